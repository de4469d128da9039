"""Where the stand-in drafter's training step spends its time: step time, steps/s, tokens/s,
anchors/s and achieved TFLOP/s per batch size against a FLOP count by component; the real loop's
host-side batch building, the loss forward and the frozen target's forward timed alone; with
--trace, a jax.profiler trace of a few steps and its top device ops.

  . scripts/device_env.sh; python3 scripts/profile_drafter_train.py --batches 4,8,16 --out $OUT/drafter_train_profile.json --trace $OUT/trace

The trainer is train_standin's drafter phase at gpu_train_standin.sh's shapes: the shipped S
(compact, 24,576 rows, its logit bias), DSpark with 2 layers, Markov rank 32, block 7, bf16
compute, cuDNN target attention where it works, no remat. THE DATA IS SYNTHETIC: random ids in
prompt + reply sequences of the real runs' lengths, packed by pack_reply_arrays as train_standin
packs them (a step's cost depends on the shapes, not the ids). --random-target: a random S
(tiny sizes for CPU tests). The JSON is rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))

import profile_steps as ps  # noqa: E402 - the trace readers (stdlib-only at import)
import train_standin as ts  # noqa: E402 - the drafter phase's pieces (numpy-only at import)

# gpu_train_standin.sh's drafter optimizer (--draft-steps 3000 --draft-lr 1.5e-3): its values
# do not change the step's cost, only its updates.
DRAFT_STEPS, DRAFT_LR = 3000, 1.5e-3
SYNTHETIC_NOTE = ("synthetic data: random token ids (never the mask row) in prompt + reply "
                  "sequences of uniform random lengths, loss mask on the replies, packed as "
                  "train_standin packs them; timing depends on shapes, not ids")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON written after every measurement")
    g = ap.add_argument_group("target S")
    g.add_argument("--target", default="standin",
                   help="S's compact model directory, or a stand-in name ('standin': the shipped S's "
                        "compact directory, as python -m jspec.standin path standin --compact)")
    g.add_argument("--random-target", action="store_true",
                   help="a random S of the sizes below (the stand-in's by default; read only with "
                        "this flag) instead of --target (CPU tests)")
    g.add_argument("--vocab", type=int, default=24576)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=12)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--ffn", type=int, default=1024)
    g = ap.add_argument_group("drafter and step (gpu_train_standin.sh's values)")
    g.add_argument("--drafter", default="dspark", choices=list(ts.DRAFTERS))
    g.add_argument("--draft-layers", type=int, default=2)
    g.add_argument("--block-size", type=int, default=7)
    g.add_argument("--markov-rank", type=int, default=32)
    g.add_argument("--tap-layers", help="comma-separated target layers (default: 5 evenly in [1, L-3])")
    g.add_argument("--seq-len", type=int, default=4096)
    g.add_argument("--batches", default="4,8,16", help="rows per step, one measurement each")
    g.add_argument("--anchors", type=int, default=1024, help="anchors per row")
    g.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--attn", default="cudnn", choices=["dense", "cudnn"],
                   help="target attention ('cudnn' falls back to 'dense' where it does not work, "
                        "as train_standin does)")
    g.add_argument("--remat", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--row-chunk", type=int, default=2048, help="drafter loss: block rows per vocabulary chunk")
    g.add_argument("--block-attn", default="split", choices=["split", "cudnn", "xla", "cudnn_chunks", "xla_chunks"],
                   help="the drafter's block attention in training (DrafterTrainConfig.block_attn_impl)")
    g.add_argument("--loss-remat", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute the loss chunks' vocabulary terms in the backward (train_standin's default)")
    g = ap.add_argument_group("synthetic data")
    g.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                   help="rows of several sequences with segment ids / positions (pack_reply_arrays, "
                        "train_standin's default); --no-packed: one sequence per row (reply_arrays)")
    g.add_argument("--joined-rows", type=float, default=0.0, help="pack_reply_arrays joined_share")
    g.add_argument("--host-sequences", type=int, default=8192,
                   help="sequences in the data pool (the real runs: 4096 prompts x 2 reply sets)")
    g.add_argument("--prompt-min", type=int, default=64)
    g.add_argument("--prompt-max", type=int, default=1024)
    g.add_argument("--reply-max", type=int, default=512)
    g = ap.add_argument_group("measurement")
    g.add_argument("--steps", type=int, default=10, help="timed steps per setting (after compile + warm-up)")
    g.add_argument("--breakdown", default="first", choices=["first", "all", "none"],
                   help="batch sizes at which the loss forward and the target forward are timed alone "
                        "(each is one more compile)")
    g.add_argument("--trace", metavar="DIR", help="jax.profiler trace of --trace-steps steps at the first batch size")
    g.add_argument("--trace-steps", type=int, default=3)
    g.add_argument("--top", type=int, default=25, help="device ops listed from the trace")
    g.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    try:
        args.batch_list = [int(x) for x in args.batches.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--batches {args.batches!r}: expected comma-separated positive integers")
    if not args.batch_list or min(args.batch_list) < 1:
        ap.error(f"--batches {args.batches!r}: every batch size must be a positive integer")
    for name in ("steps", "trace_steps", "seq_len", "anchors", "host_sequences", "prompt_min",
                 "prompt_max", "reply_max", "row_chunk", "block_size", "draft_layers", "top"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.anchors > args.seq_len - 1:
        ap.error(f"--anchors {args.anchors} exceeds the {args.seq_len - 1} candidate positions of "
                 f"--seq-len {args.seq_len}")
    if not 0.0 <= args.joined_rows <= 1.0:
        ap.error(f"--joined-rows must be in [0, 1], got {args.joined_rows}")
    if args.joined_rows and not args.packed:
        ap.error("--joined-rows needs --packed")
    if args.prompt_min > args.prompt_max:
        ap.error(f"--prompt-min {args.prompt_min} > --prompt-max {args.prompt_max}")
    return args


# ---- FLOPs by count ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepShape:
    rows: int            # B
    seq_len: int         # S
    anchors: int         # A per row
    block: int
    hidden: int          # D (target and drafter)
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int           # V (S's rows)
    target_layers: int
    draft_layers: int
    taps: int
    markov_rank: int
    attn_impl: str       # the target's: "dense" computes every [S, S] score, "cudnn" the causal half
    remat: bool
    loss_remat: bool = True
    block_attn: str = "split"

    @property
    def block_rows(self) -> int:  # R = B * A * block: the rows of the vocabulary-sized terms
        return self.rows * self.anchors * self.block


def block_keys_per_block(s) -> int:
    """How many blocks' keys a block query scores on the route s.block_attn: its own ("split"),
    every block of the row (the masked routes) or every block of its chunk ("*_chunks")."""
    from jspec.train.drafter import anchors_per_attention
    return 1 if s.block_attn == "split" else anchors_per_attention(s.block_attn, s.anchors)


def step_flops(s: StepShape) -> dict[str, float]:
    """FLOPs of one training step by component (a multiply-add = 2), disjoint, summing to the
    step. Matmuls only: the softmax / L1 passes over [R, V] are memory-bound and left out.
    Backward: the target is frozen (no backward); the drafter's ~2x its forward; the vocabulary
    head is frozen too, so the drafter's projection costs one input-gradient GEMM (Markov: 2x).
    With loss_remat (the default) the row chunks of the loss are rematerialised
    (sum_over_row_chunks), so both vocabulary projections run twice."""
    T, R = s.rows * s.seq_len, s.block_rows
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer_params = s.hidden * (2 * qd + 2 * kvd) + 3 * s.hidden * s.ffn  # q, o, k, v, mlp
    keys_per_query = s.seq_len if s.attn_impl == "dense" else (s.seq_len + 1) / 2
    f = {
        "target_layers_fwd": 2.0 * T * layer_params * s.target_layers,
        "target_attention_fwd": 4.0 * T * keys_per_query * qd * s.target_layers,
        # fuse the taps [T, taps*D] -> D, then each draft layer's context K/V
        "drafter_context_fwd": 2.0 * T * s.taps * s.hidden * s.hidden + 2.0 * T * s.hidden * 2 * kvd * s.draft_layers,
        "drafter_layers_fwd": 2.0 * R * layer_params * s.draft_layers,
        # every block query scores all S context keys (masked, not skipped) and its own block;
        # the fused (masked) route scores every block's keys too, the chunked one its chunk's
        "drafter_block_attention_fwd": 4.0 * R * (s.seq_len + s.block * block_keys_per_block(s))
                                       * qd * s.draft_layers,
        "vocab_drafter_fwd": 2.0 * R * s.hidden * s.vocab + 2.0 * R * s.markov_rank * s.vocab,
        "vocab_target_fwd": 2.0 * R * s.hidden * s.vocab,
    }
    drafter_fwd = f["drafter_context_fwd"] + f["drafter_layers_fwd"] + f["drafter_block_attention_fwd"]
    f["drafter_bwd"] = 2.0 * drafter_fwd
    f["vocab_drafter_bwd"] = 2.0 * R * s.hidden * s.vocab + 4.0 * R * s.markov_rank * s.vocab
    if s.loss_remat:
        f["vocab_recompute"] = f["vocab_drafter_fwd"] + f["vocab_target_fwd"]
    if s.remat:
        f["drafter_layers_recompute"] = f["drafter_layers_fwd"] + f["drafter_block_attention_fwd"]
    f["total"] = sum(f.values())
    return f


# ---- setup ----------------------------------------------------------------------------------------

def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_target(args):
    """(target cfg, model, compact vocabulary or None, mask row, pad id): as train_standin's
    light_state reads S (float32 masters; the trainer casts them to the compute dtype)."""
    from jspec.config import Qwen3Config
    from jspec.qwen3 import init_random
    if args.random_target:
        cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                          num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                          head_dim=args.head_dim, max_position_embeddings=max(40960, args.seq_len),
                          tie_word_embeddings=True, dtype="float32")
        return cfg, init_random(cfg, seed=args.seed), None, cfg.vocab_size - 1, 0
    from jspec.standin import source_dir
    from jspec.tokenizer import ENDOFTEXT_ID
    from jspec.train.vocab import load_training_target
    path = source_dir(args.target)  # a stand-in name -> its compact directory (S's own rows)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--target {args.target!r}: {path} is not a model directory (no config.json)")
    cfg, model, vocab, mask_row = load_training_target(path)
    return cfg, model, vocab, mask_row, 0 if vocab is None else int(vocab.to_rows([ENDOFTEXT_ID])[0])


def synthetic_pool(args, vocab_size: int, mask_id: int, pad_id: int) -> tuple[dict, dict]:
    """Training rows built as train_standin builds them (pack_reply_arrays / reply_arrays) from
    --host-sequences random prompt + reply sequences; (arrays, info with the pack time)."""
    import numpy as np
    from jspec.train.data import pack_reply_arrays, reply_arrays
    rng = np.random.default_rng(args.seed)
    # Lengths are clamped to the row so short CPU rows still hold whole sequences.
    p_hi = min(args.prompt_max, max(1, args.seq_len // 2))
    p_lo = min(args.prompt_min, max(1, p_hi // 2))
    r_hi = min(args.reply_max, max(2, args.seq_len - p_hi))
    r_lo = min(r_hi, max(2, r_hi // 4))

    def draw(n: int) -> list[int]:  # ids in [0, V) but the mask row (lists, as read from JSONL)
        x = rng.integers(0, vocab_size - 1, n)
        return (x + (x >= mask_id)).tolist()

    prompts = [draw(int(n)) for n in rng.integers(p_lo, p_hi + 1, args.host_sequences)]
    replies = [draw(int(n)) for n in rng.integers(r_lo, r_hi + 1, args.host_sequences)]
    t0 = time.perf_counter()
    if args.packed:
        arrays = pack_reply_arrays(prompts, replies, args.seq_len, pad_id=pad_id,
                                   joined_share=args.joined_rows, seed=args.seed)
    else:
        arrays = reply_arrays(prompts, replies, args.seq_len, pad_id=pad_id)
    info = {"note": SYNTHETIC_NOTE, "sequences": args.host_sequences, "rows": len(arrays["tokens"]),
            "prompt_len": [p_lo, p_hi], "reply_len": [r_lo, r_hi], "packed": args.packed,
            "joined_rows": args.joined_rows, "reply_token_share": float(arrays["loss_mask"].mean()),
            "pack_s_once": time.perf_counter() - t0}
    if args.packed:
        seg = arrays["segment_ids"]
        info["sequences_per_row"] = float(np.mean(seg.max(axis=1)))
    return arrays, info


def make_trainer(args, target, vocab, dcfg):
    """train_standin.stage_drafter's trainer (random drafter init, as without --init-drafter)."""
    from jspec.dspark import init_random_drafter
    from jspec.train import OptimConfig
    from jspec.train import drafter as dt
    loss = getattr(dt, ts.DRAFTERS[args.drafter][1])
    return dt.DrafterTrainer(
        target, init_random_drafter(dcfg, seed=args.seed + 1), OptimConfig(DRAFT_STEPS, lr=DRAFT_LR),
        ts.drafter_train_config(args, loss),
        seed=args.seed, logit_bias=None if vocab is None else vocab.log_multiplicity())


