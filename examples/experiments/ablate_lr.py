"""The learning rate for continuing a trained draft on new answers, at equal steps on the same rows.

Every variant continues the same draft (`--init-from`) with `confu-train` for the same steps, seed and rows
(the same batches in the same order), differing only in the peak learning rate (warm-up, then cosine to 0).
Each is then scored, with the starting draft, on answers none of them trained on (`--eval-data`, e.g. the
dataset's newest shard when `--train-data` names the older ones): the TTT accuracy against the target's
greedy token over its full vocabulary at each depth, and the paired difference to the first variant with a
95% interval over the evaluation rows. Resumable: finished variants are skipped.

    python examples/experiments/ablate_lr.py --init-from src/transformers_confu/checkpoints/smollm2-135m-instruct-eagle3 \
        --train-data data/smollm2-135m-instruct-answers/data/train-000{00..19}.parquet \
        --eval-data data/smollm2-135m-instruct-answers/data/train-00020.parquet --lrs 2e-4,8e-4 --out results/lr_ablation
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from dev_accuracy import shard_rows  # this folder's teacher-forced scoring script

from transformers_confu import ConFuDraftModel, load_target
from transformers_confu.training.ttt import evaluate_ttt


def train_argv(args: argparse.Namespace, lr: str, out: Path) -> list[str]:
    return ["--output-dir", str(out), "--data", *args.train_data, "--init-from", args.init_from,
            "--ttt-steps", str(args.ttt_steps), "--batch-size", "8", "--max-steps", str(args.steps),
            "--max-length", "768", "--lr", lr, "--warmup-steps", "10", "--save-minutes", "10",
            "--save-dtype", "float32", "--seed", str(args.seed), "--bf16", "--target-dtype", args.target_dtype]


def per_row_scores(draft_dir: str, target, rows: list[dict], steps: int) -> list[dict[str, float]]:
    """`evaluate_ttt` row by row: the paired differences need each row's correct count per depth."""
    draft = ConFuDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    draft.attach_target(target)
    return [evaluate_ttt(draft, target, [row], steps) for row in rows]


def positions(row: dict, depth: int) -> float:
    """The row's trained positions at TTT depth `depth` (those whose predicted token is an answer token)."""
    return float(sum(row["loss_mask"][2 + depth :]))


def summary(scores: list[dict[str, float]], rows: list[dict], steps: int) -> dict[str, float]:
    """Accuracy per depth over all positions (each row weighs by its trained positions)."""
    return {f"full_acc_{i}": sum(s[f"full_acc_{i}"] * positions(r, i) for s, r in zip(scores, rows))
            / sum(positions(r, i) for r in rows) for i in range(steps)}


def paired(a: list[dict], b: list[dict], rows: list[dict], depth: int) -> tuple[float, float]:
    """Mean position-weighted difference b - a at `depth` and its 95% half-width (ratio estimator over rows)."""
    key, weights = f"full_acc_{depth}", [positions(r, depth) for r in rows]
    diffs = [(y[key] - x[key]) * w for x, y, w in zip(a, b, weights)]
    total, n = sum(weights), len(rows)
    mean = sum(diffs) / total
    resid = [d - mean * w for d, w in zip(diffs, weights)]
    se = math.sqrt(sum(r * r for r in resid) / (n - 1) / n) / (total / n)
    return mean, 1.96 * se


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init-from", required=True, help="the draft every variant continues")
    p.add_argument("--train-data", nargs="+", required=True)
    p.add_argument("--eval-data", nargs="+", required=True, help="answers no variant trains on")
    p.add_argument("--eval-rows", type=int, default=128)
    p.add_argument("--lrs", default="2e-4,8e-4", help="peak learning rates; the first is the reference")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--eval-depths", type=int, default=3)
    p.add_argument("--target-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--runs", default="runs/lr_ablation")
    p.add_argument("--out", required=True, help="writes OUT.md and OUT.json")
    args = p.parse_args()
    runs, lrs = Path(args.runs), args.lrs.split(",")
    seconds = {}
    for lr in lrs:
        out = runs / f"lr{lr}"
        record = out / "final" / "training_record.json"
        if not (record.is_file() and json.loads(record.read_text())["finished"]):
            subprocess.run([sys.executable, "-m", "transformers_confu.training.train", *train_argv(args, lr, out)],
                           check=True)
        seconds[lr] = json.loads(record.read_text())["seconds_this_piece"]
    target, tokenizer = load_target()  # scored with the float32 target that decodes
    rows = shard_rows(args.eval_data, tokenizer, args.eval_rows)
    depths = args.eval_depths
    scores = {"start": per_row_scores(args.init_from, target, rows, depths)}
    for lr in lrs:
        scores[lr] = per_row_scores(str(runs / f"lr{lr}" / "final"), target, rows, depths)
    results = {name: summary(s, rows, depths) for name, s in scores.items()}
    for lr in lrs[1:]:
        for i in range(depths):
            results[lr][f"diff_{i}"], results[lr][f"half_width_{i}"] = paired(scores[lrs[0]], scores[lr], rows, i)
    command = "python examples/experiments/ablate_lr.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()
        if k != "runs")
    scored = int(sum(positions(r, 0) for r in rows))
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"command": command, "eval_rows": len(rows), "eval_positions": scored, "train_seconds": seconds,
         "results": results}, indent=2))
    md = [f"# Learning rate for continuing a draft\n\n`{command}`\n",
          f"Each variant continues `{args.init_from}` for {args.steps} steps of 8 rows (the same batches, seed "
          f"{args.seed}, TTT {args.ttt_steps}, 10 warm-up steps, cosine to 0, `--bf16 --target-dtype "
          f"{args.target_dtype}`), then is scored on {len(rows)} rows of `{' '.join(args.eval_data)}` that no "
          f"variant trained on ({scored:,} depth-0 positions, float32 target). `full acc i`: the draft's token equals "
          f"the target's greedy token (full vocabulary) at TTT depth i; `vs {lrs[0]}`: the paired difference, "
          "95% interval over the rows.\n",
          "| draft | " + " | ".join(f"full acc {i}" for i in range(depths)) + " | "
          + " | ".join(f"vs {lrs[0]}, depth {i}" for i in range(depths)) + " | train s |",
          "|---" * (2 + 2 * depths) + "|"]
    for name, r in results.items():
        diffs = [f"{r[f'diff_{i}']:+.4f} +- {r[f'half_width_{i}']:.4f}" if f"diff_{i}" in r else ""
                 for i in range(depths)]
        label = "start (no training)" if name == "start" else f"lr {name}"
        md.append(f"| {label} | " + " | ".join(f"{r[f'full_acc_{i}']:.4f}" for i in range(depths)) + " | "
                  + " | ".join(diffs) + f" | {seconds.get(name, 0):.0f} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
