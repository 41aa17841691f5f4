"""Module tracking: torch's global module hooks and multi-grad hooks, reported to the recorder.

* Forward begins in a global forward pre-hook
  (``torch.nn.modules.module.register_module_forward_pre_hook``).
* Forward ends in a module-local forward hook, last in the module's own
  hooks, always called: global forward hooks run before module-local ones
  (``Module._call_impl``), so closing there would miss collectives that
  tensor parallel issues in the module's own output hook (RowwiseParallel's
  all_reduce). The pre-hook adds it for the call's duration and it removes
  itself: between calls a module holds only its own hooks (TorchScript,
  export, copies and pickles inspect them).
* A call's inputs and outputs are searched for tensors in any container:
  tuples, lists, dicts, dataclasses, types registered with torch's pytree,
  and for outputs other objects' ``__dict__`` and ``__slots__``, within
  bounds (cycles).
* Backward begins when the first gradient w.r.t. the call's outputs is ready
  (a ``Tensor.register_hook`` per output; the recorder keeps the first per
  graph task, as ``register_multi_grad_hook(mode="any")`` would) and ends when
  gradients w.r.t. its inputs are computed (the input's own hook, or
  ``torch.autograd.graph.register_multi_grad_hook`` for several inputs, as
  ``torch.distributed._tools.mod_tracker.ModTracker`` does). The engine's
  ``queue_callback`` closes whatever is left at the end of the backward.
* A forward that runs while the autograd engine is running is activation
  checkpoint recompute.
* A module compiled on its own is one span, marked compiled: torch's
  ``OptimizedModule`` (``torch.compile(module)``) runs its module hooks
  eagerly around the compiled code, and an in-place ``module.compile()``'s
  compiled call (``Module._compiled_call_impl``) is wrapped when the module is
  first named, because its hooks run inside the compiled code. Hooks traced
  into compiled code return at once (``torch.compiler.is_compiling()``), so
  they add nothing to the graph; modules inside a compiled call get no spans,
  even where a graph break runs them eagerly. Under compiled autograd the
  backward is one compiled graph: its module and tensor hooks return at once
  (the forward keeps its spans; the backward passes get none).
* On a step that records no module passes (untraced, no module label in the
  metrics), only the outermost call matters (the pass label of its
  collectives): the global hooks are removed for its duration, so the modules
  inside take ``Module._call_impl``'s hook-free fast path, and come back in its
  forward hook. Once ``optimizer.step()`` ends steps on a known training
  thread, they stay off until the step closes (``Recorder.hook_free_step``):
  the step's first module call opens it, and no other module call of the step
  runs Python of ours; they come back at the step's close (:meth:`ModuleTracker.resume`),
  so the next step, traced or not, is seen from its first call.

Modules are held through weak references only. Every hook catches its own
errors, logs once and gives up; none raises into training.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from commdebug_otel import semconv
from commdebug_otel.capture._torch import (
    add_forward_hook_last,
    add_tensor_hook,
    compiled_call,
    compiled_original,
    disown_global_hooks,
    has_forward_hook,
    in_compiled_code,
    mark_unserializable,
    new_hook_id,
    own_global_hooks,
    pytree_children,
    remove_forward_hook,
    remove_global_forward_hook,
    rewrites_keyword_inputs,
    run_tensor_hook_first,
    set_compiled_call,
    user_class,
)
from commdebug_otel.core.protocols import ModuleHooks
from commdebug_otel.core.records import Record
from commdebug_otel.core.thread_role import one_role_holder


class _TooLarge(Exception):
    """A module's inputs or outputs hold more containers than :func:`_grad_tensors` walks."""

    def __init__(self, found: list) -> None:
        super().__init__(f"more than {_MAX_CONTAINERS} containers or {_MAX_DEPTH} levels: the rest is not hooked")
        self.found = found


# Values that hold no tensor: skipped at once (None and plain fields are common in outputs).
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                    torch.memory_format, slice, type(Ellipsis)})
_Tensor = torch.Tensor
# Bounds on one call's walk (cycles, huge object graphs): the containers entered, and how deep.
_MAX_CONTAINERS, _MAX_DEPTH = 1024, 32


