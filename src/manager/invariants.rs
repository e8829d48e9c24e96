//! The manager's self-check: every published counter recomputed from the tables.

use crate::ids::BlockId;
use crate::pool::BlockState;

use super::KvCache;

impl KvCache {
    /// Checks every invariant between tables and pool: refcounts equal table
    /// references, no table points at a free block, tables cover exactly their tokens,
    /// the live-slot counter matches the blocks' fills, and the prefix cache is
    /// consistent: every cached block is in the index exactly once, the index names only
    /// live or cached blocks with matching hashes, chains are linked parent to child
    /// (no live block under a cached parent), pins and eviction candidates match.
    ///
    /// # Errors
    /// A message describing the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        if let Some(h) = &self.hybrid {
            return h.check_invariants();
        }
        self.pool.check_invariants()?;
        self.seqs.check()?;
        self.fill_dirty
            .check()
            .map_err(|e| format!("fill recount flags: {e}"))?;
        let mut refs = vec![0u32; self.num_blocks()];
        let mut fills = vec![0u16; self.num_blocks()];
        let bs = self.block_size();
        for (id, s) in &self.seqs {
            if s.computed + s.scheduled > s.num_tokens {
                return Err(format!(
                    "sequence {id}: {} computed + {} reserved tokens but {} slots",
                    s.computed, s.scheduled, s.num_tokens
                ));
            }
            {
                // Every reservation ahead holds a query token, and the oldest one too.
                let none = std::collections::VecDeque::new();
                let q = s.later.as_deref().unwrap_or(&none);
                if q.contains(&0) || (!q.is_empty() && s.later_tokens() >= s.scheduled) {
                    return Err(format!(
                        "sequence {id}: reservations ahead {q:?} within {} reserved tokens",
                        s.scheduled
                    ));
                }
            }
            if s.table.len() != self.layout.blocks_for_tokens(s.num_tokens) {
                return Err(format!(
                    "sequence {id}: {} tokens but {} blocks",
                    s.num_tokens,
                    s.table.len()
                ));
            }
            if s.released > s.table.len()
                || s.released > self.first_block_in_window(s.computed)
                || s.table[..s.released]
                    .iter()
                    .any(|&b| b != BlockId::RELEASED)
            {
                return Err(format!(
                    "sequence {id}: {} released blocks of {} with {} computed tokens \
                     (window {:?})",
                    s.released,
                    s.table.len(),
                    s.computed,
                    self.window
                ));
            }
            for (i, &b) in s.table.iter().enumerate().skip(s.released) {
                match refs.get_mut(b.index()) {
                    Some(r) => *r += 1,
                    None => return Err(format!("sequence {id} points outside the arena at {b}")),
                }
                let held = s.num_tokens.saturating_sub(i * bs).min(bs) as u16;
                fills[b.index()] = fills[b.index()].max(held);
            }
        }
        // A store to the host level in flight holds its device blocks, full.
        for b in self.tiers.host_cache.held_device_blocks() {
            match refs.get_mut(b.index()) {
                Some(r) => *r += 1,
                None => return Err(format!("a host store reads {b}, outside the arena")),
            }
            fills[b.index()] = bs as u16;
        }
        let mut live_slots = 0;
        for (i, &r) in refs.iter().enumerate() {
            let b = BlockId(i as u32);
            let rc = self.pool.refcount(b).map_err(|e| e.to_string())?;
            if rc != r {
                return Err(format!("block {b}: refcount {rc} but {r} table references"));
            }
            if r > 0 {
                if self.pool.state(b).map_err(|e| e.to_string())? != BlockState::Live {
                    return Err(format!("block {b} is referenced but not live"));
                }
                let fill = self.pool.fill(b);
                if fill != fills[i] {
                    return Err(format!(
                        "block {b}: fill {fill} but its holders hold {}",
                        fills[i]
                    ));
                }
                live_slots += usize::from(fill);
            }
        }
        if live_slots != self.live_token_slots {
            return Err(format!(
                "live slots {} but blocks hold {live_slots}",
                self.live_token_slots
            ));
        }
        self.check_prefix_invariants()?;
        self.check_tier_invariants()
    }
}
