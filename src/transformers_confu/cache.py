"""Editing transformers' `DynamicCache` in place: truncate, and keep an accepted path."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel


def cache_kwargs(model: PreTrainedModel, cache: DynamicCache) -> dict:
    """`{name: cache}` for `model.forward`: transformers 5.24 renamed `past_key_values` to `cache`."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def cache_length(cache: DynamicCache) -> int:
    """Number of cached positions."""
    return cache.get_seq_length()


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Drop every position from `length` on (views, no copy)."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def keep_path(cache: DynamicCache, start: int, path: list[int]) -> None:
    """Keep positions `[0, start)` followed by `start + path` (sorted ascending), drop the rest.

    Used after a tree verify pass: the tree's nodes sit at `start + i`; the accepted path's nodes are
    moved down to `start, start + 1, ...` in place, then the tail is cut off.
    """
    n = len(path)
    if path != list(range(n)):
        index = torch.tensor(path, device=cache.layers[0].keys.device) + start
        for layer in cache.layers:
            layer.keys[..., start : start + n, :] = layer.keys[..., index, :]
            layer.values[..., start : start + n, :] = layer.values[..., index, :]
    truncate_cache(cache, start + n)
