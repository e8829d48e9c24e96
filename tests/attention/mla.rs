//! Latent (MLA) caches: slots of a latent layout through `HostStorage`, the absorbed
//! CPU decode against its `f64` reference, and the absorbed form against standard
//! attention over materialised keys and values of a tiny random model, projected back.

use pagedkv::attention::mla::{mla_decode, mla_decode_reference, write_latent, MlaParams};
use pagedkv::attention::model::SplitMix64;
use pagedkv::attention::reference::paged_decode_reference;
use pagedkv::attention::{cpu::reshape_and_cache, AttentionParams};
use pagedkv::layout::convert::encode;
use pagedkv::layout::Slot;
use pagedkv::tables::PaddedTables;
use pagedkv::{BlockId, DType, Error, HostStorage, KvKind, KvLayout, ModelShape, Storage};

fn latent_layout(
    layers: usize,
    q_heads: usize,
    rank: usize,
    rope: usize,
    dtype: DType,
    bs: usize,
) -> KvLayout {
    let kind = KvKind::Latent {
        kv_lora_rank: rank,
        rope_dim: rope,
    };
    KvLayout::with_kind(
        ModelShape::latent(layers, q_heads, rank, rope, dtype),
        bs,
        kind,
    )
    .unwrap()
}

/// Padded tables for sequences of `ctxs` tokens, each block drawn from a shuffled
/// arena of `num_blocks` so that pages are neither contiguous nor in order.
fn tables(ctxs: &[u32], bs: usize, num_blocks: usize, rng: &mut SplitMix64) -> PaddedTables {
    let mut free: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let max_blocks = ctxs
        .iter()
        .map(|&c| (c as usize).div_ceil(bs))
        .max()
        .unwrap()
        .max(1);
    let mut t = vec![0u32; ctxs.len() * max_blocks];
    for (i, &c) in ctxs.iter().enumerate() {
        for b in 0..(c as usize).div_ceil(bs) {
            t[i * max_blocks + b] = free.pop().unwrap();
        }
    }
    PaddedTables {
        tables: t,
        context_lens: ctxs.to_vec(),
        batch: ctxs.len(),
        max_blocks,
    }
}

fn slots_of(layout: &KvLayout, t: &PaddedTables, seq: usize) -> Vec<Slot> {
    let bs = layout.block_size();
    (0..t.context_lens[seq] as usize)
        .map(|p| layout.slot(BlockId(t.row(seq)[p / bs]), p % bs))
        .collect()
}

#[test]
fn latent_slots_round_trip_through_host_storage() {
    for dtype in [DType::F32, DType::BF16, DType::Fp8E4M3] {
        let layout = latent_layout(2, 4, 16, 4, dtype, 4);
        let d = 20;
        let es = dtype.size_bytes();
        let mut st = HostStorage::new(layout, 8).unwrap();
        let mut rng = SplitMix64::new(7);
        let t = tables(&[11], 4, 8, &mut rng);
        let slots = slots_of(&layout, &t, 0);
        let x: Vec<f32> = (0..11 * d).map(|_| rng.uniform(2.0)).collect();
        let mut bytes = vec![0u8; x.len() * es];
        encode(dtype, &x, 1.0, &mut bytes).unwrap();
        st.write_slots(1, &slots, &bytes, &[]).unwrap();
        // Each token's vector sits at its slot's address, contiguous, in layer 1 only.
        for (p, &slot) in slots.iter().enumerate() {
            let (b, off) = layout.split_slot(slot);
            let at = layout.elem_offset(b, pagedkv::layout::Kv::K, 0, off) * es;
            assert_eq!(
                &st.region(1)[at..at + d * es],
                &bytes[p * d * es..(p + 1) * d * es]
            );
        }
        assert!(st.region(0).iter().all(|&b| b == 0));
        // Read back through the table.
        let table: Vec<BlockId> = t.row(0).iter().map(|&b| BlockId(b)).collect();
        let mut back = vec![0u8; bytes.len()];
        st.read_tokens(1, &table, 11, &mut back, &mut []).unwrap();
        assert_eq!(back, bytes);
        // `write_latent` from f32 writes the same bytes.
        let mut st2 = HostStorage::new(layout, 8).unwrap();
        write_latent(&mut st2, 1, &slots, &x, 1.0).unwrap();
        assert_eq!(st2.region(1), st.region(1));
        // A latent layout has no V half: a non-empty `v` is a shape error, and so is a
        // short latent buffer; nothing is written.
        let before = st.region(1).to_vec();
        assert!(matches!(
            st.write_slots(1, &slots, &bytes, &bytes),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            st.write_slots(1, &slots, &bytes[es..], &[]),
            Err(Error::ShapeMismatch { .. })
        ));
        assert_eq!(st.region(1), &before[..]);
        // A block holds block_size vectors of 20 per layer.
        assert_eq!(layout.block_bytes_per_layer(), 4 * d * es);
    }
}

