"""`ConFuAssistant`: the object passed as `generate(assistant_model=...)`.

Why the target's `generate` is wrapped: transformers' `generate(assistant_model=...)` verifies only
chains, picks its candidate generator in a private if/elif with no registry, and the `custom_generate`
callable form drops `assistant_model` and `streamer`. So attaching an assistant wraps `generate` on
that target INSTANCE (transformers' own `custom_generate` loading does the same): calls with a
`ConFuAssistant` run our tree loop, every other call goes to the original `generate` unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError
from transformers import CompileConfig, GenerationConfig, PretrainedConfig, PreTrainedModel, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput

from ..models.checkpoints import draft_problem
from ..models.configuration_confu import ConFuDraftConfig
from ..models.contemplate import ADAPTER_FOLDER, ContemplateAdapter
from ..models.eagle3_format import is_eagle3_config, load_eagle3, read_config, save_eagle3
from ..models.hub import SUFFIX_FOLDER
from ..models.modeling_confu import ConFuDraftModel
from ..utils.cache import full_attention, keep_path, reset_cache, static_cache
from ..utils.grouped_attention import grouped_query_attention
from ..utils.packed_linear import native_bf16, pack_linear_weights
from .batched import generate_batch, is_batch, move_rows
from .generation import KeptCaches, SpeculativeStats, StaticTarget, StepScores, TreeBudget, speculative_generate
from .processing import call_options, node_processing
from .suffix import SuffixProposer, load_proposer
from .tree import TreeDrafter, catch_up_step, draft_tree
from .width import checked_width, round_costs

# generate() options that change the output in ways this loop does not reproduce, with neutral values.
_UNSUPPORTED = {
    "num_beams": (None, 1),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "token_healing": (None, False),
}
# generate()'s decoding modes this loop reproduces; assisted generation is what prompt lookup, MTP or early exit
# would make of greedy decoding or sampling (their output: greedy decoding's, or sampling's distribution)
_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.ASSISTED_GENERATION)
STATIC_BUCKET = 256  # static-mode cache capacities are multiples of this


class RoutedAssistant:
    """What `target.generate(assistant_model=self)` and `pipeline(..., model=target, assistant_model=self)` need of an
    assistant: `wrap_generate` (called when it is built) routes the target's generate to `self.generate`, and
    `config` is the target's (a pipeline checks that its model and the assistant share the vocabulary and special
    tokens). `build`: how to build one for a model, for error messages."""

    routes_generate = True  # `target.generate(assistant_model=self)` runs `self.generate`
    build = "an assistant of this kind with that model as its target"
    target: PreTrainedModel

    @property
    def config(self) -> PretrainedConfig:
        """The target's config."""
        return self.target.config

    def __getattr__(self, name: str) -> Any:
        # Only reached when transformers' own generate() inspects us: the model was not prepared.
        target = self.__dict__.get("target")
        raise AttributeError(
            f"{type(self).__name__!r} has no attribute {name!r}. If this came from `model.generate(..., "
            f"assistant_model=)` or a pipeline: this assistant drafts for {_describe(target)}, and the model you "
            f"called is not prepared for it. Build one for the model you call, {self.build}, and create it BEFORE "
            "evaluating `model.generate` (creating it prepares the model's generate())."
        )


