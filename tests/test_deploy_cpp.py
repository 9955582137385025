"""The C++ runtime (``csrc/``) through ``examples/cpp_runner``: packages against ``fxrt.load``
and eager, and hostile files.

The runner is built once per source tree and torch (:mod:`cpp_runner`; the tests skip only when
there is no CMake or C++ compiler). Covered: W1-W3 and a tiny random-weight GPT-2 (kwargs, a
dynamic sequence length, a constant input) give eager's answers and exactly ``fxrt.load``'s
(both loops); int inputs (SymInts of the graph; an int output) likewise; threads share one
model; ``LoadOptions::device`` (the CPU keeps the weights mapped; the meta device
stands in for another device type; one that is not there is named); ``update_weights`` (new
answers, Python's errors word for word, tied names, and threads that never see a mix of two
weight sets while another swaps them); the installed package (``cmake --install``, then
``find_package(fxrt)`` in another project); the DispatchStub probe; damaged, truncated and
forged files (manifest and program changes re-hashed so that validation, not the hash, must
refuse them, and a fuzz loop) are refused with a message and a non-zero exit, never a crash;
packages with Python fallbacks are refused naming the node; ``fxrt.load`` refuses a package whose
stored program differs from its graph. The semantics every face shares (answers, input errors
word for word, forged packages, one verdict on hostile files) are tests/test_deploy_faces.py.
"""

from __future__ import annotations

import copy
import platform
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import native_available
from test_deploy import _ids, _mutate, _repack, _sections
from torch.export import Dim

import fxrt
from fxrt.deploy.program_data import cpp_runnable
from fxrt.deploy.tensorfile import load_tensors, save_tensors
from fxrt.models import workloads

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def runner() -> Any:
    import cpp_runner

    try:
        cpp_runner.build()
    except cpp_runner.Unavailable as e:
        pytest.skip(str(e))
    return cpp_runner.run


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cpp")


@pytest.fixture(scope="module")
def w_packages(store: Path) -> dict[str, tuple[Any, tuple, Path]]:
    out = {}
    for name, (model, args) in workloads().items():
        path = store / f"{name.split()[0]}.fxrt"
        fxrt.export(model, args).save(path)
        out[name.split()[0]] = (model, args, path)
    return out


def _run_cpp(
    runner: Any, path: Path, inputs: list[torch.Tensor], tmp: Path, *extra: str
) -> list[torch.Tensor]:
    src, dst = tmp / f"{path.stem}-in.safetensors", tmp / f"{path.stem}-out.safetensors"
    save_tensors(src, {str(i): t for i, t in enumerate(inputs)})
    proc = runner(str(path), "--inputs", str(src), "--output", str(dst), *extra)
    assert proc.returncode == 0, proc.stderr
    out = load_tensors(dst)
    return [out[str(i)] for i in range(len(out))]


def _loaded(path: Path, pure_python: bool) -> Any:
    return fxrt.load(path, options={"pure_python": pure_python or not native_available()})


@pytest.mark.parametrize("name", ["W1", "W2", "W3"])
def test_workloads_cpp_equals_load_equals_eager(
    name: str, runner: Any, w_packages, tmp_path: Path
) -> None:
    model, (x,), path = w_packages[name]
    assert cpp_runnable(fxrt.load(path).manifest["program"]) is None
    x = torch.randn_like(x)
    with torch.inference_mode():
        eager = model(x)
        loads = [_loaded(path, p)(x) for p in (False, True)]
    (cpp,) = _run_cpp(runner, path, [x], tmp_path)
    torch.testing.assert_close(cpp, eager)
    for out in loads:
        # The same loop and kernels, in another process (a GEMM may split its work otherwise there:
        # bit equality is not promised across processes).
        torch.testing.assert_close(cpp, out)


@pytest.fixture(scope="module")
def gpt2(store: Path) -> tuple[Any, Path]:

    return _export_client("gpt2", store)


def _export_client(name: str, store: Path) -> tuple[Any, Path]:
    """A client-tier model exported with its mask and a dynamic sequence length (2 to 32)."""
    from clients_child import build

    model = build(name)
    ids = _ids(2, 8)
    seq = Dim("seq", min=2, max=32)
    kwargs = {"attention_mask": torch.ones_like(ids), "use_cache": False}
    dyn = {"input_ids": {1: seq}, "attention_mask": {1: seq}, "use_cache": None}
    path = store / f"{name}.fxrt"
    fxrt.export(model, (ids,), kwargs, dynamic_shapes=dyn).save(path)
    return model, path


