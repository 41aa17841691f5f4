"""The collective registry: which dispatcher ops are collectives, and their facts.

Each collective overload (c10d ``torch.ops.c10d.*``, native functional
``torch.ops._c10d_functional.*``, legacy ``torch.ops.c10d_functional.*``,
autograd ``torch.ops._c10d_functional_autograd.*`` and DTensor's
``_dtensor.shard_dim_alltoall``) maps to a :class:`CollectiveSpec` that says
where its payload, process group, reduce op and peer sit in the argument list.
The positions come from each op's schema (``OpOverload._schema``) once, at
import, so the dispatch hot path only indexes tuples.

No tensor value is ever read: only ``shape``, ``dtype``, ``numel`` and
``element_size``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import operator
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from commdebug_otel import semconv
from commdebug_otel.capture._torch import (
    device_mesh_class,
    import_functional_collectives,
    mesh_dim_groups,
    overload_name,
    process_groups_state,
    resolve_process_group,
    schema_argument_names,
    unbox_process_group,
)
from commdebug_otel.core.fact import GroupFacts  # the resolver's answer (fact: no torch)

_logger = logging.getLogger(__name__)

# (namespace, op) -> canonical name. CommDebugMode's c10d_collective_ops and
# NATIVE_TO_PY_MAPPING, plus P2P, barrier and the coalesced/out variants it misses.
_REGISTRY: dict[str, dict[str, str]] = {
    "c10d": {
        "allreduce_": semconv.ALL_REDUCE,
        "allreduce_coalesced_": semconv.ALL_REDUCE,
        "allgather_": semconv.ALL_GATHER,
        "_allgather_base_": semconv.ALL_GATHER,
        "allgather_coalesced_": semconv.ALL_GATHER,
        "allgather_into_tensor_coalesced_": semconv.ALL_GATHER,
        "reduce_scatter_": semconv.REDUCE_SCATTER,
        "_reduce_scatter_base_": semconv.REDUCE_SCATTER,
        "reduce_scatter_tensor_coalesced_": semconv.REDUCE_SCATTER,
        "alltoall_": semconv.ALL_TO_ALL,
        "alltoall_base_": semconv.ALL_TO_ALL,
        "broadcast_": semconv.BROADCAST,
        "reduce_": semconv.REDUCE,
        "gather_": semconv.GATHER,
        "scatter_": semconv.SCATTER,
        "send": semconv.SEND,
        "recv_": semconv.RECV,
        "recv_any_source_": semconv.RECV,
        "barrier": semconv.BARRIER,
        "monitored_barrier_": semconv.BARRIER,
    },
    "_c10d_functional": {
        "all_reduce": semconv.ALL_REDUCE,
        "all_reduce_": semconv.ALL_REDUCE,
        "all_reduce_coalesced": semconv.ALL_REDUCE,
        "all_reduce_coalesced_": semconv.ALL_REDUCE,
        "all_gather_into_tensor": semconv.ALL_GATHER,
        "all_gather_into_tensor_out": semconv.ALL_GATHER,
        "all_gather_into_tensor_coalesced": semconv.ALL_GATHER,
        "reduce_scatter_tensor": semconv.REDUCE_SCATTER,
        "reduce_scatter_tensor_out": semconv.REDUCE_SCATTER,
        "reduce_scatter_tensor_coalesced": semconv.REDUCE_SCATTER,
        "all_to_all_single": semconv.ALL_TO_ALL,
        "broadcast": semconv.BROADCAST,
        "broadcast_": semconv.BROADCAST,
        "isend": semconv.SEND,
        "irecv": semconv.RECV,
        "batch_p2p_ops": semconv.BATCH_P2P,
    },
    "c10d_functional": {
        "all_reduce": semconv.ALL_REDUCE,
        "all_reduce_coalesced": semconv.ALL_REDUCE,
        "all_gather_into_tensor": semconv.ALL_GATHER,
        "all_gather_into_tensor_coalesced": semconv.ALL_GATHER,
        "reduce_scatter_tensor": semconv.REDUCE_SCATTER,
        "reduce_scatter_tensor_coalesced": semconv.REDUCE_SCATTER,
        "all_to_all_single": semconv.ALL_TO_ALL,
        "broadcast": semconv.BROADCAST,
        "isend": semconv.SEND,
        "irecv": semconv.RECV,
        "batch_p2p_ops": semconv.BATCH_P2P,
    },
    "_c10d_functional_autograd": {
        "all_gather_into_tensor": semconv.ALL_GATHER,
        "reduce_scatter_tensor": semconv.REDUCE_SCATTER,
        "all_to_all_single": semconv.ALL_TO_ALL,
    },
    "_dtensor": {"shard_dim_alltoall": semconv.ALL_TO_ALL},
}

# Argument names, in order of preference, per role. Schemas differ between the
# c10d, native functional and legacy functional forms (see each op's _schema).
_PAYLOAD_ARGS = ("input_tensor", "input_tensors", "input_list", "inputs", "input",
                 "shard", "self", "tensors", "tensor")
# c10d ops with an output argument; the others' output is their input (in place) or,
# for functional collectives, what they return.
_OUTPUT_ARGS = ("output_tensor", "output_tensors", "output_lists", "outputs", "output")
_GROUP_ARGS = ("process_group", "group_name")
_REDUCE_ARGS = ("reduce_op", "reduceOp")
_PEER_ARGS = ("dst", "src")
_LEGACY_RANKS_ARG = "ranks"
_P2P = (semconv.SEND, semconv.RECV)

# Legacy functional collectives name the namespace so CommDebugMode's counts,
# which key native ops by their legacy packet, can be reproduced.
FUNCTIONAL_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional",
                                   "_c10d_functional_autograd", "_dtensor"})


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
    """Where a collective overload keeps each fact, as argument positions (-1: absent)."""

    op: str  # canonical name, e.g. "all_gather"
    overload_name: str  # e.g. "_c10d_functional.all_gather_into_tensor.default"
    namespace: str
    packet_name: str  # op name within its namespace, e.g. "all_gather_into_tensor"
    payload_index: int
    output_index: int  # -1: the output is the input (c10d, in place) or the return value (functional)
    group_index: int
    reduce_index: int
    peer_index: int
    ranks_index: int
    barrier: bool
    functional: bool


def _arg_index(names: list[str], candidates: tuple[str, ...]) -> int:
    for candidate in candidates:
        if candidate in names:
            return names.index(candidate)
    return -1


def _overloads() -> Iterator[tuple[str, str, str, Any]]:
    for namespace, ops in _REGISTRY.items():
        ns = getattr(torch.ops, namespace)
        for name, canonical in ops.items():
            try:
                packet = getattr(ns, name)
            except (AttributeError, RuntimeError):
                continue  # op not built into this torch (e.g. no distributed support)
            for overload in packet.overloads():
                yield namespace, name, canonical, getattr(packet, overload)


def build_registry() -> dict[Any, CollectiveSpec]:
    """Map every available collective ``OpOverload`` to its :class:`CollectiveSpec`."""
    try:
        import_functional_collectives()
    except Exception:  # pragma: no cover - torch built without distributed
        pass
    registry: dict[Any, CollectiveSpec] = {}
    for namespace, name, canonical, overload in _overloads():
        names = schema_argument_names(overload)
        registry[overload] = CollectiveSpec(
            op=canonical,
            overload_name=f"{namespace}.{name}.{overload_name(overload)}",
            namespace=namespace,
            packet_name=name,
            payload_index=_arg_index(names, _PAYLOAD_ARGS),
            output_index=_arg_index(names, _OUTPUT_ARGS),
            group_index=_arg_index(names, _GROUP_ARGS),
            reduce_index=_arg_index(names, _REDUCE_ARGS),
            peer_index=_arg_index(names, _PEER_ARGS) if canonical in _P2P else -1,
            ranks_index=names.index(_LEGACY_RANKS_ARG) if _LEGACY_RANKS_ARG in names else -1,
            barrier=canonical == semconv.BARRIER,
            functional=namespace in FUNCTIONAL_NAMESPACES,
        )
    return registry


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _first_tensor(value: Any) -> torch.Tensor | None:
    """``next(_tensors(value), None)`` without a generator per level (on every collective)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _plain_payload(value: Any) -> torch.Tensor | None:
    """The payload of most collectives, on every step: a plain tensor, or c10d's list of one; else None."""
    kind = type(value)
    if kind is torch.Tensor:
        return value
    if (kind is list or kind is tuple) and len(value) == 1 and type(value[0]) is torch.Tensor:
        return value[0]
    return None


