"""`jspec bench`: SpecScore and the lossless gate (protocol.md), one JSON record, a markdown table
and a PNG chart.

    jspec bench --model DIR --draft DIR --out DIR [--workloads solo,team,busy[,peer]]
                [--sampling t1|greedy|qwen] [--quick]

One process loads the target once and builds, per workload, a stock Engine and a speculative
Engine over the same model object (the same weight arrays), then runs them alternately. What
each workload adds to the gate:
  solo   the roofline (copy bandwidth measured at the start of the process) and the fixed-text
         fidelity check (teacher-forced through the solo engines: stock decode, candidate verify);
  team   greedy agreement (greedy replies of both team engines);
  busy   the device-memory check (same pool, peaks of both engines);
  every  its sampled replies, scored at the end of the process by the target's dense forward
         (the reference computation, independent of both engines' paged paths; the same scorer
         for both), for the likelihood, first-choice and length checks.
  peer   transformers + PyTorch at solo, in a subprocess run before JAX touches the device.

Each workload writes OUT/parts/<workload>.json as soon as it is measured (and again once its
replies are scored); every invocation then assembles OUT/bench.json, bench.md and bench.png from
all parts in OUT that belong to the same run (same model, drafter, sampling, knobs, commit). So a
run too long for one command can be split: `--workloads peer`, `--workloads solo --peer off`,
`--workloads team`, `--workloads busy` into one --out give the same record as one invocation.

Peak device memory: JAX's allocator statistics keep one process-wide peak. The stock engine is
built and warmed first; its peak is the process peak then, minus the drafter's own weights (loaded
at start and resident throughout, but not stock's: counting them for stock would hide them from
the difference). The speculative engine is built next
while stock's KV pool is still alive, so its peak is the process peak after its warm-up minus
the bytes of stock's pool (an upper bound if the peak did not rise; `exact` says which).
Workloads run in ascending footprint (solo, team, busy), so busy's peaks are new highs. On CPU
JAX has no device statistics: memory is null, and the memory gate cannot pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from jspec.bench import gate as G
from jspec.bench import workloads as W
from jspec.config import SPEC_DECODE_STEPS, STOCK_DECODE_STEPS
from jspec.kernels.linear import mma_family_from_env

REPO_ROOT = Path(__file__).resolve().parents[2]


def peer_process(job_path: Path, res_path: Path) -> tuple[list[str], dict]:
    """argv and environment of the peer's subprocess: jspec/bench/peer.py run by path with -P
    and the repo root dropped from PYTHONPATH. It needs only torch and transformers, and with the
    root on its path transformers' start-up check finds this repo's kernels/ as the top-level
    `kernels` package, imports it and fails where Hugging Face's `kernels` is not installed
    (the GPU machine, 2026-12-06: docs/benchmarks.md)."""
    root = os.path.abspath(REPO_ROOT)
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.abspath(p) != root]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    return ([sys.executable, "-P", str(Path(__file__).with_name("peer.py")), "--job",
             str(Path(job_path).resolve()), "--out", str(Path(res_path).resolve())], env)


# ---- command line -----------------------------------------------------------------------------

def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="SpecScore and the lossless gate: stock vs speculative "
                              "on solo / team / busy (protocol.md)")
    p.add_argument("--model", required=True, help="target directory (Hugging Face or jspec), "
                   "or standin")
    p.add_argument("--draft", required=True, help="DSpark / DFlash drafter directory, or "
                   "standin-dspark / standin-dflash")
    p.add_argument("--out", required=True, help="output directory: bench.json, bench.md, "
                   "bench.png, parts/")
    p.add_argument("--workloads", default="solo,team,busy",
                   help="comma list of solo, team, busy, peer (default solo,team,busy; the "
                   "transformers peer runs with solo unless --peer off)")
    p.add_argument("--sampling", default="t1", choices=sorted(W.SAMPLING),
                   help="t1: temperature 1 (headline); greedy; qwen: T 0.7, top-p 0.8, top-k 20")
    p.add_argument("--quick", action="store_true", help="a small CPU-scale run of the whole "
                   "pipeline (the gates are underpowered then)")
    p.add_argument("--num-draft-tokens", metavar="K | solo=K,team=K,busy=K",
                   help="drafts verified per step, for every workload or per workload (one not "
                   "named verifies the drafter's whole block, the default). Fewer verify rows "
                   "cost less where the verify GEMM is compute-bound (busy's 256 rows); lossless "
                   "at any K")
    p.add_argument("--verify-threshold", metavar="T | solo=T,team=T,busy=T",
                   help="DSpark's prefix rule, for every workload or per workload (0, the "
                   "default: verify every draft): each lane verifies the drafts whose cumulative "
                   "confidence stays >= T, packed into the smallest static verify size that "
                   "holds them (EngineConfig.verify_threshold; lossless at any T)")
    p.add_argument("--verify-rule", default="block", choices=["block", "token"],
                   help="how the verifier decides the accept length: block verification (the "
                   "default; never fewer accepted drafts in expectation) or draft by draft; both "
                   "lossless (EngineConfig.verify_rule)")
    p.add_argument("--peer", default="auto", choices=["auto", "on", "off"],
                   help="transformers peer with solo: auto = on unless --quick")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--stock-decode-steps", type=int, default=STOCK_DECODE_STEPS,
                   help="decode steps per dispatch")
    p.add_argument("--spec-decode-steps", type=int, default=SPEC_DECODE_STEPS,
                   help="speculative iterations per dispatch (jspec.config says why 8)")
    p.add_argument("--attn-impl", default="auto", choices=["auto", "xla", "triton"])
    p.add_argument("--batch-invariant", action="store_true", help="GPU: the target's matmuls and "
                   "attention through batch-invariant kernels in both engines (verify rows and "
                   "decode rows compute the same bits)")
    p.add_argument("--invariant-prefill", action="store_true", help="with --batch-invariant: "
                   "prefill through the batch-invariant kernels too (default: XLA's GEMMs; "
                   "EngineConfig.invariant_prefill says why either is exact)")
    p.add_argument("--draft-kv-dtype", choices=["float8_e4m3fn"], help="the drafter's KV pool "
                   "dtype (default: the model's); float8_e4m3fn halves it (acceptance may change, "
                   "the output distribution does not)")
    p.add_argument("--draft-weight-dtype", metavar="int8 | solo=int8,team=int8,busy=none",
                   help="the drafter's layers, fc and Markov W2 as int8 with a scale per output "
                   "channel, for every workload or per workload (one not named, or 'none': the "
                   "model dtype); jspec/draft_weights.py. int8 GEMMs win at few rows and lose at "
                   "busy's 256 drafter rows on the H100 (docs/benchmarks.md); acceptance may "
                   "change, the output distribution does not")
    p.add_argument("--draft-linear", metavar="triton | solo=triton,team=triton",
                   help="the drafter's matmuls on jspec's linear kernel (GPU; it reads int8 "
                   "weights itself) instead of XLA's GEMMs, for every workload or per workload "
                   "(one not named, or 'xla': XLA's); EngineConfig.draft_linear. Speed only: "
                   "the output distribution does not change")
    p.add_argument("--draft-vocab", type=int, metavar="N", help="the drafter proposes only the N "
                   "most frequent token ids, ranked in DRAFT/draft_vocab.json (jspec/draft_vocab.py;"
                   " acceptance may change, the output distribution does not)")
    p.add_argument("--lookahead-admission", action="store_true",
                   help="both engines also look ahead while requests wait: requests seated in "
                   "freed lanes join the dispatch after the running one, their first tokens "
                   "merged on the device (EngineConfig.lookahead_admission; the same outputs)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="target dtype (default: the checkpoint's)")
    p.add_argument("--fresh", action="store_true", help="delete earlier parts in --out first")
    p.add_argument("--merge-parts", action="append", default=[], metavar="DIR",
                   help="copy into --out the parts in DIR/parts that belong to this run (same model, "
                   "drafter, sampling, knobs, commit): a run split over several GPUs, each with "
                   "its own --out, becomes one record (repeatable; a later DIR's part replaces the "
                   "same part from an earlier one). With --workloads none: only merge and assemble")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_bench)
    return p


def verify_rule(args) -> str:
    """--verify-rule; records made before it existed (and Namespaces without it) used "token"."""
    return getattr(args, "verify_rule", None) or "token"


def command_line(args) -> str:
    """The invocation, every option explicit, so the record says exactly how to reproduce it."""
    model, draft = getattr(args, "given", (args.model, args.draft))  # as typed (names too)
    words = ["jspec", "bench", "--model", str(model), "--draft", str(draft), "--out",
             str(args.out), "--workloads", args.workloads, "--sampling", args.sampling]
    if args.quick:
        words.append("--quick")
    if args.num_draft_tokens is not None:
        words += ["--num-draft-tokens", str(args.num_draft_tokens)]
    if getattr(args, "verify_threshold", None) is not None:
        words += ["--verify-threshold", str(args.verify_threshold)]
    words += ["--verify-rule", verify_rule(args)]
    words += ["--peer", args.peer, "--page-size", str(args.page_size), "--prefill-chunk",
              str(args.prefill_chunk), "--stock-decode-steps", str(args.stock_decode_steps),
              "--spec-decode-steps", str(args.spec_decode_steps), "--attn-impl", args.attn_impl]
    if args.dtype:
        words += ["--dtype", args.dtype]
    if args.batch_invariant:
        words.append("--batch-invariant")
    if getattr(args, "invariant_prefill", False):
        words.append("--invariant-prefill")
    if args.draft_kv_dtype:
        words += ["--draft-kv-dtype", args.draft_kv_dtype]
    if getattr(args, "draft_weight_dtype", None):
        words += ["--draft-weight-dtype", args.draft_weight_dtype]
    if getattr(args, "draft_linear", None):
        words += ["--draft-linear", args.draft_linear]
    if getattr(args, "draft_vocab", None):
        words += ["--draft-vocab", str(args.draft_vocab)]
    if getattr(args, "lookahead_admission", False):
        words.append("--lookahead-admission")
    return " ".join(shlex.quote(w) for w in words)


def cmd_bench(args) -> int:
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in names if w not in (*W.WORKLOAD_ORDER, "peer")]
    merge_only = names == ["none"] and bool(args.merge_parts)
    if merge_only:
        names, bad = [], []
    if bad or not (names or merge_only):
        raise ValueError(f"--workloads: unknown {bad or 'empty'}; choose from solo, team, busy, peer "
                         f"(or none, with --merge-parts)")
    if getattr(args, "invariant_prefill", False) and not args.batch_invariant:
        raise ValueError("--invariant-prefill needs --batch-invariant")
    for flag in ("page_size", "prefill_chunk", "stock_decode_steps", "spec_decode_steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    # Refused before any model loads.
    parse_per_workload_choice(getattr(args, "draft_weight_dtype", None), "--draft-weight-dtype",
                              ("int8",))
    draft_linear_choice(args)
    from jspec.standin import resolve_drafter, resolve_model
    args.given = (args.model, args.draft)
    args.model, args.draft = str(resolve_model(args.model)), str(resolve_drafter(args.draft))
    bench = Bench(args, names)
    record = bench.run()
    print(summary_text(record))
    print(f"wrote {bench.out / 'bench.json'}, bench.md, bench.png")
    return 0


def _workload_items(value, flag: str, what: str) -> list[tuple[str, str, str]]:
    """A per-workload option's items as (item, workload, value text): "V" names every
    workload, "solo=V,busy=V" the named ones. Refuses an empty option or an unknown workload."""
    items = [w.strip() for w in str(value).strip().split(",") if w.strip()]
    if not items:
        raise ValueError(f"{flag}: empty")
    if len(items) == 1 and "=" not in items[0]:
        items = [f"{name}={items[0]}" for name in W.WORKLOAD_ORDER]
    out = []
    for item in items:
        name, sep, v = (x.strip() for x in item.partition("="))
        if not sep or name not in W.WORKLOAD_ORDER:
            raise ValueError(f"{flag}: {item!r} is neither {what} nor WORKLOAD={what} with "
                             f"WORKLOAD one of {', '.join(W.WORKLOAD_ORDER)}")
        out.append((item, name, v))
    return out


def parse_per_workload(value, flag: str, kind, default, bounds, what: str = "V") -> dict:
    """A per-workload option -> {workload: value}: None = the default everywhere; "V" = V
    everywhere; "solo=V,busy=V" = per workload (the rest: the default). `bounds` (low, high)
    with high exclusive for floats and inclusive for ints."""
    out = {name: default for name in W.WORKLOAD_ORDER}
    if value is None:
        return out
    low, high = bounds
    for item, name, v in _workload_items(value, flag, what):
        try:
            v = kind(v)
        except ValueError:
            raise ValueError(f"{flag}: {item!r}: {what} must be "
                             f"{'an integer' if kind is int else 'a number'}") from None
        inside = low <= v <= high if kind is int else low <= v < high
        if not inside:
            span = f"{low}..{high}" if kind is int else f"[{low}, {high})"
            raise ValueError(f"{flag}: {item!r}: {what} must be in {span}")
        out[name] = v
    return out


def parse_per_workload_choice(value: str | None, flag: str, choices: tuple[str, ...]) -> dict:
    """As parse_per_workload for a named choice: None = None everywhere; "C" = C everywhere;
    "solo=C,team=C" = per workload (the rest: None); "none" names the default explicitly."""
    out = {name: None for name in W.WORKLOAD_ORDER}
    if value is None:
        return out
    for item, name, v in _workload_items(value, flag, "VALUE"):
        if v not in choices + ("none",):
            raise ValueError(f"{flag}: {item!r}: the value must be one of "
                             f"{', '.join(choices + ('none',))}")
        out[name] = None if v == "none" else v
    return out


def draft_linear_choice(args) -> dict[str, str]:
    """--draft-linear -> the drafter's matmul route per workload ("xla" where not named)."""
    chosen = parse_per_workload_choice(getattr(args, "draft_linear", None), "--draft-linear",
                                       ("xla", "triton"))
    return {name: v or "xla" for name, v in chosen.items()}


