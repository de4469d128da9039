"""Where the engine's dispatch loses time against the bare step, at Qwen3-8B shape (random bf16
weights, one lane, the bench's engine settings), with the step loop driven from the host
(EngineConfig.device_loop=False, a fixed count) and as one CUDA graph that ends once every lane
has ended (device_loop=True).

  python3 scripts/bench_engine_loop.py --out $OUT/loop.json [--spec] [--batch-invariant]

For each loop kind, per step (or speculative iteration):

  fixed      the decode program fed the same input state every dispatch (bench_steps' way);
  chained    fed the previous dispatch's output state (the engine's carried state);
  uploaded   chained, plus a page table sent from the host every dispatch (the engine, when a
             lane grew by a page);
  engine     Engine.generate on one request at a time (a prompt of --prompt-len random tokens,
             --max-tokens each, EOS off): all of the above plus prefill and the host's work,
             per token all-in; with the device loop also with look-ahead dispatches.

The gap between two rows says what one difference costs. Every figure is a median over timed
dispatches after a warm-up; the JSON is written after each measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")


def loop_in_graph(hlo_text: str) -> dict:
    """Whether XLA put the step loop into a command buffer (a CUDA graph): the optimized HLO's
    command-buffer computations (CommandBufferScheduling names them command_buffer*) and the
    while loops inside and outside them. All zero off the GPU."""
    comps, name = {}, None
    for line in hlo_text.splitlines():
        head = line.split(" ", 2)
        if line and not line[0].isspace() and "{" in line and "(" in line:
            name = head[1] if head[0] == "ENTRY" else head[0]
            name = name.lstrip("%")
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    buffers = [n for n in comps if n.startswith("command_buffer")]
    whiles = lambda n: sum(" while(" in l for l in comps[n])  # noqa: E731
    return {"command_buffers": len(buffers),
            "whiles_in_command_buffers": sum(whiles(n) for n in buffers),
            "whiles_elsewhere": sum(whiles(n) for n in comps if n not in buffers)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--spec", action="store_true", help="the speculative engine (random drafter)")
    ap.add_argument("--steps", type=int, default=None, help="steps (iterations) per dispatch "
                    "(default: the bench's, 16 stock / 8 speculative)")
    ap.add_argument("--context", type=int, default=272, help="lanes' length in the bare rows "
                    "(the bench's mean solo context)")
    ap.add_argument("--prompt-len", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--requests", type=int, default=4, help="timed requests in the engine row")
    ap.add_argument("--reps", type=int, default=8, help="timed dispatches in the bare rows")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--draft-kv-dtype", choices=["float8_e4m3fn"])
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec.bench.run import triton_route
    from jspec.config import PRESETS
    from jspec.engine import Engine, EngineConfig, Request
    from jspec.qwen3 import init_random
    from jspec.sampling import SamplingArrays
    from jspec.steps import DecodeState

    cfg = PRESETS[args.preset].replace(dtype="bfloat16")
    steps = args.steps or (8 if args.spec else 16)
    rec = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "spec": args.spec,
           "steps_per_dispatch": steps, "context": args.context, "batch_invariant":
           args.batch_invariant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=2)

    target = init_random(cfg, seed=0)
    drafter = dcfg = None
    if args.spec:
        from jspec.dspark import dspark_8b_like_config, init_random_drafter
        dcfg = dspark_8b_like_config(cfg)
        drafter = init_random_drafter(dcfg, seed=1)
    rng = np.random.default_rng(0)

    def requests(n):
        return [Request(rng.integers(0, min(150000, cfg.vocab_size), args.prompt_len).tolist(),
                        temperature=args.temperature, max_tokens=args.max_tokens,
                        stop_on_eos=False, seed=i) for i in range(n)]

    sampling = SamplingArrays.from_lists([args.temperature], [0], [1.0], [0])
    for device_loop in (False, True):
        ecfg = EngineConfig(max_lanes=1, page_size=16, decode_steps=steps,
                            max_context=args.prompt_len + args.max_tokens + 64,
                            batch_invariant=args.batch_invariant,
                            draft_kv_dtype=args.draft_kv_dtype, device_loop=device_loop)
        eng = Engine(cfg, target, (), ecfg, drafter=drafter, draft_cfg=dcfg)
        ppl = eng.ecfg.pages_per_lane
        table = (1 + np.arange(ppl, dtype=np.int32))[None]
        state0 = jax.device_put(DecodeState(  # committed, as the engine's
            tokens=np.asarray([7], np.int32), lengths=np.asarray([args.context], np.int32),
            page_table=table, active=np.asarray([True]), remaining=np.asarray([10**6], np.int32),
            stop_on_eos=np.asarray([False]), sampling=sampling), eng._device)

        def run_bare(mode: str) -> dict:
            state = state0
            per, returned = [], []
            for i in range(args.reps + 1):
                if mode == "uploaded":
                    state = dataclasses.replace(state, page_table=jax.device_put(table, eng._device))
                t = time.perf_counter()
                eng.caches, state_out, toks, *_ = eng.programs.decode(
                    eng.params, eng.caches, state, num_steps=steps)
                t_ret = time.perf_counter() - t
                toks.block_until_ready()
                if i:  # [0]: warm-up
                    per.append((time.perf_counter() - t) / steps * 1e3)
                    returned.append(t_ret / steps * 1e3)
                if mode != "fixed":
                    # The lane must not run past its pages: back to the start length.
                    state = dataclasses.replace(state_out, lengths=state0.lengths,
                                                remaining=state0.remaining)
            return {"ms_per_step": statistics.median(per), "call_ms_per_step":
                    statistics.median(returned), "samples": per}

        tag = "device_loop" if device_loop else "host_loop"
        rec[f"{tag}/graphs"] = g = loop_in_graph(eng.programs.decode.lower(
            eng.params, eng.caches, state0, num_steps=steps).compile().as_text())
        print(f"{tag}: {g}", flush=True)
        for mode in ("fixed", "chained", "uploaded"):
            rec["rows"][f"{tag}/{mode}"] = r = run_bare(mode)
            print(f"{tag}/{mode:9s} {r['ms_per_step']:.3f} ms per step (call returns after "
                  f"{r['call_ms_per_step']:.3f})", flush=True)
            save()

        for lookahead in ((False, True) if device_loop else (False,)):
            eng.ecfg = dataclasses.replace(eng.ecfg, lookahead=lookahead)
            eng.generate(requests(1))  # warm-up: compiles prefill and what the loop needs
            eng.stats.clear()
            t = time.perf_counter()
            done = []
            for req in requests(args.requests):  # solo: one request at a time
                done += eng.generate([req])
            wall = time.perf_counter() - t
            tokens = sum(len(r.output_ids) for r in done)
            st = eng.stats
            disp = st["decode_dispatches"]
            row = {"tokens": tokens, "wall_s": wall, "ms_per_token": wall / tokens * 1e3,
                   "dispatches": disp, "lookahead_dispatches": st["lookahead_dispatches"],
                   "ms_per_dispatch": {k: st[f"time_{k}_s"] / disp * 1e3 for k in
                                       ("prefill", "prepare", "call", "wait", "emit")},
                   "state_uploads": st["state_uploads"], "state_carries": st["state_carries"]}
            name = f"{tag}/engine" + ("+lookahead" if lookahead else "")
            rec["rows"][name] = row
            print(f"{name}: {row['ms_per_token']:.3f} ms per token all-in ({tokens} tokens, "
                  f"{disp} dispatches); per dispatch (ms): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row["ms_per_dispatch"].items()),
                  flush=True)
            save()
        eng.caches = None
        del eng

    rec["triton_route"] = triton_route()
    save()


if __name__ == "__main__":
    main()
