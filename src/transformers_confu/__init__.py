"""transformers-confu: ConFu / EAGLE-3 speculative decoding for Hugging Face transformers."""

from .assistant import ConFuAssistant
from .configuration_confu import ConFuDraftConfig
from .generation import SpeculativeStats, TreeBudget
from .modeling_confu import ConFuDraftModel
from .packed_linear import pack_linear_weights
from .target import load_target

__all__ = ["ConFuAssistant", "ConFuDraftConfig", "ConFuDraftModel", "SpeculativeStats", "TreeBudget", "load_target",
           "pack_linear_weights"]
