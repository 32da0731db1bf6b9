"""The EAGLE-3 TTT loss on tiny random targets: teacher logits, loss value, masks and causality."""

from __future__ import annotations

import conftest
import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from transformers_confu import ConFuDraftConfig, ConFuDraftModel
from transformers_confu.training.data import DataCollatorForDraft
from transformers_confu.training.ttt import (
    copy_positions,
    shift_left,
    target_features_and_logits,
    ttt_attention_mask,
    ttt_hidden_states,
    ttt_loss,
    ttt_teacher,
    ttt_valid_positions,
)

VOCAB, DRAFT_VOCAB, LENGTH = 128, 64, 12


def tiny_target(family: str = "llama", seed: int = 0, tie_word_embeddings: bool = False) -> PreTrainedModel:
    """A random 4-layer target whose large initial weights give peaked distributions: something to learn."""
    return conftest.tiny_target(family, vocab_size=VOCAB, seed=seed, init=0.5, tie_word_embeddings=tie_word_embeddings)


def tiny_draft(target: PreTrainedModel, seed: int = 1) -> ConFuDraftModel:
    """A random draft for `target` with 64 draft tokens scattered over the target vocabulary."""
    torch.manual_seed(seed)
    draft = ConFuDraftModel(ConFuDraftConfig.for_target(target, draft_vocab_size=DRAFT_VOCAB))
    draft.set_vocab_map(torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values)
    draft.attach_target(target)
    return draft


def tiny_batch(batch: int = 2, length: int = LENGTH, seed: int = 2) -> dict[str, torch.Tensor]:
    """Random tokens, no padding, loss on the second half (the "assistant" turn)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(VOCAB, (batch, length), generator=generator)
    loss_mask = torch.zeros(batch, length, dtype=torch.long)
    loss_mask[:, length // 2 - 2 :] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(input_ids)}


@pytest.fixture(params=sorted(conftest.ARCHS))
def setup(request):
    target = tiny_target(request.param)
    draft = tiny_draft(target)
    batch = tiny_batch()
    features, target_logits = target_features_and_logits(
        target, batch["input_ids"], batch["attention_mask"], draft.config.feature_layers, draft.d2t
    )
    return target, draft, batch, features, target_logits


def additive_causal_mask(length: int) -> torch.Tensor:
    mask = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)
    return mask[None, None]


@pytest.mark.parametrize("family", sorted(conftest.ARCHS))
@pytest.mark.parametrize("tie", [False, True])
def test_teacher_logits_equal_full_logits_restricted_to_draft_vocab(family, tie):
    target = tiny_target(family, tie_word_embeddings=tie)
    draft = tiny_draft(target)
    batch = tiny_batch()
    features, logits = target_features_and_logits(
        target, batch["input_ids"], batch["attention_mask"], draft.config.feature_layers, draft.d2t
    )
    full = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    torch.testing.assert_close(logits, full.logits[..., draft.d2t])
    expected = torch.cat([full.hidden_states[i] for i in draft.config.feature_layers], dim=-1)
    torch.testing.assert_close(features, expected)
    assert not logits.requires_grad


def test_one_step_loss_is_plain_soft_cross_entropy(setup):
    _, draft, batch, features, target_logits = setup
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    loss, metrics = ttt_loss(draft, features, target_logits, ids, loss_mask, batch["attention_mask"], steps=1)

    positions = torch.arange(LENGTH).expand_as(ids)
    hidden = draft(shift_left(ids, 1), features, positions, additive_causal_mask(LENGTH))
    logits = draft.logits(hidden)
    ces, correct = [], []
    for b in range(ids.shape[0]):
        for t in range(LENGTH - 2):
            if loss_mask[b, t + 2]:
                teacher = target_logits[b, t + 1].softmax(dim=-1)
                ces.append(-(teacher * logits[b, t].log_softmax(dim=-1)).sum()[None])
                correct.append(logits[b, t].argmax() == target_logits[b, t + 1].argmax())
    torch.testing.assert_close(loss, torch.cat(ces).mean())
    torch.testing.assert_close(metrics["acc_0"], torch.stack(correct).float().mean())
    assert metrics["count_0"] == len(ces)


def test_teacher_is_shared_by_every_step_where_it_reads():
    """`ttt_teacher` holds, for each step's positions (padding and prompt tokens included in the batch), the
    softmax and greedy token of the target's logits one step further on."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 10, DRAFT_VOCAB, generator=generator).bfloat16()
    logits[0, :, 5] = logits[0].max()  # ties: the greedy token is the first best one, as argmax says
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[1, 7:] = 0
    loss_mask = torch.zeros(3, 10, dtype=torch.long)
    loss_mask[:, 3:] = 1
    loss_mask[2] = 0
    teacher = ttt_teacher(logits, loss_mask, attention_mask)
    for step in range(4):
        rows, cols = ttt_valid_positions(attention_mask, loss_mask, step).nonzero(as_tuple=True)
        slot = teacher.slot[rows, cols + 1 + step]
        assert (slot >= 0).all()
        torch.testing.assert_close(teacher.probs[slot], logits[rows, cols + 1 + step].float().softmax(-1))
        assert torch.equal(teacher.ids[slot], logits[rows, cols + 1 + step].argmax(-1))
    assert (teacher.slot[2] == -1).all()  # a row with nothing trained reads no teacher
    assert len(teacher.probs) == int((teacher.slot >= 0).sum())


