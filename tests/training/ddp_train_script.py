"""Run by test_trainer.py under `accelerate launch` with 2 CPU processes: train 3 steps, save,
and write whether every rank ends with the same draft weights (it does only if DDP synced the
gradients of all TTT steps and of the LM head)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import default_data_collator

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # this folder and conftest.py
from test_trainer import tiny_dataset  # noqa: E402
from test_ttt import tiny_draft, tiny_target  # noqa: E402

from transformers_confu.training.trainer import ConFuTrainer  # noqa: E402
from transformers_confu.training.training_args import ConFuTrainingArguments  # noqa: E402


def train_and_compare_ranks(output_dir: str) -> None:
    target = tiny_target()
    args = ConFuTrainingArguments(
        output_dir=output_dir, max_steps=3, per_device_train_batch_size=2, learning_rate=3e-3,
        save_strategy="steps", save_steps=3, logging_steps=1, report_to="none", use_cpu=True, seed=0,
        ttt_steps=3, max_minutes=60,  # never reached, but its per-step broadcast runs on both ranks
    )
    trainer = ConFuTrainer(
        model=tiny_draft(target), target_model=target, args=args,
        train_dataset=tiny_dataset(), data_collator=default_data_collator,
    )
    trainer.train()
    weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    if trainer.is_world_process_zero():
        in_sync = all(torch.equal(gathered[0], w) for w in gathered)
        Path(output_dir, "weights_in_sync").write_text(f"world_size={len(gathered)} in_sync={in_sync}")


def main(output_dir: str) -> None:
    train_and_compare_ranks(output_dir)
    # Free the trainer (its DDP wrapper holds the process group) before destroying the group:
    # here, exiting with the group alive sometimes aborted, and destroying it first sometimes hung.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
