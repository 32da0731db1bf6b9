"""Fit a trained draft's LM head alone on many of the target's answers, its layer frozen (#22).

The head maps the draft's last (normed) hidden state to its vocabulary. With the layer frozen, fitting it is a softmax
regression on (hidden state, target distribution) pairs: one pass of the target and the draft over the rows gives
them (`extract`, cached to a file), then cheap epochs fit the head (`fit`). Thousands of rows take minutes on a CPU,
where training the whole draft on as many takes hours. Pairs are taken at TTT depths 0 and 1 (the draft's own
hidden state fed back once); the teacher is the target's top-32 logits over its full vocabulary, renormalised over
the tokens the draft's vocabulary holds. Every tenth extracted row is held out: `fit` reports the draft's accuracy
there (its greedy token against the target's, full vocabulary) at depths 0 and 1 per epoch, apart for the tokens a
widened vocabulary gained over `--base` (`widen`: `remap_draft_vocab` to the N most frequent tokens of the answers;
`fit --rows new` fits only the gained rows).

    python examples/experiments/fit_head.py widen --draft D --size 16384 --out runs/fit/D-16k
    python examples/experiments/fit_head.py extract --draft D --rows 2000 --seed 5 --out runs/fit/a.pt
    python examples/experiments/fit_head.py fit --draft D --features runs/fit/a.pt --epochs 2 --lr 1e-4 --out runs/fit/D-fit
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from dev_accuracy import shard_dataset  # this folder's teacher-forced scoring script

from transformers_confu import ConFuDraftModel, load_target
from transformers_confu.training.data import DataCollatorForDraft, build_draft_vocab, remap_draft_vocab
from transformers_confu.training.ttt import target_hidden, ttt_hidden_states, ttt_valid_positions

DATASET = "data/smollm2-135m-instruct-answers"
HELD_OUT_SHARD = "train-00020"  # the "fresh" shard no draft trains on
TOP = 32


def train_shards(dataset: str) -> list[str]:
    """The answers dataset's shards less the held-out one."""
    return [str(p) for p in sorted(Path(dataset, "data").glob("train-*.parquet")) if HELD_OUT_SHARD not in p.name]


def widen(args: argparse.Namespace) -> None:
    target, tokenizer = load_target()
    draft = ConFuDraftModel.from_pretrained(args.draft, dtype=torch.float32)
    vocab = build_draft_vocab(shard_dataset(train_shards(args.dataset), tokenizer, None), args.size,
                              draft.config.vocab_size)
    print(f"{remap_draft_vocab(draft, vocab, target)} new draft tokens", flush=True)
    draft.save_pretrained(args.out)


@torch.no_grad()
def extract(args: argparse.Namespace) -> None:
    target, tokenizer = load_target(torch_dtype=getattr(torch, args.target_dtype))
    draft = ConFuDraftModel.from_pretrained(args.draft, dtype=torch.float32)
    draft.attach_target(target)
    tokenized = shard_dataset(train_shards(args.dataset), tokenizer, args.rows, args.seed)
    rows = sorted((tokenized[i] for i in range(len(tokenized))), key=lambda r: len(r["input_ids"]))  # less padding
    collate, head = DataCollatorForDraft(pad_token_id=0), target.get_output_embeddings()
    store = {depth: {k: [] for k in ("hidden", "top_logits", "top_ids", "row")} for depth in (0, 1)}
    start_time = time.time()
    for start in range(0, len(rows), 8):
        batch = collate(rows[start : start + 8])
        ids, mask = batch["input_ids"], batch["attention_mask"]
        features, last = target_hidden(target, ids, mask, draft.config.feature_layers)
        hidden = ttt_hidden_states(draft, features.float(), ids, mask, 2)
        for depth, kept in store.items():
            b, t = ttt_valid_positions(mask, batch["loss_mask"], depth).nonzero(as_tuple=True)
            h = hidden[depth][b, t]
            top = head(last[b, t + 1 + depth]).float().topk(TOP, dim=-1)  # the target's logits for that token
            kept["hidden"].append((draft.norm(h) if draft.config.norm_output else h).half())
            kept["top_logits"].append(top.values.half())
            kept["top_ids"].append(top.indices.int())
            kept["row"].append(b + start)
        if start % 800 == 0:
            print(f"{start}/{len(rows)} rows, {time.time() - start_time:.0f} s", flush=True)
    torch.save({depth: {k: torch.cat(v) for k, v in kept.items()} for depth, kept in store.items()}, args.out)


