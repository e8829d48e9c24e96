//! KV export/import: round trips (same and different block sizes, tensor-parallel
//! degrees, a partial block list, a loopback TCP socket) and rejection of every kind
//! of bad buffer with a typed error, leaving the receiver exactly as it was.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use pagedkv::executor::shard::ShardedStorage;
use pagedkv::export::{
    export_blocks, export_sequence, exported_len, import_sequence, ExportHeader, ExportView,
};
use pagedkv::export::{xxh64, EXPORT_VERSION, HEADER_FIXED_BYTES};
use pagedkv::layout::Kv;
use pagedkv::{
    CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape, SeqId, Storage,
};

use crate::support::faulty_storage;
use faulty_storage::FaultyStorage;

const LAYERS: usize = 3;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 8;

fn shape() -> ModelShape {
    ModelShape {
        num_layers: LAYERS,
        num_q_heads: 2 * KV_HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        kv_dtype: DType::F16,
    }
}

fn layout(block_size: usize) -> KvLayout {
    KvLayout::new(shape(), block_size).unwrap()
}

fn row(l: &KvLayout) -> usize {
    l.shape().num_kv_heads * l.shape().head_dim * l.dtype().size_bytes()
}

/// Bytes of token `pos` of a sequence, layer and K/V: a function of all three.
fn token_bytes(pos: u64, layer: usize, kv: Kv, len: usize, out: &mut Vec<u8>) {
    let mut x = pos
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((layer as u64) << 32 | (kv as u64) << 48);
    out.extend((0..len).map(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    }));
}

/// A manager and its storage.
struct Cache<S: Storage> {
    mgr: KvCache,
    kv: S,
}

fn host_cache(block_size: usize, num_blocks: usize) -> Cache<HostStorage> {
    let l = layout(block_size);
    let mut config = CacheConfig::new(num_blocks);
    config.watermark_blocks = 0;
    Cache {
        mgr: KvCache::new(l, config).unwrap(),
        kv: HostStorage::new(l, num_blocks).unwrap(),
    }
}

fn tp_cache(block_size: usize, num_blocks: usize, tp: usize) -> Cache<ShardedStorage<HostStorage>> {
    let l = layout(block_size);
    let mut config = CacheConfig::new(num_blocks);
    config.watermark_blocks = 0;
    Cache {
        mgr: KvCache::new(l, config).unwrap(),
        kv: ShardedStorage::host(l, tp, num_blocks, 0).unwrap(),
    }
}

impl<S: Storage> Cache<S> {
    /// Admits `seq` with `n` tokens whose K/V derive from `first + position`.
    fn prefill(&mut self, seq: SeqId, n: usize, first: u64) {
        let mut slots = Vec::new();
        self.mgr.admit(seq, n, &mut slots).unwrap();
        self.write(&slots, first);
    }

    fn append(&mut self, seq: SeqId, n: usize, first: u64) {
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        self.mgr.append(seq, n, &mut slots, &mut copies).unwrap();
        self.kv.copy_blocks(&copies).unwrap();
        self.write(&slots, first);
    }

    fn write(&mut self, slots: &[pagedkv::layout::Slot], first: u64) {
        let r = row(self.kv.layout());
        for layer in 0..LAYERS {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for i in 0..slots.len() as u64 {
                token_bytes(first + i, layer, Kv::K, r, &mut k);
                token_bytes(first + i, layer, Kv::V, r, &mut v);
            }
            self.kv.write_slots(layer, slots, &k, &v).unwrap();
        }
    }

    /// Every layer's K and V of the first `n` tokens of `table`.
    fn read(&self, table: &[pagedkv::BlockId], n: usize) -> Vec<Vec<u8>> {
        let r = row(self.kv.layout());
        let mut out = Vec::new();
        for layer in 0..LAYERS {
            let (mut k, mut v) = (vec![0; n * r], vec![0; n * r]);
            self.kv
                .read_tokens(layer, table, n, &mut k, &mut v)
                .unwrap();
            out.push(k);
            out.push(v);
        }
        out
    }

    fn read_seq(&self, seq: SeqId) -> Vec<Vec<u8>> {
        let n = self.mgr.num_tokens(seq).unwrap();
        self.read(self.mgr.block_table(seq).unwrap(), n)
    }

