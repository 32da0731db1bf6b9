"""Long jobs survive faults. Training, regeneration and the de-quantized target copy, on tiny models, are
killed (SIGKILL, in a subprocess: `fault_script.py`) at chosen points, inside saves included, or find their
newest checkpoint torn the ways a crash or a full disk leaves it; each rerun finishes with the result of an
uninterrupted run."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fault_script import REGENERATION, regeneration_dataset
from safetensors.torch import load_file
from test_train_cli import saved_target_and_data

from transformers_confu import ConFuAssistant
from transformers_confu.models.checkpoints import (
    checkpoint_problem,
    latest_complete_checkpoint,
)
from transformers_confu.models.contemplate import ADAPTER_FOLDER
from transformers_confu.models.target import load_target
from transformers_confu.training.regenerate import (
    RESPONSES_FILE,
    read_responses,
    regenerate_responses,
)
from transformers_confu.training.train import main
from transformers_confu.utils.atomic import staging_path

SCRIPT = Path(__file__).with_name("fault_script.py")
STEPS = 30  # 2 epochs of 15 rows in batches of 2; checkpoints every 10 steps, the last two kept


def run_until_killed(*args: str | Path, **env: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    result = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]


def cut_in_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def assert_same_weights(folder: Path, reference: Path) -> None:
    a, b = load_file(folder / "model.safetensors"), load_file(reference / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=key)


def assert_finished_like(run: Path, reference: Path) -> None:
    """`run` ended with the final draft of the uninterrupted `reference` run, and left nothing half-done."""
    record = json.loads((run / "final" / "training_record.json").read_text())
    assert record["finished"] and record["global_step"] == record["max_steps"]
    assert_same_weights(run / "final", reference / "final")
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no staging folders left


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny target and data, the confu-train arguments, and an uninterrupted run (`<root>/reference`)."""
    root = tmp_path_factory.mktemp("faults")
    target, _, data = saved_target_and_data(root, STEPS)
    argv = ["--target", str(root / "target"), "--data-dir", str(data), "--max-length", "64", "--batch-size", "2",
            "--epochs", "2",
            "--draft-vocab-size", "64", "--ttt-steps", "2", "--warmup-steps", "1", "--save-minutes", "0.01",
            "--save-dtype", "float32"]
    main(argv + ["--output-dir", str(root / "reference")])
    assert sorted(p.name for p in (root / "reference").glob("checkpoint-*")) == ["checkpoint-20", "checkpoint-30"]
    return root, argv, target


@pytest.mark.parametrize("point, resumes_from", [
    ("step:25", "checkpoint-20"),  # between two saves (resumes in the middle of epoch 2)
    ("save-weights:20", "checkpoint-10"),  # checkpoint-20's weights half written
    ("save-rename:20", "checkpoint-10"),  # checkpoint-20 whole but not renamed into place
    ("save-weights:10", None),  # the first save torn: start again from scratch
])
def test_killed_training_resumes_from_the_last_whole_checkpoint(job, tmp_path, point, resumes_from):
    root, argv, _ = job
    run = tmp_path / "run"
    run_until_killed("train", point, *argv, "--output-dir", run)
    assert latest_complete_checkpoint(run) == (resumes_from and str(run / resumes_from))
    assert not (run / "final").exists()
    main(argv + ["--output-dir", str(run)])
    assert_finished_like(run, root / "reference")


def test_killed_while_writing_final_keeps_the_previous_final(job, tmp_path):
    root, argv, target = job
    run = tmp_path / "run"
    main(argv + ["--output-dir", str(run), "--max-minutes", "0"])  # a first piece: final/ at step 1
    run_until_killed("train", "final", *argv, "--output-dir", run)
    assert json.loads((run / "final" / "training_record.json").read_text())["global_step"] == 1
    ConFuAssistant.from_pretrained(run / "final", target_model=target)  # the previous final/, whole
    main(argv + ["--output-dir", str(run)])  # resumes from checkpoint-30: only final/ is written
    assert_finished_like(run, root / "reference")


def _half_weights(folder: Path) -> None:
    cut_in_half(folder / "model.safetensors")


def _no_optimizer(folder: Path) -> None:
    (folder / "optimizer.pt").unlink()


def _empty_rng_state(folder: Path) -> None:  # a full disk: the file was created, nothing written
    (folder / "rng_state.pth").write_bytes(b"")


def _half_trainer_state(folder: Path) -> None:
    cut_in_half(folder / "trainer_state.json")


