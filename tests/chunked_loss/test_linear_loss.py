"""The LM head and its loss in chunks: the op alone, and Hugging Face causal LMs through it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import actune
from actune import tunables
from actune.chunked_loss.lm_head import recognised
from actune.tune.alternatives import Config, parse_configs

transformers = pytest.importorskip("transformers")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few tokens, so that every test crosses chunk boundaries."""
    monkeypatch.setattr(tunables, "CHUNK_ELEMENTS", 700)


def _reference(h, w, b, t, ignore, reduction, softcap):
    z = F.linear(h, w, b).float()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z.reshape(-1, w.shape[0]), t.reshape(-1), ignore_index=ignore,
                           reduction=reduction)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_loss_and_gradients_are_the_unfused_ops(small_chunks, bias, reduction, softcap):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 17, 24, generator=g, requires_grad=True)
    w = torch.randn(100, 24, generator=g).mul_(0.3).requires_grad_()
    b = torch.randn(100, generator=g, requires_grad=True) if bias else None
    t = torch.randint(0, 100, (3, 17), generator=g)
    t[0, :4] = -100
    args = [x for x in (h, w, b) if x is not None]
    want = _reference(h, w, b, t, -100, reduction, softcap)
    got = actune.linear_cross_entropy(h, w, t, b, reduction=reduction, softcap=softcap)
    assert got.shape == (want.shape if reduction != "none" else t.shape)
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5)
    seed = torch.randn(want.shape, generator=g)
    expected = torch.autograd.grad((want * seed).sum(), args)
    found = torch.autograd.grad((got.reshape(want.shape) * seed).sum(), args)
    for e, f in zip(expected, found, strict=True):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-5)


def test_a_sum_divided_by_the_items_of_the_whole_batch(small_chunks):
    h, w = torch.randn(4, 8, 16, requires_grad=True), torch.randn(50, 16)
    t = torch.randint(0, 50, (4, 8))
    got = actune.linear_cross_entropy(h, w, t, reduction="sum", divide_by=torch.tensor(64))
    torch.testing.assert_close(got, _reference(h, w, None, t, -100, "sum", None) / 64)


def test_bad_shapes_say_what_to_fix():
    with pytest.raises(ValueError, match="width 16 do not match"):
        actune.linear_cross_entropy(torch.randn(2, 16), torch.randn(10, 8),
                                    torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="target shape"):
        actune.linear_cross_entropy(torch.randn(2, 8), torch.randn(10, 8),
                                    torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction"):
        actune.linear_cross_entropy(torch.randn(2, 8), torch.randn(10, 8),
                                    torch.zeros(2, dtype=torch.long), reduction="max")


def test_per_token_losses_inside_compressed_keep_the_hidden_states_at_8_bits():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(8, 64, 32, generator=g, requires_grad=True)
    w = torch.randn(500, 32, generator=g).mul_(0.2).requires_grad_()
    t = torch.randint(0, 500, (8, 64), generator=g)
    seed = torch.rand(8, 64, generator=g)
    exact = torch.autograd.grad((_reference(h, w, None, t, -100, "none", None).reshape(8, 64)
                                 * seed).sum(), (h, w))
    stats = []
    with actune.compressed("u8", stats=stats.append):
        losses = actune.linear_cross_entropy(h, w, t, reduction="none")
    got = torch.autograd.grad((losses * seed).sum(), (h, w))
    assert stats[0].by_kind.get("lm_head", 0) == pytest.approx(h.numel(), rel=0.1)  # 8 bits
    for e, f in zip(exact, got, strict=True):
        assert ((f - e).norm() / e.norm()).item() < 0.02


def test_a_summed_loss_keeps_its_exact_gradients_named_and_nothing_of_the_logits():
    h = torch.randn(8, 64, 32, requires_grad=True)
    w = torch.randn(500, 32).requires_grad_()
    t = torch.randint(0, 500, (8, 64))
    stats = []
    with actune.compressed("L3", stats=stats.append):
        loss = actune.linear_cross_entropy(h, w, t)
    assert stats[0].exact == {"lm_head gradient": h.numel() * 4,
                              "lm_head weight gradient": w.numel() * 4}
    kept = stats[0].kept_bytes - stats[0].small_bytes
    assert kept == h.numel() * 4 + w.numel() * 4  # no logits, no probabilities
    expected = torch.autograd.grad(_reference(h, w, None, t, -100, "mean", None), (h, w))
    for e, f in zip(expected, torch.autograd.grad(loss, (h, w)), strict=True):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-6)


# -- Hugging Face causal LMs -----------------------------------------------------------------

def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


_SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
          "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}

MODELS = {
    "gpt2": _gpt2,  # tied head
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **_SMALL, tie_word_embeddings=False)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **_SMALL, head_dim=8, final_logit_softcapping=4.0)),  # soft-capped logits
    "cohere": lambda: transformers.CohereForCausalLM(transformers.CohereConfig(
        **_SMALL, logit_scale=0.5)),  # scaled logits
    "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(
        **_SMALL, logits_scaling=4.0)),  # logits divided by a constant
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_SMALL)),
    "phi": lambda: transformers.PhiForCausalLM(transformers.PhiConfig(  # a head with a bias
        **_SMALL, resid_pdrop=0.0, embd_pdrop=0.0)),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **{k: v for k, v in _SMALL.items() if k != "num_key_value_heads"},
        hidden_dropout=0.0, attention_dropout=0.0)),
    "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        n_layer=2, hidden_size=32, n_head=4, vocab_size=300, bos_token_id=0, eos_token_id=0,
        hidden_dropout=0.0, attention_dropout=0.0)),
}


