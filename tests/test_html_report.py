"""`commdebug-otel report`: one self-contained HTML page of a real 2-rank run, rendered in headless chromium."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from commdebug_otel.offline import html_report, summary

from distributed import run_ranks
from models import AllReduceLinear
from tools import require_program

_STEPS = 3
_SLOW_RANK = 1
_DELAY_S = 0.3


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = AllReduceLinear()
        self.second = AllReduceLinear()

    def forward(self, x, rank):
        x = self.first(x)
        if rank == _SLOW_RANK:
            time.sleep(_DELAY_S)  # in _Net's own forward, before second's all_reduce
        return self.second(x)


def _job(rank, world_size, out_dir):
    from commdebug_otel import CommTracer, Settings

    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    def step():
        model(torch.ones(2, 4), rank).sum().backward()
        torch.distributed.all_reduce(torch.ones(1))  # in train_step, outside modules
        optimizer.step()

    step()  # untraced warm-up: the ranks' first collective waits for the slower start-up
    tracer = CommTracer(Settings(output_dir=out_dir))
    with tracer:
        for _ in range(_STEPS):
            step()
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


def test_the_heat_map_counts_each_module_and_op_on_every_rank(run):
    spans, _, page = run
    counts = html_report.heat_counts(spans)
    per_rank_steps = 2 * _STEPS
    assert {place: dict(ops) for place, ops in counts.items()} == {
        "_Net.first": {"all_reduce": per_rank_steps}, "_Net.second": {"all_reduce": per_rank_steps},
        "train_step": {"all_reduce": per_rank_steps}}
    assert f"title='_Net.first: {per_rank_steps} all_reduce'>{per_rank_steps}</td>" in page


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
    assert "<td>rank 0</td><td>3</td>" in page and "<td>rank 1</td><td>3</td>" in page


def test_the_findings_are_what_diagnose_says(run):
    import html

    from commdebug_otel.offline import diagnose, stragglers

    spans, _, page = run
    found = diagnose.diagnose(spans)
    text = diagnose.format_text(found)
    assert f"<pre>{html.escape(text)}</pre>" in page
    # The one straggler answer, as summarize and diagnose give it.
    assert "\n".join(stragglers.format_lines(found)) in text and "Desyncs: 0" in text


def test_a_timeline_per_step_with_every_collective(run):
    spans, _, page = run
    timelines = re.findall(r"<svg class='timeline' data-step='(\d+)'.*?</svg>", page, re.DOTALL)
    assert timelines == [str(step) for step in range(_STEPS)]
    for step in range(_STEPS):
        svg = re.search(rf"<svg class='timeline' data-step='{step}'.*?</svg>", page, re.DOTALL).group(0)
        ticks = svg.count("fill='#e15759'")
        assert ticks == len(summary.collective_events(summary.step_spans(spans, step))) == 2 * 3
        assert svg.count(">rank 0</text>") == svg.count(">rank 1</text>") == 1


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
    shot = tmp_path / "report.png"
    done = _chromium(page, f"--screenshot={shot}", "--window-size=1280,1800")
    assert done.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_browser_check_sees_a_script_error(run, tmp_path):
    """The check above can fail: the same page with its script broken."""
    _, _, text = run
    broken = tmp_path / "broken.html"
    broken.write_text(text.replace("document.getElementById('status')", "document.getElementByIdd('status')"))
    dom, errors = _rendered(broken)
    assert ">script not run</span>" in dom
    [error] = errors
    assert '"Uncaught TypeError: document.getElementByIdd is not a function"' in error
