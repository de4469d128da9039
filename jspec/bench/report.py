"""The record of `jspec bench`: assembled from the workload parts, written as JSON, a markdown
table and a PNG chart (ratios, tau and tokens/s per workload, stock vs speculative).

SpecScore (the geometric mean of the three median ratios) is reported only when every gate in
`gates` passes; otherwise it is null and `reason` names each failing gate. The gates:
  memory       busy: candidate peak <= stock peak + 4096 MiB (no statistics, e.g. CPU: fails)
  fidelity     32 fixed texts x 256 tokens: mean |log p verify - log p decode| <= 0.002
  likelihood   every timed reply of every workload (>= 200 per engine), scored by the target:
               95 % CI of the per-token log-likelihood gap intersects +-0.05, not underpowered
  argmax       the same replies: CI of the gap in the share of first choices intersects +-0.01
  lengths      the same replies: CI of the ratio of mean lengths intersects [0.95, 1.05], not
               underpowered; and no workload's own length CI may lie outside [0.95, 1.05] (a
               workload's CI that is merely wide does not fail: its sample size is the
               workload's, not the gate's)
  greedy       greedy agreement >= 0.99 (jspec's own bar; the protocol only asks to report it)
  stock_bar    solo stock tokens/s >= 85 % of the HBM bound (a weak stock inflates every ratio;
               on CPU the bound is only a number, so this gate cannot pass there)
  busy_pool    the busy KV pool was >= 90 % occupied at steady state, for both engines
  compilation  nothing recompiled during the timed passes
  protocol     not --quick (quick sizes are not the protocol's)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from jspec.bench import gate as G
from jspec.bench.workloads import WORKLOAD_ORDER

SCHEMA = "jspec-bench/1"
# Protocol section 5: the record has at least these keys, always (null when not measured).
REQUIRED_KEYS = ("ratios", "specscore", "acceptance", "efficiency", "tokens_per_s", "likelihood",
                 "argmax", "fidelity", "lengths", "greedy_agreement", "memory", "roofline", "env",
                 "reason")


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return None
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def _fmt(x, spec=".3f", none="-"):
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _gate(ok, why: str) -> dict:
    return {"ok": ok is True, "why": None if ok is True else why}


def paired_passes(part: dict) -> list[tuple[dict, dict]]:
    """A workload part's (stock pass, speculative pass) pairs, by pass index."""
    by = lambda engine: sorted((x for x in part["passes"] if x["engine"] == engine),
                               key=lambda x: x["index"])
    return list(zip(by("stock"), by("spec")))


