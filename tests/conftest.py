"""Suite-wide fixtures.

``shared_ray_head``: one Ray head with 4 emulated TPU chips for every end-to-end module that joins
a cluster with ``--address`` (each run still starts its own actors and compiles; the cluster start
is paid once per session instead of once per module). Token auth is off for it (as in every test
env here) because the test processes join it without the token a fresh cluster would mint.
"""

from __future__ import annotations

import os

import pytest

import procs

# as the CLI and the actors do: no device backend at ``import torch`` in test processes either;
# tests of the TPU path import torch_tpu themselves
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# one persistent JAX compile cache for every `rltpu train` the suite starts (the sampler programs of the
# quickstart grid are compiled once, not once per run); a test of the cache itself uses its own dir
if "RLTPU_COMPILE_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["RLTPU_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="rltpu-suite-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["RLTPU_COMPILE_CACHE_DIR"], True)

RAY_ENV = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0")


@pytest.fixture(scope="session")
def shared_ray_head():
    with procs.ray_head("suite", RAY_ENV) as address:
        yield address
