//! A small, fast, non-cryptographic 64-bit checksum for blocks read back from disk.
//!
//! FNV-1a's xor-then-multiply step, applied to 64-bit words over four independent lanes
//! (so the multiplies pipeline) and then to the lanes and the length. Each step is a
//! bijection of the lane state (xor with the input, multiply by an odd constant), so
//! changing any one word of a block always changes its checksum; random damage goes
//! undetected with probability about 2^-64. It guards against torn or corrupted disk
//! data, not against an adversary.

/// The 64-bit FNV prime.
const PRIME: u64 = 0x0000_0100_0000_01b3;
/// The 64-bit FNV offset basis.
const BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// The checksum of `data`.
pub fn checksum64(data: &[u8]) -> u64 {
    let mut lanes = [
        BASIS,
        BASIS ^ 0x9e37_79b9_7f4a_7c15,
        BASIS ^ 0xc2b2_ae3d_27d4_eb4f,
        BASIS ^ 0x1656_67b1_9e37_79f9,
    ];
    let mut chunks = data.chunks_exact(32);
    for chunk in &mut chunks {
        for (lane, word) in lanes.iter_mut().zip(chunk.chunks_exact(8)) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            *lane = (*lane ^ u64::from_le_bytes(w)).wrapping_mul(PRIME);
        }
    }
    let mut h = BASIS;
    for lane in lanes {
        // Fold each lane in with a final avalanche so lane differences spread.
        h = (h ^ (lane ^ (lane >> 29))).wrapping_mul(PRIME);
    }
    for &b in chunks.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(PRIME);
    }
    h = (h ^ data.len() as u64).wrapping_mul(PRIME);
    h ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_single_byte_change_is_detected() {
        let data: Vec<u8> = (0..203u32).map(|i| (i * 31 % 251) as u8).collect();
        let base = checksum64(&data);
        for i in 0..data.len() {
            for flip in [1u8, 0x80, 0xff] {
                let mut d = data.clone();
                d[i] ^= flip;
                assert_ne!(checksum64(&d), base, "byte {i} flip {flip:#x}");
            }
        }
        assert_ne!(checksum64(&data[..202]), base);
        assert_ne!(checksum64(&[]), checksum64(&[0]));
        assert_eq!(checksum64(&data), base);
    }
}
