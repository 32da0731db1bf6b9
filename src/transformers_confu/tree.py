"""Drafting an EAGLE-2 dynamic tree with the draft head.

From the root (the last token the target produced) the draft expands `top_k` children per node for
`depth` levels, keeping the `top_k` best nodes of each level (cumulative log-probability) to expand
next, then keeps the best `total_tokens - 1` nodes overall. Greedy decoding takes each node's top-k
children; sampling draws them without replacement (Gumbel top-k) from the draft's distribution `q`,
which is kept so that acceptance can use the distribution the children were really drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .cache import cache_length, truncate_cache
from .modeling_confu import ConFuDraftModel


@dataclass
class DraftTree:
    """A drafted token tree; node 0 is the root, parents precede their children.

    Attributes:
        tokens: (N,) target token ids.
        depths: (N,) depth of each node (root 0).
        parents: parent node of each node (-1 for the root).
        children: per node, every drafted child as `(target token, node index or -1 if pruned)`, in the
            order they were drafted (the order in which acceptance must try them).
        proposals: per expanded node, the draft distribution over the DRAFT vocabulary its children were
            drawn from (sampling only).
        scores: (N,) the draft's cumulative log-probability of each node (root 0), if known.
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: list[int]
    children: list[list[tuple[int, int]]]
    proposals: dict[int, torch.Tensor]
    scores: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.parents)

    def ancestry(self) -> torch.Tensor:
        """(N, N) bool: `[i, j]` is true when node j is node i or one of its ancestors."""
        n = len(self)
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        return anc

    def likely_ends(self, count: int) -> list[int]:
        """The `count` nodes the accepted path most likely ends at, by the draft's own estimate:
        P(reach node) minus P(reach one of its verified children). Without `scores`, the `count` deepest nodes."""
        if count >= len(self):
            return list(range(len(self)))
        if self.scores is None:
            return list(range(len(self) - count, len(self)))
        reach = self.scores.float().exp()
        ends = reach.clone()
        ends.index_add_(0, torch.tensor(self.parents[1:], device=reach.device), -reach[1:])
        return sorted(ends.topk(count).indices.tolist())


def to_additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = may attend) -> additive float mask of the same shape: 0, or `dtype`'s minimum."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def additive_mask(visible: torch.Tensor, prefix: int, dtype: torch.dtype) -> torch.Tensor:
    """(Q, K) bool -> (1, 1, Q, prefix + K) additive float mask, with the whole prefix visible."""
    mask = torch.zeros(visible.shape[0], prefix + visible.shape[1], dtype=dtype, device=visible.device)
    mask[:, prefix:] = to_additive(visible, dtype)
    return mask[None, None]


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


@torch.no_grad()
def draft_tree(
    draft: ConFuDraftModel,
    cache,
    hidden: torch.Tensor,
    root: int,
    root_position: int,
    depth: int,
    top_k: int,
    total_tokens: int,
    temperature: float | None = None,
    future_slot: int | None = None,
) -> DraftTree:
    """Draft a tree under `root`.

    Args:
        draft: the draft head.
        cache: the draft's `DynamicCache` over the accepted prefix; restored to that length on return.
        hidden: (1, 1, H) the draft's output at the root's entry (it predicts the root's children).
        root: target id of the root token; root_position: its position in the target sequence.
        temperature: None for greedy decoding, else the sampling temperature of the proposals.
        future_slot: cache index of this round's `[f]` entry (ConFu), which every drafted token attends to.
    """
    keys = None if future_slot is None else slice(future_slot, future_slot + 1)
    prefix = cache_length(cache)
    dtype, device = hidden.dtype, hidden.device
    eye = torch.eye(top_k, dtype=torch.bool, device=device)
    ids, logq, q = _pick(draft.logits(hidden[0, -1:]), top_k, temperature)
    frontier_scores, frontier_tokens = logq[0], ids[0]
    frontier_hidden = hidden[:, -1:].expand(1, top_k, -1)
    frontier_ids = torch.arange(top_k, device=device)  # candidate ids of the frontier nodes
    visible = eye
    cand_tokens, cand_scores, cand_parents = [frontier_tokens], [frontier_scores], [torch.full_like(ids[0], -1)]
    proposals = {-1: q[0]} if q is not None else {}
    n_cand = top_k
    for level in range(1, depth):
        positions = torch.full((1, top_k), root_position + level - 1, device=device)
        out = draft(
            draft.d2t[frontier_tokens][None], frontier_hidden, positions, additive_mask(visible, prefix, dtype), cache,
            future_keys=keys,
        )
        ids, logq, q = _pick(draft.logits(out[0]), top_k, temperature)
        if q is not None:
            proposals.update(zip(frontier_ids.tolist(), q))
        scores = (frontier_scores[:, None] + logq).flatten()
        cand_tokens.append(ids.flatten())
        cand_scores.append(scores)
        cand_parents.append(frontier_ids.repeat_interleave(top_k))
        best = scores.topk(top_k).indices
        rows = best // top_k
        frontier_scores, frontier_tokens = scores[best], ids.flatten()[best]
        frontier_hidden, frontier_ids = out[:, rows], n_cand + best
        visible = torch.cat([visible[rows], eye], dim=1)
        n_cand += top_k * top_k
    truncate_cache(cache, prefix)
    return _select(draft, root, torch.cat(cand_tokens), torch.cat(cand_scores), torch.cat(cand_parents),
                   proposals, total_tokens)


