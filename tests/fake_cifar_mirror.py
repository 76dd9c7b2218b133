"""A local stand-in for the CIFAR-10 download server, for tests that cannot reach the real one.

:func:`build_archive` writes ``cifar-10-python.tar.gz`` in CIFAR-10's own format (pickled batches of
uint8 rows, ``batches.meta`` with the label names) but with only a few images, and returns the manifest
torchvision needs to accept it: the URL and the MD5 of the archive and of every member.
:func:`patch_torchvision` applies a manifest (to the class attributes torchvision checks, and to the URL
``helpers.rank.data`` probes). :class:`Mirror` serves a folder over HTTP on 127.0.0.1 and counts the GETs.
"""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import pickle
import tarfile
import threading
from pathlib import Path

import numpy as np

MANIFEST_ENV = "FAKE_CIFAR_MANIFEST"  # path of a manifest JSON, read by tests/scripts/download_data.py
TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
PER_BATCH = 4  # images per batch file: 20 train, 4 test


def fake_images(batch: str) -> tuple[np.ndarray, list[int]]:
    """The rows (N, 3072 uint8, CIFAR's channel-major layout) and labels of one batch file; seeded by its name."""
    rng = np.random.default_rng(int(hashlib.sha256(batch.encode()).hexdigest()[:8], 16))
    return rng.integers(0, 256, size=(PER_BATCH, 3072), dtype=np.uint8), rng.integers(0, 10, PER_BATCH).tolist()


def build_archive(folder: Path, url_base: str) -> dict:
    """Write the fake archive into ``folder`` and return its manifest."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import calculate_md5 as md5

    from helpers.rank.data import CIFAR10_CLASSES

    staging = folder / "staging" / CIFAR10.base_folder
    staging.mkdir(parents=True)
    for batch in TRAIN_BATCHES + ["test_batch"]:
        rows, labels = fake_images(batch)
        (staging / batch).write_bytes(pickle.dumps({"batch_label": batch, "data": rows, "labels": labels}))
    (staging / "batches.meta").write_bytes(pickle.dumps({"label_names": list(CIFAR10_CLASSES)}))
    archive = folder / CIFAR10.filename
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(staging, arcname=CIFAR10.base_folder)
    return {
        "url": f"{url_base}/{CIFAR10.filename}",
        "tgz_md5": md5(archive),
        "train_list": [[b, md5(staging / b)] for b in TRAIN_BATCHES],
        "test_list": [["test_batch", md5(staging / "test_batch")]],
        "meta_md5": md5(staging / "batches.meta"),
    }


def patch_torchvision(manifest: dict, setattr_=setattr) -> None:
    """Point torchvision's CIFAR10 and helpers.rank.data at the fake archive (``setattr_``: e.g. monkeypatch.setattr)."""
    from torchvision.datasets import CIFAR10

    from helpers.rank import data

    setattr_(CIFAR10, "url", manifest["url"])
    setattr_(CIFAR10, "tgz_md5", manifest["tgz_md5"])
    setattr_(CIFAR10, "train_list", [list(x) for x in manifest["train_list"]])
    setattr_(CIFAR10, "test_list", [list(x) for x in manifest["test_list"]])
    setattr_(CIFAR10, "meta", {**CIFAR10.meta, "md5": manifest["meta_md5"]})
    setattr_(data, "CIFAR10_URL", manifest["url"])


def patch_from_env() -> None:
    """In a launched rank: apply the manifest named by :data:`MANIFEST_ENV`."""
    patch_torchvision(json.loads(Path(os.environ[MANIFEST_ENV]).read_text()))


class Mirror:
    """``with Mirror(folder) as m:`` serves ``folder`` at ``m.url`` (127.0.0.1, a free port); ``m.gets`` lists
    the paths requested with GET, in order. One torchvision download is two GETs of the archive (a redirect
    probe, then the file), so tests compare counts with a download they make themselves."""

    def __init__(self, folder: Path):
        mirror = self
        self.gets: list[str] = []
        self.manifest: dict | None = None  # set by whoever builds the archive it serves

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(folder), **kwargs)

            def do_GET(self):
                mirror.gets.append(self.path)
                super().do_GET()

            def log_message(self, *args):  # keep the test output clean
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                # torchvision's redirect probe sends a GET (its "HEAD" is only a header) and hangs up mid-file
                pass

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "Mirror":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
