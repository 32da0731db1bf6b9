"""Is a saved folder complete? Checks for files, draft folders and `Trainer` checkpoints, and the choice
of the checkpoint to resume: the newest complete one, saying which newer ones were skipped and why.

A kill or a full disk while saving leaves files cut short, missing or empty; these checks read only
what tells them apart from whole files (a safetensors header, a zip archive's end record, JSON), so
they are cheap even for large checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path

from transformers.trainer import (
    OPTIMIZER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    TRAINING_ARGS_NAME,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME

from .contemplate import ADAPTER_FOLDER

logger = logging.getLogger(__name__)

DRAFT_FILES = (CONFIG_NAME, SAFE_WEIGHTS_NAME)
ADAPTER_FILES = (f"{ADAPTER_FOLDER}/{CONFIG_NAME}", f"{ADAPTER_FOLDER}/{SAFE_WEIGHTS_NAME}")
TRAINER_FILES = (TRAINER_STATE_NAME, OPTIMIZER_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME)
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def file_problem(path: str | os.PathLike) -> str | None:
    """Why the file at `path` is not whole, or None: missing, empty, or (by its suffix) a `.safetensors`
    file whose size does not match its header, a `.json` file that does not parse, or a `torch.save`
    archive (`.pt`, `.pth`, `.bin`) without its end record."""
    return _file_problem(Path(path), Path(path).name)


def folder_problem(folder: str | os.PathLike, files: Iterable[str]) -> str | None:
    """Why `folder` is not complete, or None: it is missing or empty, or one of `files` (paths relative to
    it) has a `file_problem`."""
    folder = Path(folder)
    if not folder.is_dir():
        return "the folder is missing"
    if not any(folder.iterdir()):
        return "the folder is empty"
    return next((problem for name in files if (problem := _file_problem(folder / name, name))), None)


def draft_problem(folder: str | os.PathLike) -> str | None:
    """Why `folder` is not a complete draft, or None: `config.json`, `model.safetensors` and, for a ConFu
    draft (`contemplate` in its config), `contemplate_adapter/`."""
    problem = folder_problem(folder, DRAFT_FILES)
    if problem is None and json.loads((Path(folder) / CONFIG_NAME).read_text()).get("contemplate"):
        adapter = folder_problem(folder, ADAPTER_FILES)
        problem = adapter and f"{adapter} (the contemplate adapter)"
    return problem


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why `folder` is not a complete `ConFuTrainer` checkpoint, or None: a complete draft, the trainer
    state, optimizer, scheduler, training arguments and RNG state(s)."""
    problem = draft_problem(folder) or folder_problem(folder, TRAINER_FILES)
    if problem is None:
        rng = sorted(p.name for p in Path(folder).glob("rng_state*.pth"))
        problem = folder_problem(folder, rng) if rng else "rng_state.pth is missing"
    return problem


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete `checkpoint-N` folder in `output_dir` (None if there is none). Each newer one
    that is not complete is skipped with a warning naming it and its problem."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()]
    for _, folder in sorted(steps, reverse=True):
        problem = checkpoint_problem(folder)
        if problem is None:
            return str(folder)
        logger.warning("Skipping checkpoint %s: %s (cut by a kill or a full disk while saving?); "
                       "resuming from an earlier one if there is one.", folder, problem)
    return None


def _file_problem(path: Path, name: str) -> str | None:
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size == 0:
        return f"{name} is empty"
    if path.suffix == ".safetensors":
        return _safetensors_problem(path, name, size)
    if path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"{name} is not valid JSON ({err})"
    if path.suffix in (".pt", ".pth", ".bin") and not zipfile.is_zipfile(path):
        return f"{name} is cut short (not a complete torch.save archive)"
    return None


def _safetensors_problem(path: Path, name: str, size: int) -> str | None:
    with path.open("rb") as file:
        head = file.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else size
        if 8 + length > size:
            return f"{name} is cut short (its header is incomplete)"
        try:
            header = json.loads(file.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, IndexError):
            return f"{name} has an unreadable header"
    expected = 8 + length + end
    if size != expected:
        return f"{name} is cut short ({size} of {expected} bytes)" if size < expected else (
            f"{name} has {size - expected} bytes more than its header describes")
    return None
