"""Every span, event, attribute, metric and resource name that commdebug-otel emits.

These names are the data contract that dashboards, docs and users depend on;
``docs/semantic-conventions.md`` lists each one with type, unit and example,
and a test checks that every constant here appears there.
"""

# Span names. Module spans are named "{fqn} {pass}".
SPAN_TRAIN_STEP = "train_step"
SPAN_OUTSIDE_STEP = "outside_step"
# Work of a training iteration after its optimizer step (logging all-reduces, ZeRO's parameter all-gather):
# a child of that step's train_step, in its trace, until the next step begins.
SPAN_TRAIN_STEP_TAIL = "train_step_tail"

# OpenTelemetry's own names that we write and read back: resource attributes and the exception event.
SERVICE_NAME = "service.name"
HOST_NAME = "host.name"
PROCESS_PID = "process.pid"
EVENT_EXCEPTION = "exception"
EXCEPTION_TYPE = "exception.type"
EXCEPTION_MESSAGE = "exception.message"
EXCEPTION_STACKTRACE = "exception.stacktrace"
EXCEPTION_ESCAPED = "exception.escaped"

# Span attributes.
STEP = "torch.step"
MODULE_FQN = "torch.module.fqn"
MODULE_TYPE = "torch.module.type"
MODULE_PASS = "torch.module.pass"
MODULE_DEPTH = "torch.module.depth"
MODULE_CALL_INDEX = "torch.module.call_index"
MODULE_PARAMETERS = "torch.module.parameters"
MODULE_COMPILED = "torch.module.compiled"  # its call ran compiled code: no module spans inside
SPAN_UNMATCHED = "commdebug.span.unmatched"
SPAN_DROPPED_EVENTS = "commdebug.span.dropped_events"
# A train_step cut at OTEL_PYTHON_COMMDEBUG_MAX_SPANS_PER_STEP: this part is exported, the step goes on.
STEP_TRUNCATED = "commdebug.step.truncated"
STEP_PART = "commdebug.step.part"  # on the parts after such a cut: 1, 2, ...
# Per-step signals on train_step (traced steps).
STEP_COLLECTIVE_WAIT = "torch.step.collective_wait_s"  # seconds the training thread waited in collectives
# Seconds the training thread was runnable but waited for a CPU (another process had it; Linux schedstat).
STEP_CPU_WAIT = "commdebug.step.cpu_wait_s"
STEP_SLOW = "commdebug.step.slow"  # longer than SLOW_STEP_FACTOR x the rank's recent median
STEP_STALLED = "commdebug.step.stalled"  # a stall snapshot was taken during this step: how many
# The desync fingerprint: parallel arrays, one entry per process group the step used.
STEP_COLLECTIVE_GROUPS = "torch.step.collective_groups"
STEP_COLLECTIVE_FINGERPRINTS = "torch.step.collective_fingerprints"  # hash of the ordered (op, dtype, shape, reduce op)
STEP_COLLECTIVE_COUNTS = "torch.step.collective_counts"
STEP_COLLECTIVE_FIRST_SEQ = "torch.step.collective_first_seq"

