//! Preemption: which sequences give up their device blocks when the arena is short,
//! and whether each is swapped to the host tier or dropped and recomputed.
//!
//! # Policy
//!
//! Victims are whole *fork groups* (every sequence descending from one admission,
//! so shared blocks move once and stay shared), taken in vLLM's order: lowest
//! priority first ([`KvCache::set_preempt_priority`]), then the most recently
//! admitted. Sequences with a swap in flight are never picked.
//!
//! For each victim the [`CostModel`] compares
//!
//! * **swap**: `2 x bytes / swap_bytes_per_s` (out now, back in later), against
//! * **recompute**: `tokens / prefill_tokens_per_s` (the prompt and generated tokens
//!   the engine must prefill again),
//!
//! and picks the cheaper, unless the host tier has no room (then recompute) or the
//! policy forces one way. The transfer bandwidth is measured on the real storage by
//! [`crate::executor::probe_cost_model`]; the prefill throughput is the engine's own figure. Both can be
//! overridden.
//!
//! # Engine loop (overload)
//!
//! ```
//! use pagedkv::manager::preempt::{CostModel, PreemptAction};
//! use pagedkv::{CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout,
//!               ModelShape, PreemptPolicy, SeqId, Storage, TierConfig};
//!
//! let shape = ModelShape { num_layers: 2, num_q_heads: 4, num_kv_heads: 2, head_dim: 8,
//!                          kv_dtype: DType::F16 };
//! let layout = KvLayout::new(shape, 16)?;
//! let mut storage = HostStorage::with_host_tier(layout, 8, 16)?;
//! let tiers = TierConfig { num_host_blocks: 16, num_disk_slots: 0 };
//! let mut kv = KvCache::with_tiers(layout, CacheConfig::new(8), tiers)?;
//! let policy = PreemptPolicy::cost_based(pagedkv::executor::probe_cost_model(&mut storage, 4, 10_000.0)?);
//! let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
//!
//! kv.admit(SeqId(1), 64, &mut slots)?;   // 4 blocks
//! kv.admit(SeqId(2), 64, &mut slots)?;   // 4 blocks: the arena is full
//! let err = kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap_err();
//! if let Error::OutOfBlocks { needed, .. } = err {
//!     for p in kv.preempt_for(needed, &policy)? {
//!         if let PreemptAction::Swap(job) = &p.action {
//!             storage.swap(&job.plan)?;        // or a TransferEngine
//!             kv.complete_swap(job.ticket)?;
//!         }                                  // Recompute: re-admit later with its tokens
//!     }
//! }
//! kv.append(SeqId(1), 1, &mut slots, &mut copies)?;  // fits now
//! assert!(!kv.contains(SeqId(2)) || kv.is_swapped(SeqId(2)));
//! # Ok::<(), pagedkv::Error>(())
//! ```

use crate::error::{Error, Result};
use crate::manager::{KvCache, SwapJob};

use crate::ids::{BlockId, SeqId};

/// Events kept by [`KvCache::take_preempt_events`] before the oldest are
/// dropped.
pub const MAX_PREEMPT_EVENTS: usize = 4096;

/// The two throughputs the swap-or-recompute decision weighs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Device <-> host transfer bandwidth, bytes per second.
    pub swap_bytes_per_s: f64,
    /// Prefill throughput of the engine, tokens per second.
    pub prefill_tokens_per_s: f64,
}

impl CostModel {
    /// A model from known figures (an override of the probe).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when a figure is not a positive finite number.
    pub fn new(swap_bytes_per_s: f64, prefill_tokens_per_s: f64) -> Result<Self> {
        for (field, v) in [
            ("swap_bytes_per_s", swap_bytes_per_s),
            ("prefill_tokens_per_s", prefill_tokens_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::config(field, format!("{v} is not a positive rate")));
            }
        }
        Ok(CostModel {
            swap_bytes_per_s,
            prefill_tokens_per_s,
        })
    }

    /// Seconds to swap `bytes` out and back in.
    pub fn swap_seconds(&self, bytes: usize) -> f64 {
        2.0 * bytes as f64 / self.swap_bytes_per_s
    }

    /// Seconds to prefill `tokens` again.
    pub fn recompute_seconds(&self, tokens: usize) -> f64 {
        tokens as f64 / self.prefill_tokens_per_s
    }
}

