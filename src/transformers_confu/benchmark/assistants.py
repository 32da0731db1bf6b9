"""The assistants a benchmark runs for a draft at a tree budget, and the budgets' names."""

from __future__ import annotations

from ..decoding.assistant import ConFuAssistant


def draft_assistant(model, path: str, budget: tuple[int, ...], suffix_corpus: str | None,
                    width: str = "fixed", draft_dtype: str = "auto") -> ConFuAssistant:
    """The draft at `budget`: (depth, top_k, total_tokens) alone, (..., suffix_nodes) a hybrid tree with `suffix_corpus`;
    `width` and `draft_dtype` as in `ConFuAssistant`."""
    depth, top_k, total, *nodes = budget
    extra = dict(suffix=suffix_corpus, suffix_nodes=nodes[0]) if nodes else dict(suffix=False)
    return ConFuAssistant.from_pretrained(path, target_model=model, depth=depth, top_k=top_k, total_tokens=total,
                                          width=width, draft_dtype=draft_dtype, **extra)


def budget_name(budget: tuple[int, ...]) -> str:
    """`d2k1n3` for a draft's budget, `d2k1n8s6` for a hybrid one (6 suffix candidates)."""
    return "d{}k{}n{}".format(*budget[:3]) + (f"s{budget[3]}" if len(budget) > 3 else "")
