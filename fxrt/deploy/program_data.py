"""The lowered Program as data: what a package stores for runtimes that cannot lower a graph.

fxrt's C++ runtime (``csrc/``) runs the same compiled loop as the Python extension but has no
Python to decode a graph, plan its lifetimes, place its arena and lower it. So ``fxrt.export``
stores the Program itself in the manifest's ``"program"`` field, which the runtime validates and
runs; where fxrt's own loops run the package's graph instead (:mod:`fxrt.deploy.host_loop`), the
Program lowered from the graph must equal the stored one (a package means one program)::

    format     "fxrt-program/1"
    n_regs     size of the register file
    inputs     register of each graph input, in call order
    output     the graph output (fxrt.serialize's argument encoding: {"ref": id}, {"tuple": [...]})
    nodes      node name per node index (errors name nodes)
    code       one object per instruction, in order, "kind" first:
               CALL    node, op, args, kwargs, outputs, multi
               OUT     as CALL, and slot (with multi, output k is slot + k), out_op,
                       out_args, out_kwargs; elementwise (add, sub, mul, clamp_min:
                       fxrt.exec.elementwise) when it has that form
               ALLOC   as CALL, and slot, cpu
               VIEW    as CALL, and view, ints, strides, offset, always
               SYM     node, op (add, mul, ...: fxrt.exec.program.SYM_OPS), args, outputs
               PYCALL  node, op (the callable's name), args, kwargs, outputs, multi, reason
               FREE    regs
    guards     inputs: [position, dtype, device, sizes, strides] per checked tensor input (sizes
               >= 0 exact, -1 any, -2 - k size symbol k; strides >= 0 exact, -1 any, or all
               -2 - k: dense, dimension k-th from the innermost);
               arena_inputs: [position, shape, dtype]; constants_need_grad
    arena      null, or nbytes, device and slots: [offset, nbytes, shape, stride, dtype]

``op`` is the qualified name the manifest's ``ops`` table lists with its schema. Arguments and the
output use :mod:`fxrt.serialize`'s encoding (a tensor is refused: graph tensors are registers,
preloaded from the graph's ``constants``); dtypes are written ``torch.float32``. A program with
PYCALLs or several streams is stored too: the C++ runtime validates it but its loop does not run
it (``fxrt.load`` runs the graph on fxrt's own loops; the C++ API refuses it, naming the node).
Importing this module imports no torch (``python -m fxrt inspect`` uses it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..exec.program import Program

FORMAT = "fxrt-program/1"


def encode_program(program: Program) -> dict[str, Any]:
    """The data form of ``program`` (the lowered Program, before any demotion).

    Raises:
        SerializationError: an argument the encoding cannot hold.
    """
    import torch

    from ..exec.program import (
        Alloc,
        Free,
        Kernel,
        OutCall,
        PyCall,
        Record,
        Stream,
        SymStep,
        View,
        Wait,
    )
    from ..ir.graph import Op
    from ..serialize import SerializationError
    from ..serialize.encode import _Writer

    class Args(_Writer):  # fxrt.serialize's argument encoding, without tensors
        def arg(self, a: Any, where: str) -> Any:
            if isinstance(a, torch.Tensor):
                raise SerializationError(f"{where}: a tensor argument that is not a register")
            return super().arg(a, where)

    w = Args(())
    names = [n.name for n in program.nodes]
    code: list[dict[str, Any]] = []
    for ins in program.code:
        if isinstance(ins, Free):
            code.append({"kind": "FREE", "regs": list(ins.regs)})
            continue
        where = f"node {names[ins.node]}"
        if isinstance(ins, Kernel):
            raise SerializationError(f"{where}: a compiled C kernel cannot be stored")
        d: dict[str, Any] = {"kind": ins.KIND, "node": ins.node}
        if isinstance(ins, SymStep):
            d.update(op=ins.op, args=w.arg(ins.args, where), outputs=list(ins.outputs))
            code.append(d)
            continue
        d.update(
            op=Op.of(ins.target).name,
            args=w.arg(ins.args, where),
            kwargs=w.arg(ins.kwargs, where),
            outputs=list(ins.outputs),
            multi=ins.multi,
        )
        if isinstance(ins, PyCall):
            d["reason"] = ins.reason
        elif isinstance(ins, OutCall):
            d.update(
                slot=ins.slot,
                out_op=Op.of(ins.out_target).name,
                out_args=w.arg(ins.out_args, where),
                out_kwargs=w.arg(ins.out_kwargs, where),
            )
            if ins.elementwise:
                d["elementwise"] = ins.elementwise
        elif isinstance(ins, Alloc):
            d.update(slot=ins.slot, cpu=ins.cpu)
        elif isinstance(ins, Stream):
            d["stream"] = ins.stream
            if isinstance(ins, Record):
                d["event"] = ins.event
            elif isinstance(ins, Wait):
                d.update(events=list(ins.events), protect=list(ins.protect))
        elif isinstance(ins, View):
            d.update(
                view=ins.view,
                ints=list(ins.ints),
                strides=list(ins.strides),
                offset=ins.offset,
                always=ins.always,
            )
        code.append(d)
    g = program.guards
    arena = program.arena
    return {
        "format": FORMAT,
        "n_regs": program.n_regs,
        "inputs": list(program.inputs),
        "output": w.arg(program.output, "graph output"),
        "nodes": names,
        "code": code,
        "guards": {
            "inputs": [
                [s.pos, str(s.meta.dtype), str(s.device), list(s.sizes), list(s.strides)]
                for s in g.input_specs
            ],
            "arena_inputs": [[pos, list(shape), str(dt)] for pos, shape, dt in g.arena_inputs],
            "constants_need_grad": g.constants_need_grad,
        },
        "arena": None
        if arena is None
        else {
            "nbytes": arena.nbytes,
            "device": str(arena.device),
            "slots": [
                [s.offset, s.nbytes, list(s.shape), list(s.stride), str(s.dtype)]
                for s in arena.slots
            ],
        },
    }


def first_difference(a: Any, b: Any, path: str = "program") -> str | None:
    """Where two encoded programs first differ (for the load error), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{path}.{k}"
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path} (length {len(a)} vs {len(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    if type(a) is not type(b) or a != b:
        return path
    return None


def cpp_runnable(program: dict[str, Any] | None) -> str | None:
    """Why the C++ runtime cannot run a stored program (None: it can, as far as the data says;
    the C++ loader validates the rest)."""
    if not isinstance(program, dict):
        return "the package stores no program (made by an older fxrt, or not encodable)"
    for ins in program.get("code", ()):
        kind = ins.get("kind") if isinstance(ins, dict) else None
        if kind in ("PYCALL", "STREAM", "RECORD", "WAIT"):
            nodes = program.get("nodes", [])
            i = ins.get("node")
            name = nodes[i] if isinstance(i, int) and 0 <= i < len(nodes) else "?"
            if kind == "PYCALL":
                return f"node {name} runs Python ({str(ins.get('op'))[:80]})"
            return f"node {name} switches streams (fxrt.load runs it on fxrt's own loops)"
    return None


__all__ = ["FORMAT", "cpp_runnable", "encode_program", "first_difference"]
