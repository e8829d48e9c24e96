#!/usr/bin/env python3
"""Cross-check of the golden KVEventBatch bytes in tests/io/vllm_wire.rs with msgspec.

The structs below restate the wire schema of vLLM's vllm/distributed/kv_events.py
(field names, order, defaults, and the msgspec struct options) for the two event
layouts the crate writes; they are not vLLM's source. Needs `pip install msgspec`.
The test's bytes were derived by hand from the msgpack spec; this prints what msgspec
encodes for the same batch, which must be equal.

Run: python3 tests/data/vllm_events_golden.py
"""

import msgspec


def schema(array_like):
    class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class Event(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        if not array_like:
            # Optional fields of the current (map) layout; omitted at their defaults.
            # The array-era structs ended at lora_name (msgspec writes every field of
            # an array_like struct, so they are left out of that schema).
            extra_keys: list | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None
        if not array_like:
            group_idx: int | None = None

    class AllBlocksCleared(Event):
        pass

    return Batch, BlockStored, BlockRemoved, AllBlocksCleared


def golden(array_like):
    Batch, Stored, Removed, Cleared = schema(array_like)
    events = [
        Stored(
            block_hashes=[1, 300],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4, 5, 6, 7, 200],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        Removed(block_hashes=[1 << 40], medium="CPU"),
        Cleared(),
    ]
    return msgspec.msgpack.encode(Batch(ts=1.5, events=events, data_parallel_rank=0))


def keyed():
    """A chain of two blocks whose first carries two multimodal spans (a text
    identifier at offset 1 and a binary one at offset 3) and whose second carries none:
    `extra_keys` is one entry per block, `[identifier, offset]` pairs or None."""
    Batch, Stored, _, _ = schema(False)
    event = Stored(
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[[("img", 1), (b"\xff\x00", 3)], None],
    )
    return msgspec.msgpack.encode(Batch(ts=1.5, events=[event], data_parallel_rank=0))


if __name__ == "__main__":
    print("keyed map:  ", keyed().hex())
    print("tagged maps:", golden(False).hex())
    print("array like: ", golden(True).hex())
