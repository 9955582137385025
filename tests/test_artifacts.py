"""Hostile artifacts: no file can run code or crash the process, on either loop.

Every artifact below is either refused with a :class:`SerializationError` or, where a change
leaves it valid, loads and runs (raising at most an ordinary Python exception). The fuzz loop
runs in a child process, so that a crash would show as a failed test rather than end the suite.
"""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import EXECUTORS, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.artifact import unpack
from fxrt.ir.graph import Graph, Node, Op, OpKind, Ref, ValueKind
from fxrt.serialize import SerializationError

C = torch.tensor([1.0, -2.0, 3.0])


def eager(x: torch.Tensor) -> torch.Tensor:
    return ((x * C).relu().t() @ x).sum(0) + C.sum()


def sample(executor: str = "python") -> tuple[fxrt.CompiledGraph, torch.Tensor]:
    x = torch.randn(2, 3)
    cfg = fxrt.CompilerConfig(cache=False, pure_python=executor == "python")
    return fxrt.compile_graph(make_fx(eager)(x), [x], cfg), x


def repack(data: bytes, edit) -> bytes:
    """The artifact with its document edited, re-hashed so the edit reaches the validator."""
    doc, section = unpack(data)
    edit(doc)
    tensors = doc.pop("tensors")
    js = json.dumps({**doc, "tensors": tensors}).encode()
    body = len(js).to_bytes(8, "little") + js + bytes(section.data)
    import hashlib

    from fxrt.artifact import MAGIC

    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


@pytest.mark.parametrize("executor", EXECUTORS)
def test_round_trip_equals_eager(executor):
    skip_unless_executor(executor)
    cg, x = sample(executor)
    loaded = fxrt.CompiledGraph.load_artifacts(cg.dump_artifacts(), cg.config)
    assert loaded.executor == executor
    for args in (x, torch.randn(2, 3)):
        torch.testing.assert_close(loaded(args), eager(args))


def test_attrgetter_call_chain_is_never_written_or_read(tmp_path):
    """The chain that ran code: ``attrgetter('system')(os)`` then ``call(f, cmd)``."""
    g = Graph()
    mod = g.add_value("mod", ValueKind.OTHER)
    fn = g.add_value("fn", ValueKind.OTHER)
    out = g.add_value("out", ValueKind.OTHER)
    g.inputs = [mod]
    get = g.add_value("get", ValueKind.OTHER)
    g.nodes = [
        Node(
            "get",
            Op(OpKind.PYTHON, operator.attrgetter, "operator.attrgetter"),
            ("system",),
            {},
            [get],
        ),
        Node(
            "fn", Op(OpKind.PYTHON, operator.call, "operator.call"), (Ref(get), Ref(mod)), {}, [fn]
        ),
        Node(
            "run",
            Op(OpKind.PYTHON, operator.call, "operator.call"),
            (Ref(fn), f"touch {tmp_path}/pwned"),
            {},
            [out],
        ),
    ]
    g.output = Ref(out)
    from fxrt.serialize import dump_graph

    with pytest.raises(SerializationError, match="cannot serialize Python callable"):
        dump_graph(g)
    cg, _ = sample()

    def inject(doc):
        doc["nodes"][0]["op"] = {"python": "operator.attrgetter"}
        doc["nodes"][0]["args"] = {"tuple": ["system"]}

    with pytest.raises(SerializationError, match="not an allowed Python fallback"):
        fxrt.CompiledGraph.load_artifacts(repack(cg.dump_artifacts(), inject))

    def getitem_with_string(doc):
        doc["nodes"][0]["op"] = {"python": "operator.getitem"}

    with pytest.raises(SerializationError, match="not an allowed Python fallback"):
        fxrt.CompiledGraph.load_artifacts(repack(cg.dump_artifacts(), getitem_with_string))
    assert not (tmp_path / "pwned").exists()


