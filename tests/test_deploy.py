"""``fxrt.export`` / ``fxrt.load``: packages against eager, on both loops.

Every model is exported once per session (module-scoped fixtures; an export takes seconds) and
each test loads the saved file. Covered: round trips of W1-W3 and a tiny GPT-2 (kwargs, a
``ModelOutput``, a dynamic sequence length, tied weights), kwargs and nested inputs/outputs,
buffer and input mutations, dynamic shapes and the errors for inputs outside them,
``update_weights`` (new answers, no recompile, errors naming the tensor, tied names, calls from
other threads never mixing two weight sets), hostile files (flipped bytes, truncations, bad
lengths and offsets, unknown ops, changed schemas, Python names and module imports smuggled into
the manifest, and a fuzz loop over re-hashed mutations: always a PackageError, never a crash or
code), ``python -m fxrt inspect``, loading in fresh processes (and what a load imports there),
``device=``, and the weights section read by the ``safetensors`` package.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import native_available, skip_unless_executor
from torch.export import Dim

import fxrt
from fxrt.deploy import package as pkgfmt
from fxrt.models import workloads

ROOT = Path(__file__).resolve().parents[1]
# torch.export deep-copies pytree leaf specs, which warns about LeafSpec's deprecation.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _opts(executor: str) -> dict[str, Any]:
    skip_unless_executor(executor)
    return {"pure_python": executor == "python"}


def _load(path: Path, executor: str, **kw: Any) -> Any:
    m = fxrt.load(path, options=_opts(executor), **kw)
    assert m.executor == executor
    return m


# ----------------------------------------------------------------------------------------------
# Exported once per session


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("packages")


@pytest.fixture(scope="module")
def w_packages(store: Path) -> dict[str, tuple[Any, tuple, Path]]:
    out = {}
    for name, (model, args) in workloads().items():
        path = store / f"{name.split()[0]}.fxrt"
        fxrt.export(model, args).save(path)
        out[name.split()[0]] = (model, args, path)
    return out


class Nested(torch.nn.Module):
    """Nested inputs, keyword arguments, a constant flag, and a dict of tuples back."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, pair, *, scale, extra=None, flag=True):
        a, b = pair
        h = self.lin(x) * scale["w"] + a
        if flag:
            h = h.relu()
        return {"h": h, "parts": (b.sum(-1), h.mean()), "extra": extra * 2}


def _nested_inputs(seed: int, n: int = 3) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    args = (r(n, 8), (r(n, 8), r(n, 5)))
    return args, {"scale": {"w": r(8)}, "extra": r(2), "flag": True}


@pytest.fixture(scope="module")
def nested_package(store: Path) -> tuple[Any, Path]:
    torch.manual_seed(0)
    model = Nested().eval()
    args, kwargs = _nested_inputs(0)
    path = store / "nested.fxrt"
    fxrt.export(model, args, kwargs).save(path)
    return model, path


@pytest.fixture(scope="module")
def gpt2(store: Path) -> tuple[Any, Path]:
    from clients_child import build

    model = build("gpt2")
    ids = _ids(2, 8)
    seq = Dim("seq", min=2, max=32)
    kwargs = {"attention_mask": torch.ones_like(ids), "use_cache": False}
    dyn = {"input_ids": {1: seq}, "attention_mask": {1: seq}, "use_cache": None}
    path = store / "gpt2.fxrt"
    fxrt.export(model, (ids,), kwargs, dynamic_shapes=dyn).save(path)
    return model, path


def _ids(batch: int, seq: int) -> torch.Tensor:
    from clients_child import input_ids

    return input_ids(batch, seq)


# ----------------------------------------------------------------------------------------------
# What the Python face alone shows (the deploy semantics every face shares are
# tests/test_deploy_faces.py's)


def test_gpt2_tied_weights_stored_once(gpt2) -> None:
    model, path = gpt2
    m = fxrt.load(path)
    sd = m.state_dict()
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    assert m.manifest["weights"]["lm_head.weight"]["entry"] == "transformer.wte.weight"
    section = _weights_section(path.read_bytes())
    st = json.loads(section[8 : 8 + int.from_bytes(section[:8], "little")])
    assert "lm_head.weight" not in st and "transformer.wte.weight" in st


