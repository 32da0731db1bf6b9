"""Batched suffix drafting (`SuffixAssistant`) and hybrid trees: each row exactly what plain batched `generate`
gives on the same padded batch, with suffix candidates really proposed and accepted."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target, tiny_tokenizer
from test_batched import plain
from test_sampling import SAMPLES, TEMPERATURE, TOP_K, exact_distribution, p_value
from test_suffix import hybrid_assistant, oracle_corpus, repetitive_prompt, sampling_hybrid, suffix_assistant

import transformers_confu.decoding.verify as verify
from transformers_confu import SuffixAssistant
from transformers_confu.decoding.batched import BatchStats, batch_budget
from transformers_confu.decoding.generation import TreeBudget
from transformers_confu.decoding.suffix import SuffixProposer


def padded(prompts: list[torch.LongTensor]) -> tuple[torch.LongTensor, torch.Tensor]:
    """(1, n) prompts left-padded with 0 into one batch, and its attention mask."""
    width = max(p.shape[1] for p in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1]:], mask[row, width - prompt.shape[1]:] = prompt[0], 1
    return ids, mask


def mixed_batch(seed: int) -> tuple[torch.LongTensor, torch.Tensor]:
    """2-4 prompts of mixed lengths, most of them repeating a phrase (the sequence source matches at once)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [repetitive_prompt(4 * seed + row) for row in range(1 + seed % 3)]
    return padded(prompts + [torch.randint(1, 128, (1, 2 + 5 * seed % 11), generator=g)])


def add_sources(total: dict, stats: BatchStats) -> None:
    for source, count in stats.accepted_by_source.items():
        total[source] = total.get(source, 0) + count


def check_rows(target, assistant, seeds=range(5), max_new: int = 24, **kwargs) -> dict:
    """Greedy batches of `mixed_batch(seed)`: identical to plain batched generate; returns the accepted tokens by
    source over all of them."""
    accepted: dict = {}
    for seed in seeds:
        ids, mask = mixed_batch(seed)
        ref = plain(target, ids, mask, max_new_tokens=max_new)
        out = plain(target, ids, mask, max_new_tokens=max_new, assistant_model=assistant, **kwargs)
        assert torch.equal(out, ref), f"seed {seed}"
        stats = assistant.stats
        mode = "static" if kwargs.get("cache_implementation") == "static" else "eager"
        assert isinstance(stats, BatchStats) and stats.mode == mode and stats.new_tokens == max_new * ids.shape[0]
        assert all(sum(a) >= max_new - 1 for a in stats.row_accept_lengths)  # the first comes from the prefill
        add_sources(accepted, stats)
    return accepted


@pytest.mark.parametrize("total", [4, 8])
def test_suffix_batches_match_plain_batched_generate(arch, total):
    target = tiny_target(arch)
    assistant = suffix_assistant(target, total_tokens=total)
    accepted = check_rows(target, assistant)
    assert set(accepted) == {"suffix"} and accepted["suffix"] > 0  # copied tokens were accepted


def test_each_row_drafts_from_its_own_context(monkeypatch):
    """Every row's proposer reads that row's real tokens so far, root last (no padding, nothing of other rows)."""
    target = tiny_target()
    assistant = suffix_assistant(target, total_tokens=6)
    contexts: dict = {}
    candidates = SuffixProposer.candidates

    def spy(self, context, *args):
        contexts.setdefault(id(self), []).append(list(context))
        return candidates(self, context, *args)

    monkeypatch.setattr(SuffixProposer, "candidates", spy)
    for seed in range(3):
        ids, mask = mixed_batch(seed)
        out = plain(target, ids, mask, max_new_tokens=16, assistant_model=assistant)
        rows = [out[row, int((mask[row] == 0).sum()):].tolist() for row in range(ids.shape[0])]
        prompts = [len(row) - 16 for row in rows]
        seen = sorted(next(r for r, row in enumerate(rows) if row[: len(c[0])] == c[0]) for c in contexts.values())
        assert seen == list(range(ids.shape[0])), f"seed {seed}"  # one proposer per row
        for calls in contexts.values():
            row = next(r for r, tokens in enumerate(rows) if tokens[: len(calls[0])] == calls[0])
            assert len(calls[0]) == prompts[row] + 1  # the prompt and the first root
            assert all(rows[row][: len(c)] == c for c in calls)  # the row's tokens so far, each call longer
            assert [len(c) for c in calls] == sorted({len(c) for c in calls})
        contexts.clear()


@pytest.mark.parametrize("tree", [dict(depth=3, top_k=2, total_tokens=9), dict(depth=2, top_k=1, total_tokens=6)],
                         ids=["tree", "chain"])
def test_hybrid_batches_match_plain_batched_generate(arch, tree):
    target = tiny_target(arch)
    accepted = check_rows(target, hybrid_assistant(target, **tree))
    assert accepted.get("suffix", 0) > 0  # a random draft is rarely right: the suffix candidates are


def test_hybrid_batch_without_suffix_is_the_draft_alone():
    target = tiny_target()
    assistant = hybrid_assistant(target, depth=2, top_k=1, total_tokens=6)
    accepted = check_rows(target, assistant, seeds=[1, 2], suffix=False)
    assert set(accepted) <= {"draft"} and assistant.stats.suffix_seconds == 0


