"""`--hf`: a Hugging Face model from its config alone, written here (no download)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from actune import tunables
from actune.cli import app
from actune.tune.hf_workload import hf_workload
from actune.tune.sources import from_source
from actune.tune.workload import WorkloadError

transformers = pytest.importorskip("transformers")
runner = CliRunner()


def flat(text: str) -> str:
    return "".join(c for c in text if not c.isspace() and c not in "│╭╮╰╯─")


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    made = {
        "gpt2": transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256,
                                        n_positions=128, architectures=["GPT2LMHeadModel"],
                                        bos_token_id=0, eos_token_id=0),
        "llama": transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=176, vocab_size=256,
                                          max_position_embeddings=128, bos_token_id=0,
                                          eos_token_id=0, architectures=["LlamaForCausalLM"]),
        "bert": transformers.BertConfig(num_hidden_layers=2, hidden_size=64,
                                        num_attention_heads=2, intermediate_size=128,
                                        vocab_size=256, max_position_embeddings=128,
                                        num_labels=3,
                                        architectures=["BertForSequenceClassification"]),
    }
    for name, config in made.items():
        config.save_pretrained(root / name)
    return root


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_maxbatch_on_a_config_directory(configs, name):
    result = runner.invoke(app, ["maxbatch", "--hf", str(configs / name), "--levels", "L0,L3",
                                 "--budget", "256MiB", "--json", str(configs / f"{name}.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((configs / f"{name}.json").read_text())
    l0, l3 = (r["value"] for r in report["levels"])
    assert 0 < l0 < l3


def test_the_task_decides_the_batch(configs):
    bert = hf_workload(str(configs / "bert" / "config.json"))
    inputs, targets = bert.make_batch(4, 32)
    assert inputs["input_ids"].shape == (4, 32) and inputs["labels"].shape == (4,)
    assert int(inputs["labels"].max()) < 3 and targets is None
    gpt2 = hf_workload(str(configs / "gpt2"))
    inputs, _ = gpt2.make_batch(2, 16)
    assert inputs["labels"] is inputs["input_ids"]
    loss = gpt2.step_loss(gpt2.model(), inputs, None)
    assert loss.dim() == 0 and loss.requires_grad


def test_a_causal_lm_whose_class_names_no_loss_compiles_to_one_graph(configs):
    """GPT2LMHeadModel logs that it falls back to the causal-LM loss on every call, which
    Dynamo cannot trace: the workload names that loss, so a compiled step is one graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    gpt2 = hf_workload(str(configs / "gpt2"))
    model = gpt2.model()
    assert model.loss_type == "ForCausalLM"
    inputs, _ = gpt2.make_batch(2, 16)
    torch._dynamo.reset()
    counters.clear()
    gpt2.step_loss(torch.compile(model, backend="aot_eager"), inputs, None).backward()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_depth_and_width_scale_the_config_with_whole_heads(configs):
    llama = hf_workload(str(configs / "llama"))
    model = llama.model(depth=2.0, width=1.5)
    config = model.config
    assert config.num_hidden_layers == 4
    assert config.hidden_size == 96 and config.num_attention_heads == 6  # 16 per head
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.intermediate_size == 264
    assert from_source(llama.source).name == llama.name  # rebuilt by name in other processes


def test_hf_class_overrides_the_architecture(configs):
    work = hf_workload(str(configs / "gpt2"), "GPT2ForSequenceClassification")
    assert type(work.model()).__name__ == "GPT2ForSequenceClassification"
    inputs, _ = work.make_batch(2, 16)
    assert inputs["labels"].shape == (2,)


@pytest.mark.parametrize(("content", "says"), [
    ("{not json", "doesnotparseasJSON"),
    (json.dumps({"model_type": "nosuchtype"}), "doesnotknowthemodeltype'nosuchtype'"),
    (json.dumps({"vocab_size": 3}), "hasno\"model_type\""),
    (json.dumps({"model_type": "gpt2", "architectures": ["NoSuchModel"]}),
     "hasnomodelclass'NoSuchModel'"),
])
def test_bad_configs_get_one_clear_paragraph_and_exit_2(tmp_path, content, says):
    path = tmp_path / "config.json"
    path.write_text(content)
    result = runner.invoke(app, ["maxbatch", "--hf", str(path)])
    assert result.exit_code == 2
    assert says in flat(result.output) and "Traceback" not in result.output


def test_a_hub_id_without_network_says_what_to_do(monkeypatch):
    def offline(spec, *args, **kwargs):  # what transformers raises with no network (quickly)
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files of "
                      f"{spec}, and couldn't find them in the cached files.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(WorkloadError, match="Without network access, pass a local"):
        hf_workload("nobody-here/no-such-model")


def test_missing_transformers_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers":
            raise ImportError("No module named 'transformers'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    result = runner.invoke(app, ["summary", "--hf", "anything"])
    assert result.exit_code == 2 and "actune[hf]" in flat(result.output)


def test_hf_and_a_model_file_together_are_refused(tmp_path):
    result = runner.invoke(app, ["maxbatch", str(tmp_path / "m.py"), "--hf", "x"])
    assert result.exit_code == 2 and "not both" in result.output


def test_a_vision_config_gets_pixel_values_at_its_image_size(tmp_path):
    transformers.ViTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                           intermediate_size=64, image_size=32, patch_size=8, num_labels=5,
                           architectures=["ViTForImageClassification"]).save_pretrained(tmp_path)
    work = hf_workload(str(tmp_path))
    inputs, _ = work.make_batch(2)
    assert inputs["pixel_values"].shape == (2, 3, 32, 32) and int(inputs["labels"].max()) < 5
    loss = work.step_loss(work.model(), inputs, None)
    assert loss.dim() == 0 and loss.requires_grad


