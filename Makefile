# Distributed Training from Zero -- every target creates .venv when missing and is safe to repeat.
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.course-installed
PROFILE ?= auto
# A hang fails within 3 minutes anywhere in CI: a notebook cell (nbval's timeout), a test (pytest-timeout), and
# each launch has its own stall and wall-clock limits below those
HANG_S  := 180
NBVAL   := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout $(HANG_S)
# Each tier writes JUnit XML (per-test seconds) under build/junit/; tests/timings.py turns them into one table
JUNIT   := build/junit

# The fast tier (make check): every test not marked slow, browser or slurm, and the one real launch marked smoke
FAST    := (not slow and not browser and not slurm) or smoke
# Both test tiers run on 2 pytest-xdist workers, each test file on one worker (its module fixtures built once). On
# 2 cores this took the slow tier (without SLURM and the browser) from 624 s to 421 s: many of its tests wait (a
# stall, a timeout, a restart, a process group's start) while the other worker computes. 3 workers: 386 s, but
# single tests took up to 4x their serial time, and the SLURM tests failed their limits. The SLURM tests (8 ranks,
# two DeepSpeed jobs in one test, a refusal held to 30 s) run after, on their own. nbval stays serial: the
# notebooks' timing claims hold against noise measured in their own run, not a neighbour's.
XDIST   := -n 2 --dist loadfile

.PHONY: setup course check test tiers unit slow nbtest timings record matrix lab lab-zh regen translate bench clean

setup: $(STAMP)

# pip takes torch/torchvision within pyproject's ranges; the kernel is registered inside .venv so
# papermill and JupyterLab run notebooks on this environment, never on a machine-wide python3.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name dtfz --display-name "Python (distributed course)" >/dev/null
	@# DeepSpeed JIT-builds its CPU communication op on first use (~40 s); build it now, not in a learner's first run
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()" >/dev/null 2>&1 \
	  || echo "note: could not prebuild DeepSpeed's CPU comm op (needs g++); the first DeepSpeed run will build it"
	@touch $(STAMP)

course: setup          ## execute every notebook into build/notebooks and print the summary table
	$(PY) -m helpers course --profile $(PROFILE)

check: setup           ## fast tier (< 5 min): import contracts, calculations, refusals, one real launch, drift
	$(VENV)/bin/lint-imports --no-cache   # the layers of helpers (pyproject.toml)
	$(PY) -m pytest tests -q $(XDIST) -m "$(FAST)" --timeout $(HANG_S) --junitxml=$(JUNIT)/fast.xml

# everything (CI): the fast tier, the slow tests, then nbval on the committed notebooks; then, pass or fail, the table
# of where the time went (tests/timings.py), which CI prints
test:                  ## everything (CI), then the table of where its time went
	@rm -rf $(JUNIT)
	@status=0; $(MAKE) --no-print-directory tiers || status=$$?; \
	  $(PY) tests/timings.py || true; exit $$status

tiers: unit nbtest

# every test once: the fast tier, then the rest
unit: check slow

slow: setup            ## the tests beyond the fast tier: real multi-process launches, faults, browser, SLURM
	$(PY) -m pytest tests -q $(XDIST) -m "not ($(FAST)) and not slurm" --timeout $(HANG_S) --junitxml=$(JUNIT)/slow.xml
	$(PY) -m pytest tests -q -m "slurm and not ($(FAST))" --timeout $(HANG_S) --junitxml=$(JUNIT)/slurm.xml

# no live progress bars: the committed outputs have none (helpers/launch/session.py). Each notebook is held to its
# syllabus timeout (tests/nbval_timeouts.py), each cell to HANG_S. The English notebooks only:
# notebooks/zh/ holds the same cells and outputs (tests/test_translations.py proves it), so nbval runs once.
nbtest: setup
	HELPERS_OUTPUT=saved PYTHONPATH=tests $(PY) -m pytest $(NBVAL) -p nbval_timeouts notebooks/[0-9]*.ipynb -q \
	  -p no:cacheprovider --junitxml=$(JUNIT)/nbval.xml

