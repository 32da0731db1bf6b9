"""On-policy training data: the target answers the training prompts itself (self-distillation).

Batched decoding (greedy, or sampled at a temperature) with a KV cache that grows in place, prompts of
similar length batched together, time-boxed, and resumable: every finished batch is appended to
`responses.jsonl` (flushed and synced) keyed by a hash of its prompt, so a rerun skips what is done and a
line torn by a kill is ignored. `settings.json` pins the target and decoding settings the answers were made
with (a directory made with other settings is refused, not silently reused); `stats.json` accumulates the
rows, generated tokens and seconds of all runs (tokens/s).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm

from ..utils.atomic import pin_settings, write_json_atomic
from ..utils.cache import cache_kwargs, growing_cache
from .data import Messages, prompt_messages, render

logger = logging.getLogger(__name__)

RESPONSES_FILE, STATS_FILE = "responses.jsonl", "stats.json"


@dataclass(frozen=True)
class RegenerationSettings:
    """What the answers depend on: the target (a fingerprint of its config and weights) and the decoding."""

    target: str
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def target_fingerprint(model) -> str:
    """A short hash of the target's config and of a slice of its weights."""
    probe = model.get_input_embeddings().weight[:256].float().sum().item()
    text = model.config.to_json_string(use_diff=False) + f"{probe:.6e}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prompt_key(prompt: Messages) -> str:
    """The key of a prompt's answer in `responses.jsonl`."""
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]



def read_responses(path: Path) -> dict[str, dict]:
    """`{key: record}` from a responses file; unreadable (torn) lines are skipped with a warning."""
    records = {}
    if path.exists():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                record = json.loads(line)
                records[record["key"]] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                logger.warning("ignoring unreadable line %d of %s (a write cut by a kill?)", lineno, path)
    return records


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line torn by a kill (no final newline), so that the next record starts on a line of its own."""
    if path.exists():
        data = path.read_bytes()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            os.truncate(path, whole)



STATIC_WIDTH_STEP = 64  # static-cache regeneration pads prompts to a multiple of this


def _batches(prompt_ids: list[list[int]], batch_size: int, window: int = 8) -> list[list[int]]:
    """Indices in batches of similar prompt length: the order is kept window by window (`window` batches),
    sorted by length inside each window, so that a time-boxed run covers a random subset of a shuffled set."""
    batches = []
    span = batch_size * window
    for start in range(0, len(prompt_ids), span):
        chunk = sorted(range(start, min(start + span, len(prompt_ids))), key=lambda i: len(prompt_ids[i]))
        batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
    return batches


@torch.no_grad()
def generate_answers(model, tokenizer, prompt_ids: list[list[int]], settings: RegenerationSettings, seed: int,
                     static: bool | None = None):
    """Answer tokenized prompts in one left-padded batch; returns (texts, new-token counts, ended with EOS).
    `seed` seeds the sampling (unused when greedy). The KV cache grows in place (`growing_cache`), or with
    `static` (default: on CUDA) it is transformers' static cache, which `generate` compiles: the padded width
    is then rounded up to a multiple of `STATIC_WIDTH_STEP`, so that batches share compiled shapes."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    static = model.device.type == "cuda" if static is None else static
    width = max(len(p) for p in prompt_ids)
    if static:
        width = -(-width // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP
    input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    sampling = settings.temperature > 0
    if sampling:
        torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
        max_new_tokens=settings.max_new_tokens, do_sample=sampling,
        temperature=settings.temperature if sampling else None, top_p=settings.top_p if sampling else None,
        top_k=0 if sampling else None, pad_token_id=pad,
        **(dict(cache_implementation="static") if static
           else cache_kwargs(model, growing_cache(model.config, reserve=settings.max_new_tokens))),
    )[:, width:].cpu()
    eos = model.generation_config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long)
    is_eos = torch.isin(out, eos)
    ended = is_eos.any(dim=1)
    lengths = torch.where(ended, is_eos.int().argmax(dim=1) + 1, torch.full_like(ended, out.shape[1], dtype=torch.long))
    texts = [tokenizer.decode(row[:n], skip_special_tokens=True).strip() for row, n in zip(out, lengths.tolist())]
    return texts, lengths.tolist(), ended.tolist()


