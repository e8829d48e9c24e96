//! Prefix caching: hits, namespaces, per-block keys, collisions, eviction order, pins,
//! priorities, events, resets, bad input, and a model-based property test that checks
//! every sequence's K/V bytes against what an unshared run would hold. The hashers'
//! test vectors are in `tests/io/prefix_hash.rs`.

use std::collections::BTreeMap;

use pagedkv::ids::PinId;
use pagedkv::layout::Slot;
use pagedkv::pool::prefix::{BlockHash, PrefixEvent};
use pagedkv::pool::prefix::{
    ChainHasher, CostAwarePolicy, EvictionPolicy, LruPolicy, Medium, PrefixHasher, PrefixReset,
    Xxh3Hasher,
};
use pagedkv::{
    AdmitOptions, CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape,
    PrefixConfig, SeqId, Storage,
};
use proptest::prelude::*;

const BLOCK: usize = 4;
const HEAD_DIM: usize = 2;
const LAYERS: usize = 2;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: LAYERS,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: HEAD_DIM,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, BLOCK).unwrap()
}

fn cfg(num_blocks: usize) -> CacheConfig {
    CacheConfig {
        num_blocks,
        watermark_blocks: 0,
        max_seq_len_tokens: 0,
        ..CacheConfig::new(0)
    }
}

fn manager(num_blocks: usize) -> KvCache {
    KvCache::new(layout(), cfg(num_blocks)).unwrap()
}

fn manager_with(num_blocks: usize, f: impl FnOnce(&mut PrefixConfig)) -> KvCache {
    let mut p = PrefixConfig::for_arena(num_blocks);
    f(&mut p);
    KvCache::with_prefix_config(layout(), cfg(num_blocks), p).unwrap()
}

const NONE: AdmitOptions<'static> = AdmitOptions {
    extra_key: b"",
    cache_salt: b"",
    retention_priority: 0,
    block_keys: &[],
};

fn toks(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

/// Everything observable about the manager, to prove a failed call changed nothing.
fn snapshot(kv: &KvCache) -> String {
    format!("{kv:?}")
}

/// Hashes every block of every prompt to one of three values: collisions everywhere.
#[derive(Debug, Clone, Copy)]
struct CollidingHasher;

impl PrefixHasher for CollidingHasher {
    fn namespace(&self, _salt: &[u8], _extra: &[u8]) -> BlockHash {
        BlockHash(0)
    }
    fn block(&self, _parent: BlockHash, tokens: &[u32], _extra: &[u8]) -> BlockHash {
        BlockHash(u64::from(tokens.iter().sum::<u32>() % 3))
    }
    fn clone_box(&self) -> Box<dyn PrefixHasher> {
        Box::new(*self)
    }
}

// ---- K/V content: what an unshared run would hold ---------------------------------

/// The value a token's K/V stands for: a hash of its namespace and every token up to
/// and including it, as real K/V depends on the whole prefix.
fn next_value(prev: u64, token: u32) -> u64 {
    let x = (prev ^ u64::from(token)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^ (x >> 29)
}

/// A shadow namespace with a keyed span (an image) at token `pos` keyed `key`: bits
/// 0-7 the namespace, bit 8 set, bits 9-15 the key, bits 16.. the position.
fn with_span(ns: u8, pos: usize, key: u8) -> u64 {
    u64::from(ns) | 1 << 8 | u64::from(key & 0x7f) << 9 | (pos as u64) << 16
}

/// Values of `tokens` in shadow namespace `ns`; from a keyed span's position on, the
/// span's key changes every value (a multimodal input changes the K/V after it, not
/// before).
fn values(ns: u64, tokens: &[u32]) -> Vec<u64> {
    let span = (ns >> 8 & 1 == 1).then_some(((ns >> 16) as usize, ns >> 9 & 0x7f));
    let mut v = (ns & 0xff).wrapping_mul(0xbf58_476d_1ce4_e5b9) | 1;
    tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            if let Some((pos, key)) = span {
                if i == pos {
                    v = next_value(v, 0xdead_0000 | key as u32);
                }
            }
            v = next_value(v, t);
            v
        })
        .collect()
}

fn pattern(value: u64, layer: usize) -> ([u8; 4 * HEAD_DIM], [u8; 4 * HEAD_DIM]) {
    let mut k = [0u8; 4 * HEAD_DIM];
    let mut v = [0u8; 4 * HEAD_DIM];
    let x = value ^ (layer as u64) << 60;
    k.copy_from_slice(&x.to_le_bytes());
    v.copy_from_slice(&(!x).to_le_bytes());
    (k, v)
}

/// Engine side: manager + storage + what each sequence should hold.
struct Engine {
    kv: KvCache,
    store: HostStorage,
    /// Per sequence: namespace id and token ids.
    shadow: BTreeMap<SeqId, (u64, Vec<u32>)>,
    slots: Vec<Slot>,
    copies: CopyPlan,
}

impl Engine {
    fn new(kv: KvCache) -> Self {
        let n = kv.num_blocks();
        Engine {
            kv,
            store: HostStorage::new(layout(), n).unwrap(),
            shadow: BTreeMap::new(),
            slots: Vec::new(),
            copies: CopyPlan::new(),
        }
    }

    /// Writes the K/V of tokens `from..` of `seq` into the slots just handed out.
    fn write(&mut self, seq: SeqId, from: usize) {
        let (ns, tokens) = &self.shadow[&seq];
        let vals = values(*ns, tokens);
        assert_eq!(
            vals.len() - from,
            self.slots.len(),
            "{seq}: slots for {from}.."
        );
        for layer in 0..LAYERS {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for &val in &vals[from..] {
                let (kb, vb) = pattern(val, layer);
                k.extend_from_slice(&kb);
                v.extend_from_slice(&vb);
            }
            self.store.write_slots(layer, &self.slots, &k, &v).unwrap();
        }
    }

    fn admit(
        &mut self,
        seq: SeqId,
        ns: u64,
        tokens: &[u32],
        opts: &AdmitOptions,
    ) -> Result<usize, Error> {
        let a = self.kv.admit_tokens(seq, tokens, opts, &mut self.slots)?;
        assert!(a.cached_tokens % BLOCK == 0);
        assert!(a.cached_tokens < tokens.len().max(1));
        self.shadow.insert(seq, (ns, tokens.to_vec()));
        self.write(seq, a.cached_tokens);
        Ok(a.cached_tokens)
    }

    fn append(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(), Error> {
        self.copies.clear();
        self.kv
            .append_tokens(seq, tokens, &mut self.slots, &mut self.copies)?;
        self.store.copy_blocks(&self.copies).unwrap();
        let from = self.shadow[&seq].1.len();
        self.shadow
            .get_mut(&seq)
            .unwrap()
            .1
            .extend_from_slice(tokens);
        self.write(seq, from);
        Ok(())
    }

    fn free(&mut self, seq: SeqId) {
        self.kv.free(seq).unwrap();
        self.shadow.remove(&seq);
    }

    /// Invariants, exact block accounting, and every sequence's bytes.
    fn check(&self) {
        self.kv.check_invariants().unwrap();
        let s = self.kv.stats();
        let p = self.kv.prefix_stats();
        assert_eq!(
            s.used_blocks + s.free_blocks + s.cached_blocks,
            s.num_blocks
        );
        assert!(p.evictable_blocks <= s.cached_blocks);
        assert_eq!(
            self.kv.num_available_blocks(),
            s.free_blocks + p.evictable_blocks
        );
        assert!(self.kv.num_available_blocks() <= s.num_blocks - s.used_blocks);
        for (&seq, (ns, tokens)) in &self.shadow {
            let vals = values(*ns, tokens);
            assert_eq!(self.kv.num_tokens(seq).unwrap(), tokens.len());
            let table = self.kv.block_table(seq).unwrap();
            for layer in 0..LAYERS {
                let n = tokens.len() * 4 * HEAD_DIM;
                let (mut k, mut v) = (vec![0u8; n], vec![0u8; n]);
                self.store
                    .read_tokens(layer, table, tokens.len(), &mut k, &mut v)
                    .unwrap();
                for (t, &val) in vals.iter().enumerate() {
                    let (kb, vb) = pattern(val, layer);
                    let r = t * 4 * HEAD_DIM..(t + 1) * 4 * HEAD_DIM;
                    assert_eq!(&k[r.clone()], &kb, "{seq} token {t} K, layer {layer}");
                    assert_eq!(&v[r], &vb, "{seq} token {t} V, layer {layer}");
                }
            }
        }
    }
}

#[test]
fn the_manager_stays_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<KvCache>();
}

// ---- hits and misses --------------------------------------------------------------

#[test]
fn a_freed_prompt_is_served_from_the_cache_and_only_the_rest_is_computed() {
    let mut e = Engine::new(manager(16));
    let prompt = toks(0, 10);
    assert_eq!(e.admit(SeqId(1), 0, &prompt, &NONE).unwrap(), 0);
    e.free(SeqId(1));
    let s = e.kv.stats();
    assert_eq!((s.used_blocks, s.cached_blocks), (0, 2));

    let mut longer = prompt.clone();
    longer.extend(toks(100, 5));
    assert_eq!(e.kv.cached_prefix_len(&longer, &NONE).unwrap(), 8);
    assert_eq!(e.admit(SeqId(2), 0, &longer, &NONE).unwrap(), 8);
    assert_eq!(e.slots.len(), 7);
    e.check();
    let p = e.kv.prefix_stats();
    assert_eq!(
        (p.queries, p.hit_blocks, p.hit_tokens, p.query_tokens),
        (2, 2, 8, 25)
    );

    // A live hit shares (refcount up) rather than revives.
    assert_eq!(e.admit(SeqId(3), 0, &longer, &NONE).unwrap(), 12);
    let t2 = e.kv.block_table(SeqId(2)).unwrap().to_vec();
    let t3 = e.kv.block_table(SeqId(3)).unwrap().to_vec();
    assert_eq!(t2[..3], t3[..3]);
    assert_ne!(
        t2[3], t3[3],
        "the partial last block is not shared through the cache"
    );
    assert_eq!(e.kv.pool().refcount(t2[0]).unwrap(), 2);
    e.check();
}

