"""The client-model tier's tiny ``transformers`` models under eager, ``aot_eager``, Inductor, fxrt
and Inductor + fxrt: forward latency, ``generate()`` ms per token, compile time and peak memory.

The models are the ones ``tests/test_clients.py`` runs (``tests/clients_child.py``: GPT-2, Llama,
Qwen2, Mistral, BERT, the T5 encoder and OPT, built from configs with 2 layers and hidden size 64,
random weights, ``sdpa`` attention; nothing is downloaded). Every competitor runs in this one
process, one intra-op thread (``torch.set_num_threads(1)``), under ``torch.no_grad()``:

  eager            the model as it is
  aot_eager        ``torch.compile(backend="aot_eager")``
  inductor         ``torch.compile`` with Inductor's defaults (its Python host wrapper, with its
                   ``assert_size_stride`` input checks)
  fxrt             ``torch.compile(backend="fxrt")``, the compiled loop
  inductor+fxrt    Inductor's defaults with ``fxrt.register_fx_wrapper()``: Inductor's kernels,
                   fxrt running the host graph (with fxrt's own input checks)
  inductor+fxrt[aten]  the same without fxrt's own CPU ops (``own_ops=False``: ATen's attention
                   kernel, as Inductor's wrapper calls it); forward only

Each competitor compiles a function of its own (a fresh code object, so Dynamo never shares
compiled code or recompile counts between competitors), with static shapes, cold: no Inductor
FX-graph or AOTAutograd cache, an empty Inductor cache directory for each Inductor compile (no
kernel compiled by another competitor or an earlier run is reused), no fxrt cache.

* forward: batch 1, 16 tokens; ``measure`` of ``fxrt.bench`` (interleaved rounds in a shuffled
  order, each figure the median over rounds of the mean µs per call);
* generate: greedy ``generate()`` of ``--new-tokens`` tokens from a 16-token prompt with a static
  KV cache (``cache_implementation="static"``), ``model.forward`` replaced by the competitor's
  compiled forward (two graphs: prefill and decode step); a round runs one ``generate`` per
  competitor in a shuffled order, and the figure is the median over rounds of the wall time
  divided by the number of new tokens (prefill included);
* compile: seconds spent in the backend (Dynamo's tracing excluded; for Inductor the whole
  ``compile_fx``, kernels included), summed over the graphs of the forward, and the wall time of
  the first forward call (Dynamo + backend);
* memory: peak resident set size (``VmHWM`` of /proc/self/status, reset through
  /proc/self/clear_refs before each phase) minus the resident size before it, during the first
  forward call (compile included), in MB. It is an RSS delta: memory the allocator kept from
  earlier phases is reused without showing, so read it as an order of magnitude.

Times are wall-clock by default; ``--clock cpu`` takes the calling thread's CPU time instead, so
that time the process spends descheduled on a busy shared machine is not counted (every
competitor runs its ops on the calling thread with one intra-op thread, Inductor's C++ kernels
included).

Outputs are checked against eager (logits within 1e-4; generated tokens equal) before timing.

Usage: python benchmarks/clients.py [--quick] [--models gpt2,llama] [--rounds N]
                                    [--gen-rounds N] [--new-tokens N] [--clock wall|cpu]
                                    [--md out.md]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fxrt  # noqa: E402
from fxrt.bench import measure  # noqa: E402

COMPETITORS = ["eager", "aot_eager", "inductor", "fxrt", "inductor+fxrt"]
# Forward only: Inductor + fxrt without fxrt's own CPU ops (fxrt.ops.own_ops), so that the
# runtime's gain is told apart from its kernels'.
ATEN_OPS = "inductor+fxrt[aten]"
FORWARD = [*COMPETITORS, ATEN_OPS]
QUICK_MODELS = ["gpt2", "llama", "bert"]
QUICK_GENERATE = ["gpt2"]


# --- memory -----------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1))


@contextlib.contextmanager
def peak_rss_delta(out: dict[str, float], key: str) -> Iterator[None]:
    """``out[key]``: peak RSS during the block minus RSS before it, in MB (NaN where Linux's
    /proc interface is missing)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = _status_kb("VmRSS")
    except OSError:
        before = None
    yield
    out[key] = float("nan") if before is None else (_status_kb("VmHWM") - before) / 1024


