"""Span building: the records of a finished step become OTel spans, with their recorded times.

The recorder (``core/recorder.py``) hands over a step as root records plus a
``children`` map (``id(record) -> [records]``) once the step has ended; this
module turns it into spans and nothing else. Where the spans go (providers,
exporters, shutdown) is set up in ``otel/telemetry.py``.

Two paths build the same spans:

* our own ``TracerProvider``: finished ``ReadableSpan`` objects handed straight
  to its batch processors (:class:`_DirectSpans`), skipping the SDK's live
  ``Span``, which was 80% of a traced step's span-building cost;
* any other provider, another sampler, or a record with an error:
  ``Tracer.start_span`` with the recorded start and end times.

Trace ids of ``train_step`` roots and span ids that metric exemplars point at
are chosen by the recorder; :class:`StepIdGenerator` makes the SDK use them.
Every other id of a span built here comes from our own random source
(:mod:`.ids`), never from the script's global ``random``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from commdebug_otel import semconv
from commdebug_otel.core.ids import span_id as _new_span_id
from commdebug_otel.core.ids import trace_id as _new_trace_id
from commdebug_otel.core.records import span_attributes
from commdebug_otel.core.redact import exception_attributes, valid_text
from commdebug_otel.otel._sdk import instrumentation_scope, span_limits


class OwnIdGenerator(IdGenerator):
    """The SDK's ``RandomIdGenerator`` drawing from our own random source (:mod:`.ids`), not the global
    ``random``: the script's random numbers stay its own, and ranks seeded alike get distinct ids."""

    def generate_span_id(self) -> int:
        return _new_span_id()

    def generate_trace_id(self) -> int:
        return _new_trace_id()

    def is_trace_id_random(self) -> bool:
        return True


class StepIdGenerator(IdGenerator):
    """Random ids, except that a ``train_step`` root span can be given its trace id.

    Args:
        inner: the provider's generator, which keeps making the ids of the spans
            we do not build (None: :class:`OwnIdGenerator`, our own provider).

    ``own``: where the random ids of the spans we build come from:
    :class:`OwnIdGenerator` when ``inner`` is ours or makes its ids with the SDK's
    ``RandomIdGenerator`` methods (they draw from the script's global ``random``);
    ``inner`` itself when the user chose another kind (e.g. X-Ray's, whose ids
    have a form of their own).
    """

    def __init__(self, inner: IdGenerator | None = None) -> None:
        self._inner = inner or OwnIdGenerator()
        draws_global = all(getattr(type(self._inner), name, None) is getattr(RandomIdGenerator, name)
                           for name in ("generate_span_id", "generate_trace_id"))  # the stock one, or a subclass
        self.own = OwnIdGenerator() if draws_global or isinstance(self._inner, OwnIdGenerator) else self._inner
        self._pending = threading.local()

    @contextlib.contextmanager
    def ids(self, trace_id: int | None, span_id: int = 0) -> Iterator[None]:
        """Ids for the span started inside: ``trace_id`` (root spans only) and ``span_id`` (0: random)."""
        self._pending.trace_id, self._pending.span_id = trace_id, span_id
        try:
            yield
        finally:
            self._pending.trace_id = self._pending.span_id = None

    def generate_span_id(self) -> int:
        pending = getattr(self._pending, "span_id", None)
        return pending if pending else self._inner.generate_span_id()

    def generate_trace_id(self) -> int:
        pending = getattr(self._pending, "trace_id", None)
        return pending if pending else self._inner.generate_trace_id()


class TracerSetup(NamedTuple):
    """What span building needs from the SDK set-up (``Telemetry.tracer_setup``).

    ``processors``: our own provider's batch processors, empty for an injected
    provider (whose spans then always take ``Tracer.start_span``).
    ``ids``: our id generator in the provider (:func:`attach_id_generator`, which
    must run before the provider makes ``tracer``: an SDK tracer keeps the
    generator it was made with), None where the provider has none.
    ``sdk_metrics``: the SDK's own span metrics are on.
    ``discards``: spans go nowhere (our own provider without a span processor,
    ``OTEL_TRACES_EXPORTER=none``, or a no-op provider), so none are built.
    """

    tracer: Any
    provider: Any
    ids: StepIdGenerator | None = None
    processors: Sequence[Any] = ()
    sdk_metrics: bool = False
    discards: bool = False


