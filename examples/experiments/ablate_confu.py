"""ConFu ablations: which contemplate-adapter settings make the `[con]` help the draft, on the dev set.

The shipped ConFu draft is an EAGLE-3 draft plus a contemplate adapter (soft prompt, `[con]` MoE); the
`[con]`'s own prediction is mixed into the draft's first level (`future_logit_weight`). Every variant trains a
fresh adapter for the same number of steps on the same rows, the draft frozen (`confu-train --freeze-draft`,
the auxiliary `[con]` loss), with one setting changed from the defaults (a second training seed of the
defaults shows the seed-to-seed spread). Each is then scored at the same dev anchors on the target's own
greedy dev answers (`confu_diagnostics.py --per-anchor`): the `[con]` predicting the target's token two ahead
of its anchor, and the draft's first prediction with the `[con]` mixed in at w 0.5, with 95% intervals and
the paired difference to the defaults. The "f off" row is the same draft without the `[con]` (no prior).
Each row also shows what was really trained (steps run, the adapter's shape read back from its files).

Resumable: a finished variant (its `final/` and its scores) is skipped, so rerun the same command after an
interruption. Flags this script does not know go to `confu-train` (the training data):

    python examples/experiments/ablate_confu.py --steps 80 --out results/confu_ablation -- \
        --data runs/self_prompts.jsonl --regenerate --regenerate-dir runs/regen-greedy --regenerate-minutes 0
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

from transformers_confu.models.target import EAGLE3_DRAFT

HERE = Path(__file__).resolve().parent
DEFAULTS = dict(con_experts=8, con_top_k=2, soft_tokens=16, anchor_ratio=0.5, contemplate_lr_scale=10.0)
VARIANTS: dict[str, dict] = {
    "defaults": {},
    "defaults, training seed +1": dict(seed_offset=1),
    "no MoE (1 expert)": dict(con_experts=1, con_top_k=1),
    "4 experts, top-1": dict(con_experts=4, con_top_k=1),
    "16 experts, top-2": dict(con_experts=16, con_top_k=2),
    "soft prompt 4": dict(soft_tokens=4),
    "soft prompt 32": dict(soft_tokens=32),
    "anchors 10%": dict(anchor_ratio=0.1),
    "adapter lr x3 (scale 30)": dict(contemplate_lr_scale=30.0),
    "adapter lr /3 (scale 3.3)": dict(contemplate_lr_scale=3.3),
    "soft prompt from text": dict(soft_prompt_init_text="Think ahead: the next words of the answer are"),
}
MIX = "mix_w0.5"


def slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name).split())


def train(name: str, args: argparse.Namespace, train_args: list[str]) -> Path:
    """Train one variant's adapter (skipped if its finished final draft exists); returns the final folder."""
    out = Path(args.runs) / slug(name)
    record = out / "final" / "training_record.json"
    if record.is_file() and json.loads(record.read_text())["finished"]:
        return out / "final"
    settings = {**DEFAULTS, **VARIANTS[name]}
    seed = args.seed + settings.pop("seed_offset", 0)
    command = [sys.executable, "-m", "transformers_confu.training.train", "--init-from", args.draft, "--output-dir", str(out),
               "--contemplate", "--no-future-entry", "--freeze-draft", "--future-token-weight", "1",
               "--future-logit-weight", "0.5", "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--lr", str(args.lr), "--warmup-steps", "5", "--max-length", str(args.max_length),
               "--seed", str(seed), "--save-minutes", "5", *train_args]
    command += [x for key, value in settings.items() for x in (f"--{key.replace('_', '-')}", str(value))]
    subprocess.run(command, check=True)
    return out / "final"


def score(name: str, adapter: Path | None, args: argparse.Namespace) -> dict:
    """`confu_diagnostics.py --per-anchor` of the variant's adapter on the draft (cached beside the run)."""
    out = Path(args.runs) / "scores" / slug(name)
    if not out.with_suffix(".json").is_file():
        subprocess.run([sys.executable, str(HERE / "confu_diagnostics.py"), "--draft", args.draft, "--adapter",
                        str(adapter), "--answers", args.answers, "--anchor-ratio", str(args.eval_anchor_ratio),
                        "--seed", "0", "--per-anchor", "--out", str(out)], check=True)
    return json.loads(out.with_suffix(".json").read_text())


def interval(bits: str) -> tuple[float, float]:
    """Mean of a 0/1 string and the half-width of its 95% interval."""
    n, mean = len(bits), bits.count("1") / len(bits)
    return mean, 1.96 * math.sqrt(mean * (1 - mean) / n)


