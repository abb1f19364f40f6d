"""The bit allocator: optimality, the budget, per-sample packing, its state, and training."""

import contextlib
import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given
from hypothesis import strategies as st

import actune
from actune.apps import zoo
from actune.autoprec import allocator as autoprec
from actune.autoprec import solver as bit_allocation
from actune.autoprec.allocator import CHOICES, AutoPrecision, allocate, objective
from actune.levels import get_level, parse_levels
from actune.packing.formats import PackedRows, PackedSamples
from actune.packing.samples import dequantize_samples, quantize_samples


def brute_force(costs, numel, avg_bits, min_bits, quartic=None):
    """The least variance over every assignment that fits (the reference optimum)."""
    cap = avg_bits * sum(numel) + 1e-9
    best = None
    for bits in itertools.product(CHOICES, repeat=len(costs)):
        if any(b < lo for b, lo in zip(bits, min_bits, strict=True)):
            continue
        if sum(b * n for b, n in zip(bits, numel, strict=True)) <= cap:
            v = objective(costs, bits, quartic)
            best = v if best is None else min(best, v)
    return best


problems = st.integers(1, 5).flatmap(lambda k: st.tuples(
    st.lists(st.floats(0, 1e3), min_size=k, max_size=k),
    st.lists(st.integers(1, 6), min_size=k, max_size=k),
    st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.5, 8.0]),
    st.lists(st.sampled_from([1, 1, 2]), min_size=k, max_size=k),
    st.lists(st.floats(0, 1e3), min_size=k, max_size=k)))


@given(problems)
def test_allocation_is_the_brute_force_optimum_on_small_problems(problem):
    costs, numel, avg, lo, quartic = problem
    if sum(b * n for b, n in zip(lo, numel, strict=True)) > avg * sum(numel):
        with pytest.raises(ValueError, match="below the minimum"):
            allocate(costs, numel, avg, lo, quartic)
        return
    bits = allocate(costs, numel, avg, lo, quartic)
    assert set(bits.tolist()) <= set(CHOICES)
    assert all(b >= m for b, m in zip(bits, lo, strict=True))
    assert (bits * np.array(numel)).sum() <= avg * sum(numel) + 1e-9  # the budget, exactly
    got = objective(costs, bits, quartic)
    assert got == pytest.approx(brute_force(costs, numel, avg, lo, quartic), rel=1e-9, abs=1e-12)


