//! Paged attention against the f64 reference, CoW/sharing, the contiguous baselines, the
//! tiny model under both allocators, and the typed errors.
//!
//! Tolerances (fast path vs the f64 reference computed on the *stored* values, so the
//! only error is f32 accumulation; the fp8 dequantisation `code * scale` rounds once in
//! f32):
//!
//! | dtype | abs | rel |
//! |---|---|---|
//! | f32  | 2e-5 | 2e-5 |
//! | f16  | 2e-5 | 2e-5 |
//! | bf16 | 2e-5 | 2e-5 |
//! | fp8  | 3e-5 | 3e-5 |
//!
//! Against the *original* f32 data (quantisation error included), see `QUANT_TOL`.

use pagedkv::attention::cpu::{
    contiguous_decode, num_splits, paged_decode, paged_decode_split, paged_prefill,
    plan_split_tokens, reshape_and_cache, ContiguousKv,
};
use pagedkv::attention::model::{SplitMix64, TinyModel};
use pagedkv::attention::reference::{paged_decode_reference, paged_prefill_reference};
use pagedkv::attention::{alibi_slopes, AttentionParams, DecodeOutput};
use pagedkv::baseline::{CacheAllocator, ContiguousCache};
use pagedkv::layout::Slot;
use pagedkv::tables::PaddedTables;
use pagedkv::{
    BlockId, CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape,
    SeqId, Storage,
};

const BS: usize = 16;

fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => (2e-5, 2e-5),
        DType::Fp8E4M3 => (3e-5, 3e-5),
    }
}

fn shape(q: usize, kv: usize, d: usize, dtype: DType) -> ModelShape {
    ModelShape {
        num_layers: 2,
        num_q_heads: q,
        num_kv_heads: kv,
        head_dim: d,
        kv_dtype: dtype,
    }
}

/// The NaN pattern of a dtype, as the bytes of one element.
fn nan_bytes(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => f32::NAN.to_le_bytes().to_vec(),
        DType::F16 => 0x7e00u16.to_le_bytes().to_vec(),
        DType::BF16 => 0x7fc0u16.to_le_bytes().to_vec(),
        DType::Fp8E4M3 => vec![0x7f],
    }
}

/// An arena whose every element is NaN until written.
fn poisoned(layout: KvLayout, num_blocks: usize) -> HostStorage {
    let mut st = HostStorage::new(layout, num_blocks).unwrap();
    let nan = nan_bytes(layout.dtype());
    for layer in 0..layout.num_layers() {
        for c in st.region_mut(layer).chunks_exact_mut(nan.len()) {
            c.copy_from_slice(&nan);
        }
    }
    st
}

fn randv(rng: &mut SplitMix64, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(a)).collect()
}

fn shuffle<T>(rng: &mut SplitMix64, v: &mut [T]) {
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
}

/// A batch over a poisoned arena: permuted block ids, `shared` full blocks aliased by
/// every sequence long enough, random K/V written through `reshape_and_cache` for every
/// live token, NaN everywhere else (tails of last pages included).
struct Case {
    storage: HostStorage,
    tables: PaddedTables,
    /// The f32 values written, per layer, per sequence, `[ctx, kv_heads, d]` (K, V); for
    /// aliased blocks, the last write wins in the arena, and these hold what was written
    /// for this sequence.
    written: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
}

fn build_case(
    rng: &mut SplitMix64,
    shape: ModelShape,
    ctxs: &[usize],
    shared: usize,
    params: &AttentionParams,
) -> Case {
    let layout = KvLayout::new(shape, BS).unwrap();
    let private: usize = ctxs
        .iter()
        .map(|&c| {
            layout
                .blocks_for_tokens(c)
                .saturating_sub(if c > shared * BS { shared } else { 0 })
        })
        .sum();
    let num_blocks = shared + private + 7;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    shuffle(rng, &mut ids);
    let (shared_ids, mut rest) = (ids[..shared].to_vec(), ids[shared..].iter().copied());
    let max_blocks = ctxs
        .iter()
        .map(|&c| layout.blocks_for_tokens(c))
        .max()
        .unwrap_or(0)
        + 1;
    let mut tables = PaddedTables {
        tables: vec![0; ctxs.len() * max_blocks],
        context_lens: ctxs.iter().map(|&c| c as u32).collect(),
        batch: ctxs.len(),
        max_blocks,
    };
    for (i, &c) in ctxs.iter().enumerate() {
        let need = layout.blocks_for_tokens(c);
        for j in 0..need {
            let b = match shared_ids.get(j) {
                Some(&b) if c > shared * BS => b,
                _ => rest.next().unwrap(),
            };
            tables.tables[i * max_blocks + j] = b;
        }
        // Padding past the last block points at a poisoned block, as garbage would.
        for j in need..max_blocks {
            tables.tables[i * max_blocks + j] = *ids.last().unwrap();
        }
    }
    let mut storage = poisoned(layout, num_blocks);
    let (kvh, d) = (shape.num_kv_heads, shape.head_dim);
    let mut written = Vec::new();
    for layer in 0..shape.num_layers {
        let mut per_seq = Vec::new();
        for (i, &c) in ctxs.iter().enumerate() {
            let k = randv(rng, c * kvh * d, 1.0);
            let v = randv(rng, c * kvh * d, 1.0);
            let row = tables.row(i);
            let slots: Vec<Slot> = (0..c)
                .map(|p| layout.slot(BlockId(row[p / BS]), p % BS))
                .collect();
            reshape_and_cache(
                &mut storage,
                layer,
                &slots,
                &k,
                &v,
                params.k_scale,
                params.v_scale,
            )
            .unwrap();
            per_seq.push((k, v));
        }
        written.push(per_seq);
    }
    Case {
        storage,
        tables,
        written,
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f64], (abs, rel): (f64, f64)) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "{what}[{i}]");
            continue;
        }
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= abs + rel * w.abs(),
            "{what}[{i}]: got {g}, want {w} (err {err:.3e})"
        );
        worst = worst.max(err);
    }
}