def _grad_tensors(value: Any, found: list, objects: bool = True) -> list:
    """Append the tensors that require grad in ``value`` (a module's inputs or outputs) to ``found``; return it.

    Any container: tuples and lists (namedtuples too), dicts (``ModelOutput``, an OrderedDict and a
    dataclass), dataclasses, types registered with torch's pytree, and, if ``objects``, other objects
    through their ``__dict__`` and ``__slots__`` (a distribution holding its parameters). Not modules,
    classes nor tensor-likes (``__torch_function__``: an fx ``Proxy``). Raises :class:`_TooLarge` (with
    what was found) past ``_MAX_CONTAINERS`` containers or ``_MAX_DEPTH`` levels.
    """
    if isinstance(value, _Tensor):  # the common case first: one output tensor
        if value.requires_grad:
            found.append(value)
    elif type(value) not in _ATOMS and _walk(value, found, _MAX_DEPTH, _MAX_CONTAINERS, objects) < 0:
        raise _TooLarge(found)
    return found


def _walk(value: Any, found: list, depth: int, budget: int, objects: bool) -> int:
    """:func:`_grad_tensors` in a container; returns how many more containers may be entered (negative: cut)."""
    items: Any
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        items = _members(value, objects)
        if not items:
            return budget
    if depth == 0 or budget == 0:
        return -1
    budget -= 1
    for item in items:  # tensors and plain values here: one call less per item
        if isinstance(item, _Tensor):
            if item.requires_grad:
                found.append(item)
        elif type(item) not in _ATOMS:
            budget = _walk(item, found, depth - 1, budget, objects)
            if budget < 0:
                break
    return budget


def _members(value: Any, objects: bool) -> Any:
    """The values inside an object that is not a built-in container (empty: none to look at, or it raised);
    ``objects``: any object's ``__dict__`` and ``__slots__`` too, else dataclasses and pytree types only."""
    if isinstance(value, (torch.nn.Module, type)) or hasattr(type(value), "__torch_function__"):
        return ()
    try:
        if dataclasses.is_dataclass(value):
            return [getattr(value, field.name, None) for field in dataclasses.fields(value)]
        children = pytree_children(value)  # a type registered with torch's pytree
        if children is not None:
            return children
        if not objects:
            return ()
        members = list(value.__dict__.values()) if hasattr(value, "__dict__") else []
        for cls in type(value).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__"):
                    members.append(getattr(value, name, None))
        return members
    except Exception:  # an odd object (a __getattr__ or flatten function that raises): not looked into
        return ()


def _edge(tensor: torch.Tensor) -> int:
    """What identifies the gradient a tensor receives: its autograd node and output slot, or the leaf itself.

    Compared only while the call runs, when its inputs keep their nodes alive. An int, not a tuple:
    no object the garbage collector tracks, alive through the call (docs/performance.md).
    """
    node = tensor.grad_fn
    # Node addresses are 16-byte aligned: shifted, distinct nodes never meet below 2**24 output slots.
    return (id(node) << 20) + tensor.output_nr if node is not None else -id(tensor)


def _edges(tensors: list) -> tuple | set:
    """The edges of ``tensors``: a tuple for a few (untracked by the collector once it sees it), else a set."""
    edges = tuple([_edge(t) for t in tensors])
    return edges if len(edges) <= 8 else set(edges)


_EMPTY: frozenset = frozenset()


def _hooked_inputs(grads: list) -> list:
    """The inputs whose gradients end a call's backward: leaves are left out.

    Torch's "all" multi-grad hook asks the engine about each tensor's node, which raises for a
    leaf inside torch.autograd.grad() (pipeline parallel does that). Without a hook, backward
    ends with the pass.
    """
    return [t for t in grads if t.grad_fn is not None]

# Passes whose outputs get backward hooks: a recompute's too, for reentrant checkpointing, whose
# backward runs through the recomputed graph (non-reentrant checkpointing never backpropagates
# through it: those hooks never fire and go with the step).
_HOOKED_PASSES = frozenset({semconv.PASS_FORWARD, semconv.PASS_RECOMPUTE})
# Hooks that check which thread trains and then record: the check and the records hold together. Called
# only outside compiled code (after _compiled()).
_tracker_hook = one_role_holder(attrgetter("_recorder.role"))


