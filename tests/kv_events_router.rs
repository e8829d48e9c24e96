//! The published stream read by a real consumer: NVIDIA Dynamo's KV router
//! (`dynamo-kv-router` 1.6.1, default features), through its vLLM ZMQ-wire parser
//! (`zmq_wire::decode_event_batch`, `ZmqEventNormalizer`) into its radix-tree indexer.
//! After every step of a cache's life (prompts sharing prefixes, frees, evictions,
//! resets) the overlap the router reports for a set of requests must equal the cache's
//! own `cached_prefix_len`. Feature `router-check` (CI turns it on):
//! `cargo test --features router-check --test kv_events_router`.
#![cfg(feature = "router-check")]

#[path = "support/mod.rs"]
mod support;

use support::kv_events;

use dynamo_kv_router::protocols::{compute_block_hash_for_seq, BlockHashOptions, WorkerWithDpRank};
use dynamo_kv_router::zmq_wire::{
    decode_event_batch, RawKvEvent, ZmqEventFilterReason, ZmqEventNormalizer,
};
use dynamo_kv_router::RadixTree;
use kv_events::{admit, cache, prompt, wait_subscribers, Zmtp, BLOCK};
use pagedkv::events::{ZmqEventPublisher, ZmqPublisherConfig};
use pagedkv::{AdmitOptions, KvCache, SeqId};

const WORKER: u64 = 7;

/// The router's side: a subscriber, the parser and the indexer.
struct Router {
    sub: Zmtp,
    normalizer: ZmqEventNormalizer,
    tree: RadixTree,
    next_seq: u64,
    events: u64,
    removals: u64,
}

impl Router {
    /// Reads batch `seq` off the socket and indexes its events.
    fn take(&mut self, seq: u64) {
        let m = self.sub.recv();
        assert_eq!(m[1], seq.to_be_bytes());
        assert_eq!(seq, self.next_seq, "no gap");
        self.next_seq += 1;
        let batch = decode_event_batch(&m[2]).expect("Dynamo decodes the batch");
        assert_eq!(batch.data_parallel_rank, Some(0));
        let worker = WorkerWithDpRank::new(WORKER, 0);
        for raw in batch.events {
            self.removals += u64::from(matches!(raw, RawKvEvent::BlockRemoved { .. }));
            let placed = self
                .normalizer
                .normalize(raw, self.events, worker)
                .expect("Dynamo keeps every event");
            self.events += 1;
            let event = placed.into_router_event().expect("a local worker's event");
            self.tree
                .apply_event(event)
                .expect("the indexer applies it");
        }
    }

    /// Full blocks of `tokens` the router says the worker holds.
    fn overlap(&self, tokens: &[u32]) -> usize {
        let hashes = compute_block_hash_for_seq(tokens, BLOCK as u32, BlockHashOptions::default());
        let scores = self.tree.find_matches(hashes, false).scores;
        scores
            .get(&WorkerWithDpRank::new(WORKER, 0))
            .map_or(0, |&n| n as usize)
    }
}

/// Seeded SplitMix64, so the walk is the same everywhere.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}

/// A publisher on a loopback port and a router subscribed to it.
fn publisher_and_router() -> (ZmqEventPublisher, Router) {
    let p = ZmqEventPublisher::bind(ZmqPublisherConfig::new("tcp://127.0.0.1:0")).unwrap();
    let mut sub = Zmtp::connect(p.local_addr(), "SUB", 1);
    sub.subscribe(b"", true);
    wait_subscribers(&p, 1);
    let router = Router {
        sub,
        normalizer: ZmqEventNormalizer::new(BLOCK as u32),
        tree: RadixTree::new(),
        next_seq: 0,
        events: 0,
        removals: 0,
    };
    (p, router)
}

/// One of three system prompts of 2, 3 and 5 blocks, then a tail of any length unique
/// to `step`.
fn random_prompt(rng: &mut Rng, step: u64) -> Vec<u32> {
    let family = rng.below(3) as u32;
    let shared = [2, 3, 5][family as usize] * BLOCK;
    let mut tokens = prompt(family, shared + rng.below(3 * BLOCK), shared);
    tokens
        .iter_mut()
        .skip(shared)
        .for_each(|t| *t += step as u32);
    tokens
}

