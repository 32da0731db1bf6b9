"""Quickstart: SmolLM2-135M-Instruct with the default shipped draft, streamed answers, tau and speed-up.

    python examples/quickstart.py [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import TextStreamer

from transformers_confu import ConFuAssistant, load_target
from transformers_confu.benchmark.questions import chat_input_ids
from transformers_confu.models.hub import describe_con_tokens
from transformers_confu.models.target import DEFAULT_DRAFT

PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_target()
    assistant = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model)
    method = "EAGLE-3" if assistant.adapter is None else "ConFu, [con] tokens per verify pass: " + describe_con_tokens(
        assistant.contemplate_nodes, assistant.draft.config.contemplate_when_greedy)
    budget, suffix = assistant.budget, assistant.suffix
    tree = f"d{budget.depth}k{budget.top_k}n{budget.total_tokens}" + (f"s{suffix.max_nodes}" if suffix else "")
    if suffix:
        method += f"; hybrid: up to {suffix.max_nodes} of the {budget.total_tokens} nodes from suffix drafting"
    print(f"Draft: {DEFAULT_DRAFT.name} ({method}); tree {tree} (depth {budget.depth}, top-k {budget.top_k}, "
          f"{budget.total_tokens} nodes)")
    plain_s = spec_s = 0.0
    new_tokens = accepted = passes = 0
    for prompt in PROMPTS:
        ids = chat_input_ids(tokenizer, [prompt])
        print(f"\n>>> {prompt}\n")
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, assistant_model=assistant, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
        spec_s += time.perf_counter() - start
        start = time.perf_counter()
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False)
        plain_s += time.perf_counter() - start
        stats = assistant.stats
        new_tokens += stats.new_tokens
        accepted += sum(stats.accept_lengths)
        passes += stats.target_forwards
        print(f"[tau {stats.mean_accepted_tokens:.2f}, {stats.new_tokens} tokens, identical to plain generate: "
              f"{torch.equal(out, ref)}]")
    print(f"\nOverall ({DEFAULT_DRAFT.name}, {method}, tree {tree}, greedy): tau {accepted / max(passes, 1):.2f} "
          "tokens per target pass; "
          f"speed-up over plain generate {plain_s / spec_s:.2f}x ({new_tokens / spec_s:.1f} vs "
          f"{new_tokens / plain_s:.1f} tokens/s, same run, this machine).")


if __name__ == "__main__":
    main()
