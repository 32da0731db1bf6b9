"""Does ranking tree nodes by calibrated acceptance, not by the draft's raw probability, pay at T=0?

Greedy verification accepts a drafted token when it is the target's argmax. The draft's top token is accepted
more often than its probability says (its probability 0.15 -> accepted 0.27 of the time), its other tokens about
as often as their probability: raw path probabilities undervalue chains of top tokens against second children,
and the draft's nodes against the suffix candidates, whose scores are calibrated acceptance estimates.

`fit` measures, teacher-forced on answers-dataset rows (not the dev set), the hit rate of the draft's top-4 tokens
by probability bin, TTT depth and rank. `bench` answers the dev first turns with plain `generate` and, per
question and in turn, the shipped assistant as it ranks now and with its top tokens' log-probabilities replaced by
the logs of their fitted hit rates (the pooled rank-0 curve, interpolated; other ranks unchanged), at the trees
given (default: the default hybrid and the draft alone's saved tree), through confu-bench's `run_bench` (methods
interleaved per question, a warm-up call each, every output checked against plain `generate`) and its tables.

    OMP_NUM_THREADS=1 python examples/experiments/draft_calibration.py fit --rows 240 \
        --shards train-00021.parquet train-00074.parquet --out results/draft_calibration_fit.json
    OMP_NUM_THREADS=1 python examples/experiments/draft_calibration.py bench --fit results/draft_calibration_fit.json \
        --out results/draft_calibration_dev
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch

from transformers_confu import ConFuAssistant, ConFuDraftModel, load_target
from transformers_confu.benchmark.bench import Method, _speculative, markdown, run_bench, summarize
from transformers_confu.benchmark.questions import PACKAGED_QUESTIONS, load_questions
from transformers_confu.decoding import tree
from transformers_confu.models.target import DEFAULT_DRAFT, EAGLE3_DRAFT
from transformers_confu.training.data import DataCollatorForDraft
from transformers_confu.training.ttt import target_hidden, ttt_hidden_states, ttt_valid_positions

sys.path.insert(0, str(Path(__file__).parent))
from dev_accuracy import shard_rows  # noqa: E402

EDGES = [0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]
DATASET = "data/smollm2-135m-instruct-answers/data"


@torch.no_grad()
def fit(args) -> None:
    target, tokenizer = load_target()
    draft = ConFuDraftModel.from_pretrained(EAGLE3_DRAFT, dtype=torch.float32)
    draft.attach_target(target)
    rows = shard_rows([f"{DATASET}/{s}" for s in args.shards], tokenizer, args.rows)
    collate, bins = DataCollatorForDraft(pad_token_id=0), len(EDGES) - 1
    trials, hits, mass = (np.zeros((args.depths, 4, bins)) for _ in range(3))
    for start in range(0, len(rows), 8):
        batch = collate(rows[start : start + 8])
        features, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], draft.config.feature_layers)
        for step, hidden in enumerate(ttt_hidden_states(draft, features, batch["input_ids"], batch["attention_mask"],
                                                        args.depths)):
            where = ttt_valid_positions(batch["attention_mask"], batch["loss_mask"], step).nonzero(as_tuple=True)
            greedy = target.lm_head(last[where[0], where[1] + 1 + step]).argmax(-1)
            probs, ids = draft.logits(hidden[where]).float().softmax(-1).topk(4, dim=-1)
            hit = (draft.d2t[ids] == greedy[:, None]).numpy()
            cell = np.digitize(probs.numpy(), EDGES) - 1
            for rank in range(4):
                np.add.at(trials[step, rank], cell[:, rank], 1)
                np.add.at(hits[step, rank], cell[:, rank], hit[:, rank])
                np.add.at(mass[step, rank], cell[:, rank], probs[:, rank].numpy())
    top_trials, top_hits = trials[:, 0].sum(0), hits[:, 0].sum(0)
    seen = top_trials > 0
    record = {"command": " ".join(["python", *sys.argv]), "shards": args.shards, "rows": len(rows),
              "draft": f"src/transformers_confu/checkpoints/{EAGLE3_DRAFT.name}", "edges": EDGES,
              "trials": trials.tolist(), "hits": hits.tolist(),
              "mean_probability": (mass / np.maximum(trials, 1)).tolist(),
              # the pooled rank-0 curve: (mean probability, hit rate) per bin seen, hit rates made non-decreasing
              "curve": [[float(mass[:, 0].sum(0)[i] / top_trials[i]), float(r)] for i, r in
                        zip(np.flatnonzero(seen), np.maximum.accumulate(top_hits[seen] / top_trials[seen]))]}
    Path(args.out).write_text(json.dumps(record, indent=1))
    for step in range(args.depths):
        for rank, name in ((0, "top"), (1, "second")):
            print(f"depth {step} {name}: " + " ".join(
                f"{mass[step, rank, i] / trials[step, rank, i]:.2f}->{hits[step, rank, i] / trials[step, rank, i]:.2f}"
                for i in range(bins) if trials[step, rank, i] >= 50))


def calibrated_pick(curve: list[list[float]]):
    """`tree._pick` with the greedy top child's log-probability replaced by the log of its fitted hit rate."""
    xs, ys = (torch.tensor(c, dtype=torch.float32) for c in zip(*curve))
    pick = tree._pick

    def _pick(logits: torch.Tensor, k: int, temperature: float | None):
        ids, values, q = pick(logits, k, temperature)
        if temperature is None:
            p = values[..., 0].exp().clamp(xs[0], xs[-1])
            i = (torch.searchsorted(xs, p) - 1).clamp(0, len(xs) - 2)
            rate = ys[i] + (ys[i + 1] - ys[i]) * (p - xs[i]) / (xs[i + 1] - xs[i])
            values = torch.cat([rate.log()[..., None], values[..., 1:]], dim=-1)
        return ids, values, q

    return pick, _pick


