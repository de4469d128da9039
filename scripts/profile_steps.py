"""Where the time of one decode step (or one speculative iteration) goes: a jax.profiler trace of
a few device-resident decode dispatches, per kernel and per category, against the bytes each
category must move.

  python3 scripts/profile_steps.py --out $OUT/profile_stock.json              # stock, 8B, 1 lane, ctx 512
  python3 scripts/profile_steps.py --out $OUT/profile_spec.json --spec        # one speculative iteration

Same engine and programs as scripts/bench_steps.py: random bf16 weights at the preset's shape,
lanes parked at `--context` with random K/V, `--steps` steps per dispatch. The script

1. lowers the decode program once with named scopes on the model's pieces (qkv, o_proj, mlp,
   norm, rope, attention, kv_write, lm_head, embed, sampling; draft / verify / context for the
   speculative iteration). Scopes only change HLO metadata (op_name), never the computation;
   they let every kernel be traced back to the part of the model it computes;
2. times `--reps` dispatches without the profiler (the step time to compare with bench_steps);
3. traces `--dispatches` dispatches (each inside a `profile_dispatch_i` annotation) and one
   device copy (`profile_copy`, a kernel-timed copy bandwidth) with jax.profiler;
4. reads the device events from the Perfetto JSON (perfetto_trace.json.gz), or from the
   .xplane.pb through jax.profiler.ProfileData when the JSON is missing or has no device events:
   GPU kernels and memcpys on the `Stream #...` tracks of `/device:GPU:N`; on CPU, the XLA:CPU
   thunk events (args.hlo_op) on the host threads, exclusive of nested events;
5. maps each event to its HLO instruction (hlo_op, or an annotation / kernel name that names
   one), and each instruction to a category and its bytes (operand + result sizes from the
   compiled HLO; KV-pool-sized buffers are left out since kernels touch a few pages of them),
   and writes per-kernel, per-HLO-op and per-category tables, device busy time against wall
   time, analytic bytes per category and achieved bandwidth to `--out`, plus a markdown table.

Caveat printed with the results: under an active profiler XLA runs command buffers (CUDA graphs)
op by op (`--xla_enable_command_buffers_during_profiling` is false by default), so the profiled
wall time per step includes more launch overhead than the unprofiled step; kernel times are
unaffected. Compare the device busy time with the *unprofiled* step time for the real gap.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gzip
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")

SCOPE_PREFIX = "px_"
# Innermost named scope -> component; phases prefix the component in the speculative iteration.
COMPONENTS = ("attention", "kv_write", "lm_head", "embed", "qkv", "o_proj", "mlp", "norm", "rope",
              "sampling", "draft_sample", "rejection", "markov", "fc")
PHASES = ("draft", "verify", "context")
CONTROL_OPCODES = {"while", "conditional", "call", "async-start", "async-done", "async-update"}
MEMCPY_RE = re.compile(r"^(memcpy|memset|MemcpyH2D|MemcpyD2H|MemcpyD2D|MemcpyP2P|Memset)", re.I)
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


# ---- HLO text --------------------------------------------------------------------------------

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16}
ARRAY_RE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([^\]]*)\]")
INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def dtype_bytes(dtype: str) -> float:
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    if dtype.startswith("f8") or dtype.startswith("f6") or dtype.startswith("f4"):
        return 1
    return 0


def arrays_in(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array [dtype, dims] in a shape string (tuples give several)."""
    out = []
    for dtype, dims in ARRAY_RE.findall(shape):
        ds = tuple(int(re.sub(r"[^0-9]", "", d) or 0) for d in dims.split(",") if d.strip())
        out.append((dtype, ds))
    return out


