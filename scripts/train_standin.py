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
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOY = dict(tokenizer="train:512", hidden=64, layers=5, heads=4, kv_heads=2, head_dim=16, ffn=128,
           seq_len=128, batch=8, target_steps=200, target_lr=3e-3, eval_every=50, eval_rows=16,
           prompts=96, eval_prompts=16, prompt_min=8, prompt_max=48, reply_tokens=48, draft_seq_len=96,
           draft_layers=1, block_size=4, anchors=16, markov_rank=16, draft_batch=8,
           draft_steps=150, draft_lr=3e-3, reply_batch=32, export_dtype="float32",
           compute_dtype="float32", ckpt_every=50, remat=False)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="directory of .py files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--toy", action="store_true", help="tiny shapes and steps for a CPU run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default="qwen3",
                    help="'qwen3' (the shipped Qwen3 vocabulary), 'train:N' (a BPE of N ids trained "
                         "on the corpus, for toy runs) or a directory with tokenizer.json")
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
    g.add_argument("--eval-prompts", type=int, default=64)
    g.add_argument("--prompt-min", type=int, default=64)
    g.add_argument("--prompt-max", type=int, default=1024)
    g.add_argument("--reply-tokens", type=int, default=1024)
    g.add_argument("--reply-temperature", type=float, default=1.0)
    g.add_argument("--reply-batch", type=int, default=32)
    g = ap.add_argument_group("drafters (DSpark and the DFlash ablation, same budget)")
    g.add_argument("--draft-seq-len", type=int, default=2048)
    g.add_argument("--draft-layers", type=int, default=5)
    g.add_argument("--tap-layers", help="comma-separated target layers (default: 5 evenly in [1, L-3])")
    g.add_argument("--block-size", type=int, default=7)
    g.add_argument("--anchors", type=int, default=512)
    g.add_argument("--markov-rank", type=int, default=256)
    g.add_argument("--draft-batch", type=int, default=8)
    g.add_argument("--draft-steps", type=int, default=3000)
    g.add_argument("--draft-lr", type=float, default=6e-4)
    g.add_argument("--skip-dflash", action="store_true")
    g = ap.add_argument_group("run")
    g.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--attn", default="dense", choices=["dense", "cudnn"],
                   help="target attention in training ('cudnn': fused, GPU + bf16 only)")
    g.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--loss-chunk", type=int, default=4096, help="target CE: tokens per vocabulary chunk")
    g.add_argument("--row-chunk", type=int, default=2048, help="drafter loss: block rows per vocabulary chunk")
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
    from jspec.train.data import corpus_manifest, gather_corpus, read_texts
    files = gather_corpus(args.corpus)
    if not files:
        raise SystemExit(f"no .py files under {args.corpus}")
    manifest = corpus_manifest(args.corpus, files)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    args.corpus_sha256 = manifest["sha256"]
    log(f"corpus: {manifest['file_count']} files, {manifest['total_bytes']:,} bytes, sha256 {manifest['sha256'][:16]}")
    return read_texts(files)


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


