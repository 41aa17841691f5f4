"""`commdebug-otel report`: one self-contained HTML page of a real 2-rank run, rendered in headless chromium."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from commdebug_otel.offline import html_report, summary

from distributed import run_ranks
from models import AllReduceLinear
from tools import require_program

_STEPS = 5  # 4 past the warm-up: a straggler must be late in at least 3 steps to be one
_SLOW_RANK = 1
_DELAY_S = 0.3
_TINY = 3  # tiny all_reduces per step in train_step outside modules: the most collectives, the fewest bytes
_TAIL_S = 1.0  # after the last optimizer.step(): its train_step_tail lasts this long, to the tracer's exit


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = AllReduceLinear()
        self.second = AllReduceLinear()
        self.delay_s = _DELAY_S
        self.until = None  # a file: sleep until it exists (at most delay_s) instead

    def forward(self, x, rank):
        x = self.first(x)  # all_reduce of 2 x 4 float32: 32 bytes
        if rank == _SLOW_RANK:
            deadline = time.monotonic() + self.delay_s  # in _Net's own forward, before second's all_reduce
            while time.monotonic() < deadline and not (self.until and os.path.exists(self.until)):
                time.sleep(min(0.1, self.delay_s))
        return self.second(torch.cat([x, x]))  # 4 x 4: 64 bytes


def _job(rank, world_size, out_dir):
    from commdebug_otel import CommTracer, Settings

    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    def step():
        model(torch.ones(2, 4), rank).sum().backward()
        for _ in range(_TINY):
            torch.distributed.all_reduce(torch.ones(1))  # in train_step, outside modules: 4 bytes
        optimizer.step()
        torch.distributed.all_reduce(torch.ones(2))  # after optimizer.step(): the step's train_step_tail, 8 bytes

    step()  # untraced warm-up: the ranks' first collective waits for the slower start-up
    tracer = CommTracer(Settings(output_dir=out_dir))
    with tracer:
        for _ in range(_STEPS):
            step()
        time.sleep(_TAIL_S)
    tracer.telemetry.shutdown()
    return tracer.telemetry.file_directory


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    folder, _ = run_ranks(_job, 2, str(out))
    page = out / "report.html"
    done = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "report", folder, "-o", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return summary.load_spans([folder]), page, page.read_text()


def test_the_page_needs_no_network(run):
    _, _, page = run
    assert not re.search(r"""(src|href)\s*=|@import|url\(|<link""", page, re.IGNORECASE)
    assert page.count("<script>") == 1 and page.count("<style>") == 1


def test_the_page_opens_with_the_straggler_answer(run):
    _, _, page = run
    # The first thing under the title: rank 1's sleep in _Net's own forward, every step past the warm-up.
    answer = re.search(r"</h1><div id='answer' class='(\w+)'>(.*?)</div>", page)
    assert answer.group(1) == "slow"
    # Late in each of the 4 steps past the warm-up, by about the sleep (a loaded machine can hide a step).
    found = re.fullmatch(r"straggler: rank 1 in _Net forward: late in (\d) of 4 steps, (\d+)-(\d+) ms \(noise cut "
                         r"[\d.]+ ms\), p=\de-\d+( \(\d+ more under Findings\))?", answer.group(2))
    assert found, answer.group(2)
    assert int(found.group(1)) >= 3 and int(found.group(2)) >= _DELAY_S * 1e3 * 0.9


def test_a_healthy_answer_and_a_live_verdict_first(run):
    from commdebug_otel.offline import diagnose

    spans, _, _ = run
    diagnosis = diagnose.diagnose(spans)
    assert html_report._answer(diagnosis | {"stragglers": []}, []) == [
        ("ok", "healthy: no straggler above the noise, no stall, error or desync; judged on steps 1-4")]
    verdicts = [("hang", "rank 1 never entered all_reduce #4 on group 0", 7)]
    assert html_report._answer(diagnosis, verdicts)[0] == ("bad", "hang: rank 1 never entered all_reduce #4 on group 0")


def test_a_stall_from_the_snapshots_is_the_answer_without_a_live_verdict(run):
    from commdebug_otel.offline import diagnose

    spans, _, _ = run
    stall = {"rank": 1, "step": 4, "module": "_Net.second", "pass": "forward", "age_s": 42.04, "snapshot": 2,
             "between_steps": False, "ended": False, "reason": "behind on group 0",
             "waiting_ranks": [{"rank": 0}, {"rank": 2}, {"rank": 3}]}
    over = stall | {"rank": 2, "step": 0, "ended": True, "waiting_ranks": []}
    diagnosis = diagnose.diagnose(spans) | {"stalls": [stall, over]}
    answers = html_report._answer(diagnosis, [])
    assert answers[0] == (
        "bad", "hang: rank 1 is stuck in step 4 at _Net.second forward for 42.0 s; rank(s) 0, 2-3 wait for it")
    assert answers[1][1].startswith("straggler: rank 1 in _Net forward: late in ")  # after the stall still on
    assert answers[2:] == [("slow", "stall (ended): rank 2 was stuck in step 0 at _Net.second forward for 42.0 s")]
    # A verdict goes with the stalls of its step: still on, it leads; ended, it follows the straggler.
    verdicts = [("hang", "rank 2 never entered all_reduce #0", 0), ("hang", "rank 1 never entered all_reduce #9", 4)]
    answers = html_report._answer(diagnosis, verdicts)
    assert [text for _, text in answers if "verdict" in text or "never entered" in text] == [
        "hang: rank 1 never entered all_reduce #9", "hang (ended): rank 2 never entered all_reduce #0"]
    assert answers[0] == ("bad", "hang: rank 1 never entered all_reduce #9")
    # The hang rule's kind leads the sentence: a desync's smaller side, a rank that sent no snapshot.
    desync = stall | {"verdict": {"kind": "desync", "summary": "desync at #9 on group 0 in step 4: ..."}}
    missing = {"rank": 3, "snapshot": 0, "reason": "sent no snapshot while the others are stalled",
               "verdict": {"kind": "missing", "summary": "rank 3 published nothing ..."}}
    answers = html_report._answer(diagnosis | {"stalls": [desync, missing]}, [])
    assert [text for _, text in answers[:2]] == [
        "desync: rank 1 is stuck in step 4 at _Net.second forward for 42.0 s; rank(s) 0, 2-3 wait for it",
        "missing: rank 3 is stuck: it sent no snapshot while the others are stalled"]


_STUCK_S = 120.0  # a hung rank's sleep at most: the test ends it once it has read the files


def _hang_job(rank, world_size, out_dir, release):
    from commdebug_otel import CommTracer, Settings

    model = _Net()
    model.until = release
    step = 0
    def one_step():
        model.delay_s = _STUCK_S if step == 1 else 0.0
        model(torch.ones(2, 4), rank).sum().backward()

    one_step()  # untraced warm-up
    with CommTracer(Settings(output_dir=out_dir, stall_after_s=2.0)):
        for step in range(2):  # noqa: B007 (one_step reads it)
            one_step()
            torch.optim.SGD(model.parameters(), lr=0.1).step()


def test_a_live_hang_opens_with_the_verdict_sentence(tmp_path):
    """A real hang, read while it lasts: rank 1 sleeps in _Net's forward in step 1 while rank 0 waits in second's
    all_reduce; the report is made once that step's live verdict is in the files, and then the hang is released (a
    loaded machine can stall step 0 too, with a verdict of its own: ended by then, it comes after)."""
    out, page, release, failed = tmp_path / "hang", tmp_path / "hang.html", tmp_path / "release", []

    def job():
        try:
            run_ranks(_hang_job, 2, str(out), str(release))
        except BaseException as error:  # said by the test, not lost in the thread
            failed.append(error)
    thread = threading.Thread(target=job)
    thread.start()
    try:
        deadline = time.monotonic() + _STUCK_S / 2
        while time.monotonic() < deadline and not any(
                "(step 1, 2 of 2 ranks reported)" in path.read_text() for path in out.glob("*/traces-rank*.jsonl")):
            time.sleep(0.3)
        done = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "report", str(out), "-o", str(page)],
                              capture_output=True, text=True, timeout=120)
    finally:
        release.touch()
        thread.join(timeout=_STUCK_S * 2)
    assert failed == [] and done.returncode == 0, done.stderr
    text = page.read_text()
    answer = re.search(r"</h1><div id='answer' class='(\w+)'>(.*?)</div>", text)
    assert answer.group(1) == "bad"
    assert re.fullmatch(r"hang: rank 1 never entered all_reduce #\d+ on group 0, issued by _Net.second; it is in "
                        r"_Net forward; rank 0 waits? in it \(step 1, 2 of 2 ranks reported\)", answer.group(2)), answer
    # diagnose's stall from the snapshots is said under it, and its table is in the findings.
    assert re.search(r"<li>hang: rank 1 is stuck in step 1 at _Net forward for \d+\.\d s; rank\(s\) 0 wait for it</li>",
                     text)
    assert re.search(r"<h3>Stalls: \d+</h3>", text) and "stack of rank 1 (" in text  # step 0's too, when it stalled


def _hostile(spans):
    """The run's spans with a hostile module name and a live hang verdict whose sentence is hostile too."""
    name = "<img src=x onerror=alert(1)>&'\""
    out = [{**span, "attributes": {**span["attributes"], "torch.module.fqn": name}}
           if span["attributes"].get("torch.module.fqn") == "_Net.first" else span for span in spans]
    step = next(span for span in spans if span["name"] == "train_step")
    out.append({**step, "name": "stall_verdict", "span_id": "f" * 16, "parent_span_id": step["span_id"], "events": [],
                "attributes": {"commdebug.verdict.kind": "hang", "commdebug.verdict.summary": f"rank 1 in {name}"}})
    return name, out


