//! Foreign readers of a device arena: streams other than the storage's own (a decode
//! on an engine's stream, a replayed graph step) that read its blocks, each with the
//! last point recorded after its reads. Pure bookkeeping over an abstract event, so the
//! rules are tested on the CPU; `CudaStorage` plugs CUDA events in.
//!
//! The rules, for in-order streams:
//! - a point recorded later on a stream covers everything recorded on it before, so one
//!   entry per stream is enough: a new read replaces (re-records) the stream's point;
//! - work of the storage's own that overwrites or unmaps blocks (a write on the compute
//!   stream, a swap on the transfer stream, a shrink, the storage's drop) first waits for
//!   every entry: a stream on the device with an event wait ([`ReaderLedger::for_unwaited`]
//!   skips points that stream already waited for), the host by synchronising
//!   ([`ReaderLedger::drain`]);
//! - a point that has passed orders nothing any more and is forgotten
//!   ([`ReaderLedger::forget_completed`]), so the ledger holds only streams with reads in
//!   flight.
//!
//! The other direction (a foreign read waits for the writes before it) needs no ledger:
//! the reader's stream waits on a point recorded on the compute stream, and on the
//! layer's swap fence ([`super::fence`]).

/// Which of the storage's own streams waits for foreign readers on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum OwnStream {
    /// Kernels and K/V writes.
    Compute = 0,
    /// Swaps.
    Transfer = 1,
}

/// One foreign stream: its last recorded point, and which own streams already wait
/// for that point.
#[derive(Debug)]
struct Reader<E> {
    stream: usize,
    event: E,
    waited: [bool; 2],
}

/// Every foreign stream with reads of the arena possibly in flight; see the module docs.
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct ReaderLedger<E> {
    readers: Vec<Reader<E>>,
}

impl<E> Default for ReaderLedger<E> {
    fn default() -> Self {
        ReaderLedger {
            readers: Vec::new(),
        }
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl<E> ReaderLedger<E> {
    /// Streams with an entry.
    pub(crate) fn len(&self) -> usize {
        self.readers.len()
    }

    /// The event `stream` recorded last, to record again after new reads (then call
    /// [`Self::recorded`] with it); `None` when the stream has no entry.
    pub(crate) fn take_event(&mut self, stream: usize) -> Option<E> {
        let i = self.readers.iter().position(|r| r.stream == stream)?;
        Some(self.readers.swap_remove(i).event)
    }

    /// `stream` recorded `event` after its latest reads: it replaces the stream's entry
    /// (a later point covers the earlier ones), and no own stream has waited for it yet.
    pub(crate) fn recorded(&mut self, stream: usize, event: E) {
        self.readers.retain(|r| r.stream != stream);
        self.readers.push(Reader {
            stream,
            event,
            waited: [false; 2],
        });
    }

    /// Calls `wait` for every point `who` has not yet waited for, and marks each as
    /// waited once `wait` returns `Ok`. Stops at the first error (that point stays
    /// unwaited, so a later call retries it).
    pub(crate) fn for_unwaited<Er>(
        &mut self,
        who: OwnStream,
        mut wait: impl FnMut(&E) -> Result<(), Er>,
    ) -> Result<(), Er> {
        for r in self.readers.iter_mut().filter(|r| !r.waited[who as usize]) {
            wait(&r.event)?;
            r.waited[who as usize] = true;
        }
        Ok(())
    }

    /// Calls `wait` (a host synchronisation) for every point; each one waited for is
    /// forgotten, as every read before it has finished. Stops at the first error,
    /// keeping that point and those after it.
    pub(crate) fn drain<Er>(
        &mut self,
        mut wait: impl FnMut(&E) -> Result<(), Er>,
    ) -> Result<(), Er> {
        while let Some(r) = self.readers.last() {
            wait(&r.event)?;
            self.readers.pop();
        }
        Ok(())
    }

    /// Forgets the points that `is_complete` says have passed.
    pub(crate) fn forget_completed(&mut self, mut is_complete: impl FnMut(&E) -> bool) {
        self.readers.retain(|r| !is_complete(&r.event));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A fake event: the point's number on its stream and whether it has passed.
    #[derive(Debug, Clone, PartialEq)]
    struct Point {
        stream: usize,
        n: u32,
        done: std::rc::Rc<Cell<bool>>,
    }

    fn point(stream: usize, n: u32) -> Point {
        Point {
            stream,
            n,
            done: Default::default(),
        }
    }

    fn unwaited(l: &mut ReaderLedger<Point>, who: OwnStream) -> Vec<(usize, u32)> {
        let mut seen = Vec::new();
        l.for_unwaited::<()>(who, |p| {
            seen.push((p.stream, p.n));
            Ok(())
        })
        .unwrap();
        seen.sort();
        seen
    }

    #[test]
    fn one_entry_per_stream_and_a_new_point_is_waited_for_again() {
        let mut l = ReaderLedger::default();
        l.recorded(7, point(7, 1));
        l.recorded(9, point(9, 1));
        assert_eq!(l.len(), 2);
        assert_eq!(unwaited(&mut l, OwnStream::Compute), [(7, 1), (9, 1)]);
        // Waited once per own stream: compute has, transfer has not.
        assert_eq!(unwaited(&mut l, OwnStream::Compute), []);
        assert_eq!(unwaited(&mut l, OwnStream::Transfer), [(7, 1), (9, 1)]);
        // Stream 7 reads again: its entry is re-recorded, and both own streams must
        // wait for the new point (it covers reads the old one did not).
        let mut e = l.take_event(7).unwrap();
        assert_eq!(l.len(), 1);
        e.n = 2;
        l.recorded(7, e);
        assert_eq!(l.len(), 2);
        assert_eq!(unwaited(&mut l, OwnStream::Compute), [(7, 2)]);
        assert_eq!(unwaited(&mut l, OwnStream::Transfer), [(7, 2)]);
        assert!(l.take_event(3).is_none());
    }

    #[test]
    fn a_failed_wait_is_retried_and_completed_points_are_forgotten() {
        let mut l = ReaderLedger::default();
        l.recorded(1, point(1, 1));
        l.recorded(2, point(2, 1));
        let r: Result<(), &str> = l.for_unwaited(OwnStream::Compute, |p| {
            if p.stream == 2 {
                Err("refused")
            } else {
                Ok(())
            }
        });
        assert_eq!(r, Err("refused"));
        assert_eq!(unwaited(&mut l, OwnStream::Compute), [(2, 1)]);
        // Only passed points go.
        l.readers[0].event.done.set(true);
        l.forget_completed(|p| p.done.get());
        assert_eq!(l.len(), 1);
        // A host drain that fails keeps what it has not waited for.
        l.recorded(3, point(3, 1));
        let r: Result<(), ()> = l.drain(|p| if p.stream == 2 { Err(()) } else { Ok(()) });
        assert!(r.is_err());
        assert_eq!(l.len(), 1);
        l.drain::<()>(|_| Ok(())).unwrap();
        assert_eq!(l.len(), 0);
    }
}
