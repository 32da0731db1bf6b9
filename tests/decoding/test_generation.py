"""Lossless tree speculative decoding through `generate(assistant_model=...)`."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target, tiny_tokenizer
from transformers import DynamicCache, GenerationConfig

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.decoding.generation import (
    SpeculativeStats,
    StaticTarget,
    TreeBudget,
    speculative_generate,
)
from transformers_confu.decoding.oracle import OracleDrafter
from transformers_confu.decoding.suffix_index import CorpusIndex, tokenizer_fingerprint
from transformers_confu.decoding.tree import additive_mask
from transformers_confu.models.hub import SUFFIX_FOLDER
from transformers_confu.utils.cache import (
    cache_kwargs,
    keep_path,
    key_width,
    static_cache,
)

BUDGETS = [dict(depth=1, top_k=1, total_tokens=2), dict(depth=3, top_k=2, total_tokens=6),
           dict(depth=5, top_k=4, total_tokens=24)]


@pytest.fixture(params=["eager", "static"])
def mode(request):
    """The loop's two modes: growing caches, or static caches with fixed shapes (`cache_implementation="static"`)."""
    return request.param


def mode_kwargs(mode: str) -> dict:
    return {"cache_implementation": "static"} if mode == "static" else {}


def make_assistant(target, draft_vocab_size=64, draft_init=None, **tree):
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=draft_vocab_size)
    if draft_init is not None:
        config.initializer_range = draft_init
    return ConFuAssistant.from_config(config, target, **tree)


def plain(target, ids, **kw):
    """Plain greedy `generate` (explicit mask: it would otherwise infer padding from pad_token_id)."""
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"d{b['depth']}k{b['top_k']}n{b['total_tokens']}")
def test_greedy_identity_random_draft(arch, budget, mode):
    target = tiny_target(arch)
    assistant = make_assistant(target, **budget)
    for seed in range(6):
        torch.manual_seed(seed)
        ids = torch.randint(0, 128, (1, 3 + 4 * seed))
        ref = plain(target, ids, max_new_tokens=30)
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant, **mode_kwargs(mode))
        assert torch.equal(out, ref), f"seed {seed}"
        assert assistant.stats.mode == mode
        assert assistant.stats.new_tokens == 30
        assert sum(assistant.stats.accept_lengths) == 29  # the first token comes from the prefill


def oracle_generate(target, ids, reference, depth=4, total_tokens=10, mode="eager", **config_kw):
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, **config_kw)
    stats = SpeculativeStats()
    drafter = OracleDrafter(reference, depth, total_tokens, target.config.vocab_size)
    static = None
    if mode != "eager":
        static = StaticTarget(static_cache(target.config.num_hidden_layers, 128), target)
    if mode == "compiled":  # the eager backend runs the captured graphs; fullgraph fails on a graph break
        static.call, static.keep = (torch.compile(f, backend="eager", fullgraph=True) for f in (target, keep_path))
    out = speculative_generate(target, drafter, [1, 2, 3], ids, config, config_kw.get("max_new_tokens", 40),
                               stats, tokenizer=config_kw.get("tokenizer"), static=static)
    return out, stats


@pytest.mark.parametrize("mode", ["eager", "static", "compiled"])
def test_greedy_identity_oracle_draft(arch, mode):
    target = tiny_target(arch)
    for seed in range(5):
        torch.manual_seed(seed)
        ids = torch.randint(0, 128, (1, 5 + seed))
        ref = plain(target, ids, max_new_tokens=40)
        out, stats = oracle_generate(target, ids, ref, depth=4, total_tokens=10, mode=mode, max_new_tokens=40)
        assert torch.equal(out, ref)
        assert stats.mean_accepted_tokens > 4.5  # full chains of 4 + bonus, except near the end


def test_eos_inside_accepted_block(mode):
    target = tiny_target()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    free = plain(target, ids, max_new_tokens=40)
    eos = int(free[0, ids.shape[1] + 13])  # a token in the middle of a 5-token accepted block
    ref = plain(target, ids, max_new_tokens=40, eos_token_id=eos)
    out, stats = oracle_generate(target, ids, free, mode=mode, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out, ref)
    assert out[0, -1] == eos and out.shape[1] < free.shape[1]


@pytest.mark.parametrize("max_new", [1, 2, 13, 17])
def test_max_new_tokens_mid_block(max_new, mode):
    target = tiny_target()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    ref = plain(target, ids, max_new_tokens=max_new)
    out, stats = oracle_generate(target, ids, plain(target, ids, max_new_tokens=40), mode=mode, max_new_tokens=max_new)
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + max_new


