"""`confu-bench`: Spec-Bench style comparison of decoding methods on one target, in one run.

Methods are interleaved per question (plain `generate` first, as the reference), so that slow drifts of
the machine hit every method alike. Per method it writes Spec-Bench answer files; per method and category
it reports tau (tokens per target pass), tokens/s, speed-up over plain `generate` (total tokens over total
time, as Spec-Bench computes it) and, at temperature 0, whether every output equals plain `generate`'s
(each mismatch listed with the target's top-2 logit gap where it diverged, to tell a near-tie from a bug).
At temperature > 0, questions with a GSM8K reference (`math_reasoning`, or GSM8K `{question, answer}` rows)
also get the task-quality check of `quality.py`: exact match per method with confidence intervals.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..decoding.assistant import draft_dtype_for
from ..decoding.suffix import SHIPPED_CORPUS
from ..decoding.suffix_assistant import DEFAULT_TOTAL_TOKENS, SuffixAssistant
from ..models.target import DEFAULT_DRAFT, DEFAULT_TARGET, load_target
from ..utils.packed_linear import packed_kernels
from .assistants import budget_name, draft_assistant
from .batch_bench import batch_methods, run_batches
from .quality import quality_check, quality_markdown
from .questions import (
    DEFAULT_QUESTIONS,
    PACKAGED_QUESTIONS,
    chat_input_ids,
    load_questions,
)


@dataclass
class Method:
    """A named way to answer: `run(input_ids, max_new_tokens) -> (output ids, accept lengths or None)`;
    `assistant`: the assistant it runs, whose `stats` are read after each call (accepted tokens by source)."""

    name: str
    run: Callable[[torch.LongTensor, int], tuple[torch.LongTensor, list[int] | None]]
    assistant: object | None = None


AUTO_CANDIDATES = "1,3,4;2,1,3;2,2,4;2,3,6;3,1,4;3,2,5;4,1,5;4,2,6;5,2,8;6,2,10;6,4,16;8,4,30"
WIDTH_TAGS = {"fixed": "", "auto": ":auto-width"}  # method name suffix per --width


def auto_tree(model, tokenizer, path: str, questions: list[dict], candidates: list[tuple[int, ...]],
              max_new_tokens: int, sampling: dict, suffix_corpus: str | None = None) -> tuple[tuple[int, ...], dict]:
    """Pick the tree budget with the most tokens/s for this draft on THIS machine.

    Each candidate answers the first turn of the calibration questions; the measured tokens/s folds in both
    the draft's acceptance at that budget and the machine's verify cost at that width. A candidate
    (depth, top_k, total_tokens) runs the draft alone; (depth, top_k, total_tokens, suffix_nodes) a hybrid
    tree with `suffix_corpus`.
    """
    speeds = {}
    for budget in tqdm(candidates, desc="auto-tree calibration"):
        assistant = draft_assistant(model, path, budget, suffix_corpus)
        tokens = seconds = 0.0
        for question in questions:
            model.generate(chat_input_ids(tokenizer, question["turns"][:1]), max_new_tokens=max_new_tokens,
                           assistant_model=assistant, **sampling)
            tokens += assistant.stats.new_tokens
            seconds += assistant.stats.total_seconds
        speeds[budget_name(budget)] = tokens / seconds
    best = max(candidates, key=lambda b: speeds[budget_name(b)])
    return best, speeds


def build_methods(model, drafts: list[str], trees: list[tuple[int, int, int]], sampling: dict,
                  prompt_lookup: int | None, contemplate_nodes: list[int | str | None] = (None,),
                  assistant_model=None, static_baseline: bool = False, loops: tuple[str, ...] = ("eager",),
                  static: dict | None = None, suffix: tuple[str, ...] = (),
                  suffix_corpus: str | Sequence[str] | None = None,
                  suffix_tokens: tuple[int, ...] = (DEFAULT_TOTAL_TOKENS,), hybrid_trees: list[tuple[int, ...]] = (),
                  widths: tuple[str, ...] = ("fixed",), draft_dtypes: tuple[str, ...] = ("auto",)) -> list[Method]:
    """Plain generate (the reference), with `static_baseline` plain generate with a static cache (which transformers
    compiles on CUDA), prompt lookup, transformers' assisted decoding (with `assistant_model`),
    then every draft x tree budget x loop; a ConFu draft once per `contemplate_nodes` entry ("saved": as the draft is
    configured, "confu-saved"; None: a `[con]` on every node, "confu"; m > 0: on the m likeliest path ends,
    "confu-c{m}"; 0: without its future token, "confu-off").
    `loops`: "eager" and/or "static" (`cache_implementation="static"`, compiled on CUDA; named `<method>-static`);
    `static`: the `generate` options of the static methods and baseline (default `static_options("auto")`).
    Drafts run alone (`suffix=False`). `suffix` adds draft-free `SuffixAssistant`s, one per `suffix_tokens` width:
    "suffix" (the sequence itself), "suffix-corpus" (and `suffix_corpus`); "hybrid" runs every draft with the
    suffix candidates of both sources in its trees, per `hybrid_trees` budget (depth, top_k, total_tokens, suffix
    nodes), named `<mode>-hybrid:<draft>:d..k..n..s..`. `widths`: the suffix and hybrid methods once per entry,
    "fixed" and/or "auto" (a per-round width, `width.py`; eager loop only; named `<method>:auto-width`).
    Several `suffix_corpus` folders run each corpus method once per corpus, named `<method>@<corpus folder name>`.
    Several `draft_dtypes` ("auto", "float32", "bfloat16": `ConFuAssistant`'s `draft_dtype`) run each draft method
    once per dtype, named `<method>@<dtype>`."""
    static = static or static_options("auto")
    corpora = [suffix_corpus] if suffix_corpus is None or isinstance(suffix_corpus, (str, Path)) else list(suffix_corpus)
    corpus_tag = {c: f"@{Path(c).name}" if len(corpora) > 1 else "" for c in corpora}
    if len(set(corpus_tag.values())) < len(corpora):
        raise ValueError(f"Suffix corpora {corpora} share a folder name; give each its own, the methods are named by it.")
    ones = torch.ones_like

    def plain(ids, n):
        return model.generate(ids, attention_mask=ones(ids), max_new_tokens=n, **sampling), None

    methods = [Method("generate", plain)]
    if static_baseline:  # transformers' compiled decoding: the baseline to beat on a GPU
        methods.append(Method("generate-static", lambda ids, n: (model.generate(
            ids, attention_mask=ones(ids), max_new_tokens=n, **static, **sampling), None)))
    if prompt_lookup:
        methods.append(Method(f"prompt_lookup{prompt_lookup}", lambda ids, n: (model.generate(
            ids, attention_mask=ones(ids), max_new_tokens=n, prompt_lookup_num_tokens=prompt_lookup, **sampling), None)))
    if assistant_model is not None:
        methods.append(Method("assisted", lambda ids, n: (model.generate(
            ids, attention_mask=ones(ids), max_new_tokens=n, assistant_model=assistant_model, **sampling), None)))
    runs = {width: [loop for loop in loops if width == "fixed" or loop == "eager"] for width in widths}
    for name in (x for x in suffix if x in ("suffix", "suffix-corpus")):
        for corpus in corpora if name == "suffix-corpus" else [None]:
            for total in suffix_tokens:
                for width, width_loops in runs.items():
                    assistant = SuffixAssistant(model, corpus=corpus, total_tokens=total, width=width)
                    for loop in width_loops:
                        tag, options = ("", {}) if loop == "eager" else ("-static", static)
                        methods.append(Method(f"{name}{tag}:n{total}{WIDTH_TAGS[width]}{corpus_tag.get(corpus, '')}",
                                              _speculative(model, assistant, {**sampling, **options}), assistant))
    budgets = list(trees) + (list(hybrid_trees) if "hybrid" in suffix else [])
    for path, draft_dtype in itertools.product(drafts, draft_dtypes):
        dtype_tag = f"@{draft_dtype}" if len(draft_dtypes) > 1 else ""
        for budget in budgets:
            kind = "-hybrid" if len(budget) > 3 else ""
            for corpus, (width, width_loops) in itertools.product(
                    corpora if kind else [None], runs.items() if kind else [("fixed", loops)]):
                assistant = draft_assistant(model, path, budget, corpus, width, draft_dtype)
                tree = (f"{Path(path).name}:{budget_name(budget)}{WIDTH_TAGS[width]}{corpus_tag.get(corpus, '')}"
                        f"{dtype_tag}")
                for loop in width_loops:
                    tag, options = ("", {}) if loop == "eager" else ("-static", static)
                    if not assistant.draft.config.contemplate:
                        methods.append(Method(f"eagle3{kind}{tag}:{tree}",
                                              _speculative(model, assistant, {**sampling, **options}), assistant))
                        continue
                    for nodes in contemplate_nodes:
                        mode = {"saved": "confu-saved", None: "confu", 0: "confu-off"}.get(nodes, f"confu-c{nodes}")
                        methods.append(Method(f"{mode}{kind}{tag}:{tree}", _speculative(
                            model, assistant, {**sampling, **options}, nodes), assistant))
    return methods


def static_options(compile: str) -> dict:
    """`generate` options of the static mode: compiled as transformers decides ("auto"), "always" (a CPU too)
    or "never"."""
    from transformers import CompileConfig

    options: dict = dict(cache_implementation="static")
    if compile == "always":
        options["compile_config"] = CompileConfig()
        options["compile_config"]._compile_all_devices = True
    elif compile == "never":
        options["disable_compile"] = True
    return options


def _speculative(model, assistant, sampling: dict, contemplate_nodes: int | str | None = None):
    """A method running `assistant`; `contemplate_nodes` "saved" leaves the draft's own setting in place."""
    saved = getattr(assistant, "adapter", None) is None or contemplate_nodes == "saved"  # SuffixAssistant: no adapter
    extra = {} if saved else dict(contemplate_nodes=contemplate_nodes)

    def run(ids, n):
        out = model.generate(ids, max_new_tokens=n, assistant_model=assistant, **sampling, **extra)
        return out, list(assistant.stats.accept_lengths)

    return run


def answer(method: Method, tokenizer, question: dict, max_new_tokens: int, seed: int,
           device: torch.device | str = "cpu") -> dict:
    """Answer every turn of a question (later turns see the method's own earlier answers)."""
    texts, ids_out, new_tokens, times, accepts = [], [], [], [], []
    sources, suffix_seconds, tree_sizes = defaultdict(int), 0.0, []
    for turn in range(len(question["turns"])):
        ids = chat_input_ids(tokenizer, question["turns"][: turn + 1], texts).to(device)
        torch.manual_seed(seed + turn)
        start = time.perf_counter()
        out, accept = method.run(ids, max_new_tokens)
        times.append(time.perf_counter() - start)
        out = getattr(out, "sequences", out)  # return_dict_in_generate
        if method.assistant is not None:
            for name, count in method.assistant.stats.accepted_by_source.items():
                sources[name] += count
            suffix_seconds += method.assistant.stats.suffix_seconds
            tree_sizes += method.assistant.stats.tree_sizes
        new = out[0, ids.shape[1]:].cpu()
        ids_out.append((ids.cpu(), new))
        texts.append(tokenizer.decode(new, skip_special_tokens=True))
        new_tokens.append(int(new.numel()))
        if accept is None and method.name == "generate":  # one token per target pass, by definition
            accept = [1] * max(int(new.numel()) - 1, 0)
        accepts.append(accept or [])
    return dict(question_id=question["question_id"], category=question["category"], model_id=method.name,
                choices=[dict(index=0, turns=texts, new_tokens=new_tokens, wall_time=times,
                              accept_lengths=[a for turn in accepts for a in turn],
                              decoding_steps=[len(a) + 1 for a in accepts], accepted_by_source=dict(sources),
                              suffix_seconds=suffix_seconds, tree_sizes=tree_sizes)],
                tstamp=time.time(), _ids=ids_out)


def divergence(model, reference: tuple, other: tuple) -> dict | None:
    """Where `other`'s tokens first differ from the reference's, with the target's top-2 logit gap there."""
    (prompt, ref), (prompt_b, new) = reference, other
    if torch.equal(prompt, prompt_b) and torch.equal(ref, new):
        return None
    n = min(ref.numel(), new.numel())
    diff = (ref[:n] != new[:n]).nonzero()
    at = int(diff[0]) if diff.numel() else n
    if not torch.equal(prompt, prompt_b):
        return dict(position=-1, note="the prompts differ (an earlier turn diverged)")
    with torch.no_grad():
        logits = model(torch.cat([prompt[0], ref[:at]])[None].to(model.device)).logits[0, -1]
    top = logits.float().topk(2).values
    return dict(position=at, top2_logit_gap=float(top[0] - top[1]), reference_token=int(ref[at]) if at < ref.numel()
                else None, token=int(new[at]) if at < new.numel() else None)


def summarize(records: dict[str, list[dict]], greedy: bool, mismatches: dict[str, list]) -> dict:
    """Per method and category (and `overall`): tau, tokens/s, speed-up over `generate`, losslessness."""
    table: dict[str, dict[str, dict]] = {}
    for name, rows in records.items():
        groups = defaultdict(list)
        for row in rows:
            groups[row["category"]].append(row["choices"][0])
            groups["overall"].append(row["choices"][0])
        table[name] = {}
        for category, choices in groups.items():
            tokens = sum(sum(c["new_tokens"]) for c in choices)
            seconds = sum(sum(c["wall_time"]) for c in choices)
            accepts = [a for c in choices for a in c["accept_lengths"]]
            table[name][category] = dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                                         tau=sum(accepts) / len(accepts) if accepts else None)
            sources = defaultdict(int)
            for c in choices:
                for source, count in c.get("accepted_by_source", {}).items():
                    sources[source] += count
            if any(c.get("suffix_seconds", 0) > 0 for c in choices):  # suffix lookups ran: accepted tokens by origin
                sizes = [n for c in choices for n in c.get("tree_sizes", [])]
                table[name][category].update(accepted_by_source=dict(sources), suffix_ms_per_round=1e3 * sum(
                    c["suffix_seconds"] for c in choices) / max(len(accepts), 1),
                    nodes_per_round=sum(sizes) / len(sizes) if sizes else None)  # None: batches (padded trees)
    for name in table:
        for category, cell in table[name].items():
            cell["speedup"] = cell["tokens_per_s"] / table["generate"][category]["tokens_per_s"]
            if greedy:
                cell["identical"] = not any(m["category"] == category or category == "overall"
                                            for m in mismatches.get(name, []))
    return table


