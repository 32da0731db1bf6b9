"""`num_return_sequences` with sampling: each prompt repeated as plain `generate` repeats it, each copy its own
independent draw from the target's exact distribution (the batched loop, or plain `generate` where the batch
policy says speculation does not pay)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from scipy.stats import binomtest
from test_batched import left_padded
from test_generation import make_assistant
from test_processing import sampling_setup  # noqa: F401 (a fixture)
from test_sampling import SAMPLES, exact_distribution, p_value, sampled_counts
from test_suffix import suffix_assistant

TREE = dict(tree_depth=2, tree_top_k=2, tree_total_tokens=5)


@pytest.mark.parametrize("kind", ["confu", "suffix"])
@pytest.mark.parametrize("tree", [TREE, {}], ids=["speculative", "policy"])
def test_copies_of_each_prompt_in_generates_order(kind, tree):
    """top_k=1 makes every draw the argmax: each copy must be plain generate's, row for row, left padding included."""
    target = tiny_target()
    assistant = make_assistant(target) if kind == "confu" else suffix_assistant(target)
    tree = tree if kind == "confu" else {k: v for k, v in tree.items() if k == "tree_total_tokens"}
    for ids, mask in [(torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(0)), None),
                      left_padded(1, [4, 7])]:
        kwargs = dict(max_new_tokens=12, do_sample=True, top_k=1, num_return_sequences=3, pad_token_id=0)
        ref = target.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, **kwargs)
        out = target.generate(ids, attention_mask=mask, assistant_model=assistant, **kwargs, **tree)
        assert out.shape[0] == 3 * ids.shape[0] and torch.equal(out, ref)
        assert assistant.stats.mode == ("eager" if tree else "plain")


def test_copies_are_independent_draws_from_the_exact_distribution(sampling_setup):
    """Pooled, the copies follow the exact distribution; the two copies of a call agree as often as two independent
    draws would (sum of p^2), which identical or correlated copies would not."""
    target, assistant, prompt = sampling_setup
    exact = exact_distribution(target, prompt)
    pairs = []
    counts = sampled_counts(target, assistant, prompt, SAMPLES // 2, num_return_sequences=2, pairs=pairs, **TREE)
    assert sum(counts.values()) == SAMPLES and assistant.stats.mode == "eager"
    assert p_value(exact, counts) > 1e-3
    same = sum(a == b for a, b in pairs)
    assert binomtest(same, len(pairs), sum(p * p for p in exact.values())).pvalue > 1e-3


def test_greedy_copies_are_refused_as_plain_generate_refuses_them():
    target = tiny_target()
    assistant = make_assistant(target)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="num_return_sequences"):
        target.generate(ids, max_new_tokens=5, do_sample=False, num_return_sequences=2, assistant_model=assistant)
