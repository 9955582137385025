"""``LoadedModel``: a package loaded by fxrt's C++ runtime, called from Python.

The runtime (``csrc/``, the library the C++ API ships, compiled into the extension as
``fxrt._speedups._runtime``) does the loading and every call: it checks the file's structure and
hashes, looks up every op and compares its schema, validates and binds the stored program, maps
the weights, checks each call's inputs (dtypes, devices, sizes, symbol ranges, derived sizes, int
inputs; errors name the input), runs the program on the compiled loop with the GIL released and
copies mutations back; ``update_weights`` and ``state_dict`` are its own. This face adds what only
Python has:

- the call's structure: ``(args, kwargs)`` flattened as exported (:meth:`Binder.flatten`), the
  constants the export specialized on compared and left out, outputs unflattened to the exported
  tree. A call made as exported (positional leaves, one output, no constants) goes from the
  extension's ``Model.__call__`` to the runtime with no Python frame;
- the package's graph on fxrt's own loops (:mod:`fxrt.deploy.host_loop`), which the runtime's
  ``run_on`` calls in place of its loop (its checks, weights and mutations as always): for every
  call with the Python loop (``pure_python``) or of a package whose program the runtime cannot
  run (a node that runs Python, several streams, no stored program), and for calls under
  ``fxrt.profile``, ``record_function`` callbacks or a ``__torch_function__`` (a mode, a tensor
  subclass), which the runtime does not see; built the first time it is needed, or at load when
  every call needs it. ``graph``, ``program`` and ``compiled`` are its IR.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..config import CompilerConfig
from ..errors import ExecutionError, _with_original_type
from ..exec.inputs import InputError
from ..exec.native import extension_status
from .binder import Binder
from .host_loop import host_graph, manifest_fields
from .package import PackageError
from .signature import Signature, spec_from_json
from .tensorfile import loads_json

_runtime = extension_status().runtime


class Unsupported(PackageError):
    """A valid package that the C++ runtime cannot run itself (fxrt.load runs its graph on
    fxrt's own loops)."""


class RuntimeNotBuilt(RuntimeError):
    """fxrt.load was called where fxrt's C++ extension (its runtime) is not built."""


RUNTIME_OPTIONS = ("pure_python", "arena", "arena_max_idle", "check_inputs")


# fxrt::RunError::Cause -> the Python type the failed op raised, as eager raises it.
_CAUSES = {1: IndexError, 2: ValueError, 3: TypeError, 4: NotImplementedError, 5: MemoryError}


def _run_error(message: str, cause: int) -> BaseException:
    cls = _with_original_type(_CAUSES.get(cause, RuntimeError)) or ExecutionError
    return cls(message)


if _runtime is not None:
    _runtime.set_errors(PackageError, Unsupported, InputError, _run_error)
    _Base: type = _runtime.Model
else:
    _Base = object


class LoadedModel(_Base, metaclass=abc.ABCMeta):  # type: ignore[misc]
    """A loaded package: call it as the exported model was called.

    Attributes:
        path: the file it was loaded from (``<bytes>`` for bytes).
        signature: the calling convention (:class:`fxrt.deploy.signature.Signature`).
        manifest: the package's manifest (parsed on first use).
        compiled, program, graph: its compiled graph, Program and fxrt IR (decoded on first use).
    """

    def __init__(
        self,
        source: Any,
        where: str,
        device: Any,
        verify_weights: bool,
        config: CompilerConfig | None = None,
    ):
        dev = None if device is None else str(device)
        if config is None:  # the package's options
            super().__init__(source, dev, verify_weights, host_executor=True)
        else:
            super().__init__(
                source,
                dev,
                verify_weights,
                config.arena,
                config.arena_max_idle,
                int(config.check_inputs),
                True,
            )
        self.path = where
        self._device = device
        self._config = config
        self._lock = threading.Lock()
        self._host_entry: Any = None
        self._compiled: Any = None
        self._manifest: dict[str, Any] | None = None
        m = manifest_fields(self, ("signature", "runtime_options"))
        self.runtime_options = dict(m["runtime_options"])  # the defaults fxrt.load applies
        sig = Signature.from_json(m["signature"])
        in_spec = spec_from_json(sig.in_spec, "input")
        self._out_spec = spec_from_json(sig.out_spec, "output")
        del m
        users = sig.user_inputs()
        n_user_out = sum(1 for o in sig.outputs if o.kind == "user")
        if in_spec.num_leaves != len(users) or self._out_spec.num_leaves != n_user_out:
            raise PackageError("invalid fxrt package: the tree specs do not match the signature")
        self.signature = sig
        self._binder = Binder(sig, in_spec)
        self._pass = [i for i, s in enumerate(users) if s.kind != "constant"]
        self._all_pass = len(self._pass) == len(users)
        if [(s.name, s.kind == "symint") for s in users if s.kind != "constant"] != [
            (name, is_int) for name, _, is_int in self.inputs
        ]:
            raise PackageError("invalid fxrt package: the signature's inputs are not the program's")
        # Where the call's leaves go among the graph's inputs (the host's executor gets them as
        # they were passed: a tensor subclass stays one).
        self._user_pos = [i for i, s in enumerate(sig.inputs) if s.kind in ("tensor", "symint")]
        self._plain = self._out_spec.is_leaf()
        self._host_only = bool(self.unsupported)

    def _direct(self, config: CompilerConfig) -> None:
        """Calls made as exported go to the runtime with no Python frame (to ``run_on`` with the
        host's loop, when every call takes it: built now, so that a graph it refuses is refused
        at load)."""
        self._host_only = bool(self.unsupported) or config.pure_python
        entry = self._host() if self._host_only else None
        if self._binder.n_args >= 0 and self._all_pass and self._plain:
            self._set_direct(self._binder.n_args, entry)

    # -- calling

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call the direct path does not take: another structure, constants, a tree of outputs,
        the host's loop, or a profiler or ``__torch_function__`` to honour (the host's loop)."""
        leaves = self._binder.flatten(args, kwargs)
        if not self._all_pass:
            self._binder.check_constants(leaves)
            leaves = [leaves[i] for i in self._pass]
        if self._host_only or _runtime.hooks_on(leaves):
            entry = self._host()
            positions = self._user_pos

            def execute(graph_inputs: list[Any]) -> Any:
                for p, leaf in zip(positions, leaves):
                    graph_inputs[p] = leaf
                return entry(graph_inputs)

            out = self.run_on(leaves, execute)
        else:
            out = self.run(leaves)
        return out[0] if self._plain else pytree.tree_unflatten(out, self._out_spec)

    def _host(self) -> Any:
        """The package's graph on fxrt's own loops (:mod:`.host_loop`), built on first use: the
        callable the runtime's ``run_on`` runs in place of its loop."""
        if self._host_entry is None:
            with self._lock:
                if self._host_entry is None:
                    config = self._config or _config(self.runtime_options, {})
                    cg = host_graph(self, self._device, config)
                    weights = [i for i, s in enumerate(self.signature.inputs) if s.kind == "weight"]
                    self._compiled = cg
                    self._host_entry = cg.entry(weights)
        return self._host_entry

    # -- weights

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
    ) -> None:
        """Replace weights by name without recompiling. Calls already running finish on the old
        weights; calls that start afterwards see the new ones.

        Each tensor must have the weight's shape and dtype; one on another device or with other
        strides is copied to the package's. The new tensors are used as they are (not copied
        otherwise), so later in-place changes to them are seen, as with a module's parameters.

        Args:
            state_dict: name -> tensor, as ``model.state_dict()`` gives.
            strict: as ``nn.Module.load_state_dict``: every parameter and persistent buffer must
                be given, and no unknown name.

        Raises:
            ValueError: a shape or dtype that does not match (the message names the tensor), an
                unknown or missing name under ``strict``, or two different tensors for tied names.
            TypeError: a value that is not a tensor.
        """
        names = set(self.state_dict())
        given = {}
        for name, t in state_dict.items():
            if name in names and not isinstance(t, torch.Tensor):
                raise TypeError(f"fxrt: weight '{name}': expected a tensor, got {type(t).__name__}")
            if isinstance(name, str) and isinstance(t, torch.Tensor):
                given[name] = t.detach()
            elif isinstance(name, str):  # unknown: the runtime refuses it under strict, else skips
                given[name] = torch.empty(0)
        with self._lock:
            self._update_weights(given, strict)

    # -- inspection

    @property
    def compiled(self) -> Any:
        """The package's graph as a :class:`fxrt.CompiledGraph` (decoded on first use)."""
        self._host()
        return self._compiled

    @property
    def program(self) -> Any:
        return self.compiled.program

    @property
    def graph(self) -> Any:
        return self.compiled.graph

    @property
    def manifest(self) -> dict[str, Any]:
        """The package's manifest (parsed from its text on first use; the same object after)."""
        if self._manifest is None:
            with self._lock:
                if self._manifest is None:
                    self._manifest = loads_json(self._manifest_json(), "manifest")
        return self._manifest

    @property
    def executor(self) -> str:
        """What runs a call: ``cpp`` (the runtime's loop), or the host's loop's (``python``)."""
        return self.compiled.executor if self._host_only else "cpp"

    def __repr__(self) -> str:
        users = ", ".join(s.name for s in self.signature.user_inputs())
        return (
            f"LoadedModel({self.module_name}({users}) from {self.path}, "
            f"{self.num_instructions} instructions, executor={self.executor!r})"
        )


