"""Where a draft-training step's time goes, with the target in the loop: the target's forward (features), its
greedy token over the full vocabulary (the `full_acc` metric), the TTT loss's forward and its backward, as
`ConFuTrainer.compute_loss` runs them (bfloat16 autocast for the draft as with `--bf16`, or float32 with `--autocast
none`; oneDNN-packed weights).

Run it on two checkouts of the library with the same arguments to compare them (alternate the runs on a
shared machine):

    PYTHONPATH=<checkout>/src OMP_NUM_THREADS=1 python examples/experiments/train_step_cost.py \
        --data data/smollm2-135m-instruct-answers --label new --out runs/step_cost_new.json
"""

from __future__ import annotations

import argparse
import json
import time

import datasets
import numpy as np
import torch

import transformers_confu
from transformers_confu import ConFuDraftModel, load_target
from transformers_confu.training.data import DataCollatorForDraft, tokenize_conversations
from transformers_confu.training.ttt import target_argmax, target_hidden, teacher_logits, ttt_loss
from transformers_confu.utils.packed_linear import pack_linear_weights

SHIPPED_DRAFT = "src/transformers_confu/checkpoints/smollm2-135m-instruct-eagle3"
PARTS = ("target_forward", "target_greedy", "ttt_forward", "ttt_backward")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="an answers dataset folder (messages column)")
    p.add_argument("--batches", type=int, default=4, help="length-grouped batches timed (after one warm-up)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--target-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--autocast", default="bfloat16", choices=["bfloat16", "none"],
                   help="the draft's mixed precision (none: float32, as confu-train without --bf16)")
    p.add_argument("--draft", default=SHIPPED_DRAFT)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None, help="write the per-part seconds as JSON here")
    args = p.parse_args()
    target, tokenizer = load_target(torch_dtype=getattr(torch, args.target_dtype))
    draft = ConFuDraftModel.from_pretrained(args.draft, dtype=torch.float32)
    draft.attach_target(target)
    pack_linear_weights(draft)
    pack_linear_weights(target)
    rows = datasets.load_dataset(args.data, split="train").shuffle(seed=0).select(range(64 * args.batch_size))
    rows = tokenize_conversations(rows.select_columns(["messages"]), tokenizer, max_length=768)
    order = np.argsort([len(ids) for ids in rows["input_ids"]])  # batches of similar lengths, as training groups them
    picks = np.linspace(0, len(order) - args.batch_size, args.batches + 1).astype(int)
    collate = DataCollatorForDraft(pad_token_id=tokenizer.pad_token_id or 0)
    batches = [collate([rows[int(i)] for i in order[s : s + args.batch_size]]) for s in picks]
    seconds = {part: 0.0 for part in PARTS}
    tokens = 0
    for n, batch in enumerate(batches):
        times = []
        clock = time.perf_counter()

        def lap() -> None:
            nonlocal clock
            now = time.perf_counter()
            times.append(now - clock)
            clock = now

        features, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], draft.config.feature_layers)
        lap()
        target_ids = target_argmax(target, last)
        lap()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bfloat16"):
            loss, _ = ttt_loss(draft, features, teacher_logits(target, last, draft.d2t), batch["input_ids"],
                               batch["loss_mask"], batch["attention_mask"], steps=args.ttt_steps, target_ids=target_ids)
        lap()
        loss.backward()
        lap()
        draft.zero_grad()
        if n > 0:  # the first batch warms oneDNN up
            tokens += batch["input_ids"].numel()
            for part, t in zip(PARTS, times):
                seconds[part] += t
    total = sum(seconds.values())
    result = {"label": args.label, "library": transformers_confu.__file__, "threads": torch.get_num_threads(),
              "target_dtype": args.target_dtype, "autocast": args.autocast,
              "batches": args.batches, "batch_size": args.batch_size,
              "tokens": tokens, "seconds": seconds, "total_seconds": total, "tokens_per_second": tokens / total}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