/// How [`KvCache::preempt_for`] chooses between swapping and recomputing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PreemptMode {
    /// The cheaper by the cost model.
    CostBased,
    /// Always swap (recompute only when the host tier is full).
    AlwaysSwap,
    /// Always drop for recomputation.
    AlwaysRecompute,
}

/// The preemption policy: a mode, the cost model it consults, and whether sequences
/// already reserved this step may be taken.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PreemptPolicy {
    /// How to choose.
    pub mode: PreemptMode,
    /// The throughputs weighed.
    pub cost: CostModel,
    /// `Some(p)`: a group whose priority is below `p` may be preempted even when a
    /// member holds an uncommitted reservation of this step (vLLM unschedules such a
    /// request for a higher-priority one). Its reservations are cancelled first and
    /// listed in [`Preemption::unscheduled`]: the engine drops those sequences from
    /// the step it has not launched yet (and rebuilds the step's buffers). Pass the
    /// priority of the sequence the blocks are for. `None` (the default): a
    /// reserved sequence is never taken.
    pub unschedule_below: Option<i32>,
}

impl PreemptPolicy {
    /// Swap or recompute, whichever the cost model says is cheaper.
    pub fn cost_based(cost: CostModel) -> Self {
        PreemptPolicy {
            mode: PreemptMode::CostBased,
            cost,
            unschedule_below: None,
        }
    }

    /// This policy, allowed to unschedule reserved groups of priority below
    /// `priority` ([`Self::unschedule_below`]).
    pub fn unscheduling_below(self, priority: i32) -> Self {
        PreemptPolicy {
            unschedule_below: Some(priority),
            ..self
        }
    }
}

/// Why a victim was swapped or recomputed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreemptReason {
    /// The cost model found swapping cheaper.
    SwapCheaper,
    /// The cost model found recomputing cheaper.
    RecomputeCheaper,
    /// Swapping was preferred but the host tier could not take the group.
    HostTierFull,
    /// The policy forces this action.
    Forced,
    /// Swapping was preferred but this cache cannot swap the group as one: a hybrid
    /// cache swaps one sequence at a time, so a fork group of several is recomputed.
    SwapUnavailable,
}

/// What happened to one preempted group.
#[derive(Debug, Clone, PartialEq)]
pub enum PreemptAction {
    /// Swapped out: execute the job's plan, then
    /// [`KvCache::complete_swap`] frees the device blocks; later
    /// [`KvCache::swap_in_group`] brings the group back.
    Swap(SwapJob),
    /// Swapped out in every group of a hybrid cache: execute every plan of the job,
    /// then [`KvCache::complete_swap_grouped`]; later [`KvCache::swap_in_grouped`]
    /// brings it back.
    SwapGroups(super::groups::GroupSwapJob),
    /// Freed now: the engine re-admits each sequence with its tokens (prompt and
    /// generated) when there is room, and prefills them again.
    Recompute {
        /// Each freed sequence and the tokens it held.
        tokens: Vec<(SeqId, usize)>,
    },
}

/// One preempted group and the decision taken for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Preemption {
    /// The group (a sequence and its forks), in id order.
    pub seqs: Vec<SeqId>,
    /// Members whose reservation of this step was cancelled first (only with
    /// [`PreemptPolicy::unschedule_below`]): drop them from the step.
    pub unscheduled: Vec<SeqId>,
    /// What was done.
    pub action: PreemptAction,
    /// Why.
    pub reason: PreemptReason,
    /// Device blocks the preemption frees (a swap frees them on completion).
    pub blocks_freed: usize,
    /// Distinct blocks of the group, i.e. the blocks a swap moves.
    pub blocks: usize,
    /// Tokens a recompute would prefill again (the group's computed tokens).
    pub tokens: usize,
    /// The cost model's estimate for swapping, in seconds.
    pub swap_seconds: f64,
    /// The cost model's estimate for recomputing, in seconds.
    pub recompute_seconds: f64,
}

