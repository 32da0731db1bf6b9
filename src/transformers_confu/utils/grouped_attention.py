"""CPU attention for tree passes: grouped-query heads stay grouped under a mask.

transformers' SDPA attention copies every key and value head `num_key_value_groups` times (`repeat_kv`) for a
masked call with more than one query (the fused CUDA and NPU kernels fall back to the math kernel on grouped
heads with a mask). A tree verify pass is such a call, so on a CPU each pass copies the whole cache, in every
layer (3x for SmolLM2-135M's 9 query heads on 3 key/value heads). PyTorch's CPU flash kernel takes the mask and
the grouped heads together (`enable_gqa=True`), with the same results bit for bit and 6% less target time per
pass on the dev set (`results/grouped_attention_dev.md`).

`grouped_query_attention(model)` runs the model with `grouped_sdpa_attention` inside a block, where it runs
transformers' SDPA on a CPU (else it leaves the model as it is); `target.generate(assistant_model=...)` runs the
speculative loops inside it, so the user's model keeps its attention outside those calls. The draft keeps
transformers' SDPA: its modeling file is saved beside its weights for `trust_remote_code` loading and imports
nothing from this package.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["GROUPED_SDPA", "grouped_query_attention", "grouped_sdpa_attention"]

GROUPED_SDPA = "confu_grouped_sdpa"


def grouped_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except a masked multi-token query on a CPU with grouped key/value heads,
    which attends with the heads grouped in the kernel instead of repeated. query (B, Hq, T, d), key/value
    (B, Hkv, N, d) -> (B, T, Hq, d)."""
    if (query.device.type != "cpu" or query.shape[2] == 1 or attention_mask is None
            or query.shape[1] == key.shape[1] or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


@contextmanager
def grouped_query_attention(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block, `model` attends with `grouped_sdpa_attention` if it runs transformers' SDPA on a CPU;
    its attention implementation is restored after."""
    swap = model.config._attn_implementation == "sdpa" and model.device.type == "cpu"
    if swap:
        model.set_attn_implementation(GROUPED_SDPA)
    try:
        yield
    finally:
        if swap:
            model.set_attn_implementation("sdpa")
