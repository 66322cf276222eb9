"""The plan as Markdown (terminal, PRs) and as one self-contained HTML page (inline SVG, no network).

HTML elements tests and readers can find by id: ``label`` (emulated / sources), ``why``,
``chip-map`` (each slice's chips coloured by the winner's roles; ``chip-map-runnable`` for the
best placement ``rltpu train`` runs, when that is another one), ``memory-bars`` (per role,
stacked, against HBM), ``timeline`` (one step per candidate), ``ranked``, ``ranks`` (rank -> chip),
``route`` (weight-sync hops). A few lines of inline script only set ``data-check`` on <body>
once those elements exist, so a headless browser can tell the page rendered without errors.

Beyond ``DETAIL_MAX_CHIPS`` chips (a 6,144-chip v5p slice) a page of every chip and every rank would
be tens of MB nobody reads: the chip map draws one cell per host, ``ranks`` lists runs of ranks by
host, a ``<details>`` per slice holds one row per host, and the full rank table goes to
``plan.json`` and ``ranks.csv`` (``ranks_csv``).
"""

from __future__ import annotations

import html
import json

from rltpu.plan.candidates import MODES
from rltpu.plan.planner import Plan
from rltpu.plan.costmodel import fmt_bytes

ROLE_COLOURS = {"sampler": "#3b7dd8", "trainer": "#e8832a", "sampler+trainer": "#8e5bc6", "idle": "#c9c9c9"}
PHASE_COLOURS = {"sample": "#3b7dd8", "host": "#9a9a9a", "train": "#e8832a", "sync": "#2ba36b"}
MEM_COLOURS = ["#3b7dd8", "#e8832a", "#2ba36b", "#c94f4f", "#8e5bc6", "#b8a12a", "#4fb8c9", "#777777", "#d17fb0",
               "#1f4e8c", "#8c5a1f", "#5fd18f", "#a0a0e0", "#602060"]


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.3g}"


def engine_line(plan: Plan, c) -> str:
    """The continuous engine of a candidate's samplers: slots, KV pool, waves (one line)."""
    e = (c.phases.detail if c.phases else {}).get("engine")
    if not e:
        return ""
    return (f"Sampler engine: continuous, {e['slots']} slots per sampler, KV pool of {e['kv_pages']} pages x "
            f"{e['page_size']} tokens ({fmt_bytes(e['kv_pool_bytes_per_chip'])} per chip; it feeds {e['pool_rows']} "
            f"rows at their mean length); {c.phases.detail['rows_per_sampler_program']} rows per sampler in "
            f"{e['waves']} wave(s) of {e['concurrent_rows']}: {e['decode_steps']:,.0f} decode steps in "
            f"{e['chunks']:,} chunks, each step attending over about {e['attended_tokens']:,} history tokens per slot; "
            f"{c.phases.detail['sampler_tokens_per_s_per_chip']:,.0f} generated tokens/s per sampler chip.")


def _span(a, b) -> str:
    return str(a) if a == b else f"{a}-{b}"


def rank_runs(ranks: list[dict]) -> list[list]:
    """Consecutive ranks of one role on consecutive hosts of one slice, with as many ranks on each
    host and chips per rank, as one row: [role, ranks, slice, hosts, ranks per host, chips per rank,
    chip ids]. Two rows for a 6,144-chip placement of 2,048 samplers and 4,096 trainers."""
    rows: list[list] = []
    run: list[dict] = []

    def flush():
        if not run:
            return
        per_host: dict = {}
        for r in run:
            per_host[r["host"]] = per_host.get(r["host"], 0) + 1
        ids = [i for r in run for i in r["chips"]]
        lo, hi = min(ids), max(ids)
        chips = _span(lo, hi) if hi - lo + 1 == len(ids) else f"{len(ids)} in {lo}-{hi}"
        rows.append([run[0]["role"], _span(run[0]["rank"], run[-1]["rank"]), run[0]["slice"],
                     _span(run[0]["host"], run[-1]["host"]), _span(min(per_host.values()), max(per_host.values())),
                     len(run[0]["chips"]), chips])
        run.clear()

    for r in ranks:
        if run:
            last = run[-1]
            same = (r["role"], r["slice"], len(r["chips"])) == (last["role"], last["slice"], len(last["chips"]))
            if not (same and r["rank"] == last["rank"] + 1 and 0 <= r["host"] - last["host"] <= 1):
                flush()
        run.append(r)
    flush()
    return rows


