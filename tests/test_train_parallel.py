"""Data-parallel target pre-training (TargetTrainer(mesh=...)) on two CPU devices equals the
single-device step on the same batches; a data-parallel run resumes from its checkpoint; the
short / long row interleaving is a pure function of the position."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jspec.train.data import batch_source, interleaved_source

ROOT = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jspec.config import Qwen3Config
    from jspec.qwen3 import init_random
    from jspec.train import OptimConfig, data_mesh
    from jspec.train.checkpointing import CheckpointManager, fit, resume
    from jspec.train.data import batch_source
    from jspec.train.target import TargetTrainConfig, TargetTrainer

    assert len(jax.devices()) == 2, jax.devices()
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=128, dtype="float32")
    rows = np.random.default_rng(0).integers(2, 60, size=(32, 24)).astype(np.int32)
    batch_at = batch_source({"tokens": rows}, 8, seed=0)
    make = lambda mesh: TargetTrainer(init_random(cfg, seed=0), OptimConfig(6, lr=3e-3, weight_decay=0.01),
                                      TargetTrainConfig(remat=True, loss_chunk=50), mesh=mesh)
    out = {}
    for name, mesh in (("one", None), ("two", data_mesh())):
        trainer = make(mesh)
        records = fit(trainer, batch_at, 6, progress=False)
        out[name + "_eval"] = trainer.eval_loss(rows[:8], 4)["loss"]
        out[name] = {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
                     "params": [np.asarray(x).ravel()[:64].tolist() for x in jax.tree.leaves(trainer.state.params)],
                     "devices": len(jax.tree.leaves(trainer.state.params)[0].sharding.device_set)}
    # interrupted after 4 steps, resumed onto the mesh: the same as the straight run
    trainer = make(data_mesh())
    manager = CheckpointManager(sys.argv[1])
    fit(trainer, batch_at, 6, manager=manager, ckpt_every=2, progress=False, stop_after=4)
    resumed = make(data_mesh())
    resume(resumed, manager)
    fit(resumed, batch_at, 6, progress=False)
    out["resumed"] = [np.asarray(x).ravel()[:64].tolist() for x in jax.tree.leaves(resumed.state.params)]
    out["resumed_devices"] = len(jax.tree.leaves(resumed.state.params)[0].sharding.device_set)
    try:
        trainer.train_step({"tokens": rows[:3]})
        out["odd"] = "no error"
    except ValueError as e:
        out["odd"] = str(e)
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path_factory.mktemp("ckpt"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_data_parallel_step_equals_single_device(parallel_run):
    one, two = parallel_run["one"], parallel_run["two"]
    assert one["devices"] == 1 and two["devices"] == 2  # the masters replicated over both devices
    np.testing.assert_allclose(parallel_run["two_eval"], parallel_run["one_eval"], rtol=1e-4)
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two["grad_norm"], one["grad_norm"], rtol=1e-4, atol=1e-6)
    for a, b in zip(two["params"], one["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # the run moved the params: equality is not two untouched initialisations
    assert one["loss"][-1] < one["loss"][0]


def test_data_parallel_resume_and_row_check(parallel_run):
    assert parallel_run["resumed_devices"] == 2
    for a, b in zip(parallel_run["resumed"], parallel_run["two"]["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert "3 rows does not divide over 2 devices" in parallel_run["odd"]


def test_interleaved_source_is_positional():
    short = np.arange(40 * 4).reshape(40, 4)
    long = np.arange(10 * 16).reshape(10, 16) + 1000
    short_at, long_at = batch_source({"tokens": short}, 4, seed=0), batch_source({"tokens": long}, 1, seed=0)
    at = interleaved_source(short_at, long_at, 3)
    shapes = [at(p)["tokens"].shape for p in range(9)]
    assert shapes == [(4, 4), (4, 4), (1, 16)] * 3
    # short batches are consumed in order without gaps, long ones likewise
    assert np.array_equal(at(3)["tokens"], short_at(2)["tokens"])
    assert np.array_equal(at(5)["tokens"], long_at(1)["tokens"])
    assert np.array_equal(at(7)["tokens"], at(7)["tokens"])
    every_one = interleaved_source(short_at, long_at, 1)
    assert np.array_equal(every_one(4)["tokens"], long_at(4)["tokens"])
    with pytest.raises(ValueError, match="long_every"):
        interleaved_source(short_at, long_at, 0)
