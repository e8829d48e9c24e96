//! The serve simulation's GPU path (this module's parent), run on the CPU: the `serve`
//! example's tests (`test = true` in Cargo.toml; `cargo test --example serve`).
//!
//! * Chunked prefill: the launches `plan_chunks` builds for a batch (cut contexts,
//!   `query_start_loc`, the positions each launch's queries hold), run through
//!   `replay_tiling` (the prefill kernel's loop structure, tile sizes and masks, in
//!   `f32`), must give what the host attention path gives for the whole tails at once,
//!   while the K/V past each launch's context is still NaN (the engine writes a chunk's
//!   K/V just before its launch), so a launch that reads one key too far fails.
//! * `Checked`, the model cache the GPU path uses, over a CPU device that replays the
//!   prefill kernel: the tiny model prefills (in chunks, over a shared prefix) and
//!   decodes through it; every launch is compared with the host shadow, a copy plan
//!   runs on both, and the two caches stay byte-equal. Devices with a planted fault
//!   (contexts one token short, cache writes that are lost, a byte changed behind the
//!   cache's back) must be caught.
//! * The host/GPU run comparison names the first figure that differs, and the kernels
//!   the GPU run needs are among the cubins prebuilt for the GPU machine.
//!
//! What this cannot check: the CUDA kernels themselves (the decode kernel has no CPU
//! replay; the replay device decodes with the prefill kernel's algorithm at one query
//! per sequence). `tests/cuda/prefill.rs` and `tests/cuda/attention.rs` run those on a
//! GPU, and `serve --backend cuda` runs this whole path there.

use super::{prefill_chunked, rel_err, tolerance, Checked, Device, GpuChecks, ModelCache};
use pagedkv::attention::cpu::{paged_prefill, reshape_and_cache};
use pagedkv::attention::cuda_prefill::{kernel_tile_sizes, plan_chunks, replay_tiling};
use pagedkv::attention::model::{ModelAttention, SplitMix64, TinyModel};
use pagedkv::attention::reference::paged_prefill_reference;
use pagedkv::attention::{alibi_slopes, AttentionParams};
use pagedkv::layout::convert::encode;
use pagedkv::layout::Slot;
use pagedkv::tables::PaddedTables;
use pagedkv::{BlockId, CopyPlan, DType, HostStorage, KvLayout, ModelShape, Storage};

fn padded(rows: &[Vec<u32>], ctx: &[usize]) -> PaddedTables {
    let max_blocks = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut tables = vec![0u32; rows.len() * max_blocks];
    for (i, r) in rows.iter().enumerate() {
        tables[i * max_blocks..i * max_blocks + r.len()].copy_from_slice(r);
    }
    PaddedTables {
        tables,
        context_lens: ctx.iter().map(|&c| c as u32).collect(),
        batch: rows.len(),
        max_blocks,
    }
}

/// The cache bytes of `n` tokens of one layer: `[tokens, kv_heads, head_dim]` of `dtype`.
fn token_bytes(dtype: DType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; x.len() * dtype.size_bytes()];
    encode(dtype, x, 1.0, &mut out).unwrap();
    out
}

