"""Every touch of private torch APIs, in one place: a torch upgrade that moves one breaks this file only.

Each name says what it is for and where torch keeps it. The live modules
(recorder, tracker, dispatch mode, collective kernels, tracer) import torch's
internals from here and nowhere else.
"""

from __future__ import annotations

import os
import sys
import types
from collections import OrderedDict
from types import FrameType
from typing import Any

import torch
from torch._ops import HigherOrderOperator  # noqa: F401  (re-exported: the mode skips these)
from torch.compiler import is_compiling
from torch.utils import _pytree
from torch.utils._python_dispatch import (  # noqa: F401  (TorchDispatchMode re-exported)
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)
from torch.utils.hooks import RemovableHandle

# The autograd graph task running on this thread, -1 outside backward
# (torch/csrc/autograd/python_engine.cpp). A builtin: as cheap as a call gets on the hot path.
graph_task_id = torch._C._current_graph_task_id


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return graph_task_id() != -1


def in_compiled_code() -> bool:
    """Whether a hook runs inside compiled code: traced by dynamo (``torch.compiler.is_compiling()``, first:
    nothing after it goes into a graph) or compiled autograd's backward graph running now
    (``torch._dynamo.compiled_autograd``, never imported here), whose module calls and tensor-hook calls are
    the compiled backward's own (a ``GraphModule``, the hooks it captured), not the model's.
    """
    if is_compiling():
        return True
    module = _modules.get("torch._dynamo.compiled_autograd")  # (one call a hook: no helper function)
    return module is not None and getattr(module, "in_compiled_autograd_region", False) is True


_modules = sys.modules


def queue_engine_callback(callback: Any) -> None:
    """Run ``callback()`` when the running backward pass ends (the engine's final callbacks)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def compiled_original(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module that ``torch.compile(module)`` wrapped (``OptimizedModule._orig_mod``); None for others.

    ``OptimizedModule`` lives in torch/_dynamo/eval_frame.py; a process that
    never imported it has none (importing torch._dynamo here would cost every
    start-up a second).
    """
    # The cheap test first: this runs on every module call (a ScriptModule's _modules has no get()).
    if "_orig_mod" in module._modules:
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
            return module._modules["_orig_mod"]
    return None


def _swapped_in(cls: type) -> type | None:
    """The class ``cls`` was generated over by a class swap of torch's, else None.

    ``fully_shard`` (``FSDP<Class>``), ``replicate`` (``DDP<Class>``; FSDP-based
    ``Replicate<Class>``) set ``module.__class__ = type(prefix + cls.__name__,
    (Marker, cls), {...})``, and ``torch.nn.utils.parametrize`` the same with
    ``(cls,)`` (``Parametrized<Class>``), made in torch's package by ``type()``.
    So: made in ``torch``'s package, not defined under its name in its module (a
    class statement's is: ``LazyLinear(LazyModuleMixin, Linear)`` stays), an
    ``nn.Module`` class as last base after at most one mixin, and the name a
    prefix plus that base's. A class the user made, by a class statement or
    ``type()``, keeps its name.
    """
    module_name = cls.__module__
    bases = cls.__bases__
    if not (module_name == "torch" or module_name.startswith("torch.")) or not 1 <= len(bases) <= 2:
        return None
    original = bases[-1]
    name = cls.__name__
    if ((len(bases) == 2 and issubclass(bases[0], torch.nn.Module)) or not issubclass(original, torch.nn.Module)
            or name == original.__name__ or not name.endswith(original.__name__)
            or cls.__qualname__ != name
            or getattr(sys.modules.get(module_name), name, None) is cls):
        return None
    return original


# Module class -> (the user's class, "module.QualName" of it); bounded: dynamically made classes come and go.
_USER_CLASSES: dict[type, tuple[type, str]] = {}
_USER_CLASSES_MAX = 4096