/// A record of one preemption, without its plan (see
/// [`KvCache::take_preempt_events`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PreemptEvent {
    /// The group.
    pub seqs: Vec<SeqId>,
    /// True for a swap, false for a recompute.
    pub swapped: bool,
    /// Why.
    pub reason: PreemptReason,
    /// Device blocks freed.
    pub blocks_freed: usize,
    /// Estimated seconds to swap.
    pub swap_seconds: f64,
    /// Estimated seconds to recompute.
    pub recompute_seconds: f64,
}

/// A candidate group with everything the decision needs.
struct Candidate {
    priority: i32,
    admission: u64,
    seqs: Vec<SeqId>,
    /// Members holding a reservation of this step.
    reserved: Vec<SeqId>,
    blocks: usize,
    blocks_freed: usize,
    tokens: usize,
}

impl KvCache {
    /// Fork groups of resident sequences with no swap in flight, in victim order;
    /// groups in this step's batch only when their priority is below
    /// `unschedule_below`.
    fn preemption_candidates(&self, unschedule_below: Option<i32>) -> Result<Vec<Candidate>> {
        // Keyed by admission; a sequence without a stamp (0) is a group of its own.
        let mut groups: std::collections::HashMap<(u64, SeqId), Vec<SeqId>> = Default::default();
        for (&id, s) in &self.seqs {
            // A hybrid group's hidden lenders hold pages, not tokens.
            if super::groups::is_hidden(id) {
                continue;
            }
            let key = match s.admission {
                0 => (0, id),
                a => (a, SeqId(0)),
            };
            groups.entry(key).or_default().push(id);
        }
        let mut out = Vec::with_capacity(groups.len());
        for ((admission, _), mut seqs) in groups {
            // A group with a member in flight is busy as a whole.
            if seqs.iter().any(|id| self.resident(*id).is_err()) {
                continue;
            }
            seqs.sort_unstable();
            let reserved: Vec<SeqId> = seqs
                .iter()
                .copied()
                .filter(|id| self.idle(*id).is_err())
                .collect();
            let mut tokens = 0;
            let mut priority = i32::MAX;
            for id in &seqs {
                let s = self.resident(*id)?;
                tokens += s.computed;
                priority = priority.min(s.preempt_priority);
            }
            // So is one in this step's batch (the batch may be writing into its
            // blocks), unless the policy may unschedule it.
            if !reserved.is_empty() && unschedule_below.is_none_or(|p| priority >= p) {
                continue;
            }
            let (blocks, blocks_freed) = self.held_by(&seqs)?;
            out.push(Candidate {
                priority,
                admission,
                seqs,
                reserved,
                blocks,
                blocks_freed,
                tokens,
            });
        }
        // Lowest priority first, then the most recent admission.
        out.sort_by(|a, b| {
            a.priority
                .cmp(&b.priority)
                .then(b.admission.cmp(&a.admission))
        });
        Ok(out)
    }

    /// The distinct blocks the resident sequences `seqs` hold, and how many of them
    /// no other sequence holds (those a preemption frees).
    pub(super) fn held_by(&self, seqs: &[SeqId]) -> Result<(usize, usize)> {
        let mut refs: std::collections::HashMap<BlockId, u32> = Default::default();
        for id in seqs {
            let s = self.resident(*id)?;
            for &b in &s.table[s.released..] {
                *refs.entry(b).or_default() += 1;
            }
        }
        let mut freed = 0;
        for (&b, &r) in &refs {
            if self.pool.refcount(b)? == r {
                freed += 1;
            }
        }
        Ok((refs.len(), freed))
    }

