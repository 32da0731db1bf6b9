"""`greedy_ids` is argmax, ties included, in every dtype the target and draft run in."""

import pytest
import torch

from transformers_confu.utils.greedy import greedy_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_ids_is_argmax_with_ties_to_the_first(dtype):
    generator = torch.Generator().manual_seed(0)
    few_values = torch.randint(0, 4, (64, 1000), generator=generator).to(dtype)  # ties in nearly every row
    assert torch.equal(greedy_ids(few_values), few_values.argmax(dim=-1))
    logits = torch.randn(2, 5, 300, generator=generator).to(dtype)
    logits[..., 7] = logits[..., 250] = logits.amax(dim=-1) + 1  # a tie for the best, first at 7
    assert (greedy_ids(logits) == 7).all()
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
