//! Swapping sequences between the device arena, the host tier and the disk tier.
//!
//! # States of a sequence
//!
//! ```text
//!            swap_out            complete_swap             swap_in           complete_swap
//! resident ----------> swapping out ----------> swapped ----------> swapping in ----------> resident
//!    ^                     |  abort_swap           |  ^                  |  abort_swap
//!    +---------------------+                       |  +------------------+
//!                                  spill_to_disk / restore_from_disk
//! ```
//!
//! * **swapping out**: the plan copies the device blocks to freshly taken host blocks.
//!   The sequence keeps its device table and every device reference until
//!   [`KvCache::complete_swap`], so nothing can allocate those blocks while the
//!   transfer reads them, and attention on the sequence can still run. Append, fork,
//!   truncate and free are refused ([`Error::SequenceState`]).
//! * **swapped**: the sequence has no device blocks; its table names host-tier blocks
//!   or disk slots ([`TierBlock`]). Append, fork, truncate and batch views are refused;
//!   free releases its tier blocks.
//! * **swapping in**: the sequence has new device blocks whose data is still arriving
//!   (ask [`crate::executor::tier::TransferEngine::is_layer_ready`] per layer) and keeps its host
//!   references until completion. Mutations are refused as while swapping out.
//!
//! # Shared blocks
//!
//! A call moves a *group* of sequences (`swap_out_group`, `swap_in_group`, spills and
//! restores take slices). Inside a group each distinct block moves once and the copy
//! keeps one reference per table entry of the group, so forks swapped together stay
//! shared. A block also referenced from outside the group is copied: the outside
//! references keep the original, the group's references move to the copy. That is
//! correct because a shared block is never written in place (appends copy-on-write),
//! so both copies hold the same bytes for as long as either is shared; the cost is
//! the duplicated block. Swapping whole fork groups together (what
//! [`KvCache::preempt_for`] does) avoids it.
//!
//! # Consecutive blocks
//!
//! Host blocks (and device blocks on swap-in) are taken as one run of consecutive ids
//! where the tier has one, so [`SwapPlan::runs`] merges every stretch that is also
//! consecutive on the other side into one transfer.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::Hash;

use super::{in_flight, KvCache, Sequence};
use crate::error::{Error, Result};
use crate::manager::preempt::PreemptEvent;
use crate::pool::BlockPool;

use crate::ids::{BlockId, DiskSlot, SeqId, SwapTicket};
use crate::layout::plans::{SwapDirection, SwapPlan};
use crate::pool::pick_free_run;

/// Sizes of the tiers below the device arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierConfig {
    /// Blocks in the host tier (0: no swapping; swap-outs fail with
    /// [`Error::TierFull`]). Must match the storage's [`crate::Storage::num_host_blocks`]:
    /// [`TierConfig::for_storage`] takes it from there.
    pub num_host_blocks: usize,
    /// Slots in the disk tier (0: no disk tier). Must match the [`crate::executor::tier::DiskTier`] passed to
    /// [`crate::executor::spill_to_disk`].
    pub num_disk_slots: usize,
}

/// A swap the manager has planned: execute `plan` (one [`crate::Storage::swap`] or a
/// [`crate::executor::tier::TransferEngine`]), then call [`KvCache::complete_swap`] with
/// `ticket`, or [`KvCache::abort_swap`] when the transfer failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapJob {
    /// The ticket to complete or abort.
    pub ticket: SwapTicket,
    /// The sequences it moves.
    pub seqs: Vec<SeqId>,
    /// The blocks to move.
    pub plan: SwapPlan,
}

/// Where one block of a swapped-out sequence lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierBlock {
    /// A host-tier block.
    Host(BlockId),
    /// A disk-tier slot.
    Disk(DiskSlot),
}

/// Counters of the host and disk tiers and of preemption.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierStats {
    /// Blocks in the host tier.
    pub host_blocks: usize,
    /// Host blocks holding data (swapped sequences, transfers in flight, spilled
    /// prefix-cache blocks, and the host level of the prefix cache:
    /// [`KvCache::host_cache_stats`]).
    pub host_used_blocks: usize,
    /// Of those, prefix-cache blocks spilled to the host tier
    /// ([`KvCache::plan_prefix_spill`]) and not yet restored.
    pub spilled_prefix_blocks: usize,
    /// Slots in the disk tier.
    pub disk_slots: usize,
    /// Disk slots holding data.
    pub disk_used_slots: usize,
    /// Sequences swapped out (on the host tier, the disk tier, or both).
    pub swapped_sequences: usize,
    /// Swap transfers planned and not yet completed or aborted.
    pub in_flight_transfers: usize,
    /// Completed swap-outs (groups).
    pub swaps_out: u64,
    /// Completed swap-ins (groups).
    pub swaps_in: u64,
    /// Bytes moved device -> host by completed swap-outs.
    pub bytes_swapped_out: u64,
    /// Bytes moved host -> device by completed swap-ins.
    pub bytes_swapped_in: u64,
    /// Blocks written host -> disk.
    pub blocks_spilled: u64,
    /// Blocks read disk -> host.
    pub blocks_restored: u64,
    /// Groups preempted by [`KvCache::preempt_for`].
    pub preemptions: u64,
    /// Of those, groups preempted by swapping.
    pub preempt_swaps: u64,
    /// Of those, groups dropped for recomputation.
    pub preempt_recomputes: u64,
}

/// A swap of a sequence that has not completed.
/// The direction first (`repr(C)`): it is what tells a sequence's `in_flight: None`
/// apart, and it sits in the sequence's first cache line (see `Sequence`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct InFlight {
    pub(crate) direction: SwapDirection,
    pub(crate) ticket: SwapTicket,
}

