"""The decoding loop's ceiling on this machine, with the real target.

(a) The target's verify cost against tree width (one forward over `width` new tokens on a cache of
    `--context` tokens, with hidden states, as the loop runs it).
(b) Tokens/s of the loop with an ORACLE draft (it proposes the target's own greedy continuation, so every
    chain is accepted) against plain `generate`, per tree budget, and the loop's own overhead: wall time
    outside the draft and target forwards.

Both with each `--kernels` setting of the linear layers, in the same run: `mkl` (PyTorch's `F.linear`) and
`onednn` (weights packed for oneDNN, `packed_linear`, what `load_target` gives on a CPU).

    python examples/experiments/bench_loop_ceiling.py --out results/loop_ceiling
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig

from transformers_confu import SpeculativeStats, load_target
from transformers_confu.benchmark.questions import chat_input_ids, load_questions
from transformers_confu.decoding.generation import speculative_generate
from transformers_confu.decoding.oracle import OracleDrafter
from transformers_confu.decoding.tree import additive_mask
from transformers_confu.utils.cache import cache_kwargs, truncate_cache
from transformers_confu.utils.packed_linear import packed_kernels


def verify_cost(model, context: int, widths: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one forward over `width` chained tokens after `context` cached tokens."""
    cache = DynamicCache(config=model.config)
    ids = torch.randint(100, 20000, (1, context + max(widths)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :context], use_cache=True, **cache_kwargs(model, cache))
        costs = {}
        for width in tqdm(widths, desc="verify cost"):
            mask = additive_mask(torch.ones(width, width, dtype=torch.bool).tril(), context, model.dtype)
            positions = torch.arange(context, context + width)[None]
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                model(ids[:, context : context + width], position_ids=positions, attention_mask=mask,
                      use_cache=True, output_hidden_states=True, **cache_kwargs(model, cache))
                times.append(time.perf_counter() - start)
                truncate_cache(cache, context)
            costs[width] = statistics.median(times)
    return costs


def oracle_speed(model, tokenizer, prompts, budgets, max_new_tokens: int) -> list[dict]:
    """Plain greedy `generate` vs the loop with an oracle draft, interleaved per prompt."""
    config = GenerationConfig(do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                              max_new_tokens=max_new_tokens)
    rows = {"generate": dict(method="generate", seconds=0.0, tokens=0)}
    for depth, total in budgets:
        rows[(depth, total)] = dict(method=f"oracle d{depth} n{total}", seconds=0.0, tokens=0, forwards=0,
                                    accepted=0, other=0.0)
    for ids in tqdm(prompts, desc="oracle vs generate"):
        start = time.perf_counter()
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        rows["generate"]["seconds"] += time.perf_counter() - start
        rows["generate"]["tokens"] += reference.shape[1] - ids.shape[1]
        for depth, total in budgets:
            stats = SpeculativeStats()
            drafter = OracleDrafter(reference, depth, total, model.config.vocab_size)
            out = speculative_generate(model, drafter, [2, 15, 27], ids, config, max_new_tokens, stats)
            assert torch.equal(out, reference), "the loop is not lossless"
            row = rows[(depth, total)]
            row["seconds"] += stats.total_seconds
            row["tokens"] += stats.new_tokens
            row["forwards"] += stats.target_forwards
            row["accepted"] += sum(stats.accept_lengths)
            row["other"] += stats.other_seconds
    base = rows["generate"]["tokens"] / rows["generate"]["seconds"]
    for row in rows.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["speedup"] = row["tokens_per_s"] / base
        if "forwards" in row:
            row["tau"] = row.pop("accepted") / row["forwards"]
            row["overhead"] = row.pop("other") / row["seconds"]
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/loop_ceiling", help="output path without extension")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--widths", default="1,2,4,8,12,16,24,32,48,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=2, help="dev questions per category group")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budgets", default="2:3,3:4,4:6,5:8,6:12,8:16", help="depth:total_tokens,...")
    parser.add_argument("--kernels", default="mkl,onednn", help="linear kernels to compare: mkl, onednn")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_target()
    widths = [int(w) for w in args.widths.split(",")]
    questions = load_questions(per_category=args.prompts)
    prompts = [chat_input_ids(tokenizer, q["turns"][:1]) for q in questions if q["category"] in
               ("translation", "summarization", "qa", "math_reasoning", "rag", "writing")]
    budgets = [tuple(int(x) for x in b.split(":")) for b in args.budgets.split(",")]
    kernels = args.kernels.split(",")
    costs, speed = {}, {}
    for kernel in kernels:
        with packed_kernels(kernel == "onednn"):
            costs[kernel] = verify_cost(model, args.context, widths, args.repeats)
            speed[kernel] = oracle_speed(model, tokenizer, prompts, budgets, args.max_new_tokens)
    result = dict(
        hardware=f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, CPU",
        target="SmolLM2-135M-Instruct (fp32, sdpa)", context=args.context, prompts=len(prompts),
        max_new_tokens=args.max_new_tokens, verify_seconds=costs, oracle=speed,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    first = costs[kernels[0]][widths[0]]
    lines = [f"# Loop ceiling: {result['target']}, {result['hardware']}", "",
             f"## Verify cost vs tree width (cache of {args.context} tokens, median of {args.repeats})", "",
             f"ms, and in brackets x width {widths[0]} of the same kernel; last column: x {kernels[0]} width {widths[0]}.", "",
             "| width | " + " | ".join(kernels) + f" | {kernels[-1]} vs {kernels[0]} width {widths[0]} |",
             "|---|" + "---|" * (len(kernels) + 1)]
    for w in widths:
        cells = [f"{1000 * costs[k][w]:.1f} ({costs[k][w] / costs[k][widths[0]]:.2f}x)" for k in kernels]
        lines.append(f"| {w} | " + " | ".join(cells) + f" | {costs[kernels[-1]][w] / first:.2f}x |")
    lines += ["", f"## Oracle draft vs plain generate ({len(prompts)} dev prompts, {args.max_new_tokens} new tokens,"
              " greedy, outputs checked identical; speed-up over plain generate with the same kernels)", "",
              "| kernels | method | tau | tokens/s | speed-up | loop overhead |", "|---|---|---|---|---|---|"]
    for kernel in kernels:
        for row in speed[kernel]:
            tau, over = row.get("tau"), row.get("overhead")
            lines.append(f"| {kernel} | {row['method']} | {tau:.2f} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                         f"{100 * over:.1f}% |" if tau else
                         f"| {kernel} | {row['method']} | 1.00 | {row['tokens_per_s']:.1f} | 1.00x | - |")
    lines += ["", f"Command: `python examples/experiments/bench_loop_ceiling.py {' '.join(sys.argv[1:])}`", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
