"""Suffix drafting: candidate continuations from the sequence itself and a corpus, scored by calibrated
acceptance estimates, as a small token tree under the round's root.

For the current context (prompt + accepted tokens, the root last) each source (`suffix_index`) finds the
longest earlier match of the context's suffix and the continuations that followed its occurrences; they form
a trie whose node counts say how often each continuation was seen. A node's conditional acceptance estimate
(the chance the target accepts it once its parent is accepted) is read from a `Calibration` table by source,
match length, count share among its siblings, support (occurrences under its parent) and depth, fitted on
the target's own training answers (teacher-forced: the answers ARE the target's greedy outputs). A path's
estimate is the product along it, the same quantity as a draft node's path probability, so both kinds of
candidate can compete for one node budget (`tree._select`). The two sources' tries are merged by path,
keeping the better estimate; the best `max_nodes` nodes (at most `branch` children per node, parents always
before children) are returned as a fixed-size `SuffixCandidates`.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..models.hub import SUFFIX_FOLDER
from ..models.target import CONFU_DRAFT
from .suffix_index import CorpusIndex, SequenceIndex

SOURCES = ("sequence", "corpus")
Allowed = Callable[[np.ndarray, tuple[int, ...]], bool]  # (context, path) -> whether the path's last token can follow
MATCH_BINS = (1, 2, 3, 4, 6, 8, 12)  # lower edges of the match-length buckets
SHARE_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # lower edges of the count-share buckets (last: all occurrences agree)
SUPPORT_BINS = (1, 2, 3, 5, 9, 33)  # lower edges of the support buckets (occurrences under the parent)
DEPTH_BINS = (1, 2, 3, 4)
SMOOTHING = 4.0  # pseudo-trials pulling a cell towards its (source, depth) rate


class SuffixCandidates(NamedTuple):
    """S candidate nodes under the root (parents first), as `tree._select` merges them with a draft's.

    tokens, parents (index into these S, -1 for the root), scores (log acceptance estimate of the path;
    -inf pads), ranks (sibling order, < branch), depths (1 under the root): (S,) tensors; `max_depth`,
    `branch`: the static bounds of depth and children per node."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    ranks: torch.Tensor
    depths: torch.Tensor
    max_depth: int
    branch: int


def _bucket(edges: Sequence[float], value: float) -> int:
    return max(0, bisect.bisect_right(edges, value) - 1)


def _share_bucket(share: float) -> int:
    return len(SHARE_BINS) - 1 if share >= 1.0 else min(_bucket(SHARE_BINS, share), len(SHARE_BINS) - 2)


@dataclass
class Calibration:
    """Conditional acceptance estimates by (source, match length, share, support, depth) bucket.

    `hits` and `trials` are the counts it was fitted from (teacher-forced on training answers)."""

    hits: np.ndarray
    trials: np.ndarray

    @classmethod
    def empty(cls) -> "Calibration":
        shape = (len(SOURCES), len(MATCH_BINS), len(SHARE_BINS), len(SUPPORT_BINS), len(DEPTH_BINS))
        return cls(np.zeros(shape), np.zeros(shape))

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        calibration = cls(np.asarray(data["hits"], dtype=float), np.asarray(data["trials"], dtype=float))
        if calibration.hits.shape != cls.empty().hits.shape:
            raise ValueError(f"A suffix calibration of shape {calibration.hits.shape} was saved by another version "
                             f"(expected {cls.empty().hits.shape}): calibrate again.")
        return calibration

    def to_dict(self) -> dict:
        return {"hits": self.hits.astype(int).tolist(), "trials": self.trials.astype(int).tolist(),
                "bins": {"match": MATCH_BINS, "share": SHARE_BINS, "support": SUPPORT_BINS, "depth": DEPTH_BINS}}

    @staticmethod
    def cell(source: int, match: int, share: float, support: float, depth: int) -> tuple[int, ...]:
        return (source, _bucket(MATCH_BINS, match), _share_bucket(share), _bucket(SUPPORT_BINS, support),
                _bucket(DEPTH_BINS, depth))

    def record(self, cell: tuple[int, ...], hit: bool) -> None:
        self.trials[cell] += 1
        self.hits[cell] += hit

    def table(self) -> np.ndarray:
        """The smoothed estimates: each cell pulled towards its source and depth's overall rate (which
        itself defaults to 0.3 where nothing was seen)."""
        axes = (1, 2, 3)
        base = (self.hits.sum(axes, keepdims=True) + 0.3 * SMOOTHING) / (self.trials.sum(axes, keepdims=True) + SMOOTHING)
        return (self.hits + SMOOTHING * base) / (self.trials + SMOOTHING)


