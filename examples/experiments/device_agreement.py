"""Whether answers the target made on another device (a GPU's regeneration folder) are the ones this CPU makes.

Greedy answers from the same float32 weights differ between devices only where float rounding flips a near
tie; once a token differs the rest of the answer follows another path. This answers a sample of the folder's
prompts again here (the same settings, `regenerate_responses`) and counts identical answers and, for the
others, how far they agree.

    python examples/experiments/device_agreement.py --answers runs/gpu-regen/answers \
        --prompts .dev/pool/prompts_*.jsonl --rows 48 --out results/gpu_cpu_answer_agreement
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import datasets

from transformers_confu import load_target
from transformers_confu.training.data import prompt_messages
from transformers_confu.training.prompt_pool import read_jsonl
from transformers_confu.training.regenerate import prompt_key, read_responses, regenerate_responses


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--answers", required=True, help="the other device's regeneration folder")
    p.add_argument("--prompts", nargs="+", required=True, help="the prompt files it answered (.jsonl, messages)")
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=int, default=704, help="as confu-train --max-length 768 answers")
    p.add_argument("--out", required=True, help="output path prefix (.json, .md)")
    args = p.parse_args()
    theirs = read_responses(Path(args.answers) / "responses.jsonl")
    prompts = {}
    for path in args.prompts:
        for request in read_jsonl(Path(path)):
            messages = prompt_messages(request["messages"])
            prompts.setdefault(prompt_key(messages), messages)
    keys = sorted(k for k in theirs if k in prompts)
    keys = random.Random(args.seed).sample(keys, min(args.rows, len(keys)))
    settings = json.loads((Path(args.answers) / "settings.json").read_text())
    target, tokenizer = load_target()
    rows = datasets.Dataset.from_dict({"messages": [prompts[k] for k in keys]})
    with tempfile.TemporaryDirectory() as folder:
        regenerate_responses(rows, target, tokenizer, folder, batch_size=16, max_new_tokens=settings["max_new_tokens"],
                             max_prompt_tokens=args.max_prompt_tokens)
        ours = read_responses(Path(folder) / "responses.jsonl")
    per_row = []
    for key in keys:
        a = tokenizer(theirs[key]["response"], add_special_tokens=False)["input_ids"]
        b = tokenizer(ours[key]["response"], add_special_tokens=False)["input_ids"]
        per_row.append({"key": key, "identical": a == b, "tokens_there": len(a), "tokens_here": len(b),
                        "common_prefix": common_prefix(a, b)})
    differ = [r for r in per_row if not r["identical"]]
    result = {"answers": args.answers, "settings": settings, "rows": len(per_row),
              "identical": len(per_row) - len(differ),
              "tokens_there": sum(r["tokens_there"] for r in per_row),
              "agreeing_prefix_tokens": sum(r["common_prefix"] for r in per_row),
              "threads": os.environ.get("OMP_NUM_THREADS"), "per_row": per_row}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    lines = [f"# The target's greedy answers: {args.answers} against this CPU", "",
             f"{result['identical']} of {result['rows']} answers identical token for token; the tokens before "
             f"the first difference cover {result['agreeing_prefix_tokens']} of the other device's "
             f"{result['tokens_there']} answer tokens.", "",
             "| answer tokens there | here | first difference at |", "|---|---|---|"]
    lines += [f"| {r['tokens_there']} | {r['tokens_here']} | {r['common_prefix']} |" for r in differ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
