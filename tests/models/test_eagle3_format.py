"""Reference-format EAGLE-3 drafts (SafeAILab/EAGLE, SpecForge): loading, exporting, round trips, mismatches."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_target
from safetensors.torch import load_file, save_file
from test_hub import fake_hub_cache, run_python

from transformers_confu import ConFuAssistant, ConFuDraftConfig, ConFuDraftModel
from transformers_confu.models.eagle3_format import save_eagle3
from transformers_confu.training.ttt import ttt_loss

DRAFT_VOCAB = 48


def random_draft(target, seed: int = 1, **overrides) -> ConFuDraftModel:
    """An EAGLE-3 draft with every weight random (norm weights too, so a swapped name would show) and a
    non-contiguous vocabulary map (so d2t offsets are not all zero)."""
    torch.manual_seed(seed)
    draft = ConFuDraftModel(ConFuDraftConfig.for_target(target, draft_vocab_size=DRAFT_VOCAB, **overrides))
    with torch.no_grad():
        for param in draft.parameters():
            param.copy_(torch.randn_like(param) * 0.3 + (1.0 if param.ndim == 1 else 0.0))
    draft.set_vocab_map(torch.randperm(target.config.vocab_size)[:DRAFT_VOCAB].sort().values)
    return draft


def write_reference(draft: ConFuDraftModel, target, folder, bin_file: bool = False, **config_overrides):
    """Write `draft` as SpecForge / the EAGLE authors do, by hand (independently of `save_eagle3`)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
             "input_norm.weight": "midlayer.input_layernorm.weight", "hidden_norm.weight": "midlayer.hidden_norm.weight",
             "post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight"}
    names |= {f"{m}.{p}_proj.weight": f"midlayer.{m}.{p}_proj.weight"
              for m, ps in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for p in ps}
    state = draft.state_dict()
    tensors = {ref: state[ours].clone() for ours, ref in names.items()}
    tensors["d2t"] = draft.d2t - torch.arange(DRAFT_VOCAB)
    tensors["t2d"] = draft.t2d.clone()
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.clone()
    layer = draft.config.layer_config
    L = target.config.num_hidden_layers
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  hidden_size=32, intermediate_size=layer["intermediate_size"], num_attention_heads=4,
                  num_key_value_heads=2, hidden_act="silu", rms_norm_eps=layer["rms_norm_eps"],
                  max_position_embeddings=512, rope_theta=layer["rope_parameters"]["rope_theta"],
                  vocab_size=target.config.vocab_size, draft_vocab_size=DRAFT_VOCAB, tie_word_embeddings=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4], "use_aux_hidden_state": True})
    config.update(config_overrides)
    config = {k: v for k, v in config.items() if v is not None}
    if bin_file:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def greedy_runs(target, assistant, prompts=6, new_tokens=24):
    outs, accepts = [], []
    for seed in range(prompts):
        ids = torch.randint(0, 128, (1, 4 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        outs.append(target.generate(ids, max_new_tokens=new_tokens, do_sample=False, assistant_model=assistant))
        accepts.append(assistant.stats.accept_lengths)
    return outs, accepts


def test_reference_checkpoint_drafts_exactly_as_our_format(tmp_path):
    target = tiny_target()
    draft = random_draft(target)
    ours = ConFuAssistant(draft, target, draft_dtype="float32", depth=3, top_k=2, total_tokens=6)
    loaded = ConFuAssistant.from_pretrained(write_reference(draft, target, tmp_path / "ref"), target_model=target,
                                            draft_dtype="float32", depth=3, top_k=2, total_tokens=6)
    assert loaded.draft.config.feature_layers == draft.config.feature_layers == [2, 2, 1]
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.draft.state_dict()[name], tensor), name
    (ref_out, ref_acc), (out, acc) = greedy_runs(target, ours), greedy_runs(target, loaded)
    assert all(torch.equal(a, b) for a, b in zip(ref_out, out))
    assert acc == ref_acc and sum(map(sum, acc)) > len(sum(acc, []))  # same drafts, some of them accepted


def reference_step(tensors: dict, config: dict, embeddings, features, ids):
    """One EAGLE-3 draft step written from the reference format's definition (SGLang's and SpecForge's
    LlamaForCausalLMEagle3): fc -> [input_layernorm(embed); hidden_norm(h)] -> Llama attention + MLP with residual
    h -> norm (skipped when the config says `norm_output: false`, SpecForge's Eagle3.1 option) -> lm_head, then
    target id = draft id + d2t[draft id]. Returns (draft-vocabulary logits, target ids, h)."""
    w = {k.removeprefix("midlayer."): v.double() for k, v in tensors.items()}
    heads, kv, eps = config["num_attention_heads"], config["num_key_value_heads"], config["rms_norm_eps"]

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    h = features.double() @ w["fc.weight"].T
    x = torch.cat([rms(embeddings(ids[0]).double(), w["input_layernorm.weight"]), rms(h, w["hidden_norm.weight"])], -1)
    T, dim = ids.shape[1], config["hidden_size"] // heads
    q, k, v = ((x @ w[f"self_attn.{p}_proj.weight"].T).view(T, -1, dim).transpose(0, 1) for p in "qkv")
    inv = 1.0 / config["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(t):
        return t * cos + torch.cat([-t[..., dim // 2:], t[..., : dim // 2]], -1) * sin

    q, k = rope(q), rope(k).repeat_interleave(heads // kv, 0)
    scores = (q @ k.transpose(1, 2)) / dim ** 0.5 + torch.full((T, T), float("-inf")).triu(1).double()
    attn = (scores.softmax(-1) @ v.repeat_interleave(heads // kv, 0)).transpose(0, 1).reshape(T, -1)
    h = h + attn @ w["self_attn.o_proj.weight"].T
    y = rms(h, w["post_attention_layernorm.weight"])
    h = h + (torch.nn.functional.silu(y @ w["mlp.gate_proj.weight"].T) * (y @ w["mlp.up_proj.weight"].T)) @ \
        w["mlp.down_proj.weight"].T
    logits = (rms(h, w["norm.weight"]) if config.get("norm_output", True) else h) @ w["lm_head.weight"].T
    draft_ids = logits.argmax(-1)
    return logits, draft_ids + tensors["d2t"][draft_ids], h


def draft_inputs(target, config: dict, length: int = 9):
    """Token ids, the target's fused features at the reference config's aux layers, and a causal additive mask."""
    ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(0))
    hidden = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i + 1] for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]], -1)
    causal = torch.zeros(length, length, dtype=torch.float64).masked_fill(
        torch.ones(length, length, dtype=torch.bool).triu(1), torch.finfo(torch.float64).min)
    return ids, features, causal[None, None]


def test_exported_checkpoint_matches_the_reference_definition(tmp_path):
    """Our export, read back with the reference format's own semantics, predicts the tokens our draft predicts."""
    target = tiny_target()
    draft = random_draft(target).double()
    save_eagle3(draft, tmp_path / "out")
    tensors, config = load_file(tmp_path / "out" / "model.safetensors"), json.loads((tmp_path / "out" / "config.json").read_text())
    draft.attach_target(target)
    ids, features, causal = draft_inputs(target, config)
    _, expected, expected_h = reference_step(tensors, config, target.get_input_embeddings(), features[0], ids)
    h = draft(ids, features.double(), torch.arange(9)[None], causal)
    assert torch.allclose(h[0], expected_h, atol=1e-5)
    assert torch.equal(draft.d2t[draft.logits(h)[0].argmax(-1)], expected)


def test_norm_output_false_checkpoint_loads_drafts_trains_and_exports_as_the_reference(tmp_path):
    """SpecForge's `norm_output: false` (no norm before lm_head; norm.weight still saved): the loaded draft's logits
    are the reference definition's, its training loss does not go through the norm, and export keeps the option."""
    target = tiny_target()
    folder = write_reference(random_draft(target), target, tmp_path / "ref", norm_output=False)
    tensors, config = load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())
    draft = ConFuAssistant.from_pretrained(folder, target_model=target, draft_dtype="float32").draft.double()
    assert draft.config.norm_output is False
    ids, features, causal = draft_inputs(target, config)
    expected, expected_ids, _ = reference_step(tensors, config, target.get_input_embeddings(), features[0], ids)
    normed, _, _ = reference_step(tensors, {**config, "norm_output": True}, target.get_input_embeddings(),
                                  features[0], ids)
    assert (normed - expected).abs().max() > 1.0  # the norm matters for these weights
    logits = draft.logits(draft(ids, features.double(), torch.arange(9)[None], causal))[0]
    # un-normed logits reach ~150 and the target's features are float32: the kernels' rounding (it differs between
    # CPUs: 4e-6 seen on AVX-512) stays far below the 1.0 the norm would change
    assert torch.allclose(logits, expected, atol=1e-4)
    assert torch.equal(draft.d2t[logits.argmax(-1)], expected_ids)

    draft.float().requires_grad_(True)
    loss, _ = ttt_loss(draft, features, torch.randn(1, 9, DRAFT_VOCAB), ids, torch.ones(1, 9), torch.ones(1, 9),
                       steps=2)
    loss.backward()
    assert draft.norm.weight.grad is None and draft.lm_head.weight.grad.abs().sum() > 0

    ConFuAssistant(draft, target, draft_dtype="float32").save_pretrained(tmp_path / "ours")
    assert ConFuAssistant.from_pretrained(tmp_path / "ours", target_model=target).draft.config.norm_output is False
    save_eagle3(draft, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["norm_output"] is False
    exported = load_file(tmp_path / "back" / "model.safetensors")
    assert set(exported) == set(tensors) - {"embed_tokens.weight"}
    assert all(torch.equal(exported[name], tensors[name]) for name in exported)
    save_eagle3(random_draft(target), tmp_path / "normed")  # the default is not written (SpecForge's default)
    assert "norm_output" not in json.loads((tmp_path / "normed" / "config.json").read_text())


def test_round_trip_ours_to_eagle3_and_back(tmp_path):
    target = tiny_target(num_hidden_layers=8)
    draft = random_draft(target)
    ConFuAssistant(draft, target, draft_dtype="float32").save_pretrained(tmp_path / "eagle3", format="eagle3")
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # hidden_states [2, 4, 5]
    assert (config["architectures"], config["model_type"], config["num_hidden_layers"]) == (
        ["LlamaForCausalLMEagle3"], "llama", 1)
    assert (config["draft_vocab_size"], config["vocab_size"], config["tie_word_embeddings"]) == (DRAFT_VOCAB, 128, False)
    saved = load_file(tmp_path / "eagle3" / "model.safetensors")
    assert "embed_tokens.weight" not in saved and "midlayer.hidden_norm.weight" in saved
    assert torch.equal(saved["d2t"] + torch.arange(DRAFT_VOCAB), draft.d2t) and saved["d2t"].any()
    back = ConFuAssistant.from_pretrained(tmp_path / "eagle3", target_model=target, draft_dtype="float32").draft
    assert back.config.feature_layers == draft.config.feature_layers
    assert back.config.layer_config == draft.config.layer_config
    for name, tensor in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_round_trip_eagle3_to_ours_and_back(tmp_path):
    """A reference .bin checkpoint without eagle_config (default layers) and with its own rope_theta survives
    ours -> reference again, tensor for tensor, and its layer keeps the draft's rope, not the target's."""
    target = tiny_target()
    source = write_reference(random_draft(target), target, tmp_path / "ref", bin_file=True, rope_theta=50000.0,
                             eagle_config=None)
    first = ConFuAssistant.from_pretrained(source, target_model=target, draft_dtype="float32")
    assert first.draft.config.layer_config["rope_parameters"]["rope_theta"] == 50000.0
    assert first.draft.config.feature_layers == [2, 2, 1]
    first.save_pretrained(tmp_path / "ours")
    again = ConFuAssistant.from_pretrained(tmp_path / "ours", target_model=target, draft_dtype="float32")
    again.save_pretrained(tmp_path / "back", format="eagle3")
    original = torch.load(source / "pytorch_model.bin", weights_only=True)
    exported = load_file(tmp_path / "back" / "model.safetensors")
    assert set(exported) == set(original) - {"embed_tokens.weight"}
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["rope_theta"] == 50000.0 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]


def test_vllm_style_top_level_layer_ids_are_hidden_state_indices(tmp_path):
    target = tiny_target(num_hidden_layers=8)
    folder = write_reference(random_draft(target), target, tmp_path / "ref", eagle_config=None,
                             eagle_aux_hidden_state_layer_ids=[1, 4, 6])
    assert ConFuAssistant.from_pretrained(folder, target_model=target).draft.config.feature_layers == [1, 4, 6]


def test_hub_id_of_a_reference_draft_loads_offline(tmp_path):
    target = tiny_target()
    write_reference(random_draft(target), target, tmp_path / "ref")
    target.save_pretrained(tmp_path / "target")
    cache = fake_hub_cache(tmp_path / "hub", "someone/tiny-eagle3", tmp_path / "ref")
    result = run_python(f"""
        from transformers import AutoModelForCausalLM
        from transformers_confu import ConFuAssistant
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
        a = ConFuAssistant.from_pretrained("someone/tiny-eagle3", target_model=target)
        print("LOADED", a.draft.config.draft_vocab_size, int(a.draft.d2t[-1]))
    """, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    expected = int(load_file(tmp_path / "ref" / "model.safetensors")["d2t"][-1]) + DRAFT_VOCAB - 1
    assert f"LOADED {DRAFT_VOCAB} {expected}" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("change, message", [
    (dict(arch="qwen2"), "Llama-family targets only"),
    (dict(hidden_size=48), "hidden_size: draft 32, target 48"),
    (dict(vocab_size=160), "vocab_size: draft 128, target 160"),
    (dict(num_hidden_layers=2), "must be 3 indices in \\[0, 1\\]"),
])
def test_draft_for_another_target_raises(tmp_path, change, message):
    folder = write_reference(random_draft(tiny_target()), tiny_target(), tmp_path / "ref")
    with pytest.raises(ValueError, match=message):
        ConFuAssistant.from_pretrained(folder, target_model=tiny_target(**change))


def test_broken_reference_checkpoints_raise(tmp_path):
    target = tiny_target()
    folder = write_reference(random_draft(target), target, tmp_path / "ref")
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "d2t": tensors["d2t"] + 1}, folder / "model.safetensors")
    with pytest.raises(OSError, match="inconsistent vocabulary map"):
        ConFuAssistant.from_pretrained(folder, target_model=target)
    save_file({k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}, folder / "model.safetensors")
    with pytest.raises(OSError, match="missing \\['hidden_norm.weight'\\]"):
        ConFuAssistant.from_pretrained(folder, target_model=target)
    save_file({**tensors, "fc.bias": torch.zeros(32)}, folder / "model.safetensors")
    with pytest.raises(OSError, match="unexpected \\['fc.bias'\\]"):
        ConFuAssistant.from_pretrained(folder, target_model=target)


def test_foreign_embedding_warns(tmp_path, caplog):
    target = tiny_target()
    write_reference(random_draft(target), tiny_target(seed=5), tmp_path / "ref")
    with caplog.at_level("WARNING"):
        ConFuAssistant.from_pretrained(tmp_path / "ref", target_model=target)
    assert "another token embedding" in caplog.text


def test_export_refuses_what_the_format_cannot_hold(tmp_path):
    llama, qwen = tiny_target(), tiny_target(arch="qwen2")
    with pytest.raises(ValueError, match="no EAGLE-3 equivalent"):
        save_eagle3(ConFuDraftModel(ConFuDraftConfig.for_target(llama, contemplate=True)), tmp_path / "a")
    with pytest.raises(ValueError, match="'qwen2' layer"):
        save_eagle3(ConFuDraftModel(ConFuDraftConfig.for_target(qwen)), tmp_path / "b")
    with pytest.raises(ValueError, match="cannot be written as EAGLE-3 aux layer ids"):
        save_eagle3(ConFuDraftModel(ConFuDraftConfig.for_target(llama, feature_layers=[0, 2, 4])), tmp_path / "c")
    with pytest.raises(ValueError, match="format='onnx'"):
        ConFuAssistant(random_draft(llama), llama).save_pretrained(tmp_path / "d", format="onnx")
