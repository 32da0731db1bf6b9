"""Batched speculative decoding: B left-padded prompts, one draft tree (or chain) per row, every row's tree
verified in the same target pass.

Rows advance at their own pace. The caches are shared tensors in which each row keeps its own valid entries
`[start, end)` (`RowCache`: the rest of its row is masked); each row has its own positions (numbered as plain
batched `generate` numbers them, padding excluded), its own acceptance and its own stopping. After a verify
pass each row's accepted path is moved down to that row's end; finished rows leave the batch. The output is
padded as plain batched `generate` pads it (`pad_token_id` after a row's end).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import Cache, DynamicCache, GenerationConfig, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import StaticLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..models.contemplate import ContemplateAdapter, soft_prompt_mask
from ..models.modeling_confu import ConFuDraftModel
from ..utils.cache import cache_kwargs, full_attention, growing_cache, key_width, truncate_cache
from ..utils.masks import to_additive
from .generation import (
    SOURCE_NAMES,
    SpeculativeStats,
    StaticTarget,
    StepScores,
    TreeBudget,
    _append,
    node_states,
    stopping_criteria,
)
from .processing import NodeProcessing, node_processing, probabilities
from .suffix import SuffixProposer
from .tree import DraftTree, TreeDrafter, _pick, pad_keys
from .verify import accept_greedy, accept_sampling


@dataclass
class BatchStats(SpeculativeStats):
    """`SpeculativeStats` of a batched call: `accept_lengths` holds every row's rounds, `row_accept_lengths`
    each row's own (its tau is their mean), `row_accepted_by_source` each row's part of `accepted_by_source`;
    `new_tokens` counts the real tokens of all rows (no padding); `mode` is `"plain"` when the budget policy left
    the call to plain `generate`."""

    row_accept_lengths: list[list[int]] = field(default_factory=list)
    row_accepted_by_source: list[Counter] = field(default_factory=list)

    def __str__(self) -> str:
        taus = [sum(rounds) / len(rounds) for rounds in self.row_accept_lengths if rounds]
        return super().__str__() + (f"; {len(taus)} rows, tau {min(taus):.2f}-{max(taus):.2f}" if taus else "")


# Per device type: (the largest batch that drafts a chain, the chain's depth; None: the draft's saved depth);
# larger batches run plain `generate`. CPU: measured on this project's 2-core machine (results/batched_policy.md:
# depth 1 was the best chain at batches 2 and 4, and only at batch 2 did it reach plain batched `generate`);
# other devices: not measured here, the literature's figure (SGLang's EAGLE-3 chains still pay at batch 32 on a GPU).
CHAINS = {"cpu": (2, 1)}
CHAINS_ELSEWHERE = (32, None)
# When sampling: the CPU's batch-2 chain did not pay (results/batched_sampling_policy.md: 0.95-0.96x of plain batched
# `generate` with the shipped default, 1.01x for the draft's chain; greedy 1.14-1.17x in the same session), so sampled
# batches run plain there; other devices: as `CHAINS`.
SAMPLED_CHAINS = {"cpu": (1, 1)}
# Draft-free suffix trees (SuffixAssistant), per device type: the largest batch that speculates (their width stays).
# CPU: measured (results/batched_suffix_policy.md): at batches 2 and 4, trees of 4 and 8 nodes, with and without the
# corpus, came out at 0.62-0.96x of plain batched `generate`, so batches run plain; other devices: as `CHAINS`.
SUFFIX_BATCHES = {"cpu": 1}
SUFFIX_BATCHES_ELSEWHERE = 32


def batch_budget(budget: TreeBudget, batch_size: int, device_type: str = "cpu", drafted: bool = True,
                 sample: bool = False) -> TreeBudget | None:
    """The `auto` budget for a batch: `budget` at batch 1; above it a chain (a tree's verify pass is B x nodes
    wide, and its draft runs row by row) up to the device's largest batch in `CHAINS` (`SAMPLED_CHAINS` when
    `sample`); None (plain `generate`) beyond, where speculation stops paying. Draft-free trees (not `drafted`) keep
    `budget` up to the device's largest batch in `SUFFIX_BATCHES`."""
    if batch_size == 1:
        return budget
    if not drafted:
        return budget if batch_size <= SUFFIX_BATCHES.get(device_type, SUFFIX_BATCHES_ELSEWHERE) else None
    largest, depth = (SAMPLED_CHAINS if sample else CHAINS).get(device_type, CHAINS_ELSEWHERE)
    if batch_size > largest:
        return None
    depth = budget.depth if depth is None else min(depth, budget.depth)
    return TreeBudget(depth=depth, top_k=1, total_tokens=depth + 1)