def _user_class_entry(cls: type) -> tuple[type, str]:
    entry = _USER_CLASSES.get(cls)
    if entry is None:
        original = cls
        for _ in range(8):  # swaps stack one per wrapper; never a cycle, but stay bounded
            under = _swapped_in(original)
            if under is None:
                break
            original = under
        if len(_USER_CLASSES) >= _USER_CLASSES_MAX:
            _USER_CLASSES.clear()
        entry = _USER_CLASSES[cls] = (original, f"{original.__module__}.{original.__qualname__}")
    return entry


def user_class(cls: type) -> type:
    """The module class as the user wrote it: ``Net`` for the ``FSDPNet`` that ``fully_shard`` swapped in.

    Classes torch generates over the user's (``fully_shard``, composable
    ``replicate`` and its FSDP-based form, ``parametrize``) are walked down to the class they
    were made from; every other class, the user's own subclasses included, is
    returned as it is. Cached per class (a dict lookup once seen).
    """
    return _user_class_entry(cls)[0]


def user_class_name(cls: type) -> str:
    """``"module.QualName"`` of :func:`user_class` (``torch.module.type``), cached per class."""
    return _user_class_entry(cls)[1]


def compiled_call(module: torch.nn.Module) -> Any:
    """``module.compile()``'s compiled ``_call_impl`` (``Module._compiled_call_impl``), or None."""
    return module.__dict__.get("_compiled_call_impl")


def set_compiled_call(module: torch.nn.Module, call: Any) -> None:
    """Replace what ``Module._wrapped_call_impl`` calls for an in-place compiled module."""
    module._compiled_call_impl = call


def add_tensor_hook(tensor: torch.Tensor, hook: Any) -> Any:
    """``tensor.register_hook(hook)``; for a tensor no ``__torch_function__`` sees (no subclass that overrides
    it, no torch function mode on), what it does without its handle object: returns ``(hooks dict, key)``,
    the entry that the handle's ``remove()`` pops (:func:`tensor_hook_key`), else the handle. Raises
    ``RuntimeError`` as ``register_hook`` does for a tensor that does not require grad.
    """
    if _has_torch_function_unary(tensor) or not tensor.requires_grad:
        return tensor.register_hook(hook)
    hooks = tensor._backward_hooks
    if hooks is None:  # (Tensor.register_hook, torch/_tensor.py)
        hooks = tensor._backward_hooks = OrderedDict()
        if tensor.grad_fn is not None:
            tensor.grad_fn._register_hook_dict(tensor)
    key = RemovableHandle.next_id  # the id a handle would take: unique among every handle's
    RemovableHandle.next_id = key + 1
    hooks[key] = hook
    return hooks, key


_has_torch_function_unary = torch._C._has_torch_function_unary


def run_tensor_hook_first(tensor: torch.Tensor, handle: Any) -> None:
    """Run the tensor hook ``handle`` (``Tensor.register_hook``'s handle, or :func:`add_tensor_hook`'s
    ``(hooks dict, key)``) before the hooks registered earlier.

    Autograd calls ``Tensor._backward_hooks`` in the order of the underlying dict
    (``PyDict_Next``), which ``OrderedDict.move_to_end`` does not change: the
    entries are inserted again, in the same dict object the handles refer to.
    """
    hooks: Any = tensor._backward_hooks
    ours = hooks.pop(handle[1] if type(handle) is tuple else handle.id)
    rest = list(hooks.items())
    hooks.clear()
    hooks[handle[1] if type(handle) is tuple else handle.id] = ours
    hooks.update(rest)


def tensor_hook_key(handle: Any) -> tuple[Any, int] | None:
    """``(hooks dict, key)`` of a ``Tensor.register_hook`` handle: popping the key is what its
    ``remove()`` does, so the handle need not be kept. None for another kind of handle."""
    if type(handle) is not RemovableHandle or handle.extra_dict_ref:
        return None
    hooks = handle.hooks_dict_ref()
    return None if hooks is None else (hooks, handle.id)


def new_hook_id() -> int:
    """A hook id no torch handle ever has: negative (torch's count up from 0, ``RemovableHandle.next_id``, also
    in a module unpickled from another process), and unique in this process (drawn from that counter)."""
    hook_id = RemovableHandle.next_id
    RemovableHandle.next_id = hook_id + 1
    return -1 - hook_id


