//! Conversions between `f32` and the KV-cache dtypes.
//!
//! * `f16` and `bf16` go through the [`half`] crate (round-to-nearest-even on encode,
//!   exact on decode).
//! * fp8 e4m3 is the OCP "fn" variant (`float8_e4m3fn`): 1 sign bit, 4 exponent bits with
//!   bias 7, 3 mantissa bits, subnormals, no infinities, and one NaN pattern per sign
//!   (`0x7f` / `0xff`). The largest finite value is 448 (`0x7e`), the smallest subnormal
//!   2^-9.
//!
//! fp8 rules, which the CUDA kernels reproduce exactly:
//!
//! * encode stores `x / scale`, rounded to nearest, ties to even;
//! * every finite value whose magnitude rounds above 448, and +-infinity, saturates to
//!   +-448 (`0x7e` / `0xfe`), like CUDA's `__NV_SATFINITE`;
//! * NaN encodes to the canonical `0x7f` whatever its sign (what the hardware `cvt`
//!   produces);
//! * `-0.0` encodes to `0x80`, and values that round to zero keep their sign;
//! * decode multiplies by `scale` (in `f32`); both NaN codes decode to NaN.
//!
//! `scale` is only applied for fp8; it must be finite and positive for every dtype so that
//! a bad scale is caught whatever the cache dtype.
//!
//! Buffers are little-endian, the order of the arena on every supported target.

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::layout::shape::DType;

/// Largest finite fp8 e4m3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// The canonical fp8 e4m3 NaN code.
pub const FP8_E4M3_NAN: u8 = 0x7f;

/// Decodes one fp8 e4m3 (OCP "fn") code. Exact.
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = u32::from(b & 0x80) << 24;
    let exp = u32::from((b >> 3) & 0x0f);
    let man = u32::from(b & 0x07);
    let mag = if exp == 0x0f && man == 0x07 {
        return f32::from_bits(sign | 0x7fc0_0000);
    } else if exp == 0 {
        // Subnormal: man * 2^-9, exact in f32.
        man as f32 * (1.0 / 512.0)
    } else {
        // Normal: rebias 7 -> 127, mantissa to the top of the f32 mantissa.
        f32::from_bits(((exp + 120) << 23) | (man << 20))
    };
    f32::from_bits(sign | mag.to_bits())
}

/// Encodes one `f32` as fp8 e4m3 (OCP "fn"): round to nearest even, saturate to +-448,
/// NaN to `0x7f`.
#[inline]
pub fn f32_to_fp8_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return FP8_E4M3_NAN;
    }
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = x.abs();
    if a >= FP8_E4M3_MAX {
        return sign | 0x7e;
    }
    if a < 1.0 / 64.0 {
        // Below the smallest normal (2^-6): multiples of 2^-9. `a * 512` is exact, so one
        // rounding happens here; a result of 8 is the smallest normal, whose code is 8.
        let q = (a * 512.0).round_ties_even() as u8;
        return sign | q;
    }
    let exp = ((bits >> 23) & 0xff) as i32 - 127; // -6..=8
    let man = bits & 0x007f_ffff;
    let mut code = (((exp + 7) as u32) << 3) | (man >> 20);
    let rest = man & 0x000f_ffff;
    const HALF: u32 = 0x0008_0000;
    if rest > HALF || (rest == HALF && code & 1 == 1) {
        // A carry out of the mantissa moves to the next binade, which is what we want.
        code += 1;
    }
    // `a < 448` rounds to at most 448 (0x7e), never to the NaN code.
    sign | code as u8
}

/// A 256-entry table: `fp8_e4m3_to_f32(code) * scale` for every code.
pub fn fp8_e4m3_table(scale: f32) -> [f32; 256] {
    let mut t = [0.0f32; 256];
    for (i, v) in t.iter_mut().enumerate() {
        *v = fp8_e4m3_to_f32(i as u8) * scale;
    }
    t
}

/// Checks a quantisation scale: finite and positive.
///
/// # Errors
/// [`Error::InvalidConfig`] naming `what`.
pub fn check_scale(what: &'static str, scale: f32) -> Result<()> {
    if scale.is_finite() && scale > 0.0 {
        Ok(())
    } else {
        Err(Error::config(
            what,
            format!("{scale} must be finite and positive"),
        ))
    }
}