#[test]
fn chunked_launches_replayed_as_the_kernel_tiles_match_the_host_path() {
    // Three sequences: a chunk after a cached prefix, a whole prompt, a one-token tail.
    let ctxs = [70usize, 33, 129];
    let computed = [20usize, 0, 128];
    for (dtype, group, window, alibi) in [
        (DType::BF16, 4, None, true),
        (DType::F16, 1, Some(24), false),
        (DType::Fp8E4M3, 8, None, false),
    ] {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 2 * group,
            num_kv_heads: 2,
            head_dim: 64,
            kv_dtype: dtype,
        };
        let layout = KvLayout::new(shape, 16).unwrap();
        let bs = layout.block_size();
        let num_blocks: usize = ctxs.iter().map(|c| c.div_ceil(bs)).sum::<usize>() + 3;
        let mut rng = SplitMix64::new(0x5e7e ^ group as u64);
        // Blocks handed out back to front, so table order is not arena order.
        let mut next = num_blocks as u32;
        let rows: Vec<Vec<u32>> = ctxs
            .iter()
            .map(|c| {
                (0..c.div_ceil(bs))
                    .map(|_| {
                        next -= 1;
                        next
                    })
                    .collect()
            })
            .collect();
        let full = padded(&rows, &ctxs);
        let per_token = shape.num_kv_heads * shape.head_dim;
        // The real K/V of every position, and the slot of every position.
        let kv: Vec<Vec<(Vec<f32>, Vec<f32>)>> = ctxs
            .iter()
            .map(|&c| {
                (0..c)
                    .map(|_| {
                        let k = (0..per_token).map(|_| rng.uniform(1.5)).collect();
                        let v = (0..per_token).map(|_| rng.uniform(1.5)).collect();
                        (k, v)
                    })
                    .collect()
            })
            .collect();
        let slot = |i: usize, p: usize| layout.slot(BlockId(rows[i][p / bs]), p % bs);
        let write = |st: &mut HostStorage, i: usize, ps: std::ops::Range<usize>, real: bool| {
            for p in ps {
                let (k, v) = &kv[i][p];
                let nan = vec![f32::NAN; per_token];
                let (k, v) = if real { (k, v) } else { (&nan, &nan) };
                st.write_slots(
                    0,
                    &[slot(i, p)],
                    &token_bytes(dtype, k),
                    &token_bytes(dtype, v),
                )
                .unwrap();
            }
        };
        let mut params = AttentionParams::new(64);
        params.sliding_window = window;
        params.alibi_slopes = alibi.then(|| alibi_slopes(shape.num_q_heads));
        if dtype == DType::Fp8E4M3 {
            (params.k_scale, params.v_scale) = (0.5, 2.0);
        }
        // The whole tails' queries, packed per sequence.
        let row_elems = shape.num_q_heads * shape.head_dim;
        let tails: Vec<usize> = ctxs.iter().zip(&computed).map(|(c, d)| c - d).collect();
        let mut qsl = vec![0usize];
        for t in &tails {
            qsl.push(qsl.last().unwrap() + t);
        }
        let q: Vec<f32> = (0..qsl[3] * row_elems).map(|_| rng.uniform(1.0)).collect();

        // The host attention path over the whole tails at once.
        let mut whole = HostStorage::new(layout, num_blocks).unwrap();
        for (i, &c) in ctxs.iter().enumerate() {
            write(&mut whole, i, 0..c, true);
        }
        let mut want = vec![0f32; q.len()];
        paged_prefill(&whole, 0, &q, &qsl, &full, &params, None, &mut want, None).unwrap();
        let exact = paged_prefill_reference(&whole, 0, &q, &qsl, &full, &params).unwrap();
        let exact: Vec<f32> = exact.out.iter().map(|&x| x as f32).collect();
        assert!(rel_err(&want, &exact) < 1e-5);

        // The prefix is cached; the tails are still NaN until their launch.
        let cached_prefix = || {
            let mut st = HostStorage::new(layout, num_blocks).unwrap();
            for (i, (&done, &c)) in computed.iter().zip(&ctxs).enumerate() {
                write(&mut st, i, 0..done, true);
                write(&mut st, i, done..c, false);
            }
            st
        };
        let (q_tile, kv_tile) = kernel_tile_sizes(&layout);
        for chunk in [0, 1, 5, 16, 37] {
            let mut st = cached_prefix();
            let mut got = vec![f32::NAN; q.len()];
            let launches = plan_chunks(&full, &computed, chunk).unwrap();
            for launch in &launches {
                let mut cq = Vec::new();
                for (i, r) in launch.positions.iter().enumerate() {
                    write(&mut st, i, r.clone(), true);
                    let first = qsl[i] + r.start - computed[i];
                    cq.extend_from_slice(&q[first * row_elems..(first + r.len()) * row_elems]);
                }
                let (out, _) = replay_tiling(
                    &st,
                    0,
                    &cq,
                    &launch.query_start_loc,
                    &launch.tables,
                    &params,
                    q_tile,
                    kv_tile,
                )
                .unwrap();
                for (i, r) in launch.positions.iter().enumerate() {
                    let first = qsl[i] + r.start - computed[i];
                    let src = launch.query_start_loc[i] * row_elems;
                    got[first * row_elems..(first + r.len()) * row_elems]
                        .copy_from_slice(&out[src..src + r.len() * row_elems]);
                }
            }
            let e = rel_err(&got, &want);
            println!(
                "{dtype} group {group} chunk {chunk}: {} launches, rel err {e:.2e}",
                launches.len()
            );
            assert!(
                e < tolerance(129),
                "{dtype} group {group} chunk {chunk}: {} launches, rel err {e}",
                launches.len()
            );
            // A launch that reads past its context reads NaN: cutting the context one
            // token later than planned must show.
            if chunk == 5 {
                let mut st = cached_prefix();
                let launch = &launches[0];
                let mut cq = Vec::new();
                let mut wrong = launch.tables.clone();
                for (i, r) in launch.positions.iter().enumerate() {
                    write(&mut st, i, r.clone(), true);
                    let first = qsl[i] + r.start - computed[i];
                    cq.extend_from_slice(&q[first * row_elems..(first + r.len()) * row_elems]);
                    if r.end < ctxs[i] {
                        wrong.context_lens[i] += 1;
                    }
                }
                let (out, _) = replay_tiling(
                    &st,
                    0,
                    &cq,
                    &launch.query_start_loc,
                    &wrong,
                    &params,
                    q_tile,
                    kv_tile,
                )
                .unwrap();
                assert!(
                    out.iter().any(|x| !x.is_finite()),
                    "{dtype}: an off-by-one context went unnoticed"
                );
            }
        }
    }
}

