"""Built-in models: torchvision's ResNet layouts, scalable, and the small models."""

import pytest
import torch

from actune.apps import zoo


@pytest.mark.parametrize(("variant", "params"), [
    (18, 11_689_512), (34, 21_797_672), (50, 25_557_032), (101, 44_549_160),
    (152, 60_192_808),
])
def test_resnet_parameter_counts_match_torchvision(variant, params):
    with torch.device("meta"):
        model = zoo.resnet(variant)
    assert sum(p.numel() for p in model.parameters()) == params


def test_resnet50_state_dict_keys_follow_torchvision():
    with torch.device("meta"):
        keys = list(zoo.resnet(50).state_dict())
    assert keys[:6] == ["conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean",
                        "bn1.running_var", "bn1.num_batches_tracked"]
    assert "layer1.0.downsample.0.weight" in keys and "layer4.2.conv3.weight" in keys
    assert keys[-2:] == ["fc.weight", "fc.bias"]


def test_resnets_scale_in_depth_width_and_resolution():
    with torch.device("meta"):
        base = zoo.resnet(18)
        deep = zoo.resnet(18, depth=2)
        wide = zoo.resnet(18, width=2)
    assert len(deep.layer3) == 2 * len(base.layer3)
    assert wide.conv1.out_channels == 2 * base.conv1.out_channels
    x, y = zoo.make_batch(zoo.MODELS["resnet18"], 2, 64)
    assert x.shape == (2, 3, 64, 64) and y.shape == (2,)
    assert zoo.resnet(18, num_classes=7)(x).shape == (2, 7)


@pytest.mark.parametrize(("variant", "params"), [(50, 68_883_240), (101, 126_886_696)])
def test_bottleneck_width_is_torchvisions_wide_resnet(variant, params):
    # wide_resnet50_2 / wide_resnet101_2: the inner 3x3 width doubles, the outer channels stay
    with torch.device("meta"):
        base, wide = zoo.resnet(variant), zoo.resnet(variant, width=2)
    assert sum(p.numel() for p in wide.parameters()) == params
    assert wide.layer1[0].conv2.out_channels == 2 * base.layer1[0].conv2.out_channels == 128
    assert wide.layer1[0].conv3.out_channels == base.layer1[0].conv3.out_channels == 256
    assert wide.conv1.out_channels == base.conv1.out_channels == 64


def test_small_models_run():
    tokens, _ = zoo.make_batch(zoo.MODELS["transformer"], 2, 16)
    assert zoo.transformer(depth=0.25, width=0.25, resolution=16)(tokens).shape == (2, 10)
    digits, _ = zoo.make_batch(zoo.MODELS["tinycnn"], 3)
    assert zoo.TinyCNN()(digits).shape == (3, 10)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="not built in"):
        zoo.resnet(42)
    with pytest.raises(ValueError, match="positive"):
        zoo.resnet(50, width=0)
