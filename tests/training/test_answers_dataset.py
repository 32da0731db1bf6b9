"""The answers dataset: appended from regeneration folders, read by `datasets` and `confu-train`, never mixed."""

import json
from dataclasses import asdict

import datasets
import pytest
from test_train_cli import saved_target_and_data

from transformers_confu.training import answers_dataset
from transformers_confu.training.answers_dataset import append_answers, dataset_answers, read_card
from transformers_confu.training.data_sources import find_sources, load_conversations
from transformers_confu.training.regenerate import regenerate_responses, regeneration_settings
from transformers_confu.training.train import main

PROMPTS = [f"What is {i} + 3? Answer in words." for i in range(7)]


def _requests(path, prompts, kind):
    rows = [{"messages": [{"role": "user", "content": p}], "kind": kind, "source": "gsm8k_train.jsonl"} for p in prompts]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return datasets.Dataset.from_list([{"messages": r["messages"], "source": r["source"]} for r in rows])


def test_append_read_reuse_and_refuse(tmp_path):
    target, tokenizer, _ = saved_target_and_data(tmp_path, 1)
    first = _requests(tmp_path / "prompts_a.jsonl", PROMPTS[:4], "math_reasoning")
    regenerate_responses(first, target, tokenizer, tmp_path / "answers", batch_size=3, max_new_tokens=5)
    folder = tmp_path / "dataset"
    report = append_answers(folder, tmp_path / "answers", [str(tmp_path / "prompts_a.jsonl")], tokenizer)
    assert report["added"] == 4 and report["answer_tokens"] > 0 and report["shard"] == "train-00000.parquet"

    # More answers in the same folder: only the new ones go in, as a second shard.
    both = _requests(tmp_path / "prompts_b.jsonl", PROMPTS, "qa")
    regenerate_responses(both, target, tokenizer, tmp_path / "answers", batch_size=3, max_new_tokens=5)
    prompt_files = [str(tmp_path / "prompts_a.jsonl"), str(tmp_path / "prompts_b.jsonl")]
    report = append_answers(folder, tmp_path / "answers", prompt_files, tokenizer)
    assert (report["added"], report["already_in"]) == (3, 4)
    assert append_answers(folder, tmp_path / "answers", prompt_files, tokenizer)["added"] == 0

    card = read_card(folder)
    assert card["rows"] == 7 and card["kinds"]["math_reasoning"]["rows"] == 4 and card["kinds"]["qa"]["rows"] == 3
    assert card["sources"]["gsm8k_train.jsonl"]["license"] == "MIT"
    assert card["regeneration"] == asdict(regeneration_settings(target, max_new_tokens=5))
    assert set(card["mb_per_million_answer_tokens"]) == {"text", "token_ids"}
    assert 'download_mode="force_redownload"' in (folder / "README.md").read_text()  # the card warns of the cache
    # a cache of its own: datasets keys a local folder's cache by its name, not by its shards
    rows = datasets.load_dataset(str(folder), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(rows) == 7 and sum(rows["answer_tokens"]) == card["answer_tokens"]
    assert sorted(m[0]["content"] for m in rows["messages"]) == PROMPTS  # in the order they were answered
    assert answers_dataset.read_rows(folder, leave_out={"train-00000.parquet"})["messages"].to_pylist() == rows["messages"][4:]
    conversations = load_conversations(find_sources([str(folder)]))
    assert conversations["messages"] == rows["messages"] and conversations[0]["messages"][-1]["role"] == "assistant"

    # A regeneration reuses the dataset's answers; answers made with other settings are refused.
    settings = asdict(regeneration_settings(target, max_new_tokens=5))
    answered = dataset_answers(folder, settings)
    again = regenerate_responses(both, target, tokenizer, tmp_path / "fresh", max_new_tokens=5, answered=answered)
    assert sorted(map(json.dumps, again["messages"])) == sorted(map(json.dumps, rows["messages"]))
    assert not (tmp_path / "fresh" / "responses.jsonl").read_text()  # nothing answered twice
    with pytest.raises(ValueError, match="other settings.*max_new_tokens: 5 there, 6 here"):
        dataset_answers(folder, {**settings, "max_new_tokens": 6})
    regenerate_responses(first, target, tokenizer, tmp_path / "other", max_new_tokens=6)
    with pytest.raises(ValueError, match="other settings"):
        append_answers(folder, tmp_path / "other", prompt_files, tokenizer)

    # A folder that is not a regeneration folder stops the command before any folder is appended.
    with pytest.raises(SystemExit):
        answers_dataset.main(["--dataset", str(tmp_path / "new"), "--answers", str(tmp_path / "answers"),
                              str(tmp_path / "missing"), "--prompts", *prompt_files])
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="not a regeneration folder"):
        append_answers(folder, tmp_path / "missing", prompt_files, tokenizer)


def test_confu_train_trains_on_a_dataset_folder(tmp_path):
    target, tokenizer, _ = saved_target_and_data(tmp_path, 1)
    prompts = _requests(tmp_path / "prompts.jsonl", PROMPTS, "qa")
    regenerate_responses(prompts, target, tokenizer, tmp_path / "answers", batch_size=4, max_new_tokens=8)
    append_answers(tmp_path / "dataset", tmp_path / "answers", [str(tmp_path / "prompts.jsonl")], tokenizer)
    main(["--target", str(tmp_path / "target"), "--output-dir", str(tmp_path / "run"), "--data",
          str(tmp_path / "dataset"), "--max-length", "64", "--batch-size", "4", "--draft-vocab-size", "64",
          "--max-steps", "2", "--ttt-steps", "2", "--warmup-steps", "1"])
    record = json.loads((tmp_path / "run" / "final" / "training_record.json").read_text())
    assert record["finished"] and record["global_step"] == 2