def _is_fake_tensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "FakeTensor"  # no import of torch._subclasses on the hot path


def is_fake(tensor: torch.Tensor) -> bool:
    """FakeTensorMode or meta-device tensors: traced shapes, no real traffic."""
    return tensor.is_meta or _is_fake_tensor(tensor)


def compiler_traced(args: tuple) -> bool:
    """Whether a collective's first tensor is a ``FakeTensor``: torch.compile tracing it (AOTAutograd
    compiles a backward at its first run), not traffic; the compiled code issues the real one."""
    first = _first_tensor(args)
    return first is not None and _is_fake_tensor(first)


# What a barrier reports, as the PyTorch profiler does (ParamCommsUtils: 0 elements of kByte).
BARRIER_DTYPE = "uint8"
NO_TENSOR_DTYPE = "unknown"  # an op with no tensor at all: nothing can be said but the op


@dataclasses.dataclass(frozen=True)
class Message:
    """A collective's message on this rank, without any tensor value.

    Attributes:
        nbytes: bytes this rank sends; on a rank that sends nothing (scatter's
            non-source ranks) the bytes it receives. 0 for barrier.
        dtype: dtype of the first input tensor, else of the first output tensor
            (``"uint8"`` for barrier, as the profiler records it); never empty.
        shape: shape of that tensor (``[0]`` for barrier); empty only for a 0-d tensor.
        input_elements: the profiler's ``in_msg_nelems`` (c10d ``RECORD_PARAM_COMMS``):
            elements in the op's input message, the same on every rank of the group.
        output_elements: the profiler's ``out_msg_nelems``.
        fake: FakeTensor or meta-device tensors (traced shapes, no real traffic).
    """

    nbytes: int
    dtype: str
    shape: list[int]
    input_elements: int
    output_elements: int
    fake: bool


