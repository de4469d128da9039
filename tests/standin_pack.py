"""A tiny random stand-in pair (compact Qwen3 vocabulary, DSpark + DFlash drafters) packed in
jspec.standin's int8 format, and the environment that points the stand-in names at a package.

The tiny target can be grafted into the Qwen3-8B shape (head_dim 128, hidden 64 = 4096 / 4^3,
five taps before its last layer), so the graft's name resolution is testable with a dry run."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

SHIPPED = Path(__file__).resolve().parents[1] / "jspec" / "assets" / "standin"
ROWS = 256
TAPS = (0, 1, 2, 3, 4)


def shipped_pack_present() -> bool:
    return (SHIPPED / "target" / "weights.safetensors").is_file()


def make_compact_pair(root: Path, seed: int = 0) -> dict[str, Path]:
    """S (ROWS rows for the most frequent Qwen3 ids of a little code, the shared row, the specials
    and the mask row) and its drafters, as the training exports write them (float32)."""
    from hf_models import TINY_CORPUS
    from jspec.config import Qwen3Config
    from jspec.dspark import init_random_drafter
    from jspec.qwen3 import init_random
    from jspec.tokenizer import QWEN3_EOS_IDS, Tokenizer
    from jspec.train.checkpointing import export_drafter, export_target
    from jspec.train.drafter import drafter_config
    from jspec.train.vocab import build_compact_vocab

    tok = Tokenizer.qwen3()
    docs = [tok.encode(chunk) for chunk in TINY_CORPUS.split("\n\n") if chunk]
    vocab = build_compact_vocab(docs, ROWS)
    cfg = Qwen3Config(vocab_size=ROWS, hidden_size=64, intermediate_size=128, num_layers=6,
                      num_heads=2, num_kv_heads=1, head_dim=128, max_position_embeddings=1024,
                      dtype="float32")
    model = init_random(cfg, seed=seed)
    dirs = {"target": export_target(model, root / "target", dtype="float32", eos_ids=QWEN3_EOS_IDS)}
    hf = json.loads((dirs["target"] / "config.json").read_text())
    hf.update(vocab.hf_keys())
    (dirs["target"] / "config.json").write_text(json.dumps(hf, indent=2))
    for i, kind in enumerate(("dspark", "dflash")):
        dcfg = drafter_config(cfg, draft_layers=1, mask_token_id=vocab.mask_row, block_size=4,
                              tap_layers=TAPS, markov_rank=8, dflash=kind == "dflash")
        drafter = init_random_drafter(dcfg, seed=seed + 1 + i)
        dirs[kind] = export_drafter(drafter, model, root / kind, dtype="float32")
    return dirs


def make_tiny_pack(root: Path) -> Path:
    """root/src/{target,dspark,dflash} and their package root/pack (built once per root)."""
    from jspec.standin import pack
    out = root / "pack"
    if not (out / "target").is_dir():
        src = make_compact_pair(root / "src")
        pack(src["target"], src["dspark"], out, src["dflash"], force=True)
    return out


@contextlib.contextmanager
def standin_env(base: Path, *, prefer_shipped: bool = True):
    """Environment for the stand-in names: the shipped package when it exists (and
    prefer_shipped), else a tiny random one built under `base`; the cache in `base` either way.
    Yields (package dir, whether it is the shipped one)."""
    shipped = prefer_shipped and shipped_pack_present()
    pack_dir = SHIPPED if shipped else make_tiny_pack(base / "tiny-standin")
    saved = {k: os.environ.get(k) for k in ("JSPEC_STANDIN_DIR", "JSPEC_CACHE")}
    os.environ["JSPEC_CACHE"] = str(base / "jspec-cache")
    if shipped:
        os.environ.pop("JSPEC_STANDIN_DIR", None)
    else:
        os.environ["JSPEC_STANDIN_DIR"] = str(pack_dir)
    try:
        yield pack_dir, shipped
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def assert_close_rows(a: np.ndarray, b: np.ndarray, tol: float = 1e-6) -> None:
    scale = max(float(np.abs(b).max()), 1e-30)
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)
