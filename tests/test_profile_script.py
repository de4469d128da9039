"""scripts/profile_steps.py: the trace parsing on a GPU-shaped trace (synthetic, both the Perfetto
JSON and the XPlane reader), and one real CPU run of the script on a tiny model."""

import gzip
import json
from pathlib import Path

import pytest

from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent


ps = load_script("profile_steps")

# A compiled-GPU-style module: the weight reaches a cuBLAS gemm through bitcast / GTE / while /
# tuple; a loop fusion in the sampler's scope; the Triton attention custom call (two kernels).
HLO = """HloModule jit__decode, entry_computation_layout={(bf16[8,16,64]{2,1,0}, bf16[1,64]{1,0})->bf16[1,64]{1,0}}

%fused_add (param_0: bf16[1,64], param_1: bf16[1,64]) -> bf16[1,64] {
  %param_0 = bf16[1,64]{1,0} parameter(0)
  %param_1 = bf16[1,64]{1,0} parameter(1)
  ROOT %add.1 = bf16[1,64]{1,0} add(%param_0, %param_1), metadata={op_name="jit(_decode)/while/body/closed_call/px_sampling/add"}
}

%body (arg: (s32[], bf16[1,64], bf16[8,16,64])) -> (s32[], bf16[1,64], bf16[8,16,64]) {
  %arg = (s32[], bf16[1,64]{1,0}, bf16[8,16,64]{2,1,0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%arg), index=0
  %gte.1 = bf16[1,64]{1,0} get-tuple-element(%arg), index=1
  %gte.2 = bf16[8,16,64]{2,1,0} get-tuple-element(%arg), index=2
  %bitcast.5 = bf16[128,64]{1,0} bitcast(%gte.2)
  %custom-call.3 = (bf16[1,128]{1,0}, s8[4194304]{0}) custom-call(%gte.1, %bitcast.5), custom_call_target="__cublas$gemm", metadata={op_name="jit(_decode)/while/body/closed_call/px_qkv/dot_general"}
  %loop_add_fusion.2 = bf16[1,64]{1,0} fusion(%gte.1, %gte.1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(_decode)/while/body/closed_call/px_sampling/add"}
  %custom-call.7 = bf16[1,64]{1,0} custom-call(%loop_add_fusion.2), custom_call_target="triton_kernel_call", metadata={op_name="jit(_decode)/while/body/closed_call/px_attention/triton_kernel_call"}
  ROOT %tuple.1 = (s32[], bf16[1,64]{1,0}, bf16[8,16,64]{2,1,0}) tuple(%gte.0, %custom-call.7, %gte.2)
}

%cond (arg.1: (s32[], bf16[1,64], bf16[8,16,64])) -> pred[] {
  %arg.1 = (s32[], bf16[1,64]{1,0}, bf16[8,16,64]{2,1,0}) parameter(0)
  %gte.c = s32[] get-tuple-element(%arg.1), index=0
  %constant.9 = s32[] constant(4)
  ROOT %compare.1 = pred[] compare(%gte.c, %constant.9), direction=LT
}

ENTRY %main.5 (params__layers___0___self_attn____q_proj___value.1: bf16[8,16,64], x.1: bf16[1,64]) -> bf16[1,64] {
  %params__layers___0___self_attn____q_proj___value.1 = bf16[8,16,64]{2,1,0} parameter(0)
  %x.1 = bf16[1,64]{1,0} parameter(1)
  %constant.1 = s32[] constant(0)
  %tuple.0 = (s32[], bf16[1,64]{1,0}, bf16[8,16,64]{2,1,0}) tuple(%constant.1, %x.1, %params__layers___0___self_attn____q_proj___value.1)
  %while.1 = (s32[], bf16[1,64]{1,0}, bf16[8,16,64]{2,1,0}) while(%tuple.0), condition=%cond, body=%body
  ROOT %gte.r = bf16[1,64]{1,0} get-tuple-element(%while.1), index=1
}
"""

DIMS = {"hidden": 64, "ffn": 160, "spec": False, "pool_elems": 10**9, "weight_shapes": {}}

