"""Compiler configuration: one dataclass, defaults from FXRT_* environment variables, overridden by
``torch.compile(..., mode=..., options={...})``."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
STREAM_MODES = ("manual", "auto", "off")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


# The built-in passes (their functions: fxrt.passes.PASSES, which checks it has these names). Named
# here, with the lists each optimization level runs, so that a config is validated without
# importing the passes (a graph loaded from an artifact needs none of them).
PASS_NAMES = (
    "eliminate_dead_code",
    "remove_noops",
    "eliminate_common_subexpressions",
    "fold_constants",
    "fuse_attention",
    "fuse_patterns",
)

# Optimization levels: 0 runs nothing; 1 the cheap clean-ups; 2 (default) adds constant folding,
# attention fusion (after folding, which turns a mask made in forward into a constant) and the
# fused patterns (fxrt.patterns; after attention fusion, whose K/V they may un-repeat).
LEVELS: dict[int, tuple[str, ...]] = {
    0: (),
    1: ("remove_noops", "eliminate_common_subexpressions", "eliminate_dead_code"),
    2: (
        "fold_constants",
        "fuse_attention",
        "fuse_patterns",
        "remove_noops",
        "eliminate_common_subexpressions",
        "eliminate_dead_code",
    ),
}


def _env_number(name: str, default: Any, kind: type, what: str) -> Any:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected {what}") from None


def env_int(name: str, default: int) -> int:
    return _env_number(name, default, int, "an integer")


def env_float(name: str, default: float) -> float:
    return _env_number(name, default, float, "a number")


def env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off"
    )


# Deprecated option name -> its new name, and the environment variables likewise. Each old name
# still works, with one DeprecationWarning per process.
DEPRECATED_OPTIONS = {"native_kernels": "own_ops"}
DEPRECATED_ENV = {"FXRT_NATIVE_KERNELS": "FXRT_OWN_OPS"}
_warned: set[str] = set()


def _deprecated(old: str, new: str, stacklevel: int) -> None:
    if old not in _warned:
        _warned.add(old)
        warnings.warn(
            f"fxrt: {old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel + 1
        )


def _own_ops_default() -> bool:
    if "FXRT_OWN_OPS" not in os.environ:
        for old, new in DEPRECATED_ENV.items():
            if new == "FXRT_OWN_OPS" and old in os.environ:
                _deprecated(f"the environment variable {old}", new, stacklevel=3)
                return env_flag(old, True)
    return env_flag("FXRT_OWN_OPS", True)


def _env_list(name: str) -> list[str]:
    return [p.strip() for p in os.environ.get(name, "").split(",") if p.strip()]


@dataclass
class CompilerConfig:
    """Options of the fxrt compiler.

    Attributes:
        pure_python: run the pure-Python loop instead of the compiled one. Default from
            ``FXRT_PURE_PYTHON`` (off).
        verify: run the IR verifier after conversion and after every pass. Default from
            ``FXRT_VERIFY`` (on).
        opt_level: which built-in passes run: 0 none, 1 remove_noops +
            eliminate_common_subexpressions + eliminate_dead_code, 2 also fold_constants and
            fuse_attention first.
            Default from ``FXRT_OPT_LEVEL`` (2).
        passes: an explicit, ordered list of built-in pass names; overrides ``opt_level``.
        fold_max_bytes: the largest result constant folding may create (16 MiB).
        freeze: fold the graph's constants that are the caller's weights (the parameters and
            buffers of a graph handed to ``compile_graph``), like ``torch.jit.freeze`` and
            Inductor's freezing. The weights must not change afterwards: later updates are not
            seen. Off: weights stay live, and only constants no caller can reach are folded.
        post_grad_custom_pre_pass: ``fn(gm, example_inputs, config)`` run on the ATen-level FX
            graph before the built-in passes (TorchAir's interface); edits ``gm`` in place.
        post_grad_custom_post_pass: the same, after the built-in passes.
        dump_dir: write each compiled graph's stages here. Default from ``FXRT_DUMP_DIR``.
        arena: write intermediates into a preallocated arena, reused from call to call, through
            their ops' ``out=`` overloads (see :mod:`fxrt.exec.arena`). Default from
            ``FXRT_ARENA`` (on).
        arena_max_idle: how many arenas a compiled graph keeps between calls, per inference
            mode (each concurrent call needs its own; more are freed when their calls return).
            Default from ``FXRT_ARENA_MAX_IDLE`` (2). ``CompiledGraph.release_memory()`` frees
            them all.
        arena_headroom: how far the arena may raise a call's peak memory above the lifetime
            plan's own, as a fraction of it (the arena is held for the whole call): beyond
            that (and past one page, 4 KiB), results leave the arena while that lowers the
            peak. ``float("inf")`` keeps every slot. Default from ``FXRT_ARENA_HEADROOM``
            (0.125).
        own_ops: use fxrt's own CPU ops where ATen's kernel choice costs more host time than
            the math (``aten::gelu`` on small float32 tensors; see :mod:`fxrt.ops.own_ops`), and
            the compiled loop's own loops for small float32 add, sub, mul and relu
            (:mod:`fxrt.exec.elementwise`).
            Default from ``FXRT_OWN_OPS`` (on). ``native_kernels`` and ``FXRT_NATIVE_KERNELS``
            are its deprecated old names.
        disable_patterns: names of fused patterns (:mod:`fxrt.patterns`) not to apply, built-in
            (``layer_norm``, ``add_rms_norm``, ``rms_norm``, ``rotary``, ``rotary_complex``,
            ``gated_mlp``, ``gqa_attention``, ``gqa_softcap_attention``) or registered. Default
            from ``FXRT_DISABLE_PATTERNS`` (comma-separated; none). All of them: leave
            ``fuse_patterns`` out of ``passes``, or ``opt_level=1``.
        check_inputs: check every call's inputs against what the graph was compiled for (dtype,
            device, rank, static sizes and strides, size symbols bound consistently) and raise
            ``fxrt.InputError`` naming the input otherwise. Default from ``FXRT_CHECK_INPUTS``
            (on); off for callers that guarantee their inputs.
        cache: use the on-disk compile cache. Default from ``FXRT_CACHE`` (on).
        cache_dir: where the cache lives. Default from ``FXRT_CACHE_DIR``, else
            ``$XDG_CACHE_HOME/fxrt`` or ``~/.cache/fxrt``. A directory that cannot be created
            or written gives one warning, and graphs are compiled without the cache.
        cache_max_bytes: the most bytes the cache directory may hold; least-recently-used
            entries are evicted past it. Default from ``FXRT_CACHE_MAX_BYTES`` (1 GiB).
        streams: ``"manual"`` (default): the graph's own stream scopes (``fxrt.stream_scope``,
            ``fxrt::scope_enter``/``air::scope_enter`` from a user pass) run on their streams;
            ``"auto"``: also put independent branches on streams of their own where a cost
            estimate says they pay for the hand-off (:mod:`fxrt.passes.assign_streams`);
            ``"off"``: every op runs on the caller's stream (the stream ops are removed).
        max_streams: the most streams ``"auto"`` uses, the caller's included (2).
        strict_streams: a cross-stream use without a record/wait ordering it is an error naming
            both nodes, instead of fxrt inserting the pair (and logging it on ``fxrt.streams``).
        capture: whole-graph capture (:mod:`fxrt.exec.capture`): on a device with graph
            support (CUDA graphs, Ascend NPUGraph), each input signature's Program is captured
            into a device graph after ``capture_warmup`` plain calls and replayed with one host
            call from then on. Default: on for ``mode="reduce-overhead"``, else off. On the CPU
            it is accepted and the loop runs.
        capture_warmup: plain calls of a signature before it is captured (1).
        capture_limit: the most input signatures a graph captures (64); past it the graph runs
            the loop from then on (one log line). Also bounds one signature's recaptures.
        clone_input: copy tensor inputs into static buffers before each replay (on). Parameters,
            inputs the graph writes (a KV cache) and inputs whose address did not change over
            the warmup calls are read where they lie instead; if such an input's address
            changes, the signature is captured again. Off: no input is copied, and every address
            change recaptures.
        clone_output: return new tensors from each replay (on). Off: the outputs are the
            graph pool's memory, overwritten by the next call of any graph that shares the pool
            (every signature of one compiled graph shares it).
        use_graph_pool: a pool handle (``torch.cuda.graph_pool_handle()`` or the device's
            equivalent) that the captures use, to share memory across compiled graphs. Default:
            one pool per compiled graph.
        force_eager: with capture on, never capture (run the loop; the report says so).
        inductor_host_graph: the graph is Inductor's FX host graph (Inductor + fxrt sets it): the
            pipeline starts with its rewrites (:mod:`fxrt.passes.host_graph`).
        mode: the ``torch.compile`` mode. fxrt accepts every mode torch.compile knows;
            ``"reduce-overhead"`` turns ``capture`` on, and every other mode compiles and runs
            exactly what ``"default"`` does.
    """

    pure_python: bool = field(default_factory=lambda: env_flag("FXRT_PURE_PYTHON", False))
    verify: bool = field(default_factory=lambda: env_flag("FXRT_VERIFY", True))
    opt_level: int = field(default_factory=lambda: env_int("FXRT_OPT_LEVEL", 2))
    passes: list[str] | None = None
    fold_max_bytes: int = 16 * 1024 * 1024
    freeze: bool = False
    post_grad_custom_pre_pass: Callable[..., Any] | None = None
    post_grad_custom_post_pass: Callable[..., Any] | None = None
    dump_dir: str | None = field(default_factory=lambda: os.environ.get("FXRT_DUMP_DIR") or None)
    arena: bool = field(default_factory=lambda: env_flag("FXRT_ARENA", True))
    arena_max_idle: int = field(default_factory=lambda: env_int("FXRT_ARENA_MAX_IDLE", 2))
    arena_headroom: float = field(default_factory=lambda: env_float("FXRT_ARENA_HEADROOM", 0.125))
    own_ops: bool = field(default_factory=_own_ops_default)
    disable_patterns: list[str] = field(default_factory=lambda: _env_list("FXRT_DISABLE_PATTERNS"))
    check_inputs: bool = field(default_factory=lambda: env_flag("FXRT_CHECK_INPUTS", True))
    cache: bool = field(default_factory=lambda: env_flag("FXRT_CACHE", True))
    cache_dir: str | None = field(default_factory=lambda: os.environ.get("FXRT_CACHE_DIR") or None)
    cache_max_bytes: int = field(default_factory=lambda: env_int("FXRT_CACHE_MAX_BYTES", 1 << 30))
    streams: str = "manual"
    max_streams: int = 2
    strict_streams: bool = False
    capture: bool | None = None
    capture_warmup: int = 1
    capture_limit: int = 64
    clone_input: bool = True
    clone_output: bool = True
    use_graph_pool: Any = None
    force_eager: bool = False
    mode: str = "default"
    inductor_host_graph: bool = False
    native_kernels: InitVar[bool | None] = None  # deprecated: own_ops

    def __post_init__(self, native_kernels: bool | None) -> None:
        if native_kernels is not None:
            _deprecated("the option native_kernels", "own_ops", stacklevel=3)
            self.own_ops = native_kernels
        if self.mode not in MODES:
            raise ValueError(f"fxrt: unknown mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(v, bool):
                raise ValueError(f"fxrt: option {f.name!r} must be a bool, got {v!r}")
            if f.type in ("int", int) and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"fxrt: option {f.name!r} must be an int, got {v!r}")
            if f.name.endswith("_pass") and v is not None and not callable(v):
                raise ValueError(f"fxrt: option {f.name!r} must be callable, got {v!r}")
        if self.streams not in STREAM_MODES:
            raise ValueError(
                f"fxrt: option 'streams' must be one of {', '.join(STREAM_MODES)}, "
                f"got {self.streams!r}"
            )
        headroom = self.arena_headroom
        if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not headroom >= 0:
            raise ValueError(
                f"fxrt: arena_headroom must be a number >= 0 (float('inf'): no limit), "
                f"got {headroom!r}"
            )
        if self.max_streams < 1:
            raise ValueError(f"fxrt: max_streams must be at least 1, got {self.max_streams}")
        if self.capture is not None and not isinstance(self.capture, bool):
            raise ValueError(f"fxrt: option 'capture' must be a bool or None, got {self.capture!r}")
        if self.capture_warmup < 0:
            raise ValueError(f"fxrt: capture_warmup must be >= 0, got {self.capture_warmup}")
        if self.capture_limit < 1:
            raise ValueError(f"fxrt: capture_limit must be >= 1, got {self.capture_limit}")
        if self.opt_level not in LEVELS:
            raise ValueError(
                f"fxrt: opt_level must be one of {sorted(LEVELS)}, got {self.opt_level!r}"
            )
        if self.passes is not None:
            unknown = [p for p in self.passes if p not in PASS_NAMES]
            if isinstance(self.passes, str) or unknown:
                raise ValueError(
                    f"fxrt: unknown pass(es) {unknown or self.passes!r}; "
                    f"valid passes: {', '.join(PASS_NAMES)}"
                )

        if isinstance(self.disable_patterns, str) or not all(
            isinstance(p, str) for p in self.disable_patterns
        ):
            raise ValueError(
                "fxrt: option 'disable_patterns' must be a list of pattern names, got "
                f"{self.disable_patterns!r}"
            )
        self.disable_patterns = sorted(set(self.disable_patterns))
        if self.disable_patterns:
            self._check_pattern_names()

    @property
    def capture_enabled(self) -> bool:
        """Whether whole-graph capture is on (``capture``, else the mode)."""
        return self.capture if self.capture is not None else self.mode == "reduce-overhead"

    def _check_pattern_names(self) -> None:
        from .patterns import registered_patterns  # only when some are named: a load needs none

        unknown = sorted(set(self.disable_patterns) - set(registered_patterns()))
        if unknown:
            raise ValueError(
                f"fxrt: unknown pattern(s) {', '.join(map(repr, unknown))} in disable_patterns; "
                f"registered patterns: {', '.join(registered_patterns())}"
            )

    def pass_names(self) -> tuple[str, ...]:
        """The built-in passes to run, in order."""
        return tuple(self.passes) if self.passes is not None else LEVELS[self.opt_level]

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "mode"]

    @classmethod
    def from_options(
        cls, mode: str | None = None, options: Mapping[str, Any] | None = None
    ) -> CompilerConfig:
        """Build a config from torch.compile's ``mode`` and ``options``.

        Raises:
            ValueError: an option key is unknown (the message lists the valid keys), or a value
                has the wrong type, or the mode is unknown.
        """
        options = dict(options or {})
        valid = cls.option_names()
        unknown = sorted(k for k in options if k not in valid and k not in DEPRECATED_OPTIONS)
        if unknown:
            raise ValueError(
                f"fxrt: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(valid)}"
            )
        return cls(mode=mode or "default", **options)


def _native_kernels(self: CompilerConfig) -> bool:
    _deprecated("CompilerConfig.native_kernels", "own_ops", stacklevel=2)
    return self.own_ops


# Reading the deprecated name still works (set after the class is made: the dataclass's
# ``__init__`` already holds the InitVar's default).
CompilerConfig.native_kernels = property(_native_kernels)  # type: ignore[assignment]