@functools.cache
def target_forward_fn():
    """The frozen target's forward as drafter_loss runs it (taps + final hidden), jitted once."""
    import jax
    from jspec.train.target import target_forward

    @functools.partial(jax.jit, static_argnums=(0, 1, 2))
    def run(binder, attn_impl, taps, target_params, batch):
        return target_forward(binder.bind(target_params), batch["tokens"], attn_impl=attn_impl,
                              tap_layers=taps, positions_bt=batch.get("positions"),
                              segment_ids_bt=batch.get("segment_ids"))
    return run


# ---- measurements ---------------------------------------------------------------------------------

def median_ms(xs) -> float:
    return statistics.median(xs) * 1e3


def time_calls(fn, batches, steps: int) -> dict:
    """compile (first call), warm-up, then `steps` calls each timed to block_until_ready."""
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn(batches[0]))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(fn(batches[1 % len(batches)]))
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(batches[i % len(batches)]))
        times.append(time.perf_counter() - t0)
    return {"compile_s": compile_s, "ms_median": median_ms(times), "ms_all": [t * 1e3 for t in times]}


def host_batch_timing(arrays, batch: int, seed: int, n: int = 50) -> dict:
    """What fit() does on the host per step before the jitted step: batch_at(position) (the
    epoch permutation + row gather), the host->device copy of the batch (_device_batch, inside
    DrafterTrainer.train_step) and the step key (fold_in)."""
    import jax
    from jspec.train import drafter as dt
    from jspec.train.data import batch_source
    batch_at = batch_source(arrays, batch, seed)
    gather, copy, key = [], [], []
    rng = jax.random.PRNGKey(seed)
    for pos in range(n):
        t0 = time.perf_counter()
        b = batch_at(pos)
        t1 = time.perf_counter()
        jax.block_until_ready(dt._device_batch(b))
        t2 = time.perf_counter()
        jax.block_until_ready(jax.random.fold_in(rng, pos))
        t3 = time.perf_counter()
        gather.append(t1 - t0), copy.append(t2 - t1), key.append(t3 - t2)
    bytes_ = sum(v.nbytes for k, v in b.items() if k in dt.BATCH_KEYS)
    return {"batch": batch, "batch_at_ms": median_ms(gather), "device_copy_ms": median_ms(copy),
            "fold_in_key_ms": median_ms(key), "batch_bytes": bytes_,
            "total_ms": median_ms(gather) + median_ms(copy) + median_ms(key)}


