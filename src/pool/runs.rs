//! Choosing free blocks so that swap plans merge into few runs.

use super::{BlockPool, BlockState};
use crate::ids::BlockId;

/// Chooses `n` free blocks of `pool` so that swap plans merge into few runs: the first
/// run of `n` consecutive free blocks at or after `cursor` (wrapping), else the first
/// `n` free blocks in ascending id order from `cursor`, so that whatever adjacency
/// exists is kept. Takes nothing; returns fewer than `n` only when fewer are free.
///
/// O(blocks in the pool): it runs once per swap, never per token.
pub(crate) fn pick_free_run(pool: &BlockPool, n: usize, cursor: usize) -> Vec<BlockId> {
    let total = pool.num_blocks();
    if n == 0 || total == 0 {
        return Vec::new();
    }
    let is_free = |i: usize| pool.state(BlockId(i as u32)) == Ok(BlockState::Free);
    let cursor = cursor % total;
    let mut run_start = 0;
    let mut run_len = 0;
    for k in 0..total {
        let i = (cursor + k) % total;
        if i == 0 {
            // Runs do not wrap around the end of the tier.
            run_len = 0;
        }
        if is_free(i) {
            if run_len == 0 {
                run_start = i;
            }
            run_len += 1;
            if run_len == n {
                return (run_start..run_start + n)
                    .map(|b| BlockId(b as u32))
                    .collect();
            }
        } else {
            run_len = 0;
        }
    }
    (cursor..total)
        .chain(0..cursor)
        .filter(|&i| is_free(i))
        .take(n)
        .map(|b| BlockId(b as u32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_a_consecutive_run_when_one_exists() {
        let mut pool = BlockPool::new(10).unwrap();
        for b in [1, 4, 7] {
            pool.take(BlockId(b)).unwrap();
        }
        // Free: 0, 2,3, 5,6, 8,9.
        let ids = |v: Vec<BlockId>| v.into_iter().map(|b| b.0).collect::<Vec<_>>();
        assert_eq!(ids(pick_free_run(&pool, 2, 0)), vec![2, 3]);
        assert_eq!(ids(pick_free_run(&pool, 2, 6)), vec![8, 9]);
        // No run of 3: ascending free ids from the cursor, wrapping.
        assert_eq!(ids(pick_free_run(&pool, 3, 5)), vec![5, 6, 8]);
        assert_eq!(ids(pick_free_run(&pool, 3, 9)), vec![9, 0, 2]);
        assert_eq!(pick_free_run(&pool, 8, 0).len(), 7);
        assert!(pick_free_run(&pool, 0, 0).is_empty());
    }
}
