"""Model files: the contract and every error a user can make, phrased as what to fix."""

import textwrap

import pytest

from actune.tune.workload import WorkloadError, builtin, load

GOOD = """
import torch
from torch import nn

def build_model(width=1.0, resolution=8):
    return nn.Sequential(nn.Flatten(), nn.Linear(resolution * resolution, round(16 * width)))

def make_batch(batch_size, resolution=8):
    return torch.randn(batch_size, 1, resolution, resolution), torch.randint(0, 16, (batch_size,))
"""


def write(tmp_path, text, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_good_file_loads_and_reports_its_scalable_dimensions(tmp_path):
    wl = load(write(tmp_path, GOOD))
    wl.check()
    assert wl.dims == {"width": 1.0, "resolution": 8}
    wl.require("width")
    with pytest.raises(WorkloadError, match=r"no 'depth' keyword.*accepts: width, resolution"):
        wl.require("depth")


@pytest.mark.parametrize(("text", "match"), [
    ("def build_model(:\n", "syntax error at line 1"),
    ("import torch\n", "does not define build_model\\(\\) and make_batch\\(\\)"),
    ("raise RuntimeError('boom')\n", "raised RuntimeError while being imported.*boom"),
    (GOOD.replace("return nn.Sequential", "raise ValueError('bad width'); return nn.Sequential"),
     "build_model\\(\\) raised ValueError: bad width"),
    (GOOD.replace("return nn.Sequential(nn.Flatten(), nn.Linear(resolution * resolution, "
                  "round(16 * width)))",
                  "return nn.Sequential(nn.Flatten(), Pair())\n"
                  "class Pair(nn.Module):\n    def forward(self, x):\n        return (x, x)"),
     "returned tuple without a loss in it.*define loss_fn"),
    (GOOD.replace("torch.randint(0, 16, (batch_size,))", "torch.randint(0, 16, (batch_size, 3))"),
     "loss_fn\\(outputs, targets\\).*targets are a \\(2, 3\\) int64 tensor"),
    (GOOD.replace("return torch.randn(batch_size, 1, resolution, resolution), "
                  "torch.randint(0, 16, (batch_size,))", "return 5"),
     "must return a pair \\(inputs, targets\\)"),
])
def test_each_mistake_gets_a_message_that_says_what_to_fix(tmp_path, text, match):
    with pytest.raises(WorkloadError, match=match):
        load(write(tmp_path, text)).check()


def test_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        load(tmp_path / "nope.py")


def test_builtin_models():
    assert builtin("resnet50").dims == {"depth": 1.0, "width": 1.0, "resolution": 224}
    with pytest.raises(WorkloadError, match="no built-in model 'vgg'"):
        builtin("vgg")


@pytest.mark.parametrize("source", ["file", "builtin"])
def test_batches_land_on_the_device_the_step_runs_on(tmp_path, source):
    """The tuner runs a step inside ``with torch.device(...)``; a model file that makes its
    batch on the CPU (as GOOD does) and the built-in models both get that device's tensors."""
    import torch

    wl = load(write(tmp_path, GOOD)) if source == "file" else builtin("tinycnn")
    with torch.device("meta"):
        inputs, targets = wl.make_batch(4, 8)
    assert inputs.device.type == "meta" and targets.device.type == "meta"
    assert inputs.shape[0] == 4 and targets.shape == (4,)
    inputs, targets = wl.make_batch(4, 8)
    assert inputs.device.type == "cpu" and targets.device.type == "cpu"


def test_a_tuple_of_inputs_is_the_forward_arguments_and_a_dict_its_keywords(tmp_path):
    import torch

    several = write(tmp_path, """
        import torch
        from torch import nn

        class TwoInputs(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 4)

            def forward(self, tokens, mask):
                return self.head((torch.relu(self.embed(tokens)) * mask[..., None]).mean(1))

        def build_model():
            return TwoInputs()

        def make_batch(batch_size):
            tokens = torch.randint(0, 50, (batch_size, 12))
            return (tokens, torch.ones(batch_size, 12)), torch.randint(0, 4, (batch_size,))
        """, "several.py")
    wl = load(several)
    wl.check()
    with torch.device("meta"):  # nested tensors land on the step's device too
        (tokens, mask), targets = wl.make_batch(3)
    assert tokens.device.type == mask.device.type == targets.device.type == "meta"
    out = wl.forward(wl.model(), wl.make_batch(3)[0])
    assert out.shape == (3, 4)
    one = write(tmp_path, """
        import torch
        from torch import nn

        class DictInput(nn.Module):
            def __init__(self):
                super().__init__()
                self.head = nn.Linear(8, 4)

            def forward(self, batch):
                return self.head(batch["x"])

        def build_model():
            return DictInput()

        def make_batch(batch_size):  # one dict argument: a tuple of one
            return ({"x": torch.randn(batch_size, 8)},), torch.randint(0, 4, (batch_size,))
        """, "one.py")
    load(one).check()
    keywords = write(tmp_path, (tmp_path / "one.py").read_text()
                     .replace("def forward(self, batch):", "def forward(self, x):")
                     .replace('self.head(batch["x"])', "self.head(x)")
                     .replace('return ({"x": torch.randn(batch_size, 8)},),',
                              'return {"x": torch.randn(batch_size, 8)},'), "keywords.py")
    load(keywords).check()


def test_errors_after_the_dry_run_name_the_function_and_out_of_memory_passes_through(tmp_path):
    import torch

    wl = load(write(tmp_path, GOOD.replace(
        "def make_batch(batch_size, resolution=8):\n",
        "def make_batch(batch_size, resolution=8):\n    if batch_size > 4:\n"
        "        raise ValueError('at most 4 samples')\n")))
    wl.check()  # the dry run uses 2 samples
    with pytest.raises(WorkloadError, match=r"make_batch\(8\) raised ValueError: at most 4"):
        wl.make_batch(8)

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError):  # a search reads it as "does not fit"
        wl._call("build_model()", out_of_memory)


