"""Communication signatures: what a job or a test communicates, per step, as a sorted JSON document.

A signature says, per module, pass, collective op, process group (and mesh dimension), dtype and
"why" (the DTensor cause, source and target placements), how many collectives a rank issues per
training step and how many bytes they move (``torch.collective.bytes``). It holds no times, ids,
pids or host names, so the same code gives the same document run after run; two documents are
compared with :func:`compare`.

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

    {"format": "commdebug-otel.signature/1", "world_size": 2, "steps": 4,
     "entries": [{"module": "ToyModel.out_proj", "pass": "forward", "op": "all_reduce", "group": "0",
                  "mesh_dim": "tp", "dtype": "float32", "count_per_step": 1, "bytes_per_step": 80,
                  "cause": "redistribute", "source_placements": "(Partial(sum),)",
                  "target_placements": "(Replicate(),)", "ranks": [0, 1]}]}

* ``steps``: training steps counted (per rank; the largest where ranks differ). Files: the
  collectives under ``train_step`` spans, the first traced step left out as summarize leaves it out
  of stragglers (start-up, cold caches: :func:`.model.warmup_step`) unless ``include_warmup``;
  collectives outside any step (set-up, ``outside_step``) are not counted. A live recording counts
  everything its block issued, over its steps (at least 1).
* ``count_per_step``, ``bytes_per_step``: a rank's totals over its steps, divided by them: an int
  when exact, else rounded to 6 decimals (the steps did not all communicate alike).
* ``ranks``: the ranks with exactly these values; a rank that differs gets an entry of its own.
* ``module``: the owning span's ``torch.module.fqn``, else its span name (``train_step``,
  ``train_step_tail``, ``outside_step``); ``pass``: ``forward``, ``backward``, ``recompute`` or
  ``none``; ``mesh_dim``, ``cause`` and the placements are ``""`` where not recorded.
* With ``times``, a section ``times`` (per entry key, over all ranks: ``n``, ``min_s``,
  ``median_s``, ``max_s`` of ``torch.collective.issue_duration_s``) follows; :func:`compare`
  ignores it.

Collectives on fake tensors (traced shapes that move nothing) are left out. Nothing here
imports torch or the OTel SDK.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.core.fact import ranges_text
from commdebug_otel.offline import EXIT_DONE, EXIT_UNREADABLE, write_output
from commdebug_otel.offline.model import SpanIndex, collective_events, is_snapshot, warmup_step
from commdebug_otel.offline.otlp_json import SpanReader

__all__ = ["FORMAT", "KEY_FIELDS", "MAX_SIGNATURE_BYTES", "SignatureError", "Tally", "build", "compare",
           "format_diff", "load", "read_spans", "signature_of_spans", "tally_spans", "to_json"]

FORMAT = "commdebug-otel.signature/1"
#: The fields that identify an entry, in sort order.
KEY_FIELDS = ("module", "pass", "op", "group", "mesh_dim", "dtype", "cause", "source_placements",
              "target_placements")
PASS_NONE = "none"
#: A file larger than this is read as spans only (a run's OTLP-JSON), never loaded whole as one signature.
MAX_SIGNATURE_BYTES = 64 << 20
_DECIMALS = 6

Key = tuple[str, ...]


class SignatureError(ValueError):
    """A path that holds neither a signature nor spans to make one from; ``str()`` says why."""


@dataclass
class Tally:
    """One rank's collectives over its counted steps.

    Attributes:
        steps: training steps counted (>= 1 wherever a collective was counted).
        counts: ``{entry key (KEY_FIELDS order): [collectives, bytes]}`` summed over the steps.
        durations_s: ``{entry key: [issue durations in seconds]}`` (filled only when asked for times).
    """

    steps: int = 0
    counts: dict[Key, list[int]] = field(default_factory=dict)
    durations_s: dict[Key, list[float]] = field(default_factory=dict)


def _text(value: Any) -> str:
    """An attribute as entry text: strings as they are, arrays as their elements joined (never None)."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)


