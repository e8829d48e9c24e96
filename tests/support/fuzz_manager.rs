//! The manager fuzz harness, shared by `fuzz/fuzz_targets/manager.rs` (coverage-guided)
//! and `tests/cache/fuzz_corpus.rs` (corpus replay and seeded random inputs under `cargo test`).
//!
//! The first input byte picks a configuration, composed with `KvCache::builder`:
//! the eviction policy (LRU or cost-aware), the block hasher (XXH3 or the chain hash),
//! the storage (`HostStorage`, or a `ShardedStorage` of two head shards) and whether
//! swaps run through a `TransferEngine` on a worker thread or directly. The rest decode
//! into actions (admit, prefix admit, append, fork, free, truncate, pin/unpin, evict,
//! defragment, shrink, grow, swap out (completed or aborted), swap in). Every token
//! written gets K/V bytes that
//! are a function of its whole token prefix (as in a real model, so shared prefixes
//! hold identical bytes). After every action the harness checks the manager's
//! invariants and every sequence's bytes on `HostStorage`; a failed call must leave a
//! full snapshot of the manager unchanged.

use std::collections::BTreeMap;
use std::sync::Arc;

use pagedkv::executor::shard::shard_layout;
use pagedkv::executor::shard::ShardedStorage;
use pagedkv::executor::tier::TransferEngine;
use pagedkv::ids::PinId;
use pagedkv::layout::Slot;
use pagedkv::manager::{DefragOptions, SwapJob, TierConfig};
use pagedkv::pool::prefix::Xxh3Hasher;
use pagedkv::pool::prefix::{AdmitOptions, ChainHasher, CostAwarePolicy, LruPolicy};
use pagedkv::{
    CacheConfig, CopyPlan, DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId, Storage,
};
use parking_lot::Mutex;

const BLOCK: usize = 4;
const START_BLOCKS: usize = 48;
const MAX_BLOCKS: usize = 96;
const HEAD_DIM: usize = 2;
const KV_HEADS: usize = 2;
const HOST_BLOCKS: usize = 32;
const TOKEN_BYTES: usize = 4 * HEAD_DIM * KV_HEADS;

fn chain(prev: u64, token: u32) -> u64 {
    let mut z = prev.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(token);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 31)
}

fn kv_bytes(hash: u64) -> [u8; TOKEN_BYTES] {
    let mut b = [0u8; TOKEN_BYTES];
    b[..8].copy_from_slice(&hash.to_le_bytes());
    b[8..].copy_from_slice(&hash.rotate_left(29).to_le_bytes());
    b
}

struct Seq {
    tokens: Vec<u32>,
    /// Admitted with token ids (prefix cache) or plainly.
    cached_kind: bool,
}

/// Reads actions from fuzzer bytes.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
}

struct Harness<S: Storage + Send + 'static> {
    kv: KvCache,
    /// Shared with the transfer engine's worker when there is one.
    store: Arc<Mutex<S>>,
    engine: Option<TransferEngine<S>>,
    seqs: BTreeMap<SeqId, Seq>,
    /// Swapped out to the host tier (their bytes are checked again after swap-in).
    swapped: BTreeMap<SeqId, Seq>,
    pins: Vec<PinId>,
    next_seq: u64,
    next_unique: u32,
    slots: Vec<Slot>,
    copies: CopyPlan,
    prompts: [Vec<u32>; 3],
}

fn snapshot(kv: &KvCache) -> String {
    let mut ids: Vec<_> = kv.sequence_ids().collect();
    ids.sort();
    let tables: Vec<_> = ids
        .iter()
        .map(|&s| (s, kv.block_table(s).map(<[_]>::to_vec), kv.num_tokens(s)))
        .collect();
    format!(
        "{:?} {:?} {:?} {:?}",
        kv.stats(),
        tables,
        kv.prefix_stats().registered_blocks,
        kv.fragmentation()
    )
}

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: KV_HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, BLOCK).expect("layout")
}

