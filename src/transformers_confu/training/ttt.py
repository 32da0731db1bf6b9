"""EAGLE-3 training-time test (TTT): the draft unrolled over its own outputs, as pure functions.

Shapes: B batch, T tokens, H the target's hidden size, D the draft vocabulary, k the number of TTT steps.

Step i (0 <= i < k) runs the draft once over all T positions. Position t gets the token x_{t+1+i},
position id t+i, and as feature the fused target feature F_t (step 0) or its own step i-1 output
(step i > 0). Its output predicts x_{t+2+i}; the teacher is the target's distribution at t+1+i.

Attention at step i (keys are appended to one `DynamicCache`, so the key axis is (i+1)T long).
Query t sees the step-0 keys of the real positions s <= t, then only itself in every later block:

    keys:     step 0 (s = 0..T-1)   step 1      ...   step i
    query t:  [ 1 1 1 0 0 0 ]      [ 0 0 1 0 0 0 ]    [ 0 0 1 0 0 0 ]     (here t = 2)

This is what the draft sees at inference, where the token drafted at depth i after position t
attends to the real prefix and to its own ancestors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ..utils.cache import cache_kwargs
from ..utils.greedy import greedy_ids
from ..utils.masks import to_additive


class Future(NamedTuple):
    """ConFu's future vectors for a batch: `vectors` (B, K, 3H) read at the `[con]` after each anchor,
    `anchors` (B, K) the anchor positions, `visible` (B, T, K) which draft positions see which vector;
    `hidden` (B, K, H) the `[con]` tokens' final (normed) hidden states, if kept."""

    vectors: torch.Tensor
    anchors: torch.LongTensor
    visible: torch.Tensor
    hidden: torch.Tensor | None = None