def stage_target(args, out: Path, target_cfg, docs, tok_dir, eos_ids):
    """Pre-train S (resuming from checkpoints) and export it; returns (model, held-out loss)."""
    from jspec.loading import load_model
    from jspec.qwen3 import init_random
    from jspec.train import OptimConfig
    from jspec.train.checkpointing import CheckpointManager, LossLog, export_target, fit, resume
    from jspec.train.data import batch_source, pack_documents, split_documents
    from jspec.train.target import TargetTrainConfig, TargetTrainer

    train_docs, held_docs = split_documents(docs, args.heldout_fraction, args.seed)
    export = out / "target"
    if (export / "config.json").is_file():
        log(f"target: {export} exists, skipping pre-training")
        return load_model(export)[1], None, train_docs, held_docs
    rows = pack_documents(train_docs, args.seq_len, args.sep_id)
    held = pack_documents(held_docs, args.seq_len, args.sep_id)[:args.eval_rows]
    log(f"target: {len(rows)} rows x {args.seq_len} tokens for training, {len(held)} held out")
    eval_batch = min(args.batch, len(held))
    trainer = TargetTrainer(
        init_random(target_cfg, seed=args.seed),
        OptimConfig(args.target_steps, lr=args.target_lr, weight_decay=0.1, b2=0.95),
        TargetTrainConfig(compute_dtype=args.compute_dtype, attn_impl=args.attn, remat=args.remat,
                          loss_chunk=args.loss_chunk), seed=args.seed)
    manager = CheckpointManager(out / "ckpt" / "target")
    run_id = {"corpus_sha256": args.corpus_sha256, "tokens": int(rows.size)}
    if resume(trainer, manager, expect=run_id) is not None:
        log(f"target: resumed at step {trainer.state.step}")
    loss_log = LossLog(out / "logs" / "target.jsonl", resume_step=trainer.state.step or None)
    evaluate = (lambda: trainer.eval_loss(held, eval_batch)) if eval_batch else None
    t0 = time.time()
    fit(trainer, batch_source({"tokens": rows}, args.batch, args.seed), args.target_steps,
        manager=manager, ckpt_every=args.ckpt_every, log=loss_log, eval_fn=evaluate,
        eval_every=args.eval_every, log_every=args.log_every, progress=not args.quiet, desc="target",
        ckpt_extra=run_id)
    held_loss = evaluate() if evaluate else None
    if held_loss and args.target_steps % args.eval_every:
        loss_log.write({"step": trainer.state.step, **{f"eval_{k}": v for k, v in held_loss.items()}})
    loss_log.close()
    log(f"target: {time.time() - t0:.0f} s, held-out {held_loss}")
    export_target(trainer.model(), export, dtype=args.export_dtype, eos_ids=eos_ids, tokenizer_dir=tok_dir)
    log(f"target: exported to {export}")
    return load_model(export)[1], held_loss, train_docs, held_docs


def stage_prompts(args, out: Path, train_docs, held_docs):
    """Training prompts (windows of training documents) and held-out prompts (windows of
    held-out documents, or training ones when those are too short), written once."""
    from jspec.train.data import make_prompts
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    sets = {}
    for name, docs, n in (("prompts", train_docs, args.prompts), ("prompts_eval", held_docs, args.eval_prompts)):
        path = data / f"{name}.jsonl"
        if path.is_file():
            sets[name] = [json.loads(line)["prompt_ids"] for line in path.read_text().splitlines() if line]
            continue
        try:
            prompts = make_prompts(docs, n, args.prompt_min, args.prompt_max, args.seed + len(name))
        except ValueError:
            prompts = make_prompts(train_docs, n, args.prompt_min, args.prompt_max, args.seed + len(name))
        path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
        sets[name] = prompts
    return sets["prompts"], sets["prompts_eval"]


def stage_replies(args, out: Path, model, prompts, eos_ids):
    from jspec.train.data import read_replies, write_replies
    from jspec.train.drafter import sample_replies
    sets = {}
    for name, prompt_set, temperature, given in (
            ("replies", prompts[0], args.reply_temperature, args.replies),
            ("replies_eval", prompts[1], 0.0, args.eval_replies)):
        path = out / "data" / f"{name}.jsonl"
        if given:
            sets[name] = read_replies(given)
        elif path.is_file():
            sets[name] = read_replies(path)
        else:  # a plain loop without a KV cache: fine at toy size, slow at 4k context
            t0 = time.time()
            replies = sample_replies(model, prompt_set, args.reply_tokens, temperature=temperature,
                                     seed=args.seed, eos_ids=eos_ids, batch_size=args.reply_batch,
                                     progress=not args.quiet)
            write_replies(path, prompt_set, replies)
            log(f"{name}: {len(prompt_set)} replies, {sum(map(len, replies)):,} tokens, "
                f"T = {temperature}, {time.time() - t0:.0f} s")
            sets[name] = (prompt_set, replies)
    return sets["replies"], sets["replies_eval"]