def measure_batch(args, target, vocab, dcfg, arrays, batch: int, breakdown: bool, rec: dict) -> dict:
    import jax
    import numpy as np
    from jspec.train import drafter as dt
    from jspec.train.data import batch_source
    r = {"batch": batch, "tokens_per_step": batch * args.seq_len, "anchor_slots_per_step": batch * args.anchors}
    trainer = make_trainer(args, target, vocab, dcfg)
    batch_at = batch_source(arrays, batch, args.seed)
    batches = [batch_at(p) for p in range(max(2, args.steps))]

    # (1) the train step, blocked per step: compile, warm-up, `steps` timed
    def step(b):
        metrics = trainer.train_step(b)
        return metrics, trainer.state.params

    dispatch = []
    t0 = time.perf_counter()
    metrics, _ = jax.block_until_ready(step(batches[0]))
    r["compile_s"] = time.perf_counter() - t0  # + the first step's run
    jax.block_until_ready(step(batches[1]))
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        out = step(batches[i % len(batches)])
        t1 = time.perf_counter()
        metrics, _ = jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        dispatch.append(t1 - t0)
    r["step_ms_median"] = median_ms(times)
    r["step_ms_all"] = [t * 1e3 for t in times]
    r["dispatch_ms_median"] = median_ms(dispatch)  # host time until train_step returns
    r["steps_per_s"] = 1e3 / r["step_ms_median"]
    r["tokens_per_s"] = r["tokens_per_step"] * r["steps_per_s"]
    r["anchors_per_s"] = r["anchor_slots_per_step"] * r["steps_per_s"]
    r["anchor_fill"] = float(metrics["anchor_fill"])
    r["loss"] = float(metrics["loss"])

    # (2) pipelined as fit() runs: batch_at per step, no sync until the end (metrics fetched once)
    pending = []
    t0 = time.perf_counter()
    for pos in range(args.steps):
        pending.append(trainer.train_step(batch_at(1000 + pos)))
    jax.device_get(pending)
    r["pipelined_step_ms"] = (time.perf_counter() - t0) / args.steps * 1e3
    r["pipelined_steps_per_s"] = 1e3 / r["pipelined_step_ms"]

    # (3) FLOPs: by count, and XLA's estimate of the lowered step (no second compile)
    shape = StepShape(rows=batch, seq_len=args.seq_len, anchors=args.anchors, block=dcfg.block_size,
                      hidden=target.cfg.hidden_size, heads=target.cfg.num_heads,
                      kv_heads=target.cfg.num_kv_heads, head_dim=target.cfg.head_dim,
                      ffn=target.cfg.intermediate_size, vocab=target.cfg.vocab_size,
                      target_layers=target.cfg.num_layers, draft_layers=dcfg.layers.num_layers,
                      taps=dcfg.num_taps, markov_rank=dcfg.markov_rank, attn_impl=args.attn,
                      remat=args.remat, loss_remat=args.loss_remat, block_attn=args.block_attn)
    r["flops"] = step_flops(shape)
    r["tflops_per_s"] = r["flops"]["total"] / (r["step_ms_median"] * 1e-3) / 1e12
    r["tflops_per_s_pipelined"] = r["flops"]["total"] / (r["pipelined_step_ms"] * 1e-3) / 1e12
    try:
        s = trainer.state
        lowered = dt._train_step.lower(trainer.binders, trainer.optim_cfg, trainer.cfg, s.params, s.opt_state,
                                       trainer.target_params, dt._device_batch(batches[0]),
                                       jax.random.fold_in(s.rng, s.step), trainer.logit_bias, np.float32(1.0))
        cost = lowered.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if cost is None:  # jax 0.11.2 on the H200 gives no estimate of a lowered step
            raise RuntimeError("no cost estimate of the lowered step on this backend")
        r["xla_flops"] = float(cost.get("flops", 0.0)) or None
    except Exception as e:  # noqa: BLE001 - an estimate only
        r["xla_flops"] = None
        rec["notes"].append(f"batch {batch}: XLA cost analysis failed: {type(e).__name__}: {str(e)[:200]}")

    # (4) the loss forward alone (jit of drafter_loss: _eval_step) and the target's forward alone
    if breakdown:
        key = jax.random.PRNGKey(args.seed)
        dev = [dt._device_batch(b) for b in batches[:2]]
        loss_fwd = lambda d: dt._eval_step(trainer.binders, trainer.cfg, trainer.state.params,
                                           trainer.target_params, d, key, trainer.logit_bias)
        r["loss_forward"] = time_calls(loss_fwd, dev, args.steps)
        r["loss_forward"]["share_of_step"] = r["loss_forward"]["ms_median"] / r["step_ms_median"]
        tgt = lambda d: target_forward_fn()(trainer.binders[0], args.attn, tuple(dcfg.target_layer_ids),
                                     trainer.target_params, d)
        r["target_forward"] = time_calls(tgt, dev, args.steps)
        r["target_forward"]["share_of_step"] = r["target_forward"]["ms_median"] / r["step_ms_median"]
        fwd = r["flops"]["target_layers_fwd"] + r["flops"]["target_attention_fwd"]
        r["target_forward"]["tflops_per_s"] = fwd / (r["target_forward"]["ms_median"] * 1e-3) / 1e12
    r["_trainer"] = trainer  # for the trace; dropped before saving
    r["_batches"] = batches
    return r


