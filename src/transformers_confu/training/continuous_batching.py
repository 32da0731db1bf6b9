"""Answers to many prompts from one batch whose finished rows are refilled with new prompts (continuous batching).

`generate` on a left-padded batch decodes until its longest answer ends: when most answers end after ~40
tokens and a few run to the limit, most of its work is on rows that are done. Here a row that ends is
handed back at once and its place in the batch and in the KV cache goes to the next prompt. Waiting prompts
are prefilled in groups, as a left-padded batch of their own, and their keys and values are written
right-aligned into the rows they take, so that every row's next token goes to the same cache position.
Each row keeps its own positions and attention mask, so a row's answer is the one `generate` gives for its
prompt alone (up to the float rounding of batched matrix products). Cache positions that no row sees any
more are cut off its left end from time to time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
from transformers.cache_utils import DynamicCache

from ..utils.cache import GrowingLayer, cache_kwargs, full_attention, growing_cache
from ..utils.greedy import greedy_ids


class _Batch:
    """The running batch: the KV cache, which cache positions each row sees, each row's next position and
    last token, and the prompt index each row answers (None: a free row, waiting for a prompt)."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, prompts: list[int]):
        self.cache, self.mask, self.prompts = cache, mask, prompts
        self.positions = mask.sum(dim=1)
        self.last = torch.zeros(len(prompts), dtype=torch.long)
        self.tokens: list[list[int]] = [[] for _ in prompts]

    def layers(self) -> list[GrowingLayer]:
        return self.cache.layers

    @property
    def device(self) -> torch.device:
        """Where the cache lives (row indices into it must be there too)."""
        return self.layers()[0].keys.device

    def place(self, rows: list[int], cache: DynamicCache, mask: torch.Tensor, prompts: list[int]) -> None:
        """Put prefilled prompts (`cache`, `mask`: their own left-padded batch) into the free `rows`."""
        width, extra = self.mask.shape[1], mask.shape[1] - self.mask.shape[1]
        if extra > 0:  # the new prompts are longer than every running row: widen the cache on the left
            self._keep(torch.arange(len(self.prompts)), -extra)
            width = mask.shape[1]
        index = torch.tensor(rows)
        on_device = index.to(self.device)
        for layer, new in zip(self.layers(), cache.layers):
            layer.keys[on_device, :, width - new.keys.shape[-2]:] = new.keys
            layer.values[on_device, :, width - new.values.shape[-2]:] = new.values
        self.mask[index] = False
        self.mask[index, width - mask.shape[1]:] = mask
        self.positions[index] = mask.sum(dim=1)
        for row, prompt in zip(rows, prompts):
            self.prompts[row], self.tokens[row] = prompt, []

    def _keep(self, rows: torch.Tensor, start: int) -> None:
        """Keep only `rows` and the cache positions from `start` on (a negative `start` pads on the left)."""
        on_device = None if len(rows) == len(self.prompts) else rows.to(self.device)
        for layer in self.layers():
            layer.keep(on_device, start)
        mask = self.mask.index_select(0, rows)
        self.mask = torch.cat([mask.new_zeros((len(rows), -start)), mask], 1) if start < 0 else mask[:, start:]
        self.positions, self.last = self.positions[rows], self.last[rows]
        self.prompts = [self.prompts[r] for r in rows.tolist()]
        self.tokens = [self.tokens[r] for r in rows.tolist()]

    def shrink(self, drop_free_rows: bool) -> None:
        """Drop the cache positions that no running row sees once they are an eighth of the cache or more,
        and (with `drop_free_rows`) the free rows once they are half of the batch or more: each is a copy of
        the cache, so it is not done at every step."""
        running = [r for r, p in enumerate(self.prompts) if p is not None]
        if not running:
            return
        start = int(self.mask[running].any(dim=0).nonzero()[0])
        drop_rows = drop_free_rows and 2 * len(running) <= len(self.prompts)
        cut = start >= max(32, self.mask.shape[1] // 8)
        if drop_rows or cut:
            self._keep(torch.tensor(running if drop_rows else list(range(len(self.prompts)))), start if cut else 0)


def left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int, width: int | None = None
                ) -> tuple[torch.LongTensor, torch.Tensor]:
    """(B, width) ids and boolean attention mask of token-id prompts, padded on the left (default width: the
    longest prompt)."""
    width = max(len(p) for p in prompts) if width is None else width
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
        mask[row, width - len(ids):] = True
    return input_ids, mask


