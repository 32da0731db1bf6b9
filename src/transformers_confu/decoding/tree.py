"""Drafting an EAGLE-2 dynamic tree with the draft head.

From the root (the last token the target produced) the draft expands `top_k` children per node for
`depth` levels, keeping the `top_k` best nodes of each level (cumulative log-probability) to expand
next, then keeps the best `total_tokens - 1` nodes overall. Greedy decoding takes each node's top-k
children; sampling draws them without replacement (Gumbel top-k) from the draft's distribution `q`,
which is kept so that acceptance can use the distribution the children were really drawn from.

Everything here has a fixed shape given the budget and stays on the device: the tree is a set of
tensors, chosen without a host sync, so a round can run under `torch.compile` and CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from ..models.modeling_confu import ConFuDraftModel
from ..utils.cache import keep_path, key_width, truncate_cache
from ..utils.masks import to_additive
from .width import best_width

if TYPE_CHECKING:
    from .suffix import SuffixCandidates, SuffixProposer


@dataclass
class DraftTree:
    """A drafted token tree of N nodes; node 0 is the root, parents precede their children.

    Attributes:
        tokens: (N,) target token ids.
        parents: (N,) parent node of each node (the root's is 0, itself).
        depths: (N,) depth of each node (root 0).
        ancestry: (N, N) bool, `[i, j]` true when node j is node i or one of its ancestors.
        child_tokens: (N, K) every drafted child's target token, in the order they were drafted (the order
            in which acceptance must try them); -1 where a node has fewer (or no) children.
        child_nodes: (N, K) the node index of each of those children, -1 where pruned (not verified).
        max_depth: the deepest level the budget allows (paths hold at most `max_depth + 1` nodes).
        proposals: (N, D) per node, the draft distribution over the DRAFT vocabulary its children were
            drawn from (sampling only).
        scores: (N,) the draft's cumulative log-probability of each node (root 0), if known (suffix
            candidates: their log acceptance estimate; -inf for padding nodes that nothing proposes).
        point_from: the first column of `child_tokens` holding deterministic (point-mass) proposals, the
            suffix candidates; None if there are none.
        sources: (N,) where each node came from with suffix candidates: 0 the root or a padding node (nothing
            proposed it), 1 drafted, 2 suffix, 3 both.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestry: torch.Tensor
    child_tokens: torch.Tensor
    child_nodes: torch.Tensor
    max_depth: int
    proposals: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    point_from: int | None = None
    sources: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def path_size(self) -> int:
        """Fixed length of the accepted-path tensors: `max_depth + 1`, at most N."""
        return min(self.max_depth + 1, len(self))

    @classmethod
    def from_parents(cls, tokens: list[int] | torch.Tensor, parents: list[int], scores: torch.Tensor | None = None,
                     proposals: dict[int, torch.Tensor] | None = None,
                     pruned: dict[int, list[int]] | None = None) -> "DraftTree":
        """A tree from a parent list (root's parent -1; parents before children). `proposals` maps nodes to
        their children's draft distribution; `pruned` lists extra drafted-but-unverified child tokens per node."""
        tokens = torch.as_tensor(tokens)
        n, device = len(parents), tokens.device
        parent = torch.tensor([max(p, 0) for p in parents], device=device)
        kids: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for node, p in enumerate(parents[1:], start=1):
            kids[p].append((int(tokens[node]), node))
        for node, extra in (pruned or {}).items():
            kids[node].extend((token, -1) for token in extra)
        width = max(1, max(len(k) for k in kids))
        child_tokens = torch.full((n, width), -1, dtype=torch.long, device=device)
        child_nodes = child_tokens.clone()
        for node, k in enumerate(kids):
            for j, (token, index) in enumerate(k):
                child_tokens[node, j], child_nodes[node, j] = token, index
        depth_list = [0] * n
        for node, p in enumerate(parents[1:], start=1):
            depth_list[node] = depth_list[p] + 1
        ancestry = tree_ancestry(parent, max(depth_list))
        depths = torch.tensor(depth_list, device=device)
        table = None
        if proposals:
            table = torch.zeros(n, len(next(iter(proposals.values()))), device=device)
            for node, q in proposals.items():
                table[node] = q
        return cls(tokens, parent, depths, ancestry, child_tokens, child_nodes, int(depths.max()), table, scores)

    def likely_ends(self, count: int) -> torch.Tensor:
        """The `count` nodes (ascending) the accepted path most likely ends at, by the draft's own estimate:
        P(reach node) minus P(reach one of its verified children). Without `scores`, the `count` deepest nodes."""
        n = len(self)
        if count >= n:
            return torch.arange(n, device=self.tokens.device)
        if self.scores is None:
            return torch.arange(n - count, n, device=self.tokens.device)
        reach = self.scores.float().exp()
        ends = reach.index_add(0, self.parents[1:], -reach[1:])
        return ends.topk(count).indices.sort().values