def test_greedy_on_large_problems_is_within_a_hair_of_the_exact_optimum():
    rng = np.random.default_rng(0)
    costs = rng.lognormal(0, 2, 300)
    numel = rng.integers(1, 40, 300) * 64  # the exact path solves in units of 64
    lo = np.ones(300, dtype=np.int64)
    var = np.stack([costs * bit_allocation.NOISE[b] for b in CHOICES], axis=1)
    for avg in (1.25, 2.0, 3.0):
        cap = int(avg * numel.sum())
        exact = bit_allocation._exact(var, numel // 64, cap // 64, lo)
        greedy = bit_allocation._greedy(var, numel, cap, lo)
        assert (allocate(costs, numel, avg) == greedy).all()  # too large: allocate is greedy
        assert (greedy * numel).sum() <= cap
        assert objective(costs, greedy) <= objective(costs, exact) * 1.02
        assert objective(costs, greedy) >= objective(costs, exact) * (1 - 1e-12)


def test_allocation_spends_bits_where_the_cost_is():
    bits = allocate([100.0, 1.0, 1.0, 1.0], [10, 10, 10, 10], 2.0)
    assert bits[0] > bits[1]
    assert (bits * 10).sum() <= 80
    with pytest.raises(ValueError, match="finite"):
        allocate([-1.0], [1], 2.0)
    with pytest.raises(ValueError, match="differ"):
        allocate([1.0, 2.0], [1], 2.0)


def test_levels_from_average_bits():
    lv = get_level("1.25b")
    assert (lv.name, lv.avg_bits, lv.matmul_bits) == ("1.25b", 1.25, 1)
    assert get_level("2").avg_bits == 2.0 and get_level("3 bits").matmul_bits == 2
    assert [x.name for x in parse_levels("L0,L3,2b,1.25")] == ["L0", "L3", "2b", "1.25b"]
    with pytest.raises(ValueError, match="average number of bits"):
        get_level("fast")
    with pytest.raises(ValueError, match="within"):
        get_level("9b")


def test_l3_is_mixed_precision_and_u2_is_its_uniform_baseline():
    """L3 (and L4/L5) allocate 2 bits on average, per sample by default, as ActNN's L3; u2
    is the same 2 bits everywhere with no allocator; without an allocator both pack alike."""
    from actune.levels import LEVELS, uniform

    for name in ("L3", "L4", "L5"):
        assert LEVELS[name].avg_bits == 2.0 and LEVELS[name].matmul_bits == 2
    u2 = get_level("u2")
    assert u2 == uniform(2) and u2.avg_bits is None and (u2.matmul_bits, u2.other_bits) == (2, 2)
    assert get_level("U4").other_bits == 4
    assert [x.name for x in parse_levels("u2,L3")] == ["u2", "L3"]
    with pytest.raises(ValueError, match="u1, u2, u4, u8"):
        get_level("u3")
    model = actune.compress(zoo.tiny_cnn(), "L3")
    ap = actune.autoprec_of(model)
    assert ap is not None and ap.avg_bits == 2.0 and ap.per_sample
    assert actune.autoprec_of(actune.compress(zoo.tiny_cnn(), "u2")) is None
    x = torch.randn(16, 1, 8, 8)
    saved = {}
    for name in ("u2", "L3"):  # compressed() with no allocator: L3 falls back to 2 bits
        torch.manual_seed(0)
        seen = []
        with actune.compressed(name, stats=seen.append):
            zoo.tiny_cnn()(x).sum()
        saved[name] = (seen[0].kept_bytes, seen[0].packed)
    assert saved["u2"] == saved["L3"]


def test_u8_takes_groups_of_64_and_they_round_heavy_tails_with_less_noise():
    """At 8 bits a group of 64 pays its statistics the share of its codes a 2-bit group of 256
    pays, and its step is set by the extremes of 64 values: on heavy-tailed values (a normal
    over the square root of a uniform) the rounding noise falls by over a fifth; the
    narrower uniform levels keep L3's groups (like for like against the mixed levels)."""
    from actune.levels import UNIFORM_GROUP_SIZES
    from actune.packing.tensors import dequantize, quantize

    assert get_level("u8").group_size == UNIFORM_GROUP_SIZES[8] == 64
    assert get_level("u2").group_size == get_level("u4").group_size == get_level("L3").group_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 16, generator=gen) / torch.rand(1 << 16, generator=gen).sqrt()
    noise = {g: (dequantize(quantize(x, 8, group_size=g, seed=3)) - x).norm() / x.norm()
             for g in (64, 256)}
    assert noise[64] < 0.8 * noise[256], noise
    packed = quantize(x, 8, group_size=64, seed=3)
    assert packed.bits_per_element == pytest.approx(8.5)  # (codes and two 16-bit words a group)


@pytest.mark.parametrize("channels", [4, 3])  # 256 per sample: packed in place; 192: gathered
def test_per_sample_packing_gives_each_sample_its_bits(channels):
    torch.manual_seed(0)
    scale = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.25]).view(6, 1, 1, 1)
    x = torch.randn(6, channels, 8, 8) * scale
    packed = quantize_samples(x, ((8, 2), (2, 4)))
    if channels == 4:
        assert isinstance(packed, PackedRows)
        assert packed.row_bits.tolist() == [8, 8, 2, 2, 2, 2]  # the two largest got 8 bits
        assert packed.nbytes < x.nbytes
    else:
        assert isinstance(packed, PackedSamples)
        widths = {int(idx.numel()): part.bits for idx, part in packed.parts}
        assert widths == {2: 8, 4: 2}
        assert sorted(packed.parts[0][0].tolist()) == [0, 1]
    y = dequantize_samples(packed)
    assert y.shape == x.shape
    err = (y - x).flatten(1).abs().amax(1) / x.flatten(1).abs().amax(1)
    assert (err[:2] < 0.02).all() and (err[2:] > 0.05).all()
    # unbiased, sample by sample
    mean = torch.stack([dequantize_samples(quantize_samples(x, ((8, 2), (2, 4))))
                        for _ in range(400)]).mean(0)
    assert ((mean - x).norm() / x.norm()) < 0.02
    with pytest.raises(ValueError, match="runs cover"):
        quantize_samples(x, ((2, 5),))


