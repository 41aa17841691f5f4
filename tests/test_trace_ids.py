"""Job-scope trace ids on real gloo ranks: train_step, its tail and outside_step segments agree across ranks."""

import torch

from distributed import run_ranks


def _segments(rank, world_size, scope, ranks_per_trace=8):
    """Set-up, a step, a checkpoint-like all_reduce, an evaluation forward on rank 0 only, a barrier, a step."""
    import torch.distributed as dist

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    torch.manual_seed(0)
    telemetry = InMemoryTelemetry()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()

    with CommTracer(Settings(trace_scope=scope, ranks_per_trace=ranks_per_trace),
                    tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider) as tracer:
        dist.broadcast(torch.zeros(2), src=0)  # set-up: outside-0
        step()
        dist.all_reduce(torch.ones(1))  # a checkpoint save after the step: the tail of step 0
        if rank == 0:
            with torch.no_grad():
                model(torch.ones(1, 2))  # evaluation on rank 0 only: an inference root, then a new segment
        dist.barrier()  # the tail of step 0 still: ranks that evaluated and ranks that did not agree
        step()
        nonce = tracer.recorder.job_id() if scope == "job" else ""  # the key goes when the tracers stop
    dist.barrier()  # rank 0 hosts the store: it stays until every rank has read it
    return {"nonce": nonce, "spans": [(span.name, span.context.trace_id, span.parent is None,
                                       [event.name for event in span.events]) for span in telemetry.spans()],
            "roots": [(span.name, span.attributes.get("torch.step"), span.attributes.get("commdebug.trace.block"))
                      for span in telemetry.spans() if span.parent is None]}


_SEGMENTS = ("outside_step", "train_step", "train_step_tail")


def test_outside_step_segments_share_a_trace_id_on_every_rank():
    from commdebug_otel.core.job_identity import step_trace_id

    results = run_ranks(_segments, 2, "job")
    assert all(block is None for result in results for _, _, block in result["roots"])  # 2 ranks: one trace
    views = [[span for span in result["spans"] if span[0] in _SEGMENTS] for result in results]
    nonce = results[0]["nonce"]

    def trace(label):
        return step_trace_id("none", nonce, label)  # TORCHELASTIC_RUN_ID is unset: "none"

    assert views[0] == [
        ("outside_step", trace("outside-0"), True, ["broadcast"]),
        ("train_step", trace(0), True, []),
        ("train_step_tail", trace(0), False, ["all_reduce"]),  # under train_step 0
        ("train_step_tail", trace(0), False, ["barrier"]),  # after rank 0's evaluation: step 0's still
        ("train_step", trace(1), True, []),
    ]
    assert views[1] == [
        ("outside_step", trace("outside-0"), True, ["broadcast"]),
        ("train_step", trace(0), True, []),
        ("train_step_tail", trace(0), False, ["all_reduce", "barrier"]),
        ("train_step", trace(1), True, []),
    ]


def test_rank_scope_keeps_outside_step_traces_apart():
    results = run_ranks(_segments, 2, "rank")
    ids = [{trace_id for name, trace_id, _, _ in result["spans"] if name == "outside_step"} for result in results]
    assert len(ids[0]) == 1 and len(ids[1]) == 1 and not ids[0] & ids[1]
    for result in results:  # each rank's tail is in its own step 0's trace
        segments = [span for span in result["spans"] if span[0] in _SEGMENTS][:3]
        traces = {name: trace_id for name, trace_id, _, _ in segments}
        assert [name for name, *_ in segments] == list(_SEGMENTS)
        assert traces["train_step_tail"] == traces["train_step"] != traces["outside_step"]


def test_job_scope_cuts_a_larger_job_into_trace_blocks():
    """4 ranks, 2 per trace: ranks 0-1 share a trace per step and segment, ranks 2-3 another; each root names its
    block and keeps torch.step, so a step is found across blocks."""
    from commdebug_otel.core.job_identity import step_trace_id

    results = run_ranks(_segments, 4, "job", 2)
    nonce = results[0]["nonce"]
    labels = ["outside-0", 0, 0, 1]
    for rank, result in enumerate(results):
        block = rank // 2
        views = [(name, trace_id) for name, trace_id, _, _ in result["spans"] if name in _SEGMENTS]
        if rank == 0:  # its evaluation forward ends one tail segment and starts another
            views.pop(3)
        assert views == [(name, step_trace_id("none", nonce, label, block)) for name, label in
                         zip(["outside_step", "train_step", "train_step_tail", "train_step"], labels)]
        roots = [root for root in result["roots"] if root[0] in _SEGMENTS]
        assert {root_block for _, _, root_block in roots} == {block}
        assert [step for name, step, _ in roots if name == "train_step"] == [0, 1]
    traces = [{trace_id for _, trace_id, _, _ in result["spans"]} for result in results]
    assert traces[0] & traces[1] and traces[2] & traces[3] and not (traces[0] | traces[1]) & (traces[2] | traces[3])