    fn export(&self, seq: SeqId, ids: Option<&[u32]>) -> Vec<u8> {
        let n = self.mgr.num_tokens(seq).unwrap();
        let mut buf = vec![0; exported_len(self.kv.layout(), n, ids.is_some()).unwrap()];
        let written = export_sequence(&self.mgr, &self.kv, seq, ids, &mut buf).unwrap();
        assert_eq!(written, buf.len());
        buf
    }
}

/// A sender holding sequences of awkward lengths, one of them a fork whose append
/// went through copy-on-write.
fn populated<S: Storage>(mut c: Cache<S>) -> (Cache<S>, Vec<SeqId>) {
    let bs = c.mgr.block_size();
    let lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3, 0];
    let mut seqs = Vec::new();
    for (i, &n) in lens.iter().enumerate() {
        let seq = SeqId(i as u64);
        c.prefill(seq, n, 1000 * i as u64);
        seqs.push(seq);
    }
    c.mgr.fork(SeqId(4), SeqId(99)).unwrap();
    c.append(SeqId(99), 2, 777_777);
    c.append(SeqId(4), 1, 555_555);
    seqs.push(SeqId(99));
    (c, seqs)
}

fn ids_for(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761) ^ salt)
        .collect()
}

#[test]
fn round_trips_across_block_sizes() {
    for (send_bs, recv_bs) in [(16, 16), (16, 4), (4, 16), (8, 1), (1, 8)] {
        let (src, seqs) = populated(host_cache(send_bs, 256));
        let mut dst = host_cache(recv_bs, 2048);
        for (i, &seq) in seqs.iter().enumerate() {
            let n = src.mgr.num_tokens(seq).unwrap();
            let ids = ids_for(n, i as u32);
            let with_ids = i % 2 == 0;
            let buf = src.export(seq, with_ids.then_some(&ids[..]));
            let new = SeqId(1000 + i as u64);
            let got = import_sequence(&mut dst.mgr, &mut dst.kv, new, &buf).unwrap();
            assert_eq!(got.seq, new);
            assert_eq!(got.num_tokens, n);
            assert_eq!(got.table, dst.mgr.block_table(new).unwrap());
            assert_eq!(got.table.len(), n.div_ceil(recv_bs));
            assert_eq!(got.token_ids, with_ids.then(|| ids.clone()));
            assert_eq!(
                dst.read_seq(new),
                src.read_seq(seq),
                "{seq} block sizes {send_bs} -> {recv_bs}"
            );
            dst.mgr.check_invariants().unwrap();
        }
        // The imported sequences are ordinary: they grow and fork like any other.
        dst.append(SeqId(1004), 3, 42);
        dst.mgr.fork(SeqId(1004), SeqId(5000)).unwrap();
        dst.append(SeqId(5000), 1, 43);
        dst.mgr.check_invariants().unwrap();
    }
}

#[test]
fn tensor_parallel_degrees_may_differ() {
    let (src, seqs) = populated(tp_cache(16, 128, 2));
    let mut plain = host_cache(8, 512);
    let mut tp4 = tp_cache(32, 128, 4);
    for &seq in &seqs {
        let buf = src.export(seq, None);
        let a = import_sequence(&mut plain.mgr, &mut plain.kv, seq, &buf).unwrap();
        let b = import_sequence(&mut tp4.mgr, &mut tp4.kv, seq, &buf).unwrap();
        let want = src.read_seq(seq);
        assert_eq!(plain.read(&a.table, a.num_tokens), want);
        assert_eq!(tp4.read(&b.table, b.num_tokens), want);
    }
}

#[test]
fn a_partial_block_list_exports() {
    let (src, _) = populated(host_cache(4, 64));
    let table = src.mgr.block_table(SeqId(4)).unwrap();
    // The first two blocks, and 6 tokens of the first two blocks.
    for n in [8, 6] {
        let mut buf = vec![0; exported_len(src.kv.layout(), n, false).unwrap()];
        export_blocks(&src.kv, &table[..2], n, None, &mut buf).unwrap();
        let mut dst = host_cache(4, 16);
        let got = import_sequence(&mut dst.mgr, &mut dst.kv, SeqId(1), &buf).unwrap();
        assert_eq!(dst.read(&got.table, n), src.read(table, n));
    }
    // A table too short for the tokens is refused.
    let mut buf = vec![0; exported_len(src.kv.layout(), 9, false).unwrap()];
    assert!(matches!(
        export_blocks(&src.kv, &table[..2], 9, None, &mut buf),
        Err(Error::CorruptBlockTable(_))
    ));
}

