"""`confu-bench --batch-size B`: the methods answer the questions' first turns B at a time.

Each batch is the next B questions' first turns, left-padded; every method answers it in turn (plain batched
`generate` first, the reference), so that drifts of the machine hit every method alike. A row's wall time is
its batch's divided by B, so tokens/s over a method's rows is its throughput over the batch; its accept
lengths are the row's own (tau per row). The records are those of `bench.answer`, for the same tables.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..decoding.assistant import ConFuAssistant
from ..decoding.batched import eos_token_ids, real_lengths
from ..decoding.suffix_assistant import SuffixAssistant
from .assistants import budget_name, draft_assistant
from .questions import chat_input_ids


@dataclass
class BatchMethod:
    """A named way to answer a batch: `run(input_ids, attention_mask, max_new_tokens) -> (output ids, each row's
    accept lengths or None)`; `assistant`: the one it runs, whose `stats` are read after each batch (accepted tokens
    by source)."""

    name: str
    run: Callable[[torch.LongTensor, torch.Tensor, int], tuple[torch.LongTensor, list[list[int]] | None]]
    assistant: object = None


def batch_methods(model, drafts: list[str], trees: list[tuple[int, int, int]], sampling: dict,
                  static: dict | None = None, suffix: tuple[str, ...] = (), suffix_corpus: str | None = None,
                  suffix_tokens: tuple[int, ...] = (), hybrid_trees: list[tuple[int, int, int, int]] = (),
                  loops: tuple[str, ...] = ("eager",), static_loop: dict | None = None) -> list[BatchMethod]:
    """Plain batched `generate` (the reference) and, with `static` (its `generate` options: a static cache, compiled
    on CUDA), `generate-static`; then per draft its `auto` budget for the batch (the draft's own budget under
    `batched.batch_budget`) and each of `trees` as it is. `suffix` as in `bench.build_methods`: "suffix" /
    "suffix-corpus" `SuffixAssistant`s at the `auto` width and each of `suffix_tokens`, "hybrid" every draft at each
    of `hybrid_trees` (depth, top_k, total_tokens, suffix nodes) with `suffix_corpus`. Each speculative method runs
    in each of `loops`: "eager", "static" (with the `generate` options `static_loop`; named `<method>-static`)."""
    tags = [("", {}) if loop == "eager" else ("-static", static_loop) for loop in loops]

    def plain(options):
        return lambda ids, mask, n: (model.generate(ids, attention_mask=mask, max_new_tokens=n, **options, **sampling),
                                     None)

    methods = [BatchMethod("generate", plain({}))]
    if static is not None:
        methods.append(BatchMethod("generate-static", plain(static)))
    for name in (x for x in suffix if x in ("suffix", "suffix-corpus")):
        for width in [None, *suffix_tokens]:
            assistant = SuffixAssistant(model, corpus=suffix_corpus if name == "suffix-corpus" else None,
                                        total_tokens=width)
            methods += [BatchMethod(f"{name}{tag}:{'auto' if width is None else f'n{width}'}",
                                    _speculative(model, assistant, {**sampling, **options}), assistant)
                        for tag, options in tags]
    hybrids = list(hybrid_trees) if "hybrid" in suffix else []
    for path in drafts:
        for budget in [None, *trees, *hybrids]:
            assistant = (ConFuAssistant.from_pretrained(path, target_model=model) if budget is None
                         else draft_assistant(model, path, budget, suffix_corpus))
            kind = ("eagle3" if assistant.adapter is None else "confu") + ("-hybrid" if budget and len(budget) > 3 else "")
            label = "auto" if budget is None else budget_name(budget)
            methods += [BatchMethod(f"{kind}{tag}:{Path(path).name}:{label}",
                                    _speculative(model, assistant, {**sampling, **options}), assistant)
                        for tag, options in tags]
    return methods


def _speculative(model, assistant: ConFuAssistant, sampling: dict):
    def run(ids, mask, n):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, assistant_model=assistant, **sampling)
        rows = getattr(assistant.stats, "row_accept_lengths", None) or [assistant.stats.accept_lengths]
        return out, None if assistant.stats.mode == "plain" else [list(r) for r in rows]

    return run


def left_padded(prompts: list[torch.LongTensor], pad_id: int) -> tuple[torch.LongTensor, torch.Tensor]:
    """(B, T) ids and attention mask of 1-D prompts, padded on the left."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel():], mask[row, width - prompt.numel():] = prompt, 1
    return ids, mask


