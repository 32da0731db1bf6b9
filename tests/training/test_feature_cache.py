"""The feature cache (target outputs kept on disk), draft init from the target, vocabulary coverage and the
full-vocabulary accuracy: training from the cache equals training with the target in the loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from test_ttt import VOCAB, tiny_batch, tiny_draft, tiny_target

import transformers_confu.training.feature_cache as feature_cache
from transformers_confu.training.data import DataCollatorForDraft, vocab_coverage
from transformers_confu.training.feature_cache import build_feature_cache
from transformers_confu.training.trainer import ConFuTrainer
from transformers_confu.training.training_args import ConFuTrainingArguments
from transformers_confu.training.ttt import target_argmax, target_hidden, ttt_loss


def tiny_rows(size: int = 6) -> datasets.Dataset:
    batch = tiny_batch(batch=size, seed=5)
    rows = {"input_ids": [], "loss_mask": []}
    for i in range(size):
        n = 12 - (i % 3)  # ragged lengths
        rows["input_ids"].append(batch["input_ids"][i, :n].tolist())
        rows["loss_mask"].append(batch["loss_mask"][i, :n].tolist())
    return datasets.Dataset.from_dict(rows)


def test_cache_holds_the_target_outputs_and_resumes_without_recomputing(tmp_path, monkeypatch):
    target, rows = tiny_target(), tiny_rows()
    layers = [2, 2, 4]
    cached = build_feature_cache(rows, target, layers, tmp_path, batch_size=4, shard_rows=4, dtype="float32")
    assert len(cached) == len(rows) and len(list(tmp_path.glob("shard-*.arrow"))) == 2
    row = cached.with_format("torch")[1]
    ids = torch.tensor([rows[1]["input_ids"]])
    features, last_hidden = target_hidden(target, ids, torch.ones_like(ids), layers)
    torch.testing.assert_close(row["features"], features[0], atol=1e-4, rtol=1e-4)  # batched with padding
    torch.testing.assert_close(row["last_hidden"], last_hidden[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(row["target_ids"], target_argmax(target, last_hidden)[0])
    calls = []
    monkeypatch.setattr(feature_cache, "target_hidden", lambda *a, **k: calls.append(1) or target_hidden(*a, **k))
    again = build_feature_cache(rows, target, layers, tmp_path, batch_size=4, shard_rows=4, dtype="float32")
    assert calls == [] and again["input_ids"] == cached["input_ids"]
    (tmp_path / "shard-00001-of-00002.arrow").unlink()  # a shard lost: only it is rebuilt
    build_feature_cache(rows, target, layers, tmp_path, batch_size=4, shard_rows=4, dtype="float32")
    assert len(calls) == 1


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_torn_shard_is_rebuilt_with_a_warning(tmp_path, caplog, damage):
    target, rows = tiny_target(), tiny_rows()
    whole = build_feature_cache(rows, target, [2, 2, 4], tmp_path / "whole", shard_rows=4, dtype="float32")
    build_feature_cache(rows, target, [2, 2, 4], tmp_path / "torn", shard_rows=4, dtype="float32")
    shard = tmp_path / "torn" / "shard-00000-of-00002.arrow"
    if damage == "truncated":
        os.truncate(shard, shard.stat().st_size * 2 // 3)
    else:
        shard.write_bytes(b"" if damage == "empty" else b"not an arrow stream" * 10)
    again = build_feature_cache(rows, target, [2, 2, 4], tmp_path / "torn", shard_rows=4, dtype="float32")
    assert "rebuilding feature-cache shard shard-00000-of-00002.arrow" in caplog.text
    for key in ("input_ids", "features", "target_ids"):
        assert again[key] == whole[key]


def test_killed_cache_build_resumes_to_the_same_cache(tmp_path):
    """SIGKILL inside the second shard's computation (in a subprocess); the rerun gives the uninterrupted cache."""
    script = (
        "import os, signal, sys; sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]\n"
        "import transformers_confu.training.feature_cache as fc\n"
        "from test_feature_cache import tiny_rows, tiny_target\n"
        "compute, calls = fc._compute, []\n"
        "def dying(*a):\n"
        "    inner = compute(*a)\n"
        "    def run(batch):\n"
        "        calls.append(1)\n"
        "        if len(calls) == 2: os.kill(os.getpid(), signal.SIGKILL)\n"
        "        return inner(batch)\n"
        "    return run\n"
        "fc._compute = dying\n"
        "fc.build_feature_cache(tiny_rows(), tiny_target(), [2, 2, 4], sys.argv[2], batch_size=4, shard_rows=4)\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "run")],
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == -signal.SIGKILL
    assert len(list((tmp_path / "run").glob("shard-*.arrow"))) == 1  # the first shard only; no torn second one
    again = build_feature_cache(tiny_rows(), tiny_target(), [2, 2, 4], tmp_path / "run", batch_size=4, shard_rows=4)
    whole = build_feature_cache(tiny_rows(), tiny_target(), [2, 2, 4], tmp_path / "whole", batch_size=4, shard_rows=4)
    for key in ("input_ids", "features", "last_hidden", "target_ids"):
        assert again[key] == whole[key]


def test_cache_time_box_returns_finished_shards(tmp_path, monkeypatch):
    clock = iter(range(0, 10**6, 25))  # each reading of the clock is 25 s later
    monkeypatch.setattr(feature_cache, "monotonic", lambda: next(clock))
    partial = build_feature_cache(tiny_rows(), tiny_target(), [2, 2, 4], tmp_path, shard_rows=2, max_minutes=1)
    assert len(partial) == 4  # two shards fit in the minute, the third does not start
    full = build_feature_cache(tiny_rows(), tiny_target(), [2, 2, 4], tmp_path, shard_rows=2)
    assert len(full) == 6 and full["input_ids"][:4] == partial["input_ids"]


@pytest.mark.parametrize("change", ["target", "layers", "data", "dtype"])
def test_cache_built_for_something_else_is_refused(tmp_path, change):
    target, rows, layers, dtype = tiny_target(), tiny_rows(), [2, 2, 4], "float16"
    build_feature_cache(rows, target, layers, tmp_path, shard_rows=4, dtype=dtype)
    if change == "target":
        target = tiny_target(seed=9)
    elif change == "layers":
        layers = [1, 2, 4]
    elif change == "data":
        rows = rows.select(range(5))
    else:
        dtype = "float32"
    with pytest.raises(ValueError, match="built for something else"):
        build_feature_cache(rows, target, layers, tmp_path, shard_rows=4, dtype=dtype)


def _trainer(tmp_path, dataset, collator, target):
    args = ConFuTrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=3, learning_rate=3e-3, warmup_steps=1,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, ttt_steps=2,
    )
    return ConFuTrainer(model=tiny_draft(target, seed=7), target_model=target, args=args, train_dataset=dataset,
                        data_collator=collator)


