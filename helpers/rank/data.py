"""Datasets for the course: CIFAR-10 when it is on disk or downloadable, otherwise generated data that says so.

:func:`get_datasets` returns ``(train_ds, test_ds, info)``. ``info.name`` is ``"cifar10"`` or ``"synthetic"``
and ``info.announcement`` is one line to print, so nobody mistakes numbers on generated data for CIFAR-10
results.

* ``name="auto"``      -- CIFAR-10 from ``root`` if there, else downloaded, else the synthetic set.
* ``name="cifar10"``   -- CIFAR-10 or a :class:`DatasetUnavailableError` saying what to do.
* ``name="synthetic"`` -- the generated set, never touching the network.

Inside a distributed job (``torch.distributed`` initialised) rank 0 looks for and downloads the data while
the other ranks wait for its decision, so N ranks never write the same archive at once and every rank uses
the same dataset. Offline, a download attempt gives up within a few seconds (:data:`PROBE_TIMEOUT_S`).

The synthetic set is "CIFAR-shaped": 3x32x32 images, 10 classes, stored as uint8 and normalised per channel
like CIFAR-10. Each class is a fixed random low-frequency colour pattern, shifted by a few pixels, with random
contrast, low-frequency clutter and pixel noise on top. SimpleCNN learns it (about 90% test accuracy after
one epoch of 4000 images at global batch 64), but not instantly. It is generated from ``seed`` with a
private ``torch.Generator``, in fixed chunks, so the first 2000 images are the same whether you ask for
2000 or 10000.

Example::

    train_ds, test_ds, info = get_datasets("auto", root="data", train_size=4000, test_size=1000)
    print(info.announcement)
    image, label = train_ds[0]          # float tensor (3, 32, 32), int label
"""
from __future__ import annotations

import os
import socket
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

NAMES = ("auto", "cifar10", "synthetic")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"

PROBE_TIMEOUT_S = 5.0  # how long to wait for a TCP connection to the download host before calling it offline
DOWNLOAD_SOCKET_TIMEOUT_S = 30.0  # per blocking socket operation while downloading (a stall, not the whole file)

SYNTHETIC_SIZES = (50_000, 10_000)  # the full synthetic set mirrors CIFAR-10; only what is asked for is generated
SYNTHETIC_CHUNK = 1000  # images are generated in chunks of this many, each from its own seeded generator


class DatasetUnavailableError(RuntimeError):
    """CIFAR-10 was required but is neither on disk nor downloadable."""


@dataclass(frozen=True)
class DatasetInfo:
    """What :func:`get_datasets` loaded. ``asdict(info)`` is JSON-ready."""

    name: str  # "cifar10" or "synthetic"
    announcement: str  # one line for humans, says plainly when the data is not CIFAR-10
    reason: str  # why this dataset: "found at data/", "downloaded to data/", "CIFAR-10 not found ..."
    num_classes: int
    classes: tuple[str, ...]
    train_size: int
    test_size: int
    root: str
    seed: int


# --------------------------------------------------------------------------------------------- CIFAR-10


def cifar10_on_disk(root: str | os.PathLike = "data") -> bool:
    """True if ``root/cifar-10-batches-py`` holds the complete, checksum-verified CIFAR-10."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    folder = Path(root) / CIFAR10.base_folder  # checksums only, without loading 60k images
    return all(check_integrity(str(folder / f), md5) for f, md5 in CIFAR10.train_list + CIFAR10.test_list)


def _download_host() -> tuple[str, int]:
    """The host a download connects to first: the HTTPS proxy if one is configured, else the CIFAR server."""
    target = urllib.parse.urlsplit(CIFAR10_URL)
    proxy = urllib.request.getproxies().get("https")
    if proxy and not urllib.request.proxy_bypass(target.hostname):
        p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return p.hostname, p.port or 80
    return target.hostname, target.port or 443


def _reachable(host: str, port: int, timeout: float | None = None) -> str | None:
    """None if a TCP connection to host:port opens within ``timeout`` (default :data:`PROBE_TIMEOUT_S`) s, else why not.

    Runs in a daemon thread because name resolution (getaddrinfo) ignores socket timeouts and can hang
    far longer than the timeout on a machine without network.
    """
    timeout = PROBE_TIMEOUT_S if timeout is None else timeout
    outcome: list[str | None] = []

    def attempt():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"{type(e).__name__}: {e}")

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout)
    return outcome[0] if outcome else f"no connection to {host}:{port} within {timeout:.0f} s"


def download_cifar10(root: str | os.PathLike = "data") -> None:
    """Download and unpack CIFAR-10 into ``root``; raise :class:`DatasetUnavailableError` fast when offline."""
    from torchvision.datasets import CIFAR10

    host, port = _download_host()
    problem = _reachable(host, port)
    if problem is None:
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_SOCKET_TIMEOUT_S)  # torchvision's urlopen has no timeout of its own
        try:
            CIFAR10(os.fspath(root), train=True, download=True)
        except Exception as e:  # URLError, timeout, bad checksum, disk full...
            problem = f"{type(e).__name__}: {e}"
        finally:
            socket.setdefaulttimeout(previous)
    if problem is not None:
        raise DatasetUnavailableError(
            f"CIFAR-10 is not in {Path(root) / CIFAR10.base_folder} and could not be downloaded ({problem}). "
            f"On a machine with internet run: python -c \"import torchvision; "
            f"torchvision.datasets.CIFAR10('{root}', download=True)\" and copy {root}/ here, "
            f"or use the generated data (dataset 'synthetic', or 'auto' to fall back by itself)."
        )


def _cifar10(root: str, train: bool):
    from torchvision import transforms
    from torchvision.datasets import CIFAR10

    to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)])
    return CIFAR10(root, train=train, download=False, transform=to_tensor)


# --------------------------------------------------------------------------------------------- synthetic


class SyntheticCIFAR(Dataset):
    """uint8 images (N, 3, 32, 32) and labels, served as normalised float tensors like CIFAR-10's transform."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean, std):
        self.images, self.labels = images, labels
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = (self.images[index].float() / 255 - self.mean) / self.std
        return image, int(self.labels[index])


