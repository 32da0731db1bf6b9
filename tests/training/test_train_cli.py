"""confu-train end to end on a tiny target: a time-boxed first piece, then a resumed second one."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import chat_tokenizer, tiny_target

from transformers_confu import ConFuAssistant
from transformers_confu.decoding import assistant as assistant_module
from transformers_confu.models.hub import model_card
from transformers_confu.models.target import load_target
from transformers_confu.training.regenerate import target_fingerprint
from transformers_confu.training.train import cpu_bf16_problem, main, parse_args, resolve_target_dtype


def saved_target_and_data(tmp_path, n_rows: int, extra: str = ""):
    """A tiny chat target saved to `tmp_path/target` and `n_rows` GSM8K-style rows in `tmp_path/data`."""
    tokenizer = chat_tokenizer()
    target = tiny_target(vocab_size=len(tokenizer), init=0.5)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    data = tmp_path / "data"
    data.mkdir()
    rows = [dict(question=f"What is {i} + 3?", answer=f"The answer is {i + 3}.") for i in range(n_rows)]
    (data / "gsm8k_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return target, tokenizer, data


def test_train_in_two_pieces_then_load(tmp_path, monkeypatch):
    monkeypatch.setattr(assistant_module, "native_bf16", lambda: False)  # "auto": the target's dtype
    target, tokenizer, data = saved_target_and_data(tmp_path, 24, extra="{not json\n")
    argv = ["--target", str(tmp_path / "target"), "--output-dir", str(tmp_path / "run"), "--data-dir", str(data),
            "--max-length", "64", "--batch-size", "4", "--draft-vocab-size", "64", "--epochs", "2",
            "--ttt-steps", "2", "--warmup-steps", "1", "--save-dtype", "float16"]
    main(argv + ["--max-minutes", "0"])  # stops (with a checkpoint) after the first step
    first = json.loads((tmp_path / "run" / "final" / "training_record.json").read_text())
    assert first["finished"] is False and first["global_step"] == 1
    main(argv)  # picks up the checkpoint and finishes
    record = json.loads((tmp_path / "run" / "final" / "training_record.json").read_text())
    assert record["finished"] is True and record["global_step"] == record["max_steps"] == 12
    assert 0.9 < record["vocab_coverage"] <= 1 and "vocab_coverage" not in record["args"]
    assistant = ConFuAssistant.from_pretrained(tmp_path / "run" / "final", target_model=target)
    assert assistant.draft.lm_head.weight.dtype == torch.float32  # moved to the target's dtype on attach
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                      add_generation_prompt=True, return_dict=True)["input_ids"]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                          pad_token_id=0)
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=assistant), ref)
    card = model_card(tmp_path / "run" / "final", "tiny-llama")
    assert card.startswith("---\nlibrary_name: transformers-confu") and "- openai/gsm8k" in card
    assert "steps 12 of 12" in card and "confu-train --target" in card
    values = [x for v in record["args"].values() for x in (v if isinstance(v, list) else [v])]
    assert {v for v in values if isinstance(v, str) and "/" in v} <= set(argv)  # no path the package made up


def test_confu_training_from_an_eagle3_draft_resumes_and_loads(tmp_path):
    """`--contemplate --init-from <EAGLE-3 draft>`: the adapter is trained and saved beside the draft, an
    interrupted run resumes both, and the result decodes losslessly."""
    from transformers_confu.models.contemplate import ADAPTER_FOLDER

    target, tokenizer, data = saved_target_and_data(tmp_path, 16)
    common = ["--target", str(tmp_path / "target"), "--data", str(data / "gsm8k_train.jsonl"), "--max-length", "64",
              "--batch-size", "4", "--draft-vocab-size", "64", "--ttt-steps", "2", "--warmup-steps", "1"]
    main(common + ["--output-dir", str(tmp_path / "eagle3")])
    argv = common + ["--output-dir", str(tmp_path / "confu"), "--init-from", str(tmp_path / "eagle3" / "final"),
                     "--contemplate", "--soft-tokens", "4", "--con-experts", "4", "--epochs", "2",
                     "--soft-prompt-init-text", "What is", "--route-lag", "2"]
    main(argv + ["--max-minutes", "0"])
    checkpoint = tmp_path / "confu" / "checkpoint-1"
    assert (checkpoint / ADAPTER_FOLDER / "model.safetensors").is_file()
    main(argv)
    record = json.loads((tmp_path / "confu" / "final" / "training_record.json").read_text())
    assert record["finished"] is True and record["global_step"] == 8
    assistant = ConFuAssistant.from_pretrained(tmp_path / "confu" / "final", target_model=target)
    first = ConFuAssistant.from_pretrained(checkpoint, target_model=target)
    assert assistant.draft.config.contemplate and assistant.adapter.num_soft_tokens == 4
    assert not torch.allclose(assistant.adapter.soft_prompt, first.adapter.soft_prompt)  # trained after resuming
    peft_config = assistant.adapter.peft_config  # peft's TEXT init from the target's tokenizer
    assert (peft_config.prompt_tuning_init, peft_config.prompt_tuning_init_text) == ("TEXT", "What is")
    assert peft_config.base_model_name_or_path == peft_config.tokenizer_name_or_path == str(tmp_path / "target")
    with pytest.raises(SystemExit, match="drop one of the two"):
        main(argv[:-2] + ["--output-dir", str(tmp_path / "again"), "--init-from", str(tmp_path / "confu" / "final"),
                          "--soft-prompt-init-text", "What is", "--route-lag", "2"])
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                      add_generation_prompt=True, return_dict=True)["input_ids"]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                          pad_token_id=0)
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=assistant), ref)
    # the adapter alone, continued from the ConFu run onto the EAGLE-3 draft, f as a first-level prior only
    main(common + ["--output-dir", str(tmp_path / "prior"), "--init-from", str(tmp_path / "eagle3" / "final"),
                   "--adapter-from", str(tmp_path / "confu" / "final"), "--contemplate", "--no-future-entry",
                   "--freeze-draft", "--future-token-weight", "1", "--anchor-ratio", "0.5", "--max-steps", "6"])
    assert json.loads((tmp_path / "prior" / "final" / "training_record.json").read_text())["global_step"] == 6
    prior = ConFuAssistant.from_pretrained(tmp_path / "prior" / "final", target_model=target)
    eagle3 = ConFuAssistant.from_pretrained(tmp_path / "eagle3" / "final", target_model=target)
    config = prior.draft.config
    assert config.contemplate and not config.future_entry and config.future_logit_weight == 0.5
    assert all(torch.equal(a, b) for a, b in zip(prior.draft.state_dict().values(), eagle3.draft.state_dict().values()))
    assert not torch.allclose(prior.adapter.soft_prompt, assistant.adapter.soft_prompt)
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=prior), ref)
    card = model_card(tmp_path / "prior" / "final", "tiny-llama")
    assert "no `[f]` entry" in card and "first drafted level with weight 0.5" in card
    assert "no `[f]` entry" not in model_card(tmp_path / "confu" / "final", "tiny-llama")
    with pytest.raises(SystemExit, match="has no contemplate_adapter"):
        main(common + ["--output-dir", str(tmp_path / "bad"), "--init-from", str(tmp_path / "eagle3" / "final"),
                       "--adapter-from", str(tmp_path / "eagle3" / "final"), "--contemplate"])


def test_no_training_data_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--output-dir", "run"])
    assert "no training data given: pass training data: --data FILE_OR_HUB_ID" in capsys.readouterr().err


def test_bf16_on_a_cpu_without_bf16_kernels_is_warned_about(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert "leave --bf16 out" in cpu_bf16_problem("cpu")
    assert cpu_bf16_problem("cuda") is None  # GPUs run bf16 natively
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_bf16_problem("cpu") is None


def test_target_dtype_auto_is_bfloat16_only_on_cuda_with_bf16():
    def dtype(*extra):
        return resolve_target_dtype(parse_args(["--output-dir", "run", "--data", "x.jsonl", *extra]))
    assert dtype() == dtype("--bf16") == dtype("--device", "cuda") == torch.float32
    assert dtype("--device", "cuda", "--bf16") == dtype("--target-dtype", "bfloat16") == torch.bfloat16
    assert dtype("--device", "cuda", "--bf16", "--target-dtype", "float32") == torch.float32


def test_a_bfloat16_target_on_a_cpu_trains_a_float32_draft(tmp_path, monkeypatch, caplog):
    """`--target-dtype bfloat16` without `--bf16`: the target's features come in bfloat16, the draft trains
    in float32 on them, and the result decodes losslessly behind the float32 target."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(assistant_module, "native_bf16", lambda: False)
    target, tokenizer, data = saved_target_and_data(tmp_path, 8)
    main(["--target", str(tmp_path / "target"), "--output-dir", str(tmp_path / "run"), "--data-dir", str(data),
          "--max-length", "64", "--batch-size", "4", "--draft-vocab-size", "64", "--max-steps", "2",
          "--ttt-steps", "2", "--warmup-steps", "1", "--target-dtype", "bfloat16"])
    assert "leave --target-dtype bfloat16 out here" in caplog.text  # no bf16 kernels: said, then done anyway
    record = json.loads((tmp_path / "run" / "final" / "training_record.json").read_text())
    assert record["finished"] is True and record["args"]["target_dtype"] == "bfloat16"
    assert 0 < float(record["metrics"]["train_loss"]) < 100
    assistant = ConFuAssistant.from_pretrained(tmp_path / "run" / "final", target_model=target)
    assert assistant.draft.fc.weight.dtype == torch.float32
    (fp32_target, _), (bf16_target, _) = (load_target(str(tmp_path / "target"), torch_dtype=d)
                                          for d in (torch.float32, torch.bfloat16))
    assert target_fingerprint(fp32_target) == target_fingerprint(target)
    assert target_fingerprint(bf16_target) != target_fingerprint(target)  # its answers are not the fp32 target's
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                      add_generation_prompt=True, return_dict=True)["input_ids"]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                          pad_token_id=0)
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=assistant), ref)