def array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    return int(math.prod(dims) * dtype_bytes(dtype))


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    in_str = False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if c == "\\":
                continue
            if c == '"':
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
    return len(text) - 1


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    shape: str
    operands: list[str]
    attrs: str
    computation: str
    is_root: bool

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def called(self) -> list[str]:
        names = []
        for key in ("calls", "to_apply", "body", "condition", "branch_computations",
                    "called_computations"):
            for m in re.finditer(key + r"=(\{[^}]*\}|%?[\w.\-]+)", self.attrs):
                names += re.findall(r"%?([\w.\-]+)", m.group(1).strip("{}"))
        return names

    @property
    def custom_call_target(self) -> str:
        m = re.search(r'custom_call_target="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    def out_arrays(self):
        arrays = arrays_in(self.shape)
        # A custom call's tuple result ends with scratch (cuBLAS workspace): count the first only.
        if self.opcode == "custom-call" and self.shape.startswith("(") and arrays:
            return arrays[:1]
        return arrays


def parse_hlo(text: str) -> dict:
    instrs: dict[str, Instr] = {}
    comps: dict[str, list[str]] = collections.defaultdict(list)
    comp = ""
    entry = ""
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("//") or s.startswith("HloModule"):
            continue
        if s == "}":
            continue
        if s.endswith("{"):
            cm = COMP_RE.match(line)
            if cm:
                comp = cm.group(2)
                if cm.group(1):
                    entry = comp
            continue
        m = INSTR_RE.match(line)
        if m:
            is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
            if rest.startswith("("):
                end = _matching(rest, 0)
                shape, rest2 = rest[:end + 1], rest[end + 1:].lstrip()
            else:
                shape, _, rest2 = rest.partition(" ")
            om = re.match(r"([\w\-]+)\(", rest2)
            if not om:
                continue
            opcode = om.group(1)
            open_at = om.end() - 1
            close_at = _matching(rest2, open_at)
            operand_text = rest2[open_at + 1:close_at]
            operands = ([] if opcode in ("constant", "parameter", "iota")
                        else re.findall(r"%([\w.\-]+)", operand_text))
            if opcode not in ("constant", "parameter", "iota") and not operands and operand_text.strip():
                # Operands printed without '%': "f32[2] a, f32[2] b" or "a, b".
                operands = [p.strip().split(" ")[-1] for p in operand_text.split(",") if p.strip()]
            attrs = rest2[close_at + 1:]
            if opcode == "parameter":
                attrs = f"parameter_number={operand_text.strip()}" + attrs
            instrs[name] = Instr(name, opcode, shape, operands, attrs, comp, is_root)
            comps[comp].append(name)
    roots = {c: next((n for n in names if instrs[n].is_root), names[-1] if names else None)
             for c, names in comps.items()}
    callers = collections.defaultdict(list)
    users = collections.defaultdict(list)
    for ins in instrs.values():
        for c in ins.called:
            callers[c].append(ins.name)
        for o in ins.operands:
            users[o].append(ins.name)
    m = re.search(r"^\s*HloModule\s+([\w.\-]+)", text, re.M)
    return {"instrs": instrs, "comps": dict(comps), "roots": roots, "entry": entry,
            "callers": dict(callers), "users": dict(users), "module": m.group(1) if m else None}


PASS_THROUGH = {"bitcast", "copy", "reshape", "transpose", "convert", "bitcast-convert",
                "copy-done", "copy-start", "optimization-barrier"}


def _int_attr(ins: Instr, key: str) -> int | None:
    m = re.search(key + r"=(\d+)", ins.attrs)
    return int(m.group(1)) if m else None


def entry_source(hlo: dict, name: str, index: int | None = None, depth: int = 0) -> str | None:
    """The ENTRY parameter an array comes from, through tuples, while loops, fusion / call
    parameters and layout-only ops (bitcast, copy, transpose, convert); None if computed."""
    instrs = hlo["instrs"]
    ins = instrs.get(name)
    if ins is None or depth > 40:
        return None
    op = ins.opcode
    if op == "parameter":
        if ins.computation == hlo["entry"]:
            return name if index is None else None
        n = _int_attr(ins, "parameter_number")
        for caller in hlo["callers"].get(ins.computation, []):
            c = instrs[caller]
            if c.opcode == "while" and c.operands:
                return entry_source(hlo, c.operands[0], index, depth + 1)
            if c.opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", c.attrs)
                names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
                if ins.computation in names and names.index(ins.computation) + 1 < len(c.operands):
                    return entry_source(hlo, c.operands[names.index(ins.computation) + 1], index,
                                        depth + 1)
                continue
            if n is not None and n < len(c.operands):
                return entry_source(hlo, c.operands[n], index, depth + 1)
        return None
    if op == "get-tuple-element" and ins.operands:
        return entry_source(hlo, ins.operands[0], _int_attr(ins, "index"), depth + 1)
    if op == "tuple" and index is not None and index < len(ins.operands):
        return entry_source(hlo, ins.operands[index], None, depth + 1)
    if op == "while" and index is not None and ins.operands:
        return entry_source(hlo, ins.operands[0], index, depth + 1)  # loop-invariant elements
    if op in PASS_THROUGH and ins.operands and index is None:
        return entry_source(hlo, ins.operands[0], None, depth + 1)
    if op == "fusion" and index is None:
        # A layout-only fusion (convert / transpose of one array): follow its array operand.
        outs = arrays_in(ins.shape)
        arr = [o for o in ins.operands if o in instrs and arrays_in(instrs[o].shape)
               and math.prod(arrays_in(instrs[o].shape)[0][1]) > 1]
        if len(outs) == 1 and len(arr) == 1 and \
                math.prod(arrays_in(instrs[arr[0]].shape)[0][1]) == math.prod(outs[0][1]):
            return entry_source(hlo, arr[0], None, depth + 1)
    return None


WEIGHT_KINDS = (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
                ("o_proj", "o_proj"), ("gate_proj", "gate_up"), ("up_proj", "gate_up"),
                ("down_proj", "down"), ("lm_head", "lm_head"), ("embed_tokens", "embed_tokens"),
                ("markov", "markov"), ("confidence", "confidence"))


def weight_kind(param_name: str, dtype_dims: tuple[str, tuple], dims: dict) -> str | None:
    """What a parameter is, from its name (jax names ENTRY parameters after the argument path,
    e.g. params__layers___3___mlp____down_proj___value), else from its shape."""
    for key, kind in WEIGHT_KINDS:
        if key in param_name:
            return kind
    if re.search(r"(^|_)fc(_|$)", param_name):
        return "fc"
    if "cache" in param_name:
        return "kv_pool"
    return dims.get("weight_shapes", {}).get(tuple(dtype_dims[1]))


def _inner(hlo: dict, instr: Instr, depth: int = 0):
    """Instructions of the computations an instruction calls (fusions, nested fusions)."""
    if depth > 4:
        return
    for c in instr.called:
        for n in hlo["comps"].get(c, []):
            sub = hlo["instrs"][n]
            yield sub
            yield from _inner(hlo, sub, depth + 1)


def scopes_of(op_name: str) -> list[str]:
    return [t[len(SCOPE_PREFIX):] for t in op_name.split("/") if t.startswith(SCOPE_PREFIX)]


def caller_op_name(hlo: dict, comp: str, depth: int = 0) -> str:
    """op_name of the while / conditional / call whose body holds `comp` (the nearest with
    named scopes), e.g. the sampler's inner loops."""
    if depth > 8:
        return ""
    for c in hlo["callers"].get(comp, []):
        ins = hlo["instrs"][c]
        if scopes_of(ins.op_name):
            return ins.op_name
        up = caller_op_name(hlo, ins.computation, depth + 1)
        if up:
            return up
    return ""


def neighbor_op_name(hlo: dict, ins: Instr, depth: int = 2) -> str:
    """The first op_name with named scopes among operands and users (breadth first)."""
    seen, frontier = {ins.name}, [ins.name]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            i = hlo["instrs"][n]
            for m in list(i.operands) + hlo["users"].get(n, []):
                if m in seen or m not in hlo["instrs"]:
                    continue
                seen.add(m)
                if scopes_of(hlo["instrs"][m].op_name):
                    return hlo["instrs"][m].op_name
                nxt.append(m)
        frontier = nxt
    return ""


def instr_info(hlo: dict, name: str, dims: dict, cache: dict) -> dict | None:
    """Category, bytes and provenance of one kernel-level HLO instruction.

    Category, first match: (1) the weight it reads (a matmul operand that comes from a named
    ENTRY parameter: q/k/v_proj, o_proj, gate/up, down, lm_head, fc, markov; a whole-weight
    copy is `weight_relayout`); (2) the innermost named scope of its own op_name (or of the dot /
    root inside a fusion); (3) a scatter / dynamic-update-slice into a KV pool is `kv_write`;
    (4) the scopes of the loop / conditional whose body holds it; (5) of its neighbours;
    (6) copy, other_matmul or other. The phase (draft / verify / context) prefixes it."""
    if name in cache:
        return cache[name]
    instrs = hlo["instrs"]
    ins = instrs.get(name)
    if ins is None:
        cache[name] = None
        return None
    inner = list(_inner(hlo, ins)) if ins.opcode in ("fusion", "call") else []
    dots = [i for i in [ins] + inner if i.opcode in ("dot", "convolution") or
            (i.opcode == "custom-call" and (i.custom_call_target in GEMM_TARGETS
                                            or "linear_bi" in i.op_name))]  # kernels/linear.py
    names = [ins.op_name]
    if dots:
        names.insert(0, dots[0].op_name)
    if ins.called:
        root = instrs.get(hlo["roots"].get(ins.called[0]) or "")
        names.append(root.op_name if root else "")
    source = "own"
    pool = dims["pool_elems"]
    writes_pool = any(i.opcode in ("scatter", "dynamic-update-slice") for i in [ins] + inner)

    weights = []
    for op in ins.operands:
        src = entry_source(hlo, op)
        if src:
            arr = arrays_in(instrs[src].shape)
            kind = weight_kind(src, arr[0] if arr else ("", ()), dims)
            if kind and kind != "kv_pool":
                weights.append((src, kind, math.prod(arr[0][1]) if arr else 0))

    touches_pool = False
    nbytes = out_bytes = 0
    for dtype, ds in ins.out_arrays():
        if pool and math.prod(ds) == pool:
            touches_pool = True
            continue
        out_bytes += array_bytes(dtype, ds)
    nbytes = out_bytes
    # A gather / dynamic slice of a table (embedding rows, Markov rows) reads what it returns.
    gathers = not dots and any(i.opcode in ("gather", "dynamic-slice") for i in [ins] + inner)
    table_ops = {w[0] for w in weights}
    for op in ins.operands:
        src = instrs.get(op)
        if src is None:
            continue
        for dtype, ds in src.out_arrays() if src.opcode == "custom-call" else arrays_in(src.shape):
            if pool and math.prod(ds) == pool:
                touches_pool = True
                continue
            b = array_bytes(dtype, ds)
            if gathers and entry_source(hlo, op) in table_ops:
                b = min(b, out_bytes)
            nbytes += b

    category = categorize_by_weight(dots, ins, weights, dims)
    if category is not None:
        source = "weight"
    op_name = next((n for n in names if scopes_of(n)), "")
    if category is None and not op_name and touches_pool and writes_pool:
        category, source = "kv_write", "kv-pool write"
    if not op_name:
        names += [i.op_name for i in inner]
        op_name = next((n for n in names if scopes_of(n)), next((n for n in names if n), ""))
        if category is None:
            source = "fused"
    if category is None and not scopes_of(op_name):
        for how, alt in (("enclosing loop", lambda: caller_op_name(hlo, ins.computation)),
                         ("neighbours", lambda: neighbor_op_name(hlo, ins))):
            n = alt()
            if scopes_of(n):
                op_name, source = n, how
                break
    scopes = scopes_of(op_name)
    if category is None:
        component = next((s for s in reversed(scopes) if s in COMPONENTS), None)
        category = categorize_by_scope(component, dots, ins, dims)
    phase = next((s for s in scopes if s in PHASES), None)
    if phase is None and dims.get("spec") and weights:
        # No scope: a drafter weight (second element of the params tuple) means the draft.
        if any(re.match(r"params_?1_", w[0]) for w in weights):
            phase = "draft"
    if phase:
        category = f"{phase}/{category}"
    info = {"hlo_op": name, "opcode": ins.opcode, "category": category, "by": source,
            "custom_call_target": ins.custom_call_target or None, "hlo_bytes": nbytes,
            "touches_kv_pool": touches_pool, "weights": sorted({w[0] for w in weights})[:4],
            "shape": ins.shape[:200], "op_name": op_name[-200:]}
    cache[name] = info
    return info


MATMUL_WEIGHTS = ("qkv_proj", "o_proj", "gate_up", "down", "lm_head", "fc")


def categorize_by_weight(dots: list, ins: Instr, weights: list, dims: dict) -> str | None:
    """A kernel reading a weight is what the weight is: a matmul (or a matrix-vector product
    that XLA emitted as a reduction) of q/k/v, o, gate/up, down, lm_head, fc; a gather from the
    embedding / Markov table; a whole weight copied is a relayout."""
    if not weights:
        return None
    big = max(weights, key=lambda w: w[2])
    outs = ins.out_arrays()
    out_elems = math.prod(outs[0][1]) if outs else 0
    if not dots and big[2] and out_elems == big[2]:
        return "weight_relayout"  # a whole weight copied / transposed / converted
    if big[1] == "embed_tokens":
        if dots or (outs and outs[0][1] and outs[0][1][-1] != dims["hidden"]):
            return "lm_head"
        return "embed"
    if big[1] == "markov":
        return "markov"
    if dots or (big[1] in MATMUL_WEIGHTS and out_elems < big[2]):
        return big[1]
    return None


def categorize_by_scope(component: str | None, dots: list, ins: Instr, dims: dict) -> str:
    has_dot = bool(dots)
    if component in ("attention", "kv_write", "lm_head", "embed", "sampling", "draft_sample",
                     "rejection", "markov", "fc", "norm", "rope"):
        return component
    if component == "o_proj":
        return "o_proj" if has_dot else "o_proj_other"
    if component == "qkv":
        return "qkv_proj" if has_dot else "qkv_other"
    if component == "mlp":
        if not has_dot:
            return "mlp_act"
        arrays = dots[0].out_arrays() or arrays_in(dots[0].shape)
        last = arrays[0][1][-1] if arrays and arrays[0][1] else 0
        # gate / up project D -> F (possibly merged: 2F); down projects F -> D.
        return "down" if last == dims["hidden"] and dims["hidden"] != dims["ffn"] else "gate_up"
    if ins.opcode.startswith("copy"):
        return "copy"
    return "other_matmul" if has_dot else "other"


# ---- named scopes while tracing ----------------------------------------------------------------

@contextlib.contextmanager
def scoped_model(spec: bool):
    """Wrap the model's pieces in jax.named_scope for the duration of tracing (metadata only).
    Missing attributes are skipped and reported (the categories then fall back to other)."""
    import jax

    import jspec.qwen3 as q
    import jspec.steps as st
    targets = [(q.Attention, "qkv", "qkv"), (q.Attention, "out", "o_proj"),
               (q.MLP, "__call__", "mlp"), (q.RMSNorm, "__call__", "norm"),
               (q.Qwen3, "embed", "embed"), (q.Qwen3, "logits", "lm_head"),
               (q, "apply_rope", "rope"), (st, "write_kv", "kv_write"),
               (st, "ragged_paged_attention", "attention"), (st, "sample", "sampling"),
               (st, "token_logprobs", "sampling")]
    if spec:
        import jspec.dspark as ds
        import jspec.spec_steps as sp
        targets += [(sp.SpecPrograms, "draft", "draft"), (sp.SpecPrograms, "verify", "verify"),
                    (sp.SpecPrograms, "_write_context", "context"),
                    (sp, "rejection_sample", "rejection"), (sp, "draft_sample", "draft_sample"),
                    (sp, "write_kv", "kv_write"), (ds.DSparkDrafter, "markov_bias", "markov"),
                    (ds.DSparkDrafter, "fuse", "fc"), (ds, "apply_rope", "rope")]

    def scoped(fn, name):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            with jax.named_scope(SCOPE_PREFIX + name):
                return fn(*a, **k)
        return wrapper

    saved, missing = [], []
    for owner, attr, name in targets:
        own = attr in vars(owner)
        fn = getattr(owner, attr, None)
        if fn is None or not callable(fn):
            missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            continue
        saved.append((owner, attr, vars(owner)[attr] if own else None, own))
        setattr(owner, attr, scoped(fn, name))
    try:
        yield missing
    finally:
        for owner, attr, orig, own in reversed(saved):
            if own:
                setattr(owner, attr, orig)
            else:
                delattr(owner, attr)


# ---- trace reading ----------------------------------------------------------------------------

@dataclasses.dataclass
class Event:
    track: str         # process / thread (JSON) or plane / line (xplane)
    process: str
    thread: str
    name: str
    ts: float          # microseconds
    dur: float         # microseconds
    args: dict

    @property
    def end(self) -> float:
        return self.ts + self.dur


def read_json_trace(path: Path) -> list[Event]:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    out = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        pid, tid = e.get("pid"), e.get("tid")
        out.append(Event(f"{pid}:{tid}", procs.get(pid, str(pid)), threads.get((pid, tid), str(tid)),
                         str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0.0)),
                         dict(e.get("args") or {})))
    return out