class ConFuAssistant(RoutedAssistant):
    """A draft head bound to a target model, usable as `target.generate(..., assistant_model=self)`.

    Attributes:
        draft: the `ConFuDraftModel`.
        target: the target model it drafts for.
        budget: the default tree budget (`depth`, `top_k`, `total_tokens`); a call can override it with
            `tree_depth=`, `tree_top_k=`, `tree_total_tokens=`.
        sampling_top_k: the draft's children per node in sampling calls of the batch-1 loop that set no
            `tree_top_k=` (None: `budget.top_k`); `from_pretrained` takes it from the hybrid budget saved with a
            suffix corpus, where one is saved.
        stats: `SpeculativeStats` of the last `generate` call.
        kept_caches: the target's and the draft's caches of the last eager batch-1 call (`generation.KeptCaches`),
            reused by a next call whose prompt continues its sequence (a chat's next turn); `kept_caches.clear()`
            drops them, `kept_caches = None` keeps none (each call's caches are freed when it returns).
        config: the target's config (`RoutedAssistant`: what a pipeline checks); the draft's is `draft.config`.
        adapter: ConFu's `ContemplateAdapter` for the target (drafts with `contemplate=True`), else None.
        contemplate_nodes: ConFu: how many tree nodes get a `[con]` (None: all, 0: none, i.e. the draft without
            its future token); a call can override it with `contemplate_nodes=`. Unless it is set here or in the
            call, greedy calls of a draft with `contemplate_when_greedy=False` run with 0.
        suffix: a `SuffixProposer` whose candidates (from the sequence itself and its corpus) join every tree
            under the same `total_tokens` (a hybrid tree), or None for the draft alone; a call can leave it
            out with `suffix=False`.
        width: "fixed" (every tree holds up to `total_tokens` nodes) or "auto" (the eager batch-1 loop cuts each
            tree to the width that maximizes its expected accepted tokens per unit of the target's verify cost,
            measured at the first such call and kept as `verify_costs`; `width.py`), or a cost table {width: seconds}.
        draft_dtype: the dtype the draft runs in (`draft_dtype_for`): "auto" (default) the target's, except bfloat16
            for a float32 target on a CPU that multiplies bfloat16 natively; or a dtype (`torch.float32`, "bfloat16").
            The target verifies every drafted token in its own dtype, so the outputs do not depend on it.

    A call can also override the draft config's `future_logit_weight` (ConFu: how much the `[con]`'s own
    prediction is mixed into the first drafted level) with `future_logit_weight=`.
    """

    build = "`ConFuAssistant.from_pretrained(draft, target_model=model)`"

    def __init__(self, draft: ConFuDraftModel, target_model: PreTrainedModel,
                 adapter: ContemplateAdapter | None = None, contemplate_nodes: int | None = None,
                 suffix: SuffixProposer | None = None, width: str | dict[int, float] = "fixed",
                 draft_dtype: torch.dtype | str = "auto", **tree: int) -> None:
        self.width, self.verify_costs = checked_width(width), None
        if draft.config.contemplate and adapter is None:
            raise ValueError("This is a ConFu draft (contemplate=True): it needs its ContemplateAdapter "
                             f"(saved in {ADAPTER_FOLDER}/ beside the draft).")
        if adapter is not None and not draft.config.contemplate:
            raise ValueError("A ContemplateAdapter was given for an EAGLE-3 draft (contemplate=False).")
        draft.attach_target(target_model)
        weight = target_model.get_input_embeddings().weight
        dtype = draft_dtype_for(draft_dtype, weight)
        # the draft is cast in place: where that rounds its weights, they are kept as given (on the host) for saving
        self._given_dtype, state = draft.dtype, draft.state_dict()
        lossy = dtype != draft.dtype and any(v.is_floating_point() and not torch.equal(v, v.to(dtype).to(v.dtype))
                                            for v in state.values())
        self._given = {k: v.detach().to("cpu", copy=True) for k, v in state.items()} if lossy else None
        self.draft = _cast(draft, weight.device, dtype).eval().requires_grad_(False)
        if adapter is not None:
            adapter.check_target(target_model)
            adapter = adapter.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
        if weight.device.type == "cpu":
            pack_linear_weights(self.draft)
            if adapter is not None:
                pack_linear_weights(adapter)
        self.adapter = adapter
        self._given_versions = _versions(self.draft)
        self._nodes_set = contemplate_nodes is not None
        self.contemplate_nodes = contemplate_nodes if contemplate_nodes is not None else draft.config.contemplate_nodes
        self.target, self.suffix = target_model, suffix
        cfg = draft.config
        self.budget = TreeBudget(
            depth=tree.get("depth", cfg.tree_depth),
            top_k=tree.get("top_k", cfg.tree_top_k),
            total_tokens=tree.get("total_tokens", cfg.tree_total_tokens),
        )
        self._budget_set = bool(tree)  # batches run an explicit budget as it is, else `batch_budget`'s
        self.sampling_top_k: int | None = None
        self.stats = SpeculativeStats()
        self.kept_caches = KeptCaches()  # the last eager batch-1 call's, for a next call that continues it
        wrap_generate(target_model)

    @classmethod
    def from_pretrained(
        cls, path_or_id: str | os.PathLike, target_model: PreTrainedModel, **kwargs: Any
    ) -> "ConFuAssistant":
        """Load a draft (local folder or Hub id) for `target_model`, with its contemplate adapter if it is a
        ConFu draft; `depth`/`top_k`/`total_tokens` go to the budget, `contemplate_nodes`, `width` and `draft_dtype` as
        in the class.

        `suffix`: True (default) uses the suffix corpus saved beside a local draft (`suffix_corpus/`), if there
        is one, with the hybrid budget saved in it (its `total_tokens`, `suffix_nodes` and, where saved, the draft's
        `top_k` and `sampling_top_k`, unless the call gives them); False the draft alone; or a corpus folder / `CorpusIndex` /
        `SuffixProposer` (see `suffix.load_proposer`; the corpus is checked against `tokenizer`, default the target's).

        Reference-format EAGLE-3 drafts (SafeAILab/EAGLE, SpecForge: a Llama config with `draft_vocab_size`,
        weights `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`) load too (see `eagle3_format`)."""
        options = {k: kwargs.pop(k) for k in ("depth", "top_k", "total_tokens", "contemplate_nodes", "width", "draft_dtype")
                   if k in kwargs}
        source, tokenizer, nodes = kwargs.pop("suffix", True), kwargs.pop("tokenizer", None), kwargs.pop("suffix_nodes", None)
        beside = Path(path_or_id) / SUFFIX_FOLDER
        if source is True:
            source = beside if beside.is_dir() else None
        suffix, saved = load_proposer(source, target_model, tokenizer), {}
        if suffix is not None and suffix.corpus is not None:
            hybrid = suffix.corpus.meta.get("hybrid", {})
            saved = {"total_tokens": hybrid.get("total_tokens", suffix.max_nodes + 1)}
            saved.update((k, hybrid[k]) for k in ("top_k", "sampling_top_k") if k in hybrid)
            suffix.max_nodes = nodes or hybrid.get("suffix_nodes", suffix.max_nodes)
        elif suffix is not None and nodes:
            suffix.max_nodes = nodes
        hub = {k: kwargs[k] for k in ("revision", "cache_dir", "token") if k in kwargs}
        if is_eagle3_config(read_config(path_or_id, **hub) or {}):
            assistant = cls(load_eagle3(path_or_id, target_model, **hub), target_model, suffix=suffix, **options)
        else:
            draft = load_draft(path_or_id, **kwargs)
            adapter = load_adapter(path_or_id, **kwargs) if draft.config.contemplate else None
            assistant = cls(draft, target_model, adapter, suffix=suffix, **options)
        sampling_top_k = saved.pop("sampling_top_k", None)  # the assistant's, not the budget's
        if "top_k" not in options:
            assistant.sampling_top_k = sampling_top_k
        for key, value in saved.items():  # saved defaults, not the caller's: batches follow the policy
            if key not in options:
                setattr(assistant.budget, key, value)
        return assistant

    @classmethod
    def from_config(cls, config: ConFuDraftConfig, target_model: PreTrainedModel, **options: Any) -> "ConFuAssistant":
        """A randomly initialised (untrained) draft for `target_model` (and adapter, for a ConFu config)."""
        adapter = ContemplateAdapter.for_target(target_model) if config.contemplate else None
        return cls(ConFuDraftModel(config), target_model, adapter, **options)

    def save_pretrained(self, path: str | os.PathLike, format: str = "confu", **kwargs: Any) -> None:
        """Save the draft (config + safetensors) and a ConFu draft's adapter, loadable with `from_pretrained`.

        `format="eagle3"` writes an EAGLE-3 draft in the reference format instead (for SGLang, vLLM, SpecForge)."""
        if format not in ("confu", "eagle3"):
            raise ValueError(f"format={format!r}: use 'confu' (this package's format) or 'eagle3' (the reference one).")
        if format == "eagle3" and kwargs:
            raise TypeError(f"format='eagle3' takes no other options, got {sorted(kwargs)}.")
        with self._as_given():
            if format == "eagle3":
                save_eagle3(self.draft, path)
                return
            self.draft.save_pretrained(path, **kwargs)
        if self.adapter is not None:
            self.adapter.save_to(path)

    @contextlib.contextmanager
    def _as_given(self) -> Iterator[None]:
        """The draft in the dtype it was given, with its weights as given where running it in `draft_dtype` rounded
        them (a float32 draft run in bfloat16 saves its float32 weights), unless they were changed since."""
        if self._given is not None and _versions(self.draft) != self._given_versions:
            warnings.warn("The draft's weights changed after the assistant was built: saving them as they are now "
                          f"(their {self.draft.dtype} values, in {self._given_dtype}), not as given.", stacklevel=3)
            self._given = None
        dtype, device = self.draft.dtype, next(self.draft.parameters()).device
        _cast(self.draft, device, self._given_dtype)
        if self._given is not None:
            self.draft.load_state_dict(self._given)
        try:
            yield
        finally:
            _cast(self.draft, device, dtype)
            self._given_versions = _versions(self.draft)

    def push_to_hub(self, repo_id: str, model_card: str | None = None, **kwargs: Any) -> Any:
        """Upload the draft (config, safetensors, remote code, adapter) to the Hub, with `model_card` as README.md."""
        with self._as_given():
            result = self.draft.push_to_hub(repo_id, **kwargs)
        if self.adapter is not None:
            from huggingface_hub import HfApi

            with tempfile.TemporaryDirectory() as folder:
                self.adapter.save_to(folder)
                HfApi(token=kwargs.get("token")).upload_folder(folder_path=folder, repo_id=repo_id, repo_type="model")
        if model_card is not None:
            from huggingface_hub import HfApi

            HfApi(token=kwargs.get("token")).upload_file(path_or_fileobj=model_card.encode(), path_in_repo="README.md",
                                                         repo_id=repo_id, repo_type="model")
        return result

    def generate(self, target: PreTrainedModel, input_ids: torch.LongTensor | None = None, **kwargs: Any):
        """Run tree speculative decoding; called through `target.generate(assistant_model=self)`. `suffix=False`
        leaves this call's trees to the draft alone."""
        input_ids, mask = kwargs.pop("inputs", input_ids), kwargs.pop("attention_mask", None)
        batched = is_batch(input_ids, mask)
        input_ids = checked_input_ids(self.target, target, input_ids, self.build, batched)
        use_suffix = kwargs.pop("suffix", True)
        tree_set = self._budget_set or any(f"tree_{name}" in kwargs for name in ("depth", "top_k", "total_tokens"))
        top_k = kwargs.pop("tree_top_k", None)
        depth = kwargs.pop("tree_depth", self.budget.depth)
        total_tokens = kwargs.pop("tree_total_tokens", self.budget.total_tokens)
        tokenizer, streamer, options, stopping = call_arguments(kwargs)
        nodes_set = self._nodes_set or "contemplate_nodes" in kwargs
        contemplate_nodes = kwargs.pop("contemplate_nodes", self.contemplate_nodes)
        if contemplate_nodes is not None and contemplate_nodes < 0:
            raise ValueError(f"contemplate_nodes={contemplate_nodes} must be >= 0 (or None for every node).")
        future_logit_weight = kwargs.pop("future_logit_weight", self.draft.config.future_logit_weight)
        if future_logit_weight < 0:
            raise ValueError(f"future_logit_weight={future_logit_weight} must be >= 0 (0: off).")
        config = _generation_config(target, kwargs)
        if top_k is None:
            top_k = self.sampling_top_k if config.do_sample and self.sampling_top_k else self.budget.top_k
        budget = TreeBudget(depth, top_k, total_tokens)
        if min(budget.depth, budget.top_k, budget.total_tokens) < 1:
            raise ValueError(f"Tree budget values must be >= 1, got {budget}.")
        if budget.top_k > self.draft.config.draft_vocab_size:
            raise ValueError(f"Tree budget top_k={budget.top_k} exceeds the draft vocabulary "
                             f"({self.draft.config.draft_vocab_size}).")
        if not (nodes_set or config.do_sample or self.draft.config.contemplate_when_greedy):
            contemplate_nodes = 0
        max_new = _max_new_tokens(config, input_ids.shape[1], budget, target)
        input_ids, mask = sequence_copies(input_ids, mask, config)
        batched = batched or input_ids.shape[0] > 1
        static = uses_static_cache(config, "ConFu")
        record, parts = score_record(config, batched, static), {}
        if static:
            parts = self._static_parts(config, input_ids.shape[1] + max_new, budget,
                                       input_ids.shape[0] if batched else None)
        if batched:  # B > 1 or left padding: batched.py
            return returned(generate_batch(self, target, input_ids, mask, config, budget if tree_set else None,
                                           max_new, tokenizer, streamer, contemplate_nodes, future_logit_weight,
                                           self.suffix if use_suffix else None, parts or None, options, record,
                                           stopping),
                            config, record)
        self.stats = SpeculativeStats(mode="static" if parts else "eager")
        temperature = (config.temperature or 1.0) if config.do_sample else None
        suffix = self.suffix if use_suffix else None
        processing = node_processing(target, config, input_ids, input_ids.shape[1] + max_new, **options)[0]
        drafter = TreeDrafter(self.draft, budget.depth, budget.top_k, budget.total_tokens, temperature,
                              parts.get("draft_cache"), parts.get("draft_calls"), suffix,
                              costs=None if parts else round_costs(self, target, budget.total_tokens))
        output = speculative_generate(
            target, drafter, self.draft.config.feature_layers, input_ids, config, max_new, self.stats,
            tokenizer, streamer, self.adapter, contemplate_nodes, parts.get("target"), future_logit_weight, processing,
            record, stopping, self.kept_caches,
        )
        self.stats.suffix_seconds = 0.0 if suffix is None else suffix.seconds
        return returned(output, config, record)

    def _static_parts(self, config: GenerationConfig, length: int, budget: TreeBudget, batch: int | None
                      ) -> dict[str, Any]:
        """Static mode: `static_parts` for target and draft, sized to `length` tokens per row plus the soft
        prompt and the tree (a batch's budget is at most `budget`'s), kept on the assistant and reused by later
        calls of the same capacity, batch size (None: the batch-1 loop) and compile settings."""
        offset = 0 if self.adapter is None else self.adapter.num_soft_tokens
        needed = offset + length + 2 * budget.total_tokens + budget.depth * (budget.top_k + 1) + 2
        self._static = static_parts(self.target, config, needed, self.__dict__.get("_static"), True, batch)
        return self._static


