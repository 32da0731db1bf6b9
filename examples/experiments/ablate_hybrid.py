"""Ablation: which hybrid budget (draft tree + suffix share of one node budget) and which SuffixAssistant
width are fastest on THIS machine.

One confu-bench run (methods interleaved per question: one machine state for all ratios) with plain
`generate`, prompt lookup, the draft alone at its default tree, SuffixAssistant at a few widths (with the
corpus) and the hybrid at every candidate budget (depth, top_k, total_tokens, suffix_nodes); writes the
bench files and a table sorted by tokens/s:

    python examples/experiments/ablate_hybrid.py --per-category 1 --out results/hybrid_ablation

The corpus and its calibration come from training answers only; the questions are the dev half.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers_confu.benchmark.bench import main as bench
from transformers_confu.decoding.suffix import SHIPPED_CORPUS

HYBRIDS = "2,1,5,3;2,1,6,4;2,1,8,6;2,1,10,8;3,1,8,5;3,2,10,5;2,2,8,4"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hybrid-trees", default=HYBRIDS, help="candidate hybrid budgets 'd,k,n,s;...'")
    p.add_argument("--draft-tree", default="2,1,3", help="the draft alone, for reference")
    p.add_argument("--suffix-tokens", default="6,8,12", help="SuffixAssistant widths (with the corpus)")
    p.add_argument("--suffix-corpus", default=str(SHIPPED_CORPUS))
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default="results/hybrid_ablation")
    args = p.parse_args(argv)
    summary = bench(["--turns", "1", "--per-category", str(args.per_category), "--max-new-tokens",
                     str(args.max_new_tokens), "--temperature", str(args.temperature), "--contemplate-nodes", "saved",
                     "--trees", args.draft_tree, "--suffix", "suffix-corpus,hybrid", "--suffix-tokens",
                     args.suffix_tokens, "--hybrid-trees", args.hybrid_trees, "--suffix-corpus", args.suffix_corpus,
                     "--out", args.out])
    rows = sorted(summary["table"].items(), key=lambda kv: -kv[1]["overall"]["tokens_per_s"])
    lines = [f"# Hybrid budget ablation: {summary['meta']['hardware']}", "",
             f"{summary['meta']['questions']} dev first turns, max {args.max_new_tokens} new tokens, temperature "
             f"{args.temperature}; one run, methods interleaved; speed-up against plain generate.", "",
             "Command: `python examples/experiments/ablate_hybrid.py " + " ".join(argv) + "`", "",
             "| method (fastest first) | tau | tokens/s | speed-up |", "|---|---|---|---|"]
    lines += [f"| {name} | {c['overall']['tau'] or 1:.2f} | {c['overall']['tokens_per_s']:.2f} | "
              f"{c['overall']['speedup']:.2f}x |" for name, c in rows]
    Path(args.out).with_name(Path(args.out).name + "_sorted.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
