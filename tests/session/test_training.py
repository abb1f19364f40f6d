"""Compressed training: levels, compress() / compressed(), and the numerics that must hold."""

import copy
import datetime
import inspect
import io
import math
import os
import tempfile
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import actune
from actune.apps import zoo
from actune.convert import compress, decompress, is_compressed, summary
from actune.levels import LEVELS, Level, get_level, parse_levels
from actune.packing.saved import Saved
from tests.distributed import run_ranks


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1), nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class Block(nn.Module):
    """A transformer block written with functional calls."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.block = zoo._Block(dim, heads, 4 * dim, dropout=0.0)

    def forward(self, x):
        return self.block(x).square().mean()


def grads(model, inputs, level, seed=0, loss_fn=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with actune.compressed(level):
        out = model(*inputs)
        loss = loss_fn(out) if loss_fn else out
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def cnn_case():
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    return small_cnn(), (x,), lambda out: F.cross_entropy(out, y)


def block_case():
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(3))
    return Block(), (x,), None


# -- levels -----------------------------------------------------------------------------------


def test_levels_are_immutable_named_and_parse_ranges():
    assert [lv.name for lv in parse_levels("L0-L5")] == list(LEVELS)
    assert [lv.name for lv in parse_levels("l0, L3")] == ["L0", "L3"]
    assert get_level("l3") is LEVELS["L3"]
    with pytest.raises(ValueError, match="valid levels: L0, L1, L2, L3, L4, L5"):
        get_level("L9")
    with pytest.raises(ValueError, match="runs backwards"):
        parse_levels("L3-L1")
    with pytest.raises(AttributeError):
        LEVELS["L3"].matmul_bits = 8


def test_custom_level_round_trips_json_and_is_validated():
    mine = Level("mine", matmul_bits=4, other_bits=2, masks=True, group_size=128)
    assert Level.from_json(mine.to_json()) == mine
    with pytest.raises(ValueError, match="other_bits"):
        Level("bad", other_bits=3)
    with pytest.raises(ValueError, match="sensitive_bits"):
        Level("bad", other_bits=2, sensitive_bits=5)
    assert Level("plain", other_bits=2).sensitive_width == 2  # unset: other_bits
    assert Level("set", other_bits=2, sensitive_bits=8).sensitive_width == 8
    assert Level("none", matmul_bits=4, sensitive_bits=8).sensitive_width is None  # others exact


# -- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [cnn_case, block_case])
def test_l0_gradients_are_bit_identical_to_pytorch(case):
    model, inputs, loss_fn = case()
    plain = grads(model, inputs, "L0", loss_fn=loss_fn)
    model.zero_grad()
    out = model(*inputs)
    (loss_fn(out) if loss_fn else out).backward()
    for name, p in model.named_parameters():
        assert torch.equal(plain[name], p.grad), name


def test_compress_at_l0_leaves_plain_pytorch():
    model, _inputs, _loss_fn = cnn_case()
    compress(model, "L0")
    assert not is_compressed(model)


@pytest.mark.parametrize("case", [cnn_case, block_case])
def test_8_bits_is_close_to_exact(case):
    model, inputs, loss_fn = case()
    exact = grads(model, inputs, "L0", loss_fn=loss_fn)
    eight = grads(model, inputs, Level("L8", matmul_bits=8, other_bits=8, masks=True),
                  loss_fn=loss_fn)
    scale = max(g.abs().max().item() for g in exact.values())
    for name, g in exact.items():  # tolerance: 3% of the largest gradient entry
        assert (eight[name] - g).abs().max().item() <= 0.03 * scale, name


def shrinks_like_noise(samples: torch.Tensor, exact: torch.Tensor, small=16, large=256) -> float:
    """||mean of `large` samples - exact|| / ||mean of `small` samples - exact||.

    Unbiased estimates average their noise away: the ratio is about sqrt(small / large) = 0.25.
    A bias does not average away: the ratio tends to 1. (The ratio of norms over many
    elements is stable where per-element z-scores are not: rare rounding events make the
    sample variance of single elements unreliable.)
    """
    err = [(samples[:k].mean(0) - exact).norm() for k in (small, large)]
    return (err[1] / err[0]).item()


@pytest.mark.parametrize("case", [cnn_case, block_case])
@pytest.mark.parametrize("level", ["L2", "L3"])
def test_quantized_gradients_are_unbiased_per_layer(case, level):
    # (at L3, GELU's input rounded at 4 bits: its derivative and the rebuilt output are
    # corrected for the bias of a function of a rounded value, to first order)
    lv = actune.get_level(level)
    model, inputs, loss_fn = case()
    exact = grads(model, inputs, "L0", loss_fn=loss_fn)
    runs = [grads(model, inputs, lv, seed=s, loss_fn=loss_fn) for s in range(256)]
    scale = sum(g.norm() ** 2 for g in exact.values()).sqrt()
    checked = 0
    for name, g in exact.items():
        if g.norm() < 1e-3 * scale:
            continue  # e.g. conv biases before batch norm: their true gradient is ~0
        stack = torch.stack([r[name] for r in runs])
        if (stack[0] - g).norm() < 1e-6 * g.norm():
            continue  # exact for this layer (nothing quantized feeds it)
        assert shrinks_like_noise(stack, g) < 0.4, name
        checked += 1
    assert checked >= 3


def _op_cases():
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(7)) / 8
    conv_w = torch.randn(6, 4, 3, 3, generator=torch.Generator().manual_seed(8)) / 4
    return {
        "softmax": (lambda t: torch.softmax(t, -1), (16, 64)),
        "gelu": (F.gelu, (16, 64)),
        "gelu_tanh": (lambda t: F.gelu(t, approximate="tanh"), (16, 64)),
        "silu": (F.silu, (16, 64)),
        "sigmoid": (torch.sigmoid, (16, 64)),
        "tanh": (torch.tanh, (16, 64)),
        "linear_weight_grad": (lambda t: F.linear(t, w).square(), (16, 64)),
        "matmul": (lambda t: (t @ t.transpose(-1, -2)).square(), (16, 64)),
        # norms: the input is made a non-leaf (a leaf's saved input stays a reference)
        "layer_norm": (lambda t: F.layer_norm(t * 1.0, (64,)).square(), (16, 64)),
        # norms' backward is quadratic in the saved input: a bias of order (quantization
        # variance) / (elements reduced over), invisible at the sizes of real layers (here
        # 1024 per channel); with 16 it shows (see docs/training.md)
        "batch_norm": (lambda t: F.batch_norm(t * 1.0, None, None, training=True).square(),
                       (16, 4, 8, 8)),
        "conv": (lambda t: F.conv2d(t, conv_w, padding=1).square(), (4, 4, 8, 8)),
    }


@pytest.mark.parametrize("op", list(_op_cases()))
def test_each_compressed_op_has_an_unbiased_input_gradient(op):
    fn, shape = _op_cases()[op]
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 2).requires_grad_()
    g = torch.randn(fn(x).shape, generator=torch.Generator().manual_seed(5))
    (exact,) = torch.autograd.grad(fn(x), x, g)
    samples = []
    for s in range(512):
        torch.manual_seed(100 + s)
        with actune.compressed(Level("t", matmul_bits=2, other_bits=2, masks=True,
                                     min_numel=1)):
            y = fn(x)
        samples.append(torch.autograd.grad(y, x, g)[0])
    samples = torch.stack(samples)
    assert (samples[0] - exact).norm() > 1e-3 * exact.norm()  # it was quantized
    # unbiased: about sqrt(8 / 512) = 0.125 (measured 0.11-0.16); a single rounded softmax
    # copy used for both factors of its backward (biased) measures 0.26
    assert shrinks_like_noise(samples, exact, small=8, large=512) < 0.2


def test_masks_give_pytorchs_gradients_exactly_for_relu_maxpool():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.ReLU6(), nn.LeakyReLU(0.1),
                          nn.MaxPool2d(2))
    x = torch.randn(4, 8, 17, 17, requires_grad=True)
    y = model(x)
    g = torch.randn(y.shape)
    (ref,) = torch.autograd.grad(y, x, g)
    for level in (Level("masks", masks=True), "L3", "L2"):
        with actune.compressed(level):
            y = model(x)
        (got,) = torch.autograd.grad(y, x, g)
        assert torch.equal(got, ref), level


def test_inplace_relu_mask_is_exact_at_l3():
    x = torch.randn(64, 300, requires_grad=True)
    g = torch.randn(64, 300)
    (ref,) = torch.autograd.grad(torch.relu(x * 1.0), x, g)
    with actune.compressed("L3"):
        y = torch.relu_(x * 1.0)
    (got,) = torch.autograd.grad(y, x, g)
    assert torch.equal(got, ref)


def test_dropout_mask_is_drawn_again_in_backward_and_exact():
    x = torch.randn(32, 512, requires_grad=True)
    g = torch.randn(32, 512)
    st = []
    torch.manual_seed(0)
    with actune.compressed("L3", stats=st.append):
        y = F.dropout(x, 0.3, training=True)
        y2 = F.dropout(x, 0.3, training=True)
    (got,) = torch.autograd.grad(y, x, g)
    keep = y != 0
    assert torch.equal(got, g * keep.float().div_(0.7))  # PyTorch's dropout backward
    assert torch.allclose(y[keep], x[keep] / 0.7, rtol=1e-6, atol=0)
    assert 0.69 < keep.float().mean() < 0.71  # 16,384 draws: 0.7 +- 0.0036 (1 sd)
    assert not torch.equal(keep, y2 != 0)  # each call its own mask
    assert st[0].by_kind["mask"] == 0  # on the CPU nothing is kept: the mask is drawn again
    torch.manual_seed(0)
    with actune.compressed("L3"):
        again = F.dropout(x, 0.3, training=True)
    assert torch.equal(again, y)  # torch.manual_seed repeats the masks


# -- memory -----------------------------------------------------------------------------------


def activation_ratio(model, inputs, level, loss_fn=None):
    st = []
    with actune.compressed(level, stats=st.append):
        out = model(*inputs)
    (loss_fn(out) if loss_fn else out).backward()
    return st[0]


def test_resnet50_activations_shrink_over_14x_at_l3():
    model = zoo.resnet(50)
    x, y = zoo.make_batch(zoo.MODELS["resnet50"], 1, 224)
    st = activation_ratio(model, (x,), "L3", lambda o: F.cross_entropy(o, y))
    assert st.ratio >= 14.0, st


def test_transformer_activations_shrink_over_10x_at_l3():
    model = zoo.transformer(depth=0.5, width=0.25, resolution=64)
    x, y = zoo.make_batch(zoo.MODELS["transformer"], 2, 64)
    st = activation_ratio(model, (x,), "L3", lambda o: F.cross_entropy(o, y))
    assert st.ratio >= 10.0, st


def test_a_forward_draws_one_seed_and_manual_seed_repeats_its_rounding(monkeypatch):
    from actune.session import packer as keeping

    draws = []
    real = keeping.draw_seed
    monkeypatch.setattr(keeping, "draw_seed", lambda: draws.append(1) or real())
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                        nn.Linear(64, 8))
    x = torch.randn(32, 64)

    def grads(seed: int) -> list[torch.Tensor]:
        net.zero_grad()
        torch.manual_seed(seed)
        with actune.compressed("u2"):
            loss = net(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in net.parameters()]

    first = grads(1)
    assert len(draws) == 1  # one draw for the five tensors packed in that forward
    assert all(torch.equal(a, b) for a, b in zip(first, grads(1), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, grads(2), strict=True))


def test_parameters_are_never_quantized_and_cost_nothing():
    lin = nn.Linear(4096, 4)
    x = torch.randn(2, 4096)
    st = activation_ratio(lin, (x,), "L3", lambda o: o.sum())
    assert st.saved_bytes == 2 * 4096 * 4  # the input only: the weight stays a reference


def test_eval_and_no_grad_cost_nothing():
    model, inputs, _ = cnn_case()
    model.eval()
    stats = []
    with torch.no_grad(), actune.compressed("L3", stats=stats.append):
        model(*inputs)
    assert stats[0].packed == 0 and stats[0].saved_bytes == 0


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_backward_inside_the_context_frees_packed_values_as_it_goes(name, monkeypatch):
    """A loop inside one compressed(): each packed value goes once its reader has run (the
    layer norm's rebuilt outputs and the shared-storage cache hold them weakly), so backward
    in the context holds less and less, and no step keeps the one before it."""
    if name == "cnn":
        model, inputs, _ = cnn_case()
        first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    else:
        torch.manual_seed(0)
        model = zoo.transformer(depth=0.5, width=0.25, resolution=32)
        inputs = (torch.randint(0, 1000, (4, 32)),)
        first = model.blocks[0]
    made = weakref.WeakSet()  # every packed value made, held weakly
    init = Saved.__init__

    def tracked(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        made.add(self)

    monkeypatch.setattr(Saved, "__init__", tracked)
    seen: dict[str, int] = {}

    def at_first(*_) -> None:
        seen.setdefault("first", len(made))

    first.register_full_backward_pre_hook(at_first)
    with actune.compressed("L3"):
        for _ in range(3):
            seen.pop("first", None)
            loss = model(*inputs).float().pow(2).mean()
            seen["forward"] = len(made)
            loss.backward()
            del loss
            assert seen["forward"] > 0
            assert seen["first"] < seen["forward"]  # the later layers' values are gone
            assert len(made) == 0


# -- compress() -------------------------------------------------------------------------------


def test_compress_keeps_weights_state_dict_and_modes():
    model, inputs, _loss_fn = cnn_case()
    model.eval()
    before = dict(model.state_dict(keep_vars=True))
    hook_calls = []
    model[0].register_forward_hook(lambda *a: hook_calls.append(1))
    assert compress(model, "L3") is model
    after = dict(model.state_dict(keep_vars=True))
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    assert not model.training
    model(*inputs)
    assert hook_calls == [1]
    kinds = {row.layer: row for row in summary(model)}
    assert kinds["Conv2d"].converted and kinds["ReLU"].converted
    assert not kinds["AdaptiveAvgPool2d"].converted
    assert "never substituted" in kinds["AdaptiveAvgPool2d"].keeps
    assert type(model[7]) is nn.AdaptiveAvgPool2d  # average pooling is never replaced


def test_checkpoints_load_both_ways_and_compressed_models_pickle():
    plain, _, _ = cnn_case()
    comp, _, _ = cnn_case()
    compress(comp, "L3")
    comp.load_state_dict(plain.state_dict())
    plain.load_state_dict(comp.state_dict())
    buf = io.BytesIO()
    torch.save(comp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert is_compressed(loaded)
    # its forward (the instance's: the traced rules' entry under torch.compile) is the
    # copy's own, in a load and a deep copy alike, and names the model's arguments
    twin = copy.deepcopy(comp)
    x = cnn_case()[1][0]
    comp.eval()
    for model in (loaded, twin):
        assert model.forward.module is model
        assert list(inspect.signature(model.forward).parameters) == ["input"]
        assert torch.equal(model.eval()(x), comp(x))


def test_compress_twice_then_decompress_restores_plain_layers():
    model, _inputs, _loss_fn = cnn_case()
    types = [type(m) for m in model]
    compress(model, "L2")
    compress(model, "L3")
    assert all(getattr(m, "_actune_level", LEVELS["L3"]).name == "L3" for m in model)
    decompress(model)
    assert [type(m) for m in model] == types
    assert not is_compressed(model)


def test_layers_inside_the_models_forward_enter_no_block_of_their_own(monkeypatch):
    """The model's forward runs under its level: its converted layers run their own code
    straight away (a block each would change nothing); a layer called alone, or under another
    level, still opens its own."""
    import actune.convert as convert

    calls = []
    real = convert._eager_forward
    monkeypatch.setattr(convert, "_eager_forward",
                        lambda m, *a, **k: calls.append(type(m).__name__) or real(m, *a, **k))
    torch.manual_seed(0)
    model = compress(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), "L2")
    x = torch.randn(32, 64, requires_grad=True)
    model(x).sum().backward()
    assert calls == []
    model[0](x).sum().backward()
    assert calls == ["CompressedLinear"]
    with actune.compressed("L3"):
        model[2](x).sum().backward()
    assert calls == ["CompressedLinear", "CompressedLinear"]


def test_compress_before_or_after_to_and_trains():
    model, inputs, loss_fn = cnn_case()
    compress(model, "L3").to(torch.float64)
    x = inputs[0].double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = loss_fn(model(x))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_several_models_at_different_levels_in_one_process():
    a, inputs, loss_fn = cnn_case()
    b, _, _ = cnn_case()
    compress(a, "L2")
    compress(b, "L3")
    ga = {n: p for n, p in a.named_parameters()}
    for m in (a, b):
        loss_fn(m(*inputs)).backward()
    assert all(p.grad is not None for p in ga.values())
    assert {m._actune_level.name for m in a.modules() if hasattr(m, "_actune_level")} == {"L2"}


def test_sync_batchnorm_converts():
    model = nn.SyncBatchNorm.convert_sync_batchnorm(small_cnn())
    keys = list(model.state_dict())
    compress(model, "L3")
    assert type(model[1]).__name__ == "CompressedSyncBatchNorm"
    assert list(model.state_dict()) == keys


# -- what must fail clearly, or work ----------------------------------------------------------


def test_double_backward_raises_a_clear_error():
    model, inputs, loss_fn = cnn_case()
    x = inputs[0].requires_grad_()
    with actune.compressed("L3"):
        loss = loss_fn(model(x))
    # the first backward that builds a graph is refused, before any wrong value exists
    with pytest.raises(actune.DoubleBackwardError, match="create_graph"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_torch_compile_of_a_compressed_cnn_is_close_to_exact():
    """Layers the traced rules do not cover (convolutions, ReLU, pooling) run as PyTorch's ops
    inside the graph; the linear head's input is packed: at 8 bits close to exact."""
    model = zoo.TinyCNN()
    model.features[-1].p = 0.0  # no dropout: eager and compiled draw no random numbers
    twin = copy.deepcopy(model)
    compress(twin, "u8")
    x = torch.randn(8, 1, 8, 8)
    y = torch.randint(0, 10, (8,))
    F.cross_entropy(model(x), y).backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    F.cross_entropy(torch.compile(twin)(x), y).backward()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert (a.grad - b.grad).norm() <= 0.05 * a.grad.norm() + 1e-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_activations_are_compressed_not_passed_through(dtype):
    model = zoo.transformer(depth=0.25, width=0.25, resolution=32)
    x, y = zoo.make_batch(zoo.MODELS["transformer"], 2, 32)
    st = []
    with torch.autocast("cpu", dtype=dtype), actune.compressed("L3", stats=st.append):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert st[0].packed > 0 and st[0].ratio > 5


def test_an_autocast_copy_of_a_weight_is_kept_exact():
    """The bfloat16 copy autocast makes of a weight (ToCopyBackward0 -> AccumulateGrad) is a
    parameter for the hooks: the input's gradient, read from it, is exactly autocast's own."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    grads, stats = [], []
    for level in ("L0", "L3"):
        with (torch.autocast("cpu", dtype=torch.bfloat16),
              actune.compressed(level, stats=stats.append)):
            loss = layer(x * 1).float().sum()  # (an activation's copy; nothing saved above)
        x.grad = None
        loss.backward()
        grads.append(x.grad.clone())
    assert stats[1].packed == 1  # the input's copy, read only for the weight's gradient
    assert torch.equal(grads[0], grads[1])


def test_a_training_step_runs_under_fake_tensor_mode():
    with FakeTensorMode(), torch.device("cpu"):
        model = compress(zoo.resnet(18), "L3")
        x = torch.randn(2, 3, 64, 64)
        loss = model(x).sum()
        loss.backward()
        assert model.conv1.weight.grad.shape == model.conv1.weight.shape


def _ddp_worker(rank: int, world: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                                         world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = compress(zoo.TinyCNN(), "L3")
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(16, 1, 8, 8, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    if rank == 0:
        torch.save(gathered, out)
    torch.distributed.barrier()  # rank 0 has written the result
    # gloo's teardown (destroy_process_group, or its threads at interpreter exit) hangs or
    # aborts a rank now and then: leave without it, the work being done and checked
    os._exit(0)


def test_distributed_data_parallel_ranks_stay_in_sync():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "params.pt")
        run_ranks(_ddp_worker, (2, os.path.join(tmp, "init"), out), seconds=120)
        a, b = torch.load(out)
    assert torch.equal(a, b)
    assert not torch.equal(a, torch.cat([p.reshape(-1) for p in zoo.TinyCNN().parameters()]))


def test_what_goes_wrong_without_the_safe_behaviour():
    """Documented failure modes, measured: why ReLU outputs use zero-code packing and softmax
    keeps two copies (docs/training.md)."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(64, 1024, generator=gen).relu()
    plain = actune.dequantize(actune.quantize(y, 2, seed=1))
    wrong = ((plain > 0) != (y > 0)).float().mean().item()
    assert wrong > 0.1  # a plain 2-bit copy loses >10% of the ReLU mask
    safe = actune.dequantize(actune.quantize(y, 2, seed=1, zero_code=True))
    assert torch.equal(safe > 0, y > 0)

    p = torch.softmax(torch.randn(16, 64, generator=gen) * 2, -1)
    g = torch.randn(16, 64, generator=gen)
    exact = p * (g - (g * p).sum(-1, keepdim=True))
    one, two = [], []
    for s in range(512):
        y1 = actune.dequantize(actune.quantize(p, 2, seed=2 * s + 1))
        y2 = actune.dequantize(actune.quantize(p, 2, seed=2 * s + 2))
        one.append(y1 * (g - (g * y1).sum(-1, keepdim=True)))
        two.append(y1 * (g - (g * y2).sum(-1, keepdim=True)))
    assert shrinks_like_noise(torch.stack(one), exact, small=8, large=512) > 0.2  # biased
    assert shrinks_like_noise(torch.stack(two), exact, small=8, large=512) < 0.2  # unbiased


def test_norm_statistics_stay_exact_and_only_the_input_is_rounded():
    # layer norm keeps its normalised input and its per-token rstd (PyTorch's keeps the input,
    # mean and rstd); with 1024 tokens rstd is large enough to be packed, but the backward
    # reads it nonlinearly: it stays exact
    x = torch.randn(16, 64, 64, requires_grad=True) * 1.0  # an activation, not a leaf
    w = torch.ones(64, requires_grad=True)
    seen = []
    with actune.compressed("L3", stats=seen.append):
        y = F.layer_norm(x, (64,), w)
    (y * torch.randn_like(y)).sum().backward()
    stats = seen[0]
    assert stats.packed == 1 and stats.kept == 1
    assert stats.by_kind["exact"] == 16 * 64 * 4  # rstd, float32


@pytest.mark.parametrize(("size", "kernel", "stride", "padding", "dilation"), [
    ((17, 17), (3, 3), (2, 2), (1, 1), (1, 1)),
    ((9, 12), (2, 3), (1, 2), (1, 1), (2, 1)),
    ((3, 2), (3, 3), (1, 1), (1, 1), (1, 1)),  # a window row as wide as the input
    ((2, 3), (3, 3), (1, 1), (1, 1), (1, 2)),  # wider: decomposed through coordinates
    ((8, 8), (2, 2), (2, 2), (0, 0), (1, 1)),
])
@pytest.mark.parametrize("path", ["numba", "numba-parallel", "torch"])
def test_max_pool_offsets_round_trip_to_pytorchs_indices(size, kernel, stride, padding,
                                                         dilation, path, monkeypatch):
    from actune.substitutes import max_pool_offsets
    from actune.substitutes.max_pool_offsets import indices_from_offsets, window_offsets
    from actune_kernels import pool

    if path == "torch":  # the path GPUs and fake tensors take
        monkeypatch.setattr(max_pool_offsets, "_numba_pool", lambda t, kernel: False)
    if path == "numba-parallel":  # (these sizes take the serial kernels otherwise)
        monkeypatch.setattr(pool, "SERIAL", 0)
    x = torch.randn(3, 5, *size, generator=torch.Generator().manual_seed(1))
    _, idx = F.max_pool2d(x, kernel, stride, padding, dilation, return_indices=True)
    offsets, spatial = window_offsets(idx, x.shape[-2:], kernel, stride, padding, dilation)
    assert offsets.dtype == torch.uint8 and int(offsets.max()) < kernel[0] * kernel[1]
    back = indices_from_offsets(offsets, spatial, kernel, stride, padding, dilation)
    assert torch.equal(back, idx)


def test_max_pool_offsets_32_bit_lanes_match_the_general_loop():
    """The vectorized path (window rows narrower than the input, unit dilation, indices in
    32 bits) gives the bytes of the general loop, which divides."""
    from actune_kernels import pool

    for size, k, s, p in (((17, 17), 3, 2, 1), ((9, 13), 2, 2, 0), ((30, 7), 3, 1, 1)):
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
        _, idx = F.max_pool2d(x, k, s, p, return_indices=True)
        rows = idx.reshape(6, -1).numpy()
        out_h, out_w = idx.shape[-2:]
        fast, general = (np.empty(rows.shape, dtype=np.uint8) for _ in range(2))
        for out, lanes32 in ((fast, True), (general, False)):
            pool._to_offsets_serial(rows, out, size[1], out_h, out_w, k, s, s, p, p, 1, 1,
                                    lanes32)
        assert np.array_equal(fast, general)
        assert int(general.max()) == k * k - 1  # every window position occurs


@pytest.mark.parametrize(("size", "kernel", "stride", "padding", "dilation"), [
    ((7, 9, 8), (3, 3, 2), (2, 2, 2), (1, 1, 0), (1, 1, 1)),
    ((6, 5, 7), (2, 3, 3), (1, 2, 1), (1, 1, 1), (2, 1, 2)),
])
def test_max_pool_3d_offsets_round_trip(size, kernel, stride, padding, dilation):
    from actune.substitutes.max_pool_offsets import indices_from_offsets, window_offsets

    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(2))
    _, idx = F.max_pool3d(x, kernel, stride, padding, dilation, return_indices=True)
    offsets, spatial = window_offsets(idx, x.shape[-3:], kernel, stride, padding, dilation)
    assert offsets.dtype == torch.uint8 and int(offsets.max()) < math.prod(kernel)
    assert torch.equal(indices_from_offsets(offsets, spatial, kernel, stride, padding,
                                             dilation), idx)
