"""The traced rules (what runs inside torch.compile graphs), run eagerly: gradients per family
close to exact at 8 bits and unbiased at 2, and the packing itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from actune.levels import Level
from actune.traced import TracedMode, pack, unpack
from actune.traced.pack import in_memory_order, memory_order, pack_range, unpack_range


def _level(bits: int) -> Level:
    """Every width at ``bits`` but attention's q and k (read nonlinearly) at 8."""
    return Level(f"t{bits}", matmul_bits=bits, other_bits=bits, nonlinear_bits=8, masks=True,
                 min_numel=1)


def _activations(inputs):
    """The inputs with the activations (2+ dims, not a weight) through ``* 1``: what the
    rules see in a model (weights stay leaves)."""
    return [t * 1 if t.dim() >= 2 and not getattr(t, "weight", False) else t for t in inputs]


def _grads(fn, inputs, level, draws, seed=0):
    """Gradients of ``sum(fn(*inputs) * g)`` under the traced rules, ``draws`` times."""
    with torch.no_grad():
        g = torch.randn(fn(*inputs).shape, generator=torch.Generator().manual_seed(5))
    out = []
    for s in range(draws):
        torch.manual_seed(seed + s)
        with TracedMode(level):
            y = fn(*_activations(inputs))
        out.append(torch.autograd.grad(y, inputs, g))
    return [torch.stack([d[i] for d in out]) for i in range(len(inputs))]


def _exact(fn, inputs):
    with torch.no_grad():
        g = torch.randn(fn(*inputs).shape, generator=torch.Generator().manual_seed(5))
    return torch.autograd.grad(fn(*inputs), inputs, g)


