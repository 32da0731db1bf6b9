"""`confu-train`: train a draft head for a target on chat data, in time-boxed, resumable pieces.

    confu-train --output-dir runs/eagle3 --max-minutes 60           # first piece
    confu-train --output-dir runs/eagle3 --max-minutes 60           # continues from the last checkpoint
    accelerate launch --num_processes 2 -m transformers_confu.training.train ...   # several processes / machines

The final draft is written to `<output-dir>/final` (config + safetensors in `--save-dtype`), loadable with
`ConFuAssistant.from_pretrained`. Checkpoints and `final` are written atomically: a run killed at any instant
resumes from its newest complete checkpoint (newer, incomplete ones are skipped with a warning).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..models.checkpoints import latest_complete_checkpoint
from ..models.configuration_confu import ConFuDraftConfig
from ..models.contemplate import ADAPTER_FOLDER, ContemplateAdapter
from ..models.modeling_confu import ConFuDraftModel
from ..models.target import DEFAULT_TARGET, hub_name, load_target, tokenizer_path
from ..utils.atomic import atomic_dir
from .answers_dataset import dataset_answers
from .data import (
    DataCollatorForDraft,
    build_draft_vocab,
    remap_draft_vocab,
    tokenize_conversations,
    vocab_coverage,
)
from .data_sources import HOW_TO_PASS, find_sources, load_conversations
from .feature_cache import build_feature_cache
from .regenerate import regenerate_responses, regeneration_settings
from .trainer import ConFuTrainer
from .training_args import ConFuTrainingArguments

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="target: the embedded default, a folder or a Hub id")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the target runs (regeneration, features) and the draft trains")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 mixed-precision draft training (autocast; float32 master weights); on CUDA the "
                        "target is also loaded in bfloat16, on a CPU it stays float32 unless --target-dtype says otherwise (faster on CPUs with AVX-512 or "
                        "AMX; slower on AVX2-only ones, which get a warning)")
    p.add_argument("--target-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the target's dtype for regeneration and features; auto: bfloat16 on CUDA with --bf16, else "
                        "float32. bfloat16 on a CPU with AMX runs the target's forward 3-4x faster, training steps 1.7x "
                        "(results/train_target_bf16_amx.md); answers regenerated so are pinned to its own target fingerprint")
    p.add_argument("--output-dir", required=True, help="checkpoints go here; rerun to resume")
    p.add_argument("--data", nargs="+", default=None,
                   help=".jsonl/.json/.parquet files, folders of them, or Hub data set ids (org/name[:split]); chat "
                        "layouts: messages, ShareGPT conversations, instruction/input/output, question/answer")
    p.add_argument("--data-dir", default=None, help="a folder of data files (all of them, or --files among them)")
    p.add_argument("--files", nargs="*", default=None, help="file names inside --data-dir to use")
    p.add_argument("--on-error", choices=["skip", "raise"], default="skip", help="malformed data rows")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--max-samples", type=int, default=None, help="use the first N shuffled conversations")
    p.add_argument("--regenerate", action="store_true",
                   help="train on the target's own answers to the prompts (on-policy; cached and resumable)")
    p.add_argument("--regenerate-dir", default=None, help="where the answers are kept (default <output-dir>/regenerated)")
    p.add_argument("--regenerate-minutes", type=float, default=None,
                   help="time box of the regeneration; train on what is answered by then (rerun to answer more)")
    p.add_argument("--regenerate-only", action="store_true", help="stop after the regeneration")
    p.add_argument("--regenerate-reuse", default=None,
                   help="an answers dataset folder (answers_dataset) made with the same settings: its answers are "
                        "used and not made again")
    p.add_argument("--keep-reference", action="store_true",
                   help="with --regenerate: rows not regenerated yet keep their reference answer (else they are left out)")
    p.add_argument("--regenerate-batch-size", type=int, default=64)
    p.add_argument("--regenerate-max-new-tokens", type=int, default=256)
    p.add_argument("--regenerate-temperature", type=float, default=0.0, help="0: greedy answers")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="the most frequent assistant tokens of the training data (its coverage is logged); "
                        "default 8192 for a fresh draft, the --init-from draft's own size with --recount-vocab")
    p.add_argument("--init-from-target", default="head,norm,fc,layer",
                   help="fresh drafts: parts copied from the target (head, norm, fc, layer; comma-separated) or 'none'")
    p.add_argument("--feature-cache", default=None,
                   help="EAGLE-3: keep the target's features here (built once, resumable); epochs then run the draft only")
    p.add_argument("--feature-cache-minutes", type=float, default=None, help="time box of the feature-cache build")
    p.add_argument("--init-from", default=None, help="start from this draft instead of a random one")
    p.add_argument("--recount-vocab", action="store_true",
                   help="with --init-from: count the draft vocabulary again on the training data (the tokens "
                        "the draft keeps keep their trained head rows; new ones start from the target's)")
    p.add_argument("--contemplate", action="store_true",
                   help="train a ConFu draft (future token, soft prompt, [con] MoE), e.g. from an EAGLE-3 --init-from")
    p.add_argument("--soft-tokens", type=int, default=16, help="ConFu: soft-prompt length")
    p.add_argument("--soft-prompt-init-text", default=None,
                   help="ConFu: start a fresh soft prompt as the target's embeddings of this text's tokens (peft's "
                        "TEXT init), e.g. 'Think about what comes next.'; default: random vocabulary tokens")
    p.add_argument("--con-experts", type=int, default=8, help="ConFu: experts of the [con] and [f] MoE embeddings")
    p.add_argument("--con-top-k", type=int, default=2, help="ConFu: experts mixed per token")
    p.add_argument("--future-bias", type=float, default=2.0, help="ConFu: initial attention bias on the [f] entry")
    p.add_argument("--anchor-ratio", type=float, default=0.1, help="ConFu: fraction of positions that are anchors")
    p.add_argument("--replication-window", type=int, default=4, help="ConFu: positions that reuse an anchor's f")
    p.add_argument("--route-lag", type=int, default=0,
                   help="ConFu: route each [con] by a state up to this many tokens older, as inference routes a "
                   "tree's deeper [con] tokens (e.g. the tree depth - 1; 0: the state just before the anchor)")
    p.add_argument("--future-token-weight", type=float, default=0.0,
                   help="ConFu: weight of an auxiliary loss making each [con] predict, through the target's head, the "
                   "target's token two ahead of its anchor (0: off)")
    p.add_argument("--no-future-entry", action="store_true",
                   help="ConFu: no [f] entry in the draft; f reaches it only through --future-logit-weight (the [con]'s "
                   "own prediction mixed into the first drafted level); needs --future-token-weight > 0")
    p.add_argument("--future-logit-weight", type=float, default=None,
                   help="ConFu: weight of the [con]'s prediction in the first drafted level (saved in the draft config; "
                   "default: the --init-from draft's, else 0, or 0.5 with --no-future-entry)")
    p.add_argument("--adapter-from", default=None,
                   help="ConFu: start the adapter from this ConFu draft folder's contemplate_adapter/ (default: "
                   "--init-from's, if it has one, else a fresh adapter)")
    p.add_argument("--freeze-draft", action="store_true",
                   help="ConFu: train the adapter alone, by the auxiliary [con] loss; the draft is not run or changed")
    p.add_argument("--contemplate-lr-scale", type=float, default=10.0,
                   help="ConFu: learning-rate multiplier of the adapter and [f] MoE (fresh modules)")
    p.add_argument("--ttt-steps", type=int, default=None, help="training-time-test depth (default: the --tree depth + 1)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=-1,
                   help="train exactly this many optimizer steps (overrides --epochs; the data repeats if needed)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--pad-to-multiple-of", type=int, default=16,
                   help="round each batch's padded length up to a multiple of this (16 trains faster on CPU: "
                        "results/train_step_padding.md)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (with a checkpoint) after this long")
    p.add_argument("--save-minutes", type=float, default=10.0, help="checkpoint about this often")
    p.add_argument("--save-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree", default="4,2,6", help="default tree of the saved draft: depth,top_k,total_tokens")
    args = p.parse_args(argv)
    if not (args.data or args.data_dir):
        p.error(f"no training data given: {HOW_TO_PASS}")
    if args.recount_vocab and not args.init_from:
        p.error("--recount-vocab re-counts the vocabulary of an --init-from draft; a fresh draft counts its own.")
    return args


def build_dataset(args: argparse.Namespace, target, tokenizer):
    conversations = load_conversations(find_sources(args.data, args.data_dir, args.files), on_error=args.on_error)
    conversations = conversations.shuffle(seed=args.seed)
    if args.max_samples:
        conversations = conversations.select(range(min(args.max_samples, len(conversations))))
    if args.regenerate:
        answered = None
        if args.regenerate_reuse:
            settings = regeneration_settings(target, args.regenerate_max_new_tokens, args.regenerate_temperature,
                                             seed=args.seed)
            answered = dataset_answers(args.regenerate_reuse, asdict(settings))
        conversations = regenerate_responses(
            conversations, target, tokenizer, args.regenerate_dir or Path(args.output_dir) / "regenerated",
            batch_size=args.regenerate_batch_size, max_new_tokens=args.regenerate_max_new_tokens,
            temperature=args.regenerate_temperature, max_prompt_tokens=args.max_length - 64,
            max_minutes=args.regenerate_minutes, seed=args.seed, keep_unanswered=args.keep_reference,
            answered=answered,
        )
        if args.regenerate_only:
            return None  # the answers are kept in the regeneration folder: nothing to tokenize
    return tokenize_conversations(conversations, tokenizer, max_length=args.max_length)


def build_draft(args: argparse.Namespace, target, dataset) -> tuple[ConFuDraftModel, ContemplateAdapter | None]:
    """The draft to train (fresh or `--init-from`, e.g. ConFu from a trained EAGLE-3 draft) and, for ConFu,
    its adapter (the init draft's own if it has one, else a fresh one)."""
    confu = dict(contemplate=True, future_experts=args.con_experts, future_top_k=args.con_top_k,
                 future_attention_bias=args.future_bias, future_entry=not args.no_future_entry) if args.contemplate else {}
    if args.contemplate and (args.future_logit_weight is not None or args.no_future_entry):
        confu["future_logit_weight"] = 0.5 if args.future_logit_weight is None else args.future_logit_weight
    if args.init_from:
        draft = ConFuDraftModel.from_pretrained(args.init_from, dtype=torch.float32, **confu)
        if args.draft_vocab_size not in (None, draft.config.draft_vocab_size) and not args.recount_vocab:
            raise SystemExit(f"--draft-vocab-size {args.draft_vocab_size}: {args.init_from} has "
                             f"{draft.config.draft_vocab_size} draft tokens; add --recount-vocab to resize it.")
        if args.recount_vocab:
            before = vocab_coverage(dataset, draft.d2t)
            vocab = build_draft_vocab(dataset, args.draft_vocab_size or draft.config.draft_vocab_size,
                                      draft.config.vocab_size)
            added = remap_draft_vocab(draft, vocab, target)
            logger.info("--recount-vocab: %d new draft tokens; coverage of the training answers %.2f%% -> %.2f%%",
                        added, 100 * before, 100 * vocab_coverage(dataset, draft.d2t))
    else:
        depth, top_k, total = (int(x) for x in args.tree.split(","))
        size = args.draft_vocab_size or 8192
        config = ConFuDraftConfig.for_target(target, draft_vocab_size=size, tree_depth=depth,
                                             tree_top_k=top_k, tree_total_tokens=total, **confu)
        draft = ConFuDraftModel(config)
        draft.set_vocab_map(build_draft_vocab(dataset, size, config.vocab_size))
        if args.init_from_target != "none":
            draft.init_from_target(target, tuple(args.init_from_target.split(",")))
    if not draft.config.contemplate:
        return draft, None
    source = args.adapter_from or args.init_from
    if args.adapter_from and not (Path(args.adapter_from) / ADAPTER_FOLDER).is_dir():
        raise SystemExit(f"--adapter-from {args.adapter_from} has no {ADAPTER_FOLDER}/: pass a ConFu draft folder.")
    if source and (Path(source) / ADAPTER_FOLDER).is_dir():
        if args.soft_prompt_init_text is not None:
            raise SystemExit(f"--soft-prompt-init-text starts a fresh soft prompt, but {source} brings its trained "
                             f"{ADAPTER_FOLDER}/: drop one of the two.")
        return draft, ContemplateAdapter.from_pretrained(Path(source) / ADAPTER_FOLDER)
    if draft.config.has_future_entry:
        draft.init_future_from_target(target)
    adapter = ContemplateAdapter.for_target(target, num_soft_tokens=args.soft_tokens, num_experts=args.con_experts,
                                            top_k=args.con_top_k, init_text=args.soft_prompt_init_text,
                                            tokenizer_name_or_path=tokenizer_path(args.target),
                                            base_model_name_or_path=hub_name(args.target))
    return draft, adapter


def estimate_save_steps(args: argparse.Namespace) -> int:
    """Checkpoint every ~`save_minutes`, from a rough CPU rate of 150 training tokens/s."""
    rows_per_minute = 150 * 60 / max(args.max_length / 2, 1)
    return max(10, int(args.save_minutes * rows_per_minute / (args.batch_size * args.grad_accum)))


def cpu_bf16_problem(device: str, flag: str = "--bf16") -> str | None:
    """Why `flag` (a bfloat16 option) would slow training on `device`, or None: a CPU without the AVX-512
    instructions oneDNN's bf16 kernels need (e.g. AVX2 only) runs bf16 matmuls emulated."""
    if torch.device(device).type != "cpu" or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return (f"{flag} on this CPU ({torch.backends.cpu.get_cpu_capability()}, no bf16 instructions for oneDNN): "
            "bf16 matmuls run emulated, autocast 4.2x slower per step than float32 on a 2-core AVX2 EPYC "
            f"(results/train_bf16_avx2.md); leave {flag} out here.")


def resolve_target_dtype(args: argparse.Namespace) -> torch.dtype:
    """`--target-dtype` as a torch dtype; `auto` is bfloat16 on CUDA with `--bf16`, else float32."""
    if args.target_dtype == "auto":
        return torch.bfloat16 if args.bf16 and torch.device(args.device).type != "cpu" else torch.float32
    if args.target_dtype == "bfloat16" and (problem := cpu_bf16_problem(args.device, "--target-dtype bfloat16")):
        logger.warning(problem)
    return getattr(torch, args.target_dtype)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.bf16 and (problem := cpu_bf16_problem(args.device)):
        logger.warning(problem)
    torch.manual_seed(args.seed)
    target_dtype = resolve_target_dtype(args)
    target, tokenizer = load_target(args.target, torch_dtype=target_dtype, device=args.device)
    dataset = build_dataset(args, target, tokenizer)
    if dataset is None:
        return
    if args.ttt_steps is None:
        args.ttt_steps = int(args.tree.split(",")[0]) + 1
    draft, adapter = build_draft(args, target, dataset)
    coverage = vocab_coverage(dataset, draft.d2t)
    logger.info("the draft vocabulary (%d tokens) covers %.2f%% of the training assistant tokens",
                draft.config.draft_vocab_size, 100 * coverage)
    dataset = dataset.add_column("length", [len(ids) for ids in dataset["input_ids"]])
    if args.feature_cache:
        if adapter is not None:
            raise SystemExit("--feature-cache serves EAGLE-3 training; ConFu training runs the target's [con] pass.")
        dataset = build_feature_cache(dataset, target, draft.config.feature_layers, args.feature_cache,
                                      max_minutes=args.feature_cache_minutes)
    training_args = ConFuTrainingArguments(
        output_dir=args.output_dir, ttt_steps=args.ttt_steps, max_minutes=args.max_minutes,
        anchor_ratio=args.anchor_ratio, replication_window=args.replication_window, route_lag=args.route_lag,
        future_token_weight=args.future_token_weight, freeze_draft=args.freeze_draft,
        contemplate_lr_scale=args.contemplate_lr_scale,
        num_train_epochs=args.epochs, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, warmup_steps=args.warmup_steps,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=0.5, weight_decay=0.0, lr_scheduler_type="cosine",
        logging_steps=10, save_strategy="steps", save_steps=estimate_save_steps(args),
        save_total_limit=2, train_sampling_strategy="group_by_length", length_column_name="length", seed=args.seed,
        use_cpu=args.device == "cpu", bf16=args.bf16,
        dataloader_num_workers=0, dataloader_pin_memory=args.device != "cpu", report_to=[], disable_tqdm=False,
    )
    trainer = ConFuTrainer(
        model=draft, target_model=target, args=training_args, adapter=adapter, train_dataset=dataset,
        data_collator=DataCollatorForDraft(tokenizer.pad_token_id or 0, args.pad_to_multiple_of),
    )
    last = latest_complete_checkpoint(args.output_dir)
    start = time.monotonic()
    result = trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        finished = trainer.state.global_step >= trainer.state.max_steps
        save_final(trainer, args, result.metrics, time.monotonic() - start, finished, coverage)
    del trainer
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def save_final(trainer: ConFuTrainer, args: argparse.Namespace, metrics: dict, seconds: float, finished: bool,
               vocab_coverage: float | None = None) -> None:
    """Write the draft in `--save-dtype` to `<output-dir>/final`, with the run's record (and the draft
    vocabulary's coverage of the training answers), atomically: a kill
    leaves the previous `final` (or none), never a partly written one."""
    final = Path(args.output_dir) / "final"
    draft, adapter = trainer.trained_modules(trainer.model)
    with atomic_dir(final) as folder:
        draft.to(getattr(torch, args.save_dtype)).save_pretrained(folder)
        draft.to(torch.float32)
        if adapter is not None:
            adapter.to(getattr(torch, args.save_dtype)).save_to(folder)
            adapter.to(torch.float32)
        history = [log for log in trainer.state.log_history if "loss" in log]
        record = dict(args=vars(args), finished=finished, global_step=trainer.state.global_step,
                      max_steps=trainer.state.max_steps, seconds_this_piece=seconds, metrics=metrics,
                      vocab_coverage=vocab_coverage, last_logs=history[-5:])
        (folder / "training_record.json").write_text(json.dumps(record, indent=2, default=str))
    logger.info("Saved the draft to %s (step %d of %d)", final, trainer.state.global_step, trainer.state.max_steps)


if __name__ == "__main__":
    main()
