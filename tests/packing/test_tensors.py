"""quantize() / dequantize(): the torch-facing API."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import actune
from actune import tunables
from actune.packing.tensors import dequantize, quantize_checked
from actune_kernels import layout
from actune_kernels import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def max_step(p: actune.PackedTensor) -> float:
    meta = p.meta.numpy().view(np.uint16)
    return float(ref.meta_values(meta)[1].max())


@pytest.mark.parametrize("bits", layout.SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_keeps_shape_dtype_device_and_error_within_one_step(bits, dtype):
    x = torch.randn(3, 5, 70, generator=torch.Generator().manual_seed(bits)).to(dtype)
    p = actune.quantize(x, bits, seed=1)
    y = actune.dequantize(p)
    assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device)
    assert (p.shape, p.dtype, p.bits) == (x.shape, x.dtype, bits)
    err = (y.double() - x.double()).abs().max().item()
    tol = {torch.float16: 1e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-6)  # output rounding
    assert err <= max_step(p) * (1 + tol)


def test_round_to_nearest_is_within_half_a_step_and_deterministic():
    x = torch.randn(1000)
    p = actune.quantize(x, 4, stochastic=False)
    q = actune.quantize(x, 4, stochastic=False)
    assert torch.equal(p.codes, q.codes)
    assert (actune.dequantize(p) - x).abs().max().item() <= max_step(p) / 2 * (1 + 1e-6)


def test_nbytes_counts_codes_and_metadata():
    x = torch.randn(64, 256)
    p = actune.quantize(x, 2)
    assert p.nbytes == 64 * 256 * 2 // 8 + 64 * 4
    assert p.nbytes == layout.packed_nbytes(x.numel(), 2, 256)
    assert p.bits_per_element == pytest.approx(2.125)


def test_manual_seed_makes_quantization_repeatable():
    x = torch.randn(4096)
    torch.manual_seed(3)
    a = actune.quantize(x, 2)
    b = actune.quantize(x, 2)
    torch.manual_seed(3)
    c = actune.quantize(x, 2)
    assert torch.equal(a.codes, c.codes)
    assert not torch.equal(a.codes, b.codes)


def test_explicit_seed_matches_the_reference_bytes():
    x = torch.randn(1000, dtype=torch.float64)
    p = actune.quantize(x, 2, seed=42)
    codes, meta = ref.pack(x.numpy(), 2, 256, 42)
    np.testing.assert_array_equal(p.codes.numpy(), codes)
    np.testing.assert_array_equal(p.meta.numpy().view(np.uint16), meta)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (1,), (1, 1, 1)])
def test_empty_and_single_element(shape):
    x = torch.full(shape, 1.5)
    p = actune.quantize(x, 2)
    y = actune.dequantize(p)
    assert y.shape == x.shape
    assert torch.equal(y, x)  # 1.5 is exact in float16: constant groups round-trip exactly
    assert p.nbytes == layout.packed_nbytes(x.numel(), 2, 256)


def test_channels_last_is_packed_without_copy_and_restored():
    x = torch.randn(2, 8, 5, 7).to(memory_format=torch.channels_last)
    p = actune.quantize(x, 8, seed=0)
    y = actune.dequantize(p)
    assert y.stride() == x.stride()
    assert y.is_contiguous(memory_format=torch.channels_last)
    # packed in memory order: identical bytes to packing the NHWC tensor
    q = actune.quantize(x.permute(0, 2, 3, 1).contiguous(), 8, seed=0)
    assert torch.equal(p.codes, q.codes)
    assert (y - x).abs().max() <= max_step(p)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(30, 40).t(),
    lambda: torch.randn(30, 40)[:, ::3],
    lambda: torch.randn(30, 1).expand(30, 9),
    lambda: torch.randn(6, 7, 8).permute(2, 0, 1),
])
def test_non_contiguous_inputs(make):
    x = make()
    y = actune.dequantize(actune.quantize(x, 8, seed=0))
    assert y.shape == x.shape
    assert (y - x).abs().max().item() < 0.05


def test_nan_and_inf_propagate_visibly():
    x = torch.randn(1024)
    x[700] = float("nan")
    x[10] = float("inf")
    y = actune.dequantize(actune.quantize(x, 2))
    assert torch.isnan(y[:256]).all() and torch.isnan(y[512:768]).all()
    assert torch.isfinite(y[256:512]).all() and torch.isfinite(y[768:]).all()


def test_large_magnitudes_never_become_inf():
    x = torch.randn(512) * 1e30
    y = actune.dequantize(actune.quantize(x, 2))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"bits": 3}, ValueError, "bits must be one of"),
    ({"bits": 2, "group_size": 100}, ValueError, "group_size"),
    ({"bits": 2, "seed": -1}, ValueError, "seed"),
])
def test_bad_arguments_say_what_to_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        actune.quantize(torch.randn(10), **kwargs)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_zero_code_keeps_the_zero_pattern_exactly(bits):
    x = torch.randn(64, 100).relu()
    x[3] = 0  # whole groups of zeros
    x[5, :7] = 1e-30  # tiny positives stay positive
    y = actune.dequantize(actune.quantize(x, bits, zero_code=True))
    assert torch.equal(y > 0, x > 0)
    assert torch.equal(y == 0, x == 0)


def test_zero_code_needs_two_bits():
    with pytest.raises(ValueError, match="at least 2 bits"):
        actune.quantize(torch.rand(10), 1, zero_code=True)


def test_integer_tensors_are_rejected():
    with pytest.raises(TypeError, match="floating-point"):
        actune.quantize(torch.arange(10), 2)


def test_requires_grad_input_is_packed_detached():
    x = torch.randn(100, requires_grad=True)
    y = actune.dequantize(actune.quantize(x, 8))
    assert not y.requires_grad


def test_fake_tensor_mode_gives_shapes_without_compute():
    with FakeTensorMode():
        x = torch.randn(16, 300)
        p = actune.quantize(x, 2)
        y = actune.dequantize(p)
        assert p.codes.shape == (layout.codes_nbytes(16 * 300, 2, 256),)
        assert p.meta.shape == (layout.num_groups(16 * 300, 256), 2)
        assert y.shape == x.shape and y.dtype == x.dtype


def test_opcheck_passes_for_both_ops():
    x = torch.randn(1000)
    p = actune.quantize(x, 2, seed=0)
    for op, args in [
        (torch.ops.actune.pack.default, (x, 2, 256, 5, True, False)),
        (torch.ops.actune.pack.default, (x.relu(), 2, 256, 5, True, True)),
        (torch.ops.actune.unpack.default, (p.codes, p.meta, 2, 256, 1000, torch.float32,
                                           False)),
    ]:
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


def test_buffers_are_torch_tensors_seen_by_the_allocator():
    x = torch.randn(2048)
    p = actune.quantize(x, 2)
    assert isinstance(p.codes, torch.Tensor) and isinstance(p.meta, torch.Tensor)
    assert p.codes.untyped_storage().nbytes() == p.codes.nbytes


@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    bits=st.sampled_from(layout.SUPPORTED_BITS),
    seed=st.integers(0, 2**31),
)
def test_property_round_trip(shape, dtype, bits, seed):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10).to(dtype)
    p = actune.quantize(x, bits, group_size=32, seed=seed)
    y = actune.dequantize(p)
    assert y.shape == x.shape and y.dtype == dtype
    tol = {torch.float16: 1e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-6)
    assert (y.double() - x.double()).abs().max().item() <= max_step(p) * (1 + tol) + 1e-6


def test_large_cpu_outputs_in_their_own_mapping_hold_the_same_values(monkeypatch):
    import gc

    from actune.packing import kernels

    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(3)).t()  # strided
    p = actune.quantize(x, 2, seed=4)
    expected = actune.dequantize(p)
    monkeypatch.setattr(tunables, "HUGE_OUTPUT_BYTES", 4096)  # this tensor's 60 KB qualifies
    got = actune.dequantize(p)
    gc.collect()  # the mapping lives as long as the tensor's storage, not a Python name
    assert torch.equal(got, expected) and got.stride() == x.stride()
    assert got.untyped_storage().data_ptr() % 4096 == 0  # its own mapping, page-aligned
    (got * 2).sum().item()  # usable as any tensor
    assert kernels.empty_cpu(10, torch.float64).dtype == torch.float64  # small: torch.empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_view_at_a_storage_offset_packs_its_own_values(dtype):
    base = torch.randn(3, 700, dtype=torch.float64)
    x = base.to(dtype)[1]  # a contiguous view 700 elements into its storage
    assert x.storage_offset() == 700 and x.is_contiguous()
    p = actune.quantize(x, 4, seed=5)
    codes, meta = ref.pack(x.double().numpy() if dtype is torch.bfloat16 else x.numpy(), 4, 256,
                           5)
    np.testing.assert_array_equal(p.meta.numpy().view(np.uint16), meta)
    np.testing.assert_array_equal(p.codes.numpy(), codes)
    y = actune.dequantize(p)
    assert y.dtype == dtype and y.shape == x.shape
    assert (y.double() - x.double()).abs().max() <= max_step(p) + 0.02


def test_packed_buffers_that_are_not_contiguous_are_read_as_their_values():
    x = torch.randn(3, 700)
    p = actune.quantize(x, 4, seed=1)
    meta_t = p.meta.t().contiguous().t()  # the same values, column-major
    codes_s = torch.stack([p.codes, p.codes], 1)[:, 0]  # the same values, stride 2
    assert not meta_t.is_contiguous() and not codes_s.is_contiguous()
    q = dataclasses.replace(p, codes=codes_s, meta=meta_t)
    assert torch.equal(actune.dequantize(q), actune.dequantize(p))


@pytest.mark.parametrize("shape,dtype,bits", [((4, 33, 48), torch.float32, 2),
                                              ((100, 24), torch.float32, 4),
                                              ((2, 3, 5, 8), torch.bfloat16, 8),
                                              ((3, 7, 16), torch.float32, 1)])
def test_by_feature_on_the_cpu_is_the_column_layout_with_no_copy(shape, dtype, bits):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    p = quantize_checked(x, bits, 64, 11, by_feature=True)
    rows = x.numel() // shape[-1]
    flat = x.reshape(rows, shape[-1])
    codes, meta = ref.pack_columns(flat.float().numpy() if dtype == torch.bfloat16
                                   else flat.numpy(), bits, min(64, rows), 11)
    assert p.by_feature and p.group_size == min(64, rows)
    assert np.array_equal(p.codes.numpy(), codes)
    assert np.array_equal(p.meta.numpy().view(np.uint16), meta)
    y = dequantize(p)
    assert y.is_contiguous() and y.dtype == dtype and y.shape == x.shape
    assert float((y.float() - x.float()).abs().max()) <= max_step(p) * 1.01
    with FakeTensorMode() as mode:  # an estimate: the same bytes, a row-major output
        fake = quantize_checked(mode.from_tensor(x), bits, 64, -1, by_feature=True)
        assert fake.nbytes == p.nbytes and dequantize(fake).is_contiguous()


def test_by_feature_off_the_column_layout_packs_a_feature_major_copy():
    from actune.packing.columns import feature_major

    x = torch.randn(4, 33, 45)  # 45 features: not a multiple of 8
    p = quantize_checked(x, 2, 256, 5, by_feature=True)
    q = quantize_checked(feature_major(x), 2, 256, 5)
    assert not p.by_feature and torch.equal(p.codes, q.codes) and p.stride == q.stride
    assert torch.equal(dequantize(p), dequantize(q))


def test_by_feature_leaves_tensors_without_that_order_as_they_are():
    for x in (torch.randn(5), torch.randn(7, 1), torch.randn(1, 9), torch.randn(6, 4).t()):
        p = quantize_checked(x, 8, 8, 3, by_feature=True)
        assert not p.by_feature and torch.equal(p.codes, quantize_checked(x, 8, 8, 3).codes)


def test_dequantize_into_fills_the_buffer_as_dequantize_would():
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(0))
    p = actune.quantize(x, 4, seed=3)
    out = torch.empty(37, 300)
    assert actune.packing.tensors.dequantize_into(p, out) is out
    assert torch.equal(out, actune.dequantize(p))
    by_feature = quantize_checked(x, 2, 256, 5, by_feature=True)  # (a copy there)
    out2 = torch.empty(37, 300)
    assert torch.equal(actune.packing.tensors.dequantize_into(by_feature, out2),
                       actune.dequantize(by_feature))
    with pytest.raises(ValueError, match=r"contiguous torch\.float32 tensor of shape"):
        actune.packing.tensors.dequantize_into(p, torch.empty(300, 37).t())