def tree_ancestry(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """(N, N) bool ancestry from (N,) parent indices (the root's parent is itself) of a tree at most `depth`
    deep, on the device: each step adds one more generation of ancestors."""
    eye = torch.eye(parents.numel(), dtype=torch.bool, device=parents.device)
    ancestry = eye
    for _ in range(depth):
        ancestry = eye | ancestry[parents]
    return ancestry


def additive_mask(visible: torch.Tensor, prefix: int | torch.Tensor, dtype: torch.dtype,
                  width: int | None = None) -> torch.Tensor:
    """(Q, K) bool -> (1, 1, Q, width) additive float mask: the `prefix` first keys visible, then `visible`,
    then (up to `width`, default `prefix + K`: a static cache's spare room) nothing. `prefix` may be a 0-d
    device tensor (then `width` is needed): the mask is built without reading it on the host."""
    q, k = visible.shape
    rel = torch.arange(width or prefix + k, device=visible.device) - prefix  # key index - prefix
    allowed = (rel < 0) | (visible[:, rel.clamp(0, k - 1)] & (rel < k))
    return to_additive(allowed, dtype)[None, None]


def _scalar(value: int | torch.Tensor, device) -> torch.Tensor:
    """(1,) long tensor holding `value` (a host int or a device scalar), with no host-to-device copy."""
    return torch.zeros(1, dtype=torch.long, device=device) + value


def _pick(logits: torch.Tensor, k: int, temperature: float | None):
    """Choose k children per row: top-k (greedy) or Gumbel top-k from softmax(logits / T)."""
    if temperature is None:
        logq = torch.log_softmax(logits.float(), dim=-1)
        values, ids = logq.topk(k, dim=-1)
        return ids, values, None
    logq = torch.log_softmax(logits.float() / temperature, dim=-1)
    gumbel = -torch.empty_like(logq).exponential_().log()
    ids = (logq + gumbel).topk(k, dim=-1).indices
    return ids, logq.gather(-1, ids), logq.exp()


def draft_tree(
    draft: ConFuDraftModel,
    cache,
    prefix: int,
    hidden: torch.Tensor,
    root: torch.Tensor | int,
    root_position: int,
    depth: int,
    top_k: int,
    total_tokens: int,
    temperature: float | None = None,
    future_slot: int | torch.Tensor | None = None,
    prior: torch.Tensor | None = None,
    extra: SuffixCandidates | None = None,
    pad: bool = True,
    costs: dict[int, float] | None = None,
) -> DraftTree:
    """Draft a tree under `root`.

    Args:
        draft: the draft head.
        cache: the draft's cache over the accepted prefix, `prefix` entries long (known to the caller: reading
            a static cache's length would sync); restored to that length on return.
        hidden: (1, 1, H) the draft's output at the root's entry (it predicts the root's children).
        root: target id of the root token; root_position: its position in the target sequence.
        temperature: None for greedy decoding, else the sampling temperature of the proposals.
        future_slot: cache index of this round's `[f]` entry (ConFu), which every drafted token attends to.
        prior: optional (D,) log-probabilities over the draft vocabulary added to the first level's logits
            (ConFu's `[con]` prediction, already weighted).
        extra: suffix candidates competing with the drafted ones for the same `total_tokens` (see `_select`).
        pad: always `total_tokens` nodes (static shapes); else `extra`'s padding and duplicates are left out.
        costs: a verify cost table {width: seconds} (eager only): keep the `width.best_width` of the candidates.

    `prefix`, `root_position` and `future_slot` are host ints or, on a static cache, 0-d device tensors: then
    the whole function has fixed shapes and no host reads, and the static mode compiles it as one graph.
    """
    device, dtype = hidden.device, hidden.dtype
    keys = None if future_slot is None else _scalar(future_slot, device)
    eye = torch.eye(top_k, dtype=torch.bool, device=device)
    logits = draft.logits(hidden[0, -1:])
    ids, logq, q = _pick(logits if prior is None else logits.float() + prior, top_k, temperature)
    frontier_scores, frontier_tokens = logq[0], ids[0]
    frontier_hidden = hidden[:, -1:].repeat(1, top_k, 1)  # dense: a compiled step sees the same strides
    frontier_ids = torch.arange(top_k, device=device)  # candidate ids of the frontier nodes
    visible = eye
    tokens, scores, parents = [ids[0]], [logq[0]], [torch.full_like(ids[0], -1)]
    # one row per expanded node: its candidate id (-1: the root), its children's candidate ids, their q
    rows, row_children, row_q = [torch.full((1,), -1, device=device)], [frontier_ids[None]], [q]
    n_cand = top_k
    for level in range(1, depth):
        positions = _scalar(root_position + level - 1, device).expand(1, top_k)
        width = key_width(cache, prefix + visible.shape[1])
        out = draft(draft.d2t[frontier_tokens][None], frontier_hidden, positions,
                    additive_mask(visible, prefix, dtype, width), cache, future_keys=keys)
        ids, logq, q = _pick(draft.logits(out[0]), top_k, temperature)
        level_scores = (frontier_scores[:, None] + logq).flatten()
        children = n_cand + torch.arange(top_k * top_k, device=device).view(top_k, top_k)
        tokens.append(ids.flatten())
        scores.append(level_scores)
        parents.append(frontier_ids.repeat_interleave(top_k))
        rows.append(frontier_ids)
        row_children.append(children)
        row_q.append(q)
        best = level_scores.topk(top_k).indices
        frontier_scores, frontier_tokens = level_scores[best], ids.flatten()[best]
        frontier_hidden, frontier_ids = out[:, best // top_k], children.flatten()[best]
        visible = torch.cat([visible[best // top_k], eye], dim=1)
        n_cand += top_k * top_k
    truncate_cache(cache, prefix)
    levels = torch.cat([torch.ones(top_k, dtype=torch.long, device=device),
                        torch.arange(2, depth + 1, device=device).repeat_interleave(top_k * top_k)])
    return _select(root, draft.d2t[torch.cat(tokens)], torch.cat(scores), torch.cat(parents), levels,
                   torch.cat(rows), torch.cat(row_children), None if q is None else torch.cat(row_q), total_tokens,
                   depth, extra, pad, costs)


def suffix_tree(root: torch.Tensor | int, extra: SuffixCandidates, total_tokens: int, pad: bool = True,
                costs: dict[int, float] | None = None) -> DraftTree:
    """A tree of suffix candidates alone (no draft): the best `total_tokens - 1` of them under `root` (with
    `costs`, the best `width.best_width - 1`)."""
    device = extra.tokens.device
    none = torch.empty(0, dtype=torch.long, device=device)
    return _select(root, none, extra.scores[:0], none, none, torch.full((1,), -1, device=device),
                   none.view(1, 0), None, total_tokens, 0, extra, pad, costs)


def _select(root, tokens, scores, parents, levels, rows, row_children, row_q, total_tokens, depth,
            extra: SuffixCandidates | None = None, pad: bool = True, costs: dict[int, float] | None = None
            ) -> DraftTree:
    """Keep the best `total_tokens - 1` of the C drafted candidates and the S suffix ones, on the device (with
    a verify cost table `costs`, eager only: the best `width.best_width - 1` of those, read on the host).

    `tokens` (C,) target ids, `scores` log path probabilities, `parents` candidate ids (-1 the root),
    `levels` depths; `rows` (R,) the expanded candidates (-1 the root), `row_children` (R, K) their
    children, `row_q` (R, D) the draft distribution they came from. A suffix candidate on a drafted
    candidate's path (same parent, same token) is merged into it, which keeps the better score; the others
    become candidates C.. and their children's columns come after the draft's K (`point_from`).

    A child's score is never above its parent's and its candidate id is larger, so a stable sort ranks
    every parent before its children: the kept set is a tree.
    """
    device, width = scores.device, row_children.shape[1]
    n_draft, origins = tokens.numel(), None
    if extra is not None:
        tokens, scores, parents, levels, origins, s_parents, live = _merge(tokens, scores, parents, levels, extra)
        depth = max(depth, extra.max_depth)
    n_cand = tokens.numel()
    keep = min(total_tokens - 1, n_cand)
    if extra is not None and not pad:  # host read (eager hybrid trees only): leave out padding and merged duplicates
        keep = min(keep, int(torch.isfinite(scores).sum()))
    order = torch.argsort(scores, descending=True, stable=True)
    if costs is not None:  # host read: the round's width from the kept candidates' estimates
        keep = best_width(scores[order[:keep]].tolist(), costs) - 1
    chosen = order[:keep].sort().values
    node_of = torch.full((n_cand + 1,), -1, dtype=torch.long, device=device)  # candidate + 1 -> node
    node_of[0] = 0
    node_of[chosen + 1] = torch.arange(1, keep + 1, device=device)
    node_parents = torch.cat([node_of.new_zeros(1), node_of[parents[chosen] + 1]])
    depths = torch.cat([levels.new_zeros(1), levels[chosen]])
    root = torch.as_tensor(root, device=device).reshape(1)
    # children tables: rows of candidates that were not kept land in a spare row N, dropped after
    row_nodes = node_of[rows + 1]
    row_nodes = row_nodes.masked_fill(row_nodes < 0, keep + 1)
    columns = width + (0 if extra is None else extra.branch)
    child_tokens = torch.full((keep + 2, columns), -1, dtype=torch.long, device=device)
    child_nodes = child_tokens.clone()
    child_tokens[:, :width].index_copy_(0, row_nodes, tokens[row_children])
    child_nodes[:, :width].index_copy_(0, row_nodes, node_of[row_children + 1])
    if extra is not None:
        s_rows = node_of[s_parents + 1]
        s_rows = torch.where(live & (s_rows >= 0), s_rows, keep + 1)
        s_cols = width + extra.ranks
        child_tokens[s_rows, s_cols] = extra.tokens
        child_nodes[s_rows, s_cols] = node_of[n_draft + 1 + torch.arange(extra.tokens.numel(), device=device)]
    proposals = None
    if row_q is not None:
        proposals = row_q.new_zeros(keep + 2, row_q.shape[1]).index_copy_(0, row_nodes, row_q)[: keep + 1]
    return DraftTree(
        tokens=torch.cat([root, tokens[chosen]]),
        parents=node_parents,
        depths=depths,
        ancestry=tree_ancestry(node_parents, depth),
        child_tokens=child_tokens[: keep + 1],
        child_nodes=child_nodes[: keep + 1],
        max_depth=depth,
        proposals=proposals,
        scores=torch.cat([scores.new_zeros(1), scores[chosen]]),
        point_from=None if extra is None else width,
        sources=None if origins is None else torch.cat([origins.new_zeros(1),
                                                         origins[chosen].masked_fill(scores[chosen].isinf(), 0)]),
    )


def _merge(tokens, scores, parents, levels, extra: SuffixCandidates):
    """Append the suffix candidates to the drafted ones, merging each one that repeats a drafted node.

    Returns the C + S candidates' tokens, scores, parents, levels and origins (1 drafted, 2 suffix, 3 both),
    and per suffix candidate its parent's candidate id (-1 the root) and whether it stands as a node of its
    own (not merged, not padding)."""
    n_draft = tokens.numel()
    none = torch.full_like(extra.parents, -2)
    match = none  # the drafted candidate each suffix candidate repeats (-2: none)
    on_root = extra.parents < 0
    if n_draft:
        for _ in range(extra.max_depth):  # parents precede children: one more level resolved per step
            parent_match = torch.where(on_root, -1, match[extra.parents.clamp_min(0)])
            same = (tokens[None] == extra.tokens[:, None]) & (parents[None] == parent_match[:, None])
            match = torch.where(same.any(1), same.long().argmax(1), none)
    merged = match >= 0
    real = torch.isfinite(extra.scores)
    origin = torch.ones_like(parents)  # 1 drafted, 2 suffix, 3 both
    if n_draft:
        scores = scores.scatter_reduce(0, match.clamp_min(0), extra.scores.masked_fill(~merged, -torch.inf), "amax")
        origin = origin + 2 * torch.zeros_like(parents).scatter_reduce(0, match.clamp_min(0), merged.long(), "amax")
    parent_match = torch.where(on_root, -1, match[extra.parents.clamp_min(0)])
    s_parents = torch.where(on_root, -1, torch.where(parent_match >= 0, parent_match, n_draft + extra.parents))
    return (torch.cat([tokens, extra.tokens]), torch.cat([scores, extra.scores.masked_fill(merged, -torch.inf)]),
            torch.cat([parents, s_parents]), torch.cat([levels, extra.depths]), torch.cat([origin, 2 + 0 * s_parents]),
            s_parents, real & ~merged)


class TreeDrafter:
    """Drafts trees with a draft head, keeping its own cache over the accepted prefix.

    The two-step contract of the decoding loop: `catch_up` feeds the tokens the target just accepted
    (with the target's features at the positions before them), `propose` drafts a tree under the root.
    ConFu: `catch_up` also takes the future vector f; its `[f]` entry stays in the cache for one round
    (the last new entry and the whole tree see it) and is replaced at the next `catch_up`.

    `cache` is a `DynamicCache` (eager; lengths are host ints) or a static cache (lengths are 0-d device
    tensors); `calls` may replace `catch_up_step` and `draft_tree` by their compiled versions (static mode).
    With a `suffix` proposer, its candidates for the context (prompt + accepted tokens) join each tree under
    the same `total_tokens` (a hybrid tree); `pad` keeps every tree at its full size (padding nodes score -inf:
    a static cache's fixed shapes, a batch's stacked rows); `costs` (eager only): a verify cost table, each tree
    cut to the `width.best_width` of its candidates.
    """

    def __init__(self, draft: ConFuDraftModel, depth: int, top_k: int, total_tokens: int,
                 temperature: float | None = None, cache=None, calls: dict | None = None,
                 suffix: SuffixProposer | None = None, pad: bool | None = None,
                 costs: dict[int, float] | None = None) -> None:
        self.draft, self.depth, self.top_k, self.total_tokens = draft, depth, top_k, total_tokens
        self.temperature = temperature
        self.pad = cache is not None if pad is None else pad  # fixed shapes (default: with a static cache)
        self.cache = DynamicCache() if cache is None else cache
        self.suffix, self.costs = suffix, costs
        if suffix is not None:
            suffix.reset()
        calls = calls or {}
        self._catch_up, self._propose = calls.get("catch_up", catch_up_step), calls.get("propose", draft_tree)
        self.hidden: torch.Tensor | None = None
        self.length: int | torch.Tensor = 0  # entries in the cache
        self._future_slot: int | torch.Tensor | None = None  # cache index of this round's [f] entry

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft.d2t

    @property
    def filled(self) -> int | torch.Tensor:
        """The cache's entries of real positions (0 .. filled - 1); a ConFu `[f]` entry sits after them."""
        return self.length if self._future_slot is None else self._future_slot

    @torch.no_grad()
    def catch_up(self, next_ids: torch.LongTensor, features: torch.Tensor, length: int | torch.Tensor,
                 future: tuple[torch.Tensor, int | torch.Tensor] | None = None,
                 count: int | torch.Tensor | None = None) -> None:
        """Feed the accepted next tokens (1, P) with the target's (1, P, 3H) features at positions
        `length - count .. length - 1`: only the first `count` (default P) are real, the rest pad a
        fixed-size call and are dropped. `future` (ConFu) is `(f (3H,), anchor position)`."""
        if self._future_slot is not None:
            truncate_cache(self.cache, self._future_slot)
        run = catch_up_step if count is None else self._catch_up  # the prompt's call (its own size): not compiled
        self.hidden, self.length, self._future_slot = run(
            self.draft, self.cache, next_ids, features, length, next_ids.shape[1] if count is None else count, future)

    @torch.no_grad()
    def propose(self, root: torch.Tensor | int, root_position: int | torch.Tensor,
                prior: torch.Tensor | None = None, context=None, allowed=None) -> DraftTree:
        """Draft a tree under `root` (at `root_position` in the target sequence); `prior` as in `draft_tree`;
        `context`: the host's token ids so far, root last, and `allowed` (`SuffixProposer.best_paths`) are read by
        the suffix proposer only."""
        extra = None if self.suffix is None else self.suffix.candidates(context, self.hidden.device, self.pad,
                                                                         allowed)
        return self._propose(self.draft, self.cache, self.length, self.hidden, root, root_position, self.depth,
                             self.top_k, self.total_tokens, self.temperature, self._future_slot, prior, extra,
                             self.pad, self.costs)


def catch_up_step(draft: ConFuDraftModel, cache, next_ids: torch.LongTensor, features: torch.Tensor,
                  length: int | torch.Tensor, n: int | torch.Tensor, future=None):
    """`TreeDrafter.catch_up` on an explicit cache (the `[f]` entry of the last round already dropped):
    returns the draft's (1, 1, H) output at the last real entry, the cache's new length and the `[f]`
    entry's index (None without `future`). Host ints, or device scalars on a static cache (one graph)."""
    size, device = next_ids.shape[1], next_ids.device
    start, dtype = length - n, draft.fc.weight.dtype
    positions = torch.arange(size, device=device) + start
    visible = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    vector, keys = None, None
    if future is not None:  # one more entry, [f]: seen by the rows at or after its anchor, sees itself
        vector, anchor = future[0].reshape(1, 1, -1), future[1]
        causal, visible = visible, torch.zeros(size + 1, size + 1, dtype=torch.bool, device=device)
        visible[:size, :size], visible[:size, size], visible[size, size] = causal, positions >= anchor, True
        positions = torch.cat([positions, _scalar(anchor, device)])
        keys = _scalar(start + size, device)
    mask = additive_mask(visible, start, dtype, key_width(cache, start + visible.shape[1]))
    out = draft(next_ids, features.to(dtype), positions[None], mask, cache, future=vector, future_keys=keys)
    last = out[:, n - 1 : n] if isinstance(n, int) else out.index_select(1, n.reshape(1) - 1)
    hidden = last.clone(memory_format=torch.contiguous_format)
    if future is None:
        truncate_cache(cache, length)
        return hidden, length, None
    order = torch.arange(size + 1, device=device)  # move [f] down next to the real entries, drop the pads
    keep_path(cache, start, order.masked_fill(order == n, size), n + 1)
    return hidden, length + 1, length


def pad_keys(mask: torch.Tensor, width: int) -> torch.Tensor:
    """An additive (..., Q, K) mask widened to `width` keys that nothing sees (a static cache's spare room)."""
    extra = width - mask.shape[-1]
    return mask if extra == 0 else torch.nn.functional.pad(mask, (0, extra), value=torch.finfo(mask.dtype).min)