/// Asserts that the router's overlap for each of the last 24 prompts (one token
/// longer, so a fully cached prompt is all hit) is the cache's own `cached` blocks;
/// returns the queries with a hit.
fn check_overlaps(
    router: &Router,
    prompts: &[Vec<u32>],
    step: u64,
    cached: impl Fn(&[u32]) -> usize,
) -> usize {
    let mut hits = 0;
    for (i, tokens) in prompts.iter().enumerate().rev().take(24) {
        let mut query = tokens.clone();
        query.push(u32::MAX - i as u32);
        let own = cached(&query);
        assert_eq!(own % BLOCK, 0);
        assert_eq!(
            router.overlap(&query),
            own / BLOCK,
            "step {step}, prompt {i} of {} tokens",
            tokens.len()
        );
        hits += usize::from(own > 0);
    }
    hits
}

fn publish(p: &mut ZmqEventPublisher, kv: &mut KvCache, router: &mut Router) {
    if let Some(seq) = p.publish_drained(kv).unwrap() {
        router.take(seq);
    }
}

#[test]
fn dynamos_router_reports_the_caches_own_prefix_hits() {
    let (mut p, mut router) = publisher_and_router();
    let mut kv = cache(48);
    let mut rng = Rng(37);
    let mut live: Vec<u64> = Vec::new();
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    let (mut hits, mut resets, mut frees) = (0, 0, 0);
    for step in 0..400u64 {
        match rng.below(10) {
            0..=5 => {
                let tokens = random_prompt(&mut rng, step);
                if kv.can_admit(tokens.len()) {
                    admit(&mut kv, step, &tokens);
                    live.push(step);
                    prompts.push(tokens);
                }
            }
            6..=8 if !live.is_empty() => {
                let seq = live.swap_remove(rng.below(live.len()));
                kv.free(SeqId(seq)).unwrap();
                frees += 1;
            }
            9 if step % 7 == 0 => {
                kv.reset_prefix_cache().unwrap();
                resets += 1;
            }
            _ => {}
        }
        publish(&mut p, &mut kv, &mut router);
        hits += check_overlaps(&router, &prompts, step, |q| {
            kv.cached_prefix_len(q, &AdmitOptions::default()).unwrap()
        });
    }
    // The walk went where it should: hits, frees, evictions and resets all happened.
    println!(
        "{} batches, {} router events ({} removals), {hits} queries with a hit, {frees} frees, \
         {resets} resets",
        router.next_seq, router.events, router.removals
    );
    assert!(hits > 100 && frees > 20 && resets > 0 && router.removals > 10);
    assert!(p.stats().batches_dropped_slow_peer == 0);
}

/// A keyed store's `extra_keys` read by Dynamo's parser: a span whose identifier is in
/// Dynamo's multimodal-hash form (16 hex digits then 48 zeros) becomes that block's
/// multimodal object, the unkeyed blocks have none. A binary identifier with an offset
/// is an item Dynamo 1.6.1 has no type for: it rejects the batch (the limitation the
/// encoder's docs state).
#[test]
fn dynamo_reads_extra_keys_as_block_multimodal_infos() {
    use pagedkv::events::VllmEventEncoder;
    use pagedkv::pool::prefix::{BlockHash, Medium, PrefixEvent};

    let span = |offset: u32, key: &[u8]| {
        let mut v = offset.to_le_bytes().to_vec();
        v.extend_from_slice(&(key.len() as u32).to_le_bytes());
        v.extend_from_slice(key);
        v
    };
    let stored = |hash: u64, parent: Option<u64>, extra_keys: Vec<u8>| PrefixEvent::BlockStored {
        hash: BlockHash(hash),
        parent: parent.map(BlockHash),
        block: pagedkv::BlockId(0),
        token_ids: vec![1; BLOCK],
        block_size: BLOCK,
        extra_keys,
        medium: Medium::Device,
        group: None,
    };
    let mm_hash: u64 = 0x0123_4567_89ab_cdef;
    let id = format!("{mm_hash:016x}{}", "0".repeat(48));
    let events = [
        stored(1, None, Vec::new()),
        stored(2, Some(1), span(3, id.as_bytes())),
        stored(3, Some(2), Vec::new()),
    ];
    let mut out = Vec::new();
    assert_eq!(
        VllmEventEncoder::new()
            .encode_batch(1.0, &events, &mut out)
            .unwrap(),
        1
    );
    let batch = decode_event_batch(&out).expect("Dynamo decodes a keyed batch");
    let [RawKvEvent::BlockStored {
        block_hashes,
        block_mm_infos,
        lora_name,
        ..
    }] = &batch.events[..]
    else {
        panic!("one store: {:?}", batch.events);
    };
    assert_eq!(block_hashes.len(), 3);
    assert_eq!(*lora_name, None);
    let infos = block_mm_infos
        .as_ref()
        .expect("multimodal infos from extra_keys");
    assert_eq!(infos.len(), 3);
    assert!(infos[0].is_none() && infos[2].is_none());
    let objects = &infos[1].as_ref().expect("block 1 is keyed").mm_objects;
    assert_eq!(objects.len(), 1);
    assert_eq!(objects[0].mm_hash, mm_hash);

    let mut binary = Vec::new();
    VllmEventEncoder::new()
        .encode_batch(1.0, &[stored(1, None, span(0, &[0xff, 0x00]))], &mut binary)
        .unwrap();
    assert!(decode_event_batch(&binary).is_err());
}

