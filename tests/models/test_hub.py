"""Checkpoints: Hub ids through the local cache (offline), remote code, corrupt and foreign checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import tiny_target

from transformers_confu import ConFuAssistant, ConFuDraftConfig


@pytest.fixture
def saved(tmp_path):
    target = tiny_target()
    assistant = ConFuAssistant.from_config(ConFuDraftConfig.for_target(target, draft_vocab_size=64), target,
                                          draft_dtype="float32")
    assistant.save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    return tmp_path, assistant


def fake_hub_cache(root, repo_id: str, folder, commit: str = "a" * 40):
    """Lay out `folder` as huggingface_hub's cache would after a download of `repo_id`."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_hub_id_loads_offline_from_the_cache(saved):
    tmp_path, _ = saved
    cache = fake_hub_cache(tmp_path / "hub", "someone/tiny-confu-draft", tmp_path / "draft")
    result = run_python(f"""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers_confu import ConFuAssistant
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
        a = ConFuAssistant.from_pretrained("someone/tiny-confu-draft", target_model=target)
        b = ConFuAssistant.from_pretrained("someone/tiny-confu-draft", target_model=target, revision={"a" * 40!r},
                                           cache_dir={str(cache)!r})
        print("LOADED", a.draft.config.draft_vocab_size, torch.equal(a.draft.fc.weight, b.draft.fc.weight))
    """, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    assert "LOADED 64 True" in result.stdout, result.stderr[-2000:]


def test_confu_hub_id_loads_draft_and_adapter_offline(tmp_path):
    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True)
    ConFuAssistant.from_config(config, target).save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    cache = fake_hub_cache(tmp_path / "hub", "someone/tiny-confu", tmp_path / "draft")
    result = run_python(f"""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers_confu import ConFuAssistant
        from transformers_confu.models.contemplate import ContemplateAdapter
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
        a = ConFuAssistant.from_pretrained("someone/tiny-confu", target_model=target)
        local = ContemplateAdapter.from_pretrained({str(tmp_path / "draft" / "contemplate_adapter")!r})
        ids = torch.tensor([[5, 9, 2]])
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        out = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=a)
        print("LOADED", torch.equal(a.adapter.soft_prompt, local.soft_prompt), torch.equal(out, ref))
    """, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    assert "LOADED True True" in result.stdout, result.stderr[-2000:]


def test_checkpoint_loads_with_remote_code_without_the_package(saved):
    tmp_path, assistant = saved
    result = run_python(f"""
        import sys
        sys.modules["transformers_confu"] = None  # the package is not installed
        from transformers import AutoModel
        draft = AutoModel.from_pretrained({str(tmp_path / "draft")!r}, trust_remote_code=True)
        print("LOADED", type(draft).__name__, float(draft.fc.weight.sum()))
    """, HF_HUB_OFFLINE="1")
    assert f"LOADED ConFuDraftModel {float(assistant.draft.fc.weight.sum())}" in result.stdout, result.stderr[-2000:]


def test_truncated_checkpoint_raises_a_clear_error(saved):
    tmp_path, _ = saved
    weights = tmp_path / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(OSError, match="corrupt or incomplete"):
        ConFuAssistant.from_pretrained(tmp_path / "draft", target_model=tiny_target())


def test_truncated_checkpoint_error_names_the_torn_file(saved):
    tmp_path, _ = saved
    weights = tmp_path / "draft" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    with pytest.raises(OSError, match=r"'.*draft' is corrupt or incomplete: model.safetensors is cut short \(\d+ of"):
        ConFuAssistant.from_pretrained(tmp_path / "draft", target_model=tiny_target())


def test_confu_folder_without_its_adapter_raises(tmp_path):
    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True)
    ConFuAssistant.from_config(config, target).save_pretrained(tmp_path / "draft")
    (tmp_path / "draft" / "contemplate_adapter" / "model.safetensors").unlink()
    with pytest.raises(OSError, match="corrupt or incomplete: contemplate_adapter/model.safetensors is missing"):
        ConFuAssistant.from_pretrained(tmp_path / "draft", target_model=target)


@pytest.mark.parametrize("typo", ["runs/my-draf/final", "./my-draft", "/tmp/no/such/draft"])
def test_typo_in_a_local_path_says_it_is_neither_folder_nor_hub_id(typo):
    with pytest.raises(FileNotFoundError, match="no draft folder .*not a Hub id .* check the path") as info:
        ConFuAssistant.from_pretrained(typo, target_model=tiny_target())
    assert "Repo id must" not in str(info.value)


def test_hub_shaped_name_that_is_not_a_folder_says_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError, match=r"'someone/draft': it is not a local folder \(no .*someone/draft\), and as a Hub id"):
        ConFuAssistant.from_pretrained("someone/draft", target_model=tiny_target(), local_files_only=True,
                                       cache_dir=str(tmp_path / "hub"))


