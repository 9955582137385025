"""``LoadedModel``: a package loaded by fxrt's C++ runtime, called from Python.

The runtime (``csrc/``, the library the C++ API ships, compiled into the extension as
``fxrt._speedups._runtime``) does the loading and every call: it checks the file's structure and
hashes, looks up every op and compares its schema, validates and binds the stored program, maps
the weights, checks each call's inputs (dtypes, devices, sizes, symbol ranges, derived sizes, int
inputs; errors name the input) and runs the program on the compiled loop with the GIL released;
``update_weights`` and ``state_dict`` are its own. This face adds what only Python has:

- the call's structure: ``(args, kwargs)`` flattened as exported (:meth:`Binder.flatten`), the
  constants the export specialized on compared and left out, outputs unflattened to the exported
  tree. A call made as exported (positional leaves, one output, no constants) goes from the
  extension's ``Model.__call__`` to the runtime with no Python frame;
- the Python loop (:mod:`fxrt.deploy.python_loader`), built from the same package the first
  time it is needed: for calls under ``fxrt.profile``, ``record_function`` callbacks or a
  ``__torch_function__`` (a mode, a tensor subclass), which the runtime does not see; and for
  ``graph``, ``program`` and ``compiled``, the IR a user inspects. It shares the runtime's weight
  tensors.

:func:`load_runtime` is what :func:`fxrt.load` calls first; it returns None where the runtime
cannot run the package (no stored program, several streams, a node that runs Python) and the
Python loader runs it.
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
from .package import PackageError
from .python_loader import load_python
from .signature import Signature, spec_from_json
from .tensorfile import loads_json

_runtime = extension_status().runtime


class Unsupported(PackageError):
    """A valid package that the C++ runtime cannot run (the Python loader runs it)."""


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
        keep: Any,
        options: dict[str, Any] | None = None,
    ):
        options = dict(options or {})
        dev = None if device is None else str(device)
        super().__init__(
            source,
            dev,
            verify_weights,
            options.get("arena", True),
            options.get("arena_max_idle", -1),
        )
        self.path = where
        self._keep = keep  # the package, for the Python loader when it is needed
        self._options = options
        self._device = device
        self._lock = threading.Lock()
        self._python_model: Any = None
        self._manifest: dict[str, Any] | None = None
        # The fields the face reads, each parsed from its own text (the runtime keeps the file);
        # the whole manifest (most of it the graph) only where a key is written with escapes.
        texts = {k: self._manifest_field(k) for k in ("signature", "runtime_options")}
        if all(texts.values()):
            m = {k: loads_json(t, k) for k, t in texts.items()}
        else:
            m = loads_json(self._manifest_json(), "manifest")
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
        self._binder = Binder(sig, in_spec, None if device is None else self._target())
        self._pass = [i for i, s in enumerate(users) if s.kind != "constant"]
        self._all_pass = len(self._pass) == len(users)
        if [(s.name, s.kind == "symint") for s in users if s.kind != "constant"] != [
            (name, is_int) for name, _, is_int in self.inputs
        ]:
            raise PackageError("invalid fxrt package: the signature's inputs are not the program's")
        self._plain = self._out_spec.is_leaf()
        if self._binder.n_args >= 0 and self._all_pass and self._plain:
            self._set_direct(self._binder.n_args)

    def _target(self) -> torch.device:
        return torch.empty(0, device=self._device).device

    # -- calling

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call the direct path does not take: another structure, constants, a tree of outputs,
        or a profiler or ``__torch_function__`` to honour (the Python loop's)."""
        leaves = self._binder.flatten(args, kwargs)
        if _runtime.hooks_on(leaves):
            return self._python()._call(args, kwargs)
        if not self._all_pass:
            self._binder.check_constants(leaves)
            leaves = [leaves[i] for i in self._pass]
        out = self.run(leaves)
        return out[0] if self._plain else pytree.tree_unflatten(out, self._out_spec)

    def _python(self) -> Any:
        """The package on the Python loader, sharing the runtime's current weights."""
        if self._python_model is None:
            with self._lock:
                if self._python_model is None:
                    py = load_python(
                        self._keep, self._device, options=self._options, verify_weights=False
                    )
                    py.update_weights(self.state_dict(), strict=False)
                    self._python_model = py
        return self._python_model

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
            if self._python_model is not None:
                self._python_model.update_weights(self.state_dict(), strict=False)

    # -- inspection

    @property
    def compiled(self) -> Any:
        return self._python().compiled

    @property
    def program(self) -> Any:
        return self._python().program

    @property
    def graph(self) -> Any:
        return self._python().graph

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
        return "cpp"

    def __repr__(self) -> str:
        users = ", ".join(s.name for s in self.signature.user_inputs())
        return (
            f"LoadedModel({self.module_name}({users}) from {self.path}, "
            f"{self.num_instructions} instructions, executor='cpp')"
        )


def load_runtime(
    source: Any, where: str, device: Any, verify_weights: bool, options: dict[str, Any]
) -> LoadedModel | None:
    """The package on the C++ runtime with fxrt.load's ``options`` (over the package's and the
    environment's defaults), or None where there is none (no extension), the options ask for what
    only the Python loader does (``pure_python``; ``check_inputs`` or an ``arena`` other than the
    stored program's: the program lowered again), or the runtime cannot run the package
    (:class:`Unsupported`)."""
    if _runtime is None or options.get("pure_python") or "check_inputs" in options:
        return None
    keep = source if isinstance(source, (str, bytes)) else bytes(source)
    try:
        model = LoadedModel(keep, where, device, verify_weights, keep)
    except Unsupported:
        return None
    except (TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
        # what else a hostile manifest provokes in the face's own reading: one clean error
        raise PackageError(f"invalid fxrt package: {type(e).__name__}: {str(e)[:300]}") from e
    stored = model.runtime_options
    config = CompilerConfig.from_options(None, {**stored, **options, "cache": False})
    stored_arena = CompilerConfig.from_options(None, {**stored, "cache": False}).arena
    if config.pure_python or config.check_inputs is not stored.get("check_inputs", True):
        return None
    if config.arena and not stored_arena:
        return None  # the stored program has no arena: lowering again makes one
    chosen = {"arena": config.arena, "arena_max_idle": config.arena_max_idle}
    if chosen != {"arena": True, "arena_max_idle": stored.get("arena_max_idle", 2)}:
        del model  # the runtime made its arena pool at load: load again with these
        model = LoadedModel(keep, where, device, verify_weights, keep, chosen)
    return model


__all__ = ["LoadedModel", "Unsupported", "load_runtime"]