/// A sequence with no device blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SwappedSeq {
    /// Its held blocks: those after the `released` leading blocks a sliding window
    /// gave back.
    pub(crate) table: Vec<TierBlock>,
    /// Leading blocks a sliding window gave back before the swap-out (not stored).
    pub(crate) released: usize,
    pub(crate) num_tokens: usize,
    pub(crate) computed: usize,
    pub(crate) admission: u64,
    pub(crate) preempt_priority: i32,
    /// Its prefix-cache progress rewound to position 0 (the blocks it comes back to
    /// are fresh copies): the swap-in's completion registers them again, or shares
    /// the copies still cached, so registration goes on after the swap-in.
    pub(crate) prefix: Option<Box<super::prefix::SeqPrefix>>,
    /// [`Sequence::tracking_stopped`], kept while swapped out.
    pub(crate) tracking_stopped: bool,
}

/// What a ticket still holds.
#[derive(Debug, Clone)]
enum Pending {
    /// The group's host tables (host references taken); device references are
    /// released on completion.
    Out {
        seqs: Vec<(SeqId, Vec<BlockId>)>,
        blocks: usize,
        /// Device blocks the completion will free (an estimate for the preemption
        /// policy: later forks can change it).
        frees_device_blocks: usize,
    },
    /// The group as it was swapped out (host references still held); released on
    /// completion, restored on abort.
    In {
        seqs: Vec<(SeqId, SwappedSeq)>,
        blocks: usize,
    },
}

/// The tiers' bookkeeping inside a [`KvCache`].
#[derive(Debug, Clone)]
pub(crate) struct Tiers {
    host: BlockPool,
    /// Filled token slots of each live host block (restored on swap-in).
    host_fill: Vec<u16>,
    host_cursor: usize,
    disk: BlockPool,
    disk_fill: Vec<u16>,
    disk_cursor: usize,
    device_cursor: usize,
    pub(crate) swapped: super::SeqMap<SwappedSeq>,
    pending: BTreeMap<SwapTicket, Pending>,
    next_ticket: u64,
    next_admission: u64,
    pub(crate) stats: TierStats,
    pub(crate) events: VecDeque<PreemptEvent>,
    /// Prefix-cache blocks spilled to the host tier (see `manager/prefix_spill.rs`).
    pub(crate) spilled: Vec<super::prefix_spill::SpilledPrefix>,
    /// The host level of the prefix cache (see `manager/tier_cache.rs`).
    pub(crate) host_cache: super::tier_cache::HostLevel,
    /// The disk level of the prefix cache's index (see `manager/disk_level.rs`).
    pub(crate) disk_cache: super::disk_level::DiskLevel,
}

impl Tiers {
    pub(crate) fn new(config: TierConfig) -> Result<Self> {
        Ok(Tiers {
            host: BlockPool::new(config.num_host_blocks)?,
            host_fill: vec![0; config.num_host_blocks],
            host_cursor: 0,
            disk: BlockPool::new(config.num_disk_slots)?,
            disk_fill: vec![0; config.num_disk_slots],
            disk_cursor: 0,
            device_cursor: 0,
            swapped: super::SeqMap::default(),
            pending: BTreeMap::new(),
            next_ticket: 0,
            next_admission: 0,
            stats: TierStats::default(),
            events: VecDeque::new(),
            spilled: Vec::new(),
            host_cache: super::tier_cache::HostLevel::default(),
            disk_cache: super::disk_level::DiskLevel::default(),
        })
    }

    /// The host tier's pool (for the prefix spill).
    pub(crate) fn host_pool(&self) -> &BlockPool {
        &self.host
    }

    /// The host tier's pool, to take and release blocks (for the prefix spill).
    pub(crate) fn host_pool_mut(&mut self) -> &mut BlockPool {
        &mut self.host
    }

    /// A fresh admission stamp (monotonic: larger is more recent).
    pub(crate) fn next_admission(&mut self) -> u64 {
        self.next_admission += 1;
        self.next_admission
    }

    pub(crate) fn next_ticket(&mut self) -> SwapTicket {
        self.next_ticket += 1;
        SwapTicket(self.next_ticket)
    }

    /// Free host blocks.
    pub(crate) fn host_free(&self) -> usize {
        self.host.num_free()
    }

    /// Device blocks that in-flight swap-outs will free when they complete.
    /// Swap transfers issued and not yet completed or aborted.
    pub(crate) fn num_in_flight(&self) -> usize {
        // Disk stores read host blocks only: they do not hold device blocks in place.
        self.pending.len() + self.host_cache.num_in_flight()
    }

    pub(crate) fn pending_device_release(&self) -> usize {
        self.pending
            .values()
            .map(|p| match p {
                Pending::Out {
                    frees_device_blocks,
                    ..
                } => *frees_device_blocks,
                Pending::In { .. } => 0,
            })
            .sum()
    }
}
/// Copies between the host tier and the disk tier planned by
/// [`KvCache::plan_spill`] or [`KvCache::plan_restore`] and not yet
/// committed. It holds the manager's `&mut` borrow, so nothing can take the
/// destinations meanwhile; dropping it aborts and leaves the manager as it was (the
/// destinations were free, so whatever was written there is never read).
#[derive(Debug)]
#[must_use = "dropping a pending tier move aborts it"]
pub struct PendingTierMove<'a> {
    manager: &'a mut KvCache,
    to_disk: bool,
    seqs: Vec<SeqId>,
    /// `(host block, disk slot, references from the group)`.
    moves: Vec<(BlockId, DiskSlot, u32)>,
}

