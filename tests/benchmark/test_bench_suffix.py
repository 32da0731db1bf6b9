"""confu-bench's suffix methods (SuffixAssistant, hybrid trees) end to end on a tiny target."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_target, tiny_tokenizer
from test_bench import write_questions
from transformers import AutoModelForCausalLM

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.benchmark.bench import build_methods, main
from transformers_confu.decoding.suffix_index import CorpusIndex, tokenizer_fingerprint


def save_setup(tmp_path) -> None:
    """A tiny target (with its tokenizer), a random draft for it and a small corpus, saved under `tmp_path`."""
    target, tokenizer = tiny_target(), tiny_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    ConFuAssistant.from_config(ConFuDraftConfig.for_target(target, draft_vocab_size=64), target).save_pretrained(
        tmp_path / "draft")
    corpus = CorpusIndex.build([[3, 4, 5, 6, 7, 8], [9, 10, 11]], dict(tokenizer_fingerprint=tokenizer_fingerprint(tokenizer)))
    corpus.save_pretrained(tmp_path / "corpus")


def test_bench_runs_suffix_and_hybrid_methods_and_reports_sources(tmp_path):
    save_setup(tmp_path)
    out = tmp_path / "res" / "bench"
    summary = main(["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
                    str(write_questions(tmp_path / "q.jsonl")), "--max-new-tokens", "12", "--trees", "2,1,3",
                    "--prompt-lookup", "0", "--suffix", "suffix,suffix-corpus,hybrid", "--suffix-corpus",
                    str(tmp_path / "corpus"), "--suffix-tokens", "4,6", "--hybrid-trees", "2,1,6,3",
                    "--auto-tree", "--auto-candidates", "2,1,3;2,1,5,2", "--auto-questions", "1", "--out", str(out)])
    names = list(summary["table"])
    assert names[:6] == ["generate", "suffix:n4", "suffix:n6", "suffix-corpus:n4", "suffix-corpus:n6",
                         "eagle3:draft:d2k1n3"]
    assert "eagle3-hybrid:draft:d2k1n6s3" in names
    assert summary["mismatches"] == {}
    cell = summary["table"]["eagle3-hybrid:draft:d2k1n6s3"]["overall"]
    assert cell["identical"] is True and cell["suffix_ms_per_round"] >= 0
    assert "accepted_by_source" not in summary["table"]["eagle3:draft:d2k1n3"]["overall"]  # the draft runs alone
    text = out.with_suffix(".md").read_text()
    assert "## Accepted tokens by source" in text and "| suffix:n4 |" in text
    row = json.loads((tmp_path / "res" / "bench_answers" / "suffix_n4.jsonl").read_text().splitlines()[0])
    assert "accepted_by_source" in row["choices"][0]


def test_bench_width_switch_adds_auto_width_rows_for_suffix_and_hybrid_methods(tmp_path):
    save_setup(tmp_path)
    summary = main(["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
                    str(write_questions(tmp_path / "q.jsonl", n=2)), "--max-new-tokens", "8", "--trees", "2,1,3",
                    "--prompt-lookup", "0", "--suffix", "suffix,hybrid", "--suffix-corpus", str(tmp_path / "corpus"),
                    "--suffix-tokens", "4", "--hybrid-trees", "2,1,6,3", "--width", "fixed,auto", "--loops", "eager,static",
                    "--out", str(tmp_path / "bench")])
    assert list(summary["table"]) == [
        "generate", "suffix:n4", "suffix-static:n4", "suffix:n4:auto-width", "eagle3:draft:d2k1n3",
        "eagle3-static:draft:d2k1n3", "eagle3-hybrid:draft:d2k1n6s3", "eagle3-hybrid-static:draft:d2k1n6s3",
        "eagle3-hybrid:draft:d2k1n6s3:auto-width"]  # auto: suffix and hybrid methods, eager loop only
    assert summary["mismatches"] == {}
    assert 1 <= summary["table"]["suffix:n4:auto-width"]["overall"]["nodes_per_round"] <= 4
    assert "nodes/round" in (tmp_path / "bench.md").read_text()
    with pytest.raises(SystemExit, match="--width"):
        main(["--target", str(tmp_path / "target"), "--questions", str(tmp_path / "q.jsonl"), "--width", "wide"])


def test_bench_runs_corpus_methods_once_per_corpus(tmp_path):
    save_setup(tmp_path)
    other = CorpusIndex.build([[5, 6, 7, 8, 9, 10, 11]], dict(tokenizer_fingerprint=tokenizer_fingerprint(tiny_tokenizer())))
    other.save_pretrained(tmp_path / "other")
    args = ["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
            str(write_questions(tmp_path / "q.jsonl", n=2)), "--max-new-tokens", "8", "--trees", "2,1,3",
            "--prompt-lookup", "0", "--suffix", "suffix,suffix-corpus,hybrid", "--suffix-tokens", "4",
            "--hybrid-trees", "2,1,6,3", "--out", str(tmp_path / "bench"), "--suffix-corpus"]
    summary = main(args + [str(tmp_path / "corpus"), str(tmp_path / "other")])
    assert list(summary["table"]) == [
        "generate", "suffix:n4", "suffix-corpus:n4@corpus", "suffix-corpus:n4@other", "eagle3:draft:d2k1n3",
        "eagle3-hybrid:draft:d2k1n6s3@corpus", "eagle3-hybrid:draft:d2k1n6s3@other"]
    assert summary["mismatches"] == {}
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    methods = {m.name: m for m in build_methods(target, [str(tmp_path / "draft")], [], dict(do_sample=False), None,
                                                suffix=("suffix-corpus", "hybrid"), hybrid_trees=[(2, 1, 6, 3)],
                                                suffix_corpus=[str(tmp_path / "corpus"), str(tmp_path / "other")])}
    proposers = {name: m.assistant.proposer if "hybrid" not in name else m.assistant.suffix for name, m in methods.items()
                 if "@" in name}
    assert {name: len(p.corpus.tokens) for name, p in proposers.items()} == {  # each its own corpus (+ separators)
        "suffix-corpus:n8@corpus": 11, "suffix-corpus:n8@other": 8, "eagle3-hybrid:draft:d2k1n6s3@corpus": 11,
        "eagle3-hybrid:draft:d2k1n6s3@other": 8}
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "corpus").rename(tmp_path / "elsewhere" / "other")
    with pytest.raises(ValueError, match="share a folder name"):
        main(args + [str(tmp_path / "elsewhere" / "other"), str(tmp_path / "other")])


def test_bench_trees_none_runs_hybrid_trees_only_and_bad_budgets_are_refused(tmp_path):
    save_setup(tmp_path)
    args = ["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
            str(write_questions(tmp_path / "q.jsonl", n=1)), "--max-new-tokens", "6", "--prompt-lookup", "0",
            "--suffix", "hybrid", "--suffix-corpus", str(tmp_path / "corpus"), "--hybrid-trees", "2,1,6,3",
            "--out", str(tmp_path / "bench")]
    summary = main(args + ["--trees", "none"])
    assert list(summary["table"]) == ["generate", "eagle3-hybrid:draft:d2k1n6s3"]
    assert summary["mismatches"] == {}
    with pytest.raises(SystemExit, match="Tree budgets '2,x,3'"):
        main(args + ["--trees", "2,x,3"])
