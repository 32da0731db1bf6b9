"""An oracle drafter that knows the target's greedy continuation: the decoding loop's ceiling.

It proposes the true continuation as a chain of `depth` tokens and fills the rest of the tree with
wrong siblings, so a verify pass has the same width as a real draft's. Used by the tests (long
accepted blocks through every path of the loop) and by the loop-ceiling benchmark.
"""

from __future__ import annotations

import torch

from .tree import DraftTree


class OracleDrafter:
    """Proposes `reference[p]` at each position p (greedy decoding only)."""

    def __init__(self, reference: torch.LongTensor, depth: int, total_tokens: int, vocab_size: int) -> None:
        self.reference = reference.flatten().tolist()
        self.depth, self.total_tokens, self.vocab_size = depth, total_tokens, vocab_size
        self.d2t = torch.arange(vocab_size)

    def catch_up(self, next_ids: torch.LongTensor, features: torch.Tensor, length: int, future=None,
                 count: int | None = None) -> None:
        """Nothing to do: the oracle needs no state."""

    def propose(self, root: torch.Tensor | int, root_position: int, prior: torch.Tensor | None = None,
                context=None, allowed=None) -> DraftTree:
        """The true continuation under `root` (a `prior`, the `context` or what is `allowed` change nothing: the
        oracle knows)."""
        chain = self.reference[root_position + 1 : root_position + 1 + self.depth]
        tokens, parents = [int(root)], [-1]
        for token in chain[: self.total_tokens - 1]:
            parents.append(len(tokens) - 1)
            tokens.append(token)
        level = 0
        while len(tokens) < self.total_tokens:  # wrong siblings along the chain, round robin
            parent = level % len(tokens)
            parents.append(parent)
            tokens.append((tokens[min(parent + 1, len(chain))] + 1 + level) % self.vocab_size)
            level += 1
        return DraftTree.from_parents(tokens, parents)