def add_forward_hook_last(module: torch.nn.Module, hook_id: int, hook: Any) -> bool:
    """Put ``hook`` last in ``module``'s own forward hooks, always called, under ``hook_id``.

    What ``module.register_forward_hook(hook, always_call=True)`` does (``Module._forward_hooks``,
    ``_forward_hooks_always_called``), without a handle object per call. Returns whether it was
    there already (a call of the module inside its own call): then it moves behind hooks added since.
    """
    hooks: Any = module._forward_hooks  # an OrderedDict
    there = hook_id in hooks
    hooks[hook_id] = hook  # (a copy made inside a call holds another object under the id)
    if there:
        hooks.move_to_end(hook_id)
    module._forward_hooks_always_called[hook_id] = True
    return there


def remove_forward_hook(module: torch.nn.Module, hook_id: int) -> None:
    """Undo :func:`add_forward_hook_last` (nothing if the hook is not there)."""
    module._forward_hooks.pop(hook_id, None)
    module._forward_hooks_always_called.pop(hook_id, None)


def has_forward_hook(module: torch.nn.Module, hook_id: int) -> bool:
    """Whether ``module``'s own forward hooks (``Module._forward_hooks``) hold one under ``hook_id``."""
    return hook_id in module._forward_hooks


# ``Module._call_impl``'s code: a frame running it is a module call in progress (torch/nn/modules/module.py).
MODULE_CALL_CODE = torch.nn.Module._call_impl.__code__
# ``Module.__call__`` (``_wrapped_call_impl``): every module call runs it, an in-place ``module.compile()``'d one too.
_MODULE_WRAPPED_CALL_CODE = torch.nn.Module._wrapped_call_impl.__code__


def in_module_call() -> bool:
    """Whether the calling thread runs inside an ``nn.Module`` call now (its Python stack; about 40 ns a frame).

    Where no module hook runs (a step whose module calls go hook-free) this is the only way to know.
    """
    frame: types.FrameType | None = sys._getframe(1)
    code = _MODULE_WRAPPED_CALL_CODE
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def remove_global_forward_hook(handle: Any) -> None:
    """Remove a ``register_module_forward_hook(..., with_kwargs=True)`` hook completely.

    Its ``RemovableHandle`` forgets the hook but not its id in
    ``torch.nn.modules.module._global_forward_hooks_with_kwargs``: without this,
    every removal (one per suspended step) would leave an entry behind.
    """
    handle.remove()
    from torch.nn.modules import module

    getattr(module, "_global_forward_hooks_with_kwargs", {}).pop(handle.id, None)


# torch.compile(module)'s call warns when any global module hook exists (OptimizedModule.__call__ asks
# torch.nn.modules.module._has_any_global_hook): ours must not reach a script run with -W error. Ours count
# the OptimizedModule's extra call as its module's (one FQN for both), so the warning is not about them.
def global_forward_pre_hooks() -> dict[int, Any]:
    """torch's global module forward pre-hooks, ``{hook id: hook}`` in the order they run
    (``torch.nn.modules.module._global_forward_pre_hooks``)."""
    from torch.nn.modules import module

    return module._global_forward_pre_hooks


_GLOBAL_HOOK_DICTS = ("_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_pre_hooks",
                      "_global_forward_hooks", "_global_forward_hooks_always_called",
                      "_global_forward_hooks_with_kwargs")
_own_global_hook_ids: set[int] = set()
_torch_has_any_global_hook: Any = None  # torch's own, while ours stands in for it


def _has_any_global_hook_but_ours() -> bool:
    """torch's ``_has_any_global_hook``, not counting the global module hooks of ours."""
    from torch.nn.modules import module

    found: list[Any] = [getattr(module, name, None) for name in _GLOBAL_HOOK_DICTS]
    if any(not isinstance(hooks, dict) for hooks in found):  # another torch: its own answer
        return bool(_torch_has_any_global_hook())
    return any(key not in _own_global_hook_ids for hooks in found for key in hooks)


