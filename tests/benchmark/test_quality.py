"""The lossless-sampling quality check: GSM8K exact match through `evaluate`, confidence intervals, the report."""

from __future__ import annotations

import json

import evaluate
import numpy as np
import pytest
from scipy.stats import binomtest
from test_bench import save_target_and_draft

from transformers_confu.benchmark.bench import main
from transformers_confu.benchmark.quality import (
    FinalNumberExactMatch,
    final_number,
    paired_bootstrap,
    quality_check,
    reference_number,
    wilson_interval,
)


def test_final_numbers_of_answers_and_gsm8k_references():
    assert final_number("It costs $1,000.00.") == "1000"
    assert final_number("from 3 to -2.50 degrees") == "-2.5"
    assert final_number("The answer is 72, I think") == "72"
    assert final_number("no number") == ""
    assert reference_number("48/2 = <<48/2=24>>24\n#### 72") == "72"
    assert reference_number("a solution without an answer line 5") is None


def test_exact_match_is_an_evaluate_metric():
    metric = FinalNumberExactMatch(keep_in_memory=True)
    assert isinstance(metric, evaluate.EvaluationModule)
    result = metric.compute(predictions=["So 72.", "It is 1,000", "I do not know", "5 apples, 6 pears"],
                            references=["#### 72", "x\n#### 1000", "#### 3", "#### 5"])
    assert result == dict(exact_match=0.5, correct=[1, 1, 0, 0])


@pytest.mark.parametrize("successes,n", [(8, 10), (0, 10), (10, 10), (17, 40)])
def test_wilson_interval_matches_scipy(successes, n):
    expected = binomtest(successes, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson_interval(successes, n) == pytest.approx((expected.low, expected.high), abs=1e-9)
    assert wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)  # the textbook value
    with pytest.raises(ValueError, match="n > 0"):
        wilson_interval(0, 0)


def test_paired_bootstrap_interval_of_a_difference():
    assert paired_bootstrap([1, 0, 1, 1], [1, 0, 1, 1]) == (0.0, 0.0)
    assert paired_bootstrap([0] * 5, [1] * 5) == (1.0, 1.0)
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2, 400)
    b = a.copy()
    b[np.flatnonzero(a == 0)[:40]] = 1  # 40 of 400 items gained: the difference is 0.1
    low, high = paired_bootstrap(a.tolist(), b.tolist())
    d = (b - a).astype(float)
    half = 1.96 * d.std() / np.sqrt(d.size)  # the normal approximation the bootstrap should approach
    assert low == pytest.approx(0.1 - half, abs=0.006) and high == pytest.approx(0.1 + half, abs=0.006)
    with pytest.raises(ValueError, match="equally long"):
        paired_bootstrap([1, 0], [1])


def test_quality_check_uses_only_questions_with_a_gsm8k_reference():
    questions = [dict(question_id=1, reference=["#### 4"]), dict(question_id=2, reference=["#### 9"]),
                 dict(question_id=3, reference=["a summary"]), dict(question_id=4, reference=[["a", "list"]]),
                 dict(question_id=5)]

    def answer(qid, text):
        return dict(question_id=qid, choices=[dict(turns=[text])])

    records = {"generate": [answer(1, "4"), answer(2, "8"), answer(3, "x"), answer(4, "4"), answer(5, "1")],
               "eagle3": [answer(1, "4"), answer(2, "9"), answer(3, "x"), answer(4, "4"), answer(5, "1")]}
    quality = quality_check(records, questions)
    assert quality["questions"] == 2
    plain, spec = quality["methods"]["generate"], quality["methods"]["eagle3"]
    assert (plain["correct"], spec["correct"]) == ([1, 0], [1, 1])
    assert spec["difference"] == 0.5 and "difference" not in plain
    assert plain["ci"] == wilson_interval(1, 2) and spec["difference_ci"][1] == 1.0
    assert quality_check(records, questions[2:]) is None


def test_bench_at_temperature_reports_task_quality(tmp_path):
    save_target_and_draft(tmp_path)
    rows = [dict(question=f"t{3 + i} t{9 + i}", answer=f"t4 is {i}\n#### {20 + i}") for i in range(5)]
    rows.append(dict(question_id=99, category="qa", turns=["t5 t6"]))  # left out by --categories
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "bench"
    summary = main(["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
                    str(tmp_path / "q.jsonl"), "--categories", "gsm8k", "--max-new-tokens", "8", "--trees", "2,1,3",
                    "--prompt-lookup", "0", "--temperature", "0.8", "--out", str(out)])
    quality = summary["quality"]
    assert quality["questions"] == 5 and list(quality["methods"]) == ["generate", "eagle3:draft:d2k1n3"]
    for name, cell in quality["methods"].items():
        answers = [json.loads(line) for line in (tmp_path / f"bench_answers/{name.replace(':', '_')}.jsonl")
                   .read_text().splitlines()]
        assert [a["question_id"] for a in answers] == [1, 2, 3, 4, 5]
        assert cell["correct"] == [int(final_number(a["choices"][0]["turns"][0]) == str(20 + i))
                                   for i, a in enumerate(answers)]
        assert cell["ci"] == pytest.approx(wilson_interval(sum(cell["correct"]), 5))
    assert json.loads(out.with_suffix(".json").read_text())["quality"]["questions"] == 5
    report = out.with_suffix(".md").read_text()
    assert report.index("## Overall") < report.index("## Task quality")
    assert "| eagle3:draft:d2k1n3 | " in report.split("## Task quality")[1]
