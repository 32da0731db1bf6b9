"""The static mode against the eager loop on a CPU, per prompt length (issue #25).

For one dev question per prompt-length bucket (`length_questions.py`'s buckets), greedy, after one warm-up call per
mode: `model.generate(..., assistant_model=assistant)` with the eager loop, with `cache_implementation="static"`,
and (`static-full`) the static mode as it was before #25, whose attention read the whole bucketed capacity of its
caches (`StaticLayer`) instead of the filled positions (`FilledStaticLayer`). The modes alternate within each
repetition, in a rotated order, so that the machine's drifts hit them alike; the ratios are total times over
the same prompts, from this one run. Every output must equal the eager loop's.

    python examples/experiments/static_cpu_long.py --reps 2 --out results/static_cpu_long
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from transformers_confu import ConFuAssistant, load_target
from transformers_confu.benchmark.questions import chat_input_ids, load_questions
from transformers_confu.decoding import assistant as assistant_module
from transformers_confu.models.target import DEFAULT_DRAFT
from transformers_confu.utils.cache import static_cache

MODES = {"eager": {}, "static": {"cache_implementation": "static"}, "static-full": {"cache_implementation": "static"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--edges", default="50,100,200,400,600,800", help="bucket edges in prompt tokens")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args()
    model, tokenizer = load_target()
    assistant = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model)
    edges = [int(x) for x in args.edges.split(",")]
    prompts: dict[str, torch.Tensor] = {}
    for row in load_questions():
        ids = chat_input_ids(tokenizer, row["turns"][:1])
        for lo, hi in zip(edges, edges[1:]):
            if lo <= ids.shape[1] < hi:
                prompts.setdefault(f"{lo}-{hi}", ids)
    options = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "assistant_model": assistant}

    def full_width(num_layers: int, capacity: int, filled_only: bool = False):
        return static_cache(num_layers, capacity)

    parts: dict[str, dict] = {}  # each static mode keeps its own caches between calls, as one assistant does

    def run(mode: str, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        assistant_module.static_cache = full_width if mode == "static-full" else static_cache
        if mode in parts:
            assistant._static = parts[mode]
        start = time.perf_counter()
        out = model.generate(ids, **options, **MODES[mode])
        took = time.perf_counter() - start
        if mode != "eager":
            parts[mode] = assistant.__dict__.pop("_static")
        return out, took

    for mode in MODES:  # warm-up
        run(mode, next(iter(prompts.values())))
    seconds = {bucket: dict.fromkeys(MODES, 0.0) for bucket in prompts}
    identical = True
    for rep in range(args.reps):
        for bucket, ids in prompts.items():
            order = list(MODES)[rep % 3:] + list(MODES)[: rep % 3]
            outs = {}
            for mode in order:
                outs[mode], took = run(mode, ids)
                seconds[bucket][mode] += took
            identical &= all(torch.equal(outs["eager"], out) for out in outs.values())
            print(bucket, rep, {m: round(s, 2) for m, s in seconds[bucket].items()}, flush=True)
    rows = [dict(bucket=bucket, prompt_tokens=prompts[bucket].shape[1], **{f"{m}_seconds": s for m, s in t.items()},
                 static_over_eager=t["eager"] / t["static"], static_full_over_eager=t["eager"] / t["static-full"])
            for bucket, t in seconds.items()]
    result = dict(hardware=f"{platform.machine()} CPU, {torch.get_num_threads()} threads", draft=DEFAULT_DRAFT.name,
                  tree=str(assistant.budget), max_new_tokens=args.max_new_tokens, reps=args.reps,
                  outputs_identical=identical, rows=rows,
                  command="python examples/experiments/static_cpu_long.py " + shlex.join(sys.argv[1:]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Static mode vs the eager loop on a CPU, per prompt length\n\n`{result['command']}`\n",
          f"{result['hardware']}; draft {result['draft']}, {result['tree']}, greedy, {args.max_new_tokens} new tokens, "
          f"{args.reps} repetitions per mode, modes alternated; outputs identical to the eager loop: {identical}. "
          "Speed = eager seconds / mode seconds (> 1: faster than the eager loop).\n",
          "| prompt tokens | eager s | static s | static-full s (before #25) | static / eager | static-full / eager |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['prompt_tokens']} | {r['eager_seconds']:.1f} | {r['static_seconds']:.1f} | "
           f"{r['static-full_seconds']:.1f} | {r['static_over_eager']:.2f}x | {r['static_full_over_eager']:.2f}x |"
           for r in rows]
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
