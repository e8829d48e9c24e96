//! Several schedulers allocating from one arena: the sharded pool beside one
//! mutex-protected `BlockPool`, at 1, 2, 4 and 8 threads.
//!
//! `cargo bench --bench concurrent`

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv::pool::sharded::ShardedPool;
use pagedkv::pool::BlockPool;

const BLOCKS: usize = 65_536;
/// Each thread allocates this many blocks, then frees them: one scheduler step's churn.
const BURST: usize = 64;

/// Runs `threads` workers for `iters` bursts each; returns the wall time of the slowest.
fn run(threads: usize, iters: u64, work: Arc<dyn Fn(usize) + Send + Sync>) -> Duration {
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (barrier, work) = (barrier.clone(), work.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..iters {
                    work(t);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    start.elapsed()
}

fn scaling(c: &mut Criterion) {
    let mut g = c.benchmark_group("multi_scheduler");
    for threads in [1usize, 2, 4, 8] {
        g.throughput(Throughput::Elements((threads * BURST) as u64));
        let sharded = ShardedPool::new(BLOCKS, threads, 32).unwrap();
        let handles: Arc<Vec<_>> =
            Arc::new((0..threads).map(|t| sharded.handle(t).unwrap()).collect());
        g.bench_with_input(
            BenchmarkId::new("sharded", threads),
            &threads,
            |b, &threads| {
                let handles = handles.clone();
                let work: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |t| {
                    let h = &handles[t];
                    let mut held = [pagedkv::BlockId(0); BURST];
                    for slot in held.iter_mut() {
                        *slot = h.allocate().unwrap();
                    }
                    for b in held {
                        h.free(b).unwrap();
                    }
                });
                b.iter_custom(|iters| run(threads, iters, work.clone()))
            },
        );
        let locked = Arc::new(parking_lot::Mutex::new(BlockPool::new(BLOCKS).unwrap()));
        g.bench_with_input(
            BenchmarkId::new("one_mutex", threads),
            &threads,
            |b, &threads| {
                let locked = locked.clone();
                let work: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |_| {
                    let mut held = [pagedkv::BlockId(0); BURST];
                    for slot in held.iter_mut() {
                        *slot = locked.lock().allocate().unwrap();
                    }
                    for b in held {
                        locked.lock().decref(b).unwrap();
                    }
                });
                b.iter_custom(|iters| run(threads, iters, work.clone()))
            },
        );
    }
    g.finish();
}

criterion_group!(benches, scaling);
criterion_main!(benches);
