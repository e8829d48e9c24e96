//! A storage whose writes to one layer fail, as a device fault would: the import
//! tests (`tests/io/export.rs`, `tests/cache/groups.rs`) check that such a fault frees what the
//! import admitted. And [`FlakyStorage`], whose swaps and host-tier copies fail
//! partway (`tests/memory/transfer_faults.rs`).

#![allow(dead_code)] // each test binary uses its own part

use std::sync::atomic::{AtomicUsize, Ordering};

use pagedkv::{Error, HostStorage};

/// A storage whose writes to one layer fail, as a device fault would.
pub struct FaultyStorage {
    /// Where the writes that do not fail go.
    pub inner: HostStorage,
    /// Every write to this layer fails.
    pub failing_layer: usize,
}

// No host tier: per-layer swaps and host-block I/O keep the trait's refusal.
pagedkv::delegate_storage! {
    FaultyStorage => inner, except [
        write_slots, num_host_blocks, swap_layer, read_host_block, write_host_block,
    ];

    fn write_slots(
        &mut self,
        layer: usize,
        slots: &[pagedkv::layout::Slot],
        k: &[u8],
        v: &[u8],
    ) -> pagedkv::Result<()> {
        if layer == self.failing_layer {
            return Err(Error::Cuda("simulated fault".into()));
        }
        self.inner.write_slots(layer, slots, k, v)
    }
    fn num_host_blocks(&self) -> usize {
        0
    }
}

/// A host storage with a host tier whose transfers fail on demand, as a copy engine or
/// a device would partway through: swaps (per layer, or whole plans for backends
/// without per-layer swaps) and host-block reads and writes (the disk tier's copies).
/// Used by `tests/memory/transfer_faults.rs`.
pub struct FlakyStorage {
    /// Where the copies that do not fail go.
    pub inner: HostStorage,
    /// Swap calls that still fail; each failure counts down one.
    pub swap_failures: usize,
    /// The layer whose per-layer swap fails (earlier layers are copied).
    pub fail_at_layer: usize,
    /// Whether the storage swaps per layer; without, the transfer engine falls back to
    /// whole-plan swaps, and a failing one copies the first half of its pairs in
    /// every layer before it fails.
    pub per_layer: bool,
    /// Host-block reads and writes that succeed before the next one fails
    /// (`usize::MAX`: none fails); a failure resets it to `usize::MAX`.
    pub host_io_left: AtomicUsize,
}

impl FlakyStorage {
    /// Nothing fails until told to.
    pub fn new(inner: HostStorage, per_layer: bool) -> Self {
        FlakyStorage {
            inner,
            swap_failures: 0,
            fail_at_layer: 0,
            per_layer,
            host_io_left: AtomicUsize::new(usize::MAX),
        }
    }

    /// Lets `n` host-block reads and writes succeed, then fails the next one.
    pub fn fail_host_io_after(&self, n: usize) {
        self.host_io_left.store(n, Ordering::Relaxed);
    }

    fn host_io(&self) -> pagedkv::Result<()> {
        match self.host_io_left.load(Ordering::Relaxed) {
            usize::MAX => Ok(()),
            0 => {
                self.host_io_left.store(usize::MAX, Ordering::Relaxed);
                Err(Error::Io("simulated host-tier fault".into()))
            }
            n => {
                self.host_io_left.store(n - 1, Ordering::Relaxed);
                Ok(())
            }
        }
    }
}

fn simulated() -> Error {
    Error::Cuda("simulated copy fault".into())
}

pagedkv::delegate_storage! {
    FlakyStorage => inner, except [swap, swap_layer, read_host_block, write_host_block];

    fn swap(&mut self, plan: &pagedkv::SwapPlan) -> pagedkv::Result<()> {
        if self.swap_failures == 0 {
            return self.inner.swap(plan);
        }
        self.swap_failures -= 1;
        let mut half = pagedkv::SwapPlan::new(plan.direction());
        for p in &plan.pairs()[..plan.len() / 2] {
            half.push(p.device, p.host);
        }
        self.inner.swap(&half)?;
        Err(simulated())
    }
    fn swap_layer(&mut self, layer: usize, plan: &pagedkv::SwapPlan) -> pagedkv::Result<()> {
        if !self.per_layer {
            return Err(Error::Unsupported("whole-plan swaps only".into()));
        }
        if self.swap_failures > 0 && layer == self.fail_at_layer {
            self.swap_failures -= 1;
            return Err(simulated());
        }
        self.inner.swap_layer(layer, plan)
    }
    fn read_host_block(&self, block: pagedkv::BlockId, out: &mut [u8]) -> pagedkv::Result<()> {
        self.host_io()?;
        self.inner.read_host_block(block, out)
    }
    fn write_host_block(&mut self, block: pagedkv::BlockId, data: &[u8]) -> pagedkv::Result<()> {
        self.host_io()?;
        self.inner.write_host_block(block, data)
    }
}
