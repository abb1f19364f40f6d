"""nn.MultiheadAttention under compressed(): its usual path computed as its calls
(actune.substitutes.multihead), each routed by its rule, in eager and in the traced rules."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch._dynamo.utils import counters

import actune
from actune.substitutes.multihead import decompose


def _calls(module: nn.MultiheadAttention, *inputs, **kwargs):
    """What ``module(*inputs, **kwargs)`` passes to F.multi_head_attention_forward."""
    seen = []

    def spy(*args, **kw):
        seen.append((args, kw))
        return real(*args, **kw)

    real = F.multi_head_attention_forward
    from torch.nn.modules import activation

    activation.F.multi_head_attention_forward = spy
    try:
        out = module(*inputs, **kwargs)[0]
    finally:
        activation.F.multi_head_attention_forward = real
    return out, seen[0]


@pytest.mark.parametrize(("batch_first", "causal", "cross", "separate"), [
    (True, False, False, False), (False, True, False, False), (True, False, True, False),
    (True, False, True, True)])
def test_the_decomposition_is_pytorchs_value(batch_first, causal, cross, separate):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(32, 4, batch_first=batch_first,
                              kdim=24 if separate else None, vdim=24 if separate else None)
    q = torch.randn(3, 7, 32)
    kv = torch.randn(3, 5, 24 if separate else 32) if cross else q
    mask = nn.Transformer.generate_square_subsequent_mask(7) if causal else None
    ref, (args, kwargs) = _calls(m, q, kv, kv, need_weights=False, attn_mask=mask,
                                 is_causal=causal)
    out, weights = decompose(args, kwargs)
    assert weights is None
    assert torch.allclose(out.transpose(0, 1) if batch_first else out, ref, atol=1e-6)


@pytest.mark.parametrize("average", [True, False])
def test_with_the_weights_too(average):
    """``need_weights=True`` (the module's default): the weights' own products and softmax,
    as PyTorch's code computes them."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(32, 4, batch_first=True)
    q = torch.randn(3, 7, 32)
    ref, ref_weights = m(q, q, q, average_attn_weights=average)
    _, (args, kwargs) = _calls(m, q, q, q, average_attn_weights=average)
    out, weights = decompose(args, kwargs)
    assert torch.allclose(out.transpose(0, 1), ref, atol=1e-6)
    assert weights.shape == ref_weights.shape and torch.allclose(weights, ref_weights, atol=1e-6)


def _masks(case: str, bsz=3, heads=4, tgt=7, src=7):
    gen = torch.Generator().manual_seed(3)
    padding = torch.zeros(bsz, src, dtype=torch.bool)
    padding[0, -2:] = True  # the first sequence's last two keys are padding
    bias = torch.randn(bsz * heads, tgt, src, generator=gen).requires_grad_()
    causal = nn.Transformer.generate_square_subsequent_mask(tgt)
    return {
        "bool_mask": {"attn_mask": torch.rand(tgt, src, generator=gen) > 0.8},
        # WavLM's gated relative position bias: per head, with a gradient of its own
        "learned_bias": {"attn_mask": bias},
        "padding": {"key_padding_mask": padding},
        "bias_and_padding": {"attn_mask": bias, "key_padding_mask": padding},
        "float_padding": {"key_padding_mask": torch.where(padding, -1e4, 0.0)},
        "causal_and_padding": {"attn_mask": causal, "is_causal": True,
                               "key_padding_mask": padding},
    }[case]


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("case", ["bool_mask", "learned_bias", "padding", "bias_and_padding",
                                  "float_padding", "causal_and_padding"])
def test_masks_are_merged_as_pytorch_merges_them(case, need_weights):
    """An attention mask (boolean, or additive with a gradient: WavLM's position bias) and a
    key padding mask, alone or together: PyTorch's output, weights and gradients, the mask's
    included (these calls ran PyTorch's own code, everything in it kept exact)."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(32, 4)
    q = torch.randn(7, 3, 32, requires_grad=True)
    masks = _masks(case)

    def run(fn):
        out, weights = fn(q, q, q, 32, 4, m.in_proj_weight, m.in_proj_bias, None, None,
                          False, 0.0, m.out_proj.weight, m.out_proj.bias, training=True,
                          need_weights=need_weights, **masks)
        loss = out.square().sum() + (0 if weights is None else weights.square().sum())
        leaves = [q, m.in_proj_weight, *(t for t in masks.values()
                                         if isinstance(t, torch.Tensor) and t.requires_grad)]
        return out, weights, torch.autograd.grad(loss, leaves)

    ref = run(F.multi_head_attention_forward)
    got = run(lambda *args, **kwargs: decompose(args, kwargs))
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    assert (got[1] is None) == (ref[1] is None)
    if ref[1] is not None:
        torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    for g, r in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_other_paths_are_pytorchs_own():
    """A mask of a shape PyTorch's code rejects, ``bias_k``: its own code (and its error)."""
    m = nn.MultiheadAttention(32, 4, batch_first=True)
    q = torch.randn(3, 7, 32)
    for kwargs in ({"attn_mask": torch.zeros(5, 7, 7)},
                   {"key_padding_mask": torch.zeros(3, 6, dtype=torch.bool)}):
        args = (q.transpose(0, 1),) * 3 + (32, 4, m.in_proj_weight, m.in_proj_bias, None,
                                            None, False, 0.0, m.out_proj.weight,
                                            m.out_proj.bias)
        assert decompose(args, kwargs) is None
    m = nn.MultiheadAttention(32, 4, batch_first=True, add_bias_kv=True)
    _, (args, kw) = _calls(m, q, q, q)
    assert decompose(args, kw) is None


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_an_encoder_layer_keeps_nothing_of_its_attention_exact(dropout):
    """PyTorch's TransformerEncoderLayer: its attention was one call to the mode, everything
    inside it saved exact (ratio 2.5x at dropout 0, 1.9x at 0.1 on a 128-wide layer)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=dropout, batch_first=True)
    x = torch.randn(8, 32, 64)
    stats = []
    with actune.compressed("L3", stats=stats.append):
        out = layer(x)
    out.square().mean().backward()
    assert "multi_head_attention_forward" not in stats[0].exact, stats[0].exact
    assert stats[0].ratio > 6


def test_eight_bits_close_to_exact_in_both_forms():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    x = torch.randn(8, 32, 64)
    layer(x).square().mean().backward()
    exact = torch.cat([p.grad.flatten() for p in layer.parameters()])
    for compile_ in (False, True):
        layer.zero_grad()
        run = torch.compile(layer, backend="aot_eager") if compile_ else layer
        torch._dynamo.reset()
        counters.clear()
        with actune.compressed("u8"):
            out = run(x)
        out.square().mean().backward()
        got = torch.cat([p.grad.flatten() for p in layer.parameters()])
        assert (got - exact).norm() <= 0.03 * exact.norm(), compile_
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_the_causal_hint_without_its_mask_still_raises_as_pytorchs():
    m = nn.MultiheadAttention(32, 4, batch_first=True)
    q = torch.randn(3, 7, 32)
    with actune.compressed("L3"), pytest.raises(RuntimeError, match="Need attn_mask"):
        m(q, q, q, need_weights=False, is_causal=True)


def test_a_module_called_with_its_defaults_keeps_little_exact():
    """``mha(x, x, x)`` returns the weights (need_weights defaults to True): compressed too."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True)
    x = torch.randn(8, 32, 64)
    stats = []
    with actune.compressed("L3", stats=stats.append):
        out, weights = m(x, x, x)
    (out.square().mean() + weights.square().mean()).backward()
    assert "multi_head_attention_forward" not in stats[0].exact, stats[0].exact
    assert stats[0].ratio > 6, stats[0]
