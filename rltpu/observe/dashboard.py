"""A run's live dashboard, served from its directory (health.json, metrics.jsonl, trace.json).

    rltpu dashboard runs/quickstart --port 8266     # or dashboard.enabled=true on `rltpu train`

``/`` is one self-contained HTML page (inline SVG, no scripts from anywhere, refreshes itself every
2 s): the chip map coloured by owner with a health border, the actor table, reward and phase-time
charts, restart events. ``/metrics`` is Prometheus text; ``/health.json`` and ``/trace.json`` are
the files. The standard library's threaded HTTP server is enough for one page per run, and every
request re-reads the files, so the same server shows a live run or a finished one. Binds to
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import html
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rltpu.observe.health import assess
from rltpu.observe.log import log

OWNER_COLOURS = {"sampler": "#4e79a7", "trainer": "#f28e2b", "reward": "#59a14f", None: "#d0d0d0"}
STATE_COLOURS = {"ok": "#2ca02c", "restarted": "#e6b800", "starting": "#999999", "fenced": "#d62728"}
PHASE_KEYS = (("sample_s", "#4e79a7"), ("train_s", "#f28e2b"), ("sync_s", "#59a14f"))


def _read(run_dir: Path) -> tuple[dict, list[dict]]:
    try:
        health = json.loads((run_dir / "health.json").read_text())
    except (OSError, ValueError):
        health = {}
    metrics = []
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                metrics.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    except OSError:
        pass
    return health, metrics


def chip_map(health: dict) -> str:
    """One square per chip at its coordinates; fill = owning group, border = that actor's state."""
    owner = {}
    for a in health.get("actors", []):
        for cid in a.get("chip_ids") or []:
            owner[cid] = a
    chips = health.get("chips", [])
    cells = []
    for c in chips:
        xy = [int(v) for v in str(c.get("coords", "0,0")).split(",")[:2]] + [0]
        x, y = xy[0] + 4 * c.get("host", 0), xy[1]
        a = owner.get(c["global_id"])
        fill = OWNER_COLOURS.get(a["group"] if a else None, "#d0d0d0")
        stroke = STATE_COLOURS.get(a["state"], "#d62728") if a else "#aaaaaa"
        label = f"{a['group']} {a['rank']}" if a else "idle"
        cells.append(f'<g class="chip" data-chip="{c["global_id"]}"><rect x="{10 + x * 110}" y="{10 + y * 70}" '
                     f'width="100" height="60" rx="6" fill="{fill}" stroke="{stroke}" stroke-width="5"/>'
                     f'<text x="{60 + x * 110}" y="{36 + y * 70}" text-anchor="middle" fill="white" font-size="12">'
                     f'chip {c["global_id"]}</text><text x="{60 + x * 110}" y="{54 + y * 70}" text-anchor="middle" '
                     f'fill="white" font-size="12">{html.escape(label)}</text></g>')
    w = 20 + 110 * (1 + max([int(str(c.get("coords", "0")).split(",")[0]) + 4 * c.get("host", 0) for c in chips] or [0]))
    h = 20 + 70 * (1 + max([int((str(c.get("coords", "0,0")).split(",") + ["0"])[1]) for c in chips] or [0]))
    return f'<svg id="chip-map" width="{w}" height="{h}" role="img">{"".join(cells)}</svg>'


def line_chart(values: list[float], svg_id: str, colour: str = "#4e79a7", w: int = 480, h: int = 160) -> str:
    if not values:
        return f'<svg id="{svg_id}" width="{w}" height="{h}"><text x="10" y="20">no steps yet</text></svg>'
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    pts = " ".join(f"{10 + i * (w - 20) / max(len(values) - 1, 1):.1f},{h - 20 - (v - lo) / span * (h - 40):.1f}"
                   for i, v in enumerate(values))
    return (f'<svg id="{svg_id}" width="{w}" height="{h}"><polyline fill="none" stroke="{colour}" stroke-width="2" '
            f'points="{pts}"/><text x="10" y="14" font-size="11">{hi:.3g}</text>'
            f'<text x="10" y="{h - 4}" font-size="11">{lo:.3g} (steps 1..{len(values)})</text></svg>')


def phase_chart(metrics: list[dict], w: int = 480, h: int = 160) -> str:
    """Stacked bars of sample / train / sync seconds for the last 60 steps."""
    rows = metrics[-60:]
    if not rows:
        return f'<svg id="phase-chart" width="{w}" height="{h}"><text x="10" y="20">no steps yet</text></svg>'
    top = max(sum(r.get(k) or 0 for k, _ in PHASE_KEYS) for r in rows) or 1.0
    bw = (w - 20) / len(rows)
    bars = []
    for i, r in enumerate(rows):
        y = h - 20
        for k, colour in PHASE_KEYS:
            hh = (r.get(k) or 0) / top * (h - 40)
            y -= hh
            bars.append(f'<rect x="{10 + i * bw:.1f}" y="{y:.1f}" width="{max(bw - 1, 1):.1f}" height="{hh:.1f}" '
                        f'fill="{colour}"><title>step {r.get("step")} {k}={r.get(k) or 0:.3f}</title></rect>')
    legend = " ".join(f'<tspan fill="{c}">{k}</tspan>' for k, c in PHASE_KEYS)
    return (f'<svg id="phase-chart" width="{w}" height="{h}">{"".join(bars)}'
            f'<text x="10" y="14" font-size="11">{legend} (max {top:.2f}s)</text></svg>')


