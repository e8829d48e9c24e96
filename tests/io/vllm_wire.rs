//! vLLM interop: the `sha256_cbor` block hasher (feature `vllm-hash`) and the prefix
//! events as vLLM `KVEventBatch` msgpack bytes.
//!
//! Golden values and where they come from:
//! - hashes: `tests/data/vllm_hash_vectors.py` (hashlib plus a hand CBOR encoder that
//!   mirrors vLLM's definition; its `--check` compared the encoding with cbor2 6.3.0's
//!   canonical output), and one block's CBOR spelled out below from RFC 8949;
//! - event bytes: derived by hand from the msgpack spec below, and equal to what
//!   msgspec 0.23.0 encodes for the same batch (`tests/data/vllm_events_golden.py`).

use pagedkv::events::{VllmEventEncoder, VllmEventLayout};
use pagedkv::pool::prefix::{BlockHash, Medium, PrefixEvent};
use pagedkv::{
    AdmitOptions, CacheConfig, DType, Error, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape,
    PrefixConfig, SeqId,
};

const BLOCK: usize = 4;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 1,
        num_kv_heads: 1,
        head_dim: 2,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, BLOCK).unwrap()
}

fn manager(num_blocks: usize, f: impl FnOnce(&mut PrefixConfig)) -> KvCache {
    let mut p = PrefixConfig::for_arena(num_blocks);
    p.record_events = true;
    f(&mut p);
    let cfg = CacheConfig {
        num_blocks,
        watermark_blocks: 0,
        max_seq_len_tokens: 0,
        ..CacheConfig::new(0)
    };
    KvCache::with_prefix_config(layout(), cfg, p).unwrap()
}

const NONE: AdmitOptions<'static> = AdmitOptions {
    extra_key: b"",
    cache_salt: b"",
    retention_priority: 0,
    block_keys: &[],
};

fn admit(kv: &mut KvCache, seq: u64, tokens: &[u32], opts: &AdmitOptions<'_>) -> usize {
    let mut slots = Vec::new();
    kv.admit_tokens(SeqId(seq), tokens, opts, &mut slots)
        .unwrap()
        .cached_tokens
}

// ---------------------------------------------------------------------------------
// A tiny msgpack reader, test-side: only what the batches hold.

#[derive(Debug, Clone, PartialEq)]
enum Value {
    Nil,
    UInt(u64),
    F64(f64),
    Str(String),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

impl Value {
    fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(kv) => kv
                .iter()
                .find(|(k, _)| *k == Value::Str(key.into()))
                .map(|(_, v)| v),
            _ => None,
        }
    }
    fn array(&self) -> &[Value] {
        match self {
            Value::Array(a) => a,
            other => panic!("not an array: {other:?}"),
        }
    }
    fn uints(&self) -> Vec<u64> {
        self.array()
            .iter()
            .map(|v| match v {
                Value::UInt(n) => *n,
                other => panic!("not an unsigned int: {other:?}"),
            })
            .collect()
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
    fn be(&mut self, n: usize) -> u64 {
        self.take(n)
            .iter()
            .fold(0u64, |acc, &b| acc << 8 | u64::from(b))
    }
    fn value(&mut self) -> Value {
        let b = self.take(1)[0];
        match b {
            0x00..=0x7f => Value::UInt(u64::from(b)),
            0x80..=0x8f => self.map(usize::from(b & 0x0f)),
            0x90..=0x9f => self.array(usize::from(b & 0x0f)),
            0xa0..=0xbf => self.str(usize::from(b & 0x1f)),
            0xc0 => Value::Nil,
            0xcb => Value::F64(f64::from_bits(self.be(8))),
            0xcc => Value::UInt(self.be(1)),
            0xcd => Value::UInt(self.be(2)),
            0xce => Value::UInt(self.be(4)),
            0xcf => Value::UInt(self.be(8)),
            0xd9 => {
                let n = self.be(1) as usize;
                self.str(n)
            }
            0xdc => {
                let n = self.be(2) as usize;
                self.array(n)
            }
            0xdd => {
                let n = self.be(4) as usize;
                self.array(n)
            }
            0xde => {
                let n = self.be(2) as usize;
                self.map(n)
            }
            other => panic!("msgpack byte {other:#04x} not expected here"),
        }
    }
    fn str(&mut self, n: usize) -> Value {
        Value::Str(String::from_utf8(self.take(n).to_vec()).unwrap())
    }
    fn array(&mut self, n: usize) -> Value {
        Value::Array((0..n).map(|_| self.value()).collect())
    }
    fn map(&mut self, n: usize) -> Value {
        Value::Map((0..n).map(|_| (self.value(), self.value())).collect())
    }
}

