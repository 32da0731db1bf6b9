"""Key/value caches of the decoding loop: transformers' `DynamicCache` (eager mode) or preallocated static
layers (static mode), with the two edits the loop needs on either: truncate, and keep an accepted path."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer


def cache_kwargs(model: PreTrainedModel, cache: Cache) -> dict:
    """`{name: cache}` for `model.forward`: transformers 5.24 renamed `past_key_values` to `cache`."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def full_attention(config) -> bool:
    """Whether every layer of a model with `config` attends to the full context (no sliding window, chunked or
    linear attention): what the static mode, batched decoding and continuous batching need."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def is_static(cache: Cache) -> bool:
    return bool(cache.layers) and isinstance(cache.layers[0], StaticLayer)


class FilledStaticLayer(StaticLayer):
    """A `StaticLayer` whose attention sees its filled positions only, not its whole capacity: for the
    uncompiled static mode on a CPU, where fixed shapes buy nothing and the spare room of a bucketed capacity
    would cost attention time in every pass. Keys and values keep their one preallocated buffer (reading the
    fill level is free on a CPU; under `torch.compile` it would break the graph: use `StaticLayer` there)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        end = int(self.cumulative_length)
        return keys[:, :, :end], values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self.get_seq_length()) + query_length, 0


def static_cache(num_layers: int, capacity: int, filled_only: bool = False) -> Cache:
    """A cache of `num_layers` preallocated layers of `capacity` positions (allocated at the first write):
    keys and values keep one address for the whole generation, as CUDA graphs need. `filled_only`: attention
    sees the filled positions only (`FilledStaticLayer`, uncompiled on a CPU)."""
    if not hasattr(StaticLayer(1), "cumulative_length"):
        raise RuntimeError("The static mode needs transformers' StaticLayer.cumulative_length (transformers >= 5.23).")
    layer = FilledStaticLayer if filled_only else StaticLayer
    return Cache(layers=[layer(max_cache_len=capacity) for _ in range(num_layers)])


def key_width(cache: Cache, needed: int | torch.Tensor) -> int:
    """Width of the key axis an attention mask must have after writing up to `needed` positions: the
    capacity of a static cache (checked against `needed` when it is a host int), else `needed` (as a host int
    for a `FilledStaticLayer` cache)."""
    if is_static(cache):
        capacity = cache.layers[0].max_cache_len
        if isinstance(needed, int) and needed > capacity:
            raise ValueError(f"The static cache holds {capacity} positions, {needed} are needed.")
        return int(needed) if isinstance(cache.layers[0], FilledStaticLayer) else capacity
    return needed


def truncate_cache(cache: Cache, length: int | torch.Tensor) -> None:
    """Drop every position from `length` on (no copy: views, or the static write position moved back)."""
    for layer in cache.layers:
        if isinstance(layer, StaticLayer):
            layer.cumulative_length.fill_(length)
        else:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def reset_cache(cache: Cache) -> None:
    """Empty a kept static cache for its next generation, each layer back to its whole preallocated buffer (a
    batch's finished rows leave views of its first rows: `batched.RowCache.select`)."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys, layer.values = (s if s._base is None else s._base for s in (layer.keys, layer.values))
    truncate_cache(cache, 0)


def keep_path(cache: Cache, start: int | torch.Tensor, path: torch.Tensor, length: int | torch.Tensor) -> None:
    """Keep positions `[0, start)` followed by `start + path[:length]`, drop the rest.

    After a tree verify pass the tree's nodes sit at `start + i`; the accepted path's nodes (ascending, a
    fixed-size tensor whose entries past `length` are ignored) are moved down to `start, start + 1, ...` in
    place, then the tail is cut off. The copy has a fixed shape; on a static cache `start` and `length` may be
    0-d device tensors, so that it needs no host sync and compiles once (the static mode compiles it).
    """
    layer0 = cache.layers[0]
    width = path.numel() if isinstance(layer0, StaticLayer) else min(path.numel(), layer0.keys.shape[-2] - start)
    source = path[:width] + start
    target = torch.arange(width, device=path.device) + start
    for layer in cache.layers:
        layer.keys.index_copy_(-2, target, layer.keys.index_select(-2, source))
        layer.values.index_copy_(-2, target, layer.values.index_select(-2, source))
    truncate_cache(cache, start + length)


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

    def keep(self, rows: torch.Tensor | None, start: int) -> None:
        """Keep the batch rows `rows` (None: all of them) and the positions from `start` on; a negative `start`
        puts `-start` zero positions before them. One copy into a new buffer with spare room (an index, a
        concatenation and the next `update` would each copy the cache)."""
        pad, skip = max(-start, 0), max(start, 0)
        needed = pad + self.get_seq_length() - skip
        buffers = []
        for states in (self.keys, self.values):
            kept = states[:, :, skip:] if rows is None else states[rows, :, skip:]
            buffer = states.new_empty((kept.shape[0], kept.shape[1], needed + self.reserve, kept.shape[3]))
            buffer[:, :, :pad] = 0  # masked out, but never garbage: a NaN there would still reach the output
            buffer[:, :, pad:needed] = kept
            buffers.append(buffer)
        self._buffers = tuple(buffers)
        self.keys, self.values = buffers[0][:, :, :needed], buffers[1][:, :, :needed]

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def growing_cache(config, reserve: int = 256) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers grow in place (see `GrowingLayer`)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
