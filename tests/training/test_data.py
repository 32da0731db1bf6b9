import json
import logging
from pathlib import Path

import datasets
import pandas as pd
import pytest
import torch
from conftest import chat_tokenizer, tiny_target
from transformers import LlamaConfig, LlamaForCausalLM

from transformers_confu.training.data import (
    DataCollatorForDraft,
    build_draft_vocab,
    remap_draft_vocab,
    tokenize_conversations,
)
from transformers_confu.training.data_sources import find_sources, load_conversations
from transformers_confu.training.regenerate import regenerate_responses

REAL_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "train"


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def _write_fixtures(d: Path) -> None:
    gsm = [
        json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}),
        "{not json",
        json.dumps({"question": "", "answer": "x"}),
        json.dumps({"question": "Q2", "answer": "A2"}),
    ]
    (d / "gsm8k_train.jsonl").write_text("\n".join(gsm) + "\n")
    codegen = [
        {"instruction": "Write add.", "input": "a, b", "response": "def add(a, b): return a + b"},
        {"instruction": "Say hi.", "input": "", "response": "print('hi')"},
        {"instruction": "Broken", "input": "", "response": 3},
    ]
    (d / "gpteacher_codegen_instruct.json").write_text(json.dumps(codegen))
    roleplay = [{"instruction": "Be a pirate.", "input": "", "response": "Arr!"}]
    (d / "gpteacher_roleplay_instruct.json").write_text(json.dumps(roleplay))
    self_instruct = [
        {"id": "t0", "instruction": "Fix it.", "instances": [{"input": "teh cat", "output": "the cat"}]},
        {"id": "t1", "instruction": "Greet.", "instances": [{"input": "", "output": "Hello!"}]},
        {"id": "t2", "instruction": "No instances.", "instances": []},
        "not an object",
    ]
    (d / "self_instruct_user_oriented.jsonl").write_text("\n".join(map(json.dumps, self_instruct)) + "\n")
    ultra = [{"class": " Vicuna ", "data": "Tell me a story."}, {"class": " Writing ", "data": None}]
    (d / "ultrachat_ultra_eval.json").write_text(json.dumps(ultra))


@pytest.fixture
def data_dir(tmp_path):
    _write_fixtures(tmp_path)
    return tmp_path


def _by_source(ds):
    out = {}
    for row in ds:
        out.setdefault(row["source"], []).append(row["messages"])
    return out


def test_load_conversations_converts_each_format(data_dir):
    convs = _by_source(load_conversations(find_sources(data_dir=data_dir)))
    assert convs["gsm8k_train.jsonl"] == [
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5\n#### 5"}],
        [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}],
    ]
    assert convs["gpteacher_codegen_instruct.json"][0] == [
        {"role": "user", "content": "Write add.\n\na, b"},
        {"role": "assistant", "content": "def add(a, b): return a + b"},
    ]
    assert convs["gpteacher_codegen_instruct.json"][1][0]["content"] == "Say hi."
    assert convs["gpteacher_roleplay_instruct.json"] == [
        [{"role": "user", "content": "Be a pirate."}, {"role": "assistant", "content": "Arr!"}]
    ]
    assert convs["self_instruct_user_oriented.jsonl"][0] == [
        {"role": "user", "content": "Fix it.\n\nteh cat"},
        {"role": "assistant", "content": "the cat"},
    ]
    assert convs["ultrachat_ultra_eval.json"] == [[{"role": "user", "content": "Tell me a story."}]]


def test_malformed_rows_are_reported_and_skipped(data_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="transformers_confu.training.data_sources"):
        ds = load_conversations(find_sources(data_dir=data_dir))
    text = caplog.text
    assert len(ds) == 2 + 2 + 1 + 2 + 1
    for where in [
        "gsm8k_train.jsonl line 2",
        "gsm8k_train.jsonl line 3",
        "gpteacher_codegen_instruct.json row 2",
        "self_instruct_user_oriented.jsonl line 3",
        "self_instruct_user_oriented.jsonl line 4",
        "ultrachat_ultra_eval.json row 1",
    ]:
        assert where in text
    assert "gsm8k_train.jsonl: 2 conversations loaded, 2 malformed rows skipped" in text


