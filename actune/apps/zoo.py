"""Built-in models: no downloads, no torchvision.

* ResNet-18/34/50/101/152 with torchvision's exact layouts (ResNet-50 has 25,557,032
  parameters, state_dict keys as torchvision's), scalable like ActNN's scaled ResNets in depth
  (``depth`` multiplies the blocks per stage), width and input resolution (``resolution``, used
  by :func:`make_batch`). ``width`` follows the wide-ResNet conventions: it multiplies every
  channel count of a basic-block ResNet (Zagoruyko & Komodakis) and the inner (3x3) width of
  each bottleneck, whose outer channels stay as they are (torchvision's ``width_per_group``,
  as ``wide_resnet50_2`` and ActNN's width benchmark use it).
* A small transformer classifier: embedding, attention written with functional calls, layer
  norm, GELU MLP.
* MobileNetV3-Small with torchvision's exact layout (2,542,856 parameters; Howard et al.,
  ICCV 2019): Hardswish, squeeze-excitation gates through Hardsigmoid, depthwise convolutions,
  scalable in width and input resolution.
* A tiny CNN that trains in seconds on the CPU (8x8 inputs, e.g. scikit-learn's digits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["MODELS", "MobileNetV3Small", "ModelSpec", "SmallTransformer", "TinyCNN",
           "make_batch", "mobilenet_v3_small", "resnet"]


# ---------------------------------------------------------------------------------------------
# ResNet (torchvision layout)


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class _Residual(nn.Module):
    """A block's ending as torchvision writes it: the shortcut's projection (if any) after the
    main path, so its output does not live through it; the sum in place; the last ReLU."""

    downsample: nn.Module | None
    relu: nn.ReLU

    def _join(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out += x if self.downsample is None else self.downsample(x)
        return self.relu(out)


class BasicBlock(_Residual):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchvision's statements in torchvision's order (see Bottleneck.forward)
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        return self._join(out, x)


class Bottleneck(_Residual):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, width: float = 1.0) -> None:
        super().__init__()
        inner = max(1, round(planes * width))  # torchvision: planes * width_per_group / 64
        self.conv1 = _conv1x1(cin, inner)
        self.bn1 = nn.BatchNorm2d(inner)
        self.conv2 = _conv3x3(inner, inner, stride)
        self.bn2 = nn.BatchNorm2d(inner)
        self.conv3 = _conv1x1(inner, planes * 4)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchvision's statements in torchvision's order, which sets what is alive at the
        # forward peak: each statement rebinds ``out``, so a convolution's input is freed
        # before its batch norm runs (a nested call would hold it); the shortcut comes last
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.bn3(out)
        return self._join(out, x)


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock | Bottleneck], layers: list[int],
                 num_classes: int = 1000, width: float = 1.0) -> None:
        super().__init__()
        # bottlenecks widen inside (``Bottleneck(width=...)``), basic blocks everywhere
        self._inner_width = width if block is Bottleneck else 1.0
        base = 64 if block is Bottleneck else max(1, round(64 * width))
        self.inplanes = base
        self.conv1 = nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._stage(block, base, layers[0])
        self.layer2 = self._stage(block, base * 2, layers[1], stride=2)
        self.layer3 = self._stage(block, base * 4, layers[2], stride=2)
        self.layer4 = self._stage(block, base * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(base * 8 * block.expansion, num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _stage(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        widen = {"width": self._inner_width} if block is Bottleneck else {}
        layers = [block(self.inplanes, planes, stride, downsample, **widen)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, **widen) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchvision's statements: ``x`` is rebound after each stage, so max pooling's output
        # is freed once layer1 has run (nested calls would hold it to the end of forward)
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


_RESNETS = {
    18: (BasicBlock, [2, 2, 2, 2]),
    34: (BasicBlock, [3, 4, 6, 3]),
    50: (Bottleneck, [3, 4, 6, 3]),
    101: (Bottleneck, [3, 4, 23, 3]),
    152: (Bottleneck, [3, 8, 36, 3]),
}


def resnet(variant: int = 50, *, depth: float = 1.0, width: float = 1.0,
           num_classes: int = 1000, resolution: int = 224) -> ResNet:
    """ResNet-``variant`` with blocks per stage times ``depth``, wider by ``width``.

    ``width`` multiplies a bottleneck's inner width (ResNet-50 with ``width=2`` is
    torchvision's ``wide_resnet50_2``) or, for basic-block ResNets, every channel count.

    ``resolution`` is accepted so every built-in factory takes the same scalable keywords; a
    ResNet takes any input size (use it with :func:`make_batch`).
    """
    if variant not in _RESNETS:
        raise ValueError(f"ResNet-{variant} is not built in; choose one of {sorted(_RESNETS)}")
    if depth <= 0 or width <= 0 or resolution < 32:
        raise ValueError("depth and width must be positive and resolution at least 32")
    block, layers = _RESNETS[variant]
    return ResNet(block, [max(1, round(n * depth)) for n in layers], num_classes, width)


# ---------------------------------------------------------------------------------------------
# Small transformer


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # attention and MLP in their own calls (as timm's blocks): each one's locals (q, k,
        # v, the attention map) are freed when it returns
        x = x + F.dropout(self._attention(self.norm1(x)), self.dropout, self.training)
        return x + F.dropout(self._mlp(self.norm2(x)), self.dropout, self.training)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d // h)), dim=-1)
        attn = F.dropout(attn, self.dropout, self.training)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SmallTransformer(nn.Module):
    """A pre-norm transformer encoder classifier over token sequences."""

    def __init__(self, vocab: int = 1000, dim: int = 256, heads: int = 4, layers: int = 4,
                 mlp_ratio: int = 4, seq_len: int = 128, num_classes: int = 10,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, dim))
        self.blocks = nn.ModuleList(_Block(dim, heads, dim * mlp_ratio, dropout)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def transformer(*, depth: float = 1.0, width: float = 1.0, resolution: int = 128,
                num_classes: int = 10) -> SmallTransformer:
    """The small transformer: ``depth`` x 4 layers, ``width`` x 256 dims, ``resolution`` tokens."""
    layers = max(1, round(4 * depth))
    dim = max(4, round(256 * width / 4) * 4)
    return SmallTransformer(dim=dim, heads=4, layers=layers, seq_len=resolution,
                            num_classes=num_classes)


# ---------------------------------------------------------------------------------------------
# MobileNetV3-Small (torchvision layout)


def _divisible(v: float, divisor: int = 8) -> int:
    """The channel count nearest ``v`` that ``divisor`` divides, never 10% below it (the
    MobileNet rule)."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def _conv_norm_act(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1,
                   act: type[nn.Module] | None = None) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)


