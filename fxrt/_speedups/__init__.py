"""fxrt's compiled loop: a Cython extension in C++ mode (``_loop``), built by setup.py.

Import it through :mod:`fxrt.exec.native`, which checks that it was built against the running
torch and falls back to the Python loop otherwise.

``FXRT_BUILD_EXT=0`` (also false/no/off) in the environment means the extension was left out on
purpose (``FXRT_BUILD_EXT=0 pip install ...``, ``FXRT_BUILD_EXT=0 make test``). When it is set and
there is no extension, this package says so once, as information, on stderr when fxrt first loads
its executor, instead of the warning that asks to build it. A broken or mismatched build still
warns.
"""

from __future__ import annotations

import os
import sys
import warnings
from importlib.machinery import PathFinder

_FALSE = {"0", "false", "no", "off"}


def build_skipped() -> bool:
    """Whether ``FXRT_BUILD_EXT`` says the extension was left out on purpose."""
    return os.environ.get("FXRT_BUILD_EXT", "1").strip().lower() in _FALSE


def built() -> bool:
    """Whether an extension file is there (it may still fail to load)."""
    return PathFinder.find_spec("_loop", __path__) is not None


if build_skipped() and not built():
    warnings.filterwarnings(
        "ignore",
        message=r"fxrt: compiled loop unavailable \(extension not built",
        category=RuntimeWarning,
    )
    print(
        "fxrt: FXRT_BUILD_EXT=0, so fxrt runs compiled graphs on its pure-Python loop",
        file=sys.stderr,
    )
