"""A Llama registered with vLLM whose graph fxrt must run partly in Python: its output is scaled
by a float computed from the token count (a symbolic float expression, which fxrt's loops run as
a Python fallback instruction). Run by ``llm_child.py`` before the engine starts."""

from __future__ import annotations

from vllm import ModelRegistry
from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel

ARCHITECTURE = "ScaledLlamaForCausalLM"


class ScaledLlamaModel(LlamaModel):
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
        tokens = positions.shape[0]
        return hidden * (1.0 + tokens / (tokens + 3.5))


class ScaledLlamaForCausalLM(LlamaForCausalLM):
    def _init_model(self, vllm_config, prefix="", layer_type=None):
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        return ScaledLlamaModel(vllm_config=vllm_config, prefix=prefix, **kwargs)


ModelRegistry.register_model(ARCHITECTURE, ScaledLlamaForCausalLM)
