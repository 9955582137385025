"""FX rewrites of Inductor's host graph: the first stages of the compile pipeline when
``config.inductor_host_graph`` is set (:mod:`fxrt.pipeline`; :mod:`fxrt.inductor.host_graph`
sets it).

With ``torch._inductor.config.fx_wrapper`` Inductor describes its host wrapper as a
``torch.fx.GraphModule``; these four stages prepare it for fxrt. Each edits the GraphModule in
place and returns how many nodes it changed; the pipeline's manager verifies, times, records and
dumps each like any stage:

1. Rewrite the Python-level torch functions the converter emits into the ATen overloads they
   dispatch to, so that fxrt's compiled loop runs them natively instead of calling back into
   Python: ``torch.empty_strided`` (allocations) -> ``aten.empty_strided.default`` and
   ``torch.as_strided`` (Inductor's ``reinterpret_tensor`` views) -> ``aten.as_strided.default``.
   Extern kernels (``aten.addmm.out``, ``aten.bmm.out``...) and fallback ops already are
   OpOverloads. Inductor's C++ kernels are KERNEL instructions (their C functions, called
   directly: :mod:`fxrt.ops.c_kernels`), SymInt arithmetic SYM steps; what remains Python runs
   as fxrt fallback (PYCALL) instructions inside the same loop.
2. Fold an allocation into the extern kernel that fills it: ``buf = empty_strided(...)`` followed
   by ``addmm.out(..., out=buf)`` as ``buf``'s first use becomes ``buf = addmm(...)``, the
   functional overload of the same op (the same ATen kernel, which allocates its own result), when
   running it on the graph's fake tensors gives exactly ``buf``'s size, strides, dtype and device.
   One host instruction fewer per extern call (4 of W2's 18).
3. Drop views the host graph does not need (each costs an instruction per call):
   ``as_strided`` of an ``as_strided`` reads the same storage, so it is rebased on the first one's
   input; the same view of the same input made twice is made once (a view holds no data, so
   writes in between do not matter); a view with exactly its input's sizes, strides and offset is
   its input; and a view passed to a C++ kernel for a pointer parameter, at its input's offset, is
   its input as far as the kernel can tell (it reads only the data pointer). Views of inputs the
   caller receives are kept, so it never gets an input's tensor object; a returned identity view of
   a buffer the graph allocated is that buffer. Unused views are erased.
4. Make the views what they are in Inductor's own Python wrapper, except views of inputs and
   constants that a caller receives (real views, as in eager):
   ``reinterpret_tensor``, with an offset relative to its base's (``fxrt::reinterpret_tensor``,
   see :mod:`fxrt.ops.reinterpret`: Inductor's ``inductor::_reinterpret_tensor`` lacks the alias
   annotation AOTAutograd's first-call check needs). The converter's ``as_strided`` offsets are
   absolute, the base's traced offset added in, so that offset is taken back out. The compiled
   loop makes these views inline as raw aliases with no view tracking, as Inductor's wrapper
   does, without a dispatcher round trip (the weights' views cost most there: as views of normal
   tensors they go through autograd's view tracking).

Why fxrt's passes and lifetime plan are safe on this graph: Inductor's kernels return nothing and
write some of their tensor arguments (``out_ptr`` buffers allocated earlier by ``empty_strided``,
or graph inputs mutated in place). fxrt treats every node whose target is not an ATen op (a
kernel's call, KERNEL or PYCALL alike) as writing all of its arguments
(:func:`fxrt.analysis.values.written_values`) and as having side effects, so no pass
drops, merges or folds anything a kernel touches. Liveness counts a kernel's arguments as uses of
their whole alias sets (a view shares its base's lifetime), so a buffer's FREE never comes before a
kernel that reads or writes it, through any view. Inductor's own memory planning shows up in the
graph only as reuse: a reused buffer is the same FX value (or an ``as_strided`` of it), so its
lifetime spans every use; Inductor's ``del`` lines produce no nodes. The graph keeps Inductor's
instruction order (fxrt's passes never reorder), so in-place writes stay ordered.

fxrt also joins a fallback's result into the alias sets of all its tensor arguments
(:func:`fxrt.ops.aliasing.output_aliases`), even the None a kernel returns. That costs memory, not
correctness: a buffer a kernel shares with a graph input (a weight, say) is pinned until the call
returns instead of being freed after its last use (on W2 the planned peak is 4104 bytes instead of
2056; Inductor's own wrapper frees them). Telling fxrt that a fallback's None result aliases
nothing is a core change (``fxrt.ops.aliasing.output_aliases``). Subgraphs (``torch.cond``
branches) are not rewritten: they run as Python GraphModules inside the ``cond`` fallback.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from ..ops.reinterpret import reinterpret_tensor

aten = torch.ops.aten

# Python-level functions of Inductor's FX host graph and the ATen overloads they dispatch to.
ATEN_EQUIVALENTS: dict[Any, torch._ops.OpOverload] = {
    torch.empty_strided: aten.empty_strided.default,
    torch.as_strided: aten.as_strided.default,
}


def _aten_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    # The converter passes ``device=device.type`` (a str); the schema's ``Device?`` wants a
    # torch.device so that the compiled loop can convert the constant without Python.
    out = dict(kwargs)
    if isinstance(out.get("device"), str):
        out["device"] = torch.device(out["device"])
    return out


def rewrite_to_aten(gm: torch.fx.GraphModule) -> int:
    """Rewrite, in place, the Python-level calls of ``gm`` that have an ATen equivalent.

    Returns:
        How many nodes were rewritten.
    """
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        try:
            aten_op = ATEN_EQUIVALENTS.get(node.target)
        except TypeError:  # an unhashable callable
            continue
        if aten_op is None:
            continue
        node.target = aten_op
        node.kwargs = _aten_kwargs(dict(node.kwargs))
        changed += 1
    if changed:
        gm.recompile()
    return changed


def _functional_of(out_op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``op.default`` if ``out_op`` is ``op.out`` with the same arguments plus one ``out``."""
    schema = out_op._schema
    writes = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if out_op._overloadname != "out" or [a.name for a in writes] != ["out"]:
        return None
    functional = getattr(out_op.overloadpacket, "default", None)
    if functional is None:
        return None
    fs = functional._schema
    if [a.name for a in fs.arguments] != [a.name for a in schema.arguments if a.name != "out"]:
        return None
    if len(fs.returns) != 1 or fs.returns[0].alias_info is not None or fs.is_mutable:
        return None
    return functional


