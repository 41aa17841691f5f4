"""Communication signatures (``commdebug-otel signature``) and their diffs (``commdebug-otel compare``):
from real 2-rank runs of pytorch/examples' tensor- and sequence-parallel model (runs of 3, 5 and 8 steps
among them), and from hand-built spans."""

import json

import pytest
import torch

from commdebug_otel import semconv
from commdebug_otel.cli import main
from commdebug_otel.offline import signature

from distributed import run_ranks
from models import ToyModel, toy_plan
from otlp_files import span, write_otlp

_STYLES = ("tp", "sp", "tp_sp_out")
_STEPS = 3
_RUNS = 3


def _toy_job(rank, world_size, out_dirs):
    """Each style in its own output folder: _STEPS optimizer steps of the example model, every step traced."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from commdebug_otel import CommTracer, Settings

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for style in _STYLES:
        torch.manual_seed(0)
        model = parallelize_module(ToyModel(), mesh, toy_plan(style))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        tracer = CommTracer(Settings(output_dir=out_dirs[style]))
        with tracer:
            for _ in range(_STEPS):
                model(torch.rand(4, 10)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        tracer.telemetry.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs of the same code: ``[{style: run folder}]``."""
    out = []
    for number in range(_RUNS):
        dirs = {style: str(tmp_path_factory.mktemp(f"{style}-{number}")) for style in _STYLES}
        run_ranks(_toy_job, 2, dirs)
        out.append(dirs)
    return out


def _entry(module, pass_, op, count, nbytes, cause, source, target):
    return {"module": module, "pass": pass_, "op": op, "group": "0", "mesh_dim": "tp", "dtype": "float32",
            "cause": cause, "source_placements": source, "target_placements": target,
            "count_per_step": count, "bytes_per_step": nbytes, "ranks": [0, 1]}


_OUT_FW = "ToyModel.out_proj", "forward"
_OUT_BW = "ToyModel.out_proj", "backward"
_IN_FW = "ToyModel.in_proj", "forward"
_IN_BW = "ToyModel.in_proj", "backward"
_PARTIAL, _REPLICATE, _SHARD0 = "(Partial(sum),)", "(Replicate(),)", "(Shard(dim=0),)"
# RowwiseParallel's output all-reduce: a (4, 5) float32 output, 80 bytes.
_TP_ROWWISE_ALL_REDUCE = _entry(*_OUT_FW, "all_reduce", 1, 80, "redistribute", _PARTIAL, _REPLICATE)
# out_proj's output sequence-sharded instead: reduce-scatter of the (4, 5) partial output (80 bytes in), then
# in backward the gradient's (2, 5) shards gathered back (40 bytes).
_SP_OUT_REDUCE_SCATTER = _entry(*_OUT_FW, "reduce_scatter", 1, 80, "redistribute", _PARTIAL, _SHARD0)
_SP_OUT_GRAD_ALL_GATHER = _entry(*_OUT_BW, "all_gather", 1, 40, "redistribute", _SHARD0, _REPLICATE)
_EXPECTED = {
    "tp": [_TP_ROWWISE_ALL_REDUCE],
    # The sequence-parallel example: each rank's (4, 10) input is a shard of an (8, 10) one: in_proj gathers it
    # (160 bytes), out_proj reduce-scatters its (8, 5) partial output (160 bytes in) and gathers the gradient back.
    "sp": [
        _entry(*_IN_FW, "all_gather", 1, 160, "redistribute", _SHARD0, _REPLICATE),
        _entry(*_OUT_BW, "all_gather", 1, 80, "redistribute", _SHARD0, _REPLICATE),
        _entry(*_OUT_FW, "reduce_scatter", 1, 160, "redistribute", _PARTIAL, _SHARD0),
    ],
    "tp_sp_out": [_SP_OUT_GRAD_ALL_GATHER, _SP_OUT_REDUCE_SCATTER],
}