def _config(stored: dict[str, Any], options: dict[str, Any]) -> CompilerConfig:
    try:
        return CompilerConfig.from_options(None, {**stored, **options, "cache": False})
    except ValueError as e:
        raise PackageError(f"invalid fxrt package: {e}") from None


def load_runtime(
    source: Any, where: str, device: Any, verify_weights: bool, options: dict[str, Any]
) -> LoadedModel:
    """The package on the C++ runtime with fxrt.load's ``options`` over the package's and the
    environment's defaults (see :func:`fxrt.load`)."""
    if _runtime is None:
        raise RuntimeNotBuilt(
            f"fxrt.load runs packages on fxrt's C++ runtime, which is not built here "
            f"({extension_status().reason}); build the extension (make .venv/.fxrt, or pip install "
            "--no-build-isolation -e .)"
        )
    if not isinstance(source, (str, bytes)):
        source = bytes(source)
    try:
        model = LoadedModel(source, where, device, verify_weights)
        config = _config(model.runtime_options, options)
        loaded = {
            "arena": True,
            "arena_max_idle": model.runtime_options.get("arena_max_idle", 2),
            "check_inputs": model.runtime_options.get("check_inputs", True),
        }
        chosen = {k: getattr(config, k) for k in loaded}
        if chosen != loaded:
            del model  # the runtime made its arena pool and checks at load: load again
            model = LoadedModel(source, where, device, verify_weights, config)
        model._config = config
        model._direct(config)
    except (TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
        # what else a hostile manifest provokes in the face's own reading: one clean error
        raise PackageError(f"invalid fxrt package: {type(e).__name__}: {str(e)[:300]}") from e
    return model


__all__ = ["RUNTIME_OPTIONS", "LoadedModel", "RuntimeNotBuilt", "Unsupported", "load_runtime"]
