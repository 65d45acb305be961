# One venv, pinned torch for this machine (a CPU build lies on disk; an unpinned
# torch would pull a multi-GB CUDA build). GPU users: see README "On GPUs".
PYTHON   ?= python3
VENV     ?= .venv
TORCH    ?= torch==2.13.0
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
NPROC_PER_NODE ?= 2

.PHONY: venv install test train bench gpu-check clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q "$(TORCH)" -e ".[test]"
	touch $@

venv install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q -x --durations=15 $(PYTEST_ARGS)

train: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC_PER_NODE) scripts/pretrain_gpt.py $(TRAIN_ARGS)

bench: $(VENV)/.installed
	$(PY) scripts/bench/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) data_cache checkpoints runs