def _store_keys_per_session(rank, world_size):
    """Two tracing sessions with a step each (and the stall watchdog, which writes its alive keys): the job's
    store holds as many keys after each stop as before the first start, and each session's nonce is agreed."""
    import torch.distributed as dist

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.core.job_identity import NONCE_KEY
    from commdebug_otel.testing import InMemoryTelemetry

    store = dist.distributed_c10d._get_default_store()
    dist.all_reduce(torch.ones(1))  # the backend's own keys (lazy connections) are in before counting
    dist.barrier()
    before = store.num_keys()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    telemetry = InMemoryTelemetry()
    sessions = []
    for _ in range(2):
        with CommTracer(Settings(trace_scope="job", stall_after_s=30.0), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider) as tracer:
            model(torch.ones(1, 2)).sum().backward()
            dist.all_reduce(torch.ones(1))
            optimizer.step()
            nonce = tracer.recorder.job_id()
            during = store.num_keys()
        dist.barrier()  # every rank stopped: the last one out has deleted the keys
        sessions.append((nonce, during - before, store.num_keys() - before, store.check([NONCE_KEY])))
        dist.barrier()  # every rank counted before the next session writes its nonce (rank 0 hosts the store)
    return sessions


def test_the_job_store_keeps_no_key_of_ours_after_tracing_stops():
    results = run_ranks(_store_keys_per_session, 2)
    for session in range(2):
        nonces = {result[session][0] for result in results}
        assert len(nonces) == 1  # both ranks agreed on the session's nonce
        assert [result[session][1] >= 1 for result in results] == [True, True]  # the nonce key was there
        assert [result[session][2:] for result in results] == [(0, False), (0, False)]
    assert results[0][0][0] != results[0][1][0]  # the second session agreed on a nonce of its own


def _keys_after_destroy(rank, world_size):
    """The usual script: the tracer runs on past destroy_process_group and stops at exit, when the store can no
    longer be reached through the group: the keys go at the destroy."""
    import time

    import torch.distributed as dist

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.core.job_identity import NONCE_KEY
    from commdebug_otel.testing import InMemoryTelemetry

    store = dist.distributed_c10d._get_default_store()  # held: rank 0's server outlives the group
    telemetry = InMemoryTelemetry()
    tracer = CommTracer(Settings(trace_scope="job"), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider).start()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    dist.all_reduce(torch.ones(1))
    optimizer.step()
    during = store.check([NONCE_KEY])
    dist.destroy_process_group()
    store.add("test/destroyed", 1)
    deadline = time.monotonic() + 60
    while int(store.add("test/destroyed", 0)) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    left = store.check([NONCE_KEY]), store.check([f"{NONCE_KEY}/left"])
    tracer.stop()  # nothing left to do in the store, and no group to reach it through
    store.add("test/read", 1)
    while rank == 0 and int(store.add("test/read", 0)) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)  # rank 0 hosts the store: it stays until every rank has read it
    return during, left


def test_the_keys_go_at_the_default_groups_destroy():
    assert run_ranks(_keys_after_destroy, 2) == [(True, (False, False))] * 2


def _forked_child_leaves_nothing(rank, world_size):
    import os

    import torch.distributed as dist

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.core.job_identity import NONCE_KEY
    from commdebug_otel.testing import InMemoryTelemetry

    store = dist.distributed_c10d._get_default_store()
    telemetry = InMemoryTelemetry()
    with CommTracer(Settings(trace_scope="job"), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider) as tracer:
        tracer.recorder.job_id()
        pid = os.fork()  # a fork DataLoader worker: the parent's group, copied
        if pid == 0:
            from commdebug_otel.core.job_identity import leave_job

            os._exit(0 if leave_job() is False else 1)
        _, status = os.waitpid(pid, 0)
        dist.barrier()
        kept = store.check([NONCE_KEY]), store.check([f"{NONCE_KEY}/left"])
        dist.barrier()  # both ranks looked before either stops
    dist.barrier()
    after = store.check([NONCE_KEY])
    dist.barrier()  # rank 0 hosts the store: it stays until both have read it
    return os.waitstatus_to_exitcode(status), kept, after


def test_a_forked_child_counts_nothing_for_its_parent():
    assert run_ranks(_forked_child_leaves_nothing, 2) == [(0, (True, False), False)] * 2
