//! The CUDA paged prefill kernel (`kernels/paged_prefill.cu`) against the `f64`
//! reference `paged_prefill_reference`, on the same random non-zero K/V: chunked
//! prefill over a cached prefix, whole prompts, single-token chunks, GQA, f16/bf16/fp8,
//! sliding windows and ALiBi. Outputs are poisoned with NaN before the launch. Skips
//! with a visible line without a GPU (and fails then under `PAGEDKV_REQUIRE_GPU=1`).

use crate::support::cuda;

use cuda::{skip, storage_or_skip, Rng};
use pagedkv::attention::cuda_prefill::CudaPrefill;
use pagedkv::attention::reference::paged_prefill_reference;
use pagedkv::attention::AttentionParams;
use pagedkv::executor::storage::CudaStorageConfig;
use pagedkv::layout::Slot;
use pagedkv::tables::PaddedTables;
use pagedkv::{DType, Error, HostStorage, KvLayout, ModelShape, Storage};

fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-30)).sqrt()
}

/// (head dim, GQA group) of `prefill_matches_the_f64_reference`, each in f16, bf16 and
/// fp8 on 16-token pages.
const PREFILL_CASES: [(usize, usize); 3] = [(128, 8), (64, 1), (128, 4)];
const PREFILL_DTYPES: [DType; 3] = [DType::F16, DType::BF16, DType::Fp8E4M3];
/// `multi_query_verification_matches_successive_decode_launches`: bf16, d128, 16 query
/// heads over 2 KV heads.
const VERIFY_SHAPE: ModelShape = ModelShape {
    num_layers: 1,
    num_q_heads: 16,
    num_kv_heads: 2,
    head_dim: 128,
    kv_dtype: DType::BF16,
};

/// Runs without a GPU: every prefill and decode specialisation this file launches is
/// among the cubins `.ci/gpu-check build` prebuilds (the GPU machine has no NVRTC).
#[test]
fn every_case_here_is_prebuilt() {
    use pagedkv::executor::cuda::{catalog, AttentionSpec, KernelSpec, PrefillSpec};
    let all = catalog();
    let mut used = Vec::new();
    for dtype in PREFILL_DTYPES {
        for (head_dim, gqa_group) in PREFILL_CASES {
            used.push(KernelSpec::Prefill(PrefillSpec {
                head_dim,
                block_size: 16,
                gqa_group,
                dtype,
            }));
        }
    }
    let verify = KvLayout::new(VERIFY_SHAPE, 16).unwrap();
    used.push(KernelSpec::Prefill(PrefillSpec::for_layout(&verify)));
    used.push(KernelSpec::Attention(AttentionSpec::for_layout(&verify)));
    for spec in used {
        assert!(
            all.contains(&spec),
            "{spec:?} is launched by tests/cuda/prefill.rs but not prebuilt"
        );
    }
}

