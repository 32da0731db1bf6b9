"""Model cards for published drafts, generated from the training record and benchmark results."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .contemplate import ADAPTER_FOLDER

SUFFIX_FOLDER = "suffix_corpus"  # a suffix corpus saved beside a draft, which its assistant then uses (hybrid trees)

_DATASETS = {
    "gsm8k_train.jsonl": "openai/gsm8k",
    "gpteacher_codegen_instruct.json": "teknium/GPTeacher-General-Instruct",
    "gpteacher_roleplay_instruct.json": "teknium/GPTeacher-General-Instruct",
    "self_instruct_user_oriented.jsonl": "yizhongw/self_instruct",
}


def describe_con_tokens(nodes: int | None, when_greedy: bool = True) -> str:
    """The `[con]` tokens a verify pass carries (`contemplate_nodes`, `contemplate_when_greedy`), in words."""
    if nodes is None:
        text = "one per tree node"
    else:
        text = "none (the draft runs without its future token)" if nodes == 0 else f"{nodes} (the likeliest path ends)"
    if not when_greedy:
        text += (" when sampling; none in greedy decoding (`contemplate_when_greedy=False`; pass `contemplate_nodes=` "
                 "to `generate` to use them there too)")
    return text


def model_card(draft_dir: str | Path, base_model: str, bench: dict | None = None, hardware: str = "",
               notes: str = "") -> str:
    """A Hub model card (with metadata header) for the draft in `draft_dir`.

    Reads `config.json` and, if present, `training_record.json` (written by `confu-train`); `bench` is the
    JSON summary of a `confu-bench` run.
    """
    draft_dir = Path(draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    record_path = draft_dir / "training_record.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    args = record.get("args", {})
    mode = "ConFu" if config.get("contemplate") else "EAGLE-3"
    sources = [str(source) for source in args.get("data") or []] + list(args.get("files") or []) or list(_DATASETS)
    files = [Path(source).name for source in sources]
    header = ["---", "library_name: transformers-confu", f"base_model: {base_model}", "license: apache-2.0",
              "tags:", "- speculative-decoding", f"- {mode.lower()}"]
    hub_datasets = sorted({_DATASETS[f] for f in files if f in _DATASETS})
    header += (["datasets:"] + [f"- {d}" for d in hub_datasets] if hub_datasets else []) + ["---", ""]
    lines = [
        f"# {mode} draft head for {base_model}", "",
        f"A one-layer {mode} draft head for speculative decoding of `{base_model}` with "
        "[transformers-confu](https://pypi.org/project/transformers-confu/). Generation stays lossless: greedy "
        "output is token-identical to plain `generate`, sampling keeps the target's distribution.", "",
        "```python", "from transformers_confu import ConFuAssistant, load_target",
        "model, tokenizer = load_target()  # or AutoModelForCausalLM.from_pretrained(...)",
        f"assistant = ConFuAssistant.from_pretrained(\"{draft_dir.name}\", target_model=model)",
        "out = model.generate(**inputs, assistant_model=assistant, max_new_tokens=256)", "```", "",
        "## Architecture", "",
        f"- target: {config['target_architecture']} ({config['target_model_type']}), hidden {config['hidden_size']}, "
        f"{config['target_num_layers']} layers, vocabulary {config['vocab_size']}",
        f"- features from target layers {config['feature_layers']}; draft vocabulary {config['draft_vocab_size']}",
        f"- default tree: depth {config['tree_depth']}, top-k {config['tree_top_k']}, "
        f"{config['tree_total_tokens']} nodes", "",
    ]
    adapter_config = draft_dir / ADAPTER_FOLDER / "config.json"
    if config.get("contemplate") and adapter_config.is_file():
        adapter = json.loads(adapter_config.read_text())
        entry = config.get("future_entry", True)
        lines[-1:-1] = [
            f"- ConFu future token `[f]`: MoE embedding of {config['future_experts']} experts, top-"
            f"{config['future_top_k']}" if entry else
            "- no `[f]` entry: f reaches the draft only as the prior below (the draft itself is an EAGLE-3 draft)",
            f"- target-side adapter (`contemplate_adapter/`, the target itself is unchanged): "
            f"{adapter['num_soft_tokens']} soft-prompt tokens seen only by `[con]` tokens, `[con]` MoE embedding "
            f"of {adapter['num_experts']} experts, top-{adapter['top_k']}",
            "- `[con]` tokens per verify pass: " + describe_con_tokens(config.get("contemplate_nodes"),
                                                                       config.get("contemplate_when_greedy", True)),
            f"- the `[con]`'s own prediction mixed into the first drafted level with weight "
            f"{config.get('future_logit_weight', 0.0)} (0: off)",
        ]
    if record:
        logs = record.get("last_logs") or [{}]
        lines += ["## Training", "",
                  f"- data: {' '.join(brace_numbered(sources))} (chat-formatted, loss on "
                  "assistant tokens), "
                  f"{args.get('max_samples') or 'all'} conversations, max length {args.get('max_length')}",
                  f"- TTT steps {args.get('ttt_steps')}, lr {args.get('lr')}, batch {args.get('batch_size')}, "
                  f"steps {record.get('global_step')} of {record.get('max_steps')}, "
                  f"{record.get('metrics', {}).get('train_runtime', '?')} s of training in the last run "
                  "(a resumed run counts from its resume)",
                  f"- hardware: {hardware or 'CPU'}",
                  *([f"- the draft vocabulary covers {100 * record['vocab_coverage']:.2f}% of the training answers' "
                     "tokens"] if record.get("vocab_coverage") else []),
                  "- final TTT accuracies: " + ", ".join(f"{k} {v}" for k, v in logs[-1].items() if "acc" in k),
                  f"- command: `confu-train {' '.join(_cli(args))}`", ""]
    if bench:
        meta = bench["meta"]
        lines += ["## Measured", "", f"{meta['questions']} questions of `{Path(meta['question_file']).name}`, "
                  f"{meta['max_new_tokens']} new tokens, temperature {meta['temperature']}, {meta['hardware']}.", "",
                  "| method | tau | tokens/s | speed-up | identical to generate |", "|---|---|---|---|---|"]
        for name, cells in bench["table"].items():
            c = cells["overall"]
            tau = "n/a" if c["tau"] is None else f"{c['tau']:.2f}"
            lines.append(f"| {name} | {tau} | {c['tokens_per_s']:.2f} | {c['speedup']:.2f}x | "
                         f"{c.get('identical', 'n/a')} |")
        lines += ["", f"Command: `{meta['command']}`", ""]
    lines += suffix_corpus_section(draft_dir)
    lines += ["## Limits", "", "- greedy and temperature/top-k/top-p/min-p sampling; batches of left-padded prompts",
              "- trained for this target only (loading it for another target raises an error)", ""]
    if notes:
        lines += ["## Notes", "", notes, ""]
    return "\n".join(header + lines)


def suffix_corpus_section(draft_dir: str | Path) -> list[str]:
    """The card's lines on the suffix corpus saved beside the draft (`suffix_corpus/`), if there is one."""
    path = Path(draft_dir) / SUFFIX_FOLDER / "config.json"
    if not path.is_file():
        return []
    corpus, size = json.loads(path.read_text()), sum(f.stat().st_size for f in path.parent.iterdir())
    hybrid = corpus.get("hybrid", {})
    lines = ["## Suffix corpus (hybrid trees)", "",
             f"`{SUFFIX_FOLDER}/`: a suffix array over {corpus['documents']:,} of the target's own answers "
             f"({corpus['tokens']:,} tokens, {size / 1e6:.1f} MB, memory-mapped), tokenizer fingerprint "
             f"`{corpus['tokenizer_fingerprint']}`. Its continuations of the context join the draft's tree under one "
             "node budget (`suffix=False` in `from_pretrained` or `generate` drafts alone)."]
    if hybrid:
        draft = f", the draft at top-k {hybrid['top_k']}" if "top_k" in hybrid else ""
        if "sampling_top_k" in hybrid:
            draft += f" ({hybrid['sampling_top_k']} when sampling)"
        lines.append(f"Default hybrid tree: {hybrid['total_tokens']} nodes, up to {hybrid['suffix_nodes']} of them "
                     f"suffix candidates{draft} "
                     f"({hybrid.get('chosen_by', 'saved with the corpus')}).")
    return lines + [""]