#[test]
fn a_whole_prompt_hit_still_leaves_its_last_block_to_compute() {
    let mut e = Engine::new(manager(16));
    let prompt = toks(0, 8);
    e.admit(SeqId(1), 0, &prompt, &NONE).unwrap();
    e.free(SeqId(1));
    assert_eq!(e.admit(SeqId(2), 0, &prompt, &NONE).unwrap(), 4);
    assert_eq!(e.slots.len(), 4);
    // The recomputed block duplicates the cached one: not registered twice.
    assert_eq!(e.kv.prefix_stats().duplicate_blocks, 1);
    assert_eq!(e.kv.prefix_stats().registered_blocks, 2);
    e.check();
    // Empty and one-token prompts: nothing can hit.
    assert_eq!(e.admit(SeqId(3), 0, &[], &NONE).unwrap(), 0);
    assert_eq!(e.admit(SeqId(4), 0, &[0], &NONE).unwrap(), 0);
    e.check();
}

#[test]
fn appended_blocks_are_registered_when_they_fill() {
    let mut e = Engine::new(manager(16));
    e.admit(SeqId(1), 0, &toks(0, 6), &NONE).unwrap();
    assert_eq!(e.kv.prefix_stats().registered_blocks, 1);
    e.append(SeqId(1), &[6]).unwrap();
    assert_eq!(e.kv.prefix_stats().registered_blocks, 1);
    e.append(SeqId(1), &[7, 8, 9, 10, 11, 12]).unwrap();
    assert_eq!(e.kv.prefix_stats().registered_blocks, 3);
    e.check();
    // A second turn of the conversation hits the generated blocks too.
    assert_eq!(e.admit(SeqId(2), 0, &toks(0, 14), &NONE).unwrap(), 12);
    e.check();
}

#[test]
fn plain_admit_and_append_never_touch_the_cache() {
    let mut kv = manager(8);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 9, &mut slots).unwrap();
    kv.append(SeqId(1), 4, &mut slots, &mut copies).unwrap();
    kv.free(SeqId(1)).unwrap();
    assert_eq!(kv.stats().cached_blocks, 0);
    assert_eq!(kv.prefix_stats().registered_blocks, 0);
    // A plain append on a tracked sequence stops its registration (ids unknown).
    kv.admit_tokens(SeqId(2), &toks(0, 6), &NONE, &mut slots)
        .unwrap();
    kv.append(SeqId(2), 2, &mut slots, &mut copies).unwrap();
    kv.append_tokens(SeqId(2), &toks(50, 8), &mut slots, &mut copies)
        .unwrap();
    assert_eq!(kv.prefix_stats().registered_blocks, 1);
    kv.check_invariants().unwrap();
}

#[test]
fn forks_share_and_copy_on_write_without_corrupting_the_cache() {
    let mut e = Engine::new(manager(24));
    e.admit(SeqId(1), 0, &toks(0, 6), &NONE).unwrap();
    e.kv.fork(SeqId(1), SeqId(2)).unwrap();
    let content = e.shadow[&SeqId(1)].clone();
    e.shadow.insert(SeqId(2), content);
    e.append(SeqId(1), &[6, 7, 8]).unwrap();
    e.append(SeqId(2), &[6, 9, 7]).unwrap();
    e.check();
    // Both filled their own copy of block 1 with different ids: both registered.
    assert_eq!(e.kv.prefix_stats().registered_blocks, 3);
    e.admit(SeqId(3), 0, &[toks(0, 6), vec![6, 9, 7, 1]].concat(), &NONE)
        .unwrap();
    assert_eq!(e.slots.len(), 2, "hits both blocks of the second branch");
    e.check();
}

#[test]
fn truncating_into_a_registered_block_copies_it_before_writing() {
    let mut e = Engine::new(manager(16));
    e.admit(SeqId(1), 0, &toks(0, 9), &NONE).unwrap();
    e.kv.truncate(SeqId(1), 6).unwrap();
    e.shadow.get_mut(&SeqId(1)).unwrap().1.truncate(6);
    e.check();
    e.append(SeqId(1), &[60, 61]).unwrap();
    assert_eq!(e.copies.len(), 1, "the registered block is immutable");
    e.check();
    e.free(SeqId(1));
    // The original blocks are intact and still hit.
    assert_eq!(e.admit(SeqId(2), 0, &toks(0, 9), &NONE).unwrap(), 8);
    e.check();
}

// ---- never wrong content ----------------------------------------------------------

#[test]
fn namespaces_isolate_tenants_and_extra_keys() {
    let mut e = Engine::new(manager(32));
    let prompt = toks(0, 9);
    e.admit(SeqId(1), 0, &prompt, &NONE).unwrap();
    let tenant = AdmitOptions {
        cache_salt: b"tenant-b",
        ..NONE
    };
    let lora = AdmitOptions {
        extra_key: b"lora-7",
        ..NONE
    };
    let swapped = AdmitOptions {
        cache_salt: b"lora-7",
        ..NONE
    };
    assert_eq!(e.admit(SeqId(2), 1, &prompt, &tenant).unwrap(), 0);
    assert_eq!(e.admit(SeqId(3), 2, &prompt, &lora).unwrap(), 0);
    assert_eq!(e.admit(SeqId(4), 3, &prompt, &swapped).unwrap(), 0);
    assert_eq!(e.admit(SeqId(5), 1, &prompt, &tenant).unwrap(), 8);
    assert_eq!(e.admit(SeqId(6), 2, &prompt, &lora).unwrap(), 8);
    e.check();
}

#[test]
fn colliding_hashes_never_return_another_prompts_kv() {
    let kv = manager_with(32, |p| p.hasher = Box::new(CollidingHasher));
    let mut e = Engine::new(kv);
    // [0,1,2,3] and [3,2,1,0] collide (same sum); so do many others.
    e.admit(SeqId(1), 0, &[0, 1, 2, 3, 9], &NONE).unwrap();
    e.free(SeqId(1));
    assert_eq!(e.admit(SeqId(2), 0, &[3, 2, 1, 0, 9], &NONE).unwrap(), 0);
    assert_eq!(e.kv.prefix_stats().rejected_collisions, 1);
    // Same content under another namespace collides too (seed is constant): rejected.
    let other = AdmitOptions {
        cache_salt: b"x",
        ..NONE
    };
    assert_eq!(e.admit(SeqId(3), 7, &[0, 1, 2, 3, 9], &other).unwrap(), 0);
    // The real owner still hits.
    assert_eq!(e.admit(SeqId(4), 0, &[0, 1, 2, 3, 9], &NONE).unwrap(), 4);
    e.check();
}

// ---- per-block keys ---------------------------------------------------------------

/// An image span keyed `key` starting at token `pos`.
fn image(pos: usize, key: &[u8]) -> [(usize, &[u8]); 1] {
    [(pos, key)]
}

#[test]
fn a_text_prefix_before_an_image_is_shared_with_text_only_requests() {
    let mut e = Engine::new(manager(32));
    let prompt = toks(0, 13); // 3 full blocks + 1; the image starts in block 1
    let (a, b, a_later) = (
        image(6, b"image-a"),
        image(6, b"image-b"),
        image(7, b"image-a"),
    );
    let with = |spans| AdmitOptions {
        block_keys: spans,
        ..NONE
    };
    assert_eq!(
        e.admit(SeqId(1), with_span(0, 6, 0), &prompt, &with(&a))
            .unwrap(),
        0
    );
    // Text only: the block before the image is shared, nothing from the image on.
    assert_eq!(e.admit(SeqId(2), 0, &prompt, &NONE).unwrap(), 4);
    // Another image at the same place: the same.
    assert_eq!(
        e.admit(SeqId(3), with_span(0, 6, 1), &prompt, &with(&b))
            .unwrap(),
        4
    );
    // The same image one token later in the same block: not the same block.
    let later = with_span(0, 7, 0);
    assert_eq!(
        e.admit(SeqId(4), later, &prompt, &with(&a_later)).unwrap(),
        4
    );
    // The same image at the same place: every block (but the last token's).
    assert_eq!(
        e.admit(SeqId(5), with_span(0, 6, 0), &prompt, &with(&a))
            .unwrap(),
        12
    );
    // The text-only chain registered by SeqId(2) still serves text-only requests.
    assert_eq!(e.admit(SeqId(6), 0, &prompt, &NONE).unwrap(), 12);
    e.check();
}

#[test]
fn block_keys_reach_blocks_registered_later() {
    let mut kv = manager_with(16, |p| p.max_pinned_blocks = 8);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    // Chunked prefill: the keyed block 1 is registered by the second commit.
    let img = image(5, b"img");
    let opts = AdmitOptions {
        block_keys: &img,
        ..NONE
    };
    let prompt = toks(0, 14);
    let mut hit = pagedkv::PrefixHit::default();
    kv.lookup_prefix(&prompt, &opts, &mut hit).unwrap();
    kv.admit_prompt(SeqId(1), &prompt, &hit).unwrap();
    kv.reserve(SeqId(1), 6, 0, &mut slots, &mut copies).unwrap();
    assert_eq!(kv.commit(SeqId(1), 6).unwrap(), 1);
    kv.reserve(SeqId(1), 8, 0, &mut slots, &mut copies).unwrap();
    assert_eq!(kv.commit(SeqId(1), 8).unwrap(), 2);
    let longer = toks(0, 15);
    assert_eq!(kv.cached_prefix_len(&longer, &opts).unwrap(), 12);
    assert_eq!(kv.cached_prefix_len(&longer, &NONE).unwrap(), 4);
    let other = image(5, b"imh");
    let other = AdmitOptions {
        block_keys: &other,
        ..NONE
    };
    assert_eq!(kv.cached_prefix_len(&longer, &other).unwrap(), 4);
    // A span past the prompt keys the block that holds it when appends fill it.
    let late = image(17, b"late");
    let late = AdmitOptions {
        block_keys: &late,
        ..NONE
    };
    kv.admit_tokens(SeqId(2), &toks(100, 10), &late, &mut slots)
        .unwrap();
    kv.append_tokens(SeqId(2), &toks(110, 10), &mut slots, &mut copies)
        .unwrap();
    let all = toks(100, 21);
    assert_eq!(kv.cached_prefix_len(&all, &late).unwrap(), 20);
    assert_eq!(kv.cached_prefix_len(&all, &NONE).unwrap(), 16);
    // Forks carry the keys too.
    kv.fork(SeqId(2), SeqId(3)).unwrap();
    kv.append_tokens(SeqId(3), &toks(120, 4), &mut slots, &mut copies)
        .unwrap();
    assert_eq!(kv.cached_prefix_len(&toks(100, 25), &late).unwrap(), 24);
    assert_eq!(kv.cached_prefix_len(&toks(100, 25), &NONE).unwrap(), 16);
    kv.check_invariants().unwrap();
    // Pins take the keys into account.
    assert!(matches!(
        kv.pin_prefix(&toks(100, 20), &NONE),
        Err(Error::PrefixNotCached {
            cached_tokens: 16,
            ..
        })
    ));
    assert_eq!(kv.pin_prefix(&toks(100, 20), &late).unwrap().tokens, 20);
    // A block key is bounded like the other keys.
    let long = [(0usize, &[0u8; 300][..])];
    assert_eq!(
        kv.cached_prefix_len(
            &all,
            &AdmitOptions {
                block_keys: &long,
                ..NONE
            }
        ),
        Err(Error::PrefixKeyTooLong {
            what: "block key",
            len: 300,
            limit: pagedkv::pool::prefix::DEFAULT_MAX_KEY_BYTES,
        })
    );
    kv.check_invariants().unwrap();
}