HF_STYLE = """
import torch
from torch import nn

class Out(dict):  # a ModelOutput is a dict whose keys are attributes too
    __getattr__ = dict.get

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids, labels=None, attention_mask=None):
        assert attention_mask is not None  # keyword arguments arrive by name
        logits = self.head(self.emb(input_ids))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return Out(loss=loss, logits=logits)

def build_model():
    return LM()

def make_batch(batch_size):
    ids = torch.randint(0, 50, (batch_size, 8))
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}, None
"""


def test_hugging_face_conventions_dict_inputs_and_the_outputs_own_loss(tmp_path):
    import torch

    wl = load(write(tmp_path, HF_STYLE))
    wl.check()
    inputs, targets = wl.make_batch(3)
    assert targets is None
    loss = wl.step_loss(wl.model(), inputs, targets)
    assert loss.dim() == 0 and loss.requires_grad
    # a loss_fn receives whatever the model returned
    custom = HF_STYLE + "\ndef loss_fn(out, targets):\n    return out['logits'].square().mean()\n"
    wl = load(write(tmp_path, custom, "custom.py"))
    wl.check()
    model = wl.model()
    out = wl.step_loss(model, *wl.make_batch(2))
    with torch.no_grad():
        expected = model(**wl.make_batch(2)[0])["logits"]
    assert out.shape == () and expected.shape == (2, 8, 50)


def test_an_output_without_a_loss_says_how_to_get_one(tmp_path):
    text = HF_STYLE.replace('"labels": ids, ', "")
    with pytest.raises(WorkloadError, match=r"without a loss in it.*'labels': ids"):
        load(write(tmp_path, text)).check()


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_the_hugging_face_example_files_dry_run(name):
    from pathlib import Path

    wl = load(Path(__file__).parents[2] / "docs" / "examples" / f"{name}.py")
    assert set(wl.dims) == {"depth", "width", "resolution"}
    small = {"depth": 0.0625, "width": 0.125, "resolution": 16}
    wl.factory = _sized(wl.factory, small)
    wl.check()


def _sized(factory, sizes):
    return lambda **kw: factory(**{**kw, **sizes})


def test_a_missing_transformers_names_the_extra(tmp_path, monkeypatch):
    import builtins
    from pathlib import Path

    real = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name.startswith("transformers"):
            raise ImportError("No module named 'transformers'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    path = Path(__file__).parents[2] / "docs" / "examples" / "hf_gpt2.py"
    with pytest.raises(WorkloadError, match=r"pip install 'actune\[hf\]'"):
        load(path)


def test_a_model_for_fake_or_meta_tensors_is_built_without_setting_its_values():
    """values=False skips the initialisation's in-place calls on meta (or fake) tensors:
    the same parameters and buffers, shapes and dtypes, for fewer operations; real tensors
    are initialised as ever."""
    import torch

    from actune.tune.workload import builtin

    workload = builtin("resnet18")
    with torch.device("meta"):
        plain, lean = workload.model(), workload.model(False)
    shapes = [(n, p.shape, p.dtype) for n, p in plain.named_parameters()]
    assert shapes == [(n, p.shape, p.dtype) for n, p in lean.named_parameters()]
    assert [(n, b.shape) for n, b in plain.named_buffers()] == \
        [(n, b.shape) for n, b in lean.named_buffers()]
    torch.manual_seed(0)
    real = workload.model(False)  # not meta: set as usual
    torch.manual_seed(0)
    assert torch.equal(real.conv1.weight, workload.model().conv1.weight)
    assert real.bn1.weight.eq(1).all()
