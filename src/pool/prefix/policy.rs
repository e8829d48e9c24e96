//! Which evictable cached block goes first.
//!
//! Only *leaves* are ever candidates: a cached block whose registered children are all
//! gone. So a chain shrinks from its tail and is never cut in the middle, whatever the
//! policy says. Among leaves, request priority is a hard tier (every candidate of a
//! lower priority goes before any of a higher one) and the policy's key orders the rest:
//! lowest key first.

/// What a policy knows about a block when it becomes an eviction candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictionCandidate {
    /// The manager's logical clock when the block was last used (hit, registered or
    /// released); larger is more recent.
    pub last_used: u64,
    /// Blocks from the start of the prompt up to and including this one (1 for the
    /// first block): recomputing a block attends over `depth` blocks of context.
    pub depth: u32,
    /// Prefix-cache hits on the block since it was registered.
    pub hits: u32,
}

/// Orders eviction candidates; see the module docs.
pub trait EvictionPolicy: std::fmt::Debug + Send + Sync {
    /// The key of a block entering the candidate set; lower keys are evicted first.
    /// Keys are fixed while the block stays a candidate.
    fn key(&mut self, block: &EvictionCandidate) -> u64;

    /// Called with the key of each evicted block.
    fn on_evict(&mut self, _key: u64) {}

    /// A short name for logs and benches.
    fn name(&self) -> &'static str;

    /// A boxed copy (the manager is `Clone`).
    fn clone_box(&self) -> Box<dyn EvictionPolicy>;
}

impl Clone for Box<dyn EvictionPolicy> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// Least recently used first (the default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LruPolicy;

impl EvictionPolicy for LruPolicy {
    fn key(&mut self, block: &EvictionCandidate) -> u64 {
        block.last_used
    }

    fn name(&self) -> &'static str {
        "lru"
    }

    fn clone_box(&self) -> Box<dyn EvictionPolicy> {
        Box::new(*self)
    }
}

/// GreedyDual-Size-Frequency: weighs what a block would cost to recompute and how often
/// it was hit against how long it has sat unused.
///
/// A block entering the candidate set gets `inflation + (1 + hits) * (1 + depth) *
/// weight`; `inflation` rises to the key of every evicted block, so blocks that wait
/// long enough are eventually evicted however valuable they were (aging), while among
/// blocks freed around the same time the deep (expensive to recompute) and often hit
/// ones stay longest. All blocks have the same size, so size drops out of GDSF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostAwarePolicy {
    /// Key units per unit of `(1 + hits) * (1 + depth)`.
    pub weight: u64,
    /// Largest hit count that still adds value (bounds the key of hot blocks).
    pub max_hits: u32,
    inflation: u64,
}

impl CostAwarePolicy {
    /// A policy with `weight` key units per unit of value and hits capped at `max_hits`.
    pub const fn new(weight: u64, max_hits: u32) -> Self {
        CostAwarePolicy {
            weight,
            max_hits,
            inflation: 0,
        }
    }

    /// The current inflation (the key of the last evicted block, or 0).
    pub const fn inflation(&self) -> u64 {
        self.inflation
    }
}

impl Default for CostAwarePolicy {
    /// Weight 1, hits capped at 64.
    fn default() -> Self {
        CostAwarePolicy::new(1, 64)
    }
}

impl EvictionPolicy for CostAwarePolicy {
    fn key(&mut self, block: &EvictionCandidate) -> u64 {
        let hits = u64::from(block.hits.min(self.max_hits));
        let value = (1 + hits)
            .saturating_mul(1 + u64::from(block.depth))
            .saturating_mul(self.weight);
        self.inflation.saturating_add(value)
    }

    fn on_evict(&mut self, key: u64) {
        self.inflation = self.inflation.max(key);
    }

    fn name(&self) -> &'static str {
        "cost-aware"
    }

    fn clone_box(&self) -> Box<dyn EvictionPolicy> {
        Box::new(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_aware_keeps_deep_and_hot_blocks_until_they_age() {
        let mut p = CostAwarePolicy::default();
        let shallow = p.key(&EvictionCandidate {
            last_used: 9,
            depth: 1,
            hits: 0,
        });
        let deep_hot = p.key(&EvictionCandidate {
            last_used: 1,
            depth: 8,
            hits: 3,
        });
        assert!(shallow < deep_hot);
        p.on_evict(deep_hot);
        let later = p.key(&EvictionCandidate {
            last_used: 10,
            depth: 1,
            hits: 0,
        });
        assert!(
            later > deep_hot,
            "aging: new candidates rank above old evictions"
        );
        assert!(
            LruPolicy.key(&EvictionCandidate {
                last_used: 3,
                depth: 1,
                hits: 0
            }) < LruPolicy.key(&EvictionCandidate {
                last_used: 4,
                depth: 1,
                hits: 0
            })
        );
    }
}