/// Xxh3Hasher with the extra keys left out: every keyed block collides with the same
/// tokens unkeyed or keyed otherwise.
#[derive(Debug, Clone, Copy)]
struct KeyBlindHasher;

impl PrefixHasher for KeyBlindHasher {
    fn namespace(&self, salt: &[u8], extra: &[u8]) -> BlockHash {
        Xxh3Hasher.namespace(salt, extra)
    }
    fn block(&self, parent: BlockHash, tokens: &[u32], _extra: &[u8]) -> BlockHash {
        Xxh3Hasher.block(parent, tokens, b"")
    }
    fn clone_box(&self) -> Box<dyn PrefixHasher> {
        Box::new(*self)
    }
}

#[test]
fn a_forged_collision_on_a_keyed_block_is_a_miss() {
    let mut e = Engine::new(manager_with(32, |p| p.hasher = Box::new(KeyBlindHasher)));
    let prompt = toks(0, 13);
    let (a, b) = (image(6, b"image-a"), image(6, b"image-b"));
    let (a, b) = (
        AdmitOptions {
            block_keys: &a,
            ..NONE
        },
        AdmitOptions {
            block_keys: &b,
            ..NONE
        },
    );
    e.admit(SeqId(1), with_span(0, 6, 0), &prompt, &a).unwrap();
    // Block 1 hashes equal for every key; the stored key bytes differ: rejected.
    assert_eq!(
        e.admit(SeqId(2), with_span(0, 6, 1), &prompt, &b).unwrap(),
        4
    );
    assert_eq!(e.kv.prefix_stats().rejected_collisions, 1);
    assert_eq!(e.admit(SeqId(3), 0, &prompt, &NONE).unwrap(), 4);
    assert_eq!(e.kv.prefix_stats().rejected_collisions, 2);
    // The owner's key still hits the whole chain.
    assert_eq!(
        e.admit(SeqId(4), with_span(0, 6, 0), &prompt, &a).unwrap(),
        12
    );
    e.check();
}

// ---- a hit admitted with another prompt than it was looked up for ----------------

impl Engine {
    /// Admits `tokens` (shadow namespace `ns`) with `hit`, which the caller looked up,
    /// computes the rest in one chunk (reserve, write, commit) and returns the cached
    /// tokens.
    fn admit_hit(
        &mut self,
        seq: SeqId,
        ns: u64,
        tokens: &[u32],
        hit: &pagedkv::PrefixHit,
    ) -> usize {
        let a = self.kv.admit_prompt(seq, tokens, hit).unwrap();
        let rest = tokens.len() - a.cached_tokens;
        self.copies.clear();
        self.kv
            .reserve(seq, rest, 0, &mut self.slots, &mut self.copies)
            .unwrap();
        self.store.copy_blocks(&self.copies).unwrap();
        self.shadow.insert(seq, (ns, tokens.to_vec()));
        self.write(seq, a.cached_tokens);
        self.kv.commit(seq, rest).unwrap();
        a.cached_tokens
    }
}

/// A hit looked up for prompt A and admitted (`admit_prompt`) with prompt B shares
/// only the leading blocks whose stored token ids B confirms: none when B differs in
/// block 0, the blocks before the first difference otherwise. The hit's blocks are
/// all still registered under the hit's hashes, so only the confirmation of the ids
/// stops B from reading A's K/V (`a_stale_hit_is_checked_at_admission` in
/// `tests/cache/engine_contract.rs` covers hits whose blocks were evicted).
#[test]
fn a_hit_admitted_with_another_prompt_shares_only_what_that_prompt_confirms() {
    let mut e = Engine::new(manager(32));
    let a = toks(0, 13); // 3 full blocks + 1
    e.admit(SeqId(1), 0, &a, &NONE).unwrap();
    let a_blocks = e.kv.block_table(SeqId(1)).unwrap()[..3].to_vec();
    e.free(SeqId(1));
    let mut hit = pagedkv::PrefixHit::default();
    e.kv.lookup_prefix(&a, &NONE, &mut hit).unwrap();
    assert_eq!(hit.cached_tokens(), 12);

    let mut first = a.clone();
    first[1] = 777; // block 0 differs
    let mut later = a.clone();
    later[9] = 777; // only block 2 differs
    assert_eq!(e.admit_hit(SeqId(2), 0, &first, &hit), 0);
    assert_eq!(e.admit_hit(SeqId(3), 0, &later, &hit), 8);
    let t2 = e.kv.block_table(SeqId(2)).unwrap();
    assert!(
        t2.iter().all(|b| !a_blocks.contains(b)),
        "{t2:?} vs {a_blocks:?}"
    );
    let t3 = e.kv.block_table(SeqId(3)).unwrap();
    assert_eq!(&t3[..2], &a_blocks[..2]);
    assert!(!a_blocks.contains(&t3[2]), "{t3:?} vs {a_blocks:?}");
    // Every sequence reads its own K/V, not prompt A's.
    e.check();
    // The hit still serves the prompt it was made for.
    assert_eq!(e.admit_hit(SeqId(4), 0, &a, &hit), 12);
    assert_eq!(&e.kv.block_table(SeqId(4)).unwrap()[..3], &a_blocks[..]);
    e.check();
}

/// Xxh3Hasher with the cache salt and the extra keys left out: the same tokens hash
/// alike in every namespace and under every block key, so only the stored namespace
/// and keys tell them apart.
#[derive(Debug, Clone, Copy)]
struct NamespaceAndKeyBlindHasher;

impl PrefixHasher for NamespaceAndKeyBlindHasher {
    fn namespace(&self, _salt: &[u8], _extra: &[u8]) -> BlockHash {
        Xxh3Hasher.namespace(b"", b"")
    }
    fn block(&self, parent: BlockHash, tokens: &[u32], _extra: &[u8]) -> BlockHash {
        Xxh3Hasher.block(parent, tokens, b"")
    }
    fn clone_box(&self) -> Box<dyn PrefixHasher> {
        Box::new(*self)
    }
}

/// A stale hit whose blocks now hold the same tokens under another namespace or other
/// block keys: looked up with `(ns_a, opts_a)`, then the blocks are evicted and the
/// same physical blocks registered again, under the same hashes (the hasher ignores
/// salt and keys), by the prompt admitted with `(ns_b, opts_b)`. Admitting the stale
/// hit must share only the blocks whose stored namespace and keys are the hit's;
/// returns the cached tokens.
fn stale_hit_under_other_options(
    (ns_a, opts_a): (u64, &AdmitOptions),
    (ns_b, opts_b): (u64, &AdmitOptions),
) -> usize {
    // 4 blocks: the prompt takes the whole arena, so its second admission gets the
    // same blocks back.
    let mut e = Engine::new(manager_with(4, |p| {
        p.hasher = Box::new(NamespaceAndKeyBlindHasher)
    }));
    let prompt = toks(0, 13);
    e.admit(SeqId(1), ns_a, &prompt, opts_a).unwrap();
    let hit_blocks = e.kv.block_table(SeqId(1)).unwrap()[..3].to_vec();
    e.free(SeqId(1));
    let mut hit = pagedkv::PrefixHit::default();
    e.kv.lookup_prefix(&prompt, opts_a, &mut hit).unwrap();
    assert_eq!(hit.cached_tokens(), 12);
    assert_eq!(e.kv.evict_cached(usize::MAX), 3);
    e.admit(SeqId(2), ns_b, &prompt, opts_b).unwrap();
    let table = e.kv.block_table(SeqId(2)).unwrap().to_vec();
    e.free(SeqId(2));
    // The precondition of the test: the stale hit's blocks are registered again, in
    // the same places and under its hashes, by the other prompt.
    assert_eq!(&table[..3], &hit_blocks[..]);
    let mut again = pagedkv::PrefixHit::default();
    e.kv.lookup_prefix(&prompt, opts_b, &mut again).unwrap();
    assert_eq!(again.cached_tokens(), 12);
    let cached = e.admit_hit(SeqId(3), ns_a, &prompt, &hit);
    assert_eq!(
        &e.kv.block_table(SeqId(3)).unwrap()[..cached / BLOCK],
        &table[..cached / BLOCK]
    );
    e.check();
    cached
}

#[test]
fn a_stale_hit_is_confirmed_against_the_namespace_and_block_keys_at_admission() {
    let (salt_a, salt_b) = (
        AdmitOptions {
            cache_salt: b"tenant-a",
            ..NONE
        },
        AdmitOptions {
            cache_salt: b"tenant-b",
            ..NONE
        },
    );
    // Another namespace: block 0 already differs.
    assert_eq!(stale_hit_under_other_options((1, &salt_a), (2, &salt_b)), 0);
    let (a, b) = (image(6, b"image-a"), image(6, b"image-b"));
    let (key_a, key_b) = (
        AdmitOptions {
            block_keys: &a,
            ..NONE
        },
        AdmitOptions {
            block_keys: &b,
            ..NONE
        },
    );
    // Other block keys from block 1 on: only block 0 is shared.
    assert_eq!(
        stale_hit_under_other_options((with_span(0, 6, 0), &key_a), (with_span(0, 6, 1), &key_b)),
        4
    );
    // The same options: the whole hit is served.
    assert_eq!(
        stale_hit_under_other_options((with_span(0, 6, 0), &key_a), (with_span(0, 6, 0), &key_a)),
        12
    );
}

// ---- events and reset -------------------------------------------------------------

