"""Train the 8B stand-in's small parts end to end (protocol.md section 6): a Qwen3 target S
pre-trained on a corpus of .py files, then a DSpark drafter and a DFlash drafter (same budget)
distilled against S's own sampled replies; exports all three.

  python scripts/train_standin.py --corpus DIR --out OUT --toy      # CPU, a couple of minutes
  python scripts/train_standin.py --corpus DIR --out OUT [sizes, steps, --compute-dtype bfloat16]

OUT/ after a run:
  manifest.json                 corpus: file count, bytes, sha256 per file and overall
  tokenizer/                    tokenizer.json (+ config) used throughout
  data/prompts{,_eval}.jsonl    training / held-out prompts ({"prompt_ids": [...]})
  data/replies.jsonl            prompts + S's sampled replies (drafter training data)
  data/replies_eval.jsonl       held-out prompts + S's greedy replies (drafter evaluation)
  data/replies{,_eval}_t1.jsonl with --reply-t1: the same prompts answered at T = 1.0 without
                                truncation (the bench's headline law): training data, and a
                                held-out set whose tau_prob tracks the engine's T = 1 tau
  ckpt/{target,dspark,dflash}/  resumable checkpoints (rerunning the command resumes)
  logs/{target,dspark,dflash}.jsonl   loss logs
  target/   Hugging Face Qwen3 directory     dspark/, dflash/   DeepSpec-layout drafters
  summary.json                  held-out losses and drafter metrics
Stages whose export exists are skipped. Replies come from a plain sampling loop without a KV
cache (fine at toy size); at full size run with --only-target, answer data/prompts*.jsonl with
the engine, and rerun with --replies FILE --eval-replies FILE (JSONL lines
{"prompt_ids": [...], "reply_ids": [...]}; eval replies greedy).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOY = dict(tokenizer="train:512", hidden=64, layers=5, heads=4, kv_heads=2, head_dim=16, ffn=128,
           seq_len=128, batch=8, target_steps=200, target_lr=3e-3, eval_every=50, eval_rows=16,
           prompts=96, eval_prompts=16, prompt_min=8, prompt_max=48, reply_tokens=48, draft_seq_len=96,
           draft_layers=1, block_size=4, anchors=16, markov_rank=16, draft_batch=8,
           draft_steps=150, draft_lr=3e-3, reply_batch=32, export_dtype="float32",
           compute_dtype="float32", ckpt_every=50, remat=False)


def add_eval_arguments(g) -> None:
    """The engine eval's options (stage_engine_eval reads them)."""
    g.add_argument("--eval-prompts-dir",
                   help="directory with humaneval.jsonl / mbpp.jsonl: tokens per verify step of both "
                        "drafters through the engine at T = 1 and greedy (measurement only)")
    g.add_argument("--eval-max-tokens", type=int, default=256)
    g.add_argument("--eval-limit", type=int, default=0, help="first N prompts of each set (0 = all)")
    g.add_argument("--eval-samplings", default="t1,greedy",
                   help="comma list of t1, greedy (default both; without greedy no stock reference runs)")
    g.add_argument("--eval-long-tokens", type=int, default=0, metavar="N",
                   help="also evaluate at T = 1 on prompts of >= N tokens built as the bench's busy "
                        "prompts are (consecutive first turns joined; 0 = off)")
    g.add_argument("--eval-long-count", type=int, default=16, help="how many such prompts")


