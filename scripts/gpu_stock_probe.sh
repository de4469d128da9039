#!/usr/bin/env bash
# Is the 8B decode step launch-bound? Stock step time and the time until the jitted call returns
# (the host's launch work), under XLA command-buffer (CUDA graph) settings, on the GPU machine:
#
#   bash scripts/gpu_stock_probe.sh [VARIANT ...]     (default: default legacy off)
#
#   default  XLA's own command buffers (fusions, GEMMs, FFI custom calls; loops not captured);
#            jax-triton kernels through the FFI target (kernels/triton_ffi.py, JSPEC_TRITON_FFI=auto)
#   legacy   default, with jax-triton's legacy custom call (JSPEC_TRITON_FFI=0: never captured)
#   off      --xla_gpu_enable_command_buffer=        (every kernel launched by the host)
#   loop     + WHILE and CONDITIONAL, min graph size 1 (the whole decode fori_loop as one graph)
#   unroll   loop + --xla_gpu_command_buffer_unroll_loops=true
#
# Each variant is its own process (XLA_FLAGS are read once): scripts/bench_steps.py at 1 lane,
# context 512, 16 steps per dispatch, random Qwen3-8B weights, with $PROBE_ARGS (default
# "--batch-invariant": the bench's configuration) and --skip-spec unless SPEC=1. A variant whose
# flags this jaxlib rejects fails alone. Records: $OUT/probe-<variant>.json and .log.
# If call_ms_per_step is close to step_ms, the host's launching sets the pace; if graphs bring
# step_ms down, launch overhead was on the critical path.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE_XLA_FLAGS=${XLA_FLAGS:-}  # every variant adds its flags to these
. scripts/device_env.sh

OUT=${OUT:-/tmp/out}
PROBE_ARGS=${PROBE_ARGS:---batch-invariant}
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(default legacy off)
LOOP="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
spec=--skip-spec
[ "${SPEC:-0}" = 1 ] && spec="--spec-lanes 1"

for v in "${variants[@]}"; do
  ffi=auto
  case "$v" in
    default) flags="" ;;
    legacy) flags="" ffi=0 ;;
    off) flags="--xla_gpu_enable_command_buffer=" ;;
    loop) flags="$LOOP" ;;
    unroll) flags="$LOOP --xla_gpu_command_buffer_unroll_loops=true" ;;
    *) echo "gpu_stock_probe: unknown variant $v (default | legacy | off | loop | unroll)" >&2; exit 2 ;;
  esac
  t0=$SECONDS
  # shellcheck disable=SC2086
  all_flags=$(echo ${BASE_XLA_FLAGS:-} $flags)  # XLA reads a value not starting with -- as a file
  (
    if [ -n "$all_flags" ]; then export XLA_FLAGS="$all_flags"; else unset XLA_FLAGS; fi
    export JSPEC_TRITON_FFI=$ffi
    # shellcheck disable=SC2086
    timeout "${VARIANT_TIMEOUT:-200}" python3 scripts/bench_steps.py \
      --out "$OUT/probe-$v.json" --lanes 1 --contexts 512 --steps 16 $spec $PROBE_ARGS
  ) > "$OUT/probe-$v.log" 2>&1
  echo "gpu_stock_probe: $v rc=$? in $((SECONDS - t0)) s  (XLA_FLAGS=$flags JSPEC_TRITON_FFI=$ffi)"
  grep -h '^stock\|^spec' "$OUT/probe-$v.log" | tail -n 2
done