class SpanBuilder:
    """Finished step records to spans; the span sink the recorder is given.

    Args:
        setup: returns the :class:`TracerSetup` to build on, starting the
            tracer provider if needed. Called at :meth:`start` and :meth:`emit`;
            a new ``TracerSetup`` (after a fork) is taken up at once.
        exception_messages: ``redacted``, ``full`` or ``none``: what the
            ``exception`` event of a span whose forward raised keeps of the
            message (``redact.exception_attributes``).
    """

    # emit() turns records into spans before it returns and keeps none: the recorder may reuse them.
    keeps_records = False

    def __init__(self, setup: Callable[[], TracerSetup], exception_messages: str = "redacted") -> None:
        self._setup = setup
        self._exception_messages = exception_messages
        self._built_for: TracerSetup | None = None
        self._ids: StepIdGenerator | None = None
        self._direct: _DirectSpans | None = None

    def _current(self) -> TracerSetup:
        setup = self._setup()
        if setup is not self._built_for:
            self._built_for = setup
            self._ids = setup.ids
            self._direct = None
            if setup.processors:
                self._direct = _DirectSpans.for_provider(setup.provider, setup.tracer, setup.processors,
                                                         setup.sdk_metrics)
        return setup

    def start(self) -> bool:
        """Start the tracer provider if needed.

        Returns True when span ids chosen by the recorder are honoured (our id
        generator is in the provider), so metric exemplars can point at spans
        before they exist.
        """
        self._current()
        return self._ids is not None

    @property
    def exporting(self) -> bool:
        """Whether spans built now would go anywhere (known after :meth:`start`); :meth:`emit` builds
        nothing when they would not."""
        return not self._current().discards

    @property
    def direct(self) -> bool:
        """Whether spans skip the SDK's live ``Span`` (known after :meth:`start`)."""
        return self._direct is not None

    def emit(self, roots: list, children: dict[int, list], trace_id: int | None, parent_span_id: int = 0) -> None:
        """Turn finished records (``recorder.Record``) into spans with their own timestamps.

        ``trace_id``: the roots' trace id (128-bit int), or None for a random one.
        ``parent_span_id``: with a ``trace_id``, the span (64-bit int, exported earlier) that the
        roots are children of (a ``train_step_tail`` under its ``train_step``); 0: they are roots.
        """
        setup = self._current()
        if setup.discards:
            return
        tracer = setup.tracer
        # The direct path's spans reach the processors together, after the whole step is built: the
        # export thread, woken by the first full batch, would otherwise contend for the GIL meanwhile.
        finished: list[ReadableSpan] = []
        try:
            parent = (SpanContext(trace_id, parent_span_id, is_remote=False,
                                  trace_flags=TraceFlags(TraceFlags.SAMPLED)) if parent_span_id and trace_id else None)
            for root in roots:
                self._start(tracer, root, parent, None, trace_id, children, finished)
        finally:
            if finished and self._direct is not None:  # (only the direct path fills it)
                self._direct.hand_over(finished)

    def _start(self, tracer: Any, record: Any, parent: SpanContext | None, parent_span: Any,
               trace_id: int | None, children: dict[int, list], finished: list[ReadableSpan]) -> None:
        """``parent``: the parent's context; ``parent_span``: the parent itself when the SDK built it;
        ``finished``: where the direct path puts its spans (:meth:`_DirectSpans.hand_over`)."""
        direct = self._direct
        prepared = direct.prepare(record) if direct is not None else None
        if prepared is not None:
            # Nothing more than needed stays alive down the recursion (a chain of modules nests as
            # deep): the prepared triple is unpacked, the children are walked by index, not an iterator.
            name, attributes, events = prepared
            prepared = None
            assert direct is not None  # (prepared says so)
            context = direct.context(record, parent, trace_id)
            kids = children.get(id(record))
            if kids:
                for index in range(len(kids)):
                    self._start(tracer, kids[index], context, None, None, children, finished)
            finished.append(ReadableSpan(name=name, context=context, parent=parent, resource=direct.provider.resource,
                                         attributes=attributes, events=events, start_time=record.start_ns,
                                         end_time=record.end_ns, instrumentation_info=direct.info,
                                         instrumentation_scope=direct.scope))
            return
        attributes = span_attributes(record)
        ids = self._ids
        if ids is not None:  # every id ours, also where the provider's generator draws from the global random
            own = ids.own
            chosen = ids.ids(trace_id or (own.generate_trace_id() if parent is None else None),
                             record.span_id or own.generate_span_id())
        else:
            chosen = contextlib.nullcontext()  # type: ignore[assignment]
        if parent_span is not None:  # processors and samplers see the live parent span
            parent_context = otel_trace.set_span_in_context(parent_span)
        elif parent is not None:
            parent_context = otel_trace.set_span_in_context(NonRecordingSpan(parent))
        else:
            parent_context = otel_context.Context()
        with chosen:
            span = tracer.start_span(valid_text(record.name), context=parent_context,
                                     attributes=_valid_values(attributes), start_time=record.start_ns)
        for name, event_attributes, timestamp in record.events:
            span.add_event(name, _valid_values(event_attributes), timestamp)
        if record.error is not None:
            span.set_status(Status(StatusCode.ERROR, type(record.error).__name__))
            # Not Span.record_exception: its message and stack trace can hold tensor values.
            span.add_event(semconv.EVENT_EXCEPTION, exception_attributes(record.error, self._exception_messages),
                           record.end_ns)
        context = span.get_span_context()
        for child in children.get(id(record), ()):
            self._start(tracer, child, context, span, None, children, finished)
        span.end(end_time=record.end_ns)