def assemble(parts: dict, *, env: dict, warnings: list[str] | None = None,
             config: dict | None = None) -> dict:
    """The record from the parts of one run (any subset of solo / team / busy / peer)."""
    warnings = list(warnings or [])
    ratios, acceptance, efficiency, tps, lengths, details = {}, {}, {}, {}, {}, {}
    for w in WORKLOAD_ORDER:
        p = parts.get(w)
        if p is None:
            ratios[w] = {"passes": [], "ratio": None}
            acceptance[w] = efficiency[w] = None
            tps[w] = {"stock": None, "spec": None}
            lengths[w] = {"ratio": None, "low": None, "high": None, "ok": False, "why": "not run"}
            continue
        pairs = paired_passes(p)
        st, sp = [a for a, _ in pairs], [b for _, b in pairs]
        pr = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(st, sp)]
        ratio = _median(pr)
        tau = p["verify"]["tau"]
        ratios[w] = {"passes": pr, "ratio": ratio}
        acceptance[w] = tau
        efficiency[w] = ratio / tau if ratio is not None and tau else None
        tps[w] = {"stock": _median([a["tokens_per_s"] for a in st]),
                  "spec": _median([b["tokens_per_s"] for b in sp]),
                  "stock_passes": [a["tokens_per_s"] for a in st],
                  "spec_passes": [b["tokens_per_s"] for b in sp]}
        reps = p["replies"]
        lengths[w] = G.replies_lengths_check([r for r in reps if r["engine"] == "spec"],
                                             [r for r in reps if r["engine"] == "stock"])
        peak = p.get("peak_memory")
        details[w] = {
            "lanes": p["spec"]["lanes"], "prompts": p["spec"]["num_prompts"],
            "max_new_tokens": p["spec"]["max_new_tokens"], "prompt_tokens": p["prompt_tokens"],
            "engine": p["engine"], "pool": p["pool"], "recompiled": p["recompiled"],
            "wall_s": {"stock": [a["wall_s"] for a in st], "spec": [b["wall_s"] for b in sp]},
            "tokens": {"stock": [a["tokens"] for a in st], "spec": [b["tokens"] for b in sp]},
            "preemptions": {"stock": sum(a["preemptions"] for a in st),
                            "spec": sum(b["preemptions"] for b in sp)},
            # per pass: the engine's wall time by phase (host vs device share of a dispatch)
            "engine_time": {"stock": [a.get("engine_time") for a in st],
                            "spec": [b.get("engine_time") for b in sp]},
            "acceptance_per_position": p["verify"]["acceptance_per_position"],
            "verify_steps": p["verify"]["steps"],
            # DSpark's prefix rule: its threshold and the drafts a verify step verified on average
            "verify_threshold": p["verify"].get("threshold"),
            "drafts_per_step": p["verify"].get("drafts_per_step"),
            # how the accept length was decided (records before the knob: draft by draft)
            "verify_rule": p["verify"].get("rule", "token"),
            "peak_mib": None if not peak else {
                "stock": peak["stock"] / 2 ** 20, "spec": peak["spec"] / 2 ** 20,
                "exact": {"stock": peak["stock_exact"], "spec": peak["spec_exact"]}},
            "scored": p.get("scored", False), "warmup_s": p.get("warmup_s"),
            "command": p.get("command"), "date": (p.get("env") or {}).get("date"),
        }

    # Sampled replies: every workload's replies, both engines, scored by the target.
    all_replies = [r for w in WORKLOAD_ORDER if parts.get(w) for r in parts[w]["replies"]]
    cand = [r for r in all_replies if r["engine"] == "spec"]
    stock = [r for r in all_replies if r["engine"] == "stock"]
    likelihood = G.likelihood_check(cand, stock)
    argmax = G.argmax_check(cand, stock)
    lengths["all"] = G.replies_lengths_check(cand, stock, min_replies=G.MIN_REPLIES)
    unscored = [w for w in WORKLOAD_ORDER if parts.get(w) and not parts[w].get("scored")]

    solo, team, busy = (parts.get(w) for w in WORKLOAD_ORDER)
    fidelity = (solo or {}).get("extras", {}).get("fidelity") or {
        "mean": None, "max": None, "ok": False, "why": "solo not run"}
    greedy = (team or {}).get("extras", {}).get("greedy") or {
        "mean": None, "ok": False, "why": "team not run"}
    memory = (busy or {}).get("extras", {}).get("memory") or {
        "peak_mib_stock": None, "peak_mib_spec": None, "allowed_mib": None, "ok": None,
        "note": "busy not run"}
    roof = dict((solo or {}).get("extras", {}).get("roofline") or {})
    fraction = None
    if roof and tps["solo"]["stock"]:
        fraction = tps["solo"]["stock"] / roof["hbm_bound_tokens_per_s"]
    roofline = {"solo_stock_fraction": fraction, **roof,
                "bar": G.STOCK_HBM_BAR,
                "note": "solo stock tokens/s (prefill included) over copy bandwidth / bytes a decode "
                        "step reads (target weights but the embedding, plus KV at the mean context)"}
    if roof.get("device") == "cpu":
        roofline["note"] += "; device: cpu, so the bound is only a number"

    peer_part = parts.get("peer")
    peer = {"status": "not run", "reason": "no peer part in this run", "tokens_per_s": None}
    if peer_part:
        peer = {k: v for k, v in peer_part.items() if k not in ("key", "part")}
        if peer.get("tokens_per_s") and tps["solo"]["stock"]:
            peer["stock_over_peer"] = tps["solo"]["stock"] / peer["tokens_per_s"]

    # ---- the gates ----
    gates = {}
    if memory.get("ok") is None:
        why = memory.get("note") or "no device memory statistics"
    else:
        why = (f"candidate peak {_fmt(memory['peak_mib_spec'], '.0f')} MiB > stock "
               f"{_fmt(memory['peak_mib_stock'], '.0f')} MiB + {G.MEMORY_ALLOWANCE_MIB:.0f} MiB")
    gates["memory"] = _gate(memory.get("ok"), why)
    gates["fidelity"] = _gate(fidelity.get("ok"), fidelity.get("why") or (
        f"mean |d log p| {_fmt(fidelity.get('mean'), '.2e')} > {G.FIDELITY_MEAN_LIMIT}"))
    for name, chk in (("likelihood", likelihood), ("argmax", argmax)):
        gates[name] = _gate(chk["ok"] and not unscored, _interval_why(chk, unscored))
    bad_w = [w for w in WORKLOAD_ORDER if parts.get(w) and lengths[w].get("low") is not None
             and not lengths[w]["intersects"]]
    why = _interval_why(lengths["all"], [])
    if bad_w:
        why = f"length ratio CI outside [0.95, 1.05] in {', '.join(bad_w)}"
    gates["lengths"] = _gate(lengths["all"]["ok"] and not bad_w, why)
    gates["greedy"] = _gate(greedy.get("ok"), greedy.get("why") or (
        f"greedy agreement {_fmt(greedy.get('mean'))} < {G.GREEDY_BAR}"))
    if not roof:
        gates["stock_bar"] = _gate(False, "solo not run")
    elif roof.get("device") == "cpu":
        gates["stock_bar"] = _gate(False, "device: cpu (the HBM bar is for accelerators)")
    else:
        gates["stock_bar"] = _gate(fraction is not None and fraction >= G.STOCK_HBM_BAR,
                                   f"stock solo at {_fmt(fraction, '.2f')} of the HBM bound "
                                   f"(< {G.STOCK_HBM_BAR})")
    if busy:
        occ = busy["pool"]["occupancy"]
        low = [e for e in ("stock", "spec") if occ.get(e) is None or occ[e] < G.BUSY_MIN_OCCUPANCY]
        gates["busy_pool"] = _gate(not low, "busy KV pool occupancy " + ", ".join(
            f"{e} {_fmt(occ.get(e), '.2f')}" for e in ("stock", "spec")) +
            f" (< {G.BUSY_MIN_OCCUPANCY} at steady state)")
    else:
        gates["busy_pool"] = _gate(False, "busy not run")
    rec = [w for w in WORKLOAD_ORDER if parts.get(w) and parts[w]["recompiled"]]
    gates["compilation"] = _gate(not rec, f"recompiled during the timed passes of {', '.join(rec)}")
    quick = bool((config or {}).get("quick"))
    gates["protocol"] = _gate(not quick, "--quick: not the protocol's workload sizes")

    score, reason = G.specscore({w: ratios[w]["ratio"] for w in WORKLOAD_ORDER}, gates)
    if unscored:
        warnings.append(f"replies of {', '.join(unscored)} not scored yet")
    commands = {w: parts[w].get("command") for w in (*WORKLOAD_ORDER, "peer") if parts.get(w)}
    record = {
        "schema": SCHEMA,
        "ratios": ratios, "specscore": score, "acceptance": acceptance, "efficiency": efficiency,
        "tokens_per_s": tps, "likelihood": likelihood, "argmax": argmax, "fidelity": fidelity,
        "lengths": lengths, "greedy_agreement": greedy.get("mean"), "greedy": greedy,
        "memory": memory, "roofline": roofline, "peer": peer, "gates": gates,
        "workloads": details, "env": {**env, "commands": commands}, "config": config or {},
        "warnings": warnings, "reason": reason,
    }
    return _clean(record)