#[test]
fn stored_events_carry_tokens_block_size_keys_and_medium() {
    // The hashes are the Python reference's (`tests/io/prefix_hash.rs` has the snippet):
    // ns = namespace(b"tenant"); m0 = block(ns, [0, 1, 2, 3]);
    // m1 = block(m0, [4, 5, 6, 7], span_key(1, b"img")).
    let (m0, m1) = (BlockHash(0x90994d80860b6c66), BlockHash(0x5bbb3a78fef8ec40));
    let mut kv = manager_with(16, |p| p.record_events = true);
    let mut slots = Vec::new();
    let img = image(5, b"img");
    let opts = AdmitOptions {
        cache_salt: b"tenant",
        block_keys: &img,
        ..NONE
    };
    kv.admit_tokens(SeqId(1), &toks(0, 9), &opts, &mut slots)
        .unwrap();
    let table = kv.block_table(SeqId(1)).unwrap().to_vec();
    let mut events = Vec::new();
    kv.drain_prefix_events(&mut events);
    let mut key = 1u32.to_le_bytes().to_vec();
    key.extend_from_slice(&3u32.to_le_bytes());
    key.extend_from_slice(b"img");
    assert_eq!(
        events,
        vec![
            PrefixEvent::BlockStored {
                hash: m0,
                parent: None,
                block: table[0],
                token_ids: vec![0, 1, 2, 3],
                block_size: BLOCK,
                extra_keys: Vec::new(),
                medium: Medium::Device,
                group: None,
            },
            PrefixEvent::BlockStored {
                hash: m1,
                parent: Some(m0),
                block: table[1],
                token_ids: vec![4, 5, 6, 7],
                block_size: BLOCK,
                extra_keys: key,
                medium: Medium::Device,
                group: None,
            },
        ]
    );
    events.clear();
    kv.free(SeqId(1)).unwrap();
    assert_eq!(kv.evict_cached(1), 1);
    kv.drain_prefix_events(&mut events);
    assert_eq!(
        events,
        vec![PrefixEvent::BlockRemoved {
            hash: m1,
            block: table[1],
            medium: Medium::Device,
            group: None,
        }]
    );
}

#[test]
fn reset_drops_cached_blocks_keeps_live_and_pinned_ones_and_tells_the_router() {
    let mut kv = manager_with(16, |p| p.record_events = true);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit_tokens(SeqId(1), &toks(0, 9), &NONE, &mut slots)
        .unwrap(); // 2 full blocks, stays live
    kv.admit_tokens(SeqId(2), &toks(100, 13), &NONE, &mut slots)
        .unwrap(); // 3 full blocks
    kv.admit_tokens(SeqId(3), &toks(200, 8), &NONE, &mut slots)
        .unwrap(); // 2 full blocks, pinned below
    kv.free(SeqId(2)).unwrap();
    kv.free(SeqId(3)).unwrap();
    let pin = kv.pin_prefix(&toks(200, 8), &NONE).unwrap();
    let live = kv.block_table(SeqId(1)).unwrap().to_vec();
    let mut events = Vec::new();
    kv.drain_prefix_events(&mut events);
    events.clear();
    let before = kv.stats();
    assert_eq!(before.cached_blocks, 5);

    let r = kv.reset_prefix_cache().unwrap();
    assert_eq!(
        r,
        PrefixReset {
            evicted_blocks: 3,
            kept_live_blocks: 2,
            kept_pinned_blocks: 2,
        }
    );
    kv.check_invariants().unwrap();
    let after = kv.stats();
    assert_eq!(after.cached_blocks, 2);
    assert_eq!(after.free_blocks, before.free_blocks + 3);
    assert_eq!(after.used_blocks, before.used_blocks);
    assert_eq!(kv.block_table(SeqId(1)).unwrap(), &live[..]);
    assert_eq!(kv.prefix_stats().evictable_blocks, 0);
    assert_eq!(kv.prefix_stats().registered_blocks, 4);
    assert_eq!(kv.cached_prefix_len(&toks(100, 13), &NONE).unwrap(), 0);
    assert_eq!(kv.cached_prefix_len(&toks(0, 9), &NONE).unwrap(), 8);
    assert_eq!(kv.cached_prefix_len(&toks(200, 9), &NONE).unwrap(), 8);

    // One AllCleared, no BlockRemoved, then the kept blocks, parents first.
    kv.drain_prefix_events(&mut events);
    assert_eq!(events[0], PrefixEvent::AllCleared);
    let mut seen = Vec::new();
    for e in &events[1..] {
        let PrefixEvent::BlockStored {
            hash,
            parent,
            block,
            ..
        } = e
        else {
            panic!("unexpected {e:?}");
        };
        if let Some(p) = parent {
            assert!(seen.contains(p), "{block}: parent after child");
        }
        seen.push(*hash);
    }
    assert_eq!(seen.len(), 4);

    // The live sequence keeps registering after the reset.
    assert_eq!(
        kv.prefix_stats().stored_blocks,
        7,
        "re-announcing is not storing"
    );
    kv.append_tokens(SeqId(1), &toks(9, 3), &mut slots, &mut copies)
        .unwrap();
    assert_eq!(kv.cached_prefix_len(&toks(0, 13), &NONE).unwrap(), 12);
    kv.unpin_prefix(pin.id).unwrap();
    let r = kv.reset_prefix_cache().unwrap();
    assert_eq!(
        (r.evicted_blocks, r.kept_live_blocks, r.kept_pinned_blocks),
        (2, 3, 0)
    );
    kv.free(SeqId(1)).unwrap();
    assert_eq!(kv.reset_prefix_cache().unwrap().evicted_blocks, 3);
    assert_eq!(kv.stats().free_blocks, 16);
    assert_eq!(kv.prefix_stats().registered_blocks, 0);
    kv.check_invariants().unwrap();
    // Nothing cached: a reset is a no-op but still announced.
    events.clear();
    kv.drain_prefix_events(&mut events);
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == PrefixEvent::AllCleared)
            .count(),
        2
    );
    assert_eq!(kv.reset_prefix_cache().unwrap(), PrefixReset::default());
}

// ---- eviction ---------------------------------------------------------------------

