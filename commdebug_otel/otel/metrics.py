"""Collective metrics: operation and byte counters, an issue-time histogram, and drop counters.

Instruments (OTel name -> Prometheus name after the Collector's translation):

* ``torch.collective.operations`` Counter ``{operation}`` -> ``torch_collective_operations_total``
* ``torch.collective.io`` Counter ``By`` -> ``torch_collective_io_bytes_total``
* ``torch.collective.duration`` Histogram ``s`` -> ``torch_collective_duration_seconds_*``:
  the time the CPU spent issuing the collective (for gloo and blocking
  c10d calls this includes the transfer; for async work it does not), on
  timed steps: those ``trace_every`` picks, one in ``completion_every``, and
  between steps (an SDK record per collective cost about 1 % of an untraced step; its
  count is a sample of the operations, whose counters cover every step).
* ``torch.collective.completion_duration`` Histogram ``s`` -> ``torch_collective_completion_duration_seconds_*``:
  from issue to completion, for c10d collectives (their ``Work`` future completes
  without anyone waiting) on the steps ``trace_every`` picks, one in ``completion_every`` and between steps;
  functional collectives complete at ``wait_tensor`` and are not timed here.
* ``commdebug.telemetry.dropped`` Counter ``{item}`` -> ``commdebug_telemetry_dropped_total``
* ``torch.step.duration`` Histogram ``s`` -> ``torch_step_duration_seconds_*``: each optimizer
  step's wall time, on every step, per rank.
* ``torch.step.collective_wait`` Histogram ``s`` -> ``torch_step_collective_wait_seconds_*``: time
  the training thread spent blocked waiting for collectives in each step (``Work.wait()``,
  ``wait_tensor``); the straggler is the rank that waits least while the others wait for it.
* ``torch.step.age`` Gauge ``s`` -> ``torch_step_age_seconds``: how long the current step (or,
  between steps, the gap since the last one) has lasted, read at each export: a stuck rank's grows.
* ``torch.collective.seq.issued`` / ``torch.collective.seq.completed`` Gauges, per process group:
  the last seq this rank issued / knows complete (stall/watchdog.py); a stuck rank's line stays flat and behind.
* ``commdebug.straggler.lost`` Gauge ``s`` -> ``commdebug_straggler_lost_seconds``: from rank 0 only, per rank
  the live straggler verdict named (``torch.distributed.rank`` is the slow rank's, whatever
  ``metric_rank_label``), seconds per step the other ranks wait on it; 0 once it recovered (stall/straggler.py).

Labels are low-cardinality only: op, pass, process group name and size, mesh
dimension name, rank, and the module FQN cut to ``metric_module_depth``
levels when that setting is above 0. Never shapes or step numbers. Without the
rank label (``metric_rank_label``: off, or auto past
``config.METRIC_RANK_LABEL_AUTO_MAX_WORLD`` ranks) a group that is a device-mesh
dimension is named by its dimension name and size alone: its process group name
differs from one group of that dimension to the next (a job of W ranks with
tensor parallel of size T has W/T tensor-parallel groups), so the label sets are
the same on every rank and a job's series do not grow with its size once summed
across ranks. Exemplars still name the rank's span.

The training thread only appends each point, as a tuple, to a deque; at a
traced step's end (an untraced one's at most once a second: ``step_lifecycle.QUIET_FLUSH_NS``)
a :class:`MetricsWorker` thread labels them, sums the counters and
makes the SDK calls (an SDK ``Histogram.record`` costs tens of microseconds,
more than the rest of a collective's bookkeeping together, and in a running job
any Python is several times slower scattered between the step's ops than in one
loop). When no take has come for ``IDLE_TAKE_S`` seconds, the worker takes what
is pending itself: a rank stuck in a hung collective still exports the counts that led
there, and completion times that arrive after the last step are not stranded.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import weakref
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from commdebug_otel import semconv
from commdebug_otel.core.fact import CollectiveFact, GroupFacts, group_labels, metric_labels
from commdebug_otel.core.redact import describe, valid_text
from commdebug_otel.core.thread_signals import start_quiet
from commdebug_otel.otel._sdk import exemplar_draws

# Collective issue times span microseconds (in-process) to seconds (slow ranks).
DURATION_BUCKETS_S = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05,
                      0.1, 0.5, 1.0, 5.0, 10.0)


# Step times span milliseconds (small CPU jobs) to minutes (large models, stalls).
STEP_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                  60.0, 120.0, 300.0, 600.0)


# Pending counter sums are flushed at least this often, so long stretches without a step
# boundary (evaluation, set-up) still export.
FLUSH_EVERY_COLLECTIVES = 256
# Points waiting for the worker beyond this are dropped and counted (a stalled SDK must not
# grow memory without bound).
MAX_PENDING_POINTS = 1_000_000
# An idle worker takes what is pending itself this often (seconds): a training thread stuck in
# a hung collective never reaches its flush, and those counts are what a hang needs.
IDLE_TAKE_S = 1.0

_logger = logging.getLogger(__name__)


_STOP = object()  # ends a MetricsWorker's thread


class MetricsWorker:
    """A daemon thread that runs the calls handed over, in order.

    ``submit`` costs the training thread one queue put; ``drain`` waits (bounded)
    until everything submitted before it has been recorded; ``on_idle()`` runs
    whenever the queue stays empty for ``IDLE_TAKE_S`` seconds. The thread starts
    here: :class:`CollectiveMetrics` is made at the first point (``LazyCollectiveMetrics``),
    so a forked child that never records starts none. :meth:`stop` ends it (its tracer
    stopped); a call submitted after that starts it again.
    """

    def __init__(self, on_idle: Any = None) -> None:
        self._on_idle = on_idle
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="commdebug-otel-metrics", daemon=True)
                start_quiet(self._thread)

    def submit(self, call: Any) -> None:
        """Queue ``call()``."""
        self._queue.put(call)
        if self._thread is None:
            self._start()

    def stop(self, timeout_s: float) -> bool:
        """Run what was submitted so far, then end the thread; wait at most ``timeout_s``. True if it ended."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return True
            self._queue.put(_STOP)
        if thread is not threading.current_thread():
            thread.join(timeout_s)
        return not thread.is_alive()

    def _run(self) -> None:
        failed = False
        while True:
            try:
                call = self._queue.get(timeout=IDLE_TAKE_S)
            except queue.Empty:
                call = self._on_idle
                if call is None:
                    continue
            if call is _STOP:
                return
            try:
                call()
            except Exception as error:  # the SDK failed: say it once, keep the thread alive
                if not failed:
                    failed = True
                    _logger.warning("commdebug-otel: recording metrics failed (%s)",
                                    describe(error))

    def drain(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the calls submitted so far. True if they all ran."""
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout_s)


def dropped_counter(meter: Meter) -> Any:
    """``commdebug.telemetry.dropped`` on ``meter`` (the SDK returns the same instrument each time)."""
    return meter.create_counter(semconv.METRIC_DROPPED, unit="{item}",
                                description="Telemetry that commdebug-otel had to drop, by kind.")


_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class _SpanContexts:
    """The OTel context of a span named by ``(trace id, span id)``, made once per span in one take:
    a module's collectives come one after another, so the last one is kept."""

    __slots__ = ("_context", "_ref")

    def __init__(self) -> None:
        self._ref: tuple[int, int] | None = None
        self._context: Any = None

    def __call__(self, ref: tuple[int, int] | None) -> Any:
        if ref is None:
            return None
        if ref != self._ref:
            trace_id, span_id = ref
            self._context = set_span_in_context(NonRecordingSpan(SpanContext(
                trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)))
            self._ref = ref
        return self._context


class CollectiveMetrics:
    """Records collective metrics on ``meter``; label dicts are cached per label tuple."""

    def __init__(self, meter: Meter, module_depth: int = 0, on_dropped: Any = None,
                 rank_label: bool = True, progress: Any = None, straggler_lost: Any = None) -> None:
        """``progress``: ``() -> (rank, step age s, Progress.seqs())`` for the progress gauges;
        ``straggler_lost``: ``() -> {rank: s per step}`` for ``commdebug.straggler.lost`` (None: no points)."""
        self._module_depth = module_depth
        self._straggler_lost = straggler_lost or dict
        self._rank_label = rank_label
        # Exemplars only where offering one leaves the script's random numbers alone (an injected provider's
        # default reservoir for sums draws from the global random): else the points go without their context.
        draws = exemplar_draws(meter)
        self._sum_exemplars, self._histogram_exemplars = not draws[0], not draws[1]
        self._operations = meter.create_counter(
            semconv.METRIC_OPERATIONS, unit="{operation}",
            description="Collectives issued by this rank.")
        self._io = meter.create_counter(
            semconv.METRIC_IO, unit="By",
            description="Input payload bytes of the collectives issued by this rank.")
        self._duration = meter.create_histogram(
            semconv.METRIC_DURATION, unit="s",
            description="CPU time spent issuing each collective.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        self._completion = meter.create_histogram(
            semconv.METRIC_COMPLETION, unit="s",
            description="Time from issuing a c10d collective to its Work completing.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        self._dropped = dropped_counter(meter)
        self._step_duration = meter.create_histogram(
            semconv.METRIC_STEP_DURATION, unit="s", description="Wall time of each optimizer step.",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS_S)
        self._step_wait = meter.create_histogram(
            semconv.METRIC_STEP_WAIT, unit="s",
            description="Time the training thread waited for collectives to complete, per step.",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS_S)
        self._steps: collections.deque = collections.deque()
        if progress is not None:
            self._progress = progress
            _ProgressGauges.on(meter).attach(self)
        self._labels: dict[tuple, dict[str, Any]] = {}  # the worker's only
        # Points as the training thread saw them, labelled and summed by the worker: a deque
        # because any thread appends (backend threads add completions) while the worker pops.
        self._points: collections.deque = collections.deque()
        self._completions: collections.deque = collections.deque()
        self._unflushed = 0
        self._take_queued = False
        self._on_dropped = on_dropped or (lambda kind, count: None)
        # Last: its thread may take pending points as soon as it runs.
        self._worker = MetricsWorker(self._record_pending)

    def step(self, duration_s: float, wait_s: float, rank: int, span_ref: tuple[int, int] | None = None) -> None:
        """One step ended: ``duration_s`` long, ``wait_s`` of it waiting for collectives (recorded at the flush).

        ``span_ref``: the traced step's ``(trace id, span id)``, for exemplars; None on untraced steps.
        """
        self._steps.append((duration_s, wait_s, self._rank_labels(rank), span_ref))

    def _rank_labels(self, rank: int) -> dict[str, Any]:
        """The rank label of every instrument, or none (``rank_label`` off)."""
        return {semconv.RANK: rank} if self._rank_label else {}

    # The gauges' callbacks (through _ProgressGauges): run by the metric reader's thread at each collection.
    def _observe_age(self, _options: CallbackOptions) -> list[Observation]:
        rank, age_s, _ = self._progress()
        return [Observation(age_s, self._rank_labels(rank))]

    def _observe_issued(self, _options: CallbackOptions) -> list[Observation]:
        return self._observe_seq(1)

    def _observe_completed(self, _options: CallbackOptions) -> list[Observation]:
        return self._observe_seq(2)

    def _observe_straggler(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(lost_s, {semconv.RANK: rank}) for rank, lost_s in sorted(self._straggler_lost().items())]

    def _observe_seq(self, which: int) -> list[Observation]:
        rank, _, seqs = self._progress()
        return [Observation(entry[which], {**self._rank_labels(rank),
                                           **group_labels(entry[0], entry[3], self._rank_label)})
                for entry in seqs if entry[which] >= 0]

    def _module_label(self, fqn: str) -> str:
        return ".".join(fqn.split(".")[: self._module_depth + 1])

    def collective(self, fact: CollectiveFact, rank: int, duration_s: float | None,
                   span_ref: tuple[int, int] | None = None) -> None:
        """Count one collective (``fact.nbytes`` payload bytes, labelled by its op, pass, group and module) that
        took ``duration_s`` seconds to issue (None on a step that is not timed: counted, without a
        ``torch.collective.duration`` point).

        ``span_ref`` (the owning span's ``(trace id, span id)``; the worker makes its OTel context) makes the
        SDK attach exemplars that link these points to the traced step's span, where offering
        one leaves the global ``random`` alone (``_sdk.exemplar_draws``). Beyond
        ``MAX_PENDING_POINTS`` waiting for the worker, the point is dropped and counted.
        """
        points = self._points
        if len(points) >= MAX_PENDING_POINTS:
            self._on_dropped(semconv.DROPPED_KIND_METRIC, 1)
            return
        points.append((fact, rank, duration_s, span_ref))
        self._unflushed += 1
        if self._unflushed >= FLUSH_EVERY_COLLECTIVES:
            self.flush()

    def _labels_of(self, op: str, pass_: str, group: GroupFacts, rank: int, fqn: str) -> dict[str, Any]:
        module = self._module_label(fqn) if self._module_depth and fqn else ""
        key = (op, pass_, group.name, group.dim_name, rank, module)  # a mesh made later names the group
        labels = self._labels.get(key)
        if labels is None:  # names from the script made valid Unicode: OTLP strings are UTF-8
            labels = self._labels[key] = metric_labels(op, pass_, group, self._rank_labels(rank), module, valid_text)
        return labels

    def completion(self, fact: CollectiveFact, rank: int, duration_s: float) -> None:
        """Record that ``fact``'s c10d collective completed ``duration_s`` seconds after it was issued.

        Called from the backend's completion callback thread (gloo's worker, NCCL's
        watchdog), which must not be held up: the point waits for the next flush, and
        the SDK call is left to the worker (a hand-over per completion, waking the
        worker each time, cost more than the rest of an untraced collective).
        """
        if len(self._completions) >= MAX_PENDING_POINTS:
            self._on_dropped(semconv.DROPPED_KIND_METRIC, 1)
            return
        self._completions.append((fact, rank, duration_s))

    def flush(self) -> None:
        """Have the worker record the pending points (at a step end, and every few hundred collectives)."""
        self._unflushed = 0
        if not self._take_queued and (self._points or self._completions or self._steps):
            self._take_queued = True  # one take in the queue at a time: it takes everything
            self._worker.submit(self._record_pending)

    def _record_pending(self) -> None:
        """On the worker: label, sum and record every point appended so far (popped one by one,
        so appends from other threads meanwhile wait for the next take, never vanish)."""
        self._take_queued = False
        sums: dict[int, list] = {}
        points, record, span_context = self._points, self._duration.record, _SpanContexts()
        for _ in range(len(points)):
            fact, rank, duration_s, ref = points.popleft()
            context = span_context(ref)
            labels = self._labels_of(fact.op, fact.pass_, fact.group, rank, fact.fqn)
            entry = sums.get(id(labels))
            if entry is None:
                entry = sums[id(labels)] = [labels, 0, 0, None]
            entry[1] += 1
            entry[2] += fact.nbytes
            if context is not None:
                entry[3] = context
            if duration_s is not None:  # a timed step's
                record(duration_s, labels, context=context if self._histogram_exemplars else None)
        for labels, count, nbytes, context in sums.values():
            context = context if self._sum_exemplars else None
            self._operations.add(count, labels, context=context)
            self._io.add(nbytes, labels, context=context)
        steps = self._steps
        for _ in range(len(steps)):
            duration_s, wait_s, labels, ref = steps.popleft()
            context = span_context(ref) if self._histogram_exemplars else None
            self._step_duration.record(duration_s, labels, context=context)
            self._step_wait.record(wait_s, labels, context=context)
        completions, record = self._completions, self._completion.record
        for _ in range(len(completions)):
            fact, rank, duration_s = completions.popleft()
            record(duration_s, self._labels_of(fact.op, fact.pass_, fact.group, rank, fact.fqn))

    def drain(self, timeout_s: float) -> bool:
        """Flush, then wait at most ``timeout_s`` until the worker has recorded everything."""
        self.flush()
        return self._worker.drain(timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Record everything pending, then end the worker thread, within ``timeout_s``. True if it ended."""
        self.flush()
        return self._worker.stop(timeout_s)

    def dropped(self, kind: str, count: int, rank: int) -> None:
        """Count ``count`` items of telemetry dropped on ``rank``, by ``kind`` (span, event, hook_error, ...).

        The rank is a label only where collective metrics carry it too (``rank_label``).
        """
        self._dropped.add(count, {semconv.DROPPED_KIND: kind, **self._rank_labels(rank)})


class _ProgressGauges:
    """The progress gauges of one meter, made once: the SDK keeps the callbacks of an instrument's first creation
    and ignores those of a later one of the same name, so gauges made by each tracer would read the first tracer
    forever (and keep it alive). They read the :class:`CollectiveMetrics` that attached last, weakly: nothing once
    it is gone."""

    _by_meter: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, meter: Meter) -> None:
        self._source: Any = lambda: None
        meter.create_observable_gauge(
            semconv.METRIC_STEP_AGE, [self._observe_age], unit="s",
            description="How long the current step (or the gap since the last one) has lasted.")
        meter.create_observable_gauge(
            semconv.METRIC_SEQ_ISSUED, [self._observe_issued], unit="{collective}",
            description="Seq of the last collective this rank issued, per process group.")
        meter.create_observable_gauge(
            semconv.METRIC_SEQ_COMPLETED, [self._observe_completed], unit="{collective}",
            description="Seq of the last collective this rank knows complete, per process group.")
        meter.create_observable_gauge(
            semconv.METRIC_STRAGGLER_LOST, [self._observe_straggler], unit="s",
            description="Seconds per step the other ranks wait on a rank the live straggler verdict named.")

    @classmethod
    def on(cls, meter: Meter) -> _ProgressGauges:
        with cls._lock:
            try:
                gauges = cls._by_meter.get(meter)
                if gauges is None:
                    gauges = cls._by_meter[meter] = cls(meter)
            except TypeError:  # a meter that takes no weak reference: its own gauges, as many as asked
                gauges = cls(meter)
            return gauges

    def attach(self, metrics: CollectiveMetrics) -> None:
        self._source = weakref.ref(metrics)

    # The callbacks: run by the metric reader's thread at each collection.
    def _observe_age(self, options: CallbackOptions) -> list[Observation]:
        metrics = self._source()
        return [] if metrics is None else metrics._observe_age(options)

    def _observe_issued(self, options: CallbackOptions) -> list[Observation]:
        metrics = self._source()
        return [] if metrics is None else metrics._observe_issued(options)

    def _observe_completed(self, options: CallbackOptions) -> list[Observation]:
        metrics = self._source()
        return [] if metrics is None else metrics._observe_completed(options)

    def _observe_straggler(self, options: CallbackOptions) -> list[Observation]:
        metrics = self._source()
        return [] if metrics is None else metrics._observe_straggler(options)


class LazyCollectiveMetrics:
    """Creates :class:`CollectiveMetrics` at the first record, when the rank is known.

    ``rank``: a callable returning this process's ``job_identity.RankInfo``. ``rank_label``: called
    with the job's world size at that first record, whether points carry the rank
    (``Settings.metric_rank_label_on``; default: always). ``ready``: whether the meter may
    start now (``Telemetry.metrics_ready``: not before the process group exists, in a job of
    several ranks); until then points are held, in order (at most ``MAX_PENDING_POINTS``,
    the rest counted as ``metric_point`` drops), and recorded when it may.
    """

    def __init__(self, meter_factory: Any, module_depth: int, rank: Any,
                 rank_label: Any = lambda world_size: True, progress: Any = None,
                 ready: Any = None, straggler_lost: Any = None) -> None:
        self._meter_factory = meter_factory
        self._rank = rank
        self._rank_label = rank_label
        self._progress = progress
        self._straggler_lost = straggler_lost
        self._module_depth = module_depth
        self._ready = ready
        self._metrics: CollectiveMetrics | None = None
        self._lock = threading.Lock()
        self._held: list[tuple[str, tuple, dict]] = []  # (method, args, kwargs) before the meter may start
        self._held_dropped = 0

    def _hold(self, method: str, args: tuple, kwargs: dict | None = None) -> None:
        if len(self._held) < MAX_PENDING_POINTS:
            self._held.append((method, args, kwargs or {}))
        else:
            self._held_dropped += 1

    def _get(self) -> CollectiveMetrics | None:
        """The instruments, or None while the meter may not start (``ready``)."""
        if self._metrics is not None:
            return self._metrics
        if self._ready is not None and not self._ready():
            return None
        with self._lock:
            if self._metrics is not None:
                return self._metrics
            try:
                meter = self._meter_factory()
            except Exception as error:  # e.g. an output folder we cannot create: say it once
                from opentelemetry.metrics import NoOpMeter

                _logger.warning("commdebug-otel: metrics are off: %s", describe(error, values=False))
                meter = NoOpMeter("commdebug_otel")
            self._metrics = CollectiveMetrics(meter, self._module_depth, self.dropped,
                                              self._rank_label(self._rank().world_size), self._progress,
                                              self._straggler_lost)
            metrics = self._metrics
            held, self._held = self._held, []
            for method, args, kwargs in held:  # what came before the meter could start, in order
                getattr(metrics, method)(*args, **kwargs)
            if self._held_dropped:
                metrics.dropped(semconv.DROPPED_KIND_METRIC, self._held_dropped, self._rank().rank)
                self._held_dropped = 0
            # From now on the recorder calls the instruments' methods directly.
            self.collective = metrics.collective  # type: ignore[method-assign]
            self.completion = metrics.completion  # type: ignore[method-assign]
        return metrics

    def collective(self, fact: CollectiveFact, rank: int, duration_s: float | None,
                   span_ref: tuple[int, int] | None = None) -> None:
        """As :meth:`CollectiveMetrics.collective` (held until the meter may start)."""
        metrics = self._get()
        if metrics is None:
            self._hold("collective", (fact, rank, duration_s, span_ref))
        else:
            metrics.collective(fact, rank, duration_s, span_ref)

    def completion(self, fact: CollectiveFact, rank: int, duration_s: float) -> None:
        """As :meth:`CollectiveMetrics.completion` (held until the meter may start)."""
        metrics = self._get()
        if metrics is None:
            self._hold("completion", (fact, rank, duration_s))
        else:
            metrics.completion(fact, rank, duration_s)

    def step(self, duration_s: float, wait_s: float, span_ref: tuple[int, int] | None = None) -> None:
        metrics = self._get()
        if metrics is None:
            self._hold("step", (duration_s, wait_s, self._rank().rank, span_ref))
        else:
            metrics.step(duration_s, wait_s, self._rank().rank, span_ref)

    def flush(self) -> None:
        if self._metrics is not None:
            self._metrics.flush()

    def drain(self, timeout_s: float) -> bool:
        """Flush and wait (at most ``timeout_s``) until every point is recorded in the SDK."""
        metrics = self._get() if self._held else self._metrics
        return metrics.drain(timeout_s) if metrics is not None else True

    def close(self, timeout_s: float) -> bool:
        """Record every point, then end the worker thread (the tracer stops), within ``timeout_s``.

        Returns False if the worker did not finish in time. A later point starts it again.
        """
        metrics = self._get() if self._held else self._metrics
        return metrics.close(timeout_s) if metrics is not None else True

    def reset(self) -> None:
        """Forget the instruments (a forked child gets its own meter and worker thread)."""
        self._metrics = None
        self._held, self._held_dropped = [], 0
        self._lock = threading.Lock()  # a fork may have copied it held
        self.__dict__.pop("collective", None)
        self.__dict__.pop("completion", None)

    def dropped(self, kind: str, count: int) -> None:
        metrics = self._get()
        if metrics is None:
            self._hold("dropped", (kind, count, self._rank().rank))
        else:
            metrics.dropped(kind, count, self._rank().rank)