# Stall snapshots (stall/watchdog.py).
SPAN_STALLED = "stalled"
SPAN_INCOMPLETE = "commdebug.span.incomplete"  # still open at the snapshot: ended there
STALL_SNAPSHOT = "commdebug.stall.snapshot"  # on every span of a snapshot: 1, 2, ... while the stall lasts
STALL_AGE = "commdebug.stall.age_s"
STALL_THRESHOLD = "commdebug.stall.threshold_s"
STALL_BETWEEN_STEPS = "commdebug.stall.between_steps"
STALL_MODULE = "commdebug.stall.module"
STALL_PASS = "commdebug.stall.pass"
STALL_STACK = "commdebug.stall.stack"
STALL_GROUPS = "commdebug.stall.groups"
STALL_ISSUED_SEQ = "commdebug.stall.issued_seq"
STALL_COMPLETED_SEQ = "commdebug.stall.completed_seq"
COLLECTIVE_STATE = "commdebug.collective.state"  # on a snapshot's ring events
STATE_IN_FLIGHT = "in_flight"
STATE_COMPLETED = "completed"
# The cross-rank stall verdict (stall/verdict.py): one span, exported by one rank, in the stalled step's trace.
SPAN_STALL_VERDICT = "stall_verdict"
VERDICT_KIND = "commdebug.verdict.kind"  # hang | desync | missing
VERDICT_KIND_HANG = "hang"
VERDICT_KIND_DESYNC = "desync"
VERDICT_KIND_MISSING = "missing"
VERDICT_BEHIND_RANKS = "commdebug.verdict.behind_ranks"
VERDICT_WAITING_RANKS = "commdebug.verdict.waiting_ranks"
VERDICT_GROUP = "commdebug.verdict.group"
VERDICT_MESH_DIM = "commdebug.verdict.mesh_dim"
VERDICT_SEQ = "commdebug.verdict.seq"
VERDICT_OP = "commdebug.verdict.op"
VERDICT_MODULE = "commdebug.verdict.module"
VERDICT_WAITING_MODULE = "commdebug.verdict.waiting_module"
VERDICT_STACK = "commdebug.verdict.stack"  # the first behind rank's training thread, innermost last
VERDICT_CAUSE = "commdebug.verdict.cause"
VERDICT_SUMMARY = "commdebug.verdict.summary"
VERDICT_WORLD_SIZE = "commdebug.verdict.world_size"
VERDICT_REPORTED_RANKS = "commdebug.verdict.reported_ranks"
# Of the ranks that published nothing: process gone / alive but silent (told on the forming rank's host only).
VERDICT_DEAD_RANKS = "commdebug.verdict.dead_ranks"
VERDICT_SILENT_RANKS = "commdebug.verdict.silent_ranks"
# The live straggler verdict (stall/straggler.py): one span per change, exported by rank 0, in the trace of the
# newest step judged; with VERDICT_KIND, VERDICT_BEHIND_RANKS, VERDICT_MODULE, VERDICT_SUMMARY and STEP.
SPAN_STRAGGLER_VERDICT = "straggler_verdict"
VERDICT_KIND_STRAGGLER = "straggler"
VERDICT_KIND_RECOVERED = "recovered"  # a rank named before is no longer late beyond the noise
VERDICT_PASS = "commdebug.verdict.pass"
VERDICT_LOST = "commdebug.verdict.lost_s"  # seconds per late step the other ranks waited on the behind ranks
VERDICT_SINCE_STEP = "commdebug.verdict.since_step"  # the first late step of the episode
VERDICT_STEPS_LATE = "commdebug.verdict.steps_late"
VERDICT_STEPS_SEEN = "commdebug.verdict.steps_seen"
# Trace scope job, a job of more than RANKS_PER_TRACE ranks: the trace block (rank // RANKS_PER_TRACE) whose
# trace holds this train_step or outside_step.
TRACE_BLOCK = "commdebug.trace.block"

# Module pass values.
PASS_FORWARD = "forward"
PASS_BACKWARD = "backward"
PASS_RECOMPUTE = "recompute"

# Collective event attributes.
COLLECTIVE_OP = "torch.collective.op"
OP_NAME = "torch.op.name"
COLLECTIVE_BYTES = "torch.collective.bytes"
COLLECTIVE_INPUT_ELEMENTS = "torch.collective.input_elements"  # the profiler's in_msg_nelems
COLLECTIVE_OUTPUT_ELEMENTS = "torch.collective.output_elements"  # the profiler's out_msg_nelems
COLLECTIVE_DTYPE = "torch.collective.dtype"
COLLECTIVE_SHAPE = "torch.collective.shape"
COLLECTIVE_REDUCE_OP = "torch.collective.reduce_op"
COLLECTIVE_PEER = "torch.collective.peer"
COLLECTIVE_SEQ = "torch.collective.seq"
COLLECTIVE_DURATION = "torch.collective.issue_duration_s"
COLLECTIVE_FAKE = "torch.collective.fake"
PROCESS_GROUP_NAME = "torch.process_group.name"
PROCESS_GROUP_SIZE = "torch.process_group.size"
DEVICE_MESH = "torch.device_mesh"
DEVICE_MESH_DIM_NAME = "torch.device_mesh.dim_name"
# Between the names of a process group that serves several mesh dimensions, in the order the meshes were made.
DEVICE_MESH_DIM_NAME_SEPARATOR = ","
DEVICE_MESH_SHAPE = "torch.device_mesh.shape"
DEVICE_MESH_DIM_NAMES = "torch.device_mesh.dim_names"
DTENSOR_OP = "torch.dtensor.op"
DTENSOR_INPUT_SHAPES = "torch.dtensor.input_shapes"
DTENSOR_INPUT_PLACEMENTS = "torch.dtensor.input_placements"
# The "why" of a collective that a DTensor redistribution issued (any detail level).
DTENSOR_CAUSE = "torch.dtensor.cause"  # the op, or redistribute | full_tensor | from_local
DTENSOR_SOURCE_PLACEMENTS = "torch.dtensor.source_placements"
DTENSOR_TARGET_PLACEMENTS = "torch.dtensor.target_placements"
OP_INPUT_SHAPES = "torch.op.input_shapes"

