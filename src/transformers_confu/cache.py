"""Editing transformers' `DynamicCache` in place (truncate, keep an accepted path), and a cache that grows in place."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


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


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that writes new keys/values in place into a buffer with spare room (grown by
    `reserve` positions when full) instead of concatenating a new tensor at every step: batched decoding
    on a CPU spends most of its time in those copies. `keys`/`values` stay views of the filled part, so
    `truncate_cache` and `keep_path` work on it unchanged."""

    def __init__(self, reserve: int = 256) -> None:
        super().__init__()
        self.reserve = reserve
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        buffers = self._buffers
        if buffers is None or needed > buffers[0].shape[-2] or (length and self.keys.data_ptr() != buffers[0].data_ptr()):
            shape = (*key_states.shape[:-2], needed + self.reserve, key_states.shape[-1])
            buffers = (key_states.new_empty(shape), value_states.new_empty(shape))
            if length:
                buffers[0][..., :length, :] = self.keys
                buffers[1][..., :length, :] = self.values
            self._buffers = buffers
        buffers[0][..., length:needed, :] = key_states
        buffers[1][..., length:needed, :] = value_states
        self.keys, self.values = buffers[0][..., :needed, :], buffers[1][..., :needed, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def growing_cache(config, reserve: int = 256) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers grow in place (see `GrowingLayer`)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