def capture_trace(args, r: dict, rec: dict) -> dict:
    """A jax.profiler trace of --trace-steps blocked steps; the top device ops by total time."""
    import contextlib
    import jax
    trainer, batches = r["_trainer"], r["_batches"]
    trace_dir = Path(args.trace)
    trace_dir.mkdir(parents=True, exist_ok=True)
    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
    except Exception:  # noqa: BLE001 - older / newer option sets
        opts = None
    try:
        jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True, profiler_options=opts)
    except TypeError:
        jax.profiler.start_trace(str(trace_dir))
    walls = []
    t_trace = time.perf_counter()
    try:
        for i in range(args.trace_steps):
            t0 = time.perf_counter()
            with jax.profiler.TraceAnnotation(f"drafter_step_{i}"):
                jax.block_until_ready((trainer.train_step(batches[i % len(batches)]), trainer.state.params))
            walls.append(time.perf_counter() - t0)
    finally:
        try:
            jax.profiler.stop_trace()
        except Exception as e:  # noqa: BLE001 - the xplane is written before the JSON
            rec["notes"].append(f"stop_trace raised {e!r}; reading the .xplane.pb")
            with contextlib.suppress(Exception):
                from jax._src import profiler as _p
                _p._profile_state.reset()
    out = {"batch": r["batch"], "steps": args.trace_steps, "dir": str(trace_dir),
           "profiled_step_ms": [w * 1e3 for w in walls],
           "capture_s": time.perf_counter() - t_trace}
    out.update(device_op_summary(trace_dir, args.trace_steps, args.top))
    return out