def _case(name):
    gen = torch.Generator().manual_seed(1)

    def r(*shape, weight=False):
        t = torch.randn(*shape, generator=gen).requires_grad_()
        t.weight = weight
        return t
    if name == "linear":
        return (lambda x, w, b: F.linear(x, w, b)), (r(4, 64, 32), r(48, 32, weight=True),
                                                     r(48))
    if name == "addmm":
        return (lambda b, x, w: torch.addmm(b, x, w)), (r(48), r(256, 32),
                                                        r(32, 48, weight=True))
    if name == "product":
        return (lambda a, b: a @ b), (r(2, 4, 64, 32), r(2, 4, 32, 64))
    if name == "gelu":
        return (lambda x: F.gelu(x)), (r(8, 512),)
    if name == "gelu_tanh":
        return (lambda x: F.gelu(x, approximate="tanh")), (r(8, 512),)
    if name == "silu":
        return (lambda x: F.silu(x)), (r(8, 512),)
    if name == "hardswish":
        return (lambda x: F.hardswish(x * 3)), (r(8, 512),)
    if name == "hardswish_inplace":
        return (lambda x: F.hardswish(x * 3, inplace=True)), (r(8, 512),)
    if name == "hardsigmoid_inplace":
        return (lambda x: F.hardsigmoid(x * 4, True)), (r(8, 300),)
    if name == "mish":
        return (lambda x: F.mish(x * 2)), (r(8, 512),)
    if name in ("elu", "selu", "softplus", "logsigmoid", "softsign", "tanhshrink"):
        return getattr(F, name), (r(8, 512),)
    if name == "elu_inplace":
        return (lambda x: F.elu(x * 1, inplace=True)), (r(8, 512),)
    if name == "relu6":
        return (lambda x: F.relu6(x * 4)), (r(8, 300),)
    if name == "hardtanh":
        return (lambda x: F.hardtanh(x, -0.5, 0.7)), (r(8, 300),)
    if name == "hardsigmoid":
        return (lambda x: F.hardsigmoid(x * 4)), (r(8, 300),)
    if name == "leaky_relu":
        return (lambda x: F.leaky_relu(x, 0.2)), (r(8, 300),)
    if name == "layer_norm":
        return (lambda x, w, b: F.layer_norm(x, (64,), w, b)), (r(4, 64, 64), r(64), r(64))
    if name == "rms_norm":
        return (lambda x, w: F.rms_norm(x, (64,), w, 1e-6)), (r(4, 64, 64), r(64))
    if name == "softmax":
        return (lambda x: torch.softmax(x, -1)), (r(4, 64, 64),)
    if name == "mul":
        return (lambda a, b: a * b), (r(8, 64, 32), r(8, 64, 32))
    if name == "attention_map":  # (the product keeps the softmax's first copy)
        return _attention_map, (r(2, 4, 32, 16), r(2, 4, 32, 16), r(2, 4, 32, 16))
    if name == "sdpa_causal_gqa":
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True)), \
            (r(2, 4, 32, 16), r(2, 2, 32, 16), r(2, 2, 32, 16))
    if name == "sdpa_mask":
        mask = torch.randn(1, 1, 32, 32, generator=gen)
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), \
            (r(2, 4, 32, 16), r(2, 4, 32, 16), r(2, 4, 32, 16))
    if name == "cross_entropy":
        target = torch.randint(0, 40, (256,), generator=gen)
        target[:7] = -100
        return (lambda x: F.cross_entropy(x, target)), (r(256, 40),)
    if name == "cross_entropy_pixels":  # (a segmentation's (N, C, H, W) logits)
        target = torch.randint(0, 10, (4, 8, 8), generator=gen)
        target[:, 0] = -100
        return (lambda x: F.cross_entropy(x, target)), (r(4, 10, 8, 8),)
    if name == "conv":
        return (lambda x, w, b: F.conv2d(x, w, b, 1, 1)), \
            (r(4, 3, 16, 16), r(8, 3, 3, 3, weight=True), r(8))
    if name == "conv_channels_last":  # (packed in memory order, unpacked in that layout)
        return (lambda x, w, b: F.conv2d(_channels_last(x), w, b, 1, 1)), \
            (r(4, 3, 16, 16), r(8, 3, 3, 3, weight=True), r(8))
    if name == "relu":
        return (lambda x: F.relu(x)), (r(8, 300),)
    if name == "relu_channels_last":
        return (lambda x: F.relu(_channels_last(x))), (r(2, 5, 6, 7),)
    if name == "relu_inplace":  # (nn.ReLU(inplace=True)): the result written over its input
        return (lambda x: F.relu(x * 1, inplace=True)), (r(8, 300),)
    if name == "relu_":
        return (lambda x: torch.relu_(x * 1)), (r(8, 300),)
    if name == "batch_norm":
        return (lambda x, w, b: F.batch_norm(x, None, None, w, b, True)), \
            (r(8, 4, 8, 8), r(4), r(4))
    if name == "batch_norm_channels_last":
        return (lambda x, w, b: F.batch_norm(_channels_last(x), None, None, w, b, True)), \
            (r(8, 4, 8, 8), r(4), r(4))
    if name == "vector_norm":  # (ConvNeXt V2's global response norm)
        return (lambda x: torch.linalg.vector_norm(x, 2, dim=(1, 2), keepdim=True)), \
            (r(4, 8, 8, 32),)
    if name == "vector_norm_rows":
        return (lambda x: torch.linalg.vector_norm(x, dim=-1)), (r(16, 64),)
    if name == "normalize":
        return (lambda x: F.normalize(x, dim=-1)), (r(16, 64),)
    if name == "grid_sample":  # (a grid mostly inside the input: -1 to 1)
        return (lambda x, g: F.grid_sample(x, g * 0.5, align_corners=False)), \
            (r(2, 4, 10, 12), r(2, 5, 7, 2))
    if name == "grid_sample_3d":
        return (lambda x, g: F.grid_sample(x, g * 0.5, padding_mode="border",
                                           align_corners=True)), \
            (r(2, 3, 5, 6, 7), r(2, 4, 5, 3, 3))
    raise KeyError(name)


def _attention_map(q, k, v):
    return F.dropout(torch.softmax(q @ k.transpose(-2, -1), -1), 0.0, True) @ v


