"""Tiny random targets and tokenizers built in code (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    StoppingCriteria,
)

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_target(arch: str = "llama", vocab_size: int = 128, seed: int = 0, init: float = 0.3,
                tie_word_embeddings: bool = False, **overrides):
    """A 4-layer random target; a large init makes its next-token distributions peaked (few near-ties)."""
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(**dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=init, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=tie_word_embeddings,
    ) | overrides)
    return model_cls(config).eval().requires_grad_(False)


class LastTokenIs(StoppingCriteria):
    """A call's own stopping criterion (`stopping_criteria=`): done where a row's last token is `token`."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return input_ids[:, -1] == self.token


def tiny_tokenizer(vocab_size: int = 128) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose token i is the string `t{i} ` (so stop strings can be matched)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["abcdef"] = vocab_size - 1  # StopStringCriteria probes the vocabulary with this prefix
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    chat = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t1 {% endif %}"
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", chat_template=chat)


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "What is 2 + 3? The answer is 5.",
    "Write a Python function that adds two numbers: def add(a, b): return a + b",
    "Hello there! How are you today? I am fine, thank you.",
    "Natalia sold 48 clips in April and half as many in May.",
    "user assistant system\n",
]


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (about 400 tokens) with a ChatML template, trained in code."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


@pytest.fixture(params=sorted(ARCHS))
def arch(request) -> str:
    return request.param


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models run fastest (and least disturbed by other processes) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_compile_caches():
    """Each test compiles from scratch: compiled frames of one code object (a model's forward) would otherwise
    pile up across tests until torch's recompile limit fails a `fullgraph` compile."""
    yield
    torch._dynamo.reset()