#[test]
fn exports_need_room_and_matching_token_ids() {
    let (src, _) = populated(host_cache(16, 64));
    let n = src.mgr.num_tokens(SeqId(3)).unwrap();
    let len = exported_len(src.kv.layout(), n, true).unwrap();
    let mut short = vec![0; len - 1];
    let ids = ids_for(n, 0);
    assert_eq!(
        export_sequence(&src.mgr, &src.kv, SeqId(3), Some(&ids), &mut short),
        Err(Error::ShapeMismatch {
            what: "export buffer bytes (at least)",
            expected: len,
            got: len - 1
        })
    );
    let mut buf = vec![0; len + 100];
    assert!(matches!(
        export_sequence(&src.mgr, &src.kv, SeqId(3), Some(&ids[1..]), &mut buf),
        Err(Error::ShapeMismatch { .. })
    ));
    assert_eq!(
        export_sequence(&src.mgr, &src.kv, SeqId(77), None, &mut buf),
        Err(Error::UnknownSequence(SeqId(77)))
    );
    // A larger buffer is fine, and trailing bytes are ignored on import.
    let written = export_sequence(&src.mgr, &src.kv, SeqId(3), Some(&ids), &mut buf).unwrap();
    assert_eq!(written, len);
    buf[len..].fill(0xAB);
    let mut dst = host_cache(16, 8);
    import_sequence(&mut dst.mgr, &mut dst.kv, SeqId(3), &buf).unwrap();
}

/// Reads one export from a stream: the fixed header says how long the rest is.
fn read_frame(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let mut buf = vec![0; HEADER_FIXED_BYTES];
    match stream.read_exact(&mut buf) {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        r => r?,
    }
    let header = ExportHeader::parse(&buf).map_err(std::io::Error::other)?;
    buf.resize(header.total_len(), 0);
    stream.read_exact(&mut buf[HEADER_FIXED_BYTES..])?;
    Ok(Some(buf))
}

#[test]
fn round_trip_over_a_loopback_socket() {
    let (src, seqs) = populated(host_cache(16, 256));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let receiver = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut dst = host_cache(4, 1024);
        let mut imported = Vec::new();
        while let Some(frame) = read_frame(&mut stream).unwrap() {
            let seq = SeqId(imported.len() as u64);
            let got = import_sequence(&mut dst.mgr, &mut dst.kv, seq, &frame).unwrap();
            imported.push(dst.read(&got.table, got.num_tokens));
        }
        imported
    });
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut shipped = 0;
    for &seq in &seqs {
        let buf = src.export(seq, Some(&ids_for(src.mgr.num_tokens(seq).unwrap(), 1)));
        stream.write_all(&buf).unwrap();
        shipped += buf.len();
    }
    drop(stream);
    let imported = receiver.join().unwrap();
    assert_eq!(imported.len(), seqs.len());
    for (got, &seq) in imported.iter().zip(&seqs) {
        assert_eq!(*got, src.read_seq(seq), "{seq}");
    }
    assert!(shipped > 0);
}

// ---- rejection ---------------------------------------------------------------------

/// A receiver with some sequences of its own, and a snapshot to compare against.
struct Receiver {
    c: Cache<HostStorage>,
    stats: pagedkv::CacheStats,
    regions: Vec<Vec<u8>>,
}

impl Receiver {
    fn new(num_blocks: usize) -> Self {
        let mut c = host_cache(8, num_blocks);
        c.prefill(SeqId(500), 13, 1);
        c.prefill(SeqId(501), 30, 2);
        c.mgr.fork(SeqId(501), SeqId(502)).unwrap();
        c.append(SeqId(502), 1, 3);
        c.mgr.free(SeqId(500)).unwrap();
        let stats = c.mgr.stats();
        let regions = (0..LAYERS).map(|l| c.kv.region(l).to_vec()).collect();
        Receiver { c, stats, regions }
    }

    /// Imports `buf` as `seq` expecting an error; checks nothing changed.
    fn reject(&mut self, buf: &[u8], seq: SeqId) -> Error {
        let existed = self.c.mgr.contains(seq);
        let err = import_sequence(&mut self.c.mgr, &mut self.c.kv, seq, buf)
            .expect_err("a bad buffer was imported");
        assert_eq!(self.c.mgr.stats(), self.stats, "after {err}");
        self.c.mgr.check_invariants().unwrap();
        assert_eq!(self.c.mgr.contains(seq), existed);
        for l in 0..LAYERS {
            assert!(
                self.c.kv.region(l) == self.regions[l],
                "storage changed by {err}"
            );
        }
        err
    }
}

