//! [`TransferEngine`]: executes swap plans on a worker thread and reports each layer.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::executor::storage::{Storage, SwapFence};
use crate::ids::SeqId;
use crate::ids::SwapTicket;
use crate::layout::plans::SwapPlan;
use crate::layout::KvLayout;
use crate::manager::{
    DiskLoadItem, DiskLoadJob, DiskPlacement, DiskStoreItem, DiskStoreJob, SwapJob,
};
use crate::pool::prefix::BlockHash;

use super::disk_cache::{DiskPrefixStore, DiskStoreOutcome};
use super::prefix::DiskSpill;

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

/// What the worker runs, in submission order.
enum Work {
    Swap(Job),
    DiskStore {
        ticket: SwapTicket,
        items: Vec<DiskStoreItem>,
    },
    DiskStage {
        ticket: SwapTicket,
        items: Vec<DiskLoadItem>,
    },
}

/// Cumulative counters of the disk jobs a [`TransferEngine`] reported
/// ([`TransferEngine::disk_transfer_counters`]; published through
/// `metrics::ExtraCounters::with_disk_transfers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskTransferCounters {
    /// Store jobs reported (successful or not).
    pub store_jobs: u64,
    /// Microseconds they took on the worker.
    pub store_time_us: u64,
    /// Bytes they wrote.
    pub stored_bytes: u64,
    /// Staging (load) jobs reported.
    pub load_jobs: u64,
    /// Microseconds they took on the worker.
    pub load_time_us: u64,
    /// Bytes they read into host blocks.
    pub loaded_bytes: u64,
}

/// How a disk job run by the [`TransferEngine`]'s worker ended, reported once by
/// [`TransferEngine::poll_disk_completed`]. The manager's side is completed from it
/// (`executor::tier::complete_disk_jobs` does that): a store with
/// [`crate::KvCache::complete_disk_store`] of `placements`, a staging with
/// [`crate::KvCache::mark_disk_load_staged`] or, on failure,
/// [`crate::KvCache::abort_swap`] (after [`crate::KvCache::remove_disk_entry`] of
/// `drop_entry`).
#[derive(Debug, Clone, PartialEq)]
pub enum DiskJobReport {
    /// A host -> disk store ([`TransferEngine::submit_disk_store`]).
    Store {
        /// The store's ticket ([`DiskStoreJob::ticket`]).
        ticket: SwapTicket,
        /// Where each block stored (or found present) went, parents first; blocks not
        /// listed were not stored.
        placements: Vec<DiskPlacement>,
        /// The counts of those placements.
        spill: DiskSpill,
        /// The error that stopped the store, if any (the blocks before it are stored
        /// and journaled).
        error: Option<Error>,
        /// Bytes written to the store.
        bytes: u64,
        /// Time from the worker taking the job to its end.
        elapsed: Duration,
    },
    /// A disk -> host staging of a load ([`TransferEngine::submit_disk_stage`]).
    Stage {
        /// The load's ticket ([`DiskLoadJob::ticket`]).
        ticket: SwapTicket,
        /// The blocks staged, or the error that stopped the staging
        /// ([`Error::Checksum`], [`Error::DiskEntryMissing`], [`Error::Io`], the
        /// storage's errors).
        result: Result<usize>,
        /// The entry to drop from the disk index: a block missing from the store or
        /// whose bytes failed their checksum (the store dropped it already).
        drop_entry: Option<BlockHash>,
        /// Bytes read from the store into host blocks.
        bytes: u64,
        /// Time from the worker taking the job to its end.
        elapsed: Duration,
    },
}