def device_op_summary(trace_dir: Path, steps: int, top: int) -> dict:
    """Device events of the newest trace (the Perfetto JSON, else the .xplane.pb, as
    profile_steps reads them), summed by op name: total and per-step time, share of the summed
    device time, and device busy time (union of events) per step."""
    perfetto = sorted(trace_dir.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    tracejson = sorted(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    xplanes = sorted(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    sources = [("json", p) for p in (perfetto[-1:] or tracejson[-1:])] + [("xplane", p) for p in xplanes[-1:]]
    notes = []
    for kind, path in sources:
        try:
            events = ps.read_json_trace(path) if kind == "json" else ps.read_xplane(path)
        except Exception as e:  # noqa: BLE001 - try the next source
            notes.append(f"reading {path.name} failed: {type(e).__name__}: {e}")
            continue
        mode, tracks = ps.device_tracks(events)
        if mode == "host":
            notes.append(f"{path.name}: {len(events)} events, none on a device track")
            continue
        dev = [e for e in events if e.track in tracks]
        excl = ps.exclusive_times(dev)
        by_op: dict[str, dict] = {}
        for e, us in zip(dev, excl):
            op = by_op.setdefault(e.name, {"op": e.name, "kind": ps.guess_kernel(e.name), "count": 0,
                                           "total_us": 0.0, "hlo_op": e.args.get("hlo_op")})
            op["count"] += 1
            op["total_us"] += us
        total = sum(o["total_us"] for o in by_op.values()) or 1.0
        ops = sorted(by_op.values(), key=lambda o: -o["total_us"])
        for o in ops:
            o["us_per_step"] = o["total_us"] / steps
            o["share"] = o["total_us"] / total
        kinds: dict[str, float] = {}
        for o in ops:
            kinds[o["kind"]] = kinds.get(o["kind"], 0.0) + o["share"]
        return {"source": f"{kind}:{path.name}", "events_kind": mode, "device_events": len(dev),
                "device_us_per_step": total / steps,
                "device_busy_us_per_step": ps.union_length([(e.ts, e.end) for e in dev]) / steps,
                "share_by_kind": kinds, "top_ops": ops[:top], "notes": notes}
    notes.append("no device events in the trace: the per-op summary needs a GPU (on CPU, XLA runs "
                 "ops as host thunks with no device track)")
    return {"source": None, "device_events": 0, "top_ops": [], "notes": notes}


# ---- report ---------------------------------------------------------------------------------------

def print_report(rec: dict) -> None:
    print(f"\n{rec['backend']} ({rec['device']}), target {rec['target']['name']}, drafter {rec['drafter']['name']}"
          f", seq {rec['settings']['seq_len']}, anchors {rec['settings']['anchors']}/row, "
          f"{rec['settings']['compute_dtype']}, attn {rec['settings']['attn']}; {SYNTHETIC_NOTE}")
    print(f"{'batch':>5} {'compile s':>9} {'step ms':>9} {'piped ms':>9} {'disp ms':>8} {'steps/s':>8} "
          f"{'ktok/s':>9} {'kanch/s':>8} {'TFLOP':>7} {'TFLOP/s':>8} {'XLA TFLOP':>9} {'loss fwd ms':>11} "
          f"{'target fwd ms':>13}")
    for r in rec["records"]:
        if "error" in r:
            print(f"{r['batch']:>5}  error: {r['error']}")
            continue
        xla = f"{r['xla_flops'] / 1e12:9.3g}" if r.get("xla_flops") else f"{'-':>9}"
        lf = f"{r['loss_forward']['ms_median']:11.2f}" if "loss_forward" in r else f"{'-':>11}"
        tf = f"{r['target_forward']['ms_median']:13.2f}" if "target_forward" in r else f"{'-':>13}"
        print(f"{r['batch']:>5} {r['compile_s']:9.1f} {r['step_ms_median']:9.2f} {r['pipelined_step_ms']:9.2f} "
              f"{r['dispatch_ms_median']:8.2f} {r['steps_per_s']:8.2f} {r['tokens_per_s'] / 1e3:9.1f} "
              f"{r['anchors_per_s'] / 1e3:8.1f} {r['flops']['total'] / 1e12:7.3g} {r['tflops_per_s']:8.3g} "
              f"{xla} {lf} {tf}")
    ok = [r for r in rec["records"] if "flops" in r]
    if ok:
        f = ok[0]["flops"]
        print(f"\nFLOPs by count at batch {ok[0]['batch']} (matmuls only; share of {f['total'] / 1e12:.4g} TFLOP):")
        for k, v in f.items():
            if k != "total":
                print(f"  {k:28} {v / 1e9:10.4g} GFLOP  {v / f['total']:6.1%}")
    print("\nhost side per step (fit: batch_at + _device_batch + fold_in), median ms:")
    for h in rec["host_batch"]:
        print(f"  batch {h['batch']:>3}: batch_at {h['batch_at_ms']:.3f}, device copy {h['device_copy_ms']:.3f} "
              f"({h['batch_bytes'] / 1e6:.2f} MB), key {h['fold_in_key_ms']:.3f}, total {h['total_ms']:.3f}")
    print(f"  one-off packing of {rec['data']['sequences']} sequences: {rec['data']['pack_s_once']:.2f} s")
    tr = rec.get("trace")
    if tr:
        print(f"\ntrace of {tr['steps']} steps at batch {tr['batch']} ({tr['dir']}), profiled step ms "
              + ", ".join(f"{x:.1f}" for x in tr["profiled_step_ms"]))
        if tr["top_ops"]:
            print(f"device time per step {tr['device_us_per_step'] / 1e3:.2f} ms "
                  f"(busy {tr['device_busy_us_per_step'] / 1e3:.2f} ms); by kind "
                  + ", ".join(f"{k} {v:.1%}" for k, v in tr["share_by_kind"].items()))
            print(f"{'us/step':>10} {'share':>6} {'count':>6} {'kind':>9}  op")
            for o in tr["top_ops"]:
                print(f"{o['us_per_step']:10.1f} {o['share']:6.1%} {o['count']:6d} {o['kind']:>9}  {o['op'][:100]}")
        for n in tr["notes"]:
            print(f"  {n}")
    for n in rec["notes"]:
        print(f"note: {n}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax
    from jspec.train.drafter import drafter_config

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"jax": jax.__version__, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
           "synthetic_data": True, "notes": [], "records": [], "host_batch": []}

    def save():
        clean = dict(rec, records=[{k: v for k, v in r.items() if not k.startswith("_")} for r in rec["records"]])
        out_path.write_text(json.dumps(clean, indent=1, default=str))

    t0 = time.perf_counter()
    target_cfg, target, vocab, mask_id, pad_id = load_target(args)
    if args.attn == "cudnn" and not ts.cudnn_attention_works(segments=args.packed):
        rec["notes"].append("cuDNN attention unavailable here: the target's attention is dense "
                            "(as train_standin falls back)")
        args.attn = "dense"
    taps = tuple(int(i) for i in args.tap_layers.split(",")) if args.tap_layers else None
    dflash = ts.DRAFTERS[args.drafter][0]
    dcfg = drafter_config(target_cfg, draft_layers=args.draft_layers, mask_token_id=mask_id,
                          block_size=args.block_size, tap_layers=taps, markov_rank=args.markov_rank,
                          dflash=dflash)
    rec["target"] = {"name": "random" if args.random_target else args.target,
                     "config": target_cfg.to_hf_dict(), "compact_vocab": vocab is not None}
    rec["drafter"] = {"name": args.drafter, "layers": args.draft_layers, "block_size": dcfg.block_size,
                      "markov_rank": dcfg.markov_rank, "taps": list(dcfg.target_layer_ids)}
    rec["settings"] = {k: getattr(args, k) for k in ("seq_len", "batch_list", "anchors", "compute_dtype",
                                                     "attn", "remat", "row_chunk", "loss_remat",
                                                     "block_attn", "steps",
                                                     "packed")}
    log(f"target loaded ({time.perf_counter() - t0:.1f} s); building the synthetic data pool")
    arrays, rec["data"] = synthetic_pool(args, target_cfg.vocab_size, mask_id, pad_id)
    if rec["data"]["rows"] < max(args.batch_list):
        raise SystemExit(f"--host-sequences {args.host_sequences} packed into {rec['data']['rows']} rows, "
                         f"fewer than the largest of --batches {args.batches}")
    log(f"data: {rec['data']['rows']} rows from {args.host_sequences} sequences "
        f"(packed in {rec['data']['pack_s_once']:.2f} s)")
    for b in args.batch_list:
        rec["host_batch"].append(host_batch_timing(arrays, b, args.seed))
    save()

    for i, b in enumerate(args.batch_list):
        breakdown = args.breakdown == "all" or (args.breakdown == "first" and i == 0)
        log(f"batch {b}: compiling and timing {args.steps} steps"
            + (" (+ the loss / target forward alone)" if breakdown else ""))
        try:
            r = measure_batch(args, target, vocab, dcfg, arrays, b, breakdown, rec)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at a large batch: keep the others
            r = {"batch": b, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        rec["records"].append(r)
        save()
        if "error" not in r:
            log(f"batch {b}: {r['step_ms_median']:.2f} ms/step blocked, {r['pipelined_step_ms']:.2f} pipelined, "
                f"{r['tflops_per_s']:.2f} TFLOP/s by count")
        if i == 0 and args.trace and "error" not in r:
            log(f"tracing {args.trace_steps} steps at batch {b}")
            try:
                rec["trace"] = capture_trace(args, r, rec)
            except Exception as e:  # noqa: BLE001 - the timings stand without the trace
                rec["notes"].append(f"trace failed: {type(e).__name__}: {str(e)[:300]}")
        for k in [k for k in r if k.startswith("_")]:
            del r[k]  # free the trainer (its params and optimizer state) before the next size
        save()
    rec["notes"].append("step_ms: each step blocked on its metrics and params; pipelined_step_ms: "
                        "steps queued as fit() runs them (batch_at per step, one sync at the end)")
    rec["notes"].append("xla_flops: XLA's estimate of the lowered (unoptimised) step; custom calls "
                        "(cuDNN attention) count 0 there")
    rec["total_s"] = time.perf_counter() - t0
    save()
    print_report(rec)
    return rec


if __name__ == "__main__":
    main()