EVAL_KEYS = ("eval/accuracy", "eval/pass@k", "eval/mean@k")


def rewards_panel(health: dict, metrics: list[dict]) -> str:
    """The reward workers: failed calls per step (errors, timeouts) and the pool's totals."""
    rw = health.get("rewards") or {}
    rows = "".join(f"<tr><td>{m.get('step')}</td><td>{m.get('reward_errors', '-')}</td>"
                   f"<td>{m.get('reward_timeouts', '-')}</td><td>{m.get('reward_calls', '-')}</td></tr>"
                   for m in metrics[-8:])
    head = (f"<p id=\"reward-pool\">{rw.get('workers', '-')} workers for {html.escape(str(rw.get('fn', '-')))}, "
            f"deadline {rw.get('timeout_s', '-')}s, {rw.get('replaced', 0)} replaced; run totals: "
            f"{rw.get('reward_errors', 0)} errors, {rw.get('reward_timeouts', 0)} timeouts</p>") if rw else ""
    return (f'{head}<table id="reward-failures"><tr><th>step</th><th>errors</th><th>timeouts</th><th>calls</th>'
            f'</tr>{rows}</table>')


def eval_panel(metrics: list[dict]) -> str:
    """Held-out evaluation: the newest figures and a line per metric over the steps that ran it."""
    evals = [m for m in metrics if any(k in m for k in EVAL_KEYS)]
    if not evals:
        return '<p id="eval">no evaluation yet</p>'
    last = evals[-1]
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{last[k]:.4f}</td></tr>" for k in EVAL_KEYS if k in last)
    charts = "".join(line_chart([m[k] for m in evals if k in m], "eval-" + k.split("/")[1].replace("@", "-at-"))
                     for k in EVAL_KEYS if k in last)
    return f'<table id="eval"><tr><th>step {last.get("step")}</th><th></th></tr>{cells}</table>{charts}'