#[test]
fn eviction_is_lru_leaves_first_and_never_cuts_a_chain() {
    let mut kv = manager_with(6, |p| p.record_events = true);
    let mut slots = Vec::new();
    kv.admit_tokens(SeqId(1), &toks(0, 13), &NONE, &mut slots)
        .unwrap(); // 3 full + 1
    kv.admit_tokens(SeqId(2), &toks(100, 8), &NONE, &mut slots)
        .unwrap(); // 2 full
    let a = kv.block_table(SeqId(1)).unwrap().to_vec();
    let b = kv.block_table(SeqId(2)).unwrap().to_vec();
    kv.free(SeqId(1)).unwrap(); // older
    kv.free(SeqId(2)).unwrap();
    assert_eq!(kv.stats().cached_blocks, 5);
    assert_eq!(kv.stats().free_blocks, 1);
    let mut events = Vec::new();
    kv.drain_prefix_events(&mut events);
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, PrefixEvent::BlockStored { .. }))
            .count(),
        5
    );
    events.clear();
    // Need 4 blocks: 1 free, then 3 evictions from the older chain, tail first.
    kv.admit(SeqId(3), 16, &mut slots).unwrap();
    kv.drain_prefix_events(&mut events);
    let removed: Vec<_> = events
        .iter()
        .map(|e| match e {
            PrefixEvent::BlockRemoved { block, .. } => *block,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(removed, vec![a[2], a[1], a[0]]);
    assert_eq!(kv.prefix_stats().evicted_blocks, 3);
    kv.check_invariants().unwrap();
    // The younger chain is whole and still hits.
    assert_eq!(kv.cached_prefix_len(&toks(100, 9), &NONE).unwrap(), 8);
    // Evicting one more takes its tail; the head alone still hits.
    assert_eq!(kv.evict_cached(1), 1);
    assert_eq!(
        kv.pool().state(b[0]).unwrap(),
        pagedkv::pool::BlockState::Cached
    );
    assert_eq!(kv.cached_prefix_len(&toks(100, 9), &NONE).unwrap(), 4);
    kv.check_invariants().unwrap();
}

#[test]
fn cached_blocks_count_as_available_exactly_once() {
    let mut kv = manager(8);
    let mut slots = Vec::new();
    kv.admit_tokens(SeqId(1), &toks(0, 16), &NONE, &mut slots)
        .unwrap();
    kv.free(SeqId(1)).unwrap();
    let s = kv.stats();
    assert_eq!((s.free_blocks, s.cached_blocks, s.used_blocks), (4, 4, 0));
    assert_eq!(kv.num_available_blocks(), 8);
    kv.admit(SeqId(9), 4, &mut slots).unwrap();
    assert_eq!(kv.num_available_blocks(), 7);
    assert!(kv.can_admit(28));
    assert!(!kv.can_admit(29));
    // A prompt that hits 3 cached blocks needs 4 more plus the 3 it revives: 7.
    let hit = [toks(0, 12), toks(200, 16)].concat();
    assert!(kv.can_admit_tokens(&hit, &NONE));
    let too_big = [toks(0, 12), toks(200, 17)].concat();
    assert!(!kv.can_admit_tokens(&too_big, &NONE));
    let before = snapshot(&kv);
    assert!(matches!(
        kv.admit_tokens(SeqId(2), &too_big, &NONE, &mut slots),
        Err(Error::OutOfBlocks { needed: 8, free: 7 })
    ));
    assert_eq!(snapshot(&kv), before);
    let a = kv.admit_tokens(SeqId(2), &hit, &NONE, &mut slots).unwrap();
    assert_eq!((a.cached_blocks, a.new_blocks), (3, 4));
    assert_eq!(kv.num_available_blocks(), 0);
    kv.check_invariants().unwrap();
}

#[test]
fn low_priority_blocks_go_first() {
    let mut kv = manager(4);
    let mut slots = Vec::new();
    let vip = AdmitOptions {
        retention_priority: 5,
        ..NONE
    };
    kv.admit_tokens(SeqId(1), &toks(0, 4), &vip, &mut slots)
        .unwrap();
    kv.admit_tokens(SeqId(2), &toks(50, 4), &NONE, &mut slots)
        .unwrap();
    kv.free(SeqId(1)).unwrap(); // older, but high priority
    kv.free(SeqId(2)).unwrap();
    kv.admit(SeqId(3), 12, &mut slots).unwrap(); // 2 free + 1 eviction
    assert_eq!(kv.cached_prefix_len(&toks(0, 5), &NONE).unwrap(), 4);
    assert_eq!(kv.cached_prefix_len(&toks(50, 5), &NONE).unwrap(), 0);
    kv.check_invariants().unwrap();
}

#[test]
fn the_cost_aware_policy_keeps_deep_and_hot_prefixes() {
    let policy: Box<dyn EvictionPolicy> = Box::new(CostAwarePolicy::default());
    assert_eq!(policy.name(), "cost-aware");
    let mut kv = manager_with(8, |p| p.policy = policy);
    let mut slots = Vec::new();
    // A hot 2-block prefix, hit three times, freed first.
    for s in 0..4 {
        kv.admit_tokens(SeqId(s), &toks(0, 9), &NONE, &mut slots)
            .unwrap();
        kv.free(SeqId(s)).unwrap();
    }
    // A cold 1-block prompt freed later: LRU would keep it, cost-aware does not.
    kv.admit_tokens(SeqId(10), &toks(50, 4), &NONE, &mut slots)
        .unwrap();
    kv.free(SeqId(10)).unwrap();
    kv.admit(SeqId(11), 24, &mut slots).unwrap(); // 5 free + 1 eviction
    assert_eq!(kv.cached_prefix_len(&toks(0, 9), &NONE).unwrap(), 8);
    assert_eq!(kv.cached_prefix_len(&toks(50, 5), &NONE).unwrap(), 0);
    kv.check_invariants().unwrap();
    // Under LRU the same trace keeps the cold prompt.
    let mut kv = manager_with(8, |p| p.policy = Box::new(LruPolicy));
    for s in 0..4 {
        kv.admit_tokens(SeqId(s), &toks(0, 9), &NONE, &mut slots)
            .unwrap();
        kv.free(SeqId(s)).unwrap();
    }
    kv.admit_tokens(SeqId(10), &toks(50, 4), &NONE, &mut slots)
        .unwrap();
    kv.free(SeqId(10)).unwrap();
    kv.admit(SeqId(11), 24, &mut slots).unwrap();
    assert_eq!(kv.cached_prefix_len(&toks(50, 5), &NONE).unwrap(), 4);
}

// ---- pins -------------------------------------------------------------------------

#[test]
fn a_pinned_prefix_survives_pressure_until_unpinned() {
    let mut kv = manager_with(6, |p| p.max_pinned_blocks = 4);
    let mut slots = Vec::new();
    let system = toks(0, 8);
    kv.admit_tokens(SeqId(1), &system, &NONE, &mut slots)
        .unwrap();
    let pin = kv.pin_prefix(&toks(0, 10), &NONE).unwrap();
    assert_eq!((pin.tokens, pin.blocks), (8, 2));
    kv.free(SeqId(1)).unwrap();
    assert_eq!(
        kv.num_available_blocks(),
        4,
        "pinned cached blocks are not available"
    );
    assert_eq!(kv.prefix_stats().pinned_blocks, 2);
    let before = snapshot(&kv);
    assert!(matches!(
        kv.admit(SeqId(2), 17, &mut slots),
        Err(Error::OutOfBlocks { needed: 5, free: 4 })
    ));
    assert_eq!(snapshot(&kv), before);
    kv.admit(SeqId(2), 16, &mut slots).unwrap();
    assert_eq!(kv.evict_cached(usize::MAX), 0);
    // A pinned cached block revived by a hit stays pinned.
    kv.free(SeqId(2)).unwrap();
    kv.admit_tokens(SeqId(3), &toks(0, 9), &NONE, &mut slots)
        .unwrap();
    kv.free(SeqId(3)).unwrap();
    kv.check_invariants().unwrap();
    kv.unpin_prefix(pin.id).unwrap();
    assert_eq!(kv.num_available_blocks(), 6);
    let before = snapshot(&kv);
    assert_eq!(kv.unpin_prefix(pin.id), Err(Error::UnknownPin(pin.id)));
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();
}

#[test]
fn pinning_is_limited_and_unknown_prefixes_are_errors() {
    let mut kv = manager_with(8, |p| p.max_pinned_blocks = 2);
    let mut slots = Vec::new();
    kv.admit_tokens(SeqId(1), &toks(0, 12), &NONE, &mut slots)
        .unwrap();
    let before = snapshot(&kv);
    assert_eq!(
        kv.pin_prefix(&toks(0, 12), &NONE),
        Err(Error::PinLimit {
            requested: 3,
            pinned: 0,
            limit: 2
        })
    );
    assert_eq!(
        kv.pin_prefix(&toks(1, 8), &NONE),
        Err(Error::PrefixNotCached {
            requested_tokens: 8,
            cached_tokens: 0
        })
    );
    assert_eq!(
        kv.pin_prefix(&[toks(0, 4), toks(90, 4)].concat(), &NONE),
        Err(Error::PrefixNotCached {
            requested_tokens: 8,
            cached_tokens: 4
        })
    );
    assert!(matches!(
        kv.pin_prefix(&toks(0, 3), &NONE),
        Err(Error::PrefixNotCached { .. })
    ));
    let tenant = AdmitOptions {
        cache_salt: b"t",
        ..NONE
    };
    assert!(matches!(
        kv.pin_prefix(&toks(0, 8), &tenant),
        Err(Error::PrefixNotCached { .. })
    ));
    assert_eq!(
        kv.unpin_prefix(PinId(42)),
        Err(Error::UnknownPin(PinId(42)))
    );
    assert_eq!(snapshot(&kv), before);
    // Two pins over the same blocks count the blocks once.
    let p1 = kv.pin_prefix(&toks(0, 8), &NONE).unwrap();
    let p2 = kv.pin_prefix(&toks(0, 4), &NONE).unwrap();
    assert_eq!(kv.prefix_stats().pinned_blocks, 2);
    kv.unpin_prefix(p1.id).unwrap();
    assert_eq!(kv.prefix_stats().pinned_blocks, 1);
    kv.unpin_prefix(p2.id).unwrap();
    kv.check_invariants().unwrap();
    assert!(matches!(
        KvCache::with_prefix_config(layout(), cfg(8), {
            let mut p = PrefixConfig::for_arena(8);
            p.max_pinned_blocks = 9;
            p
        }),
        Err(Error::InvalidConfig {
            field: "max_pinned_blocks",
            ..
        })
    ));
}

// ---- bad input --------------------------------------------------------------------

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let mut kv = manager_with(8, |p| p.max_key_bytes = 4);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit_tokens(SeqId(1), &toks(0, 6), &NONE, &mut slots)
        .unwrap();
    kv.admit(SeqId(5), 4, &mut slots).unwrap();
    let before = snapshot(&kv);
    let long_salt = AdmitOptions {
        cache_salt: b"12345",
        ..NONE
    };
    let long_key = AdmitOptions {
        extra_key: b"123456",
        ..NONE
    };
    assert_eq!(
        kv.admit_tokens(SeqId(2), &toks(0, 6), &long_salt, &mut slots),
        Err(Error::PrefixKeyTooLong {
            what: "cache salt",
            len: 5,
            limit: 4
        })
    );
    assert_eq!(
        kv.pin_prefix(&toks(0, 4), &long_key),
        Err(Error::PrefixKeyTooLong {
            what: "extra key",
            len: 6,
            limit: 4
        })
    );
    assert!(kv.cached_prefix_len(&toks(0, 6), &long_key).is_err());
    assert!(!kv.can_admit_tokens(&toks(0, 6), &long_key));
    assert_eq!(
        kv.admit_tokens(SeqId(1), &toks(0, 6), &NONE, &mut slots),
        Err(Error::DuplicateSequence(SeqId(1)))
    );
    assert_eq!(
        kv.append_tokens(SeqId(9), &[1], &mut slots, &mut copies),
        Err(Error::UnknownSequence(SeqId(9)))
    );
    assert!(matches!(
        kv.admit_tokens(SeqId(3), &toks(0, 33), &NONE, &mut slots),
        Err(Error::TooLong { tokens: 33, .. })
    ));
    assert!(matches!(
        kv.append_tokens(SeqId(1), &toks(0, 27), &mut slots, &mut copies),
        Err(Error::TooLong { .. })
    ));
    assert!(matches!(
        kv.append_tokens(SeqId(1), &toks(0, 26), &mut slots, &mut copies),
        Err(Error::OutOfBlocks { .. })
    ));
    assert!(copies.is_empty());
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();
}

// ---- the model ----------------------------------------------------------------------

const MODEL_BLOCKS: usize = 24;

#[derive(Debug, Clone)]
enum Action {
    /// Prompt = a cut of a base prompt, then extra tokens, in namespace `ns`, with a
    /// keyed span `(position, key)` if any.
    Admit {
        base: usize,
        cut: usize,
        ext: Vec<u32>,
        ns: u8,
        priority: i32,
        span: Option<(usize, u8)>,
    },
    /// `reset_prefix_cache`.
    Reset,
    AdmitPlain(usize),
    Append(usize, Vec<u32>),
    AppendPlain(usize, usize),
    Fork(usize),
    Free(usize),
    Truncate(usize, usize),
    Pin {
        base: usize,
        cut: usize,
        ns: u8,
    },
    Unpin(usize),
    Evict(usize),
}

fn small_tokens(max: usize) -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(0u32..3, 0..max)
}

/// Mostly the default namespace, so that prompts meet often.
fn namespace() -> impl Strategy<Value = u8> {
    prop_oneof![3 => Just(0u8), 1 => 1u8..4]
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (
            any::<usize>(),
            any::<usize>(),
            small_tokens(7),
            namespace(),
            0i32..3,
            prop_oneof![3 => Just(None), 2 => (0usize..24, 0u8..2).prop_map(Some)],
        )
            .prop_map(|(base, cut, ext, ns, priority, span)| Action::Admit {
                base,
                cut,
                ext,
                ns,
                priority,
                span,
            }),
        1 => Just(Action::Reset),
        1 => (0usize..12).prop_map(Action::AdmitPlain),
        4 => (any::<usize>(), proptest::collection::vec(0u32..3, 1..6))
            .prop_map(|(i, t)| Action::Append(i, t)),
        1 => (any::<usize>(), 1usize..4).prop_map(|(i, n)| Action::AppendPlain(i, n)),
        2 => any::<usize>().prop_map(Action::Fork),
        3 => any::<usize>().prop_map(Action::Free),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(i, n)| Action::Truncate(i, n)),
        2 => (any::<usize>(), any::<usize>(), namespace())
            .prop_map(|(base, cut, ns)| Action::Pin { base, cut, ns }),
        1 => any::<usize>().prop_map(Action::Unpin),
        1 => (0usize..4).prop_map(Action::Evict),
    ]
}

fn ns_opts(ns: u8, priority: i32) -> AdmitOptions<'static> {
    let (salt, extra): (&'static [u8], &'static [u8]) = match ns {
        0 => (b"", b""),
        1 => (b"a", b""),
        2 => (b"", b"a"),
        _ => (b"a", b"a"),
    };
    AdmitOptions {
        cache_salt: salt,
        extra_key: extra,
        retention_priority: priority,
        block_keys: &[],
    }
}

