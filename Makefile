# Attention, from the math to a Triton kernel.
# `make lab` and `make test` create the environment on first use (conda env when conda is on
# PATH, otherwise .venv with pip) and reuse it afterwards.
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= python3
# CI and this project's machines pin torch (a CPU build is provided locally); the package itself
# accepts a range so that Colab keeps its own torch. Keep in sync with environment.yml (a test checks).
TORCH_PIN := torch==2.13.0
PIP_SPEC := $(TORCH_PIN) -e .[dev]
CONDA_ENV := attention-course
NB ?=
JOBS ?= 2
# The pip environment's folder: `make test PYTHON=python3.12 VENV=.venv-3.12` builds and tests a
# second one beside the first (.ci/run does so for Python 3.10, 3.12 and 3.13).
VENV ?= .venv
LAB_ARGS ?=
# JupyterLab refuses to start as root (containers, some cloud VMs) unless told it may.
# JupyterLab's news pop-up and update check would cover the first notebook on a learner's first screen.
LAB_NO_NEWS := --LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate
LAB_ROOT := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root,)

ifneq ($(PY),)
  # PY=/path/to/python uses an existing environment as is (for example a GPU machine's image).
  ENV_STAMP :=
else ifneq ($(shell command -v conda 2>/dev/null),)
  PY := conda run --no-capture-output -n $(CONDA_ENV) python
  ENV_STAMP := .env-conda.stamp
else
  PY := $(VENV)/bin/python
  ENV_STAMP := $(VENV)/.stamp
endif

.PHONY: help setup lab test test-all nbval execute exercises sync grade gradescope bench kernel-report clean \
	new-exercise check-exercise

help:
	@echo "make lab        start JupyterLab on the course (creates the environment on first use)"
	@echo "make test       the fast suite, for every change: unit, checks, lint, drift, grading, notebooks (nbval)"
	@echo "make test-all   make test plus the slow checks: browser, nbgrader, package installs, every Run All (CI)"
	@echo "make nbval      strict nbval of notebooks/ and solutions/ alone (ATEN_CPU_CAPABILITY=default make nbval: another CPU)"
	@echo "make execute    re-run notebooks/ and solutions/ in fresh kernels and store their outputs (NB=03_masks: one topic)"
	@echo "make new-exercise NB=03 NAME=fn [ARGS='T, window'] [STARS=2] [TITLE=..] [SECTION=..]  a new exercise's stubs"
	@echo "make check-exercise EX=3.7   every test of one exercise, slow ones included (about a minute)"
	@echo "make exercises  regenerate exercises/ from solutions/"
	@echo "make sync       rewrite the Colab bootstrap cells and README notebook map from pyproject.toml"
	@echo "make grade      grade exercise notebooks (all, or NB=notebook, student folder or class folder)"
	@echo "make gradescope the autograder zip for Gradescope (build/gradescope-autograder.zip; see the README)"
	@echo "make bench      GPU benchmarks into helpers/results/ (on CPU: a small interpreter check)"
	@echo "make kernel-report  registers and spills of every autotuner config, compiled for sm_80/sm_90 without a GPU"
	@echo "make clean      remove caches and the environment"

setup: $(ENV_STAMP)

# nbgrader is a dev dependency (tests/test_nbgrader.py runs its commands); its JupyterLab menus
# (formgrader, assignment list) are for nbgrader courses, not for learners: switched off in the
# environment. `jupyter labextension enable @jupyter/nbgrader` turns them back on.
define hide_nbgrader
$(1) -m jupyter labextension disable --level=sys_prefix @jupyter/nbgrader >/dev/null 2>&1 || true; \
for e in formgrader validate_assignment assignment_list course_list; do \
  $(1) -m jupyter server extension disable --sys-prefix nbgrader.server_extensions.$$e >/dev/null 2>&1 || true; done
endef

# On Linux without an NVIDIA GPU (no nvidia-smi), take torch's CPU build from PyTorch's CPU index
# instead of the default wheel and its several GB of CUDA packages, if that index can be reached
# (machines with their own package mirror, like CI's, keep the mirror). TORCH_INDEX= turns it off.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(if $(and $(filter Linux,$(shell uname -s)),$(if $(shell command -v nvidia-smi),,no-gpu),$(shell $(PYTHON) -c 'import socket; socket.getaddrinfo("download.pytorch.org", 443)' 2>/dev/null && echo reachable)),--extra-index-url $(TORCH_CPU_INDEX))

$(VENV)/.stamp: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python >= 3.10 is needed; found " + sys.version.split()[0] + ". Run: make PYTHON=python3.11 ...")'
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet $(TORCH_INDEX) $(PIP_SPEC)
	@$(call hide_nbgrader,$(VENV)/bin/python)
	@touch $@

.env-conda.stamp: environment.yml pyproject.toml
	conda env update --name $(CONDA_ENV) --file environment.yml --prune
	@$(call hide_nbgrader,conda run -n $(CONDA_ENV) python)
	@touch $@

lab: $(ENV_STAMP)
	$(PY) -m jupyter lab --LabApp.default_url=/lab/tree/notebooks/01_qkv_shapes.ipynb $(LAB_NO_NEWS) $(LAB_ROOT) $(LAB_ARGS)

# Both run notebooks/ and solutions/ under nbval (strict: committed outputs must match). `make test`
# leaves out the tests marked slow (pyproject.toml); `make test-all` runs them too, as .ci/run does.
# --dist loadscope keeps a notebook's cells on one worker (one kernel); --no-loadscope-reorder starts
# modules in file order, so that the long browser test (one scope, one worker) starts early.
PYTEST := $(PY) -m pytest -n $(JOBS) --dist loadscope --no-loadscope-reorder --durations=10 \
	--nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

