"""Prompts written by the target itself (Magpie-style), for on-policy regeneration beyond the training files.

The training files are mostly math (GSM8K) and code; the dev categories where the shipped draft is weakest
(writing, STEM, humanities, extraction, translation, QA) are barely in them. An instruction-tuned target,
given its chat template up to the start of a user turn, writes a user request of the kind it was tuned on.
This samples such requests, each started with an opener word ("Write", "Explain", "Translate", ...) that
steers it toward one kind of task, keeps the complete ones (ended by the end-of-turn token, 4-150 words),
drops duplicates, and writes them in the messages layout (user turn only). Their answers then come from
`confu-train --regenerate` (pass the file with `--data`). No dev or held-out text is used.

    python examples/make_self_prompts.py --count 1200 --out runs/self_prompts.jsonl
    python examples/make_self_prompts.py --openers "Summarize,Extract,Translate" --out runs/reading.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from transformers_confu import load_target

OPENERS = ["", "Write", "Explain", "What", "How", "Why", "Describe", "Translate", "Summarize", "Compare", "Give",
           "Can you", "List", "Imagine", "Extract", "Who", "Rewrite", "Suggest", "Create", "Tell me"]
SENTINEL = "\x00"


def user_prefix(tokenizer) -> str:
    """The chat template's text before a user turn's content (system prompt included, if the template adds one)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    return text[: text.index(SENTINEL)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--count", type=int, default=1200, help="prompts to write")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--openers", type=lambda text: text.split(","), default=OPENERS,
                   help="comma-separated opener words to steer toward kinds of task (default: a broad list; "
                        "an empty item lets the target start freely)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model, tokenizer = load_target(args.target)
    prefix, eos = user_prefix(tokenizer), tokenizer.eos_token_id
    seen, prompts, tries = set(), [], 0
    bar = tqdm(total=args.count, desc="self prompts")
    while len(prompts) < args.count and tries < 20 * args.count:
        opener = rng.choice(args.openers)
        ids = tokenizer(prefix + opener, return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=args.temperature,
                             top_p=args.top_p, max_new_tokens=args.max_new_tokens, num_return_sequences=args.batch_size,
                             pad_token_id=tokenizer.eos_token_id)
        tries += args.batch_size
        for row in out[:, ids.shape[1]:].tolist():
            if eos not in row:
                continue  # cut by max_new_tokens: not a complete request
            text = (opener + tokenizer.decode(row[: row.index(eos)])).strip()
            words = len(text.split())
            if not 4 <= words <= 150 or text.lower() in seen:
                continue
            seen.add(text.lower())
            prompts.append({"messages": [{"role": "user", "content": text}]})
            bar.update(1)
            if len(prompts) == args.count:
                break
    bar.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in prompts)
    print(f"{len(prompts)} prompts from {tries} samples -> {args.out}")


if __name__ == "__main__":
    main()
