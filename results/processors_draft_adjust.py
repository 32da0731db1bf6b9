"""tau with a repetition penalty: draft adjusted by the processors vs not (A/B, same questions)."""
import sys, torch
from transformers_confu import ConFuAssistant, load_target
from transformers_confu.models.target import DEFAULT_DRAFT
from transformers_confu.benchmark.questions import DEFAULT_QUESTIONS, load_questions, chat_input_ids
import transformers_confu.decoding.tree as tree

torch.set_num_threads(1)
model, tok = load_target()
kw = eval(sys.argv[1]) if len(sys.argv) > 1 else {"repetition_penalty": 1.2}
qs = load_questions(DEFAULT_QUESTIONS, None, 1, None)
orig = tree.TreeDrafter.propose
for suffix in (False, True):
    a = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model)
    res = {}
    for mode in ("adjusted", "unaware"):
        acc, rounds = 0, 0
        for q in qs:
            ids = chat_input_ids(tok, q["turns"][:1])
            if mode == "unaware":
                def propose(self, *args, **kwargs):
                    saved, self.processing = self.processing, None
                    try:
                        return orig(self, *args, **kwargs)
                    finally:
                        self.processing = saved
                tree.TreeDrafter.propose = propose
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False, **kw)
            out = model.generate(ids, max_new_tokens=64, do_sample=False, assistant_model=a, suffix=suffix, **kw)
            tree.TreeDrafter.propose = orig
            assert torch.equal(out, ref)
            acc += sum(a.stats.accept_lengths); rounds += len(a.stats.accept_lengths)
        res[mode] = acc / rounds
    print("suffix" if suffix else "alone", kw, res, flush=True)
