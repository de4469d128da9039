"""The 8B stand-in graft: lift a small Qwen3 target S and its DSpark / DFlash drafters into the
exact Qwen3-8B / DSpark-8B shapes, computing S's next-token law (protocol.md section 6).

    python -m jspec.convert.graft --target SRC_S --draft SRC_D [--dflash SRC_F] --out DIR \
        [--shape qwen3-8b] [--dtype bfloat16] [--shard-mib 4000] [--no-drafter-copies]
        [--force] [--dry-run] [--check]

writes DIR/target (config.json, model-0000k-of-0000n.safetensors + index, generation_config.json
and S's tokenizer files), DIR/dspark and DIR/dflash (DeepSpec layout: config.json and
model.safetensors holding the drafter and the copies of the target's embedding and lm_head, as
DeepSpec saves them; --no-drafter-copies leaves them out). Tensors are generated one at a time
into one reused buffer and written straight into their shard, so the host holds one output tensor
(at most a 1.2 GB vocabulary table) and S's small files; trailing zero rows (o_proj / down_proj /
gate / up beyond S's corner, whole identity-layer outputs) are never made and stay file holes.
Everything goes to .DIR.partial-PID first and is renamed into place when complete. 8B pair with
DFlash: 24 GiB of files (about 13 GiB on disk), 16 GiB of them the target; ~3 GB peak host RAM.

How the graft works (d_s = S's hidden size, D = T's, with D / d_s = 4^n):
  residual   S's channels are T's first d_s; every matrix writing into the residual stream
             (embedding, o_proj, down_proj) is zero in rows >= d_s, so those channels stay zero.
  RMSNorm    hidden-size norms (input, post-attention, final; the drafter's hidden_norm and norm)
             hold S's weight x sqrt(d_s / D) = 2^-n (exact) and zero beyond d_s: the mean over D
             of a vector zero beyond d_s is the mean over d_s times d_s / D. q_norm / k_norm copied.
  heads      T q head h uses kv head h // g_T. S's kv head j is T's kv head j, and S's q head
             j * g_S + i (i < g_S) is T's q head j * g_T + i. The other T heads are copies of S
             heads (T q head j*g_T + i copies S q head (j mod Hkv_S)*g_S + i mod g_S) whose o_proj
             columns are zero: they cost what real heads cost, contribute nothing, and never
             normalise a zero vector (so eps = 0 is safe).
  MLP        S's gate / up / down in the top-left corner, zero elsewhere.
  depth      S's layers sit at increasing T positions such that S's tapped layers (the DSpark
             drafter's target_layer_ids) land on T's taps; within a gap S's layers are packed
             just before the tap they lead to (after the last tap: just after it). Every other T
             layer is an identity: a copy of the nearest preceding placed S layer (the first one
             before any) with o_proj and down_proj zero.
  drafter    fc's S blocks sit at the d_s-wide slices of each D-wide tap; S's draft layers take
             T's first draft layers, any further ones are identities; Markov W1 / W2 padded with
             zero columns to T's rank; the confidence weights go on the first d_s channels and
             the Markov part (gated Markov heads likewise); the rest is copied.
  exactness  bit-exact arithmetic identity when rms_norm_eps = 0. With eps > 0, T's hidden-size
             norms act as S's with eps x 4^n (q/k norms are over head_dim in both and match), a
             relative difference of order eps / mean(x^2), about 1e-6.

Vocabulary convention (keys of S's target config.json). T has V_T ids; S has `vocab_size` = V_S
rows. The map sigma: T id -> S row is
  1. sigma(t) = t for t < V_S;
  2. sigma(t) = `jspec_shared_row` for t >= V_S (required when V_S < V_T);
  3. `jspec_id_to_row` (optional, {"T id": S row}) overrides single ids, e.g. Qwen3's special
     tokens 151643.. placed on S rows near the top of its table;
  4. the mask: T's mask id (DSpark's 151669 for the 8B shape) maps to S's drafter mask row
     (its mask_token_id), as if listed in jspec_id_to_row;
  5. a T id t < V_S whose row t was given to another id by 3. or 4. (and that has no override
     itself) maps to the shared row.
Every S row must be reached by at least one T id, and every T row is populated: embedding,
lm_head, Markov W1 and W2 rows of T id t are S's rows sigma(t).

What "T's law equals S's" means with a shared row. Let n_j = |sigma^-1(j)| (n_r = m for the shared
row r, 1 for most rows). T's logits are S's row logits, z_T(t) = z_S(sigma(t)), so
    p_T(t) = exp z_S(sigma(t)) / sum_j n_j exp z_S(j) = P_S(sigma(t)) / n_sigma(t),
where P_S(j) = softmax_j(z_S(j) + log n_j) is S's law over its rows with row j counted n_j times
(the compact format: the shared row stands for m tokens). T samples an individual id; its law is
S's with each row's mass split evenly among the ids that share the row. S must be trained and
scored with log n_j added to its row logits (a constant per row) for this to be S's own law; with
a plain softmax over rows, the graft gives the shared row m times its weight. The same holds for
the drafters (q_T(t) = Q_S(sigma(t)) / n_sigma(t)), so p / q ratios, acceptance and tau are the
S pair's. `vocab_law` below returns sigma and n.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from jspec.atomic import atomic_dir
from jspec.config import ConfigError, Qwen3Config, PRESETS
from jspec.convert.safetensors_reader import CheckpointError, index_checkpoint, read_tensor
from jspec.draft_vocab import ranked_ids_from_rows, write_ranked_ids
from jspec.dspark import DSparkConfig, drafter_checkpoint_shapes
from jspec.qwen3 import checkpoint_shapes

SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
              "chat_template.jinja")
_ST_DTYPES = {"bfloat16": ("BF16", ml_dtypes.bfloat16), "float32": ("F32", np.float32),
              "float16": ("F16", np.float16)}


class GraftError(ValueError):
    """A graft request that cannot be placed in the requested shape."""


@dataclasses.dataclass(frozen=True)
class GraftShape:
    """The shape T is grafted into. rope_theta, rms_norm_eps and max_position_embeddings of `target`
    are ignored: T takes S's (it computes S's function)."""
    target: Qwen3Config
    taps: tuple[int, ...]
    draft_layers: int
    markov_rank: int
    mask_token_id: int


SHAPES: dict[str, GraftShape] = {
    # Qwen3-8B and deepseek-ai/dspark_qwen3_8b_block7.
    "qwen3-8b": GraftShape(PRESETS["qwen3-8b"], taps=(1, 9, 17, 25, 33), draft_layers=5,
                           markov_rank=256, mask_token_id=151669),
    # The same construction at a CPU-test size (hidden 1024 = 4 x 256, group 4 like 8B).
    "mid": GraftShape(Qwen3Config(vocab_size=2048, hidden_size=1024, intermediate_size=1024,
                                  num_layers=12, num_heads=8, num_kv_heads=2, head_dim=128),
                      taps=(1, 3, 5, 7, 9), draft_layers=3, markov_rank=64, mask_token_id=2000),
}


# ---- the maps: depth, heads, vocabulary -----------------------------------------------------------

def place_layers(n_src: int, src_taps, n_dst: int, dst_taps) -> list[int]:
    """T position of each S layer: increasing, S's taps on T's taps. Raises GraftError if impossible."""
    src_taps, dst_taps = list(src_taps), list(dst_taps)
    if len(src_taps) != len(dst_taps):
        raise GraftError(f"S's drafter taps {len(src_taps)} layers {src_taps} but the shape taps "
                         f"{len(dst_taps)} {dst_taps}: the counts must be equal")
    if any(not 0 <= t < n_src - 1 for t in src_taps) or sorted(set(src_taps)) != src_taps:
        raise GraftError(f"S's taps {src_taps} must be strictly increasing layers of S's "
                         f"{n_src} layers, excluding the last")
    if n_src > n_dst:
        raise GraftError(f"S has {n_src} layers, more than the shape's {n_dst}")
    pos = [0] * n_src
    prev_s, prev_t = -1, -1
    for k, (ts, tt) in enumerate(zip(src_taps, dst_taps)):
        if ts - prev_s > tt - prev_t:
            where = "before its first tap" if k == 0 else f"between its taps {prev_s} and {ts}"
            raise GraftError(
                f"cannot place S's layers on taps {dst_taps}: S has {ts - prev_s} layer(s) "
                f"{where} (up to layer {ts}) but T has only {tt - prev_t} position(s) up to its tap "
                f"{tt}; S's taps {src_taps} need gaps no wider than T's")
        for i in range(prev_s + 1, ts + 1):
            pos[i] = tt - (ts - i)  # packed just before the tap
        prev_s, prev_t = ts, tt
    tail_s, tail_t = n_src - 1 - prev_s, n_dst - 1 - prev_t
    if tail_s > tail_t:
        raise GraftError(f"cannot place S's layers: S has {tail_s} layer(s) after its last tap "
                         f"{prev_s}, T only {tail_t} after its last tap {prev_t}")
    for i in range(prev_s + 1, n_src):
        pos[i] = prev_t + (i - prev_s)
    return pos


def layer_sources(pos: list[int], n_dst: int) -> tuple[list[int], list[bool]]:
    """For each T layer: the S layer whose weights it holds, and whether it is live (else identity)."""
    src, live = [], []
    at = {p: i for i, p in enumerate(pos)}
    last = 0
    for p in range(n_dst):
        if p in at:
            last = at[p]
        src.append(last)
        live.append(p in at)
    return src, live


@dataclasses.dataclass(frozen=True)
class HeadMap:
    q_src: np.ndarray    # [Hq_T] S q head copied into each T q head
    kv_src: np.ndarray   # [Hkv_T] S kv head copied into each T kv head
    live_t: np.ndarray   # T q heads whose o_proj columns carry S's (one per S q head)
    live_s: np.ndarray   # the S q head of each of those


def head_map(s: Qwen3Config, t: Qwen3Config) -> HeadMap:
    if s.head_dim != t.head_dim:
        raise GraftError(f"S's head_dim {s.head_dim} differs from the shape's {t.head_dim}")
    if s.num_kv_heads > t.num_kv_heads:
        raise GraftError(f"S has {s.num_kv_heads} kv heads, more than the shape's {t.num_kv_heads}")
    if s.q_per_kv > t.q_per_kv:
        raise GraftError(f"S's GQA group ({s.q_per_kv} q heads per kv head) exceeds the shape's "
                         f"({t.q_per_kv})")
    gs, gt = s.q_per_kv, t.q_per_kv
    h = np.arange(t.num_heads)
    j, i = h // gt, h % gt
    q_src = (j % s.num_kv_heads) * gs + i % gs
    kv_src = np.arange(t.num_kv_heads) % s.num_kv_heads
    live = (j < s.num_kv_heads) & (i < gs)
    return HeadMap(q_src, kv_src, h[live], q_src[live])


def vocab_law(s_hf: dict, n_rows: int, v_dst: int, s_mask: int | None, t_mask: int | None
              ) -> tuple[np.ndarray, np.ndarray]:
    """sigma [V_T] (T id -> S row) and n [V_S] (ids per row), by the convention in the module doc."""
    if n_rows > v_dst:
        raise GraftError(f"S has {n_rows} vocabulary rows, more than the shape's {v_dst}")
    shared = s_hf.get("jspec_shared_row")
    if shared is not None and not 0 <= int(shared) < n_rows:
        raise GraftError(f"jspec_shared_row {shared} is not a row of S's {n_rows}")
    overrides = {int(k): int(v) for k, v in (s_hf.get("jspec_id_to_row") or {}).items()}
    if s_mask is not None and t_mask is not None and s_mask != t_mask:
        if overrides.get(t_mask, s_mask) != s_mask:
            raise GraftError(f"jspec_id_to_row maps the mask id {t_mask} to row "
                             f"{overrides[t_mask]}, but S's drafter mask row is {s_mask}")
        overrides[t_mask] = s_mask
    for t, r in overrides.items():
        if not 0 <= t < v_dst or not 0 <= r < n_rows:
            raise GraftError(f"jspec_id_to_row entry {t} -> {r} is outside T's {v_dst} ids or "
                             f"S's {n_rows} rows")
    taken = sorted({r for t, r in overrides.items() if t != r and r not in overrides})
    need_shared = n_rows < v_dst or taken
    if need_shared and shared is None:
        why = (f"S has {n_rows} rows for {v_dst} ids" if n_rows < v_dst else
               f"S's row(s) {taken[:5]} serve other ids (mask / jspec_id_to_row)")
        raise GraftError(f"{why}: S's config.json must name the row of the ids it does not "
                         "model (jspec_shared_row)")
    sigma = np.arange(v_dst, dtype=np.int64)
    if n_rows < v_dst:
        sigma[n_rows:] = int(shared)
    for r in taken:
        sigma[r] = int(shared)
    for t, r in overrides.items():
        sigma[t] = r
    n = np.bincount(sigma, minlength=n_rows)
    unused = np.flatnonzero(n == 0)
    if unused.size:
        raise GraftError(f"S's row(s) {unused[:8].tolist()} are reached by no T id (their ids "
                         "were given to other rows): S's law cannot be reproduced")
    return sigma, n


# ---- reading S --------------------------------------------------------------------------------

def _sources(*dirs):
    """Directories as given; the stand-in names (standin, standin-dspark, standin-dflash) give
    the dequantized compact directories (S's own rows), never the full-vocabulary ones."""
    from jspec.standin import source_dir
    return tuple(None if d is None else source_dir(d) for d in dirs)


def _read_all(model_dir: Path, expected: dict) -> dict[str, np.ndarray]:
    infos = index_checkpoint(model_dir)
    missing = sorted(set(expected) - set(infos))
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor(s) {missing[:8]}")
    out = {}
    for name, (shape, _) in expected.items():
        if tuple(infos[name].shape) != tuple(shape):
            raise CheckpointError(f"{model_dir}: tensor {name!r} has shape {list(infos[name].shape)}"
                                  f", expected {list(shape)}")
        out[name] = read_tensor(infos[name]).astype(np.float32)
    return out


@dataclasses.dataclass
class _Source:
    dir: Path
    cfg: Qwen3Config
    hf: dict
    tensors: dict[str, np.ndarray]


@dataclasses.dataclass
class _Drafter:
    dir: Path
    cfg: DSparkConfig
    tensors: dict[str, np.ndarray]


def _load_target(src: Path) -> _Source:
    if not (src / "config.json").is_file():
        raise ConfigError(f"{src} is not a model directory (no config.json)")
    hf = json.loads((src / "config.json").read_text())
    if "target_layer_ids" in hf:
        raise ConfigError(f"{src} is a drafter; --target wants S's target model")
    cfg = Qwen3Config.from_hf_dict(hf)
    return _Source(src, cfg, hf, _read_all(src, checkpoint_shapes(cfg)))


def _load_drafter(src: Path, target: Qwen3Config, what: str) -> _Drafter:
    if not (src / "config.json").is_file():
        raise ConfigError(f"{src} is not a drafter directory (no config.json)")
    cfg = DSparkConfig.from_dir(src, dtype="float32")
    try:
        cfg.check_fits(target)
    except ConfigError as e:
        raise ConfigError(f"{what} {src}: {e}") from None
    return _Drafter(src, cfg, _read_all(src, drafter_checkpoint_shapes(cfg)))


# ---- the plan -------------------------------------------------------------------------------------

Producer = Callable[[], np.ndarray]
"""Makes one output tensor in the output dtype. It may return only the leading rows (axis 0) of a
tensor whose remaining rows are zero: those are never materialised, and become file holes."""


def materialize(shape, make: Producer) -> np.ndarray:
    """The whole tensor a producer stands for (leading rows plus the zero rows it left out)."""
    part = make()
    if part.shape == tuple(shape):
        return part
    out = np.zeros(shape, part.dtype)
    out[:part.shape[0]] = part
    return out


@dataclasses.dataclass
class GraftPlan:
    shape_name: str
    target_cfg: Qwen3Config
    source_cfg: Qwen3Config
    positions: list[int]           # T position of each S layer
    layer_src: list[int]           # S layer held by each T layer
    layer_live: list[bool]
    heads: HeadMap
    sigma: np.ndarray
    multiplicity: np.ndarray
    dtype: str
    outputs: dict[str, tuple[dict, list[tuple[str, tuple, Producer]]]]  # subdir -> (config, tensors)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        lines = [f"graft {self.source_cfg.num_layers} x {self.source_cfg.hidden_size} -> "
                 f"{self.shape_name} ({self.target_cfg.num_layers} x {self.target_cfg.hidden_size}, "
                 f"{self.dtype})",
                 f"  S layer -> T position: {self.positions}",
                 f"  T q head <- S q head: {self.heads.q_src.tolist()} (live: "
                 f"{self.heads.live_t.tolist()})",
                 f"  vocabulary: {len(self.sigma)} ids onto {len(self.multiplicity)} rows, "
                 f"max ids per row {int(self.multiplicity.max())}"]
        itemsize = np.dtype(_ST_DTYPES[self.dtype][1]).itemsize
        for sub, (_, items) in self.outputs.items():
            nbytes = sum(math.prod(s) for _, s, _ in items) * itemsize
            lines.append(f"  {sub}: {len(items)} tensors, {nbytes / 2**30:.2f} GiB")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


