"""A ``commdebug`` page in torch's debug server: where every rank is, what it waits for, the last verdicts.

torch (2.10 and later) ships ``torch.distributed.debug.start_debug_server``: a page on rank 0 that fans out to
every rank for stacks, Flight Recorder and py-spy. Add ours with one call, on every rank, in place of the default
handlers::

    import torch.distributed.debug as debug
    from commdebug_otel.debug_page import debug_handlers

    debug.start_debug_server(port=25999, handlers=debug_handlers())
    # http://RANK0-HOST:25999/commdebug  (JSON: /commdebug_json)

Per rank the page shows the step, the module and pass the training thread is in, whether it is blocked in a
collective, the last issued and completed seq per process group (a collective in flight is one issued and not
known complete), the last stall snapshot and the last stall verdict. Ranks answer through the job's TCPStore
(``MASTER_ADDR``/``MASTER_PORT``, as torch's debug server itself): each rank's answering thread blocks on the store
until the page asks, so a job whose page nobody opens pays nothing. A rank that does not answer within
:data:`ANSWER_TIMEOUT_S` is shown as not answering (stuck holding the GIL, or gone).

Needs what torch's debug server needs: ``pip install '.[debug-server]'`` (jinja2, tabulate, requests).
It does not start the server, nor trace: the tracer runs as always (``CommTracer`` or the environment start), and a
rank with no tracer answers ``"tracing": false``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from typing import Any

from commdebug_otel.capture._torch import debug_server_default_handlers, debug_server_store, debug_server_types
from commdebug_otel.core.thread_signals import start_quiet
from commdebug_otel.offline.hangs import ranks_text

__all__ = ["ANSWER_TIMEOUT_S", "CommDebugPage", "debug_handlers", "rank_state"]

_logger = logging.getLogger(__name__)
DebugHandler, NavLink, Route = debug_server_types()

STORE_PREFIX = "commdebug_otel/debug"
ANSWER_TIMEOUT_S = 5.0  # how long the page waits for every rank's answer
_WAIT = datetime.timedelta(hours=1)  # one blocking wait of an answering thread (then it waits again)
FORMAT = 1  # of each rank's answer


def rank_state() -> dict[str, Any]:
    """This rank's answer: :func:`~commdebug_otel.tracer.debug_state` of the exporting tracer, with
    ``format`` and ``tracing``; ``{"rank", "tracing": False}`` when none runs."""
    from commdebug_otel.tracer import debug_state, exporting_tracer

    tracer = exporting_tracer()
    if tracer is None:
        return {"format": FORMAT, "rank": int(os.environ.get("RANK", "0")), "tracing": False}
    return {"format": FORMAT, "tracing": True, **debug_state(tracer)}


class _Answerer:
    """This rank's daemon thread: blocks on the store until the page asks, then writes :func:`rank_state`."""

    def __init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name="commdebug-otel-debug-page", daemon=True)

    def _run(self) -> None:
        import torch.distributed as dist

        try:
            store, _ = debug_server_store(STORE_PREFIX)
            rank = int(os.environ["RANK"])
            asked = int(store.add("asks", 0))  # answer what is asked from now on
        except Exception as error:  # no store to answer through: the page shows this rank as not answering
            _logger.warning("commdebug-otel: the debug page's answering thread did not start: %s",
                            type(error).__name__)
            return
        while True:
            try:
                store.wait([f"ask/{asked}"], _WAIT)
            except dist.DistStoreError:  # the wait's own timeout: nobody asked for an hour
                continue
            except Exception:  # the store is gone (the job is ending)
                return
            try:
                store.set(f"r/{asked}/{rank}", json.dumps(rank_state()))
                if asked:
                    store.delete_key(f"r/{asked - 1}/{rank}")
            except Exception as error:
                _logger.warning("commdebug-otel: the debug page's answer failed (%s); no more answers",
                                type(error).__name__)
                return
            asked += 1


_answerer: _Answerer | None = None
_answerer_lock = threading.Lock()


def _answer_on_this_rank() -> None:
    global _answerer
    with _answerer_lock:
        if _answerer is None:
            _answerer = _Answerer()
            start_quiet(_answerer.thread)


PAGE_TEMPLATE = """
{% extends "base.html" %}
{% block header %}<h1>{% block title %}commdebug-otel{% endblock %}</h1>{% endblock %}
{% block content %}
<style>
 .cd td, .cd th { border: 1px solid #ccc; padding: 2px 8px; text-align: left; vertical-align: top; }
 .cd { border-collapse: collapse; } .wait { color: #a60; } .stuck { color: #b00; font-weight: bold; }
</style>
<p class="answer">{{ answer | e }}</p>
<table class="cd">
<tr><th>rank</th><th>step</th><th>where</th><th>doing</th><th>for (s)</th>
    <th>seq per group: issued / completed</th><th>last stall snapshot</th></tr>
{% for row in rows %}
<tr>
 <td>{{ row.rank | e }}</td><td>{{ row.step | e }}</td><td>{{ row.where | e }}</td>
 <td class="{{ row.css }}">{{ row.doing | e }}</td><td>{{ row.age | e }}</td>
 <td>{% for group in row.groups %}{{ group | e }}<br>{% endfor %}</td><td>{{ row.stall | e }}</td>
</tr>
{% endfor %}
</table>
<p>Asked {{ asked | e }}; {{ answered | e }} of {{ world | e }} ranks answered within {{ timeout | e }} s.</p>
{% endblock %}
"""