def own_global_hooks(*handles: Any) -> None:
    """The global module hooks behind ``handles`` are ours: torch.compile's global-hook warning leaves them out."""
    global _torch_has_any_global_hook
    from torch.nn.modules import module

    _own_global_hook_ids.update(handle.id for handle in handles)
    current = getattr(module, "_has_any_global_hook", None)
    if current is not None and current is not _has_any_global_hook_but_ours:
        _torch_has_any_global_hook = current
        module._has_any_global_hook = _has_any_global_hook_but_ours


def disown_global_hooks(*handles: Any) -> None:
    """Undo :func:`own_global_hooks` for ``handles`` (removed); torch's own test is back once none of ours is left."""
    global _torch_has_any_global_hook
    from torch.nn.modules import module

    _own_global_hook_ids.difference_update(handle.id for handle in handles)
    if not _own_global_hook_ids and _torch_has_any_global_hook is not None:
        if getattr(module, "_has_any_global_hook", None) is _has_any_global_hook_but_ours:
            module._has_any_global_hook = _torch_has_any_global_hook
        _torch_has_any_global_hook = None


def mark_unserializable(handle: Any) -> None:
    """Mark the tensor hooks of a ``register_multi_grad_hook`` handle as torch's ``unserializable_hook`` does:
    pickling a tensor that holds one (``Tensor.__reduce_ex__``) then warns of no hook of ours."""
    for part in getattr(handle, "handles", ()):
        hooks = part.hooks_dict_ref()
        hook = hooks.get(part.id) if hooks is not None else None
        if hook is not None:
            hook.__torch_unserializable__ = True


def rewrites_keyword_inputs(module: torch.nn.Module) -> bool:
    """True if ``module`` has forward pre-hooks that may replace its keyword inputs (``with_kwargs=True``: FSDP2,
    TP's ``PrepareModuleInput``): the keyword inputs its forward hooks see are not the caller's (``Module._call_impl``).
    """
    return bool(getattr(module, "_forward_pre_hooks_with_kwargs", True))  # unknown torch: assume they may


def pytree_children(value: Any) -> list | None:
    """``value``'s children one level down if its type is a node of torch's pytree (``torch.utils._pytree``:
    ``register_pytree_node``, ``register_dataclass``, the built-in containers), else None."""
    node = _pytree.SUPPORTED_NODES.get(type(value))
    return None if node is None else node.flatten_fn(value)[0]


# ------------------------------------------------------------------ dispatch modes
dispatch_mode_stack = _get_current_dispatch_mode_stack
push_mode = _push_mode
pop_mode = _pop_mode


def is_user_mode(mode: Any) -> bool:
    """Whether a dispatch mode on the stack is a user's: infra modes (``FakeTensorMode``, ...) have a
    ``TorchDispatchMode._mode_key`` and sit below the users'."""
    return getattr(mode, "_mode_key", None) is None


def sync_dispatch_mode_flags() -> None:
    """Recompute the process-wide "a mode is active" flags from this thread's stack.

    ``TorchDispatchMode.__enter__``/``__exit__`` save and restore these flags
    (torch/utils/_python_dispatch.py) assuming last-in, first-out order, which
    a mode inserted under others breaks: ours are pushed and popped raw, and the
    flags set from what is really on the stack.
    """
    from torch.utils import _python_dispatch as dispatch

    stack = _get_current_dispatch_mode_stack()
    try:
        dispatch._is_in_torch_dispatch_mode = bool(stack)
        dispatch._is_in_non_infra_torch_dispatch_mode = any(not m.is_infra_mode() for m in stack)
        without = any(not m.ignore_compile_internals() for m in stack)
        dispatch._is_in_any_mode_without_ignore_compile_internals = without
        dispatch.set_is_in_mode_without_ignore_compile_internals(without)
    except AttributeError:  # another torch without some of these flags
        pass


# ------------------------------------------------------------------ dispatcher kernels
def keys_after_backend_select() -> Any:
    """The dispatch keys below ``BackendSelect``: where a kernel registered there redispatches to."""
    return torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)