fn fast_decode(
    case: &Case,
    layer: usize,
    q: &[f32],
    params: &AttentionParams,
    split: Option<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let s = case.storage.layout().shape();
    let mut out = vec![f32::NAN; q.len()];
    let mut lse = vec![f32::NAN; case.tables.batch * s.num_q_heads];
    match split {
        Some(sp) => paged_decode_split(
            &case.storage,
            layer,
            q,
            &case.tables,
            params,
            sp,
            &mut out,
            Some(&mut lse),
        )
        .unwrap(),
        None => paged_decode(
            &case.storage,
            layer,
            q,
            &case.tables,
            params,
            &mut out,
            Some(&mut lse),
        )
        .unwrap(),
    }
    (out, lse)
}

fn check_decode(
    case: &Case,
    q: &[f32],
    params: &AttentionParams,
    splits: &[Option<usize>],
) -> DecodeOutput {
    let dtype = case.storage.layout().dtype();
    // The last layer: its region is not the first, so a kernel that ignores `layer` fails.
    let layers = case.storage.layout().num_layers();
    let mut last = None;
    for layer in layers - 1..layers {
        let want = paged_decode_reference(&case.storage, layer, q, &case.tables, params).unwrap();
        assert!(
            want.out.iter().all(|x| x.is_finite()),
            "reference read a poisoned slot"
        );
        for &sp in splits {
            let (out, lse) = fast_decode(case, layer, q, params, sp);
            let tag = format!("{dtype} layer {layer} split {sp:?}");
            assert_close(&format!("{tag} out"), &out, &want.out, tol(dtype));
            assert_close(&format!("{tag} lse"), &lse, &want.lse, tol(dtype));
        }
        last = Some(want);
    }
    last.unwrap()
}

/// Context lengths around the block size, a split boundary (64) and one long context.
const CTXS: [usize; 9] = [1, BS - 1, BS, BS + 1, 63, 64, 65, 0, 450];

#[test]
fn decode_matches_reference_over_dtypes_groups_and_head_dims() {
    let mut rng = SplitMix64::new(1);
    for dtype in DType::ALL {
        for (q, kv) in [(2, 2), (8, 2), (8, 1)] {
            for d in [64, 128] {
                if d == 128 && q == 2 {
                    continue; // keep debug builds fast; d = 128 still runs with groups 4 and 8
                }
                let mut params = AttentionParams::new(d);
                if dtype == DType::Fp8E4M3 {
                    params.k_scale = 0.05;
                    params.v_scale = 0.02;
                }
                let case = build_case(&mut rng, shape(q, kv, d, dtype), &CTXS, 2, &params);
                let qv = randv(&mut rng, CTXS.len() * q * d, 1.0);
                check_decode(&case, &qv, &params, &[None, Some(64), Some(usize::MAX)]);
            }
        }
    }
}

#[test]
fn alibi_and_sliding_window_match_reference() {
    let mut rng = SplitMix64::new(2);
    for dtype in [DType::F32, DType::BF16, DType::Fp8E4M3] {
        let (q, kv, d) = (8, 2, 64);
        for (alibi, window) in [
            (true, None),
            (false, Some(1)),
            (false, Some(20)),
            (true, Some(100)),
        ] {
            let mut params = AttentionParams::new(d);
            if alibi {
                params.alibi_slopes = Some(alibi_slopes(q));
            }
            params.sliding_window = window;
            let case = build_case(&mut rng, shape(q, kv, d, dtype), &CTXS, 1, &params);
            let qv = randv(&mut rng, CTXS.len() * q * d, 2.0);
            check_decode(&case, &qv, &params, &[None, Some(16), Some(33)]);
        }
    }
}

/// One query head's attention, in `f64`, over the keys a sliding window of `window`
/// tokens lets a query at position `p` see, written from the definition and not from
/// [`AttentionParams::window_start`]: the `window` most recent positions, the query's
/// own included, i.e. keys `t` with `t <= p` and `p - t < window` (the crate's
/// documented rule, "the last `w` tokens, the query's own position included"; vLLM's
/// convention, which passes FlashAttention `window_size = (w - 1, 0)`, and Hugging
/// Face Mistral's mask `q_idx - kv_idx < sliding_window`). `k` and `v` are one
/// sequence's `[ctx, kv_heads, d]` values; ALiBi adds `slope * (t - p)`.
#[allow(clippy::too_many_arguments)]
fn windowed_attention(
    (k, v): (&[f32], &[f32]),
    (kv_heads, d, kv_head): (usize, usize, usize),
    q: &[f32],
    p: usize,
    window: Option<usize>,
    scale: f64,
    slope: f64,
) -> Vec<f64> {
    let seen: Vec<usize> = (0..=p)
        .filter(|&t| window.is_none_or(|w| p - t < w))
        .collect();
    let at = |x: &[f32], t: usize, i: usize| f64::from(x[(t * kv_heads + kv_head) * d + i]);
    let logits: Vec<f64> = seen
        .iter()
        .map(|&t| {
            let dot: f64 = (0..d).map(|i| f64::from(q[i]) * at(k, t, i)).sum();
            dot * scale + slope * (t as f64 - p as f64)
        })
        .collect();
    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
    let sum: f64 = weights.iter().sum();
    (0..d)
        .map(|i| {
            seen.iter()
                .zip(&weights)
                .map(|(&t, w)| w / sum * at(v, t, i))
                .sum()
        })
        .collect()
}