class _SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return gate * x


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, kernel: int, expanded: int, cout: int, se: bool,
                 act: type[nn.Module], stride: int) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(_conv_norm_act(cin, expanded, 1, act=act))
        layers.append(_conv_norm_act(expanded, expanded, kernel, stride, expanded, act))
        if se:
            layers.append(_SqueezeExcitation(expanded, _divisible(expanded // 4)))
        layers.append(_conv_norm_act(expanded, cout, 1))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.use_res_connect else out


#: (kernel, expanded, out, squeeze-excitation, Hardswish, stride) per block, before ``width``
_SMALL = ((3, 16, 16, True, False, 2), (3, 72, 24, False, False, 2),
          (3, 88, 24, False, False, 1), (5, 96, 40, True, True, 2), (5, 240, 40, True, True, 1),
          (5, 240, 40, True, True, 1), (5, 120, 48, True, True, 1), (5, 144, 48, True, True, 1),
          (5, 288, 96, True, True, 2), (5, 576, 96, True, True, 1), (5, 576, 96, True, True, 1))


class MobileNetV3Small(nn.Module):
    """MobileNetV3-Small as torchvision builds it (module names and initialisation too), its
    channels multiplied by ``width``."""

    def __init__(self, num_classes: int = 1000, width: float = 1.0,
                 dropout: float = 0.2) -> None:
        super().__init__()
        first = _divisible(16 * width)
        layers: list[nn.Module] = [_conv_norm_act(3, first, 3, 2, act=nn.Hardswish)]
        cin = first
        for kernel, expanded, cout, se, hard, stride in _SMALL:
            cout = _divisible(cout * width)
            layers.append(_InvertedResidual(cin, kernel, _divisible(expanded * width), cout, se,
                                            nn.Hardswish if hard else nn.ReLU, stride))
            cin = cout
        last = 6 * cin
        layers.append(_conv_norm_act(cin, last, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(last, 1024), nn.Hardswish(inplace=True),
                                        nn.Dropout(dropout, inplace=True),
                                        nn.Linear(1024, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenet_v3_small(*, depth: float = 1.0, width: float = 1.0, resolution: int = 224,
                       num_classes: int = 1000) -> MobileNetV3Small:
    """MobileNetV3-Small (``depth`` is accepted for a uniform signature and must be 1)."""
    if depth != 1.0:
        raise ValueError("MobileNetV3-Small has a fixed depth; scale its width or resolution")
    return MobileNetV3Small(num_classes=num_classes, width=width)


# ---------------------------------------------------------------------------------------------
# Tiny CNN


class TinyCNN(nn.Module):
    """conv-bn-relu x2, max-pool, linear: trains on 8x8 digits in seconds."""

    def __init__(self, num_classes: int = 10, width: float = 1.0, in_channels: int = 1) -> None:
        super().__init__()
        c = max(1, round(32 * width))
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.1))
        self.classifier = nn.Linear(2 * c * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, 4)
        return self.classifier(torch.flatten(x, 1))


def tiny_cnn(*, depth: float = 1.0, width: float = 1.0, resolution: int = 8,
             num_classes: int = 10) -> TinyCNN:
    """The tiny CNN (``depth`` is accepted for a uniform signature and must be 1)."""
    if depth != 1.0:
        raise ValueError("the tiny CNN has a fixed depth")
    return TinyCNN(num_classes=num_classes, width=width)


# ---------------------------------------------------------------------------------------------
# Registry and batches


@dataclass(frozen=True)
class ModelSpec:
    """A built-in model: its factory, its default input resolution and its input kind."""

    name: str
    factory: Callable[..., nn.Module]
    resolution: int
    inputs: str  # "image" (3 channels), "digits" (1 channel) or "tokens"
    num_classes: int


MODELS: dict[str, ModelSpec] = {
    **{f"resnet{v}": ModelSpec(f"resnet{v}", lambda v=v, **kw: resnet(v, **kw), 224, "image",
                               1000) for v in _RESNETS},
    "mobilenet_v3_small": ModelSpec("mobilenet_v3_small", mobilenet_v3_small, 224, "image",
                                    1000),
    "transformer": ModelSpec("transformer", transformer, 128, "tokens", 10),
    "tinycnn": ModelSpec("tinycnn", tiny_cnn, 8, "digits", 10),
}


def make_batch(spec: ModelSpec, batch: int, resolution: int | None = None, *,
               device: str | torch.device = "cpu",
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (inputs, targets) batch of ``batch`` samples for a built-in model, drawn on
    the CPU whatever the default device (``generator`` is a CPU generator), then moved to
    ``device``."""
    r = resolution or spec.resolution
    cpu = torch.device("cpu")
    targets = torch.randint(0, spec.num_classes, (batch,), generator=generator,
                            device=cpu).to(device)
    if spec.inputs == "tokens":
        inputs = torch.randint(0, 1000, (batch, r), generator=generator, device=cpu).to(device)
    else:
        channels = 1 if spec.inputs == "digits" else 3
        inputs = torch.randn(batch, channels, r, r, generator=generator, device=cpu).to(device)
    return inputs, targets
