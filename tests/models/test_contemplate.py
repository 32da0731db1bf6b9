"""ConFu: the contemplate adapter, the future token, lossless decoding with `[con]` tokens, and training."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import tiny_target
from safetensors.torch import load_file
from test_sampling import exact_distribution, p_value, sampled_counts
from transformers import DynamicCache

from transformers_confu import ConFuAssistant, ConFuDraftConfig
from transformers_confu.decoding.generation import _Target
from transformers_confu.decoding.tree import DraftTree, TreeDrafter
from transformers_confu.models.contemplate import ADAPTER_FOLDER, ContemplateAdapter
from transformers_confu.models.hub import model_card
from transformers_confu.models.modeling_confu import ConFuDraftModel
from transformers_confu.models.target import CONFU_DRAFT
from transformers_confu.training.anchors import future_vectors, future_visibility, sample_anchors
from transformers_confu.training.ttt import target_features_and_logits, ttt_loss

BUDGETS = [dict(depth=1, top_k=1, total_tokens=2), dict(depth=3, top_k=2, total_tokens=6),
           dict(depth=5, top_k=4, total_tokens=24)]


def confu_assistant(target, **options):
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True)
    return ConFuAssistant.from_config(config, target, **options)


def plain(target, ids, **kw):
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"d{b['depth']}k{b['top_k']}n{b['total_tokens']}")
@pytest.mark.parametrize("contemplate_nodes", [None, 1, 3])
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_greedy_identity_with_contemplate_tokens(arch, budget, contemplate_nodes, cache_implementation):
    target = tiny_target(arch)
    assistant = confu_assistant(target, contemplate_nodes=contemplate_nodes, **budget)
    for seed in range(5):
        torch.manual_seed(seed)
        ids = torch.randint(0, 128, (1, 3 + 4 * seed))
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=assistant,
                              cache_implementation=cache_implementation)
        assert torch.equal(out, plain(target, ids, max_new_tokens=30)), f"seed {seed}"
        stats = assistant.stats
        if contemplate_nodes is None or contemplate_nodes >= budget["total_tokens"]:
            assert stats.fresh_futures == stats.target_forwards  # every node has a [con]: f is always renewed
        assert stats.fresh_futures <= stats.target_forwards


@pytest.mark.parametrize("contemplate_nodes", [0, 1, 2])
def test_contemplate_nodes_bounds_the_con_tokens_per_pass(contemplate_nodes, monkeypatch):
    """0 sends no `[con]` at all (the draft never gets an f); m > 0 at most m per verify pass."""
    target = tiny_target("llama")
    assistant = confu_assistant(target, contemplate_nodes=contemplate_nodes, depth=3, top_k=2, total_tokens=6)
    sent, tree_pass = [], _Target.tree
    monkeypatch.setattr(_Target, "tree", lambda self, tree, length, cons, state: sent.append(len(cons))
                        or tree_pass(self, tree, length, cons, state))
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, plain(target, ids, max_new_tokens=20))
    assert sent and max(sent) == contemplate_nodes
    if contemplate_nodes == 0:
        assert assistant.stats.fresh_futures == 0
    else:
        assert assistant.stats.fresh_futures > 0


def test_contemplate_when_greedy_false_drops_the_con_tokens_in_greedy_calls_only(tmp_path):
    """A draft saved with `contemplate_when_greedy=False`: greedy calls send no `[con]` (and stay identical to
    plain generate), sampling calls do, and `contemplate_nodes` set in the call or on the assistant wins."""
    target = tiny_target("llama")
    confu_assistant(target, depth=3, top_k=2, total_tokens=6).save_pretrained(tmp_path / "draft")
    config = ConFuDraftConfig.from_pretrained(tmp_path / "draft")
    assert config.contemplate_when_greedy is True  # the default: the paper's behaviour
    config.contemplate_when_greedy = False
    config.save_pretrained(tmp_path / "draft")
    assistant = ConFuAssistant.from_pretrained(tmp_path / "draft", target_model=target)
    assert assistant.draft.config.contemplate_when_greedy is False
    assert "none in greedy decoding" in model_card(tmp_path / "draft", "tiny-llama")
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, plain(target, ids, max_new_tokens=20)) and assistant.stats.fresh_futures == 0
    target.generate(ids, max_new_tokens=20, do_sample=True, temperature=0.7, assistant_model=assistant)
    assert assistant.stats.fresh_futures > 0
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=assistant, contemplate_nodes=1)
    assert torch.equal(out, plain(target, ids, max_new_tokens=20)) and assistant.stats.fresh_futures > 0
    pinned = ConFuAssistant.from_pretrained(tmp_path / "draft", target_model=target, contemplate_nodes=2)
    target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=pinned)
    assert pinned.stats.fresh_futures > 0


def test_real_token_logits_unchanged_by_contemplate_tokens(arch):
    """The tree pass with soft prompt and a [con] per node gives the same logits and features on the real
    tokens as the plain tree pass, and the [con] tokens' own features do depend on the adapter."""
    target = tiny_target(arch)
    adapter = ContemplateAdapter.for_target(target, num_soft_tokens=5)
    layers = [1, 2, 3]
    prompt = torch.randint(0, 128, (1, 9))
    tree = DraftTree.from_parents([3, 7, 9, 11, 2], [-1, 0, 0, 1, 2])
    plain_pass, confu_pass = _Target(target, layers), _Target(target, layers, adapter)
    plain_pass.prefill(prompt)
    _, prompt_features = confu_pass.prefill(prompt)
    logits, features, _, _ = plain_pass.tree(tree, 9, None, None)
    state = prompt_features[0, -1]
    logits_c, features_c, con, no_logits = confu_pass.tree(tree, 9, torch.arange(5), state)
    torch.testing.assert_close(logits_c, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(features_c, features, rtol=1e-5, atol=1e-5)
    assert con.shape == (5, 96) and no_logits is None
    # with con_logits the [con] rows' logits come too (the target's head on their last hidden state)
    mixing = _Target(target, layers, adapter, con_logits=True)
    mixing.prefill(prompt)
    logits_m, _, con_m, con_logits = mixing.tree(tree, 9, torch.arange(2), state)
    torch.testing.assert_close(logits_m, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(con_m, con[:2], rtol=1e-5, atol=1e-5)
    assert con_logits.shape == (2, 128) and not torch.allclose(con_logits[0], logits_m[0])
    with torch.no_grad():
        adapter.soft_prompt.mul_(2)
    other = _Target(target, layers, adapter)
    other.prefill(prompt)
    assert not torch.allclose(other.tree(tree, 9, torch.arange(5), state)[2], con)
    # only the nodes named get a [con]; the cache keeps the soft prompt in front of the prompt and tree
    assert confu_pass.cache.get_seq_length() == 5 + 9 + 5 + 5


def test_soft_prompt_kv_is_computed_once():
    target = tiny_target()
    adapter = ContemplateAdapter.for_target(target, num_soft_tokens=4)
    first = adapter.constant_soft_kv(target)
    assert adapter.constant_soft_kv(target) is first
    assert first[0][0].shape[-2] == 4 and not first[0][0].requires_grad
    with torch.no_grad():
        adapter.soft_prompt.add_(1)  # a trained (changed) soft prompt invalidates the constant
    assert adapter.constant_soft_kv(target) is not first


def test_future_entry_is_seen_for_one_round_then_replaced():
    target = tiny_target()
    assistant = confu_assistant(target)
    draft = assistant.draft
    ids, features = torch.randint(0, 128, (1, 6)), torch.randn(1, 6, 96)
    f = torch.randn(96)
    with_f, without_f = TreeDrafter(draft, 3, 2, 6), TreeDrafter(draft, 3, 2, 6)
    with_f.catch_up(ids, features, 6, (f, 5))
    without_f.catch_up(ids, features, 6)
    assert with_f.cache.get_seq_length() == 7 and without_f.cache.get_seq_length() == 6
    assert not torch.allclose(with_f.hidden, without_f.hidden)  # the last entry sees [f]
    tree = with_f.propose(4, 6)
    assert with_f.cache.get_seq_length() == 7 and len(tree) == 6
    with_f.catch_up(ids[:, :2], features[:, :2], 8)  # the old [f] entry is dropped first
    without_f.catch_up(ids[:, :2], features[:, :2], 8)
    assert with_f.cache.get_seq_length() == 8
    torch.testing.assert_close(with_f.hidden, without_f.hidden)


def test_likely_ends():
    # root -> a (p .6) -> c (p .3); root -> b (p .3)
    scores = torch.tensor([0.0, 0.6, 0.3, 0.3]).log()
    tree = DraftTree.from_parents(torch.arange(4), [-1, 0, 0, 1], scores)
    # P(end): root 1 - .9 = .1, a .6 - .3 = .3, b .3, c .3
    assert tree.likely_ends(3).tolist() == [1, 2, 3]
    assert tree.likely_ends(10).tolist() == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def sampling_setup():
    from test_sampling import VOCAB

    target = tiny_target(vocab_size=VOCAB, init=0.15, seed=3)
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=4, contemplate=True)
    config.initializer_range = 0.4
    assistant = ConFuAssistant.from_config(config, target, depth=2, top_k=2, total_tokens=4, contemplate_nodes=2)
    assistant.draft.set_vocab_map(torch.tensor([0, 2, 3, 5]))
    prompt = torch.tensor([1, 4, 2])
    return target, assistant, prompt, exact_distribution(target, prompt)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("future_logit_weight", [0.0, 1.5])
def test_sampling_with_contemplate_matches_exact_distribution(sampling_setup, cache_implementation,
                                                              future_logit_weight):
    target, assistant, prompt, exact = sampling_setup
    counts = sampled_counts(target, assistant, prompt, cache_implementation=cache_implementation,
                            future_logit_weight=future_logit_weight)
    assert p_value(exact, counts) > 1e-3


@pytest.mark.parametrize("contemplate_nodes", [None, 1])
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_future_logit_mix_is_lossless_and_reaches_the_first_level(arch, contemplate_nodes, cache_implementation,
                                                                  monkeypatch):
    """With future_logit_weight w > 0 the round after a fresh `[con]` drafts its first level with w times that
    `[con]`'s log-probabilities over the draft vocabulary added (other rounds: nothing added); greedy output
    stays identical to plain generate, and the trees differ from w = 0."""
    target = tiny_target(arch)
    assistant = confu_assistant(target, contemplate_nodes=contemplate_nodes, depth=3, top_k=2, total_tokens=6)
    priors, trees, propose = [], [], TreeDrafter.propose

    def spy(self, root, position, prior=None, context=None, allowed=None):
        priors.append(prior)
        tree = propose(self, root, position, prior, context, allowed)
        trees.append(tree.tokens.tolist())
        return tree

    monkeypatch.setattr(TreeDrafter, "propose", spy)
    for seed in range(3):
        ids = torch.randint(0, 128, (1, 4 + 5 * seed), generator=torch.Generator().manual_seed(seed))
        runs = {}
        for weight in (0.0, 2.0):
            priors.clear(), trees.clear()
            out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant,
                                  cache_implementation=cache_implementation, future_logit_weight=weight)
            assert torch.equal(out, plain(target, ids, max_new_tokens=24)), f"seed {seed}, w {weight}"
            runs[weight] = list(trees)
            given = [p for p in priors if p is not None]
            if weight == 0:
                assert not given
                continue
            fresh = assistant.stats.fresh_futures  # the last round's [con] has no next round
            assert priors[0] is None and fresh > 0 and fresh - 1 <= len(given) <= fresh
            for prior in given:  # w times a log-distribution over the draft vocabulary
                assert prior.shape == (64,)
                torch.testing.assert_close(torch.logsumexp(prior / weight, 0), torch.tensor(0.0), atol=1e-4, rtol=0)
        assert runs[0.0] != runs[2.0]


