"""The OpenAI API simulator's continuous-batching engine (``--latency-model vllm``).

A simulated vLLM V1 engine core for one base model: requests queue, are admitted
while the KV cache and the running batch have room, and ONE asyncio task steps
every running sequence together, so time to first token and inter-token latency
*emerge from load* (queueing, batch size, prefill of others) instead of being
per-request sleeps.  Used by :mod:`backends.simulator_openai`; nothing here
speaks HTTP.

Engine step (what one iteration of the loop does, as vLLM's scheduler)
    1. Running sequences in admission order get their share of the step's token
       budget (``--max-num-batched-tokens``): a decoding sequence 1 token per
       live choice, a prefilling one a chunk of its remaining uncached prompt
       (chunked prefill).
    2. Waiting requests are admitted, first come first served (ordered by
       ``(priority, arrival)``; every request has priority 0 unless it says
       otherwise), while budget, a running slot (``--max-num-seqs``) and KV
       blocks are left.  A request whose whole footprint (prompt plus every
       planned completion token, in blocks of ``--block-size``) does not fit in
       the free blocks stops admission (strict FCFS, nothing behind it jumps
       ahead); so the simulator never preempts, where vLLM would admit on the
       prompt's blocks and preempt under pressure.  A LoRA request whose adapter
       is not in the batch while ``--max-loras`` adapters already are is
       skipped and stays waiting (vLLM's scheduler skips it the same way).
    3. The step lasts::

           t_step = (step_base + step_per_seq * seqs + prefill_per_token * prefill_tokens)
                    * time_scale / speed

       ``seqs``: sequences in the step (decoding choices plus prefilling
       requests); ``prefill_tokens``: uncached prompt tokens computed in it.
    4. When it ends, a request whose prefill completed emits its first token,
       every decoding one its next token; finished requests free their blocks.

Prefix cache (vLLM's automatic prefix caching)
    A prompt is a token stream (the simulator's tokens: 4 UTF-8 bytes each, or
    the ids of a pre-tokenized prompt, see :func:`block_hashes`) cut into
    blocks of ``block_size`` tokens.  Block *i*'s hash chains the hash of
    block *i-1* with block *i*'s tokens (and the LoRA adapter's name), so it
    identifies the whole prefix 0..i.  Only full blocks are hashed and cached.
    On admission the longest run of leading blocks found in the cache is
    reused (never the whole prompt: at least its last token is recomputed, as
    in vLLM) and counted in ``usage.prompt_tokens_details.cached_tokens``.
    Computed prompt blocks are registered as their prefill completes; a freed
    block keeps its contents and hash and goes to the tail of the free queue,
    a request's last block first; allocation takes from the head, evicting
    the least recently used cached block.  Only prompt blocks are cached (not
    generated tokens, which vLLM also caches).

Calibration (``time_scale = 1``, ``speed = 1``: an H100-class GPU, Llama-3.1-8B BF16)
    * ``step_base = 6.2 ms``, ``step_per_seq = 0.3 ms``: a linear fit of vLLM
      0.21's TPOT p50 on one H100-80GB, Llama-3.1-8B-Instruct fp16: 6.48 ms at
      concurrency 1, 6.59 ms at 4, 10.94 ms at 16 (InferenceBench
      concurrency-sweep recipe, yobitelcomm.github.io/bench/recipes/concurrency-sweep/).
      Real decode is flatter below the knee and steeper past it; the line is
      the mid-range.
    * Older GPU (``--speed 0.5``): vLLM 0.23 on one A100-40GB, same model,
      1024-token prompts: ~75 tokens/s for one stream (13.3 ms/step) and a
      6.6x aggregate gain at concurrency 8 (16.2 ms/step), i.e. ~12.9 ms +
      0.41 ms/seq (johnmusgrave.com/p/vllm-throughput-latency-sweep-on), about
      2x the H100 figures, which matches Lambda's "H100 ~2x A100" vLLM
      benchmark (github.com/LambdaLabsML/vllm-benchmark).
    * ``prefill_per_token = 33 us`` (~30k tokens/s): an estimate, not a
      measurement: 2 FLOPs x 8.0e9 parameters per token against the H100's
      989 TFLOP/s dense BF16 at ~50% utilisation (an A100 at 312 TFLOP/s is
      ~3x slower; ``--speed`` scales both phases alike).
    * ``block_size = 16`` and ``max_num_batched_tokens = 8192``: vLLM's
      defaults (the OpenAI server on a >= 70 GiB GPU; 2048 on smaller ones).
    * KV capacity: Llama-3-8B holds 128 KiB per token (32 layers x 8 KV heads x
      128 dims x K and V x 2 bytes), so an H100-80GB at 0.9 memory utilisation
      has room for ~440k tokens and an A100-40GB ~140k.  The simulator's
      default (``--kv-capacity 65536``) and the benchmark's smaller fleets are
      scaled down with the request rate, so caches fill and evict.
    * This machine has 2 CPU cores shared with other work: asyncio timers jitter
      by about a millisecond, so the fleet benchmark runs the model slowed down
      by ``--time-scale`` (every simulated duration multiplied by it, e.g. 10:
      a 6.2 ms step lasts 62 ms) with request rates scaled down to match.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import math
import struct
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Protocol

__all__ = ["BatchEngine", "BatchJob", "BlockPool", "LatencyParams", "TOKEN_BYTES", "block_hashes"]

log = logging.getLogger("backends.simulator")

TOKEN_BYTES = 4  # the simulator's token: ceil(utf-8 bytes / 4) tokens per text
_HASH_SEED = b"adapter-gateway simulator prefix v1"


# --------------------------------------------------------------------------
# Prefix hashing
# --------------------------------------------------------------------------


def block_hashes(items: Iterable[str | Sequence[int]], block_size: int, lora: str | None = None) -> list[str]:
    """Chained hashes (16 hex digits each) of the full blocks of a prompt.

    ``items`` are the prompt's parts in order, as the simulator counts them: a
    chat request is one item, the concatenated text of its messages' contents;
    a completion request has one item per prompt (a string or a list of token
    ids).  A text of ``b`` UTF-8 bytes is ``ceil(b / 4)`` tokens of 4 bytes;
    a token-id list is one token per id.  The stream of all items' tokens is
    cut into blocks of ``block_size``; block *i*'s hash covers blocks 0..i and
    the LoRA adapter (``lora``; None for the base model), as vLLM's prefix
    cache keys do.  Public so a benchmark's oracle can compute what a
    simulator would find cached.
    """
    segments: list[tuple[int, int, bool, bytes]] = []  # (first token, tokens, is text, data)
    position = 0
    for item in items:
        if isinstance(item, str):
            data = item.encode("utf-8")
            count, text = math.ceil(len(data) / TOKEN_BYTES), True
        else:
            data = struct.pack(f"<{len(item)}q", *item)
            count, text = len(item), False
        if count:
            segments.append((position, count, text, data))
            position += count

    parent = hashlib.blake2b(_HASH_SEED + b"|" + (lora or "").encode(), digest_size=8).digest()
    hashes: list[str] = []
    first_segment = 0
    for block in range(position // block_size):
        start, end = block * block_size, (block + 1) * block_size
        digest = hashlib.blake2b(parent, digest_size=8)
        while segments[first_segment][0] + segments[first_segment][1] <= start:
            first_segment += 1
        index = first_segment
        while index < len(segments) and segments[index][0] < end:
            seg_start, seg_count, text, data = segments[index]
            lo, hi = max(start, seg_start) - seg_start, min(end, seg_start + seg_count) - seg_start
            width = TOKEN_BYTES if text else 8
            piece = data[lo * width:hi * width]
            # kind, whether the piece starts its item, and its length: no two token streams collide
            digest.update(b"T" if text else b"I")
            digest.update(struct.pack("<?I", lo == 0, len(piece)))
            digest.update(piece)
            index += 1
        parent = digest.digest()
        hashes.append(parent.hex())
    return hashes


# --------------------------------------------------------------------------
# Latency model
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LatencyParams:
    """The step-time model (see the module docstring for the figures' sources)."""

    step_base_s: float = 0.0062
    step_per_seq_s: float = 0.0003
    prefill_s_per_token: float = 33e-6
    max_num_batched_tokens: int = 8192
    speed: float = 1.0  # 0.5: a GPU half as fast (an older node)
    time_scale: float = 1.0  # every simulated duration is multiplied by this

    def __post_init__(self) -> None:
        if min(self.step_base_s, self.step_per_seq_s, self.prefill_s_per_token) < 0:
            raise ValueError("step and prefill costs must be >= 0")
        if self.speed <= 0 or self.time_scale <= 0:
            raise ValueError("speed and time_scale must be > 0")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")

    def step_seconds(self, seqs: int, prefill_tokens: int) -> float:
        cost = self.step_base_s + self.step_per_seq_s * seqs + self.prefill_s_per_token * prefill_tokens
        return cost * self.time_scale / self.speed


# --------------------------------------------------------------------------
# KV-cache blocks
# --------------------------------------------------------------------------


class BlockPool:
    """KV-cache blocks with reference counts, a hash -> block index and an LRU free queue.

    A block with no reference is *free* (allocatable); it may still hold a
    cached prefix block (``hash_of``) until allocation evicts it.  ``reserved``
    blocks are promised to running requests for tokens not generated yet.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[str | None] = [None] * num_blocks
        self.cached: dict[str, int] = {}
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.reserved = 0

    @property
    def available(self) -> int:
        """Blocks that admission may still promise: free ones not already reserved."""
        return len(self.free) - self.reserved

    @property
    def usage(self) -> float:
        """vLLM's KV usage: the fraction of blocks held by requests."""
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, hashes: Sequence[str], limit: int) -> list[int]:
        """The cached blocks of the longest leading run of ``hashes`` (at most ``limit``)."""
        found: list[int] = []
        for block_hash in itertools.islice(hashes, max(limit, 0)):
            block = self.cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)  # least recently freed first
        old = self.hash_of[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
            self.hash_of[block] = None
        self.ref[block] = 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):  # a request's tail blocks are evicted first (as vLLM)
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None

    def register(self, block: int, block_hash: str) -> None:
        """Record a computed full block; a duplicate of an already cached one stays uncached."""
        if block_hash not in self.cached and self.hash_of[block] is None:
            self.cached[block_hash] = block
            self.hash_of[block] = block_hash