def fit(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    draft = ConFuDraftModel.from_pretrained(args.draft, dtype=torch.float32)
    d2t = draft.d2t
    to_draft = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
    to_draft[d2t] = torch.arange(len(d2t))
    gained = ~torch.isin(d2t, ConFuDraftModel.from_pretrained(args.base).d2t) if args.base else torch.zeros_like(d2t).bool()
    if args.rows == "new" and not gained.any():
        raise SystemExit("--rows new fits the rows a widened vocabulary gained over --base: pass --base")
    files = [torch.load(f) for f in args.features]
    pairs = {depth: {k: torch.cat([f[depth][k] for f in files]) for k in files[0][depth]} for depth in (0, 1)}
    # row numbers of different files apart (every tenth row held out)
    rows = {depth: torch.cat([f[depth]["row"] + 10**6 * i for i, f in enumerate(files)]) for depth in (0, 1)}

    def split(depth: int, held_out: bool):
        part = pairs[depth]
        where = (rows[depth] % 10 == 0) == held_out
        ids = to_draft[part["top_ids"][where].long()]
        logits = part["top_logits"][where].float().masked_fill(ids < 0, float("-inf"))
        keep = torch.ones(len(ids), dtype=torch.bool) if held_out else (ids >= 0).any(dim=1)
        return (part["hidden"][where][keep], ids[keep].clamp(min=0), logits[keep].softmax(dim=-1),
                part["top_ids"][where][keep, 0].long())

    weight = torch.nn.Parameter(draft.lm_head.weight.detach().clone())
    held_out = {depth: split(depth, True) for depth in (0, 1)}

    @torch.no_grad()
    def score() -> dict:
        out = {}
        for depth, (hidden, _, _, greedy) in held_out.items():
            right = torch.cat([d2t[(hidden[i : i + 8192].float() @ weight.T).argmax(-1)]
                               for i in range(0, len(hidden), 8192)])
            right = right == greedy
            was_gained = (to_draft[greedy] >= 0) & gained[to_draft[greedy].clamp(min=0)]
            out[f"depth{depth}"] = round(float(right.float().mean()), 4)
            if gained.any():
                out[f"depth{depth}_gained_tokens"] = round(float(right[was_gained].float().mean()), 4)
                out[f"depth{depth}_gained_share"] = round(float(was_gained.float().mean()), 4)
        out["positions"] = len(held_out[0][0])
        return out

    train = [split(depth, False) for depth in (0, 1)]
    hidden, ids, probs = (torch.cat([t[k] for t in train]) for k in range(3))  # hidden states kept in float16
    del train, pairs, files
    log = [{"epoch": 0, **score()}]
    print(log[-1], flush=True)
    optimizer = torch.optim.Adam([weight], lr=args.lr)
    only = gained.float()[:, None] if args.rows == "new" else None
    start_time = time.time()
    for epoch in range(1, args.epochs + 1):
        total = 0.0
        for batch in torch.randperm(len(hidden)).split(args.batch_size):
            log_probs = F.log_softmax(hidden[batch].float() @ weight.T, dim=-1)
            loss = -(probs[batch] * log_probs.gather(1, ids[batch])).sum(-1).mean()
            optimizer.zero_grad()
            loss.backward()
            if only is not None:
                weight.grad.mul_(only)
            optimizer.step()
            total += float(loss.detach()) * len(batch)
        log.append({"epoch": epoch, "loss": round(total / len(hidden), 4), **score(),
                    "seconds": round(time.time() - start_time)})
        print(log[-1], flush=True)
    with torch.no_grad():
        draft.lm_head.weight.copy_(weight)
    draft.save_pretrained(args.out)
    Path(args.out, "fit_head.json").write_text(json.dumps({"args": vars(args), "train_pairs": len(hidden),
                                                           "log": log}, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = p.add_subparsers(dest="step", required=True)
    w = steps.add_parser("widen", help="the draft with the N most frequent answer tokens as its vocabulary")
    w.add_argument("--size", type=int, required=True)
    e = steps.add_parser("extract", help="cache (hidden state, target top-32) pairs of answers-dataset rows")
    e.add_argument("--rows", type=int, default=2000)
    e.add_argument("--seed", type=int, default=0, help="which rows (a seeded shuffle of the dataset)")
    e.add_argument("--target-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="bfloat16: 3x faster on a CPU with AMX, 2%% of the teacher's tokens differ")
    f = steps.add_parser("fit", help="fit the head on cached pairs")
    f.add_argument("--features", nargs="+", required=True)
    f.add_argument("--base", default=None, help="the draft the vocabulary was widened from (which rows are gained)")
    f.add_argument("--rows", default="all", choices=["all", "new"], help="the head rows to fit")
    f.add_argument("--epochs", type=int, default=2)
    f.add_argument("--lr", type=float, default=1e-4)
    f.add_argument("--batch-size", type=int, default=4096)
    f.add_argument("--seed", type=int, default=0)
    for sub in (w, e, f):
        sub.add_argument("--draft", required=True)
        sub.add_argument("--dataset", default=DATASET)
        sub.add_argument("--out", required=True)
    args = p.parse_args()
    {"widen": widen, "extract": extract, "fit": fit}[args.step](args)


if __name__ == "__main__":
    main()
