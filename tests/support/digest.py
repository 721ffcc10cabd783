"""The snapshot format's file digest, computed here independently of the code under test."""

from __future__ import annotations

import blake3

LEAF = 16 << 20


def blake3_tree(data: bytes) -> str:
    """BLAKE3 of the 32-byte BLAKE3 digests of the 16 MiB chunks, then the size (8 bytes LE)."""
    leaves = b"".join(blake3.blake3(data[i : i + LEAF]).digest() for i in range(0, len(data), LEAF))
    return blake3.blake3(leaves + len(data).to_bytes(8, "little")).hexdigest()
