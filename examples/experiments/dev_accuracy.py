"""Teacher-forced accuracy of drafts on the target's own greedy answers to the dev questions.

A cheap stand-in for acceptance: for each draft, the TTT accuracy at depth 0, 1, 2, ... against the target's
greedy token over its full vocabulary, on conversations [dev question, the target's greedy answer] (the
answers a `confu-bench` run wrote for plain `generate`). At T=0 the first drafted token is accepted exactly
when the depth-0 prediction is right, so this predicts tau without decoding, in seconds per draft; it also
separates a weak draft (low accuracy here) from an inference bug (high accuracy here, low tau in the bench).
`--answers` also takes a parquet shard of the answers dataset (`--rows N`: the first N after a seeded
shuffle), e.g. the newest shard, which no draft trained before it was appended has seen.
`--by-confidence` also splits the depth-0 accuracy by the target's own top-1 probability at the predicted
token: how much of the gap is positions where the target itself hesitates.
`--by-source` sorts the depth-0 positions by where the target's token could come from: outside the draft
vocabulary (no draft can propose it), the sequence itself (the two tokens before it occurred together earlier
in prompt + answer, and the last time they were followed by it: a copy, `ttt.copy_positions`), the hybrid's
suffix proposer (the shipped corpus and the sequence, calibrated: its best first token is it), or neither;
and gives the draft's accuracy in each and the share of positions the draft misses but a suffix source has.
`--by-category` (dev answers only) splits it by the dev question's category: where the draft is weak.

    python examples/experiments/dev_accuracy.py --answers results/eagle3_v2_dev_t0_answers/generate.jsonl \
        --drafts src/transformers_confu/checkpoints/smollm2-135m-instruct-eagle3 runs/my-draft/final
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import datasets
import numpy as np
import torch

from transformers_confu import ConFuDraftModel, load_target
from transformers_confu.benchmark.questions import load_questions
from transformers_confu.decoding.suffix import SHIPPED_CORPUS, SuffixProposer, load_proposer
from transformers_confu.training.data import DataCollatorForDraft, tokenize_conversations
from transformers_confu.training.ttt import (
    copy_positions,
    evaluate_ttt,
    target_hidden,
    ttt_hidden_states,
    ttt_valid_positions,
)

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)


def dev_rows(answers: str, tokenizer) -> list[dict]:
    """Tokenized conversations [dev question, answer, ...] from a confu-bench answer file, each with its
    question's `category` (tokenized category by category: tokenizing drops rows with no answer token)."""
    questions = {q["question_id"]: q for q in load_questions()}
    by_category: dict[str, list[dict]] = {}
    for line in Path(answers).read_text().splitlines():
        row = json.loads(line)
        turns, replies = questions[row["question_id"]]["turns"], row["choices"][0]["turns"]
        messages = []
        for question, reply in zip(turns, replies):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        by_category.setdefault(row["category"], []).append({"messages": messages})
    rows = []
    for category, conversations in by_category.items():
        tokenized = tokenize_conversations(datasets.Dataset.from_list(conversations), tokenizer, max_length=2048)
        rows += [dict(tokenized[i], category=category) for i in range(len(tokenized))]
    return rows


def shard_dataset(shard: str | list[str], tokenizer, count: int | None, seed: int = 0) -> datasets.Dataset:
    """Tokenized conversations from parquet shards of the answers dataset: `count` rows (all if None) of a
    seeded shuffle."""
    table = datasets.load_dataset("parquet", data_files=shard, split="train").shuffle(seed=seed)
    table = table.select(range(min(count or len(table), len(table)))).select_columns(["messages"])
    return tokenize_conversations(table, tokenizer, max_length=768)


def shard_rows(shard: str | list[str], tokenizer, count: int | None) -> list[dict]:
    """`shard_dataset` as a list of rows."""
    tokenized = shard_dataset(shard, tokenizer, count)
    return [tokenized[i] for i in range(len(tokenized))]