def _signature_file(path, tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    assert main(["signature", str(path), "-o", str(out), *extra]) == 0
    return out


@pytest.mark.parametrize("style", ["tp", "sp"])
def test_example_signatures_are_equal_over_three_runs(runs, tmp_path, style):
    files = [_signature_file(run[style], tmp_path, f"{style}{number}") for number, run in enumerate(runs)]
    texts = [file.read_text() for file in files]
    assert texts[0] == texts[1] == texts[2]
    assert texts[0].count("\"ranks\": [0, 1]") == len(_EXPECTED[style])  # one line per list of ranks
    document = json.loads(texts[0])
    # Every step communicates alike: the typical step, and none apart.
    assert document == {"format": signature.FORMAT, "world_size": 2, "entries": _EXPECTED[style],
                        "first_step": [], "last_step": [], "other_steps": []}
    assert main(["compare", str(files[0]), runs[2][style]]) == 0


def test_include_warmup_is_accepted_and_changes_nothing(runs, tmp_path):
    plain = _signature_file(runs[0]["tp"], tmp_path, "plain").read_text()
    assert _signature_file(runs[0]["tp"], tmp_path, "all", "--include-warmup").read_text() == plain
    assert main(["compare", str(tmp_path / "plain.json"), runs[0]["tp"], "--include-warmup"]) == 0


def test_switching_one_layers_style_gives_exactly_that_diff(runs, tmp_path, capsys):
    base = _signature_file(runs[0]["tp"], tmp_path, "base")
    capsys.readouterr()
    assert main(["compare", str(base), runs[1]["tp_sp_out"], "--format", "json"]) == 1
    diff = json.loads(capsys.readouterr().out)
    assert diff == {"equal": False, "world_size": [2, 2],
                    "appeared": [_SP_OUT_GRAD_ALL_GATHER, _SP_OUT_REDUCE_SCATTER],
                    "disappeared": [_TP_ROWWISE_ALL_REDUCE], "changed": [], "first_step": [], "last_step": []}
    assert main(["compare", str(base), runs[1]["tp_sp_out"]]) == 1
    text = capsys.readouterr().out
    assert text.splitlines() == [
        f"communication differs ({runs[1]['tp_sp_out']} against {base}): 2 appeared, 1 disappeared, 0 changed",
        "+ ToyModel.out_proj backward  all_gather  group 0 (tp)  float32  cause redistribute (Shard(dim=0),) -> "
        "(Replicate(),): 1 per step, 40 bytes per step  ranks 0-1",
        "+ ToyModel.out_proj forward  reduce_scatter  group 0 (tp)  float32  cause redistribute (Partial(sum),) -> "
        "(Shard(dim=0),): 1 per step, 80 bytes per step  ranks 0-1",
        "- ToyModel.out_proj forward  all_reduce  group 0 (tp)  float32  cause redistribute (Partial(sum),) -> "
        "(Replicate(),): 1 per step, 80 bytes per step  ranks 0-1",
    ]


# ------------------------------------------------------------- hand-built spans


def _step_spans(rank, step, events, module="M.lin", pass_="forward"):
    """A train_step and one module span under it holding ``events`` (collective attribute dicts)."""
    root = f"s{step}"
    return [span(rank, "train_step", root, trace=f"t{step}", world_size=2, **{semconv.STEP: step}),
            span(rank, f"{module} {pass_}", f"m{step}", parent=root, trace=f"t{step}", world_size=2,
                 events=[(1000 + n, attrs) for n, attrs in enumerate(events)],
                 **{semconv.MODULE_FQN: module, semconv.MODULE_PASS: pass_})]


def _all_reduce(nbytes, group="0", issue_s=0.001):
    return {semconv.COLLECTIVE_OP: "all_reduce", semconv.PROCESS_GROUP_NAME: group, semconv.PROCESS_GROUP_SIZE: 2,
            semconv.COLLECTIVE_DTYPE: "bfloat16", semconv.COLLECTIVE_BYTES: nbytes,
            semconv.COLLECTIVE_DURATION: issue_s}


def _job(per_step_events):
    """Steps 0, 1, ... of ranks 0, 1, ...: ``per_step_events[step][rank]`` is that step's events on that rank."""
    spans = []
    for step, per_rank in enumerate(per_step_events):
        for rank, events in enumerate(per_rank):
            spans += _step_spans(rank, step, events)
    return spans


def _bare(module="M.lin", count=1, nbytes=8, ranks=(0, 1)):
    return {"module": module, "pass": "forward", "op": "all_reduce", "group": "0", "mesh_dim": "", "dtype": "bfloat16",
            "cause": "", "source_placements": "", "target_placements": "", "count_per_step": count,
            "bytes_per_step": nbytes, "ranks": list(ranks)}


def _apart(module="M.lin", count=1, nbytes=8, ranks=(0, 1), steps=None):
    """An entry of first_step, last_step (or other_steps, with ``steps``): a difference from the typical step."""
    entry = {**_bare(module, ranks=ranks), "count_delta": count, "bytes_delta": nbytes}
    del entry["count_per_step"], entry["bytes_per_step"]
    if steps is not None:
        entry["steps"] = list(steps)
    entry["ranks"] = entry.pop("ranks")
    return entry


def test_ranks_that_differ_get_their_own_entries_and_steps_apart_their_deltas():
    ar = _all_reduce
    spans = _job([[[ar(8)], [ar(8)]],
                  [[ar(8)], [ar(16)]],
                  [[ar(8), ar(8)], [ar(16)]]])
    document = signature.signature_of_spans(spans)
    # Rank 0: typical step 1 all_reduce of 8 bytes, its last step one more. Rank 1: typical 16 bytes, its first 8.
    assert document == _document(_bare(ranks=[0]), _bare(count=1, nbytes=16, ranks=[1]),
                                 first_step=[_apart(count=0, nbytes=-8, ranks=[1])],
                                 last_step=[_apart(count=1, nbytes=8, ranks=[0])])
    # The same spans in another order make the same document.
    assert signature.signature_of_spans(list(reversed(spans))) == document
    # Set-up collectives (outside any step) are not counted; snapshots neither.
    extra = [span(0, "outside_step", "o", trace="o", world_size=2, events=[(5, ar(99))]),
             span(0, "M.lin forward", "snap", trace="t1", world_size=2, events=[(6, ar(99))],
                  **{semconv.MODULE_FQN: "M.lin", semconv.SPAN_INCOMPLETE: True})]
    assert signature.signature_of_spans(spans + extra) == document


def test_times_only_when_asked_and_compare_ignores_them():
    spans = _job([[[_all_reduce(8, issue_s=0.5)], [_all_reduce(8, issue_s=0.1)]],
                  [[_all_reduce(8, issue_s=0.2)], [_all_reduce(8, issue_s=0.3)]]])
    plain = signature.signature_of_spans(spans)
    timed = signature.signature_of_spans(spans, times=True)
    assert "times" not in plain
    assert timed["times"] == [{**{name: _bare()[name] for name in signature.KEY_FIELDS},
                               "n": 4, "min_s": 0.1, "median_s": 0.25, "max_s": 0.5}]
    assert signature.compare(plain, timed)["equal"] is True


def _document(*entries, world_size=2, first_step=(), last_step=(), other_steps=()):
    return {"format": signature.FORMAT, "world_size": world_size, "entries": list(entries),
            "first_step": list(first_step), "last_step": list(last_step), "other_steps": list(other_steps)}


def test_compare_per_rank_with_tolerances():
    base = _document(_bare(count=4, nbytes=100))
    new = _document(_bare(count=5, nbytes=104, ranks=[1]), _bare(count=4, nbytes=100, ranks=[0]))
    diff = signature.compare(base, new)
    assert diff["changed"] == [{**{name: _bare()[name] for name in signature.KEY_FIELDS}, "ranks": [1],
                                "base": {"count_per_step": 4, "bytes_per_step": 100},
                                "new": {"count_per_step": 5, "bytes_per_step": 104}}]
    assert signature.format_diff(diff).splitlines()[1] == (
        "~ M.lin forward  all_reduce  group 0  bfloat16: count 4 -> 5 per step, bytes 100 -> 104 per step  ranks 1")
    assert not signature.compare(base, new, count_tolerance=1)["equal"]  # bytes moved 4 %
    assert signature.compare(base, new, count_tolerance=1, bytes_tolerance=0.04)["equal"]
    assert not signature.compare(base, new, count_tolerance=1, bytes_tolerance=0.03)["equal"]
    # Another world size is a difference.
    other = signature.compare(base, _document(_bare(count=4, nbytes=100), world_size=4))
    assert not other["equal"] and other["world_size"] == [2, 4]
    with pytest.raises(ValueError, match="tolerances"):
        signature.compare(base, new, count_tolerance=-1)


def test_cli_reads_files_and_folders_and_exits_2_when_it_cannot(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_otlp(_job([[[_all_reduce(8)], [_all_reduce(8)]], [[_all_reduce(8)], [_all_reduce(8)]]]),
               run / "traces.jsonl")
    sig = _signature_file(run, tmp_path, "sig")
    assert json.loads(sig.read_text()) == _document(_bare())
    assert main(["compare", str(sig), str(run)]) == 0
    assert "communication equal: 1 entries" in capsys.readouterr().out
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_document(_bare(count=2, nbytes=16))))
    assert main(["compare", str(sig), str(other), "--count-tolerance", "1", "--bytes-tolerance", "1"]) == 0
    assert main(["compare", str(sig), str(other)]) == 1
    capsys.readouterr()
    for bad, why in ((tmp_path / "missing", "no such file or folder"),
                     (tmp_path / "not-ours.json", "format 'x', expected 'commdebug-otel.signature/2'"),
                     (tmp_path / "broken.json", "entries[0]: 'count_per_step' is not a number"),
                     (tmp_path / "old.json", "format 'commdebug-otel.signature/1' (every step averaged, the first "
                      "and last steps in the average) is no longer read, expected 'commdebug-otel.signature/2': "
                      "write it again (pytest --comm-update, or commdebug-otel signature RUN -o FILE)\n"),
                     (tmp_path / "empty.jsonl", "neither a signature")):
        if bad.name == "not-ours.json":
            bad.write_text('{"format": "x"}')
        elif bad.name == "broken.json":
            bad.write_text(json.dumps(_document({**_bare(), "count_per_step": "1"})))
        elif bad.name == "old.json":
            bad.write_text(json.dumps({**_document(_bare()), "format": "commdebug-otel.signature/1"}))
        elif bad.name == "empty.jsonl":
            bad.write_text("")
        assert main(["compare", str(sig), str(bad)]) == 2
        assert why in capsys.readouterr().err
    assert main(["signature", str(tmp_path / "missing")]) == 2  # as compare