def test_stop_strings(mode):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    free = plain(target, ids, max_new_tokens=40)
    stop = tokenizer.decode(free[0, ids.shape[1] + 9 : ids.shape[1] + 11])
    ref = plain(target, ids, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer)
    assert ref.shape[1] < free.shape[1]
    out, _ = oracle_generate(target, ids, free, mode=mode, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(out, ref)
    assistant = make_assistant(target)
    out = target.generate(ids, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer, assistant_model=assistant,
                          **mode_kwargs(mode))
    assert torch.equal(out, ref)


def test_streamer_receives_every_token(mode):
    target = tiny_target()
    assistant = make_assistant(target)

    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten())

        def end(self):
            self.ended = True

    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    streamer = Collect()
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=assistant, streamer=streamer,
                          **mode_kwargs(mode))
    assert streamer.ended and torch.equal(torch.cat(streamer.chunks), out[0])


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_kv_compaction_matches_sequential_forward(kind):
    """A tree pass then `keep_path` (with a padded path, as the loop passes it) leaves the cache that
    decoding the accepted path token by token would have built."""
    target = tiny_target()
    prefix = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    tree_tokens = torch.tensor([[11, 12, 13, 14, 15, 16]])
    parents = [-1, 0, 0, 1, 2, 3]  # node 5 has ancestors 3, 1, 0
    anc = torch.zeros(6, 6, dtype=torch.bool)
    for i, p in enumerate(parents):
        anc[i] = anc[p] if p >= 0 else anc[i]
        anc[i, i] = True
    depths = anc.sum(1) - 1
    cache = DynamicCache(config=target.config) if kind == "dynamic" else static_cache(target.config.num_hidden_layers, 32)
    target(prefix, use_cache=True, **cache_kwargs(target, cache))
    mask = additive_mask(anc, 7, torch.float32, key_width(cache, 13))
    tree_out = target(tree_tokens, position_ids=(7 + depths)[None], attention_mask=mask,
                      use_cache=True, **cache_kwargs(target, cache))
    path = [0, 1, 3, 5]
    keep_path(cache, 7, torch.tensor(path + [2, 4]), 4)
    assert int(cache.get_seq_length()) == 11
    seq_cache = DynamicCache(config=target.config)
    seq_out = target(torch.cat([prefix, tree_tokens[:, path]], 1), use_cache=True, **cache_kwargs(target, seq_cache))
    torch.testing.assert_close(tree_out.logits[0, path], seq_out.logits[0, 7:], atol=1e-5, rtol=1e-4)
    for a, b in zip(cache.layers, seq_cache.layers):
        torch.testing.assert_close(a.keys[..., :11, :], b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.values[..., :11, :], b.values, atol=1e-5, rtol=1e-4)


def test_plain_generate_untouched_by_wrapping():
    target = tiny_target()
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    ref = plain(target, ids, max_new_tokens=10)
    make_assistant(target)
    assert torch.equal(plain(target, ids, max_new_tokens=10), ref)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty"),
        (dict(num_beams=2), "num_beams"),
        (dict(guidance_scale=2.0), "guidance_scale"),
        (dict(attention_mask=torch.tensor([[1, 1, 1, 0]])), "Right padding"),
        (dict(max_new_tokens=600), "context"),
        (dict(stop_strings=["x"]), "tokenizer"),
        (dict(tree_total_tokens=0), "Tree budget"),
        (dict(tree_top_k=65), "exceeds the draft vocabulary"),
        (dict(return_dict_in_generate=True, output_attentions=True, cache_implementation="static"),
         "output_attentions"),
        (dict(penalty_alpha=0.6, top_k=4), "contrastive search"),  # plain generate would fetch it from the Hub
        (dict(dola_layers="low"), "dola generation"),
        (dict(force_words_ids=[[5]]), "constrained beam search"),
        (dict(token_healing=True), "token_healing"),
        (dict(cache_implementation="offloaded"), "cache_implementation"),
        (dict(past_key_values=DynamicCache()), "keeps the caches of its last call"),
    ],
)
def test_unsupported_inputs_raise_clear_errors(kwargs, match):
    target = tiny_target()
    assistant = make_assistant(target)
    kwargs = {"input_ids": torch.ones(1, 4, dtype=torch.long), "max_new_tokens": 5, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        target.generate(assistant_model=assistant, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(do_sample=True), dict(do_sample=True, temperature=0.5, top_p=0.9),
                                    dict(max_new_tokens=7), dict(generation_config=GenerationConfig(top_k=3))])