def test_arithmetic_fallback_on_a_tensor_is_refused():
    cg, _ = sample()

    def on_tensor(doc):
        node = doc["nodes"][0]
        node["op"] = {"python": "operator.add"}
        node["kwargs"] = {"dict": {}}

    with pytest.raises(SerializationError, match="SymInts and numbers only"):
        fxrt.CompiledGraph.load_artifacts(repack(cg.dump_artifacts(), on_tensor))


@pytest.mark.parametrize(
    "where",
    ["input", "arg", "output", "node_output", "constant", "graph_output", "caller"],
)
def test_out_of_range_ids_are_refused(where):
    cg, _ = sample()

    def edit(doc):
        n = len(doc["values"])
        if where == "input":
            doc["inputs"] = [n + 5]
        elif where == "arg":
            doc["nodes"][0]["args"] = {"tuple": [{"ref": 10**9}, {"ref": 0}]}
        elif where == "output":
            doc["nodes"][-1]["outputs"] = [-1]
        elif where == "node_output":
            doc["nodes"][0]["outputs"] = [n]
        elif where == "constant":
            doc["constants"][0][0] = n + 1
        elif where == "graph_output":
            doc["output"] = {"ref": 2**40}
        else:
            doc["constants"][0][1] = {"caller": 0}

    with pytest.raises(SerializationError):
        fxrt.CompiledGraph.load_artifacts(repack(cg.dump_artifacts(), edit))


@pytest.mark.parametrize("edit", ["shape", "dtype", "nbytes", "sha", "offset", "stride"])
def test_constant_bytes_must_match_their_metadata(edit):
    cg, _ = sample()

    def change(doc):
        rec = next(iter(doc["tensors"].values()))
        if edit == "shape":
            rec["shape"] = [4]
            rec["stride"] = [1]
        elif edit == "dtype":
            rec["dtype"] = "torch.float64"
        elif edit == "nbytes":
            rec["nbytes"] = 10**12
        elif edit == "sha":
            rec["sha256"] = "f" * 64
        elif edit == "offset":
            rec["offset"] = 10**9
        else:
            rec["stride"] = [0]

    with pytest.raises(SerializationError):
        fxrt.CompiledGraph.load_artifacts(repack(cg.dump_artifacts(), change))


def test_symbolic_expressions_cannot_reach_eval():
    cg, _ = sample()

    def edit(doc):
        doc["values"][0][2]["nbytes"] = "__import__('os').system('true')"

    with pytest.raises(SerializationError, match="not a size expression"):
        fxrt.CompiledGraph.load_artifacts(repack(cg.dump_artifacts(), edit))


@pytest.mark.parametrize("damage", ["truncated", "bitflip", "unhashed_edit", "empty", "pickle"])
def test_damaged_bytes_are_refused(damage):
    cg, _ = sample()
    data = cg.dump_artifacts()
    if damage == "truncated":
        data = data[: len(data) - 7]
    elif damage == "bitflip":
        data = data[:150] + bytes([data[150] ^ 0x10]) + data[151:]
    elif damage == "unhashed_edit":
        data = data.replace(b"aten::relu", b"aten::tanh")
    elif damage == "empty":
        data = b""
    else:
        import pickle

        data = pickle.dumps({"json": "{}"})
    with pytest.raises(SerializationError):
        fxrt.CompiledGraph.load_artifacts(data)


