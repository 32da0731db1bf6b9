"""Training arguments of the draft head: `transformers.TrainingArguments` plus the TTT settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class ConFuTrainingArguments(TrainingArguments):
    """`TrainingArguments` for `ConFuTrainer`.

    Defaults changed from `TrainingArguments`: `remove_unused_columns=False` (the batches carry
    `loss_mask`, which the draft's forward does not take) and `ddp_find_unused_parameters=False`
    (the TTT unroll calls the draft several times and its LM head outside `forward`; DDP's unused
    parameter search fails on that, while plain DDP syncs every gradient correctly).
    """

    ttt_steps: int = field(default=4, metadata={"help": "Number of training-time-test steps the draft is unrolled."})
    ttt_decay: float = field(default=0.8, metadata={"help": "The loss of TTT step i is weighted ttt_decay**i."})
    anchor_ratio: float = field(
        default=0.1, metadata={"help": "ConFu: fraction of positions per sequence given a [con] anchor."}
    )
    replication_window: int = field(
        default=4, metadata={"help": "ConFu: an anchor's future vector is seen by the next this many positions."}
    )
    route_lag: int = field(
        default=0, metadata={"help": "ConFu: route each [con] by a state up to this many tokens older (uniform), "
                             "as inference routes a tree's deeper [con] tokens (0: the state before the anchor)."}
    )
    future_token_weight: float = field(
        default=0.0, metadata={"help": "ConFu: weight of the auxiliary loss that makes each [con] token predict, "
                               "through the target's head, the target's token two ahead of its anchor (0: off)."}
    )
    freeze_draft: bool = field(
        default=False, metadata={"help": "ConFu: train the adapter alone, by the auxiliary [con] loss "
                                 "(future_token_weight > 0): the draft is not run or changed."}
    )
    contemplate_lr_scale: float = field(
        default=10.0, metadata={"help": "ConFu: learning-rate multiplier of the adapter and the [f] MoE."}
    )
    max_minutes: float | None = field(
        default=None,
        metadata={"help": "Save a checkpoint and stop once training has run this many minutes (wall clock)."},
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep the batch columns the model's forward does not name (loss_mask)."}
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "DDP's unused-parameter search; must stay False for the TTT unroll."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps={self.ttt_steps} must be >= 1.")
        if self.ttt_decay <= 0:
            raise ValueError(f"ttt_decay={self.ttt_decay} must be > 0.")
        if not 0 < self.anchor_ratio <= 1:
            raise ValueError(f"anchor_ratio={self.anchor_ratio} must be in (0, 1].")
        if self.contemplate_lr_scale <= 0:
            raise ValueError(f"contemplate_lr_scale={self.contemplate_lr_scale} must be > 0.")
        if self.future_token_weight < 0:
            raise ValueError(f"future_token_weight={self.future_token_weight} must be >= 0.")
        if self.freeze_draft and self.future_token_weight == 0:
            raise ValueError("freeze_draft trains the adapter by the auxiliary [con] loss alone: set "
                             "future_token_weight > 0.")
        if self.route_lag < 0:
            raise ValueError(f"route_lag={self.route_lag} must be >= 0.")
        if self.replication_window < 1:
            raise ValueError(f"replication_window={self.replication_window} must be >= 1.")
        if self.max_minutes is not None and self.max_minutes < 0:
            raise ValueError(f"max_minutes={self.max_minutes} must be >= 0.")