def test_steps_are_weighted_by_decay(setup):
    _, draft, batch, features, target_logits = setup
    loss, metrics = ttt_loss(draft, features, target_logits, **batch, steps=3, decay=0.5)
    torch.testing.assert_close(loss, sum(0.5**i * metrics[f"loss_{i}"] for i in range(3)))


def test_copy_positions_follow_the_definition():
    """A position copies when the two real tokens before it occurred together earlier and the token after
    their most recent earlier occurrence is its own; checked against a loop over random rows with padding."""
    generator = torch.Generator().manual_seed(4)
    for _ in range(50):
        length = int(torch.randint(1, 30, (1,), generator=generator))
        vocab = int(torch.randint(2, 6, (1,), generator=generator))
        ids = torch.randint(vocab, (3, length), generator=generator)
        attention_mask = torch.ones_like(ids)
        for row in range(3):
            attention_mask[row, int(torch.randint(length + 1, (1,), generator=generator)) :] = 0
        expected = torch.zeros(3, length, dtype=torch.bool)
        for row in range(3):
            x, real, last = ids[row].tolist(), int(attention_mask[row].sum()), {}
            for s in range(2, real):
                bigram = (x[s - 2], x[s - 1])
                expected[row, s] = bigram in last and x[last[bigram]] == x[s]
                last[bigram] = s
        assert torch.equal(copy_positions(ids, attention_mask), expected)
    ids = torch.tensor([[5, 6, 7, 1, 5, 6, 7, 5, 6, 8]])
    assert copy_positions(ids, torch.ones_like(ids)).nonzero()[:, 1].tolist() == [6]  # 5 6 -> 7 again; then 8: no


def test_mask_picture():
    attention_mask = torch.tensor([[1, 1, 1, 0]])
    allowed = ttt_attention_mask(attention_mask, step=2, dtype=torch.float32)[0, 0] == 0
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
            [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],  # the padding key 3 is seen by its own query only
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


def test_valid_positions_follow_the_definition():
    attention_mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 0, 0, 0]])
    for step in range(3):
        valid = ttt_valid_positions(attention_mask, loss_mask, step)
        for b in range(2):
            for t in range(10):
                j = t + 2 + step
                expected = j < 10 and bool(attention_mask[b, j - 1] and attention_mask[b, j] and loss_mask[b, j])
                assert bool(valid[b, t]) == expected, (step, b, t)


