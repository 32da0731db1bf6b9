"""Training conversations from local files (.jsonl, .json, .parquet) and Hub data sets, read with
`datasets.load_dataset` and converted by `chat_layouts`; unreadable rows are reported and skipped (or raise)."""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets

from .chat_layouts import MalformedRow, to_conversations

logger = logging.getLogger(__name__)

_STRING = datasets.Value("string")
FEATURES = datasets.Features({"messages": [{"role": _STRING, "content": _STRING}], "source": _STRING})
BUILDERS = {".jsonl": "text", ".json": "json", ".parquet": "parquet"}  # .jsonl is read line by line
HOW_TO_PASS = ("pass training data: --data FILE_OR_HUB_ID [...] (.jsonl, .json or .parquet files, folders of "
               "them, data set folders, or Hub data set ids such as org/name or org/name:split), or --data-dir FOLDER")


def find_sources(data: Sequence[str] | None = None, data_dir: str | None = None,
                 files: Sequence[str] | None = None) -> list[str]:
    """The data sources to read: `data` (files, folders, glob patterns, Hub ids) and the files of `data_dir`
    (only `files` among them if given). Raises a `ValueError` saying how to pass data when there is none."""
    sources = []
    for item in data or []:
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        if not matches:
            raise FileNotFoundError(f"No file matches {item!r}.")
        sources += [s for m in matches for s in (_folder_files(Path(m)) if _plain_folder(Path(m)) else [m])]
    if data_dir is not None:
        folder = Path(data_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"--data-dir {data_dir!r} is not a folder.")
        if files:
            missing = [name for name in files if not (folder / name).is_file()]
            if missing:
                raise FileNotFoundError(f"Not in {data_dir}: {missing}.")
            sources += [str(folder / name) for name in files]
        else:
            sources += _folder_files(folder)
    elif files:
        raise ValueError("--files names files inside --data-dir: pass --data-dir too (or the paths with --data).")
    if not sources:
        raise ValueError(f"No training data given: {HOW_TO_PASS}.")
    return sources


def load_conversations(sources: Sequence[str], on_error: str = "skip") -> datasets.Dataset:
    """Conversations (columns `messages`, `source`) from every source, in order.

    A source is a local .jsonl / .json / .parquet file, a local data set folder (a card and parquet shards,
    such as the answers dataset) or a Hub data set id (`org/name`, or `org/name:split`, default split "train"). Rows in an unknown layout or with bad fields, and unreadable .jsonl lines, are
    logged with file and line (or row) and skipped (`on_error="skip"`), or raise a `ValueError` (`"raise"`)."""
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', not {on_error!r}")
    if not sources:
        raise ValueError(f"No training data given: {HOW_TO_PASS}.")
    records = []
    for source in sources:
        name = Path(source).name if Path(source).exists() else source
        loaded, skipped = 0, 0
        for location, row in _rows(source):
            try:
                if isinstance(row, MalformedRow):
                    raise row
                conversations = to_conversations(row)
            except MalformedRow as err:
                if on_error == "raise":
                    raise ValueError(f"{name} {location}: {err}") from err
                logger.warning("skipping malformed row at %s %s: %s", name, location, err)
                skipped += 1
                continue
            records += [{"messages": m, "source": name} for m in conversations]
            loaded += len(conversations)
        logger.log(logging.WARNING if skipped else logging.INFO,
                   "%s: %d conversations loaded, %d malformed rows skipped", name, loaded, skipped)
    return datasets.Dataset.from_list(records, features=FEATURES)


def _plain_folder(path: Path) -> bool:
    """A folder of data files, read file by file (not a data set folder: a README.md card and data/*.parquet
    shards, as `answers_dataset` writes, which `datasets.load_dataset` reads as one source)."""
    return path.is_dir() and not ((path / "README.md").is_file() and any((path / "data").glob("*.parquet")))


def _folder_files(folder: Path) -> list[str]:
    found = sorted(str(p) for p in folder.iterdir() if p.suffix in BUILDERS and p.is_file())
    if not found:
        raise FileNotFoundError(f"No {'/'.join(BUILDERS)} file in {folder}.")
    return found


def _rows(source: str) -> Iterator[tuple[str, object]]:
    """(location, row) pairs of one source; an unreadable .jsonl line comes as (location, MalformedRow)."""
    path = Path(source)
    if path.is_file():
        builder = BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet.")
        table = _load(path.name, builder, data_files=str(path))
        if builder == "text":
            for number, line in enumerate(table["text"], start=1):
                if line.strip():
                    yield f"line {number}", _parse(line)
            return
    elif path.is_dir():  # a data set folder: rebuilt each time (datasets' cache of a folder misses added shards)
        table = _load(path.name, source, download_mode="force_redownload", verification_mode="no_checks")
    else:
        repo, _, split = source.partition(":")
        table = _load(source, repo, split=split or "train")
    for index, row in enumerate(table):
        yield f"row {index}", row


def _load(name: str, path: str, split: str = "train", **kwargs) -> datasets.Dataset:
    try:
        return datasets.load_dataset(path, split=split, **kwargs)
    except Exception as err:  # datasets raises many kinds: report which source and why
        cause = err.__cause__ or err
        kind = "file" if kwargs.get("data_files") else "Hub data set (or local path that does not exist)"
        raise ValueError(f"Could not read the {kind} {name!r}: {type(cause).__name__}: {cause}. "
                         "Check the path or id (and network access for Hub ids); a .json file must be a JSON "
                         "array of objects or JSON Lines (save it as .jsonl to have bad lines skipped).") from err


def _parse(line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        return MalformedRow(f"invalid JSON: {err}")
