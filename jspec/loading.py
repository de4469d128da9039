"""Load a Qwen3 model from a Hugging Face directory or a jspec (Orbax) directory.

Hugging Face: headers are checked first (every expected tensor present, nothing extra, every
shape right) before any weight is read; then tensors stream one at a time from disk to the
device, so the host never holds more than one tensor. jspec directories restore straight onto
the device through Orbax.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import ConfigError, Qwen3Config
from jspec.convert.safetensors_reader import CheckpointError, index_checkpoint, read_tensor
from jspec.qwen3 import Qwen3, abstract_model, checkpoint_shapes

JSPEC_MARKER = "jspec.json"  # present in directories written by `jspec convert`
ORBAX_SUBDIR = "weights"


def is_jspec_dir(model_dir: str | Path) -> bool:
    return (Path(model_dir) / JSPEC_MARKER).is_file()


def check_model_dir(model_dir: str | Path) -> Path:
    """The directory itself; a stand-in name (`standin`, `standin-dspark`, ...) is built once
    into the cache and its directory returned (jspec.standin)."""
    from jspec.standin import resolve
    path = resolve(model_dir)
    if not path.is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{str(model_dir)!r} is not a model directory (no config.json)")
    return path


def _progress(iterable, total, desc, enabled):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, total=total, desc=desc, unit="tensor")


def _set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _get_path(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def stream_safetensors(model_dir: str | Path, abstract_module: nnx.Module,
                       expected: dict[str, tuple[tuple[int, ...], tuple]], *,
                       optional: frozenset[str] = frozenset(), progress: bool = False,
                       device: jax.Device | None = None):
    """Fill `abstract_module` (ShapeDtypeStructs) from a safetensors checkpoint.

    `expected` maps checkpoint keys to (shape in the checkpoint, param path); every one must be
    present with that shape, and nothing else may be, except keys in `optional` (returned
    unread as TensorInfos for the caller to check). Headers are validated before any weight is
    read; then tensors stream one at a time from disk to the device."""
    model_dir = Path(model_dir)
    infos = index_checkpoint(model_dir)
    missing = sorted(set(expected) - set(infos))
    extra = sorted(set(infos) - set(expected) - optional)
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor(s) {_names(missing)}")
    if extra:
        raise CheckpointError(f"{model_dir}: unexpected tensor(s) {_names(extra)} "
                              "(not part of this config)")
    for name, (shape, _) in expected.items():
        if tuple(infos[name].shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(infos[name].shape)}, "
                                  f"expected {list(shape)} for this config")
    device = device or jax.devices()[0]
    graphdef, abstract_state = nnx.split(abstract_module)
    params = nnx.to_pure_dict(abstract_state)
    # File and offset order: sequential reads through each shard.
    order = sorted(expected, key=lambda n: (str(infos[n].file), infos[n].begin))
    for name in _progress(order, len(order), "loading", progress):
        path = expected[name][1]
        target = _get_path(params, path)
        host = read_tensor(infos[name]).reshape(target.shape)
        value = jax.device_put(host, device)
        del host  # one tensor on the host at a time
        if value.dtype != target.dtype:
            value = value.astype(target.dtype)
        _set_path(params, path, value)
    nnx.replace_by_pure_dict(abstract_state, params)
    return nnx.merge(graphdef, abstract_state), {k: infos[k] for k in optional if k in infos}


def check_copy(info, reference: jax.Array, what: str) -> None:
    """A checkpoint's copy of a shared array must equal the array it copies."""
    if tuple(info.shape) != tuple(reference.shape):
        raise CheckpointError(f"tensor {info.name!r} has shape {list(info.shape)} but {what} "
                              f"has {list(reference.shape)}")
    copy = jax.device_put(read_tensor(info), reference.device).astype(reference.dtype)
    if not bool(jnp.array_equal(copy, reference)):
        raise CheckpointError(f"tensor {info.name!r} differs from {what}")


def load_hf_weights(model_dir: str | Path, cfg: Qwen3Config, *, progress: bool = False,
                    device: jax.Device | None = None) -> Qwen3:
    """Stream a Qwen3 safetensors checkpoint into a module on `device` (default: the first)."""
    # A tied checkpoint may still carry lm_head.weight; it must then equal the embedding.
    optional = frozenset({"lm_head.weight"} if cfg.tie_word_embeddings else ())
    model, extras = stream_safetensors(model_dir, abstract_model(cfg), checkpoint_shapes(cfg),
                                       optional=optional, progress=progress, device=device)
    if "lm_head.weight" in extras:
        check_copy(extras["lm_head.weight"], model.embed_tokens[...],
                   "'model.embed_tokens.weight' (tied config)")
    return model


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---- Orbax (jspec directories) ----------------------------------------------------------------

