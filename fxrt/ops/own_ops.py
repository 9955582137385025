"""fxrt's own CPU ops ("own ops"), used in fxrt graphs where ATen's kernel choice costs more host
time than the math.

The compiled extension (``fxrt/_speedups``) registers them with the dispatcher when it loads,
as ``fxrt::*`` ops. Each has its ATen op's schema and computes what the ATen op computes, with
one of ATen's own CPU kernels or a vectorized one of its own (within a stated bound of eager's
values, docs/numerics.md); it calls the ATen op itself whenever its fast path does not apply
(another device or dtype, a large or non-contiguous input, autograd recording, a dispatch mode, a
tensor subclass), so nothing but the fast path differs from eager.

* ``fxrt::gelu``: ``aten::gelu`` (``approximate='none'``) on a contiguous float32 CPU tensor of at
  most 8192 elements runs ATen's vectorized ``GeluKernel`` instead of oneDNN's eltwise primitive,
  whose per-call set-up dominates at these sizes (1x256: 2.9 us against 14.4 us). Results are
  those of ATen's kernel, which eager itself runs when oneDNN is off; they differ from oneDNN's
  in the last bit of some elements.
* ``fxrt::attention``: ``aten::_scaled_dot_product_flash_attention_for_cpu`` (what
  ``scaled_dot_product_attention`` runs on the CPU) on float32 problems with no dropout: each
  head computed directly on the calling thread (scores, softmax, product with the values, each
  key/value head laid out once for the query heads that read it) instead of ATen's blocked flash
  kernel, whose buffers and parallel loop cost about 20 us on small problems and which runs at
  about half its speed on one thread (``python benchmarks/attention.py``). Same outputs and
  layouts; values within float32 rounding of ATen's (both exponentials are vectorized
  approximations). Above 2**18 multiply-adds with more than two intra-op threads, ATen's kernel.
  Where the graph never reads the logsumexp (inference), ``fxrt::sdpa``: the same kernel
  returning the output alone, which the arena holds through its ``out=`` overload.
* ``fxrt::softcap_sdpa``: attention with soft-capped scores (Gemma-2's ``softcap * tanh(scores
  / softcap)`` before the mask), which ATen has no op for: :mod:`fxrt.passes.fuse_attention`
  makes it of the chain written out, and ``fxrt::attention``'s kernel computes it (the cap
  through SLEEF's ``tanhf``); off that fast path, eager's chain of ATen ops.
* ``fxrt::layer_norm``: ``aten::native_layer_norm`` when the graph uses only its first result
  (the normalized tensor; inference never reads the means and inverse standard deviations it
  also allocates and reshapes). On float32 contiguous CPU tensors it runs the same CPU kernel
  into one result, or into the arena through its ``out=`` overload; results are eager's, bit for
  bit.
* ``fxrt::tanh``: ``aten::tanh`` on a contiguous float32 CPU tensor computes with SLEEF's
  vectorized ``tanhf`` (what Inductor's CPU kernels call; libtorch exports it) instead of MKL's
  vector math, which takes 2.7 ns an element on AMD CPUs (64K elements: 76 us against 180 us).
  Within 1 ulp of eager's results; NaN, +-inf, -0 and denormals are eager's. With more than one
  intra-op thread, inputs above 32768 elements are ``aten::tanh``'s (parallel).
* ``fxrt::embedding``: ``aten::embedding``'s forward, the weight's rows at the indices, copied
  directly when the weight's rows are contiguous and the indices a contiguous int64 or int32
  CPU tensor within range, in any dtype. ATen makes it a reshape, an ``index_select`` through the
  dispatcher and a view (4-12 us on a decoder's 16 token ids); the result is eager's bytes, and
  the arena holds it through the ``out=`` overload. An index out of range is ``aten::embedding``
  (eager's error).

:func:`use_own_ops` rewrites a graph's nodes to these ops. It is a stage of the compile pipeline
(:mod:`fxrt.pipeline`) that runs last among the graph rewrites, after the user's post pass, so
user passes see ATen ops and a user's override (:mod:`fxrt.ops.overrides`) wins; it is off with
``CompilerConfig(own_ops=False)`` (``FXRT_OWN_OPS=0``). Without the extension the ops do not
exist and graphs keep the ATen ops. ("Native" in fxrt means the compiled loop, which runs any
op without Python, ATen's and these alike.)
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Op, OpKind

# ATen op -> fxrt op, for nodes whose (first) result is a float32 CPU tensor (of any dtype for
# the ``_ANY_DTYPE`` ones). ``gelu`` has aten::gelu's schema; ``layer_norm`` takes
# native_layer_norm's arguments (``normalized_shape`` static) and returns only its first result.
OWN_OPS: dict[str, str] = {
    "aten::gelu": "gelu",
    "aten::native_layer_norm": "layer_norm",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::tanh": "tanh",
    "aten::embedding": "embedding",
}
# fxrt ops that take any dtype (they copy bytes), not only float32.
_ANY_DTYPE = frozenset({"aten::embedding"})
# fxrt ops with all the results of their ATen op.
_ALL_RESULTS = frozenset({"aten::_scaled_dot_product_flash_attention_for_cpu"})
# ATen op -> the fxrt op that returns only its first result, for nodes whose other results
# nothing reads (the arena can hold it through its out= overload).
_FIRST_RESULT: dict[str, str] = {"aten::_scaled_dot_product_flash_attention_for_cpu": "sdpa"}


def available() -> dict[str, torch._ops.OpOverload]:
    """The ATen op names that have an fxrt op in this process, with that op."""
    from ..exec.native import extension_status

    if not extension_status().usable:  # loading the extension registers the ops
        return {}
    ops = {}
    for aten_name, name in OWN_OPS.items():
        if torch._C._dispatch_has_kernel(f"fxrt::{name}"):
            ops[aten_name] = getattr(torch.ops.fxrt, name).default
    return ops


def _first_result(aten_name: str) -> torch._ops.OpOverload | None:
    name = _FIRST_RESULT.get(aten_name)
    if name is None or not torch._C._dispatch_has_kernel(f"fxrt::{name}"):
        return None
    return getattr(torch.ops.fxrt, name).default


def available_op(name: str) -> torch._ops.OpOverload | None:
    """fxrt's own op ``fxrt::<name>`` (its default overload) when the extension that registers
    it is loaded in this process, else None; the fused patterns' CPU targets
    (:mod:`fxrt.patterns`)."""
    from ..exec.native import extension_status

    if not extension_status().usable or not torch._C._dispatch_has_kernel(f"fxrt::{name}"):
        return None
    return getattr(torch.ops.fxrt, name).default


def use_own_ops(graph: Graph) -> Graph:
    """Rewrite the nodes of ``graph`` that have an fxrt op (in place); return the graph."""
    ops = available()
    if not ops:
        return graph
    used = set(graph.output_ids())
    for node in graph.nodes:
        used.update(node.input_ids())
    for node in graph.nodes:
        op = ops.get(node.op.name) if node.op.kind is OpKind.ATEN else None
        if op is None or not node.outputs:
            continue
        meta = graph.values[node.outputs[0]].meta
        if meta is None or meta.device != "cpu":
            continue
        if meta.dtype != torch.float32 and node.op.name not in _ANY_DTYPE:
            continue
        if node.op.name == "aten::native_layer_norm":
            shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
            static = isinstance(shape, (list, tuple)) and all(type(d) is int for d in shape)
            if not static or used.intersection(node.outputs[1:]) or len(node.args) != 5:
                continue
            node.outputs, node.multi = node.outputs[:1], False
        elif node.op.name in _FIRST_RESULT and not used.intersection(node.outputs[1:]):
            first = _first_result(node.op.name)
            if first is not None:
                op = first
                node.outputs, node.multi = node.outputs[:1], False
        elif len(node.outputs) != 1 and node.op.name not in _ALL_RESULTS:
            continue
        node.op = Op.of(op)
    return graph


__all__ = ["OWN_OPS", "available", "available_op", "use_own_ops"]
