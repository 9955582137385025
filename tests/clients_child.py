"""Tiny random-weight HuggingFace models for the client tier, and its child process.

The test module imports the model zoo from here. Run as a script, this compiles each named model's
forward with fxrt (static shapes, the ones fxrt caches), checks it against eager, does the same for
a short greedy generate with a static KV cache on the decoder-only models, and prints one JSON line:
``fxrt.cache.stats`` plus the loops that ran. The loop comes from ``FXRT_PURE_PYTHON`` and the cache
from ``FXRT_CACHE_DIR``; any mismatch raises, so the exit status says whether it all matched.

    python tests/clients_child.py --models gpt2,bert --new-tokens 4
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers as hf

import fxrt

VOCAB = 128
NEW_TOKENS = 16


@dataclass(frozen=True)
class Client:
    build: Callable[[str], torch.nn.Module]  # attn_implementation -> model
    decoder: bool  # decoder-only: has generate() with a KV cache
    output: str  # the output field compared with eager


def _causal_lm(model_cls: type, config_cls: type, **config: Any) -> Callable[[str], Any]:
    """A decoder-only LM: 2 layers, hidden 64, 4 query / 2 key-value heads."""
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return lambda attn: model_cls(
        config_cls(
            vocab_size=VOCAB,
            max_position_embeddings=64,
            attn_implementation=attn,
            **sizes,
            **heads,
            **ids,
            **config,
        )
    )


def _gpt2(attn: str) -> Any:
    config = hf.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=2,
        bos_token_id=None, eos_token_id=None, attn_implementation=attn,
    )  # fmt: skip
    return hf.GPT2LMHeadModel(config)


def _opt(attn: str) -> Any:
    config = hf.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, word_embed_proj_dim=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation=attn,
    )  # fmt: skip
    return hf.OPTForCausalLM(config)


def _bert(attn: str) -> Any:
    config = hf.BertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=64, attn_implementation=attn,
    )  # fmt: skip
    return hf.BertModel(config)


def _t5_encoder(attn: str) -> Any:
    config = hf.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
        attn_implementation=attn,
    )  # fmt: skip
    return hf.T5EncoderModel(config)


CLIENTS: dict[str, Client] = {
    "gpt2": Client(_gpt2, True, "logits"),
    "llama": Client(_causal_lm(hf.LlamaForCausalLM, hf.LlamaConfig), True, "logits"),
    "qwen2": Client(_causal_lm(hf.Qwen2ForCausalLM, hf.Qwen2Config), True, "logits"),
    "mistral": Client(
        _causal_lm(hf.MistralForCausalLM, hf.MistralConfig, sliding_window=None), True, "logits"
    ),
    "gemma": Client(_causal_lm(hf.GemmaForCausalLM, hf.GemmaConfig, head_dim=16), True, "logits"),
    # transformers soft-caps Gemma-2's attention scores in its eager attention only
    "gemma2": Client(
        lambda attn: _causal_lm(hf.Gemma2ForCausalLM, hf.Gemma2Config, head_dim=16)("eager"),
        True,
        "logits",
    ),
    # per-head q and k norms after the heads' transpose; local and global rotary tables
    "gemma3": Client(
        _causal_lm(hf.Gemma3ForCausalLM, hf.Gemma3TextConfig, head_dim=16), True, "logits"
    ),
    # LayerNorm written out in ATen ops, widened to float32 (CohereLayerNorm)
    "cohere": Client(_causal_lm(hf.CohereForCausalLM, hf.CohereConfig), True, "logits"),
    "bert": Client(_bert, False, "last_hidden_state"),
    "t5_encoder": Client(_t5_encoder, False, "last_hidden_state"),
    "opt": Client(_opt, True, "logits"),
}
DECODERS = [name for name, c in CLIENTS.items() if c.decoder]


def build(name: str, attn: str = "sdpa") -> Any:
    """``name``'s model with fixed random weights, in eval mode; generate never stops early."""
    torch.manual_seed(0)
    model = CLIENTS[name].build(attn).eval()
    if CLIENTS[name].decoder:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = None
    return model


def input_ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(batch))


def forward_output(model: Any, name: str, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return getattr(model(ids), CLIENTS[name].output)


def greedy(model: Any, ids: torch.Tensor, new_tokens: int = NEW_TOKENS, **kw: Any) -> torch.Tensor:
    """Greedy generate of exactly ``new_tokens`` tokens (no EOS in play)."""
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **kw
        )
    assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens), out.shape
    return out


def compiled_forward(model: Any) -> Any:
    """``model.forward`` compiled by fxrt, static shapes; the loop is FXRT_PURE_PYTHON's."""
    return torch.compile(model.forward, backend="fxrt", dynamic=False)


def check(name: str, new_tokens: int) -> None:
    model = build(name)
    ids = input_ids(2, 5)
    expected = forward_output(model, name, ids)
    compiled = torch.compile(model, backend="fxrt", dynamic=False)
    torch.testing.assert_close(forward_output(compiled, name, ids), expected)
    if CLIENTS[name].decoder:
        expected = greedy(model, ids, new_tokens, cache_implementation="static")
        model.forward = compiled_forward(model)
        got = greedy(model, ids, new_tokens, cache_implementation="static")
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def main() -> None:
    from conftest import recording_compiles

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CLIENTS))
    parser.add_argument("--new-tokens", type=int, default=4)
    args = parser.parse_args()
    with recording_compiles() as built:
        for name in args.models.split(","):
            print(f"clients_child: {name}", file=sys.stderr, flush=True)
            torch._dynamo.reset()
            check(name, args.new_tokens)
    executors = sorted({cg.executor for cg in built})
    patterns = [fxrt.pattern_counts(cg) for cg in built]  # per graph, in the order they came
    print(
        json.dumps(
            {**fxrt.cache.stats, "executors": executors, "graphs": len(built), "patterns": patterns}
        )
    )


if __name__ == "__main__":
    main()