def test_corpus_of_own_answers_gives_long_blocks_in_every_row(arch):
    target = tiny_target(arch)
    prompts = [torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 5)]
    ids, mask = padded(prompts)
    for assistant in (suffix_assistant(target, oracle_corpus(target, prompts), total_tokens=8),
                      hybrid_assistant(target, oracle_corpus(target, prompts), depth=2, top_k=2, total_tokens=8)):
        out = plain(target, ids, mask, max_new_tokens=40, assistant_model=assistant)
        assert torch.equal(out, plain(target, ids, mask, max_new_tokens=40))
        stats = assistant.stats
        assert all(sum(a) / len(a) > 3 for a in stats.row_accept_lengths), stats.row_accept_lengths
        assert stats.accepted_by_source["suffix"] > 60 and stats.suffix_seconds > 0


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_eos_stop_strings_and_max_new_tokens_inside_copied_blocks(kind):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    prompts = [torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (6, 3)]
    ids, mask = padded(prompts)
    corpus = oracle_corpus(target, prompts)
    assistant = (suffix_assistant(target, corpus, total_tokens=8) if kind == "suffix"
                 else hybrid_assistant(target, corpus, depth=2, top_k=1, total_tokens=8))
    free = plain(target, ids, mask, max_new_tokens=40)
    start = ids.shape[1]
    eos = int(free[0, start + 13])  # row 0 stops inside a block; row 1 wherever this token comes, if it does
    cases = [dict(eos_token_id=eos), dict(eos_token_id=eos, pad_token_id=None), dict(max_new_tokens=13),
             dict(max_new_tokens=2), dict(stop_strings=[tokenizer.decode(free[1, start + 9 : start + 11])],
                                          tokenizer=tokenizer)]
    for case in cases:
        case = dict(max_new_tokens=40) | case
        ref = target.generate(ids, attention_mask=mask, do_sample=False, **dict(pad_token_id=0) | case)
        out = target.generate(ids, attention_mask=mask, do_sample=False, assistant_model=assistant,
                              **dict(pad_token_id=0) | case)
        assert torch.equal(out, ref), case
        assert max(assistant.stats.accept_lengths) > 2  # stopped inside a block of several accepted tokens


def test_suffix_batch_policy():
    saved = TreeBudget(depth=6, top_k=2, total_tokens=8)
    assert batch_budget(saved, 1, "cpu", drafted=False) == saved
    assert batch_budget(saved, 2, "cpu", drafted=False) is None  # measured: suffix trees do not pay in CPU batches
    assert batch_budget(saved, 32, "cuda", drafted=False) == saved
    assert batch_budget(saved, 64, "cuda", drafted=False) is None
    target = tiny_target()
    assistant = SuffixAssistant(target, tokenizer=tiny_tokenizer())  # no width given: the policy decides
    ids, mask = padded([repetitive_prompt(seed) for seed in range(2)])
    ref = plain(target, ids, mask, max_new_tokens=8)
    out = plain(target, ids, mask, max_new_tokens=8, assistant_model=assistant)
    assert torch.equal(out, ref) and assistant.stats.mode == "plain" and assistant.stats.new_tokens == 16
    out = plain(target, ids, mask, max_new_tokens=8, assistant_model=assistant, tree_total_tokens=5)  # explicit
    assert torch.equal(out, ref) and assistant.stats.mode == "eager"


def test_suffix_batch_refuses_what_batches_do_not_take():
    target = tiny_target()
    assistant = suffix_assistant(target)
    with pytest.raises(ValueError, match="Right padding"):
        target.generate(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 0], [1] * 4]),
                        max_new_tokens=5, assistant_model=assistant)
    with pytest.raises(ValueError, match="not supported"):
        target.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=5, assistant_model=assistant,
                        cache_implementation="offloaded")


# Sampling: the tiny vocabulary of test_sampling; each row's suffix recurs, so that candidates are proposed.
VOCAB = 6
PROMPTS = [torch.tensor([1, 4, 2, 1, 4]), torch.tensor([3, 5, 3])]


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny_target(vocab_size=VOCAB, init=0.15, seed=3)
    return target, [exact_distribution(target, p) for p in PROMPTS]


def sampled_rows(target, assistant) -> tuple[list[dict], int]:
    """Per prompt, the counts of its `SAMPLES` sampled continuations (each batch holds every prompt twice: two
    independent draws); and the suffix tokens accepted."""
    ids, mask = padded([p[None] for p in PROMPTS * 2])
    torch.manual_seed(0)
    counts, suffix = [{}, {}], 0
    for _ in range(SAMPLES // 2):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, temperature=TEMPERATURE,
                              top_k=TOP_K, pad_token_id=0, assistant_model=assistant)
        for row in range(ids.shape[0]):
            key = tuple(out[row, ids.shape[1]:].tolist())
            counts[row % 2][key] = counts[row % 2].get(key, 0) + 1
        suffix += assistant.stats.accepted_by_source.get("suffix", 0)
    return counts, suffix


def sampling_assistant(target, kind: str):
    return SuffixAssistant(target, total_tokens=4, max_depth=3) if kind == "suffix" else sampling_hybrid(target)


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_sampling_matches_exact_distribution_per_row(sampling_setup, kind):
    target, exact = sampling_setup
    counts, suffix = sampled_rows(target, sampling_assistant(target, kind))
    assert suffix > 100  # suffix candidates were proposed and accepted
    for row in range(2):
        assert p_value(exact[row], counts[row]) > 1e-3, f"row {row}"


def test_a_wrong_point_mass_rule_is_detected_in_a_batch(sampling_setup, monkeypatch):
    """Keeping a rejected suffix token in the residual (not zeroing it) over-samples it: the test must fail."""
    target, exact = sampling_setup
    monkeypatch.setattr(verify, "without_token", lambda p, x: p)
    counts, _ = sampled_rows(target, sampling_assistant(target, "suffix"))
    assert min(p_value(exact[row], counts[row]) for row in range(2)) < 1e-6
