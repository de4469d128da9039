"""A frequency-ranked draft vocabulary (as FR-Spec does): the drafter proposes only the N most
frequent token ids, so its head reads N rows of the lm_head instead of all of them, and its
sampling steps (softmax, Markov bias, draws) run over N entries.

Lossless by construction: q, the law a draft is drawn from, is zero outside the N ids, and the
rejection sampler is exact for any q (jspec/rejection.py): a token outside them is never
proposed, and its probability reaches the output through the residual max(p - q, 0), which is p
there. Only acceptance can change, by the target's mass outside the N ids.

The ranking travels beside the drafter as draft_vocab.json ({"ranked_ids": [most frequent
first, ...]}); convert/graft.py writes it from the stand-in's compact vocabulary, whose rows are
ranked by corpus frequency (jspec/train/vocab.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ConfigError

RANKED_IDS_FILE = "draft_vocab.json"


def write_ranked_ids(model_dir: str | Path, ranked_ids: Sequence[int]) -> Path:
    path = Path(model_dir) / RANKED_IDS_FILE
    path.write_text(json.dumps({"ranked_ids": [int(t) for t in ranked_ids]}))
    return path


def read_ranked_ids(model_dir: str | Path) -> list[int]:
    """The ranking saved beside a drafter; a ConfigError that names the file if it is missing or
    malformed."""
    path = Path(model_dir) / RANKED_IDS_FILE
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no {RANKED_IDS_FILE} (the frequency-ranked token ids "
                          "a draft vocabulary is cut from)")
    try:
        ids = json.loads(path.read_text())["ranked_ids"]
        if not all(isinstance(t, int) for t in ids):
            raise TypeError("ids must be integers")
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a draft vocabulary "
                          f"({{\"ranked_ids\": [...]}}): {e}") from None
    return ids


def ranked_ids_from_rows(sigma: np.ndarray, multiplicity: np.ndarray,
                         exclude: Sequence[int] = ()) -> list[int]:
    """Ids that own a row of a compact vocabulary (sigma: id -> row, multiplicity: row -> ids on
    it), in row order: the compact rows are ranked by corpus frequency."""
    own = np.flatnonzero(multiplicity[sigma] == 1)
    own = own[~np.isin(own, np.asarray(list(exclude), np.int64))]
    return own[np.argsort(sigma[own], kind="stable")].tolist()


def choose_ids(ranked: Sequence[int], size: int, vocab_size: int,
               keep: Sequence[int] = ()) -> np.ndarray:
    """The first `size` ranked ids plus `keep` (EOS ids, so that a draft can end a reply),
    sorted, int32. ValueError names what is wrong with the inputs."""
    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    if size > len(ranked):
        raise ValueError(f"draft vocabulary size {size} exceeds the {len(ranked)} ranked ids")
    head = np.asarray(list(ranked[:size]), np.int64)
    if len(np.unique(head)) != len(head):
        raise ValueError("the ranked ids repeat an id")
    ids = np.union1d(head, np.asarray([k for k in keep if 0 <= k < vocab_size], np.int64))
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"ranked id {int(ids.min() if ids.min() < 0 else ids.max())} is outside "
                         f"the vocabulary (size {vocab_size})")
    return ids.astype(np.int32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ids", "head", "markov_w2"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """The draft vocabulary's ids [N] and the rows the drafter's head reads for them: the
    target's lm_head rows [N, D] and, for DSpark, the Markov head's W2 rows [N, r] (None for
    DFlash). Gathered once, when the engine is built."""
    ids: jax.Array
    head: jax.Array
    markov_w2: jax.Array | None

    @classmethod
    def build(cls, ids: np.ndarray, target, drafter) -> "DraftVocab":
        idx = jnp.asarray(ids)
        w2 = None if drafter.cfg.is_dflash else jnp.take(drafter.markov_w2[...], idx, axis=0)
        return cls(idx, jnp.take(target.head_weight(), idx, axis=0), w2)

    def scatter(self, q_logprobs_bn: jax.Array, vocab_size: int) -> jax.Array:
        """q over the draft ids [B, N] -> over the whole vocabulary [B, V], -inf elsewhere."""
        full = jnp.full(q_logprobs_bn.shape[:-1] + (vocab_size,), -jnp.inf, q_logprobs_bn.dtype)
        return full.at[..., self.ids].set(q_logprobs_bn)
