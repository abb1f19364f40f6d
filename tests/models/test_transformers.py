"""Hugging Face transformers under actune: checkpointing, compress() of a whole model, FSDP2,
and a seeded training check (random init from configs: nothing is downloaded)."""

import contextlib
import copy
import datetime
import os
import tempfile

import pytest
import torch
import torch.utils.checkpoint as checkpoint
import transformers  # in the test extra
from torch import nn

import actune
from tests.distributed import run_ranks


def gpt2(layers=2, width=64, vocab=500, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab,
                                     n_positions=64, resid_pdrop=dropout, embd_pdrop=dropout,
                                     attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=172,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=500, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def t5(seed=0):
    """An encoder-decoder whose attention adds a learned relative position bias (SDPA)."""
    torch.manual_seed(seed)
    config = transformers.T5Config(vocab_size=500, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0,
                                   attn_implementation="sdpa")
    return transformers.T5ForConditionalGeneration(config)


def mixtral(seed=0):
    """A mixture of experts: each layer's tokens routed to 2 of 4 experts (F.grouped_mm)."""
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64,
                                        intermediate_size=172, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=500, bos_token_id=0,
                                        eos_token_id=0, pad_token_id=0)
    return transformers.MixtralForCausalLM(config)


IDS = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(0))


def flat_grads(model, level, stats=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with actune.compressed(level, stats=stats):
        loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("make", [gpt2, llama])
def test_saved_activations_shrink_over_10x_with_nothing_large_exact(make):
    model = make()
    st0, st3 = [], []
    flat_grads(model, "L0", st0.append)
    flat_grads(model, "L3", st3.append)
    assert st3[0].exact == {}, st3[0].describe_exact()
    assert st0[0].saved_bytes / st3[0].kept_bytes > 10


def test_a_mixture_of_experts_packs_its_experts_inputs():
    # its experts' grouped matmuls kept their inputs exact before they had a rule (3.7x at
    # L3 on a 2-layer Mixtral, 1.5 of 2.3 MiB exact): now packed like any linear layer's
    model = mixtral()
    st0, st3 = [], []
    exact = flat_grads(model, "L0", st0.append)
    flat_grads(model, "L3", st3.append)
    assert st3[0].exact == {}, st3[0].describe_exact()
    assert st0[0].saved_bytes / st3[0].kept_bytes > 10
    assert rel(flat_grads(model, "u8"), exact) < 0.01  # 0.54% measured


def test_t5s_learned_position_bias_is_packed_not_kept_exact():
    model = t5()
    st0, st3, st8 = [], [], []
    exact = flat_grads(model, "L0", st0.append)
    flat_grads(model, "L3", st3.append)
    got = flat_grads(model, "u8", st8.append)
    assert "scaled_dot_product_attention" not in st3[0].describe_exact()
    assert {"attention bias", "attention bias mask"} <= set(st3[0].by_kind)
    assert st0[0].saved_bytes / st3[0].kept_bytes > 7  # (3.2x when the bias kept it exact)
    assert rel(got, exact) < 0.03


def test_blooms_gelu_runs_as_one_op_not_its_own_autograd_function():
    """Bloom's tanh GELU is an autograd function of its own keeping its input exact (4.2x a
    2-layer Bloom kept at L3); it runs as F.gelu(approximate='tanh'), its derivative packed."""
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(
        hidden_size=64, n_layer=2, n_head=4, vocab_size=500))
    st = []
    exact = flat_grads(model, "L0")
    flat_grads(model, "L3", st.append)
    assert st[0].exact == {}, st[0].describe_exact()
    assert rel(flat_grads(model, "u8"), exact) < 0.03


@pytest.mark.parametrize("make", [gpt2, llama])
@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_gradient_checkpointing_inside_compressed(reentrant, make):
    model = make()
    exact = flat_grads(model, "L0")
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    st = []
    got = flat_grads(model, "u8", st.append)
    assert rel(got, exact) < 0.03  # (the recomputation's saved tensors packed too)
    assert "checkpoint boundary" in st[0].by_kind  # the blocks' inputs were packed
    twin = actune.compress(copy.deepcopy(model), "L3")  # and a compress()ed model, at L3
    twin.zero_grad(set_to_none=True)
    twin(input_ids=IDS, labels=IDS).loss.backward()
    l3 = torch.cat([p.grad.reshape(-1) for p in twin.parameters() if p.grad is not None])
    assert 0 < rel(l3, exact) < 2 and torch.isfinite(l3).all()