def attach_id_generator(provider: Any) -> StepIdGenerator | None:
    """Put a :class:`StepIdGenerator` around ``provider``'s id generator; None if it has none (not an SDK provider)."""
    inner = getattr(provider, "id_generator", None)
    if inner is None:
        return None  # not an SDK provider (a proxy or no-op): trace ids stay random
    if not isinstance(inner, StepIdGenerator):
        provider.id_generator = StepIdGenerator(inner)
    return provider.id_generator


class _DirectSpans:
    """Our own provider's finished spans, built as ``ReadableSpan`` and handed to its processors.

    A record becomes a span only after it has ended, so the SDK's live ``Span``
    (locks, per-attribute validation in ``BoundedAttributes``, ``on_start``)
    buys nothing; it was 80% of the cost of a traced step's span building. The
    result is the span the SDK would build: same name, ids, parent, flags,
    resource, scope, times, attributes and events (a test compares both paths
    on the wire). Used only where that can be guaranteed: our own
    ``TracerProvider`` with its ``CountingBatchSpanProcessor``s, the SDK's
    default or ``always_on`` sampler (every span sampled), its internal metrics
    off, and a record without error whose attributes are plain values
    (``str``, ``bool``, ``int``, ``float``, or a tuple/list of one of those)
    within the span limits. Anything else goes through ``Tracer.start_span``.
    Strings are cut and lists made tuples, as ``BoundedAttributes`` does.
    """

    __slots__ = (
        "_event_attributes",
        "_event_chars",
        "_events",
        "_ids",
        "_modules",
        "_processors",
        "_root_flags",
        "_span_attributes",
        "_span_chars",
        "_span_id",
        "_trace_id",
        "info",
        "provider",
        "scope",
    )

    def __init__(self, provider: Any, tracer: Any, processors: Sequence[Any], limits: SpanLimits) -> None:
        self.provider = provider  # its resource is read per span: the SDK replaces it after a fork
        self._ids = provider.id_generator
        # Random ids of spans built here: never the global random (no ids are pending on this path).
        own = self._ids.own if isinstance(self._ids, StepIdGenerator) else self._ids
        if type(own) is OwnIdGenerator:  # its draws themselves: one call less per span
            self._span_id, self._trace_id = _new_span_id, _new_trace_id
        else:
            self._span_id, self._trace_id = own.generate_span_id, own.generate_trace_id
        self.scope = instrumentation_scope(tracer)
        self.info = getattr(tracer, "instrumentation_info", None)
        # A module record's name -> (fqn, pass, type, the span's name, its attributes but the call index), as
        # prepare() keeps them; the attributes None where they are not plain (the SDK's path).
        self._modules: dict[str, tuple[str, str, str, str, dict[str, Any] | None]] = {}
        self._processors = tuple(processors)
        self._span_chars = limits.max_span_attribute_length
        self._event_chars = limits.max_attribute_length
        self._span_attributes = limits.max_span_attributes
        self._event_attributes = limits.max_event_attributes
        self._events = limits.max_events
        random_ids = getattr(self._ids, "is_trace_id_random", lambda: False)()
        # The SDK's root flags: sampled, and "random trace id" when the generator says so.
        self._root_flags = TraceFlags(TraceFlags.SAMPLED | (TraceFlags.RANDOM_TRACE_ID if random_ids else 0))

    @classmethod
    def for_provider(cls, provider: Any, tracer: Any, processors: Sequence[Any],
                     sdk_metrics: bool = False) -> _DirectSpans | None:
        """The direct path for ``provider``, or None where only the SDK's path is exact.

        ``sdk_metrics``: the SDK's own span metrics are on (they count live spans).
        """
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, DEFAULT_ON

        limits = span_limits(provider)
        if (getattr(provider, "sampler", None) not in (ALWAYS_ON, DEFAULT_ON)
                or not isinstance(limits, SpanLimits) or not processors
                or instrumentation_scope(tracer) is None or sdk_metrics):
            return None  # another sampler, SDK shape or the SDK's own span metrics: its own path
        return cls(provider, tracer, processors, limits)

    def prepare(self, record: Any) -> tuple[str, dict[str, Any], tuple] | None:
        """The span's name, attributes (``records.span_attributes``) and events as the SDK would keep them,
        or None: use the SDK's path."""
        if record.error is not None:
            return None
        attributes: dict[str, Any] | None
        if record.fqn and not (record.attrs or record.params or record.compiled or record.unmatched
                               or record.dropped_events):
            # A module span like every other of its module and pass but for its call index: what the
            # SDK would keep of the rest is known from the first (the index, an int, is kept as it is).
            known = self._modules.get(record.name)
            if (known is None or known[0] != record.fqn or known[1] != record.pass_
                    or known[2] != record.module_type):
                known = self._module_entry(record)
            name, common = known[3], known[4]
            if common is None:
                return None
            attributes = common.copy()
            attributes[semconv.MODULE_CALL_INDEX] = record.call_index
        else:
            name = valid_text(record.name)
            attributes = _plain(span_attributes(record), self._span_chars, self._span_attributes)
            if attributes is None:
                return None
        if not record.events:
            return name, attributes, ()
        if not _fits(len(record.events), self._events):
            return None
        events = []
        for event_name, event_attributes, timestamp in record.events:
            event_attributes = _plain(event_attributes, self._event_chars, self._event_attributes)
            if event_attributes is None:
                return None
            events.append(Event(event_name, event_attributes, timestamp))
        return name, attributes, tuple(events)

    def _module_entry(self, record: Any) -> tuple[str, str, str, str, dict[str, Any] | None]:
        """:meth:`prepare`'s memo entry for ``record``'s module and pass (bounded: cleared when full)."""
        common = _plain(span_attributes(record), self._span_chars, self._span_attributes)
        if common is not None:
            del common[semconv.MODULE_CALL_INDEX]  # the last key: a copy plus the index keeps the order
        if len(self._modules) >= _MAX_MODULE_ENTRIES:
            self._modules.clear()
        entry = self._modules[record.name] = (record.fqn, record.pass_, record.module_type, valid_text(record.name),
                                              common)
        return entry

    def context(self, record: Any, parent: SpanContext | None, trace_id: int | None) -> SpanContext:
        """The span's context (ids as the SDK would choose them), known before its children."""
        if parent is None:
            trace_id, flags = trace_id or self._trace_id(), self._root_flags
        else:
            trace_id, flags = parent.trace_id, parent.trace_flags
        return SpanContext(trace_id, record.span_id or self._span_id(), is_remote=False, trace_flags=flags)

    def hand_over(self, spans: list[ReadableSpan]) -> None:
        """Give finished spans to the processors, in order (ours take them all at once: ``on_end_all``)."""
        for processor in self._processors:
            on_end_all = getattr(processor, "on_end_all", None)
            if on_end_all is not None:
                on_end_all(spans)
                continue
            for span in spans:
                processor.on_end(span)


