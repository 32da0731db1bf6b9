"""Sampling is lossless: continuations drawn with the assistant follow the target's exact distribution."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_target
from scipy.stats import chisquare

import transformers_confu.decoding.generation as generation
from transformers_confu import ConFuAssistant, ConFuDraftConfig

VOCAB, NEW, TEMPERATURE, TOP_K = 6, 3, 0.8, 5
SAMPLES = 2500


def exact_distribution(target, prompt: torch.Tensor, penalty: float = 1.0, no_repeat: bool = False
                       ) -> dict[tuple[int, ...], float]:
    """P(x1..x3 | prompt) under temperature + top-k, by enumerating every prefix; first a repetition `penalty` or a
    ban on repeated tokens (`no_repeat_ngram_size=1`) if asked."""

    def next_probs(seq: list[int]) -> torch.Tensor:
        logits = target(torch.tensor([seq])).logits[0, -1].double()
        seen = torch.tensor(sorted(set(seq)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
        if no_repeat:
            logits[seen] = float("-inf")
        logits = logits / TEMPERATURE
        kth = logits.topk(TOP_K).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)

    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NEW):
        probs = {
            prefix + (x,): p * float(q)
            for prefix, p in probs.items()
            for x, q in enumerate(next_probs(prompt.tolist() + list(prefix)))
            if p * float(q) > 0
        }
    return probs


def sampled_counts(target, assistant, prompt: torch.Tensor, samples: int = SAMPLES, pairs: list | None = None,
                   **kwargs) -> dict[tuple[int, ...], int]:
    """How often each continuation came out of `samples` calls (every returned sequence counts); `pairs`: where
    each call's continuations are also listed, if given."""
    torch.manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(samples):
        out = target.generate(prompt[None], max_new_tokens=NEW, do_sample=True, temperature=TEMPERATURE,
                              top_k=TOP_K, assistant_model=assistant, **kwargs)
        keys = [tuple(row[prompt.numel():].tolist()) for row in out]
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        if pairs is not None:
            pairs.append(keys)
    return counts


def p_value(exact, counts) -> float:
    """Chi-square goodness of fit, pooling outcomes expected fewer than 5 times."""
    common = [k for k, p in exact.items() if p * SAMPLES >= 5]
    observed = [counts.get(k, 0) for k in common] + [SAMPLES - sum(counts.get(k, 0) for k in common)]
    expected = [exact[k] * SAMPLES for k in common] + [SAMPLES * (1 - sum(exact[k] for k in common))]
    assert set(counts) <= set(exact), "sampled a continuation of probability 0"
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(vocab_size=VOCAB, init=0.15, seed=3)
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=4)
    config.initializer_range = 0.4  # a confident draft that is often wrong: many rejections
    assistant = ConFuAssistant.from_config(config, target, draft_dtype="float32", depth=2, top_k=2, total_tokens=4)
    assistant.draft.set_vocab_map(torch.tensor([0, 2, 3, 5]))  # tokens 1 and 4 are never drafted
    prompt = torch.tensor([1, 4, 2])
    return target, assistant, prompt, exact_distribution(target, prompt)


def compiled_static() -> dict:
    """The static mode compiled (the eager backend runs the captured graphs; fullgraph fails on a break)."""
    from transformers import CompileConfig

    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    return dict(cache_implementation="static", compile_config=config)


@pytest.mark.parametrize("mode", ["eager", "static", "compiled"])
def test_sampling_matches_exact_target_distribution(setup, mode):
    target, assistant, prompt, exact = setup
    options = {"eager": {}, "static": dict(cache_implementation="static"), "compiled": compiled_static()}[mode]
    counts = sampled_counts(target, assistant, prompt, **options)
    assert p_value(exact, counts) > 1e-3


def test_sampling_with_a_bfloat16_draft_matches_exact_target_distribution(setup):
    """The same draft run in bfloat16 (what "auto" picks on CPUs with native bfloat16) proposes from its own q."""
    target, assistant, prompt, exact = setup
    half = ConFuAssistant.from_config(assistant.draft.config, target, draft_dtype="bfloat16", depth=2, top_k=2,
                                      total_tokens=4)
    half.draft.load_state_dict(assistant.draft.state_dict())
    assert half.draft.dtype == torch.bfloat16
    counts = sampled_counts(target, half, prompt)
    assert p_value(exact, counts) > 1e-3


def test_a_wrong_acceptance_rule_is_detected(setup, monkeypatch):
    """Treating q as 1 for drawn children (EAGLE's shortcut) must fail the same test."""
    target, assistant, prompt, exact = setup

    def q_is_one(tree, target_probs, d2t):
        drafted = tree.proposals.sum(-1, keepdim=True) > 0
        one_hot = torch.zeros_like(tree.proposals).scatter_(1, tree.proposals.argmax(-1, keepdim=True), 1.0)
        tree.proposals = torch.where(drafted, one_hot, tree.proposals)
        return accept(tree, target_probs, d2t)

    accept = generation.accept_sampling
    monkeypatch.setattr(generation, "accept_sampling", q_is_one)
    counts = sampled_counts(target, assistant, prompt)
    assert p_value(exact, counts) < 1e-6


def test_exact_distribution_is_normalised(setup):
    exact = setup[3]
    assert abs(sum(exact.values()) - 1) < 1e-9
    assert len(exact) == len(set(itertools.islice(exact, None)))
