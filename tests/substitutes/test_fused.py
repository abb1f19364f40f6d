"""The fused table's run-time path: a listed class gets a forward that runs the one op while a
compressing block is open, its own forward otherwise; a class imported after the first block
is taken over at the next one; no module hook is added for any of it."""

import sys
import types

import torch
from torch import nn
from torch.nn.modules import module as nn_module

import actune
from actune.substitutes import fused


class Doubling(nn.Module):
    """A stand-in for an inline chain: ``x + x``, whose one op is ``2 * x``."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return x + x


def test_a_class_imported_after_the_first_block_is_taken_over_at_the_next(monkeypatch):
    actune_calls = []

    def one_op(module, x):
        actune_calls.append(x.shape)
        return x * 2

    library = types.ModuleType("late_library")
    monkeypatch.setitem(sys.modules, "late_library", library)  # (not its class yet)
    monkeypatch.setitem(fused.FUSED, "late_library.Doubling", fused.Fused("2x", one_op))
    monkeypatch.setattr(Doubling, "forward", Doubling.forward)  # (restored after the test)
    hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    x = torch.randn(64, 32, requires_grad=True)
    with actune.compressed("u8"):
        Doubling()(x)
    assert not actune_calls  # the class was not importable when the block opened
    Doubling.__module__ = "late_library"
    library.Doubling = Doubling
    monkeypatch.setitem(sys.modules, "late_library_marker", types.ModuleType("marker"))
    with actune.compressed("u8"):
        y = Doubling()(x)
    assert actune_calls == [x.shape] and torch.equal(y, 2 * x)
    before = Doubling.calls
    assert torch.equal(Doubling()(x), x + x) and Doubling.calls == before + 1  # own, outside
    with actune.compressed("L0"):
        Doubling()(x)  # an exact level: its own forward
    assert len(actune_calls) == 1
    assert (len(nn_module._global_forward_pre_hooks),
            len(nn_module._global_forward_hooks)) == hooks


def test_a_fused_rms_norm_asks_the_function_mode_for_its_one_op_alone(monkeypatch):
    # its checks read the input's and weight's dtype and shape: outside the mode's own
    # handling each read would be a call of the mode (four a layer, before the op)
    import transformers

    from actune.session.routing import FunctionMode

    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(64)
    seen = []
    own = FunctionMode.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return own(self, func, types, args, kwargs)

    x = torch.randn(2, 8, 64, requires_grad=True) * 1.0
    with actune.compressed("L3"):
        monkeypatch.setattr(FunctionMode, "__torch_function__", spy)
        y = norm(x)
        monkeypatch.undo()
    assert seen == [torch.rms_norm]
    expected = torch.rms_norm(x, (64,), norm.weight, norm.variance_epsilon)
    assert torch.allclose(y, expected)
    with actune.compressed("L3"):
        assert torch.equal(norm(x.double()), norm.forward.__actune_own_forward__(norm, x.double()))
