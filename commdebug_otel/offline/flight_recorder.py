"""torch's Flight Recorder dumps joined with our spans: what FR knows, plus module, pass, step and DTensor why.

torch's Flight Recorder (on by default; ``TORCH_FR_BUFFER_SIZE``) keeps, per rank, the last collectives each process
group issued: op (``profiling_name``, ``"nccl:all_reduce"``), ``collective_seq_id`` (1, 2, ... per
group; point-to-point ops count in ``p2p_seq_id`` instead), sizes, dtypes, state and whether it
finished (``retired``), and per group the last seq enqueued and completed (``pg_status``). It knows
nothing of modules. Our spans know the module, pass, step and DTensor redistribution of each
collective, numbered by ``torch.collective.seq`` (0, 1, ... per group, point-to-point ops included).
:func:`join` puts the two together by (rank, process group, seq) (docs/diagnosis.md).

Only torch's JSON form is read (``_dump_fr_trace_json``: what the stall snapshot writes,
``commdebug-flight-recorder-rank<N>.json``). torch's own files (NCCL's watchdog dumps) are pickles:
they are read only with ``allow_pickle`` (``diagnose --flight-recorder-pickle``), and then by an
unpickler that refuses every class and function (a dump holds only dicts, lists, strings and
numbers), so a hostile file cannot run code. Any file is survived: what cannot be read is said in
the messages and left out.
"""

from __future__ import annotations

import bisect
import io
import json
import os
import pickle
import re
import stat
from collections import Counter, defaultdict
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.offline.model import CollectiveEvent, SpanIndex, collective_events, is_snapshot

__all__ = ["MAX_DUMP_BYTES", "dump_files", "join", "read_dumps"]

# Our collectives of one rank and group looked at, latest arrival first, to find the one an FR entry was made in.
_OVERLAP = 8
#: Entries of each list in the text report (JSON has them all).
TEXT_ROWS = 10
#: A dump larger than this is not read (torch's default buffer of 2,000 entries is well under 10 MiB).
MAX_DUMP_BYTES = 256 << 20
_OURS = semconv.FLIGHT_RECORDER_FILE_PREFIX  # the stall snapshot's dumps
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.json)?$")
# FR's op names (``profiling_name`` after the backend's ``nccl:``) that differ from ours.
_FR_OPS = {"allreduce": semconv.ALL_REDUCE, "allgather": semconv.ALL_GATHER, "allgather_base": semconv.ALL_GATHER,
           "all_gather_into_tensor": semconv.ALL_GATHER, "reduce_scatter_base": semconv.REDUCE_SCATTER,
           "reduce_scatter_tensor": semconv.REDUCE_SCATTER, "alltoall": semconv.ALL_TO_ALL,
           "alltoall_base": semconv.ALL_TO_ALL, "all_to_all_single": semconv.ALL_TO_ALL}


def dump_files(paths: list[str], explicit: list[str]) -> list[str]:
    """The dumps to read: each of ``explicit`` (a file, or every file in a folder), and the
    ``commdebug-flight-recorder-rank<N>.json`` files under ``paths`` (the trace files and folders)."""
    found: list[str] = []
    for path in explicit:
        if os.path.isdir(path):
            found += _walk(path, lambda name: True)
        else:
            found.append(path)
    for path in paths:
        if os.path.isdir(path):
            found += _walk(path, lambda name: name.startswith(_OURS) and name.endswith(".json"))
        elif os.path.basename(path).startswith(_OURS):
            found.append(path)
    unique: dict[str, str] = {}  # each file once, however it was named
    for path in found:
        unique.setdefault(os.path.realpath(path), path)
    return list(unique.values())


def _walk(folder: str, wanted: Any) -> list[str]:
    out = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        out += [os.path.join(root, name) for name in sorted(names) if wanted(name)]
    return out


