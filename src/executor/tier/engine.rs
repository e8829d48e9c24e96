//! [`TransferEngine`]: executes swap plans on a worker thread and reports each layer.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::executor::storage::{Storage, SwapFence};
use crate::ids::SeqId;
use crate::ids::SwapTicket;
use crate::layout::plans::SwapPlan;
use crate::manager::SwapJob;

/// What the worker reports, in order, for each submitted job. An asynchronous
/// storage (`CudaStorage`) only *enqueues* copies, so each report carries the fence
/// after which they have landed; [`TransferEngine`] answers "ready" only once it has.
#[derive(Debug, Clone, PartialEq)]
pub enum TransferEvent {
    /// Every copy of `layer` has been issued (layers are issued in ascending order);
    /// they have landed once `fence` is complete.
    Layer {
        /// The job.
        ticket: SwapTicket,
        /// The layer issued.
        layer: usize,
        /// Complete when the layer's copies have landed.
        fence: SwapFence,
    },
    /// The whole plan was issued (or failed; layers after the failure were not moved).
    Done {
        /// The job.
        ticket: SwapTicket,
        /// Its outcome as far as issuing goes; copies that fail on the device surface
        /// through `fence`.
        result: Result<()>,
        /// Complete when every copy of the job has landed.
        fence: SwapFence,
    },
}

struct Job {
    ticket: SwapTicket,
    plan: SwapPlan,
}

/// What is known of one job: the fence of each layer issued so far, and once it is
/// fully issued, its outcome and its last fence. Nothing here counts as landed until
/// its fence says so.
#[derive(Debug, Default)]
struct Progress {
    /// Fences of the layers issued so far, by layer.
    layer_fences: Vec<Option<SwapFence>>,
    /// The outcome of issuing, and the fence after every copy of the job.
    issued: Option<(Result<()>, SwapFence)>,
    /// A fence that reported an error (a copy failed on the device).
    failed: Option<Error>,
    seqs: Vec<SeqId>,
}

impl Progress {
    /// Whether `layer` has landed, asking its fence (never blocks).
    fn layer_landed(&mut self, layer: usize) -> bool {
        let Some(Some(fence)) = self.layer_fences.get(layer) else {
            return false;
        };
        match fence.is_complete() {
            Ok(done) => done,
            Err(e) => {
                self.failed = Some(e);
                false
            }
        }
    }

    /// The job's outcome once it is over: issued and landed, or failed.
    fn outcome(&mut self) -> Option<Result<()>> {
        if let Some(e) = &self.failed {
            return Some(Err(e.clone()));
        }
        let (result, fence) = self.issued.as_ref()?;
        if result.is_err() {
            return Some(result.clone());
        }
        match fence.is_complete() {
            Ok(true) => Some(Ok(())),
            Ok(false) => None,
            Err(e) => {
                self.failed = Some(e.clone());
                Some(Err(e))
            }
        }
    }
}

