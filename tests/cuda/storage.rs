//! `CudaStorage` against `HostStorage`, byte for byte: K/V writes, reads, copy plans
//! (copy-on-write and defragmentation moves), swap plans both ways, resize, fp8/f16/
//! bf16 quantisation in `reshape_and_cache`, and hostile plans rejected with nothing
//! changed. Each test prints a skip line and returns on a machine without a GPU.

use crate::support::cuda;

use cuda::{encode, skip, storage_or_skip, Rng};
use pagedkv::executor::storage::{auto, Backend, CudaStorage, CudaStorageConfig};
use pagedkv::layout::plans::SwapDirection;
use pagedkv::layout::Slot;
use pagedkv::{
    BlockId, CopyPlan, DType, Error, HostStorage, KvLayout, ModelShape, Storage, SwapPlan,
};

const BLOCKS: usize = 48;
const HOST_BLOCKS: usize = 24;

fn layout(dtype: DType) -> KvLayout {
    KvLayout::new(
        ModelShape {
            num_layers: 3,
            num_q_heads: 8,
            num_kv_heads: 2,
            head_dim: 64,
            kv_dtype: dtype,
        },
        16,
    )
    .unwrap()
}

/// A GPU arena and a host arena holding the same random bytes in every slot.
fn pair(test: &str, dtype: DType, seed: u64) -> Option<(CudaStorage, HostStorage)> {
    let l = layout(dtype);
    let config = CudaStorageConfig {
        host_blocks: HOST_BLOCKS,
        max_blocks: Some(4 * BLOCKS),
        ..CudaStorageConfig::blocks(BLOCKS)
    };
    let mut gpu = storage_or_skip(test, l, config)?;
    let mut host = HostStorage::with_host_tier(l, BLOCKS, HOST_BLOCKS).unwrap();
    let mut rng = Rng(seed);
    let slots: Vec<Slot> = (0..(BLOCKS * l.block_size()) as u64).map(Slot).collect();
    let n = slots.len() * l.shape().num_kv_heads * l.shape().head_dim * dtype.size_bytes();
    for layer in 0..l.num_layers() {
        let (k, v) = (rng.bytes(n), rng.bytes(n));
        gpu.write_slots(layer, &slots, &k, &v).unwrap();
        host.write_slots(layer, &slots, &k, &v).unwrap();
    }
    Some((gpu, host))
}

fn assert_same(gpu: &CudaStorage, host: &HostStorage, what: &str) {
    assert_eq!(gpu.num_blocks(), host.num_blocks(), "{what}: block counts");
    for layer in 0..host.layout().num_layers() {
        for b in 0..host.num_blocks() as u32 {
            let g = gpu.block_bytes(layer, BlockId(b)).unwrap();
            let h = host.block_bytes(layer, BlockId(b)).unwrap();
            assert!(g == h, "{what}: layer {layer} block {b} differs");
        }
        for b in 0..host.num_host_blocks() as u32 {
            let g = gpu.host_block_bytes(layer, BlockId(b)).unwrap();
            let n = host.layout().block_bytes_per_layer();
            let h = &host.host_region(layer)[b as usize * n..(b as usize + 1) * n];
            assert!(g == h, "{what}: layer {layer} host block {b} differs");
        }
    }
}

#[test]
fn writes_and_reads_match_host_storage() {
    let Some((gpu, host)) = pair("writes_and_reads_match_host_storage", DType::BF16, 1) else {
        return;
    };
    assert_same(&gpu, &host, "after writes");
    let l = *host.layout();
    let table = [BlockId(7), BlockId(3), BlockId(40)];
    let tokens = 37;
    let n = tokens * l.shape().num_kv_heads * l.shape().head_dim * 2;
    let (mut gk, mut gv, mut hk, mut hv) = (vec![0; n], vec![0; n], vec![0; n], vec![0; n]);
    for layer in 0..l.num_layers() {
        gpu.read_tokens(layer, &table, tokens, &mut gk, &mut gv)
            .unwrap();
        host.read_tokens(layer, &table, tokens, &mut hk, &mut hv)
            .unwrap();
        assert!(gk == hk && gv == hv, "layer {layer}");
    }
}