# --- competitors ------------------------------------------------------------------------------


def fresh_method(method: Any, tag: str) -> Any:
    """``method`` (a bound method) with a copy of its function's code object, so that Dynamo keeps
    its compiled code apart. ``generate()`` needs this rather than :func:`fresh_entry`: OPT's
    forward breaks the graph at ``.item()`` under a static cache, and compiling a wrapper around
    the bound forward fails in the resumed frame (``ValueError: too many values to unpack``, with
    ``aot_eager`` too), where compiling the forward itself works."""
    fn = method.__func__
    name = re.sub(r"\W", "_", f"{fn.__name__}_{tag}")
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    return types.MethodType(copy, method.__self__)


def fresh_entry(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn(*args, **kwargs)`` behind a function with a code object of its own (see the module
    docstring)."""
    namespace = {"fn": fn}
    code = "def entry(*args, **kwargs):\n    return fn(*args, **kwargs)\n"
    exec(compile(code, f"<{tag}>", "exec"), namespace)
    return namespace["entry"]


class Timed:
    """A Dynamo backend that calls ``backend`` and adds up the seconds it takes."""

    def __init__(self, backend: Callable[..., Any]):
        self.backend = backend
        self.seconds = 0.0
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.backend(gm, example_inputs, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.graphs += 1


def backend_of(name: str) -> Callable[..., Any]:
    from torch._dynamo.backends.registry import lookup_backend
    from torch._inductor.compile_fx import compile_fx

    if name in ("inductor", "inductor+fxrt", ATEN_OPS):
        return compile_fx
    if name == "fxrt":
        return lambda gm, inputs, **kw: fxrt.backend(gm, inputs, options={"cache": False})
    return lookup_backend(name)


CACHE_ROOT = tempfile.TemporaryDirectory(prefix="fxrt-clients-bench-")


@contextlib.contextmanager
def compiling_as(name: str) -> Iterator[None]:
    """Each Inductor compile gets an empty cache directory and empty in-memory caches, so that no
    competitor reuses the kernels another one compiled (``fresh_cache``); Inductor + fxrt also
    compiles with fxrt's wrapper registered."""
    if name not in ("inductor", "inductor+fxrt", ATEN_OPS):
        yield
        return
    from torch._inductor.utils import fresh_cache

    with fresh_cache(dir=CACHE_ROOT.name, delete=False):
        if name == "inductor":
            yield
            return
        fxrt.register_fx_wrapper(fxrt.CompilerConfig(cache=False, own_ops=name != ATEN_OPS))
        try:
            yield
        finally:
            fxrt.unregister_fx_wrapper()


def compile_competitor(name: str, fn: Callable[..., Any], tag: str) -> tuple[Callable, Timed]:
    """``fn`` compiled by competitor ``name``: a bound method through :func:`fresh_method`,
    anything else through :func:`fresh_entry`."""
    timed = Timed(backend_of(name))
    fresh = fresh_method if isinstance(fn, types.MethodType) else fresh_entry
    compiled = torch.compile(fresh(fn, f"{tag}: {name}"), backend=timed, dynamic=False)
    return compiled, timed


# --- one model --------------------------------------------------------------------------------


def bench_forward(
    name: str, rounds: int, clock: Callable[[], float]
) -> dict[str, dict[str, float]]:
    from clients_child import build, forward_output, input_ids

    model = build(name)
    ids = input_ids(1, 16)
    with torch.no_grad():
        expected = forward_output(model, name, ids)
    out: dict[str, dict[str, float]] = {c: {} for c in FORWARD}
    fns: dict[str, Callable[..., Any]] = {"eager": lambda x: forward_output(model, name, x)}
    for comp in FORWARD[1:]:
        compiled, timed = compile_competitor(comp, model, f"{name} forward")
        fns[comp] = lambda x, c=compiled: forward_output(c, name, x)
        with compiling_as(comp), torch.no_grad(), peak_rss_delta(out[comp], "compile_mb"):
            t0 = time.perf_counter()
            got = fns[comp](ids)
            out[comp]["first_call_s"] = time.perf_counter() - t0
        out[comp]["compile_s"] = timed.seconds
        out[comp]["graphs"] = timed.graphs
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"{name}/{comp}")
    if fxrt.inductor.stats["python_wrapper_fallbacks"]:
        print(f"note: {name}: a graph fell back to Inductor's own wrapper", file=sys.stderr)
    with torch.no_grad():
        times = measure(fns, (ids,), rounds, clock=clock)
    for comp, us in times.items():
        out[comp]["forward_us"] = us
    return out