def _channels_last(x):
    return x.contiguous(memory_format=torch.channels_last)


CASES = ("linear", "addmm", "product", "gelu", "gelu_tanh", "silu", "hardswish",
         "hardswish_inplace", "mish", "elu", "elu_inplace", "selu", "softplus", "logsigmoid",
         "softsign", "tanhshrink", "relu6", "hardtanh", "hardsigmoid", "hardsigmoid_inplace",
         "leaky_relu", "layer_norm", "rms_norm",
         "softmax", "mul", "attention_map", "sdpa_causal_gqa", "sdpa_mask", "cross_entropy",
         "cross_entropy_pixels", "conv",
         "conv_channels_last", "relu", "relu_channels_last", "relu_inplace", "relu_",
         "batch_norm", "batch_norm_channels_last", "vector_norm", "vector_norm_rows",
         "normalize", "grid_sample", "grid_sample_3d")


@pytest.mark.parametrize("name", CASES)
def test_eight_bits_close_to_exact(name):
    fn, inputs = _case(name)
    exact = _exact(fn, inputs)
    got = _grads(fn, inputs, _level(8), draws=1)
    for e, s in zip(exact, got, strict=True):
        assert (s[0] - e).norm() <= 0.03 * e.norm() + 1e-6


@pytest.mark.parametrize("name", CASES)
def test_two_bits_unbiased(name):
    """The mean of K draws approaches the exact gradient like 1/sqrt(K): its error at 64
    draws is well below that at 4 (a biased rule stalls at its bias)."""
    fn, inputs = _case(name)
    exact = _exact(fn, inputs)
    draws = _grads(fn, inputs, _level(2), draws=64)
    for e, d in zip(exact, draws, strict=True):
        few = (d[:4].mean(0) - e).norm()
        many = (d.mean(0) - e).norm()
        if few <= 1e-5 * e.norm():  # a gradient that reads no rounded tensor: exact
            assert many <= 1e-4 * e.norm()
            continue
        assert many < 0.5 * few, (name, float(few), float(many))


def test_the_rules_run_where_they_apply():
    """Each case runs through its autograd function (not PyTorch's op)."""
    for name in CASES:
        fn, inputs = _case(name)
        with TracedMode(_level(2)):
            y = fn(*_activations(inputs))
        node = y.grad_fn
        # in place: the copy over the input, then the rule
        if name in ("relu_inplace", "relu_", "hardswish_inplace", "hardsigmoid_inplace",
                    "elu_inplace"):
            assert type(node).__name__ == "CopyBackwards", name
            node = next(f for f, _ in node.next_functions if f is not None
                        and type(f).__name__.startswith(("Masked", "Packed", "TwoSlopes")))
        assert type(node).__name__.startswith(("Packed", "TwoCopy", "TwoSlopes", "Gated",
                                               "Masked")), \
            (name, type(node).__name__)


def test_leaves_and_small_tensors_keep_the_op():
    x = torch.randn(4, 8, requires_grad=True)
    with TracedMode(Level("t2", matmul_bits=2, other_bits=2, min_numel=1024)):
        assert type(F.gelu(x * 1).grad_fn).__name__ == "GeluBackward0"  # too small
    with TracedMode(_level(2)):
        assert type(F.gelu(x).grad_fn).__name__ == "GeluBackward0"  # a leaf
    y = torch.randn(8, 512, requires_grad=True)
    with TracedMode(_level(2)):  # parameters other than the defaults the grids are made for
        assert type(F.elu(y * 1, 0.5).grad_fn).__name__ == "EluBackward0"
        assert type(F.softplus(y * 1, beta=2.0).grad_fn).__name__ == "SoftplusBackward0"


