"""fxrt's vLLM platform: vLLM's CPU platform with fxrt as its piecewise compiler.

vLLM takes a ``CompilerInterface`` for piecewise compilation (VLLM_COMPILE) only from the
platform's :meth:`get_compile_backend`, and its CPU platform turns VLLM_COMPILE into
DYNAMO_TRACE_ONCE with Inductor. This subclass keeps VLLM_COMPILE, with
:class:`fxrt.vllm.compiler.FxrtCompiler`, and changes three CPU defaults that piecewise
compilation trips over on vLLM 0.32 (each noted where it is set). Everything else is vLLM's.
"""

from __future__ import annotations

import os

from vllm.logger import logger as log
from vllm.platforms.cpu import CpuPlatform

COMPILER = "fxrt.vllm.compiler.FxrtCompiler"


class FxrtCpuPlatform(CpuPlatform):
    """vLLM's CPU platform, compiling with fxrt (see the module docstring)."""

    @classmethod
    def get_compile_backend(cls) -> str:
        return COMPILER

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode

        cc = vllm_config.compilation_config
        if cc.mode == CompilationMode.STOCK_TORCH_COMPILE:
            # vLLM's CPU model runner never calls torch.compile in this mode.
            log.warning(
                "fxrt: vLLM's CPU model runner does not compile in STOCK_TORCH_COMPILE mode "
                "(mode 1): the model runs uncompiled. Use mode 3 (VLLM_COMPILE, vLLM's default) "
                "for fxrt's piecewise compile, or mode 2 with backend='fxrt' for the whole graph."
            )
        piecewise = cc.mode == CompilationMode.VLLM_COMPILE and cc.backend in ("", COMPILER)
        super().check_and_update_config(vllm_config)  # turns VLLM_COMPILE into Inductor's mode 2
        if not piecewise or vllm_config.lora_config is not None:  # LoRA: vLLM compiles nothing
            return
        cc.mode = CompilationMode.VLLM_COMPILE
        cc.backend = COMPILER
        # vLLM's quantization fusions are on by default, and their passes are imported only on
        # CUDA and XPU (a NameError on the CPU); fxrt fuses the norms and activations itself.
        cc.pass_config.fuse_norm_quant = False
        cc.pass_config.fuse_act_quant = False
        # The CPU platform never sets the sizes to compile for; piecewise needs the list.
        if cc.compile_sizes is None:
            cc.compile_sizes = []
        # vLLM's "mega" AOT artifact holds Inductor's outputs only; fxrt's handles go through
        # vLLM's per-piece cache instead.
        os.environ["VLLM_USE_MEGA_AOT_ARTIFACT"] = "0"
        log.info("fxrt: vLLM compiles piecewise with fxrt (VLLM_COMPILE, %s)", COMPILER)