def test_generation_config_merged_as_generate_does(kwargs):
    """Same settings as plain generate, including its global defaults (top_k=50 when sampling)."""
    from transformers_confu.decoding.assistant import _generation_config

    target = tiny_target()
    target.generation_config.eos_token_id = 5
    ours = _generation_config(target, dict(kwargs))
    theirs, _ = target._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
    assert ours.to_dict() == theirs.to_dict()
    assert ours.eos_token_id == 5 and (not ours.do_sample or ours.top_k in (50, 3))


def test_unknown_generate_argument_raises():
    target = tiny_target()
    assistant = make_assistant(target)
    with pytest.raises(TypeError, match="frobnicate"):
        target.generate(torch.ones(1, 4, dtype=torch.long), assistant_model=assistant, frobnicate=1)


def test_generate_of_unprepared_model_explains_the_fix():
    target, other = tiny_target(), tiny_target()
    assistant = make_assistant(target)
    with pytest.raises(AttributeError, match=rf"drafts for the LlamaForCausalLM at {id(target):#x}.*Build one for "
                                             r"the model you call.*target_model=model.*BEFORE"):
        other.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, assistant_model=assistant)


def test_assistant_passed_to_another_prepared_model_names_both():
    target, other = tiny_target(), tiny_target()
    assistant = make_assistant(target)
    make_assistant(other)  # prepares other.generate
    with pytest.raises(ValueError, match=rf"drafts for the LlamaForCausalLM at {id(target):#x}, not for the model "
                                         rf"whose generate\(\) was called \(the LlamaForCausalLM at {id(other):#x}\)"):
        other.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, assistant_model=assistant)


def test_draft_for_other_target_raises():
    draft_target, other = tiny_target(), tiny_target(vocab_size=96)
    config = ConFuDraftConfig.for_target(draft_target, draft_vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size: draft expects 128, target has 96"):
        ConFuAssistant.from_config(config, other)


def test_assistant_save_and_load_roundtrip(tmp_path):
    target = tiny_target()
    assistant = make_assistant(target, depth=3, top_k=2, total_tokens=6)
    assistant.save_pretrained(tmp_path)
    loaded = ConFuAssistant.from_pretrained(tmp_path, target_model=target, depth=3, top_k=2, total_tokens=6)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(7))
    out_a = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    stats_a = list(assistant.stats.accept_lengths)
    out_b = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=loaded)
    assert torch.equal(out_a, out_b) and stats_a == loaded.stats.accept_lengths


def test_static_mode_refuses_sliding_window_targets():
    target = tiny_target("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assistant = make_assistant(target)
    with pytest.raises(ValueError, match="full-attention"):
        target.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=5, assistant_model=assistant,
                        cache_implementation="static")


def test_compiled_static_mode_is_exact_without_graph_breaks_or_recompiles():
    """`compile_config` compiles the tree pass and draft step (here with the `eager` backend, which runs the
    captured graphs as they are: `fullgraph=True` fails on any graph break). Prompts of other lengths in the
    same capacity bucket, and later calls, reuse the compiled graphs and the caches."""
    from test_sampling import compiled_static
    from torch._dynamo.utils import counters

    target = tiny_target()
    assistant = make_assistant(target, depth=3, top_k=2, total_tokens=6)
    graphs = []
    for seed, length in enumerate([5, 11, 23]):
        ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed))
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant,
                              **compiled_static())
        assert torch.equal(out, plain(target, ids, max_new_tokens=30)), f"prompt of {length}"
        assert assistant.stats.mode == "static"
        assert (assistant.stats.compile_seconds > 0) == (seed == 0)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0] == graphs[2]