/// Rewrites the header checksum after a deliberate edit, as a buggy or hostile sender
/// would, so the field checks behind the checksum are reached.
fn patch(buf: &mut [u8], offset: usize, bytes: &[u8]) {
    buf[offset..offset + bytes.len()].copy_from_slice(bytes);
    buf[16..24].fill(0);
    let sum = xxh64(&buf[..HEADER_FIXED_BYTES]);
    buf[16..24].copy_from_slice(&sum.to_le_bytes());
}

fn good_export() -> (Vec<u8>, usize, usize) {
    let (src, _) = populated(host_cache(16, 64));
    let n = src.mgr.num_tokens(SeqId(4)).unwrap();
    let buf = src.export(SeqId(4), Some(&ids_for(n, 9)));
    (buf, n, 16)
}

#[test]
fn every_flipped_header_byte_is_rejected() {
    let (good, _, _) = good_export();
    let header_len = ExportView::parse(&good).unwrap().header().header_len();
    let mut rx = Receiver::new(64);
    for i in 0..header_len {
        let mut bad = good.clone();
        bad[i] ^= 1 << (i % 8);
        let err = rx.reject(&bad, SeqId(1));
        match i {
            0..=7 => assert!(matches!(err, Error::ExportFormat { what: "magic", .. })),
            8..=11 => assert!(matches!(
                err,
                Error::ExportFormat {
                    what: "version",
                    ..
                }
            )),
            12..=127 => assert!(
                matches!(&err, Error::Checksum { what, .. } if what == "KV export header"),
                "byte {i}: {err}"
            ),
            _ => assert!(
                matches!(&err, Error::Checksum { what, .. } if what.contains("token ids")),
                "byte {i}: {err}"
            ),
        }
    }
}

#[test]
fn flipped_payload_bytes_name_their_block() {
    let (good, n, bs) = good_export();
    let header_len = ExportView::parse(&good).unwrap().header().header_len();
    let r = row(&layout(bs));
    let mut rx = Receiver::new(64);
    let positions = (header_len..good.len())
        .step_by(251)
        .chain([good.len() - 1]);
    for p in positions {
        let mut bad = good.clone();
        bad[p] ^= 0x80;
        let token = ((p - header_len) % (n * r)) / r;
        let err = rx.reject(&bad, SeqId(1));
        match err {
            Error::Checksum { what, .. } => {
                assert_eq!(what, format!("KV export payload, block {}", token / bs))
            }
            other => panic!("byte {p}: {other}"),
        }
    }
}

#[test]
fn truncated_buffers_are_rejected() {
    let (good, _, _) = good_export();
    let header_len = ExportView::parse(&good).unwrap().header().header_len();
    let mut rx = Receiver::new(64);
    for len in [
        0,
        5,
        8,
        11,
        12,
        127,
        128,
        header_len - 1,
        header_len,
        good.len() - 1,
    ] {
        let err = rx.reject(&good[..len], SeqId(1));
        let needed = if len < HEADER_FIXED_BYTES {
            HEADER_FIXED_BYTES
        } else {
            good.len()
        };
        assert_eq!(
            err,
            Error::ExportTruncated { needed, got: len },
            "length {len}"
        );
    }
}

#[test]
fn other_versions_and_inconsistent_fields_are_rejected() {
    let (good, _, _) = good_export();
    let mut rx = Receiver::new(64);
    // A newer version is named as such, whether or not its checksum matches ours.
    let mut v2 = good.clone();
    v2[8..12].copy_from_slice(&(EXPORT_VERSION + 1).to_le_bytes());
    let want = Error::ExportFormat {
        what: "version",
        expected: 1,
        got: 2,
    };
    assert_eq!(rx.reject(&v2, SeqId(1)), want);
    patch(&mut v2, 8, &2u32.to_le_bytes());
    assert_eq!(rx.reject(&v2, SeqId(1)), want);
    // Fields that contradict each other behind a valid checksum.
    for (offset, value, what) in [
        (12, 2u64, "flags"),
        (32, 999, "header_len"),
        (40, 1, "payload_len"),
        (72, 5, "stride_block"),
        (112, 1, "num_blocks"),
        (120, 1, "reserved"),
        (64, 9, "dtype code"),
    ] {
        let mut bad = good.clone();
        let bytes = value.to_le_bytes();
        let width = if matches!(offset, 12 | 64) { 4 } else { 8 };
        patch(&mut bad, offset, &bytes[..width]);
        let err = rx.reject(&bad, SeqId(1));
        assert!(
            matches!(err, Error::ExportFormat { what: w, .. } if w == what),
            "{what}: {err}"
        );
    }
    // A block size no cache could have.
    let mut bad = good.clone();
    patch(&mut bad, 68, &0u32.to_le_bytes());
    assert!(matches!(
        rx.reject(&bad, SeqId(1)),
        Error::InvalidConfig {
            field: "block_size",
            ..
        }
    ));
}

