"""Checks on the committed files themselves (what `git ls-files` lists)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Records of runs: results, model cards, the shipped checkpoints' records. Their paths must be relative.
RECORDS = ("results/", "model_cards/", "src/transformers_confu/checkpoints/")
# A path starts at the line start, after a space, quote, backtick, "=" or "(" (not inside a URL, a relative
# path or a word such as "tokens/s").
_START = r"(?<![\w.~:/\\-])"
HOME = re.compile(_START + r"/(?:root|home/[^/\s]+|Users/[^/\s]+)/")
ABSOLUTE = re.compile(_START + r"/[A-Za-z_][\w.-]*/")
SELF = "tests/test_repository.py"  # holds examples of what the rule flags


def tracked_text_files() -> dict[str, str]:
    """Every git-tracked file that is text (no NUL byte, UTF-8), by repository path."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = {}
    for name in filter(None, names.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" not in data:
            files[name] = data.decode("utf-8", errors="replace")
    return files


def checkout_prefixes() -> list[str]:
    """This checkout's absolute folder and the folders above it (not `/`, not the temp folder): `/a/b/repo/`, `/a/b/`,
    `/a/`."""
    temp = Path(tempfile.gettempdir()).resolve()
    return [f"{folder}/" for folder in [ROOT, *ROOT.parents] if folder != Path(folder.anchor) and folder != temp]


def machine_paths(name: str, text: str, prefixes: list[str]) -> list[str]:
    """The machine paths `text` names: a home folder (`/root/`, `/home/<user>/`, `/Users/<user>/`) or this
    checkout's location (or a folder above it) anywhere; in a record (`RECORDS`), any absolute path at all."""
    found = [m.group() for m in HOME.finditer(text)]
    found += [p for p in prefixes if re.search(_START + re.escape(p), text)]
    if name.startswith(RECORDS):
        found += [m.group() for m in ABSOLUTE.finditer(text)]
    return sorted(set(found))


def test_no_committed_text_file_names_a_machine_path():
    """The rule: no tracked text file names a home folder or where this checkout lives, and no record of a
    run (results, model cards, checkpoint records) names an absolute path: commands are recorded as typed,
    with paths relative to the repository. Other files may name system folders in examples (`/tmp/...` as a
    scratch folder in a script or a test, `/dev/null`): those are the same on every machine."""
    prefixes = checkout_prefixes()
    bad = {name: paths for name, text in tracked_text_files().items()
           if name != SELF and (paths := machine_paths(name, text, prefixes))}
    assert not bad, f"machine paths committed (record them relative to the repository): {bad}"


@pytest.mark.parametrize("name, text, flagged", [
    ("examples/run.sh", "stage=/root/stage", ["/root/"]),
    ("docs/x.md", "see /home/alice/data and /Users/bob/x", ["/Users/bob/", "/home/alice/"]),
    ("docs/x.md", "out=/tmp/scratch; cat /dev/null; https://host/root/x; runs/a/b; 12 tokens/s", []),
    ("results/x.json", '"command": "confu-bench --out /tmp/bench"', ["/tmp/"]),
    ("results/x.md", "`confu-bench --questions data/q.jsonl --out results/x` at 3.2 tokens/s", []),
    ("src/transformers_confu/checkpoints/d/training_record.json", '"data": "/data/train"', ["/data/"]),
])
def test_machine_path_rule(name, text, flagged):
    assert machine_paths(name, text, []) == flagged


def test_the_checkout_location_is_flagged():
    prefixes = checkout_prefixes()
    assert f"{ROOT}/" in prefixes
    assert machine_paths("README.md", f"python {ROOT}/examples/quickstart.py", prefixes)