def message(spec: CollectiveSpec, args: tuple, out: Any, group_size: int) -> Message:
    """The :class:`Message` of a collective from its arguments and what the op returned.

    ``out``: the op's return value (a functional collective's output tensor);
    ``group_size``: ranks in its process group. Per op (docs/semantic-conventions.md):
    element counts sum the input and output tensors; scatter's input on a
    non-source rank is its output times the group size, gather's output on a
    non-root rank its input times the group size, as the profiler records them.
    """
    if spec.barrier:
        return Message(0, BARRIER_DTYPE, [0], 0, 0, False)
    in_bytes, in_elements, first_in = _sizes(_arg(args, spec.payload_index))
    out_bytes, out_elements, first_out = _sizes(_output(spec, args, out))
    if spec.op == semconv.SCATTER and first_in is None:
        in_elements = out_elements * group_size
    elif spec.op == semconv.GATHER and first_out is None:
        out_elements = in_elements * group_size
    first = first_in if first_in is not None else first_out
    if first is None:  # no tensor at all: nothing can be said but the op
        return Message(0, NO_TENSOR_DTYPE, [0], 0, 0, False)
    return Message(
        nbytes=in_bytes if first_in is not None else out_bytes,
        dtype=str(first.dtype).removeprefix("torch."),
        shape=[int(size) for size in first.shape],
        input_elements=in_elements,
        output_elements=out_elements,
        fake=is_fake(first),
    )