    /// Makes `needed_blocks` blocks available by preempting fork groups (see the
    /// [module docs](crate::manager::preempt) for the order and the decision).
    ///
    /// `needed_blocks` is the whole need of the allocation that failed, as
    /// [`Error::OutOfBlocks`]`::needed` or [`KvCache::blocks_needed`] report it
    /// (not the shortfall): blocks already free or evictable and those in-flight
    /// swap-outs will free are counted first, and nothing is preempted when they
    /// suffice.
    ///
    /// Sequences in this step's batch (an uncommitted [`KvCache::reserve`]) are
    /// never picked, nor are their fork groups: the batch may be writing into their
    /// blocks. With [`PreemptPolicy::unschedule_below`], a lower-priority group of the
    /// batch may be: its reservations are cancelled and listed in
    /// [`Preemption::unscheduled`]. An engine on the one-call path ([`KvCache::append`], which
    /// commits at once) decides preemption before it hands out the step's slots.
    ///
    /// Recomputed groups are freed at once. Swapped groups free their blocks when the
    /// engine has run each returned [`PreemptAction::Swap`] plan and called
    /// [`KvCache::complete_swap`]. Every decision is also counted in
    /// [`KvCache::tier_stats`] and recorded for
    /// [`KvCache::take_preempt_events`].
    ///
    /// A group's freed blocks are those only it references; blocks it shares with
    /// other groups are not counted, so the estimate errs on the side of one victim
    /// too many, never too few.
    ///
    /// The sequence whose allocation failed may itself be picked (it may be the
    /// newest): check the returned groups before retrying.
    ///
    /// # Errors
    /// [`Error::OutOfBlocks`] when even preempting every candidate would not free
    /// enough; nothing is preempted then.
    pub fn preempt_for(
        &mut self,
        needed_blocks: usize,
        policy: &PreemptPolicy,
    ) -> Result<Vec<Preemption>> {
        let chosen = match &self.hybrid {
            Some(h) => h.choose_victims(needed_blocks, policy)?,
            None => {
                let have = self.num_available_blocks() + self.tiers.pending_device_release();
                if needed_blocks <= have {
                    return Ok(Vec::new());
                }
                let candidates = self.preemption_candidates(policy.unschedule_below)?;
                choose_victims(
                    candidates,
                    policy,
                    needed_blocks,
                    have,
                    self.tiers.host_free(),
                    self.layout.block_bytes(),
                    |_| true,
                )?
            }
        };
        // Decisions made on a consistent state; applying them cannot fail short of
        // a corrupt manager. A hybrid cache's calls below reach every group.
        let mut out = Vec::with_capacity(chosen.len());
        for v in chosen {
            for &id in &v.c.reserved {
                self.cancel(id)?; // cancels its reservations
            }
            let action = match (v.swap, self.is_hybrid()) {
                (true, false) => PreemptAction::Swap(self.swap_out_group(&v.c.seqs)?),
                (true, true) => PreemptAction::SwapGroups(self.swap_out_grouped(v.c.seqs[0])?),
                (false, _) => PreemptAction::Recompute {
                    tokens: self.free_for_recompute(&v.c.seqs)?,
                },
            };
            out.push(self.record_preemption(v, action));
        }
        Ok(out)
    }

    /// Frees `seqs` for a recompute preemption; returns each with its computed tokens.
    fn free_for_recompute(&mut self, seqs: &[SeqId]) -> Result<Vec<(SeqId, usize)>> {
        let mut tokens = Vec::with_capacity(seqs.len());
        for &id in seqs {
            tokens.push((id, self.num_computed_tokens(id)?));
            self.free(id)?;
        }
        Ok(tokens)
    }

    /// Counts and records a preemption carried out (a hybrid cache records in its
    /// group 0, whose counters [`Self::tier_stats`] and [`Self::take_preempt_events`]
    /// read).
    fn record_preemption(&mut self, v: Victim, action: PreemptAction) -> Preemption {
        if let Some(h) = &mut self.hybrid {
            return h.group_mut(0).record_preemption(v, action);
        }
        let Victim {
            c,
            swap,
            reason,
            swap_seconds,
            recompute_seconds,
        } = v;
        let stats = &mut self.tiers.stats;
        stats.preemptions += 1;
        if swap {
            stats.preempt_swaps += 1;
        } else {
            stats.preempt_recomputes += 1;
        }
        if self.tiers.events.len() == MAX_PREEMPT_EVENTS {
            self.tiers.events.pop_front();
        }
        self.tiers.events.push_back(PreemptEvent {
            seqs: c.seqs.clone(),
            swapped: swap,
            reason,
            blocks_freed: c.blocks_freed,
            swap_seconds,
            recompute_seconds,
        });
        Preemption {
            seqs: c.seqs,
            unscheduled: c.reserved,
            action,
            reason,
            blocks_freed: c.blocks_freed,
            blocks: c.blocks,
            tokens: c.tokens,
            swap_seconds,
            recompute_seconds,
        }
    }