def test_gpt2_cpp_dynamic(runner: Any, gpt2, tmp_path: Path) -> None:
    model, path = gpt2
    for seq in (8, 5, 17):
        ids = _ids(2, seq)
        mask = torch.ones_like(ids)
        mask[0, : seq // 3] = 0
        with torch.inference_mode():
            eager = model(ids, attention_mask=mask, use_cache=False).logits
            loaded = _loaded(path, False)(ids, attention_mask=mask, use_cache=False).logits
        (cpp,) = _run_cpp(runner, path, [ids, mask], tmp_path)
        torch.testing.assert_close(cpp, eager)
        torch.testing.assert_close(cpp, loaded)


def test_threads_share_a_model(runner: Any, w_packages) -> None:
    proc = runner(str(w_packages["W3"][2]), "--random", "--parallel", "4")
    assert proc.returncode == 0, proc.stderr
    assert "4 threads x 50 calls, 0 mismatches" in proc.stdout


def test_random_inputs_and_bench(runner: Any, w_packages) -> None:
    proc = runner(str(w_packages["W2"][2]), "--random", "--bench", "20", "--clock", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "output 0: Float[1, 256]" in proc.stdout
    assert '"median_us"' in proc.stdout


# ----------------------------------------------------------------------------------------------
# Hostile files: always a message and a clean exit


def _check(runner: Any, blobs: list[bytes], tmp: Path) -> list[tuple[str, str]]:
    """Run ``--check`` on the files; (outcome, message) per file, in order."""
    paths = []
    for i, b in enumerate(blobs):
        p = tmp / f"hostile-{i}.fxrt"
        p.write_bytes(b)
        paths.append(str(p))
    proc = runner("--check", *paths, timeout=900)
    assert proc.returncode == 0, f"the runner crashed ({proc.returncode}): {proc.stderr[-2000:]}"
    lines = proc.stdout.splitlines()
    assert len(lines) == len(blobs), proc.stdout[-2000:]
    out = []
    for path, line in zip(paths, lines):
        fields = line.split("\t")
        assert fields[0] == path
        out.append((fields[1], fields[2] if len(fields) > 2 else ""))
    return out


def test_damaged_and_truncated(runner: Any, w_packages, tmp_path: Path) -> None:
    data = w_packages["W3"][2].read_bytes()
    rng = random.Random(0)
    blobs = []
    for pos in sorted(rng.sample(range(len(data)), 40)) + [0, 8, 12, 16, 56, 100]:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << rng.randrange(8)
        blobs.append(bytes(flipped))
    blobs += [data[:cut] for cut in (1, 56, 127, 128, 4096, len(data) - 1)]
    blobs += [data + b"\0", b"not a package at all " * 20]
    results = _check(runner, blobs, tmp_path)
    assert all(r == "refused" for r, _ in results), results
    msgs = [m for _, m in results]
    assert any("truncated" in m for m in msgs) and any("SHA-256" in m for m in msgs)
    assert "bad magic" in msgs[-1]
    proc = runner(str(tmp_path / "hostile-0.fxrt"))
    assert proc.returncode == 2 and "fxrt_runner:" in proc.stderr


def _forge(data: bytes, change: Any) -> bytes:
    m, _, _ = _sections(data)
    m = copy.deepcopy(m)
    change(m)
    return _repack(data, manifest=m)


def _instr(kind: str) -> Any:
    def find(m: Any) -> dict[str, Any]:
        return next(i for i in m["program"]["code"] if i["kind"] == kind)

    return find


def test_forged_programs(runner: Any, w_packages, tmp_path: Path) -> None:
    data = w_packages["W2"][2].read_bytes()
    call = _instr("CALL")
    n_regs = _sections(data)[0]["program"]["n_regs"]

    def set_(getter: Any, key: str, value: Any) -> Any:
        return lambda m: getter(m).__setitem__(key, value)

    def first_ref(m: Any) -> dict[str, Any]:
        return next(a for a in call(m)["args"]["tuple"] if isinstance(a, dict) and "ref" in a)

    cases = [
        (set_(call, "op", "aten::no_such_op"), "not in the package's op table"),
        (
            lambda m: m["ops"].update({"aten::no_such_op": "aten::no_such_op() -> ()"}),
            "not registered",
        ),
        (
            lambda m: m["ops"].update({k: v + " " for k, v in m["ops"].items()}),
            "changed its schema",
        ),
        (lambda m: first_ref(m).update(ref=n_regs + 5), "register"),
        (lambda m: first_ref(m).update(ref=-1), "register"),
        (lambda m: first_ref(m).update(ref=m["program"]["n_regs"] - 1), "before it is written"),
        (set_(call, "kind", "PYCALL"), "runs Python"),
        (set_(call, "kind", "JUMP"), "unknown instruction kind"),
        (set_(call, "outputs", []), "no outputs"),
        (set_(call, "args", {"tuple": []}), "no value for argument"),
        (set_(call, "kwargs", {"dict": {"bogus": 1}}), "keyword argument"),
        (set_(call, "node", 10**6), "node"),
        (lambda m: m["program"].update(n_regs=2**40), "n_regs"),
        (lambda m: m["program"].update(output={"ref": 10**9}), "register"),
        (lambda m: m["program"]["guards"]["inputs"][0].__setitem__(0, 99), "input spec"),
        (lambda m: m["program"]["guards"]["inputs"][0].__setitem__(1, "torch.float128"), "dtype"),
        (lambda m: m["program"].pop("code"), "code"),
        (lambda m: m.update(program=None), "stores no program"),
        (lambda m: m.pop("program"), "stores no program"),
        (lambda m: m["weights"]["layers.0.bias"].update(offset=10**6), "reaches past"),
        (lambda m: m["signature"]["inputs"].pop(), "signature"),
        (lambda m: m["program"]["code"].insert(0, {"kind": "FREE", "regs": [0]}), "before it is"),
    ]
    blobs = [_forge(data, change) for change, _ in cases]
    results = _check(runner, blobs, tmp_path)
    for (outcome, msg), (_, match) in zip(results, cases):
        assert outcome == "refused" and match in msg, (match, outcome, msg)
    # fxrt.load refuses a program that differs from the graph's too (it never runs the stored
    # one, but a package must mean one thing).
    for blob in blobs[3:8]:
        with pytest.raises(fxrt.PackageError):
            fxrt.load(blob)


def test_forged_elementwise_forms(runner: Any, w_packages, tmp_path: Path) -> None:
    """W1's package stores inline elementwise forms; one that names no form, or another op's,
    is refused by the C++ runtime (it would compute the wrong op) and by fxrt.load."""
    data = w_packages["W1"][2].read_bytes()
    forms = [i for i in _sections(data)[0]["program"]["code"] if i.get("elementwise")]
    assert {i["elementwise"] for i in forms} == {"add", "mul", "clamp_min"}, forms[:3]

    def on(op: str, form: str) -> Any:
        def change(m: Any) -> None:
            ins = next(i for i in m["program"]["code"] if i.get("out_op") == op)
            ins["elementwise"] = form

        return change

    cases = [
        (on("aten::add.out", "div"), "no elementwise form div"),
        (on("aten::add.out", "mul"), "the elementwise form mul of another op"),
        (on("aten::sin.out", "add"), "the elementwise form add of another op"),
    ]
    blobs = [_forge(data, change) for change, _ in cases]
    for (outcome, msg), (_, match) in zip(_check(runner, blobs, tmp_path), cases):
        assert outcome == "refused" and match in msg, (match, outcome, msg)
    for blob in blobs:
        with pytest.raises(fxrt.PackageError):
            fxrt.load(blob)


def _hostile(data: bytes, seed: int, n: int) -> list[bytes]:
    """``n`` rehashed mutations of the package: the manifest, its program, the weights header."""
    manifest, header, _ = _sections(data)
    rng = random.Random(seed)
    junk = [None, -1, 0, 2**62, 1.5, "", "x" * 5000, [], {}, [[[]]], {"ref": 3}, True, "aten::mm"]
    blobs = []
    for i in range(n):
        if i % 4:
            target = copy.deepcopy(manifest)
            _mutate(target["program"] if i % 2 else target, rng, junk)
            blobs.append(_repack(data, manifest=target))
        else:
            target = copy.deepcopy(header)
            _mutate(target, rng, junk)
            blobs.append(_repack(data, header=target))
    return blobs


def test_fuzz_rehashed_mutations(runner: Any, w_packages, tmp_path: Path) -> None:
    """Random mutations of the manifest (program included) and weights header, re-hashed: the
    C++ runtime refuses them or runs them to a clean error, never crashes."""
    blobs = _hostile(w_packages["W3"][2].read_bytes(), 2, 120)
    results = _check(runner, blobs, tmp_path)
    assert sum(r == "refused" for r, _ in results) > 30, results


def test_packages_without_a_program(w_packages, tmp_path: Path) -> None:
    """Packages of fxrt versions before the stored program still load in Python (and inspect
    says the C++ runtime cannot run them); a load with other runtime options than the export's
    checks the stored program against the export's lowering, not its own."""
    model, (x,), path = w_packages["W3"]
    old = tmp_path / "old.fxrt"
    old.write_bytes(_forge(path.read_bytes(), lambda m: m.pop("program")))
    with torch.inference_mode():
        torch.testing.assert_close(fxrt.load(old)(x), model(x))
        for options in ({"arena": False}, {"check_inputs": False}, {"pure_python": True}):
            torch.testing.assert_close(fxrt.load(path, options=options)(x), model(x))
    from fxrt.deploy.inspect import describe

    assert "C++ runtime: no (the package stores no program" in describe(str(old))


def test_sym_steps_run_and_python_fallbacks_are_refused(runner: Any, tmp_path: Path) -> None:
    class Halves(torch.nn.Module):  # sym_size, floordiv (a SYM step), a view of SymInts
        def forward(self, x):
            return x.reshape(x.shape[0] // 2, -1) * 2

    class Thirds(torch.nn.Module):  # truediv of a SymInt: a Python fallback (PYCALL)
        def forward(self, x):
            return x * (x.shape[0] / 3)

    batch = Dim("batch", min=2, max=64)
    pkg = fxrt.export(Halves(), (torch.randn(8, 3),), dynamic_shapes=({0: 2 * batch},))
    assert pkg.manifest["info"]["cpp"] is None
    pkg.save(tmp_path / "halves.fxrt")
    x = torch.randn(10, 3)
    (cpp,) = _run_cpp(runner, tmp_path / "halves.fxrt", [x], tmp_path)
    torch.testing.assert_close(cpp, Halves()(x))

    pkg = fxrt.export(Thirds(), (torch.randn(8, 3),), dynamic_shapes=({0: batch},))
    assert pkg.manifest["info"]["cpp"] == "node truediv runs Python (operator.truediv)"
    pkg.save(tmp_path / "thirds.fxrt")
    proc = runner(str(tmp_path / "thirds.fxrt"), "--random")
    assert proc.returncode == 2, proc.stderr
    assert "node truediv runs Python (operator.truediv)" in proc.stderr, proc.stderr


def test_inspect_says_cpp_runnable(w_packages) -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "fxrt", "inspect", str(w_packages["W2"][2])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "C++ runtime: yes" in proc.stdout


class _TwoStreams(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fxrt.stream_scope("side"):
            y = self.a(x).relu()
        return y + self.b(x)


def test_multi_stream_package_runs_in_python_and_is_refused_in_cpp(runner: Any, tmp_path: Path):
    """A package whose program switches streams: fxrt.load runs it (equal to eager on both
    loops); inspect and the C++ runtime say it switches streams, naming the node."""
    torch.manual_seed(0)
    model = _TwoStreams().eval()
    pkg = fxrt.export(model, (torch.randn(2, 16),))
    assert "switches streams" in pkg.manifest["info"]["cpp"]
    pkg.save(tmp_path / "streams.fxrt")
    x = torch.randn(2, 16)
    with torch.inference_mode():
        for pure in (False, True):
            torch.testing.assert_close(_loaded(tmp_path / "streams.fxrt", pure)(x), model(x))
    proc = runner(str(tmp_path / "streams.fxrt"), "--random")
    assert proc.returncode == 2, proc.stderr
    assert "switches streams" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------------
# Int inputs: Python ints the export kept symbolic (SymInt placeholders of the graph)


class _Scale(torch.nn.Module):  # an int with a range of its own
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n + n


class _Ones(torch.nn.Module):  # an int that is the same size symbol as a tensor dim
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x + torch.ones(n)


class _Grid(torch.nn.Module):  # an int used as a size, and an int output (a SYM step)
    def forward(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
        return x.new_zeros(n, 2) + x.sum(), n + 1


@pytest.fixture(scope="module")
def int_packages(store: Path) -> dict[str, tuple[Any, Path]]:
    d = Dim.DYNAMIC
    out = {}
    for name, model, args, dyn in [
        ("scale", _Scale(), (torch.randn(3), 4), (None, Dim.DYNAMIC(min=1, max=10))),
        ("ones", _Ones(), (torch.randn(3), 3), ({0: d}, d)),
        ("grid", _Grid(), (torch.randn(3), 3), ({0: d}, d)),
    ]:
        pkg = fxrt.export(model, args, dynamic_shapes=dyn)
        assert pkg.manifest["info"]["cpp"] is None
        assert [s["kind"] for s in pkg.manifest["signature"]["inputs"]] == ["tensor", "symint"]
        path = store / f"int-{name}.fxrt"
        pkg.save(path)
        out[name] = (model, path)
    return out


def _leaves(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize(
    "name,calls",
    [("scale", [(3, 7), (3, 1), (3, 10)]), ("ones", [(4, 4), (9, 9)]), ("grid", [(3, 5), (6, 2)])],
)
def test_int_inputs_cpp_equals_load_equals_eager(
    name: str, calls: list[tuple[int, int]], runner: Any, int_packages, tmp_path: Path
) -> None:
    model, path = int_packages[name]
    for size, n in calls:
        x = torch.randn(size)
        with torch.inference_mode():
            eager = _leaves(model(x, n))
            loads = [_leaves(_loaded(path, p)(x, n)) for p in (False, True)]
        cpp = _run_cpp(runner, path, [x, torch.tensor(n)], tmp_path)  # an int: a 0-dim int64
        for got in (cpp, *loads):
            assert len(got) == len(eager)
            for g, e in zip(got, eager):
                if isinstance(e, int):  # the C++ runner writes an int output as a 0-dim tensor
                    assert int(g) == e and (got is cpp or type(g) is int)
                else:
                    torch.testing.assert_close(g, e)


# ----------------------------------------------------------------------------------------------
# LoadOptions::device


def _mapped(stdout: str) -> tuple[int, int, str]:
    m = re.search(r"weights: (\d+) of (\d+) mapped from the file, on (\S+)", stdout)
    assert m, stdout
    return int(m[1]), int(m[2]), m[3]


class _Affine(torch.nn.Module):  # ops whose meta kernels are in libtorch (no Python ones)
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


def test_device_option(runner: Any, w_packages, tmp_path: Path) -> None:
    model, (x,), path = w_packages["W2"]
    x = torch.randn_like(x)
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_tensors(src, {"0": x})
    proc = runner(str(path), "--inputs", str(src), "--output", str(dst), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    n, total, dev = _mapped(proc.stdout)
    assert n == total == 16 and dev == "cpu"  # the CPU keeps the weights in the mapped file
    with torch.inference_mode():
        torch.testing.assert_close(load_tensors(dst)["0"], model(x))
        for pure in (False, True):
            loaded = fxrt.load(path, device="cpu", options={"pure_python": pure})
            torch.testing.assert_close(load_tensors(dst)["0"], loaded(x))
    # Another device type (the meta device stands in for an accelerator): the program's devices
    # are retargeted, the weights copied there, and it runs without the export's arena.
    torch.manual_seed(0)
    affine = tmp_path / "affine.fxrt"
    fxrt.export(_Affine().eval(), (torch.randn(2, 8),)).save(affine)
    proc = runner(str(affine), "--random", "--device", "meta")
    assert proc.returncode == 0, proc.stderr
    assert _mapped(proc.stdout) == (0, 2, "meta")
    assert "output 0: Float[2, 4] on meta" in proc.stdout
    for pure in (False, True):
        meta = fxrt.load(affine, device="meta", options={"pure_python": pure, "arena": False})
        assert meta(torch.empty(2, 8, device="meta")).shape == (2, 4)
    if not torch.cuda.is_available():
        proc = runner(str(path), "--random", "--device", "cuda")
        assert proc.returncode == 4, proc.stderr
        assert "fxrt: device cuda is not available in this process" in proc.stderr


# ----------------------------------------------------------------------------------------------
# update_weights


def _save_weights(path: Path, weights: dict[str, torch.Tensor]) -> Path:
    save_tensors(path, {k: v.detach().contiguous() for k, v in weights.items()})
    return path


def test_update_weights_cpp(runner: Any, w_packages, tmp_path: Path) -> None:
    model, (x,), path = w_packages["W2"]
    torch.manual_seed(5)
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.data.normal_()
    new = _save_weights(tmp_path / "other.safetensors", other.state_dict())
    (cpp,) = _run_cpp(runner, path, [x], tmp_path, "--weights", str(new))
    with torch.inference_mode():
        torch.testing.assert_close(cpp, other(x))
        for pure in (False, True):
            m = _loaded(path, pure)
            m.update_weights(other.state_dict())
            torch.testing.assert_close(cpp, m(x))
    proc = runner(str(path), "--random", "--weights", str(new))
    assert _mapped(proc.stdout)[0] == 0  # the new weights are the file's tensors, not the package's
    # Non-strict: one tensor changes, the rest stay the package's.
    part = {"layers.0.bias": other.layers[0].bias}
    one = _save_weights(tmp_path / "one.safetensors", part)
    (cpp,) = _run_cpp(runner, path, [x], tmp_path, "--weights", str(one), "--non-strict")
    mixed = copy.deepcopy(model)
    mixed.layers[0].bias.data.copy_(other.layers[0].bias)
    with torch.inference_mode():
        torch.testing.assert_close(cpp, mixed(x))
    # Errors: the same words as Python's (ValueError there, std::invalid_argument here).
    state = model.state_dict()
    bad = [
        {**state, "layers.1.weight": torch.randn(128, 256)},
        {**state, "layers.1.weight": state["layers.1.weight"].double()},
        {k: v for k, v in state.items() if k != "layers.3.bias"},
        {**state, "nope": torch.zeros(1)},
        part,  # strict: everything else is missing
    ]
    for i, weights in enumerate(bad):
        with pytest.raises(ValueError) as e:
            fxrt.load(path).update_weights(weights)
        f = _save_weights(tmp_path / f"bad-{i}.safetensors", weights)
        proc = runner(str(path), "--random", "--weights", str(f))
        assert proc.returncode == 4, proc.stderr
        assert str(e.value) in proc.stderr, (str(e.value), proc.stderr)


def test_update_weights_tied_cpp(runner: Any, gpt2, tmp_path: Path) -> None:
    """GPT-2's lm_head.weight is transformer.wte.weight: giving one of the two names replaces
    both (strict is satisfied); two different tensors for them are refused."""
    model, path = gpt2
    other = copy.deepcopy(model)
    # (a uniform shift of every weight leaves GPT-2 so ill-conditioned that eager's own
    # attention kernels disagree by 2e-4)
    g = torch.Generator().manual_seed(0)
    for p in other.parameters():
        p.data.add_(torch.randn(p.shape, generator=g) * 0.02)  # a fine-tuned checkpoint
    state = other.state_dict()
    once = {k: v for k, v in state.items() if k != "lm_head.weight"}
    f = _save_weights(tmp_path / "tied.safetensors", once)
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    (cpp,) = _run_cpp(runner, path, [ids, mask], tmp_path, "--weights", str(f))
    with torch.inference_mode():
        want = other(ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(cpp, want)
        for pure in (False, True):
            m = _loaded(path, pure)
            m.update_weights(once)
            torch.testing.assert_close(cpp, m(ids, attention_mask=mask, use_cache=False).logits)
    twice = {**state, "lm_head.weight": state["lm_head.weight"].clone()}
    with pytest.raises(ValueError, match="tied in the package"):
        fxrt.load(path).update_weights(twice)
    f = _save_weights(tmp_path / "twice.safetensors", twice)
    proc = runner(str(path), "--random", "--weights", str(f))
    assert proc.returncode == 4, proc.stderr
    assert re.search(r"weights '.*' and '.*' are tied in the package \(one tensor\)", proc.stderr)


def test_weight_swap_never_mixes(runner: Any, w_packages, tmp_path: Path) -> None:
    """Four threads call the model while a fifth alternates its weights between two sets: every
    call gives what one set gives, bit for bit (each call holds the set it started with)."""
    model, _, path = w_packages["W2"]
    torch.manual_seed(7)
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.data.normal_()
    f = _save_weights(tmp_path / "swap.safetensors", other.state_dict())
    proc = runner(str(path), "--random", "--parallel", "4", "--swap", str(f))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(
        r"swap: 4 threads x 50 calls, (\d+) swaps, (\d+) on the first set, (\d+) on the second, "
        r"0 mixes, sets differ: yes",
        proc.stdout,
    )
    assert m, proc.stdout
    assert int(m[1]) > 0 and int(m[2]) + int(m[3]) == 200


# ----------------------------------------------------------------------------------------------
# Building against the runtime: the installed package, the in-tree config, the DispatchStub probe


def test_installed_runtime_builds_a_consumer(runner: Any, w_packages, tmp_path: Path) -> None:
    import cpp_runner

    prefix = tmp_path / "prefix"
    cpp_runner.install(prefix)
    installed = {p.relative_to(prefix).as_posix() for p in prefix.rglob("*") if p.is_file()}
    for name in ("libfxrt_runtime.a", "fxrtConfig.cmake", "fxrtConfigVersion.cmake"):
        assert any(p.endswith(name) for p in installed), installed
    assert {"include/fxrt/model.h", "include/fxrt/tensors.h"} <= installed
    exe = cpp_runner.build_consumer(prefix, tmp_path / "consumer")
    model, (x,), path = w_packages["W3"]
    x = torch.randn_like(x)
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_tensors(src, {"0": x})
    proc = subprocess.run(
        [str(exe), str(path), "--inputs", str(src), "--output", str(dst)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    with torch.inference_mode():
        torch.testing.assert_close(load_tensors(dst)["0"], model(x))
    # The in-tree config (fxrt_DIR=<fxrt>/csrc/cmake) still gives a project fxrt::runtime.
    root = Path(cpp_runner.ROOT)
    proc = cpp_runner.configure(
        root / "examples" / "cpp_runner",
        tmp_path / "in-tree",
        "-DFXRT_RUNNER_INSTALLED=ON",
        f"-Dfxrt_DIR={root / 'csrc' / 'cmake'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_cpu_stub_probe_links_only_with_torchs_macros(runner: Any) -> None:
    """The DispatchStub macros the builds use are the ones that link against this torch, and
    another known set does not link (so a wrong set cannot be chosen)."""
    import cpp_runner
    from torch.utils import cpp_extension

    from fxrt._speedups import cpu_stubs

    inc, libs = cpp_extension.include_paths(), cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    macros = cpu_stubs.stub_macros(inc, libs, abi)
    assert ("FXRT_CPU_STUBS", "1") in macros
    chosen = tuple(d for d, _ in macros if d != "FXRT_CPU_STUBS")
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert chosen == ("HAVE_AVX512_CPU_DEFINITION", "HAVE_AVX2_CPU_DEFINITION")
    wrong = [c for c in cpu_stubs.candidates() if c != chosen][:2]
    for defs in wrong:
        assert not cpu_stubs.links(defs, inc, libs, abi), defs
    cache = (cpp_runner.build_dir() / "CMakeCache.txt").read_text()
    want = ";".join([*(f"{d}=1" for d in chosen), "FXRT_CPU_STUBS=1"])
    assert f"FXRT_CPU_STUBS_DEFINITIONS:INTERNAL={want}\n" in cache


@pytest.mark.skipif(not native_available(), reason="the fused ops are fxrt's own (the extension)")
def test_fused_decoder_package(runner: Any, store: Path, tmp_path: Path) -> None:
    """A decoder's fused patterns travel in the package: its manifest names the fused ops, and
    fxrt.load (both loops) and the C++ runtime run them with eager's answers, over a dynamic
    sequence length."""
    model, path = _export_client("llama", store)
    loaded = fxrt.load(path)
    assert {"fxrt::rms_norm", "fxrt::add_rms_norm", "fxrt::rotary", "fxrt::gated"} <= set(
        loaded.manifest["ops"]
    )
    # with an attention mask, transformers repeats the K/V heads: gqa_attention reads them once
    assert fxrt.pattern_counts(loaded) == {"rms_norm": 1, "add_rms_norm": 4, "rotary": 2,
                                           "gated_mlp": 2, "gqa_attention": 2}  # fmt: skip
    for seq_len in (8, 13):
        ids = _ids(2, seq_len)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            eager = model(ids, attention_mask=mask, use_cache=False).logits
            outs = [
                _loaded(path, p)(ids, attention_mask=mask, use_cache=False).logits
                for p in (False, True)
            ]
        (cpp,) = _run_cpp(runner, path, [ids, mask], tmp_path)
        for out in (cpp, *outs):
            torch.testing.assert_close(out, eager)


@pytest.mark.skipif(not native_available(), reason="the fused ops are fxrt's own (the extension)")
def test_complex_rotary_package(runner: Any, store: Path, tmp_path: Path) -> None:
    """Meta's reference Llama (complex rotary, a complex64 frequency table among the constants):
    the package names fxrt::rotary_complex, and fxrt.load (both loops) and the C++ runtime run
    it with eager's logits over a dynamic sequence length."""
    from reference_llama import Llama, tokens

    torch.manual_seed(0)
    model = Llama().eval()
    path = store / "reference_llama.fxrt"
    seq = Dim("seq", min=2, max=64)
    fxrt.export(model, (tokens(2, 8, 0),), dynamic_shapes={"tokens": {1: seq}}).save(path)
    loaded = fxrt.load(path)
    assert "fxrt::rotary_complex" in loaded.manifest["ops"]
    assert fxrt.pattern_counts(loaded)["rotary_complex"] == 2
    for n in (8, 13):
        t = tokens(2, n, n)
        with torch.inference_mode():
            eager = model(t)
            outs = [_loaded(path, p)(t) for p in (False, True)]
        (cpp,) = _run_cpp(runner, path, [t], tmp_path)
        for out in (cpp, *outs):
            torch.testing.assert_close(out, eager)


class _StridedConstants(torch.nn.Module):
    # Folding leaves constants that are not dense: quantile of a 0-d tensor is one of sizes (1,)
    # and strides (0,). Packages hold them with their strides, and both faces load them.
    def forward(self, x):
        return x * torch.tensor([1.0, 2.0, 3.0]).expand(4, 3) + torch.quantile(
            torch.tensor(3.0), 0.5
        )


def test_strided_constants_load_in_both_faces(runner: Any, tmp_path: Path) -> None:
    model, x = _StridedConstants(), torch.randn(4, 3)
    path = tmp_path / "strided.fxrt"
    fxrt.export(model, (x,)).save(path)
    strides = [v.stride() for v in fxrt.load(path).graph.constants.values()]
    assert (0,) in strides, strides
    x = torch.randn(4, 3)
    (cpp,) = _run_cpp(runner, path, [x], tmp_path)
    torch.testing.assert_close(cpp, model(x))
    for pure_python in (False, True):
        torch.testing.assert_close(_loaded(path, pure_python)(x), model(x))


class _SoftCapped(torch.nn.Module):
    # Gemma-2's soft cap of attention scores and logits: c * tanh(x / c), run by fxrt::tanh.
    def forward(self, x):
        return torch.tanh(x / 30.0) * 30.0, torch.tanh(x.t() / 50.0)


def test_tanh_package(runner: Any, store: Path, tmp_path: Path) -> None:
    """A package whose graph runs fxrt::tanh names it, and fxrt.load (both loops) and the C++
    runtime give eager's values within its bound (docs/numerics.md: 1 ulp of tanh, here scaled)."""
    model = _SoftCapped()
    path = store / "soft_capped.fxrt"
    fxrt.export(model, (torch.randn(16, 24),)).save(path)
    assert "fxrt::tanh" in fxrt.load(path).manifest["ops"]
    for x in (torch.randn(16, 24) * 100, torch.randn(16, 24)):
        eager = model(x)
        outs = [_loaded(path, p)(x) for p in (False, True)]
        cpp = _run_cpp(runner, path, [x], tmp_path)
        for out in (cpp, *outs):
            for got, want in zip(out, eager):
                torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-7)


def test_softcap_attention_package(runner: Any, store: Path, tmp_path: Path) -> None:
    """A package of Gemma-2's soft-capped attention names fxrt::softcap_sdpa, and fxrt.load
    (both loops) and the C++ runtime give eager's values."""
    from test_patterns_softcap import CappedAttention

    torch.manual_seed(0)
    model = CappedAttention(window=4).eval()
    path = store / "softcap_attention.fxrt"
    fxrt.export(model, (torch.randn(2, 9, 64),)).save(path)
    assert "fxrt::softcap_sdpa" in fxrt.load(path).manifest["ops"]
    for seed in (0, 1):
        x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(seed)) * 3
        with torch.no_grad():
            want = model(x)
        cpp = _run_cpp(runner, path, [x], tmp_path)
        for got in (cpp[0], *(_loaded(path, p)(x) for p in (False, True))):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_layer_norm_package(runner: Any, store: Path, tmp_path: Path, dtype) -> None:
    """A package of Cohere's written-out LayerNorm names fxrt::layer_norm_chain, and fxrt.load
    (both loops) and the C++ runtime give eager's values bit for bit."""
    from test_layer_norm_chain import CohereNorm

    torch.manual_seed(0)
    model = CohereNorm().to(dtype).eval()
    path = store / f"layer_norm_{dtype}.fxrt".replace("torch.", "")
    fxrt.export(model, (torch.randn(2, 9, 64).to(dtype),)).save(path)
    assert "fxrt::layer_norm_chain" in fxrt.load(path).manifest["ops"]
    for seed in (0, 1):
        x = (torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
        with torch.no_grad():
            want = model(x)
        cpp = _run_cpp(runner, path, [x], tmp_path)
        for got in (cpp[0], *(_loaded(path, p)(x) for p in (False, True))):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Attention(torch.nn.Module):
    # grouped-query causal attention, as a decoder block calls it: fxrt::sdpa into the arena
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ).transpose(1, 2)


def test_sdpa_package(runner: Any, store: Path, tmp_path: Path) -> None:
    """A package whose attention's logsumexp nobody reads names fxrt::sdpa, and fxrt.load (both
    loops) and the C++ runtime give eager's values."""
    model = _Attention()
    shapes = ((2, 4, 12, 16), (2, 2, 12, 16), (2, 2, 12, 16))
    path = store / "attention.fxrt"
    fxrt.export(model, tuple(torch.randn(s) for s in shapes)).save(path)
    assert "fxrt::sdpa" in fxrt.load(path).manifest["ops"]
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        args = [torch.randn(s, generator=g) for s in shapes]
        want = model(*args)
        cpp = _run_cpp(runner, path, args, tmp_path)
        for got in (cpp[0], *(_loaded(path, p)(*args) for p in (False, True))):
            torch.testing.assert_close(got, want)


def test_multi_result_out_package(runner: Any, store: Path, tmp_path: Path) -> None:
    """A decoder block's package stores add_rms_norm's and rotary's out= forms writing two arena
    slots each; fxrt.load (both loops) and the C++ runtime give eager's values, and the C++
    runtime refuses such an OUT whose slots run past the arena or that does not say multi."""
    from test_patterns import Block, _block_inputs

    torch.manual_seed(0)
    model = Block().eval()
    path = store / "block.fxrt"
    fxrt.export(model, _block_inputs(0)).save(path)
    data = path.read_bytes()
    code = _sections(data)[0]["program"]["code"]
    multi = {i["out_op"]: i for i in code if i["kind"] == "OUT" and i["multi"]}
    assert set(multi) == {"fxrt::add_rms_norm.out", "fxrt::rotary.out"}, multi
    for seed in (1, 2):
        inputs = list(_block_inputs(seed))
        with torch.no_grad():
            want = model(*inputs)
        cpp = _run_cpp(runner, path, inputs, tmp_path)
        for got in (cpp[0], *(_loaded(path, p)(*inputs) for p in (False, True))):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def forge(change: Any) -> bytes:
        def edit(m: Any) -> None:
            ins = next(i for i in m["program"]["code"] if i.get("out_op") == "fxrt::rotary.out")
            change(m, ins)

        return _forge(data, edit)

    n_slots = len(_sections(data)[0]["program"]["arena"]["slots"])
    cases = [
        (lambda m, ins: ins.update(slot=n_slots - 1), "slot"),
        (lambda m, ins: ins.update(multi=False), "malformed outputs"),
    ]
    results = _check(runner, [forge(c) for c, _ in cases], tmp_path)
    for (outcome, msg), (_, match) in zip(results, cases):
        assert outcome == "refused" and match in msg, (match, outcome, msg)
