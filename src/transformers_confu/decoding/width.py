"""Per-round tree width (the eager batch-1 loop): the target's verify cost per width, measured on the machine,
and the width that maximizes a round's expected accepted tokens per unit of that cost.

A round that verifies the root and its best `k - 1` candidates accepts, in expectation, 1 + the sum of the
candidates' acceptance estimates (`exp(score)`: a draft node's path probability, a suffix candidate's
calibrated estimate) tokens, and costs one target pass over `k` tokens. Where verifying more tokens costs
more (a CPU), few likely candidates are not worth a wide pass: `best_width` picks `k` per round, down to a
plain step (`k = 1`) when nothing is likely.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from ..utils.cache import cache_kwargs, truncate_cache
from ..utils.masks import to_additive

WIDTH_MODES = ("fixed", "auto")


@torch.no_grad()
def measure_verify_costs(model: PreTrainedModel, widths: Iterable[int], context: int = 256,
                         repeats: int = 5) -> dict[int, float]:
    """{width: seconds} of one target forward over `width` chained tokens after `context` cached ones, as the
    loop's tree passes run it (an additive 4-D mask, hidden states out, `width` logits kept); the fastest of
    `repeats`, the widths interleaved so that a slow moment of the machine hits them alike."""
    widths = sorted(set(widths))
    if not widths or widths[0] < 1:
        raise ValueError(f"widths={widths}: give one or more widths >= 1.")
    device, vocab = model.device, model.config.vocab_size
    ids = torch.arange(context + widths[-1], device=device)[None] % vocab
    cache = DynamicCache(config=model.config)
    kwargs = cache_kwargs(model, cache)
    model(input_ids=ids[:, :context], use_cache=True, **kwargs)
    best = dict.fromkeys(widths, math.inf)
    for _ in range(repeats):
        for width in widths:
            allowed = torch.ones(width, context + width, dtype=torch.bool, device=device).tril(context)
            mask = to_additive(allowed, model.dtype)[None, None]
            positions = torch.arange(context, context + width, device=device)[None]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(input_ids=ids[:, context : context + width], position_ids=positions, attention_mask=mask,
                  use_cache=True, output_hidden_states=True, logits_to_keep=width, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[width] = min(best[width], time.perf_counter() - start)
            truncate_cache(cache, context)
    return best


def best_width(scores: Sequence[float], costs: Mapping[int, float]) -> int:
    """The node count k (root included) maximizing (1 + sum of exp(score) of the best k - 1 candidates) /
    costs[k], among the widths of `costs` that the candidates fill (k <= len(scores) + 1).

    `scores`: the candidates' log acceptance estimates, best first, parents before their children (so any
    prefix is a tree); `costs`: {width: seconds}, width 1 (a plain step) included."""
    if 1 not in costs:
        raise ValueError(f"The cost table has widths {sorted(costs)}: it needs width 1 (a plain step).")
    gains = [1.0]
    for score in scores:
        gains.append(gains[-1] + math.exp(score))
    return max((k for k in costs if k <= len(gains)), key=lambda k: (gains[k - 1] / costs[k], -k))


def checked_width(width: str | Mapping[int, float]) -> str | dict[int, float]:
    """An assistant's `width` option: "fixed", "auto" or a cost table {width: seconds} (with width 1)."""
    if isinstance(width, Mapping):
        table = {int(k): float(v) for k, v in width.items()}
        if 1 not in table or min(table) < 1 or min(table.values()) <= 0:
            raise ValueError(f"width={width!r}: a cost table maps widths >= 1, width 1 included, to seconds > 0.")
        return table
    if width not in WIDTH_MODES:
        raise ValueError(f"width={width!r}: use 'fixed' (every round verifies the whole budget), 'auto' (a width per "
                         "round from the candidates' estimates and this machine's verify costs) or a cost table "
                         "{width: seconds}.")
    return width


def round_costs(assistant, model: PreTrainedModel, total_tokens: int) -> dict[int, float] | None:
    """The cost table the eager batch-1 loop picks widths with: None for `width="fixed"`; for "auto" the
    target's measured costs of widths 1..`total_tokens` (measured at the first call and kept on the assistant as
    `verify_costs`, widths a later, larger budget needs measured then); a given table as it is."""
    if assistant.width == "fixed":
        return None
    if assistant.width != "auto":
        return assistant.width
    costs = assistant.verify_costs or {}
    missing = [w for w in range(1, total_tokens + 1) if w not in costs]
    if missing:
        costs = assistant.verify_costs = {**costs, **measure_verify_costs(model, missing)}
    return costs
