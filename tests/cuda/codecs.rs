//! The dtype codecs of `support::cuda`, checked once here rather than in every binary
//! that includes the support module: the fp8 reference encoder round-trips every
//! code, and kernels/common.cuh's fp8 conversions, transliterated, agree with it.

use crate::support::cuda::{fp8_encode, fp8_value};

#[test]
fn fp8_reference_encoder_round_trips_every_code() {
    for code in 0..=255u8 {
        let v = fp8_value(code);
        if v.is_nan() {
            continue;
        }
        let back = fp8_encode(v as f32);
        // +0 and -0 both exist; everything else is unique.
        assert!(
            back == code || (v == 0.0 && back & 0x7f == 0),
            "{code:#x} -> {v} -> {back:#x}"
        );
    }
    assert_eq!(fp8_encode(1000.0), 0x7e);
    assert_eq!(fp8_encode(-1000.0), 0xfe);
    // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): ties to even.
    assert_eq!(fp8_encode(1.0625), 0x38);
}

/// The fp8 conversions of kernels/common.cuh, transliterated to Rust step by step.
/// This checks the algorithms (bit tricks, rounding, saturation) on every input class
/// without a GPU; it does not check the compiled kernels, which the GPU tests do.
mod common_cuh_algorithms {
    use super::{fp8_encode, fp8_value};

    fn device_fp8_to_f32(b: u8) -> f32 {
        if b & 0x7f == 0x7f {
            return f32::NAN;
        }
        let h = (((b as u16) & 0x80) << 8) | (((b as u16) & 0x7f) << 7);
        half::f16::from_bits(h).to_f32() * 256.0
    }

    fn rintf(x: f32) -> f32 {
        x.round_ties_even()
    }

    fn device_f32_to_fp8(x: f32) -> u8 {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        let a = x.abs();
        if a.is_nan() {
            return 0x7f;
        }
        if a >= 448.0 {
            return sign | 0x7e;
        }
        if a < 0.015625 {
            return sign | rintf(a * 512.0) as u8;
        }
        let mut e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        let q = rintf(a * 2f32.powi(3 - e));
        let mut r = q as u32;
        if r == 16 {
            r = 8;
            e += 1;
        }
        let biased = e + 7;
        if biased > 15 || (biased == 15 && r - 8 == 7) {
            return sign | 0x7e;
        }
        sign | ((biased << 3) as u8 | (r - 8) as u8)
    }

    #[test]
    fn fp8_decode_trick_matches_the_format_for_every_code() {
        for code in 0..=255u8 {
            let (got, want) = (device_fp8_to_f32(code) as f64, fp8_value(code));
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{code:#x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn fp8_encoder_matches_exhaustive_search() {
        let mut x = 1e-5f32;
        let mut probes = vec![0.0, -0.0, 447.9, 448.0, 464.0, 1e9, f32::INFINITY, f32::NAN];
        while x < 600.0 {
            probes.push(x);
            probes.push(-x);
            x *= 1.0137;
        }
        // Every midpoint between neighbouring codes: the ties.
        for c in 0..0x7eu8 {
            let mid = ((fp8_value(c) + fp8_value(c + 1)) / 2.0) as f32;
            let (up, down) = (
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits() - 1),
            );
            probes.extend([mid, -mid, up, down]);
        }
        for p in probes {
            let (got, want) = (device_f32_to_fp8(p), fp8_encode(p));
            let zero_either_sign = fp8_value(got) == 0.0 && fp8_value(want) == 0.0;
            assert!(
                got == want || zero_either_sign,
                "{p}: device {got:#x}, search {want:#x}"
            );
        }
    }
}