@torch.no_grad()
def target_passes(target, rows: list[dict], feature_layers: list[int], batch_size: int = 8) -> list[dict]:
    """The target's pass over `rows` in batches, once for all drafts: the batch, its fused features, the scored
    depth-0 positions and the target's top-1 probability and token at the token they predict."""
    collate, passes = DataCollatorForDraft(pad_token_id=0), []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        batch = collate(chunk)
        features, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], feature_layers)
        where = ttt_valid_positions(batch["attention_mask"], batch["loss_mask"], 0).nonzero(as_tuple=True)
        top_p, top_id = target.lm_head(last[where[0], where[1] + 1]).float().softmax(dim=-1).max(dim=-1)
        categories = [chunk[b].get("category") for b in where[0].tolist()]
        passes.append(dict(batch=batch, features=features, where=where, top_p=top_p, top_id=top_id,
                           categories=categories))
    return passes


def depth0_right(draft, p: dict) -> torch.Tensor:
    """(N,) bool: the draft's depth-0 greedy token is the target's at the scored positions of pass `p`."""
    hidden = ttt_hidden_states(draft, p["features"], p["batch"]["input_ids"], p["batch"]["attention_mask"], 1)[0]
    return draft.d2t[draft.logits(hidden[p["where"]]).argmax(dim=-1)] == p["top_id"]


@torch.no_grad()
def accuracy_by_confidence(draft, passes: list[dict]) -> list[dict]:
    """Depth-0 full-vocabulary accuracy of `draft` per bin of the target's top-1 probability (`BINS`)."""
    confidence = torch.cat([p["top_p"] for p in passes])
    correct = torch.cat([depth0_right(draft, p) for p in passes]).float()
    table = []
    for low, high in zip(BINS[:-1], BINS[1:]):
        inside = (confidence >= low) & (confidence < high)
        n = int(inside.sum())
        table.append({"target_top1": f"{low:.1f}-{min(high, 1.0):.1f}", "share": n / len(confidence),
                      "draft_acc": float(correct[inside].mean()) if n else float("nan"), "positions": n})
    return table


@torch.no_grad()
def accuracy_by_category(draft, passes: list[dict], rows: list[dict]) -> list[dict]:
    """Depth-0 full-vocabulary accuracy of `draft` per dev category (in the order categories first occur), with
    the target's mean top-1 probability there and the median prompt length (tokens before the first answer)."""
    categories = [c for p in passes for c in p["categories"]]
    correct = torch.cat([depth0_right(draft, p) for p in passes]).float()
    confidence = torch.cat([p["top_p"] for p in passes])
    table = []
    for category in dict.fromkeys(categories):
        inside = torch.tensor([c == category for c in categories])
        prompts = [row["loss_mask"].index(1) for row in rows if row["category"] == category]
        table.append({"category": category, "share": float(inside.float().mean()), "positions": int(inside.sum()),
                      "draft_acc": float(correct[inside].mean()), "target_top1": float(confidence[inside].mean()),
                      "prompt_tokens": int(np.median(prompts))})
    return table


def best_next(proposer: SuffixProposer, context: np.ndarray) -> int:
    """The proposer's best first continuation token of `context` (-1: no match)."""
    firsts = [(score, path[0]) for path, score in proposer.best_paths(context).items() if len(path) == 1]
    return max(firsts)[1] if firsts else -1


