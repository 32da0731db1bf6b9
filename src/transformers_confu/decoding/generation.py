"""The speculative decoding loop: draft a tree, verify it in one target pass, accept, compact, repeat."""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import (
    Cache,
    DynamicCache,
    GenerationConfig,
    PreTrainedModel,
    StoppingCriteriaList,
)

from ..models.contemplate import ContemplateAdapter, soft_prompt_mask
from ..utils.cache import cache_kwargs, keep_path, key_width, truncate_cache
from .processing import NodeProcessing, node_processing, probabilities
from .tree import DraftTree, TreeDrafter, additive_mask, pad_keys
from .verify import accept_greedy, accept_sampling


SOURCE_NAMES = {1: "draft", 2: "suffix", 3: "both"}  # `DraftTree.sources` codes


@dataclass
class TreeBudget:
    """EAGLE-2 dynamic tree budget: levels drafted, children per node, nodes verified (root included)."""

    depth: int = 4
    top_k: int = 4
    total_tokens: int = 16


@dataclass
class SpeculativeStats:
    """What one `generate` call did. `mean_accepted_tokens` (tau) counts the bonus token; `fresh_futures`
    (ConFu) counts the rounds whose last accepted node had a `[con]` (so f was renewed). `mode` is the loop
    that ran: `"eager"` (growing caches) or `"static"` (preallocated caches, fixed shapes, compiled where
    the generation config says so); `compile_seconds` is the part of `total_seconds` spent compiling
    (the first call of a shape), `draft_seconds`/`verify_seconds` are host-side times (asynchronous on a GPU).
    With suffix candidates, `accepted_by_source` counts the accepted drafted tokens (bonus tokens aside) by
    origin, "draft", "suffix" or "both" (proposed by each), and `suffix_seconds` is the suffix lookups' part
    of `draft_seconds`. `reused_tokens`: the prompt positions whose caches the last call left (`KeptCaches`).
    `tree_sizes`: the nodes verified each round (root included; below the budget where the candidates are fewer,
    or where a per-round width chose fewer, `width.py`)."""

    mode: str = "eager"
    compile_seconds: float = 0.0
    reused_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    fresh_futures: int = 0
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    suffix_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def other_seconds(self) -> float:
        """Wall time outside the draft and target forwards (tree building, acceptance, bookkeeping)."""
        return self.total_seconds - self.draft_seconds - self.verify_seconds

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_accepted_tokens": self.mean_accepted_tokens, "other_seconds": self.other_seconds}

    def __str__(self) -> str:
        """One line for `print(assistant.stats)` (the dataclass's repr lists every round)."""
        rate = f", {self.new_tokens / self.total_seconds:.1f} tokens/s" if self.total_seconds else ""
        if self.mode == "plain":
            return (f"plain generate (the batch policy): {self.new_tokens} new tokens in {self.total_seconds:.2f} s"
                    + rate)
        line = (f"{self.mode} loop: {self.new_tokens} new tokens in {self.target_forwards} target passes, "
                f"tau {self.mean_accepted_tokens:.2f}; {self.total_seconds:.2f} s (draft {self.draft_seconds:.2f}, "
                f"verify {self.verify_seconds:.2f}, other {self.other_seconds:.2f}){rate}")
        if self.reused_tokens:
            line += f"; {self.reused_tokens} prompt tokens' caches kept from the last call"
        drafted = sum(self.accepted_by_source.values())
        if drafted:
            line += "; accepted drafted tokens: " + ", ".join(
                f"{name} {count / drafted:.0%}" for name, count in sorted(self.accepted_by_source.items()))
        return line