def _static_ints(xs: Any) -> tuple[int, ...] | None:
    if not isinstance(xs, (list, tuple)) or not all(type(x) is int for x in xs):
        return None
    return tuple(xs)


def _geometry(t: Any) -> tuple[Any, ...] | None:
    """(sizes, strides, offset) of a fake tensor value when all are static ints."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        sizes, strides = _static_ints(list(t.shape)), _static_ints(list(t.stride()))
        offset = t.storage_offset()
    except Exception:  # sparse or other layouts without strides
        return None
    if sizes is None or strides is None or type(offset) is not int:
        return None
    return sizes, strides, offset


def _same_layout(a: Any, b: Any) -> bool:
    geometry = _geometry(a)
    return (
        geometry is not None
        and geometry == _geometry(b)
        and (a.dtype, a.device) == (b.dtype, b.device)
    )


def use_functional_variants(gm: torch.fx.GraphModule) -> int:
    """Fold ``empty_strided`` allocations into the ``.out`` extern calls that fill them (step 2
    of the module docstring), in place.

    Returns:
        How many allocations were folded.
    """
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        buf = node.kwargs.get("out")
        functional = _functional_of(node.target)
        if (
            functional is None
            or not isinstance(buf, torch.fx.Node)
            or buf.target is not aten.empty_strided.default
            or min(buf.users, key=position.__getitem__) is not node  # nothing uses it before
        ):
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}
        if any(a is buf for a in _flat_nodes((node.args, kwargs))):
            continue  # also read as an input: the result must go to a separate buffer
        expected = buf.meta.get("val")
        if _geometry(expected) is None:
            continue  # symbolic sizes: comparing them would add guards this late
        result = _fake_run(functional, node.args, kwargs, expected)
        if not _same_layout(result, expected):
            continue
        with graph.inserting_before(node):
            fresh = graph.call_function(functional, node.args, kwargs)
        fresh.meta["val"] = expected
        position[fresh] = position[node]
        node.replace_all_uses_with(fresh)
        graph.erase_node(node)
        buf.replace_all_uses_with(fresh)  # every remaining use comes after ``node``
        graph.erase_node(buf)
        folded += 1
    if folded:
        gm.recompile()
    return folded


def _flat_nodes(tree: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(tree, lambda n: found.append(n) or n)
    return found


def _fake_run(op: torch._ops.OpOverload, args: Any, kwargs: Any, like: Any) -> Any:
    """``op`` on the fake values of its arguments, or None when that is not possible."""
    fake_mode = getattr(like, "fake_mode", None)
    if fake_mode is None:
        return None
    values = [n.meta.get("val") for n in _flat_nodes((args, kwargs))]
    if any(not isinstance(v, torch.Tensor) or _geometry(v) is None for v in values):
        return None  # only static tensors: symbolic sizes would add guards this late
    fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    try:
        with fake_mode:
            return op(*fake_args, **fake_kwargs)
    except Exception:  # no fake kernel, a data-dependent op: keep the out= call
        return None


def _view_key(view: torch.fx.Node) -> Any:
    base, size, stride, offset = view.args[:4]
    try:
        key = (base, tuple(size), tuple(stride), offset)
        hash(key)
    except TypeError:
        return None
    return key


def _returned(node: torch.fx.Node) -> bool:
    return any(user.op == "output" for user in node.users)


def _allocated(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a tensor the graph made: the result of an ATen op (or one result of a
    multi-output one) that its schema says is fresh, not an alias of an argument."""
    if node.op != "call_function":
        return False
    target, index = node.target, 0
    if target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        target, index = node.args[0].target, node.args[1]
    returns = getattr(getattr(target, "_schema", None), "returns", ())
    return type(index) is int and index < len(returns) and returns[index].alias_info is None


