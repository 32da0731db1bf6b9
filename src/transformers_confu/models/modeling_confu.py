"""The ConFu / EAGLE-3 draft head: fused target features, one decoder layer of the target's family,
a reduced-vocabulary LM head.

Shapes: B batch, T tokens, H the target's hidden size, V the target vocabulary, D the draft vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface, AutoConfig, AutoModel, PreTrainedModel
from transformers import initialization as init
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .configuration_confu import ConFuDraftConfig


class MoEEmbedding(nn.Module):
    """A mixture-of-experts embedding: a linear router over a state picks the top-k of n learnable
    expert embeddings and returns their sum weighted by the softmax of the chosen router logits."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"MoE top_k={top_k} must be in [1, num_experts={num_experts}].")
        self.top_k = top_k
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        """(..., H) routing states -> (..., H) embeddings."""
        scores, chosen = self.router(state).topk(self.top_k, dim=-1)
        return (scores.softmax(dim=-1).unsqueeze(-1) * self.experts[chosen]).sum(dim=-2)


class _SharedAndOwnKeys(torch.autograd.Function):
    """CPU training-time-test attention: the shared keys through the fused flash kernel, the own keys
    (B, H, S, T, d: query t sees key t of each of the S blocks) as dot products, merged by log-sum-exp.

    The backward runs the flash kernel's own backward with the merged output and log-sum-exp in place of the
    shared ones, which gives exactly the shared keys' part of the merged softmax's gradient (its correction
    term, the row sum of grad * out, is then that of the merged output), and the own keys' part by hand. The
    (B, H, T, T) scores are never materialised: 2.2x faster than scoring them in eager ops."""

    @staticmethod
    def forward(ctx, query, key, value, own_keys, own_values, mask, scaling):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=mask, scale=scaling)[:2]
        own = (query[:, :, None] * own_keys).float().sum(-1) * scaling  # (B, H, S, T)
        merged = torch.logaddexp(lse, own.logsumexp(dim=2))
        own_probs = (own - merged[:, :, None]).exp()
        out = (lse - merged).exp()[..., None] * out + (own_probs[..., None] * own_values).sum(2)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, own_keys, own_values, mask, out, merged, own_probs)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, own_keys, own_values, mask, out, merged, own_probs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_query, grad_key, grad_value = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, out, merged, 0.0, False, attn_mask=mask, scale=ctx.scaling)
        grad_probs = (grad[:, :, None] * own_values).float().sum(-1)  # (B, H, S, T)
        grad_scores = own_probs * (grad_probs - (grad * out).float().sum(-1)[:, :, None]) * ctx.scaling
        grad_query = grad_query + (grad_scores[..., None] * own_keys).sum(2).to(grad_query.dtype)
        grad_own_keys = (grad_scores[..., None] * query[:, :, None]).to(own_keys.dtype)
        grad_own_values = (own_probs[..., None] * grad[:, :, None]).to(own_values.dtype)
        return grad_query, grad_key, grad_value, grad_own_keys, grad_own_values, None, None