def uses_static_cache(config: GenerationConfig, assistant: str) -> bool:
    """Whether a call asks for the static mode; any cache implementation but static and dynamic is refused."""
    if config.cache_implementation == "static":
        return True
    if config.cache_implementation not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={config.cache_implementation!r} is not supported with a {assistant} "
                         "assistant: use 'static' (preallocated caches, compiled on CUDA) or leave it unset.")
    return False


def static_parts(target: PreTrainedModel, config: GenerationConfig, needed: int, kept: dict[str, Any] | None,
                 draft: bool, batch: int | None = None) -> dict[str, Any]:
    """The static mode's preallocated caches and the calls that run them: the target's cache of `needed`
    positions per row rounded up to a multiple of `STATIC_BUCKET` (so prompts of similar length share one
    compiled shape) with its tree pass and path compaction (`keep_path`; for the batched loop, `batch` rows,
    `batched.move_rows`), and with `draft` the draft's cache (the batched loop's chain drafter: of `batch` rows) and
    its catch-up and whole-tree drafting calls (the batched loop: also one batch-1 draft cache per row,
    `row_draft_caches`, for per-row tree drafters). Compiled (each
    one graph) where transformers' `generate` compiles a static cache (CUDA/XPU, or
    `compile_config._compile_all_devices`; never with `disable_compile`), with its `compile_config`; uncompiled
    on a CPU, attention sees only the filled positions. `kept`, the parts of an earlier call, is emptied and
    returned when its capacity, batch size and compile settings match."""
    check_full_attention(target)
    options = compile_options(config, target)
    key = (static_capacity(needed), batch, repr(options))
    caches = ("draft_cache", "row_draft_caches") if draft else ()
    if kept is not None and kept["key"] == key:
        for cache in [kept["target"].cache, *(c for name in caches for c in _listed(kept.get(name)))]:
            reset_cache(cache)
        return kept
    compile = options is not None
    filled = not compile and target.device.type == "cpu"
    cache = static_cache(target.config.num_hidden_layers, key[0], filled)
    parts = {"key": key, "target": StaticTarget(cache, torch.compile(target, **options),
                                                torch.compile(keep_path if batch is None else move_rows, **options))
             if compile else StaticTarget(cache, target)}
    if draft:
        parts["draft_cache"] = static_cache(1, key[0], filled)
        parts["draft_calls"] = {"catch_up": torch.compile(catch_up_step, **options),
                                "propose": torch.compile(draft_tree, **options)} if compile else None
        if batch is not None:
            parts["row_draft_caches"] = [static_cache(1, key[0], filled) for _ in range(batch)]
    return parts