def test_corpus_beside_a_draft_brings_its_hybrid_budget_unless_the_call_gives_one(tmp_path, monkeypatch):
    """The hybrid budget saved with a corpus (nodes, suffix candidates, the draft's top-k, its top-k when sampling)
    is the default with that corpus; a caller's values win, and the draft alone (`suffix=False`) keeps the tree
    saved in its config."""
    import transformers_confu.decoding.assistant as assistant_module

    target, tokenizer = tiny_target(), tiny_tokenizer()
    draft = make_assistant(target).draft
    draft.config.tree_depth, draft.config.tree_top_k, draft.config.tree_total_tokens = 2, 2, 4
    draft.save_pretrained(tmp_path)
    meta = dict(tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), tokenizer_name="tiny",
                hybrid=dict(total_tokens=6, suffix_nodes=4, top_k=3, sampling_top_k=1))
    CorpusIndex.build([[3, 4, 5, 6], [4, 5, 7]], meta).save_pretrained(tmp_path / SUFFIX_FOLDER)

    def load(**options):
        assistant = ConFuAssistant.from_pretrained(tmp_path, target_model=target, tokenizer=tokenizer, **options)
        return assistant.budget, assistant.suffix and assistant.suffix.max_nodes, assistant.sampling_top_k

    assert load() == (TreeBudget(depth=2, top_k=3, total_tokens=6), 4, 1)
    assert load(top_k=2, suffix_nodes=2) == (TreeBudget(depth=2, top_k=2, total_tokens=6), 2, None)
    assert load(suffix=False) == (TreeBudget(depth=2, top_k=2, total_tokens=4), None, None)

    drafted = []  # the top-k each call's drafter got
    tree_drafter = assistant_module.TreeDrafter
    monkeypatch.setattr(assistant_module, "TreeDrafter", lambda draft, depth, top_k, *rest, **kw: (
        drafted.append(top_k), tree_drafter(draft, depth, top_k, *rest, **kw))[1])
    assistant = ConFuAssistant.from_pretrained(tmp_path, target_model=target, tokenizer=tokenizer)
    ids = torch.randint(3, target.config.vocab_size, (1, 9))
    for sampling in [dict(do_sample=False), dict(do_sample=True), dict(do_sample=True, tree_top_k=2)]:
        target.generate(ids, max_new_tokens=4, assistant_model=assistant, **sampling)
    assert drafted == [3, 1, 2]


def test_draft_dtype_auto_halves_only_a_float32_target_on_a_native_bfloat16_cpu(monkeypatch):
    """"auto": bfloat16 for a float32 target on a CPU with native bfloat16 products, else the target's dtype; an
    explicit dtype (or its name) wins; anything else is refused with the values to use."""
    import transformers_confu.decoding.assistant as assistant_module

    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64)
    for native, expected in [(True, torch.bfloat16), (False, torch.float32)]:
        monkeypatch.setattr(assistant_module, "native_bf16", lambda native=native: native)
        assert ConFuAssistant.from_config(config, target).draft.dtype == expected
        assert ConFuAssistant.from_config(config, target, draft_dtype="float32").draft.dtype == torch.float32
        assert ConFuAssistant.from_config(config, target, draft_dtype=torch.bfloat16).draft.dtype == torch.bfloat16
    monkeypatch.setattr(assistant_module, "native_bf16", lambda: True)
    assert ConFuAssistant.from_config(config, target.to(torch.bfloat16)).draft.dtype == torch.bfloat16
    assert target.dtype == torch.bfloat16  # the target is never cast
    for wrong in ["bf16", torch.long, 3, "float8_e4m3fn"]:
        with pytest.raises(ValueError, match="use 'auto' or one of 'float32', 'bfloat16'"):
            ConFuAssistant.from_config(config, target, draft_dtype=wrong)



def test_a_draft_run_in_a_narrower_dtype_saves_its_weights_as_given(tmp_path):
    """An assistant that runs a float32 draft in bfloat16 saves (and exports) the float32 weights it was given, bit
    for bit, and runs in bfloat16 again afterwards."""
    from safetensors.torch import load_file

    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64)
    given = {k: v.clone() for k, v in ConFuAssistant.from_config(config, target, draft_dtype="float32").draft.state_dict().items()}
    narrowed = ConFuAssistant.from_config(config, target, draft_dtype="bfloat16")
    narrowed.draft.to(torch.float32).load_state_dict(given)
    narrowed = ConFuAssistant(narrowed.draft, target, draft_dtype="bfloat16")
    assert narrowed.draft.dtype == torch.bfloat16
    narrowed.save_pretrained(tmp_path / "ours")
    narrowed.save_pretrained(tmp_path / "eagle3", format="eagle3")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in given.items() if k in saved) and saved["lm_head.weight"].dtype == torch.float32
    assert load_file(tmp_path / "eagle3" / "model.safetensors")["lm_head.weight"].dtype == torch.float32
    assert narrowed.draft.dtype == torch.bfloat16
    assert narrowed.draft.rotary_emb.inv_freq.dtype == torch.float32  # frequencies are never rounded
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    out = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=narrowed)
    assert torch.equal(out, plain(target, ids, max_new_tokens=8))

    # weights loaded after the assistant was built are saved as they are now (with a warning), not the stale copy
    trained = {k: v + 0.5 if v.is_floating_point() else v for k, v in given.items()}
    narrowed.draft.load_state_dict(trained)
    with pytest.warns(UserWarning, match="changed after the assistant was built"):
        narrowed.save_pretrained(tmp_path / "later")
    saved = load_file(tmp_path / "later" / "model.safetensors")
    assert torch.equal(saved["lm_head.weight"], trained["lm_head.weight"].to(torch.bfloat16).float())
    # weights that bfloat16 holds exactly keep no copy and are saved as given all the same
    exact = {k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in given.items()}
    draft = ConFuAssistant.from_config(config, target, draft_dtype="float32").draft
    draft.load_state_dict(exact)
    lossless = ConFuAssistant(draft, target, draft_dtype="bfloat16")
    assert lossless._given is None
    lossless.save_pretrained(tmp_path / "exact")
    saved = load_file(tmp_path / "exact" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in exact.items() if k in saved)


