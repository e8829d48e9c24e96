//! Sequences moved between two NIXL agents (feature `nixl`): both agents live in this
//! process and talk UCX (`UCX_TLS=tcp` in CI) over loopback, so the bytes go through the
//! transport exactly as between two processes; `examples/disaggregated.rs --transport
//! nixl` runs the two-process case.
//!
//! Needs `libnixl_capi.so` (the `nixl-cu13` wheel's `.nixl_cu13.mesonpy.libs` folder on
//! `LD_LIBRARY_PATH`). Without it every test prints that it skipped, unless `CI` is set:
//! then it fails. NIXL's bindings ask for single-threaded use, so the tests take a
//! lock and run one at a time.

#![cfg(feature = "nixl")]

#[path = "support/mod.rs"]
mod support;

use support::{kv_bytes, snapshot};

use std::sync::Mutex;
use std::time::Duration;

use kv_bytes::{check_values, write_values};
use pagedkv::executor::nixl::{nixl_available, NixlAgent};
use pagedkv::export::nixl::{offer_sequence, pull_sequence, SequenceOffer};
use pagedkv::{
    AdmitOptions, BlockId, CacheConfig, DType, Error, HostStorage, KvCache, KvLayout, ModelShape,
    SeqId, Storage,
};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
const TIMEOUT: Duration = Duration::from_secs(20);

/// Whether NIXL can be loaded; panics in CI when it cannot.
fn nixl_or_skip(test: &str) -> bool {
    match nixl_available() {
        Ok(()) => true,
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{test}: NIXL is required in CI: {e}")
        }
        Err(e) => {
            eprintln!(
                "{test}: skipped, NIXL not loadable ({e}); install nixl-cu13==1.5.1 and put \
                 its .nixl_cu13.mesonpy.libs folder on LD_LIBRARY_PATH"
            );
            false
        }
    }
}

fn layout(block_size: usize, dtype: DType) -> KvLayout {
    let shape = ModelShape {
        num_layers: 3,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        kv_dtype: dtype,
    };
    KvLayout::new(shape, block_size).unwrap()
}

/// One side: a manager, its arena, and an agent with the arena registered.
struct Side {
    kv: KvCache,
    st: HostStorage,
    agent: NixlAgent,
}

impl Side {
    fn new(name: &str, layout: KvLayout, blocks: usize) -> Side {
        let kv = KvCache::new(layout, CacheConfig::new(blocks)).unwrap();
        let st = HostStorage::new(layout, blocks).unwrap();
        let mut agent = NixlAgent::new(name).unwrap();
        // SAFETY: `st` is never resized and lives as long as the agent (same struct,
        // and `agent` is dropped first where a test drops it on its own).
        unsafe { agent.register_host_arena(&st).unwrap() };
        Side { kv, st, agent }
    }

    /// Admits `seq` with tokens valued `values` and writes their K/V.
    fn put(&mut self, seq: SeqId, values: &[u32]) {
        let mut slots = Vec::new();
        self.kv.admit(seq, values.len(), &mut slots).unwrap();
        write_values(&mut self.st, &slots, values);
    }
}

