"""The function mode's eager path: calls without a rule run at once, labelled as having none;
and a compressed step reads no value back to the host (checked on the meta device, where any
such read raises)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import actune
from actune.session import routing
from actune.session.hooks import _session


def test_a_call_without_a_rule_keeps_what_it_saves_exact_and_restores_the_labels():
    stats = []
    x = torch.randn(64, 64, requires_grad=True)
    with actune.compressed("u2", stats=stats.append):
        s = _session()
        y = torch.cumprod(x, 1)  # no rule of its own, not pointwise: exact
        rule, label = routing._ROUTES[torch.cumprod]  # (decided once, then looked up)
        assert rule is None and label.op is torch.cumprod and label.kind is None
        assert s.label is routing.OUTSIDE_OPS  # the label as before the call
        z = F.linear(y, torch.nn.Parameter(torch.randn(64, 64)))  # a rule's call after it packs
    (z.sum()).backward()
    assert stats[0].exact.get("cumprod", 0) >= x.nbytes  # input and output kept as they are
    assert stats[0].packed >= 1
    g = torch.autograd.grad(torch.cumprod(x, 1).sum(), x)[0]
    x.grad = None
    with actune.compressed("u2"):
        torch.cumprod(x, 1).sum().backward()
    assert torch.equal(x.grad, g)  # exact: the same gradient as plain PyTorch


def test_a_query_runs_at_once_and_a_rule_call_without_gradients_runs_as_it_is():
    x = torch.randn(8, 16)
    with actune.compressed("u2", stats=[].append):
        assert x.dim() == 2 and routing._ROUTES[torch.Tensor.dim][0] is routing._QUERY
        with torch.no_grad():
            assert torch.equal(F.relu(x), x.clamp_min(0))


def _meta_models():
    import transformers

    convnet = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                            nn.Conv2d(16, 16, 3, padding=1), nn.Hardswish(),
                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2))
    return {"convnet": (convnet, lambda m: F.cross_entropy(
                m(torch.randn(4, 3, 16, 16, device="meta")),
                torch.zeros(4, dtype=torch.long, device="meta"))),
            "llama": (llama, lambda m: m(input_ids=torch.zeros(2, 32, dtype=torch.long,
                                                                device="meta"),
                                         labels=torch.zeros(2, 32, dtype=torch.long,
                                                            device="meta")).loss)}


@pytest.mark.parametrize("level", ["L2", "L3", "u8"])
def test_a_compressed_step_reads_no_value_back_on_the_meta_device(level):
    # A meta tensor has no values: .item(), bool() or a copy to the host raises. A step that
    # packs and unpacks through every rule it meets there takes no host read of a device value
    # (what would make a GPU wait: the per-tensor path must never synchronise).
    with pytest.raises(RuntimeError):
        torch.ones(1, device="meta").item()
    for name, (model, loss_of) in _meta_models().items():
        model.to("meta").train()
        stats = []
        with actune.compressed(level, stats=stats.append):
            loss = loss_of(model)
        loss.backward()
        assert stats[0].packed >= 3, name
        assert all(p.grad is not None and p.grad.is_meta for p in model.parameters()
                   if p.requires_grad), name


def test_a_rule_changed_after_a_call_applies_to_the_next():
    from actune.rules import RULES, Rule

    x = torch.randn(64, 64, requires_grad=True)

    def packed(func) -> int:
        stats = []
        with actune.compressed("u8", stats=stats.append):
            func(x)
        return stats[0].packed

    assert packed(torch.sigmoid) == 1  # (its derivative: routed, then remembered)
    own = RULES[torch.sigmoid]
    RULES[torch.sigmoid] = Rule("activation", None)  # (a rule keeping what it saves exact)
    try:
        assert torch.sigmoid not in routing._ROUTES  # (forgotten at the change)
        assert packed(torch.sigmoid) == 0
    finally:
        RULES[torch.sigmoid] = own
    assert packed(torch.sigmoid) == 1


def test_a_converted_model_reads_no_value_back_on_the_meta_device():
    # compress(): the allocator's statistics step (the first) watches every op's output and
    # plans every slot without a host read either; the next step's fold is the one transfer.
    # (A causal LM is called with use_cache=True: without a cache, which compress() does not
    # build unless asked, Hugging Face's own check for packed sequences reads a value back.)
    models = _meta_models()
    llama, _ = models["llama"]
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    models["llama"] = (llama, lambda m: m(input_ids=ids, labels=ids, use_cache=True).loss)
    for name, (model, loss_of) in models.items():
        model.to("meta").train()
        actune.track_stats(actune.compress(model, "L3"))
        loss_of(model).backward()
        assert actune.stats_of(model).packed >= 3, name
        assert actune.autoprec_of(model).collecting, name


class _Cumulative(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(x, -1)  # (no rule: what it saves stays exact)


def test_a_converted_step_between_statistics_steps_routes_only_ruled_calls(monkeypatch):
    # Between the allocator's statistics steps a call without a rule runs at once, as under
    # compressed(), and nothing is counted; a statistics step watches every call and counts
    # each storage once (its budget's shared slots)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _Cumulative(), nn.ReLU(), nn.Linear(32, 4))
    actune.compress(model, "L3", every=2)
    routed = []
    run = routing.FunctionMode._routed

    def spy(self, func, rule, args, kwargs):
        routed.append((func, rule is not None, self.s.accounting.counting))
        return run(self, func, rule, args, kwargs)

    monkeypatch.setattr(routing.FunctionMode, "_routed", spy)
    x = torch.randn(8, 16)
    steps = []
    for _ in range(3):
        routed.clear()
        model(x).square().mean().backward()
        steps.append(list(routed))
    statistics, between, again = steps
    assert (torch.cumprod, False, True) in statistics
    assert all(counting for *_, counting in statistics)
    assert between and all(ruled and not counting for _, ruled, counting in between)
    assert {func for func, *_ in between} == {F.linear, F.relu}
    assert again == statistics  # (every=2: the third step collects again)


def test_a_layer_with_a_trainable_weight_is_labelled_once_per_shapes_and_level():
    from actune.rules import RULES

    x = torch.randn(4, 16, 32, requires_grad=True) * 1.0  # (an activation, not a leaf)
    trainable = nn.Linear(32, 256)  # (8x wider: its input takes the level's narrow width)
    frozen = nn.Linear(32, 256).requires_grad_(False)

    def calls():
        for _ in range(2):
            trainable(x)
            frozen(x)
            F.linear(x, trainable.weight)
            F.linear(x[:, :8], trainable.weight)  # (other shapes: a label of their own)

    labels = []  # what the pack hook reads for each call: the label its rule runs under
    spy_rule = RULES[F.linear]

    def capture(s, func, args, kwargs, level):
        labels.append(s.label)
        return spy_rule.replace(s, func, args, kwargs, level)

    RULES[F.linear] = dataclasses.replace(spy_rule, replace=capture)
    try:
        with actune.compressed("L3"):
            calls()
        at_l3 = labels[:]
        labels.clear()
        with actune.compressed("L3"):
            calls()
        again = labels[:]
        labels.clear()
        with actune.compressed("u8"):
            calls()
        at_u8 = labels[:]
        labels.clear()
        RULES[F.linear] = dataclasses.replace(spy_rule, replace=capture, width=None,
                                             features_last=False)
        with actune.compressed("L3"):
            calls()
        replaced = labels[:]
    finally:
        RULES[F.linear] = spy_rule
    # each call's label as the full derivation gives it: a widening layer's input at the
    # narrow width, a frozen weight's shapes kept exact, other shapes their own label
    assert [lab.kind for lab in at_l3[:4]] == [routing.NARROW] * 4
    assert at_l3[1].frozen_shapes == {frozen.weight.shape, frozen.bias.shape}
    assert at_l3[0].frozen_shapes == () and at_l3[0].features
    # the same object for the same shapes, within a step and across steps at one level
    assert at_l3[0] is at_l3[4] is again[0] and at_l3[2] is at_l3[6]
    assert at_l3[2] is at_l3[0] and at_l3[3] is not at_l3[0]  # (a trainable bias or none)
    assert at_l3[1] is not at_l3[5]  # (a frozen weight: labelled from its arguments each call)
    conv = nn.Conv2d(4, 8, 3)
    images = torch.randn(2, 4, 9, 9, requires_grad=True) * 1.0
    with actune.compressed("L3"):
        s = _session()
        labels_of_convs = []
        for _ in range(2):
            conv(images)
            labels_of_convs.append(s.weighted_labels[(F.conv2d, images.shape,
                                                      conv.weight.shape)][1])
    assert labels_of_convs[0] is labels_of_convs[1] and labels_of_convs[0].kind == "matmul"
    assert at_u8[0] is not at_l3[0] and at_u8[2] is at_u8[6]  # (made again at another level)
    # a rule replaced since: its own label (what it saves kept exact)
    assert replaced[0] is not at_l3[0] and replaced[0].kind is None
    assert not replaced[0].features