def parse_num_draft(value: str | int | None, block_size: int) -> dict[str, int]:
    """--num-draft-tokens -> drafts verified per step for each workload: None = the whole block
    everywhere; "K" = K everywhere; "solo=7,busy=3" = per workload (the rest: the whole block)."""
    return parse_per_workload(value, "--num-draft-tokens", int, block_size, (1, block_size), "K")


def canonical_per_workload(value: str | int | None) -> str | None:
    """The run key's form of a per-workload option (--num-draft-tokens, --verify-threshold):
    stages typed the same way merge, whatever the spacing (None: the option's default)."""
    if value is None:
        return None
    return ",".join(w.strip().replace(" ", "") for w in str(value).split(",") if w.strip())


# ---- the run ------------------------------------------------------------------------------------

def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty). JSPEC_COMMIT wins: a copy of the tree on a device machine may carry a
    stale .git (the 2026-11-30 bench recorded an older commit that way)."""
    if os.environ.get("JSPEC_COMMIT"):
        return os.environ["JSPEC_COMMIT"], None
    try:
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "diff", "--quiet", "HEAD"],
                               capture_output=True).returncode != 0
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        # A copy of the tree without .git (e.g. on a device machine): JSPEC_COMMIT names it.
        return os.environ.get("JSPEC_COMMIT"), None


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def device_memory() -> dict | None:
    import jax
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without statistics
        stats = None
    if not stats:
        return None
    return {"in_use": stats.get("bytes_in_use"), "peak": stats.get("peak_bytes_in_use")}


def triton_route() -> str | None:
    """How this process called its jax-triton kernels ("ffi" | "legacy", kernels/triton_ffi.py),
    or None if it called none (read without importing Triton)."""
    return getattr(sys.modules.get("jspec.kernels.triton_ffi"), "_route", None)


# What nvidia-smi reports per GPU that can make two machines of one model decode at different
# speeds (two H100s gave the stock bar 0.83 and 0.90 on 2026-12-06/07, docs/benchmarks.md).
GPU_FACTS = ("driver_version", "power.limit", "clocks.max.sm", "clocks.max.mem",
             "clocks.applications.graphics", "clocks.applications.memory", "pstate",
             "temperature.gpu", "clocks_throttle_reasons.active")


def _query_gpu(fields, runner) -> list[str] | None:
    """nvidia-smi's values of `fields` for the first GPU, or None if it is missing or fails."""
    try:
        res = runner(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in (res.stdout or "").splitlines() if ln.strip()]
    if res.returncode != 0 or not lines:
        return None
    values = [v.strip() for v in lines[0].split(",")]
    return values if len(values) == len(fields) else None


