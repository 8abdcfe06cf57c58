"""Paged KV-cache bookkeeping with prefix caching: which block ids a request uses. Full blocks
only are hashed, chained: h1 = H(h0, t16..t31); h0 = H(seed, t0..t15), seeded by LoRA adapter
and RoPE length class. A block is referenced or in the LRU free list, never both; a free block
keeps its cached prefix until reallocated."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from expresslane.contract import NULL_BLOCK_ID
from expresslane.scheduler.request import Request


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    data = array("q", token_ids).tobytes()
    return hashlib.sha256((parent or b"") + data).digest()


class BlockPool:
    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        self.fence: Callable[[], frozenset[int]] | None = None  # steps in flight (two lanes)
        self._held: dict[int, tuple[Block, frozenset[int]]] = {}  # freed, until they land

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # lazy eviction of a cached prefix
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Reference prefix-cache hits (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0 and self._free.pop(block.block_id, None) is None:
                del self._held[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks_in_eviction_order: list[Block]) -> None:
        steps = self.fence() if self.fence is not None and blocks_in_eviction_order else None
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if steps:
                    self._held[block.block_id] = (block, steps)
                else:
                    self._free[block.block_id] = block

    def landed(self, step_id: int) -> None:
        for block_id, (block, steps) in list(self._held.items()):
            if step_id in steps:
                steps = steps - {step_id}
                if steps:
                    self._held[block_id] = (block, steps)
                else:
                    del self._held[block_id]
                    self._free[block_id] = block

    def register(self, block: Block, block_hash: bytes) -> None:
        """Publish a full block for reuse; first writer wins."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block


