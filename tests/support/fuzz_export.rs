//! Fuzz harnesses for the KV export readers that face the network: a single export
//! (`ExportView::parse`, `import_sequence`, `ExportView::import_into_cache`) and a group
//! export (`GroupExportView::parse`, `import_group_sequence`,
//! `GroupExportView::import_into_cache`), shared by `fuzz/fuzz_targets/{export,
//! group_export}.rs` and `tests/cache/fuzz_corpus.rs`.
//!
//! Input: one flag byte, then the export. Flag bit 0 makes the harness rewrite every
//! checksum of the export (header, tables, block hashes, and a group export's header
//! and table) from the bytes it was given, so mutations reach the checks behind the
//! checksums (shapes, lengths, the import itself) instead of all failing the first
//! hash; bit 1 imports through the receiver's prefix cache.
//!
//! Checked: no panic; an accepted export imports as a sequence whose every held byte
//! equals the export's (past any prefix-cache hit), the receiver's other sequence
//! keeps its bytes, invariants hold, and freeing the import leaves nothing behind; a
//! refused one leaves the receiver's bookkeeping and every byte of its arena as they
//! were.

#![allow(dead_code)] // each test binary uses its own part

// Its own copy: the fuzz targets include this file alone, without `support`.
#[allow(clippy::duplicate_mod)]
#[path = "snapshot.rs"]
mod snapshot;

use pagedkv::export::groups::{export_group_sequence, exported_group_len, GroupExportView};
use pagedkv::export::{
    export_sequence, exported_len, xxh64, ExportHeader, ExportView, HEADER_FIXED_BYTES,
};
use pagedkv::layout::Slot;
use pagedkv::{
    AdmitOptions, BlockId, DType, GroupSpec, GroupStep, HostStorage, KvCache, KvKind, KvLayout,
    ModelShape, SeqId, Storage,
};
use snapshot::{device_bytes, read_kv as read, snapshot};

/// Flag bit: rewrite the checksums before parsing.
pub const REPAIR: u8 = 1;
/// Flag bit: import through the receiver's prefix cache.
pub const THROUGH_CACHE: u8 = 2;

const RECEIVER_BLOCKS: usize = 24;
const GROUP_PAGES: usize = 32;
const GROUP_WINDOW: usize = 8;
/// The sequence the receiver holds before the import, and the one imported.
const RESIDENT: SeqId = SeqId(9);
const IMPORTED: SeqId = SeqId(5);

fn shape(layers: usize, kv_heads: usize, dtype: DType) -> ModelShape {
    ModelShape {
        num_layers: layers,
        num_q_heads: 2 * kv_heads,
        num_kv_heads: kv_heads,
        head_dim: 4,
        kv_dtype: dtype,
    }
}

/// The receiver of single exports: 2 layers, 1 KV head of 4 f16, blocks of 4 tokens.
pub fn receiver_layout() -> KvLayout {
    KvLayout::new(shape(2, 1, DType::F16), 4).unwrap()
}

fn read_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap())
}

fn read_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().unwrap())
}

/// XXH64 of `bytes` with the 8 bytes at `at` taken as zero (how both formats checksum
/// their fixed headers).
fn checksum_without(bytes: &[u8], at: usize) -> u64 {
    let mut b = bytes.to_vec();
    b[at..at + 8].fill(0);
    xxh64(&b)
}

/// Bytes of one layer's K (or V) row of one token.
fn row_bytes(l: &KvLayout) -> usize {
    l.shape().num_kv_heads * l.shape().head_dim * l.dtype().size_bytes()
}