#[test]
fn absorbed_decode_matches_its_f64_reference() {
    // DeepSeek-V3's latent: 512 + 64; 16 query heads (one GPU's share at tp 8).
    let (rank, rope, heads, bs) = (512, 64, 16, 16);
    let ctxs = [37u32, 0, 100, 1];
    for (dtype, kv_scale, tol) in [
        (DType::F32, 1.0, 2e-5),
        (DType::BF16, 1.0, 2e-5),
        (DType::Fp8E4M3, 0.01, 2e-5),
    ] {
        let layout = latent_layout(2, heads, rank, rope, dtype, bs);
        let d = rank + rope;
        let num_blocks = 16;
        let mut st = HostStorage::new(layout, num_blocks).unwrap();
        let mut rng = SplitMix64::new(21);
        let t = tables(&ctxs, bs, num_blocks, &mut rng);
        for (i, &c) in ctxs.iter().enumerate() {
            let x: Vec<f32> = (0..c as usize * d).map(|_| rng.uniform(1.0)).collect();
            write_latent(&mut st, 1, &slots_of(&layout, &t, i), &x, kv_scale).unwrap();
        }
        let q: Vec<f32> = (0..ctxs.len() * heads * d)
            .map(|_| rng.uniform(1.0))
            .collect();
        let params = MlaParams {
            scale: 1.0 / (192f32).sqrt(),
            kv_scale,
        };
        let want = mla_decode_reference(&st, 1, &q, &t, &params).unwrap();
        let mut out = vec![f32::NAN; ctxs.len() * heads * rank];
        let mut lse = vec![f32::NAN; ctxs.len() * heads];
        mla_decode(&st, 1, &q, &t, &params, &mut out, Some(&mut lse)).unwrap();
        let err_out = out
            .iter()
            .zip(&want.out)
            .map(|(a, b)| (f64::from(*a) - b).abs())
            .fold(0.0, f64::max);
        let err_lse = lse
            .iter()
            .zip(&want.lse)
            .filter(|(_, b)| b.is_finite())
            .map(|(a, b)| (f64::from(*a) - b).abs())
            .fold(0.0, f64::max);
        println!("{dtype}: max |out - f64| = {err_out:.3e}, max |lse - f64| = {err_lse:.3e}");
        assert!(
            err_out < tol && err_lse < tol,
            "{dtype}: {err_out} {err_lse}"
        );
        // The empty sequence gives zeros and -inf.
        let empty = &out[heads * rank..2 * heads * rank];
        assert!(empty.iter().all(|&x| x == 0.0));
        assert!(lse[heads..2 * heads]
            .iter()
            .all(|&x| x == f32::NEG_INFINITY));
        // A one-token context returns that token's first `rank` values.
        let (b, off) = (t.row(3)[0], 0);
        let mut one = vec![0f32; d];
        let at =
            layout.elem_offset(BlockId(b), pagedkv::layout::Kv::K, 0, off) * dtype.size_bytes();
        pagedkv::layout::convert::decode(
            dtype,
            &st.region(1)[at..at + d * dtype.size_bytes()],
            kv_scale,
            &mut one,
        )
        .unwrap();
        for h in 0..heads {
            let o = &out[(3 * heads + h) * rank..(3 * heads + h + 1) * rank];
            for (x, y) in o.iter().zip(&one[..rank]) {
                assert!((x - y).abs() < 1e-5);
            }
        }
    }
}