def _pad_left(states: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, T, D) keys or values with zeros before them up to `width` positions."""
    return torch.nn.functional.pad(states, (0, 0, width - states.shape[-2], 0))


# Largest padded pass (rows x longest prompt) of a prefill on a CPU: prompts of 700-1,216 tokens ran 193 prompt tokens/s
# in passes of 8, 266 alone; shorter ones were level within noise (`results/prefill_passes.md`).
CPU_PREFILL_TOKENS = 1024


def prefill_passes(lengths: Sequence[int], max_rows: int, max_tokens: int | None) -> list[range]:
    """Consecutive groups of at most `max_rows` prompts whose padded size (rows x longest) is at most
    `max_tokens` (None: no limit); a prompt longer than `max_tokens` gets a pass of its own."""
    passes, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        longest = max(longest, length)
        if i > start and (i - start == max_rows or (max_tokens is not None and (i - start + 1) * longest > max_tokens)):
            passes.append(range(start, i))
            start, longest = i, length
    return passes + [range(start, len(lengths))] if lengths else passes


def _prefill(model, prompts: list[Sequence[int]], pad_token_id: int, cache: DynamicCache, prefill_rows: int = 8,
             prefill_tokens: int | None = None):
    """Run prompts through `model` into `cache` in passes (`prefill_passes`), each left-padded to its own longest
    (one pass over 64 prompts ran 4x slower a token on a CPU, `results/regen_prefill_rows.md`), their keys and
    values then left-padded to the longest of all; return their mask and last-position logits."""
    width, device = max(map(len, prompts)), model.device
    parts, masks, logits = [], [], []
    for rows in prefill_passes([len(p) for p in prompts], prefill_rows, prefill_tokens):
        input_ids, mask = left_padded([prompts[i] for i in rows], pad_token_id)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # as `generate` numbers left-padded rows
        part = DynamicCache(config=model.config)
        logits.append(model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                            position_ids=positions.to(device), use_cache=True, logits_to_keep=1,
                            **cache_kwargs(model, part)).logits[:, -1])
        parts.append(part)
        masks.append(torch.nn.functional.pad(mask, (width - mask.shape[1], 0)))
    for index, layer in enumerate(cache.layers):  # the passes' keys and values, left-padded to `width`, as one
        keys, values = ([_pad_left(getattr(part.layers[index], name), width) for part in parts] for name in ("keys", "values"))
        layer.update(torch.cat(keys), torch.cat(values))
    return torch.cat(masks), torch.cat(logits)


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Greedy tokens (`temperature` 0), or tokens sampled at `temperature` from the `top_p` nucleus, one
    generator per row (so that a row's sample does not depend on the other rows of the batch)."""
    if temperature <= 0:
        return greedy_ids(logits).cpu()
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p  # the most likely token always stays
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators)])


@torch.no_grad()
def stream_answers(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    batch_size: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seeds: Sequence[int] | None = None,
    refill_rows: int | None = None,
    pad_token_id: int = 0,
    stop: Callable[[], bool] | None = None,
    prefill_rows: int = 8,
    prefill_tokens: int | Literal["auto"] | None = "auto",
) -> Iterator[tuple[int, list[int], bool]]:
    """Yield `(prompt index, new token ids, ended with an EOS token)` for each of `prompts` (token ids), as
    their answers end, decoding at most `batch_size` rows at a time. Waiting prompts are prefilled once
    `refill_rows` rows (default: an eighth of the batch) are free. Sampled rows (`temperature` > 0) use a
    generator seeded with `seeds[i]` for prompt i. Once `stop()` is true no more prompts are started; the
    running ones are finished. Prompts are prefilled in passes of at most `prefill_rows` prompts and
    `prefill_tokens` padded tokens ("auto": `CPU_PREFILL_TOKENS` on a CPU, no limit elsewhere; None: none)."""
    if not full_attention(model.config):
        raise ValueError("continuous batching needs a model whose layers all attend to the full context")
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("sampling needs one seed per prompt")
    eos = set(eos_token_ids)
    refill_rows = refill_rows or max(1, batch_size // 8)
    if prefill_tokens == "auto":
        prefill_tokens = CPU_PREFILL_TOKENS if model.device.type == "cpu" else None
    waiting, batch = deque(range(len(prompts))), None
    generators: dict[int, torch.Generator] = {}
    while True:
        free = [r for r, p in enumerate(batch.prompts) if p is None] if batch else []
        if waiting and not (stop and stop()) and (batch is None or len(free) >= min(refill_rows, len(waiting))):
            taken = [waiting.popleft() for _ in range(min(len(free) if batch else batch_size, len(waiting)))]
            cache = growing_cache(model.config, reserve=max_new_tokens) if batch is None else DynamicCache(config=model.config)
            mask, logits = _prefill(model, [prompts[i] for i in taken], pad_token_id, cache, prefill_rows,
                                    prefill_tokens)
            if temperature > 0:
                generators.update({i: torch.Generator().manual_seed(int(seeds[i])) for i in taken})
            first = next_tokens(logits, temperature, top_p, [generators.get(i) for i in taken])
            if batch is None:
                batch = _Batch(cache, mask, taken)
                rows = list(range(len(taken)))
            else:
                rows = free[: len(taken)]
                batch.place(rows, cache, mask, taken)
            batch.last[rows] = first
        elif batch is None or all(p is None for p in batch.prompts):
            return
        else:
            step_mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.prompts), 1))], dim=1)
            logits = model(input_ids=batch.last[:, None].to(model.device), attention_mask=step_mask.to(model.device),
                           position_ids=batch.positions[:, None].to(model.device), use_cache=True, logits_to_keep=1,
                           **cache_kwargs(model, batch.cache)).logits[:, -1]
            batch.mask, batch.positions = step_mask, batch.positions + 1
            batch.last = next_tokens(logits, temperature, top_p, [generators.get(p) for p in batch.prompts])
            rows = [r for r, p in enumerate(batch.prompts) if p is not None]
        for row in rows:
            token = int(batch.last[row])
            batch.tokens[row].append(token)
            ended = token in eos
            if ended or len(batch.tokens[row]) >= max_new_tokens:
                yield batch.prompts[row], batch.tokens[row], ended
                generators.pop(batch.prompts[row], None)
                batch.prompts[row] = None
        batch.shrink(drop_free_rows=not waiting or bool(stop and stop()))
