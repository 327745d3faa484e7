"""Page bookkeeping for the paged latent KV cache, with a page-granular prefix cache.

The cache tensor itself ([layers, pages, page_size, R+P]) lives in the attention backend; this module
only decides which pages a request owns. A full page whose KV has been computed is registered under a
chain hash of all tokens up to its end, so a later request sharing that prefix reuses it (ref-counted,
read-only). Unreferenced cached pages stay resident until the allocator needs them (LRU eviction).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def page_hashes(token_ids: list[int], page_size: int, n_pages: int, parent: bytes = b"") -> list[bytes]:
    """Chain hashes of the first n_pages full pages: h_i = sha256(h_{i-1} || tokens of page i)."""
    out = []
    for i in range(n_pages):
        chunk = np.asarray(token_ids[i * page_size : (i + 1) * page_size], dtype=np.int64).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        out.append(parent)
    return out


class KVPool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.ref = [0] * num_pages
        self.page_hash: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}  # hash -> page
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages with ref 0, LRU first
        self.hits = self.queries = 0  # prefix-cache stats, in tokens

    # ---- accounting ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can get now (free + evictable)."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def check(self) -> None:
        """Invariant: every page is exactly one of free, evictable, or referenced."""
        referenced = {p for p in range(self.num_pages) if self.ref[p] > 0}
        free, evict = set(self.free_pages), set(self.evictable)
        assert len(free) == len(self.free_pages), "duplicate page in free list"
        assert not (free & evict) and not (free & referenced) and not (evict & referenced)
        assert len(free) + len(evict) + len(referenced) == self.num_pages, "a page is lost"

    # ---- prefix cache ------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Pages holding the longest cached page-aligned prefix of token_ids, referenced for the caller.
        At most len-1 tokens match: the last token must be computed to produce logits."""
        if not self.enable_prefix_caching:
            return []
        n_full = (len(token_ids) - 1) // self.page_size
        pages = []
        for h in page_hashes(token_ids, self.page_size, n_full):
            p = self.cached.get(h)
            if p is None:
                break
            pages.append(p)
        for p in pages:
            self._ref(p)
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """Another reference to each of `pages` (full, computed pages of a prompt that a sibling request shares)."""
        for p in pages:
            assert self.ref[p] > 0, f"page {p} is not held"
            self._ref(p)
        return list(pages)

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit

    def commit(self, token_ids: list[int], pages: list[int], num_computed: int, num_committed: int) -> int:
        """Register the request's full pages computed since `num_committed` pages; returns the new count."""
        if not self.enable_prefix_caching:
            return num_committed
        n_full = min(num_computed, len(token_ids)) // self.page_size
        if n_full <= num_committed:
            return num_committed
        hashes = page_hashes(token_ids, self.page_size, n_full)
        for i in range(num_committed, n_full):
            h, p = hashes[i], pages[i]
            if h not in self.cached and p not in self.page_hash:
                self.cached[h] = p
                self.page_hash[p] = h
        return n_full

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages, evicting unreferenced cached pages LRU-first; None (and nothing taken) if short."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self.free_pages:
                p = self.free_pages.pop()
            else:
                p, _ = self.evictable.popitem(last=False)
                del self.cached[self.page_hash.pop(p)]
            self.ref[p] = 1
            out.append(p)
        return out

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; cached pages stay resident (evictable), others go free.
        Freed in reverse so a request's tail pages are evicted before its shared head."""
        for p in reversed(pages):
            assert self.ref[p] > 0, f"page {p} freed twice"
            self.ref[p] -= 1
            if self.ref[p] == 0:
                if p in self.page_hash:
                    self.evictable[p] = None
                else:
                    self.free_pages.append(p)

    def _ref(self, p: int) -> None:
        if self.ref[p] == 0:
            self.evictable.pop(p, None)
        self.ref[p] += 1

    def reset_prefix_cache(self) -> None:
        for p in list(self.evictable):
            del self.cached[self.page_hash.pop(p)]
            self.free_pages.append(p)
        self.evictable.clear()
