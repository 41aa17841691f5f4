"""Communication signatures: what a job or a test communicates in a typical step, as a sorted JSON document.

A signature says, per module, pass, collective op, process group (and mesh dimension), dtype and
"why" (the DTensor cause, source and target placements), how many collectives a rank issues in
its **typical training step** and how many bytes they move (``torch.collective.bytes``), and
apart from that, how its first and last steps differ from the typical one. It holds no times,
ids, pids, host names or step counts, so the same code gives the same document run after run,
whatever the number of steps; two documents are compared with :func:`compare`.

Usage::

    from commdebug_otel.offline import signature

    base = signature.load("comm_signatures/tp.json")            # a signature file, or
    new = signature.load("commdebug-otel-out/run-20261201-...")  # run folders or OTLP-JSON files
    diff = signature.compare(base, new)
    print(signature.format_diff(diff))                          # "" when equal

or ``commdebug-otel signature PATH... -o sig.json`` and ``commdebug-otel compare BASE NEW``.
The pytest fixture ``comm_signature`` (:mod:`commdebug_otel.pytest_plugin`) records one from a live
tracer with :mod:`commdebug_otel.testing.signatures`, through the same :func:`tally_spans`.

The document (``format`` :data:`FORMAT`)::

    {"format": "commdebug-otel.signature/2", "world_size": 2,
     "entries": [{"module": "ToyModel.out_proj", "pass": "forward", "op": "all_reduce", "group": "0",
                  "mesh_dim": "tp", "dtype": "float32", "cause": "redistribute",
                  "source_placements": "(Partial(sum),)", "target_placements": "(Replicate(),)",
                  "count_per_step": 1, "bytes_per_step": 80, "ranks": [0, 1]}],
     "first_step": [], "last_step": [{"module": "train_step_tail", "pass": "none", "op": "all_reduce", ...,
                                      "count_delta": -1, "bytes_delta": -4, "ranks": [0, 1]}],
     "other_steps": []}

* Steps: each rank's collectives are counted step by step (:func:`typical_step`). Files: the
  collectives under ``train_step`` spans, the ``train_step_tail`` under each (what ran after that
  step's ``optimizer.step()``) included; collectives outside any step (set-up, ``outside_step``)
  are not counted. A live recording counts everything its block issued (set-up in the block goes
  to its first step).
* ``entries``: the typical step: the commonest step among the steps between the first and the
  last (among all steps in a run of 1 or 2), the latest of them on a tie. ``count_per_step``,
  ``bytes_per_step``: that step's collectives and bytes (integers).
* ``first_step``, ``last_step``: where the first (lazy initialisation) or last step (no trailing
  logging collective, a tail after the last ``optimizer.step()``) differs from the typical one,
  ``count_delta`` and ``bytes_delta`` (that step's figure minus the typical one's, per key); empty
  where it does not, and in a run of one step.
* ``other_steps``: steps between the first and the last that differ from the typical one
  (``steps``: their ``torch.step`` numbers; the deltas as above). Which steps these are depends on
  the run's length (an every-4-steps checkpoint), so :func:`compare` does not hold them.
* ``ranks``: the ranks with exactly these values; a rank that differs gets an entry of its own.
* ``module``: the owning span's ``torch.module.fqn``, else its span name (``train_step``,
  ``train_step_tail``, ``outside_step``); ``pass``: ``forward``, ``backward``, ``recompute`` or
  ``none``; ``mesh_dim``, ``cause`` and the placements are ``""`` where not recorded.
* With ``times``, a section ``times`` (per entry key, over all ranks and steps: ``n``, ``min_s``,
  ``median_s``, ``max_s`` of ``torch.collective.issue_duration_s``) follows; :func:`compare`
  ignores it.

A file of another format (``commdebug-otel.signature/1``: every step averaged) is refused, as is
one that holds two entries for one key and rank in a section, or one JSON member twice in an
object (the last would silently win). Collectives on fake tensors (traced shapes that move
nothing) are left out. Nothing here imports torch or the OTel SDK.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.core.fact import PASS_NONE, ranges_text
from commdebug_otel.offline import EXIT_DONE, EXIT_UNREADABLE, write_output
from commdebug_otel.offline.model import CollectiveEvent, SpanIndex, collective_events, is_snapshot, process_of
from commdebug_otel.offline.otlp_json import SpanReader

__all__ = ["EDGES", "FORMAT", "KEY_FIELDS", "MAX_SIGNATURE_BYTES", "SignatureError", "Tally", "TypicalStep", "build",
           "compare", "format_diff", "load", "read_spans", "signature_of_spans", "tally_spans", "to_json",
           "typical_step"]

FORMAT = "commdebug-otel.signature/2"
#: The fields that identify an entry, in sort order.
KEY_FIELDS = ("module", "pass", "op", "group", "mesh_dim", "dtype", "cause", "source_placements",
              "target_placements")
#: The sections of the steps reported apart that :func:`compare` holds, in document order.
EDGES = ("first_step", "last_step")
_OTHER = "other_steps"
#: A file larger than this is read as spans only (a run's OTLP-JSON), never loaded whole as one signature.
MAX_SIGNATURE_BYTES = 64 << 20

Key = tuple[str, ...]
#: A step's collectives: ``{entry key: (collectives, bytes)}``.
StepCounts = dict[Key, tuple[int, int]]


class SignatureError(ValueError):
    """A path that holds neither a signature nor spans to make one from; ``str()`` says why."""


@dataclass
class Tally:
    """One rank's collectives, step by step.

    Attributes:
        steps: ``{torch.step: {entry key (KEY_FIELDS order): [collectives, bytes]}}`` for every counted
            step (a step that issued nothing maps to ``{}``).
        durations_s: ``{entry key: [issue durations in seconds]}`` (filled only when asked for times).
    """

    steps: dict[int, dict[Key, list[int]]] = field(default_factory=dict)
    durations_s: dict[Key, list[float]] = field(default_factory=dict)


@dataclass
class TypicalStep:
    """One rank's steps read as a typical step and the steps that differ from it (:func:`typical_step`).

    Attributes:
        counts: the typical step's ``{entry key: (collectives, bytes)}``.
        first, last: ``{entry key: (collectives, bytes)}`` that step minus the typical one, keys
            with a difference only (``{}`` where it is typical, and in a run of one step).
        other: ``{torch.step: differences as above}`` for the steps between the first and the
            last that differ from the typical one.
    """

    counts: StepCounts = field(default_factory=dict)
    first: StepCounts = field(default_factory=dict)
    last: StepCounts = field(default_factory=dict)
    other: dict[int, StepCounts] = field(default_factory=dict)


def _text(value: Any) -> str:
    """An attribute as entry text: strings as they are, arrays as their elements joined (never None)."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)


