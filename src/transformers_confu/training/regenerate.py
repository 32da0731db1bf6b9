"""On-policy training data: the target answers the training prompts itself (self-distillation).

Batched decoding (greedy, or sampled at a temperature) whose finished rows take the next prompt at once
(`continuous_batching`), prompts of similar length together, time-boxed, and resumable: every answer is
appended to `responses.jsonl` as it ends (flushed; synced every few seconds) keyed by a hash of its prompt,
so a rerun skips what is done and a line torn by a kill is ignored. `settings.json` pins the target and decoding settings the answers were made
with (a directory made with other settings is refused, not silently reused); `stats.json` accumulates the
rows, generated tokens and seconds of all runs (tokens/s).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm

from ..decoding.batched import eos_token_ids, real_lengths
from ..utils.atomic import pin_settings, write_json_atomic
from ..utils.cache import cache_kwargs, full_attention, growing_cache
from .continuous_batching import left_padded, stream_answers
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


# Fields of a config that name where or with what it was loaded, not the model: left out of the fingerprint.
_LOAD_FIELDS = ("_name_or_path", "transformers_version")
# Fingerprints that `target_fingerprint` gave before it left `_LOAD_FIELDS` out -> the fingerprint the same
# target has now: the embedded default target loaded from its GGUF and from its float copy in the default
# `$CONFU_CACHE`. Folders pinned to them hold that target's answers and stay usable (`migrate_fingerprint`).
LEGACY_FINGERPRINTS = {"dca0dd02874cfafe": "0de68d7aa27e7747", "b8f9516f4af8e355": "0de68d7aa27e7747"}


def target_fingerprint(model) -> str:
    """A short hash of the target's config (architecture, sizes, dtype; not the folder it was loaded from)
    and of a slice of its weights, summed on the CPU so that a target on a GPU gets the same hash."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _LOAD_FIELDS}
    probe = model.get_input_embeddings().weight[:256].detach().cpu().float().sum().item()
    text = json.dumps(config, sort_keys=True, default=str) + f"{probe:.6e}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def canonical_fingerprint(fingerprint: str) -> str:
    """The fingerprint a target has now, for one that `target_fingerprint` gave it before (else unchanged)."""
    return LEGACY_FINGERPRINTS.get(fingerprint, fingerprint)


def migrate_fingerprint(directory: str | Path, fingerprint: str) -> None:
    """Rewrite `directory/settings.json` pinned to a legacy fingerprint of the target now fingerprinted
    `fingerprint` (see `LEGACY_FINGERPRINTS`), so that its answers or features are reused, not refused."""
    path = Path(directory) / "settings.json"
    if path.exists():
        settings = json.loads(path.read_text())
        old = settings.get("target")
        if LEGACY_FINGERPRINTS.get(old) == fingerprint:
            logger.info("%s: target fingerprint %s (legacy) is %s now: rewritten", path, old, fingerprint)
            write_json_atomic(path, {**settings, "target": fingerprint})


def prompt_key(prompt: Messages) -> str:
    """The key of a prompt's answer in `responses.jsonl`."""
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


