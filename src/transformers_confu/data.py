"""Training data for the draft head: load chat data, tokenize with loss masks, build the draft vocabulary,
collate batches and regenerate answers with the target model (self-distillation)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "train"
Messages = list[dict[str, str]]
_STRING = datasets.Value("string")
FEATURES = datasets.Features({"messages": [{"role": _STRING, "content": _STRING}], "source": _STRING})


class MalformedRow(ValueError):
    """A row of a data file that cannot be converted to a conversation."""


def _field(row: dict, key: str, allow_empty: bool = False, default: str | None = None) -> str:
    if not isinstance(row, dict):
        raise MalformedRow(f"row is a {type(row).__name__}, not an object")
    value = row.get(key, default)
    if value is None:
        raise MalformedRow(f"field {key!r} is missing")
    if not isinstance(value, str):
        raise MalformedRow(f"field {key!r} is a {type(value).__name__}, not a string")
    if not allow_empty and not value.strip():
        raise MalformedRow(f"field {key!r} is empty")
    return value


def _chat(user: str, assistant: str | None = None) -> Messages:
    turns = [("user", user)] + ([("assistant", assistant)] if assistant is not None else [])
    return [{"role": role, "content": content} for role, content in turns]


def _with_input(instruction: str, inp: str) -> str:
    return f"{instruction}\n\n{inp}" if inp.strip() else instruction


def convert_gsm8k(row: dict) -> list[Messages]:
    return [_chat(_field(row, "question"), _field(row, "answer"))]


def convert_gpteacher(row: dict) -> list[Messages]:
    user = _with_input(_field(row, "instruction"), _field(row, "input", allow_empty=True, default=""))
    return [_chat(user, _field(row, "response"))]


def convert_self_instruct(row: dict) -> list[Messages]:
    instruction = _field(row, "instruction")
    instances = row.get("instances")
    if not isinstance(instances, list) or not instances:
        raise MalformedRow("field 'instances' is missing, empty or not a list")
    return [
        _chat(_with_input(instruction, _field(inst, "input", allow_empty=True, default="")), _field(inst, "output"))
        for inst in instances
    ]


def convert_ultrachat(row: dict) -> list[Messages]:
    """Prompts only: a user-only conversation (answer it with `regenerate_responses` to train on it)."""
    return [_chat(_field(row, "data"))]


CONVERTERS: dict[str, Callable[[dict], list[Messages]]] = {
    "gsm8k_train.jsonl": convert_gsm8k,
    "gpteacher_codegen_instruct.json": convert_gpteacher,
    "gpteacher_roleplay_instruct.json": convert_gpteacher,
    "self_instruct_user_oriented.jsonl": convert_self_instruct,
    "ultrachat_ultra_eval.json": convert_ultrachat,
}


def _read_rows(path: Path):
    """Yield (location, row) pairs; a bad JSONL line is yielded as (location, exception)."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path.name} line {lineno}", json.loads(line)
                    except json.JSONDecodeError as e:
                        yield f"{path.name} line {lineno}", MalformedRow(f"invalid JSON: {e}")
        return
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name}: not a valid JSON file: {e}") from e
    if not isinstance(rows, list):
        raise ValueError(f"{path.name}: expected a JSON array, got a {type(rows).__name__}")
    for index, row in enumerate(rows):
        yield f"{path.name} item {index}", row


def _load_file(path: Path, on_error: str) -> list[dict]:
    converter = CONVERTERS[path.name]
    records, skipped = [], 0
    for location, row in _read_rows(path):
        try:
            if isinstance(row, MalformedRow):
                raise row
            records += [{"messages": m, "source": path.name} for m in converter(row)]
        except MalformedRow as e:
            if on_error == "raise":
                raise ValueError(f"{location}: {e}") from e
            logger.warning("skipping malformed row at %s: %s", location, e)
            skipped += 1
    level = logging.WARNING if skipped else logging.INFO
    logger.log(level, "%s: %d conversations loaded, %d malformed rows skipped", path.name, len(records), skipped)
    return records


