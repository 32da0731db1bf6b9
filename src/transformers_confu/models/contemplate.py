"""ConFu's target-side adapter: the soft prompt and the `[con]` mixture-of-experts embedding.

The target stays frozen and is only prompted. `[con]` tokens appended to a target pass see the soft
prompt, the real prefix and their own node's ancestry; real tokens never see a `[con]` token or the
soft prompt, so the target's logits on real tokens are unchanged. The soft prompt reads only itself,
so its keys and values are a constant of the trained adapter (`soft_kv`, computed once per target).

Cache layout of a target pass with the adapter: `[soft prompt S][real tokens][this pass's tokens]`;
position ids of real tokens start at 0 as without it (the soft prompt sits at positions 0..S-1 too).

The soft prompt is peft's prompt-tuning `PromptEmbedding` (initialised by peft from the embeddings of a text,
`prompt_tuning_init="TEXT"`, or of random vocabulary tokens) described by a `PromptTuningConfig`. peft's
`PeftModel` alone cannot run this adapter: its prompt tuning prepends the virtual tokens to every position's
context, so the real tokens would see them and the target's outputs would change, while ConFu's mask shows
the soft prompt to `[con]` tokens only (and a `[con]` token, fed by the MoE, is not a peft concept either).

Saved in its own folder (`contemplate_adapter/` beside the draft): `config.json` + `model.safetensors` (the
soft prompt and the MoE, once each) through `huggingface_hub.PyTorchModelHubMixin`, and peft's
`adapter_config.json` (readable with `peft.PeftConfig.from_pretrained`, with `base_model_name_or_path`).
There is deliberately no `adapter_model.safetensors`, so `PeftModel.from_pretrained` fails on the folder
(no adapter weights) instead of running it as ordinary prompt tuning. Folders saved before peft (no `adapter_config.json`, the
soft prompt under the key `soft_prompt`) still load. The target's weights are never saved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import PyTorchModelHubMixin
from peft import PromptEmbedding, PromptTuningConfig
from peft.utils import CONFIG_NAME as PEFT_CONFIG
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ..utils.cache import cache_kwargs
from ..utils.masks import to_additive
from .modeling_confu import MoEEmbedding

ADAPTER_FOLDER = "contemplate_adapter"


class ContemplateAdapter(nn.Module, PyTorchModelHubMixin):
    """Learnable soft prompt (seen only by `[con]` tokens) and the `[con]` MoE embedding.

    Args:
        hidden_size: the target's hidden size H.
        num_soft_tokens: length S of the soft prompt (input embeddings run through the target).
        num_experts, top_k: the `[con]` embedding mixes the top-k of `num_experts` expert embeddings,
            routed by the target's last-layer state of the last accepted token.
        target_model_type, target_num_layers: the target it was trained with (checked on use).

    `peft_config` is the soft prompt's `PromptTuningConfig` (saved as `adapter_config.json`) and `prompt` its
    peft `PromptEmbedding`; `soft_prompt` is the (S, H) embedding weight.
    """

    def __init__(self, hidden_size: int, num_soft_tokens: int = 16, num_experts: int = 8, top_k: int = 2,
                 target_model_type: str = "llama", target_num_layers: int = 4) -> None:
        super().__init__()
        if num_soft_tokens < 1:
            raise ValueError(f"num_soft_tokens={num_soft_tokens} must be >= 1.")
        self.hidden_size, self.num_soft_tokens = hidden_size, num_soft_tokens
        self.target_model_type, self.target_num_layers = target_model_type, target_num_layers
        self.peft_config = self._prompt_config()
        with torch.random.fork_rng(devices=[]):  # a placeholder (filled by for_target or loading): keep the
            self.prompt = PromptEmbedding(self.peft_config, None)  # caller's random stream as it was
        self.con_moe = MoEEmbedding(hidden_size, num_experts, top_k)
        self._constant: tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self.register_load_state_dict_pre_hook(_rename_pre_peft_keys)

    @property
    def soft_prompt(self) -> nn.Parameter:
        """The (S, H) soft prompt: the weight of peft's `PromptEmbedding`."""
        return self.prompt.embedding.weight

    def _prompt_config(self, **fields: Any) -> PromptTuningConfig:
        return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=self.num_soft_tokens,
                                  token_dim=self.hidden_size, num_layers=self.target_num_layers,
                                  num_transformer_submodules=1, **{"inference_mode": True} | fields)

    @classmethod
    def for_target(cls, target: PreTrainedModel, init_text: str | None = None,
                   tokenizer_name_or_path: str | None = None, base_model_name_or_path: str | None = None,
                   **kwargs: Any) -> ContemplateAdapter:
        """A fresh adapter for `target`, initialised by peft's `PromptEmbedding`.

        The soft prompt starts as the target's embeddings of `init_text`'s tokens (peft's `TEXT` init, the
        tokens repeated or cut to S; tokenized with `tokenizer_name_or_path`, default the target's path), or
        without a text of random vocabulary tokens (`SAMPLE_VOCAB`); the experts as embeddings of random
        tokens. `base_model_name_or_path` (default the target's `name_or_path`) goes into `adapter_config.json`.
        """
        config = target.config
        adapter = cls(config.hidden_size, target_model_type=config.model_type,
                      target_num_layers=config.num_hidden_layers, **kwargs)
        name = base_model_name_or_path or config.name_or_path or None
        init = dict(prompt_tuning_init="SAMPLE_VOCAB") if init_text is None else dict(
            prompt_tuning_init="TEXT", prompt_tuning_init_text=init_text,
            tokenizer_name_or_path=tokenizer_name_or_path or name)
        prompt_config = adapter._prompt_config(base_model_name_or_path=name, inference_mode=False,
                                               num_attention_heads=config.num_attention_heads, **init)
        embeddings, experts = target.get_input_embeddings(), adapter.con_moe.experts
        adapter.prompt = PromptEmbedding(prompt_config, embeddings).to(experts.device)
        prompt_config.inference_mode = True  # as saved: loading it must not initialise the prompt again
        adapter.peft_config = prompt_config
        table = embeddings.weight.detach().float()
        with torch.no_grad():
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

    def prefilled_cache(self, target: PreTrainedModel, cache=None):
        """`cache` (default a new `DynamicCache`; empty) holding the soft prompt's keys and values (copies of
        the constant)."""
        cache = DynamicCache(config=target.config) if cache is None else cache
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

    def _save_pretrained(self, save_directory: Path) -> None:
        """The mixin's `model.safetensors` (soft prompt and MoE), and peft's `adapter_config.json` beside it."""
        super()._save_pretrained(save_directory)
        self.peft_config.save_pretrained(str(save_directory))

    @classmethod
    def _from_pretrained(cls, *, model_id: str, **kwargs: Any) -> ContemplateAdapter:
        """The mixin's loading (strict: both parts must be in the file), then peft's `adapter_config.json` if the
        folder has one (folders saved before peft do not)."""
        adapter = super()._from_pretrained(model_id=model_id, **kwargs | {"strict": True})
        if (Path(model_id) / PEFT_CONFIG).is_file():
            config = PromptTuningConfig.from_pretrained(model_id)
            if (config.num_virtual_tokens, config.token_dim) != (adapter.num_soft_tokens, adapter.hidden_size):
                raise ValueError(f"{Path(model_id) / PEFT_CONFIG} describes a soft prompt of {config.num_virtual_tokens}"
                                 f" x {config.token_dim}, config.json one of {adapter.num_soft_tokens} x "
                                 f"{adapter.hidden_size}: the folder mixes two adapters; save it again.")
            adapter.peft_config = config
        return adapter


def _rename_pre_peft_keys(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """Adapters saved before peft held the soft prompt as `soft_prompt`: load it into peft's embedding."""
    old = prefix + "soft_prompt"
    if old in state_dict:
        state_dict[prefix + "prompt.embedding.weight"] = state_dict.pop(old)


def soft_prompt_mask(visible: torch.Tensor, soft: int, soft_visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(Q, K) or (B, Q, K) bool `visible` over the real keys -> additive (B, 1, Q, soft + K) mask whose first
    `soft` columns (the soft prompt) are visible to the rows where `soft_visible` (Q,) or (B, Q) is true."""
    if visible.ndim == 2:
        visible, soft_visible = visible[None], soft_visible[None]
    soft_cols = soft_visible[..., None].expand(*soft_visible.shape, soft)
    return to_additive(torch.cat([soft_cols, visible], dim=-1), dtype)[:, None]
