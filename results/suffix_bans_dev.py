"""Suffix candidates that the call's logits processors ban, left out of the tree (after) or verified anyway
(before, `SuffixProposer.best_paths` ignoring `allowed`), under `no_repeat_ngram_size`: the shipped default
assistant (hybrid) and suffix candidates alone, dev first turns, greedy, each question answered by plain `generate`
and by every setting in turn, outputs checked identical.

    OMP_NUM_THREADS=1 python results/suffix_bans_dev.py results/suffix_bans_dev.json [per_category] [ngram]
"""
import json
import sys
import time

import torch

from transformers_confu import ConFuAssistant, SuffixAssistant, load_target
from transformers_confu.benchmark.questions import chat_input_ids, load_questions
from transformers_confu.decoding.suffix import SuffixProposer
from transformers_confu.models.target import DEFAULT_DRAFT

NEW = 96
per_category = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ngram = int(sys.argv[3]) if len(sys.argv) > 3 else 4
model, tok = load_target()
assistants = {"hybrid": ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model),
              "suffix": SuffixAssistant(model)}
pruned = SuffixProposer.best_paths


def unpruned(self, context, allowed=None):
    return pruned(self, context)


def timed(ids, **kwargs):
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         no_repeat_ngram_size=ngram, **kwargs)
    return out, time.perf_counter() - start


records = []
for q in load_questions(per_category=per_category):
    ids = chat_input_ids(tok, q["turns"][:1])
    ref, plain_s = timed(ids)
    record = dict(question_id=q["question_id"], category=q["category"], new_tokens=ref.shape[1] - ids.shape[1],
                  plain_s=plain_s, identical=True)
    for name, assistant in assistants.items():
        for setting in ("before", "after"):
            SuffixProposer.best_paths = unpruned if setting == "before" else pruned
            out, seconds = timed(ids, assistant_model=assistant)
            record[f"{name}_{setting}_s"] = seconds
            record[f"{name}_{setting}_tau"] = assistant.stats.mean_accepted_tokens
            record["identical"] &= bool(torch.equal(out, ref))
    SuffixProposer.best_paths = pruned
    records.append(record)
    print(record, flush=True)
tokens = sum(r["new_tokens"] for r in records)
summary = dict(plain=tokens / sum(r["plain_s"] for r in records), questions=len(records),
               identical=sum(r["identical"] for r in records), ngram=ngram, threads=torch.get_num_threads())
for name in assistants:
    for setting in ("before", "after"):
        key = f"{name}_{setting}"
        summary[key] = tokens / sum(r[f"{key}_s"] for r in records)
        summary[f"{key}_speedup"] = summary[key] / summary["plain"]
        summary[f"{key}_tau"] = sum(r[f"{key}_tau"] for r in records) / len(records)
print(summary)
with open(sys.argv[1], "w") as f:
    json.dump(dict(summary=summary, records=records), f, indent=1)