def answer_batch(method: BatchMethod, tokenizer, questions: list[dict], max_new_tokens: int, seed: int,
                 eos_ids: list[int], device) -> list[dict]:
    """Answer the first turns of `questions` in one batch; one record per question (as `bench.answer`'s)."""
    prompts = [chat_input_ids(tokenizer, q["turns"][:1])[0] for q in questions]
    ids, mask = left_padded(prompts, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [0])[0])
    torch.manual_seed(seed)
    start = time.perf_counter()
    out, accepts = method.run(ids.to(device), mask.to(device), max_new_tokens)
    seconds = (time.perf_counter() - start) / len(questions)
    new = out[:, ids.shape[1]:].cpu()
    stats = None if method.assistant is None else method.assistant.stats
    sources = getattr(stats, "row_accepted_by_source", None) or [{}] * len(questions)  # none: plain generate ran
    records = []
    for row, (question, length) in enumerate(zip(questions, real_lengths(new, eos_ids).tolist())):
        tokens = new[row, :length]
        accept = accepts[row] if accepts else [1] * max(length - 1, 0) if method.name.startswith("generate") else []
        suffix = {} if stats is None else dict(accepted_by_source=dict(sources[row]),
                                               suffix_seconds=stats.suffix_seconds / len(questions))
        records.append(dict(question_id=question["question_id"], category=question["category"], model_id=method.name,
                            choices=[dict(index=0, turns=[tokenizer.decode(tokens, skip_special_tokens=True)],
                                          new_tokens=[length], wall_time=[seconds], accept_lengths=accept,
                                          decoding_steps=[len(accept) + 1], **suffix)],
                            tstamp=time.time(), _ids=[(prompts[row][None], tokens)]))
    return records


def run_batches(model, tokenizer, methods: list[BatchMethod], questions: list[dict], max_new_tokens: int, seed: int,
                greedy: bool, batch_size: int, divergence) -> tuple[dict[str, list[dict]], dict[str, list], dict]:
    """`bench.run_bench` for batches: every batch answered by every method (interleaved), rows checked against
    plain batched `generate`'s at T=0 (`divergence` as `bench.divergence`). Each method first answers the first
    batch once, untimed."""
    eos_ids = eos_token_ids(model.generation_config)
    groups = [questions[i : i + batch_size] for i in range(0, len(questions), batch_size)]
    records: dict[str, list[dict]] = {m.name: [] for m in methods}
    mismatches: dict[str, list] = defaultdict(list)
    warmup_seconds = {}
    for method in methods:
        start = time.perf_counter()
        answer_batch(method, tokenizer, groups[0], max_new_tokens, seed, eos_ids, model.device)
        warmup_seconds[method.name] = time.perf_counter() - start
    for group in tqdm(groups, desc=f"batches of {batch_size}"):
        rows = {m.name: answer_batch(m, tokenizer, group, max_new_tokens, seed, eos_ids, model.device) for m in methods}
        for name, answers in rows.items():
            for reference, row in zip(rows["generate"], answers):
                where = None if not greedy or name == "generate" else divergence(model, reference["_ids"][0],
                                                                                 row["_ids"][0])
                if where is not None:
                    mismatches[name].append(dict(question_id=row["question_id"], category=row["category"], turn=0,
                                                 **where))
        for name, answers in rows.items():
            records[name].extend({k: v for k, v in row.items() if k != "_ids"} for row in answers)
    return records, dict(mismatches), warmup_seconds
