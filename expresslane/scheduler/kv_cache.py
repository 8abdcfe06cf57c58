"""Paged KV-cache bookkeeping with prefix caching: which block ids a request uses. Full blocks
only are hashed, chained: h1 = H(h0, t16..t31); h0 = H(seed, t0..t15), the seed from the
request's LoRA adapter and its RoPE length class (layers/rotary.py), so neither adapters nor
classes share blocks. A block is referenced or in the LRU free list, never both; a free block
keeps its cached prefix until reallocated."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

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
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks_in_eviction_order: list[Block]) -> None:
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def register(self, block: Block, block_hash: bytes) -> None:
        """Publish a full block for reuse; first writer wins."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 length_class: Callable[[int], int] | None = None):
        self.block_size = block_size
        self.length_class = length_class
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[Block]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        self._req_num_registered: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """From the `start`-th block on."""
        return [b.block_id for b in self._req_blocks.get(request_id, ())[start:]]

    def _block_hashes(self, req: Request) -> list[bytes]:
        hashes = self._req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        seed = req.cache_salt  # the adapter's (LoRA), then RoPE's length class
        if not hashes and self.length_class is not None:
            cls = self.length_class(req.rope_length)
            if cls:
                seed = hashlib.sha256((seed or b"") + b"rope-length-class:%d" % cls).digest()
        while (len(hashes) + 1) * bs <= req.num_tokens:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else seed, req.all_token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, req: Request) -> list[Block]:
        """Longest cached prefix of full blocks, for a request with no KV yet."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in self._block_hashes(req)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int, cached: list[Block] = ()) -> bool:
        """Room for `num_new_tokens` more (after `cached` hits); False if out of blocks."""
        blocks = self._req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(cached) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(cached)
        reviving = sum(1 for b in cached if b.ref_cnt == 0)
        if num_needed > self.pool.num_free - reviving:
            if not blocks:
                del self._req_blocks[req.request_id]
            return False
        self.pool.touch(list(cached))
        blocks.extend(cached)
        if num_needed > 0:
            blocks.extend(self.pool.allocate(num_needed))
        if self.enable_prefix_caching:  # blocks of known tokens only
            self._register_full_blocks(req, blocks, min(total, req.num_tokens) // self.block_size)
        return True

    def _register_full_blocks(self, req: Request, blocks: list[Block], num_full: int) -> None:
        start = self._req_num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req)
        for i in range(start, num_full):
            self.pool.register(blocks[i], hashes[i])
        self._req_num_registered[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Drop the blocks, tail first in eviction order."""
        blocks = self._req_blocks.pop(req.request_id, [])
        self.pool.release(blocks[::-1])
        self._req_num_registered.pop(req.request_id, None)
        if req.is_finished:
            self._req_hashes.pop(req.request_id, None)

    def forget_hashes(self, request_id: str) -> None:
        self._req_hashes.pop(request_id, None)

    def num_held_blocks(self) -> int:
        return sum(len(b) for b in self._req_blocks.values())