def test_malformed_rows_raise_and_unreadable_files_are_named(data_dir):
    with pytest.raises(ValueError, match="gsm8k_train.jsonl line 2: invalid JSON"):
        load_conversations(find_sources(data_dir=data_dir, files=["gsm8k_train.jsonl"]), on_error="raise")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        find_sources(data_dir=data_dir, files=["nope.jsonl"])
    (data_dir / "gpteacher_codegen_instruct.json").write_text(json.dumps(["x"])[:-1])
    with pytest.raises(ValueError, match="Could not read the file 'gpteacher_codegen_instruct.json'"):
        load_conversations([str(data_dir / "gpteacher_codegen_instruct.json")])
    (data_dir / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="unsupported file type '.txt'"):
        load_conversations([str(data_dir / "notes.txt")])


def test_no_data_says_how_to_pass_some(tmp_path):
    with pytest.raises(ValueError, match="--data FILE_OR_HUB_ID"):
        find_sources()
    with pytest.raises(ValueError, match="--data FILE_OR_HUB_ID"):
        load_conversations([])
    with pytest.raises(FileNotFoundError, match="No .jsonl/.json/.parquet file"):
        find_sources(data_dir=tmp_path)
    with pytest.raises(ValueError, match="pass --data-dir too"):
        find_sources(files=["a.jsonl"])


CHAT_LAYOUTS = {
    "messages": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello."}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."},
                                   {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye."}]},
    "alpaca": {"instruction": "Add.", "input": "1, 2", "output": "3"},
    "qa": {"question": "2+2?", "answer": "4"},
    "ultrachat": {"data": ["Hi", "Hello.", "Bye", "Bye."]},
}
EXPECTED = {
    "messages": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}]],
    "sharegpt": [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]],
    "alpaca": [[{"role": "user", "content": "Add.\n\n1, 2"}, {"role": "assistant", "content": "3"}]],
    "qa": [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]],
}
EXPECTED["ultrachat"] = EXPECTED["sharegpt"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_common_chat_layouts_from_every_file_type(tmp_path, suffix, caplog):
    rows = list(CHAT_LAYOUTS.values()) + [
        {"conversations": [{"from": "gpt", "value": "I speak first"}]},
        {"messages": [{"role": "wizard", "content": "?"}]},
        {"text": "no chat layout"},
    ]
    path = tmp_path / f"mixed{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        pd.DataFrame(rows).to_parquet(path)  # one column per field, null where a row lacks it
    with pytest.raises(ValueError, match="row 5|line 6"):
        load_conversations([str(path)], on_error="raise")
    with caplog.at_level(logging.WARNING, logger="transformers_confu.training.data_sources"):
        ds = load_conversations([str(path)])
    assert "must start (after any system turn) with a user turn" in caplog.text
    assert "unknown role 'wizard'" in caplog.text and "no chat layout recognised" in caplog.text
    assert f"{path.name}: 5 conversations loaded, 3 malformed rows skipped" in caplog.text
    assert ds["messages"] == [m for name in CHAT_LAYOUTS for m in EXPECTED[name]]
    assert set(ds["source"]) == {path.name}


def test_hub_ids_go_through_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, split, **kwargs):
        calls.append((path, split, kwargs))
        return datasets.Dataset.from_list([CHAT_LAYOUTS["messages"]])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_conversations(["someone/chats", "someone/other:train_sft"])
    assert calls == [("someone/chats", "train", {}), ("someone/other", "train_sft", {})]
    assert ds["source"] == ["someone/chats", "someone/other:train_sft"]
    assert ds["messages"] == EXPECTED["messages"] * 2


def test_sources_from_folders_globs_and_files(data_dir):
    everything = find_sources(data_dir=data_dir)
    assert [Path(s).name for s in everything] == sorted(p.name for p in data_dir.iterdir())
    assert find_sources([str(data_dir)]) == everything
    assert find_sources([str(data_dir / "*.jsonl")]) == [s for s in everything if s.endswith(".jsonl")]
    with pytest.raises(FileNotFoundError, match="No file matches"):
        find_sources([str(data_dir / "*.csv")])


def _dataset(convs):
    return datasets.Dataset.from_list([{"messages": m, "source": "test"} for m in convs])


MULTI_TURN = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "Hello there!"},
    {"role": "assistant", "content": " I am fine,\nthank you."},
]