def _class_templates(seed: int) -> torch.Tensor:
    """One smooth random colour pattern per class, values in [0, 1], shape (10, 3, 32, 32)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(10, 3, 4, 4, generator=g)
    return F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)


def _synthetic_chunk(templates: torch.Tensor, seed: int, split: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SYNTHETIC_CHUNK images of one split; chunk k of a split is the same whatever size is requested."""
    g = torch.Generator().manual_seed((seed * 2 + split) * 1_000_003 + chunk)
    n = SYNTHETIC_CHUNK
    labels = (torch.arange(n) % 10)[torch.randperm(n, generator=g)]  # exactly balanced classes per chunk
    # The class pattern, shifted (with wrap-around) by up to 4 pixels each way, so position alone says nothing.
    shift_y = torch.randint(-4, 5, (n, 1), generator=g)
    shift_x = torch.randint(-4, 5, (n, 1), generator=g)
    pixels = torch.arange(32)
    rows = ((pixels + shift_y) % 32)[:, None, :, None].expand(n, 3, 32, 32)
    cols = ((pixels + shift_x) % 32)[:, None, None, :].expand(n, 3, 32, 32)
    pattern = templates[labels].gather(2, rows).gather(3, cols)
    contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=g)
    clutter = F.interpolate(torch.rand(n, 3, 8, 8, generator=g), size=(32, 32), mode="bilinear", align_corners=False)
    noise = torch.randn(n, 3, 32, 32, generator=g)
    # image = 0.5 + 0.4 * contrast * (pattern - 0.5) + 0.6 * (clutter - 0.5) + 0.2 * noise, computed in place
    image = noise.mul_(0.2).add_(clutter.sub_(0.5), alpha=0.6).addcmul_(pattern.sub_(0.5), contrast, value=0.4)
    return image.add_(0.5).clamp_(0, 1).mul_(255).round_().to(torch.uint8), labels