/// Runs [`SwapJob`]s on a worker thread over a storage shared behind a lock.
///
/// Each job is one batched call per layer ([`Storage::swap_layer`], falling back to one
/// [`Storage::swap`] for backends without per-layer swaps), layer 0 first. The worker
/// sends a [`TransferEvent`] per layer and per job through a crossbeam channel, so the
/// engine never blocks on a transfer: it asks [`Self::is_layer_ready`] before running
/// attention on a layer of a sequence being swapped in, and calls
/// [`crate::KvCache::complete_swap`] for every ticket that
/// [`Self::poll_completed`] returns. The lock is taken per layer, so other work on the
/// storage interleaves with a long transfer.
///
/// ```
/// use pagedkv::{CacheConfig, DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId,
///               TierConfig};
/// use pagedkv::executor::tier::TransferEngine;
///
/// let shape = ModelShape { num_layers: 4, num_q_heads: 4, num_kv_heads: 2, head_dim: 8,
///                          kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 16)?;
/// let mut kv = KvCache::with_tiers(layout, CacheConfig::new(64),
///                                         TierConfig { num_host_blocks: 64, num_disk_slots: 0 })?;
/// let mut engine = TransferEngine::new(HostStorage::with_host_tier(layout, 64, 64)?);
///
/// kv.admit(SeqId(1), 40, &mut Vec::new())?;
/// let job = kv.swap_out(SeqId(1))?;      // device blocks stay held until completion
/// engine.submit(&job)?;
/// engine.wait(job.ticket)?;              // or poll and do other work meanwhile
/// assert!(engine.is_layer_ready(SeqId(1), 3));
/// kv.complete_swap(job.ticket)?;         // now the device blocks are free
/// assert_eq!(kv.tier_stats().swapped_sequences, 1);
/// # Ok::<(), pagedkv::Error>(())
/// ```
pub struct TransferEngine<S: Storage + Send + 'static> {
    storage: Arc<Mutex<S>>,
    jobs: Option<Sender<Job>>,
    events: Receiver<TransferEvent>,
    worker: Option<JoinHandle<()>>,
    num_layers: usize,
    progress: HashMap<SwapTicket, Progress>,
    by_seq: HashMap<SeqId, SwapTicket>,
}

impl<S: Storage + Send + 'static> std::fmt::Debug for TransferEngine<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("num_layers", &self.num_layers)
            .field("tracked", &self.progress.len())
            .finish()
    }
}

