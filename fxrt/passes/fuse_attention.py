"""Attention fusion: attention written out by hand becomes the op ``scaled_dot_product_attention``
runs on the CPU.

A model that computes ``softmax(q @ k.transpose(-2, -1) / c [masked]) @ v`` itself (fxrt's W3,
nanoGPT-style blocks, "eager" attention of older model code) traces to two ``bmm`` with the
``view``s around them, a scale, a mask, and ``_softmax``: five kernel calls and three
intermediates per attention. When the pieces are exactly that, this pass replaces them with one
``aten::_scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=1/c)``, as Inductor's
``fuse_attention`` does; fxrt's own ``fxrt::attention`` then runs it for small problems. The
compile pipeline runs this pass only where that op exists and own ops are on: ATen's flash kernel
alone costs more than the unfused ops at those sizes (W3: 300 against 275 µs a call, and 248
with ``fxrt::attention``).

Matched, on static float32 CPU tensors ``q [B, H, L, D]``, ``k [B, H, S, D]``, ``v [B, H, S, D]``:

* scores ``bmm(view(q), view(transpose(k, -2, -1)))`` viewed back to ``[B, H, L, S]``;
* an optional scale: ``div`` or ``mul`` by a number;
* an optional soft cap after it, ``mul(tanh(div(scores, c)), c)`` (Gemma-2's; ``mul`` by ``1 /
  c`` for the ``div`` when that is exact): the fused op is then ``fxrt::softcap_sdpa``, fxrt's
  own (ATen has none), given by the caller; without it soft-capped attention keeps its ops;
* an optional mask: ``masked_fill(scores, m, -inf)`` with ``m`` a constant boolean tensor (after
  constant folding, a mask made in ``forward`` is one), or a constant float32 bias added
  (``scores + m``, Meta's Llama: zeros and -inf) or subtracted (``scores - m``, ALiBi's
  distances). A lower-triangular keep-mask (zeros below the diagonal, -inf above) is
  ``is_causal``; any other becomes an additive float mask. A row every key of which is masked
  (eager's softmax gives NaN there, the flash kernel zeros), or a bias holding NaN or +inf, stops
  the match;
* ``_softmax(-1)`` (then the copy eval-mode dropout makes, if any), then ``bmm(view(probs),
  view(v))`` viewed back to ``[B, H, L, D]``; q, k
  and v may be read through the contiguous copy matmul's decomposition makes of a strided
  operand (the copy goes with the rest: the pass removes what the fused op left unread);
* every intermediate read only by the next step (a model that also returns its attention weights
  keeps its ops), and nothing written in place between the first read and the last.

Values differ from eager's in the last bits (the order of the additions, the exponential's
approximation), as between eager's own attention backends. The result's layout is eager's: the
fused op lays its output out ``[B, L, H, D]``; when the graph reads it through
``transpose(1, 2)`` into a contiguous copy (the usual merge of the heads), the transpose reads the
fused output directly and the copy becomes a no-op, else one contiguous copy restores the layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..analysis.values import alias_roots, replace_uses, unique_name, written_values
from ..ir.from_fx import tensor_meta
from ..ir.graph import Graph, Node, Op, Ref, TensorMeta, ValueKind
from .eliminate_dead_code import eliminate_dead_code

aten = torch.ops.aten
_RESHAPES = frozenset({"aten::view", "aten::_unsafe_view", "aten::reshape"})
_FUSED = aten._scaled_dot_product_flash_attention_for_cpu.default
FUSED_ATTENTION = Op.of(_FUSED).name


@dataclass
class _Match:
    q: int
    k: int
    v: int
    scale: float
    causal: bool
    mask: torch.Tensor | None
    nodes: list[Node]  # scores bmm ... output view, in graph order
    out: int  # the [B, H, L, D] value the fused op replaces
    dropped: int | None  # the constant boolean mask the masked_fill read
    softcap: float | None = None  # scores soft-capped: softcap * tanh(scores / softcap)


class _Matcher:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.producer: dict[int, Node] = {}
        self.readers: dict[int, list[Node]] = {}
        self.uses = Counter(graph.output_ids())  # reads, a node's repeated reads counted
        for n in graph.nodes:
            for v in n.outputs:
                self.producer[v] = n
            ins = n.input_ids()
            self.uses.update(ins)
            for v in set(ins):
                self.readers.setdefault(v, []).append(n)

    def meta(self, vid: int) -> TensorMeta | None:
        return self.graph.values[vid].meta

    def node(self, vid: Any, *names: str) -> Node | None:
        """The node that makes ``vid`` when it is one of ``names`` and nothing else reads it."""
        if not isinstance(vid, Ref) or self.uses[vid.id] != 1:
            return None
        n = self.producer.get(vid.id)
        return n if n is not None and n.op.name in names and not n.multi else None

    def through_expand(self, ref: Any, chain: list[Node] | None = None) -> Any:
        """What ``ref`` reads when it is an ``expand`` to its own shape (a no-op that matmul's
        decomposition leaves), else ``ref``; with ``chain``, only a sole reader's, recorded."""
        n = self.producer.get(ref.id) if isinstance(ref, Ref) else None
        if n is None or n.op.name != "aten::expand" or not isinstance(n.args[0], Ref):
            return ref
        src, dst = self.meta(n.args[0].id), self.meta(ref.id)
        if src is None or dst is None or src.shape != dst.shape:
            return ref
        if chain is not None:
            if self.uses[ref.id] != 1:
                return ref
            chain.append(n)
        return n.args[0]

    def unview(self, ref: Any, shape: tuple[int, ...]) -> int | None:
        """``ref`` is a reshape of a 4-D value of ``shape`` (which other nodes may read too), or
        of a contiguous copy of it (matmul's decomposition copies a strided operand)."""
        if not isinstance(ref, Ref):
            return None
        n = self.producer.get(ref.id)
        if n is None or n.op.name not in _RESHAPES or not isinstance(n.args[0], Ref):
            return None
        copy = self.producer.get(n.args[0].id)
        arg = n.args[0]
        if copy is not None and copy.op.name == "aten::clone" and isinstance(copy.args[0], Ref):
            arg = copy.args[0]
        src = self.through_expand(arg).id
        meta = self.meta(src)
        return src if meta is not None and tuple(meta.shape) == shape else None

    def match(self, bmm2: Node) -> _Match | None:
        # out = view(bmm(view(softmax(masked(scaled(view(bmm(q', k'^T')))))), view(v)))
        out_view = self._sole_reader(bmm2.outputs[0], _RESHAPES)
        probs3 = self.node(bmm2.args[0], *_RESHAPES)
        if out_view is None or probs3 is None:
            return None
        out = out_view.outputs[0]
        meta = self.meta(out)
        if not _usable(meta) or len(meta.shape) != 4:
            return None
        B, H, L, D = meta.shape
        expands: list[Node] = []
        probs = self.through_expand(probs3.args[0], expands)
        dropout = self.node(probs, "aten::clone")  # eval-mode dropout's copy (eager attention)
        if dropout is not None and not dropout.kwargs:
            expands.append(dropout)
            probs = dropout.args[0]
        softmax = self.node(probs, "aten::_softmax")
        if softmax is None or softmax.args[1] not in (-1, 3) or softmax.args[2]:
            return None
        S = self.meta(softmax.outputs[0]).shape[-1]
        if tuple(self.meta(softmax.outputs[0]).shape) != (B, H, L, S):
            return None
        x, causal, mask, dropped = softmax.args[0], False, None, None
        tril = torch.ones(L, S, dtype=torch.bool).tril().expand(B, H, L, S)
        masked = self.node(x, "aten::masked_fill.Scalar")
        added = self.node(x, "aten::add.Tensor", "aten::sub.Tensor") if masked is None else None
        if masked is not None:
            keep = self._keep_mask(masked, (B, H, L, S))
            if keep is None:
                return None
            causal = bool(torch.equal(keep.expand(B, H, L, S), tril))
            if not causal:
                mask = torch.zeros(keep.shape).masked_fill_(~keep, -math.inf)
            x, dropped = masked.args[0], masked.args[1].id
        elif added is not None:
            found = self._added_mask(added, (B, H, L, S))
            if found is None:
                return None
            x, bias, dropped = found
            zeros = bool((bias.expand(B, H, L, S)[tril] == 0).all())
            causal = zeros and bool((bias.expand(B, H, L, S)[~tril] == -math.inf).all())
            mask = None if causal or bool((bias == 0).all()) else bias
        softcap, capped = self._softcap(x)
        if capped:
            x = capped[0].args[0]
        scale, scaled = 1.0, self.node(x, "aten::div.Tensor", "aten::mul.Tensor")
        if scaled is not None:
            c = scaled.args[1]
            if type(c) not in (int, float) or not math.isfinite(c) or c == 0:
                return None
            scale = 1.0 / c if scaled.op.name == "aten::div.Tensor" else float(c)
            x = scaled.args[0]
        scores4 = self.node(x, *_RESHAPES)
        bmm1 = scores4 and self.node(scores4.args[0], "aten::bmm")
        if not bmm1:
            return None
        q = self.unview(bmm1.args[0], (B, H, L, D))
        kt = self.unview(bmm1.args[1], (B, H, D, S))
        v = self.unview(bmm2.args[1], (B, H, S, D))
        k_node = kt is not None and self.producer.get(kt)
        if q is None or v is None or not k_node or k_node.op.name != "aten::transpose.int":
            return None
        if sorted(d % 4 for d in k_node.args[1:3]) != [2, 3]:
            return None
        k = k_node.args[0].id
        if not all(_usable(self.meta(t)) for t in (q, k, v)):
            return None
        chain = (bmm1, scores4, scaled, *capped, masked, added, softmax, *expands, probs3, bmm2,
                 out_view)  # fmt: skip
        nodes = [n for n in self.graph.nodes if any(n is c for c in chain)]
        return _Match(q, k, v, scale, causal, mask, nodes, out, dropped, softcap)

    def _softcap(self, x: Any) -> tuple[float | None, list[Node]]:
        """``x = mul(tanh(div(y, c)), c)`` (Gemma-2's soft cap; ``mul`` by ``1 / c`` for the
        ``div``): ``(c, [div, tanh, mul])``; ``(None, [])`` otherwise."""
        mul = self.node(x, "aten::mul.Tensor")
        tanh = mul and self.node(mul.args[0], "aten::tanh")
        inner = tanh and self.node(tanh.args[0], "aten::div.Tensor", "aten::mul.Tensor")
        if not inner or mul.kwargs or inner.kwargs:
            return None, []
        c, d = mul.args[1], inner.args[1]
        if type(c) not in (int, float) or type(d) not in (int, float):
            return None, []
        if not math.isfinite(c) or c == 0 or not math.isfinite(d) or d == 0:
            return None, []
        if (d if inner.op.name == "aten::div.Tensor" else 1.0 / d) != c:
            return None, []
        return float(c), [inner, tanh, mul]

    def _sole_reader(self, vid: int, names: frozenset[str]) -> Node | None:
        if self.uses[vid] != 1:
            return None
        reader = self.readers[vid][0]
        return reader if reader.op.name in names else None

    def _keep_mask(self, masked: Node, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Where ``masked_fill(scores, m, -inf)`` keeps scores (a constant, every row keeping
        one), broadcast to 4-D; None otherwise."""
        m, fill = masked.args[1], masked.args[2]
        if not isinstance(m, Ref) or fill != -math.inf or m.id not in self.graph.constants:
            return None
        drop = self.graph.constants[m.id]
        if not isinstance(drop, torch.Tensor) or drop.dtype != torch.bool or drop.dim() > 4:
            return None
        try:
            keep = (~drop).reshape((1,) * (4 - drop.dim()) + tuple(drop.shape))
            torch.broadcast_shapes(keep.shape, shape)
        except RuntimeError:
            return None
        if not bool(keep.any(-1).all()):
            return None
        return keep

    def _added_mask(
        self, added: Node, shape: tuple[int, ...]
    ) -> tuple[Any, torch.Tensor, int] | None:
        """``scores + m`` (either order) or ``scores - m`` with ``m`` a constant float32 tensor
        broadcast to 4-D, every row keeping a finite score, no NaN or +inf: (scores, the bias
        as 4-D, ``m``'s id)."""
        if added.kwargs or len(added.args) != 2:
            return None
        sub = added.op.name == "aten::sub.Tensor"
        for x, m in (added.args,) if sub else (added.args, added.args[::-1]):
            if not isinstance(m, Ref) or m.id not in self.graph.constants:
                continue
            bias = self.graph.constants[m.id]
            if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32 or bias.dim() > 4:
                return None
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
            bias = -bias if sub else bias  # exact: scores - m is scores + (-m)
            try:
                torch.broadcast_shapes(bias.shape, shape)
            except RuntimeError:
                return None
            if bias.isnan().any() or (bias == math.inf).any() or not bias.isfinite().any(-1).all():
                return None  # eager's softmax gives NaN where the flash kernel does not
            return x, bias, m.id
        return None


def _usable(meta: TensorMeta | None) -> bool:
    return (
        meta is not None and meta.is_static and meta.dtype == torch.float32 and meta.device == "cpu"
    )


def _fake(meta: TensorMeta) -> torch.Tensor:
    """A meta-device tensor of ``meta``'s geometry (static), for shape functions and layouts."""
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")


def _cpu_meta(fake: torch.Tensor) -> TensorMeta:
    """The meta of the CPU tensor that ``fake`` (on the meta device) stands for."""
    return dataclasses.replace(tensor_meta(fake), device="cpu")


def fuse_attention(graph: Graph, softcap_op: torch._ops.OpOverload | None = None) -> Graph:
    """Fuse the graph's written-out attentions (in place); return the graph. Soft-capped ones
    become ``softcap_op`` (``fxrt::softcap_sdpa``; ATen has no such op), and stay as they are
    without it."""
    if not any(n.op.name == "aten::_softmax" for n in graph.nodes):
        return graph  # most graphs: nothing to look at
    fused = False
    while (match := _find(graph, softcap_op is not None)) is not None:
        _rewrite(graph, match, softcap_op)
        fused = True
    # the reshapes and copies that fed the bmms go now, so that the fused patterns see the
    # attention's q, k and v read by it alone (grouped-query K/V heads, then, read un-repeated)
    return eliminate_dead_code(graph) if fused else graph


def _find(graph: Graph, softcap: bool) -> _Match | None:
    matcher = _Matcher(graph)
    root = None
    for node in graph.nodes:
        if node.op.name != "aten::bmm" or (m := matcher.match(node)) is None:
            continue
        if m.softcap is not None and not softcap:
            continue
        root = root or alias_roots(graph)
        if not _written_between(graph, m, root):
            return m
    return None


def _written_between(graph: Graph, m: _Match, root: tuple[int, ...]) -> bool:
    # The fused op reads q, k and v where the second bmm was; nothing may write them before that.
    first, last = graph.nodes.index(m.nodes[0]), graph.nodes.index(m.nodes[-1])
    read = {root[m.q], root[m.k], root[m.v]}
    return any(root[w] in read for n in graph.nodes[first:last] for w in written_values(n))


def _rewrite(graph: Graph, m: _Match, softcap_op: torch._ops.OpOverload | None) -> None:
    taken = {n.name for n in graph.nodes} | {v.name for v in graph.values}
    base = unique_name(taken, "attention")
    kwargs: dict[str, Any] = {"attn_mask": None, "scale": m.scale}
    if m.mask is not None:
        mask = graph.add_value(f"{base}_mask", ValueKind.TENSOR, tensor_meta(m.mask))
        graph.constants[mask] = m.mask
        kwargs["attn_mask"] = Ref(mask)
    fake = [_fake(graph.values[v].meta) for v in (m.q, m.k, m.v)]
    mask_fake = None if m.mask is None else m.mask.to("meta")
    qkv = (Ref(m.q), Ref(m.k), Ref(m.v))
    if m.softcap is not None:
        out_fake = softcap_op(*fake, m.softcap, m.causal, attn_mask=mask_fake, scale=m.scale)
        out = graph.add_value(base, ValueKind.TENSOR, _cpu_meta(out_fake))
        op, args, outputs = softcap_op, (*qkv, m.softcap, m.causal), [out]
    else:
        out_fake, lse_fake = _FUSED(*fake, 0.0, m.causal, attn_mask=mask_fake, scale=m.scale)
        out = graph.add_value(base, ValueKind.TENSOR, _cpu_meta(out_fake))
        lse = graph.add_value(f"{base}_logsumexp", ValueKind.TENSOR, _cpu_meta(lse_fake))
        op, args, outputs = _FUSED, (*qkv, 0.0, m.causal), [out, lse]
    node = Node(
        base,
        Op.of(op),
        args,
        kwargs,
        outputs,
        multi=len(outputs) > 1,
        stack_trace=m.nodes[-1].stack_trace,
    )
    at = graph.nodes.index(m.nodes[-1])
    new = [node]
    replacement = out
    if tuple(out_fake.stride()) != tuple(graph.values[m.out].meta.stride):
        replacement = _relayout(graph, m.out, out, base, new)
    for n in m.nodes:
        graph.nodes.remove(n)
    graph.nodes[at - len(m.nodes) + 1 : at - len(m.nodes) + 1] = new
    replace_uses(graph, {m.out: replacement})
    if m.dropped is not None and not any(m.dropped in n.input_ids() for n in graph.nodes):
        del graph.constants[m.dropped]  # the boolean mask, now read by nothing


def _relayout(graph: Graph, old: int, out: int, base: str, new: list[Node]) -> int:
    """The value that stands for ``old`` (contiguous) when the fused output ``out`` is laid out
    otherwise: ``out`` itself when the caller never receives ``old`` and every reader is
    ``transpose(1, 2)`` whose readers copy it to a contiguous tensor (their results are the same
    either way; the transposes' layouts are updated, and the copies become no-ops), else a
    contiguous copy of ``out``."""
    readers = [n for n in graph.nodes if old in n.input_ids()]
    returned = set(graph.output_ids())

    def merges_heads(n: Node) -> bool:
        if n.op.name != "aten::transpose.int" or sorted(d % 4 for d in n.args[1:3]) != [1, 2]:
            return False
        t = n.outputs[0]
        copies = [r for r in graph.nodes if t in r.input_ids()]
        return (
            t not in returned
            and bool(copies)
            and all(
                r.op.name == "aten::clone"
                and r.kwargs.get("memory_format") == torch.contiguous_format
                for r in copies
            )
        )

    if (
        readers
        and old not in returned
        and _fake(graph.values[old].meta).is_contiguous()
        and all(map(merges_heads, readers))
    ):
        fake = _fake(graph.values[out].meta)
        for n in readers:
            t = graph.values[n.outputs[0]]
            meta = _cpu_meta(fake.transpose(*n.args[1:3]))
            graph.values[t.id] = dataclasses.replace(t, meta=meta)
        return out
    copy = graph.add_value(f"{base}_contiguous", ValueKind.TENSOR, graph.values[old].meta)
    new.append(
        Node(
            f"{base}_contiguous",
            Op.of(aten.clone.default),
            (Ref(out),),
            {"memory_format": torch.contiguous_format},
            [copy],
        )
    )
    return copy
