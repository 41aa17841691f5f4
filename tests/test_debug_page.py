"""The `commdebug` page in torch's debug server, over HTTP, on real gloo ranks: one rank stuck in a module, the
other waiting for it in a collective."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request

import pytest
import torch
from torch import nn

pytest.importorskip("jinja2")
pytest.importorskip("tabulate")
pytest.importorskip("requests")
pytest.importorskip("torch.distributed.debug")

from commdebug_otel.debug_page import answer_line

from distributed import free_port, run_ranks
from models import AllReduceLinear, Net
from tools import require_program

HOLD_MAX_S = 90.0  # the stuck rank's longest hold, should the test fail before letting it go


class Holds(nn.Module):
    """An all-reducing layer whose forward can be held until a file appears (the stuck rank's module)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = AllReduceLinear(8)
        self.hold_until: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hold_until:
            deadline = time.monotonic() + HOLD_MAX_S
            while not os.path.exists(self.hold_until) and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.proj(x)


def _serve_and_hold(rank: int, world_size: int, port: int, release: str) -> None:
    import torch.distributed.debug as debug

    from commdebug_otel import CommTracer
    from commdebug_otel.debug_page import debug_handlers

    model = Net(Holds)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    debug.start_debug_server(port=port, handlers=debug_handlers())
    try:
        with CommTracer():
            for step in range(3):
                model.layers[1].hold_until = release if rank == 1 and step == 1 else None
                model(torch.ones(2, 8)).sum().backward()
                optimizer.step()
    finally:
        if rank == 0:  # (torch's stop_debug_server raises on the ranks that run no frontend)
            debug.stop_debug_server()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.read()


@pytest.fixture(scope="module")
def held_job(tmp_path_factory):
    """``(answers, html)`` read while rank 1 is held in ``Net.layers.1 forward`` of step 1."""
    release = str(tmp_path_factory.mktemp("debug") / "release")
    port = free_port()
    failures: list[BaseException] = []

    def job() -> None:
        try:
            run_ranks(_serve_and_hold, 2, port, release, env={"OTEL_TRACES_EXPORTER": "none",
                                                              "OTEL_METRICS_EXPORTER": "none"})
        except BaseException as error:  # reported by the test
            failures.append(error)

    runner = threading.Thread(target=job)
    runner.start()
    try:
        answers, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline and not failures:
            try:
                answers = json.loads(_get(f"http://127.0.0.1:{port}/commdebug_json"))
            except OSError:  # the server is not up yet
                time.sleep(0.5)
                continue
            if (all(a.get("tracing") for a in answers) and answers[0]["communicating"]
                    and answers[1]["module"] == "Net.layers.1"):
                break
            time.sleep(0.2)
        html = _get(f"http://127.0.0.1:{port}/commdebug").decode()
    finally:
        open(release, "w").close()
        runner.join(timeout=300)
    assert not failures, failures
    return answers, html


def test_the_page_names_the_stuck_rank_and_who_waits_for_it(held_job):
    answers, html = held_job
    waiting, stuck = answers
    assert (stuck["rank"], stuck["step"], stuck["in_step"], stuck["module"], stuck["pass"],
            stuck["communicating"]) == (1, 1, True, "Net.layers.1", "forward", False)
    assert (waiting["rank"], waiting["step"], waiting["in_step"], waiting["communicating"]) == (0, 1, True, True)
    # Two forward all-reduces a step on the default group: rank 1 issued seq 2 (layers.0's), rank 0 also seq 3.
    [held_group], [waiting_group] = stuck["groups"], waiting["groups"]
    assert (held_group["issued"], waiting_group["issued"]) == (2, 3)
    assert waiting_group["completed"] < waiting_group["issued"]  # rank 0's collective is in flight
    line = "Rank 0 waits in a collective; not communicating: rank 1 (in Net.layers.1 forward)."
    assert answer_line(answers) == line
    assert line in html and "waiting in a collective" in html and "3 / " in html
    assert '<a href="/commdebug">commdebug-otel</a>' in html  # in torch's own navigation bar


def test_the_page_renders_in_chromium(held_job, tmp_path):
    chromium = require_program("chromium", "chromium-browser", package="chromium")
    _, html = held_job
    page, shot = tmp_path / "page.html", tmp_path / "page.png"
    page.write_text(html)
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1100,500", page.as_uri()], check=True, capture_output=True, timeout=120)
    assert shot.stat().st_size > 5000


def test_a_rank_that_does_not_answer_is_said():
    states = [{"rank": 0, "tracing": True, "communicating": True, "module": "", "pass": ""},
              {"rank": 1, "answered": False}]
    assert answer_line(states) == "Rank 1 did not answer: stuck holding the GIL, or gone."
    states[1] = {"rank": 1, "tracing": True, "verdict": "rank 1 is stuck in Net.layers.1 forward"}
    assert answer_line(states) == "Stall verdict: rank 1 is stuck in Net.layers.1 forward"


def test_a_standing_straggler_verdict_is_the_answer_when_nothing_hangs():
    slow = "rank 1 is slow since step 30: the other ranks wait 49 ms per step for it"
    states = [{"rank": 0, "tracing": True, "communicating": False, "module": "", "pass": "", "straggler": slow},
              {"rank": 1, "tracing": True, "communicating": False, "module": "", "pass": "", "straggler": ""}]
    assert answer_line(states) == f"Straggler verdict: {slow}"
    states[1]["verdict"] = "rank 1 is stuck in Net.layers.1 forward"  # a hang comes first
    assert answer_line(states) == "Stall verdict: rank 1 is stuck in Net.layers.1 forward"
