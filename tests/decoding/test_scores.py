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
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TypicalLogitsWarper,
)

from transformers_confu import ConFuAssistant, ConFuDraftConfig, SuffixAssistant
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


@pytest.mark.parametrize("setting, warpers", [
    (dict(top_k=5), [TopKLogitsWarper(5)]),
    (dict(top_k=0, typical_p=0.9), [TypicalLogitsWarper(0.9)]),
    (dict(top_k=0, epsilon_cutoff=0.01), [EpsilonLogitsWarper(0.01)]),
    (dict(top_k=0, eta_cutoff=0.01), [EtaLogitsWarper(0.01, device="cpu")]),
    (dict(top_k=0, top_h=0.5), [TopHLogitsWarper(0.5)]),
], ids=["top_k", "typical_p", "epsilon", "eta", "top_h"])
def test_sampling_scores_are_the_warped_logits_of_the_sampled_sequence(setting, warpers):
    """Sampling: at each step the logits are the target's at that prefix and the scores are them after
    temperature and the call's warper; every sampled token is among the scores' finite ones."""
    target = tiny_target(init=0.1)
    assistant = make_assistant(target, depth=3, top_k=2, total_tokens=6)
    warp = [TemperatureLogitsWarper(0.7), *warpers]
    for seed in range(3):
        ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        out = target.generate(ids, max_new_tokens=20, do_sample=True, temperature=0.7, **setting,
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


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_batched_scores_match_plain_batched_generate_up_to_each_rows_end(kind, mode):
    """Left-padded rows, suppressed tokens (scores differ from logits), an EOS that ends the first row early, and a
    corpus of the rows' own answers, so rows accept blocks of several tokens."""
    target = tiny_target()
    ids, mask = left_padded(2, [4, 7, 5])
    prompts = [row[keep.bool()][None] for row, keep in zip(ids, mask)]
    first = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    eos = int(first[0, ids.shape[1] + 6])
    settings = dict(eos_token_id=eos, suppress_tokens=[1, 2])
    corpus = oracle_corpus(target, prompts, 16, **settings)
    assistant, tree = ((suffix_assistant(target, corpus), dict(tree_total_tokens=8)) if kind == "suffix" else
                       (hybrid_assistant(target, corpus), dict(tree_depth=2, tree_top_k=1, tree_total_tokens=8)))
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, **settings, **SCORES)
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=assistant, **kwargs, **tree, **mode_kwargs(mode))
    assert assistant.stats.mode == mode and assistant.stats.mean_accepted_tokens > 2
    assert_same_steps(out, ref, ids.shape[1], eos)


def test_batches_the_policy_leaves_to_plain_generate_return_its_scores():
    target = tiny_target()
    assistant = make_assistant(target)
    ids, mask = left_padded(3, [4, 7, 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, **SCORES)
    ref, out = target.generate(ids, **kwargs), target.generate(ids, assistant_model=assistant, **kwargs)
    assert assistant.stats.mode == "plain"
    assert torch.equal(out.sequences, ref.sequences)
    for ours, theirs in zip(out.scores + out.logits, ref.scores + ref.logits):
        assert torch.equal(ours, theirs)


def test_returned_sequences_each_get_their_scores():
    """`num_return_sequences` (top_k=1: every draw the argmax, so plain generate's copies are the reference)."""
    target = tiny_target()
    assistant = make_assistant(target)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=1, num_return_sequences=2, **SCORES)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    out = target.generate(ids, assistant_model=assistant, tree_depth=2, tree_top_k=2, tree_total_tokens=5, **kwargs)
    assert assistant.stats.mode == "eager" and out.sequences.shape[0] == 2
    assert_same_steps(out, ref, ids.shape[1])



