"""The model file: how to build the model and a batch, and (optionally) the loss and optimizer.

A model file is a plain Python file (see docs/tuning.md and docs/examples/model.py)::

    def build_model(depth=1.0, width=1.0, resolution=32):   # required; scalable keywords
        ...                                                  # are the ones it accepts
    def make_batch(batch_size, resolution=32):               # required
        return inputs, targets     # inputs: a tensor, a tuple of forward's arguments, or a
                                   # dict of its keyword arguments; targets may be None
    def loss_fn(outputs, targets): ...                       # optional: the output's own
                                                             # `loss`, else cross entropy
    def make_optimizer(parameters): ...                      # optional: SGD, momentum 0.9
    def make_dataset(resolution=32):                         # optional: for `actune train`
        return x_train, y_train, x_test, y_test
    def checkpoint_blocks(model): ...                        # optional: the modules `ckpt`
                                                             # wraps (default: repeated blocks)

Everything that can go wrong while loading or dry-running it raises :class:`WorkloadError`
with one paragraph that says what to fix.
"""

from __future__ import annotations

import importlib.util
import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from actune.apps import data, zoo
from actune.apps.data import Dataset
from actune.apps.precision import PRECISIONS, autocast, cast_model
from actune.apps.train import default_optimizer
from actune.tune.oom import is_oom

__all__ = ["DIMENSIONS", "PRECISIONS", "Workload", "WorkloadError", "builtin", "check_precision",
           "first_line", "load"]

DIMENSIONS = ("depth", "width", "resolution")
#: What ``scale --dim`` also accepts for a model that takes tokens: its resolution, named as
#: a language model's user names it.
TOKEN_NAMES = ("tokens", "seq-len")


