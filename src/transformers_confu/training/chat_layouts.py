"""The common chat layouts of training rows, turned into conversations (lists of `{role, content}` turns).

Recognised, in this order (the first field present and not null decides):

- `messages`: a list of `{role, content}` turns (OpenAI / TRL); roles system, user, assistant.
- `conversations`: ShareGPT turns `{from, value}` (from: system, human/user, gpt/assistant/chatgpt/model;
  `{role, content}` turns are read too).
- `instances` with `instruction`: self-instruct, one conversation per instance `{input, output}`.
- `instruction` with optional `input` and `output` (Alpaca) or `response` (GPTeacher).
- `question` with `answer` (GSM8K).
- `data`: UltraChat, a list of alternating user / assistant turns, or one prompt string (a user-only
  conversation: answer it with `--regenerate` to train on it).
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, str]]

_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
          "chatgpt": "assistant", "model": "assistant"}
LAYOUTS = ("messages", "conversations", "instances", "instruction", "question", "data")


class MalformedRow(ValueError):
    """A row that cannot be converted to a conversation."""


def to_conversations(row: Any) -> list[Messages]:
    """The conversations held by one data row, or a `MalformedRow` saying what is wrong with it."""
    if not isinstance(row, dict):
        raise MalformedRow(f"row is a {type(row).__name__}, not an object")
    layout = next((key for key in LAYOUTS if row.get(key) is not None), None)
    if layout is None:
        raise MalformedRow(f"no chat layout recognised: expected one of the fields {list(LAYOUTS)}, "
                           f"got {sorted(row)}")
    if layout == "messages":
        return [_turns(row["messages"], "messages", "role", "content")]
    if layout == "conversations":
        turns = row["conversations"]
        keys = ("role", "content") if turns and isinstance(turns[0], dict) and "role" in turns[0] else ("from", "value")
        return [_turns(turns, "conversations", *keys)]
    if layout == "instances":
        instruction, instances = _text(row, "instruction"), row["instances"]
        if not isinstance(instances, list) or not instances:
            raise MalformedRow("field 'instances' is empty or not a list")
        return [_chat(_with_input(instruction, _text(inst, "input", allow_empty=True, default="")),
                      _text(inst, "output")) for inst in instances]
    if layout == "instruction":
        answer = "output" if row.get("output") is not None else "response"
        user = _with_input(_text(row, "instruction"), _text(row, "input", allow_empty=True, default=""))
        return [_chat(user, _text(row, answer))]
    if layout == "question":
        return [_chat(_text(row, "question"), _text(row, "answer"))]
    data = row["data"]
    if isinstance(data, str):
        return [_chat(_text(row, "data"))]
    if not isinstance(data, list) or not data or not all(isinstance(t, str) and t.strip() for t in data):
        raise MalformedRow("field 'data' must be a prompt string or a non-empty list of non-empty turn strings")
    return [[{"role": ("user", "assistant")[i % 2], "content": turn} for i, turn in enumerate(data)]]


def _turns(turns: Any, field: str, role_key: str, content_key: str) -> Messages:
    if not isinstance(turns, list) or not turns:
        raise MalformedRow(f"field {field!r} is empty or not a list")
    out = []
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        role = _ROLES.get(_text(turn, role_key, where=where).strip().lower())
        if role is None:
            raise MalformedRow(f"{where}: unknown role {turn[role_key]!r} (known: {sorted(_ROLES)})")
        content = _text(turn, content_key, allow_empty=role == "system", where=where)
        if content.strip():
            out.append({"role": role, "content": content})
    speakers = [t["role"] for t in out if t["role"] != "system"]
    if not speakers or speakers[0] != "user":
        raise MalformedRow(f"field {field!r} must start (after any system turn) with a user turn")
    return out


def _text(row: Any, key: str, allow_empty: bool = False, default: str | None = None, where: str = "") -> str:
    where = f"{where}: " if where else ""
    if not isinstance(row, dict):
        raise MalformedRow(f"{where}expected an object, got a {type(row).__name__}")
    value = row.get(key)
    value = default if value is None else value
    if value is None:
        raise MalformedRow(f"{where}field {key!r} is missing")
    if not isinstance(value, str):
        raise MalformedRow(f"{where}field {key!r} is a {type(value).__name__}, not a string")
    if not allow_empty and not value.strip():
        raise MalformedRow(f"{where}field {key!r} is empty")
    return value


def _chat(user: str, assistant: str | None = None) -> Messages:
    turns = [("user", user)] + ([("assistant", assistant)] if assistant is not None else [])
    return [{"role": role, "content": content} for role, content in turns]


def _with_input(instruction: str, inp: str) -> str:
    return f"{instruction}\n\n{inp}" if inp.strip() else instruction
