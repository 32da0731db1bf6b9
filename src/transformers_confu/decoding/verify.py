"""Lossless acceptance of a verified draft tree, on the device.

Both rules walk down from the root and return the accepted path, its length and the next token, drawn
from the target: the "bonus" token that ends the round. The path is a fixed-size tensor of
`tree.path_size` node indices (root first; entries past the length are meaningless) and the length and
token are 0-d tensors, so a round needs no host sync until the loop reads what was accepted.
"""

from __future__ import annotations

import torch

from .tree import DraftTree


def path_to(tree: DraftTree, node: torch.Tensor) -> torch.Tensor:
    """The (path_size,) nodes from the root down to `node` (ascending), padded with other nodes."""
    off_path = (~tree.ancestry[node]).to(torch.uint8)
    return torch.sort(off_path, stable=True).indices[: tree.path_size]


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow the target's argmax through the tree. `target_logits`: (N, V) at the tree's nodes.

    A node is accepted when it and each of its ancestors is the target's argmax after its parent; the
    deepest accepted node ends the path (drafted siblings are distinct tokens, so it is one path)."""
    best = target_logits.argmax(dim=-1)
    matched = (tree.tokens == best[tree.parents]) | (tree.depths == 0)
    accepted = ~(tree.ancestry & ~matched).any(dim=-1)
    last = (tree.depths * accepted).argmax()
    return path_to(tree, last), tree.depths[last] + 1, best[last]


def accept_sampling(tree: DraftTree, target_probs: torch.Tensor, d2t: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-draft recursive rejection sampling (children drawn without replacement).

    At a node with target distribution p, the children x_1, x_2, ... were drawn in order from the
    draft distribution q with earlier draws removed (q_i). Child x_i is accepted with probability
    min(1, p_i(x_i) / q_i(x_i)); on rejection p_{i+1} = norm(max(p_i - q_i, 0)). If all are rejected the
    token is drawn from the last residual. Each step is an exact rejection-sampling step, so the token
    leaving a node is distributed exactly as p. A pruned child (not verified) that is accepted still is
    an exact draw from p: it becomes the round's last token.

    Suffix children (columns from `tree.point_from` on, after the drafted ones) are deterministic
    proposals, a point mass on their token x: accepted with probability p_i(x), on rejection
    p_{i+1} = norm(p_i with x zeroed), an exact step as well; none repeats a drafted sibling (the tree
    merges such duplicates), and a drafted sibling rejected earlier has no residual mass left anyway.

    The walk has a fixed number of steps (depth x children) of masked tensor operations: a finished walk
    keeps its state.

    Args:
        tree: the drafted tree (with `proposals`).
        target_probs: (N, V) the target's processed next-token probabilities at the tree's nodes.
        d2t: (D,) draft-to-target id map (the proposals are over the draft vocabulary).
    """
    device = target_probs.device
    node = torch.zeros((), dtype=torch.long, device=device)
    walking = torch.ones((), dtype=torch.bool, device=device)
    token = torch.zeros((), dtype=torch.long, device=device)
    drafted = tree.child_tokens.shape[1] if tree.point_from is None else tree.point_from
    for _ in range(tree.path_size):
        p = target_probs[node].float()
        q = None if drafted == 0 else torch.zeros_like(p).index_copy_(0, d2t, tree.proposals[node].float())
        found = torch.zeros((), dtype=torch.bool, device=device)
        child = torch.full((), -1, dtype=torch.long, device=device)
        for k in range(tree.child_tokens.shape[1]):
            candidate = tree.child_tokens[node, k]
            tried = ~found & (candidate >= 0)
            x = candidate.clamp_min(0)
            if k < drafted:  # drawn from q without replacement
                accept = tried & (torch.rand((), device=device) * q[x] < p[x])
                residual = _normalize((p - q).clamp_min(0), fallback=p)
                q = torch.where(tried & ~accept, _normalize(q.index_fill(0, x[None], 0), fallback=q), q)
            else:  # a point mass on x: accepted with probability p(x), else x leaves the residual
                accept = tried & (torch.rand((), device=device) < p[x])
                residual = without_token(p, x)
            token = torch.where(walking & accept, x, token)
            child = torch.where(accept, tree.child_nodes[node, k], child)
            p = torch.where(tried & ~accept, residual, p)
            found = found | accept
        drawn = torch.multinomial(p, 1)[0]
        token = torch.where(walking & ~found, drawn, token)
        go_on = walking & (child >= 0)
        node = torch.where(go_on, child, node)
        walking = go_on
    return path_to(tree, node), tree.depths[node] + 1, token


def without_token(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The residual after a point-mass proposal of token `x` is rejected: p with x zeroed, renormalised."""
    return _normalize(p.index_fill(0, x[None], 0), fallback=p)


def _normalize(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    return torch.where(total > 0, x / total.clamp_min(torch.finfo(x.dtype).tiny), fallback)
