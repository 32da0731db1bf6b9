"""When a round drafts (the eager batch-1 loop, `speculate="auto"`).

A speculative round (the draft's forwards, then one target pass over the tree) pays only while it accepts more
tokens than its cost in plain steps (one target pass over the last token, no draft forward). Where the draft keeps
missing (a repetition penalty moves the target's picks away from what the draft learned, a passage unlike its
training data), plain steps are faster. `Pacer` measures both in the call itself and picks per round: it steps
aside (plain steps) while the recent rounds' accepted tokens per second fall below a plain step's, and probes
again after 1, 2, 4, ... `max_wait` plain steps. The output does not depend on it (a plain step picks the token
plain `generate` picks, or samples it from the same distribution); with sampling, which draws a seed's random
numbers feed depends on the timings, so a seed no longer fixes the sample.
"""

from __future__ import annotations

import torch

from .tree import DraftTree

PACING_MODES = ("always", "auto")


def checked_pacing(speculate: str) -> str:
    """An assistant's `speculate` option: "always" or "auto"."""
    if speculate not in PACING_MODES:
        raise ValueError(f"speculate={speculate!r}: use 'always' (every round drafts) or 'auto' (plain steps where "
                         "drafting has not paid in this call, measured as it runs).")
    return speculate


def root_only(root: torch.Tensor) -> DraftTree:
    """The tree of a plain step: the root alone (nothing drafted, so sampling draws from the target's own
    distribution)."""
    tree = DraftTree.from_parents(root.reshape(1), [-1])
    tree.point_from = 0
    return tree


class Pacer:
    """Per round: draft (`drafts()`) or take a plain step, from exponential averages (weight `smoothing` on the
    newest) of this call's speculative rounds' accepted tokens and seconds and of its plain steps' seconds.

    The first round is a plain step (it measures one); afterwards a round drafts unless the last speculative
    round left the averages showing fewer tokens per second than plain steps, and then after `wait` plain steps
    a probe round drafts again; each probe that does not pay doubles the wait, up to `max_wait`."""

    def __init__(self, smoothing: float = 0.25, max_wait: int = 16) -> None:
        if not 0 < smoothing <= 1 or max_wait < 1:
            raise ValueError(f"smoothing={smoothing} must be in (0, 1] and max_wait={max_wait} >= 1.")
        self.smoothing, self.max_wait = smoothing, max_wait
        self.tokens: float | None = None  # accepted tokens per speculative round (bonus included)
        self.round: float | None = None  # seconds per speculative round
        self.step: float | None = None  # seconds per plain step
        self.wait, self.backoff = 1, 1

    def drafts(self) -> bool:
        """Whether the next round drafts (else a plain step)."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def update(self, drafted: bool, accepted: int, seconds: float) -> None:
        """Record a round: whether it drafted, the tokens it accepted, its wall time."""
        if not drafted:
            self.step = self._average(self.step, seconds)
            return
        self.tokens = self._average(self.tokens, accepted)
        self.round = self._average(self.round, seconds)
        if self.tokens * self.step >= self.round:
            self.backoff = 1
        else:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, self.max_wait)
