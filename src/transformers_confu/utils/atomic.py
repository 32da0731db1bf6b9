"""Writing a folder or a JSON file all at once: a kill at any instant leaves the old one or the new one complete.

Long jobs (training checkpoints, the final draft, the de-quantized target) write into a staging folder
beside the destination, sync it to disk, and rename it into place. A rename is atomic on POSIX file
systems, so the destination name never points at a half-written folder. Their small state files
(`write_json_atomic`) and the settings a directory of results was made with (`pin_settings`) go the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def staging_path(path: str | os.PathLike) -> Path:
    """The hidden folder beside `path` that `atomic_dir` writes into before renaming it to `path`."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def fsync_tree(folder: str | os.PathLike) -> None:
    """Flush every file and folder under `folder` to disk (a machine that stops loses nothing written)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as file:
                os.fsync(file.fileno())
        _fsync_dir(root)


def publish_dir(staged: str | os.PathLike, path: str | os.PathLike) -> None:
    """Sync the complete folder `staged` to disk and rename it to `path`, replacing an existing `path`.

    An existing `path` is first renamed aside (to `.<name>.old`) and removed once the new one is in place;
    a kill between those two renames leaves no `path` but both complete copies beside it.
    """
    staged, path = Path(staged), Path(path)
    fsync_tree(staged)
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.rename(path, old)
    os.rename(staged, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder to write the folder `path` into; it becomes `path` when the block ends.

    On an error the staging folder is removed and `path` is left as it was; a staging folder left by a
    kill is removed by the next call. One writer per `path` at a time.

        with atomic_dir(out / "final") as folder:
            model.save_pretrained(folder)
    """
    staged = staging_path(path)
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    try:
        yield staged
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    publish_dir(staged, path)


def write_json_atomic(path: str | os.PathLike, obj: dict) -> None:
    """Write `obj` as JSON so that a kill leaves the old or the new file, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as file:
        file.write(json.dumps(obj, indent=2))
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def pin_settings(directory: str | os.PathLike, settings: dict, mismatch: str, remedy: str) -> None:
    """Record `settings` in `directory/settings.json` on first use; later, raise a `ValueError` when they differ
    (`mismatch`, the fields that differ, then `remedy`): results made with other settings are never reused."""
    path = Path(directory) / "settings.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != settings:
            diff = ", ".join(f"{k}: {saved.get(k)} there, {v} now" for k, v in settings.items() if saved.get(k) != v)
            raise ValueError(f"{mismatch} ({diff}). {remedy}")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, settings)


def _fsync_dir(folder: str | os.PathLike) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
