"""Is a row's result independent of how many rows share the op? (batch invariance)

Speculative verify computes 8 rows per lane where stock decode computes 1; if an op's per-row
result depends on the row count, the two paths round differently and the bench's fixed-text
fidelity gate sees it. For each op at Qwen3-8B shapes this compares row 0 computed alone (M = 1)
with row 0 computed among M rows, bitwise, under the XLA_FLAGS it runs with.

  python3 scripts/invariance_probe.py --out inv.json
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="8,16,128,256")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    D, F, V, hd = 4096, 12288, 151936, 128
    dots = {"qkv": (D, 48 * hd), "o": (D, D), "gate_up": (D, 2 * F), "down": (F, D), "lm_head": (D, V)}
    key = jax.random.PRNGKey(0)
    rows = [int(r) for r in args.rows.split(",")]
    Mmax = max(rows)
    result = {"label": args.label, "xla_flags": os.environ.get("XLA_FLAGS", ""), "ops": {}}

    def compare(name, fn, x_full):
        ref = np.asarray(fn(x_full[:1]).astype(jnp.float32))
        out = {}
        for m in rows:
            got = np.asarray(fn(x_full[:m]).astype(jnp.float32))[:1]
            diff = np.abs(got - ref)
            out[m] = {"mismatch_share": float((diff != 0).mean()),
                      "max_rel": float((diff / (np.abs(ref) + 1e-30)).max())}
        result["ops"][name] = out
        print(name, json.dumps(out), flush=True)

    for name, (k, n) in dots.items():
        kx, kw, key = jax.random.split(key, 3)
        w = (0.02 * jax.random.normal(kw, (n, k), jnp.float32)).astype(jnp.bfloat16)
        x = jax.random.normal(kx, (Mmax, k), jnp.float32).astype(jnp.bfloat16)
        fn = jax.jit(lambda x, w=w: jnp.einsum("md,nd->mn", x, w, preferred_element_type=jnp.float32))
        compare("dot_" + name, fn, x)

    kx, key = jax.random.split(key)
    x = jax.random.normal(kx, (Mmax, D), jnp.float32)
    g = jnp.ones((D,), jnp.bfloat16)
    norm = jax.jit(lambda x: (g * (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)))
    compare("rmsnorm", norm, x)
    kx, key = jax.random.split(key)
    logits = 3 * jax.random.normal(kx, (Mmax, V), jnp.float32)
    compare("log_softmax", jax.jit(lambda z: jax.nn.log_softmax(z, -1)), logits)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
