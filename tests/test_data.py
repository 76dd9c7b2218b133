"""helpers.rank.data: the synthetic set is deterministic and CIFAR-shaped; offline, CIFAR-10 fails fast and says so."""
import socket
import time

import pytest
import torch

from helpers.rank import data
from helpers.rank.data import DatasetUnavailableError, get_datasets, make_synthetic


def _stack(dataset, n=None):
    n = len(dataset) if n is None else n
    images, labels = zip(*(dataset[i] for i in range(n)))
    return torch.stack(images), torch.tensor(labels)


@pytest.fixture
def offline(monkeypatch):
    """No TCP connection can open, as on a machine without network (and the test never downloads on one with)."""

    def refuse(*args, **kwargs):
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def network_hangs(monkeypatch):
    """Connecting hangs (unanswered DNS or a firewall that drops packets), the slow way to be offline."""

    def hang(*args, **kwargs):
        time.sleep(60)  # the probe gives up long before; this thread lingers as a daemon
        raise OSError("timed out")  # what a real connect does in the end (returning None would crash the thread)

    monkeypatch.setattr(socket, "create_connection", hang)


def test_synthetic_is_identical_for_the_same_seed():
    first = _stack(get_datasets("synthetic", train_size=300, test_size=100, seed=3)[0])
    second = _stack(get_datasets("synthetic", train_size=300, test_size=100, seed=3)[0])
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_synthetic_differs_between_seeds():
    images_a, _ = make_synthetic(200, "train", seed=0)
    images_b, _ = make_synthetic(200, "train", seed=1)
    assert not torch.equal(images_a, images_b)


def test_synthetic_does_not_depend_on_global_rng():
    torch.manual_seed(123)
    images_a, labels_a = make_synthetic(200, "train", seed=0)
    torch.manual_seed(456)
    images_b, labels_b = make_synthetic(200, "train", seed=0)
    assert torch.equal(images_a, images_b) and torch.equal(labels_a, labels_b)


def test_smaller_synthetic_request_is_a_prefix_of_a_larger_one():
    small_images, small_labels = make_synthetic(1500, "train", seed=0)
    big_images, big_labels = make_synthetic(2500, "train", seed=0)
    assert torch.equal(small_images, big_images[:1500]) and torch.equal(small_labels, big_labels[:1500])


def test_synthetic_train_and_test_are_different_images():
    train_images, _ = make_synthetic(100, "train", seed=0)
    test_images, _ = make_synthetic(100, "test", seed=0)
    assert not torch.equal(train_images, test_images)


def test_synthetic_items_are_normalised_cifar_shaped_tensors():
    train_ds, test_ds, info = get_datasets("synthetic", train_size=1000, test_size=200, seed=0)
    images, labels = _stack(train_ds)
    assert (len(train_ds), len(test_ds)) == (1000, 200) == (info.train_size, info.test_size)
    assert images.shape == (1000, 3, 32, 32) and images.dtype == torch.float32
    assert info.num_classes == 10 and set(labels.tolist()) == set(range(10))
    assert images.mean(dim=(0, 2, 3)).abs().max() < 0.1  # normalised per channel, like CIFAR-10's transform
    assert (images.std(dim=(0, 2, 3)) - 1).abs().max() < 0.1


def test_synthetic_never_touches_the_network(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("synthetic data opened a network connection")

    monkeypatch.setattr(socket, "create_connection", forbidden)
    _, _, info = get_datasets("synthetic", train_size=10, test_size=10)
    assert info.name == "synthetic" and "SYNTHETIC" in info.announcement


def test_auto_falls_back_to_synthetic_offline_and_says_so(offline, tmp_path):
    train_ds, _, info = get_datasets("auto", root=tmp_path, train_size=50, test_size=20)
    assert info.name == "synthetic" and len(train_ds) == 50
    assert "SYNTHETIC" in info.announcement and "NOT CIFAR-10" in info.announcement
    assert str(tmp_path) in info.announcement  # says where it looked


def test_cifar10_offline_raises_a_clear_error(offline, tmp_path):
    with pytest.raises(DatasetUnavailableError) as caught:
        get_datasets("cifar10", root=tmp_path)
    message = str(caught.value)
    assert "could not be downloaded" in message and str(tmp_path) in message and "synthetic" in message


@pytest.mark.slow
def test_cifar10_gives_up_quickly_when_the_network_hangs(network_hangs, tmp_path):
    start = time.monotonic()
    with pytest.raises(DatasetUnavailableError):
        get_datasets("cifar10", root=tmp_path)
    assert time.monotonic() - start < 60 / 2  # the probe's 5 s gave up, not the connect's minute of hanging


def test_auto_without_download_does_not_try_the_network(monkeypatch, tmp_path):
    def forbidden(*args, **kwargs):
        raise AssertionError("download=False opened a network connection")

    monkeypatch.setattr(socket, "create_connection", forbidden)
    _, _, info = get_datasets("auto", root=tmp_path, train_size=10, test_size=10, download=False)
    assert info.name == "synthetic"


def test_unknown_dataset_name_is_refused():
    with pytest.raises(ValueError, match="dataset must be one of"):
        get_datasets("imagenet")


@pytest.mark.skipif(not data.cifar10_on_disk("data"), reason="CIFAR-10 is not in data/")
def test_cifar10_subsets_are_deterministic():
    first_train, first_test, info = get_datasets("cifar10", "data", train_size=100, test_size=50, seed=0)
    second_train, _, _ = get_datasets("cifar10", "data", train_size=100, test_size=50, seed=0)
    assert info.name == "cifar10" and "SYNTHETIC" not in info.announcement
    assert first_train.indices == second_train.indices and len(first_test) == 50
