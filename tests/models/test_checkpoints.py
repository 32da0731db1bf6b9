"""Atomic folders, completeness checks, choosing the checkpoint to resume, the de-quantized target copy."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import tiny_target, tiny_tokenizer
from safetensors.torch import save_file

from transformers_confu.models import target as target_module
from transformers_confu.models.checkpoints import (
    file_problem,
    folder_problem,
    latest_complete_checkpoint,
)
from transformers_confu.utils.atomic import atomic_dir, publish_dir, staging_path


def test_atomic_dir_replaces_the_folder_only_when_complete(tmp_path):
    path = tmp_path / "final"
    with atomic_dir(path) as folder:
        (folder / "a.txt").write_text("old")
        assert not path.exists()
    with pytest.raises(RuntimeError), atomic_dir(path) as folder:
        (folder / "a.txt").write_text("new, half written")
        raise RuntimeError("killed")
    assert (path / "a.txt").read_text() == "old" and not staging_path(path).exists()
    staging_path(path).mkdir()
    (staging_path(path) / "junk").write_text("left by a kill")
    with atomic_dir(path) as folder:
        assert not any(folder.iterdir())  # the leftover staging folder was cleared
        (folder / "b.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert [p.name for p in path.iterdir()] == ["b.txt"]


def test_publish_dir_after_a_kill_between_its_renames(tmp_path):
    """A kill after moving the old folder aside leaves `.final.old`; the next publish cleans it up."""
    (tmp_path / ".final.old").mkdir()
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "x").write_text("1")
    publish_dir(staged, tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_file_problem_tells_whole_files_from_torn_ones(tmp_path):
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, weights)
    assert file_problem(weights) is None
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-10])
    assert file_problem(weights) == f"model.safetensors is cut short ({len(whole) - 10} of {len(whole)} bytes)"
    weights.write_bytes(whole[:5])
    assert file_problem(weights) == "model.safetensors is cut short (its header is incomplete)"
    weights.write_bytes(whole + b"\0")
    assert file_problem(weights) == "model.safetensors has 1 bytes more than its header describes"
    weights.write_bytes(b"")
    assert file_problem(weights) == "model.safetensors is empty"
    state = tmp_path / "optimizer.pt"
    torch.save({"x": torch.ones(3)}, state)
    assert file_problem(state) is None
    os.truncate(state, state.stat().st_size - 1)
    assert file_problem(state) == "optimizer.pt is cut short (not a complete torch.save archive)"
    (tmp_path / "config.json").write_text('{"a": ')
    assert file_problem(tmp_path / "config.json").startswith("config.json is not valid JSON")
    assert file_problem(tmp_path / "nothing.json") == "nothing.json is missing"
    assert folder_problem(tmp_path / "none", []) == "the folder is missing"


def test_latest_complete_checkpoint_skips_torn_ones_and_ignores_other_folders(tmp_path, caplog):
    from test_trainer import make_trainer

    make_trainer(tmp_path, save_strategy="steps", save_steps=1, max_steps=3, save_total_limit=5).train()
    assert latest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-3" / "scheduler.pt").unlink()
    (tmp_path / "checkpoint-2").rename(tmp_path / "checkpoint-2.bak")  # not a checkpoint name
    (tmp_path / "checkpoint-9").write_text("a file, not a folder")
    with caplog.at_level(logging.WARNING, logger="transformers_confu.models.checkpoints"):
        assert latest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1")
    assert f"Skipping checkpoint {tmp_path / 'checkpoint-3'}: scheduler.pt is missing" in caplog.text
    assert latest_complete_checkpoint(tmp_path / "absent") is None


def test_first_load_of_the_default_target_reads_the_copy_it_wrote(tmp_path, monkeypatch):
    """The load that builds the de-quantized copy returns the model and tokenizer as later loads do: read from the
    copy, which they name as their `name_or_path` (where a suffix corpus check finds the tokenizer), not the GGUF's
    folder."""
    from transformers_confu.decoding.suffix import target_tokenizer

    monkeypatch.setenv("CONFU_CACHE", str(tmp_path))
    monkeypatch.setattr(target_module, "_dequantize_gguf", lambda: (tiny_tokenizer(), tiny_target()))
    model, tokenizer = target_module.load_target()
    copy = str(target_module._dequantized_copy())
    assert model.config.name_or_path == copy and tokenizer.name_or_path == copy
    assert target_tokenizer(model).get_vocab() == tokenizer.get_vocab()


def test_torn_dequantized_target_copy_is_rebuilt(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CONFU_CACHE", str(tmp_path))
    built = []

    def dequantize():  # stands in for reading the GGUF
        built.append(1)
        return tiny_tokenizer(), tiny_target()

    monkeypatch.setattr(target_module, "_dequantize_gguf", dequantize)
    model, _ = target_module.load_target()
    copy = target_module._dequantized_copy()
    assert built == [1] and sorted(p.name for p in tmp_path.iterdir()) == [copy.name, f"{copy.name}.lock"]
    target_module.load_target()
    assert built == [1]  # a complete copy is loaded, not rebuilt
    weights = copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a crash while writing the copy
    with caplog.at_level(logging.WARNING, logger="transformers_confu.models.target"):
        target_module.load_target()
    assert built == [1, 1] and "model.safetensors is cut short" in caplog.text
    reloaded, _ = target_module.load_target()
    assert built == [1, 1]
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value)
    assert json.loads((copy / "config.json").read_text())["model_type"] == "llama"
