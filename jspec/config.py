"""Qwen3 model configuration: a frozen dataclass built from a Hugging Face config.json.

Only what jspec computes is representable. A config.json asking for something jspec does not
implement (rope scaling, sliding windows, attention biases, ...) is refused with an error that
names the field, rather than silently computing a different model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# Steps (stock) or speculative iterations per device dispatch (EngineConfig.decode_steps) that
# the API and the bench default to. Every dispatch costs host time (state in, tokens out, the
# jitted call). On the H200 one speculative iteration takes 7.0 ms inside a 16-iteration dispatch
# (scripts/bench_steps.py), but the bench at 2 per dispatch got 11.6 ms per iteration: about 9 ms
# per dispatch, inferred (docs/benchmarks.md). 8 iterations (up to 64 tokens) amortise it about as
# stock's 16 steps do; a finished lane idles at most the rest of its dispatch.
STOCK_DECODE_STEPS = 16
SPEC_DECODE_STEPS = 8


class ConfigError(ValueError):
    """A config.json that jspec cannot serve faithfully."""


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    dtype: str = "bfloat16"  # weights and activations; norms and softmax run in fp32

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name!r} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ConfigError(f"config field 'dtype' = {self.dtype!r} is not supported "
                              "(bfloat16, float16 or float32)")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "Qwen3Config":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face interop -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], dtype: str | None = None) -> "Qwen3Config":
        _check_supported(hf)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in hf:
                raise ConfigError(f"config.json lacks the required field {key!r}")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10_000.0))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 40960),
            dtype=dtype or _hf_dtype(hf),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | None = None) -> "Qwen3Config":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir} has no config.json: not a model directory")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(hf, dtype=dtype)

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_scaling": None,
            "use_sliding_window": False,
            "torch_dtype": self.dtype,
        }


def _hf_dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    return {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)


def _check_supported(hf: dict[str, Any]) -> None:
    """Refuse every config.json feature jspec does not compute, naming the field."""

    def refuse(field, why):
        raise ConfigError(f"config.json field {field!r} = {hf.get(field)!r} is not supported: {why}")

    model_type = hf.get("model_type", "qwen3")
    if model_type != "qwen3":
        refuse("model_type", "jspec serves Qwen3 (dense) models only")
    if hf.get("rope_scaling"):
        refuse("rope_scaling", "only plain RoPE is implemented")
    rope = hf.get("rope_parameters")
    if rope and rope.get("rope_type", "default") != "default":
        refuse("rope_parameters", "only plain RoPE (rope_type 'default') is implemented")
    if hf.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention is not implemented")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        refuse("layer_types", "only full attention layers are implemented")
    if hf.get("attention_bias"):
        refuse("attention_bias", "Qwen3 has no attention biases")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "Qwen3's MLP is SwiGLU with silu")
    if hf.get("attention_dropout", 0.0):
        refuse("attention_dropout", "inference only")
    quant = hf.get("quantization_config")
    if quant:
        refuse("quantization_config", "quantized checkpoints are not supported yet")


# ---- Presets: the published Qwen3 dense shapes, and tiny shapes for tests -----------------

_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=40960)

PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": Qwen3Config(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                              num_kv_heads=8, tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-1.7b": Qwen3Config(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                              num_kv_heads=8, tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-4b": Qwen3Config(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                            num_kv_heads=8, tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-8b": Qwen3Config(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                            num_kv_heads=8, tie_word_embeddings=False, **_QWEN3_COMMON),
    # Tiny shapes for CPU tests: tied like 0.6B, untied like 8B.
    "tiny-tied": Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                             num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                             max_position_embeddings=2048, dtype="float32"),
    "tiny-untied": Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=6,
                               num_heads=8, num_kv_heads=2, head_dim=16, tie_word_embeddings=False,
                               max_position_embeddings=2048, dtype="float32"),
}