def eval_args(**given) -> argparse.Namespace:
    """The engine eval's options at their defaults, `given` (eval_prompts_dir=..., ...) replacing
    them: for callers of stage_engine_eval outside this script, so a new option needs no edit there."""
    ap = argparse.ArgumentParser()
    add_eval_arguments(ap)
    args = ap.parse_args([])
    unknown = set(given) - set(vars(args))
    if unknown:
        raise TypeError(f"eval_args: unknown options {sorted(unknown)}")
    vars(args).update(given)
    return args


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, action="append",
                    help="directory of .py files (repeatable: several roots form one corpus)")
    ap.add_argument("--max-corpus-bytes", type=int, default=0,
                    help="take files (deduplicated by content, in path order) up to this many bytes; 0 = all")
    ap.add_argument("--out", required=True)
    ap.add_argument("--toy", action="store_true", help="tiny shapes and steps for a CPU run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-seed", type=int, default=None,
                    help="draws the training prompts and their replies' sampling seeds (default: "
                    "--seed); the corpus, its held-out split and the held-out prompts and replies "
                    "stay on --seed, so another value gives a later session fresh training data "
                    "measured on the same held-out set")
    ap.add_argument("--tokenizer", default="qwen3",
                    help="'qwen3' (the shipped Qwen3 vocabulary), 'train:N' (a BPE of N ids trained "
                         "on the corpus, for toy runs) or a directory with tokenizer.json")
    ap.add_argument("--compact-rows", type=int, default=None,
                    help="vocabulary rows of S with --tokenizer qwen3 (the most frequent corpus ids; "
                         "the rest share one row, jspec.train.vocab); default 24576, 0 = the full table")
    ap.add_argument("--chat-tasks", type=int, default=60000,
                    help="chat-form function tasks (signature + docstring -> function) added to "
                         "the pre-training documents (qwen3 tokenizer only)")
    g = ap.add_argument_group("target S")
    g.add_argument("--hidden", type=int, default=1024)
    g.add_argument("--layers", type=int, default=12)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--ffn", type=int, default=3072)
    g.add_argument("--seq-len", type=int, default=4096)
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--target-steps", type=int, default=4000)
    g.add_argument("--target-lr", type=float, default=6e-4)
    g.add_argument("--short-seq-len", type=int, default=0,
                   help="train most steps on rows of this length (the same tokens per step), every "
                        "--long-every-th step on full --seq-len rows: attention's cost grows with the "
                        "row length, so short rows are cheaper, and the long ones keep S trained at "
                        "its full context (0 = every step at --seq-len)")
    g.add_argument("--long-every", type=int, default=5)
    g.add_argument("--data-parallel", type=int, default=0,
                   help="devices for S's data-parallel steps (0 = all local devices)")
    g.add_argument("--target-until", type=float, default=0,
                   help="stop pre-training at this time.time() (a deadline shared with what runs "
                        "before it in one GPU call; 0 = none)")
    g.add_argument("--heldout-fraction", type=float, default=0.01)
    g.add_argument("--eval-every", type=int, default=500)
    g.add_argument("--eval-rows", type=int, default=64)
    g = ap.add_argument_group("replies")
    g.add_argument("--replies", help="JSONL of prompt_ids / reply_ids instead of sampling")
    g.add_argument("--eval-replies", help="the same for the held-out (greedy) evaluation replies")
    g.add_argument("--only-target", action="store_true",
                   help="stop after pre-training S and writing data/prompts{,_eval}.jsonl (to answer "
                        "with the engine, then rerun with --replies / --eval-replies)")
    g.add_argument("--prompts", type=int, default=2048)
    g.add_argument("--described-tasks", type=float, default=0.25,
                   help="share of the training prompts that ask for a function in words (a corpus "
                        "docstring's summary: 'Write a function to return ...'; qwen3 tokenizer only); "
                        "half are code tasks (signature + docstring), the rest corpus windows")
    g.add_argument("--eval-prompts", type=int, default=64)
    g.add_argument("--prompt-min", type=int, default=64)
    g.add_argument("--prompt-max", type=int, default=1024)
    g.add_argument("--reply-tokens", type=int, default=1024)
    g.add_argument("--reply-temperature", type=float, default=0.7)
    g.add_argument("--reply-top-p", type=float, default=0.8)
    g.add_argument("--reply-top-k", type=int, default=20)
    g.add_argument("--reply-t1", action=argparse.BooleanOptionalAction, default=False,
                   help="also answer every training prompt at temperature 1.0 without top-p / top-k "
                        "(the benchmark's headline law; data/replies_t1.jsonl), and train the drafters "
                        "on both sets; the held-out prompts too (data/replies_eval_t1.jsonl), to "
                        "evaluate the drafters under that law as well")
    g.add_argument("--reply-sets", default="train,train_t1,eval,eval_t1",
                   help="which reply sets this run may sample (the others must exist or are not "
                        "needed): split across processes, one per GPU, with --stop-after-replies")
    g.add_argument("--engine-replies", action=argparse.BooleanOptionalAction, default=None,
                   help="sample replies with the jspec engine on the expanded S (default: on with "
                        "the qwen3 tokenizer; off: a plain no-cache loop, fine at toy size)")
    g.add_argument("--reply-lanes", type=int, default=128)
    g.add_argument("--reply-batch", type=int, default=32)
    g = ap.add_argument_group("drafters (DSpark and the DFlash ablation, same budget)")
    g.add_argument("--draft-seq-len", type=int, default=2048)
    g.add_argument("--pack-replies", action=argparse.BooleanOptionalAction, default=True,
                   help="pack several prompt + reply sequences into each training row, kept apart "
                        "by segment ids (a reply of ~200 tokens would otherwise leave most of a "
                        "2048-token row, and most of its anchors, to padding); held-out rows stay one "
                        "sequence each")
    g.add_argument("--joined-rows", type=float, default=0.0, metavar="SHARE",
                   help="with --pack-replies: this share of the training rows joins its sequences "
                        "into one long sequence (jspec.train.data.pack_reply_arrays joined_share), so "
                        "the drafter also trains at contexts as long as --draft-seq-len, as the "
                        "bench's busy prompts (>= 3,000 tokens) need")
    g.add_argument("--draft-layers", type=int, default=5)
    g.add_argument("--tap-layers", help="comma-separated target layers (default: 5 evenly in [1, L-3])")
    g.add_argument("--block-size", type=int, default=7)
    g.add_argument("--anchors", type=int, default=512)
    g.add_argument("--markov-rank", type=int, default=256)
    g.add_argument("--draft-batch", type=int, default=8)
    g.add_argument("--draft-steps", type=int, default=3000)
    g.add_argument("--draft-lr", type=float, default=6e-4)
    g.add_argument("--draft-time-boxed", action="store_true",
                   help="warm-up + cosine over --draft-minutes (from the first compiled step) instead "
                        "of over --draft-steps, which becomes a cap: the schedule ends when the time "
                        "box does, whatever the machine's step rate")
    g.add_argument("--skip-dflash", action="store_true")
    g.add_argument("--init-drafter", action="append", default=[], metavar="NAME=DIR",
                   help="start drafter NAME (dspark / dflash) from the weights in DIR (a drafter of "
                        "these shapes for this S, e.g. the shipped one: python -m jspec.standin path "
                        "standin-dspark --compact) instead of a random init: training accumulates "
                        "over runs (repeatable)")
    g.add_argument("--only-drafter", choices=list(DRAFTERS),
                   help="train and evaluate this drafter alone (they run side by side, one per GPU; "
                        "summary_<name>.json and engine_eval_<name>.json)")
    g.add_argument("--ablation-ce", action="store_true",
                   help="also train dspark_ce: DSpark's drafter on the CE-only objective (no L1), at "
                        "the same budget, to isolate what the L1 term does")
    add_eval_arguments(g)
    g = ap.add_argument_group("run")
    g.add_argument("--target-minutes", type=float, default=0, help="time box for pre-training (0 = none)")
    g.add_argument("--draft-minutes", type=float, default=0, help="time box per drafter (0 = none)")
    g.add_argument("--stop-after-replies", action="store_true",
                   help="stop once S and its replies exist (a first GPU call); rerun to go on")
    g.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--attn", default="dense", choices=["dense", "cudnn"],
                   help="target attention in training ('cudnn': fused, GPU + bf16 only)")
    g.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--loss-chunk", type=int, default=4096, help="target CE: tokens per vocabulary chunk")
    g.add_argument("--row-chunk", type=int, default=2048, help="drafter loss: block rows per vocabulary chunk")
    g.add_argument("--block-attn", default="split", choices=["split", "cudnn", "cudnn_chunks"],
                   help="drafter training's block attention: split einsums (scores in HBM), one "
                        "fused cuDNN attention under a mask, or that attention per chunk of "
                        "anchors with only its own blocks' keys (fewer masked scores); the cuDNN "
                        "routes are checked against split first and fall back to split where "
                        "they do not run or differ")
    g.add_argument("--loss-remat", action=argparse.BooleanOptionalAction, default=True,
                   help="drafter loss: recompute each row chunk's vocabulary-sized terms in the "
                        "backward (--no-loss-remat keeps them: more memory, less compute)")
    g.add_argument("--ckpt-every", type=int, default=500)
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    if ap.parse_known_args(argv)[0].toy:
        ap.set_defaults(**TOY)  # toy values replace the defaults, not what is given explicitly
    return ap.parse_args(argv)