def test_loss_mask_covers_exactly_assistant_content(tokenizer, caplog):
    ds = _dataset([MULTI_TURN, [{"role": "user", "content": "Only a prompt"}]])
    with caplog.at_level(logging.INFO, logger="transformers_confu.training.data"):
        out = tokenize_conversations(ds, tokenizer)
    assert "dropped 1 without an assistant turn" in caplog.text
    assert len(out) == 1 and out.column_names == ["input_ids", "loss_mask"]
    ids, mask = out[0]["input_ids"], out[0]["loss_mask"]
    assert ids == tokenizer.apply_chat_template(MULTI_TURN, tokenize=True, return_dict=True)["input_ids"]
    # masked tokens form two runs, one per assistant turn: content + <|im_end|>
    runs, cur = [], []
    for tok, m in zip(ids, mask):
        if m:
            cur.append(tok)
        elif cur:
            runs, cur = runs + [cur], []
    assert [tokenizer.decode(r) for r in runs] == ["The answer is 5.<|im_end|>", " I am fine,\nthank you.<|im_end|>"]


def test_truncation(tokenizer, caplog):
    ds = _dataset([MULTI_TURN])
    full = tokenize_conversations(ds, tokenizer)[0]
    first_end = full["loss_mask"].index(1) + 2
    out = tokenize_conversations(ds, tokenizer, max_length=first_end)[0]
    assert out["input_ids"] == full["input_ids"][:first_end]
    assert out["loss_mask"] == full["loss_mask"][:first_end]
    with caplog.at_level(logging.INFO, logger="transformers_confu.training.data"):
        assert len(tokenize_conversations(ds, tokenizer, max_length=5)) == 0
    assert "1 with no assistant token left after truncation to 5 tokens" in caplog.text


def test_build_draft_vocab():
    ds = datasets.Dataset.from_list(
        [
            {"input_ids": [9, 9, 9, 7, 7, 3, 3, 1], "loss_mask": [1, 1, 1, 1, 1, 1, 1, 0]},
            {"input_ids": [1, 1, 1, 1, 5, 3, 8], "loss_mask": [0, 0, 0, 0, 1, 0, 1]},
        ]
    )
    # counts among masked tokens: 9->3, 7->2, 3->2, 5->1, 8->1 (1 is never masked)
    assert build_draft_vocab(ds, 3, 10).tolist() == [3, 7, 9]
    top4 = build_draft_vocab(ds, 4, 10)
    assert top4.dtype == torch.long and top4.tolist() == [3, 5, 7, 9]  # tie 5 vs 8 broken by id
    assert build_draft_vocab(ds, 6, 10).tolist() == [1, 3, 5, 7, 8, 9]  # then prompt tokens (1 occurs 5 times)
    assert build_draft_vocab(ds, 7, 10).tolist() == [0, 1, 3, 5, 7, 8, 9]  # then the lowest unused ids
    filtered = ds.filter(lambda r: r["input_ids"][0] == 1)  # indices mapping must be respected
    assert build_draft_vocab(filtered, 2, 10).tolist() == [5, 8]
    with pytest.raises(ValueError):
        build_draft_vocab(ds, 11, 10)