/// A hybrid cache's stream (a full group and a window group, as a Gemma-like model
/// has): Dynamo learns each group's kind from the `BlockStored` events and indexes the
/// full-attention group, so after every step the overlap it reports equals the full
/// group's own prefix cache (`kv.group(0).cached_prefix_len`); a window group's store
/// is filtered out by Dynamo's normalizer, not indexed as full attention.
#[test]
fn dynamo_indexes_a_hybrid_caches_full_attention_group() {
    use pagedkv::events::VllmEventEncoder;
    use pagedkv::pool::prefix::{BlockHash, Medium, PrefixEvent};
    use pagedkv::{DType, GroupSpec, GroupStep, KvLayout, ModelShape};

    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 1,
        num_kv_heads: 1,
        head_dim: 2,
        kv_dtype: DType::F32,
    };
    let layout = KvLayout::new(shape, BLOCK).unwrap();
    let mut kv = KvCache::hybrid_builder(&[
        GroupSpec::full(layout),
        GroupSpec::window(layout, 2 * BLOCK),
    ])
    .num_blocks(96)
    .watermark_blocks(0)
    .record_events(true)
    .build()
    .unwrap();

    let (mut p, mut router) = publisher_and_router();
    let mut rng = Rng(41);
    let mut step_buf = GroupStep::default();
    let mut live: Vec<u64> = Vec::new();
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    let (mut hits, mut frees) = (0, 0);
    for step in 0..200u64 {
        match rng.below(10) {
            0..=5 => {
                let tokens = random_prompt(&mut rng, step);
                if kv.can_admit(tokens.len()) {
                    kv.admit_tokens_grouped(
                        SeqId(step),
                        &tokens,
                        &AdmitOptions::default(),
                        &mut step_buf,
                    )
                    .unwrap();
                    live.push(step);
                    prompts.push(tokens);
                }
            }
            6..=8 if !live.is_empty() => {
                let seq = live.swap_remove(rng.below(live.len()));
                kv.free(SeqId(seq)).unwrap();
                frees += 1;
            }
            _ => {}
        }
        publish(&mut p, &mut kv, &mut router);
        hits += check_overlaps(&router, &prompts, step, |q| {
            kv.group(0)
                .cached_prefix_len(q, &AdmitOptions::default())
                .unwrap()
        });
    }
    println!(
        "{} batches, {} router events ({} removals), {hits} queries with a hit, {frees} frees",
        router.next_seq, router.events, router.removals
    );
    assert!(hits > 50 && frees > 20 && router.removals > 10);

    // A window group's store, in a fresh normalizer: Dynamo drops it.
    let store = PrefixEvent::BlockStored {
        hash: BlockHash(5),
        parent: None,
        block: pagedkv::BlockId(3),
        token_ids: vec![1; BLOCK],
        block_size: BLOCK,
        extra_keys: Vec::new(),
        medium: Medium::Device,
        group: Some(1),
    };
    let removal = PrefixEvent::BlockRemoved {
        hash: BlockHash(5),
        block: pagedkv::BlockId(3),
        medium: Medium::Device,
        group: Some(1),
    };
    let mut out = Vec::new();
    VllmEventEncoder::new()
        .groups_of(&kv)
        .encode_batch(1.0, &[store, removal], &mut out)
        .unwrap();
    let batch = decode_event_batch(&out).expect("Dynamo decodes the batch");
    let mut normalizer = ZmqEventNormalizer::new(BLOCK as u32);
    let worker = WorkerWithDpRank::new(WORKER, 0);
    let reasons: Vec<_> = batch
        .events
        .into_iter()
        .map(|raw| normalizer.preprocess_with_reason(raw, worker).err())
        .collect();
    // The store names its kind; the removal's group is known from it.
    assert_eq!(
        reasons,
        [
            Some(ZmqEventFilterReason::NonMainAttentionKind),
            Some(ZmqEventFilterReason::NonMainAttentionGroup)
        ]
    );
}
