"""The plan as Markdown (terminal, PRs) and as one self-contained HTML page (inline SVG, no network).

HTML elements tests and readers can find by id: ``label`` (emulated / sources), ``why``,
``chip-map`` (each slice's chips coloured by the winner's roles; ``chip-map-runnable`` for the
best placement ``rltpu train`` runs, when that is another one), ``memory-bars`` (per role,
stacked, against HBM), ``timeline`` (one step per candidate), ``ranked``, ``ranks`` (rank -> chip),
``route`` (weight-sync hops). A few lines of inline script only set ``data-check`` on <body>
once those elements exist, so a headless browser can tell the page rendered without errors.
"""

from __future__ import annotations

import html
import json

from rltpu.plan.planner import Plan
from rltpu.plan.costmodel import fmt_bytes

ROLE_COLOURS = {"sampler": "#3b7dd8", "trainer": "#e8832a", "sampler+trainer": "#8e5bc6", "idle": "#c9c9c9"}
PHASE_COLOURS = {"sample": "#3b7dd8", "host": "#9a9a9a", "train": "#e8832a", "sync": "#2ba36b"}
MEM_COLOURS = ["#3b7dd8", "#e8832a", "#2ba36b", "#c94f4f", "#8e5bc6", "#b8a12a", "#4fb8c9", "#777777", "#d17fb0",
               "#1f4e8c", "#8c5a1f", "#5fd18f", "#a0a0e0", "#602060"]


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _rows(plan: Plan, top: int):
    feas = [c for c in plan.candidates if c.feasible][:top]
    bad = [c for c in plan.candidates if not c.feasible][: max(4, top // 2)]
    shown = feas + bad
    extra = [plan.as_configured] + [plan.best(mode) for mode in ("disaggregated", "async", "colocated")]
    for c in extra:  # always show the config's own placement and the best of each mode
        if c is not None and c not in shown:
            shown.append(c)
    return shown


def markdown(plan: Plan, top: int = 12) -> str:
    w, m, win = plan.workload, plan.model, plan.winner
    out = [f"# rltpu plan: {plan.cfg.name} on {plan.table.describe()} ({plan.hw.name})", "",
           f"> {plan.label()}", "",
           f"Model: {m.params / 1e6:.2f}M params ({m.layers} layers, hidden {m.hidden}, {m.dtype}). "
           f"Workload: {w.prompts} prompts x {w.group} samples = {w.rows} rows of {w.prompt_len} + {w.new_tokens} "
           f"tokens, {w.ppo_epochs} epoch(s), precision {w.precision}"
           f"{', reference model' if w.reference else ''}{', critic' if w.critic else ''}"
           f"{f', reward model {w.reward_params / 1e9:.2f}B' if w.reward_params else ''}.", "",
           "## Why", "", plan.why(), "",
           "## Ranked candidates", "",
           "| # | candidate | runs in `rltpu train` | fits | step | sample | train | sync | host | peak mem / chip | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(_rows(plan, top), 1):
        p = c.phases
        peak = max(c.peak_bytes().values()) if c.memory else 0
        cells = ([_fmt_s(p.step), _fmt_s(p.sample), _fmt_s(p.train), _fmt_s(p.sync), _fmt_s(p.host)]
                 if p else ["-"] * 5)
        note = "; ".join(x for x in ["as configured" if c.as_configured else "", c.not_runnable, c.reason,
                                             *c.warnings] if x)
        out.append(f"| {i} | {c.name} | {'yes' if c.runnable else 'no'} | {'yes' if c.feasible else '**no**'} | "
                   + " | ".join(cells) + f" | {fmt_bytes(peak)} / {fmt_bytes(c.capacity)} | {note} |")
    if win:
        out += ["", f"## Winner: {win.name}", "",
                f"Compile (one-off, rough): {_fmt_s(win.phases.compile)}. Activation checkpointing: "
                f"{'on' if win.checkpointing else 'off'}.", "", "Memory per chip:", ""]
        for role, items in win.memory.items():
            out.append(f"- **{role}**: {fmt_bytes(sum(items.values()))} of {fmt_bytes(win.capacity)}: "
                       + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in items.items()))
        out += ["", "Weight-sync route:", "", "| hop | link | from | to | bytes | time |", "|---|---|---|---|---|---|"]
        out += [f"| {h.what} | {h.link} | {h.src} | {h.dst} | {fmt_bytes(h.bytes)} | {_fmt_s(h.seconds)} |"
                for h in win.route]
        out += ["", "Rank -> chip:", "", "| role | rank | slice | host | chips |", "|---|---|---|---|---|"]
        out += [f"| {r['role']} | {r['rank']} | {r['slice']} | {r['host']} | {r['chips']} |" for r in win.ranks]
        if win.warnings:
            out += ["", "Mesh warnings:", ""] + [f"- {x}" for x in win.warnings]
    out += ["", "## Hardware figures", ""]
    out += [f"- {k}: {v}{' (unconfirmed)' if k in plan.hw.unconfirmed else ''}" for k, v in plan.hw.sources.items()]
    return "\n".join(out) + "\n"


# -- SVG pieces -----------------------------------------------------------------------------------

def _chip_map(plan: Plan, win=None, svg_id: str = "chip-map") -> str:
    win = win or plan.winner or plan.as_configured
    role_of = {}
    for r in win.ranks:
        for cid in r["chips"]:
            role_of[cid] = r["role"]
    cell, gap = 34, 4
    chips = plan.table.chips
    dims = [int(d) for d in plan.table.topology.split("x")]
    d0, d1 = dims[0], dims[1]
    planes = dims[2] if len(dims) == 3 else 1
    slice_w = planes * (d0 * cell + 12)
    parts, x0 = [], 10
    height = d1 * cell + 40
    for s in range(plan.table.num_slices):
        parts.append(f'<text x="{x0}" y="14" font-size="12">slice {s}</text>')
        for ch in [c for c in chips if c.slice == s]:
            z = ch.coords[2] if len(ch.coords) == 3 else 0
            x = x0 + z * (d0 * cell + 12) + ch.coords[0] * cell
            y = 22 + ch.coords[1] * cell
            role = role_of.get(ch.global_id, "idle")
            parts.append(f'<rect class="chip" data-role="{role}" x="{x}" y="{y}" width="{cell - gap}" '
                         f'height="{cell - gap}" fill="{ROLE_COLOURS[role]}"><title>chip {ch.global_id} '
                         f'host {ch.host} idx {ch.index} {role}</title></rect>'
                         f'<text x="{x + 3}" y="{y + 19}" font-size="10" fill="#fff">{ch.global_id}</text>')
        x0 += slice_w + 24
    legend_y = height - 6
    lx = 10
    for role, col in ROLE_COLOURS.items():
        parts.append(f'<rect x="{lx}" y="{legend_y - 9}" width="10" height="10" fill="{col}"/>'
                     f'<text x="{lx + 14}" y="{legend_y}" font-size="11">{role}</text>')
        lx += 110
    width = max(x0, lx + 20)
    return (f'<svg id="{svg_id}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'role="img" aria-label="chip map">{"".join(parts)}</svg>')


def _memory_bars(plan: Plan) -> str:
    win = plan.winner or plan.as_configured
    cap = win.capacity
    roles = list(win.memory.items())
    bar_w, left, height = 560, 130, 34 * len(roles) + 50
    scale = bar_w / max(cap, max(sum(v.values()) for _, v in roles))
    parts, y = [], 16
    keys = sorted({k for _, items in roles for k in items})
    colour = {k: MEM_COLOURS[i % len(MEM_COLOURS)] for i, k in enumerate(keys)}
    for role, items in roles:
        x = left
        parts.append(f'<text x="4" y="{y + 15}" font-size="12">{html.escape(role)}</text>')
        for k, v in items.items():
            wpx = max(v * scale, 0.0)
            parts.append(f'<rect class="mem" x="{x:.1f}" y="{y}" width="{wpx:.1f}" height="22" fill="{colour[k]}">'
                         f'<title>{html.escape(k)}: {fmt_bytes(v)}</title></rect>')
            x += wpx
        parts.append(f'<text x="{x + 4:.1f}" y="{y + 15}" font-size="11">{fmt_bytes(sum(items.values()))}</text>')
        y += 34
    cx = left + cap * scale
    parts.append(f'<line id="hbm-line" x1="{cx:.1f}" y1="8" x2="{cx:.1f}" y2="{y}" stroke="#c00" stroke-dasharray="4"/>'
                 f'<text x="{cx - 60:.1f}" y="{y + 12}" font-size="11" fill="#c00">capacity {fmt_bytes(cap)}</text>')
    legend = "".join(f'<span style="color:{colour[k]}">&#9632;</span> {html.escape(k)} &nbsp;' for k in keys)
    return (f'<svg id="memory-bars" xmlns="http://www.w3.org/2000/svg" width="{left + bar_w + 120}" '
            f'height="{height}">{"".join(parts)}</svg><div class="legend">{legend}</div>')


def _timeline(plan: Plan, top: int = 8) -> str:
    cands = [c for c in plan.candidates if c.feasible][:top]
    if plan.as_configured not in cands and plan.as_configured.phases:
        cands.append(plan.as_configured)
    if not cands:
        return '<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="600" height="30"><text x="4" y="20">no candidate fits</text></svg>'
    longest = max(max(c.phases.step, c.phases.sample + c.phases.host + c.phases.train + c.phases.sync) for c in cands)
    left, bar_w, row_h = 330, 560, 30
    scale = bar_w / longest
    parts, y = [], 10
    for c in cands:
        p = c.phases
        parts.append(f'<text x="4" y="{y + 14}" font-size="11">{html.escape(c.name[:52])}</text>')
        if c.mode == "async":  # sampling (next step) on its own lane, under train + host
            lanes = [[("host", p.host), ("train", p.train), ("sync", p.sync)], [("sample", p.sample)]]
        else:
            lanes = [[("sample", p.sample), ("host", p.host), ("train", p.train), ("sync", p.sync)]]
        for li, lane in enumerate(lanes):
            x = left
            h = 18 if len(lanes) == 1 else 9
            for name, secs in lane:
                wpx = secs * scale
                parts.append(f'<rect class="phase" data-phase="{name}" x="{x:.1f}" y="{y + li * 9}" width="{wpx:.1f}" '
                             f'height="{h}" fill="{PHASE_COLOURS[name]}"><title>{name}: {_fmt_s(secs)}</title></rect>')
                x += wpx
        parts.append(f'<text x="{left + p.step * scale + 4:.1f}" y="{y + 14}" font-size="11">{_fmt_s(p.step)}</text>')
        y += row_h
    legend = "".join(f'<rect x="{left + i * 90}" y="{y + 2}" width="10" height="10" fill="{col}"/>'
                     f'<text x="{left + i * 90 + 14}" y="{y + 11}" font-size="11">{n}</text>'
                     for i, (n, col) in enumerate(PHASE_COLOURS.items()))
    return (f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{left + bar_w + 80}" height="{y + 20}">'
            f'{"".join(parts)}{legend}</svg>')


def _table(tid: str, head: list[str], rows: list[list]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f'<table id="{tid}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


_CHECK = """<script>
(function () {
  var ids = ["label", "why", "chip-map", "memory-bars", "timeline", "ranked", "ranks", "route"];
  var missing = ids.filter(function (i) { return !document.getElementById(i); });
  var chips = document.querySelectorAll("#chip-map rect.chip").length;
  var phases = document.querySelectorAll("#timeline rect.phase").length;
  document.body.setAttribute("data-check", missing.length ? "missing:" + missing.join(",") : "ok");
  document.body.setAttribute("data-chips", String(chips));
  document.body.setAttribute("data-phases", String(phases));
})();
</script>"""


def html_page(plan: Plan, top: int = 12) -> str:
    win = plan.winner or plan.as_configured
    ranked = []
    for i, c in enumerate(_rows(plan, top), 1):
        p = c.phases
        peak = max(c.peak_bytes().values()) if c.memory else 0
        ranked.append([i, c.name, "yes" if c.runnable else "no", "yes" if c.feasible else "NO",
                       *( [_fmt_s(p.step), _fmt_s(p.sample), _fmt_s(p.train), _fmt_s(p.sync)] if p else ["-"] * 4),
                       f"{fmt_bytes(peak)} / {fmt_bytes(c.capacity)}",
                       "; ".join(x for x in ["as configured" if c.as_configured else "", c.not_runnable, c.reason,
                                             *c.warnings] if x)])
    ranks = [[r["role"], r["rank"], r["slice"], r["host"], r["chips"]] for r in win.ranks]
    route = [[h.what, h.link, h.src, h.dst, fmt_bytes(h.bytes), _fmt_s(h.seconds)] for h in win.route]
    w, m = plan.workload, plan.model
    style = ("body{font:14px system-ui,sans-serif;margin:24px;max-width:1200px;color:#222}"
             "table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 6px;font-size:12px}"
             "#label{background:#fff3cd;border:1px solid #e0c36a;padding:8px}.legend{font-size:12px}"
             "h2{margin-top:28px}")
    body = [
        f"<h1>rltpu plan: {html.escape(plan.cfg.name)} on {html.escape(plan.table.describe())} ({plan.hw.name})</h1>",
        f'<p id="label">{html.escape(plan.label())}</p>',
        f"<p>Model {m.params / 1e6:.2f}M params, {m.layers} layers, hidden {m.hidden}, {m.dtype}; "
        f"{w.prompts} prompts x {w.group} = {w.rows} rows of {w.prompt_len}+{w.new_tokens} tokens.</p>",
        f'<h2>Why</h2><p id="why">{html.escape(plan.why())}</p>',
        f"<h2>Chip map ({html.escape(win.name)})</h2>", _chip_map(plan),
        *([f"<h3>Best placement rltpu train can run ({html.escape(plan.best_runnable.name)})</h3>",
           _chip_map(plan, plan.best_runnable, "chip-map-runnable")]
          if plan.best_runnable is not None and plan.best_runnable is not win else []),
        "<h2>Memory per chip</h2>", _memory_bars(plan),
        "<h2>One step per candidate</h2>", _timeline(plan),
        "<h2>Ranked candidates</h2>",
        _table("ranked", ["#", "candidate", "runs in rltpu train", "fits", "step", "sample", "train", "sync",
                          "peak mem / chip", "note"], ranked),
        "<h2>Rank &rarr; chip</h2>", _table("ranks", ["role", "rank", "slice", "host", "chips"], ranks),
        "<h2>Weight-sync route</h2>", _table("route", ["hop", "link", "from", "to", "bytes", "time"], route),
        "<h2>Hardware figures</h2>",
        _table("sources", ["figure", "source", "unconfirmed"],
               [[k, v, "yes" if k in plan.hw.unconfirmed else ""] for k, v in plan.hw.sources.items()]),
        f'<script type="application/json" id="plan-json">{html.escape(json.dumps(plan.to_json(), default=str))}</script>',
    ]
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>rltpu plan</title><style>{style}</style>'
            f'</head><body>{"".join(body)}{_CHECK}</body></html>\n')