impl PendingTierMove<'_> {
    /// Whether the copies go from the host tier to the disk tier (a spill) rather than
    /// back (a restore).
    pub fn to_disk(&self) -> bool {
        self.to_disk
    }

    /// The copies: `(host block, disk slot)`, the source first for a spill, the
    /// destination first for a restore.
    pub fn moves(&self) -> impl ExactSizeIterator<Item = (BlockId, DiskSlot)> + '_ {
        self.moves.iter().map(|&(h, d, _)| (h, d))
    }

    /// Records that every copy landed: the group's tables now name the destinations and
    /// the sources are released. Returns the blocks moved.
    ///
    /// # Errors
    /// A refcount error means the manager's own state was corrupt (the plan was made
    /// under the same borrow, so it cannot happen otherwise).
    pub fn commit(self) -> Result<usize> {
        let t = &mut self.manager.tiers;
        let mut host_of = HashMap::with_capacity(self.moves.len());
        let mut slot_of = HashMap::with_capacity(self.moves.len());
        for &(host, slot, refs) in &self.moves {
            let disk = BlockId(slot.0);
            if self.to_disk {
                take_with_refs(&mut t.disk, disk, refs)?;
                t.disk_fill[disk.index()] = t.host_fill[host.index()];
                drop_refs(&mut t.host, host, refs)?;
            } else {
                take_with_refs(&mut t.host, host, refs)?;
                t.host_fill[host.index()] = t.disk_fill[disk.index()];
                drop_refs(&mut t.disk, disk, refs)?;
            }
            slot_of.insert(host, slot);
            host_of.insert(slot, host);
        }
        if let Some(&(host, slot, _)) = self.moves.last() {
            if self.to_disk {
                t.disk_cursor = slot.0 as usize + 1;
            } else {
                t.host_cursor = host.index() + 1;
            }
        }
        for id in &self.seqs {
            let Some(s) = t.swapped.get_mut(id) else {
                continue;
            };
            for e in &mut s.table {
                match *e {
                    TierBlock::Host(h) if self.to_disk => {
                        if let Some(&d) = slot_of.get(&h) {
                            *e = TierBlock::Disk(d);
                        }
                    }
                    TierBlock::Disk(d) if !self.to_disk => {
                        if let Some(&h) = host_of.get(&d) {
                            *e = TierBlock::Host(h);
                        }
                    }
                    _ => {}
                }
            }
        }
        let n = self.moves.len() as u64;
        if self.to_disk {
            t.stats.blocks_spilled += n;
        } else {
            t.stats.blocks_restored += n;
        }
        Ok(self.moves.len())
    }
}

/// The distinct items of `items` in first-seen order with how often each occurs, and
/// each item's index in that list.
fn distinct_with_counts<T: Copy + Eq + Hash>(
    items: impl IntoIterator<Item = T>,
) -> (Vec<(T, u32)>, HashMap<T, usize>) {
    let mut list: Vec<(T, u32)> = Vec::new();
    let mut index = HashMap::new();
    for item in items {
        let i = *index.entry(item).or_insert_with(|| {
            list.push((item, 0));
            list.len() - 1
        });
        list[i].1 += 1;
    }
    (list, index)
}

pub(super) fn check_group(seqs: &[SeqId]) -> Result<()> {
    if seqs.is_empty() {
        return Err(Error::config("seqs", "an empty group"));
    }
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::config("seqs", format!("{} is listed twice", w[0])));
    }
    Ok(())
}

/// Plans a job for every sequence of `seqs` with `plan`, all or none: when one fails
/// (unreachable after the callers' checks), the jobs planned so far are undone with
/// `abort`, last first.
pub(super) fn plan_each<C, J>(
    cx: &mut C,
    seqs: &[SeqId],
    plan: impl Fn(&mut C, SeqId) -> Result<J>,
    abort: impl Fn(&mut C, &J),
) -> Result<Vec<J>> {
    let mut jobs = Vec::with_capacity(seqs.len());
    for &seq in seqs {
        match plan(cx, seq) {
            Ok(job) => jobs.push(job),
            Err(e) => {
                for job in jobs.iter().rev() {
                    abort(cx, job);
                }
                return Err(e);
            }
        }
    }
    Ok(jobs)
}

/// Fails unless `s` (sequence `seq`) has no swap in flight.
#[inline]
pub(crate) fn check_resident(seq: SeqId, s: &Sequence) -> Result<()> {
    match s.in_flight {
        None => Ok(()),
        Some(f) => Err(state_error(
            seq,
            match f.direction {
                SwapDirection::Out => "swapping out",
                SwapDirection::In => "swapping in",
            },
            "resident with no swap in flight",
        )),
    }
}

fn state_error(seq: SeqId, state: &'static str, needed: &'static str) -> Error {
    Error::SequenceState { seq, state, needed }
}

/// Gives `refs` references of one pool block: takes it, then adds `refs - 1`.
fn take_with_refs(pool: &mut BlockPool, block: BlockId, refs: u32) -> Result<()> {
    pool.take(block)?;
    for _ in 1..refs {
        pool.incref(block)?;
    }
    Ok(())
}

/// Drops `refs` references of one pool block.
fn drop_refs(pool: &mut BlockPool, block: BlockId, refs: u32) -> Result<()> {
    for _ in 0..refs {
        pool.decref(block)?;
    }
    Ok(())
}

impl KvCache {
    /// A manager with a host tier (and optionally disk-tier bookkeeping) to swap to
    /// (shorthand for [`KvCache::builder`] with [`super::CacheBuilder::tiers`]).
    ///
    /// # Errors
    /// As [`KvCache::new`]; [`Error::InvalidConfig`] when a tier does not fit
    /// `u32` ids.
    pub fn with_tiers(
        layout: crate::layout::KvLayout,
        config: super::CacheConfig,
        tiers: TierConfig,
    ) -> Result<Self> {
        Self::builder(layout).config(config).tiers(tiers).build()
    }

