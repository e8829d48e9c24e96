//! The CUDA decode kernel against an f64 reference on the same cache: every
//! specialisation of `executor::cuda::PREBUILT_ATTENTION` (f16, bf16 and fp8 with scales
//! at GQA 1/4/8 and head dims 64/128, f32, pages of 1/2/4/8 tokens beside 16; the GPU
//! machine has no NVRTC, so a test may only launch what is prebuilt, which a CPU test
//! here checks for every fixed case), ALiBi, sliding window,
//! every slot past a context poisoned with NaN (a kernel that reads one fails), empty
//! sequences, padded and CSR tables, and split counts 1, 2, 3, 5, 8, 64 plus the
//! planner's choice (several chunks per sequence exercise the work list's fused
//! log-sum-exp merge).
//!
//! The reference is the crate's `attention::reference::paged_decode_reference`, itself
//! cross-checked against an independent f64 loop in this file (which reads K/V back
//! through `HostStorage::read_tokens` and decodes them with tests/support/cuda.rs).
//! Each test prints a skip line and returns on a machine without a GPU.

use crate::support::cuda;

use cuda::{decode, nan_bytes, storage_or_skip, Rng};
use pagedkv::attention::cuda::{CudaAttention, Tables};
use pagedkv::attention::decode_mma::{check_against_reference, replay_decode_mma, uses_mma};
use pagedkv::attention::reference::paged_decode_reference;
use pagedkv::attention::{
    plan_splits, plan_splits_for_occupancy, split_plan_with, AttentionParams, SplitPlan,
};
use pagedkv::executor::cuda::{catalog, AttentionSpec, KernelSpec, PREBUILT_ATTENTION};
use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
use pagedkv::layout::Slot;
use pagedkv::tables::{CsrTables, PaddedTables};
use pagedkv::{BlockId, DType, HostStorage, KvLayout, ModelShape, Storage};

const LAYER: usize = 1;

#[derive(Debug, Clone)]
struct Case {
    dtype: DType,
    head_dim: usize,
    group: usize,
    /// Tokens per page.
    block_size: usize,
    alibi: bool,
    window: Option<usize>,
    contexts: Vec<usize>,
}

struct Setup {
    layout: KvLayout,
    host: HostStorage,
    /// `None` for the CPU-only simulation test.
    gpu: Option<CudaStorage>,
    padded: PaddedTables,
    csr: CsrTables,
    tables: Vec<Vec<BlockId>>,
    q: Vec<f32>,
    params: AttentionParams,
}

/// The case's cache and inputs on the host, and on the GPU when `want_gpu` (then
/// `None` on a machine without one).
fn setup(test: &str, case: &Case, seed: u64, want_gpu: bool) -> Option<Setup> {
    let kv_heads = 2;
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: kv_heads * case.group,
        num_kv_heads: kv_heads,
        head_dim: case.head_dim,
        kv_dtype: case.dtype,
    };
    let layout = KvLayout::new(shape, case.block_size).unwrap();
    let bs = layout.block_size();
    let needed: usize = case.contexts.iter().map(|&c| c.div_ceil(bs)).sum();
    let num_blocks = needed + 8;
    let mut gpu = match want_gpu {
        true => Some(storage_or_skip(
            test,
            layout,
            CudaStorageConfig::blocks(num_blocks),
        )?),
        false => None,
    };
    let mut host = HostStorage::new(layout, num_blocks).unwrap();
    let mut rng = Rng(seed);
    let fp8 = case.dtype == DType::Fp8E4M3;
    let (k_scale, v_scale) = if fp8 { (0.05, 0.03) } else { (1.0, 1.0) };

    // Poison every slot of every block, in both layers, with NaN.
    let per_token = kv_heads * case.head_dim;
    let all: Vec<Slot> = (0..(num_blocks * bs) as u64).map(Slot).collect();
    let nan: Vec<u8> = nan_bytes(case.dtype).repeat(all.len() * per_token);
    for layer in 0..2 {
        if let Some(g) = gpu.as_mut() {
            g.write_slots(layer, &all, &nan, &nan).unwrap();
        }
        host.write_slots(layer, &all, &nan, &nan).unwrap();
    }

    let mut free: Vec<u32> = (0..num_blocks as u32).collect();
    rng.shuffle(&mut free);
    let mut tables = Vec::new();
    for &ctx in &case.contexts {
        let table: Vec<BlockId> = free.drain(..ctx.div_ceil(bs)).map(BlockId).collect();
        let slots: Vec<Slot> = (0..ctx)
            .map(|t| layout.slot(table[t / bs], t % bs))
            .collect();
        let k: Vec<f32> = (0..ctx * per_token).map(|_| rng.f32()).collect();
        let v: Vec<f32> = (0..ctx * per_token).map(|_| rng.f32()).collect();
        // The cache is written with the crate's own encoder (fp8 stores x / scale).
        let mut kb = vec![0u8; k.len() * case.dtype.size_bytes()];
        let mut vb = vec![0u8; v.len() * case.dtype.size_bytes()];
        pagedkv::layout::convert::encode(case.dtype, &k, k_scale, &mut kb).unwrap();
        pagedkv::layout::convert::encode(case.dtype, &v, v_scale, &mut vb).unwrap();
        if let Some(g) = gpu.as_mut() {
            g.write_slots(LAYER, &slots, &kb, &vb).unwrap();
        }
        host.write_slots(LAYER, &slots, &kb, &vb).unwrap();
        tables.push(table);
    }
    let max_blocks = tables.iter().map(Vec::len).max().unwrap_or(0);
    let mut padded = PaddedTables {
        tables: vec![0; tables.len() * max_blocks],
        context_lens: case.contexts.iter().map(|&c| c as u32).collect(),
        batch: tables.len(),
        max_blocks,
    };
    let mut csr = CsrTables {
        indptr: vec![0],
        ..CsrTables::default()
    };
    for (i, t) in tables.iter().enumerate() {
        for (j, b) in t.iter().enumerate() {
            padded.tables[i * max_blocks + j] = b.0;
        }
        csr.indices.extend(t.iter().map(|b| b.0));
        csr.indptr.push(csr.indices.len() as u32);
        let c = case.contexts[i];
        csr.last_page_len
            .push(if c == 0 { 0 } else { ((c - 1) % bs + 1) as u32 });
    }
    let q_heads = shape.num_q_heads;
    let q: Vec<f32> = (0..tables.len() * q_heads * case.head_dim)
        .map(|_| rng.f32() * 2.0)
        .collect();
    let params = AttentionParams {
        scale: 1.0 / (case.head_dim as f32).sqrt(),
        alibi_slopes: case.alibi.then(|| {
            (0..q_heads)
                .map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / q_heads as f32))
                .collect()
        }),
        sliding_window: case.window,
        k_scale,
        v_scale,
    };
    Some(Setup {
        layout,
        host,
        gpu,
        padded,
        csr,
        tables,
        q,
        params,
    })
}