def ttt_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    own_key_blocks: int = 0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The draft's attention: transformers' SDPA, except in a training-time-test step (`own_key_blocks` > 0).

    There the last `own_key_blocks` blocks of T keys are the draft's own earlier steps, each seen only by the
    query at the same position (`ttt.ttt_attention_mask`: identity blocks). They are scored as T dot products
    each, instead of T x T entries of which all but T are masked, and `attention_mask` covers the other keys
    only; on a CPU those go through the fused flash kernel (`_SharedAndOwnKeys`).
    query (B, Hq, T, d), key/value (B, Hkv, N, d), mask (B, 1, T, N - own_key_blocks T) -> (B, T, Hq, d)."""
    if not own_key_blocks:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("The training-time-test attention has no dropout: build the draft with attention_dropout=0.")
    length, groups = query.shape[2], query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    shared = key.shape[2] - own_key_blocks * length
    if attention_mask.shape[-1] != shared:
        raise ValueError(f"With {own_key_blocks} own-key blocks the mask covers the first {shared} keys, "
                         f"not {attention_mask.shape[-1]}.")
    own_keys = key[:, :, shared:].unflatten(2, (own_key_blocks, length))  # (B, H, S, T, d)
    own_values = value[:, :, shared:].unflatten(2, (own_key_blocks, length))
    if query.device.type == "cpu":  # one dtype for the kernel: the projections' (rotary embeddings may upcast q, k)
        dtype = value.dtype
        out = _SharedAndOwnKeys.apply(query.to(dtype), key[:, :, :shared].to(dtype).contiguous(),
                                      value[:, :, :shared].contiguous(), own_keys.to(dtype), own_values,
                                      attention_mask.to(dtype), scaling)
        return out.transpose(1, 2).contiguous(), None
    scores = torch.cat([
        torch.matmul(query, key[:, :, :shared].transpose(2, 3)) * scaling + attention_mask,
        torch.einsum("bhtd,bhstd->bhts", query, own_keys) * scaling,
    ], dim=-1)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs[..., :shared], value[:, :, :shared])
    out = out + torch.einsum("bhts,bhstd->bhtd", probs[..., shared:], own_values)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("confu_ttt", ttt_attention)


def build_family_layer(config: ConFuDraftConfig) -> tuple[nn.Module, nn.Module, type]:
    """Build one decoder layer and the rotary embedding of the target's family.

    The layer's q/k/v projections are widened to take `[embedding; feature]` (2H) as EAGLE-3 does.
    Returns `(layer, rotary_emb, norm_class)`.
    """
    family = AutoConfig.for_model(
        config.target_model_type, **config.layer_config,
        num_hidden_layers=1,
        vocab_size=1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    family._attn_implementation = "sdpa"
    base = AutoModel.from_config(family, attn_implementation="sdpa")
    layer = base.layers[0]
    attn = layer.self_attn
    attn.config._attn_implementation = "confu_ttt"  # SDPA, with the TTT fast path (`ttt_attention`)
    for name in ("q_proj", "k_proj", "v_proj"):
        old: nn.Linear = getattr(attn, name)
        setattr(attn, name, nn.Linear(2 * old.in_features, old.out_features, bias=old.bias is not None))
    return layer, base.rotary_emb, type(base.norm)


class ConFuDraftModel(PreTrainedModel):
    """EAGLE-3 draft head, plus ConFu's future token `[f]` when `config.has_future_entry` (ConFu drafts built
    with `future_entry=False` take f only as a prior on their first level, in the decoding loop).

    ConFu: the target's future vector f (a fused 3H feature read at a `[con]` token) enters the draft
    as one extra entry whose feature is `fc(f)` and whose embedding comes from `future_moe`, routed
    by `fc(f)`. The caller appends it through `forward(..., future=f)` and chooses with the mask which
    queries see it.

    The token embedding is the target's, frozen and not part of this model's weights: attach it
    with `attach_target` (the assistant does this). `d2t` maps draft ids to target ids; `t2d`
    marks the target ids the draft can emit.
    """

    config_class = ConFuDraftConfig
    base_model_prefix = "draft"
    _supports_sdpa = True

    def __init__(self, config: ConFuDraftConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        layer, self.rotary_emb, norm_cls = build_family_layer(config)
        eps = config.layer_config.get("rms_norm_eps", 1e-6)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.input_norm = norm_cls(hidden, eps=eps)
        self.hidden_norm = norm_cls(hidden, eps=eps)
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.norm = norm_cls(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        if config.has_future_entry:
            self.future_moe = MoEEmbedding(hidden, config.future_experts, config.future_top_k)
            self.future_bias = nn.Parameter(torch.tensor(float(config.future_attention_bias)))
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=True)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d, persistent=True)
        self._target_embeddings: list[nn.Module] = []  # a list keeps it out of state_dict
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, MoEEmbedding):
            init.normal_(module.experts, std=getattr(self.config, "initializer_range", None) or 0.02)
        if module is self and self.config.has_future_entry:
            init.constant_(self.future_bias, self.config.future_attention_bias)

    def init_future_from_target(self, target: PreTrainedModel) -> None:
        """Start the `[f]` experts as embeddings of random draft-vocabulary tokens, so that the new `[f]`
        entry looks like a token entry to a draft trained without it (call once, before ConFu training)."""
        table = target.get_input_embeddings().weight
        experts = self.future_moe.experts
        with torch.no_grad():
            experts.copy_(table[self.d2t[torch.randint(0, len(self.d2t), (len(experts),))]].to(experts))

    def init_from_target(self, target: PreTrainedModel, parts: tuple[str, ...] = ("head", "norm")) -> None:
        """Copy what fits from the target before training (after `set_vocab_map`).

        `head`: the LM head rows of the draft vocabulary from the target's output embedding (the draft then
        starts in the target's output space); `norm`: the final norm from the target's; `fc`: the feature
        projection passes the highest feature layer through unchanged (and drops the others); `layer`: the MLP,
        post-attention norm, output projection and the feature half of the q/k/v projections from the
        target's last decoder layer (the embedding half keeps its random init)."""
        unknown = set(parts) - {"head", "norm", "fc", "layer"}
        if unknown:
            raise ValueError(f"Unknown init part(s) {sorted(unknown)}: choose among head, norm, fc, layer.")
        self.config.check_target(target)
        with torch.no_grad():
            if "head" in parts:
                head = target.get_output_embeddings()
                if head.bias is not None or self.lm_head.bias is not None:
                    raise ValueError("init part 'head' needs bias-free output heads.")
                self.lm_head.weight.copy_(head.weight[self.d2t.to(head.weight.device)].to(self.lm_head.weight))
            if "norm" in parts:
                self.norm.load_state_dict(target.base_model.norm.state_dict())
            if "fc" in parts:
                hidden = self.config.hidden_size
                self.fc.weight.zero_()
                self.fc.weight[:, -hidden:] = torch.eye(hidden)
            if "layer" in parts:
                last = target.base_model.layers[-1]
                self.mlp.load_state_dict(last.mlp.state_dict())
                self.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
                self.self_attn.o_proj.load_state_dict(last.self_attn.o_proj.state_dict())
                for name in ("q_proj", "k_proj", "v_proj"):
                    ours, theirs = getattr(self.self_attn, name), getattr(last.self_attn, name)
                    ours.weight[:, theirs.in_features :].copy_(theirs.weight)
                    if theirs.bias is not None:
                        ours.bias.copy_(theirs.bias)

    def attach_target(self, target: PreTrainedModel) -> None:
        """Check `target` against the config and borrow its (frozen) input embedding."""
        self.config.check_target(target)
        self._target_embeddings[:] = [target.get_input_embeddings()]

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Set the draft vocabulary: `draft_to_target[i]` is the target id of draft id `i`."""
        if draft_to_target.numel() != self.config.draft_vocab_size:
            raise ValueError(
                f"Expected {self.config.draft_vocab_size} target ids, got {draft_to_target.numel()}."
            )
        self.d2t.copy_(draft_to_target.to(self.d2t))
        self.t2d.zero_()
        self.t2d[self.d2t] = True

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """The target's embedding of `input_ids` (no gradient)."""
        if not self._target_embeddings:
            raise RuntimeError("No target attached: call `draft.attach_target(target_model)` first.")
        with torch.no_grad():
            return self._target_embeddings[0](input_ids).to(self.fc.weight.dtype)

    def forward(
        self,
        input_ids: torch.LongTensor,
        hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        cache=None,
        future: torch.Tensor | None = None,
        future_keys: slice | None = None,
        own_key_blocks: int = 0,
    ) -> torch.Tensor:
        """One draft step over T positions (and K future entries).

        Args:
            input_ids: (B, T) the NEXT token at each position.
            hidden_states: (B, T, 3H) fused target features, or (B, T, H) the draft's own outputs.
            position_ids: (B, T + K) positions (the future entries' last).
            attention_mask: (B, 1, T + K, past + T + K) additive float mask (0 = attend, dtype min = not).
            cache: optional `DynamicCache` for the draft's keys and values.
            future: optional (B, K, 3H) future vectors (ConFu), appended as K `[f]` entries after the T.
            future_keys: the key columns of `[f]` entries (in the cache or appended now); the learned
                `future_bias` is added to their attention logits.
            own_key_blocks: training-time test: the last this many blocks of T keys (with the new ones) are the
                draft's earlier steps, each query seeing its own position's only; they are scored without the
                T x T products and `attention_mask` covers the other keys only (`ttt_attention`).

        Returns:
            (B, T + K, H) the draft's hidden states: the features of its next step; `logits()` maps them to
            draft-vocabulary logits.
        """
        if hidden_states.shape[-1] != self.config.hidden_size:
            hidden_states = self.fc(hidden_states)
        embeds = self.embed(input_ids)
        if future is not None:
            if not self.config.has_future_entry:
                raise ValueError("This draft has no [f] entry: it was built with contemplate=False or "
                                 "future_entry=False.")
            future = self.fc(future.to(self.fc.weight.dtype))
            hidden_states = torch.cat([hidden_states, future], dim=1)
            embeds = torch.cat([embeds, self.future_moe(future)], dim=1)
        x = torch.cat([self.input_norm(embeds), self.hidden_norm(hidden_states)], dim=-1)
        if future_keys is not None:
            attention_mask = attention_mask.clone()
            attention_mask[..., future_keys] += self.future_bias.to(attention_mask.dtype)
        position_embeddings = self.rotary_emb(x, position_ids=position_ids)
        attn, _ = self.self_attn(x, position_embeddings, attention_mask, cache, own_key_blocks=own_key_blocks)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(…, H) draft hidden states -> (…, D) draft-vocabulary logits (through the final norm unless the config
        says `norm_output=False`)."""
        return self.lm_head(self.norm(hidden_states) if self.config.norm_output else hidden_states)


ConFuDraftConfig.register_for_auto_class()
ConFuDraftModel.register_for_auto_class("AutoModel")
AutoConfig.register("confu_draft", ConFuDraftConfig, exist_ok=True)
AutoModel.register(ConFuDraftConfig, ConFuDraftModel, exist_ok=True)