def test_checkpoint_of_a_compress_ed_model_and_torch_checkpoint_directly():
    model = gpt2()
    exact = flat_grads(model, "L0")
    twin = actune.compress(copy.deepcopy(model), "u8")
    twin.gradient_checkpointing_enable({"use_reentrant": False})
    twin.zero_grad(set_to_none=True)
    twin(input_ids=IDS, labels=IDS).loss.backward()
    got = torch.cat([p.grad.reshape(-1) for p in twin.parameters() if p.grad is not None])
    assert rel(got, exact) < 0.03
    # torch.utils.checkpoint around a plain function, backward inside the block too
    lin = nn.Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    with actune.compressed("u8"):
        y = checkpoint.checkpoint(lambda t: torch.tanh(lin(t)) * 2, x * 1.0, use_reentrant=False)
        y.square().sum().backward()
    ref = torch.autograd.grad(torch.tanh(lin(x * 1.0)).mul(2).square().sum(), x)[0]
    assert rel(x.grad, ref) < 0.03


def test_compress_covers_the_whole_hugging_face_model():
    model = gpt2()
    exact = flat_grads(model, "L0")
    actune.compress(model, "u8")
    model.zero_grad(set_to_none=True)
    model(input_ids=IDS, labels=IDS).loss.backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert 1e-4 < rel(got, exact) < 0.03  # rounded (attention, the loss...), and close
    actune.decompress(model)
    assert rel(flat_grads(model, "L0"), exact) < 1e-6