@dataclass
class StepScores:
    """`generate`'s `output_scores`, `output_logits`, `output_hidden_states` and `output_attentions`: for each new
    token, the (1, V) float32 scores it was picked from (the target's logits after the call's processors and
    warpers), the target's raw logits, the target's hidden states where it was picked (a tuple over the embeddings and
    every layer of (1, L, H) tensors: L the prompt's length for the first new token, 1 after it) and its attention
    weights there (a tuple over the layers of (1, heads, L, K) tensors, K the positions attended: L for the first new
    token, then one more each step; empty where the target's attention returns none, as sdpa's); a list is None where
    the call did not ask for it."""

    scores: list[torch.Tensor] | None = None
    logits: list[torch.Tensor] | None = None
    hidden_states: list[tuple[torch.Tensor, ...]] | None = None
    attentions: list[tuple[torch.Tensor, ...]] | None = None
    KINDS = ("scores", "logits", "hidden_states", "attentions")

    def add(self, scores: torch.Tensor, logits: torch.Tensor,
            hidden_states: list[tuple[torch.Tensor, ...]] | None = None,
            attentions: list[tuple[torch.Tensor, ...]] | None = None) -> None:
        """Record the (n, V) `scores` and `logits` of n new tokens, and their n `hidden_states` and `attentions`."""
        for kept, rows in ((self.scores, scores), (self.logits, logits)):
            if kept is not None:
                kept.extend(rows.to(torch.float32, copy=True).split(1))
        for kept, steps in ((self.hidden_states, hidden_states), (self.attentions, attentions)):
            if kept is not None:
                kept.extend(steps)

    def like(self) -> "StepScores":
        """An empty record of the same kinds."""
        return StepScores(*(None if getattr(self, name) is None else [] for name in self.KINDS))

    def add_rows(self, rows: list["StepScores"], steps: int) -> None:
        """Record `steps` new tokens of a batch from each row's own record: per step the rows' tensors stacked into
        one of B rows, zeros where a row has fewer steps (it ended: its output is padding there)."""
        for name in self.KINDS:
            kept = getattr(self, name)
            if kept is None:
                continue
            per_row = [getattr(row, name) for row in rows]
            for step in range(steps):
                at = [r[step] if step < len(r) else None for r in per_row]
                present = next(a for a in at if a is not None)
                if name == "hidden_states":  # a tuple over the layers
                    kept.append(tuple(_stack([None if a is None else a[layer] for a in at], states)
                                      for layer, states in enumerate(present)))
                else:
                    kept.append(_stack(at, present))


def _stack(rows: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """The rows' tensors concatenated, zeros shaped as `like` for a missing (None) one."""
    return torch.cat([torch.zeros_like(like) if row is None else row for row in rows])


@dataclass
class KeptCaches:
    """What an eager batch-1 call leaves for the next one (a `ConFuAssistant` or `SuffixAssistant` keeps one): its
    sequence `tokens` (1, S) on the host, the target's cache (`offset` soft-prompt entries first) and the draft's
    (None without a draft), whose first `length` entries hold positions 0 .. length - 1 (a draft lags the target by
    its last round; without one, `length` is the target's S - 1)."""

    tokens: torch.LongTensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.long))
    target: Cache | None = None
    draft: Cache | None = None
    length: int = 0
    offset: int = 0
    weights: tuple = ()  # `weights_key` of the target that filled them

    def reusable(self, input_ids: torch.LongTensor, offset: int, weights: tuple) -> int:
        """Positions a call with prompt `input_ids` (1, T) takes from these caches: their common prefix less one
        (the draft's entry at p needs the token at p + 1; the prompt's last token is run again for its logits and
        features), at most the draft's entries; none if the target's weights changed since."""
        n = min(input_ids.shape[1], self.tokens.shape[1])
        if self.target is None or offset != self.offset or weights != self.weights or n < 2:
            return 0
        same = input_ids[0, :n].cpu() == self.tokens[0, :n]
        common = n if bool(same.all()) else int(same.int().argmin())
        return max(0, min(common - 1, self.length))

    def clear(self) -> None:
        """Drop the caches (the next call prefills its whole prompt)."""
        self.tokens, self.target, self.draft, self.length = self.tokens[:, :0], None, None, 0

    def take(self, input_ids: torch.LongTensor, offset: int, target: PreTrainedModel, drafter: TreeDrafter
             ) -> tuple[int, Cache | None]:
        """Hand a call the `reusable` positions: the target's cache cut there (returned, None if nothing is
        reused) and the draft's, put on `drafter`. Clears itself: a call that fails half-way leaves nothing."""
        weights = weights_key(target)
        reused, cache = self.reusable(input_ids, offset, weights), None
        if reused:
            truncate_cache(self.target, offset + reused)
            cache = self.target
            if self.draft is not None:
                truncate_cache(self.draft, reused)
                drafter.cache = self.draft
        self.clear()
        self.weights = weights  # what `leave` keeps them under
        return reused, cache

    def leave(self, output: torch.LongTensor, cache: Cache, drafter: TreeDrafter, offset: int) -> None:
        """Keep a finished call's sequence and caches (the target's `weights` were read by `take`)."""
        self.tokens, self.target, self.draft = output, cache, drafter.cache
        self.offset = offset
        self.length = output.shape[1] - 1 if self.draft is None else int(drafter.filled)


