"""generate's logits processors (penalties, constraints, custom ones) with an assistant: still lossless."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import tiny_target
from test_batched import left_padded
from test_generation import make_assistant, mode, mode_kwargs, plain  # noqa: F401 (mode: a fixture)
from test_sampling import NEW, SAMPLES, TEMPERATURE, TOP_K, VOCAB, exact_distribution, p_value, sampled_counts
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import transformers_confu.decoding.processing as processing
from transformers_confu import ConFuAssistant, ConFuDraftConfig, SuffixAssistant
from transformers_confu.decoding.generation import SpeculativeStats, speculative_generate
from transformers_confu.decoding.oracle import OracleDrafter
from transformers_confu.decoding.processing import NodeProcessing, node_prefixes, node_processing
from transformers_confu.decoding.suffix import SuffixProposer
from transformers_confu.decoding.tree import DraftTree

EOS = 3


class ByPosition(LogitsProcessor):
    """A custom processor that reads its input ids: at position p no token t with t = p (mod 3)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        banned = torch.arange(scores.shape[-1], device=scores.device) % 3 == input_ids.shape[-1] % 3
        return scores.masked_fill(banned, float("-inf"))


def even_after_odd(batch_id: int, ids: torch.Tensor) -> list[int]:
    """`prefix_allowed_tokens_fn`: after an odd token only even ones."""
    return list(range(0, 128, 2)) if int(ids[-1]) % 2 else list(range(128))


SETTINGS = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 8]]),
    "sequence_bias": dict(sequence_bias={(9,): 4.0, (10, 11): 6.0}),
    "min_new_tokens": dict(min_new_tokens=15, eos_token_id=EOS),
    "suppress_tokens": dict(suppress_tokens=[1, 2], begin_suppress_tokens=[4]),
    "forced_eos_token_id": dict(forced_eos_token_id=EOS, eos_token_id=EOS),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(4, 1.3), eos_token_id=EOS),
    "logits_processor": dict(logits_processor=LogitsProcessorList([ByPosition()])),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=even_after_odd),
    "several": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, renormalize_logits=True),
}


# generate's per-token outputs: `GenerateDecoderOnlyOutput.scores` (processed) and `.logits` (raw)
SCORES = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


def assert_same_steps(out, ref, prompt_len: int, eos: int | None = None) -> None:
    """Same sequences, and per new token the same scores and logits (up to the float error of a tree pass); with
    `eos`, each row's up to its end (its EOS) and zeros after it (where its sequence holds padding)."""
    assert torch.equal(out.sequences, ref.sequences)
    steps = out.sequences.shape[1] - prompt_len
    for name in ("scores", "logits"):
        ours, theirs = getattr(out, name), getattr(ref, name)
        assert len(ours) == len(theirs) == steps, name
        for row, new in enumerate(out.sequences[:, prompt_len:].tolist()):
            end = new.index(eos) + 1 if eos in new else steps
            for step, (a, b) in enumerate(zip(ours, theirs)):
                where = f"{name}, row {row}, step {step}"
                assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, where
                if step < end:
                    torch.testing.assert_close(a[row], b[row], atol=1e-4, rtol=1e-4, msg=where)
                else:
                    assert not a[row].any(), f"{where} (after its end)"


@pytest.mark.parametrize("name", SETTINGS)
def test_greedy_with_processors_matches_plain_generate(arch, name, mode):
    """The tokens, and each new token's processed scores and raw logits (`output_scores`, `output_logits`)."""
    target = tiny_target(arch)
    assistant = make_assistant(target, depth=3, top_k=2, total_tokens=6)
    for seed in range(4):
        ids = torch.randint(0, 128, (1, 3 + 4 * seed), generator=torch.Generator().manual_seed(seed))
        ref = plain(target, ids, max_new_tokens=24, **SETTINGS[name], **SCORES)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant,
                              **SETTINGS[name], **mode_kwargs(mode), **SCORES)
        assert_same_steps(out, ref, ids.shape[1])


def oracle_run(target, ids, reference, record=None, new=30, **options):
    """The loop with an oracle that drafts the reference 4 deep: every node of long accepted paths is processed
    (`new`: the most new tokens; `record`: a `StepScores` for the new tokens' scores)."""
    config = GenerationConfig(do_sample=False, pad_token_id=0, **{k: v for k, v in options.items()
                                                                  if k not in processing.CALL_OPTIONS})
    extra = {k: v for k, v in options.items() if k in processing.CALL_OPTIONS}
    stats = SpeculativeStats()
    rows = node_processing(target, config, ids, ids.shape[1] + new, **extra)
    out = speculative_generate(target, OracleDrafter(reference, 4, 8, 128), [1, 2, 3], ids, config, new, stats,
                               processing=rows[0], record=record)
    return out, stats