def bench(args) -> None:
    model, tokenizer = load_target()
    raw, calibrated = calibrated_pick(json.loads(Path(args.fit).read_text())["curve"])

    def ranked(run):
        """`run` with the calibrated ranking in place for the call."""
        def call(ids, n):
            tree._pick = calibrated
            try:
                return run(ids, n)
            finally:
                tree._pick = raw
        return call

    methods = [Method("generate", lambda ids, n: (model.generate(ids, attention_mask=torch.ones_like(ids),
                                                                 max_new_tokens=n, do_sample=False), None))]
    for spec in args.trees:  # hybrid:d,k,n,s or alone:d,k,n
        kind, numbers = spec.split(":")
        d, k, n, *s = map(int, numbers.split(","))
        name = f"{'hybrid' if kind == 'hybrid' else 'draft alone'} d{d}k{k}n{n}" + (f"s{s[0]}" if s else "")
        assistant = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model, depth=d, top_k=k, total_tokens=n,
                                                   **(dict(suffix_nodes=s[0]) if s else dict(suffix=False)))
        run = _speculative(model, assistant, dict(do_sample=False), "saved")
        methods += [Method(f"{name}, raw", run, assistant), Method(f"{name}, calibrated", ranked(run), assistant)]
    questions = [{**q, "turns": q["turns"][:1]} for q in load_questions(per_category=args.per_category)]
    records, mismatches, _ = run_bench(model, tokenizer, methods, questions, args.max_new_tokens, 0, greedy=True)
    table = summarize(records, True, mismatches)
    meta = dict(target="smollm2-135m-instruct", hardware=f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
                questions=len(questions), question_file=PACKAGED_QUESTIONS, max_new_tokens=args.max_new_tokens,
                temperature=0.0, seed=0, command=" ".join(["python", *sys.argv]))
    Path(f"{args.out}.json").write_text(json.dumps(dict(meta=meta, table=table, mismatches=mismatches), indent=1))
    Path(f"{args.out}.md").write_text(markdown(table, meta))
    print(markdown(table, meta))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    f = sub.add_parser("fit")
    f.add_argument("--shards", nargs="+", default=["train-00021.parquet"], help="answers-dataset shards (not 20)")
    f.add_argument("--rows", type=int, default=200)
    f.add_argument("--depths", type=int, default=3, help="TTT depths measured")
    f.add_argument("--out", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--fit", required=True, help="the fit step's JSON")
    b.add_argument("--trees", nargs="+", default=["hybrid:2,2,6,4", "alone:2,2,4"],
                   help="hybrid:DEPTH,TOP_K,NODES,SUFFIX_NODES or alone:DEPTH,TOP_K,NODES (the shipped ConFu folder)")
    b.add_argument("--per-category", type=int, default=2)
    b.add_argument("--max-new-tokens", type=int, default=96)
    b.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args()
    fit(args) if args.step == "fit" else bench(args)


if __name__ == "__main__":
    main()