def _adapted(model: nn.Module, rank: int) -> nn.Module:
    from actune.tune.adapters import with_lora

    try:
        return with_lora(model, rank)
    except ImportError:
        raise WorkloadError("--lora needs peft: pip install 'actune[peft]'") from None


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; else a WorkloadError naming them."""
    if precision not in PRECISIONS:
        raise WorkloadError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)} "
                            "(Lightning's names).")
    return precision


class WorkloadError(Exception):
    """A model file (or built-in model) that cannot be used, and what to fix."""


@dataclass
class Workload:
    """A model to tune: factory, batch maker, loss and optimizer."""

    name: str
    factory: Callable[..., nn.Module]
    batch: Callable[..., tuple]
    loss: Callable = F.cross_entropy
    optimizer: Callable = default_optimizer
    dims: dict[str, float] = field(default_factory=dict)  # scalable keyword -> default value
    source: str = ""  # the model file's path, or "builtin:NAME" (to rebuild it elsewhere)
    dataset_fn: Callable | None = None  # make_dataset(): real data for training
    custom_loss: bool = False  # the model file defines loss_fn
    blocks_fn: Callable | None = None  # checkpoint_blocks(model): the blocks ckpt wraps
    #: how the step runs (:data:`PRECISIONS`): autocast around forward and loss ("bf16-mixed",
    #: "16-mixed", with a GradScaler in real steps), or the model cast ("bf16-true")
    precision: str = "32-true"
    #: LoRA adapters of this rank on the linear layers, the model's own weights frozen
    #: (``--lora``, :mod:`actune.tune.adapters`); None: every weight trains
    lora: int | None = None
    #: the resolution is a sequence length (a language model): reports and JSON say "tokens"
    tokens: bool = False
    #: the largest resolution the model takes (a language model's positions), if it has one
    max_resolution: int | None = None

    def label(self, dim: str) -> str:
        """What reports call ``dim`` for this model ("tokens" for a language model's
        resolution)."""
        return "tokens" if dim == "resolution" and self.tokens else dim

    def dim_of(self, name: str) -> str:
        """The dimension a user's ``name`` means (``tokens`` or ``seq-len``: the resolution of
        a model that takes tokens); raises WorkloadError for an image model's tokens."""
        if name not in TOKEN_NAMES:
            return name
        if not self.tokens:
            raise WorkloadError(f"{self.name} does not take tokens; for its input size use "
                                f"resolution (--dim resolution, --resolution)")
        return "resolution"

    def dataset(self, resolution: int | None = None) -> Dataset:
        """The workload's training and test data (``make_dataset`` of a model file)."""
        if self.dataset_fn is None:
            raise WorkloadError(
                f"{self.name} has no dataset. Define make_dataset() in the model file, "
                f"returning (x_train, y_train, x_test, y_test) tensors, or train a built-in "
                f"image model (--model tinycnn, resnet18, ...) on scikit-learn's digits.")
        wants = "resolution" in inspect.signature(self.dataset_fn).parameters
        made = self._call("make_dataset()", self.dataset_fn,
                          *([resolution] if wants and resolution else []))
        if isinstance(made, Dataset):
            return made
        if not (isinstance(made, tuple | list) and len(made) == 4
                and all(isinstance(t, torch.Tensor) for t in made)):
            raise WorkloadError(f"{self.name}: make_dataset() must return four tensors "
                                f"(x_train, y_train, x_test, y_test), got {_describe(made)}.")
        try:
            return Dataset(self.name, *made)
        except ValueError as err:
            raise WorkloadError(f"{self.name}: make_dataset(): {err}.") from None

    def model(self, values: bool = True, **sizes) -> nn.Module:
        """The model at ``sizes`` (scalable keywords only). ``values=False``: for fake or meta
        tensors, whose values nothing reads, the in-place initialisation of its parameters
        is skipped (on fake tensors each is an operation of its own: seconds for a deep
        model)."""
        kwargs = {k: v for k, v in sizes.items() if k in self.dims}
        dtype = PRECISIONS[self.precision][1]
        default = torch.get_default_dtype()
        if dtype is not None:  # built in it (casting fake parameters cannot swap them)
            torch.set_default_dtype(dtype)
        try:
            if values:
                model = self._call("build_model()", self.factory, **kwargs)
            else:
                with _ShapesOnly():
                    model = self._call("build_model()", self.factory, **kwargs)
            if dtype is not None and any(p.is_floating_point() and p.dtype != dtype
                                         for p in model.parameters()):
                model = cast_model(self.precision, model)
            if self.lora:  # (its adapters made in the model's dtype: nothing cast after)
                model = self._call(f"--lora {self.lora}", _adapted, model, self.lora)
        finally:
            torch.set_default_dtype(default)
        return model

    def make_optimizer(self, model: nn.Module):
        """The optimizer of ``model``'s trainable parameters (a frozen weight has no state)."""
        return self._call("make_optimizer(parameters)", self.optimizer,
                          [p for p in model.parameters() if p.requires_grad])

    def make_batch(self, batch: int, resolution=None) -> tuple:
        """A batch of ``batch`` samples, its tensors on the current default device (the one a
        ``with torch.device(...)`` block selects), wherever the model file made them."""
        if resolution is not None and "resolution" in self._batch_params():
            made = self._call(f"make_batch({batch})", self.batch, batch, resolution=resolution)
        else:
            made = self._call(f"make_batch({batch})", self.batch, batch)
        if not isinstance(made, (tuple, list)):
            return made  # the caller's check names what is wrong
        made = tuple(_to_device(t, torch.get_default_device()) for t in made)
        cast = PRECISIONS[self.precision][1]
        return made if cast is None else tuple(_cast_floats(t, cast) for t in made)

    @staticmethod
    def forward(model: nn.Module, inputs):
        """``model(**inputs)`` for a dict (keyword arguments, as Hugging Face models take a
        batch), ``model(*inputs)`` for a tuple (a model of several arguments), else
        ``model(inputs)`` (a tensor, or a list the model takes as one argument)."""
        if isinstance(inputs, dict):
            return model(**inputs)
        return model(*inputs) if isinstance(inputs, tuple) else model(inputs)

    def loss_of(self, outputs, targets) -> torch.Tensor:
        """The step's loss: ``loss_fn(outputs, targets)`` if the model file defines one, else
        the outputs' own ``loss`` (a Hugging Face ``ModelOutput`` given ``labels``, a dict),
        else cross entropy of a tensor output against ``targets``."""
        if self.custom_loss:
            return self.loss(outputs, targets)
        own = _own_loss(outputs)
        if own is not None:
            return own
        if isinstance(outputs, torch.Tensor):
            return self.loss(outputs, targets)
        raise WorkloadError(
            f"{self.name}: the model returned {type(outputs).__name__} without a loss in it. "
            f"Put the labels in the inputs so that the model computes its loss (for a Hugging "
            f"Face model: make_batch returns ({{'input_ids': ids, 'labels': ids}}, None)), "
            f"return the logits as one tensor, or define loss_fn(outputs, targets).")

    def step_loss(self, model: nn.Module, inputs, targets) -> torch.Tensor:
        """Forward ``inputs`` through ``model`` and return the loss; nothing else of the
        output is kept (a model's logits are freed before backward, as in a training loop
        that keeps only the loss)."""
        device = next((p.device.type for p in model.parameters()), "cpu")
        with autocast(self.precision, device):
            return self.loss_of(self.forward(model, inputs), targets)

    def _batch_params(self) -> set[str]:
        return set(inspect.signature(self.batch).parameters)

    def require(self, dim: str) -> None:
        """Raise if ``dim`` is not a scalable keyword of the factory."""
        if dim not in DIMENSIONS:
            raise WorkloadError(f"--dim must be one of {', '.join(DIMENSIONS)} (tokens for a "
                                f"language model), not {dim!r}.")
        if dim not in self.dims:
            have = ", ".join(self.dims) or "none"
            raise WorkloadError(
                f"{self.name} cannot be scaled in {dim}: its build_model() has no {dim!r} "
                f"keyword argument (it accepts: {have}). Add `{dim}=...` to build_model's "
                f"signature and use it to size the model"
                + (", and accept `resolution=` in make_batch as well." if dim == "resolution"
                   else "."))

    def check(self, batch: int = 2) -> None:
        """Dry-run one step under FakeTensorMode (no arithmetic); raise WorkloadError."""
        with FakeTensorMode(), torch.device("cpu"):
            model = self._call("build_model()", self.model)
            if not isinstance(model, nn.Module):
                raise WorkloadError(f"{self.name}: build_model() returned "
                                    f"{type(model).__name__}, not a torch.nn.Module.")
            made = self._call(f"make_batch({batch})", self.make_batch, batch)
            if not (isinstance(made, tuple | list) and len(made) == 2):
                raise WorkloadError(f"{self.name}: make_batch() must return a pair "
                                    f"(inputs, targets), got {type(made).__name__}.")
            inputs, targets = made
            out = self._call("the model's forward pass", self.forward, model, inputs)
            shape = (f"outputs are {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                     else f"outputs are a {type(out).__name__}")
            loss = self._call("loss_fn(outputs, targets) (check the targets' shape and "
                              f"dtype: {shape}, targets are {_describe(targets)})",
                              self.loss_of, out, targets)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise WorkloadError(f"{self.name}: loss_fn must return a scalar tensor, got "
                                    f"{_describe(loss)}.")
            self.make_optimizer(model)

    def _call(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``; an error becomes a WorkloadError naming ``what`` raised it,
        except running out of memory (which a search reads as "does not fit")."""
        try:
            return fn(*args, **kwargs)
        except WorkloadError:
            raise
        except Exception as err:
            if is_oom(err):
                raise
            hint = ""
            if "cuda" in str(err).lower() and not torch.cuda.is_available():
                hint = (" There is no CUDA device here: create the tensors without device=... "
                        "(actune puts the batch on the device the step runs on).")
            raise WorkloadError(f"{self.name}: {what} raised {type(err).__name__}: "
                                f"{first_line(err)}{hint}") from err


#: In-place tensor methods that only set values (what ``torch.nn.init`` and modules'
#: ``reset_parameters`` call); none changes a shape.
_SETS_VALUES = frozenset(
    f"{name}_" for name in ("uniform", "normal", "fill", "zero", "copy", "bernoulli",
                            "exponential", "random", "erfinv", "mul", "add", "sub", "div",
                            "clamp", "abs", "sqrt", "neg", "exp", "log", "trunc", "fmod",
                            "addcmul", "addcdiv", "masked_fill", "index_fill"))


class _ShapesOnly(TorchFunctionMode):
    """Skip the value-setting in-place calls made without gradients (initialisation) while a
    model of fake or meta tensors is built."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (args and getattr(func, "__name__", None) in _SETS_VALUES
                and not torch.is_grad_enabled() and isinstance(args[0], torch.Tensor)
                and (args[0].is_meta or isinstance(args[0], FakeTensor))):
            return args[0]
        return func(*args, **(kwargs or {}))


def _to_device(value, device: torch.device):
    """``value`` with its tensors (inside tuples, lists and dicts too) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _cast_floats(value, dtype: torch.dtype):
    """``value`` with its floating tensors (inside tuples, lists and dicts too) in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _own_loss(outputs) -> torch.Tensor | None:
    """The loss a model returned itself: a ``loss`` attribute or key holding a tensor."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {str(value.dtype).replace('torch.', '')} tensor"
    return type(value).__name__


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else "(no message)"


def builtin(name: str) -> Workload:
    """A built-in model (``actune.apps.zoo.MODELS``) as a workload."""
    spec = zoo.MODELS.get(name.lower())
    if spec is None:
        raise WorkloadError(f"no built-in model {name!r}; choose one of "
                            f"{', '.join(zoo.MODELS)} or pass a model file.")

    def batch(batch_size: int, resolution: int | None = None):
        return zoo.make_batch(spec, batch_size, resolution)

    dims = {"depth": 1.0, "width": 1.0, "resolution": spec.resolution}
    if spec.name == "tinycnn":
        dims = {"width": 1.0, "resolution": spec.resolution}
    dataset_fn = None
    if spec.inputs != "tokens":
        channels = 1 if spec.inputs == "digits" else 3

        def dataset_fn(resolution: int = 8 if channels == 1 else 32) -> Dataset:
            return data.digits(resolution, channels)

    return Workload(spec.name, spec.factory, batch, dims=dims, source=f"builtin:{spec.name}",
                    dataset_fn=dataset_fn)


def load(path: str | Path) -> Workload:
    """Load a model file; raise WorkloadError saying what to fix."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"model file {str(p)!r} does not exist. Pass the path of a Python "
                            f"file that defines build_model() and make_batch(), or use "
                            f"--model with one of: {', '.join(zoo.MODELS)}.")
    source = p.read_text()
    try:
        compile(source, str(p), "exec")
    except SyntaxError as err:
        raise WorkloadError(f"{p.name} has a syntax error at line {err.lineno}: {err.msg}. "
                            f"Fix the file and run again.") from err
    spec = importlib.util.spec_from_file_location(f"actune_model_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        raise WorkloadError(f"{p.name} raised {type(err).__name__} while being imported "
                            f"(line {frame.lineno}): {first_line(err)}") from err
    missing = [n for n in ("build_model", "make_batch") if not callable(getattr(module, n, None))]
    if missing:
        raise WorkloadError(
            f"{p.name} does not define {' and '.join(f'{m}()' for m in missing)}. A model file "
            f"needs build_model(**sizes) returning an nn.Module and make_batch(batch_size) "
            f"returning (inputs, targets); see docs/tuning.md.")
    factory = module.build_model
    params = inspect.signature(factory).parameters
    dims = {d: params[d].default for d in DIMENSIONS if d in params}
    precision = check_precision(getattr(module, "precision", "32-true"))
    return Workload(p.stem, factory, module.make_batch, precision=precision,
                    loss=getattr(module, "loss_fn", F.cross_entropy),
                    custom_loss=callable(getattr(module, "loss_fn", None)),
                    optimizer=getattr(module, "make_optimizer", default_optimizer),
                    dims=dims, source=str(p.resolve()),
                    dataset_fn=getattr(module, "make_dataset", None),
                    blocks_fn=getattr(module, "checkpoint_blocks", None))