#[test]
fn other_shapes_and_dtypes_are_rejected() {
    let mut rx = Receiver::new(64);
    let cases: [(ModelShape, Error); 4] = [
        (
            ModelShape {
                head_dim: 16,
                ..shape()
            },
            Error::ExportShape {
                what: "head_dim",
                sender: 16,
                receiver: HEAD_DIM,
            },
        ),
        (
            ModelShape {
                num_kv_heads: 2,
                num_q_heads: 8,
                ..shape()
            },
            Error::ExportShape {
                what: "num_kv_heads",
                sender: 2,
                receiver: KV_HEADS,
            },
        ),
        (
            ModelShape {
                num_layers: 2,
                ..shape()
            },
            Error::ExportShape {
                what: "num_layers",
                sender: 2,
                receiver: LAYERS,
            },
        ),
        (
            shape().with_dtype(DType::BF16),
            Error::ExportDType {
                sender: DType::BF16.name(),
                receiver: DType::F16.name(),
            },
        ),
    ];
    for (other, want) in cases {
        let l = KvLayout::new(other, 8).unwrap();
        let mut mgr = KvCache::new(l, CacheConfig::new(8)).unwrap();
        let kv = HostStorage::new(l, 8).unwrap();
        mgr.admit(SeqId(1), 10, &mut Vec::new()).unwrap();
        let mut buf = vec![0; exported_len(&l, 10, false).unwrap()];
        export_sequence(&mgr, &kv, SeqId(1), None, &mut buf).unwrap();
        assert_eq!(rx.reject(&buf, SeqId(1)), want);
    }
}

#[test]
fn receiver_refusals_allocate_nothing() {
    let (good, n, _) = good_export();
    // Too small to hold the sequence.
    let mut rx = Receiver::new(12);
    let free = rx.c.mgr.num_available_blocks();
    assert_eq!(
        rx.reject(&good, SeqId(1)),
        Error::OutOfBlocks {
            needed: n.div_ceil(8),
            free
        }
    );
    // The sequence id is taken.
    let mut rx = Receiver::new(64);
    assert_eq!(
        rx.reject(&good, SeqId(501)),
        Error::DuplicateSequence(SeqId(501))
    );
    // A storage that does not match the manager.
    let mut other = HostStorage::new(layout(16), 64).unwrap();
    let before = rx.c.mgr.stats();
    assert!(matches!(
        import_sequence(&mut rx.c.mgr, &mut other, SeqId(1), &good),
        Err(Error::InvalidConfig {
            field: "storage",
            ..
        })
    ));
    assert_eq!(rx.c.mgr.stats(), before);
    // And the good buffer still imports afterwards.
    import_sequence(&mut rx.c.mgr, &mut rx.c.kv, SeqId(1), &good).unwrap();
    rx.c.mgr.check_invariants().unwrap();
}

#[test]
fn a_storage_fault_during_import_frees_the_new_sequence() {
    let (good, _, _) = good_export();
    let rx = Receiver::new(64);
    let mut mgr = rx.c.mgr.clone();
    let mut faulty = FaultyStorage {
        inner: rx.c.kv.clone(),
        failing_layer: 1,
    };
    let err = import_sequence(&mut mgr, &mut faulty, SeqId(1), &good).unwrap_err();
    assert_eq!(err, Error::Cuda("simulated fault".into()));
    assert!(!mgr.contains(SeqId(1)));
    mgr.check_invariants().unwrap();
    // Everything but the peak counter is as before (documented).
    let (mut now, mut before) = (mgr.stats(), rx.stats);
    assert!(now.peak_used_blocks >= before.peak_used_blocks);
    now.peak_used_blocks = 0;
    before.peak_used_blocks = 0;
    assert_eq!(now, before);
}

