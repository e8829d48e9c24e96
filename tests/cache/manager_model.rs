//! Model-based property tests: the manager driven by random actions against a plain
//! shadow model, with every token's K/V bytes written to `HostStorage` and checked.

use std::collections::BTreeMap;

use pagedkv::layout::Slot;
use pagedkv::{
    CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape, SeqId, Storage,
};
use proptest::prelude::*;

const BLOCK: usize = 4;
const BLOCKS: usize = 48;
const HEAD_DIM: usize = 2;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: HEAD_DIM,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, BLOCK).unwrap()
}

/// The bytes every token's K (and, negated, V) holds: a value unique to the write.
fn pattern(value: u32, layer: usize) -> ([u8; 4 * HEAD_DIM], [u8; 4 * HEAD_DIM]) {
    let k = (value as f32) + layer as f32 * 0.25;
    let mut kb = [0u8; 4 * HEAD_DIM];
    let mut vb = [0u8; 4 * HEAD_DIM];
    for d in 0..HEAD_DIM {
        kb[d * 4..d * 4 + 4].copy_from_slice(&(k + d as f32 * 0.5).to_le_bytes());
        vb[d * 4..d * 4 + 4].copy_from_slice(&(-k - d as f32 * 0.5).to_le_bytes());
    }
    (kb, vb)
}

#[derive(Debug, Clone)]
enum Action {
    Admit(usize),
    Append(usize, usize),
    Fork(usize),
    Free(usize),
    Truncate(usize, usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (0usize..40).prop_map(Action::Admit),
        5 => (any::<usize>(), 1usize..6).prop_map(|(i, n)| Action::Append(i, n)),
        2 => any::<usize>().prop_map(Action::Fork),
        2 => any::<usize>().prop_map(Action::Free),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(i, n)| Action::Truncate(i, n)),
    ]
}

/// The engine side: manager + storage + the shadow model of what each sequence holds.
struct Harness {
    kv: KvCache,
    store: HostStorage,
    /// Shadow: the value written for each token of each sequence.
    shadow: BTreeMap<SeqId, Vec<u32>>,
    next_seq: u64,
    next_value: u32,
    slots: Vec<Slot>,
    copies: CopyPlan,
}

impl Harness {
    fn new() -> Self {
        let cfg = CacheConfig {
            num_blocks: BLOCKS,
            watermark_blocks: 2,
            max_seq_len_tokens: 0,
            ..CacheConfig::new(0)
        };
        Harness {
            kv: KvCache::new(layout(), cfg).unwrap(),
            store: HostStorage::new(layout(), BLOCKS).unwrap(),
            shadow: BTreeMap::new(),
            next_seq: 0,
            next_value: 1,
            slots: Vec::new(),
            copies: CopyPlan::new(),
        }
    }

    fn pick(&self, i: usize) -> Option<SeqId> {
        let n = self.shadow.len();
        (n > 0).then(|| *self.shadow.keys().nth(i % n).unwrap())
    }

    /// Writes fresh values for the slots just handed out and records them.
    fn write(&mut self, seq: SeqId) {
        let mut values = Vec::new();
        for _ in 0..self.slots.len() {
            values.push(self.next_value);
            self.next_value += 1;
        }
        for layer in 0..2 {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for &val in &values {
                let (kb, vb) = pattern(val, layer);
                k.extend_from_slice(&kb);
                v.extend_from_slice(&vb);
            }
            self.store.write_slots(layer, &self.slots, &k, &v).unwrap();
        }
        self.shadow.get_mut(&seq).unwrap().extend(values);
    }