# ----------------------------------------------------------------------------------------------
# Dynamic shapes and input errors


class _Shifted(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum() + y[1:].sum() * 2, y[1:] + x


def test_calls_with_int_inputs_and_derived_dims_never_run_sympy(
    executor: str, tmp_path: Path, monkeypatch
) -> None:
    """Derived sizes are evaluated by the runtime (csrc/src/size_expr.h): a call evaluates no sympy
    expression, and still names a broken relation."""
    import sympy

    n = Dim("n", min=2, max=64)
    pkg = fxrt.export(
        _Shifted(), (torch.randn(5, 3), torch.randn(6, 3)),
        dynamic_shapes={"x": {0: n}, "y": {0: n + 1}},
    )  # fmt: skip
    pkg.save(tmp_path / "shifted.fxrt")
    m = _load(tmp_path / "shifted.fxrt", executor)

    def refuse(*args, **kwargs):
        raise AssertionError("a call ran sympy")

    monkeypatch.setattr(sympy.Basic, "xreplace", refuse)
    monkeypatch.setattr(sympy.Basic, "subs", refuse)
    for k in (3, 7):
        x, y = torch.randn(k, 3), torch.randn(k + 1, 3)
        torch.testing.assert_close(m(x, y), _Shifted()(x, y))
    with pytest.raises(fxrt.InputError, match=r"input 'y' .*dim 0: size 3, expected s\d+ \+ 1 = 4"):
        m(torch.randn(3, 3), torch.randn(3, 3))


def test_static_input_errors_name_the_input(w_packages) -> None:
    _, _, path = w_packages["W2"]
    m = fxrt.load(path)
    with pytest.raises(fxrt.InputError, match=r"input 'x' \(args\[0\]\): dim 0: size 2, exported "
                       r"for 1 \(static\)"):  # fmt: skip
        m(torch.randn(2, 256))
    with pytest.raises(fxrt.InputError, match="exported structure"):
        m(torch.randn(1, 256), torch.randn(1, 256))


# ----------------------------------------------------------------------------------------------
# update_weights


def test_update_weights_tied(gpt2) -> None:
    model, path = gpt2
    m = fxrt.load(path)
    other = copy.deepcopy(model)
    # (a uniform shift of every weight leaves GPT-2 so ill-conditioned that eager's own
    # attention kernels disagree by 2e-4)
    g = torch.Generator().manual_seed(0)
    for p in other.parameters():
        p.data.add_(torch.randn(p.shape, generator=g) * 0.02)  # a fine-tuned checkpoint
    m.update_weights(other.state_dict())  # lm_head.weight and wte: one tensor, both names
    ids = _ids(2, 6)
    with torch.no_grad():
        want = other(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    torch.testing.assert_close(
        m(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits, want
    )
    sd = dict(other.state_dict())
    sd["lm_head.weight"] = sd["lm_head.weight"].clone()
    with pytest.raises(ValueError, match="tied in the package"):
        m.update_weights(sd)


def test_threads_and_atomic_weight_swap(w_packages) -> None:
    model, (x,), path = w_packages["W2"]
    m = fxrt.load(path)
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.data.normal_()
    sets = [model.state_dict(), other.state_dict()]
    xs = [torch.randn(1, 256, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    # What each weight set gives, single-threaded (checked against eager); in the threads every
    # result must be one of the two bit for bit, never a mix.
    want = []
    for k in (0, 1):
        m.update_weights(sets[k])
        want.append([m(xi) for xi in xs])
        with torch.no_grad():
            torch.testing.assert_close(want[k], [(model, other)[k](xi) for xi in xs])
    want = list(zip(*want))
    failures: list[BaseException] = []
    stop = threading.Event()

    def caller(i: int) -> None:
        try:
            for _ in range(60):
                got = m(xs[i])
                a, b = want[i]
                assert torch.equal(got, a) or torch.equal(got, b), "a mix of two weight sets"
        except BaseException as e:  # noqa: BLE001
            failures.append(e)

    def swapper() -> None:
        k = 0
        while not stop.is_set():
            m.update_weights(sets[k % 2])
            k += 1

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(xs))]
    sw = threading.Thread(target=swapper)
    sw.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sw.join()
    assert not failures, failures[0]


# ----------------------------------------------------------------------------------------------
# Hostile and damaged files


def _sections(data: bytes) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    _, _, _, m_off, m_len, w_off, _, _ = struct.unpack("<8sIIQQQQQ", data[:56])
    n = int.from_bytes(data[w_off : w_off + 8], "little")
    manifest = json.loads(data[m_off : m_off + m_len])
    header = json.loads(data[w_off + 8 : w_off + 8 + n])
    return manifest, header, data[w_off + 8 + n :]


def _weights_section(data: bytes) -> bytes:
    w_off = struct.unpack("<8sIIQQQQQ", data[:56])[5]
    return data[w_off:]


def _repack(
    data: bytes, manifest: Any = None, header: Any = None, raw_manifest: bytes | None = None
) -> bytes:
    """The package with its manifest and/or weights header replaced and every hash and offset
    made consistent again: what a deliberate forger writes."""
    m0, h0, body = _sections(data)
    man = (
        raw_manifest
        if raw_manifest is not None
        else json.dumps(m0 if manifest is None else manifest).encode()
    )
    head = json.dumps(h0 if header is None else header).encode()
    w_off = -(-(128 + len(man)) // 64) * 64
    head += b" " * (-(w_off + 8 + len(head)) % 64)
    st = len(head).to_bytes(8, "little") + head
    f_len = w_off + len(st) + len(body)
    fixed = struct.pack(
        "<8sIIQQQQQ", pkgfmt.MAGIC, 1, 0, 128, len(man), w_off, len(st) + len(body), f_len
    )
    out = fixed + hashlib.sha256(fixed + man + st).digest() + hashlib.sha256(body).digest()
    out += b"\0" * 8 + man + b"\0" * (w_off - 128 - len(man)) + st + body
    assert len(out) == f_len
    return out


def _refused(data: bytes, match: str | None = None) -> str:
    with pytest.raises(fxrt.PackageError, match=match) as e:
        fxrt.load(data)
    return str(e.value)


def test_repack_is_faithful(w_packages) -> None:
    model, (x,), path = w_packages["W3"]
    with torch.no_grad():
        torch.testing.assert_close(fxrt.load(_repack(path.read_bytes()))(x), model(x))


def test_damaged_files(w_packages, tmp_path: Path) -> None:
    data = w_packages["W3"][2].read_bytes()
    rng = random.Random(0)
    for pos in sorted(rng.sample(range(len(data)), 150)) + [0, 8, 12, 16, 56, 100, len(data) - 1]:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << rng.randrange(8)
        _refused(bytes(flipped))
    for cut in sorted(rng.sample(range(len(data)), 60)) + [0, 1, 56, 127, 128, len(data) - 1]:
        _refused(data[:cut])
    _refused(data + b"\0", "says")
    bad = bytearray(data)
    bad[8:12] = (2).to_bytes(4, "little")
    _refused(bytes(bad), "format version 2 is not supported")
    for field, value in ((24, 2**40), (24, 2**64 - 1), (40, 2**63), (32, 3)):  # lengths, offsets
        bad = bytearray(data)
        bad[field : field + 8] = value.to_bytes(8, "little")
        _refused(bytes(bad))
    empty = tmp_path / "empty.fxrt"
    empty.write_bytes(b"")
    with pytest.raises(fxrt.PackageError, match="empty"):
        fxrt.load(empty)
    (tmp_path / "text.fxrt").write_text("not a package at all " * 20)
    with pytest.raises(fxrt.PackageError, match="magic"):
        fxrt.load(tmp_path / "text.fxrt")


def test_forged_weights_header(w_packages) -> None:
    data = w_packages["W2"][2].read_bytes()
    _, header, _ = _sections(data)
    name = "layers.0.weight"
    for change, match in [
        (lambda h: h[name].update(data_offsets=[0, 10**12]), "out of range|bytes for"),
        (lambda h: h[name].update(data_offsets=[4, 262148]), "hole or an overlap|aligned"),
        (lambda h: h[name].update(data_offsets=[-8, 262136]), "out of range"),
        (lambda h: h[name].update(shape=[256, 255]), "bytes for"),
        (lambda h: h[name].update(dtype="F128"), "unknown dtype"),
        (lambda h: h[name].update(dtype="I32"), "dtype float32 but its entry is I32"),
        (
            lambda h: h.update(extra={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}),
            "used by nothing",
        ),
        (lambda h: h.pop(name), "hole|no weights entry"),
        (lambda h: h.update(__metadata__={"a": 1}), "__metadata__"),
    ]:
        h = copy.deepcopy(header)
        change(h)
        _refused(_repack(data, header=h), match)
    # a header length far past the section (rehashed)
    bad = bytearray(_repack(data))
    w_off = struct.unpack("<8sIIQQQQQ", bytes(bad[:56]))[5]
    bad[w_off : w_off + 8] = (2**62).to_bytes(8, "little")
    _refused(bytes(bad), "out of range")


def test_forged_manifest(w_packages, tmp_path: Path) -> None:
    data = w_packages["W2"][2].read_bytes()
    manifest, _, _ = _sections(data)
    canary = tmp_path / "fxrt_canary_module.py"
    canary.write_text("import os\nos.environ['FXRT_CANARY_IMPORTED'] = '1'\n")
    sys.path.insert(0, str(tmp_path))
    node = next(
        i for i, n in enumerate(manifest["graph"]["nodes"]) if n["op"] == {"aten": "aten::addmm"}
    )

    def weights_view(m: Any) -> None:
        m["weights"]["layers.0.bias"]["offset"] = 10

    def op(name: str) -> Any:
        def change(m: Any) -> None:
            m["graph"]["nodes"][node]["op"] = {"aten": name}
            m["ops"][name] = "x"

        return change

    enum_spec = json.dumps([1, {"type": "builtins.dict", "context": json.dumps(
        [{"__enum__": True, "fqn": "fxrt_canary_module:X", "name": "A"}]),
        "children_spec": [{"type": None, "context": None, "children_spec": []}]}])  # fmt: skip
    cases = [
        (op("aten::definitely_not_an_op"), "aten::definitely_not_an_op"),
        (op("os::system"), "os::system"),
        (op("aten::add.Tensor; import os"), "not an op name"),
        (
            lambda m: m["ops"].update(
                {"aten::addmm": m["ops"]["aten::addmm"].replace("beta", "b")}
            ),
            "aten::addmm changed its schema",
        ),
        (lambda m: m.update(format="fxrt-package/9"), "format"),
        (lambda m: m.update(device="cuda:banana"), "device"),
        (lambda m: m["signature"]["inputs"].pop(), "signature inputs"),
        (
            lambda m: m["signature"]["inputs"][-1].update(shape=[1, "__import__('os')"]),
            "size expression",
        ),
        (
            lambda m: m["signature"].update(
                out_spec=json.dumps(
                    [1, {"type": "os.system", "context": "null", "children_spec": []}]
                )
            ),
            "not registered",
        ),  # fmt: skip
        (lambda m: m["signature"].update(in_spec=enum_spec), "enum|do not match"),
        (lambda m: m["signature"]["ranges"].update(s0=[5, 1]), "empty"),
        (weights_view, "past its entry"),
        (lambda m: m["weights"]["layers.0.bias"].update(shape=[255]), "does not match"),
        (lambda m: m["runtime_options"].update(dump_dir="/tmp/x"), "runtime options"),
        (lambda m: m.update(extra=1), "manifest fields"),
        (lambda m: m.update(weights=[]), "must be an object"),
    ]
    # The graph section (the fxrt IR, for the Python loop and for inspection) is not what the
    # runtime runs: a forged one is refused where it is decoded, never run.
    graph_cases = [
        (lambda m: m["graph"]["nodes"][node].update(op={"python": "builtins.eval"}), "allowed"),
        (
            lambda m: m["graph"]["nodes"][node].update(op={"python": "operator.attrgetter"}),
            "allowed",
        ),
        (lambda m: m["graph"]["nodes"][node].update(outputs=[10**6]), "out of range"),
        (
            lambda m: m["graph"]["nodes"][node]["args"]["tuple"].__setitem__(0, {"ref": -1}),
            "out of range",
        ),
        (lambda m: m["graph"].update(format="fxrt-artifact/99"), "format"),
    ]
    model, (x,), _ = w_packages["W2"]
    try:
        for change, match in cases:
            m = copy.deepcopy(manifest)
            change(m)
            _refused(_repack(data, manifest=m), match)
        for change, match in graph_cases:
            m = copy.deepcopy(manifest)
            change(m)
            forged = _repack(data, manifest=m)
            with pytest.raises(fxrt.PackageError, match=match):
                fxrt.load(forged, options={"pure_python": True})
            if fxrt.runtime_info()["executor"] == "cpp":
                loaded = fxrt.load(forged)
                with torch.no_grad():
                    torch.testing.assert_close(loaded(x), model(x))
                with pytest.raises(fxrt.PackageError, match=match):
                    loaded.graph  # noqa: B018
        _refused(
            _repack(data, raw_manifest=b'{"format": "fxrt-package/1", "a": 1, "a": 2}'), "duplicate"
        )
        _refused(_repack(data, raw_manifest=b"[" * 100000), "JSON")
        _refused(_repack(data, raw_manifest=b'{"x": NaN}'), "NaN")
    finally:
        sys.path.remove(str(tmp_path))
    assert "FXRT_CANARY_IMPORTED" not in os.environ and "fxrt_canary_module" not in sys.modules


def test_package_from_another_torch_loads(w_packages) -> None:
    """Versions are recorded, not required: the op schemas decide (a changed one is refused in
    test_forged_manifest, naming the op)."""
    model, (x,), path = w_packages["W3"]
    data = path.read_bytes()
    manifest, _, _ = _sections(data)
    manifest["producer"].update(torch="2.12.0", fxrt="0.0.9", fxrt_source="0" * 64)
    with torch.no_grad():
        torch.testing.assert_close(fxrt.load(_repack(data, manifest=manifest))(x), model(x))


def test_fuzz_rehashed_mutations(w_packages) -> None:
    """Random mutations of the manifest and weights header, re-hashed so that validation, not
    the hash, must refuse them: a PackageError, or a model that loads (a harmless change) and
    whose call raises a Python exception at worst. Never a crash."""
    model, (x,), path = w_packages["W3"]
    data = path.read_bytes()
    manifest, header, _ = _sections(data)
    rng = random.Random(1)
    junk = [None, -1, 0, 2**70, 1.5, "", "x" * 5000, [], {}, [[[]]], {"ref": 3}, True, "aten::mm"]
    outcomes = {"refused": 0, "loaded": 0}
    for i in range(int(os.environ.get("FXRT_DEPLOY_FUZZ", "300"))):
        target = copy.deepcopy(manifest if i % 3 else header)
        _mutate(target, rng, junk)
        blob = _repack(data, manifest=target) if i % 3 else _repack(data, header=target)
        try:
            m = fxrt.load(blob)
        except fxrt.PackageError:
            outcomes["refused"] += 1
            continue
        outcomes["loaded"] += 1
        try:
            with torch.no_grad():
                m(x)
        except Exception:  # noqa: BLE001 - any Python exception is fine, a crash is not
            pass
    assert outcomes["refused"] > 0, outcomes


def _mutate(doc: Any, rng: random.Random, junk: list[Any]) -> None:
    """Replace one randomly chosen value deep in ``doc`` by junk, or a string by a variant."""
    parent, key = None, None
    node = doc
    for _ in range(rng.randrange(1, 12)):
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
        elif isinstance(node, list) and node:
            key = rng.randrange(len(node))
        else:
            break
        parent, node = node, node[key]
    if parent is None:
        return
    if isinstance(node, str) and rng.random() < 0.5:
        parent[key] = node[::-1] if rng.random() < 0.5 else node + "x"
    elif isinstance(node, int) and not isinstance(node, bool) and rng.random() < 0.5:
        parent[key] = node + rng.choice([-1, 1, 2**31])
    else:
        parent[key] = copy.deepcopy(rng.choice(junk))


# ----------------------------------------------------------------------------------------------
# The CLI, fresh processes, devices, the safetensors section


def test_inspect_cli(gpt2, w_packages) -> None:
    _, path = gpt2
    out = subprocess.run(
        [sys.executable, "-m", "fxrt", "inspect", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for want in (
        "fxrt package (fxrt-package/1)",
        "module:  GPT2LMHeadModel",
        f"torch {torch.__version__}",
        "args[0]",
        "kwargs['attention_mask']",
        "constant False",
        "int64[2, s",
        "seq (s",
        "in [2, 32]",
        "aten::addmm",
        "fallbacks:",
        "tied: transformer.wte.weight = lm_head.weight",
        "weights: 29 tensors",
    ):
        assert want in text, (want, text)
    from fxrt.__main__ import main

    assert main(["inspect", str(w_packages["W2"][2]), "--verify", "--load"]) == 0
    bad = path.with_suffix(".bad")
    bad.write_bytes(path.read_bytes()[:1000])
    assert main(["inspect", str(bad)]) == 1


CHILD = r"""
import json, sys, time, torch, fxrt
w3, w3_io, gpt2 = sys.argv[1:4]
x, want = torch.load(w3_io)
out = {}
for run in ("cold", "warm"):
    t0 = time.perf_counter()
    m = fxrt.load(w3)
    out[run + "_load_s"] = time.perf_counter() - t0
    torch.testing.assert_close(m(x), want)
out["compiled"] = fxrt.cache.stats["compiled"]
try:
    fxrt.load(gpt2)
    out["unregistered"] = "loaded"
except fxrt.PackageError as e:
    out["unregistered"] = str(e)
import transformers.modeling_outputs  # noqa: registers the output type with pytree
m = fxrt.load(gpt2)
ids = torch.randint(0, 128, (2, 7))
out["gpt2"] = type(m(ids, attention_mask=torch.ones_like(ids), use_cache=False)).__name__
print(json.dumps(out))
"""


def _child(code: str, args: list[Any], env: dict[str, str]) -> dict[str, Any]:
    """Run ``code`` in a fresh Python process; the JSON object its last line prints."""
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_load_in_fresh_process(w_packages, gpt2, tmp_path: Path) -> None:
    model, (x,), path = w_packages["W3"]
    with torch.no_grad():
        torch.save((x, model(x)), tmp_path / "io.pt")
    env = {**os.environ, "FXRT_CACHE_DIR": str(tmp_path / "cache")}
    got = _child(CHILD, [path, tmp_path / "io.pt", gpt2[1]], env)
    assert got["compiled"] == 0  # loading never compiles
    assert "CausalLMOutputWithCrossAttentions" in got["unregistered"]
    assert "not registered" in got["unregistered"]
    assert got["gpt2"] == "CausalLMOutputWithCrossAttentions"
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.fxrt"))


LEAN_CHILD = r"""
import json, sys, torch
package, io = sys.argv[1:3]
x, want = torch.load(io)
before = set(sys.modules)
import fxrt
m = fxrt.load(package)
got = m(x)
new = sorted(set(sys.modules) - before)  # before assert_close, which imports sympy itself
torch.testing.assert_close(got, want)
print(json.dumps({"executor": m.executor, "new": new}))
"""
# What a static package's load and first call must not import (where ``import torch`` has not
# already): sympy and torch's symbolic shapes, Dynamo, Inductor, export and decompositions, and
# fxrt's torch.compile backend, Inductor glue and export side.
HEAVY = (
    "sympy",
    "torch._dynamo",
    "torch._inductor",
    "torch.export",
    "torch._decomp",
    "torch.fx.experimental.symbolic_shapes",
    "fxrt.backend",
    "fxrt.inductor",
    "fxrt.deploy.build",
)


@pytest.mark.parametrize("executor", ["python", "cpp"])
def test_load_imports_only_the_runtime(w_packages, tmp_path: Path, executor: str) -> None:
    """``import fxrt; fxrt.load(p)(x)`` in a process that has only imported torch: eager's answer,
    and none of the modules above (sympy alone is ~30 MiB and 0.4 s)."""
    skip_unless_executor(executor)
    model, (x,), path = w_packages["W2"]
    with torch.no_grad():
        torch.save((x, model(x)), tmp_path / "io.pt")
    env = {k: v for k, v in os.environ.items() if k != "FXRT_PURE_PYTHON"}
    if executor == "python":
        env["FXRT_PURE_PYTHON"] = "1"
    got = _child(LEAN_CHILD, [path, tmp_path / "io.pt"], env)
    assert got["executor"] == executor
    imported = [h for h in HEAVY if any(m == h or m.startswith(f"{h}.") for m in got["new"])]
    assert not imported, f"loading and calling a static package imported {', '.join(imported)}"


def test_device_argument(w_packages) -> None:
    model, (x,), path = w_packages["W3"]
    m = fxrt.load(path, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(m(x), model(x))
    # Another device retargets the graph's devices and metadata (the meta device stands in for
    # an accelerator here; the arena does not apply to it).
    for executor in ("python", "cpp") if native_available() else ("python",):
        meta = fxrt.load(
            path, device="meta", options={"pure_python": executor == "python", "arena": False}
        )
        out = meta(torch.empty(x.shape, device="meta"))
        assert out.device.type == "meta" and out.shape == x.shape
        assert all(t.device.type == "meta" for t in meta.state_dict().values())
        with pytest.raises(fxrt.InputError, match=r"input 'x' .*device cpu, exported for meta"):
            meta(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device(w_packages) -> None:
    model, (x,), path = w_packages["W3"]
    m = fxrt.load(path, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(m(x.cuda()).cpu(), model(x), rtol=1e-4, atol=1e-4)


def test_weights_section_is_safetensors(gpt2) -> None:
    st = pytest.importorskip("safetensors.torch")
    model, path = gpt2
    tensors = st.load(_weights_section(path.read_bytes()))
    state = model.state_dict()
    # The graph's own constants (folded at compile time: the mask's fill values) are stored
    # beside the weights, under names no state dict has.
    weights = {k: t for k, t in tensors.items() if not k.startswith("graph/")}
    assert set(weights) == set(state) - {"lm_head.weight"}  # tied: stored once
    for name, t in weights.items():
        torch.testing.assert_close(t, state[name], rtol=0, atol=0)


def test_weights_are_mapped_not_copied(w_packages) -> None:
    _, _, path = w_packages["W2"]
    m = fxrt.load(path)
    data = path.read_bytes()
    t = m.state_dict()["layers.2.weight"]
    # the tensor's bytes are the file's, at an aligned offset of the mapping
    assert t.untyped_storage().nbytes() == t.numel() * 4 or t._base is not None
    assert bytes(t.contiguous().view(torch.uint8).numpy()) in data
    t_before = t.clone()
    t.add_(1)  # copy-on-write: the process's page changes, the file does not
    assert path.read_bytes() == data
    torch.testing.assert_close(fxrt.load(path).state_dict()["layers.2.weight"], t_before)


def test_load_keeps_what_the_model_needs(gpt2) -> None:
    """The memory a load leaves behind (benchmarks/deploy.py measures it): the manifest is kept
    as its text and parsed when asked for, repeated stack traces are one string, and fxrt's
    source hash (a cache's versions check, read from every fxrt file) is not computed."""
    from fxrt.fingerprint import source_hash

    _, path = gpt2
    data = path.read_bytes()
    source_hash.cache_clear()
    for m in (fxrt.load(path), fxrt.load(data)):
        assert source_hash.cache_info().currsize == 0
        assert m.manifest == _sections(data)[0]
        assert m.manifest is m.manifest
        assert repr(m).startswith(f"LoadedModel({m.manifest['module']}(input_ids, ")
        traces = [n.stack_trace for n in m.graph.nodes if n.stack_trace]
        assert len(traces) > len(set(traces))  # the layers share source lines...
        assert len({id(t) for t in traces}) == len(set(traces))  # ...and their strings


def test_strict_export(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    x = torch.randn(2, 8)
    fxrt.export(model, (x,), strict=True).save(tmp_path / "strict.fxrt")
    with torch.no_grad():
        torch.testing.assert_close(fxrt.load(tmp_path / "strict.fxrt")(x), model(x))


def test_options() -> None:
    model, (x,) = workloads()["W2 mlp"]
    with pytest.raises(ValueError, match="freeze is not supported"):
        fxrt.export(model, (x,), options={"freeze": True})
    with pytest.raises(ValueError, match="unknown option"):
        fxrt.export(model, (x,), options={"bogus": 1})
    with pytest.raises(ValueError, match="unknown option"):
        fxrt.load(b"", options={"opt_level": 1})
