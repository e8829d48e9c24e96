//! Helpers shared by the GPU tests: skip reporting, a seeded RNG, and plain dtype
//! encoders/decoders written independently of the crate's (by exhaustive search for
//! fp8), so a kernel is checked against something it does not share code with.
#![allow(dead_code)]

use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
use pagedkv::{DType, Error, KvLayout};
use std::io::Write;

/// Prints a skip line that a plain `cargo test` shows (the harness captures
/// `eprintln!` of passing tests, not the stderr handle).
pub fn skip(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// A `CudaStorage`, or `None` (with a skip line) on a machine without a GPU.
/// Any other error fails the test, and so does a missing GPU when
/// `PAGEDKV_REQUIRE_GPU=1` (set by `.ci/gpu-check` on the GPU machine).
pub fn storage_or_skip(
    test: &str,
    layout: KvLayout,
    config: CudaStorageConfig,
) -> Option<CudaStorage> {
    match CudaStorage::new(layout, config) {
        Ok(s) => Some(s),
        Err(Error::CudaUnavailable(why)) => {
            if std::env::var("PAGEDKV_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: PAGEDKV_REQUIRE_GPU=1 but no GPU: {why}");
            }
            skip(test, &format!("no GPU: {why}"));
            None
        }
        Err(e) => panic!("{test}: CudaStorage::new failed on a machine with a GPU: {e}"),
    }
}

/// xorshift64*: deterministic, seedable, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

pub fn fp8_value(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = (code >> 3) & 0xf;
    let m = (code & 7) as f64;
    if e == 15 && m == 7.0 {
        return f64::NAN;
    }
    let mag = if e == 0 {
        m * 2f64.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e as i32 - 7)
    };
    sign * mag
}

/// Nearest e4m3 code, ties to the even code, saturating at 448, NaN -> 0x7f: a search
/// over the table of all 127 non-negative finite values (codes 0..=0x7e ascend).
pub fn fp8_encode(x: f32) -> u8 {
    static TABLE: std::sync::OnceLock<Vec<f64>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| (0..=0x7eu8).map(fp8_value).collect());
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = (x as f64).abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    // First code whose value is >= a; the nearest is it or the one below.
    let hi = table.partition_point(|&v| v < a).min(0x7e);
    let lo = hi.saturating_sub(1);
    let (dl, dh) = (a - table[lo], table[hi] - a);
    let code = if dl < dh || (dl == dh && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    sign | code as u8
}

/// Elements of `x` in `dtype` (fp8 as `x / scale`), as bytes.
pub fn encode(dtype: DType, x: &[f32], scale: f32) -> Vec<u8> {
    match dtype {
        DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => x
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::BF16 => x
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::Fp8E4M3 => x.iter().map(|v| fp8_encode(v / scale)).collect(),
    }
}

/// Bytes of `dtype` as f64 (fp8 times `scale`).
pub fn decode(dtype: DType, bytes: &[u8], scale: f64) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::Fp8E4M3 => bytes.iter().map(|&b| fp8_value(b) * scale).collect(),
    }
}

/// One element of NaN in `dtype`, as bytes.
pub fn nan_bytes(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => f32::NAN.to_le_bytes().to_vec(),
        DType::F16 => half::f16::NAN.to_le_bytes().to_vec(),
        DType::BF16 => half::bf16::NAN.to_le_bytes().to_vec(),
        DType::Fp8E4M3 => vec![0x7f],
    }
}