def save_orbax(model: nnx.Module, path: Path) -> None:
    import orbax.checkpoint as ocp

    from jspec.qwen3 import unfuse_projections
    unfuse_projections(model)  # checkpoints hold the checkpoint layout, never the serving one
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(Path(path).absolute(), params)
    checkpointer.wait_until_finished()


def load_orbax(path: Path, cfg, device: jax.Device | None = None, abstract: nnx.Module | None = None):
    import orbax.checkpoint as ocp
    device = device or jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    graphdef, abstract_state = nnx.split(abstract if abstract is not None else abstract_model(cfg))
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                          nnx.to_pure_dict(abstract_state))
    checkpointer = ocp.StandardCheckpointer()
    try:
        params = checkpointer.restore(Path(path).absolute(), target)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: the Orbax checkpoint does not match config.json: {e}") from None
    nnx.replace_by_pure_dict(abstract_state, params)
    return nnx.merge(graphdef, abstract_state)


# ---- One entry point --------------------------------------------------------------------------

def load_model(model_dir: str | Path, *, dtype: str | None = None, progress: bool = False
               ) -> tuple[Qwen3Config, Qwen3]:
    """Load a Qwen3 target from a Hugging Face or jspec directory onto the default device."""
    path = check_model_dir(model_dir)
    if is_drafter_dir(path):
        raise ConfigError(f"{path} is a DSpark/DFlash drafter, not a target model (pass it as the draft)")
    if is_jspec_dir(path):
        stored = json.loads((path / JSPEC_MARKER).read_text())["dtype"]
        if dtype and dtype != stored:
            raise ConfigError(f"{path} was converted to {stored}; dtype {dtype!r} needs a "
                              "conversion from the original weights")
        cfg = Qwen3Config.from_dir(path, dtype=stored)
        return cfg, load_orbax(path / ORBAX_SUBDIR, cfg)
    cfg = Qwen3Config.from_dir(path, dtype=dtype)
    return cfg, load_hf_weights(path, cfg, progress=progress)



# ---- Drafters ---------------------------------------------------------------------------------

def is_drafter_dir(model_dir: str | Path) -> bool:
    path = Path(model_dir) / "config.json"
    return path.is_file() and "target_layer_ids" in json.loads(path.read_text())


def row_fingerprint(array) -> str:
    """sha256 of 17 evenly spaced rows of a [V, D] matrix: a cheap exact identity check that a
    drafter's stored copy of the embedding / lm_head is the target's."""
    import hashlib

    import numpy as np
    rows = np.linspace(0, array.shape[0] - 1, 17).astype(int)
    sample = np.asarray(jax.device_get(array[rows]), np.float32)  # bf16 -> fp32 is exact
    return hashlib.sha256(sample.tobytes()).hexdigest()


def _target_shared(target: Qwen3) -> dict[str, jax.Array]:
    return {"embed_tokens.weight": target.embed_tokens[...], "lm_head.weight": target.head_weight()}


def load_drafter(draft_dir: str | Path, target_cfg: Qwen3Config, target: Qwen3 | None, *,
                 progress: bool = False):
    """A DSpark/DFlash drafter for `target`: refused with a named mismatch if it does not fit.
    Copies of the embedding / lm_head in the checkpoint are checked once against the target's
    arrays (when `target` is given) and never kept."""
    from jspec.dspark import (DSparkConfig, SHARED_WITH_TARGET, abstract_drafter,
                              drafter_checkpoint_shapes)
    path = check_model_dir(draft_dir)
    if not is_drafter_dir(path):
        raise ConfigError(f"{path} is not a DSpark/DFlash drafter (config.json has no target_layer_ids)")
    cfg = DSparkConfig.from_dir(path, dtype=target_cfg.dtype)
    cfg.check_fits(target_cfg)
    if is_jspec_dir(path):
        marker = json.loads((path / JSPEC_MARKER).read_text())
        if target is not None:
            for key, array in _target_shared(target).items():
                stored = marker.get("shared_fingerprints", {}).get(key)
                if stored and stored != row_fingerprint(array):
                    raise CheckpointError(f"the drafter's {key!r} (fingerprint at conversion) "
                                          "differs from the target's")
        return cfg, load_orbax(path / ORBAX_SUBDIR, cfg, abstract=abstract_drafter(cfg))
    drafter, extras = stream_safetensors(path, abstract_drafter(cfg), drafter_checkpoint_shapes(cfg),
                                         optional=frozenset(SHARED_WITH_TARGET), progress=progress)
    if target is not None:
        shared = _target_shared(target)
        for key, info in extras.items():
            check_copy(info, shared[key], f"the target's {key!r}")
    return cfg, drafter


def drafter_shared_fingerprints(draft_dir: Path) -> dict[str, str]:
    """Fingerprints of the embedding / lm_head copies a drafter checkpoint carries."""
    from jspec.dspark import SHARED_WITH_TARGET
    infos = index_checkpoint(draft_dir)
    return {k: row_fingerprint(read_tensor(infos[k])) for k in SHARED_WITH_TARGET if k in infos}
