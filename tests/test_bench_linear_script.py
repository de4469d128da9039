"""scripts/bench_linear.py's timing harness on CPU (the Triton kernel itself needs a GPU): the
chained calls rotate through distinct copies of the weight, enough to pass the L2, and the first
call's output is the product."""

import jax
import jax.numpy as jnp
import numpy as np

from script_loader import load_script


def test_weight_copies_pass_the_l2_and_stay_the_same_weight():
    bl = load_script("bench_linear")
    mib = 2 ** 20
    # Qwen3-8B's o_proj (32 MiB bf16): 16 copies hold 512 MiB; lm_head (1.16 GiB) needs none;
    # never more than one per call of the chain; 0 MiB: the weight repeated (the old harness).
    assert bl.copies_for(4096 * 4096 * 2, 512) == 16
    assert bl.copies_for(151936 * 4096 * 2, 512) == 1
    assert bl.copies_for(1024, 512) == 20
    assert bl.copies_for(4096 * 4096 * 2, 0) == 1
    assert bl.copies_for(3 * mib, 10) == 4  # ceil(10 / 3)
    w = jnp.arange(12.0).reshape(3, 4).astype(jnp.bfloat16)
    ws = bl.weight_copies(w, 24 / mib)  # 24 bytes of copies: one 24-byte weight, so 1
    assert len(ws) == 1 and ws[0] is w
    ws = bl.weight_copies(w, 100 / mib)  # 100 bytes: 5 buffers
    assert len(ws) == 5
    ptrs = {c.unsafe_buffer_pointer() for c in ws}
    assert len(ptrs) == 5  # distinct buffers, not views of one
    for c in ws:
        np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(w, np.float32))


def test_timeit_chains_over_the_copies_and_returns_the_first_product():
    bl = load_script("bench_linear")
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (4, 16), jnp.float32)
    w = jax.random.normal(kw, (8, 16), jnp.float32)
    seen = []

    def f(a, b):
        seen.append(b)  # traced once per call of the chain: which weight argument it got
        return a @ b.T

    t, y0 = bl.timeit(f, x, bl.weight_copies(w, 3 * w.size * 4 / 2 ** 20), chain=5, reps=1)
    assert t > 0 and len(seen) == 5
    ids = [id(b) for b in seen]  # copies 0, 1, 2, 0, 1: each a jit argument of its own
    assert len(set(ids[:3])) == 3 and ids[3:] == ids[:2]
    np.testing.assert_allclose(np.asarray(y0), np.asarray(x @ w.T), rtol=1e-6)