def gpu_facts(runner=subprocess.run) -> dict | None:
    """The first GPU's GPU_FACTS from nvidia-smi (strings as it prints them, "[N/A]" kept), or
    None where nvidia-smi is missing or fails: a record must never fail for want of them. A
    driver that refuses one field fails the whole query, so the fields are then asked one by
    one and the refused ones left out."""
    values = _query_gpu(GPU_FACTS, runner)
    if values is not None:
        return dict(zip(GPU_FACTS, values))
    facts = {}
    for field in GPU_FACTS:
        one = _query_gpu((field,), runner)
        if one is None and field == GPU_FACTS[0]:  # driver_version: every driver knows it
            return None  # so nvidia-smi itself is missing or broken: do not ask eight more times
        if one is not None:
            facts[field] = one[0]
    return facts or None


def copy_bandwidth(nbytes: int, passes: int = 8) -> float:
    """Device-to-device bandwidth (bytes/s): `passes` read + write sweeps of a bf16 array inside
    one jitted loop, in place (donated), median of 5 dispatches. In place and looped so that
    neither an output allocation nor the host dispatch is timed: a one-sweep, freshly allocated
    `a + 1` read 2.69 TB/s on the H200 while the decode step's GEMMs read weights at 3.7-4.5
    TB/s (docs/benchmarks.md), which flattered the HBM-bound fraction."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: jax.lax.fori_loop(0, passes, lambda i, a: a + jnp.bfloat16(1), a),
                donate_argnums=0)
    x = f(x).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        x = f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    del x
    return 2 * (nbytes // 2) * 2 * passes / sorted(ts)[len(ts) // 2]


def tree_bytes(tree) -> int:
    import jax
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


class Bench:
    def __init__(self, args, names: list[str]):
        from jspec.tokenizer import Tokenizer
        self.args = args
        self.names = names
        self.quick = bool(args.quick)
        self.progress = not args.no_progress
        self.out = Path(args.out)
        (self.out / "parts").mkdir(parents=True, exist_ok=True)
        if args.fresh:
            for f in (self.out / "parts").glob("*.json"):
                f.unlink()
        self.specs = W.QUICK_WORKLOADS if self.quick else W.WORKLOADS
        self.gate_spec = W.QUICK_GATES if self.quick else W.GATES
        self.sampling = W.SAMPLING[args.sampling]
        self.command = command_line(args)
        self.tokenizer = Tokenizer.from_dir(args.model)
        self.prompt_sets = W.QUICK_PROMPT_SETS if self.quick else W.PROMPT_SETS
        self.texts = W.prompt_texts(self.prompt_sets)
        commit, dirty = git_state()
        self.key = {"model": str(Path(args.model).resolve()), "draft": str(Path(args.draft).resolve()),
                    "sampling": args.sampling, "quick": self.quick,
                    "num_draft_tokens": canonical_per_workload(args.num_draft_tokens),
                    "verify_threshold": canonical_per_workload(getattr(args, "verify_threshold", None)),
                    "verify_rule": verify_rule(args),
                    "page_size": args.page_size,
                    "prefill_chunk": args.prefill_chunk, "attn_impl": args.attn_impl,
                    "decode_steps": [args.stock_decode_steps, args.spec_decode_steps],
                    "dtype": args.dtype, "commit": commit,
                    "batch_invariant": args.batch_invariant,
                    "invariant_prefill": getattr(args, "invariant_prefill", False),
                    # the invariant linear kernel's MMA family (kernels/linear_triton.py)
                    "linear_mma": mma_family_from_env() if args.batch_invariant else None,
                    "draft_kv_dtype": args.draft_kv_dtype,
                    "draft_weight_dtype": canonical_per_workload(
                        getattr(args, "draft_weight_dtype", None)),
                    "draft_linear": canonical_per_workload(getattr(args, "draft_linear", None)),
                    "draft_vocab": getattr(args, "draft_vocab", None),
                    "lookahead_admission": getattr(args, "lookahead_admission", False)}
        self.git = {"commit": commit, "dirty": dirty}
        self.env = None
        for src in getattr(args, "merge_parts", None) or []:
            self.merge_parts(Path(src))

    # The peer (transformers + PyTorch on the checkpoint as stored) depends on none of the jspec
    # engines' knobs: its part belongs to every run on the same model, sampling, size and code.
    PEER_KEY_FIELDS = ("model", "sampling", "quick", "commit")

    def key_differences(self, part: dict) -> list[str]:
        """The key fields in which a part differs from this run ([] when it belongs to it)."""
        key = part.get("key") or {}
        fields = set(key) | set(self.key)
        if part.get("part") == "peer":
            fields = set(self.PEER_KEY_FIELDS)
        return sorted(k for k in fields if key.get(k) != self.key.get(k))

    def merge_parts(self, src: Path) -> None:
        """The parts under SRC/parts that belong to this run, copied into OUT/parts; a part of
        another run is left out, and said so."""
        files = sorted((src / "parts").glob("*.json"))
        if not files:
            raise ValueError(f"--merge-parts {src}: no parts/*.json there")
        for f in files:
            part = json.loads(f.read_text())
            if self.key_differences(part):
                print(f"--merge-parts: {f} belongs to another run, not merged", file=sys.stderr)
                continue
            self.write_part(part["part"], part)

    # -- parts ---------------------------------------------------------------------------------

    def write_part(self, name: str, part: dict) -> None:
        path = self.out / "parts" / f"{name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(part, indent=1))
        tmp.replace(path)

    def read_parts(self) -> tuple[dict, list[str]]:
        parts, warnings = {}, []
        for f in sorted((self.out / "parts").glob("*.json")):
            try:
                p = json.loads(f.read_text())
            except json.JSONDecodeError:
                warnings.append(f"{f.name}: unreadable, ignored")
                continue
            diff = self.key_differences(p)
            if diff:
                warnings.append(f"{f.name}: from another run (differs in {', '.join(diff)}), ignored")
                continue
            parts[p["part"]] = p
        return parts, warnings

    def assemble(self) -> dict:
        from jspec.bench.report import assemble, write_outputs
        parts, warnings = self.read_parts()
        env = self.env
        if env is None:  # no JAX workload in this process (peer only): the last one measured
            envs = [p["env"] for p in parts.values() if p.get("env")]
            env = max(envs, key=lambda e: e.get("date") or "") if envs else self.base_env(device=False)
            peer_device = parts.get("peer", {}).get("device")
            if env.get("gpu") is None and peer_device:  # JAX never touched the GPU: the peer did
                env = {**env, "gpu": peer_device}
        record = assemble(parts, env=env, warnings=warnings, config=self.config())
        write_outputs(record, self.out)
        return record

    def base_env(self, device: bool) -> dict:
        import platform

        import jax
        import jaxlib
        env = {"gpu": None, "device": None, "device_kind": None, "devices": None,
               "jax": jax.__version__, "jaxlib": jaxlib.__version__, **self.git,
               "command": self.command, "date": utc_now(), "python": platform.python_version()}
        if device:
            d = jax.devices()[0]
            env.update(device=d.platform, device_kind=d.device_kind, devices=jax.device_count(),
                       gpu=None if d.platform == "cpu" else d.device_kind)
            if d.platform == "gpu":
                env["gpu_facts"] = gpu_facts()
        return env

    def config(self) -> dict:
        return {"workloads": {k: dataclasses.asdict(v) for k, v in self.specs.items()},
                "gates": dataclasses.asdict(self.gate_spec), "sampling": {
                    "name": self.args.sampling, **self.sampling},
                "prompt_sets": list(self.prompt_sets), "chat_template": "qwen3, non-thinking",
                "passes": W.PASSES, "quick": self.quick, "key": self.key}

    # -- orchestration ---------------------------------------------------------------------------

    def run(self) -> dict:
        jax_names = [w for w in W.WORKLOAD_ORDER if w in self.names]
        peer = "peer" in self.names or ("solo" in self.names and self.args.peer == "on") or (
            "solo" in self.names and self.args.peer == "auto" and not self.quick)
        if peer:  # before JAX touches the device: PyTorch gets the whole GPU
            self.run_peer()
        elif "solo" in self.names and not (self.out / "parts" / "peer.json").exists():
            why = "--quick" if self.quick else "--peer off"
            self.write_part("peer", {"part": "peer", "key": self.key, "status": "skipped",
                                     "reason": f"not run ({why})", "command": self.command})
        if not jax_names:
            return self.assemble()
        self.env = self.base_env(device=True)
        self.load()
        plans = {name: self.plan(self.specs[name]) for name in jax_names}
        if self.quick:
            self.share_geometry(plans)
        self._pair = None
        runs = {}
        for name in jax_names:
            part, items = self.run_workload(plans[name])
            runs[name] = (part, items)
            self.write_part(name, part)
            self.assemble()
        self._pair = None
        gc.collect()
        self.score(runs)
        return self.assemble()

    def load(self) -> None:
        import jax
        from jspec.loading import load_drafter, load_model
        accel = jax.devices()[0].platform != "cpu"
        # Copy bandwidth first, before anything else sits in device memory.
        self.bandwidth = copy_bandwidth(2 * 2 ** 30 if accel else 64 * 2 ** 20)
        t = time.time()
        self.cfg, self.model = load_model(self.args.model, dtype=self.args.dtype,
                                          progress=self.progress)
        self.dcfg, self.drafter = load_drafter(self.args.draft, self.cfg, self.model,
                                               progress=self.progress)
        self.load_s = time.time() - t
        self.num_draft = parse_num_draft(self.args.num_draft_tokens, self.dcfg.block_size)
        self.draft_weight_dtype = parse_per_workload_choice(
            getattr(self.args, "draft_weight_dtype", None), "--draft-weight-dtype", ("int8",))
        self.draft_linear = draft_linear_choice(self.args)
        self.verify_threshold = parse_per_workload(getattr(self.args, "verify_threshold", None),
                                                   "--verify-threshold", float, 0.0, (0.0, 1.0))
        if any(self.verify_threshold.values()):  # refuse a DFlash drafter before any workload
            from jspec.spec_steps import check_confidence_head
            check_confidence_head(max(self.verify_threshold.values()), self.dcfg)
        # Pages reserved per step: the widest verify of any workload (or the draft block).
        self.step_width = max(max(self.num_draft.values()) + 1, self.dcfg.block_size)
        self.draft_vocab_ids = None
        if getattr(self.args, "draft_vocab", None) is not None:
            from jspec.draft_vocab import choose_ids, read_ranked_ids
            self.draft_vocab_ids = read_ranked_ids(self.args.draft)
            choose_ids(self.draft_vocab_ids, self.args.draft_vocab, self.cfg.vocab_size)  # checks

    # -- one workload ----------------------------------------------------------------------------

    def engine_configs(self, spec: W.WorkloadSpec, prompts: list[list[int]], extra_context: int = 0):
        from jspec.engine import EngineConfig
        a = self.args
        window = max(a.stock_decode_steps, a.spec_decode_steps * self.step_width)
        need = max(max(map(len, prompts)) + spec.max_new_tokens, extra_context) + 1
        max_context = min(need, self.cfg.max_position_embeddings)
        if max(map(len, prompts)) >= max_context:
            raise ValueError(f"{spec.name}: a prompt of {max(map(len, prompts))} tokens does not "
                             f"fit the model's context ({self.cfg.max_position_embeddings})")
        num_pages = None
        if spec.size_pool:
            num_pages = W.busy_num_pages([len(p) for p in prompts], spec.lanes,
                                         spec.max_new_tokens, a.page_size, window)
        base = dict(max_lanes=spec.lanes, page_size=a.page_size, max_context=max_context,
                    num_pages=num_pages, prefill_chunk=a.prefill_chunk, attn_impl=a.attn_impl,
                    batch_invariant=a.batch_invariant,
                    invariant_prefill=getattr(a, "invariant_prefill", False),
                    draft_kv_dtype=a.draft_kv_dtype,  # the stock engine ignores both
                    draft_vocab=getattr(a, "draft_vocab", None),
                    lookahead_admission=getattr(a, "lookahead_admission", False))
        return (EngineConfig(decode_steps=a.stock_decode_steps, **base),
                EngineConfig(decode_steps=a.spec_decode_steps,
                             verify_threshold=self.verify_threshold[spec.name],
                             draft_weight_dtype=self.draft_weight_dtype[spec.name],
                             draft_linear=self.draft_linear[spec.name],
                             verify_rule=verify_rule(a), **base))

    def warm(self, engine, spec, prompts, name) -> float:
        # With lookahead_admission a request seated while a dispatch runs joins the next one
        # through a state merge, its own small program: a request more than the lanes makes it
        # compile here rather than in the first timed pass.
        n = min(spec.lanes + 1 if engine.ecfg.lookahead_admission else 2, len(prompts))
        seeds = [W.request_seed("warmup", spec.name, name, i) for i in range(n)]
        t = time.time()
        engine.precompile_prefill()  # every padded prompt size: none compiles in a timed pass
        engine.generate(W.make_requests(prompts[:n], min(spec.max_new_tokens, 32), self.sampling, seeds))
        return time.time() - t

    def plan(self, spec: W.WorkloadSpec) -> dict:
        """Prompts, fixed texts and the two engine configurations of one workload."""
        g = self.gate_spec
        prompts = W.workload_prompts(spec, self.tokenizer, self.texts)
        width = self.num_draft[spec.name] + 1
        fixed_len = -(-g.fixed_tokens // width) * width
        fixed = W.fixed_texts(self.tokenizer, self.texts, g.fixed_texts, fixed_len) \
            if spec.name == "solo" else []
        extra = max((len(p) + len(c) + width for p, c in fixed), default=0)
        if spec.name == "team":
            extra = max(len(p) for p in prompts[:g.greedy_prompts]) + g.greedy_tokens
        ecfg_stock, ecfg_spec = self.engine_configs(spec, prompts, extra)
        return {"spec": spec, "prompts": prompts, "fixed": fixed, "ecfg": (ecfg_stock, ecfg_spec)}

    def share_geometry(self, plans: dict) -> None:
        """--quick only: team and busy run on engines of one geometry (busy's sized pool, the
        larger context), so the second workload reuses the first one's compiled engines."""
        if not ("team" in plans and "busy" in plans):
            return
        t, b = plans["team"]["ecfg"][0], plans["busy"]["ecfg"][0]
        if t.max_lanes != b.max_lanes:
            return
        ctx = max(t.max_context, b.max_context)
        window = max(self.args.stock_decode_steps, self.args.spec_decode_steps * self.step_width)
        need = -(-(ctx + window) // self.args.page_size) + 2
        pages = max(b.num_pages or 0, need)
        for name in ("team", "busy"):
            plans[name]["ecfg"] = tuple(dataclasses.replace(e, max_context=ctx, num_pages=pages)
                                        for e in plans[name]["ecfg"])

    def run_workload(self, plan: dict) -> tuple[dict, list]:
        import jax

        from jspec.engine import Engine
        from jspec.steps import compile_count
        g = self.gate_spec
        spec, prompts, fixed = plan["spec"], plan["prompts"], plan["fixed"]
        ecfg_stock, ecfg_spec = plan["ecfg"]
        eos = self.tokenizer.eos_ids
        num_draft = self.num_draft[spec.name]
        reuse = self._pair is not None and self._pair[0] == (ecfg_stock, ecfg_spec, num_draft)

        def committed(engine):
            # Fresh pools come out uncommitted; the programs return committed ones, so the first
            # prefill would compile twice. Committing them up front (same buffers, no copy)
            # keeps warm-up to one compilation per program.
            engine.caches = jax.device_put(engine.caches, jax.devices()[0])
            return engine

        if not reuse:
            self._pair = None
        gc.collect()
        mem0 = device_memory()
        stock = self._pair[1] if reuse else committed(Engine(self.cfg, self.model, eos, ecfg_stock))
        warm_stock = self.warm(stock, spec, prompts, "stock")
        mem1 = device_memory()
        stock_pool = tree_bytes(stock.caches)
        spec_eng = self._pair[2] if reuse else committed(Engine(
            self.cfg, self.model, eos, ecfg_spec, drafter=self.drafter, draft_cfg=self.dcfg,
            num_draft=num_draft, draft_vocab_ids=self.draft_vocab_ids))
        warm_spec = self.warm(spec_eng, spec, prompts, "spec")
        mem2 = device_memory()
        self._pair = ((ecfg_stock, ecfg_spec, num_draft), stock, spec_eng)
        engines = {"stock": stock, "spec": spec_eng}

        def counts():
            return {n: (compile_count(e.programs.prefill), compile_count(e.programs.decode))
                    for n, e in (("stock", stock), ("spec", spec_eng))}

        before = counts()
        t = time.time()
        passes = W.alternate_passes(engines, prompts, spec, self.sampling, progress=self.progress)
        timings = {"passes_s": time.time() - t}
        recompiled = counts() != before
        mem3 = device_memory()

        peak = None  # reused engines: both pools were alive throughout, no per-engine peak
        if mem0 and mem1 and mem2 and not reuse:
            from flax import nnx
            drafter_bytes = tree_bytes(nnx.state(self.drafter))
            peak = {"stock": mem1["peak"] - drafter_bytes, "spec": mem2["peak"] - stock_pool,
                    "drafter_weights": drafter_bytes,
                    "stock_exact": mem1["peak"] > mem0["peak"], "spec_exact": mem2["peak"] > mem1["peak"],
                    "process_after_passes": mem3["peak"] if mem3 else None,
                    "stock_pool": stock_pool, "spec_pools": tree_bytes(spec_eng.caches)}
        extras = {}
        t = time.time()
        if spec.name == "solo":
            extras["fidelity"] = self.fidelity(stock, spec_eng, fixed)
            extras["roofline"] = self.roofline_inputs(passes, prompts)
            timings["fidelity_s"] = time.time() - t
        if spec.name == "team":
            extras["greedy"] = self.greedy(stock, spec_eng, prompts[:g.greedy_prompts])
            timings["greedy_s"] = time.time() - t
        if spec.name == "busy":
            extras["memory"] = G.memory_check(
                peak and peak["stock"], peak and peak["spec"], workload="busy", reused_engines=reuse,
                exact={"stock": peak and peak["stock_exact"], "spec": peak and peak["spec_exact"]},
                note=None if peak else ("no device memory statistics on this backend (cpu)"
                                        if mem0 is None else "engines reused across workloads "
                                        "(--quick): no per-engine peak"))

        step_tokens = [n for r in passes if r.engine == "spec" for req in r.step_tokens for n in req]
        step_drafts = [n for r in passes if r.engine == "spec" for req in r.step_drafts for n in req]
        per_pos = [sum(t - 1 >= k for t in step_tokens) / len(step_tokens) if step_tokens else None
                   for k in range(1, num_draft + 1)]
        replies, items = [], []
        for r in passes:
            for i, (prompt, out) in enumerate(zip(prompts, r.outputs)):
                replies.append({"workload": spec.name, "engine": r.engine, "pass": r.index,
                                "prompt": i, "prompt_len": len(prompt), "n": len(out),
                                "logp": None, "hits": None})
                items.append((prompt, out))
        occ = {e: [x for r in passes if r.engine == e for x in r.occupancy] for e in ("stock", "spec")}
        part = {
            "part": spec.name, "key": self.key, "command": self.command,
            "env": {**self.env, "triton_route": triton_route()},
            "spec": dataclasses.asdict(spec),
            "engine": {"max_lanes": spec.lanes, "max_context": ecfg_stock.max_context,
                       "page_size": ecfg_stock.page_size, "num_pages": stock.allocator.num_pages,
                       "prefill_chunk": ecfg_stock.prefill_chunk, "attn_impl": ecfg_stock.attn_impl,
                       "decode_steps": {"stock": ecfg_stock.decode_steps, "spec": ecfg_spec.decode_steps},
                       "num_draft_tokens": num_draft, "step_width": spec_eng.ecfg.step_width,
                       "draft_weight_dtype": spec_eng.ecfg.draft_weight_dtype,
                       "draft_linear": spec_eng.ecfg.draft_linear},
            "prompt_tokens": {"mean": sum(map(len, prompts)) / len(prompts),
                              "min": min(map(len, prompts)), "max": max(map(len, prompts))},
            "passes": [{"engine": r.engine, "index": r.index, "wall_s": r.wall_s, "tokens": r.tokens,
                        "tokens_per_s": r.tokens_per_s, "preemptions": r.preemptions,
                        "occupancy_mean": (sum(r.occupancy) / len(r.occupancy)) if r.occupancy else None,
                        "engine_time": r.timing}
                       for r in passes],
            "verify": {"steps": len(step_tokens), "tokens": sum(step_tokens),
                       "tau": sum(step_tokens) / len(step_tokens) if step_tokens else None,
                       "threshold": self.verify_threshold[spec.name],
                       "rule": verify_rule(self.args),
                       "drafts_per_step": (sum(step_drafts) / len(step_drafts)
                                           if step_drafts else None),
                       "acceptance_per_position": per_pos},
            "pool": {"num_pages": stock.allocator.num_pages, "sized": spec.size_pool,
                     "occupancy": {e: (sum(v) / len(v) if v else None) for e, v in occ.items()},
                     "occupancy_min": {e: (min(v) if v else None) for e, v in occ.items()},
                     "samples": {e: len(v) for e, v in occ.items()}},
            "peak_memory": peak, "recompiled": recompiled, "reused_engines": reuse,
            "warmup_s": {"stock": warm_stock, "spec": warm_spec}, "timings": timings,
            "load_s": self.load_s, "replies": replies, "scored": False, "extras": extras,
        }
        return part, items

    def fidelity(self, stock, spec_eng, fixed) -> dict:
        from jspec.scoring import verify_minus_decode
        diffs = list(verify_minus_decode(stock, spec_eng, fixed, self.progress))
        return G.fidelity_check(diffs, texts=len(fixed),
                                tokens_per_text=len(fixed[0][1]) if fixed else 0,
                                path={"candidate": f"verify, blocks of {spec_eng.num_draft + 1}",
                                      "stock": "decode, one token per step"})

    def greedy(self, stock, spec_eng, prompts) -> dict:
        greedy = W.SAMPLING["greedy"]
        n = self.gate_spec.greedy_tokens
        seeds = [W.request_seed("greedy", i) for i in range(len(prompts))]
        a = stock.generate(W.make_requests(prompts, n, greedy, seeds))
        b = spec_eng.generate(W.make_requests(prompts, n, greedy, seeds))
        return G.greedy_check([r.output_ids for r in a], [r.output_ids for r in b])

    def roofline_inputs(self, passes, prompts) -> dict:
        from flax import nnx
        cfg = self.cfg
        weights = tree_bytes(nnx.state(self.model))
        embed = self.model.embed_tokens[...].nbytes
        # A tied head reads the embedding every step; an untied one reads lm_head instead.
        read = weights - (0 if cfg.tie_word_embeddings else embed)
        import jax.numpy as jnp
        kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
        num = den = 0
        for r in passes:
            if r.engine != "stock":
                continue
            for p, out in zip(prompts, r.outputs):
                n = len(out)
                num += n * len(p) + n * (n - 1) / 2
                den += n
        mean_ctx = num / den if den else 0.0
        step_bytes = read + kv_token * mean_ctx
        import jax
        return {"copy_bandwidth_GBps": self.bandwidth / 1e9, "weight_bytes_read": int(read),
                "embedding_bytes_excluded": int(0 if cfg.tie_word_embeddings else embed),
                "kv_bytes_per_token": int(kv_token), "mean_context": mean_ctx,
                "bytes_per_step": step_bytes, "hbm_bound_tokens_per_s": self.bandwidth / step_bytes,
                "device": jax.devices()[0].platform}

    # -- scoring --------------------------------------------------------------------------------

    def score(self, runs: dict) -> None:
        import jax
        accel = jax.devices()[0].platform != "cpu"
        scorer = Scorer(self.model, budget_bytes=(6 if accel else 0.25) * 2 ** 30,
                        max_batch_tokens=16384 if accel else 4096, quick=self.quick)
        if self.quick:  # one batch shape for every workload: one compilation
            every = [it for _, items in runs.values() for it in items]
            shape = scorer.shape(every)
        for name, (part, items) in runs.items():
            t = time.time()
            scores = scorer.score(items, desc=f"scoring {name} replies", progress=self.progress,
                                  shape=shape if self.quick else None)
            for rep, (lp, hits) in zip(part["replies"], scores):
                rep["logp"], rep["hits"] = lp, hits
            part["scored"] = True
            part["score_s"] = time.time() - t
            part["scorer"] = "target dense forward (causal, no cache), fp32 log-softmax"
            self.write_part(name, part)

    # -- peer -----------------------------------------------------------------------------------

    def run_peer(self) -> None:
        from jspec.loading import is_jspec_dir
        spec = self.specs["solo"]
        base = {"part": "peer", "key": self.key, "command": self.command, "workload": "solo"}
        if is_jspec_dir(self.args.model):
            self.write_part("peer", {**base, "status": "skipped", "reason": "the model is a jspec "
                                     "(Orbax) directory; the peer needs a Hugging Face checkpoint"})
            return
        import importlib.util
        missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
        if missing:
            self.write_part("peer", {**base, "status": "skipped",
                                     "reason": f"not installed: {', '.join(missing)}"})
            return
        prompts = W.workload_prompts(spec, self.tokenizer, self.texts)
        job = {"model": str(self.args.model), "prompts": prompts,
               "max_new_tokens": spec.max_new_tokens, "sampling": self.sampling,
               "eos_ids": list(self.tokenizer.eos_ids),
               "seeds": [[W.request_seed(spec.name, p, "peer", i) for i in range(len(prompts))]
                         for p in range(W.PASSES)]}
        job_path, res_path = self.out / "peer_job.json", self.out / "peer_result.json"
        job_path.write_text(json.dumps(job))
        res_path.unlink(missing_ok=True)
        log = self.out / "peer.log"
        t = time.time()
        argv, env = peer_process(job_path, res_path)
        with open(log, "w") as f:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=str(self.out),
                                env=env).returncode
        res = json.loads(res_path.read_text()) if res_path.exists() else {}
        if rc != 0 or "tokens_per_s" not in res:
            tail = log.read_text()[-600:] if log.exists() else ""
            self.write_part("peer", {**base, "status": "failed", "reason": f"exit {rc}: {tail}", **res})
            return
        self.write_part("peer", {**base, "status": "ok", "reason": None, "elapsed_s": time.time() - t,
                                 **res})


