//! A thread-safe handle for engines that call the manager from several threads.

use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use super::{CacheStats, KvCache};
use crate::error::Result;
use crate::ids::SeqId;
use crate::layout::plans::CopyPlan;
use crate::layout::Slot;

/// A cloneable, thread-safe handle to one [`KvCache`].
///
/// Each call takes the lock once; for several operations that must see one consistent
/// state (a scheduler step), take the guard with [`Self::lock`].
#[derive(Debug, Clone)]
pub struct SharedKvCache {
    inner: Arc<Mutex<KvCache>>,
}

impl SharedKvCache {
    /// Wraps a manager.
    pub fn new(manager: KvCache) -> Self {
        SharedKvCache {
            inner: Arc::new(Mutex::new(manager)),
        }
    }

    /// Locks the manager for a sequence of calls.
    pub fn lock(&self) -> MutexGuard<'_, KvCache> {
        self.inner.lock()
    }

    /// See [`KvCache::admit`].
    ///
    /// # Errors
    /// As [`KvCache::admit`].
    pub fn admit(&self, seq: SeqId, num_tokens: usize, slots: &mut Vec<Slot>) -> Result<()> {
        self.inner.lock().admit(seq, num_tokens, slots)
    }

    /// See [`KvCache::append`].
    ///
    /// # Errors
    /// As [`KvCache::append`].
    pub fn append(
        &self,
        seq: SeqId,
        n: usize,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        self.inner.lock().append(seq, n, slots, copies)
    }

    /// See [`KvCache::fork`].
    ///
    /// # Errors
    /// As [`KvCache::fork`].
    pub fn fork(&self, parent: SeqId, child: SeqId) -> Result<()> {
        self.inner.lock().fork(parent, child)
    }

    /// See [`KvCache::free`].
    ///
    /// # Errors
    /// As [`KvCache::free`].
    pub fn free(&self, seq: SeqId) -> Result<()> {
        self.inner.lock().free(seq)
    }

    /// See [`KvCache::stats`].
    pub fn stats(&self) -> CacheStats {
        self.inner.lock().stats()
    }
}
