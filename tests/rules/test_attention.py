"""Attention: F.scaled_dot_product_attention with masks, the causal flag, dropout and GQA
keeps v rounded (unbiased), q and k exact or at nonlinear_bits, and nothing else."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import actune
from actune import tunables
from tests.rules.helpers import exact_grads, input_grads, level, relative_error, shrinks_like_noise


def qkv(heads=4, kv_heads=4, seq=32, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, dim, generator=gen)
    k = torch.randn(2, kv_heads, seq, dim, generator=gen)
    v = torch.randn(2, kv_heads, seq, dim, generator=gen)
    return tuple(t.requires_grad_() for t in (q, k, v))


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "bool_mask": {"attn_mask": torch.rand(32, 32, generator=torch.Generator().manual_seed(1))
                  > 0.3},
    "float_mask": {"attn_mask": torch.randn(2, 1, 32, 32,
                                            generator=torch.Generator().manual_seed(2))},
    "scale": {"scale": 0.3},
    "gqa": {"enable_gqa": True},
}


def attention(kwargs):
    return lambda q, k, v: F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_unbiased_with_exact_q_k_and_rounded_v(case):
    inputs = qkv(kv_heads=2 if case == "gqa" else 4)
    fn = attention(CASES[case])
    exact = exact_grads(fn, inputs)
    got = input_grads(fn, inputs, level(2), 256)
    for name, g, e in zip("qkv", got, exact, strict=True):
        if name == "v":  # v's gradient, P^T g, does not read v: exact
            assert relative_error(g[0], e[0]) < 1e-5
            continue
        assert relative_error(g[0], e[0]) > 1e-3, name  # v was rounded
        assert shrinks_like_noise(g, e[0], small=8, large=256) < 0.25, name


@pytest.mark.parametrize("bits", [4, 8])
def test_q_and_k_at_nonlinear_bits_are_close(bits):
    inputs = qkv()
    fn = attention({"is_causal": True})
    exact = exact_grads(fn, inputs)
    got = input_grads(fn, inputs, level(8, nonlinear_bits=bits), 1)
    for g, e in zip(got, exact, strict=True):
        assert relative_error(g[0], e[0]) < (0.02 if bits == 8 else 0.3)


def test_dropout_off_the_cpu_is_replayed_in_the_recomputation(monkeypatch):
    # (CUDA's path, taken here by declaring the CPU unable to draw masks itself)
    monkeypatch.setattr("actune.rules.attention.drawn_here", lambda t: False)
    inputs = qkv()
    fn = attention({"dropout_p": 0.3})
    torch.manual_seed(7)
    exact = torch.autograd.grad(fn(*inputs).sum(), inputs)
    torch.manual_seed(7)
    with actune.compressed(level(8, nonlinear_bits=8)):
        y = fn(*inputs)
    torch.manual_seed(99)  # the stream moved on: the recomputation must not read it
    got = torch.autograd.grad(y.sum(), inputs)
    for g, e in zip(got, exact, strict=True):
        assert relative_error(g, e) < 0.02


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("case", [*CASES, "bias"])
def test_dropout_on_the_cpu_is_pytorchs_math_with_a_mask_drawn_again(case, sliced,
                                                                     monkeypatch):
    import actune.rules.attention as rule

    if sliced:  # one sample's maps at a time, forward and backward
        monkeypatch.setattr(tunables, "ATTENTION_MAP_SLICE", 4 * 32 * 32)
    inputs = qkv(kv_heads=2 if case == "gqa" else 4)
    kwargs = dict(CASES.get(case, {}), dropout_p=0.3)
    if case == "bias":
        kwargs["attn_mask"] = torch.randn(4, 32, 32, requires_grad=True)
        inputs = (*inputs, kwargs["attn_mask"])
    masks = []
    sliced_calls = []
    rule_math = rule._math
    monkeypatch.setattr(rule, "_math", lambda *a, **k: sliced_calls.append(a[0].shape[0])
                        or rule_math(*a, **k))

    def spied(*args):
        masks.append(rule_keep(*args))
        return masks[-1]

    rule_keep = rule.keep_mask
    monkeypatch.setattr(rule, "keep_mask", spied)
    g = torch.randn(2, 4, 32, 16, generator=torch.Generator().manual_seed(3))
    with actune.compressed(level(8, nonlinear_bits=8)):
        y = F.scaled_dot_product_attention(*(t * 1.0 for t in inputs[:3]), **kwargs)
    torch.manual_seed(99)  # the torch stream does not matter: the mask is drawn from a seed
    got = torch.autograd.grad(y, inputs, g)
    assert len(masks) == 2 and torch.equal(masks[0], masks[1])  # drawn again in backward
    assert sliced_calls == ([1, 1, 1, 1] if sliced and case != "bias" else [2, 2])
    assert 0.65 < masks[0].float().mean() < 0.75
    math = dict(kwargs, dropout_mask=masks[0])
    math.pop("dropout_p")
    if case == "bool_mask":  # (the math op adds its mask: PyTorch's front end converts it)
        math["attn_mask"] = torch.zeros(32, 32).masked_fill(~kwargs["attn_mask"], -torch.inf)
    ref = torch.ops.aten._scaled_dot_product_attention_math(*inputs[:3], dropout_p=0.3,
                                                            **math)[0]
    assert relative_error(y, ref) < 1e-5  # the forward: exact
    exact = torch.autograd.grad(ref, inputs, g)
    for gq, e in zip(got, exact, strict=True):  # backward: q, k, v at 8 bits
        assert relative_error(gq, e) < 0.02


def test_keeps_only_packed_q_k_v():
    inputs = qkv(seq=64)
    st = []
    with actune.compressed("L3", stats=st.append):
        y = attention({"is_causal": True})(*inputs)
    y.sum().backward()
    s = st[0]
    assert s.exact == {}
    assert set(s.by_kind) == {"attention q/k", "attention v"}
    # PyTorch keeps q, k, v and the output in float32: 4 x 4 bytes an element; here q and k
    # at 8 bits and v at 2 (plus metadata)
    assert s.ratio > 6


def test_few_keys_and_values_over_many_queries_are_compressed_too():
    """Keys and values over a spatially reduced sequence (SegFormer's attention: 16 of them
    under ``min_numel``) against 1,024 queries: the rule runs, nothing stays exact, and the
    gradients are close at 8 bits (before, the small values turned the rule off and the
    queries and the output were kept exact)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 1024, 16, generator=gen).requires_grad_()
    k, v = (torch.randn(2, 1, 16, 16, generator=gen).requires_grad_() for _ in range(2))
    fn = attention({})
    st = []
    with actune.compressed("L3", stats=st.append):
        fn(q, k, v).sum().backward()
    assert st[0].exact == {}, st[0].exact
    assert {"attention q/k", "attention v"} <= set(st[0].by_kind)
    exact = exact_grads(fn, (q, k, v))
    got = input_grads(fn, (q, k, v), level(8), 1)
    for name, g, e in zip("qkv", got, exact, strict=True):
        assert relative_error(g[0], e[0]) < 0.02, name


