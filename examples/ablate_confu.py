"""ConFu ablations: which of its unknown settings help, measured on the dev set.

Every variant continues the shipped EAGLE-3 draft for the same number of steps on the same data (an
EAGLE-3 control included), then answers the dev questions greedily; the table reports the mean accepted
tokens per target pass (tau) and the last training logs. Runs are resumable: a finished variant (its
`final/` folder and its evaluation file) is skipped, so rerun the same command after an interruption.

    python examples/ablate_confu.py --steps 40 --out results/confu_ablation
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from transformers_confu import ConFuAssistant
from transformers_confu.questions import (
    DEFAULT_QUESTIONS,
    chat_input_ids,
    load_questions,
)
from transformers_confu.target import EAGLE3_DRAFT, load_target

DEFAULTS = dict(con_experts=8, con_top_k=2, soft_tokens=16, anchor_ratio=0.1, replication_window=4, future_bias=2.0)
VARIANTS: dict[str, dict | None] = {
    "eagle3-control": None,  # the same extra steps without ConFu
    "confu-default": {},
    "no-moe (1 expert)": dict(con_experts=1, con_top_k=1),
    "no-replication (window 1)": dict(replication_window=1),
    "experts 4, top-1": dict(con_experts=4, con_top_k=1),
    "experts 16, top-2": dict(con_experts=16, con_top_k=2),
    "soft prompt 4": dict(soft_tokens=4),
    "soft prompt 32": dict(soft_tokens=32),
    "anchors 5%": dict(anchor_ratio=0.05),
    "anchors 25%": dict(anchor_ratio=0.25),
    "window 8": dict(replication_window=8),
    "no [f] attention bias (init 0)": dict(future_bias=0.0),
    "[f] attention bias init 4": dict(future_bias=4.0),
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


def train(name: str, settings: dict | None, args: argparse.Namespace) -> Path:
    """Train one variant (skipped if its final draft exists); returns the final draft's folder."""
    out = Path(args.runs) / slug(name)
    if (out / "final" / "training_record.json").is_file() and json.loads(
            (out / "final" / "training_record.json").read_text())["finished"]:
        return out / "final"
    command = [sys.executable, "-m", "transformers_confu.train", "--init-from", str(EAGLE3_DRAFT),
               "--data", *args.data, "--output-dir", str(out), "--max-samples", str(args.steps * args.batch_size),
               "--seed", str(args.seed), "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--warmup-steps", "5", "--save-minutes", "3"]
    if settings is not None:
        merged = {**DEFAULTS, **settings}
        command += ["--contemplate"] + [x for k, v in merged.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    subprocess.run(command, check=True)
    return out / "final"


def tau(assistant: ConFuAssistant, model, tokenizer, questions: list[dict], max_new_tokens: int, **kwargs) -> float:
    """Mean accepted tokens per target pass over the first turns of `questions` (greedy)."""
    accepted = passes = 0
    for question in tqdm(questions, desc="eval", leave=False):
        model.generate(chat_input_ids(tokenizer, question["turns"][:1]), max_new_tokens=max_new_tokens,
                       do_sample=False, assistant_model=assistant, **kwargs)
        accepted += sum(assistant.stats.accept_lengths)
        passes += len(assistant.stats.accept_lengths)
    return accepted / passes


def evaluate(path: Path, model, tokenizer, questions: list[dict], max_new_tokens: int) -> dict:
    """Dev-set tau of the draft, and for ConFu also without its future token (is f used?); cached."""
    cache = path / "dev_eval.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    assistant = ConFuAssistant.from_pretrained(path, target_model=model)
    result = dict(tau=tau(assistant, model, tokenizer, questions, max_new_tokens),
                  tree=[assistant.budget.depth, assistant.budget.top_k, assistant.budget.total_tokens])
    if assistant.adapter is not None:
        result["tau_without_f"] = tau(assistant, model, tokenizer, questions, max_new_tokens, contemplate_nodes=0)
        result["future_bias"] = float(assistant.draft.future_bias)
    cache.write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="training steps per variant")
    p.add_argument("--data", nargs="+", default=["../shared/data/train"],
                   help="training data for confu-train --data (default: the workspace's data, from the repository root)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=2, help="data shuffle of the ablation runs")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--eval-questions", type=int, default=None, help="score on the first N dev questions (default all)")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), help="subset of: " + ", ".join(VARIANTS))
    p.add_argument("--runs", default="runs/ablation")
    p.add_argument("--out", default="results/confu_ablation")
    args = p.parse_args(argv)
    questions = load_questions(DEFAULT_QUESTIONS, args.eval_questions)
    rows = []
    model, tokenizer = load_target()
    for name in args.variants:
        path = train(name, VARIANTS[name], args)
        torch.manual_seed(0)
        result = evaluate(path, model, tokenizer, questions, args.max_new_tokens)
        logs = json.loads((path / "training_record.json").read_text())["last_logs"]
        acc = sum(log.get("ttt_acc_0", 0) for log in logs) / max(len(logs), 1)
        rows.append(dict(variant=name, settings=VARIANTS[name], ttt_acc_0=acc, **result))
        Path(args.out).with_suffix(".json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=2))
    control = next((r["tau"] for r in rows if r["variant"] == "eagle3-control"), None)
    tree = "d{}k{}n{}".format(*rows[0]["tree"]) if rows else "as saved"
    lines = ["# ConFu ablations on the dev set", "",
             f"Each variant continues the shipped EAGLE-3 draft for {args.steps} steps (batch {args.batch_size}, "
             f"lr {args.lr}, data seed {args.seed}); greedy, first turns of {len(questions)} dev questions, "
             f"{args.max_new_tokens} new tokens, tree {tree}. Defaults: {DEFAULTS}.", "",
             f"Command: `python examples/ablate_confu.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             "tau without f: the same ConFu draft run with `contemplate_nodes=0` (no `[con]`, no `[f]`): "
             "how much the future vector itself adds.", "",
             "| variant | tau | vs EAGLE-3 control | tau without f | TTT step-0 accuracy (last logs) |",
             "|---|---|---|---|---|"]
    for row in rows:
        delta = f"{row['tau'] / control:.3f}x" if control else "n/a"
        without = f"{row['tau_without_f']:.3f}" if "tau_without_f" in row else "-"
        lines.append(f"| {row['variant']} | {row['tau']:.3f} | {delta} | {without} | {row['ttt_acc_0']:.3f} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