@pytest.mark.parametrize("option, value", [("--count-tolerance", "-1"), ("--bytes-tolerance", "x"),
                                           ("--bytes-tolerance", "nan")])
def test_compare_says_what_a_tolerance_accepts(tmp_path, capsys, option, value):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), option, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == f"commdebug-otel compare: error: argument {option}: expected a number >= 0, got {value!r}"


def test_a_folder_of_several_runs_is_refused_not_added_up(tmp_path, capsys):
    out = tmp_path / "commdebug-otel-out"
    for number in (1, 2):
        spans = _job([[[_all_reduce(8)], [_all_reduce(8)]], [[_all_reduce(8)], [_all_reduce(8)]]])
        for one in spans:
            one["resource"] = {**one["resource"], "host.name": "h", "process.pid": 100 * number + one["rank"]}
            one["trace_id"] = f"r{number}{one['trace_id']}"
        (out / f"run-{number}").mkdir(parents=True)
        write_otlp(spans, out / f"run-{number}" / "traces.jsonl")
    sig = _signature_file(out / "run-1", tmp_path, "sig")
    assert main(["compare", str(sig), str(out / "run-2")]) == 0
    capsys.readouterr()
    assert main(["compare", str(sig), str(out)]) == 2
    why = "rank 0 has spans from 2 processes: several runs are mixed; pass one run's folder"
    assert capsys.readouterr().err == f"commdebug-otel compare: {out}: {why}\n"
    assert main(["signature", str(out)]) == 2
    assert capsys.readouterr().err == f"commdebug-otel signature: {why}\n"


