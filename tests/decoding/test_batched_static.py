"""The static mode of the batched loop (`cache_implementation="static"` on a batch): preallocated caches kept on
the assistant, each row exactly what plain batched `generate` gives on the same padded batch; compiled, finished
rows stay in the batch and every pass keeps its shapes."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from test_batched import left_padded, noisy_oracles, plain
from test_batched_suffix import check_rows
from test_generation import make_assistant
from test_sampling import compiled_static
from test_suffix import hybrid_assistant, suffix_assistant
from transformers import GenerationConfig
from transformers.cache_utils import StaticLayer

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.decoding.batched import BatchStats, batched_generate
from transformers_confu.decoding.generation import StaticTarget
from transformers_confu.utils.cache import FilledStaticLayer, static_cache

STATIC = dict(cache_implementation="static")
KINDS = {"chain": lambda t: make_assistant(t, depth=3, top_k=1, total_tokens=4),
         "tree": lambda t: make_assistant(t, depth=3, top_k=2, total_tokens=6),  # RowDrafters
         "hybrid": lambda t: hybrid_assistant(t, depth=2, top_k=2, total_tokens=7),
         "suffix": lambda t: suffix_assistant(t, total_tokens=5),
         "confu": lambda t: ConFuAssistant.from_config(  # [f] entries and the [con] prior: RowDrafters
             ConFuDraftConfig.for_target(t, draft_vocab_size=64, contemplate=True, future_entry=True,
                                         future_logit_weight=0.5), t, depth=3, top_k=2, total_tokens=6)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_static_batches_match_plain_batched_generate(arch, kind):
    target = tiny_target(arch)
    assistant = KINDS[kind](target)
    check_rows(target, assistant, seeds=range(3), max_new=16, **STATIC)
    layers = assistant._static["target"].cache.layers
    assert isinstance(layers[0], FilledStaticLayer)  # uncompiled on a CPU: attention over the filled positions


def test_eos_and_max_new_tokens_per_row_in_static_batches():
    target = tiny_target()
    assistant = make_assistant(target)
    ids, mask = left_padded(7, [5, 9, 3, 7])
    free = plain(target, ids, mask, max_new_tokens=30)
    eos = int(free[1, ids.shape[1] + 4])  # row 1 stops early (and leaves the batch), the others where it comes
    for max_new in (30, 2):
        ref = plain(target, ids, mask, max_new_tokens=max_new, eos_token_id=eos)
        out = plain(target, ids, mask, max_new_tokens=max_new, eos_token_id=eos, assistant_model=assistant,
                    tree_depth=3, tree_top_k=2, tree_total_tokens=6, **STATIC)
        assert torch.equal(out, ref) and assistant.stats.mode == "static", f"max_new_tokens={max_new}"


def test_static_caches_kept_across_calls_and_rebuilt_for_another_batch_size():
    target = tiny_target()
    assistant = make_assistant(target, depth=2, top_k=1, total_tokens=3)
    ids, mask = left_padded(3, [4, 9, 6])
    eos = int(plain(target, ids, mask, max_new_tokens=20)[0, ids.shape[1] + 3])  # row 0 leaves the batch early
    options = dict(max_new_tokens=20, eos_token_id=eos)
    ref = plain(target, ids, mask, **options)
    assert torch.equal(plain(target, ids, mask, assistant_model=assistant, **options, **STATIC), ref)
    parts = assistant._static
    buffers = [layer.keys.data_ptr() for layer in parts["target"].cache.layers]
    assert parts["target"].cache.layers[0].keys.shape[0] < 3  # the finished rows left: views of the first rows
    ids2, mask2 = left_padded(4, [8, 2, 5])  # another batch in the same capacity: the same caches, whole again
    out = plain(target, ids2, mask2, assistant_model=assistant, **options, **STATIC)
    assert torch.equal(out, plain(target, ids2, mask2, **options))
    assert assistant._static is parts and [layer.keys.data_ptr() for layer in parts["target"].cache.layers] == buffers
    out = plain(target, ids2[:2], mask2[:2], assistant_model=assistant, **options, **STATIC)  # 2 rows: new caches
    assert torch.equal(out, plain(target, ids2[:2], mask2[:2], **options))
    assert assistant._static is not parts and assistant._static["target"].cache.layers[0].keys.shape[0] == 2


def test_rows_accepting_different_lengths_stay_exact_in_static_caches(arch):
    target = tiny_target(arch)
    ids, mask = left_padded(1, [2, 11, 6, 9])
    ref = plain(target, ids, mask, max_new_tokens=40)
    cache = static_cache(target.config.num_hidden_layers, 256, filled_only=True)
    out = batched_generate(target, noisy_oracles(ref, mask, 5, 9), [1, 2, 3], ids, mask,
                           GenerationConfig(do_sample=False, pad_token_id=0), 40, BatchStats(),
                           static=StaticTarget(cache, target))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kind", ["chain", "confu"])
def test_compiled_static_batches_keep_their_shapes(kind):
    """Compiled (the `eager` backend runs the captured graphs as they are; `fullgraph=True` fails on a graph
    break): exact, with a row that finishes early kept in the batch, and a second batch of other prompt lengths
    in the same capacity reuses every graph."""
    from torch._dynamo.utils import counters

    target = tiny_target()
    assistant = KINDS[kind](target)
    ids, mask = left_padded(5, [3, 8, 5])
    eos = int(plain(target, ids, mask, max_new_tokens=16)[1, ids.shape[1] + 2])
    graphs = []
    for seed, lengths in enumerate([[3, 8, 5], [7, 2, 4]]):
        ids, mask = left_padded(5 + seed, lengths)
        out = plain(target, ids, mask, max_new_tokens=16, eos_token_id=eos, assistant_model=assistant,
                    **compiled_static())
        assert torch.equal(out, plain(target, ids, mask, max_new_tokens=16, eos_token_id=eos)), f"batch {seed}"
        assert assistant.stats.mode == "static" and (assistant.stats.compile_seconds > 0) == (seed == 0)
        graphs.append(counters["stats"]["unique_graphs"])
    assert type(assistant._static["target"].cache.layers[0]) is StaticLayer
    assert graphs[0] > 0 and graphs[1] == graphs[0]