    /// The error for a sequence with no device table: swapped, or unknown.
    pub(crate) fn absent_error(&self, seq: SeqId) -> Error {
        if self.tiers.swapped.contains_key(&seq) {
            state_error(seq, "swapped out", "resident on the device")
        } else {
            Error::UnknownSequence(seq)
        }
    }

    /// The sequence if it is resident with no swap in flight (it may be changed).
    pub(crate) fn resident(&self, seq: SeqId) -> Result<&Sequence> {
        let s = self.seq(seq)?;
        check_resident(seq, s)?;
        Ok(s)
    }

    /// [`Self::resident`] and not in this step's batch: no uncommitted reservation
    /// (the batch may be writing into its blocks).
    pub(crate) fn idle(&self, seq: SeqId) -> Result<&Sequence> {
        let s = self.resident(seq)?;
        if in_flight::is_mid_step(s) {
            return Err(in_flight::mid_step_error(seq));
        }
        Ok(s)
    }

    fn swapped(&self, seq: SeqId) -> Result<&SwappedSeq> {
        match self.tiers.swapped.get(&seq) {
            Some(s) => Ok(s),
            None if self.seqs.contains_key(&seq) => {
                Err(state_error(seq, "on the device", "swapped out"))
            }
            None => Err(Error::UnknownSequence(seq)),
        }
    }

    /// Whether `seq` is swapped out (no device blocks, no transfer in flight).
    pub fn is_swapped(&self, seq: SeqId) -> bool {
        if let Some(h) = &self.hybrid {
            return h.is_swapped(seq);
        }
        self.tiers.swapped.contains_key(&seq)
    }

