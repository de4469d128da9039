"""Kernels behind small interfaces, each with an XLA reference twin (attention, linear layers,
row reductions).

    ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, *, sm_scale,
                           causal=True, max_q_len=None, impl="auto")
    write_kv(k_pages, v_pages, k_new, v_new, slot_mapping)

Modules:
  ragged_paged_attention.py         the interface, dispatch and the XLA reference (CPU path, oracle)
  ragged_paged_attention_triton.py  the GPU kernel (Triton via jax-triton); imports triton, so it
                                    is imported only when impl="triton" is chosen
  ragged_paged_attention_pallas_tpu.py  the TPU kernel (Pallas Mosaic; see TPU below)
  kv_cache_write.py                 write_kv, a plain XLA scatter into the page pools
  linear.py                         the model's matmuls: linear(x, w, impl) with its XLA twin,
                                    and linear_partials (the split-K partials left uncombined)
  linear_triton.py                  batch-invariant Triton matmul (a row's bits never depend on
                                    the row count), for EngineConfig.batch_invariant on the GPU
  reductions.py                     the model's row reductions: rms_norm(x, w, eps, out_dtype,
                                    impl), add_rms_norm (the residual add, then the norm),
                                    qk_norm_rope, logsumexp(x, impl) and token_logprobs, with XLA
                                    twins
  rowwise_triton.py                 batch-invariant Triton RMSNorm (alone or with the residual
                                    add), q/k norm + RoPE and logsumexp (one program per row, a
                                    fixed order), the batch_invariant partners of linear
  triton_ffi.py                     every jax-triton call goes through it: jax-triton's legacy
                                    custom call rewritten to jaxlib's command-buffer-compatible
                                    FFI target (JSPEC_TRITON_FFI=auto|1|0)

TPU: ragged_paged_attention_pallas_tpu.py is the Pallas TPU (Mosaic) kernel behind
impl="pallas_tpu": grid (lanes, kv heads), kv_lens / page table / cu_q_lens scalar-prefetched,
each lane's queries packed with XLA ops into one [max_q_len * G, D] block per kv head (the Triton
kernel's GQA packing), K/V pages left in HBM and DMA'd page by page into double-buffered VMEM with
`pltpu.make_async_copy`, online softmax in fp32, fp8 pages widened on load. It is a separate
program, not a port of the Triton kernel, and keeps this repo's pool layout ([P, S, Hkv, D], K and
V in two pools, non-causal supported), unlike jax's own
`jax.experimental.pallas.ops.tpu.ragged_paged_attention` (interleaved K/V pool, causal only).
It is tested only in TPU interpret mode on CPU (pltpu.InterpretParams, tests/
test_kernels_pallas_tpu.py) against the XLA reference; Mosaic compilation, layouts and
performance on a real TPU are unchecked, so impl="auto" on a TPU still uses the XLA reference, and
impl="pallas_tpu" off a TPU raises unless JSPEC_PALLAS_TPU_INTERPRET=1 (interpret mode, slow).
"""



def _hand_over_to_hub_kernels():
    """This directory ships as `jspec.kernels`, but `python -m ...` run from the repo root puts the
    root on sys.path, where `kernels/` would shadow Hugging Face's `kernels` package (a dependency
    of transformers >= 5.2x, which imports it at start-up). Load that package in our place."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != repo_root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", others)
    if spec is None or spec.loader is None:
        raise ImportError(f"`import kernels` found jspec's {os.path.dirname(os.path.abspath(__file__))}"
                          " (import it as jspec.kernels) and no other package named `kernels`")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns what sys.modules holds
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_to_hub_kernels()
else:
    from jspec.kernels.kv_cache_write import write_kv
    from jspec.kernels.ragged_paged_attention import (ragged_paged_attention,
                                                      ragged_paged_attention_xla)

__all__ = ["ragged_paged_attention", "ragged_paged_attention_xla", "write_kv"]
