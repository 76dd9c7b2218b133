"""helpers.rank.models: parameter counts match the layer arithmetic; models map CIFAR-shaped batches to logits."""
import pytest
import torch

from helpers.rank.models import SimpleCNN, WideMLP, count_parameters, make_memory_model, mlp_parameter_count


def _conv(c_in, c_out, k):
    return c_in * c_out * k * k + c_out


def _linear(n_in, n_out):
    return n_in * n_out + n_out


def test_simple_cnn_parameter_count_matches_the_layer_formula():
    expected = _conv(3, 32, 3) + _conv(32, 64, 3) + _linear(64 * 8 * 8, 128) + _linear(128, 10)
    assert count_parameters(SimpleCNN()) == expected


def test_simple_cnn_maps_an_image_batch_to_class_logits():
    assert SimpleCNN()(torch.randn(4, 3, 32, 32)).shape == (4, 10)
    assert SimpleCNN(num_classes=7)(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_wide_mlp_parameter_count_matches_the_layer_formula():
    width, depth = 96, 3
    expected = _linear(3 * 32 * 32, width) + (depth - 1) * _linear(width, width) + _linear(width, 10)
    model = WideMLP(width, depth)
    assert count_parameters(model) == expected == mlp_parameter_count(width, depth)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("target", [2_000_000, 20_000_000])
def test_memory_model_lands_near_the_parameter_target(target):
    model = make_memory_model(target)
    assert abs(count_parameters(model) - target) / target < 0.05
    assert model.width % 64 == 0


def test_count_parameters_can_skip_frozen_ones():
    model = SimpleCNN()
    for p in model.conv1.parameters():
        p.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == count_parameters(model) - _conv(3, 32, 3)
