"""Lossless acceptance of a verified draft tree.

Both rules walk down from the root and return the accepted path (node indices, root first) and the
next token, drawn from the target: the "bonus" token that ends the round.
"""

from __future__ import annotations

import torch

from .tree import DraftTree


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Follow the target's argmax through the tree. `target_logits`: (N, V) at the tree's nodes."""
    best = target_logits.argmax(dim=-1).tolist()
    path = [0]
    while True:
        token = best[path[-1]]
        node = next((i for t, i in tree.children[path[-1]] if t == token and i >= 0), -1)
        if node < 0:
            return path, token
        path.append(node)


def accept_sampling(tree: DraftTree, target_probs: torch.Tensor, d2t: torch.Tensor) -> tuple[list[int], int]:
    """Multi-draft recursive rejection sampling (children drawn without replacement).

    At a node with target distribution p, the children x_1, x_2, ... were drawn in order from the
    draft distribution q with earlier draws removed (q_i). Child x_i is accepted with probability
    min(1, p_i(x_i) / q_i(x_i)); on rejection p_{i+1} = norm(max(p_i - q_i, 0)). If all are rejected the
    token is drawn from the last residual. Each step is an exact rejection-sampling step, so the token
    leaving a node is distributed exactly as p. A pruned child (not verified) that is accepted still is
    an exact draw from p: it becomes the round's last token.

    Args:
        tree: the drafted tree.
        target_probs: (N, V) the target's processed next-token probabilities at the tree's nodes.
        d2t: (D,) draft-to-target id map (the proposals are over the draft vocabulary).
    """
    path = [0]
    while True:
        node = path[-1]
        p = target_probs[node].float()
        children = tree.children[node]
        token, child = -1, -1
        if children:
            q = torch.zeros_like(p)
            q[d2t] = tree.proposals[node].float()
            for candidate, index in children:
                if torch.rand(()) * q[candidate] < p[candidate]:
                    token, child = candidate, index
                    break
                p = _normalize((p - q).clamp_min_(0), fallback=p)
                q[candidate] = 0
                q = _normalize(q, fallback=q)
        if token < 0:
            token = int(torch.multinomial(p, 1))
        if child < 0:
            return path, token
        path.append(child)


def _normalize(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    return x / total if total > 0 else fallback