def test_future_logit_weight_is_checked():
    target = tiny_target()
    with pytest.raises(ValueError, match="future_logit_weight"):
        ConFuDraftConfig.for_target(target, contemplate=True, future_logit_weight=-1.0)
    assistant = confu_assistant(target)
    with pytest.raises(ValueError, match="future_logit_weight"):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, assistant_model=assistant, future_logit_weight=-1)


def test_anchor_sampling_and_replication_window():
    attention = torch.ones(2, 12, dtype=torch.long)
    attention[1, 8:] = 0
    loss = torch.ones_like(attention)
    loss[:, :4] = 0
    anchors = sample_anchors(attention, loss, 3, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3) and bool((anchors[:, 1:] > anchors[:, :-1]).all())
    assert bool((anchors >= 3).all())  # the draft at position a predicts a+2, which must be an assistant token
    assert bool((anchors[1] < 8).all()) and bool((anchors[0] < 10).all())
    visible = future_visibility(torch.tensor([[2, 5, 11]]), torch.tensor([[1] * 11 + [0]]), window=2)
    expected = {2: 0, 3: 0, 5: 1, 6: 1}  # position -> the anchor whose f it sees; anchor 11 is padding
    for t in range(12):
        seen = visible[0, t].nonzero().flatten().tolist()
        assert seen == ([expected[t]] if t in expected else []), t


