#!/usr/bin/env python3
"""Golden vectors for tests/io/vllm_wire.rs: vLLM's `sha256_cbor` prefix-block hashes.

This mirrors vLLM's definition (vllm/v1/core/kv_cache_utils.py `hash_block_tokens`,
`init_none_hash`, `maybe_convert_block_hash`; `sha256_cbor` in vLLM's hashing
utilities):

    digest(block) = sha256(cbor2.dumps((parent, tuple(tokens), extra_keys), canonical=True))
    parent        = previous block's digest, or NONE_HASH for a prompt's first block
    NONE_HASH     = sha256_cbor(os.environ["PYTHONHASHSEED"])   (when it is set)
    event int     = int.from_bytes(digest, "big") & (2**64 - 1)

cbor2 is not installed on the machines that made these vectors, so the CBOR below is
written out by hand from RFC 8949 (shortest heads, definite lengths; tuples are arrays,
None is null, str is text, bytes are byte strings). For these types cbor2's canonical
mode emits exactly this; where cbor2 is available, `--check` compares with it.

Run: python3 tests/data/vllm_hash_vectors.py [--check]
"""

import hashlib
import sys


def head(major: int, n: int) -> bytes:
    m = major << 5
    if n < 24:
        return bytes([m | n])
    if n < 1 << 8:
        return bytes([m | 24]) + n.to_bytes(1, "big")
    if n < 1 << 16:
        return bytes([m | 25]) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes([m | 26]) + n.to_bytes(4, "big")
    return bytes([m | 27]) + n.to_bytes(8, "big")


def cbor(obj) -> bytes:
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        raise TypeError("no booleans in block hashes")
    if isinstance(obj, int):
        return head(0, obj) if obj >= 0 else head(1, -1 - obj)
    if isinstance(obj, bytes):
        return head(2, len(obj)) + obj
    if isinstance(obj, str):
        b = obj.encode("utf-8")
        return head(3, len(b)) + b
    if isinstance(obj, (tuple, list)):
        return head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(type(obj))


def sha256_cbor(obj) -> bytes:
    return hashlib.sha256(cbor(obj)).digest()


def key(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def chain(none_hash, blocks):
    """blocks: [(tokens, extra_keys)]; returns the digests."""
    out, parent = [], none_hash
    for tokens, extra in blocks:
        d = sha256_cbor((parent, tuple(tokens), extra))
        out.append(d)
        parent = d
    return out


CASES = {
    # Two plain blocks of 4 tokens, PYTHONHASHSEED=0.
    "plain": ("0", [([1, 2, 3, 4], None), ([5, 6, 7, 8], None)]),
    # LoRA name on every block, cache salt on the first; token ids across CBOR widths.
    "lora_salt": (
        "0",
        [
            ([151644, 70000, 300, 24], ("my-lora", "tenant-a")),
            ([23, 0, 255, 256], ("my-lora",)),
        ],
    ),
    # A multimodal input starting at offset 2 of the second block.
    "mm": ("42", [([9, 9, 9, 9], None), ([1, 1, 7, 7], (("img-0001", 2),))]),
    # A salt that is not UTF-8 hashes as a byte string.
    "bytes_salt": ("0", [([1, 2, 3, 4], (b"\xff\xfe",))]),
}


def main():
    for name, (seed, blocks) in CASES.items():
        none_hash = sha256_cbor(seed)
        print(f"{name}: seed={seed!r} none_hash={none_hash.hex()}")
        for i, d in enumerate(chain(none_hash, blocks)):
            print(f"  block {i}: digest={d.hex()} key={key(d)}")
    if "--check" in sys.argv[1:]:
        import cbor2

        for _, (seed, blocks) in CASES.items():
            assert cbor(seed) == cbor2.dumps(seed, canonical=True)
            parent = sha256_cbor(seed)
            for tokens, extra in blocks:
                obj = (parent, tuple(tokens), extra)
                assert cbor(obj) == cbor2.dumps(obj, canonical=True), obj
                parent = sha256_cbor(obj)
        print("hand CBOR equals cbor2's canonical encoding")


if __name__ == "__main__":
    main()