def simplify_views(gm: torch.fx.GraphModule) -> int:
    """Drop the ``as_strided`` views the host graph does not need (step 3 of the module
    docstring), in place.

    Returns:
        How many views were erased.
    """
    graph = gm.graph
    as_strided = aten.as_strided.default
    views = [n for n in graph.nodes if n.op == "call_function" and n.target is as_strided]
    seen: dict[Any, torch.fx.Node] = {}
    for view in views:
        if len(view.args) < 4 or view.args[3] is None or view.kwargs:
            continue  # no explicit offset: it defaults to the input's, which rebasing changes
        base = view.args[0]
        while isinstance(base, torch.fx.Node) and base.target is as_strided:
            base = base.args[0]  # an explicit offset is absolute: the input's view is moot
        if not isinstance(base, torch.fx.Node):
            continue
        if base is not view.args[0]:
            view.args = (base, *view.args[1:])
        # The same view of the same base made twice (Inductor makes one per use): a view holds
        # no data, so writes in between do not matter; the first one serves both.
        key = _view_key(view)
        twin = seen.get(key) if key is not None else None
        if twin is not None and not _returned(view) and not _returned(twin):
            view.replace_all_uses_with(twin)
            continue
        if key is not None:
            seen.setdefault(key, view)
        sizes, strides, offset = (
            _static_ints(view.args[1]),
            _static_ints(view.args[2]),
            view.args[3],
        )
        geometry = _geometry(base.meta.get("val"))
        if geometry is None or type(offset) is not int:
            continue
        if (sizes, strides, offset) == geometry:
            # A caller never gets an input or constant object itself for a view of it; a buffer
            # the graph allocated, which it does not return otherwise, it may get as it is.
            own_buffer = base.op == "call_function" and not _returned(base)
            view.replace_all_uses_with(
                base, delete_user_cb=lambda user, own=own_buffer: own or user.op != "output"
            )
        elif offset == geometry[2]:  # same data pointer
            for user in list(view.users):
                pointer_args = user.meta.get("fxrt_pointer_args", ())
                args = list(user.args)
                for i in pointer_args:
                    if i < len(args) and args[i] is view:
                        args[i] = base
                user.args = tuple(args)
    erased = 0
    for view in reversed(views):
        if not view.users:
            graph.erase_node(view)
            erased += 1
    if erased:
        gm.recompile()
    return erased


def use_reinterpret_views(gm: torch.fx.GraphModule) -> int:
    """Turn the ``as_strided`` views that are not returned views of inputs into
    ``fxrt::reinterpret_tensor`` (step 4 of the module docstring), in place, where the geometry
    is static.

    Returns:
        How many views were rewritten.
    """
    changed = 0
    for view in gm.graph.nodes:
        if view.op != "call_function" or view.target is not aten.as_strided.default:
            continue
        if len(view.args) != 4 or view.kwargs:
            continue
        base, sizes, strides, offset = view.args
        if _returned(view) and not (isinstance(base, torch.fx.Node) and _allocated(base)):
            continue  # a caller gets a view of an input or constant: a real one, as in eager
        geometry = _geometry(base.meta.get("val")) if isinstance(base, torch.fx.Node) else None
        if geometry is None or _static_ints(sizes) is None or _static_ints(strides) is None:
            continue
        if type(offset) is not int:
            continue
        view.target = reinterpret_tensor
        view.args = (base, list(sizes), list(strides), offset - geometry[2])
        changed += 1
    if changed:
        gm.recompile()
    return changed


REWRITES = (rewrite_to_aten, use_functional_variants, simplify_views, use_reinterpret_views)

__all__ = [
    "ATEN_EQUIVALENTS",
    "REWRITES",
    "rewrite_to_aten",
    "simplify_views",
    "use_functional_variants",
    "use_reinterpret_views",
]
