//! The broker's chunk moves on `CudaStorage` (VMM: shrink and grow without copying the
//! arena): two models of different shapes on one GPU budget of 2 MiB chunks; one fills
//! blocks with random bytes, the other takes its idle chunks and then gives them back
//! through a reservation; the first model's bytes are read back unchanged, block by
//! block, against a `HostStorage` mirror. Prints a skip line and returns on a machine
//! without a GPU.
#![cfg(feature = "cuda")]

mod cuda_common;

use std::time::Duration;

use cuda_common::{storage_or_skip, Rng};
use pagedkv::broker::{Broker, BrokerConfig, ModelLimits, MoveReason};
use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
use pagedkv::{DType, KvCacheManager, KvLayout, ModelShape, SeqId, Storage};

const CHUNK: usize = 2 << 20;

fn layout(layers: usize, heads: usize, dim: usize, dtype: DType, block: usize) -> KvLayout {
    KvLayout::new(
        ModelShape {
            num_layers: layers,
            num_q_heads: heads * 4,
            num_kv_heads: heads,
            head_dim: dim,
            kv_dtype: dtype,
        },
        block,
    )
    .unwrap()
}

#[test]
fn chunk_moves_keep_bytes_on_the_gpu() {
    let test = "chunk_moves_keep_bytes_on_the_gpu";
    // 64 KiB blocks (32 per chunk) and 192 KiB blocks (10 per chunk, 128 KiB unused).
    let layouts = [
        layout(4, 2, 128, DType::BF16, 16),
        layout(3, 4, 64, DType::F32, 16),
    ];
    let mut broker: Broker<CudaStorage> =
        Broker::new(BrokerConfig::new(16 * CHUNK, CHUNK)).unwrap();
    let mut ids = Vec::new();
    for (i, l) in layouts.iter().enumerate() {
        let bpc = broker.blocks_per_chunk(l).unwrap();
        let blocks = 4 * bpc;
        let config = CudaStorageConfig {
            max_blocks: Some(16 * bpc),
            ..CudaStorageConfig::blocks(blocks)
        };
        let Some(storage) = storage_or_skip(test, *l, config) else {
            return;
        };
        let kv = KvCacheManager::builder(*l)
            .num_blocks(blocks)
            .build()
            .unwrap();
        let limits = ModelLimits::new(CHUNK, 12 * CHUNK);
        ids.push(
            broker
                .register(format!("m{i}"), kv, storage, limits)
                .unwrap(),
        );
    }
    // Model 0 grows to 10 chunks and fills the first 3 chunks' worth with a sequence.
    let mut g = broker.lock(ids[0]).unwrap();
    assert_eq!(g.ensure_available(10 * 32).unwrap(), 10 * 32);
    let l = layouts[0];
    let tokens = 3 * 32 * l.block_size();
    let mut slots = Vec::new();
    g.kv_mut().admit(SeqId(1), tokens, &mut slots).unwrap();
    let mut rng = Rng(7);
    let n = tokens * l.shape().num_kv_heads * l.shape().head_dim * l.dtype().size_bytes();
    let mut written = Vec::new();
    for layer in 0..l.num_layers() {
        let (k, v) = (rng.bytes(n), rng.bytes(n));
        let (_, storage) = g.parts_mut();
        storage.write_slots(layer, &slots, &k, &v).unwrap();
        written.push((k, v));
    }
    drop(g);
    // Model 1 takes everything it can: the free budget, then model 0's idle chunks.
    let mut g1 = broker.lock(ids[1]).unwrap();
    g1.ensure_available(12 * 10).unwrap();
    drop(g1);
    let events = broker.events();
    assert!(events.iter().any(|e| e.reason == MoveReason::TakeIdle));
    broker.check_invariants().unwrap();
    // A reservation takes more from model 1's idle memory, then gives it back.
    let r = broker.reserve(2 * CHUNK, Duration::from_millis(50));
    if let Ok(r) = r {
        broker.release(r).unwrap();
    }
    broker.check_invariants().unwrap();
    // Model 0's bytes, read back from VRAM, are the ones written.
    let g = broker.lock(ids[0]).unwrap();
    let table = g.kv().block_table(SeqId(1)).unwrap().to_vec();
    for (layer, (k, v)) in written.iter().enumerate() {
        let (mut rk, mut rv) = (vec![0; n], vec![0; n]);
        g.storage()
            .read_tokens(layer, &table, tokens, &mut rk, &mut rv)
            .unwrap();
        assert!(
            &rk == k && &rv == v,
            "layer {layer}: bytes changed by the moves"
        );
    }
    let stats = broker.stats();
    eprintln!(
        "GPU broker: {} events; granted MiB {:?}",
        events.len(),
        stats
            .models
            .iter()
            .map(|m| m.granted_bytes >> 20)
            .collect::<Vec<_>>()
    );
}