def impl_name(overload: Any) -> str:
    """``OpOverload`` → the ``name[.overload]`` that ``torch.library.Library.impl`` takes."""
    name = overload._schema.name.split("::", 1)[1]
    if overload._overloadname != "default":
        name = f"{name}.{overload._overloadname}"
    return name


def schema_argument_names(overload: Any) -> list[str]:
    """The argument names of an ``OpOverload``'s schema (``OpOverload._schema.arguments``), in order."""
    return [argument.name for argument in overload._schema.arguments]


def overload_name(overload: Any) -> str:
    """An ``OpOverload``'s overload name (``OpOverload._overloadname``): ``"default"``, ``"Tensor"``, ..."""
    return overload._overloadname


def import_functional_collectives() -> None:
    """Import ``torch.distributed._functional_collectives``: it registers the functional collectives'
    Python-side definitions. Raises whatever the import raises (a torch built without distributed)."""
    import torch.distributed._functional_collectives  # noqa: F401


def boxed_redispatch(overload: Any) -> Any:
    """``redispatch(keyset, *args, **kwargs)`` for ``overload``: ``OpOverload.redispatch`` without its Python frame."""
    return overload._handle.redispatch_boxed


def destroy_library(library: torch.library.Library) -> None:
    """Deregister a ``torch.library.Library``'s kernels now."""
    library._destroy()


def dtensor_redistribution() -> tuple[type, Any]:
    """DTensor's ``OpDispatcher`` and its ``redistribute_local_args`` as stored on the class (a staticmethod).

    Raises whatever the import or lookup raises on a torch without them
    (torch/distributed/tensor/_dispatch.py).
    """
    from torch.distributed.tensor._dispatch import OpDispatcher

    return OpDispatcher, OpDispatcher.__dict__["redistribute_local_args"]


# Where DTensor calls ``redistribute_local_tensor(local, current_spec, target_spec, ...)``, the one
# function every DTensor redistribution runs (torch/distributed/tensor/_redistribute.py), and what
# caused the calls from there: each module holds its own reference (``from ... import``).
_REDISTRIBUTE_CALLERS = (
    ("torch.distributed.tensor._redistribute", "redistribute"),  # DTensor.redistribute(), fwd and bwd
    ("torch.distributed.tensor._api", "from_local"),  # from_local's backward (gradient placements)
    ("torch.distributed.tensor._dispatch", None),  # an op's dispatch: the op is the cause
)


def dtensor_redistribute_sites() -> list[tuple[Any, str, Any, str | None]]:
    """``(module, attribute, function, cause)`` for each module that calls DTensor's ``redistribute_local_tensor``.

    ``cause`` is what a call from that module is for: ``"redistribute"``,
    ``"from_local"``, or None for an op's dispatch. Raises whatever the
    imports raise on a torch without them.
    """
    import importlib

    from torch.distributed.tensor import _redistribute

    original = _redistribute.__dict__["redistribute_local_tensor"]
    sites = []
    for name, cause in _REDISTRIBUTE_CALLERS:
        module = importlib.import_module(name)
        if module.__dict__.get("redistribute_local_tensor") is original:
            sites.append((module, "redistribute_local_tensor", original, cause))
    return sites


# Modules that hold DTensor's ``distribute_tensor`` by name (``from ... import``): the parallel styles
# (ColwiseParallel, RowwiseParallel, ...) call it when parallelize_module shards parameters.
_DISTRIBUTE_HOLDERS = ("torch.distributed.tensor._api", "torch.distributed.tensor",
                       "torch.distributed.tensor.parallel.style", "torch.distributed._tensor",
                       "torch.distributed.tensor.placement_types", "torch.distributed._state_dict_utils")


def dtensor_distribute_sites() -> list[tuple[Any, str, Any]]:
    """``(module, "distribute_tensor", function)`` for each module that holds DTensor's ``distribute_tensor``.

    Raises whatever the imports raise on a torch without them; a holder that is missing or holds
    another function is left out.
    """
    import importlib

    from torch.distributed.tensor import _api

    original = _api.__dict__["distribute_tensor"]
    sites = []
    for name in _DISTRIBUTE_HOLDERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if module.__dict__.get("distribute_tensor") is original:
            sites.append((module, "distribute_tensor", original))
    return sites


