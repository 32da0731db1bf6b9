"""Suffix drafting through `generate`: `SuffixAssistant` and hybrid trees are lossless (greedy identity,
stopping inside copied blocks, streamer, static and compiled modes) and sampling stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import LastTokenIs, tiny_target, tiny_tokenizer
from test_generation import make_assistant, mode_kwargs, plain
from test_sampling import compiled_static, exact_distribution, p_value, sampled_counts
from transformers import StoppingCriteriaList

import transformers_confu.decoding.verify as verify
from transformers_confu import ConFuAssistant, ConFuDraftConfig, SuffixAssistant
from transformers_confu.decoding.suffix import SuffixProposer
from transformers_confu.decoding.suffix_index import CorpusIndex, tokenizer_fingerprint


@pytest.fixture(params=["eager", "static"])
def mode(request):
    return request.param


def repetitive_prompt(seed: int, vocab: int = 128) -> torch.LongTensor:
    """A prompt that repeats a phrase: the sequence source has matches from the first round."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, vocab, (1, 4 + seed % 5), generator=g)
    return torch.cat([torch.randint(0, vocab, (1, 3), generator=g), phrase, phrase[:, : 2 + seed % 3]], dim=1)


def oracle_corpus(target, prompts: list[torch.LongTensor], max_new: int = 60, **kwargs) -> CorpusIndex:
    """A corpus of the target's own greedy answers (each with its prompt; `kwargs`: more generate() settings): from
    it the suffix proposer proposes the true continuation, so blocks of many tokens are accepted."""
    tokenizer = tiny_tokenizer()
    docs = [plain(target, ids, max_new_tokens=max_new, **kwargs)[0].tolist() for ids in prompts]
    return CorpusIndex.build(docs, dict(tokenizer_fingerprint=tokenizer_fingerprint(tokenizer)))


def suffix_assistant(target, corpus=None, **settings) -> SuffixAssistant:
    return SuffixAssistant(target, corpus=corpus, tokenizer=tiny_tokenizer(), **settings)


def hybrid_assistant(target, corpus=None, **tree) -> ConFuAssistant:
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64)
    return ConFuAssistant.from_config(config, target, suffix=SuffixProposer(corpus, max_nodes=5), **tree)


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_greedy_identity_over_prompts_seeds_and_architectures(arch, kind, mode):
    target = tiny_target(arch)
    assistant = (suffix_assistant(target, total_tokens=6) if kind == "suffix"
                 else hybrid_assistant(target, depth=3, top_k=2, total_tokens=9))
    accepted = {}
    for seed in range(6):
        ids = repetitive_prompt(seed) if seed % 2 else torch.randint(0, 128, (1, 3 + 3 * seed),
                                                                     generator=torch.Generator().manual_seed(seed))
        ref = plain(target, ids, max_new_tokens=30)
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant, **mode_kwargs(mode))
        assert torch.equal(out, ref), f"seed {seed}"
        assert assistant.stats.new_tokens == 30 and assistant.stats.mode == mode
        for source, count in assistant.stats.accepted_by_source.items():
            accepted[source] = accepted.get(source, 0) + count
    assert accepted.get("suffix", 0) > 0  # copied tokens were accepted


def test_corpus_of_own_answers_gives_long_accepted_blocks(arch, mode):
    target = tiny_target(arch)
    prompts = [torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    assistant = suffix_assistant(target, oracle_corpus(target, prompts), total_tokens=8)
    for ids in prompts:
        out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant, **mode_kwargs(mode))
        assert torch.equal(out, plain(target, ids, max_new_tokens=40))
        assert assistant.stats.mean_accepted_tokens > 3 and assistant.stats.suffix_seconds > 0


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_eos_stop_strings_and_max_new_tokens_inside_a_copied_block(kind, mode):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    corpus = oracle_corpus(target, [ids])
    assistant = (suffix_assistant(target, corpus, total_tokens=8) if kind == "suffix"
                 else hybrid_assistant(target, corpus, depth=2, top_k=1, total_tokens=8))
    free = plain(target, ids, max_new_tokens=40)
    eos = int(free[0, ids.shape[1] + 13])
    cases = [dict(eos_token_id=eos), dict(max_new_tokens=13), dict(max_new_tokens=2),
             dict(stop_strings=[tokenizer.decode(free[0, ids.shape[1] + 9 : ids.shape[1] + 11])], tokenizer=tokenizer),
             dict(stopping_criteria=StoppingCriteriaList([LastTokenIs(int(free[0, ids.shape[1] + 11]))]))]
    for case in cases:
        case = dict(max_new_tokens=40) | case
        ref = plain(target, ids, **case)
        out = target.generate(ids, do_sample=False, assistant_model=assistant, **case, **mode_kwargs(mode))
        assert torch.equal(out, ref), case
        assert max(assistant.stats.accept_lengths) > 2  # stopped inside a block of several accepted tokens


