"""Cold start and restart: a cold process against a warm one (same cache directory), each a fresh
interpreter, through every way PyTorch offers to start a compiled model.

For each model (tiny GPT-2, Llama and Qwen2 from the client tier, batch 1, 16 tokens; the W3
decoder block and eight decoder blocks of width 256 from ``fxrt.models``), each a pair of fresh
processes, cold then warm:

* ``fxrt``: ``torch.compile(model, backend="fxrt")``; warm = fxrt's compile cache filled.
* ``inductor``: ``torch.compile(model)``; warm = Inductor's FX graph cache and AOTAutograd cache
  filled (its own cache directory, ``TORCHINDUCTOR_CACHE_DIR``).
* ``fxrt precompile``: cold = ``torch.compile(model, fullgraph=True, backend="fxrt")``'s
  ``aot_compile`` and ``save_compiled_function``; warm = ``torch.compiler.load_compiled_function``
  (no Dynamo trace, no backend call).
* ``fxrt caching``: ``TORCH_CACHING_PRECOMPILE=1``: cold compiles and calls
  ``torch.compiler.save_cache_artifacts()``; warm gets Dynamo's entry with fxrt's bytes.

Reported per process (medians over ``--repeats``): the first call alone (compile or load, and
the call; for precompile the load and the call), and the time to the first output of the whole
process (interpreter start to the first output: imports, building the model, the first call).
Python's bytecode caches are on and written by an untimed first pair of processes (a deployment
has them; without them every process compiles torch._dynamo's and transformers' sources). Import
times are reported on their own and are not in the first call: ``import torch``,
``import fxrt``, and ``import torch._dynamo`` (about a second, PyTorch's, which every one of
these paths needs at its first compile or load). Single-threaded (``torch.set_num_threads(1)``).

Usage: python benchmarks/coldstart.py [--models gpt2,llama,qwen2,w3,blocks8] [--repeats 3]
           [--modes fxrt,inductor,precompile,caching]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import json, os, sys, time
    spawned = float(sys.argv[3])
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import fxrt
    t2 = time.perf_counter()
    import torch._dynamo.aot_compile  # every mode's first compile or load imports it
    t2b = time.perf_counter()
    torch.set_num_threads(1)
    name, mode = sys.argv[1], sys.argv[2]
    path = os.environ["COLDSTART_FILE"]
    if name in ("w3", "blocks8"):
        from fxrt.models import DecoderBlock
        torch.manual_seed(0)
        if name == "w3":
            model, x = DecoderBlock(128, 4).eval(), torch.randn(1, 16, 128)
        else:
            model = torch.nn.Sequential(*[DecoderBlock(256, 8) for _ in range(8)]).eval()
            x = torch.randn(1, 32, 256)
        first_output = lambda out: out
    else:
        sys.path.insert(0, os.path.join(os.environ["COLDSTART_ROOT"], "tests"))
        from clients_child import CLIENTS, build, input_ids
        model, x = build(name), input_ids(1, 16)
        first_output = lambda out: getattr(out, CLIENTS[name].output)
    t3 = time.perf_counter()
    with torch.no_grad():
        if mode in ("fxrt", "inductor", "caching"):
            compiled = torch.compile(model, backend="inductor" if mode == "inductor" else "fxrt")
            out = compiled(x)
        elif mode == "aot_save":
            compiled = torch.compile(model, fullgraph=True, backend="fxrt")
            fn = compiled.forward.aot_compile(((x,), {}))
            fn.save_compiled_function(path)
            out = fn(model, x)
        else:  # aot_load
            with open(path, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
            out = fn(model, x)
        first_output(out).sum().item()
        t4 = time.perf_counter()
        ttfo = time.time() - spawned
        torch.testing.assert_close(first_output(out), first_output(model(x)))
    if mode == "caching":
        torch.compiler.save_cache_artifacts()
    print(json.dumps({"import_torch": t1 - t0, "import_fxrt": t2 - t1, "import_dynamo": t2b - t2,
                      "build": t3 - t2b, "first_call": t4 - t3, "ttfo": ttfo,
                      "fxrt_stats": dict(fxrt.cache.stats)}))
""")

# PyTorch's aot_compile saves these (W3's guards and state); see the notes main() prints.
OWN_MODELS = ("w3",)
MODES = {
    # mode: (cold child mode, warm child mode, extra environment)
    "fxrt": ("fxrt", "fxrt", {}),
    "inductor": ("inductor", "inductor", {}),
    "precompile": ("aot_save", "aot_load", {}),
    "caching": ("caching", "caching", {"TORCH_CACHING_PRECOMPILE": "1"}),
}
LABELS = {
    "fxrt": "fxrt (torch.compile)",
    "inductor": "Inductor",
    "precompile": "fxrt, aot_compile / load_compiled_function",
    "caching": "fxrt, TORCH_CACHING_PRECOMPILE=1",
}