def test_training_from_the_cache_equals_training_with_the_target(tmp_path):
    target, rows = tiny_target(), tiny_rows()
    layers = tiny_draft(target).config.feature_layers
    cached = build_feature_cache(rows, target, layers, tmp_path / "cache", shard_rows=4, dtype="float32")
    collator = DataCollatorForDraft(pad_token_id=0)
    live = _trainer(tmp_path / "a", rows, collator, target)
    live.train()
    from_cache = _trainer(tmp_path / "b", cached.with_format("torch"), collator, target)
    from_cache.train()
    for key, value in live.model.state_dict().items():
        torch.testing.assert_close(from_cache.model.state_dict()[key], value, atol=1e-5, rtol=1e-4, msg=key)
    logs = [log for log in from_cache.state.log_history if "loss" in log]
    assert all(0 <= log["ttt_full_acc_1"] <= log["ttt_acc_1"] + 1e-9 for log in logs)


def test_full_vocabulary_accuracy_counts_tokens_outside_the_draft_vocabulary():
    target = tiny_target()
    draft = tiny_draft(target)
    batch = tiny_batch()
    features, last_hidden = target_hidden(target, batch["input_ids"], batch["attention_mask"], draft.config.feature_layers)
    greedy = target_argmax(target, last_hidden)
    logits = torch.nn.functional.linear(last_hidden, target.lm_head.weight[draft.d2t])
    _, metrics = ttt_loss(draft, features, logits, **batch, steps=1, target_ids=greedy)
    in_vocab = draft.t2d[greedy[:, 1:]]  # the teacher positions of step 0
    assert not in_vocab.all()  # the draft vocabulary misses some greedy tokens ...
    assert metrics["full_acc_0"] <= metrics["acc_0"]  # ... which the full-vocabulary accuracy counts as misses
    draft.set_vocab_map(torch.arange(VOCAB)[: draft.config.draft_vocab_size])
    _, same = ttt_loss(draft, features, logits, **batch, steps=1, target_ids=draft.d2t[logits.argmax(-1)])
    assert same["full_acc_0"] == same["acc_0"]  # teacher argmax inside the vocabulary: both agree


def test_init_from_target_copies_head_rows_norm_and_layer():
    target = tiny_target()
    draft = tiny_draft(target)
    before = draft.self_attn.q_proj.weight.detach().clone()
    draft.init_from_target(target, ("head", "norm", "fc", "layer"))
    features = torch.randn(2, 3 * target.config.hidden_size)
    torch.testing.assert_close(draft.fc(features), features[:, -target.config.hidden_size:])
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight[draft.d2t])
    torch.testing.assert_close(draft.norm.weight, target.model.norm.weight)
    last = target.model.layers[-1]
    torch.testing.assert_close(draft.mlp.down_proj.weight, last.mlp.down_proj.weight)
    hidden = target.config.hidden_size
    torch.testing.assert_close(draft.self_attn.q_proj.weight[:, hidden:], last.self_attn.q_proj.weight)
    torch.testing.assert_close(draft.self_attn.q_proj.weight[:, :hidden], before[:, :hidden])  # embedding half kept
    with pytest.raises(ValueError, match="Unknown init part"):
        draft.init_from_target(target, ("heads",))


def test_vocab_coverage():
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [4, 5]], "loss_mask": [[0, 1, 1, 1], [1, 1]]})
    assert vocab_coverage(rows, torch.tensor([2, 4])) == pytest.approx(3 / 5)
    assert vocab_coverage(rows, torch.tensor([0])) == 0.0