    /// The preemptions recorded since the last call, oldest first (at most
    /// [`MAX_PREEMPT_EVENTS`]; older ones are dropped).
    pub fn take_preempt_events(&mut self) -> Vec<PreemptEvent> {
        if let Some(h) = &mut self.hybrid {
            return h.group_mut(0).take_preempt_events();
        }
        self.tiers.events.drain(..).collect()
    }
}

/// A candidate chosen, with the decision taken for it.
struct Victim {
    c: Candidate,
    swap: bool,
    reason: PreemptReason,
    swap_seconds: f64,
    recompute_seconds: f64,
}

/// Takes `candidates` in order until `have` reaches `needed`, deciding swap or
/// recompute for each (`may_swap` false forces a recompute); refuses with nothing
/// chosen when every candidate together frees too little.
fn choose_victims(
    candidates: Vec<Candidate>,
    policy: &PreemptPolicy,
    needed: usize,
    mut have: usize,
    mut host_free: usize,
    block_bytes: usize,
    may_swap: impl Fn(&Candidate) -> bool,
) -> Result<Vec<Victim>> {
    let mut chosen = Vec::new();
    for c in candidates {
        if have >= needed {
            break;
        }
        let swap_seconds = policy.cost.swap_seconds(c.blocks * block_bytes);
        let recompute_seconds = policy.cost.recompute_seconds(c.tokens);
        let (swap, reason) = match policy.mode {
            PreemptMode::AlwaysSwap => (true, PreemptReason::Forced),
            PreemptMode::AlwaysRecompute => (false, PreemptReason::Forced),
            PreemptMode::CostBased if swap_seconds <= recompute_seconds => {
                (true, PreemptReason::SwapCheaper)
            }
            PreemptMode::CostBased => (false, PreemptReason::RecomputeCheaper),
        };
        // A swap the host tier cannot take becomes a recompute.
        let (swap, reason) = if swap && c.blocks > host_free {
            (false, PreemptReason::HostTierFull)
        } else if swap && !may_swap(&c) {
            (false, PreemptReason::SwapUnavailable)
        } else {
            (swap, reason)
        };
        if swap {
            host_free -= c.blocks;
        }
        have += c.blocks_freed;
        chosen.push(Victim {
            c,
            swap,
            reason,
            swap_seconds,
            recompute_seconds,
        });
    }
    if have < needed {
        return Err(Error::OutOfBlocks { needed, free: have });
    }
    Ok(chosen)
}

impl super::groups::Groups {
    /// The victims of [`KvCache::preempt_for`] on a hybrid cache: `needed_pages` of
    /// the whole arena.
    /// Victims and their order come from group 0 (every group holds the same
    /// sequences); the pages a victim holds and frees are summed over the groups. A
    /// swap moves one sequence in every group ([`PreemptAction::SwapGroups`]), so a
    /// fork group of several sequences is recomputed rather than swapped (its shared
    /// pages would move once per member).
    fn choose_victims(&self, needed_pages: usize, policy: &PreemptPolicy) -> Result<Vec<Victim>> {
        let pending: usize = (0..self.num_groups())
            .map(|g| self.group(g).tiers.pending_device_release())
            .sum();
        let have = self.num_free_pages() + pending;
        if needed_pages <= have {
            return Ok(Vec::new());
        }
        let mut candidates = self
            .group(0)
            .preemption_candidates(policy.unschedule_below)?;
        for c in &mut candidates {
            (c.blocks, c.blocks_freed) = (0, 0);
            for g in 0..self.num_groups() {
                let (blocks, freed) = self.group(g).held_by(&c.seqs)?;
                c.blocks += blocks;
                c.blocks_freed += freed;
            }
        }
        choose_victims(
            candidates,
            policy,
            needed_pages,
            have,
            self.num_free_host_blocks(),
            self.group(0).layout.block_bytes(),
            |c| c.seqs.len() == 1,
        )
    }
}