/// The sliding window checked against a rule written in this test
/// ([`windowed_attention`]), not against the crate's reference (which shares
/// `window_start` with the kernels, so a window one token too wide in both passes
/// every comparison between them). f32, so the stored values are the written ones;
/// windows around the block size and the context lengths; decode and prefill, the
/// fast CPU kernels and the f64 reference both.
#[test]
fn sliding_window_attends_to_exactly_the_last_w_positions() {
    let mut rng = SplitMix64::new(11);
    let (qh, kvh, d) = (4, 2, 16);
    let group = qh / kvh;
    for window in [1, 2, 15, 16, 17, 63] {
        for alibi in [false, true] {
            let mut params = AttentionParams::new(d);
            params.sliding_window = Some(window);
            if alibi {
                params.alibi_slopes = Some(alibi_slopes(qh));
            }
            let scale = f64::from(params.scale);
            // The expected output of every head of every query `(token row, sequence,
            // position)` of `at`, from the window rule above (not the crate's
            // `window_start`); rows not in `at` stay 0.
            type At = [(usize, usize, usize)];
            let expect = |written: &[(Vec<f32>, Vec<f32>)], at: &At, qv: &[f32]| {
                let mut want = vec![0.0f64; qv.len()];
                for &(tok, i, pos) in at {
                    let (k, v) = &written[i];
                    for h in 0..qh {
                        let row = (tok * qh + h) * d..(tok * qh + h + 1) * d;
                        want[row.clone()].copy_from_slice(&windowed_attention(
                            (k, v),
                            (kvh, d, h / group),
                            &qv[row],
                            pos,
                            Some(window),
                            scale,
                            f64::from(params.slope(h)),
                        ));
                    }
                }
                want
            };
            // The fast kernel and the f64 reference both against it.
            let check = |what: &str, fast: &[f32], reference: &[f64], want: &[f64]| {
                let tag = format!("{what} window {window} alibi {alibi}");
                assert_close(&tag, fast, want, tol(DType::F32));
                let reference: Vec<f32> = reference.iter().map(|&x| x as f32).collect();
                assert_close(
                    &format!("{tag} reference"),
                    &reference,
                    want,
                    tol(DType::F32),
                );
            };
            // Decode: the query sits at the last context position. No shared blocks:
            // `written` then holds what the arena holds.
            let case = build_case(&mut rng, shape(qh, kvh, d, DType::F32), &CTXS, 0, &params);
            let layer = 1;
            let qv = randv(&mut rng, CTXS.len() * qh * d, 2.0);
            let (fast, _) = fast_decode(&case, layer, &qv, &params, None);
            let reference =
                paged_decode_reference(&case.storage, layer, &qv, &case.tables, &params).unwrap();
            let at: Vec<_> = CTXS
                .iter()
                .enumerate()
                .filter(|(_, &c)| c > 0)
                .map(|(i, &c)| (i, i, c - 1))
                .collect();
            let want = expect(&case.written[layer], &at, &qv);
            check("decode", &fast, &reference.out, &want);

            // Prefill: query j of n new tokens sits at position ctx - n + j.
            let seqs = [(40usize, 40usize), (100, 17), (5, 1), (33, 2)];
            let ctxs: Vec<usize> = seqs.iter().map(|s| s.0).collect();
            let case = build_case(&mut rng, shape(qh, kvh, d, DType::F32), &ctxs, 0, &params);
            let mut qsl = vec![0];
            for s in &seqs {
                qsl.push(qsl.last().unwrap() + s.1);
            }
            let tokens = *qsl.last().unwrap();
            let qv = randv(&mut rng, tokens * qh * d, 2.0);
            let mut fast = vec![f32::NAN; qv.len()];
            paged_prefill(
                &case.storage,
                layer,
                &qv,
                &qsl,
                &case.tables,
                &params,
                None,
                &mut fast,
                None,
            )
            .unwrap();
            let reference =
                paged_prefill_reference(&case.storage, layer, &qv, &qsl, &case.tables, &params)
                    .unwrap();
            let at: Vec<_> = seqs
                .iter()
                .enumerate()
                .flat_map(|(i, &(ctx, n))| {
                    let first = qsl[i];
                    (0..n).map(move |j| (first + j, i, ctx - n + j))
                })
                .collect();
            let want = expect(&case.written[layer], &at, &qv);
            check("prefill", &fast, &reference.out, &want);
        }
    }
}

#[test]
fn every_split_count_gives_the_same_result() {
    let mut rng = SplitMix64::new(3);
    let d = 64;
    let params = AttentionParams {
        alibi_slopes: Some(alibi_slopes(8)),
        ..AttentionParams::new(d)
    };
    let ctxs = [300, 17, 1, 256];
    let case = build_case(&mut rng, shape(8, 1, d, DType::BF16), &ctxs, 3, &params);
    let qv = randv(&mut rng, ctxs.len() * 8 * d, 1.0);
    let (base, base_lse) = fast_decode(&case, 0, &qv, &params, Some(usize::MAX));
    for sp in [1, 5, 15, 16, 17, 64, 100, 255, 256, 257, 299, 300, 301] {
        assert!(num_splits(0, 300, sp) >= 1);
        let (out, lse) = fast_decode(&case, 0, &qv, &params, Some(sp));
        let want: Vec<f64> = base.iter().map(|&x| f64::from(x)).collect();
        let want_lse: Vec<f64> = base_lse.iter().map(|&x| f64::from(x)).collect();
        assert_close(&format!("split {sp}"), &out, &want, (1e-5, 1e-5));
        assert_close(&format!("split {sp} lse"), &lse, &want_lse, (1e-5, 1e-5));
    }
    // The planner's choice for this batch on any thread count.
    for threads in [1, 2, 8, 64, 256] {
        let sp = plan_split_tokens(&case.tables.context_lens, 1, BS, threads);
        let (out, _) = fast_decode(&case, 0, &qv, &params, Some(sp));
        let want: Vec<f64> = base.iter().map(|&x| f64::from(x)).collect();
        assert_close(&format!("planned split {sp}"), &out, &want, (1e-5, 1e-5));
    }
}

