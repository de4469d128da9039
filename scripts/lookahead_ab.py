"""Look-ahead through admissions (EngineConfig.lookahead_admission), A/B on one machine.

The bench's workloads (team, busy: the ones where requests wait for a lane) on one pair of
engines, with the option off and on in turn: rounds of off, on, on, off, ... (ABBA, so a drift of
the machine falls on both), each a stock and a speculative pass. A pass of either setting uses the
seeds of the bench's pass of the same index, so both settings must emit the same tokens: the
script records whether they did. No gates run: the bench does that; this times the one knob in
a fraction of a bench stage's device time.

It takes `jspec bench`'s options (the engines are built exactly as the bench builds them;
--lookahead-admission is ignored) plus --rounds:

  python3 scripts/lookahead_ab.py --model /tmp/graft/target --draft /tmp/graft/dspark \\
      --out /tmp/la-ab --workloads team,busy --batch-invariant --draft-kv-dtype float8_e4m3fn \\
      --num-draft-tokens team=3,busy=3 --prefill-chunk 512 --draft-weight-dtype solo=int8,team=int8

Writes OUT/lookahead_ab.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse(argv=None):
    from jspec.bench.run import add_bench_parser
    top = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p = add_bench_parser(top.add_subparsers(dest="cmd"))
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of each setting (default 2: off, on, on, off)")
    args = top.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in names if w not in ("team", "busy", "solo")]
    if bad or not names:
        raise SystemExit(f"--workloads: solo, team or busy, not {bad or 'nothing'}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    args.lookahead_admission = False
    return args, names


def settings_order(rounds: int) -> list[bool]:
    """off, on, on, off, off, on, ...: each setting's passes centred on the same time."""
    return [bool((i % 4) in (1, 2)) for i in range(2 * rounds)]


def summarize(passes: list[dict]) -> dict:
    """Median tokens/s by (engine, setting), the spec / stock ratio of each setting, and each
    engine's gain from the option."""
    med = {}
    for eng in ("stock", "spec"):
        for la in (False, True):
            tps = [p["tokens_per_s"] for p in passes if p["engine"] == eng and p["lookahead_admission"] == la]
            med[f"{eng}_{'on' if la else 'off'}"] = statistics.median(tps) if tps else None
    out = {"median_tokens_per_s": med}
    if all(v for v in med.values()):
        out["ratio"] = {"off": med["spec_off"] / med["stock_off"], "on": med["spec_on"] / med["stock_on"]}
        out["gain"] = {"stock": med["stock_on"] / med["stock_off"], "spec": med["spec_on"] / med["spec_off"]}
    return out


def main(argv=None) -> dict:
    args, names = parse(argv)
    import jax

    from jspec.bench import workloads as W
    from jspec.bench.run import Bench
    from jspec.engine import Engine
    from jspec.standin import resolve_drafter, resolve_model

    args.given = (args.model, args.draft)
    args.model, args.draft = str(resolve_model(args.model)), str(resolve_drafter(args.draft))
    bench = Bench(args, names)
    bench.env = bench.base_env(device=True)
    bench.load()
    record = {"command": "python3 scripts/lookahead_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "env": bench.env, "rounds": args.rounds, "workloads": {}}
    eos = bench.tokenizer.eos_ids
    for name in names:
        plan = bench.plan(bench.specs[name])
        spec, prompts = plan["spec"], plan["prompts"]
        ecfg_stock, ecfg_spec = plan["ecfg"]

        def build(ecfg, **kw):
            e = Engine(bench.cfg, bench.model, eos, ecfg, **kw)
            e.caches = jax.device_put(e.caches, jax.devices()[0])  # as the bench: no 2nd compile
            return e

        engines = {"stock": build(ecfg_stock),
                   "spec": build(ecfg_spec, drafter=bench.drafter, draft_cfg=bench.dcfg,
                                 num_draft=bench.num_draft[name],
                                 draft_vocab_ids=bench.draft_vocab_ids)}
        base = {n: e.ecfg for n, e in engines.items()}

        def set_la(on: bool):
            for n, e in engines.items():
                e.ecfg = dataclasses.replace(base[n], lookahead_admission=on)

        for on in (False, True):  # warm both settings: the merge program compiles on first use
            set_la(on)
            for n, e in engines.items():
                bench.warm(e, spec, prompts, n)
        warm_merges = {n: e.stats["state_merges"] for n, e in engines.items()}
        passes, outputs = [], {}
        for i, on in enumerate(settings_order(args.rounds)):
            set_la(on)
            index = i // 2  # the bench's pass index: its seeds, shared by both settings
            for n in ("stock", "spec"):
                seeds = [W.request_seed(spec.name, index, n, j) for j in range(len(prompts))]
                reqs = W.make_requests(prompts, spec.max_new_tokens, bench.sampling, seeds)
                r = W.timed_pass(engines[n], reqs, engine_name=n, index=index,
                                 desc=f"{name} {n} la={'on' if on else 'off'}",
                                 progress=bench.progress)
                outputs.setdefault((n, index), {})[on] = r.outputs
                tau = None
                if n == "spec":
                    steps = [k for req in r.step_tokens for k in req]
                    tau = sum(steps) / len(steps)
                passes.append({"engine": n, "lookahead_admission": on, "index": index,
                               "wall_s": r.wall_s, "tokens": r.tokens,
                               "tokens_per_s": r.tokens_per_s, "tau": tau,
                               "preemptions": r.preemptions, "engine_time": r.timing})
                print(f"{name} {n:5s} la={'on ' if on else 'off'} pass {index}: "
                      f"{r.tokens_per_s:8.1f} tok/s, wall {r.wall_s:6.2f} s", flush=True)
        same = [outs[False] == outs[True] for outs in outputs.values() if len(outs) == 2]
        record["workloads"][name] = {"passes": passes, **summarize(passes),
                                     "outputs_equal": all(same), "pairs_compared": len(same),
                                     "warmup_state_merges": warm_merges,
                                     "stats": {n: {k: v for k, v in e.stats.items()
                                                   if k in ("admissions_ahead", "lookahead_dispatches",
                                                            "decode_dispatches")}
                                               for n, e in engines.items()}}
        del engines
        gc.collect()
        print(json.dumps({k: v for k, v in record["workloads"][name].items() if k != "passes"}),
              flush=True)
        out = Path(args.out) / "lookahead_ab.json"  # after each workload: a cut-off run keeps it
        out.write_text(json.dumps(record, indent=1))
        print(f"wrote {out}", flush=True)
    return record


if __name__ == "__main__":
    main()
