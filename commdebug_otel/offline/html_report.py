"""``commdebug-otel report PATH... -o report.html``: one self-contained HTML page to look at a run.

For where no Grafana or Jaeger is at hand (a login node, a laptop after ``scp``): the page needs
no network (CSS, script and SVG inline) and holds, top to bottom,

* **the answer** (``#answer``), one line: the live hang verdict's sentence (the ``stall_verdict`` span's
  ``commdebug.verdict.summary``), else what :func:`commdebug_otel.offline.diagnose.diagnose` found, most
  important first (an error, a stall, an unfinished step, a desync, the straggler that cost most), else
  ``healthy: no straggler above the noise``; further answers below it;
* the findings of ``diagnose`` as tables (errors, stalls with their stacks folded, unfinished steps,
  desyncs, stragglers, pipeline waits), and ``diagnose``'s text folded at the end;
* per rank, step time (mean and max of the finished ``train_step`` spans) and time waited in
  collectives (``torch.step.collective_wait_s``), as bars;
* step timelines (the last :data:`DEFAULT_TIMELINES` finished steps, or ``--step N``): a time axis in ms, one band
  per rank, module spans nested by depth, coloured by pass and named where they are wide enough,
  collectives as ticks, each with its details on hover; a selector switches steps. A step's
  ``train_step_tail`` (its work after ``optimizer.step()``, up to the next step's first module) is not
  drawn: it lasts to the process's exit after the last step; its length and collectives are said below;
* collectives by the module whose span issued them (``train_step``, ``train_step_tail``,
  ``outside_step`` outside modules) and op, over every rank: bytes and counts, modules ranked by bytes.

Times on a timeline are from the earliest start of that step on any rank: ranks on different
hosts show their clocks' offset too. The page's script only switches steps and writes
``ready`` into the element ``#status`` (a headless browser's check that it ran).

Usage::

    from commdebug_otel.offline import html_report, summary

    spans = summary.load_spans(["commdebug-otel-out/run-20261201-062712-66fd1e02"])
    open("report.html", "w").write(html_report.render(spans))

What it does not do: it draws no step it cannot find finished in the files, and it answers only what ``diagnose``
answers: ``_answer``, ``_straggler_rows`` and ``_straggler_answer`` are the only readers of its result's
stalls and stragglers.
"""

from __future__ import annotations

import argparse
import html
import json
import math
from collections import defaultdict
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.core.fact import ranges_text, stall_step_text
from commdebug_otel.offline import (
    EXIT_DONE,
    EXIT_NOT_THERE,
    EXIT_UNREADABLE,
    diagnose,
    stragglers,
    summary,
    write_output,
)
from commdebug_otel.offline.load import load_for_command
from commdebug_otel.offline.model import index_of, reusing

