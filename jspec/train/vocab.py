"""The compact vocabulary of the stand-in target: the most frequent corpus ids get rows of their
own, every other id shares one row, and the loss counts that row once per id it stands for.

Rows (V_S = `rows`):   0 .. K-1     the K most frequent ordinary ids of the training corpus
                       K            the shared row (every id without a row of its own)
                       K+1 ..       the special ids (<|endoftext|>, <|im_start|>, <|im_end|>)
                       V_S - 1      the drafter's mask row (DSpark's mask id 151669 maps to it)
The target's config.json carries this as `jspec_shared_row` and `jspec_id_to_row` (every row's
owner, the mask id included), the convention convert/graft.py's `vocab_law` reads. With n_j the
number of ids on row j, the model's law over ids is softmax(z + log n) over rows, split evenly
among a row's ids: training adds `log_multiplicity` to the logits, so the law trained is exactly
the law of the expanded (convert/expand_vocab.py) and grafted models.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

QWEN3_VOCAB = 151936
QWEN3_SPECIALS = (151643, 151644, 151645)  # <|endoftext|>, <|im_start|>, <|im_end|>
DSPARK_MASK_ID = 151669


@dataclasses.dataclass(frozen=True)
class CompactVocab:
    id_to_row: dict[int, int]   # every row's owning id (the shared row has none)
    shared_row: int
    mask_row: int
    rows: int
    full_vocab: int = QWEN3_VOCAB
    mask_id: int = DSPARK_MASK_ID

    def hf_keys(self) -> dict:
        return {"jspec_shared_row": self.shared_row,
                "jspec_id_to_row": {str(t): r for t, r in sorted(self.id_to_row.items())}}

    def law(self) -> tuple[np.ndarray, np.ndarray]:
        """(sigma [full_vocab] id -> row, n [rows]) by graft.vocab_law (one definition),
        computed once per vocabulary."""
        return self._law

    @functools.cached_property
    def _law(self) -> tuple[np.ndarray, np.ndarray]:
        from jspec.convert.expand_vocab import compact_law
        return compact_law({"vocab_size": self.rows, **self.hf_keys()}, self.full_vocab,
                           self.mask_row, self.mask_id)

    def log_multiplicity(self) -> np.ndarray:
        return np.log(self.law()[1]).astype(np.float32)

    def to_rows(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.law()[0][np.asarray(ids, np.int64)].astype(np.int32)

    def docs_to_rows(self, docs: Sequence[Sequence[int]]) -> list[list[int]]:
        """Token lists of full-vocabulary ids -> lists of rows."""
        return [self.to_rows(d).tolist() for d in docs]

    @classmethod
    def from_hf(cls, hf: dict, mask_row: int, full_vocab: int = QWEN3_VOCAB,
                mask_id: int = DSPARK_MASK_ID) -> "CompactVocab":
        return cls({int(k): int(v) for k, v in hf["jspec_id_to_row"].items()}, int(hf["jspec_shared_row"]),
                   mask_row, int(hf["vocab_size"]), full_vocab, mask_id)


def load_training_target(path, dtype: str = "float32"):
    """S as the trainers read it: (cfg, model, CompactVocab or None, mask row). A directory
    without a compact vocabulary has its mask on the last row."""
    import json
    from pathlib import Path

    from jspec.loading import load_model
    cfg, model = load_model(path, dtype=dtype)
    hf = json.loads((Path(path) / "config.json").read_text())
    if "jspec_shared_row" not in hf:
        return cfg, model, None, cfg.vocab_size - 1
    vocab = CompactVocab.from_hf(hf, mask_row=cfg.vocab_size - 1)
    return cfg, model, vocab, vocab.mask_row


def build_compact_vocab(docs: Sequence[Sequence[int]], rows: int, *, specials=QWEN3_SPECIALS,
                        mask_id: int = DSPARK_MASK_ID, full_vocab: int = QWEN3_VOCAB) -> CompactVocab:
    """The `rows`-row vocabulary of the corpus `docs` (ids of the full vocabulary): frequency ties
    broken by the smaller id, so the same corpus always gives the same rows."""
    k = rows - len(specials) - 2
    if k < 1:
        raise ValueError(f"{rows} rows leave no room for ordinary ids")
    counts = np.bincount(np.concatenate([np.asarray(d, np.int64) for d in docs]),
                         minlength=full_vocab)[:full_vocab].astype(np.int64)
    counts[list(specials) + [mask_id]] = -1
    order = np.lexsort((np.arange(full_vocab), -counts))[:k]  # most frequent first
    id_to_row = {int(t): r for r, t in enumerate(order)}
    shared = k
    for i, t in enumerate(specials):
        id_to_row[int(t)] = k + 1 + i
    mask_row = rows - 1
    id_to_row[int(mask_id)] = mask_row
    return CompactVocab(id_to_row, shared, mask_row, rows, full_vocab, mask_id)


def coverage(vocab: CompactVocab, docs: Sequence[Sequence[int]]) -> float:
    """Share of corpus tokens that have a row of their own."""
    sigma = vocab.law()[0]
    toks = np.concatenate([np.asarray(d, np.int64) for d in docs]) if docs else np.zeros(0, np.int64)
    return float(np.mean(sigma[toks] != vocab.shared_row)) if toks.size else 0.0