@pytest.mark.parametrize("lag", [None, [[1, 0], [3, 9]]], ids=["fresh", "lagged"])
def test_future_vectors_match_a_direct_forward(arch, lag):
    """The [con] pass over the cached real keys equals one forward of [soft prompt, tokens..a, [con]], its
    [con] routed by the state at a - 1 - lag (clamped at 0), as inference routes a node at depth lag."""
    target = tiny_target(arch)
    adapter = ContemplateAdapter.for_target(target, num_soft_tokens=3)
    ids = torch.randint(0, 128, (2, 10))
    attention = torch.ones_like(ids)
    cache = DynamicCache(config=target.config)
    layers = [1, 2, 3]
    features, _ = target_features_and_logits(target, ids, attention, layers, torch.arange(64), cache)
    anchors = torch.tensor([[2, 6], [4, 8]])
    f, hidden = future_vectors(target, adapter, cache, features, attention, anchors, layers,
                               None if lag is None else torch.tensor(lag))
    for b in range(2):
        for k in range(2):
            a = int(anchors[b, k])
            con = adapter.con_embedding(features[b, max(a - 1 - (0 if lag is None else lag[b][k]), 0)])
            embeds = torch.cat([adapter.soft_prompt, target.get_input_embeddings()(ids[b, : a + 1]), con[None]])[None]
            n = a + 1
            allowed = torch.zeros(3 + n + 1, 3 + n + 1, dtype=torch.bool)
            allowed[:3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
            allowed[3 : 3 + n, 3 : 3 + n] = torch.ones(n, n, dtype=torch.bool).tril()
            allowed[-1] = True
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
            positions = torch.cat([torch.arange(3), torch.arange(n), torch.tensor([a + 1])])[None]
            out = target.base_model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask,
                                    output_hidden_states=True)
            direct = torch.cat([out.hidden_states[i][0, -1] for i in layers])
            # fp32 sums in another order (cached keys vs one pass): a few 1e-5 apart
            torch.testing.assert_close(f[b, k], direct, rtol=1e-4, atol=5e-5)
            torch.testing.assert_close(hidden[b, k], out.last_hidden_state[0, -1], rtol=1e-4, atol=5e-5)


