"""What `generate` does to the target's logits before it picks a token, at every node of a verified tree.

transformers builds the list (`GenerationMixin._get_logits_processor`: penalties, constraints, forced and
suppressed tokens, `logits_processor=` and `prefix_allowed_tokens_fn=` of the call, then the sampling warpers),
so the options and their order are plain `generate`'s. A processor may read the tokens before the position it
scores; at a tree node those are the context (prompt and accepted tokens, ending with the tree's root) and the
node's drafted ancestors, so each node is processed with its own prefix, as transformers' assisted decoding
processes each candidate position. The trailing processors that read no tokens (temperature, top-k, top-p, ...)
run once on all nodes. Like transformers' assisted decoding, this assumes a processor's output depends only on
its (input_ids, scores) row, not on earlier calls.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .tree import DraftTree

# processors whose output does not read `input_ids`: run once on all of a tree's nodes when they end the list
TOKEN_FREE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TopHLogitsWarper,
              TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper, LogitNormalization,
              InfNanRemoveLogitsProcessor, SuppressTokensLogitsProcessor)
CALL_OPTIONS = ("logits_processor", "prefix_allowed_tokens_fn")  # generate() arguments that add processors


class NodeProcessing:
    """The processors `generate` applies to one sequence, applied at the nodes of its trees.

    Attributes:
        per_prefix: the processors up to the last one that reads `input_ids`, run on each node with its prefix.
        token_free: the rest (`TOKEN_FREE`), run once on all nodes.
        sample: whether tokens are drawn (else the argmax is taken).
        vocab_size, device: the scores' width and device (what `allows` builds its row with).
    """

    def __init__(self, processors: LogitsProcessorList, sample: bool, vocab_size: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        split = len(processors)
        while split and isinstance(processors[split - 1], TOKEN_FREE):
            split -= 1
        self.per_prefix = LogitsProcessorList(processors[:split])
        self.token_free = LogitsProcessorList(processors[split:])
        self.sample, self.vocab_size, self.device = sample, vocab_size, device

    def allows(self, context: np.ndarray, path: tuple[int, ...], padding: np.ndarray | None = None) -> bool:
        """Whether the processors that read ids (`per_prefix`) leave the last token of `path` possible after
        `context` (root last; after a batch row's left `padding`, which its processors see) and the path's earlier
        tokens: a row of zeros processed there is not -inf at it. Bans that depend on the ids alone
        (`no_repeat_ngram_size`, `bad_words_ids`, `min_new_tokens`, forced tokens, `prefix_allowed_tokens_fn`) are
        found; a token it rejects is never accepted, so a tree need not verify it."""
        parts = [context, np.asarray(path[:-1], dtype=context.dtype)]
        ids = torch.as_tensor(np.concatenate(parts if padding is None else [padding, *parts]), device=self.device)
        scores = self.per_prefix(ids[None], torch.zeros(1, self.vocab_size, device=self.device))
        return bool(scores[0, path[-1]] > -math.inf)

    def suffix_check(self, padding: np.ndarray | None = None) -> Callable[[np.ndarray, tuple[int, ...]], bool] | None:
        """`allows` as the suffix proposer takes it (`SuffixProposer.best_paths(allowed=)`), for a batch row with
        its left `padding`; None where no processor reads the ids (nothing to check)."""
        if not self.per_prefix:
            return None
        return self.allows if padding is None else functools.partial(self.allows, padding=padding)

    def scores(self, logits: torch.Tensor, context: torch.LongTensor, tree: DraftTree | None = None) -> torch.Tensor:
        """(N, V) logits at the nodes of `tree` (or (1, V) at the end of `context` alone) -> the scores `generate`
        picks from (argmax, or softmax when sampling). `context`: (1, L) ids ending with the tree's root."""
        if not (self.sample or self.per_prefix or self.token_free):
            return logits  # greedy, nothing to apply
        scores = logits.float()
        if self.per_prefix:
            prefixes = [context[0]] if tree is None else node_prefixes(context[0], tree)
            scores = torch.cat([self.per_prefix(ids.to(scores.device)[None], scores[i : i + 1])
                                for i, ids in enumerate(prefixes)])
        return self.token_free(None, scores) if self.token_free else scores

    def pick(self, logits: torch.Tensor, context: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token `generate` picks after `context` (1, L) from the target's (V,) `logits` there, and the (1, V)
        scores it picked from."""
        scores = self.scores(logits[None], context)
        token = torch.multinomial(probabilities(scores), 1)[0, 0] if self.sample else scores[0].argmax()
        return token, scores


def probabilities(scores: torch.Tensor) -> torch.Tensor:
    """(N, V) processed scores -> the probabilities `generate` samples from. A row whose processors leave no token
    gets a uniform one, so that the acceptance walk, which draws at every node it stops at, stays defined: such a
    node lies past `max_new_tokens` or under a token they ban (never part of the output), unless they ban every
    token after a prefix plain `generate` reaches too, where it fails."""
    return torch.where(torch.isinf(scores).all(-1, keepdim=True), 0.0, scores).softmax(-1)


def node_prefixes(context: torch.LongTensor, tree: DraftTree) -> list[torch.LongTensor]:
    """Each node's prefix: the (L,) `context` (ending with the root) and the node's drafted ancestors and itself."""
    tokens, parents = tree.tokens.clamp_min(0).tolist(), tree.parents.tolist()  # (padding nodes are never reached)
    paths: list[list[int]] = [[]]
    for node in range(1, len(tokens)):
        paths.append(paths[parents[node]] + [tokens[node]])
    context = context.cpu()
    return [torch.cat([context, context.new_tensor(path)]) for path in paths]


def call_options(kwargs: dict) -> dict:
    """Pop `generate()`'s processor arguments (`CALL_OPTIONS`) from a call's `kwargs`."""
    return {name: kwargs.pop(name) for name in CALL_OPTIONS if name in kwargs}


def node_processing(target: PreTrainedModel, config: GenerationConfig, input_ids: torch.LongTensor,
                    max_length: int, attention_mask: torch.Tensor | None = None,
                    logits_processor: LogitsProcessorList | None = None,
                    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
                    ) -> list[NodeProcessing]:
    """One `NodeProcessing` per row of `input_ids` (B, T), built as `generate` builds its list for the batch
    (`attention_mask`: its left padding, which a repetition penalty leaves out), for outputs up to `max_length`."""
    config = copy.deepcopy(config)
    config.max_length = max_length  # as generate sets it (forced EOS reads it)
    target._prepare_special_tokens(config, attention_mask is not None, device=input_ids.device,
                                   batch_size=input_ids.shape[0])
    rows = []
    for row in range(input_ids.shape[0]):
        mask = None if attention_mask is None else attention_mask[row : row + 1]
        allowed = None if prefix_allowed_tokens_fn is None else _as_row(prefix_allowed_tokens_fn, row)
        processors = target._get_logits_processor(
            config, input_ids_seq_length=input_ids.shape[1], prefix_allowed_tokens_fn=allowed,
            logits_processor=logits_processor, device=input_ids.device,
            model_kwargs=None if mask is None else {"attention_mask": mask})
        rows.append(NodeProcessing(processors, config.do_sample, _vocab_size(target), input_ids.device))
    return rows


def _vocab_size(target: PreTrainedModel) -> int:
    """The width of the target's logits."""
    head = target.get_output_embeddings()
    return target.config.get_text_config().vocab_size if head is None else head.weight.shape[0]


def _as_row(prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]], row: int
            ) -> Callable[[int, torch.Tensor], list[int]]:
    """The function as the batch's `row` calls it (a node is processed alone, as batch index 0)."""
    return lambda batch_id, ids: prefix_allowed_tokens_fn(row, ids)
