"""Resumable training: checkpoints, the JSONL loss log, the training loop, and export.

Checkpoint: <dir>/step_XXXXXXXX/ holding state.safetensors (fp32 masters "params/<path>",
optimizer leaves "opt/<path>", the base RNG key "rng") and meta.json (step, data position,
caller's extras). Written to a temporary directory and renamed into place, so a directory named
step_* is always complete; an interrupted run resumes from the newest one and loses at most one
checkpoint interval. Batches and step keys are pure functions of (seed, position / step), so a
resumed run computes exactly what the uninterrupted run would have.

Export: a trained target as a Hugging Face directory (config.json + model.safetensors in Qwen3's
key layout), a trained drafter in DeepSpec's layout; jspec.loading reads both back.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from jspec.atomic import atomic_dir
from jspec.train import TrainState, make_schedule, time_boxed_factor

STATE_FILE, META_FILE, PREFIX = "state.safetensors", "meta.json", "step_"


def _named_leaves(tree, prefix: str) -> dict[str, object]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {prefix + jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _fsync_dir_files(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


class CheckpointManager:
    def __init__(self, directory: str | Path, keep: int = 2):
        self.dir = Path(directory)
        self.keep = keep

    def steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(p.name[len(PREFIX):]) for p in self.dir.iterdir()
                      if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, state: TrainState, extra: dict | None = None) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"{PREFIX}{state.step:08d}"
        tmp = self.dir / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tensors = {**_named_leaves(state.params, "params/"), **_named_leaves(state.opt_state, "opt/"),
                   "rng": state.rng}
        save_file({k: np.ascontiguousarray(jax.device_get(v)) for k, v in tensors.items()},
                  tmp / STATE_FILE)
        meta = {"format": 1, "step": state.step, "data_position": state.data_position,
                "extra": extra or {}}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        _fsync_dir_files(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        for step in self.steps()[:-self.keep] if self.keep else []:
            shutil.rmtree(self.dir / f"{PREFIX}{step:08d}", ignore_errors=True)
        return final

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict] | None:
        """The saved state with `template`'s tree structure (None when there is no checkpoint)."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        path = self.dir / f"{PREFIX}{step:08d}"
        meta = json.loads((path / META_FILE).read_text())
        saved = load_file(path / STATE_FILE)

        def fill(tree, prefix):
            flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
            leaves = []
            for p, leaf in flat:
                name = prefix + jax.tree_util.keystr(p)
                if name not in saved:
                    raise ValueError(f"{path}: checkpoint lacks {name!r}: it is not of this model / optimizer")
                value = saved[name]
                if tuple(leaf.shape) == () and value.shape == (1,):  # safetensors stores scalars as [1]
                    value = value.reshape(())
                if value.shape != tuple(leaf.shape) or value.dtype != np.dtype(leaf.dtype):
                    raise ValueError(f"{path}: {name!r} is {value.dtype}{list(value.shape)}, expected "
                                     f"{np.dtype(leaf.dtype)}{list(leaf.shape)}")
                leaves.append(jax.device_put(value, jax.devices()[0]))  # committed, as step outputs
            return jax.tree_util.tree_unflatten(treedef, leaves)

        state = TrainState(params=fill(template.params, "params/"),
                           opt_state=fill(template.opt_state, "opt/"), step=meta["step"],
                           data_position=meta["data_position"], rng=jax.device_put(saved["rng"], jax.devices()[0]))
        return state, meta["extra"]


class LossLog:
    """Append-only JSONL of {"step": ..., ...} records. Opened for a resume at step s, records
    past s (written after the checkpoint by the interrupted run) are dropped first."""

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # a fresh start (resume_step None) starts a fresh log
            lines = self.path.read_text().splitlines() if resume_step is not None else []
            keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        self._f = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def resume(trainer, manager: CheckpointManager | None, expect: dict | None = None) -> dict | None:
    """Load the newest checkpoint into trainer.state; returns its extras (None: fresh start).
    Every key of `expect` must match the checkpoint's extras (e.g. the corpus hash: resuming on
    other data would not continue the same run)."""
    if manager is None:
        return None
    restored = manager.restore(trainer.state)
    if restored is None:
        return None
    state, extra = restored
    for key, value in (expect or {}).items():
        if extra.get(key) != value:
            raise ValueError(f"{manager.dir}: checkpoint has {key} = {extra.get(key)!r}, this run "
                             f"{value!r}: not the same run (use another output directory)")
    place = getattr(trainer, "place_state", None)  # e.g. replicated over a data-parallel mesh
    trainer.state = place(state) if place else state
    return extra