def _cast(draft: ConFuDraftModel, device: torch.device, dtype: torch.dtype) -> ConFuDraftModel:
    """`draft` moved and cast in place, its rotary frequencies kept in their own dtype (float32, as transformers
    builds them: rounded to bfloat16 they would turn far positions by up to a radian)."""
    frequencies = {name: buffer for name, buffer in draft.named_buffers() if name.endswith("inv_freq")}
    draft.to(device=device, dtype=dtype)
    for name, buffer in frequencies.items():
        module, _, attribute = name.rpartition(".")
        setattr(draft.get_submodule(module), attribute, buffer.to(device))
    return draft


def _versions(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Each parameter's storage and in-place version: what tells whether weights were changed."""
    return {name: (p.data_ptr(), p._version) for name, p in module.named_parameters()}


DRAFT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def draft_dtype_for(requested: torch.dtype | str, target_weight: torch.Tensor) -> torch.dtype:
    """The dtype a draft runs in: `requested` (a floating dtype or its name), or for "auto" the target's, except
    bfloat16 for a float32 target on a CPU with native bfloat16 products (`native_bf16`): the draft's weights
    are read from memory twice a round, and half the bytes made its calls about a quarter cheaper (the draft alone
    1.27x plain `generate` instead of 1.22x on an AVX-512 BF16 CPU; the hybrid tree as fast either way,
    docs/draft-dtype.md)."""
    if requested == "auto":
        native = target_weight.device.type == "cpu" and target_weight.dtype == torch.float32 and native_bf16()
        return torch.bfloat16 if native else target_weight.dtype
    dtype = getattr(torch, requested, None) if isinstance(requested, str) else requested
    if dtype not in DRAFT_DTYPES:
        raise ValueError(f"draft_dtype={requested!r}: use 'auto' or one of "
                         f"{', '.join(repr(str(d).removeprefix('torch.')) for d in DRAFT_DTYPES)} (or the torch dtype).")
    return dtype


def _listed(value) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def checked_input_ids(own: PreTrainedModel, target: PreTrainedModel, input_ids: torch.LongTensor | None,
                      build: str, batch: bool = False) -> torch.LongTensor:
    """`input_ids` of a call through `target.generate`, after checking it is the assistant's `own` target
    (else the error says to `build` one for it) and the ids are one non-empty prompt (a non-empty `batch`)."""
    if target is not own:
        raise ValueError(f"This assistant drafts for {_describe(own)}, not for the model whose generate() was "
                         f"called ({_describe(target)}): build one for that model with {build}.")
    if input_ids is None or input_ids.ndim != 2:
        raise ValueError("Pass `input_ids` of shape (1, prompt_length).")
    if input_ids.shape[0] != 1 and not batch:
        raise ValueError(f"ConFu speculative decoding supports batch size 1 only, got {input_ids.shape[0]}.")
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: speculative decoding needs at least one prompt token.")
    return input_ids


def check_full_attention(target: PreTrainedModel) -> None:
    """The static mode's caches are full-attention ones: refuse a target with other layer types."""
    if not full_attention(target.config):
        raise ValueError("cache_implementation='static' with an assistant supports full-attention targets only; "
                         f"this one has layer types {getattr(target.config, 'layer_types', None)}: leave "
                         "cache_implementation unset.")


def static_capacity(needed: int) -> int:
    """A static cache's capacity for `needed` entries: the next multiple of `STATIC_BUCKET`."""
    return -(-needed // STATIC_BUCKET) * STATIC_BUCKET


def compile_options(config: GenerationConfig, target: PreTrainedModel) -> dict | None:
    """`torch.compile` options for the static mode where transformers' `generate` compiles a static cache
    (CUDA/XPU, or `compile_config._compile_all_devices`; never with `disable_compile`), else None."""
    compile_config = config.compile_config
    compile = not config.disable_compile and (
        target.device.type in ("cuda", "xpu") or bool(compile_config and compile_config._compile_all_devices))
    return (compile_config or CompileConfig()).to_dict() if compile else None


def load_draft(path_or_id: str | os.PathLike, **kwargs: Any) -> ConFuDraftModel:
    """`ConFuDraftModel.from_pretrained` (folder or Hub id; `revision`, `cache_dir`, `token`, ...) that
    refuses corrupt, truncated or incomplete checkpoints instead of filling missing weights at random, and
    says so when `path_or_id` is neither a folder nor a Hub id."""
    _check_draft_source(path_or_id)
    try:
        draft, info = ConFuDraftModel.from_pretrained(path_or_id, output_loading_info=True, **kwargs)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        if not Path(path_or_id).is_dir():
            raise OSError(
                f"Could not load a ConFu draft from {str(path_or_id)!r}: it is not a local folder (no "
                f"{Path(path_or_id).resolve()}), and as a Hub id: {err} Check the path, or the Hub id and your "
                "connection."
            ) from err
        raise OSError(
            f"Could not load a ConFu draft from {str(path_or_id)!r}: {err}. The checkpoint may be corrupt or "
            "incomplete: download or save it again (it needs config.json and model.safetensors)."
        ) from err
    missing = info.get("missing_keys") or []
    if missing:
        raise OSError(
            f"The draft checkpoint {str(path_or_id)!r} lacks weights {sorted(missing)[:5]}"
            f"{' ...' if len(missing) > 5 else ''}: it is incomplete or was saved by another model."
        )
    return draft


def _check_draft_source(path_or_id: str | os.PathLike) -> None:
    """Raise a clear error for a file, an incomplete draft folder, or a name that is neither a folder nor a
    Hub id (a typo'd path)."""
    folder = Path(path_or_id)
    if folder.is_file():
        raise OSError(f"{str(path_or_id)!r} is a file: pass the draft's folder (the one holding config.json "
                      "and model.safetensors), or a Hub id.")
    if folder.is_dir():
        problem = draft_problem(folder)
        if problem is not None:
            raise OSError(f"The draft checkpoint {str(path_or_id)!r} is corrupt or incomplete: {problem}. Save "
                          "or download it again (for confu-train's final/, rerun the training command).")
        return
    try:
        validate_repo_id(str(path_or_id))
    except HFValidationError:
        raise FileNotFoundError(
            f"There is no draft folder {str(path_or_id)!r} (looked in {folder.resolve()}), and it is not a Hub id "
            "('name' or 'namespace/name') either: check the path."
        ) from None


def load_adapter(path_or_id: str | os.PathLike, revision: str | None = None, cache_dir: str | None = None,
                 token: str | bool | None = None, **_: Any) -> ContemplateAdapter:
    """The `contemplate_adapter/` of a ConFu draft (folder or Hub id), with a clear error if it is missing."""
    folder = Path(path_or_id)
    try:
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(str(path_or_id), revision=revision, cache_dir=cache_dir, token=token,
                                            allow_patterns=[f"{ADAPTER_FOLDER}/*"]))
        return ContemplateAdapter.from_pretrained(folder / ADAPTER_FOLDER)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise OSError(
            f"Could not load the contemplate adapter of the ConFu draft {str(path_or_id)!r} from "
            f"{ADAPTER_FOLDER}/ ({err}): the checkpoint is incomplete or corrupt; save or download it again."
        ) from err


def _describe(model: PreTrainedModel | None) -> str:
    """`the LlamaForCausalLM loaded from 'path'` (or `at 0x...`), to name a model in error messages."""
    name = getattr(getattr(model, "config", None), "name_or_path", "")
    return f"the {type(model).__name__}" + (f" loaded from {name!r}" if name else f" at {id(model):#x}")


def wrap_generate(model: PreTrainedModel) -> None:
    """Route `model.generate(assistant_model=<ConFuAssistant or SuffixAssistant>)` to the assistant (once per
    instance)."""
    if getattr(model.generate, "_confu_wrapped", False):
        return
    original = model.generate

    @functools.wraps(original)
    def generate(*args: Any, assistant_model: Any = None, **kwargs: Any):
        if getattr(type(assistant_model), "routes_generate", False):  # ConFuAssistant, SuffixAssistant
            with grouped_query_attention(model):  # tree passes without copies of the cache's heads (CPU)
                return assistant_model.generate(model, *args, **kwargs)
        return original(*args, assistant_model=assistant_model, **kwargs)

    generate._confu_wrapped = True
    model.generate = generate


def call_arguments(kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any], StoppingCriteriaList | None]:
    """Pop what a call passes beside its generation settings: `tokenizer`, `streamer`, the processor arguments
    (`processing.CALL_OPTIONS`) and its own `stopping_criteria`."""
    return (kwargs.pop("tokenizer", None), kwargs.pop("streamer", None), call_options(kwargs),
            kwargs.pop("stopping_criteria", None))


