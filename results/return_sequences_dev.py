"""`num_return_sequences=2` with sampling: the shipped default assistant against plain `generate` with the same
settings, on the dev set's first turns (2 per category), one question at a time (plain, then assisted). The two
copies of a prompt run as a batch of 2 (the assistant's batch policy on a CPU: a depth-1 chain); tokens/s counts
both copies' real tokens (up to each one's EOS).

    OMP_NUM_THREADS=1 python results/return_sequences_dev.py results/return_sequences_dev.json
"""

import json
import platform
import sys
import time

import torch

from transformers_confu import ConFuAssistant, load_target
from transformers_confu.benchmark.questions import DEFAULT_QUESTIONS, chat_input_ids, load_questions
from transformers_confu.models.target import DEFAULT_DRAFT

SETTINGS = dict(max_new_tokens=96, do_sample=True, temperature=0.7, num_return_sequences=2)


def real_tokens(sequences: torch.LongTensor, prompt: int, eos: int) -> int:
    new = sequences[:, prompt:]
    ended = (new == eos).int().cumsum(1) > 0  # at and after each row's first EOS
    return int((~ended).sum() + ended.any(1).sum())  # the EOS itself counts


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_target()
    assistant = ConFuAssistant.from_pretrained(DEFAULT_DRAFT, target_model=model)
    questions = load_questions(DEFAULT_QUESTIONS, None, 2, None)
    eos = tokenizer.eos_token_id
    warm = chat_input_ids(tokenizer, ["Hello."])
    model.generate(warm, assistant_model=assistant, **SETTINGS)
    seconds, tokens, modes, rounds = {"plain": 0.0, "assisted": 0.0}, {"plain": 0, "assisted": 0}, set(), []
    for seed, question in enumerate(questions):
        ids = chat_input_ids(tokenizer, question["turns"][:1])
        runs = (("plain", dict(attention_mask=torch.ones_like(ids))), ("assisted", dict(assistant_model=assistant)))
        for name, extra in runs:
            torch.manual_seed(seed)
            start = time.perf_counter()
            out = model.generate(ids, **extra, **SETTINGS)
            seconds[name] += time.perf_counter() - start
            tokens[name] += real_tokens(out, ids.shape[1], eos)
        modes.add(assistant.stats.mode)
        rounds += assistant.stats.accept_lengths  # every row's rounds
    speed = {name: tokens[name] / seconds[name] for name in seconds}
    summary = json.dumps(dict(
        command="OMP_NUM_THREADS=1 python results/return_sequences_dev.py results/return_sequences_dev.json",
        draft=DEFAULT_DRAFT.name, hardware=f"{platform.machine()} CPU, 1 thread", questions=len(questions),
        settings=SETTINGS, assistant_modes=sorted(modes), tau=sum(rounds) / len(rounds), tokens=tokens,
        tokens_per_s=speed,
        speedup=speed["assisted"] / speed["plain"]), indent=2)
    with open(sys.argv[1], "w") as f:
        f.write(summary + "\n")
    print(summary)


if __name__ == "__main__":
    main()