def target_hidden(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    feature_layers: list[int],
    cache: DynamicCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One frozen target forward: `(features, last_hidden)`, (B, T, 3H) the concatenated hidden states of
    `feature_layers` (indices into the `hidden_states` tuple) and (B, T, H) the final (normed) hidden state,
    from which `teacher_logits` and `target_argmax` read the target's distribution. `cache`: a
    `DynamicCache` to fill with the real tokens' keys and values (ConFu's `[con]` pass reads it). Computed in
    the target's own dtype also under mixed precision: the features the draft will see when decoding (unless the
    target was loaded in another dtype than it decodes in, as `confu-train --target-dtype bfloat16` does)."""
    with torch.no_grad(), torch.autocast(input_ids.device.type, enabled=False):
        kwargs = {} if cache is None else cache_kwargs(target.base_model, cache)
        out = target.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                                use_cache=cache is not None, **kwargs)
        features = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1)
    return features, out.last_hidden_state


def draft_vocab_logits(target: PreTrainedModel, hidden: torch.Tensor, d2t: torch.LongTensor) -> torch.Tensor:
    """(..., H) final hidden states -> (..., D) the target's logits restricted to the draft vocabulary `d2t`
    (equal to the full logits[..., d2t], without materialising the full-vocabulary tensor), differentiable in
    `hidden`. The output head must be a plain linear map (Llama, Qwen2, ...)."""
    head: nn.Linear = target.get_output_embeddings()
    bias = None if head.bias is None else head.bias[d2t]
    return F.linear(hidden.to(head.weight.dtype), head.weight[d2t], bias)


def teacher_logits(target: PreTrainedModel, last_hidden: torch.Tensor, d2t: torch.LongTensor) -> torch.Tensor:
    """`draft_vocab_logits` without gradients: the teacher distribution of the TTT loss, in the target's own
    dtype also under mixed precision (autocast would round a float32 target's soft labels to bfloat16)."""
    with torch.no_grad(), torch.autocast(last_hidden.device.type, enabled=False):
        return draft_vocab_logits(target, last_hidden, d2t)


def target_argmax(target: PreTrainedModel, last_hidden: torch.Tensor, chunk: int = 4096) -> torch.LongTensor:
    """(B, T, H) final hidden states -> (B, T) the target's greedy token over its FULL vocabulary (in the
    target's dtype also under mixed precision)."""
    head: nn.Linear = target.get_output_embeddings()
    flat = last_hidden.reshape(-1, last_hidden.shape[-1]).to(head.weight.dtype)
    with torch.no_grad(), torch.autocast(last_hidden.device.type, enabled=False):
        ids = [greedy_ids(head(flat[i : i + chunk])) for i in range(0, len(flat), chunk)]
    return torch.cat(ids).reshape(last_hidden.shape[:-1]) if ids else flat.new_zeros(last_hidden.shape[:-1], dtype=torch.long)


def target_features_and_logits(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    feature_layers: list[int],
    d2t: torch.LongTensor,
    cache: DynamicCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_hidden` then `teacher_logits`: (B, T, 3H) fused features and (B, T, D) draft-vocabulary logits."""
    features, last_hidden = target_hidden(target, input_ids, attention_mask, feature_layers, cache)
    return features, teacher_logits(target, last_hidden, d2t)


def shift_left(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """(B, T, ...) -> (B, T, ...) holding `x[:, t + n]` at position t, and `fill` past the end."""
    tail = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], tail], dim=1)


def ttt_attention_mask(
    attention_mask: torch.Tensor, step: int, dtype: torch.dtype, future_visible: torch.Tensor | None = None
) -> torch.Tensor:
    """The additive mask of TTT step `step`: (B, T) padding mask -> (B, 1, T, (step+1)T).

    0 where the query may attend, `torch.finfo(dtype).min` elsewhere (see the module docstring).
    A query always sees its own step-0 key, so no row is empty (padding queries included).

    ConFu: with `future_visible` (B, T, K), K future entries follow the step-0 keys (K more columns, seen
    by query t where `future_visible[:, t]`); at step 0 they are also K more queries, each seeing itself.
    """
    batch, length = attention_mask.shape
    eye = torch.eye(length, dtype=torch.bool, device=attention_mask.device)
    causal = torch.ones_like(eye).tril()
    prefix = (causal & attention_mask.bool()[:, None, :]) | eye
    future = [] if future_visible is None else [future_visible.bool()]
    allowed = torch.cat([prefix, *future, eye.repeat(1, step).expand(batch, -1, -1)], dim=-1)
    if future and step == 0:
        k = future_visible.shape[-1]
        own = torch.eye(k, dtype=torch.bool, device=eye.device).expand(batch, k, k)
        future_rows = torch.cat([own.new_zeros(batch, k, length), own], dim=-1)
        allowed = torch.cat([allowed, future_rows], dim=1)
    return to_additive(allowed, dtype)[:, None]


def ttt_hidden_states(
    draft: nn.Module,
    features: torch.Tensor,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    steps: int,
    future: Future | None = None,
) -> list[torch.Tensor]:
    """Unroll the draft for `steps` TTT steps; returns one (B, T, H) hidden state per step.

    `draft` is a `ConFuDraftModel` or a wrapper of it (DDP) whose forward is the draft's. `future`
    (ConFu) adds the anchors' `[f]` entries to step 0, seen where `future.visible` says.
    """
    batch, length = input_ids.shape
    dtype = _unwrap(draft).fc.weight.dtype
    positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    cache = DynamicCache()
    hidden = features.to(dtype)
    visible = None if future is None else future.visible
    keys = None if future is None else slice(length, length + future.anchors.shape[1])
    # step 0's mask; later steps read its first T rows over the shared keys, and their own earlier keys
    # (the identity blocks of `ttt_attention_mask`) are scored apart (`own_key_blocks`, `ttt_attention`)
    mask = ttt_attention_mask(attention_mask, 0, dtype, visible)
    outputs = []
    for step in range(steps):
        if step == 0 and future is not None:
            step_positions = torch.cat([positions, future.anchors], dim=1)
            hidden = draft(shift_left(input_ids, 1), hidden, step_positions, mask, cache, future=future.vectors,
                           future_keys=keys)
            hidden = hidden[:, :length]
        else:
            hidden = draft(shift_left(input_ids, 1 + step), hidden, positions + step, mask[:, :, :length], cache,
                           future_keys=keys, own_key_blocks=step)
        outputs.append(hidden)
    return outputs


def ttt_valid_positions(attention_mask: torch.Tensor, loss_mask: torch.Tensor, step: int) -> torch.Tensor:
    """(B, T) bool: positions t trained at `step`.

    The teacher position t+1+step must be a real token and the predicted token x_{t+2+step} a real
    token with `loss_mask` 1 (an assistant token).
    """
    teacher_is_real = shift_left(attention_mask, 1 + step)
    target_is_trained = shift_left(attention_mask * loss_mask, 2 + step)
    return (teacher_is_real * target_is_trained).bool()


def copy_positions(input_ids: torch.LongTensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: positions s whose token copies an earlier bigram's continuation: the real tokens
    x_{s-2} x_{s-1} occurred together earlier in the row, and the token after their most recent earlier
    occurrence is x_s. One stable sort of the rows' bigram keys, no loop. The draft's weakest class of tokens
    (results/draft_misses_by_source.md): `examples/experiments/dev_accuracy.py --by-source` scores it."""
    batch, length = input_ids.shape
    copies = torch.zeros(batch, length, dtype=torch.bool, device=input_ids.device)
    if length < 4:
        return copies
    ids, real = input_ids.long(), attention_mask.bool()
    vocab = int(ids.max()) + 1
    rows = torch.arange(batch, device=ids.device)[:, None]
    key = (rows * vocab + ids[:, :-2]) * vocab + ids[:, 1:-1]  # (B, T-2): the bigram before s = 2 .. T-1
    unique = -1 - torch.arange(key.numel(), device=ids.device).view_as(key)  # a bigram with padding matches nothing
    key = torch.where(real[:, :-2] & real[:, 1:-1], key, unique)
    order = torch.sort(key.flatten(), stable=True).indices  # equal bigrams in position order
    same = key.flatten()[order[1:]] == key.flatten()[order[:-1]]
    later, earlier = order[1:][same], order[:-1][same]  # flat (row, s - 2) of a bigram and of its last occurrence
    row, s, s_before = later // (length - 2), later % (length - 2) + 2, earlier % (length - 2) + 2
    copies[row, s] = (ids[row, s] == ids[row, s_before]) & real[row, s]
    return copies


class Teacher(NamedTuple):
    """The teacher of every TTT step, computed once: `probs` (N, D) the fp32 softmax of the target's
    draft-vocabulary logits and `ids` (N,) their greedy token, at the N positions some step reads; `slot`
    (B, T) the row of position (b, s) in them (-1 where no step reads it)."""

    probs: torch.Tensor
    ids: torch.LongTensor
    slot: torch.LongTensor


def ttt_teacher(target_logits: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> Teacher:
    """(B, T, D) logits -> `Teacher` at the positions s with a real token whose next token is trained: step i
    reads s = t + 1 + i for each of its positions t (`ttt_valid_positions`), so every step shares one softmax
    instead of taking its own."""
    read = (shift_left(attention_mask * loss_mask, 1) * attention_mask).bool()
    slot = torch.full(read.shape, -1, dtype=torch.long, device=read.device)
    slot[read] = torch.arange(int(read.sum()), device=read.device)
    logits = target_logits[read]
    return Teacher(logits.float().softmax(dim=-1), greedy_ids(logits), slot)


def ttt_loss(
    draft: nn.Module,
    features: torch.Tensor,
    target_logits: torch.Tensor,
    input_ids: torch.LongTensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    steps: int = 4,
    decay: float = 0.8,
    future: Future | None = None,
    target_ids: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The EAGLE-3 TTT loss: sum over steps i of decay**i * mean soft cross-entropy at step i.

    Args:
        draft: a `ConFuDraftModel` (attached to the target), or a DDP wrapper of it.
        features: (B, T, 3H) fused target features.
        target_logits: (B, T, D) the target's logits over the draft vocabulary.
        input_ids, loss_mask, attention_mask: (B, T), right-padded; loss_mask 1 on assistant tokens.
        steps: number of unrolled steps k.
        decay: weight of step i is decay**i.
        future: ConFu's future vectors at the anchors and which positions see them (None: EAGLE-3).
        target_ids: (B, T) the target's greedy token over its full vocabulary (`target_argmax`), for `full_acc_i`.

    Returns:
        `(loss, metrics)`; metrics hold detached scalars per step i: `loss_i` (unweighted mean
        cross-entropy), `acc_i` (draft argmax == teacher argmax within the draft vocabulary; 0 when nothing
        is trained), `count_i` (number of trained positions) and, with `target_ids`, `full_acc_i` (the draft's
        token == the target's greedy token over the full vocabulary: what greedy acceptance sees).
    """
    head = _unwrap(draft)
    hidden_states = ttt_hidden_states(draft, features, input_ids, attention_mask, steps, future)
    teacher = ttt_teacher(target_logits, loss_mask, attention_mask)
    loss = torch.zeros((), device=features.device)
    metrics: dict[str, torch.Tensor] = {}
    for step, hidden in enumerate(hidden_states):
        rows, cols = ttt_valid_positions(attention_mask, loss_mask, step).nonzero(as_tuple=True)
        logits = head.logits(hidden[rows, cols]).float()  # the LM head only where there is a loss
        slot = teacher.slot[rows, cols + 1 + step]
        count = max(len(rows), 1)
        step_loss = F.cross_entropy(logits, teacher.probs[slot], reduction="sum") / count  # soft labels
        loss = loss + decay**step * step_loss
        drafted = greedy_ids(logits.detach())
        correct = (drafted == teacher.ids[slot]).sum()
        metrics[f"loss_{step}"] = step_loss.detach()
        metrics[f"acc_{step}"] = correct.float() / count
        metrics[f"count_{step}"] = torch.tensor(len(rows), device=features.device)
        if target_ids is not None:
            full = head.d2t[drafted] == target_ids[rows, cols + 1 + step]
            metrics[f"full_acc_{step}"] = full.sum().float() / count
    return loss, metrics


def _unwrap(draft: nn.Module) -> nn.Module:
    """The draft head inside a DDP wrapper and/or a `DraftWithAdapter` (forward goes through the wrappers,
    for gradient sync)."""
    module = getattr(draft, "module", draft)
    return getattr(module, "draft", module)


@torch.no_grad()
def evaluate_ttt(draft: nn.Module, target: PreTrainedModel, rows: list[dict], steps: int,
                 batch_size: int = 8) -> dict[str, float]:
    """Mean TTT metrics of an EAGLE-3 `draft` (attached to `target`) over tokenized `rows` (`input_ids`,
    `loss_mask`), weighted by positions: `loss_i`, `acc_i` and `full_acc_i` (the draft's token == the target's
    greedy token, full vocabulary: at T=0 the depth-0 one is the first drafted token's acceptance)."""
    from .data import DataCollatorForDraft

    collate = DataCollatorForDraft(pad_token_id=0)
    sums: dict[str, float] = {}
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size])
        features, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], draft.config.feature_layers)
        _, metrics = ttt_loss(draft, features, teacher_logits(target, last, draft.d2t), batch["input_ids"],
                              batch["loss_mask"], batch["attention_mask"], steps=steps,
                              target_ids=target_argmax(target, last))
        for step in range(steps):
            n = float(metrics[f"count_{step}"])
            sums[f"positions_{step}"] = sums.get(f"positions_{step}", 0.0) + n
            for key in ("loss", "acc", "full_acc"):
                sums[f"{key}_{step}"] = sums.get(f"{key}_{step}", 0.0) + float(metrics[f"{key}_{step}"]) * n
    return {k: v / sums[f"positions_{k.rsplit('_', 1)[1]}"] for k, v in sums.items() if not k.startswith("positions")}