class _Builder:
    """Produces T tensors (in the output dtype) from S tensors."""

    def __init__(self, s: Qwen3Config, t: Qwen3Config, heads: HeadMap, dtype):
        self.s, self.t, self.h, self.dtype = s, t, heads, dtype
        ratio = t.hidden_size // s.hidden_size
        n = round(math.log(ratio, 4)) if ratio >= 1 else -1
        if t.hidden_size % s.hidden_size or 4 ** n != ratio:
            raise GraftError(f"T's hidden size {t.hidden_size} must be S's {s.hidden_size} times a "
                             "power of 4 (so the RMSNorm rescale sqrt(d_s / D) is exact)")
        if s.intermediate_size > t.intermediate_size:
            raise GraftError(f"S's intermediate_size {s.intermediate_size} exceeds the shape's "
                             f"{t.intermediate_size}")
        self.scale = 2.0 ** -n
        # Tensors are assembled as raw unsigned integers of the output's width (numpy's own
        # copy loops; ml_dtypes' bf16 gathers are several times slower) and viewed back at the end.
        self.raw_dtype = {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
        self._raw: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def raw(self, w: np.ndarray) -> np.ndarray:
        """S's tensor (fp32) in the output dtype, as raw integers (cast once, cached)."""
        hit = self._raw.get(id(w))
        if hit is None or hit[0] is not w:
            hit = self._raw[id(w)] = (w, w.astype(self.dtype).view(self.raw_dtype))
        return hit[1]

    def zeros(self, shape):
        return _ARENA.zeros(shape, self.raw_dtype) if _ARENA else np.zeros(shape, self.raw_dtype)

    def done(self, out: np.ndarray) -> np.ndarray:
        return out.view(self.dtype)

    def vocab(self, table: np.ndarray, sigma: np.ndarray, width: int) -> Producer:
        def make():
            out, src, k = self.zeros((len(sigma), width)), self.raw(table), table.shape[1]
            for i in range(0, len(sigma), 8192):  # bounded gather temporaries
                out[i:i + 8192, :k] = src[sigma[i:i + 8192]]
            return self.done(out)
        return make

    def norm(self, w: np.ndarray) -> Producer:
        def make():
            out = np.zeros((self.t.hidden_size,), self.dtype)
            out[:w.shape[0]] = w * np.float32(self.scale)  # a power of two: exact
            return out
        return make

    def copy(self, w: np.ndarray) -> Producer:
        return lambda: w.astype(self.dtype)

    def layer(self, get: Callable[[str], np.ndarray], live: bool) -> dict[str, Producer]:
        """Suffix ("self_attn.q_proj.weight", ...) -> producer, from S layer tensors `get(suffix)`."""
        s, t, h = self.s, self.t, self.h
        d, D, hd = s.hidden_size, t.hidden_size, t.head_dim

        def heads_in(name, n_src, src):
            def make():
                w = self.raw(get(name)).reshape(n_src, hd, d)
                out = self.zeros((len(src), hd, D))
                out[:, :, :d] = w[src]
                return self.done(out.reshape(len(src) * hd, D))
            return make

        def o_proj():  # rows >= d (all rows of an identity layer) are zero: not made
            out = self.zeros((d if live else 0, t.num_heads, hd))
            if live:
                w = self.raw(get("self_attn.o_proj.weight")).reshape(d, s.num_heads, hd)
                out[:, h.live_t] = w[:, h.live_s]
            return self.done(out.reshape(-1, t.num_heads * hd))

        def mlp_in(name):
            def make():
                out = self.zeros((s.intermediate_size, D))
                out[:, :d] = self.raw(get(name))
                return self.done(out)
            return make

        def down():
            out = self.zeros((d if live else 0, t.intermediate_size))
            if live:
                out[:, :s.intermediate_size] = self.raw(get("mlp.down_proj.weight"))
            return self.done(out)

        return {
            "input_layernorm.weight": lambda: self.norm(get("input_layernorm.weight"))(),
            "post_attention_layernorm.weight":
                lambda: self.norm(get("post_attention_layernorm.weight"))(),
            "self_attn.q_proj.weight": heads_in("self_attn.q_proj.weight", s.num_heads, h.q_src),
            "self_attn.k_proj.weight": heads_in("self_attn.k_proj.weight", s.num_kv_heads, h.kv_src),
            "self_attn.v_proj.weight": heads_in("self_attn.v_proj.weight", s.num_kv_heads, h.kv_src),
            "self_attn.o_proj.weight": o_proj,
            "self_attn.q_norm.weight": lambda: get("self_attn.q_norm.weight").astype(self.dtype),
            "self_attn.k_norm.weight": lambda: get("self_attn.k_norm.weight").astype(self.dtype),
            "mlp.gate_proj.weight": mlp_in("mlp.gate_proj.weight"),
            "mlp.up_proj.weight": mlp_in("mlp.up_proj.weight"),
            "mlp.down_proj.weight": down,
        }


def _check(items, expected: dict, what: str):
    """The planned tensors are exactly the keys and shapes the loaders expect."""
    planned = {name: tuple(shape) for name, shape, _ in items}
    want = {k: tuple(v[0]) for k, v in expected.items()}
    if planned != want:
        raise AssertionError(f"{what}: planned tensors differ from the checkpoint layout")


def plan_graft(target: str | Path, draft: str | Path, dflash: str | Path | None = None, *,
               shape: str = "qwen3-8b", dtype: str = "bfloat16", drafter_copies: bool = True
               ) -> GraftPlan:
    """Read S (and its drafters), check the graft can be placed, and plan every output tensor.
    drafter_copies: the drafters carry copies of T's embedding and lm_head, as DeepSpec saves
    them (jspec's loader only checks them against the target's; leaving them out saves 2.3 GiB
    per 8B drafter)."""
    if shape not in SHAPES:
        raise GraftError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    if dtype not in _ST_DTYPES:
        raise GraftError(f"dtype {dtype!r} is not one of {', '.join(_ST_DTYPES)}")
    gs = SHAPES[shape]
    np_dtype = _ST_DTYPES[dtype][1]
    target, draft, dflash = _sources(target, draft, dflash)
    S = _load_target(Path(target))
    s = S.cfg
    drafters = {"dspark": _load_drafter(Path(draft), s, "--draft")}
    if dflash is not None:
        drafters["dflash"] = _load_drafter(Path(dflash), s, "--dflash")
    for name, dr in drafters.items():
        if name == "dspark" and dr.cfg.is_dflash:
            raise GraftError(f"--draft {dr.dir} has no Markov head (a DFlash drafter); pass it as "
                             "--dflash and give the DSpark drafter as --draft")
        if name == "dflash" and not dr.cfg.is_dflash:
            raise GraftError(f"--dflash {dr.dir} has a Markov head: it is a DSpark drafter")
    dspark = drafters["dspark"].cfg
    for name, dr in drafters.items():
        if dr.cfg.target_layer_ids != dspark.target_layer_ids:
            raise GraftError(f"the {name} drafter taps {list(dr.cfg.target_layer_ids)}, the DSpark "
                             f"drafter {list(dspark.target_layer_ids)}: one placement must serve both")
        if dr.cfg.mask_token_id != dspark.mask_token_id:
            raise GraftError(f"the {name} drafter's mask row {dr.cfg.mask_token_id} differs from "
                             f"the DSpark drafter's {dspark.mask_token_id}: T's mask id can map to one")
        if dr.cfg.layers.num_layers > gs.draft_layers:
            raise GraftError(f"the {name} drafter has {dr.cfg.layers.num_layers} layers, more than "
                             f"the shape's {gs.draft_layers}")
        if dr.cfg.markov_rank > gs.markov_rank:
            raise GraftError(f"the {name} drafter's Markov rank {dr.cfg.markov_rank} exceeds the "
                             f"shape's {gs.markov_rank}")
    if max(gs.taps) >= gs.target.num_layers - 1:
        raise GraftError(f"shape taps {gs.taps} must leave T's last layer untapped")

    t = gs.target.replace(rope_theta=s.rope_theta, rms_norm_eps=s.rms_norm_eps,
                          max_position_embeddings=s.max_position_embeddings, dtype=dtype,
                          tie_word_embeddings=False)
    positions = place_layers(s.num_layers, dspark.target_layer_ids, t.num_layers, gs.taps)
    layer_src, layer_live = layer_sources(positions, t.num_layers)
    heads = head_map(s, t)
    sigma, mult = vocab_law(S.hf, s.vocab_size, t.vocab_size, dspark.mask_token_id, gs.mask_token_id)
    b = _Builder(s, t, heads, np_dtype)

    St = S.tensors
    embed_s = St["model.embed_tokens.weight"]
    head_s = embed_s if s.tie_word_embeddings else St["lm_head.weight"]
    D = t.hidden_size
    embed = (t.vocab_size, D), b.vocab(embed_s, sigma, D)
    head = (t.vocab_size, D), b.vocab(head_s, sigma, D)

    items = [("model.embed_tokens.weight",) + embed]
    for p in range(t.num_layers):
        pre_s = f"model.layers.{layer_src[p]}."
        layer = b.layer(lambda n, pre_s=pre_s: St[pre_s + n], layer_live[p])
        items += [(f"model.layers.{p}.{k}", None, f) for k, f in layer.items()]
    items += [("model.norm.weight", (D,), b.norm(St["model.norm.weight"])), ("lm_head.weight",) + head]
    expected = checkpoint_shapes(t)
    items = [(n, sh or expected[n][0], f) for n, sh, f in items]
    _check(items, expected, "target")
    t_hf = t.to_hf_dict()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in S.hf:
            t_hf[key] = S.hf[key]
    t_hf["jspec_graft"] = {"source": S.dir.name, "shape": shape, "source_hidden": s.hidden_size,
                           "layer_positions": positions, "vocab_rows": s.vocab_size,
                           "mask_token_id": gs.mask_token_id, "source_mask_row": dspark.mask_token_id}
    outputs = {"target": (t_hf, items)}

    for name, dr in drafters.items():
        dc = dr.cfg
        r_t = gs.markov_rank if dc.markov_rank else 0
        tdc = DSparkConfig(layers=t.replace(num_layers=gs.draft_layers), block_size=dc.block_size,
                           mask_token_id=gs.mask_token_id, target_layer_ids=gs.taps,
                           markov_rank=r_t, markov_head_type=dc.markov_head_type,
                           confidence_head=dc.confidence_head,
                           confidence_with_markov=dc.confidence_with_markov)
        tdc.check_fits(t)
        d_items = _drafter_items(b, dr, tdc, sigma, embed, head)
        if not drafter_copies:
            d_items = [it for it in d_items if it[0] not in ("embed_tokens.weight", "lm_head.weight")]
        outputs[name] = (_drafter_hf(tdc, t, dr), d_items)
    return GraftPlan(shape, t, s, positions, layer_src, layer_live, heads, sigma, mult, dtype,
                     outputs, _eos_warnings(S, sigma, mult))


def _eos_warnings(S: _Source, sigma, mult) -> list[str]:
    """EOS ids that S does not model with a row of their own would stop T on a shared-row draw."""
    ids = []
    for hf in (S.hf, _json_or_empty(S.dir / "generation_config.json")):
        eos = hf.get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return [f"EOS id {t} shares S's row {sigma[t]} with {mult[sigma[t]] - 1} other id(s)"
            for t in sorted(set(ids)) if 0 <= t < len(sigma) and mult[sigma[t]] > 1]


def _json_or_empty(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _drafter_hf(tdc: DSparkConfig, t: Qwen3Config, dr: _Drafter) -> dict:
    hf = tdc.to_hf_dict()
    hf.update(num_target_layers=t.num_layers, layer_types=["full_attention"] * tdc.layers.num_layers,
              jspec_graft={"source": dr.dir.name, "source_target_layer_ids":
                           list(dr.cfg.target_layer_ids), "source_mask_token_id": dr.cfg.mask_token_id})
    return hf


def _drafter_items(b: _Builder, dr: _Drafter, tdc: DSparkConfig, sigma, embed, head):
    dc, Dt = dr.cfg, dr.tensors
    s, t = b.s, b.t
    d, D, n_taps = s.hidden_size, t.hidden_size, dc.num_taps
    r_s, r_t = dc.markov_rank, tdc.markov_rank

    def fc():
        w = b.raw(Dt["fc.weight"]).reshape(d, n_taps, d)
        out = b.zeros((d, n_taps, D))
        out[:, :, :d] = w
        return b.done(out.reshape(d, n_taps * D))

    def markov(name):
        def make():
            out, src = b.zeros((t.vocab_size, r_t)), b.raw(Dt[name])
            for i in range(0, len(sigma), 8192):
                out[i:i + 8192, :r_s] = src[sigma[i:i + 8192]]
            return b.done(out)
        return make

    def split_hidden_rank(name, rows_t, rows_s):
        """[rows, d + r_s] -> [rows_t, D + r_t]: hidden part on the first d, rank part at D."""
        def make():
            w = b.raw(Dt[name]).reshape(rows_s, -1)
            out = b.zeros((rows_s, D + (r_t if w.shape[1] > d else 0)))
            out[:, :d] = w[:, :d]
            out[:, D:D + w.shape[1] - d] = w[:, d:]
            return b.done(out)
        return make

    def gate_bias():
        out = b.zeros((r_t,))
        out[:r_s] = b.raw(Dt["markov_head.gate_proj.bias"])
        return b.done(out)

    items = [("embed_tokens.weight",) + embed, ("fc.weight", None, fc),
             ("hidden_norm.weight", None, b.norm(Dt["hidden_norm.weight"]))]
    n_src = dc.layers.num_layers
    for p in range(tdc.layers.num_layers):
        pre = f"layers.{min(p, n_src - 1)}."
        layer = b.layer(lambda n, pre=pre: Dt[pre + n], p < n_src)
        items += [(f"layers.{p}.{k}", None, f) for k, f in layer.items()]
    items.append(("norm.weight", None, b.norm(Dt["norm.weight"])))
    if r_t:
        items += [("markov_head.markov_w1.weight", None, markov("markov_head.markov_w1.weight")),
                  ("markov_head.markov_w2.weight", None, markov("markov_head.markov_w2.weight"))]
        if tdc.markov_head_type == "gated":
            items += [("markov_head.gate_proj.weight", None,
                       split_hidden_rank("markov_head.gate_proj.weight", r_t, r_s)),
                      ("markov_head.gate_proj.bias", None, gate_bias)]
    if tdc.confidence_head:
        items += [("confidence_head.proj.weight", None,
                   split_hidden_rank("confidence_head.proj.weight", 1, 1)),
                  ("confidence_head.proj.bias", None, b.copy(Dt["confidence_head.proj.bias"]))]
    items.append(("lm_head.weight",) + head)
    expected = dict(drafter_checkpoint_shapes(tdc))
    expected.update({"embed_tokens.weight": (embed[0], None), "lm_head.weight": (head[0], None)})
    items = [(n, sh or expected[n][0], f) for n, sh, f in items]
    _check(items, expected, "drafter")
    return items


# ---- writing --------------------------------------------------------------------------------------

class _Arena:
    """One zeroed buffer reused for every output tensor while writing. Fresh pages cost a fault
    and a kernel zeroing each, and 24 GiB of them dominated the 8B build; a memset does not."""

    def __init__(self):
        self.buf = np.zeros(0, np.uint8)

    def zeros(self, shape, dtype) -> np.ndarray:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        if self.buf.size < n:
            self.buf = np.zeros(n, np.uint8)
        else:
            self.buf[:n] = 0
        return self.buf[:n].view(dtype).reshape(shape)


_ARENA: _Arena | None = None  # set while writing: a made tensor lives until the next is made


def write_safetensors(path: Path, items, dtype: str, log=None) -> int:
    """One safetensors file: the header first (every shape is known), then each tensor as it is
    made, one at a time. Zero rows a producer left out are skipped over: they become file holes
    (read back as zeros), so a graft takes far less disk than its size."""
    st_name, np_dtype = _ST_DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    header, offset = {}, 0
    for name, shape, _ in items:
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": st_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, make in items:
            arr = np.ascontiguousarray(make())
            if (arr.shape[1:] != tuple(shape[1:]) or arr.shape[0] > shape[0] or arr.ndim != len(shape)
                    or arr.dtype != np.dtype(np_dtype)):
                raise AssertionError(f"{name}: made {arr.shape} {arr.dtype}, planned {shape} {dtype}")
            f.seek(start + header[name]["data_offsets"][0])
            f.write(arr.reshape(-1).view(np.uint8).data)
            del arr  # one output tensor on the host at a time
        f.truncate(start + offset)
    if log:
        log(f"  wrote {path.name} ({offset / 2**30:.2f} GiB)")
    return offset


def write_model(out_dir: Path, items, dtype: str, shard_bytes: int | None, log=None) -> None:
    """Shards of at most shard_bytes (HF names and index when more than one), else model.safetensors."""
    itemsize = np.dtype(_ST_DTYPES[dtype][1]).itemsize
    shards, current, size = [], [], 0
    for item in items:
        nbytes = math.prod(item[1]) * itemsize
        if shard_bytes and current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        write_safetensors(out_dir / "model.safetensors", shards[0], dtype, log)
        return
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out_dir / fname, shard, dtype, log)
        weight_map.update({name: fname for name, _, _ in shard})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def graft(target: str | Path, draft: str | Path, out: str | Path, dflash: str | Path | None = None,
          *, shape: str = "qwen3-8b", dtype: str = "bfloat16", shard_mib: int | None = 4000,
          drafter_copies: bool = True, force: bool = False, quiet: bool = False) -> GraftPlan:
    """Plan and write the graft into out/{target,dspark[,dflash]}; atomic (renamed when complete)."""
    log = None if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    plan = plan_graft(target, draft, dflash, shape=shape, dtype=dtype, drafter_copies=drafter_copies)
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    if log:
        log(plan.summary())
    t0 = time.time()
    global _ARENA
    _ARENA = _Arena()
    try:
        with atomic_dir(out) as tmp:
            for sub, (hf, items) in plan.outputs.items():
                d = tmp / sub
                d.mkdir(parents=True)
                write_model(d, items, dtype, shard_mib * 2**20 if sub == "target" and shard_mib else None,
                            log)
                (d / "config.json").write_text(json.dumps(hf, indent=2))
                if sub != "target" and plan.multiplicity.max() > 1:
                    # A compact S (a shared row): its own rows are ranked by corpus frequency,
                    # the draft vocabulary's ranking (jspec/draft_vocab.py), T's mask id aside.
                    mask = plan.outputs["target"][0]["jspec_graft"]["mask_token_id"]
                    write_ranked_ids(d, ranked_ids_from_rows(plan.sigma, plan.multiplicity,
                                                             exclude=[mask]))
            src, = _sources(target)
            for name in SIDE_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp / "target" / name)
    finally:
        _ARENA = None
    if log:
        log(f"graft written to {out} in {time.time() - t0:.1f} s")
    return plan