# ---- stages -------------------------------------------------------------------------------------

def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage_corpus(args, out: Path) -> list[str]:
    """Texts of the corpus files (deduplicated by content; up to --max-corpus-bytes), with the
    manifest written to OUT/manifest.json."""
    import hashlib
    from jspec.train.data import gather_corpus
    files, seen, total, entries, digest = [], set(), 0, [], hashlib.sha256()
    paths = [(root, p) for root in args.corpus for p in gather_corpus(root)]
    if args.max_corpus_bytes:  # a seeded random subset, not the alphabetically first packages
        paths = [paths[i] for i in np.random.default_rng(args.seed).permutation(len(paths))]
    for root, path in paths:
        data = path.read_bytes()
        h = hashlib.sha256(data).hexdigest()
        if h in seen or not data.strip() or (args.max_corpus_bytes and total + len(data) > args.max_corpus_bytes):
            continue
        seen.add(h)
        total += len(data)
        rel = f"{root.rstrip('/')}/{path.relative_to(root).as_posix()}"
        entries.append({"path": rel, "bytes": len(data), "sha256": h})
        digest.update(f"{rel}\0{h}\n".encode())
        files.append(data.decode("utf-8", errors="replace"))
    if not files:
        raise SystemExit(f"no .py files under {args.corpus}")
    manifest = {"roots": args.corpus, "file_count": len(entries), "total_bytes": total,
                "sha256": digest.hexdigest(), "max_corpus_bytes": args.max_corpus_bytes,
                "dedup": "sha256 of content", "files": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    args.corpus_sha256 = manifest["sha256"]
    log(f"corpus: {len(entries)} files, {total:,} bytes, sha256 {manifest['sha256'][:16]}")
    return files


def stage_tokenizer(args, out: Path, texts: list[str]):
    """(tokenizer, its directory, model vocab size, separator id, mask id)."""
    from jspec.tokenizer import ENDOFTEXT_ID, Tokenizer, write_qwen3_tokenizer
    tok_dir = out / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    if args.tokenizer == "qwen3":
        write_qwen3_tokenizer(tok_dir)
        tok = Tokenizer.qwen3()
        # Qwen3's 151936-row table; 151669, the first unused row, is DSpark's mask token.
        return tok, tok_dir, 151936, ENDOFTEXT_ID, 151669
    if args.tokenizer.startswith("train:"):
        if not (tok_dir / "tokenizer.json").is_file():
            _train_bpe(texts, int(args.tokenizer.split(":")[1]), tok_dir)
    else:
        tok_dir = Path(args.tokenizer)
    tok = Tokenizer.from_dir(tok_dir)
    sep = tok.token_to_id("<|endoftext|>")
    if sep is None:
        raise SystemExit(f"{tok_dir}: the tokenizer has no <|endoftext|> to separate documents")
    mask = tok.vocab_size  # the first id the tokenizer never produces
    return tok, tok_dir, -(-(mask + 1) // 64) * 64, sep, mask


def _train_bpe(texts, vocab_size, tok_dir: Path):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer)
    tk.save(str(tok_dir / "tokenizer.json"))
    eos = [tk.token_to_id("<|endoftext|>")]
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def split_files(texts, args):
    """(train texts, held-out texts), by whole files."""
    from jspec.train.data import split_documents
    idx = list(range(len(texts)))
    train_idx, held_idx = split_documents([[i] for i in idx], args.heldout_fraction, args.seed)
    return [texts[i[0]] for i in train_idx], [texts[i[0]] for i in held_idx]


def chat_tasks(texts, tok, limit: int, seed: int, with_answers: bool) -> list[str]:
    """Up to `limit` chat-form function tasks from the files, in a seeded random order."""
    import numpy as np
    from jspec.train.data import INSTRUCTIONS, chat_task_text, function_tasks
    rng = np.random.default_rng(seed)
    tasks = [t for text in texts for t in function_tasks(text)]
    order = rng.permutation(len(tasks))[:limit]
    return [chat_task_text(tok, tasks[i][0], tasks[i][1] if with_answers else None,
                           INSTRUCTIONS[int(rng.integers(len(INSTRUCTIONS)))]) for i in order]


def described_tasks(texts, tok, limit: int, seed: int) -> list[str]:
    """Up to `limit` chat prompts asking in words for a function the files document (its
    docstring's summary, jspec.train.data.function_descriptions), distinct, in a seeded random
    order, each under a template of its verb's form."""
    import numpy as np
    from jspec.train.data import DESCRIPTION_TEMPLATES, described_task_text, function_descriptions
    rng = np.random.default_rng(seed)
    found = sorted({d for text in texts for d in function_descriptions(text)})
    order = rng.permutation(len(found))[:limit]
    prompts = []
    for i in order:
        task, form = found[i]
        templates = DESCRIPTION_TEMPLATES[form]
        prompts.append(described_task_text(tok, task, templates[int(rng.integers(len(templates)))]))
    return prompts


def stage_target(args, out: Path, target_cfg, train_docs, held_docs, tok_dir, eos_ids, vocab):
    """Pre-train S (resuming from checkpoints) and export it; returns (model, held-out loss).
    With a compact vocabulary the documents are already rows and the loss carries the rows'
    log multiplicities; the export's config.json names the vocabulary (jspec_* keys)."""
    from jspec.loading import load_model
    from jspec.qwen3 import init_random
    from jspec.train import OptimConfig, data_mesh
    from jspec.train.checkpointing import CheckpointManager, LossLog, export_target, fit, resume
    from jspec.train.data import batch_source, interleaved_source, pack_documents
    from jspec.train.target import TargetTrainConfig, TargetTrainer

    export = out / "target"
    if (export / "config.json").is_file():
        log(f"target: {export} exists, skipping pre-training")
        return load_model(export)[1], None
    if args.attn == "cudnn" and not cudnn_attention_works():
        log("target: cuDNN attention unavailable here; training with dense attention")
        args.attn = "dense"
    rows = pack_documents(train_docs, args.seq_len, args.sep_id)
    held = pack_documents(held_docs, args.seq_len, args.sep_id)[:args.eval_rows]
    log(f"target: {len(rows)} rows x {args.seq_len} tokens for training, {len(held)} held out")
    eval_batch = min(args.batch, len(held))
    batches = batch_source({"tokens": rows}, args.batch, args.seed)
    if args.short_seq_len:
        if args.seq_len % args.short_seq_len:
            raise SystemExit(f"--short-seq-len {args.short_seq_len} must divide --seq-len {args.seq_len}")
        split = args.seq_len // args.short_seq_len  # a long row is `split` short rows, cut in place
        short = batch_source({"tokens": rows.reshape(-1, args.short_seq_len)}, args.batch * split, args.seed)
        batches = interleaved_source(short, batches, args.long_every)
        log(f"target: {args.long_every - 1} of every {args.long_every} steps on {args.batch * split} rows x "
            f"{args.short_seq_len}, the rest on {args.batch} x {args.seq_len}")
    mesh = data_mesh(args.data_parallel or None)
    if mesh is not None:
        log(f"target: data-parallel over {mesh.size} devices")
    trainer = TargetTrainer(
        init_random(target_cfg, seed=args.seed),
        OptimConfig(args.target_steps, lr=args.target_lr, weight_decay=0.1, b2=0.95),
        TargetTrainConfig(compute_dtype=args.compute_dtype, attn_impl=args.attn, remat=args.remat,
                          loss_chunk=args.loss_chunk), seed=args.seed,
        logit_bias=None if vocab is None else vocab.log_multiplicity(), mesh=mesh)
    manager = CheckpointManager(out / "ckpt" / "target")
    run_id = {"corpus_sha256": args.corpus_sha256, "tokens": int(rows.size)}
    if resume(trainer, manager, expect=run_id) is not None:
        log(f"target: resumed at step {trainer.state.step}")
    loss_log = LossLog(out / "logs" / "target.jsonl", resume_step=trainer.state.step or None)
    evaluate = (lambda: trainer.eval_loss(held, eval_batch)) if eval_batch else None
    t0 = time.time()
    deadlines = [t for t in (args.target_until, t0 + 60 * args.target_minutes if args.target_minutes else 0) if t]
    fit(trainer, batches, args.target_steps,
        manager=manager, ckpt_every=args.ckpt_every, log=loss_log, eval_fn=evaluate,
        eval_every=args.eval_every, log_every=args.log_every, progress=not args.quiet, desc="target",
        ckpt_extra=run_id, deadline=min(deadlines) if deadlines else None)
    held_loss = evaluate() if evaluate else None
    if held_loss:
        loss_log.write({"step": trainer.state.step, **{f"eval_{k}": v for k, v in held_loss.items()}})
    loss_log.close()
    log(f"target: {time.time() - t0:.0f} s, {trainer.state.step} steps, held-out {held_loss}")
    export_target(trainer.model(), export, dtype=args.export_dtype, eos_ids=eos_ids, tokenizer_dir=tok_dir)
    if vocab is not None:
        hf = json.loads((export / "config.json").read_text())
        hf.update(vocab.hf_keys())
        (export / "config.json").write_text(json.dumps(hf, indent=2))
    (out / "target_heldout.json").write_text(json.dumps({"heldout": held_loss, "steps": trainer.state.step}))
    log(f"target: exported to {export}")
    return load_model(export)[1], held_loss


def cudnn_attention_works(segments: bool = False) -> bool:
    """cuDNN's fused causal attention runs here (and, with `segments`, with a packed row's
    segment mask, matching the dense masked softmax)."""
    import jax
    import jax.numpy as jnp
    from jspec.train.target import segment_attention_gap
    try:
        x = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
        jax.block_until_ready(jax.jit(lambda q: jax.nn.dot_product_attention(
            q, q, q, is_causal=True, implementation="cudnn"))(x))
        if segments:
            err = segment_attention_gap("cudnn", 256)
            if not err < 3e-2:
                log(f"cuDNN attention with a segment mask differs from the dense one by {err}")
                return False
        return True
    except Exception as e:  # no GPU, old cuDNN, unsupported shape: say why and fall back
        log(f"cuDNN attention check failed: {type(e).__name__}: {str(e)[:200]}")
        return False


def cudnn_block_attention_works(impl: str = "cudnn") -> bool:
    """The drafter's block attention fused on cuDNN (`impl`: "cudnn" or "cudnn_chunks") runs here
    and matches the split einsums."""
    from jspec.train.drafter import block_attention_gap
    try:
        err = block_attention_gap(impl)
    except Exception as e:  # no GPU, old cuDNN, unsupported shape: say why and fall back
        log(f"cuDNN block attention check failed: {type(e).__name__}: {str(e)[:200]}")
        return False
    if not err < 3e-2:
        log(f"cuDNN block attention differs from the split one by {err}: using split")
        return False
    return True


def stage_prompts(args, out: Path, tok, train_texts, held_texts, train_docs, held_docs):
    """Training prompts (half chat-form function tasks of training files, --described-tasks of
    them functions asked for in words, the rest windows of training documents) and held-out
    prompts (chat tasks of held-out files, else windows of held-out documents), as ids of the
    tokenizer, written once."""
    from jspec.train.data import make_prompts
    if not 0 <= args.described_tasks <= 0.5:
        raise SystemExit(f"--described-tasks {args.described_tasks}: a share in [0, 0.5] (half the "
                         "training prompts are code tasks)")
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    sets = {}
    for name, texts, docs, n in (("prompts", train_texts, train_docs, args.prompts),
                                 ("prompts_eval", held_texts, held_docs, args.eval_prompts)):
        seed = prompt_seed(args) if name == "prompts" else args.seed
        path = data / f"{name}.jsonl"
        if path.is_file():
            sets[name] = [json.loads(line)["prompt_ids"] for line in path.read_text().splitlines() if line]
            continue
        prompts = []
        if args.tokenizer == "qwen3":
            chats = chat_tasks(texts, tok, n // 2 if name == "prompts" else n, seed + 7 + len(name), False)
            if name == "prompts" and args.described_tasks:  # (the held-out set stays as it was)
                chats += described_tasks(texts, tok, round(args.described_tasks * n), seed + 11)
            prompts = [ids for ids in tok.encode_batch(chats) if len(ids) <= args.prompt_max]
        try:
            prompts += make_prompts(docs, n - len(prompts), args.prompt_min, args.prompt_max, seed + len(name))
        except ValueError:
            prompts += make_prompts(train_docs, n - len(prompts), args.prompt_min, args.prompt_max,
                                    seed + len(name))
        path.write_text("".join(json.dumps({"prompt_ids": list(map(int, p))}) + "\n" for p in prompts))
        sets[name] = prompts
    return sets["prompts"], sets["prompts_eval"]


def prompt_seed(args) -> int:
    return args.seed if args.prompt_seed is None else args.prompt_seed


def engine_replies(full_dir: Path, prompts, args, temperature: float, seed: int,
                   raw: bool = False) -> list[list[int]]:
    """S's replies through the jspec engine on the expanded (full-vocabulary) S: the law the
    graft serves. Per-request seeds from `seed`; top-p / top-k only when sampling and not
    `raw`."""
    from jspec.api import LLM, SamplingParams
    longest = max(map(len, prompts)) + args.reply_tokens
    llm = LLM(full_dir, dtype=args.compute_dtype, max_lanes=args.reply_lanes,
              max_context=-(-longest // 64) * 64, prefill_chunk=512, attn_impl="auto")
    truncate = temperature and not raw
    seed0 = seed * 100003 + (7919 if raw else 0)  # the raw set draws other seeds
    sp = [SamplingParams(temperature=temperature, top_p=args.reply_top_p if truncate else 1.0,
                         top_k=args.reply_top_k if truncate else 0, seed=seed0 + i,
                         max_tokens=args.reply_tokens) for i in range(len(prompts))]
    return [r.token_ids for r in llm.generate([list(p) for p in prompts], sp)]


# name -> (DFlash architecture?, the loss's name in jspec.train.drafter); dspark_ce is the
# ablation (--ablation-ce)
DRAFTERS = {"dspark": (False, "DSPARK_LOSS"), "dflash": (True, "DFLASH_LOSS"),
            "dspark_ce": (False, "DSPARK_CE_LOSS")}

REPLY_SETS = {"train": "replies", "train_t1": "replies_t1", "eval": "replies_eval",
              "eval_t1": "replies_eval_t1"}
T1_SETS = ("replies_t1", "replies_eval_t1")  # sampled at T = 1.0, untruncated, with --reply-t1
TRAIN_SETS = ("replies", "replies_t1")  # replies to the training prompts (--prompt-seed)


def stage_replies(args, out: Path, model, prompts, eos_ids, full_dir: Path | None):
    """Replies to the training prompts (sampled: T, top-p, top-k of --reply-*) and to the
    held-out prompts (greedy); with --reply-t1 both prompt sets also at T = 1.0 without
    truncation. Ids of the tokenizer (full ids with the qwen3 tokenizer). Sets this run may not
    sample (--reply-sets) are read when another process has written them, else left out (None).
    Returns (training replies, held-out greedy replies, held-out T = 1 replies or None)."""
    from jspec.train.data import read_replies, write_replies
    from jspec.train.drafter import sample_replies
    asked = [k for k in args.reply_sets.split(",") if k]
    unknown = [k for k in asked if k not in REPLY_SETS]
    if unknown:
        raise SystemExit(f"--reply-sets: unknown set(s) {', '.join(unknown)} "
                         f"(the sets are {', '.join(REPLY_SETS)})")
    may_sample = {REPLY_SETS[k] for k in asked}
    sets = {}
    for name, prompt_set, temperature, given in (
            ("replies", prompts[0], args.reply_temperature, args.replies),
            ("replies_t1", prompts[0], 1.0, None),
            ("replies_eval", prompts[1], 0.0, args.eval_replies),
            ("replies_eval_t1", prompts[1], 1.0, None)):
        path = out / "data" / f"{name}.jsonl"
        if name in T1_SETS and not args.reply_t1:
            continue
        if given:
            sets[name] = read_replies(given)
        elif path.is_file():
            sets[name] = read_replies(path)
        elif name not in may_sample:
            sets[name] = None
        else:
            t0 = time.time()
            seed = prompt_seed(args) if name in TRAIN_SETS else args.seed
            if full_dir is not None:
                replies = engine_replies(full_dir, prompt_set, args, temperature, seed,
                                         raw=name in T1_SETS)
            else:  # a plain loop without a KV cache: fine at toy size, slow at 4k context
                replies = sample_replies(model, prompt_set, args.reply_tokens, temperature=temperature,
                                         seed=seed, eos_ids=eos_ids, batch_size=args.reply_batch,
                                         progress=not args.quiet)
            write_replies(path, prompt_set, replies)
            log(f"{name}: {len(prompt_set)} replies, {sum(map(len, replies)):,} tokens, "
                f"T = {temperature}, {time.time() - t0:.0f} s")
            sets[name] = (prompt_set, replies)
    train = sets["replies"]
    if sets.get("replies_t1") and train:  # both laws' replies train the drafters
        train = (list(train[0]) + list(sets["replies_t1"][0]), list(train[1]) + list(sets["replies_t1"][1]))
    elif args.reply_t1:
        train = None  # not all of it yet: another process is sampling the rest
    return train, sets["replies_eval"], sets.get("replies_eval_t1")


def drafter_train_config(args, loss_cfg):
    """The drafter step's configuration from the command line (also scripts/profile_drafter_train.py's)."""
    from jspec.train.drafter import DrafterTrainConfig
    return DrafterTrainConfig(num_anchors=args.anchors, loss=loss_cfg, compute_dtype=args.compute_dtype,
                              target_attn_impl=args.attn, remat=args.remat, row_chunk=args.row_chunk,
                              loss_remat=args.loss_remat, block_attn_impl=args.block_attn)


def stage_drafter(args, out: Path, name: str, model, dcfg, loss_cfg, train, held, held_t1, vocab):
    """Train one drafter (resuming) and export it. Evaluated on the held-out greedy replies and,
    when given, the held-out T = 1 replies (metrics prefixed t1_): the greedy set flatters
    tau_prob at T = 1, whose drafts meet sampled continuations."""
    from jspec.dspark import init_random_drafter
    from jspec.train import OptimConfig
    from jspec.train.checkpointing import CheckpointManager, LossLog, export_drafter, fit, resume
    from jspec.train.data import batch_source
    from jspec.train.drafter import DrafterTrainer

    export = out / name
    if (export / "config.json").is_file():
        log(f"{name}: {export} exists, skipping")
        return None
    if args.draft_time_boxed and not args.draft_minutes:
        raise SystemExit("--draft-time-boxed needs --draft-minutes (the time box)")
    init = dict(d.split("=", 1) for d in args.init_drafter).get(name)
    drafter = init_random_drafter(dcfg, seed=args.seed + 1) if init is None else initial_drafter(init, dcfg, model)
    trainer = DrafterTrainer(
        model, drafter, OptimConfig(args.draft_steps, lr=args.draft_lr, time_boxed=args.draft_time_boxed),
        drafter_train_config(args, loss_cfg),
        seed=args.seed, logit_bias=None if vocab is None else vocab.log_multiplicity())
    eval_batch = min(args.draft_batch, len(held["tokens"]))

    def evaluate():
        metrics = trainer.evaluate(held, eval_batch)
        if held_t1 is not None:
            t1 = trainer.evaluate(held_t1, min(args.draft_batch, len(held_t1["tokens"])))
            metrics.update({f"t1_{k}": v for k, v in t1.items()})
        return metrics

    before = evaluate()
    manager = CheckpointManager(out / "ckpt" / name)
    run_id = {"corpus_sha256": args.corpus_sha256, "reply_tokens": int(train["loss_mask"].sum()),
              "init": init, "rows": len(train["tokens"])}
    if resume(trainer, manager, expect=run_id) is not None:
        log(f"{name}: resumed at step {trainer.state.step}")
    loss_log = LossLog(out / "logs" / f"{name}.jsonl", resume_step=trainer.state.step or None)
    t0 = time.time()
    fit(trainer, batch_source(train, args.draft_batch, args.seed), args.draft_steps, manager=manager,
        ckpt_every=args.ckpt_every, log=loss_log, eval_fn=evaluate, eval_every=args.eval_every,
        log_every=args.log_every, progress=not args.quiet, desc=name, ckpt_extra=run_id,
        deadline=t0 + 60 * args.draft_minutes if args.draft_minutes else None)
    after = evaluate()
    loss_log.write({"step": trainer.state.step, **{f"eval_{k}": v for k, v in after.items()}})
    loss_log.close()
    log(f"{name}: {time.time() - t0:.0f} s, {trainer.state.step} steps; held-out tau_greedy "
        f"{before['tau_greedy']:.2f} -> {after['tau_greedy']:.2f}, tau_prob {before['tau_prob']:.2f} -> "
        f"{after['tau_prob']:.2f}, L1 {before['l1']:.3f} -> {after['l1']:.3f}, first-position c* "
        f"{before['c_star_1']:.3f} -> {after['c_star_1']:.3f} (greedy held-out replies)"
        + (f"; on T = 1 replies tau_prob {before['t1_tau_prob']:.2f} -> {after['t1_tau_prob']:.2f}, "
           f"first-position c* {before['t1_c_star_1']:.3f} -> {after['t1_c_star_1']:.3f}"
           if held_t1 is not None else ""))
    export_drafter(trainer.drafter(), None if vocab is not None else model, export, dtype=args.export_dtype)
    log(f"{name}: exported to {export}")
    return {"untrained": before, "trained": after, "steps": trainer.state.step}


def initial_drafter(path: str, dcfg, model):
    """A trained drafter to start from: refused unless every weight has this run's shape and its
    mask token and taps are this run's."""
    from jspec.dspark import drafter_checkpoint_shapes
    from jspec.loading import load_drafter
    cfg, drafter = load_drafter(path, model.cfg, None)
    want = {k: shape for k, (shape, _) in drafter_checkpoint_shapes(dcfg).items()}
    have = {k: shape for k, (shape, _) in drafter_checkpoint_shapes(cfg).items()}
    if want != have or (cfg.mask_token_id, tuple(cfg.target_layer_ids)) != (dcfg.mask_token_id,
                                                                            tuple(dcfg.target_layer_ids)):
        raise SystemExit(f"--init-drafter {path}: not a drafter of this run's shapes, mask token and taps")
    log(f"drafter initialised from {path}")
    return drafter


def eval_samplings(value: str, flag: str = "--eval-samplings") -> tuple[str, ...]:
    """--eval-samplings (or the caller's `flag`): a non-empty comma list of t1 and greedy."""
    names = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    bad = [v for v in names if v not in ("t1", "greedy")]
    if bad or not names:
        raise ValueError(f"{flag}: choose from t1, greedy, not {bad or 'nothing'}")
    return names


def stage_engine_eval(args, out: Path, full_target: Path, drafters: dict[str, Path], path: Path) -> dict:
    """Tokens per verify step of each drafter through the engine on the humaneval + mbpp first
    turns (chat template), at T = 1 and greedy (--eval-samplings); greedy outputs checked against
    stock."""
    from jspec.api import LLM, SamplingParams
    from jspec.engine import EngineConfig
    from jspec.prompts import load_prompts
    from jspec.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(full_target)
    sets = {s: load_prompts(Path(args.eval_prompts_dir) / f"{s}.jsonl", limit=args.eval_limit or None)
            for s in ("humaneval", "mbpp")}
    texts = [r.first_turn for records in sets.values() for r in records]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    long_prompts = []
    if args.eval_long_tokens:  # busy-like: consecutive first turns joined into one prompt
        from jspec.bench.workloads import concatenated_prompts
        long_prompts = concatenated_prompts(tok, texts, args.eval_long_count, args.eval_long_tokens)
    ctx = -(-(max(map(len, prompts + long_prompts)) + args.eval_max_tokens + 16) // 64) * 64
    kw = dict(dtype="float32", max_lanes=64, max_context=ctx, prefill_chunk=512)
    samplings = eval_samplings(args.eval_samplings)
    greedy_ref = None
    if "greedy" in samplings:
        stock = LLM(full_target, **kw)
        greedy_ref = [r.token_ids for r in stock.generate(prompts, SamplingParams(temperature=0, max_tokens=args.eval_max_tokens))]
    # "sets": how many of the prompts, in order, each set gave (compare_drafters splits by it)
    result = {"prompts": len(prompts), "sets": {s: len(r) for s, r in sets.items()},
              "max_tokens": args.eval_max_tokens, "dtype": "float32",
              "verify_rule": EngineConfig().verify_rule}  # the engines' default accept rule
    def per_request(res) -> dict:  # in prompt order: what scripts/compare_drafters.py pairs
        return {"tokens": [len(r.token_ids) for r in res],
                "steps": [len(r.token_ids) / r.tokens_per_step if r.tokens_per_step else 0.0
                          for r in res]}

    def tokens_per_step(per: dict) -> float:  # every emitted token over all replies' verify steps
        return sum(per["tokens"]) / sum(per["steps"])

    for name, d in drafters.items():
        llm = LLM(full_target, draft=d, **kw)
        for label, sp in (("t1", SamplingParams(temperature=1.0, seed=0, max_tokens=args.eval_max_tokens)),
                          ("greedy", SamplingParams(temperature=0.0, max_tokens=args.eval_max_tokens))):
            if label not in samplings:
                continue
            res = llm.generate(prompts, [dataclasses.replace(sp, seed=i) for i in range(len(prompts))])
            per = per_request(res)
            rec = {"tokens_per_step": tokens_per_step(per), "tokens": sum(per["tokens"]),
                   "mean_per_request": sum(r.tokens_per_step for r in res) / len(res),
                   "per_request": per}
            if label == "t1" and long_prompts:
                res = llm.generate(long_prompts, [dataclasses.replace(sp, seed=i) for i in range(len(long_prompts))])
                per = per_request(res)
                rec["long"] = {"prompts": len(long_prompts), "min_tokens": args.eval_long_tokens,
                               "prompt_tokens_mean": sum(map(len, long_prompts)) / len(long_prompts),
                               "tokens_per_step": tokens_per_step(per), "per_request": per}
                log(f"eval {name} t1, prompts of >= {args.eval_long_tokens} tokens: tokens per verify "
                    f"step {rec['long']['tokens_per_step']:.3f}")
            if label == "greedy":
                rec["greedy_match"] = sum(r.token_ids == g for r, g in zip(res, greedy_ref)) / len(res)
            result[f"{name}_{label}"] = rec
            start, by_set = 0, []
            for set_name, count in result["sets"].items():  # each set's own figure, in prompt order
                part = {k: v[start:start + count] for k, v in rec["per_request"].items()}
                start += count
                if count:
                    by_set.append(f"{set_name} {tokens_per_step(part):.3f}")
            log(f"eval {name} {label}: tokens per verify step {rec['tokens_per_step']:.3f} ({', '.join(by_set)})"
                + (f", greedy match {rec['greedy_match']:.3f}" if "greedy_match" in rec else ""))
            path.write_text(json.dumps(result, indent=1))  # after each: a cut-off eval keeps it
    return result


def main(argv=None):
    args = parse_args(argv)
    try:  # refused before any training, not after it
        eval_samplings(args.eval_samplings)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    from jspec.config import Qwen3Config
    from jspec.train.data import tokenize_documents
    from jspec.train.vocab import build_compact_vocab, coverage

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    qwen3 = args.tokenizer == "qwen3"
    if args.compact_rows is None:
        args.compact_rows = 24576 if qwen3 else 0
    if args.engine_replies is None:
        args.engine_replies = qwen3
    if light_resume(args, out):  # S and its prompts exist: the corpus is not needed again
        return after_target(args, out, *light_state(args, out))
    texts = stage_corpus(args, out)
    tok, tok_dir, vocab_size, args.sep_id, mask_id = stage_tokenizer(args, out, texts)
    train_texts, held_texts = split_files(texts, args)
    t0 = time.time()
    train_docs, held_docs = tokenize_documents(train_texts, tok), tokenize_documents(held_texts, tok)
    if qwen3 and args.chat_tasks:
        chats = chat_tasks(train_texts, tok, args.chat_tasks, args.seed, True)
        train_docs += tokenize_documents(chats, tok)
        held_docs += tokenize_documents(chat_tasks(held_texts, tok, max(1, args.chat_tasks // 100), args.seed, True), tok)
        log(f"chat tasks: {len(chats)} in training")
    log(f"tokenized: {len(train_docs)} + {len(held_docs)} held-out documents, "
        f"{sum(map(len, train_docs)):,} training tokens, {time.time() - t0:.0f} s")
    eos_ids = list(tok.eos_ids) if qwen3 else [args.sep_id]
    vocab = None
    full_sep = args.sep_id
    if args.compact_rows:
        vocab = build_compact_vocab(train_docs, args.compact_rows)
        given = out / "target" / "config.json"
        if given.is_file():  # S is given (e.g. the shipped one, to train drafters on): same rows?
            hf = json.loads(given.read_text())
            if any(hf.get(k) != v for k, v in json.loads(json.dumps(vocab.hf_keys())).items()):
                raise SystemExit(f"{given}: S's compact vocabulary is not the one this corpus gives "
                                 f"(another corpus or --compact-rows): its rows would be misread")
        log(f"compact vocabulary: {vocab.rows} rows, training coverage {coverage(vocab, train_docs):.4f}, "
            f"held-out {coverage(vocab, held_docs):.4f}")
        vocab_size, mask_id, args.sep_id = vocab.rows, vocab.mask_row, int(vocab.to_rows([args.sep_id])[0])
    rows_of = vocab.docs_to_rows if vocab else (lambda docs: docs)
    target_cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.ffn,
                             num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                             head_dim=args.head_dim, max_position_embeddings=max(40960, args.seq_len),
                             tie_word_embeddings=bool(args.compact_rows), dtype="float32")
    model, held_loss = stage_target(args, out, target_cfg, rows_of(train_docs), rows_of(held_docs),
                                    tok_dir, eos_ids, vocab)
    prompts = stage_prompts(args, out, tok, train_texts, held_texts, train_docs, held_docs)
    full_dir = full_target_dir(args, out, vocab)  # made here, before processes that share it start
    if args.only_target:
        log(f"--only-target: S is in {out / 'target'}; prompts in {out / 'data'}")
        return
    after_target(args, out, target_cfg, model, vocab, mask_id, full_dir, prompts,
                 [full_sep] + eos_ids, {"config": target_cfg.to_hf_dict(), "heldout": held_loss})


def full_target_dir(args, out: Path, vocab) -> Path | None:
    """The expanded (full-vocabulary) S the engine serves, made once (None without the engine)."""
    if not args.engine_replies:
        return None
    from jspec.convert.expand_vocab import expand_target
    full_dir = out / "full" / "target"
    if not (full_dir / "config.json").is_file():
        expand_target(out / "target", full_dir) if vocab else shutil.copytree(out / "target", full_dir)
    return full_dir


def after_target(args, out: Path, target_cfg, model, vocab, mask_id, full_dir, prompts, eos_ids,
                 target_summary):
    """Replies, then (unless --stop-after-replies) the drafters."""
    train_pr, eval_pr, eval_t1_pr = stage_replies(args, out, model, prompts, eos_ids, full_dir)
    if args.stop_after_replies:
        log("--stop-after-replies: done")
        return
    missing = [n for n, r in (("training", train_pr), ("held-out", eval_pr),
                              ("held-out T = 1", eval_t1_pr if args.reply_t1 else ())) if r is None]
    if missing:
        raise SystemExit(f"the {' and '.join(missing)} replies are not all in {out / 'data'}: sample them "
                         f"first (--reply-sets, --stop-after-replies)")
    drafter_stages(args, out, target_cfg, model, vocab, mask_id, full_dir, train_pr, eval_pr, eval_t1_pr,
                   target_summary)


def light_resume(args, out: Path) -> bool:
    data = out / "data"
    return ((out / "target" / "config.json").is_file() and (out / "manifest.json").is_file()
            and (data / "prompts.jsonl").is_file() and (data / "prompts_eval.jsonl").is_file())


def light_state(args, out: Path):
    """What the later stages need, from OUT alone (after a first call that stopped after S and
    its prompts, or after the replies): S, its vocabulary, the prompts."""
    from jspec.tokenizer import Tokenizer
    from jspec.train.vocab import load_training_target
    args.corpus_sha256 = json.loads((out / "manifest.json").read_text())["sha256"]
    tok = Tokenizer.from_dir(out / "target")
    sep = tok.token_to_id("<|endoftext|>")
    target_cfg, model, vocab, mask_id = load_training_target(out / "target")
    args.sep_id = sep if vocab is None else int(vocab.to_rows([sep])[0])
    if vocab is None and args.tokenizer != "qwen3":
        mask_id = tok.vocab_size
    full_dir = full_target_dir(args, out, vocab)
    held = (out / "target_heldout.json")
    gen = out / "target" / "generation_config.json"
    eos_ids = [sep] + (json.loads(gen.read_text())["eos_token_id"] if gen.is_file() else [])
    prompts = tuple([json.loads(line)["prompt_ids"] for line in (out / "data" / f"{n}.jsonl").read_text().splitlines()
                     if line] for n in ("prompts", "prompts_eval"))
    log(f"resuming from {out}: S, its vocabulary and prompts (corpus not re-read)")
    return (target_cfg, model, vocab, mask_id, full_dir, prompts, eos_ids,
            {"config": target_cfg.to_hf_dict(),
             "heldout": json.loads(held.read_text())["heldout"] if held.is_file() else None})


def drafter_stages(args, out: Path, target_cfg, model, vocab, mask_id, full_dir, train_pr, eval_pr,
                   eval_t1_pr, target_summary):
    from jspec.train import drafter as drafter_training
    from jspec.train.data import pack_reply_arrays, reply_arrays
    from jspec.train.drafter import drafter_config
    if args.attn == "cudnn" and not cudnn_attention_works(segments=args.pack_replies):
        args.attn = "dense"
    if args.block_attn != "split" and not cudnn_block_attention_works(args.block_attn):
        args.block_attn = "split"
    rows_of = vocab.docs_to_rows if vocab else (lambda docs: docs)
    if args.joined_rows and not args.pack_replies:
        raise SystemExit("--joined-rows needs --pack-replies")
    to_rows = (functools.partial(pack_reply_arrays, joined_share=args.joined_rows, seed=args.seed)
               if args.pack_replies else reply_arrays)
    train = to_rows(rows_of(train_pr[0]), rows_of(train_pr[1]), args.draft_seq_len, pad_id=args.sep_id)
    held = reply_arrays(rows_of(eval_pr[0]), rows_of(eval_pr[1]), args.draft_seq_len, pad_id=args.sep_id)
    held_t1 = None if eval_t1_pr is None else reply_arrays(rows_of(eval_t1_pr[0]), rows_of(eval_t1_pr[1]),
                                                           args.draft_seq_len, pad_id=args.sep_id)
    log(f"drafter data: {len(train_pr[0])} training sequences"
        + (f" packed into {len(train['tokens'])} rows" if args.pack_replies else "")
        + (f" ({args.joined_rows:.0%} joined into one sequence each)" if args.joined_rows else "")
        + f", {int(train['loss_mask'].sum()):,} reply tokens")

    taps = tuple(int(i) for i in args.tap_layers.split(",")) if args.tap_layers else None
    summary = {"target": target_summary}
    drafter_dirs = {}
    for name, (dflash, loss_name) in DRAFTERS.items():
        wanted = name != "dspark_ce" or args.ablation_ce or args.only_drafter == name
        if not wanted or dflash and args.skip_dflash or args.only_drafter not in (None, name):
            continue
        loss = getattr(drafter_training, loss_name)
        dcfg = drafter_config(target_cfg, draft_layers=args.draft_layers, mask_token_id=mask_id,
                              block_size=args.block_size, tap_layers=taps,
                              markov_rank=args.markov_rank, dflash=dflash)
        summary[name] = {"config": dcfg.to_hf_dict(),
                         "metrics": stage_drafter(args, out, name, model, dcfg, loss, train, held, held_t1,
                                                    vocab)}
        drafter_dirs[name] = out / name
        if full_dir is not None:
            from jspec.convert.expand_vocab import expand_drafter
            drafter_dirs[name] = out / "full" / name
            if vocab is not None:
                expand_drafter(out / name, drafter_dirs[name], out / "target")
            elif not drafter_dirs[name].exists():
                shutil.copytree(out / name, drafter_dirs[name])
    suffix = f"_{args.only_drafter}" if args.only_drafter else ""
    if args.eval_prompts_dir and full_dir is not None:
        summary["engine_eval"] = stage_engine_eval(args, out, full_dir, drafter_dirs,
                                                   out / f"engine_eval{suffix}.json")
    summary["args"] = vars(args)
    (out / f"summary{suffix}.json").write_text(json.dumps(summary, indent=1, default=str))
    log(f"done: {out}")


if __name__ == "__main__":
    main()