class SuffixProposer:
    """Builds `SuffixCandidates` for a context from the sequence itself and, optionally, a corpus.

    Args:
        corpus: a `CorpusIndex` (the target's own answers), or None for the sequence alone.
        calibration: the estimates table (default: the corpus's saved one, else a flat prior).
        max_nodes: S, candidates returned (the suffix share of a hybrid tree's budget).
        max_depth: continuation tokens per path; branch: children kept per node.
        max_match / min_match: match lengths tried; max_occurrences: occurrences read per source.
    """

    def __init__(self, corpus: CorpusIndex | None = None, calibration: Calibration | None = None,
                 max_nodes: int = 8, max_depth: int = 6, branch: int = 2, max_match: int = 12, min_match: int = 1,
                 max_occurrences: int = 32) -> None:
        if min(max_nodes, max_depth, branch, max_match, min_match, max_occurrences) < 1:
            raise ValueError("SuffixProposer settings must all be >= 1.")
        if calibration is None and corpus is not None and "calibration" in corpus.meta:
            calibration = Calibration.from_dict(corpus.meta["calibration"])
        self.corpus, self.calibration = corpus, calibration or Calibration.empty()
        self.log_estimates = {cell: math.log(v) for cell, v in np.ndenumerate(self.calibration.table())}  # by cell
        self.max_nodes, self.max_depth, self.branch = max_nodes, max_depth, branch
        self.max_match, self.min_match, self.max_occurrences = max_match, min_match, max_occurrences
        self.sequence = SequenceIndex()
        self.seconds = 0.0  # spent in `candidates` since the last reset

    def reset(self) -> None:
        """Forget the sequence and the time spent (a new `generate` call)."""
        self.sequence, self.seconds = SequenceIndex(), 0.0

    def fork(self) -> "SuffixProposer":
        """A proposer for another sequence (a batch's row): this one's settings, corpus and calibration, shared,
        with an empty sequence of its own."""
        forked = copy.copy(self)
        forked.reset()
        return forked

    def source_tries(self, context: np.ndarray) -> list[tuple[int, int, list[np.ndarray], float]]:
        """Per source that matched: (source, match length, continuations, occurrences each stands for)."""
        self.sequence.sync(context)
        found = []
        length, starts = self.sequence.match(self.max_match, self.min_match, self.max_occurrences)
        if length:
            seq = self.sequence.tokens[: self.sequence.length]
            found.append((0, length, [seq[s : s + self.max_depth].tolist() for s in starts], 1.0))
        if self.corpus is not None:
            length, starts, total = self.corpus.match(context, self.max_match, self.min_match, self.max_occurrences)
            if length:
                found.append((1, length, self.corpus.continuations(starts, self.max_depth), total / starts.size))
        return found

    def best_paths(self, context: np.ndarray, allowed: Allowed | None = None) -> dict[tuple[int, ...], float]:
        """The best `max_nodes` candidate paths (token tuples) with their log acceptance estimates, both sources
        merged (a path keeps its better estimate), at most `branch` children per path, best first. `allowed`:
        a predicate (context, path) -> whether the path's last token can follow (the call's logits processors);
        a path it rejects is left out with its children.

        Best-first: a path's children are scored only once it is taken (a child never scores above its parent,
        so this takes exactly the best paths, parents before children)."""
        tries = [(source, length, weight, *_trie(continuations))
                 for source, length, continuations, weight in self.source_tries(context)]
        heap: list = []

        def expand(t: int, parent: tuple[int, ...], score: float) -> None:
            source, length, weight, counts, children = tries[t]
            for child in children.get(parent, ()):
                cell = self.calibration.cell(source, length, counts[child] / counts[parent], counts[parent] * weight,
                                             len(child))
                heapq.heappush(heap, (-(score + self.log_estimates[cell]), len(child), child, t))

        for t in range(len(tries)):
            expand(t, (), 0.0)
        taken: dict[tuple[int, ...], float] = {}
        kids: dict[tuple[int, ...], int] = defaultdict(int)
        banned: set[tuple[int, ...]] = set()  # rejected by `allowed`: checked once, though both sources find it
        while heap and len(taken) < self.max_nodes:
            negative, _, path, t = heapq.heappop(heap)
            if path not in taken:  # else: the other source's estimate of it, lower; its children may still count
                if kids[path[:-1]] == self.branch or path in banned:
                    continue
                if allowed is not None and not allowed(context, path):
                    banned.add(path)
                    continue
                kids[path[:-1]] += 1
                taken[path] = -negative
            expand(t, path, -negative)
        return taken

    def candidates(self, context: Sequence[int] | np.ndarray, device: torch.device | str = "cpu",
                   pad: bool = False, allowed: Allowed | None = None) -> SuffixCandidates:
        """The best `max_nodes` paths' nodes for `context` (its last token is the root), those `allowed` (see
        `best_paths`); `pad`: always S entries (static shapes), the missing ones with score -inf under the root."""
        start = time.perf_counter()
        paths = self.best_paths(np.asarray(context), allowed)
        index: dict[tuple[int, ...], int] = {}
        rank: dict[tuple[int, ...], int] = defaultdict(int)
        tokens, parents, scores, ranks, depths = [], [], [], [], []
        for path, score in paths.items():
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(index[path[:-1]] if len(path) > 1 else -1)
            scores.append(score)
            ranks.append(rank[path[:-1]])
            rank[path[:-1]] += 1
            depths.append(len(path))
        missing = self.max_nodes - len(tokens) if pad else 0
        tokens += [0] * missing
        parents += [-1] * missing
        scores += [-math.inf] * missing
        ranks += [self.branch - 1] * missing
        depths += [1] * missing
        # two host-to-device copies a round (one per dtype), not one per field
        ids = torch.tensor([tokens, parents, ranks, depths], dtype=torch.long, device=device)
        found = SuffixCandidates(ids[0], ids[1], torch.tensor(scores, dtype=torch.float32, device=device), ids[2],
                                 ids[3], self.max_depth, self.branch)
        self.seconds += time.perf_counter() - start
        return found