class KVCacheManager:
    """A block list per request and KV group (`windows`: each one's window), from one pool;
    a windowed group frees blocks before a step's window::

        window 8, block 4, next query at 13:  [None, None, b7, b2]   keys 6..13 visible
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,), length_class: Callable[[int], int] | None = None):
        for window in windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
        self.block_size = block_size
        self.length_class = length_class
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[list[Block | None]]] = {}  # per group
        self._req_hashes: dict[str, list[bytes]] = {}
        self._req_num_registered: dict[str, int] = {}
        self._req_num_dropped: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.window_freed_blocks = 0
        self.window_saved_blocks = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """From the `start`-th block on, group after group."""
        return [NULL_BLOCK_ID if b is None else b.block_id
                for blocks in self._req_blocks.get(request_id, ()) for b in blocks[start:]]

    def first_needed_block(self, position: int, group: int = 0) -> int:
        """The first block a query at `position` reads."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, position - window + 1) // self.block_size

    def _block_hashes(self, req: Request) -> list[bytes]:
        hashes = self._req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        seed = req.cache_salt
        if not hashes and self.length_class is not None:
            cls = self.length_class(req.rope_length)
            if cls:
                seed = hashlib.sha256((seed or b"") + b"rope-length-class:%d" % cls).digest()
        while (len(hashes) + 1) * bs <= req.num_tokens:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else seed, req.all_token_ids[i * bs:(i + 1) * bs]))
        return hashes

    @staticmethod
    def _group_key(block_hash: bytes, group: int) -> bytes:
        return block_hash + group.to_bytes(2, "little") if group else block_hash

    def find_cached_prefix(self, req: Request) -> list[tuple[Block | None, ...]]:
        """Longest cached prefix of full blocks of a request with no KV yet: each group's
        (None before its window)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(req)[:max_blocks]
        groups = range(self.num_groups)
        best, runs = 0, [0] * self.num_groups
        for i, block_hash in enumerate(hashes):
            for g in groups:
                runs[g] = runs[g] + 1 if self.pool.lookup(self._group_key(block_hash, g)) is not None else 0
            if any(runs[g] <= i for g in groups if self.windows[g] is None):
                break
            if all(runs[g] >= i + 1 - self.first_needed_block((i + 1) * self.block_size, g) for g in groups):
                best = i + 1
        first = [self.first_needed_block(best * self.block_size, g) for g in groups]
        return [tuple(None if i < first[g] else self.pool.lookup(self._group_key(hashes[i], g)) for g in groups)
                for i in range(best)]

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int, cached: list[tuple[Block | None, ...]] = ()) -> bool:
        """Room for `num_new_tokens` more (after `cached` hits); False if out of blocks."""
        rid = req.request_id
        groups = self._req_blocks.get(rid)
        num_computed = req.num_computed_tokens + len(cached) * self.block_size
        total = num_computed + num_new_tokens
        have = len(groups[0]) if groups else 0
        per_group = max(0, -(-total // self.block_size) - have - len(cached))
        firsts = [self.first_needed_block(num_computed, g) for g in range(self.num_groups)]
        if groups:
            for g, first in enumerate(firsts):
                self._drop(rid, g, first)
        kept = [[row[g] for row in cached[first:] if row[g] is not None] for g, first in enumerate(firsts)]
        reviving = sum(1 for blocks in kept for b in blocks if b.ref_cnt == 0)
        if per_group * self.num_groups > self.pool.num_free - reviving:
            return False
        if groups is None:
            groups = self._req_blocks[rid] = [[] for _ in self.windows]
            self._req_num_dropped[rid] = [0] * self.num_groups
        for blocks in kept:  # before allocate takes one
            self.pool.touch(blocks)
        for g, blocks in enumerate(groups):
            if cached:
                skipped = min(firsts[g], len(cached))
                blocks.extend([None] * skipped)
                self._req_num_dropped[rid][g] = skipped
                self.window_saved_blocks += skipped
                blocks.extend(kept[g])
            if per_group:
                blocks.extend(self.pool.allocate(per_group))
        if self.enable_prefix_caching and self.pool.fence is None:  # blocks of known tokens only
            self._register_full_blocks(req, groups, min(total, req.num_tokens) // self.block_size)
        return True

    def two_lanes(self, in_flight: Callable[[], frozenset[int]]) -> None:
        """Freed blocks wait for `in_flight()` to land; blocks publish on landing."""
        self.pool.fence = in_flight

    def blocks_of(self, request_id: str) -> list[list[Block | None]] | None:
        return self._req_blocks.get(request_id)

    def publish_landed(self, req: Request, end: int, blocks: list[list[Block | None]] | None) -> None:
        """KV up to `end` landed in `blocks`, if still `req`'s."""
        if self.enable_prefix_caching and blocks is not None and self._req_blocks.get(req.request_id) is blocks:
            self._register_full_blocks(req, blocks, min(end, req.num_tokens) // self.block_size)

    def _drop(self, request_id: str, group: int, upto: int) -> None:
        dropped = self._req_num_dropped[request_id]
        start = dropped[group]
        if upto <= start:
            return
        blocks = self._req_blocks[request_id][group]
        freed = [b for b in blocks[start:upto] if b is not None]
        blocks[start:upto] = [None] * (upto - start)
        self.pool.release(freed)
        dropped[group] = upto
        self.window_freed_blocks += len(freed)
        self.window_saved_blocks += upto - start

    def _register_full_blocks(self, req: Request, groups: list[list[Block | None]], num_full: int) -> None:
        start = self._req_num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req)
        for g, blocks in enumerate(groups):
            for i in range(start, num_full):
                if blocks[i] is not None:
                    self.pool.register(blocks[i], self._group_key(hashes[i], g))
        self._req_num_registered[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Drop the blocks, tail first in eviction order."""
        groups = self._req_blocks.pop(req.request_id, [])
        tail_first = [blocks[i] for i in range(len(groups[0]) - 1, -1, -1) for blocks in groups] if groups else []
        self.pool.release([b for b in tail_first if b is not None])
        self._req_num_registered.pop(req.request_id, None)
        self.window_saved_blocks -= sum(self._req_num_dropped.pop(req.request_id, ()))
        if req.is_finished:
            self._req_hashes.pop(req.request_id, None)

    def forget_hashes(self, request_id: str) -> None:
        self._req_hashes.pop(request_id, None)

    def held_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for blocks in self._req_blocks.get(request_id, ()) for b in blocks if b is not None]

    def num_held_blocks(self, request_id: str | None = None, group: int | None = None) -> int:
        requests = self._req_blocks.values() if request_id is None else [self._req_blocks.get(request_id, ())]
        return sum(1 for groups in requests for g, blocks in enumerate(groups) if group in (None, g)
                   for b in blocks if b is not None)


def max_blocks_per_request(max_model_len: int, block_size: int, windows: tuple[int | None, ...],
                           max_step_tokens: int) -> int:
    """Blocks one request holds at once: a windowed group's the window - 1 + a step's keys,
    straddling one more block."""
    full = -(-max_model_len // block_size)
    return sum(full if window is None else min(full, -(-(window - 1 + max_step_tokens) // block_size) + 1)
               for window in windows)
