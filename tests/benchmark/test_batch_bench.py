"""confu-bench --batch-size on a tiny random target."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_target, tiny_tokenizer
from test_bench import write_questions

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.benchmark.bench import main
from transformers_confu.decoding.suffix_index import CorpusIndex, tokenizer_fingerprint


def save_target_and_draft(tmp_path, eos_token_id: int | None = None):
    """A tiny target (with its tokenizer) in `tmp_path / "target"`, a random EAGLE-3 draft in `tmp_path / "draft"`."""
    target, tokenizer = tiny_target(), tiny_tokenizer()
    target.generation_config.eos_token_id = eos_token_id
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    ConFuAssistant.from_config(ConFuDraftConfig.for_target(target, draft_vocab_size=64), target).save_pretrained(
        tmp_path / "draft")
    return tokenizer


def test_batched_bench_compares_each_budget_with_plain_batched_generate(tmp_path):
    save_target_and_draft(tmp_path, eos_token_id=7)  # rows end at different lengths
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


def test_batched_bench_runs_suffix_and_hybrid_methods(tmp_path):
    tokenizer = save_target_and_draft(tmp_path)
    CorpusIndex.build([[3, 4, 5, 6, 7, 8], [9, 10, 11]], dict(tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
                      ).save_pretrained(tmp_path / "corpus")
    out = tmp_path / "bench"
    summary = main(["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
                    str(write_questions(tmp_path / "q.jsonl", n=3)), "--max-new-tokens", "10", "--trees", "2,1,3",
                    "--batch-size", "2", "--suffix", "suffix,suffix-corpus,hybrid", "--suffix-corpus",
                    str(tmp_path / "corpus"), "--suffix-tokens", "4", "--hybrid-trees", "2,1,6,3", "--out", str(out)])
    assert list(summary["table"]) == ["generate", "suffix:auto", "suffix:n4", "suffix-corpus:auto", "suffix-corpus:n4",
                                      "eagle3:draft:auto", "eagle3:draft:d2k1n3", "eagle3-hybrid:draft:d2k1n6s3"]
    assert summary["mismatches"] == {}
    for name in ("suffix:n4", "eagle3-hybrid:draft:d2k1n6s3"):
        cell = summary["table"][name]["overall"]
        assert cell["identical"] is True and cell["tau"] >= 1 and cell["suffix_ms_per_round"] >= 0
        assert cell["nodes_per_round"] is None  # batched trees are padded to the budget: not counted, not 0
    sources = out.with_suffix(".md").read_text().split("## Accepted tokens by source")[1]
    assert "| suffix-corpus:n4 |" in sources and "| n/a |" in sources


def test_batched_bench_runs_the_static_loop_beside_the_eager_one(tmp_path):
    save_target_and_draft(tmp_path, eos_token_id=7)
    summary = main(["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
                    str(write_questions(tmp_path / "q.jsonl", n=3)), "--max-new-tokens", "10", "--trees", "3,2,5",
                    "--batch-size", "2", "--loops", "eager,static", "--out", str(tmp_path / "bench")])
    assert list(summary["table"]) == ["generate", "eagle3:draft:auto", "eagle3-static:draft:auto",
                                      "eagle3:draft:d3k2n5", "eagle3-static:draft:d3k2n5"]
    assert summary["mismatches"] == {} and summary["meta"]["loops"] == "eager,static"


@pytest.mark.parametrize("flags", [["--assistant-model", "x"], ["--auto-tree"]])
def test_batched_bench_refuses_batch_1_methods_before_loading_anything(flags, capsys):
    with pytest.raises(SystemExit):
        main(["--target", "no/such-target", "--batch-size", "4", *flags])
    error = capsys.readouterr().err
    assert flags[0] in error and "use --batch-size 1" in error
