# Two entry points for a fresh machine:
#   make demo   install everything into .venv and run the quickstart (GRPO on 4 emulated chips)
#   make test   install everything into .venv and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export RAY_AUTH_MODE := disabled
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup demo test bench-sampler clean

setup: $(VENV)/.installed

# torch is pinned to the CPU build first (an unpinned torch would pull a multi-GB CUDA build)
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,hf,data]'
	touch $@

demo: setup
	$(VENV)/bin/rltpu train configs/quickstart.yaml

test: setup
	$(PY) -m pytest -q

# rltpu's sampler vs Hugging Face generate on the same weights (one JSON document on stdout)
bench-sampler: setup
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/sampler.py

clean:
	rm -rf $(VENV) runs .pytest_cache