class RecordScores(StoppingCriteria):
    """A call's own criterion that never stops and keeps what it is called with: None, or the number of recorded
    steps and the last one."""

    def __init__(self) -> None:
        self.seen: list = []

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.seen.append(None if scores is None else (len(scores), scores[-1].clone()))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class LastTopScoreAtMost(StoppingCriteria):
    """Done where a row's best score at its last step is at most `threshold` (a criterion that reads the scores)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return scores[-1].amax(-1) <= self.threshold


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_own_stopping_criteria_get_the_scores_generate_passes(kind, mode):
    """`stopping_criteria=` gets what plain generate passes it: None, or with `output_scores` (and a dict) the scores
    recorded up to each new token, also inside long accepted blocks; a criterion that stops on them stops where plain
    generate's does."""
    target = tiny_target()
    prompts = [torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    settings = dict(suppress_tokens=[1, 2])  # processed scores differ from the logits
    corpus = oracle_corpus(target, prompts, **settings)
    assistant = (suffix_assistant(target, corpus, total_tokens=8) if kind == "suffix"
                 else hybrid_assistant(target, corpus, depth=2, top_k=1, total_tokens=8))
    for ids in prompts:
        for output in ({}, SCORES):
            theirs, ours = RecordScores(), RecordScores()
            ref = plain(target, ids, max_new_tokens=40, stopping_criteria=StoppingCriteriaList([theirs]), **settings,
                        **output)
            out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant, **settings,
                                  stopping_criteria=StoppingCriteriaList([ours]), **output, **mode_kwargs(mode))
            assert assistant.stats.mean_accepted_tokens > 3
            assert len(ours.seen) == len(theirs.seen) == 40
            if not output:
                assert torch.equal(out, ref) and ours.seen == theirs.seen == [None] * 40
                continue
            assert_same_steps(out, ref, ids.shape[1])
            for step, (a, b) in enumerate(zip(ours.seen, theirs.seen)):
                assert a[0] == b[0] == step + 1 and a[1].shape == b[1].shape == (1, 128)
                torch.testing.assert_close(a[1], b[1], atol=1e-4, rtol=1e-4)
        tops = sorted(float(b[1].amax()) for b in theirs.seen[:30])
        first = [float(b[1].amax()) for b in theirs.seen].index(tops[0])  # where the criterion below first fires
        stop = StoppingCriteriaList([LastTopScoreAtMost((tops[0] + tops[1]) / 2)])  # clear of a tree pass's error
        ref = plain(target, ids, max_new_tokens=40, stopping_criteria=stop, **settings, **SCORES)
        out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant, **settings,
                              stopping_criteria=stop, **SCORES, **mode_kwargs(mode))
        assert_same_steps(out, ref, ids.shape[1])
        assert out.sequences.shape[1] == ids.shape[1] + first + 1


@pytest.mark.parametrize("eos", [None, 126], ids=["no-eos", "eos"])
def test_batched_own_stopping_criteria_read_each_rows_scores(eos):
    """In a batch the call's criterion gets each row's output and recorded (1, V) scores; a criterion on them stops
    each row where plain batched generate stops it (padded after with an EOS id, decoding on without one)."""
    target = tiny_target()
    ids, mask = left_padded(2, [4, 7, 5])
    prompts = [row[keep.bool()][None] for row, keep in zip(ids, mask)]
    assistant = hybrid_assistant(target, oracle_corpus(target, prompts, 40))
    kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos, **SCORES)
    free = target.generate(ids, **kwargs)
    tops = torch.stack(free.scores[:16]).amax(-1)  # (16, B): each row's best score per step
    reached = float(tops.min(0).values.max())  # every row reaches it within its first 16 tokens
    threshold = (reached + float(tops[tops > reached].min())) / 2  # clear of a tree pass's float error
    ends = (tops <= threshold).int().argmax(0) + 1  # each row's tokens up to the step where the criterion fires
    ref = target.generate(ids, **kwargs, stopping_criteria=StoppingCriteriaList([LastTopScoreAtMost(threshold)]))
    assert ref.sequences.shape[1] < free.sequences.shape[1]
    out = target.generate(ids, **kwargs, stopping_criteria=StoppingCriteriaList([LastTopScoreAtMost(threshold)]),
                          assistant_model=assistant, tree_depth=2, tree_top_k=1, tree_total_tokens=8)
    assert assistant.stats.mode == "eager" and assistant.stats.mean_accepted_tokens > 2
    assert torch.equal(out.sequences, ref.sequences)
    for row, end in enumerate(ends.tolist()):  # after its stop a row's scores are padding's (plain) or zeros (ours)
        for ours, theirs in zip(out.scores[:end], ref.scores[:end]):
            torch.testing.assert_close(ours[row], theirs[row], atol=1e-4, rtol=1e-4)


HIDDEN = dict(return_dict_in_generate=True, output_hidden_states=True, output_scores=True)


def assert_same_hidden_states(out, ref, ends: list[int] | None = None, real: torch.Tensor | None = None) -> None:
    """Per new token the target's hidden states (embeddings and every layer) as plain generate records them, up to
    each row's end (`ends`; default all steps), and in the prompt step at the real positions (`real`: the mask)."""
    assert len(out.hidden_states) == len(ref.hidden_states) == out.sequences.shape[1] - out.hidden_states[0][0].shape[1]
    for step, (ours, theirs) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        assert len(ours) == len(theirs) == 5  # embeddings + 4 layers
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape and a.dtype == b.dtype
            for row in range(a.shape[0]):
                if ends is not None and step >= ends[row]:
                    continue
                keep = slice(None) if step or real is None else real[row].bool()
                torch.testing.assert_close(a[row, keep], b[row, keep], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["confu", "suffix", "hybrid"])