# --------------------------------------------------------------------------
# Requests and the engine
# --------------------------------------------------------------------------


class _Histogram(Protocol):
    def observe(self, value: float) -> None: ...


class EngineStats(Protocol):
    """What the engine records (the simulator's per-model series)."""

    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    finished: dict[str, int]
    ttft: _Histogram
    itl: _Histogram
    e2e: _Histogram
    queue_time: _Histogram


@dataclasses.dataclass(eq=False)
class BatchJob:
    """One request (a sequence group: all its prompts and choices) in the engine."""

    served_model: str
    lora: str | None
    prompt_tokens: int
    hashes: Sequence[str]
    choice_lengths: Sequence[int]  # planned tokens of each choice
    priority: int
    arrival: float
    order: int
    footprint_blocks: int
    admitted: asyncio.Future
    first_token: asyncio.Future  # done when prefill has produced the first token (or finished)
    progress: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    state: str = "new"  # new -> waiting -> running -> done
    cached_tokens: int = 0
    computed: int = 0  # prompt tokens whose KV exists
    registered: int = 0  # prompt blocks already entered in the prefix cache
    blocks: list[int] = dataclasses.field(default_factory=list)
    reserved: int = 0
    produced: int = 0  # decode steps emitted
    generated: int = 0  # tokens emitted, over all choices
    last_emit: float = 0.0
    error: BaseException | None = None

    @property
    def steps(self) -> int:
        return max(self.choice_lengths, default=0)

    @property
    def prefill_total(self) -> int:
        return max(self.prompt_tokens, 1)  # an empty prompt still takes one forward pass

    def live(self, step: int) -> int:
        return sum(1 for length in self.choice_lengths if length > step)

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.order)


