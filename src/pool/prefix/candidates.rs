//! The eviction candidate set: cached, unpinned leaves ordered by
//! `(priority, policy key, block)`, lowest first.
//!
//! Most candidates arrive in order: a block becomes a candidate when it is released, and
//! under `LruPolicy` its key is the clock at that moment, larger than every key already
//! in the set; the parent a victim leaves behind often ranks below everything else.
//! Those go into an intrusive doubly-linked list kept sorted by the full order (links in
//! per-block arrays, no allocation per operation): appended at the tail when they rank
//! at or after it, prepended at the head when they rank at or before it, O(1) either way.
//! Anything else (a key in the middle: mixed priorities, a block unpinned long after its
//! release, many keys of `CostAwarePolicy`) goes into an ordered overflow set, O(log n).
//! The next victim is the lower of the list's head and the set's first element, so the
//! order is exactly the full order whatever the policy.

use std::collections::BTreeSet;

const NIL: u32 = u32::MAX;

/// `(priority, key, block)`, compared in that order.
type Rank = (i32, u64, u32);

/// One block's place in the list. 32 bytes, aligned to 32, so never split across two
/// cache lines.
#[derive(Debug, Clone, Copy)]
#[repr(align(32))]
struct Node {
    /// `(priority, key)` while the block is in the list.
    rank: (i32, u64),
    prev: u32,
    next: u32,
    /// In the list (not the overflow set).
    listed: bool,
}

const FREE_NODE: Node = Node {
    rank: (0, 0),
    prev: NIL,
    next: NIL,
    listed: false,
};

/// See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct Candidates {
    /// Per block, its rank, links and flag in one record: an insert or an unlink
    /// touches one cache line per block instead of one per array.
    nodes: Vec<Node>,
    head: u32,
    tail: u32,
    listed_len: usize,
    overflow: BTreeSet<Rank>,
}

impl Candidates {
    pub(crate) fn new(num_blocks: usize) -> Self {
        Candidates {
            nodes: vec![FREE_NODE; num_blocks],
            head: NIL,
            tail: NIL,
            listed_len: 0,
            overflow: BTreeSet::new(),
        }
    }

    fn rank_of(&self, b: u32) -> Rank {
        let (p, k) = self.nodes[b as usize].rank;
        (p, k, b)
    }

    pub(crate) fn len(&self) -> usize {
        self.listed_len + self.overflow.len()
    }

    /// Adds block `b` with `priority` and `key`; it must not be a candidate already.
    pub(crate) fn insert(&mut self, priority: i32, key: u64, b: u32) {
        let i = b as usize;
        let r = (priority, key, b);
        if i >= self.nodes.len() {
            // Not reachable (the index covers the arena); stays exact anyway.
            self.overflow.insert(r);
            return;
        }
        if self.tail == NIL {
            self.nodes[i].rank = (priority, key);
            self.nodes[i].prev = NIL;
            self.nodes[i].next = NIL;
            self.head = b;
            self.tail = b;
        } else if r > self.rank_of(self.tail) {
            self.nodes[i].rank = (priority, key);
            self.nodes[i].prev = self.tail;
            self.nodes[i].next = NIL;
            self.nodes[self.tail as usize].next = b;
            self.tail = b;
        } else if r < self.rank_of(self.head) {
            self.nodes[i].rank = (priority, key);
            self.nodes[i].prev = NIL;
            self.nodes[i].next = self.head;
            self.nodes[self.head as usize].prev = b;
            self.head = b;
        } else {
            self.overflow.insert(r);
            return;
        }
        self.nodes[i].listed = true;
        self.listed_len += 1;
    }

    /// Hints the CPU to fetch block `b`'s record (an insert of `b` is coming).
    #[inline]
    pub(crate) fn prefetch(&self, b: u32) {
        if let Some(n) = self.nodes.get(b as usize) {
            crate::pool::prefetch(n);
        }
    }

    /// Removes block `b`, a candidate with `priority` and `key`.
    pub(crate) fn remove(&mut self, priority: i32, key: u64, b: u32) {
        if self.nodes.get(b as usize).is_some_and(|n| n.listed) {
            self.unlink(b);
        } else {
            self.overflow.remove(&(priority, key, b));
        }
    }