#[test]
fn aliased_and_repeated_blocks_read_what_is_stored() {
    // One table uses the same physical block twice; another shares it.
    let mut rng = SplitMix64::new(4);
    let (q, kv, d) = (4, 1, 64);
    let layout = KvLayout::new(shape(q, kv, d, DType::F16), BS).unwrap();
    let mut st = poisoned(layout, 6);
    for layer in 0..2 {
        let slots: Vec<Slot> = (0..6 * BS as u64).map(Slot).collect();
        let k = randv(&mut rng, slots.len() * kv * d, 1.0);
        let v = randv(&mut rng, slots.len() * kv * d, 1.0);
        reshape_and_cache(&mut st, layer, &slots, &k, &v, 1.0, 1.0).unwrap();
    }
    let tables = PaddedTables {
        tables: vec![3, 3, 5, 0, 5, 3, 1, 1],
        context_lens: vec![40, 64],
        batch: 2,
        max_blocks: 4,
    };
    let params = AttentionParams::new(d);
    let qv = randv(&mut rng, 2 * q * d, 1.0);
    let case = Case {
        storage: st,
        tables,
        written: Vec::new(),
    };
    check_decode(&case, &qv, &params, &[None, Some(16), Some(20)]);
}

#[test]
fn quantisation_error_against_the_original_values_is_bounded() {
    // (abs, rel) of the output against f64 attention over the unquantised f32 inputs.
    const QUANT_TOL: [(DType, f64, f64); 4] = [
        (DType::F32, 2e-5, 2e-5),
        (DType::F16, 2e-3, 1e-2),
        (DType::BF16, 1e-2, 5e-2),
        (DType::Fp8E4M3, 8e-2, 2e-1),
    ];
    let mut rng = SplitMix64::new(5);
    let (q, kv, d) = (8, 2, 64);
    let ctxs = [1, 17, 100];
    for (dtype, abs, rel) in QUANT_TOL {
        let mut params = AttentionParams::new(d);
        if dtype == DType::Fp8E4M3 {
            params.k_scale = 1.0 / 64.0;
            params.v_scale = 1.0 / 64.0;
        }
        let seed = rng.next_u64();
        let case = build_case(
            &mut SplitMix64::new(seed),
            shape(q, kv, d, dtype),
            &ctxs,
            0,
            &params,
        );
        let exact = build_case(
            &mut SplitMix64::new(seed),
            shape(q, kv, d, DType::F32),
            &ctxs,
            0,
            &AttentionParams::new(d),
        );
        assert_eq!(case.written[0][2].0, exact.written[0][2].0);
        let qv = randv(&mut rng, ctxs.len() * q * d, 1.0);
        let want = paged_decode_reference(
            &exact.storage,
            0,
            &qv,
            &exact.tables,
            &AttentionParams::new(d),
        )
        .unwrap();
        let (out, _) = fast_decode(&case, 0, &qv, &params, None);
        assert_close(&format!("{dtype} vs original"), &out, &want.out, (abs, rel));
    }
}

#[test]
fn prefill_matches_reference_and_decode_bit_for_bit() {
    let mut rng = SplitMix64::new(6);
    for dtype in [DType::F32, DType::BF16, DType::Fp8E4M3] {
        let (q, kv, d) = (8, 2, 64);
        for (alibi, window) in [(false, None), (true, Some(24))] {
            let mut params = AttentionParams::new(d);
            if alibi {
                params.alibi_slopes = Some(alibi_slopes(q));
            }
            params.sliding_window = window;
            // (context, new tokens): a full prompt, a chunk after a prefix, one token, none.
            let seqs = [(40usize, 40usize), (100, 17), (5, 1), (0, 0), (33, 2)];
            let ctxs: Vec<usize> = seqs.iter().map(|s| s.0).collect();
            let case = build_case(&mut rng, shape(q, kv, d, dtype), &ctxs, 0, &params);
            let mut qsl = vec![0];
            for s in &seqs {
                qsl.push(qsl.last().unwrap() + s.1);
            }
            let tokens = *qsl.last().unwrap();
            let qv = randv(&mut rng, tokens * q * d, 1.0);
            let want = paged_prefill_reference(&case.storage, 1, &qv, &qsl, &case.tables, &params)
                .unwrap();
            for sp in [None, Some(16), Some(32), Some(7)] {
                let mut out = vec![f32::NAN; qv.len()];
                let mut lse = vec![f32::NAN; tokens * q];
                paged_prefill(
                    &case.storage,
                    1,
                    &qv,
                    &qsl,
                    &case.tables,
                    &params,
                    sp,
                    &mut out,
                    Some(&mut lse),
                )
                .unwrap();
                assert_close(
                    &format!("{dtype} prefill split {sp:?}"),
                    &out,
                    &want.out,
                    tol(dtype),
                );
                assert_close(
                    &format!("{dtype} prefill lse split {sp:?}"),
                    &lse,
                    &want.lse,
                    tol(dtype),
                );

                // The last query token of each sequence decoded alone gives the same bits.
                let dec_q: Vec<f32> = (0..seqs.len())
                    .flat_map(|i| {
                        let t = if qsl[i + 1] > qsl[i] {
                            qsl[i + 1] - 1
                        } else {
                            0
                        };
                        qv[t * q * d..(t + 1) * q * d].to_vec()
                    })
                    .collect();
                let (dout, dlse) =
                    fast_decode(&case, 1, &dec_q, &params, Some(sp.unwrap_or(usize::MAX)));
                for i in 0..seqs.len() {
                    if qsl[i + 1] == qsl[i] {
                        continue;
                    }
                    let t = qsl[i + 1] - 1;
                    assert_eq!(
                        &dout[i * q * d..(i + 1) * q * d],
                        &out[t * q * d..(t + 1) * q * d]
                    );
                    assert_eq!(&dlse[i * q..(i + 1) * q], &lse[t * q..(t + 1) * q]);
                }
            }
        }
    }
}

