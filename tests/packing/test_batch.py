"""quantize_many / dequantize_many: one kernel call, the results of one call per tensor."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from actune import tunables
from actune.packing.batch import dequantize_many, quantize_many
from actune.packing.tensors import dequantize, group_steps, quantize
from actune_kernels import cpu, cpu_segments


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(1000, generator=g),
        torch.randn(3, 700, generator=g).bfloat16(),
        torch.empty(0),
        torch.randn(1, generator=g),
        torch.randn(5, 5, dtype=torch.float64, generator=g),
        torch.rand(300, generator=g).half().relu(),
        torch.randn(8, 40, generator=g).t(),  # a transposed (dense, permuted) layout
        torch.randn(4, 6, generator=g)[:, ::2],  # with gaps: packed from a copy
        torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
    ]


BITS = [2, 4, 8, 1, 2, 8, 2, 4, 1]
ZEROS = [False, False, False, False, False, True, False, False, False]


def test_each_tensor_gets_the_bytes_of_its_own_segment_and_its_own_layout_back():
    xs = _tensors()
    ps = quantize_many(xs, BITS, seed=123, zero_code=ZEROS)
    ys = dequantize_many(ps)
    for x, p, y, b, z in zip(xs, ps, ys, BITS, ZEROS, strict=True):
        assert (p.bits, p.zero_code, p.shape, p.dtype) == (b, z, x.shape, x.dtype)
        assert (y.shape, y.dtype, y.stride()) == (x.shape, x.dtype, dequantize(p).stride())
        assert torch.equal(y, dequantize(p))
    assert ys[6].stride() == xs[6].stride() and ys[8].stride() == xs[8].stride()
    # the float32-working tensors share one buffer (one call), float64 has its own
    f32 = [p for p, x in zip(ps, xs, strict=True) if x.numel() and x.dtype != torch.float64]
    assert len({p.codes.untyped_storage().data_ptr() for p in f32}) == 1
    # segment k's bytes are those of the kernel packing it alone at its stream offset
    flats = [x.detach().permute(*range(x.dim())).reshape(-1) for x in xs]
    sizes = [x.numel() for x in xs]
    batch = [i for i, x in enumerate(xs) if x.numel() and x.dtype != torch.float64]
    start = cpu_segments.segment_table([sizes[i] for i in batch], [BITS[i] for i in batch],
                                       [ZEROS[i] for i in batch], 256)[0]
    for k, i in enumerate(batch[:2]):  # contiguous ones: their flat order is their own
        codes = torch.empty_like(ps[i].codes)
        meta = torch.empty_like(ps[i].meta)
        cpu.pack(flats[i].float().numpy(), codes.numpy(), meta.numpy().view("uint16"),
                 BITS[i], 256, 123, int(start[k]), True, ZEROS[i])
        assert torch.equal(codes, ps[i].codes) and torch.equal(meta, ps[i].meta)


def test_unbiased_per_tensor():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(512, generator=g), torch.randn(300, generator=g).bfloat16()]
    mean = [torch.zeros(512), torch.zeros(300)]
    runs = 400
    for s in range(runs):
        ps = quantize_many(xs, [2, 1], seed=s)
        for m, y in zip(mean, dequantize_many(ps), strict=True):
            m += y.float() / runs
    for x, m, p in zip(xs, mean, ps, strict=True):
        # the mean of 400 draws of lo or lo + step: within 5 standard errors (step / 40),
        # plus bfloat16's rounding of each value
        step = group_steps(p).repeat_interleave(256)[:x.numel()]
        tolerance = 5 * step / (2 * runs**0.5) + x.float().abs() / 128
        assert ((m - x.float()).abs() <= tolerance).all()


def test_packs_from_separate_calls_and_group_sizes_unpack_together():
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randn(n, generator=g) for n in (257, 64, 1))
    ps = [quantize(a, 2, seed=1), quantize(b, 4, group_size=32, seed=2),
          quantize(c, 8, seed=3), quantize(torch.empty(0), 2)]
    assert all(torch.equal(y, dequantize(p)) for y, p in zip(dequantize_many(ps), ps,
                                                                strict=True))
    assert dequantize_many([]) == [] and quantize_many([], 2) == []


def test_fake_tensors_take_the_one_by_one_path():
    with FakeTensorMode():
        xs = [torch.empty(4, 300), torch.empty(10, dtype=torch.bfloat16)]
        ps = quantize_many(xs, [2, 4])
        ys = dequantize_many(ps)
    assert [p.codes.numel() for p in ps] == [5 * 64, 128]  # 1,200 elements: 5 groups of 64 bytes
    assert [(y.shape, y.dtype) for y in ys] == [(x.shape, x.dtype) for x in xs]


def test_bad_arguments_name_what_to_fix():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits has 1 entries for 2 tensors"):
        quantize_many([x, x], [2])
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_many([x, x], [2, 3])
    with pytest.raises(TypeError, match="floating-point tensor"):
        quantize_many([x, torch.arange(3)], 2)
    with pytest.raises(ValueError, match="zero_code needs at least 2 bits"):
        quantize_many([x], 1, zero_code=True)


def test_large_tensors_get_their_own_call_and_a_lone_small_one_is_quantize_itself():
    g = torch.Generator().manual_seed(4)
    big = torch.randn(tunables.SMALL_PACK, generator=g)
    small = [torch.randn(100, generator=g), torch.randn(200, generator=g)]
    ps = quantize_many([big, *small], 2, seed=9)
    storages = [p.codes.untyped_storage().data_ptr() for p in ps]
    assert storages[0] not in storages[1:] and storages[1] == storages[2]
    assert torch.equal(ps[0].codes, quantize(big, 2, seed=9).codes)
    lone = torch.randn(300, dtype=torch.float64, generator=g)
    p = quantize_many([lone, big], 4, seed=5)[0]
    assert torch.equal(p.codes, quantize(lone, 4, seed=5).codes)
    assert all(torch.equal(y, dequantize(q)) for y, q in zip(dequantize_many(ps), ps,
                                                                strict=True))