def bench_generate(
    name: str, rounds: int, new_tokens: int, clock: Callable[[], float]
) -> dict[str, dict[str, float]]:
    from clients_child import build, greedy, input_ids

    model = build(name)
    ids = input_ids(1, 16)
    own_forward = model.forward  # the bound class forward
    expected = greedy(model, ids, new_tokens, cache_implementation="static")
    forwards: dict[str, Callable[..., Any] | None] = {"eager": None}
    out: dict[str, dict[str, float]] = {c: {} for c in COMPETITORS}
    for comp in COMPETITORS[1:]:
        compiled, timed = compile_competitor(comp, own_forward, f"{name} generate")
        forwards[comp] = compiled
        model.forward = compiled
        try:
            with compiling_as(comp):
                got = greedy(model, ids, new_tokens, cache_implementation="static")
        except Exception as e:  # reported in the table as a failure, not timed
            print(f"note: {name}/{comp}: generate failed: {type(e).__name__}: {e}", file=sys.stderr)
            out[comp]["generate_error"] = f"{type(e).__name__}"
            forwards[comp] = None
            continue
        finally:
            del model.forward
        out[comp]["generate_graphs"] = timed.graphs
        if not torch.equal(got, expected):
            print(f"note: {name}/{comp}: generated tokens differ from eager's", file=sys.stderr)
    samples: dict[str, list[float]] = {c: [] for c in COMPETITORS}
    order = [c for c in COMPETITORS if c == "eager" or forwards[c] is not None]
    for _ in range(rounds):
        random.shuffle(order)
        for comp in order:
            if forwards[comp] is not None:
                model.forward = forwards[comp]
            try:
                t0 = clock()
                greedy(model, ids, new_tokens, cache_implementation="static")
                samples[comp].append((clock() - t0) / new_tokens * 1e3)
            finally:
                if forwards[comp] is not None:
                    del model.forward
    for comp, s in samples.items():
        if s:
            out[comp]["generate_ms"] = statistics.median(s)
    return out


# --- report -----------------------------------------------------------------------------------


def _cell(value: float | None, base: float | None = None, fmt: str = "{:.1f}") -> str:
    if value is None:
        return "n/a"
    text = fmt.format(value)
    return f"{text} ({base / value:.2f}x)" if base else text


def markdown(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        "Forward, batch 1 x 16 tokens (µs per call; speedup over eager):",
        "",
        "| model | "
        + " | ".join(FORWARD)
        + " | inductor+fxrt vs inductor | inductor+fxrt[aten] vs inductor |",
        "|" + "---|" * (len(FORWARD) + 3),
    ]
    for model, r in results.items():
        base = r["eager"]["forward_us"]
        cells = [_cell(r[c]["forward_us"], base) for c in FORWARD]
        vs = r["inductor"]["forward_us"] / r["inductor+fxrt"]["forward_us"]
        aten = r["inductor"]["forward_us"] / r[ATEN_OPS]["forward_us"]
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {vs:.2f}x | {aten:.2f}x |")
    gen = {m: r for m, r in results.items() if "generate_ms" in r["eager"]}
    if gen:
        lines += [
            "",
            "generate(), static KV cache (ms per new token; speedup over eager):",
            "",
            "| model | " + " | ".join(COMPETITORS) + " | inductor+fxrt vs inductor |",
            "|" + "---|" * (len(COMPETITORS) + 2),
        ]
        for model, r in gen.items():
            base = r["eager"]["generate_ms"]
            cells = [
                _cell(r[c]["generate_ms"], base, "{:.2f}")
                if "generate_ms" in r[c]
                else f"fails ({r[c].get('generate_error', '?')})"
                for c in COMPETITORS
            ]
            both = all("generate_ms" in r[c] for c in ("inductor", "inductor+fxrt"))
            vs = r["inductor"]["generate_ms"] / r["inductor+fxrt"]["generate_ms"] if both else None
            lines.append(f"| {model} | " + " | ".join(cells) + f" | {_cell(vs, fmt='{:.2f}x')} |")
    compiled = COMPETITORS[1:]
    lines += [
        "",
        "Compile, the forward's graphs, cold (backend seconds / first call seconds / peak ΔRSS of "
        "the first call in MB):",
        "",
        "| model | " + " | ".join(compiled) + " | fxrt / inductor (backend) |",
        "|" + "---|" * (len(compiled) + 2),
    ]
    for model, r in results.items():
        cells = [
            f"{r[c]['compile_s']:.2f} / {r[c]['first_call_s']:.2f} / {r[c]['compile_mb']:.0f}"
            for c in compiled
        ]
        ratio = r["fxrt"]["compile_s"] / r["inductor"]["compile_s"]
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return "\n".join(lines)


