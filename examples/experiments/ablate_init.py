"""Draft initialisation from the target against random init, on the same budget.

Every variant trains a fresh draft with `confu-train` for the same steps on the same rows (one shared feature
cache, so the target runs once), then is scored on held-out rows of the same data: the TTT accuracy against
the target's greedy token over its full vocabulary at each depth (what greedy acceptance sees). Resumable:
finished variants are skipped.

    python examples/experiments/ablate_init.py --data-dir ../shared/data/train --regenerate-dir runs/regen-greedy \
        --rows 192 --eval-rows 48 --out results/init_ablation
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from transformers_confu import ConFuDraftModel
from transformers_confu.models.target import load_target
from transformers_confu.training.train import build_dataset, parse_args
from transformers_confu.training.ttt import evaluate_ttt

VARIANTS = {"random": "none", "head+norm": "head,norm", "head+norm+fc": "head,norm,fc",
            "head+norm+fc+layer": "head,norm,fc,layer"}


def train_argv(args: argparse.Namespace, max_samples: int) -> list[str]:
    return ["--data-dir", args.data_dir, "--regenerate", "--regenerate-dir", args.regenerate_dir, "--keep-reference",
            "--regenerate-minutes", "0", "--max-samples", str(max_samples), "--draft-vocab-size", str(args.vocab),
            "--ttt-steps", str(args.ttt_steps), "--batch-size", "8", "--lr", str(args.lr), "--warmup-steps", "5",
            "--seed", str(args.seed)]


def score(draft_dir: Path, target, rows, steps: int) -> dict[str, float]:
    draft = ConFuDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    draft.attach_target(target)
    return evaluate_ttt(draft, target, rows, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--regenerate-dir", required=True)
    p.add_argument("--rows", type=int, default=192, help="training rows per variant (steps = rows / 8)")
    p.add_argument("--eval-rows", type=int, default=48, help="held-out rows (the next ones of the same shuffle)")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--runs", default="runs/init_ablation")
    p.add_argument("--out", required=True, help="writes OUT.md and OUT.json")
    args = p.parse_args()
    runs = Path(args.runs)
    target, tokenizer = load_target()
    held_out = build_dataset(parse_args(train_argv(args, args.rows + args.eval_rows) + ["--output-dir", str(runs)]),
                             target, tokenizer)
    held_out = held_out.select(range(args.rows, len(held_out)))
    results = {}
    for name in args.variants.split(","):
        out = runs / name
        record = out / "final" / "training_record.json"
        if not (record.is_file() and json.loads(record.read_text())["finished"]):
            subprocess.run([sys.executable, "-m", "transformers_confu.training.train", *train_argv(args, args.rows),
                            "--output-dir", str(out), "--feature-cache", str(runs / "feature-cache"),
                            "--init-from-target", VARIANTS[name]], check=True)
        results[name] = score(out / "final", target, held_out, args.ttt_steps)
        results[name]["train_seconds"] = json.loads(record.read_text())["seconds_this_piece"]
        print(name, results[name], flush=True)
    command = "python examples/experiments/ablate_init.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("runs",))
    Path(args.out).with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=2))
    steps = range(args.ttt_steps)
    md = [f"# Draft init from the target vs random init\n\n`{command}`\n",
          f"Each variant: a fresh draft (vocabulary {args.vocab}), {args.rows // 8} steps of batch 8 on the same rows, "
          f"TTT {args.ttt_steps}, lr {args.lr}; scored on {len(held_out)} held-out rows. `full acc i` = the draft's "
          "token equals the target's greedy token (full vocabulary) at TTT depth i.\n",
          "| init | " + " | ".join(f"full acc {i}" for i in steps) + " | " + " | ".join(f"loss {i}" for i in steps)
          + " |", "|---" * (1 + 2 * args.ttt_steps) + "|"]
    md += [f"| {name} | " + " | ".join(f"{r[f'full_acc_{i}']:.3f}" for i in steps) + " | "
           + " | ".join(f"{r[f'loss_{i}']:.3f}" for i in steps) + " |" for name, r in results.items()]
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