class ModuleNames:
    """Module FQNs, CommDebugMode's: the root's class name, then the dotted path; modules held weakly.

    The root's class is the one the user wrote (``Net``, not the ``FSDPNet`` that ``fully_shard``
    swaps in: ``_torch.user_class``; not ``OptimizedModule`` for ``torch.compile(Net())``, whose
    ``_orig_mod`` shares its FQN); :meth:`torch_fqn` gives torch's own root name back.

    Args:
        on_named: called with each module as it is first named (the tracker wraps an in-place
            ``module.compile()``'s compiled call there); it must not raise.
    """

    def __init__(self, on_named: Callable[[torch.nn.Module], None]) -> None:
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # A root FQN's first part as ours -> as torch's ModTracker writes it (``type(root).__name__``),
        # where the two differ: what the CommDebugMode drop-in keys by.
        self._torch_roots: dict[str, str] = {}
        self._on_named = on_named

    def __len__(self) -> int:
        return len(self._names)

    def get(self, module: torch.nn.Module) -> str | None:
        """The FQN of a module already named, else None (safe from any thread: names nothing)."""
        return self._names.get(module)

    def fqn(self, module: torch.nn.Module) -> str:
        """The module's FQN; a module not named yet is a root: it and its descendants are named now."""
        name = self._names.get(module)
        if name is None:
            name = self._names[module] = user_class(type(compiled_original(module) or module)).__name__
            torch_name = type(module).__name__  # FSDPNet, or OptimizedModule for torch.compile(Net())
            if torch_name != name:
                # Two roots of one user class, one swapped and one not, share our name; torch's the first seen.
                self._torch_roots.setdefault(name, torch_name)
            self._on_named(module)
            self._name_children(module, name)
        return name

    def torch_fqn(self, fqn: str) -> str:
        """``fqn`` as torch's ModTracker (and so its CommDebugMode) names the module: the root part
        is ``type(root).__name__`` (``FSDPNet.blocks.0`` for our ``Net.blocks.0``)."""
        if not self._torch_roots:
            return fqn
        root, dot, rest = fqn.partition(".")
        torch_root = self._torch_roots.get(root)
        return fqn if torch_root is None else f"{torch_root}{dot}{rest}"

    def _name_children(self, module: torch.nn.Module, prefix: str) -> None:
        original = compiled_original(module)
        for child_name, child in module.named_children():
            if child not in self._names:
                # torch.compile(module) registers the module as its "_orig_mod": one FQN for both.
                full = prefix if child is original else f"{prefix}.{child_name}"
                self._names[child] = full
                self._on_named(child)
                self._name_children(child, full)