def test_hidden_states_match_plain_generate(kind, mode):
    """`output_hidden_states`: the prompt step's (1, T, H) and each new token's (1, 1, H) per layer, also inside
    long accepted blocks (tree passes and the accepted path's nodes) and with a ConFu adapter's `[con]` tokens."""
    target = tiny_target()
    prompts = [torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    corpus = oracle_corpus(target, prompts)
    if kind == "confu":  # a random draft: few tokens accepted, but every pass carries [con] tokens
        config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True)
        assistant, extra = ConFuAssistant.from_config(config, target, depth=3, top_k=2, total_tokens=6), {}
        extra = dict(contemplate_nodes=3)
    else:
        assistant, extra = ((suffix_assistant(target, corpus, total_tokens=8), {}) if kind == "suffix" else
                            (hybrid_assistant(target, corpus, depth=2, top_k=1, total_tokens=8), {}))
    for ids in prompts:
        ref = plain(target, ids, max_new_tokens=30, **HIDDEN)
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant, **HIDDEN, **extra,
                              **mode_kwargs(mode))
        assert torch.equal(out.sequences, ref.sequences) and out.hidden_states[0][0].shape == (1, 6, 32)
        assert kind == "confu" or assistant.stats.mean_accepted_tokens > 3
        assert_same_hidden_states(out, ref)


def test_batched_hidden_states_match_plain_batched_generate(mode):
    """Left-padded rows in the batched loop, an EOS ending the first row early: each row's hidden states as plain
    batched generate's up to its end (zeros after it), the prompt step's at the real positions."""
    target = tiny_target()
    ids, mask = left_padded(2, [4, 7, 5])
    prompts = [row[keep.bool()][None] for row, keep in zip(ids, mask)]
    first = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    eos = int(first[0, ids.shape[1] + 6])
    assistant = hybrid_assistant(target, oracle_corpus(target, prompts, 16, eos_token_id=eos))
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=eos, **HIDDEN)
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=assistant, tree_depth=2, tree_top_k=1, tree_total_tokens=8, **kwargs,
                          **mode_kwargs(mode))
    assert assistant.stats.mode == mode and assistant.stats.mean_accepted_tokens > 2
    assert torch.equal(out.sequences, ref.sequences)
    new = out.sequences[:, ids.shape[1]:]
    ends = [int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else new.shape[1] for row in new]
    assert ends[0] == 7 and max(ends) == 16
    assert_same_hidden_states(out, ref, ends, mask)
    assert all(not layer[0].any() for step in out.hidden_states[7:] for layer in step)  # row 0 ended: zeros


ATTENTIONS = dict(return_dict_in_generate=True, output_attentions=True)


@pytest.mark.parametrize("kind", ["eagle3", "confu", "suffix", "hybrid"])
def test_attentions_match_plain_generate(kind):
    """`output_attentions` (an eager-attention target): the prompt step's (1, heads, T, T) and each new token's
    (1, heads, 1, K) per layer over the positions before it, as plain generate returns them, also for tokens accepted
    deep in a tree (its weights over the path's earlier nodes) and beside a ConFu adapter's soft prompt and `[con]`."""
    target = tiny_target()
    target.set_attn_implementation("eager")
    prompts = [torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    corpus, extra = oracle_corpus(target, prompts), {}
    if kind == "confu":
        config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True)
        assistant, extra = ConFuAssistant.from_config(config, target, depth=3, top_k=2, total_tokens=6), dict(
            contemplate_nodes=3)
    else:
        assistant = {"eagle3": lambda: make_assistant(target, depth=3, top_k=2, total_tokens=6),
                     "suffix": lambda: suffix_assistant(target, corpus, total_tokens=8),
                     "hybrid": lambda: hybrid_assistant(target, corpus, depth=2, top_k=1, total_tokens=8)}[kind]()
    for ids in prompts:
        ref = plain(target, ids, max_new_tokens=30, **ATTENTIONS)
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant, **ATTENTIONS,
                              **extra)
        assert torch.equal(out.sequences, ref.sequences) and out.scores is None
        assert kind in ("eagle3", "confu") or assistant.stats.mean_accepted_tokens > 3
        assert len(out.attentions) == len(ref.attentions) == 30
        for step, (ours, theirs) in enumerate(zip(out.attentions, ref.attentions)):
            assert len(ours) == len(theirs) == 4
            for a, b in zip(ours, theirs):
                assert a.shape == b.shape == ((1, 4, 6, 6) if step == 0 else (1, 4, 1, 6 + step))
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_attentions_without_weights_and_where_they_are_refused():
    """An sdpa target returns no attention weights: an empty tuple per step, as plain generate's; batches and the
    static mode refuse `output_attentions` with a clear error."""
    target = tiny_target()
    assistant = make_assistant(target, depth=2, top_k=2, total_tokens=5)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    out = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=assistant, **ATTENTIONS)
    assert out.attentions == plain(target, ids, max_new_tokens=8, **ATTENTIONS).attentions == ((),) * 8
    batch, mask = left_padded(2, [4, 6])
    with pytest.raises(ValueError, match="one prompt at a time"):
        target.generate(batch, attention_mask=mask, max_new_tokens=4, assistant_model=assistant, **ATTENTIONS)
    with pytest.raises(ValueError, match="one prompt at a time"):
        target.generate(ids, max_new_tokens=4, assistant_model=assistant, cache_implementation="static", **ATTENTIONS)
