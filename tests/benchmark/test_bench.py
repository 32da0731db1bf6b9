"""confu-bench end to end on a tiny random target, and its losslessness check."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_target, tiny_tokenizer

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.benchmark.bench import (
    Method,
    _speculative,
    build_methods,
    main,
    run_bench,
    summarize,
)


def write_questions(path, n=4):
    rows = [dict(question_id=i, category=["qa", "math"][i % 2], turns=[f"t{3 + i} t{9 + i}", "t5 t6"][: 1 + i % 2])
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_target_and_draft(tmp_path):
    """A tiny target with its tokenizer in `tmp_path/target` and a random draft for it in `tmp_path/draft`."""
    target, tokenizer = tiny_target(), tiny_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    ConFuAssistant.from_config(ConFuDraftConfig.for_target(target, draft_vocab_size=64), target).save_pretrained(
        tmp_path / "draft")


def test_bench_end_to_end_writes_spec_bench_answers_tables_and_plots(tmp_path):
    save_target_and_draft(tmp_path)
    out = tmp_path / "res" / "bench_t0.7"  # a prefix with a dot in it: kept whole
    summary = main(["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
                    str(write_questions(tmp_path / "q.jsonl")), "--max-new-tokens", "12", "--trees", "3,2,5;2,1,3",
                    "--prompt-lookup", "3", "--auto-tree", "--auto-candidates", "1,1,2;2,1,3", "--auto-questions", "2",
                    "--out", str(out)])
    chosen = "d{}k{}n{}".format(*summary["auto_tree"]["draft"]["chosen"])
    assert chosen in ("d1k1n2", "d2k1n3")
    methods = ["generate", "prompt_lookup3", "eagle3:draft:d3k2n5", "eagle3:draft:d2k1n3"]
    methods += [] if chosen == "d2k1n3" else ["eagle3:draft:d1k1n2"]
    assert list(summary["table"]) == methods
    assert summary["mismatches"] == {}
    for name in methods:
        cell = summary["table"][name]["overall"]
        assert set(cell) >= {"tau", "tokens_per_s", "speedup", "identical"} and cell["identical"] is True
        answers = tmp_path / "res" / "bench_t0.7_answers" / f"{name.replace(':', '_')}.jsonl"
        rows = [json.loads(line) for line in answers.read_text().splitlines()]
        assert len(rows) == 4
        choice = rows[1]["choices"][0]
        assert {"question_id", "category", "model_id", "choices"} <= set(rows[1])
        assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 2
        assert all(1 <= a for a in choice["accept_lengths"])
    assert summary["table"]["generate"]["overall"]["speedup"] == 1.0
    assert set(summary["table"]["generate"]) == {"qa", "math", "overall"}
    written = {path.name for path in (tmp_path / "res").iterdir()}
    assert written == {"bench_t0.7.json", "bench_t0.7.md", "bench_t0.7.png", "bench_t0.7_answers"}
    assert (tmp_path / "res" / "bench_t0.7.png").stat().st_size > 1000
    assert "| method |" in (tmp_path / "res" / "bench_t0.7.md").read_text()


def test_equality_check_catches_a_lossy_method(tmp_path):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    methods = build_methods(target, [], [], dict(do_sample=False), None)

    def lossy(ids, n):  # greedy, but the 4th new token is replaced
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        out[0, ids.shape[1] + 3] = (out[0, ids.shape[1] + 3] + 1) % 128
        return out, None

    methods.append(Method("lossy", lossy))
    questions = [json.loads(line) for line in write_questions(tmp_path / "q.jsonl").read_text().splitlines()]
    records, mismatches, warmup = run_bench(target, tokenizer, methods, questions, 8, 0, greedy=True)
    assert set(warmup) == {"generate", "lossy"}
    assert [m["position"] for m in mismatches["lossy"] if m["turn"] == 0] == [3, 3, 3, 3]
    assert all(m["top2_logit_gap"] > 0 for m in mismatches["lossy"] if m["turn"] == 0)
    table = summarize(records, True, mismatches)
    assert table["lossy"]["overall"]["identical"] is False and table["generate"]["overall"]["identical"] is True


def test_bench_runs_a_confu_draft_in_each_mode_and_loop_and_assisted_decoding(tmp_path):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    tiny_target(seed=1).save_pretrained(tmp_path / "small")  # same vocabulary: usable as an assistant model
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True)
    ConFuAssistant.from_config(config, target).save_pretrained(tmp_path / "confu")
    summary = main(["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "confu"), "--questions",
                    str(write_questions(tmp_path / "q.jsonl", n=2)), "--max-new-tokens", "10", "--trees", "3,2,5",
                    "--prompt-lookup", "0", "--contemplate-nodes", "saved,all,1,0", "--assistant-model",
                    str(tmp_path / "small"), "--loops", "eager,static", "--out", str(tmp_path / "bench")])
    names = ["generate", "assisted", "confu-saved:confu:d3k2n5", "confu:confu:d3k2n5", "confu-c1:confu:d3k2n5",
             "confu-off:confu:d3k2n5", "confu-saved-static:confu:d3k2n5", "confu-static:confu:d3k2n5",
             "confu-c1-static:confu:d3k2n5", "confu-off-static:confu:d3k2n5"]
    assert list(summary["table"]) == names
    assert summary["mismatches"] == {}
    assert all(summary["table"][n]["overall"]["identical"] is True for n in names)
    assert set(summary["warmup_seconds"]) == set(names)


def test_saved_contemplate_nodes_keep_the_drafts_own_setting():
    """'saved' runs a ConFu draft as configured (here: no `[con]` in greedy calls); 'all' overrides that."""
    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True, contemplate_when_greedy=False)
    assistant = ConFuAssistant.from_config(config, target)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    _speculative(target, assistant, dict(do_sample=False), "saved")(ids, 12)
    assert assistant.stats.fresh_futures == 0
    _speculative(target, assistant, dict(do_sample=False), None)(ids, 12)
    assert assistant.stats.fresh_futures > 0


def test_packaged_spec_bench_questions_load_by_default():
    from transformers_confu.benchmark.questions import (
        DEFAULT_QUESTIONS,
        PACKAGED_QUESTIONS,
        load_questions,
    )

    assert DEFAULT_QUESTIONS.as_posix().endswith(PACKAGED_QUESTIONS)
    rows = load_questions()
    assert len(rows) == 240 and len({r["category"] for r in rows}) == 13
    assert len(load_questions(per_category=1)) == 13


def test_turns_device_dtype_and_the_static_cache_baseline(tmp_path):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    out = tmp_path / "bench"
    main(["--target", str(tmp_path / "target"), "--drafts", "--questions", str(write_questions(tmp_path / "q.jsonl")),
          "--max-new-tokens", "4", "--prompt-lookup", "0", "--turns", "1", "--static-baseline", "--compile", "never",
          "--device", "cpu",
          "--dtype", "float32", "--out", str(out)])
    for method in ("generate", "generate-static"):
        rows = [json.loads(line) for line in (tmp_path / "bench_answers" / f"{method}.jsonl").read_text().splitlines()]
        assert rows and all(len(row["choices"][0]["turns"]) == 1 for row in rows)
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["table"]["generate-static"]["overall"]["identical"] is True and summary["meta"]["dtype"] == "float32"


def test_draft_dtypes_run_each_draft_once_per_dtype_and_are_recorded(tmp_path, capsys):
    save_target_and_draft(tmp_path)
    common = ["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
              str(write_questions(tmp_path / "q.jsonl", n=2)), "--max-new-tokens", "6", "--trees", "2,1,3",
              "--prompt-lookup", "0", "--out", str(tmp_path / "bench")]
    summary = main(common + ["--draft-dtypes", "float32,bfloat16,float32"])  # a repeat runs once
    assert list(summary["table"]) == ["generate", "eagle3:draft:d2k1n3@float32", "eagle3:draft:d2k1n3@bfloat16"]
    assert summary["mismatches"] == {}
    assert summary["meta"]["draft_dtypes"] == {"float32": "float32", "bfloat16": "bfloat16"}
    with pytest.raises(SystemExit):  # refused before the target loads: the folder need not exist
        main(["--target", str(tmp_path / "nowhere"), "--draft-dtypes", "bf16"])
    assert "--draft-dtypes 'bf16': choose among auto, float32, bfloat16, float16" in capsys.readouterr().err


def test_generate_kwargs_reach_every_method_and_are_recorded(tmp_path):
    """`--generate-kwargs`: the same logits processors for plain generate and the drafts, still identical (and
    dict outputs with scores read as their sequences)."""
    save_target_and_draft(tmp_path)
    common = ["--target", str(tmp_path / "target"), "--drafts", str(tmp_path / "draft"), "--questions",
              str(write_questions(tmp_path / "q.jsonl")), "--max-new-tokens", "16", "--trees", "3,2,5",
              "--prompt-lookup", "0", "--turns", "1"]
    settings = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "return_dict_in_generate": True,
                "output_scores": True}
    penalized = main(common + ["--generate-kwargs", json.dumps(settings), "--out", str(tmp_path / "penalized")])
    assert penalized["mismatches"] == {} and penalized["table"]["eagle3:draft:d3k2n5"]["overall"]["identical"] is True
    assert penalized["meta"]["generate_kwargs"] == settings
    assert "repetition_penalty=1.5, no_repeat_ngram_size=2" in (tmp_path / "penalized.md").read_text()
    main(common + ["--out", str(tmp_path / "plain")])
    answers = [[json.loads(line)["choices"][0]["turns"] for line in
                (tmp_path / f"{run}_answers" / "generate.jsonl").read_text().splitlines()] for run in ("penalized", "plain")]
    assert answers[0] != answers[1]  # the settings changed plain generate's answers too