def test_exact_q_k_are_named_in_the_statistics():
    inputs = qkv(seq=64)
    st = []
    with actune.compressed(actune.get_level("L3").with_(nonlinear_bits=None), stats=st.append):
        attention({})(*inputs).sum().backward()
    assert set(st[0].exact) == {"scaled_dot_product_attention q/k"}
    assert "(scaled_dot_product_attention q/k 64.0 KiB)" in st[0].describe_exact()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast(dtype):
    q, k, v = qkv()
    w = (torch.randn(16, 16, generator=torch.Generator().manual_seed(3)) / 4).requires_grad_()

    def step(lv):
        w.grad = None
        with torch.autocast("cpu", dtype=dtype), actune.compressed(lv):
            out = F.scaled_dot_product_attention(q @ w, k @ w, v @ w, is_causal=True)
        out.float().square().sum().backward()
        return w.grad.clone()

    exact = step("L0")
    assert relative_error(step(level(8, nonlinear_bits=8)), exact) < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dropout_under_autocast_is_the_math_op_with_the_seeded_mask(dtype, monkeypatch):
    """Under CPU autocast too the mask is drawn from a seed (nothing kept, maps a slice at a
    time); the forward is PyTorch's math op with that mask under the same autocast."""
    import actune.rules.attention as rule

    monkeypatch.setattr(tunables, "ATTENTION_MAP_SLICE", 4 * 32 * 32)
    masks = []
    draw = rule.keep_mask
    monkeypatch.setattr(rule, "keep_mask", lambda *a: masks.append(draw(*a)) or masks[-1])
    q, k, v = qkv()
    w = (torch.randn(16, 16, generator=torch.Generator().manual_seed(3)) / 4).requires_grad_()
    with torch.autocast("cpu", dtype=dtype), actune.compressed(level(8, nonlinear_bits=8)):
        out = F.scaled_dot_product_attention(q @ w, k @ w, v @ w, dropout_p=0.2)
    got = torch.autograd.grad(out.float().square().sum(), w)[0]
    assert len(masks) == 2 and torch.equal(masks[0], masks[1])
    with torch.autocast("cpu", dtype=dtype):
        ref = torch.ops.aten._scaled_dot_product_attention_math(
            q @ w, k @ w, v @ w, dropout_p=0.2, dropout_mask=masks[0])[0]
    assert relative_error(out.float(), ref.float()) < 0.02
    exact = torch.autograd.grad(ref.float().square().sum(), w)[0]
    assert relative_error(got, exact) < 0.05


