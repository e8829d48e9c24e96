//! The world of the hybrid tier tests (`memory/hybrid_host_cache.rs`,
//! `memory/hybrid_disk_cache.rs`): a hybrid cache of two full groups over one host
//! storage, each group holding its own value for a token, and what they do with it.

use crate::support::kv_bytes::{check_values, write_values};
use crate::support::tiers::{prompt, BS};
use pagedkv::{AdmitOptions, GroupStep, HostStorage, KvCache, SeqId};

/// What group `g` holds for the token with id `t` (the groups hold different layers).
pub fn value(g: usize, t: u32) -> u32 {
    t + g as u32 * 1_000_000
}

/// Four prompts sharing leading blocks, so hits split across the tiers.
pub fn prompts() -> Vec<Vec<u32>> {
    let base = prompt(6 * BS, 0);
    vec![
        base[..3 * BS + 1].to_vec(),
        base[..5 * BS + 2].to_vec(),
        [&base[..2 * BS], &prompt(2 * BS + 1, 900)[..]].concat(),
        prompt(3 * BS + 3, 5000),
    ]
}

/// A world of two full groups: the cache, the storage of its pages and host blocks,
/// and the step the grouped calls fill.
pub trait TwoGroups {
    fn parts(&mut self) -> (&mut KvCache, &mut HostStorage, &mut GroupStep);
    fn cache(&self) -> &KvCache;
    fn storage(&self) -> &HostStorage;

    fn check(&self) {
        self.cache().check_invariants().unwrap();
    }

    /// Admits `p` as `seq` through the prefix caches and writes every uncached token.
    fn compute(&mut self, seq: u64, p: &[u32]) -> usize {
        let (kv, st, step) = self.parts();
        let a = kv
            .admit_tokens_grouped(SeqId(seq), p, &AdmitOptions::default(), step)
            .unwrap();
        for g in 0..2 {
            let values: Vec<u32> = p[a.cached_tokens..].iter().map(|&t| value(g, t)).collect();
            write_values(st, &step.slots[g], &values);
        }
        self.check();
        a.cached_tokens
    }

    /// Reserves and computes `seq`'s prompt from `from` to its end.
    fn compute_rest(&mut self, seq: u64, p: &[u32], from: usize) {
        if from == p.len() {
            return;
        }
        let n = p.len() - from;
        let (kv, st, step) = self.parts();
        if kv.reserve_grouped(SeqId(seq), n, 0, step).is_err() {
            return; // out of pages: the sequence stays computed up to `from`
        }
        for g in 0..2 {
            let values: Vec<u32> = p[from..].iter().map(|&t| value(g, t)).collect();
            write_values(st, &step.slots[g], &values);
        }
        kv.commit(SeqId(seq), n).unwrap();
    }

    /// Every group's first `n` tokens of `seq` hold `p`'s values.
    fn assert_bytes(&self, seq: u64, p: &[u32], n: usize) {
        for g in 0..2 {
            let table = self.cache().group(g).block_table(SeqId(seq)).unwrap();
            let values: Vec<u32> = p[..n].iter().map(|&t| value(g, t)).collect();
            assert_eq!(
                check_values(self.storage(), table, &values),
                Ok(()),
                "group {g}"
            );
        }
    }

    /// Admits `p` as `seq` with `admit_prompt_grouped`: `(cached, loading)` tokens.
    fn admit_prompt(&mut self, seq: u64, p: &[u32]) -> (usize, usize) {
        let (kv, _, _) = self.parts();
        let a = kv
            .admit_prompt_grouped(SeqId(seq), p, &AdmitOptions::default())
            .unwrap();
        self.check();
        (a.cached_tokens, a.loading_tokens)
    }
}