def _entry_key(event: CollectiveEvent) -> Key:
    attributes = event.attributes
    span = event.span
    span_attributes = span["attributes"]
    return (
        _text(span_attributes.get(semconv.MODULE_FQN) or span["name"]),
        _text(event.pass_ or span_attributes.get(semconv.MODULE_PASS) or PASS_NONE),
        event.op,
        event.group,
        _text(attributes.get(semconv.DEVICE_MESH_DIM_NAME)),
        event.dtype,
        _text(attributes.get(semconv.DTENSOR_CAUSE)),
        _text(attributes.get(semconv.DTENSOR_SOURCE_PLACEMENTS)),
        _text(attributes.get(semconv.DTENSOR_TARGET_PLACEMENTS)),
    )


def tally_spans(spans: list[dict], whole: bool = False, times: bool = False) -> dict[int, Tally]:
    """Each rank's collectives, step by step and per entry key, from span dicts (:class:`.otlp_json.SpanReader`'s).

    Every ``train_step`` is a step, the first one too; a ``train_step_tail`` (collectives after the
    step's ``optimizer.step()``) is part of its step.

    Args:
        spans: span dicts with ``rank``; spans of stall snapshots are left out here.
        whole: count every collective in ``spans`` (a live recording: one block): those outside any
            step go to the rank's first step (step 0 where there is none), instead of being left out.
        times: keep each collective's issue duration (:attr:`Tally.durations_s`).

    Returns:
        ``{rank: Tally}`` for every rank with a step or a counted collective.
    """
    spans = [span for span in spans if not is_snapshot(span)]
    index = SpanIndex(spans)
    tallies: dict[int, Tally] = defaultdict(Tally)
    for span in spans:
        step = index.step(span)
        if step is not None:
            tallies[span["rank"]].steps.setdefault(step, {})
    outside: list[tuple[CollectiveEvent, Key]] = []
    for event in collective_events(spans):
        if event.fake:
            continue
        step = index.step(event.span)
        if step is None and not whole:
            continue
        key = _entry_key(event)
        tally = tallies[event.rank]
        if step is None:
            outside.append((event, key))
        else:
            _add(tally.steps.setdefault(step, {}), key, event.nbytes)
        if times:
            tally.durations_s.setdefault(key, []).append(event.duration_s)
    for event, key in outside:
        steps = tallies[event.rank].steps
        _add(steps.setdefault(min(steps, default=0), {}), key, event.nbytes)
    return dict(tallies)