@pytest.mark.parametrize("options", [SETTINGS["repetition_penalty"], dict(no_repeat_ngram_size=1),
                                     SETTINGS["logits_processor"]], ids=["penalty", "ngram", "custom"])
def test_deep_nodes_are_processed_with_their_own_prefix(options, monkeypatch):
    """With an oracle draft whole paths are accepted; processing a node with the context alone (its drafted
    ancestors left out) must be caught (negative control)."""
    target = tiny_target()
    wrong = 0
    for seed in range(4):
        ids = torch.randint(0, 128, (1, 4 + seed), generator=torch.Generator().manual_seed(seed))
        ref = plain(target, ids, max_new_tokens=30, **options)
        out, stats = oracle_run(target, ids, ref, **options)
        assert torch.equal(out, ref), f"seed {seed}"
        assert stats.mean_accepted_tokens > 4
        with monkeypatch.context() as patch:
            patch.setattr(processing, "node_prefixes", lambda context, tree: [context] * len(tree))
            wrong += not torch.equal(oracle_run(target, ids, ref, **options)[0], ref)
    assert wrong >= 2


def test_allows_finds_the_bans_that_depend_on_the_ids_alone():
    """`NodeProcessing.allows`: an n-gram ban (also deep in a path), a banned word and the EOS before
    `min_new_tokens` reject their token; a repetition penalty rejects nothing."""
    import numpy as np

    target = tiny_target()
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    context = ids[0].numpy()
    settings = dict(no_repeat_ngram_size=3, bad_words_ids=[[9]], min_new_tokens=4, eos_token_id=7)
    row = node_processing(target, GenerationConfig(**settings), ids, 40)[0]
    assert not row.allows(context, (3,)) and row.allows(context, (4,))
    assert not row.allows(context, (4, 9)) and not row.allows(context, (5, 7)) and row.allows(context, (5, 6))
    assert not row.allows(np.array([1, 2, 4, 2]), (4, 2, 4))  # the path's own tokens repeat (2, 4)
    penalty = node_processing(target, GenerationConfig(repetition_penalty=1.5), ids, 40)[0]
    assert all(penalty.allows(context, (token,)) for token in range(128))


@contextlib.contextmanager
def suffix_bans(monkeypatch, setting: str):
    """Suffix candidates that the processors ban "left out" (as built) or "verified" (the proposer ignores its
    `allowed` predicate: the negative control)."""
    with monkeypatch.context() as patch:
        if setting == "verified":
            ignore = SuffixProposer.best_paths
            patch.setattr(SuffixProposer, "best_paths", lambda self, context, allowed=None: ignore(self, context))
        yield


def test_banned_suffix_candidates_are_left_out(monkeypatch):
    """Under `no_repeat_ngram_size` a repetitive sequence's own continuations repeat its n-grams: the proposer leaves
    out the candidates the processors ban, so rounds verify fewer nodes for the same output; verifying them anyway
    (the predicate ignored: negative control) takes more."""
    from test_suffix import repetitive_prompt

    target = tiny_target()
    assistant = SuffixAssistant(target, total_tokens=6)
    verified = {}
    for setting in ("left out", "verified"):
        with suffix_bans(monkeypatch, setting):
            verified[setting] = 0
            for seed in range(4):
                ids = repetitive_prompt(seed)
                ref = plain(target, ids, max_new_tokens=24, no_repeat_ngram_size=2)
                out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant,
                                      no_repeat_ngram_size=2)
                assert torch.equal(out, ref), f"{setting}, seed {seed}"
                verified[setting] += sum(assistant.stats.tree_sizes)
    assert verified["left out"] < verified["verified"]


