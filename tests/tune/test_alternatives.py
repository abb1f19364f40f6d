"""Activation checkpointing and CPU offload as configurations beside the levels."""

import json

import pytest
import torch
import transformers  # in the test extra
from torch import nn
from typer.testing import CliRunner

from actune.apps import zoo
from actune.cli import app
from actune.levels import L0, L3, L4
from actune.tune.alternatives import (
    Config,
    apply_checkpointing,
    get_config,
    parse_configs,
    repeated_blocks,
)
from actune.tune.probe import Trial
from actune.tune.workload import builtin


def test_configurations_parse_with_levels_and_ranges():
    configs = parse_configs("L0-L2,ckpt,L3+ckpt,offload,l3+offload,u2+ckpt")
    assert [c.name for c in configs] == ["L0", "L1", "L2", "ckpt", "L3+ckpt", "offload",
                                         "L3+offload", "u2+ckpt"]
    assert configs[3] == Config(L0, checkpoint=True) and configs[5] == Config(L0, offload=True)
    assert configs[6].run_level.offload and configs[6].run_level.name == "L3+offload"
    assert Config.from_json(configs[4].to_json()) == configs[4]
    assert get_config(L3) == Config(L3) and get_config("L3+ckpt") == configs[4]


@pytest.mark.parametrize(("text", "message"), [
    ("L3+L4", "more than one level"), ("L0-L3+ckpt", "not a range"), ("L9", "unknown level"),
    (",", "no levels")])
def test_bad_configurations_say_what_to_write(text, message):
    with pytest.raises(ValueError, match=message):
        parse_configs(text)


def test_default_blocks_are_the_repeated_blocks():
    resnet = zoo.resnet(50)
    blocks = repeated_blocks(resnet)
    assert len(blocks) == 16 and {type(b).__name__ for b in blocks} == {"Bottleneck"}
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=100)
    gpt2 = transformers.GPT2LMHeadModel(config)
    assert repeated_blocks(gpt2) == list(gpt2.transformer.h)
    with pytest.raises(ValueError, match="checkpoint_blocks"):
        apply_checkpointing(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_checkpointed_blocks_give_the_same_gradients_and_keep_less():
    torch.manual_seed(0)
    model = zoo.resnet(18)
    x = torch.randn(4, 3, 32, 32)
    model(x).sum().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert apply_checkpointing(model) == 8
    model(x).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(exact, grads, strict=True))
    workload = builtin("resnet18")
    l0 = Trial(workload, "L0", {"resolution": 32}, "estimate").peak(16)
    ckpt = Trial(workload, "ckpt", {"resolution": 32}, "estimate").peak(16)
    l3ckpt = Trial(workload, "L3+ckpt", {"resolution": 32}, "estimate").peak(16)
    assert ckpt.saved < 0.9 * l0.saved and l3ckpt.saved < 0.2 * ckpt.saved
    offload = Trial(workload, "offload", {"resolution": 32}, "estimate").peak(16)
    assert offload.host >= l0.saved and offload.total < l0.total
    assert Trial(workload, L4, {"resolution": 32}, "estimate").peak(16).host > 0


#: A model file of two checkpointable blocks (Linear-Tanh pairs, 256 wide times ``width``)
TWO_BLOCKS = (
    "import torch\nfrom torch import nn\n"
    "def block(h):\n"
    "    return nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh())\n"
    "def build_model(width=1.0):\n"
    "    h = int(256 * width)\n"
    "    return nn.Sequential(nn.Linear(32, h), block(h), block(h), nn.Linear(h, 10))\n"
    "def checkpoint_blocks(model):  # the default finds none here: mixed children\n"
    "    return [model[1], model[2]]\n"
    "def make_batch(batch_size):\n"
    "    return torch.randn(batch_size, 32), torch.randint(0, 10, (batch_size,))\n")


def test_model_file_names_its_blocks_and_the_cli_runs_every_alternative(tmp_path):
    model_file = tmp_path / "net.py"
    model_file.write_text(TWO_BLOCKS)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["maxbatch", str(model_file), "--budget", "64MiB",
                                      "--levels", "L0,ckpt,L3,L3+ckpt,offload", "--json",
                                      str(out)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    rows = {r["level"]: r for r in json.loads(out.read_text())["levels"]}
    assert list(rows) == ["L0", "ckpt", "L3", "L3+ckpt", "offload"]
    assert rows["L3+ckpt"]["base_level"] == "L3" and rows["L3+ckpt"]["checkpoint"]
    assert rows["offload"]["offload"] and rows["offload"]["host_bytes"] > 0
    assert rows["offload"]["activation_bytes"] is None
    assert rows["ckpt"]["value"] > rows["L0"]["value"]
    assert rows["L3+ckpt"]["value"] > rows["ckpt"]["value"]
    # checkpointing both blocks at L3 holds more in the last one's recomputation than L3
    # alone (10,947 against 11,307): the second block runs whole
    assert rows["L3+ckpt"]["whole_blocks"] == ["2"] and rows["ckpt"]["whole_blocks"] == []
    assert rows["L3+ckpt"]["value"] >= rows["L3"]["value"]
    assert "L3+ckpt: 1 of 2 blocks checkpointed" in result.output
    assert "offload: offload simulated" in result.output


def test_checkpointing_turns_off_every_key_value_cache_as_hugging_face_does():
    """T5's decoder (its own config copy) filled a cache in the forward and read it back in
    the recomputation: checkpointing failed (a different number of tensors saved)."""
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, vocab_size=100,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    assert model.decoder.config.use_cache
    assert apply_checkpointing(model) == 4
    assert not model.config.use_cache and not model.decoder.config.use_cache
    ids = torch.randint(1, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.decoder.block[1].parameters())


def test_a_step_that_fails_under_a_configuration_says_so_without_a_traceback(tmp_path):
    model_file = tmp_path / "net.py"
    model_file.write_text(
        "import torch\nfrom torch import nn\n"
        "class Block(nn.Module):  # a different computation each call: recomputing fails\n"
        "    calls = 0\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(16, 16)\n"
        "    def forward(self, x):\n"
        "        Block.calls += 1\n"
        "        y = self.lin(x).tanh()\n"
        "        return y.sin() if Block.calls % 2 else y\n"
        "def build_model():\n"
        "    return nn.Sequential(nn.Linear(8, 16), nn.Sequential(Block(), Block()),\n"
        "                         nn.Linear(16, 4))\n"
        "def make_batch(batch_size):\n"
        "    return torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))\n")
    result = CliRunner().invoke(app, ["maxbatch", str(model_file), "--budget", "64MiB",
                                      "--levels", "ckpt"], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())  # (the error console wraps at its own width)
    assert "ckpt: a step at batch 8 failed with CheckpointError" in said
    assert "leave ckpt out of --levels" in said and "Traceback" not in said
