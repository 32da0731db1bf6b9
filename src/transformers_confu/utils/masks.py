"""Attention masks: boolean visibility to the additive float masks attention layers take."""

import torch


def to_additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = may attend) -> additive float mask of the same shape: 0, or `dtype`'s minimum."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
