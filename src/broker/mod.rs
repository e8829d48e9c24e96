//! Several models, one memory budget: a broker that moves KV memory, in chunks, to the
//! model under load.
//!
//! A [`Broker`] owns a budget of bytes (VRAM with `CudaStorage`, host memory with
//! [`HostStorage`](crate::executor::storage::HostStorage)) cut into chunks of
//! [`BrokerConfig::chunk_bytes`] (on CUDA, the VMM granule: 2 MiB). Each registered
//! model is a [`KvCache`] and its [`Storage`], of any shape and block size; a
//! chunk is, for each model, the whole number of its blocks that fits in the chunk
//! (`chunk_bytes / block_bytes`; the rest of the chunk is charged but unused, and
//! [`ModelBudget::blocks_per_chunk`] says how much). Every byte of the budget is, at
//! every moment, in exactly one place: free, granted to one model, or held by one
//! external [`Reservation`].
//!
//! # Moves
//!
//! A model under pressure calls [`ModelGuard::ensure_available`] from its scheduler:
//!
//! 1. it grows into free budget ([`MoveReason::Grow`]);
//! 2. it takes chunks another model holds as free blocks ([`MoveReason::TakeIdle`]):
//!    the other model shrinks ([`shrink_to`], which moves the few blocks above the new
//!    end into holes below it, i.e. the defragmentation that shrink needs), keeping
//!    [`BrokerConfig::keep_free_chunks`] of free blocks so it does not immediately
//!    need them back;
//! 3. it takes chunks another model's prefix cache holds: cached blocks are evicted
//!    ([`KvCache::evict_cached`]), then the other model shrinks
//!    ([`MoveReason::TakeCached`]). Cold caches go first, whatever their holder's
//!    priority; a warm cache only to a model of no lower priority (below).
//!
//! Victims are tried lowest priority first. No model goes below its floor or above
//! its ceiling ([`ModelLimits`]).
//!
//! A model whose scheduler is mid-step (a sequence holds an uncommitted
//! [`KvCache::reserve`] or [`KvCache::reserve_step`]: the model is
//! writing through the slots it was handed) gives nothing, whether or not its lock is
//! held: a shrink would move the blocks under the step's slots. The broker tries the
//! next donor, and [`Broker::sleep`] refuses such a model.
//!
//! # Cache is not running work
//!
//! Priority protects what a model is doing: its referenced blocks are never taken (only
//! free and unreferenced cached blocks are), nor its floor, and while a model is warm
//! its cache is taken only by models of no lower priority. A model is *cold* when it
//! held no sequence when its lock was last released and has held none for
//! [`BrokerConfig::cold_cache_steps`] steps of the broker clock ([`Broker::set_clock`]);
//! its unreferenced cached blocks above its floor are then idle memory that any model
//! under pressure (or a reservation) takes, before any warm model's cache. Why: a
//! finished request's blocks stay cached, so without this rule a high-priority model
//! that served a burst and went quiet keeps its whole peak as cache, and models of
//! lower priority under load queue beside it until it is put to sleep (the
//! `serve_multi --shared-prefix-tokens 64` run fell below a static equal split). The
//! steps of grace keep the cache of a model between two close bursts, so its next
//! request still hits. A cold model that gets a request again is warm at once and
//! takes memory back like any other (from free budget, idle blocks, cold caches).
//! `cold_cache_steps: None` restores the older rule (a cache is protected by its
//! holder's priority always). Coldness is read without the holder's lock, so it can be
//! a step stale; that costs at most a cache hit, never a referenced block. A model can be put to sleep ([`Broker::sleep`]: its
//! arena shrinks to the floor, optionally after swapping its sequences out to the host
//! tier and spilling its prefix cache there, still indexed) and woken
//! ([`Broker::wake`], which restores the spilled prefixes so they hit again). External
//! consumers take bytes with
//! [`Broker::reserve`] and give them back with [`Broker::release`].
//!
//! Every move is a [`MoveEvent`] (who gave, who took, bytes, why), published on the
//! `metrics` facade (see [`metric_names`]) and drawn by [`Broker::events_svg`].
//!
//! # Locking
//!
//! One `parking_lot::Mutex` per model (its manager and storage) and one for the
//! ledger (the budget's bookkeeping and the event log). The rules:
//!
//! * a thread blocks on at most one model lock, its own ([`Broker::lock`]); the lock of
//!   any *other* model is only ever tried ([`Mutex::try_lock`], or `try_lock_for` with
//!   a bound for reservations), so two schedulers asking for each other's memory never
//!   deadlock, and a scheduler never waits for another model's decode step;
//! * the ledger lock is taken last and held only for arithmetic (never across storage
//!   work or a model lock acquisition);
//! * memory is taken from another model one chunk at a time, and that model's lock is
//!   released after each chunk: a scheduler whose model is giving memory waits at most
//!   one chunk move (one [`shrink_to`] by one chunk) before its decode step runs.
//!
//! While a model's lock is free, its arena holds exactly `granted chunks x
//! blocks_per_chunk` blocks ([`Broker::check_invariants`] checks it).
//!
//! ```
//! use std::time::Duration;
//! use pagedkv::broker::{Broker, BrokerConfig, ModelLimits};
//! use pagedkv::{DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId};
//!
//! let shape = |layers, heads| ModelShape { num_layers: layers, num_q_heads: 8,
//!     num_kv_heads: heads, head_dim: 64, kv_dtype: DType::F16 };
//! let mut broker = Broker::new(BrokerConfig::new(8 << 20, 1 << 20))?; // 8 chunks of 1 MiB
//! let mut ids = Vec::new();
//! for (name, layout) in [("chat", KvLayout::new(shape(4, 2), 16)?),
//!                        ("embed", KvLayout::new(shape(2, 4), 32)?)] {
//!     let blocks = 2 * broker.blocks_per_chunk(&layout)?;          // two chunks each
//!     let kv = KvCache::builder(layout).num_blocks(blocks).build()?;
//!     let storage = HostStorage::new(layout, blocks)?;
//!     ids.push(broker.register(name, kv, storage, ModelLimits::new(1 << 20, 6 << 20))?);
//! }
//! // The chat model (32 blocks per chunk) needs 90 blocks: it grows by one chunk of
//! // free budget.
//! let mut chat = broker.lock(ids[0])?;
//! assert_eq!(chat.ensure_available(90)?, 96);
//! chat.kv_mut().admit(SeqId(1), 88 * 16, &mut Vec::new())?;
//! drop(chat);
//! // An external consumer takes 1 MiB, from the free budget here (from the arenas'
//! // idle or cached blocks when the budget is all granted).
//! let r = broker.reserve(1 << 20, Duration::from_millis(100))?;
//! assert_eq!(broker.stats().free_bytes, 2 << 20);
//! broker.check_invariants().map_err(pagedkv::Error::Unsupported)?;
//! broker.release(r)?;
//! assert!(broker.events().len() >= 4);
//! # Ok::<(), pagedkv::Error>(())
//! ```

mod svg;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::executor::storage::Storage;
use crate::executor::tier::{restore_spilled_prefixes, spill_cached_prefixes};
use crate::executor::{grow_to, shrink_to};
use crate::ids::SeqId;
use crate::layout::KvLayout;
use crate::manager::KvCache;