class Scorer:
    """Target log-likelihood and argmax of every reply token, through the target's dense causal
    forward (no cache): the same scorer for both engines' replies. Replies are right-padded into
    one bucket shape per call site (one compilation per workload)."""

    def __init__(self, model, budget_bytes: float, max_batch_tokens: int, quick: bool):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from jspec.qwen3 import causal_attention
        self.cfg = model.cfg
        self.budget, self.max_tokens, self.quick = budget_bytes, max_batch_tokens, quick
        graphdef, self.params = nnx.split(model)

        def score(params, tokens_bt, start_b, len_b, num_reply: int):
            m = nnx.merge(graphdef, params)
            B, T = tokens_bt.shape
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
            hidden, _, _ = m(tokens_bt, positions, attention=causal_attention())
            r = jnp.arange(num_reply, dtype=jnp.int32)
            idx = jnp.clip(start_b[:, None] - 1 + r[None], 0, T - 1)  # position predicting reply[r]
            h = jnp.take_along_axis(hidden, idx[..., None], axis=1)
            logits = m.logits(h)  # [B, R, V] fp32
            target = jnp.take_along_axis(tokens_bt, jnp.clip(idx + 1, 0, T - 1), axis=1)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), target[..., None], -1)[..., 0]
            hit = jnp.argmax(logits, -1) == target
            mask = r[None] < len_b[:, None]
            return jnp.where(mask, logp, 0.0).sum(-1), (hit & mask).sum(-1)

        self.fn = jax.jit(score, static_argnames=("num_reply",))

    def shape(self, items) -> tuple[int, int, int]:
        """(B, T, R): sequences per batch, padded sequence length, padded reply length."""
        q = 32 if self.quick else 128
        T = -(-max(len(p) + len(o) for p, o in items) // q) * q
        R = -(-max(len(o) for _, o in items) // (q // 2)) * (q // 2)
        V = self.cfg.vocab_size
        per_seq = max(self.cfg.num_heads * T * T * 8, R * V * 12, 1)
        B = int(max(1, min(len(items), self.budget // per_seq, self.max_tokens // T)))
        return B, T, R

    def score(self, items, desc: str = "scoring", progress: bool = True,
              shape: tuple[int, int, int] | None = None) -> list[tuple[float, int]]:
        import numpy as np
        from tqdm.auto import tqdm
        if not items:
            return []
        B, T, R = shape or self.shape(items)
        out = []
        for s in tqdm(range(0, len(items), B), desc=desc, leave=False, disable=not progress):
            chunk = items[s:s + B]
            tokens = np.zeros((B, T), np.int32)
            start = np.ones(B, np.int32)
            length = np.zeros(B, np.int32)
            for b, (p, o) in enumerate(chunk):
                tokens[b, :len(p) + len(o)] = list(p) + list(o)
                start[b], length[b] = len(p), len(o)
            lp, hits = self.fn(self.params, tokens, start, length, num_reply=R)
            lp, hits = np.asarray(lp, np.float64), np.asarray(hits)
            out += [(float(lp[b]), int(hits[b])) for b in range(len(chunk))]
        return out


def summary_text(record: dict) -> str:
    from jspec.bench.report import markdown
    return markdown(record)


if __name__ == "__main__":  # python -m jspec.bench.run ... (same as `jspec bench ...`)
    parser = argparse.ArgumentParser(prog="jspec")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    ns = parser.parse_args(["bench", *sys.argv[1:]])
    sys.exit(ns.func(ns))