#[test]
fn copy_and_move_plans_match_host_storage() {
    let Some((mut gpu, mut host)) = pair("copy_and_move_plans_match_host_storage", DType::F16, 2)
    else {
        return;
    };
    // Copy-on-write copies, a run of consecutive blocks, and a defragmentation-style
    // move of tail blocks to the front, as src -> dst pairs.
    let mut plan = CopyPlan::new();
    for (s, d) in [(1, 30), (2, 31), (3, 32), (47, 0), (46, 5), (10, 20)] {
        plan.push(BlockId(s), BlockId(d));
    }
    gpu.copy_blocks(&plan).unwrap();
    host.copy_blocks(&plan).unwrap();
    assert_same(&gpu, &host, "after copy plan");
    // A big plan: every even block onto the odd block after it.
    let mut plan = CopyPlan::new();
    for b in (0..BLOCKS as u32).step_by(2) {
        plan.push(BlockId(b), BlockId(b + 1));
    }
    gpu.copy_blocks(&plan).unwrap();
    host.copy_blocks(&plan).unwrap();
    assert_same(&gpu, &host, "after big copy plan");
}

#[test]
fn swap_plans_match_host_storage() {
    let Some((mut gpu, mut host)) = pair("swap_plans_match_host_storage", DType::Fp8E4M3, 3) else {
        return;
    };
    let mut out = SwapPlan::new(SwapDirection::Out);
    for (d, h) in [(4, 0), (5, 1), (6, 2), (20, 10), (47, 23), (9, 7)] {
        out.push(BlockId(d), BlockId(h));
    }
    gpu.swap(&out).unwrap();
    host.swap(&out).unwrap();
    assert_same(&gpu, &host, "after swap out");
    // Overwrite the swapped-out device blocks, then swap back in elsewhere.
    let mut clobber = CopyPlan::new();
    for (s, d) in [(30, 4), (31, 5), (32, 6)] {
        clobber.push(BlockId(s), BlockId(d));
    }
    gpu.copy_blocks(&clobber).unwrap();
    host.copy_blocks(&clobber).unwrap();
    let mut back = SwapPlan::new(SwapDirection::In);
    for (d, h) in [(40, 0), (41, 1), (42, 2), (4, 10), (0, 23), (13, 7)] {
        back.push(BlockId(d), BlockId(h));
    }
    gpu.swap(&back).unwrap();
    host.swap(&back).unwrap();
    gpu.sync_transfers().unwrap();
    for layer in 0..3 {
        assert!(
            gpu.is_layer_ready(layer).unwrap(),
            "layer {layer} not ready after sync"
        );
    }
    assert_same(&gpu, &host, "after swap in");
}

#[test]
fn resize_keeps_blocks_and_zeroes_new_ones() {
    let Some((mut gpu, mut host)) = pair("resize_keeps_blocks_and_zeroes_new_ones", DType::BF16, 4)
    else {
        return;
    };
    let bases: Vec<u64> = (0..3).map(|l| gpu.region_ptr(l).unwrap()).collect();
    for n in [3 * BLOCKS, 10, 4 * BLOCKS, BLOCKS] {
        gpu.resize(n).unwrap();
        host.resize(n).unwrap();
        assert_same(&gpu, &host, &format!("after resize to {n}"));
        // Grown and shrunk in place: no region moved, so nothing was copied.
        let now: Vec<u64> = (0..3).map(|l| gpu.region_ptr(l).unwrap()).collect();
        assert_eq!(now, bases, "a region moved on resize to {n}");
    }
    let err = gpu.resize(gpu.max_blocks() + 1).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    assert_same(&gpu, &host, "after a refused resize");
}