/// The crate's f64 reference (`attention::reference::paged_decode_reference`), checked
/// against this file's independent f64 loop, so the semantics the kernel is held to
/// (window, ALiBi, fp8 scales, empty sequences) are the crate's and are pinned twice.
fn reference(s: &Setup, contexts: &[usize]) -> (Vec<f64>, Vec<f64>) {
    let want = paged_decode_reference(&s.host, LAYER, &s.q, &s.padded, &s.params).unwrap();
    let (out, lse) = independent_reference(s, contexts);
    for (i, (a, b)) in want.out.iter().zip(&out).enumerate() {
        assert!(
            (a - b).abs() <= 1e-9 * (1.0 + a.abs()),
            "references differ at out[{i}]: {a} vs {b}"
        );
    }
    for (i, (a, b)) in want.lse.iter().zip(&lse).enumerate() {
        assert!(
            a == b || (a - b).abs() <= 1e-9 * (1.0 + a.abs()),
            "references differ at lse[{i}]: {a} vs {b}"
        );
    }
    (want.out, want.lse)
}

/// f64 attention for every (sequence, query head), written here from the formulas:
/// `(out, lse)`.
fn independent_reference(s: &Setup, contexts: &[usize]) -> (Vec<f64>, Vec<f64>) {
    let shape = s.layout.shape();
    let (d, qh, g) = (shape.head_dim, shape.num_q_heads, shape.group_size());
    let eb = shape.kv_dtype.size_bytes();
    let fp8 = shape.kv_dtype == DType::Fp8E4M3;
    let (ks, vs) = if fp8 {
        (s.params.k_scale as f64, s.params.v_scale as f64)
    } else {
        (1.0, 1.0)
    };
    let mut out = vec![0.0; contexts.len() * qh * d];
    let mut lse = vec![f64::NEG_INFINITY; contexts.len() * qh];
    for (i, &ctx) in contexts.iter().enumerate() {
        let n = ctx * shape.num_kv_heads * d * eb;
        let (mut kb, mut vb) = (vec![0u8; n], vec![0u8; n]);
        s.host
            .read_tokens(LAYER, &s.tables[i], ctx, &mut kb, &mut vb)
            .unwrap();
        let (k, v) = (
            decode(shape.kv_dtype, &kb, ks),
            decode(shape.kv_dtype, &vb, vs),
        );
        let start = s.params.sliding_window.map_or(0, |w| ctx.saturating_sub(w));
        for h in 0..qh {
            let kvh = h / g;
            let q = &s.q[(i * qh + h) * d..(i * qh + h + 1) * d];
            let logits: Vec<f64> = (start..ctx)
                .map(|t| {
                    let kt = &k[(t * shape.num_kv_heads + kvh) * d..][..d];
                    let dot: f64 = q.iter().zip(kt).map(|(&a, &b)| a as f64 * b).sum();
                    let alibi = s
                        .params
                        .alibi_slopes
                        .as_ref()
                        .map_or(0.0, |sl| sl[h] as f64 * (t as f64 - (ctx as f64 - 1.0)));
                    dot * s.params.scale as f64 + alibi
                })
                .collect();
            if logits.is_empty() {
                continue;
            }
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            lse[i * qh + h] = m + sum.ln();
            for (j, t) in (start..ctx).enumerate() {
                let vt = &v[(t * shape.num_kv_heads + kvh) * d..][..d];
                for (o, &x) in out[(i * qh + h) * d..][..d].iter_mut().zip(vt) {
                    *o += w[j] / sum * x;
                }
            }
        }
    }
    (out, lse)
}