fn values(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

/// A receiver's bookkeeping (`support/snapshot.rs`) and every arena byte: what must not
/// change after a refused pull (after a failed transfer only the bookkeeping: the
/// bytes of free blocks are unspecified).
fn snapshot(side: &Side) -> (String, Vec<u8>) {
    let l = *side.st.layout();
    let bytes = (0..l.num_layers())
        .flat_map(|layer| side.st.region(layer).to_vec())
        .collect();
    (snapshot::snapshot(&side.kv), bytes)
}

#[test]
fn sequences_move_byte_exact() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !nixl_or_skip("sequences_move_byte_exact") {
        return;
    }
    let l = layout(16, DType::BF16);
    let mut prefill = Side::new("prefill-exact", l, 64);
    let mut decode = Side::new("decode-exact", l, 64);

    // Fragment the prefill arena so the tables are not runs, and give the decode side
    // a sequence of its own that must stay intact.
    prefill.put(SeqId(900), &values(9, 70));
    let lens = [1usize, 16, 17, 40, 100];
    for (i, &n) in lens.iter().enumerate() {
        prefill.put(SeqId(i as u64), &values(i as u32 + 1, n));
        if i == 1 {
            prefill.kv.free(SeqId(900)).unwrap();
        }
    }
    decode.put(SeqId(500), &values(50, 33));
    let keep = decode.kv.block_table(SeqId(500)).unwrap().to_vec();

    let peer = decode
        .agent
        .add_peer(&prefill.agent.local_metadata().unwrap())
        .unwrap();
    assert_eq!(peer, "prefill-exact");
    let mut scratch = Vec::new();
    let (mut moved, mut took) = (0, Duration::ZERO);
    for (i, &n) in lens.iter().enumerate() {
        let seq = SeqId(i as u64);
        let ids: Vec<u32> = (0..n as u32).map(|t| t * 3 + 1).collect();
        let offer =
            offer_sequence(&prefill.kv, &prefill.st, seq, Some(&ids), &mut scratch).unwrap();
        let parsed = SequenceOffer::parse(&offer).unwrap();
        assert_eq!(parsed.table(), prefill.kv.block_table(seq).unwrap());
        let into = SeqId(100 + i as u64);
        let pulled = pull_sequence(
            &decode.agent,
            &peer,
            &mut decode.kv,
            &mut decode.st,
            into,
            &offer,
            TIMEOUT,
        )
        .unwrap();
        assert_eq!(pulled.imported.num_tokens, n);
        assert_eq!(pulled.imported.token_ids.as_deref(), Some(&ids[..]));
        assert_eq!(decode.kv.num_computed_tokens(into).unwrap(), n);
        assert_eq!(
            pulled.transfer.bytes,
            l.blocks_for_tokens(n) * l.block_bytes()
        );
        assert!(pulled.transfer.descriptors >= l.num_layers());
        moved += pulled.transfer.bytes;
        took += pulled.transfer.elapsed;
        check_values(&decode.st, &pulled.imported.table, &values(i as u32 + 1, n))
            .unwrap_or_else(|layer| panic!("sequence {i}: layer {layer} differs"));
        decode.kv.check_invariants().unwrap();
    }
    check_values(&decode.st, &keep, &values(50, 33)).expect("the decode side's own sequence");
    eprintln!(
        "moved {moved} bytes over NIXL in {} sequences, {:.1} ms in transfers",
        lens.len(),
        took.as_secs_f64() * 1e3
    );
}

#[test]
fn corrupted_sender_byte_fails_its_checksum_and_changes_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !nixl_or_skip("corrupted_sender_byte") {
        return;
    }
    let l = layout(16, DType::F16);
    let mut prefill = Side::new("prefill-corrupt", l, 32);
    let mut decode = Side::new("decode-corrupt", l, 32);
    prefill.put(SeqId(1), &values(1, 50));
    decode.put(SeqId(7), &values(7, 20));
    let peer = decode
        .agent
        .add_peer(&prefill.agent.local_metadata().unwrap())
        .unwrap();
    let offer = offer_sequence(&prefill.kv, &prefill.st, SeqId(1), None, &mut Vec::new()).unwrap();

    // A byte of token 35 (block 2), V of layer 1, changes after the header was made.
    let (block, tok) = (prefill.kv.block_table(SeqId(1)).unwrap()[2], 35 % 16);
    let at = l.block_byte_offset(block)
        + l.elem_offset(BlockId(0), pagedkv::layout::Kv::V, 1, tok) * l.dtype().size_bytes();
    prefill.st.region_mut(1)[at] ^= 0x40;

    let before = snapshot(&decode);
    let err = pull_sequence(
        &decode.agent,
        &peer,
        &mut decode.kv,
        &mut decode.st,
        SeqId(2),
        &offer,
        TIMEOUT,
    )
    .unwrap_err();
    match &err {
        Error::Checksum { what, .. } => assert!(what.contains("block 2"), "{what}"),
        other => panic!("expected a checksum error, got {other:?}"),
    }
    assert!(!decode.kv.contains(SeqId(2)));
    assert_eq!(snapshot(&decode).0, before.0);
    decode.kv.check_invariants().unwrap();
    check_values(
        &decode.st,
        decode.kv.block_table(SeqId(7)).unwrap(),
        &values(7, 20),
    )
    .unwrap();

    // Restored, the same offer goes through: the failed pull left nothing behind.
    prefill.st.region_mut(1)[at] ^= 0x40;
    let pulled = pull_sequence(
        &decode.agent,
        &peer,
        &mut decode.kv,
        &mut decode.st,
        SeqId(2),
        &offer,
        TIMEOUT,
    )
    .unwrap();
    check_values(&decode.st, &pulled.imported.table, &values(1, 50)).unwrap();

    // A damaged control message is refused before anything is allocated.
    let mut bad = offer.clone();
    let last = bad.len() - 12;
    bad[last] ^= 1; // the block table
    let before = snapshot(&decode);
    assert!(matches!(
        pull_sequence(
            &decode.agent,
            &peer,
            &mut decode.kv,
            &mut decode.st,
            SeqId(3),
            &bad,
            TIMEOUT
        ),
        Err(Error::Checksum { .. })
    ));
    assert_eq!(snapshot(&decode), before);
}