def _entry_key(event: dict) -> Key:
    attributes = event["attributes"]
    span = event["span"]
    span_attributes = span["attributes"]
    return (
        _text(span_attributes.get(semconv.MODULE_FQN) or span["name"]),
        _text(attributes.get(semconv.MODULE_PASS) or span_attributes.get(semconv.MODULE_PASS) or PASS_NONE),
        _text(attributes.get(semconv.COLLECTIVE_OP, event["name"])),
        _text(attributes.get(semconv.PROCESS_GROUP_NAME)),
        _text(attributes.get(semconv.DEVICE_MESH_DIM_NAME)),
        _text(attributes.get(semconv.COLLECTIVE_DTYPE)),
        _text(attributes.get(semconv.DTENSOR_CAUSE)),
        _text(attributes.get(semconv.DTENSOR_SOURCE_PLACEMENTS)),
        _text(attributes.get(semconv.DTENSOR_TARGET_PLACEMENTS)),
    )


def tally_spans(spans: list[dict], include_warmup: bool = False, whole: bool = False,
                times: bool = False) -> dict[int, Tally]:
    """Each rank's collectives, per entry key, from span dicts (:class:`.otlp_json.SpanReader`'s).

    Args:
        spans: span dicts with ``rank``; spans of stall snapshots are left out here.
        include_warmup: count the first traced step too (files only; see the module docstring).
        whole: count every collective in ``spans`` (a live recording: one block), over the steps
            it holds (at least 1), instead of only those under counted ``train_step`` spans.
        times: keep each collective's issue duration (:attr:`Tally.durations_s`).

    Returns:
        ``{rank: Tally}`` for every rank with a counted step or collective.
    """
    spans = [span for span in spans if not is_snapshot(span)]
    index = SpanIndex(spans)
    warmup = None if include_warmup or whole else warmup_step(spans)
    steps: dict[int, set[int]] = defaultdict(set)
    for span in spans:
        step = index.step(span)
        if step is not None and step != warmup:
            steps[span["rank"]].add(step)
    tallies: dict[int, Tally] = {}
    for event in collective_events(spans):
        attributes = event["attributes"]
        if attributes.get(semconv.COLLECTIVE_FAKE) is True:
            continue
        if not whole:
            step = index.step(event["span"])
            if step is None or step == warmup:
                continue
        rank = event["rank"]
        tally = tallies.get(rank)
        if tally is None:
            tally = tallies[rank] = Tally()
        key = _entry_key(event)
        total = tally.counts.get(key)
        if total is None:
            total = tally.counts[key] = [0, 0]
        total[0] += 1
        total[1] += int(attributes.get(semconv.COLLECTIVE_BYTES, 0))
        if times:
            tally.durations_s.setdefault(key, []).append(float(attributes.get(semconv.COLLECTIVE_DURATION, 0.0)))
    for rank in steps:
        tallies.setdefault(rank, Tally())
    for rank, tally in tallies.items():
        tally.steps = max(len(steps.get(rank, ())), 1 if whole or tally.counts else 0)
    return tallies


def _per_step(total: int, steps: int) -> int | float:
    if steps <= 0 or total % steps == 0:
        return total // max(steps, 1)
    return round(total / steps, _DECIMALS)


def build(tallies: Mapping[int, Tally], world_size: int | None = None, times: bool = False) -> dict[str, Any]:
    """The signature document of per-rank tallies (:func:`tally_spans`, or gathered from live ranks).

    ``world_size``: the job's (default: the number of ranks tallied). ``times``: add the ``times``
    section (the tallies must hold durations).
    """
    values: dict[tuple, list[int]] = defaultdict(list)  # (key, count/step, bytes/step) -> ranks
    for rank, tally in tallies.items():
        for key, (count, nbytes) in tally.counts.items():
            values[(key, _per_step(count, tally.steps), _per_step(nbytes, tally.steps))].append(rank)
    entries = []
    for (key, count, nbytes), ranks in sorted(values.items(), key=lambda item: (item[0][0], sorted(item[1]))):
        entry: dict[str, Any] = dict(zip(KEY_FIELDS, key))
        entry["count_per_step"] = count
        entry["bytes_per_step"] = nbytes
        entry["ranks"] = sorted(ranks)
        entries.append(entry)
    document: dict[str, Any] = {
        "format": FORMAT,
        "world_size": world_size if world_size is not None else len(tallies),
        "steps": max((tally.steps for tally in tallies.values()), default=0),
        "entries": entries,
    }
    if times:
        durations: dict[Key, list[float]] = defaultdict(list)
        for tally in tallies.values():
            for key, found in tally.durations_s.items():
                durations[key].extend(found)
        document["times"] = [
            {**dict(zip(KEY_FIELDS, key)), "n": len(found), "min_s": min(found),
             "median_s": statistics.median(found), "max_s": max(found)}
            for key, found in sorted(durations.items())]
    return document