def test_recount_vocab_counts_the_new_data(tmp_path, caplog):
    """`--init-from D --recount-vocab` re-counts D's vocabulary on the new data: its coverage of the new
    answers goes up, and the result still decodes losslessly; without `--init-from` the flag is refused."""
    target, tokenizer, data = saved_target_and_data(tmp_path, 8)
    other = tmp_path / "other"
    other.mkdir()
    rows = [dict(question=f"Name colour {i}.", answer=f"Colour {i} is {c}.") for i, c in
            enumerate(["violet", "yellow", "crimson", "magenta", "turquoise", "brown"] * 2)]
    (other / "gsm8k_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--target", str(tmp_path / "target"), "--max-length", "64", "--batch-size", "4",
              "--draft-vocab-size", "24", "--ttt-steps", "2", "--warmup-steps", "1", "--max-steps", "2"]
    main(common + ["--output-dir", str(tmp_path / "first"), "--data-dir", str(data)])
    with caplog.at_level("INFO", logger="transformers_confu.training.train"):
        main(common + ["--output-dir", str(tmp_path / "second"), "--data-dir", str(other),
                       "--init-from", str(tmp_path / "first" / "final"), "--recount-vocab"])
    before, after = (float(x) for x in re.search(r"coverage of the training answers ([\d.]+)% -> ([\d.]+)%",
                                                 caplog.text).groups())
    record = json.loads((tmp_path / "second" / "final" / "training_record.json").read_text())
    assert before < after == pytest.approx(100 * record["vocab_coverage"], abs=0.01)
    assistant = ConFuAssistant.from_pretrained(tmp_path / "second" / "final", target_model=target)
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "Name colour 3."}],
                                                      add_generation_prompt=True, return_dict=True)["input_ids"]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                          pad_token_id=0)
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=assistant), ref)
    # a larger --draft-vocab-size widens the head: saved, loaded and decoding losslessly at its new size
    main(common[:6] + ["--draft-vocab-size", "40", "--ttt-steps", "2", "--warmup-steps", "1", "--max-steps", "1",
                       "--output-dir", str(tmp_path / "wider"), "--data-dir", str(other),
                       "--init-from", str(tmp_path / "second" / "final"), "--recount-vocab"])
    wider = ConFuAssistant.from_pretrained(tmp_path / "wider" / "final", target_model=target)
    assert wider.draft.config.draft_vocab_size == 40 and wider.draft.lm_head.weight.shape[0] == 40
    assert set(assistant.draft.d2t.tolist()) < set(wider.draft.d2t.tolist())
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=wider), ref)
    with pytest.raises(SystemExit):
        parse_args(["--output-dir", "x", "--data-dir", str(data), "--recount-vocab"])
    with pytest.raises(SystemExit, match="add --recount-vocab to resize it"):
        main(common[:6] + ["--draft-vocab-size", "32", "--output-dir", str(tmp_path / "refused"), "--data-dir",
                           str(other), "--init-from", str(tmp_path / "wider" / "final")])