/// Rewrites the checksums of the single export at the start of `buf` (written here from
/// the format's description, not with the crate's code): the header's, each block's
/// content hash, the tables'. Returns the export's length when its header parses.
pub fn repair_single(buf: &mut [u8]) -> Option<usize> {
    const HEADER_CHECKSUM: usize = 16;
    const TABLES_CHECKSUM: usize = 24;
    let fixed = HEADER_FIXED_BYTES;
    if buf.len() < fixed {
        return None;
    }
    let sum = checksum_without(&buf[..fixed], HEADER_CHECKSUM);
    buf[HEADER_CHECKSUM..HEADER_CHECKSUM + 8].copy_from_slice(&sum.to_le_bytes());
    let h = ExportHeader::parse(buf).ok()?;
    let total = h.total_len();
    if buf.len() < total {
        return Some(total);
    }
    let l = *h.layout();
    let n = h.num_tokens();
    let ids = if h.has_token_ids() {
        (4 * n).next_multiple_of(8)
    } else {
        0
    };
    let (bs, row) = (l.block_size(), row_bytes(&l));
    let halves = l.kind().vectors_per_head() * l.num_layers();
    let (head, payload) = buf[..total].split_at_mut(h.header_len());
    for b in 0..l.blocks_for_tokens(n) {
        let (t0, t1) = (b * bs, ((b + 1) * bs).min(n));
        let mut block = Vec::new();
        for half in 0..halves {
            let base = half * n * row;
            block.extend_from_slice(&payload[base + t0 * row..base + t1 * row]);
        }
        let at = fixed + ids + 8 * b;
        head[at..at + 8].copy_from_slice(&xxh64(&block).to_le_bytes());
    }
    let tables = xxh64(&head[fixed..]);
    head[TABLES_CHECKSUM..TABLES_CHECKSUM + 8].copy_from_slice(&tables.to_le_bytes());
    let sum = checksum_without(&head[..fixed], HEADER_CHECKSUM);
    head[HEADER_CHECKSUM..HEADER_CHECKSUM + 8].copy_from_slice(&sum.to_le_bytes());
    Some(total)
}

/// Rewrites every checksum of a group export: each record's ([`repair_single`]), the
/// group table's and the group header's.
pub fn repair_group(buf: &mut [u8]) {
    const FIXED: usize = 40;
    const PER_GROUP: usize = 24;
    const CHECKSUM_AT: usize = 16;
    const TABLE_CHECKSUM_AT: usize = 32;
    if buf.len() < FIXED {
        return;
    }
    let groups = (read_u32(&buf[12..]) as usize).min(255);
    let head_len = FIXED + PER_GROUP * groups;
    if buf.len() < head_len {
        return;
    }
    let mut at = head_len;
    for g in 0..groups {
        let len = read_u64(&buf[FIXED + PER_GROUP * g + 16..]);
        let Some(end) = usize::try_from(len).ok().and_then(|l| at.checked_add(l)) else {
            break;
        };
        if end > buf.len() {
            break;
        }
        repair_single(&mut buf[at..end]);
        at = end;
    }
    let table = xxh64(&buf[FIXED..head_len]);
    buf[TABLE_CHECKSUM_AT..FIXED].copy_from_slice(&table.to_le_bytes());
    let sum = checksum_without(&buf[..FIXED], CHECKSUM_AT);
    buf[CHECKSUM_AT..CHECKSUM_AT + 8].copy_from_slice(&sum.to_le_bytes());
}

/// The K (kind 0) or V (kind 1) bytes of `n` tokens from `first`, distinct per token,
/// layer and salt.
fn pattern(l: &KvLayout, layer: usize, kind: u8, first: usize, n: usize, salt: u8) -> Vec<u8> {
    let row = row_bytes(l);
    (0..n * row)
        .map(|i| {
            let (t, b) = (first + i / row, i % row);
            (t as u8).wrapping_mul(31) ^ (layer as u8) << 5 ^ kind << 7 ^ (b as u8) ^ salt
        })
        .collect()
}

fn write_pattern(st: &mut HostStorage, l: &KvLayout, slots: &[Slot], first: usize, salt: u8) {
    for layer in 0..l.num_layers() {
        let k = pattern(l, layer, 0, first, slots.len(), salt);
        let v = if l.kind().vectors_per_head() == 2 {
            pattern(l, layer, 1, first, slots.len(), salt)
        } else {
            Vec::new()
        };
        st.write_slots(layer, slots, &k, &v).unwrap();
    }
}