def page(run_dir: Path) -> str:
    health, metrics = _read(run_dir)
    healthy, problems = assess(health) if health else (False, ["no health.json yet"])
    now = time.time()
    rows = []
    for a in health.get("actors", []):
        age = f"{now - a['heartbeat']:.1f}s" if a.get("heartbeat") else "-"
        cells = [a["group"], a["rank"], ",".join(map(str, a.get("chip_ids") or [])), a.get("host"), a.get("pid"),
                 a.get("phase"), a.get("step"), a.get("version"), a.get("rss_mb"), age, a["restarts"], a["state"]]
        rows.append(f'<tr class="actor state-{html.escape(str(a["state"]))}">'
                    + "".join(f"<td>{html.escape('-' if v is None else str(v))}</td>" for v in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("group", "rank", "chips", "host", "pid", "phase", "step", "version",
                                            "RSS MB", "heartbeat", "restarts", "state"))
    events = "".join(f"<li>{time.strftime('%H:%M:%S', time.localtime(e['time']))} step {e.get('step')}: "
                     f"<b>{html.escape(e['actor'])}</b> {html.escape(e['what'])}: {html.escape(e['why'])}</li>"
                     for e in reversed(health.get("events", [])[-30:])) or "<li>none</li>"
    status = "healthy" if healthy else "UNHEALTHY: " + "; ".join(problems)
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>rltpu {html.escape(str(health.get('run_dir', run_dir)))}</title>
<style>body{{font-family:sans-serif;margin:16px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;font-size:13px}} .state-fenced{{background:#fdd}}
.state-restarted{{background:#ffd}} section{{display:inline-block;vertical-align:top;margin:8px}}</style></head>
<body><h1>rltpu: {html.escape(str(health.get('run_dir', run_dir)))}</h1>
<p id="summary">{html.escape(str(health.get('state', '?')))} at step {health.get('step')}/{health.get('steps')},
weight version {health.get('weight_version')}, {html.escape(status)}</p>
<section><h2>Chips</h2>{chip_map(health)}</section>
<section><h2>Actors</h2><table id="actors"><tr>{head}</tr>{''.join(rows)}</table></section><br>
<section><h2>Reward</h2>{line_chart([m.get('reward_mean') or 0.0 for m in metrics], 'reward-chart')}</section>
<section><h2>Phase seconds</h2>{phase_chart(metrics)}</section>
<section><h2>Reward workers</h2>{rewards_panel(health, metrics)}</section>
<section><h2>Evaluation</h2>{eval_panel(metrics)}</section>
<section><h2>Restart events</h2><ul id="events">{events}</ul></section>
<p><a href="/metrics">/metrics</a> <a href="/health.json">/health.json</a> <a href="/trace.json">/trace.json</a>
(open in ui.perfetto.dev)</p></body></html>"""


def _label(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"')


def prometheus(run_dir: Path) -> str:
    health, metrics = _read(run_dir)
    now = time.time()
    out = ["# HELP rltpu_up 1 when the job is healthy (rltpu status exits 0)", "# TYPE rltpu_up gauge",
           f"rltpu_up {int(assess(health)[0]) if health else 0}",
           "# TYPE rltpu_step gauge", f"rltpu_step {health.get('step') or 0}",
           "# TYPE rltpu_weight_version gauge", f"rltpu_weight_version {health.get('weight_version') or 0}"]
    last = metrics[-1] if metrics else {}
    for key in ("reward_mean", "loss", "kl", "step_s", "sample_s", "train_s", "sync_s", "new_tokens_per_s",
                "compiles", "reward_errors", "reward_timeouts"):
        if isinstance(last.get(key), (int, float)):
            out += [f"# TYPE rltpu_{key} gauge", f"rltpu_{key} {last[key]}"]
    evals = [m for m in metrics if any(k in m for k in EVAL_KEYS)]
    for key in EVAL_KEYS:  # the newest evaluation
        if evals and isinstance(evals[-1].get(key), (int, float)):
            name = "rltpu_" + key.replace("/", "_").replace("@", "_at_")
            out += [f"# TYPE {name} gauge", f"{name} {evals[-1][key]}"]
    series = {"rltpu_actor_healthy": ("gauge", lambda a: int(a["state"] in ("ok", "restarted"))),
              "rltpu_actor_restarts_total": ("counter", lambda a: a["restarts"]),
              "rltpu_actor_heartbeat_age_seconds": ("gauge", lambda a: round(now - a["heartbeat"], 3)
                                                    if a.get("heartbeat") else None),
              "rltpu_actor_rss_bytes": ("gauge", lambda a: int((a.get("rss_mb") or 0) * 2**20)),
              "rltpu_actor_compiles": ("gauge", lambda a: a.get("compiles"))}
    for name, (kind, fn) in series.items():
        out.append(f"# TYPE {name} {kind}")
        for a in health.get("actors", []):
            v = fn(a)
            if v is not None:
                out.append(f'{name}{{group="{_label(a["group"])}",rank="{a["rank"]}",'
                           f'phase="{_label(a.get("phase"))}"}} {v}')
    return "\n".join(out) + "\n"


def allowed_hosts(bind_host: str) -> frozenset[str]:
    """Host header names a request may carry (without port): loopback names, the bind address, and
    with a non-loopback bind this machine's own names and addresses. Anything else is a page of
    another site (DNS rebinding) or a proxy we were not told about: 403."""
    import socket

    names = {"localhost", "127.0.0.1", "::1", bind_host}
    if bind_host not in ("127.0.0.1", "localhost", "::1"):
        names |= {socket.gethostname(), socket.getfqdn()}
        try:
            names |= set(socket.gethostbyname_ex(socket.gethostname())[2])
        except OSError:
            pass
    return frozenset(n.lower() for n in names if n)


def host_of(header: str | None) -> str:
    """``Host`` header -> name without port (``[::1]:80`` -> ``::1``)."""
    h = (header or "").strip().lower()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class _Handler(BaseHTTPRequestHandler):
    run_dir: Path
    hosts: frozenset = frozenset()

    def do_GET(self):  # noqa: N802 - http.server's name
        if host_of(self.headers.get("Host")) not in self.hosts:
            self.send_error(403, "foreign Host header (the dashboard answers only to this machine's names)")
            return
        path = self.path.split("?")[0]
        if path in ("/", "/index.html"):
            body, ctype = page(self.run_dir).encode(), "text/html; charset=utf-8"
        elif path == "/metrics":
            body, ctype = prometheus(self.run_dir).encode(), "text/plain; version=0.0.4"
        elif path in ("/health.json", "/trace.json") and (self.run_dir / path[1:]).exists():
            body, ctype = (self.run_dir / path[1:]).read_bytes(), "application/json"
        else:
            self.send_error(404, "not found: /, /metrics, /health.json, /trace.json")
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet: a refreshing page would flood stderr
        pass


def serve(run_dir, host: str = "127.0.0.1", port: int = 8266) -> ThreadingHTTPServer:
    """Start serving ``run_dir`` in a daemon thread; ``.shutdown()`` stops it, ``.thread`` is it.
    Callers pass a non-loopback ``host`` only on an explicit flag (``--allow-remote``,
    ``dashboard.allow_remote``); serving one prints a warning."""
    
    from rltpu.config import is_loopback

    handler = type("Handler", (_Handler,), {"run_dir": Path(run_dir), "hosts": allowed_hosts(host)})
    server = ThreadingHTTPServer((host, port), handler)
    if not is_loopback(host):
        log.warning(f"rltpu: warning: the dashboard listens on {host}:{server.server_address[1]}, reachable from "
                    f"other hosts; it has no authentication")
    server.daemon_threads = True
    server.thread = threading.Thread(target=server.serve_forever, name="rltpu-dashboard", daemon=True)
    server.thread.start()
    return server