def markdown(table: dict, meta: dict) -> str:
    categories = [c for c in next(iter(table.values())) if c != "overall"] + ["overall"]
    lines = [f"# confu-bench: {meta['target']}, {meta['hardware']}", "",
             f"{meta['questions']} questions from `{meta['question_file']}`, max {meta['max_new_tokens']} new tokens, "
             f"temperature {meta['temperature']}, seed {meta['seed']}" + "".join(
                 f", {name}={value!r}" for name, value in meta.get("generate_kwargs", {}).items()) + (
                 f", in batches of {meta['batch_size']} first turns (left-padded; tokens/s over the batch, tau per row)"
                 if meta.get("batch_size", 1) > 1 else "") + ".", "", f"Command: `{meta['command']}`", "",
             "tau: tokens per target pass (n/a where transformers does not report it).", "",
             "## Overall", "", "| method | tau | tokens/s | speed-up | identical to generate |", "|---|---|---|---|---|"]
    for name, cells in table.items():
        c = cells["overall"]
        lines.append(f"| {name} | {_tau(c)} | {c['tokens_per_s']:.2f} | {c['speedup']:.2f}x | "
                     f"{c.get('identical', 'n/a (sampling)')} |")
    lines += ["", "## Speed-up (tau) per category", "", "| method | " + " | ".join(categories) + " |",
              "|---" * (len(categories) + 1) + "|"]
    for name, cells in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{cells[c]['speedup']:.2f}x ({_tau(cells[c])})"
                                                 for c in categories) + " |")
    with_sources = [name for name, cells in table.items() if "accepted_by_source" in cells["overall"]]
    if with_sources:
        lines += ["", "## Accepted tokens by source", "",
                  "Drafted tokens accepted (bonus tokens aside) by who proposed them: the draft, the suffix index, or both "
                  "(the same node); suffix lookup cost per round; nodes verified per round (root included; n/a: batched "
                  "trees, padded to the budget).", "",
                  "| method | draft | suffix | both | suffix share | suffix ms/round | nodes/round |",
                  "|---|---|---|---|---|---|---|"]
        for name in with_sources:
            c = table[name]["overall"]
            by = {k: c["accepted_by_source"].get(k, 0) for k in ("draft", "suffix", "both")}
            total = max(sum(by.values()), 1)
            lines.append(f"| {name} | {by['draft']} | {by['suffix']} | {by['both']} | "
                         f"{(by['suffix'] + by['both']) / total:.0%} | {c['suffix_ms_per_round']:.2f} | "
                         f"{'n/a' if c['nodes_per_round'] is None else format(c['nodes_per_round'], '.2f')} |")
    return "\n".join(lines) + "\n"