def dtensor_placement_makers() -> list[tuple[type, str, Any, Any]]:
    """``(class, attribute, classmethod, facts(cls, args) -> (placement, mesh))`` for the placements' own
    makers that ``distribute_tensor`` calls per mesh dimension (``Shard._make_shard_tensor(dim, tensor,
    mesh, ...)``, ``_StridedShard``'s, ``Replicate._make_replicate_tensor(tensor, mesh, ...)``): a
    ``distribute_tensor`` held by name since before the tracer started still runs them. Raises on a
    torch without them."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    return [
        (Shard, "_make_shard_tensor", Shard.__dict__["_make_shard_tensor"],
         lambda cls, args: (cls(args[0]), args[2])),
        (_StridedShard, "_make_shard_tensor", _StridedShard.__dict__["_make_shard_tensor"],
         lambda cls, args: (cls(dim=args[0], split_factor=args[5] if len(args) > 5 else 1), args[2])),
        (Replicate, "_make_replicate_tensor", Replicate.__dict__["_make_replicate_tensor"],
         lambda cls, args: (cls(), args[1])),
    ]


def placements_of(device_mesh: Any, placements: Any) -> tuple:
    """``distribute_tensor``'s target placements as DTensor fills them in (Replicate on every mesh dim if None)."""
    if placements is not None:
        return tuple(placements)
    from torch.distributed.tensor import Replicate

    return (Replicate(),) * (device_mesh.ndim if device_mesh is not None else 1)


def dtensor_full_tensor() -> tuple[type, Any]:
    """``DTensor`` and its ``full_tensor`` method as stored on the class (a public API that redistributes)."""
    from torch.distributed.tensor import DTensor

    return DTensor, DTensor.__dict__["full_tensor"]


def redistribution_specs(current_spec: Any, target_spec: Any) -> tuple[tuple, tuple, Any]:
    """``(source placements, target placements, mesh)`` of ``redistribute_local_tensor``'s two ``DTensorSpec``."""
    return tuple(current_spec.placements), tuple(target_spec.placements), current_spec.mesh


def redistribution_op(op_info: Any, suggested_input_schema: Any) -> tuple[Any, tuple]:
    """The op being redistributed and its input specs, from ``redistribute_local_args``'s arguments."""
    return suggested_input_schema.op, tuple(op_info.flat_args_schema)


# ------------------------------------------------------------------ c10d objects
def unbox_work(work: Any) -> Any:
    """The c10d ``Work`` of a boxed one (as c10d ops return it)."""
    from torch.distributed import Work

    return Work.unbox(work)


def work_future(work: Any) -> Any:
    """The future of a boxed c10d ``Work`` (as c10d ops return it); raises where the backend has none."""
    return unbox_work(work).get_future()


def work_class() -> type:
    """c10d's ``Work``, whose ``wait()`` Python calls block in (``dist.all_reduce``, FSDP2's unshard)."""
    from torch.distributed import Work

    return Work


def wait_tensor_overload() -> Any:
    """``_c10d_functional.wait_tensor.default``: where a functional collective's output is waited for."""
    return torch.ops._c10d_functional.wait_tensor.default


def unbox_process_group(group: Any) -> Any:
    """The ``ProcessGroup`` of a c10d op's boxed group argument (other values as they are)."""
    if isinstance(group, torch.ScriptObject):
        return torch.distributed.ProcessGroup.unbox(group)
    return group


def resolve_process_group(name: str) -> Any:
    """The live ``ProcessGroup`` registered under ``name`` (``distributed_c10d._resolve_process_group``);
    raises where none is."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]


def default_store() -> Any:
    """The default process group's c10d ``Store`` (``distributed_c10d._get_default_store``); raises
    where there is no default group."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def flight_recorder_json() -> bytes | None:
    """This process's Flight Recorder buffer, as torch dumps it in JSON (every backend's entries:
    ``_distributed_c10d._dump_fr_trace_json``; NCCL's own ``_dump_nccl_trace_json`` where the generic one is
    missing), or None where torch has neither. Raises what the dump raises."""
    from torch._C import _distributed_c10d

    dump = getattr(_distributed_c10d, "_dump_fr_trace_json", None) \
        or getattr(_distributed_c10d, "_dump_nccl_trace_json", None)
    return None if dump is None else dump()


