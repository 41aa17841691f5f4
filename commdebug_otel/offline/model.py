"""The one model of spans that ``summarize``, ``diagnose`` and ``perfetto`` read: a span index, steps,
collective events, their matching across ranks, and what a collective's arrival is.

Spans are the dicts :class:`.otlp_json.SpanReader` yields (or any dicts with the same keys:
``rank``, ``trace_id``, ``span_id``, ``parent_span_id``, ``name``, ``start_ns``, ``end_ns``,
``attributes``, ``events``).

* :class:`SpanIndex`: parents, children and training step of every span, built in one pass
  without recursion. A span whose parent is not among the spans is a root; so is a span that
  is its own parent, and where parents form a loop, the span where a walk up the loop first
  comes back (its parent link is dropped): walks always end, whatever the files say.
* :attr:`CollectiveEvent.issued_ns`: a collective's **arrival**, when its rank's CPU began issuing it. The
  event is stamped when the call returned; the issue duration is taken off. Both commands
  measure lateness on arrivals: the time the others waited for this rank (docs/diagnosis.md).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import statistics
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

from commdebug_otel import semconv
from commdebug_otel.core.fact import P2P

__all__ = ["P2P", "Arrivals", "CollectiveEvent", "SpanIndex", "arrival_matches", "collective_events", "column",
           "counted_seqs", "finished_spans", "index_of", "is_complete", "is_snapshot", "once", "own_step", "p2p_pairs",
           "reusing", "warmup_step", "warmup_steps"]

_T = TypeVar("_T")
_REUSED: ContextVar[dict | None] = ContextVar("commdebug_otel_offline_reused", default=None)


@contextlib.contextmanager
def reusing(own: bool = False) -> Iterator[None]:
    """Within it, :func:`once` computes each result once per list of spans (the same list object):
    for one command's reading and views of spans that do not change while they run (a 1,024-rank
    job's span index takes seconds to build). Python's cycle collector is paused meanwhile: span
    dicts form no cycles, and with millions of them alive each full collection walks them all
    (a quarter of ``diagnose``'s time on a 64-rank job). Nested, it keeps the outer one's results;
    ``own``: results of its own, dropped at its end (a reader's worker process, forked inside the
    command's, would otherwise keep every file's)."""
    if _REUSED.get() is not None and not own:
        yield
        return
    token = _REUSED.set({})
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        _REUSED.reset(token)
        if collecting:
            gc.enable()


def once(name: str, spans: list, compute: Callable[[], _T]) -> _T:
    """``compute()``, or within :func:`reusing` what it returned for ``name`` and this ``spans`` list before."""
    memo = _REUSED.get()
    if memo is None:
        return compute()
    key = (name, id(spans))
    if key not in memo:
        memo[key] = (spans, compute())  # holding the list keeps its id its own
    return memo[key][1]


def index_of(spans: list[dict]) -> SpanIndex:
    """``SpanIndex(spans)``, built once per list within :func:`reusing`."""
    return once("index", spans, lambda: SpanIndex(spans))


def own_step(span: dict) -> int | None:
    """The ``torch.step`` of a ``train_step`` span; None for any other span."""
    value = span["attributes"].get(semconv.STEP)
    return value if span["name"] == semconv.SPAN_TRAIN_STEP and isinstance(value, int) else None


#: A traced step right after the first that took more than this many times the median step (its slowest rank's
#: ``train_step``) is still warming up (FSDP2's lazy init, allocator growth, autotuning, a compile).
WARMUP_SLOWER = 1.5


def warmup_step(spans: list[dict]) -> int | None:
    """The last step both commands leave out of stragglers by default, with every traced step before it: the first
    traced step (the lowest ``torch.step`` of a finished ``train_step``), and the traced steps right after it
    that took more than :data:`WARMUP_SLOWER` times the median step, at most a quarter of the steps; None when
    the files hold one step.

    Ranks start the first step at different times (process start-up, loading) and run it cold (allocator,
    autotuning, first exports), so its lateness is start-up skew, not a straggler: torchtitan's
    healthy runs showed 0.35 to 0.63 s there; DeepSpeed's 0.40 s injected delay read 0.627 s. FSDP2 ran its
    next two steps at 2 to 4 times the later ones on CPU. Collectives before any step are never matched as
    stragglers either.
    """
    return once("warmup_step", spans, lambda: _warmup_step(spans))


def warmup_steps(spans: list[dict]) -> list[int]:
    """The traced steps :func:`warmup_step` leaves out, sorted (``[]`` when none)."""
    last = warmup_step(spans)
    if last is None:
        return []
    return sorted({step for span in spans if not is_snapshot(span) and (step := own_step(span)) is not None
                   and step <= last})


def _warmup_step(spans: list[dict]) -> int | None:
    steps: set[int] = set()
    took: dict[int, int] = {}  # step -> its slowest rank's train_step (ns)
    for span in spans:
        if is_snapshot(span) or (step := own_step(span)) is None:
            continue
        steps.add(step)
        if span["name"] == semconv.SPAN_TRAIN_STEP and span.get("end_ns"):
            took[step] = max(took.get(step, 0), span["end_ns"] - span["start_ns"])
    if len(steps) <= 1:
        return None
    ordered = sorted(steps)
    last = ordered[0]
    if len(took) >= 4:
        median = statistics.median(took.values())
        for step in ordered[1:len(ordered) // 4 + 1]:
            if took.get(step, 0) <= WARMUP_SLOWER * median:
                break
            last = step
    return last


def _root_step(span: dict) -> int | None:
    """The step of a span under no other: the ``root_step`` a folding reader gave it (its parents folded
    away, :class:`.otlp_json.SpanReader`), else its own."""
    known = span.get("root_step")
    return known[0] if known else own_step(span)


def process_of(resource: dict) -> tuple[str, str]:
    """The process a span's ``resource`` names: ``(host.name, process.pid)`` as text ("None" where missing); a rank
    with spans of two processes holds two runs."""
    return str(resource.get(semconv.HOST_NAME)), str(resource.get(semconv.PROCESS_PID))


def is_snapshot(span: dict) -> bool:
    """A span of a stall snapshot: the ``stalled`` span, or a copy of a step's spans so far
    (the step's own export, if it ever ended, has them all again)."""
    attributes = span["attributes"]
    return (span["name"] == semconv.SPAN_STALLED or semconv.STALL_SNAPSHOT in attributes
            or attributes.get(semconv.SPAN_INCOMPLETE) is True)


def finished_spans(spans: list[dict]) -> list[dict]:
    """The finished spans (no stall snapshot), a ``train_step_tail`` read as a root between steps: it runs after
    its ``train_step`` ended (a child clipped to its parent would vanish from a timeline), and the straggler
    windows count collectives of steps only. Read folded, it drops the ``root_step`` the reader gave it too
    (its ``train_step``'s: the tail is in no step). Within :func:`reusing`, made once per list."""
    return once("finished", spans, lambda: _finished_in(spans))


def _finished_in(spans: list[dict]) -> list[dict]:
    return [{**span, "parent_span_id": "", "root_step": ()} if span["name"] == semconv.SPAN_TRAIN_STEP_TAIL else span
            for span in spans if not is_snapshot(span)]


def is_complete(events: dict[int, CollectiveEvent]) -> bool:
    """A match (``{rank: event}``) that holds as many ranks as its group's size."""
    return len(events) == next(iter(events.values())).group_size


class SpanIndex:
    """Parents, children and training step of spans of any ranks, loops broken (see the module docstring).

    A span's parent is the span of the same rank and trace whose id is its ``parent_span_id``.
    Building it is linear in the spans; so is every walk.
    """

    def __init__(self, spans: list[dict]) -> None:
        by_id: dict[tuple, dict] = {}
        for span in spans:
            by_id.setdefault((span["rank"], span["trace_id"], span["span_id"]), span)
        parent: dict[int, dict | None] = {}
        children: dict[int, list[dict]] = defaultdict(list)
        for span in spans:
            found = by_id.get((span["rank"], span["trace_id"], span["parent_span_id"])) \
                if span["parent_span_id"] else None
            if found is span:
                found = None
            parent[id(span)] = found
            if found is not None:
                children[id(found)].append(span)
        self._parent = parent
        self._children = children
        self._steps: dict[int, int | None] = {}
        self._walk_down([span for span in spans if parent[id(span)] is None])
        if len(self._steps) < len(parent):  # spans no root reaches: parents form loops
            self._break_loops([span for span in spans if id(span) not in self._steps])
        self.roots: list[dict] = [span for span in spans if parent[id(span)] is None]

    def _walk_down(self, roots: list[dict]) -> None:
        """The step of every span under ``roots``, each root's own."""
        steps, children = self._steps, self._children
        stack = [(root, _root_step(root)) for root in roots]
        while stack:
            span, step = stack.pop()
            steps[id(span)] = step
            below = children.get(id(span))
            if below:
                stack.extend([(child, step) for child in below])

    def _break_loops(self, spans: list[dict]) -> None:
        """Drop the parent link where a walk up from each of ``spans`` (in order; none reached from a root)
        first comes back to itself, and give the spans under it their steps."""
        parent = self._parent
        state: dict[int, bool] = {}  # id -> True while on the chain being walked, False once done
        cut = []
        for span in spans:
            chain = []
            node: dict | None = span
            while node is not None and id(node) not in state:
                state[id(node)] = True
                chain.append(node)
                node = parent[id(node)]
            if node is not None and state[id(node)]:  # came back to the chain: a loop
                self._children[id(parent[id(node)])].remove(node)
                parent[id(node)] = None
                cut.append(node)
            for item in chain:
                state[id(item)] = False
        self._walk_down(cut)

    def parent(self, span: dict) -> dict | None:
        """The span's parent span, or None for a root."""
        return self._parent[id(span)]

    def children(self, span: dict) -> list[dict]:
        """The span's children, in the order of the spans given."""
        return self._children.get(id(span), [])

    def step(self, span: dict) -> int | None:
        """The ``torch.step`` of the span's ``train_step`` root; None under any other root."""
        return self._steps[id(span)]

    def ancestors(self, span: dict) -> Iterator[dict]:
        """The span's parent, its parent's parent, ... up to its root."""
        node = self._parent[id(span)]
        while node is not None:
            yield node
            node = self._parent[id(node)]


def collective_events(spans: list[dict], rank: int | None = None) -> list[CollectiveEvent]:
    """Collective events (those with ``torch.collective.op``), oldest first (by the time the call returned).

    Returns:
        :class:`CollectiveEvent` of each. Within :func:`reusing`, every rank's are found once per list (do not
        change the list returned).
    """
    if rank is None:
        return once("collective_events", spans, lambda: _collective_events(spans, None))
    return _collective_events(spans, rank)


def _collective_events(spans: list[dict], rank: int | None) -> list[CollectiveEvent]:
    found = []
    for order, span in enumerate(spans):
        if rank is not None and span["rank"] != rank:
            continue
        for number, event in enumerate(span["events"]):
            if semconv.COLLECTIVE_OP in event["attributes"]:
                found.append((event["time_ns"], order, number, event, span))
    found.sort()  # (time, order, number) are never equal: the dicts are never compared
    return [CollectiveEvent(span["rank"], time_ns, event["name"], event["attributes"], span)
            for time_ns, _, _, event, span in found]


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class CollectiveEvent:
    """One exported collective event, as every offline command reads it: the one place that decodes its
    attributes (a 1,024-rank job has half a million: a slotted record, each field read from the exported
    attributes when asked, holds no copy of them).

    ``rank``; ``time_ns``: when the call returned (the event's time); ``name``: the op (the event's name);
    ``attributes``: as exported (read back by ``otlp_json``); ``span``: the owning span dict. What an event leaves
    out reads as unknown: ``""``, ``()``, 0, None.
    """

    __slots__ = ("attributes", "name", "rank", "span", "time_ns")

    def __init__(self, rank: int, time_ns: int, name: str, attributes: Mapping[str, Any], span: dict) -> None:
        self.rank = rank
        self.time_ns = time_ns
        self.name = name
        self.attributes = attributes
        self.span = span

    @property
    def op(self) -> str:
        """``torch.collective.op`` (the event's name where missing)."""
        return str(self.attributes.get(semconv.COLLECTIVE_OP, self.name))

    @property
    def overload(self) -> str:
        """The dispatcher op (``torch.op.name``; the event's name where missing)."""
        return str(self.attributes.get(semconv.OP_NAME, self.name))

    @property
    def group(self) -> str:
        """Its process group's name ("" when not recorded)."""
        return str(self.attributes.get(semconv.PROCESS_GROUP_NAME, ""))

    @property
    def group_size(self) -> int:
        """``torch.process_group.size`` (1 when not recorded)."""
        return int(self.attributes.get(semconv.PROCESS_GROUP_SIZE, 1))

    @property
    def seq(self) -> int | None:
        """``torch.collective.seq``: collectives the rank issued on the group before (send/recv counted); None
        when not recorded (or not an integer)."""
        return _integer(self.attributes.get(semconv.COLLECTIVE_SEQ))

    @property
    def peer(self) -> int | None:
        """A send's destination or a recv's source, a rank in the group; None when not recorded (or not an
        integer)."""
        return _integer(self.attributes.get(semconv.COLLECTIVE_PEER))

    @property
    def nbytes(self) -> int:
        """Payload bytes (``torch.collective.bytes``; 0 when not recorded)."""
        return int(self.attributes.get(semconv.COLLECTIVE_BYTES, 0) or 0)

    @property
    def dtype(self) -> str:
        """The payload's dtype ("" when not recorded)."""
        return str(self.attributes.get(semconv.COLLECTIVE_DTYPE, ""))

    @property
    def shape(self) -> Sequence[int]:
        """The payload's shape as exported (``()`` when not recorded)."""
        return self.attributes.get(semconv.COLLECTIVE_SHAPE, ())

    @property
    def reduce_op(self) -> str:
        """``sum``... ("" when none)."""
        return str(self.attributes.get(semconv.COLLECTIVE_REDUCE_OP, ""))

    @property
    def module(self) -> str | None:
        """The owning module's FQN as the event says it (None when it says none: its span's, if any)."""
        fqn = self.attributes.get(semconv.MODULE_FQN)
        return None if fqn is None else str(fqn)

    @property
    def pass_(self) -> str | None:
        """``torch.module.pass`` as the event says it (None when it says none)."""
        pass_ = self.attributes.get(semconv.MODULE_PASS)
        return None if pass_ is None else str(pass_)

    @property
    def fake(self) -> bool:
        """A FakeTensor or meta-device payload: no traffic."""
        return self.attributes.get(semconv.COLLECTIVE_FAKE) is True

    @property
    def duration_s(self) -> float:
        """The CPU time spent issuing it (``torch.collective.issue_duration_s``; 0.0 when not recorded)."""
        return float(self.attributes.get(semconv.COLLECTIVE_DURATION, 0.0))

    @property
    def issued_ns(self) -> int:
        """Its arrival (ns since the epoch): when the CPU began issuing the op. The event is stamped when the call
        returned; ``torch.collective.issue_duration_s`` is taken off."""
        return self.time_ns - round(self.duration_s * 1e9)


def counted_seqs(events: Iterable[CollectiveEvent]) -> Iterator[tuple[CollectiveEvent, str, int | None]]:
    """Each of ``events`` (collective events in the order their ranks issued them) with its process group name
    and its seq counted without point-to-point ops: the key that matches one collective across ranks.

    ``torch.collective.seq`` counts send/recv too, and pipeline stages issue different numbers of them, so
    each rank's send/recv before a collective on its group are taken off. The seq is None for
    ``send``/``recv``/``batch_p2p`` (:data:`P2P`) and for events without a seq.
    """
    p2p_before: Counter = Counter()  # (rank, group) -> point-to-point ops issued so far
    for event in events:
        group, seq = event.group, event.seq
        if event.name in P2P:
            p2p_before[(event.rank, group)] += 1
            seq = None
        elif seq is not None:
            seq -= p2p_before[(event.rank, group)]
        yield event, group, seq


class Arrivals:
    """One rank's collectives, in the order it issued them, as the straggler model (:mod:`.stragglers`) matches
    and windows them: columns of one value per collective event (8 bytes each where they fit).

    ``events``: the rank's events as :func:`collective_events` orders them; ``steps``: their spans' index;
    ``step_starts``: ``{step: its train_step's start}`` (for :meth:`window_start`).

    ``groups``, ``seqs`` (the seq counted without send/recv, :func:`counted_seqs`; None for
    send/recv and events without a seq), ``issued`` (:attr:`CollectiveEvent.issued_ns`), ``returned`` (the event's
    time), ``steps`` (of its span; None outside steps), ``sizes`` (its group's size), ``peers``
    (``(op, peer's group rank)`` of a ``send`` or ``recv`` with a peer, else None: :func:`p2p_pairs`).
    """

    def __init__(self, events: list[CollectiveEvent], steps: SpanIndex, step_starts: dict[int, int]) -> None:
        groups, seqs, issued, returned, in_steps, sizes, peers = [], [], [], [], [], [], []
        for event, group, seq in counted_seqs(events):
            peer = event.peer
            peers.append((event.name, peer) if event.name in (semconv.SEND, semconv.RECV) and peer is not None
                         else None)
            groups.append(group)
            seqs.append(seq)
            issued.append(event.issued_ns)
            returned.append(event.time_ns)
            in_steps.append(steps.step(event.span))
            sizes.append(event.group_size)
        self.groups, self.seqs, self.steps, self.sizes, self.peers = groups, seqs, in_steps, sizes, peers
        #: Its sends and recvs (pipeline waits pair them).
        self.p2p = sum(event.name in (semconv.SEND, semconv.RECV) for event in events)
        self.issued, self.returned = column(issued), column(returned)
        # Arrivals by time (a step None before an int where times tie), to find the window before one.
        order = sorted(range(len(issued)), key=lambda i: (issued[i], in_steps[i] is not None, in_steps[i] or 0))
        self._times = column([issued[i] for i in order])
        self._time_steps = [in_steps[i] for i in order]
        self._step_starts = step_starts

    def window_start(self, arrival: int, step: int) -> int:
        """The previous arrival when it lies in this step or the one before, else the step's start."""
        i = bisect.bisect_left(self._times, arrival)
        if i > 0 and self._time_steps[i - 1] in (step, step - 1):
            return self._times[i - 1]
        return min(self._step_starts.get(step, arrival), arrival)


def arrival_matches(tables: dict[int, Arrivals], skip: Callable[[int | None], bool],
                    steps: Mapping[int, Sequence[int | None]] | None = None) -> list[list[tuple[int, int, int]]]:
    """The same collective on every rank, from the ranks' columns: by (group, seq counted without send/recv,
    :func:`counted_seqs`), a rank's first event of each; send/recv, events
    without a seq and those whose step ``skip(step)`` says are left out. ``steps``: each rank's step of each
    collective, in place of its table's ``steps``.

    Returns:
        each match as ``[(time returned, rank, index in its columns)]``, unordered (sorted, a match's events and
        the matches by their first are in the order of the events; the first one's ``tables[rank].sizes[index]``
        is the group's size).
    """
    matches: dict[tuple[str, int], list[tuple[int, int, int]]] = defaultdict(list)
    for rank, table in tables.items():
        seen: set[tuple[str, int]] = set()
        in_steps = table.steps if steps is None else steps[rank]
        for i, (group, seq, step) in enumerate(zip(table.groups, table.seqs, in_steps, strict=True)):
            if seq is None or (group, seq) in seen or skip(step):
                continue
            seen.add((group, seq))
            matches[(group, seq)].append((table.returned[i], rank, i))
    return list(matches.values())


def p2p_pairs(tables: dict[int, Arrivals]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each ``send`` with its ``recv``, from the ranks' columns: the n-th send from rank A to rank B on a process
    group and the n-th recv on B from A on it (as :func:`.summary.pipeline_waits` pairs them). A peer is a
    group rank: a group is mapped to global ranks where every member is in ``tables`` (torch sorts a group's
    ranks), or it is as large as ``tables`` (the world); sends and recvs of other groups are not paired.

    Returns:
        ``[((sender, index in its columns), (receiver, index in its columns))]``, in no particular order.
    """
    seen: dict[str, set[int]] = defaultdict(set)
    sizes: dict[str, int] = {}
    for rank, table in tables.items():
        for group, size in zip(table.groups, table.sizes, strict=True):
            seen[group].add(rank)
            sizes[group] = size
    members = {group: sorted(ranks) if len(ranks) == sizes[group] else
               sorted(tables) if sizes[group] == len(tables) else None for group, ranks in seen.items()}
    queues: dict[tuple[str, int, int], tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for rank, table in tables.items():
        for i, peer in enumerate(table.peers):
            if peer is None:
                continue
            op, peer_rank = peer
            ranks = members.get(table.groups[i])
            if ranks is None or not 0 <= peer_rank < len(ranks):
                continue
            if op == semconv.SEND:
                queues[(table.groups[i], rank, ranks[peer_rank])][0].append(i)
            else:
                queues[(table.groups[i], ranks[peer_rank], rank)][1].append(i)
    return [((sender, send), (receiver, recv)) for (_, sender, receiver), (sends, recvs) in queues.items()
            for send, recv in zip(sends, recvs, strict=False)]


def column(values: list[int]) -> Sequence[int]:
    """``values`` in 8 bytes each (an ``array``), or as they are where one does not fit in 64 bits."""
    try:
        return array("q", values)
    except OverflowError:
        return values
