//! The small world of the tier tests (`memory/{tier_cache, tier_engine,
//! disk_tier_cache, disk_cache, prefix_spill}.rs`): a tiny layout, temporary
//! directories, prompts, where a hit's tokens are, the disk index check and a flipped
//! byte in a file.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use pagedkv::executor::tier::DiskPrefixStore;
use pagedkv::{AdmitOptions, DType, KvCache, KvLayout, ModelShape, PrefixHit};

/// Tokens per block of [`layout`].
pub const BS: usize = 4;

/// Two layers, two query heads over one KV head of dimension 4, `f32`: small enough to
/// check every byte, with GQA.
pub fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, BS).unwrap()
}

static DIRS: AtomicUsize = AtomicUsize::new(0);

/// A directory under the system temp dir, unique in this process, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> Self {
        let n = DIRS.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("pagedkv-tiers-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `n` consecutive token ids from `base`.
pub fn prompt(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

/// What a lookup of `prompt` finds, without admitting it.
pub fn hit_of(kv: &KvCache, prompt: &[u32]) -> PrefixHit {
    let mut hit = PrefixHit::default();
    kv.lookup_prefix(prompt, &AdmitOptions::default(), &mut hit)
        .unwrap();
    hit
}

/// A hit's tokens on the device, the host and the disk.
pub fn tiers(hit: &PrefixHit) -> (usize, usize, usize) {
    (hit.device_tokens(), hit.host_tokens(), hit.disk_tokens())
}

/// The manager's disk index names exactly the store's entries, at their slots.
pub fn assert_index_matches(kv: &KvCache, store: &DiskPrefixStore) {
    assert_eq!(kv.disk_cache_stats().cached_blocks, store.len());
    for (slot, e) in store.entries() {
        assert_eq!(kv.disk_cache_slot(e.hash), Some(slot), "{:?}", e.hash);
    }
}

/// Flips one bit of the byte at `at` in the file at `path`.
pub fn flip(path: &Path, at: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
}