class BatchRun:
    """The request handler's side of a running job: waits for each decode step."""

    def __init__(self, job: BatchJob) -> None:
        self._job = job
        self._consumed = 0
        self.finish_reason = "stop"

    @property
    def cached_tokens(self) -> int:
        return self._job.cached_tokens

    async def step(self, tokens: int = 0) -> None:
        """Wait for the engine's next step of this request (``tokens`` is accounted by the engine)."""
        job = self._job
        while job.produced <= self._consumed:
            if job.error is not None:
                raise RuntimeError("simulator engine failed") from job.error
            if job.state == "done":
                raise RuntimeError("the request left the engine before all its steps")
            job.progress.clear()
            await job.progress.wait()
        self._consumed += 1


class BatchEngine:
    """A simulated vLLM engine core for one base model (and its LoRA adapters)."""

    def __init__(self, model: str, *, kv_cache_tokens: int, block_size: int, max_num_seqs: int,
                 max_loras: int | None, params: LatencyParams, prefix_caching: bool,
                 stats: EngineStats) -> None:
        if block_size < 1 or kv_cache_tokens < block_size:
            raise ValueError("the KV cache must hold at least one block")
        self.model = model
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras
        self.params = params
        self.prefix_caching = prefix_caching
        self.stats = stats
        self.pool = BlockPool(kv_cache_tokens // block_size)
        self.steps_run = 0
        self._waiting: list[BatchJob] = []  # sorted by (priority, arrival order)
        self._running: list[BatchJob] = []  # admission order
        self._order = itertools.count()
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    # -- observation -----------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def active_loras(self, *, running: bool) -> list[str]:
        jobs = self._running if running else self._waiting
        return [job.lora for job in jobs if job.lora is not None]

    def capacity_ok(self, footprint_tokens: int) -> bool:
        return math.ceil(footprint_tokens / self.block_size) <= self.pool.num_blocks

    def cached_prefix(self, hashes: Sequence[str], prompt_tokens: int) -> tuple[int, int]:
        """(leading blocks cached now, tokens a request sent now would find cached)."""
        if not self.prefix_caching:
            return 0, 0
        blocks = len(self.pool.lookup(hashes, len(hashes)))
        return blocks, min(blocks, self._hit_limit(prompt_tokens)) * self.block_size

    def state(self, *, with_hashes: bool = True) -> dict[str, Any]:
        pool = self.pool
        state: dict[str, Any] = {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "waiting_prompt_tokens": sum(job.prompt_tokens for job in self._waiting),
            "kv_cache_usage": pool.usage,
            "num_blocks": pool.num_blocks,
            "free_blocks": len(pool.free),
            "reserved_blocks": pool.reserved,
            "cached_blocks": len(pool.cached),
            "steps": self.steps_run,
        }
        if with_hashes:
            state["cached_block_hashes"] = sorted(pool.cached)
        return state

    # -- requests --------------------------------------------------------------

    def new_job(self, served_model: str, prompt_tokens: int, completion_tokens: int, priority: int, *,
                lora: str | None = None, hashes: Sequence[str] = (),
                choice_lengths: Sequence[int] = ()) -> BatchJob:
        loop = asyncio.get_running_loop()
        footprint = math.ceil((prompt_tokens + completion_tokens) / self.block_size)
        return BatchJob(served_model, lora, prompt_tokens, tuple(hashes), tuple(choice_lengths), priority,
                        loop.time(), next(self._order), max(footprint, 1), loop.create_future(),
                        loop.create_future())

    @contextlib.asynccontextmanager
    async def run(self, job: BatchJob) -> AsyncIterator[BatchRun]:
        """Queue ``job``; once prefilled (first token produced) yield a :class:`BatchRun`.

        Leaving the block by error or cancellation aborts the request (its
        blocks are freed, cached contents kept) and counts it with
        ``finished_reason="abort"`` if it had been admitted.
        """
        loop = asyncio.get_running_loop()
        self._submit(job)
        try:
            await job.admitted
        except BaseException:
            self._abort(job)
            raise
        run = BatchRun(job)
        try:
            await job.first_token
            yield run
        except BaseException:
            self.stats.finished["abort"] += 1
            raise
        else:
            self.stats.finished[run.finish_reason] += 1
            self.stats.e2e.observe(loop.time() - job.arrival)
        finally:
            self._abort(job)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    # -- internals -------------------------------------------------------------

    def _hit_limit(self, prompt_tokens: int) -> int:
        return max((prompt_tokens - 1) // self.block_size, 0)

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._loop(), name=f"simulator-engine-{self.model}")

    def _submit(self, job: BatchJob) -> None:
        self._ensure_loop()
        job.state = "waiting"
        bisect.insort(self._waiting, job, key=BatchJob.sort_key)
        assert self._wake is not None
        self._wake.set()

    def _abort(self, job: BatchJob) -> None:
        if job.state == "waiting":
            self._waiting.remove(job)
            job.state = "done"
        elif job.state == "running":
            self._release(job)
        for future in (job.admitted, job.first_token):
            if not future.done():
                future.cancel()
        if self._wake is not None:
            self._wake.set()  # whatever was blocked on this request may proceed

    def _release(self, job: BatchJob) -> None:
        self._running.remove(job)
        self.pool.release(job.blocks)
        self.pool.reserved -= job.reserved
        job.blocks, job.reserved, job.state = [], 0, "done"
        job.progress.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        clock = loop.time()
        try:
            while True:
                plan, seqs, prefill_tokens = self._schedule()
                if not plan:
                    wake.clear()
                    await wake.wait()
                    clock = loop.time()
                    continue
                duration = self.params.step_seconds(seqs, prefill_tokens)
                now = loop.time()
                # absorb timer overshoot of up to one step, never run ahead of real time
                clock = (clock if now - clock <= duration else now) + duration
                await asyncio.sleep(max(clock - loop.time(), 0.0))
                self.steps_run += 1
                self._apply(plan, loop.time())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a simulator bug: fail every request rather than hang them
            log.exception("simulator engine %s failed", self.model)
            for job in self._running + self._waiting:
                job.error = exc
                job.progress.set()
                for future in (job.admitted, job.first_token):
                    if not future.done():
                        future.set_exception(exc)
            raise

    def _schedule(self) -> tuple[list[tuple[BatchJob, int]], int, int]:
        """Plan one step: [(job, prefill chunk or 0 for a decode)], sequences, prefill tokens."""
        budget = self.params.max_num_batched_tokens
        plan: list[tuple[BatchJob, int]] = []
        seqs = prefill_tokens = 0
        for job in self._running:
            if budget <= 0:
                break
            if job.computed < job.prefill_total:
                chunk = min(job.prefill_total - job.computed, budget)
                plan.append((job, chunk))
                seqs, prefill_tokens, budget = seqs + 1, prefill_tokens + chunk, budget - chunk
            elif job.produced < job.steps:
                live = job.live(job.produced)
                plan.append((job, 0))
                seqs, budget = seqs + live, budget - live
        if budget > 0:
            for job in self._admit():
                chunk = min(job.prefill_total - job.computed, budget)
                plan.append((job, chunk))
                seqs, prefill_tokens, budget = seqs + 1, prefill_tokens + chunk, budget - chunk
                if budget <= 0:
                    break
        return plan, seqs, prefill_tokens

    def _admit(self) -> Iterable[BatchJob]:
        """Admit waiting requests FCFS while slots, KV blocks and LoRA slots allow (a generator:
        the caller stops it when the step's token budget is spent)."""
        loop = asyncio.get_running_loop()
        pool = self.pool
        running_loras = {job.lora for job in self._running if job.lora is not None}
        index = 0
        while index < len(self._waiting) and len(self._running) < self.max_num_seqs:
            job = self._waiting[index]
            if (job.lora is not None and self.max_loras is not None and job.lora not in running_loras
                    and len(running_loras) >= self.max_loras):
                index += 1  # its adapter has no slot in this batch: skipped, keeps its place
                continue
            hits = pool.lookup(job.hashes, self._hit_limit(job.prompt_tokens)) if self.prefix_caching else []
            revived = sum(1 for block in hits if pool.ref[block] == 0)
            new_blocks = job.footprint_blocks - len(hits)
            if new_blocks > pool.available - revived:
                return  # strict FCFS: the head waits for memory, nothing behind it jumps ahead
            del self._waiting[index]
            pool.touch(hits)
            job.blocks = list(hits)
            job.cached_tokens = job.computed = len(hits) * self.block_size
            job.registered = len(hits)
            prompt_blocks = max(math.ceil(job.prompt_tokens / self.block_size) - len(hits), 0)
            job.blocks.extend(pool.allocate() for _ in range(prompt_blocks))
            job.reserved = new_blocks - prompt_blocks
            pool.reserved += job.reserved
            job.state = "running"
            self._running.append(job)
            if job.lora is not None:
                running_loras.add(job.lora)
            stats = self.stats
            if self.prefix_caching:
                stats.prefix_cache_queries += job.prompt_tokens
                stats.prefix_cache_hits += job.cached_tokens
            stats.queue_time.observe(loop.time() - job.arrival)
            job.admitted.set_result(None)
            yield job

    def _apply(self, plan: list[tuple[BatchJob, int]], now: float) -> None:
        for job, chunk in plan:
            if job.state != "running":
                continue  # aborted while the step ran
            if job.computed < job.prefill_total:
                job.computed += chunk
                self._register_prompt_blocks(job)
                if job.computed < job.prefill_total:
                    continue
                self.stats.prompt_tokens += job.prompt_tokens
                if job.steps == 0:  # nothing to generate (embeddings): done with its prefill
                    job.first_token.set_result(None)
                    self._release(job)
                    continue
            self._emit(job, now)

    def _register_prompt_blocks(self, job: BatchJob) -> None:
        if not self.prefix_caching:
            return
        full = min(job.computed // self.block_size, len(job.hashes))
        while job.registered < full:
            self.pool.register(job.blocks[job.registered], job.hashes[job.registered])
            job.registered += 1

    def _emit(self, job: BatchJob, now: float) -> None:
        live = job.live(job.produced)
        job.produced += 1
        job.generated += live
        stats = self.stats
        stats.generation_tokens += live
        if job.produced == 1:
            stats.ttft.observe(now - job.arrival)
            job.first_token.set_result(None)
        else:
            stats.itl.observe(now - job.last_emit)
        job.last_emit = now
        needed = math.ceil((job.prompt_tokens + job.generated) / self.block_size)
        while len(job.blocks) < needed and job.reserved > 0:
            job.blocks.append(self.pool.allocate())
            job.reserved -= 1
            self.pool.reserved -= 1
        job.progress.set()
        if job.produced >= job.steps:
            self._release(job)  # finished: its blocks are free (cached prompt blocks stay cached)
