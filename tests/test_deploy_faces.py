"""The deploy semantics, one suite through every face of the one loader.

Faces: ``load`` (``fxrt.load``: the C++ runtime behind a Python face), ``runner`` (the same
runtime through ``examples/cpp_runner``, no Python), and ``python`` (``fxrt.load`` with
``pure_python``: the runtime's loader and checks, the Python loop running the graph, the
reference). Each test runs one package through a
face and asserts what a user sees: eager's answers on two different inputs; inputs outside the
exported signature refused with the same words, naming the input; hostile packages refused with a
message, never a crash. Last, 240 hostile packages get one verdict from the runtime whichever
face asks (the runner's line equals ``fxrt.load``'s for every file).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import native_available
from test_deploy import _ids, _nested_inputs, _repack, _sections, nested_package
from test_deploy_cpp import (
    _check,
    _forge,
    _hostile,
    _Ones,
    _Scale,
    _TwoStreams,
    gpt2,
    int_packages,
    runner,
    store,
    w_packages,
)
from torch.export import Dim

import fxrt
from fxrt.deploy.tensorfile import load_tensors, save_tensors
from fxrt.models import DecoderBlock, KVCacheDecoder

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
__all__ = ["gpt2", "int_packages", "nested_package", "runner", "store", "w_packages"]  # fixtures

FACES = ["load", "runner", "python"]


class Face:
    """One way to run a package: ``call(path, inputs, kwargs, weights=None, strict=True)``
    returns the output leaves (after ``update_weights(weights, strict)``, when given) or raises
    fxrt.InputError / fxrt.PackageError / ValueError with the face's message."""

    def __init__(self, name: str, tmp: Path, runner: Any = None):
        self.name, self.tmp, self.runner = name, tmp, runner

    def call(
        self,
        path: Path,
        inputs: list[Any],
        kwargs: dict[str, Any] | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        strict: bool = True,
    ) -> list:
        if self.name != "runner":
            m = fxrt.load(path, options={"pure_python": self.name == "python"})
            assert m.executor == ("python" if self.name == "python" else "cpp")
            if weights is not None:
                m.update_weights(weights, strict=strict)
            with torch.inference_mode():
                out = m(*inputs, **(kwargs or {}))
            if hasattr(out, "logits"):
                return [out.logits]
            return pytree.tree_leaves(out)
        # The runner takes the exported call's leaves in order, constants left out.
        leaves = [
            x for x in pytree.tree_leaves((list(inputs), kwargs or {})) if not isinstance(x, bool)
        ]
        src, dst = self.tmp / "in.safetensors", self.tmp / "out.safetensors"
        as_tensors = [x if isinstance(x, torch.Tensor) else torch.tensor(x) for x in leaves]
        save_tensors(src, {str(i): t for i, t in enumerate(as_tensors)})
        extra = []
        if weights is not None:
            wfile = self.tmp / "w.safetensors"
            save_tensors(wfile, {k: v.contiguous() for k, v in weights.items()})
            extra = ["--weights", str(wfile), *([] if strict else ["--non-strict"])]
        proc = self.runner(str(path), "--inputs", str(src), "--output", str(dst), *extra)
        message = proc.stderr.strip().removeprefix("fxrt_runner: ")
        if proc.returncode == 3:
            raise fxrt.InputError(message)
        if proc.returncode == 2:
            raise fxrt.PackageError(message)
        if proc.returncode == 4:
            raise ValueError(message)
        assert proc.returncode == 0, proc.stderr
        out = load_tensors(dst)
        return [out[str(i)] for i in range(len(out))]


@pytest.fixture(params=FACES)
def face(request, tmp_path: Path) -> Face:
    if request.param == "runner":
        return Face("runner", tmp_path, request.getfixturevalue("runner"))
    if request.param == "load" and not native_available():
        pytest.skip("fxrt.load's runtime is the extension's")
    return Face(request.param, tmp_path)


# ----------------------------------------------------------------------------------------------
# Answers


@pytest.mark.parametrize("name", ["W1", "W2", "W3"])
def test_workloads_equal_eager(face: Face, name: str, w_packages) -> None:
    model, (x,), path = w_packages[name]
    for seed in (1, 2):  # two different inputs
        torch.manual_seed(seed)
        x = torch.randn_like(x)
        with torch.inference_mode():
            want = model(x)
        (got,) = face.call(path, [x])
        torch.testing.assert_close(got, want)
    if face.name != "runner":  # the IR a user inspects: the program both loops run
        m = fxrt.load(path, options={"pure_python": face.name == "python"})
        assert m.program is m.compiled.program and "CALL" in str(m.program)