def test_file_instead_of_folder_raises(saved):
    tmp_path, _ = saved
    with pytest.raises(OSError, match="is a file: pass the draft's folder"):
        ConFuAssistant.from_pretrained(tmp_path / "draft" / "model.safetensors", target_model=tiny_target())


def test_checkpoint_missing_weights_raises(saved):
    from safetensors.torch import load_file, save_file

    tmp_path, _ = saved
    weights = tmp_path / "draft" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["fc.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(OSError, match="lacks weights"):
        ConFuAssistant.from_pretrained(tmp_path / "draft", target_model=tiny_target())


def test_draft_for_another_target_raises(saved):
    tmp_path, _ = saved
    with pytest.raises(ValueError, match="different target"):
        ConFuAssistant.from_pretrained(tmp_path / "draft", target_model=tiny_target(arch="qwen2"))


def test_shipped_draft_remote_code_matches_the_package():
    """The shipped folders carry copies of the modeling code for remote-code loading: they must not drift."""
    from transformers_confu.models.target import CHECKPOINTS

    models = CHECKPOINTS.parent / "models"  # the package's own copies
    folders = [f for f in CHECKPOINTS.iterdir() if "auto_map" in json.loads((f / "config.json").read_text())]
    assert folders
    for folder in folders:
        for name in ("configuration_confu.py", "modeling_confu.py"):
            assert (folder / name).read_text() == (models / name).read_text(), (folder.name, name)


def test_model_card_describes_the_suffix_corpus_beside_a_draft(tmp_path):
    from transformers_confu.models.hub import SUFFIX_FOLDER, suffix_corpus_section
    from transformers_confu.models.target import CHECKPOINTS, CONFU_DRAFT

    assert suffix_corpus_section(CHECKPOINTS / "smollm2-135m-instruct-eagle3") == []  # no corpus beside it
    section = "\n".join(suffix_corpus_section(CONFU_DRAFT))
    corpus = json.loads((CONFU_DRAFT / SUFFIX_FOLDER / "config.json").read_text())
    assert f"{corpus['documents']:,} of the target's own answers" in section
    assert f"{corpus['hybrid']['total_tokens']} nodes, up to {corpus['hybrid']['suffix_nodes']} of them" in section
    assert section in (CONFU_DRAFT / "README.md").read_text()  # the shipped card is up to date


def test_model_card_header_lists_hub_datasets_only_when_there_are_some(saved):
    """A draft trained on local data (e.g. the answers dataset folder) gets no empty `datasets:` key; one trained
    on a known Hub dataset's file lists it."""
    import yaml

    from transformers_confu.models.hub import model_card

    tmp_path, _ = saved
    headers = {}
    for data in (["data/smollm2-135m-instruct-answers"], ["../shared/data/train/gsm8k_train.jsonl"]):
        (tmp_path / "draft" / "training_record.json").write_text(json.dumps({"args": {"data": data}}))
        headers[data[0]] = yaml.safe_load(model_card(tmp_path / "draft", "tiny").split("---")[1])
    assert "datasets" not in headers["data/smollm2-135m-instruct-answers"]
    assert headers["../shared/data/train/gsm8k_train.jsonl"]["datasets"] == ["openai/gsm8k"]


def test_model_card_writes_numbered_shards_as_a_brace_expression_the_shell_expands_back(saved):
    """A draft trained on shards 0-19 and 21-26 (shard 20 held out) gets one short `--data` word that expands back
    into the same files in the same order (a file given again out of order stays where it was)."""
    from transformers_confu.models.hub import model_card

    tmp_path, _ = saved
    shards = [f"data/answers/data/train-{i:05d}.parquet" for i in range(27) if i != 20]
    other = ["runs/self_prompts.jsonl", "runs/self_prompts_s1.jsonl", "data/answers/data/train-00002.parquet"]
    record = {"args": {"data": other[:1] + shards + other[1:], "seed": 3}, "global_step": 1}
    (tmp_path / "draft" / "training_record.json").write_text(json.dumps(record))
    card = model_card(tmp_path / "draft", "tiny")
    brace = "data/answers/data/train-{{00000..00019},{00021..00026}}.parquet"
    assert f"- data: runs/self_prompts.jsonl {brace} {' '.join(other[1:])} (" in card
    command = next(line for line in card.splitlines() if line.startswith("- command: `"))[len("- command: `"):-1]
    assert f"--data runs/self_prompts.jsonl {brace} {' '.join(other[1:])} --seed 3" in command
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {command}"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert words[:2] == ["confu-train", "--data"]
    assert words[2:words.index("--seed")] == record["args"]["data"]
