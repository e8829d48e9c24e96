//! loom model of the sharded pool: two schedulers allocating, freeing across shards
//! and stealing never hand one block to both, never lose one.
//!
//! `RUSTFLAGS="--cfg loom" cargo test --release --test loom_pool`
#![cfg(loom)]

use pagedkv::pool::sharded::ShardedPool;

#[test]
fn two_shards_never_share_or_lose_a_block() {
    loom::model(|| {
        let pool = ShardedPool::new(3, 2, 1).unwrap();
        let (a, b) = (pool.handle(0).unwrap(), pool.handle(1).unwrap());
        let t = loom::thread::spawn(move || {
            let x = b.allocate().ok();
            if let Some(x) = x {
                b.free(x).unwrap();
            }
            b.allocate().ok()
        });
        let mine = [a.allocate().ok(), a.allocate().ok()];
        let theirs = t.join().unwrap();
        let mut got: Vec<_> = mine
            .iter()
            .chain(std::iter::once(&theirs))
            .flatten()
            .copied()
            .collect();
        let n = got.len();
        got.sort();
        got.dedup();
        assert_eq!(got.len(), n, "a block was handed out twice");
        assert_eq!(pool.num_taken(), n);
        pool.check_invariants().unwrap();
    });
}