def regenerate_responses(
    dataset: datasets.Dataset,
    model,
    tokenizer,
    directory: str | Path,
    batch_size: int = 64,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_prompt_tokens: int = 384,
    max_minutes: float | None = None,
    seed: int = 0,
    keep_unanswered: bool = False,
) -> datasets.Dataset:
    """Answer each conversation's prompt (its turns before the last assistant turn) with `model`.

    Returns the conversations answered so far (this run's and earlier runs' answers in `directory`), each
    ending with the model's answer; rows not answered yet (time box reached) and prompts longer than
    `max_prompt_tokens` are left out (logged), or with `keep_unanswered` kept as they are when they end with
    an assistant turn (a reference answer). Rerun with the same arguments to go on."""
    directory = Path(directory)
    sampled = temperature > 0  # greedy answers depend on neither the seed nor top_p
    settings = RegenerationSettings(target_fingerprint(model), max_new_tokens, temperature,
                                    top_p if sampled else 1.0, seed if sampled else 0)
    pin_settings(directory, asdict(settings), f"{directory} holds answers made with other settings",
                 "Use another directory for these settings, or delete this one to regenerate.")
    responses_path = directory / RESPONSES_FILE
    done = read_responses(responses_path)
    _drop_torn_tail(responses_path)
    prompts = [prompt_messages(m) for m in dataset["messages"]]
    keys = [prompt_key(p) for p in prompts]
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    unique = [i for key, i in first.items()]
    ids = [tokenizer(render(tokenizer, prompts[i], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
           for i in unique]
    fits = [n for n, p in enumerate(ids) if len(p) <= max_prompt_tokens]
    if len(fits) < len(unique):
        logger.info("skipping %d prompts longer than %d tokens", len(unique) - len(fits), max_prompt_tokens)
    batches = [[fits[j] for j in batch] for batch in _batches([ids[n] for n in fits], batch_size)]
    todo = [b for b in batches if any(keys[unique[n]] not in done for n in b)]
    missing = sum(keys[unique[n]] not in done for n in fits)
    logger.info("%d of %d prompts to answer (%d answered in %s)", missing, len(fits), len(fits) - missing,
                responses_path)
    stats_path = directory / STATS_FILE
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {"rows": 0, "new_tokens": 0, "seconds": 0.0}
    start = time.monotonic()
    model.eval()
    with responses_path.open("a", encoding="utf-8") as f, tqdm(total=sum(map(len, todo)), desc="Regenerating") as bar:
        for batch in todo:
            if max_minutes is not None and time.monotonic() - start > max_minutes * 60:
                logger.info("time box of %.1f min reached: rerun to go on", max_minutes)
                break
            t0 = time.monotonic()
            seed_b = int(prompt_key([{"seed": str(seed), "first": keys[unique[batch[0]]]}]), 16) % 2**31
            texts, lengths, ended = generate_answers(model, tokenizer, [ids[n] for n in batch], settings, seed_b)
            for n, text, length, eos in zip(batch, texts, lengths, ended):
                record = {"key": keys[unique[n]], "response": text, "new_tokens": length, "eos": eos}
                done[record["key"]] = record
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            stats["rows"] += len(batch)
            stats["new_tokens"] += sum(lengths)
            stats["seconds"] += time.monotonic() - t0
            stats["tokens_per_second"] = stats["new_tokens"] / max(stats["seconds"], 1e-9)
            write_json_atomic(stats_path, stats)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{sum(lengths) / (time.monotonic() - t0):.0f}")
    rows, regenerated = [], 0
    for row, prompt, key in zip(dataset, prompts, keys):
        record = done.get(key)
        if record is not None and record["response"]:
            rows.append({**row, "messages": prompt + [{"role": "assistant", "content": record["response"]}]})
            regenerated += 1
        elif keep_unanswered and row["messages"][-1]["role"] == "assistant":
            rows.append(row)
    logger.info("%d of %d conversations have a regenerated answer (%.0f generated tokens/s over all runs); "
                "%d kept with their reference answer", regenerated, len(dataset),
                stats.get("tokens_per_second", 0.0), len(rows) - regenerated)
    return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in dataset.column_names}, features=dataset.features)