def _generation_config(target: PreTrainedModel, kwargs: dict[str, Any]) -> GenerationConfig:
    """Merge `generation_config=`, the target's generation config, transformers' global defaults (e.g.
    `top_k=50` when sampling) and keyword overrides, in the order `generate` does."""
    config = copy.deepcopy(kwargs.pop("generation_config", None) or GenerationConfig())
    config.update(**target.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**target.generation_config._get_default_generation_params(), defaults_only=True)
    unused = config.update(**kwargs)
    unused.pop("use_cache", None)
    if "past_key_values" in unused:
        raise TypeError("past_key_values is not taken with an assistant: it keeps the caches of its last call itself "
                        "and reuses them where the next prompt begins with that call's sequence (a chat's next turn); "
                        "pass the whole sequence as input_ids and leave past_key_values out.")
    if unused:
        raise TypeError(f"Unsupported generate() arguments with a ConFu assistant: {sorted(unused)}.")
    for name, neutral in _UNSUPPORTED.items():
        if getattr(config, name, None) not in neutral:
            raise ValueError(
                f"`{name}={getattr(config, name)}` is not supported with a ConFu assistant "
                "(supported: greedy or sampling with generate's logits processors and warpers, eos, stop strings)."
            )
    mode = config.get_generation_mode()
    if mode not in _MODES:  # e.g. contrastive search (penalty_alpha), DoLa, constrained beam search (force_words_ids)
        raise ValueError(f"These generate() settings ask for {mode.value.replace('_', ' ')}, which a ConFu assistant "
                         "does not run (it runs greedy decoding and sampling): leave the assistant out, or the "
                         "settings (penalty_alpha, dola_layers, force_words_ids, constraints, ...).")
    return config