#[test]
fn hostile_plans_are_rejected_and_change_nothing() {
    let Some((mut gpu, host)) = pair(
        "hostile_plans_are_rejected_and_change_nothing",
        DType::BF16,
        5,
    ) else {
        return;
    };
    let mut plan = CopyPlan::new();
    plan.push(BlockId(1), BlockId(2));
    plan.push(BlockId(3), BlockId(BLOCKS as u32));
    assert!(matches!(
        gpu.copy_blocks(&plan),
        Err(Error::BlockOutOfRange { .. })
    ));
    let mut plan = CopyPlan::new();
    plan.push(BlockId(1), BlockId(2));
    plan.push(BlockId(2), BlockId(3));
    assert!(matches!(
        gpu.copy_blocks(&plan),
        Err(Error::CorruptBlockTable(_))
    ));
    let mut swap = SwapPlan::new(SwapDirection::Out);
    swap.push(BlockId(0), BlockId(HOST_BLOCKS as u32));
    assert!(matches!(
        gpu.swap(&swap),
        Err(Error::BlockOutOfRange { .. })
    ));
    let l = *host.layout();
    let n = l.shape().num_kv_heads * l.shape().head_dim * 2;
    let bad_slot = [Slot((BLOCKS * l.block_size()) as u64)];
    assert!(matches!(
        gpu.write_slots(0, &bad_slot, &vec![0; n], &vec![0; n]),
        Err(Error::BlockOutOfRange { .. })
    ));
    assert!(gpu
        .write_slots(9, &[Slot(0)], &vec![0; n], &vec![0; n])
        .is_err());
    let (mut k, mut v) = (vec![0; 40 * n], vec![0; 40 * n]);
    assert!(matches!(
        gpu.read_tokens(0, &[BlockId(1), BlockId(2)], 40, &mut k, &mut v),
        Err(Error::CorruptBlockTable(_))
    ));
    assert_same(&gpu, &host, "after rejected calls");
}

#[test]
fn reshape_and_cache_quantises_like_the_cpu() {
    for cache in [DType::F16, DType::BF16, DType::Fp8E4M3] {
        let test = format!("reshape_and_cache_quantises_like_the_cpu ({cache})");
        let l = layout(cache);
        let Some(mut gpu) = storage_or_skip(&test, l, CudaStorageConfig::blocks(BLOCKS)) else {
            return;
        };
        let mut host = HostStorage::new(l, BLOCKS).unwrap();
        let mut rng = Rng(6);
        let tokens = 50;
        let n = tokens * l.shape().num_kv_heads * l.shape().head_dim;
        // Wide range, with values past fp8's 448 (saturation) and exact ties.
        let mut k: Vec<f32> = (0..n).map(|_| rng.f32() * 600.0).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.f32() * 3.0).collect();
        k[0] = 1.0625 * 2.0;
        k[1] = f32::NAN;
        // Scales that are not powers of two: the kernel must divide exactly as the CPU.
        let (ks, vs) = (1.7, 0.37);
        let slots: Vec<Slot> = (0..tokens as u64)
            .map(|t| Slot(t * 7 % (BLOCKS as u64 * 16)))
            .collect();
        gpu.reshape_and_cache(
            0,
            &slots,
            &encode(DType::F32, &k, 1.0),
            &encode(DType::F32, &v, 1.0),
            DType::F32,
            ks,
            vs,
        )
        .unwrap();
        // The CPU's reshape_and_cache (fp8: x / scale through pagedkv::layout::convert).
        pagedkv::attention::cpu::reshape_and_cache(&mut host, 0, &slots, &k, &v, ks, vs).unwrap();
        for blk in 0..BLOCKS as u32 {
            let g = gpu.block_bytes(0, BlockId(blk)).unwrap();
            let h = host.block_bytes(0, BlockId(blk)).unwrap();
            // NaN payloads may differ between encoders in f16/bf16; compare values.
            let (gd, hd) = (cuda::decode(cache, &g, 1.0), cuda::decode(cache, h, 1.0));
            for (i, (a, b)) in gd.iter().zip(&hd).enumerate() {
                assert!(
                    a == b || (a.is_nan() && b.is_nan()),
                    "{cache} block {blk} elem {i}: gpu {a} cpu {b}"
                );
            }
        }
    }
}

#[test]
fn auto_falls_back_to_host_without_a_gpu() {
    let (storage, backend) = auto(layout(DType::BF16), 8, 2).unwrap();
    assert_eq!(storage.num_blocks(), 8);
    assert_eq!(storage.num_host_blocks(), 2);
    match backend {
        Backend::Cuda(_) => {}
        Backend::Host(why) => {
            assert!(!why.is_empty());
            skip("auto_falls_back_to_host_without_a_gpu (GPU half)", &why);
        }
    }
}