    /// Ids of swapped-out sequences, in no particular order.
    pub fn swapped_sequence_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        let hybrid = self.hybrid.is_some();
        let kv = self.first_group().unwrap_or(self);
        kv.tiers
            .swapped
            .keys()
            .copied()
            .filter(move |&s| !(hybrid && super::groups::is_hidden(s)))
    }

    /// Where each block of swapped-out `seq` lives: the blocks it held, after the
    /// leading ones a sliding window had given back (those stay holes).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when it is on the device.
    pub fn swapped_table(&self, seq: SeqId) -> Result<&[TierBlock]> {
        if let Some(g0) = self.first_group() {
            return g0.swapped_table(seq);
        }
        Ok(&self.swapped(seq)?.table)
    }

    /// The ticket of the swap in flight for `seq`, if any.
    pub fn swap_in_flight(&self, seq: SeqId) -> Option<SwapTicket> {
        if let Some(g0) = self.first_group() {
            return g0.swap_in_flight(seq);
        }
        self.seqs.get(&seq)?.in_flight.map(|f| f.ticket)
    }

    /// Sets the preemption priority of `seq` (default 0; lower is preempted first).
    /// Forks made later inherit it.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn set_preempt_priority(&mut self, seq: SeqId, priority: i32) -> Result<()> {
        if let Some(h) = &mut self.hybrid {
            // Every group holds the sequence; group 0 answers for an unknown one.
            for g in 0..h.num_groups() {
                h.group_mut(g).set_preempt_priority(seq, priority)?;
            }
            return Ok(());
        }
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.preempt_priority = priority;
        } else if let Some(s) = self.tiers.swapped.get_mut(&seq) {
            s.preempt_priority = priority;
        } else {
            return Err(Error::UnknownSequence(seq));
        }
        Ok(())
    }

    /// Counters of the tiers now.
    pub fn tier_stats(&self) -> TierStats {
        if let Some(h) = &self.hybrid {
            return h.tier_stats();
        }
        TierStats {
            host_blocks: self.tiers.host.num_blocks(),
            host_used_blocks: self.tiers.host.num_live(),
            spilled_prefix_blocks: self.tiers.spilled.len(),
            disk_slots: self.tiers.disk.num_blocks(),
            disk_used_slots: self.tiers.disk.num_live(),
            swapped_sequences: self.tiers.swapped.len(),
            in_flight_transfers: self.tiers.pending.len(),
            ..self.tiers.stats
        }
    }

    /// Plans the swap-out of one sequence; see [`Self::swap_out_group`].
    ///
    /// # Errors
    /// As [`Self::swap_out_group`].
    pub fn swap_out(&mut self, seq: SeqId) -> Result<SwapJob> {
        self.one_group("swap_out")?;
        self.swap_out_group(&[seq])
    }

    /// Plans the swap-out of a group of sequences (a fork group, so shared blocks move
    /// once and stay shared): takes a host block for each distinct device block, as
    /// consecutive as the host tier allows, and returns the plan. The device blocks
    /// stay held until [`Self::complete_swap`]; until then the sequences are
    /// "swapping out".
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when a sequence is swapped
    /// or has a swap in flight; [`Error::InvalidConfig`] for an empty group or a
    /// repeated id; [`Error::TierFull`] when the host tier lacks room even after
    /// evicting the host level's entries that can go (swapped sequences come first:
    /// see [`Self::plan_host_store`]). Nothing changed on error: the sequences stay
    /// resident.
    pub fn swap_out_group(&mut self, seqs: &[SeqId]) -> Result<SwapJob> {
        self.one_group("swap_out_group")?;
        check_group(seqs)?;
        let mut tables = Vec::with_capacity(seqs.len());
        for &id in seqs {
            let s = self.idle(id)?;
            // Blocks a sliding window gave back are not moved: they stay holes.
            tables.push(s.table[s.released..].to_vec());
        }
        let (distinct, index) = distinct_with_counts(tables.iter().flat_map(|t| t.iter().copied()));
        // Swapped sequences come before the host level of the prefix cache: its
        // entries make room (nothing changes when even that is not enough).
        let host_needed = distinct.len();
        self.make_host_room(host_needed)?;
        let hosts = pick_free_run(&self.tiers.host, distinct.len(), self.tiers.host_cursor);
        let host_tables: Vec<(SeqId, Vec<BlockId>)> = seqs
            .iter()
            .zip(&tables)
            .map(|(&id, t)| (id, t.iter().map(|d| hosts[index[d]]).collect()))
            .collect();
        let mut frees_device_blocks = 0;
        for &(dev, refs) in &distinct {
            if self.pool.refcount(dev)? == refs {
                frees_device_blocks += 1;
            }
        }
        // Every check is done; from here on nothing fails on a consistent manager.
        let mut plan = SwapPlan::new(SwapDirection::Out);
        for (&(dev, refs), &host) in distinct.iter().zip(&hosts) {
            take_with_refs(&mut self.tiers.host, host, refs)?;
            self.tiers.host_fill[host.index()] = self.pool.fill(dev);
            plan.push(dev, host);
        }
        if let Some(last) = hosts.last() {
            self.tiers.host_cursor = last.index() + 1;
        }
        let ticket = self.tiers.next_ticket();
        for &id in seqs {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.in_flight = Some(InFlight {
                    ticket,
                    direction: SwapDirection::Out,
                });
            }
        }
        self.tiers.pending.insert(
            ticket,
            Pending::Out {
                seqs: host_tables,
                blocks: plan.len(),
                frees_device_blocks,
            },
        );
        Ok(SwapJob {
            ticket,
            seqs: seqs.to_vec(),
            plan,
        })
    }

    /// Plans the swap-in of one sequence; see [`Self::swap_in_group`].
    ///
    /// # Errors
    /// As [`Self::swap_in_group`].
    pub fn swap_in(&mut self, seq: SeqId) -> Result<SwapJob> {
        self.one_group("swap_in")?;
        self.swap_in_group(&[seq])
    }

    /// Plans the swap-in of a group of swapped-out sequences: takes a device block for
    /// each distinct host block (consecutive where the arena has a run), gives the
    /// sequences their new tables and returns the plan. The sequences are "swapping
    /// in" until [`Self::complete_swap`]; their host blocks stay held until then.
    /// Order the engine's work by layer with [`crate::executor::tier::TransferEngine::is_layer_ready`].
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when a sequence is not
    /// swapped out, or has blocks on disk (call [`crate::executor::restore_from_disk`] first);
    /// [`Error::InvalidConfig`] for an empty group or a repeated id;
    /// [`Error::OutOfBlocks`] when the arena lacks room. Nothing changed on error.
    pub fn swap_in_group(&mut self, seqs: &[SeqId]) -> Result<SwapJob> {
        self.one_group("swap_in_group")?;
        check_group(seqs)?;
        let mut hosts_in_order = Vec::new();
        for &id in seqs {
            for &e in &self.swapped(id)?.table {
                match e {
                    TierBlock::Host(h) => hosts_in_order.push(h),
                    TierBlock::Disk(_) => {
                        return Err(state_error(
                            id,
                            "partly on disk",
                            "wholly in the host tier (restore_from_disk first)",
                        ))
                    }
                }
            }
        }
        let (distinct, index) = distinct_with_counts(hosts_in_order);
        self.ensure_available(distinct.len())?;
        self.seqs.reserve_room(seqs.len())?;
        // Prefer one run of free device blocks; evictable blocks fill in the rest.
        let n_free = distinct.len().min(self.pool.num_free());
        let mut devs = pick_free_run(&self.pool, n_free, self.tiers.device_cursor);
        for &d in &devs {
            self.pool.take(d)?;
            if let Some(f) = self.pool.fill_mut(d) {
                *f = 0;
            }
        }
        if let Some(last) = devs.last() {
            self.tiers.device_cursor = last.index() + 1;
        }
        while devs.len() < distinct.len() {
            devs.push(self.alloc_block()?);
        }
        let mut plan = SwapPlan::new(SwapDirection::In);
        for (&(host, refs), &dev) in distinct.iter().zip(&devs) {
            for _ in 1..refs {
                self.pool.incref(dev)?;
            }
            // Fills are counted from the group's tables below.
            if let Some(f) = self.pool.fill_mut(dev) {
                *f = 0;
            }
            plan.push(dev, host);
        }
        let ticket = self.tiers.next_ticket();
        let mut saved = Vec::with_capacity(seqs.len());
        for &id in seqs {
            let Some(old) = self.tiers.swapped.remove(&id) else {
                continue;
            };
            let held = old.table.iter().filter_map(|e| match e {
                TierBlock::Host(h) => Some(devs[index[h]]),
                TierBlock::Disk(_) => None,
            });
            let table = std::iter::repeat_n(BlockId::RELEASED, old.released)
                .chain(held)
                .collect();
            self.seqs.insert(
                id,
                Sequence {
                    table,
                    num_tokens: old.num_tokens,
                    admission: old.admission,
                    preempt_priority: old.preempt_priority,
                    in_flight: Some(InFlight {
                        ticket,
                        direction: SwapDirection::In,
                    }),
                    // The chain rewound to position 0: the completion registers the
                    // fresh copies again (or shares the copies still cached).
                    prefix: old.prefix.clone(),
                    twin_pending: false,
                    tracking_stopped: old.tracking_stopped,
                    computed: old.computed,
                    scheduled: 0,
                    released: old.released,
                    later: Default::default(),
                },
            )?;
            saved.push((id, old));
        }
        // Each new device block holds what the group's longest holder holds in it. A
        // block whose holders hold different lengths (a fork and its truncated twin) is
        // flagged for a recount, as a truncation flags it: when the longest holder
        // goes, the fill must fall to what the others hold.
        let bs = self.layout.block_size();
        for &id in seqs {
            let Some(s) = self.seqs.get(&id) else {
                continue;
            };
            for (i, &b) in s.table.iter().enumerate().skip(s.released) {
                // At least 1: the table covers exactly `num_tokens`.
                let want = s.num_tokens.saturating_sub(i * bs).min(bs) as u16;
                if let Some(fill) = self.pool.fill_mut(b) {
                    // Fills start at 0, so a non-zero fill is another holder's.
                    if *fill != 0 && *fill != want {
                        self.fill_dirty.insert(b);
                    }
                    if *fill < want {
                        self.live_token_slots += usize::from(want - *fill);
                        *fill = want;
                    }
                }
            }
        }
        self.note_usage();
        self.tiers.pending.insert(
            ticket,
            Pending::In {
                seqs: saved,
                blocks: plan.len(),
            },
        );
        Ok(SwapJob {
            ticket,
            seqs: seqs.to_vec(),
            plan,
        })
    }

    /// Finishes a swap whose plan has run: a swap-out releases the device blocks (they
    /// may now be allocated) and leaves the sequences swapped; a swap-in releases the
    /// host blocks and makes the sequences resident.
    ///
    /// # Errors
    /// [`Error::UnknownTicket`] when the ticket is not in flight (nothing changed); a
    /// refcount error means the manager's own state was corrupt and is reported after
    /// every block was processed.
    pub fn complete_swap(&mut self, ticket: SwapTicket) -> Result<()> {
        self.one_group("complete_swap")?;
        if let Some(r) = self.finish_host_transfer(ticket, true) {
            return r;
        }
        let pending = self
            .tiers
            .pending
            .remove(&ticket)
            .ok_or(Error::UnknownTicket(ticket))?;
        let block_bytes = self.layout.block_bytes() as u64;
        let mut result = Ok(());
        match pending {
            Pending::Out { seqs, blocks, .. } => {
                for (id, host_table) in seqs {
                    let Some(s) = self.seqs.remove(&id) else {
                        result = result.and(Err(Error::UnknownSequence(id)));
                        continue;
                    };
                    // Read the chain's ids while its blocks are still registered.
                    let prefix = s
                        .prefix
                        .as_deref()
                        .and_then(|p| p.rewound(&s.table, &self.prefix))
                        .map(Box::new);
                    result = result.and(self.release_table(&s.table[s.released..]));
                    self.tiers.swapped.insert(
                        id,
                        SwappedSeq {
                            table: host_table.into_iter().map(TierBlock::Host).collect(),
                            released: s.released,
                            num_tokens: s.num_tokens,
                            computed: s.computed,
                            admission: s.admission,
                            preempt_priority: s.preempt_priority,
                            prefix,
                            tracking_stopped: s.tracking_stopped,
                        },
                    );
                }
                self.tiers.stats.swaps_out += 1;
                self.tiers.stats.bytes_swapped_out += blocks as u64 * block_bytes;
            }
            Pending::In { seqs, blocks } => {
                for (id, old) in seqs {
                    result = result.and(self.release_tier_blocks(&old.table));
                    if let Some(s) = self.seqs.get_mut(&id) {
                        s.in_flight = None;
                    }
                    // The transfer is done: the chain registers again from position 0.
                    result = result.and(self.register_swapped_in(id));
                }
                self.tiers.stats.swaps_in += 1;
                self.tiers.stats.bytes_swapped_in += blocks as u64 * block_bytes;
            }
        }
        result
    }

    /// Undoes a swap whose plan failed or will not run: a swap-out's sequences stay
    /// resident (their host blocks are released), a swap-in's go back to swapped
    /// (their new device blocks are released; the host copy was never given up).
    ///
    /// # Errors
    /// As [`Self::complete_swap`].
    pub fn abort_swap(&mut self, ticket: SwapTicket) -> Result<()> {
        self.one_group("abort_swap")?;
        if let Some(r) = self.finish_host_transfer(ticket, false) {
            return r;
        }
        let pending = self
            .tiers
            .pending
            .remove(&ticket)
            .ok_or(Error::UnknownTicket(ticket))?;
        let mut result = Ok(());
        match pending {
            Pending::Out { seqs, .. } => {
                for (id, host_table) in seqs {
                    for &h in host_table.iter().rev() {
                        result = result.and(self.tiers.host.decref(h).map(drop));
                    }
                    if let Some(s) = self.seqs.get_mut(&id) {
                        s.in_flight = None;
                    }
                }
            }
            Pending::In { seqs, .. } => {
                for (id, old) in seqs {
                    if let Some(s) = self.seqs.remove(&id) {
                        result = result.and(self.release_table(&s.table[s.released..]));
                    }
                    self.tiers.swapped.insert(id, old);
                }
            }
        }
        result
    }

    /// Drops one reference to each tier block of a swapped table.
    fn release_tier_blocks(&mut self, table: &[TierBlock]) -> Result<()> {
        let mut result = Ok(());
        for &e in table.iter().rev() {
            let r = match e {
                TierBlock::Host(h) => self.tiers.host.decref(h),
                TierBlock::Disk(d) => self.tiers.disk.decref(BlockId(d.0)),
            };
            result = result.and(r.map(drop));
        }
        result
    }

    /// Frees a swapped-out sequence (the `free` of a sequence with no device table).
    pub(crate) fn free_swapped(&mut self, seq: SeqId) -> Result<()> {
        let s = self
            .tiers
            .swapped
            .remove(&seq)
            .ok_or(Error::UnknownSequence(seq))?;
        self.release_tier_blocks(&s.table)
    }

    /// Plans writing the host-tier blocks of swapped-out `seqs` to the disk tier
    /// (shared blocks inside the group once). The returned [`PendingTierMove`] lists
    /// `(host block, disk slot)` copies; execute them (read each host block, write it to
    /// its slot) and [`PendingTierMove::commit`], or drop it to abort.
    /// [`crate::executor::spill_to_disk`] does all three.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::SequenceState`] (not swapped out);
    /// [`Error::TierFull`] (`"disk"`) when the disk tier lacks slots;
    /// [`Error::InvalidConfig`] for an empty or repeated group. Nothing changed.
    pub fn plan_spill(&mut self, seqs: &[SeqId]) -> Result<PendingTierMove<'_>> {
        self.one_group("plan_spill")?;
        check_group(seqs)?;
        let mut hosts = Vec::new();
        for &id in seqs {
            hosts.extend(self.swapped(id)?.table.iter().filter_map(|e| match e {
                TierBlock::Host(h) => Some(*h),
                TierBlock::Disk(_) => None,
            }));
        }
        let (distinct, _) = distinct_with_counts(hosts);
        let free = self.tiers.disk.num_free();
        if distinct.len() > free {
            return Err(Error::TierFull {
                tier: "disk",
                needed: distinct.len(),
                free,
            });
        }
        let slots = pick_free_run(&self.tiers.disk, distinct.len(), self.tiers.disk_cursor);
        let moves = distinct
            .iter()
            .zip(&slots)
            .map(|(&(host, refs), &slot)| (host, DiskSlot(slot.0), refs))
            .collect();
        Ok(PendingTierMove {
            manager: self,
            to_disk: true,
            seqs: seqs.to_vec(),
            moves,
        })
    }

    /// Plans reading the disk-tier blocks of swapped-out `seqs` back into the host
    /// tier. The returned [`PendingTierMove`] lists `(host block, disk slot)` copies
    /// the other way; execute them (read each slot, check it, write the host block) and
    /// [`PendingTierMove::commit`]; afterwards [`Self::swap_in_group`] can bring the
    /// sequences to the device. [`crate::executor::restore_from_disk`] does all three.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::SequenceState`] (not swapped out);
    /// [`Error::TierFull`] (`"host"`) when the host tier lacks room;
    /// [`Error::InvalidConfig`] for an empty or repeated group. Nothing changed.
    pub fn plan_restore(&mut self, seqs: &[SeqId]) -> Result<PendingTierMove<'_>> {
        self.one_group("plan_restore")?;
        check_group(seqs)?;
        let mut on_disk = Vec::new();
        for &id in seqs {
            on_disk.extend(self.swapped(id)?.table.iter().filter_map(|e| match e {
                TierBlock::Disk(d) => Some(*d),
                TierBlock::Host(_) => None,
            }));
        }
        let (distinct, _) = distinct_with_counts(on_disk);
        self.make_host_room(distinct.len())?;
        let hosts = pick_free_run(&self.tiers.host, distinct.len(), self.tiers.host_cursor);
        let moves = distinct
            .iter()
            .zip(&hosts)
            .map(|(&(slot, refs), &host)| (host, slot, refs))
            .collect();
        Ok(PendingTierMove {
            manager: self,
            to_disk: false,
            seqs: seqs.to_vec(),
            moves,
        })
    }

    /// Slots of the disk tier the manager was configured with
    /// ([`TierConfig::num_disk_slots`]).
    pub fn num_disk_slots(&self) -> usize {
        if let Some(g0) = self.first_group() {
            return g0.num_disk_slots();
        }
        self.tiers.disk.num_blocks()
    }

    /// Checks the tiers: both pools' own invariants; every host and disk refcount
    /// equals the references from swapped tables and transfers in flight; swapped
    /// sequences have no device table and cover their tokens; every sequence marked in
    /// flight belongs to exactly the transfer that names it.
    pub(crate) fn check_tier_invariants(&self) -> std::result::Result<(), String> {
        let t = &self.tiers;
        t.host
            .check_invariants()
            .map_err(|e| format!("host tier: {e}"))?;
        t.disk
            .check_invariants()
            .map_err(|e| format!("disk tier: {e}"))?;
        let mut host_refs = vec![0u32; t.host.num_blocks()];
        let mut disk_refs = vec![0u32; t.disk.num_blocks()];
        let mut count = |id: SeqId, e: TierBlock| -> std::result::Result<(), String> {
            let slot = match e {
                TierBlock::Host(h) => host_refs.get_mut(h.index()),
                TierBlock::Disk(d) => disk_refs.get_mut(d.0 as usize),
            };
            match slot {
                Some(r) => {
                    *r += 1;
                    Ok(())
                }
                None => Err(format!("{id} points outside its tier at {e:?}")),
            }
        };
        for (&id, s) in &t.swapped {
            if self.seqs.contains_key(&id) {
                return Err(format!("{id} is both swapped and on the device"));
            }
            if s.released + s.table.len() != self.layout.blocks_for_tokens(s.num_tokens) {
                return Err(format!(
                    "swapped {id}: {} tokens but {} + {} released blocks",
                    s.num_tokens,
                    s.table.len(),
                    s.released
                ));
            }
            for &e in &s.table {
                count(id, e)?;
            }
        }
        let mut in_flight = 0;
        for (&ticket, p) in &t.pending {
            let (direction, members): (SwapDirection, Vec<(SeqId, usize)>) = match p {
                Pending::Out { seqs, .. } => {
                    for (id, table) in seqs {
                        for &h in table {
                            count(*id, TierBlock::Host(h))?;
                        }
                    }
                    (
                        SwapDirection::Out,
                        seqs.iter().map(|(id, tb)| (*id, tb.len())).collect(),
                    )
                }
                Pending::In { seqs, .. } => {
                    for (id, old) in seqs {
                        if t.swapped.contains_key(id) {
                            return Err(format!("{id} is swapping in and swapped"));
                        }
                        for &e in &old.table {
                            count(*id, e)?;
                        }
                    }
                    (
                        SwapDirection::In,
                        seqs.iter()
                            .map(|(id, old)| (*id, old.table.len()))
                            .collect(),
                    )
                }
            };
            for (id, len) in members {
                let s = self
                    .seqs
                    .get(&id)
                    .ok_or_else(|| format!("{ticket} names {id}, which has no device table"))?;
                if s.in_flight != Some(InFlight { ticket, direction }) {
                    return Err(format!("{id} in {ticket} is marked {:?}", s.in_flight));
                }
                if s.table.len() - s.released.min(s.table.len()) != len {
                    return Err(format!(
                        "{id} in {ticket}: {} device blocks ({} released) but {len} tier \
                         blocks",
                        s.table.len(),
                        s.released
                    ));
                }
                in_flight += 1;
            }
        }
        in_flight += self.check_host_cache(&mut host_refs)?;
        self.tiers.disk_cache.check()?;
        let marked = self.seqs.values().filter(|s| s.in_flight.is_some()).count();
        if marked != in_flight {
            return Err(format!(
                "{marked} sequences marked in flight, transfers and loads name {in_flight}"
            ));
        }
        for p in &t.spilled {
            match host_refs.get_mut(p.host.index()) {
                Some(r) => *r += 1,
                None => {
                    return Err(format!(
                        "spilled prefix block at {} outside the host tier",
                        p.host
                    ))
                }
            }
        }
        for (name, pool, refs) in [("host", &t.host, &host_refs), ("disk", &t.disk, &disk_refs)] {
            for (i, &r) in refs.iter().enumerate() {
                let rc = pool
                    .refcount(BlockId(i as u32))
                    .map_err(|e| e.to_string())?;
                if rc != r {
                    return Err(format!(
                        "{name} block {i}: refcount {rc} but {r} references"
                    ));
                }
            }
        }
        Ok(())
    }
}

