"""`output_scores` and `output_logits` with an assistant: each new token's scores and logits as plain `generate`
returns them (`GenerateDecoderOnlyOutput.scores` / `.logits`, one (1, V) float32 tensor per new token). With
logits processors, on Llama and Qwen2 targets: `test_processing.test_greedy_with_processors_matches_plain_generate`."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from test_batched import left_padded
from test_generation import make_assistant, mode, mode_kwargs, plain  # noqa: F401 (mode: a fixture)
from test_processing import SCORES, assert_same_steps, oracle_run
from test_suffix import hybrid_assistant, oracle_corpus, suffix_assistant
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from transformers_confu import SuffixAssistant
from transformers_confu.decoding.generation import StepScores


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_suffix_and_hybrid_scores_match_plain_generate_over_long_accepted_blocks(kind, mode):
    """A corpus of the target's own answers: most rounds accept blocks of several tokens."""
    target = tiny_target()
    prompts = [torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    corpus = oracle_corpus(target, prompts)
    assistant = (suffix_assistant(target, corpus, total_tokens=8) if kind == "suffix"
                 else hybrid_assistant(target, corpus, depth=2, top_k=1, total_tokens=8))
    for ids in prompts:
        ref = plain(target, ids, max_new_tokens=40, **SCORES)
        out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant, **SCORES,
                              **mode_kwargs(mode))
        assert_same_steps(out, ref, ids.shape[1])
        assert assistant.stats.mean_accepted_tokens > 3
        torch.testing.assert_close(target.compute_transition_scores(out.sequences, out.scores, normalize_logits=True),
                                   target.compute_transition_scores(ref.sequences, ref.scores, normalize_logits=True),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("stop", ["max_new_tokens", "eos"])
def test_rounds_cut_by_a_stop_record_only_the_kept_tokens(stop):
    """An oracle accepts 5 tokens a round; where the output stops inside a round (length or EOS), the scores
    stop with it."""
    target = tiny_target()
    for seed in range(3):
        ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(seed))
        reference = plain(target, ids, max_new_tokens=30)
        limit = dict(max_new_tokens=13) if stop == "max_new_tokens" else dict(eos_token_id=int(reference[0, 5 + 12]))
        ref = plain(target, ids, **({"max_new_tokens": 30} | limit), **SCORES)
        record = StepScores([], [])
        out, stats = oracle_run(target, ids, reference, record=record, new=limit.get("max_new_tokens", 30),
                                eos_token_id=limit.get("eos_token_id"))
        assert stats.mean_accepted_tokens > 3
        assert torch.equal(out, ref.sequences)
        assert len(record.scores) == len(record.logits) == len(ref.scores) == out.shape[1] - 5 <= 13
        for ours, theirs in zip(record.scores + record.logits, ref.scores + ref.logits):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_sampling_scores_are_the_warped_logits_of_the_sampled_sequence():
    """Sampling: at each step the logits are the target's at that prefix and the scores are them after
    temperature and top-k; every sampled token is among the scores' finite ones."""
    target = tiny_target(init=0.1)
    assistant = make_assistant(target, depth=3, top_k=2, total_tokens=6)
    warp = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]
    for seed in range(3):
        ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        out = target.generate(ids, max_new_tokens=20, do_sample=True, temperature=0.7, top_k=5,
                              assistant_model=assistant, **SCORES)
        new = out.sequences[0, 6:]
        logits = target(out.sequences).logits[0, 5:-1].float()
        assert len(out.scores) == len(out.logits) == len(new) == 20
        for step, token in enumerate(new.tolist()):
            torch.testing.assert_close(out.logits[step][0], logits[step], atol=1e-4, rtol=1e-4)
            expected = logits[step : step + 1]
            for warper in warp:
                expected = warper(None, expected)
            torch.testing.assert_close(out.scores[step], expected, atol=1e-4, rtol=1e-4)
            assert torch.isfinite(out.scores[step][0, token])


def test_only_what_is_asked_is_returned():
    target = tiny_target()
    assistant = make_assistant(target)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    out = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=assistant,
                          return_dict_in_generate=True, output_scores=True)
    assert len(out.scores) == 8 and out.logits is None
    no_dict = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=assistant, output_scores=True)
    assert torch.equal(no_dict, out.sequences)  # as plain generate: no dict, no scores


@pytest.mark.parametrize("assistant", ["confu", "suffix"])
def test_batches_are_refused_with_a_clear_error(assistant):
    target = tiny_target()
    helper = make_assistant(target) if assistant == "confu" else SuffixAssistant(target)
    ids, mask = left_padded(0, [4, 6])
    with pytest.raises(ValueError, match="one unpadded prompt at a time"):
        target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                        assistant_model=helper, **SCORES)
