"""ConFu training: anchor token sampling, the `[con]` target pass, and future-prediction replication.

Per sequence, K anchor positions a are drawn. A second, K-token target pass over the cached real keys
and values puts a `[con]` after each anchor (position a + 1; it sees the soft prompt, the real tokens
s <= a and itself) and reads the future vector f_a there, as the fused 3H feature. Only this pass
carries gradients into the soft prompt and the `[con]` MoE through the frozen target, so the cost is
K tokens of backward, not T. Replication: draft position t sees the f of the latest anchor a <= t if
t - a < window, so the draft learns that nearby tokens share a future and copes with a stale f.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from ..models.contemplate import ContemplateAdapter, soft_prompt_mask
from ..utils.cache import cache_kwargs
from .ttt import Future, draft_vocab_logits, ttt_valid_positions


def sample_anchors(attention_mask: torch.Tensor, loss_mask: torch.Tensor, count: int,
                   generator: torch.Generator | None = None) -> torch.LongTensor:
    """(B, K) sorted anchor positions, K = `count`, drawn without replacement per row.

    Anchors are drawn among trained positions (the draft predicts an assistant token there) and never at
    position 0 (routing reads the state before the anchor); a row with too few of those falls back to
    other positions (padding last), which `future_visibility` ignores.
    """
    trained = ttt_valid_positions(attention_mask, loss_mask, 0).float()
    weights = trained + 1e-4 * attention_mask.float() + 1e-8
    weights[:, 0] = 0
    count = min(count, attention_mask.shape[1] - 1)
    anchors = torch.multinomial(weights, count, replacement=False, generator=generator)
    return anchors.sort(dim=1).values


def future_visibility(anchors: torch.LongTensor, attention_mask: torch.Tensor, window: int) -> torch.Tensor:
    """(B, T, K) bool: draft position t sees the f of anchor k iff k is the latest real anchor <= t and
    t - a_k < window."""
    length = attention_mask.shape[1]
    t = torch.arange(length, device=anchors.device)
    real = attention_mask.gather(1, anchors).bool()  # (B, K)
    a = torch.where(real, anchors, torch.full_like(anchors, length + window))  # padding anchors never match
    ordered, order = a.sort(dim=1)
    latest = torch.searchsorted(ordered, t.expand(len(a), -1).contiguous(), right=True) - 1
    chosen = order.gather(1, latest.clamp_min(0))  # (B, T) index k of the latest anchor
    gap = t[None] - a.gather(1, chosen)
    ok = (latest >= 0) & (gap < window) & (gap >= 0)
    visible = torch.zeros(*anchors.shape[:1], length, anchors.shape[1], dtype=torch.bool, device=anchors.device)
    return visible.scatter_(2, chosen[..., None], ok[..., None])


def future_vectors(
    target: PreTrainedModel,
    adapter: ContemplateAdapter,
    real_cache: DynamicCache,
    features: torch.Tensor,
    attention_mask: torch.Tensor,
    anchors: torch.LongTensor,
    feature_layers: list[int],
    route_lag: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `[con]` pass: (B, K, 3H) future vectors at the anchors and (B, K, H) the `[con]` tokens' final
    (normed) hidden states, with gradients into `adapter`.

    Args:
        real_cache: the real tokens' keys and values from the no-grad target pass.
        features: (B, T, 3H) the fused target features of that pass; the `[con]` after anchor a is
            routed by the features at a - 1 - lag (`route_lag` (B, K), default 0). At inference a tree's
            `[con]` tokens are all routed by the last accepted token, which is d positions before the anchor
            - 1 of a node at depth d: a lag of d.
    """
    batch, length = attention_mask.shape
    soft = adapter.num_soft_tokens
    cache = DynamicCache(config=target.config)
    for index, ((soft_k, soft_v), layer) in enumerate(zip(adapter.soft_kv(target), real_cache.layers)):
        cache.update(soft_k.expand(batch, -1, -1, -1), soft_v.expand(batch, -1, -1, -1), index)
        cache.update(layer.keys, layer.values, index)
    routed = anchors - 1 if route_lag is None else (anchors - 1 - route_lag).clamp_min(0)
    states = features.gather(1, routed[..., None].expand(-1, -1, features.shape[-1]))
    embeds = adapter.con_embedding(states).to(target.dtype)
    t = torch.arange(length, device=anchors.device)
    sees_real = (t[None, None] <= anchors[..., None]) & attention_mask.bool()[:, None]  # (B, K, T)
    own = torch.eye(anchors.shape[1], dtype=torch.bool, device=anchors.device).expand(batch, -1, -1)
    mask = soft_prompt_mask(torch.cat([sees_real, own], dim=-1), soft, torch.ones_like(anchors, dtype=torch.bool),
                            target.dtype)
    out = target.base_model(inputs_embeds=embeds, position_ids=anchors + 1, attention_mask=mask, use_cache=True,
                            output_hidden_states=True, **cache_kwargs(target.base_model, cache))
    return torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1), out.last_hidden_state


def contemplate_future(
    target: PreTrainedModel,
    adapter: ContemplateAdapter,
    real_cache: DynamicCache,
    features: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    feature_layers: list[int],
    anchor_ratio: float,
    window: int,
    max_route_lag: int = 0,
) -> Future:
    """Sample anchors (`anchor_ratio` of the positions, at least 1), run the `[con]` pass, replicate.
    `max_route_lag` > 0 routes each `[con]` by a state up to that many tokens older (uniform), as a tree's
    deeper `[con]` tokens are routed at inference."""
    count = max(1, round(anchor_ratio * attention_mask.shape[1]))
    anchors = sample_anchors(attention_mask, loss_mask, count)
    lag = torch.randint(0, max_route_lag + 1, anchors.shape, device=anchors.device) if max_route_lag else None
    vectors, hidden = future_vectors(target, adapter, real_cache, features, attention_mask, anchors, feature_layers,
                                     lag)
    return Future(vectors, anchors, future_visibility(anchors, attention_mask, window), hidden)


def future_token_loss(target: PreTrainedModel, future: Future, target_ids: torch.LongTensor,
                      attention_mask: torch.Tensor, d2t: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The auxiliary "contemplate" loss: the `[con]` after anchor a, read through the target's own output head
    (restricted to the draft vocabulary `d2t`), should predict the target's next token after a + 1, i.e. the
    token two ahead of the anchor, which the draft's next round must guess. Gradients reach the soft prompt
    and the `[con]` MoE only (the target is frozen), so f learns to carry that future token.

    Returns (mean cross-entropy, accuracy, count) over the anchors whose a + 1 is a real position and whose
    label is in the draft vocabulary (a zero loss with count 0 when there is none).
    """
    anchors, length = future.anchors, attention_mask.shape[1]
    after = (anchors + 1).clamp(max=length - 1)
    labels = target_ids.gather(1, after)
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long, device=d2t.device)
    to_draft[d2t] = torch.arange(len(d2t), device=d2t.device)
    labels = to_draft[labels]
    valid = (anchors + 1 < length) & attention_mask.gather(1, after).bool() & (labels >= 0)
    logits = draft_vocab_logits(target, future.hidden[valid], d2t).float()
    count = int(valid.sum())
    if count == 0:
        return future.hidden.sum() * 0, logits.new_zeros(()), 0
    labels = labels[valid]
    return F.cross_entropy(logits, labels), (logits.argmax(-1) == labels).float().mean(), count
