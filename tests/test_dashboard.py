"""The dashboard server on a run directory: the page in headless Chromium (actor table, chip map),
Prometheus text at /metrics, loopback only."""

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from rltpu.observe.dashboard import serve
from rltpu.observe.health import actor_rows, write_health

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def fake_run(run_dir: Path) -> None:
    """A run dir as `rltpu train` leaves it mid-run: 4 chips, one sampler restarted once."""
    now = time.time()
    rep = lambda g, r, chip, phase: {"group": g, "rank": r, "incarnation": 0, "phase": phase,  # noqa: E731
                                     "phase_since": now - 1, "time": now, "received": now, "last_progress": now,
                                     "pid": 100 + chip, "host": "h0", "chips": [chip], "chip_ids": [chip],
                                     "step": 5, "version": 5, "rss_mb": 321.5, "compiles": 1}
    reports = {"trainer-0": rep("trainer", 0, 0, "training"), "trainer-1": rep("trainer", 1, 1, "training"),
               "sampler-0": rep("sampler", 0, 2, "idle"), "sampler-1": rep("sampler", 1, 3, "sampling")}
    chips = [{"global_id": i, "slice": 0, "host": 0, "index": i, "coords": f"{i % 2},{i // 2}"} for i in range(4)]
    doc = {"time": now, "state": "running", "run_dir": str(run_dir), "step": 5, "steps": 20, "weight_version": 5,
           "heartbeat_timeout_s": 60, "stale_after_s": 30, "chips": chips,
           "actors": actor_rows(reports, list(reports), {"sampler-1": 1}, {}, now),
           "events": [{"time": now, "actor": "sampler-1", "what": "replaced", "why": "died (SIGKILL)", "step": 3}]}
    write_health(run_dir / "health.json", doc)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, 6):
            f.write(json.dumps({"step": s, "reward_mean": 0.1 * s, "sample_s": 0.1, "train_s": 0.3,
                                "sync_s": 0.05, "loss": 0.01}) + "\n")


@pytest.fixture
def server(tmp_path):
    fake_run(tmp_path)
    srv = serve(tmp_path, "127.0.0.1", 0)
    yield srv
    srv.shutdown()
    srv.server_close()


def test_metrics_and_files(server):
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    assert "rltpu_up 1" in text and "rltpu_step 5" in text and "rltpu_reward_mean 0.5" in text
    assert 'rltpu_actor_restarts_total{group="sampler",rank="1",phase="sampling"} 1' in text
    assert 'rltpu_actor_rss_bytes{group="trainer",rank="0",phase="training"} 337117184' in text
    health = json.loads(urllib.request.urlopen(f"http://{host}:{port}/health.json", timeout=10).read())
    assert health["step"] == 5
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"http://{host}:{port}/nope", timeout=10)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (make browser)")
def test_page_in_headless_chromium(server, tmp_path):
    host, port = server.server_address[:2]
    profile = tmp_path / "chrome-profile"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}"]
    res = subprocess.run([CHROMIUM, *flags, "--dump-dom", f"http://{host}:{port}/"], capture_output=True,
                         text=True, timeout=120)
    dom = res.stdout
    assert '<table id="actors">' in dom, res.stderr[-2000:]
    assert dom.count('class="actor state-') == 4 and "state-restarted" in dom
    assert '<svg id="chip-map"' in dom and dom.count('class="chip"') == 4
    assert 'id="reward-chart"' in dom and "<polyline" in dom and 'id="phase-chart"' in dom
    assert "died (SIGKILL)" in dom
    shot = tmp_path / "dash.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1200,900", f"http://{host}:{port}/"],
                   capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000