    fn step(&mut self, a: &Action) {
        let before = self.kv.stats();
        match *a {
            Action::Admit(n) => {
                let seq = SeqId(self.next_seq);
                self.next_seq += 1;
                let fits = self.kv.layout().blocks_for_tokens(n) <= self.kv.num_available_blocks();
                match self.kv.admit(seq, n, &mut self.slots) {
                    Ok(()) => {
                        assert!(fits);
                        self.shadow.insert(seq, Vec::new());
                        self.write(seq);
                    }
                    Err(e) => {
                        assert!(!fits, "admit failed though it fits: {e}");
                        assert!(matches!(e, Error::OutOfBlocks { .. }));
                        assert_eq!(self.kv.stats(), before, "failed admit changed state");
                    }
                }
            }
            Action::Append(i, n) => {
                let Some(seq) = self.pick(i) else { return };
                self.copies.clear();
                match self.kv.append(seq, n, &mut self.slots, &mut self.copies) {
                    Ok(()) => {
                        // Copy-on-write data moves before the new K/V is written.
                        self.store.copy_blocks(&self.copies).unwrap();
                        assert_eq!(self.slots.len(), n);
                        self.write(seq);
                    }
                    Err(e) => {
                        assert!(matches!(e, Error::OutOfBlocks { .. }), "{e}");
                        assert_eq!(self.kv.stats(), before, "failed append changed state");
                        assert!(self.copies.is_empty());
                    }
                }
            }
            Action::Fork(i) => {
                let Some(parent) = self.pick(i) else { return };
                let child = SeqId(self.next_seq);
                self.next_seq += 1;
                self.kv.fork(parent, child).unwrap();
                let content = self.shadow[&parent].clone();
                self.shadow.insert(child, content);
            }
            Action::Free(i) => {
                let Some(seq) = self.pick(i) else { return };
                self.kv.free(seq).unwrap();
                self.shadow.remove(&seq);
                assert_eq!(self.kv.free(seq), Err(Error::UnknownSequence(seq)));
            }
            Action::Truncate(i, n) => {
                let Some(seq) = self.pick(i) else { return };
                let len = self.shadow[&seq].len();
                let new_len = if len == 0 { 0 } else { n % (len + 1) };
                self.kv.truncate(seq, new_len).unwrap();
                self.shadow.get_mut(&seq).unwrap().truncate(new_len);
            }
        }
        self.check();
    }

    /// Invariants, plus every sequence's bytes equal its shadow (CoW isolation).
    fn check(&self) {
        self.kv.check_invariants().unwrap();
        let stats = self.kv.stats();
        assert_eq!(
            stats.used_blocks + stats.free_blocks + stats.cached_blocks,
            BLOCKS
        );
        for (&seq, values) in &self.shadow {
            assert_eq!(self.kv.num_tokens(seq).unwrap(), values.len());
            let table = self.kv.block_table(seq).unwrap();
            for layer in 0..2 {
                let n = values.len() * 4 * HEAD_DIM;
                let (mut k, mut v) = (vec![0u8; n], vec![0u8; n]);
                self.store
                    .read_tokens(layer, table, values.len(), &mut k, &mut v)
                    .unwrap();
                for (t, &val) in values.iter().enumerate() {
                    let (kb, vb) = pattern(val, layer);
                    let r = t * 4 * HEAD_DIM..(t + 1) * 4 * HEAD_DIM;
                    assert_eq!(&k[r.clone()], &kb, "{seq} token {t} K, layer {layer}");
                    assert_eq!(&v[r], &vb, "{seq} token {t} V, layer {layer}");
                }
            }
        }
    }

    fn free_all(&mut self) {
        for seq in self.shadow.keys().copied().collect::<Vec<_>>() {
            self.kv.free(seq).unwrap();
        }
        self.shadow.clear();
        self.kv.check_invariants().unwrap();
        let s = self.kv.stats();
        assert_eq!(
            (s.used_blocks, s.free_blocks, s.live_token_slots),
            (0, BLOCKS, 0),
            "leak"
        );
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(128))]

    #[test]
    fn random_actions_keep_invariants_and_bytes(actions in proptest::collection::vec(action(), 1..80)) {
        let mut h = Harness::new();
        for a in &actions {
            h.step(a);
        }
        h.free_all();
    }
}

#[test]
fn writing_to_a_fork_never_changes_the_parent() {
    let mut h = Harness::new();
    h.step(&Action::Admit(6));
    h.step(&Action::Fork(0));
    for i in 0..10 {
        h.step(&Action::Append(i, 1 + i % 3));
    }
    h.free_all();
}