impl<S: Storage + Send + 'static> TransferEngine<S> {
    /// Starts a worker over `storage`.
    pub fn new(storage: S) -> Self {
        Self::with_shared(Arc::new(Mutex::new(storage)))
    }

    /// Starts a worker over a storage the caller also uses (attention reads it between
    /// layers).
    pub fn with_shared(storage: Arc<Mutex<S>>) -> Self {
        let num_layers = storage.lock().layout().num_layers();
        let (job_tx, job_rx) = unbounded::<Job>();
        let (event_tx, event_rx) = unbounded();
        let worker_storage = Arc::clone(&storage);
        let worker = std::thread::Builder::new()
            .name("pagedkv-transfer".into())
            .spawn(move || {
                for job in job_rx {
                    if !run_job(&worker_storage, num_layers, &job, &event_tx) {
                        break;
                    }
                }
            })
            .ok();
        TransferEngine {
            storage,
            jobs: Some(job_tx),
            events: event_rx,
            worker,
            num_layers,
            progress: HashMap::new(),
            by_seq: HashMap::new(),
        }
    }

    /// The storage, shared with the worker.
    pub fn storage(&self) -> &Arc<Mutex<S>> {
        &self.storage
    }

    /// Queues `job` for the worker; returns at once.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the worker thread could not be started or has
    /// stopped; [`Error::InvalidConfig`] when the ticket is already tracked.
    pub fn submit(&mut self, job: &SwapJob) -> Result<()> {
        if self.progress.contains_key(&job.ticket) {
            return Err(Error::config(
                "ticket",
                format!("{} was already submitted", job.ticket),
            ));
        }
        let sender = match (&self.jobs, &self.worker) {
            (Some(s), Some(_)) => s,
            _ => return Err(Error::Unsupported("transfer worker is not running".into())),
        };
        sender
            .send(Job {
                ticket: job.ticket,
                plan: job.plan.clone(),
            })
            .map_err(|_| Error::Unsupported("transfer worker has stopped".into()))?;
        self.progress.insert(
            job.ticket,
            Progress {
                seqs: job.seqs.clone(),
                ..Progress::default()
            },
        );
        for &s in &job.seqs {
            self.by_seq.insert(s, job.ticket);
        }
        Ok(())
    }

    /// Takes every event the worker has sent so far into the progress table.
    fn drain(&mut self) {
        while let Ok(event) = self.events.try_recv() {
            self.apply(event);
        }
    }

    fn apply(&mut self, event: TransferEvent) {
        match event {
            TransferEvent::Layer {
                ticket,
                layer,
                fence,
            } => {
                if let Some(p) = self.progress.get_mut(&ticket) {
                    if p.layer_fences.len() <= layer {
                        p.layer_fences.resize(layer + 1, None);
                    }
                    p.layer_fences[layer] = Some(fence);
                }
            }
            TransferEvent::Done {
                ticket,
                result,
                fence,
            } => {
                if let Some(p) = self.progress.get_mut(&ticket) {
                    p.issued = Some((result, fence));
                }
            }
        }
    }

    /// Whether `layer` of the transfer that moves `seq` has landed: issued, and its
    /// fence complete (for `CudaStorage`, the copies have finished on the device, so
    /// any stream may read the layer). A sequence with no tracked transfer (never
    /// submitted, or already taken by [`Self::poll_completed`]) is ready.
    pub fn is_layer_ready(&mut self, seq: SeqId, layer: usize) -> bool {
        self.drain();
        match self.by_seq.get(&seq).and_then(|t| self.progress.get_mut(t)) {
            Some(p) => p.layer_landed(layer),
            None => true,
        }
    }

    /// The fence of `layer` of the transfer that moves `seq`, once the worker has
    /// issued it: a GPU engine makes its stream wait on it
    /// (`CudaStorage::wait_fence_on`) instead of polling [`Self::is_layer_ready`].
    /// `None` while the layer is not issued yet; [`SwapFence::complete`] for a
    /// sequence with no tracked transfer.
    pub fn layer_fence(&mut self, seq: SeqId, layer: usize) -> Option<SwapFence> {
        self.drain();
        match self.by_seq.get(&seq).and_then(|t| self.progress.get(t)) {
            Some(p) => p.layer_fences.get(layer).cloned().flatten(),
            None => Some(SwapFence::complete()),
        }
    }

    /// Whether the transfer `ticket` has finished (successfully or not): issued and
    /// landed, or failed.
    pub fn is_done(&mut self, ticket: SwapTicket) -> bool {
        self.drain();
        match self.progress.get_mut(&ticket) {
            Some(p) => p.outcome().is_some(),
            None => true,
        }
    }

    /// Blocks until `ticket` finishes and returns its outcome; the ticket stays tracked
    /// until [`Self::poll_completed`] takes it.
    ///
    /// # Errors
    /// The transfer's error; [`Error::UnknownTicket`] when it is not tracked;
    /// [`Error::Unsupported`] when the worker stopped before finishing it.
    pub fn wait(&mut self, ticket: SwapTicket) -> Result<()> {
        loop {
            self.drain();
            match self.progress.get_mut(&ticket) {
                None => return Err(Error::UnknownTicket(ticket)),
                Some(p) => {
                    if let Some((result, fence)) = &p.issued {
                        if let Err(e) = result {
                            return Err(e.clone());
                        }
                        // Issued: block on the device work itself, then report.
                        if let Err(e) = fence.wait() {
                            p.failed = Some(e);
                        }
                        return p.outcome().unwrap_or(Ok(()));
                    }
                }
            }
            match self.events.recv() {
                Ok(event) => self.apply(event),
                Err(_) => return Err(Error::Unsupported("transfer worker has stopped".into())),
            }
        }
    }

    /// Finished transfers and their outcomes, each reported once and then forgotten.
    /// Pass each successful ticket to [`crate::KvCache::complete_swap`] and each
    /// failed one to [`crate::KvCache::abort_swap`].
    pub fn poll_completed(&mut self) -> Vec<(SwapTicket, Result<()>)> {
        self.drain();
        let done: Vec<(SwapTicket, Result<()>)> = self
            .progress
            .iter_mut()
            .filter_map(|(t, p)| p.outcome().map(|r| (*t, r)))
            .collect();
        let mut out = Vec::with_capacity(done.len());
        for (t, result) in done {
            if let Some(p) = self.progress.remove(&t) {
                for s in &p.seqs {
                    if self.by_seq.get(s) == Some(&t) {
                        self.by_seq.remove(s);
                    }
                }
                out.push((t, result));
            }
        }
        out.sort_by_key(|(t, _)| *t);
        out
    }
}