fn lender_mut(swapped: &mut super::SeqMap<SwappedSeq>, lender: SeqId) -> Result<&mut SwappedSeq> {
    swapped
        .get_mut(&lender)
        .ok_or(Error::UnknownSequence(lender))
}

impl KvCache {
    /// Registers the blocks of swapped-in sequence `id` that its rewound chain covers
    /// (sharing the copies still cached, see `manager/prefix.rs`).
    pub(crate) fn register_swapped_in(&mut self, id: SeqId) -> Result<()> {
        let bs = self.layout.block_size();
        let Ok(h) = self.handle(id) else {
            return Ok(());
        };
        let Some(s) = self.seqs.at_mut(h) else {
            return Ok(());
        };
        super::prefix::extend_chain_in(&mut self.prefix, bs, s);
        if s.twin_pending {
            self.settle_twin(h, usize::MAX)?;
        }
        Ok(())
    }
}

/// The host-tier lending of KV-cache groups that share one host tier (see
/// [`crate::manager::groups`]): each group's host pool spans the whole tier, and a
/// hidden swapped sequence holds the host blocks other groups own.
impl KvCache {
    /// Adds the hidden swapped sequence `lender`, which will hold lent host blocks.
    pub(crate) fn insert_host_lender(&mut self, lender: SeqId) {
        self.tiers.swapped.insert(
            lender,
            SwappedSeq {
                table: Vec::new(),
                released: 0,
                num_tokens: 0,
                computed: 0,
                admission: 0,
                preempt_priority: i32::MAX,
                prefix: None,
                tracking_stopped: false,
            },
        );
    }

