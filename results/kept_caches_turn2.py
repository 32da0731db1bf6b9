"""Dev second turns with the shipped default assistant: the call that reuses the first turn's caches (a chat's next
turn) against the same call from scratch and plain `generate`, greedy, outputs checked identical.

    OMP_NUM_THREADS=1 python results/kept_caches_turn2.py results/kept_caches_turn2.json
    OMP_NUM_THREADS=1 python results/kept_caches_turn2.py results/kept_caches_suffix_turn2.json --suffix

`--suffix`: a `SuffixAssistant(model)` (suffix candidates from the sequence alone, no draft) instead.
"""
import json
import sys
import time

import torch

from transformers_confu import ConFuAssistant, SuffixAssistant, load_target
from transformers_confu.decoding.generation import KeptCaches
from transformers_confu.models.target import DEFAULT_DRAFT

NEW = 96
model, tok = load_target()
assistant = (SuffixAssistant(model) if "--suffix" in sys.argv else
             ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model))
rows = [json.loads(line) for line in open("src/transformers_confu/benchmark/data/specbench_dev.jsonl")]
questions = [r for r in rows if len(r["turns"]) > 1][:16]


def chat(messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)["input_ids"]


def timed(ids, **kwargs):
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


records = []
for q in questions:
    messages = [{"role": "user", "content": q["turns"][0]}]
    first, _ = timed(chat(messages), assistant_model=assistant)  # leaves its caches on the assistant
    kept = assistant.kept_caches
    messages += [{"role": "assistant", "content": tok.decode(first[0, chat(messages).shape[1]:],
                                                             skip_special_tokens=True)},
                 {"role": "user", "content": q["turns"][1]}]
    ids = chat(messages)
    ref, plain_s = timed(ids)
    assistant.kept_caches = KeptCaches()
    fresh, fresh_s = timed(ids, assistant_model=assistant)
    assistant.kept_caches = kept
    reused, reused_s = timed(ids, assistant_model=assistant)
    records.append(dict(question_id=q["question_id"], category=q["category"], prompt_tokens=ids.shape[1],
                        reused_tokens=assistant.stats.reused_tokens, new_tokens=ref.shape[1] - ids.shape[1],
                        plain_s=plain_s, fresh_s=fresh_s, reused_s=reused_s,
                        identical=bool(torch.equal(ref, fresh) and torch.equal(ref, reused))))
    print(records[-1], flush=True)
tokens = sum(r["new_tokens"] for r in records)
summary = {name: tokens / sum(r[f"{name}_s"] for r in records) for name in ("plain", "fresh", "reused")}
summary |= dict(questions=len(records), identical=sum(r["identical"] for r in records),
                prompt_tokens=sum(r["prompt_tokens"] for r in records) / len(records),
                reused_tokens=sum(r["reused_tokens"] for r in records) / len(records),
                threads=torch.get_num_threads())
print(summary)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(dict(summary=summary, records=records), f, indent=1)