fn check_len(dtype: DType, elems: usize, bytes: usize) -> Result<()> {
    let want = elems * dtype.size_bytes();
    if bytes != want {
        return Err(Error::ShapeMismatch {
            what: "bytes for the elements",
            expected: want,
            got: bytes,
        });
    }
    Ok(())
}

/// Encodes `x` into `out` in `dtype` (little-endian). fp8 stores `x / scale`.
///
/// # Errors
/// [`Error::InvalidConfig`] for a scale that is not finite and positive,
/// [`Error::ShapeMismatch`] when `out` is not `x.len() * dtype.size_bytes()` long. Nothing
/// is written on error.
pub fn encode(dtype: DType, x: &[f32], scale: f32, out: &mut [u8]) -> Result<()> {
    check_scale("scale", scale)?;
    check_len(dtype, x.len(), out.len())?;
    encode_unchecked(dtype, x, scale, out);
    Ok(())
}

/// [`encode`] without the checks; lengths must match (panics otherwise).
#[inline]
pub(crate) fn encode_unchecked(dtype: DType, x: &[f32], scale: f32, out: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (o, &v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        DType::BF16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        DType::Fp8E4M3 => {
            // Divide (not multiply by a reciprocal) so the code is the rounding of exactly
            // the f32 quotient `x / scale`, as the CUDA kernels compute it.
            for (o, &v) in out.iter_mut().zip(x) {
                let y = v / scale;
                *o = f32_to_fp8_e4m3(y);
            }
        }
    }
}

/// Decodes `bytes` (little-endian, `dtype`) into `out`. fp8 values are multiplied by
/// `scale`.
///
/// # Errors
/// [`Error::InvalidConfig`] for a scale that is not finite and positive,
/// [`Error::ShapeMismatch`] when `bytes` is not `out.len() * dtype.size_bytes()` long.
/// Nothing is written on error.
pub fn decode(dtype: DType, bytes: &[u8], scale: f32, out: &mut [f32]) -> Result<()> {
    check_scale("scale", scale)?;
    check_len(dtype, out.len(), bytes.len())?;
    match dtype {
        DType::Fp8E4M3 => decode_fp8_with(&fp8_e4m3_table(scale), bytes, out),
        _ => decode_unchecked(dtype, bytes, out),
    }
    Ok(())
}

/// Decodes a non-fp8 dtype; lengths must match. Panics for fp8 (which needs a table).
#[inline(always)]
pub(crate) fn decode_unchecked(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        DType::Fp8E4M3 => unreachable!("fp8 decodes through a table"),
    }
}

/// Decodes fp8 codes through a table made by [`fp8_e4m3_table`].
#[inline(always)]
pub(crate) fn decode_fp8_with(table: &[f32; 256], bytes: &[u8], out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(bytes) {
        *o = table[usize::from(b)];
    }
}