impl DiskJobReport {
    /// The job's ticket.
    pub fn ticket(&self) -> SwapTicket {
        match self {
            DiskJobReport::Store { ticket, .. } | DiskJobReport::Stage { ticket, .. } => *ticket,
        }
    }
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
    /// Bytes the job moves, counted in flight until it is polled.
    bytes: u64,
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
/// With a [`DiskPrefixStore`] attached ([`Self::attach_disk_store`]) the same worker
/// runs the disk level's file I/O: stores ([`Self::submit_disk_store`]) and the
/// disk -> host staging of loads ([`Self::submit_disk_stage`]), reported by
/// [`Self::poll_disk_completed`], so no file is touched on the caller's thread. The
/// worker holds the storage's lock only to copy one host block and the store's lock
/// only for one block's file I/O, never both at once.
///
/// [`Self::set_in_flight_budget`] bounds the bytes submitted and not yet polled:
/// a submission past it is refused with [`Error::TransferBudget`], nothing queued.
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
    jobs: Option<Sender<Work>>,
    events: Receiver<TransferEvent>,
    worker: Option<JoinHandle<()>>,
    num_layers: usize,
    progress: HashMap<SwapTicket, Progress>,
    by_seq: HashMap<SeqId, SwapTicket>,
    block_bytes: u64,
    disk: Arc<Mutex<Option<DiskPrefixStore>>>,
    /// The attached store's layout, kept here so that submissions never wait on the
    /// store's lock (the worker may hold it through a long write).
    disk_layout: Option<KvLayout>,
    disk_events: Receiver<DiskJobReport>,
    /// Disk jobs submitted and not yet polled, with their bytes.
    disk_pending: HashMap<SwapTicket, u64>,
    budget: Option<u64>,
    in_flight_bytes: u64,
    disk_counters: DiskTransferCounters,
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
        let (num_layers, block_bytes) = {
            let s = storage.lock();
            (s.layout().num_layers(), s.layout().block_bytes())
        };
        let (job_tx, job_rx) = unbounded::<Work>();
        let (event_tx, event_rx) = unbounded();
        let (disk_tx, disk_rx) = unbounded();
        let worker_storage = Arc::clone(&storage);
        let disk: Arc<Mutex<Option<DiskPrefixStore>>> = Arc::new(Mutex::new(None));
        let worker_disk = Arc::clone(&disk);
        let worker = std::thread::Builder::new()
            .name("pagedkv-transfer".into())
            .spawn(move || {
                for work in job_rx {
                    let listening = match work {
                        Work::Swap(job) => run_job(&worker_storage, num_layers, &job, &event_tx),
                        Work::DiskStore { ticket, items } => disk_tx
                            .send(run_disk_store(
                                &worker_storage,
                                &worker_disk,
                                ticket,
                                &items,
                                block_bytes,
                            ))
                            .is_ok(),
                        Work::DiskStage { ticket, items } => disk_tx
                            .send(run_disk_stage(
                                &worker_storage,
                                &worker_disk,
                                ticket,
                                &items,
                                block_bytes,
                            ))
                            .is_ok(),
                    };
                    if !listening {
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
            block_bytes: block_bytes as u64,
            disk,
            disk_layout: None,
            disk_events: disk_rx,
            disk_pending: HashMap::new(),
            budget: None,
            in_flight_bytes: 0,
            disk_counters: DiskTransferCounters::default(),
        }
    }

    /// Gives the worker `store` for the disk jobs ([`Self::submit_disk_store`],
    /// [`Self::submit_disk_stage`]); returns the store attached before, if any. Jobs
    /// already queued run against the store attached when the worker takes them.
    pub fn attach_disk_store(&mut self, store: DiskPrefixStore) -> Option<DiskPrefixStore> {
        self.disk_layout = Some(*store.layout());
        self.disk.lock().replace(store)
    }

    /// Takes the attached store back (for example to close it before a restart);
    /// queued disk jobs then fail with [`Error::Unsupported`].
    pub fn detach_disk_store(&mut self) -> Option<DiskPrefixStore> {
        self.disk_layout = None;
        self.disk.lock().take()
    }

    /// The layout of the attached disk store (`None` without one); read without
    /// taking the store's lock.
    pub fn disk_store_layout(&self) -> Option<&KvLayout> {
        self.disk_layout.as_ref()
    }

    /// The attached disk store, shared with the worker: lock it for short reads
    /// (`entries`, `stats`); file I/O belongs to the worker.
    pub fn disk_store(&self) -> &Arc<Mutex<Option<DiskPrefixStore>>> {
        &self.disk
    }

    /// Bounds the bytes submitted and not yet polled as completed (swaps and disk
    /// jobs); `None` (the default) sets no bound. A submission that would take the
    /// bytes in flight past the budget is refused with [`Error::TransferBudget`] and
    /// nothing is queued, unless nothing is in flight: a job larger than the whole
    /// budget then runs alone, so the budget never stalls the engine for good.
    pub fn set_in_flight_budget(&mut self, bytes: Option<u64>) {
        self.budget = bytes;
    }

    /// The budget set by [`Self::set_in_flight_budget`].
    pub fn in_flight_budget(&self) -> Option<u64> {
        self.budget
    }

    /// Bytes submitted and not yet polled as completed.
    pub fn in_flight_bytes(&self) -> u64 {
        self.in_flight_bytes
    }

    /// How many more blocks fit in the budget now (`usize::MAX` without a budget; at
    /// least one block's worth is always admitted when nothing is in flight).
    pub fn budget_room_blocks(&self) -> usize {
        match self.budget {
            None => usize::MAX,
            Some(_) if self.in_flight_bytes == 0 => usize::MAX,
            Some(b) => {
                usize::try_from(b.saturating_sub(self.in_flight_bytes) / self.block_bytes.max(1))
                    .unwrap_or(usize::MAX)
            }
        }
    }

    fn check_budget(&self, needed: u64) -> Result<()> {
        match self.budget {
            Some(budget)
                if self.in_flight_bytes > 0
                    && self.in_flight_bytes.saturating_add(needed) > budget =>
            {
                Err(Error::TransferBudget {
                    needed,
                    in_flight: self.in_flight_bytes,
                    budget,
                })
            }
            _ => Ok(()),
        }
    }

    fn sender(&self) -> Result<&Sender<Work>> {
        match (&self.jobs, &self.worker) {
            (Some(s), Some(_)) => Ok(s),
            _ => Err(Error::Unsupported("transfer worker is not running".into())),
        }
    }

    fn check_disk_submission(&self, ticket: SwapTicket, blocks: usize) -> Result<u64> {
        if self.disk_pending.contains_key(&ticket) {
            return Err(Error::config(
                "ticket",
                format!("{ticket} was already submitted as a disk job"),
            ));
        }
        if self.disk_layout.is_none() {
            return Err(Error::Unsupported(
                "no disk store is attached to the transfer engine".into(),
            ));
        }
        let bytes = (blocks as u64).saturating_mul(self.block_bytes);
        self.check_budget(bytes)?;
        self.sender()?;
        Ok(bytes)
    }

    /// Queues a store to the disk level ([`crate::KvCache::plan_disk_store`]) for the
    /// worker; returns at once. Its report comes from [`Self::poll_disk_completed`].
    ///
    /// # Errors
    /// [`Error::TransferBudget`]; [`Error::Unsupported`] without an attached store or
    /// a running worker; [`Error::InvalidConfig`] for a ticket already queued. Nothing
    /// queued on error.
    pub fn submit_disk_store(&mut self, job: &DiskStoreJob) -> Result<()> {
        let work = Work::DiskStore {
            ticket: job.ticket,
            items: job.items.clone(),
        };
        self.queue_disk_job(job.ticket, job.items.len(), work)
    }

    /// Queues the disk -> host staging of a load ([`crate::KvCache::disk_load_job`])
    /// for the worker; returns at once. Once [`Self::poll_disk_completed`] reports it
    /// staged, the load's host -> device swap ([`crate::KvCache::load_job`]) can be
    /// submitted.
    ///
    /// # Errors
    /// As [`Self::submit_disk_store`].
    pub fn submit_disk_stage(&mut self, job: &DiskLoadJob) -> Result<()> {
        let work = Work::DiskStage {
            ticket: job.ticket,
            items: job.items.clone(),
        };
        self.queue_disk_job(job.ticket, job.items.len(), work)
    }

    /// Checks a disk job of `blocks` blocks against the budget, sends it to the worker
    /// and counts its bytes in flight; nothing queued on error.
    fn queue_disk_job(&mut self, ticket: SwapTicket, blocks: usize, work: Work) -> Result<()> {
        let bytes = self.check_disk_submission(ticket, blocks)?;
        self.sender()?
            .send(work)
            .map_err(|_| Error::Unsupported("transfer worker has stopped".into()))?;
        self.disk_pending.insert(ticket, bytes);
        self.in_flight_bytes += bytes;
        Ok(())
    }

    /// The disk jobs reported so far: counts, time on the worker, bytes.
    pub fn disk_transfer_counters(&self) -> DiskTransferCounters {
        self.disk_counters
    }

    /// Disk jobs submitted and not yet reported.
    pub fn disk_jobs_in_flight(&self) -> usize {
        self.disk_pending.len()
    }

    /// Finished disk jobs, each reported once, in the order the worker ran them;
    /// their bytes leave the in-flight count.
    pub fn poll_disk_completed(&mut self) -> Vec<DiskJobReport> {
        let mut out = Vec::new();
        while let Ok(report) = self.disk_events.try_recv() {
            if let Some(bytes) = self.disk_pending.remove(&report.ticket()) {
                self.in_flight_bytes = self.in_flight_bytes.saturating_sub(bytes);
            }
            let c = &mut self.disk_counters;
            match &report {
                DiskJobReport::Store { bytes, elapsed, .. } => {
                    c.store_jobs += 1;
                    c.store_time_us += elapsed.as_micros() as u64;
                    c.stored_bytes += bytes;
                }
                DiskJobReport::Stage { bytes, elapsed, .. } => {
                    c.load_jobs += 1;
                    c.load_time_us += elapsed.as_micros() as u64;
                    c.loaded_bytes += bytes;
                }
            }
            out.push(report);
        }
        out
    }

    /// The storage, shared with the worker.
    pub fn storage(&self) -> &Arc<Mutex<S>> {
        &self.storage
    }

    /// Queues `job` for the worker; returns at once.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the worker thread could not be started or has
    /// stopped; [`Error::InvalidConfig`] when the ticket is already tracked;
    /// [`Error::TransferBudget`] past the in-flight budget. Nothing queued on error.
    pub fn submit(&mut self, job: &SwapJob) -> Result<()> {
        if self.progress.contains_key(&job.ticket) {
            return Err(Error::config(
                "ticket",
                format!("{} was already submitted", job.ticket),
            ));
        }
        let bytes = (job.plan.len() as u64).saturating_mul(self.block_bytes);
        self.check_budget(bytes)?;
        self.sender()?
            .send(Work::Swap(Job {
                ticket: job.ticket,
                plan: job.plan.clone(),
            }))
            .map_err(|_| Error::Unsupported("transfer worker has stopped".into()))?;
        self.in_flight_bytes += bytes;
        self.progress.insert(
            job.ticket,
            Progress {
                seqs: job.seqs.clone(),
                bytes,
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
                self.in_flight_bytes = self.in_flight_bytes.saturating_sub(p.bytes);
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

fn no_store() -> Error {
    Error::Unsupported("no disk store is attached to the transfer engine".into())
}

/// Runs one disk store: each host block is copied out under the storage's lock, then
/// written under the store's lock (the same steps and outcomes as
/// [`DiskPrefixStore::store_from`]), parents first, stopping at the first error.
fn run_disk_store<S: Storage>(
    storage: &Mutex<S>,
    disk: &Mutex<Option<DiskPrefixStore>>,
    ticket: SwapTicket,
    items: &[DiskStoreItem],
    block_bytes: usize,
) -> DiskJobReport {
    let start = Instant::now();
    let mut placements = Vec::with_capacity(items.len());
    let mut spill = DiskSpill::default();
    let mut error = None;
    let mut buf = vec![0u8; block_bytes];
    for item in items {
        let present = disk.lock().as_ref().map(|d| d.slot_of(item.entry.hash));
        let outcome = match present {
            None => Err(no_store()),
            Some(Some(slot)) => Ok(DiskStoreOutcome::AlreadyPresent { slot }),
            Some(None) => storage
                .lock()
                .read_host_block(item.host, &mut buf)
                .and_then(|()| match disk.lock().as_mut() {
                    Some(d) => d.store(&item.entry, &buf),
                    None => Err(no_store()),
                }),
        };
        match outcome {
            Ok(DiskStoreOutcome::Stored { slot, evicted }) => {
                spill.stored_blocks += 1;
                spill.evicted_blocks += usize::from(evicted.is_some());
                placements.push(DiskPlacement {
                    hash: item.entry.hash,
                    slot,
                    evicted: evicted.map(|e| (e.hash, e.slot)),
                });
            }
            Ok(DiskStoreOutcome::AlreadyPresent { slot }) => {
                spill.already_present += 1;
                placements.push(DiskPlacement {
                    hash: item.entry.hash,
                    slot,
                    evicted: None,
                });
            }
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    DiskJobReport::Store {
        ticket,
        bytes: (spill.stored_blocks * block_bytes) as u64,
        placements,
        spill,
        error,
        elapsed: start.elapsed(),
    }
}

/// Runs one staging: each block is read and verified under the store's lock, then
/// written to its staging host block under the storage's lock (the steps of
/// [`DiskPrefixStore::load_into`]), stopping at the first failure.
fn run_disk_stage<S: Storage>(
    storage: &Mutex<S>,
    disk: &Mutex<Option<DiskPrefixStore>>,
    ticket: SwapTicket,
    items: &[DiskLoadItem],
    block_bytes: usize,
) -> DiskJobReport {
    let start = Instant::now();
    let mut buf = vec![0u8; block_bytes];
    let mut staged = 0usize;
    let mut failure = None;
    for item in items {
        let loaded = match disk.lock().as_mut() {
            Some(d) => d.load(item.hash, &mut buf),
            None => Err(no_store()),
        };
        let failed = match loaded {
            Ok(true) => match storage.lock().write_host_block(item.host, &buf) {
                Ok(()) => {
                    staged += 1;
                    continue;
                }
                Err(e) => (e, None),
            },
            Ok(false) => (
                Error::DiskEntryMissing { hash: item.hash.0 },
                Some(item.hash),
            ),
            Err(e @ Error::Checksum { .. }) => (e, Some(item.hash)),
            Err(e) => (e, None),
        };
        failure = Some(failed);
        break;
    }
    let bytes = (staged * block_bytes) as u64;
    let (result, drop_entry) = match failure {
        None => (Ok(staged), None),
        Some((e, drop)) => (Err(e), drop),
    };
    DiskJobReport::Stage {
        ticket,
        result,
        drop_entry,
        bytes,
        elapsed: start.elapsed(),
    }
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