def test_batched_banned_suffix_candidates_are_left_out(monkeypatch):
    """In a left-padded batch each row's suffix candidates that its n-gram ban forbids take no node: no verified
    suffix node repeats a bigram of its row's prefix (the padding counted, as plain batched `generate` counts it),
    and the outputs are plain batched `generate`'s; verifying them anyway (negative control) puts such nodes in."""
    from test_suffix import repetitive_prompt

    from transformers_confu.decoding.batched import RowDrafters

    target = tiny_target()
    assistant = SuffixAssistant(target)
    prompts = [repetitive_prompt(seed)[0] for seed in (0, 2, 4)]  # 9, 13 and 14 tokens
    width = max(p.numel() for p in prompts)
    ids = torch.stack([torch.nn.functional.pad(p, (width - p.numel(), 0)) for p in prompts])
    mask = torch.stack([torch.arange(width) >= width - p.numel() for p in prompts]).long()
    propose, repeated = RowDrafters.propose, {}

    def repeats(ids: list[int]) -> bool:  # the last token repeats a bigram of the ids before it
        return tuple(ids[-2:]) in set(zip(ids[:-2], ids[1:-1]))

    def spy(self, roots, lengths, priors, contexts, allowed=None):
        trees = propose(self, roots, lengths, priors, contexts, allowed)
        for context, tree in zip(contexts, trees):
            row = next(r for r, p in enumerate(prompts) if context[: p.numel()].tolist() == p.tolist())
            prefix = [0] * (width - prompts[row].numel()) + context.tolist()
            for node in (tree.sources >= 2).nonzero()[:, 0].tolist():
                path = []
                while node:
                    path, node = [int(tree.tokens[node])] + path, int(tree.parents[node])
                repeated[setting] += repeats(prefix + path)
        return trees

    monkeypatch.setattr(RowDrafters, "propose", spy)
    for setting in ("left out", "verified"):
        with suffix_bans(monkeypatch, setting):
            repeated[setting] = 0
            options = dict(attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=24,
                           no_repeat_ngram_size=2)
            out = target.generate(ids, assistant_model=assistant, tree_total_tokens=6, **options)
            assert torch.equal(out, target.generate(ids, **options)), setting
            assert assistant.stats.mode == "eager"
    assert repeated["left out"] == 0 and repeated["verified"] > 0


def test_suffix_assistant_with_processors_matches_plain_generate():
    target = tiny_target()
    assistant = SuffixAssistant(target, total_tokens=6)
    for seed in range(4):
        ids = torch.randint(0, 16, (1, 12), generator=torch.Generator().manual_seed(seed))  # repeats to match
        for name in ("repetition_penalty", "no_repeat_ngram_size"):
            ref = plain(target, ids, max_new_tokens=24, **SETTINGS[name])
            out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant, **SETTINGS[name])
            assert torch.equal(out, ref), f"{name}, seed {seed}"


@pytest.mark.parametrize("name", ["repetition_penalty", "no_repeat_ngram_size", "logits_processor", "min_new_tokens"])
@pytest.mark.parametrize("tree", [dict(tree_depth=1, tree_top_k=1, tree_total_tokens=2),
                                  dict(tree_depth=3, tree_top_k=2, tree_total_tokens=6)], ids=["chain", "tree"])
def test_batched_greedy_with_processors_matches_plain_batched_generate(name, tree):
    """Left-padded rows: the penalty leaves each row's padding out, as plain batched `generate` does."""
    target = tiny_target()
    assistant = make_assistant(target)
    for seed in range(3):
        ids, mask = left_padded(seed, [4 + seed, 11, 2][: 2 + seed % 2])
        ref = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=20,
                              **SETTINGS[name])
        out = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=20,
                              assistant_model=assistant, **tree, **SETTINGS[name])
        assert torch.equal(out, ref), f"seed {seed}"
        assert assistant.stats.mode == "eager"


def test_batched_prefix_allowed_tokens_fn_sees_each_rows_index():
    target = tiny_target()
    assistant = make_assistant(target)
    ids, mask = left_padded(5, [6, 3])

    def by_row(batch_id: int, sent: torch.Tensor) -> list[int]:  # row 0 even tokens, row 1 odd ones
        return list(range(batch_id, 128, 2))

    options = dict(attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=12,
                   prefix_allowed_tokens_fn=by_row)
    ref = target.generate(ids, **options)
    assert (ref[0, 6:] % 2 == 0).all() and (ref[1, 6:] % 2 == 1).all()
    assert torch.equal(target.generate(ids, assistant_model=assistant, tree_depth=3, tree_top_k=2, tree_total_tokens=6,
                                       **options), ref)


def test_plain_fallback_of_a_batch_gets_the_processors():
    """Where the batch policy runs plain batched generate, the call's processors go with it."""
    target = tiny_target()
    assistant = make_assistant(target)
    ids, mask = left_padded(4, [5, 8, 3, 6])
    options = SETTINGS["logits_processor"]
    ref = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=12, **options)
    out = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=12,
                          assistant_model=assistant, **options)
    assert assistant.stats.mode == "plain"
    assert torch.equal(out, ref)


