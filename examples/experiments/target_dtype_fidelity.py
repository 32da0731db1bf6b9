"""What training on a bfloat16 target's features changes: the bfloat16 target against the float32 one on the
same answer rows, at the positions the draft is trained on.

`confu-train --target-dtype bfloat16` runs the target's forward 4x faster on a CPU with AMX, but decoding
runs the float32 target: this measures the gap the draft is trained across (the features' relative error and
cosine, per feature layer; how often the teacher's top-1 token differs), and the forward's time in each dtype.

    python examples/experiments/target_dtype_fidelity.py --data data/smollm2-135m-instruct-answers --rows 64 \
        --out results/train_target_bf16_amx
"""

from __future__ import annotations

import argparse
import json
import time

import datasets
import torch

from transformers_confu import ConFuDraftModel, load_target
from transformers_confu.training.data import DataCollatorForDraft, tokenize_conversations
from transformers_confu.training.ttt import target_hidden, ttt_valid_positions

SHIPPED_DRAFT = "src/transformers_confu/checkpoints/smollm2-135m-instruct-eagle3"


@torch.no_grad()
def passes(target, batches: list[dict], layers: list[int]) -> tuple[list, list, float]:
    """Per batch: the features and top-1 teacher tokens at the trained positions; and the forwards' seconds."""
    features, top1, seconds = [], [], 0.0
    for batch in batches:
        start = time.perf_counter()
        feats, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], layers)
        seconds += time.perf_counter() - start
        where = ttt_valid_positions(batch["attention_mask"], batch["loss_mask"], 0).nonzero(as_tuple=True)
        features.append(feats[where].float())
        top1.append(target.lm_head(last[where[0], where[1] + 1]).argmax(dim=-1))
    return features, top1, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="an answers dataset folder (messages column)")
    p.add_argument("--rows", type=int, default=64, help="the first N rows after a seeded shuffle")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--draft", default=SHIPPED_DRAFT, help="whose feature layers are compared")
    p.add_argument("--out", default=None, help="also write OUT.json")
    args = p.parse_args()
    layers = list(ConFuDraftModel.from_pretrained(args.draft).config.feature_layers)
    rows = datasets.load_dataset(args.data, split="train").shuffle(seed=0).select(range(args.rows))
    results, batches = {}, None
    for dtype in (torch.float32, torch.bfloat16):
        target, tokenizer = load_target(torch_dtype=dtype)
        if batches is None:  # the tokenizer is the same in both dtypes
            tokenized = tokenize_conversations(rows.select_columns(["messages"]), tokenizer, max_length=768)
            collate = DataCollatorForDraft(pad_token_id=tokenizer.pad_token_id or 0)
            batches = [collate([tokenized[i] for i in range(s, min(s + args.batch_size, len(tokenized)))])
                       for s in range(0, len(tokenized), args.batch_size)]
        passes(target, batches[:1], layers)  # warm-up: oneDNN's first call
        results[str(dtype)] = passes(target, batches, layers)
    (f32, top32, s32), (bf16, top16, s16) = results.values()
    f32, bf16, top32, top16 = (torch.cat(x) for x in (f32, bf16, top32, top16))
    hidden = f32.shape[-1] // len(layers)
    per_layer = []
    for i, layer in enumerate(layers):
        a, b = f32[:, i * hidden:(i + 1) * hidden], bf16[:, i * hidden:(i + 1) * hidden]
        per_layer.append(dict(layer=layer, relative_error=float((a - b).norm(dim=-1).div(a.norm(dim=-1)).mean()),
                              cosine=float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())))
    report = dict(rows=args.rows, positions=len(top32), feature_layers=per_layer,
                  top1_disagreement=float((top32 != top16).float().mean()),
                  forward_seconds={"float32": s32, "bfloat16": s16}, speedup=s32 / s16,
                  threads=torch.get_num_threads(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
                  mkldnn_bf16=torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                  command="python examples/experiments/target_dtype_fidelity.py " + " ".join(
                      f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None))
    print(json.dumps(report, indent=2))
    if args.out:
        with open(f"{args.out}.json", "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
