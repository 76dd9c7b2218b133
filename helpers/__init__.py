"""The course's library, in four parts along one line (enforced by the import-linter contracts in pyproject.toml):

* ``helpers.rank``     -- runs inside a rank: what the ``course/`` scripts import.
* ``helpers.calc``     -- pure calculations (formulas, estimators, ds_config checks): no process group, no subprocess.
* ``helpers.launch``   -- notebook kernel: starts real multi-process runs with torchrun / deepspeed and watches them.
* ``helpers.notebook`` -- notebook kernel: environment check, plots, widgets, exercises, the course runner.

The rank side never imports the kernel side; pure calculations import neither.
"""