/// A CPU device for `Checked`: the cache in a `HostStorage`, prefill by the replay of
/// the prefill kernel's tiling, decode by the same replay at one query per sequence.
/// `fault` plants a bug to be caught.
struct Replay {
    store: HostStorage,
    fault: Fault,
}

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    None,
    /// Prefill launches see contexts one token shorter than the tables say.
    ShortContext,
    /// Cache writes to layer 1 are lost.
    LostWrite,
}

pagedkv::delegate_storage! { Replay => store; }

impl Device for Replay {
    fn write_kv(
        &mut self,
        layer: usize,
        slots: &[Slot],
        k: &[f32],
        v: &[f32],
        params: &AttentionParams,
    ) -> pagedkv::Result<()> {
        if self.fault == Fault::LostWrite && layer == 1 {
            return Ok(());
        }
        reshape_and_cache(
            &mut self.store,
            layer,
            slots,
            k,
            v,
            params.k_scale,
            params.v_scale,
        )
    }

    fn prefill(
        &mut self,
        layer: usize,
        q: &[f32],
        query_start_loc: &[usize],
        tables: &PaddedTables,
        params: &AttentionParams,
    ) -> pagedkv::Result<Vec<f32>> {
        let (qt, kt) = kernel_tile_sizes(self.store.layout());
        if self.fault == Fault::ShortContext {
            // Every context one token short where the queries allow it: each query
            // attends as if it sat one position earlier.
            let mut t = tables.clone();
            for i in 0..t.batch {
                let n = query_start_loc[i + 1] - query_start_loc[i];
                if (t.context_lens[i] as usize) > n {
                    t.context_lens[i] -= 1;
                }
            }
            return Ok(
                replay_tiling(&self.store, layer, q, query_start_loc, &t, params, qt, kt)?.0,
            );
        }
        Ok(replay_tiling(
            &self.store,
            layer,
            q,
            query_start_loc,
            tables,
            params,
            qt,
            kt,
        )?
        .0)
    }

    fn decode(
        &mut self,
        layer: usize,
        q: &[f32],
        tables: &PaddedTables,
        params: &AttentionParams,
    ) -> pagedkv::Result<Vec<f32>> {
        let (qt, kt) = kernel_tile_sizes(self.store.layout());
        let qsl: Vec<usize> = (0..=tables.batch).collect();
        Ok(replay_tiling(&self.store, layer, q, &qsl, tables, params, qt, kt)?.0)
    }

    fn block_bytes(&self, layer: usize, block: BlockId) -> pagedkv::Result<Vec<u8>> {
        let l = self.store.layout();
        let start = l.block_byte_offset(block);
        Ok(self.store.region(layer)[start..start + l.block_bytes_per_layer()].to_vec())
    }
}

