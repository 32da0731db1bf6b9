"""Does a ConFu draft use its future vector? Measurements on the target's own greedy dev answers.

For each conversation [dev question, the target's greedy answer]: anchors as in training, the `[con]` pass
(the future vectors f), then the draft's first TTT step with and without the `[f]` entries, at the answer
positions that see an f:
- `kl_with_vs_without`: mean KL(draft with f || draft without f): 0 means f changes nothing;
- `full_acc_with_f` / `full_acc_without_f`: the draft's token == the target's greedy token;
- `attention_on_f`: the draft's attention mass on the `[f]` entries (mean over heads and positions);
- `con_future_token_acc`: the `[con]` itself, read through the target's head (draft vocabulary), predicting
  the target's token two ahead of its anchor (what `--future-token-weight` trains);
- `draft_acc_at_anchors` / `con_only_at_anchors` / `union_acc_at_anchors`: the same token at the same anchors
  as the draft's own first prediction (it sees one more token than the `[con]`), and how often the `[con]` is
  right where the draft is wrong: what f could add to the draft's first prediction at best;
- `mix_acc_at_anchors_w{w}`: the draft's first prediction from `log q + w log p_con` (`future_logit_weight`);
  `..._prob{s}` from the mixture `(1 - s) q + s p_con`; `..._more_confident` the top token of whichever of the
  two is surer (other ways to combine the two, for comparison);
- with `--temperature T`: `accept_T{T}_w{w}_d{Td}`, the expected acceptance of the first drafted token when
  sampling at T (top-k `--top-k`, as `generate` samples): sum over tokens of min(p_target, q), the chance a
  one-child level keeps its draw, with q = softmax((log q_draft + w log p_con) / Td) mapped to target ids. The
  loop drafts at Td = T; other Td show whether a sharper or flatter proposal would keep more (exact, no
  sampling noise: what tau at T > 0 depends on first);
- router statistics of the `[con]` MoE (routed by the target's state) and the `[f]` MoE: expert usage and
  the spread of the router logits (a router at its initial scale has not learned to route), and the learned
  `[f]` attention bias.

    python examples/experiments/confu_diagnostics.py --answers results/eagle3_v2_dev_t0_answers/generate.jsonl \
        --out results/confu_diagnostics
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from functools import partial
from pathlib import Path

import torch
from dev_accuracy import dev_rows
from transformers import DynamicCache, GenerationConfig

from transformers_confu import load_target
from transformers_confu.decoding.assistant import load_adapter, load_draft
from transformers_confu.models.target import CONFU_DRAFT
from transformers_confu.training.anchors import (
    future_token_loss,
    future_vectors,
    future_visibility,
    sample_anchors,
)
from transformers_confu.training.ttt import (
    Future,
    draft_vocab_logits,
    target_argmax,
    target_hidden,
    ttt_hidden_states,
    ttt_valid_positions,
)

SHIPPED = f"transformers_confu/checkpoints/{CONFU_DRAFT.name}"  # how records name the default (no machine path)


def log_mix(q: torch.Tensor, p: torch.Tensor, w: float) -> torch.Tensor:
    return q + w * p


def prob_mix(q: torch.Tensor, p: torch.Tensor, share: float) -> torch.Tensor:
    return torch.logaddexp(q + math.log1p(-share), p + math.log(share))


def more_confident(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.where((q.max(-1).values >= p.max(-1).values)[:, None], q, p)


def expected_acceptance(target_probs: torch.Tensor, mixed_logp: torch.Tensor, draft_temperature: float) -> torch.Tensor:
    """(N,) sum_x min(p(x), q(x)): p the target's sampling probabilities at the draft vocabulary's tokens, q the
    draft's proposal softmax(mixed_logp / draft_temperature) over that vocabulary (zero elsewhere)."""
    return torch.minimum(target_probs, (mixed_logp / draft_temperature).softmax(-1)).sum(-1)


