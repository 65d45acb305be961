# One venv, pinned torch for this machine (a CPU build lies on disk; an unpinned
# torch would pull a multi-GB CUDA build). GPU users: see docs/user_guide/pretraining.md, "On GPUs".
PYTHON   ?= python3
VENV     ?= .venv
TORCH    ?= torch==2.13.0
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
NPROC_PER_NODE ?= 2

# The second megatron-core: the newest 0.19.x needs Python >= 3.12, so it gets its own venv.
# PYTHON_COMPAT: python3.12 on PATH, else pyenv's newest 3.12 (empty when neither runs).
PYTHON_COMPAT ?= $(shell for p in python3.12 $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n 1); do \
                   $$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1 && { command -v $$p; break; }; done)
VENV_COMPAT   ?= .venv-compat
MCORE_COMPAT  ?= megatron-core>=0.19,<0.20
PY_COMPAT     := $(VENV_COMPAT)/bin/python

.PHONY: venv install test test-compat python-compat train bench gpu-check clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q "$(TORCH)" -e ".[test]"
	touch $@

venv install: $(VENV)/.installed

# test_real_libraries.py runs flash-attn's and TE's shipped Python from .gl/ (cached; a release the
# registry cannot give is reported and its tests skip with that reason).
test: $(VENV)/.installed
	bash scripts/ci/gpu_libs.sh
	$(PY) -m pytest -q -x --durations=15 $(PYTEST_ARGS)

# Same suite on Python 3.12 + the newest megatron-core 0.19.x (torch's PyPI wheel there is the
# CUDA build, ~5 GB; it runs on CPU).
$(VENV_COMPAT)/.installed: pyproject.toml Makefile
	@test -n "$(PYTHON_COMPAT)" || { echo "test-compat: no Python 3.12 found (python3.12 on PATH or" \
	  "~/.pyenv/versions/3.12*); install one (pyenv install 3.12) or pass PYTHON_COMPAT=/path/to/python3.12" >&2; exit 2; }
	$(PYTHON_COMPAT) -m venv $(VENV_COMPAT)
	$(PY_COMPAT) -m pip install -q --upgrade pip
	$(PY_COMPAT) -m pip install -q "$(TORCH)" "$(MCORE_COMPAT)"
	$(PY_COMPAT) -m pip install -q "$(TORCH)" "$(MCORE_COMPAT)" -e ".[test]"
	touch $@

test-compat: $(VENV_COMPAT)/.installed
	bash scripts/ci/gpu_libs.sh
	PYTHON=$(PY_COMPAT) bash scripts/ci/gpu_libs.sh
	$(PY_COMPAT) -c 'import megatron.core as m, torch, sys; print("test-compat: python", sys.version.split()[0], "megatron-core", m.__version__, "torch", torch.__version__)'
	$(PY_COMPAT) -m pytest -q -x --durations=15 $(PYTEST_ARGS)

# Prints the Python 3.12 that test-compat would use (empty: none); .ci/run skips test-compat then.
python-compat:
	@echo "$(PYTHON_COMPAT)"

train: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC_PER_NODE) scripts/pretrain_gpt.py $(TRAIN_ARGS)

bench: $(VENV)/.installed
	$(PY) scripts/bench/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV_COMPAT) data_cache checkpoints runs