/// Key bytes of the model's keyed spans.
const SPAN_KEYS: [&[u8]; 2] = [b"image-0", b"image-1"];

/// The shadow namespace of a sequence admitted without ids: content no other
/// sequence may share.
const PLAIN_NS: u64 = 99;

struct Model {
    e: Engine,
    bases: Vec<Vec<u32>>,
    pins: Vec<PinId>,
    next_seq: u64,
    next_plain: u32,
}

impl Model {
    fn new(kv: KvCache, bases: Vec<Vec<u32>>) -> Self {
        Model {
            e: Engine::new(kv),
            bases,
            pins: Vec::new(),
            next_seq: 0,
            next_plain: 1000,
        }
    }

    fn pick(&self, i: usize) -> Option<SeqId> {
        let n = self.e.shadow.len();
        (n > 0).then(|| *self.e.shadow.keys().nth(i % n).unwrap())
    }

    fn prompt(&self, base: usize, cut: usize) -> Vec<u32> {
        let b = &self.bases[base % self.bases.len()];
        b[..cut % (b.len() + 1)].to_vec()
    }

    fn plain_tokens(&mut self, n: usize) -> Vec<u32> {
        // Ids no cached prompt uses, so plain sequences never look shareable.
        let t = toks(self.next_plain, n);
        self.next_plain += n as u32;
        t
    }

    fn step(&mut self, a: &Action) {
        let before = snapshot(&self.e.kv);
        match a {
            Action::Admit {
                base,
                cut,
                ext,
                ns,
                priority,
                span,
            } => {
                let mut prompt = self.prompt(*base, *cut);
                prompt.extend_from_slice(ext);
                let seq = SeqId(self.next_seq);
                self.next_seq += 1;
                let spans: Vec<(usize, &[u8])> = span
                    .iter()
                    .map(|&(pos, key)| (pos, SPAN_KEYS[usize::from(key)]))
                    .collect();
                let shadow_ns = match *span {
                    Some((pos, key)) => with_span(*ns, pos, key),
                    None => u64::from(*ns),
                };
                let opts = AdmitOptions {
                    block_keys: &spans,
                    ..ns_opts(*ns, *priority)
                };
                let fits = self.e.kv.can_admit_tokens(&prompt, &opts);
                let expect_hit = self.e.kv.cached_prefix_len(&prompt, &opts).unwrap();
                match self.e.admit(seq, shadow_ns, &prompt, &opts) {
                    Ok(hit) => assert_eq!(hit, expect_hit),
                    Err(err) => {
                        assert!(!fits, "{err}");
                        assert!(matches!(err, Error::OutOfBlocks { .. }), "{err}");
                        assert_eq!(snapshot(&self.e.kv), before);
                    }
                }
            }
            Action::AdmitPlain(n) => {
                let seq = SeqId(self.next_seq);
                self.next_seq += 1;
                let tokens = self.plain_tokens(*n);
                match self.e.kv.admit(seq, *n, &mut self.e.slots) {
                    Ok(()) => {
                        // Without a prompt, the ids appended from position 0 are the
                        // sequence's content in the default namespace (they start
                        // tracking); after a prompt without ids, nothing registers.
                        let ns = if *n == 0 { 0 } else { PLAIN_NS };
                        self.e.shadow.insert(seq, (ns, tokens));
                        self.e.write(seq, 0);
                    }
                    Err(err) => {
                        assert!(matches!(err, Error::OutOfBlocks { .. }), "{err}");
                        assert_eq!(snapshot(&self.e.kv), before);
                    }
                }
            }
            Action::Append(i, t) => {
                let Some(seq) = self.pick(*i) else { return };
                if let Err(err) = self.e.append(seq, t) {
                    assert!(matches!(err, Error::OutOfBlocks { .. }), "{err}");
                    assert_eq!(snapshot(&self.e.kv), before);
                }
            }
            Action::AppendPlain(i, n) => {
                let Some(seq) = self.pick(*i) else { return };
                let t = self.plain_tokens(*n);
                self.e.copies.clear();
                match self
                    .e
                    .kv
                    .append(seq, *n, &mut self.e.slots, &mut self.e.copies)
                {
                    Ok(()) => {
                        self.e.store.copy_blocks(&self.e.copies).unwrap();
                        let from = self.e.shadow[&seq].1.len();
                        self.e.shadow.get_mut(&seq).unwrap().1.extend(t);
                        self.e.write(seq, from);
                    }
                    Err(err) => {
                        assert!(matches!(err, Error::OutOfBlocks { .. }), "{err}");
                        assert_eq!(snapshot(&self.e.kv), before);
                    }
                }
            }
            Action::Fork(i) => {
                let Some(parent) = self.pick(*i) else { return };
                let child = SeqId(self.next_seq);
                self.next_seq += 1;
                self.e.kv.fork(parent, child).unwrap();
                let content = self.e.shadow[&parent].clone();
                self.e.shadow.insert(child, content);
            }
            Action::Free(i) => {
                let Some(seq) = self.pick(*i) else { return };
                self.e.free(seq);
                assert_eq!(self.e.kv.free(seq), Err(Error::UnknownSequence(seq)));
            }
            Action::Truncate(i, n) => {
                let Some(seq) = self.pick(*i) else { return };
                let len = self.e.shadow[&seq].1.len();
                let new_len = n % (len + 1);
                self.e.kv.truncate(seq, new_len).unwrap();
                let (ns, tokens) = self.e.shadow.get_mut(&seq).unwrap();
                tokens.truncate(new_len);
                if new_len == 0 && *ns == PLAIN_NS {
                    // Nothing of the plain prompt is left: ids appended from position
                    // 0 are the content in the default namespace, as after
                    // `admit(seq, 0)` (the manager starts tracking them).
                    *ns = 0;
                }
            }
            Action::Pin { base, cut, ns } => {
                let prompt = self.prompt(*base, *cut);
                match self.e.kv.pin_prefix(&prompt, &ns_opts(*ns, 0)) {
                    Ok(p) => self.pins.push(p.id),
                    Err(err) => {
                        assert!(
                            matches!(err, Error::PrefixNotCached { .. } | Error::PinLimit { .. }),
                            "{err}"
                        );
                        assert_eq!(snapshot(&self.e.kv), before);
                    }
                }
            }
            Action::Unpin(i) => {
                if self.pins.is_empty() {
                    return;
                }
                let id = self.pins.remove(i % self.pins.len());
                self.e.kv.unpin_prefix(id).unwrap();
                assert_eq!(self.e.kv.unpin_prefix(id), Err(Error::UnknownPin(id)));
            }
            Action::Evict(n) => {
                let evictable = self.e.kv.prefix_stats().evictable_blocks;
                assert_eq!(self.e.kv.evict_cached(*n), (*n).min(evictable));
            }
            Action::Reset => {
                let (s, p) = (self.e.kv.stats(), self.e.kv.prefix_stats());
                let r = self.e.kv.reset_prefix_cache().unwrap();
                assert_eq!(r.evicted_blocks, p.evictable_blocks);
                assert_eq!(
                    r.kept_live_blocks + r.kept_pinned_blocks,
                    p.registered_blocks - p.evictable_blocks
                );
                let (s2, p2) = (self.e.kv.stats(), self.e.kv.prefix_stats());
                assert_eq!(p2.evictable_blocks, 0);
                assert_eq!(s2.cached_blocks, r.kept_pinned_blocks);
                assert_eq!(s2.free_blocks, s.free_blocks + r.evicted_blocks);
                assert_eq!(s2.used_blocks, s.used_blocks, "live blocks untouched");
            }
        }
        self.e.check();
    }

    /// Everything freed: no block live, every cached block evictable or pinned; then
    /// with the pins released, every block available and evictable to the free list.
    fn finish(&mut self) {
        for seq in self.e.shadow.keys().copied().collect::<Vec<_>>() {
            self.e.free(seq);
        }
        self.e.check();
        let s = self.e.kv.stats();
        let p = self.e.kv.prefix_stats();
        assert_eq!((s.used_blocks, s.live_token_slots), (0, 0), "leak");
        assert_eq!(s.free_blocks + s.cached_blocks, MODEL_BLOCKS);
        assert!(s.cached_blocks - p.evictable_blocks <= p.pinned_blocks);
        for id in std::mem::take(&mut self.pins) {
            self.e.kv.unpin_prefix(id).unwrap();
        }
        assert_eq!(self.e.kv.num_available_blocks(), MODEL_BLOCKS);
        let cached = self.e.kv.stats().cached_blocks;
        assert_eq!(self.e.kv.evict_cached(usize::MAX), cached);
        assert_eq!(self.e.kv.stats().free_blocks, MODEL_BLOCKS);
        assert_eq!(self.e.kv.prefix_stats().registered_blocks, 0);
        self.e.kv.check_invariants().unwrap();
    }
}

fn model_manager(hasher: Box<dyn PrefixHasher>, cost_aware: bool) -> KvCache {
    let mut p = PrefixConfig::for_arena(MODEL_BLOCKS);
    p.hasher = hasher;
    p.max_pinned_blocks = 8;
    p.record_events = true;
    if cost_aware {
        p.policy = Box::new(CostAwarePolicy::default());
    }
    let c = CacheConfig {
        num_blocks: MODEL_BLOCKS,
        watermark_blocks: 2,
        max_seq_len_tokens: 0,
        ..CacheConfig::new(0)
    };
    KvCache::with_prefix_config(layout(), c, p).unwrap()
}

fn bases() -> impl Strategy<Value = Vec<Vec<u32>>> {
    proptest::collection::vec(proptest::collection::vec(0u32..3, 4..24), 1..4)
}

proptest! {
    #![proptest_config(crate::support::proptest_config(96))]

    #[test]
    fn shared_prefixes_hold_exactly_what_unshared_runs_would(
        bases in bases(),
        actions in proptest::collection::vec(action(), 20..100),
        cost_aware in any::<bool>(),
    ) {
        let hasher: Box<dyn PrefixHasher> = if cost_aware { Box::new(ChainHasher) } else { Box::new(Xxh3Hasher) };
        let mut m = Model::new(model_manager(hasher, cost_aware), bases);
        for a in &actions {
            m.step(a);
        }
        m.finish();
    }

    #[test]
    fn colliding_hashers_never_share_wrong_content(
        bases in bases(),
        actions in proptest::collection::vec(action(), 20..100),
    ) {
        let mut m = Model::new(model_manager(Box::new(CollidingHasher), false), bases);
        for a in &actions {
            m.step(a);
        }
        m.finish();
    }
}

