"""``commdebug-otel report PATH... -o report.html``: one self-contained HTML page to look at a run.

For where no Grafana or Jaeger is at hand (a login node, a laptop after ``scp``): the page needs
no network (CSS, script and SVG inline) and holds

* the findings of :func:`commdebug_otel.offline.diagnose.diagnose` (errors, stalls, desyncs,
  stragglers with the module that held the others back), as ``diagnose`` prints them;
* per rank, step time (mean and max of the finished ``train_step`` spans) and time waited in
  collectives (``torch.step.collective_wait_s``), as bars;
* a heat map of collectives: the module whose span issued them (``train_step`` / ``outside_step``
  outside modules) by collective op, counted over every rank;
* step timelines (the last ``--timelines`` finished steps, or ``--step N``): one band per rank,
  module spans nested by depth and coloured by pass, collectives as ticks, each with its
  details on hover; a selector switches steps.

Times on a timeline are from the earliest start of that step on any rank: ranks on different
hosts show their clocks' offset too. The page's script only switches steps and writes
``ready`` into the element ``#status`` (a headless browser's check that it ran).
"""

from __future__ import annotations

import argparse
import html
import json
import math
from collections import Counter, defaultdict
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.offline import EXIT_DONE, EXIT_NOT_THERE, EXIT_UNREADABLE, diagnose, summary, write_output

