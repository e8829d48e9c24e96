//! Swap completion: which recorded point of a storage's transfer work covers which
//! layers, and what "complete" means. Pure bookkeeping over an abstract event, so the
//! rules are tested on the CPU with a fake event; `CudaStorage` plugs CUDA events in.
//!
//! The rules, for one in-order transfer stream:
//! - every enqueued swap (all its layers, or one layer of [`crate::Storage::swap_layer`])
//!   records its own completion point after its copies;
//! - a point recorded later on the same stream covers everything recorded before it,
//!   so "every swap so far has finished" is the *latest* point, never the point of the
//!   highest layer (swaps of single layers can arrive in any order);
//! - a layer is ready when the latest point recorded after one of *its* copies is.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::error::Result;

/// A recorded point of asynchronous transfer work, shared by the storage and whoever
/// waits for it ([`SwapFence`]). Implementations are cheap to query from any thread.
pub trait FenceEvent: Send + Sync + 'static {
    /// Whether everything enqueued before the point has finished (never blocks).
    ///
    /// # Errors
    /// Backend failures (a failed copy surfaces here).
    fn is_complete(&self) -> Result<bool>;

    /// Blocks the calling thread until [`Self::is_complete`].
    ///
    /// # Errors
    /// Backend failures.
    fn wait(&self) -> Result<()>;

    /// The backend's own type, so a backend can make a device stream wait on it
    /// (`CudaStorage::wait_fence_on`).
    fn as_any(&self) -> &dyn Any;
}

/// The completion point of swap work a [`crate::Storage`] enqueued: complete once every
/// copy enqueued before it has finished. Synchronous backends hand out
/// [`SwapFence::complete`]; `CudaStorage` hands out one CUDA event per enqueued swap,
/// which a caller's stream can also wait on without blocking the host.
#[derive(Clone, Default)]
pub struct SwapFence(Option<Arc<dyn FenceEvent>>);

impl SwapFence {
    /// A fence with nothing to wait for (the work ran synchronously).
    pub fn complete() -> Self {
        SwapFence(None)
    }

    /// A fence that completes with `event`.
    pub fn pending(event: Arc<dyn FenceEvent>) -> Self {
        SwapFence(Some(event))
    }

    /// Whether the work before the fence has finished (never blocks).
    ///
    /// # Errors
    /// The backend's failure (a copy that failed on the device).
    pub fn is_complete(&self) -> Result<bool> {
        match &self.0 {
            None => Ok(true),
            Some(e) => e.is_complete(),
        }
    }

    /// Blocks until the work before the fence has finished.
    ///
    /// # Errors
    /// As [`Self::is_complete`].
    pub fn wait(&self) -> Result<()> {
        match &self.0 {
            None => Ok(()),
            Some(e) => e.wait(),
        }
    }

    /// A fence complete when every one of `fences` is (storages made of several, such
    /// as [`crate::executor::shard::ShardedStorage`]).
    pub fn all(fences: Vec<SwapFence>) -> Self {
        let pending: Vec<SwapFence> = fences.into_iter().filter(|f| f.0.is_some()).collect();
        match pending.len() {
            0 => SwapFence::complete(),
            1 => pending.into_iter().next().unwrap_or_default(),
            _ => SwapFence::pending(Arc::new(AllFences(pending))),
        }
    }

    /// The backend's event, `None` for a fence created complete.
    pub fn event(&self) -> Option<&dyn FenceEvent> {
        self.0.as_deref()
    }
}

/// Two fences are equal when they are the same point (the same event), or both
/// complete-at-creation.
impl PartialEq for SwapFence {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl fmt::Debug for SwapFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            None => f.write_str("SwapFence(complete)"),
            Some(_) => f.write_str("SwapFence(pending)"),
        }
    }
}

/// Several fences as one.
struct AllFences(Vec<SwapFence>);