class _NoGlobals(pickle.Unpickler):
    """torch's pickled dump holds plain data only: any class or function is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a Flight Recorder dump holds no objects")


def _decode(data: bytes, allow_pickle: bool) -> Any:
    """The dump's dict; raises ValueError (with why) when it is none."""
    text = data.lstrip()
    if text[:1] in (b"{", b"["):
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as error:
            raise ValueError(f"not valid JSON ({str(error)[:80]})") from None
    if not allow_pickle:
        raise ValueError("not JSON (a pickled dump? only with --flight-recorder-pickle, which reads it "
                         "without loading any class or function)")
    try:
        return _NoGlobals(io.BytesIO(data)).load()
    except Exception as error:  # any damage a pickle can have
        raise ValueError(f"not a readable pickle ({type(error).__name__}: {str(error)[:80]})") from None


def _int(value: Any, default: int | None = None) -> int | None:
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit() and len(value) < 30:
        return int(value)
    return default


def _sizes(value: Any) -> list:
    if not isinstance(value, list):
        return []
    return [[n for n in shape if isinstance(n, int) and not isinstance(n, bool)] if isinstance(shape, list) else []
            for shape in value[:64]]


def _entry(raw: Any) -> dict[str, Any] | None:
    """One FR entry as plain, checked data; None when it has no process group or seq."""
    if not isinstance(raw, dict):
        return None
    group = raw.get("process_group")
    if isinstance(group, (list, tuple)) and group and isinstance(group[0], (str, int)):
        name, desc = str(group[0]), str(group[1]) if len(group) > 1 and isinstance(group[1], str) else ""
    else:
        return None
    seq = _int(raw.get("collective_seq_id"))
    if seq is None:
        return None
    profiling = raw.get("profiling_name")
    profiling = profiling if isinstance(profiling, str) else ""
    dtypes = raw.get("input_dtypes")
    return {
        "group": name[:256], "group_desc": desc[:256], "fr_seq": seq, "p2p_seq": _int(raw.get("p2p_seq_id"), 0),
        "is_p2p": raw.get("is_p2p") is True, "fr_op": profiling[:256], "op": fr_op(profiling),
        "state": str(raw.get("state", ""))[:32], "retired": raw.get("retired") is True,
        "record_id": _int(raw.get("record_id")), "time_created_ns": _int(raw.get("time_created_ns"), 0),
        "input_sizes": _sizes(raw.get("input_sizes")), "output_sizes": _sizes(raw.get("output_sizes")),
        "input_dtypes": [str(d)[:32] for d in dtypes[:64]] if isinstance(dtypes, list) else [],
        "timeout_ms": _int(raw.get("timeout_ms")),
    }


def fr_op(profiling_name: str) -> str:
    """Our op name for FR's ``profiling_name`` (``"nccl:_allgather_base"`` -> ``"all_gather"``), best effort."""
    op = profiling_name.split(":", 1)[-1].strip().split(" ", 1)[0].lstrip("_")
    op = op.removesuffix("_coalesced")
    return _FR_OPS.get(op, op)