def load_conversations(
    data_dir: str | Path = DEFAULT_DATA_DIR, files: list[str] | None = None, on_error: str = "skip"
) -> datasets.Dataset:
    """Load chat conversations (columns `messages`, `source`) from the known files in `data_dir`.

    `files=None` loads every known file present. Malformed rows are logged and skipped (`on_error="skip"`)
    or raise a ValueError naming file and line (`on_error="raise"`)."""
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', not {on_error!r}")
    data_dir = Path(data_dir)
    if files is None:
        files = [name for name in CONVERTERS if (data_dir / name).exists()]
        if not files:
            raise FileNotFoundError(f"none of the known data files {sorted(CONVERTERS)} is in {data_dir}")
    unknown = [name for name in files if name not in CONVERTERS]
    if unknown:
        raise ValueError(f"unknown data file(s) {unknown}; known files: {sorted(CONVERTERS)}")
    records = [rec for name in files for rec in _load_file(data_dir / name, on_error)]
    return datasets.Dataset.from_list(records, features=FEATURES)


def _render(tokenizer, messages: Messages, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: Messages) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages`; return the text and the character spans of the assistant turns, each from the
    end of the generation prompt to the end of the turn, found by rendering prefixes incrementally."""
    text, spans = _render(tokenizer, messages), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], add_generation_prompt=True)
        end = _render(tokenizer, messages[: i + 1])
        if not (end.startswith(start) and text.startswith(end)):
            raise ValueError("the chat template does not render conversations prefix by prefix")
        spans.append((len(start), len(end)))
    return text, spans


def _loss_mask(offsets: np.ndarray, ids: np.ndarray, spans, special_ids: np.ndarray) -> np.ndarray:
    """1 on the tokens starting inside a span, up to and including its last special (end-of-turn) token."""
    mask = np.zeros(len(ids), dtype=np.int64)
    for start, end in spans:
        idx = np.nonzero((offsets[:, 0] >= start) & (offsets[:, 0] < end))[0]
        special = np.nonzero(np.isin(ids[idx], special_ids))[0]
        mask[idx[: special[-1] + 1] if len(special) else idx] = 1
    return mask


def tokenize_conversations(
    dataset: datasets.Dataset, tokenizer, max_length: int = 1024, num_proc: int | None = None
) -> datasets.Dataset:
    """Render conversations with the chat template; return `input_ids` and `loss_mask` (1 on assistant
    content and its end-of-turn token). Rows without assistant tokens (after truncation) are dropped.
    Needs a fast tokenizer (offset mapping)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template")
    special_ids = np.array(sorted(set(tokenizer.all_special_ids)), dtype=np.int64)

    def tokenize_batch(batch):
        rendered = [assistant_char_spans(tokenizer, messages) for messages in batch["messages"]]
        enc = tokenizer([t for t, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
        out = {"input_ids": [], "loss_mask": [], "has_assistant": []}
        for (_, spans), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
            ids = np.asarray(ids, dtype=np.int64)
            mask = _loss_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), ids, spans, special_ids)
            out["input_ids"].append(ids[:max_length].tolist())
            out["loss_mask"].append(mask[:max_length].tolist())
            out["has_assistant"].append(bool(spans))
        return out

    tokenized = dataset.map(
        tokenize_batch, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="Tokenizing"
    )
    no_assistant = len(tokenized) - sum(tokenized["has_assistant"])
    kept = tokenized.filter(lambda m: any(m), input_columns="loss_mask", num_proc=num_proc).remove_columns(
        "has_assistant"
    )
    logger.info(
        "tokenized %d conversations: dropped %d without an assistant turn and %d with no assistant token left "
        "after truncation to %d tokens",
        len(dataset), no_assistant, len(tokenized) - len(kept) - no_assistant, max_length,
    )
    return kept


def build_draft_vocab(dataset: datasets.Dataset, draft_vocab_size: int, vocab_size: int) -> torch.LongTensor:
    """Sorted target ids of the `draft_vocab_size` most frequent loss-masked tokens (ties by id; filled
    with the lowest unused ids when fewer distinct tokens occur)."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    table = dataset.with_format("arrow")[:]
    ids = pc.list_flatten(table["input_ids"]).to_numpy()
    mask = pc.list_flatten(table["loss_mask"]).to_numpy().astype(bool)
    ids = ids[mask]
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}) in the dataset")
    counts = np.bincount(ids, minlength=vocab_size)
    top = np.argsort(-counts, kind="stable")[:draft_vocab_size]
    return torch.from_numpy(np.sort(top)).long()


class DataCollatorForDraft:
    """Right-pad rows of `input_ids` and `loss_mask` into LongTensors, adding `attention_mask`."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.LongTensor]:
        length = max(len(row["input_ids"]) for row in rows)
        batch = {
            "input_ids": torch.full((len(rows), length), self.pad_token_id, dtype=torch.long),
            "loss_mask": torch.zeros((len(rows), length), dtype=torch.long),
            "attention_mask": torch.zeros((len(rows), length), dtype=torch.long),
        }
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            batch["input_ids"][i, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            batch["loss_mask"][i, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
            batch["attention_mask"][i, :n] = 1
        return batch


def _prompt(messages: Messages) -> Messages:
    return messages[:-1] if messages[-1]["role"] == "assistant" else messages


def _prompt_key(prompt: Messages) -> str:
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


def _read_cache(path: Path) -> dict[int, dict]:
    cache = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
                cache[record["index"]] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                logger.warning("ignoring an unreadable line in %s (interrupted write?)", path)
    return cache


@torch.no_grad()
def _generate_batch(model, tokenizer, prompts: list[Messages], max_new_tokens: int) -> list[str]:
    texts = [_render(tokenizer, p, add_generation_prompt=True) for p in prompts]
    enc = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt").to(model.device)
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    return [s.strip() for s in tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)]


def regenerate_responses(
    dataset: datasets.Dataset,
    model,
    tokenizer,
    cache_dir: str | Path,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    limit: int | None = None,
) -> datasets.Dataset:
    """Replace each conversation's last assistant turn (or add one) with the model's greedy answer.

    Answers are appended to `cache_dir/responses.jsonl` keyed by row index (with a hash of the prompt), so an
    interrupted run resumes: rows already answered are not regenerated. `limit` keeps the first rows only."""
    rows = dataset.select(range(min(limit, len(dataset)) if limit is not None else len(dataset))).to_list()
    cache_path = Path(cache_dir) / "responses.jsonl"
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache = _read_cache(cache_path)
    keys = [_prompt_key(_prompt(row["messages"])) for row in rows]
    todo = [i for i, key in enumerate(keys) if cache.get(i, {}).get("prompt_key") != key]
    todo.sort(key=lambda i: -sum(len(m["content"]) for m in rows[i]["messages"]))  # long first: OOM shows early
    logger.info("regenerating %d of %d responses (%d cached in %s)", len(todo), len(rows), len(rows) - len(todo), cache_path)
    saved = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    try:
        with cache_path.open("a", encoding="utf-8") as f, tqdm(total=len(todo), desc="Regenerating") as bar:
            for b in range(0, len(todo), batch_size):
                batch = todo[b : b + batch_size]
                answers = _generate_batch(model, tokenizer, [_prompt(rows[i]["messages"]) for i in batch], max_new_tokens)
                for i, answer in zip(batch, answers):
                    cache[i] = {"index": i, "prompt_key": keys[i], "response": answer}
                    f.write(json.dumps(cache[i], ensure_ascii=False) + "\n")
                f.flush()
                bar.update(len(batch))
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved
    for i, row in enumerate(rows):
        row["messages"] = _prompt(row["messages"]) + [{"role": "assistant", "content": cache[i]["response"]}]
    return datasets.Dataset.from_list(rows, features=dataset.features)
