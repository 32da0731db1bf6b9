"""Regeneration throughput: useful (answer) tokens/s of each way of batching, on the same prompts, in one run.

- `generate:B` (`generate_answers`, the old path): left-padded batches of B prompts of similar length, each
  decoded by `generate` with the in-place growing cache until its longest answer ends;
- `static:B`: the same with transformers' static cache (the CUDA default);
- `refill:B` (`continuous_batching`, the default now): B rows, each refilled with the next prompt as soon as
  its answer ends; `refill:B:P` prefills the prompts in passes of P rows (default 8; before: all B at once),
  `refill:B:P:T` of at most T padded tokens too (`none`: no bound, as before `prefill_passes`; default `auto`);
- the prefill rate (prompt tokens/s of one forward over a batch of B prompts) is the ceiling of any of them.

The prompts are drawn from those a regeneration folder has answered already (`--answers`), so that each way's
answers are also compared with the recorded ones (`same as recorded`: greedy answers that differ only follow
the float rounding of another batch composition).

    OMP_NUM_THREADS=2 python examples/experiments/bench_regeneration.py --prompts ../shared/data/regen/prompts.jsonl \
        --answers ../shared/data/regen/answers --count 128 --ways generate:32 refill:32 refill:64 \
        --out results/regen_throughput
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from transformers_confu.models.target import load_target
from transformers_confu.training.continuous_batching import left_padded, stream_answers
from transformers_confu.training.data import render
from transformers_confu.training.regenerate import (
    RegenerationSettings,
    _batches,
    generate_answers,
    prompt_key,
    read_responses,
    target_fingerprint,
)


def run_way(way: str, model, tokenizer, prompts: list[list[int]], max_new_tokens: int, eos: list[int]):
    """(answers in prompt order, seconds) of one way of batching."""
    name, batch, *passes = way.split(":")
    batch = int(batch)
    start = time.perf_counter()
    if name == "refill":
        rows = int(passes[0]) if passes else 8
        budget = passes[1] if len(passes) > 1 else "auto"
        budget = None if budget == "none" else budget if budget == "auto" else int(budget)
        answers = {i: t for i, t, _ in stream_answers(model, prompts, max_new_tokens, eos, batch_size=batch,
                                                      pad_token_id=tokenizer.pad_token_id, prefill_rows=rows,
                                                      prefill_tokens=budget)}
        answers = [answers[i] for i in range(len(prompts))]
    else:
        settings = RegenerationSettings("bench", max_new_tokens=max_new_tokens)
        answers = [a for b in range(0, len(prompts), batch)
                   for a in generate_answers(model, tokenizer, prompts[b : b + batch], settings, 0, static=name == "static")]
    return answers, time.perf_counter() - start


def add_prompt_arguments(p: argparse.ArgumentParser, count: int) -> None:
    """The arguments that choose the recorded prompts (`recorded_prompts`) and where the results go."""
    p.add_argument("--prompts", required=True, help="a .jsonl of {messages, kind} requests")
    p.add_argument("--answers", required=True, help="a regeneration folder that answered some of them")
    p.add_argument("--count", type=int, default=count)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=704)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")


def recorded_prompts(tokenizer, prompts_file: str, recorded: dict, count: int, max_prompt_tokens: int, seed: int
                     ) -> tuple[list[list[int]], list[dict]]:
    """(token ids, request rows) of `count` shuffled requests of `prompts_file` that `recorded` answered and
    that fit in `max_prompt_tokens`, in the order regeneration takes them."""
    rows = [json.loads(line) for line in Path(prompts_file).read_text(encoding="utf-8").split("\n") if line.strip()]
    rows = [r for r in rows if prompt_key(r["messages"]) in recorded]
    random.Random(seed).shuffle(rows)
    prompts, kept = [], []
    for row in rows:
        ids = tokenizer(render(tokenizer, row["messages"], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
            kept.append(row)
        if len(prompts) == count:
            break
    order = [i for b in _batches(prompts, 32) for i in b]  # as regeneration orders them
    return [prompts[i] for i in order], [kept[i] for i in order]


def prefill_rate(model, prompts: list[list[int]], batch: int) -> dict:
    rows = prompts[:batch]
    ids, mask = left_padded(rows, 0)
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask.long(), logits_to_keep=1)
    seconds = time.perf_counter() - start
    tokens = sum(map(len, rows))
    return {"prompt_tokens": tokens, "padded_tokens": int(ids.numel()), "seconds": seconds,
            "tokens_per_second": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_arguments(p, count=128)
    p.add_argument("--ways", nargs="+", default=["generate:32", "refill:32", "refill:64"])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the target's dtype (the dataset's answers are float32: bfloat16 answers differ from them)")
    args = p.parse_args()
    model, tokenizer = load_target(torch_dtype=getattr(torch, args.dtype))
    recorded = read_responses(Path(args.answers) / "responses.jsonl")
    prompts, kept = recorded_prompts(tokenizer, args.prompts, recorded, args.count, args.max_prompt_tokens, args.seed)
    eos = [model.generation_config.eos_token_id]
    kinds = {}
    for r in kept:
        kinds[r.get("kind", "?")] = kinds.get(r.get("kind", "?"), 0) + 1
    command = f"OMP_NUM_THREADS={torch.get_num_threads()} python examples/experiments/bench_regeneration.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items())
    record = {"command": command, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "threads": torch.get_num_threads(), "dtype": args.dtype, "target": target_fingerprint(model),
              "prompts": len(prompts),
              "prompts_by_kind": kinds,
              "results": {"prefill": prefill_rate(model, prompts, 32)}}
    print("prefill", record["results"]["prefill"], flush=True)
    for way in args.ways:
        answers, seconds = run_way(way, model, tokenizer, prompts, args.max_new_tokens, eos)
        texts = [tokenizer.decode(a, skip_special_tokens=True).strip() for a in answers]
        same = sum(t == recorded[prompt_key(r["messages"])]["response"] for t, r in zip(texts, kept))
        tokens = sum(map(len, answers))
        record["results"][way] = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                                  "same_as_recorded": same}
        print(way, record["results"][way], flush=True)
        write_results(record, args)  # after every way: a run cut short keeps what it measured


def write_results(record: dict, args: argparse.Namespace) -> None:
    results = record["results"]
    Path(args.out + ".json").write_text(json.dumps(record, indent=2))
    setup = (f"{record['machine']}, {record['threads']} threads, {record['dtype']}, greedy, "
             f"{args.max_new_tokens} new tokens; "
             f"{record['prompts']} prompts already answered in {args.answers} "
             f"({record['prompts_by_kind']}); every row measured in the same run.\n")
    lines = [f"# Regeneration throughput\n\n`{record['command']}`\n", setup,
             "| way | answer tokens | seconds | tokens/s | vs generate | same answer as recorded |", "|---|---|---|---|---|---|"]
    base = next((v["tokens_per_second"] for k, v in results.items() if k.startswith("generate")), None)
    for way, r in results.items():
        if way == "prefill":
            continue
        ratio = f"{r['tokens_per_second'] / base:.2f}x" if base else "-"
        lines.append(f"| {way} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_second']:.0f} | {ratio} | "
                     f"{r['same_as_recorded']}/{record['prompts']} |")
    pf = results["prefill"]
    lines.append(f"\nPrefill (the ceiling): {pf['prompt_tokens']} prompt tokens of 32 prompts in {pf['seconds']:.1f} s, "
                 f"{pf['tokens_per_second']:.0f} tokens/s.")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
