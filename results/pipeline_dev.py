"""transformers' text-generation pipeline with and without the shipped assistant (the default draft folder: its hybrid
tree), on the dev set's first turns as chat messages: identical answers, tokens/s of each, one question at a time
(plain then assisted, so that a slow moment of the machine hits both).

    OMP_NUM_THREADS=1 python results/pipeline_dev.py results/pipeline_dev.json
"""

import json
import platform
import sys
import time

import torch
from transformers import pipeline

from transformers_confu import ConFuAssistant, load_target
from transformers_confu.benchmark.questions import DEFAULT_QUESTIONS, load_questions
from transformers_confu.models.target import DEFAULT_DRAFT

MAX_NEW_TOKENS = 96


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_target()
    assistant = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model)
    plain = pipeline("text-generation", model=model, tokenizer=tokenizer)
    assisted = pipeline("text-generation", model=model, tokenizer=tokenizer, assistant_model=assistant)
    questions = load_questions(DEFAULT_QUESTIONS, None, 2, None)
    options = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    assisted([{"role": "user", "content": "Hello."}], **options)  # warm-up
    seconds = {"plain": 0.0, "assisted": 0.0}
    tokens = identical = 0
    accepted = []
    for question in questions:
        messages = [{"role": "user", "content": question["turns"][0]}]
        start = time.perf_counter()
        ref = plain(messages, **options)
        seconds["plain"] += time.perf_counter() - start
        start = time.perf_counter()
        out = assisted(messages, **options)
        seconds["assisted"] += time.perf_counter() - start
        identical += out == ref
        tokens += assistant.stats.new_tokens
        accepted += assistant.stats.accept_lengths
    speed = {name: tokens / s for name, s in seconds.items()}
    summary = json.dumps(dict(
        command="OMP_NUM_THREADS=1 python results/pipeline_dev.py results/pipeline_dev.json", draft=DEFAULT_DRAFT.name,
        hardware=f"{platform.machine()} CPU, 1 thread", questions=len(questions), max_new_tokens=MAX_NEW_TOKENS,
        identical=f"{identical}/{len(questions)}", new_tokens=tokens, tau=sum(accepted) / len(accepted),
        tokens_per_s=speed, speedup=speed["assisted"] / speed["plain"]), indent=2)
    with open(sys.argv[1], "w") as f:
        f.write(summary + "\n")
    print(summary)


if __name__ == "__main__":
    main()
