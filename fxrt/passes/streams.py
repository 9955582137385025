"""Deprecated name of :mod:`fxrt.passes.synchronize_streams` (the pass that orders streams); the
stream facts are :mod:`fxrt.analysis.streams`."""

from __future__ import annotations

import warnings

from .synchronize_streams import *  # noqa: F403
from .synchronize_streams import __all__  # noqa: F401

warnings.warn(
    "fxrt.passes.streams is now fxrt.passes.synchronize_streams",
    DeprecationWarning,
    stacklevel=2,
)