def fit(trainer, batch_at: Callable[[int], dict], num_steps: int, *,
        manager: CheckpointManager | None = None, ckpt_every: int = 0, log: LossLog | None = None,
        eval_fn: Callable[[], dict] | None = None, eval_every: int = 0, log_every: int = 1,
        progress: bool = True, desc: str = "train", stop_after: int | None = None,
        ckpt_extra: dict | None = None, deadline: float | None = None,
        clock: Callable[[], float] = time.time) -> list[dict]:
    """Run trainer.train_step until trainer.state.step == num_steps (from wherever the state is:
    fresh or resumed). Metrics are fetched every `log_every` steps (fewer host syncs); a
    checkpoint (with `ckpt_extra` in its meta) every `ckpt_every` steps and at the end.
    `stop_after` simulates an interruption; at `deadline` (a time.time() value) training stops
    early with a checkpoint (a time-boxed run on a lent GPU). With a time-boxed OptimConfig the
    learning rate follows the time gone between now and `deadline` (time_boxed_factor), so the
    schedule ends there (`clock`: the time.time it reads). Returns the records written."""
    from tqdm.auto import tqdm

    state = trainer.state
    schedule = make_schedule(trainer.optim_cfg)
    time_boxed = trainer.optim_cfg.time_boxed
    if time_boxed and deadline is None:
        raise ValueError("a time-boxed learning-rate schedule needs a deadline")
    if time_boxed and "lr_factor" not in inspect.signature(trainer.train_step).parameters:
        raise ValueError(f"{type(trainer).__name__}.train_step takes no lr_factor: a time-boxed "
                         "schedule is for the drafter trainer")
    start = None  # a time-boxed schedule's clock starts once the first step (compiled) is done
    factors: dict[int, float] = {}
    records, pending = [], []
    bar = tqdm(total=num_steps, initial=state.step, desc=desc, unit="step", disable=not progress)

    def flush():
        for step, metrics in pending:
            rec = {"step": step, "lr": float(schedule(step - 1)) * factors.pop(step, 1.0),
                   **{k: float(v) for k, v in jax.device_get(metrics).items()}}
            records.append(rec)
            if log:
                log.write(rec)
        if pending:
            bar.set_postfix(loss=f"{records[-1]['loss']:.4f}", refresh=False)
        pending.clear()

    while trainer.state.step < num_steps:
        if stop_after is not None and trainer.state.step >= stop_after:
            break
        if deadline is not None and clock() >= deadline:
            flush()
            if manager:
                manager.save(trainer.state, ckpt_extra)
            bar.write(f"{desc}: time budget reached at step {trainer.state.step} of {num_steps}")
            break
        number = trainer.state.step + 1
        batch = batch_at(trainer.state.data_position)
        if time_boxed:
            gone = 0.0 if start is None else (clock() - start) / max(deadline - start, 1e-9)
            factors[number] = time_boxed_factor(trainer.optim_cfg, gone)
            metrics = trainer.train_step(batch, lr_factor=factors[number])
            if start is None:
                jax.block_until_ready(metrics)
                start = clock()
        else:
            metrics = trainer.train_step(batch)
        pending.append((number, metrics))
        step = trainer.state.step
        bar.update(1)
        if step % log_every == 0:
            flush()
        if eval_fn and eval_every and step % eval_every == 0:
            flush()
            rec = {"step": step, **{f"eval_{k}": v for k, v in eval_fn().items()}}
            records.append(rec)
            if log:
                log.write(rec)
        if manager and ckpt_every and (step % ckpt_every == 0 or step == num_steps):
            flush()
            manager.save(trainer.state, ckpt_extra)
    flush()
    bar.close()
    return records


# ---- export -------------------------------------------------------------------------------------

def _tensor(params: dict, path: tuple, shape: tuple, dtype) -> np.ndarray:
    value = params
    for p in path:
        value = value[p]
    return np.ascontiguousarray(np.asarray(jax.device_get(value.astype(dtype))).reshape(shape))


def _write_dir(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Write into a temporary sibling, then rename into place (replacing an old export)."""
    with atomic_dir(out_dir) as tmp:
        write(tmp)
        _fsync_dir_files(tmp)
    return Path(out_dir)


def export_target(model: nnx.Module, out_dir: str | Path, *, dtype: str = "bfloat16",
                  eos_ids: Sequence[int] | None = None, tokenizer_dir: str | Path | None = None) -> Path:
    """A Hugging Face Qwen3 directory: config.json, model.safetensors (Qwen3 key layout),
    generation_config.json (when eos_ids), and tokenizer files copied from tokenizer_dir."""
    from jspec.qwen3 import checkpoint_shapes
    cfg = model.cfg.replace(dtype=dtype)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def write(d: Path):
        tensors = {k: _tensor(params, path, shape, dtype) for k, (shape, path) in checkpoint_shapes(cfg).items()}
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
        if eos_ids:
            (d / "generation_config.json").write_text(json.dumps({"eos_token_id": list(map(int, eos_ids))}))
        if tokenizer_dir is not None:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy(Path(tokenizer_dir) / name, d / name)

    return _write_dir(Path(out_dir), write)


def export_drafter(drafter: nnx.Module, target: nnx.Module | None, out_dir: str | Path, *,
                   dtype: str = "bfloat16") -> Path:
    """DeepSpec's layout: config.json (Qwen3DSparkModel) + model.safetensors with keys without a
    "model." prefix; with `target`, the copies of its embedding and lm_head that DeepSpec's
    checkpoints carry (jspec.loading checks them against the target and never keeps them)."""
    from jspec.dspark import drafter_checkpoint_shapes
    dcfg = dataclasses.replace(drafter.cfg, layers=drafter.cfg.layers.replace(dtype=dtype))
    params = nnx.to_pure_dict(nnx.state(drafter, nnx.Param))

    def write(d: Path):
        tensors = {k: _tensor(params, path, shape, dtype)
                   for k, (shape, path) in drafter_checkpoint_shapes(dcfg).items()}
        if target is not None:
            tensors["embed_tokens.weight"] = np.asarray(jax.device_get(target.embed_tokens[...].astype(dtype)))
            tensors["lm_head.weight"] = np.asarray(jax.device_get(target.head_weight().astype(dtype)))
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(dcfg.to_hf_dict(), indent=2))

    return _write_dir(Path(out_dir), write)
