"""Longer chats: fourth turns of the regeneration pool's conversations (training prompts, not dev: the shipped draft
saw their answers, so read the ratio between the two assistant calls, not against plain `generate`). For each: the
third turn answered with the assistant (its answer is the conversation's, the target's own greedy one), then the
fourth turn answered with the first call's caches kept and, again, from scratch; outputs checked against plain
`generate`.

    OMP_NUM_THREADS=1 python results/kept_caches_turn4.py runs/regen/pool/prompts_fourth_turn.jsonl results/kept_caches_turn4.json
    OMP_NUM_THREADS=1 python results/kept_caches_turn4.py runs/regen/pool/prompts_fourth_turn.jsonl \
        results/kept_caches_suffix_turn4.json --suffix

`--suffix`: a `SuffixAssistant(model)` (suffix candidates from the sequence alone, no draft) instead.
"""
import json
import sys
import time

import torch

from transformers_confu import ConFuAssistant, SuffixAssistant, load_target
from transformers_confu.models.target import DEFAULT_DRAFT

NEW, COUNT = 96, 8
model, tok = load_target()
assistant = (SuffixAssistant(model) if "--suffix" in sys.argv else
             ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model))
chats = [json.loads(line)["messages"] for line in open(sys.argv[1])][:COUNT * 40:40]


def chat(messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)["input_ids"]


def timed(ids, new, **kwargs):
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


records = []
for messages in chats:
    model.generate(chat(messages[:5]), max_new_tokens=256, do_sample=False, assistant_model=assistant)  # turn 3
    ids = chat(messages)
    kept, _ = timed(ids, NEW, assistant_model=assistant)
    reused = assistant.stats.reused_tokens
    assistant.kept_caches.clear()
    fresh, fresh_s = timed(ids, NEW, assistant_model=assistant)
    assistant.kept_caches.clear()
    model.generate(chat(messages[:5]), max_new_tokens=256, do_sample=False, assistant_model=assistant)
    kept, kept_s = timed(ids, NEW, assistant_model=assistant)
    ref, plain_s = timed(ids, NEW)
    records.append(dict(prompt_tokens=ids.shape[1], reused_tokens=reused, new_tokens=ref.shape[1] - ids.shape[1],
                        plain_s=plain_s, fresh_s=fresh_s, kept_s=kept_s,
                        identical=bool(torch.equal(ref, fresh) and torch.equal(ref, kept))))
    print(records[-1], flush=True)
tokens = sum(r["new_tokens"] for r in records)
summary = {name: tokens / sum(r[f"{name}_s"] for r in records) for name in ("plain", "fresh", "kept")}
summary |= dict(chats=len(records), identical=sum(r["identical"] for r in records),
                prompt_tokens=sum(r["prompt_tokens"] for r in records) / len(records),
                reused_tokens=sum(r["reused_tokens"] for r in records) / len(records))
print(summary)
with open(sys.argv[2], "w") as f:
    json.dump(dict(summary=summary, records=records), f, indent=1)