def test_remap_draft_vocab_keeps_trained_rows_and_maps_new_ones():
    """Kept tokens keep their head rows (moved to their new draft ids, so their logits are unchanged); a new
    token's row comes from the target's row through the linear map the kept rows follow."""
    from transformers_confu.models.configuration_confu import ConFuDraftConfig
    from transformers_confu.models.modeling_confu import ConFuDraftModel

    target = tiny_target(vocab_size=128)
    draft = ConFuDraftModel(ConFuDraftConfig.for_target(target, draft_vocab_size=64))
    draft.set_vocab_map(torch.arange(1, 128, 2))
    rows = target.get_output_embeddings().weight.detach()
    mapping = torch.randn(rows.shape[1], rows.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        draft.lm_head.weight.copy_(rows[draft.d2t] @ mapping)
    hidden = torch.randn(3, rows.shape[1])
    before = dict(zip(draft.d2t.tolist(), draft.logits(hidden).T))
    new_vocab = torch.tensor(sorted(range(0, 32, 2)) + list(range(33, 128, 2)))  # 16 new tokens, 48 kept
    assert remap_draft_vocab(draft, new_vocab, target, ridge=1e-6) == 16
    assert draft.d2t.tolist() == new_vocab.tolist() and draft.t2d.sum() == 64
    after = dict(zip(draft.d2t.tolist(), draft.logits(hidden).T))
    for token in range(33, 128, 2):
        assert torch.equal(after[token], before[token])
    position = {token: i for i, token in enumerate(draft.d2t.tolist())}
    new = list(range(0, 32, 2))
    assert torch.allclose(draft.lm_head.weight[[position[t] for t in new]], rows[new] @ mapping, atol=1e-3)
    # a larger vocabulary widens the head: every token keeps its row, the 16 added ones are mapped
    wider = torch.cat([draft.d2t, torch.arange(1, 33, 2)]).sort().values
    kept_rows = dict(zip(draft.d2t.tolist(), draft.lm_head.weight.detach().clone()))
    assert remap_draft_vocab(draft, wider, target, ridge=1e-6) == 16
    assert draft.config.draft_vocab_size == 80 and draft.lm_head.weight.shape == (80, rows.shape[1])
    assert draft.d2t.tolist() == wider.tolist() and draft.t2d.sum() == 80 and draft.logits(hidden).shape == (3, 80)
    position = {token: i for i, token in enumerate(draft.d2t.tolist())}
    for token, row in kept_rows.items():
        assert torch.equal(draft.lm_head.weight[position[token]], row)
    assert torch.allclose(draft.lm_head.weight[[position[t] for t in range(1, 33, 2)]], rows[1:33:2] @ mapping,
                          atol=1e-3)
    with pytest.raises(ValueError, match="distinct target ids"):
        remap_draft_vocab(draft, torch.tensor([3, 3, 5]), target)


def test_collator_right_pads():
    batch = DataCollatorForDraft(pad_token_id=0)(
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_collator_pads_to_a_multiple():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 1, 1, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    batch = DataCollatorForDraft(pad_token_id=0, pad_to_multiple_of=4)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [8] + [0] * 7]
    assert batch["attention_mask"].sum(1).tolist() == [5, 1] and batch["loss_mask"].sum().item() == 5
    assert DataCollatorForDraft(0, pad_to_multiple_of=5)(rows)["input_ids"].shape == (2, 5)
    with pytest.raises(ValueError, match="pad_to_multiple_of must be >= 1"):
        DataCollatorForDraft(0, pad_to_multiple_of=0)


def _tiny_chat_model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    return LlamaForCausalLM(config).eval()


REGEN_CONVS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "Old answer."}],
    [{"role": "user", "content": "Tell me a story."}],
    MULTI_TURN,
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}],
    [{"role": "user", "content": "Write add."}],
]


def test_regenerate_responses_resumes_and_matches_one_run(tokenizer, tmp_path, monkeypatch):
    from transformers_confu.training import regenerate

    model = _tiny_chat_model(tokenizer)
    calls = []
    stream = regenerate.stream_answers

    def counting_stream(model, prompts, *args, **kwargs):
        answers = list(stream(model, prompts, *args, **kwargs))
        calls.append(len(answers))
        return iter(answers)

    monkeypatch.setattr(regenerate, "stream_answers", counting_stream)
    ds = _dataset(REGEN_CONVS)
    first = regenerate_responses(ds, model, tokenizer, tmp_path / "a", batch_size=2, max_new_tokens=3, max_minutes=0)
    assert len(first) == 0 and calls == [0]  # time box of 0: nothing answered, nothing lost
    kept = regenerate_responses(ds, model, tokenizer, tmp_path / "a", max_new_tokens=3, max_minutes=0,
                                keep_unanswered=True)
    assert [row["messages"] for row in kept] == [c for c in REGEN_CONVS if c[-1]["role"] == "assistant"]
    first = regenerate_responses(ds.select(range(3)), model, tokenizer, tmp_path / "a", batch_size=2, max_new_tokens=3)
    assert len(first) == 3 and sum(calls) == 3
    calls.clear()
    full = regenerate_responses(ds, model, tokenizer, tmp_path / "a", batch_size=2, max_new_tokens=3)
    assert sum(calls) == 2 and len(full) == 5  # only the two new prompts were answered
    for row, conv in zip(full, REGEN_CONVS):
        prompt = conv[:-1] if conv[-1]["role"] == "assistant" else conv
        assert row["messages"][:-1] == prompt and row["messages"][-1]["role"] == "assistant"
    assert full[0]["messages"][-1]["content"] != "Old answer."
    stats = json.loads((tmp_path / "a" / "stats.json").read_text())
    assert stats["rows"] == 5 and stats["new_tokens"] > 0 and stats["tokens_per_second"] > 0
    calls.clear()
    regenerate_responses(ds, model, tokenizer, tmp_path / "a", batch_size=2, max_new_tokens=3)
    assert calls == [0]
    monkeypatch.undo()
    # One uninterrupted run gives the same records.
    once = regenerate_responses(ds, model, tokenizer, tmp_path / "b", batch_size=2, max_new_tokens=3)
    assert once.to_list() == full.to_list()


