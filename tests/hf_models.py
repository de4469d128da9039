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


TINY_CORPUS = """def add(a, b):
    return a + b

The quick brown fox jumps over the lazy dog. Speculative decoding keeps the target's law.
for i in range(10):
    print(i * i)
class Stack:
    def push(self, x):
        self.items.append(x)
""" * 20


def write_tiny_tokenizer(out_dir: Path, vocab_size: int = 512) -> list[int]:
    """A byte-level BPE tokenizer trained on a toy corpus, with Qwen3's chat special tokens, so a
    tiny model directory is a complete model directory. Returns the EOS ids it declares."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TINY_CORPUS], trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    (Path(out_dir) / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return eos


def save_drafter_checkpoint(drafter, dcfg, out_dir: Path, target=None) -> None:
    """Write a jspec drafter in DeepSpec's checkpoint layout (safetensors + config.json), with the
    target's embedding / lm_head copies when `target` is given (as DeepSpec saves them)."""
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from jspec.dspark import drafter_checkpoint_shapes
    from jspec.qwen3 import unfuse_projections

    unfuse_projections(drafter)  # an engine may have put it in the serving layout
    params = nnx.to_pure_dict(nnx.state(drafter, nnx.Param))
    tensors = {}
    for key, (shape, path) in drafter_checkpoint_shapes(dcfg).items():
        value = params
        for p in path:
            value = value[p]
        tensors[key] = np.asarray(value, np.float32).reshape(shape)
    if target is not None:
        tensors["embed_tokens.weight"] = np.asarray(target.embed_tokens[...], np.float32)
        tensors["lm_head.weight"] = np.asarray(target.head_weight(), np.float32)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors")
    hf = dcfg.to_hf_dict()
    hf["torch_dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