#[test]
fn contiguous_baselines_match_paged_bit_for_bit() {
    let mut rng = SplitMix64::new(7);
    let (q, kv, d) = (8, 2, 64);
    let ctxs = [200usize, 1, 16, 33];
    let max_len = 256;
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::Fp8E4M3] {
        let sh = shape(q, kv, d, dtype);
        let layout = KvLayout::new(sh, BS).unwrap();
        let params = AttentionParams {
            alibi_slopes: Some(alibi_slopes(q)),
            k_scale: 0.1,
            v_scale: 0.1,
            ..AttentionParams::new(d)
        };
        // The same tokens through the paged manager and through contiguous reservations.
        let mut paged = KvCache::new(layout, CacheConfig::new(128)).unwrap();
        let mut contig = ContiguousCache::new(layout, 128, max_len).unwrap();
        let mut st_p = poisoned(layout, 128);
        let mut st_c = poisoned(layout, 128);
        // Fragment the paged arena first so its tables are not consecutive.
        let mut slots = Vec::new();
        for i in 0..6 {
            paged.admit(SeqId(100 + i), 20, &mut slots).unwrap();
        }
        for i in [0, 2, 4] {
            paged.free(SeqId(100 + i)).unwrap();
        }
        let mut tensor_k = vec![0u8; ctxs.len() * max_len * kv * d * dtype.size_bytes()];
        let mut tensor_v = tensor_k.clone();
        for (i, &c) in ctxs.iter().enumerate() {
            let k = randv(&mut rng, c * kv * d, 1.0);
            let v = randv(&mut rng, c * kv * d, 1.0);
            for (alloc, st) in [
                (&mut paged as &mut dyn CacheAllocator, &mut st_p),
                (&mut contig as &mut dyn CacheAllocator, &mut st_c),
            ] {
                alloc.admit(SeqId(i as u64), c, &mut slots).unwrap();
                reshape_and_cache(st, 0, &slots, &k, &v, params.k_scale, params.v_scale).unwrap();
            }
            let at = i * max_len * kv * d * dtype.size_bytes();
            let n = c * kv * d * dtype.size_bytes();
            pagedkv::layout::convert::encode(dtype, &k, params.k_scale, &mut tensor_k[at..at + n])
                .unwrap();
            pagedkv::layout::convert::encode(dtype, &v, params.v_scale, &mut tensor_v[at..at + n])
                .unwrap();
        }
        let seqs: Vec<SeqId> = (0..ctxs.len() as u64).map(SeqId).collect();
        let mut tp = PaddedTables::default();
        paged.fill_padded(&seqs, &mut tp).unwrap();
        let tc = padded(&contig, &seqs);
        assert_ne!(tp.tables, tc.tables);
        let qv = randv(&mut rng, ctxs.len() * q * d, 1.0);
        for sp in [usize::MAX, 64] {
            let mut a = vec![0f32; qv.len()];
            let mut b = vec![0f32; qv.len()];
            let mut c = vec![0f32; qv.len()];
            paged_decode_split(&st_p, 0, &qv, &tp, &params, sp, &mut a, None).unwrap();
            paged_decode_split(&st_c, 0, &qv, &tc, &params, sp, &mut b, None).unwrap();
            let kvt = ContiguousKv {
                k: &tensor_k,
                v: &tensor_v,
                dtype,
                batch: ctxs.len(),
                max_tokens: max_len,
                num_kv_heads: kv,
                head_dim: d,
            };
            contiguous_decode(
                &kvt,
                q,
                &qv,
                &tp.context_lens,
                &params,
                Some(sp),
                &mut c,
                None,
            )
            .unwrap();
            assert_eq!(a, b, "{dtype}: paged vs contiguous reservation");
            assert_eq!(a, c, "{dtype}: paged vs contiguous tensor");
            assert!(a.iter().all(|x| x.is_finite()));
        }
    }
}

fn padded(alloc: &dyn CacheAllocator, seqs: &[SeqId]) -> PaddedTables {
    let max_blocks = seqs
        .iter()
        .map(|&s| alloc.block_table(s).unwrap().len())
        .max()
        .unwrap_or(0);
    let mut t = PaddedTables {
        tables: vec![0; seqs.len() * max_blocks],
        context_lens: Vec::new(),
        batch: seqs.len(),
        max_blocks,
    };
    for (i, &s) in seqs.iter().enumerate() {
        for (j, b) in alloc.block_table(s).unwrap().iter().enumerate() {
            t.tables[i * max_blocks + j] = b.0;
        }
        t.context_lens.push(alloc.num_tokens(s).unwrap() as u32);
    }
    t
}

