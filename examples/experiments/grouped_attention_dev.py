"""Tree verify passes with grouped-query heads (`utils/grouped_attention.py`) against transformers' SDPA as it is.

On the dev first turns (2 per category), greedy: plain `generate`, then the shipped draft alone (d2k1n3) and its
hybrid tree (d2k1n6s4, the shipped corpus), each with the grouped path on and off (off: the wrapped `generate`
without `grouped_query_attention`), in one process, the methods in a rotated order per question so that the
machine's drifts hit them alike. Reports tau, tokens/s, speed-up over plain `generate` and the target's time per
pass (the prompt's included), overall and for the prompts up to and over the median length; every output must
equal plain `generate`'s.

    OMP_NUM_THREADS=1 python examples/experiments/grouped_attention_dev.py --out results/grouped_attention_dev
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from transformers_confu import load_target
from transformers_confu.benchmark.assistants import budget_name, draft_assistant
from transformers_confu.benchmark.questions import chat_input_ids, load_questions
from transformers_confu.decoding import assistant as assistant_module
from transformers_confu.decoding.suffix import SHIPPED_CORPUS
from transformers_confu.models.target import DEFAULT_DRAFT


def cpu_name() -> str:
    """The CPU's model name where /proc/cpuinfo says it, else the machine type."""
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.is_file() else [])
             if line.startswith("model name")]
    return names[0] if names else platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=str(DEFAULT_DRAFT))
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args()
    model, tokenizer = load_target()
    assistants = {budget_name(b): draft_assistant(model, args.draft, b, str(SHIPPED_CORPUS) if len(b) > 3 else None)
                  for b in [(2, 1, 3), (2, 1, 6, 4)]}
    methods = ["generate"] + [f"{name}:{attention}" for name in assistants for attention in ("sdpa", "grouped")]
    prompts = [chat_input_ids(tokenizer, q["turns"][:1]) for q in load_questions(per_category=args.per_category)]
    median = statistics.median(ids.shape[1] for ids in prompts)

    def run(method: str, ids: torch.Tensor) -> tuple[torch.Tensor, float, dict]:
        name, _, attention = method.partition(":")
        options = {} if name == "generate" else {"assistant_model": assistants[name]}
        with contextlib.ExitStack() as stack:
            if attention == "sdpa":  # transformers' SDPA in the tree passes, as before grouped_query_attention
                stack.enter_context(mock.patch.object(assistant_module, "grouped_query_attention",
                                                      lambda model: contextlib.nullcontext()))
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, **options)
            took = time.perf_counter() - start
        stats = assistants[name].stats if options else None
        if stats is None:
            return out, took, {}
        return out, took, dict(passes=stats.target_forwards, accepted=sum(stats.accept_lengths),
                               verify=stats.verify_seconds)

    for method in methods:  # warm-up
        run(method, prompts[0])
    totals = {half: {m: dict(tokens=0, seconds=0.0, passes=0, accepted=0, verify=0.0) for m in methods}
              for half in ("short", "long")}
    identical = True
    for i, ids in enumerate(prompts):
        half = "short" if ids.shape[1] <= median else "long"
        outs = {}
        for method in methods[i % len(methods):] + methods[: i % len(methods)]:
            outs[method], took, counts = run(method, ids)
            row = totals[half][method]
            row["tokens"] += outs[method].shape[1] - ids.shape[1]
            row["seconds"] += took
            for key, value in counts.items():
                row[key] += value
        identical &= all(torch.equal(outs["generate"], out) for out in outs.values())
        print(i, ids.shape[1], {m: round(t["seconds"], 1) for m, t in totals[half].items()}, flush=True)
    table = {}
    for half in ("short", "long", "overall"):
        rows = {m: {k: sum(totals[h][m][k] for h in ("short", "long")) for k in totals["short"][m]} for m in methods} \
            if half == "overall" else totals[half]
        base = rows["generate"]["tokens"] / rows["generate"]["seconds"]
        table[half] = {m: dict(tokens_per_s=r["tokens"] / r["seconds"], speedup=r["tokens"] / r["seconds"] / base,
                               tau=r["accepted"] / r["passes"] if r["passes"] else 1.0,
                               verify_ms=1e3 * r["verify"] / r["passes"] if r["passes"] else None)
                       for m, r in rows.items()}
    result = dict(hardware=f"{platform.machine()} CPU ({cpu_name()}), {torch.get_num_threads()} threads",
                  draft=Path(args.draft).name, questions=len(prompts), median_prompt_tokens=median,
                  max_new_tokens=args.max_new_tokens, outputs_identical=identical, table=table,
                  command="python examples/experiments/grouped_attention_dev.py " + shlex.join(sys.argv[1:]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = ["# Tree verify passes with grouped-query heads vs transformers' SDPA (repeated heads)\n",
          f"`{result['command']}`\n",
          f"{result['hardware']}; {len(prompts)} dev first turns (median prompt {median:.0f} tokens), greedy, "
          f"{args.max_new_tokens} new tokens, methods rotated per question, one run; outputs identical to plain "
          f"`generate`: {identical}. target ms: the target's time per pass, the prompt's pass included.\n"]
    for half, label in (("overall", "All questions"), ("short", f"Prompts up to {median:.0f} tokens"),
                        ("long", f"Prompts over {median:.0f} tokens")):
        md += [f"## {label}\n", "| method | tau | tokens/s | speed-up | target ms |", "|---|---|---|---|---|"]
        md += [f"| {m} | {r['tau']:.2f} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | "
               f"{'' if r['verify_ms'] is None else format(r['verify_ms'], '.1f')} |" for m, r in table[half].items()]
        md.append("")
    Path(args.out).with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