FUZZ = """
import copy, json, random, sys, torch, fxrt
sys.path.insert(0, sys.argv[2])
from test_artifacts import repack, sample
from fxrt.serialize import SerializationError

WRONG = [None, True, -1, 0, 3, 2**63, 1.5, float("nan"), "x", "aten::add", [], [0], {}, {"ref": 0},
         {"tensor": "t0"}, {"caller": 0}, {"python": "operator.add"}, [[0, 1]], "s0*(2", "4*s0"]

def paths(x, prefix=()):
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from paths(v, prefix + (i,))

def setter(path, value):
    def edit(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = copy.deepcopy(value)
    return edit

cg, x = sample(sys.argv[1])
cfg = fxrt.CompilerConfig(pure_python=sys.argv[1] == "python", cache=False)
if sys.argv[4] == "precompiled":  # PyTorch's precompile: the artifact and the options it runs under
    import dataclasses
    from fxrt import precompile

    cg.config = dataclasses.replace(cg.config, arena_max_idle=1, check_inputs=False)
    data = precompile.serialize(cg)
    load = lambda b, _cfg: fxrt.CompiledGraph.deserialize_compile_artifacts(b)  # noqa: E731
else:
    data = cg.dump_artifacts()
    load = fxrt.CompiledGraph.load_artifacts
doc, _ = fxrt.artifact.unpack(data)
rng = random.Random(0)
all_paths = [p for p in paths(doc) if p and p[0] not in ("format", "versions")]
cases = [(p, v) for p in all_paths for v in WRONG]
rng.shuffle(cases)
counts = {"refused": 0, "ran": 0, "raised": 0}
for path, value in cases[: int(sys.argv[3])]:
    try:
        loaded = load(repack(data, setter(path, value)), cfg)
    except SerializationError:
        counts["refused"] += 1
        continue
    try:
        loaded(torch.randn(2, 3))
        counts["ran"] += 1
    except Exception:
        counts["raised"] += 1
raw = bytearray(data)
for _ in range(200):  # raw flips and cuts never get past the hash
    b = bytearray(raw)
    i = rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    for bad in (bytes(b), bytes(raw[: rng.randrange(len(raw))])):
        try:
            load(bad, cfg)
            raise SystemExit("a damaged artifact loaded")
        except SerializationError:
            counts["refused"] += 1
print(json.dumps(counts))
"""


@pytest.mark.parametrize("kind", ["artifact", "precompiled"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_fuzzed_artifacts_never_crash_or_run_code(executor, kind, tmp_path):
    skip_unless_executor(executor)
    script = tmp_path / "fuzz.py"
    script.write_text(textwrap.dedent(FUZZ))
    n = 3000 if os.environ.get("FXRT_FUZZ") == "full" else 600
    tests_dir = os.path.dirname(__file__)
    out = subprocess.run(
        [sys.executable, str(script), executor, tests_dir, str(n), kind],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-3000:]}"
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["refused"] > 400, counts
    assert not list(tmp_path.glob("pwned*"))


def test_caller_constants_are_only_for_cache_entries():
    """A self-contained artifact never refers to a caller's tensors."""
    cg, _ = sample()
    doc, _ = unpack(cg.dump_artifacts())
    assert "caller" not in json.dumps(doc["constants"])
    assert doc["tensors"], "the constant's bytes are inline"


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 4),
        lambda: torch.randn(2, 3, 4).permute(2, 0, 1),  # dense, not contiguous
        lambda: torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last),
        lambda: torch.randn(4, 1).expand(4, 1).t(),  # a size-1 dim with any stride
        lambda: torch.tensor(2.5),  # 0-d
        lambda: torch.arange(6, dtype=torch.int64).view(2, 3),
        lambda: torch.tensor([True, False, True]),
        lambda: torch.empty(0, 3),
        # Any strided tensor, not only dense ones: stride 0 (an expanded constant, as folding
        # ``quantile`` leaves one), gaps, an offset into a larger storage.
        lambda: torch.tensor(2.5).expand(1),
        lambda: torch.randn(3).expand(4, 3),
        lambda: torch.randn(4, 6)[:, ::2],
        lambda: torch.randn(10)[3:7],
        lambda: torch.randn(2, 3).t()[1:],
    ],
)
def test_tensor_records_round_trip_exactly(make):
    from fxrt.artifact import decode_tensor, encode_tensor

    t = make()
    r = encode_tensor(t)
    back = decode_tensor(r, r.payload)
    assert (back.shape, back.stride(), back.dtype) == (t.shape, t.stride(), t.dtype)
    torch.testing.assert_close(back, t, rtol=0, atol=0)
    original = t.clone()
    back.untyped_storage().fill_(0)  # its own, writable memory: the original is untouched
    torch.testing.assert_close(t, original, rtol=0, atol=0)