#[test]
fn imports_go_through_the_receivers_prefix_cache() {
    // The sender holds one conversation of 5 blocks + 3 tokens.
    let (mut sender, mut receiver) = (host_cache(4, 32), host_cache(4, 32));
    sender.prefill(SeqId(1), 23, 42);
    let ids = ids_for(23, 9);
    let buf = sender.export(SeqId(1), Some(&ids));
    let want = sender.read_seq(SeqId(1));
    let view = ExportView::parse(&buf).unwrap();
    let opts = pagedkv::AdmitOptions::default();

    // First import: nothing cached yet; its 5 full blocks get registered.
    let (a, cached) = view
        .import_into_cache(&mut receiver.mgr, &mut receiver.kv, SeqId(10), &opts)
        .unwrap();
    assert_eq!((a.num_tokens, cached), (23, 0));
    assert_eq!(receiver.read_seq(SeqId(10)), want);
    // Second import of the same conversation: the full blocks are shared, only the
    // tail is written, and the bytes are the same.
    let (b, cached) = view
        .import_into_cache(&mut receiver.mgr, &mut receiver.kv, SeqId(11), &opts)
        .unwrap();
    assert_eq!(cached, 20);
    assert_eq!(&a.table[..5], &b.table[..5]);
    assert_ne!(a.table[5], b.table[5]);
    assert_eq!(receiver.read_seq(SeqId(11)), want);
    // After the first sequence is freed, its blocks still serve a third import.
    receiver.mgr.free(SeqId(10)).unwrap();
    receiver.mgr.free(SeqId(11)).unwrap();
    let (_, cached) = view
        .import_into_cache(&mut receiver.mgr, &mut receiver.kv, SeqId(12), &opts)
        .unwrap();
    assert_eq!(cached, 20);
    assert_eq!(receiver.read_seq(SeqId(12)), want);
    receiver.mgr.check_invariants().unwrap();

    // An export without token ids cannot use the cache: a typed error, nothing allocated.
    let plain = sender.export(SeqId(1), None);
    let before = receiver.mgr.stats();
    let err = ExportView::parse(&plain).unwrap().import_into_cache(
        &mut receiver.mgr,
        &mut receiver.kv,
        SeqId(13),
        &opts,
    );
    assert!(matches!(err, Err(Error::ExportFormat { .. })));
    assert_eq!(receiver.mgr.stats(), before);
}

/// A DeepSeek-like latent layout in miniature: 2 layers, latent 6 + rope 2, f16.
fn latent_layout(block_size: usize) -> KvLayout {
    let kind = pagedkv::KvKind::Latent {
        kv_lora_rank: 6,
        rope_dim: 2,
    };
    KvLayout::with_kind(ModelShape::latent(2, 4, 6, 2, DType::F16), block_size, kind).unwrap()
}

/// Admits `seq` with `n` tokens in `mgr` and writes latent bytes that name the token,
/// the layer and `salt`; returns every layer's latents.
fn latent_prefill(
    mgr: &mut KvCache,
    kv: &mut HostStorage,
    seq: SeqId,
    n: usize,
    salt: u8,
) -> Vec<Vec<u8>> {
    let mut slots = Vec::new();
    mgr.admit(seq, n, &mut slots).unwrap();
    let width = 8 * 2;
    (0..2)
        .map(|layer| {
            let bytes: Vec<u8> = (0..n * width)
                .map(|i| (i / width * 7 + i % width * 3 + layer * 101) as u8 ^ salt)
                .collect();
            kv.write_slots(layer, &slots, &bytes, &[]).unwrap();
            bytes
        })
        .collect()
}

fn read_latents(mgr: &KvCache, kv: &HostStorage, seq: SeqId) -> Vec<Vec<u8>> {
    let (table, n) = mgr.readable_blocks(seq).unwrap();
    (0..2)
        .map(|layer| {
            let mut k = vec![0u8; n * 16];
            kv.read_tokens(layer, table, n, &mut k, &mut []).unwrap();
            k
        })
        .collect()
}

