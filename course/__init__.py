"""The course's scripts: each is run on its own by torchrun or deepspeed (``torchrun --nproc-per-node 2
course/ddp_cifar10.py``), never imported. This file only makes the folder a package for the import-linter contract
in pyproject.toml: a script here imports the rank side (``helpers.rank``) and pure calculations (``helpers.calc``),
never the notebook kernel's launcher or helpers."""