# Entries of _DirectSpans' module memo: a model's module FQNs times passes; past this many, it starts afresh.
_MAX_MODULE_ENTRIES = 65536


def _fits(count: int, limit: int | None) -> bool:
    return limit is None or count <= limit


_PLAIN = (str, bool, int, float)


def _valid_values(attributes: Any) -> Any:
    """``attributes`` with every string made valid Unicode (``redact.valid_text``); itself when all are."""
    if not attributes:
        return attributes
    fixed = None
    for key, value in attributes.items():
        if type(value) is str:
            valid: Any = valid_text(value)
        elif type(value) in (tuple, list) and any(type(item) is str and not item.isascii() for item in value):
            valid = tuple(valid_text(item) if type(item) is str else item for item in value)
        else:
            continue
        if valid is not value:
            if fixed is None:
                fixed = dict(attributes)
            fixed[key] = valid
    return attributes if fixed is None else fixed


def _plain(attributes: dict[str, Any], chars: int | None, limit: int | None) -> dict[str, Any] | None:
    """``attributes`` (changed in place) as ``BoundedAttributes`` keeps them, or None if they are not plain.

    Strings, also inside sequences, are made valid Unicode (``redact.valid_text``: OTLP strings are
    UTF-8) and cut at ``chars``; lists become tuples. None when
    a value is of another type or a sequence mixes types (the SDK would convert or drop
    it, with a warning), or there are more than ``limit`` attributes.
    """
    if not _fits(len(attributes), limit):
        return None
    for key, value in attributes.items():
        kind = type(value)
        if kind is str:
            if not value.isascii():
                attributes[key] = value = valid_text(value)
            if chars is not None and len(value) > chars:
                attributes[key] = value[:chars]
        elif kind is int or kind is bool or kind is float:
            continue
        elif kind is tuple or kind is list:
            if value:
                first = type(value[0])
                if first not in _PLAIN or any(type(item) is not first for item in value):
                    return None
                if first is str:
                    value = tuple((item if item.isascii() else valid_text(item))[:chars] for item in value)
            if kind is list:
                value = tuple(value)
            attributes[key] = value
        else:
            return None
    return attributes
