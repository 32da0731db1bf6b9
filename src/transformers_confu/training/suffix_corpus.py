"""Build a suffix corpus: the target's own answers as token ids, their suffix array and a calibration.

    python -m transformers_confu.training.suffix_corpus --out my_corpus SOURCE [SOURCE ...]

A SOURCE is a regeneration folder (`answers/responses.jsonl` beside `prompts.jsonl`, as `confu-train
--regenerate` writes them), a dataset folder (`*.parquet`, or one saved by `datasets.save_to_disk`), or a
`.jsonl`/`.json` file; rows give an answer as `response`, `answer`, `completion`, `output` or `text`, or a
chat as `messages` (its last assistant turn; the turns before are its prompt). Answers are tokenized with
the target's tokenizer (its fingerprint is recorded: `CorpusIndex.from_pretrained` refuses another one).

The acceptance estimates (`decoding.suffix.calibrate`) are fitted teacher-forced on a held-out share of
the answers (`--calibration-fraction`), against an index of the rest; the saved index holds all answers.
Use answers to TRAINING prompts only: never the evaluation questions.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ..decoding.suffix import SuffixProposer, calibrate, calibration_summary
from ..decoding.suffix_index import CorpusIndex, tokenizer_fingerprint
from ..models.target import DEFAULT_TARGET, hub_name, tokenizer_path
from .data import Messages, prompt_messages
from .regenerate import prompt_key, read_responses

PROG = "python -m transformers_confu.training.suffix_corpus"
ANSWER_FIELDS = ("response", "answer", "completion", "output", "text")


def read_rows(source: str | Path) -> Iterator[tuple[Messages | None, str]]:
    """(prompt messages or None, answer text) from a regeneration folder, a dataset folder or a json(l) file."""
    path = Path(source)
    if (path / "answers" / "responses.jsonl").is_file():
        prompts = {}
        if (path / "prompts.jsonl").is_file():
            for line in (path / "prompts.jsonl").read_text(encoding="utf-8").split("\n"):
                if line.strip():
                    messages = json.loads(line)["messages"]
                    prompts[prompt_key(messages)] = messages
        for key, record in read_responses(path / "answers" / "responses.jsonl").items():
            yield prompts.get(key), record["response"]
    elif path.is_dir():
        files = sorted(path.rglob("*.parquet"))
        if files:
            import datasets

            rows = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
        else:
            try:
                import datasets

                rows = datasets.load_from_disk(str(path))
            except (FileNotFoundError, ValueError) as err:
                raise ValueError(f"{path} holds no regeneration answers (answers/responses.jsonl), no *.parquet "
                                 f"and no saved dataset ({err}).") from err
        yield from (_row(row, path) for row in rows)
    elif path.is_file():
        text = path.read_text(encoding="utf-8")
        rows = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.split("\n") if x.strip()]
        yield from (_row(row, path) for row in rows)
    else:
        raise FileNotFoundError(f"No corpus source {str(source)!r}: give a regeneration folder, a dataset folder "
                                "or a .jsonl/.json file.")


def _row(row: dict, where: Path) -> tuple[Messages | None, str]:
    messages = row.get("messages")
    if messages and messages[-1].get("role") == "assistant":
        return prompt_messages(messages) or None, messages[-1]["content"]
    for name in ANSWER_FIELDS:
        if isinstance(row.get(name), str):
            return messages or None, row[name]
    raise ValueError(f"A row of {where} has no answer: expected a `messages` chat ending with an assistant turn or "
                     f"one of the fields {ANSWER_FIELDS}; it has {sorted(row)}.")


def build_corpus(rows: list[tuple[Messages | None, str]], tokenizer, calibration_fraction: float = 0.1,
                 **settings) -> tuple[CorpusIndex, dict]:
    """The corpus index of every answer, its calibration fitted on a held-out share, and a build report."""
    start = time.perf_counter()
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    answers = [tokenizer(text, add_special_tokens=False)["input_ids"] + eos for _, text in rows if text.strip()]
    if not answers:
        raise ValueError("The corpus is empty: the sources gave no non-empty answer.")
    every = max(2, round(1 / calibration_fraction)) if calibration_fraction > 0 else 0
    held = [i for i in range(len(answers)) if every and i % every == 0]
    meta = dict(tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), tokenizer_name=hub_name(tokenizer.name_or_path))
    report = {}
    if held:
        rest = CorpusIndex.build([a for i, a in enumerate(answers) if i % every], meta)
        examples = []
        for i in held:
            prompt, _ = rows[i]
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"] \
                if prompt else []
            examples.append((list(ids), answers[i]))
        t0 = time.perf_counter()
        calibration = calibrate(SuffixProposer(rest, **settings), examples)
        report = dict(calibration_answers=len(held), calibration_seconds=time.perf_counter() - t0,
                      calibration=calibration_summary(calibration))
        meta["calibration"] = calibration.to_dict()
    index = CorpusIndex.build(answers, meta)
    report.update(answers=len(answers), tokens=index.meta["tokens"], build_seconds=time.perf_counter() - start,
                  bytes=int(index.tokens.nbytes + index.suffix_array.nbytes))
    return index, report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", help="regeneration folders, dataset folders or .jsonl/.json files")
    p.add_argument("--out", required=True, help="the corpus folder to write (e.g. <draft>/suffix_corpus)")
    p.add_argument("--tokenizer", default=DEFAULT_TARGET, help="the target's tokenizer: folder or Hub id")
    p.add_argument("--calibration-fraction", type=float, default=0.1, help="answers held out to fit the estimates")
    p.add_argument("--limit", type=int, default=None, help="at most this many answers (the first ones)")
    p.add_argument("--hybrid-total-tokens", type=int, default=None,
                   help="hybrid budget saved with the corpus: nodes per tree (draft + suffix, root included)")
    p.add_argument("--hybrid-suffix-nodes", type=int, default=None, help="hybrid budget: suffix candidates offered")
    p.add_argument("--hybrid-top-k", type=int, default=None,
                   help="hybrid budget: the draft's children per node (default: the draft's own saved tree's)")
    p.add_argument("--hybrid-sampling-top-k", type=int, default=None,
                   help="hybrid budget: the draft's children per node in sampling calls (default: --hybrid-top-k)")
    p.add_argument("--hybrid-chosen-by", default=None,
                   help="how the hybrid budget was chosen (e.g. the benchmark file), for the draft's card")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    from transformers import AutoTokenizer

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(args.tokenizer))
    rows = [row for source in args.sources for row in read_rows(source)][: args.limit]
    index, report = build_corpus(rows, tokenizer, args.calibration_fraction)
    if args.hybrid_total_tokens:
        index.meta["hybrid"] = dict(total_tokens=args.hybrid_total_tokens, suffix_nodes=args.hybrid_suffix_nodes
                                    or args.hybrid_total_tokens - 1)
        for key in ("top_k", "sampling_top_k"):
            if getattr(args, f"hybrid_{key}") is not None:
                index.meta["hybrid"][key] = getattr(args, f"hybrid_{key}")
        if args.hybrid_chosen_by:
            index.meta["hybrid"]["chosen_by"] = args.hybrid_chosen_by
    index.meta["build"] = {k: v for k, v in report.items() if k != "calibration"}
    index.meta.update(sources=list(args.sources), command=" ".join([PROG, shlex.join(argv)]))
    index.save_pretrained(args.out)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
