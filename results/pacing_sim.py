"""Replay of a per-round pacing policy (results/pacing_dev.md) on the per-round accepted-token counts that the shipped
draft's benches recorded, without running a model: a round that drafts at output position p accepts what the
recorded round covering p accepted from p on; a speculative round costs `c` plain `generate` steps (the bench's
tau / speed-up), a plain step of the loop 1.03 (measured, the loop's verify pass of the root alone).

    python results/pacing_sim.py
"""

import itertools
import json

RESULTS = "results/"
RUNS = {  # name: (answers of the always-drafting run, cost of one of its rounds in plain steps)
    "no processor, d2k2n4": (
        "shipped_v21_avx2_answers/confu-saved_smollm2-135m-instruct-confu_d2k2n4.jsonl", 1.77 / 1.19),
    "no processor, hybrid d2k2n6s4": (
        "shipped_v21_avx2_answers/confu-saved-hybrid_smollm2-135m-instruct-confu_d2k2n6s4.jsonl", 2.28 / 1.35),
    "repetition_penalty=1.2, d2k2n4": (
        "processors_penalty_dev_answers/confu-saved_smollm2-135m-instruct-confu_d2k2n4.jsonl", 1.30 / 0.93),
    "repetition_penalty=1.2, hybrid d2k2n6s4": (
        "processors_penalty_dev_answers/confu-saved-hybrid_smollm2-135m-instruct-confu_d2k2n6s4.jsonl", 1.38 / 0.89),
}
STEP = 1.03


def load(path: str) -> list[tuple[list[int], int]]:
    rows = [json.loads(line)["choices"][0] for line in open(RESULTS + path)]
    return [(row["accept_lengths"], row["new_tokens"][0]) for row in rows]


def accepted_at(rounds: list[int], position: int) -> int:
    start = 0
    for n in rounds:
        if start <= position < start + n:
            return n - (position - start)
        start += n
    return 1


def paced(answers, cost: float, smoothing: float, max_wait: int, margin: float) -> float:
    """Speed-up over plain generate of the Pacer rule: draft unless the smoothed accepted tokens per round times a
    plain step's cost fall below `margin` x a round's cost; then 1, 2, 4, ... `max_wait` plain steps per probe."""
    tokens = total = 0.0
    for rounds, length in answers:
        position, mean, wait, backoff = 0, None, 1, 1
        while position < length:
            if wait:
                wait, position, total = wait - 1, position + 1, total + STEP
                continue
            n = min(accepted_at(rounds, position), length - position)
            position, total = position + n, total + cost
            mean = n if mean is None else mean + smoothing * (n - mean)
            if mean * STEP >= margin * cost:
                backoff = 1
            else:
                wait, backoff = backoff, min(2 * backoff, max_wait)
        tokens += length
    return tokens / total


def main() -> None:
    data = {name: (load(path), cost) for name, (path, cost) in RUNS.items()}
    names = list(data)
    print("| policy | " + " | ".join(names) + " |\n" + "|---" * (len(names) + 1) + "|")
    always = [sum(t for _, t in a) / (sum(len(r) for r, _ in a) * c) for a, c in data.values()]
    oracle = [sum(t for _, t in a) / sum(min(len(r) * c, t * STEP) for r, t in a) for a, c in data.values()]
    print("| always draft | " + " | ".join(f"{x:.3f}x" for x in always) + " |")
    print("| the better of always and plain steps per answer (an oracle) | "
          + " | ".join(f"{x:.3f}x" for x in oracle) + " |")
    for smoothing, max_wait, margin in itertools.product([0.1, 0.25, 0.5], [4, 16, 64], [0.8, 0.9, 1.0]):
        row = [paced(a, c, smoothing, max_wait, margin) for a, c in data.values()]
        print(f"| paced, smoothing {smoothing}, max wait {max_wait}, margin {margin} | "
              + " | ".join(f"{x:.3f}x" for x in row) + " |")


if __name__ == "__main__":
    main()