@pytest.mark.parametrize("kernels", [False, True], ids=["torch_ops", "numba_op"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("by_feature", [False, True])
def test_pack_round_trip_within_a_step_and_unbiased(bits, by_feature, kernels):
    """Both forms of the compiled pack (torch ops Inductor fuses; the Numba kernels as one
    op, the CPU's default): within a group's step of the input, and unbiased."""
    x = torch.randn(300, 40, generator=torch.Generator().manual_seed(0)) * 3
    torch.manual_seed(0)
    step = pack(x, bits, 64, by_feature, kernels=False).step.max()  # (the groups' steps)
    p = pack(x, bits, 64, by_feature, kernels)
    assert (p.step is None) == kernels
    assert p.codes.dtype == torch.uint8 and p.codes.numel() * 8 == p.low.numel() * 64 * bits
    y = unpack(p, bits, x.shape, x.dtype, 64, by_feature)
    assert y.shape == x.shape
    assert (y - x).abs().max() <= step * 1.01  # (the kernels keep a step rounded up a little)
    mean = torch.stack([unpack(pack(x, bits, 64, by_feature, kernels), bits, x.shape, x.dtype,
                               64, by_feature) for _ in range(64)]).mean(0)
    assert (mean - x).abs().mean() < 0.25 * (y - x).abs().mean() + 1e-6


def test_the_cpu_packs_through_the_kernels_where_they_run():
    """float32 on the CPU: the Numba op (flat, and by feature with features a multiple of
    8); by feature with 12 features, or bfloat16: the torch ops."""
    x = torch.randn(64, 16)
    assert pack(x, 2, 64).step is None and pack(x, 2, 64, True).step is None
    assert pack(x[:, :12].contiguous(), 2, 64, True).step is not None
    assert pack(x.bfloat16(), 2, 64).step is not None


def test_pack_range_on_a_fixed_grid():
    x = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 1.2 - 0.1
    codes = pack_range(x, 2, -0.1, 1.1)
    assert codes.numel() == 256  # 1,024 padded elements, four a byte
    y = unpack_range(codes, 2, -0.1, 1.1, x.shape, x.dtype)
    assert (y - x).abs().max() <= 0.4 + 1e-6
    mean = torch.stack([unpack_range(pack_range(x, 2, -0.1, 1.1), 2, -0.1, 1.1, x.shape,
                                     x.dtype) for _ in range(256)]).mean(0)
    assert (mean - x).abs().mean() < 0.02


def test_batch_norm_updates_running_statistics_as_pytorch():
    x = torch.randn(8, 4, 8, 8, generator=torch.Generator().manual_seed(3)) * 2 + 1
    ours, theirs = [(torch.zeros(4), torch.ones(4)) for _ in range(2)]
    w = torch.ones(4, requires_grad=True)
    with TracedMode(_level(2)):
        y = F.batch_norm(x * w.view(1, -1, 1, 1), *ours, w, None, True, 0.1)
    ref = F.batch_norm(x * w.view(1, -1, 1, 1), *theirs, w, None, True, 0.1)
    assert type(y.grad_fn).__name__.startswith("PackedBatchNorm")
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


def test_bits_round_trip():
    from actune.traced.convolutions import pack_bits, unpack_bits
    m = torch.rand(3, 77, generator=torch.Generator().manual_seed(0)) > 0.5
    p = pack_bits(m)
    assert p.dtype == torch.uint8 and p.numel() == -(-m.numel() // 8)
    assert torch.equal(unpack_bits(p, m.shape), m)
    # a channels-last mask: packed in memory order, read back with its strides
    c = (torch.rand(2, 5, 3, 7, generator=torch.Generator().manual_seed(1)) > 0.5) \
        .contiguous(memory_format=torch.channels_last)
    order = memory_order(c)
    assert order == (0, 2, 3, 1)
    back = unpack_bits(pack_bits(c), c.shape, order)
    assert torch.equal(back, c) and back.stride() == c.stride()
    from actune.packing import (
        graph_ops as quant_graph,  # (the CPU's opaque unpack: schema, fake, tracing)
    )
    torch.library.opcheck(quant_graph.graph_unpack_bits, (p, m.numel()))


@pytest.mark.parametrize("kernels", [False, True])
def test_a_channels_last_tensor_is_packed_in_memory_order(kernels):
    """No copy to pack it, and its values back in its own layout (a layout mix between the
    unpacked tensor and the convolution's gradient made Inductor transpose between them)."""
    x = torch.randn(4, 16, 5, 5, generator=torch.Generator().manual_seed(2)) \
        .contiguous(memory_format=torch.channels_last)
    order = memory_order(x)
    view = in_memory_order(x, order)
    assert view.is_contiguous() and view.data_ptr() == x.data_ptr()
    y = unpack(pack(view, 8, 64, kernels=kernels), 8, x.shape, x.dtype, 64, order=order)
    assert y.stride() == x.stride()
    assert (y - x).abs().max() <= (x.max() - x.min()) / 255 + 1e-6
    assert memory_order(torch.randn(3, 4)) is None  # contiguous: as it is
    assert memory_order(torch.randn(4, 6)[:, ::2]) is None  # not dense: copied to pack


def test_the_graphs_random_stream_is_the_kernels():
    """The pack's uniform numbers are the Numba kernels' counter-based stream (the same
    32-bit hash of index and key, 24 bits kept), the key drawn from torch's generator."""
    import numba
    import numpy as np

    from actune.traced.pack import uniform
    from actune_kernels.scalar import random24_u32

    torch.manual_seed(3)
    u = uniform(torch.empty(3, 1000))
    torch.manual_seed(3)
    key = np.uint32(int(torch.randint(0, 2**31, (), dtype=torch.int32)))
    stream = numba.njit(random24_u32)
    ref = np.array([stream(key, np.uint32(i)) for i in range(3000)]) / 2**24
    assert np.array_equal(u.flatten().numpy(), ref.astype(np.float32))
    assert abs(u.mean().item() - 0.5) < 0.02 and u.min() >= 0 and u.max() < 1


def test_attention_dropout_replays_its_mask_in_backward(monkeypatch):
    """With dropout the traced attention draws its mask from a key and draws it again in
    backward: at 8 bits its gradients are those of the same masked attention computed exactly,
    at 2 bits their mean over rounding draws approaches them (a fixed key here)."""
    import actune.traced.attention as attention

    key = torch.tensor(12345)
    monkeypatch.setattr(attention, "random_key", lambda device: key)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=gen).requires_grad_() for _ in range(3))
    g = torch.randn(2, 4, 32, 16, generator=torch.Generator().manual_seed(5))  # as _grads's

    def fn(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, dropout_p=0.25, is_causal=True)

    exact = torch.autograd.grad(attention._dropped(attention._map(q, k, None, True, 0.25), key,
                                                   0.25) @ v, (q, k, v), g)
    dropped = attention._dropped(torch.ones(2, 4, 32, 32), key, 0.25)
    assert 0.2 < (dropped == 0).float().mean() < 0.3  # a quarter of the map dropped
    eight = _grads(fn, (q, k, v), _level(8), draws=1)
    for e, s in zip(exact, eight, strict=True):
        assert (s[0] - e).norm() <= 0.03 * e.norm()
    two = _grads(fn, (q, k, v), _level(2), draws=64)
    for e, d in zip(exact, two, strict=True):
        assert (d.mean(0) - e).norm() < 0.5 * (d[:4].mean(0) - e).norm()


@pytest.mark.parametrize("by_feature", [False, True])
def test_the_graph_ops_pass_opcheck(by_feature):
    """The Numba ops a compiled graph calls: schema, fake shapes against real ones, and
    tracing (``torch.library.opcheck``)."""
    from actune.packing import graph_ops as quant_graph

    x = torch.randn(100, 24, dtype=torch.float64)
    key = torch.tensor(7)
    torch.library.opcheck(quant_graph.graph_pack, (x, 4, 64, by_feature, key))
    codes, meta = quant_graph.graph_pack(x, 4, 64, by_feature, key)
    torch.library.opcheck(quant_graph.graph_unpack,
                          (codes, meta, 4, 64, by_feature, [100, 24], torch.float32))
    # float64 packed, unpacked as float32 and as bfloat16 (not a dtype the kernels write):
    # the same values, rounded to the dtype asked for
    wide = quant_graph.graph_unpack(codes, meta, 4, 64, by_feature, [100, 24], torch.float32)
    narrow = quant_graph.graph_unpack(codes, meta, 4, 64, by_feature, [100, 24],
                                      torch.bfloat16)
    assert wide.shape == narrow.shape == x.shape and narrow.dtype == torch.bfloat16
    assert torch.equal(narrow, wide.to(torch.bfloat16))
    assert (wide.double() - x).abs().max() <= (x.max() - x.min()) / 15


def test_a_softmax_output_read_by_a_product_is_packed_twice_not_three_times(monkeypatch):
    """As in eager, the product reading a softmax's output (through a dropout that drops
    nothing) keeps the softmax's first copy instead of packing a third."""
    import actune.traced.functions as functions

    shapes = []

    def counting(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return pack(x, *args, **kwargs)

    monkeypatch.setattr(functions, "pack", counting)
    _, inputs = _case("attention_map")
    with TracedMode(_level(2)):
        _attention_map(*_activations(inputs)).sum().backward()
    assert shapes.count((2, 4, 32, 32)) == 2 and len(shapes) == 5, shapes
    shapes.clear()
    with TracedMode(_level(2)):  # (a dropout that drops: a new map, packed for the product)
        (F.dropout(torch.softmax(inputs[0] * 1, -1), 0.5, True) @ inputs[1].transpose(-2, -1)
         ).sum().backward()
    assert shapes.count((2, 4, 32, 16)) == 3, shapes


def test_dropout_keeps_a_key_and_draws_its_mask_again():
    """In training a dropout keeps only a key: backward draws the same mask (zero where the
    output is, scaled by 1 / (1 - p) elsewhere); about 1 - p of the entries kept."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).requires_grad_()
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    saved = []

    def keep(t):
        saved.append(t)
        return t

    torch.manual_seed(0)
    with TracedMode(_level(2)), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        y = F.dropout(x * 1, 0.3, True)
    (gx,) = torch.autograd.grad(y, x, g)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.01
    assert torch.equal(y, torch.where(kept, x / 0.7, 0))
    assert torch.allclose(gx, torch.where(kept, g / 0.7, 0))
    assert all(t.numel() == 1 for t in saved), [tuple(t.shape) for t in saved]


@pytest.mark.parametrize("call", ["linear", "addmm", "matmul"])
def test_a_frozen_weight_keeps_the_op(call):
    # PyTorch's own op keeps no input where the weight takes no gradient (a LoRA model's
    # base): packing one would cost memory and time for a gradient nobody computes
    w = torch.randn(48, 32) if call == "linear" else torch.randn(32, 48)  # (as layers hold it)
    x = torch.randn(256, 32, requires_grad=True) * 1
    calls = {"linear": lambda: F.linear(x, w), "addmm": lambda: torch.addmm(
        torch.zeros(48), x, w), "matmul": lambda: x @ w}
    with TracedMode(_level(2)):
        frozen = calls[call]()
        w.requires_grad_()
        trained = calls[call]()
    assert not type(frozen.grad_fn).__name__.startswith("Packed")
    assert type(trained.grad_fn).__name__.startswith("Packed")


def test_a_batch_norm_of_features_is_packed_by_feature():
    """A ``[batch, features]`` batch norm input with offsets 40x its spread: packed one feature
    a group, as eager packs it, its input gradient at 4 bits stays close to exact (grouped by
    rows, its neighbours' offsets would set every group's grid)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 64, generator=gen) * 0.5
         + torch.randn(64, generator=gen) * 20).requires_grad_()
    w = torch.rand(64, generator=gen).add(0.5).requires_grad_()

    def fn(x, w):
        return F.batch_norm(x, None, None, w, None, training=True)

    exact = _exact(fn, (x, w))
    draws = _grads(fn, (x, w), _level(4), 4)
    assert ((draws[0].mean(0) - exact[0]).norm() / exact[0].norm()).item() < 0.03