def child(name: str, mode: str, env: dict[str, str]) -> dict:
    # Python's bytecode caches are on, as in any installed deployment: a restart that compiles
    # every module of torch._dynamo and transformers from source measures the interpreter.
    environ = {**os.environ, "COLDSTART_ROOT": str(ROOT), **env}
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, name, mode, repr(time.time())],
        env=environ,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{name} {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pair(name: str, mode: str) -> tuple[dict, dict | None]:
    """A cold process and a warm one on the same (new) cache directories."""
    cold_mode, warm_mode, extra = MODES[mode]
    with tempfile.TemporaryDirectory() as d:
        env = {
            **extra,
            "FXRT_CACHE_DIR": os.path.join(d, "fxrt"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(d, "inductor"),
            "COLDSTART_FILE": os.path.join(d, "compiled.bin"),
        }
        cold = child(name, cold_mode, env)
        if mode == "caching":  # the warm process must not find fxrt's own cache either
            env["FXRT_CACHE_DIR"] = os.path.join(d, "fxrt-empty")
        try:
            warm = child(name, warm_mode, env)
        except RuntimeError as e:
            if mode == "caching" and "_Missing" in str(e):
                return cold, None  # PyTorch's, with every backend: see KNOWN_FAILURES
            raise
    if mode == "fxrt":
        assert warm["fxrt_stats"].get("hit", 0) >= 1, warm
        assert warm["fxrt_stats"].get("compiled", 0) == 0, warm
    if mode in ("precompile", "caching"):
        assert warm["fxrt_stats"].get("compiled", 0) == 0, warm  # fxrt was never asked
        assert warm["fxrt_stats"].get("hit", 0) == 0, warm
    return cold, warm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,llama,qwen2,w3,blocks8")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="append each cold/warm pair's measurements to this file")
    args = p.parse_args()
    models, modes = args.models.split(","), args.modes.split(",")
    med = statistics.median

    for name in models:  # untimed: writes the bytecode caches every later process reads
        pair(name, "fxrt")
    rows: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for _ in range(args.repeats):
        for name in models:  # interleaved: each round runs every model and mode once
            for mode in modes:
                if mode == "precompile" and name not in OWN_MODELS:
                    continue
                rows.setdefault((name, mode), []).append(pair(name, mode))
                if args.json:  # each pair as it comes: a long run keeps what it measured
                    with open(args.json, "a") as f:
                        f.write(json.dumps([name, mode, *rows[name, mode][-1]]) + "\n")
    every = [r for runs in rows.values() for pair_ in runs for r in pair_ if r is not None]
    print(
        f"imports (median of {len(every)} processes): torch {med(r['import_torch'] for r in every):.2f} s, "  # noqa: E501
        f"fxrt {med(r['import_fxrt'] for r in every) * 1e3:.1f} ms, "
        f"torch._dynamo {med(r['import_dynamo'] for r in every):.2f} s (imported before the "
        "first call in every process: each mode's first compile or load needs it)"
    )
    print()
    print(
        "| model | how | first call, cold | warm | warm/cold "
        "| time to first output, cold | warm | warm/cold |"
    )
    print("|---|---|---|---|---|---|---|---|")
    failed = set()
    for (name, mode), runs in rows.items():
        if any(w is None for _, w in runs):
            failed.add(name)
            print(f"| {name} | {LABELS[mode]} | the warm process fails in PyTorch (*) | | | | | |")
            continue
        fc = med(c["first_call"] for c, _ in runs), med(w["first_call"] for _, w in runs)
        tt = med(c["ttfo"] for c, _ in runs), med(w["ttfo"] for _, w in runs)
        print(
            f"| {name} | {LABELS[mode]} | {fc[0]:.2f} s | {fc[1]:.2f} s | {fc[1] / fc[0]:.2f}x "
            f"| {tt[0]:.2f} s | {tt[1]:.2f} s | {tt[1] / tt[0]:.2f}x |"
        )
    if failed:
        print(
            f"\n(*) {', '.join(sorted(failed))}: under TORCH_CACHING_PRECOMPILE=1 the second "
            "process fails while PyTorch loads the saved guards (AttributeError: '_Missing' "
            "object has no attribute '__closure__'), with backend='inductor' too."
        )
    if "precompile" in modes and set(models) - set(OWN_MODELS):
        print(
            "\nNo aot_compile row for the transformers models: PyTorch cannot save their guards "
            "with any backend (aot_eager too: an ID_MATCH guard on the code object transformers' "
            "decorators read, and with such guards filtered out, external references the loader "
            "needs as f_globals). None for blocks8 either: its forward (nn.Sequential's) "
            "iterates its modules, which save_compiled_function refuses to pickle without "
            "external_data, with any backend."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
