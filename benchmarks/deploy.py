"""Deploy without Dynamo: ``fxrt.export``/``fxrt.load`` against the other ways to run a model.

Per workload (W1-W3 of ``fxrt/models.py``; the client tier's tiny GPT-2 and Llama forward, batch
1, 16 tokens, with an attention mask and ``use_cache=False``; and ``mlp-wide``, W2's MLP at
width 2048, 64 MiB of weights, for the memory figures), in one process, interleaved, medians of
rounds, ``torch.set_num_threads(1)``, under ``torch.inference_mode()``:

  eager            the module called as it is
  torch.compile    torch.compile(model, backend="fxrt")
  loop             the package's CompiledGraph called directly with its weights and the flat
                   inputs (what fxrt.load wraps: no pytree, no checks of its own)
  fxrt.load        the loaded package (``pkg.save`` then ``fxrt.load``), called as the model
  static_runtime   torch._C._jit_to_static_module on torch.jit.freeze(torch.jit.trace(model))
  aoti             torch._inductor.aoti_compile_and_package / aoti_load_package (CPU, C++)
  cpp runner       the package run by examples/cpp_runner (fxrt's C++ runtime, no Python), in a
                   process of its own that times batches of calls on the same clock when asked
                   (``--serve``), in the same shuffled rounds; built as the tests build it, left
                   out (and said so) when there is no CMake or C++ compiler, or with --skip-cpp

and, per packaged runtime (fxrt, aoti):

  build s          fxrt: fxrt.export (torch.export + decompositions + compile) and save;
                   aoti: torch.export + aoti_compile_and_package
  load ms          fxrt.load / aoti_load_package in a fresh process (imports done first)
  RSS MiB          the fresh process's resident memory after the load and after the first
                   call, minus what it held before the load (torch, fxrt, and for the HF models
                   transformers imported), and that delta over the size of the weights; for
                   the load, that delta by kind of page (/proc/self/status, smaps): the
                   package file's own mapped pages (fxrt: the weights, which the hash check
                   reads), other file pages (the code of torch's and fxrt's libraries that the
                   load runs for the first time in the process: clean, shared with every process
                   that maps them, paid once per process), and anonymous memory (the process's
                   own: Python objects, malloc); then the same package loaded again into that
                   process and called (what each further package costs)

Every competitor's output is checked against eager first. Usage:

    python benchmarks/deploy.py [--rounds 15] [--only W2,gpt2] [--skip-aoti] [--skip-cpp]
                                [--clock cpu]
    python benchmarks/deploy.py --render bench-results/deploy.json   # the tables again
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fxrt  # noqa: E402
from fxrt.bench import measure, progress  # noqa: E402
from fxrt.models import MLP, workloads  # noqa: E402


class HFForward(torch.nn.Module):
    """A HF causal LM's forward with a mask and no cache, returning the logits (one tensor, so
    every runtime, Static Runtime's trace included, sees the same function)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, attention_mask=attention_mask, use_cache=False).logits


def workload_list() -> dict[str, tuple[torch.nn.Module, tuple]]:
    out = dict(workloads())
    from clients_child import build, input_ids

    for name in ("gpt2", "llama"):
        ids = input_ids(1, 16)
        out[name] = (HFForward(build(name)).eval(), (ids, torch.ones_like(ids)))
    torch.manual_seed(0)
    out["mlp-wide"] = (MLP(2048, 4).eval(), (torch.randn(1, 2048),))
    return out


def weights_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# ----------------------------------------------------------------------------------------------
# Competitors


def build_fxrt(model: torch.nn.Module, args: tuple, path: Path) -> tuple[Any, float]:
    t0 = time.perf_counter()
    pkg = fxrt.export(model, args, options={"cache": False})
    pkg.save(path)
    return pkg, time.perf_counter() - t0


def build_aoti(model: torch.nn.Module, args: tuple, path: Path) -> float:
    t0 = time.perf_counter()
    ep = torch.export.export(model, args, strict=False)
    torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return time.perf_counter() - t0