    /// Free host-tier blocks (of the whole shared tier, for a hybrid cache).
    pub fn num_free_host_blocks(&self) -> usize {
        if let Some(h) = &self.hybrid {
            return h.num_free_host_blocks();
        }
        self.tiers.host_free()
    }

    /// Takes one free host block and lends it to `lender`. Returns the block and its
    /// index in the lender's table.
    pub(crate) fn lend_host_block(&mut self, lender: SeqId) -> Result<(BlockId, usize)> {
        let bs = self.layout.block_size();
        let t = &mut self.tiers;
        let s = lender_mut(&mut t.swapped, lender)?;
        let h = t.host.allocate()?;
        t.host_fill[h.index()] = bs as u16;
        s.table.push(TierBlock::Host(h));
        s.num_tokens += bs;
        s.computed += bs;
        Ok((h, s.table.len() - 1))
    }

    /// Takes back the host block lent at index `pos` of `lender`'s table: it becomes
    /// free here. Returns the block the swap-remove moved into `pos`, if any.
    pub(crate) fn reclaim_host_block(
        &mut self,
        lender: SeqId,
        pos: usize,
    ) -> Result<Option<BlockId>> {
        let bs = self.layout.block_size();
        let t = &mut self.tiers;
        let s = lender_mut(&mut t.swapped, lender)?;
        let host = |e: Option<&TierBlock>| match e {
            Some(&TierBlock::Host(h)) => Ok(h),
            other => Err(Error::CorruptBlockTable(format!(
                "lent host block {pos}: {other:?}"
            ))),
        };
        let h = host(s.table.get(pos))?;
        s.table.swap_remove(pos);
        let moved = s.table.get(pos).map(|e| host(Some(e))).transpose()?;
        s.num_tokens -= bs;
        s.computed -= bs;
        t.host.decref(h)?;
        t.host_fill[h.index()] = 0;
        Ok(moved)
    }

    /// The host blocks `lender` holds, in table order.
    pub(crate) fn lent_host_blocks(&self, lender: SeqId) -> impl Iterator<Item = BlockId> + '_ {
        self.tiers
            .swapped
            .get(&lender)
            .into_iter()
            .flat_map(|s| &s.table)
            .filter_map(|e| match e {
                TierBlock::Host(h) => Some(*h),
                TierBlock::Disk(_) => None,
            })
    }
}