#[test]
fn per_layer_swaps_and_host_block_io_match_host_storage() {
    let Some((mut gpu, mut host)) = pair(
        "per_layer_swaps_and_host_block_io_match_host_storage",
        DType::BF16,
        8,
    ) else {
        return;
    };
    let mut out = SwapPlan::new(SwapDirection::Out);
    for (d, h) in [(2, 3), (3, 4), (30, 0), (11, 23)] {
        out.push(BlockId(d), BlockId(h));
    }
    // Layer by layer, in reverse order, equals one whole swap.
    for layer in (0..3).rev() {
        gpu.swap_layer(layer, &out).unwrap();
    }
    host.swap(&out).unwrap();
    gpu.sync_transfers().unwrap();
    assert!(gpu.is_swap_complete().unwrap());
    assert_same(&gpu, &host, "after per-layer swap out");
    assert!(gpu.swap_layer(3, &out).is_err());

    // A host block read and written back through the all-layers byte layout.
    let l = *host.layout();
    let n = l.block_bytes_per_layer();
    let mut bytes = vec![0u8; l.block_bytes()];
    gpu.read_host_block(BlockId(4), &mut bytes).unwrap();
    for layer in 0..3 {
        assert!(bytes[layer * n..][..n] == host.host_region(layer)[4 * n..][..n]);
    }
    gpu.write_host_block(BlockId(5), &bytes).unwrap();
    let mut back = vec![0u8; l.block_bytes()];
    gpu.read_host_block(BlockId(5), &mut back).unwrap();
    assert!(back == bytes);
    assert!(matches!(
        gpu.read_host_block(BlockId(HOST_BLOCKS as u32), &mut back),
        Err(Error::BlockOutOfRange { .. })
    ));
    assert!(matches!(
        gpu.write_host_block(BlockId(0), &bytes[1..]),
        Err(Error::ShapeMismatch { .. })
    ));
}

// ---- VMM at scale and stream ordering ---------------------------------------

/// 64 KiB per block and layer (8 KV heads x 128 x 16 tokens x bf16 x K and V), so a
/// few hundred blocks span several 2 MiB granules.
fn wide_layout(layers: usize, dtype: DType) -> KvLayout {
    KvLayout::new(
        ModelShape {
            num_layers: layers,
            num_q_heads: 8,
            num_kv_heads: 8,
            head_dim: 128,
            kv_dtype: dtype,
        },
        16,
    )
    .unwrap()
}

/// Fills every slot of both storages with the same random bytes.
fn fill_same(gpu: &mut CudaStorage, host: &mut HostStorage, seed: u64) {
    let l = *host.layout();
    let mut rng = Rng(seed);
    let slots: Vec<Slot> = (0..(host.num_blocks() * l.block_size()) as u64)
        .map(Slot)
        .collect();
    let n = slots.len() * l.shape().num_kv_heads * l.shape().head_dim * l.dtype().size_bytes();
    for layer in 0..l.num_layers() {
        let (k, v) = (rng.bytes(n), rng.bytes(n));
        gpu.write_slots(layer, &slots, &k, &v).unwrap();
        host.write_slots(layer, &slots, &k, &v).unwrap();
    }
}

#[test]
fn regions_span_several_granules_and_shrink_really_unmaps() {
    let test = "regions_span_several_granules_and_shrink_really_unmaps";
    let l = wide_layout(2, DType::BF16);
    let blocks = 200; // 12.5 MiB per layer: chunks of 8 + 4 + 2 MiB
    let config = CudaStorageConfig {
        max_blocks: Some(4096),
        host_blocks: 8,
        ..CudaStorageConfig::blocks(blocks)
    };
    let Some(mut gpu) = storage_or_skip(test, l, config) else {
        return;
    };
    let mut host = HostStorage::with_host_tier(l, blocks, 8).unwrap();
    fill_same(&mut gpu, &mut host, 21);
    let (mapped, chunks) = gpu.mapped_bytes(0).unwrap();
    assert!(
        mapped >= blocks * l.block_bytes_per_layer() && chunks >= 2,
        "{mapped} B in {chunks}"
    );
    // A copy plan and a swap whose blocks sit in different chunks.
    let mut plan = CopyPlan::new();
    for (s, d) in [(0, 199), (150, 3), (64, 130)] {
        plan.push(BlockId(s), BlockId(d));
    }
    gpu.copy_blocks(&plan).unwrap();
    host.copy_blocks(&plan).unwrap();
    assert_same(&gpu, &host, "copies across chunks");

    let free_before = gpu.context().mem_get_info().unwrap().0;
    gpu.resize(20).unwrap();
    host.resize(20).unwrap();
    let (after, chunks_after) = gpu.mapped_bytes(0).unwrap();
    assert!(
        after < mapped && chunks_after < chunks,
        "{after} B in {chunks_after} chunks"
    );
    let free_after = gpu.context().mem_get_info().unwrap().0;
    // Both layers gave their tail back to the device (allow for other tenants' noise
    // by asking for half of it).
    let released = 2 * (mapped - after);
    assert!(
        free_after >= free_before + released / 2,
        "free {free_before} -> {free_after}, released {released}"
    );
    assert_same(&gpu, &host, "after shrink");
    // Growing again maps fresh chunks and zeroes them; old bytes stay.
    gpu.resize(300).unwrap();
    host.resize(300).unwrap();
    assert_same(&gpu, &host, "after regrowth");
}