@pytest.mark.parametrize("kind", ["eagle3", "confu"])
def test_bfloat16_draft_beside_a_float32_target_is_lossless(arch, kind, mode):
    """A draft run in bfloat16 (started from the target's head and last layer, so that many of its tokens are
    accepted) gives plain `generate`'s greedy outputs, one prompt at a time and in a batch."""
    from transformers_confu import ConFuDraftModel

    target = tiny_target(arch)
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=128, contemplate=kind == "confu")
    draft = ConFuDraftModel(config)
    draft.init_from_target(target, ("head", "norm", "fc", "layer"))
    assistant = ConFuAssistant.from_config(config, target, draft_dtype="bfloat16", depth=3, top_k=2, total_tokens=6)
    assistant.draft.load_state_dict(draft.state_dict())
    assert assistant.draft.dtype == torch.bfloat16 and target.dtype == torch.float32
    drafted = 0
    for seed in range(4):
        ids = torch.randint(0, 128, (1, 4 + 5 * seed), generator=torch.Generator().manual_seed(seed))
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant, **mode_kwargs(mode))
        assert torch.equal(out, plain(target, ids, max_new_tokens=24)), f"seed {seed}"
        drafted += sum(n - 1 for n in assistant.stats.accept_lengths)
    assert drafted > 0  # some drafted tokens were accepted: the bfloat16 draft's proposals were used
    batch = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(batch)
    out = target.generate(batch, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                          assistant_model=assistant, **mode_kwargs(mode))
    assert torch.equal(out, plain(target, batch, max_new_tokens=16))


def test_max_time_stops_as_plain_generate(mode):
    """`max_time`: 0 stops after the first token as plain `generate` does; a short limit cuts the greedy output
    (until now it was ignored with an assistant)."""
    target = tiny_target()
    assistant = make_assistant(target, depth=2, top_k=2, total_tokens=4)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    free = plain(target, ids, max_new_tokens=400)
    for limit in (0.0, 1e6):
        out = target.generate(ids, max_new_tokens=400, do_sample=False, assistant_model=assistant, max_time=limit,
                              **mode_kwargs(mode))
        assert torch.equal(out, plain(target, ids, max_new_tokens=400, max_time=limit))
    assert out.shape[1] == 406
    out = target.generate(ids, max_new_tokens=400, do_sample=False, assistant_model=assistant, max_time=0.05,
                          **mode_kwargs(mode))
    assert ids.shape[1] < out.shape[1] < 406 and torch.equal(out[0], free[0, : out.shape[1]])


def test_stats_print_as_one_summary_line():
    """`print(assistant.stats)`: the call's counts, tau and times on one line (the repr lists every round); the
    batch policy's plain generate says so."""
    target = tiny_target()
    assistant = make_assistant(target, depth=2, top_k=1, total_tokens=3)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    stats = assistant.stats
    line = str(stats)
    assert "\n" not in line and line.startswith(f"eager loop: 12 new tokens in {stats.target_forwards} target passes")
    assert f"tau {stats.mean_accepted_tokens:.2f}" in line and "accept_lengths" in repr(stats)
    batch = torch.randint(1, 128, (4, 5), generator=torch.Generator().manual_seed(1))
    policy = make_assistant(target)
    target.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=6, do_sample=False, pad_token_id=0,
                    assistant_model=policy)
    assert str(policy.stats).startswith("plain generate (the batch policy): 24 new tokens in ")
    target.generate(batch[:2], attention_mask=torch.ones_like(batch[:2]), max_new_tokens=6, do_sample=False,
                    pad_token_id=0, assistant_model=policy)  # batch 2: a chain per row
    taus = [sum(r) / len(r) for r in policy.stats.row_accept_lengths]
    assert str(policy.stats).startswith("eager loop: 12 new tokens in ")
    assert str(policy.stats).endswith(f"; 2 rows, tau {min(taus):.2f}-{max(taus):.2f}")