def weights_key(model: torch.nn.Module) -> tuple:
    """Which parameter tensors a model holds and their in-place version counters: changes when its weights do."""
    return tuple((id(p), p._version) for p in model.parameters())


def node_states(layers: tuple[torch.Tensor, ...], row: int, nodes: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Per node of `nodes`, a pass's hidden states `layers` ((B, N, H) each) at that node of batch row `row`, as a
    tuple of (1, 1, H) tensors (what `generate` records for a one-token step)."""
    picked = [states[row, nodes] for states in layers]
    return [tuple(states[k][None, None] for states in picked) for k in range(len(nodes))]


def node_attentions(layers: tuple[torch.Tensor, ...], length: int, offset: int, path: torch.Tensor
                    ) -> list[tuple[torch.Tensor, ...]]:
    """Per node of the accepted `path` (root first), a tree pass's attention weights `layers` ((1, heads, N, K) each;
    the cached positions 0 .. length - 1 at keys `offset`...) as a one-token step of `generate` has them: a tuple of
    (1, heads, 1, length + j + 1) tensors for the j-th node, over the cached positions and the path up to that node
    (the only keys a path node sees, besides the soft prompt, which it gives no weight)."""
    keys = torch.cat([torch.arange(offset, offset + length, device=path.device), offset + length + path])
    return [tuple(weights[:, :, node, keys[: length + j + 1]][:, :, None] for weights in layers)
            for j, node in enumerate(path.tolist())]


def stopping_criteria(target: PreTrainedModel, config: GenerationConfig, max_length: int, tokenizer=None,
                      custom: StoppingCriteriaList | None = None) -> StoppingCriteriaList:
    """The stopping criteria `generate` builds for `config` with outputs up to `max_length` (transformers'
    `_get_stopping_criteria`: length, `max_time`, stop strings, EOS) and the call's own `custom` ones
    (`stopping_criteria=`) merged in as `generate` merges them. The loop calls them with each grown output, on the
    host copy of the output (so the EOS ids go to the CPU), and with the scores `generate` passes: the tuple of the
    scores recorded so far where the call records them (`output_scores` with `return_dict_in_generate`), else None.
    Stop strings without `tokenizer` raise transformers' own error."""
    config = copy.deepcopy(config)
    config.max_length = max_length
    target._prepare_special_tokens(config, device="cpu")
    return target._get_stopping_criteria(config, StoppingCriteriaList() if custom is None else custom, tokenizer)


@dataclass
class StaticTarget:
    """What the static mode runs the target with: an empty static `cache`, the `call` that runs the
    fixed-shape tree passes (the model or its compiled call) and, compiled, `keep` (`keep_path` taking
    device scalars), or None to run `keep_path` as it is. `warm`: the compiled calls have run once (the
    loop counts the first round of a cold one as `stats.compile_seconds`)."""

    cache: Cache
    call: Callable
    keep: Callable | None = None
    warm: bool = False


