"""Models the course trains.

* :class:`SimpleCNN` -- the classic small CIFAR-10 CNN (about 0.55 M parameters). The DDP and DeepSpeed
  lessons train it; it is small enough for a CPU laptop.
* :class:`WideMLP` and :func:`make_memory_model` -- a plain stack of linear layers whose size you pick. The
  memory lessons (ZeRO stages, optimizer state) need tens of millions of parameters, and an MLP gets there
  cheaply: its memory is all parameters, gradients and optimizer state, not activations.

Example::

    model = SimpleCNN()
    count_parameters(model)                       # 545098
    big = make_memory_model(20_000_000)
    count_parameters(big)                         # 19_899_274 (width 2112)
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

CIFAR_INPUT_FEATURES = 3 * 32 * 32


class SimpleCNN(nn.Module):
    """Two conv blocks then two linear layers, for 3x32x32 images.

    conv(3->32, 3x3, pad 1) relu maxpool2 -> conv(32->64, 3x3, pad 1) relu maxpool2 -> fc(64*8*8 -> 128) relu
    -> fc(128 -> num_classes).

    Example::

        logits = SimpleCNN()(torch.randn(8, 3, 32, 32))   # shape (8, 10)
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 32x32 -> 16x16
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 16x16 -> 8x8
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class WideMLP(nn.Sequential):
    """Flatten, then ``depth`` hidden linear layers of ``width`` units with ReLU, then a classifier.

    Parameters: ``in*w + w  +  (depth-1)*(w*w + w)  +  w*num_classes + num_classes``
    (see :func:`mlp_parameter_count`).

    Example::

        model = WideMLP(width=2048, depth=4)        # 18.9 M parameters
        model(torch.randn(2, 3, 32, 32)).shape      # torch.Size([2, 10])
    """

    def __init__(self, width: int, depth: int, num_classes: int = 10, in_features: int = CIFAR_INPUT_FEATURES):
        if width < 1 or depth < 1:
            raise ValueError(f"WideMLP needs width >= 1 and depth >= 1, got width={width}, depth={depth}")
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(in_features, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
        self.width, self.depth, self.num_classes, self.in_features = width, depth, num_classes, in_features


def mlp_parameter_count(width: int, depth: int, num_classes: int = 10, in_features: int = CIFAR_INPUT_FEATURES) -> int:
    """Exact parameter count of ``WideMLP(width, depth, num_classes, in_features)``, without building it.

    Example::

        mlp_parameter_count(2048, 4) == count_parameters(WideMLP(2048, 4))   # True
    """
    return (in_features * width + width) + (depth - 1) * (width * width + width) + (width * num_classes + num_classes)


def make_memory_model(
    params_target: int = 20_000_000, depth: int = 4, num_classes: int = 10, multiple_of: int = 64
) -> WideMLP:
    """A :class:`WideMLP` of ``depth`` layers whose width is chosen so it has about ``params_target`` parameters.

    The width is rounded to a multiple of ``multiple_of`` (friendlier to matrix kernels), so the count lands
    within a few percent of the target; read the exact figure with :func:`count_parameters`.

    Example::

        model = make_memory_model(50_000_000)   # width 3584, 4 layers
        count_parameters(model)                 # 49_595_402
    """
    if params_target < 1:
        raise ValueError(f"params_target must be positive, got {params_target}")
    # Solve a*w^2 + b*w + c = target for the width w (the count is quadratic in w).
    a = depth - 1
    b = CIFAR_INPUT_FEATURES + 1 + (depth - 1) + num_classes
    c = num_classes - params_target
    width = -c / b if a == 0 else (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    width = max(multiple_of, int(round(width / multiple_of)) * multiple_of)
    return WideMLP(width, depth, num_classes)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (elements, not bytes) of ``model``.

    Example::

        count_parameters(SimpleCNN())   # 545098
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