test: $(ENV_STAMP)
	$(PYTEST) -m "not slow" tests notebooks solutions

test-all: $(ENV_STAMP)
	$(PYTEST) tests notebooks solutions

# Strict nbval of the committed notebooks alone, e.g. with torch's kernels for another CPU:
# `ATEN_CPU_CAPABILITY=default make nbval` (also avx2, avx512; .ci/run runs default and avx2).
nbval: $(ENV_STAMP)
	$(PYTEST) notebooks solutions

# NB=03_masks (or 03): that topic's teaching and solutions notebooks only.
execute: $(ENV_STAMP)
	$(PY) -m helpers.tools.notebooks execute $(if $(NB),$(NB),notebooks solutions)

# The stubs of a new exercise in the five places an exercise lives (helpers/tools/scaffold.py; CONTRIBUTING.md).
new-exercise: $(ENV_STAMP)
	@test -n "$(NB)" -a -n "$(NAME)" || { echo "usage: make new-exercise NB=03 NAME=sliding_window_mask [ARGS='T, window'] [STARS=2] [TITLE='...'] [SECTION='...']"; exit 2; }
	$(PY) -m helpers.tools.scaffold new $(NB) $(NAME) $(if $(ARGS),--args "$(ARGS)") $(if $(STARS),--stars $(STARS)) $(if $(TITLE),--title "$(TITLE)") $(if $(SECTION),--section "$(SECTION)")

# Every test of one exercise (EX=3.7 or its function's name), the slow ones included.
check-exercise: $(ENV_STAMP)
	@test -n "$(EX)" || { echo "usage: make check-exercise EX=3.7"; exit 2; }
	JOBS=$(JOBS) $(PY) -m helpers.tools.scaffold check $(EX)

exercises: $(ENV_STAMP)
	$(PY) -m helpers.tools.notebooks exercises

sync: $(ENV_STAMP)
	$(PY) -m helpers.tools.notebooks sync

# make grade [NB=notebook, student folder or class folder] [JOBS=n: notebooks at once; default all cores]
#   [REPORT=dir: the class's mistake report, feedback per student] [ANONYMISE=1] [GRADESCOPE=1] (with REPORT)
#   [EXPECT=03_masks,05_multihead: notebooks every student must hand in]
#   [GRADEBOOK=path.csv: default REPORT/gradebook.csv, or gradebook.csv here for a class without REPORT]
grade: $(ENV_STAMP)
	$(PY) -m helpers.tools.grading $(if $(filter command line environment,$(origin JOBS)),-j $(JOBS) )$(if $(REPORT),--report $(REPORT) )$(if $(GRADEBOOK),--gradebook $(GRADEBOOK) )$(if $(filter 1 yes true,$(ANONYMISE)),--anonymise )$(if $(filter 1 yes true,$(GRADESCOPE)),--gradescope )$(if $(EXPECT),--expect $(EXPECT) )$(if $(NB),$(NB),exercises)

# The autograder zip Gradescope asks for: setup.sh, run_autograder and the course at GRADESCOPE_REV
# (default HEAD: git archive, so committed files only; tests/test_gradescope.py names a tree of the
# working tree) in GRADESCOPE_OUT (default build/; the test uses a temporary folder).
# NOTEBOOKS=03_masks,05_multihead: the assignment's notebooks (one not handed in is graded missing).
GRADESCOPE_REV ?= HEAD
GRADESCOPE_OUT ?= build
gradescope: $(ENV_STAMP)
	rm -rf "$(GRADESCOPE_OUT)/gradescope" "$(GRADESCOPE_OUT)/gradescope-autograder.zip"
	mkdir -p "$(GRADESCOPE_OUT)/gradescope"
	set -o pipefail; git archive --format=tar --prefix=course/ $(GRADESCOPE_REV) -- . ':(exclude)solutions' \
	  | tar -x -C "$(GRADESCOPE_OUT)/gradescope"
	sed 's/@TORCH_PIN@/$(TORCH_PIN)/' gradescope/setup.sh > "$(GRADESCOPE_OUT)/gradescope/setup.sh"
	echo "$(NOTEBOOKS)" > "$(GRADESCOPE_OUT)/gradescope/course/gradescope_notebooks.txt"
	cp gradescope/run_autograder "$(GRADESCOPE_OUT)/gradescope/"
	chmod +x "$(GRADESCOPE_OUT)/gradescope/setup.sh" "$(GRADESCOPE_OUT)/gradescope/run_autograder"
	$(PY) -c "import shutil, sys; shutil.make_archive(sys.argv[1], 'zip', sys.argv[2])" \
	  "$(GRADESCOPE_OUT)/gradescope-autograder" "$(GRADESCOPE_OUT)/gradescope"
	@echo "wrote $(GRADESCOPE_OUT)/gradescope-autograder.zip: upload it as the assignment's autograder (README: Gradescope)"

bench: $(ENV_STAMP)
	$(PY) bench/bench_attention.py

# Compiles every config the autotuner can choose for named GPUs (no GPU needed; ~400 compiles, ~30 min
# on 2 cores; an interrupted run resumes) into helpers/results/kernel_aot.{json,md}.
# KERNEL_REPORT_ARGS: e.g. --fast (fp16 only), --targets sm_80,sm_89,sm_90, --jobs 4.
KERNEL_REPORT_ARGS ?=
kernel-report: $(ENV_STAMP)
	TRITON_INTERPRET=0 $(PY) -m helpers.tools.kernel_report $(KERNEL_REPORT_ARGS)

clean:
	rm -rf .venv .venv-* .env-conda.stamp .pytest_cache .ruff_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