def ranks_csv(plan: Plan) -> str:
    """Every rank of the chip map's candidate, one line each: role,rank,slice,host,chips,coords
    (chips space-separated, coords as x:y:z)."""
    win = plan.winner or plan.as_configured
    lines = [f"# {win.name}", "role,rank,slice,host,chips,coords"]
    lines += [f"{r['role']},{r['rank']},{r['slice']},{r['host']},{' '.join(map(str, r['chips']))},"
              f"{' '.join(':'.join(map(str, c)) for c in r['coords'])}" for r in win.ranks]
    return "\n".join(lines) + "\n"


def _note(c) -> str:
    """The note column: each verdict with its own label, so a memory miss is never read as a
    backend limit or the other way round."""
    return "; ".join(x for x in [
        "as configured" if c.as_configured else "",
        f"cannot run here: {c.not_runnable}" if c.not_runnable else "",
        f"does not fit: {c.reason}" if not c.feasible and c.reason else "",
        f"on real chips: {c.backend_refusal}" if c.backend_refusal and not c.real_chips else "",
        *c.warnings] if x)


def _rows(plan: Plan, top: int):
    feas = [c for c in plan.candidates if c.feasible][:top]
    bad = [c for c in plan.candidates if not c.feasible][: max(4, top // 2)]
    shown = feas + bad
    extra = [plan.as_configured] + [plan.best(mode) for mode in MODES]
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
           "| # | candidate | runs here | fits in memory | tokens/s/chip | step | sample | train | sync | host "
           "| peak mem / chip | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(_rows(plan, top), 1):
        p = c.phases
        peak = max(c.peak_bytes().values()) if c.memory else 0
        cells = ([_fmt_rate(p.tokens_per_s_per_chip), _fmt_s(p.step), _fmt_s(p.sample), _fmt_s(p.train),
                  _fmt_s(p.sync), _fmt_s(p.host)] if p else ["-"] * 6)
        note = _note(c)
        out.append(f"| {i} | {c.name} | {'yes' if c.runnable else 'no'} | {'yes' if c.feasible else '**no**'} | "
                   + " | ".join(cells) + f" | {fmt_bytes(peak)} / {fmt_bytes(c.capacity)} | {note} |")
    if win:
        out += ["", f"## Winner: {win.name}", "",
                f"Predicted {_fmt_rate(win.phases.tokens_per_s_per_chip)} tokens/s/chip ({plan.workload.tokens:,.0f} "
                f"training tokens per step over {plan.table.num_chips} chips in {_fmt_s(win.phases.step)}). "
                f"Compile (one-off, rough): {_fmt_s(win.phases.compile)}. Activation checkpointing: "
                f"{'on' if win.checkpointing else 'off'}.", *(["", engine_line(plan, win)] if engine_line(plan, win) else []),
                "", "Memory per chip:", ""]
        for role, items in win.memory.items():
            out.append(f"- **{role}**: {fmt_bytes(sum(items.values()))} of {fmt_bytes(win.capacity)}: "
                       + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in items.items()))
        out += ["", "Weight-sync route:", "", "| hop | link | from | to | bytes | time |", "|---|---|---|---|---|---|"]
        out += [f"| {h.what} | {h.link} | {h.src} | {h.dst} | {fmt_bytes(h.bytes)} | {_fmt_s(h.seconds)} |"
                for h in win.route]
        if plan.detailed_report:
            out += ["", "Rank -> chip:", "", "| role | rank | slice | host | chips |", "|---|---|---|---|---|"]
            out += [f"| {r['role']} | {r['rank']} | {r['slice']} | {r['host']} | {r['chips']} |" for r in win.ranks]
        else:
            out += ["", f"Rank -> chip, by runs of hosts ({len(win.ranks)} ranks; every rank in plan.json and "
                        f"ranks.csv with --out):", "",
                    "| role | ranks | slice | hosts | ranks per host | chips per rank | chips |",
                    "|---|---|---|---|---|---|---|"]
            out += ["| " + " | ".join(map(str, r)) + " |" for r in rank_runs(win.ranks)]
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


def _by_host(win) -> dict:
    """(slice, host) -> {role: [chips, ranks]} from a candidate's rank table."""
    out: dict = {}
    for r in win.ranks:
        ent = out.setdefault((r["slice"], r["host"]), {}).setdefault(r["role"], [0, []])
        ent[0] += len(r["chips"])
        ent[1].append(r["rank"])
    return out


def _host_text(roles: dict, n: int) -> str:
    parts = [f"{role} rank{'s' if len(rk) > 1 else ''} {_span(min(rk), max(rk))}"
             if max(rk) - min(rk) + 1 == len(rk) else f"{role} {len(rk)} ranks" for role, (_, rk) in roles.items()]
    idle = n - sum(k for k, _ in roles.values())
    return "; ".join(parts + ([f"{idle} idle"] if idle else [])) or "idle"


def _host_map(plan: Plan, win, svg_id: str = "chip-map") -> str:
    """One cell per host (the host's block of the slice), coloured by the roles of its chips, planes
    of a 3-D slice side by side and wrapped; hover for the ranks. ``data-n``: the host's chips."""
    t = plan.table
    dims = [int(d) for d in t.topology.split("x")]
    hosts = t.hosts()
    first = t.chips_on(*hosts[0])
    nd = len(dims)
    block = [max(c.coords[d] for c in first) - min(c.coords[d] for c in first) + 1 for d in range(nd)]
    nb = [d // b for d, b in zip(dims, block)]
    gx, gy, planes = nb[0], nb[1] if nd > 1 else 1, nb[2] if nd > 2 else 1
    cell = 12
    plane_w, plane_h = gx * cell + 10, gy * cell + 10
    per_row = max(1, min(planes, 1150 // plane_w))
    slice_h = -(-planes // per_row) * plane_h + 22
    summary = _by_host(win)
    parts = []
    for si in range(t.num_slices):
        parts.append(f'<text x="10" y="{si * slice_h + 14}" font-size="12">slice {si}: '
                     f'{len(hosts) // t.num_slices} hosts of {t.chips_per_host} chips, one square per host'
                     f'{f", {planes} planes along the last dim" if planes > 1 else ""}</text>')
    for key in hosts:
        chips = t.chips_on(*key)
        o = chips[0].coords  # index 0 is the host block's origin
        z = o[2] // block[2] if nd > 2 else 0
        x = 10 + (z % per_row) * plane_w + (o[0] // block[0]) * cell
        y = key[0] * slice_h + 22 + (z // per_row) * plane_h + ((o[1] // block[1]) * cell if nd > 1 else 0)
        roles = summary.get(key, {})
        title = f"<title>slice {key[0]} host {key[1]}: {_host_text(roles, len(chips))}</title>"
        counts = {role: roles[role][0] for role in ROLE_COLOURS if role in roles}
        idle = len(chips) - sum(counts.values())
        if idle:
            counts["idle"] = idle
        if len(counts) == 1:
            role = next(iter(counts))
            parts.append(f'<rect class="host" data-n="{len(chips)}" data-role="{role}" x="{x}" y="{y}" '
                         f'width="{cell - 2}" height="{cell - 2}" fill="{ROLE_COLOURS[role]}">{title}</rect>')
            continue
        stripes, sx = [], float(x)
        for role, k in counts.items():
            wpx = (cell - 2) * k / len(chips)
            stripes.append(f'<rect x="{sx:.1f}" y="{y}" width="{wpx:.1f}" height="{cell - 2}" '
                           f'fill="{ROLE_COLOURS[role]}"/>')
            sx += wpx
        parts.append(f'<g class="host" data-n="{len(chips)}" data-role="mixed">{title}{"".join(stripes)}</g>')
    height = t.num_slices * slice_h + 20
    lx = 10
    for role, col in ROLE_COLOURS.items():
        parts.append(f'<rect x="{lx}" y="{height - 15}" width="10" height="10" fill="{col}"/>'
                     f'<text x="{lx + 14}" y="{height - 6}" font-size="11">{role}</text>')
        lx += 110
    width = max(10 + per_row * plane_w, lx + 20)
    return (f'<svg id="{svg_id}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'role="img" aria-label="chip map, one cell per host">{"".join(parts)}</svg>')


def _host_details(plan: Plan, win) -> str:
    """A closed ``<details>`` per slice: one row per host (its chips and ranks), read on demand."""
    t = plan.table
    summary = _by_host(win)
    out = []
    for si in range(t.num_slices):
        keys = [k for k in t.hosts() if k[0] == si]
        rows, tally = [], {}
        for key in keys:
            chips = t.chips_on(*key)
            roles = summary.get(key, {})
            for role, (k, _) in roles.items():
                tally[role] = tally.get(role, 0) + k
            rows.append(f"<tr><td>{key[1]}</td><td>{_span(chips[0].global_id, chips[-1].global_id)}</td>"
                        f"<td>{html.escape(_host_text(roles, len(chips)))}</td></tr>")
        what = ", ".join(f"{k} {role}" for role, k in tally.items()) or "idle"
        out.append(f'<details class="slice-hosts" data-slice="{si}"><summary>slice {si} '
                   f'({html.escape(t.slice_name(si))}): {len(keys)} hosts; chips: {what}</summary>'
                   f'<table><thead><tr><th>host</th><th>chips</th><th>ranks</th></tr></thead>'
                   f'<tbody>{"".join(rows)}</tbody></table></details>')
    return "".join(out)


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
        if c.placement_mode.written()["staleness"]:  # sampling (next step) on its own lane, under train + host
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
  document.querySelectorAll("#chip-map .host").forEach(function (h) { chips += Number(h.getAttribute("data-n")); });
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
                       *([_fmt_rate(p.tokens_per_s_per_chip), _fmt_s(p.step), _fmt_s(p.sample), _fmt_s(p.train),
                          _fmt_s(p.sync)] if p else ["-"] * 5),
                       f"{fmt_bytes(peak)} / {fmt_bytes(c.capacity)}",
                       _note(c)])
    chip_map = _chip_map if plan.detailed_report else _host_map
    if plan.detailed_report:
        ranks = _table("ranks", ["role", "rank", "slice", "host", "chips"],
                       [[r["role"], r["rank"], r["slice"], r["host"], r["chips"]] for r in win.ranks])
    else:
        ranks = (f"<p>{len(win.ranks)} ranks on {plan.table.num_chips} chips, by runs of hosts; every rank is in "
                 f"plan.json and ranks.csv, every host in the per-slice lists below.</p>"
                 + _table("ranks", ["role", "ranks", "slice", "hosts", "ranks per host", "chips per rank", "chips"],
                          rank_runs(win.ranks))
                 + _host_details(plan, win))
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
        f"<h2>Chip map ({html.escape(win.name)})</h2>", chip_map(plan, win),
        *([f"<h3>Best placement rltpu train can run ({html.escape(plan.best_runnable.name)})</h3>",
           chip_map(plan, plan.best_runnable, "chip-map-runnable")]
          if plan.best_runnable is not None and plan.best_runnable is not win else []),
        "<h2>Memory per chip</h2>", _memory_bars(plan),
        "<h2>One step per candidate</h2>", _timeline(plan),
        "<h2>Ranked candidates</h2>",
        _table("ranked", ["#", "candidate", "runs here", "fits in memory", "tokens/s/chip", "step", "sample", "train",
                          "sync",
                          "peak mem / chip", "note"], ranked),
        "<h2>Rank &rarr; chip</h2>", ranks,
        "<h2>Weight-sync route</h2>", _table("route", ["hop", "link", "from", "to", "bytes", "time"], route),
        "<h2>Hardware figures</h2>",
        _table("sources", ["figure", "source", "unconfirmed"],
               [[k, v, "yes" if k in plan.hw.unconfirmed else ""] for k, v in plan.hw.sources.items()]),
        f'<script type="application/json" id="plan-json">'
        f'{html.escape(json.dumps(plan.to_json(plan.detailed_report), default=str))}</script>',
    ]
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>rltpu plan</title><style>{style}</style>'
            f'</head><body>{"".join(body)}{_CHECK}</body></html>\n')
