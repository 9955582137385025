"""Decoder LLMs: fxrt alone against Inductor and eager, forward and ``generate()``, with the fused
patterns' match counts and what each pattern saves.

Models: tiny random-weight ``transformers`` decoders built from configs (2 layers, hidden 64,
4 query / 2 key-value heads, head size 16; nothing is downloaded): Llama, Qwen2, Mistral and
Gemma, which the patterns were written against, and Qwen3, Phi-3, OLMo-2 and Granite, which they
were not; ``--models more`` runs eight further architectures nobody tuned on either (Gemma-2
with its soft-capped attention written out, Gemma-3, StableLM, GPT-NeoX, Cohere, SmolLM3, GLM,
Mixtral with 4 experts, 2 per token); and the same sizes written as reference code outside
``transformers``
(tests/reference_llama.py, forward only): ``llama-ref``, Meta's Llama (rotary as a complex
product, attention by hand), and ``llama-pairs``, its rotary on real pairs with
``scaled_dot_product_attention`` (gpt-fast's and torchtitan's spellings). One process, one
intra-op thread (``torch.set_num_threads(1)``), ``torch.no_grad()``, static shapes:

  eager       the model as it is
  inductor    ``torch.compile`` with Inductor's defaults
  fxrt        ``torch.compile(backend="fxrt")``, the compiled loop, every pattern on
  fxrt-nopat  the same with ``disable_patterns`` = every pattern (the ATen ops the patterns
              replace), forward only: the patterns' saving, per model and shape

* forward: each (batch, tokens) shape of ``--shapes``; ``measure`` of ``fxrt.bench``
  (interleaved rounds in a shuffled order; each figure the median over rounds of the mean µs per
  call, ``--clock cpu``: the calling thread's CPU time);
* generate: greedy ``generate()`` of ``--new-tokens`` tokens from a 16-token prompt, with the
  dynamic KV cache and with the static one, ``model.forward`` replaced by the competitor's
  compiled forward; rounds interleaved, the figure the median ms per new token;
* compile: seconds of the first forward call (Dynamo + backend), cold caches (fxrt's: the
  median of three fresh compiles, see ``forward``);
* patterns: how many fused calls of each pattern the forward graph holds
  (``fxrt.pattern_counts``), and the µs per layer the patterns save (fxrt-nopat - fxrt, over the
  layers); on the ``--ablate`` shapes also each pattern's own saving (fxrt with that pattern
  off, ``fxrt-no:<pattern>``, minus fxrt);
* memory: the most bytes a steady call holds allocated at once (torch.profiler's allocator
  events), for fxrt plus the arena it keeps between calls; the weights are not counted.

Outputs are checked against eager (logits within 1e-4; generated tokens equal) before timing.

Usage: python benchmarks/llm.py [--models llama,qwen2 | more] [--shapes 1x16,4x128] [--rounds N]
                                [--gen-rounds N] [--new-tokens 16,64] [--no-generate]
                                [--clock wall|cpu] [--dtype float32|bfloat16]

``--dtype bfloat16`` casts the models to bfloat16 (forward only; logits within 3e-2 of eager's).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

import fxrt
from fxrt.bench import measure
from fxrt.patterns import BUILTIN, registered_patterns

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(
    1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)
from clients import fresh_method  # noqa: E402

VOCAB = 128
LAYERS = 2
DTYPE = torch.float32  # --dtype
TUNED = ["llama", "qwen2", "mistral", "gemma"]
UNTUNED = ["qwen3", "phi3", "olmo2", "granite"]
MORE = ["gemma2", "gemma3", "stablelm", "gpt_neox", "cohere", "smollm3", "glm", "mixtral"]
# decoders written as reference code writes them (tests/reference_llama.py), forward only
REFERENCE = ["llama-ref", "llama-pairs"]


def build(name: str) -> Any:
    if name in REFERENCE:
        from reference_llama import Llama

        torch.manual_seed(0)
        if name == "llama-ref":  # Meta's model.py: complex rotary, attention by hand
            return Llama(layers=LAYERS, vocab=VOCAB, max_seq=256).eval().to(DTYPE)
        # real-pair rotary and scaled_dot_product_attention (gpt-fast, torchtitan)
        return (
            Llama(layers=LAYERS, vocab=VOCAB, max_seq=256, rope="pairs", attention="sdpa")
            .eval()
            .to(DTYPE)
        )
    import transformers as hf

    classes = {
        "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
        "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
        "gemma": ("GemmaForCausalLM", "GemmaConfig", {"head_dim": 16}),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16}),
        "phi3": ("Phi3ForCausalLM", "Phi3Config", {}),
        "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {}),
        "granite": ("GraniteForCausalLM", "GraniteConfig", {}),
        # transformers has no SDPA attention for Gemma-2 (its scores are soft-capped)
        "gemma2": (
            "Gemma2ForCausalLM",
            "Gemma2Config",
            {"head_dim": 16, "attn_implementation": "eager"},
        ),
        "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {"head_dim": 16}),
        "stablelm": ("StableLmForCausalLM", "StableLmConfig", {}),
        "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
        "cohere": ("CohereForCausalLM", "CohereConfig", {}),
        "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {}),
        "glm": ("GlmForCausalLM", "GlmConfig", {}),
        "mixtral": (
            "MixtralForCausalLM",
            "MixtralConfig",
            {"num_local_experts": 4, "num_experts_per_tok": 2},
        ),
    }
    model_cls, config_cls, extra = classes[name]
    config = getattr(hf, config_cls)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **({"attn_implementation": "sdpa"} | extra),
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(hf, model_cls)(config).eval().to(DTYPE)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def compiled(model: Any, who: str, dynamic: bool | None = False) -> Any:
    """``model.forward`` compiled for ``who``, with a code object of its own (so Dynamo shares
    nothing between competitors)."""
    if who == "eager":
        return model.forward
    bound = fresh_method(model.forward, f"{who}_{next(_tags)}")
    if who == "inductor":
        return torch.compile(bound, dynamic=dynamic)
    options: dict[str, Any] = {"cache": False}
    if who == "fxrt-nopat":
        options["disable_patterns"] = list(registered_patterns())
    elif who.startswith("fxrt-no:"):
        options["disable_patterns"] = [who.removeprefix("fxrt-no:")]
    return torch.compile(bound, backend="fxrt", dynamic=dynamic, options=options)


_tags = itertools.count()


def logits(out: Any) -> torch.Tensor:
    """A transformers model's logits, or a reference model's output (its logits)."""
    return out if isinstance(out, torch.Tensor) else out.logits


def ids(batch: int, tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 1000 + tokens)
    return torch.randint(0, VOCAB, (batch, tokens), generator=g)


def forward(
    name: str, shapes: list[tuple[int, int]], rounds: int, clock: Any, ablate: set[str]
) -> list[dict]:
    model = build(name)
    rows = []
    for batch, tokens in shapes:
        x = ids(batch, tokens)
        with torch.no_grad():
            expected = logits(model(x))
        fns, compile_s = {}, {}
        who_list = ["eager", "inductor", "fxrt", "fxrt-nopat"]
        if f"{batch}x{tokens}" in ablate:
            who_list += [f"fxrt-no:{p}" for p in BUILTIN]
        for who in who_list:
            torch._dynamo.reset() if who == "eager" else None
            f = compiled(model, who)
            t0 = time.perf_counter()
            with cold(who), torch.no_grad():
                got = logits(f(x))
            compile_s[who] = time.perf_counter() - t0
            tol = 1e-4 if DTYPE is torch.float32 else 3e-2  # bfloat16: a few ulps of the logits
            torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
            fns[who] = f
        # fxrt's first call is under a second, where a full garbage collection during Dynamo's
        # trace (0.2-0.9 s in a process holding many compiled models) is most of the spread:
        # the median of three fresh compiles. Inductor's (4-16 s) is its one cold compile.
        again = []
        for _ in range(2):
            f = compiled(model, "fxrt")
            t0 = time.perf_counter()
            with torch.no_grad():
                f(x)
            again.append(time.perf_counter() - t0)
        compile_s["fxrt"] = statistics.median([compile_s["fxrt"], *again])
        with recording() as built:
            torch._dynamo.reset()
            f = compiled(model, "fxrt")
            with torch.no_grad():
                f(x)
        counts = fxrt.pattern_counts(built[-1]) if built else {}

        def call(f: Any) -> Any:
            def run(t: torch.Tensor) -> Any:
                with torch.no_grad():
                    return f(t)

            return run

        us = measure({k: call(f) for k, f in fns.items()}, (x,), rounds, clock=clock)
        memory = {who: peak_bytes(fns[who], x) for who in ("eager", "inductor", "fxrt")}
        memory["fxrt"] += arena_bytes(built[-1]) if built else 0
        rows.append(
            dict(model=name, shape=f"{batch}x{tokens}", us=us, compile=compile_s, counts=counts,
                 memory=memory)
        )  # fmt: skip
        print(_row(rows[-1]), flush=True)
    return rows


@contextlib.contextmanager
def cold(who: str) -> Iterator[None]:
    """An Inductor compile in an empty cache directory with empty in-memory caches: cold, no
    kernel another compile made is reused."""
    if who != "inductor":
        yield
        return
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        yield


def peak_bytes(f: Any, x: torch.Tensor) -> int:
    """The most bytes a call holds allocated at once (the CPU allocator's events, recorded by
    torch.profiler; the result included, the model's weights not)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        f(x)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            f(x)
    # Every allocation and free, in order (the raw events: the parsed ones fold the allocations
    # made inside an op into that op).
    events = prof.profiler.kineto_results.events()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


def arena_bytes(cg: Any) -> int:
    """The arena fxrt allocates once and keeps between calls (outside a call's allocations)."""
    arena = getattr(cg.program, "arena", None)
    return arena.nbytes if arena is not None else 0


class recording:
    """The CompiledGraphs fxrt builds inside the block."""

    def __enter__(self) -> list:
        from fxrt import compiler

        self.built: list = []
        self.original = compiler.CompiledGraph.__init__
        built, original = self.built, self.original

        def init(cg: Any, *a: Any, **k: Any) -> None:
            original(cg, *a, **k)
            built.append(cg)

        compiler.CompiledGraph.__init__ = init
        return self.built

    def __exit__(self, *exc: Any) -> None:
        from fxrt import compiler

        compiler.CompiledGraph.__init__ = self.original


def _row(r: dict) -> str:
    us = r["us"]
    saved = (us["fxrt-nopat"] - us["fxrt"]) / LAYERS
    counts = " ".join(f"{k}={v}" for k, v in sorted(r["counts"].items())) or "none"
    each = [
        f"{p} {(us[f'fxrt-no:{p}'] - us['fxrt']) / LAYERS:+.1f}"
        for p in BUILTIN
        if f"fxrt-no:{p}" in us and p in r["counts"]
    ]
    mem = r["memory"]
    return (
        f"| {r['model']} | {r['shape']} | {us['eager']:.0f} | {us['inductor']:.0f} | "
        f"{us['fxrt-nopat']:.0f} | {us['fxrt']:.0f} | {us['inductor'] / us['fxrt']:.2f}x | "
        f"{saved:.1f}{' (' + ', '.join(each) + ')' if each else ''} | "
        f"{r['compile']['fxrt']:.1f} / {r['compile']['inductor']:.1f} | "
        f"{mem['fxrt'] / 1024:.0f} / {mem['eager'] / 1024:.0f} | {counts} |"
    )


def generate(name: str, new_tokens: int, rounds: int) -> list[dict]:
    model = build(name)
    prompt = ids(1, 16)
    rows = []
    for cache in ["dynamic", "static"]:
        kw = {} if cache == "dynamic" else {"cache_implementation": "static"}
        dyn = None if cache == "dynamic" else False

        def run(fwd: Any, kw: dict = kw) -> torch.Tensor:
            if fwd is not None:
                model.forward = fwd
            try:
                with torch.no_grad():
                    return model.generate(
                        prompt, attention_mask=torch.ones_like(prompt),
                        max_new_tokens=new_tokens, do_sample=False, **kw,
                    )  # fmt: skip
            finally:
                if fwd is not None:
                    del model.forward

        expected = run(None)
        fwds: dict[str, Any] = {"eager": None}
        torch._dynamo.reset()
        for who in ["inductor", "fxrt"]:
            # the dynamic cache grows every step: torch.compile's default dynamic
            fn = compiled(model, who, dynamic=dyn)
            with cold(who):
                torch.testing.assert_close(run(fn), expected, rtol=0, atol=0)
            fwds[who] = fn
            torch.testing.assert_close(run(fn), expected, rtol=0, atol=0)
        samples: dict[str, list[float]] = {k: [] for k in fwds}
        order = list(fwds)
        for _ in range(rounds):
            random.shuffle(order)
            for who in order:
                t0 = time.perf_counter()
                run(fwds[who])
                samples[who].append((time.perf_counter() - t0) * 1e3 / new_tokens)
        ms = {k: statistics.median(v) for k, v in samples.items()}
        rows.append(dict(model=name, cache=cache, new=new_tokens, ms=ms))
        print(
            f"| {name} | {cache} | {new_tokens} | {ms['eager']:.2f} | {ms['inductor']:.2f} | "
            f"{ms['fxrt']:.2f} | {ms['fxrt'] / ms['inductor']:.2f} |",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(TUNED + UNTUNED + REFERENCE))
    parser.add_argument("--shapes", default="1x16,1x128,4x16,4x128")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--gen-rounds", type=int, default=3)
    parser.add_argument("--new-tokens", default="16,64")
    parser.add_argument("--no-generate", action="store_true")
    parser.add_argument(
        "--ablate", default="1x16", help="shapes (BxL,...) timed with each pattern off in turn"
    )
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32",
        help="the models' dtype (bfloat16: forward only, as a CPU deployment casts them)",
    )  # fmt: skip
    args = parser.parse_args()
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    if DTYPE is not torch.float32:
        args.no_generate = True  # greedy tokens in bfloat16 need not equal eager's
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    models = MORE if args.models == "more" else args.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp  # cold: no kernel of an earlier run
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
        print(f"# forward, {args.dtype}, µs per call (median of {args.rounds} rounds, "
              f"{args.clock} clock)")  # fmt: skip
        print(
            "| model | BxL | eager | inductor | fxrt no patterns | fxrt | inductor/fxrt | "
            "saved µs/layer (per pattern) | compile s fxrt / inductor | peak KiB fxrt / eager | "
            "patterns |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        ablate = set(args.ablate.split(",")) if args.ablate else set()
        rows = [r for m in models for r in forward(m, shapes, args.rounds, clock, ablate)]
        speedups = [r["us"]["inductor"] / r["us"]["fxrt"] for r in rows]
        geo = statistics.geometric_mean(speedups)
        print(f"\ngeomean speed vs inductor: {geo:.2f}x; lowest {min(speedups):.2f}x")
        groups = (
            ("tuned on", TUNED), ("not tuned on", UNTUNED), ("more not tuned on", MORE),
            ("reference code", REFERENCE),
        )  # fmt: skip
        for group, names in groups:
            part = [r["us"]["inductor"] / r["us"]["fxrt"] for r in rows if r["model"] in names]
            if part:
                print(f"  {group}: geomean {statistics.geometric_mean(part):.2f}x, "
                      f"lowest {min(part):.2f}x")  # fmt: skip
        ratio = max(r["compile"]["fxrt"] / r["compile"]["inductor"] for r in rows)
        mem = max(r["memory"]["fxrt"] / max(r["memory"]["eager"], 1) for r in rows)
        print(f"compile time fxrt/inductor: at most {ratio:.2f}; peak bytes fxrt/eager: at most "
              f"{mem:.2f}")  # fmt: skip
        if not args.no_generate:
            print(f"\n# generate(), ms per new token (median of {args.gen_rounds} rounds)")
            print("| model | KV cache | new tokens | eager | inductor | fxrt | fxrt/inductor |")
            print("|---|---|---|---|---|---|---|")
            for m in (m for m in models if m not in REFERENCE):  # generate() is transformers'
                for n in (int(v) for v in args.new_tokens.split(",")):
                    generate(m, n, args.gen_rounds)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
