"""Greedy generation without a KV cache: the plain reference the paged engine is checked against.

Each step recomputes the whole (padded) sequence; one compiled program serves every step because
the buffer has a fixed length and causality hides the padding to the right.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.qwen3 import Qwen3, forward_logits


def greedy_generate(model: Qwen3, prompt_ids: list[int], max_new_tokens: int,
                    eos_ids: tuple[int, ...] = ()) -> list[int]:
    total = len(prompt_ids) + max_new_tokens
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, tokens_1t, index):
        logits, _ = forward_logits(nnx.merge(graphdef, state), tokens_1t)
        return jnp.argmax(logits[0, index]).astype(jnp.int32)

    tokens = np.zeros((1, total), np.int32)
    tokens[0, :len(prompt_ids)] = prompt_ids
    out = []
    for i in range(len(prompt_ids) - 1, total - 1):
        token = int(next_token(state, jnp.asarray(tokens), i))
        tokens[0, i + 1] = token
        out.append(token)
        if token in eos_ids:
            break
    return out
