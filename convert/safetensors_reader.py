"""Stream tensors out of a Hugging Face safetensors checkpoint, one at a time.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte offsets) and the raw little-endian data. Reading it directly lets us pull a single tensor
into one host buffer (bf16 included, through ml_dtypes) without ever materialising a whole
file, so a 16 GB Qwen3-8B loads with a few GB of host memory.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint that does not match what the model expects."""


class TensorInfo:
    __slots__ = ("name", "file", "dtype", "shape", "begin", "end")

    def __init__(self, name, file, dtype, shape, begin, end):
        self.name, self.file, self.dtype, self.shape = name, file, dtype, tuple(shape)
        self.begin, self.end = begin, end


def read_header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > 100 * 2**20:
            raise CheckpointError(f"{path} is not a safetensors file (header of {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from None
    data_start = 8 + header_len
    infos = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} in {path.name} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        infos[name] = TensorInfo(name, path, meta["dtype"], meta["shape"], data_start + begin,
                                 data_start + end)
    return infos


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (sharded through an index, or not)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) named in the index are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} holds no *.safetensors weights")
    return files


def index_checkpoint(model_dir: str | Path) -> dict[str, TensorInfo]:
    """Every tensor's location, from the headers only (nothing is read)."""
    infos: dict[str, TensorInfo] = {}
    for path in checkpoint_files(Path(model_dir)):
        for name, info in read_header(path).items():
            if name in infos:
                raise CheckpointError(f"tensor {name!r} appears in both {infos[name].file.name} "
                                      f"and {path.name}")
            infos[name] = info
    return infos


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor into a fresh host buffer (read, not mmap: the page cache is not ours to hold)."""
    dtype = np.dtype(_DTYPES[info.dtype])
    count = int(np.prod(info.shape, dtype=np.int64))
    if info.end - info.begin != count * dtype.itemsize:
        raise CheckpointError(f"tensor {info.name!r} in {info.file.name}: byte range does not "
                              f"match shape {list(info.shape)} x {info.dtype}")
    out = np.empty(count, dtype)
    with open(info.file, "rb") as f:
        f.seek(info.begin)
        n = f.readinto(memoryview(out.view(np.uint8)))
    if n != out.nbytes:
        raise CheckpointError(f"tensor {info.name!r}: {info.file.name} is truncated")
    return out.reshape(info.shape)


def iter_tensors(infos: dict[str, TensorInfo]) -> Iterator[tuple[str, np.ndarray]]:
    # File order, then offset order: sequential reads.
    for info in sorted(infos.values(), key=lambda i: (str(i.file), i.begin)):
        yield info.name, read_tensor(info)
