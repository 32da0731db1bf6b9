"""`ConFuTrainer`: trains the draft head with the EAGLE-3 TTT loss against a frozen target."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
from accelerate.utils import broadcast
from safetensors.torch import load_file
from torch import nn
from transformers import (
    DynamicCache,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import SAFE_WEIGHTS_NAME

from ..models.checkpoints import checkpoint_problem, latest_complete_checkpoint
from ..models.configuration_confu import ConFuDraftConfig
from ..models.contemplate import ADAPTER_FOLDER, ContemplateAdapter
from ..models.modeling_confu import ConFuDraftModel
from ..utils.atomic import publish_dir
from ..utils.packed_linear import pack_linear_weights
from .anchors import contemplate_future, future_token_loss
from .training_args import ConFuTrainingArguments
from .ttt import target_argmax, target_hidden, teacher_logits, ttt_loss

STAGING_FOLDER = ".checkpoint-staging"  # hidden: transformers' checkpoint globs and rotation never see it


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


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """A `LengthGroupedSampler` whose order depends only on `seed` and the epoch, not on the global RNG when
    the epoch starts, so that a run resumed in the middle of any epoch skips exactly the batches it trained."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int) -> None:
        super().__init__(batch_size, lengths=lengths)
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator = torch.Generator().manual_seed(self.seed + epoch)


class DraftWithAdapter(nn.Module):
    """ConFu's trained modules as one (DDP-wrappable) module: the draft head, whose forward this is,
    and the target-side `ContemplateAdapter`."""

    def __init__(self, draft: ConFuDraftModel, adapter: ContemplateAdapter) -> None:
        super().__init__()
        self.draft, self.adapter = draft, adapter

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.draft(*args, **kwargs)


