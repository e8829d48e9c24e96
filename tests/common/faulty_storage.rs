//! A storage whose writes to one layer fail, as a device fault would: the import
//! tests (`tests/export.rs`, `tests/groups.rs`) check that such a fault frees what the
//! import admitted.

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