#[test]
fn wrong_layout_is_refused_before_any_transfer() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !nixl_or_skip("wrong_layout") {
        return;
    }
    let mut prefill = Side::new("prefill-layout", layout(16, DType::F16), 16);
    prefill.put(SeqId(1), &values(1, 30));
    let offer = offer_sequence(&prefill.kv, &prefill.st, SeqId(1), None, &mut Vec::new()).unwrap();
    let md = prefill.agent.local_metadata().unwrap();
    for (name, receiver, what) in [
        ("decode-bs32", layout(32, DType::F16), "block_size"),
        ("decode-bf16", layout(16, DType::BF16), "dtype"),
    ] {
        let mut decode = Side::new(name, receiver, 16);
        let peer = decode.agent.add_peer(&md).unwrap();
        let before = snapshot(&decode);
        let err = pull_sequence(
            &decode.agent,
            &peer,
            &mut decode.kv,
            &mut decode.st,
            SeqId(1),
            &offer,
            TIMEOUT,
        )
        .unwrap_err();
        assert!(
            matches!(err, Error::ExportShape { .. } | Error::ExportDType { .. }),
            "{what}: {err:?}"
        );
        assert!(!decode.kv.contains(SeqId(1)));
        assert_eq!(snapshot(&decode), before, "{what}");
        decode.kv.check_invariants().unwrap();
    }
    // Refused before the transport is touched: with the sender's agent gone, the
    // layout is still what the error names.
    let mut decode = Side::new("decode-bs32-late", layout(32, DType::F16), 16);
    let peer = decode.agent.add_peer(&md).unwrap();
    drop(prefill.agent);
    assert!(matches!(
        pull_sequence(
            &decode.agent,
            &peer,
            &mut decode.kv,
            &mut decode.st,
            SeqId(1),
            &offer,
            TIMEOUT
        ),
        Err(Error::ExportShape { .. })
    ));
}

#[test]
fn a_peer_whose_agent_was_destroyed_is_a_typed_error() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !nixl_or_skip("destroyed_peer") {
        return;
    }
    let l = layout(16, DType::F16);
    let mut prefill = Side::new("prefill-gone", l, 16);
    let mut decode = Side::new("decode-gone", l, 16);
    prefill.put(SeqId(1), &values(1, 40));
    decode.put(SeqId(9), &values(9, 10));
    let peer = decode
        .agent
        .add_peer(&prefill.agent.local_metadata().unwrap())
        .unwrap();
    let offer = offer_sequence(&prefill.kv, &prefill.st, SeqId(1), None, &mut Vec::new()).unwrap();
    drop(prefill.agent);

    let before = snapshot(&decode);
    let err = pull_sequence(
        &decode.agent,
        &peer,
        &mut decode.kv,
        &mut decode.st,
        SeqId(1),
        &offer,
        Duration::from_secs(5),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Transport { .. } | Error::TransportTimeout { .. }
        ),
        "{err:?}"
    );
    eprintln!("transfer from a destroyed agent: {err}");
    assert!(!decode.kv.contains(SeqId(1)));
    assert_eq!(snapshot(&decode).0, before.0);
    decode.kv.check_invariants().unwrap();
    check_values(
        &decode.st,
        decode.kv.block_table(SeqId(9)).unwrap(),
        &values(9, 10),
    )
    .unwrap();
}

#[test]
fn bad_block_requests_are_refused_before_anything_moves() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !nixl_or_skip("bad_block_requests") {
        return;
    }
    let l = layout(16, DType::F16);
    let mut prefill = Side::new("prefill-bad", l, 8);
    let mut decode = Side::new("decode-bad", l, 8);
    prefill.put(SeqId(1), &values(1, 40));
    decode.put(SeqId(2), &values(2, 40));
    let md = prefill.agent.local_metadata().unwrap();
    let mut damaged = md.clone();
    damaged[12] ^= 1;
    assert!(matches!(
        decode.agent.add_peer(&damaged),
        Err(Error::Checksum { .. })
    ));
    let peer = decode.agent.add_peer(&md).unwrap();
    let before = snapshot(&decode);
    let t = Duration::from_secs(5);
    let p = |r: u32, l: u32| (BlockId(r), BlockId(l));
    let err = decode
        .agent
        .read_blocks("nobody", &mut decode.st, &[p(0, 5)], t)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
    for pairs in [[p(8, 5)], [p(0, 8)]] {
        let err = decode
            .agent
            .read_blocks(&peer, &mut decode.st, &pairs, t)
            .unwrap_err();
        assert!(matches!(err, Error::BlockOutOfRange { .. }), "{err:?}");
    }
    let mut other = HostStorage::new(l, 8).unwrap();
    let err = decode
        .agent
        .read_blocks(&peer, &mut other, &[p(0, 5)], t)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
    assert_eq!(snapshot(&decode), before);
    assert!(other.region(0).iter().all(|&b| b == 0));

    // The same agent still moves blocks afterwards: 3 blocks, one descriptor per layer.
    let src = prefill.kv.block_table(SeqId(1)).unwrap().to_vec();
    let pairs: Vec<_> = src.iter().zip(5..).map(|(&r, l)| p(r.0, l)).collect();
    let stats = decode
        .agent
        .read_blocks(&peer, &mut decode.st, &pairs, t)
        .unwrap();
    assert_eq!(stats.bytes, 3 * l.block_bytes());
    assert_eq!(stats.descriptors, l.num_layers());
    let dst: Vec<BlockId> = (5..8).map(BlockId).collect();
    check_values(&decode.st, &dst, &values(1, 40)).unwrap();
}