def check_graft(target: str | Path, out: str | Path, *, length: int = 64, seed: int = 0) -> dict:
    """Load S and the grafted target (S in T's dtype, on the default device) and compare them on
    `length` random tokens that S models with rows of their own: max |logit difference| relative
    to the largest logit, and the mean total-variation distance between T's law and S's law split
    over shared rows (module doc). A report, not a verdict: bf16 rounding shows up here."""
    import jax
    import jax.numpy as jnp

    from jspec.loading import load_model
    from jspec.qwen3 import forward_logits
    target, = _sources(target)
    t_cfg, t_model = load_model(Path(out) / "target")
    s_cfg, s_model = load_model(target, dtype=t_cfg.dtype)
    info = json.loads((Path(out) / "target" / "config.json").read_text())["jspec_graft"]
    s_hf = json.loads((Path(target) / "config.json").read_text())
    sigma, mult = vocab_law(s_hf, s_cfg.vocab_size, t_cfg.vocab_size, info["source_mask_row"],
                            info["mask_token_id"])
    own = np.flatnonzero(mult[sigma] == 1)
    ids = np.random.default_rng(seed).choice(own, (1, length))
    t_logits, _ = forward_logits(t_model, jnp.asarray(ids))
    s_logits, _ = forward_logits(s_model, jnp.asarray(sigma[ids]))
    t_logits = np.asarray(t_logits, np.float64)[0]
    s_logits = np.asarray(s_logits, np.float64)[0]
    want = s_logits[:, sigma]
    p_t = np.asarray(jax.nn.softmax(t_logits, -1))
    law = np.asarray(jax.nn.softmax(s_logits + np.log(mult), -1))[:, sigma] / mult[sigma]
    return {"positions": length, "dtype": t_cfg.dtype,
            "max_rel_logit_diff": float(np.abs(t_logits - want).max() / np.abs(want).max()),
            "mean_tv": float(0.5 * np.abs(p_t - law).sum(-1).mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jspec.convert.graft",
                                description="Graft a small Qwen3 target and its DSpark/DFlash "
                                "drafters into the Qwen3-8B / DSpark-8B shapes (same law).")
    p.add_argument("--target", required=True, help="S: small Qwen3 target directory (HF layout), "
                   "or standin (the shipped pair, in its compact form)")
    p.add_argument("--draft", required=True, help="S's DSpark drafter directory (DeepSpec layout), "
                   "or standin-dspark")
    p.add_argument("--dflash", help="S's DFlash drafter directory (optional), or standin-dflash")
    p.add_argument("--out", required=True, help="output directory: target/, dspark/, dflash/")
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_ST_DTYPES))
    p.add_argument("--shard-mib", type=int, default=4000, help="target shard size (0: one file)")
    p.add_argument("--no-drafter-copies", action="store_true", help="leave the copies of the "
                   "target's embedding / lm_head out of the drafters (DeepSpec writes them; jspec "
                   "only checks them): 4.6 GiB less to write for the 8B pair")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--dry-run", action="store_true", help="check and print the plan, write nothing")
    p.add_argument("--check", action="store_true", help="after writing, load S and the grafted "
                   "target and compare their logits (prints a JSON report)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.dry_run:
            print(plan_graft(args.target, args.draft, args.dflash, shape=args.shape,
                             dtype=args.dtype).summary())
            return 0
        graft(args.target, args.draft, args.out, args.dflash, shape=args.shape, dtype=args.dtype,
              shard_mib=args.shard_mib, drafter_copies=not args.no_drafter_copies,
              force=args.force, quiet=args.quiet)
        if args.check:
            print(json.dumps(check_graft(args.target, args.out)))
        return 0
    except (GraftError, ConfigError, CheckpointError, FileExistsError, FileNotFoundError) as e:
        print(f"graft: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
