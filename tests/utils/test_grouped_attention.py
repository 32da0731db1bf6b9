"""Grouped-query attention under a mask on a CPU: the same outputs as transformers' SDPA, without `repeat_kv`."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_module
from conftest import tiny_target
from transformers import DynamicCache

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.decoding import assistant as assistant_module
from transformers_confu.utils.cache import cache_kwargs
from transformers_confu.utils.grouped_attention import GROUPED_SDPA, grouped_query_attention


def _tree_pass(model) -> torch.Tensor:
    """Logits of a 5-node masked pass (a tree: node 3 does not see node 1) after a 40-token prompt."""
    torch.manual_seed(0)
    prompt, nodes = torch.randint(0, 128, (1, 40)), torch.randint(0, 128, (1, 5))
    mask = torch.zeros(5, 45, dtype=model.dtype)
    mask[:, 40:] = torch.full((5, 5), torch.finfo(model.dtype).min).triu(1)
    mask[3, 41] = torch.finfo(model.dtype).min
    cache = cache_kwargs(model, DynamicCache(config=model.config))
    model(input_ids=prompt, **cache)
    return model(input_ids=nodes, position_ids=torch.arange(40, 45)[None], attention_mask=mask[None, None],
                 **cache).logits


def _count_repeats(monkeypatch) -> list[int]:
    calls = []
    original = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda x, n: calls.append(n) or original(x, n))
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_grouped_tree_pass_is_bit_identical_and_copies_no_heads(arch, dtype, monkeypatch):
    model = tiny_target(arch).to(dtype)
    assert model.config._attn_implementation == "sdpa"
    repeats = _count_repeats(monkeypatch)
    reference = _tree_pass(model)
    assert len(repeats) == model.config.num_hidden_layers * 2  # transformers' SDPA: keys and values repeated
    repeats.clear()
    with grouped_query_attention(model):
        assert model.config._attn_implementation == GROUPED_SDPA
        grouped = _tree_pass(model)
    assert torch.equal(grouped, reference)
    assert not repeats
    assert model.config._attn_implementation == "sdpa"  # restored


def test_other_attention_implementations_are_left_alone():
    model = tiny_target(attn_implementation="eager")
    with grouped_query_attention(model):
        assert model.config._attn_implementation == "eager"


@torch.no_grad()
def test_generate_verifies_trees_with_grouped_heads(monkeypatch):
    """Each multi-node verify pass of the loop skips the target's head copies; greedy output unchanged."""
    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64)
    assistant = ConFuAssistant.from_config(config, target, depth=3, top_k=2, total_tokens=6)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                            pad_token_id=0)
    repeats = _count_repeats(monkeypatch)
    counts = []
    for grouped in (False, True):
        repeats.clear()
        assistant.kept_caches.clear()  # both calls prefill the whole prompt (the same passes)
        with monkeypatch.context() as patch:
            if not grouped:  # the loop without the switch: transformers' SDPA in the tree passes
                patch.setattr(assistant_module, "grouped_query_attention", lambda model: contextlib.nullcontext())
            out = target.generate(prompt, assistant_model=assistant, max_new_tokens=24, do_sample=False)
        assert torch.equal(out, plain)
        counts.append(len(repeats))
    tree_passes = sum(size > 1 for size in assistant.stats.tree_sizes)
    assert tree_passes > 0
    assert counts[0] - counts[1] == 2 * target.config.num_hidden_layers * tree_passes
    assert target.config._attn_implementation == "sdpa"