/// Pulled blocks enter the receiver's prefix cache once their bytes are checked: after
/// a pull with token ids, `cached_prefix_len` of the prompt on the receiver is its full
/// blocks, a later request with that prefix shares the pulled blocks (after the pulled
/// sequence is freed too); a pull that fails its checksum registers nothing, and an
/// offer without ids registers nothing either.
#[test]
fn pulled_blocks_enter_the_receivers_prefix_cache() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !nixl_or_skip("pulled_blocks_enter_the_receivers_prefix_cache") {
        return;
    }
    let l = layout(16, DType::F16);
    let mut prefill = Side::new("prefill-cache", l, 32);
    let mut decode = Side::new("decode-cache", l, 32);
    let n = 50; // 3 full blocks and 2 tokens
    prefill.put(SeqId(1), &values(1, n));
    let ids: Vec<u32> = (0..n as u32).map(|t| 7 * t + 3).collect();
    let opts = AdmitOptions::default();
    let peer = decode
        .agent
        .add_peer(&prefill.agent.local_metadata().unwrap())
        .unwrap();
    let offer = offer_sequence(
        &prefill.kv,
        &prefill.st,
        SeqId(1),
        Some(&ids),
        &mut Vec::new(),
    )
    .unwrap();
    let pull = |decode: &mut Side, seq: SeqId, offer: &[u8]| {
        pull_sequence(
            &decode.agent,
            &peer,
            &mut decode.kv,
            &mut decode.st,
            seq,
            offer,
            TIMEOUT,
        )
    };

    // Without ids: the blocks arrive but nothing is registered.
    let bare = offer_sequence(&prefill.kv, &prefill.st, SeqId(1), None, &mut Vec::new()).unwrap();
    let pulled = pull(&mut decode, SeqId(10), &bare).unwrap();
    assert_eq!(pulled.registered_blocks, 0);
    assert_eq!(decode.kv.cached_prefix_len(&ids, &opts).unwrap(), 0);
    decode.kv.free(SeqId(10)).unwrap();

    // A byte of block 1 changes after the offer was made: the pull fails its checksum
    // and the receiver's prefix cache holds none of the prompt.
    let (block, tok) = (prefill.kv.block_table(SeqId(1)).unwrap()[1], 20 % 16);
    let at = l.block_byte_offset(block)
        + l.elem_offset(BlockId(0), pagedkv::layout::Kv::K, 0, tok) * l.dtype().size_bytes();
    prefill.st.region_mut(0)[at] ^= 0x10;
    let err = pull(&mut decode, SeqId(2), &offer).unwrap_err();
    assert!(matches!(err, Error::Checksum { .. }), "{err:?}");
    assert_eq!(decode.kv.cached_prefix_len(&ids, &opts).unwrap(), 0);
    assert_eq!(
        decode.kv.stats().cached_blocks,
        0,
        "{:?}",
        decode.kv.stats()
    );
    decode.kv.check_invariants().unwrap();

    // Restored, the pull registers the 3 full blocks (not the partial last one).
    prefill.st.region_mut(0)[at] ^= 0x10;
    let pulled = pull(&mut decode, SeqId(2), &offer).unwrap();
    assert_eq!(pulled.registered_blocks, 3);
    assert_eq!(decode.kv.cached_prefix_len(&ids, &opts).unwrap(), 48);
    decode.kv.check_invariants().unwrap();

    // A later request on the receiver with that prefix (and more) shares the pulled
    // blocks, also once the pulled sequence is gone; their bytes are the sender's.
    decode.kv.free(SeqId(2)).unwrap();
    let mut longer = ids.clone();
    longer.extend([1, 2, 3]);
    let mut slots = Vec::new();
    let admitted = decode
        .kv
        .admit_tokens(SeqId(3), &longer, &opts, &mut slots)
        .unwrap();
    assert_eq!(admitted.cached_tokens, 48);
    let table = decode.kv.block_table(SeqId(3)).unwrap().to_vec();
    assert_eq!(table[..3], pulled.imported.table[..3]);
    check_values(&decode.st, &table[..3], &values(1, 48)).unwrap();
    decode.kv.check_invariants().unwrap();
}
