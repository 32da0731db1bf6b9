"""The decoding loop's caches: the uncompiled static mode's attention sees the filled positions only; a growing
layer keeps rows and positions in one copy and writes in place after it."""

from __future__ import annotations

import torch
from conftest import tiny_target
from test_sampling import compiled_static
from transformers.cache_utils import StaticLayer

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.utils.cache import FilledStaticLayer, GrowingLayer, key_width, keep_path, static_cache


def test_filled_static_layer_returns_and_masks_the_filled_positions_of_one_buffer():
    layer = FilledStaticLayer(max_cache_len=16)
    keys, values = layer.update(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    buffer = layer.keys.data_ptr()
    assert keys.shape[-2] == values.shape[-2] == 5 and layer.get_mask_sizes(3) == (8, 0)
    keys, _ = layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    assert keys.shape[-2] == 8 and keys.data_ptr() == layer.keys.data_ptr() == buffer
    cache = static_cache(1, 16, filled_only=True)
    cache.layers[0] = layer
    keep_path(cache, 5, torch.tensor([0, 2]), torch.tensor(2))  # keep 2 of the 3 new entries
    assert int(layer.cumulative_length) == 7 and key_width(cache, torch.tensor(7) + 2) == 9
    assert key_width(static_cache(1, 16), 9) == 16  # a plain static cache: its capacity, fixed shapes


def test_static_mode_attends_over_filled_positions_on_a_cpu_and_keeps_fixed_shapes_compiled():
    target = tiny_target()
    assistant = ConFuAssistant.from_config(ConFuDraftConfig.for_target(target), target, depth=3, top_k=2,
                                           total_tokens=6)
    widths = []
    hook = target.model.layers[0].self_attn.register_forward_hook(
        lambda module, args, kwargs, out: widths.append(getattr(kwargs.get("attention_mask"), "shape", [0])[-1]),
        with_kwargs=True)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    eager = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    widths.clear()
    static = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant,
                             cache_implementation="static")
    assert torch.equal(eager, static)
    layers = assistant._static["target"].cache.layers
    assert isinstance(layers[0], FilledStaticLayer) and 0 < max(widths) < layers[0].max_cache_len
    hook.remove()
    target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant, **compiled_static())
    assert type(assistant._static["target"].cache.layers[0]) is StaticLayer


def test_growing_layer_keeps_rows_and_positions_and_then_grows_in_place():
    layer = GrowingLayer(reserve=4)
    keys, values = torch.randn(3, 2, 6, 4), torch.randn(3, 2, 6, 4)
    layer.update(keys, values)
    layer.keep(None, -2)  # widened: two zero positions on the left
    assert torch.equal(layer.keys[:, :, 2:], keys) and not layer.keys[:, :, :2].any() and not layer.values[:, :, :2].any()
    layer.keep(torch.tensor([2, 0]), 3)  # rows 2 and 0, the first 3 positions cut
    assert torch.equal(layer.keys, keys[[2, 0], :, 1:]) and torch.equal(layer.values, values[[2, 0], :, 1:])
    buffer = layer.keys.data_ptr()
    new = torch.randn(2, 2, 4, 4)
    out, _ = layer.update(new, new)  # fits the spare room: written in place, no new buffer
    assert out.data_ptr() == buffer and torch.equal(out[:, :, 5:], new) and torch.equal(out[:, :, :5], keys[[2, 0], :, 1:])