def read_xplane(path: Path) -> list[Event]:
    from jax.profiler import ProfileData
    return xplane_events(ProfileData.from_file(str(path)))


def xplane_events(data) -> list[Event]:
    out = []
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                args = {}
                try:
                    for k, v in e.stats:
                        args[str(k)] = v if isinstance(v, (int, float, str)) else str(v)
                except Exception:  # noqa: BLE001 - stats of an odd type: keep the event
                    pass
                out.append(Event(f"{plane.name}:{line.name}", plane.name, line.name, e.name,
                                 e.start_ns / 1e3, e.duration_ns / 1e3, args))
    return out


def device_tracks(events: list[Event]) -> tuple[str, set[str]]:
    """('gpu', tracks) for accelerator stream tracks, else ('host', set())."""
    dev = [e for e in events if e.process.startswith("/device:") and "CPU" not in e.process]
    streams = {e.track for e in dev if e.thread.startswith("Stream")}
    if streams:
        return "gpu", streams
    ops = {e.track for e in dev if e.thread in ("XLA Ops", "Async XLA Ops")}
    if ops:
        return "device-ops", ops
    derived = {"XLA Modules", "Steps", "Framework Ops", "Framework Name Scope", "Source code",
               "XLA TraceMe", "Launch Stats", "TensorFlow Ops", "TensorFlow Name Scope"}
    other = {e.track for e in dev if e.thread not in derived}
    if other:
        return "device-other", other
    return "host", set()


