"""The stock serving engine: host scheduler over the jitted paged programs.

The host owns the truth about lanes (which request, its pages, its length) and does only the
bookkeeping between dispatches: admitting waiting requests into free lanes, reserving pages for
the next window of `decode_steps` tokens, preempting when the pool runs dry, and retiring
finished requests. Each decode dispatch runs `decode_steps` tokens for all lanes on the device
with no host synchronisation in between, and where it can the engine launches the next dispatch
before reading the last one's tokens (EngineConfig.lookahead).

Preemption is by recomputation: a preempted request frees its pages and returns to the front of
the queue; when readmitted, its prompt and the tokens it already produced are prefilled again
and decoding continues. Sampling keys depend only on (seed, position), so it continues with the
same random stream.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.config import Qwen3Config
from jspec.draft_vocab import DraftVocab, choose_ids
from jspec.draft_weights import DRAFT_WEIGHT_DTYPES, quantize_drafter_state, quantize_int8
from jspec.kernels.linear import LINEAR_IMPLS, check_impl, require_triton_gpu
from jspec.paged_cache import NULL_PAGE, CacheShape, PageAllocator, init_kv_caches
from jspec.qwen3 import Qwen3, fuse_projections
from jspec.rejection import check_rule
from jspec.sampling import SamplingArrays
from jspec.steps import DecodeState, StockPrograms


# The smallest padded prefill (EngineConfig.prefill_sizes): below ~64 rows a forward costs about
# what 64 rows cost (the weights are read once either way), and each size is one more compile.
MIN_PREFILL_BUCKET = 64


@functools.lru_cache(maxsize=16)
def shared_programs(kind, *static):
    """One set of jitted programs per (model structure, cache geometry, eos ids, ...): engines
    with the same static configuration share compiled executables instead of recompiling."""
    return kind(*static)


@dataclasses.dataclass
class Request:
    """One generation request and everything the engine learns about it."""
    prompt_ids: list[int]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 256
    stop_on_eos: bool = True
    request_id: int = 0
    # Filled by the engine.
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "eos" | "length" | "stop" (set by a stop checker)
    num_preemptions: int = 0
    # Speculative statistics: tokens committed by each verify step of this request.
    step_tokens: list[int] = dataclasses.field(default_factory=list)
    # Drafts each of those verify steps verified (the confidence gate may verify fewer than K).
    step_drafts: list[int] = dataclasses.field(default_factory=list)
    # Scheduling state.
    lane: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    admitted_at: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def tokens_per_step(self) -> float | None:
        """Mean tokens per verify step (bonus included); None without speculation."""
        return sum(self.step_tokens) / len(self.step_tokens) if self.step_tokens else None

    def acceptance_per_position(self, num_draft: int) -> list[float]:
        """Share of verify steps whose k-th draft was accepted, k = 1..num_draft."""
        n = len(self.step_tokens)
        return [sum(t - 1 >= k for t in self.step_tokens) / n if n else 0.0
                for k in range(1, num_draft + 1)]


# Drafter KV pool dtypes: None (the model's) or fp8 e4m3 (the format the kernels widen exactly).
DRAFT_KV_DTYPES = (None, "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_lanes: int = 8
    page_size: int = 16
    max_context: int = 4096  # prompt + generated tokens of one request
    num_pages: int | None = None  # default: every lane can reach max_context at once
    prefill_chunk: int = 256
    # A prompt's last (or only) chunk is padded to the smallest of these sizes that holds it
    # instead of to prefill_chunk: a 60-token prompt runs a 64-row forward, not a 256-row one.
    # Each size is one more compiled prefill (Engine.precompile_prefill compiles them all).
    prefill_buckets: bool = True
    decode_steps: int = 16  # decode steps (or speculative iterations) per dispatch
    attn_impl: str = "auto"
    # GPU only: the target's matmuls and attention through batch-invariant kernels, so that a
    # verify row and a decode row compute the same bits (kernels/linear.py).
    batch_invariant: bool = False
    # With batch_invariant: prefill through the batch-invariant kernels too. Off (the default),
    # prefill's matmuls and RMSNorms run XLA's (cuBLAS GEMMs): a prompt's chunk is one lane's,
    # so its bits never depend on the batch either way, and both engines of a comparison
    # prefill the same prompt the same way. What invariance buys is verify == decode; no
    # prefill row is ever compared with a decode row. (A preempted request's re-prefill does
    # not reproduce decode's bits on either route: the attention's invariant plan covers at
    # most 8 queries a lane.)
    invariant_prefill: bool = False
    # The drafter's KV pool dtype: None = the model dtype; "float8_e4m3fn" halves the pool (bf16).
    # It changes only what the drafter proposes (acceptance), never the output distribution: the
    # target's pool, the verifier and the rejection sampler are untouched. Writes clip to the
    # format's finite range (kernels/kv_cache_write.py); reads widen pages to the query dtype.
    # Ignored by a stock engine (no drafter pool): one EngineConfig is shared by the stock and
    # speculative engines of a comparison (jspec bench builds both from one base), and a stock
    # engine computes the same bits with or without it. LLM refuses it without a drafter.
    draft_kv_dtype: str | None = None
    # The drafter's big weights (its layers' projections, fc, Markov W2): None = the model
    # dtype; "int8" stores them as int8 with a scale per output channel, each matmul scaling its
    # output (jspec/draft_weights.py), plus an int8 copy of the head rows the drafter reads:
    # about half the bytes an iteration reads for them. As with draft_kv_dtype, only the
    # proposals change, never the output law; a stock engine ignores it.
    draft_weight_dtype: str | None = None
    # The drafter's matmul route (its layers' projections, fc, context K/V, Markov W2 and its
    # int8 head rows; kernels/linear.py): "xla" (XLA's GEMMs; int8 weights as a convert fused
    # into the GEMM's operand load) or "triton" (jspec's linear kernel, GPU only, which also
    # reads int8 weights itself, widening each tile as it loads it). The drafter's norms stay
    # on XLA either way. Only the proposals' speed (and, through rounding, the proposals) may
    # change, never the output law; a stock engine ignores it.
    draft_linear: str = "xla"
    # The decode step loop stops once every lane has ended (steps.Programs), so a dispatch
    # wastes no steps after its replies end; it is compiled with WHILE / CONDITIONAL command
    # buffers so that XLA may run the loop as one CUDA graph (not yet confirmed on the H200:
    # docs/benchmarks.md). False: a fixed-count loop driven from the host.
    device_loop: bool = True
    # Launch the next dispatch before reading this one's tokens, from the state this one leaves
    # on the device, so the device never waits for the host's bookkeeping between dispatches.
    # Only while no request waits for a lane (or with one lane), and when the pool holds the
    # next two windows of every lane without preempting (Engine._may_look_ahead).
    lookahead: bool = True
    # With lookahead, also look ahead while requests wait for a lane and after lanes end. The
    # requests admitted into the lanes a read dispatch freed join the dispatch after the one
    # already running: their prefills are launched behind it and their first tokens stay on the
    # device, merged into the carried state (Engine._merged_state). A lane that ends then idles
    # through one dispatch instead of being refilled at once; in exchange the device does not
    # wait for the host's admission and launch between dispatches. The outputs are the same
    # either way. Off: the behaviour every benchmark until 2026-12-06 measured.
    lookahead_admission: bool = False
    # The drafter proposes only the N most frequent token ids (jspec/draft_vocab.py): its head
    # and sampling steps shrink; the output law is unchanged, acceptance may fall. None: every
    # id. Needs the ranking (Engine's draft_vocab_ids); a stock engine ignores it.
    draft_vocab: int | None = None
    # DSpark's prefix rule (jspec/spec_steps.py): each lane verifies the drafts whose cumulative
    # confidence c_1 ... c_k is at least this, and the target runs over the smallest static row
    # count that holds the lanes' rows. Lossless at any value; 0 verifies every draft (the
    # programs of before). Needs a drafter with a confidence head; a stock engine ignores it.
    verify_threshold: float = 0.0
    # How the verifier decides the accept length (jspec/rejection.py): "block" (block
    # verification: the whole block at once; never fewer accepted drafts in expectation) or
    # "token" (draft by draft). Both are lossless. A stock engine ignores it.
    verify_rule: str = "block"

    # Positions a step may write past the committed length (verify writes K+1); set by Engine.
    step_width: int = 1

    def __post_init__(self):
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1 (None: the whole vocabulary), got "
                             f"{self.draft_vocab}")
        if self.draft_kv_dtype not in DRAFT_KV_DTYPES:
            raise ValueError(f"draft_kv_dtype must be one of {DRAFT_KV_DTYPES} (None: the model "
                             f"dtype), got {self.draft_kv_dtype!r}")
        if self.draft_weight_dtype not in DRAFT_WEIGHT_DTYPES:
            raise ValueError(f"draft_weight_dtype must be one of {DRAFT_WEIGHT_DTYPES} (None: the "
                             f"model dtype), got {self.draft_weight_dtype!r}")
        if self.draft_linear not in LINEAR_IMPLS:
            raise ValueError(f"draft_linear must be one of {LINEAR_IMPLS}, got "
                             f"{self.draft_linear!r}")
        if self.invariant_prefill and not self.batch_invariant:
            raise ValueError("invariant_prefill needs batch_invariant (without it every route is "
                             "XLA's)")
        check_rule(self.verify_rule, "verify_rule")
        if self.lookahead_admission and not self.lookahead:
            raise ValueError("lookahead_admission needs lookahead")
        if not 0.0 <= self.verify_threshold < 1.0:
            raise ValueError(f"verify_threshold must be in [0, 1) (0: verify every draft), got "
                             f"{self.verify_threshold}")

    def prefill_sizes(self) -> tuple[int, ...]:
        """Padded prefill lengths, ascending; the last is prefill_chunk. The smaller ones are
        prefill_chunk / 2, / 4 and / 8 while they stay >= MIN_PREFILL_BUCKET rows."""
        sizes = {self.prefill_chunk}
        if self.prefill_buckets:
            for div in (2, 4, 8):
                if self.prefill_chunk % div == 0 and self.prefill_chunk // div >= MIN_PREFILL_BUCKET:
                    sizes.add(self.prefill_chunk // div)
        return tuple(sorted(sizes))

    @property
    def pages_per_lane(self) -> int:
        return -(-(self.max_context + self.step_width) // self.page_size)

    def total_pages(self) -> int:
        return self.num_pages or self.max_lanes * self.pages_per_lane + 1


def draft_head_int8(params: tuple, target) -> tuple:
    """(target, drafter[, vocab]) -> (target, drafter, vocab | None, head): with a draft
    vocabulary its head and Markov rows become Int8Weight (head None); without one, head is an
    int8 copy of the target's whole lm_head [V, D] (0.62 GB at Qwen3-8B size, beside the bf16
    one that verify reads)."""
    vocab = params[2] if len(params) > 2 else None
    if vocab is not None:
        w2 = None if vocab.markov_w2 is None else quantize_int8(vocab.markov_w2, (1,))
        return params[:2] + (DraftVocab(vocab.ids, quantize_int8(vocab.head, (1,)), w2), None)
    return params[:2] + (None, quantize_int8(target.head_weight(), (1,)))


class Engine:
    def __init__(self, cfg: Qwen3Config, model: Qwen3, eos_ids: Sequence[int],
                 engine_cfg: EngineConfig = EngineConfig(), drafter=None, draft_cfg=None,
                 num_draft: int | None = None, draft_vocab_ids: Sequence[int] | None = None):
        """Stock decoding, or speculative decoding when a DSpark/DFlash `drafter` is given.
        `draft_vocab_ids`: token ids ranked by frequency, most frequent first, from which
        `engine_cfg.draft_vocab` cuts the draft vocabulary (draft_vocab.read_ranked_ids).

        The engine takes the modules over: it puts them in the serving layout in place
        (`qwen3.fuse_projections`; `unfuse_projections` restores the checkpoint layout)."""
        self.cfg = cfg
        if engine_cfg.max_context > cfg.max_position_embeddings:
            raise ValueError(f"max_context {engine_cfg.max_context} exceeds the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
        self.eos_ids = tuple(eos_ids)
        self.draft_cfg = draft_cfg
        self.num_draft = 0
        if drafter is not None:
            self.num_draft = draft_cfg.block_size if num_draft is None else num_draft
            if not 1 <= self.num_draft <= draft_cfg.block_size:
                raise ValueError(f"num_draft_tokens must be in 1..{draft_cfg.block_size} (the "
                                 f"drafter's block size), got {self.num_draft}")
        # Positions one step writes past the committed length: verify's K+1, or the draft
        # block when it is wider (its keys are written past the committed length too).
        width = max(self.num_draft + 1, draft_cfg.block_size) if drafter is not None else 1
        self.ecfg = engine_cfg = dataclasses.replace(engine_cfg, step_width=width)
        linear_impl, attn_impl = "xla", engine_cfg.attn_impl
        if engine_cfg.batch_invariant:
            check_impl("triton")
            if attn_impl not in ("auto", "triton", "triton_invariant"):
                raise ValueError(f"batch_invariant needs the Triton attention kernel, not {attn_impl!r}")
            linear_impl, attn_impl = "triton", "triton_invariant"
        prefill_impl = linear_impl if engine_cfg.invariant_prefill else "xla"
        # Serving layout, in place (idempotent); the module attributes become part of the graphdef
        # split below, so an engine built later with other choices does not change this one.
        # A prefill on another route gets its own graphdef over the same parameters.
        prefill_graphdef = None
        if prefill_impl != linear_impl:
            fuse_projections(model, linear_impl=prefill_impl)
            prefill_graphdef = nnx.split(model)[0]
        fuse_projections(model, linear_impl=linear_impl)
        if drafter is not None:
            if engine_cfg.draft_linear == "triton":
                require_triton_gpu("draft_linear='triton' (the drafter's matmuls on jspec's "
                                   "linear kernel)")
            fuse_projections(drafter, qkv=False, linear_impl=engine_cfg.draft_linear,
                             norm_impl="xla")
            drafter.fuse_context_kv()
        graphdef, target_params = nnx.split(model)
        self.cache_shape = CacheShape(cfg.num_layers, engine_cfg.total_pages(), engine_cfg.page_size,
                                      cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
        self.allocator = PageAllocator(self.cache_shape.num_pages)
        if drafter is None:
            self.params = target_params
            self.caches = init_kv_caches(self.cache_shape)
            self.programs = shared_programs(StockPrograms, graphdef, engine_cfg.page_size,
                                            self.eos_ids, attn_impl, engine_cfg.device_loop,
                                            prefill_graphdef)
        else:
            from jspec.spec_steps import SpecPrograms
            draft_cfg.check_fits(cfg)
            draft_graphdef, draft_params = nnx.split(drafter)
            draft_params = quantize_drafter_state(draft_params, engine_cfg.draft_weight_dtype)
            self.params = (target_params, draft_params)
            if engine_cfg.draft_vocab is not None:
                if draft_vocab_ids is None:
                    raise ValueError("draft_vocab needs the ranked token ids (draft_vocab_ids)")
                ids = choose_ids(draft_vocab_ids, engine_cfg.draft_vocab, cfg.vocab_size,
                                 keep=self.eos_ids)
                self.params += (DraftVocab.build(ids, model, drafter),)
            if engine_cfg.draft_weight_dtype is not None:
                # The drafter's head too: an int8 copy of the rows it reads (the target keeps its
                # own lm_head for verify), on the draft ids when there is a draft vocabulary.
                self.params = draft_head_int8(self.params, model)
            # The drafter's pool mirrors the target's pages (same page table), with its layers.
            self.draft_cache_shape = dataclasses.replace(
                self.cache_shape, num_layers=draft_cfg.layers.num_layers,
                dtype=engine_cfg.draft_kv_dtype or cfg.dtype)
            self.caches = (init_kv_caches(self.cache_shape), init_kv_caches(self.draft_cache_shape))
            self.programs = shared_programs(SpecPrograms, graphdef, draft_graphdef, draft_cfg,
                                            engine_cfg.page_size, self.eos_ids,
                                            attn_impl, self.num_draft, engine_cfg.device_loop,
                                            float(engine_cfg.verify_threshold),
                                            prefill_graphdef, engine_cfg.verify_rule)
        self.lanes: list[Request | None] = [None] * engine_cfg.max_lanes
        self._admissions = itertools.count(1)
        self.stats = collections.Counter()
        # The last dispatch's output state, kept on the device (see _dispatch_state).
        self._carry: tuple | None = None
        # Inputs go to the caches' device, committed, as the carried outputs are: a committed and
        # an uncommitted argument are two jit signatures (a recompilation).
        self._device = next(iter(jax.tree.leaves(self.caches)[0].devices()))
        self.carry_state = True  # False: send the whole state every dispatch (the reference)
        # lookahead_admission: (request, first token on the device) of the requests admitted
        # while a look-ahead dispatch ran, before (_joining) and after (_joined) they join one
        self._joining: list[tuple[Request, tuple | None]] = []
        self._joined: list[tuple[Request, tuple | None]] = []
        # _merge_state's constant operands, on the device once: a lane's "no first token" and
        # the EOS ids (-1 where there are none: no token matches it)
        self._no_token = jax.device_put(np.zeros(1, np.int32), self._device)
        self._eos_ids_dev = jax.device_put(np.asarray(self.eos_ids or (-1,), np.int32),
                                           self._device)
        self.check_carry = False  # tests: compare a carried state with the host's every dispatch

    # ---- validation ---------------------------------------------------------------------------

    def check_request(self, req: Request) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("empty prompt: nothing to condition on")
        if n >= self.ecfg.max_context:
            raise ValueError(f"prompt of {n} tokens does not fit the maximum context of "
                             f"{self.ecfg.max_context} tokens")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"(size {self.cfg.vocab_size})")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {req.max_tokens}")
        need = self.cache_shape.pages_for(self._max_len(req) + self.ecfg.step_width - 1)
        if need > self.allocator.num_pages - 1:
            raise ValueError(f"request needs {need} KV pages but the pool has only "
                             f"{self.allocator.num_pages - 1}")

    def _window_end(self, req: Request, windows: int = 1) -> int:
        """Positions the next `windows` dispatches may write: from the input token (the last
        emitted, at len(context) - 1) through decode_steps steps of step_width tokens each,
        capped by what the request can ever hold (plus one verify width of rows past it)."""
        width = self.ecfg.step_width
        reach = len(req.context_ids) - 1 + windows * self.ecfg.decode_steps * width
        return min(reach, self._max_len(req) + width - 1)

    def _max_len(self, req: Request) -> int:
        """The most tokens this request's context can ever hold (never past max_context)."""
        return min(len(req.prompt_ids) + req.max_tokens, self.ecfg.max_context)

    # ---- the loop -----------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request],
                 on_update: Callable[[Request], None] | None = None) -> list[Request]:
        """Runs the requests to completion (continuous batching); returns them, finished."""
        for req in requests:
            self.check_request(req)
            # The context can never pass max_context: clamp what may still be generated.
            req.max_tokens = self._max_len(req) - len(req.prompt_ids)
        waiting = collections.deque(requests)
        pending = None  # a launched dispatch whose tokens the host has not read yet
        while waiting or any(self.lanes):
            if pending is None:
                seated, self._joining = self._joining, []  # admitted ahead, joined none
                self._emit_first_tokens(seated, on_update)
                self._admit(waiting, on_update)
                if not any(self.lanes):
                    continue
                self._reserve_or_preempt(waiting)
                pending = self._launch()
            ahead = None
            if self._may_look_ahead(pending, waiting):
                ahead = self._launch(ahead=True)
            self._collect(pending, on_update)
            seated, self._joined = self._joined, []
            self._emit_first_tokens(seated, on_update)  # before the tokens of `ahead`
            if ahead is not None and self.ecfg.lookahead_admission:
                self._admit_ahead(waiting)
            pending = ahead
        if pending is not None:  # every lane ended inside it: it emits nothing
            self._collect(pending, on_update)
        return list(requests)

    def _may_look_ahead(self, pending: "_Dispatch", waiting: collections.deque) -> bool:
        """Whether the next dispatch may be launched before `pending`'s tokens are read. It
        starts from the state `pending` leaves on the device, so the lanes must be the ones
        `pending` ran. A lane that ends inside `pending` idles through the next one: so only
        while no request waits for a lane, or with a single lane (the device loop then stops
        at once). With lookahead_admission requests may wait, and a lane may also have emptied
        or been seated ahead since `pending` (_mergeable; _merged_state puts them in). And only
        when the pool holds every lane's next two windows without preempting (the host's lengths
        trail the device's by one dispatch)."""
        if not (self.ecfg.lookahead and self.carry_state and any(self.lanes)):
            return False
        if not self.ecfg.lookahead_admission:
            if waiting and len(self.lanes) > 1:
                return False
            if self._lane_key(self.lanes) != pending.lane_key:
                return False
        elif not self._mergeable(pending.lane_key):
            return False
        for req in self.lanes:
            if req is None:
                continue
            need = self.cache_shape.pages_for(self._window_end(req, windows=2)) - len(req.pages)
            if need > 0:
                pages = self.allocator.allocate(need)
                if pages is None:
                    return False  # what was taken stays with its lane: the next windows use it
                req.pages += pages
        return True

    def _admit(self, waiting: collections.deque, on_update) -> None:
        """Gives free lanes to waiting requests and prefills them. The prefills of one round are
        all launched before the first token is read: the device runs them back to back while
        the host prepares the next, instead of idling through one sync per request."""
        while waiting and None in self.lanes:
            t0, launched, blocked = time.perf_counter(), [], False
            while waiting and None in self.lanes:
                seated = self._seat(waiting)
                if seated is None:
                    blocked = True  # wait for pages: running lanes finish or get preempted
                    break
                launched.append(seated)
            for req, first in launched:  # in admission order, as one request at a time did
                self._emit_first(req, first)
            self.stats["time_prefill_s"] += time.perf_counter() - t0
            for req, _ in launched:
                if on_update:
                    on_update(req)
                if req.finished:
                    self._retire(req)
            if blocked:
                return

    def _seat(self, waiting: collections.deque) -> tuple | None:
        """The first waiting request in a free lane with the pages of its prompt and first
        window, its prefill launched, not waited for: (request, its first token's device arrays
        or None); None, and nothing taken, when the pool is short."""
        req = waiting[0]
        need = self.cache_shape.pages_for(max(len(req.context_ids), self._window_end(req)))
        pages = self.allocator.allocate(need)
        if pages is None:
            return None
        waiting.popleft()
        req.lane, req.pages = self.lanes.index(None), pages
        req.admitted_at = next(self._admissions)
        self.lanes[req.lane] = req
        return req, self._launch_prefill(req)

    def _admit_ahead(self, waiting: collections.deque) -> None:
        """lookahead_admission: seats waiting requests in free lanes while a look-ahead dispatch
        runs. Their prefills queue behind it on the device and their first tokens stay there:
        they join the next look-ahead dispatch (_merged_state), or are read before the next
        launch from the host's state if there is none."""
        t0 = time.perf_counter()
        while waiting and None in self.lanes:
            seated = self._seat(waiting)
            if seated is None:
                break
            self._joining.append(seated)
            self.stats["admissions_ahead"] += 1
        self.stats["time_prefill_s"] += time.perf_counter() - t0

    def _emit_first_tokens(self, seated: list, on_update) -> None:
        """Reads and emits the first tokens of requests seated ahead ((request, first) pairs),
        retiring those that end there."""
        for req, first in seated:
            self._emit_first(req, first)
            if on_update:
                on_update(req)
            if req.finished:
                self._retire(req)

    def _mergeable(self, lane_key: tuple) -> bool:
        """lookahead_admission: whether the next dispatch can start from the state of the one
        with `lane_key`: every lane holds the same admission, or is empty now (its request ended
        or was stopped: the merged state deactivates it), or was seated ahead (_joining)."""
        joining = {req.lane for req, _ in self._joining}
        return all(now == then or now == 0 or b in joining
                   for b, (now, then) in enumerate(zip(self._lane_key(self.lanes), lane_key)))

    def _page_row(self, req: Request) -> np.ndarray:
        row = np.full(self.ecfg.pages_per_lane, NULL_PAGE, np.int32)
        row[:len(req.pages)] = req.pages
        return row

    def _sampling(self, reqs: Sequence[Request | None]) -> SamplingArrays:
        live = [r if r is not None else Request([0], temperature=0.0) for r in reqs]
        return SamplingArrays.from_lists([r.temperature for r in live], [r.top_k for r in live],
                                         [r.top_p for r in live], [r.seed for r in live])

    def _prefill(self, req: Request) -> None:
        """Fill the lane's cache. A fresh request prefills its prompt and samples its first
        token. A resumed (preempted) one prefills everything but its last emitted token, which
        becomes the next step's input again: nothing is sampled twice, so the continuation uses
        exactly the random draws it would have used without preemption."""
        t0 = time.perf_counter()
        self._emit_first(req, self._launch_prefill(req))
        self.stats["time_prefill_s"] += time.perf_counter() - t0

    def _emit_first(self, req: Request, first) -> None:
        """Reads a fresh request's first token from its prefill (a sync) and emits it."""
        if first is not None:
            token, logprob = first
            self._emit(req, [int(token[0])], [float(logprob[0])])

    def _launch_prefill(self, req: Request):
        """_prefill's device work, not waited for: (token, logprob) device arrays of a fresh
        request's first token, or None for a resumed one."""
        resumed = bool(req.output_ids)
        context = req.context_ids[:-1] if resumed else req.context_ids
        chunk, sizes = self.ecfg.prefill_chunk, self.ecfg.prefill_sizes()
        row = jnp.asarray(self._page_row(req))
        sampling = self._sampling([req])
        for start in range(0, len(context), chunk):
            piece = context[start:start + chunk]
            tokens = np.zeros(next(n for n in sizes if n >= len(piece)), np.int32)
            tokens[:len(piece)] = piece
            self.caches, token, logprob = self.programs.prefill(
                self.params, self.caches, jnp.asarray(tokens), jnp.int32(start),
                jnp.int32(len(piece)), row, sampling)
        self.stats["prefill_tokens"] += len(context)
        return None if resumed else (token, logprob)

    def precompile_prefill(self) -> None:
        """Compiles the prefill at every padded size now (a benchmark's warm-up), so that no
        prompt length compiles one later. Each runs once on a lane whose pages are all the null
        page, which only padding ever writes."""
        row = jnp.full((self.ecfg.pages_per_lane,), NULL_PAGE, jnp.int32)
        sampling = self._sampling([None])
        for size in self.ecfg.prefill_sizes():
            self.caches, token, _ = self.programs.prefill(
                self.params, self.caches, jnp.zeros((size,), jnp.int32), jnp.int32(0),
                jnp.int32(1), row, sampling)
        jax.block_until_ready(token)

    def _emit(self, req: Request, tokens: list[int], logprobs: list[float]) -> None:
        for tok, lp in zip(tokens, logprobs):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            if req.stop_on_eos and tok in self.eos_ids:
                req.finish_reason = "eos"
                return
            if len(req.output_ids) >= req.max_tokens:
                req.finish_reason = "length"
                return

    def _retire(self, req: Request) -> None:
        self.allocator.free(req.pages)
        req.pages = []
        self.lanes[req.lane] = None
        req.lane = None

    def _reserve_or_preempt(self, waiting: collections.deque) -> None:
        """Give every running lane pages for its next window; preempt the newest when short."""
        for req in sorted((r for r in self.lanes if r), key=lambda r: r.admitted_at):
            if req.lane is None:
                continue  # preempted below in this pass
            need = self.cache_shape.pages_for(self._window_end(req)) - len(req.pages)
            while need > 0:
                pages = self.allocator.allocate(need)
                if pages is not None:
                    req.pages += pages
                    break
                victim = max((r for r in self.lanes if r), key=lambda r: r.admitted_at)
                self._preempt(victim, waiting)
                if victim is req:
                    break

    def _preempt(self, req: Request, waiting: collections.deque) -> None:
        self._retire(req)
        req.num_preemptions += 1
        self.stats["preemptions"] += 1
        waiting.appendleft(req)

    @staticmethod
    def _lane_key(lanes: Sequence[Request | None]) -> tuple[int, ...]:
        """Which admission holds each lane (admitted_at is unique per admission, 0 = empty)."""
        return tuple(r.admitted_at if r else 0 for r in lanes)

    def _host_state(self, lanes: Sequence[Request | None], page_table: np.ndarray,
                    unread: Sequence[bool] | None = None) -> DecodeState:
        """The dispatch's input state from the host's bookkeeping (numpy arrays). `unread[b]`:
        lane b's first token is still on the device (_merged_state puts it in; here a 0), so its
        whole prompt is in the cache and one token less remains."""
        unread = unread or [False] * len(lanes)
        remaining = [r.max_tokens - len(r.output_ids) - u if r else 0 for r, u in zip(lanes, unread)]
        return DecodeState(
            # The last emitted token is not in the cache yet: it is the step's input.
            tokens=np.asarray([r.output_ids[-1] if r and not u else 0
                               for r, u in zip(lanes, unread)], np.int32),
            lengths=np.asarray([len(r.context_ids) - 1 + u if r else 0
                                for r, u in zip(lanes, unread)], np.int32),
            page_table=page_table,
            active=np.asarray([r is not None and n > 0 for r, n in zip(lanes, remaining)]),
            remaining=np.asarray(remaining, np.int32),
            stop_on_eos=np.asarray([r.stop_on_eos if r else True for r in lanes]),
            sampling=self._sampling(lanes),
        )

    def _merged_state(self, lanes: Sequence[Request | None], page_table: np.ndarray) -> DecodeState:
        """lookahead_admission: the carried state (the running dispatch's output, still on the
        device) with the lanes seated ahead (_joining) put in from the host's bookkeeping and their
        first tokens from their prefills, and the lanes now empty deactivated. A first token that
        is EOS (for a request that stops there) leaves its lane inactive, as decode would."""
        then, state, _ = self._carry
        now = self._lane_key(lanes)
        first = {req.lane: f for req, f in self._joining if f is not None}
        take = np.asarray([n != t and n != 0 for n, t in zip(now, then)])
        unread = [b in first for b in range(len(lanes))]
        fresh = jax.device_put(self._host_state(lanes, page_table, unread), self._device)
        # one [1] array a lane (a fixed structure: one compilation), concatenated in the jit
        firsts = tuple(first[b][0] if b in first else self._no_token for b in range(len(lanes)))
        flags = jax.device_put((take, np.asarray([k == 0 for k in now]), np.asarray(unread)),
                               self._device)
        self.stats["state_merges"] += 1
        return _merge_state(state, fresh, firsts, *flags, self._eos_ids_dev)

    def _dispatch_state(self, lanes: Sequence[Request | None], ahead: bool = False):
        """The dispatch's input state on the device. When the same admissions hold the same lanes
        as in the previous dispatch, that dispatch's output state is already it: its tokens,
        lengths, remaining and active advanced on the device exactly as the host's bookkeeping
        did (a lane that stopped is retired, which changes the key). Then only a page table that
        grew is sent. Otherwise every field goes up in one device_put. (Each small host-to-device
        transfer costs the GPU idle time: 2.8 ms per dispatch for the ~12 fields, measured on
        the H200, docs/benchmarks.md.) `check_carry` (tests) compares the carried state with the
        host's, field by field. `ahead`: the previous dispatch is still unread, so the host's
        bookkeeping trails the carried state by one dispatch and is not compared."""
        page_table = np.stack([self._page_row(r) if r else
                               np.zeros(self.ecfg.pages_per_lane, np.int32) for r in lanes])
        carry = self._carry
        if not self.carry_state or carry is None or carry[0] != self._lane_key(lanes):
            if ahead and self.ecfg.lookahead_admission and carry is not None:
                return self._merged_state(lanes, page_table), page_table
            assert not ahead, "a look-ahead dispatch must start from the carried state"
            self.stats["state_uploads"] += 1
            return jax.device_put(self._host_state(lanes, page_table), self._device), page_table
        _, state, sent_pages = carry
        if self.check_carry and not ahead:  # every field but the page table, which may have grown
            host = self._host_state(lanes, page_table)
            for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(host),
                                         jax.tree.leaves(state)):
                name = jax.tree_util.keystr(path)
                if name != ".page_table" and not np.array_equal(want, np.asarray(got)):
                    raise AssertionError(f"carried decode state differs from the host's in "
                                         f"{name}: {np.asarray(got)} vs {want}")
        self.stats["state_carries"] += 1
        if not np.array_equal(sent_pages, page_table):
            state = dataclasses.replace(state, page_table=jax.device_put(page_table, self._device))
        return state, page_table

    def _launch(self, ahead: bool = False) -> "_Dispatch":
        """Launches one device dispatch of `decode_steps` steps (or iterations) for every lane
        and returns without waiting for its tokens (`_collect` reads them). Wall time is split
        into stats:
        time_prepare_s (host arrays in), time_call_s (the jitted call until it returns),
        time_wait_s (until the tokens are on the host: the device's share, less what overlapped
        a look-ahead) and time_emit_s (host bookkeeping): what a dispatch costs beyond the
        device's work, measured where the engine runs."""
        t0 = time.perf_counter()
        lanes = list(self.lanes)
        state, page_table = self._dispatch_state(lanes, ahead)
        t1 = time.perf_counter()
        self.caches, state_out, out_tokens, out_logprobs, *extra = self.programs.decode(
            self.params, self.caches, state, num_steps=self.ecfg.decode_steps)
        t2 = time.perf_counter()
        key = self._lane_key(lanes)
        self._carry = (key, state_out, page_table)
        if ahead and self._joining:  # they are in this dispatch now: read their first tokens next
            self._joined, self._joining = self._joining, []
        self.stats["decode_dispatches"] += 1
        self.stats["lookahead_dispatches"] += int(ahead)
        self.stats["time_prepare_s"] += t1 - t0
        self.stats["time_call_s"] += t2 - t1
        return _Dispatch(lanes, key, out_tokens, out_logprobs, extra[0] if extra else None,
                         extra[1] if len(extra) > 1 else None)

    def _collect(self, dispatch: "_Dispatch", on_update) -> None:
        """Reads a dispatch's tokens and does the host's bookkeeping for its lanes. A lane whose
        request ended before (in the dispatch this one looked ahead of) emitted nothing on the
        device, or emitted past a host-side stop; either way it is skipped."""
        t0 = time.perf_counter()
        out_tokens, out_logprobs = np.asarray(dispatch.tokens), np.asarray(dispatch.logprobs)
        step_tokens = np.asarray(dispatch.step_tokens) if dispatch.step_tokens is not None else None
        step_drafts = np.asarray(dispatch.step_drafts) if dispatch.step_drafts is not None else None
        t1 = time.perf_counter()
        for b, req in enumerate(dispatch.lanes):
            if req is None or req.finished:
                continue
            emitted = out_tokens[b] >= 0
            self._emit(req, out_tokens[b, emitted].tolist(), out_logprobs[b, emitted].tolist())
            if step_tokens is not None:
                req.step_tokens += [int(n) for n in step_tokens[b] if n > 0]
            if step_drafts is not None:
                req.step_drafts += [int(d) for n, d in zip(step_tokens[b], step_drafts[b]) if n > 0]
            self.stats["decode_tokens"] += int(emitted.sum())
            if on_update:
                on_update(req)
            if req.finished:
                self._retire(req)
        self.stats["time_wait_s"] += t1 - t0
        self.stats["time_emit_s"] += time.perf_counter() - t1


@jax.jit
def _merge_state(carried: DecodeState, fresh: DecodeState, firsts: tuple, take_b, empty_b,
                 unread_b, eos_ids) -> DecodeState:
    """Engine._merged_state on the device: lane b from `fresh` where take_b, else carried; the
    page table from the host; tokens of the lanes with unread first tokens from firsts[b]."""
    first_b = jnp.concatenate(firsts).astype(carried.tokens.dtype)

    def pick(c, f):
        return jnp.where(take_b.reshape(take_b.shape + (1,) * (c.ndim - 1)), f, c)

    merged = jax.tree.map(pick, carried, fresh)
    first_eos = unread_b & fresh.stop_on_eos & jnp.isin(first_b, eos_ids)
    return dataclasses.replace(merged, tokens=jnp.where(unread_b, first_b, merged.tokens),
                               active=merged.active & ~empty_b & ~first_eos,
                               page_table=fresh.page_table)


@dataclasses.dataclass
class _Dispatch:
    """A launched dispatch: the lanes it ran (a snapshot), their admission key and its device
    outputs, not yet read."""
    lanes: list
    lane_key: tuple
    tokens: jax.Array
    logprobs: jax.Array
    step_tokens: jax.Array | None
    step_drafts: jax.Array | None = None
