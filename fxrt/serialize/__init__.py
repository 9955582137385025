"""Data-only serialization of compiled graphs (``dump_artifacts`` / ``load_artifacts``, pickle,
the on-disk cache).

An artifact is a closed format that loads without running code and without trusting the file:

* The container (:mod:`fxrt.artifact`) is a magic line, the SHA-256 of the rest, a JSON
  document and raw tensor bytes. No pickle, no ``torch.load``: a flipped bit is caught by the hash
  before anything is parsed.
* The document holds the IR (values, inputs, constants, nodes, output) and the pass records.
  Ops are stored by qualified name (``aten::add.Tensor``) and resolved through ``torch.ops`` only.
  Python fallbacks are limited to a fixed allow-list of pure arithmetic and comparison on SymInts
  and Python scalars (:data:`PYTHON_FALLBACKS`): no attribute access, no calls of values, no
  strings as callables, and their arguments must be scalar values or numbers.
* Every field is type-checked, every value id bounds-checked, symbolic size expressions must be
  arithmetic over size symbols (they are later read by sympy), constants must match their
  metadata, and the graph is verified. The lifetime plan, the arena and the program are never
  read from the file: they are recomputed from the graph.
* A constant is stored either as tensor bytes or, for the cache, as a reference to the caller's
  own constant (``{"caller": i}``): a model's parameters and buffers stay the live objects the
  caller holds, on a hit as on a miss.
"""

from __future__ import annotations

from .decode import decode_graph, load_graph, resolve_op
from .encode import dump_graph, encode_graph
from .format import FORMAT, PYTHON_FALLBACKS, SerializationError, versions

__all__ = [
    "FORMAT",
    "PYTHON_FALLBACKS",
    "SerializationError",
    "decode_graph",
    "dump_graph",
    "encode_graph",
    "load_graph",
    "resolve_op",
    "versions",
]