def test_every_name_is_escaped_and_the_hang_verdict_comes_first(run):
    import html

    spans, _, _ = run
    name, hostile = _hostile(spans)
    page = html_report.render(hostile)
    assert name not in page and "<img" not in page
    assert f"<div id='answer' class='bad'>hang: rank 1 in {html.escape(name)}</div>" in page
    assert f"<td class=text>{html.escape(name)}</td>" in page  # the module table


def test_modules_ranked_by_bytes_with_their_counts(run):
    spans, _, page = run
    traffic = html_report.module_traffic(spans)
    n = 2 * _STEPS  # per module: once per step on each rank
    assert list(traffic.items()) == [
        ("_Net.second", {"all_reduce": {"count": n, "bytes": 64 * n}}),
        ("_Net.first", {"all_reduce": {"count": n, "bytes": 32 * n}}),
        ("train_step", {"all_reduce": {"count": _TINY * n, "bytes": 4 * _TINY * n}}),
        ("train_step_tail", {"all_reduce": {"count": n, "bytes": 8 * n}})]
    rows = re.findall(r"<tr class=module><td class=text>(.*?)</td><td>(.*?)</td><td>(\d+)</td>", page)
    assert rows == [("_Net.second", f"{64 * n} B", f"{n}"), ("_Net.first", f"{32 * n} B", f"{n}"),
                    ("train_step", f"{4 * _TINY * n} B", f"{_TINY * n}"), ("train_step_tail", f"{8 * n} B", f"{n}")]
    assert f"title='_Net.first: {n} all_reduce, {32 * n} bytes'>{32 * n} B ({n})</td>" in page


