"""In the notebook kernel: environment probes and verdict, plots, widgets, exercises, the course runner and report.
Every rank is a subprocess started by ``helpers.launch``; nothing here initialises CUDA.

This package is the kernel's entry point, and the one place that sets ``DS_ACCELERATOR``: to ``cpu``, unless it is
set already, for the kernel's own DeepSpeed imports (the facts a ds_config is checked against, the memory
estimators in :mod:`helpers.rank.deepspeed_facts`), so that DeepSpeed never picks CUDA in the kernel. The ranks
get theirs from the launcher, from their backend (:func:`helpers.launch.environment.rank_env`), whatever the
kernel has.
"""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