/// Names the broker publishes on the `metrics` facade.
pub mod metric_names {
    /// Counter: bytes moved, labels `from`, `to` (a model's name, `free` or
    /// `external`) and `reason` ([`super::MoveReason::name`]).
    pub const MOVED_BYTES: &str = "pagedkv_broker_moved_bytes_total";
    /// Counter: moves, same labels as [`MOVED_BYTES`].
    pub const MOVES: &str = "pagedkv_broker_moves_total";
    /// Gauge: bytes granted to a model, label `model`.
    pub const GRANTED_BYTES: &str = "pagedkv_broker_granted_bytes";
    /// Gauge: bytes of the budget no one holds.
    pub const FREE_BYTES: &str = "pagedkv_broker_free_bytes";
    /// Gauge: bytes held by external reservations.
    pub const RESERVED_BYTES: &str = "pagedkv_broker_reserved_bytes";
    /// Counter: prefix-cache blocks spilled to the host tier by a sleep, label `model`.
    pub const SPILLED_BLOCKS: &str = "pagedkv_broker_spilled_blocks_total";
    /// Counter: prefix-cache blocks evicted by a move (a sleep, a take of cached
    /// memory), label `model`.
    pub const EVICTED_BLOCKS: &str = "pagedkv_broker_evicted_blocks_total";
    /// Counter: spilled prefix-cache blocks restored to the device by a wake, label
    /// `model`.
    pub const RESTORED_BLOCKS: &str = "pagedkv_broker_restored_blocks_total";
}

/// A registered model, numbered from 0 in registration order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelId(pub u32);

impl std::fmt::Display for ModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "model{}", self.0)
    }
}

/// An external reservation, numbered from 1 in the order they were asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationId(pub u64);

/// The budget and how it is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BrokerConfig {
    /// Bytes the broker hands out, in all: model arenas plus external reservations.
    pub budget_bytes: usize,
    /// The unit of every move, in bytes (on CUDA, the VMM allocation granule).
    pub chunk_bytes: usize,
    /// Chunks of free blocks a model keeps when another model takes its idle memory,
    /// so that it does not need them back at its next step (hysteresis).
    pub keep_free_chunks: usize,
    /// The physical allocation granule of the storage, per layer region (on CUDA, the
    /// VMM granularity: 2 MiB), or 0 when memory is not mapped in granules (the host
    /// backend). [`Broker::register`] reads the storage's own granule
    /// ([`Storage::mapping_granule_bytes`]) and uses it when this is 0; a declared one
    /// must be a multiple of it. With a granule, [`Broker::register`] accepts only models whose chunk is
    /// exactly its blocks and whose per-layer share of a chunk is a whole number of
    /// granules, so that a move maps or unmaps exactly its accounted bytes:
    /// [`chunk_bytes_for`] gives the smallest such chunk for a set of models.
    pub granule_bytes: usize,
    /// Broker clock steps ([`Broker::set_clock`]) a model must have held no sequence
    /// before its prefix cache stops being protected by its priority, or `None` to
    /// protect it always. A cold model's unreferenced cached blocks above its floor
    /// can be taken by any model under pressure, and are taken before the caches of
    /// models that are still warm (see the module docs, *Cache is not running work*).
    pub cold_cache_steps: Option<u64>,
}

impl BrokerConfig {
    /// `budget_bytes` cut into chunks of `chunk_bytes`; a victim keeps one chunk free;
    /// no physical granule; a model's cache turns cold after
    /// [`Self::DEFAULT_COLD_CACHE_STEPS`] steps without a sequence.
    pub fn new(budget_bytes: usize, chunk_bytes: usize) -> Self {
        BrokerConfig {
            budget_bytes,
            chunk_bytes,
            keep_free_chunks: 1,
            granule_bytes: 0,
            cold_cache_steps: Some(Self::DEFAULT_COLD_CACHE_STEPS),
        }
    }

    /// Default of [`Self::cold_cache_steps`]: long enough that a model between two
    /// bursts of requests keeps its cache, short against a phase of minutes.
    pub const DEFAULT_COLD_CACHE_STEPS: u64 = 20;

    /// The same budget and chunk, with `cold_cache_steps` (`None`: a model's cache is
    /// always protected by its priority, as running work is).
    pub fn with_cold_cache_steps(self, cold_cache_steps: Option<u64>) -> Self {
        BrokerConfig {
            cold_cache_steps,
            ..self
        }
    }

    /// The same budget and chunk, with each layer region mapped in `granule_bytes`.
    pub fn with_granule(self, granule_bytes: usize) -> Self {
        BrokerConfig {
            granule_bytes,
            ..self
        }
    }
}

/// Swaps every sequence of `seqs` of hybrid `kv` out to the host tier, one job per
/// sequence: every job is planned (or none), every plan executed, then every job
/// completed; a failed transfer aborts them all, so the sequences stay resident and
/// the host blocks written are free again.
fn swap_out_each<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    seqs: &[SeqId],
) -> Result<()> {
    let jobs = kv.swap_out_each_grouped(seqs)?;
    let copied = jobs
        .iter()
        .flat_map(|job| &job.plans)
        .try_for_each(|plan| storage.swap(plan));
    if let Err(e) = copied {
        for job in jobs.iter().rev() {
            kv.abort_swap_grouped(job)?;
        }
        return Err(e);
    }
    jobs.iter()
        .try_for_each(|job| kv.complete_swap_grouped(job))
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn lcm(a: usize, b: usize) -> Option<usize> {
    (a / gcd(a, b)).checked_mul(b)
}

/// The smallest chunk that every one of `layouts` fills exactly with whole blocks
/// while each of its layer regions grows or shrinks by whole granules of
/// `granule_bytes`: for a model of `L` layers and `p` bytes per block per layer,
/// chunks are multiples of `L * lcm(p, granule)`; the chunk is the least common
/// multiple of those over the models. With such a chunk, a move's physical footprint
/// (what the storage maps or unmaps, per layer rounded to the granule) equals its
/// accounted bytes. Models with many layers in different counts make it large (32 and
/// 28 layers of 64 KiB blocks per layer: 448 MiB on a 2 MiB granule).
///
/// ```
/// use pagedkv::broker::chunk_bytes_for;
/// use pagedkv::{DType, KvLayout, ModelShape};
///
/// let shape = |layers| ModelShape { num_layers: layers, num_q_heads: 8,
///     num_kv_heads: 2, head_dim: 128, kv_dtype: DType::BF16 };
/// let a = KvLayout::new(shape(4), 16)?; // 16 KiB per block per layer
/// let b = KvLayout::new(shape(3), 16)?;
/// // 4 layers x 2 MiB and 3 layers x 2 MiB: a 24 MiB chunk.
/// assert_eq!(chunk_bytes_for(&[a, b], 2 << 20)?, 24 << 20);
/// # Ok::<(), pagedkv::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidConfig`] for no layouts, a granule of 0, or a chunk that overflows.
pub fn chunk_bytes_for(layouts: &[KvLayout], granule_bytes: usize) -> Result<usize> {
    if layouts.is_empty() || granule_bytes == 0 {
        return Err(Error::config(
            "chunk_bytes_for",
            "needs at least one layout and a positive granule",
        ));
    }
    let overflow = || Error::config("chunk_bytes_for", "the chunk overflows usize");
    let mut chunk = 1;
    for l in layouts {
        let per_layer =
            lcm(l.block_bytes_per_layer().max(1), granule_bytes).ok_or_else(overflow)?;
        let model = per_layer.checked_mul(l.num_layers()).ok_or_else(overflow)?;
        chunk = lcm(chunk, model).ok_or_else(overflow)?;
    }
    Ok(chunk)
}

/// Bytes the storage maps for `blocks` blocks of `layout`: each layer region rounded up
/// to the granule (no rounding with a granule of 0).
fn mapped_bytes(layout: &KvLayout, blocks: usize, granule_bytes: usize) -> usize {
    let region = blocks * layout.block_bytes_per_layer();
    let region = match granule_bytes {
        0 => region,
        g => region.div_ceil(g) * g,
    };
    region * layout.num_layers()
}

/// One model's guarantee, limit and priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLimits {
    /// Bytes the model always keeps (rounded up to whole chunks).
    pub floor_bytes: usize,
    /// Bytes the model never exceeds (rounded down to whole chunks).
    pub ceiling_bytes: usize,
    /// Higher keeps its prefix cache against lower; victims are tried lowest first.
    pub priority: i32,
}

