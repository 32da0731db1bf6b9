"""transformers-confu: ConFu / EAGLE-3 speculative decoding for Hugging Face transformers."""

from .decoding.assistant import ConFuAssistant
from .decoding.generation import SpeculativeStats, TreeBudget
from .decoding.suffix_assistant import SuffixAssistant
from .models.configuration_confu import ConFuDraftConfig
from .models.modeling_confu import ConFuDraftModel
from .models.target import load_target
from .utils.packed_linear import pack_linear_weights

__all__ = ["ConFuAssistant", "ConFuDraftConfig", "ConFuDraftModel", "SpeculativeStats", "SuffixAssistant", "TreeBudget",
           "load_target", "pack_linear_weights"]
