"""Where a decode step of continuous batching spends its time: the CPU ceiling of regeneration.

One decode step of `continuous_batching.stream_answers` runs the target on ROWS rows (one new token each) over a
growing cache of about WIDTH positions, rows left-padded by different amounts as refills leave them. This times
that step, splits it by operator (linear layers, attention, the rest) with the PyTorch profiler, and compares the
attention with a grouped-matmul attention that reads each key/value head once for its query heads (the kernel
SDPA uses takes `enable_gqa`), on 30 layers' worth of caches of the same shape:

    OMP_NUM_THREADS=1 python examples/experiments/regen_decode_step.py --rows 64 --width 213 --out results/regen_decode_step
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import profile

from transformers_confu import load_target
from transformers_confu.training.continuous_batching import _prefill
from transformers_confu.utils.cache import cache_kwargs, growing_cache


def _median_ms(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


@torch.no_grad()
def decode_step(model, rows: int, width: int, repeats: int) -> dict:
    """Median ms of a decode step over `rows` ragged rows of a `width`-position cache, and its profile shares."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, model.config.vocab_size - 100, (width - row * width // (2 * rows),),
                             generator=generator).tolist() for row in range(rows)]  # left padding up to half the width
    cache = growing_cache(model.config, reserve=256)
    mask, logits = _prefill(model, prompts, 0, cache)
    positions = mask.sum(dim=1, keepdim=True)
    state = {"mask": mask, "positions": positions, "last": logits.argmax(dim=-1, keepdim=True)}

    def step():
        state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(rows, 1)], dim=1)
        logits = model(input_ids=state["last"], attention_mask=state["mask"], position_ids=state["positions"],
                       use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits[:, -1]
        state["positions"] = state["positions"] + 1
        state["last"] = logits.argmax(dim=-1, keepdim=True)

    for _ in range(3):
        step()
    ms = _median_ms(step, repeats)
    with profile() as prof:
        for _ in range(repeats):
            step()
    totals = {"linear": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        name = ("linear" if "linear" in event.key or event.key in ("aten::mm", "aten::addmm") else
                "attention" if "attention" in event.key else "other")
        totals[name] += event.self_cpu_time_total
    whole = sum(totals.values())
    return {"ms_per_step": ms, "tokens_per_second": rows / ms * 1000, "width_at_end": state["mask"].shape[1],
            "share": {k: v / whole for k, v in totals.items()}}


def attention_alternatives(config, rows: int, width: int, repeats: int) -> dict:
    """ms for 30 layers' attention of one decode step: SDPA with grouped heads vs a grouped matmul."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim, groups = config.hidden_size // heads, heads // kv_heads
    layers = [(torch.randn(rows, kv_heads, width, dim), torch.randn(rows, kv_heads, width, dim))
              for _ in range(config.num_hidden_layers)]
    query = torch.randn(rows, heads, 1, dim)
    mask = torch.ones(rows, 1, 1, width, dtype=torch.bool)
    for row in range(rows):
        mask[row, ..., : row * width // (2 * rows)] = False
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))

    def sdpa():
        return [F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True) for k, v in layers]

    def grouped():
        out = []
        for k, v in layers:
            scores = torch.matmul(query.view(rows, kv_heads, groups, dim), k.transpose(-1, -2)).mul_(dim ** -0.5)
            out.append(torch.matmul(scores.add_(bias).softmax(dim=-1), v).view(rows, heads, 1, dim))
        return out

    error = max(float((a - b).abs().max()) for a, b in zip(sdpa(), grouped()))
    return {"sdpa_enable_gqa_ms": _median_ms(sdpa, repeats), "grouped_matmul_ms": _median_ms(grouped, repeats),
            "max_abs_difference": error,
            "kv_cache_mb_read": 2 * config.num_hidden_layers * rows * kv_heads * width * dim * 4 / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--width", type=int, default=213, help="cache positions at the first timed step")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", required=True, help="writes OUT.json")
    args = p.parse_args()
    model, _ = load_target()
    result = {"command": "OMP_NUM_THREADS=%d python examples/experiments/regen_decode_step.py --rows %d --width %d "
                         "--repeats %d --out %s" % (torch.get_num_threads(), args.rows, args.width, args.repeats, args.out),
              "threads": torch.get_num_threads(), "rows": args.rows, "width": args.width,
              "linear_gflop_per_step": 2 * args.rows * sum(m.weight.numel() for m in model.modules()
                                                          if isinstance(m, torch.nn.Linear)) / 1e9,
              "decode_step": decode_step(model, args.rows, args.width, args.repeats),
              "attention_30_layers": attention_alternatives(model.config, args.rows, args.width, args.repeats)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
