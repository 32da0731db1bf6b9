"""oneDNN-packed linear layers: same outputs as `nn.Linear`, never stale, never in the way of training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_target
from torch import nn

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.utils.packed_linear import (
    PACKED_DTYPES,
    PackedLinear,
    can_pack,
    pack_linear_weights,
    packed_kernels,
    unpack_linear_weights,
)

pytestmark = pytest.mark.skipif(not can_pack(), reason="this PyTorch build has no oneDNN linear")


def _calls_packed_kernel(layer: nn.Module, x: torch.Tensor) -> bool:
    with torch.profiler.profile() as prof:
        layer(x)
    return any("linear_pointwise" in e.key for e in prof.key_averages())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_layer_matches_linear(dtype, bias):
    if dtype not in PACKED_DTYPES:
        pytest.skip(f"oneDNN has no {dtype} linear kernels on this CPU (it runs F.linear instead)")
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias).to(dtype).requires_grad_(False)
    packed = pack_linear_weights(nn.Sequential(nn.Linear(48, 80, bias=bias).to(dtype)).requires_grad_(False))[0]
    packed.load_state_dict(layer.state_dict())
    assert type(packed) is PackedLinear
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for shape in [(1, 48), (4, 48), (17, 48), (2, 5, 48), (1, 1, 48)]:
        x = torch.randn(shape).to(dtype)
        assert _calls_packed_kernel(packed, x)
        torch.testing.assert_close(packed(x), layer(x), **tol)


def test_state_dict_unchanged_and_unpack_restores_linear():
    model = tiny_target()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pack_linear_weights(model)
    assert all(type(m) is not nn.Linear for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    unpack_linear_weights(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    x = torch.randn(3, model.config.hidden_size)
    assert not _calls_packed_kernel(model.model.layers[0].mlp.up_proj, x)


def test_packed_kernels_switch():
    layer = pack_linear_weights(nn.Sequential(nn.Linear(16, 24))).requires_grad_(False)[0]
    x = torch.randn(3, 16)
    with packed_kernels(False):
        assert not _calls_packed_kernel(layer, x)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert _calls_packed_kernel(layer, x)


def test_weight_changed_in_place_is_repacked():
    layer = pack_linear_weights(nn.Sequential(nn.Linear(16, 24))).requires_grad_(False)[0]
    x = torch.randn(4, 16)
    layer(x)
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.load_state_dict({"weight": torch.randn(24, 16), "bias": torch.zeros(24)})
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("bias", [True, False])
def test_training_gradients_match_linear_and_steps_repack(bias):
    torch.manual_seed(0)
    plain = nn.Linear(16, 24, bias=bias)
    packed = pack_linear_weights(nn.Sequential(nn.Linear(16, 24, bias=bias)))[0]
    packed.load_state_dict(plain.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (packed, plain)]  # no version bump
    for step in range(3):
        x = torch.randn(2, 5, 16, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        assert _calls_packed_kernel(packed, x)
        for layer, inputs, opt in zip((packed, plain), (x, x_ref), opts):
            opt.zero_grad()
            layer(inputs).square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
        for name, param in plain.named_parameters():
            torch.testing.assert_close(getattr(packed, name).grad, param.grad, atol=1e-4, rtol=1e-4)
        for opt in opts:
            opt.step()  # in place: the packed copy must follow
        torch.testing.assert_close(packed.weight, plain.weight, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(packed(x), plain(x), atol=1e-4, rtol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast decides the dtype: F.linear
        assert not _calls_packed_kernel(packed, x)


def test_packed_target_generates_the_same_tokens_and_assistant_stays_lossless(arch):
    target = tiny_target(arch)
    packed = pack_linear_weights(tiny_target(arch))
    assistant = ConFuAssistant.from_config(ConFuDraftConfig.for_target(packed, draft_vocab_size=64), packed,
                                           depth=3, top_k=2, total_tokens=6)
    assert isinstance(assistant.draft.lm_head, PackedLinear)  # the assistant packs its draft on a CPU
    for seed in range(4):
        torch.manual_seed(seed)
        ids = torch.randint(0, 128, (1, 4 + 3 * seed))
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=24)
        ref = target.generate(ids, **kw)
        assert torch.equal(packed.generate(ids, **kw), ref)
        assert torch.equal(packed.generate(ids, assistant_model=assistant, **kw), ref)
