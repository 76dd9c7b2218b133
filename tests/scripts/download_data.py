"""Fixture: every rank calls helpers.rank.data.get_datasets("auto") against the fake CIFAR-10 mirror.

Launched by tests/test_data_download.py with ``--root``; the mirror's manifest comes from FAKE_CIFAR_MANIFEST.
Each rank reports what it loaded and a digest of its images, so the test can check that rank 0 alone
downloaded and that every rank built the same data.
"""
import argparse
import hashlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for fake_cifar_mirror
from fake_cifar_mirror import patch_from_env  # noqa: E402

from helpers.rank.data import get_datasets  # noqa: E402
from helpers.rank.metrics import Reporter  # noqa: E402
from helpers.rank.runtime import end_rank  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    patch_from_env()
    dist.init_process_group("gloo")
    train_ds, test_ds, info = get_datasets("auto", root=args.root)
    images = torch.stack([train_ds[i][0] for i in range(len(train_ds))])
    Reporter(schema=None).result(name=info.name, reason=info.reason, train_size=len(train_ds), test_size=len(test_ds),
                      digest=hashlib.sha256(images.numpy().tobytes()).hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())