#[test]
fn fork_cow_and_shared_blocks_equal_an_unshared_copy() {
    let mut rng = SplitMix64::new(8);
    let (q, kv, d) = (8, 2, 64);
    let sh = shape(q, kv, d, DType::BF16);
    let layout = KvLayout::new(sh, BS).unwrap();
    let params = AttentionParams::new(d);
    let prompt = 37;
    let tok =
        |rng: &mut SplitMix64, n: usize| (randv(rng, n * kv * d, 1.0), randv(rng, n * kv * d, 1.0));
    let prompt_kv: Vec<_> = (0..2).map(|_| tok(&mut rng, prompt)).collect();
    // Shared: A with the prompt, forked into B and C; each appends its own token.
    let mut m = KvCache::new(layout, CacheConfig::new(32)).unwrap();
    let mut st = poisoned(layout, 32);
    let mut slots = Vec::new();
    m.admit(SeqId(0), prompt, &mut slots).unwrap();
    for (layer, (k, v)) in prompt_kv.iter().enumerate() {
        reshape_and_cache(&mut st, layer, &slots, k, v, 1.0, 1.0).unwrap();
    }
    m.fork(SeqId(0), SeqId(1)).unwrap();
    m.fork(SeqId(0), SeqId(2)).unwrap();
    let new_kv: Vec<Vec<_>> = (0..3)
        .map(|_| (0..2).map(|_| tok(&mut rng, 1)).collect())
        .collect();
    let mut copies_total = 0;
    for s in 0..3u64 {
        let mut copies = CopyPlan::new();
        m.append(SeqId(s), 1, &mut slots, &mut copies).unwrap();
        copies_total += copies.len();
        st.copy_blocks(&copies).unwrap();
        for (layer, (k, v)) in new_kv[s as usize].iter().enumerate() {
            reshape_and_cache(&mut st, layer, &slots, k, v, 1.0, 1.0).unwrap();
        }
    }
    assert_eq!(
        copies_total, 2,
        "two copy-on-writes of the shared last block"
    );
    // Unshared: three independent sequences with the same tokens.
    let mut u = KvCache::new(layout, CacheConfig::new(32)).unwrap();
    let mut su = poisoned(layout, 32);
    for s in 0..3u64 {
        u.admit(SeqId(s), prompt + 1, &mut slots).unwrap();
        for layer in 0..2 {
            let (mut k, mut v) = prompt_kv[layer].clone();
            k.extend_from_slice(&new_kv[s as usize][layer].0);
            v.extend_from_slice(&new_kv[s as usize][layer].1);
            reshape_and_cache(&mut su, layer, &slots, &k, &v, 1.0, 1.0).unwrap();
        }
    }
    let seqs = [SeqId(0), SeqId(1), SeqId(2)];
    let (mut ts, mut tu) = (PaddedTables::default(), PaddedTables::default());
    m.fill_padded(&seqs, &mut ts).unwrap();
    u.fill_padded(&seqs, &mut tu).unwrap();
    assert_eq!(
        ts.tables[0], ts.tables[ts.max_blocks],
        "the first block is shared"
    );
    let qv = randv(&mut rng, 3 * q * d, 1.0);
    for layer in 0..2 {
        for sp in [usize::MAX, 16] {
            let mut a = vec![0f32; qv.len()];
            let mut b = vec![0f32; qv.len()];
            paged_decode_split(&st, layer, &qv, &ts, &params, sp, &mut a, None).unwrap();
            paged_decode_split(&su, layer, &qv, &tu, &params, sp, &mut b, None).unwrap();
            assert_eq!(a, b);
        }
        let ra = paged_decode_reference(&st, layer, &qv, &ts, &params).unwrap();
        let rb = paged_decode_reference(&su, layer, &qv, &tu, &params).unwrap();
        assert_eq!(ra, rb);
        // And the three sequences really differ (their last tokens do).
        assert_ne!(ra.out[..q * d], ra.out[q * d..2 * q * d]);
    }
}

