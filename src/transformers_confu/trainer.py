"""`ConFuTrainer`: trains the draft head with the EAGLE-3 TTT loss against a frozen target."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from accelerate.utils import broadcast
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from .configuration_confu import ConFuDraftConfig
from .modeling_confu import ConFuDraftModel
from .training_args import ConFuTrainingArguments
from .ttt import target_features_and_logits, ttt_loss


class MaxMinutesCallback(TrainerCallback):
    """Save a checkpoint and stop training once `max_minutes` of wall clock have passed.

    The clock of process 0 decides for all processes, so they stop at the same step.
    """

    def __init__(self, max_minutes: float) -> None:
        self.max_seconds = max_minutes * 60
        self.start = time.monotonic()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        self.start = time.monotonic()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        elapsed = broadcast(torch.tensor([time.monotonic() - self.start], device=args.device), from_process=0)
        if elapsed.item() >= self.max_seconds:
            control.should_save = True
            control.should_training_stop = True
        return control


class ConFuTrainer(Trainer):
    """A `Trainer` whose model is the draft head and whose loss is the TTT loss against `target_model`.

    The draft (a `ConFuDraftModel`) is the only trained and saved module: checkpoints hold its
    `config.json` and `model.safetensors`, which `ConFuDraftModel.from_pretrained` reads. The
    target is frozen, put in eval mode and on the training device, and never saved. Batches carry
    `input_ids`, `loss_mask` and `attention_mask` (B, T), right-padded. Training logs add
    `ttt_acc_i`, the accuracy of TTT step i since the last log.
    """

    def __init__(
        self,
        model: ConFuDraftModel,
        target_model: PreTrainedModel,
        args: ConFuTrainingArguments,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, ConFuTrainingArguments):
            raise TypeError(f"ConFuTrainer needs ConFuTrainingArguments, got {type(args).__name__}.")
        super().__init__(model=model, args=args, **kwargs)
        self.target_model = target_model.requires_grad_(False).eval().to(self.args.device)
        model.attach_target(self.target_model)
        self.loss_is_scaled_for_ga = False  # ttt_loss is a per-batch mean
        self._ttt_correct = torch.zeros(args.ttt_steps, device=self.args.device)
        self._ttt_count = torch.zeros(args.ttt_steps, device=self.args.device)
        if args.max_minutes is not None:
            self.add_callback(MaxMinutesCallback(args.max_minutes))

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The TTT loss of one batch; `return_outputs` adds the per-step metrics."""
        draft: ConFuDraftModel = self.accelerator.unwrap_model(model)
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        features, target_logits = target_features_and_logits(
            self.target_model, input_ids, attention_mask, draft.config.feature_layers, draft.d2t
        )
        loss, metrics = ttt_loss(
            model, features, target_logits, input_ids, inputs["loss_mask"], attention_mask,
            steps=self.args.ttt_steps, decay=self.args.ttt_decay,
        )
        if model.training:
            self._accumulate_accuracy(metrics)
        return (loss, metrics) if return_outputs else loss

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor, None, None]:
        """Evaluation: the TTT loss only (the draft has no labels or logits to gather)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the per-step TTT accuracies (summed over processes) to the training logs."""
        if "loss" in logs:  # a training log: every process gets here at the same step
            correct = self.accelerator.reduce(self._ttt_correct, reduction="sum")
            count = self.accelerator.reduce(self._ttt_count, reduction="sum")
            for step, (c, n) in enumerate(zip(correct.tolist(), count.tolist())):
                if n > 0:
                    logs[f"ttt_acc_{step}"] = c / n
            self._ttt_correct.zero_()
            self._ttt_count.zero_()
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """`Trainer.train`, first checking that a checkpoint to resume was trained for this target."""
        if resume_from_checkpoint is True:
            # With no checkpoint found, `Trainer.train` raises its own error for `True`.
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            self._check_checkpoint_target(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _check_checkpoint_target(self, checkpoint: str | os.PathLike) -> None:
        """Raise a `ValueError` if the draft in `checkpoint` was built for another target."""
        try:
            ConFuDraftConfig.from_pretrained(checkpoint).check_target(self.target_model)
        except ValueError as error:
            raise ValueError(f"Cannot resume from {checkpoint}: {error}") from error

    def _accumulate_accuracy(self, metrics: dict[str, torch.Tensor]) -> None:
        for step in range(self.args.ttt_steps):
            count = metrics[f"count_{step}"]
            self._ttt_correct[step] += metrics[f"acc_{step}"] * count
            self._ttt_count[step] += count
