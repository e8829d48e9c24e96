//! Synchronisation primitives, swapped for `loom`'s model-checked versions under
//! `--cfg loom` (crossbeam's pattern), so the same code is what loom explores.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU8, Ordering};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU8, Ordering};

/// A mutex with parking_lot's non-poisoning `lock()` signature in both builds.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T>(
    #[cfg(not(loom))] parking_lot::Mutex<T>,
    #[cfg(loom)] loom::sync::Mutex<T>,
);

#[cfg(not(loom))]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Mutex(parking_lot::Mutex::new(value))
    }
    pub(crate) fn lock(&self) -> parking_lot::MutexGuard<'_, T> {
        self.0.lock()
    }
}

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Mutex(loom::sync::Mutex::new(value))
    }
    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        // A poisoned lock only follows a panic in another model thread, which loom
        // reports on its own.
        match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}