def test_unroll_matches_sequential_drafting(setup):
    """Each chain sees the real prefix and its own earlier steps, exactly as when drafting token by token."""
    _, draft, batch, features, _ = setup
    ids, steps = batch["input_ids"][:1], 3
    unrolled = ttt_hidden_states(draft, features[:1], ids, batch["attention_mask"][:1], steps)
    for t in range(LENGTH):
        cache = DynamicCache()
        tokens, prefix = shift_left(ids, 1)[:, : t + 1], torch.arange(t + 1)[None]
        hidden = draft(tokens, features[:1, : t + 1], prefix, additive_causal_mask(t + 1), cache)[:, -1:]
        torch.testing.assert_close(hidden, unrolled[0][:, t : t + 1])
        for step in range(1, steps):
            token = shift_left(ids, 1 + step)[:, t : t + 1]
            mask = torch.zeros(1, 1, 1, cache.get_seq_length() + 1)
            hidden = draft(token, hidden, torch.tensor([[t + step]]), mask, cache)
            torch.testing.assert_close(hidden, unrolled[step][:, t : t + 1], atol=1e-5, rtol=1e-4)


def test_own_key_blocks_match_sdpa_over_the_full_mask(setup):
    """The TTT fast path (each step's earlier own keys scored as dot products, `ttt_attention`) gives the hidden
    states and gradients of SDPA over the full (B, 1, T, (step+1)T) mask, with padding and grouped KV heads."""
    _, draft, batch, features, _ = setup
    mask = batch["attention_mask"].clone()
    mask[0, -3:] = 0
    weights = [torch.randn(2, LENGTH, draft.config.hidden_size, generator=torch.Generator().manual_seed(s))
               for s in range(4)]

    def loss_and_grads(unroll):
        draft.zero_grad()
        hidden = unroll()
        loss = sum((h * w).sum() for h, w in zip(hidden, weights))
        loss.backward()
        return hidden, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    def masked_sdpa():
        cache, hidden, outputs = DynamicCache(), features, []
        positions = torch.arange(LENGTH).expand(2, LENGTH)
        for step in range(4):
            hidden = draft(shift_left(batch["input_ids"], 1 + step), hidden, positions + step,
                           ttt_attention_mask(mask, step, torch.float32), cache)
            outputs.append(hidden)
        return outputs

    fast, fast_grads = loss_and_grads(lambda: ttt_hidden_states(draft, features, batch["input_ids"], mask, 4))
    reference, reference_grads = loss_and_grads(masked_sdpa)
    for a, b in zip(fast, reference):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert fast_grads.keys() == reference_grads.keys() and "self_attn.q_proj.weight" in fast_grads
    for name in fast_grads:
        torch.testing.assert_close(fast_grads[name], reference_grads[name], atol=1e-4, rtol=1e-3, msg=name)


def test_own_key_blocks_under_bfloat16_autocast_match_float32(setup):
    """Mixed-precision training (`--bf16`) takes the same fused path in bfloat16: hidden states and gradients
    stay within bfloat16 rounding of the float32 ones."""
    _, draft, batch, features, _ = setup
    weights = [torch.randn(2, LENGTH, draft.config.hidden_size, generator=torch.Generator().manual_seed(s))
               for s in range(4)]

    def run(autocast: bool):
        draft.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = ttt_hidden_states(draft, features, batch["input_ids"], batch["attention_mask"], 4)
        sum((h.float() * w).sum() for h, w in zip(hidden, weights)).backward()
        return [h.float() for h in hidden], draft.self_attn.q_proj.weight.grad.clone()

    (low, low_grad), (full, full_grad) = run(True), run(False)
    for a, b in zip(low, full):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    assert torch.nn.functional.cosine_similarity(low_grad.flatten(), full_grad.flatten(), dim=0) > 0.99