def test_compress_fuses_gpt2_inline_gelu_into_one_saved_derivative():
    from transformers.activations import FastGELUActivation, NewGELUActivation

    x = torch.randn(4, 300, requires_grad=True, generator=torch.Generator().manual_seed(0))
    for cls in (NewGELUActivation, FastGELUActivation):
        act, exact_stats, stats = cls(), [], []
        with actune.compressed("L0", stats=exact_stats.append):
            act(x).sum().backward()
        exact, x.grad = x.grad, None
        actune.compress(act, "u8")
        assert "F.gelu(approximate='tanh')" in actune.summary(act)[0].keeps
        with actune.compressed("u8", stats=stats.append):
            y = act(x)
        y.sum().backward()
        assert torch.allclose(y, cls()(x), atol=1e-5)  # the same function
        assert 0 < rel(x.grad, exact) < 0.02  # through one rounded derivative
        assert stats[0].packed == 1 and stats[0].kept_bytes < 1.2 * x.numel()  # one, 8 bits
        assert exact_stats[0].saved_bytes >= 3 * 4 * x.numel()  # the chain: three fp32 copies
        x.grad = None
        actune.decompress(act)
        assert type(act) is cls
    model = actune.compress(gpt2(), "L3")
    assert type(model.transformer.h[0].mlp.act).__name__ == "CompressedNewGELUActivation"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_runs_llamas_inline_rms_norm_as_one_op_shared_with_its_projections(dtype):
    # Llama's RMSNorm (cast, pow, mean, rsqrt, two products) keeps three tensors of the
    # model's width; converted, it keeps one packed normalised input, which the q, k, v (and
    # gate, up) projections reading its output rebuild theirs from
    model = llama().to(dtype)
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(2, 48, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    x.requires_grad_()
    reference = norm(x)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = torch.autograd.grad(reference, x, g)[0]
    actune.compress(model, "u8")
    assert type(norm).__name__ == "CompressedLlamaRMSNorm"
    assert "F.rms_norm" in next(r.keeps for r in actune.summary(model)
                                if r.name.endswith("layers.0.input_layernorm"))
    stats = []
    with actune.compressed("u8", stats=stats.append):
        y = norm(x)
        got = torch.autograd.grad(y, x, g)[0]
    assert stats[0].packed == 1  # the normalised input (rstd kept exact: small)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.float(), reference.float(), atol=tolerance, rtol=tolerance)
    assert 0 < rel(got.float(), exact.float()) < (0.02 if dtype == torch.float32 else 0.08)
    exact_grads = flat_grads(llama().to(dtype), "L0")
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model(input_ids=IDS, labels=IDS).loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert rel(grads.float(), exact_grads.float()) < (0.03 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_step(dtype):
    model = llama()
    with torch.autocast("cpu", dtype=dtype):
        exact = flat_grads(model, "L0")
        got = flat_grads(model, "u8")
    assert torch.isfinite(got).all()
    assert rel(got, exact) < 0.1


def test_a_compressed_gpt2_lowers_its_loss_like_l0():
    """Byte-level GPT-2 on real text (a topic of Python's own documentation): 30 seeded AdamW
    steps over 16 sequences at L0 and at L3; the mean loss of the last 8 steps."""
    from pydoc_data.topics import topics

    text = torch.tensor(list(topics["assignment"].encode()[: 16 * 48]))
    batches = text.reshape(16, 48)
    final = {level: tail_loss(actune.compress(gpt2(vocab=256, seed=3), level), batches, 2e-3)
             for level in ("L0", "L3")}
    # measured: L0 2.921, L3 2.913 (seeds 5 and 7: 2.948 / 2.970, 3.061 / 2.959)
    assert final["L0"] < 3.3  # from ln(256) = 5.5
    assert abs(final["L3"] - final["L0"]) < 0.03 * final["L0"], final


def tail_loss(model, batches, lr, scope=contextlib.nullcontext) -> float:
    """30 seeded AdamW steps over ``batches`` (4 of its rows a step, the forward inside
    ``scope()``); the mean loss of the last 8."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(4)
    tail = []
    for i in range(30):
        ids = batches[(4 * i) % len(batches):(4 * i) % len(batches) + 4]
        with scope():
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= 22:
            tail.append(loss.item())
    return sum(tail) / len(tail)


def _fsdp_worker(rank: int, world: int, path: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                                         world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    model = gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = IDS[rank:rank + 1]
    for _ in range(2):
        opt.zero_grad()
        with actune.compressed("u8"):  # close enough to compare with one process below
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
    flat = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    if rank == 0:
        torch.save(gathered, out)
    torch.distributed.barrier()
    os._exit(0)  # (gloo's teardown hangs now and then; the work is done and checked)


def test_fsdp2_trains_a_compressed_transformer_and_ranks_stay_in_sync():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "params.pt")
        run_ranks(_fsdp_worker, (2, os.path.join(tmp, "init"), out), seconds=180)
        a, b = torch.load(out)
    assert torch.equal(a, b)
    start = torch.cat([p.reshape(-1) for p in gpt2().parameters()])
    assert not torch.equal(a, start)  # it trained
    # and like a single process, exact, on the whole batch (two steps, 8-bit gradients)
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert rel(a - start, ref - start) < 0.05


def test_numerics_on_real_text_with_the_hugging_face_example():
    """`actune numerics docs/examples/hf_text.py`: per-layer bias and variance of a byte-level
    GPT-2 on pydoc_data.topics (the example's make_dataset and loss_fn)."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from actune.cli import app

    path = Path(__file__).parents[2] / "docs" / "examples" / "hf_text.py"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "n.json")
        result = CliRunner().invoke(app, ["numerics", str(path), "--levels", "L3", "--batch",
                                          "4", "--repeats", "2", "--draws", "2", "--per-tensor",
                                          "--json", out])
        assert result.exit_code == 0, result.output
        level = json.loads(Path(out).read_text())["levels"][0]
    assert level["level"] == "L3" and level["sgd_variance"] > 0
    assert 0 < level["quant_variance"] < level["sgd_variance"]


def test_compress_without_a_level_picks_the_measured_default():
    """L3 for every model but a family measured short at L3 trained from scratch
    (docs/benchmarks.md): Phi gets L2; GPT-2, GPT-NeoX (GELU), Llama (SiLU, gated) and a
    user's own MLP get L3; a level named is always the one used."""
    from actune.convert import _ROOT_LEVEL_ATTR

    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64))
    mine = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))
    for model, name in ((gpt2(), "L3"), (neox, "L3"), (mine, "L3"), (llama(), "L3"),
                        (phi(), "L2")):
        assert actune.default_level(model).name == name, type(model).__name__
    for model, name in ((actune.compress(phi()), "L2"), (actune.compress(llama()), "L3"),
                        (actune.compress(nn.Sequential(nn.Linear(4, 4))), "L3"),
                        (actune.compress(phi(), "L3"), "L3")):
        assert model.__dict__[_ROOT_LEVEL_ATTR].name == name
    assert actune.autoprec_of(actune.compress(phi())) is None  # L2 allocates nothing


def phi() -> nn.Module:
    return transformers.PhiForCausalLM(transformers.PhiConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64))


def test_a_model_fine_tuned_through_adapters_gets_l3_whatever_its_family():
    # (Phi's L2 is its measurement trained from scratch; a fine-tune through adapters of a
    # frozen base is measured at L3, docs/benchmarks.md)
    peft = pytest.importorskip("peft")
    from actune.tune.adapters import with_lora

    assert actune.default_level(with_lora(phi(), 4)).name == "L3"
    # peft's layers injected into the model itself are recognised as well
    base = phi()
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj"]), base)
    assert actune.default_level(base).name == "L3"
    assert actune.default_level(phi()).name == "L2"
