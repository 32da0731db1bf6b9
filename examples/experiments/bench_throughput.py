"""Throughput of the data and training pipeline on this machine, each path measured in the same run.

- regeneration: generated tokens/s of batched greedy decoding with transformers' default cache and with the
  in-place growing cache (`regenerate.py`), same prompts, same batch;
- feature cache: target tokens/s of building it;
- training: tokens/s of `ConFuTrainer` steps with the target in the loop (the old path) and from the feature
  cache (draft only), same rows, same draft, in every `--precisions` setting (`fp32`; `bf16`: bf16 mixed
  precision, `confu-train --bf16`);

each with every `--kernels` setting of the CPU linear layers: `mkl` (PyTorch's `F.linear`) and `onednn`
(`packed_linear`: what `load_target` and `ConFuTrainer` use on a CPU).

    python examples/experiments/bench_throughput.py --data-dir ../shared/data/train --out results/throughput
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from transformers_confu import ConFuDraftConfig, ConFuDraftModel
from transformers_confu.models.target import load_target
from transformers_confu.training.data import (
    DataCollatorForDraft,
    build_draft_vocab,
    prompt_messages,
    render,
    tokenize_conversations,
)
from transformers_confu.training.data_sources import find_sources, load_conversations
from transformers_confu.training.feature_cache import build_feature_cache
from transformers_confu.training.regenerate import RegenerationSettings, generate_answers
from transformers_confu.training.trainer import ConFuTrainer
from transformers_confu.training.training_args import ConFuTrainingArguments
from transformers_confu.utils.packed_linear import packed_kernels


def regeneration(model, tokenizer, conversations, batch: int, new_tokens: int) -> dict:
    prompts = [tokenizer(render(tokenizer, prompt_messages(m), add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"][:256] for m in conversations["messages"][:batch]]
    settings = RegenerationSettings("bench", max_new_tokens=new_tokens)
    out = {}
    for name, growing in (("transformers DynamicCache", False), ("growing cache (ours)", True)):
        start = time.perf_counter()
        if growing:
            lengths = [len(a) for a in generate_answers(model, tokenizer, prompts, settings, seed=0)]
        else:
            pad = tokenizer.pad_token_id
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=pad)[:, width:]
            lengths = [int((row != pad).sum()) for row in gen]
        seconds = time.perf_counter() - start
        out[name] = {"tokens": sum(lengths), "seconds": seconds, "tokens_per_second": sum(lengths) / seconds}
    return out


def training(model, rows, steps: int, vocab: int, ttt_steps: int, cache_dir: Path, precisions: list[str]) -> dict:
    config = ConFuDraftConfig.for_target(model, draft_vocab_size=vocab)
    d2t = build_draft_vocab(rows, vocab, config.vocab_size)
    tokens = sum(len(r) for r in rows["input_ids"])
    out = {}
    start = time.perf_counter()
    cached = build_feature_cache(rows, model, config.feature_layers, cache_dir)
    seconds = time.perf_counter() - start
    out["feature cache build"] = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}
    out["feature cache size GB"] = sum(p.stat().st_size for p in cache_dir.glob("*.arrow")) / 1e9
    paths = (("target in the loop", rows), ("from the feature cache", cached.with_format("torch")))
    for precision, (name, data) in itertools.product(precisions, paths):
        name = name if precision == "fp32" else f"{name}, {precision}"
        torch.manual_seed(0)
        draft = ConFuDraftModel(config)
        draft.set_vocab_map(d2t)
        args = ConFuTrainingArguments(output_dir=str(cache_dir / name.replace(" ", "-")), max_steps=steps,
                                      per_device_train_batch_size=8, save_strategy="no", report_to=[], use_cpu=True,
                                      bf16=precision == "bf16", ttt_steps=ttt_steps, logging_steps=10**6,
                                      disable_tqdm=True)
        trainer = ConFuTrainer(model=draft, target_model=model, args=args, train_dataset=data,
                               data_collator=DataCollatorForDraft(0))
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        out[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--regen-batch", type=int, default=64)
    p.add_argument("--regen-tokens", type=int, default=128)
    p.add_argument("--train-steps", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--kernels", default="mkl,onednn", help="CPU linear kernels to compare: mkl, onednn")
    p.add_argument("--precisions", default="fp32", help="training precisions to compare: fp32, bf16")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model, tokenizer = load_target()
    conversations = load_conversations(find_sources(data_dir=args.data_dir)).shuffle(seed=1)
    rows = tokenize_conversations(conversations.select(range(2 * args.train_steps * 8)), tokenizer)
    rows = rows.select(range(min(len(rows), args.train_steps * 8)))  # tokenizing drops unusable rows
    result = {"command": "python examples/experiments/bench_throughput.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "hardware": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, fp32",
        "regeneration": {}, "training": {}}
    for kernel in args.kernels.split(","):
        with packed_kernels(kernel == "onednn"), tempfile.TemporaryDirectory() as tmp:
            for name, r in regeneration(model, tokenizer, conversations, args.regen_batch, args.regen_tokens).items():
                result["regeneration"][f"{kernel}, {name}"] = r
            for name, r in training(model, rows, args.train_steps, args.vocab, args.ttt_steps, Path(tmp),
                                      args.precisions.split(",")).items():
                result["training"][f"{kernel}, {name}"] = r
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2))
    md = [f"# Throughput on this machine\n\n`{result['command']}`\n\n{result['hardware']}; every row of a table was "
          "measured in the same run.\n", "| path | tokens | seconds | tokens/s |", "|---|---|---|---|"]
    for section in ("regeneration", "training"):
        for name, r in result[section].items():
            if isinstance(r, dict):
                md.append(f"| {section}: {name} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_second']:.0f} |")
    first = args.kernels.split(",")[0]
    md.append(f"\nFeature cache on disk: {result['training'][f'{first}, feature cache size GB']:.3f} GB for "
              f"{result['training'][f'{first}, feature cache build']['tokens']} tokens.")
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