def test_regenerate_refuses_other_settings_and_skips_torn_lines(tokenizer, tmp_path):
    model = _tiny_chat_model(tokenizer)
    ds = _dataset(REGEN_CONVS)
    full = regenerate_responses(ds, model, tokenizer, tmp_path, batch_size=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        regenerate_responses(ds, model, tokenizer, tmp_path, batch_size=2, max_new_tokens=4)
    same = regenerate_responses(ds, model, tokenizer, tmp_path, batch_size=2, max_new_tokens=3, seed=5)
    assert same.to_list() == full.to_list()  # greedy answers do not depend on the seed: the same directory serves
    other = _tiny_chat_model(tokenizer)
    with torch.no_grad():
        other.get_input_embeddings().weight.add_(1.0)
    with pytest.raises(ValueError, match="other settings.*target"):
        regenerate_responses(ds, other, tokenizer, tmp_path, batch_size=2, max_new_tokens=3)
    path = tmp_path / "responses.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # a write cut by a kill
    again = regenerate_responses(ds, model, tokenizer, tmp_path, batch_size=2, max_new_tokens=3)
    assert again.to_list() == full.to_list()


def test_responses_with_unicode_line_separators_are_read(tmp_path):
    from transformers_confu.training.regenerate import read_responses

    path = tmp_path / "responses.jsonl"
    records = [{"key": "a", "response": "one\u2028two\x85three"}, {"key": "b", "response": "plain"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert read_responses(path) == {r["key"]: r for r in records}


def test_real_training_files_load():
    if not REAL_DATA.exists():
        pytest.skip(f"{REAL_DATA} not found")
    ds = load_conversations(find_sources(data_dir=REAL_DATA), on_error="raise")
    counts = {}
    for source in ds["source"]:
        counts[source] = counts.get(source, 0) + 1
    assert counts == {
        "gsm8k_train.jsonl": 7473,
        "gpteacher_codegen_instruct.json": 4535,
        "gpteacher_roleplay_instruct.json": 1923,
        "self_instruct_user_oriented.jsonl": 252,
        "ultrachat_ultra_eval.json": 385,
    }


def test_static_cache_regeneration_gives_the_growing_cache_answers(tokenizer):
    """The static-cache path (the default on CUDA: compiled there, shapes bucketed by wider left padding)
    answers as the growing cache does."""
    from transformers_confu.training.regenerate import RegenerationSettings, generate_answers

    model = _tiny_chat_model(tokenizer)
    prompts = [tokenizer.apply_chat_template(conv[:1], add_generation_prompt=True) for conv in REGEN_CONVS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    settings = RegenerationSettings("tiny", max_new_tokens=6, temperature=0.0, top_p=1.0, seed=0)
    growing = generate_answers(model, tokenizer, prompts, settings, seed=0, static=False)
    static = generate_answers(model, tokenizer, prompts, settings, seed=0, static=True)
    assert static == growing and any(growing[0])


def test_a_dataset_folder_is_read_with_the_shards_appended_since_its_last_read(tmp_path):
    """datasets caches a local folder by its path: a shard appended later would be missed without a rebuild."""
    folder = tmp_path / "answers"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                      "    path: data/train-*.parquet\n---\n")
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    pd.DataFrame([row]).to_parquet(folder / "data" / "train-00000.parquet")
    assert len(load_conversations([str(folder)])) == 1
    pd.DataFrame([row, row]).to_parquet(folder / "data" / "train-00001.parquet")
    assert len(load_conversations([str(folder)])) == 3