@torch.no_grad()
def accuracy_by_source(draft, passes: list[dict], corpus: SuffixProposer) -> list[dict]:
    """Depth-0 full-vocabulary accuracy of `draft` per source the target's token could come from (see the
    module docstring), with the share of positions a suffix source gets right where the draft does not."""
    kinds, draft_right, suffix_right = [], [], []
    for p in passes:
        ids = p["batch"]["input_ids"]
        draft_right += depth0_right(draft, p).tolist()
        copies = copy_positions(ids, p["batch"]["attention_mask"])[p["where"][0], p["where"][1] + 2].tolist()
        row_of, in_vocab = None, torch.isin(p["top_id"], draft.d2t).tolist()
        columns = (*(x.tolist() for x in p["where"]), p["top_id"].tolist(), in_vocab, copies)
        for b, t, y, drafted, repeats in zip(*columns):
            if row_of != b:  # positions come row by row, in order: the proposer follows one growing context
                row_of, context = b, ids[b].numpy()
                corpus.reset()
            # a copy counts when the copied token is also the target's greedy token there
            copy, from_corpus = repeats and int(ids[b, t + 2]) == y, best_next(corpus, context[: t + 2]) == y
            kinds.append("outside the draft vocabulary" if not drafted else
                         "copy from the sequence" if copy else "suffix proposer" if from_corpus else "neither")
            suffix_right.append(copy or from_corpus)
    table = []
    for kind in ("outside the draft vocabulary", "copy from the sequence", "suffix proposer", "neither"):
        inside = [i for i, k in enumerate(kinds) if k == kind]
        table.append({"source": kind, "share": len(inside) / len(kinds), "positions": len(inside),
                      "draft_acc": float(np.mean([draft_right[i] for i in inside])) if inside else float("nan"),
                      "missed_suffix_right": sum(suffix_right[i] and not draft_right[i] for i in inside) / len(kinds)})
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--answers", required=True,
                   help="a confu-bench answer file of plain generate (generate.jsonl), or a parquet shard of answers")
    p.add_argument("--rows", type=int, default=None, help="with a parquet shard: score this many of its rows")
    p.add_argument("--drafts", nargs="+", required=True)
    p.add_argument("--steps", type=int, default=3, help="TTT depths scored")
    p.add_argument("--by-confidence", action="store_true",
                   help="also split depth-0 accuracy by the target's top-1 probability")
    p.add_argument("--by-source", action="store_true",
                   help="also split depth-0 accuracy by where the target's token could come from")
    p.add_argument("--by-category", action="store_true",
                   help="with dev answers: also split depth-0 accuracy by the dev question's category")
    p.add_argument("--corpus", default=None, help="with --by-source: the suffix corpus folder (default: the shipped one)")
    p.add_argument("--out", default=None, help="also write OUT.json")
    args = p.parse_args()
    if args.by_category and args.answers.endswith(".parquet"):
        p.error("--by-category needs dev answers (a confu-bench generate.jsonl), not a parquet shard")
    target, tokenizer = load_target()
    if args.answers.endswith(".parquet"):
        rows = shard_rows(args.answers, tokenizer, args.rows)
    else:
        rows = dev_rows(args.answers, tokenizer)
    results, passes = {}, {}  # passes: the target's, per feature-layer set
    for path in args.drafts:
        draft = ConFuDraftModel.from_pretrained(path, dtype=torch.float32)
        draft.attach_target(target)
        results[path] = {k: v for k, v in evaluate_ttt(draft, target, rows, args.steps).items() if "full_acc" in k}
        print(path, {k: round(v, 3) for k, v in results[path].items()}, flush=True)
        if args.by_confidence or args.by_source or args.by_category:
            layers = tuple(draft.config.feature_layers)
            passes[layers] = passes.get(layers) or target_passes(target, rows, list(layers))
        if args.by_confidence:
            results[path]["by_confidence"] = accuracy_by_confidence(draft, passes[layers])
            for row in results[path]["by_confidence"]:
                print(f"  target top-1 {row['target_top1']}: {100 * row['share']:.1f}% of positions, "
                      f"draft accuracy {row['draft_acc']:.3f}", flush=True)
        if args.by_category:
            results[path]["by_category"] = accuracy_by_category(draft, passes[layers], rows)
            for row in results[path]["by_category"]:
                print(f"  {row['category']}: {100 * row['share']:.1f}% of positions, draft accuracy "
                      f"{row['draft_acc']:.3f}, target top-1 {row['target_top1']:.3f}, prompt {row['prompt_tokens']} "
                      "tokens", flush=True)
        if args.by_source:
            proposer = load_proposer(args.corpus or SHIPPED_CORPUS, target, tokenizer)
            results[path]["by_source"] = accuracy_by_source(draft, passes[layers], proposer)
            for row in results[path]["by_source"]:
                print(f"  {row['source']}: {100 * row['share']:.1f}% of positions, draft accuracy "
                      f"{row['draft_acc']:.3f}; missed by the draft, right by a suffix source: "
                      f"{100 * row['missed_suffix_right']:.1f}% of positions", flush=True)
    if args.out:
        options = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {' '.join(v) if isinstance(v, list) else v}")
                   for k, v in vars(args).items() if v not in (None, False)]
        command = "python examples/experiments/dev_accuracy.py " + " ".join(options)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=2))


if __name__ == "__main__":
    main()
