//! [`TransferEngine`]: executes swap plans on a worker thread and reports each layer.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::executor::storage::Storage;
use crate::ids::SeqId;
use crate::ids::SwapTicket;
use crate::layout::plans::SwapPlan;
use crate::manager::SwapJob;

/// What the worker reports, in order, for each submitted job.
#[derive(Debug, Clone, PartialEq)]
pub enum TransferEvent {
    /// Every block of `layer` has landed (layers arrive in ascending order).
    Layer {
        /// The job.
        ticket: SwapTicket,
        /// The layer now complete.
        layer: usize,
    },
    /// The whole plan ran (or failed; layers after the failure were not moved).
    Done {
        /// The job.
        ticket: SwapTicket,
        /// Its outcome.
        result: Result<()>,
    },
}

struct Job {
    ticket: SwapTicket,
    plan: SwapPlan,
}

#[derive(Debug, Default)]
struct Progress {
    /// Layers landed so far (they land in order, so a count suffices).
    layers_done: usize,
    result: Option<Result<()>>,
    seqs: Vec<SeqId>,
}

/// Runs [`SwapJob`]s on a worker thread over a storage shared behind a lock.
///
/// Each job is one batched call per layer ([`Storage::swap_layer`], falling back to one
/// [`Storage::swap`] for backends without per-layer swaps), layer 0 first. The worker
/// sends a [`TransferEvent`] per layer and per job through a crossbeam channel, so the
/// engine never blocks on a transfer: it asks [`Self::is_layer_ready`] before running
/// attention on a layer of a sequence being swapped in, and calls
/// [`crate::KvCacheManager::complete_swap`] for every ticket that
/// [`Self::poll_completed`] returns. The lock is taken per layer, so other work on the
/// storage interleaves with a long transfer.
///
/// ```
/// use pagedkv::{CacheConfig, DType, HostStorage, KvCacheManager, KvLayout, ModelShape,
///               SeqId, TierConfig, TransferEngine};
///
/// let shape = ModelShape { num_layers: 4, num_q_heads: 4, num_kv_heads: 2, head_dim: 8,
///                          kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 16)?;
/// let mut kv = KvCacheManager::with_tiers(layout, CacheConfig::new(64),
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
            TransferEvent::Layer { ticket, layer } => {
                if let Some(p) = self.progress.get_mut(&ticket) {
                    p.layers_done = p.layers_done.max(layer + 1);
                }
            }
            TransferEvent::Done { ticket, result } => {
                if let Some(p) = self.progress.get_mut(&ticket) {
                    if result.is_ok() {
                        p.layers_done = self.num_layers;
                    }
                    p.result = Some(result);
                }
            }
        }
    }

    /// Whether `layer` of the transfer that moves `seq` has landed. A sequence with no
    /// tracked transfer (never submitted, or already taken by
    /// [`Self::poll_completed`]) is ready.
    pub fn is_layer_ready(&mut self, seq: SeqId, layer: usize) -> bool {
        self.drain();
        match self.by_seq.get(&seq).and_then(|t| self.progress.get(t)) {
            Some(p) => layer < p.layers_done,
            None => true,
        }
    }

    /// Whether the transfer `ticket` has finished (successfully or not).
    pub fn is_done(&mut self, ticket: SwapTicket) -> bool {
        self.drain();
        match self.progress.get(&ticket) {
            Some(p) => p.result.is_some(),
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
            match self.progress.get(&ticket) {
                None => return Err(Error::UnknownTicket(ticket)),
                Some(Progress {
                    result: Some(r), ..
                }) => return r.clone(),
                Some(_) => {}
            }
            match self.events.recv() {
                Ok(event) => self.apply(event),
                Err(_) => return Err(Error::Unsupported("transfer worker has stopped".into())),
            }
        }
    }

    /// Finished transfers and their outcomes, each reported once and then forgotten.
    /// Pass each successful ticket to [`crate::KvCacheManager::complete_swap`] and each
    /// failed one to [`crate::KvCacheManager::abort_swap`].
    pub fn poll_completed(&mut self) -> Vec<(SwapTicket, Result<()>)> {
        self.drain();
        let done: Vec<SwapTicket> = self
            .progress
            .iter()
            .filter(|(_, p)| p.result.is_some())
            .map(|(t, _)| *t)
            .collect();
        let mut out = Vec::with_capacity(done.len());
        for t in done {
            if let Some(p) = self.progress.remove(&t) {
                for s in &p.seqs {
                    if self.by_seq.get(s) == Some(&t) {
                        self.by_seq.remove(s);
                    }
                }
                out.push((t, p.result.unwrap_or(Ok(()))));
            }
        }
        out.sort_by_key(|(t, _)| *t);
        out
    }
}

/// Runs one job layer by layer; returns false when nobody listens any more.
fn run_job<S: Storage>(
    storage: &Mutex<S>,
    num_layers: usize,
    job: &Job,
    events: &Sender<TransferEvent>,
) -> bool {
    let ticket = job.ticket;
    let mut result = Ok(());
    for layer in 0..num_layers {
        let step = storage.lock().swap_layer(layer, &job.plan);
        match step {
            Ok(()) => {
                if events.send(TransferEvent::Layer { ticket, layer }).is_err() {
                    return false;
                }
            }
            Err(Error::Unsupported(_)) if layer == 0 => {
                // No per-layer path: one batched call for every layer, then report
                // them all.
                result = storage.lock().swap(&job.plan);
                if result.is_ok() {
                    for layer in 0..num_layers {
                        if events.send(TransferEvent::Layer { ticket, layer }).is_err() {
                            return false;
                        }
                    }
                }
                break;
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    events.send(TransferEvent::Done { ticket, result }).is_ok()
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