def plain_payload(spec: CollectiveSpec, args: tuple) -> torch.Tensor | None:
    """The tensor this rank sends in the common case of every step: one eager, strided, non-meta tensor
    (or c10d's list of one); None otherwise (a barrier, several tensors, fake, meta or sparse ones: then
    :func:`payload_bytes` and :func:`payload_tensor` look further). Not a ``FakeTensor`` (a subclass):
    a collective with a plain payload is traffic, not torch.compile tracing."""
    index = spec.payload_index
    if spec.barrier or not 0 <= index < len(args):
        return None
    payload = _plain_payload(args[index])
    # Strided only: a sparse COO tensor has no ``nbytes`` (gloo all-reduces DDP's sparse embedding gradients).
    if payload is None or payload.is_meta or payload.layout is not torch.strided:
        return None
    return payload


def payload(spec: CollectiveSpec, args: tuple, out: Any, plain: torch.Tensor | None
            ) -> tuple[int, torch.Tensor | None]:
    """``(nbytes, first tensor)`` of :func:`message`, without the rest (on every step): the bytes this rank
    sends, else those it receives, and the first tensor it sends, else receives (None: barrier, no tensor).

    ``plain``: ``plain_payload(spec, args)``, which the caller has already asked.
    """
    if plain is not None:
        return plain.nbytes, plain
    if spec.barrier:
        return 0, None
    nbytes, _, first = _sizes(_arg(args, spec.payload_index))
    if first is None:  # this rank sends nothing: what it receives
        nbytes, _, first = _sizes(_output(spec, args, out))
    return nbytes, first


def _arg(args: tuple, index: int) -> Any:
    return args[index] if 0 <= index < len(args) else None


def _output(spec: CollectiveSpec, args: tuple, out: Any) -> Any:
    if spec.output_index >= 0:
        return _arg(args, spec.output_index)
    if spec.functional:
        return out
    return _arg(args, spec.payload_index)  # c10d in place: the buffer is both


