"""Random tiny Qwen3 checkpoints built with transformers (the oracle), saved as safetensors."""

from __future__ import annotations

import json
from pathlib import Path

from jspec.config import Qwen3Config


def make_hf_qwen3(cfg: Qwen3Config, out_dir: Path, seed: int = 0, std: float = 0.1):
    """Build a random transformers Qwen3ForCausalLM (fp32, CPU) for `cfg` and save it to out_dir.

    Weights are drawn wider than the default init (std 0.1) so that layers actually change the
    residual stream and mistakes in any block show up in the logits. Norm weights are random too,
    so a swapped or missing norm is visible."""
    import torch
    from transformers import Qwen3Config as HFConfig, Qwen3ForCausalLM

    torch.manual_seed(seed)
    hf_cfg_dict = cfg.to_hf_dict()
    hf_cfg_dict.pop("architectures")
    hf_cfg_dict.pop("model_type")
    hf_cfg_dict["torch_dtype"] = "float32"
    hf_cfg = HFConfig(**hf_cfg_dict)
    hf_cfg._attn_implementation = "eager"
    model = Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return model