/// Runs requests through the model under one allocator with a given schedule: at most
/// `max_batch` sequences at once, prompts prefilled `chunk` tokens per step.
fn serve(
    model: &TinyModel,
    alloc: &mut dyn CacheAllocator,
    storage: &mut HostStorage,
    requests: &[(usize, usize)],
    max_batch: usize,
    chunk: usize,
) -> Vec<(Vec<u32>, Vec<f32>)> {
    let h = model.hidden_size();
    let mut results = vec![(Vec::new(), Vec::new()); requests.len()];
    let mut slots = Vec::new();
    let mut copies = CopyPlan::new();
    for group in (0..requests.len()).collect::<Vec<_>>().chunks(max_batch) {
        // Prefill in chunks, one sequence at a time per call but several per batch.
        let mut done = vec![0usize; requests.len()];
        let mut last_hidden = vec![vec![0f32; h]; requests.len()];
        loop {
            let active: Vec<usize> = group
                .iter()
                .copied()
                .filter(|&r| done[r] < requests[r].0)
                .collect();
            if active.is_empty() {
                break;
            }
            let mut qsl = vec![0];
            let mut toks = Vec::new();
            for &r in &active {
                let n = chunk.min(requests[r].0 - done[r]);
                let prompt = model.prompt_tokens(r as u64, requests[r].0);
                if done[r] == 0 {
                    alloc.admit(SeqId(r as u64), n, &mut slots).unwrap();
                } else {
                    copies.clear();
                    alloc
                        .append(SeqId(r as u64), n, &mut slots, &mut copies)
                        .unwrap();
                    storage.copy_blocks(&copies).unwrap();
                }
                toks.extend_from_slice(&prompt[done[r]..done[r] + n]);
                qsl.push(qsl.last().unwrap() + n);
                done[r] += n;
            }
            let seqs: Vec<SeqId> = active.iter().map(|&r| SeqId(r as u64)).collect();
            let tables = padded(alloc, &seqs);
            let mut y = vec![0f32; toks.len() * h];
            model
                .prefill_tokens(storage, &tables, &qsl, &toks, &mut y)
                .unwrap();
            for (i, &r) in active.iter().enumerate() {
                last_hidden[r].copy_from_slice(&y[(qsl[i + 1] - 1) * h..qsl[i + 1] * h]);
            }
        }
        for &r in group {
            results[r].0.push(model.next_tokens(&last_hidden[r])[0]);
        }
        // Decode.
        let max_steps = group.iter().map(|&r| requests[r].1).max().unwrap_or(0);
        for step in 0..max_steps {
            let active: Vec<usize> = group
                .iter()
                .copied()
                .filter(|&r| step < requests[r].1)
                .collect();
            for &r in &active {
                copies.clear();
                alloc
                    .append(SeqId(r as u64), 1, &mut slots, &mut copies)
                    .unwrap();
                storage.copy_blocks(&copies).unwrap();
            }
            let seqs: Vec<SeqId> = active.iter().map(|&r| SeqId(r as u64)).collect();
            let tables = padded(alloc, &seqs);
            let toks: Vec<u32> = active
                .iter()
                .map(|&r| *results[r].0.last().unwrap())
                .collect();
            let mut y = vec![0f32; toks.len() * h];
            let next = model
                .decode_tokens(storage, &tables, &toks, &mut y)
                .unwrap();
            for (i, &r) in active.iter().enumerate() {
                results[r].0.push(next[i]);
                results[r].1 = y[i * h..(i + 1) * h].to_vec();
            }
        }
        for &r in group {
            alloc.free(SeqId(r as u64)).unwrap();
        }
    }
    results
}

#[test]
fn tiny_model_agrees_under_paged_and_contiguous_allocation() {
    for dtype in [DType::F32, DType::Fp8E4M3] {
        let sh = ModelShape {
            num_layers: 2,
            num_q_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            kv_dtype: dtype,
        };
        let model = TinyModel::with_dims(sh, 64, 256, 42).unwrap();
        let layout = KvLayout::new(sh, BS).unwrap();
        let mut rng = SplitMix64::new(9);
        let requests: Vec<(usize, usize)> = (0..8)
            .map(|_| (1 + rng.below(50) as usize, 1 + rng.below(12) as usize))
            .collect();
        let mut paged = KvCache::new(layout, CacheConfig::new(200)).unwrap();
        let mut sp = poisoned(layout, 200);
        let a = serve(&model, &mut paged, &mut sp, &requests, 8, 64);
        let mut contig = ContiguousCache::new(layout, 200, 96).unwrap();
        let mut sc = poisoned(layout, 200);
        let b = serve(&model, &mut contig, &mut sc, &requests, 3, 7);
        for (r, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x.0, y.0, "{dtype} request {r}: tokens");
            for (u, v) in x.1.iter().zip(&y.1) {
                assert!(
                    (u - v).abs() <= 1e-5 * (1.0 + u.abs()),
                    "{dtype} request {r}: {u} vs {v}"
                );
            }
            // In fact the schedule never changes a bit.
            assert_eq!(x.1, y.1);
            assert!(x.1.iter().all(|v| v.is_finite()));
        }
        // The tokens are not trivially constant.
        let distinct: std::collections::HashSet<u32> =
            a.iter().flat_map(|r| r.0.iter().copied()).collect();
        assert!(distinct.len() > 3, "{dtype}: {distinct:?}");
    }
}

