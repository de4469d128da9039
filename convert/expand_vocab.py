"""Expand a compact-vocabulary model (the stand-in's storage form) into a standard Hugging Face
directory with the full vocabulary, keeping every other shape.

A compact target S has `vocab_size` rows and names in its config.json the row shared by the ids
it does not model (`jspec_shared_row`) and, optionally, which ids own which rows
(`jspec_id_to_row`): convert/graft.py's `vocab_law` defines sigma (id -> row) and the row
multiplicities n. The expanded model's embedding, lm_head (and a drafter's Markov W1 / W2) row of
id t is S's row sigma(t), so its softmax over all ids is

    p(t) = exp z(sigma t) / sum_j n_j exp z(j),

S's law with row j counted n_j times, split evenly among the ids sharing it: the law S is
trained on (jspec.train: logits + log n). The engine serves the expanded directory unchanged.

    python -m jspec.convert.expand_vocab --target SRC --out DST [--draft SRC_D --draft-out DST_D]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jspec.atomic import atomic_dir
from jspec.config import ConfigError, Qwen3Config
from jspec.convert.safetensors_reader import index_checkpoint, read_tensor
from jspec.draft_vocab import RANKED_IDS_FILE, ranked_ids_from_rows

QWEN3_VOCAB = 151936
DSPARK_MASK_ID = 151669  # the first unused Qwen3 id, DSpark's mask token
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja")
_VOCAB_KEYS = {"model.embed_tokens.weight", "lm_head.weight", "embed_tokens.weight",
               "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}


def compact_law(target_hf: dict, vocab_size: int = QWEN3_VOCAB, s_mask: int | None = None,
                t_mask: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(sigma [vocab_size] id -> row, n [rows] ids per row) of a compact target config."""
    from jspec.convert.graft import vocab_law
    return vocab_law(target_hf, int(target_hf["vocab_size"]), vocab_size, s_mask, t_mask)


def _read_dir(src: Path) -> tuple[dict, dict[str, np.ndarray]]:
    if not (src / "config.json").is_file():
        raise ConfigError(f"{src} is not a model directory (no config.json)")
    hf = json.loads((src / "config.json").read_text())
    return hf, {name: read_tensor(info) for name, info in index_checkpoint(src).items()}


def _write_dir(dst: Path, hf: dict, tensors: dict[str, np.ndarray], side_from: Path | None,
               extra: dict[str, str] | None = None) -> Path:
    """Atomic: built beside dst and renamed into place. `extra`: more files, name -> text."""
    with atomic_dir(dst) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        for name in SIDE_FILES if side_from else ():
            if (side_from / name).is_file():
                shutil.copy2(side_from / name, tmp / name)
    return Path(dst)


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes
    return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))


def expand_target(src: str | Path, dst: str | Path, *, vocab_size: int = QWEN3_VOCAB,
                  dtype: str = "float32") -> Path:
    """Compact S -> a standard Qwen3 directory with `vocab_size` rows (untied embedding and
    lm_head, no jspec_* keys), side files (tokenizer, generation_config) copied."""
    src = Path(src)
    hf, tensors = _read_dir(src)
    if "target_layer_ids" in hf:
        raise ConfigError(f"{src} is a drafter; expand it with expand_drafter")
    cfg = Qwen3Config.from_hf_dict(hf)
    sigma, _ = compact_law(hf, vocab_size)
    embed = tensors["model.embed_tokens.weight"]
    head = embed if cfg.tie_word_embeddings else tensors["lm_head.weight"]
    out = {k: _cast(v, dtype) for k, v in tensors.items() if k not in _VOCAB_KEYS}
    out["model.embed_tokens.weight"] = _cast(embed[sigma], dtype)
    out["lm_head.weight"] = _cast(head[sigma], dtype)
    new_hf = {k: v for k, v in hf.items() if not k.startswith("jspec_")}
    new_hf.update(vocab_size=vocab_size, tie_word_embeddings=False, torch_dtype=dtype)
    return _write_dir(Path(dst), new_hf, out, src)


def expand_drafter(src: str | Path, dst: str | Path, target_src: str | Path, *,
                   vocab_size: int = QWEN3_VOCAB, mask_token_id: int = DSPARK_MASK_ID,
                   dtype: str = "float32") -> Path:
    """A drafter of compact S -> the drafter of expand_target(S): Markov W1 / W2 rows by sigma,
    the mask row becomes `mask_token_id`; copies of the target's embedding / lm_head dropped (the
    expanded target's are the ones)."""
    src = Path(src)
    hf, tensors = _read_dir(src)
    if "target_layer_ids" not in hf:
        raise ConfigError(f"{src} is not a drafter (no target_layer_ids in config.json)")
    target_hf = json.loads((Path(target_src) / "config.json").read_text())
    if int(hf["vocab_size"]) != int(target_hf["vocab_size"]):
        raise ConfigError(f"drafter {src} has vocab_size {hf['vocab_size']}, its target "
                          f"{target_src} {target_hf['vocab_size']}")
    sigma, mult = compact_law(target_hf, vocab_size, int(hf["mask_token_id"]), mask_token_id)
    out = {}
    for k, v in tensors.items():
        if k in ("embed_tokens.weight", "lm_head.weight"):
            continue
        out[k] = _cast(v[sigma] if k in _VOCAB_KEYS else v, dtype)
    new_hf = {k: v for k, v in hf.items() if not k.startswith("jspec_")}
    new_hf.update(vocab_size=vocab_size, mask_token_id=mask_token_id, torch_dtype=dtype)
    # S's own rows are ranked by corpus frequency: the draft vocabulary's ranking.
    ranked = ranked_ids_from_rows(sigma, mult, exclude=[mask_token_id])
    return _write_dir(Path(dst), new_hf, out, None,
                      extra={RANKED_IDS_FILE: json.dumps({"ranked_ids": ranked})})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--draft", action="append", default=[], help="a drafter of the target (repeatable)")
    ap.add_argument("--draft-out", action="append", default=[])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    if len(args.draft) != len(args.draft_out):
        ap.error("give one --draft-out per --draft")
    try:
        expand_target(args.target, args.out, dtype=args.dtype)
        for d, o in zip(args.draft, args.draft_out):
            expand_drafter(d, o, args.target, dtype=args.dtype)
    except (ConfigError, ValueError, OSError) as e:
        raise SystemExit(f"expand_vocab: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
