"""Where continuous batching's work goes: counts (not times) of one regeneration run, so any machine, loaded or
not, gives the same table.

Wraps the target's forward and counts, over the decode steps, the rows decoded (each makes a token, whether its
row still answers or waits for a refill), the attention cells computed (rows x the batch's shared cache width)
against those some row's mask keeps, and, over the prefills of refilled rows, the padded and real prompt
tokens. The prompts are those of `bench_regeneration.py` with the same arguments, in the order regeneration takes them.

    OMP_NUM_THREADS=1 python examples/experiments/regen_occupancy.py --prompts ../shared/data/regen/prompts.jsonl \
        --answers ../shared/data/regen/answers --count 256 --batch-size 64 --out results/regen_occupancy
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# this script's folder is on sys.path when it runs
from bench_regeneration import add_prompt_arguments, recorded_prompts

from transformers_confu.models.target import load_target
from transformers_confu.training.continuous_batching import stream_answers
from transformers_confu.training.regenerate import read_responses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_arguments(p, count=256)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    model, tokenizer = load_target()
    recorded = read_responses(Path(args.answers) / "responses.jsonl")
    prompts, _ = recorded_prompts(tokenizer, args.prompts, recorded, args.count, args.max_prompt_tokens, args.seed)
    counts = {name: 0 for name in ("decode_steps", "row_steps", "attention_cells", "attended_cells", "prefills",
                                   "prefill_padded_tokens", "prefill_prompt_tokens")}
    forward = model.forward

    def counting_forward(*a, **kw):
        ids, mask = kw["input_ids"], kw["attention_mask"]
        if ids.shape[1] == 1:
            counts["decode_steps"] += 1
            counts["row_steps"] += ids.shape[0]
            counts["attention_cells"] += mask.numel()
            counts["attended_cells"] += int(mask.sum())
        else:
            counts["prefills"] += 1
            counts["prefill_padded_tokens"] += ids.numel()
            counts["prefill_prompt_tokens"] += int(mask.sum())
        return forward(*a, **kw)

    model.forward = counting_forward
    answers = {i: len(t) for i, t, _ in stream_answers(model, prompts, args.max_new_tokens,
                                                       [model.generation_config.eos_token_id],
                                                       batch_size=args.batch_size, pad_token_id=tokenizer.pad_token_id)}
    counts["answer_tokens"] = sum(answers.values())
    counts["prompts"] = len(prompts)
    command = "python examples/experiments/regen_occupancy.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    Path(args.out + ".json").write_text(json.dumps({"command": command, **counts}, indent=2))
    c = counts
    decoded = c["answer_tokens"] - c["prompts"]  # each answer's first token comes from its prompt's prefill
    lines = [
        "# Continuous batching: where the work goes (counts, not times)", "", f"`{command}`", "",
        f"{c['prompts']} recorded prompts, {c['answer_tokens']} answer tokens, {args.batch_size} rows.", "",
        "| count | value |", "|---|---|",
        f"| decode steps | {c['decode_steps']} |",
        f"| rows decoded (row-steps) | {c['row_steps']} |",
        f"| of them answer tokens | {decoded} ({decoded / c['row_steps']:.0%}) |",
        f"| attention cells computed (rows x shared width) | {c['attention_cells']} |",
        f"| of them inside a row's mask (rows waiting for a refill included) | {c['attended_cells']} ({c['attended_cells'] / c['attention_cells']:.0%}) |",
        f"| mean cache width | {c['attention_cells'] / c['row_steps']:.0f} |",
        f"| prefills (the first rows and the refills) | {c['prefills']} |",
        f"| prefill tokens, padded / prompt | {c['prefill_padded_tokens']} / {c['prefill_prompt_tokens']} |",
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