def sequence_copies(input_ids: torch.LongTensor, mask: torch.Tensor | None, config: GenerationConfig
                    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
    """`num_return_sequences` > 1 (sampling): each prompt and its mask repeated in place, as `generate` expands them
    (an unmasked prompt's copies get an all-ones mask), and the config's count set back to 1; else as given."""
    copies = config.num_return_sequences or 1
    if copies == 1:
        return input_ids, mask
    if not config.do_sample:
        raise ValueError(f"num_return_sequences={copies} needs do_sample=True: greedy decoding gives one sequence per "
                         "prompt (plain generate refuses it too).")
    config.num_return_sequences = 1
    mask = torch.ones_like(input_ids) if mask is None else mask
    return input_ids.repeat_interleave(copies, 0), mask.repeat_interleave(copies, 0)


def score_record(config: GenerationConfig, batched: bool = False, static: bool = False) -> StepScores | None:
    """Where a call's `output_scores` / `output_logits` / `output_hidden_states` / `output_attentions` go (None where
    it asks for none, or returns no dict, as `generate` then returns the sequences alone). Attentions are recorded
    by the eager loop of one prompt only: refused for a batch (`batched`) or in the static mode (`static`)."""
    asked = [config.output_scores, config.output_logits, config.output_hidden_states, config.output_attentions]
    if not (config.return_dict_in_generate and any(asked)):
        return None
    if config.output_attentions and (batched or static):
        raise ValueError("output_attentions is recorded for one prompt at a time in the eager loop: pass one unpadded "
                         "prompt without cache_implementation='static', or leave output_attentions out.")
    return StepScores(*([] if wanted else None for wanted in asked))


def returned(output: torch.LongTensor | ModelOutput, config: GenerationConfig, record: StepScores | None = None
             ) -> torch.LongTensor | ModelOutput:
    """What `generate` returns: the sequences or, with `return_dict_in_generate`, a `GenerateDecoderOnlyOutput`
    holding them and the `record`ed scores, logits and hidden states (no cache is returned)."""
    if config.return_dict_in_generate and torch.is_tensor(output):
        kept = {name: None if record is None or getattr(record, name) is None else tuple(getattr(record, name))
                for name in StepScores.KINDS}
        return GenerateDecoderOnlyOutput(sequences=output, **kept)
    return output


def _max_new_tokens(config: GenerationConfig, prompt_len: int, budget: TreeBudget, target) -> int:
    max_new = config.max_new_tokens
    if max_new is None:
        max_new = (config.max_length or 20) - prompt_len
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and prompt_len + max_new + budget.total_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new}) + tree ({budget.total_tokens}) exceeds the "
            f"target's context of {limit} positions: shorten the prompt or lower max_new_tokens."
        )
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}.")
    return max_new
