"""Caches kept between calls: a call whose prompt continues the last call's sequence (a chat's next turn) prefills
only what is new, and still returns plain `generate`'s output."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from test_generation import make_assistant, plain
from test_suffix import hybrid_assistant, oracle_corpus, suffix_assistant

from transformers_confu import ConFuAssistant, ConFuDraftConfig


def confu(target, entry: bool, weight: float) -> ConFuAssistant:
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True, future_entry=entry,
                                         future_logit_weight=weight)
    return ConFuAssistant.from_config(config, target, depth=3, top_k=2, total_tokens=6)


def turn(seed: int, n: int = 5) -> torch.Tensor:
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["eagle3", "confu-prior", "confu-f-entry", "hybrid", "suffix"])
def test_next_turns_reuse_the_last_calls_caches_and_equal_plain_generate(kind):
    """Three turns: each prompt is the last output plus a new request; the second and third prefill only what is
    new (at least the earlier prompt is reused; without a draft, all of the last output but its last token), and
    every output is plain generate's on the whole prompt."""
    target = tiny_target()
    ids = turn(0, 8)
    calls = dict(max_new_tokens=20)
    if kind in ("hybrid", "suffix"):  # a corpus of the target's own answers: long accepted blocks
        prompts = [ids]
        for seed in (1, 2):
            prompts.append(torch.cat([plain(target, prompts[-1], max_new_tokens=20), turn(seed)], 1))
        corpus = oracle_corpus(target, prompts, 20)
        assistant = (suffix_assistant(target, corpus) if kind == "suffix" else
                     hybrid_assistant(target, corpus, depth=2, top_k=1, total_tokens=8))
    else:
        assistant = (make_assistant(target, depth=2, top_k=2, total_tokens=5) if kind == "eagle3" else
                     confu(target, kind == "confu-f-entry", 0.0 if kind == "confu-f-entry" else 0.5))
        calls |= {} if kind == "eagle3" else dict(contemplate_nodes=2)
    prompt, out = ids, None
    for step, seed in enumerate((None, 1, 2)):
        if seed is not None:
            prompt = torch.cat([out, turn(seed)], 1)
        before = 0 if out is None else out.shape[1]  # reused: all of it but the last round's tokens (at most 9)
        out = target.generate(prompt, do_sample=False, assistant_model=assistant, **calls)
        assert torch.equal(out, plain(target, prompt, max_new_tokens=20)), f"turn {step}"
        stats = assistant.stats
        low = before - 1 if kind == "suffix" else before - 10
        assert stats.reused_tokens == 0 if step == 0 else low <= stats.reused_tokens <= before - 1
    if kind in ("hybrid", "suffix"):
        assert stats.mean_accepted_tokens > 3
    if kind.startswith("confu"):
        assert stats.fresh_futures > 0


@pytest.mark.parametrize("kind", ["eagle3", "suffix"])
def test_only_the_common_prefix_is_reused(kind):
    """An edited earlier turn reuses the caches up to the edit; another prompt reuses nothing; hidden states and the
    static mode run the whole prompt."""
    target = tiny_target()
    assistant = suffix_assistant(target) if kind == "suffix" else make_assistant(target, depth=2, top_k=2,
                                                                                  total_tokens=5)
    first = target.generate(turn(0, 10), max_new_tokens=12, do_sample=False, assistant_model=assistant)
    edited = first.clone()
    edited[0, 6] = (edited[0, 6] + 1) % 128
    out = target.generate(edited, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, plain(target, edited, max_new_tokens=12)) and assistant.stats.reused_tokens == 5
    assistant.kept_caches.clear()  # dropped: the same continuation prefills its whole prompt
    out = target.generate(edited, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, plain(target, edited, max_new_tokens=12)) and assistant.stats.reused_tokens == 0
    first = target.generate(edited, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    with torch.no_grad():
        target.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # the target changed since: its caches are stale
    nxt = torch.cat([first, turn(6)], 1)
    out = target.generate(nxt, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, plain(target, nxt, max_new_tokens=12)) and assistant.stats.reused_tokens == 0
    other = turn(3, 9)
    assert torch.equal(target.generate(other, max_new_tokens=12, do_sample=False, assistant_model=assistant),
                       plain(target, other, max_new_tokens=12))
    assert assistant.stats.reused_tokens == 0
    nxt = torch.cat([plain(target, other, max_new_tokens=12), turn(4)], 1)
    hidden = target.generate(nxt, max_new_tokens=6, do_sample=False, assistant_model=assistant,
                             return_dict_in_generate=True, output_hidden_states=True)
    assert assistant.stats.reused_tokens == 0 and hidden.hidden_states[0][0].shape[1] == nxt.shape[1]
    nxt = torch.cat([hidden.sequences, turn(5)], 1)
    out = target.generate(nxt, max_new_tokens=6, do_sample=False, assistant_model=assistant,
                          cache_implementation="static")
    assert torch.equal(out, plain(target, nxt, max_new_tokens=6)) and assistant.stats.reused_tokens == 0


def test_a_call_that_fails_half_way_leaves_no_caches():
    """A stopping criterion that raises in the middle of a call: the next call prefills its whole prompt."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Fails(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] > 20:
                raise RuntimeError("stop here")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    target = tiny_target()
    assistant = make_assistant(target, depth=2, top_k=2, total_tokens=5)
    first = target.generate(turn(0, 8), max_new_tokens=10, do_sample=False, assistant_model=assistant)
    nxt = torch.cat([first, turn(1)], 1)
    with pytest.raises(RuntimeError, match="stop here"):
        target.generate(nxt, max_new_tokens=10, do_sample=False, assistant_model=assistant,
                        stopping_criteria=StoppingCriteriaList([Fails()]))
    out = target.generate(nxt, max_new_tokens=10, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, plain(target, nxt, max_new_tokens=10)) and assistant.stats.reused_tokens == 0


def test_no_caches_kept_when_turned_off():
    """`kept_caches = None`: a chat's next turn prefills its whole prompt, and nothing holds the last call's caches."""
    target = tiny_target()
    assistant = suffix_assistant(target)
    assistant.kept_caches = None
    first = target.generate(turn(0, 8), max_new_tokens=10, do_sample=False, assistant_model=assistant)
    nxt = torch.cat([first, turn(1)], 1)
    out = target.generate(nxt, max_new_tokens=10, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, plain(target, nxt, max_new_tokens=10))
    assert assistant.stats.reused_tokens == 0 and assistant.kept_caches is None