def _interval_why(chk: dict, unscored: list[str]) -> str:
    if unscored:
        return f"replies of {', '.join(unscored)} not scored"
    if chk.get("too_few_replies"):
        n = chk.get("replies") or chk.get("n") or {}
        return (f"too few replies ({n.get('candidate')} / {n.get('stock')}; "
                f"need {G.MIN_REPLIES} per engine)")
    if chk.get("low") is None:
        return "not measured"
    if chk.get("underpowered"):
        return (f"underpowered: 95 % half-width {_fmt((chk['high'] - chk['low']) / 2, '.4f')} "
                f"> twice the margin")
    return (f"95 % CI [{_fmt(chk['low'], '.4f')}, {_fmt(chk['high'], '.4f')}] outside "
            f"[{chk['band'][0]}, {chk['band'][1]}]")


def _clean(x):
    """NaN / inf -> None, tuples -> lists: strict JSON."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):  # numpy scalars
        return _clean(x.item())
    return x


# ---- markdown ---------------------------------------------------------------------------------

def markdown(rec: dict) -> str:
    env = rec.get("env") or {}
    out = ["# jspec bench", ""]
    if rec.get("specscore") is not None:
        out.append(f"**SpecScore {rec['specscore']:.3f}** (geometric mean of the median ratios; "
                   "every gate passed)")
    else:
        out.append(f"**SpecScore: null** ({rec.get('reason')})")
    out += ["", f"GPU: {env.get('gpu') or env.get('device')} | jax {env.get('jax')} / jaxlib "
            f"{env.get('jaxlib')} | commit {(env.get('commit') or '?')[:12]}"
            f"{' (dirty)' if env.get('dirty') else ''} | {env.get('date')} | sampling "
            f"{(rec.get('config') or {}).get('sampling', {}).get('name')}"]
    facts = env.get("gpu_facts")
    if facts:  # what can make two GPUs of one name decode at different speeds
        out.append("GPU state (nvidia-smi): " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    out += ["", f"`{env.get('command')}`", ""]
    out += ["| workload | lanes | prompts | new tokens | pass ratios | ratio | tau | drafts / step "
            "| eta | stock tok/s | spec tok/s | peak MiB stock / spec | length ratio [95 % CI] |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in WORKLOAD_ORDER:
        d = (rec.get("workloads") or {}).get(w)
        r, t, L = rec["ratios"][w], rec["tokens_per_s"][w], rec["lengths"][w]
        if not d:
            out.append(f"| {w} | - | - | - | not run | - | - | - | - | - | - | - | - |")
            continue
        peak = d.get("peak_mib") or {}
        out.append(
            f"| {w} | {d['lanes']} | {d['prompts']} | {d['max_new_tokens']} | "
            f"{', '.join(_fmt(x, '.2f') for x in r['passes'])} | {_fmt(r['ratio'], '.2f')} | "
            f"{_fmt(rec['acceptance'][w], '.2f')} | {_fmt(d.get('drafts_per_step'), '.2f')} | "
            f"{_fmt(rec['efficiency'][w], '.2f')} | "
            f"{_fmt(t['stock'], '.1f')} | {_fmt(t['spec'], '.1f')} | "
            f"{_fmt(peak.get('stock'), '.0f')} / {_fmt(peak.get('spec'), '.0f')} | "
            f"{_fmt(L.get('ratio'))} [{_fmt(L.get('low'))}, {_fmt(L.get('high'))}] |")
    g = rec["gates"]
    lk, am, la, fi, me = rec["likelihood"], rec["argmax"], rec["lengths"]["all"], rec["fidelity"], rec["memory"]
    ro = rec["roofline"]
    ok = lambda name: "pass" if g[name]["ok"] else f"FAIL: {g[name]['why']}"
    out += ["", "## Lossless gate", "", "| check | value | 95 % CI | limit | result |",
            "|---|---|---|---|---|",
            f"| device memory (busy) | spec {_fmt(me.get('peak_mib_spec'), '.0f')} MiB, stock "
            f"{_fmt(me.get('peak_mib_stock'), '.0f')} MiB | | spec <= stock + 4096 MiB | {ok('memory')} |",
            f"| fixed texts' log-probs | mean {_fmt(fi.get('mean'), '.2e')}, max "
            f"{_fmt(fi.get('max'), '.2e')} | | mean <= 0.002 | {ok('fidelity')} |",
            f"| sampled replies' likelihood (spec - stock, nats/token) | {_fmt(lk.get('gap'), '.4f')} "
            f"| [{_fmt(lk.get('low'), '.4f')}, {_fmt(lk.get('high'), '.4f')}] | intersects +-0.05 | "
            f"{ok('likelihood')} |",
            f"| share of first choices (spec - stock) | {_fmt(am.get('gap'), '.4f')} | "
            f"[{_fmt(am.get('low'), '.4f')}, {_fmt(am.get('high'), '.4f')}] | intersects +-0.01 | "
            f"{ok('argmax')} |",
            f"| reply lengths (spec / stock, all) | {_fmt(la.get('ratio'))} | [{_fmt(la.get('low'))}, "
            f"{_fmt(la.get('high'))}] | intersects [0.95, 1.05] | {ok('lengths')} |",
            f"| greedy agreement | {_fmt(rec.get('greedy_agreement'), '.4f')} | | >= 0.99 | {ok('greedy')} |",
            f"| stock vs HBM bound (solo) | {_fmt(ro.get('solo_stock_fraction'), '.3f')} | | >= 0.85 | "
            f"{ok('stock_bar')} |",
            f"| busy KV pool occupancy | "
            f"{_occ(rec)} | | >= 0.90 | {ok('busy_pool')} |",
            f"| no recompilation in timed passes | | | | {ok('compilation')} |",
            f"| protocol workload sizes | | | | {ok('protocol')} |"]
    rep = lk.get("replies") or {}
    out += ["", f"Replies scored: {rep.get('candidate')} candidate / {rep.get('stock')} stock "
            f"(paired by prompt and pass: {lk.get('paired')})."]
    if ro.get("hbm_bound_tokens_per_s"):
        out.append(f"Roofline: copy bandwidth {_fmt(ro.get('copy_bandwidth_GBps'), '.1f')} GB/s, "
                   f"{_fmt(ro.get('bytes_per_step', 0) / 1e6, '.1f')} MB per decode step at mean "
                   f"context {_fmt(ro.get('mean_context'), '.0f')}: bound "
                   f"{_fmt(ro['hbm_bound_tokens_per_s'], '.1f')} tok/s ({ro.get('device')}).")
    out += _host_lines(rec)
    peer = rec.get("peer") or {}
    if peer.get("tokens_per_s"):
        out.append(f"Peer (transformers {peer.get('transformers')}, {peer.get('mode')}): "
                   f"{peer['tokens_per_s']:.1f} tok/s at solo; stock / peer = "
                   f"{_fmt(peer.get('stock_over_peer'), '.2f')}.")
    else:
        out.append(f"Peer: {peer.get('status')} ({peer.get('reason')}).")
    for w in rec.get("warnings") or []:
        out.append(f"Warning: {w}")
    return "\n".join(out) + "\n"


def _occ(rec):
    d = (rec.get("workloads") or {}).get("busy")
    if not d:
        return "-"
    o = d["pool"]["occupancy"]
    return f"stock {_fmt(o.get('stock'), '.3f')}, spec {_fmt(o.get('spec'), '.3f')}"


# ---- chart --------------------------------------------------------------------------------------

def chart(rec: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(WORKLOAD_ORDER)
    x = np.arange(len(names))
    nan = lambda v: np.nan if v is None else v
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    ax.bar(x, [nan(rec["ratios"][w]["ratio"]) for w in names], color="tab:green", alpha=0.7,
           label="median")
    for i, w in enumerate(names):
        ps = rec["ratios"][w]["passes"]
        ax.scatter([i] * len(ps), ps, color="k", s=12, zorder=3, label="passes" if i == 0 else None)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xticks(x, names)
    ax.set_title("speed-up spec / stock")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(x, [nan(rec["acceptance"][w]) for w in names], color="tab:purple", alpha=0.7)
    ax.set_xticks(x, names)
    ax.set_title("tau: tokens per verify step")
    ax = axes[2]
    wdt = 0.38
    ax.bar(x - wdt / 2, [nan(rec["tokens_per_s"][w]["stock"]) for w in names], wdt, label="stock")
    ax.bar(x + wdt / 2, [nan(rec["tokens_per_s"][w]["spec"]) for w in names], wdt, label="spec")
    peer = (rec.get("peer") or {}).get("tokens_per_s")
    if peer:
        ax.scatter([0 - wdt], [peer], marker="x", color="k", label="peer (transformers)", zorder=3)
    ax.set_xticks(x, names)
    ax.set_title("tokens/s (all lanes)")
    ax.legend(fontsize=8)
    env = rec.get("env") or {}
    score = rec.get("specscore")
    fig.suptitle(f"jspec bench: SpecScore {'null' if score is None else f'{score:.3f}'} | "
                 f"{env.get('gpu') or env.get('device')} | {(env.get('commit') or '?')[:10]}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(rec: dict, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    assert not missing, missing
    (out_dir / "bench.json").write_text(json.dumps(rec, indent=2, allow_nan=False) + "\n")
    try:
        chart(rec, out_dir / "bench.png")
    except ImportError as e:  # the record and the table matter more than the picture
        rec["warnings"] = list(rec.get("warnings") or []) + [f"no chart: {e}"]
        (out_dir / "bench.json").write_text(json.dumps(rec, indent=2, allow_nan=False) + "\n")
    (out_dir / "bench.md").write_text(markdown(rec))


def _host_lines(rec: dict) -> list[str]:
    """Per workload and engine: host milliseconds per decode dispatch (arrays in, the jitted
    call, bookkeeping out) against the wait for the device, summed over the passes."""
    out = []
    for w in WORKLOAD_ORDER:
        times = ((rec.get("workloads") or {}).get(w) or {}).get("engine_time") or {}
        cells = []
        for e in ("stock", "spec"):
            ts = [t for t in times.get(e) or [] if t]
            n = sum(t["decode_dispatches"] for t in ts)
            if not n:
                continue
            host = sum(t["prepare_s"] + t["call_s"] + t["emit_s"] for t in ts)
            wait = sum(t["wait_s"] for t in ts)
            cells.append(f"{e} {1e3 * host / n:.2f} ms host + {1e3 * wait / n:.2f} ms waiting per "
                         f"dispatch ({n} dispatches)")
        if cells:
            out.append(f"Host ({w}): " + "; ".join(cells) + ".")
    return out