def _trie(continuations: Iterable[list[int]]) -> tuple[dict[tuple[int, ...], int], dict[tuple[int, ...], list]]:
    """The trie of the continuations: occurrences through each path (the root () counts them all) and each
    path's child paths, parents before children."""
    counts: dict[tuple[int, ...], int] = {(): 0}
    children: dict[tuple[int, ...], list] = defaultdict(list)
    for continuation in continuations:
        counts[()] += 1
        path: tuple[int, ...] = ()
        for token in continuation:
            child = path + (token,)
            if child not in counts:
                counts[child] = 0
                children[path].append(child)
            counts[child] += 1
            path = child
    return counts, children


def calibrate(proposer: SuffixProposer, examples: Iterable[tuple[Sequence[int], Sequence[int]]]) -> Calibration:
    """Fit the estimates, teacher-forced: for each (prompt ids, answer ids) and each answer position, every
    trie node whose parent path is the answer's true continuation is a trial, a hit if it continues it too.
    The answers must be the target's own (greedy) answers, never evaluation data, and absent from
    `proposer.corpus` (hold them out)."""
    calibration = Calibration.empty()
    for prompt, answer in examples:
        proposer.reset()
        context = np.asarray(list(prompt) + list(answer), dtype=np.int64)
        start = len(prompt)
        for end in range(start + 1, len(context)):  # the root is context[end - 1]
            truth = tuple(context[end : end + proposer.max_depth].tolist())
            for source, length, continuations, weight in proposer.source_tries(context[:end]):
                counts, children = _trie(continuations)
                for depth in range(min(len(truth), proposer.max_depth)):  # children of the true path's nodes
                    parent = truth[:depth]
                    for child in children.get(parent, ()):
                        cell = calibration.cell(source, length, counts[child] / counts[parent], counts[parent] * weight,
                                                depth + 1)
                        calibration.record(cell, child[-1] == truth[depth])
    return calibration


def calibration_summary(calibration: Calibration) -> dict:
    """Trials and hit rate per source and depth (what a calibration saw, for reports)."""
    rows = {}
    for s, name in enumerate(SOURCES):
        for d, depth in enumerate(DEPTH_BINS):
            trials = calibration.trials[s, ..., d].sum()
            rows[f"{name} depth {depth}{'+' if d == len(DEPTH_BINS) - 1 else ''}"] = dict(
                trials=int(trials), rate=float(calibration.hits[s, ..., d].sum() / max(trials, 1)))
    return rows



SHIPPED_CORPUS = CONFU_DRAFT / SUFFIX_FOLDER  # SmolLM2-135M-Instruct's own answers, beside the default draft


def target_tokenizer(model):
    """The tokenizer saved with `model` (its `name_or_path`), to check a corpus against."""
    from transformers import AutoTokenizer

    name = getattr(model.config, "name_or_path", "")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ValueError(f"Checking that the suffix corpus matches the model needs its tokenizer, and none was found "
                         f"at {name!r} ({err}): pass `tokenizer=`.") from err


def load_proposer(source, model, tokenizer=None, **settings) -> SuffixProposer | None:
    """A `SuffixProposer` from `source`: None/False (none), True (the sequence alone), a `SuffixProposer`
    (as is), a `CorpusIndex`, or a corpus folder / Hub id (checked against `tokenizer`, default the model's).
    `settings` go to `SuffixProposer`; without a corpus the calibration is the shipped corpus's, if any."""
    if source is None or source is False:
        return None
    if isinstance(source, SuffixProposer):
        return source
    if source is True:
        return SuffixProposer(None, settings.pop("calibration", None) or default_calibration(), **settings)
    corpus = source if isinstance(source, CorpusIndex) else CorpusIndex.from_pretrained(source)
    corpus.check_tokenizer(tokenizer or target_tokenizer(model))
    return SuffixProposer(corpus, **settings)


def default_calibration() -> Calibration | None:
    """The calibration saved with the shipped corpus (fitted on SmolLM2-135M-Instruct's training answers)."""
    config = SHIPPED_CORPUS / "config.json"
    if not config.is_file():
        return None
    return Calibration.from_dict(json.loads(config.read_text())["calibration"])