@pytest.mark.parametrize("layout", ["features first", "channels last",
                                    "channels last, whole groups"])
def test_per_sample_packing_keeps_a_tensors_memory_order(layout):
    """A dense tensor whose memory is not row-major (a norm's copy laid out features first, a
    channels-last input) comes back with its own values in its own strides: its rows are
    packed in memory order, gathered (a sample not whole groups) or in place."""
    from actune.packing.columns import feature_major

    torch.manual_seed(0)
    x = {"features first": lambda: feature_major(torch.randn(4, 65, 128)),
         "channels last": lambda: torch.randn(4, 5, 7, 7).to(memory_format=torch.channels_last),
         "channels last, whole groups": lambda: torch.randn(4, 64, 8, 8).to(
             memory_format=torch.channels_last)}[layout]()
    assert not x.is_contiguous()
    packed = quantize_samples(x, ((8, 2), (4, 2)))
    y = dequantize_samples(packed)
    assert y.shape == x.shape and y.stride() == x.stride()
    err = (y - x).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
    assert err.max() < 0.2, err  # (values laid out in another order: about 1.4)
    assert sorted(err.tolist())[:2] == pytest.approx([0, 0], abs=0.02)  # two samples at 8 bits


def test_rows_kernel_writes_the_bytes_of_uniform_packing_row_by_row():
    from actune_kernels import cpu, cpu_rows

    rng = np.random.default_rng(0)
    n, m, group = 8, 1024, 256
    x = (rng.standard_normal(n * m) * np.repeat(np.logspace(-2, 2, n), m)).astype(np.float32)
    x[5 * m:5 * m + 300] = np.maximum(x[5 * m:5 * m + 300], 0)
    row_bits = np.array([1, 2, 4, 8, 2, 1, 8, 4], np.uint8)
    for zero_code in (False, True):
        bits_used = np.maximum(row_bits, 2) if zero_code else row_bits
        sizes = bits_used.astype(np.int64) * m // 8
        offsets = np.cumsum(sizes) - sizes
        src = np.abs(x) if zero_code else x
        codes = np.zeros(int(sizes.sum()), np.uint8)
        meta = np.zeros((n * m // group, 2), np.uint16)
        cpu_rows.pack_rows(src, codes, meta, bits_used, offsets, group, 7, 3, True, zero_code)
        for b in (1, 2, 4, 8):
            if zero_code and b == 1:
                continue
            whole = np.zeros(n * m * b // 8, np.uint8)
            whole_meta = np.zeros((n * m // group, 2), np.uint16)
            cpu.pack(src, whole, whole_meta, b, group, 7, 3, True, zero_code)
            for r in np.flatnonzero(bits_used == b):
                span = slice(r * m * b // 8, (r + 1) * m * b // 8)
                assert (whole[span] == codes[offsets[r]:offsets[r] + m * b // 8]).all()
                rows = slice(r * m // group, (r + 1) * m // group)
                assert (whole_meta[rows] == meta[rows]).all()
        out = np.empty_like(src)
        cpu_rows.unpack_rows(codes, meta, bits_used, offsets, group, out, zero_code)
        assert (out[src == 0] == 0).all() if zero_code else True


def _steps(model, ap_or_none, steps, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_allocator_learns_keeps_the_budget_and_survives_state_dict():
    torch.manual_seed(0)
    model = zoo.tiny_cnn()
    actune.compress(model, "1.25b", every=3, per_sample=True)
    ap = actune.autoprec_of(model)
    assert isinstance(ap, AutoPrecision) and ap.avg_bits == 1.25
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    _steps(model, ap, 7, x, y)
    assert ap.reallocations == 2  # after steps 1 and 4 (statistics on steps 1, 4, 7)
    assert ap.mean_bits <= 1.25 + 1e-9
    rows = ap.rows()
    assert rows and all(r["cost"] >= 0 for r in rows)
    assert {b for r in rows for b, _ in r["bits_by_rank"]} <= {0, 1, 2, 4, 8}
    assert ap.variance <= ap.uniform_variance(1)
    state = ap.state_dict()
    again = AutoPrecision()
    again.load_state_dict(state)
    assert again.state_dict() == state
    assert again.rows() == rows
    # a model in eval mode (no backward) teaches nothing and changes nothing
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    assert ap.state_dict()["slots"] == state["slots"]


def test_per_sample_bits_are_used_in_training_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    actune.compress(model, "2b", every=2, per_sample=True)
    ap = actune.autoprec_of(model)
    # very different samples (one quantization group each): the large ones get more bits
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 64).unsqueeze(1)
    y = torch.randint(0, 10, (64,))
    _steps(model, ap, 3, x, y)
    mixed = [r for r in ap.rows() if len(r["bits_by_rank"]) > 1]
    assert mixed, ap.rows()
    with actune.compressed("2b", autoprec=ap, stats=(stats := []).append):
        F.cross_entropy(model(x), y).backward()
    assert stats


def _sgd_002(parameters):  # the rate these two-epoch checks were sized with
    return torch.optim.SGD(parameters, lr=0.02, momentum=0.9)


def test_mixed_precision_training_on_digits_lowers_the_loss_like_exact_training():
    from actune.apps.data import digits

    data = digits()
    from actune.apps.train import train

    finals = {}
    for name in ("L0", "L3", "2b", "1.25b"):
        result = list(train(zoo.tiny_cnn, data, get_level(name), epochs=2, seed=0, every=10,
                            make_optimizer=_sgd_002))
        finals[name] = result[-1]
    for name, r in finals.items():
        assert r.loss < 0.6, (name, r)  # from ln(10) = 2.3
        assert r.test_accuracy > 0.85, (name, r)
        assert abs(r.loss - finals["L0"].loss) < 0.25, (name, r)
    assert finals["2b"].mean_bits == pytest.approx(2.0, abs=0.01)
    assert finals["1.25b"].mean_bits <= 1.25 + 1e-9


def test_estimate_mode_runs_with_a_mixed_level():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.device("cpu"):
        model = zoo.tiny_cnn()
        actune.compress(model, "2b")
        x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
    assert actune.autoprec_of(model).reallocations == 0  # no statistics from fake tensors


def test_per_sample_ranking_follows_the_weight():
    torch.manual_seed(0)
    x = torch.randn(4, 4, 8, 8)  # samples of about equal norm
    weight = torch.tensor([1.0, 50.0, 1.0, 1.0])
    for packed in (quantize_samples(x, ((8, 1), (1, 3)), weight=weight),
                   quantize_samples(x[:, :3], ((8, 1), (1, 3)), weight=weight)):
        y = dequantize_samples(packed)
        ref = x if y.shape == x.shape else x[:, :3]
        err = (y - ref).flatten(1).abs().amax(1)
        assert int(err.argmin()) == 1 and err[1] < 0.1 * err[[0, 2, 3]].min()


def test_named_samples_are_remembered_and_weigh_their_rank():
    torch.manual_seed(0)
    model = zoo.tiny_cnn()
    actune.compress(model, "2b", every=0, per_sample=True)
    ap = actune.autoprec_of(model)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    ids = torch.tensor([9, 3, 4, 5, 6, 7, 8, 2])
    ap.samples(ids)
    F.cross_entropy(model(x), y).backward()
    table = ap.sensitivity
    assert table is not None and table.numel() == 10
    assert (table[ids] > 0).all() and (table[[0, 1]] == 0).all()  # only the named samples
    first = table.clone()
    ap.samples(ids)
    F.cross_entropy(model(x * 2), y).backward()  # seen again: halved towards the new value
    assert ((ap.sensitivity[ids] - first[ids]).abs() > 0).all()
    # the next step ranks sample 0 (never seen: the mean of the known) and sample 9
    ap.sensitivity = torch.zeros(10)
    ap.sensitivity[9], ap.sensitivity[3] = 100.0, 4.0
    ap.samples([9, 3, 0])
    ap.begin_step()
    plan = ap.plan(torch.randn(3, 256))
    assert plan.weight.tolist() == pytest.approx([10.0, 2.0, 52.0 ** 0.5])
    state = ap.state_dict()
    again = AutoPrecision()
    again.load_state_dict(state)
    assert torch.equal(again.sensitivity, ap.sensitivity)


def test_named_samples_cut_the_variance_of_a_trained_model():
    # ActNN's per-sample allocation: after training, a few samples carry most of the
    # gradient; remembering which lets them have the wide widths (benchmarks/variance.py)
    from actune.apps.data import digits
    from actune.apps.numerics import measure
    from actune.apps.train import train

    data = digits()
    kept = {}
    for _ in train(zoo.tiny_cnn, data, get_level("2b"), epochs=2, seed=0, per_sample=True,
                   make_optimizer=_sgd_002, keep=lambda m, ap: kept.update(model=m, ap=ap)):
        pass
    assert kept["ap"].sensitivity is not None
    res = {r.level: r.quant_variance
           for r in measure(kept["model"], data, [get_level("u2"), get_level("L3")], repeats=8,
                            draws=2, per_sample=True, sensitivity=kept["ap"].sensitivity)}
    assert res["u2"] / res["L3"] > 2.0, res  # measured 4.5x; per tensor only: 0.96x


class _AddmmMLP(torch.nn.Module):
    """GPT-2's way of writing linear layers (``Conv1D``: ``addmm(bias, x, w)``), zero biases
    as at its initialisation, with an embedding, a layer norm and an inline GELU."""

    def __init__(self, dim=64):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(100, dim)
        self.w1 = torch.nn.Parameter(torch.randn(dim, 4 * dim) / dim**0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(4 * dim))
        self.w2 = torch.nn.Parameter(torch.randn(4 * dim, dim) / (4 * dim) ** 0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(dim))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, ids):
        h = self.norm(self.emb(ids))
        flat = h.view(-1, h.shape[-1])
        a = torch.addmm(self.b1, flat, self.w1)
        a = 0.5 * a * (1.0 + torch.tanh(0.79788456 * (a + 0.044715 * torch.pow(a, 3.0))))
        return torch.addmm(self.b2, a, self.w2).view(*h.shape).square().mean()


def test_every_allocated_slot_of_an_addmm_model_has_a_cost():
    """An addmm's activation is its second argument: measured from the (zero) bias, every
    weight gradient looked size 0 and the norm and GELU above got 1 bit, unmeasured."""
    model = actune.compress(_AddmmMLP(), "L3")
    ids = torch.randint(0, 100, (8, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # a statistics step, then the allocation
        model.zero_grad()
        model(ids).backward()
    rows = actune.autoprec_of(model).rows()
    assert len(rows) >= 5
    assert all(r["cost"] > 0 for r in rows), [(r["shape"], r["cost"]) for r in rows]


def test_relayed_noise_reaches_the_nearest_matmul_below():
    """Positions 0..5 with matmuls of sizes 3 (at 1) and 5 (at 3): an op at position p relays
    to the last matmul before it; the cumulative count (batch norm's) sums all of them."""
    size_at = np.array([0.0, 3.0, 0.0, 5.0, 0.0, 0.0])
    np.testing.assert_array_equal(autoprec._nearest_below(size_at), [0, 0, 3, 3, 5, 5, 5])
    np.testing.assert_array_equal(autoprec._nearest_below(np.zeros(2)), [0, 0, 0])


def test_a_packed_derivative_gets_two_bits_at_least_unless_the_budget_is_under_that():
    # (SiLU: GELU's derivative at L3 is kept as codes, outside the budget)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.SiLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 4))
    actune.compress(model, "L3", every=2, per_sample=False)
    ap = actune.autoprec_of(model)
    x = torch.randn(32, 16)
    for _ in range(3):
        model.zero_grad()
        model(x).square().mean().backward()
    assert ap.reallocations >= 1
    derivative = [s for s in ap.slots if s.min_bits == 2 and not s.zero_code]
    assert derivative and all(s.bits.min() >= 2 for s in derivative)
    assert all(s.min_bits == 1 for s in ap.slots if s not in derivative and not s.zero_code)
    state = ap.state_dict()
    again = AutoPrecision()
    again.load_state_dict(state)
    assert [s.zero_code for s in again.slots] == [s.zero_code for s in ap.slots]
    actune.compress(model, "1.25b", every=2, per_sample=False)  # under the floors: they yield
    for _ in range(3):
        model.zero_grad()
        model(x).square().mean().backward()
    assert actune.autoprec_of(model).mean_bits <= 1.25 + 1e-9


def test_a_layer_norm_shared_with_its_linear_counts_twice_in_the_budget():
    # the norm's packed input also serves the linear layer reading its output: one slot for
    # two saved tensors, whose budget is theirs together (the same bytes as two 2-bit copies)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    actune.compress(model, "L3", every=2, per_sample=False)
    ap = actune.autoprec_of(model)
    x = torch.randn(16, 40, 32)
    for _ in range(3):
        model.zero_grad()
        model(x).square().mean().backward()
    shared = [s for s in ap.slots if s.shares == 2]
    assert len(shared) == 1 and shared[0].numel == 16 * 40 * 64
    stored = sum(float((s.bits * s.per_sample_numel).sum()) for s in ap.slots)
    saved = sum(s.numel * s.shares for s in ap.slots)
    assert stored <= 2.0 * saved + 1e-6 and ap.mean_bits <= 2.0 + 1e-9
    assert stored > 2.0 * sum(s.numel for s in ap.slots)  # the shared budget was spent
    state = ap.state_dict()
    again = AutoPrecision()
    again.load_state_dict(state)
    assert [s.shares for s in again.slots] == [s.shares for s in ap.slots]


class _EagerAttention(torch.nn.Module):
    """A layer norm, then attention written as products of two activations and a softmax."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, 10)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        p = torch.softmax(q @ k.transpose(-2, -1) * 4.0, dim=-1)
        return self.out((p @ v).mean(1))


def test_the_allocator_gives_products_of_activations_softmax_and_norm_inputs_two_bits():
    # at one bit their rounding noise meets another noise in backward (the other operand's,
    # softmax's second copy, the normalised input times itself), which the cost model does
    # not see: a Swin V2 rose to 75x the uniform widths' gradient error (docs/autoprec.md)
    torch.manual_seed(0)
    model = actune.compress(_EagerAttention(), "L3")
    x, y = torch.randn(8, 24, 32), torch.randint(0, 10, (8,))
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    slots = actune.autoprec_of(model).slots
    # the norm's input (shared with the projection), q and k^T, softmax's two copies (p in
    # p @ v is the first), v: nothing here may take one bit
    shapes = sorted(s.label for s in slots)
    assert shapes == ["(8, 24, 24)"] * 2 + ["(8, 24, 32)"] * 3 + ["(8, 32, 24)"]
    assert all(s.min_bits >= 2 and s.bits.min() >= 2 for s in slots)


@pytest.mark.parametrize("correlation", [0.0, 0.5, 1.0])
def test_a_layer_norms_relayed_noise_is_what_its_backward_passes_on(correlation):
    """The share of ``x_hat``'s rounding noise a layer norm's backward passes to its input's
    gradient, against PyTorch's own backward of a noisy ``x_hat`` (rstd 1): about
    ``corr(grad * weight, x_hat)**2 + 1 / M``, per sample (the relays held 1 before)."""
    from actune.autoprec.allocator import relayed_by_norm

    gen = torch.Generator().manual_seed(0)
    samples, tokens, features, sigma = 2, 16, 32, 1e-3
    x = torch.randn(samples, tokens, features, generator=gen, dtype=torch.float64)
    x_hat = (x - x.mean(-1, keepdim=True)) / x.std(-1, unbiased=False, keepdim=True)
    weight = 1 + 0.3 * torch.randn(features, generator=gen, dtype=torch.float64)
    noise = torch.randn(samples, tokens, features, generator=gen, dtype=torch.float64)
    grad = (correlation * x_hat + (1 - correlation) * noise) / weight  # (grad * weight: mixed)
    stats = torch.zeros(samples, tokens, 1, dtype=torch.float64)

    def dx(xh):
        return torch.ops.aten.native_layer_norm_backward(
            grad, xh, [features], stats, stats + 1, weight, None, [True, False, False])[0]

    clean = dx(x_hat)
    draws = torch.stack([dx(x_hat + sigma * torch.randn(x_hat.shape, generator=gen,
                                                        dtype=torch.float64)) - clean
                         for _ in range(300)])
    assumed = sigma**2 * features * (grad * weight).square().mean(-1).sum(-1)  # per sample
    measured = draws.square().sum((2, 3)).mean(0) / assumed
    entry = [0, torch.ones(samples, dtype=torch.float64), None, None, False]
    relayed_by_norm([entry], grad, x_hat, weight, 1)
    assert entry[1] == pytest.approx(measured, rel=0.15), (entry[1], measured)
    assert (entry[1] < 0.1).all() if correlation == 0 else (entry[1] > 0.1).all()


def test_a_batch_norms_2d_input_keeps_its_groups_by_feature_under_the_allocator():
    # with per-sample widths its [batch, features] input was grouped along each sample, across
    # channels of large mean and small spread: a group's step many times a channel's spread,
    # which batch norm's backward divides by (LeViT's classifier: 22x the uniform widths' error
    # on the statistics step, inf beyond)
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 64)
    with torch.no_grad():
        head.weight.mul_(0.05)
        head.bias.uniform_(-20, 20)  # channels: large means, small spreads
    model = torch.nn.Sequential(head, torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def grads(m, seed, level=None):
        m.load_state_dict(state)  # (batch norm's running statistics move each step)
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with actune.compressed(level) if level else contextlib.nullcontext():
            F.cross_entropy(m(x), y).backward()
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    exact = grads(model, 0)
    converted = actune.compress(copy.deepcopy(model), "L3")
    first = (grads(converted, 1) - exact).norm()  # the statistics step, at 2 bits
    allocated = sum((grads(converted, s) - exact).norm() for s in (2, 3, 4))
    uniform = sum((grads(model, s, "L3") - exact).norm() for s in (2, 3, 4))
    assert first < 1.5 * uniform / 3
    assert allocated < 1.2 * uniform


def test_a_statistics_step_whose_gradients_overflowed_prices_nothing_and_is_taken_again():
    # (its inf and nan were read as zero costs: every slot at its floor, under the budget)
    torch.manual_seed(0)
    model = actune.compress(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)), "L3")
    ap = actune.autoprec_of(model)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    (F.cross_entropy(model(x), y) * 3e38).backward()  # overflows to inf, as an AMP scale may
    loss = F.cross_entropy(model(x), y)  # nothing learned from the last: it collects again
    assert ap.collecting and ap.reallocations == 0 and not ap.slots
    loss.backward()
    model(x)
    assert not ap.collecting and ap.reallocations == 1
    assert all(s.cost.sum() > 0 for s in ap.slots)
    assert ap.mean_bits == pytest.approx(2.0, abs=0.05)


@pytest.mark.parametrize(("shape", "group"), [((8, 512), 256), ((8, 128), 256), ((6, 100), 64)])
def test_row_noise_is_the_noise_the_rows_packing_reports(shape, group):
    """A statistics step packs a [batch, features] input by feature and reads its samples'
    noise from its rows' ranges: the figure packing it in row groups reports."""
    from actune.packing.tensors import quantize_checked

    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    t *= torch.logspace(-1, 1, shape[1])  # (features of other scales)
    packed = quantize_checked(t, 2, group, 1)
    # (within the 16-bit steps the packed metadata keeps)
    torch.testing.assert_close(autoprec.row_noise(t, shape[0], group),
                               autoprec.rounding_noise(packed, shape[0]), rtol=1e-2, atol=0)


def test_a_classifiers_pooled_input_is_grouped_by_feature_in_the_statistics_step():
    """wav2vec 2.0's head reads mean-pooled features of scales 0.1 to 10: grouped along each
    sample (as per-sample widths pack them) at the statistics step's uniform 2 bits, the
    step's gradient was 20x noisier than ``compressed("L3")``'s, which groups it by feature;
    now the two agree within their noise."""
    torch.manual_seed(0)
    head = torch.nn.Linear(256, 4)
    scales = torch.logspace(-1, 1, 256)
    x = torch.randn(32, 256) * scales
    y = torch.randint(0, 4, (32,))

    def gradient(model, scope) -> torch.Tensor:
        model.zero_grad()
        with scope():
            F.cross_entropy(model(x * 1.0), y).backward()
        return model.weight.grad.clone()

    exact = gradient(head, contextlib.nullcontext)
    errors = {}
    for name, model, scope in (
            ("uniform", head, lambda: actune.compressed("L3")),
            ("statistics", actune.compress(copy.deepcopy(head), "L3"), contextlib.nullcontext)):
        torch.manual_seed(1)
        errors[name] = ((gradient(model, scope) - exact).norm() / exact.norm()).item()
    assert errors["statistics"] < 2 * errors["uniform"], errors