/// Runs the tiny model through `cache`: sequence A prefills its 40-token prompt in
/// chunks of 16; B shares A's first two blocks (a 32-token prefix-cache hit) and
/// prefills its 75-token prompt's tail in chunks of 7; B's third block is copied
/// (copy-on-write); then both decode 6 tokens. Returns the final hidden states.
fn drive(model: &TinyModel, cache: &mut dyn ModelCache) -> pagedkv::Result<Vec<f32>> {
    let bs = cache.layout().block_size();
    let mut a_rows: Vec<u32> = vec![0, 1, 2];
    let mut b_rows: Vec<u32> = vec![0, 1, 3, 4, 5];
    let (mut a_len, mut b_len) = (40usize, 75usize);
    let a_prompt = model.prompt_tokens(1, a_len);
    let mut b_prompt = a_prompt[..32].to_vec();
    b_prompt.extend(model.prompt_tokens(2, b_len - 32));
    let mut hidden = Vec::new();
    prefill_chunked(
        model,
        cache,
        &padded(&[a_rows.clone()], &[a_len]),
        0,
        &a_prompt,
        16,
        &mut hidden,
    )?;
    prefill_chunked(
        model,
        cache,
        &padded(&[b_rows.clone()], &[b_len]),
        32,
        &b_prompt[32..],
        7,
        &mut hidden,
    )?;
    let mut plan = CopyPlan::new();
    plan.push(BlockId(3), BlockId(6));
    cache.copy_blocks(&plan)?;
    b_rows[2] = 6;
    let mut next = 7;
    for step in 0..6u32 {
        for (rows, len) in [(&mut a_rows, &mut a_len), (&mut b_rows, &mut b_len)] {
            *len += 1;
            if rows.len() * bs < *len {
                rows.push(next);
                next += 1;
            }
        }
        let tables = padded(&[a_rows.clone(), b_rows.clone()], &[a_len, b_len]);
        hidden.resize(2 * model.hidden_size(), 0.0);
        model.decode_tokens(cache, &tables, &[step, 100 + step], &mut hidden)?;
    }
    cache.verify()?;
    Ok(hidden)
}

fn tiny() -> (TinyModel, KvLayout) {
    let shape = TinyModel::scaled_shape(&ModelShape {
        num_layers: 32,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        kv_dtype: DType::BF16,
    });
    let model = TinyModel::new(shape, 7).unwrap();
    (model, KvLayout::new(shape, 16).unwrap())
}

fn checked(layout: KvLayout, fault: Fault) -> (Checked<Replay>, super::SharedChecks) {
    let checks = super::SharedChecks::default();
    checks.borrow_mut().tolerance = tolerance(2048);
    let dev = Replay {
        store: HostStorage::new(layout, 16).unwrap(),
        fault,
    };
    (Checked::new(dev, &checks).unwrap(), checks)
}

#[test]
fn the_checked_cache_runs_the_tiny_model_on_a_cpu_device() {
    let (model, layout) = tiny();
    let mut host = HostStorage::new(layout, 16).unwrap();
    let want = drive(&model, &mut host).unwrap();
    let (mut cache, checks) = checked(layout, Fault::None);
    let got = drive(&model, &mut cache).unwrap();
    let c: GpuChecks = checks.borrow().clone();
    println!("checked launches: {}", c.json());
    // A: ceil(40 / 16) = 3 launches; B: ceil(43 / 7) = 7; each on 2 layers. Decode:
    // 6 steps on 2 layers.
    assert_eq!(c.prefill_launches, (3 + 7) * 2);
    assert_eq!(c.decode_launches, 6 * 2);
    assert_eq!(c.cache_compares, 1);
    assert!(c.prefill_max_rel_err <= c.tolerance && c.decode_max_rel_err <= c.tolerance);
    // The model went on with the device's outputs, which differ from the host path's
    // only by f32 rounding; the final states agree to well under a bf16 step.
    let e = rel_err(&got, &want);
    assert!(e < 1e-3, "final hidden states differ by {e}");
}