HLO_OP_RE = re.compile(r"hlo_op=([^,#\s]+)")


def resolve_op(e: Event, instrs: dict, by_kernel: dict) -> str | None:
    """The HLO instruction an event belongs to, from its args or its name."""
    cands = []
    if isinstance(e.args.get("hlo_op"), str):
        cands.append(e.args["hlo_op"])
    for v in e.args.values():
        if isinstance(v, str):
            cands += HLO_OP_RE.findall(v)
            for piece in reversed(v.split("::")):
                cands.append(piece.split(":#")[0].split(":")[0].strip())
    cands += [e.name, e.name.split(":#")[0]]
    for c in cands:
        if c in instrs:
            return c
    for c in cands:
        k = normalize_symbol(c)
        if k in by_kernel:
            return by_kernel[k]
    # Last resort: a kernel name with one extra numeric suffix (one of several kernels of a
    # fusion, e.g. loop_add_fusion_2_1).
    for c in (e.name,):
        k = re.sub(r"_\d+$", "", normalize_symbol(c))
        if k != normalize_symbol(c) and k in by_kernel:
            return by_kernel[k]
    return None


def normalize_symbol(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


def family(name: str) -> str:
    """A kernel name without its per-instance numeric suffix (fusion.12, loop_add_fusion_3)."""
    return re.sub(r"([._]\d+)+$", "", name) or name


def exclusive_times(evs: list[Event]) -> list[float]:
    """Per event, its duration minus that of events nested inside it on the same track."""
    excl = [e.dur for e in evs]
    by_track = collections.defaultdict(list)
    for i, e in enumerate(evs):
        by_track[e.track].append(i)
    for idx in by_track.values():
        idx.sort(key=lambda i: (evs[i].ts, -evs[i].dur))
        stack: list[int] = []
        for i in idx:
            while stack and evs[stack[-1]].end <= evs[i].ts:
                stack.pop()
            if stack:
                p = stack[-1]
                excl[p] -= max(0.0, min(evs[i].end, evs[p].end) - evs[i].ts)
            stack.append(i)
    return [max(0.0, x) for x in excl]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


HLO_MODULE_RE = re.compile(r"hlo_module=([^,#\s]+)")


def event_module(e: Event) -> str | None:
    if isinstance(e.args.get("hlo_module"), str):
        return e.args["hlo_module"]
    for v in e.args.values():
        if isinstance(v, str):
            m = HLO_MODULE_RE.search(v)
            if m:
                return m.group(1)
    return None


def group_by_gaps(evs: list[Event], n: int) -> list[tuple[float, float, str]]:
    """n windows around the events, split at the n - 1 widest gaps (the fallback when device
    timestamps do not fall inside the host annotations)."""
    evs = sorted(evs, key=lambda e: e.ts)
    if not evs or n < 1:
        return []
    reach, gaps = evs[0].end, []
    for i in range(1, len(evs)):
        gaps.append((evs[i].ts - reach, i))
        reach = max(reach, evs[i].end)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:n - 1])
    bounds = [0] + cuts + [len(evs)]
    return [(evs[lo].ts, max(e.end for e in evs[lo:hi]), f"group_{k}")
            for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])) if hi > lo]