#[test]
fn bad_inputs_are_errors_before_any_read() {
    let layout = latent_layout(1, 4, 16, 4, DType::F32, 4);
    let st = HostStorage::new(layout, 4).unwrap();
    let ok = PaddedTables {
        tables: vec![1, 2],
        context_lens: vec![5],
        batch: 1,
        max_blocks: 2,
    };
    let p = MlaParams::new(8);
    let q = vec![0f32; 4 * 20];
    let mut out = vec![0f32; 4 * 16];
    assert!(mla_decode(&st, 0, &q, &ok, &p, &mut out, None).is_ok());
    assert!(matches!(
        mla_decode(&st, 1, &q, &ok, &p, &mut out, None),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        mla_decode(&st, 0, &q[1..], &ok, &p, &mut out, None),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        mla_decode(&st, 0, &q, &ok, &p, &mut out[1..], None),
        Err(Error::ShapeMismatch { .. })
    ));
    let mut outside = ok.clone();
    outside.tables[1] = 4;
    assert!(matches!(
        mla_decode(&st, 0, &q, &outside, &p, &mut out, None),
        Err(Error::BlockOutOfRange { .. })
    ));
    let mut long = ok.clone();
    long.context_lens[0] = 9;
    assert!(matches!(
        mla_decode_reference(&st, 0, &q, &long, &p),
        Err(Error::CorruptBlockTable(_))
    ));
    let bad = MlaParams {
        scale: f32::NAN,
        kv_scale: 1.0,
    };
    assert!(matches!(
        mla_decode(&st, 0, &q, &ok, &bad, &mut out, None),
        Err(Error::InvalidConfig { .. })
    ));
    // The standard kernels refuse a latent cache rather than read it as K and V.
    assert!(matches!(
        paged_decode_reference(&st, 0, &q, &ok, &AttentionParams::new(20)),
        Err(Error::Unsupported(_))
    ));
}

/// Row-major `[rows, cols]` matrix times vector, in f64.
fn matvec(m: &[f64], rows: usize, cols: usize, x: &[f64]) -> Vec<f64> {
    (0..rows)
        .map(|r| (0..cols).map(|c| m[r * cols + c] * x[c]).sum())
        .collect()
}

/// Transposed: `mᵀ x` for `m` `[rows, cols]`, `x` of `rows`.
fn matvec_t(m: &[f64], rows: usize, cols: usize, x: &[f64]) -> Vec<f64> {
    (0..cols)
        .map(|c| (0..rows).map(|r| m[r * cols + c] * x[r]).sum())
        .collect()
}