def _select(draft, root, tokens, scores, parents, proposals, total_tokens) -> DraftTree:
    """Keep the best `total_tokens - 1` candidates.

    A child's score is never above its parent's and its candidate id is larger, so a stable sort ranks
    every parent before its children: the kept set is a tree.
    """
    keep = min(total_tokens - 1, tokens.numel())
    chosen = sorted(torch.argsort(scores, descending=True, stable=True)[:keep].tolist())
    node_of = {-1: 0, **{c: i + 1 for i, c in enumerate(chosen)}}
    target_tokens = draft.d2t[tokens].tolist()
    parent_list = parents.tolist()
    children: list[list[tuple[int, int]]] = [[] for _ in range(keep + 1)]
    for cand, parent in enumerate(parent_list):
        if parent in node_of:
            children[node_of[parent]].append((target_tokens[cand], node_of.get(cand, -1)))
    node_parents = [-1] + [node_of[parent_list[c]] for c in chosen]
    depths = [0] * (keep + 1)
    for i in range(1, keep + 1):
        depths[i] = depths[node_parents[i]] + 1
    return DraftTree(
        tokens=torch.tensor([root] + [target_tokens[c] for c in chosen], device=tokens.device),
        depths=torch.tensor(depths, device=tokens.device),
        parents=node_parents,
        children=children,
        proposals={node_of[c]: q for c, q in proposals.items() if c in node_of},
        scores=torch.cat([scores.new_zeros(1), scores[chosen]]),
    )


class TreeDrafter:
    """Drafts trees with a draft head, keeping its own cache over the accepted prefix.

    The two-step contract of the decoding loop: `catch_up` feeds the tokens the target just accepted
    (with the target's features at the positions before them), `propose` drafts a tree under the root.
    ConFu: `catch_up` also takes the future vector f; its `[f]` entry stays in the cache for one round
    (the last new entry and the whole tree see it) and is replaced at the next `catch_up`.
    """

    def __init__(self, draft: ConFuDraftModel, depth: int, top_k: int, total_tokens: int,
                 temperature: float | None = None) -> None:
        self.draft, self.depth, self.top_k, self.total_tokens = draft, depth, top_k, total_tokens
        self.temperature = temperature
        self.cache = DynamicCache()
        self.hidden: torch.Tensor | None = None
        self._future_slot: int | None = None  # cache index of this round's [f] entry

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft.d2t

    @torch.no_grad()
    def catch_up(self, next_ids: torch.LongTensor, features: torch.Tensor, length: int,
                 future: tuple[torch.Tensor, int] | None = None) -> None:
        """Feed (1, n) accepted next tokens with the target's (1, n, 3H) features at positions
        `length - n .. length - 1`; `future` (ConFu) is `(f (3H,), anchor position)`."""
        if self._future_slot is not None:
            truncate_cache(self.cache, self._future_slot)
            self._future_slot = None
        n, device = next_ids.shape[1], next_ids.device
        dtype = self.draft.fc.weight.dtype
        positions = torch.arange(length - n, length, device=device)
        visible = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        vector, keys = None, None
        if future is not None:  # one more entry, [f]: seen by the rows at or after its anchor, sees itself
            vector, anchor = future[0].reshape(1, 1, -1), future[1]
            causal, visible = visible, torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
            visible[:n, :n], visible[:n, n], visible[n, n] = causal, positions >= anchor, True
            positions = torch.cat([positions, positions.new_tensor([anchor])])
            self._future_slot = length
            keys = slice(length, length + 1)
        mask = additive_mask(visible, length - n, dtype)
        out = self.draft(next_ids, features.to(dtype), positions[None], mask, self.cache, future=vector, future_keys=keys)
        self.hidden = out[:, n - 1 : n]

    def propose(self, root: int, root_position: int) -> DraftTree:
        """Draft a tree under `root` (at `root_position` in the target sequence)."""
        return draft_tree(self.draft, self.cache, self.hidden, root, root_position, self.depth, self.top_k,
                          self.total_tokens, self.temperature, self._future_slot)
