"""Continuous batching gives each prompt the answer `generate` gives it alone; the target fingerprint."""

import json

import pytest
import torch
from conftest import chat_tokenizer, tiny_target
from test_data import REGEN_CONVS, _dataset, _tiny_chat_model

from transformers_confu.training import continuous_batching
from transformers_confu.training.continuous_batching import prefill_passes, stream_answers
from transformers_confu.training.regenerate import (
    LEGACY_FINGERPRINTS,
    canonical_fingerprint,
    regenerate_responses,
    target_fingerprint,
)

EOS = 5


def _prompts(count: int = 23, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(EOS + 1, 128, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (count,), generator=g)]


def _alone(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(EOS) + 1] if EOS in new else new


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_refilled_rows_answer_as_generate_alone(arch, monkeypatch):
    model = tiny_target(arch, eos_token_id=EOS)
    prompts = _prompts()
    alone = [_alone(model, p, 30) for p in prompts]
    assert 1 < sum(len(a) < 30 for a in alone) < len(prompts)  # answers of very different lengths
    edits = []
    keep = continuous_batching._Batch._keep

    def spy(self, rows, start):
        edits.append((len(rows) < len(self.prompts), start))
        return keep(self, rows, start)

    monkeypatch.setattr(continuous_batching._Batch, "_keep", spy)
    for batch_size, refill_rows, prefill_rows, prefill_tokens in [
            (4, 1, 8, "auto"), (5, None, 2, None), (8, 3, 3, 40), (64, None, 8, "auto"), (64, None, 64, None),
            (64, None, 64, 100)]:
        got = list(stream_answers(model, prompts, 30, [EOS], batch_size=batch_size, refill_rows=refill_rows,
                                  prefill_rows=prefill_rows, prefill_tokens=prefill_tokens))
        assert sorted(i for i, _, _ in got) == list(range(len(prompts)))
        for i, tokens, ended in got:
            assert tokens == alone[i] and ended == (tokens[-1] == EOS)
    assert any(start < 0 for _, start in edits)  # the cache was widened for a longer prompt
    assert any(start > 0 for _, start in edits)  # positions no row sees were cut
    assert any(dropped for dropped, _ in edits)  # free rows were dropped at the end


def test_prefill_passes_bound_rows_and_padded_tokens():
    lengths = [3, 5, 5, 9, 30, 31, 2]
    assert prefill_passes(lengths, 8, None) == [range(0, 7)]
    assert prefill_passes(lengths, 3, None) == [range(0, 3), range(3, 6), range(6, 7)]
    # rows x longest <= 20: 3 x 5 fits, 4 x 9 does not; 30 and 31 exceed it and go alone
    assert prefill_passes(lengths, 8, 20) == [range(0, 3), range(3, 4), range(4, 5), range(5, 6), range(6, 7)]
    assert prefill_passes(lengths, 8, 1) == [range(i, i + 1) for i in range(7)]
    assert prefill_passes([], 8, 20) == []


def test_sampled_answers_do_not_depend_on_the_batch():
    model = tiny_target(eos_token_id=EOS)
    prompts = _prompts(12)
    runs = [{i: t for i, t, _ in stream_answers(model, prompts, 20, [EOS], batch_size=b, temperature=0.8, top_p=0.9,
                                                seeds=list(range(12)))} for b in (1, 5)]
    assert runs[0] == runs[1]
    other = {i: t for i, t, _ in stream_answers(model, prompts, 20, [EOS], batch_size=5, temperature=0.8, top_p=0.9,
                                                seeds=list(range(1, 13)))}
    assert other != runs[0]


def test_stop_finishes_running_rows_and_starts_no_more():
    model = tiny_target(eos_token_id=EOS)
    prompts = _prompts(12)
    steps = []
    got = list(stream_answers(model, prompts, 10, [EOS], batch_size=3, stop=lambda: steps.append(1) or len(steps) > 5))
    assert len(got) == 3 and all(t == _alone(model, prompts[i], 10) for i, t, _ in got)


def test_refill_and_generate_batches_give_the_same_answers(tmp_path):
    tokenizer = chat_tokenizer()
    model = _tiny_chat_model(tokenizer)
    ds = _dataset(REGEN_CONVS)
    refilled = regenerate_responses(ds, model, tokenizer, tmp_path / "a", batch_size=2, max_new_tokens=6)
    batched = regenerate_responses(ds, model, tokenizer, tmp_path / "b", batch_size=2, max_new_tokens=6, refill=False)
    assert refilled.to_list() == batched.to_list()
    records = [json.loads(line) for line in (tmp_path / "a" / "responses.jsonl").read_text().splitlines()]
    assert len(records) == 5 and all(r["new_tokens"] > 0 for r in records)


def test_sliding_window_targets_regenerate_by_whole_batches(tmp_path):
    tokenizer = chat_tokenizer()
    model = tiny_target("qwen2", vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                        use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="full context"):
        list(stream_answers(model, [[EOS + 1] * 3], 4, [EOS]))
    regenerate_responses(_dataset(REGEN_CONVS), model, tokenizer, tmp_path, batch_size=2, max_new_tokens=4)
    records = [json.loads(line) for line in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert len(records) == 5 and all(r["new_tokens"] > 0 for r in records)


def test_answered_prompts_are_not_answered_again(tmp_path):
    tokenizer = chat_tokenizer()
    model = _tiny_chat_model(tokenizer)
    ds = _dataset(REGEN_CONVS)
    from transformers_confu.training.regenerate import prompt_key
    given = {prompt_key(REGEN_CONVS[1]): "Given answer."}
    out = regenerate_responses(ds, model, tokenizer, tmp_path, batch_size=2, max_new_tokens=3, answered=given)
    assert out[1]["messages"][-1]["content"] == "Given answer."
    assert len((tmp_path / "responses.jsonl").read_text().splitlines()) == 4


def test_fingerprint_ignores_the_load_folder_and_migrates_legacy_folders(tmp_path, monkeypatch):
    tokenizer = chat_tokenizer()
    model = _tiny_chat_model(tokenizer)
    for name in ("a", "b"):
        model.save_pretrained(tmp_path / name)
    loaded = [type(model).from_pretrained(tmp_path / name) for name in ("a", "b")]
    assert target_fingerprint(loaded[0]) == target_fingerprint(loaded[1]) == target_fingerprint(model)
    other = _tiny_chat_model(tokenizer)
    with torch.no_grad():
        other.get_input_embeddings().weight.mul_(1.5)
    assert target_fingerprint(other) != target_fingerprint(model)
    assert canonical_fingerprint("b8f9516f4af8e355") == "0de68d7aa27e7747" == canonical_fingerprint("0de68d7aa27e7747")
    # A folder pinned to a legacy fingerprint of this target is rewritten and reused, not refused.
    ds = _dataset(REGEN_CONVS)
    full = regenerate_responses(ds, model, tokenizer, tmp_path / "answers", batch_size=2, max_new_tokens=3)
    settings_path = tmp_path / "answers" / "settings.json"
    settings = json.loads(settings_path.read_text())
    monkeypatch.setitem(LEGACY_FINGERPRINTS, "0123456789abcdef", settings["target"])
    settings_path.write_text(json.dumps({**settings, "target": "0123456789abcdef"}))
    again = regenerate_responses(ds, model, tokenizer, tmp_path / "answers", batch_size=2, max_new_tokens=3)
    assert again.to_list() == full.to_list() and json.loads(settings_path.read_text()) == settings
