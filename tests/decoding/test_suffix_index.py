"""Suffix indexes and the suffix proposer: matches against brute force, saved corpora, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import chat_tokenizer, tiny_tokenizer

from transformers_confu.decoding.suffix import Calibration, SuffixProposer, calibrate
from transformers_confu.decoding.suffix_index import (
    SEPARATOR,
    CorpusIndex,
    SequenceIndex,
    suffix_array,
    tokenizer_fingerprint,
)


def brute_longest(history: list[int], context: list[int], max_len: int) -> int:
    """The longest suffix of `context` (at most max_len) that occurs in `history`."""
    best = 0
    for length in range(1, min(max_len, len(context)) + 1):
        pattern = context[-length:]
        if any(history[i : i + length] == pattern for i in range(len(history) - length + 1)):
            best = length
    return best


@pytest.mark.parametrize("seed", range(5))
def test_sequence_match_is_the_longest_earlier_occurrence(seed):
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, 4, 60).tolist()
    index = SequenceIndex(capacity=4)  # grows
    for n in range(2, len(seq) + 1):
        index.sync(seq[:n])
        length, starts = index.match(max_len=7, max_occurrences=100)
        # earlier occurrences end before the last token: the history is seq[:n-1]
        assert length == brute_longest(seq[: n - 1], seq[:n], 7), n
        for start in starts:
            assert seq[start - length : start] == seq[n - length : n] and start <= n - 1


def test_suffix_array_sorts_every_suffix():
    rng = np.random.default_rng(0)
    tokens = np.append(rng.integers(0, 3, 300), SEPARATOR).astype(np.int32)
    expected = sorted(range(tokens.size), key=lambda i: tokens[i:].tolist())
    assert suffix_array(tokens).tolist() == expected


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scale", [1, 200_000], ids=["packed-keys", "keys-then-binary-search"])
def test_corpus_match_finds_every_occurrence_and_its_continuation(seed, scale):
    """Small ids pack 21 tokens per key; ids near 2^20 only 3, so longer patterns search on in the suffix array."""
    rng = np.random.default_rng(seed)
    docs = [(rng.integers(0, 5, rng.integers(5, 40)) * scale).tolist() for _ in range(20)]
    index = CorpusIndex.build(docs)
    assert index.meta["key_tokens"] == (21 if scale == 1 else 3)
    flat = [t for d in docs for t in d + [SEPARATOR]]
    for _ in range(30):
        context = (rng.integers(0, 5, 10) * scale).tolist()
        length, starts, total = index.match(context, max_len=8, max_occurrences=1000)
        assert length == brute_longest(flat, context, 8)
        if length:
            pattern = context[-length:]
            occurrences = [i for i in range(len(flat) - length + 1) if flat[i : i + length] == pattern]
            assert total == len(occurrences) == starts.size
            assert sorted(starts.tolist()) == [i + length for i in occurrences]
            for start, continuation in zip(starts, index.continuations(starts, 6)):
                assert SEPARATOR not in continuation and flat[start : start + len(continuation)] == continuation
                assert len(continuation) == 6 or flat[start + len(continuation)] == SEPARATOR


def test_corpus_saves_loads_memory_mapped_and_checks_the_tokenizer(tmp_path):
    tokenizer = tiny_tokenizer()
    index = CorpusIndex.build([[3, 4, 5, 6], [4, 5, 7]], dict(tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                                                            tokenizer_name="tiny"))
    index.save_pretrained(tmp_path / "corpus")
    loaded = CorpusIndex.from_pretrained(tmp_path / "corpus", tokenizer=tokenizer)
    assert all(isinstance(a.base, np.memmap) for a in (loaded.tokens, loaded.suffix_array))  # mapped views
    assert sorted(f.name for f in (tmp_path / "corpus").iterdir()) == ["config.json", "suffix_array.npy", "tokens.npy"]
    assert np.array_equal(loaded.keys, index.keys)  # derived again on load
    assert loaded.meta["documents"] == 2 and loaded.meta["tokens"] == 7
    assert loaded.match([1, 4, 5], 4)[:1] == (2,) and loaded.match([4, 5, 99], 4)[0] == 0  # 99: above the ids
    with pytest.raises(ValueError, match="another tokenizer.*fingerprint.*Build a corpus with this model's tokenizer"):
        CorpusIndex.from_pretrained(tmp_path / "corpus", tokenizer=chat_tokenizer())


def test_bad_corpora_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        CorpusIndex.build([[], []])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with pytest.raises(OSError, match="not a readable suffix corpus.*tokens.npy"):
        CorpusIndex.from_pretrained(tmp_path / "broken")
    with pytest.raises(FileNotFoundError, match="No suffix corpus folder"):
        CorpusIndex.from_pretrained(tmp_path / "missing" / "corpus")


def test_candidates_form_a_bounded_tree_with_path_scores():
    proposer = SuffixProposer(CorpusIndex.build([[1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [2, 3, 4, 6]]), max_nodes=6,
                              max_depth=3, branch=2)
    found = proposer.candidates([7, 1, 2, 3, 4, 8, 1, 2])
    tokens, parents, scores = found.tokens.tolist(), found.parents.tolist(), found.scores.tolist()
    assert 0 < len(tokens) <= 6 and found.max_depth == 3 and found.branch == 2
    for node, parent in enumerate(parents):
        assert parent < node and (parent < 0 or scores[parent] >= scores[node])
        assert found.depths[node] == (1 if parent < 0 else found.depths[parent] + 1) <= 3
    for parent in set(parents):
        ranks = [found.ranks[i].item() for i, p in enumerate(parents) if p == parent]
        assert sorted(ranks) == list(range(len(ranks))) and len(ranks) <= 2
    assert tokens[0] == 3  # "1 2" continues with 3 in the sequence (4 follows) and in the corpus
    padded = proposer.candidates([0], pad=True)  # nothing matches
    assert padded.tokens.numel() == 6 and math.isinf(padded.scores.max().item())


def test_calibration_learns_what_continues():
    """Teacher-forced on answers that repeat their own phrases, deep sequence matches earn high estimates."""
    rng = np.random.default_rng(0)
    answers = []
    for _ in range(20):
        phrase = rng.integers(10, 60, 6).tolist()
        answers.append((rng.integers(0, 60, 5).tolist(), phrase + rng.integers(0, 60, 3).tolist() + phrase))
    calibration = calibrate(SuffixProposer(max_depth=4), answers)
    table = calibration.table()
    assert calibration.trials[0].sum() > 50 and calibration.trials[1].sum() == 0
    deep = Calibration.cell(0, 2, 1.0, 1, 3)  # 2 phrase tokens matched: the 3rd next one is in the phrase
    assert calibration.trials[deep] > 0 and table[deep] > 0.5
    assert json.loads(json.dumps(calibration.to_dict()))["hits"] == calibration.to_dict()["hits"]
    assert torch.equal(torch.tensor(Calibration.from_dict(calibration.to_dict()).hits), torch.tensor(calibration.hits))