def _tau(cell: dict) -> str:
    return "n/a" if cell["tau"] is None else f"{cell['tau']:.2f}"


def plot(table: dict, records: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in table if n != "generate"]
    categories = [c for c in next(iter(table.values())) if c != "overall"] + ["overall"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(categories))]
        axes[0].bar(xs, [table[name][c]["speedup"] for c in categories], width, label=name)
        axes[1].bar(xs, [table[name][c]["tau"] or 0 for c in categories], width, label=name)
        accepts = [a for row in records[name] for a in row["choices"][0]["accept_lengths"]]
        if accepts:
            axes[2].hist(accepts, bins=range(1, max(accepts) + 2), alpha=0.5, label=name, align="left")
    for ax, title in zip(axes, ["speed-up over generate", "tau (tokens per target pass)", "accepted tokens per pass"]):
        ax.set_title(title)
        ax.legend(fontsize=7)
    for ax in axes[:2]:
        ax.set_xticks(range(len(categories)), categories, rotation=45, ha="right")
    axes[0].axhline(1.0, color="gray", linestyle="--")
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + ".png"), dpi=100)
    plt.close(fig)


def run_bench(model, tokenizer, methods: list[Method], questions: list[dict], max_new_tokens: int, seed: int,
              greedy: bool) -> tuple[dict[str, list[dict]], dict[str, list]]:
    """Answer every question with every method (interleaved); check outputs against `generate` at T=0.

    Each method first answers the first question once, untimed (`warmup_seconds`: compiling, allocating)."""
    records: dict[str, list[dict]] = {m.name: [] for m in methods}
    mismatches: dict[str, list] = defaultdict(list)
    warmup_ids = chat_input_ids(tokenizer, questions[0]["turns"][:1]).to(model.device)
    warmup_seconds = {}
    for method in methods:
        start = time.perf_counter()
        method.run(warmup_ids, max_new_tokens)
        warmup_seconds[method.name] = time.perf_counter() - start
    for question in tqdm(questions, desc="questions"):
        rows = {m.name: answer(m, tokenizer, question, max_new_tokens, seed, model.device) for m in methods}
        reference = rows["generate"].pop("_ids")
        for name, row in rows.items():
            ids = row.pop("_ids", reference)
            if greedy and name != "generate":
                for turn, (ref, got) in enumerate(zip(reference, ids)):
                    where = divergence(model, ref, got)
                    if where is not None:
                        mismatches[name].append(dict(question_id=question["question_id"],
                                                     category=question["category"], turn=turn, **where))
            records[name].append(row)
    return records, dict(mismatches), warmup_seconds