/// A receiver of single exports holding one written sequence, with its prefix cache.
fn single_receiver() -> (KvCache, HostStorage) {
    let l = receiver_layout();
    let mut kv = KvCache::builder(l)
        .num_blocks(RECEIVER_BLOCKS)
        .watermark_blocks(0)
        .build()
        .unwrap();
    let mut st = HostStorage::new(l, RECEIVER_BLOCKS).unwrap();
    let tokens: Vec<u32> = (0..7).collect();
    let mut slots = Vec::new();
    kv.admit_tokens(RESIDENT, &tokens, &AdmitOptions::default(), &mut slots)
        .unwrap();
    write_pattern(&mut st, &l, &slots, 0, 0x55);
    (kv, st)
}

/// The flag byte and the export bytes of a fuzz input, repaired when the flag says so.
fn split(data: &[u8]) -> Option<(u8, Vec<u8>)> {
    let (&flags, rest) = data.split_first()?;
    Some((flags, rest.to_vec()))
}

/// One single-export input (see the module docs); returns whether it was imported.
pub fn run_single(data: &[u8]) -> bool {
    let Some((flags, mut buf)) = split(data) else {
        return false;
    };
    if flags & REPAIR != 0 {
        repair_single(&mut buf);
    }
    let (mut kv, mut st) = single_receiver();
    let resident = kv.block_table(RESIDENT).unwrap().to_vec();
    let before = (snapshot(&kv), device_bytes(&st, RECEIVER_BLOCKS));
    let result = ExportView::parse(&buf).and_then(|view| {
        // The accessors stay inside the buffer whatever the header said.
        let h = *view.header();
        assert_eq!(view.as_bytes().len(), h.total_len());
        assert_eq!(view.block_hashes().len(), h.num_blocks());
        let _ = view.token_ids().count();
        for layer in 0..=h.layout().num_layers() {
            let _ = view.layer(layer);
        }
        let cached = if flags & THROUGH_CACHE != 0 {
            view.import_into_cache(&mut kv, &mut st, IMPORTED, &AdmitOptions::default())?
                .1
        } else {
            view.import_into(&mut kv, &mut st, IMPORTED)?;
            0
        };
        Ok((view, cached))
    });
    kv.check_invariants().unwrap();
    let imported = result.is_ok();
    if let Ok((view, cached)) = result {
        let h = view.header();
        let n = h.num_tokens();
        assert_eq!(kv.num_tokens(IMPORTED).unwrap(), n);
        let table = kv.block_table(IMPORTED).unwrap().to_vec();
        let row = row_bytes(h.layout());
        for layer in 0..h.layout().num_layers() {
            let (k, v) = read(&st, layer, &table, n);
            let (ek, ev) = view.layer(layer).unwrap();
            assert!(
                k[cached * row..] == ek[cached * row..],
                "layer {layer}: imported K differs"
            );
            assert!(
                v.get(cached * row..) == ev.get(cached * row..),
                "layer {layer}: V"
            );
        }
        let l = receiver_layout();
        for layer in 0..l.num_layers() {
            let (k, v) = read(&st, layer, &resident, 7);
            assert_eq!(k, pattern(&l, layer, 0, 0, 7, 0x55), "resident K changed");
            assert_eq!(v, pattern(&l, layer, 1, 0, 7, 0x55), "resident V changed");
        }
    }
    settle(
        &mut kv,
        &st,
        imported,
        &before,
        snapshot,
        |kv| kv.stats().used_blocks,
        RECEIVER_BLOCKS,
    )
}

/// The end of every input: an import is freed with the resident sequence and must
/// leave nothing used; a refusal must have left the bookkeeping (`view` of it) and every
/// arena byte as `before`. Returns `imported`.
fn settle(
    kv: &mut KvCache,
    st: &HostStorage,
    imported: bool,
    before: &(String, Vec<u8>),
    view: fn(&KvCache) -> String,
    used: fn(&KvCache) -> usize,
    blocks: usize,
) -> bool {
    if imported {
        kv.free(IMPORTED).unwrap();
        kv.free(RESIDENT).unwrap();
        kv.evict_cached(usize::MAX);
        kv.check_invariants().unwrap();
        assert_eq!(used(kv), 0, "the import leaked blocks");
    } else {
        assert_eq!(view(kv), before.0, "a refused import changed the manager");
        assert!(
            device_bytes(st, blocks) == before.1,
            "a refused import wrote the arena"
        );
    }
    imported
}

