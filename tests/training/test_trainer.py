"""ConFuTrainer on tiny random targets: learning, checkpoints, exact resume, target checks, 2-process DDP."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_ttt import tiny_batch, tiny_draft, tiny_target
from transformers import TrainingArguments, default_data_collator

from transformers_confu import ConFuDraftModel
from transformers_confu.training.trainer import ConFuTrainer
from transformers_confu.training.training_args import ConFuTrainingArguments
from transformers_confu.training.ttt import draft_vocab_logits, target_hidden, teacher_logits

RESUME_STEPS = 4


def tiny_dataset(size: int = 8) -> list[dict[str, torch.Tensor]]:
    """`size` random sequences; every other one right-padded by 3 tokens."""
    batch = tiny_batch(batch=size, seed=3)
    batch["attention_mask"][::2, -3:] = 0
    batch["loss_mask"][::2, -3:] = 0
    return [{key: value[i] for key, value in batch.items()} for i in range(size)]


def make_trainer(output_dir: Path, family: str = "llama", **overrides) -> ConFuTrainer:
    settings = dict(
        output_dir=str(output_dir), max_steps=RESUME_STEPS, per_device_train_batch_size=2,
        learning_rate=3e-3, warmup_steps=1, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, ttt_steps=3,
    )
    target = tiny_target(family)
    return ConFuTrainer(
        model=tiny_draft(target, seed=7),
        target_model=target,
        args=ConFuTrainingArguments(**{**settings, **overrides}),
        train_dataset=tiny_dataset(),
        data_collator=default_data_collator,
    )


def draft_weights(trainer: ConFuTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=key)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """4 uninterrupted steps with a checkpoint after step 2; returns (output_dir, final weights)."""
    output_dir = tmp_path_factory.mktemp("run")
    trainer = make_trainer(output_dir, save_strategy="steps", save_steps=2)
    trainer.train()
    return output_dir, draft_weights(trainer)


def test_training_lowers_the_loss_and_logs_step_accuracies(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=40, learning_rate=1e-2, logging_steps=10)
    trainer.eval_dataset = tiny_dataset()
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < 0.8 * before
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert train_logs[-1]["loss"] < train_logs[0]["loss"]
    assert all(0 <= log[f"ttt_acc_{i}"] <= 1 for log in train_logs for i in range(3))
    assert train_logs[-1]["ttt_acc_0"] > train_logs[0]["ttt_acc_0"]


def test_bf16_mixed_precision_on_cpu_trains_float32_weights_with_bfloat16_matmuls(tmp_path):
    """`bf16=True` on a CPU: the draft's linear layers compute in bfloat16 (autocast), its weights stay float32
    and learn, and the float32 target's features and soft labels are computed in float32 (as when decoding)."""
    trainer = make_trainer(tmp_path, max_steps=30, learning_rate=1e-2, logging_steps=10, bf16=True)
    draft = trainer.model
    seen: list[torch.dtype] = []
    draft.fc.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    trainer.train()
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert train_logs[-1]["loss"] < train_logs[0]["loss"]
    target, batch = trainer.target_model, tiny_dataset(2)
    ids, mask = torch.stack([r["input_ids"] for r in batch]), torch.stack([r["attention_mask"] for r in batch])
    hidden = torch.randn(4, target.config.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        labels = teacher_logits(target, hidden, draft.d2t)
        features, last = target_hidden(target, ids, mask, draft.config.feature_layers)
    assert labels.dtype == features.dtype == torch.float32
    torch.testing.assert_close(labels, draft_vocab_logits(target, hidden, draft.d2t))
    torch.testing.assert_close(features, target_hidden(target, ids, mask, draft.config.feature_layers)[0])


def test_target_is_frozen_and_not_trained(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1)
    before = {k: v.clone() for k, v in trainer.target_model.state_dict().items()}
    trainer.train()
    assert not trainer.target_model.training
    assert not any(p.requires_grad for p in trainer.target_model.parameters())
    assert_same_weights(before, trainer.target_model.state_dict())


def test_checkpoint_holds_only_the_draft(saved_run):
    output_dir, _ = saved_run
    checkpoint = output_dir / "checkpoint-2"
    weight_files = {p.name for p in checkpoint.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")}
    assert weight_files == {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"}
    assert (checkpoint / "config.json").is_file()

    loaded = ConFuDraftModel.from_pretrained(checkpoint)
    with safe_open(checkpoint / "model.safetensors", "pt") as file:
        assert set(file.keys()) == set(loaded.state_dict())  # no target weights (embed_tokens, layers, ...)
    assert not any("embed" in key for key in loaded.state_dict())


def test_from_pretrained_loads_the_trained_draft(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.train()
    trainer.save_model(tmp_path / "final")
    loaded = ConFuDraftModel.from_pretrained(tmp_path / "final")
    assert_same_weights(draft_weights(trainer), loaded.state_dict())
    assert torch.equal(loaded.d2t, trainer.model.d2t)


def test_resume_from_checkpoint_is_exact(saved_run, tmp_path):
    output_dir, final = saved_run
    trainer = make_trainer(tmp_path)
    trainer.train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))
    assert trainer.state.global_step == RESUME_STEPS
    assert_same_weights(final, draft_weights(trainer))


def test_max_minutes_saves_stops_and_resumes_exactly(saved_run, tmp_path):
    _, final = saved_run
    stopped = make_trainer(tmp_path, max_minutes=0)
    stopped.train()
    assert stopped.state.global_step == 1
    assert (tmp_path / "checkpoint-1" / "model.safetensors").is_file()

    resumed = make_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert_same_weights(final, draft_weights(resumed))


def test_checkpoints_are_renamed_into_place_complete(saved_run):
    from transformers_confu.models.checkpoints import checkpoint_problem

    output_dir, _ = saved_run
    assert sorted(p.name for p in output_dir.iterdir()) == ["checkpoint-2", "checkpoint-4"]  # no staging left
    assert checkpoint_problem(output_dir / "checkpoint-2") is None


def test_resume_from_a_torn_checkpoint_raises_a_clear_error(saved_run, tmp_path):
    output_dir, _ = saved_run
    shutil.copytree(output_dir / "checkpoint-2", tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-2" / "optimizer.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="Cannot resume from .*checkpoint-2: optimizer.pt is empty.*=True"):
        make_trainer(tmp_path / "run").train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_best_checkpoint_is_tracked_under_its_final_name(tmp_path):
    args = dict(output_dir=str(tmp_path), max_steps=RESUME_STEPS, per_device_train_batch_size=2, learning_rate=3e-3,
                save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2, report_to="none",
                metric_for_best_model="loss", load_best_model_at_end=True, use_cpu=True, ttt_steps=3)
    target = tiny_target()
    trainer = ConFuTrainer(model=tiny_draft(target), target_model=target, args=ConFuTrainingArguments(**args),
                           train_dataset=tiny_dataset(), eval_dataset=tiny_dataset(), data_collator=default_data_collator)
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    assert best.parent == tmp_path and best.is_dir()
    saved = json.loads((best / "trainer_state.json").read_text())["best_model_checkpoint"]
    assert saved == str(best)


def test_resume_with_another_target_raises(saved_run, tmp_path):
    output_dir, _ = saved_run
    trainer = make_trainer(tmp_path, family="qwen2")
    with pytest.raises(ValueError, match="Cannot resume .* different target"):
        trainer.train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))


def test_needs_confu_training_arguments(tmp_path):
    target = tiny_target()
    with pytest.raises(TypeError, match="ConFuTrainingArguments"):
        ConFuTrainer(model=tiny_draft(target), target_model=target, args=TrainingArguments(str(tmp_path)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(shutil.which("accelerate", path=os.path.dirname(sys.executable)) is None,
                    reason="accelerate launcher not installed")
def test_two_process_ddp_training(tmp_path):
    """2 CPU processes (gloo): training finishes, saves, and both ranks end with the same weights."""
    from transformers_confu.models.checkpoints import checkpoint_problem

    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    script = Path(__file__).with_name("ddp_train_script.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # `--multi_gpu` picks accelerate's torchrun launcher; the script's `use_cpu=True` makes it gloo on CPU.
    command = [
        accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(script), str(tmp_path),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name for p in (tmp_path / "checkpoint-3").glob("rng_state*")} == {"rng_state_0.pth", "rng_state_1.pth"}
    assert checkpoint_problem(tmp_path / "checkpoint-3") is None  # both ranks wrote, then it was renamed
    assert (tmp_path / "weights_in_sync").read_text() == "world_size=2 in_sync=True"
    ConFuDraftModel.from_pretrained(tmp_path / "checkpoint-3")