def test_gradients_reach_the_adapter_only_through_contemplate_tokens():
    from transformers_confu.training.anchors import contemplate_future

    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True)
    draft = ConFuDraftModel(config)
    draft.attach_target(target)
    adapter = ContemplateAdapter.for_target(target, num_soft_tokens=4)
    ids = torch.randint(0, 128, (2, 16))
    attention, loss_mask = torch.ones_like(ids), torch.ones_like(ids)
    cache = DynamicCache(config=target.config)
    features, logits = target_features_and_logits(target, ids, attention, config.feature_layers, draft.d2t, cache)
    assert not features.requires_grad
    future = contemplate_future(target, adapter, cache, features, attention, loss_mask, config.feature_layers, 0.25, 3)
    loss, _ = ttt_loss(draft, features, logits, ids, loss_mask, attention, steps=2, future=future)
    loss.backward()
    for name, param in [*adapter.named_parameters(), *draft.future_moe.named_parameters()]:
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in target.parameters())
    # without visible futures the adapter gets no gradient at all
    adapter.zero_grad(set_to_none=True)
    future = contemplate_future(target, adapter, cache, features, attention, loss_mask, config.feature_layers, 0.25, 3)
    blind = future._replace(visible=torch.zeros_like(future.visible))
    loss, _ = ttt_loss(draft, features, logits, ids, loss_mask, attention, steps=2, future=blind)
    loss.backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in adapter.parameters())


