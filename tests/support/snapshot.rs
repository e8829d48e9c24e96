//! Everything observable about a manager's bookkeeping, as one string, to prove that a
//! refused or failed call changed nothing (`tests/memory/transfer_faults.rs`,
//! `tests/memory/broker_model.rs`, the export fuzz harness).

#![allow(dead_code)] // each test binary uses its own part

use pagedkv::{BlockId, HostStorage, KvCache, SeqId, Storage};

/// Stats, tier stats, spilled prefix blocks, the pool's block states, and for every
/// sequence (resident or swapped) its tokens and table (device table and any swap in
/// flight, or its tier blocks). Not the peak-usage counter: a call that allocated and
/// gave everything back on failure may have raised it.
pub fn snapshot(kv: &KvCache) -> String {
    let mut stats = kv.stats();
    stats.peak_used_blocks = 0;
    let mut ids: Vec<SeqId> = kv.sequence_ids().chain(kv.swapped_sequence_ids()).collect();
    ids.sort();
    ids.dedup();
    let mut s = format!(
        "{:?}\n{:?}\nspilled prefix blocks {}\n{:?}\n",
        stats,
        kv.tier_stats(),
        kv.spilled_prefix_blocks(),
        kv.pool().states(),
    );
    for id in ids {
        let table = match kv.block_table(id) {
            Ok(t) => format!("device {t:?} in flight {:?}", kv.swap_in_flight(id)),
            Err(_) => format!("tiers {:?}", kv.swapped_table(id)),
        };
        s += &format!(
            "{id}: {:?} tokens ({:?} computed), {table}\n",
            kv.num_tokens(id).ok(),
            kv.num_computed_tokens(id).ok()
        );
    }
    s
}

/// The K and V of the first `n` tokens of `layer` through `table` (V empty for a
/// latent layout).
pub fn read_kv(st: &HostStorage, layer: usize, table: &[BlockId], n: usize) -> (Vec<u8>, Vec<u8>) {
    let l = *st.layout();
    let vectors = l.kind().vectors_per_head();
    let row = l.token_bytes() / l.num_layers() / vectors;
    let mut k = vec![0u8; n * row];
    let mut v = vec![0u8; if vectors == 2 { n * row } else { 0 }];
    st.read_tokens(layer, table, n, &mut k, &mut v)
        .expect("reading K/V");
    (k, v)
}

/// Every K/V byte of the first `blocks` device blocks of every layer.
pub fn device_bytes(storage: &HostStorage, blocks: usize) -> Vec<u8> {
    let l = *storage.layout();
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    let mut out = Vec::new();
    for layer in 0..l.num_layers() {
        let (k, v) = read_kv(storage, layer, &table, blocks * l.block_size());
        out.extend(k);
        out.extend(v);
    }
    out
}

/// A hybrid cache's state, every group's in full (its `Debug`), and the group stats;
/// the hybrid layer's scratch buffers are left out (a refused call may have used them).
/// A one-group cache gives its one group.
pub fn groups_snapshot(kv: &KvCache) -> Vec<String> {
    let mut out: Vec<String> = (0..kv.num_groups())
        .map(|g| format!("{:?}", kv.group(g)))
        .collect();
    out.push(format!("{:?}", kv.group_stats()));
    out
}