def test_chain_ignores_other_chains_keys(setup):
    """Perturbing the keys and values of every chain but one at steps > 0 leaves that chain unchanged."""
    _, draft, batch, features, _ = setup
    args = (draft, features, batch["input_ids"], batch["attention_mask"], 4)
    reference = ttt_hidden_states(*args)
    kept, calls = 5, {"n": 0}

    def perturb_other_chains(module, inputs, output):
        calls["n"] += 1
        if calls["n"] > 2:  # k_proj and v_proj of step 0 are calls 1 and 2
            noise = torch.randn_like(output)
            noise[:, kept] = 0
            return output + noise

    projections = (draft.self_attn.k_proj, draft.self_attn.v_proj)
    hooks = [projection.register_forward_hook(perturb_other_chains) for projection in projections]
    try:
        perturbed = ttt_hidden_states(*args)
    finally:
        for hook in hooks:
            hook.remove()
    for step in range(1, 4):
        torch.testing.assert_close(perturbed[step][:, kept], reference[step][:, kept])
        assert not torch.allclose(perturbed[step], reference[step])


def test_later_tokens_and_features_do_not_reach_earlier_positions(setup):
    _, draft, batch, features, _ = setup
    steps, p = 3, 8
    reference = ttt_hidden_states(draft, features, batch["input_ids"], batch["attention_mask"], steps)

    ids = batch["input_ids"].clone()
    ids[:, p] = (ids[:, p] + 1) % VOCAB
    new_token = ttt_hidden_states(draft, features, ids, batch["attention_mask"], steps)
    new_features = features.clone()
    new_features[:, p] += 1.0
    new_feature = ttt_hidden_states(draft, new_features, batch["input_ids"], batch["attention_mask"], steps)

    for step in range(steps):
        # x_p is the input token of position p-1-step, and in the step-0 key of position p-1.
        first = p - 1 - step
        torch.testing.assert_close(new_token[step][:, :first], reference[step][:, :first])
        assert not torch.allclose(new_token[step][:, first], reference[step][:, first])
        torch.testing.assert_close(new_feature[step][:, :p], reference[step][:, :p])
        assert not torch.allclose(new_feature[step][:, p], reference[step][:, p])


def test_masked_predictions_give_no_loss(setup):
    _, draft, batch, features, target_logits = setup
    steps = 3
    loss, _ = ttt_loss(draft, features, target_logits, **batch, steps=steps)
    # The teachers of predictions x_j with loss_mask[j] == 0 sit at j-1: they must not matter.
    masked_teachers = (shift_left(batch["loss_mask"], 1) == 0)
    noisy = target_logits + 10 * torch.randn_like(target_logits) * masked_teachers[..., None]
    torch.testing.assert_close(ttt_loss(draft, features, noisy, **batch, steps=steps)[0], loss)

    trained_teachers = ~masked_teachers
    noisy = target_logits + 10 * torch.randn_like(target_logits) * trained_teachers[..., None]
    assert not torch.allclose(ttt_loss(draft, features, noisy, **batch, steps=steps)[0], loss)

    nothing = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    loss, metrics = ttt_loss(draft, features, target_logits, **nothing, steps=steps)
    assert loss.item() == 0 and all(metrics[f"count_{i}"] == 0 for i in range(steps))