def stage_drafter(args, out: Path, name: str, model, dcfg, loss_cfg, train, held):
    from jspec.dspark import init_random_drafter
    from jspec.train import OptimConfig
    from jspec.train.checkpointing import CheckpointManager, LossLog, export_drafter, fit, resume
    from jspec.train.data import batch_source
    from jspec.train.drafter import DrafterTrainConfig, DrafterTrainer

    export = out / name
    if (export / "config.json").is_file():
        log(f"{name}: {export} exists, skipping")
        return None
    trainer = DrafterTrainer(
        model, init_random_drafter(dcfg, seed=args.seed + 1), OptimConfig(args.draft_steps, lr=args.draft_lr),
        DrafterTrainConfig(num_anchors=args.anchors, loss=loss_cfg, compute_dtype=args.compute_dtype,
                           target_attn_impl=args.attn, remat=args.remat, row_chunk=args.row_chunk),
        seed=args.seed)
    eval_batch = min(args.draft_batch, len(held["tokens"]))
    evaluate = lambda: trainer.evaluate(held, eval_batch)
    before = evaluate()
    manager = CheckpointManager(out / "ckpt" / name)
    run_id = {"corpus_sha256": args.corpus_sha256, "reply_tokens": int(train["loss_mask"].sum())}
    if resume(trainer, manager, expect=run_id) is not None:
        log(f"{name}: resumed at step {trainer.state.step}")
    loss_log = LossLog(out / "logs" / f"{name}.jsonl", resume_step=trainer.state.step or None)
    t0 = time.time()
    fit(trainer, batch_source(train, args.draft_batch, args.seed), args.draft_steps, manager=manager,
        ckpt_every=args.ckpt_every, log=loss_log, eval_fn=evaluate, eval_every=args.eval_every,
        log_every=args.log_every, progress=not args.quiet, desc=name, ckpt_extra=run_id)
    after = evaluate()
    if args.draft_steps % args.eval_every:
        loss_log.write({"step": trainer.state.step, **{f"eval_{k}": v for k, v in after.items()}})
    loss_log.close()
    log(f"{name}: {time.time() - t0:.0f} s; held-out tau_greedy {before['tau_greedy']:.2f} -> "
        f"{after['tau_greedy']:.2f}, tau_prob {before['tau_prob']:.2f} -> {after['tau_prob']:.2f}, "
        f"L1 {before['l1']:.3f} -> {after['l1']:.3f}")
    export_drafter(trainer.drafter(), model, export, dtype=args.export_dtype)
    log(f"{name}: exported to {export}")
    return {"untrained": before, "trained": after}


def main(argv=None):
    args = parse_args(argv)
    from jspec.config import Qwen3Config
    from jspec.train.data import reply_arrays, tokenize_documents
    from jspec.train.drafter import DFLASH_LOSS, DSPARK_LOSS, drafter_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = stage_corpus(args, out)
    tok, tok_dir, vocab, args.sep_id, mask_id = stage_tokenizer(args, out, texts)
    t0 = time.time()
    docs = tokenize_documents(texts, tok)
    log(f"tokenized: {len(docs)} documents, {sum(map(len, docs)):,} tokens, {time.time() - t0:.0f} s")
    eos_ids = list(tok.eos_ids) if args.tokenizer == "qwen3" else [args.sep_id]
    target_cfg = Qwen3Config(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                             num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                             head_dim=args.head_dim, max_position_embeddings=max(40960, args.seq_len),
                             tie_word_embeddings=False, dtype="float32")
    model, held_loss, train_docs, held_docs = stage_target(args, out, target_cfg, docs, tok_dir, eos_ids)

    prompts = stage_prompts(args, out, train_docs, held_docs)
    if args.only_target:
        log(f"--only-target: S is in {out / 'target'}; prompts in {out / 'data'}")
        return
    train_pr, eval_pr = stage_replies(args, out, model, prompts, [args.sep_id] + eos_ids)
    train = reply_arrays(*train_pr, args.draft_seq_len, pad_id=args.sep_id)
    held = reply_arrays(*eval_pr, args.draft_seq_len, pad_id=args.sep_id)
    log(f"drafter data: {len(train['tokens'])} training sequences, {int(train['loss_mask'].sum()):,} reply tokens")

    taps = tuple(int(i) for i in args.tap_layers.split(",")) if args.tap_layers else None
    summary = {"target": {"config": target_cfg.to_hf_dict(), "heldout": held_loss}}
    for name, dflash, loss in (("dspark", False, DSPARK_LOSS), ("dflash", True, DFLASH_LOSS)):
        if dflash and args.skip_dflash:
            continue
        dcfg = drafter_config(target_cfg, draft_layers=args.draft_layers, mask_token_id=mask_id,
                              block_size=args.block_size, tap_layers=taps,
                              markov_rank=args.markov_rank, dflash=dflash)
        summary[name] = {"config": dcfg.to_hf_dict(),
                         "metrics": stage_drafter(args, out, name, model, dcfg, loss, train, held)}
    summary["args"] = vars(args)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    log(f"done: {out}")


if __name__ == "__main__":
    main()