class RowCache:
    """A key/value cache (growing, or static: `utils.cache.static_cache`) whose rows hold different numbers of
    entries: row b's are `[start[b], end[b])` (host ints); entries past a row's end are stale and masked. `move`:
    `keep`'s fixed-shape copy (`move_rows`, or its compiled version)."""

    def __init__(self, cache: Cache, start: list[int], end: list[int], move: Callable | None = None) -> None:
        self.cache, self.start, self.end, self.move = cache, start, end, move or move_rows

    @property
    def filled(self) -> int:
        """The entries written: where the next pass writes."""
        return max(self.end)

    def visible(self, device: torch.device) -> torch.Tensor:
        """(B, filled) bool: the cached keys each row sees."""
        keys = torch.arange(self.filled, device=device)
        start, end = torch.tensor([self.start, self.end], device=device)[..., None]  # one host-to-device copy
        return (keys >= start) & (keys < end)

    def mask(self, new: torch.Tensor, dtype: torch.dtype, prefix: torch.Tensor | None = None) -> torch.Tensor:
        """The additive (B, 1, Q, W) mask of Q queries that see the cached keys `prefix` says ((B, filled) or
        (B, Q, filled) bool; default `visible`) and, of K entries written after them, those `new` (B, Q, K) says;
        W: the cache's key axis after that write (a `StaticLayer`'s capacity: the rest hidden)."""
        rows, queries, count = new.shape
        prefix = self.visible(new.device) if prefix is None else prefix
        if prefix.ndim == 2:
            prefix = prefix[:, None].expand(rows, queries, -1)
        return pad_keys(to_additive(torch.cat([prefix, new], -1), dtype)[:, None],
                        key_width(self.cache, self.filled + count))

    def keep(self, base: int, paths: torch.Tensor, counts: list[int]) -> None:
        """After a pass appended entries at `base`: move row b's `base + paths[b, :counts[b]]` down to its end
        and drop the rest (`paths` (B, P), P at most the number of entries appended)."""
        ends = torch.tensor(self.end, device=paths.device)
        self.move(self.cache, paths + base, ends[:, None] + torch.arange(paths.shape[1], device=paths.device))
        self.end = [end + count for end, count in zip(self.end, counts)]
        truncate_cache(self.cache, self.filled)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); a static layer's rows are compacted into its buffer's first
        ones (`utils.cache.reset_cache` gives it back whole)."""
        index = torch.tensor(rows, device=self.cache.layers[0].keys.device)
        self.start, self.end = [self.start[r] for r in rows], [self.end[r] for r in rows]
        for layer in self.cache.layers:
            if isinstance(layer, StaticLayer):
                for states in (layer.keys, layer.values):
                    states[: len(rows), :, : self.filled] = states[index, :, : self.filled]
                layer.keys, layer.values = layer.keys[: len(rows)], layer.values[: len(rows)]
            else:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        truncate_cache(self.cache, self.filled)


def move_rows(cache: Cache, source: torch.Tensor, dest: torch.Tensor) -> None:
    """In every layer, copy row b's entries `source[b]` (P,) to `dest[b]` (P,): one fixed-shape gather and
    scatter (the static mode compiles it)."""
    source, dest = source[:, None, :, None], dest[:, None, :, None]
    for layer in cache.layers:
        for states in (layer.keys, layer.values):
            shape = (source.shape[0], states.shape[1], source.shape[2], states.shape[3])
            states.scatter_(2, dest.expand(shape), states.gather(2, source.expand(shape)))


class _BatchTarget:
    """The target's passes over a left-padded batch: the prompt pass, then one pass over every row's tree (and,
    with a `ContemplateAdapter`, its `[con]` tokens, which alone see the soft prompt's `offset` entries).
    `static`: the static mode's cache (empty, B rows) and calls (the prompt pass always runs the model itself);
    default a growing cache."""

    def __init__(self, model: PreTrainedModel, feature_layers: list[int], adapter: ContemplateAdapter | None,
                 pads: list[int], reserve: int, con_logits: bool = False, static: StaticTarget | None = None,
                 keep_hidden: bool = False) -> None:
        self.model, self.layers, self.adapter, self.con_logits = model, feature_layers, adapter, con_logits
        self.keep_hidden, self.hidden = keep_hidden, None  # the last pass's hidden states, every layer
        cache = growing_cache(model.config, reserve) if static is None else static.cache
        self.call = model if static is None else static.call
        self.offset = 0 if adapter is None else adapter.num_soft_tokens
        if adapter is not None:
            for index, kv in enumerate(adapter.constant_soft_kv(model)):
                cache.update(*(s.expand(len(pads), -1, -1, -1).contiguous() for s in kv), index)
        self.rows = RowCache(cache, [self.offset + pad for pad in pads], [self.offset] * len(pads),
                             None if static is None else static.keep)
        self.kwargs = cache_kwargs(model, cache)
        self.base = 0

    def _forward(self, call, keep: int | torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        out = call(**inputs, use_cache=True, output_hidden_states=True, logits_to_keep=keep, **self.kwargs)
        self.hidden = out.hidden_states if self.keep_hidden else None
        return out.logits, torch.cat([out.hidden_states[i] for i in self.layers], dim=-1)

    def prefill(self, ids: torch.LongTensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt pass, positions numbered from each row's first real token: (B, V) logits at the last
        position, (B, T, 3H) features."""
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        mask = attention_mask
        if self.adapter is not None:
            n, real = ids.shape[1], attention_mask.bool()
            causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
            visible = (causal & real[:, None, :]) | torch.eye(n, dtype=torch.bool, device=ids.device)
            mask = pad_keys(soft_prompt_mask(visible, self.offset, real.new_zeros(real.shape), self.model.dtype),
                            key_width(self.rows.cache, self.offset + n))
        logits, features = self._forward(self.model, 1, input_ids=ids, position_ids=positions, attention_mask=mask)
        self.rows.end = [self.offset + ids.shape[1]] * ids.shape[0]
        return logits[:, -1], features

    def tree(self, trees: list[DraftTree], lengths: torch.Tensor, cons: torch.Tensor | None,
             states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Verify row b's `trees[b]` (root at position `lengths[b]`) in one pass: (B, N, V) logits and (B, N, 3H)
        features at the nodes; (B, M, 3H) features at the `[con]` tokens of nodes `cons` (B, M) (routed by
        `states` (B, 3H)) and, with `con_logits`, their (B, M, V) logits."""
        tokens = torch.stack([t.tokens for t in trees])
        ancestry = torch.stack([t.ancestry for t in trees])
        positions = lengths[:, None] + torch.stack([t.depths for t in trees])
        (rows, n), self.base, dtype = tokens.shape, self.rows.filled, self.model.dtype
        if self.adapter is None:
            logits, features = self._forward(self.call, n, input_ids=tokens, position_ids=positions,
                                             attention_mask=self.rows.mask(ancestry, dtype))
            return logits, features, None, None
        m = cons.shape[1]
        eye = torch.eye(m, dtype=torch.bool, device=tokens.device).expand(rows, m, m)
        node_rows = torch.cat([ancestry, ancestry.new_zeros(rows, n, m)], dim=-1)
        con_rows = torch.cat([ancestry.gather(1, cons[..., None].expand(rows, m, n)), eye], dim=-1)
        prefix = self.rows.visible(tokens.device)[:, None].repeat(1, n + m, 1)
        prefix[:, n:, : self.offset] = True  # the soft prompt, seen by the [con] tokens only
        con = self.adapter.con_embedding(states).to(dtype)[:, None].expand(rows, m, -1)
        embeds = torch.cat([self.model.get_input_embeddings()(tokens), con], dim=1)
        positions = torch.cat([positions, positions.gather(1, cons) + 1], dim=1)
        keep = torch.arange(n + m if self.con_logits else n, device=tokens.device)
        logits, features = self._forward(self.call, keep, inputs_embeds=embeds, position_ids=positions,
                                         attention_mask=self.rows.mask(torch.cat([node_rows, con_rows], 1), dtype,
                                                                       prefix))
        return (logits[:, :n], features[:, :n], features[:, n:],
                logits[:, n:] if self.con_logits else None)

    def keep(self, paths: torch.Tensor, counts: list[int]) -> None:
        """Keep each row's accepted path of the last tree pass."""
        self.rows.keep(self.base, paths, counts)


class RowDrafters:
    """One batch-1 drafter per row (`TreeDrafter`, or `SuffixDrafter` without a draft): any tree budget, ConFu's
    `[f]` entries, suffix candidates (each row its own proposer and context); the draft runs row by row. A row
    fed no accepted tokens (count 0: a finished row kept in a compiled batch) is not caught up. `scalars`: the
    positions go to the drafters as 0-d device tensors (compiled calls: one graph for every position)."""

    def __init__(self, drafters: list[TreeDrafter], scalars: bool = False) -> None:
        self.drafters, self.d2t, self.scalars = drafters, drafters[0].d2t, scalars
        self.draft = getattr(drafters[0], "draft", None)

    def _at(self, value: int, device: torch.device) -> int | torch.Tensor:
        return torch.tensor(value, device=device) if self.scalars else value

    def prefill(self, next_ids: torch.LongTensor, features: torch.Tensor, pads: list[int]) -> None:
        for row, drafter in enumerate(self.drafters):
            drafter.catch_up(next_ids[row : row + 1, pads[row]:], features[row : row + 1, pads[row]:],
                             self._at(next_ids.shape[1] - pads[row], next_ids.device))

    def catch_up(self, next_ids: torch.LongTensor, features: torch.Tensor, lengths: list[int], counts: list[int],
                 futures: list) -> None:
        device = next_ids.device
        for row, drafter in enumerate(self.drafters):
            if counts[row]:
                future = futures[row] and (futures[row][0], self._at(futures[row][1], device))
                drafter.catch_up(next_ids[row : row + 1], features[row : row + 1], self._at(lengths[row], device),
                                 future, self._at(counts[row], device))

    def propose(self, roots: torch.Tensor, lengths: list[int], priors: list, contexts: list,
                allowed: list | None = None) -> list[DraftTree]:
        """Row b's tree under `roots[b]` (at position `lengths[b]`); `contexts[b]`: its tokens so far, root last;
        `allowed[b]`: which of its suffix candidates may take a node (see `TreeDrafter.propose`; None: all)."""
        allowed = allowed or [None] * len(self.drafters)
        return [d.propose(roots[row], self._at(lengths[row], roots.device), priors[row], contexts[row], allowed[row])
                for row, d in enumerate(self.drafters)]

    def select(self, rows: list[int]) -> None:
        self.drafters = [self.drafters[r] for r in rows]


class ChainDrafter:
    """Chains (top_k = 1) for the whole batch: one draft forward per level for all rows, on a `RowCache`."""

    def __init__(self, draft: ConFuDraftModel, depth: int, total_tokens: int, temperature: float | None,
                 cache: Cache | None = None) -> None:
        """`cache`: the static mode's (empty) draft cache of B rows; default a `DynamicCache`."""
        if draft.config.has_future_entry:
            raise ValueError("ChainDrafter drafts without [f] entries: use RowDrafters for this draft.")
        self.draft, self.d2t, self.temperature = draft, draft.d2t, temperature
        self.levels = min(depth, total_tokens - 1)
        nodes = torch.arange(max(self.levels, 1) + 1, device=draft.fc.weight.device)  # the same chain every round
        self.chain = ((nodes - 1).clamp_min(0), nodes, nodes[:, None] >= nodes,
                      torch.cat([nodes[1:], nodes.new_full((1,), -1)])[:, None])
        self.cache = cache
        self.rows: RowCache | None = None
        self.hidden: torch.Tensor | None = None

    def prefill(self, next_ids: torch.LongTensor, features: torch.Tensor, pads: list[int]) -> None:
        rows, n = next_ids.shape
        device, dtype = next_ids.device, self.draft.fc.weight.dtype
        keys = torch.arange(n, device=device)
        pad = torch.tensor(pads, device=device)[:, None]
        visible = (keys[:, None] >= keys) & (keys >= pad)[:, None, :] | torch.eye(n, dtype=torch.bool, device=device)
        cache = DynamicCache() if self.cache is None else self.cache
        out = self.draft(next_ids, features.to(dtype), (keys - pad).clamp_min(0),
                         pad_keys(to_additive(visible, dtype)[:, None], key_width(cache, n)), cache)
        self.rows, self.hidden = RowCache(cache, list(pads), [n] * rows), out[:, -1:]

    def catch_up(self, next_ids: torch.LongTensor, features: torch.Tensor, lengths: list[int], counts: list[int],
                 futures: list) -> None:
        """Feed each row's accepted tokens (B, P), of which row b's first `counts[b]` are real, with the target's
        features at positions `lengths[b] - counts[b]` on (count 0: a finished row kept in the batch, fed nothing)."""
        rows, size = next_ids.shape
        device, base = next_ids.device, self.rows.filled
        count = torch.tensor(counts, device=device)
        new = torch.ones(size, size, dtype=torch.bool, device=device).tril().expand(rows, size, size)
        positions = (torch.tensor(lengths, device=device) - count)[:, None] + torch.arange(size, device=device)
        out = self.draft(next_ids, features.to(self.hidden.dtype), positions, self.rows.mask(new, self.hidden.dtype),
                         self.rows.cache)
        self.rows.keep(base, torch.arange(size, device=device).expand(rows, size), counts)
        self.hidden = out.gather(1, (count - 1).clamp_min(0)[:, None, None].expand(rows, 1, out.shape[-1]))

    def propose(self, roots: torch.Tensor, lengths: list[int], priors: list, contexts=None,
                allowed=None) -> list[DraftTree]:
        """Draft a chain under each row's root (at position `lengths[b]`); `priors[b]` as `draft_tree`'s prior
        (`contexts`, `allowed`: unused, chains hold no suffix candidates)."""
        rows, device = roots.numel(), roots.device
        logits = self.draft.logits(self.hidden[:, 0]).float()
        if any(p is not None for p in priors):
            logits = logits + torch.stack([torch.zeros_like(logits[0]) if p is None else p for p in priors])
        ids, logq, q = _pick(logits, 1, self.temperature)
        drafted, scores, proposals = [ids], [logq], [q]
        hidden, base, at = self.hidden, self.rows.filled, torch.tensor(lengths, device=device)
        prefix = self.rows.visible(device)
        for level in range(1, self.levels):
            new = torch.ones(rows, 1, level, dtype=torch.bool, device=device)  # the chain drafted so far
            hidden = self.draft(self.d2t[ids], hidden, (at + level - 1)[:, None],
                                self.rows.mask(new, hidden.dtype, prefix), self.rows.cache)
            ids, logq, q = _pick(self.draft.logits(hidden[:, 0]), 1, self.temperature)
            drafted.append(ids)
            scores.append(logq)
            proposals.append(q)
        truncate_cache(self.rows.cache, base)
        return self._trees(roots, self.d2t[torch.cat(drafted, 1)], torch.cat(scores, 1).cumsum(1),
                           None if q is None else torch.stack(proposals, 1))

    def _trees(self, roots: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, proposals: torch.Tensor | None
               ) -> list[DraftTree]:
        """Per row, the chain `roots[b], tokens[b]` as a `DraftTree` (`scores` (B, L) cumulative, `proposals`
        (B, L, D) the distributions each drafted token was drawn from)."""
        (rows, n), (parents, depths, ancestry, child_nodes) = tokens.shape, self.chain
        paths = torch.cat([roots[:, None], tokens], 1)
        children = torch.nn.functional.pad(tokens, (0, 1), value=-1)[..., None]  # the last node has none
        scores = torch.nn.functional.pad(scores, (1, 0))  # the root's 0
        tables = None if proposals is None else torch.nn.functional.pad(proposals, (0, 0, 0, 1))
        return [DraftTree(paths[b], parents, depths, ancestry, children[b], child_nodes, n,
                          None if tables is None else tables[b], scores[b]) for b in range(rows)]

    def select(self, rows: list[int]) -> None:
        self.rows.select(rows)
        self.hidden = self.hidden[torch.tensor(rows, device=self.hidden.device)]


@torch.no_grad()
def batched_generate(
    target: PreTrainedModel,
    drafter: ChainDrafter | RowDrafters,
    feature_layers: list[int],
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    config: GenerationConfig,
    max_new_tokens: int,
    stats: BatchStats,
    tokenizer=None,
    adapter: ContemplateAdapter | None = None,
    contemplate_nodes: int | None = None,
    future_logit_weight: float = 0.0,
    static: StaticTarget | None = None,
    processing: list[NodeProcessing] | None = None,
    records: list[StepScores] | None = None,
    stopping: StoppingCriteriaList | None = None,
) -> torch.LongTensor:
    """Generate up to `max_new_tokens` after each row of the left-padded `input_ids` (B, T); returns (B, T + new),
    rows that end early padded with `pad_token_id` (or the first EOS id) as plain batched `generate` pads them.

    Each round drafts every active row's tree, verifies them all in one target pass, accepts per row (one host
    sync), keeps each row's accepted path in the caches and retires the rows that stopped. ConFu (`adapter`): as
    in `speculative_generate`, per row. `static` (static mode): the target's static cache and calls (the drafter
    holds its own); compiled (`static.keep` set), every pass keeps its shapes: finished rows stay in the batch,
    fed and keeping nothing, and the accepted paths are copied at the tree's full size. `processing`: each row's
    logits processing (default: the one `config` asks for). `records`: where each row's new tokens' scores,
    logits and hidden states go (`output_scores`, `output_logits`, `output_hidden_states`), one `StepScores` per
    row. `stopping`: the call's own stopping criteria (`stopping_criteria=`), beside `generate`'s, checked per row
    with its output and its recorded scores (`max_time` stops each row at its next token).
    """
    start = time.perf_counter()
    batch, prompt_len = input_ids.shape
    criteria = stopping_criteria(target, config, prompt_len + max_new_tokens, tokenizer, stopping)
    processing = processing or node_processing(target, config, input_ids, prompt_len + max_new_tokens, attention_mask)
    sample = processing[0].sample
    mix = adapter is not None and future_logit_weight > 0
    entry = adapter is not None and drafter.draft.config.has_future_entry
    pads = (attention_mask == 0).sum(1).tolist()
    keep_hidden = records is not None and records[0].hidden_states is not None
    verify = _BatchTarget(target, feature_layers, adapter, pads, max_new_tokens + 64, mix, static, keep_hidden)
    compiled = static is not None and static.keep is not None
    parked: set[int] = set()  # compiled: the finished rows kept in the batch (indices into `rows`)

    t0 = time.perf_counter()
    logits, features = verify.prefill(input_ids, attention_mask)
    stats.verify_seconds += time.perf_counter() - t0
    outputs = list(input_ids.cpu().split(1))
    scores = torch.cat([row.scores(logits[i : i + 1], outputs[i]) for i, row in enumerate(processing)])
    roots = torch.multinomial(probabilities(scores), 1)[:, 0] if sample else scores.argmax(-1)
    drafter.prefill(torch.cat([input_ids[:, 1:], roots[:, None]], dim=1), features, pads)
    states = features[:, -1]
    rows = list(range(batch))  # the input row of each active row
    lengths = [prompt_len - pad for pad in pads]  # each active row's real tokens: the position of its root
    ends: dict[int, int] = {}  # input row -> output length where its stopping criteria fired
    stats.row_accept_lengths = [[] for _ in range(batch)]
    stats.row_accepted_by_source = [Counter() for _ in range(batch)]
    futures, priors = [None] * batch, [None] * batch
    accepted = [[int(r)] for r in roots.tolist()]
    picked = [(scores[i : i + 1], logits[i : i + 1],  # each row's accepted tokens' scores, logits, hidden states
               [tuple(states[i : i + 1] for states in verify.hidden)] if keep_hidden else None) for i in range(batch)]
    bans = [row.suffix_check(outputs[i][0, : pads[i]].numpy()) for i, row in enumerate(processing)]  # see `allows`
    next_ids = feats = counts = None
    while True:
        before = [outputs[row].shape[1] for row in rows]
        own = stopping and records is not None and records[0].scores is not None  # only the call's own read scores
        seen = [records[row].scores for row in rows] if own else None
        keep = _advance(rows, accepted, outputs, ends, criteria, config.eos_token_id is not None,
                        prompt_len + max_new_tokens, seen, None if seen is None else [p[0] for p in picked])
        if records is not None:  # the tokens each row kept were picked at the first nodes of its path
            for i, row in enumerate(rows):
                kept = outputs[row].shape[1] - before[i]
                records[row].add(picked[i][0][:kept], picked[i][1][:kept], picked[i][2] and picked[i][2][:kept])
        if not keep:
            break
        if compiled:
            parked = set(range(len(rows))) - set(keep)
        elif len(keep) < len(rows):
            index = torch.tensor(keep, device=input_ids.device)
            rows, lengths = [rows[i] for i in keep], [lengths[i] for i in keep]
            futures, priors = [futures[i] for i in keep], [priors[i] for i in keep]
            roots, states = roots[index], states[index]
            if next_ids is not None:
                next_ids, feats, counts = next_ids[index], feats[index], [counts[i] for i in keep]
            drafter.select(keep)
            verify.rows.select(keep)
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        if next_ids is not None:
            drafter.catch_up(next_ids, feats, lengths, counts, futures)
        trees = drafter.propose(roots, lengths, priors, [outputs[row][0, pads[row]:].numpy() for row in rows],
                                [bans[row] for row in rows])
        cons = None
        if adapter is not None:
            n = len(trees[0])
            cons = torch.stack([t.likely_ends(n if contemplate_nodes is None else min(contemplate_nodes, n))
                                for t in trees])
        t1 = time.perf_counter()
        at = torch.tensor(lengths, device=input_ids.device)
        logits, features, con_features, con_logits = verify.tree(trees, at, cons, states)
        t2 = time.perf_counter()
        scores = [processing[rows[i]].scores(logits[i], outputs[rows[i]], tree) for i, tree in enumerate(trees)]
        if sample:
            results = [accept_sampling(tree, probabilities(s), drafter.d2t) for tree, s in zip(trees, scores)]
        else:
            results = [accept_greedy(tree, s) for tree, s in zip(trees, scores)]
        # rows' trees may differ in depth (paths padded with 0); compiled: one width, the tree's
        width = len(trees[0]) if compiled else max(path.numel() for path, _, _ in results)
        paths = torch.stack([torch.nn.functional.pad(path, (0, width - path.numel())) for path, _, _ in results])
        sizes, roots = torch.stack([size for _, size, _ in results]), torch.stack([root for _, _, root in results])
        lasts = paths.gather(1, (sizes - 1)[:, None])
        tokens = torch.stack([t.tokens for t in trees])
        next_ids = torch.cat([tokens.gather(1, paths[:, 1:]), roots[:, None]], 1).scatter(1, sizes[:, None] - 1,
                                                                                         roots[:, None])
        hits = None if cons is None else cons == lasts  # each row's [con] of its last accepted node, if it had one
        fresh = torch.zeros_like(sizes) if hits is None else hits.any(1).long()
        origins = [] if trees[0].sources is None else [torch.stack([t.sources for t in trees]).gather(1, paths)]
        read = torch.cat([sizes[:, None], fresh[:, None], next_ids, *origins], 1).tolist()  # the round's one host sync
        counts = [0 if i in parked else r[0] for i, r in enumerate(read)]
        verify.keep(paths, counts)
        if compiled and not static.warm:
            stats.compile_seconds, static.warm = time.perf_counter() - t0, True
        priors = [None] * len(rows)
        for i, r in enumerate(read):
            if i in parked:
                continue
            if r[1]:
                slot = hits[i].int().argmax()
                if entry:
                    futures[i] = (con_features[i, slot], lengths[i] + counts[i] - 1)
                if mix:
                    priors[i] = future_logit_weight * con_logits[i, slot, drafter.d2t].float().log_softmax(-1)
                stats.fresh_futures += 1
            stats.row_accept_lengths[rows[i]].append(counts[i])
            below_root = r[2 + next_ids.shape[1] :][1 : counts[i]]  # where the accepted nodes below the root came from
            stats.row_accepted_by_source[rows[i]].update(SOURCE_NAMES[origin] for origin in below_root if origin)
        accepted = [r[2 : 2 + count] for r, count in zip(read, counts)]
        if records is not None:
            picked = [(s[path], logits[i, path], node_states(verify.hidden, i, path) if keep_hidden else None)
                      for i, (s, path) in enumerate(zip(scores, paths))]
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        stats.target_forwards += 1
        stats.accept_lengths.extend(count for count in counts if count)
        feats = features.gather(1, paths[..., None].expand(-1, -1, features.shape[-1]))
        states = features[torch.arange(len(rows), device=features.device), lasts[:, 0]]
        lengths = [length + count for length, count in zip(lengths, counts)]
    stats.accepted_by_source = dict(sum(stats.row_accepted_by_source, Counter()))
    output, real = _padded(outputs, ends, config)
    stats.new_tokens = real - batch * prompt_len
    stats.total_seconds = time.perf_counter() - start
    return output.to(input_ids.device)


def _advance(rows: list[int], accepted: list[list[int]], outputs: list[torch.Tensor], ends: dict[int, int],
             criteria, pads_after_end: bool, max_length: int, seen: list[list[torch.Tensor]] | None = None,
             scores: list[torch.Tensor] | None = None) -> list[int]:
    """Append each active row's accepted tokens; return the active rows (indices into `rows`) still to decode.
    `seen` and `scores`: each active row's recorded scores and those of its accepted tokens, for the criteria
    (`_append`).

    A row whose stopping criteria fire is done: with an EOS criterion (`pads_after_end`) plain `generate` pads
    it from there, so it leaves the batch; without one plain `generate` keeps decoding it until every row is
    done, so it stays until the batch's end is known and reached."""
    for i, (row, tokens) in enumerate(zip(rows, accepted)):
        if row not in ends:
            row_seen, row_scores = (None, None) if seen is None else (seen[i], scores[i])
            grown, stopped = _append(outputs[row], tokens, criteria, None, row_seen, row_scores)
            tokens, outputs[row] = tokens[grown.shape[1] - outputs[row].shape[1]:], grown  # what follows a stop
            if stopped:
                ends[row] = grown.shape[1]
        if tokens and not pads_after_end:  # done, no EOS criterion: tokens as plain generate keeps producing them
            outputs[row] = torch.cat([outputs[row], torch.tensor([tokens])], dim=1)[:, :max_length]
    end = max(ends.values()) if len(ends) == len(outputs) else max_length
    return [i for i, row in enumerate(rows)
            if not (row in ends and pads_after_end) and outputs[row].shape[1] < end]


def _padded(outputs: list[torch.Tensor], ends: dict[int, int], config: GenerationConfig
            ) -> tuple[torch.LongTensor, int]:
    """The rows cut at the batch's end (the last row's) and, with an EOS criterion, padded past their own ends as
    `generate` pads them; and the number of real tokens in them."""
    length, pad = max(ends.values()), _pad_id(config)
    result = outputs[0].new_full((len(outputs), length), 0 if pad is None else pad)
    real = [length if pad is None else ends[row] for row in range(len(outputs))]
    for row, out in enumerate(outputs):
        result[row, : real[row]] = out[0, : real[row]]
    return result, sum(real)


def generate_batch(assistant, target: PreTrainedModel, input_ids: torch.LongTensor,
                   attention_mask: torch.Tensor | None, config: GenerationConfig, budget: TreeBudget | None,
                   max_new_tokens: int, tokenizer=None, streamer=None, contemplate_nodes: int | None = None,
                   future_logit_weight: float = 0.0, suffix: SuffixProposer | None = None,
                   static: dict | None = None, options: dict | None = None, record: StepScores | None = None,
                   stopping: StoppingCriteriaList | None = None) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """`ConFuAssistant.generate` and `SuffixAssistant.generate` for a batch (or a left-padded prompt): checks the
    inputs, picks the budget (`budget` None: `batch_budget`'s choice for `assistant.budget`), then runs
    `batched_generate`, or plain `generate` where the policy says speculation does not pay. `suffix`: the proposer
    whose candidates join every row's tree (each row gets its own `fork`); a draft-free assistant (`SuffixAssistant`,
    no `draft`) verifies them alone. `static`: the static mode's parts for this batch (`assistant.static_parts`:
    the target's cache and calls, the chain's draft cache, one draft cache per row). `options`: the call's
    `processing.CALL_OPTIONS`. `record`: where the new tokens' scores and logits go, per step (B, V) (plain
    `generate` returns its own dict). `stopping`: the call's `stopping_criteria=`. Sets `assistant.stats` (a
    `BatchStats`)."""
    batch = input_ids.shape[0]
    if streamer is not None:
        raise ValueError("A streamer supports batch size 1 only (as in transformers): generate one prompt at a time "
                         "to stream it.")
    if not full_attention(target.config):
        raise ValueError("Batched speculative decoding supports full-attention targets only; this one has layer "
                         f"types {getattr(target.config, 'layer_types', None)}: generate one prompt at a time.")
    mask = _left_padding_mask(input_ids, attention_mask, config)
    stats = assistant.stats = BatchStats()
    draft = getattr(assistant, "draft", None)  # None: SuffixAssistant
    if budget is None:
        budget = batch_budget(assistant.budget, batch, target.device.type, draft is not None, bool(config.do_sample))
    if budget is None:
        start = time.perf_counter()
        # the length as `max_new_tokens` alone, as a call that gives only it reaches plain `generate` (no warning that
        # the merged config's default `max_length` is set too)
        config = copy.deepcopy(config)
        config.max_length, config.max_new_tokens = None, max_new_tokens
        output = type(target).generate(target, input_ids, attention_mask=mask, generation_config=config,
                                       tokenizer=tokenizer, stopping_criteria=stopping, **(options or {}))
        stats.mode, stats.total_seconds = "plain", time.perf_counter() - start
        sequences = output if torch.is_tensor(output) else output.sequences  # return_dict_in_generate
        stats.new_tokens = int(real_lengths(sequences[:, input_ids.shape[1]:], eos_token_ids(config)).sum())
        return output
    temperature = (config.temperature or 1.0) if config.do_sample else None
    proposers = [None] * batch if suffix is None else [suffix.fork() for _ in range(batch)]
    static = static or {}
    target_parts, calls = static.get("target"), static.get("draft_calls")
    scalars = calls is not None  # compiled drafting calls take positions as device scalars
    if draft is None:
        from .suffix_assistant import SuffixDrafter  # which imports this module (through assistant.py)

        drafter = RowDrafters([SuffixDrafter(proposer, budget.total_tokens, pad=True) for proposer in proposers])
    elif suffix is None and budget.top_k == 1 and not draft.config.has_future_entry:
        drafter = ChainDrafter(draft, budget.depth, budget.total_tokens, temperature, static.get("draft_cache"))
    else:  # every row's tree at its full size (`pad`), so that they stack
        caches = static.get("row_draft_caches")
        drafter = RowDrafters([TreeDrafter(draft, budget.depth, budget.top_k, budget.total_tokens, temperature,
                                           None if target_parts is None else caches[row], calls, proposer, pad=True)
                               for row, proposer in enumerate(proposers)], scalars)
    layers = [target.config.num_hidden_layers] if draft is None else draft.config.feature_layers  # no draft: unused
    stats.mode = "eager" if target_parts is None else "static"
    processing = node_processing(target, config, input_ids, input_ids.shape[1] + max_new_tokens, mask,
                                 **(options or {}))
    records = None if record is None else [record.like() for _ in range(batch)]
    output = batched_generate(target, drafter, layers, input_ids, mask, config, max_new_tokens, stats, tokenizer,
                              None if draft is None else assistant.adapter, contemplate_nodes, future_logit_weight,
                              target_parts, processing, records, stopping)
    if record is not None:
        record.add_rows(records, output.shape[1] - input_ids.shape[1])
    stats.suffix_seconds = sum(proposer.seconds for proposer in proposers if proposer is not None)
    return output


def real_lengths(new: torch.LongTensor, eos_ids: list[int]) -> torch.LongTensor:
    """(B,) the real tokens of each row of a batch's (B, N) new tokens: up to its first EOS (included); the
    rest is padding."""
    ends = torch.isin(new, torch.tensor(eos_ids, dtype=new.dtype, device=new.device)).int()
    return (ends.cumsum(1) - ends == 0).sum(1)


def eos_token_ids(config: GenerationConfig) -> list[int]:
    """The EOS ids of `config` as a list (empty without one)."""
    eos = config.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _pad_id(config: GenerationConfig) -> int | None:
    """The id `generate` pads finished rows with (None: rows never finish early): `pad_token_id`, else the first
    EOS id; None without an EOS id."""
    eos = eos_token_ids(config)
    if not eos:
        return None
    return config.pad_token_id if config.pad_token_id is not None else eos[0]


def _left_padding_mask(input_ids: torch.LongTensor, mask: torch.Tensor | None, config: GenerationConfig
                       ) -> torch.Tensor:
    """The attention mask of a left-padded batch (all ones if none was given), with clear errors for what the
    batched loop does not take: right padding, holes, empty rows, a missing mask on a padded batch."""
    if mask is None:
        pad = config.pad_token_id
        if pad is not None and pad not in eos_token_ids(config) and bool((input_ids == pad).any()):
            raise ValueError("The batch holds pad tokens but no attention_mask was given: pass the tokenizer's "
                             "attention_mask (padding_side='left').")
        return torch.ones_like(input_ids)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}.")
    mask = mask.long()
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("Right padding (or a hole in attention_mask) is not supported with a ConFu assistant: pad "
                         "on the left (tokenizer.padding_side = 'left'), as batched generate needs anyway.")
    if not bool(mask[:, -1].all()):
        raise ValueError("A row of attention_mask is all padding: every prompt needs at least one token.")
    return mask


def is_batch(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> bool:
    """Whether a call needs the batched loop: several rows, or a (left-)padded one."""
    if input_ids is None or input_ids.ndim != 2:
        return False
    return input_ids.shape[0] > 1 or (attention_mask is not None and not bool(attention_mask.all()))