def _sizes(value: Any) -> tuple[int, int, torch.Tensor | None]:
    """``(bytes, elements, first tensor)`` of a tensor or a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size(), value.numel(), value
    first: torch.Tensor | None = None
    nbytes = elements = 0
    for tensor in _tensors(value):
        if first is None:
            first = tensor
        elements += tensor.numel()
        nbytes += tensor.numel() * tensor.element_size()
    return nbytes, elements, first


def _reduce_op_names() -> dict[int, str]:
    try:
        from torch.distributed import ReduceOp

        return {int(member): name.lower()  # type: ignore[call-overload]  # (a pybind11 enum: int() takes it)
                for name, member in ReduceOp.RedOpType.__members__.items()}
    except Exception:  # torch without distributed
        return {}


_REDUCE_OP_NAMES = _reduce_op_names()


def reduce_op_name(value: Any) -> str:
    """``"sum"`` for a functional collective's ``"sum"``, a ``ReduceOp``, or c10d's boxed ReduceOp.

    c10d ops receive the reduce op as a TorchScript object whose ``op()``
    method returns the ``ReduceOp.RedOpType`` value.
    """
    if isinstance(value, str):
        return value.lower()
    if isinstance(value, torch.ScriptObject):
        try:
            return _REDUCE_OP_NAMES.get(int(value.op()), "unknown")  # type: ignore[attr-defined]
        except Exception:
            return "unknown"
    op = getattr(value, "op", value)
    name = getattr(op, "name", None)
    if isinstance(name, str):
        return name.lower()
    return str(op).rsplit(".", 1)[-1].lower()


def backend_name(group: Any = None) -> str:
    """The backend of ``group`` (default: the world group), resolved per device when torch says ``undefined``.

    A group made by ``init_process_group()`` without a backend, or by
    ``init_device_mesh``, has ``get_backend() == "undefined"``: its backend
    is chosen per device, as ``get_backend_config()`` lists (``cpu:gloo`` or
    ``cpu:gloo,cuda:nccl``). One backend for every device is given by name
    (``gloo``), several as that list. Raises what torch raises on a group this
    rank is not part of.
    """
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if backend and backend != dist.Backend.UNDEFINED:
        return backend
    config = str(dist.get_backend_config(group))
    names = {pair.split(":", 1)[-1] for pair in config.split(",") if pair}
    return names.pop() if len(names) == 1 else config


_UNKNOWN_GROUP = GroupFacts("unknown", 0, "")


class MeshDimensions:
    """The device meshes of this process, to name a process group by the mesh dimensions it serves.

    A mesh dimension's group is named by ``DeviceMesh`` only through ``group_desc``
    (``mesh_<dim>``), and only when the mesh made that group: a dimension over every rank reuses
    the default group (``group_desc`` ``default_pg``), and flattened or sliced dimensions and
    ``DeviceMesh.from_group`` reuse groups made before. So the meshes themselves are asked: each
    ``DeviceMesh`` made while a tracer runs is registered (:meth:`add`, from a wrapper of its
    ``__init__``), and those made before are found at the first question after a tracer
    started (:meth:`scan`), unless no process group was made or destroyed since the last search:
    a search walks every object of the process (0.15 to 0.2 s at 290,000 objects on a busy 2-core
    machine, as long as the step of benchmarks/bench.py's TP job), which a tracer started around
    every step (the ``CommDebugMode`` drop-in used as torch's) paid on every step.
    Known gap: a mesh made while no tracer runs over groups that all existed at the last search
    (a second 1-D mesh over every rank, ``from_group``) is not found; its groups are named by
    their ``group_desc``.
    Meshes are held weakly. :attr:`version` changes when a mesh is added, so that cached group
    facts are made again.
    """

    def __init__(self) -> None:
        self._meshes: list[weakref.ref] = []
        self._seen: set[int] = set()  # id() of registered meshes that are alive
        self._scan_pending = False
        self._scanned_state: tuple | None = None  # process_groups_state() at the last search
        self.version = 0

    def add(self, mesh: Any) -> None:
        """Register ``mesh`` (a ``DeviceMesh``); again is a no-op."""
        key = id(mesh)
        if key in self._seen:
            return
        self._seen.add(key)
        self._meshes.append(weakref.ref(mesh, lambda _ref, key=key: self._seen.discard(key)))  # type: ignore[misc]
        self.version += 1

    def scan(self) -> None:
        """Register every ``DeviceMesh`` alive, at the next :meth:`dim_names` (the first collective's group):
        one pass over the collector's objects, about 0.1 s in a process that has just imported torch on a
        busy 2-core machine, which a tracer's start need not wait for (nor a job that issues no collective).
        Not even then when no process group was made or destroyed since the last search (see the class)."""
        state = process_groups_state()
        self._scan_pending = state is None or state != self._scanned_state

    def _scan(self) -> None:
        """``type() is``, not ``isinstance``: ``DeviceMesh``'s metaclass answers ``isinstance`` in Python; the
        filter runs in C (a loop in Python took 0.17 s over the 165,000 objects)."""
        self._scan_pending = False
        self._scanned_state = process_groups_state()
        try:
            kind = device_mesh_class()
            objects = gc.get_objects()
            for mesh in itertools.compress(objects, map(functools.partial(operator.is_, kind), map(type, objects))):
                self.add(mesh)
        except Exception as error:  # torch without torch.distributed, a mesh not weakly referenceable
            _logger.debug("commdebug-otel: device meshes made before the tracer not found: %s", error)

    def dim_names(self, group_name: str) -> list[str]:
        """The names of the mesh dimensions whose process group is ``group_name``, in the order the meshes
        were made, each once."""
        if self._scan_pending:
            self._scan()
        names: list[str] = []
        for ref in list(self._meshes):
            mesh = ref()
            if mesh is None:
                continue
            try:
                pairs = mesh_dim_groups(mesh)
            except Exception:  # a mesh torch can no longer describe
                continue
            for dim, group in pairs:
                if group == group_name and dim not in names:
                    names.append(dim)
        self._meshes = [ref for ref in self._meshes if ref() is not None]
        return names


#: The process's meshes (kept up to date by the collective interceptor while a tracer runs).
MESHES = MeshDimensions()


class GroupResolver:
    """Resolve the group argument of a collective to :class:`GroupFacts`, cached.

    c10d ops pass a ``ProcessGroup``; functional collectives pass its
    ``group_name`` (a string); legacy functional ones pass ``tag`` and ``ranks``.
    The mesh dimension comes from the meshes that use the group (:class:`MeshDimensions`), else
    from ``ProcessGroup.group_desc``, which ``DeviceMesh`` sets to ``mesh_<dim name>``
    (torch/distributed/device_mesh.py) on the groups it makes. The cache is emptied when a mesh
    is made.
    """

    def __init__(self, meshes: MeshDimensions = MESHES) -> None:
        self._by_key: dict[Any, GroupFacts] = {}
        # Group name -> its mesh dimensions as last resolved (kept through a new mesh's clearing of the cache):
        # what Progress reports per group, read on other threads.
        self._dims: dict[str, str] = {}
        self._meshes = meshes
        self._version = meshes.version

    def __len__(self) -> int:
        """How many group arguments are cached."""
        return len(self._by_key)

    def dim_name(self, group_name: str) -> str:
        """The mesh dimensions the group named ``group_name`` serves, as last resolved ("" if none or not seen)."""
        return self._dims.get(group_name, "")

    def _remember(self, key: Any, facts: GroupFacts) -> GroupFacts:
        self._by_key[key] = facts
        self._dims[facts.name] = facts.dim_name
        return facts

    def resolve(self, spec: CollectiveSpec, args: tuple) -> GroupFacts:
        if self._version != self._meshes.version:  # a new mesh may name groups seen before
            self._version = self._meshes.version
            self._by_key.clear()
        if 0 <= spec.group_index < len(args):
            key = args[spec.group_index]
        elif 0 <= spec.ranks_index < len(args):
            key = tuple(args[spec.ranks_index])
        else:
            return _UNKNOWN_GROUP
        if not isinstance(key, (str, tuple)):
            group = key
            # A boxed group is a fresh object per call: key by the underlying group's name.
            key = _group_key(group)
            facts = self._by_key.get(key)
            if facts is None:
                facts = self._remember(key, _facts_of_group(group, self._meshes))
            return facts
        facts = self._by_key.get(key)
        if facts is None:
            facts = self._remember(key, _facts_of_key(key, self._meshes))
        return facts


def _group_key(group: Any) -> Any:
    try:
        return ("group", unbox_process_group(group).group_name)
    except Exception:
        return id(group)


def _facts_of_group(group: Any, meshes: MeshDimensions) -> GroupFacts:
    try:
        group = unbox_process_group(group)
        name = str(getattr(group, "group_name", "") or "unknown")
        size = int(group.size())
        desc = str(getattr(group, "group_desc", "") or "")
    except Exception:  # a group torch can no longer describe
        return _UNKNOWN_GROUP
    names = meshes.dim_names(name)
    # A mesh gone since (or made before a torch without _dim_group_names): the group's own label.
    # "mesh_default" is the label of a 1-D mesh's copy of the default group, not a dimension name.
    if not names and desc.startswith("mesh_") and desc != "mesh_default":
        names = [desc[len("mesh_"):]]
    return GroupFacts(name, size, semconv.DEVICE_MESH_DIM_NAME_SEPARATOR.join(names))


def _facts_of_key(key: str | tuple, meshes: MeshDimensions) -> GroupFacts:
    try:
        if isinstance(key, str):
            return _facts_of_group(resolve_process_group(key), meshes)
        return GroupFacts("ranks:" + ",".join(str(rank) for rank in key), len(key), "")
    except Exception:
        return GroupFacts(str(key), 0, "")
