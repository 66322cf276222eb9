# Two entry points for a fresh machine:
#   make demo   install everything into .venv and run the quickstart (GRPO on 4 emulated chips; an earlier
#               demo run in runs/quickstart moves to runs/quickstart/previous-<time>/)
#   make test   install everything into .venv and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup tpu-libtpu demo test browser bench bench-sampler clean

setup: $(VENV)/.installed

# One pip resolve for everything (each extra pip run resolves and checks every installed package again).
# torch==2.13.0 is pinned in pyproject.toml, so no unpinned (multi-GB CUDA) build is pulled. pip is upgraded
# first: the venv's bundled pip (23.x) ignores this machine's file:// extra indexes, with a warning per package.
# loggers: the TensorBoard/W&B/MLflow tests run in CI; tpu: TorchTPU + libtpu import on CPU (no device) and
# tests compare its launch env. vllm: vLLM's CPU build (sampler.backend: vllm); the torchvision, torchaudio and
# torchcodec it pulls fail to load against torch 2.13.0+cpu (torchvision::nms missing, .so load errors) and
# transformers imports torchvision when it is installed, so they are uninstalled (vLLM's text models need none).
# Bytecode is compiled here, at install: this machine (and CI) sets
# PYTHONDONTWRITEBYTECODE=1, so with `--no-compile` every process compiled torch & co. from source at each
# import (tried: the parallel part reached 35% in 19 min instead of 97% in 18).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,hf,data,math,loggers,tpu,vllm]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(MAKE) tpu-libtpu
	touch $@

# JAX (samplers) and TorchTPU (trainers) pin different libtpu builds (rltpu/chips/libtpu.py): the project's
# venv holds TorchTPU's; JAX's goes beside it, in $(VENV)/libtpu-jax, with the pin read from jax's own metadata.
# Each actor on a real chip gets TPU_LIBRARY_PATH of its runtime's build (`rltpu doctor` shows both).
tpu-libtpu:
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/libtpu-jax \
	  "libtpu$$($(PY) -c 'from rltpu.chips.libtpu import requirement; print(requirement("jax"))')"

demo: setup
	$(VENV)/bin/rltpu train configs/quickstart.yaml --new-run

# Two parts: everything but the `serial` tests on 2 xdist workers (the suite keeps 2 cores about 96% busy
# either way; overlapping one test's waits with another's work took its serial 34 min to 28.5), then the
# `serial` ones alone: wall-clock bounds (reward deadlines, the planner against a real run) and the session
# run they share. --dist loadgroup: tests marked with one xdist_group share a worker, so a
# session run they read (the quickstart, its SIGTERM + resume) is made once. --durations: the slowest tests,
# for whoever shortens CI next.
# Only the suite turns Ray's token auth off (its processes join shared clusters that hold no token;
# tests/test_security.py unsets it again); demo, bench and every command a user runs keep token mode.
test: export RAY_AUTH_MODE := disabled
test: setup browser
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not serial" --durations=25
	$(PY) -m pytest -q -m serial --durations=10

# `make -j2 test` (.ci/run) installs the venv and Chromium side by side (network and unpacking, not CPU).
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
