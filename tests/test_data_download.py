"""CIFAR-10's download path, end to end, against a local mirror (this machine cannot reach the real server).

The mirror serves an archive in CIFAR-10's own format with a few images (tests/fake_cifar_mirror.py);
torchvision's checksums are pointed at it, so the real code runs: helpers.rank.data's reachability probe,
torchvision's download, MD5 check and unpacking, the on-disk check, and the loader with the course's transform.
"""
import json

import numpy as np
import pytest
import torch

from fake_cifar_mirror import MANIFEST_ENV, PER_BATCH, TRAIN_BATCHES, Mirror, build_archive, fake_images, \
    patch_torchvision
from helpers.rank import data
from helpers import launch
from helpers.rank.data import CIFAR10_MEAN, CIFAR10_STD, DatasetUnavailableError, get_datasets
from test_data import _stack

ARCHIVE = "/cifar-10-python.tar.gz"


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A running mirror with torchvision and helpers.rank.data pointed at it; proxies bypassed for 127.0.0.1."""
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    served = tmp_path / "mirror"
    served.mkdir()
    with Mirror(served) as m:
        m.manifest = build_archive(served, m.url)
        patch_torchvision(m.manifest, monkeypatch.setattr)
        yield m


def _normalised(rows):
    images = torch.from_numpy(rows).reshape(-1, 3, 32, 32).float() / 255
    return (images - torch.tensor(CIFAR10_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR10_STD).view(3, 1, 1)


def test_auto_downloads_verifies_and_loads_cifar10_then_finds_it_on_disk(mirror, tmp_path):
    root = tmp_path / "data"
    assert not data.cifar10_on_disk(root)
    train_ds, test_ds, info = get_datasets("auto", root=root)
    assert mirror.gets and set(mirror.gets) == {ARCHIVE}
    fetched = len(mirror.gets)
    assert info.name == "cifar10" and info.reason == f"downloaded to {root}/"
    assert "SYNTHETIC" not in info.announcement and "CIFAR-10" in info.announcement
    assert (len(train_ds), len(test_ds)) == (len(TRAIN_BATCHES) * PER_BATCH, PER_BATCH)
    assert data.cifar10_on_disk(root)

    # the pixels and labels that were served, through the course's transform, in the files' order
    rows, labels = zip(*(fake_images(b) for b in TRAIN_BATCHES))
    expected = _normalised(np.concatenate(rows))
    got_images, got_labels = _stack(train_ds)
    assert torch.allclose(got_images, expected, atol=1e-6)
    assert got_labels.tolist() == [label for batch in labels for label in batch]

    _, _, again = get_datasets("auto", root=root)
    assert again.reason == f"found at {root}/" and len(mirror.gets) == fetched  # no second download


def test_a_corrupted_download_is_refused_and_auto_falls_back_to_synthetic(mirror, tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    monkeypatch.setattr(CIFAR10, "tgz_md5", "0" * 32)  # what the archive should have been
    with pytest.raises(DatasetUnavailableError) as caught:
        get_datasets("cifar10", root=tmp_path / "data")
    assert "could not be downloaded" in str(caught.value) and "corrupted" in str(caught.value)
    fetched = len(mirror.gets)
    _, _, info = get_datasets("auto", root=tmp_path / "data", train_size=10, test_size=10)
    assert info.name == "synthetic" and "NOT CIFAR-10" in info.announcement
    assert fetched > 0 and mirror.gets == [ARCHIVE] * (2 * fetched)  # each attempt fetched it; neither kept it
    assert not data.cifar10_on_disk(tmp_path / "data")


@pytest.mark.slow
def test_in_a_two_rank_job_rank_0_alone_downloads_and_every_rank_loads_the_same_data(mirror, tmp_path, runs_root):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(mirror.manifest))
    root = tmp_path / "data"
    run = launch.torchrun(launch.PROJECT_ROOT / "tests" / "scripts" / "download_data.py", nproc=2,
                          args=["--root", str(root)], env={MANIFEST_ENV: str(manifest)}, timeout=120,
                          show="none")
    by_the_job = len(mirror.gets)
    get_datasets("cifar10", root=tmp_path / "one_download")  # what a single download costs the mirror
    assert by_the_job == len(mirror.gets) - by_the_job > 0  # one download: rank 1 waited instead of fetching too
    results = run.results_by_rank()
    assert sorted(results) == [0, 1]
    assert {r["name"] for r in results.values()} == {"cifar10"}
    assert {r["reason"] for r in results.values()} == {f"downloaded to {root}/"}  # rank 0's decision, shared
    assert results[0]["digest"] == results[1]["digest"] and results[0]["train_size"] == len(TRAIN_BATCHES) * PER_BATCH