def analyze_trace(events: list[Event], hlo: dict, dims: dict, steps_per_dispatch: int,
                  copy_bytes: int | None = None, slack_us: float = 50.0) -> dict:
    """Per-kernel / per-op / per-category aggregation of the device events inside the
    `profile_dispatch_*` windows, busy vs wall, idle gaps, and the kernel-timed copy."""
    instrs = hlo["instrs"]
    module = hlo.get("module")
    by_kernel = {}
    for n in instrs:
        by_kernel.setdefault(normalize_symbol(n), n)
    host_windows = sorted((e.ts, e.end, e.name) for e in events
                          if e.name.startswith("profile_dispatch_"))
    copy_win = [(e.ts, e.end, e.name) for e in events if e.name == "profile_copy"]
    mode, tracks = device_tracks(events)
    if mode == "host":
        # XLA:CPU: thunk events carry hlo_op; the dispatch / trace annotations themselves don't.
        cand = [e for e in events if not e.name.startswith(("end: ", "profile_"))
                and ("hlo_op" in e.args or e.name in instrs)]
    else:
        cand = [e for e in events if e.track in tracks]

    def window_of(e: Event, wins) -> int | None:
        for i, w in enumerate(wins):
            if w[0] - slack_us <= e.ts and e.end <= w[1] + slack_us:
                return i
        return None

    def same_module(m: str | None) -> bool:
        if m is None or not module:
            return True
        a, b = (re.sub(r"[._]\d+$", "", x) for x in (m, module))
        return a == b or m.startswith(module) or module.startswith(m)

    notes = []
    other_module = [e for e in cand if not same_module(event_module(e))]
    if other_module and len(other_module) == len(cand):
        notes.append(f"every device event names a module other than {module!r} "
                     f"(e.g. {event_module(other_module[0])!r}): module filter disabled")
        other_module = []
    skip = {id(e) for e in other_module}
    cand = [e for e in cand if id(e) not in skip]
    windows = host_windows
    # Each window (the copy's and the dispatches') owns the time up to the midpoints between it
    # and its neighbours, so a small host / device clock skew cannot drop or move kernels;
    # `events_outside_strict` counts events not strictly inside their window (skew diagnostic).
    every = sorted(copy_win + host_windows)
    owned = []
    for i, (ws, we, name) in enumerate(every):
        lo = (every[i - 1][1] + ws) / 2 if i else ws - 1e3
        hi = (we + every[i + 1][0]) / 2 if i + 1 < len(every) else we + 1e3
        owned.append((lo, hi, name))
    index_of = {w[2] + repr(w[0]): i for i, w in enumerate(host_windows)}
    dev, copy_evs, outside, loose = [], [], 0, 0
    for e in cand:
        k = window_of(e, owned)
        if k is None:
            outside += 1
        elif every[k][2] == "profile_copy":
            copy_evs.append(e)
        else:
            w = index_of[every[k][2] + repr(every[k][0])]
            dev.append((w, e))
            loose += window_of(e, windows[w:w + 1]) is None
    if not dev and cand and host_windows:
        windows = group_by_gaps(cand, len(host_windows))
        dev = [(window_of(e, windows), e) for e in cand]
        dev = [(w, e) for w, e in dev if w is not None]
        outside, loose = len(cand) - len(dev), 0
        notes.append("device timestamps fell outside the host dispatch annotations: device "
                     "events grouped into dispatches at the widest gaps; wall time from the host")
    cache: dict = {}
    rows = []
    for w, e in dev:
        op = resolve_op(e, instrs, by_kernel)
        info = instr_info(hlo, op, dims, cache) if op else None
        is_copy = bool(MEMCPY_RE.match(e.name))
        if info and info["opcode"] in CONTROL_OPCODES and not is_copy and mode == "host":
            continue  # an XLA:CPU while / conditional thunk wraps the events of its body
        if is_copy:
            category = "memcpy/memset"
        elif info:
            category = info["category"]
        else:
            category = "unattributed:" + guess_kernel(e.name)
        rows.append({"w": w, "e": e, "op": op, "info": info, "category": category,
                     "idle": 0.0})
    excl = exclusive_times([r["e"] for r in rows])
    for r, x in zip(rows, excl):
        r["excl"] = x

    n_disp = len(host_windows) or len(windows)
    n_steps = max(1, n_disp * steps_per_dispatch)
    # Busy (union over streams / threads), span and idle gaps per dispatch window.
    busy = span = lead = tail = 0.0
    by_window = collections.defaultdict(list)
    for r in rows:
        by_window[r["w"]].append(r)
    for wi, (ws, we, _) in enumerate(windows):
        mine = sorted(by_window.get(wi, []), key=lambda r: r["e"].ts)
        if not mine:
            continue
        busy += union_length([(r["e"].ts, r["e"].end) for r in mine])
        first, last = mine[0]["e"].ts, max(r["e"].end for r in mine)
        span += last - first
        lead += max(0.0, first - ws)
        tail += max(0.0, we - last)
        reach = first
        for r in mine:
            if r["e"].ts > reach:
                r["idle"] = r["e"].ts - reach
            reach = max(reach, r["e"].end)
    wall = sum(we - ws for ws, we, _ in host_windows) or sum(we - ws for ws, we, _ in windows)

    # One execution of an op may launch several kernels (split-K attention: kernel + merge):
    # its HLO bytes are charged once per execution, i.e. split over its distinct kernel names.
    names_of_op = collections.defaultdict(set)
    for r in rows:
        if r["info"]:
            names_of_op[r["op"]].add(r["e"].name)
    for r in rows:
        r["bytes"] = r["info"]["hlo_bytes"] / len(names_of_op[r["op"]]) if r["info"] else 0.0
    new = lambda: {"count": 0, "total_us": 0.0, "bytes": 0.0, "idle_us": 0.0, "set": set()}  # noqa: E731
    kern = collections.defaultdict(new)
    ops = collections.defaultdict(new)
    cats = collections.defaultdict(new)
    for r in rows:
        e = r["e"]
        for table, key, member in ((kern, (family(e.name), r["category"]), r["op"]),
                                   (ops, r["op"] or f"<{e.name}>", family(e.name)),
                                   (cats, r["category"], None)):
            t = table[key]
            t["count"] += 1
            t["total_us"] += r["excl"]
            t["bytes"] += r["bytes"]
            t["idle_us"] += r["idle"]
            if member:
                t["set"].add(member)

    kernels = [{"kernel": fam, "category": cat, "calls_per_step": k["count"] / n_steps,
                "us_per_step": k["total_us"] / n_steps, "mean_us": k["total_us"] / k["count"],
                "idle_before_us_per_step": k["idle_us"] / n_steps, "hlo_ops": len(k["set"]),
                "hlo_bytes_per_call": k["bytes"] / k["count"]}
               for (fam, cat), k in kern.items()]
    kernels.sort(key=lambda r: -r["us_per_step"])
    op_rows = []
    for name, o in ops.items():
        info = cache.get(name) or {}
        op_rows.append({"hlo_op": name, "category": info.get("category", "unattributed"),
                        "by": info.get("by"), "opcode": info.get("opcode"),
                        "custom_call_target": info.get("custom_call_target"),
                        "kernels": sorted(o["set"]), "calls_per_step": o["count"] / n_steps,
                        "us_per_step": o["total_us"] / n_steps,
                        "mean_us": o["total_us"] / o["count"],
                        "idle_before_us_per_step": o["idle_us"] / n_steps,
                        "hlo_bytes": info.get("hlo_bytes"),
                        "touches_kv_pool": info.get("touches_kv_pool"),
                        "weights": info.get("weights"), "op_name": info.get("op_name")})
    op_rows.sort(key=lambda r: -r["us_per_step"])
    categories = {cat: {"us_per_step": c["total_us"] / n_steps,
                        "kernels_per_step": c["count"] / n_steps,
                        "idle_before_us_per_step": c["idle_us"] / n_steps,
                        "hlo_bytes_per_step": c["bytes"] / n_steps}
                  for cat, c in cats.items()}
    used = sorted({r["e"].track for r in rows})
    res = {"events_kind": mode, "device_tracks": used[:32], "device_track_count": len(used),
           "module": module,
           "dispatches": n_disp, "steps": n_steps, "events_in_windows": len(rows),
           "events_outside_windows": outside, "events_outside_strict": loose,
           "events_other_modules": len(other_module),
           "wall_us_per_step": wall / n_steps, "busy_us_per_step": busy / n_steps,
           "span_us_per_step": span / n_steps,
           "kernel_sum_us_per_step": sum(r["excl"] for r in rows) / n_steps,
           "idle_inside_span_us_per_step": (span - busy) / n_steps,
           "launch_lead_us_per_dispatch": lead / max(1, n_disp),
           "tail_us_per_dispatch": tail / max(1, n_disp),
           "unattributed_events": sum(1 for r in rows if r["info"] is None
                                      and not r["category"].startswith("memcpy")),
           "kernels": kernels, "hlo_ops": op_rows, "categories": categories,
           "analysis_notes": notes}
    if copy_evs and copy_bytes:
        durs = sorted(e.dur for e in copy_evs if e.dur > 0)
        if durs:
            t = statistics.median(durs)
            res["copy_kernel_us"] = t
            res["copy_bandwidth_kernel_TBps"] = copy_bytes / (t * 1e-6) / 1e12
    return res


def guess_kernel(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "gemv", "xmma", "nvjet", "cutlass", "cublas", "matmul")):
        return "matmul"
    if any(s in n for s in ("rpa", "attention", "paged", "flash")):
        return "attention"
    return "other"


# ---- expected bytes --------------------------------------------------------------------------

def analytic_bytes(cfg, dcfg, lanes: int, kv_len: float, spec: bool, width: int) -> dict:
    """Bytes each weight-reading category must move per step (weights read once, KV of the
    context read once, this step's K/V written once). Activations are ignored (< 1 MB)."""
    w = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hq, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kv_tok = 2 * Hkv * hd * w

    def layers(L, rows, kvl):
        return {"qkv_proj": L * (Hq + 2 * Hkv) * hd * D * w, "o_proj": L * Hq * hd * D * w,
                "gate_up": L * 2 * F * D * w, "down": L * F * D * w,
                "attention": lanes * L * kvl * kv_tok, "kv_write": rows * L * kv_tok,
                "norm": L * (2 * D + 2 * hd) * w}

    if not spec:
        out = layers(cfg.num_layers, lanes, kv_len)
        out.update(lm_head=V * D * w, embed=lanes * D * w)
        out["norm"] += D * w
        return out
    L_d, block = dcfg.layers.num_layers, dcfg.block_size
    out = {}
    for k, v in layers(cfg.num_layers, lanes * width, kv_len + width - 1).items():
        out["verify/" + k] = v
    out["verify/lm_head"] = V * D * w
    out["verify/embed"] = lanes * width * D * w
    out["verify/norm"] += D * w
    for k, v in layers(L_d, lanes * block, kv_len + block - 1).items():
        out["draft/" + k] = v
    out["draft/lm_head"] = V * D * w
    out["draft/embed"] = lanes * block * D * w
    out["draft/norm"] += D * w
    out["context/fc"] = D * dcfg.num_taps * D * w
    out["context/kv_write"] = lanes * width * L_d * kv_tok
    return out