#[test]
fn a_latent_layout_round_trips_and_is_refused_by_a_kv_receiver() {
    let sender_layout = latent_layout(4);
    let mut sender = KvCache::new(sender_layout, pagedkv::CacheConfig::new(16)).unwrap();
    let mut sender_kv = HostStorage::new(sender_layout, 16).unwrap();
    let want = latent_prefill(&mut sender, &mut sender_kv, SeqId(1), 23, 0x5a);
    let ids = ids_for(23, 3);
    let mut wire = vec![0u8; exported_len(&sender_layout, 23, true).unwrap()];
    export_sequence(&sender, &sender_kv, SeqId(1), Some(&ids), &mut wire).unwrap();
    // One vector per token and layer: half a K/V payload of the same width.
    let view = ExportView::parse(&wire).unwrap();
    assert_eq!(view.header().layout(), &sender_layout);
    assert_eq!(view.header().payload_len(), 23 * 2 * 16);
    assert_eq!(view.layer(1).unwrap(), (&want[1][..], &[][..]));
    assert_eq!(u32::from_le_bytes(wire[124..128].try_into().unwrap()), 6);

    // The receiver pages by 8 tokens: re-paged, every latent byte the same.
    let rx_layout = latent_layout(8);
    let mut rx = KvCache::new(rx_layout, pagedkv::CacheConfig::new(16)).unwrap();
    let mut rx_kv = HostStorage::new(rx_layout, 16).unwrap();
    let got = import_sequence(&mut rx, &mut rx_kv, SeqId(7), &wire).unwrap();
    assert_eq!((got.num_tokens, got.table.len()), (23, 3));
    assert_eq!(read_latents(&rx, &rx_kv, SeqId(7)), want);
    // Through the prefix cache: the second import shares the full blocks.
    let opts = pagedkv::AdmitOptions::default();
    view.import_into_cache(&mut rx, &mut rx_kv, SeqId(8), &opts)
        .unwrap();
    let (b, cached) = view
        .import_into_cache(&mut rx, &mut rx_kv, SeqId(9), &opts)
        .unwrap();
    assert_eq!((b.num_tokens, cached), (23, 16));
    assert_eq!(read_latents(&rx, &rx_kv, SeqId(9)), want);
    rx.check_invariants().unwrap();

    // A corrupted latent byte names its block; nothing is allocated.
    let before = format!("{rx:?}");
    let mut bad = wire.clone();
    let at = view.header().header_len() + 16 * 23 + 5 * 16; // layer 1, token 5
    bad[at] ^= 1;
    let e = import_sequence(&mut rx, &mut rx_kv, SeqId(10), &bad).unwrap_err();
    assert!(
        matches!(&e, Error::Checksum { what, .. } if what.ends_with("block 1")),
        "{e}"
    );
    // A rank that leaves no rope part, behind a valid checksum, is a format error.
    let mut bad = wire.clone();
    patch(&mut bad, 124, &8u32.to_le_bytes());
    assert!(matches!(
        import_sequence(&mut rx, &mut rx_kv, SeqId(10), &bad),
        Err(Error::ExportFormat { .. })
    ));
    assert_eq!(format!("{rx:?}"), before);

    // A K/V receiver of the same bytes per token refuses a latent export, and the
    // other way round: the kinds differ.
    let kv_shape = ModelShape {
        num_layers: 2,
        num_q_heads: 4,
        num_kv_heads: 1,
        head_dim: 8,
        kv_dtype: DType::F16,
    };
    let kv_layout = KvLayout::new(kv_shape, 4).unwrap();
    let mut kv_rx = KvCache::new(kv_layout, pagedkv::CacheConfig::new(16)).unwrap();
    let mut kv_rx_kv = HostStorage::new(kv_layout, 16).unwrap();
    let e = import_sequence(&mut kv_rx, &mut kv_rx_kv, SeqId(1), &wire).unwrap_err();
    assert!(
        matches!(
            e,
            Error::ExportShape {
                sender: 6,
                receiver: 0,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(kv_rx.stats().used_blocks, 0);
    let mut slots = Vec::new();
    kv_rx.admit(SeqId(2), 5, &mut slots).unwrap();
    let mut kv_wire = vec![0u8; exported_len(&kv_layout, 5, false).unwrap()];
    export_sequence(&kv_rx, &kv_rx_kv, SeqId(2), None, &mut kv_wire).unwrap();
    // A K/V export keeps its reserved bytes zero, as before latent layouts.
    assert_eq!(&kv_wire[120..128], &[0; 8]);
    let e = import_sequence(&mut rx, &mut rx_kv, SeqId(10), &kv_wire).unwrap_err();
    assert!(
        matches!(
            e,
            Error::ExportShape {
                sender: 0,
                receiver: 6,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(format!("{rx:?}"), before);
}