impl FenceEvent for AllFences {
    fn is_complete(&self) -> Result<bool> {
        for f in &self.0 {
            if !f.is_complete()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn wait(&self) -> Result<()> {
        self.0.iter().try_for_each(SwapFence::wait)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Which completion point covers which layer: the storage records one fence per
/// enqueued swap and tells the ledger which layers it covered.
// Only `CudaStorage` uses it; the unit tests run without the feature too.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone)]
pub(crate) struct FenceLedger<F> {
    /// The latest fence recorded after a copy of each layer.
    per_layer: Vec<Option<F>>,
    /// The latest fence recorded at all: it covers every earlier one (one in-order
    /// stream).
    latest: Option<F>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl<F: Clone> FenceLedger<F> {
    pub(crate) fn new(num_layers: usize) -> Self {
        FenceLedger {
            per_layer: vec![None; num_layers],
            latest: None,
        }
    }

    /// Notes that `fence` was recorded after the copies of `layers`.
    pub(crate) fn recorded(&mut self, layers: impl IntoIterator<Item = usize>, fence: F) {
        for layer in layers {
            if let Some(slot) = self.per_layer.get_mut(layer) {
                *slot = Some(fence.clone());
            }
        }
        self.latest = Some(fence);
    }

    /// The fence `layer` must pass before it holds its last swap's data (`None`:
    /// no swap ever touched it).
    pub(crate) fn layer(&self, layer: usize) -> Option<&F> {
        self.per_layer.get(layer).and_then(Option::as_ref)
    }

    /// The fence after which every swap enqueued so far has finished.
    pub(crate) fn latest(&self) -> Option<&F> {
        self.latest.as_ref()
    }

    /// Forgets fences for which `done` says true, so their events can be freed;
    /// forgotten fences count as complete.
    pub(crate) fn forget_completed(&mut self, mut done: impl FnMut(&F) -> bool) {
        for slot in &mut self.per_layer {
            if slot.as_ref().is_some_and(&mut done) {
                *slot = None;
            }
        }
        if self.latest.as_ref().is_some_and(&mut done) {
            self.latest = None;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use parking_lot::Mutex;

    /// A fake in-order stream: points are numbered as recorded; the test says how far
    /// the "device" has got.
    #[derive(Default)]
    pub(crate) struct FakeStream {
        pub(crate) recorded: Mutex<u64>,
        pub(crate) finished: Mutex<u64>,
    }

    pub(crate) struct FakeEvent {
        pub(crate) stream: Arc<FakeStream>,
        pub(crate) at: u64,
    }

    impl FakeStream {
        pub(crate) fn record(self: &Arc<Self>) -> SwapFence {
            let mut r = self.recorded.lock();
            *r += 1;
            SwapFence::pending(Arc::new(FakeEvent {
                stream: Arc::clone(self),
                at: *r,
            }))
        }
        pub(crate) fn finish_up_to(&self, n: u64) {
            *self.finished.lock() = n;
        }
    }

    impl FenceEvent for FakeEvent {
        fn is_complete(&self) -> Result<bool> {
            Ok(*self.stream.finished.lock() >= self.at)
        }
        fn wait(&self) -> Result<()> {
            let now = *self.stream.finished.lock();
            self.stream.finish_up_to(self.at.max(now));
            Ok(())
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    fn done(f: &SwapFence) -> bool {
        f.is_complete().unwrap()
    }

    #[test]
    fn out_of_order_layer_swaps_complete_only_with_the_latest_fence() {
        // A reported bug: swap_layer(3) then swap_layer(0); the device has finished
        // the first. The old rule asked the highest layer's event and said "complete".
        let stream = Arc::new(FakeStream::default());
        let mut ledger = FenceLedger::new(4);
        ledger.recorded([3], stream.record());
        ledger.recorded([0], stream.record());
        stream.finish_up_to(1);
        let old_rule = ledger.layer(3).map(done).unwrap_or(true);
        assert!(old_rule, "the highest layer's copy did finish");
        assert!(
            !done(ledger.latest().unwrap()),
            "layer 0 is still in flight"
        );
        assert!(!done(ledger.layer(0).unwrap()));
        assert!(ledger.layer(1).is_none() && ledger.layer(2).is_none());
        stream.finish_up_to(2);
        assert!(done(ledger.latest().unwrap()));
    }

    #[test]
    fn some_layers_only_and_a_whole_swap_after_them() {
        // Only layer 1 was swapped: the highest layer (3) has no event at all, which
        // the old rule read as "complete" (a stale earlier record).
        let stream = Arc::new(FakeStream::default());
        let mut ledger = FenceLedger::new(4);
        ledger.recorded([1], stream.record());
        assert!(ledger.layer(3).is_none());
        assert!(!done(ledger.latest().unwrap()));
        // A whole swap records per-layer fences in order; its last is its fence.
        for layer in 0..4 {
            ledger.recorded([layer], stream.record());
        }
        stream.finish_up_to(3); // the old layer-1 swap, and layers 0 and 1 of the new
        assert!(done(ledger.layer(0).unwrap()) && done(ledger.layer(1).unwrap()));
        assert!(!done(ledger.layer(2).unwrap()) && !done(ledger.latest().unwrap()));
        stream.finish_up_to(5);
        assert!(done(ledger.latest().unwrap()));
        ledger.forget_completed(done);
        assert!(ledger.latest().is_none() && (0..4).all(|l| ledger.layer(l).is_none()));
    }

    #[test]
    fn forgetting_keeps_fences_in_flight() {
        let stream = Arc::new(FakeStream::default());
        let mut ledger = FenceLedger::new(2);
        ledger.recorded([0], stream.record());
        ledger.recorded([1], stream.record());
        stream.finish_up_to(1);
        ledger.forget_completed(done);
        assert!(ledger.layer(0).is_none());
        assert!(ledger.layer(1).is_some() && ledger.latest().is_some());
        // Out-of-range layers are ignored, not a panic.
        ledger.recorded([7], stream.record());
        assert!(ledger.layer(7).is_none());
    }

    #[test]
    fn all_of_several_completes_with_the_slowest() {
        let (a, b) = (
            Arc::new(FakeStream::default()),
            Arc::new(FakeStream::default()),
        );
        let f = SwapFence::all(vec![a.record(), SwapFence::complete(), b.record()]);
        a.finish_up_to(1);
        assert!(!f.is_complete().unwrap());
        b.finish_up_to(1);
        assert!(f.is_complete().unwrap());
        assert!(SwapFence::all(vec![SwapFence::complete()])
            .event()
            .is_none());
    }

    #[test]
    fn complete_fences_need_no_backend() {
        let f = SwapFence::complete();
        assert!(f.is_complete().unwrap());
        f.wait().unwrap();
        assert!(f.event().is_none());
        assert_eq!(format!("{f:?}"), "SwapFence(complete)");
    }
}