class _Target:
    """The frozen target's forward passes: next-token logits and fused draft features.

    `static`: the static mode's cache and calls (default: a `DynamicCache` and the model); the prompt pass
    always runs the model itself.
    With a `ContemplateAdapter` (ConFu) the cache starts with the soft prompt's constant keys and values
    (`offset` positions, hidden from real tokens) and each tree pass carries `[con]` tokens (whose logits are
    kept too with `con_logits`).
    """

    def __init__(self, model: PreTrainedModel, feature_layers: list[int],
                 adapter: ContemplateAdapter | None = None, static: StaticTarget | None = None,
                 con_logits: bool = False, keep_hidden: bool = False, cache: Cache | None = None,
                 keep_attentions: bool = False) -> None:
        self.model, self.layers, self.adapter, self.con_logits = model, feature_layers, adapter, con_logits
        self.keep_hidden, self.hidden = keep_hidden, None  # the last pass's hidden states, every layer
        self.keep_attentions, self.attentions = keep_attentions, None  # and its attention weights
        self.offset = 0 if adapter is None else adapter.num_soft_tokens
        if cache is None:  # else a kept one, soft prompt included
            cache = DynamicCache(config=model.config) if static is None else static.cache
            cache = cache if adapter is None else adapter.prefilled_cache(model, cache)
        self.cache = cache
        self.call = model if static is None else static.call
        self.keep_call = None if static is None else static.keep
        self.kwargs = cache_kwargs(model, self.cache)
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _forward(self, call, keep, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = {**self.kwargs, "logits_to_keep": keep} if self.keeps_logits else self.kwargs
        if self.keep_attentions:
            kwargs = {**kwargs, "output_attentions": True}
        out = call(**inputs, use_cache=True, output_hidden_states=True, **kwargs)
        self.hidden = out.hidden_states if self.keep_hidden else None
        self.attentions = tuple(w for w in out.attentions or () if w is not None) if self.keep_attentions else None
        logits = out.logits[0]
        if not self.keeps_logits:
            logits = logits[keep] if torch.is_tensor(keep) else logits[-keep:]
        return logits, torch.cat([out.hidden_states[i] for i in self.layers], dim=-1)

    def _width(self, needed: int) -> int:
        return key_width(self.cache, self.offset + needed)

    def prefill(self, ids: torch.LongTensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt pass over `ids` at positions `start`... (after `start` cached ones): the last position's logits
        (all `generate` needs) and all features."""
        if self.adapter is None:
            return self._forward(self.model, 1, input_ids=ids)
        n, device = ids.shape[1], ids.device
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        visible = torch.cat([causal.new_ones(n, start), causal], dim=1)
        mask = soft_prompt_mask(visible, self.offset, causal.new_zeros(n), self.model.dtype)
        positions = torch.arange(start, start + n, device=device)[None]
        return self._forward(self.model, 1, input_ids=ids, position_ids=positions,
                             attention_mask=pad_keys(mask, self._width(start + n)))

    def keep(self, path: torch.Tensor, length: int | torch.Tensor, count: int | torch.Tensor) -> None:
        """Compact the cache to the accepted `path` of `count` nodes after a tree pass at `length` (host ints,
        or device scalars in static mode)."""
        (self.keep_call or keep_path)(self.cache, self.offset + length, path, count)

    def tree(self, tree: DraftTree, length: int, cons: torch.Tensor | None, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Verify `tree` (root at position `length`) in one pass: (N, V) logits and (1, N, 3H) features at
        the nodes, (M, 3H) features at the `[con]` tokens of nodes `cons` (M,) (routed by `state`, the
        fused features of the last accepted token) and, with `con_logits`, their (M, V) logits."""
        ancestry, positions, n = tree.ancestry, length + tree.depths, len(tree)
        if self.adapter is None:
            mask = additive_mask(ancestry, length, self.model.dtype, self._width(length + n))
            logits, features = self._forward(self.call, n, input_ids=tree.tokens[None], position_ids=positions[None],
                                             attention_mask=mask)
            return logits, features, None, None
        m, device = cons.numel(), tree.tokens.device
        node_rows = torch.cat([ancestry, ancestry.new_zeros(n, m)], dim=1)
        con_rows = torch.cat([ancestry[cons], torch.eye(m, dtype=torch.bool, device=device)], dim=1)
        visible = torch.cat([node_rows, con_rows])
        visible = torch.cat([visible.new_ones(n + m, length), visible], dim=1)
        mask = soft_prompt_mask(visible, self.offset, torch.arange(n + m, device=device) >= n, self.model.dtype)
        con = self.adapter.con_embedding(state).to(self.model.dtype).expand(m, -1)
        embeds = torch.cat([self.model.get_input_embeddings()(tree.tokens), con])[None]
        positions = torch.cat([positions, positions[cons] + 1])[None]
        keep = torch.arange(n + m if self.con_logits else n, device=device)
        logits, features = self._forward(self.call, keep, inputs_embeds=embeds, position_ids=positions,
                                         attention_mask=pad_keys(mask, self._width(length + n + m)))
        return logits[:n], features[:, :n], features[0, n:], logits[n:] if self.con_logits else None


def _append(output, tokens, criteria, streamer, seen: list[torch.Tensor] | None = None,
            scores: torch.Tensor | None = None) -> tuple[torch.LongTensor, bool]:
    """Append `tokens` one at a time to the host copy of the output, stopping where `generate`'s stopping
    criteria would (on the host: no device sync per token). `seen`: the scores recorded for the earlier new tokens
    (`output_scores`, where the call has criteria of its own), with `scores` (len(tokens), V) this call's: the
    criteria get those up to each token as a tuple, as `generate` passes its recorded scores (None without `seen`)."""
    stopped, kept = False, 0
    for token in tokens:
        output = torch.cat([output, output.new_tensor([[token]])], dim=1)
        kept += 1
        stopped = bool(criteria(output, None if seen is None else (*seen, *scores[:kept].split(1))).any())
        if stopped:
            break
    if streamer is not None:
        streamer.put(output[0, -kept:])
    return output, stopped


@torch.no_grad()
def speculative_generate(
    target: PreTrainedModel,
    drafter: TreeDrafter,
    feature_layers: list[int],
    input_ids: torch.LongTensor,
    config: GenerationConfig,
    max_new_tokens: int,
    stats: SpeculativeStats,
    tokenizer=None,
    streamer=None,
    adapter: ContemplateAdapter | None = None,
    contemplate_nodes: int | None = None,
    static: StaticTarget | None = None,
    future_logit_weight: float = 0.0,
    processing: NodeProcessing | None = None,
    record: StepScores | None = None,
    stopping: StoppingCriteriaList | None = None,
    kept: KeptCaches | None = None,
) -> torch.LongTensor:
    """Generate up to `max_new_tokens` after `input_ids` (1, T); returns (1, T + new).

    One host sync per round: the accepted tokens are read once; the tree, the acceptance and the cache
    edits stay on the device with fixed shapes. `static` (static mode): the target's static cache and
    (compiled) calls; the drafter holds its own. `processing`: the logits processing of the call (default: the
    one `config` asks for); with any beyond greedy's none or sampling's token-free warpers, a round also reads the
    tree on the host. `record`: where each new token's scores, logits and hidden states go (`output_scores`,
    `output_logits`, `output_hidden_states`, `output_attentions`; the last two not with `static`).
    `stopping`: the call's own stopping criteria (`stopping_criteria=`), beside `generate`'s. `kept` (eager): the
    caches the last call left, reused where this prompt begins with its sequence, and replaced by this call's.

    With `adapter` (ConFu) every verify pass also carries `[con]` tokens (on all nodes, or on the
    `contemplate_nodes` likeliest ends of the accepted path); the future vector read at the last accepted
    node feeds the next draft round (as its `[f]` entry, if the draft has one), and the previous one is kept
    when that node had no `[con]`.
    """
    start = time.perf_counter()
    prompt_len = input_ids.shape[1]
    criteria = stopping_criteria(target, config, prompt_len + max_new_tokens, tokenizer, stopping)
    processing = processing or node_processing(target, config, input_ids, prompt_len + max_new_tokens)[0]
    mix = adapter is not None and future_logit_weight > 0
    entry = adapter is not None and drafter.draft.config.has_future_entry
    keep_hidden = record is not None and record.hidden_states is not None
    keep_attentions = record is not None and record.attentions is not None
    offset = 0 if adapter is None else adapter.num_soft_tokens
    # the prompt step's hidden states and attentions need the whole pass
    kept = None if static is not None or keep_hidden or keep_attentions else kept
    reused, cache = (0, None) if kept is None else kept.take(input_ids, offset, target, drafter)
    stats.reused_tokens = reused
    verify = _Target(target, feature_layers, adapter, static, con_logits=mix, keep_hidden=keep_hidden, cache=cache,
                     keep_attentions=keep_attentions)
    compiled = verify.keep_call is not None
    if streamer is not None:
        streamer.put(input_ids.cpu())

    t0 = time.perf_counter()
    logits, features = verify.prefill(input_ids[:, reused:], reused)
    stats.verify_seconds += time.perf_counter() - t0
    output = input_ids.cpu()
    root, first = processing.pick(logits[-1], output)
    # the scores `generate` hands its criteria; only the call's own read them (transformers' ignore them)
    seen = None if record is None or not stopping else record.scores
    output, stopped = _append(output, [int(root)], criteria, streamer, seen, first)
    if record is not None:
        record.add(first, logits[-1:], [verify.hidden],
                   [tuple(w[..., offset:] for w in verify.attentions)] if keep_attentions else None)
    next_ids = torch.cat([input_ids[:, reused + 1 :], root.view(1, 1)], dim=1)
    feats, state, length, count = features, features[0, -1], prompt_len, None
    # the length as the fixed-shape calls see it: a host int, or in static mode a device scalar (no recompiles)
    at = prompt_len if static is None else torch.tensor(prompt_len, device=input_ids.device)
    future, prior = None, None
    allowed = processing.suffix_check()  # suffix candidates the processors ban: left out
    while not stopped:
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        # Draft: catch up on the newly accepted tokens, then draft a tree under the last one.
        t0 = time.perf_counter()
        drafter.catch_up(next_ids, feats, at, future, count)
        tree = drafter.propose(root, at, prior, output[0].numpy(), allowed)
        ends = len(tree) if contemplate_nodes is None else min(contemplate_nodes, len(tree))
        cons = None if adapter is None else tree.likely_ends(ends)
        t1 = time.perf_counter()
        # Verify the whole tree in one target pass, accept a path, keep only its keys and values.
        logits, features, con_features, con_logits = verify.tree(tree, length, cons, state)
        t2 = time.perf_counter()
        scores = processing.scores(logits, output, tree)
        if processing.sample:
            path, size, root = accept_sampling(tree, probabilities(scores), drafter.d2t)
        else:
            path, size, root = accept_greedy(tree, scores)
        last = path.gather(0, (size - 1)[None])
        next_ids = torch.cat([tree.tokens[path[1:]], root[None]]).scatter(0, size[None] - 1, root[None])[None]
        hit = None if cons is None else cons == last  # the [con] of the last accepted node, if it had one
        con_hit = torch.zeros_like(last) if hit is None else hit.any()[None].long()
        origins = [] if tree.sources is None else [tree.sources[path]]
        read = torch.cat([size[None], con_hit, next_ids[0], *origins]).tolist()  # the round's one host sync
        n, fresh, accepted = read[0], read[1], read[2 : 2 + read[0]]
        for origin in read[2 + next_ids.shape[1] :][1:n]:  # where the accepted nodes below the root came from
            if origin:  # not a padding node
                name = SOURCE_NAMES[origin]
                stats.accepted_by_source[name] = stats.accepted_by_source.get(name, 0) + 1
        count = n if static is None else size
        verify.keep(path, at, count)
        prior = None
        if fresh:
            slot = hit.int().argmax()
            if entry:
                future = (con_features[slot], at + count - 1)
            if mix:
                prior = future_logit_weight * con_logits[slot, drafter.d2t].float().log_softmax(-1)
            stats.fresh_futures += 1
        if compiled and not static.warm:
            stats.compile_seconds, static.warm = time.perf_counter() - t0, True
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        stats.target_forwards += 1
        stats.accept_lengths.append(n)
        stats.tree_sizes.append(len(tree))
        before = output.shape[1]
        # the k-th new token was picked at the k-th node of the path
        output, stopped = _append(output, accepted, criteria, streamer, seen, None if seen is None else scores[path])
        if record is not None:
            nodes = path[: output.shape[1] - before]
            record.add(scores[nodes], logits[nodes], node_states(verify.hidden, 0, nodes) if keep_hidden else None,
                       node_attentions(verify.attentions, length, offset, nodes) if keep_attentions else None)
        feats, state = features[:, path], features[0, last[0]]
        length, at = length + n, at + count
    if streamer is not None:
        streamer.end()
    if kept is not None:
        kept.leave(output, verify.cache, drafter, offset)
    stats.new_tokens = output.shape[1] - prompt_len
    stats.total_seconds = time.perf_counter() - start
    return output.to(input_ids.device)