def weight_shapes(cfg, dcfg) -> dict:
    """Parameter dims -> kind: the fallback when ENTRY parameters carry no argument names."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hq, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {(Hq, hd, D): "qkv_proj", (Hkv, hd, D): "qkv_proj", (D, Hq, hd): "o_proj",
              (F, D): "gate_up", (D, F): "down", (V, D): "embed_tokens",
              (Hq + 2 * Hkv, hd, D): "qkv_proj", (2 * F, D): "gate_up"}  # the engine's fused layout
    if dcfg is not None:
        shapes[(D, dcfg.num_taps * D)] = "fc"
        if dcfg.markov_rank:
            shapes[(V, dcfg.markov_rank)] = "markov"
    return shapes


# ---- the run ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output; the trace goes beside it")
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16, help="steps (iterations) per dispatch")
    ap.add_argument("--dispatches", type=int, default=3, help="dispatches under the profiler")
    ap.add_argument("--reps", type=int, default=5, help="unprofiled timed dispatches")
    ap.add_argument("--spec", action="store_true", help="profile the speculative iteration")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--attn-impl", default="auto")
    ap.add_argument("--batch-invariant", action="store_true", help="EngineConfig.batch_invariant")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off (Qwen3's default: 20)")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off (Qwen3's default: 0.8)")
    ap.add_argument("--candidate-top-k", type=int, default=None,
                    help="jspec.sampling.CANDIDATE_TOP_K (0: small top-k by bit search too)")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--taps", default="1,9,17,25,33")
    ap.add_argument("--num-draft", type=int, default=None, help="drafts verified per iteration "
                    "(default: the block's 7; the bench's team and busy verify 3)")
    ap.add_argument("--verify-rule", default="block", choices=("block", "token"))
    ap.add_argument("--draft-kv-dtype", choices=["float8_e4m3fn"], default=None,
                    help="EngineConfig.draft_kv_dtype (the bench's fp8 drafter pool)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="device copy for the bandwidth "
                    "ceiling (read + write counted); 0 skips it")
    ap.add_argument("--source", choices=("auto", "json", "xplane"), default="auto")
    ap.add_argument("--trace-dir", default=None, help="where jax.profiler writes (default "
                    "/tmp/profile_steps/<out stem>: the raw trace is too deep and large for $OUT)")
    ap.add_argument("--no-trace-copy", action="store_true", help="do not copy the Perfetto JSON "
                    "(when <= 15 MiB) beside --out as <stem>.perfetto.json.gz")
    ap.add_argument("--cmd-buffers-in-profile", action="store_true",
                    help="set --xla_enable_command_buffers_during_profiling=true (before jax "
                    "starts): kernels inside CUDA graphs may then lose their hlo_op")
    ap.add_argument("--top", type=int, default=25, help="kernel rows printed")
    ap.add_argument("--no-cross-check", action="store_true", help="skip re-reading the trace "
                    "from the other source (xplane when the JSON was used) for a busy-time check")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.cmd_buffers_in_profile:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_enable_command_buffers_during_profiling=true").strip()
    t_start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jspec.config import PRESETS
    from jspec.engine import Engine, EngineConfig
    from jspec.qwen3 import init_random
    from jspec import sampling as sampling_module
    from jspec.sampling import SamplingArrays
    if args.candidate_top_k is not None:  # before any program is traced
        sampling_module.CANDIDATE_TOP_K = args.candidate_top_k
    from jspec.steps import DecodeState

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    trace_dir = Path(args.trace_dir) if args.trace_dir else Path("/tmp/profile_steps") / out_path.stem
    cfg = PRESETS[args.preset].replace(dtype=args.dtype)
    rec = {"jax": jax.__version__, "backend": jax.default_backend(),
           "device": jax.devices()[0].device_kind, "preset": args.preset, "dtype": args.dtype,
           "mode": "spec" if args.spec else "stock", "lanes": args.lanes, "context": args.context,
           "steps_per_dispatch": args.steps, "dispatches_profiled": args.dispatches,
           "page_size": args.page_size, "attn_impl": args.attn_impl,
           "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
           "candidate_top_k": sampling_module.CANDIDATE_TOP_K,
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "notes": []}

    def save():
        with open(out_path, "w") as f:
            json.dump(rec, f, indent=2, default=str)

    t0 = time.perf_counter()
    target = init_random(cfg, seed=0)
    drafter = dcfg = None
    width = 1
    if args.spec:
        from jspec.dspark import dspark_8b_like_config, init_random_drafter
        dcfg = dspark_8b_like_config(cfg, args.draft_layers,
                                     tuple(int(x) for x in args.taps.split(",")))
        drafter = init_random_drafter(dcfg, seed=1)
        width = 8
    jax.block_until_ready(nnx.state(target))
    eng = Engine(cfg, target, (), EngineConfig(
        max_lanes=args.lanes, page_size=args.page_size,
        max_context=args.context + (args.steps + 1) * width, decode_steps=args.steps,
        attn_impl=args.attn_impl, batch_invariant=args.batch_invariant,
        verify_rule=args.verify_rule, draft_kv_dtype=args.draft_kv_dtype), drafter=drafter,
        draft_cfg=dcfg, **({"num_draft": args.num_draft} if args.spec and args.num_draft else {}))
    width = eng.ecfg.step_width if args.spec else 1

    def random_caches(caches, seed):
        key = jax.random.key(seed)
        return [tuple(jax.random.normal(jax.random.fold_in(key, 2 * i + j), c.shape, c.dtype)
                      for j, c in enumerate(pair)) for i, pair in enumerate(caches)]

    caches = ((random_caches(eng.caches[0], 2), random_caches(eng.caches[1], 3)) if args.spec
              else random_caches(eng.caches, 1))
    eng.caches = None
    ppl = eng.ecfg.pages_per_lane
    table = np.stack([1 + b * ppl + np.arange(ppl) for b in range(args.lanes)]).astype(np.int32)
    lanes = args.lanes
    state = DecodeState(
        tokens=jnp.asarray(np.random.default_rng(0).integers(0, min(150000, cfg.vocab_size), lanes),
                           jnp.int32),
        lengths=jnp.full((lanes,), args.context, jnp.int32), page_table=jnp.asarray(table),
        active=jnp.ones((lanes,), bool), remaining=jnp.full((lanes,), 10**6, jnp.int32),
        stop_on_eos=jnp.zeros((lanes,), bool),
        sampling=SamplingArrays.from_lists([args.temperature] * lanes, [args.top_k] * lanes,
                                           [args.top_p] * lanes, seed=list(range(lanes))))
    jax.block_until_ready(caches)
    rec["init_s"] = time.perf_counter() - t0
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(nnx.state(target)))
    rec["target_weight_bytes"] = weight_bytes
    if drafter is not None:
        rec["drafter_weight_bytes"] = sum(a.nbytes for a in jax.tree.leaves(nnx.state(drafter)))
    print(f"init {rec['init_s']:.1f} s, target weights {weight_bytes / 2**30:.2f} GiB", flush=True)

    # Lower once with named scopes (metadata only), compile, and keep the executable.
    t0 = time.perf_counter()
    raw = getattr(eng.programs, "_decode", None)
    if raw is not None:
        # A fresh jit of the same function (the program bench_steps times, caches donated): a
        # trace cached earlier in this process, without the scopes, cannot be reused.
        def decode(params, caches, state):
            return raw(params, caches, state, num_steps=args.steps)

        program = jax.jit(decode, donate_argnums=(1,))
        lower = functools.partial(program.lower)
    else:
        jax.clear_caches()
        lower = functools.partial(eng.programs.decode.lower, num_steps=args.steps)
    with scoped_model(args.spec) as missing:
        lowered = lower(eng.params, caches, state)
    if missing:
        rec["notes"].append(f"named scopes not installed (renamed?): {missing}")
    compiled = lowered.compile()
    rec["compile_s"] = time.perf_counter() - t0
    hlo_text = compiled.as_text()
    with gzip.open(out_path.with_name(out_path.stem + ".hlo.txt.gz"), "wt") as f:
        f.write(hlo_text)
    hlo = parse_hlo(hlo_text)
    try:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        rec["xla_cost_analysis_one_iteration"] = {k: ca.get(k) for k in
                                                  ("flops", "bytes accessed", "transcendentals")}
    except Exception as e:  # noqa: BLE001 - optional
        rec["xla_cost_analysis_one_iteration"] = f"unavailable: {e!r}"
    print(f"compile {rec['compile_s']:.1f} s, HLO {len(hlo['instrs'])} instructions", flush=True)
    save()

    def dispatch():
        nonlocal caches
        caches, _, toks, *_ = compiled(eng.params, caches, state)
        toks.block_until_ready()

    dispatch()  # warm-up
    dispatch()
    ts = []
    for _ in range(args.reps):
        t = time.perf_counter()
        dispatch()
        ts.append(time.perf_counter() - t)
    step_s = statistics.median(ts) / args.steps
    rec["step_ms_unprofiled"] = step_s * 1e3
    rec["dispatch_ms_unprofiled"] = [t * 1e3 for t in ts]
    rec["tokens_per_s_unprofiled"] = lanes / step_s if not args.spec else None
    print(f"{'iteration' if args.spec else 'step'} {step_s * 1e3:.3f} ms unprofiled "
          f"(median of {args.reps} dispatches of {args.steps})", flush=True)
    save()

    copy_bytes = None
    copy_fn = x = None
    if args.copy_mib:
        x = jnp.ones((args.copy_mib * 2**19,), jnp.bfloat16)
        copy_fn = jax.jit(lambda a: a + jnp.bfloat16(1))
        copy_fn(x).block_until_ready()
        tc = []
        for _ in range(5):
            t = time.perf_counter()
            copy_fn(x).block_until_ready()
            tc.append(time.perf_counter() - t)
        copy_bytes = 2 * x.nbytes
        rec["copy_bandwidth_host_timed_TBps"] = copy_bytes / statistics.median(tc) / 1e12

    # The profile.
    trace_dir.mkdir(parents=True, exist_ok=True)
    run_dir = trace_dir / time.strftime("%Y%m%d_%H%M%S")
    opts = None
    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
    except Exception:  # noqa: BLE001 - older / newer option sets
        opts = None
    started_perfetto = True
    try:
        jax.profiler.start_trace(str(run_dir), create_perfetto_trace=True, profiler_options=opts)
    except TypeError:
        started_perfetto = False
        jax.profiler.start_trace(str(run_dir))
    prof_walls = []
    t_trace = time.perf_counter()
    try:
        if copy_fn is not None:
            with jax.profiler.TraceAnnotation("profile_copy"):
                for _ in range(3):
                    copy_fn(x).block_until_ready()
        for i in range(args.dispatches):
            t = time.perf_counter()
            with jax.profiler.TraceAnnotation(f"profile_dispatch_{i}"):
                dispatch()
            prof_walls.append(time.perf_counter() - t)
    finally:
        try:
            jax.profiler.stop_trace()
        except Exception as e:  # noqa: BLE001 - the xplane is written before the JSON step
            rec["notes"].append(f"stop_trace raised {e!r}; reading the .xplane.pb")
            with contextlib.suppress(Exception):
                from jax._src import profiler as _p
                _p._profile_state.reset()
    del x
    rec["trace_export_s"] = time.perf_counter() - t_trace - sum(prof_walls)
    print(f"trace captured and exported in {time.perf_counter() - t_trace:.1f} s", flush=True)
    rec["profiled_dispatch_ms_host"] = [t * 1e3 for t in prof_walls]
    rec["trace_dir"] = str(run_dir)

    perfetto = sorted(run_dir.rglob("perfetto_trace.json.gz"))
    tracejson = sorted(run_dir.rglob("*.trace.json.gz"))
    xplanes = sorted(run_dir.rglob("*.xplane.pb"))
    rec["trace_files"] = [str(p.relative_to(run_dir)) for p in perfetto + tracejson + xplanes]
    dims = {"hidden": cfg.hidden_size, "ffn": cfg.intermediate_size, "spec": args.spec,
            "pool_elems": eng.ecfg.total_pages() * args.page_size * cfg.num_kv_heads * cfg.head_dim,
            "weight_shapes": weight_shapes(cfg, dcfg)}
    sources = []
    if args.source in ("auto", "json"):
        sources += [("json", p) for p in (perfetto[-1:] or tracejson[-1:])]
    if args.source in ("auto", "xplane"):
        sources += [("xplane", p) for p in xplanes[-1:]]
    result = None
    for kind, path in sources:
        t_parse = time.perf_counter()
        try:
            events = read_json_trace(path) if kind == "json" else read_xplane(path)
        except Exception as e:  # noqa: BLE001 - try the next source
            rec["notes"].append(f"reading {path.name} failed: {e!r}")
            continue
        res = analyze_trace(events, hlo, dims, args.steps, copy_bytes)
        res["source"] = f"{kind}:{path.name}"
        res["parse_s"] = time.perf_counter() - t_parse
        print(f"{kind}: {len(events)} events read and analysed in {res['parse_s']:.1f} s, "
              f"{res['events_in_windows']} in the dispatch windows", flush=True)
        if res["events_in_windows"] == 0:
            rec["notes"].append(f"{path.name}: no device events inside the dispatch windows "
                                f"({res['events_kind']}, {res['events_outside_windows']} outside)")
            continue
        result = res
        break
    if result is None:
        rec["error"] = ("no device events found in the trace (perfetto JSON: "
                        f"{'requested' if started_perfetto else 'unsupported'}; files "
                        f"{rec['trace_files']}); see notes")
        save()
        print(rec["error"], file=sys.stderr)
        return rec
    rec["notes"] += result.pop("analysis_notes")
    if rec["backend"] != "cpu" and result["events_kind"] == "host":
        rec["warning"] = ("no accelerator stream tracks in the trace (CUPTI not loaded?): the "
                          "times below are host-side XLA thunk events, not kernel times")
        print("WARNING: " + rec["warning"], file=sys.stderr)
    rest = [(k, p) for k, p in sources if not result["source"].startswith(k)]
    if rest and not args.no_cross_check and time.perf_counter() - t_start < 150:
        kind, path = rest[-1]
        try:
            t_check = time.perf_counter()
            other = analyze_trace(read_json_trace(path) if kind == "json" else read_xplane(path),
                                  hlo, dims, args.steps, copy_bytes)
            rec["cross_check"] = {"source": f"{kind}:{path.name}", **{
                k: other.get(k) for k in ("events_kind", "events_in_windows", "busy_us_per_step",
                                          "kernel_sum_us_per_step", "wall_us_per_step",
                                          "unattributed_events")},
                "s": time.perf_counter() - t_check}
        except Exception as e:  # noqa: BLE001 - a check only
            rec["cross_check"] = f"failed: {e!r}"
    if perfetto and not args.no_trace_copy:
        size = perfetto[-1].stat().st_size
        if size <= 15 * 2**20:
            import shutil
            dst = out_path.with_name(out_path.stem + ".perfetto.json.gz")
            shutil.copyfile(perfetto[-1], dst)
            rec["perfetto_copy"] = dst.name
        else:
            rec["notes"].append(f"Perfetto JSON is {size / 2**20:.0f} MiB: not copied beside "
                                f"--out (see trace_dir)")
    rec.update(result)
    # Per-category bytes and bandwidth.
    kv_len = args.context + (args.steps + 1) / 2 if not args.spec else args.context + (args.steps - 1) / 2 + 1
    expect = analytic_bytes(cfg, dcfg, lanes, kv_len, args.spec, width)
    ceiling = result.get("copy_bandwidth_kernel_TBps") or rec.get("copy_bandwidth_host_timed_TBps")
    step_us = rec["step_ms_unprofiled"] * 1e3
    cats = []
    for name in sorted(set(result["categories"]) | set(expect),
                       key=lambda n: -result["categories"].get(n, {}).get("us_per_step", 0)):
        c = result["categories"].get(name, {"us_per_step": 0.0, "kernels_per_step": 0.0,
                                            "idle_before_us_per_step": 0.0, "hlo_bytes_per_step": 0})
        a = expect.get(name)
        b = a if a is not None else (c["hlo_bytes_per_step"] or None)
        gbs = b / (c["us_per_step"] * 1e-6) / 1e9 if b and c["us_per_step"] else None
        cats.append({"category": name, **c, "analytic_bytes_per_step": a,
                     "bytes_used": "analytic" if a is not None else ("hlo" if b else None),
                     "achieved_GBps": gbs,
                     "share_of_step": c["us_per_step"] / step_us if step_us else None,
                     "fraction_of_copy_bw": gbs / (ceiling * 1e3) if gbs and ceiling else None})
    rec["categories"] = cats
    total_bytes = sum(expect.values())
    rec["analytic_bytes_per_step"] = total_bytes
    rec["hbm_bound_us_at_4p3TBps"] = total_bytes / 4.3e12 * 1e6
    if ceiling:
        rec["hbm_bound_us_at_copy_bw"] = total_bytes / (ceiling * 1e12) * 1e6
    rec["gap_unprofiled_step_minus_busy_us"] = step_us - result["busy_us_per_step"]
    rec["notes"].append(
        "Under the profiler XLA runs command buffers op by op unless "
        "--xla_enable_command_buffers_during_profiling=true, so wall_us_per_step (profiled) "
        "carries more launch overhead than step_ms_unprofiled; kernel times are unaffected.")
    rec["notes"].append(
        "hlo_bytes: operand + result sizes of the HLO instruction (KV-pool-sized buffers left "
        "out); an upper bound for kernels that read parts of their operands (gathers, slices).")
    rec["total_s"] = time.perf_counter() - t_start
    save()
    print(markdown(rec, args.top))
    return rec


def _f(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def markdown(rec: dict, top: int = 25) -> str:
    step_us = rec["step_ms_unprofiled"] * 1e3
    unit = "iteration" if rec["mode"] == "spec" else "step"
    lines = [
        f"## {rec['mode']} {'iteration' if rec['mode'] == 'spec' else 'step'}: {rec['preset']} "
        f"{rec['dtype']}, {rec['lanes']} lane(s), context {rec['context']}, {rec['device']} "
        f"(jax {rec['jax']}, trace {rec.get('source')}, events: {rec.get('events_kind')})", "",
        *([f"- **WARNING: {rec['warning']}**"] if rec.get("warning") else []),
        f"- unprofiled: {step_us:.1f} us per {unit} (median of dispatches of "
        f"{rec['steps_per_dispatch']}); 'step' below means one {unit}",
        f"- profiled: wall {rec['wall_us_per_step']:.1f} us/step, device busy "
        f"{rec['busy_us_per_step']:.1f} us/step, kernel sum {rec['kernel_sum_us_per_step']:.1f}, "
        f"first-kernel span {rec['span_us_per_step']:.1f}",
        f"- unprofiled step - busy = {rec['gap_unprofiled_step_minus_busy_us']:.1f} us/step not "
        f"covered by device work (launch / host / sync gaps)",
        f"- analytic bytes {rec['analytic_bytes_per_step'] / 1e9:.3f} GB/step: "
        f"{rec['hbm_bound_us_at_4p3TBps']:.0f} us at 4.3 TB/s"
        + (f", {rec['hbm_bound_us_at_copy_bw']:.0f} us at the measured copy "
           f"{rec.get('copy_bandwidth_kernel_TBps') or rec.get('copy_bandwidth_host_timed_TBps'):.2f} TB/s"
           if rec.get("hbm_bound_us_at_copy_bw") else ""),
        f"- events: {rec['events_in_windows']} in windows, {rec['unattributed_events']} "
        f"unattributed, {rec['events_outside_windows']} outside", "",
        "| category | us/step | % of step | kernels/step | idle before us/step | MB/step | bytes | GB/s | % copy BW |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for c in rec["categories"]:
        b = c["analytic_bytes_per_step"] if c["analytic_bytes_per_step"] is not None else c["hlo_bytes_per_step"]
        lines.append(
            f"| {c['category']} | {c['us_per_step']:.1f} | {_f(100 * c['share_of_step'] if c['share_of_step'] is not None else None)} | "
            f"{c['kernels_per_step']:.1f} | {c['idle_before_us_per_step']:.1f} | {_f(b / 1e6 if b else None, '.2f')} | "
            f"{c['bytes_used'] or '-'} | {_f(c['achieved_GBps'], '.0f')} | "
            f"{_f(100 * c['fraction_of_copy_bw'] if c['fraction_of_copy_bw'] else None)} |")
    busy = rec["busy_us_per_step"]
    lines.append(f"| **device busy** | {busy:.1f} | {100 * busy / step_us:.1f} | | | | | | |")
    gap = rec["gap_unprofiled_step_minus_busy_us"]
    lines.append(f"| **not covered (step - busy)** | {gap:.1f} | {100 * gap / step_us:.1f} | | | | | | |")
    lines += ["", f"Top {top} kernels (family = name without numeric suffix):", "",
              "| kernel | category | calls/step | us/step | mean us | HLO MB/call | GB/s |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for k in rec["kernels"][:top]:
        mb = k["hlo_bytes_per_call"] / 1e6
        gbs = k["hlo_bytes_per_call"] / (k["mean_us"] * 1e-6) / 1e9 if k["mean_us"] else None
        lines.append(f"| {k['kernel'][:60]} | {k['category']} | {k['calls_per_step']:.2f} | "
                     f"{k['us_per_step']:.1f} | {k['mean_us']:.2f} | {mb:.2f} | {_f(gbs, '.0f')} |")
    idle = sorted(rec.get("hlo_ops", []), key=lambda o: -o.get("idle_before_us_per_step", 0))
    idle = [o for o in idle if o.get("idle_before_us_per_step", 0) > 0][:10]
    if idle:
        lines += ["", "Where the device waits (idle time before an op, inside the dispatch span):", "",
                  "| hlo op | category | idle before us/step | calls/step | op us/step |",
                  "|---|---|---:|---:|---:|"]
        lines += [f"| {o['hlo_op'][:50]} | {o['category']} | {o['idle_before_us_per_step']:.1f} | "
                  f"{o['calls_per_step']:.2f} | {o['us_per_step']:.1f} |" for o in idle]
    cc = rec.get("cross_check")
    if isinstance(cc, dict):
        lines += ["", f"cross-check ({cc['source']}): {cc['events_in_windows']} events, busy "
                  f"{_f(cc['busy_us_per_step'])} us/step, kernel sum "
                  f"{_f(cc['kernel_sum_us_per_step'])}, wall {_f(cc['wall_us_per_step'])}"]
    elif cc:
        lines += ["", f"cross-check: {cc}"]
    if rec.get("notes"):
        lines += [""] + [f"note: {n}" for n in rec["notes"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