def test_step_and_wait_time_per_rank(run):
    spans, _, page = run
    times = html_report.step_times(spans)
    assert sorted(times) == [0, 1] and [row["steps"] for row in times.values()] == [_STEPS, _STEPS]
    for rank, row in times.items():
        steps = [span for span in spans if span["name"] == "train_step" and span["rank"] == rank]
        assert row["wait_ms"] == pytest.approx(sum(span["attributes"]["torch.step.collective_wait_s"]
                                                   for span in steps) * 1e3)
        assert row["max_ms"] == max(span["end_ns"] - span["start_ns"] for span in steps) / 1e6
        assert f"<td>{row['wait_ms']:.2f}</td>" in page
    # Rank 0 waits in second's all_reduce for rank 1's sleep, every step. No bound in seconds: a busy machine
    # can delay rank 0 too; only the order of the two ranks is asserted.
    assert times[0]["wait_ms"] > times[1]["wait_ms"]
    assert f"<td>rank 0</td><td>{_STEPS}</td>" in page and f"<td>rank 1</td><td>{_STEPS}</td>" in page


def test_the_findings_are_what_diagnose_says(run):
    import html

    from commdebug_otel.offline import diagnose, stragglers

    spans, _, page = run
    found = diagnose.diagnose(spans)
    text = diagnose.format_text(found)
    assert f"<pre class=wrap>{html.escape(text)}</pre></details>" in page
    # The one straggler answer, as summarize and diagnose give it; the injected place is the latest of the raw rows.
    assert "\n".join(stragglers.format_lines(found)) in text and "Desyncs: 0" in text
    top = found["lateness"][0]
    assert (top["rank"], top["module"], top["pass"]) == (1, "_Net", "forward")
    for row in found["stragglers"]:
        assert f"<td class=text>{html.escape(row['module'])} {row['pass']}</td>" in page
    assert "<p class=muted>No errors, no stalls, no desyncs.</p>" in page


def _figure(page, step):
    return re.search(rf"<div class='timeline' data-step='{step}' data-ms='([\d.]+)'>.*?</div>", page, re.DOTALL)