def test_streamer_receives_every_token(mode):
    target = tiny_target()
    ids = repetitive_prompt(3)
    assistant = suffix_assistant(target, oracle_corpus(target, [ids]))
    chunks, ended = [], []
    streamer = type("Collect", (), {"put": lambda self, value: chunks.append(value.flatten()),
                                    "end": lambda self: ended.append(True)})()
    out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant, streamer=streamer,
                          **mode_kwargs(mode))
    assert ended and torch.equal(torch.cat(chunks), out[0])
    assert max(assistant.stats.accept_lengths) > 2


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_compiled_static_mode_is_exact_without_graph_breaks_or_recompiles(kind):
    from torch._dynamo.utils import counters

    target = tiny_target()
    assistant = (suffix_assistant(target, total_tokens=6) if kind == "suffix"
                 else hybrid_assistant(target, depth=3, top_k=2, total_tokens=8))
    graphs = []
    for seed in range(3):
        ids = repetitive_prompt(seed + 1)
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant, **compiled_static())
        assert torch.equal(out, plain(target, ids, max_new_tokens=30)), f"seed {seed}"
        assert (assistant.stats.compile_seconds > 0) == (seed == 0)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0] == graphs[2]


def test_suffix_switch_and_bad_settings():
    target = tiny_target()
    ids = repetitive_prompt(5)
    assistant = hybrid_assistant(target, depth=2, top_k=1, total_tokens=6)
    target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=assistant, suffix=False)
    assert assistant.stats.accepted_by_source == {} and assistant.stats.suffix_seconds == 0
    with pytest.raises(ValueError, match="at least 2 nodes"):
        SuffixAssistant(target, total_tokens=1)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        target.generate(ids, max_new_tokens=5, assistant_model=suffix_assistant(target), tree_total_tokens=1)
    with pytest.raises(ValueError, match="another tokenizer"):
        SuffixAssistant(target, corpus=CorpusIndex.build([[1, 2, 3]], dict(tokenizer_fingerprint="0" * 16)),
                        tokenizer=tiny_tokenizer())


# Sampling: the tiny vocabulary of test_sampling, a prompt whose suffix recurs so that candidates are proposed.
VOCAB, PROMPT = 6, torch.tensor([1, 4, 2, 1, 4])


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny_target(vocab_size=VOCAB, init=0.15, seed=3)
    return target, exact_distribution(target, PROMPT)


def sampling_hybrid(target):
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=4)
    config.initializer_range = 0.4  # a confident draft that is often wrong: many rejections
    assistant = ConFuAssistant.from_config(config, target, suffix=SuffixProposer(max_nodes=3, max_depth=3),
                                           depth=2, top_k=2, total_tokens=6)
    assistant.draft.set_vocab_map(torch.tensor([0, 2, 3, 5]))  # tokens 1 and 4 come from the suffix only
    return assistant


@pytest.mark.parametrize("kind, mode", [("suffix", "eager"), ("hybrid", "eager"), ("hybrid", "compiled")])
def test_sampling_matches_exact_target_distribution(sampling_setup, kind, mode):
    target, exact = sampling_setup
    assistant = SuffixAssistant(target, total_tokens=4, max_depth=3) if kind == "suffix" else sampling_hybrid(target)
    options = {"eager": {}, "static": dict(cache_implementation="static"), "compiled": compiled_static()}[mode]
    counts = sampled_counts(target, assistant, PROMPT, **options)
    assert p_value(exact, counts) > 1e-3


def test_suffix_candidates_are_accepted_when_sampling(sampling_setup):
    target, _ = sampling_setup
    assistant = sampling_hybrid(target)
    torch.manual_seed(0)
    accepted = 0
    for _ in range(40):
        target.generate(PROMPT[None], max_new_tokens=3, do_sample=True, temperature=0.8, top_k=5,
                        assistant_model=assistant)
        accepted += assistant.stats.accepted_by_source.get("suffix", 0)
    assert accepted > 0


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_a_wrong_point_mass_rule_is_detected(sampling_setup, kind, monkeypatch):
    """Keeping a rejected suffix token in the residual (not zeroing it) over-samples it: the test must fail."""
    target, exact = sampling_setup
    assistant = SuffixAssistant(target, total_tokens=4, max_depth=3) if kind == "suffix" else sampling_hybrid(target)
    monkeypatch.setattr(verify, "without_token", lambda p, x: p)
    counts = sampled_counts(target, assistant, PROMPT)
    assert p_value(exact, counts) < 1e-6
