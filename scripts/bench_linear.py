"""The batch-invariant Triton linear kernel against XLA's GEMM at Qwen3-8B shapes: time and
achieved weight bandwidth of the default plan, of the fixed 16-row fallback (FORCE_BLOCK_M = 16),
of the unsplit walk where the plan splits K (split_k = 1) and of a sweep of the plan's knobs (row
tile, rows per dot, column tile, warps, stages, K splits), so the plan can be tuned on the GPU.

The tiling knobs are meant not to change a result's bits (kernels/linear_triton.py; on the H200
none of 56 tilings did), but nothing here assumes it: every timed configuration's output (the
first call of its timed chain, on the same inputs) is compared bit for bit with the default
plan's, and the record says which differ (`bits_equal_plan`, `n_diff`, `bits`). The number of K
splits is another matter: it is part of the sum (fixed per shape, never per M), so a
configuration with another split_k (or another MMA family: the v2 16-row fallback under
`--mma v3`) than the plan's is expected to differ from it (`same_split` false;
`bits.other_split_differ`, not a failure); only same-split, same-family configurations must match
(`bits.differ_from_plan` should stay empty). Every output is checked against XLA's
(`max_rel_err_vs_xla`).

Timing: 20 dependent calls in one program, rotating through copies of the weight that hold
--rotate-mib (512) together, so each call reads its weight from HBM as a layer of the model does;
before 2026-12-04 one weight was repeated, which the 50 MB L2 partly held, and that flattered the
split plans 4x against the engine (docs/benchmarks.md).

Order: first XLA, the plan, the 16-row fallback and the unsplit walk at every (shape, rows); then
the sweep at each of --sweep-rows in turn, one configuration at a time across all shapes (widest
row tiles first), until --budget-s: a cut loses the same configurations on every shape, and the
JSON is rewritten after every step. The best per (shape, rows) is over all timed entries.

  . scripts/device_env.sh
  timeout 100 python3 scripts/bench_linear.py --rows 1,8,32,256 --sweep-rows 1,8,32,256 \
      --shapes qkv,o,gate_up,down --block-m auto --block-n auto --split-k 1,2,3,4 \
      --budget-s 70 --out $OUT/linear.json
  python3 scripts/bench_linear.py --dry-run ... --out x   # list what would be timed (no GPU)
  timeout 110 python3 scripts/bench_linear.py --mma v3 --rows 1,16,128,256 --sweep-rows 128,256 \
      --block-m 64,128 --block-n 16,32,64,128 --warps 4,8 --budget-s 90 --out $OUT/linear_v3.json  # gpu_linear_v3.sh
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}
# A swept configuration whose warps would each own less than a 16 x 32 accumulator (warps doing
# the same MMAs twice) or more than 64 x 64 (spills) is left out; the default plan's tile never
# is (whatever the split: a split sweep at M = 1 keeps the 16 x 16 decode tile).
WARP_TILE = (16 * 32, 64 * 64)


def timeit(f, x, ws, chain: int = 20, reps: int = 7):
    """(seconds per call, the first call's output): `chain` dependent calls unrolled in one jitted
    program (no host dispatch or loop sync between them), median over `reps` programs. Call i
    multiplies by ws[i % len(ws)]: distinct copies of the weight whose bytes together pass the L2,
    so that each call streams its weight from HBM as a model's next layer does (one weight
    repeated stays in the H200's 50 MB L2 when it fits, and flatters: see weight_copies)."""
    import jax

    ws = tuple(ws)

    @jax.jit
    def chained(x, ws):
        y0 = f(x, ws[0])
        acc = jax.lax.dynamic_update_slice(x, y0[:1, :1].astype(x.dtype), (0, 0))
        for i in range(1, chain):
            y = f(acc, ws[i % len(ws)])
            acc = jax.lax.dynamic_update_slice(x, y[:1, :1].astype(x.dtype), (0, 0))
        return acc, y0

    _, y0 = jax.block_until_ready(chained(x, ws))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(chained(x, ws))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] / chain, y0