def _world_size(spans: list[dict], tallies: Mapping[int, Tally]) -> int:
    """The job's size: the resource's ``torch.distributed.world_size``, else the ranks seen."""
    sizes = {span["resource"].get(semconv.WORLD_SIZE) for span in spans if isinstance(span.get("resource"), dict)}
    sizes = {size for size in sizes if isinstance(size, int) and size > 0}
    if sizes:
        return max(sizes)
    return max(len(tallies), len({span["rank"] for span in spans}))


def signature_of_spans(spans: list[dict], include_warmup: bool = False, times: bool = False) -> dict[str, Any]:
    """The signature document of span dicts from files (see :func:`tally_spans`)."""
    tallies = tally_spans(spans, include_warmup=include_warmup, times=times)
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
        processes[span["rank"]].add((str(resource.get("host.name")), str(resource.get("process.pid"))))
    rank, seen = max(processes.items(), key=lambda item: (len(item[1]), -item[0]), default=(0, set()))
    if len(seen) < 2:
        return None
    return f"rank {rank} has spans from {len(seen)} processes: several runs are mixed; pass one run's folder"


def _is_signature(document: Any) -> bool:
    return isinstance(document, dict) and document.get("format") == FORMAT


def _checked(document: dict, path: str) -> dict[str, Any]:
    """A signature document read from a file, its fields checked (compare must not fail half-way)."""
    entries = document.get("entries")
    if not isinstance(entries, list):
        raise SignatureError(f"{path}: 'entries' is not a list")
    for number, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise SignatureError(f"{path}: entry {number} is not an object")
        for name in KEY_FIELDS:
            if not isinstance(entry.get(name, ""), str):
                raise SignatureError(f"{path}: entry {number}: {name!r} is not a string")
        for name in ("count_per_step", "bytes_per_step"):
            value = entry.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SignatureError(f"{path}: entry {number}: {name!r} is not a number")
        ranks = entry.get("ranks", [0])
        if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise SignatureError(f"{path}: entry {number}: 'ranks' is not a list of integers")
    return document


def load(path: str | os.PathLike, include_warmup: bool = False, messages: list[str] | None = None
         ) -> dict[str, Any]:
    """A signature: a signature file as it is, or one made from a run folder or OTLP-JSON trace files.

    Args:
        path: a signature file (``format`` :data:`FORMAT`), or a folder or file of OTLP-JSON spans.
        include_warmup: for spans, as :func:`tally_spans`.
        messages: what the span reader skipped is appended to it.

    Raises:
        SignatureError: the path does not exist, is another format's JSON, holds spans of several runs
            (:func:`mixed_runs`), or holds no spans (then
            what the reader skipped is in its message, not in ``messages``).
    """
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.getsize(path) <= MAX_SIGNATURE_BYTES:
        try:
            with open(path, encoding="utf-8") as handle:
                document = json.load(handle)
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            document = None  # one OTLP-JSON line per line, or not JSON: the span reader says which
        if _is_signature(document):
            return _checked(document, path)
        if isinstance(document, dict) and "format" in document:
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
    return signature_of_spans(spans, include_warmup)


# ------------------------------------------------------------------ compare


def _by_rank(document: dict) -> dict[Key, dict[int, tuple[float, float]]]:
    """``{entry key: {rank: (count_per_step, bytes_per_step)}}``."""
    out: dict[Key, dict[int, tuple[float, float]]] = defaultdict(dict)
    for entry in document.get("entries", []):
        key = tuple(str(entry.get(name, "")) for name in KEY_FIELDS)
        for rank in entry.get("ranks", [0]):
            out[key][rank] = (entry["count_per_step"], entry["bytes_per_step"])
    return out


