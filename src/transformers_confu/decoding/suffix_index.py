"""Suffix indexes over token ids: where the current context's longest suffix occurred before.

Two sources of continuations, one question (`match`): given the context, the length `L` of its longest
suffix that occurs in the source, and where the tokens following each occurrence start.

- `SequenceIndex`: the sequence being generated (prompt + accepted tokens), grown incrementally each round;
  a match is found with a few vectorised comparisons over the whole sequence (a few hundred to a few
  thousand tokens: microseconds).
- `CorpusIndex`: a corpus of token ids (the target's own past answers) with its suffix array, saved as a
  folder of `.npy` files and a `config.json`, loaded memory-mapped; a match is a search over the suffix
  array for each tried length (themselves binary-searched: a suffix that occurs has all its shorter
  suffixes occurring too). Each suffix's first few tokens are also packed into one uint64 key (in suffix
  array order), so the search for a pattern's first tokens is one `np.searchsorted`; only longer patterns
  continue with a binary search, inside that (small) range.

The corpus records the fingerprint of the tokenizer it was built with, and refuses any other.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..utils.atomic import atomic_dir

SEPARATOR = -1  # ends every document of a corpus (sorts before every token; no match crosses it)
CORPUS_CONFIG = "config.json"
CORPUS_FORMAT = "confu-suffix-corpus"


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id, added tokens included)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


class SequenceIndex:
    """The tokens generated so far (prompt included), grown with `sync`."""

    def __init__(self, capacity: int = 1024) -> None:
        self.tokens = np.empty(capacity, dtype=np.int32)
        self.length = 0

    def sync(self, context: Sequence[int] | np.ndarray) -> None:
        """Make the index hold `context`, which extends what it holds (only the new tail is copied)."""
        context = np.asarray(context)
        n = len(context)
        if n > self.tokens.size:
            grown = np.empty(max(n, 2 * self.tokens.size), dtype=np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : n] = context[self.length :]
        self.length = n

    def match(self, max_len: int, min_len: int = 1, max_occurrences: int = 16) -> tuple[int, np.ndarray]:
        """`(L, starts)`: the longest `L <= max_len` such that the last L tokens occurred earlier (ending
        before the last token), and where the token after each of the (at most `max_occurrences` most
        recent) occurrences stands. `(0, [])` if no suffix of at least `min_len` tokens occurred."""
        seq, n = self.tokens[: self.length], self.length
        if n < 2:
            return 0, np.empty(0, dtype=np.int64)
        ends = np.flatnonzero(seq[: n - 1] == seq[n - 1])
        length = 1 if ends.size else 0
        while ends.size and length < max_len:
            longer = ends[ends >= length]
            longer = longer[seq[longer - length] == seq[n - 1 - length]]
            if not longer.size:
                break
            ends, length = longer, length + 1
        if length < min_len:
            return 0, np.empty(0, dtype=np.int64)
        return length, ends[-max_occurrences:] + 1


class CorpusIndex:
    """A suffix array over a corpus of token ids (documents ended by `SEPARATOR`), memory-mappable.

    Attributes:
        tokens: (T,) int32 corpus; suffix_array: (T,) int32 start of each suffix, in lexicographic order.
        keys: (T,) uint64, the first `meta["key_tokens"]` tokens of each suffix (in suffix-array order), packed;
            derived from the two on load (~0.1 s per million tokens), not stored.
        meta: `config.json`: tokenizer fingerprint and name, documents, tokens, key layout, calibration, ...
    """

    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray, meta: dict) -> None:
        self.tokens, self.suffix_array, self.meta = tokens, suffix_array, meta
        if "key_tokens" not in meta:
            bits = max(1, int(tokens.max()) + 2).bit_length()  # ids + 1 (0: the separator)
            meta.update(key_bits=bits, key_tokens=64 // bits)
        self._bits, self._width = meta["key_bits"], meta["key_tokens"]
        self.keys = prefix_keys(tokens, suffix_array, self._bits, self._width)

    @classmethod
    def build(cls, documents: Iterable[Sequence[int]], meta: dict | None = None) -> "CorpusIndex":
        """Index token-id documents (each at least one token). Raises ValueError on an empty corpus."""
        docs = [np.asarray(d, dtype=np.int32) for d in documents]
        docs = [d for d in docs if d.size]
        if not docs:
            raise ValueError("The corpus is empty: no document with at least one token to index.")
        if min(int(d.min()) for d in docs) < 0:
            raise ValueError("Corpus token ids must be >= 0.")
        tokens = np.concatenate([np.append(d, np.int32(SEPARATOR)) for d in docs]).astype(np.int32)
        meta = {**(meta or {}), "documents": len(docs), "tokens": int(tokens.size - len(docs))}
        return cls(tokens, suffix_array(tokens), meta)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write `tokens.npy`, `suffix_array.npy` and `config.json` into `folder` (atomically)."""
        with atomic_dir(Path(folder)) as tmp:
            np.save(tmp / "tokens.npy", self.tokens)
            np.save(tmp / "suffix_array.npy", self.suffix_array)
            (tmp / CORPUS_CONFIG).write_text(json.dumps({"format": CORPUS_FORMAT, **self.meta}, indent=2))

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike, tokenizer=None, **hub) -> "CorpusIndex":
        """Load a corpus folder (or Hub id: `revision`, `cache_dir`, `token`) memory-mapped. With `tokenizer`,
        refuse a corpus built with another tokenizer."""
        folder = Path(path_or_id)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            try:
                folder = Path(snapshot_download(str(path_or_id), **hub))
            except Exception as err:  # noqa: BLE001 - any Hub failure: say what was looked for
                raise FileNotFoundError(f"No suffix corpus folder {str(path_or_id)!r} (looked in "
                                        f"{Path(path_or_id).resolve()}) and no such Hub repository: {err}") from err
        try:
            meta = json.loads((folder / CORPUS_CONFIG).read_text())
            # plain ndarray views of the maps: a `np.memmap` slice costs a Python-level subclass hop, per lookup step
            tokens, sa = (np.asarray(np.load(folder / f"{name}.npy", mmap_mode="r")) for name in ("tokens", "suffix_array"))
        except (OSError, ValueError) as err:
            raise OSError(f"{str(path_or_id)!r} is not a readable suffix corpus ({err}): it needs config.json, "
                          "tokens.npy and suffix_array.npy; build it again with "
                          "`python -m transformers_confu.training.suffix_corpus`.") from err
        if meta.get("format") != CORPUS_FORMAT or not tokens.size or tokens.shape != sa.shape or "key_tokens" not in meta:
            raise OSError(f"{str(path_or_id)!r} is not a complete suffix corpus (format {meta.get('format')!r}, "
                          f"{tokens.size} tokens, {sa.size} suffixes): build it again.")
        index = cls(tokens, sa, meta)
        if tokenizer is not None:
            index.check_tokenizer(tokenizer)
        return index

    def check_tokenizer(self, tokenizer) -> None:
        """Raise ValueError unless the corpus was built with (a tokenizer identical to) `tokenizer`."""
        ours, theirs = self.meta.get("tokenizer_fingerprint"), tokenizer_fingerprint(tokenizer)
        if ours != theirs:
            raise ValueError(
                f"This suffix corpus was built with another tokenizer ({self.meta.get('tokenizer_name')!r}, "
                f"fingerprint {ours}) than the model's ({getattr(tokenizer, 'name_or_path', '?')!r}, fingerprint "
                f"{theirs}): its token ids mean other words. Build a corpus with this model's tokenizer "
                "(`python -m transformers_confu.training.suffix_corpus --tokenizer ...`).")

    def _bound(self, pattern: list[int], upper: bool, lo: int, hi: int) -> int:
        """First slot in [lo, hi) whose suffix's first len(pattern) tokens are >= (upper: >) `pattern`."""
        tokens, sa, size = self.tokens, self.suffix_array, len(pattern)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(sa[mid])
            head = tokens[start : start + size].tolist()
            if head < pattern or (upper and head == pattern):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """The suffix-array slots [lo, hi) of the suffixes that start with `pattern`."""
        head = pattern[: self._width]
        if max(head) + 1 >= 1 << self._bits:  # an id above every id of the corpus
            return 0, 0
        low = high = 0
        for i in range(self._width):
            shift = self._bits * (self._width - 1 - i)
            low |= (head[i] + 1 << shift) if i < len(head) else 0
            high |= (head[i] + 1 << shift) if i < len(head) else ((1 << self._bits) - 1) << shift
        lo = int(np.searchsorted(self.keys, np.uint64(low), side="left"))
        hi = int(np.searchsorted(self.keys, np.uint64(high), side="right"))
        if len(pattern) > self._width and hi > lo:
            lo = self._bound(pattern, False, lo, hi)
            hi = self._bound(pattern, True, lo, hi)
        return lo, hi

    def match(self, context: Sequence[int] | np.ndarray, max_len: int, min_len: int = 1,
              max_occurrences: int = 64) -> tuple[int, np.ndarray, int]:
        """`(L, starts, total)`: the longest `L <= max_len` such that the last L tokens of `context` occur in
        the corpus, where the token after each of at most `max_occurrences` of its `total` occurrences
        (evenly spread over the suffix array, so continuations keep their frequencies) stands."""
        tail = [int(t) for t in context[-max_len:]]
        best, found = 0, (0, 0)
        lo_len, hi_len = min_len, len(tail)
        while lo_len <= hi_len:  # a suffix that occurs has every shorter suffix occurring
            mid = (lo_len + hi_len) // 2
            lo, hi = self._range(tail[-mid:])
            if hi > lo:
                best, found, lo_len = mid, (lo, hi), mid + 1
            else:
                hi_len = mid - 1
        lo, hi = found
        if not best:
            return 0, np.empty(0, dtype=np.int64), 0
        total = hi - lo
        slots = lo + (np.arange(min(total, max_occurrences)) * total) // min(total, max_occurrences)
        return best, np.asarray(self.suffix_array[slots], dtype=np.int64) + best, total

    def continuations(self, starts: np.ndarray, depth: int) -> list[list[int]]:
        """Up to `depth` corpus tokens from each of `starts`, each cut at the end of its document."""
        rows = np.asarray(self.tokens[np.minimum(starts[:, None] + np.arange(depth), self.tokens.size - 1)]).tolist()
        return [row[: row.index(SEPARATOR)] if SEPARATOR in row else row for row in rows]


def prefix_keys(tokens: np.ndarray, suffix_array: np.ndarray, bits: int, width: int) -> np.ndarray:
    """(T,) uint64: the first `width` tokens of each suffix (in suffix-array order), each as id + 1 in `bits` bits
    (0: the separator or past the end), so that keys sort as the suffixes do."""
    keys = np.zeros(suffix_array.size, dtype=np.uint64)
    padded = np.concatenate([tokens.astype(np.int64) + 1, np.zeros(width, dtype=np.int64)])
    for i in range(width):
        keys |= padded[suffix_array.astype(np.int64) + i].astype(np.uint64) << np.uint64(bits * (width - 1 - i))
    return keys


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """(T,) int32 suffix array of `tokens` by prefix doubling (numpy sorts, O(T log^2 T))."""
    n = tokens.size
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)
    order = np.argsort(rank, kind="stable")
    step = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)
        second[: n - step] = rank[step:]
        order = np.lexsort((second, rank))
        key_first, key_second = rank[order], second[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate([[0], np.cumsum((np.diff(key_first) != 0) | (np.diff(key_second) != 0))])
        rank = new
        if rank.max() == n - 1 or step >= n:
            return order.astype(np.int32)
        step *= 2