def test_future_token_loss_reads_the_con_through_the_target_head():
    """The auxiliary loss is the cross-entropy of the [con] after anchor a (target head, draft vocabulary)
    against the target's greedy token at a + 1; labels outside the draft vocabulary and anchors at the end
    are left out; its gradient reaches the adapter and not the target."""
    from transformers_confu.training.anchors import future_token_loss, future_vectors
    from transformers_confu.training.ttt import Future, target_argmax, target_hidden

    target = tiny_target()
    adapter = ContemplateAdapter.for_target(target, num_soft_tokens=3)
    ids = torch.randint(0, 128, (2, 12))
    attention = torch.ones_like(ids)
    cache = DynamicCache(config=target.config)
    features, last = target_hidden(target, ids, attention, [1, 2, 3], cache)
    target_ids = target_argmax(target, last)
    anchors = torch.tensor([[2, 5, 11], [3, 7, 9]])
    excluded = int(target_ids[0, 3])  # the label of the first anchor: left out of the draft vocabulary
    d2t = torch.tensor([i for i in range(128) if i != excluded])
    vectors, hidden = future_vectors(target, adapter, cache, features, attention, anchors, [1, 2, 3])
    future = Future(vectors, anchors, torch.zeros(2, 12, 3, dtype=torch.bool), hidden)
    loss, accuracy, count = future_token_loss(target, future, target_ids, attention, d2t)
    losses, hits = [], []
    for b in range(2):
        for k in range(3):
            a = int(anchors[b, k])
            label = int(target_ids[b, a + 1]) if a + 1 < 12 else excluded
            if label == excluded:
                continue
            index = int((d2t == label).nonzero())
            logits = target.lm_head(hidden[b, k])[d2t]
            losses.append(torch.nn.functional.cross_entropy(logits[None], torch.tensor([index])))
            hits.append(float(logits.argmax() == index))
    assert 0 < count == len(losses) <= 4
    torch.testing.assert_close(loss, torch.stack(losses).mean())
    assert accuracy.item() == pytest.approx(sum(hits) / len(hits))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.parameters())
    assert all(p.grad is None for p in target.parameters())