/// The group receiver's page layout: 2 layers, 1 KV head of 4 f32, pages of 4 tokens.
pub fn group_layout() -> KvLayout {
    KvLayout::new(shape(2, 1, DType::F32), 4).unwrap()
}

fn group_specs() -> [GroupSpec; 2] {
    let l = group_layout();
    [GroupSpec::full(l), GroupSpec::window(l, GROUP_WINDOW)]
}

fn group_receiver() -> (KvCache, HostStorage) {
    let l = group_layout();
    let mut kv = KvCache::hybrid(&group_specs(), GROUP_PAGES).unwrap();
    let mut st = HostStorage::new(l, GROUP_PAGES).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(RESIDENT, 6, &mut step).unwrap();
    for slots in &step.slots {
        write_pattern(&mut st, &l, slots, 0, 0x33);
    }
    (kv, st)
}

/// One group-export input (see the module docs); returns whether it was imported.
pub fn run_group(data: &[u8]) -> bool {
    let Some((flags, mut buf)) = split(data) else {
        return false;
    };
    if flags & REPAIR != 0 {
        repair_group(&mut buf);
    }
    let (mut kv, mut st) = group_receiver();
    let before = (snapshot_groups(&kv), device_bytes(&st, GROUP_PAGES));
    let result = GroupExportView::parse(&buf).and_then(|view| {
        let cached = if flags & THROUGH_CACHE != 0 {
            view.import_into_cache(&mut kv, &mut st, IMPORTED, &AdmitOptions::default())?
                .cached_tokens
        } else {
            view.import_into(&mut kv, &mut st, IMPORTED)?;
            0
        };
        Ok((view, cached))
    });
    kv.check_invariants().unwrap();
    let imported = result.is_ok();
    if let Ok((view, cached)) = result {
        let n = view.num_tokens();
        assert_eq!(kv.num_computed_tokens(IMPORTED).unwrap(), n);
        for (g, record) in view.records().iter().enumerate() {
            let grp = kv.group(g);
            let (table, computed) = grp.readable_blocks(IMPORTED).unwrap();
            assert_eq!(computed, n);
            let held = table
                .iter()
                .take_while(|&&b| b == BlockId::RELEASED)
                .count();
            let first = held * grp.block_size();
            let h = record.view.header();
            let sent_first = n - h.num_tokens();
            assert!(
                first >= sent_first,
                "group {g} holds tokens it was not sent"
            );
            let row = row_bytes(h.layout());
            let from = first.max(cached);
            for layer in 0..h.layout().num_layers() {
                let (k, v) = read(&st, layer, &table[held..], n - first);
                let (ek, ev) = record.view.layer(layer).unwrap();
                let (a, b) = ((from - first) * row, (from - sent_first) * row);
                assert!(k[a..] == ek[b..], "group {g} layer {layer}: K differs");
                assert!(v[a..] == ev[b..], "group {g} layer {layer}: V differs");
            }
        }
    }
    settle(
        &mut kv,
        &st,
        imported,
        &before,
        snapshot_groups,
        |kv| kv.group_stats().used_pages,
        GROUP_PAGES,
    )
}

/// A hybrid manager's bookkeeping: each group's manager and the page stats.
fn snapshot_groups(kv: &KvCache) -> String {
    let mut s = format!("{:?}\n", kv.group_stats());
    for g in 0..kv.num_groups() {
        s += &snapshot(kv.group(g));
    }
    s
}

// ---- seeds ---------------------------------------------------------------------------

/// A sender of `layout` holding one sequence of `n` written tokens with ids.
fn single_sender(layout: KvLayout, n: usize, salt: u8) -> (KvCache, HostStorage, Vec<u32>) {
    let blocks = layout.blocks_for_tokens(n).max(1) + 2;
    let mut kv = KvCache::builder(layout)
        .num_blocks(blocks)
        .watermark_blocks(0)
        .build()
        .unwrap();
    let mut st = HostStorage::new(layout, blocks).unwrap();
    let mut slots = Vec::new();
    kv.admit(SeqId(1), n, &mut slots).unwrap();
    write_pattern(&mut st, &layout, &slots, 0, salt);
    let ids = (0..n as u32).map(|t| t * 7 + u32::from(salt)).collect();
    (kv, st, ids)
}