impl<S: Storage + Send + 'static> Harness<S> {
    /// A harness over `store`, with the configuration bits of `config`.
    fn new(store: S, config: u8) -> Self {
        let cfg = CacheConfig {
            watermark_blocks: 1,
            max_num_blocks: MAX_BLOCKS,
            ..CacheConfig::new(START_BLOCKS)
        };
        let mut builder = KvCache::builder(layout()).config(cfg).tiers(TierConfig {
            num_host_blocks: HOST_BLOCKS,
            num_disk_slots: 0,
        });
        builder = if config & 1 != 0 {
            builder.eviction_policy(Box::new(CostAwarePolicy::default()))
        } else {
            builder.eviction_policy(Box::new(LruPolicy))
        };
        builder = if config & 2 != 0 {
            builder.hasher(Box::new(ChainHasher))
        } else {
            builder.hasher(Box::new(Xxh3Hasher))
        };
        let store = Arc::new(Mutex::new(store));
        let engine = (config & 4 != 0).then(|| TransferEngine::with_shared(Arc::clone(&store)));
        Harness {
            kv: builder.build().expect("manager"),
            store,
            engine,
            seqs: BTreeMap::new(),
            swapped: BTreeMap::new(),
            pins: Vec::new(),
            next_seq: 0,
            next_unique: 1_000_000,
            slots: Vec::new(),
            copies: CopyPlan::new(),
            prompts: [
                (0..13).collect(),
                (0..6).chain(100..110).collect(),
                (200..209).collect(),
            ],
        }
    }

    fn pick(&self, b: u8) -> Option<SeqId> {
        let n = self.seqs.len();
        (n > 0).then(|| *self.seqs.keys().nth(b as usize % n).expect("in range"))
    }

    /// Writes the K/V of tokens `from..` of `seq` into the slots just handed out.
    fn write(&mut self, seq: SeqId, from: usize) {
        let tokens = &self.seqs[&seq].tokens;
        let mut hash = 0;
        let mut bytes = Vec::new();
        for (pos, &t) in tokens.iter().enumerate() {
            hash = chain(hash, t);
            if pos >= from {
                bytes.extend_from_slice(&kv_bytes(hash));
            }
        }
        assert_eq!(
            bytes.len(),
            self.slots.len() * TOKEN_BYTES,
            "{seq}: slots for tokens {from}.."
        );
        self.store
            .lock()
            .write_slots(0, &self.slots, &bytes, &bytes)
            .expect("write_slots");
    }

    fn step(&mut self, input: &mut Input<'_>) -> Option<()> {
        let op = input.byte()? % 14;
        let (a, b) = (input.byte()?, input.byte()?);
        let before = snapshot(&self.kv);
        let ok = match op {
            0 => {
                let seq = SeqId(self.next_seq);
                self.next_seq += 1;
                let n = a as usize % 40;
                let tokens: Vec<u32> = (0..n as u32).map(|i| self.next_unique + i).collect();
                self.next_unique += n as u32;
                let r = self.kv.admit(seq, n, &mut self.slots);
                if r.is_ok() {
                    self.seqs.insert(
                        seq,
                        Seq {
                            tokens,
                            cached_kind: false,
                        },
                    );
                    self.write(seq, 0);
                }
                r.is_ok()
            }
            1 => {
                let seq = SeqId(self.next_seq);
                self.next_seq += 1;
                let mut tokens = self.prompts[a as usize % 3].clone();
                tokens.extend((0..(b as u32 % 9)).map(|i| i * 7));
                let salt: &[u8] = if b & 0x80 != 0 { b"tenant-b" } else { b"" };
                let opts = AdmitOptions {
                    cache_salt: salt,
                    retention_priority: i32::from(a & 3),
                    ..AdmitOptions::default()
                };
                match self.kv.admit_tokens(seq, &tokens, &opts, &mut self.slots) {
                    Ok(adm) => {
                        self.seqs.insert(
                            seq,
                            Seq {
                                tokens,
                                cached_kind: true,
                            },
                        );
                        self.write(seq, adm.cached_tokens);
                        true
                    }
                    Err(_) => false,
                }
            }
            2 => {
                let seq = self.pick(a)?;
                let n = 1 + b as usize % 6;
                let s = &self.seqs[&seq];
                let new: Vec<u32> = (0..n as u32)
                    .map(|i| (s.tokens.len() as u32 + i) * 3 + u32::from(b))
                    .collect();
                self.copies.clear();
                let r = if s.cached_kind {
                    self.kv
                        .append_tokens(seq, &new, &mut self.slots, &mut self.copies)
                } else {
                    self.kv.append(seq, n, &mut self.slots, &mut self.copies)
                };
                if r.is_ok() {
                    self.store
                        .lock()
                        .copy_blocks(&self.copies)
                        .expect("copy plan");
                    let from = self.seqs[&seq].tokens.len();
                    self.seqs.get_mut(&seq)?.tokens.extend(new);
                    self.write(seq, from);
                } else {
                    assert!(self.copies.is_empty(), "a failed append emitted copies");
                }
                r.is_ok()
            }
            3 => {
                let parent = self.pick(a)?;
                let child = SeqId(self.next_seq);
                self.next_seq += 1;
                self.kv
                    .fork(parent, child)
                    .expect("fork of a live sequence");
                let s = &self.seqs[&parent];
                let copy = Seq {
                    tokens: s.tokens.clone(),
                    cached_kind: s.cached_kind,
                };
                self.seqs.insert(child, copy);
                true
            }
            4 => {
                let seq = self.pick(a)?;
                self.kv.free(seq).expect("free");
                self.seqs.remove(&seq);
                true
            }
            5 => {
                let seq = self.pick(a)?;
                let len = self.seqs[&seq].tokens.len();
                let new_len = b as usize % (len + 1);
                self.kv.truncate(seq, new_len).expect("truncate");
                self.seqs.get_mut(&seq)?.tokens.truncate(new_len);
                true
            }
            6 => {
                let opts = match a % 3 {
                    0 => DefragOptions::FULL,
                    1 => DefragOptions::incremental(1 + b as usize % 5),
                    _ => DefragOptions::FULL.above(f64::from(b) / 255.0),
                };
                pagedkv::executor::defragment_with(&mut self.kv, &mut *self.store.lock(), opts)
                    .is_ok()
            }
            7 => {
                let target = 2 + a as usize % self.kv.num_blocks();
                pagedkv::executor::shrink_to(&mut self.kv, target, &mut *self.store.lock()).is_ok()
            }
            8 => {
                let target = self.kv.num_blocks() + a as usize % 24;
                pagedkv::executor::grow_to(&mut self.kv, target, &mut *self.store.lock()).is_ok()
            }
            9 => {
                let opts = AdmitOptions::default();
                match self.kv.pin_prefix(&self.prompts[a as usize % 3], &opts) {
                    Ok(p) => {
                        self.pins.push(p.id);
                        true
                    }
                    Err(_) => false,
                }
            }
            10 => {
                if self.pins.is_empty() {
                    return Some(());
                }
                let pin = self.pins.swap_remove(a as usize % self.pins.len());
                self.kv.unpin_prefix(pin).expect("unpin of a held pin");
                assert!(
                    self.kv.unpin_prefix(pin).is_err(),
                    "unpinning twice must fail"
                );
                true
            }
            11 => {
                self.kv.evict_cached(a as usize);
                true
            }
            12 => {
                let seq = self.pick(a)?;
                match self.kv.swap_out(seq) {
                    Ok(job) => {
                        if b % 4 == 0 {
                            // The transfer failed: abort, and the sequence stays resident.
                            self.kv.abort_swap(job.ticket).expect("abort");
                        } else {
                            self.run_swap(&job);
                            self.kv.complete_swap(job.ticket).expect("complete");
                            let s = self.seqs.remove(&seq)?;
                            self.swapped.insert(seq, s);
                        }
                        true
                    }
                    Err(_) => false,
                }
            }
            _ => {
                let n = self.swapped.len();
                if n == 0 {
                    return Some(());
                }
                let seq = *self.swapped.keys().nth(a as usize % n)?;
                match self.kv.swap_in(seq) {
                    Ok(job) => {
                        self.run_swap(&job);
                        self.kv.complete_swap(job.ticket).expect("complete");
                        let s = self.swapped.remove(&seq)?;
                        self.seqs.insert(seq, s);
                        true
                    }
                    Err(_) => false,
                }
            }
        };
        if !ok {
            assert_eq!(
                snapshot(&self.kv),
                before,
                "a failed call (op {op}) changed the manager"
            );
        }
        self.check();
        Some(())
    }

    /// Executes a swap plan, through the transfer engine's worker when there is one.
    fn run_swap(&mut self, job: &SwapJob) {
        match &mut self.engine {
            Some(engine) => {
                engine.submit(job).expect("submit");
                engine.wait(job.ticket).expect("transfer");
            }
            None => self.store.lock().swap(&job.plan).expect("swap plan"),
        }
    }

    fn check(&self) {
        if let Err(e) = self.kv.check_invariants() {
            panic!("invariant broken: {e}");
        }
        let store = self.store.lock();
        assert_eq!(store.num_blocks(), self.kv.num_blocks());
        for (&seq, s) in &self.seqs {
            let n = s.tokens.len();
            assert_eq!(self.kv.num_tokens(seq).ok(), Some(n));
            let (mut k, mut v) = (vec![0u8; n * TOKEN_BYTES], vec![0u8; n * TOKEN_BYTES]);
            let table = self.kv.block_table(seq).expect("table");
            store
                .read_tokens(0, table, n, &mut k, &mut v)
                .expect("read back");
            let mut hash = 0;
            for (pos, &t) in s.tokens.iter().enumerate() {
                hash = chain(hash, t);
                let r = pos * TOKEN_BYTES..(pos + 1) * TOKEN_BYTES;
                assert_eq!(&k[r], &kv_bytes(hash), "{seq} token {pos}: wrong K/V");
            }
        }
    }

    fn finish(mut self) {
        for p in std::mem::take(&mut self.pins) {
            self.kv.unpin_prefix(p).expect("unpin");
        }
        for seq in self
            .seqs
            .keys()
            .chain(self.swapped.keys())
            .copied()
            .collect::<Vec<_>>()
        {
            self.kv.free(seq).expect("free");
        }
        assert_eq!(self.kv.tier_stats().host_used_blocks, 0, "host tier leak");
        self.kv.evict_cached(usize::MAX);
        self.kv
            .check_invariants()
            .expect("invariants after freeing everything");
        let s = self.kv.stats();
        assert_eq!(
            (s.used_blocks, s.cached_blocks, s.free_blocks),
            (0, 0, self.kv.num_blocks()),
            "leak"
        );
    }
}

/// Runs one fuzz input. Panics on any finding.
pub fn run(data: &[u8]) {
    let mut input = Input(data);
    let Some(config) = input.byte() else {
        return;
    };
    if config & 8 != 0 {
        let shard = shard_layout(&layout(), 2).expect("shard layout");
        let shards = (0..2)
            .map(|_| HostStorage::with_host_tier(shard, START_BLOCKS, HOST_BLOCKS).expect("shard"))
            .collect();
        let store = ShardedStorage::new(layout(), shards).expect("sharded storage");
        drive(Harness::new(store, config), input);
    } else {
        let store =
            HostStorage::with_host_tier(layout(), START_BLOCKS, HOST_BLOCKS).expect("storage");
        drive(Harness::new(store, config), input);
    }
}

fn drive<S: Storage + Send + 'static>(mut h: Harness<S>, mut input: Input<'_>) {
    for _ in 0..400 {
        if h.step(&mut input).is_none() {
            break;
        }
    }
    h.finish();
}