impl ModelLimits {
    /// Floor and ceiling in bytes, priority 0.
    pub fn new(floor_bytes: usize, ceiling_bytes: usize) -> Self {
        ModelLimits {
            floor_bytes,
            ceiling_bytes,
            priority: 0,
        }
    }

    /// The same limits with `priority`.
    pub fn with_priority(self, priority: i32) -> Self {
        ModelLimits { priority, ..self }
    }
}

/// One side of a move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Party {
    /// The unallocated part of the budget.
    Free,
    /// A model's arena.
    Model(ModelId),
    /// An external reservation.
    External(ReservationId),
}

/// Why memory moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MoveReason {
    /// A model's initial arena, at registration.
    Register,
    /// A model under pressure grew into free budget.
    Grow,
    /// A model under pressure took another model's free blocks.
    TakeIdle,
    /// A model under pressure took blocks another model's prefix cache held (evicted).
    TakeCached,
    /// A model went to sleep: its arena shrank to its floor.
    Sleep,
    /// A model woke and grew back.
    Wake,
    /// An external reservation took memory (from the free budget or an arena).
    Reserve,
    /// An external reservation gave its memory back (released, or timed out).
    Release,
    /// A model's storage refused to grow; the chunks went back to the free budget.
    GrowFailed,
}

impl MoveReason {
    /// Lowercase name, the `reason` label of the metrics.
    pub const fn name(self) -> &'static str {
        match self {
            MoveReason::Register => "register",
            MoveReason::Grow => "grow",
            MoveReason::TakeIdle => "take_idle",
            MoveReason::TakeCached => "take_cached",
            MoveReason::Sleep => "sleep",
            MoveReason::Wake => "wake",
            MoveReason::Reserve => "reserve",
            MoveReason::Release => "release",
            MoveReason::GrowFailed => "grow_failed",
        }
    }
}

/// One move of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveEvent {
    /// Position in the broker's log, from 0.
    pub seq: u64,
    /// The broker's clock when it happened ([`Broker::set_clock`]; a scheduler step).
    pub clock: u64,
    /// Who gave.
    pub from: Party,
    /// Who took.
    pub to: Party,
    /// Bytes moved (whole chunks).
    pub bytes: usize,
    /// Why.
    pub reason: MoveReason,
    /// Blocks the giving model copied to shrink (0 when its tail was already free).
    pub moved_blocks: usize,
    /// Prefix-cache blocks of the giving model copied to its host tier before it
    /// shrank (a sleep with [`SleepOptions::spill_cached_prefixes`]); still indexed,
    /// restored by [`Broker::wake`].
    pub spilled_blocks: usize,
    /// Prefix-cache blocks of the giving model evicted for this move (a sleep without
    /// spilling, or with a host tier too small for all of them; a
    /// [`MoveReason::TakeCached`]).
    pub evicted_blocks: usize,
}

/// The block counts of a move besides its bytes (the tail of a [`MoveEvent`]).
#[derive(Debug, Clone, Copy, Default)]
struct MoveBlocks {
    moved: usize,
    spilled: usize,
    evicted: usize,
}

/// One model's share of the budget, from the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelBudget {
    /// The model.
    pub id: ModelId,
    /// Its name.
    pub name: String,
    /// Bytes granted now (whole chunks).
    pub granted_bytes: usize,
    /// Highest `granted_bytes` so far.
    pub peak_bytes: usize,
    /// Floor, in bytes (whole chunks).
    pub floor_bytes: usize,
    /// Ceiling, in bytes (whole chunks).
    pub ceiling_bytes: usize,
    /// Its blocks in one chunk.
    pub blocks_per_chunk: usize,
    /// Bytes of one of its blocks.
    pub block_bytes: usize,
    /// Bytes the storage maps for one chunk of this model: its blocks' bytes, each
    /// layer rounded up to the granule ([`BrokerConfig::granule_bytes`], or the
    /// storage's own). Equal to the chunk when the
    /// chunk fits the model exactly ([`chunk_bytes_for`]); below it when part of the
    /// chunk is charged but unused (no granule; the chunk not a whole number of blocks).
    pub mapped_bytes_per_chunk: usize,
    /// Whether it sleeps.
    pub sleeping: bool,
}

/// Where the budget is, from the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerStats {
    /// The budget.
    pub budget_bytes: usize,
    /// Bytes no one holds.
    pub free_bytes: usize,
    /// Bytes held by external reservations.
    pub reserved_bytes: usize,
    /// Highest `budget - free` so far.
    pub peak_used_bytes: usize,
    /// Each model's share, by id.
    pub models: Vec<ModelBudget>,
}

/// Bytes an external consumer holds; give them back with [`Broker::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reservation holds budget until it is released"]
pub struct Reservation {
    id: ReservationId,
    bytes: usize,
    broker: u64,
}

impl Reservation {
    /// Its id (as in the events).
    pub fn id(&self) -> ReservationId {
        self.id
    }

    /// Bytes it holds (the request rounded up to whole chunks).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// What [`Broker::sleep`] does first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SleepOptions {
    /// Swap every resident sequence out to the host tier (one fork group, so shared
    /// prefix blocks move once; on a hybrid cache one
    /// [`KvCache::swap_out_each_grouped`] job per sequence, each with its own copy of
    /// a shared block) before shrinking; otherwise the live blocks must fit the floor.
    pub swap_out_sequences: bool,
    /// Copy the prefix cache's unreferenced blocks to the host tier before shrinking
    /// (after the swap-out, so the blocks the sequences leave cached are spilled too),
    /// as many as the host tier has free blocks for; they stay indexed and
    /// [`Broker::wake`] restores them. The rest is evicted, as without this option.
    pub spill_cached_prefixes: bool,
}

/// What [`Broker::sleep`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SleepReport {
    /// Bytes given back to the free budget.
    pub freed_bytes: usize,
    /// Prefix-cache blocks spilled to the host tier.
    pub spilled_blocks: usize,
    /// Prefix-cache blocks evicted.
    pub evicted_blocks: usize,
}

