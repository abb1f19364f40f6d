"""Vision models nobody on this project wrote (Hugging Face configs, random weights) and the
built-in MobileNetV3-Small: every activation has a rule, so each keeps about 10x fewer saved
bytes at L3 with nothing large exact, and 8-bit gradients stay close to exact."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
import transformers  # in the test extra

import actune
from actune.apps import zoo


def _hf(cls, config):
    model = cls(config)
    return model, lambda x, y: model(pixel_values=x, labels=y).loss


def mobilenet_v2():
    return _hf(transformers.MobileNetV2ForImageClassification, transformers.MobileNetV2Config(
        image_size=96, depth_multiplier=0.5, num_labels=10, classifier_dropout_prob=0.0))


def levit():
    return _hf(transformers.LevitForImageClassification, transformers.LevitConfig(
        image_size=96, hidden_sizes=[64, 96, 128], num_attention_heads=[2, 3, 4],
        depths=[2, 2, 2], key_dim=[16, 16, 16], num_labels=10))


def mobilevit():
    return _hf(transformers.MobileViTForImageClassification, transformers.MobileViTConfig(
        image_size=96, hidden_sizes=[48, 64, 80],
        neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 160], num_labels=10, hidden_dropout_prob=0.0,
        classifier_dropout_prob=0.0))


def convnext_v2():
    """Global response norms: a vector 2-norm over each map."""
    return _hf(transformers.ConvNextV2ForImageClassification, transformers.ConvNextV2Config(
        hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10))


def swin_v2():
    """Cosine attention: F.normalize of queries and keys."""
    return _hf(transformers.Swinv2ForImageClassification, transformers.Swinv2Config(
        image_size=96, patch_size=4, embed_dim=32, depths=[1, 1], num_heads=[2, 4],
        window_size=4, num_labels=10, drop_path_rate=0.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def mobilenet_v3_small():
    model = zoo.MobileNetV3Small(num_classes=10, dropout=0.0)
    return model, lambda x, y: F.cross_entropy(model(x), y)


#: model -> (its activation's rule kind, the largest 8-bit gradient error allowed: about 1.5x
#: what this size measures, docs/benchmarks.md, "Vision models"; the smallest ratio at L3)
MODELS = {mobilenet_v2: ("mask", 0.014, 10), levit: ("derivative", 0.04, 10),
          mobilevit: ("derivative", 0.007, 10), mobilenet_v3_small: ("derivative", 0.016, 10),
          convnext_v2: ("other", 0.01, 10),
          # (F.normalize keeps its queries' and keys' two copies at the sensitive 4 bits and
          # their norms exact, one a row of 16 values: 8.9x here, 9.5x at 64 x 64)
          swin_v2: ("normalize", 0.01, 8.5)}


def _grads(model, loss_of, x, y, state, level, stats=None):
    model.load_state_dict(state)  # (batch norm's running statistics move each step)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with actune.compressed(level, stats=stats):
        loss = loss_of(x, y)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("make", list(MODELS), ids=lambda f: f.__name__)
def test_vision_models_keep_about_10x_fewer_bytes_with_every_activation_compressed(make):
    torch.manual_seed(0)
    model, loss_of = make()
    model.train()
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 3, 96, 96, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kind, allowed, ratio = MODELS[make]
    stats = []
    _grads(model, loss_of, x, y, state, "L3", stats.append)
    s = stats[0]
    assert s.ratio >= ratio, (s.ratio, s.describe_exact())
    assert sum(s.exact.values()) < 0.01 * s.saved_bytes, s.describe_exact()
    assert s.by_kind.get(kind, 0) > 0
    exact = _grads(model, loss_of, x, y, state, "L0")
    eight = _grads(model, loss_of, x, y, state, "u8")
    assert ((eight - exact).norm() / exact.norm()).item() < allowed


def test_mobilenet_v3_small_is_torchvisions():
    with torch.device("meta"):
        model = zoo.mobilenet_v3_small()
    assert sum(p.numel() for p in model.parameters()) == 2_542_856
    keys = list(model.state_dict())
    assert keys[:2] == ["features.0.0.weight", "features.0.1.weight"]
    assert "features.1.block.1.fc1.weight" in keys and "features.12.0.weight" in keys
    assert keys[-2:] == ["classifier.3.weight", "classifier.3.bias"]
    with pytest.raises(ValueError, match="fixed depth"):
        zoo.mobilenet_v3_small(depth=2)


def test_compress_converts_hardswish_and_hardsigmoid_and_keeps_over_10x_fewer():
    torch.manual_seed(0)
    model = zoo.MobileNetV3Small(num_classes=10, dropout=0.0)
    actune.track_stats(actune.compress(model, "L3"))
    kinds = {row.layer: row.keeps for row in actune.summary(model) if row.converted}
    assert kinds["Hardswish"].startswith("packed derivative")
    assert kinds["Hardsigmoid"] == "1-bit mask at L3"
    x = torch.randn(4, 3, 96, 96, generator=torch.Generator().manual_seed(2))
    F.cross_entropy(model(x), torch.arange(4)).backward()
    stats = actune.stats_of(model)
    assert stats.ratio >= 10 and not stats.exact, stats.describe_exact()
    actune.decompress(model)
    assert type(model.features[0][2]) is torch.nn.Hardswish


def convnext():
    """Layer norms before each downsampling convolution."""
    return _hf(transformers.ConvNextForImageClassification, transformers.ConvNextConfig(
        hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10))


def vit():
    """Layer norms' copies laid out features first, some samples of them at other widths."""
    return _hf(transformers.ViTForImageClassification, transformers.ViTConfig(
        image_size=64, patch_size=8, num_hidden_layers=2, hidden_size=128,
        intermediate_size=256, num_attention_heads=4, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def levit_64():
    """Batch norms over [tokens, features] after each linear layer, and the classifier's over
    [batch, features]."""
    return _hf(transformers.LevitForImageClassification, transformers.LevitConfig(
        image_size=64, hidden_sizes=[64, 96, 128], num_attention_heads=[2, 3, 4],
        depths=[2, 2, 2], key_dim=[16, 16, 16], num_labels=10))


@pytest.mark.parametrize("make", [swin_v2, convnext, vit, levit_64], ids=lambda f: f.__name__)
def test_the_bit_allocators_widths_are_no_noisier_than_uniform_ones(make):
    # the allocator once gave one bit to what its cost model cannot price there (attention's
    # products and softmax, layer norms' inputs): Swin V2's gradient error at L3 rose to 75x
    # the uniform widths', ConvNeXt's to 1.5x (docs/autoprec.md); a features-first copy
    # whose samples took two widths came back in another order (ViT: 1.5x); and per-sample
    # widths grouped a batch norm's [batch, features] input along its samples, across
    # features of other offsets (LeViT's statistics step: 3,600x)
    torch.manual_seed(0)
    model, _ = make()
    model.train()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 64, 64, generator=gen), torch.randint(0, 10, (4,), generator=gen)

    def grads(m, level=None, seed=1):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with actune.compressed(level) if level else contextlib.nullcontext():
            loss = m(pixel_values=x, labels=y).loss
        loss.backward()
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    exact = grads(model)
    converted = actune.compress(copy.deepcopy(model), "L3")
    statistics = (grads(converted, seed=1) - exact).norm()  # at the uniform width
    grads(converted, seed=2)  # the first at the allocated widths
    uniform = sum((grads(model, "L3", s) - exact).norm() for s in (3, 4, 5))
    allocated = sum((grads(converted, None, s) - exact).norm() for s in (3, 4, 5))
    assert statistics < 1.5 * uniform / 3
    assert allocated < 1.2 * uniform