def _cli(args: dict) -> list[str]:
    out = []
    for key, value in args.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            value = " ".join(brace_numbered(list(map(str, value))) if key == "data" else map(str, value))
        out += [flag] if value is True else [flag, str(value)]
    return out


def brace_numbered(paths: list[str]) -> list[str]:
    """Paths with each stretch of numbered files in one pattern and ascending order written as a bash brace
    expression that the shell expands back into the same files in the same order:
    `d/train-00000.parquet` ... `d/train-00019.parquet`, `d/train-00021.parquet` become
    `d/train-{{00000..00019},00021}.parquet`."""
    stretches: list[tuple[tuple[str, int, str] | None, list]] = []
    for path in paths:
        match = re.fullmatch(r"(.*?)(\d+)(\.[^/]*)", path)
        key = (match[1], len(match[2]), match[3]) if match else None
        if key and stretches and stretches[-1][0] == key and int(match[2]) > stretches[-1][1][-1]:
            stretches[-1][1].append(int(match[2]))
        else:
            stretches.append((key, [int(match[2])] if key else [path]))
    out = []
    for key, items in stretches:
        if key is None:
            out += items
            continue
        prefix, width, suffix = key
        runs: list[list[int]] = []
        for n in items:
            if runs and n == runs[-1][1] + 1:
                runs[-1][1] = n
            else:
                runs.append([n, n])
        parts = [f"{a:0{width}d}" if a == b else f"{{{a:0{width}d}..{b:0{width}d}}}" for a, b in runs]
        out.append(prefix + (parts[0] if len(parts) == 1 else "{" + ",".join(parts) + "}") + suffix)
    return out