@pytest.mark.parametrize("backend", ["MATH", "FLASH_ATTENTION"])
def test_every_cpu_backend(backend):
    """The CPU build picks the math or the flash kernel; both go through the rule (the CUDA
    backends are checked by scripts/gpu_check.sh)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inputs = qkv()
    fn = attention({"is_causal": True})
    with sdpa_kernel(getattr(SDPBackend, backend)):
        exact = exact_grads(fn, inputs)
        got = input_grads(fn, inputs, level(8, nonlinear_bits=8), 1)
        st = []
        with actune.compressed("L3", stats=st.append):
            fn(*inputs).sum().backward()
    for g, e in zip(got, exact, strict=True):
        assert relative_error(g[0], e[0]) < 0.02
    assert st[0].exact == {}


@pytest.mark.parametrize(("name", "bits"), [("L3", 4), ("u2", 2)])
def test_v_is_packed_at_the_levels_sensitive_bits(name, bits):
    q, k, v = qkv(seq=64)
    st = []
    with actune.compressed(name, stats=st.append):
        F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, is_causal=True)
    assert st[0].by_kind["attention v"] == v.numel() // 256 * (256 * bits // 8 + 4)


def test_small_q_k_v_are_packed_and_read_in_one_kernel_call_each_way(monkeypatch):
    from actune_kernels import cpu, cpu_segments

    calls = []
    for module, name in ((cpu, "pack_at"), (cpu, "unpack_at"), (cpu_segments, "pack_segments"),
                         (cpu_segments, "unpack_segments")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: (
            calls.append(name), real(*a, **k))[1])
    inputs = qkv()  # 4,096 elements each: under the shared call's limit
    fn = attention({"is_causal": True})
    exact = exact_grads(fn, inputs)
    got = input_grads(fn, inputs, level(8, nonlinear_bits=8), 1)
    assert calls == ["pack_segments", "unpack_segments"]
    for g, e in zip(got, exact, strict=True):
        assert relative_error(g[0], e[0]) < 0.02
    calls.clear()
    big = qkv(seq=128)  # 16,384 elements each: a call each, no shared copy
    input_grads(fn, big, level(8, nonlinear_bits=8), 1)
    assert sorted(calls) == ["pack_at"] * 3 + ["unpack_at"] * 3


# -- a learned additive bias (attn_mask that requires grad: a relative position bias) -------

MIN = torch.finfo(torch.float32).min


def biases(seq=32, seed=3):
    """A parameter broadcast over the batch, the dense bias a model builds from one per call
    (causal entries at the dtype's minimum, as Hugging Face's ``where`` writes them), and one
    broadcast over the heads."""
    param = torch.randn(1, 4, seq, seq, generator=torch.Generator().manual_seed(seed))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return {
        "parameter": lambda p: p,
        "dense_causal": lambda p: torch.where(causal, p.expand(2, 4, seq, seq), MIN),
        "per_head_broadcast": lambda p: p[:, :1].expand(2, 1, seq, seq) * 1.0,
    }, param.requires_grad_()


def biased(make):
    return lambda q, k, v, p: F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0,
                                                             attn_mask=make(p))


@pytest.mark.parametrize("case", ["parameter", "dense_causal", "per_head_broadcast"])
def test_learned_bias_gradient_is_unbiased_and_close_at_8_bits(case):
    makes, param = biases()
    inputs = (*qkv(), param)
    fn = biased(makes[case])
    exact = exact_grads(fn, inputs)
    close = input_grads(fn, inputs, level(8, nonlinear_bits=8), 1)
    for name, g, e in zip(("q", "k", "v", "bias"), close, exact, strict=True):
        assert relative_error(g[0], e[0]) < 0.02, name
    got = input_grads(fn, inputs, level(2), 256)  # q, k and the bias exact, v at 2 bits
    for name, g, e in zip(("q", "k", "bias"), (got[0], got[1], got[3]),
                          (exact[0], exact[1], exact[3]), strict=True):
        assert relative_error(g[0], e[0]) > 1e-3, name  # v was rounded
        assert shrinks_like_noise(g, e[0], small=8, large=256) < 0.25, name


def test_learned_bias_is_packed_with_its_mask_and_nothing_kept_exact():
    makes, param = biases(seq=64)
    q, k, v = qkv(seq=64)
    st = []
    with actune.compressed("L3", stats=st.append):
        y = biased(makes["dense_causal"])(q, k, v, param)
    y.sum().backward()
    s = st[0]
    assert s.exact == {}
    bias_elements = 2 * 4 * 64 * 64
    assert s.by_kind["attention bias"] < bias_elements * 1.1  # 8 bits, not PyTorch's 32
    assert s.by_kind["attention bias mask"] <= bias_elements // 8
    assert s.ratio > 4
    # the masked entries come back masked: their gradient is exactly 0, as PyTorch's
    assert torch.count_nonzero(param.grad.triu(1)) == 0


def test_parameter_bias_is_a_reference():
    makes, param = biases(seq=64)
    q, k, v = qkv(seq=64)
    st = []
    with actune.compressed("L3", stats=st.append):
        biased(makes["parameter"])(q, k, v, param).sum().backward()
    assert set(st[0].by_kind) == {"attention q/k", "attention v"}


def test_learned_bias_on_the_cpu_backends():
    """PyTorch's CPU flash kernel takes no bias that requires grad (it refuses, and a list of
    backends falls back to math); the rule runs on whichever PyTorch picks. The CUDA backends:
    scripts/gpu_transformers.py."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    makes, param = biases()
    inputs = (*qkv(), param)
    fn = biased(makes["dense_causal"])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError):
        fn(*inputs)
    for backends in ([SDPBackend.MATH], [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        with sdpa_kernel(backends):
            exact = exact_grads(fn, inputs)
            got = input_grads(fn, inputs, level(8, nonlinear_bits=8), 1)
        for g, e in zip(got, exact, strict=True):
            assert relative_error(g[0], e[0]) < 0.02


def test_eager_spelling_of_a_learned_bias_is_covered_by_the_op_rules():
    """``softmax(q k^T * scale + bias) v`` in ops: the matmuls and softmax rules round what
    they save (linear in each: unbiased), the add saves nothing."""
    makes, param = biases(seq=64)
    q, k, v = qkv(seq=64)

    def eager(q, k, v, p):
        scores = (q * 1.0) @ (k * 1.0).transpose(-1, -2) * 0.25 + makes["dense_causal"](p)
        return scores.softmax(-1) @ (v * 1.0)

    st = []
    with actune.compressed("L3", stats=st.append):
        eager(q, k, v, param).sum().backward()
    assert st[0].exact == {} and st[0].ratio > 6
    inputs = (q, k, v, param)
    exact = exact_grads(eager, inputs)
    got = input_grads(eager, inputs, level(2), 256)
    for name, g, e in zip(("q", "k", "v", "bias"), got, exact, strict=True):
        assert shrinks_like_noise(g, e[0], small=8, large=256) < 0.25, name
