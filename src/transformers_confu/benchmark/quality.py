"""Task quality of speculative sampling: GSM8K exact match of the final number, plain vs speculative.

Lossless speculative sampling draws every token from the target's own distribution, so a task metric must
agree with plain sampling up to sampling noise. Per method the accuracy (an `evaluate` metric) gets a Wilson
interval; against plain `generate` the paired difference (same questions) gets a bootstrap interval over the
questions. An interval for the difference that contains 0 is what losslessness predicts.
"""

from __future__ import annotations

import re
from statistics import NormalDist

import datasets
import evaluate
import numpy as np

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str:
    """The last number in `text`, normalised ("$1,000.00." -> "1000", "-2.50" -> "-2.5"); "" if there is none."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return ""
    value = numbers[-1].replace(",", "")
    return value.rstrip("0").rstrip(".") if "." in value else value


def reference_number(reference: str) -> str | None:
    """The answer of a GSM8K solution ("... #### 72" -> "72"); None if it has no `####` line."""
    _, marker, answer = reference.rpartition("####")
    return final_number(answer) if marker else None


class FinalNumberExactMatch(evaluate.Metric):
    """Exact match of the final number of each prediction with the answer of its GSM8K reference solution.

    A local `evaluate` metric (nothing is downloaded): `compute(predictions=answers, references=solutions)`
    returns `exact_match` (the accuracy) and `correct` (0/1 per pair, for paired statistics).
    """

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=__doc__,
            citation="Cobbe et al. 2021, Training Verifiers to Solve Math Word Problems (GSM8K).",
            inputs_description="predictions: model answers (text); references: GSM8K solutions ending '#### N'.",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict:
        correct = [int(final_number(p) == reference_number(r)) for p, r in zip(predictions, references)]
        return dict(exact_match=sum(correct) / len(correct), correct=correct)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion `successes / n`."""
    if n == 0:
        raise ValueError("wilson_interval needs at least one trial (n > 0).")
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_bootstrap(reference: list[int], other: list[int], confidence: float = 0.95, resamples: int = 10_000,
                     seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(other) - mean(reference), resampling the paired items."""
    a, b = np.asarray(reference, dtype=float), np.asarray(other, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired_bootstrap needs two equally long, non-empty lists (got {a.size} and {b.size}).")
    rows = np.random.default_rng(seed).integers(0, a.size, size=(resamples, a.size))
    differences = (b[rows] - a[rows]).mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(differences, [tail, 1 - tail])
    return float(low), float(high)


def quality_check(records: dict[str, list[dict]], questions: list[dict], reference: str = "generate",
                  confidence: float = 0.95) -> dict | None:
    """GSM8K exact match of each method's first-turn answers on the questions with a `####` reference.

    `records` are `confu-bench` answer rows per method (`reference` among them). Returns per method
    `{exact_match, correct, n, ci}` and, except for `reference`, `difference` and `difference_ci` against
    it; None if no question has a GSM8K reference.
    """
    solutions = {q["question_id"]: solution for q in questions if (solution := _gsm8k_solution(q)) is not None}
    if not solutions:
        return None
    metric = FinalNumberExactMatch(keep_in_memory=True)
    out = {}
    for name, rows in records.items():
        rows = [row for row in rows if row["question_id"] in solutions]
        result = metric.compute(predictions=[row["choices"][0]["turns"][0] for row in rows],
                                references=[solutions[row["question_id"]] for row in rows])
        correct = result["correct"]
        out[name] = dict(exact_match=result["exact_match"], correct=correct, n=len(correct),
                         ci=wilson_interval(sum(correct), len(correct), confidence))
    for name, cell in out.items():
        if name != reference:
            cell["difference"] = cell["exact_match"] - out[reference]["exact_match"]
            cell["difference_ci"] = paired_bootstrap(out[reference]["correct"], cell["correct"], confidence)
    return dict(confidence=confidence, questions=len(out[reference]["correct"]), methods=out)


def _gsm8k_solution(question: dict) -> str | None:
    """The first turn's reference if it is a GSM8K solution (other Spec-Bench categories hold other kinds)."""
    reference = (question.get("reference") or [None])[0]
    return reference if isinstance(reference, str) and reference_number(reference) is not None else None


def quality_markdown(quality: dict) -> str:
    """The quality check as a markdown section (to follow the speed table)."""
    level = f"{100 * quality['confidence']:.0f}%"
    lines = ["", "## Task quality (lossless sampling check)", "",
             (f"GSM8K exact match of the final number on {quality['questions']} questions with a reference; "
              f"{level} Wilson interval per method, {level} paired bootstrap interval of the difference to "
              "`generate` (losslessness predicts an interval containing 0)."), "",
             "| method | exact match | interval | difference to generate | interval |", "|---|---|---|---|---|"]
    for name, cell in quality["methods"].items():
        low, high = cell["ci"]
        diff = "" if "difference" not in cell else f"{cell['difference']:+.3f}"
        diff_ci = "" if "difference_ci" not in cell else "[{:+.3f}, {:+.3f}]".format(*cell["difference_ci"])
        lines.append(f"| {name} | {cell['exact_match']:.3f} | [{low:.3f}, {high:.3f}] | {diff} | {diff_ci} |")
    return "\n".join(lines) + "\n"
