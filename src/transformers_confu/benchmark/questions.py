"""Benchmark questions in Spec-Bench's format, and chat-formatted prompts for a target's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Spec-Bench's dev half, shipped with the package (source and license: benchmark/data/NOTICE).
DEFAULT_QUESTIONS = Path(__file__).resolve().parent / "data" / "specbench_dev.jsonl"
PACKAGED_QUESTIONS = "transformers_confu/benchmark/data/specbench_dev.jsonl"  # how records name it (no machine path)


def load_questions(path: str | Path = DEFAULT_QUESTIONS, limit: int | None = None,
                   per_category: int | None = None, categories: list[str] | None = None) -> list[dict]:
    """Read `{question_id, category, turns}` rows (GSM8K `{question, answer}` rows become category `gsm8k`
    questions with the answer as `reference`); keep the `categories` given (default all), `per_category` per
    category, then `limit` overall."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No question file at {path}: pass the path of a Spec-Bench style .jsonl file.")
    rows, seen = [], {}
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "turns" not in row and {"question", "answer"} <= set(row):
                    row = dict(question_id=number, category="gsm8k", turns=[row["question"]], reference=[row["answer"]])
                assert isinstance(row["turns"], list) and row["turns"] and isinstance(row["category"], str)
            except (json.JSONDecodeError, KeyError, AssertionError, TypeError) as err:
                raise ValueError(f"{path}:{number}: not a Spec-Bench question ({err!r}).") from err
            if categories is not None and row["category"] not in categories:
                continue
            seen[row["category"]] = seen.get(row["category"], 0) + 1
            if per_category is None or seen[row["category"]] <= per_category:
                rows.append(row)
    return rows[:limit]


def chat_input_ids(tokenizer, turns: list[str], answers: list[str] = ()) -> torch.LongTensor:
    """(1, T) ids of a chat whose last user turn awaits the assistant's answer."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
    return encoded["input_ids"]
