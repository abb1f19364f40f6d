"""A plain ``F.cross_entropy(lm_head(h), y)`` in a model of one's own: the marked head returns
lazy logits and the loss runs in chunks, at an exact level and under compression; every other
use of the logits computes them, and gradients stay PyTorch's."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import actune
from actune.memory.heap import allocation_peak
from actune.substitutes.lazy_logits import LazyLogits, is_head

VOCAB = 9000


class TinyLM(nn.Module):
    """nanoGPT's shape: embedding, a block, a final norm, a linear head (tied or not)."""

    def __init__(self, tied: bool = True, bias: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.ln_f = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, VOCAB, bias=bias)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        return self.lm_head(self.ln_f(x + self.mlp(x)))


IDX = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))
TARGETS[0, :5] = -1


def _model(**kw) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(**kw)


def _nano_loss(logits, targets=TARGETS):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _step(model, level, chunk, loss_of=_nano_loss):
    model.zero_grad(set_to_none=True)
    actune.chunk_loss(model, on=chunk)
    with actune.compressed(level):
        logits = model(IDX)
        loss = loss_of(logits)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return type(logits), loss.detach(), grads


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("tied, bias", [(True, False), (False, True)])
def test_the_loss_in_chunks_is_the_models_own(tied, bias):
    model = _model(tied=tied, bias=bias)
    kind, loss, exact = _step(model, "L0", False)
    assert kind is torch.Tensor
    kind, chunked_loss, chunked = _step(model, "L0", True)  # (the tuner's lce)
    assert kind is LazyLogits
    assert torch.allclose(chunked_loss, loss, rtol=1e-5) and _rel(chunked, exact) < 1e-5
    kind, _, eight = _step(model, "u8", True)
    assert kind is LazyLogits and _rel(eight, exact) < 0.03
    actune.chunk_loss(model, on=False)
    assert not is_head(model.lm_head.weight) and "forward" not in model.lm_head.__dict__


def test_the_logits_are_never_whole():
    model = _model()
    peaks = {}
    for chunk in (False, True):
        actune.chunk_loss(model, on=chunk)

        def step():
            with actune.compressed("L3"):
                loss = _nano_loss(model(IDX.repeat(32, 1)), TARGETS.repeat(32, 1))
            loss.backward()
            model.zero_grad(set_to_none=True)
        step()
        peaks[chunk] = allocation_peak(step)
    logits = 128 * 24 * VOCAB * 4  # (106 MiB; the loss's chunks are 16 MiB)
    assert peaks[False] > logits and peaks[True] < 0.5 * logits, peaks


def test_every_other_use_computes_the_logits_and_gradients_stay_exact():
    """An argmax, a cast and a slice of the tokens, a label-smoothed loss on them (which runs
    on computed logits) and a soft cap written in place, beside the loss in chunks."""
    def losses(logits):
        accuracy = (logits.argmax(-1) == TARGETS).float().mean()
        shifted = logits.float()[:, :-1].reshape(-1, VOCAB)
        smooth = F.cross_entropy(shifted, TARGETS[:, 1:].clamp(min=0).reshape(-1),
                                 label_smoothing=0.1)
        return _nano_loss(logits) + smooth + 0 * accuracy

    model = _model()
    _, loss, exact = _step(model, "L0", False, losses)
    kind, lazy_loss, grads = _step(model, "L0", True, losses)
    assert kind is LazyLogits
    assert torch.allclose(lazy_loss, loss, rtol=1e-5) and _rel(grads, exact) < 1e-5

    def capped(logits):
        logits.mul_(0.5).add_(1.0)  # (written in place: then computed, not in chunks)
        return _nano_loss(logits)

    _, loss, exact = _step(model, "L0", False, capped)
    _, lazy_loss, grads = _step(model, "L0", True, capped)
    assert torch.allclose(lazy_loss, loss, rtol=1e-5) and _rel(grads, exact) < 1e-5


def test_only_a_vocabularys_head_is_marked_and_a_module_loss_works():
    model = nn.Sequential(nn.Embedding(9000, 32), nn.Linear(32, 8192), nn.ReLU(),
                          nn.Linear(8192, 32), nn.Linear(32, 9001))
    assert actune.chunk_loss(model) == 0  # an up projection, a classifier of its own labels
    small = nn.Sequential(nn.Embedding(4000, 32), nn.Linear(32, 4000))
    assert actune.chunk_loss(small) == 0  # a small vocabulary
    model = _model()
    assert actune.chunk_loss(model) == 1
    loss_module = nn.CrossEntropyLoss(ignore_index=-1)
    _, loss, grads = _step(model, "L3", True, lambda t: loss_module(t.view(-1, VOCAB),
                                                                   TARGETS.view(-1)))
    _, exact_loss, exact = _step(model, "L0", False)
    assert torch.allclose(loss, exact_loss, rtol=1e-3) and _rel(grads, exact) < 0.3


def test_a_hugging_face_masked_lm_nobody_wrote_for_actune():
    """BERT's MLM head (a linear with a bias, under a transform) is not a causal LM: its head
    is marked, and its own CrossEntropyLoss of ``prediction_scores.view(-1, vocab)`` runs in
    chunks."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(config)
    labels = torch.full_like(IDX, -100)
    labels[:, ::3] = IDX[:, ::3]

    loss, exact = _bert_step(model, False, labels)
    chunked_loss, chunked = _bert_step(model, True, labels)
    assert torch.allclose(chunked_loss, loss, rtol=1e-5) and _rel(chunked, exact) < 1e-4


def _bert_step(model, chunk, labels):
    model.zero_grad(set_to_none=True)
    actune.chunk_loss(model, on=chunk)
    out = model(input_ids=IDX, labels=labels)
    assert isinstance(out.logits, LazyLogits) is chunk
    out.loss.backward()
    return out.loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()
                                         if p.grad is not None])


def test_the_tuner_estimates_the_loss_in_chunks(tmp_path):
    from actune.tune.probe import Trial
    from actune.tune.workload import load

    source = tmp_path / "tiny_lm.py"
    source.write_text(
        "import torch, torch.nn.functional as F\n"
        "from tests.substitutes.test_lazy_logits import TinyLM, VOCAB\n"
        "def build_model():\n    return TinyLM()\n"
        "def make_batch(batch_size):\n"
        "    return (torch.randint(0, VOCAB, (batch_size, 24)),\n"
        "            torch.randint(0, VOCAB, (batch_size, 24)))\n"
        "def loss_fn(logits, targets):\n"
        "    return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))\n")
    work = load(source)
    plain = Trial(work, "L0", {}).peak(16).total
    chunked = Trial(work, "lce", {}).peak(16).total
    assert chunked < plain - 0.7 * 16 * 24 * VOCAB * 4


@pytest.mark.parametrize("level", ["lce", "L3"])
def test_the_estimate_of_a_model_of_ones_own_agrees_with_the_measured_cpu_peak(level):
    from pathlib import Path

    from actune.tune.probe import Trial
    from actune.tune.workload import load

    work = load(Path(__file__).parents[2] / "docs" / "examples" / "nanogpt.py")
    sizes = {"depth": 0.08, "resolution": 32}
    estimate = Trial(work, level, sizes, "estimate").peak(2)
    measured = Trial(work, level, sizes, "measure").peak(2)
    assert abs(estimate.total - measured.total) <= 0.02 * measured.total
