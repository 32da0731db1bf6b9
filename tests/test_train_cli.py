"""confu-train end to end on a tiny target: a time-boxed first piece, then a resumed second one."""

from __future__ import annotations

import json

import torch
from conftest import chat_tokenizer, tiny_target

from transformers_confu import ConFuAssistant
from transformers_confu.hub import model_card
from transformers_confu.train import main


def test_train_in_two_pieces_then_load(tmp_path):
    tokenizer = chat_tokenizer()
    target = tiny_target(vocab_size=len(tokenizer), init=0.5)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    data = tmp_path / "data"
    data.mkdir()
    rows = [dict(question=f"What is {i} + 3?", answer=f"The answer is {i + 3}.") for i in range(24)]
    (data / "gsm8k_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    argv = ["--target", str(tmp_path / "target"), "--output-dir", str(tmp_path / "run"), "--data-dir", str(data),
            "--max-length", "64", "--batch-size", "4", "--draft-vocab-size", "64", "--epochs", "2",
            "--ttt-steps", "2", "--warmup-steps", "1", "--save-dtype", "float16"]
    main(argv + ["--max-minutes", "0"])  # stops (with a checkpoint) after the first step
    first = json.loads((tmp_path / "run" / "final" / "training_record.json").read_text())
    assert first["finished"] is False and first["global_step"] == 1
    main(argv)  # picks up the checkpoint and finishes
    record = json.loads((tmp_path / "run" / "final" / "training_record.json").read_text())
    assert record["finished"] is True and record["global_step"] == record["max_steps"] == 12
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