#[test]
fn events_follow_the_index() {
    let mut m = Model::new(
        model_manager(Box::new(ChainHasher), false),
        vec![toks(0, 12)],
    );
    let mut resets = 0;
    for i in 0..30 {
        m.step(&Action::Admit {
            base: 0,
            cut: i % 13,
            ext: vec![(i % 3) as u32; i % 6],
            ns: (i % 2) as u8,
            priority: 0,
            span: (i % 4 == 1).then_some((5, (i % 2) as u8)),
        });
        if i % 3 == 2 {
            m.step(&Action::Free(i));
        }
        if i % 10 == 7 {
            m.step(&Action::Reset);
            resets += 1;
        }
    }
    m.finish();
    let mut events = Vec::new();
    m.e.kv.drain_prefix_events(&mut events);
    let mut live = std::collections::HashMap::new();
    let mut cleared = 0;
    for e in &events {
        match e {
            PrefixEvent::BlockStored {
                hash,
                block,
                parent,
                token_ids,
                block_size,
                medium,
                ..
            } => {
                assert_eq!((token_ids.len(), *block_size), (BLOCK, BLOCK));
                assert_eq!(*medium, Medium::Device);
                if let Some(p) = parent {
                    assert!(live.contains_key(p), "parent announced before its child");
                }
                assert!(live.insert(*hash, *block).is_none(), "stored twice");
            }
            PrefixEvent::BlockRemoved { hash, block, .. } => {
                assert_eq!(live.remove(hash), Some(*block));
            }
            PrefixEvent::AllCleared => {
                live.clear();
                cleared += 1;
            }
        }
    }
    assert_eq!(cleared, resets);
    assert!(
        live.is_empty(),
        "everything evicted, every store matched by a removal"
    );
    // The same stream reaches a channel, and a full one drops without blocking.
    let (tx, rx) = crossbeam_channel::bounded(3);
    let mut kv = manager_with(8, |p| p.event_channel = Some(tx));
    let mut slots = Vec::new();
    kv.admit_tokens(SeqId(1), &toks(0, 17), &NONE, &mut slots)
        .unwrap();
    let got: Vec<_> = rx.try_iter().collect();
    assert_eq!(got.len(), 3);
    assert!(matches!(
        got[0],
        PrefixEvent::BlockStored { parent: None, .. }
    ));
    assert_eq!(got[0], got[0].clone());
    assert_eq!(kv.prefix_stats().dropped_events, 1);
    let mut again = Vec::new();
    m.e.kv.drain_prefix_events(&mut again);
    assert!(again.is_empty());
}

// ---- registration goes on: duplicates, swaps, truncations, late ids ----------------

impl Engine {
    /// An engine whose storage and manager have a host tier of `host` blocks.
    fn with_host_tier(num_blocks: usize, host: usize) -> Self {
        let store = HostStorage::with_host_tier(layout(), num_blocks, host).unwrap();
        let kv = KvCache::with_tiers(
            layout(),
            cfg(num_blocks),
            pagedkv::TierConfig::for_storage(&store),
        )
        .unwrap();
        Engine {
            kv,
            store,
            shadow: BTreeMap::new(),
            slots: Vec::new(),
            copies: CopyPlan::new(),
        }
    }

    /// Admits `tokens` for chunked prefill (lookup, admit, one reservation of the
    /// rest) and writes the reserved slots; the caller commits.
    fn reserve_prompt(&mut self, seq: SeqId, tokens: &[u32]) -> usize {
        let mut hit = pagedkv::PrefixHit::default();
        self.kv.lookup_prefix(tokens, &NONE, &mut hit).unwrap();
        let a = self.kv.admit_prompt(seq, tokens, &hit).unwrap();
        let rest = tokens.len() - a.cached_tokens;
        self.copies.clear();
        self.kv
            .reserve(seq, rest, 0, &mut self.slots, &mut self.copies)
            .unwrap();
        self.shadow.insert(seq, (0, tokens.to_vec()));
        self.write(seq, a.cached_tokens);
        a.cached_tokens
    }

    /// Swaps `seq` out and back in, running both plans on the storage.
    fn swap_out_and_in(&mut self, seq: SeqId, evict_between: bool) {
        let job = self.kv.swap_out(seq).unwrap();
        self.store.swap(&job.plan).unwrap();
        self.kv.complete_swap(job.ticket).unwrap();
        if evict_between {
            self.kv.evict_cached(usize::MAX);
        }
        let job = self.kv.swap_in(seq).unwrap();
        self.store.swap(&job.plan).unwrap();
        self.kv.complete_swap(job.ticket).unwrap();
    }
}

/// Two requests with one system prompt, prefilled in the same step: the second one's
/// system blocks duplicate the first's. It shares the first's copies at commit (giving
/// its own back) and goes on registering, so both conversations hit on their next turn.
#[test]
fn twins_prefilled_together_both_hit_on_their_second_turn() {
    let mut e = Engine::new(manager(32));
    let system = toks(0, 3 * BLOCK);
    let a = [&system[..], &toks(500, 6)[..]].concat();
    let b = [&system[..], &toks(600, 6)[..]].concat();
    assert_eq!(e.reserve_prompt(SeqId(1), &a), 0);
    assert_eq!(e.reserve_prompt(SeqId(2), &b), 0);
    let used = e.kv.stats().used_blocks;
    assert_eq!(e.kv.commit(SeqId(1), a.len()).unwrap(), a.len() / BLOCK);
    // The twin's three system blocks are duplicates; its own full block registers.
    assert_eq!(e.kv.commit(SeqId(2), b.len()).unwrap(), b.len() / BLOCK - 3);
    assert_eq!(e.kv.prefix_stats().duplicate_blocks, 3);
    let (ta, tb) = (
        e.kv.block_table(SeqId(1)).unwrap().to_vec(),
        e.kv.block_table(SeqId(2)).unwrap().to_vec(),
    );
    assert_eq!(ta[..3], tb[..3], "the twin shares the cached copies");
    assert_eq!(e.kv.stats().used_blocks, used - 3);
    assert!(e.kv.is_registering(SeqId(2)).unwrap());
    e.check();
    // A few decode steps each, then the next turn of both conversations.
    for t in 0..5 {
        e.append(SeqId(1), &[700 + t]).unwrap();
        e.append(SeqId(2), &[800 + t]).unwrap();
    }
    e.check();
    let next = |s: &Engine, seq: SeqId| {
        let so_far = &s.shadow[&seq].1;
        let turn = [&so_far[..], &toks(900, 3)[..]].concat();
        (so_far.len() / BLOCK * BLOCK, turn)
    };
    for seq in [SeqId(1), SeqId(2)] {
        let (want, turn) = next(&e, seq);
        assert_eq!(e.kv.cached_prefix_len(&turn, &NONE).unwrap(), want, "{seq}");
    }
    // Still after both let go of their blocks.
    let turns: Vec<_> = [SeqId(1), SeqId(2)].map(|s| next(&e, s)).into();
    e.free(SeqId(1));
    e.free(SeqId(2));
    for (want, turn) in turns {
        assert_eq!(e.kv.cached_prefix_len(&turn, &NONE).unwrap(), want);
    }
    e.check();
}

/// A whole prompt that hits recomputes its last block into a fresh block, which
/// duplicates the cached one: the one-call path registers before the engine writes,
/// so the sequence shares the cached copy at its next call, and goes on registering.
#[test]
fn a_recomputed_last_block_is_shared_at_the_next_step_and_registration_goes_on() {
    let mut e = Engine::new(manager(16));
    let prompt = toks(0, 8);
    e.admit(SeqId(1), 0, &prompt, &NONE).unwrap();
    let cached = e.kv.block_table(SeqId(1)).unwrap().to_vec();
    e.free(SeqId(1));
    assert_eq!(e.admit(SeqId(2), 0, &prompt, &NONE).unwrap(), 4);
    assert_ne!(e.kv.block_table(SeqId(2)).unwrap()[1], cached[1]);
    e.check();
    e.append(SeqId(2), &toks(8, 4)).unwrap();
    assert_eq!(e.kv.block_table(SeqId(2)).unwrap()[..2], cached[..2]);
    assert_eq!(e.kv.prefix_stats().registered_blocks, 3);
    e.check();
    assert_eq!(
        e.kv.cached_prefix_len(&toks(0, 13), &NONE).unwrap(),
        12,
        "the block after the duplicate is registered"
    );
}

/// A defragmentation between the duplicate and its settling moves the cached copy:
/// the sequence still shares the copy at its new place.
#[test]
fn a_pending_twin_follows_its_copy_through_defragmentation() {
    let mut e = Engine::new(manager(16));
    // A filler below the prompt's blocks leaves holes for the copy to move into.
    // (Admitted without ids, so its blocks are freed, not cached.)
    e.kv.admit(SeqId(9), 4 * BLOCK, &mut e.slots).unwrap();
    let prompt = toks(0, 2 * BLOCK);
    e.admit(SeqId(1), 0, &prompt, &NONE).unwrap();
    e.free(SeqId(1));
    e.kv.free(SeqId(9)).unwrap();
    // The whole prompt hits; its last block is recomputed into a fresh block.
    assert_eq!(e.admit(SeqId(2), 0, &prompt, &NONE).unwrap(), BLOCK);
    let plan = pagedkv::executor::defragment_with(
        &mut e.kv,
        &mut e.store,
        pagedkv::manager::DefragOptions::FULL,
    )
    .unwrap();
    assert!(!plan.moves().is_empty());
    e.check();
    e.append(SeqId(2), &toks(2 * BLOCK as u32, 1)).unwrap();
    let s = e.kv.stats();
    assert_eq!(
        (s.used_blocks, s.cached_blocks),
        (3, 0),
        "shares the moved copy and gives its own block back"
    );
    e.check();
}