#[test]
fn the_checked_cache_catches_a_planted_fault() {
    let (model, layout) = tiny();
    let (mut cache, _) = checked(layout, Fault::ShortContext);
    let err = drive(&model, &mut cache).unwrap_err().to_string();
    assert!(err.contains("prefill of layer 0"), "{err}");
    let (mut cache, checks) = checked(layout, Fault::LostWrite);
    let err = drive(&model, &mut cache).unwrap_err().to_string();
    // The lost layer-1 writes leave the device reading zeros where the host reads
    // K/V: the first layer-1 launch is caught, before any cache comparison.
    assert!(err.contains("layer 1"), "{err}");
    assert_eq!(checks.borrow().cache_compares, 0);
    // And `verify` alone catches a cache that differs.
    let (mut cache, _) = checked(layout, Fault::None);
    let k = vec![1.0f32; 2 * 64];
    ModelAttention::write_kv(&mut cache, 0, &[Slot(3)], &k, &k, model.params()).unwrap();
    cache.verify().unwrap();
    let other = token_bytes(DType::BF16, &vec![2.0f32; 2 * 64]);
    let dev = cache.device_mut();
    dev.store
        .write_slots(0, &[Slot(3)], &other, &other)
        .unwrap();
    let err = cache.verify().unwrap_err().to_string();
    assert!(err.contains("block 0 of layer 0"), "{err}");
}

/// The GPU machine has no NVRTC: `serve --backend cuda` finds its kernels among the
/// cubins `gpu_bench --write-cubins` prebuilds from `catalog()`. The attention-model
/// shapes of the models `.ci/gpu-check` runs must be there (block size 16, the
/// default). qwen2.5-7b's scaled shape (GQA 7) is not: on the GPU machine it needs
/// NVRTC.
#[cfg(feature = "cuda")]
#[test]
fn the_serve_models_kernels_are_in_the_prebuilt_catalog() {
    use pagedkv::plan::config::builtin::by_name;
    use pagedkv::ModelConfig;
    let layout_of = |name: &str| {
        let config = ModelConfig::from_json_str(by_name(name).unwrap()).unwrap();
        KvLayout::new(TinyModel::scaled_shape(&config.shape), 16).unwrap()
    };
    // llama3-8b is serve's default model, the one .ci/gpu-check runs.
    for name in ["llama3-8b", "llama3-70b"] {
        let missing = super::unprebuilt_kernels(&layout_of(name), false);
        assert!(missing.is_empty(), "{name}: {missing:?} not prebuilt");
    }
    // GQA 7 is not prebuilt: without NVRTC serve refuses it before starting.
    assert_eq!(
        super::unprebuilt_kernels(&layout_of("qwen2.5-7b"), false).len(),
        2
    );
    assert!(super::unprebuilt_kernels(&layout_of("qwen2.5-7b"), true).is_empty());
}

#[test]
fn runs_compare_figure_by_figure() {
    let run = |steps: u64, hash: u64, wall: f64| {
        serde_json::json!({
            "requests_served": 40, "sequences_served": 44, "tokens_generated": 5000,
            "prefill_tokens_saved": 900, "steps": steps, "peak_concurrent_seqs": 20,
            "peak_used_blocks": 700, "admissions_delayed": 3, "preemptions": 1,
            "cow_copies": 4, "schedule_hash": hash, "kv_checksum": 77u64,
            "wall_seconds": wall,
        })
    };
    let host = vec![("paged".to_string(), run(500, 9, 1.0))];
    // Timing differs between backends and is not compared.
    assert!(super::compare_runs(&host, &[("paged".into(), run(500, 9, 2.0))]).is_ok());
    let e = super::compare_runs(&host, &[("paged".into(), run(500, 8, 1.0))]).unwrap_err();
    assert!(e.contains("schedule_hash"), "{e}");
    let e = super::compare_runs(&host, &[("paged".into(), run(501, 9, 1.0))]).unwrap_err();
    assert!(e.contains("steps"), "{e}");
    assert!(super::compare_runs(&host, &[]).is_err());
    assert!(super::compare_runs(&host, &[("contiguous".into(), run(500, 9, 1.0))]).is_err());
}
