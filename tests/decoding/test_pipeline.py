"""The assistants in transformers' text-generation pipeline: given to `pipeline(...)` or to a call, the outputs are
the plain pipeline's and the assistant's own loop makes them."""

from __future__ import annotations

import pytest
from conftest import tiny_target, tiny_tokenizer
from test_generation import make_assistant
from transformers import pipeline

from transformers_confu import SuffixAssistant
from transformers_confu.decoding.batched import BatchStats

PROMPTS = ["t5 t9 t3 t5 t9 t3 t5", "t7 t2 t7 t2 t8 t7 t2 t7"]
ASSISTANTS = {"confu": lambda target: make_assistant(target, depth=2, top_k=2, total_tokens=4),
              "suffix": lambda target: SuffixAssistant(target, total_tokens=4)}  # budgets given: batches draft


@pytest.fixture(params=list(ASSISTANTS))
def setup(request):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    tokenizer.pad_token = "t0"
    return target, tokenizer, ASSISTANTS[request.param](target)


def texts(outputs) -> list[str]:
    return [out[0]["generated_text"] if isinstance(out, list) else out["generated_text"] for out in outputs]


@pytest.mark.parametrize("given_to", ["pipeline", "call"])
def test_pipeline_with_an_assistant_gives_the_plain_pipelines_text(setup, given_to):
    target, tokenizer, assistant = setup
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    options = dict(max_new_tokens=12, do_sample=False)
    expected = texts(plain(PROMPTS, **options))
    if given_to == "pipeline":
        assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=assistant)
        got = texts(assisted(PROMPTS, **options))
    else:
        got = texts(plain(PROMPTS, assistant_model=assistant, **options))
    assert got == expected
    assert assistant.stats.new_tokens == 12 and len(assistant.stats.accept_lengths) >= 1  # its loop ran


def test_pipeline_batches_with_an_assistant_as_plain_batches(setup):
    target, tokenizer, assistant = setup
    prompts = [PROMPTS[0], "t3 t4"]  # of different lengths: the pipeline pads the shorter one on the left
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=assistant)
    options = dict(max_new_tokens=10, do_sample=False, batch_size=2)
    assert texts(assisted(prompts, **options)) == texts(plain(prompts, **options))
    stats = assistant.stats  # the batched loop ran both rows
    assert isinstance(stats, BatchStats) and stats.mode != "plain" and len(stats.row_accept_lengths) == 2


def test_pipeline_of_another_model_explains_the_fix(setup):
    _, tokenizer, assistant = setup
    other = tiny_target(seed=1)
    assisted = pipeline("text-generation", model=other, tokenizer=tokenizer, assistant_model=assistant)
    with pytest.raises(AttributeError, match=rf"{type(assistant).__name__}.*or a pipeline.*drafts for the "
                                             rf"LlamaForCausalLM at {id(assistant.target):#x}.*BEFORE"):
        assisted(PROMPTS[0], max_new_tokens=4, do_sample=False)
