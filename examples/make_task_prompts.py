"""Reading-task prompts built from the training data's own texts, for on-policy regeneration.

The training sets are instructions, code, role play and math; the dev set also asks the target to
summarize an article ("Summarize: ...") and to answer a question after retrieved passages (RAG), tasks where
the target copies from a long prompt and a draft must learn to follow. This writes such prompts (messages
layout, user turn only) from the reference answers of the given files: "Summarize: <passage>" over 2-3
joined answers, and RAG prompts of 2-3 answers followed by the question one of them answers. The target's
own answers then come from `confu-train --regenerate` (pass the output with `--data`). No dev or held-out text
is used.

    python examples/make_task_prompts.py --data-dir ../shared/data/train --count 600 --out runs/task_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from transformers_confu.training.data_sources import find_sources, load_conversations


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--files", nargs="*", default=["gpteacher_roleplay_instruct.json", "ultrachat_ultra_eval.json",
                                                  "self_instruct_user_oriented.jsonl"],
                   help="files of prose answers to build passages from")
    p.add_argument("--count", type=int, default=600, help="prompts of each task")
    p.add_argument("--max-words", type=int, default=320, help="passage length cap (prompts must fit --max-length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rng = random.Random(args.seed)
    pairs = []  # (question, answer) with a prose answer of at least 40 words
    for row in load_conversations(find_sources(data_dir=args.data_dir, files=args.files)):
        messages = row["messages"]
        for question, answer in zip(messages, messages[1:]):
            if question["role"] == "user" and answer["role"] == "assistant" and len(answer["content"].split()) >= 40:
                pairs.append((question["content"], answer["content"]))
    if len(pairs) < 3:
        raise SystemExit(f"only {len(pairs)} prose answers in {args.files}: pass other --files")

    def passages(k: int) -> list[tuple[str, str]]:
        chosen, words = [], 0
        for question, answer in rng.sample(pairs, k):
            take = " ".join(answer.split()[: max(0, args.max_words - words)])
            if take:
                chosen.append((question, take))
                words += len(take.split())
        return chosen

    prompts = []
    for _ in range(args.count):
        text = " ".join(answer for _, answer in passages(rng.randint(2, 3)))
        prompts.append("Summarize: " + text)
        context = passages(rng.randint(2, 3))
        question = rng.choice(context)[0].splitlines()[0]
        prompts.append("\n".join(answer for _, answer in context) + "\n" + question)
    with Path(args.out).open("w") as f:
        for prompt in prompts:
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
    print(f"wrote {len(prompts)} prompts ({args.count} summarization, {args.count} RAG) from {len(pairs)} answers "
          f"to {args.out}")


if __name__ == "__main__":
    main()
