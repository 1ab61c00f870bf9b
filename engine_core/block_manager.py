"""The KV block pool: reference counts, an LRU free queue and the prefix cache.

Block 0 is the null block: never handed out, always zero. Padded gathers of the
block table point at it, so padding never reads uninitialised memory.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

from engine_core.request import Request

if TYPE_CHECKING:
    from engine_core.lora_manager import LoraSpec

NULL_BLOCK = 0


def _chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    # A cryptographic digest: Python's hash() of an int tuple is easy to collide on
    # purpose, and a collision would serve one client's KV to another.
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Hands out fixed-size KV blocks to requests and shares full blocks by content."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Head = least recently freed = next to be reused (and evicted from the cache).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up, like vLLM
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_blocks(self, request: Request) -> None:
        """Extend the request's chained hashes over its newly full blocks."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        # A LoRA request's chain starts from its adapter's digest: the same tokens under
        # another adapter (or none) never share KV.
        parent = hashes[-1] if hashes else request.hash_seed
        for i in range(len(hashes), len(tokens) // bs):
            parent = _chain_hash(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix.

        Never the whole sequence: the last token must be computed to sample from it.
        """
        if not self.enable_prefix_caching:
            return []
        self.hash_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate(
        self, request: Request, num_new_tokens: int, hits: list[int] | tuple[()] = ()
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after `hits`).

        All or nothing: on False nothing changed.
        """
        ref_counts = self.ref_counts
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new = needed - len(request.block_ids) - len(hits)
        num_revived = sum(1 for b in hits if ref_counts[b] == 0)
        if num_new + num_revived > len(self.free_queue):
            return False
        for block in hits:
            if ref_counts[block] == 0:
                del self.free_queue[block]
            ref_counts[block] += 1
        if hits:
            request.block_ids.extend(hits)
            request.num_cached_blocks = len(request.block_ids)
        for _ in range(max(num_new, 0)):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            self.block_hash[block] = None
            if self.cached.get(block_hash) == block:
                del self.cached[block_hash]

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = request.num_cached_blocks
        if num_full <= start:
            return
        self.hash_blocks(request)
        for i in range(start, num_full):
            block_hash = request.block_hashes[i]
            block = request.block_ids[i]
            # A twin computed concurrently by another request keeps the entry.
            if block_hash not in self.cached:
                self.cached[block_hash] = block
                self.block_hash[block] = block_hash
        request.num_cached_blocks = num_full

    def blocks_to_fork(self, request: Request) -> int:
        """New blocks a fork of the request needs: one when its last block is partial."""
        return 1 if request.num_computed_tokens % self.block_size else 0

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give `child` the parent's computed blocks, copy-on-write: full blocks are shared
        by reference; a partial last block, which both will write next, is the one block
        copied. Returns that copy as (source, destination) for the runner, or None.

        The caller made sure a free block is there (blocks_to_fork)."""
        ids = parent.block_ids
        shared = ids[:-1] if self.blocks_to_fork(parent) else ids[:]
        ref_counts = self.ref_counts
        for block in shared:
            ref_counts[block] += 1
        child.block_ids = shared
        child.num_cached_blocks = min(parent.num_cached_blocks, len(shared))
        if len(shared) == len(ids):
            return None
        block, _ = self.free_queue.popitem(last=False)
        self._evict(block)
        ref_counts[block] = 1
        shared.append(block)
        return ids[-1], block

    def free(self, request: Request) -> None:
        """Release the request's blocks; their content stays cached until reused."""
        ref_counts = self.ref_counts
        # Tail blocks first, so they are evicted before the prefix they extend.
        for block in reversed(request.block_ids):
            ref_counts[block] -= 1
            if ref_counts[block] == 0:
                self.free_queue[block] = None
        request.block_ids = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True


def hash_seed(lora: LoraSpec | None, cache_salt: str | None) -> bytes:
    """Where a request's prefix-cache hash chain starts: the same tokens under another
    adapter or another salt (or none) never share KV."""
    digest = b"" if lora is None else lora.digest
    if cache_salt is None:
        return digest
    salt = hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
    return hashlib.blake2b(b"salt" + salt + digest, digest_size=16).digest()
