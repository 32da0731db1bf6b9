"""Dev questions grouped by prompt length, for `confu-bench --questions`: the category of each row is its
first turn's length bucket in the target's tokens (with its chat template), e.g. `prompt_0400-0600`, so that
confu-bench's per-category table reads as a table per prompt length.

    python examples/experiments/length_questions.py --per-bucket 3 --out runs/length_questions.jsonl
    confu-bench --questions runs/length_questions.jsonl --turns 1 --max-new-tokens 64 --loops eager,static ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers_confu import load_target
from transformers_confu.benchmark.questions import DEFAULT_QUESTIONS, chat_input_ids, load_questions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench style questions (default: the dev set)")
    p.add_argument("--edges", default="50,100,200,400,600,800", help="bucket edges in prompt tokens")
    p.add_argument("--per-bucket", type=int, default=3)
    p.add_argument("--out", required=True, help="the .jsonl to write")
    args = p.parse_args()
    _, tokenizer = load_target(pack=False)
    edges = [int(x) for x in args.edges.split(",")]
    buckets: dict[str, list[dict]] = {f"prompt_{lo:04d}-{hi:04d}": [] for lo, hi in zip(edges, edges[1:])}
    for row in load_questions(args.questions):
        length = chat_input_ids(tokenizer, row["turns"][:1]).shape[1]
        for (lo, hi), name in zip(zip(edges, edges[1:]), buckets):
            if lo <= length < hi and len(buckets[name]) < args.per_bucket:
                buckets[name].append({**row, "category": name, "source_category": row["category"],
                                      "prompt_tokens": length, "turns": row["turns"][:1]})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for rows in buckets.values() for row in rows)
    for name, rows in buckets.items():
        print(name, [row["prompt_tokens"] for row in rows])


if __name__ == "__main__":
    main()
