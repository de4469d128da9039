"""The Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from jspec.config import SPEC_DECODE_STEPS, STOCK_DECODE_STEPS, ConfigError
from jspec.engine import Engine, EngineConfig, Request


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 means greedy; top_k 0 and top_p 1 mean off."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: a fresh random seed per request
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if isinstance(self.max_tokens, bool) or int(self.max_tokens) != self.max_tokens or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= int(self.seed) < 2**32):
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclasses.dataclass
class GenerationResult:
    prompt: str
    text: str
    token_ids: list[int]
    logprobs: list[float]  # log p_model(token) of each generated token (temperature 1, unfiltered)
    finish_reason: str  # "eos" | "length" | "stop"
    prompt_token_ids: list[int]
    # Speculative decoding only: mean tokens committed per verify step (bonus included), and the
    # share of verify steps whose k-th draft was accepted, k = 1..num_draft_tokens.
    tokens_per_step: float | None = None
    acceptance_per_position: list[float] | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class LLM:
    """A Qwen3 model served by jspec. `model` is a Hugging Face or jspec directory, or the name
    `standin` (the shipped stand-in; its drafters are `standin-dspark` and `standin-dflash`)."""

    def __init__(self, model: str | Path, *, draft: str | Path | None = None,
                 num_draft_tokens: int | None = None, dtype: str | None = None, max_lanes: int = 8,
                 max_context: int = 4096, page_size: int = 16, num_pages: int | None = None,
                 decode_steps: int | None = None, prefill_chunk: int = 256, attn_impl: str = "auto",
                 batch_invariant: bool = False, draft_kv_dtype: str | None = None,
                 draft_weight_dtype: str | None = None, draft_linear: str = "xla",
                 draft_vocab: int | None = None, verify_threshold: float = 0.0,
                 verify_rule: str = "block", lookahead_admission: bool = False,
                 progress: bool = False):
        """`draft`: a DSpark / DFlash drafter directory for `model`; speculative decoding then
        proposes `num_draft_tokens` (default: the drafter's block size) tokens per step.
        `batch_invariant` (GPU): the target's matmuls and attention through batch-invariant
        kernels, so its numbers never depend on what is batched with a request or on how many
        tokens a step verifies (EngineConfig.batch_invariant).
        `draft_kv_dtype`: the drafter's KV pool dtype, None (the model's) or "float8_e4m3fn"
        (half the pool in bf16; changes acceptance only, never the output distribution).
        `draft_weight_dtype`: the drafter's big weights, None (the model's) or "int8" (a scale
        per output channel, the drafter's head rows too: jspec/draft_weights.py; the same).
        `draft_linear`: the drafter's matmul route, "xla" or "triton" (GPU: jspec's linear
        kernel, which reads int8 weights itself; EngineConfig.draft_linear; the same).
        `draft_vocab`: the drafter proposes only the N most frequent token ids, ranked in the
        drafter directory's draft_vocab.json (jspec/draft_vocab.py; the same: acceptance only).
        `verify_threshold`: DSpark's prefix rule; each step verifies only the drafts whose
        cumulative confidence stays >= it, so a busy engine verifies fewer rows (lossless; 0,
        the default, verifies every draft; needs a drafter with a confidence head).
        `verify_rule`: "block" (block verification, the default: the accept length decided from
        the whole block, never fewer accepted drafts in expectation) or "token" (draft by
        draft); both keep the target's distribution exactly (jspec/rejection.py).
        `lookahead_admission`: while requests wait for a lane, launch the next dispatch before
        reading the last and seat the waiting requests behind it (EngineConfig.
        lookahead_admission; the same outputs, the host's work overlapping the device's)."""
        from jspec.loading import load_drafter, load_model
        from jspec.tokenizer import Tokenizer

        from jspec.standin import resolve_drafter, resolve_model
        self.model_dir = resolve_model(model)  # a directory, or a stand-in name (jspec.standin)
        if draft is not None:
            draft = resolve_drafter(draft)
        self.cfg, model_module = load_model(self.model_dir, dtype=dtype, progress=progress)
        drafter = draft_cfg = None
        if draft is not None:
            draft_cfg, drafter = load_drafter(draft, self.cfg, model_module, progress=progress)
        elif num_draft_tokens is not None:
            raise ValueError("num_draft_tokens needs a draft model")
        elif draft_kv_dtype is not None:
            raise ValueError("draft_kv_dtype needs a draft model (it is the drafter's KV pool)")
        elif draft_weight_dtype is not None:
            raise ValueError("draft_weight_dtype needs a draft model")
        elif draft_linear != "xla":
            raise ValueError("draft_linear needs a draft model")
        elif draft_vocab is not None:
            raise ValueError("draft_vocab needs a draft model")
        elif verify_threshold:
            raise ValueError("verify_threshold needs a draft model")
        ranked = None
        if draft_vocab is not None:
            from jspec.draft_vocab import read_ranked_ids
            ranked = read_ranked_ids(draft)
        try:
            self.tokenizer = Tokenizer.from_dir(self.model_dir)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"{self.model_dir}: cannot load its tokenizer: {e}") from None
        max_context = min(max_context, self.cfg.max_position_embeddings)
        if decode_steps is None:  # jspec.config says why these
            decode_steps = SPEC_DECODE_STEPS if drafter is not None else STOCK_DECODE_STEPS
        self.engine = Engine(self.cfg, model_module, self.tokenizer.eos_ids, EngineConfig(
            max_lanes=max_lanes, page_size=page_size, max_context=max_context, num_pages=num_pages,
            prefill_chunk=prefill_chunk, decode_steps=decode_steps, attn_impl=attn_impl,
            batch_invariant=batch_invariant, draft_kv_dtype=draft_kv_dtype,
            draft_weight_dtype=draft_weight_dtype, draft_linear=draft_linear,
            draft_vocab=draft_vocab, verify_threshold=verify_threshold, verify_rule=verify_rule,
            lookahead_admission=lookahead_admission),
            drafter=drafter, draft_cfg=draft_cfg, num_draft=num_draft_tokens,
            draft_vocab_ids=ranked)
        self._seeds = np.random.default_rng()

    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            if chat:
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: int) -> Request:
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        return Request(prompt_ids=prompt_ids, temperature=params.temperature, top_k=params.top_k,
                       top_p=params.top_p, seed=seed, max_tokens=params.max_tokens,
                       stop_on_eos=not params.ignore_eos, request_id=request_id)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = False,
                 on_text: Callable[[int, str], None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (text, or token ids). `on_text(i, new_text)` streams."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        requests = [self.make_request(self.encode_prompt(p, chat), sp, i)
                    for i, (p, sp) in enumerate(zip(prompts, per_prompt))]
        streams = [_TextStream(self.tokenizer, sp.stop) for sp in per_prompt]

        def on_update(req: Request) -> None:
            new_text = streams[req.request_id].update(req)
            if on_text and new_text:
                on_text(req.request_id, new_text)

        self.engine.generate(requests, on_update)
        results = []
        for prompt, req, stream in zip(prompts, requests, streams):
            n = stream.num_tokens if stream.stopped else len(req.output_ids)
            results.append(GenerationResult(
                prompt=prompt if isinstance(prompt, str) else self.tokenizer.decode(list(prompt)),
                text=stream.text, token_ids=req.output_ids[:n], logprobs=req.logprobs[:n],
                finish_reason="stop" if stream.stopped else req.finish_reason,
                prompt_token_ids=req.prompt_ids, tokens_per_step=req.tokens_per_step,
                acceptance_per_position=(req.acceptance_per_position(self.engine.num_draft)
                                         if req.step_tokens else None)))
        return results


class _TextStream:
    """Incremental text of one request, cut at the first stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.text, self.stopped, self.num_tokens = "", False, 0
        self._seen = 0

    def update(self, req: Request) -> str:
        if self.stopped:
            return ""
        ids = req.output_ids
        if req.finish_reason == "eos":
            ids = ids[:-1]  # the EOS token ends the text; it is not part of it
        full = self.tokenizer.decode(ids)
        if full.endswith("\ufffd") and not req.finished:
            full = full[:-1]  # an incomplete UTF-8 character: wait for its next bytes
        for s in self.stop:
            at = full.find(s)
            if at >= 0:
                full = full[:at]
                self.stopped = True
                # Keep the tokens up to the one that completed the stop string.
                self.num_tokens = next(i for i in range(1, len(ids) + 1)
                                       if s in self.tokenizer.decode(ids[:i]))
                req.finish_reason = "stop"
                break
        new = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return new

