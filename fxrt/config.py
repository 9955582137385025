"""Compiler configuration: one dataclass, defaults from FXRT_* environment variables, overridden by
``torch.compile(..., mode=..., options={...})``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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


@dataclass
class CompilerConfig:
    """Options of the fxrt compiler.

    Attributes:
        pure_python: run the pure-Python loop instead of the compiled one. Default from
            ``FXRT_PURE_PYTHON`` (off).
        verify: run the IR verifier after conversion and after every pass. Default from
            ``FXRT_VERIFY`` (on).
        mode: the ``torch.compile`` mode. fxrt accepts every mode torch.compile knows; on CPU they
            all run the same program (``reduce-overhead`` is where device-graph capture hooks in).
    """

    pure_python: bool = field(default_factory=lambda: env_flag("FXRT_PURE_PYTHON", False))
    verify: bool = field(default_factory=lambda: env_flag("FXRT_VERIFY", True))
    mode: str = "default"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"fxrt: unknown mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        for f in dataclasses.fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(
                    f"fxrt: option {f.name!r} must be a bool, got {getattr(self, f.name)!r}"
                )

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
        unknown = sorted(k for k in options if k not in valid)
        if unknown:
            raise ValueError(
                f"fxrt: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(valid)}"
            )
        return cls(mode=mode or "default", **options)