/// Decodes one whole payload (nothing may follow it).
fn decode(bytes: &[u8]) -> Value {
    let mut r = Reader(bytes);
    let v = r.value();
    assert!(r.0.is_empty(), "{} bytes after the batch", r.0.len());
    v
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

// ---------------------------------------------------------------------------------
// Event bytes.

/// The batch of the golden test: a chain of two stored blocks (one wire event), a
/// removal from the host tier, a clear.
fn golden_events() -> Vec<PrefixEvent> {
    let stored = |hash: u64, parent: Option<u64>, token_ids: Vec<u32>, block: u32| {
        PrefixEvent::BlockStored {
            hash: BlockHash(hash),
            parent: parent.map(BlockHash),
            block: pagedkv::BlockId(block),
            token_ids,
            block_size: BLOCK,
            extra_keys: Vec::new(),
            medium: Medium::Device,
            group: None,
        }
    };
    vec![
        stored(1, None, vec![1, 2, 3, 4], 0),
        stored(300, Some(1), vec![5, 6, 7, 200], 5),
        PrefixEvent::BlockRemoved {
            hash: BlockHash(1 << 40),
            block: pagedkv::BlockId(2),
            medium: Medium::Host,
            group: None,
        },
        PrefixEvent::AllCleared,
    ]
}

/// A msgpack `fixstr` (`0xa0 | len`, then the UTF-8 bytes; every string here is
/// shorter than 32 bytes).
fn fixstr(out: &mut Vec<u8>, s: &str) {
    assert!(s.len() < 32);
    out.push(0xa0 | s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// The golden batch, by hand from the msgpack spec, in either layout.
fn golden_bytes(maps: bool) -> Vec<u8> {
    let mut w = vec![0x93]; // fixarray of 3: [ts, events, data_parallel_rank]
    w.push(0xcb); // float 64, big-endian
    w.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
    w.push(0x93); // 3 wire events
    let field = |w: &mut Vec<u8>, name: &str| {
        if maps {
            fixstr(w, name);
        }
    };
    // BlockStored: 7 fields after the tag.
    if maps {
        w.push(0x88); // fixmap of 8 entries
        fixstr(&mut w, "type");
    } else {
        w.push(0x98); // fixarray of 8 elements
    }
    fixstr(&mut w, "BlockStored");
    field(&mut w, "block_hashes");
    w.extend_from_slice(&[0x92, 0x01, 0xcd, 0x01, 0x2c]); // [1, 300 as uint 16]
    field(&mut w, "parent_block_hash");
    w.push(0xc0); // nil
    field(&mut w, "token_ids");
    w.extend_from_slice(&[0x98, 1, 2, 3, 4, 5, 6, 7, 0xcc, 200]); // 200 as uint 8
    field(&mut w, "block_size");
    w.push(0x04);
    field(&mut w, "lora_id");
    w.push(0xc0);
    field(&mut w, "medium");
    fixstr(&mut w, "GPU");
    field(&mut w, "lora_name");
    w.push(0xc0);
    // BlockRemoved: 2 fields after the tag.
    w.push(if maps { 0x83 } else { 0x93 });
    if maps {
        fixstr(&mut w, "type");
    }
    fixstr(&mut w, "BlockRemoved");
    field(&mut w, "block_hashes");
    w.extend_from_slice(&[0x91, 0xcf, 0, 0, 0x01, 0, 0, 0, 0, 0]); // [2^40 as uint 64]
    field(&mut w, "medium");
    fixstr(&mut w, "CPU");
    // AllBlocksCleared: the tag alone.
    w.push(if maps { 0x81 } else { 0x91 });
    if maps {
        fixstr(&mut w, "type");
    }
    fixstr(&mut w, "AllBlocksCleared");
    w.push(0x00); // data_parallel_rank 0 (positive fixint)
    w
}

/// What msgspec 0.23.0 encodes for the same batch (`tests/data/vllm_events_golden.py`).
const MSGSPEC_MAPS: &str = "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201cd012cb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739801020304050607ccc8aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf0000010000000000a66d656469756da343505581a474797065b0416c6c426c6f636b73436c656172656400";
const MSGSPEC_ARRAYS: &str = "93cb3ff80000000000009398ab426c6f636b53746f7265649201cd012cc09801020304050607ccc804c0a3475055c093ac426c6f636b52656d6f76656491cf0000010000000000a343505591b0416c6c426c6f636b73436c656172656400";

#[test]
fn golden_batch_in_both_layouts_is_byte_exact() {
    for (layout, maps, msgspec) in [
        (VllmEventLayout::TaggedMap, true, MSGSPEC_MAPS),
        (VllmEventLayout::ArrayLike, false, MSGSPEC_ARRAYS),
    ] {
        let by_hand = golden_bytes(maps);
        assert_eq!(
            by_hand,
            hex(msgspec),
            "{layout:?}: hand derivation vs msgspec"
        );
        let mut out = Vec::new();
        let n = VllmEventEncoder::new()
            .layout(layout)
            .encode_batch(1.5, &golden_events(), &mut out)
            .unwrap();
        assert_eq!(n, 3, "two chained stores become one wire event");
        assert_eq!(out, by_hand, "{layout:?}");
    }
}

#[test]
fn rank_none_is_nil_and_empty_batches_are_batches() {
    let mut out = Vec::new();
    let enc = VllmEventEncoder::new().data_parallel_rank(None);
    assert_eq!(enc.encode_batch(0.0, &[], &mut out).unwrap(), 0);
    assert_eq!(out, [0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0xc0]);
    out.clear();
    let enc = VllmEventEncoder::new().data_parallel_rank(Some(70_000));
    enc.encode_batch(2.0, &[], &mut out).unwrap();
    assert_eq!(&out[11..], [0xce, 0, 1, 0x11, 0x70]);
}

#[test]
fn a_non_finite_timestamp_is_a_typed_error_and_writes_nothing() {
    let mut out = vec![7];
    for ts in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let err = VllmEventEncoder::new()
            .encode_batch(ts, &golden_events(), &mut out)
            .unwrap_err();
        assert!(
            matches!(err, Error::OutOfRange { field: "ts", .. }),
            "{err}"
        );
        assert_eq!(out, [7]);
    }
}

#[test]
fn removals_from_different_tiers_and_broken_chains_stay_apart() {
    let removed = |hash: u64, medium| PrefixEvent::BlockRemoved {
        hash: BlockHash(hash),
        block: pagedkv::BlockId(0),
        medium,
        group: None,
    };
    let stored = |hash: u64, parent: Option<u64>| PrefixEvent::BlockStored {
        hash: BlockHash(hash),
        parent: parent.map(BlockHash),
        block: pagedkv::BlockId(0),
        token_ids: vec![0; BLOCK],
        block_size: BLOCK,
        extra_keys: Vec::new(),
        medium: Medium::Device,
        group: None,
    };
    let events = [
        removed(1, Medium::Device),
        removed(2, Medium::Device),
        removed(3, Medium::Host),
        stored(10, None),
        stored(11, Some(10)),
        stored(12, Some(99)), // another chain
    ];
    let mut out = Vec::new();
    let n = VllmEventEncoder::new()
        .encode_batch(1.0, &events, &mut out)
        .unwrap();
    assert_eq!(n, 4);
    let batch = decode(&out);
    let ev = batch.array()[1].array();
    assert_eq!(ev[0].get("block_hashes").unwrap().uints(), [1, 2]);
    assert_eq!(ev[1].get("medium"), Some(&Value::Str("CPU".into())));
    assert_eq!(ev[2].get("block_hashes").unwrap().uints(), [10, 11]);
    assert_eq!(ev[2].get("token_ids").unwrap().uints().len(), 2 * BLOCK);
    assert_eq!(ev[3].get("parent_block_hash"), Some(&Value::UInt(99)));
}

/// One block's extra-key bytes as the prefix index stores them: `offset: u32 LE ‖
/// len: u32 LE ‖ key` per span.
fn span_bytes(spans: &[(u32, &[u8])]) -> Vec<u8> {
    let mut v = Vec::new();
    for (offset, key) in spans {
        v.extend_from_slice(&offset.to_le_bytes());
        v.extend_from_slice(&(key.len() as u32).to_le_bytes());
        v.extend_from_slice(key);
    }
    v
}

/// What msgspec 0.23.0 encodes for a chain of two stores whose first block carries
/// the spans `("img", 1)` and `(b"\xff\x00", 3)` (`keyed()` in
/// `tests/data/vllm_events_golden.py`).
const MSGSPEC_KEYED: &str = "93cb3ff80000000000009189a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b657973929292a3696d670192c402ff0003c000";

fn keyed_events() -> Vec<PrefixEvent> {
    let stored = |hash: u64, parent: Option<u64>, token_ids: Vec<u32>, extra_keys| {
        PrefixEvent::BlockStored {
            hash: BlockHash(hash),
            parent: parent.map(BlockHash),
            block: pagedkv::BlockId(0),
            token_ids,
            block_size: BLOCK,
            extra_keys,
            medium: Medium::Device,
            group: None,
        }
    };
    vec![
        stored(
            1,
            None,
            vec![1, 2, 3, 4],
            span_bytes(&[(1, b"img"), (3, b"\xff\x00")]),
        ),
        stored(2, Some(1), vec![5, 6, 7, 8], Vec::new()),
    ]
}

/// A store whose block was hashed with extra keys sends them as vLLM's `extra_keys`
/// (one entry per block: nil, or `[identifier, offset]` pairs, the identifier text or
/// binary), byte for byte what msgspec writes; the array layout appends the same
/// value after `lora_name` (vLLM's field order).
#[test]
fn extra_keys_go_out_in_vllms_shape() {
    let mut out = Vec::new();
    let n = VllmEventEncoder::new()
        .encode_batch(1.5, &keyed_events(), &mut out)
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(out, hex(MSGSPEC_KEYED));

    let mut arrays = Vec::new();
    VllmEventEncoder::new()
        .layout(VllmEventLayout::ArrayLike)
        .encode_batch(1.5, &keyed_events(), &mut arrays)
        .unwrap();
    // ... lora_name nil, then extra_keys, then the rank.
    let tail = hex("c0929292a3696d670192c402ff0003c000");
    assert!(arrays.ends_with(&tail), "{arrays:02x?}");
    assert_eq!(arrays[11], 0x99, "tag + 8 fields");
}

/// Extra-key bytes that do not split into whole spans (an event built by hand) are a
/// typed error, and nothing is written.
#[test]
fn malformed_extra_keys_are_a_typed_error_and_write_nothing() {
    for bad in [vec![1, 0, 0], {
        let mut v = span_bytes(&[(0, b"abc")]);
        v.pop();
        v
    }] {
        let mut events = keyed_events();
        if let PrefixEvent::BlockStored { extra_keys, .. } = &mut events[1] {
            *extra_keys = bad;
        }
        let mut out = vec![7];
        let err = VllmEventEncoder::new()
            .encode_batch(1.0, &events, &mut out)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    field: "extra_keys",
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(out, [7]);
    }
}

/// A manager's store of a block where a keyed span starts carries the span (key and
/// offset in the block); the blocks before and after it send nil.
#[test]
fn a_keyed_admission_sends_its_span_on_its_block() {
    let mut kv = manager(16, |_| {});
    let prompt: Vec<u32> = (100..113).collect(); // 3 full blocks and one token
    let keys: [(usize, &[u8]); 1] = [(5, b"image-0")];
    let opts = AdmitOptions {
        block_keys: &keys,
        ..NONE
    };
    admit(&mut kv, 1, &prompt, &opts);
    let mut out = Vec::new();
    let n = VllmEventEncoder::new()
        .drain_manager(&mut kv, 1.0, &mut out)
        .unwrap();
    assert_eq!(n, 1);
    let batch = decode(&out);
    let ev = &batch.array()[1].array()[0];
    let span = Value::Array(vec![Value::Str("image-0".into()), Value::UInt(1)]);
    assert_eq!(
        ev.get("extra_keys"),
        Some(&Value::Array(vec![
            Value::Nil,
            Value::Array(vec![span]),
            Value::Nil
        ]))
    );
}

/// A manager's events, drained as a batch and read back, say what the crate's own
/// events say: stores (chained, parents first), removals, a clear.
#[test]
fn drained_manager_events_round_trip() {
    let mut kv = manager(16, |_| {});
    let mut enc = VllmEventEncoder::new();
    let mut out = Vec::new();
    assert_eq!(enc.drain_manager(&mut kv, 5.0, &mut out).unwrap(), 0);
    assert!(out.is_empty(), "no events, no batch");

    let prompt: Vec<u32> = (100..113).collect(); // 3 full blocks and one token
    admit(&mut kv, 1, &prompt, &NONE);
    let mut own = Vec::new();
    kv.drain_prefix_events(&mut own);
    let hashes: Vec<u64> = own
        .iter()
        .map(|e| match e {
            PrefixEvent::BlockStored { hash, .. } => hash.0,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(hashes.len(), 3);

    // The same again in a fresh manager, through the encoder this time.
    let mut kv = manager(16, |_| {});
    admit(&mut kv, 2, &prompt, &NONE);
    kv.free(SeqId(2)).unwrap();
    assert_eq!(kv.evict_cached(3), 3);
    assert_eq!(enc.drain_manager(&mut kv, 5.25, &mut out).unwrap(), 2);

    let batch = decode(&out);
    let [ts, events, rank] = batch.array() else {
        panic!("{batch:?}")
    };
    assert_eq!(*ts, Value::F64(5.25));
    assert_eq!(*rank, Value::UInt(0));
    let events = events.array();
    let stored = &events[0];
    assert_eq!(stored.get("type"), Some(&Value::Str("BlockStored".into())));
    assert_eq!(stored.get("block_hashes").unwrap().uints(), hashes);
    assert_eq!(stored.get("parent_block_hash"), Some(&Value::Nil));
    let ids: Vec<u64> = prompt[..3 * BLOCK].iter().map(|&t| u64::from(t)).collect();
    assert_eq!(stored.get("token_ids").unwrap().uints(), ids);
    assert_eq!(stored.get("block_size"), Some(&Value::UInt(BLOCK as u64)));
    assert_eq!(stored.get("medium"), Some(&Value::Str("GPU".into())));
    assert_eq!(stored.get("lora_id"), Some(&Value::Nil));
    assert!(stored.get("extra_keys").is_none(), "defaults are omitted");
    let removed = &events[1];
    assert_eq!(
        removed.get("type"),
        Some(&Value::Str("BlockRemoved".into()))
    );
    let mut gone = removed.get("block_hashes").unwrap().uints();
    gone.sort_unstable();
    let mut want = hashes.clone();
    want.sort_unstable();
    assert_eq!(gone, want);

    // A reset is AllBlocksCleared; the array layout reads back the same way.
    out.clear();
    let mut enc = VllmEventEncoder::new().layout(VllmEventLayout::ArrayLike);
    admit(&mut kv, 3, &prompt, &NONE);
    kv.drain_prefix_events(&mut Vec::new());
    kv.reset_prefix_cache().unwrap();
    enc.drain_manager(&mut kv, 6.0, &mut out).unwrap();
    let batch = decode(&out);
    let events = batch.array()[1].array();
    assert_eq!(
        events[0],
        Value::Array(vec![Value::Str("AllBlocksCleared".into())])
    );
    // The live blocks kept follow as one stored chain: [tag, hashes, parent, ...].
    assert_eq!(events[1].array()[1].uints(), hashes);
}

// ---------------------------------------------------------------------------------
// The vLLM block hash.

/// A hybrid cache of 64 pages over `specs` that records its prefix events.
fn recording_hybrid(specs: &[GroupSpec]) -> KvCache {
    KvCache::hybrid_builder(specs)
        .num_blocks(64)
        .watermark_blocks(0)
        .record_events(true)
        .build()
        .unwrap()
}

/// A hybrid cache (two full groups around a window group, built with every prefix
/// option by `hybrid_builder`) publishes each group's prefix events with its
/// `group_idx` and spec kind, as vLLM's block pool does with its KV-cache group ids:
/// the same chain registered in two groups stays two wire events, removals say their
/// group, a window group's events name their window, and the array layout writes a
/// nil `extra_keys` before the group fields.
#[test]
fn hybrid_events_name_their_group_and_its_kind() {
    let specs = [
        GroupSpec::full(layout()),
        GroupSpec::window(layout(), 8),
        GroupSpec::full(layout()),
    ];
    let mut kv = recording_hybrid(&specs);
    let prompt: Vec<u32> = (100..113).collect(); // 3 full blocks and one token
    let mut step = GroupStep::default();
    kv.admit_tokens_grouped(SeqId(1), &prompt, &NONE, &mut step)
        .unwrap();
    let mut own = Vec::new();
    kv.drain_prefix_events(&mut own);
    let groups: Vec<Option<u8>> = own
        .iter()
        .map(|e| match e {
            PrefixEvent::BlockStored { group, .. } => *group,
            other => panic!("{other:?}"),
        })
        .collect();
    // The window group keeps its blocks outside the prefix index: no events.
    assert_eq!(
        groups,
        [Some(0); 3]
            .iter()
            .chain(&[Some(2); 3])
            .copied()
            .collect::<Vec<_>>()
    );

    // Again in a fresh cache, through the encoder: stores, then the removals.
    let mut kv = recording_hybrid(&specs);
    kv.admit_tokens_grouped(SeqId(1), &prompt, &NONE, &mut step)
        .unwrap();
    let mut enc = VllmEventEncoder::new();
    let mut out = Vec::new();
    assert_eq!(enc.drain_manager(&mut kv, 1.0, &mut out).unwrap(), 2);
    let batch = decode(&out);
    let events = batch.array()[1].array();
    let mut hashes = Vec::new();
    for (ev, g) in events.iter().zip([0, 2]) {
        assert_eq!(ev.get("type"), Some(&Value::Str("BlockStored".into())));
        assert_eq!(ev.get("group_idx"), Some(&Value::UInt(g)));
        assert_eq!(
            ev.get("kv_cache_spec_kind"),
            Some(&Value::Str("full_attention".into()))
        );
        assert!(ev.get("kv_cache_spec_sliding_window").is_none());
        assert!(ev.get("extra_keys").is_none(), "a map omits the default");
        hashes.push(ev.get("block_hashes").unwrap().uints());
    }
    assert_eq!(hashes[0].len(), 3);
    assert_eq!(hashes[0], hashes[1], "one chain, registered in both groups");

    kv.free(SeqId(1)).unwrap();
    assert!(kv.evict_cached(64) >= 6);
    out.clear();
    assert_eq!(enc.drain_manager(&mut kv, 2.0, &mut out).unwrap(), 2);
    let batch = decode(&out);
    for (ev, g) in batch.array()[1].array().iter().zip([0, 2]) {
        assert_eq!(ev.get("type"), Some(&Value::Str("BlockRemoved".into())));
        assert_eq!(ev.get("group_idx"), Some(&Value::UInt(g)));
        assert_eq!(ev.get("block_hashes").unwrap().uints().len(), 3);
    }

    // A window group's store (built by hand: the window group publishes none yet)
    // names its window; the array layout puts nil where `extra_keys` would be.
    let window_store = PrefixEvent::BlockStored {
        hash: BlockHash(5),
        parent: None,
        block: pagedkv::BlockId(3),
        token_ids: vec![1, 2, 3, 4],
        block_size: BLOCK,
        extra_keys: Vec::new(),
        medium: Medium::Device,
        group: Some(1),
    };
    let removal = PrefixEvent::BlockRemoved {
        hash: BlockHash(5),
        block: pagedkv::BlockId(3),
        medium: Medium::Device,
        group: Some(1),
    };
    let enc = VllmEventEncoder::new().groups_of(&kv);
    out.clear();
    enc.encode_batch(3.0, std::slice::from_ref(&window_store), &mut out)
        .unwrap();
    let batch = decode(&out);
    let ev = &batch.array()[1].array()[0];
    assert_eq!(ev.get("group_idx"), Some(&Value::UInt(1)));
    assert_eq!(
        ev.get("kv_cache_spec_kind"),
        Some(&Value::Str("sliding_window".into()))
    );
    assert_eq!(
        ev.get("kv_cache_spec_sliding_window"),
        Some(&Value::UInt(8))
    );
    let enc = enc.layout(VllmEventLayout::ArrayLike);
    out.clear();
    enc.encode_batch(3.0, &[window_store, removal], &mut out)
        .unwrap();
    let batch = decode(&out);
    let events = batch.array()[1].array();
    let stored = events[0].array();
    assert_eq!(stored.len(), 12, "{stored:?}");
    assert_eq!(stored[8], Value::Nil, "extra_keys");
    assert_eq!(stored[9], Value::UInt(1), "group_idx");
    assert_eq!(stored[10], Value::Str("sliding_window".into()));
    assert_eq!(stored[11], Value::UInt(8));
    let removed = events[1].array();
    assert_eq!(removed.len(), 4, "{removed:?}");
    assert_eq!(removed[3], Value::UInt(1), "group_idx");

    // A one-group cache's events carry no group fields whatever the encoder knows.
    let mut one = manager(16, |_| {});
    admit(&mut one, 1, &prompt, &NONE);
    let mut enc = VllmEventEncoder::new().groups_of(&kv);
    out.clear();
    enc.drain_manager(&mut one, 4.0, &mut out).unwrap();
    let batch = decode(&out);
    let ev = &batch.array()[1].array()[0];
    assert!(ev.get("group_idx").is_none());
    assert!(ev.get("kv_cache_spec_kind").is_none());
}

/// A hybrid cache's host level publishes its stores as CPU-tier events of their
/// group, as the device level does: each group's chain goes to the host under its own
/// `group_idx`.
#[test]
fn hybrid_host_stores_are_cpu_events_of_their_group() {
    let specs = [GroupSpec::full(layout()), GroupSpec::full(layout())];
    let mut kv = KvCache::hybrid_builder(&specs)
        .num_blocks(32)
        .watermark_blocks(0)
        .tiers(pagedkv::TierConfig {
            num_host_blocks: 16,
            num_disk_slots: 0,
        })
        .record_events(true)
        .build()
        .unwrap();
    kv.set_host_cache(pagedkv::manager::HostCacheConfig::default())
        .unwrap();
    let prompt: Vec<u32> = (100..113).collect(); // 3 full blocks and one token
    let mut step = GroupStep::default();
    kv.admit_tokens_grouped(SeqId(1), &prompt, &NONE, &mut step)
        .unwrap();
    kv.drain_prefix_events(&mut Vec::new());
    let job = kv.plan_host_store_grouped(usize::MAX).unwrap().unwrap();
    kv.complete_swap_grouped(&job).unwrap();
    let mut out = Vec::new();
    let mut enc = VllmEventEncoder::new();
    assert_eq!(enc.drain_manager(&mut kv, 1.0, &mut out).unwrap(), 2);
    let batch = decode(&out);
    for (ev, g) in batch.array()[1].array().iter().zip([0, 1]) {
        assert_eq!(ev.get("type"), Some(&Value::Str("BlockStored".into())));
        assert_eq!(ev.get("medium"), Some(&Value::Str("CPU".into())));
        assert_eq!(ev.get("group_idx"), Some(&Value::UInt(g)));
        assert_eq!(ev.get("block_hashes").unwrap().uints().len(), 3);
    }
}

/// `hybrid_builder` takes every option that applies to every group and refuses,
/// typed, the ones a hybrid cache takes from its groups.
#[test]
fn the_hybrid_builder_applies_the_prefix_options_and_refuses_the_rest() {
    let specs = [GroupSpec::full(layout()), GroupSpec::window(layout(), 8)];
    let kv = KvCache::hybrid_builder(&specs)
        .num_blocks(64)
        .watermark_blocks(5)
        .hasher(Box::new(pagedkv::pool::prefix::ChainHasher))
        .max_pinned_blocks(7)
        .tiers(pagedkv::TierConfig {
            num_host_blocks: 12,
            num_disk_slots: 0,
        })
        .build()
        .unwrap();
    assert_eq!(kv.num_groups(), 2);
    assert_eq!(kv.group_stats().num_pages, 64);
    for g in 0..2 {
        let p = kv.group(g).prefix_config();
        let chain: &dyn pagedkv::pool::prefix::PrefixHasher = &pagedkv::pool::prefix::ChainHasher;
        assert_eq!(p.hasher.name(), chain.name());
        assert_ne!(chain.name(), PrefixConfig::for_arena(1).hasher.name());
        assert_eq!(p.max_pinned_blocks, 7);
    }
    assert_eq!(kv.tier_stats().host_blocks, 12);
    // The watermark holds back 5 of the 64 pages at admission.
    let over = (1..).find(|&t| kv.admission_blocks(t) > 59).unwrap();
    assert!(kv.can_admit(over - 1));
    assert!(!kv.can_admit(over));
    let no_watermark = KvCache::hybrid_builder(&specs)
        .num_blocks(64)
        .watermark_blocks(0)
        .build()
        .unwrap();
    assert!(no_watermark.can_admit(over));

    let refused = |b: pagedkv::CacheBuilder| b.build().unwrap_err();
    assert!(matches!(
        refused(KvCache::hybrid_builder(&specs).sliding_window(4)),
        Error::InvalidConfig { .. }
    ));
    assert!(matches!(
        refused(KvCache::hybrid_builder(&specs).max_seq_len_tokens(100)),
        Error::InvalidConfig { .. }
    ));
    assert!(matches!(
        refused(KvCache::hybrid_builder(&specs).tiers(pagedkv::TierConfig {
            num_host_blocks: 4,
            num_disk_slots: 4,
        })),
        Error::NotOnHybrid { .. }
    ));
    assert!(matches!(
        refused(KvCache::hybrid_builder(&[])),
        Error::InvalidConfig { .. }
    ));
}

#[cfg(feature = "vllm-hash")]
mod vllm_hash {
    use super::*;
    use pagedkv::pool::prefix::BlockDigest;
    use pagedkv::pool::prefix::{PrefixHasher, VllmHasher};

    fn digest(s: &str) -> BlockDigest {
        BlockDigest(hex(s).try_into().unwrap())
    }

    /// `sha256(cbor("0"))`: the text string "0" is `0x61 0x30`.
    const NONE_HASH_0: &str = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e";

    #[test]
    fn none_hash_is_the_seed_hashed_as_cbor_text() {
        let h = VllmHasher::with_python_hash_seed("0");
        assert_eq!(h.none_hash(), digest(NONE_HASH_0));
        assert_eq!(
            VllmHasher::with_none_hash_bytes(&hex(NONE_HASH_0)).unwrap(),
            h
        );
        assert_eq!(h.name(), "vllm-sha256-cbor");
        assert!(h.chains_digests());
    }

    #[test]
    fn a_none_hash_of_the_wrong_length_is_a_typed_error() {
        for n in [0, 31, 33] {
            let err = VllmHasher::with_none_hash_bytes(&vec![0; n]).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidConfig {
                        field: "none_hash",
                        ..
                    }
                ),
                "{err}"
            );
        }
        if std::env::var_os("PYTHONHASHSEED").is_none() {
            assert!(matches!(
                VllmHasher::from_env(),
                Err(Error::InvalidConfig {
                    field: "PYTHONHASHSEED",
                    ..
                })
            ));
        }
    }

    /// Two blocks' CBOR written out from RFC 8949, item by item.
    #[test]
    fn block_input_is_canonical_cbor_by_hand() {
        let h = VllmHasher::with_python_hash_seed("0");
        let nh = hex(NONE_HASH_0);
        let mut want = vec![0x83]; // array(3): (parent, tokens, extra_keys)
        want.extend_from_slice(&[0x58, 0x20]); // bytes, 1-byte length 32
        want.extend_from_slice(&nh);
        want.extend_from_slice(&[0x84, 0x01, 0x02, 0x03, 0x04]); // array(4) of uints < 24
        want.push(0xf6); // null: no extra keys
        let mut got = Vec::new();
        h.encode_block_input(None, b"", b"", &[1, 2, 3, 4], b"", &mut got);
        assert_eq!(got, want);

        // LoRA name and cache salt; token ids across the integer widths.
        let mut want = vec![0x83, 0x58, 0x20];
        want.extend_from_slice(&nh);
        want.push(0x84);
        want.extend_from_slice(&[0x1a, 0x00, 0x02, 0x50, 0x5c]); // 151644: 4-byte uint
        want.extend_from_slice(&[0x1a, 0x00, 0x01, 0x11, 0x70]); // 70000: 4-byte uint
        want.extend_from_slice(&[0x19, 0x01, 0x2c]); // 300: 2-byte uint
        want.extend_from_slice(&[0x18, 0x18]); // 24: 1-byte uint
        want.push(0x82); // array(2): (lora_name, cache_salt)
        want.push(0x67); // text(7)
        want.extend_from_slice(b"my-lora");
        want.push(0x68); // text(8)
        want.extend_from_slice(b"tenant-a");
        got.clear();
        h.encode_block_input(
            None,
            b"tenant-a",
            b"my-lora",
            &[151_644, 70_000, 300, 24],
            b"",
            &mut got,
        );
        assert_eq!(got, want);
    }

    /// The vectors of `tests/data/vllm_hash_vectors.py`.
    #[test]
    fn digests_match_the_vectors() {
        let h0 = VllmHasher::with_python_hash_seed("0");
        // plain
        let a = h0.block_digest(None, b"", b"", &[1, 2, 3, 4], b"");
        let b = h0.block_digest(Some(&a), b"", b"", &[5, 6, 7, 8], b"");
        assert_eq!(
            a,
            digest("c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb")
        );
        assert_eq!(a.key(), BlockHash(2_164_874_634_404_590_027));
        assert_eq!(
            b,
            digest("24125b23e68883b5c2141db2959d48433fe6bde2f26bd914efad121d154ab2d6")
        );
        assert_eq!(b.key(), BlockHash(17_270_480_062_156_288_726));
        // lora_salt: the salt keys the first block only.
        let a = h0.block_digest(
            None,
            b"tenant-a",
            b"my-lora",
            &[151_644, 70_000, 300, 24],
            b"",
        );
        let b = h0.block_digest(Some(&a), b"tenant-a", b"my-lora", &[23, 0, 255, 256], b"");
        assert_eq!(a.key(), BlockHash(15_695_240_339_768_914_391));
        assert_eq!(b.key(), BlockHash(4_584_113_139_273_111_287));
        // mm: a span of key "img-0001" at offset 2 of the second block.
        let h42 = VllmHasher::with_python_hash_seed("42");
        assert_eq!(
            h42.none_hash(),
            digest("9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780")
        );
        let mut span = 2u32.to_le_bytes().to_vec();
        span.extend_from_slice(&8u32.to_le_bytes());
        span.extend_from_slice(b"img-0001");
        let a = h42.block_digest(None, b"", b"", &[9, 9, 9, 9], b"");
        let b = h42.block_digest(Some(&a), b"", b"", &[1, 1, 7, 7], &span);
        assert_eq!(a.key(), BlockHash(12_108_077_766_411_984_957));
        assert_eq!(b.key(), BlockHash(17_142_976_678_466_277_556));
        // bytes_salt: a salt that is not UTF-8 is a byte string.
        let a = h0.block_digest(None, b"\xff\xfe", b"", &[1, 2, 3, 4], b"");
        assert_eq!(a.key(), BlockHash(230_106_440_338_742_253));
    }

    fn vllm_manager(num_blocks: usize) -> KvCache {
        manager(num_blocks, |p| {
            p.hasher = Box::new(VllmHasher::with_python_hash_seed("0"));
        })
    }

    /// The manager registers, finds and announces blocks under vLLM's hashes, with
    /// namespaces as vLLM's extra keys, and the wire batch carries vLLM's integers.
    #[test]
    fn manager_events_carry_vllm_hashes() {
        let mut kv = vllm_manager(16);
        admit(&mut kv, 1, &[1, 2, 3, 4, 5, 6, 7, 8, 9], &NONE);
        let opts = AdmitOptions {
            extra_key: b"my-lora",
            cache_salt: b"tenant-a",
            ..NONE
        };
        admit(
            &mut kv,
            2,
            &[151_644, 70_000, 300, 24, 23, 0, 255, 256, 1],
            &opts,
        );
        let mut out = Vec::new();
        let mut enc = VllmEventEncoder::new();
        assert_eq!(enc.drain_manager(&mut kv, 1.0, &mut out).unwrap(), 2);
        let batch = decode(&out);
        let events = batch.array()[1].array();
        assert_eq!(
            events[0].get("block_hashes").unwrap().uints(),
            [2_164_874_634_404_590_027, 17_270_480_062_156_288_726]
        );
        assert_eq!(
            events[1].get("block_hashes").unwrap().uints(),
            [15_695_240_339_768_914_391, 4_584_113_139_273_111_287]
        );
        assert_eq!(
            kv.prefix_digest(BlockHash(17_270_480_062_156_288_726)),
            Some(digest(
                "24125b23e68883b5c2141db2959d48433fe6bde2f26bd914efad121d154ab2d6"
            ))
        );
        assert_eq!(kv.prefix_digest(BlockHash(12345)), None);
        // Hits follow the digest chain; the LoRA namespace is its own.
        assert_eq!(admit(&mut kv, 3, &[1, 2, 3, 4, 5, 6, 7, 8, 0], &NONE), 8);
        let hit = admit(
            &mut kv,
            4,
            &[151_644, 70_000, 300, 24, 23, 0, 255, 256, 7],
            &opts,
        );
        assert_eq!(hit, 8);
        let other_lora = AdmitOptions {
            extra_key: b"other",
            ..opts
        };
        assert_eq!(
            admit(
                &mut kv,
                5,
                &[151_644, 70_000, 300, 24, 23, 0, 255, 256, 7],
                &other_lora
            ),
            0
        );
        kv.check_invariants().unwrap();
    }

    /// Digests follow blocks through defragmentation, eviction and re-registration:
    /// chains registered after a move still hash from the moved parent's digest.
    #[test]
    fn digests_follow_moves_and_chains_go_on() {
        let h = VllmHasher::with_python_hash_seed("0");
        let mut kv = vllm_manager(32);
        let filler: Vec<u32> = (1000..1017).collect();
        admit(&mut kv, 1, &filler, &NONE); // low blocks
        let prompt: Vec<u32> = (0..9).collect();
        admit(&mut kv, 2, &prompt, &NONE);
        kv.free(SeqId(1)).unwrap();
        assert!(kv.evict_cached(usize::MAX) > 0);
        let before = kv.block_table(SeqId(2)).unwrap().to_vec();
        let moves = kv
            .plan_defragment(pagedkv::manager::DefragOptions::FULL)
            .unwrap()
            .commit()
            .unwrap();
        assert!(!moves.is_empty(), "the test needs a move");
        assert_ne!(kv.block_table(SeqId(2)).unwrap(), &before[..]);
        kv.check_invariants().unwrap();
        kv.drain_prefix_events(&mut Vec::new());
        // The sequence goes on: its third block chains from the moved second one.
        let mut slots = Vec::new();
        let mut copies = pagedkv::CopyPlan::default();
        kv.append_tokens(SeqId(2), &[9, 10, 11, 12], &mut slots, &mut copies)
            .unwrap();
        kv.check_invariants().unwrap();
        let mut events = Vec::new();
        kv.drain_prefix_events(&mut events);
        let d0 = h.block_digest(None, b"", b"", &[0, 1, 2, 3], b"");
        let d1 = h.block_digest(Some(&d0), b"", b"", &[4, 5, 6, 7], b"");
        let d2 = h.block_digest(Some(&d1), b"", b"", &[8, 9, 10, 11], b"");
        assert!(
            events.iter().any(|e| matches!(e,
                PrefixEvent::BlockStored { hash, parent, .. }
                    if *hash == d2.key() && *parent == Some(d1.key()))),
            "{events:?}"
        );
        assert_eq!(kv.prefix_digest(d2.key()), Some(d2));
    }
}