class ConFuTrainer(Trainer):
    """A `Trainer` whose model is the draft head and whose loss is the TTT loss against `target_model`.

    The draft (a `ConFuDraftModel`) is the only trained and saved module: checkpoints hold its
    `config.json` and `model.safetensors`, which `ConFuDraftModel.from_pretrained` reads. The
    target is frozen, put in eval mode and on the training device, and never saved. Batches carry
    `input_ids`, `loss_mask` and `attention_mask` (B, T), right-padded. Training logs add
    `ttt_acc_i`, the accuracy of TTT step i since the last log within the draft vocabulary, and
    `ttt_full_acc_i`, the same against the target's greedy token over its full vocabulary (what greedy
    acceptance sees). Batches that carry cached target outputs (`feature_cache.py`: `features`,
    `last_hidden`, `target_ids`) train the draft without running the target.

    ConFu (`adapter` given, draft built with `contemplate=True`): the soft prompt and `[con]` MoE are
    trained jointly with the draft through `[con]` tokens after sampled anchors (`anchors.py`), by the
    draft's loss through its `[f]` entry (if it has one) and the auxiliary `[con]` loss
    (`future_token_weight`); with `freeze_draft` by the auxiliary loss alone, the draft neither run nor
    changed. Checkpoints then also hold `contemplate_adapter/`.

    On a CPU the draft's and the target's linear layers run on oneDNN (`packed_linear`), about twice
    MKL's speed on AMD CPUs; parameters and checkpoints are unchanged.

    Checkpoints are written atomically (a kill while saving leaves the earlier ones intact), and
    `resume_from_checkpoint=True` resumes from the newest complete one.
    """

    def __init__(
        self,
        model: ConFuDraftModel,
        target_model: PreTrainedModel,
        args: ConFuTrainingArguments,
        adapter: ContemplateAdapter | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, ConFuTrainingArguments):
            raise TypeError(f"ConFuTrainer needs ConFuTrainingArguments, got {type(args).__name__}.")
        if (adapter is not None) != model.config.contemplate:
            raise ValueError("A ConFu draft (contemplate=True) trains with a ContemplateAdapter and an EAGLE-3 "
                             "draft without one: pass `adapter=` exactly when the draft contemplates.")
        if adapter is not None:
            adapter.check_target(target_model)
            if not (model.config.has_future_entry or args.future_token_weight > 0):
                raise ValueError("This ConFu draft has no [f] entry (future_entry=False): only the auxiliary [con] "
                                 "loss trains its adapter; set future_token_weight > 0.")
        if args.freeze_draft:
            if adapter is None:
                raise ValueError("freeze_draft trains a ConFu adapter alone: pass `adapter=` and a ConFu draft.")
            model.requires_grad_(False)
        super().__init__(model=model if adapter is None else DraftWithAdapter(model, adapter), args=args, **kwargs)
        self.target_model = target_model.requires_grad_(False).eval().to(self.args.device)
        model.attach_target(self.target_model)
        if self.args.device.type == "cpu":  # oneDNN linear layers, in the forward and backward passes
            pack_linear_weights(self.model)
            pack_linear_weights(self.target_model)
        self.loss_is_scaled_for_ga = False  # ttt_loss is a per-batch mean
        self._ttt_correct = torch.zeros(args.ttt_steps, device=self.args.device)
        self._ttt_full_correct = torch.zeros(args.ttt_steps, device=self.args.device)
        self._ttt_count = torch.zeros(args.ttt_steps, device=self.args.device)
        self._future_hits = torch.zeros(2, device=self.args.device)  # ConFu auxiliary loss: (correct, count)
        self._staging_dir: str | None = None
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
        draft, adapter = self.trained_modules(model)
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        if "features" in inputs:  # from the feature cache: the target does not run
            if adapter is not None:
                raise ValueError("ConFu training runs the target's [con] pass: train it without a feature cache.")
            features, last_hidden, target_ids = inputs["features"], inputs["last_hidden"], inputs["target_ids"]
        else:
            cache = None if adapter is None else DynamicCache(config=self.target_model.config)
            features, last_hidden = target_hidden(
                self.target_model, input_ids, attention_mask, draft.config.feature_layers, cache
            )
            target_ids = target_argmax(self.target_model, last_hidden)
        future = None
        if adapter is not None:
            future = contemplate_future(
                self.target_model, adapter, cache, features, attention_mask, inputs["loss_mask"],
                draft.config.feature_layers, self.args.anchor_ratio, self.args.replication_window,
                self.args.route_lag,
            )
        if self.args.freeze_draft:
            loss, metrics = torch.zeros((), device=input_ids.device), {}
        else:
            loss, metrics = ttt_loss(
                model, features, teacher_logits(self.target_model, last_hidden, draft.d2t), input_ids,
                inputs["loss_mask"], attention_mask, steps=self.args.ttt_steps, decay=self.args.ttt_decay,
                future=future if draft.config.has_future_entry else None, target_ids=target_ids,
            )
        if future is not None and self.args.future_token_weight > 0:
            aux, accuracy, count = future_token_loss(self.target_model, future, target_ids, attention_mask, draft.d2t)
            loss = loss + self.args.future_token_weight * aux
            metrics.update(future_token_acc=accuracy, future_token_count=count)
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
            full = self.accelerator.reduce(self._ttt_full_correct, reduction="sum")
            count = self.accelerator.reduce(self._ttt_count, reduction="sum")
            for step, (c, f, n) in enumerate(zip(correct.tolist(), full.tolist(), count.tolist())):
                if n > 0:
                    logs[f"ttt_acc_{step}"] = c / n
                    logs[f"ttt_full_acc_{step}"] = f / n
            if self.args.future_token_weight > 0:
                correct, count = self.accelerator.reduce(self._future_hits, reduction="sum").tolist()
                if count > 0:
                    logs["future_token_acc"] = correct / count
            for buffer in (self._ttt_correct, self._ttt_full_correct, self._ttt_count, self._future_hits):
                buffer.zero_()
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """`Trainer.train`, first checking that a checkpoint to resume is complete and was trained for this
        target; `True` resumes from the newest complete checkpoint (skipping, with a warning, newer ones cut
        by a kill or a full disk)."""
        if resume_from_checkpoint is True:
            # With no checkpoint found, `Trainer.train` raises its own error for `True`.
            resume_from_checkpoint = latest_complete_checkpoint(self.args.output_dir) or True
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            problem = checkpoint_problem(resume_from_checkpoint)
            if problem is not None:
                raise ValueError(f"Cannot resume from {resume_from_checkpoint}: {problem}. Resume from an earlier "
                                 "checkpoint, or pass resume_from_checkpoint=True for the newest complete one.")
            self._check_checkpoint_target(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def trained_modules(self, model: nn.Module | None = None) -> tuple[ConFuDraftModel, ContemplateAdapter | None]:
        """The draft and (ConFu) the adapter inside `model` (default: the trained model), unwrapped."""
        unwrapped = self.accelerator.unwrap_model(model or self.model)
        if isinstance(unwrapped, DraftWithAdapter):
            return unwrapped.draft, unwrapped.adapter
        return unwrapped, None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """`Trainer`'s optimizer; ConFu's fresh modules (adapter, `[f]` MoE) learn `contemplate_lr_scale` times
        faster than the pretrained draft (prompt tuning needs a large learning rate)."""
        optimizer = super().create_optimizer(model)
        draft, adapter = self.trained_modules()
        scale = self.args.contemplate_lr_scale
        if adapter is None or scale == 1:
            return optimizer
        entry = [*draft.future_moe.parameters(), draft.future_bias] if draft.config.has_future_entry else []
        fresh = {id(p) for p in [*adapter.parameters(), *entry]}
        for group in list(optimizer.param_groups):
            moved = [p for p in group["params"] if id(p) in fresh]
            group["params"] = [p for p in group["params"] if id(p) not in fresh]
            if moved:
                settings = {k: v for k, v in group.items() if k != "params"}
                optimizer.add_param_group({**settings, "params": moved, "lr": group["lr"] * scale})
        return optimizer

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the draft; a ConFu draft's adapter goes to `<output_dir>/contemplate_adapter/` beside it."""
        draft, adapter = self.trained_modules(self.model)
        if adapter is None:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir or self.args.output_dir
        draft.save_pretrained(output_dir)
        adapter.save_to(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler | None:
        """`Trainer`'s sampler; `group_by_length` batches in an order set by the seed and the epoch alone."""
        sampler = super()._get_train_sampler(train_dataset)
        if isinstance(sampler, LengthGroupedSampler):
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return EpochSeededLengthGroupedSampler(sampler.batch_size, sampler.lengths, seed)
        return sampler

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """`Trainer._save_checkpoint`, made atomic: every process writes into a hidden staging folder, which is
        renamed to `checkpoint-N` once complete; only then are old checkpoints rotated out. A kill at any
        instant leaves every earlier checkpoint as it was."""
        run_dir = self._get_output_dir(trial)
        staging = os.path.join(run_dir, STAGING_FOLDER)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a kill while saving
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            staged, final = os.path.join(staging, name), os.path.join(run_dir, name)
            if self.state.best_model_checkpoint == staged:  # this step is the best so far
                self.state.best_model_checkpoint = final
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
            publish_dir(staged, final)
            os.rmdir(staging)
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

    def _get_output_dir(self, trial: Any) -> str:
        """The run folder; while `_save_checkpoint` runs, its staging folder."""
        return self._staging_dir or super()._get_output_dir(trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        draft, adapter = self.trained_modules(model or self.model)
        if adapter is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        draft.load_state_dict(load_file(os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_NAME)), strict=True)
        saved = ContemplateAdapter.from_pretrained(os.path.join(resume_from_checkpoint, ADAPTER_FOLDER))
        adapter.load_state_dict(saved.state_dict(), strict=True)

    def _check_checkpoint_target(self, checkpoint: str | os.PathLike) -> None:
        """Raise a `ValueError` if the draft in `checkpoint` was built for another target."""
        try:
            ConFuDraftConfig.from_pretrained(checkpoint).check_target(self.target_model)
        except ValueError as error:
            raise ValueError(f"Cannot resume from {checkpoint}: {error}") from error

    def _accumulate_accuracy(self, metrics: dict[str, torch.Tensor]) -> None:
        if "future_token_count" in metrics:
            count = metrics["future_token_count"]
            self._future_hits += torch.stack([metrics["future_token_acc"] * count, self._future_hits.new_tensor(count)])
        if "count_0" not in metrics:  # a frozen draft: no TTT loss, no TTT metrics
            return
        for step in range(self.args.ttt_steps):
            count = metrics[f"count_{step}"]
            self._ttt_correct[step] += metrics[f"acc_{step}"] * count
            self._ttt_full_correct[step] += metrics[f"full_acc_{step}"] * count
            self._ttt_count[step] += count