fn compare(what: &str, gpu: &[f32], want: &[f64]) {
    assert_eq!(gpu.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in gpu.iter().zip(want).enumerate() {
        let ok = if w.is_infinite() {
            g as f64 == w
        } else {
            (g as f64 - w).abs() <= 2e-3 * (1.0 + w.abs())
        };
        assert!(ok, "{what}: element {i}: gpu {g}, reference {w}");
    }
}

/// Runs one case; false when the machine has no GPU (skip printed once).
fn run(test: &str, case: Case, seed: u64) -> bool {
    let Some(s) = setup(test, &case, seed, true) else {
        return false;
    };
    let Some(gpu) = s.gpu.as_ref() else {
        return false;
    };
    let (want_out, want_lse) = reference(&s, &case.contexts);
    let mut attn = CudaAttention::new(gpu).unwrap();
    // The tensor-core path rounds q and P to 16 bits: it is held to the bound its
    // arithmetic gives (decode_mma::check_against_reference), not to 2e-3.
    let mma = uses_mma(case.dtype, case.group, case.head_dim, s.layout.block_size());
    let compare = |what: &str, out: &[f32], lse: &[f32]| {
        if mma {
            if let Err(e) =
                check_against_reference(&s.host, LAYER, &s.q, &s.padded, &s.params, out, lse)
            {
                panic!("{what}: {e}");
            }
        } else {
            compare(&format!("{what} out"), out, &want_out);
            compare(&format!("{what} lse"), lse, &want_lse);
        }
    };
    for splits in [None, Some(1), Some(2), Some(3), Some(5), Some(8), Some(64)] {
        let (out, lse) = attn
            .decode_host(
                gpu,
                LAYER,
                &s.q,
                Tables::Padded(&s.padded),
                &s.params,
                splits,
            )
            .unwrap();
        compare(&format!("{case:?} padded splits {splits:?}"), &out, &lse);
    }
    // Deterministic: the same inputs give the same bits, run after run (no atomics
    // in either path's epilogue; warps and splits merge in a fixed order).
    for splits in [None, Some(3)] {
        let run = |attn: &mut CudaAttention| {
            attn.decode_host(
                gpu,
                LAYER,
                &s.q,
                Tables::Padded(&s.padded),
                &s.params,
                splits,
            )
            .unwrap()
        };
        let (a, la) = run(&mut attn);
        let (b, lb) = run(&mut attn);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&a),
            bits(&b),
            "{case:?} splits {splits:?}: output differs between runs"
        );
        assert_eq!(
            bits(&la),
            bits(&lb),
            "{case:?} splits {splits:?}: lse differs between runs"
        );
    }
    for splits in [None, Some(3)] {
        let (out, lse) = attn
            .decode_host(gpu, LAYER, &s.q, Tables::Csr(&s.csr), &s.params, splits)
            .unwrap();
        compare(&format!("{case:?} csr splits {splits:?}"), &out, &lse);
    }
    true
}

const CONTEXTS: [usize; 8] = [1, 15, 16, 17, 100, 333, 0, 1030];

/// The fixed cases of the tests below (dtype, head dim, GQA group, ALiBi, window), all
/// on 16-token pages; `every_case_here_is_prebuilt` holds them to the catalog.
const ALIBI_WINDOW_CASES: [(DType, usize, usize, bool, Option<usize>); 4] = [
    (DType::BF16, 128, 4, true, None),
    (DType::F16, 64, 8, false, Some(40)),
    (DType::Fp8E4M3, 128, 8, true, Some(300)),
    (DType::F32, 128, 8, true, Some(17)),
];
/// `sixteen_bit_queries_and_outputs_round_once...`: (dtype, GQA group) at d128.
const IO_CASES: [(DType, usize); 3] = [(DType::BF16, 8), (DType::Fp8E4M3, 4), (DType::F16, 1)];
/// `hostile_tables_are_rejected_before_launch`: (dtype, head dim, GQA group).
const HOSTILE_CASE: (DType, usize, usize) = (DType::BF16, 64, 4);
/// The CUDA-graph step: the tensor-core path (bf16 GQA 8) and the simple one (f16 GQA 1,
/// ALiBi, window), at d128.
const GRAPH_CASES: [(DType, usize, bool, Option<usize>); 2] = [
    (DType::BF16, 8, false, None),
    (DType::F16, 1, true, Some(100)),
];