def test_confu_training_with_future_token_weight_adds_the_loss_and_logs_it(tmp_path):
    from transformers import default_data_collator

    from transformers_confu.training.trainer import ConFuTrainer
    from transformers_confu.training.training_args import ConFuTrainingArguments

    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True)
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 128, (16,)), "attention_mask": torch.ones(16, dtype=torch.long),
             "loss_mask": torch.ones(16, dtype=torch.long)} for _ in range(4)]
    losses = {}
    for weight in (0.0, 1.0):
        torch.manual_seed(1)
        draft, adapter = ConFuDraftModel(config), ContemplateAdapter.for_target(target, num_soft_tokens=3)
        args = ConFuTrainingArguments(output_dir=str(tmp_path / str(weight)), max_steps=2, per_device_train_batch_size=2,
                                      logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                                      ttt_steps=2, anchor_ratio=0.25, future_token_weight=weight)
        trainer = ConFuTrainer(model=draft, target_model=target, args=args, adapter=adapter, train_dataset=rows,
                               data_collator=default_data_collator)
        batch = default_data_collator(rows[:2])
        torch.manual_seed(2)  # the same anchors for both weights
        losses[weight] = trainer.compute_loss(trainer.model, batch).item()
        trainer.train()
        logged = [log for log in trainer.state.log_history if "loss" in log]
        assert ("future_token_acc" in logged[0]) == (weight > 0)
    assert losses[1.0] > losses[0.0]  # a cross-entropy over 64 draft tokens is well above 0


def test_confu_round_trip_and_errors(tmp_path):
    target = tiny_target()
    assistant = confu_assistant(target, depth=3, top_k=2, total_tokens=6)
    assistant.save_pretrained(tmp_path / "confu")
    assert (tmp_path / "confu" / ADAPTER_FOLDER / "model.safetensors").is_file()
    assert (tmp_path / "confu" / ADAPTER_FOLDER / "config.json").is_file()
    loaded = ConFuAssistant.from_pretrained(tmp_path / "confu", target_model=target)
    torch.testing.assert_close(loaded.adapter.soft_prompt, assistant.adapter.soft_prompt)
    ids = torch.randint(0, 128, (1, 5))
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=loaded),
                       plain(target, ids, max_new_tokens=12))
    with pytest.raises(ValueError, match="different target|trained for"):
        ConFuAssistant.from_pretrained(tmp_path / "confu", target_model=tiny_target(vocab_size=100))
    (tmp_path / "confu" / ADAPTER_FOLDER / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(OSError, match="contemplate adapter"):
        ConFuAssistant.from_pretrained(tmp_path / "confu", target_model=target)
    with pytest.raises(ValueError, match="needs its ContemplateAdapter"):
        ConFuAssistant(assistant.draft, target)


SHIPPED_ADAPTER = CONFU_DRAFT / ADAPTER_FOLDER


@pytest.mark.parametrize("with_peft_config", [True, False], ids=["shipped", "pre-peft"])
def test_shipped_adapter_loads_to_the_identical_weights(tmp_path, with_peft_config):
    """The shipped adapter loads into peft's `PromptEmbedding` unchanged, with its peft config or as adapters
    were saved before peft (the soft prompt under the key `soft_prompt`, no peft config)."""
    from safetensors.torch import save_file

    folder = SHIPPED_ADAPTER
    if not with_peft_config:
        folder = tmp_path / ADAPTER_FOLDER
        folder.mkdir()
        shutil.copy(SHIPPED_ADAPTER / "config.json", folder / "config.json")
        weights = load_file(SHIPPED_ADAPTER / "model.safetensors")
        prompt = weights.pop("prompt.embedding.weight", None)
        save_file(weights if prompt is None else {"soft_prompt": prompt, **weights}, folder / "model.safetensors")
    saved = load_file(folder / "model.safetensors")
    adapter = ContemplateAdapter.from_pretrained(folder)
    prompt_key = "prompt.embedding.weight" if "prompt.embedding.weight" in saved else "soft_prompt"
    assert prompt_key == "soft_prompt" or with_peft_config
    assert set(saved) == {prompt_key, "con_moe.experts", "con_moe.router.weight"}
    assert torch.equal(adapter.prompt.embedding.weight, saved.pop(prompt_key).float())
    state = adapter.state_dict()
    assert set(state) == {"prompt.embedding.weight", *saved}
    assert all(torch.equal(state[key], value.float()) for key, value in saved.items())
    peft_config = adapter.peft_config
    assert (peft_config.num_virtual_tokens, peft_config.token_dim) == (16, 576)
    assert peft_config.base_model_name_or_path == ("HuggingFaceTB/SmolLM2-135M-Instruct" if with_peft_config else None)


def test_adapter_folder_is_a_peft_prompt_tuning_config_beside_the_moe(tmp_path):
    """Text init through peft, saved once (prompt + MoE in model.safetensors) with peft's adapter_config.json,
    which peft reads but `PeftModel` refuses to run (no prompt-tuning weights there)."""
    from conftest import tiny_tokenizer
    from peft import PeftConfig, PeftModel, PromptTuningConfig

    target = tiny_target()
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    text = "t5 t9 t2"
    adapter = ContemplateAdapter.for_target(target, num_soft_tokens=7, init_text=text,
                                            tokenizer_name_or_path=str(tmp_path / "tokenizer"),
                                            base_model_name_or_path="someone/tiny-target")
    words = target.get_input_embeddings().weight
    torch.testing.assert_close(adapter.soft_prompt, words[[5, 9, 2, 5, 9, 2, 5]], rtol=0, atol=0)
    assert dict(adapter.named_parameters())["prompt.embedding.weight"] is adapter.soft_prompt
    adapter.save_to(tmp_path)
    folder = tmp_path / ADAPTER_FOLDER
    names = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "config.json", "model.safetensors"} <= names
    assert not {"adapter_model.safetensors", "adapter_model.bin"} & names
    assert set(load_file(folder / "model.safetensors")) == {"prompt.embedding.weight", "con_moe.experts",
                                                             "con_moe.router.weight"}
    config = PeftConfig.from_pretrained(folder)
    assert isinstance(config, PromptTuningConfig) and config.base_model_name_or_path == "someone/tiny-target"
    assert (config.num_virtual_tokens, config.token_dim, config.prompt_tuning_init) == (7, 32, "TEXT")
    assert config.prompt_tuning_init_text == text and config.inference_mode
    loaded = ContemplateAdapter.from_pretrained(folder)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in adapter.state_dict().items())
    assert loaded.peft_config.to_dict() == config.to_dict()
    with pytest.raises(ValueError):  # it finds no adapter weights in the folder (and a path is no Hub id)
        PeftModel.from_pretrained(target, str(folder))
    peft_file = folder / "adapter_config.json"
    peft_file.write_text(peft_file.read_text().replace('"num_virtual_tokens": 7', '"num_virtual_tokens": 6'))
    with pytest.raises(ValueError, match="mixes two adapters"):
        ContemplateAdapter.from_pretrained(folder)