def test_tokens_are_a_language_models_resolution(configs):
    out = configs / "tokens.json"
    result = runner.invoke(app, ["maxbatch", "--hf", str(configs / "gpt2"), "--tokens", "64",
                                 "--levels", "L0,lce,L3", "--budget", "256MiB", "--json",
                                 str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["fixed"]["tokens"] == 64 and "resolution" not in report["fixed"]
    assert "tokens 64" in result.output
    l0, lce, l3 = (r["value"] for r in report["levels"])
    assert 0 < l0 <= lce < l3  # the loss in chunks: lce exact, and every compressing level


def test_scale_finds_the_longest_sequence_within_the_models_positions(configs):
    out = configs / "longest.json"
    result = runner.invoke(app, ["scale", "--dim", "tokens", "--hf", str(configs / "llama"),
                                 "--batch", "2", "--levels", "L0,L3", "--budget", "2MiB",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["dim"] == "tokens" and "max tokens" in result.output
    l0, l3 = (r["value"] for r in report["levels"])
    assert 0 < l0 < l3 <= 128  # (the config's max_position_embeddings)
    roomy = runner.invoke(app, ["scale", "--dim", "seq-len", "--hf", str(configs / "llama"),
                                "--batch", "1", "--levels", "L3", "--budget", "16GiB",
                                "--json", str(out)])
    assert roomy.exit_code == 0, roomy.output
    row = json.loads(out.read_text())["levels"][0]
    assert row["value"] == 128 and row["capped"]


def test_tokens_for_an_image_model_or_with_a_resolution_are_refused(tmp_path, configs):
    transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                              num_labels=3, image_size=32,
                              architectures=["ResNetForImageClassification"]
                              ).save_pretrained(tmp_path)
    result = runner.invoke(app, ["scale", "--dim", "tokens", "--hf", str(tmp_path)])
    assert result.exit_code == 2 and "doesnottaketokens" in flat(result.output)
    result = runner.invoke(app, ["maxbatch", "--hf", str(tmp_path), "--tokens", "64"])
    assert result.exit_code == 2 and "doesnottaketokens" in flat(result.output)
    result = runner.invoke(app, ["maxbatch", "--hf", str(configs / "gpt2"), "--tokens", "64",
                                 "--resolution", "64"])
    assert result.exit_code == 2 and "not both" in result.output


def test_lora_freezes_the_base_weights_and_fits_more(configs):
    pytest.importorskip("peft")
    out = configs / "lora.json"
    args = ["maxbatch", "--hf", str(configs / "llama"), "--tokens", "64", "--levels", "L0,L3",
            "--budget", "4MiB", "--json", str(out)]
    plain = runner.invoke(app, args)
    assert plain.exit_code == 0, plain.output
    full = json.loads(out.read_text())["levels"]
    adapted = runner.invoke(app, [*args, "--lora", "4"])
    assert adapted.exit_code == 0, adapted.output
    lora = json.loads(out.read_text())["levels"]
    assert lora[0]["value"] > full[0]["value"]  # L0: 3 -> 4 here
    for f, a in zip(full, lora, strict=True):
        assert a["value"] >= f["value"]
        # no gradient and no optimizer state for the frozen weights: the adapters' alone
        assert a["peak_parts"]["optimizer"] < f["peak_parts"]["optimizer"] / 10


@pytest.mark.parametrize(("family", "precision"), [("llama", "32-true"), ("llama", "bf16-true"),
                                                   ("gpt2", "32-true")])
def test_a_lora_workload_trains_only_its_adapters(configs, family, precision):
    pytest.importorskip("peft")
    work = hf_workload(str(configs / family))  # (GPT-2's layers: transformers' Conv1D)
    work.precision, work.lora = precision, 4
    model = work.model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)  # (the output layer takes none)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert {p.dtype for p in model.parameters()} == {dtype}
    opt = work.make_optimizer(model)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)


def test_lora_on_a_model_without_linear_layers_says_so(tmp_path):
    pytest.importorskip("peft")
    result = runner.invoke(app, ["maxbatch", "--model", "tinycnn", "--lora", "4"])
    assert result.exit_code == 2 and "nolinearlayertoputadapterson" in flat(result.output)


def test_an_estimate_runs_one_slice_and_finds_the_peak_of_all(configs, monkeypatch):
    """Every slice of the attention's maps and every chunk of the loss allocates and frees
    the same: an estimate runs the first alone and finds the same peak."""
    from actune.chunked_loss import linear_loss
    from actune.rules import attention
    from actune.tune import probe

    monkeypatch.setattr(tunables, "ATTENTION_MAP_SLICE", 2 * 64 * 64)  # one sample's maps a slice
    monkeypatch.setattr(tunables, "CHUNK_ELEMENTS", 64 * 256)  # 64 tokens a chunk
    work = hf_workload(str(configs / "gpt2"))  # (attention dropout 0.1: the sliced path)

    def peak() -> int:
        probe._WARM.clear()
        return probe.Trial(work, "L3", {"resolution": 64}).peak(8).total

    one = peak()
    for module in (attention, linear_loss):
        monkeypatch.setattr(module, "_starts", lambda t, step: range(0, t.shape[0], step))
    assert peak() == one