/// Valid single exports (with the flag byte in front): the receiver's shape at several
/// sender block sizes and lengths, with and without token ids, plus shapes the receiver
/// refuses (another dtype, another head count, a latent layout).
pub fn single_seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let r = receiver_layout();
    let mut cases: Vec<(KvLayout, usize, bool)> = Vec::new();
    for (bs, n, ids) in [
        (4, 7, true),
        (4, 9, false),
        (2, 5, true),
        (8, 12, true),
        (3, 4, false),
        (4, 0, true),
        (16, 1, true),
    ] {
        cases.push((KvLayout::new(*r.shape(), bs).unwrap(), n, ids));
    }
    cases.push((KvLayout::new(shape(2, 1, DType::BF16), 4).unwrap(), 5, true));
    cases.push((KvLayout::new(shape(2, 2, DType::F16), 4).unwrap(), 5, true));
    cases.push((KvLayout::new(shape(1, 1, DType::F16), 4).unwrap(), 5, false));
    let latent = KvKind::Latent {
        kv_lora_rank: 2,
        rope_dim: 2,
    };
    if let Ok(l) = KvLayout::with_kind(shape(2, 1, DType::F16), 4, latent) {
        cases.push((l, 6, true));
    }
    for (i, (layout, n, with_ids)) in cases.into_iter().enumerate() {
        let (kv, st, ids) = single_sender(layout, n, i as u8);
        let len = exported_len(&layout, n, with_ids).unwrap();
        let mut buf = vec![0u8; len];
        export_sequence(&kv, &st, SeqId(1), with_ids.then_some(&ids[..]), &mut buf).unwrap();
        // Imported directly, and with repaired checksums through the prefix cache.
        let flags = if with_ids { THROUGH_CACHE } else { 0 };
        out.push([&[0][..], &buf].concat());
        out.push([&[flags | REPAIR][..], &buf].concat());
    }
    out
}

/// Valid group exports (with the flag byte in front) from a sender of the receiver's
/// groups: short sequences, ones whose window group gave pages back, with and without
/// token ids; and one of a single group, which the receiver refuses. Each is imported
/// directly and (repaired) through the prefix caches, which refuse a sequence with
/// window holes.
pub fn group_seeds() -> Vec<Vec<u8>> {
    let l = group_layout();
    let mut out = Vec::new();
    for (n, with_ids) in [(3, true), (10, false), (21, true), (30, false)] {
        let mut kv = KvCache::hybrid(&group_specs(), GROUP_PAGES).unwrap();
        let mut st = HostStorage::new(l, GROUP_PAGES).unwrap();
        let mut step = GroupStep::default();
        kv.admit_grouped(SeqId(1), 2, &mut step).unwrap();
        for slots in &step.slots {
            write_pattern(&mut st, &l, slots, 0, 0x11);
        }
        // Decode one token at a time, so the window group releases its old pages.
        for pos in 2..n {
            kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
            for slots in &step.slots {
                write_pattern(&mut st, &l, slots, pos, 0x11);
            }
        }
        let ids: Vec<u32> = (0..n as u32).map(|t| t + 100).collect();
        let len = exported_group_len(&kv, &st, SeqId(1), with_ids).unwrap();
        let mut buf = vec![0u8; len];
        export_group_sequence(&kv, &st, SeqId(1), with_ids.then_some(&ids[..]), &mut buf).unwrap();
        // Imported directly, and with repaired checksums through the prefix cache.
        let flags = if with_ids { THROUGH_CACHE } else { 0 };
        out.push([&[0][..], &buf].concat());
        out.push([&[flags | REPAIR][..], &buf].concat());
    }
    let mut kv = KvCache::hybrid(&[GroupSpec::full(l)], 8).unwrap();
    let mut st = HostStorage::new(l, 8).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 5, &mut step).unwrap();
    write_pattern(&mut st, &l, &step.slots[0], 0, 0x22);
    let len = exported_group_len(&kv, &st, SeqId(1), false).unwrap();
    let mut buf = vec![0u8; len];
    export_group_sequence(&kv, &st, SeqId(1), None, &mut buf).unwrap();
    out.push([&[REPAIR][..], &buf].concat());
    out
}