def _add(counts: dict[Key, list[int]], key: Key, nbytes: int) -> None:
    total = counts.get(key)
    if total is None:
        total = counts[key] = [0, 0]
    total[0] += 1
    total[1] += nbytes


def _difference(step: Mapping[Key, Any], typical: StepCounts) -> StepCounts:
    """``step`` minus ``typical``, per key, the keys that differ only."""
    out: StepCounts = {}
    for key in set(step) | set(typical):
        count, nbytes = step.get(key, (0, 0))
        base_count, base_bytes = typical.get(key, (0, 0))
        if count != base_count or nbytes != base_bytes:
            out[key] = (count - base_count, nbytes - base_bytes)
    return out


def typical_step(tally: Tally) -> TypicalStep:
    """The rank's typical step, and how its first, last and other steps differ from it.

    The typical step is the commonest step (the same collectives and bytes per key) among the steps
    between the first and the last, or among all steps in a run of 1 or 2 steps; of those equally
    common, the latest. So runs of 3 or more steps of the same code have the same typical step
    whatever their length, though their first step initialises lazily and their last skips the
    collective that logs a loss for the next one.
    """
    numbers = sorted(tally.steps)
    if not numbers:
        return TypicalStep()
    shapes = {number: frozenset((key, tuple(value)) for key, value in tally.steps[number].items())
              for number in numbers}
    pool = numbers[1:-1] if len(numbers) >= 3 else numbers
    votes = Counter(shapes[number] for number in pool)
    most = max(votes.values())
    chosen = max(number for number in pool if votes[shapes[number]] == most)
    typical: StepCounts = {key: (value[0], value[1]) for key, value in tally.steps[chosen].items()}
    found = TypicalStep(counts=typical)
    if len(numbers) >= 2:
        found.first = _difference(tally.steps[numbers[0]], typical)
        found.last = _difference(tally.steps[numbers[-1]], typical)
    for number in numbers[1:-1]:
        if shapes[number] != shapes[chosen]:
            found.other[number] = _difference(tally.steps[number], typical)
    return found