/// Runs without a GPU: every specialisation a test of this file launches is among the
/// cubins `.ci/gpu-check build` prebuilds (`catalog()`), since the GPU machine cannot
/// compile one.
#[test]
fn every_case_here_is_prebuilt() {
    let all = catalog();
    let mut used: Vec<AttentionSpec> = PREBUILT_ATTENTION.to_vec();
    used.extend(
        ALIBI_WINDOW_CASES
            .iter()
            .map(|&(dtype, d, g, _, _)| AttentionSpec::decode(dtype, d, g, 16)),
    );
    used.extend(
        IO_CASES
            .iter()
            .map(|&(dtype, g)| AttentionSpec::decode(dtype, 128, g, 16)),
    );
    used.push(AttentionSpec::decode(
        HOSTILE_CASE.0,
        HOSTILE_CASE.1,
        HOSTILE_CASE.2,
        16,
    ));
    used.extend(
        GRAPH_CASES
            .iter()
            .map(|&(dtype, g, _, _)| AttentionSpec::decode(dtype, 128, g, 16)),
    );
    for spec in used {
        assert!(
            all.contains(&KernelSpec::Attention(spec)),
            "{spec:?} is launched by tests/cuda/attention.rs but not prebuilt"
        );
    }
    // Both decode paths, and pages under a tile on both.
    let mma = |a: &AttentionSpec| uses_mma(a.dtype, a.gqa_group, a.head_dim, a.block_size);
    assert!(PREBUILT_ATTENTION.iter().any(mma));
    assert!(PREBUILT_ATTENTION.iter().any(|a| !mma(a)));
    assert!(PREBUILT_ATTENTION
        .iter()
        .any(|a| a.block_size < 16 && mma(a)));
    assert!(PREBUILT_ATTENTION
        .iter()
        .any(|a| a.block_size < 16 && !mma(a)));
}

#[test]
fn decode_matches_reference_for_every_prebuilt_specialisation() {
    for (i, a) in PREBUILT_ATTENTION.iter().enumerate() {
        let case = Case {
            dtype: a.dtype,
            head_dim: a.head_dim,
            group: a.gqa_group,
            block_size: a.block_size,
            alibi: false,
            window: None,
            contexts: CONTEXTS.to_vec(),
        };
        if !run(
            "decode_matches_reference_for_every_prebuilt_specialisation",
            case,
            11 + i as u64,
        ) {
            return;
        }
    }
}

#[test]
fn decode_matches_reference_with_alibi_and_sliding_window() {
    for (i, (dtype, head_dim, group, alibi, window)) in ALIBI_WINDOW_CASES.into_iter().enumerate() {
        let case = Case {
            dtype,
            head_dim,
            group,
            block_size: 16,
            alibi,
            window,
            contexts: CONTEXTS.to_vec(),
        };
        if !run(
            "decode_matches_reference_with_alibi_and_sliding_window",
            case,
            100 + i as u64,
        ) {
            return;
        }
    }
}

