"""Coverage of the draft vocabulary against its size: how many of the tokens the target emits a draft vocabulary
of the N most frequent training tokens contains (every uncovered token ends a speculation round).

    python examples/experiments/vocab_coverage.py --data-dir ../shared/data/train --regenerate-dir runs/regen-greedy \
        --dev-answers results/bench_dev_t0_answers/generate.jsonl --out results/vocab_coverage
    python examples/experiments/vocab_coverage.py --data data/smollm2-135m-instruct-answers \
        --dev-answers results/bench_dev_t0_answers/generate.jsonl --out results/vocab_coverage_dataset

The vocabulary is built as `confu-train --regenerate` builds it (`build_draft_vocab` on the conversations answered
so far in the regeneration directory, or on the conversations of `--data` as they are: the target's answers already
in them, as in the answers dataset); coverage is reported on those answers and on the target's greedy answers to
the dev questions (a Spec-Bench answer file of plain `generate`), per category.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from transformers_confu import ConFuDraftModel, load_target
from transformers_confu.training.data import (
    build_draft_vocab,
    tokenize_conversations,
    vocab_coverage,
)
from transformers_confu.training.data_sources import find_sources, load_conversations
from transformers_confu.training.regenerate import regenerate_responses


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", nargs="*", default=[], help="answered conversations (e.g. the answers dataset folder), "
                   "taken as they are; or --data-dir with --regenerate-dir")
    p.add_argument("--data-dir", help="the training conversations (prompts)")
    p.add_argument("--regenerate-dir", help="a regeneration directory (confu-train --regenerate-dir)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--dev-answers", required=True, help="Spec-Bench answer file of plain generate on the dev set")
    p.add_argument("--sizes", default="2048,4096,8192,16384,32768")
    p.add_argument("--drafts", nargs="*", default=[], help="also the coverage of these drafts' own vocabularies")
    p.add_argument("--out", required=True, help="writes OUT.md and OUT.json")
    args = p.parse_args()
    if bool(args.data) == bool(args.data_dir and args.regenerate_dir):
        p.error("give either --data (answered conversations) or both --data-dir and --regenerate-dir")
    model, tokenizer = load_target(args.target)
    if args.data:
        answered = load_conversations(find_sources(data=args.data))
    else:
        conversations = load_conversations(find_sources(data_dir=args.data_dir))
        answered = regenerate_responses(conversations, model, tokenizer, args.regenerate_dir,
                                        max_prompt_tokens=args.max_length - 64, max_minutes=0)  # reads only
    train = tokenize_conversations(answered, tokenizer, max_length=args.max_length)
    dev = defaultdict(list)
    for line in Path(args.dev_answers).read_text().splitlines():
        answer = json.loads(line)
        for turn in answer["choices"][0]["turns"]:
            dev[answer["category"]] += _ids(tokenizer, turn)
    dev_all = np.concatenate([np.array(v) for v in dev.values()])
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        vocab = build_draft_vocab(train, size, len(tokenizer)).numpy()
        row = {"size": size, "train": vocab_coverage(train, torch.from_numpy(vocab)),
               "dev": float(np.isin(dev_all, vocab).mean())}
        row.update({f"dev_{c}": float(np.isin(np.array(v), vocab).mean()) for c, v in sorted(dev.items())})
        rows.append(row)
    for path in args.drafts:
        vocab = ConFuDraftModel.from_pretrained(path).d2t.numpy()
        row = {"size": f"{Path(path).name} ({len(vocab)})", "train": vocab_coverage(train, torch.from_numpy(vocab)),
               "dev": float(np.isin(dev_all, vocab).mean())}
        row.update({f"dev_{c}": float(np.isin(np.array(v), vocab).mean()) for c, v in sorted(dev.items())})
        rows.append(row)
    summary = {"command": "python examples/experiments/vocab_coverage.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()
        if k != "target" and v not in (None, [])),
        "train_answers": len(train), "dev_tokens": int(len(dev_all)), "rows": rows}
    Path(args.out).with_suffix(".json").write_text(json.dumps(summary, indent=2))
    cats = sorted(dev)
    md = [f"# Draft-vocabulary coverage\n\n`{summary['command']}`\n",
          f"Vocabulary = `build_draft_vocab` over {len(train)} answered conversations (the N most frequent answer "
          f"tokens, then prompt tokens); coverage = share of the target's emitted tokens inside it ({len(dev_all)} "
          "dev tokens).\n",
          "| N | train answers | dev (all) | " + " | ".join(cats) + " |", "|---" * (3 + len(cats)) + "|"]
    md += [f"| {r['size']} | {r['train']:.3f} | {r['dev']:.3f} | " + " | ".join(f"{r['dev_' + c]:.3f}" for c in cats) + " |"
           for r in rows]
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