def static_runtime(model: torch.nn.Module, args: tuple) -> tuple[Callable | None, str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.freeze(torch.jit.trace(model, args, strict=False).eval())
            sm = torch._C._jit_to_static_module(traced._c)
            sm(*args)
        return sm, ""
    except Exception as e:  # noqa: BLE001 - reported as the reason it is skipped
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


class CppRunner:
    """examples/cpp_runner serving one package: ``batch(n)`` makes n calls in the runner's
    process and returns its mean µs per call."""

    def __init__(self, exe: Path, package: Path, inputs: tuple, clock: str, tmp: Path):
        from fxrt.deploy.tensorfile import save_tensors

        src = tmp / f"{package.stem}.inputs.safetensors"
        save_tensors(src, {str(i): t for i, t in enumerate(inputs)})
        self.proc = subprocess.Popen(
            [str(exe), str(package), "--inputs", str(src), "--serve", "--clock", clock,
             "--threads", "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        # The runner's two header lines: "loaded ..." and "weights: ... mapped from the file".
        header = [self.proc.stdout.readline() for _ in range(2)]
        if not header[0].startswith("loaded") or not header[1].startswith("weights:"):
            raise RuntimeError(f"the C++ runner did not load {package}: {header}")

    def batch(self, n: int) -> float:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the C++ runner exited")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def cpp_runner_exe() -> tuple[Path | None, str]:
    try:
        import cpp_runner

        return cpp_runner.build(), ""
    except Exception as e:  # noqa: BLE001 - reported as the reason it is skipped
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def direct_loop(pkg: Any) -> Callable:
    cg = pkg.compiled
    weights = [pkg.weights[s["weight"]] for s in pkg.manifest["signature"]["inputs"]
               if s["kind"] == "weight"]  # fmt: skip
    single = len(pkg.manifest["signature"]["outputs"]) == 1

    def loop(*flat: Any) -> Any:
        out = cg([*weights, *flat])
        return out[0] if single else out

    return loop


# ----------------------------------------------------------------------------------------------
# Fresh-process load time and memory

CHILD = r"""
import json, os, sys, time
import torch
torch.set_num_threads(1)
kind, path, hf = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
import fxrt
fxrt.runtime_info()  # the extension loaded
import fxrt.deploy.loaded  # noqa: F401 - what a load imports (imports are not the load)
if kind == "aoti":
    import torch._inductor.package  # noqa: F401 - imports are not the load
if hf:
    import transformers.modeling_outputs  # noqa: F401
args = torch.load(sys.argv[4])
def rss():
    # VmRSS and its parts: RssAnon (this process's own memory), RssFile (pages of mapped files)
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}
def package_pages():
    # resident pages of the mappings of the package file itself (fxrt: its weights)
    total, ours, real = 0, False, os.path.realpath(path)
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":"):
                ours = len(head) > 5 and head[5] == real
            elif ours and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total
def load():
    if kind == "fxrt":
        return fxrt.load(path)
    return torch._inductor.aoti_load_package(path)
before, pkg_before = rss(), package_pages()
t0 = time.perf_counter()
m = load()
t1 = time.perf_counter()
after_load, pkg_load = rss(), package_pages() - pkg_before
with torch.inference_mode():
    m(*args)
after_call = rss()
# The same package loaded again into this process, as a second model: what each further
# package costs once the process has paid for its first (code run for the first time, pools).
m2 = load()
after_load2 = rss()
with torch.inference_mode():
    m2(*args)
after_call2 = rss()
print(json.dumps({"load_s": t1 - t0, "rss_load": after_load["VmRSS"] - before["VmRSS"],
                  "rss_call": after_call["VmRSS"] - before["VmRSS"],
                  "anon_load": after_load["RssAnon"] - before["RssAnon"],
                  "file_load": after_load["RssFile"] - before["RssFile"], "pkg_load": pkg_load,
                  "rss_load2": after_load2["VmRSS"] - after_call["VmRSS"],
                  "rss_call2": after_call2["VmRSS"] - after_call["VmRSS"]}))
"""


def fresh_load(kind: str, path: Path, args_path: Path, hf: bool, repeats: int) -> dict[str, float]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, kind, str(path), "1" if hf else "0", str(args_path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=600,
        )
        if out.returncode:
            raise RuntimeError(f"{kind} load child failed: {out.stderr[-2000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# ----------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    tmp = Path(tempfile.mkdtemp(prefix="fxrt-deploy-bench-"))
    chosen = {
        k: v
        for k, v in workload_list().items()
        if not args.only or any(k.startswith(o) for o in args.only.split(","))
    }
    results: dict[str, Any] = {}
    exe, no_cpp = (None, "--skip-cpp") if args.skip_cpp else cpp_runner_exe()
    for i, (name, (model, inputs)) in enumerate(chosen.items()):
        tag = name.split()[0]
        hf = name in ("gpt2", "llama")
        r: dict[str, Any] = {"weights_bytes": weights_bytes(model), "skipped": {}}
        progress(i, len(chosen), f"{name}: fxrt.export")
        pkg, r["fxrt_build_s"] = build_fxrt(model, inputs, tmp / f"{tag}.fxrt")
        loaded = fxrt.load(tmp / f"{tag}.fxrt")
        torch._dynamo.reset()
        fns: dict[str, Callable] = {
            "eager": model,
            "torch.compile": torch.compile(model, backend="fxrt"),
            "loop": direct_loop(pkg),
            "fxrt.load": loaded,
        }
        sm, why = static_runtime(model, inputs)
        if sm is not None:
            fns["static_runtime"] = sm
        else:
            r["skipped"]["static_runtime"] = why
        if not args.skip_aoti:
            progress(i, len(chosen), f"{name}: AOTInductor compile")
            r["aoti_build_s"] = build_aoti(model, inputs, tmp / f"{tag}.pt2")
            fns["aoti"] = torch._inductor.aoti_load_package(str(tmp / f"{tag}.pt2"))
        else:
            r["skipped"]["aoti"] = "--skip-aoti"
        with torch.inference_mode():
            expected = model(*inputs)
            for n, fn in fns.items():
                torch.testing.assert_close(fn(*inputs), expected, rtol=1e-4, atol=1e-4, msg=n)
            progress(i, len(chosen), f"{name}: timing {len(fns)} competitors")
            clock = time.thread_time if args.clock == "cpu" else time.perf_counter
            runner = None
            if exe is not None:
                runner = CppRunner(exe, tmp / f"{tag}.fxrt", inputs, args.clock, tmp)
            else:
                r["skipped"]["cpp runner"] = no_cpp
            batches = {"cpp runner": runner.batch} if runner is not None else {}
            try:
                r["us_per_call"] = measure(fns, inputs, args.rounds, clock=clock, batches=batches)
            finally:
                if runner is not None:
                    runner.close()
        progress(i, len(chosen), f"{name}: fresh-process loads")
        args_path = tmp / f"{tag}.args.pt"
        torch.save(inputs, args_path)
        r["fxrt_load"] = fresh_load("fxrt", tmp / f"{tag}.fxrt", args_path, hf, args.load_repeats)
        if not args.skip_aoti:
            r["aoti_load"] = fresh_load(
                "aoti", tmp / f"{tag}.pt2", args_path, hf, args.load_repeats
            )
        results[name] = r
    progress(len(chosen), len(chosen), "done")
    print(file=sys.stderr)
    return results


def markdown(results: dict[str, Any]) -> str:
    names = list(dict.fromkeys(n for r in results.values() for n in r["us_per_call"]))
    lines = [
        "Per call, µs (ratio to eager):",
        "",
        "| workload | " + " | ".join(names) + " |",
        "|" + "---|" * (len(names) + 1),
    ]
    for w, r in results.items():
        t = r["us_per_call"]
        cells = [f"{t[n]:.1f} ({t[n] / t['eager']:.2f}x)" if n in t else "n/a" for n in names]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += [
        "",
        'Ratios: fxrt.load vs loop, vs torch.compile(backend="fxrt"), vs aoti; the C++ runner '
        "vs fxrt.load:",
        "",
        "| workload | load/loop | load/torch.compile | load/aoti | load/static_runtime "
        "| cpp runner/load |",
        "|---|---|---|---|---|---|",
    ]
    for w, r in results.items():
        cells = [
            _ratio(r["us_per_call"], "fxrt.load", b)
            for b in ("loop", "torch.compile", "aoti", "static_runtime")
        ] + [_ratio(r["us_per_call"], "cpp runner", "fxrt.load")]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Build, load (fresh process) and memory (RSS delta after load / after the first call; "
        "ratio to the weights' size):",
        "",
        "| workload | weights | fxrt build | aoti build | fxrt/aoti | fxrt load | aoti load | "
        "fxrt/aoti | fxrt RSS load / call | aoti RSS load / call |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, r in results.items():
        wb = r["weights_bytes"]
        fl, al = r["fxrt_load"], r.get("aoti_load")

        ab = r.get("aoti_build_s")
        lines.append(
            f"| {w} | {wb / 2**20:.2f} MiB | {r['fxrt_build_s']:.2f} s | "
            + (f"{ab:.1f} s | {r['fxrt_build_s'] / ab:.3f}x | " if ab else "n/a | n/a | ")
            + f"{fl['load_s'] * 1e3:.1f} ms | "
            + (
                f"{al['load_s'] * 1e3:.1f} ms | {fl['load_s'] / al['load_s']:.3f}x | "
                if al
                else "n/a | n/a | "
            )
            + f"{_mem(fl, wb)} | {_mem(al, wb)} |"
        )
    if all("rss_load2" in r["fxrt_load"] for r in results.values()):
        lines += [
            "",
            "fxrt.load's memory, MiB: the first load in a process (the RSS delta above) by kind of "
            "page, and the same package loaded again into that process (RSS delta after its load "
            "/ after its first call; ratio to the weights' size):",
            "",
            "| workload | weights | first load | package's pages | other file pages (code) "
            "| anonymous | second load / call | aoti second load / call |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for w, r in results.items():
            wb, fl, al = r["weights_bytes"], r["fxrt_load"], r.get("aoti_load")
            mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
            lines.append(
                f"| {w} | {mib(wb)} | {mib(fl['rss_load'])} | {mib(fl['pkg_load'])} | "
                f"{mib(fl['file_load'] - fl['pkg_load'])} | {mib(fl['anon_load'])} | "
                f"{_mem(fl, wb, '2')} | {_mem(al, wb, '2')} |"
            )
    skipped = {(w, k): v for w, r in results.items() for k, v in r["skipped"].items()}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{w} {k}: {v}" for (w, k), v in skipped.items())]
    return "\n".join(lines)


def _ratio(t: dict[str, float], a: str, b: str) -> str:
    return f"{t[a] / t[b]:.2f}x" if a in t and b in t else "n/a"


def _mem(x: dict[str, float] | None, weights: int, which: str = "") -> str:
    if x is None or f"rss_load{which}" not in x:
        return "n/a"
    ratio = lambda b: f" ({b / weights:.2f}x)" if weights else ""  # noqa: E731
    load, call = x[f"rss_load{which}"], x[f"rss_call{which}"]
    return f"{load / 2**20:.1f}{ratio(load)} / {call / 2**20:.1f}{ratio(call)} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--only", default="", help="comma-separated workload prefixes: W1,W2,gpt2")
    p.add_argument("--skip-aoti", action="store_true", help="leave out AOTInductor (slow to build)")
    p.add_argument("--skip-cpp", action="store_true", help="leave out the C++ runner")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: per-call times in the thread's CPU time (every competitor runs on the calling "
        "thread with one intra-op thread), so time descheduled on a busy machine does not count",
    )
    p.add_argument("--load-repeats", type=int, default=3, help="fresh processes per load figure")
    p.add_argument("--json", default="bench-results/deploy.json")
    p.add_argument("--md", default="bench-results/deploy.md")
    p.add_argument("--render", metavar="JSON", help="print the tables of an earlier run's JSON")
    args = p.parse_args(argv)
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())))
        return 0
    results = run(args)
    _write(args.json, json.dumps(results, indent=2))
    table = markdown(results)
    print(table)
    _write(args.md, table + "\n")
    return 0


def _write(path: str, text: str) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        Path(path).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