# Canonical collective names (span event names and the torch.collective.op value).
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
BROADCAST = "broadcast"
REDUCE = "reduce"
GATHER = "gather"
SCATTER = "scatter"
SEND = "send"
RECV = "recv"
BARRIER = "barrier"
BATCH_P2P = "batch_p2p"

# Metric instruments.
METRIC_OPERATIONS = "torch.collective.operations"
METRIC_IO = "torch.collective.io"
METRIC_DURATION = "torch.collective.duration"
METRIC_COMPLETION = "torch.collective.completion_duration"
METRIC_DROPPED = "commdebug.telemetry.dropped"
METRIC_STEP_DURATION = "torch.step.duration"
METRIC_STEP_WAIT = "torch.step.collective_wait"
METRIC_STEP_AGE = "torch.step.age"
METRIC_SEQ_ISSUED = "torch.collective.seq.issued"
METRIC_SEQ_COMPLETED = "torch.collective.seq.completed"
METRIC_STRAGGLER_LOST = "commdebug.straggler.lost"  # s per step the others wait on a rank named slow (rank 0)
DROPPED_KIND = "commdebug.dropped.kind"
DROPPED_KIND_EVENT = "event"
DROPPED_KIND_SPAN = "span"  # export queue full, export failed, or a span over the request size
DROPPED_KIND_METRIC_EXPORT = "metric_export"  # a failed metric export
DROPPED_KIND_HOOK_ERROR = "hook_error"
DROPPED_KIND_METRIC_OVERFLOW = "metric_overflow"  # a metric past the SDK's cardinality limit, per export
DROPPED_KIND_METRIC = "metric_point"  # collectives not recorded in metrics: the metrics worker fell behind
# A traced step cut at MAX_SPANS_PER_STEP (one per cut): backward spans of the passes before the cut are lost.
DROPPED_KIND_STEP_SPLIT = "step_split"
# A module pass not recorded: the step part was full inside a pass, where it cannot be cut.
DROPPED_KIND_STEP_FULL = "step_full"
# Spans of a thread that called modules before the training thread and never trained (tracks_thread).
DROPPED_KIND_OTHER_THREAD = "other_thread"

# Resource attributes.
RANK = "torch.distributed.rank"
WORLD_SIZE = "torch.distributed.world_size"
LOCAL_RANK = "torch.distributed.local_rank"
NODE_RANK = "torch.distributed.node_rank"
RUN_ID = "torch.distributed.run_id"
BACKEND = "torch.distributed.backend"

# torch's CommDebugMode keys native functional collectives by their legacy packet
# (NATIVE_TO_PY_MAPPING in torch/distributed/tensor/debug/_comm_mode.py):
# namespace -> ops whose key is "c10d_functional.<op>". Used for CommDebugMode-compatible counts.
LEGACY_FUNCTIONAL_PACKETS = {
    "_c10d_functional": frozenset({
        "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_reduce",
        "all_reduce_coalesced", "all_to_all_single", "broadcast", "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced"}),
    "_c10d_functional_autograd": frozenset({"all_to_all_single"}),
}

# torch's Flight Recorder buffer, dumped in its JSON form beside a stall snapshot: <prefix><rank>.json
# (commdebug_otel/stall/flight_recorder.py writes it, `diagnose` finds it in the folders it reads).
FLIGHT_RECORDER_FILE_PREFIX = "commdebug-flight-recorder-rank"