#[test]
fn prefill_matches_the_f64_reference() {
    let test = "prefill_matches_the_f64_reference";
    // (cached prefix + chunk) contexts and chunk lengths: a chunk after a long prefix,
    // a whole prompt, a decode-like single token, an empty chunk, one past tile bounds.
    let ctxs = [700usize, 129, 40, 33, 300];
    let qlens = [100usize, 129, 1, 0, 37];
    for dtype in PREFILL_DTYPES {
        for (head_dim, group) in PREFILL_CASES {
            let kv_heads = 2;
            let shape = ModelShape {
                num_layers: 1,
                num_q_heads: kv_heads * group,
                num_kv_heads: kv_heads,
                head_dim,
                kv_dtype: dtype,
            };
            let layout = KvLayout::new(shape, 16).unwrap();
            let bs = layout.block_size();
            let needed: usize = ctxs.iter().map(|c| c.div_ceil(bs)).sum();
            let num_blocks = needed + 5;
            let name = format!("{test} ({dtype} d{head_dim} g{group})");
            let Some(mut gpu) =
                storage_or_skip(&name, layout, CudaStorageConfig::blocks(num_blocks))
            else {
                return;
            };
            let prefill = match CudaPrefill::new(&gpu) {
                Ok(p) => p,
                Err(Error::CudaUnavailable(why)) => {
                    skip(&name, &why);
                    return;
                }
                Err(e) => panic!("{name}: {e}"),
            };
            let mut host = HostStorage::new(layout, num_blocks).unwrap();
            let mut rng = Rng(0x5eed ^ head_dim as u64 ^ ((group as u64) << 8));
            // Random non-zero cache contents (fp8 through the CPU encoder's scale).
            let slots: Vec<Slot> = (0..(num_blocks * bs) as u64).map(Slot).collect();
            let n = slots.len() * kv_heads * head_dim;
            let k: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0).collect();
            let v: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0).collect();
            let kb = cuda::encode(dtype, &k, 1.0);
            let vb = cuda::encode(dtype, &v, 1.0);
            gpu.write_slots(0, &slots, &kb, &vb).unwrap();
            host.write_slots(0, &slots, &kb, &vb).unwrap();
            // Tables over shuffled blocks.
            let mut order: Vec<u32> = (0..num_blocks as u32).collect();
            rng.shuffle(&mut order);
            let max_blocks = ctxs.iter().map(|c| c.div_ceil(bs)).max().unwrap();
            let mut tables = vec![0u32; ctxs.len() * max_blocks];
            let mut next = 0;
            for (i, c) in ctxs.iter().enumerate() {
                for j in 0..c.div_ceil(bs) {
                    tables[i * max_blocks + j] = order[next];
                    next += 1;
                }
            }
            let tables = PaddedTables {
                tables,
                context_lens: ctxs.iter().map(|&c| c as u32).collect(),
                batch: ctxs.len(),
                max_blocks,
            };
            let mut qsl = vec![0usize];
            for q in qlens {
                qsl.push(qsl.last().unwrap() + q);
            }
            let q: Vec<f32> = (0..qsl[ctxs.len()] * shape.num_q_heads * head_dim)
                .map(|_| rng.f32())
                .collect();
            for (window, alibi) in [(None, false), (Some(64), true)] {
                let mut params = AttentionParams::new(head_dim);
                params.sliding_window = window;
                params.alibi_slopes =
                    alibi.then(|| pagedkv::attention::alibi_slopes(shape.num_q_heads));
                if dtype == DType::Fp8E4M3 {
                    params.k_scale = 0.5;
                    params.v_scale = 1.5;
                }
                let want = paged_prefill_reference(&host, 0, &q, &qsl, &tables, &params).unwrap();
                let (out, lse) = prefill
                    .prefill_host(&gpu, 0, &q, &qsl, &tables, &params)
                    .unwrap();
                assert!(
                    out.iter().all(|x| x.is_finite()),
                    "{name}: unwritten output"
                );
                let e = rel_err(&out, &want.out);
                // f32 accumulation over exactly decoded K/V: far under 1e-4.
                assert!(
                    e < 1e-4,
                    "{name} window {window:?} alibi {alibi}: rel err {e}"
                );
                for (a, b) in lse.iter().zip(&want.lse) {
                    assert!(
                        (*a as f64 - b).abs() <= 1e-3 * b.abs().max(1.0),
                        "{name}: lse {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// Speculative verification: `k` draft queries per sequence through the prefill kernel
/// must give what `k` successive one-token launches of the decode kernel give (two
/// kernels that share no code), per draft row.
#[test]
fn multi_query_verification_matches_successive_decode_launches() {
    use pagedkv::attention::cuda::{CudaAttention, Tables};
    use pagedkv::attention::cuda_prefill::verify_query_start_loc;
    let test = "multi_query_verification_matches_successive_decode_launches";
    let ctxs = [300usize, 17, 64];
    let drafts = [5usize, 1, 8];
    let shape = VERIFY_SHAPE;
    let layout = KvLayout::new(shape, 16).unwrap();
    let bs = layout.block_size();
    let num_blocks: usize = ctxs.iter().map(|c| c.div_ceil(bs)).sum::<usize>() + 2;
    let Some(mut gpu) = storage_or_skip(test, layout, CudaStorageConfig::blocks(num_blocks)) else {
        return;
    };
    let (prefill, mut decode) = match (CudaPrefill::new(&gpu), CudaAttention::new(&gpu)) {
        (Ok(p), Ok(d)) => (p, d),
        (Err(Error::CudaUnavailable(why)), _) | (_, Err(Error::CudaUnavailable(why))) => {
            skip(test, &why);
            return;
        }
        (Err(e), _) | (_, Err(e)) => panic!("{test}: {e}"),
    };
    let mut rng = Rng(0x5bec);
    let slots: Vec<Slot> = (0..(num_blocks * bs) as u64).map(Slot).collect();
    let n = slots.len() * 2 * 128;
    let k: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let v: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    gpu.write_slots(
        0,
        &slots,
        &cuda::encode(DType::BF16, &k, 1.0),
        &cuda::encode(DType::BF16, &v, 1.0),
    )
    .unwrap();
    let max_blocks = ctxs.iter().map(|c| c.div_ceil(bs)).max().unwrap();
    let mut order: Vec<u32> = (0..num_blocks as u32).collect();
    rng.shuffle(&mut order);
    let mut ids = vec![0u32; ctxs.len() * max_blocks];
    let mut next = 0;
    for (i, c) in ctxs.iter().enumerate() {
        for j in 0..c.div_ceil(bs) {
            ids[i * max_blocks + j] = order[next];
            next += 1;
        }
    }
    let tables = PaddedTables {
        tables: ids,
        context_lens: ctxs.iter().map(|&c| c as u32).collect(),
        batch: ctxs.len(),
        max_blocks,
    };
    let qsl = verify_query_start_loc(&tables, &drafts).unwrap();
    let row = 16 * 128;
    let q: Vec<f32> = (0..qsl[3] * row).map(|_| rng.f32()).collect();
    let mut params = AttentionParams::new(128);
    params.alibi_slopes = Some(pagedkv::attention::alibi_slopes(16));
    let (out, _) = prefill
        .prefill_host(&gpu, 0, &q, &qsl, &tables, &params)
        .unwrap();
    for (i, &kd) in drafts.iter().enumerate() {
        for j in 0..kd {
            let one = PaddedTables {
                tables: tables.row(i).to_vec(),
                context_lens: vec![(ctxs[i] - kd + j + 1) as u32],
                batch: 1,
                max_blocks,
            };
            let t = qsl[i] + j;
            let (want, _) = decode
                .decode_host(
                    &gpu,
                    0,
                    &q[t * row..(t + 1) * row],
                    Tables::Padded(&one),
                    &params,
                    None,
                )
                .unwrap();
            let got = &out[t * row..(t + 1) * row];
            let num: f64 = got
                .iter()
                .zip(&want)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            let den: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
            let e = (num / den.max(1e-30)).sqrt();
            assert!(e < 1e-4, "{test}: sequence {i} draft {j}: rel err {e}");
        }
    }
}
