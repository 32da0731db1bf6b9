"""Second turns of dev questions: how much of an assistant call is the prompt pass (what reusing the previous turn's
caches would save)."""
import json, time, torch
from transformers_confu import ConFuAssistant, load_target
from transformers_confu.models.target import DEFAULT_DRAFT
torch.set_num_threads(1)
model, tok = load_target()
assistant = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model)
rows = [json.loads(l) for l in open("src/transformers_confu/benchmark/data/specbench_dev.jsonl")]
seen, qs = set(), []
for r in rows:
    if len(r["turns"]) > 1 and r["category"] not in seen:
        seen.add(r["category"]); qs.append(r)
total = prefill = 0.0
lengths = []
for r in qs:
    msgs = [{"role": "user", "content": r["turns"][0]}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    first = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=False, assistant_model=assistant)
    msgs += [{"role": "assistant", "content": tok.decode(first[0, ids.shape[1]:], skip_special_tokens=True)},
             {"role": "user", "content": r["turns"][1]}]
    ids2 = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    new_part = ids2.shape[1] - first.shape[1]
    t = time.perf_counter()
    out = model.generate(ids2, attention_mask=torch.ones_like(ids2), max_new_tokens=96, do_sample=False, assistant_model=assistant)
    call = time.perf_counter() - t
    with torch.no_grad():
        t = time.perf_counter(); model(ids2); full = time.perf_counter() - t
        t = time.perf_counter(); model(ids2[:, -max(new_part, 1):]); part = time.perf_counter() - t
    total += call; prefill += full - part
    lengths.append((ids2.shape[1], new_part, out.shape[1] - ids2.shape[1]))
    print(r["category"], ids2.shape[1], new_part, f"call {call:.2f}s prefill {full:.2f}s tail {part:.2f}s", flush=True)
print(f"second turns: {len(qs)}; prompt tokens mean {sum(l[0] for l in lengths)/len(lengths):.0f}; "
      f"saving from reuse (prefill of the cached part) {prefill:.1f}s of {total:.1f}s = {prefill/total:.1%}")
