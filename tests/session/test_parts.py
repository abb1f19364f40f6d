"""The session's parts on their own: accounting, the packed-storage cache, the packer, and the
routing mode a rule sends calls back through."""

import gc

import torch
import torch.nn.functional as F  # noqa: N812

import actune
from actune import tunables
from actune.levels import get_level
from actune.packing.saved import Saved
from actune.session.accounting import Accounting, CompressionStats, storage_key
from actune.session.hooks import Session
from actune.session.packed_cache import PackedCache
from actune.session.routing import FunctionMode


def test_accounting_counts_each_storage_once_and_only_when_read():
    acc = Accounting()
    t = torch.randn(64, 64)
    assert acc.count(t) and acc.stats.saved_bytes == 0  # nothing reads the counts: skipped
    acc.set_sink(lambda stats: None)
    assert acc.count(t) and acc.stats.saved_bytes == t.nbytes
    assert not acc.count(t[:]) and acc.stats.saved_bytes == t.nbytes  # same view, same storage
    acc.forget(t)  # written over in place: counted again
    assert acc.count(t) and acc.stats.saved_bytes == 2 * t.nbytes


def test_accounting_hands_its_statistics_to_the_sink_once_and_starts_afresh():
    got: list[CompressionStats] = []
    acc = Accounting()
    acc.set_sink(got.append)
    t = torch.randn(32, 32)
    acc.count(t)
    acc.held(100, "matmul", ())
    acc.kept_exact(torch.randn(8), True, "cross_entropy", small=False)
    acc.close()
    assert len(got) == 1 and got[0].packed == 1 and got[0].by_kind["matmul"] == 100
    assert got[0].exact == {"cross_entropy": 32} and got[0].kept_bytes == 132
    assert acc.sink is None and not acc.counting and acc.stats.packed == 0


def test_accounting_forgets_dead_storages_past_its_limit(monkeypatch):
    monkeypatch.setattr(tunables, "SEEN_LIMIT", 4)
    acc = Accounting()
    acc.set_budgeted(True)
    for _ in range(12):
        acc.count(torch.randn(4))  # each dies at once
    gc.collect()
    assert len(acc.seen) <= 8  # dropped at the limit, not grown without end


def test_the_cache_shares_a_packed_value_while_its_tensor_and_a_reader_live():
    cache = PackedCache()
    t = torch.randn(16)
    key = storage_key(t, 2)
    saved = Saved(actune.quantize(t, 2), False, None)
    cache.remember(key, t, saved)
    assert cache.find(key) is saved
    assert cache.find(storage_key(t, 4)) is None  # another width: another value
    del saved
    gc.collect()
    assert cache.find(key) is None and key not in cache.entries  # freed with its last reader


def test_the_packer_packs_at_fixed_bits_and_accounts_what_it_replaces():
    s = Session()
    s.accounting.set_sink(lambda stats: None)
    s._set_level(get_level("u2"))
    x = torch.randn(256, 64)
    saved = s.packer.pack_fixed(x, 4, "attention q", replaces=(x,))
    assert saved.packed.bits == 4 and saved.nbytes < x.nbytes / 4
    stats = s.accounting.stats
    assert stats.saved_bytes == x.nbytes and stats.by_kind["attention q"] == saved.nbytes
    with torch.no_grad():  # (read outside backward)
        assert torch.allclose(saved.get(), x, atol=float(x.abs().max()) / 4)


def test_the_packer_seeds_a_context_from_one_draw():
    s = Session()
    s._set_level(get_level("u2"))
    torch.manual_seed(0)
    first = [s.packer.draw_seed(torch.empty(1)) for _ in range(3)]
    assert first[1] == first[0] + 1 and first[2] == first[0] + 2  # consecutive after one draw
    s.packer.clear()
    torch.manual_seed(0)
    assert s.packer.draw_seed(torch.empty(1)) == first[0]  # torch's seed repeats a run


def test_a_rule_sends_calls_back_through_the_session_it_is_given():
    s = Session()
    mode = s.routing()
    assert isinstance(mode, FunctionMode) and mode.s is s


def test_the_session_compresses_only_where_its_hooks_save():
    stats: list[CompressionStats] = []
    x = torch.randn(32, 128, requires_grad=True)
    w = torch.randn(128, 128, requires_grad=True)
    with actune.compressed("u2", stats=stats.append):
        y = F.linear(x, w).relu()
    y.sum().backward()
    assert stats[0].packed >= 1 and stats[0].ratio > 4  # the routed linear and relu packed
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        s = Session()
        s._set_level(get_level("u2"))
        assert not s.compressing()  # another's hooks save here
