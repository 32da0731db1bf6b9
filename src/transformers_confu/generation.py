"""The speculative decoding loop: draft a tree, verify it in one target pass, accept, compact, repeat."""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    PreTrainedModel,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StopStringCriteria

from .cache import cache_kwargs, keep_path
from .tree import TreeDrafter, additive_mask
from .verify import accept_greedy, accept_sampling


@dataclass
class TreeBudget:
    """EAGLE-2 dynamic tree budget: levels drafted, children per node, nodes verified (root included)."""

    depth: int = 4
    top_k: int = 4
    total_tokens: int = 16


@dataclass
class SpeculativeStats:
    """What one `generate` call did. `mean_accepted_tokens` (tau) counts the bonus token."""

    new_tokens: int = 0
    target_forwards: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def other_seconds(self) -> float:
        """Wall time outside the draft and target forwards (tree building, acceptance, bookkeeping)."""
        return self.total_seconds - self.draft_seconds - self.verify_seconds

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_accepted_tokens": self.mean_accepted_tokens, "other_seconds": self.other_seconds}


def logits_warpers(config: GenerationConfig) -> LogitsProcessorList:
    """The sampling warpers `generate` applies, in its order."""
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p))
    return warpers


def stopping_criteria(config: GenerationConfig, max_length: int, tokenizer=None) -> StoppingCriteriaList:
    """The stopping criteria `generate` would use: length, EOS and stop strings."""
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=max_length)])
    if config.eos_token_id is not None:
        criteria.append(EosTokenCriteria(eos_token_id=config.eos_token_id))
    if config.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass `tokenizer=tokenizer` to generate().")
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings))
    return criteria


class _Target:
    """The frozen target's forward pass, returning next-token logits and fused draft features."""

    def __init__(self, model: PreTrainedModel, feature_layers: list[int]) -> None:
        self.model, self.layers = model, feature_layers
        self.cache = DynamicCache(config=model.config)
        self.kwargs = cache_kwargs(model, self.cache)
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def __call__(self, ids, positions=None, mask=None, last_only=False) -> tuple[torch.Tensor, torch.Tensor]:
        """`last_only`: the next-token logits of the last position only (the prefill needs no more)."""
        kwargs = {**self.kwargs, "logits_to_keep": 1} if last_only and self.keeps_logits else self.kwargs
        out = self.model(
            input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
            output_hidden_states=True, **kwargs,
        )
        features = torch.cat([out.hidden_states[i] for i in self.layers], dim=-1)
        return out.logits[0], features


def _append(output, tokens, criteria, streamer) -> tuple[torch.LongTensor, bool]:
    """Append `tokens` one at a time, stopping where `generate`'s stopping criteria would."""
    stopped, kept = False, 0
    for token in tokens:
        output = torch.cat([output, output.new_tensor([[token]])], dim=1)
        kept += 1
        stopped = bool(criteria(output, None).any())
        if stopped:
            break
    if streamer is not None:
        streamer.put(output[0, -kept:].cpu())
    return output, stopped


def _probs(logits: torch.Tensor, warpers: LogitsProcessorList) -> torch.Tensor:
    """(N, V) logits -> the processed next-token probabilities that `generate` samples from."""
    return torch.softmax(warpers(None, logits.float()), -1)


def _select_token(logits: torch.Tensor, warpers: LogitsProcessorList | None) -> int:
    if warpers is None:
        return int(logits.argmax())
    return int(torch.multinomial(_probs(logits[None], warpers)[0], 1))


@torch.no_grad()
def speculative_generate(
    target: PreTrainedModel,
    drafter: TreeDrafter,
    feature_layers: list[int],
    input_ids: torch.LongTensor,
    config: GenerationConfig,
    max_new_tokens: int,
    stats: SpeculativeStats,
    tokenizer=None,
    streamer=None,
) -> torch.LongTensor:
    """Generate up to `max_new_tokens` after `input_ids` (1, T); returns (1, T + new)."""
    start = time.perf_counter()
    prompt_len = input_ids.shape[1]
    criteria = stopping_criteria(config, prompt_len + max_new_tokens, tokenizer)
    warpers = logits_warpers(config) if config.do_sample else None
    verify = _Target(target, feature_layers)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    t0 = time.perf_counter()
    logits, features = verify(input_ids, last_only=True)
    stats.verify_seconds += time.perf_counter() - t0
    token = _select_token(logits[-1], warpers)
    output, stopped = _append(input_ids, [token], criteria, streamer)
    next_ids, feats, length = output[:, 1:], features, prompt_len
    while not stopped:
        # Draft: catch up on the newly accepted tokens, then draft a tree under the last one.
        t0 = time.perf_counter()
        drafter.catch_up(next_ids, feats, length)
        tree = drafter.propose(token, length)
        t1 = time.perf_counter()
        # Verify the whole tree in one target pass, accept a path, keep only its keys and values.
        mask = additive_mask(tree.ancestry().to(output.device), length, target.dtype)
        logits, features = verify(tree.tokens[None], (length + tree.depths)[None], mask)
        t2 = time.perf_counter()
        if warpers is None:
            path, token = accept_greedy(tree, logits)
        else:
            path, token = accept_sampling(tree, _probs(logits, warpers), drafter.d2t)
        keep_path(verify.cache, length, path)
        accepted = tree.tokens[path[1:]].tolist() + [token]
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        stats.target_forwards += 1
        stats.accept_lengths.append(len(accepted))
        output, stopped = _append(output, accepted, criteria, streamer)
        next_ids, feats = output[:, -len(path):], features[:, path]
        length += len(path)
    if streamer is not None:
        streamer.end()
    stats.new_tokens = output.shape[1] - prompt_len
    stats.total_seconds = time.perf_counter() - start
    return output