def build(tallies: Mapping[int, Tally], world_size: int | None = None, times: bool = False) -> dict[str, Any]:
    """The signature document of per-rank tallies (:func:`tally_spans`, or gathered from live ranks).

    ``world_size``: the job's (default: the number of ranks tallied). ``times``: add the ``times``
    section (the tallies must hold durations).
    """
    typical = {rank: typical_step(tally) for rank, tally in tallies.items()}
    # (key, figures...) -> ranks, per section
    sections: dict[str, dict[tuple, list[int]]] = {name: defaultdict(list) for name in ("entries", *EDGES, _OTHER)}
    for rank, found in typical.items():
        for key, figures in found.counts.items():
            sections["entries"][(key, *figures)].append(rank)
        for name, differences in zip(EDGES, (found.first, found.last)):
            for key, figures in differences.items():
                sections[name][(key, *figures)].append(rank)
        others: dict[tuple, list[int]] = defaultdict(list)  # (key, deltas) -> this rank's steps
        for number, differences in found.other.items():
            for key, figures in differences.items():
                others[(key, *figures)].append(number)
        for (key, *deltas), numbers in others.items():
            sections[_OTHER][(key, *deltas, tuple(sorted(numbers)))].append(rank)
    document: dict[str, Any] = {"format": FORMAT,
                                "world_size": world_size if world_size is not None else len(tallies)}
    names = {"entries": ("count_per_step", "bytes_per_step"), _OTHER: ("count_delta", "bytes_delta", "steps")}
    for section, rows in sections.items():
        fields = names.get(section, ("count_delta", "bytes_delta"))
        out = []
        ordered = sorted(rows.items(), key=lambda item: (item[0][0], sorted(item[1]), item[0][1:]))
        for (key, *values), ranks in ordered:
            entry: dict[str, Any] = dict(zip(KEY_FIELDS, key))
            for name, value in zip(fields, values):
                entry[name] = list(value) if name == "steps" else value
            entry["ranks"] = sorted(ranks)
            out.append(entry)
        document[section] = out
    if times:
        durations: dict[Key, list[float]] = defaultdict(list)
        for tally in tallies.values():
            for key, found_s in tally.durations_s.items():
                durations[key].extend(found_s)
        document["times"] = [
            {**dict(zip(KEY_FIELDS, key)), "n": len(found_s), "min_s": min(found_s),
             "median_s": statistics.median(found_s), "max_s": max(found_s)}
            for key, found_s in sorted(durations.items())]
    return document


def _world_size(spans: list[dict], tallies: Mapping[int, Tally]) -> int:
    """The job's size: the resource's ``torch.distributed.world_size``, else the ranks seen."""
    sizes = {span["resource"].get(semconv.WORLD_SIZE) for span in spans if isinstance(span.get("resource"), dict)}
    sizes = {size for size in sizes if isinstance(size, int) and size > 0}
    if sizes:
        return max(sizes)
    return max(len(tallies), len({span["rank"] for span in spans}))


def signature_of_spans(spans: list[dict], times: bool = False) -> dict[str, Any]:
    """The signature document of span dicts from files (see :func:`tally_spans`)."""
    tallies = tally_spans(spans, times=times)
    return build(tallies, _world_size(spans, tallies), times)


def read_spans(paths: Iterable[str | os.PathLike], messages: list[str] | None = None) -> list[dict]:
    """Every span under ``paths`` (OTLP-JSON files or folders), read once by :class:`.otlp_json.SpanReader`.

    ``messages``: what the reader skipped (one line per file) is appended to it.

    Raises:
        FileNotFoundError: a path does not exist.
    """
    reader = SpanReader(paths)
    spans = list(reader)
    if messages is not None:
        messages.extend(reader.messages)
    return spans


def mixed_runs(spans: list[dict]) -> str | None:
    """Why ``spans`` hold several runs (a rank's spans from more than one process), or None.

    Steps are told apart by number, so a second run's steps would add to the first's counts.
    """
    processes: dict[int, set[tuple[str, str]]] = defaultdict(set)
    for span in spans:
        resource = span["resource"]
        processes[span["rank"]].add(process_of(resource))
    rank, seen = max(processes.items(), key=lambda item: (len(item[1]), -item[0]), default=(0, set()))
    if len(seen) < 2:
        return None
    return f"rank {rank} has spans from {len(seen)} processes: several runs are mixed; pass one run's folder"


