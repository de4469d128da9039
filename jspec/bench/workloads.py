"""The benchmark's workloads (protocol.md section 3), their prompts, seeds and timed passes.

Prompts are the first turns of humaneval and mbpp (interleaved: humaneval 0, mbpp 0, humaneval 1,
...), each wrapped in the Qwen3 chat template (non-thinking) and tokenized by the model's own
tokenizer. Busy prompts concatenate consecutive prompt texts (blank line between) into one user
turn until the templated prompt has at least 3,000 tokens; prompt j starts at text j * N / 64 of
the pool, so no text repeats inside one prompt.

Choices this module makes where the protocol leaves room (each one the harder to flatter):
* EOS is honoured (stop_on_eos): replies are the model's natural replies capped at the
  workload's max new tokens, as in serving; tokens after an EOS are never counted.
* Every request has its own seed, derived from (workload, pass, engine, prompt): stock and the
  candidate use independent seeds, and each pass draws fresh ones, so the three passes are three
  samples of the workload, not three replays of one.
* The busy KV pool is sized from the busy prompts so that the expected steady-state occupancy is
  97 % (the window the engine reserves ahead of each lane included); the occupancy actually
  reached is measured during the passes and must be >= 90 % (else SpecScore is withheld).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
import zlib
from typing import Callable, Sequence

PROMPT_SETS = ("humaneval", "mbpp")
QUICK_PROMPT_SETS = ("mbpp",)  # --quick: one-sentence prompts, short on a CPU

# --sampling: the headline (the DSpark paper's T = 1), greedy, and Qwen3's non-thinking defaults.
SAMPLING = {
    "t1": dict(temperature=1.0, top_k=0, top_p=1.0),
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
    "qwen": dict(temperature=0.7, top_k=20, top_p=0.8),
}


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    name: str
    lanes: int
    num_prompts: int
    max_new_tokens: int
    min_prompt_tokens: int = 0  # > 0: prompts built by concatenating texts to this length
    size_pool: bool = False  # size the KV pool for the steady state (busy)
    what: str = ""


WORKLOADS = {
    "solo": WorkloadSpec("solo", 1, 16, 512, what="one user: prompts one after another"),
    "team": WorkloadSpec("team", 16, 64, 512, what="16 lanes kept full by continuous batching"),
    "busy": WorkloadSpec("busy", 32, 64, 256, min_prompt_tokens=3000, size_pool=True,
                         what="32 lanes, prompts >= 3,000 tokens, KV pool >= 90 % occupied"),
}
# --quick: the same pipeline at CPU scale (tests/test_bench.py). Gates are underpowered then.
QUICK_WORKLOADS = {
    "solo": WorkloadSpec("solo", 1, 2, 16, what=WORKLOADS["solo"].what),
    "team": WorkloadSpec("team", 4, 8, 16, what="4 lanes kept full (quick)"),
    "busy": WorkloadSpec("busy", 4, 8, 8, min_prompt_tokens=256, size_pool=True,
                         what="4 lanes, prompts >= 256 tokens, KV pool sized (quick)"),
}
WORKLOAD_ORDER = ("solo", "team", "busy")  # ascending footprint: each peak is a new high

PASSES = 3
POOL_SIZING_OCCUPANCY = 0.97


@dataclasses.dataclass(frozen=True)
class GateSpec:
    fixed_texts: int = 32  # teacher-forced texts ...
    fixed_tokens: int = 256  # ... of at least this many scored tokens (rounded up to the verify width)
    greedy_prompts: int = 16  # greedy agreement: prompts (run on the team engines) ...
    greedy_tokens: int = 512  # ... and max new tokens


GATES = GateSpec()
QUICK_GATES = GateSpec(fixed_texts=4, fixed_tokens=32, greedy_prompts=4, greedy_tokens=16)


# ---- prompts ------------------------------------------------------------------------------------

def prompt_texts(sets: Sequence[str] = PROMPT_SETS) -> list[str]:
    """First turns of the sets, interleaved (a0, b0, a1, b1, ...; the longer set's tail last)."""
    from jspec.prompts import first_turn, load_prompts
    lists = [[first_turn(r) for r in load_prompts(s)] for s in sets]
    out = []
    for i in range(max(len(x) for x in lists)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def concatenated_prompts(tokenizer, texts: Sequence[str], count: int, min_tokens: int
                         ) -> list[list[int]]:
    """`count` chat prompts of >= min_tokens tokens, each the concatenation of consecutive texts."""
    n = len(texts)
    raw = [len(tokenizer.encode(t)) + 2 for t in texts]
    if sum(raw) < min_tokens:
        raise ValueError(f"the prompt texts hold only {sum(raw)} tokens: cannot build prompts of "
                         f"{min_tokens}")
    prompts = []
    for j in range(count):
        start = (j * n) // count
        k, total = 0, 0
        while total < min_tokens and k < n:  # a cheap estimate first ...
            total += raw[(start + k) % n]
            k += 1
        while True:  # ... then the exact templated length
            ids = chat_ids(tokenizer, "\n\n".join(texts[(start + i) % n] for i in range(k)))
            if len(ids) >= min_tokens or k >= n:
                break
            k += 1
        prompts.append(ids)
    return prompts


def workload_prompts(spec: WorkloadSpec, tokenizer, texts: Sequence[str]) -> list[list[int]]:
    if spec.min_prompt_tokens:
        return concatenated_prompts(tokenizer, texts, spec.num_prompts, spec.min_prompt_tokens)
    return [chat_ids(tokenizer, t) for t in texts[:spec.num_prompts]]


def fixed_texts(tokenizer, texts: Sequence[str], count: int, length: int
                ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, continuation ids) pairs for the fidelity check: the chat prompt of text i and,
    as the continuation, exactly `length` tokens of the texts that follow it. Fixed by the
    prompt sets and the tokenizer, independent of either engine."""
    out, n = [], len(texts)
    for i in range(count):
        cont, k = [], 1
        while len(cont) < length and k <= n:
            cont += tokenizer.encode(("\n\n" if k > 1 else "") + texts[(i + k) % n])
            k += 1
        if len(cont) < length:
            raise ValueError(f"not enough text for a fixed continuation of {length} tokens")
        out.append((chat_ids(tokenizer, texts[i % n]), cont[:length]))
    return out


def request_seed(*parts) -> int:
    """A seed fixed by its label, e.g. ("team", 2, "spec", 17): reproducible, and independent
    across engines, passes and prompts."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def busy_num_pages(prompt_lens: Sequence[int], lanes: int, max_new: int, page_size: int,
                   window: int, occupancy: float = POOL_SIZING_OCCUPANCY) -> int:
    """Pages (null page included) such that `lanes` lanes at the mean busy context fill
    `occupancy` of the pool. A lane at steady state holds its prompt, on average half its reply,
    the window reserved ahead of it, and half a page of rounding."""
    mean_prompt = sum(prompt_lens) / len(prompt_lens)
    per_lane = (mean_prompt + max_new / 2 + window) / page_size + 0.5
    pages = math.ceil(lanes * per_lane / occupancy)
    # Every single request must fit (Engine.check_request).
    biggest = -(-(max(prompt_lens) + max_new + window) // page_size)
    return max(pages, biggest + 1) + 1


# ---- one timed pass -------------------------------------------------------------------------------

@dataclasses.dataclass
class PassResult:
    engine: str  # "stock" | "spec"
    index: int
    wall_s: float
    tokens: int
    outputs: list[list[int]]
    step_tokens: list[list[int]]
    preemptions: int
    occupancy: list[float]  # KV pool occupancy sampled at each dispatch while the queue was full
    # Engine wall time by phase (Engine.stats time_*_s: prefill, prepare, call, wait, emit) and
    # the number of decode dispatches: what the host adds to the device's work.
    timing: dict = dataclasses.field(default_factory=dict)
    step_drafts: list[list[int]] = dataclasses.field(default_factory=list)  # drafts verified

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def make_requests(prompts: Sequence[Sequence[int]], max_new: int, sampling: dict,
                  seeds: Sequence[int]):
    from jspec.engine import Request
    return [Request(prompt_ids=list(p), max_tokens=max_new, seed=int(s), request_id=i,
                    stop_on_eos=True, **sampling) for i, (p, s) in enumerate(zip(prompts, seeds))]


def timed_pass(engine, requests, *, engine_name: str, index: int, desc: str,
               progress: bool = True) -> PassResult:
    """Runs the requests to completion; wall time from submission to the last token (the engine
    returns after the host holds every token). The pool occupancy is sampled at every dispatch
    while requests still wait for a lane (the steady state of a kept-full workload)."""
    from tqdm.auto import tqdm
    alloc = engine.allocator
    usable = alloc.num_pages - 1
    total = len(requests)
    seen: set[int] = set()
    occupancy: list[float] = []
    last_dispatch = [-1]
    bar = tqdm(total=total, desc=desc, unit="req", leave=False, mininterval=1.0,
               disable=not progress)

    def on_update(req) -> None:
        seen.add(req.request_id)
        d = engine.stats["decode_dispatches"]
        if d != last_dispatch[0] and len(seen) < total and all(engine.lanes):
            last_dispatch[0] = d
            occupancy.append((usable - alloc.num_free) / usable)
        if req.finished:
            bar.update(1)

    preempt0 = engine.stats["preemptions"]
    timing_keys = ("time_prefill_s", "time_prepare_s", "time_call_s", "time_wait_s", "time_emit_s",
                   "decode_dispatches")
    before = {k: engine.stats[k] for k in timing_keys}
    gc.collect()
    t0 = time.perf_counter()
    engine.generate(requests, on_update)
    wall = time.perf_counter() - t0
    bar.close()
    timing = {k.removeprefix("time_"): engine.stats[k] - before[k] for k in timing_keys}
    return PassResult(engine=engine_name, index=index, wall_s=wall,
                      tokens=sum(len(r.output_ids) for r in requests),
                      outputs=[list(r.output_ids) for r in requests],
                      step_tokens=[list(r.step_tokens) for r in requests],
                      step_drafts=[list(r.step_drafts) for r in requests],
                      preemptions=engine.stats["preemptions"] - preempt0, occupancy=occupancy,
                      timing=timing)


def alternate_passes(engines: dict, prompts, spec: WorkloadSpec, sampling: dict, *,
                     passes: int = PASSES, progress: bool = True,
                     on_pass: Callable[[PassResult], None] | None = None) -> list[PassResult]:
    """stock, spec, stock, spec, ... `passes` of each; pass p of each engine answers the same
    prompts with that engine's own seeds."""
    results = []
    for p in range(passes):
        for name in ("stock", "spec"):
            seeds = [request_seed(spec.name, p, name, i) for i in range(len(prompts))]
            reqs = make_requests(prompts, spec.max_new_tokens, sampling, seeds)
            r = timed_pass(engines[name], reqs, engine_name=name, index=p, progress=progress,
                           desc=f"{spec.name} {name} pass {p + 1}/{passes}")
            results.append(r)
            if on_pass:
                on_pass(r)
    return results
