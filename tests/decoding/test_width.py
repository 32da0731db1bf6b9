"""Per-round tree width (`width.py`): the choice on hand-made estimates and costs, the measured cost table, and the
eager batch-1 loop with `width="auto"`: greedy identical to plain `generate`, sampling exact, trees really cut."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_target
from test_generation import plain
from test_sampling import p_value, sampled_counts
from test_suffix import (
    PROMPT,
    hybrid_assistant,
    repetitive_prompt,
    sampling_hybrid,
    sampling_setup,
    suffix_assistant,
)

import transformers_confu.decoding.width as width_module
from transformers_confu import SuffixAssistant
from transformers_confu.decoding.width import best_width, measure_verify_costs

__all__ = ["sampling_setup"]  # a fixture of test_suffix, used here
# the verify costs of results/batch_ceiling.md (B = 1), interpolated at widths 5, 7 and 9
CPU_LIKE = {1: 1.0, 2: 1.2, 3: 1.26, 4: 1.36, 5: 1.5, 6: 1.58, 7: 1.6, 8: 1.62, 9: 1.7}
SCORES = [math.log(p) for p in (0.9, 0.6, 0.3, 0.1, 0.05, 0.02, 0.01)]  # best first


def test_best_width_on_hand_made_estimates_and_costs():
    flat = dict.fromkeys(range(1, 9), 1.0)
    assert best_width(SCORES, flat) == 8  # every candidate is free: all of them
    assert best_width(SCORES[:3], flat) == 4  # no more nodes than candidates
    steep = {w: float(w) for w in range(1, 9)}
    assert best_width(SCORES, steep) == 1  # each node costs a whole step: a plain step
    # the measured CPU costs: the likely candidates pay, the unlikely tail does not
    assert best_width(SCORES, CPU_LIKE) == 4
    assert best_width([math.log(0.05)] * 7, CPU_LIKE) == 1
    assert best_width(SCORES, {1: 1.0, 3: 1.26, 8: 1.62}) == 3  # only widths of the table
    assert best_width([], CPU_LIKE) == 1
    # negative control: a rule that ignores the costs would take the full width
    assert best_width(SCORES, CPU_LIKE) != best_width(SCORES, flat)
    with pytest.raises(ValueError, match="needs width 1"):
        best_width(SCORES, {2: 1.0, 4: 1.5})


def test_measure_verify_costs_times_each_width_and_leaves_the_model_as_it_was():
    target = tiny_target()
    costs = measure_verify_costs(target, [4, 1, 2], context=16, repeats=2)
    assert list(costs) == [1, 2, 4] and all(0 < s < 10 for s in costs.values())
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(target.generate(ids, max_new_tokens=4, do_sample=False), plain(target, ids, max_new_tokens=4))
    with pytest.raises(ValueError, match="widths >= 1"):
        measure_verify_costs(target, [0, 2])


@pytest.fixture
def measured(monkeypatch):
    """`width="auto"` measuring the CPU-like table (the tiny targets' own costs are nearly flat): records the calls."""
    calls = []

    def fake(model, widths, **_):
        calls.append(list(widths))
        return {w: CPU_LIKE[w] for w in widths}

    monkeypatch.setattr(width_module, "measure_verify_costs", fake)
    return calls


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_auto_width_is_greedy_identical_and_cuts_trees(arch, kind, measured):
    target = tiny_target(arch)

    def build(width):
        return (suffix_assistant(target, total_tokens=8, width=width) if kind == "suffix"
                else hybrid_assistant(target, depth=3, top_k=2, total_tokens=9, width=width))

    auto, fixed = build("auto"), build("fixed")
    sizes, full = [], []
    for seed in range(5):
        ids = repetitive_prompt(seed)
        ref = plain(target, ids, max_new_tokens=30)
        for assistant, seen in ((auto, sizes), (fixed, full)):
            out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant)
            assert torch.equal(out, ref), f"seed {seed}"
            seen.append(assistant.stats.tree_sizes)
    budget = 8 if kind == "suffix" else 9
    assert measured == [list(range(1, budget + 1))]  # measured once, at the first call, kept on the assistant
    assert auto.verify_costs == {w: CPU_LIKE[w] for w in range(1, budget + 1)}
    flat = [n for rounds in sizes for n in rounds]
    assert len(set(flat)) >= 3 and 1 in flat  # the width varies between rounds, down to plain steps
    # rounds where fixed width would verify more: the auto policy cut the tree
    assert sum(flat) < sum(n for rounds in full for n in rounds)


def test_width_option_checks_and_static_mode_keeps_fixed_widths(measured):
    target = tiny_target()
    with pytest.raises(ValueError, match="'fixed'.*'auto'"):
        SuffixAssistant(target, width="dynamic")
    with pytest.raises(ValueError, match="width 1 included"):
        SuffixAssistant(target, width={2: 1.0})
    with pytest.raises(ValueError, match="'fixed'.*'auto'"):
        hybrid_assistant(target, width=4)
    assistant = suffix_assistant(target, total_tokens=6, width="auto")
    ids = repetitive_prompt(3)
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=assistant,
                          cache_implementation="static")
    assert torch.equal(out, plain(target, ids, max_new_tokens=20))
    assert measured == [] and set(assistant.stats.tree_sizes) == {6}  # static: fixed shapes, nothing measured


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_auto_width_sampling_matches_exact_target_distribution(sampling_setup, kind):
    target, exact = sampling_setup
    costs = {1: 1.0, 2: 1.1, 3: 1.15, 4: 1.2, 5: 1.25, 6: 1.3}  # cuts some trees, keeps others
    if kind == "suffix":
        assistant = SuffixAssistant(target, total_tokens=4, max_depth=3, width=costs)
    else:
        assistant = sampling_hybrid(target)
        assistant.width = costs
    sizes, run = set(), assistant.generate

    def recorded(*args, **kwargs):
        out = run(*args, **kwargs)
        sizes.update(assistant.stats.tree_sizes)
        return out

    assistant.generate = recorded
    counts = sampled_counts(target, assistant, PROMPT)
    assert p_value(exact, counts) > 1e-3
    assert len(sizes) >= 2  # the width varied between rounds