def _step(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", list(MODELS))
def test_a_causal_lms_loss_and_gradients_are_its_own(small_chunks, family):
    torch.manual_seed(0)
    own = MODELS[family]().train()
    chunked = copy.deepcopy(own)
    assert recognised(chunked)[0] and actune.chunk_loss(chunked) == 1
    ids = torch.randint(0, 300, (3, 20))
    labels = ids.clone()
    labels[0, :5] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(41)}):
        want, expected = _step(own, ids, labels, **kwargs)
        got, found = _step(chunked, ids, labels, **kwargs)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
        assert len(found) == len(expected)
        for e, f in zip(expected, found, strict=True):
            torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-6)
        assert got.logits is None and got.past_key_values is None  # never whole; no cache
    with torch.no_grad():  # evaluation: the model's own path
        out = chunked(input_ids=ids, labels=labels)
    assert out.logits.shape == (3, 20, 300)
    torch.testing.assert_close(out.loss, own(input_ids=ids, labels=labels).loss.detach())
    assert actune.chunk_loss(chunked, on=False) == 1
    assert chunked(input_ids=ids, labels=labels).logits.shape == (3, 20, 300)


def test_compress_takes_the_loss_in_chunks_and_decompress_gives_it_back():
    torch.manual_seed(0)
    model = _gpt2().train()
    ids = torch.randint(0, 300, (4, 32))
    want, expected = _step(copy.deepcopy(model), ids, ids)
    actune.compress(model, "u8")
    assert actune.chunks_loss(model)
    got, found = _step(model, ids, ids)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-3, atol=1e-3)
    error = max(((f - e).norm() / e.norm()).item() for e, f in zip(expected, found, strict=True))
    assert error < 0.03
    actune.decompress(model)
    assert not actune.chunks_loss(model)
    assert model(input_ids=ids, labels=ids).logits is not None


def test_a_model_that_changes_its_logits_otherwise_keeps_its_own_path():
    class Biased(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden)
            logits = logits + 1.0
            return self.loss_function(logits, labels, self.config.vocab_size)

    model = Biased(transformers.LlamaConfig(**_SMALL))
    ok, why = recognised(model)
    assert not ok and "logits + 1.0" in why
    assert actune.chunk_loss(model) == 0


def test_a_lora_model_chunks_the_model_it_wraps():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = MODELS["llama"]()
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"], lora_dropout=0.0))
    ids = torch.randint(0, 300, (2, 24))
    own = copy.deepcopy(model)
    assert actune.chunk_loss(model) == 1
    want, expected = _step(own, ids, ids)
    got, found = _step(model, ids, ids)
    assert got.logits is None and len(found) == len(expected) == 28  # the adapters alone
    torch.testing.assert_close(got.loss, want.loss)
    for e, f in zip(expected, found, strict=True):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-6)


def test_the_tuners_lce_is_the_exact_level_with_the_loss_in_chunks():
    lce, l3, l0 = parse_configs("lce,L3,L3+lce,L0")  # (L3+lce is L3: one row)
    assert lce.name == "lce" and lce.level.exact and lce.chunks_loss
    assert l3.name == "L3" and l3.chunks_loss  # a compressing level has it
    assert not l0.chunks_loss and l0 == Config(actune.LEVELS["L0"])
    assert Config.from_json(lce.to_json()) == lce


def test_compiled_it_computes_every_chunk(small_chunks):
    """torch.compile traces with fake tensors, as an estimate does; an estimate computes one
    chunk (each allocates the same), a compiled call every one."""
    torch._dynamo.reset()
    h, w = torch.randn(4, 30, 16, requires_grad=True), torch.randn(100, 16, requires_grad=True)
    t = torch.randint(0, 100, (4, 30))
    want = actune.linear_cross_entropy(h, w, t)
    got = torch.compile(actune.linear_cross_entropy, backend="aot_eager")(h, w, t)
    torch.testing.assert_close(got, want)
    for e, f in zip(torch.autograd.grad(want, (h, w)), torch.autograd.grad(got, (h, w)),
                    strict=True):
        torch.testing.assert_close(f, e)


def test_compress_and_compressed_on_a_lora_model_keep_few_bytes_and_close_gradients():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (4, 64))
    model = peft.get_peft_model(MODELS["llama"](), peft.LoraConfig(
        r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"], lora_dropout=0.0))
    for p in model.parameters():  # (B starts at zero: give the adapters a gradient path)
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    _, exact = _step(copy.deepcopy(model), ids, ids)
    converted = actune.compress(copy.deepcopy(model), "u8")
    _, found = _step(converted, ids, ids)
    assert len(found) == len(exact) == 28
    error = max(((f - e).norm() / e.norm()).item() for e, f in zip(exact, found, strict=True))
    assert error < 0.05
    stats = []
    plain = copy.deepcopy(model)
    with actune.compressed("L3", stats=stats.append):
        plain(input_ids=ids, labels=ids).loss.backward()
    assert stats[0].ratio > 6  # (9.6x here)


def test_a_compiled_causal_lm_takes_its_loss_in_chunks_in_one_graph():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = _gpt2().train()
    ids = torch.randint(0, 300, (4, 32))
    want, exact = _step(copy.deepcopy(model), ids, ids)
    actune.chunk_loss(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        got, found = _step(compiled, ids, ids)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss)
    for e, f in zip(exact, found, strict=True):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-6)