_OLD_FORMATS = {"commdebug-otel.signature/1": "every step averaged, the first and last steps in the average"}
#: Each section's figures (numbers), after the key fields.
_FIGURES = {"entries": ("count_per_step", "bytes_per_step"), **{name: ("count_delta", "bytes_delta")
                                                                 for name in (*EDGES, _OTHER)}}


def _is_signature(document: Any) -> bool:
    return isinstance(document, dict) and document.get("format") == FORMAT


def _integers(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _checked(document: dict, path: str) -> dict[str, Any]:
    """A signature document read from a file, its fields checked (compare must not fail half-way).

    A section that holds one key twice for a rank (a hand-merged file) is refused: one of the two
    would silently win.
    """
    for section, figures in _FIGURES.items():
        entries = document.get(section, [] if section != "entries" else None)
        if not isinstance(entries, list):
            raise SignatureError(f"{path}: {section!r} is not a list")
        document[section] = entries
        seen: dict[tuple, int] = {}
        twice: list[str] = []
        for number, entry in enumerate(entries):
            where = f"{path}: {section}[{number}]"
            if not isinstance(entry, dict):
                raise SignatureError(f"{where} is not an object")
            for name in KEY_FIELDS:
                if not isinstance(entry.get(name, ""), str):
                    raise SignatureError(f"{where}: {name!r} is not a string")
            for name in figures:
                value = entry.get(name)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise SignatureError(f"{where}: {name!r} is not a number")
            if section == _OTHER and not _integers(entry.get("steps")):
                raise SignatureError(f"{where}: 'steps' is not a list of integers")
            ranks = entry.get("ranks", [0])
            if not _integers(ranks):
                raise SignatureError(f"{where}: 'ranks' is not a list of integers")
            key = _key(entry)
            for rank in ranks:
                for step in entry["steps"] if section == _OTHER else (None,):
                    earlier = seen.setdefault((key, rank, step), number)
                    if earlier != number or ranks.count(rank) > 1:
                        at = f" step {step}" if step is not None else ""
                        which = f"[{earlier}] and [{number}]" if earlier != number else f"[{number}] (twice)"
                        twice.append(f"{section}{which}: {_where(dict(zip(KEY_FIELDS, key)))}  rank {rank}{at}")
        if twice:
            named = list(dict.fromkeys(twice))  # a rank twice in one entry's list is met twice
            raise SignatureError(f"{path}: {len(named)} key(s) with two entries for one rank (one would silently "
                                 f"win; merge them into one): " + "; ".join(named))
    return document


def _key(entry: dict) -> Key:
    return tuple(str(entry.get(name, "")) for name in KEY_FIELDS)


def _pairs(twice: list[str]):
    """A ``json`` ``object_pairs_hook`` that notes the member names an object holds twice in ``twice``."""
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in pairs:
            if name in out:
                twice.append(name)
            out[name] = value
        return out
    return hook


def load(path: str | os.PathLike, messages: list[str] | None = None) -> dict[str, Any]:
    """A signature: a signature file as it is, or one made from a run folder or OTLP-JSON trace files.

    Args:
        path: a signature file (``format`` :data:`FORMAT`), or a folder or file of OTLP-JSON spans.
        messages: what the span reader skipped is appended to it.

    Raises:
        SignatureError: the path does not exist, is another format's JSON (an older signature
            format too: it says to write the file again), is a signature with a JSON member twice in
            one object or two entries for one key and rank (:func:`_checked`), holds spans of several
            runs (:func:`mixed_runs`), or holds no spans (then what the reader skipped is in its
            message, not in ``messages``).
    """
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.getsize(path) <= MAX_SIGNATURE_BYTES:
        twice: list[str] = []
        try:
            with open(path, encoding="utf-8") as handle:
                document = json.load(handle, object_pairs_hook=_pairs(twice))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            document = None  # one OTLP-JSON line per line, or not JSON: the span reader says which
        if _is_signature(document):
            if twice:
                names = ", ".join(repr(name) for name in dict.fromkeys(twice))
                raise SignatureError(f"{path}: member(s) {names} twice in one object (the last would silently "
                                     "win; keep one)")
            return _checked(document, path)
        if isinstance(document, dict) and "format" in document:
            old = _OLD_FORMATS.get(document["format"])
            if old is not None:
                raise SignatureError(f"{path}: format {document['format']!r} ({old}) is no longer read, expected "
                                     f"{FORMAT!r}: write it again (pytest --comm-update, or commdebug-otel "
                                     "signature RUN -o FILE)")
            raise SignatureError(f"{path}: format {document['format']!r}, expected {FORMAT!r}")
    skipped: list[str] = []
    try:
        spans = read_spans([path], skipped)
    except FileNotFoundError:
        raise SignatureError(f"{path}: no such file or folder") from None
    if not spans:
        # One message: what the reader skipped is the why of it, not a second warning.
        why = f" ({skipped[0]}{' ...' if len(skipped) > 1 else ''})" if skipped else ""
        raise SignatureError(f"{path}: neither a signature ({FORMAT}) nor OTLP-JSON spans{why}")
    mixed = mixed_runs(spans)
    if mixed:
        raise SignatureError(f"{path}: {mixed}")
    if messages is not None:
        messages.extend(skipped)
    return signature_of_spans(spans)


# ------------------------------------------------------------------ compare


def _by_rank(document: dict, section: str) -> dict[Key, dict[int, tuple[float, float]]]:
    """``{entry key: {rank: (figures)}}`` of one section (:data:`_FIGURES`)."""
    first, second = _FIGURES[section]
    out: dict[Key, dict[int, tuple[float, float]]] = defaultdict(dict)
    for entry in document.get(section, []):
        for rank in entry.get("ranks", [0]):
            out[_key(entry)][rank] = (entry[first], entry[second])
    return out


def _within(base: float, new: float, absolute: float = 0.0, relative: float = 0.0) -> bool:
    return abs(new - base) <= max(absolute, relative * abs(base))


def compare(base: dict, new: dict, count_tolerance: float = 0.0, bytes_tolerance: float = 0.0,
            typical_only: bool = False) -> dict[str, Any]:
    """What differs between two signature documents.

    The typical steps (``entries``) are compared per key and rank: a key on a rank only in ``new``
    appeared, only in ``base`` disappeared; a count or byte figure that moved beyond its tolerance
    changed. Then, unless ``typical_only``, the first and last steps' differences from the typical
    step (``first_step``, ``last_step``): a key and rank whose delta moved beyond the tolerances
    (a missing one is 0) is a row. ``other_steps`` are not compared (they depend on the run's
    length). Ranks with the same difference share one row.

    Args:
        count_tolerance: collectives per step a count (or delta) may move by and stay equal (absolute, >= 0).
        bytes_tolerance: the share of the base's bytes per step (or delta) they may move by (e.g. 0.05), >= 0.
        typical_only: compare the typical steps only.

    Returns:
        ``{"equal": bool, "world_size": [base, new], "appeared": [entry], "disappeared": [entry],
        "changed": [{key fields..., "ranks", "base": {"count_per_step", "bytes_per_step"}, "new": {...}}],
        "first_step": [{key fields..., "ranks", "base": {"count_delta", "bytes_delta"}, "new": {...}}],
        "last_step": [...]}``; entries as in a signature (with their ranks). A different world size
        makes the documents different.

    Raises:
        ValueError: a negative tolerance.
    """
    if count_tolerance < 0 or bytes_tolerance < 0:
        raise ValueError(f"tolerances must be >= 0, got count {count_tolerance}, bytes {bytes_tolerance}")

    def moved(old: tuple, now: tuple) -> bool:
        return not (_within(old[0], now[0], absolute=count_tolerance)
                    and _within(old[1], now[1], relative=bytes_tolerance))

    old_ranks, new_ranks = _by_rank(base, "entries"), _by_rank(new, "entries")
    rows: dict[str, dict[tuple, list[int]]] = {"appeared": defaultdict(list), "disappeared": defaultdict(list),
                                                "changed": defaultdict(list)}
    for key in sorted(set(old_ranks) | set(new_ranks)):
        before, after = old_ranks.get(key, {}), new_ranks.get(key, {})
        for rank in sorted(set(before) | set(after)):
            if rank not in before:
                rows["appeared"][(key, after[rank])].append(rank)
            elif rank not in after:
                rows["disappeared"][(key, before[rank])].append(rank)
            elif moved(before[rank], after[rank]):
                rows["changed"][(key, before[rank], after[rank])].append(rank)
    edges: dict[str, dict[tuple, list[int]]] = {name: defaultdict(list) for name in EDGES}
    for name in () if typical_only else EDGES:
        old_edge, new_edge = _by_rank(base, name), _by_rank(new, name)
        for key in sorted(set(old_edge) | set(new_edge)):
            before, after = old_edge.get(key, {}), new_edge.get(key, {})
            for rank in sorted(set(before) | set(after)):
                old, now = before.get(rank, (0, 0)), after.get(rank, (0, 0))
                if moved(old, now):
                    edges[name][(key, old, now)].append(rank)

    def entry(key: Key, figures: tuple, ranks: list[int]) -> dict[str, Any]:
        return {**dict(zip(KEY_FIELDS, key)), "count_per_step": figures[0], "bytes_per_step": figures[1],
                "ranks": ranks}

    def figures(pair: tuple, names: tuple[str, str] = _FIGURES["entries"]) -> dict[str, float]:
        return dict(zip(names, pair))

    world = [base.get("world_size"), new.get("world_size")]
    diff: dict[str, Any] = {
        "world_size": world,
        "appeared": [entry(key, value, ranks) for (key, value), ranks in rows["appeared"].items()],
        "disappeared": [entry(key, value, ranks) for (key, value), ranks in rows["disappeared"].items()],
        "changed": [{**dict(zip(KEY_FIELDS, key)), "ranks": ranks, "base": figures(old), "new": figures(now)}
                    for (key, old, now), ranks in rows["changed"].items()],
    }
    for name in EDGES:
        diff[name] = [{**dict(zip(KEY_FIELDS, key)), "ranks": ranks, "base": figures(old, _FIGURES[name]),
                       "new": figures(now, _FIGURES[name])} for (key, old, now), ranks in edges[name].items()]
    differs = any(diff[name] for name in ("appeared", "disappeared", "changed", *EDGES))
    return {"equal": world[0] == world[1] and not differs, **diff}


def _where(row: dict) -> str:
    """``ToyModel.out_proj forward  all_reduce  group 0 (tp)  float32``, then the why where there is one."""
    group = f"group {row['group'] or '?'}" + (f" ({row['mesh_dim']})" if row["mesh_dim"] else "")
    text = f"{row['module']} {row['pass']}  {row['op']}  {group}  {row['dtype'] or '?'}"
    if row["cause"] or row["source_placements"] or row["target_placements"]:
        text += f"  cause {row['cause'] or '?'}"
        if row["source_placements"] or row["target_placements"]:
            text += f" {row['source_placements'] or '?'} -> {row['target_placements'] or '?'}"
    return text


def _figure(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.6g}"


def _delta(value: float) -> str:
    """A difference from the typical step: ``+1``, ``-4``, ``0``."""
    return _figure(value) if value <= 0 else "+" + _figure(value)


def format_diff(diff: dict, base_name: str = "base", new_name: str = "new") -> str:
    """The diff as text a person reads: one line per row, ``+`` appeared, ``-`` disappeared, ``~`` changed
    (in the typical step), then ``first step ~`` and ``last step ~``: a step's difference from the typical
    step that moved (``-1 -> 0 collectives``: that step issued one fewer than the typical step, now as many).

    Returns ``""`` when the signatures are equal.
    """
    if diff["equal"]:
        return ""
    counts = f"{len(diff['appeared'])} appeared, {len(diff['disappeared'])} disappeared, " \
             f"{len(diff['changed'])} changed"
    for name in EDGES:
        if diff.get(name):
            counts += f", {len(diff[name])} in the {name.replace('_', ' ')}"
    lines = [f"communication differs ({new_name} against {base_name}): {counts}"]
    if diff["world_size"][0] != diff["world_size"][1]:
        lines.append(f"  world size {diff['world_size'][0]} -> {diff['world_size'][1]}")
    for sign, name in (("+", "appeared"), ("-", "disappeared")):
        for row in diff[name]:
            lines.append(f"{sign} {_where(row)}: {_figure(row['count_per_step'])} per step, "
                         f"{_figure(row['bytes_per_step'])} bytes per step  ranks {ranges_text(row['ranks'])}")
    for row in diff["changed"]:
        old, now = row["base"], row["new"]
        parts = []
        if old["count_per_step"] != now["count_per_step"]:
            parts.append(f"count {_figure(old['count_per_step'])} -> {_figure(now['count_per_step'])} per step")
        if old["bytes_per_step"] != now["bytes_per_step"]:
            parts.append(f"bytes {_figure(old['bytes_per_step'])} -> {_figure(now['bytes_per_step'])} per step")
        lines.append(f"~ {_where(row)}: {', '.join(parts)}  ranks {ranges_text(row['ranks'])}")
    for name in EDGES:
        for row in diff.get(name, []):
            old, now = row["base"], row["new"]
            lines.append(f"{name.replace('_', ' ')} ~ {_where(row)}: {_delta(old['count_delta'])} -> "
                         f"{_delta(now['count_delta'])} collectives, {_delta(old['bytes_delta'])} -> "
                         f"{_delta(now['bytes_delta'])} bytes beside the typical step  "
                         f"ranks {ranges_text(row['ranks'])}")
    return "\n".join(lines)


_INT_LIST = re.compile(r"\[\n\s+(-?\d+(?:,\n\s+-?\d+)*)\n\s+\]")


def to_json(document: dict) -> str:
    """A signature (or diff) as the text written to files: indented, lists of integers (ranks) on one line,
    a newline at the end."""
    text = json.dumps(document, indent=2)
    return _INT_LIST.sub(lambda match: "[" + re.sub(r",\n\s+", ", ", match.group(1)) + "]", text) + "\n"


# --------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``signature``'s arguments to ``parser``."""
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="run folders or OTLP-JSON trace files (*.jsonl / *.json under folders)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="write the signature here (default: standard output)")
    # Every step is read now (the first one's difference reported apart): accepted so scripts keep working.
    parser.add_argument("--include-warmup", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--times", action="store_true",
                        help="add a 'times' section: issue time per entry (n, min, median, max seconds); "
                             "compare ignores it")


def run(args: argparse.Namespace) -> int:
    """Write the signature of ``args.paths``. Returns :data:`.EXIT_DONE`; :data:`.EXIT_UNREADABLE` when there is
    nothing to read or the spans are of several runs (as ``compare``), :data:`.EXIT_NOT_THERE` when ``--output``
    cannot be written (each said on stderr)."""
    messages: list[str] = []
    try:
        spans = read_spans(args.paths, messages)
    except FileNotFoundError as error:
        print(f"commdebug-otel signature: {error}", file=sys.stderr)
        return EXIT_UNREADABLE
    if not spans:
        # One message: what the reader skipped is why there are none (as load() says it).
        why = f"; {messages[0]}{' ...' if len(messages) > 1 else ''}" if messages else ""
        print(f"commdebug-otel signature: no spans found (expected OTLP-JSON trace files{why})", file=sys.stderr)
        return EXIT_UNREADABLE
    mixed = mixed_runs(spans)
    if mixed:
        print(f"commdebug-otel signature: {mixed}", file=sys.stderr)
        return EXIT_UNREADABLE
    for message in messages:
        print(f"commdebug-otel signature: {message}", file=sys.stderr)
    text = to_json(signature_of_spans(spans, args.times))
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_DONE
    return write_output("signature", args.output, text)