@pytest.mark.parametrize("contemplate_nodes", [None, 2])
def test_compiled_static_mode_with_contemplate_tokens(contemplate_nodes):
    """ConFu's [con] tokens, soft prompt and [f] entry through the compiled static mode (eager backend,
    fullgraph): token-identical to plain generate, and f is renewed."""
    from test_sampling import compiled_static

    target = tiny_target()
    assistant = confu_assistant(target, contemplate_nodes=contemplate_nodes, depth=3, top_k=2, total_tokens=6)
    for seed in range(2):
        ids = torch.randint(0, 128, (1, 5 + 6 * seed), generator=torch.Generator().manual_seed(seed))
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant, **compiled_static())
        assert torch.equal(out, plain(target, ids, max_new_tokens=24))
        assert assistant.stats.mode == "static" and assistant.stats.fresh_futures > 0


def test_draft_without_future_entry_takes_f_only_as_a_prior(monkeypatch):
    """future_entry=False: no [f] MoE or bias, the draft refuses an [f] entry, the loop never hands it f (its
    drafts equal its EAGLE-3 self's until a prior is given), greedy output stays identical."""
    target = tiny_target()
    with pytest.raises(ValueError, match="future_logit_weight > 0"):
        ConFuDraftConfig.for_target(target, contemplate=True, future_entry=False)
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True, future_entry=False,
                                         future_logit_weight=1.0)
    assistant = ConFuAssistant.from_config(config, target, draft_dtype="float32", depth=3, top_k=2, total_tokens=6)
    draft = assistant.draft
    assert not config.has_future_entry and not hasattr(draft, "future_moe") and not hasattr(draft, "future_bias")
    with pytest.raises(ValueError, match="no \\[f\\] entry"):
        draft(torch.tensor([[1]]), torch.zeros(1, 1, 3 * config.hidden_size), torch.tensor([[0, 0]]),
              torch.zeros(1, 1, 2, 2), future=torch.zeros(1, 1, 3 * config.hidden_size))
    futures, priors = [], []
    catch_up, propose = TreeDrafter.catch_up, TreeDrafter.propose
    monkeypatch.setattr(TreeDrafter, "catch_up", lambda self, *a, **k: futures.append(a[3] if len(a) > 3 else None)
                        or catch_up(self, *a, **k))
    monkeypatch.setattr(TreeDrafter, "propose", lambda self, root, at, prior=None, context=None, allowed=None:
                        priors.append(prior) or propose(self, root, at, prior, context, allowed))
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant)
    assert torch.equal(out, plain(target, ids, max_new_tokens=24))
    assert all(f is None for f in futures) and assistant.stats.fresh_futures > 0
    assert sum(p is not None for p in priors) >= assistant.stats.fresh_futures - 1