/// A swapped-in sequence registers again: its fresh copies share the blocks still
/// cached, or become the cached copies when those were evicted meanwhile, and the
/// blocks it decodes afterwards are registered.
#[test]
fn swap_in_then_decode_registers() {
    for evict_between in [false, true] {
        let mut e = Engine::with_host_tier(16, 8);
        e.admit(SeqId(1), 0, &toks(0, 10), &NONE).unwrap();
        e.append(SeqId(1), &toks(10, 2)).unwrap();
        e.swap_out_and_in(SeqId(1), evict_between);
        assert!(e.kv.is_registering(SeqId(1)).unwrap());
        e.check();
        for t in 12..18 {
            e.append(SeqId(1), &[t]).unwrap();
        }
        e.check();
        assert_eq!(
            e.kv.cached_prefix_len(&toks(0, 19), &NONE).unwrap(),
            16,
            "evicted between: {evict_between}"
        );
        e.free(SeqId(1));
        assert_eq!(e.kv.cached_prefix_len(&toks(0, 19), &NONE).unwrap(), 16);
        e.check();
    }
}

/// A truncation keeps the chain up to the new length; the blocks written after it
/// are registered.
#[test]
fn truncation_then_decode_registers() {
    let mut e = Engine::new(manager(16));
    e.admit(SeqId(1), 0, &toks(0, 13), &NONE).unwrap();
    e.kv.truncate(SeqId(1), 6).unwrap();
    e.shadow.get_mut(&SeqId(1)).unwrap().1.truncate(6);
    e.append(SeqId(1), &toks(100, 7)).unwrap();
    e.check();
    let turn = [&toks(0, 6)[..], &toks(100, 7)[..], &[1]].concat();
    assert_eq!(e.kv.cached_prefix_len(&turn, &NONE).unwrap(), 12);
}

/// One rule for ids: a sequence admitted without any starts tracking when the ids of
/// position 0 arrive, whichever call brings them; ids after a gap are refused.
#[test]
fn ids_from_position_zero_start_tracking_in_every_call() {
    let mut e = Engine::new(manager(16));
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    e.kv.admit(SeqId(1), 0, &mut slots).unwrap();
    assert!(!e.kv.is_registering(SeqId(1)).unwrap());
    e.kv.append_tokens(SeqId(1), &toks(0, 5), &mut slots, &mut copies)
        .unwrap();
    assert!(e.kv.is_registering(SeqId(1)).unwrap());
    assert_eq!(e.kv.cached_prefix_len(&toks(0, 6), &NONE).unwrap(), 4);
    e.kv.append(SeqId(1), 3, &mut slots, &mut copies).unwrap();
    assert_eq!(e.kv.add_token_ids(SeqId(1), 5, &toks(5, 3)).unwrap(), 1);
    assert_eq!(e.kv.cached_prefix_len(&toks(0, 9), &NONE).unwrap(), 8);
    // Admitted with a prompt and no ids: appended ids leave a gap and are dropped,
    // and add_token_ids refuses them, changing nothing.
    e.kv.admit(SeqId(2), 3, &mut slots).unwrap();
    e.kv.append_tokens(SeqId(2), &toks(50, 5), &mut slots, &mut copies)
        .unwrap();
    assert!(!e.kv.is_registering(SeqId(2)).unwrap());
    let before = snapshot(&e.kv);
    assert!(matches!(
        e.kv.add_token_ids(SeqId(2), 3, &toks(50, 5)),
        Err(Error::TokenIdsGap { known: 0, .. })
    ));
    assert_eq!(snapshot(&e.kv), before);
    assert_eq!(e.kv.add_token_ids(SeqId(2), 0, &toks(40, 8)).unwrap(), 2);
    e.kv.check_invariants().unwrap();
}

/// The same rule on a sliding-window manager, which registers nothing: append_tokens
/// dropped the ids of position 0 while add_token_ids started tracking them and
/// registered a block that the window would give back.
#[test]
fn a_window_manager_tracks_ids_from_no_call() {
    let window = || {
        KvCache::builder(layout())
            .num_blocks(16)
            .watermark_blocks(0)
            .sliding_window(8)
            .build()
            .unwrap()
    };
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    let mut by_append = window();
    by_append.admit(SeqId(1), 0, &mut slots).unwrap();
    by_append
        .append_tokens(SeqId(1), &toks(0, 5), &mut slots, &mut copies)
        .unwrap();
    assert!(!by_append.is_registering(SeqId(1)).unwrap());
    let mut by_add = window();
    by_add.admit(SeqId(1), 0, &mut slots).unwrap();
    by_add.append(SeqId(1), 5, &mut slots, &mut copies).unwrap();
    let before = snapshot(&by_add);
    assert_eq!(by_add.add_token_ids(SeqId(1), 0, &toks(0, 5)), Ok(0));
    assert_eq!(by_add.add_token_ids(SeqId(1), 3, &toks(3, 2)), Ok(0));
    assert_eq!(snapshot(&by_add), before);
    assert!(!by_add.is_registering(SeqId(1)).unwrap());
    assert_eq!(by_add.prefix_stats(), by_append.prefix_stats());
    by_add.check_invariants().unwrap();
}

/// A case `colliding_hashers_never_share_wrong_content` found (kept as proptest
/// printed it): a sequence admitted in a cache-salted namespace whose chain broke on a
/// hash collision (tracking ends), truncated to 0 and given ids from position 0 again,
/// started a new chain in the *default* namespace, so its block (salted content) was
/// later shared with a default-namespace prompt of the same ids. Tracking that ended
/// on a broken chain now never restarts.
#[test]
fn a_chain_broken_by_a_collision_never_restarts_in_the_default_namespace() {
    let bases: Vec<Vec<u32>> = vec![
        vec![0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        vec![0, 0, 1, 2, 0, 0, 0, 0, 0],
    ];
    let actions: Vec<Action> = vec![
        Action::Admit {
            base: 0,
            cut: 2117287430990478704,
            ext: vec![],
            ns: 0,
            priority: 0,
            span: None,
        },
        Action::Append(32445147564729, vec![2, 2, 0, 0]),
        Action::AdmitPlain(3),
        Action::Append(9966603899350939480, vec![2, 2, 2, 1, 0]),
        Action::Fork(9117285766367771878),
        Action::Admit {
            base: 3996713453305752118,
            cut: 2752433230255461778,
            ext: vec![2, 2, 1, 2],
            ns: 0,
            priority: 0,
            span: None,
        },
        Action::Fork(7312194040587682723),
        Action::Admit {
            base: 6347926359971119903,
            cut: 8466269377852314934,
            ext: vec![2, 0, 0, 1],
            ns: 0,
            priority: 1,
            span: None,
        },
        Action::Fork(11653224029853948987),
        Action::Admit {
            base: 17698666323222281085,
            cut: 9355833899565705063,
            ext: vec![2],
            ns: 3,
            priority: 0,
            span: None,
        },
        Action::Admit {
            base: 11341561465758441816,
            cut: 6428680188159529647,
            ext: vec![0, 0, 2, 2],
            ns: 1,
            priority: 0,
            span: None,
        },
        Action::Free(900465787489357539),
        Action::AppendPlain(11553065170518851652, 1),
        Action::Free(17197361469976665614),
        Action::Free(16861268467180930547),
        Action::Admit {
            base: 15824410296192865479,
            cut: 7900548723266382942,
            ext: vec![0, 1, 1, 2, 0],
            ns: 0,
            priority: 1,
            span: Some((10, 1)),
        },
        Action::Append(13273213585181423806, vec![2, 2, 1, 2]),
        Action::Admit {
            base: 1598283752191441734,
            cut: 8770490125754384212,
            ext: vec![2, 0, 1, 1, 2],
            ns: 3,
            priority: 2,
            span: None,
        },
        Action::Truncate(16242472279911404615, 4071503431054062452),
        Action::Free(4898233836855136354),
        Action::Admit {
            base: 15006075950643854097,
            cut: 6285348373008234274,
            ext: vec![],
            ns: 3,
            priority: 0,
            span: None,
        },
        Action::Free(1294546792503556476),
        Action::Free(8955749000401036943),
        Action::Fork(6246254604191552174),
        Action::Admit {
            base: 18249194833960300572,
            cut: 12648296608751172808,
            ext: vec![],
            ns: 2,
            priority: 0,
            span: Some((17, 0)),
        },
        Action::Free(12871528032412086206),
        Action::Free(13898824917674077092),
        Action::Free(16631869677160148719),
        Action::Admit {
            base: 859834258310456041,
            cut: 3780906782523253776,
            ext: vec![1, 1],
            ns: 0,
            priority: 1,
            span: None,
        },
        Action::Admit {
            base: 11492733396514273365,
            cut: 18381416840507673871,
            ext: vec![2, 2, 0, 2, 0, 1],
            ns: 0,
            priority: 1,
            span: None,
        },
        Action::Admit {
            base: 14696907300755489721,
            cut: 3520259828015503451,
            ext: vec![],
            ns: 0,
            priority: 0,
            span: Some((3, 0)),
        },
        Action::Free(13872478840713759808),
        Action::Admit {
            base: 3507425466772580320,
            cut: 2476028767003017243,
            ext: vec![0, 0, 1, 1],
            ns: 0,
            priority: 0,
            span: None,
        },
        Action::Free(3567962693422121757),
        Action::Free(1800991959028145843),
        Action::Admit {
            base: 14502926338564372293,
            cut: 5965915509610851021,
            ext: vec![0, 0, 0, 2, 2],
            ns: 0,
            priority: 1,
            span: Some((3, 1)),
        },
        Action::Fork(16257078413030661106),
        Action::Admit {
            base: 740031246200821045,
            cut: 3068292063414797150,
            ext: vec![0, 2, 1],
            ns: 0,
            priority: 2,
            span: None,
        },
        Action::Free(5912311507285527261),
        Action::Fork(7593786738542226393),
        Action::Evict(2),
        Action::Admit {
            base: 9763929137720974899,
            cut: 12115310628778030935,
            ext: vec![1, 1, 2, 0, 1, 0],
            ns: 0,
            priority: 1,
            span: None,
        },
        Action::Admit {
            base: 12761654720783908666,
            cut: 10769985738561235709,
            ext: vec![2],
            ns: 0,
            priority: 2,
            span: Some((18, 1)),
        },
        Action::Fork(14825877544497703375),
        Action::Append(11978654317590351876, vec![0, 2, 1, 2]),
        Action::Free(13485650170078526538),
        Action::Free(11423760657332738823),
        Action::Free(10883128031968992341),
        Action::Admit {
            base: 8606095214986184504,
            cut: 2280432700056344546,
            ext: vec![2],
            ns: 2,
            priority: 0,
            span: Some((1, 1)),
        },
        Action::Append(3300632931534361905, vec![2, 1, 2, 0]),
        Action::AppendPlain(12228962684396105495, 2),
    ];
    let mut m = Model::new(model_manager(Box::new(CollidingHasher), false), bases);
    for a in &actions {
        m.step(a);
    }
    m.finish();
}
