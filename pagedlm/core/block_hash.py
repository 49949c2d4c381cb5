"""Prefix-cache block hashes: what a full block of tokens is known by.

A block's hash is chained over its parent block's hash, its token ids and its extra keys (the
request's `cache_salt` on the first block; an adapter id later), so one hash stands for the
whole prefix up to that block. Two algorithms:

- ``sha256`` (default): SHA-256 over a fixed byte encoding. On a shared server a prompt crafted
  to collide with another tenant's prefix would otherwise be served from that tenant's KV blocks
  (the attack of vLLM's advisory GHSA-rm76-4mrf-v9r8, after which it moved to sha256 too).
- ``builtin``: Python's hash() of a tuple: 64 bits, deterministic for ints, unkeyed. Faster, and
  only for single-tenant use.

Either way the BlockPool keeps each cached block's (parent hash, token ids, extra keys) and a
lookup compares them before a block is reused, so a forged collision can at worst miss.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Callable

from pagedlm.config import HASH_ALGOS

BlockHash = bytes | int
ExtraKeys = tuple[str | int, ...]


def _encode_extra(extra_keys: ExtraKeys) -> bytes:
    parts = []
    for key in extra_keys:
        if isinstance(key, str):
            raw = key.encode()
            parts.append(b"s" + struct.pack("<Q", len(raw)) + raw)
        else:
            parts.append(b"i" + struct.pack("<q", key))
    return b"".join(parts)


def sha256_block_hash(parent: BlockHash | None, token_ids: tuple[int, ...],
                      extra_keys: ExtraKeys) -> bytes:
    # Length-prefixed fields, so no two different (parent, tokens, extras) share an encoding.
    h = hashlib.sha256()
    h.update(parent if isinstance(parent, bytes) else b"\0" * 32)
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(_encode_extra(extra_keys))
    return h.digest()


def builtin_block_hash(parent: BlockHash | None, token_ids: tuple[int, ...],
                       extra_keys: ExtraKeys) -> int:
    return hash((parent, token_ids, extra_keys))


def get_block_hash_fn(algo: str) -> Callable[[BlockHash | None, tuple[int, ...], ExtraKeys],
                                             BlockHash]:
    if algo == "sha256":
        return sha256_block_hash
    if algo == "builtin":
        return builtin_block_hash
    raise ValueError(f"prefix_caching_hash_algo must be one of {list(HASH_ALGOS)}, got {algo!r}.")