#[test]
fn errors_are_typed_and_come_before_any_read_or_write() {
    let mut rng = SplitMix64::new(10);
    let (q, kv, d) = (4, 2, 64);
    let params = AttentionParams::new(d);
    let case = build_case(&mut rng, shape(q, kv, d, DType::F32), &[20, 5], 0, &params);
    let qv = randv(&mut rng, 2 * q * d, 1.0);
    let mut out = vec![0f32; qv.len()];
    let nb = case.storage.num_blocks();

    let decode_err = |t: &PaddedTables, qv: &[f32], p: &AttentionParams, layer: usize| {
        let mut out = vec![0f32; qv.len()];
        let fast = paged_decode(&case.storage, layer, qv, t, p, &mut out, None).unwrap_err();
        let reference = paged_decode_reference(&case.storage, layer, qv, t, p).unwrap_err();
        assert_eq!(fast, reference);
        let qsl = vec![0, 1, 2];
        let mut out = vec![0f32; qv.len()];
        if qv.len() == 2 * q * d {
            let pre = paged_prefill(&case.storage, layer, qv, &qsl, t, p, None, &mut out, None)
                .unwrap_err();
            assert_eq!(pre, fast);
        }
        fast
    };

    // A table entry outside the arena.
    let mut t = case.tables.clone();
    t.tables[1] = nb as u32 + 3;
    assert_eq!(
        decode_err(&t, &qv, &params, 0),
        Error::BlockOutOfRange {
            block: BlockId(nb as u32 + 3),
            num_blocks: nb
        }
    );
    // ...but an out-of-range entry past the context is never read and is fine.
    let mut t = case.tables.clone();
    t.tables[t.max_blocks + 2] = u32::MAX;
    paged_decode(&case.storage, 0, &qv, &t, &params, &mut out, None).unwrap();
    // A context longer than the table covers.
    let mut t = case.tables.clone();
    t.context_lens[1] = (t.max_blocks * BS + 1) as u32;
    assert!(matches!(
        decode_err(&t, &qv, &params, 0),
        Error::CorruptBlockTable(_)
    ));
    // Inconsistent table shapes.
    let mut t = case.tables.clone();
    t.context_lens.pop();
    assert!(matches!(
        decode_err(&t, &qv, &params, 0),
        Error::ShapeMismatch { .. }
    ));
    // Wrong q length, wrong layer.
    assert!(matches!(
        decode_err(&case.tables, &qv[1..], &params, 0),
        Error::ShapeMismatch { .. }
    ));
    assert!(matches!(
        decode_err(&case.tables, &qv, &params, 2),
        Error::ShapeMismatch {
            what: "layer index",
            ..
        }
    ));
    // Bad parameters.
    let p = AttentionParams {
        alibi_slopes: Some(vec![1.0; q + 1]),
        ..params.clone()
    };
    assert!(matches!(
        decode_err(&case.tables, &qv, &p, 0),
        Error::ShapeMismatch { .. }
    ));
    let p = AttentionParams {
        v_scale: 0.0,
        ..params.clone()
    };
    assert!(matches!(
        decode_err(&case.tables, &qv, &p, 0),
        Error::InvalidConfig {
            field: "v_scale",
            ..
        }
    ));
    // Wrong output lengths, split of 0.
    let mut short = vec![0f32; qv.len() - 1];
    assert!(matches!(
        paged_decode(
            &case.storage,
            0,
            &qv,
            &case.tables,
            &params,
            &mut short,
            None
        ),
        Err(Error::ShapeMismatch { .. })
    ));
    let mut lse = vec![0f32; 3];
    assert!(matches!(
        paged_decode(
            &case.storage,
            0,
            &qv,
            &case.tables,
            &params,
            &mut out,
            Some(&mut lse)
        ),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        paged_decode_split(
            &case.storage,
            0,
            &qv,
            &case.tables,
            &params,
            0,
            &mut out,
            None
        ),
        Err(Error::InvalidConfig { .. })
    ));
    // Prefill: bad query_start_loc.
    for qsl in [vec![0, 1], vec![1, 1, 2], vec![0, 2, 1], vec![0, 1, 7]] {
        let r = paged_prefill(
            &case.storage,
            0,
            &qv,
            &qsl,
            &case.tables,
            &params,
            None,
            &mut out,
            None,
        );
        assert!(
            matches!(
                r,
                Err(Error::ShapeMismatch { .. } | Error::InvalidConfig { .. })
            ),
            "{qsl:?}"
        );
    }
    // Heads that do not divide: the shape, the contiguous kernel and the model refuse.
    let bad = shape(6, 4, d, DType::F32);
    assert!(matches!(
        KvLayout::new(bad, BS),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        TinyModel::new(bad, 1),
        Err(Error::InvalidConfig { .. })
    ));
    let bytes = vec![0u8; 4 * 4 * d * 4];
    let kvt = ContiguousKv {
        k: &bytes,
        v: &bytes,
        dtype: DType::F32,
        batch: 1,
        max_tokens: 4,
        num_kv_heads: 4,
        head_dim: d,
    };
    let mut o = vec![0f32; 6 * d];
    assert!(matches!(
        contiguous_decode(
            &kvt,
            6,
            &vec![0.0; 6 * d],
            &[4],
            &params,
            None,
            &mut o,
            None
        ),
        Err(Error::InvalidConfig { .. })
    ));
    let mut o = vec![0f32; 8 * d];
    assert!(matches!(
        contiguous_decode(
            &kvt,
            8,
            &vec![0.0; 8 * d],
            &[5],
            &params,
            None,
            &mut o,
            None
        ),
        Err(Error::TooLong { .. })
    ));

    // reshape_and_cache checks everything before writing a byte.
    let mut st = case.storage.clone();
    let before = st.region(0).to_vec();
    let k = vec![1.0f32; 2 * kv * d];
    let bad_slot = Slot((nb * BS) as u64);
    for (slots, kk, scale) in [
        (vec![Slot(0), bad_slot], &k[..], 1.0),
        (vec![Slot(0), Slot(1)], &k[1..], 1.0),
        (vec![Slot(0), Slot(1)], &k[..], f32::INFINITY),
        (vec![Slot(0), Slot(u64::MAX)], &k[..], 1.0),
    ] {
        let r = reshape_and_cache(&mut st, 0, &slots, kk, &k, scale, 1.0);
        assert!(r.is_err());
        assert_eq!(st.region(0), &before[..]);
    }
    assert!(matches!(
        reshape_and_cache(&mut st, 0, &[Slot(0), bad_slot], &k, &k, 1.0, 1.0),
        Err(Error::BlockOutOfRange { .. })
    ));
    assert!(matches!(
        reshape_and_cache(&mut st, 5, &[Slot(0), Slot(1)], &k, &k, 1.0, 1.0),
        Err(Error::ShapeMismatch { .. })
    ));
}

#[test]
fn empty_contexts_give_zeros_and_negative_infinite_lse() {
    let mut rng = SplitMix64::new(11);
    let (q, kv, d) = (2, 1, 64);
    let params = AttentionParams::new(d);
    let case = build_case(
        &mut rng,
        shape(q, kv, d, DType::BF16),
        &[0, 3, 0],
        0,
        &params,
    );
    let qv = randv(&mut rng, 3 * q * d, 1.0);
    let (out, lse) = fast_decode(&case, 0, &qv, &params, None);
    assert!(out[..q * d].iter().all(|&x| x == 0.0));
    assert!(lse[..q].iter().all(|&x| x == f32::NEG_INFINITY));
    assert!(lse[q..2 * q].iter().all(|x| x.is_finite()));
    check_decode(&case, &qv, &params, &[None]);
}