def make_synthetic(size: int, split: str = "train", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``size`` uint8 images (size, 3, 32, 32) and int64 labels of a synthetic split.

    Example::

        images, labels = make_synthetic(2000, "test", seed=0)
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    templates = _class_templates(seed)
    chunks = [_synthetic_chunk(templates, seed, split == "test", k) for k in range(-(-size // SYNTHETIC_CHUNK))]
    if not chunks:
        return torch.empty(0, 3, 32, 32, dtype=torch.uint8), torch.empty(0, dtype=torch.int64)
    images, labels = (torch.cat(parts) for parts in zip(*chunks))
    return images[:size], labels[:size]


def _synthetic_normalisation(seed: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean/std of the first train chunk: fixed by the seed, independent of the sizes requested."""
    pixels = _synthetic_chunk(_class_templates(seed), seed, 0, 0)[0].float() / 255
    return tuple(pixels.mean((0, 2, 3)).tolist()), tuple(pixels.std((0, 2, 3)).tolist())


# --------------------------------------------------------------------------------------------- entry points


def prepare_data(name: str = "auto", root: str | os.PathLike = "data", download: bool = True) -> tuple[str, str]:
    """Decide which dataset to use, downloading CIFAR-10 if needed and allowed. Returns ``(name, reason)``.

    ``name`` is ``"cifar10"`` or ``"synthetic"``. Call it on one process only (in a distributed job,
    :func:`get_datasets` does that for you on rank 0).

    Example::

        prepare_data("auto", "data")   # ('synthetic', 'CIFAR-10 not found at data/ and could not be downloaded ...')
    """
    if name not in NAMES:
        raise ValueError(f"dataset must be one of {NAMES}, got {name!r}")
    if name == "synthetic":
        return "synthetic", "synthetic data requested"
    if cifar10_on_disk(root):
        return "cifar10", f"found at {root}/"
    if not download:
        problem = DatasetUnavailableError(f"CIFAR-10 is not in {root}/ and downloading is switched off")
    else:
        try:
            download_cifar10(root)
            return "cifar10", f"downloaded to {root}/"
        except DatasetUnavailableError as e:
            problem = e
    if name == "cifar10":
        raise problem
    return "synthetic", f"CIFAR-10 not found at {root}/ and could not be downloaded"


def _subset(dataset, size: int | None, seed: int, full: int):
    """A fixed random subset (same indices for the same seed), or the dataset itself when size is None/full."""
    if size is None or size >= full:
        return dataset
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    order = torch.randperm(full, generator=torch.Generator().manual_seed(seed))
    return Subset(dataset, order[:size].tolist())


def get_datasets(
    name: str = "auto",
    root: str | os.PathLike = "data",
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
    download: bool = True,
):
    """``(train_ds, test_ds, info)`` for ``name`` in ``"auto" | "cifar10" | "synthetic"``.

    Items are ``(float tensor (3, 32, 32) normalised per channel, int label)``. ``train_size``/``test_size``
    take a deterministic subset (CIFAR-10: a seeded random choice of images; synthetic: the first images,
    which are generated in a seeded, balanced order). Under ``torch.distributed`` rank 0 decides and
    downloads while the others wait, then every rank builds the same datasets.

    Example::

        train_ds, test_ds, info = get_datasets("synthetic", train_size=4000, test_size=1000, seed=0)
        info.name, len(train_ds), info.announcement
    """
    if name not in NAMES:
        raise ValueError(f"dataset must be one of {NAMES}, got {name!r}")
    root = os.fspath(root)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Rank 0 alone looks on disk and downloads; the broadcast doubles as the barrier the others wait at.
        decision, failure = [None], None
        if torch.distributed.get_rank() == 0:
            try:
                decision[0] = prepare_data(name, root, download) + (None,)
            except Exception as e:
                failure, decision[0] = e, (None, None, str(e))  # tell the other ranks rather than leave them waiting
        torch.distributed.broadcast_object_list(decision, src=0)
        resolved, reason, error = decision[0]
        if failure is not None:
            raise failure
        if error is not None:
            raise DatasetUnavailableError(f"rank 0 could not prepare the data: {error}")
        if resolved == "cifar10" and not cifar10_on_disk(root):
            # Several ranks downloading into one node-local folder would collide, so refuse instead.
            raise DatasetUnavailableError(
                f"rank {torch.distributed.get_rank()} does not see CIFAR-10 at {root}/ although rank 0 does: "
                f"put {root}/ on a filesystem all nodes share, or download it on every node before launching"
            )
    else:
        resolved, reason = prepare_data(name, root, download)

    if resolved == "cifar10":
        train_full, test_full = _cifar10(root, train=True), _cifar10(root, train=False)
        train_ds = _subset(train_full, train_size, seed, len(train_full))
        test_ds = _subset(test_full, test_size, seed + 1, len(test_full))
        classes = CIFAR10_CLASSES
        announcement = f"Dataset: CIFAR-10 ({reason}), {len(train_ds)} train / {len(test_ds)} test images"
    else:
        mean, std = _synthetic_normalisation(seed)
        n_train = SYNTHETIC_SIZES[0] if train_size is None else min(train_size, SYNTHETIC_SIZES[0])
        n_test = SYNTHETIC_SIZES[1] if test_size is None else min(test_size, SYNTHETIC_SIZES[1])
        if n_train < 1 or n_test < 1:
            raise ValueError(f"sizes must be positive, got train_size={train_size}, test_size={test_size}")
        train_ds = SyntheticCIFAR(*make_synthetic(n_train, "train", seed), mean, std)
        test_ds = SyntheticCIFAR(*make_synthetic(n_test, "test", seed), mean, std)
        classes = tuple(f"class {k}" for k in range(10))
        announcement = (
            f"Dataset: SYNTHETIC CIFAR-shaped data ({reason}), {n_train} train / {n_test} test images, "
            f"seed {seed} -- numbers below are NOT CIFAR-10 results"
        )
    info = DatasetInfo(
        name=resolved,
        announcement=announcement,
        reason=reason,
        num_classes=10,
        classes=classes,
        train_size=len(train_ds),
        test_size=len(test_ds),
        root=root,
        seed=seed,
    )
    return train_ds, test_ds, info