def paired(bits: str, reference: str) -> tuple[float, float]:
    """Mean paired difference of two 0/1 strings over the same anchors and its 95% half-width."""
    d = [int(a) - int(b) for a, b in zip(bits, reference, strict=True)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
    return mean, 1.96 * math.sqrt(var / len(d))


def trained(path: Path) -> dict:
    """What really ran: steps, seconds, the last logged `[con]` accuracy and the saved adapter's shape."""
    record = json.loads((path / "training_record.json").read_text())
    adapter = json.loads((path / "contemplate_adapter" / "config.json").read_text())
    peft = json.loads((path / "contemplate_adapter" / "adapter_config.json").read_text())
    return dict(steps=record["global_step"], seconds=record["seconds_this_piece"],
                train_con_acc=(record["last_logs"] or [{}])[-1].get("future_token_acc"),
                anchor_ratio=record["args"]["anchor_ratio"], lr_scale=record["args"]["contemplate_lr_scale"],
                seed=record["args"]["seed"], experts=adapter.get("num_experts"), top_k=adapter.get("top_k"),
                soft_tokens=peft["num_virtual_tokens"], soft_init=peft["prompt_tuning_init"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--steps", type=int, default=80, help="training steps per variant")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4, help="base learning rate (the adapter's is x its lr scale)")
    p.add_argument("--max-length", type=int, default=384)
    p.add_argument("--seed", type=int, default=11, help="training seed (the rows and their order)")
    p.add_argument("--draft", default=str(EAGLE3_DRAFT), help="the frozen EAGLE-3 draft the adapters go with")
    p.add_argument("--answers", default="results/eagle3_v2_dev_t0_answers/generate.jsonl",
                   help="a confu-bench answer file of plain generate on the dev questions")
    p.add_argument("--eval-anchor-ratio", type=float, default=0.5, help="share of dev answer positions scored")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), help="subset of: " + ", ".join(VARIANTS))
    p.add_argument("--runs", default="runs/ablation-prior")
    p.add_argument("--out", default="results/confu_ablation")
    args, train_args = p.parse_known_args(argv)
    train_args = [a for a in train_args if a != "--"]
    if "defaults" not in args.variants:
        p.error("the variants are compared with 'defaults': keep it in --variants")
    rows = []
    for name in args.variants:
        path = train(name, args, train_args)
        rows.append(dict(variant=name, changed=VARIANTS[name], **trained(path), **score(name, path, args)))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).with_suffix(".json").write_text(json.dumps(dict(args=vars(args), train_args=train_args,
                                                                       rows=rows), indent=2))
    write_table(rows, args, train_args, argv if argv is not None else sys.argv[1:])


def write_table(rows: list[dict], args: argparse.Namespace, train_args: list[str], argv: list[str]) -> None:
    base = next(r for r in rows if r["variant"] == "defaults")["per_anchor"]
    off, off_ci = interval(base["draft"])
    lines = [
        "# ConFu ablations on the dev set: the contemplate adapter as a first-level prior", "",
        f"Each variant: a fresh adapter trained {args.steps} steps (batch {args.batch_size}, max length "
        f"{args.max_length}, base lr {args.lr}, seed {args.seed} unless stated), draft `{args.draft}` frozen, by the "
        f"auxiliary `[con]` loss; defaults {DEFAULTS}. Scored at the same {len(base['draft'])} anchors ({args.eval_anchor_ratio:.0%} "
        f"of the answer positions, seed 0) of the target's greedy dev answers `{args.answers}`.", "",
        f"Command: `python examples/experiments/ablate_confu.py {shlex.join(argv)}`", "",
        "- `[con]` acc: the `[con]`, read through the target's head, names the target's token two ahead of its anchor.",
        "- first-token acc: the draft's first prediction at the anchor with the `[con]` mixed in at w 0.5 "
        "(`log q + 0.5 log p_con`); at T=0 its gain over f off is the first level's gain in acceptance.",
        "- vs defaults: paired difference over the same anchors. +- are 95% intervals over the anchors "
        "(the seed row shows the training-seed spread).", "",
        "| variant | steps | experts / top-k / soft tokens / anchors / lr scale / init | train `[con]` acc (last log) "
        "| `[con]` acc | first-token acc | vs defaults |",
        "|---|---|---|---|---|---|---|",
        "| f off (the draft alone) | - | - | - | - | {:.3f} +- {:.3f} | {:+.3f} +- {:.3f} |".format(
            off, off_ci, *paired(base["draft"], base[MIX])),
    ]
    for r in rows:
        con, con_ci = interval(r["per_anchor"]["con"])
        mix, mix_ci = interval(r["per_anchor"][MIX])
        delta, delta_ci = paired(r["per_anchor"][MIX], base[MIX])
        shape = (f"{r['experts']} / {r['top_k']} / {r['soft_tokens']} / {r['anchor_ratio']:.0%} / "
                 f"{r['lr_scale']:g} / {r['soft_init']}" + (f", seed {r['seed']}" if r["seed"] != args.seed else ""))
        train_acc = f"{r['train_con_acc']:.3f}" if r["train_con_acc"] is not None else "-"
        lines.append(f"| {r['variant']} | {r['steps']} | {shape} | {train_acc} | {con:.3f} +- {con_ci:.3f} "
                     f"| {mix:.3f} +- {mix_ci:.3f} | {delta:+.3f} +- {delta_ci:.3f} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
