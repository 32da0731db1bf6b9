"""The reference EAGLE-3 checkpoint format (SafeAILab/EAGLE, SpecForge, served by SGLang and vLLM), read and written.

A reference draft is a folder with a Llama-style `config.json` (`model_type: "llama"`, `num_hidden_layers: 1`,
`draft_vocab_size`, optionally `eagle_config.eagle_aux_hidden_state_layer_ids`) and weights named

    fc.weight                            (H, 3H)  fuses the three target features, low/mid/high in that order
    midlayer.input_layernorm.weight      (H,)     norm of the token embedding      (ours: input_norm)
    midlayer.hidden_norm.weight          (H,)     norm of the fused feature        (ours: hidden_norm)
    midlayer.self_attn.{q,k,v}_proj      (., 2H)  over [normed embedding; normed feature], in that order
    midlayer.self_attn.o_proj, midlayer.post_attention_layernorm, midlayer.mlp.*    (ours: same names)
    norm.weight, lm_head.weight          (D, H)   logits over the draft vocabulary: lm_head(norm(h)), or lm_head(h) when
                                                  the config says `norm_output: false` (SpecForge's Eagle3.1 option;
                                                  norm.weight is still saved, unused)
    d2t                                  (D,)     OFFSETS: target id = draft id + d2t[draft id]  (ours: absolute ids)
    t2d                                  (V,)     bool, the target ids the draft can emit        (ours: same)
    embed_tokens.weight                  (V, H)   optional frozen copy of the target's embedding (ours: borrowed)

Feature layers: SGLang and SpecForge name them by decoder-layer OUTPUT, `eagle_config.eagle_aux_hidden_state_layer_ids`
(default `[1, L//2 - 1, L - 4]`); `transformers`' `hidden_states[i + 1]` is the output of layer i, so these are our
`feature_layers` (`hidden_states` indices, default `[2, L//2, L - 3]`) minus one. vLLM's top-level
`eagle_aux_hidden_state_layer_ids` are already `hidden_states` indices. The reference layer is a Llama layer whose
rotary embedding follows the DRAFT's config (`rope_theta` absent means 10000), not the target's.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, PreTrainedModel

from .configuration_confu import ConFuDraftConfig
from .modeling_confu import ConFuDraftModel

logger = logging.getLogger(__name__)

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Our parameter name -> the reference name (everything not listed keeps its name).
_RENAMES = {"input_norm.weight": "midlayer.input_layernorm.weight", "hidden_norm.weight": "midlayer.hidden_norm.weight"}
_MIDLAYER = ("self_attn.", "post_attention_layernorm.", "mlp.")
_FAMILY = "llama"


def is_eagle3_config(config: dict[str, Any]) -> bool:
    """Whether a `config.json` dict describes a reference-format EAGLE-3 draft (not a ConFu checkpoint)."""
    return config.get("model_type") != ConFuDraftConfig.model_type and "draft_vocab_size" in config


def read_config(path_or_id: str | os.PathLike, revision: str | None = None, cache_dir: str | None = None,
                token: str | bool | None = None) -> dict[str, Any] | None:
    """The `config.json` of a local folder or Hub repository as a dict, or None when it cannot be read."""
    try:
        return json.loads(Path(_file(path_or_id, "config.json", revision, cache_dir, token)).read_text())
    except (OSError, ValueError):
        return None


def load_eagle3(path_or_id: str | os.PathLike, target_model: PreTrainedModel, revision: str | None = None,
                cache_dir: str | None = None, token: str | bool | None = None, **_: Any) -> ConFuDraftModel:
    """A `ConFuDraftModel` holding a reference-format EAGLE-3 draft (folder or Hub id) for `target_model`.

    Raises a `ValueError` when the draft was not made for this target (family, hidden size, vocabulary, layers) and
    an `OSError` when its weights are missing, unexpected or inconsistent.
    """
    hub = dict(revision=revision, cache_dir=cache_dir, token=token)
    reference = read_config(path_or_id, **hub)
    if reference is None or not is_eagle3_config(reference):
        raise OSError(f"{str(path_or_id)!r} has no reference EAGLE-3 config.json (a Llama config with draft_vocab_size).")
    draft = ConFuDraftModel(_config_for_target(reference, target_model, str(path_or_id)))
    tensors = _state_dict(_read_weights(path_or_id, **hub), draft, str(path_or_id))
    embedding = tensors.pop("embed_tokens.weight", None)
    if embedding is not None and not _same_embedding(embedding, target_model.get_input_embeddings().weight):
        logger.warning("The EAGLE-3 draft %s was trained with another token embedding than this target's; it runs "
                       "with the target's (check that this draft was made for this exact target).", path_or_id)
    draft.load_state_dict(tensors, strict=True)
    return draft


def save_eagle3(draft: ConFuDraftModel, folder: str | os.PathLike) -> None:
    """Write an EAGLE-3 `draft` in the reference format (`config.json` + `model.safetensors`) into `folder`,
    loadable by SGLang, vLLM, SpecForge and EAGLE's code, and by `ConFuAssistant.from_pretrained`."""
    config = draft.config
    if config.contemplate:
        raise ValueError("A ConFu draft (contemplate=True) has no EAGLE-3 equivalent: its future token [f] and "
                         "contemplate adapter do not exist there. Export an EAGLE-3 draft (contemplate=False).")
    if config.target_model_type != _FAMILY:
        raise ValueError(f"The reference EAGLE-3 format has a Llama decoder layer; this draft's layer is a "
                         f"{config.target_model_type!r} layer, which it cannot hold. Only Llama-family drafts export.")
    last = config.target_num_layers
    if not all(1 <= i < last for i in config.feature_layers):
        raise ValueError(f"feature_layers={config.feature_layers} cannot be written as EAGLE-3 aux layer ids: they "
                         f"must be outputs of decoder layers, i.e. hidden_states indices in [1, {last - 1}].")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {_RENAMES.get(name, f"midlayer.{name}" if name.startswith(_MIDLAYER) else name): tensor.contiguous()
               for name, tensor in draft.state_dict().items() if name not in ("d2t", "t2d")}
    tensors["d2t"] = (draft.d2t - torch.arange(len(draft.d2t), device=draft.d2t.device)).long().contiguous()
    tensors["t2d"] = draft.t2d.bool().contiguous()
    save_file({k: v.cpu() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(_reference_config(draft), indent=2) + "\n")


def _reference_config(draft: ConFuDraftModel) -> dict[str, Any]:
    config = draft.config
    layer = LlamaConfig(**config.layer_config)
    rope = dict(layer.rope_parameters or {})
    norm = {} if config.norm_output else {"norm_output": False}  # written only when off, SpecForge's default on
    return dict(
        architectures=[EAGLE3_ARCHITECTURE], model_type=_FAMILY, num_hidden_layers=1,
        hidden_size=config.hidden_size, intermediate_size=layer.intermediate_size,
        num_attention_heads=layer.num_attention_heads, num_key_value_heads=layer.num_key_value_heads,
        head_dim=layer.head_dim, hidden_act=layer.hidden_act, rms_norm_eps=layer.rms_norm_eps,
        max_position_embeddings=layer.max_position_embeddings, attention_bias=layer.attention_bias,
        mlp_bias=layer.mlp_bias, rope_theta=rope.pop("rope_theta", 10000.0),
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        vocab_size=config.vocab_size, draft_vocab_size=config.draft_vocab_size, tie_word_embeddings=False,
        torch_dtype=str(draft.fc.weight.dtype).removeprefix("torch."),
        eagle_config=dict(eagle_aux_hidden_state_layer_ids=[i - 1 for i in config.feature_layers],
                          use_aux_hidden_state=True), **norm,
    )


def _config_for_target(reference: dict[str, Any], target: PreTrainedModel, name: str) -> ConFuDraftConfig:
    """Our config for a reference draft on `target`, or a `ValueError` saying why they do not match."""
    tc = target.config
    problems = []
    if reference.get("model_type") != _FAMILY or tc.model_type != _FAMILY:
        problems.append(f"the draft's layer is {reference.get('model_type')!r} and the target is {tc.model_type!r}, "
                        "but reference EAGLE-3 drafts run here with Llama-family targets only")
    if reference.get("num_hidden_layers", 1) != 1:
        problems.append(f"the draft has {reference['num_hidden_layers']} decoder layers, only 1 is supported")
    for key, ours in (("hidden_size", tc.hidden_size), ("target_hidden_size", tc.hidden_size),
                      ("vocab_size", tc.vocab_size)):
        if reference.get(key, ours) != ours:
            problems.append(f"{key}: draft {reference[key]}, target {ours}")
    layers = _feature_layers(reference, tc.num_hidden_layers)
    if not all(0 <= i < tc.num_hidden_layers for i in layers) or len(layers) != 3:
        problems.append(f"feature hidden_states {layers} must be 3 indices in [0, {tc.num_hidden_layers - 1}] of "
                        f"this {tc.num_hidden_layers}-layer target")
    if problems:
        raise ValueError(f"The EAGLE-3 draft {name!r} does not match this target "
                         f"({type(target).__name__}): {'; '.join(problems)}. Load the draft made for this target.")
    fields = {k: v for k, v in reference.items() if k not in ("architectures", "eagle_config", "auto_map")}
    layer_config = ConFuDraftConfig.for_target(LlamaConfig(**fields)).layer_config
    return ConFuDraftConfig.for_target(target, draft_vocab_size=reference["draft_vocab_size"], feature_layers=layers,
                                       layer_config=layer_config, norm_output=bool(reference.get("norm_output", True)))


def _feature_layers(reference: dict[str, Any], num_layers: int) -> list[int]:
    """`hidden_states` indices of the three features: SGLang/SpecForge layer-output ids + 1, vLLM's as they are."""
    ids = (reference.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        return [int(i) + 1 for i in ids]
    if reference.get("eagle_aux_hidden_state_layer_ids") is not None:
        return [int(i) for i in reference["eagle_aux_hidden_state_layer_ids"]]
    return [2, num_layers // 2, num_layers - 3]


def _state_dict(tensors: dict[str, torch.Tensor], draft: ConFuDraftModel, name: str) -> dict[str, torch.Tensor]:
    """Reference weights -> our names, `d2t` offsets -> absolute ids; an `OSError` for anything missing or extra."""
    config = draft.config
    inverse = {ref: ours for ours, ref in _RENAMES.items()}
    out = {inverse.get(k, k.removeprefix("midlayer.")): v for k, v in
           ((k.removeprefix("model."), v) for k, v in tensors.items())}
    ours = set(draft.state_dict())
    missing, unexpected = sorted(ours - set(out)), sorted(set(out) - ours - {"embed_tokens.weight"})
    if missing or unexpected:
        raise OSError(f"The EAGLE-3 checkpoint {name!r} is incomplete or not a one-layer Llama EAGLE-3 draft: missing "
                      f"{missing[:5]}, unexpected {unexpected[:5]}.")
    offsets, t2d = out["d2t"].long(), out["t2d"].bool()
    d2t = torch.arange(len(offsets)) + offsets
    if (len(d2t) != config.draft_vocab_size or len(t2d) != config.vocab_size or d2t.min() < 0
            or d2t.max() >= config.vocab_size or int(t2d.sum()) != len(d2t) or not bool(t2d[d2t].all())):
        raise OSError(f"The EAGLE-3 checkpoint {name!r} has an inconsistent vocabulary map: d2t must hold "
                      f"{config.draft_vocab_size} offsets (target id = draft id + d2t[draft id]) to the target ids "
                      "that t2d marks.")
    out["d2t"], out["t2d"] = d2t, t2d
    return out


def _same_embedding(saved: torch.Tensor, target: torch.Tensor) -> bool:
    if saved.shape != target.shape:
        return False
    return bool(torch.allclose(saved.float(), target.detach().float().cpu(), rtol=1e-2, atol=1e-3))


def _read_weights(path_or_id: str | os.PathLike, **hub: Any) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` (single or sharded) or `pytorch_model.bin`."""
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        try:
            path = Path(_file(path_or_id, name, **hub))
        except OSError:
            continue
        if name == "pytorch_model.bin":
            return torch.load(path, map_location="cpu", weights_only=True)
        if name == "model.safetensors":
            return load_file(path)
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(_file(path_or_id, shard, **hub)).items()}
    raise OSError(f"No weights in {str(path_or_id)!r}: expected model.safetensors or pytorch_model.bin.")


def _file(path_or_id: str | os.PathLike, name: str, revision: str | None = None, cache_dir: str | None = None,
          token: str | bool | None = None) -> str:
    """Local path of `name` in a folder, or in a Hub repository (downloaded or from the cache)."""
    folder = Path(path_or_id)
    if folder.is_dir():
        if not (folder / name).is_file():
            raise OSError(f"{folder / name} does not exist")
        return str(folder / name)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(str(path_or_id), name, revision=revision, cache_dir=cache_dir, token=token)
    except (OSError, ValueError, EntryNotFoundError) as err:  # not found, offline, or not a repository id
        raise OSError(str(err)) from err
