"""Configuration of the ConFu / EAGLE-3 draft head."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

# Fields copied from the target's config into the draft's decoder-layer config.
_LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "attention_bias",
    "mlp_bias",
)


class ConFuDraftConfig(PretrainedConfig):
    """Config of a one-layer draft head for a given target model.

    The draft's decoder layer is one layer of the target's own family (`target_model_type`), built
    from `layer_config`. `contemplate=False` is plain EAGLE-3; `True` switches on ConFu's future token.

    Args:
        target_model_type: `model_type` of the target (`"llama"`, `"qwen2"`, ...).
        target_architecture: class name of the target (`"LlamaForCausalLM"`), checked on attach.
        hidden_size: the target's hidden size H.
        vocab_size: the target's vocabulary size.
        draft_vocab_size: size of the draft's reduced vocabulary (its LM head).
        feature_layers: indices into the target's `hidden_states` fused into the draft's input.
        target_num_layers: number of decoder layers of the target.
        layer_config: the target-family config fields for the draft's decoder layer.
        contemplate: ConFu mode (future token) if true, plain EAGLE-3 if false.
        future_experts, future_top_k: the `[f]` token's mixture-of-experts embedding (ConFu only).
        future_attention_bias: initial value of the learned attention-logit bias on the `[f]` key (ConFu only):
            a draft trained without `[f]` barely attends to a new entry, so it starts with a head start.
        contemplate_nodes: ConFu inference: the number of tree nodes given a `[con]` token in the verify
            pass (the most likely ends of the accepted path); None gives every node one, 0 none (the draft then
            runs as EAGLE-3, without its future token).
        future_entry: ConFu: f enters the draft as the `[f]` attention entry (the paper's path). False: f
            reaches the draft only through `future_logit_weight` (no `[f]` MoE or bias is built; the draft
            itself runs, and trains, as EAGLE-3).
        future_logit_weight: ConFu inference: w >= 0. The `[con]` of the last accepted node, read through the
            target's own output head, predicts the same token as the draft's first level (with one token less
            of context); the first level drafts from `log q + w * log p_con` over the draft vocabulary. 0: off.
            Only a `[con]` renewed in the last verify pass is mixed in.
        contemplate_when_greedy: ConFu inference: send `[con]` tokens in greedy decoding too. False: greedy calls
            run without them (as `contemplate_nodes=0`; sampling calls keep them) unless the call or the
            assistant sets `contemplate_nodes`. For hardware where the extra verify-pass token costs more than
            the prior gains at T=0 (on a 2-core CPU the shipped drafts measured +1.4-2% tau there at 1-2% fewer
            tokens/s, and +5-7% tau at 2-3% more tokens/s at T=0.7).
        tree_depth, tree_top_k, tree_total_tokens: default EAGLE-2 dynamic-tree budget.
        norm_output: the final norm before the LM head (EAGLE-3). False: the head reads the layer's output as it
            is (SpecForge's Eagle3.1 option `norm_output: false`; the `norm` weights are kept but unused).
    """

    model_type = "confu_draft"

    def __init__(
        self,
        target_model_type: str = "llama",
        target_architecture: str = "LlamaForCausalLM",
        hidden_size: int = 64,
        vocab_size: int = 256,
        draft_vocab_size: int | None = None,
        feature_layers: list[int] | None = None,
        target_num_layers: int = 4,
        layer_config: dict[str, Any] | None = None,
        contemplate: bool = False,
        future_experts: int = 8,
        future_top_k: int = 2,
        future_attention_bias: float = 2.0,
        contemplate_nodes: int | None = None,
        future_entry: bool = True,
        future_logit_weight: float = 0.0,
        contemplate_when_greedy: bool = True,
        tree_depth: int = 4,
        tree_top_k: int = 4,
        tree_total_tokens: int = 16,
        norm_output: bool = True,
        **kwargs: Any,
    ) -> None:
        self.target_model_type = target_model_type
        self.target_architecture = target_architecture
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size or vocab_size
        self.target_num_layers = target_num_layers
        self.feature_layers = list(feature_layers or default_feature_layers(target_num_layers))
        self.layer_config = dict(layer_config or {})
        self.contemplate = contemplate
        self.future_experts = future_experts
        self.future_top_k = future_top_k
        self.future_attention_bias = future_attention_bias
        self.contemplate_nodes = contemplate_nodes
        self.future_entry = future_entry
        self.future_logit_weight = future_logit_weight
        self.contemplate_when_greedy = contemplate_when_greedy
        self.tree_depth = tree_depth
        self.tree_top_k = tree_top_k
        self.tree_total_tokens = tree_total_tokens
        self.norm_output = norm_output
        super().__init__(**kwargs)
        self.validate_fields()

    def validate_fields(self) -> None:
        """Raise a `ValueError` naming the first inconsistent field."""
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in (0, vocab_size={self.vocab_size}]."
            )
        if len(self.feature_layers) != 3 or not all(
            0 <= i <= self.target_num_layers for i in self.feature_layers
        ):
            raise ValueError(
                f"feature_layers={self.feature_layers} must be 3 hidden-state indices in "
                f"[0, {self.target_num_layers}] (EAGLE-3 uses low, mid and high layers)."
            )
        if min(self.tree_depth, self.tree_top_k, self.tree_total_tokens) < 1:
            raise ValueError("tree_depth, tree_top_k and tree_total_tokens must all be >= 1.")
        if not 0 < self.future_top_k <= self.future_experts:
            raise ValueError(f"future_top_k={self.future_top_k} must be in [1, future_experts={self.future_experts}].")
        if self.contemplate_nodes is not None and self.contemplate_nodes < 0:
            raise ValueError(f"contemplate_nodes={self.contemplate_nodes} must be >= 0 (or None for every node).")
        if self.future_logit_weight < 0:
            raise ValueError(f"future_logit_weight={self.future_logit_weight} must be >= 0 (0: off).")
        if self.contemplate and not self.future_entry and self.future_logit_weight == 0:
            raise ValueError("A ConFu draft without the [f] entry (future_entry=False) needs future_logit_weight > 0: "
                             "otherwise f reaches the draft by no path.")

    @property
    def has_future_entry(self) -> bool:
        """The draft takes f as an `[f]` attention entry (ConFu with `future_entry`)."""
        return self.contemplate and self.future_entry

    @classmethod
    def for_target(cls, model: Any, **overrides: Any) -> "ConFuDraftConfig":
        """Derive a draft config from a target `PreTrainedModel` (or its config)."""
        config = getattr(model, "config", model)
        architectures = getattr(config, "architectures", None) or [type(model).__name__]
        layer_config = {k: getattr(config, k) for k in _LAYER_FIELDS if getattr(config, k, None) is not None}
        kwargs: dict[str, Any] = dict(
            target_model_type=config.model_type,
            target_architecture=architectures[0],
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            target_num_layers=config.num_hidden_layers,
            layer_config=layer_config,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def check_target(self, model: Any) -> None:
        """Raise a `ValueError` if `model` is not a target this draft was built for."""
        config = getattr(model, "config", model)
        wanted = {
            "model_type": self.target_model_type,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.target_num_layers,
        }
        got = {k: getattr(config, k, None) for k in wanted}
        bad = {k: (wanted[k], got[k]) for k in wanted if wanted[k] != got[k]}
        if bad:
            detail = ", ".join(f"{k}: draft expects {w}, target has {g}" for k, (w, g) in bad.items())
            raise ValueError(
                f"This draft was built for a different target ({self.target_architecture}). {detail}. "
                "Load the draft trained for this target, or train one with `confu-train`."
            )


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high feature layers: `hidden_states[2]`, `[L//2]`, `[L-3]`."""
    return [min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)]