timings:               ## the table of the last `make test`'s seconds: per tier, the slowest tests, every notebook
	@$(PY) tests/timings.py

# The outcomes fast tests replay (tests/recorded.py): a checker's wrong answers, the pipeline-schedule matrix. Each
# is re-launched for real and stored with a hash of its inputs; run it when a fast test says "stale" (a few minutes).
record: setup          ## re-launch and store the recorded outcomes that fast tests replay (tests/recorded/)
	RECORD_RUNS=1 $(PY) -m pytest tests -q -p no:cacheprovider $(RECORD)

# Not part of `make test` or CI (about 35 minutes on a 2-core CPU): every notebook at NPROC 1, 2, 3, and 4 for the
# sharding chapters (the counts live in helpers/notebook/matrix.py), into build/matrix/<nproc>/.
# Narrowed: make matrix NOTEBOOKS="01 02" NPROCS="1 3"
matrix: setup          ## every notebook at several rank counts: checks True/total, False and missing ones, seconds
	$(PY) -m helpers.notebook.matrix $(NOTEBOOKS) $(if $(strip $(NPROCS)),--nprocs $(NPROCS)) --profile $(PROFILE)

# Kernels over Unix sockets in Jupyter's runtime folder, not TCP on 127.0.0.1 (which any local process can reach, and
# about which ipykernel warns on every kernel start), where that folder's path leaves a socket path (~100 bytes at
# most) room for a kernel's ~50. The course runner does the same in a folder of its own (helpers/notebook/runner.py).
LAB_KERNELS = $(shell $(PY) -c "from jupyter_core.paths import jupyter_runtime_dir as d; print('--KernelManager.transport=ipc' if len(d()) <= 50 else '')" 2>/dev/null)

# COURSE_LANGUAGE=zh_CN (as for the kernel's exercise verdicts, helpers/notebook/i18n.py) makes `make lab` `make lab-zh`
lab: setup             ## JupyterLab on the course (COURSE_LANGUAGE=zh_CN: in Chinese, on notebooks/zh)
ifneq ($(filter zh zh_CN zh-CN,$(COURSE_LANGUAGE)),)
	@$(MAKE) --no-print-directory lab-zh
else
	$(VENV)/bin/jupyter lab $(LAB_KERNELS) --notebook-dir=. notebooks/00_environment_check.ipynb
endif

# JupyterLab in Chinese on the Chinese edition. Its settings live in build/lab-zh (your own JupyterLab settings are
# not read there); in any JupyterLab, Settings > Language > 中文 (简体, 中国) switches the same way.
LAB_ZH := build/lab-zh/settings
lab-zh: setup          ## JupyterLab in Chinese on notebooks/zh (中文版)
	@mkdir -p $(LAB_ZH)/@jupyterlab/translation-extension
	@echo '{"locale": "zh_CN"}' > $(LAB_ZH)/@jupyterlab/translation-extension/plugin.jupyterlab-settings
	JUPYTERLAB_SETTINGS_DIR=$(LAB_ZH) $(VENV)/bin/jupyter lab $(LAB_KERNELS) --notebook-dir=. notebooks/zh/00_environment_check.ipynb

regen: setup           ## instructors: re-execute notebooks in place, strip volatile metadata, rebuild notebooks/zh
	$(PY) -m helpers regen --profile $(PROFILE)
	@# what a reviewer should read: changed check lines and compared outputs, not timings and images
	@$(PY) -m helpers.notebook.regen_diff || true

translate: setup       ## Chinese edition: update translations/zh_CN/*.po from the English, build notebooks/zh/
	$(PY) -m helpers translate

bench: setup           ## benchmarks: printed ratios, not pass/fail tests
	$(PY) benchmarks/bench_launcher.py
	$(PY) benchmarks/bench_side_by_side.py
	$(PY) benchmarks/bench_ds_startup.py
	$(PY) benchmarks/bench_ddp.py
	$(PY) benchmarks/bench_ds_first_launch.py

clean:
	rm -rf build runs
