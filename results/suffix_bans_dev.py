"""Suffix candidates that the call's logits processors ban, left out of the tree (after) or verified anyway
(before, `SuffixProposer.best_paths` ignoring `allowed`), under `no_repeat_ngram_size`: the shipped default
assistant (hybrid) and suffix candidates alone, dev first turns, greedy, each question answered by plain `generate`
and by every setting in turn, outputs checked identical. With `batch` > 1 the questions go B at a time, left-padded,
against plain batched `generate`, each assistant at its own tree width (`tree_total_tokens`: a batch speculates).

    OMP_NUM_THREADS=1 python results/suffix_bans_dev.py results/suffix_bans_dev.json [per_category] [ngram] [batch]
"""
import json
import sys
import time

import torch

from transformers_confu import ConFuAssistant, SuffixAssistant, load_target
from transformers_confu.benchmark.batch_bench import left_padded
from transformers_confu.benchmark.questions import chat_input_ids, load_questions
from transformers_confu.decoding.batched import eos_token_ids, real_lengths
from transformers_confu.decoding.suffix import SuffixProposer
from transformers_confu.models.target import DEFAULT_DRAFT

NEW = 96
per_category = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ngram = int(sys.argv[3]) if len(sys.argv) > 3 else 4
batch = int(sys.argv[4]) if len(sys.argv) > 4 else 1
model, tok = load_target()
assistants = {"hybrid": ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model),
              "suffix": SuffixAssistant(model)}
pruned = SuffixProposer.best_paths


def unpruned(self, context, allowed=None):
    return pruned(self, context)


widths = {"hybrid": 6, "suffix": 8}  # each assistant's own (batch 1: its default)


def timed(ids, mask, **kwargs):
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, no_repeat_ngram_size=ngram,
                         pad_token_id=tok.pad_token_id, **kwargs)
    return out, time.perf_counter() - start


records, questions = [], load_questions(per_category=per_category)
for q in [questions[i : i + batch] for i in range(0, len(questions), batch)]:
    ids, mask = left_padded([chat_input_ids(tok, x["turns"][:1])[0] for x in q], tok.pad_token_id)
    ref, plain_s = timed(ids, mask)
    record = dict(question_id=[x["question_id"] for x in q], category=[x["category"] for x in q],
                  new_tokens=int(real_lengths(ref[:, ids.shape[1]:], eos_token_ids(model.generation_config)).sum()),
                  plain_s=plain_s, identical=True)
    for name, assistant in assistants.items():
        for setting in ("before", "after"):
            SuffixProposer.best_paths = unpruned if setting == "before" else pruned
            width = {} if batch == 1 else dict(tree_total_tokens=widths[name])
            out, seconds = timed(ids, mask, assistant_model=assistant, **width)
            record[f"{name}_{setting}_s"] = seconds
            record[f"{name}_{setting}_tau"] = assistant.stats.mean_accepted_tokens
            record["identical"] &= bool(torch.equal(out, ref))
    SuffixProposer.best_paths = pruned
    records.append(record)
    print(record, flush=True)
tokens = sum(r["new_tokens"] for r in records)
summary = dict(plain=tokens / sum(r["plain_s"] for r in records), questions=len(questions), batch=batch,
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
