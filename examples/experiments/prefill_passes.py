"""How large a prefill pass should be: prompt tokens/s of `continuous_batching`'s prefill by pass budget and prompt length.

Regeneration prefills the prompts that take free rows in passes (`continuous_batching.prefill_passes`): at most
`prefill_rows` prompts and `prefill_tokens` padded tokens (rows x longest) a pass. This times the prefill of the
same prompts, drawn from the pool by length bucket (SHORT:LONG tokens), under each budget, so that the budget is
chosen on the prompts regeneration really meets:

    OMP_NUM_THREADS=1 python examples/experiments/prefill_passes.py --prompts runs/regen/pool/prompts_*.jsonl \
        --buckets 30:120 200:400 700:1216 --budgets 256 512 1024 2048 4096 none --out results/prefill_passes
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from transformers_confu import load_target
from transformers_confu.training.continuous_batching import _prefill
from transformers_confu.training.data import render
from transformers_confu.training.prompt_pool import read_jsonl


def bucket_prompts(tokenizer, files: list[str], low: int, high: int, count: int, seed: int) -> list[list[int]]:
    """`count` random prompts of `files` whose chat-rendered token ids number `low` to `high`, shortest first (as
    regeneration sorts a refill group)."""
    rows = [row for f in files for row in read_jsonl(Path(f))]
    random.Random(seed).shuffle(rows)
    out = []
    for row in rows:
        ids = tokenizer(render(tokenizer, row["messages"], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        if low <= len(ids) <= high:
            out.append(ids)
            if len(out) == count:
                break
    return sorted(out, key=len)


@torch.no_grad()
def prefill_rate(model, prompts: list[list[int]], group: int, budget: int | None, pad: int) -> float:
    """Prompt tokens/s of prefilling `prompts` in refill groups of `group` (as free rows take them)."""
    start = time.perf_counter()
    for first in range(0, len(prompts), group):
        _prefill(model, prompts[first : first + group], pad, DynamicCache(config=model.config), group, budget)
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", nargs="+", required=True, help=".jsonl files of {messages} requests")
    p.add_argument("--buckets", nargs="+", default=["30:120", "200:400", "700:1216"], help="LOW:HIGH prompt tokens")
    p.add_argument("--budgets", nargs="+", default=["256", "512", "1024", "2048", "4096", "none"],
                   help="padded tokens a pass; none: only the group's 8 rows bound it (the old passes)")
    p.add_argument("--group", type=int, default=8, help="prompts a refill prefills together (batch / 8)")
    p.add_argument("--tokens", type=int, default=8000, help="prompt tokens a bucket holds at least (whole groups)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args()
    model, tokenizer = load_target()
    budgets = [None if b == "none" else int(b) for b in args.budgets]
    record = {"command": f"OMP_NUM_THREADS={torch.get_num_threads()} python examples/experiments/prefill_passes.py "
                         f"--prompts {' '.join(args.prompts)} --buckets {' '.join(args.buckets)} --budgets "
                         f"{' '.join(args.budgets)} --group {args.group} --tokens {args.tokens} --out {args.out}",
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "threads": torch.get_num_threads(),
              "buckets": {}}
    for bucket in args.buckets:
        low, high = map(int, bucket.split(":"))
        count = args.group * max(1, math.ceil(args.tokens / ((low + high) / 2 * args.group)))  # whole groups
        prompts = bucket_prompts(tokenizer, args.prompts, low, high, count, args.seed)
        prefill_rate(model, prompts[: args.group], args.group, None, tokenizer.pad_token_id)  # warm-up
        rates = {str(b).lower(): prefill_rate(model, prompts, args.group, b, tokenizer.pad_token_id) for b in budgets}
        record["buckets"][bucket] = {"prompts": len(prompts), "mean_tokens": sum(map(len, prompts)) / len(prompts),
                                     "tokens_per_second": rates}
        print(bucket, record["buckets"][bucket], flush=True)
    Path(args.out + ".json").write_text(json.dumps(record, indent=2))
    header = " | ".join(f"{b}" for b in args.budgets)
    lines = [f"# Prefill passes: prompt tokens/s by padded tokens a pass\n", f"    {record['command']}\n",
             f"{record['machine']}, {record['threads']} thread(s), float32, refill groups of {args.group} prompts.\n",
             f"| prompt tokens | prompts | mean | {header} |", "|---" * (3 + len(budgets)) + "|"]
    for bucket, r in record["buckets"].items():
        best = max(r["tokens_per_second"].values())
        cells = [f"**{v:.0f}**" if v == best else f"{v:.0f}" for v in r["tokens_per_second"].values()]
        lines.append(f"| {bucket.replace(':', '-')} | {r['prompts']} | {r['mean_tokens']:.0f} | {' | '.join(cells)} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