def _row(state: dict[str, Any]) -> dict[str, Any]:
    """One rank's table row from its answer."""
    if not state.get("answered", True):
        return {"rank": state["rank"], "step": "", "where": "", "doing": "did not answer (stuck holding the GIL, "
                "or gone)", "css": "stuck", "age": "", "groups": [], "stall": ""}
    if not state.get("tracing"):
        return {"rank": state["rank"], "step": "", "where": "", "doing": "not traced", "css": "", "age": "",
                "groups": [], "stall": ""}
    groups = []
    in_flight = False
    for group in state["groups"]:
        behind = group["issued"] - group["completed"]
        in_flight |= behind > 0
        name = group["group"] + (f" ({group['mesh_dim']})" if group["mesh_dim"] else "")
        groups.append(f"{name}: {group['issued']} / {group['completed']}" + (f", {behind} in flight" if behind > 0
                                                                             else ""))
    where = f"{state['module']} {state['pass']}".strip() or "outside any module"
    if state["communicating"]:
        doing, css = "waiting in a collective", "wait"
    elif state["in_step"]:
        doing, css = "computing", ""
    else:
        doing, css = "between steps", ""
    return {"rank": state["rank"], "step": state["step"] if state["in_step"] else f"before {state['step']}",
            "where": where, "doing": doing, "css": css, "age": f"{state['age_s']:.1f}", "groups": groups,
            "stall": state.get("stall", "")}


def answer_line(states: list[dict[str, Any]]) -> str:
    """The page's first line: a stall verdict a rank formed, else who waits and who does not, else a live straggler
    verdict that stands, else all is well."""
    verdicts = [state["verdict"] for state in states if state.get("verdict")]
    if verdicts:
        return f"Stall verdict: {verdicts[-1]}"
    slow = [state["straggler"] for state in states if state.get("straggler")]
    silent = [state["rank"] for state in states if not state.get("answered", True)]
    if silent:
        return f"{_ranks(silent)} did not answer: stuck holding the GIL, or gone."
    traced = [state for state in states if state.get("tracing")]
    waiting = [state["rank"] for state in traced if state["communicating"]]
    if waiting and len(waiting) < len(traced):
        others = [f"rank {state['rank']}" + (f" (in {state['module']} {state['pass']})".replace(" )", ")")
                                             if state["module"] or state["pass"] else "")
                  for state in traced if not state["communicating"]]
        return f"{_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in a collective; not communicating: " \
               f"{', '.join(others)}."
    if slow:
        return f"Straggler verdict: {slow[-1]}"
    return "No stall verdict; every answering rank is making progress or waiting together."


def _ranks(ranks: list[int]) -> str:
    return ranks_text(ranks).capitalize()


class CommDebugPage(DebugHandler):  # type: ignore[valid-type, misc]  # (torch's class, found at run time)
    """torch debug server handler: ``/commdebug`` (the page) and ``/commdebug_json`` (every rank's answer)."""

    def routes(self) -> list[Any]:
        return [Route("/commdebug", self._handle), Route("/commdebug_json", self._handle_json)]

    def nav_links(self) -> list[Any]:
        return [NavLink("/commdebug", "commdebug-otel")]

    def templates(self) -> dict[str, str]:
        return {"commdebug.html": PAGE_TEMPLATE}

    def ask(self) -> tuple[int, list[dict[str, Any]]]:
        """Ask every rank; returns (ask number, one answer per rank, ``{"rank", "answered": False}`` for a rank
        that did not answer within :data:`ANSWER_TIMEOUT_S` or ``fetch_timeout``, whichever is shorter)."""
        store, world_size = debug_server_store(STORE_PREFIX)
        asked = int(store.add("asks", 1)) - 1
        store.set(f"ask/{asked}", "1")
        if asked:
            store.delete_key(f"ask/{asked - 1}")
        keys = [f"r/{asked}/{rank}" for rank in range(world_size)]
        deadline = time.monotonic() + min(ANSWER_TIMEOUT_S, self.fetch_timeout)
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        states = []
        for rank, key in enumerate(keys):
            if store.check([key]):
                states.append(json.loads(store.get(key)))
            else:
                states.append({"rank": rank, "answered": False})
        return asked, states

    def _handle_json(self, req: Any) -> bytes:
        _, states = self.ask()
        return json.dumps(states, indent=1).encode()

    def _handle(self, req: Any) -> bytes:
        _, states = self.ask()
        return req.frontend.render_template(
            "commdebug.html", answer=answer_line(states), rows=[_row(state) for state in states],
            asked=time.strftime("%H:%M:%S"), world=len(states),
            answered=sum(1 for state in states if state.get("answered", True)),
            timeout=min(ANSWER_TIMEOUT_S, self.fetch_timeout))


def debug_handlers(defaults: bool = True) -> list[Any]:
    """The handlers to give ``torch.distributed.debug.start_debug_server(handlers=...)``: torch's defaults
    (``defaults``) and :class:`CommDebugPage`. Call it on every rank: it starts this rank's answering thread.

    Raises:
        ImportError: without torch's debug-server dependencies (``pip install '.[debug-server]'``).
    """
    handlers = debug_server_default_handlers() if defaults else []
    _answer_on_this_rank()
    return [*handlers, CommDebugPage()]