# Per dispatch (one step each): gemm 10 us (annotation in the XLA style), loop fusion 2 us
# (named only by its kernel name), Triton attention fwd 3 us + merge 1 us (hlo_op stat), a 1 us
# D2H memcpy, an unknown kernel; a kernel of another module is ignored.
KERNELS = [
    # (name, start offset, dur, args)
    ("sm90_xmma_gemm_bf16bf16_bf16f32", 10.0, 10.0,
     {"annotation": "custom-call.3:#hlo_op=custom-call.3,hlo_module=jit__decode,program_id=5#"}),
    ("loop_add_fusion_2", 25.0, 2.0, {}),
    ("_rpa_fwd_kernel", 30.0, 3.0, {"hlo_op": "custom-call.7", "hlo_module": "jit__decode"}),
    ("_rpa_merge_kernel", 33.0, 1.0, {"hlo_op": "custom-call.7", "hlo_module": "jit__decode"}),
    ("MemcpyD2H", 40.0, 1.0, {"hlo_op": "while.1"}),
    ("mystery_kernel", 45.0, 1.0, {}),
    ("other_module_kernel", 50.0, 5.0, {"hlo_op": "fusion.1", "hlo_module": "jit_other"}),
]
WINDOWS = [(0.0, 100.0), (200.0, 100.0)]


def _gpu_json(path: Path):
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 1, "tid": 13, "name": "thread_name",
           "args": {"name": "Stream #13(Compute,MemcpyD2H)"}},
          {"ph": "M", "pid": 1, "tid": 99, "name": "thread_name", "args": {"name": "XLA Ops"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "python3"}}]
    for i, (t0, dur) in enumerate(WINDOWS):
        ev.append({"ph": "X", "pid": 2, "tid": 1, "ts": t0, "dur": dur, "name": f"profile_dispatch_{i}"})
        for name, off, d, args in KERNELS:
            ev.append({"ph": "X", "pid": 1, "tid": 13, "ts": t0 + off, "dur": d, "name": name,
                       "args": dict(args)})
            # A derived "XLA Ops" line duplicates the stream: must not be counted twice.
            ev.append({"ph": "X", "pid": 1, "tid": 99, "ts": t0 + off, "dur": d, "name": name})
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": ev}, f)


def _check_gpu_result(res):
    assert res["events_kind"] == "gpu"
    assert res["dispatches"] == 2 and res["steps"] == 2
    assert res["events_other_modules"] == 2
    cats = res["categories"]
    assert cats["qkv_proj"]["us_per_step"] == pytest.approx(10.0)
    assert cats["sampling"]["us_per_step"] == pytest.approx(2.0)
    assert cats["attention"]["us_per_step"] == pytest.approx(4.0)
    assert cats["attention"]["kernels_per_step"] == pytest.approx(2.0)
    assert cats["memcpy/memset"]["us_per_step"] == pytest.approx(1.0)
    assert cats["unattributed:other"]["us_per_step"] == pytest.approx(1.0)
    # gemm bytes: weight 8*16*64 bf16 + x + out (the cuBLAS workspace is not counted)
    assert cats["qkv_proj"]["hlo_bytes_per_step"] == 8 * 16 * 64 * 2 + 64 * 2 + 128 * 2
    # The two attention kernels share one execution's bytes (in 64 + out 64, bf16).
    assert cats["attention"]["hlo_bytes_per_step"] == pytest.approx(2 * 64 * 2)
    assert res["busy_us_per_step"] == pytest.approx(18.0)
    assert res["kernel_sum_us_per_step"] == pytest.approx(18.0)
    assert res["wall_us_per_step"] == pytest.approx(100.0)
    assert res["span_us_per_step"] == pytest.approx(36.0)
    # idle gaps: 10 before the gemm is the lead (not counted), then 3 + 3 + 6 + 4 inside the span
    assert res["idle_inside_span_us_per_step"] == pytest.approx(18.0)
    assert cats["sampling"]["idle_before_us_per_step"] == pytest.approx(5.0)
    assert res["launch_lead_us_per_dispatch"] == pytest.approx(10.0)
    ops = {o["hlo_op"]: o for o in res["hlo_ops"]}
    assert ops["custom-call.3"]["weights"] == ["params__layers___0___self_attn____q_proj___value.1"]
    assert ops["custom-call.3"]["by"] == "weight"


def test_gpu_trace_json(tmp_path):
    path = tmp_path / "perfetto_trace.json.gz"
    _gpu_json(path)
    res = ps.analyze_trace(ps.read_json_trace(path), ps.parse_hlo(HLO), DIMS, steps_per_dispatch=1)
    _check_gpu_result(res)


