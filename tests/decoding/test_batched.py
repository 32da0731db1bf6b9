"""Batched speculative decoding: each row exactly what plain batched `generate` gives on the same padded batch."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import LastTokenIs, tiny_target, tiny_tokenizer
from test_generation import make_assistant
from test_sampling import SAMPLES, TEMPERATURE, TOP_K, exact_distribution, p_value
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

import transformers_confu.decoding.batched as batched
from transformers_confu import ConFuAssistant, ConFuDraftConfig, SuffixAssistant
from transformers_confu.decoding.batched import BatchStats, RowDrafters, batch_budget, batched_generate
from transformers_confu.decoding.generation import TreeBudget
from transformers_confu.decoding.oracle import OracleDrafter

BUDGETS = [dict(depth=1, top_k=1, total_tokens=2), dict(depth=3, top_k=1, total_tokens=4),
           dict(depth=3, top_k=2, total_tokens=6)]


def left_padded(seed: int, lengths: list[int], vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random prompts of these lengths, left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def plain(target, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kw)


def tree_kwargs(budget: dict) -> dict:
    return {f"tree_{name}": value for name, value in budget.items()}


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"d{b['depth']}k{b['top_k']}n{b['total_tokens']}")
def test_greedy_matches_plain_batched_generate(arch, budget):
    target = tiny_target(arch)
    assistant = make_assistant(target)
    for seed in range(5):
        ids, mask = left_padded(seed, [3 + seed, 9, 1, 14 - seed][: 2 + seed % 3])
        ref = plain(target, ids, mask, max_new_tokens=24)
        out = plain(target, ids, mask, max_new_tokens=24, assistant_model=assistant, **tree_kwargs(budget))
        assert torch.equal(out, ref), f"seed {seed}"
        stats = assistant.stats
        assert isinstance(stats, BatchStats) and stats.mode == "eager"
        assert stats.new_tokens == 24 * ids.shape[0]
        assert [sum(a) for a in stats.row_accept_lengths] == [23] * ids.shape[0]  # the first comes from the prefill


def noisy_oracles(reference: torch.Tensor, mask: torch.Tensor, depth: int, total: int) -> RowDrafters:
    """Per row an oracle drafter that knows the row's continuation, except at random positions (so rows accept
    different lengths in the same round)."""
    drafters = []
    for row in range(reference.shape[0]):
        g = torch.Generator().manual_seed(row)
        seq = reference[row, int((mask[row] == 0).sum()):].clone()
        wrong = torch.rand(seq.shape, generator=g) < 0.25
        seq[wrong] = (seq[wrong] + 1) % 128
        drafters.append(OracleDrafter(seq, depth, total, 128))
    return RowDrafters(drafters)


def oracle_batch(target, ids, mask, reference, max_new, stopping=None, **config):
    stats = BatchStats()
    out = batched_generate(target, noisy_oracles(reference, mask, 5, 9), [1, 2, 3], ids, mask,
                           GenerationConfig(do_sample=False, pad_token_id=0, **config), max_new, stats,
                           tokenizer=config.get("tokenizer"), stopping=stopping)
    return out, stats


def test_batch_runs_without_autograd():
    """A batch through the assistant builds no autograd graph, as plain `generate` does not: with a target whose
    weights require gradients, the returned logits and scores carry none."""
    target = tiny_target().requires_grad_(True)
    assistant, (ids, mask) = make_assistant(target), left_padded(7, [8, 5])
    out = target.generate(ids, attention_mask=mask, assistant_model=assistant, tree_total_tokens=6,
                          max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                          output_logits=True, output_scores=True)
    assert not any(step.requires_grad for step in out.logits + out.scores)


def test_rows_accepting_different_lengths_stay_exact(arch):
    target = tiny_target(arch)
    for seed in range(4):
        ids, mask = left_padded(seed, [2, 11, 6, 8 + seed])
        ref = plain(target, ids, mask, max_new_tokens=40)
        out, stats = oracle_batch(target, ids, mask, ref, 40)
        assert torch.equal(out, ref), f"seed {seed}"
        rounds = min(len(a) for a in stats.row_accept_lengths)
        assert any(len({a[i] for a in stats.row_accept_lengths}) > 1 for i in range(rounds))
        assert stats.mean_accepted_tokens > 2


def test_eos_rows_padded_as_plain_generate():
    target = tiny_target()
    assistant = make_assistant(target)
    ids, mask = left_padded(7, [5, 9, 3, 7])
    free = plain(target, ids, mask, max_new_tokens=40)
    eos = int(free[1, ids.shape[1] + 6])  # row 1 stops early; the others wherever this token comes
    for pad in (0, None):
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40, eos_token_id=eos,
                              pad_token_id=pad)
        assert ref.shape[1] < free.shape[1] or (ref[:, ids.shape[1]:] == eos).any()
        out, stats = oracle_batch(target, ids, mask, free, 40, eos_token_id=eos)
        config = dict(eos_token_id=eos, pad_token_id=pad)
        spec = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40,
                               assistant_model=assistant, tree_depth=2, **config)
        assert torch.equal(spec, ref)
        if pad == 0:
            assert torch.equal(out, ref)


def test_finished_rows_leave_the_batch(monkeypatch):
    target = tiny_target()
    ids, mask = left_padded(7, [5, 9, 3, 7])
    free = plain(target, ids, mask, max_new_tokens=30)
    eos = int(free[1, ids.shape[1] + 4])
    widths = []
    tree = batched._BatchTarget.tree

    def spy(self, trees, *args):
        widths.append(len(trees))
        return tree(self, trees, *args)

    monkeypatch.setattr(batched._BatchTarget, "tree", spy)
    out, _ = oracle_batch(target, ids, mask, free, 30, eos_token_id=eos)
    assert torch.equal(out, plain(target, ids, mask, max_new_tokens=30, eos_token_id=eos))
    assert widths[0] == 4 and widths[-1] < 4


def test_stop_strings_without_eos_keep_decoding_as_plain_generate():
    """Without an EOS id plain `generate` pads nothing: a row that met its stop string goes on until the last
    row stops."""
    target, tokenizer = tiny_target(), tiny_tokenizer()
    assistant = make_assistant(target)
    ids, mask = left_padded(3, [6, 4, 8])
    free = plain(target, ids, mask, max_new_tokens=40)
    stop = tokenizer.decode(free[0, ids.shape[1] + 5 : ids.shape[1] + 7])
    ref = plain(target, ids, mask, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer)
    out, _ = oracle_batch(target, ids, mask, free, 40, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(out, ref)
    out = plain(target, ids, mask, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer,
                assistant_model=assistant, tree_depth=2)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("eos", [None, 126], ids=["no-eos", "eos"])
def test_own_stopping_criteria_and_max_time_per_row_as_plain_generate(eos):
    """A call's `stopping_criteria=` fires per row (with an EOS id plain `generate` pads a stopped row, without
    one it goes on); `max_time=0` stops every row after its first token."""
    target = tiny_target()
    assistant = make_assistant(target)
    ids, mask = left_padded(3, [6, 4, 8])
    free = plain(target, ids, mask, max_new_tokens=40)
    stop = StoppingCriteriaList([LastTokenIs(int(free[1, ids.shape[1] + 6]))])
    ref = plain(target, ids, mask, max_new_tokens=40, eos_token_id=eos, stopping_criteria=stop)
    assert not torch.equal(ref[1], free[1]) if eos else ref.shape == free.shape  # row 1 padded after its stop
    out, _ = oracle_batch(target, ids, mask, free, 40, stopping=stop, eos_token_id=eos)
    assert torch.equal(out, ref)
    out = plain(target, ids, mask, max_new_tokens=40, eos_token_id=eos, stopping_criteria=stop,
                assistant_model=assistant, tree_depth=2)
    assert torch.equal(out, ref)
    ref = plain(target, ids, mask, max_new_tokens=40, eos_token_id=eos, max_time=0.0)
    out = plain(target, ids, mask, max_new_tokens=40, eos_token_id=eos, max_time=0.0, assistant_model=assistant,
                tree_depth=2)
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + 1


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_short_max_new_tokens(max_new):
    target = tiny_target()
    ids, mask = left_padded(4, [3, 8])
    ref = plain(target, ids, mask, max_new_tokens=max_new)
    out, _ = oracle_batch(target, ids, mask, plain(target, ids, mask, max_new_tokens=40), max_new)
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + max_new


def test_rows_match_batch_one_generate_where_plain_batched_does(arch):
    target = tiny_target(arch)
    assistant = make_assistant(target)
    ids, mask = left_padded(11, [4, 10, 7, 1, 12])
    out = plain(target, ids, mask, max_new_tokens=20, assistant_model=assistant, tree_depth=2, tree_top_k=1,
                tree_total_tokens=3)
    batch = plain(target, ids, mask, max_new_tokens=20)
    same = 0
    for row in range(ids.shape[0]):
        prompt = ids[row : row + 1, int((mask[row] == 0).sum()):]
        single = plain(target, prompt, torch.ones_like(prompt), max_new_tokens=20)
        if torch.equal(batch[row, -20:], single[0, -20:]):  # plain batched generate agrees with batch 1 (fp32)
            same += 1
            assert torch.equal(out[row, -20:], single[0, -20:]), f"row {row}"
    assert same >= 4


@pytest.mark.parametrize("entry, weight, nodes, top_k", [(True, 0.0, None, 1), (False, 0.5, 1, 1), (True, 0.5, 2, 2)],
                         ids=["f-entry-all-nodes-chain", "prior-1-node-chain", "f-entry-prior-2-nodes-tree"])
def test_confu_batch_matches_plain(entry, weight, nodes, top_k):
    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True, future_entry=entry,
                                         future_logit_weight=weight)
    assistant = ConFuAssistant.from_config(config, target)
    for seed in range(3):
        ids, mask = left_padded(seed, [5, 2, 9])
        ref = plain(target, ids, mask, max_new_tokens=20)
        out = plain(target, ids, mask, max_new_tokens=20, assistant_model=assistant, contemplate_nodes=nodes,
                    tree_depth=3, tree_top_k=top_k, tree_total_tokens=4 + 2 * (top_k - 1))
        assert torch.equal(out, ref), f"seed {seed}"
        assert assistant.stats.fresh_futures > 0


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny_target(vocab_size=6, init=0.15, seed=3)
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=4)
    config.initializer_range = 0.4  # a confident draft that is often wrong: many rejections
    assistant = ConFuAssistant.from_config(config, target, depth=2, top_k=2, total_tokens=4)
    assistant.draft.set_vocab_map(torch.tensor([0, 2, 3, 5]))
    prompts = [torch.tensor([1, 4, 2]), torch.tensor([3, 5])]
    return target, assistant, prompts, [exact_distribution(target, p) for p in prompts]


@pytest.mark.parametrize("top_k, options", [(1, {}), (2, {}), (2, dict(cache_implementation="static"))],
                         ids=["chain", "tree", "tree-static"])
def test_sampling_matches_exact_distribution_per_row(sampling_setup, top_k, options):
    target, assistant, prompts, exact = sampling_setup
    ids = torch.tensor([[1, 4, 2], [0, 3, 5]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    torch.manual_seed(0)
    counts = [{}, {}]
    for _ in range(SAMPLES):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, temperature=TEMPERATURE,
                              top_k=TOP_K, pad_token_id=0, assistant_model=assistant, tree_depth=2, tree_top_k=top_k,
                              tree_total_tokens=2 + top_k, **options)
        for row in range(2):
            key = tuple(out[row, 3:].tolist())
            counts[row][key] = counts[row].get(key, 0) + 1
    for row in range(2):
        assert p_value(exact[row], counts[row]) > 1e-3, f"row {row}"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])), "Right padding"),
        (dict(attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])), "Right padding"),
        (dict(attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]])), "all padding"),
        (dict(attention_mask=torch.ones(2, 3, dtype=torch.long)), "shape"),
        (dict(streamer=object()), "streamer"),
        (dict(cache_implementation="offloaded"), "not supported"),
        (dict(input_ids=torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]]), pad_token_id=0), "no attention_mask"),
    ],
)
def test_unsupported_batches_raise_clear_errors(kwargs, match):
    target = tiny_target()
    assistant = make_assistant(target)
    kwargs = {"input_ids": torch.ones(2, 4, dtype=torch.long), "max_new_tokens": 5, **kwargs}
    with pytest.raises(ValueError, match=match):
        target.generate(assistant_model=assistant, **kwargs)


def test_sliding_window_targets_refused_for_batches():
    target = tiny_target("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assistant = make_assistant(target)
    with pytest.raises(ValueError, match="full-attention"):
        target.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=5, assistant_model=assistant)


def test_auto_budget_policy_and_plain_fallback():
    saved = TreeBudget(depth=3, top_k=2, total_tokens=6)
    assert batch_budget(saved, 1) == saved
    assert batch_budget(saved, 2) == TreeBudget(depth=1, top_k=1, total_tokens=2)  # this CPU: a short chain
    assert batch_budget(saved, 2, sample=True) is None  # sampling: plain generate from batch 2
    assert batch_budget(saved, 1, sample=True) == saved
    assert batch_budget(saved, 4) is None  # then plain generate
    assert batch_budget(saved, 16, "cuda") == TreeBudget(depth=3, top_k=1, total_tokens=4)
    assert batch_budget(saved, 16, "cuda", sample=True) == TreeBudget(depth=3, top_k=1, total_tokens=4)
    assert batch_budget(saved, 64, "cuda") is None
    target = tiny_target()
    assistant = make_assistant(target)
    ids, mask = left_padded(5, [3, 6, 2, 5])
    ref = plain(target, ids, mask, max_new_tokens=6)
    assert torch.equal(plain(target, ids, mask, max_new_tokens=6, assistant_model=assistant), ref)
    assert assistant.stats.mode == "plain" and assistant.stats.new_tokens == 6 * 4
    out = plain(target, ids, mask, max_new_tokens=6, assistant_model=assistant, tree_depth=2)  # an explicit budget
    assert torch.equal(out, ref) and assistant.stats.mode == "eager"
    out = plain(target, ids[:2], mask[:2], max_new_tokens=6, assistant_model=assistant)  # batch 2: a chain
    assert torch.equal(out, plain(target, ids[:2], mask[:2], max_new_tokens=6)) and assistant.stats.mode == "eager"
    sampled = dict(attention_mask=mask[:2], max_new_tokens=6, do_sample=True, temperature=0.7, pad_token_id=0)
    torch.manual_seed(3)
    ref = target.generate(ids[:2], **sampled)
    torch.manual_seed(3)  # sampled at batch 2: plain generate itself, so the same draws
    out = target.generate(ids[:2], assistant_model=assistant, **sampled)
    assert torch.equal(out, ref) and assistant.stats.mode == "plain"


class Messages(logging.Handler):
    """Collects what transformers logs (its loggers do not propagate to pytest's)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("length", [dict(max_new_tokens=6), dict(max_length=14)], ids=["max_new_tokens", "max_length"])
def test_plain_fallback_has_plain_generates_length_and_no_extra_warning(length):
    """Where the policy leaves a batch to plain generate, the call's length is kept and transformers does not warn
    that both `max_new_tokens` and `max_length` were set (the merged config's default `max_length`)."""
    target = tiny_target()
    assistant = make_assistant(target)
    ids, mask = left_padded(5, [3, 6, 2, 5])
    handler = Messages()
    logging.getLogger("transformers").addHandler(handler)
    try:
        ref = plain(target, ids, mask, **length)
        before = list(handler.messages)
        out = plain(target, ids, mask, assistant_model=assistant, **length)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert assistant.stats.mode == "plain" and torch.equal(out, ref)
    assert handler.messages[len(before):] == before  # what plain generate logs, nothing more


def test_return_dict_in_generate_holds_the_sequences():
    """`return_dict_in_generate=True`: a `GenerateDecoderOnlyOutput` whose sequences are plain generate's."""
    target = tiny_target()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=10)
    for assistant in (make_assistant(target), SuffixAssistant(target)):
        out = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=assistant,
                              return_dict_in_generate=True)
        assert isinstance(out, GenerateDecoderOnlyOutput) and torch.equal(out.sequences, ref) and out.scores is None
    batch, mask = left_padded(1, [5, 9, 3])
    ref = target.generate(batch, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=10)
    for tree in (dict(tree_depth=2, tree_top_k=1, tree_total_tokens=3), {}):  # a chain; the policy's plain generate
        out = target.generate(batch, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=10,
                              assistant_model=make_assistant(target), return_dict_in_generate=True, **tree)
        assert isinstance(out, GenerateDecoderOnlyOutput) and torch.equal(out.sequences, ref)
    assert out.past_key_values is not None  # plain generate's own output