def _read_one(path: str, allow_pickle: bool) -> dict[str, Any]:
    """``{"rank", "file", "entries", "pg_status", "version", "skipped"}``; raises ValueError (with why)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("not a regular file (not opened)")
    if info.st_size > MAX_DUMP_BYTES:
        raise ValueError(f"larger than {MAX_DUMP_BYTES >> 20} MiB")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file (not read)")
        data = handle.read(MAX_DUMP_BYTES + 1)
    dump = _decode(data, allow_pickle)
    # torch leaves "entries" out of an empty buffer's dump (its "version" is there).
    raw_entries = dump.get("entries", [] if "version" in dump else None) if isinstance(dump, dict) else None
    if not isinstance(raw_entries, list):
        raise ValueError("no Flight Recorder entries (an object with an \"entries\" list)")
    named = _RANK_IN_NAME.search(os.path.basename(path))
    rank = _int(dump.get("rank")) if named is None else int(named.group(1)) if len(named.group(1)) < 10 else -1
    if rank is None or not 0 <= rank < 1 << 31:
        raise ValueError("no rank: its name does not end in the rank (torch's <prefix><rank>)")
    entries = [_entry(raw) for raw in raw_entries]
    status = dump.get("pg_status")
    pg_status = {}
    if isinstance(status, dict):
        for group, values in list(status.items())[:4096]:
            if isinstance(values, dict):
                pg_status[str(group)[:256]] = {
                    key: _int(values.get(f"last_{key}_collective"), -1) for key in ("enqueued", "completed")}
    return {"rank": rank, "file": path, "entries": [entry for entry in entries if entry is not None],
            "skipped": sum(entry is None for entry in entries), "pg_status": pg_status,
            "version": str(dump.get("version", ""))[:32]}


def read_dumps(files: list[str], allow_pickle: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """Read Flight Recorder dumps; never raises on a file's content.

    Returns:
        ``(dumps, messages)``: dumps as ``{"rank", "file", "entries" ([{"group", "group_desc", "fr_seq",
        "p2p_seq", "is_p2p", "fr_op", "op", "state", "retired", "record_id", "time_created_ns",
        "input_sizes", "output_sizes", "input_dtypes", "timeout_ms"}]), "skipped" (entries without a group
        or seq), "pg_status" ({group: {"enqueued", "completed"}}: FR's last seqs, -1 none), "version"}``;
        messages: one line per file skipped or partly read, and why.
    """
    dumps, messages = [], []
    for path in files:
        try:
            dump = _read_one(path, allow_pickle)
        except (OSError, ValueError, RecursionError, MemoryError) as error:
            why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            messages.append(f"skipped Flight Recorder dump {path}: {why}")
            continue
        if dump["skipped"]:
            messages.append(f"skipped {dump['skipped']} Flight Recorder entries in {path}: no process group or seq")
        dumps.append(dump)
    return dumps, messages


def _why(attrs: dict) -> dict[str, str]:
    keys = (("cause", semconv.DTENSOR_CAUSE), ("source", semconv.DTENSOR_SOURCE_PLACEMENTS),
            ("target", semconv.DTENSOR_TARGET_PLACEMENTS), ("dtensor_op", semconv.DTENSOR_OP))
    return {name: str(attrs[key]) for name, key in keys if key in attrs}


def _our_events(spans: list[dict]) -> dict[tuple[int, str], list[tuple[int, int, int, str, CollectiveEvent]]]:
    """Per (rank, group): ``(seq, arrival ns, return ns, op, event)`` of our collectives, finished spans'
    events before snapshots' (a snapshot copies a step's spans; its in-flight events have no return)."""
    out: dict[tuple[int, str], list] = defaultdict(list)
    events = collective_events(spans)
    for event in sorted(events, key=lambda event: is_snapshot(event.span)):
        seq = event.seq
        if seq is not None:
            out[(event.rank, event.group)].append((seq, event.issued_ns, event.time_ns, event.name, event))
    return out


def _offset(entries: list[dict], ours: list[tuple], by_seq: dict[int, tuple]) -> int:
    """How far our seq is from FR's position (``collective_seq_id + p2p_seq_id - 1``) on one rank's group.

    0 when both counted the same collectives from the group's start. Else (our tracer started after
    collectives were issued; gloo leaves point-to-point ops out of FR) learned from the collectives
    FR created while one of ours of the same op was being issued on that rank (same clock): the most
    common difference, preferring 0 on a tie.
    """
    votes: Counter = Counter()
    by_arrival = sorted(ours, key=lambda item: item[1])
    arrivals = [item[1] for item in by_arrival]
    for entry in entries:
        position = entry["fr_seq"] + entry["p2p_seq"] - 1
        created = entry["time_created_ns"]
        mine = by_seq.get(position)
        if mine is not None and mine[3] == entry["op"] and mine[1] <= created <= mine[2]:
            votes[0] += 1
            continue
        # The collectives of ours that arrived last before it was created (a few overlap: asynchronous ones).
        at = bisect.bisect_right(arrivals, created)
        for seq, arrived, returned, op, _ in reversed(by_arrival[max(0, at - _OVERLAP):at]):
            if op == entry["op"] and arrived <= created <= max(returned, arrived):
                votes[seq - position] += 1
                break
    if not votes:
        return 0
    best = max(votes.values())
    return 0 if votes.get(0) == best else votes.most_common(1)[0][0]


def join(spans: list[dict], dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """FR's entries with our spans' facts, by (rank, process group, seq).

    An entry's seq in our numbering is ``collective_seq_id + p2p_seq_id - 1`` (FR counts from 1, and
    NCCL's point-to-point ops apart), shifted by the rank and group's learned offset
    (:func:`_offset`). Joined, an entry gets our ``seq``, ``op``, ``module``, ``pass``, ``step``
    (``torch.step`` of its ``train_step``) and ``why`` (the DTensor redistribution: ``cause``,
    ``source``/``target`` placements, ``dtensor_op``), and ``agrees``: whether FR's op is ours.

    Returns:
        ``{"dumps": [{"rank", "file", "entries" (count), "pg_status"}], "entries": n, "joined": n,
        "desyncs": [{"group", "fr_seq", "ranks": {rank: entry}}] (per group, the first FR seq where ranks'
        dumps hold different ops), "pending": [entry...] (FR entries not retired: issued, not known
        finished, oldest first),
        "disagree": [entry...] (joined, but FR's op is not ours: a desync, or a numbering this join
        cannot follow), "last": [entry...] (each rank and group's last entry)}``; entries as
        :func:`read_dumps` makes them, plus ``rank``, ``seq`` (ours, or None) and, where joined, the
        facts above.
    """
    ours = _our_events(spans)
    steps = SpanIndex(spans)
    out_entries: list[dict] = []
    joined = 0
    for dump in dumps:
        rank = dump["rank"]
        by_group: dict[str, list[dict]] = defaultdict(list)
        for entry in dump["entries"]:
            by_group[entry["group"]].append(entry)
        for group, entries in by_group.items():
            mine = ours.get((rank, group), [])
            by_seq: dict[int, tuple] = {}
            for item in mine:
                by_seq.setdefault(item[0], item)
            offset = _offset(entries, mine, by_seq)
            for entry in entries:
                seq = entry["fr_seq"] + entry["p2p_seq"] - 1 + offset
                found = by_seq.get(seq)
                facts = dict(entry, rank=rank, seq=seq if found else None)
                if found is not None:
                    joined += 1
                    event, span = found[4], found[4].span
                    module, pass_ = event.module, event.pass_
                    facts |= {"our_op": found[3],
                              "agrees": found[3] == entry["op"] if entry["op"] in _KNOWN_OPS else None,
                              "module": module if module is not None else str(
                                  span["attributes"].get(semconv.MODULE_FQN, "")),
                              "pass": pass_ if pass_ is not None else str(
                                  span["attributes"].get(semconv.MODULE_PASS, "")),
                              "step": steps.step(span), "why": _why(event.attributes)}
                out_entries.append(facts)
    last: dict[tuple[int, str], dict] = {}
    for entry in out_entries:
        key = (entry["rank"], entry["group"])
        if key not in last or (entry["fr_seq"], entry["p2p_seq"]) >= (last[key]["fr_seq"], last[key]["p2p_seq"]):
            last[key] = entry
    return {
        "dumps": [{"rank": d["rank"], "file": d["file"], "entries": len(d["entries"]), "pg_status": d["pg_status"]}
                  for d in sorted(dumps, key=lambda d: (d["rank"], d["file"]))],
        "entries": len(out_entries), "joined": joined, "desyncs": _desyncs(out_entries),
        "pending": sorted((e for e in out_entries if not e["retired"]),
                          key=lambda e: (e["time_created_ns"], e["rank"])),
        "disagree": [e for e in out_entries if e.get("agrees") is False],
        "last": [last[key] for key in sorted(last)],
    }


def _desyncs(entries: list[dict]) -> list[dict[str, Any]]:
    """Per process group, the first FR seq at which ranks' dumps hold different ops (point-to-point left out):
    ``[{"group", "fr_seq", "ranks": {rank: entry}}]``, by group."""
    by_seq: dict[tuple[str, int], dict[int, dict]] = defaultdict(dict)
    for entry in entries:
        if not entry["is_p2p"]:
            by_seq[(entry["group"], entry["fr_seq"])].setdefault(entry["rank"], entry)
    first: dict[str, tuple[int, dict[int, dict]]] = {}
    for (group, seq), ranks in by_seq.items():
        if len({entry["fr_op"] for entry in ranks.values()}) > 1 and (group not in first or seq < first[group][0]):
            first[group] = (seq, ranks)
    return [{"group": group, "fr_seq": seq, "ranks": {rank: ranks[rank] for rank in sorted(ranks)}}
            for group, (seq, ranks) in sorted(first.items())]


# Our canonical op names: an FR op outside them (a backend's own name) is not called a disagreement.
_KNOWN_OPS = frozenset({semconv.ALL_REDUCE, semconv.ALL_GATHER, semconv.REDUCE_SCATTER, semconv.ALL_TO_ALL,
                        semconv.BROADCAST, semconv.REDUCE, semconv.GATHER, semconv.SCATTER, semconv.SEND,
                        semconv.RECV, semconv.BARRIER})


def format_text(found: dict[str, Any]) -> list[str]:
    """The Flight Recorder section of ``diagnose``'s text report (lines)."""
    ranks = sorted({dump["rank"] for dump in found["dumps"]})
    span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]} to {ranks[-1]}" if ranks else "no rank"
    out = [f"Flight Recorder: {len(found['dumps'])} dump(s) of {span}, {found['entries']} entries, "
           f"{found['joined']} joined with our spans by (process group, seq)"]
    enqueued: dict[str, dict[int, int]] = defaultdict(dict)
    for dump in found["dumps"]:
        for group, values in dump["pg_status"].items():
            enqueued[group][dump["rank"]] = values["enqueued"]
    for group, by_rank in sorted(enqueued.items()):
        low, high = min(by_rank.values()), max(by_rank.values())
        if low == high:
            out.append(f"  group {group}: every dump's rank enqueued FR seq {low}")
        else:
            behind = [rank for rank, seq in sorted(by_rank.items()) if seq == low]
            out.append(f"  group {group}: rank(s) {', '.join(map(str, behind[:16]))}"
                       f"{' ...' if len(behind) > 16 else ''} enqueued FR seq {low}, others up to {high}")
    for desync in found["desyncs"]:
        out.append(f"  desync on group {desync['group']} at FR seq {desync['fr_seq']}: ranks issued different ops")
        out += [f"    {_entry_text(entry)}" for entry in list(desync["ranks"].values())[:TEXT_ROWS]]
    for title, entries in (("not finished (FR: not retired)", found["pending"]),
                           ("FR's op differs from ours at the same seq (a desync, or numbering this join cannot "
                            "follow)", found["disagree"])):
        if entries:
            out.append(f"  {title}:")
            out += [f"    {_entry_text(entry)}" for entry in entries[:TEXT_ROWS]]
            if len(entries) > TEXT_ROWS:
                out.append(f"    ... {len(entries) - TEXT_ROWS} more (--format json has them all)")
    return out


def _entry_text(entry: dict) -> str:
    shape = f" {entry['input_dtypes'][0]} {entry['input_sizes'][0]}" if entry["input_dtypes"] and entry[
        "input_sizes"] else ""
    desc = f" ({entry['group_desc']})" if entry["group_desc"] else ""
    text = (f"rank {entry['rank']}: {entry['fr_op'] or '?'} on group {entry['group']}{desc}, FR seq "
            f"{entry['fr_seq']}{shape}, {entry['state'] or '?'}")
    if entry.get("seq") is None:
        return text + " -> not in our spans"
    where = entry["module"] or "(no module)"
    text += f" -> our seq {entry['seq']} {entry['our_op']} in {where}"
    text += f" ({entry['pass']})" if entry["pass"] else ""
    text += f", step {entry['step']}" if entry["step"] is not None else ""
    why = entry["why"]
    if why:
        text += f", why: {why.get('cause', '?')}"
        if "source" in why or "target" in why:
            text += f" {why.get('source', '?')} -> {why.get('target', '?')}"
    return text
