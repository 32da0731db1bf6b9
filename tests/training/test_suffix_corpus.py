"""The suffix corpus builder: its sources, the tokenizer fingerprint, the calibration, bad input."""

from __future__ import annotations

import json

import pytest
from conftest import chat_tokenizer

from transformers_confu.decoding.suffix import SuffixProposer
from transformers_confu.decoding.suffix_index import CorpusIndex
from transformers_confu.training.regenerate import prompt_key
from transformers_confu.training.suffix_corpus import build_corpus, main, read_rows

ANSWERS = ["The answer is 5. The answer is 5.", "def add(a, b): return a + b", "Hello there! How are you today?",
           "Natalia sold 48 clips in April.", "I am fine, thank you. I am fine."] * 4


def regeneration_folder(tmp_path):
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(len(ANSWERS))]
    (tmp_path / "regen" / "answers").mkdir(parents=True)
    (tmp_path / "regen" / "prompts.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in prompts))
    (tmp_path / "regen" / "answers" / "responses.jsonl").write_text("".join(
        json.dumps({"key": prompt_key(m), "response": a}) + "\n" for m, a in zip(prompts, ANSWERS)))
    return tmp_path / "regen"


def test_sources_give_prompts_and_answers(tmp_path):
    rows = list(read_rows(regeneration_folder(tmp_path)))
    assert [a for _, a in rows] == ANSWERS and rows[0][0] == [{"role": "user", "content": "question 0"}]
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                     + "\n" + json.dumps({"response": "b"}) + "\n")
    assert list(read_rows(chats)) == [([{"role": "user", "content": "q"}], "a"), (None, "b")]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match="has no answer.*messages.*response"):
        list(read_rows(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError, match="No corpus source"):
        list(read_rows(tmp_path / "missing"))


def test_build_saves_a_calibrated_corpus_for_its_tokenizer(tmp_path, monkeypatch):
    tokenizer = chat_tokenizer()
    index, report = build_corpus(list(read_rows(regeneration_folder(tmp_path))), tokenizer, calibration_fraction=0.25)
    assert report["answers"] == len(ANSWERS) and report["calibration_answers"] == 5 and report["bytes"] > 0
    assert index.meta["calibration"]["trials"] and index.meta["tokens"] == report["tokens"]
    assert SuffixProposer(index).calibration.trials.sum() > 0  # the saved calibration is used
    with pytest.raises(ValueError, match="empty"):
        build_corpus([(None, "  ")], tokenizer)


def test_command_writes_a_loadable_folder(tmp_path, monkeypatch):
    tokenizer = chat_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    argv = [str(regeneration_folder(tmp_path)), "--out", str(tmp_path / "corpus"), "--tokenizer", str(tmp_path / "tok"),
            "--hybrid-total-tokens", "8", "--hybrid-suffix-nodes", "5", "--hybrid-top-k", "2", "--hybrid-sampling-top-k", "1",
            "--hybrid-chosen-by", "the fastest of two"]
    report = main(argv)
    loaded = CorpusIndex.from_pretrained(tmp_path / "corpus", tokenizer=tokenizer)
    assert loaded.meta["hybrid"] == {"total_tokens": 8, "suffix_nodes": 5, "top_k": 2, "sampling_top_k": 1,
                                     "chosen_by": "the fastest of two"}
    assert loaded.meta["sources"] == argv[:1]
    assert loaded.meta["command"].split()[:3] == ["python", "-m", "transformers_confu.training.suffix_corpus"]
    assert loaded.meta["command"].endswith("--hybrid-chosen-by 'the fastest of two'")
    assert loaded.meta["build"]["answers"] == report["answers"] == len(ANSWERS)