def read_responses(path: Path) -> dict[str, dict]:
    """`{key: record}` from a responses file; unreadable (torn) lines are skipped with a warning."""
    records = {}
    if path.exists():
        # not splitlines(): answers are written with ensure_ascii=False and may hold U+2028, U+0085, ...
        for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if not line:
                continue
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
                     static: bool | None = None) -> list[list[int]]:
    """Answer tokenized prompts in one left-padded batch with `generate`; returns each one's new token ids (up
    to and with its EOS token, if it ended).
    `seed` seeds the sampling (unused when greedy). The KV cache grows in place (`growing_cache`), or with
    `static` (default: on CUDA) it is transformers' static cache, which `generate` compiles: the padded width
    is then rounded up to a multiple of `STATIC_WIDTH_STEP`, so that batches share compiled shapes."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    static = model.device.type == "cuda" if static is None else static
    width = max(len(p) for p in prompt_ids)
    if static:
        width = -(-width // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP
    input_ids, attention_mask = left_padded(prompt_ids, pad, width)
    sampling = settings.temperature > 0
    if sampling:
        torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids.to(model.device), attention_mask=attention_mask.long().to(model.device),
        max_new_tokens=settings.max_new_tokens, do_sample=sampling,
        temperature=settings.temperature if sampling else None, top_p=settings.top_p if sampling else None,
        top_k=0 if sampling else None, pad_token_id=pad,
        **(dict(cache_implementation="static") if static
           else cache_kwargs(model, growing_cache(model.config, reserve=settings.max_new_tokens))),
    )[:, width:].cpu()
    lengths = real_lengths(out, eos_token_ids(model.generation_config))
    return [row[:n].tolist() for row, n in zip(out, lengths.tolist())]


def regeneration_settings(model, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                          seed: int = 0) -> RegenerationSettings:
    """The settings answers of `model` are made with (greedy answers depend on neither the seed nor top_p)."""
    sampled = temperature > 0
    return RegenerationSettings(target_fingerprint(model), max_new_tokens, temperature, top_p if sampled else 1.0,
                                seed if sampled else 0)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


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
    answered: Mapping[str, str] | None = None,
    refill: bool = True,
) -> datasets.Dataset:
    """Answer each conversation's prompt (its turns before the last assistant turn) with `model`.

    Returns the conversations answered so far (this run's and earlier runs' answers in `directory`, and
    `answered`: `{prompt_key: answer}` made elsewhere with the same settings, such as an answers dataset,
    which are not made again), each ending with the model's answer; rows not answered yet (time box reached)
    and prompts longer than `max_prompt_tokens` are left out (logged), or with `keep_unanswered` kept as
    they are when they end with an assistant turn (a reference answer). Rerun with the same arguments to go
    on. With `refill` (the default) rows whose answer has ended take the next prompt at once
    (`continuous_batching`); without, or for a target with sliding-window layers, each batch is decoded by
    `generate` until its longest answer ends.
    The time box stops new prompts from starting; the running ones are finished."""
    directory = Path(directory)
    settings = regeneration_settings(model, max_new_tokens, temperature, top_p, seed)
    migrate_fingerprint(directory, settings.target)
    pin_settings(directory, asdict(settings), f"{directory} holds answers made with other settings",
                 "Use another directory for these settings, or delete this one to regenerate.")
    responses_path = directory / RESPONSES_FILE
    done = read_responses(responses_path)
    _drop_torn_tail(responses_path)
    known = {**(answered or {}), **{key: record["response"] for key, record in done.items()}}
    prompts = [prompt_messages(m) for m in dataset["messages"]]
    keys = [prompt_key(p) for p in prompts]
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    unique = [i for key, i in first.items() if key not in known]
    ids = [tokenizer(render(tokenizer, prompts[i], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
           for i in unique]
    fits = [n for n, p in enumerate(ids) if len(p) <= max_prompt_tokens]
    if len(fits) < len(unique):
        logger.info("skipping %d prompts longer than %d tokens", len(unique) - len(fits), max_prompt_tokens)
    order = [fits[j] for batch in _batches([ids[n] for n in fits], batch_size) for j in batch]
    logger.info("%d prompts to answer (%d answered already, in %s or given)", len(order), len(first) - len(unique),
                responses_path)
    stats_path = directory / STATS_FILE
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {"rows": 0, "new_tokens": 0, "seconds": 0.0}
    earlier_seconds, start = stats["seconds"], time.monotonic()
    model.eval()

    def out_of_time() -> bool:
        return max_minutes is not None and time.monotonic() - start > max_minutes * 60

    with responses_path.open("a", encoding="utf-8") as f, tqdm(total=len(order), desc="Regenerating") as bar:
        synced, tokens = time.monotonic(), 0
        for n, new_ids, eos in _answers(model, tokenizer, [ids[n] for n in order], settings,
                                        [keys[unique[n]] for n in order], batch_size, refill, out_of_time):
            record = {"key": keys[unique[order[n]]], "response": _decode(tokenizer, new_ids), "new_tokens": len(new_ids),
                      "eos": eos}
            known[record["key"]] = record["response"]
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            tokens += len(new_ids)
            stats["rows"] += 1
            stats["new_tokens"] += len(new_ids)
            bar.update(1)
            if time.monotonic() - synced > 10:
                synced = _sync(f, stats_path, stats, earlier_seconds, start, tokens, bar)
        _sync(f, stats_path, stats, earlier_seconds, start, tokens, bar)
    if order and out_of_time():
        logger.info("time box of %.1f min reached: rerun to go on", max_minutes)
    rows, regenerated = [], 0
    for row, prompt, key in zip(dataset, prompts, keys):
        answer = known.get(key)
        if answer:
            rows.append({**row, "messages": prompt + [{"role": "assistant", "content": answer}]})
            regenerated += 1
        elif keep_unanswered and row["messages"][-1]["role"] == "assistant":
            rows.append(row)
    logger.info("%d of %d conversations have a regenerated answer (%.0f generated tokens/s over all runs); "
                "%d kept with their reference answer", regenerated, len(dataset),
                stats.get("tokens_per_second", 0.0), len(rows) - regenerated)
    return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in dataset.column_names}, features=dataset.features)


def _answers(model, tokenizer, prompt_ids: list[list[int]], settings: RegenerationSettings, keys: list[str],
             batch_size: int, refill: bool, stop) -> Iterator[tuple[int, list[int], bool]]:
    """`(index, new ids, ended with EOS)` for the prompts, as they are answered, until `stop()`."""
    eos = eos_token_ids(model.generation_config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    seeds = [int(prompt_key([{"seed": str(settings.seed), "key": key}]), 16) % 2**31 for key in keys]
    if refill and full_attention(model.config):
        yield from stream_answers(model, prompt_ids, settings.max_new_tokens, eos, batch_size=batch_size,
                                  temperature=settings.temperature, top_p=settings.top_p, seeds=seeds,
                                  pad_token_id=pad, stop=stop)
        return
    for first in range(0, len(prompt_ids), batch_size):
        if stop():
            return
        batch = prompt_ids[first : first + batch_size]
        for row, new_ids in enumerate(generate_answers(model, tokenizer, batch, settings, seeds[first])):
            yield first + row, new_ids, bool(new_ids) and new_ids[-1] in eos


def _sync(f, stats_path: Path, stats: dict, earlier_seconds: float, start: float, tokens: int, bar) -> float:
    """Sync the answers file to disk and write the stats (this run's time so far added); returns the time."""
    os.fsync(f.fileno())
    now = time.monotonic()
    stats["seconds"] = earlier_seconds + now - start
    stats["tokens_per_second"] = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    write_json_atomic(stats_path, stats)
    bar.set_postfix(tok_s=f"{tokens / max(now - start, 1e-9):.0f}")
    return now