def _python_faces_only(face: Face) -> None:
    if face.name == "runner":
        pytest.skip("the runner takes the call's leaves: no call structure, no Python values")


def test_the_call_structure(face: Face, gpt2) -> None:
    """What only the Python faces have, the call's structure: the model's output type back,
    keyword arguments in another order restored, a constant the export specialized on compared,
    another structure refused describing both."""
    _python_faces_only(face)
    model, path = gpt2
    m = fxrt.load(path, options={"pure_python": face.name == "python"})
    ids, mask = _ids(2, 8), torch.ones(2, 8, dtype=torch.long)
    with torch.inference_mode():
        want = model(ids, attention_mask=mask, use_cache=False)
        got = m(ids, attention_mask=mask, use_cache=False)
        assert type(got) is type(want)
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(m(ids, use_cache=False, attention_mask=mask).logits, want.logits)
    with pytest.raises(fxrt.InputError, match=r"'use_cache'.*constant False, got True"):
        m(ids, attention_mask=mask, use_cache=True)
    with pytest.raises(fxrt.InputError, match="exported structure"):
        m(ids)


def test_gpt2_kwargs_and_dynamic_sizes(face: Face, gpt2) -> None:
    model, path = gpt2
    for seq in (8, 5):
        ids = _ids(2, seq)
        mask = torch.ones_like(ids)
        mask[0, : seq // 3] = 0
        kwargs = {"attention_mask": mask, "use_cache": False}
        with torch.inference_mode():
            want = model(ids, **kwargs).logits
        (got,) = face.call(path, [ids], kwargs)
        torch.testing.assert_close(got, want)


class _Grid(torch.nn.Module):  # an int input with a range, and an int output
    def forward(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
        return x.new_zeros(n, 2) + x[:n].sum(), n + 1


def test_int_inputs(face: Face, int_packages, tmp_path: Path) -> None:
    """Ints exported as ``Dim.DYNAMIC`` (SymInt inputs of the graph): eager's answers; an int
    output (the runner writes it as a 0-dim int64 tensor)."""
    for name, size, n in [("scale", 3, 7), ("scale", 3, 1), ("ones", 4, 4), ("ones", 9, 9)]:
        x = torch.randn(size)
        model = {"scale": _Scale, "ones": _Ones}[name]()
        (got,) = face.call(int_packages[name][1], [x, n])
        torch.testing.assert_close(got, model(x, n))
    grid = tmp_path / "grid.fxrt"
    fxrt.export(
        _Grid(), (torch.randn(6), 3), dynamic_shapes=(None, Dim.DYNAMIC(min=1, max=6))
    ).save(grid)
    for n in (2, 6):
        x = torch.randn(6)
        want, want_n = _Grid()(x, n)
        got, got_n = face.call(grid, [x, n])
        torch.testing.assert_close(got, want)
        assert type(got_n) is int if face.name != "runner" else got_n.dim() == 0, got_n
        assert int(got_n) == want_n
    _refused_input(
        face, grid, [torch.randn(6), 7], r"input 'n' \(args\[1\]\): 7 is outside the range of "
        r"s\d+, \[\d, 6\]"
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Inputs outside the signature: one set of checks, one wording


def _refused_input(face: Face, path: Path, inputs: list[Any], match: str, **kw: Any) -> str:
    with pytest.raises(fxrt.InputError, match=match) as e:
        face.call(path, inputs, kw or None)
    return str(e.value)


def test_input_errors_name_the_input(face: Face, gpt2, w_packages) -> None:
    _, path = gpt2
    ids, mask = _ids(2, 8), torch.ones(2, 8, dtype=torch.long)
    kw = {"use_cache": False}
    _refused_input(
        face, path, [_ids(2, 40)], r"input 'input_ids' \(args\[0\]\): dim 1: size 40 is outside "
        r"the range of seq \(s\d+\), \[2, 32\] \(exported: int64\[2, s\d+\] with seq \(s\d+\) in "
        r"\[2, 32\]; got int64\[2, 40\]\)", attention_mask=torch.ones(2, 40, dtype=torch.long), **kw
    )  # fmt: skip
    _refused_input(
        face, path, [ids], r"input 'attention_mask' \(kwargs\['attention_mask'\]\): dim 1: size 9, "
        r"but seq \(s\d+\) = 8 from input 'input_ids' \(args\[0\]\) dim 1",
        attention_mask=torch.ones(2, 9, dtype=torch.long), **kw,
    )  # fmt: skip
    _refused_input(
        face, path, [ids.float()], r"input 'input_ids' \(args\[0\]\): dtype float32, exported for "
        r"int64 \(exported: int64\[2, s\d+\]", attention_mask=mask, **kw,
    )  # fmt: skip
    _, _, w2 = w_packages["W2"]
    _refused_input(
        face, w2, [torch.randn(3, 256)], r"input 'x' \(args\[0\]\): dim 0: size 3, exported for "
        r"\d+ \(static\) \(exported: float32\[\d+, 256\]; got float32\[3, 256\]\)",
    )  # fmt: skip
    _refused_input(
        face, path, [_ids(2, 1)], r"input 'input_ids' \(args\[0\]\): dim 1: size 1 is outside the "
        r"range of seq \(s\d+\), \[2, 32\]", attention_mask=torch.ones(2, 1, dtype=torch.long), **kw
    )  # fmt: skip
    _refused_input(face, w2, [torch.randn(4, 256, 1)], r"input 'x' .*3 dims, exported for 2")
    _refused_input(
        face, w2, [torch.randn(1, 128)], r"input 'x' .*dim 1: size 128, exported for 256"
    )
    if face.name != "runner":  # the runner reads tensors only
        _refused_input(face, w2, [[1.0] * 256], r"input 'x' .*expected a tensor, got a list")


def test_int_input_errors_name_the_input(face: Face, int_packages) -> None:
    n_in = r"input 'n' \(args\[1\]\): "
    for name, size, n, match in [
        ("scale", 3, 11, n_in + r"11 is outside the range of s\d+, \[1, 10\]$"),
        ("scale", 3, 0, n_in + r"0 is outside the range of s\d+, \[1, 10\]$"),
        ("ones", 4, 3, n_in + r"3, but s\d+ = 4 from input 'x' \(args\[0\]\) dim 0$"),
        ("scale", 3, 2.0, n_in + "expected an int, got a"),
    ]:
        _refused_input(face, int_packages[name][1], [torch.randn(size), n], match)


def test_derived_sizes_are_checked(face: Face, tmp_path: Path) -> None:
    class Shift(torch.nn.Module):
        def forward(self, x, y):
            return x + y[1:]

    n = Dim("n", min=2, max=20)
    path = tmp_path / "shift.fxrt"
    fxrt.export(
        Shift(), (torch.randn(5, 4), torch.randn(6, 4)), dynamic_shapes=({0: n}, {0: n + 1})
    ).save(path)
    x, y = torch.randn(7, 4), torch.randn(8, 4)
    (got,) = face.call(path, [x, y])
    torch.testing.assert_close(got, Shift()(x, y))
    _refused_input(
        face, path, [x, torch.randn(9, 4)], r"input 'y' \(args\[1\]\): dim 0: size 9, expected "
        r"s\d+ \+ 1 = 8",
    )  # fmt: skip
    _refused_input(face, path, [x, torch.randn(8, 4, 1)], r"input 'y' .*3 dims, exported for 2")


def test_nested_inputs_and_outputs(face: Face, nested_package) -> None:
    """Nested inputs, keyword arguments and a constant flag (the runner takes the leaves, the
    constant left out), a dict of tuples back (the runner gives its leaves); an input named by its
    path in the call."""
    model, path = nested_package
    for seed in (1, 2):
        args, kwargs = _nested_inputs(seed)
        with torch.no_grad():
            want = pytree.tree_leaves(model(*args, **kwargs))
        torch.testing.assert_close(face.call(path, list(args), kwargs), want)
    args, kwargs = _nested_inputs(3)
    bad = [args[0], (args[1][0], args[1][1].double())]
    with pytest.raises(fxrt.InputError, match=r"args\[1\]\[1\]\): dtype float64, exported for"):
        face.call(path, bad, kwargs)
    if face.name != "runner":  # a constant the export specialized on: the Python faces'
        kwargs["flag"] = False
        with pytest.raises(fxrt.InputError, match=r"input 'flag' \(kwargs\['flag'\]\)"):
            face.call(path, list(args), kwargs)


def test_update_weights(face: Face, w_packages) -> None:
    """update_weights (the runner's --weights): new weights give the model's answers with them,
    a partial update without strict changes one tensor, and a weight of another shape or a
    missing one is refused with the same words."""
    model, (x,), path = w_packages["W2"]
    torch.manual_seed(5)
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.data.normal_()
    weights = {k: v.detach() for k, v in other.state_dict().items()}
    (got,) = face.call(path, [x], weights=weights)
    with torch.inference_mode():
        torch.testing.assert_close(got, other(x))
    mixed = copy.deepcopy(model)
    mixed.layers[0].bias.data.copy_(other.layers[0].bias)
    (got,) = face.call(path, [x], weights={"layers.0.bias": weights["layers.0.bias"]}, strict=False)
    with torch.inference_mode():
        torch.testing.assert_close(got, mixed(x))
    bad = {k: v.detach() for k, v in model.state_dict().items()}
    bad["layers.1.weight"] = torch.randn(128, 256)
    with pytest.raises(ValueError, match=r"weight 'layers.1.weight': the package has "
                       r"float32\[256, 256\], got float32\[128, 256\]"):  # fmt: skip
        face.call(path, [x], weights=bad)
    bad["layers.1.weight"] = model.layers[1].weight.detach().double()
    with pytest.raises(ValueError, match=r"'layers.1.weight'.*float64\[256, 256\]"):
        face.call(path, [x], weights=bad)
    del bad["layers.1.weight"]
    with pytest.raises(ValueError, match=r"missing weights \['layers.1.weight'\]"):
        face.call(path, [x], weights=bad)
    with pytest.raises(ValueError, match=r"unknown weights \['nope'\]"):
        face.call(path, [x], weights={**weights, "nope": torch.zeros(1)})
    if face.name == "runner":
        return
    # On one model: no recompile, the same program; a failed update changes nothing; a transposed
    # tensor is copied to the package's strides.
    m = fxrt.load(path, options={"pure_python": face.name == "python"})
    compiled, program = fxrt.cache.stats["compiled"], m.program
    m.update_weights(weights)
    with pytest.raises(ValueError):
        m.update_weights({**weights, "nope": torch.zeros(1)})
    with torch.inference_mode():
        torch.testing.assert_close(m(x), other(x))
    assert fxrt.cache.stats["compiled"] == compiled and m.program is program
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    sd["layers.0.weight"] = sd["layers.0.weight"].t().contiguous().t()
    m.update_weights(sd)
    with torch.inference_mode():
        torch.testing.assert_close(m(x), model(x))


def test_buffer_mutations(face: Face, tmp_path: Path) -> None:
    """A block that writes its KV cache (buffers, index_copy_) before attending: the call's
    answer is eager's; on fxrt.load the cache is copied back, so a second call sees it."""
    torch.manual_seed(0)
    block = DecoderBlock(128, 4, cache_len=8).eval()
    path = tmp_path / "kv_block.fxrt"
    fxrt.export(block, (torch.randn(1, 2, 128), torch.tensor([0, 1]))).save(path)
    eager = copy.deepcopy(block)
    steps = [(torch.randn(1, 2, 128), torch.tensor([2 * k, 2 * k + 1])) for k in range(2)]
    with torch.no_grad():
        (got,) = face.call(path, list(steps[0]))
        torch.testing.assert_close(got, eager(*steps[0]))
        if face.name == "runner":
            return  # one call per process: what it copied back is gone with it
        m = fxrt.load(path, options={"pure_python": face.name == "python"})
        eager = copy.deepcopy(block)
        for x, pos in steps:
            torch.testing.assert_close(m(x, pos), eager(x, pos))
            torch.testing.assert_close(m.state_dict()["k_cache"], eager.k_cache)


def test_input_mutations(face: Face, tmp_path: Path) -> None:
    """A decoder whose KV caches are inputs written in place: eager's answer; on fxrt.load the
    caller's cache tensors hold what eager's hold after the call."""
    dec = KVCacheDecoder().eval()
    kc, vc = dec.empty_cache(1, 8)
    ids = torch.randn(1, 3, 32)
    path = tmp_path / "kv_decoder.fxrt"
    fxrt.export(dec, (ids, kc, vc, torch.arange(3))).save(path)
    k1, v1 = dec.empty_cache(1, 8)
    k2, v2 = dec.empty_cache(1, 8)
    with torch.no_grad():
        want = dec(ids, k2, v2, torch.arange(3))
        (got,) = face.call(path, [ids, k1, v1, torch.arange(3)])
    torch.testing.assert_close(got, want)
    if face.name != "runner":  # the runner's inputs are its file's, gone with its process
        torch.testing.assert_close((k1, v1), (k2, v2))
        assert k1.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# Hostile packages


def test_forged_packages_are_refused_naming_what(face: Face, w_packages, tmp_path: Path) -> None:
    model, (x,), path = w_packages["W2"]
    data = path.read_bytes()
    _, header, _ = _sections(data)
    name = "layers.0.weight"

    def header_change(change: Any) -> bytes:
        h = copy.deepcopy(header)
        change(h)
        return _repack(data, header=h)

    cases = [
        (_forge(data, lambda m: m["ops"].update({"aten::addmm": "x"})), "changed its schema"),
        (_forge(data, lambda m: m["ops"].update({"os::system": "x"})), "os::system"),
        (_forge(data, lambda m: m["ops"].update({"aten::add; import os": "x"})), "not an op name"),
        (_forge(data, lambda m: m.update(device="cuda:banana")), "device"),
        (_forge(data, lambda m: m.update(extra=1)), "manifest fields"),
        (_forge(data, lambda m: m.update(format="fxrt-package/9")), "format"),
        (_forge(data, lambda m: m["signature"]["inputs"].pop()), "signature inputs"),
        (_forge(data, lambda m: m["signature"]["ranges"].update(s0=[5, 1])), "empty|range"),
        (_forge(data, lambda m: m["weights"][name].update(offset=10**6)), "past its entry"),
        (
            _forge(data, lambda m: m["weights"]["layers.0.bias"].update(shape=[255])),
            "does not match",
        ),
        (
            _forge(data, lambda m: m["runtime_options"].update(dump_dir="/tmp/x")),
            "runtime options",
        ),
        (header_change(lambda h: h[name].update(dtype="I32")), "float32 but its entry is I32"),
        (header_change(lambda h: h[name].update(dtype="F128")), "unknown dtype"),
        (
            header_change(
                lambda h: h.update(extra={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]})
            ),
            "used by nothing",
        ),
        (_repack(data, raw_manifest=b'{"x": NaN}'), "NaN"),
        (data[:1000], "truncated|shorter|says"),
        (b"not a package at all " * 20, "magic"),
    ]
    for i, (blob, match) in enumerate(cases):
        forged = tmp_path / f"forged-{i}.fxrt"
        forged.write_bytes(blob)
        with pytest.raises(fxrt.PackageError, match=match):
            face.call(forged, [x])


@pytest.mark.skipif(not native_available(), reason="fxrt.load's runtime is the extension's")
def test_hostile_packages_get_one_verdict(runner: Any, w_packages, tmp_path: Path) -> None:
    """240 hostile packages: ``fxrt.load`` refuses exactly the ones the C++ runner refuses, with
    its message; those it loads it runs as the runner does. Two exceptions: what the runner cannot
    run though it is valid (no stored program, a node that runs Python) fxrt.load's runtime loads
    all the same and runs on the package's graph, which decides (the host's loop); and the tree
    specs of the call's structure (pytree's node types), which only the Python face reads, it
    alone refuses."""
    _, (x,), path = w_packages["W3"]
    blobs = _hostile(path.read_bytes(), 2, 240)
    cpp = _check(runner, blobs, tmp_path)
    tally = {"same": 0, "host loop": 0, "tree specs": 0}
    unsupported = "no program|runs Python|streams"
    for blob, (verdict, message) in zip(blobs, cpp):
        try:
            m = fxrt.load(blob)
        except fxrt.PackageError as e:
            if verdict != "refused" and re.search("(input|output) spec|tree specs", str(e)):
                tally["tree specs"] += 1  # the call's structure: only the Python face reads it
                continue
            if verdict == "refused" and re.search(unsupported, message):
                tally["host loop"] += 1  # the graph refused
                continue
            assert verdict == "refused" and message == str(e), (verdict, message, str(e))
            tally["same"] += 1
            continue
        if m.unsupported:
            assert verdict == "refused" and m.unsupported == message, (verdict, message)
            tally["host loop"] += 1
            continue
        assert verdict in ("loaded", "failed"), (verdict, message)
        tally["same"] += 1
    assert tally["same"] >= 200, tally
    refused = sum(v == "refused" for v, _ in cpp)
    print(f"240 hostile packages: the runtime refuses {refused}; fxrt.load agrees on {tally}")


def test_a_manifest_with_escaped_keys_loads(face: Face, w_packages, tmp_path: Path) -> None:
    """JSON may write a key with escapes ("sign\\u0061ture"): the runtime reads it as the key it
    is, and the face, which reads a few fields by their text, parses the whole manifest."""
    model, (x,), path = w_packages["W2"]
    data = path.read_bytes()
    raw = json.dumps(_sections(data)[0]).encode()
    for key in (b"signature", b"runtime_options"):
        assert raw.count(b'"%s":' % key) == 1
        escape = b"\\u%04x" % key[4]  # the fifth letter as a JSON escape
        raw = raw.replace(b'"%s":' % key, b'"%s%s%s":' % (key[:4], escape, key[5:]), 1)
    escaped = tmp_path / "escaped.fxrt"
    escaped.write_bytes(_repack(data, raw_manifest=raw))
    (got,) = face.call(escaped, [x])
    with torch.inference_mode():
        torch.testing.assert_close(got, model(x))


@pytest.mark.skipif(not native_available(), reason="fxrt.load's runtime is the extension's")
def test_arena_options_run_on_the_runtime(w_packages, monkeypatch) -> None:
    """``arena=False``, ``arena_max_idle`` and ``check_inputs`` (options, or FXRT_ARENA /
    FXRT_ARENA_MAX_IDLE / FXRT_CHECK_INPUTS) the runtime honours itself; with ``pure_python``
    every call runs on the Python loop, the runtime checking its inputs."""
    model, (x,), path = w_packages["W2"]
    with torch.inference_mode():
        want = model(x)
    for options, env, idle in [
        ({}, {}, 1),
        ({"arena": False}, {}, 0),
        ({"arena_max_idle": 0}, {}, 0),
        ({}, {"FXRT_ARENA": "0"}, 0),
        ({}, {"FXRT_ARENA_MAX_IDLE": "0"}, 0),
        ({"check_inputs": False}, {}, 1),
        ({}, {"FXRT_CHECK_INPUTS": "0"}, 1),
    ]:
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            m = fxrt.load(path, options=options)
        assert m.executor == "cpp", (options, env)
        with torch.inference_mode():
            torch.testing.assert_close(m(x), want)
            y = torch.randn_like(x)  # a second call, another input
            torch.testing.assert_close(m(y), model(y))
        assert m.idle_arenas == idle, (options, env, m.idle_arenas)
        checked = options.get("check_inputs", True) and not env
        bad = torch.randn(x.shape[0], x.shape[1] + 1)
        if checked:
            with pytest.raises(fxrt.InputError, match="exported"):
                m(bad)
    m = fxrt.load(path, options={"pure_python": True})
    assert m.executor == "python"
    with torch.inference_mode():
        torch.testing.assert_close(m(x), want)
        with pytest.raises(fxrt.InputError, match="exported"):
            m(torch.randn(x.shape[0], x.shape[1] + 1))


class _Thirds(torch.nn.Module):  # truediv of a SymInt: a node that runs Python (PYCALL)
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (x.shape[0] / 3) + self.w


@pytest.mark.skipif(not native_available(), reason="fxrt.load's runtime is the extension's")
@pytest.mark.parametrize("kind", ["python node", "two streams", "no stored program"])
def test_what_the_runtimes_loop_cannot_run_runs_on_the_host_loop(kind: str, tmp_path) -> None:
    """A valid package the runtime's loop cannot run (a node that runs Python, several streams,
    no stored program): the runner refuses it naming why; fxrt.load's runtime loads it all the
    same (``unsupported`` says why) and runs the package's graph on fxrt's loops in place of its
    own, with its own input checks (the binder's words), weights (update_weights) and answers
    equal to eager on two inputs, on both loops."""
    torch.manual_seed(0)
    if kind == "python node":
        model, x = _Thirds().eval(), torch.randn(6, 3)
        pkg = fxrt.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
        why, other = "node truediv runs Python (operator.truediv)", torch.randn(9, 3)
    else:
        model, x = _TwoStreams().eval(), torch.randn(2, 16)
        pkg = fxrt.export(model, (x,))
        why, other = "switches streams", torch.randn(2, 16)
    path = tmp_path / "host.fxrt"
    pkg.save(path)
    if kind == "no stored program":
        path.write_bytes(_forge(path.read_bytes(), lambda m: m.pop("program")))
        why = "stores no program"
    for pure in (False, True):
        m = fxrt.load(path, options={"pure_python": pure})
        assert why in m.unsupported, m.unsupported
        assert m.executor == ("python" if pure else "cpp"), m.executor
        with torch.inference_mode():
            for inp in (x, other):
                torch.testing.assert_close(m(inp), model(inp))
            with pytest.raises(fxrt.InputError, match=r"input 'x' \(args\[0\]\): dtype float64"):
                m(x.double())
            state = {k: v + 1 for k, v in m.state_dict().items()}
            m.update_weights(state)
            changed = copy.deepcopy(model)
            changed.load_state_dict(state)
            torch.testing.assert_close(m(other), changed(other))


@pytest.mark.skipif(not native_available(), reason="fxrt.load's runtime is the extension's")
def test_load_without_the_extension_says_how_to_build_it(w_packages, monkeypatch) -> None:
    from fxrt.deploy import runtime_model

    monkeypatch.setattr(runtime_model, "_runtime", None)
    with pytest.raises(runtime_model.RuntimeNotBuilt, match="C\\+\\+ runtime, which is not built"):
        fxrt.load(w_packages["W2"][2])
    # The suite's hook: installed so on purpose (FXRT_BUILD_EXT=0), such a test skips instead.
    import conftest

    for on_purpose in ("1", "0"):
        monkeypatch.setenv("FXRT_BUILD_EXT", on_purpose)
        hook = conftest.pytest_pyfunc_call(None)
        next(hook)
        expected = pytest.skip.Exception if on_purpose == "0" else runtime_model.RuntimeNotBuilt
        with pytest.raises(expected):
            hook.throw(runtime_model.RuntimeNotBuilt("not built"))


class _Lookup(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) * 2


@pytest.mark.parametrize("face_name", ["load", "python"])
def test_a_failing_op_raises_eagers_exception_naming_the_node(face_name: str, tmp_path) -> None:
    """An op that fails at run time (an index out of range) raises what eager raises (an
    IndexError, and fxrt.ExecutionError), naming the node; the model still works afterwards."""
    if face_name == "load" and not native_available():
        pytest.skip("fxrt.load's runtime is the extension's")
    model = _Lookup().eval()
    path = tmp_path / "lookup.fxrt"
    fxrt.export(model, (torch.tensor([[1, 2]]),)).save(path)
    m = fxrt.load(path, options={"pure_python": face_name == "python"})
    with pytest.raises(IndexError, match="index out of range") as e, torch.inference_mode():
        m(torch.tensor([[1, 12]]))
    assert isinstance(e.value, fxrt.ExecutionError) and "embedding" in str(e.value)
    ids = torch.tensor([[3, 4]])
    with torch.inference_mode():
        torch.testing.assert_close(m(ids), model(ids))


@pytest.mark.parametrize("face_name", ["load", "python"])
def test_update_weights_names_an_unknown_name_whatever_its_value(
    face_name: str, w_packages
) -> None:
    """Under ``strict`` an unknown name is refused even when its value is not a tensor, the same
    on both loaders (nn.Module.load_state_dict refuses it too)."""
    if face_name == "load" and not native_available():
        pytest.skip("fxrt.load's runtime is the extension's")
    model, _, path = w_packages["W2"]
    m = fxrt.load(path, options={"pure_python": face_name == "python"})
    with pytest.raises(ValueError, match=r"unknown weights \['nope'\]"):
        m.update_weights({**model.state_dict(), "nope": 3})
    m.update_weights({**model.state_dict(), "nope": 3}, strict=False)  # ignored, as unknown
