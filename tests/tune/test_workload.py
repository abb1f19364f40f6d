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
     "returned tuple, not a tensor"),
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


def test_a_tuple_of_inputs_is_the_forward_arguments_and_a_dict_is_one(tmp_path):
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

        def make_batch(batch_size):
            return {"x": torch.randn(batch_size, 8)}, torch.randint(0, 4, (batch_size,))
        """, "one.py")
    load(one).check()


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