SAMPLED_WEIGHTS, DRAFT_TEMPERATURE_SCALES = (0.0, 0.25, 0.5, 1.0), (0.5, 0.75, 1.0, 1.25)
COMBINERS = {**{f"w{w}": partial(log_mix, w=w) for w in (0.25, 0.5, 1.0, 2.0)},
             **{f"prob{s}": partial(prob_mix, share=s) for s in (0.25, 0.5)}, "more_confident": more_confident}


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=None, help=f"default: the shipped ConFu draft ({SHIPPED})")
    p.add_argument("--adapter", default=None, help="the ConFu draft folder whose adapter to use (default: --draft's)")
    p.add_argument("--answers", required=True, help="a confu-bench answer file of plain generate (generate.jsonl)")
    p.add_argument("--anchor-ratio", type=float, default=0.1)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-anchor", action="store_true",
                   help="also write, per anchor, whether the draft, the [con] and each mix are right (0/1 strings, "
                   "same anchors for any adapter at the same seed: for paired comparisons)")
    p.add_argument("--temperature", type=float, default=None,
                   help="also the expected first-token acceptance when sampling at this temperature (see above)")
    p.add_argument("--top-k", type=int, default=50, help="with --temperature: generate's top-k filter")
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args()
    target, tokenizer = load_target()
    warpers = None if args.temperature is None else target._get_logits_processor(  # generate's own list
        GenerationConfig(do_sample=True, temperature=args.temperature, top_k=args.top_k))
    path = args.draft or CONFU_DRAFT
    draft, adapter = load_draft(path), load_adapter(args.adapter or path)
    draft.attach_target(target)
    entry = draft.config.has_future_entry  # else f reaches the draft only as a prior on its first level
    draft.self_attn.config._attn_implementation = "eager"  # to read the attention weights
    weights = []
    draft.self_attn.register_forward_hook(lambda module, inputs, out: weights.append(out[1]))
    generator = torch.Generator().manual_seed(args.seed)
    totals = dict(kl=0.0, acc_with=0.0, acc_without=0.0, attention=0.0, positions=0, con_hits=0.0, con_count=0)
    con_usage = torch.zeros(adapter.con_moe.router.out_features)
    f_usage = torch.zeros(draft.future_moe.router.out_features) if entry else None
    con_spread, f_spread = [], []
    per_anchor = {key: [] for key in ("draft", "con", *(f"mix_{name}" for name in COMBINERS))}
    sampled = {}  # (w, Td) -> [(anchors,) expected acceptances]
    for row in dev_rows(args.answers, tokenizer):
        ids, loss_mask = torch.tensor([row["input_ids"]]), torch.tensor([row["loss_mask"]])
        attention_mask, length = torch.ones_like(ids), ids.shape[1]
        cache = DynamicCache(config=target.config)
        features, last = target_hidden(target, ids, attention_mask, draft.config.feature_layers, cache)
        target_ids = target_argmax(target, last)
        anchors = sample_anchors(attention_mask, loss_mask, max(1, round(args.anchor_ratio * length)), generator)
        vectors, hidden = future_vectors(target, adapter, cache, features, attention_mask, anchors,
                                         draft.config.feature_layers)
        visible = future_visibility(anchors, attention_mask, args.window)
        _, con_acc, con_count = future_token_loss(target, Future(vectors, anchors, visible, hidden), target_ids,
                                                  attention_mask, draft.d2t)
        totals["con_hits"] += float(con_acc) * con_count
        totals["con_count"] += con_count
        without_f = ttt_hidden_states(draft, features, ids, attention_mask, 1)[0]
        # the [con] and the draft's first prediction name the same token (the one two ahead of the anchor)
        scored = ttt_valid_positions(attention_mask, loss_mask, 0)[0, anchors[0]]
        at = anchors[0, scored]
        wanted = target_ids[0, at + 1]
        con_logp = draft_vocab_logits(target, hidden[0, scored], draft.d2t).float().log_softmax(-1)
        draft_logp = draft.logits(without_f[0, at]).float().log_softmax(-1)
        con_right, draft_right = draft.d2t[con_logp.argmax(-1)] == wanted, draft.d2t[draft_logp.argmax(-1)] == wanted
        per_anchor["draft"].append(draft_right)
        per_anchor["con"].append(con_right)
        for name, combine in COMBINERS.items():
            per_anchor[f"mix_{name}"].append(draft.d2t[combine(draft_logp, con_logp).argmax(-1)] == wanted)
        if args.temperature is not None:
            target_logits = target.get_output_embeddings()(last[0, at + 1]).float()
            target_probs = warpers(None, target_logits).softmax(-1)[:, draft.d2t]
            for w in SAMPLED_WEIGHTS:
                for scale in DRAFT_TEMPERATURE_SCALES:
                    td = round(scale * args.temperature, 4)
                    sampled.setdefault((w, td), []).append(
                        expected_acceptance(target_probs, log_mix(draft_logp, con_logp, w), td))
        states = features.gather(1, (anchors - 1)[..., None].expand(-1, -1, features.shape[-1]))[0]
        con_logits = adapter.con_moe.router(states[:, -adapter.hidden_size:].to(adapter.soft_prompt.dtype))
        con_usage += torch.bincount(con_logits.topk(adapter.con_moe.top_k, -1).indices.flatten(),
                                    minlength=len(con_usage))
        con_spread.append(float(con_logits.std(-1).mean()))
        positions = (ttt_valid_positions(attention_mask, loss_mask, 0) & visible.any(-1))[0].nonzero()[:, 0]
        if not entry or len(positions) == 0:
            continue
        weights.clear()
        with_f = ttt_hidden_states(draft, features, ids, attention_mask, 1, Future(vectors, anchors, visible))[0]
        attention = weights[0][0, :, :length, length:].sum(-1).mean(0)  # (T,) mass on the [f] columns
        log_with = torch.log_softmax(draft.logits(with_f[0, positions]).float(), -1)
        log_without = torch.log_softmax(draft.logits(without_f[0, positions]).float(), -1)
        wanted = target_ids[0, positions + 1]
        totals["kl"] += float((log_with.exp() * (log_with - log_without)).sum())
        totals["acc_with"] += float((draft.d2t[log_with.argmax(-1)] == wanted).sum())
        totals["acc_without"] += float((draft.d2t[log_without.argmax(-1)] == wanted).sum())
        totals["attention"] += float(attention[positions].sum())
        totals["positions"] += len(positions)
        f_logits = draft.future_moe.router(draft.fc(vectors[0].to(draft.fc.weight.dtype)))
        f_usage += torch.bincount(f_logits.topk(draft.future_moe.top_k, -1).indices.flatten(), minlength=len(f_usage))
        f_spread.append(float(f_logits.std(-1).mean()))
    n = totals["positions"]
    right = {key: torch.cat(values) for key, values in per_anchor.items()}
    draft_right, con_right = right["draft"], right["con"]
    result = dict(
        draft=args.draft or SHIPPED, anchors=len(draft_right),
        con_future_token_acc=totals["con_hits"] / max(totals["con_count"], 1),
        draft_acc_at_anchors=draft_right.double().mean().item(),
        con_only_at_anchors=(con_right & ~draft_right).double().mean().item(),
        union_acc_at_anchors=(con_right | draft_right).double().mean().item(),
        **{f"mix_acc_at_anchors_{name}": right[f"mix_{name}"].double().mean().item() for name in COMBINERS},
        con_router_logit_std=sum(con_spread) / len(con_spread), con_expert_usage=(con_usage / con_usage.sum()).tolist(),
    )
    for (w, td), values in sampled.items():
        result[f"accept_T{args.temperature}_w{w}_d{td}"] = torch.cat(values).double().mean().item()
    if entry:
        result.update(
            positions=n, kl_with_vs_without=totals["kl"] / n, full_acc_with_f=totals["acc_with"] / n,
            full_acc_without_f=totals["acc_without"] / n, attention_on_f=totals["attention"] / n,
            future_attention_bias=float(draft.future_bias), f_router_logit_std=sum(f_spread) / len(f_spread),
            f_expert_usage=(f_usage / f_usage.sum()).tolist())
    result["command"] = "python examples/experiments/confu_diagnostics.py " + shlex.join(sys.argv[1:])  # as typed
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.per_anchor:
        result["per_anchor"] = {key: "".join(map(str, bits.int().tolist())) for key, bits in right.items()}
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2))
    md = [f"# Does the ConFu draft use f?\n\n`{result['command']}`\n", "| measurement | value |", "|---|---|"]
    md += [f"| {k} | {', '.join(f'{x:.3f}' for x in v) if isinstance(v, list) else (f'{v:.4f}' if isinstance(v, float) else v)} |"
           for k, v in result.items() if k not in ("command", "draft", "per_anchor")]
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