PENALTY = 1.8


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny_target(vocab_size=VOCAB, init=0.15, seed=3)
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=VOCAB)
    config.initializer_range = 0.4
    assistant = ConFuAssistant.from_config(config, target, draft_dtype="float32", depth=2, top_k=2, total_tokens=5)
    return target, assistant, torch.tensor([1, 4, 2])


def test_sampling_with_a_repetition_penalty_matches_exact_distribution(sampling_setup):
    target, assistant, prompt = sampling_setup
    exact = exact_distribution(target, prompt, penalty=PENALTY)
    assert abs(sum(exact.values()) - 1) < 1e-9
    assert p_value(exact, sampled_counts(target, assistant, prompt, repetition_penalty=PENALTY)) > 1e-3


def test_batched_sampling_with_a_repetition_penalty_matches_exact_distribution_per_row(sampling_setup):
    """Two rows, the second left-padded: each row's penalty leaves its padding out, as plain batched generate."""
    target, assistant, _ = sampling_setup
    exact = [exact_distribution(target, torch.tensor(p), penalty=PENALTY) for p in ([1, 4, 2], [3, 5])]
    ids, mask = torch.tensor([[1, 4, 2], [0, 3, 5]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    torch.manual_seed(0)
    counts = [{}, {}]
    for _ in range(SAMPLES):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=TEMPERATURE,
                              top_k=TOP_K, repetition_penalty=PENALTY, pad_token_id=0, assistant_model=assistant,
                              tree_depth=2, tree_top_k=2, tree_total_tokens=5)
        for row in range(2):
            key = tuple(out[row, 3:].tolist())
            counts[row][key] = counts[row].get(key, 0) + 1
    for row in range(2):
        assert p_value(exact[row], counts[row]) > 1e-3, f"row {row}"


def test_sampling_under_a_ban_on_repeats_never_repeats(sampling_setup, monkeypatch):
    """`no_repeat_ngram_size=1`: only the continuations of distinct new tokens are possible; processing the nodes
    without their drafted ancestors (negative control) samples impossible ones."""
    target, assistant, prompt = sampling_setup
    exact = exact_distribution(target, prompt, no_repeat=True)
    assert abs(sum(exact.values()) - 1) < 1e-9 and set(exact) == {(0, 3, 5), (0, 5, 3), (3, 0, 5), (3, 5, 0),
                                                                      (5, 0, 3), (5, 3, 0)}
    assert set(sampled_counts(target, assistant, prompt, 500, no_repeat_ngram_size=1)) == set(exact)
    monkeypatch.setattr(processing, "node_prefixes", lambda context, tree: [context] * len(tree))
    assert not set(sampled_counts(target, assistant, prompt, 500, no_repeat_ngram_size=1)) <= set(exact)


def test_token_free_warpers_run_once_on_all_nodes():
    target = tiny_target()
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2)
    ids = torch.ones(1, 4, dtype=torch.long)
    row = node_processing(target, config, ids, 20)[0]
    assert [type(p).__name__ for p in row.per_prefix] == ["RepetitionPenaltyLogitsProcessor"]
    assert [type(p).__name__ for p in row.token_free] == ["TemperatureLogitsWarper", "TopKLogitsWarper",
                                                          "TopPLogitsWarper"]
    greedy = node_processing(target, GenerationConfig(do_sample=False), ids, 20)[0]
    assert not (greedy.per_prefix or greedy.token_free)
    logits = torch.randn(3, 128, dtype=torch.bfloat16)
    assert greedy.scores(logits, ids) is logits  # nothing to apply: the loop's argmax reads the logits as they are
    warped = NodeProcessing(LogitsProcessorList(row.token_free), sample=True).scores(logits, ids, None)
    assert warped.dtype == torch.float32 and torch.isinf(warped).sum(-1).min() >= 128 - 5


def test_node_prefixes_follow_each_nodes_ancestors():
    tree = DraftTree.from_parents([7, 1, 2, 3, 4], [-1, 0, 0, 1, 3])  # root 7; 1 and 2 under it; 3 under 1; 4 under 3
    context = torch.tensor([5, 6, 7])
    got = [p.tolist() for p in node_prefixes(context, tree)]
    assert got == [[5, 6, 7], [5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 7, 1, 3], [5, 6, 7, 1, 3, 4]]


