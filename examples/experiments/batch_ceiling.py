"""The batched loop's ceiling on this machine, with the real target (issue #24).

(a) What a verify pass costs as the batch grows: one target forward over B rows x `width` new tokens (tree-pass
    style: a 4-D mask, hidden states, every node's logits) on a cache of `--context` tokens, against a B-row
    one-token step. At batch B a round of width w pays only if the slowest row's tau exceeds that ratio.
(b) The batched loop with an ORACLE drafter (each row proposes the target's own greedy continuation as a chain)
    against plain batched `generate`, interleaved per batch, outputs checked identical: what speculation can
    give at each batch size on this CPU when every drafted token is accepted.

    OMP_NUM_THREADS=1 python examples/experiments/batch_ceiling.py --out results/batch_ceiling
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from transformers_confu import load_target
from transformers_confu.benchmark.batch_bench import left_padded
from transformers_confu.benchmark.questions import chat_input_ids, load_questions
from transformers_confu.decoding.batched import BatchStats, RowDrafters, batched_generate
from transformers_confu.decoding.oracle import OracleDrafter
from transformers_confu.utils.cache import cache_kwargs, growing_cache, truncate_cache
from transformers_confu.utils.masks import to_additive

FEATURE_LAYERS = [2, 15, 27]  # the shipped draft's; the oracle ignores the features


def verify_costs(model, context: int, batches: list[int], widths: list[int], repeats: int) -> dict:
    """{batch: {width: fastest seconds}} of one forward over `width` chained tokens per row after `context`
    cached ones; the configurations are interleaved repetition by repetition, so that a busy spell of the
    machine hits all of them (the fastest of the repetitions: the least disturbed)."""
    ids = torch.randint(100, 20000, (max(batches), context + max(widths)), generator=torch.Generator().manual_seed(0))
    caches = {}
    with torch.no_grad():
        for batch in batches:
            caches[batch] = growing_cache(model.config, max(widths))
            model(ids[:batch, :context], use_cache=True, **cache_kwargs(model, caches[batch]))
        times = {(b, w): [] for b in batches for w in widths}
        for _ in tqdm(range(repeats), desc="verify cost"):
            for batch, width in times:
                allowed = torch.ones(width, context + width, dtype=torch.bool)
                allowed[:, context:] = torch.ones(width, width, dtype=torch.bool).tril()
                mask = to_additive(allowed, model.dtype).expand(batch, 1, width, context + width)
                positions = torch.arange(context, context + width).expand(batch, width)
                start = time.perf_counter()
                model(ids[:batch, context : context + width], position_ids=positions, attention_mask=mask,
                      use_cache=True, output_hidden_states=True, logits_to_keep=width,
                      **cache_kwargs(model, caches[batch]))
                times[batch, width].append(time.perf_counter() - start)
                truncate_cache(caches[batch], context)
    return {b: {w: min(times[b, w]) for w in widths} for b in batches}


def oracle_batches(model, tokenizer, prompts: list[torch.LongTensor], batch: int, depths: list[int],
                   max_new_tokens: int) -> list[dict]:
    """Plain batched `generate` vs the batched loop with an oracle chain of each depth, batch by batch."""
    pad = tokenizer.pad_token_id
    config = GenerationConfig(do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad,
                              max_new_tokens=max_new_tokens)
    rows = {0: dict(method="generate", seconds=0.0, tokens=0, rounds=0, accepted=0, passes=0)}
    rows.update({d: dict(method=f"oracle chain d{d}", seconds=0.0, tokens=0, rounds=0, accepted=0, passes=0)
                 for d in depths})
    for first in tqdm(range(0, len(prompts) - batch + 1, batch), desc=f"oracle, batch {batch}"):
        ids, mask = left_padded(prompts[first : first + batch], pad)
        start = time.perf_counter()
        reference = model.generate(ids, attention_mask=mask, generation_config=config)
        rows[0]["seconds"] += time.perf_counter() - start
        pads = (mask == 0).sum(1).tolist()
        for depth in depths:
            drafter = RowDrafters([OracleDrafter(reference[row, pads[row]:], depth, depth + 1, model.config.vocab_size)
                                   for row in range(batch)])
            stats = BatchStats()
            out = batched_generate(model, drafter, FEATURE_LAYERS, ids, mask, config, max_new_tokens, stats, tokenizer)
            assert torch.equal(out, reference), "the batched loop is not lossless"
            row = rows[depth]
            row["seconds"] += stats.total_seconds
            row["tokens"] += stats.new_tokens
            row["rounds"] += max(len(accepts) for accepts in stats.row_accept_lengths)
            row["accepted"] += sum(stats.accept_lengths)
            row["passes"] += len(stats.accept_lengths)
        rows[0]["tokens"] += stats.new_tokens  # the same real tokens: the outputs are identical
    base = rows[0]["tokens"] / rows[0]["seconds"]
    for row in rows.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["speedup"] = row["tokens_per_s"] / base
        row["tau"] = row.pop("accepted") / row.pop("passes") if row["rounds"] else 1.0
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/batch_ceiling", help="output path without extension")
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--widths", default="1,2,3,4,6,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--questions", type=int, default=8, help="dev first turns (one per category, in order)")
    parser.add_argument("--depths", default="1,2,3", help="oracle chain depths")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_target()
    batches = [int(b) for b in args.batches.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    costs = verify_costs(model, args.context, batches, widths, args.repeats)
    questions = load_questions(per_category=1, limit=args.questions)
    prompts = [chat_input_ids(tokenizer, q["turns"][:1])[0] for q in questions]
    oracle = {b: oracle_batches(model, tokenizer, prompts, b, depths, args.max_new_tokens) for b in batches if b > 1}
    result = dict(hardware=f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, CPU",
                  target="SmolLM2-135M-Instruct (fp32, sdpa, oneDNN packed linear layers)", context=args.context,
                  questions=len(prompts), max_new_tokens=args.max_new_tokens, verify_seconds=costs, oracle=oracle,
                  command="python examples/experiments/batch_ceiling.py " + " ".join(sys.argv[1:]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [f"# Batched loop ceiling: {result['target']}, {result['hardware']}", "",
             f"## Verify cost vs batch and width (cache of {args.context} tokens, fastest of {args.repeats}, "
             "interleaved)", "",
             "ms for one forward over B rows x width tokens, and in brackets x the B-row one-token step: the tau "
             "the slowest row needs for a round of that width to break even (before the draft's own cost).", "",
             "| B | " + " | ".join(f"width {w}" for w in widths) + " |", "|---|" + "---|" * len(widths)]
    for b in batches:
        lines.append(f"| {b} | " + " | ".join(f"{1000 * costs[b][w]:.1f} ({costs[b][w] / costs[b][widths[0]]:.2f}x)"
                                              for w in widths) + " |")
    lines += ["", f"## Oracle chains in the batched loop vs plain batched generate ({len(prompts)} dev first turns, "
              f"{args.max_new_tokens} new tokens, greedy, outputs checked identical)", "",
              "tau: mean accepted tokens per row and round; rounds: summed over batches, each batch lasting as long "
              "as its slowest row.", "",
              "| B | method | tau | rounds | tokens/s | speed-up |", "|---|---|---|---|---|---|"]
    for b, methods in oracle.items():
        for row in methods:
            rounds = row["rounds"] or "-"
            lines.append(f"| {b} | {row['method']} | {row['tau']:.2f} | {rounds} | {row['tokens_per_s']:.1f} | "
                         f"{row['speedup']:.2f}x |")
    lines += ["", f"Command: `OMP_NUM_THREADS=1 {result['command']}`", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