# ------------------------------------------------------------------ device meshes
def device_mesh_class() -> type:
    """``torch.distributed.device_mesh.DeviceMesh``; raises where torch.distributed lacks it."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh


def process_groups_state() -> tuple[int, int, int] | None:
    """What changes when a process group is made or destroyed: (id of the default group, groups made since
    it, groups alive), from c10d's ``_world``; None where torch has no such state.

    Every ``DeviceMesh`` makes its dimensions' groups unless they span every rank (the default group)
    or come from existing groups (``from_group``, slicing, flattening).
    """
    try:
        from torch.distributed import distributed_c10d

        world = distributed_c10d._world
        default = world.default_pg
        return (id(default) if default is not None else 0, int(world.group_count), len(world.pg_map))
    except Exception:  # torch without torch.distributed, another c10d
        return None


def mesh_dim_groups(mesh: Any) -> list[tuple[str, str]]:
    """``(dimension name, process group name)`` of each dimension of ``mesh`` that has a group.

    ``DeviceMesh._dim_group_names`` is parallel to its dimensions (set after ``__init__`` by
    ``from_group``, slicing and unflattening; absent without a backend); a mesh without
    ``mesh_dim_names`` names them ``dim_0``, ``dim_1``, ... as the ``group_desc`` of the groups it
    makes does (``mesh_dim_0``).
    """
    groups = getattr(mesh, "_dim_group_names", None)
    if not groups:
        return []
    names = getattr(mesh, "_mesh_dim_names", None) or tuple(f"dim_{index}" for index in range(len(groups)))
    return [(str(name), str(group)) for name, group in zip(names, groups)]


# ------------------------------------------------------------------ DTensor ops dispatched in Python
# DTensor's dispatch runs in C++ (dispatchDTensorOp, torch/csrc/autograd/python_variable.cpp); it calls
# back into Python with the op as the argument ``op_call``: an op's custom handler
# (``OpDispatcher._custom_op_handlers``: loss_parallel's, convolution's, argmin/argmax's, context
# parallel's attention, the AMP found-inf reduction), and the dispatcher's slow paths and tail
# (``aten.equal``'s all_reduce). A collective issued inside such a call is that op's.
_DTENSOR_DIR = os.path.join(os.path.dirname(torch.__file__), "distributed", "tensor", "")
# id(code object) -> (code object, whether it is such a call: takes op_call, in DTensor). By id: a code object's
# own hash is computed from its contents on every call; the object is held, so its id is not reused.
_OP_CALL_CODES: dict[int, tuple[Any, bool]] = {}


def dtensor_op_on_stack(max_frames: int = 24) -> tuple[Any, Any] | None:
    """``(op, args)`` of the innermost DTensor op whose Python part this thread runs now, else None.

    A handler issues its collectives a few calls down (``_nll_loss_forward_handler`` ->
    ``_nll_loss_forward`` -> ``_MaskPartial._reduce_value`` -> ``funcol.all_reduce`` -> our kernel and
    recorder: about 10 frames), so the walk stops after ``max_frames``: a collective issued from deep
    Python code elsewhere (FSDP2's hooks) pays for those few frames only.

    Looks at most ``max_frames`` frames up the calling thread's stack for a function of
    ``torch/distributed/tensor/`` that takes ``op_call`` (an ``OpOverload``); ``args`` is its
    ``args`` (the op's arguments, DTensors among them, as the handler holds them now) or ``()``.
    """
    frame: FrameType | None = sys._getframe(1)
    codes = _OP_CALL_CODES
    while frame is not None and max_frames > 0:
        code = frame.f_code
        entry = codes.get(id(code))
        if entry is None:
            if len(codes) > 65536:  # code made at run time (exec, generated functions): never unbounded
                codes.clear()
            entry = codes[id(code)] = (code, code.co_filename.startswith(_DTENSOR_DIR)
                                       and "op_call" in code.co_varnames[:code.co_argcount])
        if entry[1]:
            found = frame.f_locals
            op = found.get("op_call")
            if isinstance(op, torch._ops.OpOverload):
                args = found.get("args")  # a handler may have made it a list (nll_loss's)
                return op, tuple(args) if isinstance(args, (tuple, list)) else ()
        frame = frame.f_back
        max_frames -= 1
    return None


# ------------------------------------------------------------------ the job's c10d store
def default_store_client(timeout_s: float) -> Any:
    """A connection of this thread's own to the default process group's c10d store, or None.

    ``Store.clone()`` is torch's way to use one store from several threads (a new client of the
    same server, with the same key prefix), so a training thread blocked in a store call never
    holds ours up; its timeout (``timeout_s`` seconds) is its own. A store that cannot be cloned
    (``HashStore``, ``FileStore``) is returned as it is, with its timeout untouched: the caller
    then makes only calls that do not wait for a key. None when there is no default group.
    Raises what torch raises when the store cannot be reached.
    """
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store()
    try:
        own = store.clone()  # type: ignore[attr-defined]
    except (RuntimeError, NotImplementedError):  # "not implemented" for stores without clients
        return store
    own.set_timeout(datetime.timedelta(seconds=timeout_s))
    return own


# ------------------------------------------------------------------ torch's debug server (torch 2.10+)
def debug_server_types() -> tuple[Any, Any, Any]:
    """``(DebugHandler, NavLink, Route)``: what a page of ``torch.distributed.debug.start_debug_server`` is made
    of (``torch/distributed/debug/_frontend.py``). Raises ImportError on a torch without it or without jinja2."""
    from torch.distributed.debug._frontend import DebugHandler, NavLink, Route

    return DebugHandler, NavLink, Route


def debug_server_store(prefix: str) -> Any:
    """A client of the job's TCPStore under ``prefix``, as torch's debug server reaches it (``MASTER_ADDR``,
    ``MASTER_PORT``), and the world size it fans out to (``WORLD_SIZE``): ``(store, world_size)``."""
    from torch.distributed.debug._store import get_world_size, tcpstore_client

    return tcpstore_client(prefix=prefix), get_world_size()


def debug_server_default_handlers() -> list[Any]:
    """torch's own debug-server handlers (stacks, Flight Recorder, py-spy, ...). Raises ImportError without
    tabulate."""
    from torch.distributed.debug._debug_handlers import default_handlers

    return default_handlers()


# ------------------------------------------------------------------ optimizers
def optimizer_classes_made() -> list[type]:
    """The optimizer classes (``torch.optim.Optimizer`` and its subclasses, loaded now) that an instance was
    made of in this process, or that inherit ``step`` from one: ``Optimizer.__init__`` wraps its class's
    ``step`` once, marking the wrapper ``hooked`` (``Optimizer._patch_step_function``,
    torch/optim/optimizer.py). Empty: no optimizer was ever made."""
    found: list[type] = []
    seen: set[int] = set()
    pending: list[type] = [torch.optim.Optimizer]
    while pending:
        kind = pending.pop()
        if id(kind) in seen:
            continue
        seen.add(id(kind))
        if getattr(getattr(kind, "step", None), "hooked", False) is True:
            found.append(kind)
        pending.extend(kind.__subclasses__())
    return found


# A DataLoader worker's process target lives in one of these (torch's own and torchdata's loaders).
_DATA_WORKER_MODULES = ("torch.utils.data", "torchdata")


def is_data_worker(process: Any = None) -> bool:
    """Whether ``process`` (default: this one) is a data-loading worker: its ``multiprocessing.Process``
    target is a DataLoader worker loop (``torch.utils.data._utils.worker._worker_loop``, any start method)."""
    import multiprocessing

    target = getattr(process or multiprocessing.current_process(), "_target", None)
    module = getattr(target, "__module__", None) or ""
    return getattr(target, "__name__", "") == "_worker_loop" and module.startswith(_DATA_WORKER_MODULES)