def copies_for(weight_bytes: int, rotate_mib: float, chain: int = 20) -> int:
    """How many distinct weight buffers the chain rotates through: enough that together they
    hold rotate_mib (0: one buffer, the weight repeated), at most one per call of the chain."""
    if rotate_mib <= 0:
        return 1
    return max(1, min(chain, -(-int(rotate_mib * 2 ** 20) // weight_bytes)))


def weight_copies(w, rotate_mib: float) -> tuple:
    """w and copies of it in their own buffers (the same values: every call's output is the
    same function of its input). Measured on the H200 (2026-12-04): with the weight repeated, the
    split plans' gain at 64 rows looked 4x what the engine then measured."""
    import jax.numpy as jnp

    n = copies_for(w.size * w.dtype.itemsize, rotate_mib)
    return (w,) + tuple(jnp.array(w, copy=True) for _ in range(n - 1))


def _ints(spec: str, name: str) -> list:
    """'16,32' -> [16, 32]; 'auto' entries -> None (the plan's choice)."""
    out = []
    for v in spec.split(","):
        v = v.strip()
        if v == "auto":
            out.append(None)
        elif v:
            try:
                out.append(int(v))
            except ValueError:
                raise SystemExit(f"--{name}: {v!r} is neither an integer nor 'auto'") from None
    return out


def cfg_of(plan) -> dict:
    return dict(block_m=plan.block_m, dot_m=plan.dot_m, block_n=plan.block_n,
                num_warps=plan.num_warps, num_stages=plan.num_stages, split_k=plan.split_k,
                mma=plan.mma, split_serial=plan.split_serial)


def label(cfg: dict) -> str:
    return (f"bm{cfg['block_m']}_dm{cfg['dot_m']}_bn{cfg['block_n']}_w{cfg['num_warps']}"
            f"_s{cfg['num_stages']}_sk{cfg['split_k']}" + ("_ser" if cfg.get("split_serial") else "")
            + ("_v3" if cfg["mma"] == "v3" else ""))


def sweep_configs(M: int, N: int, K: int, args, num_sms: int | None) -> list[dict]:
    """The swept configurations at this shape, resolved through make_plan (so 'auto' entries and
    the rows-per-dot rule are the plan's): invalid ones (make_plan refuses them: wgmma, too many
    row blocks, a split that does not cut K's 128-steps evenly), row tiles taller than M rounded
    up to a power of two (only masked rows more), warp tiles outside WARP_TILE and duplicates are
    dropped; widest row tiles first."""
    from jspec.kernels.linear_triton import MMA_M, make_plan

    cap = max(MMA_M, 1 << max(0, M - 1).bit_length())
    dflt = make_plan(M, N, K, num_sms=num_sms)
    tile = lambda p: (p.block_m, p.dot_m, p.block_n, p.num_warps)  # noqa: E731
    seen, out = set(), []
    for bm, dm, bn, nw, st, sk in itertools.product(
            _ints(args.block_m, "block-m"), _ints(args.dot_m, "dot-m"),
            _ints(args.block_n, "block-n"), _ints(args.warps, "warps"),
            _ints(args.stages, "stages"), _ints(args.split_k, "split-k")):
        if bm is not None and bm > cap:
            continue
        try:
            plan = make_plan(M, N, K, block_m=bm, dot_m=dm, block_n=bn, num_warps=nw,
                             num_stages=st, num_sms=num_sms, split_k=sk)
        except ValueError:
            continue
        if (tile(plan) != tile(dflt) and plan.mma == "v2"
                and not WARP_TILE[0] <= plan.block_m * plan.block_n // plan.num_warps
                <= WARP_TILE[1]):
            continue
        cfg = cfg_of(plan)
        if label(cfg) not in seen:
            seen.add(label(cfg))
            out.append(cfg)
    return sorted(out, key=_rank)


def _rank(cfg: dict) -> tuple:
    """Sweep order: widest row tiles first (the new ground), then widest column tiles."""
    return (-cfg["block_m"], -cfg["block_n"], cfg["dot_m"], cfg["num_warps"], cfg["num_stages"],
            cfg["split_k"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of " + ",".join(SHAPES))
    ap.add_argument("--rows", default="1,8,32,256", help="M: XLA, the plan, the 16-row fallback")
    ap.add_argument("--sweep-rows", default=None, help="M values to sweep (default: --rows)")
    ap.add_argument("--rotate-mib", type=float, default=512,
                    help="the timed chain rotates through copies of each weight holding this "
                         "many MiB, so calls read weights from HBM (0: one weight, L2-warm, the "
                         "measurement before 2026-12-04)")
    ap.add_argument("--block-m", default="16,32,64,128", help="row tiles ('auto': the plan's)")
    ap.add_argument("--dot-m", default="auto", help="rows per dot; auto: the plan's rule (the "
                    "whole tile up to 32 rows or with <= 2 warps, else 32-row blocks)")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="auto", help="e.g. 2,4,8 (2: a 64/128-row tile in one dot)")
    ap.add_argument("--stages", default="auto", help="auto: the plan's shared-memory rule")
    ap.add_argument("--split-k", default="auto", help="K splits, e.g. 1,2,3,4 (auto: the plan's "
                    "rule from (N, K); one that does not cut K's 128-steps evenly is skipped). "
                    "Another split than the plan's gives other bits, expectedly")
    ap.add_argument("--mma", default="mixed", choices=("v2", "v3", "mixed"),
                    help="the MMA family of the default plan and the sweep (linear_triton."
                    "MMA_FAMILY): v2 mma.sync, v3 wgmma (64/128-row single-dot tiles, 4/8 "
                    "warps; the sweep's other row tiles are refused). The 16-row fallback is "
                    "always v2's: another family, other bits, expectedly")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="stop sweeping once the run is this old (0: no limit)")
    ap.add_argument("--dry-run", action="store_true", help="list the sweep, time nothing")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    rows = [int(m) for m in args.rows.split(",") if m]
    sweep_rows = rows if args.sweep_rows is None else [int(m) for m in args.sweep_rows.split(",")
                                                        if m]
    shapes = {s: SHAPES[s] for s in args.shapes.split(",") if s}

    import jspec.kernels.linear_triton as lt
    from jspec.kernels.linear_triton import make_plan

    lt.MMA_FAMILY = args.mma  # the plan every default below resolves to
    if args.dry_run:
        total, base = 0, 0
        for M in sorted(set(rows) | set(sweep_rows)):
            for name, (N, K) in shapes.items():
                plan = label(cfg_of(make_plan(M, N, K)))
                legacy = label(cfg_of(make_plan(M, N, K, block_m=16, mma="v2")))
                unsplit = label(cfg_of(make_plan(M, N, K, split_k=1)))
                base += 2 + (legacy != plan) + (unsplit != plan)
                cfgs = ([label(c) for c in sweep_configs(M, N, K, args, None)]
                        if M in sweep_rows else [])
                cfgs = [c for c in cfgs if c not in (plan, legacy, unsplit)]
                total += len(cfgs)
                print(f"{name} M={M}: plan {plan}, 16-row {legacy}, unsplit {unsplit}; "
                      f"sweep {len(cfgs)}: " + " ".join(cfgs))
        print(f"{base} baseline timings (XLA, plan, 16-row fallback, unsplit), {total} swept")
        return

    import functools

    import jax
    import jax.numpy as jnp

    from jspec.kernels.linear import linear_xla
    from jspec.kernels.linear_triton import linear_triton

    try:
        sms = int(getattr(jax.devices()[0], "core_count", 0)) or None
    except Exception:  # noqa: BLE001 - the plan's heuristic input only
        sms = None
    key = jax.random.PRNGKey(0)
    data, results = {}, {}
    record = {"jax": jax.__version__, "device": str(jax.devices()[0]), "num_sms": sms,
              "args": vars(args), "rows": []}

    def gbytes(M, N, K):
        return (N * K + M * K) * 2 / 1e9 + M * N * 4 / 1e9

    def save():
        record["elapsed_s"] = time.perf_counter() - t_start
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)

    differ, other_split = [], []  # same split as the plan's: must not differ; another: may

    def run(name, M, cfg, y_plan):
        """Time one configuration (None: the default plan, no overrides), check it against XLA
        and compare its output with the default plan's; the record entry and the output."""
        x, ws, _, y_xla = data[name, M]
        N, K = shapes[name]
        f = linear_triton if cfg is None else functools.partial(linear_triton, **cfg)
        plan = make_plan(M, N, K, num_sms=sms, **(cfg or {}))
        entry = {**cfg_of(plan), "label": label(cfg_of(plan))}
        try:
            t, y = timeit(f, x, ws)
        except Exception as e:  # noqa: BLE001 - e.g. shared memory overflow; keep the others
            entry["error"] = str(e)[:200]
            return entry, None
        entry.update(us=t * 1e6, TBps=gbytes(M, N, K) / t / 1e3)
        scale = jnp.maximum(jnp.max(jnp.abs(y_xla)), 1e-30)
        entry["max_rel_err_vs_xla"] = float(jnp.max(jnp.abs(y - y_xla)) / scale)
        if y_plan is not None:
            n_diff = int(jnp.sum(y != y_plan))
            dflt = make_plan(M, N, K, num_sms=sms)
            same = plan.split_k == dflt.split_k and plan.mma == dflt.mma
            entry.update(bits_equal_plan=n_diff == 0, n_diff=n_diff, same_split=same)
            if n_diff:
                (differ if same else other_split).append(
                    f"{name} M={M} {entry['label']}: {n_diff} of {y.size} elements")
        row = results.get((name, M))
        if row is not None and "us" in entry and (row["best"] is None
                                                  or entry["us"] < row["best"]["us"]):
            row["best"] = entry
        return entry, y

    # 1. XLA, the default plan and the 16-row fallback (FORCE_BLOCK_M = 16) everywhere.
    for name, (N, K) in shapes.items():
        kw, kx = jax.random.split(jax.random.fold_in(key, N * 7 + K))
        w = (0.02 * jax.random.normal(kw, (N, K), jnp.float32)).astype(jnp.bfloat16)
        ws = weight_copies(w, args.rotate_mib)
        for M in sorted(set(rows) | set(sweep_rows)):
            x = jax.random.normal(jax.random.fold_in(kx, M), (M, K), jnp.float32)
            x = x.astype(jnp.bfloat16)
            t_xla, y_xla = timeit(linear_xla, x, ws)
            data[name, M] = (x, ws, None, y_xla)
            entry, y_plan = run(name, M, None, None)
            data[name, M] = (x, ws, y_plan, y_xla)
            row = {"shape": name, "N": N, "K": K, "M": M, "xla_us": t_xla * 1e6,
                   "xla_TBps": gbytes(M, N, K) / t_xla / 1e3, "plan": entry, "legacy": None,
                   "unsplit": None, "triton": [], "skipped": 0,
                   "best": entry if "us" in entry else None}
            results[name, M] = row
            record["rows"].append(row)
            legacy = cfg_of(make_plan(M, N, K, num_sms=sms, block_m=16, mma="v2"))
            if label(legacy) != entry["label"]:
                row["legacy"] = run(name, M, legacy, y_plan)[0]
            unsplit = cfg_of(make_plan(M, N, K, num_sms=sms, split_k=1))
            if label(unsplit) != entry["label"]:  # the kernel before split-K (other bits)
                row["unsplit"] = run(name, M, unsplit, y_plan)[0]
            print(json.dumps({"shape": name, "M": M, "xla_us": round(row["xla_us"], 1),
                              "plan": entry["label"], "plan_us": round(entry.get("us", -1), 1),
                              "plan_err": entry.get("max_rel_err_vs_xla", entry.get("error")),
                              "legacy_us": round((row["legacy"] or entry).get("us", -1), 1),
                              "unsplit_us": round((row["unsplit"] or entry).get("us", -1), 1)}),
                  flush=True)
            save()

    # 2. The sweep: one configuration at a time across the shapes, widest row tiles first.
    for M in sweep_rows:
        per_shape = {name: {label(c): c for c in sweep_configs(M, N, K, args, sms)}
                     for name, (N, K) in shapes.items()}
        union = {}
        for cfgs in per_shape.values():
            for lab, c in cfgs.items():
                union.setdefault(lab, c)
        for lab in sorted(union, key=lambda lab: _rank(union[lab])):
            for name in shapes:
                cfg, row = per_shape[name].get(lab), results[name, M]
                if cfg is None or lab in (row["plan"]["label"], (row["legacy"] or {}).get("label"),
                                          (row["unsplit"] or {}).get("label")):
                    continue
                if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                    row["skipped"] += 1
                    continue
                row["triton"].append(run(name, M, cfg, data[name, M][2])[0])
            save()
    for row in record["rows"]:
        best = row["best"] or {}
        print(json.dumps({"shape": row["shape"], "M": row["M"],
                          "xla_us": round(row["xla_us"], 1),
                          "plan": row["plan"]["label"],
                          "plan_us": round(row["plan"].get("us", -1), 1),
                          "unsplit_us": round((row["unsplit"] or row["plan"]).get("us", -1), 1),
                          "best": best.get("label"), "best_us": round(best.get("us", -1), 1),
                          "best_TBps": round(best.get("TBps", -1), 2),
                          "swept": sum("us" in e for e in row["triton"]),
                          "skipped": row["skipped"]}), flush=True)
    compared = [e for row in record["rows"]
                for e in row["triton"] + [row["legacy"] or {}, row["unsplit"] or {}]
                if "n_diff" in e]
    n_same = sum(e["same_split"] for e in compared)
    worst = max((e.get("max_rel_err_vs_xla", 0.0) for row in record["rows"]
                 for e in row["triton"] + [row["plan"], row["legacy"] or {},
                                           row["unsplit"] or {}]), default=0.0)
    record["bits"] = {"configs_compared": len(compared), "same_split": n_same,
                      "differ_from_plan": differ, "other_split_differ": other_split,
                      "max_rel_err_vs_xla": worst}
    print(f"bits: {len(compared)} configurations (sweep, 16-row fallback, unsplit) compared "
          f"with the default plan's output. Same split as the plan ({n_same}; must match): "
          f"{len(differ)} differ" + "".join(f"\n  {d}" for d in differ)
          + f"\nAnother split than the plan's ({len(compared) - n_same}; another sum, expected "
          f"to differ, each as invariant in M): {len(other_split)} differ"
          + f"\nworst max_rel_err_vs_xla of any timed output: {worst:.3g}", flush=True)
    save()


if __name__ == "__main__":
    main()