/// What [`Broker::wake`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WakeReport {
    /// Bytes the model holds afterwards.
    pub granted_bytes: usize,
    /// Spilled prefix-cache blocks copied back and findable again.
    pub restored_blocks: usize,
    /// Spilled blocks given up (their content was computed on the device again
    /// meanwhile, or their parent is gone).
    pub dropped_blocks: usize,
    /// Spilled blocks left on the host tier (no free device block for them).
    pub still_spilled_blocks: usize,
}

/// A model's manager and storage, behind its lock.
#[derive(Debug)]
pub struct ModelState<S> {
    kv: KvCache,
    storage: S,
    sleeping: bool,
}

#[derive(Debug)]
struct ModelSlot<S> {
    name: String,
    priority: i32,
    floor_chunks: usize,
    ceiling_chunks: usize,
    blocks_per_chunk: usize,
    block_bytes: usize,
    mapped_bytes_per_chunk: usize,
    /// Whether the model held a sequence when its lock was last released.
    active: AtomicBool,
    /// The broker clock when the model was last seen holding a sequence.
    active_at: AtomicU64,
    state: Mutex<ModelState<S>>,
}

#[derive(Debug, Default)]
struct Ledger {
    free_chunks: usize,
    granted: Vec<usize>,
    peak: Vec<usize>,
    sleeping: Vec<bool>,
    reservations: HashMap<u64, usize>,
    next_reservation: u64,
    peak_used_chunks: usize,
    events: Vec<MoveEvent>,
    /// Names for the metric labels, by model id.
    names: Vec<String>,
}

static NEXT_BROKER: AtomicU64 = AtomicU64::new(1);

/// One memory budget shared by several models and external consumers; see the module
/// docs. `Sync` when `S: Send`: share it with `Arc` and give each scheduler thread its
/// [`ModelId`].
#[derive(Debug)]
pub struct Broker<S> {
    config: BrokerConfig,
    budget_chunks: usize,
    models: Vec<ModelSlot<S>>,
    ledger: Mutex<Ledger>,
    clock: AtomicU64,
    instance: u64,
}

/// A model's lock, held by its scheduler for a step; the manager and storage inside,
/// and [`Self::ensure_available`] to get memory.
///
/// Do not resize the arena through it ([`grow_to`], [`shrink_to`],
/// `plan_grow`/`plan_shrink` or [`Storage::resize`]): the broker's ledger would no
/// longer match, which [`Broker::check_invariants`] reports and the broker's next
/// move on this model refuses.
#[derive(Debug)]
pub struct ModelGuard<'a, S: Storage> {
    broker: &'a Broker<S>,
    id: ModelId,
    state: MutexGuard<'a, ModelState<S>>,
}

impl<S: Storage> ModelGuard<'_, S> {
    /// The model.
    pub fn id(&self) -> ModelId {
        self.id
    }

    /// The manager.
    pub fn kv(&self) -> &KvCache {
        &self.state.kv
    }

    /// The manager, for scheduling calls.
    pub fn kv_mut(&mut self) -> &mut KvCache {
        &mut self.state.kv
    }

    /// The storage.
    pub fn storage(&self) -> &S {
        &self.state.storage
    }

    /// Manager and storage together (writing K/V through the slots it hands out).
    pub fn parts_mut(&mut self) -> (&mut KvCache, &mut S) {
        let st = &mut *self.state;
        (&mut st.kv, &mut st.storage)
    }

    /// Whether the model sleeps.
    pub fn is_sleeping(&self) -> bool {
        self.state.sleeping
    }

    /// Makes at least `blocks` blocks available to this model if the budget allows:
    /// free budget first, then other models' free blocks, then their prefix caches
    /// (cold ones of any priority first, then warm ones of models of no higher
    /// priority: see the module docs); whole chunks, up to the ceiling. Returns
    /// the blocks available afterwards ([`KvCache::num_available_blocks`]),
    /// which is below `blocks` when the budget could not provide them (the scheduler
    /// then delays an admission or preempts). A sleeping model does not grow.
    ///
    /// Another model's lock is only tried, never waited for: a model busy with its own
    /// step is skipped.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the arena no longer matches the ledger (resized
    /// behind the broker's back); the storage's error when it refuses to grow (the
    /// chunks go back to the free budget, [`MoveReason::GrowFailed`]).
    pub fn ensure_available(&mut self, blocks: usize) -> Result<usize> {
        let available = self.state.kv.num_available_blocks();
        if available >= blocks || self.state.sleeping {
            return Ok(available);
        }
        let b = self.broker;
        let slot = &b.models[self.id.0 as usize];
        let want = (blocks - available).div_ceil(slot.blocks_per_chunk);
        b.acquire_for_model(self.id, &mut self.state, want, MoveReason::Grow)?;
        Ok(self.state.kv.num_available_blocks())
    }
}

impl<S: Storage> Drop for ModelGuard<'_, S> {
    /// Notes whether the model holds a sequence, for [`BrokerConfig::cold_cache_steps`]
    /// (only a guard changes the sequences, so its release is the moment to look).
    fn drop(&mut self) {
        let slot = &self.broker.models[self.id.0 as usize];
        let active = self.state.kv.stats().num_sequences > 0;
        if active {
            let clock = self.broker.clock.load(Ordering::Relaxed);
            slot.active_at.store(clock, Ordering::Relaxed);
        }
        slot.active.store(active, Ordering::Relaxed);
    }
}