DEFAULT_TIMELINES = 5
MAX_SPANS_PER_RANK = 3000  # per step on a timeline; more are left out (and said)
#: Straggler rows in the findings table (the rest summed in one line), as ``diagnose --top``'s default.
TOP_STRAGGLERS = 10
_WIDTH = 1080  # the timeline's plot area, px
_LEFT = 64  # room for the rank labels
_AXIS = 28  # the time axis' height above the bands
_ROW = 15
_PASS_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b", "recompute": "#b07aa1"}
_STEP_COLOUR = "#bab0ac"
_TICK_COLOUR = "#e15759"

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px;margin-bottom:6px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:14px 0 4px}
table{border-collapse:collapse;margin:4px 0}td,th{padding:2px 8px;text-align:right;border-bottom:1px solid #eee;
vertical-align:top}td:first-child,th:first-child{text-align:left}td.text,th.text{text-align:left}
pre.wrap{background:#f6f6f6;padding:8px;white-space:pre-wrap;overflow-wrap:anywhere;margin:4px 0}
body *{overflow-wrap:anywhere}
#answer{font-size:17px;padding:10px 14px;border-left:6px solid #59a14f;background:#f1f8ee;margin:10px 0}
#answer.bad{border-color:#e15759;background:#fdf0f0}#answer.slow{border-color:#f28e2b;background:#fef6ec}
ul.answers{margin:4px 0 0 0}
.bar{display:inline-block;height:10px;background:#4e79a7;vertical-align:middle}.wait{background:#e15759}
.heat td{min-width:64px}.muted{color:#777}
.legend span{margin-right:14px}.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
details{margin:4px 0}summary{cursor:pointer;color:#444}
"""

_SCRIPT = """
(function(){
  var select=document.getElementById('step');
  var timelines=document.querySelectorAll('.timeline');
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


def _table(header: list[str], rows: list[list[Any]], text_columns: frozenset[int] = frozenset()) -> str:
    """A table of escaped cells; ``text_columns``: left-aligned, wrapping columns (by index)."""
    def cell(tag: str, i: int, value: Any) -> str:
        return f"<{tag} class=text>{_e(value)}</{tag}>" if i in text_columns else f"<{tag}>{_e(value)}</{tag}>"
    head = "".join(cell("th", i, value) for i, value in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", i, value) for i, value in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


# ------------------------------------------------------------------ the answer
# What the page says about stragglers comes from diagnose's JSON (diagnose.diagnose) through _straggler_rows and
# _straggler_answer only, about hangs from its stalls and the live verdict spans through _answer and _live_verdicts.


def _where(module: str, pass_: str) -> str:
    return f"{module or diagnose.TRAIN_STEP} {pass_}".rstrip()


def _straggler_rows(diagnosis: dict[str, Any]) -> tuple[list[str], list[list[Any]], str]:
    """diagnose's straggler rows (the significant ones only) as a table: ``(header, rows, what the columns mean)``,
    the costliest first; no rows on a healthy job."""
    header = ["rank", "where (module, pass)", "late in", "late by (ms)", "noise cut (ms)", "p", "lost s"]
    rows = [[row["rank"], _where(row["module"], row["pass"]), f"{row['steps_late']} of {row['steps_seen']} steps",
             f"{row['late_min_s'] * 1e3:.1f}-{row['late_max_s'] * 1e3:.1f}", f"{row['noise_cut_s'] * 1e3:.1f}",
             f"{row['p_value']:.0e}", f"{row['lost_s']:.3f}"]
            for row in diagnosis["stragglers"]]
    tested = diagnosis["stragglers"][0]["tested"] if diagnosis["stragglers"] else 0
    legend = ("late in k of n steps: the steps where the others waited for this place longer than the noise cut "
              "(the median and 3 MADs of every other place's waits); p: the chance of so many late steps if it were "
              f"noise (binomial, Bonferroni over {tested} places); lost = the others' wait it caused, over all steps")
    return header, rows, legend


def _straggler_answer(diagnosis: dict[str, Any]) -> str | None:
    """The straggler sentence of the page's answer (the costliest significant row), or None when there is none."""
    rows = diagnosis["stragglers"]
    if not rows:
        return None
    more = f" ({len(rows) - 1} more under Findings)" if len(rows) > 1 else ""
    return f"straggler: {stragglers.row_text(rows[0])}{more}"


def _live_verdicts(spans: list[dict]) -> list[tuple[str, str, int | None]]:
    """The live cross-rank stall verdicts (``stall_verdict`` spans): ``(kind, summary, step)``, the latest first,
    each said once."""
    found = sorted((span for span in spans if span["name"] == semconv.SPAN_STALL_VERDICT),
                   key=lambda span: -span["end_ns"])
    out: list[tuple[str, str, int | None]] = []
    for span in found:
        attributes = span["attributes"]
        step = attributes.get(semconv.STEP)
        said = (str(attributes.get(semconv.VERDICT_KIND, semconv.VERDICT_KIND_HANG)),
                str(attributes.get(semconv.VERDICT_SUMMARY, "")), step if isinstance(step, int) else None)
        if said[1] and said not in out:
            out.append(said)
    return out


def _stall_sentence(stall: dict) -> str:
    """``rank 1 is stuck in step 4 at M forward for 42.0 s`` (``was`` once it ended), from a snapshot's stall."""
    place = stall_step_text(stall["between_steps"], stall["step"])
    if not stall["between_steps"]:
        place += f" at {_where(stall['module'], stall['pass'])}"
    return f"rank {stall['rank']} {'was' if stall['ended'] else 'is'} stuck {place} for {stall['age_s']:.1f} s"


def _answer(diagnosis: dict[str, Any], verdicts: list[tuple[str, str, int | None]]) -> list[tuple[str, str]]:
    """The page's answers, the headline first: ``[(tone, sentence)]``, tone ``bad`` (a hang, an error, a desync),
    ``slow`` (a straggler, a stall that ended) or ``ok``.

    In order: live verdicts and stalls still on, errors, unfinished steps, desyncs, the costliest straggler, then
    stalls that ended and their verdicts (a verdict ended with the stalls of its step); else healthy.
    ``diagnosis``: :func:`.diagnose.diagnose`'s result; ``verdicts``: :func:`_live_verdicts`. Never empty.
    """
    out: list[tuple[str, str]] = []
    ended: list[tuple[str, str]] = []
    stalls = diagnosis["stalls"]
    for kind, sentence, step in verdicts:
        mine = [stall for stall in stalls if stall["step"] == step]
        if mine and all(stall["ended"] for stall in mine):
            ended.append(("slow", f"{kind} (ended): {sentence}"))
        else:
            out.append(("bad", f"{kind}: {sentence}"))
    for stall in stalls:
        kind = (stall.get("verdict") or {}).get("kind", "hang")  # the hang rule's kind (hang, desync, missing)
        if not stall["snapshot"]:
            out.append(("bad", f"{kind}: rank {stall['rank']} is stuck: it {stall['reason']}"))
            continue
        if stall["ended"]:
            ended.append(("slow", f"stall (ended): {_stall_sentence(stall)}"))
        else:
            waiting = ranges_text([other["rank"] for other in stall["waiting_ranks"]], ", ")
            out.append(("bad", f"{kind}: {_stall_sentence(stall)}" + (f"; rank(s) {waiting} wait for it" if waiting
                                                                       else "")))
    for error in diagnosis["errors"]:
        where = "outside a step" if error["step"] is None else f"step {error['step']}"
        message = f": {error['message']}" if error["message"] else ""
        out.append(("bad", f"error: rank {error['rank']} raised {error['type']}{message} in {where} at "
                           f"{_where(error['module'], error['pass'])}"))
    for item in diagnosis.get("unfinished_steps", []):
        ranks = ranges_text([*item["closed_at_exit"], *item["missing"]], ", ")
        out.append(("bad", f"unfinished: step {item['step']} did not finish on rank(s) {ranks}"))
    for desync in diagnosis["desyncs"]:
        out.append(("bad", f"desync: group {desync['group']}, step {desync['step']}, seq {desync['seq']}: "
                           f"rank(s) {ranges_text(desync['ranks'], ', ')} issued different collectives"))
    straggler = _straggler_answer(diagnosis)
    if straggler:
        out.append(("slow", straggler))
    out += ended
    if not out:
        steps = [step for step in diagnosis["steps"] if step not in diagnosis.get("warmup_steps", ())]
        judged = f"steps {ranges_text(steps, ', ')}" if steps else "no step past the warm-up"
        out.append(("ok", f"healthy: no straggler above the noise, no stall, error or desync; judged on {judged}"))
    return out


def _answer_section(answers: list[tuple[str, str]]) -> str:
    (tone, headline), rest = answers[0], answers[1:]
    more = "".join(f"<li>{_e(text)}</li>" for _, text in rest)
    return (f"<div id='answer' class='{tone}'>{_e(headline)}</div>"
            + (f"<ul class=answers>{more}</ul>" if more else ""))


# ------------------------------------------------------------------ findings


def _stall_block(stall: dict) -> str:
    def in_flight(collectives: list[dict]) -> str:
        return "; ".join(f"{c['op']} (group {c['group']}, seq {c['seq']}"
                         + (f", from {_where(c['module'], c['pass'])}" if c["module"] else "")
                         + f", {c['age_s']:.1f} s)" for c in collectives) or "nothing"
    said = (f"{_stall_sentence(stall)}: {stall['reason']}"
            if stall["snapshot"] else f"rank {stall['rank']}: {stall['reason']}")
    parts = [f"<p>{_e(said)}; in flight on rank {_e(stall['rank'])}: {_e(in_flight(stall['in_flight']))}</p>"]
    if stall["waiting_ranks"]:
        parts.append(_table(["waiting rank", "step", "where", "in flight"], [
            [other["rank"], other["step"], _where(other["module"], other["pass"]), in_flight(other["in_flight"])]
            for other in stall["waiting_ranks"]], frozenset({2, 3})))
    if stall["ahead"]:
        parts.append(_table(["rank ahead", "group", "issued seq", f"rank {stall['rank']}'s seq"], [
            [item["rank"], item["group"], item["issued_seq"], item["behind_seq"]] for item in stall["ahead"]]))
    if stall["stack"]:
        parts.append(f"<details><summary>stack of rank {_e(stall['rank'])} ({len(stall['stack'])} frames, innermost "
                     f"last)</summary><pre class=wrap>{_e(chr(10).join(stall['stack']))}</pre></details>")
    return "".join(parts)


def _findings(diagnosis: dict[str, Any]) -> str:
    parts = [f"<ul>{''.join(f'<li>{_e(line)}</li>' for line in diagnosis['warnings'])}</ul>"
             if diagnosis["warnings"] else ""]
    empty = []
    if diagnosis["errors"]:
        parts.append(f"<h3>Errors: {len(diagnosis['errors'])}</h3>" + _table(
            ["rank", "step", "where", "exception"],
            [[error["rank"], "-" if error["step"] is None else error["step"], _where(error["module"], error["pass"]),
              f"{error['type']}: {error['message']}" if error["message"] else error["type"]]
             for error in diagnosis["errors"]], frozenset({2, 3})))
    else:
        empty.append("errors")
    if diagnosis["stalls"]:
        parts.append(f"<h3>Stalls: {len(diagnosis['stalls'])}</h3>"
                     + "".join(_stall_block(stall) for stall in diagnosis["stalls"]))
    else:
        empty.append("stalls")
    unfinished = diagnosis.get("unfinished_steps", [])
    if unfinished:
        rows = []
        for item in unfinished:
            rows += [[item["step"], rank, f"ended at exit in {_where(*where.values())}"]
                     for rank, where in item["closed_at_exit"].items()]
            rows += [[item["step"], rank, "never finished it"] for rank in item["missing"]]
        parts.append(f"<h3>Unfinished steps: {len(unfinished)}</h3>"
                     + _table(["step", "rank", "what"], rows, frozenset({2})))
    if diagnosis["desyncs"]:
        parts.append(f"<h3>Desyncs: {len(diagnosis['desyncs'])}</h3>")
        for desync in diagnosis["desyncs"]:
            parts.append(f"<p>group {_e(desync['group'])}, step {_e(desync['step'])}, seq {_e(desync['seq'])}:</p>"
                         + _table(["rank", "op", "dtype", "shape", "reduce op", "where"], [
                             [rank, c["op"], c["dtype"], c["shape"], c["reduce_op"], _where(c["module"], c["pass"])]
                             for rank, c in desync["ranks"].items()], frozenset({5})))
    else:
        empty.append("desyncs")
    header, rows, legend = _straggler_rows(diagnosis)
    if rows:
        left = (f"<p class=muted>{len(rows) - TOP_STRAGGLERS} more row(s): "
                "<code>commdebug-otel diagnose --format json</code> has them all.</p>" if len(rows) > TOP_STRAGGLERS
                else "")
        warmup = diagnosis.get("warmup_steps") or ()
        parts.append(f"<h3>Stragglers: {len(rows)}</h3><p class=muted>{_e(legend)}"
                     + (f"; step {_e(ranges_text(warmup, ', '))} (warm-up) left out" if warmup else "") + ".</p>"
                     + _table(header, rows[:TOP_STRAGGLERS], frozenset({1})) + left)
    else:
        empty.append("stragglers")
    waits = diagnosis["pipeline_waits"]
    if waits["pairs"]:
        parts.append(f"<h3>Pipeline waits: {waits['pairs']} send/recv pair(s), {waits['wait_ms']:.3f} ms</h3>"
                     + _table(["rank", "group", "recvs", "waited ms", "max ms"], [
                         [row["rank"], row["group"], row["recvs"], f"{row['wait_ms']:.3f}", f"{row['max_wait_ms']:.3f}"]
                         for row in waits["per_stage"]]))
    if empty:
        parts.append(f"<p class=muted>No {', no '.join(empty)}.</p>")
    text = diagnose.format_text(diagnosis)
    parts.append(f"<details><summary><code>commdebug-otel diagnose</code>'s text</summary><pre class=wrap>{_e(text)}"
                 "</pre></details>")
    return "".join(parts)


# ------------------------------------------------------------------ per rank and per module


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


def module_traffic(spans: list[dict]) -> dict[str, dict[str, dict[str, int]]]:
    """Collectives by the module that issued them (its span's FQN, else the span's name) and op, on every rank
    (stall snapshots' copies left out): ``{place: {op: {"count": n, "bytes": b}}}``, the places ranked by bytes
    (then count, then name); ``torch.collective.bytes`` missing counts 0 bytes."""
    table: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    for event in summary.collective_events(_finished(spans)):
        place = event.span["attributes"].get(semconv.MODULE_FQN) or event.span["name"]
        cell = table[place].setdefault(event.op, {"count": 0, "bytes": 0})
        cell["count"] += 1
        cell["bytes"] += event.nbytes

    def total(place: str, key: str) -> int:
        return sum(cell[key] for cell in table[place].values())
    ranked = sorted(table, key=lambda place: (-total(place, "bytes"), -total(place, "count"), place))
    return {place: dict(sorted(table[place].items())) for place in ranked}


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
    traffic = module_traffic(spans)
    if not traffic:
        return "<p class=muted>No collectives.</p>"
    ops = sorted({op for row in traffic.values() for op in row})
    top = max(cell["bytes"] for row in traffic.values() for cell in row.values()) or 1
    head = "".join(f"<th>{_e(op)}</th>" for op in ops)
    body = []
    for place, row in traffic.items():
        cells = []
        for op in ops:
            cell = row.get(op)
            if cell is None:
                cells.append("<td></td>")
                continue
            shade = 0.06 + 0.7 * cell["bytes"] / top  # linear: a layer's megabytes stand out from a norm's bytes
            shown = summary.human_bytes(cell["bytes"])
            cells.append(f"<td style='background:rgba(225,87,89,{shade:.2f})' title='{_e(place)}: {cell['count']} "
                         f"{_e(op)}, {cell['bytes']} bytes'>{shown} ({cell['count']})</td>")
        n = sum(cell["count"] for cell in row.values())
        size = sum(cell["bytes"] for cell in row.values())
        body.append(f"<tr class=module><td class=text>{_e(place)}</td><td>{summary.human_bytes(size)}</td><td>{n}</td>"
                    f"{''.join(cells)}</tr>")
    return ("<p class=muted>Over every rank and step in the files, ranked by bytes; each op's cell: bytes (count)."
            "</p><table class=heat><tr><th>module</th><th>bytes</th><th>collectives</th>"
            f"{head}</tr>{''.join(body)}</table>")


# ------------------------------------------------------------------ timelines


def _step_parts(spans: list[dict]) -> tuple[dict[int, list[dict]], dict[int, list[dict]]]:
    """The finished spans of each step, ``{step: spans}``, without its ``train_step_tail``, and the tails
    (each with the spans under it), ``{step: spans}``."""
    detached = [{**span, "parent_span_id": ""} if span["name"] == semconv.SPAN_TRAIN_STEP_TAIL else span
                for span in _finished(spans) if span["name"] != semconv.SPAN_STALL_VERDICT]
    index = index_of(detached)
    own: dict[int, list[dict]] = defaultdict(list)
    for span in detached:
        step = index.step(span)
        if step is not None:
            own[step].append(span)
    tails: dict[int, list[dict]] = defaultdict(list)
    for root in index.roots:  # walked down from each tail: linear in the spans however deep
        step = root["attributes"].get(semconv.STEP)
        if root["name"] == semconv.SPAN_TRAIN_STEP_TAIL and isinstance(step, int):
            below = [root]
            while below:
                span = below.pop()
                tails[step].append(span)
                below.extend(index.children(span))
    return own, tails


def _tick_step_ms(span_ms: float) -> float:
    """The widest 1, 2 or 5 x 10^k ms spacing that still gives at least 5 intervals over ``span_ms``: 6 to 13 ticks."""
    power = 10 ** math.floor(math.log10(max(span_ms, 1e-3) / 5))
    return max(m * power for m in (1, 2, 5) if span_ms / (m * power) >= 5 - 1e-9)


def _axis(span_ms: float, height: int) -> str:
    every = _tick_step_ms(span_ms)
    parts = []
    for i in range(int(span_ms / every + 1e-9) + 1):
        ms = i * every
        x = _LEFT + ms / max(span_ms, 1e-9) * _WIDTH
        label = f"{ms:.{max(0, -math.floor(math.log10(every)))}f}" if every < 1 else f"{ms:.0f}"
        parts.append(f"<line x1='{x:.1f}' y1='{_AXIS - 6}' x2='{x:.1f}' y2='{height}' stroke='#ddd'/>"
                     f"<text class='tick' x='{x:.1f}' y='{_AXIS - 9}' font-size='11' text-anchor='middle'>"
                     f"{label} ms</text>")
    return f"<g class='axis'>{''.join(parts)}</g>"


def _label(span: dict, width: float) -> str:
    """The span's name as fits ``width`` px (its FQN, else its last part), or "" when nothing fits."""
    name = span["attributes"].get(semconv.MODULE_FQN) or span["name"]
    for text in (name, name.rsplit(".", 1)[-1]):
        if len(text) * 6.2 + 4 <= width:
            return text
    return ""


def _timeline(own: list[dict], tail: list[dict], step: int) -> tuple[str, int]:
    """One step's figure (time axis, a band per rank) and how many spans it left out."""
    if not own:
        return "", 0
    t0 = min(span["start_ns"] for span in own)
    t1 = max(span["end_ns"] for span in own)
    span_ms = (t1 - t0) / 1e6
    scale = _WIDTH / max(t1 - t0, 1)
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for span in own:
        by_rank[span["rank"]].append(span)
    parts, y, left_out = [], _AXIS, 0
    for rank, ranked in sorted(by_rank.items()):
        left_out += max(len(ranked) - MAX_SPANS_PER_RANK, 0)
        ranked = ranked[:MAX_SPANS_PER_RANK]
        depth_of = {id(span): (int(span["attributes"].get(semconv.MODULE_DEPTH, -1)) + 1) for span in ranked}
        rows = max(depth_of.values(), default=0) + 2
        parts.append(f"<text class='rank' x='0' y='{y + 11}' font-size='12' font-weight='bold'>rank {rank}</text>")
        for span in ranked:
            x = _LEFT + (span["start_ns"] - t0) * scale
            w = max((span["end_ns"] - span["start_ns"]) * scale, 0.5)
            top = y + depth_of[id(span)] * _ROW
            colour = _PASS_COLOURS.get(span["attributes"].get(semconv.MODULE_PASS), _STEP_COLOUR)
            ms = (span["end_ns"] - span["start_ns"]) / 1e6
            parts.append(f"<rect x='{x:.1f}' y='{top}' width='{w:.1f}' height='{_ROW - 2}' fill='{colour}'>"
                         f"<title>{_e(span['name'])}: {ms:.3f} ms</title></rect>")
            label = _label(span, w)
            if label:
                ink = "#fff" if colour != _STEP_COLOUR else "#222"
                parts.append(f"<text class='name' x='{x + 2:.1f}' y='{top + _ROW - 5}' font-size='10' fill='{ink}' "
                             f"pointer-events='none'>{_e(label)}</text>")
            for event in span["events"]:
                attributes = event["attributes"]
                if semconv.COLLECTIVE_OP not in attributes:
                    continue
                ex = _LEFT + (event["time_ns"] - t0) * scale
                detail = (f"{attributes[semconv.COLLECTIVE_OP]} {attributes.get(semconv.COLLECTIVE_SHAPE, '')} "
                          f"{attributes.get(semconv.COLLECTIVE_DTYPE, '')}, group "
                          f"{attributes.get(semconv.PROCESS_GROUP_NAME, '')} seq "
                          f"{attributes.get(semconv.COLLECTIVE_SEQ, '')}, in {span['name']}")
                parts.append(f"<rect x='{ex:.1f}' y='{y + (rows - 1) * _ROW}' width='2' height='{_ROW - 2}' "
                             f"fill='{_TICK_COLOUR}'><title>{_e(detail)}</title></rect>")
        y += rows * _ROW + 10
    svg = (f"<svg xmlns='http://www.w3.org/2000/svg' width='{_LEFT + _WIDTH + 30}' height='{y + 4}' "
           f"font-family='system-ui,sans-serif'>{_axis(span_ms, y)}{''.join(parts)}</svg>")
    tail_of: dict[int, list[dict]] = defaultdict(list)
    for span in tail:
        tail_of[span["rank"]].append(span)
    tails = []
    for rank, mine in sorted(tail_of.items()):
        roots = [span for span in mine if span["name"] == semconv.SPAN_TRAIN_STEP_TAIL]
        ms = sum(span["end_ns"] - span["start_ns"] for span in roots) / 1e6
        tails.append(f"rank {rank} {ms:.1f} ms, {len(summary.collective_events(mine))} collective(s)")
    note = (f"<p class=muted>After optimizer.step() (train_step_tail, not drawn): {_e('; '.join(tails))}.</p>"
            if tails else "")
    return (f"<div class='timeline' data-step='{step}' data-ms='{span_ms:.3f}'><p><b>step {step}</b>: "
            f"{span_ms:.2f} ms from its earliest start on any rank to its last end</p>{svg}{note}</div>"), left_out


def _timelines_section(spans: list[dict], steps: list[int]) -> str:
    if not steps:
        return "<p class=muted>No finished traced steps.</p>"
    own, tails = _step_parts(spans)
    figures, left_out = zip(*(_timeline(own.get(step, []), tails.get(step, []), step) for step in steps))
    options = "".join(f"<option value='{step}'{' selected' if step == steps[-1] else ''}>step {step}</option>"
                      for step in steps)
    legend = "".join(f"<span><i style='background:{colour}'></i>{name}</span>"
                     for name, colour in [*_PASS_COLOURS.items(), ("train_step", _STEP_COLOUR),
                                          ("collective", _TICK_COLOUR)])
    note = (f"<p class=muted>{sum(left_out)} span(s) past {MAX_SPANS_PER_RANK} per rank per step left out.</p>"
            if sum(left_out) else "")
    return (f"<p><label>Step <select id='step'>{options}</select></label></p><p class=legend>{legend}</p>"
            f"{note}{''.join(figures)}")


def render(spans: list[dict], steps: list[int] | None = None, title: str = "commdebug-otel report") -> str:
    """The page for ``spans`` (as :func:`commdebug_otel.offline.summary.load_spans` returns them).

    ``steps``: the steps with a timeline (default: the last :data:`DEFAULT_TIMELINES` finished ones).
    """
    with reusing():
        finished_steps = summary.steps_present(_finished(spans))
        shown = finished_steps[-DEFAULT_TIMELINES:] if steps is None else [s for s in steps if s in finished_steps]
        ranks = sorted({span["rank"] for span in spans})
        meta = {"ranks": ranks, "steps": finished_steps, "spans": len(spans)}
        diagnosis = diagnose.diagnose(spans)
        return (
            f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{_CSS}</style>"
            f"</head><body><h1>{_e(title)}</h1>{_answer_section(_answer(diagnosis, _live_verdicts(spans)))}"
            f"<p class=muted>{len(ranks)} rank(s), {len(finished_steps)} finished traced step(s), {len(spans)} span(s)."
            f" <span id='status'>script not run</span></p>"
            f"<script type='application/json' id='meta'>{_e(json.dumps(meta))}</script>"
            f"<h2>Findings (as <code>commdebug-otel diagnose</code>)</h2>{_findings(diagnosis)}"
            f"<h2>Step time and time waited in collectives, per rank</h2>{_times_section(spans)}"
            f"<h2>Step timelines</h2>{_timelines_section(spans, shown)}"
            f"<h2>Collectives by module and op, by bytes</h2>{_heat_section(spans)}"
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
    spans = load_for_command(args.paths, "report", snapshots=True)
    if spans is None:
        return EXIT_UNREADABLE
    page = render(spans, args.step)
    if write_output("report", args.output, page) != EXIT_DONE:
        return EXIT_NOT_THERE
    print(f"wrote {args.output} ({len(page) / 1024:.0f} KiB): open it in a browser; it needs no network")
    return EXIT_DONE