def targets(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """The issue's targets, measured: fxrt >= 1.6x eager and Inductor + fxrt >= 1.25x Inductor on
    every forward, fxrt's compile <= 0.25x Inductor's."""
    rows = []
    for model, r in results.items():
        fx = r["eager"]["forward_us"] / r["fxrt"]["forward_us"]
        ind = r["inductor"]["forward_us"] / r["inductor+fxrt"]["forward_us"]
        aten = r["inductor"]["forward_us"] / r[ATEN_OPS]["forward_us"]
        comp = r["fxrt"]["compile_s"] / r["inductor"]["compile_s"]
        rows.append(
            f"{model}: fxrt {fx:.3f}x eager ({'met' if fx >= 1.6 else 'NOT met'}, target 1.6x); "
            f"inductor+fxrt {ind:.3f}x inductor ({'met' if ind >= 1.25 else 'NOT met'}, target "
            f"1.25x; without fxrt's own ops {aten:.3f}x); fxrt compile {comp:.3f}x inductor's "
            f"({'met' if comp <= 0.25 else 'NOT met'}, target 0.25x)"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from clients_child import CLIENTS, DECODERS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"models {','.join(QUICK_MODELS)}")
    p.add_argument("--models", default="", help="comma-separated, e.g. gpt2,bert (default: all)")
    p.add_argument("--rounds", type=int, default=21, help="forward timing rounds (default: 21)")
    p.add_argument("--gen-rounds", type=int, default=7, help="generate() rounds (default: 7)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens per generate (default 16)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="see the docstring")
    p.add_argument("--md", help="also write the tables here")
    args = p.parse_args(argv)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # before compiling: Inductor bakes the thread count into kernels
    torch._inductor.config.fx_graph_cache = False  # cold compiles, and the module is compiled
    torch._functorch.config.enable_autograd_cache = False
    if fxrt.runtime_info()["executor"] != "cpp":
        print("note: fxrt's compiled loop is not available; fxrt runs its Python loop")
    models = args.models.split(",") if args.models else list(CLIENTS)
    generate = [m for m in models if m in DECODERS]
    if args.quick:
        models = [m for m in models if m in QUICK_MODELS] if not args.models else models
        generate = [m for m in generate if m in QUICK_GENERATE] if not args.models else generate
        args.rounds, args.gen_rounds = min(args.rounds, 11), min(args.gen_rounds, 5)

    results: dict[str, dict[str, dict[str, float]]] = {}
    for name in models:
        t0 = time.perf_counter()
        torch._dynamo.reset()
        results[name] = bench_forward(name, args.rounds, clock)
        if name in generate:
            torch._dynamo.reset()
            gen = bench_generate(name, args.gen_rounds, args.new_tokens, clock)
            for comp in COMPETITORS:
                results[name][comp].update(gen[comp])
        print(f"{name}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    table = markdown(results) + "\n\n" + targets(results) + f"\n\n({args.clock} clock)"
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