#[test]
fn a_region_past_4_gib_addresses_its_far_blocks() {
    let test = "a_region_past_4_gib_addresses_its_far_blocks";
    let l = wide_layout(1, DType::F16);
    let bpl = l.block_bytes_per_layer();
    // 4 GiB + 4 MiB mapped; 64 GiB of address space reserved (reserve is cheap).
    let blocks = (4usize << 30) / bpl + 64;
    let config = CudaStorageConfig {
        max_blocks: Some((64usize << 30) / bpl),
        host_blocks: 4,
        ..CudaStorageConfig::blocks(blocks)
    };
    let Some(mut gpu) = storage_or_skip(test, l, config) else {
        return;
    };
    assert!(gpu.reserved_bytes_per_layer() >= 64 << 30);
    let far = BlockId(blocks as u32 - 1);
    assert!(far.index() * bpl > 1 << 32);
    let mut rng = Rng(22);
    let per_block = l.block_size() * l.shape().num_kv_heads * l.shape().head_dim * 2;
    let (k, v) = (rng.bytes(per_block), rng.bytes(per_block));
    let slots: Vec<Slot> = (0..l.block_size() as u64)
        .map(|t| Slot(far.0 as u64 * l.block_size() as u64 + t))
        .collect();
    gpu.write_slots(0, &slots, &k, &v).unwrap();
    let want = gpu.block_bytes(0, far).unwrap();
    // Block 0 must be untouched: a 32-bit offset would have wrapped onto it.
    assert!(gpu
        .block_bytes(0, BlockId(0))
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    let (mut rk, mut rv) = (vec![0; per_block], vec![0; per_block]);
    gpu.read_tokens(0, &[far], l.block_size(), &mut rk, &mut rv)
        .unwrap();
    assert!(rk == k && rv == v, "far block read back");
    // Copy far -> near and near -> far, swap the far block out and back in elsewhere.
    let mut plan = CopyPlan::new();
    plan.push(far, BlockId(1));
    gpu.copy_blocks(&plan).unwrap();
    assert!(gpu.block_bytes(0, BlockId(1)).unwrap() == want);
    let mut out = SwapPlan::new(SwapDirection::Out);
    out.push(far, BlockId(3));
    gpu.swap(&out).unwrap();
    let mut back = SwapPlan::new(SwapDirection::In);
    back.push(BlockId(blocks as u32 - 2), BlockId(3));
    gpu.swap(&back).unwrap();
    assert!(gpu.block_bytes(0, BlockId(blocks as u32 - 2)).unwrap() == want);
    assert!(gpu.host_block_bytes(0, BlockId(3)).unwrap() == want);
}

/// A swap plan of every other block (many runs: the batched path on 13.0 drivers).
fn scattered(direction: SwapDirection, blocks: usize, host_base: u32) -> SwapPlan {
    let mut p = SwapPlan::new(direction);
    for (i, b) in (0..blocks as u32).step_by(2).enumerate() {
        p.push(BlockId(b), BlockId(host_base + i as u32));
    }
    p
}

#[test]
fn swap_out_then_overwrite_the_source_with_no_host_sync() {
    // If the compute stream did not wait for the swap-out's fence, the copy_blocks
    // below (queued at once) would overwrite the blocks while they are read.
    let test = "swap_out_then_overwrite_the_source_with_no_host_sync";
    let l = wide_layout(4, DType::BF16);
    let blocks = 512; // 32 MiB per layer, 128 MiB swapped out
    let config = CudaStorageConfig {
        host_blocks: blocks,
        ..CudaStorageConfig::blocks(blocks)
    };
    let Some(mut gpu) = storage_or_skip(test, l, config) else {
        return;
    };
    let mut host = HostStorage::with_host_tier(l, blocks, blocks).unwrap();
    fill_same(&mut gpu, &mut host, 23);
    let out = scattered(SwapDirection::Out, blocks, 0);
    let mut clobber = CopyPlan::new();
    for b in (0..blocks as u32).step_by(2) {
        clobber.push(BlockId(b + 1), BlockId(b));
    }
    gpu.swap(&out).unwrap();
    gpu.copy_blocks(&clobber).unwrap(); // no sync in between
    host.swap(&out).unwrap();
    host.copy_blocks(&clobber).unwrap();
    assert_same(&gpu, &host, "swap-out raced by copy_blocks");
}

#[test]
fn swap_in_then_read_at_once_on_the_compute_and_a_callers_stream() {
    let test = "swap_in_then_read_at_once_on_the_compute_and_a_callers_stream";
    let l = wide_layout(4, DType::BF16);
    let blocks = 512;
    let config = CudaStorageConfig {
        host_blocks: blocks,
        ..CudaStorageConfig::blocks(blocks)
    };
    let Some(mut gpu) = storage_or_skip(test, l, config) else {
        return;
    };
    let mut host = HostStorage::with_host_tier(l, blocks, blocks).unwrap();
    fill_same(&mut gpu, &mut host, 24);
    // Put distinct bytes in the host tier: swap out everything, then scribble on the
    // device so a read that runs before the swap-in lands sees the wrong bytes.
    let mut all_out = SwapPlan::new(SwapDirection::Out);
    for b in 0..blocks as u32 {
        all_out.push(BlockId(b), BlockId(b));
    }
    gpu.swap(&all_out).unwrap();
    host.swap(&all_out).unwrap();
    let mut scribble = CopyPlan::new();
    for b in (0..blocks as u32).step_by(2) {
        scribble.push(BlockId(b + 1), BlockId(b));
    }
    gpu.copy_blocks(&scribble).unwrap();
    host.copy_blocks(&scribble).unwrap();
    let back = scattered(SwapDirection::In, blocks, 1);
    // Per layer, last layer first, then consumers queued with no host sync:
    // copy_blocks on the compute stream (waits per layer) ...
    for layer in (0..4).rev() {
        gpu.swap_layer(layer, &back).unwrap();
    }
    host.swap(&back).unwrap();
    let mut consume = CopyPlan::new();
    consume.push(BlockId(0), BlockId(1));
    consume.push(BlockId(2), BlockId(3));
    gpu.copy_blocks(&consume).unwrap();
    host.copy_blocks(&consume).unwrap();
    // ... and a caller's own stream that waits on layer 0's fence, then copies out.
    let stream = gpu.context().new_stream().unwrap();
    gpu.wait_fence_on(&gpu.layer_fence(0).unwrap(), &stream)
        .unwrap();
    let bpl = l.block_bytes_per_layer();
    let region = gpu.region_ptr(0).unwrap();
    let mut staged = stream.alloc_zeros::<u8>(bpl).unwrap();
    {
        let (dst, _guard) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut staged, &stream);
        // SAFETY: block 4 of layer 0 is mapped (`blocks` > 4); `staged` holds `bpl`
        // bytes; both stay alive until the stream is synchronised below.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                dst,
                region + 4 * bpl as u64,
                bpl,
                stream.cu_stream(),
            )
        }
        .result()
        .unwrap();
    }
    let got = stream.clone_dtoh(&staged).unwrap();
    stream.synchronize().unwrap();
    assert!(
        got == host.block_bytes(0, BlockId(4)).unwrap(),
        "caller's stream raced"
    );
    assert!(gpu.is_layer_ready(0).unwrap());
    assert_same(&gpu, &host, "swap-in consumed at once");
    assert!(gpu.is_swap_complete().unwrap());
}