/// f16 and bf16 queries and outputs (`decode_io`): the kernel converts q on load and
/// rounds on store, so the result must be, bit for bit, the f32 call on the same
/// (already rounded) queries with its output rounded to nearest even; for one split
/// and for several (f32 partials, rounded by the merge). And `decode_io_on` a caller's
/// stream gives the bits of the storage's compute stream.
#[test]
fn sixteen_bit_queries_and_outputs_round_once_and_any_stream_gives_the_same_bits() {
    use half::{bf16, f16};
    use pagedkv::attention::cuda::{Outputs, Queries};
    for (case_dtype, group) in IO_CASES {
        let case = Case {
            dtype: case_dtype,
            head_dim: 128,
            group,
            block_size: 16,
            alibi: false,
            window: None,
            contexts: CONTEXTS.to_vec(),
        };
        let Some(s) = setup(
            "sixteen_bit_queries_and_outputs_round_once",
            &case,
            55,
            true,
        ) else {
            return;
        };
        let Some(gpu) = s.gpu.as_ref() else {
            return;
        };
        let mut attn = CudaAttention::new(gpu).unwrap();
        let stream = gpu.compute_stream();
        let t = attn.upload_tables(gpu, Tables::Padded(&s.padded)).unwrap();
        // Tables re-uploaded into the same buffers: no allocation when they fit, CSR
        // and padded alternating, the same bits as fresh buffers.
        {
            let mut reused = attn.upload_tables(gpu, Tables::Padded(&s.padded)).unwrap();
            let _ = attn
                .upload_tables_into(gpu, Tables::Csr(&s.csr), &mut reused)
                .unwrap();
            assert!(!attn
                .upload_tables_into(gpu, Tables::Padded(&s.padded), &mut reused)
                .unwrap());
            let (want, _) = attn
                .decode_host(gpu, LAYER, &s.q, Tables::Padded(&s.padded), &s.params, None)
                .unwrap();
            let d_q = stream.clone_htod(&s.q).unwrap();
            let mut d_out = stream.alloc_zeros::<f32>(want.len()).unwrap();
            let mut d_lse = stream
                .alloc_zeros::<f32>(reused.batch() * 2 * group)
                .unwrap();
            attn.decode(
                gpu, LAYER, &d_q, &reused, &s.params, None, &mut d_out, &mut d_lse,
            )
            .unwrap();
            let got = stream.clone_dtoh(&d_out).unwrap();
            stream.synchronize().unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{case:?}: reused table buffers");
        }
        // On a caller's stream: the same bits as on the storage's compute stream.
        {
            let (want, want_lse) = attn
                .decode_host(gpu, LAYER, &s.q, Tables::Padded(&s.padded), &s.params, None)
                .unwrap();
            let other = gpu.context().new_stream().unwrap();
            let d_q = other.clone_htod(&s.q).unwrap();
            let mut d_out = other.alloc_zeros::<f32>(want.len()).unwrap();
            let mut d_lse = other.alloc_zeros::<f32>(want_lse.len()).unwrap();
            attn.decode_io_on(
                gpu,
                &other,
                LAYER,
                Queries::F32(&d_q),
                &t,
                &s.params,
                None,
                Outputs::F32(&mut d_out),
                &mut d_lse,
            )
            .unwrap();
            let got = other.clone_dtoh(&d_out).unwrap();
            other.synchronize().unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{case:?}: caller stream");
        }
        for io in [DType::F16, DType::BF16] {
            let bits: Vec<u16> =
                s.q.iter()
                    .map(|&x| match io {
                        DType::F16 => f16::from_f32(x).to_bits(),
                        _ => bf16::from_f32(x).to_bits(),
                    })
                    .collect();
            let widened: Vec<f32> = bits
                .iter()
                .map(|&b| match io {
                    DType::F16 => f16::from_bits(b).to_f32(),
                    _ => bf16::from_bits(b).to_f32(),
                })
                .collect();
            for splits in [Some(1), Some(3)] {
                let (want, want_lse) = attn
                    .decode_host(
                        gpu,
                        LAYER,
                        &widened,
                        Tables::Padded(&s.padded),
                        &s.params,
                        splits,
                    )
                    .unwrap();
                let d_q = stream.clone_htod(&bits).unwrap();
                let mut d_out = stream.alloc_zeros::<u16>(want.len()).unwrap();
                let mut d_lse = stream.alloc_zeros::<f32>(want_lse.len()).unwrap();
                let q = match io {
                    DType::F16 => Queries::F16(&d_q),
                    _ => Queries::BF16(&d_q),
                };
                let out = match io {
                    DType::F16 => Outputs::F16(&mut d_out),
                    _ => Outputs::BF16(&mut d_out),
                };
                attn.decode_io(gpu, LAYER, q, &t, &s.params, splits, out, &mut d_lse)
                    .unwrap();
                let got = stream.clone_dtoh(&d_out).unwrap();
                let got_lse = stream.clone_dtoh(&d_lse).unwrap();
                stream.synchronize().unwrap();
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let r = match io {
                        DType::F16 => f16::from_f32(w).to_bits(),
                        _ => bf16::from_f32(w).to_bits(),
                    };
                    assert_eq!(g, r, "{case:?} {io} splits {splits:?} element {i}");
                }
                assert_eq!(
                    got_lse.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want_lse.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }
}

#[test]
fn hostile_tables_are_rejected_before_launch() {
    let case = Case {
        dtype: HOSTILE_CASE.0,
        head_dim: HOSTILE_CASE.1,
        group: HOSTILE_CASE.2,
        block_size: 16,
        alibi: false,
        window: None,
        contexts: vec![20, 5],
    };
    let Some(s) = setup("hostile_tables_are_rejected_before_launch", &case, 7, true) else {
        return;
    };
    let Some(gpu) = s.gpu.as_ref() else {
        return;
    };
    let mut attn = CudaAttention::new(gpu).unwrap();
    let mut bad = s.padded.clone();
    bad.tables[0] = gpu.num_blocks() as u32;
    assert!(attn
        .decode_host(gpu, LAYER, &s.q, Tables::Padded(&bad), &s.params, None)
        .is_err());
    let mut bad = s.padded.clone();
    bad.context_lens[1] = u32::MAX;
    assert!(attn
        .decode_host(gpu, LAYER, &s.q, Tables::Padded(&bad), &s.params, None)
        .is_err());
    assert!(attn
        .decode_host(gpu, 5, &s.q, Tables::Padded(&s.padded), &s.params, None)
        .is_err());
    assert!(attn
        .decode_host(
            gpu,
            LAYER,
            &s.q[1..],
            Tables::Padded(&s.padded),
            &s.params,
            None
        )
        .is_err());
}

/// The decode kernel's algorithm (kernels/paged_attention.cu) replayed on the CPU in
/// f32: the split ranges and window clamp, the token-group partition of a CTA, the
/// base-2 online softmax of each group, the CTA merge, and the log-sum-exp merge of
/// the splits. It checks the algorithm without a GPU; the compiled kernel is checked
/// by the tests above on a GPU.
fn simulate_kernel(s: &Setup, contexts: &[usize], plan: SplitPlan) -> (Vec<f32>, Vec<f32>) {
    const THREADS: usize = 128;
    let shape = s.layout.shape();
    let (d, qh, g_size, kvh_n) = (
        shape.head_dim,
        shape.num_q_heads,
        shape.group_size(),
        shape.num_kv_heads,
    );
    let eb = shape.kv_dtype.size_bytes();
    // The kernel's lane layout: VEC_BYTES defaults to 8 for fp8 when 16 elements per
    // lane times the group exceed 128 accumulators.
    let elems16 = d / (d * eb / 16).min(32);
    let vec_bytes = if eb == 1 && g_size * elems16 > 128 {
        8
    } else {
        16
    };
    let lanes = (d * eb / vec_bytes).min(32);
    let groups = THREADS / lanes;
    let fp8 = shape.kv_dtype == DType::Fp8E4M3;
    let scale_log2 =
        s.params.scale * if fp8 { s.params.k_scale } else { 1.0 } * std::f32::consts::LOG2_E;
    let v_scale = if fp8 { s.params.v_scale } else { 1.0 };
    let (splits, tps) = (plan.num_splits as usize, plan.tokens_per_split as usize);
    let mut out = vec![0f32; contexts.len() * qh * d];
    let mut lse = vec![0f32; contexts.len() * qh];
    for (i, &ctx) in contexts.iter().enumerate() {
        let n = ctx * kvh_n * d * eb;
        let (mut kb, mut vb) = (vec![0u8; n], vec![0u8; n]);
        s.host
            .read_tokens(LAYER, &s.tables[i], ctx, &mut kb, &mut vb)
            .unwrap();
        // Stored values: the kernel folds the fp8 scales into scale_log2 and v_scale.
        let k: Vec<f32> = decode(shape.kv_dtype, &kb, 1.0)
            .iter()
            .map(|&x| x as f32)
            .collect();
        let v: Vec<f32> = decode(shape.kv_dtype, &vb, 1.0)
            .iter()
            .map(|&x| x as f32)
            .collect();
        for kvh in 0..kvh_n {
            // Per split and query head of the group: (normalised out, lse).
            let mut parts = vec![(vec![0f32; d], f32::NEG_INFINITY); splits * g_size];
            for split in 0..splits {
                let mut begin = split * tps;
                let end = (begin + tps).min(ctx);
                if let Some(w) = s.params.sliding_window {
                    if ctx > w && begin < ctx - w {
                        begin = ctx - w;
                    }
                }
                for g in 0..g_size {
                    let h = kvh * g_size + g;
                    let q = &s.q[(i * qh + h) * d..][..d];
                    let slope = s
                        .params
                        .alibi_slopes
                        .as_ref()
                        .map_or(0.0, |sl| sl[h] * std::f32::consts::LOG2_E);
                    let mut st = vec![(f32::NEG_INFINITY, 0f32, vec![0f32; d]); groups];
                    for t in begin..end {
                        let (m, l, acc) = &mut st[(t - begin) % groups];
                        let kt = &k[(t * kvh_n + kvh) * d..][..d];
                        let dot: f32 = q.iter().zip(kt).map(|(a, b)| a * b).sum();
                        let sc = dot * scale_log2 + slope * (t as f32 - (ctx as f32 - 1.0));
                        let m_new = m.max(sc);
                        let corr = if *m == f32::NEG_INFINITY {
                            0.0
                        } else {
                            (*m - m_new).exp2()
                        };
                        let p = (sc - m_new).exp2();
                        *l = *l * corr + p;
                        let vt = &v[(t * kvh_n + kvh) * d..][..d];
                        for (a, &x) in acc.iter_mut().zip(vt) {
                            *a = *a * corr + p * x;
                        }
                        *m = m_new;
                    }
                    let mt = st.iter().map(|x| x.0).fold(f32::NEG_INFINITY, f32::max);
                    let mut lt = 0f32;
                    let mut acc = vec![0f32; d];
                    if mt != f32::NEG_INFINITY {
                        for (m, l, a) in &st {
                            if *m != f32::NEG_INFINITY {
                                let f = (m - mt).exp2();
                                lt += l * f;
                                for (o, x) in acc.iter_mut().zip(a) {
                                    *o += x * f;
                                }
                            }
                        }
                    }
                    let o: Vec<f32> = acc
                        .iter()
                        .map(|a| if lt > 0.0 { a / lt * v_scale } else { 0.0 })
                        .collect();
                    let l = if lt > 0.0 {
                        (mt + lt.log2()) * std::f32::consts::LN_2
                    } else {
                        f32::NEG_INFINITY
                    };
                    parts[split * g_size + g] = (o, l);
                }
            }
            for g in 0..g_size {
                let row = i * qh + kvh * g_size + g;
                let ls: Vec<f32> = (0..splits).map(|sp| parts[sp * g_size + g].1).collect();
                let mx = ls.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let w: Vec<f32> = ls
                    .iter()
                    .map(|&l| {
                        if mx == f32::NEG_INFINITY || l == f32::NEG_INFINITY {
                            0.0
                        } else {
                            (l - mx).exp()
                        }
                    })
                    .collect();
                let wsum: f32 = w.iter().sum();
                for dd in 0..d {
                    let acc: f32 = (0..splits)
                        .map(|sp| w[sp] * parts[sp * g_size + g].0[dd])
                        .sum();
                    out[row * d + dd] = if wsum > 0.0 { acc / wsum } else { 0.0 };
                }
                lse[row] = if wsum > 0.0 {
                    mx + wsum.ln()
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    }
    (out, lse)
}

/// Every cache dtype at head dims 64 and 128 and GQA 1, 4 and 8, plus ALiBi and window
/// cases, plus pages of 1, 2 and 4 tokens at d128 GQA 8 (bf16 and f16 take the tensor
/// cores from page 2, fp8 from page 4; smaller pages keep the simple path); one test
/// per dtype so that the test threads share the work.
fn simulation_cases(dtype: DType) -> Vec<Case> {
    let case = |(dtype, head_dim, group, block_size, alibi, window)| Case {
        dtype,
        head_dim,
        group,
        block_size,
        alibi,
        window,
        contexts: CONTEXTS.to_vec(),
    };
    let mut cases = Vec::new();
    if dtype != DType::F32 {
        for head_dim in [64, 128] {
            for group in [1, 4, 8] {
                cases.push(case((dtype, head_dim, group, 16, false, None)));
            }
        }
        for block_size in [1, 2, 4] {
            cases.push(case((dtype, 128, 8, block_size, false, None)));
        }
    }
    cases.extend(
        ALIBI_WINDOW_CASES
            .into_iter()
            .filter(|c| c.0 == dtype)
            .map(|(dtype, d, g, alibi, window)| case((dtype, d, g, 16, alibi, window))),
    );
    cases
}

// One test per dtype, so the harness's threads share the replays: f16 alone is the
// longest of them.
#[test]
fn kernel_algorithm_simulated_on_cpu_matches_reference_f16() {
    simulate_cases(0, &simulation_cases(DType::F16));
}

#[test]
fn kernel_algorithm_simulated_on_cpu_matches_reference_f32() {
    simulate_cases(100, &simulation_cases(DType::F32));
}

#[test]
fn kernel_algorithm_simulated_on_cpu_matches_reference_bf16() {
    simulate_cases(200, &simulation_cases(DType::BF16));
}

#[test]
fn kernel_algorithm_simulated_on_cpu_matches_reference_fp8() {
    simulate_cases(400, &simulation_cases(DType::Fp8E4M3));
}

fn simulate_cases(seed: u64, cases: &[Case]) {
    for (n, case) in cases.iter().enumerate() {
        let bs = case.block_size;
        let s = setup("simulation", case, seed + n as u64, false).unwrap();
        let (want_out, want_lse) = reference(&s, &case.contexts);
        let max_ctx = *case.contexts.iter().max().unwrap();
        let mma = uses_mma(case.dtype, case.group, case.head_dim, bs);
        // The tensor-core path's lane-by-lane replay is most of this test's time, and the
        // library's own test replays it at one and three splits over groups, dtypes, head
        // dims, pages, windows and ALiBi
        // (`decode_mma::replay::tests::the_replay_matches_the_reference_over_groups_dims_and_pages_*`):
        // here it takes the most splits (64) and the planners' plans for these contexts;
        // the simple path takes every plan. Unoptimised, the replay is most of a plain
        // `cargo test`'s run, so a debug build replays the 64-split plan only and CI
        // replays the planners' plans too in release
        // (`cargo test --release --test cuda kernel_algorithm`).
        let forced: &[u32] = if mma { &[64] } else { &[1, 3, 64] };
        let mut plans: Vec<SplitPlan> = forced
            .iter()
            .map(|&n| split_plan_with(max_ctx, bs, n).unwrap())
            .collect();
        if !mma || !cfg!(debug_assertions) {
            plans.push(plan_splits(case.contexts.len(), 2, max_ctx, bs, 132));
            let lens: Vec<u32> = case.contexts.iter().map(|&c| c as u32).collect();
            plans.push(plan_splits_for_occupancy(&lens, case.window, 2, bs, 132, 3));
        }
        for plan in plans {
            let what = format!("simulated {case:?} {plan:?}");
            if mma {
                // The tensor-core path: its lane-by-lane replay (src/attention/decode_mma.rs).
                let (out, lse) =
                    replay_decode_mma(&s.host, LAYER, &s.q, &s.padded, &s.params, plan).unwrap();
                if let Err(e) =
                    check_against_reference(&s.host, LAYER, &s.q, &s.padded, &s.params, &out, &lse)
                {
                    panic!("{what}: {e}");
                }
            } else {
                let (out, lse) = simulate_kernel(&s, &case.contexts, plan);
                compare(&format!("{what} out"), &out, &want_out);
                compare(&format!("{what} lse"), &lse, &want_lse);
            }
        }
    }
}

/// Rows `rows` of `s`'s padded tables as a batch of their own.
fn sub_batch(s: &Setup, rows: &[usize]) -> PaddedTables {
    let mb = s.padded.max_blocks;
    PaddedTables {
        tables: rows
            .iter()
            .flat_map(|&r| s.padded.tables[r * mb..(r + 1) * mb].iter().copied())
            .collect(),
        context_lens: rows.iter().map(|&r| s.padded.context_lens[r]).collect(),
        batch: rows.len(),
        max_blocks: mb,
    }
}

#[test]
fn a_decode_step_captured_in_a_cuda_graph_replays_new_inputs() {
    use pagedkv::attention::StepCapacity;
    for (dtype, group, alibi, window) in GRAPH_CASES {
        let case = Case {
            dtype,
            head_dim: 128,
            group,
            block_size: 16,
            alibi,
            window,
            contexts: CONTEXTS.to_vec(),
        };
        let Some(s) = setup("a_decode_step_captured_in_a_cuda_graph", &case, 77, true) else {
            return;
        };
        let Some(gpu) = s.gpu.as_ref() else {
            return;
        };
        let shape = s.layout.shape();
        let row = shape.num_q_heads * shape.head_dim;
        let attn = CudaAttention::new(gpu).unwrap();
        let stream = gpu.context().new_stream().unwrap();
        let cap = StepCapacity {
            max_batch: 8,
            max_blocks_per_seq: 80,
            max_splits: 8,
        };
        let mut step = attn.graph_step(gpu, &stream, cap, &s.params).unwrap();
        let check = |what: &str, padded: &PaddedTables, q: &[f32], step: &_| {
            let step: &pagedkv::attention::cuda::DecodeGraphStep = step;
            stream.synchronize().unwrap();
            let (d_out, d_lse) = step.outputs();
            let mut out = stream.clone_dtoh(d_out).unwrap();
            let mut lse = stream.clone_dtoh(d_lse).unwrap();
            stream.synchronize().unwrap();
            out.truncate(padded.batch * row);
            lse.truncate(padded.batch * shape.num_q_heads);
            if uses_mma(dtype, group, 128, s.layout.block_size()) {
                if let Err(e) =
                    check_against_reference(&s.host, LAYER, q, padded, &s.params, &out, &lse)
                {
                    panic!("{case:?} {what}: {e}");
                }
            } else {
                let want = paged_decode_reference(&s.host, LAYER, q, padded, &s.params).unwrap();
                compare(&format!("{case:?} {what} out"), &out, &want.out);
                compare(&format!("{case:?} {what} lse"), &lse, &want.lse);
            }
        };
        // Step 1, captured: three sequences (an empty one, a short one, the longest).
        let rows_a = [6, 1, 7];
        let tables_a = sub_batch(&s, &rows_a);
        let q_a: Vec<f32> = rows_a
            .iter()
            .flat_map(|&r| s.q[r * row..(r + 1) * row].iter().map(|x| -0.5 * x))
            .collect();
        step.stage(gpu, &tables_a).unwrap();
        step.stage_queries(&q_a).unwrap();
        step.capture(gpu, &[LAYER], true).unwrap();
        step.replay(gpu).unwrap();
        check("replay 1", &tables_a, &q_a, &step);
        // Step 2: the whole batch with other queries, written into the same staging;
        // the same graph runs it (another batch size, another split plan).
        let staged = step.stage(gpu, &s.padded).unwrap();
        assert_eq!(staged.batch, 8);
        step.stage_queries(&s.q).unwrap();
        step.replay(gpu).unwrap();
        check("replay 2", &s.padded, &s.q, &step);
        // Over capacity: a typed error, the staged step unchanged, replay still right.
        let nine = sub_batch(&s, &[0, 1, 2, 3, 4, 5, 6, 7, 0]);
        assert!(step.stage(gpu, &nine).is_err());
        assert_eq!(step.staged(), staged);
        step.replay(gpu).unwrap();
        check("replay 3 after a refused stage", &s.padded, &s.q, &step);
        // The uncaptured enqueue path gives the same bits as the replay.
        let (o1, _) = step.outputs();
        let replayed = stream.clone_dtoh(o1).unwrap();
        step.enqueue_upload().unwrap();
        step.enqueue_upload_queries().unwrap();
        step.enqueue_decode(gpu, LAYER).unwrap();
        stream.synchronize().unwrap();
        let direct = stream.clone_dtoh(step.outputs().0).unwrap();
        stream.synchronize().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&direct),
            bits(&replayed),
            "{case:?}: enqueue vs replay"
        );
    }
}