def _budgets(text: str) -> list[tuple[int, ...]]:
    """'d,k,n;d,k,n' -> [(d, k, n), ...]; 'none' (or nothing) -> [] (e.g. hybrid trees only)."""
    if text.strip().lower() in ("", "none"):
        return []
    try:
        return [tuple(int(x) for x in t.split(",")) for t in text.split(";")]
    except ValueError:
        raise SystemExit(f"Tree budgets {text!r}: integers, comma-separated within a budget and ';' between "
                         "budgets (e.g. '2,2,4;2,3,6'), or 'none'.") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="confu-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="the embedded default target, a folder or a Hub id")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="the target's dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--static-baseline", action="store_true",
                   help="also run plain generate with cache_implementation='static' (compiled on CUDA)")
    p.add_argument("--loops", default="eager", help="speculative loops to run, comma-separated: eager, static "
                   "(cache_implementation='static': fixed shapes, compiled on CUDA)")
    p.add_argument("--compile", choices=["auto", "always", "never"], default="auto",
                   help="static methods and --static-baseline: compile as transformers does (auto: on CUDA/XPU), "
                   "also on a CPU (always), or not at all (never)")
    p.add_argument("--drafts", nargs="*", default=[str(DEFAULT_DRAFT)], help="draft folders or Hub ids")
    p.add_argument("--questions", default=None,
                   help="Spec-Bench / MT-bench style question .jsonl (default: the packaged Spec-Bench dev half)")
    p.add_argument("--limit", type=int, default=None, help="at most this many questions")
    p.add_argument("--per-category", type=int, default=None, help="at most this many questions per category")
    p.add_argument("--categories", nargs="*", default=None, help="only these categories, e.g. math_reasoning")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--turns", type=int, default=None, help="answer at most this many turns per question (1: first turns)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (with the losslessness check)")
    p.add_argument("--trees", default="4,2,6", help="tree budgets 'depth,top_k,total_tokens;...' ('none': no "
                   "draft-alone trees, e.g. with --suffix hybrid)")
    p.add_argument("--auto-tree", action="store_true",
                   help="also run each draft with the budget that a calibration on this machine finds fastest")
    p.add_argument("--auto-candidates", default=AUTO_CANDIDATES, help="budgets --auto-tree chooses from "
                   "(d,k,n: the draft alone; d,k,n,s: a hybrid tree with s suffix candidates)")
    p.add_argument("--auto-questions", type=int, default=3, help="calibration questions (the first N)")
    p.add_argument("--contemplate-nodes", default="saved,0",
                   help="ConFu drafts: runs per draft, comma-separated: 'saved' = as the draft is configured "
                        "(`contemplate_nodes`, `contemplate_when_greedy`); 'all' = a [con] on every tree node; m > 0 = "
                        "on the m likeliest ends of the accepted path (cheaper verify); 0 = without the future token")
    p.add_argument("--assistant-model", default=None,
                   help="a smaller same-tokenizer model (folder or Hub id) for transformers' assisted decoding")
    p.add_argument("--prompt-lookup", type=int, default=10, help="prompt-lookup tokens (0 = leave it out)")
    p.add_argument("--suffix", default="", help="suffix-drafting methods, comma-separated: suffix (SuffixAssistant, "
                   "the sequence itself), suffix-corpus (and the corpus), hybrid (each draft with both sources)")
    p.add_argument("--suffix-corpus", nargs="+", default=[str(SHIPPED_CORPUS)],
                   help="suffix corpus folders or Hub ids; several: each corpus method once per corpus (@<folder name>; "
                        "--auto-tree calibrates with the first)")
    p.add_argument("--suffix-tokens", default=str(DEFAULT_TOTAL_TOKENS),
                   help="SuffixAssistant: nodes verified per round (root included), comma-separated widths")
    p.add_argument("--hybrid-trees", default="2,1,8,6",
                   help="hybrid budgets 'depth,top_k,total_tokens,suffix_nodes;...' (total_tokens: draft + suffix)")
    p.add_argument("--width", default="fixed", help="suffix and hybrid methods, comma-separated: fixed (each round "
                   "verifies the whole budget), auto (a per-round width from the candidates' estimates and this machine's "
                   "verify costs; eager batch-1 loop only; named <method>:auto-width)")
    p.add_argument("--generate-kwargs", type=json.loads, default={}, metavar="JSON",
                   help="more generate() settings for every method, plain generate included, e.g. "
                        "'{\"repetition_penalty\": 1.2, \"no_repeat_ngram_size\": 4}'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1,
                   help="B > 1: first turns B at a time (left-padded batches), plain batched generate as the reference "
                        "and each draft with its auto batch budget and each --trees budget, in each of --loops; tokens/s "
                        "over the batch, tau per row (prompt lookup and --contemplate-nodes are batch-1 methods: left "
                        "out)")
    p.add_argument("--draft-dtypes", default="auto",
                   help="the drafts' dtypes, comma-separated (several: each draft method once per dtype, named "
                        "<method>@<dtype>): auto (the target's; bfloat16 for a float32 target on a CPU with native "
                        "bfloat16 products), float32, bfloat16, float16")
    p.add_argument("--kernels", choices=["onednn", "mkl"], default="onednn",
                   help="CPU linear layers: onednn (packed weights, what load_target gives) or mkl (plain F.linear)")
    p.add_argument("--out", default="results/bench",
                   help="output path prefix: <out>.md, <out>.json, <out>.png, <out>_answers/ (a dot stays: run_t0.7)")
    args = p.parse_args(argv)
    # checked before anything loads: a typo must not cost the target's loading or a calibration
    trees, hybrid_trees = _budgets(args.trees), _budgets(args.hybrid_trees)
    if any(len(b) != 3 for b in trees) or any(len(b) != 4 for b in hybrid_trees):
        p.error("--trees takes 'depth,top_k,total_tokens;...', --hybrid-trees 'depth,top_k,total_tokens,suffix_nodes;...'.")
    args.draft_dtypes = tuple(dict.fromkeys(x.strip() for x in args.draft_dtypes.split(",")))  # repeats run once
    if not set(args.draft_dtypes) <= {"auto", "float32", "bfloat16", "float16"}:
        p.error(f"--draft-dtypes {','.join(args.draft_dtypes)!r}: choose among auto, float32, bfloat16, float16.")
    if args.batch_size > 1 and args.draft_dtypes != ("auto",):
        p.error("--draft-dtypes: the batched benchmark runs the drafts in their auto dtype; leave it out.")
    if args.batch_size > 1:
        unsupported = [flag for flag, used in (("--assistant-model", args.assistant_model),
                                               ("--auto-tree", args.auto_tree)) if used]
        if unsupported:
            p.error(f"--batch-size {args.batch_size} runs plain batched generate, the drafts' batched trees and the "
                    f"--suffix methods only: "
                    f"drop {', '.join(unsupported)} (batch-1 methods) or use --batch-size 1.")
    return args


