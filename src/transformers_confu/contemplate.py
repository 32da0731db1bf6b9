"""ConFu's target-side adapter: the soft prompt and the `[con]` mixture-of-experts embedding.

The target stays frozen and is only prompted. `[con]` tokens appended to a target pass see the soft
prompt, the real prefix and their own node's ancestry; real tokens never see a `[con]` token or the
soft prompt, so the target's logits on real tokens are unchanged. The soft prompt reads only itself,
so its keys and values are a constant of the trained adapter (`soft_kv`, computed once per target).

Cache layout of a target pass with the adapter: `[soft prompt S][real tokens][this pass's tokens]`;
position ids of real tokens start at 0 as without it (the soft prompt sits at positions 0..S-1 too).

Saved in its own folder (`contemplate_adapter/` beside the draft) as `config.json` + `model.safetensors`
through `huggingface_hub.PyTorchModelHubMixin`; the target's weights are never saved.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from .cache import cache_kwargs
from .modeling_confu import MoEEmbedding
from .tree import to_additive

ADAPTER_FOLDER = "contemplate_adapter"


class ContemplateAdapter(nn.Module, PyTorchModelHubMixin):
    """Learnable soft prompt (seen only by `[con]` tokens) and the `[con]` MoE embedding.

    Args:
        hidden_size: the target's hidden size H.
        num_soft_tokens: length S of the soft prompt (input embeddings run through the target).
        num_experts, top_k: the `[con]` embedding mixes the top-k of `num_experts` expert embeddings,
            routed by the target's last-layer state of the last accepted token.
        target_model_type, target_num_layers: the target it was trained with (checked on use).
    """

    def __init__(self, hidden_size: int, num_soft_tokens: int = 16, num_experts: int = 8, top_k: int = 2,
                 target_model_type: str = "llama", target_num_layers: int = 4) -> None:
        super().__init__()
        if num_soft_tokens < 1:
            raise ValueError(f"num_soft_tokens={num_soft_tokens} must be >= 1.")
        self.hidden_size, self.num_soft_tokens = hidden_size, num_soft_tokens
        self.target_model_type, self.target_num_layers = target_model_type, target_num_layers
        self.soft_prompt = nn.Parameter(torch.zeros(num_soft_tokens, hidden_size))
        self.con_moe = MoEEmbedding(hidden_size, num_experts, top_k)
        self._constant: tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    @classmethod
    def for_target(cls, target: PreTrainedModel, **kwargs) -> "ContemplateAdapter":
        """A fresh adapter for `target`: soft prompt and experts start as embeddings of random tokens."""
        config = target.config
        adapter = cls(config.hidden_size, target_model_type=config.model_type,
                      target_num_layers=config.num_hidden_layers, **kwargs)
        table = target.get_input_embeddings().weight.detach().float()
        with torch.no_grad():
            adapter.soft_prompt.copy_(table[torch.randint(0, table.shape[0], (adapter.num_soft_tokens,))])
            experts = adapter.con_moe.experts
            experts.copy_(table[torch.randint(0, table.shape[0], (experts.shape[0],))])
            nn.init.normal_(adapter.con_moe.router.weight, std=0.02)
        return adapter

    def check_target(self, target: PreTrainedModel) -> None:
        """Raise a `ValueError` if `target` is not the kind of model this adapter was trained for."""
        config = target.config
        got = (config.model_type, config.hidden_size, config.num_hidden_layers)
        wanted = (self.target_model_type, self.hidden_size, self.target_num_layers)
        if got != wanted:
            raise ValueError(f"This contemplate adapter was trained for a {wanted} (model type, hidden size, "
                             f"layers) target, got {got}: load the adapter saved with this target's draft.")

    def soft_kv(self, target: PreTrainedModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per target layer, the soft prompt's (1, kv_heads, S, head_dim) keys and values (with gradient)."""
        cache = DynamicCache(config=target.config)
        embeds = self.soft_prompt.to(target.dtype)[None]
        positions = torch.arange(self.num_soft_tokens, device=embeds.device)[None]
        target.base_model(inputs_embeds=embeds, position_ids=positions, use_cache=True,
                          **cache_kwargs(target.base_model, cache))
        return [(layer.keys, layer.values) for layer in cache.layers]

    def constant_soft_kv(self, target: PreTrainedModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`soft_kv` for inference, computed once per (target, dtype, device) and kept."""
        key = (id(target), target.dtype, target.device, self.soft_prompt._version)
        if self._constant is None or self._constant[0] != key:
            with torch.no_grad():
                self._constant = (key, self.soft_kv(target))
        return self._constant[1]

    def prefilled_cache(self, target: PreTrainedModel) -> DynamicCache:
        """A `DynamicCache` holding the soft prompt's keys and values (copies of the constant)."""
        cache = DynamicCache(config=target.config)
        for index, (keys, values) in enumerate(self.constant_soft_kv(target)):
            cache.update(keys.clone(), values.clone(), index)
        return cache

    def con_embedding(self, features: torch.Tensor) -> torch.Tensor:
        """(..., 3H) fused target features of the last accepted token -> (..., H) `[con]` input embeddings,
        routed by the highest of the three feature layers."""
        return self.con_moe(features[..., -self.hidden_size:].to(self.soft_prompt.dtype))

    def save_to(self, draft_folder: str | os.PathLike) -> None:
        """Save into `<draft_folder>/contemplate_adapter/`."""
        self.save_pretrained(Path(draft_folder) / ADAPTER_FOLDER)


def soft_prompt_mask(visible: torch.Tensor, soft: int, soft_visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(Q, K) or (B, Q, K) bool `visible` over the real keys -> additive (B, 1, Q, soft + K) mask whose first
    `soft` columns (the soft prompt) are visible to the rows where `soft_visible` (Q,) or (B, Q) is true."""
    if visible.ndim == 2:
        visible, soft_visible = visible[None], soft_visible[None]
    soft_cols = soft_visible[..., None].expand(*soft_visible.shape, soft)
    return to_additive(torch.cat([soft_cols, visible], dim=-1), dtype)[:, None]