@pytest.mark.parametrize("content", [b"garbage\n", b"\x00\xff\xfe", b"[1, 2\n{\"a\": 1}\n"])
def test_compare_says_one_line_about_a_garbage_file(tmp_path, capsys, content):
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(content)
    sig = tmp_path / "sig.json"
    sig.write_text(json.dumps(_document(_bare())))
    assert main(["compare", str(sig), str(garbage)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"commdebug-otel compare: {garbage}: neither a signature"), err
    assert main(["signature", str(garbage)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("commdebug-otel signature: no spans found"), err


def test_a_large_file_is_read_as_spans_not_loaded_whole(tmp_path, monkeypatch):
    run = tmp_path / "traces.jsonl"
    write_otlp(_job([[[_all_reduce(8)], [_all_reduce(8)]]]), run)
    sig = tmp_path / "sig.json"
    sig.write_text(signature.to_json(_document(_bare())))
    monkeypatch.setattr(signature, "MAX_SIGNATURE_BYTES", 16)
    assert signature.load(run) == _document(_bare())
    with pytest.raises(signature.SignatureError, match="neither a signature"):
        signature.load(sig)  # over the limit: only spans are looked for


# ------------------------------------------------ the typical step, whatever the run's length

_LENGTHS = (3, 5, 8)


def _logging_job(rank, world_size, out_dirs):
    """The tp example model, ``steps`` optimizer steps per folder, a lazy 12-byte broadcast in the first step,
    the loss logged by an all_reduce after every step but the last (in the step's train_step_tail), and with
    ``extra`` one more 8-byte all_reduce per step. Each loop is also recorded live: the signatures returned."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing.signatures import record_signature

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))

    def model_and_optimizer():
        torch.manual_seed(0)
        model = parallelize_module(ToyModel(), mesh, toy_plan("tp"))
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def loop(model, optimizer, steps, extra):
        for step in range(steps):
            loss = model(torch.rand(4, 10)).sum()
            loss.backward()
            if step == 0:
                dist.broadcast(torch.zeros(3), 0)
            if extra:
                dist.all_reduce(torch.zeros(2))
            optimizer.step()
            optimizer.zero_grad()
            if step < steps - 1:
                dist.all_reduce(loss.detach())

    live = {}
    for (steps, extra), out in out_dirs.items():
        tracer = CommTracer(Settings(output_dir=out))
        with tracer:
            loop(*model_and_optimizer(), steps, extra)
        tracer.telemetry.shutdown()
        model, optimizer = model_and_optimizer()  # its set-up's collectives not in the block
        with record_signature() as recording:
            loop(model, optimizer, steps, extra)
        live[(steps, extra)] = recording.signature
    return live


@pytest.fixture(scope="module")
def logging_runs(tmp_path_factory):
    """``({(steps, extra): run folder}, {(steps, extra): live signature})`` of one 2-rank job."""
    dirs = {(steps, extra): str(tmp_path_factory.mktemp(f"logging-{steps}-{extra}"))
            for steps in _LENGTHS for extra in (False, True)}
    live = run_ranks(_logging_job, 2, dirs)
    assert live[0] == live[1]  # every rank gets the job's signature
    return dirs, live[0]


def _tail(count, nbytes, field_names=("count_per_step", "bytes_per_step"), module="train_step_tail", op="all_reduce"):
    return {"module": module, "pass": "none", "op": op, "group": "0", "mesh_dim": "tp", "dtype": "float32",
            "cause": "", "source_placements": "", "target_placements": "", field_names[0]: count,
            field_names[1]: nbytes, "ranks": [0, 1]}


_DELTAS = ("count_delta", "bytes_delta")
# The typical step: the rowwise all_reduce and the loss logged in the tail (4 bytes); the first step broadcasts 12
# bytes more, the last logs nothing.
_LOGGING = {"format": signature.FORMAT, "world_size": 2,
            "entries": [_TP_ROWWISE_ALL_REDUCE, _tail(1, 4)],
            "first_step": [_tail(1, 12, _DELTAS, "train_step", "broadcast")],
            "last_step": [_tail(-1, -4, _DELTAS)], "other_steps": []}


def test_runs_of_3_5_and_8_steps_give_one_signature(logging_runs, tmp_path, capsys):
    dirs, live = logging_runs
    texts = [_signature_file(dirs[(steps, False)], tmp_path, f"plain{steps}").read_text() for steps in _LENGTHS]
    assert texts[0] == texts[1] == texts[2]
    assert json.loads(texts[0]) == _LOGGING
    for steps in _LENGTHS:
        assert main(["compare", str(tmp_path / "plain3.json"), dirs[(steps, False)]]) == 0
        assert main(["compare", dirs[(8, False)], dirs[(steps, False)]]) == 0
    # Recorded live, the same loops give the same document too.
    assert live[(3, False)] == live[(5, False)] == live[(8, False)] == _LOGGING
    capsys.readouterr()

    # One collective more per step is a difference whatever the lengths compared.
    for steps in _LENGTHS:
        assert main(["compare", str(tmp_path / "plain8.json"), dirs[(steps, True)]]) == 1
    assert capsys.readouterr().out.splitlines()[-2:] == [
        f"communication differs ({dirs[(8, True)]} against {tmp_path / 'plain8.json'}): 1 appeared, 0 disappeared, "
        "0 changed",
        "+ train_step none  all_reduce  group 0 (tp)  float32: 1 per step, 8 bytes per step  ranks 0-1"]
    assert live[(3, True)] == live[(8, True)] == {**_LOGGING, "entries": [
        _TP_ROWWISE_ALL_REDUCE, _tail(1, 8, module="train_step"), _tail(1, 4)]}


def _edges_spans(first, last, middle=((8,),) * 3, other=None):
    """Spans of 2 ranks alike: steps of all_reduces of the given byte sizes: ``first``, ``middle``..., ``last``."""
    steps = [first, *middle, last]
    if other is not None:
        steps[other[0]] = other[1]
    return _job([[[_all_reduce(nbytes) for nbytes in sizes]] * 2 for sizes in steps])


def test_a_change_in_the_first_or_last_step_only_fails_unless_typical_only(tmp_path, capsys):
    base, new = tmp_path / "base", tmp_path / "new"
    for folder, spans in ((base, _edges_spans((8, 8), ())), (new, _edges_spans((8,), ()))):
        folder.mkdir()
        write_otlp(spans, folder / "traces.jsonl")
    document = signature.load(base)
    assert document == _document(_bare(), first_step=[_apart(count=1, nbytes=8)],
                                 last_step=[_apart(count=-1, nbytes=-8)])
    assert main(["compare", str(base), str(new)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"communication differs ({new} against {base}): 0 appeared, 0 disappeared, 0 changed, 1 in the first step",
        "first step ~ M.lin forward  all_reduce  group 0  bfloat16: +1 -> 0 collectives, +8 -> 0 bytes beside the "
        "typical step  ranks 0-1"]
    assert main(["compare", str(base), str(new), "--typical-only"]) == 0
    assert main(["compare", str(base), str(new), "--count-tolerance", "1", "--bytes-tolerance", "1"]) == 0
    diff = signature.compare(document, signature.load(new))
    assert diff["first_step"] == [{**{name: _bare()[name] for name in signature.KEY_FIELDS}, "ranks": [0, 1],
                                   "base": {"count_delta": 1, "bytes_delta": 8},
                                   "new": {"count_delta": 0, "bytes_delta": 0}}]
    assert diff["last_step"] == [] and diff["changed"] == []


def test_other_steps_are_listed_and_not_compared():
    # An every-few-steps collective (a checkpoint's) lands at step 2 of 5: listed by its step number.
    spans = _edges_spans((8,), (8,), middle=((8,), (8,), (8,)), other=(2, (8, 16)))
    document = signature.signature_of_spans(spans)
    assert document == _document(_bare(), other_steps=[_apart(count=1, nbytes=16, steps=[2])])
    assert signature.compare(document, signature.signature_of_spans(_edges_spans((8,), (8,))))["equal"]


@pytest.mark.parametrize("steps, expected", [
    # One step: it is the typical step. Two: the later one is, the first's difference apart.
    ([(8,)], _document(_bare())),
    ([(8, 8), (8,)], _document(_bare(), first_step=[_apart(count=1, nbytes=8)])),
    # Between first and last, the commonest step is typical; on a tie, the latest of them.
    ([(8,), (16,), (8,), (16,), (8,), (8,)],
     _document(_bare(), other_steps=[_apart(count=0, nbytes=8, steps=[1, 3])])),
    ([(8,), (16,), (8,), (8,)], _document(_bare(), other_steps=[_apart(count=0, nbytes=8, steps=[1])])),
])
def test_the_typical_step_of_short_and_uneven_runs(steps, expected):
    spans = _job([[[_all_reduce(nbytes) for nbytes in sizes]] * 2 for sizes in steps])
    assert signature.signature_of_spans(spans) == expected


_DUPLICATES = [
    # A hand-merged file: one key twice for rank 0.
    ({"entries": [_bare(ranks=[0]), _bare(count=2, nbytes=16, ranks=[0, 1])]},
     "1 key(s) with two entries for one rank (one would silently win; merge them into one): entries[0] and [1]: "
     "M.lin forward  all_reduce  group 0  bfloat16  rank 0"),
    ({"entries": [_bare(ranks=[1, 1])]},
     "1 key(s) with two entries for one rank (one would silently win; merge them into one): entries[0] (twice): "
     "M.lin forward  all_reduce  group 0  bfloat16  rank 1"),
    ({"first_step": [_apart(), _apart(module="M.b"), _apart(count=2)]},
     "2 key(s) with two entries for one rank (one would silently win; merge them into one): first_step[0] and [2]: "
     "M.lin forward  all_reduce  group 0  bfloat16  rank 0; first_step[0] and [2]: M.lin forward  all_reduce  "
     "group 0  bfloat16  rank 1"),
    ({"other_steps": [_apart(steps=[2, 4]), _apart(steps=[4], count=2)]},
     "2 key(s) with two entries for one rank (one would silently win; merge them into one): other_steps[0] and "
     "[1]: M.lin forward  all_reduce  group 0  bfloat16  rank 0 step 4; other_steps[0] and [1]: M.lin forward  "
     "all_reduce  group 0  bfloat16  rank 1 step 4"),
]


@pytest.mark.parametrize("sections, why", _DUPLICATES)
def test_a_file_with_one_key_twice_is_refused_naming_it(tmp_path, capsys, sections, why):
    sig, merged = tmp_path / "sig.json", tmp_path / "merged.json"
    sig.write_text(json.dumps(_document(_bare())))
    merged.write_text(json.dumps({**_document(_bare()), **sections}))
    assert main(["compare", str(sig), str(merged)]) == 2
    assert capsys.readouterr().err == f"commdebug-otel compare: {merged}: {why}\n"
    assert main(["compare", str(merged), str(sig)]) == 2  # as base too


def test_a_json_member_twice_is_refused_naming_it(tmp_path, capsys):
    sig, merged = tmp_path / "sig.json", tmp_path / "merged.json"
    text = signature.to_json(_document(_bare()))
    sig.write_text(text)
    # Two "entries" members (a merge that kept both sides), and a figure twice in one entry.
    merged.write_text(text.replace('"entries": [', '"entries": [], "entries": [').replace(
        '"count_per_step": 1,', '"count_per_step": 1, "count_per_step": 2,'))
    assert main(["compare", str(sig), str(merged)]) == 2
    assert capsys.readouterr().err == (f"commdebug-otel compare: {merged}: member(s) 'count_per_step', 'entries' "
                                       "twice in one object (the last would silently win; keep one)\n")
