"""Digest of an arena's bytes, computed where the arena lives.

CPU: blake3 over the bytes (multi-threaded). CUDA: a position-weighted 64-bit
sum per block computed on the device, the block sums hashed with blake3: it
runs at device memory bandwidth (no copy to the host) and catches corruption
in a transfer or on disk (any changed word, swapped or shifted words), but
unlike blake3 it is not collision resistant. That is enough here: snapshots and
seeding peers belong to the same user and are checked by key first; the
digest guards against broken transfers and bit rot, not an adversary (who could
rewrite the recorded digest as easily as the bytes).

Source: blake3 (github.com/BLAKE3-team/BLAKE3); the checksum is wcache's own.
"""

from __future__ import annotations

import ctypes

import blake3
import torch

__all__ = ["arena_digest", "DIGEST_BYTES", "DIGEST_BLOCK_WORDS", "CPU_ALGORITHM", "CUDA_ALGORITHM"]

#: Words per device-side checksum block on CUDA (8-byte words: 128 MiB).
DIGEST_BLOCK_WORDS = 1 << 24
#: Bytes of a blake3 digest.
DIGEST_BYTES = 32
CPU_ALGORITHM = "blake3"
CUDA_ALGORITHM = "sum64-blake3"


def _cpu_view(t: torch.Tensor) -> memoryview:
    n = t.numel()
    return (
        memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
        if n
        else memoryview(b"")
    )


def arena_digest(arena: torch.Tensor) -> tuple[str, str]:
    """``(algorithm, hex digest)`` of a ``[n]`` uint8 arena.

    CPU: ``("blake3", blake3(bytes))`` (multi-threaded). CUDA: ``("sum64-blake3",
    ...)``: the arena as int64 words, per block of :data:`DIGEST_BLOCK_WORDS`
    ``sum(word_i * (2*i + 1))`` and ``sum(word_i)`` (wrapping int64), the block
    sums hashed with blake3. ``n`` must be a multiple of 8 on CUDA (arenas are
    256-byte aligned).
    """
    if arena.device.type == "cpu":
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update(_cpu_view(arena.contiguous()))
        return CPU_ALGORITHM, h.hexdigest()
    words = arena.view(torch.int64)
    sums = []
    for start in range(0, words.numel(), DIGEST_BLOCK_WORDS):
        w = words[start : start + DIGEST_BLOCK_WORDS]
        idx = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64) * 2 + 1
        sums.append(torch.stack([(w * idx).sum(), w.sum()]))
    host = torch.stack(sums).cpu() if sums else torch.zeros(0, dtype=torch.int64)
    return CUDA_ALGORITHM, blake3.blake3(host.numpy().tobytes()).hexdigest()