def test_gpu_trace_xplane():
    from jax.profiler import ProfileData
    if not hasattr(ProfileData, "from_text_proto"):
        pytest.skip("ProfileData.from_text_proto missing in this jaxlib")
    names = ["profile_dispatch_0", "profile_dispatch_1"] + [k[0] for k in KERNELS]
    stat_names = ["annotation", "hlo_op", "hlo_module"]

    def stats(args):
        return "".join(f' stats {{ metadata_id: {stat_names.index(k) + 1} str_value: "{v}" }}'
                       for k, v in args.items())

    host_events = "".join(
        f" events {{ metadata_id: {i + 1} offset_ps: {int(t0 * 1e6)} duration_ps: {int(d * 1e6)} }}"
        for i, (t0, d) in enumerate(WINDOWS))
    dev_events = "".join(
        f" events {{ metadata_id: {names.index(n) + 1} offset_ps: {int((t0 + off) * 1e6)} "
        f"duration_ps: {int(d * 1e6)}{stats(a)} }}"
        for t0, _ in WINDOWS for n, off, d, a in KERNELS)
    meta = "".join(f' event_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{n}" }} }}'
                   for i, n in enumerate(names))
    smeta = "".join(f' stat_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{n}" }} }}'
                    for i, n in enumerate(stat_names))
    text = (f'planes {{ id: 1 name: "/host:CPU" lines {{ id: 1 name: "python3" timestamp_ns: 0'
            f'{host_events} }}{meta}{smeta} }} '
            f'planes {{ id: 2 name: "/device:GPU:0" lines {{ id: 13 name: "Stream #13(Compute)" '
            f'timestamp_ns: 0{dev_events} }}{meta}{smeta} }}')
    data = ProfileData.from_text_proto(text)
    events = ps.xplane_events(data)
    res = ps.analyze_trace(events, ps.parse_hlo(HLO), DIMS, steps_per_dispatch=1)
    _check_gpu_result(res)


def test_entry_source_and_weight_kind():
    hlo = ps.parse_hlo(HLO)
    assert hlo["module"] == "jit__decode" and hlo["entry"] == "main.5"
    src = ps.entry_source(hlo, "bitcast.5")
    assert src == "params__layers___0___self_attn____q_proj___value.1"
    assert ps.weight_kind(src, ("bf16", (8, 16, 64)), DIMS) == "qkv_proj"
    assert ps.entry_source(hlo, "loop_add_fusion.2") is None


def test_profile_steps_cpu(tmp_path):
    """The whole script on a tiny model on the CPU: XLA:CPU thunk events on host threads."""
    out = tmp_path / "prof.json"
    rec = ps.main(["--out", str(out), "--preset", "tiny-untied", "--context", "40", "--steps", "3",
                   "--dispatches", "2", "--reps", "1", "--copy-mib", "1", "--top", "5",
                   "--top-k", "20", "--top-p", "0.8"])  # Qwen3's filtering, as the bench's qwen
    disk = json.loads(out.read_text())
    assert (disk["top_k"], disk["top_p"]) == (20, 0.8)
    assert disk["step_ms_unprofiled"] == pytest.approx(rec["step_ms_unprofiled"])
    assert "error" not in disk, disk.get("notes")
    assert disk["events_kind"] == "host" and disk["dispatches"] == 2 and disk["steps"] == 6
    assert disk["kernels"] and all(k["us_per_step"] >= 0 for k in disk["kernels"])
    assert sum(k["us_per_step"] for k in disk["kernels"]) > 0
    assert disk["unattributed_events"] == 0
    cats = {c["category"]: c for c in disk["categories"]}
    # The scopes and the weight tracing find the model's pieces.
    for name in ("qkv_proj", "o_proj", "gate_up", "down", "lm_head", "attention", "sampling"):
        assert cats[name]["us_per_step"] > 0, name
        assert cats[name]["kernels_per_step"] > 0, name
    wall = disk["wall_us_per_step"]
    assert 0 < disk["busy_us_per_step"] <= wall * 1.05
    assert disk["busy_us_per_step"] <= disk["span_us_per_step"] * 1.0001 <= wall * 1.05
    # Kernel times overlap only across threads (XLA:CPU runs independent thunks concurrently).
    assert disk["kernel_sum_us_per_step"] <= wall * max(1, disk["device_track_count"]) * 1.05
    assert sum(c["us_per_step"] for c in disk["categories"]) == pytest.approx(
        disk["kernel_sum_us_per_step"], rel=1e-6)
    assert Path(disk["trace_dir"]).is_dir()