def _empty_folder(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.mkdir()


@pytest.mark.parametrize("corrupt, problem", [
    (_half_weights, "model.safetensors is cut short"),
    (_no_optimizer, "optimizer.pt is missing"),
    (_empty_rng_state, "rng_state.pth is empty"),
    (_half_trainer_state, "trainer_state.json is not valid JSON"),
    (_empty_folder, "the folder is empty"),
])
def test_torn_newest_checkpoint_is_skipped_with_a_warning(job, tmp_path, caplog, corrupt, problem):
    root, argv, _ = job
    run = tmp_path / "run"
    shutil.copytree(root / "reference", run, ignore=shutil.ignore_patterns("final"))
    corrupt(run / "checkpoint-30")
    with caplog.at_level(logging.WARNING, logger="transformers_confu.models.checkpoints"):
        main(argv + ["--output-dir", str(run)])
    assert f"Skipping checkpoint {run / 'checkpoint-30'}: {problem}" in caplog.text
    assert_finished_like(run, root / "reference")
    assert checkpoint_problem(run / "checkpoint-30") is None  # saved again, whole


def test_confu_checkpoint_without_its_adapter_is_skipped(job, tmp_path, caplog):
    root, argv, _ = job
    confu = argv + ["--init-from", str(root / "reference" / "final"), "--contemplate", "--soft-tokens", "4",
                    "--con-experts", "4", "--max-samples", "22"]  # 2 x 11 steps: checkpoint-20 and -22 kept
    main(confu + ["--output-dir", str(tmp_path / "reference")])
    run = tmp_path / "run"
    shutil.copytree(tmp_path / "reference", run, ignore=shutil.ignore_patterns("final"))
    (run / "checkpoint-22" / ADAPTER_FOLDER / "model.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="transformers_confu.models.checkpoints"):
        main(confu + ["--output-dir", str(run)])
    assert f"{ADAPTER_FOLDER}/model.safetensors is missing" in caplog.text
    assert_finished_like(run, tmp_path / "reference")
    assert_same_weights(run / "final" / ADAPTER_FOLDER, tmp_path / "reference" / "final" / ADAPTER_FOLDER)


def test_killed_regeneration_gives_the_records_of_one_run(tmp_path):
    from conftest import chat_tokenizer
    from test_data import _tiny_chat_model

    tokenizer = chat_tokenizer()
    _tiny_chat_model(tokenizer).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    model, tokenizer = load_target(str(tmp_path / "target"))
    reference = regenerate_responses(regeneration_dataset(), model, tokenizer, tmp_path / "reference", **REGENERATION)
    assert len(reference) == 8
    run = tmp_path / "run"
    answers = run / RESPONSES_FILE

    run_until_killed("regenerate", "answer:5", tmp_path / "target", run)  # four answers written, the fifth made
    assert len(read_responses(answers)) == 4
    run_until_killed("regenerate", "write:4", tmp_path / "target", run)  # three more written, the fourth half
    assert not answers.read_text().endswith("\n")  # a torn last line
    assert len(read_responses(answers)) == 7

    again = regenerate_responses(regeneration_dataset(), model, tokenizer, run, **REGENERATION)
    assert again.to_list() == reference.to_list()
    for line in answers.read_text().splitlines():
        json.loads(line)  # the torn line was cut before appending
    responses = {k: r["response"] for k, r in read_responses(answers).items()}
    assert responses == {k: r["response"] for k, r in read_responses(tmp_path / "reference" / RESPONSES_FILE).items()}


def test_killed_while_writing_the_dequantized_target_copy(tmp_path, monkeypatch):
    from conftest import tiny_target, tiny_tokenizer

    from transformers_confu.models import target as target_module

    tiny = tmp_path / "tiny"
    tiny_target().save_pretrained(tiny)
    tiny_tokenizer().save_pretrained(tiny)
    run_until_killed("target", "write", tiny, CONFU_CACHE=str(tmp_path / "cache"))
    monkeypatch.setenv("CONFU_CACHE", str(tmp_path / "cache"))
    copy = target_module._dequantized_copy()
    assert not copy.exists() and staging_path(copy).is_dir()  # only the half-written staging folder
    built = []
    monkeypatch.setattr(target_module, "_dequantize_gguf", lambda: built.append(1) or load_target(str(tiny))[::-1])
    target_module.load_target()
    model, _ = target_module.load_target()  # from the copy
    assert built == [1]
    assert sorted(p.name for p in copy.parent.iterdir()) == [copy.name, f"{copy.name}.lock"]
    reference, _ = load_target(str(tiny))
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value)