#[test]
fn absorbed_form_equals_standard_attention_projected_back() {
    // A tiny random MLA layer: heads H, latent R, rope P, nope N, value head V.
    let (h_n, r, p_d, n_d, v_d) = (4usize, 32usize, 8usize, 16usize, 12usize);
    let qk = n_d + p_d;
    let bs = 4;
    let ctxs = [23u32, 9];
    let num_blocks = 12;
    let mut rng = SplitMix64::new(99);
    let mut rand =
        |n: usize, a: f32| -> Vec<f64> { (0..n).map(|_| f64::from(rng.uniform(a))).collect() };
    let w_uk = rand(h_n * n_d * r, 0.3); // [H][N][R]
    let w_uv = rand(h_n * v_d * r, 0.3); // [H][V][R]
    let tokens: usize = ctxs.iter().map(|&c| c as usize).sum();
    let c_lat = rand(tokens * r, 1.0); // [T][R]
    let k_rope = rand(tokens * p_d, 1.0); // [T][P]
    let q_nope = rand(ctxs.len() * h_n * n_d, 1.0);
    let q_rope = rand(ctxs.len() * h_n * p_d, 1.0);
    // Values are stored in f32 in both caches: round them once so that both forms
    // see the same numbers.
    let f = |v: &[f64]| -> Vec<f64> { v.iter().map(|&x| f64::from(x as f32)).collect() };
    let (c_lat, k_rope) = (f(&c_lat), f(&k_rope));
    let scale = 1.0 / (qk as f32).sqrt();
    let mut shuffle = SplitMix64::new(5);
    let t = tables(&ctxs, bs, num_blocks, &mut shuffle);

    // Standard: MHA with H KV heads of head dim N + P; K_h = [W_UK_h c ; k_rope],
    // V_h = W_UV_h c padded with zeros to the head dim.
    let std_layout = KvLayout::new(
        ModelShape {
            num_layers: 1,
            num_q_heads: h_n,
            num_kv_heads: h_n,
            head_dim: qk,
            kv_dtype: DType::F32,
        },
        bs,
    )
    .unwrap();
    let mut std_st = HostStorage::new(std_layout, num_blocks).unwrap();
    // Absorbed: one latent [c ; k_rope] per token.
    let lat_layout = latent_layout(1, h_n, r, p_d, DType::F32, bs);
    let mut lat_st = HostStorage::new(lat_layout, num_blocks).unwrap();
    let mut tok = 0;
    for (i, &c) in ctxs.iter().enumerate() {
        let slots = slots_of(&std_layout, &t, i);
        let (mut k, mut v, mut lat) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..c {
            let ct = &c_lat[tok * r..(tok + 1) * r];
            let kr = &k_rope[tok * p_d..(tok + 1) * p_d];
            for h in 0..h_n {
                let kn = matvec(&w_uk[h * n_d * r..(h + 1) * n_d * r], n_d, r, ct);
                k.extend(kn.iter().chain(kr).map(|&x| x as f32));
                let vv = matvec(&w_uv[h * v_d * r..(h + 1) * v_d * r], v_d, r, ct);
                v.extend(vv.iter().map(|&x| x as f32));
                v.extend(std::iter::repeat_n(0f32, qk - v_d));
            }
            lat.extend(ct.iter().chain(kr).map(|&x| x as f32));
            tok += 1;
        }
        reshape_and_cache(&mut std_st, 0, &slots, &k, &v, 1.0, 1.0).unwrap();
        write_latent(&mut lat_st, 0, &slots, &lat, 1.0).unwrap();
    }
    let mut q_std = Vec::new();
    let mut q_abs = Vec::new();
    for row in 0..ctxs.len() * h_n {
        let h = row % h_n;
        let qn = &q_nope[row * n_d..(row + 1) * n_d];
        let qr = &q_rope[row * p_d..(row + 1) * p_d];
        q_std.extend(qn.iter().chain(qr).map(|&x| x as f32));
        let absorbed = matvec_t(&w_uk[h * n_d * r..(h + 1) * n_d * r], n_d, r, qn);
        q_abs.extend(absorbed.iter().chain(qr).map(|&x| x as f32));
    }
    let mut params = AttentionParams::new(qk);
    params.scale = scale;
    let standard = paged_decode_reference(&std_st, 0, &q_std, &t, &params).unwrap();
    let mp = MlaParams {
        scale,
        kv_scale: 1.0,
    };
    let absorbed = mla_decode_reference(&lat_st, 0, &q_abs, &t, &mp).unwrap();
    let mut fast = vec![0f32; ctxs.len() * h_n * r];
    let mut fast_lse = vec![0f32; ctxs.len() * h_n];
    mla_decode(&lat_st, 0, &q_abs, &t, &mp, &mut fast, Some(&mut fast_lse)).unwrap();

    let (mut err_ref, mut err_fast, mut err_lse, mut biggest) = (0f64, 0f64, 0f64, 0f64);
    for row in 0..ctxs.len() * h_n {
        let h = row % h_n;
        let w = &w_uv[h * v_d * r..(h + 1) * v_d * r];
        let want = &standard.out[row * qk..row * qk + v_d];
        let got = matvec(w, v_d, r, &absorbed.out[row * r..(row + 1) * r]);
        let lat_fast: Vec<f64> = fast[row * r..(row + 1) * r]
            .iter()
            .map(|&x| f64::from(x))
            .collect();
        let got_fast = matvec(w, v_d, r, &lat_fast);
        for j in 0..v_d {
            err_ref = err_ref.max((got[j] - want[j]).abs());
            err_fast = err_fast.max((got_fast[j] - want[j]).abs());
            biggest = biggest.max(want[j].abs());
        }
        // The padded value dims of standard attention stay 0.
        assert!(standard.out[row * qk + v_d..(row + 1) * qk]
            .iter()
            .all(|&x| x == 0.0));
        err_lse = err_lse
            .max((absorbed.lse[row] - standard.lse[row]).abs())
            .max((f64::from(fast_lse[row]) - standard.lse[row]).abs());
    }
    println!(
        "absorbed vs standard (projected through W_UV): f64 ref {err_ref:.3e}, f32 fast {err_fast:.3e}, lse {err_lse:.3e}; largest |out| {biggest:.3}"
    );
    assert!(biggest > 0.05, "the outputs are not all near zero");
    assert!(err_ref < 1e-5, "{err_ref}");
    assert!(err_fast < 1e-4, "{err_fast}");
    assert!(err_lse < 1e-4, "{err_lse}");
}
