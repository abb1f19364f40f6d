"""A Hugging Face model as a workload, from its config alone (``--hf PATH_OR_ID``).

The config comes from a directory holding ``config.json``, a ``config.json`` itself, or a hub
ID that ``transformers`` resolves (fetching the config only). The model is built from it with
random weights: nothing else is downloaded. Its class is ``config.architectures[0]`` (or
``--hf-class``); the batch is the one its task expects, with labels, so the model computes
its own loss. ``depth`` scales the layer count and ``width`` the hidden size (whole heads).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch

from actune.tune.workload import Workload, WorkloadError

__all__ = ["hf_workload"]

_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_WIDTH = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_INNER = ("intermediate_size", "n_inner", "d_ff", "ffn_dim")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise WorkloadError("--hf needs the transformers package: pip install "
                            "'actune[hf]' (or pip install transformers).") from None
    return transformers


def _config(spec: str):
    """The config ``spec`` names (a directory, a config.json, or a hub ID)."""
    transformers = _transformers()
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise WorkloadError(f"{spec!r} is a directory without a config.json. Pass a "
                                "directory holding one, a config.json, or a hub ID.")
    if path.is_file():
        try:
            values = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise WorkloadError(f"{path} does not parse as JSON ({err}). Pass a Hugging Face "
                                "config.json.") from None
        kind = values.pop("model_type", None) if isinstance(values, dict) else None
        if kind is None:
            raise WorkloadError(f"{path} has no \"model_type\": a Hugging Face config.json "
                                "names its model type (\"gpt2\", \"llama\", ...).")
        try:
            return transformers.AutoConfig.for_model(kind, **values)
        except (ValueError, KeyError):
            raise WorkloadError(f"{path}: transformers {transformers.__version__} does not "
                                f"know the model type {kind!r}. Check \"model_type\", or "
                                "upgrade transformers.") from None
    if path.suffix == ".json" or spec.startswith((".", "/")) or spec.count("/") > 1:
        raise WorkloadError(f"{spec!r} does not exist. Pass a directory holding a config.json, "
                            "a config.json, or a hub ID (owner/name).")
    try:
        return transformers.AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise WorkloadError(f"could not fetch the config of {spec!r} from the Hugging Face hub "
                            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}). "
                            "Without network access, pass a local directory or config.json."
                            ) from None


def _model_class(config, name: str | None):
    transformers = _transformers()
    name = name or next(iter(getattr(config, "architectures", None) or []), None)
    if name is None:
        return transformers.AutoModelForCausalLM
    cls = getattr(transformers, name, None)
    if cls is None:
        raise WorkloadError(f"transformers {transformers.__version__} has no model class "
                            f"{name!r}. Name one with --hf-class (GPT2LMHeadModel, "
                            "LlamaForCausalLM, BertForSequenceClassification, ...).")
    return cls


def _first(config, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if isinstance(getattr(config, n, None), int)), None)


def _scaled(config, depth: float, width: float):
    """A copy of ``config`` with its layers times ``depth`` and its hidden size times
    ``width`` (rounded to whole heads; the MLP's inner size scaled alike)."""
    config = copy.deepcopy(config)
    layers = _first(config, _LAYERS)
    if layers and depth != 1.0:
        setattr(config, layers, max(1, round(getattr(config, layers) * depth)))
    hidden, heads = _first(config, _WIDTH), _first(config, _HEADS)
    if hidden and width != 1.0:
        h = getattr(config, hidden)
        unit = h // getattr(config, heads) if heads else 1
        new = max(unit, round(h * width / unit) * unit)
        setattr(config, hidden, new)
        if heads:
            setattr(config, heads, new // unit)
            kv = getattr(config, "num_key_value_heads", None)
            if isinstance(kv, int) and kv and (new // unit) % kv:
                config.num_key_value_heads = new // unit
        inner = _first(config, _INNER)
        if inner:
            setattr(config, inner, max(1, round(getattr(config, inner) * new / h)))
    return config


def positions_of(config) -> int | None:
    """The longest sequence ``config``'s model takes (its position embeddings), if it says."""
    found = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None)
    return found if isinstance(found, int) and found > 0 else None


def _batch_maker(config, cls) -> tuple[Callable, int | None]:
    """make_batch(batch, resolution) for ``cls``'s task, and its default resolution (pixels
    for an image model, else tokens)."""
    name = cls.__name__
    vocab = getattr(config, "vocab_size", None) or 2
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None) or 512
    if "ImageClassification" in name or getattr(config, "image_size", None):
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        channels = getattr(config, "num_channels", 3)
        labels = getattr(config, "num_labels", 2)

        def images(batch: int, resolution: int = size):
            return ({"pixel_values": torch.randn(batch, channels, resolution, resolution),
                     "labels": torch.randint(0, labels, (batch,))}, None)
        return images, size
    default = min(128, positions)

    if "SequenceClassification" in name:
        labels = getattr(config, "num_labels", 2)

        def classify(batch: int, resolution: int = default):
            return ({"input_ids": torch.randint(0, vocab, (batch, resolution)),
                     "labels": torch.randint(0, labels, (batch,))}, None)
        return classify, default
    if getattr(config, "is_encoder_decoder", False):
        def translate(batch: int, resolution: int = default):
            ids = torch.randint(0, vocab, (batch, resolution))
            return ({"input_ids": ids, "labels": torch.randint(0, vocab, (batch, resolution))},
                    None)
        return translate, default

    def language(batch: int, resolution: int = default):  # causal or masked LM
        ids = torch.randint(0, vocab, (batch, resolution))
        return ({"input_ids": ids, "labels": ids}, None)
    return language, default


def hf_workload(spec: str, class_name: str | None = None) -> Workload:
    """The workload of the Hugging Face model whose config ``spec`` names (see the module
    docstring); raises WorkloadError saying what to fix."""
    config = _config(spec)
    cls = _model_class(config, class_name)
    batch, resolution = _batch_maker(config, cls)

    make = getattr(cls, "from_config", cls)  # (an Auto class builds through from_config)

    def build_model(depth: float = 1.0, width: float = 1.0, resolution: int | None = None):
        # (resolution sizes the batch only)
        model = make(_scaled(config, depth, width)).train()
        if getattr(model, "loss_type", "") is None:  # (GPT2LMHeadModel) the loss it falls
            model.loss_type = "ForCausalLM"  # back to, named: its warning breaks compiled graphs
        return model

    name = getattr(config, "name_or_path", "") or Path(spec).stem or spec
    source = f"hf:{spec}" + (f"#{class_name}" if class_name else "")
    dims = {"depth": 1.0, "width": 1.0}
    if resolution is not None:
        dims["resolution"] = resolution
    images = "pixel_values" in batch(1)[0]
    return Workload(f"{Path(str(name)).name or cls.__name__} ({cls.__name__})", build_model,
                    batch, dims=dims, source=source, tokens=not images,
                    max_resolution=None if images else positions_of(config))