/// Runs one job layer by layer; returns false when nobody listens any more. Each
/// layer's report carries the fence the storage gives right after issuing it, under
/// the same lock, so the fence covers that layer's copies.
fn run_job<S: Storage>(
    storage: &Mutex<S>,
    num_layers: usize,
    job: &Job,
    events: &Sender<TransferEvent>,
) -> bool {
    let ticket = job.ticket;
    let mut result = Ok(());
    let mut last = SwapFence::complete();
    for layer in 0..num_layers {
        let step = {
            let mut s = storage.lock();
            s.swap_layer(layer, &job.plan).and_then(|()| s.swap_fence())
        };
        match step {
            Ok(fence) => {
                last = fence.clone();
                if events
                    .send(TransferEvent::Layer {
                        ticket,
                        layer,
                        fence,
                    })
                    .is_err()
                {
                    return false;
                }
            }
            Err(Error::Unsupported(_)) if layer == 0 => {
                // No per-layer path: one batched call for every layer, then report
                // them all with its fence.
                let done = {
                    let mut s = storage.lock();
                    s.swap(&job.plan).and_then(|()| s.swap_fence())
                };
                match done {
                    Ok(fence) => {
                        last = fence.clone();
                        for layer in 0..num_layers {
                            let fence = fence.clone();
                            let report = TransferEvent::Layer {
                                ticket,
                                layer,
                                fence,
                            };
                            if events.send(report).is_err() {
                                return false;
                            }
                        }
                    }
                    Err(e) => result = Err(e),
                }
                break;
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    events
        .send(TransferEvent::Done {
            ticket,
            result,
            fence: last,
        })
        .is_ok()
}

impl<S: Storage + Send + 'static> Drop for TransferEngine<S> {
    fn drop(&mut self) {
        // Closing the job channel ends the worker after the jobs already queued.
        self.jobs = None;
        if let Some(worker) = self.worker.take() {
            // A worker that panicked has nothing left to clean up; never panic here.
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::storage::fence::tests::FakeStream;
    use crate::executor::storage::HostStorage;
    use crate::ids::BlockId;
    use crate::layout::plans::CopyPlan;
    use crate::layout::shape::{DType, ModelShape};
    use crate::layout::{KvLayout, Slot};
    use crate::manager::{CacheConfig, KvCache, TierConfig};

    /// A host storage that behaves like an asynchronous one: swaps return at once and
    /// are "on the device" until the test finishes the fake stream.
    struct Async {
        inner: HostStorage,
        stream: Arc<FakeStream>,
        latest: SwapFence,
    }

    impl Storage for Async {
        fn layout(&self) -> &KvLayout {
            self.inner.layout()
        }
        fn num_blocks(&self) -> usize {
            self.inner.num_blocks()
        }
        fn copy_blocks(&mut self, plan: &CopyPlan) -> Result<()> {
            self.inner.copy_blocks(plan)
        }
        fn write_slots(&mut self, layer: usize, slots: &[Slot], k: &[u8], v: &[u8]) -> Result<()> {
            self.inner.write_slots(layer, slots, k, v)
        }
        fn read_tokens(
            &self,
            layer: usize,
            table: &[BlockId],
            num_tokens: usize,
            k: &mut [u8],
            v: &mut [u8],
        ) -> Result<()> {
            self.inner.read_tokens(layer, table, num_tokens, k, v)
        }
        fn num_host_blocks(&self) -> usize {
            self.inner.num_host_blocks()
        }
        fn resize(&mut self, num_blocks: usize) -> Result<()> {
            self.inner.resize(num_blocks)
        }
        fn swap(&mut self, plan: &SwapPlan) -> Result<()> {
            self.inner.swap(plan)?;
            self.latest = self.stream.record();
            Ok(())
        }
        fn swap_layer(&mut self, layer: usize, plan: &SwapPlan) -> Result<()> {
            self.inner.swap_layer(layer, plan)?;
            self.latest = self.stream.record();
            Ok(())
        }
        fn swap_fence(&self) -> Result<SwapFence> {
            Ok(self.latest.clone())
        }
    }

    fn drain_until(engine: &mut TransferEngine<Async>, seq: SeqId, layer: usize) {
        let start = std::time::Instant::now();
        while engine.layer_fence(seq, layer).is_none() {
            assert!(
                start.elapsed().as_secs() < 20,
                "worker never issued layer {layer}"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// One 20-token sequence of a `num_layers`-layer model swapped out through an engine
    /// over a fake stream: the manager, the stream, the engine and the submitted job.
    fn swap_submitted(
        num_layers: usize,
    ) -> (KvCache, Arc<FakeStream>, TransferEngine<Async>, SwapJob) {
        let shape = ModelShape {
            num_layers,
            num_q_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            kv_dtype: DType::F16,
        };
        let layout = KvLayout::new(shape, 16).unwrap();
        let tiers = TierConfig {
            num_host_blocks: 8,
            num_disk_slots: 0,
        };
        let mut kv = KvCache::with_tiers(layout, CacheConfig::new(8), tiers).unwrap();
        kv.admit(SeqId(1), 20, &mut Vec::new()).unwrap();
        let stream = Arc::new(FakeStream::default());
        let storage = Async {
            inner: HostStorage::with_host_tier(layout, 8, 8).unwrap(),
            stream: Arc::clone(&stream),
            latest: SwapFence::complete(),
        };
        let mut engine = TransferEngine::new(storage);
        let job = kv.swap_out(SeqId(1)).unwrap();
        engine.submit(&job).unwrap();
        (kv, stream, engine, job)
    }

    #[test]
    fn layers_are_ready_when_their_copies_land_not_when_issued() {
        // A reported bug: the old engine said "ready" as soon as swap_layer returned.
        let (mut kv, stream, mut engine, job) = swap_submitted(3);
        drain_until(&mut engine, SeqId(1), 2);
        // Every layer issued, none landed.
        for layer in 0..3 {
            assert!(!engine.is_layer_ready(SeqId(1), layer), "layer {layer}");
        }
        let start = std::time::Instant::now();
        while engine.progress[&job.ticket].issued.is_none() {
            assert!(start.elapsed().as_secs() < 20);
            engine.drain();
        }
        assert!(!engine.is_done(job.ticket));
        assert!(engine.poll_completed().is_empty());
        // The device finishes layer 0 only.
        stream.finish_up_to(1);
        assert!(engine.is_layer_ready(SeqId(1), 0));
        assert!(!engine.is_layer_ready(SeqId(1), 1));
        assert!(!engine.is_done(job.ticket));
        // The fences are the storage's, so a GPU caller could wait on them instead.
        assert!(engine
            .layer_fence(SeqId(1), 0)
            .unwrap()
            .is_complete()
            .unwrap());
        stream.finish_up_to(3);
        assert!(engine.is_layer_ready(SeqId(1), 2));
        assert!(engine.is_done(job.ticket));
        assert_eq!(engine.poll_completed(), vec![(job.ticket, Ok(()))]);
        kv.complete_swap(job.ticket).unwrap();
    }

    #[test]
    fn wait_blocks_on_the_fence_and_the_fallback_shares_one_fence() {
        let (_kv, stream, mut engine, job) = swap_submitted(2);
        // `wait` blocks on the fence (the fake's wait finishes the stream).
        engine.wait(job.ticket).unwrap();
        assert_eq!(*stream.finished.lock(), 2);
        assert!(engine.is_layer_ready(SeqId(1), 1));
        // Progress with one fence for every layer (the fallback path) lands at once.
        let mut p = Progress::default();
        let f = stream.record();
        p.layer_fences = vec![Some(f.clone()), Some(f.clone())];
        p.issued = Some((Ok(()), f));
        assert!(!p.layer_landed(0) && !p.layer_landed(1) && p.outcome().is_none());
        stream.finish_up_to(3);
        assert!(p.layer_landed(0) && p.layer_landed(1));
        assert_eq!(p.outcome(), Some(Ok(())));
    }
}