def main(argv=None) -> dict:
    """Run the benchmark and write `<out>.md`, `<out>.json`, `<out>.png` and `<out>_answers/<method>.jsonl`."""
    args = parse_args(argv)
    with packed_kernels(args.kernels == "onednn"):
        return _main(args, argv)


def _main(args: argparse.Namespace, argv) -> dict:
    import sys

    torch.manual_seed(args.seed)
    dtype = args.dtype or ("bfloat16" if str(args.device).startswith("cuda") else "float32")
    model, tokenizer = load_target(args.target, torch_dtype=getattr(torch, dtype), device=args.device)
    greedy = args.temperature == 0
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=args.temperature)
    sampling.update(args.generate_kwargs)
    trees, hybrid_trees = _budgets(args.trees), _budgets(args.hybrid_trees)
    suffix = tuple(x.strip() for x in args.suffix.split(",") if x.strip())
    if not set(suffix) <= {"suffix", "suffix-corpus", "hybrid"}:
        raise SystemExit(f"--suffix {args.suffix!r}: choose among suffix, suffix-corpus, hybrid.")
    questions = load_questions(args.questions or DEFAULT_QUESTIONS, args.limit, args.per_category, args.categories)
    if args.turns is not None:
        questions = [{**q, "turns": q["turns"][: args.turns]} for q in questions]
    calibration = {}
    if args.auto_tree:
        for path in args.drafts:
            best, speeds = auto_tree(model, tokenizer, path, questions[: args.auto_questions],
                                     _budgets(args.auto_candidates), args.max_new_tokens, sampling, args.suffix_corpus[0])
            calibration[Path(path).name] = dict(chosen=best, tokens_per_s=speeds)
            if len(best) == 3 and best not in trees:
                trees = trees + [best]
            elif len(best) == 4 and best not in hybrid_trees:
                hybrid_trees = hybrid_trees + [best]
                suffix = suffix + ("hybrid",) if "hybrid" not in suffix else suffix
    named = {"all": None, "saved": "saved"}
    nodes = [named[x] if x in named else int(x) for x in map(str.strip, args.contemplate_nodes.split(","))]
    assistant_model = None
    if args.assistant_model:
        from transformers import AutoModelForCausalLM

        assistant_model = AutoModelForCausalLM.from_pretrained(args.assistant_model, dtype=model.dtype).to(model.device)
    loops = tuple(x.strip() for x in args.loops.split(","))
    widths = tuple(x.strip() for x in args.width.split(","))
    if not set(widths) <= set(WIDTH_TAGS):
        raise SystemExit(f"--width {args.width!r}: choose among fixed, auto.")
    if not set(loops) <= {"eager", "static"}:
        raise SystemExit(f"--loops {args.loops!r}: choose among eager, static.")
    draft_dtypes = args.draft_dtypes
    if args.batch_size > 1:
        if len(args.suffix_corpus) > 1:
            raise SystemExit("--suffix-corpus: one corpus with --batch-size > 1.")
        methods = batch_methods(model, args.drafts, trees, sampling,
                                static_options(args.compile) if args.static_baseline else None, suffix,
                                args.suffix_corpus[0], tuple(int(x) for x in args.suffix_tokens.split(",")), hybrid_trees,
                                loops, static_options(args.compile))
        records, mismatches, warmup = run_batches(model, tokenizer, methods, questions, args.max_new_tokens,
                                                  args.seed, greedy, args.batch_size, divergence)
    else:
        methods = build_methods(model, args.drafts, trees, sampling, args.prompt_lookup, nodes, assistant_model,
                                args.static_baseline, loops, static_options(args.compile), suffix, args.suffix_corpus,
                                tuple(int(x) for x in args.suffix_tokens.split(",")), hybrid_trees, widths, draft_dtypes)
        records, mismatches, warmup = run_bench(model, tokenizer, methods, questions, args.max_new_tokens, args.seed,
                                                greedy)
    table = summarize(records, greedy, mismatches)
    meta = dict(target=args.target, hardware=f"{platform.machine()} CPU, {torch.get_num_threads()} threads, "
                f"{args.kernels} linear kernels"
                if model.device.type == "cpu" else torch.cuda.get_device_name(model.device), dtype=dtype,
                questions=len(questions),
                question_file=args.questions or PACKAGED_QUESTIONS, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                seed=args.seed, generate_kwargs=args.generate_kwargs, batch_size=args.batch_size, loops=args.loops,
                compile=args.compile,
                draft_dtypes={d: str(draft_dtype_for(d, model.get_input_embeddings().weight)).removeprefix("torch.")
                              for d in draft_dtypes}, command="confu-bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    answers = out.parent / f"{out.name}_answers"
    answers.mkdir(exist_ok=True)
    for name, rows in records.items():
        with (answers / f"{name.replace(':', '_')}.jsonl").open("w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    quality = None if greedy else quality_check(records, questions)
    summary = dict(meta=meta, table=table, mismatches=mismatches, auto_tree=calibration, quality=quality,
                   warmup_seconds=warmup)
    out.with_name(out.name + ".json").write_text(json.dumps(summary, indent=2))
    text = markdown(table, meta) + (quality_markdown(quality) if quality else "")
    for name, cal in calibration.items():
        text += (f"\n## --auto-tree calibration for {name}\n\nchosen {budget_name(cal['chosen'])}; tokens/s per candidate: " +
                 ", ".join(f"{k} {v:.2f}" for k, v in cal["tokens_per_s"].items()) + "\n")
    if mismatches:
        text += "\n## Mismatches against plain generate\n\n" + "\n".join(
            f"- {name}: {m}" for name, ms in mismatches.items() for m in ms) + "\n"
    out.with_name(out.name + ".md").write_text(text)
    plot(table, records, out)
    print(text)
    return summary


if __name__ == "__main__":
    main()