/// Decodes one element at `index` of a little-endian buffer to `f64` (fp8 times `scale`).
/// The reference attention reads the cache through this.
#[inline]
pub fn decode_one_f64(dtype: DType, bytes: &[u8], index: usize, scale: f32) -> f64 {
    match dtype {
        DType::F32 => {
            let b = &bytes[index * 4..index * 4 + 4];
            f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        DType::F16 => {
            let b = &bytes[index * 2..index * 2 + 2];
            f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f64()
        }
        DType::BF16 => {
            let b = &bytes[index * 2..index * 2 + 2];
            bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f64()
        }
        DType::Fp8E4M3 => f64::from(fp8_e4m3_to_f32(bytes[index])) * f64::from(scale),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fp8_code_round_trips() {
        for b in 0..=255u8 {
            let x = fp8_e4m3_to_f32(b);
            if b & 0x7f == 0x7f {
                assert!(x.is_nan(), "{b:#04x}");
                assert_eq!(f32_to_fp8_e4m3(x), FP8_E4M3_NAN);
            } else {
                assert_eq!(f32_to_fp8_e4m3(x), b, "{b:#04x} -> {x}");
            }
        }
    }

    #[test]
    fn fp8_known_values() {
        let known: [(u8, f32); 12] = [
            (0x00, 0.0),
            (0x01, 1.0 / 512.0),
            (0x07, 7.0 / 512.0),
            (0x08, 1.0 / 64.0),
            (0x38, 1.0),
            (0x39, 1.125),
            (0x40, 2.0),
            (0x7e, 448.0),
            (0x80, -0.0),
            (0xb8, -1.0),
            (0xfe, -448.0),
            (0x3f, 1.875),
        ];
        for (b, x) in known {
            assert_eq!(fp8_e4m3_to_f32(b).to_bits(), x.to_bits(), "{b:#04x}");
            assert_eq!(f32_to_fp8_e4m3(x), b, "{x}");
        }
    }

    #[test]
    fn fp8_rounding_and_saturation() {
        // Ties to even: 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39).
        assert_eq!(f32_to_fp8_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_fp8_e4m3(1.1875), 0x3a); // between 1.125 and 1.25 -> even 1.25
        assert_eq!(f32_to_fp8_e4m3(1.0626), 0x39);
        // Subnormal ties: 0.5 * 2^-9 -> 0, 1.5 * 2^-9 -> 2 * 2^-9.
        assert_eq!(f32_to_fp8_e4m3(0.5 / 512.0), 0x00);
        assert_eq!(f32_to_fp8_e4m3(1.5 / 512.0), 0x02);
        assert_eq!(f32_to_fp8_e4m3(-1e-9), 0x80);
        // Largest subnormal rounding up into the normals.
        assert_eq!(f32_to_fp8_e4m3(7.6 / 512.0), 0x08);
        // Saturation.
        for x in [448.0, 449.0, 464.0, 480.0, 1e6, f32::INFINITY] {
            assert_eq!(f32_to_fp8_e4m3(x), 0x7e, "{x}");
            assert_eq!(f32_to_fp8_e4m3(-x), 0xfe, "{x}");
        }
        assert_eq!(f32_to_fp8_e4m3(447.0), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(431.0), 0x7d); // 416 .. 448: 432 is the tie point
        assert_eq!(f32_to_fp8_e4m3(432.0), 0x7e); // tie -> even mantissa 110
        assert_eq!(f32_to_fp8_e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_fp8_e4m3(-f32::NAN), 0x7f);
    }

    #[test]
    fn fp8_matches_exhaustive_nearest_search() {
        // Every f32 on a dense grid maps to the nearest finite code, ties to the even code.
        let codes: Vec<(u8, f32)> = (0..=0x7eu8).map(|b| (b, fp8_e4m3_to_f32(b))).collect();
        let mut x = 0.0f32;
        while x < 460.0 {
            let got = f32_to_fp8_e4m3(x);
            let mut best = codes[0];
            for &(b, v) in &codes {
                let (d, db) = ((v - x).abs(), (best.1 - x).abs());
                if d < db || (d == db && b % 2 == 0) {
                    best = (b, v);
                }
            }
            assert_eq!(got, best.0, "x = {x}");
            x = if x < 1.0 {
                x + 1.0 / 4096.0
            } else {
                x * 1.0009
            };
        }
    }

    #[test]
    fn slices_round_trip_and_check_arguments() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.37).collect();
        for dtype in DType::ALL {
            let mut bytes = vec![0u8; x.len() * dtype.size_bytes()];
            encode(dtype, &x, 0.25, &mut bytes).unwrap();
            let mut back = vec![0f32; x.len()];
            decode(dtype, &bytes, 0.25, &mut back).unwrap();
            let tol = match dtype {
                DType::F32 => 0.0,
                DType::F16 => 1e-3,
                DType::BF16 => 8e-3,
                DType::Fp8E4M3 => 0.07,
            };
            for (a, b) in x.iter().zip(&back) {
                assert!(
                    (a - b).abs() <= tol * a.abs().max(0.25),
                    "{dtype}: {a} vs {b}"
                );
            }
            assert!(matches!(
                encode(dtype, &x, 0.0, &mut bytes),
                Err(Error::InvalidConfig { .. })
            ));
            assert!(matches!(
                decode(dtype, &bytes, f32::NAN, &mut back),
                Err(Error::InvalidConfig { .. })
            ));
            assert!(matches!(
                decode(dtype, &bytes[1..], 1.0, &mut back),
                Err(Error::ShapeMismatch { .. })
            ));
        }
        // fp8 stores x / scale.
        let mut b = [0u8; 1];
        encode(DType::Fp8E4M3, &[3.0], 1.5, &mut b).unwrap();
        assert_eq!(b[0], f32_to_fp8_e4m3(2.0));
        encode(DType::Fp8E4M3, &[1.0], 3.0, &mut b).unwrap();
        assert_eq!(b[0], f32_to_fp8_e4m3(1.0 / 3.0));
        assert_eq!(
            decode_one_f64(DType::Fp8E4M3, &b, 0, 3.0),
            f64::from(fp8_e4m3_to_f32(b[0])) * 3.0
        );
    }
}
