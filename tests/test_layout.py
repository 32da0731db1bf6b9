"""The package's shape: subpackages by job whose imports run one way, and the public entry points."""

import ast
import configparser
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "transformers_confu"
# Lowest first: a module may import from its own subpackage and from those before it, never after.
FLOORS = ["utils", "models", "decoding", "training", "benchmark"]


def _package_imports(source: str, here: tuple[str, ...]) -> set[str]:
    """The transformers_confu subpackages that a module in folder `here` (relative to the package) imports,
    relative or absolute, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's own folder
                base = list(here[: len(here) - (node.level - 1)])
                parts = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("transformers_confu."):
                parts = node.module.split(".")[1:]
            else:
                continue
            if parts:
                found.add(parts[0])
    return found


def _modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "checkpoints" not in p.relative_to(PACKAGE).parts]


def test_every_module_lives_in_a_subpackage():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "cli.py"], f"modules at the package top: {top}; put them in {FLOORS}"
    assert sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        FLOORS + ["checkpoints"])


@pytest.mark.parametrize("module", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(module):
    parts = module.relative_to(PACKAGE).parts
    if len(parts) == 1:  # __init__ / cli: the top may import everything
        return
    floor = FLOORS.index(parts[0])
    above = {sub for sub in _package_imports(module.read_text(), parts[:-1]) if sub in FLOORS and FLOORS.index(sub) > floor}
    assert not above, f"{'/'.join(parts)} imports from {sorted(above)}, a subpackage above {parts[0]}"


def test_import_parser_sees_every_form():
    """Negative control for the check above: upward imports in each form are found."""
    source = "from ..training.data import x\nfrom . import tree\ndef f():\n    from transformers_confu.benchmark import bench\n"
    assert _package_imports(source, ("utils",)) == {"training", "utils", "benchmark"}


def test_public_api():
    import transformers_confu

    for name in ("ConFuAssistant", "ConFuDraftConfig", "ConFuDraftModel", "SpeculativeStats", "TreeBudget",
                 "load_target", "pack_linear_weights"):
        assert callable(getattr(transformers_confu, name)), name


def test_console_scripts_resolve():
    config = configparser.ConfigParser()
    config.read(PACKAGE.parents[1] / "setup.cfg")
    scripts = [line.split("=") for line in config["options.entry_points"]["console_scripts"].split("\n") if line]
    assert {name.strip() for name, _ in scripts} >= {"confu-train", "confu-bench"}
    for _, target in scripts:
        module, function = target.strip().split(":")
        assert callable(getattr(importlib.import_module(module), function)), target