def test_padding_is_ignored(setup):
    target, draft, batch, _, _ = setup
    steps, length = 3, 8
    padded = {k: v.clone() for k, v in batch.items()}
    padded["attention_mask"][1, length:] = 0
    padded["loss_mask"][1, length:] = 0
    features, logits = target_features_and_logits(
        target, padded["input_ids"], padded["attention_mask"], draft.config.feature_layers, draft.d2t
    )
    loss, _ = ttt_loss(draft, features, logits, **padded, steps=steps)

    junk = {k: v.clone() for k, v in padded.items()}
    junk["input_ids"][1, length:] = 0
    junk["loss_mask"][1, length:] = 1
    junk_features, junk_logits = features.clone(), logits.clone()
    junk_features[1, length:] = torch.randn_like(junk_features[1, length:])
    junk_logits[1, length:] = torch.randn_like(junk_logits[1, length:])
    torch.testing.assert_close(ttt_loss(draft, junk_features, junk_logits, **junk, steps=steps)[0], loss)

    hidden = ttt_hidden_states(draft, features, padded["input_ids"], padded["attention_mask"], steps)
    alone = {k: v[1:, :length] for k, v in padded.items()}
    alone_features, _ = target_features_and_logits(
        target, alone["input_ids"], alone["attention_mask"], draft.config.feature_layers, draft.d2t
    )
    hidden_alone = ttt_hidden_states(draft, alone_features, alone["input_ids"], alone["attention_mask"], steps)
    for step in range(steps):
        real = length - 1 - step  # positions whose input tokens are all real
        torch.testing.assert_close(hidden[step][1:, :real], hidden_alone[step][:, :real], atol=1e-5, rtol=1e-4)


def test_padding_to_a_multiple_leaves_the_loss_unchanged(setup):
    """The collator's `pad_to_multiple_of` only adds masked positions: the same loss and metrics."""
    target, draft, batch, _, _ = setup
    rows = [{"input_ids": batch["input_ids"][i, : LENGTH - 3 * i].tolist(),
             "loss_mask": batch["loss_mask"][i, : LENGTH - 3 * i].tolist()} for i in range(2)]
    results = []
    for multiple in (1, 16):
        padded = DataCollatorForDraft(0, pad_to_multiple_of=multiple)(rows)
        assert padded["input_ids"].shape[1] == (LENGTH if multiple == 1 else 16)
        features, logits = target_features_and_logits(
            target, padded["input_ids"], padded["attention_mask"], draft.config.feature_layers, draft.d2t
        )
        results.append(ttt_loss(draft, features, logits, **padded, steps=3))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-5, rtol=1e-5)


def test_loss_has_gradients_only_for_the_draft(setup):
    target, draft, batch, features, target_logits = setup
    loss, _ = ttt_loss(draft, features, target_logits, **batch)
    loss.backward()
    assert all(p.grad is not None for p in draft.parameters())
    assert all(p.grad is None for p in target.parameters())


def test_evaluate_ttt_weights_batches_by_positions(setup):
    """Rows of different lengths in batches of 1: the position-weighted means equal one padded batch's."""
    from transformers_confu.training.ttt import (
        evaluate_ttt,
        target_argmax,
        target_hidden,
        teacher_logits,
    )

    target, draft, _, _, _ = setup
    rows = [{"input_ids": tiny_batch(1, length, seed=length)["input_ids"][0].tolist(),
             "loss_mask": tiny_batch(1, length)["loss_mask"][0].tolist()} for length in (8, 12, 16)]
    one_by_one = evaluate_ttt(draft, target, rows, steps=2, batch_size=1)
    together = evaluate_ttt(draft, target, rows, steps=2, batch_size=3)
    for key in ("loss_0", "acc_0", "full_acc_0", "loss_1", "full_acc_1"):
        assert one_by_one[key] == pytest.approx(together[key], rel=1e-5, abs=1e-6), key
    features, last = target_hidden(target, torch.tensor([rows[0]["input_ids"]]), torch.ones(1, 8, dtype=torch.long),
                                   draft.config.feature_layers)
    _, metrics = ttt_loss(draft, features, teacher_logits(target, last, draft.d2t), torch.tensor([rows[0]["input_ids"]]),
                          torch.tensor([rows[0]["loss_mask"]]), torch.ones(1, 8, dtype=torch.long), steps=2,
                          target_ids=target_argmax(target, last))
    assert evaluate_ttt(draft, target, rows[:1], steps=2)["full_acc_0"] == pytest.approx(float(metrics["full_acc_0"]))
