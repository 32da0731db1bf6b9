"""Make a ConFu draft from an EAGLE-3 draft and a trained `[con]` adapter, f entering as a first-level prior.

The adapter trained by the auxiliary `[con]` loss (`confu-train --contemplate --no-future-entry --freeze-draft
--future-token-weight 1`) depends on the target and the draft vocabulary only, not on the draft's weights, so it
can be put beside any EAGLE-3 draft of the same vocabulary (e.g. one trained further since). Writes the draft
with `contemplate=True, future_entry=False, future_logit_weight=W` (and `contemplate_nodes`,
`contemplate_when_greedy`) and the adapter; the draft's training record
is kept, the adapter's is written as `adapter_training_record.json`.

    python examples/experiments/add_confu_prior.py runs/eagle3-v6/final runs/confu-prior/final --weight 0.5 --out runs/confu-v6
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from transformers_confu.decoding.assistant import load_adapter, load_draft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("eagle3", help="an EAGLE-3 draft folder")
    p.add_argument("confu", help="a ConFu draft folder whose contemplate_adapter/ to use")
    p.add_argument("--weight", type=float, required=True, help="future_logit_weight of the new draft (> 0)")
    p.add_argument("--contemplate-nodes", type=int, default=1, help="`[con]` tokens per verify pass of the new draft")
    p.add_argument("--no-contemplate-when-greedy", action="store_true",
                   help="the new draft sends no `[con]` in greedy decoding (contemplate_when_greedy=False)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    draft = load_draft(args.eagle3, dtype=torch.float32)
    donor = load_draft(args.confu, dtype=torch.float32)
    if draft.config.contemplate:
        raise SystemExit(f"{args.eagle3} is a ConFu draft already: pass an EAGLE-3 one.")
    if not torch.equal(draft.d2t, donor.d2t):
        raise SystemExit(f"{args.eagle3} and {args.confu} have different draft vocabularies: the adapter's "
                         "auxiliary loss was trained over the other one. Train an adapter for this draft.")
    adapter = load_adapter(args.confu)
    settings = dict(contemplate=True, future_entry=False, future_logit_weight=args.weight,
                    contemplate_nodes=args.contemplate_nodes, contemplate_when_greedy=not args.no_contemplate_when_greedy)
    for key, value in settings.items():
        setattr(draft.config, key, value)
    draft.config.validate_fields()
    draft.to(torch.bfloat16).save_pretrained(args.out)
    adapter.save_to(args.out)
    adapter_record = Path(args.confu) / "adapter_training_record.json"  # a donor assembled by this script
    if not adapter_record.is_file():
        adapter_record = Path(args.confu) / "training_record.json"
    for record, name in ((Path(args.eagle3) / "training_record.json", "training_record.json"),
                         (adapter_record, "adapter_training_record.json")):
        if record.is_file():
            shutil.copy(record, Path(args.out) / name)
    print(f"ConFu draft (f as a first-level prior, weight {args.weight}) -> {args.out}")


if __name__ == "__main__":
    main()