    fn unlink(&mut self, b: u32) {
        let i = b as usize;
        let (p, n) = (self.nodes[i].prev, self.nodes[i].next);
        if p == NIL {
            self.head = n;
        } else {
            self.nodes[p as usize].next = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.nodes[n as usize].prev = p;
        }
        self.nodes[i].prev = NIL;
        self.nodes[i].next = NIL;
        self.nodes[i].listed = false;
        self.listed_len -= 1;
    }

    /// Takes the lowest candidate out.
    pub(crate) fn pop_first(&mut self) -> Option<Rank> {
        let listed = (self.head != NIL).then(|| self.rank_of(self.head));
        match (listed, self.overflow.first()) {
            (Some(l), Some(&o)) if o < l => self.overflow.pop_first(),
            (Some(l), _) => {
                self.unlink(l.2);
                Some(l)
            }
            (None, _) => self.overflow.pop_first(),
        }
    }

    /// Whether block `b` is a candidate with `priority` and `key`.
    pub(crate) fn contains(&self, priority: i32, key: u64, b: u32) -> bool {
        if self.nodes.get(b as usize).is_some_and(|n| n.listed) {
            self.nodes[b as usize].rank == (priority, key)
        } else {
            self.overflow.contains(&(priority, key, b))
        }
    }

    /// Follows the arena to `num_blocks`; no candidate may be at or above it.
    pub(crate) fn resize(&mut self, num_blocks: usize) {
        self.nodes.resize(num_blocks, FREE_NODE);
    }

    /// Checks the list's links, order and count, and that no block is in both halves.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut count = 0;
        let mut prev = NIL;
        let mut b = self.head;
        while b != NIL {
            let i = b as usize;
            if !self.nodes.get(i).is_some_and(|n| n.listed) {
                return Err(format!("block #{b} is linked but not flagged as listed"));
            }
            if self.nodes[i].prev != prev {
                return Err(format!(
                    "block #{b}: back link {} not {prev}",
                    self.nodes[i].prev
                ));
            }
            if prev != NIL && self.rank_of(prev) >= self.rank_of(b) {
                return Err(format!("candidate list out of order at block #{b}"));
            }
            if self.overflow.contains(&self.rank_of(b)) {
                return Err(format!("block #{b} is in the list and the overflow set"));
            }
            count += 1;
            if count > self.listed_len {
                return Err("candidate list longer than its count (a cycle?)".into());
            }
            prev = b;
            b = self.nodes[i].next;
        }
        if prev != self.tail {
            return Err(format!(
                "candidate list ends at #{prev}, tail #{}",
                self.tail
            ));
        }
        let flagged = self.nodes.iter().filter(|n| n.listed).count();
        if count != self.listed_len || flagged != count {
            return Err(format!(
                "{count} linked candidates, {flagged} flagged, count {}",
                self.listed_len
            ));
        }
        if let Some(&(_, _, b)) = self
            .overflow
            .iter()
            .find(|r| self.nodes.get(r.2 as usize).is_some_and(|n| n.listed))
        {
            return Err(format!(
                "block #{b} is in the overflow set and flagged listed"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The candidates pop in exactly the order of an ordered set of the same ranks,
    /// whatever the order of insertions and removals.
    #[test]
    fn pops_in_the_full_order() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let n = 64u32;
        let mut c = Candidates::new(n as usize);
        let mut model: BTreeSet<Rank> = BTreeSet::new();
        let mut clock = 0u64;
        for _ in 0..20_000 {
            match rnd(4) {
                0 | 1 => {
                    let b = rnd(u64::from(n)) as u32;
                    if model.iter().any(|r| r.2 == b) {
                        continue;
                    }
                    clock += 1;
                    let key = match rnd(3) {
                        0 => clock,
                        1 => rnd(clock + 1),
                        _ => rnd(4),
                    };
                    let p = rnd(3) as i32 - 1;
                    c.insert(p, key, b);
                    model.insert((p, key, b));
                }
                2 => {
                    let b = rnd(u64::from(n)) as u32;
                    if let Some(&r) = model.iter().find(|r| r.2 == b) {
                        assert!(c.contains(r.0, r.1, r.2));
                        c.remove(r.0, r.1, r.2);
                        model.remove(&r);
                    }
                }
                _ => assert_eq!(c.pop_first(), model.pop_first()),
            }
            assert_eq!(c.len(), model.len());
            c.check().unwrap();
        }
        while let Some(r) = model.pop_first() {
            assert_eq!(c.pop_first(), Some(r));
        }
        assert_eq!(c.pop_first(), None);
    }
}
