# Two entry points for a fresh machine:
#   make demo   install everything into .venv and run the quickstart (GRPO on 4 emulated chips)
#   make test   install everything into .venv and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export RAY_AUTH_MODE := disabled
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup demo test browser bench bench-sampler clean

setup: $(VENV)/.installed

# torch is pinned to the CPU build first (an unpinned torch would pull a multi-GB CUDA build)
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,hf,data,loggers]'  # loggers: the TensorBoard/W&B/MLflow tests run in CI
	$(PY) -m pip install --quiet -e '.[tpu]'  # TorchTPU + libtpu: imports on CPU (no device), tests compare its launch env
	touch $@

demo: setup
	$(VENV)/bin/rltpu train configs/quickstart.yaml

test: setup browser
	$(PY) -m pytest -q --durations=25  # the slowest tests, printed for whoever shortens CI next

# tests/test_plan.py opens the plan's HTML report in headless Chromium. CI is a fresh machine
# running as root: install the Debian package there; elsewhere (or offline) the test skips.
browser:
	@if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; } || \
	  echo "make: could not install chromium; the HTML report test will be skipped"; \
	else echo "make: no chromium and no apt-get as root; the HTML report test will be skipped"; fi

# every figure README quotes, measured again: benchmarks/results/<machine>-<date>.json
# (ONLY=quickstart,plan for a subset; then `$(PY) benchmarks/all.py --readme` rewrites README's figure blocks)
bench: setup
	$(PY) benchmarks/all.py $(if $(ONLY),--only $(ONLY))

# rltpu's sampler vs Hugging Face generate on the same weights (one JSON document on stdout)
bench-sampler: setup
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/sampler.py

clean:
	rm -rf $(VENV) runs .pytest_cache