impl<S: Storage> Broker<S> {
    /// A broker with no models.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the chunk is 0 or the budget holds no chunk.
    pub fn new(config: BrokerConfig) -> Result<Self> {
        if config.chunk_bytes == 0 {
            return Err(Error::config("chunk_bytes", "must be positive"));
        }
        let budget_chunks = config.budget_bytes / config.chunk_bytes;
        if budget_chunks == 0 {
            return Err(Error::config(
                "budget_bytes",
                format!(
                    "{} bytes hold no chunk of {}",
                    config.budget_bytes, config.chunk_bytes
                ),
            ));
        }
        Ok(Broker {
            config,
            budget_chunks,
            models: Vec::new(),
            ledger: Mutex::new(Ledger {
                free_chunks: budget_chunks,
                next_reservation: 1,
                ..Ledger::default()
            }),
            clock: AtomicU64::new(0),
            instance: NEXT_BROKER.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }

    /// Blocks of `layout` in one chunk.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when one block is larger than a chunk.
    pub fn blocks_per_chunk(&self, layout: &KvLayout) -> Result<usize> {
        let n = self.config.chunk_bytes / layout.block_bytes();
        if n == 0 {
            return Err(Error::config(
                "chunk_bytes",
                format!(
                    "a chunk of {} bytes is smaller than one block of {} bytes",
                    self.config.chunk_bytes,
                    layout.block_bytes()
                ),
            ));
        }
        Ok(n)
    }

    /// Registers a model whose arena (`kv` and `storage`, of equal size) is a whole
    /// number of chunks, taken from the free budget ([`MoveReason::Register`]). A
    /// hybrid cache ([`KvCache::hybrid`]) registers with the one storage of its pages
    /// and resizes across its groups; its [`Broker::sleep`] swaps its sequences out
    /// one job per sequence, and with `spill_cached_prefixes` refuses
    /// ([`Error::NotOnHybrid`], nothing changed).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the arena is not a whole number of chunks, lies
    /// outside `[floor, ceiling]`, the floor is not above the manager's watermark, the
    /// storage's layout differs, the storage does not map exactly
    /// ([`Storage::mapping_granule_bytes`] is `None`), or, with a granule (the
    /// storage's, or [`BrokerConfig::granule_bytes`], which must be a multiple of the
    /// storage's), a chunk would map other than its own bytes for this model;
    /// [`Error::ShapeMismatch`] for a storage of another size; [`Error::OutOfBlocks`]
    /// (in chunks) when the free budget is too small.
    pub fn register(
        &mut self,
        name: impl Into<String>,
        kv: KvCache,
        storage: S,
        limits: ModelLimits,
    ) -> Result<ModelId> {
        let name = name.into();
        let bpc = self.blocks_per_chunk(kv.layout())?;
        let layout = *kv.layout();
        // The storage's own granule where it has one (CUDA), else the declared one.
        let granule = match (storage.mapping_granule_bytes(), self.config.granule_bytes) {
            (None, _) => {
                return Err(Error::config(
                    "storage",
                    format!(
                        "{name}: the storage can keep more memory mapped after a shrink than \
                         its arena holds (CudaStorage: set CudaStorageConfig::granule_chunks), \
                         so a chunk would not map exactly its bytes"
                    ),
                ))
            }
            (Some(s), 0) if s > 1 => s,
            (Some(_), 0) => 0,
            (Some(s), g) if g % s != 0 => {
                return Err(Error::config(
                    "granule_bytes",
                    format!("{name}: {g} is not a multiple of the storage's granule of {s}"),
                ))
            }
            (Some(_), g) => g,
        };
        let mapped = mapped_bytes(&layout, bpc, granule);
        if granule > 0 && mapped != self.config.chunk_bytes {
            return Err(Error::config(
                "chunk_bytes",
                format!(
                    "{name}: a chunk of {} bytes maps {mapped} bytes ({bpc} blocks of {} bytes, \
                     {} layers each rounded to the {}-byte granule); chunk_bytes_for gives a \
                     chunk this model fills exactly",
                    self.config.chunk_bytes,
                    layout.block_bytes(),
                    layout.num_layers(),
                    granule
                ),
            ));
        }
        crate::executor::check_storage(&kv, &storage)?;
        if !kv.num_blocks().is_multiple_of(bpc) {
            return Err(Error::config(
                "num_blocks",
                format!(
                    "{name}: {} blocks is not a whole number of chunks of {bpc} blocks",
                    kv.num_blocks()
                ),
            ));
        }
        let chunk = self.config.chunk_bytes;
        let chunks = kv.num_blocks() / bpc;
        let floor_chunks = limits.floor_bytes.div_ceil(chunk).max(1);
        let ceiling_chunks = (limits.ceiling_bytes / chunk).min(kv.max_num_blocks() / bpc);
        let watermark = kv.arena_watermark();
        if floor_chunks * bpc <= watermark {
            return Err(Error::config(
                "floor_bytes",
                format!(
                    "{name}: a floor of {} blocks must be above the watermark of {watermark}",
                    floor_chunks * bpc,
                ),
            ));
        }
        if !(floor_chunks..=ceiling_chunks).contains(&chunks) {
            return Err(Error::config(
                "num_blocks",
                format!(
                    "{name}: {chunks} chunks outside floor {floor_chunks} ..= ceiling {ceiling_chunks}"
                ),
            ));
        }
        let id = ModelId(self.models.len() as u32);
        {
            let mut l = self.ledger.lock();
            if l.free_chunks < chunks {
                return Err(Error::OutOfBlocks {
                    needed: chunks,
                    free: l.free_chunks,
                });
            }
            l.free_chunks -= chunks;
            l.granted.push(chunks);
            l.peak.push(chunks);
            l.sleeping.push(false);
            l.names.push(name.clone());
            self.record(
                &mut l,
                Party::Free,
                Party::Model(id),
                chunks,
                MoveReason::Register,
                MoveBlocks::default(),
            );
        }
        self.models.push(ModelSlot {
            name,
            priority: limits.priority,
            floor_chunks,
            ceiling_chunks,
            blocks_per_chunk: bpc,
            block_bytes: kv.layout().block_bytes(),
            mapped_bytes_per_chunk: mapped,
            active: AtomicBool::new(kv.stats().num_sequences > 0),
            active_at: AtomicU64::new(self.clock.load(Ordering::Relaxed)),
            state: Mutex::new(ModelState {
                kv,
                storage,
                sleeping: false,
            }),
        });
        Ok(id)
    }

    /// Models registered.
    pub fn num_models(&self) -> usize {
        self.models.len()
    }

    /// A model's name.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown id.
    pub fn name(&self, id: ModelId) -> Result<&str> {
        Ok(&self.slot(id)?.name)
    }

    /// Sets the clock stamped on the events that follow (a scheduler step, say); it is
    /// also the clock [`BrokerConfig::cold_cache_steps`] counts.
    pub fn set_clock(&self, clock: u64) {
        self.clock.store(clock, Ordering::Relaxed);
    }

    /// Locks a model for its scheduler's step (waits for another holder of the same
    /// model; never for another model).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown id.
    pub fn lock(&self, id: ModelId) -> Result<ModelGuard<'_, S>> {
        let slot = self.slot(id)?;
        Ok(ModelGuard {
            broker: self,
            id,
            state: slot.state.lock(),
        })
    }

    /// The ledger now: free, reserved and per-model bytes.
    pub fn stats(&self) -> BrokerStats {
        let l = self.ledger.lock();
        let chunk = self.config.chunk_bytes;
        BrokerStats {
            budget_bytes: self.budget_chunks * chunk,
            free_bytes: l.free_chunks * chunk,
            reserved_bytes: l.reservations.values().sum::<usize>() * chunk,
            peak_used_bytes: l.peak_used_chunks * chunk,
            models: self
                .models
                .iter()
                .enumerate()
                .map(|(i, m)| ModelBudget {
                    id: ModelId(i as u32),
                    name: m.name.clone(),
                    granted_bytes: l.granted[i] * chunk,
                    peak_bytes: l.peak[i] * chunk,
                    floor_bytes: m.floor_chunks * chunk,
                    ceiling_bytes: m.ceiling_chunks * chunk,
                    blocks_per_chunk: m.blocks_per_chunk,
                    block_bytes: m.block_bytes,
                    mapped_bytes_per_chunk: m.mapped_bytes_per_chunk,
                    sleeping: l.sleeping[i],
                })
                .collect(),
        }
    }

    /// Every move so far, in order.
    pub fn events(&self) -> Vec<MoveEvent> {
        self.ledger.lock().events.clone()
    }

    /// Asks for `bytes` (rounded up to whole chunks) for a consumer outside the KV
    /// arenas, within `timeout`: free budget first, then models' free blocks, then
    /// their prefix caches (cold ones first), lowest priority first, never below a
    /// floor. While the
    /// arenas hold live blocks it retries (every millisecond) as sequences finish.
    /// Each model is waited for at most a millisecond at a time, so no scheduler waits
    /// on it longer than one chunk move.
    ///
    /// # Errors
    /// [`Error::ReservationTimeout`] when the bytes were not found in time (whatever
    /// was found goes back to the free budget); [`Error::OutOfRange`] for 0 bytes or
    /// more than the budget can ever give (the budget less every floor).
    pub fn reserve(&self, bytes: usize, timeout: Duration) -> Result<Reservation> {
        let chunk = self.config.chunk_bytes;
        let want = bytes.div_ceil(chunk);
        let floors: usize = self.models.iter().map(|m| m.floor_chunks).sum();
        if want == 0 || want > self.budget_chunks - floors {
            return Err(Error::OutOfRange {
                field: "bytes",
                value: bytes as f64,
                allowed: "in (0, budget less the models' floors]",
            });
        }
        let start = Instant::now();
        let deadline = start + timeout;
        let id = {
            let mut l = self.ledger.lock();
            let id = l.next_reservation;
            l.next_reservation += 1;
            l.reservations.insert(id, 0);
            ReservationId(id)
        };
        let to = Party::External(id);
        let mut got = 0;
        loop {
            got += self.take_free(to, want - got, MoveReason::Reserve);
            for allow_cached in [false, true] {
                for v in self.victims(None, i32::MAX, allow_cached) {
                    while got < want {
                        let Some(mut st) =
                            self.models[v].state.try_lock_for(Duration::from_millis(1))
                        else {
                            break;
                        };
                        if !self.take_chunk(v, &mut st, to, allow_cached, MoveReason::Reserve) {
                            break;
                        }
                        got += 1;
                    }
                }
            }
            if got == want {
                return Ok(Reservation {
                    id,
                    bytes: want * chunk,
                    broker: self.instance,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                let mut l = self.ledger.lock();
                l.reservations.remove(&id.0);
                l.free_chunks += got;
                if got > 0 {
                    self.record(
                        &mut l,
                        to,
                        Party::Free,
                        got,
                        MoveReason::Release,
                        MoveBlocks::default(),
                    );
                }
                return Err(Error::ReservationTimeout {
                    requested: bytes,
                    found: got * chunk,
                    waited_ms: (now - start).as_millis() as u64,
                });
            }
            std::thread::sleep((deadline - now).min(Duration::from_millis(1)));
        }
    }

    /// Gives an external reservation's bytes back to the free budget.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a reservation of another broker (nothing changed).
    pub fn release(&self, reservation: Reservation) -> Result<()> {
        if reservation.broker != self.instance {
            return Err(Error::config(
                "reservation",
                "the reservation was made by another broker",
            ));
        }
        let mut l = self.ledger.lock();
        let chunks = l.reservations.remove(&reservation.id.0).ok_or_else(|| {
            Error::config("reservation", "unknown reservation (already released)")
        })?;
        l.free_chunks += chunks;
        self.record(
            &mut l,
            Party::External(reservation.id),
            Party::Free,
            chunks,
            MoveReason::Release,
            MoveBlocks::default(),
        );
        Ok(())
    }

    /// Puts a model to sleep: optionally swaps its resident sequences out to the host
    /// tier, spills its prefix cache's unreferenced blocks to the host tier (or evicts
    /// them), and shrinks its arena to the floor; the chunks go to the free budget
    /// ([`MoveReason::Sleep`], whose event counts the blocks spilled and evicted). A
    /// sleeping model does not grow until [`Self::wake`]. Waits for the model's lock.
    ///
    /// # Errors
    /// [`Error::SequenceState`] when a sequence of the model holds an uncommitted
    /// reservation (the model is mid-step: commit first; nothing changed);
    /// [`Error::ShrinkBelowResident`] when the live blocks do not fit the floor and
    /// `swap_out_sequences` is off (nothing changed); the swap's errors
    /// ([`Error::TierFull`]...; nothing changed; a transfer that fails aborts every
    /// job, so the sequences stay resident); [`Error::NotOnHybrid`] for
    /// `spill_cached_prefixes` on a hybrid cache (before the swap-out: nothing
    /// changed); the storage's errors from the spill
    /// (the sequences stay swapped out, the prefix cache stays on the device) or from
    /// the shrink.
    pub fn sleep(&self, id: ModelId, opts: SleepOptions) -> Result<SleepReport> {
        let slot = self.slot(id)?;
        let mut st = slot.state.lock();
        self.check_arena(id.0 as usize, &st)?;
        // Before the swap, the spill or the eviction: a refusal changes nothing.
        st.kv.check_no_step_in_flight()?;
        let floor_blocks = slot.floor_chunks * slot.blocks_per_chunk;
        let st = &mut *st;
        if opts.spill_cached_prefixes && st.kv.is_hybrid() {
            // Refused before the swap-out, so that the refusal changes nothing.
            return Err(Error::NotOnHybrid {
                operation: "sleep spilling the prefix cache",
                groups: st.kv.num_groups(),
            });
        }
        if opts.swap_out_sequences {
            let seqs: Vec<SeqId> = st
                .kv
                .sequence_ids()
                .filter(|s| st.kv.swap_in_flight(*s).is_none())
                .collect();
            if !seqs.is_empty() && st.kv.is_hybrid() {
                swap_out_each(&mut st.kv, &mut st.storage, &seqs)?;
            } else if !seqs.is_empty() {
                let job = st.kv.swap_out_group(&seqs)?;
                if let Err(e) = st.storage.swap(&job.plan) {
                    st.kv.abort_swap(job.ticket)?;
                    return Err(e);
                }
                st.kv.complete_swap(job.ticket)?;
            }
        }
        let live = st.kv.stats().used_blocks;
        if live > floor_blocks {
            return Err(Error::ShrinkBelowResident {
                requested: floor_blocks,
                live,
                cached: st.kv.stats().cached_blocks,
            });
        }
        let mut blocks = MoveBlocks::default();
        if opts.spill_cached_prefixes {
            let spill = spill_cached_prefixes(&mut st.kv, &mut st.storage)?;
            blocks.spilled = spill.spilled_blocks;
            blocks.evicted = spill.evicted_blocks;
        }
        blocks.evicted += st.kv.evict_cached(usize::MAX);
        let before = st.kv.num_blocks();
        if before > floor_blocks {
            blocks.moved = shrink_to(&mut st.kv, floor_blocks, &mut st.storage)?.len();
        }
        let chunks = (before - floor_blocks.min(before)) / slot.blocks_per_chunk;
        st.sleeping = true;
        let mut l = self.ledger.lock();
        l.sleeping[id.0 as usize] = true;
        l.granted[id.0 as usize] -= chunks;
        l.free_chunks += chunks;
        if chunks > 0 || blocks.spilled > 0 || blocks.evicted > 0 {
            self.record(
                &mut l,
                Party::Model(id),
                Party::Free,
                chunks,
                MoveReason::Sleep,
                blocks,
            );
        }
        Ok(SleepReport {
            freed_bytes: chunks * self.config.chunk_bytes,
            spilled_blocks: blocks.spilled,
            evicted_blocks: blocks.evicted,
        })
    }

    /// Wakes a model and grows it back toward `bytes` (whole chunks, up to its
    /// ceiling) the way [`ModelGuard::ensure_available`] does ([`MoveReason::Wake`]),
    /// then restores the prefix-cache blocks its sleep spilled to the host tier into
    /// free blocks of the grown arena, so that requests with those prefixes hit again.
    /// Swapped-out sequences stay swapped out: the scheduler swaps them in. Waits for
    /// the model's lock.
    ///
    /// # Errors
    /// As [`ModelGuard::ensure_available`]; the storage's errors from the restore (the
    /// model is awake and grown; the spilled blocks stay spilled).
    pub fn wake(&self, id: ModelId, bytes: usize) -> Result<WakeReport> {
        let slot = self.slot(id)?;
        let mut st = slot.state.lock();
        st.sleeping = false;
        let granted = {
            let mut l = self.ledger.lock();
            l.sleeping[id.0 as usize] = false;
            l.granted[id.0 as usize]
        };
        let target = (bytes / self.config.chunk_bytes).min(slot.ceiling_chunks);
        if target > granted {
            self.acquire_for_model(id, &mut st, target - granted, MoveReason::Wake)?;
        }
        let mut report = WakeReport::default();
        if st.kv.spilled_prefix_blocks() > 0 {
            let st = &mut *st;
            let r = restore_spilled_prefixes(&mut st.kv, &mut st.storage)?;
            report.restored_blocks = r.restored_blocks;
            report.dropped_blocks = r.dropped_blocks;
            report.still_spilled_blocks = r.still_spilled_blocks;
            if r.restored_blocks > 0 {
                ::metrics::counter!(metric_names::RESTORED_BLOCKS, "model" => slot.name.clone())
                    .increment(r.restored_blocks as u64);
            }
        }
        report.granted_bytes = self.ledger.lock().granted[id.0 as usize] * self.config.chunk_bytes;
        Ok(report)
    }

    /// Checks the broker's invariants, locking every model in turn (for tests and
    /// debugging): the ledger sums to the budget, every model is within `[floor,
    /// ceiling]` and its arena and storage hold exactly its granted chunks, and each
    /// manager's own invariants hold.
    ///
    /// # Errors
    /// A description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let guards: Vec<_> = self.models.iter().map(|m| m.state.lock()).collect();
        let l = self.ledger.lock();
        let granted: usize = l.granted.iter().sum();
        let reserved: usize = l.reservations.values().sum();
        if granted + reserved + l.free_chunks != self.budget_chunks {
            return Err(format!(
                "ledger: granted {granted} + reserved {reserved} + free {} != budget {}",
                l.free_chunks, self.budget_chunks
            ));
        }
        for (i, (m, st)) in self.models.iter().zip(&guards).enumerate() {
            let g = l.granted[i];
            if g < m.floor_chunks || g > m.ceiling_chunks {
                return Err(format!(
                    "{}: {g} chunks outside [{}, {}]",
                    m.name, m.floor_chunks, m.ceiling_chunks
                ));
            }
            let blocks = g * m.blocks_per_chunk;
            if st.kv.num_blocks() != blocks || st.storage.num_blocks() != blocks {
                return Err(format!(
                    "{}: {g} chunks are {blocks} blocks, manager has {}, storage {}",
                    m.name,
                    st.kv.num_blocks(),
                    st.storage.num_blocks()
                ));
            }
            if st.kv.num_blocks() * m.block_bytes > g * self.config.chunk_bytes {
                return Err(format!("{}: arena bytes exceed its chunks", m.name));
            }
            st.kv
                .check_invariants()
                .map_err(|e| format!("{}: {e}", m.name))?;
        }
        let events_sum = self.ledger_sums_from_events(&l);
        if events_sum != l.granted {
            return Err(format!(
                "event log replays to {events_sum:?} chunks, ledger has {:?}",
                l.granted
            ));
        }
        Ok(())
    }

    /// The per-model chunk counts the event log replays to.
    fn ledger_sums_from_events(&self, l: &Ledger) -> Vec<usize> {
        let mut per = vec![0isize; self.models.len()];
        for e in &l.events {
            let chunks = (e.bytes / self.config.chunk_bytes) as isize;
            if let Party::Model(m) = e.from {
                per[m.0 as usize] -= chunks;
            }
            if let Party::Model(m) = e.to {
                per[m.0 as usize] += chunks;
            }
        }
        per.into_iter().map(|c| c.max(0) as usize).collect()
    }

    /// An SVG picture of the bytes each model and the external reservations held over
    /// the broker's clock, one step line each, with a marker per move (its tooltip
    /// says who gave, who took, bytes and why) and the budget as a dashed line.
    pub fn events_svg(&self, title: &str) -> String {
        let events = self.events();
        let names: Vec<String> = self.models.iter().map(|m| m.name.clone()).collect();
        svg::render(
            title,
            &names,
            &events,
            self.budget_chunks * self.config.chunk_bytes,
        )
    }

    // ---- internals ----------------------------------------------------------------

    fn slot(&self, id: ModelId) -> Result<&ModelSlot<S>> {
        self.models.get(id.0 as usize).ok_or_else(|| {
            Error::config(
                "model",
                format!("{id} is not registered ({} models)", self.models.len()),
            )
        })
    }

    /// Fails when the model's arena differs from its granted chunks.
    fn check_arena(&self, v: usize, st: &ModelState<S>) -> Result<()> {
        let expected = self.ledger.lock().granted[v] * self.models[v].blocks_per_chunk;
        for got in [st.kv.num_blocks(), st.storage.num_blocks()] {
            if got != expected {
                return Err(Error::ShapeMismatch {
                    what: "arena blocks against the broker's ledger",
                    expected,
                    got,
                });
            }
        }
        Ok(())
    }

    /// Whether model `i`'s prefix cache is cold: no sequence when its lock was last
    /// released, and none for [`BrokerConfig::cold_cache_steps`] of the clock.
    fn is_cold(&self, i: usize) -> bool {
        let Some(steps) = self.config.cold_cache_steps else {
            return false;
        };
        let m = &self.models[i];
        let since = m.active_at.load(Ordering::Relaxed);
        !m.active.load(Ordering::Relaxed)
            && self.clock.load(Ordering::Relaxed).saturating_sub(since) >= steps
    }

    /// Models other than `except` with chunks above their floor, to take memory from
    /// for a taker of priority `priority`. For free blocks (`cached` false): every
    /// model, lowest priority first, then most chunks above the floor first. For cached
    /// blocks: models whose cache is cold ([`Self::is_cold`]) first, whatever their
    /// priority, then warm ones of priority at most `priority`, each group in the same
    /// order.
    fn victims(&self, except: Option<ModelId>, priority: i32, cached: bool) -> Vec<usize> {
        let spare: Vec<usize> = {
            let l = self.ledger.lock();
            self.models
                .iter()
                .enumerate()
                .map(|(i, m)| l.granted[i].saturating_sub(m.floor_chunks))
                .collect()
        };
        let cold: Vec<bool> = (0..self.models.len())
            .map(|i| cached && self.is_cold(i))
            .collect();
        let mut v: Vec<usize> = (0..self.models.len())
            .filter(|&i| Some(ModelId(i as u32)) != except)
            .filter(|&i| {
                spare[i] > 0 && (!cached || cold[i] || self.models[i].priority <= priority)
            })
            .collect();
        v.sort_by_key(|&i| {
            (
                !cold[i],
                self.models[i].priority,
                std::cmp::Reverse(spare[i]),
                i,
            )
        });
        v
    }

    /// Moves up to `chunks` chunks from the free budget to `to`; returns how many.
    fn take_free(&self, to: Party, chunks: usize, reason: MoveReason) -> usize {
        let mut l = self.ledger.lock();
        let n = chunks.min(l.free_chunks);
        if n > 0 {
            l.free_chunks -= n;
            match to {
                Party::Model(m) => l.granted[m.0 as usize] += n,
                Party::External(r) => *l.reservations.entry(r.0).or_insert(0) += n,
                Party::Free => l.free_chunks += n,
            }
            self.record(&mut l, Party::Free, to, n, reason, MoveBlocks::default());
        }
        n
    }

    /// Gets `want` chunks for model `id` (whose lock the caller holds as `st`), up to
    /// its ceiling, and grows its arena over them.
    fn acquire_for_model(
        &self,
        id: ModelId,
        st: &mut ModelState<S>,
        want: usize,
        reason: MoveReason,
    ) -> Result<()> {
        let me = id.0 as usize;
        let slot = &self.models[me];
        self.check_arena(me, st)?;
        let room = slot
            .ceiling_chunks
            .saturating_sub(self.ledger.lock().granted[me]);
        let want = want.min(room);
        let to = Party::Model(id);
        let mut got = self.take_free(to, want, reason);
        for allow_cached in [false, true] {
            for v in self.victims(Some(id), slot.priority, allow_cached) {
                while got < want {
                    let Some(mut other) = self.models[v].state.try_lock() else {
                        break;
                    };
                    if !self.take_chunk(v, &mut other, to, allow_cached, reason) {
                        break;
                    }
                    got += 1;
                }
            }
        }
        if got == 0 {
            return Ok(());
        }
        let blocks = self.ledger.lock().granted[me] * slot.blocks_per_chunk;
        if let Err(e) = grow_to(&mut st.kv, blocks, &mut st.storage) {
            let mut l = self.ledger.lock();
            l.granted[me] -= got;
            l.free_chunks += got;
            self.record(
                &mut l,
                to,
                Party::Free,
                got,
                MoveReason::GrowFailed,
                MoveBlocks::default(),
            );
            return Err(e);
        }
        Ok(())
    }

    /// Shrinks model `v` (locked by the caller as `st`) by one chunk and hands the
    /// chunk to `to`: from its free blocks, keeping `keep_free_chunks` of them, or,
    /// when `allow_cached`, after evicting cached blocks. Returns false, changing
    /// nothing in the ledger, when the model cannot give a chunk now; a model
    /// mid-step (see the module docs) gives none and loses nothing.
    fn take_chunk(
        &self,
        v: usize,
        st: &mut ModelState<S>,
        to: Party,
        allow_cached: bool,
        reason: MoveReason,
    ) -> bool {
        let slot = &self.models[v];
        let bpc = slot.blocks_per_chunk;
        let granted = self.ledger.lock().granted[v];
        if granted <= slot.floor_chunks
            || self.check_arena(v, st).is_err()
            || st.kv.mid_step_sequence().is_some()
        {
            return false;
        }
        let keep = if st.sleeping {
            0
        } else {
            self.config.keep_free_chunks * bpc
        };
        let need_free = bpc + keep;
        let free = st.kv.stats().free_blocks;
        let mut why = if reason == MoveReason::Grow {
            MoveReason::TakeIdle
        } else {
            reason
        };
        let mut blocks = MoveBlocks::default();
        if free < need_free {
            // Evict only when that gives the chunk (available counts the evictable).
            if !allow_cached || st.kv.num_available_blocks() < need_free {
                return false;
            }
            blocks.evicted = st.kv.evict_cached(need_free - free);
            if free + blocks.evicted < need_free {
                // Cached blocks above live ones are not evictable yet; what went stays
                // evicted (nothing moved), and the counter still says so.
                self.count_evicted(v, blocks.evicted);
                return false;
            }
            if reason == MoveReason::Grow {
                why = MoveReason::TakeCached;
            }
        }
        let target = st.kv.num_blocks() - bpc;
        blocks.moved = match shrink_to(&mut st.kv, target, &mut st.storage) {
            Ok(plan) => plan.len(),
            Err(_) => {
                self.count_evicted(v, blocks.evicted);
                return false;
            }
        };
        let mut l = self.ledger.lock();
        l.granted[v] -= 1;
        match to {
            Party::Model(m) => l.granted[m.0 as usize] += 1,
            Party::External(r) => *l.reservations.entry(r.0).or_insert(0) += 1,
            Party::Free => l.free_chunks += 1,
        }
        self.record(&mut l, Party::Model(ModelId(v as u32)), to, 1, why, blocks);
        true
    }

    /// Publishes `n` prefix-cache blocks of model `v` evicted.
    fn count_evicted(&self, v: usize, n: usize) {
        if n > 0 {
            ::metrics::counter!(metric_names::EVICTED_BLOCKS, "model" => self.models[v].name.clone())
                .increment(n as u64);
        }
    }

    /// Appends an event, updates the peaks and publishes the move on the `metrics`
    /// facade. The caller holds the ledger lock and has already moved the chunks.
    fn record(
        &self,
        l: &mut Ledger,
        from: Party,
        to: Party,
        chunks: usize,
        reason: MoveReason,
        blocks: MoveBlocks,
    ) {
        let chunk = self.config.chunk_bytes;
        let bytes = chunks * chunk;
        let seq = l.events.len() as u64;
        l.events.push(MoveEvent {
            seq,
            clock: self.clock.load(Ordering::Relaxed),
            from,
            to,
            bytes,
            reason,
            moved_blocks: blocks.moved,
            spilled_blocks: blocks.spilled,
            evicted_blocks: blocks.evicted,
        });
        for i in 0..l.granted.len() {
            l.peak[i] = l.peak[i].max(l.granted[i]);
        }
        l.peak_used_chunks = l.peak_used_chunks.max(self.budget_chunks - l.free_chunks);
        let label = |p: Party| match p {
            Party::Free => "free".to_string(),
            Party::External(_) => "external".to_string(),
            Party::Model(m) => l
                .names
                .get(m.0 as usize)
                .cloned()
                .unwrap_or_else(|| m.to_string()),
        };
        let (f, t) = (label(from), label(to));
        ::metrics::counter!(metric_names::MOVED_BYTES, "from" => f.clone(), "to" => t.clone(), "reason" => reason.name())
            .increment(bytes as u64);
        ::metrics::counter!(metric_names::MOVES, "from" => f, "to" => t, "reason" => reason.name())
            .increment(1);
        for p in [from, to] {
            if let Party::Model(m) = p {
                let g = l.granted.get(m.0 as usize).copied().unwrap_or(0);
                ::metrics::gauge!(metric_names::GRANTED_BYTES, "model" => label(p))
                    .set((g * chunk) as f64);
            }
        }
        if matches!(from, Party::Model(_)) {
            if blocks.spilled > 0 {
                ::metrics::counter!(metric_names::SPILLED_BLOCKS, "model" => label(from))
                    .increment(blocks.spilled as u64);
            }
            if blocks.evicted > 0 {
                ::metrics::counter!(metric_names::EVICTED_BLOCKS, "model" => label(from))
                    .increment(blocks.evicted as u64);
            }
        }
        ::metrics::gauge!(metric_names::FREE_BYTES).set((l.free_chunks * chunk) as f64);
        let reserved: usize = l.reservations.values().sum();
        ::metrics::gauge!(metric_names::RESERVED_BYTES).set((reserved * chunk) as f64);
    }
}