DEFAULT_TIMELINES = 5
MAX_SPANS_PER_RANK = 3000  # per step on a timeline; more are left out (and said)
_WIDTH = 1100
_ROW = 14
_PASS_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b", "recompute": "#b07aa1"}
_STEP_COLOUR = "#bab0ac"

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{padding:2px 8px;text-align:right;border-bottom:1px solid #eee}
td:first-child,th:first-child{text-align:left}pre{background:#f6f6f6;padding:8px;overflow:auto}
.bar{display:inline-block;height:10px;background:#4e79a7;vertical-align:middle}.wait{background:#e15759}
.heat td{min-width:48px;text-align:center}.heat td:first-child{text-align:left}.muted{color:#888}
.legend span{margin-right:14px}.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
"""

_SCRIPT = """
(function(){
  var select=document.getElementById('step');
  var timelines=document.querySelectorAll('svg.timeline');
  function show(){for(var i=0;i<timelines.length;i++){
    timelines[i].style.display=(timelines[i].getAttribute('data-step')===select.value)?'block':'none';}}
  if(select){select.addEventListener('change',show);show();}
  document.getElementById('status').textContent='ready: '+timelines.length+' timeline(s)';
})();
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _finished(spans: list[dict]) -> list[dict]:
    return [span for span in spans if not summary.is_snapshot(span)]


def step_times(spans: list[dict]) -> dict[int, dict[str, float]]:
    """Per rank: ``{"steps", "mean_ms", "max_ms", "wait_ms" (total), "wait_share" (of step time)}``
    from the finished ``train_step`` spans."""
    rows: dict[int, list[dict]] = defaultdict(list)
    for span in _finished(spans):
        if span["name"] == semconv.SPAN_TRAIN_STEP:
            rows[span["rank"]].append(span)
    out = {}
    for rank, steps in sorted(rows.items()):
        durations = [(span["end_ns"] - span["start_ns"]) / 1e6 for span in steps]
        wait = sum(float(span["attributes"].get(semconv.STEP_COLLECTIVE_WAIT, 0.0)) for span in steps) * 1e3
        out[rank] = {"steps": len(steps), "mean_ms": sum(durations) / len(durations), "max_ms": max(durations),
                     "wait_ms": wait, "wait_share": wait / sum(durations) if sum(durations) else 0.0}
    return out


def heat_counts(spans: list[dict]) -> dict[str, Counter]:
    """Collectives by the module that issued them (its span's FQN, else the span's name) and op, on every rank
    (stall snapshots' copies left out). ``{place: Counter({op: n})}``."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for event in summary.collective_events(_finished(spans)):
        place = event["span"]["attributes"].get(semconv.MODULE_FQN) or event["span"]["name"]
        counts[place][event["attributes"][semconv.COLLECTIVE_OP]] += 1
    return counts


def _findings(spans: list[dict]) -> str:
    found = diagnose.diagnose(spans)
    return f"<pre>{_e(diagnose.format_text(found))}</pre>"


def _times_section(spans: list[dict]) -> str:
    times = step_times(spans)
    if not times:
        return "<p class=muted>No finished train_step spans.</p>"
    top = max(row["max_ms"] for row in times.values()) or 1.0
    rows = "".join(
        f"<tr><td>rank {rank}</td><td>{row['steps']}</td><td>{row['mean_ms']:.2f}</td><td>{row['max_ms']:.2f}</td>"
        f"<td>{row['wait_ms']:.2f}</td><td>{100 * row['wait_share']:.1f} %</td><td style='text-align:left'>"
        f"<span class=bar style='width:{300 * row['mean_ms'] / top:.1f}px' title='mean step'></span><br>"
        f"<span class='bar wait' style='width:{300 * row['wait_ms'] / max(row['steps'], 1) / top:.1f}px' "
        f"title='mean wait'></span></td></tr>" for rank, row in times.items())
    return ("<table><tr><th>rank</th><th>steps</th><th>mean step ms</th><th>max step ms</th><th>wait ms (total)"
            "</th><th>wait share</th><th>mean step (blue), mean wait (red)</th></tr>" + rows + "</table>")


def _heat_section(spans: list[dict]) -> str:
    counts = heat_counts(spans)
    if not counts:
        return "<p class=muted>No collectives.</p>"
    ops = sorted({op for row in counts.values() for op in row})
    top = max(n for row in counts.values() for n in row.values())
    head = "".join(f"<th>{_e(op)}</th>" for op in ops)
    body = []
    for place in sorted(counts, key=lambda place: -sum(counts[place].values())):
        cells = []
        for op in ops:
            n = counts[place].get(op, 0)
            shade = 0.0 if not n else 0.15 + 0.85 * math.log1p(n) / math.log1p(top)
            colour = f"rgba(225,87,89,{shade:.2f})"
            cells.append(f"<td style='background:{colour}' title='{_e(place)}: {n} {_e(op)}'>{n or ''}</td>")
        body.append(f"<tr><td>{_e(place)}</td>{''.join(cells)}</tr>")
    return f"<table class=heat><tr><th>module \\ op (all ranks)</th>{head}</tr>{''.join(body)}</table>"


def _timeline(spans: list[dict], step: int) -> tuple[str, int]:
    """One step's SVG and how many spans it left out."""
    mine = [span for span in summary.step_spans(_finished(spans), step)]
    if not mine:
        return "", 0
    t0 = min(span["start_ns"] for span in mine)
    t1 = max(span["end_ns"] for span in mine)
    scale = _WIDTH / max(t1 - t0, 1)
    parts, y, left_out = [], 20, 0
    for rank in sorted({span["rank"] for span in mine}):
        ranked = [span for span in mine if span["rank"] == rank]
        left_out += max(len(ranked) - MAX_SPANS_PER_RANK, 0)
        ranked = ranked[:MAX_SPANS_PER_RANK]
        depth_of = {id(span): (int(span["attributes"].get(semconv.MODULE_DEPTH, -1)) + 1) for span in ranked}
        rows = max(depth_of.values(), default=0) + 2
        parts.append(f"<text x='0' y='{y + 10}' font-size='11'>rank {rank}</text>")
        for span in ranked:
            x = 60 + (span["start_ns"] - t0) * scale
            w = max((span["end_ns"] - span["start_ns"]) * scale, 0.5)
            top = y + depth_of[id(span)] * _ROW
            kind = span["attributes"].get(semconv.MODULE_PASS)
            colour = _PASS_COLOURS.get(kind, _STEP_COLOUR)
            ms = (span["end_ns"] - span["start_ns"]) / 1e6
            parts.append(f"<rect x='{x:.1f}' y='{top}' width='{w:.1f}' height='{_ROW - 2}' fill='{colour}'>"
                         f"<title>{_e(span['name'])}: {ms:.3f} ms</title></rect>")
            for event in span["events"]:
                attributes = event["attributes"]
                if semconv.COLLECTIVE_OP not in attributes:
                    continue
                ex = 60 + (event["time_ns"] - t0) * scale
                tick = y + (rows - 1) * _ROW
                detail = (f"{attributes[semconv.COLLECTIVE_OP]} {attributes.get(semconv.COLLECTIVE_SHAPE, '')} "
                          f"{attributes.get(semconv.COLLECTIVE_DTYPE, '')}, group "
                          f"{attributes.get(semconv.PROCESS_GROUP_NAME, '')} seq "
                          f"{attributes.get(semconv.COLLECTIVE_SEQ, '')}, in {span['name']}")
                parts.append(f"<rect x='{ex:.1f}' y='{tick}' width='2' height='{_ROW - 2}' fill='#e15759'>"
                             f"<title>{_e(detail)}</title></rect>")
        y += rows * _ROW + 10
    svg = (f"<svg class='timeline' data-step='{step}' xmlns='http://www.w3.org/2000/svg' width='{_WIDTH + 70}' "
           f"height='{y + 10}'><text x='60' y='12' font-size='11'>step {step}: {(t1 - t0) / 1e6:.2f} ms from the "
           f"earliest start on any rank</text>{''.join(parts)}</svg>")
    return svg, left_out


def _timelines_section(spans: list[dict], steps: list[int]) -> str:
    if not steps:
        return "<p class=muted>No finished traced steps.</p>"
    svgs, left_out = zip(*(_timeline(spans, step) for step in steps))
    options = "".join(f"<option value='{step}'{' selected' if step == steps[-1] else ''}>step {step}</option>"
                      for step in steps)
    legend = "".join(f"<span><i style='background:{colour}'></i>{name}</span>"
                     for name, colour in [*_PASS_COLOURS.items(), ("train_step", _STEP_COLOUR),
                                          ("collective", "#e15759")])
    note = (f"<p class=muted>{sum(left_out)} span(s) past {MAX_SPANS_PER_RANK} per rank per step left out.</p>"
            if sum(left_out) else "")
    return (f"<p><label>Step <select id='step'>{options}</select></label></p><p class=legend>{legend}</p>"
            f"{note}{''.join(svgs)}")


def render(spans: list[dict], steps: list[int] | None = None, title: str = "commdebug-otel report") -> str:
    """The page for ``spans`` (as :func:`commdebug_otel.offline.summary.load_spans` returns them).

    ``steps``: the steps with a timeline (default: the last :data:`DEFAULT_TIMELINES` finished ones).
    """
    finished_steps = summary.steps_present(_finished(spans))
    shown = finished_steps[-DEFAULT_TIMELINES:] if steps is None else [s for s in steps if s in finished_steps]
    ranks = sorted({span["rank"] for span in spans})
    meta = {"ranks": ranks, "steps": finished_steps, "spans": len(spans)}
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{_CSS}</style></head>"
        f"<body><h1>{_e(title)}</h1><p>{len(ranks)} rank(s), {len(finished_steps)} finished traced step(s), "
        f"{len(spans)} span(s). <span id='status' class=muted>script not run</span></p>"
        f"<script type='application/json' id='meta'>{_e(json.dumps(meta))}</script>"
        f"<h2>Findings (as <code>commdebug-otel diagnose</code>)</h2>{_findings(spans)}"
        f"<h2>Step time and time waited in collectives, per rank</h2>{_times_section(spans)}"
        f"<h2>Collectives by module and op</h2>{_heat_section(spans)}"
        f"<h2>Step timelines</h2>{_timelines_section(spans, shown)}"
        f"<script>{_SCRIPT}</script></body></html>")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``report``'s arguments to ``parser``."""
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="OTLP-JSON trace files, or folders to search for *.jsonl / *.json")
    parser.add_argument("-o", "--output", default="report.html", help="the HTML file to write (default report.html)")
    parser.add_argument("--step", type=int, action="append", metavar="N",
                        help="a step to draw a timeline of (repeat for more); default the last "
                             f"{DEFAULT_TIMELINES} finished steps")


def run(args: argparse.Namespace) -> int:
    """Write ``args.output``. Returns :data:`.EXIT_DONE`; :data:`.EXIT_UNREADABLE` when there is nothing to show,
    :data:`.EXIT_NOT_THERE` when the page cannot be written (said on stderr)."""
    spans = summary.load_for_command(args.paths, "report", snapshots=True)
    if spans is None:
        return EXIT_UNREADABLE
    page = render(spans, args.step)
    if write_output("report", args.output, page) != EXIT_DONE:
        return EXIT_NOT_THERE
    print(f"wrote {args.output} ({len(page) / 1024:.0f} KiB): open it in a browser; it needs no network")
    return EXIT_DONE