def _within(base: float, new: float, absolute: float = 0.0, relative: float = 0.0) -> bool:
    return abs(new - base) <= max(absolute, relative * abs(base))


def compare(base: dict, new: dict, count_tolerance: float = 0.0, bytes_tolerance: float = 0.0) -> dict[str, Any]:
    """What differs between two signature documents.

    Entries are compared per key and rank: a key on a rank only in ``new`` appeared, only in
    ``base`` disappeared; a count or byte figure that moved beyond its tolerance changed. Ranks
    with the same difference share one row.

    Args:
        count_tolerance: collectives per step a count may move by and stay equal (absolute, >= 0).
        bytes_tolerance: the share of the base's bytes per step they may move by (e.g. 0.05), >= 0.

    Returns:
        ``{"equal": bool, "world_size": [base, new], "steps": [base, new], "appeared": [entry],
        "disappeared": [entry], "changed": [{key fields..., "ranks", "base": {"count_per_step",
        "bytes_per_step"}, "new": {...}}]}``; entries as in a signature (with their ranks). A
        different world size makes the documents different; different step counts do not (figures
        are per step).

    Raises:
        ValueError: a negative tolerance.
    """
    if count_tolerance < 0 or bytes_tolerance < 0:
        raise ValueError(f"tolerances must be >= 0, got count {count_tolerance}, bytes {bytes_tolerance}")
    old_ranks, new_ranks = _by_rank(base), _by_rank(new)
    rows: dict[str, dict[tuple, list[int]]] = {"appeared": defaultdict(list), "disappeared": defaultdict(list),
                                                "changed": defaultdict(list)}
    for key in sorted(set(old_ranks) | set(new_ranks)):
        before, after = old_ranks.get(key, {}), new_ranks.get(key, {})
        for rank in sorted(set(before) | set(after)):
            if rank not in before:
                rows["appeared"][(key, after[rank])].append(rank)
            elif rank not in after:
                rows["disappeared"][(key, before[rank])].append(rank)
            else:
                (count_a, bytes_a), (count_b, bytes_b) = before[rank], after[rank]
                if not (_within(count_a, count_b, absolute=count_tolerance)
                        and _within(bytes_a, bytes_b, relative=bytes_tolerance)):
                    rows["changed"][(key, before[rank], after[rank])].append(rank)

    def entry(key: Key, figures: tuple, ranks: list[int]) -> dict[str, Any]:
        return {**dict(zip(KEY_FIELDS, key)), "count_per_step": figures[0], "bytes_per_step": figures[1],
                "ranks": ranks}

    def figures(pair: tuple) -> dict[str, float]:
        return {"count_per_step": pair[0], "bytes_per_step": pair[1]}

    world = [base.get("world_size"), new.get("world_size")]
    diff: dict[str, Any] = {
        "world_size": world,
        "steps": [base.get("steps"), new.get("steps")],
        "appeared": [entry(key, value, ranks) for (key, value), ranks in rows["appeared"].items()],
        "disappeared": [entry(key, value, ranks) for (key, value), ranks in rows["disappeared"].items()],
        "changed": [{**dict(zip(KEY_FIELDS, key)), "ranks": ranks, "base": figures(old), "new": figures(now)}
                    for (key, old, now), ranks in rows["changed"].items()],
    }
    diff["equal"] = world[0] == world[1] and not (diff["appeared"] or diff["disappeared"] or diff["changed"])
    return {"equal": diff.pop("equal"), **diff}


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


def format_diff(diff: dict, base_name: str = "base", new_name: str = "new") -> str:
    """The diff as text a person reads: one line per row, ``+`` appeared, ``-`` disappeared, ``~`` changed.

    Returns ``""`` when the signatures are equal.
    """
    if diff["equal"]:
        return ""
    counts = f"{len(diff['appeared'])} appeared, {len(diff['disappeared'])} disappeared, " \
             f"{len(diff['changed'])} changed"
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
    parser.add_argument("--include-warmup", action="store_true",
                        help="count the first traced step too (left out by default, as summarize leaves it out "
                             "of stragglers: it runs cold)")
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
    text = to_json(signature_of_spans(spans, args.include_warmup, args.times))
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_DONE
    return write_output("signature", args.output, text)
