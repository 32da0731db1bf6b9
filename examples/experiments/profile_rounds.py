"""Where a round's time goes on a GPU: host syncs per round, and how busy the device is.

`torch.cuda.set_sync_debug_mode("warn")` flags every operation that waits for the GPU: the static loop
should read the device once per round (the accepted tokens). The profiler's total kernel time against the
wall time is the share of the time the GPU computes; the rest is launch and host overhead (the issue's goal:
under 10% of the wall time outside the forward passes). CUDA only: on a CPU there is no device to wait for.

    python examples/experiments/profile_rounds.py --device cuda --out results/profile_rounds_gpu
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from transformers_confu import ConFuAssistant, load_target
from transformers_confu.benchmark.questions import chat_input_ids, load_questions
from transformers_confu.models.target import EAGLE3_DRAFT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=str(EAGLE3_DRAFT))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tree", default="6,4,24")
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", required=True, help="writes OUT.json")
    args = p.parse_args()
    if not (args.device.startswith("cuda") and torch.cuda.is_available()):
        raise SystemExit("profile_rounds.py measures a CUDA device: pass --device cuda on a machine with one.")
    model, tokenizer = load_target(torch_dtype=torch.bfloat16, device=args.device)
    depth, top_k, total = (int(x) for x in args.tree.split(","))
    assistant = ConFuAssistant.from_pretrained(args.draft, target_model=model, depth=depth, top_k=top_k,
                                               total_tokens=total)
    prompts = [chat_input_ids(tokenizer, q["turns"][:1]).to(args.device)
               for q in load_questions(per_category=1)[: args.questions]]
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=assistant,
                   cache_implementation="static")
    model.generate(prompts[0], **options)  # warm-up: compile, allocate
    rounds = tokens = 0
    with warnings.catch_warnings(record=True) as caught:  # syncs, without the profiler's own
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        for ids in prompts:
            model.generate(ids, **options)
            rounds += assistant.stats.target_forwards
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for ids in prompts:
            model.generate(ids, **options)
            tokens += assistant.stats.new_tokens
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    result = dict(device=torch.cuda.get_device_name(), tree=args.tree, rounds=rounds, syncs_per_round=syncs / rounds,
                  wall_seconds=wall, tokens_per_second=tokens / wall, device_busy_seconds=busy,
                  device_busy_share=busy / wall,
                  command="python examples/experiments/profile_rounds.py " + " ".join(
                      f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
