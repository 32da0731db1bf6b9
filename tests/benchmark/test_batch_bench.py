"""confu-bench --batch-size on a tiny random target."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_target, tiny_tokenizer
from test_bench import write_questions

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.benchmark.bench import main


def test_batched_bench_compares_each_budget_with_plain_batched_generate(tmp_path):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    target.generation_config.eos_token_id = 7  # rows end at different lengths
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    ConFuAssistant.from_config(ConFuDraftConfig.for_target(target, draft_vocab_size=64), target).save_pretrained(
        tmp_path / "draft")
    out = tmp_path / "bench"
    summary = main(["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
                    str(write_questions(tmp_path / "q.jsonl", n=5)), "--max-new-tokens", "10", "--trees",
                    "2,1,3;3,2,5", "--batch-size", "2", "--static-baseline", "--out", str(out)])
    methods = ["generate", "generate-static", "eagle3:draft:auto", "eagle3:draft:d2k1n3", "eagle3:draft:d3k2n5"]
    assert list(summary["table"]) == methods and summary["mismatches"] == {}
    assert summary["meta"]["batch_size"] == 2 and "in batches of 2 first turns" in out.with_suffix(".md").read_text()
    for name in methods:
        rows = [json.loads(line) for line in (tmp_path / "bench_answers" / f"{name.replace(':', '_')}.jsonl")
                .read_text().splitlines()]
        assert [r["question_id"] for r in rows] == list(range(5))  # the last batch has one row
        assert all(len(r["choices"][0]["turns"]) == 1 for r in rows)
        assert all(1 <= a for r in rows for a in r["choices"][0]["accept_lengths"])
    assert summary["table"]["eagle3:draft:d3k2n5"]["overall"]["tau"] >= 1


@pytest.mark.parametrize("flags", [["--suffix", "hybrid"], ["--loops", "eager,static"], ["--auto-tree"]])
def test_batched_bench_refuses_batch_1_methods_before_loading_anything(flags, capsys):
    with pytest.raises(SystemExit):
        main(["--target", "no/such-target", "--batch-size", "4", *flags])
    error = capsys.readouterr().err
    assert flags[0] in error and "use --batch-size 1" in error
