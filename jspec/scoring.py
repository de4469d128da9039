"""Teacher-forced scoring through an engine's own paths: the stock decode step (q_len 1) or the
speculative verify (blocks of K+1). Used by the lossless gate: both must give the same
log-probabilities for the same text."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jspec.engine import Engine, Request
from jspec.steps import DecodeState


def teacher_forced_logprobs(engine: Engine, prompt_ids: list[int], continuation: list[int]) -> np.ndarray:
    """log p(continuation[i] | prompt, continuation[:i]) for each i, through the engine's decode
    path (stock) or verify path (speculative). The prompt minus its last token is prefilled;
    the last prompt token is the first input of the scored path."""
    width = engine.num_draft + 1 if engine.num_draft else 1
    n = len(continuation)
    if width > 1 and n % width:
        raise ValueError(f"continuation length {n} must be a multiple of the verify width {width}")
    if len(prompt_ids) < 2:
        raise ValueError("scoring needs a prompt of at least 2 tokens")
    total = len(prompt_ids) + n
    req = Request(list(prompt_ids[:-1]), temperature=0.0, max_tokens=1)
    pages = engine.allocator.allocate(engine.cache_shape.pages_for(total + width))
    if pages is None:
        raise RuntimeError("not enough free KV pages to score this text")
    req.pages, req.lane = pages, 0
    try:
        engine._prefill(req)
        forced = jnp.asarray([[prompt_ids[-1]] + list(continuation)], jnp.int32)
        state = DecodeState(
            tokens=forced[:, 0], lengths=jnp.asarray([len(prompt_ids) - 1], jnp.int32),
            page_table=jnp.asarray(engine._page_row(req)[None]), active=jnp.ones(1, bool),
            remaining=jnp.asarray([n], jnp.int32), stop_on_eos=jnp.zeros(1, bool),
            sampling=engine._sampling([req]))
        engine.caches, out = engine.programs.teacher_forced(engine.params, engine.caches, state, forced)
        return np.asarray(out[0])
    finally:
        engine.allocator.free(req.pages)


def verify_minus_decode(stock: Engine, spec: Engine, fixed, progress: bool = False) -> np.ndarray:
    """log p(verify path) - log p(decode path) per token of the fixed (prompt, continuation)
    texts, concatenated (float64): the lossless gate's fixed-text check."""
    from tqdm.auto import tqdm
    diffs = []
    for prompt, cont in tqdm(fixed, desc="fidelity (fixed texts)", leave=False, disable=not progress):
        a = teacher_forced_logprobs(stock, prompt, cont)
        b = teacher_forced_logprobs(spec, prompt, cont)
        diffs.append(np.asarray(b, np.float64) - np.asarray(a, np.float64))
    return np.concatenate(diffs) if diffs else np.zeros(0)
