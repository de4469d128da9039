"""Kernels behind small interfaces, each with an XLA reference twin (attention, linear layers,
row reductions).

    ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, *, sm_scale,
                           causal=True, max_q_len=None, impl="auto")
    write_kv(k_pages, v_pages, k_new, v_new, slot_mapping)

Modules:
  ragged_paged_attention.py         the interface, dispatch and the XLA reference (CPU path, oracle)
  ragged_paged_attention_triton.py  the GPU kernel (Triton via jax-triton); imports triton, so it
                                    is imported only when impl="triton" is chosen
  kv_cache_write.py                 write_kv, a plain XLA scatter into the page pools
  linear.py                         the model's matmuls: linear(x, w, impl) with its XLA twin
  linear_triton.py                  batch-invariant Triton matmul (a row's bits never depend on
                                    the row count), for EngineConfig.batch_invariant on the GPU
  reductions.py                     the model's row reductions: rms_norm(x, w, eps, out_dtype,
                                    impl), logsumexp(x, impl) and token_logprobs, with XLA twins
  rowwise_triton.py                 batch-invariant Triton RMSNorm and logsumexp (one program per
                                    row, a fixed order), the batch_invariant partners of linear

TPU: no Pallas TPU kernel yet; impl="pallas_tpu" raises NotImplementedError and impl="auto" on a
TPU uses the XLA reference. Why not now: the GPU kernel came first and the Pallas TPU version is a
different program, not a port (Mosaic TPU wants (8, 128)-aligned blocks and DMAs pages from HBM
into VMEM with `pltpu.make_async_copy` double-buffering, driven by scalar-prefetched page tables;
the GPU kernel gathers token rows with pointer arithmetic). Its interpret mode runs on CPU, so it
can be tested there against the XLA reference exactly like the Triton kernel. The straightest
route is JAX's own `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (present in jax 0.10.2),
which has nearly this contract (q [T, Hq, D], kv_lens, page_indices, cu_q_lens, num_seqs) but
(a) its own KV layout, K and V interleaved on the head axis of one pool [P, S, 2 * Hkv, D], so
the pool layout behind write_kv would change (re-interleaving per call would copy the whole pool
every layer and step), (b) causal masking only (the drafter's non-causal block would stay on
XLA), and (c) no `interpret` switch on its entry point, so a CPU test would need its kernel body
driven through pallas_call(interpret=True) by hand.
"""

from jspec.kernels.kv_cache_write import write_kv
from jspec.kernels.ragged_paged_attention import (ragged_paged_attention,
                                                  ragged_paged_attention_xla)

__all__ = ["ragged_paged_attention", "ragged_paged_attention_xla", "write_kv"]
