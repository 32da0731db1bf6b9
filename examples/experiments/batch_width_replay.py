"""Would a per-round tree width pay in batches? A replay of suffix drafting in batches, costed with the measured
verify cost table (no target runs).

At T=0 a suffix-only round accepts the deepest candidate on the target's greedy continuation, plus the bonus
token, and the candidates depend on the context alone: replaying plain `generate`'s answers gives each row's
acceptance exactly (up to re-tokenizing the answer text). Rows of a batch advance in lockstep; a row leaves the
batch when its answer is done. A round's cost is the forward cost of its active rows x its width, read from a
`batch_ceiling.py` result (`verify_seconds[B][width]`, B rounded up to a measured batch size); plain batched
`generate` pays one width-1 step per token of the batch's longest answer. Per-step overheads outside the target
forward are left out on both sides (plain `generate`'s are larger than the loop's).

Width policies: `wN` verifies N nodes per row every round (what `tree_total_tokens=N` does today); `expected`
picks each round the width (1 to the largest N) that maximizes the expected tokens of the round (each row's 1 +
the summed acceptance estimates of its best width-1 candidates, `exp(score)`) per unit of cost; width 1 is a
plain step.

    python examples/experiments/batch_width_replay.py results/eagle3_v8_dev_t0_trees_answers/generate.jsonl \
        --costs results/batch_ceiling.json --out results/batch_width_replay
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from transformers_confu.benchmark.questions import DEFAULT_QUESTIONS, chat_input_ids, load_questions
from transformers_confu.decoding.suffix import SHIPPED_CORPUS, SuffixProposer
from transformers_confu.decoding.suffix_index import CorpusIndex
from transformers_confu.models.target import DEFAULT_TARGET, tokenizer_path


class Row:
    """One prompt's replay: its context so far and the rest of the target's answer."""

    def __init__(self, proposer: SuffixProposer, prompt: list[int], answer: list[int]) -> None:
        self.proposer, self.answer = proposer, answer
        self.context, self.done, self.accepts = list(prompt) + answer[:1], 1, []  # token 1: from the prefill
        proposer.reset()

    def candidates(self) -> list[tuple[int, int, float]]:
        """(token, parent, estimate) of the best candidates, best first (parents before children)."""
        found = self.proposer.candidates(self.context)
        return list(zip(found.tokens.tolist(), found.parents.tolist(), found.scores.exp().tolist()))

    def accept(self, nodes: list[tuple[int, int, float]]) -> None:
        """Accept the deepest node on the true continuation, plus the bonus token."""
        truth, on_path, best = self.answer[self.done:], {-1: 0}, 0
        for node, (token, parent, _) in enumerate(nodes):
            depth = on_path.get(parent, -1)
            if 0 <= depth < len(truth) and truth[depth] == token:
                on_path[node] = depth + 1
                best = max(best, depth + 1)
        step = min(best + 1, len(self.answer) - self.done)
        self.context += self.answer[self.done : self.done + step]
        self.done += step
        self.accepts.append(step)


def cost(costs: dict[int, dict[int, float]], rows: int, width: int) -> float:
    """The measured forward cost for `rows` active rows at `width` (the next measured batch size up)."""
    batch = min((b for b in costs if b >= rows), default=max(costs))
    return costs[batch][width]


def run_batch(proposers: list[SuffixProposer], prompts, answers, policy: str, widths: list[int],
              costs) -> tuple[float, list[list[int]]]:
    """Seconds and each row's accept lengths of one batch under `policy`."""
    rows = [Row(p, prompt, answer) for p, prompt, answer in zip(proposers, prompts, answers)]
    seconds = 0.0
    while True:
        active = [row for row in rows if row.done < len(row.answer)]
        if not active:
            return seconds, [row.accepts for row in rows]
        found = [row.candidates() for row in active]
        if policy == "expected":
            def value(width: int) -> float:
                gain = sum(1 + sum(e for _, _, e in nodes[: width - 1]) for nodes in found)
                return gain / cost(costs, len(active), width)
            width = max(widths, key=value)
        else:
            width = int(policy[1:])
        for row, nodes in zip(active, found):
            row.accept(nodes[: width - 1])
        seconds += cost(costs, len(active), width)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("answers", help="plain generate's Spec-Bench answer file (confu-bench <out>_answers/generate.jsonl)")
    p.add_argument("--costs", required=True, help="a batch_ceiling.py result (.json)")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--corpus", default=str(SHIPPED_CORPUS))
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--policies", default="w2,w4,w8,expected")
    p.add_argument("--out", default="results/batch_width_replay")
    args = p.parse_args(argv)
    measured = json.loads(Path(args.costs).read_text())
    costs = {int(b): {int(w): s for w, s in row.items()} for b, row in measured["verify_seconds"].items()}
    widths = sorted(next(iter(costs.values())))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(args.target))
    questions = {q["question_id"]: q for q in load_questions(args.questions)}
    records = [json.loads(line) for line in Path(args.answers).read_text().splitlines()]
    prompts = [chat_input_ids(tokenizer, questions[r["question_id"]]["turns"][:1])[0].tolist() for r in records]
    answers = [tokenizer(r["choices"][0]["turns"][0], add_special_tokens=False)["input_ids"] for r in records]
    corpus = CorpusIndex.from_pretrained(args.corpus, tokenizer=tokenizer)
    policies = args.policies.split(",")
    table = {}
    for batch in map(int, args.batches.split(",")):
        proposers = [SuffixProposer(corpus, max_nodes=max(widths) - 1) for _ in range(batch)]
        groups = [range(i, i + batch) for i in range(0, len(records) - batch + 1, batch)]
        plain = sum(max(len(answers[i]) for i in g) * cost(costs, batch, 1) for g in groups)
        tokens = sum(len(answers[i]) for g in groups for i in g)
        for policy in policies:
            seconds, accepts = 0.0, []
            for g in groups:
                spent, rows = run_batch(proposers, [prompts[i] for i in g], [answers[i] for i in g], policy, widths,
                                        costs)
                seconds, accepts = seconds + spent, accepts + rows
            flat = [a for row in accepts for a in row]
            table[f"{batch}:{policy}"] = dict(batch=batch, policy=policy, tau=sum(flat) / len(flat),
                                              min_row_tau=min(sum(r) / len(r) for r in accepts if r),
                                              speedup=plain / seconds, tokens=tokens)
    lines = ["# Per-round tree width in batches: a costed replay of suffix drafting (with the corpus)", "",
             f"{len(records)} plain `generate` answers from `{args.answers}`, in batches of consecutive questions; "
             f"verify costs from `{args.costs}` ({measured['hardware']}); corpus `{Path(args.corpus).name}`.",
             "tau: accepted tokens per row and round (bonus included); speed-up: plain batched `generate`'s "
             "modelled time over the policy's (target forwards only).", "",
             f"Command: `python examples/experiments/batch_width_replay.py {' '.join(argv or sys.argv[1:])}`", "",
             "| B | policy | tau | slowest row's tau | modelled speed-up |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['policy']} | {r['tau']:.2f} | {r['min_row_tau']:.2f} | {r['speedup']:.2f}x |"
              for r in table.values()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(rows=table, costs=args.costs, answers=args.answers), indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
