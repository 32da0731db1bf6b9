"""Exact greedy tau of suffix drafting without running the target: replay plain `generate`'s answers.

At T=0 a round accepts the deepest tree node whose path is the target's greedy continuation, plus the bonus
token; with a suffix-only tree (SuffixAssistant) the tree depends on the context alone, so replaying the
target's own greedy answers gives tau exactly (up to re-tokenizing the answer text). Per width and source
(sequence only, or with the corpus), per category:

    python examples/experiments/ablate_hybrid_replay.py results/eagle3_v8_dev_t0_trees_answers/generate.jsonl \
        --widths 4,6,8,12,16 --out results/suffix_replay_dev
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from transformers import AutoTokenizer

from transformers_confu.benchmark.questions import DEFAULT_QUESTIONS, chat_input_ids, load_questions
from transformers_confu.decoding.suffix import SHIPPED_CORPUS, SuffixProposer, default_calibration
from transformers_confu.decoding.suffix_index import CorpusIndex
from transformers_confu.models.target import DEFAULT_TARGET, tokenizer_path


def replay(proposer: SuffixProposer, prompt: list[int], answer: list[int]) -> tuple[list[int], float]:
    """Accept lengths of each round over `answer` (greedy), and the lookups' seconds."""
    proposer.reset()
    context, done, lengths = list(prompt) + answer[:1], 1, []  # the first token comes from the prefill
    while done < len(answer):
        found = proposer.candidates(context)
        nodes = list(zip(found.tokens.tolist(), found.parents.tolist()))
        truth = answer[done:]
        on_path, best = {-1: 0}, 0  # node -> depth of the nodes on the true path
        for node, (token, parent) in enumerate(nodes):
            depth = on_path.get(parent, -1)
            if depth >= 0 and depth < len(truth) and truth[depth] == token:
                on_path[node] = depth + 1
                best = max(best, depth + 1)
        step = min(best + 1, len(answer) - done)
        lengths.append(step)
        context += answer[done : done + step]
        done += step
    return lengths, proposer.seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("answers", help="plain generate's Spec-Bench answer file (confu-bench <out>_answers/generate.jsonl)")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--corpus", default=str(SHIPPED_CORPUS))
    p.add_argument("--widths", default="4,6,8,12,16", help="nodes verified per round, root included")
    p.add_argument("--out", default="results/suffix_replay_dev")
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(args.target))
    questions = {q["question_id"]: q for q in load_questions(args.questions)}
    rows = [json.loads(line) for line in Path(args.answers).read_text().splitlines()]
    corpus = CorpusIndex.from_pretrained(args.corpus, tokenizer=tokenizer)
    table, costs = {}, {}
    for width in map(int, args.widths.split(",")):
        for source in ("suffix", "suffix-corpus"):
            proposer = (SuffixProposer(None, default_calibration(), max_nodes=width - 1) if source == "suffix"
                        else SuffixProposer(corpus, max_nodes=width - 1))
            name, groups, seconds = f"{source}:n{width}", defaultdict(list), 0.0
            for row in rows:
                question = questions[row["question_id"]]
                prompt = chat_input_ids(tokenizer, question["turns"][:1])[0].tolist()
                answer = tokenizer(row["choices"][0]["turns"][0], add_special_tokens=False)["input_ids"]
                lengths, spent = replay(proposer, prompt, answer)
                groups[row["category"]] += lengths
                groups["overall"] += lengths
                seconds += spent
            table[name] = {c: sum(v) / len(v) for c, v in groups.items()}
            costs[name] = 1e3 * seconds / len(groups["overall"])
    categories = sorted(c for c in next(iter(table.values())) if c != "overall") + ["overall"]
    lines = ["# Suffix drafting: exact greedy tau by replaying plain generate's dev answers", "",
             f"{len(rows)} answers from `{args.answers}`; corpus `{args.corpus}` (the target's own training answers).",
             "tau counts the bonus token; lookup: wall ms per round of the suffix proposer (this 2-core machine, "
             "heavily shared while measured: about 0.4 ms of CPU time per round with the corpus).", "",
             "Command: `python examples/experiments/ablate_hybrid_replay.py " + " ".join(argv or []) + "`", "",
             "| method | " + " | ".join(categories) + " | lookup ms/round |", "|---" * (len(categories) + 2) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{cells.get(c, 0):.2f}" for c in categories) + f" | {costs[name]:.2f} |"
              for name, cells in table.items()]
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(tau=table, lookup_ms=costs, time=time.time()), indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