@pytest.mark.parametrize("freeze", [False, True])
def test_training_without_future_entry_and_with_a_frozen_draft(tmp_path, freeze):
    """A draft without the [f] entry trains as EAGLE-3 while the auxiliary loss trains the adapter; with
    freeze_draft the draft is neither changed nor given a TTT loss (the loss is the auxiliary one alone)."""
    from transformers import default_data_collator

    from transformers_confu.training.trainer import ConFuTrainer
    from transformers_confu.training.training_args import ConFuTrainingArguments

    target = tiny_target()
    config = ConFuDraftConfig.for_target(target, draft_vocab_size=64, contemplate=True, future_entry=False,
                                         future_logit_weight=0.5)
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 128, (16,)), "attention_mask": torch.ones(16, dtype=torch.long),
             "loss_mask": torch.ones(16, dtype=torch.long)} for _ in range(4)]
    draft, adapter = ConFuDraftModel(config), ContemplateAdapter.for_target(target, num_soft_tokens=3)
    before = {k: v.clone() for k, v in [*draft.state_dict().items(), *adapter.state_dict().items()]}
    with pytest.raises(ValueError, match="future_token_weight > 0"):
        ConFuTrainingArguments(output_dir=str(tmp_path), freeze_draft=True, use_cpu=True)
    args = ConFuTrainingArguments(output_dir=str(tmp_path / "no-aux"), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="no \\[f\\] entry"):
        ConFuTrainer(model=draft, target_model=target, args=args, adapter=adapter, train_dataset=rows)
    args = ConFuTrainingArguments(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=2,
                                  logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, ttt_steps=2,
                                  anchor_ratio=0.5, future_token_weight=1.0, freeze_draft=freeze, learning_rate=1e-2)
    trainer = ConFuTrainer(model=draft, target_model=target, args=args, adapter=adapter, train_dataset=rows,
                           data_collator=default_data_collator)
    trainer.train()
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert all("future_token_acc" in log for log in logged)
    assert all(("ttt_acc_0" in log) != freeze for log in logged)
    moved = {k for k, v in [*draft.state_dict().items(), *adapter.state_dict().items()] if not torch.equal(v, before[k])}
    assert any(k.startswith("soft_prompt") or "con_moe" in k for k in moved)
    assert any(k.startswith(("fc.", "lm_head", "mlp", "self_attn")) for k in moved) != freeze
