"""`SuffixAssistant`: draft-free speculative decoding for any causal LM, through the same call.

    assistant = SuffixAssistant(model)                       # the sequence itself (prompt + answer so far)
    assistant = SuffixAssistant(model, corpus="my_corpus/")  # and a corpus of the model's own past answers
    out = model.generate(**inputs, assistant_model=assistant)

Each round verifies a tree of suffix candidates (`suffix.SuffixProposer`) in one target pass and accepts
with the same rules as the draft's trees (greedy identical to plain `generate`; sampling exact: each suffix
candidate is a point-mass proposal). No draft model runs, so a round costs one target pass and a lookup.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedModel

from .assistant import (
    RoutedAssistant,
    _generation_config,
    call_arguments,
    _max_new_tokens,
    checked_input_ids,
    static_parts,
    returned,
    score_record,
    sequence_copies,
    uses_static_cache,
    wrap_generate,
)
from .batched import generate_batch, is_batch
from .generation import KeptCaches, SpeculativeStats, TreeBudget, speculative_generate
from .processing import node_processing
from .suffix import CorpusIndex, SuffixProposer, load_proposer
from .tree import DraftTree, suffix_tree
from .width import checked_width, round_costs

DEFAULT_TOTAL_TOKENS = 8  # nodes verified per round, root included (measured: results/suffix_*.md)


class SuffixDrafter:
    """The decoding loop's drafter without a draft: each tree holds suffix candidates alone."""

    d2t = None  # no draft vocabulary: every child is a point-mass proposal
    cache = None  # no draft cache (what `KeptCaches` keeps of a draft)

    def __init__(self, proposer: SuffixProposer, total_tokens: int, pad: bool,
                 costs: dict[int, float] | None = None) -> None:
        self.proposer, self.total_tokens, self.pad, self.costs = proposer, total_tokens, pad, costs
        proposer.reset()

    def catch_up(self, next_ids, features, length, future=None, count=None) -> None:
        """Nothing to feed: the proposer reads the context in `propose`."""

    def propose(self, root: torch.Tensor | int, root_position, prior=None, context=None, allowed=None) -> DraftTree:
        device = root.device if torch.is_tensor(root) else "cpu"
        candidates = self.proposer.candidates(context, device, self.pad, allowed)
        return suffix_tree(root, candidates, self.total_tokens, self.pad, self.costs)


class SuffixAssistant(RoutedAssistant):
    """Suffix drafting bound to a target model, usable as `model.generate(..., assistant_model=self)`.

    Args:
        model: any causal LM. Batches (left-padded, as plain batched `generate` takes them) run
            `batched.generate_batch`: each row its own proposer (a `fork`: the corpus shared) and tree.
        corpus: None (the sequence itself only), a corpus folder or Hub id (built with
            `python -m transformers_confu.training.suffix_corpus`), or a `CorpusIndex`.
        tokenizer: checks that the corpus was built with the model's tokenizer (default: the one saved with
            the model, `model.config.name_or_path`).
        total_tokens: nodes verified per round (root included; default `DEFAULT_TOTAL_TOKENS`); a call can
            override it with `tree_total_tokens=`. Unless one of them is given, a batch runs
            `batched.batch_budget`'s choice.
        width: "fixed" (every round verifies up to `total_tokens` nodes) or "auto" (the eager batch-1 loop picks
            each round's width from the candidates' estimates and the target's verify costs, measured at the first
            such call and kept as `verify_costs`; `width.py`), or a cost table {width: seconds} to pick with.
        **settings: `SuffixProposer` options (`max_depth`, `branch`, `max_match`, ...).

    Attributes: `proposer` (the `SuffixProposer`), `budget` (its tree bounds), `stats` (`SpeculativeStats` of the
    last call; a `batched.BatchStats` for a batch), `kept_caches` (the last eager batch-1 call's target cache,
    reused by a next call that continues its sequence, e.g. a chat's next turn; `kept_caches.clear()` drops it,
    `kept_caches = None` keeps none).
    """

    build = "`SuffixAssistant(model)`"

    def __init__(self, model: PreTrainedModel, corpus: str | os.PathLike | CorpusIndex | None = None,
                 tokenizer=None, total_tokens: int | None = None, width: str | dict[int, float] = "fixed",
                 **settings: Any) -> None:
        self.width, self.verify_costs = checked_width(width), None
        self._budget_set = total_tokens is not None
        total_tokens = DEFAULT_TOTAL_TOKENS if total_tokens is None else total_tokens
        if total_tokens < 2:
            raise ValueError(f"total_tokens={total_tokens}: a suffix tree needs at least 2 nodes (the root and one).")
        settings.setdefault("max_nodes", total_tokens - 1)
        self.proposer = load_proposer(True if corpus is None else corpus, model, tokenizer, **settings)
        self.target, self.total_tokens = model, total_tokens
        self.stats = SpeculativeStats()
        self._static: dict | None = None
        self.kept_caches = KeptCaches()
        wrap_generate(model)

    @property
    def budget(self) -> TreeBudget:
        """The tree's bounds: the proposer's depth and branching, `total_tokens` nodes."""
        return TreeBudget(depth=self.proposer.max_depth, top_k=self.proposer.branch, total_tokens=self.total_tokens)

    def generate(self, target: PreTrainedModel, input_ids: torch.LongTensor | None = None, **kwargs: Any):
        """Run suffix speculative decoding; called through `target.generate(assistant_model=self)`."""
        input_ids, mask = kwargs.pop("inputs", input_ids), kwargs.pop("attention_mask", None)
        batched = is_batch(input_ids, mask)
        input_ids = checked_input_ids(self.target, target, input_ids, self.build, batched)
        tree_set = self._budget_set or "tree_total_tokens" in kwargs
        budget = replace(self.budget, total_tokens=kwargs.pop("tree_total_tokens", self.total_tokens))
        total = budget.total_tokens
        if total < 2:
            raise ValueError(f"tree_total_tokens={total}: a suffix tree needs at least 2 nodes.")
        tokenizer, streamer, options, stopping = call_arguments(kwargs)
        config = _generation_config(target, kwargs)
        max_new = _max_new_tokens(config, input_ids.shape[1], budget, target)
        input_ids, mask = sequence_copies(input_ids, mask, config)
        batched = batched or input_ids.shape[0] > 1
        wants_static = uses_static_cache(config, "suffix")
        record, static = score_record(config, batched, wants_static), None
        if wants_static:
            self._static = static_parts(target, config, input_ids.shape[1] + max_new + 2 * total + 2, self._static,
                                        False, input_ids.shape[0] if batched else None)
            static = self._static["target"]
        if batched:  # B > 1 or left padding
            return returned(generate_batch(self, target, input_ids, mask, config, budget if tree_set else None,
                                           max_new, tokenizer, streamer, suffix=self.proposer,
                                           static=None if static is None else self._static, options=options,
                                           record=record, stopping=stopping), config, record)
        self.stats = SpeculativeStats(mode="eager" if static is None else "static")
        layers = [target.config.num_hidden_layers]  # the loop reads features; nothing uses them here
        costs = None if static is not None else round_costs(self, target, total)
        processing = node_processing(target, config, input_ids, input_ids.shape[1] + max_new, **options)[0]
        output = speculative_generate(target, SuffixDrafter(self.proposer, total, static is not None, costs), layers,
                                      input_ids, config, max_new, self.stats, tokenizer, streamer, static=static,
                                      processing=processing, record=record, stopping=stopping,
                                      kept=self.kept_caches)
        self.stats.suffix_seconds = self.proposer.seconds
        return returned(output, config, record)

