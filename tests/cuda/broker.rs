//! The broker's chunk moves on `CudaStorage` (VMM: shrink and grow without copying the
//! arena): two models of different shapes on one GPU budget, in chunks that each model
//! fills exactly with layer shares of whole 2 MiB granules (`chunk_bytes_for`: 24 MiB
//! here), so the physical memory mapped behind each layer is checked against the
//! broker's accounting; one model fills blocks with random bytes, the other takes its
//! idle chunks and then gives them back through a reservation; the first model's bytes
//! are read back unchanged from VRAM. The storages are built with
//! `CudaStorageConfig::granule_chunks` (physical chunks of one granule), so a shrink
//! releases exactly the bytes past the new end; the broker reads the granule from the
//! storage and refuses a storage backed by larger chunks. Prints a skip line and
//! returns on a machine without a GPU.

use crate::support::cuda;

use std::time::Duration;

use cuda::{storage_or_skip, Rng};
use pagedkv::broker::{chunk_bytes_for, Broker, BrokerConfig, ModelId, ModelLimits, MoveReason};
use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
use pagedkv::{DType, KvCache, KvLayout, ModelShape, SeqId, Storage};

/// The VMM allocation granule of the H200 (and of every CUDA GPU so far).
const GRANULE: usize = 2 << 20;

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
    // 64 KiB blocks over 4 layers and 192 KiB blocks over 3 layers: a 24 MiB chunk is
    // 384 and 128 blocks, 6 MiB and 8 MiB per layer, whole granules.
    let layouts = [
        layout(4, 2, 128, DType::BF16, 16),
        layout(3, 4, 64, DType::F32, 16),
    ];
    let chunk = chunk_bytes_for(&layouts, GRANULE).unwrap();
    assert_eq!(chunk, 24 << 20);
    // No granule declared: the broker reads it from the storage.
    let config = BrokerConfig::new(16 * chunk, chunk);
    let mut broker: Broker<CudaStorage> = Broker::new(config).unwrap();
    let mut ids = Vec::new();
    for (i, l) in layouts.iter().enumerate() {
        let bpc = broker.blocks_per_chunk(l).unwrap();
        let blocks = 4 * bpc;
        let kv = || KvCache::builder(*l).num_blocks(blocks).build().unwrap();
        let limits = ModelLimits::new(chunk, 12 * chunk);
        // Backed by chunks larger than the granule (the default): refused, nothing
        // granted.
        let coarse = CudaStorageConfig {
            max_blocks: Some(16 * bpc),
            ..CudaStorageConfig::blocks(blocks)
        };
        let Some(storage) = storage_or_skip(test, *l, coarse.clone()) else {
            return;
        };
        assert_eq!(storage.mapping_granule_bytes(), None);
        let free = broker.stats().free_bytes;
        assert!(matches!(
            broker.register("coarse", kv(), storage, limits),
            Err(pagedkv::Error::InvalidConfig { .. })
        ));
        assert_eq!(broker.stats().free_bytes, free);
        let config = CudaStorageConfig {
            granule_chunks: true,
            ..coarse
        };
        let Some(storage) = storage_or_skip(test, *l, config) else {
            return;
        };
        assert_eq!(storage.mapping_granule_bytes(), Some(GRANULE));
        let kv = kv();
        ids.push(
            broker
                .register(format!("m{i}"), kv, storage, limits)
                .unwrap(),
        );
    }
    for m in broker.stats().models {
        assert_eq!(m.mapped_bytes_per_chunk, chunk, "{}", m.name);
    }
    // Registered arenas map exactly their granted bytes.
    for &id in &ids {
        assert_eq!(physical(&broker, id), granted(&broker, id));
    }
    // Model 0 grows to 10 chunks (growth maps exactly the new chunks' bytes) and fills
    // the first 3 chunks' worth with a sequence.
    let bpc0 = broker.blocks_per_chunk(&layouts[0]).unwrap();
    let mut g = broker.lock(ids[0]).unwrap();
    assert_eq!(g.ensure_available(10 * bpc0).unwrap(), 10 * bpc0);
    drop(g);
    assert_eq!(granted(&broker, ids[0]), 10 * chunk);
    assert_eq!(physical(&broker, ids[0]), 10 * chunk);
    let mut g = broker.lock(ids[0]).unwrap();
    let l = layouts[0];
    let tokens = 3 * bpc0 * l.block_size();
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
    let bpc1 = broker.blocks_per_chunk(&layouts[1]).unwrap();
    let mut g1 = broker.lock(ids[1]).unwrap();
    g1.ensure_available(12 * bpc1).unwrap();
    drop(g1);
    // Model 1 grew, model 0 shrank: both map exactly their grants (granule chunks:
    // no physical chunk straddles the new end).
    assert!(granted(&broker, ids[0]) < 10 * chunk);
    assert_eq!(physical(&broker, ids[1]), granted(&broker, ids[1]));
    assert_eq!(physical(&broker, ids[0]), granted(&broker, ids[0]));
    let events = broker.events();
    assert!(events.iter().any(|e| e.reason == MoveReason::TakeIdle));
    broker.check_invariants().unwrap();
    // A reservation takes more from model 1's idle memory, then gives it back.
    let r = broker.reserve(2 * chunk, Duration::from_millis(50));
    if let Ok(r) = r {
        broker.release(r).unwrap();
    }
    broker.check_invariants().unwrap();
    for &id in &ids {
        assert_eq!(physical(&broker, id), granted(&broker, id));
    }
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

/// Bytes the broker granted `id`.
fn granted(broker: &Broker<CudaStorage>, id: ModelId) -> usize {
    broker.stats().models[id.0 as usize].granted_bytes
}

/// Bytes of physical memory mapped behind all of `id`'s layer regions.
fn physical(broker: &Broker<CudaStorage>, id: ModelId) -> usize {
    let g = broker.lock(id).unwrap();
    let layers = g.kv().layout().num_layers();
    (0..layers)
        .map(|l| g.storage().mapped_bytes(l).unwrap().0)
        .sum()
}
