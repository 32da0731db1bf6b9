"""Write the model card of a trained draft (into the draft folder as README.md and into model_cards/).

    python examples/write_model_card.py DRAFT_DIR --bench results/bench_dev_t0.json --name smollm2-135m-instruct-eagle3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers_confu.models.hub import model_card


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("draft_dir")
    p.add_argument("--name", required=True, help="card file name in model_cards/ (without .md)")
    p.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--bench", default=None, help="a confu-bench JSON summary")
    p.add_argument("--hardware", default="2-core x86_64 CPU, fp32")
    p.add_argument("--notes", default="")
    args = p.parse_args()
    bench = json.loads(Path(args.bench).read_text()) if args.bench else None
    card = model_card(args.draft_dir, args.base_model, bench, args.hardware, args.notes)
    (Path(args.draft_dir) / "README.md").write_text(card)
    out = Path(__file__).resolve().parents[1] / "model_cards" / f"{args.name}.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(card)
    print(card)


if __name__ == "__main__":
    main()