def test_a_timeline_per_step_with_its_own_collectives_and_a_time_axis(run):
    spans, _, page = run
    assert re.findall(r"<div class='timeline' data-step='(\d+)'", page) == [str(step) for step in range(_STEPS)]
    for step in range(_STEPS):
        figure = _figure(page, step)
        own = [span for span in spans if span["name"] == "train_step" and span["attributes"]["torch.step"] == step]
        span_ms = (max(span["end_ns"] for span in own) - min(span["start_ns"] for span in own)) / 1e6
        assert figure.group(1) == f"{span_ms:.3f}"  # the step's own work: its train_step_tail does not stretch it
        svg = figure.group(0)
        assert svg.count(f"fill='{html_report._TICK_COLOUR}'") == 2 * (2 + _TINY)  # the tail's all_reduce apart
        assert svg.count(">rank 0</text>") == svg.count(">rank 1</text>") == 1
        ticks = [float(ms) for ms in re.findall(r"<text class='tick'[^>]*>([\d.]+) ms</text>", svg)]
        assert ticks[0] == 0 and 6 <= len(ticks) <= 13 and ticks[-1] <= span_ms < ticks[-1] + 2 * (ticks[1] - ticks[0])
        assert re.search(r"After optimizer.step\(\) \(train_step_tail, not drawn\): rank 0 [\d.]+ ms, "
                         r"1 collective\(s\); rank 1 [\d.]+ ms, 1 collective\(s\)\.", svg)
    # The last step's tail lasts to the tracer's exit, past its step's end: drawn, it would have stretched it.
    last = [span for span in spans if span["attributes"].get("torch.step") == _STEPS - 1]
    step_end = max(span["end_ns"] for span in last if span["name"] == "train_step")
    assert max(span["end_ns"] for span in last if span["name"] == "train_step_tail") - step_end > _TAIL_S * 1e9
    assert ">_Net</text>" in _figure(page, _STEPS - 1)[0]  # the module's name on its span: a third of a second


# ------------------------------------------------------------------------ in a browser
def _chromium(page, *flags):
    chromium = require_program("chromium", "chromium-browser", package="chromium")
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                           *flags, page.as_uri()], capture_output=True, text=True, timeout=120)


def _rendered(page):
    """The DOM after the page's script ran, and the console's script errors (chromium logs them to stderr)."""
    done = _chromium(page, "--enable-logging=stderr", "--v=0", "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, [line for line in done.stderr.splitlines() if "Uncaught" in line or ":ERROR:CONSOLE" in line]


def test_it_renders_in_headless_chromium_without_script_errors(run, tmp_path):
    _, page, _ = run
    dom, errors = _rendered(page)
    assert f">ready: {_STEPS} timeline(s)</span>" in dom and errors == []
    # What the browser built: the answer right under the title, then the rest; the last step's timeline shown
    # (the others hidden by the script), with its time axis and rank labels.
    body = re.search(r"<body>(.*)</body>", dom, re.DOTALL).group(1)
    assert re.match(r'<h1>commdebug-otel report</h1><div id="answer" class="slow">'
                    r"straggler: rank 1 in _Net forward: late in ", body)
    shown = re.findall(r'<div class="timeline" data-step="(\d+)"[^>]*style="display: (\w+);"', dom)
    assert shown == [*((str(step), "none") for step in range(_STEPS - 1)), (str(_STEPS - 1), "block")]
    assert '<text class="tick" x="64.0" y="19" font-size="11" text-anchor="middle">0 ms</text>' in dom
    shot = tmp_path / "report.png"  # kept in the test's tmp dir to look at
    done = _chromium(page, f"--screenshot={shot}", "--window-size=1280,1800", "--hide-scrollbars")
    assert done.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", shot.read_bytes()[16:24])  # the IHDR chunk
    assert (width, height) == (1280, 1800)


def test_nothing_runs_off_a_1280_px_window(run, tmp_path):
    """Long names and sentences wrap: the page is no wider than the window (chromium's layout, measured by a probe
    added to a copy of the page)."""
    spans, _, _ = run
    long = "model." + ".".join(f"block_{i}" for i in range(60))  # 500 characters, no space
    renamed = [{**span, "attributes": {**span["attributes"], "torch.module.fqn": long}}
               if span["attributes"].get("torch.module.fqn") == "_Net.first" else span for span in spans]
    step = next(span for span in spans if span["name"] == "train_step")
    renamed.append({**step, "name": "stall_verdict", "span_id": "f" * 16, "parent_span_id": step["span_id"],
                    "events": [], "attributes": {"commdebug.verdict.summary": f"rank 1 never entered {long}"}})
    probe = ("<script>document.getElementById('status').textContent="
             "'width '+document.documentElement.scrollWidth;</script></body>")
    page = tmp_path / "long.html"
    page.write_text(html_report.render(renamed).replace("</body>", probe))
    done = _chromium(page, "--window-size=1280,1000", "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    width = int(re.search(r'<span id="status">width (\d+)</span>', done.stdout).group(1))
    assert width <= 1280


def test_the_browser_check_sees_a_script_error(run, tmp_path):
    """The check above can fail: the same page with its script broken."""
    _, _, text = run
    broken = tmp_path / "broken.html"
    broken.write_text(text.replace("document.getElementById('status')", "document.getElementByIdd('status')"))
    dom, errors = _rendered(broken)
    assert ">script not run</span>" in dom
    [error] = errors
    assert '"Uncaught TypeError: document.getElementByIdd is not a function"' in error
