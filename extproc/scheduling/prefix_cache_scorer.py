"""Scorer `prefix-cache-scorer`: endpoints that recently served the same prompt prefix score higher (approximate).

What: the Gateway API Inference Extension's `prefix-cache-scorer` (pkg/epp/scheduling/framework/
plugins/prefixcachescorer/plugin.go), learned from our own routing: the prompt
(`ctx.request.prompt_text()`: a completion's `prompt`, or the text of the chat messages joined
with newlines) in UTF-8 is cut into blocks of `blockSize` bytes (a last partial block is ignored, as
GIE does; a prompt shorter than one block has no blocks and scores 0 everywhere), at most
`maxPrefixBlocksToMatch` of them; each block gets a cumulative hash, so block i's hash names the
whole prefix up to it. After the decision (`picked(ctx, endpoint)`, called by the profile: GIE's
PreRequest) the picked endpoint's index records every block hash of the prompt. The index is one
LRU per endpoint bounded by `lruCapacityPerServer` blocks: an endpoint's model server evicts its
own cache in LRU order too, so old prefixes fade from both. Score: the share of the prompt's
leading blocks that the endpoint's index holds.
Hashes: a chained CRC-32 of the prompt's UTF-8 bytes, never Python's salted `hash()`: c_0 =
crc32(model name), c_i = crc32(block_i, c_(i-1)), which is the CRC of the model name followed by
the whole prefix up to block i (zlib's running CRC); the key of block i is (i << 32) | c_i, an int,
so a false match needs two prefixes of the same depth with the same 32-bit CRC (about 2^-32 per
pair: with 31250 blocks in an index, one false partial match in about 10^5 lookups, which scores
one endpoint too high once; this is an approximate scorer). The model is in c_0 so two models never
share a prefix. A first version chained blake2b digests: 24 us for a 9 KB prompt against 7 us here.
Block size: bytes of the UTF-8 prompt (as GIE's Go code slices its string), not tokens (nothing is
tokenised in the gateway). Default 64, GIE's default ("vLLM default token block size is 16, and a
good guess of average characters per token is 4"), i.e. about one vLLM KV block per index block.
Leading match: blocks are inserted deepest first, so an endpoint's leading blocks of a prompt are
always at least as recent as its later ones and the LRU evicts a prefix from its tail; the blocks
an endpoint holds of a prompt are therefore always a leading run, found by binary search.
Staleness and sharing: per worker. Each worker learns only from its own picks (with N workers
each sees about 1/N of the traffic, so a prefix sent to endpoint A by worker 1 is unknown to
worker 2 until worker 2 sends it somewhere itself); nothing is shared across workers yet, and
the index does not know what the engine actually evicted (the `oracle` policy of the benchmark
reads the simulator's true cache for comparison). An endpoint removed from the config keeps its
(bounded) index until the worker restarts; a change of `blockSize` empties the index (its hashes
no longer match), a smaller capacity trims the index.
Formula: blocks = floor(min(len(utf8(prompt)), blockSize * maxPrefixBlocksToMatch) / blockSize);
score(e) = matched_leading_blocks(e) / blocks (0 when blocks = 0). Bounded: the framework only clamps.
Parameters: `blockSize` (bytes, default 64), `maxPrefixBlocksToMatch` (default 256),
`lruCapacityPerServer` (blocks per endpoint, default 31250: GIE's, sized for Llama-3-8B on an
H100's free HBM, 500K tokens / 16 per block); `capacityLabel` (default none: the name of an
endpoint label holding its KV-cache size in tokens, e.g. `kv-tokens`; an endpoint with a positive
number there gets an index of max(1, floor(tokens x bytesPerToken / blockSize)) blocks, so the
index forgets about when the engine must: an index much larger than the engine's cache keeps
calling a prefix warm after the engine evicted it, and the request pays a cold prefill where the
score promised a warm one), `bytesPerToken` (default 4).
Shared with later plugins of the profile: `ctx.cycle["prefix_match"]` (each candidate's score) and
`ctx.cycle["prompt_bytes"]` (the prompt's UTF-8 length); predicted-ttft-scorer reads them.
Native: the three inner loops (block keys, the leading-run search, recording a pick) are in C
(`_prefix.c`, built by setup.py when a compiler is there; `block_hashes_py`, `matched_py` and
`record_py` are the reference, used otherwise, and the tests check both agree).
Data consumed: the request's prompt and model, this plugin's own index. Cost (2 shared cores, 8
endpoints): hashing about 0.13 us per block in C, 0.27 us in Python (a 9 KB prompt at blockSize
256: 36 blocks, 4.8 against 9.6 us; zlib's per-call cost dominates at 256 bytes, the CRC of the
whole 9 KB alone is 1.5 us), computed once per decision (`ctx.cycle`); O(log blocks) int lookups
per candidate to score; about 0.1 us (C) or 0.2 us (Python) per block to record the pick. Memory about 100 bytes per indexed block (31250 blocks = about
3 MB per endpoint at the default capacity).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import PREFILL_ATTR, Parameters, Plugin
from extproc.scheduling.selectors import positive_label

try:  # the C inner loops (setup.py builds them; optional): the same results, about half the cost
    from extproc.scheduling import _prefix as _native
except ImportError:  # not built: the pure-Python loops below
    _native = None

_crc32 = zlib.crc32
# what score() leaves in `ctx.cycle` for the profile's later plugins: {endpoint: matched share}, and
# the prompt's length in UTF-8 bytes
PREFIX_MATCH = "prefix_match"
PROMPT_BYTES = "prompt_bytes"


class PrefixCacheScorerParameters(Parameters):
    block_size: int = Field(default=64, alias="blockSize", ge=1)
    max_prefix_blocks_to_match: int = Field(default=256, alias="maxPrefixBlocksToMatch", ge=1)
    lru_capacity_per_server: int = Field(default=31250, alias="lruCapacityPerServer", ge=1)
    # an endpoint's index sized from its own KV-cache label (tokens) instead: tokens x bytesPerToken / blockSize
    capacity_label: str | None = Field(default=None, alias="capacityLabel", min_length=1)
    bytes_per_token: float = Field(default=4.0, alias="bytesPerToken", gt=0.0, allow_inf_nan=False)


def block_hashes(model: str | None, prompt: str | bytes, block_size: int, max_blocks: int) -> list[int]:
    """The cumulative key of each full leading block of `prompt`'s UTF-8 bytes (at most `max_blocks`),
    in C when the accelerator is built, else `block_hashes_py`: the same keys."""
    data = prompt.encode() if isinstance(prompt, str) else prompt
    if _native is not None:
        return _native.block_keys(_crc32((model or "").encode()), data, block_size, max_blocks)
    return block_hashes_py(model, data, block_size, max_blocks)


def block_hashes_py(model: str | None, data: bytes, block_size: int, max_blocks: int) -> list[int]:
    """`block_hashes` in Python (the reference the C version is tested against)."""
    n = min(len(data) // block_size, max_blocks)
    crc = _crc32((model or "").encode())
    view = memoryview(data)
    out = []
    append = out.append
    for depth, i in enumerate(range(0, n * block_size, block_size), 1):
        crc = _crc32(view[i:i + block_size], crc)
        append(depth << 32 | crc)
    return out


def matched_py(lru: OrderedDict, hashes: list[int]) -> int:
    """How many leading `hashes` the index holds, by binary search (they are always a leading run)."""
    if not lru or not hashes or hashes[0] not in lru:
        return 0
    lo, hi = 1, len(hashes)  # hashes[:lo] held; find the largest such lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in lru:
            lo = mid
        else:
            hi = mid - 1
    return lo


def record_py(lru: OrderedDict, hashes: list[int], capacity: int) -> None:
    """Every hash into the LRU, deepest first (the leading blocks end most recent, evicted last), then
    the oldest evicted down to `capacity`."""
    move = lru.move_to_end
    for h in reversed(hashes):
        if h in lru:
            move(h)
        else:
            lru[h] = None
    while len(lru) > capacity:
        lru.popitem(last=False)


class PrefixCacheScorer(Plugin):
    type: ClassVar[str] = "prefix-cache-scorer"
    slot: ClassVar[str] = "scorer"
    bounded: ClassVar[bool] = True
    Parameters: ClassVar[type] = PrefixCacheScorerParameters

    def __init__(self, name: str, params: PrefixCacheScorerParameters, runtime: Any):
        super().__init__(name, params, runtime)
        self.index: dict[str, OrderedDict[int, None]] = {}  # endpoint -> LRU of block hashes (oldest first)
        self._capacity: dict[str, tuple[Any, int]] = {}  # endpoint -> (labels object, its index capacity)

    def capacity(self, labels: Any, endpoint: str) -> int:
        """The endpoint's index capacity in blocks: from its `capacityLabel` (KV tokens) when set and a
        positive number there, else `lruCapacityPerServer` (kept per labels object)."""
        found = self._capacity.get(endpoint)
        if found is not None and found[0] is labels:
            return found[1]
        p = self.params
        tokens = positive_label(labels, endpoint, p.capacity_label) if p.capacity_label else None
        cap = max(1, int(tokens * p.bytes_per_token / p.block_size)) if tokens is not None else p.lru_capacity_per_server
        self._capacity[endpoint] = (labels, cap)
        return cap

    def configure(self, old: PrefixCacheScorerParameters, new: PrefixCacheScorerParameters) -> None:
        self.params = new
        if old.block_size != new.block_size:
            self.index.clear()
        else:  # capacities as the new parameters say (with the labels last seen), trimmed now
            seen, self._capacity = self._capacity, {}
            for e, lru in self.index.items():
                cap = self.capacity(seen[e][0] if e in seen else {}, e)
                while len(lru) > cap:
                    lru.popitem(last=False)

    def hashes(self, ctx: Any) -> list[int]:
        """The prompt's block hashes for this decision (computed once, kept in `ctx.cycle`)."""
        key = (self.name, "hashes")
        found = ctx.cycle.get(key)
        if found is None:
            req = ctx.request
            if req is None:
                found = []
            else:
                p = self.params
                data = req.prompt_text().encode()
                ctx.cycle[PROMPT_BYTES] = len(data)
                found = block_hashes(req.model, data, p.block_size, p.max_prefix_blocks_to_match)
            ctx.cycle[key] = found
        return found

    def matched(self, endpoint: str, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the endpoint's index holds."""
        lru = self.index.get(endpoint)
        if not lru or not hashes or hashes[0] not in lru:
            return 0
        return _native.matched(lru, hashes) if _native is not None else matched_py(lru, hashes)

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        hashes = self.hashes(ctx)
        if not hashes:
            out = dict.fromkeys(candidates, 0.0)
        else:
            total = float(len(hashes))
            first = hashes[0]
            index_get = self.index.get
            count = _native.matched if _native is not None else matched_py
            out = {}
            for e in candidates:  # self.matched(e, hashes) / total, inlined
                lru = index_get(e)
                out[e] = count(lru, hashes) / total if lru and first in lru else 0.0
        ctx.cycle[PREFIX_MATCH] = out  # for later plugins of the profile (predicted-ttft-scorer)
        return out

    def picked(self, ctx: Any, endpoint: str) -> None:
        hashes = self.hashes(ctx)
        state = getattr(ctx, "state", None)
        if state is not None and ctx.request is not None:  # what the pick must prefill: its uncached part
            share = (ctx.cycle.get(PREFIX_MATCH) or {}).get(endpoint, 0.0)
            state.attrs[PREFILL_ATTR] = int(ctx.request.prompt_tokens_estimate() * (1.0 - share))
        if not hashes:
            return
        lru = self.index.get(endpoint)
        if lru is None:
            lru = self.index[endpoint] = OrderedDict()
        cap = self.capacity(getattr(ctx, "labels", None) or {}, endpoint)
        if _native is not None:
            _native.record(lru, hashes, cap)
        else:
            record_py(lru, hashes, cap)