class ModuleTracker:
    """Installs and removes the module hooks that feed a recorder (``protocols.ModuleHooks``)."""

    def __init__(self, recorder: ModuleHooks) -> None:
        self._recorder = recorder
        self._began = _BackwardBegan(recorder)  # every record's backward-begin hook calls it
        self._names = ModuleNames(self._wrap_compiled_call)
        # Our forward hook, put last in a module's own hooks for the call's duration only (nothing of
        # ours stays on a user's module between calls: TorchScript, pickling and copies inspect them).
        self._end_hook, self._end_hook_id = _PostHook(self), new_hook_id()
        # Calls in flight, one entry in each list: the module, its record (None: not recorded), whether its
        # inside is compiled, whether an outer call of the same module removes our forward hook at its
        # end; the hooks' bookkeeping of the call: its positional inputs if they carry the backward-end
        # hook (keyword inputs may join them), its inputs' autograd edges (_edge), the ids of its outputs
        # with a backward-begin hook. Parallel lists, not a tuple per call: no object more alive through the call.
        self._calls: list[torch.nn.Module] = []
        self._call_records: list[Record | None] = []
        self._call_compiled: list[bool] = []
        self._call_nested: list[bool] = []
        self._call_args: list[tuple | None] = []
        self._call_edges: list[tuple | set | frozenset] = []
        self._call_hooked: list[set[int] | frozenset] = []
        self._call_lists = (self._calls, self._call_records, self._call_compiled, self._call_nested,
                            self._call_args, self._call_edges, self._call_hooked)
        self._wrapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module.compile()'d
        self._pre_handle: Any = None
        self._early_post_handle: Any = None
        self._suspended = False  # global hooks off inside an unrecorded outermost call
        self._step_suspended = False  # ... and after it, until the step closes (resume())
        recorder.resume_module_hooks = self.resume
        self._thread_changes = 0  # the recorder's thread_changes that the calls in flight belong to

    def install(self) -> None:
        self._add_global_hooks()

    def _add_global_hooks(self) -> None:
        self._suspended = False
        self._pre_handle = register_module_forward_pre_hook(self._pre_hook)
        self._early_post_handle = register_module_forward_hook(self._early_post_hook, with_kwargs=True)
        own_global_hooks(self._pre_handle, self._early_post_handle)

    def _remove_global_hooks(self) -> None:
        if self._early_post_handle is not None:
            remove_global_forward_hook(self._early_post_handle)
            disown_global_hooks(self._early_post_handle)
        if self._pre_handle is not None:
            self._pre_handle.remove()
            disown_global_hooks(self._pre_handle)
        self._pre_handle = self._early_post_handle = None

    def remove(self) -> None:
        self._remove_global_hooks()
        self._suspended = self._step_suspended = False
        for module in self._calls:
            remove_forward_hook(module, self._end_hook_id)
        for entries in self._call_lists:
            entries.clear()
        for module, wrapper in list(self._wrapped.items()):
            if compiled_call(module) is wrapper:
                set_compiled_call(module, wrapper.call)
        self._wrapped.clear()

    def resume(self) -> None:
        """The step whose calls ran hook-free closed: the global hooks come back (at once, or at the end of
        the outermost call in flight). Nothing if they were not taken off (or the tracker was removed)."""
        self._step_suspended = False
        if self._suspended and not self._calls:
            self._add_global_hooks()

    def _new_thread(self) -> None:
        """The training thread's role changed hands (``Recorder.tracks_thread``): the calls in flight are
        the other thread's, whose hooks return at once from now on."""
        self._thread_changes = self._recorder.thread_changes
        for entries in self._call_lists:
            entries.clear()

    def state_sizes(self) -> dict[str, int]:
        """How many entries each piece of per-run state holds, by name (for leak checks)."""
        hooked = {id(module) for module in self._calls if has_forward_hook(module, self._end_hook_id)}
        return {"named modules": len(self._names), "module hooks": len(hooked),
                "calls in flight": len(self._calls), "compiled calls wrapped": len(self._wrapped)}

    def known_fqn(self, module: torch.nn.Module) -> str | None:
        """The FQN of a module already called, else None (safe from any thread: names nothing)."""
        return self._names.get(module)

    def fqn(self, module: torch.nn.Module) -> str:
        """The module's FQN (:meth:`ModuleNames.fqn`), naming it and its descendants first if need be."""
        return self._names.fqn(module)

    def torch_fqn(self, fqn: str) -> str:
        """:meth:`ModuleNames.torch_fqn`: ``fqn`` as torch's CommDebugMode writes it."""
        return self._names.torch_fqn(fqn)

    def _wrap_compiled_call(self, module: torch.nn.Module) -> None:
        """An in-place ``module.compile()``: our calls go around its compiled call (undone in remove())."""
        call = compiled_call(module)
        if call is not None and not isinstance(call, _CompiledCall):
            wrapper = self._wrapped[module] = _CompiledCall(self, module, call)
            set_compiled_call(module, wrapper)

    # The hooks. Each one swallows its own failure: training must never see it.
    def _pre_hook(self, module: torch.nn.Module, args: tuple) -> None:
        if not _compiled() and self._recorder.active:
            self._pre(module, args)

    @_tracker_hook
    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        recorder = self._recorder
        try:
            if not recorder.tracks_thread():
                return  # another thread's call (inference, EMA): never part of the training step
            if recorder.thread_changes != self._thread_changes:
                self._new_thread()
            if self._call_compiled and self._call_compiled[-1]:
                return  # inside a compiled call (a graph break runs this module eagerly): no span
            original = compiled_original(module)
            # Last, so the module's own forward hooks (tensor parallel's output all_reduce) are inside the span.
            nested = add_forward_hook_last(module, self._end_hook_id, self._end_hook) and self._in_flight(module)
            self._begin(module, args, original, nested)
        except Exception as error:
            recorder.hook_failed("module forward pre-hook", error)

    def _grad_tensors(self, value: Any, outputs: bool = False) -> list:
        """:func:`_grad_tensors`; what it finds past its bounds is not hooked: counted and logged once.

        Inputs (``outputs`` false) are not searched in other objects: one passed along holds tensors
        that are not the call's inputs (a Hugging Face ``DynamicCache`` holds every earlier layer's
        keys and values), and the call's backward would end only with their gradients.
        """
        try:
            return _grad_tensors(value, [], outputs)
        except _TooLarge as cut:
            self._recorder.hook_failed("module inputs or outputs walk", cut)
            return cut.found

    def _in_flight(self, module: torch.nn.Module) -> bool:
        return any(call is module for call in self._calls)  # identity: a module's own __eq__ is not ours to run

    def _begin(self, module: torch.nn.Module, args: tuple, original: torch.nn.Module | None,
               nested: bool = True) -> None:
        """A call begins; ``original``: the module whose compiled code runs inside it, else None;
        ``nested``: our forward hook on the module stays at the call's end (an outer call of it, or none)."""
        recorder = self._recorder
        name = self._names.get(module)
        if name is None:
            name = self.fqn(module)
        compiled = original is not None
        record = recorder.module_pre(original or module, name, args, compiled)
        self._calls.append(module)
        self._call_records.append(record)
        self._call_compiled.append(compiled)
        self._call_nested.append(nested)
        self._call_args.append(None)
        self._call_edges.append(_EMPTY)
        self._call_hooked.append(_EMPTY)
        if record is None:
            # Not while another thread may take the role back: it must see its own calls.
            if len(self._calls) == 1 and recorder.thread_settled:
                self._suspend_inside(module)
        elif torch.is_grad_enabled() and record.pass_ in _HOOKED_PASSES:
            grads = self._grad_tensors(args)
            if grads:
                self._call_edges[-1] = _edges(grads)
            inputs = _hooked_inputs(grads)
            if inputs:
                self._call_args[-1] = args  # alive through the call anyway: keyword inputs may join them
                self._hook_backward_end(record, inputs)

    def _run_compiled(self, module: torch.nn.Module, call: Any, args: tuple, kwargs: dict) -> Any:
        """``module.compile()``'s call, as one span: the hooks inside it are compiled code."""
        if not self._begin_compiled(module, args):
            return call(*args, **kwargs)
        try:
            output = call(*args, **kwargs)
        except BaseException:
            self._end(module, None, True)  # inside the handler: the span records the error
            raise
        self._end(module, output, True)
        return output

    @_tracker_hook
    def _begin_compiled(self, module: torch.nn.Module, args: tuple) -> bool:
        """:meth:`_run_compiled`'s call begins; whether it is recorded (False: another thread's, or inside
        another compiled call)."""
        try:
            if self._recorder.tracks_thread():  # not another thread's
                if self._recorder.thread_changes != self._thread_changes:
                    self._new_thread()
                if not (self._call_compiled and self._call_compiled[-1]):  # not inside another compiled call
                    self._begin(module, args, module)
                    return True
        except Exception as error:
            self._recorder.hook_failed("module forward pre-hook", error)
        return False

    def _hook_backward_end(self, record: Record, inputs: list) -> None:
        """Hook the end of ``record``'s backward: all gradients w.r.t. ``inputs`` (non-leaf tensors) computed."""
        record.input_hooked = True
        end = record.end_hook  # a reused record's, its hooks removed when its step closed
        if end is None or end.record is not record:
            end = record.end_hook = _BackwardEnd(self._recorder, record)
        # One input (the common case): its own hook is "all" grads, at a third of the cost.
        if len(inputs) == 1:
            handle = add_tensor_hook(inputs[0], end)
        else:
            handle = register_multi_grad_hook(inputs, end)
            mark_unserializable(handle)
        self._recorder.keep_hook(handle)

    def _add_keyword_inputs(self, module: torch.nn.Module, record: Record, kwargs: dict) -> None:
        """Keyword inputs, which the global pre-hook does not see, join the call's inputs.

        An output that passes one through opens no backward, and the backward ends
        when their gradients are computed too (the end hook is registered again over
        all inputs). Hooked now, after the forward, so the pre-hook's end hook stays
        where a positional input was modified in place since the call began, and where
        the module's own pre-hooks may have replaced the keyword inputs (FSDP2, TP's
        ``PrepareModuleInput``: their backward, the unit's reduce-scatter, belongs inside
        the span): then the backward ends at the end of the pass.
        """
        grads = self._grad_tensors(kwargs)
        if not grads:
            return
        before = self._call_edges[-1]
        self._call_edges[-1] = {*before, *(_edge(t) for t in grads)}
        keywords = _hooked_inputs(grads)
        if not keywords or not torch.is_grad_enabled() or rewrites_keyword_inputs(module):
            return
        hooked = record.input_hooked
        inputs = _hooked_inputs(self._grad_tensors(self._call_args[-1])) if hooked else []
        if any(_edge(t) not in before for t in inputs):
            return
        if hooked:
            record.end_hook.record = None  # the hook stays on the tensor, inert; a new one covers all inputs
        self._hook_backward_end(record, [*inputs, *keywords])

    def _suspend_inside(self, outermost: torch.nn.Module) -> None:
        """Nothing is recorded inside ``outermost``'s call: no hook of ours runs there.

        Its own forward hook (added by the pre-hook, ``always_call``) brings the global
        hooks back, unless the step's calls go hook-free to its close (``resume``).
        """
        self._remove_global_hooks()
        self._suspended = True
        self._step_suspended = self._recorder.hook_free_step()

    def _early_post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Global forward hooks run before the module's own: hook the raw outputs first.

        A module's own forward hook may put a tensor hook on its outputs that
        issues collectives in backward (FSDP2's pre-backward all-gather); ours,
        registered earlier on the same tensors, fires before it. Keyword inputs
        (which the global pre-hook does not see) are known here: an output that
        passes one through is not hooked either.
        """
        if not _compiled() and self._recorder.active:
            self._early_post(module, kwargs, output)

    @_tracker_hook
    def _early_post(self, module: torch.nn.Module, kwargs: dict, output: Any) -> None:
        recorder = self._recorder
        if not self._calls:
            return
        try:
            if not recorder.tracks_thread(claim=False):
                return
            record = self._call_records[-1]
            if self._calls[-1] is module and record is not None:
                if kwargs and record.pass_ in _HOOKED_PASSES:
                    self._add_keyword_inputs(module, record, kwargs)
                self._call_hooked[-1] = self._hook_backward_begin(record, output, self._call_edges[-1],
                                                                  self._call_hooked[-1])
        except Exception as error:
            recorder.hook_failed("module forward hook", error)

    def _hook_backward_begin(self, record: Record, output: Any, inputs: tuple | set | frozenset,
                             hooked: set[int] | frozenset, first: bool = False) -> set[int] | frozenset:
        """Our backward-begin hook on each output of ``record``'s call not ``hooked`` yet (ids) nor one of its
        ``inputs`` (autograd edges); ``first``: before the output's hooks registered so far. Returns the ids
        hooked, with these."""
        if record.pass_ not in _HOOKED_PASSES or not torch.is_grad_enabled() or not self._recorder.step_open:
            return hooked  # no step open (its inference step closed with the call): no step would remove the hook
        # An output that is an input passed through (the same tensor, or the same autograd
        # edge: Identity, Dropout(p=0) or in eval, a gate returning x) gets its gradient
        # only when the inputs' gradients are ready: the module has no backward of its own.
        outputs = [t for t in self._grad_tensors(output, outputs=True)
                   if id(t) not in hooked and _edge(t) not in inputs]
        if outputs:
            if hooked:
                hooked.update(id(t) for t in outputs)  # type: ignore[union-attr]  # (a set once it has any)
            else:
                hooked = {id(t) for t in outputs}
            # A plain hook per output tensor: the first to fire begins the backward and the
            # recorder ignores the rest of the same graph task (register_multi_grad_hook's
            # "any" mode, without its per-call wrapper and lock). The record itself is the
            # hook: no object more per call, alive through the step (docs/performance.md).
            record.backward_hook = self._began
            for tensor in outputs:
                handle = add_tensor_hook(tensor, record)
                self._recorder.keep_hook(handle)
                if first:
                    run_tensor_hook_first(tensor, handle)
        return hooked

    def _post_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not _compiled():
            self._end(module, output)

    @_tracker_hook
    def _end(self, module: torch.nn.Module, output: Any, in_place_compiled: bool = False) -> None:
        """A call ended; ``in_place_compiled``: the module's own hooks ran inside its compiled call."""
        recorder = self._recorder
        if not recorder.active or not self._calls:
            remove_forward_hook(module, self._end_hook_id)  # no call of ours in flight: nothing to end
            return
        try:
            if not recorder.tracks_thread(claim=False):
                return  # another thread's call: the training thread's call of the module keeps our hook
            calls, records, compiled, nested = self._calls, self._call_records, self._call_compiled, self._call_nested
            if compiled[-1] and calls[-1] is not module:
                return  # a module inside a compiled call
            while True:
                entry_module, record = calls.pop(), records.pop()
                compiled.pop()
                self._call_args.pop()  # the inputs are not kept past the call
                edges, hooked = self._call_edges.pop(), self._call_hooked.pop()
                if not nested.pop():
                    remove_forward_hook(entry_module, self._end_hook_id)
                if entry_module is module or not calls:
                    break  # else: a call whose hook never came back
            if entry_module is not module:
                remove_forward_hook(module, self._end_hook_id)  # a call whose pre-hook failed
                return
            if self._suspended and not calls and not self._step_suspended:
                self._add_global_hooks()
            recorder.module_post(module, record)
            if record is not None:
                # The module's own hooks may have replaced the outputs (tensor parallel). In place
                # compiled, they ran inside the compiled call: ours go before theirs (FSDP2's
                # pre-backward all-gather belongs to this backward). A tensor hooked before them and
                # returned as such: nothing more to hook (one they changed in place may need its hook).
                if in_place_compiled or not (type(output) is torch.Tensor and id(output) in hooked):
                    self._hook_backward_begin(record, output, edges, hooked, first=in_place_compiled)
        except Exception as error:
            recorder.hook_failed("module forward hook", error)


# Whether a hook runs inside compiled code: traced by dynamo (nothing of ours may go into a graph) or compiled
# autograd's backward graph running (its modules and hooks are its own, not the model's).
_compiled = in_compiled_code


class _PostHook:
    """Our forward hook, in a module's ``_forward_hooks`` only while the module's call runs.

    A module copied or pickled from inside its own call (its forward, a hook) holds it: the copy
    gets a no-op of Python's own (``Exception().__init__``, which takes any arguments and returns
    None), so nothing of ours is pickled and the copy loads where this package is not installed.
    """

    __slots__ = ("tracker",)

    def __init__(self, tracker: ModuleTracker) -> None:
        self.tracker = tracker

    def __call__(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.tracker._post_hook(module, args, output)

    def __deepcopy__(self, memo: dict) -> Any:
        return Exception().__init__  # type: ignore[misc]

    def __reduce__(self) -> Any:
        return getattr, (Exception(), "__init__")


class _CompiledCall:
    """Stands in for an in-place compiled module's ``_compiled_call_impl``: our span around its call."""

    __slots__ = ("call", "module", "tracker")

    def __init__(self, tracker: ModuleTracker, module: torch.nn.Module, call: Any) -> None:
        self.tracker, self.module, self.call = tracker, weakref.ref(module), call

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self.call, memo)  # a copy of the module gets torch's compiled call, as untraced

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.call.__reduce_ex__(protocol)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracker, module = self.tracker, self.module()
        if _compiled() or tracker._suspended or not tracker._recorder.active or module is None:
            return self.call(*args, **kwargs)
        return tracker._run_compiled(module, self.call, args, kwargs)


class _BackwardBegan:
    """What a record does when a gradient reaches one of its call's outputs (``Record.__call__``):
    its backward begins. One per tracker."""

    __slots__ = ("recorder",)

    def __init__(self, recorder: ModuleHooks) -> None:
        self.recorder = recorder

    def __call__(self, record: Record) -> None:
        if _compiled() or not self.recorder.active:
            return
        try:
            self.recorder.backward_began(record)
        except Exception as error:
            self.recorder.hook_failed("module backward pre-hook", error)


class _BackwardEnd:
    """A tensor (or multi-grad) hook on a call's inputs: the gradients w.r.t. them are computed."""

    __slots__ = ("record", "recorder")
    __torch_unserializable__ = True  # pickling a tensor that holds it warns of nothing (torch's unserializable_hook)

    def __init__(self, recorder: ModuleHooks, record: Record) -> None:
        self.recorder, self.record = recorder, record

    def __call__(self, _grads: Any) -> None:
        record = self.record  # None: replaced by a hook over more inputs (keyword inputs)
        if record is None or _compiled() or not self.recorder.active:
            return
        try:
            self.recorder.backward_ended(record)
        except Exception as error:
            self.recorder.hook_failed("module backward hook", error)
