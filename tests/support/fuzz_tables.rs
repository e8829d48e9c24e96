//! The block-table validation that guards kernel launches, fuzzed: tables built from
//! arbitrary bytes go through `tables::validate_tables` / `validate_csr`, the
//! manager's `check_padded` / `check_csr`, and the CPU paged decode. Nothing may panic;
//! whatever the validation accepts names only blocks inside the arena and covers its
//! contexts, and the decode over it must succeed.

use pagedkv::attention::cpu::paged_decode;
use pagedkv::attention::AttentionParams;
use pagedkv::tables::{validate_csr, validate_tables};
use pagedkv::tables::{CsrTables, PaddedTables};
use pagedkv::{CacheConfig, DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId};

const BS: usize = 4;
const BLOCKS: usize = 8;

fn word(data: &mut &[u8]) -> u32 {
    let mut b = [0u8; 4];
    for (i, x) in b.iter_mut().enumerate() {
        if let Some((&first, rest)) = data.split_first() {
            *x = first;
            *data = rest;
        } else {
            // Short input: what was read, as a small number.
            return if i == 0 {
                0
            } else {
                u32::from_le_bytes(b) % (1 << (8 * i))
            };
        }
    }
    // Mostly small numbers, sometimes huge ones.
    let v = u32::from_le_bytes(b);
    if v & 0x8000_0000 != 0 {
        v
    } else {
        v % 40
    }
}

/// Runs one fuzz input. Panics on any finding.
pub fn run(mut data: &[u8]) {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        kv_dtype: DType::F16,
    };
    let layout = KvLayout::new(shape, BS).expect("layout");
    let store = HostStorage::new(layout, BLOCKS).expect("storage");
    let mut kv = KvCache::new(
        layout,
        CacheConfig {
            watermark_blocks: 0,
            ..CacheConfig::new(BLOCKS)
        },
    )
    .expect("manager");
    let mut slots = Vec::new();
    kv.admit(SeqId(0), 9, &mut slots).expect("admit");
    let d = &mut data;

    let batch = (word(d) % 4) as usize;
    let max_blocks = (word(d) % 6) as usize;
    let mut padded = PaddedTables {
        tables: (0..batch * max_blocks + (word(d) % 2) as usize)
            .map(|_| word(d) % (BLOCKS as u32 + 3))
            .collect(),
        context_lens: (0..batch).map(|_| word(d)).collect(),
        batch,
        max_blocks,
    };
    if word(d).is_multiple_of(3) {
        padded.tables.truncate(batch * max_blocks);
    }
    if let Ok(longest) = validate_tables(&layout, BLOCKS, &padded) {
        for (row, &ctx) in padded.context_lens.iter().enumerate() {
            let used = layout.blocks_for_tokens(ctx as usize);
            assert!(
                used <= max_blocks,
                "accepted a context its row does not cover"
            );
            for &b in &padded.tables[row * max_blocks..row * max_blocks + used] {
                assert!(
                    (b as usize) < BLOCKS,
                    "accepted block {b} outside the arena"
                );
            }
            assert!(ctx as usize <= longest);
        }
        let q = vec![0.5f32; batch * 4 * 8];
        let mut out = vec![0f32; batch * 4 * 8];
        let params = AttentionParams::new(8);
        paged_decode(&store, 0, &q, &padded, &params, &mut out, None)
            .expect("decode over validated tables");
    }
    let _ = kv.check_padded(&padded);

    let rows = (word(d) % 4) as usize;
    let mut indptr = vec![0u32];
    for _ in 0..rows {
        let last = *indptr.last().unwrap_or(&0);
        indptr.push(last.saturating_add(word(d) % 4));
    }
    if word(d).is_multiple_of(5) {
        indptr.push(word(d));
    }
    // Sometimes an arbitrary (even decreasing or huge) interior offset.
    if indptr.len() > 2 && word(d).is_multiple_of(3) {
        let i = 1 + (word(d) as usize % (indptr.len() - 2));
        indptr[i] = word(d);
    }
    let indices_len = indptr.last().copied().unwrap_or(0).min(64) as usize + (word(d) % 2) as usize;
    let csr = CsrTables {
        indices: (0..indices_len)
            .map(|_| word(d) % (BLOCKS as u32 + 3))
            .collect(),
        last_page_len: (0..rows).map(|_| word(d) % (BS as u32 + 2)).collect(),
        indptr,
    };
    if validate_csr(&layout, BLOCKS, &csr).is_ok() {
        assert!(
            csr.indices.iter().all(|&b| (b as usize) < BLOCKS),
            "accepted a CSR index outside the arena"
        );
        assert_eq!(csr.indptr.len(), csr.last_page_len.len() + 1);
    }
    let _ = kv.check_csr(&csr);
}
