"""Issue 19, secure by default: Ray token authentication on the embedded cluster.

These tests are the exception to the suite's ``RAY_AUTH_MODE=disabled`` (which the other tests set
only because their processes join shared clusters without a token): here the mode is left unset,
as a user's shell would, and the embedded cluster must refuse a client without its token.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rltpu.chips import cluster
from rltpu.control.placement import actor_env

ROOT = Path(__file__).resolve().parents[1]


def _clean_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return env | {"HOME": str(tmp_path / "home"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                  "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}


def test_users_auth_mode_is_kept_and_never_forced_off(tmp_path, monkeypatch):
    from rltpu.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    for mode in ("disabled", "token"):
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
        assert cluster.ray_auth(tmp_path / "run", joining=False) == mode and os.environ["RAY_AUTH_MODE"] == mode
    assert "RAY_AUTH_MODE" not in cluster.RAY_ENV
    assert "RAY_AUTH_MODE" not in actor_env(load_config(ROOT / "configs" / "quickstart.yaml", []))
    # --address with no token anywhere: Ray's own default (nothing sent); with one: token mode
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert cluster.ray_auth(tmp_path / "run", joining=True) == "unset" and "RAY_AUTH_MODE" not in os.environ
    monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")
    assert cluster.ray_auth(tmp_path / "run", joining=True) == "token"


def test_embedded_cluster_gets_a_private_token_in_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    assert cluster.ray_auth(tmp_path / "run", joining=False) == "token"
    token = tmp_path / "run" / cluster.TOKEN_FILE
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(token.resolve())
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    first = token.read_text()
    monkeypatch.delenv("RAY_AUTH_MODE")
    cluster.ray_auth(tmp_path / "run", joining=False)  # a resume reuses it
    assert token.read_text() == first


@pytest.mark.slow
def test_embedded_cluster_cannot_be_joined_without_its_token(tmp_path):
    """The embedded cluster as ``rltpu train`` starts it (mode unset); a ``ray.init(address=...)``
    without the token fails, one with a wrong token fails, one with the token runs a task."""
    import tempfile

    short = tempfile.mkdtemp(prefix="rltpu-auth-", dir="/tmp")  # AF_UNIX socket paths must stay short
    head = textwrap.dedent(f"""
        import subprocess, sys
        from rltpu.chips.cluster import ray_auth
        assert ray_auth({str(tmp_path / 'run')!r}, joining=False) == "token"
        import ray
        ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
                 _temp_dir={short!r}, logging_level="ERROR")
        print(ray.get_runtime_context().gcs_address, flush=True)
        sys.stdin.readline()  # until the test is done
        ray.shutdown()
    """)
    env = _clean_env(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", head], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "head.log", "w"), text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address, (tmp_path / "head.log").read_text()[-2000:]
        client = textwrap.dedent("""
            import sys, ray
            ray.init(address=sys.argv[1], logging_level="ERROR")
            print("joined", ray.get(ray.remote(lambda: 42).remote(), timeout=60))
        """)

        def join(extra: dict) -> subprocess.CompletedProcess:
            # a refused token is final: 3 connection attempts instead of Ray's default 20 (~1 s each)
            return subprocess.run([sys.executable, "-c", client, address], cwd=ROOT,
                                  env=env | {"RAY_gcs_server_port_wait_time_s": "3"} | extra,
                                  capture_output=True, text=True, timeout=180)

        no_token = join({})
        assert no_token.returncode != 0 and "joined" not in no_token.stdout
        assert "InvalidAuthToken" in no_token.stderr, no_token.stderr[-2000:]  # refused, not unreachable
        wrong = join({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
        assert wrong.returncode != 0 and "joined" not in wrong.stdout
        assert "InvalidAuthToken" in wrong.stderr, wrong.stderr[-2000:]
        ok = join({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "run" / cluster.TOKEN_FILE)})
        assert ok.returncode == 0 and "joined 42" in ok.stdout, ok.stderr[-2000:]
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)
