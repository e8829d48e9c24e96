//! The two inner loops of the CPU attention, portable and AVX2+FMA.
//!
//! Each implementation is deterministic: a given `(rows, d, n)` always sums in the same
//! order, whatever the data or the caller.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::layout::convert::{decode_fp8_with, decode_unchecked};
use crate::layout::shape::DType;

pub(crate) fn cast_u16(b: &[u8]) -> Option<&[u16]> {
    if cfg!(target_endian = "big") {
        return None;
    }
    // SAFETY: every bit pattern is a valid `u16`, and `align_to` only puts correctly
    // aligned, in-bounds elements in the middle part; we use it only when it is the whole.
    let (pre, mid, post) = unsafe { b.align_to::<u16>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// Portable decoding of a run of elements.
#[inline(always)]
fn decode_portable(dtype: DType, bytes: &[u8], lut: &[f32; 256], out: &mut [f32]) {
    match dtype {
        DType::Fp8E4M3 => decode_fp8_with(lut, bytes, out),
        DType::BF16 => match cast_u16(bytes) {
            Some(u) => {
                for (o, &x) in out.iter_mut().zip(u) {
                    *o = f32::from_bits(u32::from(x) << 16);
                }
            }
            None => decode_unchecked(dtype, bytes, out),
        },
        DType::F16 => match cast_u16(bytes) {
            Some(u) => u.reinterpret_cast::<half::f16>().convert_to_f32_slice(out),
            None => decode_unchecked(dtype, bytes, out),
        },
        DType::F32 => decode_unchecked(dtype, bytes, out),
    }
}

/// The inner loops.
pub(crate) trait Kern {
    /// `logits[r * n + i] = q[r] . k[i]` for `r < rows`, `i < n`; `q` is `[rows, d]`, key
    /// `i` starts at `k[i * ks]`.
    fn qk(q: &[f32], rows: usize, d: usize, k: &[f32], ks: usize, n: usize, logits: &mut [f32]);
    /// `acc += sum_j p[j] * v[j * stride ..][..acc.len()]`, in order of `j` per element.
    fn pv(acc: &mut [f32], p: &[f32], v: &[f32], stride: usize);
    /// `x[i] = x[i] * scale + slope * (dist0 + i)`; returns the max (NaNs ignored).
    fn bias_max(x: &mut [f32], scale: f32, slope: f32, dist0: f32) -> f32;
    /// `x[i] = exp(x[i] - m)` (with [`exp_approx`]); returns the sum.
    fn exp_sum(x: &mut [f32], m: f32) -> f32;
    /// Decodes a run of `dtype` elements (not `f32`) into `out`; fp8 through `lut`
    /// (`fp8_e4m3_table(scale)`), or the same values computed another way.
    fn decode(dtype: DType, bytes: &[u8], lut: &[f32; 256], scale: f32, out: &mut [f32]);
    /// Hints that `rows` rows of `row_bytes` bytes, `stride` bytes apart from the start of
    /// `bytes`, are read soon.
    fn prefetch(_bytes: &[u8], _rows: usize, _row_bytes: usize, _stride: usize) {}
}

// Cephes-style expf: range reduction by ln 2 in two parts, degree-5 polynomial, 2^n by
// exponent bits. Relative error about 2 ulp; inputs below -87.3 give 0, above 88.3 are
// clamped (softmax never feeds positive values).
const EXP_HI: f32 = 88.376_26;
const EXP_LO: f32 = -87.336_55;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// The exponential the kernels use (scalar form of the vector code).
#[inline(always)]
pub(crate) fn exp_approx(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < EXP_LO {
        return 0.0;
    }
    let x = x.min(EXP_HI);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut y = P[0];
    for &c in &P[1..] {
        y = y * r + c;
    }
    let y = y * (r * r) + r + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

fn check_qk(q: &[f32], rows: usize, d: usize, k: &[f32], ks: usize, n: usize, logits: &[f32]) {
    assert!(q.len() >= rows * d, "q too short");
    assert!(n == 0 || k.len() >= (n - 1) * ks + d, "k too short");
    assert!(logits.len() >= rows * n, "logits too short");
}

fn check_pv(acc: &[f32], p: &[f32], v: &[f32], stride: usize) {
    assert!(
        p.is_empty() || v.len() >= (p.len() - 1) * stride + acc.len(),
        "v too short"
    );
}

/// Plain Rust, left to the auto-vectoriser.
pub(crate) struct Portable;

const LANES: usize = 16;

#[inline(always)]
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let b = &b[..n];
    let mut acc = [0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            acc[i] += acc[i + w];
        }
        w /= 2;
    }
    let mut s = acc[0];
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

impl Kern for Portable {
    #[inline(always)]
    fn qk(q: &[f32], rows: usize, d: usize, k: &[f32], ks: usize, n: usize, logits: &mut [f32]) {
        check_qk(q, rows, d, k, ks, n, logits);
        for r in 0..rows {
            let qr = &q[r * d..(r + 1) * d];
            for i in 0..n {
                logits[r * n + i] = dot_portable(qr, &k[i * ks..i * ks + d]);
            }
        }
    }

    #[inline(always)]
    fn pv(acc: &mut [f32], p: &[f32], v: &[f32], stride: usize) {
        check_pv(acc, p, v, stride);
        let d = acc.len();
        for (j, &w) in p.iter().enumerate() {
            let vr = &v[j * stride..j * stride + d];
            for (a, &x) in acc.iter_mut().zip(vr) {
                *a += w * x;
            }
        }
    }

    #[inline(always)]
    fn bias_max(x: &mut [f32], scale: f32, slope: f32, dist0: f32) -> f32 {
        let mut mx = f32::NEG_INFINITY;
        for (i, v) in x.iter_mut().enumerate() {
            *v = *v * scale + slope * (dist0 + i as f32);
            mx = mx.max(*v);
        }
        mx
    }

    #[inline(always)]
    fn decode(dtype: DType, bytes: &[u8], lut: &[f32; 256], _scale: f32, out: &mut [f32]) {
        decode_portable(dtype, bytes, lut, out);
    }

    #[inline(always)]
    fn exp_sum(x: &mut [f32], m: f32) -> f32 {
        let mut sum = 0.0;
        for v in x.iter_mut() {
            *v = exp_approx(*v - m);
            sum += *v;
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::Avx2;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{
        check_pv, check_qk, decode_portable, exp_approx, Kern, EXP_HI, EXP_LO, LN2_HI, LN2_LO,
        LOG2E, P,
    };
    use crate::layout::shape::DType;

    /// AVX2 + FMA + F16C intrinsics. Only used after the three features were detected at
    /// run time (see `cpu::isa`), from functions compiled with them enabled.
    pub(crate) struct Avx2;

    impl Kern for Avx2 {
        #[inline(always)]
        fn qk(
            q: &[f32],
            rows: usize,
            d: usize,
            k: &[f32],
            ks: usize,
            n: usize,
            logits: &mut [f32],
        ) {
            check_qk(q, rows, d, k, ks, n, logits);
            // SAFETY: the lengths were checked above; `Avx2` is only used once AVX2 and FMA
            // were detected.
            unsafe { qk(q.as_ptr(), rows, d, k.as_ptr(), ks, n, logits.as_mut_ptr()) }
        }

        #[inline(always)]
        fn pv(acc: &mut [f32], p: &[f32], v: &[f32], stride: usize) {
            check_pv(acc, p, v, stride);
            // SAFETY: the lengths were checked above; `Avx2` is only used once AVX2 and FMA
            // were detected.
            unsafe { pv(acc.as_mut_ptr(), acc.len(), p, v.as_ptr(), stride) }
        }

        #[inline(always)]
        fn bias_max(x: &mut [f32], scale: f32, slope: f32, dist0: f32) -> f32 {
            // SAFETY: `Avx2` is only used once AVX2 and FMA were detected.
            unsafe { bias_max(x, scale, slope, dist0) }
        }

        #[inline(always)]
        fn exp_sum(x: &mut [f32], m: f32) -> f32 {
            // SAFETY: `Avx2` is only used once AVX2 and FMA were detected.
            unsafe { exp_sum(x, m) }
        }

        #[inline(always)]
        fn prefetch(bytes: &[u8], rows: usize, row_bytes: usize, stride: usize) {
            for r in 0..rows {
                let row = &bytes[r * stride..r * stride + row_bytes];
                for line in row.chunks(64) {
                    // SAFETY: a prefetch hint of an address inside `bytes`; SSE is baseline
                    // on x86-64.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
                }
            }
        }

        #[inline(always)]
        fn decode(dtype: DType, bytes: &[u8], lut: &[f32; 256], scale: f32, out: &mut [f32]) {
            assert_eq!(
                bytes.len(),
                out.len() * dtype.size_bytes(),
                "decode lengths"
            );
            // SAFETY: lengths checked; `Avx2` is only used once AVX2, FMA and F16C were
            // detected.
            unsafe { decode(dtype, bytes, lut, scale, out) }
        }
    }

    /// # Safety
    /// AVX2 and F16C available; `bytes` holds `out.len()` elements of `dtype`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(dtype: DType, bytes: &[u8], lut: &[f32; 256], scale: f32, out: &mut [f32]) {
        let n = out.len();
        let (src, dst) = (bytes.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        // SAFETY: for the whole body, reads below `n * size` bytes of `bytes`, writes below `n`
        // elements of `out`; unaligned loads and stores only.
        unsafe {
            match dtype {
                DType::BF16 => {
                    while i + 8 <= n {
                        let h = _mm_loadu_si128(src.add(2 * i).cast());
                        let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                        _mm256_storeu_ps(dst.add(i), _mm256_castsi256_ps(w));
                        i += 8;
                    }
                }
                DType::F16 => {
                    while i + 8 <= n {
                        let h = _mm_loadu_si128(src.add(2 * i).cast());
                        _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
                        i += 8;
                    }
                }
                DType::Fp8E4M3 => {
                    // e4m3 -> f16 by shifting exponent and mantissa into place: an f16
                    // of value `x / 256` (subnormals included, exactly); then one multiply
                    // by `256 * scale` (exact power-of-two factor), which rounds like the
                    // table's `x * scale`. The NaN codes are patched afterwards.
                    let k = _mm256_set1_ps(256.0 * scale);
                    let nan = _mm256_set1_ps(f32::NAN);
                    let m7f = _mm_set1_epi16(0x7f);
                    let m80 = _mm_set1_epi16(0x80);
                    while i + 8 <= n {
                        let b = _mm_cvtepu8_epi16(_mm_loadl_epi64(src.add(i).cast()));
                        let em = _mm_and_si128(b, m7f);
                        let h = _mm_or_si128(
                            _mm_slli_epi16::<7>(em),
                            _mm_slli_epi16::<8>(_mm_and_si128(b, m80)),
                        );
                        let v = _mm256_mul_ps(_mm256_cvtph_ps(h), k);
                        let is_nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(em, m7f));
                        _mm256_storeu_ps(
                            dst.add(i),
                            _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(is_nan)),
                        );
                        i += 8;
                    }
                }
                DType::F32 => {}
            }
        }
        let es = dtype.size_bytes();
        decode_portable(dtype, &bytes[i * es..], lut, &mut out[i..]);
    }

    /// # Safety
    /// AVX2 and FMA available.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn bias_max(x: &mut [f32], scale: f32, slope: f32, dist0: f32) -> f32 {
        let n = x.len();
        let p = x.as_mut_ptr();
        // SAFETY: for the whole body, loads and stores stay below `n`.
        unsafe {
            let (vs, vsl) = (_mm256_set1_ps(scale), _mm256_set1_ps(slope));
            let mut dist = _mm256_add_ps(
                _mm256_set1_ps(dist0),
                _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0),
            );
            let eight = _mm256_set1_ps(8.0);
            let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut i = 0;
            while i + 8 <= n {
                let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), vs);
                let v = _mm256_add_ps(v, _mm256_mul_ps(vsl, dist));
                _mm256_storeu_ps(p.add(i), v);
                // `max(v, mx)` keeps `mx` where `v` is NaN.
                mx = _mm256_max_ps(v, mx);
                dist = _mm256_add_ps(dist, eight);
                i += 8;
            }
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), mx);
            let mut m = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            while i < n {
                let v = *p.add(i) * scale + slope * (dist0 + i as f32);
                *p.add(i) = v;
                m = m.max(v);
                i += 1;
            }
            m
        }
    }

    /// # Safety
    /// AVX2 and FMA available.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_sum(x: &mut [f32], m: f32) -> f32 {
        let n = x.len();
        let p = x.as_mut_ptr();
        // SAFETY: for the whole body, loads and stores stay below `n`.
        unsafe {
            let vm = _mm256_set1_ps(m);
            let mut sum = _mm256_setzero_ps();
            let mut i = 0;
            while i + 8 <= n {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vm));
                _mm256_storeu_ps(p.add(i), e);
                sum = _mm256_add_ps(sum, e);
                i += 8;
            }
            let z = _mm256_setzero_ps();
            let mut s = hsum4(sum, z, z, z)[0];
            while i < n {
                let e = exp_approx(*p.add(i) - m);
                *p.add(i) = e;
                s += e;
                i += 1;
            }
            s
        }
    }

    /// Eight lanes of [`exp_approx`], with FMA in the polynomial.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(unused_unsafe)]
    unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: AVX2 and FMA are enabled here; no memory is touched.
        unsafe {
            let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
            // `min`/`max` return their second operand when either is NaN: NaN stays NaN.
            let x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), x);
            let x = _mm256_max_ps(_mm256_set1_ps(EXP_LO), x);
            let n = _mm256_floor_ps(_mm256_fmadd_ps(
                x,
                _mm256_set1_ps(LOG2E),
                _mm256_set1_ps(0.5),
            ));
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
            let mut y = _mm256_set1_ps(P[0]);
            for &c in &P[1..] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
            }
            let y = _mm256_fmadd_ps(
                y,
                _mm256_mul_ps(r, r),
                _mm256_add_ps(r, _mm256_set1_ps(1.0)),
            );
            let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            let out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
            _mm256_andnot_ps(under, out)
        }
    }

    /// The sums of four vectors, as the four lanes of one.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    // Newer compilers call these intrinsics safe inside `target_feature` functions;
    // the block keeps older ones (MSRV) happy.
    #[allow(unused_unsafe)]
    unsafe fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> [f32; 4] {
        let mut out = [0f32; 4];
        // SAFETY: AVX2 is enabled here; `out` holds four f32s.
        unsafe {
            let h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
            let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            _mm_storeu_ps(out.as_mut_ptr(), s);
        }
        out
    }

    /// # Safety
    /// AVX2 and FMA available; `a` and `b` readable for `d` elements.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot(a: *const f32, b: *const f32, d: usize) -> f32 {
        // SAFETY: for the whole body, every load reads below `d` elements of `a` and `b`.
        unsafe {
            let z = _mm256_setzero_ps();
            let (mut s0, mut s1, mut s2, mut s3) = (z, z, z, z);
            let mut c = 0;
            while c + 32 <= d {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(c)), _mm256_loadu_ps(b.add(c)), s0);
                s1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.add(c + 8)),
                    _mm256_loadu_ps(b.add(c + 8)),
                    s1,
                );
                s2 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.add(c + 16)),
                    _mm256_loadu_ps(b.add(c + 16)),
                    s2,
                );
                s3 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.add(c + 24)),
                    _mm256_loadu_ps(b.add(c + 24)),
                    s3,
                );
                c += 32;
            }
            while c + 8 <= d {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(c)), _mm256_loadu_ps(b.add(c)), s0);
                c += 8;
            }
            let s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
            let mut r = hsum4(s, z, z, z)[0];
            while c < d {
                r = (*a.add(c)).mul_add(*b.add(c), r);
                c += 1;
            }
            r
        }
    }

    /// # Safety
    /// AVX2 and FMA available; `q` readable for `rows * d`, `k` for `(n - 1) * ks + d`,
    /// `logits` writable for `rows * n` elements.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn qk(
        q: *const f32,
        rows: usize,
        d: usize,
        k: *const f32,
        ks: usize,
        n: usize,
        logits: *mut f32,
    ) {
        // SAFETY: for the whole body, rows, tokens and columns stay inside the bounds above.
        unsafe {
            let z = _mm256_setzero_ps();
            let mut r = 0;
            // Four query rows by two keys: eight accumulators, each load used 2-4 times.
            while r + 4 <= rows {
                let qr = [
                    q.add(r * d),
                    q.add((r + 1) * d),
                    q.add((r + 2) * d),
                    q.add((r + 3) * d),
                ];
                let mut i = 0;
                while i + 2 <= n {
                    let (k0, k1) = (k.add(i * ks), k.add((i + 1) * ks));
                    let mut a0 = [z; 4];
                    let mut a1 = [z; 4];
                    let mut c = 0;
                    while c + 8 <= d {
                        let x0 = _mm256_loadu_ps(k0.add(c));
                        let x1 = _mm256_loadu_ps(k1.add(c));
                        for j in 0..4 {
                            let y = _mm256_loadu_ps(qr[j].add(c));
                            a0[j] = _mm256_fmadd_ps(y, x0, a0[j]);
                            a1[j] = _mm256_fmadd_ps(y, x1, a1[j]);
                        }
                        c += 8;
                    }
                    let mut s0 = hsum4(a0[0], a0[1], a0[2], a0[3]);
                    let mut s1 = hsum4(a1[0], a1[1], a1[2], a1[3]);
                    while c < d {
                        for j in 0..4 {
                            let y = *qr[j].add(c);
                            s0[j] = y.mul_add(*k0.add(c), s0[j]);
                            s1[j] = y.mul_add(*k1.add(c), s1[j]);
                        }
                        c += 1;
                    }
                    for j in 0..4 {
                        *logits.add((r + j) * n + i) = s0[j];
                        *logits.add((r + j) * n + i + 1) = s1[j];
                    }
                    i += 2;
                }
                if i < n {
                    let k0 = k.add(i * ks);
                    let mut a0 = [z; 4];
                    let mut c = 0;
                    while c + 8 <= d {
                        let x0 = _mm256_loadu_ps(k0.add(c));
                        for j in 0..4 {
                            a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[j].add(c)), x0, a0[j]);
                        }
                        c += 8;
                    }
                    let mut s0 = hsum4(a0[0], a0[1], a0[2], a0[3]);
                    while c < d {
                        for j in 0..4 {
                            s0[j] = (*qr[j].add(c)).mul_add(*k0.add(c), s0[j]);
                        }
                        c += 1;
                    }
                    for (j, &x) in s0.iter().enumerate() {
                        *logits.add((r + j) * n + i) = x;
                    }
                }
                r += 4;
            }
            while r < rows {
                for i in 0..n {
                    *logits.add(r * n + i) = dot(q.add(r * d), k.add(i * ks), d);
                }
                r += 1;
            }
        }
    }

    /// # Safety
    /// AVX2 and FMA available; `acc` writable for `d` elements, `v` readable for
    /// `(p.len() - 1) * stride + d`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pv(acc: *mut f32, d: usize, p: &[f32], v: *const f32, stride: usize) {
        // SAFETY: for the whole body, columns stay below `d`, rows below `p.len()`.
        unsafe {
            let mut c = 0;
            while c + 64 <= d {
                let mut a = [_mm256_setzero_ps(); 8];
                for (u, x) in a.iter_mut().enumerate() {
                    *x = _mm256_loadu_ps(acc.add(c + 8 * u));
                }
                for (j, &w) in p.iter().enumerate() {
                    let wv = _mm256_set1_ps(w);
                    let vr = v.add(j * stride + c);
                    for (u, x) in a.iter_mut().enumerate() {
                        *x = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vr.add(8 * u)), *x);
                    }
                }
                for (u, x) in a.iter().enumerate() {
                    _mm256_storeu_ps(acc.add(c + 8 * u), *x);
                }
                c += 64;
            }
            while c + 8 <= d {
                let mut x = _mm256_loadu_ps(acc.add(c));
                for (j, &w) in p.iter().enumerate() {
                    x = _mm256_fmadd_ps(
                        _mm256_set1_ps(w),
                        _mm256_loadu_ps(v.add(j * stride + c)),
                        x,
                    );
                }
                _mm256_storeu_ps(acc.add(c), x);
                c += 8;
            }
            while c < d {
                let mut x = *acc.add(c);
                for (j, &w) in p.iter().enumerate() {
                    x = w.mul_add(*v.add(j * stride + c), x);
                }
                *acc.add(c) = x;
                c += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<K: Kern>() {
        for (rows, d, n) in [
            (1, 64, 3),
            (4, 128, 5),
            (8, 64, 16),
            (5, 13, 2),
            (6, 100, 1),
            (4, 7, 4),
        ] {
            let ks = d + 3;
            let q: Vec<f32> = (0..rows * d)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let k: Vec<f32> = (0..n * ks)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0)
                .collect();
            let mut lg = vec![0f32; rows * n];
            K::qk(&q, rows, d, &k, ks, n, &mut lg);
            for r in 0..rows {
                for i in 0..n {
                    let want: f64 = (0..d)
                        .map(|c| f64::from(q[r * d + c]) * f64::from(k[i * ks + c]))
                        .sum();
                    assert!(
                        (f64::from(lg[r * n + i]) - want).abs() < 1e-4,
                        "{rows} {d} {n}: {r} {i}"
                    );
                }
            }
            let p: Vec<f32> = (0..n).map(|i| 0.1 + i as f32 * 0.05).collect();
            let mut acc: Vec<f32> = (0..d).map(|i| i as f32 * 0.01).collect();
            let want: Vec<f64> = (0..d)
                .map(|c| {
                    f64::from(acc[c])
                        + (0..n)
                            .map(|j| f64::from(p[j]) * f64::from(k[j * ks + c]))
                            .sum::<f64>()
                })
                .collect();
            K::pv(&mut acc, &p, &k, ks);
            for c in 0..d {
                assert!((f64::from(acc[c]) - want[c]).abs() < 1e-4);
            }
            let mut x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.7).sin() * 5.0).collect();
            let orig = x.clone();
            let mx = K::bias_max(&mut x, 0.5, 0.25, -(d as f32));
            let mut want_max = f32::NEG_INFINITY;
            for i in 0..d {
                let w = orig[i] * 0.5 + 0.25 * (i as f32 - d as f32);
                assert!((x[i] - w).abs() < 1e-5);
                want_max = want_max.max(w);
            }
            assert!((mx - want_max).abs() < 1e-5);
            let before = x.clone();
            let sum = K::exp_sum(&mut x, mx);
            let mut want_sum = 0.0f64;
            for i in 0..d {
                let w = f64::from(before[i] - mx).exp();
                assert!((f64::from(x[i]) - w).abs() < 1e-6 * w.max(1e-30) + 1e-38);
                want_sum += w;
            }
            assert!((f64::from(sum) - want_sum).abs() < 1e-5 * want_sum);
        }
    }

    #[test]
    fn exp_approx_is_within_a_few_ulp() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (got, want) = (f64::from(exp_approx(x)), f64::from(x).exp());
            assert!(((got - want) / want).abs() < 4e-7, "{x}: {got} vs {want}");
            x += 0.0137;
        }
        assert_eq!(exp_approx(0.0), 1.0);
        assert_eq!(exp_approx(-100.0), 0.0);
        assert_eq!(exp_approx(f32::NEG_INFINITY), 0.0);
        assert!(exp_approx(f32::NAN).is_nan());
    }

    fn check_decode<K: Kern>() {
        use crate::layout::convert::fp8_e4m3_table;
        let bytes: Vec<u8> = (0..=255u8).chain(0..=255u8).chain(0..7).collect();
        for scale in [1.0f32, 0.037, 3.5, 1e-3] {
            let lut = fp8_e4m3_table(scale);
            let mut out = vec![0f32; bytes.len()];
            K::decode(DType::Fp8E4M3, &bytes, &lut, scale, &mut out);
            for (b, o) in bytes.iter().zip(&out) {
                let want = lut[*b as usize];
                assert!(
                    want.to_bits() == o.to_bits() || (want.is_nan() && o.is_nan()),
                    "{b:#04x} * {scale}: {o} vs {want}"
                );
            }
        }
        for dtype in [DType::F16, DType::BF16] {
            let words: Vec<u16> = (0..40_000u32).map(|i| (i * 7919 % 65536) as u16).collect();
            let mut bytes = Vec::new();
            for w in &words {
                bytes.extend_from_slice(&w.to_le_bytes());
            }
            for off in [0usize, 2] {
                let src = &bytes[off..];
                let n = src.len() / 2;
                let mut out = vec![0f32; n];
                K::decode(dtype, src, &[0.0; 256], 1.0, &mut out);
                let mut want = vec![0f32; n];
                decode_unchecked(dtype, src, &mut want);
                for (o, w) in out.iter().zip(&want) {
                    assert!(
                        o.to_bits() == w.to_bits() || (o.is_nan() && w.is_nan()),
                        "{dtype}"
                    );
                }
            }
        }
    }

    #[test]
    fn decoders_agree_with_the_scalar_conversions() {
        check_decode::<Portable>();
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            check_decode::<Avx2>();
        }
    }

    #[test]
    fn portable_kernels_are_right() {
        check::<Portable>();
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_kernels_are_right() {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            check::<Avx2>();
        }
    }
}
