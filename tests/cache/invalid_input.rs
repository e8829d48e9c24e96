//! Bad input gets a typed error and leaves the state as it was.

use pagedkv::layout::Slot;
use pagedkv::{
    CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelConfig, ModelShape,
    SeqId, Storage,
};

fn shape() -> ModelShape {
    ModelShape {
        num_layers: 2,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 16,
        kv_dtype: DType::BF16,
    }
}

fn manager() -> KvCache {
    let layout = KvLayout::new(shape(), 16).unwrap();
    KvCache::new(
        layout,
        CacheConfig {
            num_blocks: 8,
            watermark_blocks: 1,
            max_seq_len_tokens: 0,
            ..CacheConfig::new(0)
        },
    )
    .unwrap()
}

/// Everything observable about a manager, to compare before and after a failed call.
fn snapshot(kv: &KvCache) -> String {
    let mut ids: Vec<_> = kv.sequence_ids().collect();
    ids.sort();
    let tables: Vec<_> = ids
        .iter()
        .map(|&s| {
            (
                s,
                kv.block_table(s).unwrap().to_vec(),
                kv.num_tokens(s).unwrap(),
            )
        })
        .collect();
    format!(
        "{:?} {:?} {:?}",
        kv.stats(),
        tables,
        kv.pool().free_blocks()
    )
}

#[test]
fn unknown_and_duplicate_sequences() {
    let mut kv = manager();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 20, &mut slots).unwrap();
    let before = snapshot(&kv);
    assert_eq!(
        kv.admit(SeqId(1), 4, &mut slots),
        Err(Error::DuplicateSequence(SeqId(1)))
    );
    assert_eq!(
        kv.append(SeqId(9), 1, &mut slots, &mut copies),
        Err(Error::UnknownSequence(SeqId(9)))
    );
    assert_eq!(
        kv.fork(SeqId(9), SeqId(10)),
        Err(Error::UnknownSequence(SeqId(9)))
    );
    assert_eq!(
        kv.fork(SeqId(1), SeqId(1)),
        Err(Error::DuplicateSequence(SeqId(1)))
    );
    assert_eq!(kv.free(SeqId(9)), Err(Error::UnknownSequence(SeqId(9))));
    assert!(kv.truncate(SeqId(1), 21).is_err());
    assert!(kv.block_table(SeqId(9)).is_err());
    let mut padded = pagedkv::tables::PaddedTables::default();
    assert_eq!(
        kv.fill_padded(&[SeqId(1), SeqId(9)], &mut padded),
        Err(Error::UnknownSequence(SeqId(9)))
    );
    assert_eq!(
        padded,
        pagedkv::tables::PaddedTables::default(),
        "output touched on error"
    );
    assert_eq!(snapshot(&kv), before);
    assert!(copies.is_empty());
    kv.check_invariants().unwrap();
}

#[test]
fn more_tokens_than_the_arena_holds() {
    let mut kv = manager();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    let before = snapshot(&kv);
    assert_eq!(
        kv.admit(SeqId(1), 8 * 16 + 1, &mut slots),
        Err(Error::TooLong {
            tokens: 129,
            limit: 128
        })
    );
    assert_eq!(snapshot(&kv), before);
    kv.admit(SeqId(1), 90, &mut slots).unwrap();
    kv.admit(SeqId(2), 1, &mut slots).unwrap();
    let before = snapshot(&kv);
    // 7 blocks used; 20 tokens need 2 blocks but only 1 is free.
    assert_eq!(
        kv.admit(SeqId(3), 20, &mut slots),
        Err(Error::OutOfBlocks { needed: 2, free: 1 })
    );
    assert_eq!(
        kv.append(SeqId(2), 33, &mut slots, &mut copies),
        Err(Error::OutOfBlocks { needed: 2, free: 1 })
    );
    assert!(
        !kv.can_admit(16),
        "the watermark keeps the last block for running sequences"
    );
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();
}

#[test]
fn invalid_configs() {
    for bs in [0, 4096] {
        assert!(matches!(
            KvLayout::new(shape(), bs),
            Err(Error::InvalidConfig {
                field: "block_size",
                ..
            })
        ));
    }
    let mut bad = shape();
    bad.num_kv_heads = 3;
    assert!(matches!(
        KvLayout::new(bad, 16),
        Err(Error::InvalidConfig {
            field: "num_kv_heads",
            ..
        })
    ));
    bad.num_kv_heads = 0;
    assert!(matches!(
        KvLayout::new(bad, 16),
        Err(Error::InvalidConfig { .. })
    ));
    let layout = KvLayout::new(shape(), 16).unwrap();
    assert!(KvCache::new(layout, CacheConfig::new(0)).is_err());
    let cfg = CacheConfig {
        num_blocks: 4,
        watermark_blocks: 4,
        max_seq_len_tokens: 0,
        ..CacheConfig::new(0)
    };
    assert!(matches!(
        KvCache::new(layout, cfg),
        Err(Error::InvalidConfig {
            field: "watermark_blocks",
            ..
        })
    ));
}

#[test]
fn storage_rejects_out_of_range_blocks_and_short_buffers() {
    let layout = KvLayout::new(shape(), 16).unwrap();
    let mut store = HostStorage::new(layout, 4).unwrap();
    let token_bytes = 2 * 16 * 2;
    let k = vec![1u8; token_bytes];
    let before = store.region(0).to_vec();
    assert!(matches!(
        store.write_slots(
            0,
            &[Slot(3), Slot(4 * 16)],
            &[k.clone(), k.clone()].concat(),
            &[k.clone(), k.clone()].concat()
        ),
        Err(Error::BlockOutOfRange { num_blocks: 4, .. })
    ));
    assert!(matches!(
        store.write_slots(0, &[Slot(3)], &k[1..], &k),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        store.write_slots(2, &[Slot(3)], &k, &k),
        Err(Error::ShapeMismatch { .. })
    ));
    assert_eq!(
        store.region(0),
        &before[..],
        "a failed write wrote something"
    );
    let mut plan = CopyPlan::new();
    plan.push(pagedkv::BlockId(0), pagedkv::BlockId(9));
    assert!(matches!(
        store.copy_blocks(&plan),
        Err(Error::BlockOutOfRange { .. })
    ));
    let mut plan = CopyPlan::new();
    plan.push(pagedkv::BlockId(0), pagedkv::BlockId(1));
    plan.push(pagedkv::BlockId(1), pagedkv::BlockId(2));
    assert!(matches!(
        store.copy_blocks(&plan),
        Err(Error::CorruptBlockTable(_))
    ));
    let (mut ko, mut vo) = (vec![0u8; token_bytes * 17], vec![0u8; token_bytes * 17]);
    assert!(matches!(
        store.read_tokens(0, &[pagedkv::BlockId(0)], 17, &mut ko, &mut vo),
        Err(Error::CorruptBlockTable(_))
    ));
}

#[test]
fn config_json_reading() {
    let c = ModelConfig::from_json_str(pagedkv::plan::config::builtin::LLAMA3_8B).unwrap();
    assert_eq!(
        c.shape,
        ModelShape {
            num_layers: 32,
            num_q_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            kv_dtype: DType::BF16
        }
    );
    // 2 (K,V) * 32 layers * 8 heads * 128 dims * 2 bytes = 128 KiB per token.
    assert_eq!(c.shape.kv_bytes_per_token(), 131_072);
    let q = ModelConfig::from_json_str(pagedkv::plan::config::builtin::QWEN2_5_7B).unwrap();
    assert_eq!(
        (
            q.shape.num_layers,
            q.shape.num_kv_heads,
            q.shape.head_dim,
            q.shape.group_size()
        ),
        (28, 4, 128, 7)
    );
    let layout = KvLayout::new(q.shape, 16).unwrap();
    // 2 * 28 * 4 * 128 * 2 = 57,344 bytes per token; 16 tokens per block.
    assert_eq!(layout.block_bytes(), 57_344 * 16);
    assert_eq!(
        layout.blocks_for_budget(10 << 30),
        (10usize << 30) / (57_344 * 16)
    );

    // head_dim defaults to hidden_size / heads; KV heads default to MHA.
    let mha = ModelConfig::from_json_str(
        r#"{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}"#,
    )
    .unwrap();
    assert_eq!((mha.shape.num_kv_heads, mha.shape.head_dim), (4, 64));

    for (text, needle) in [
        ("not json", "not valid JSON"),
        ("[1]", "not an object"),
        (
            r#"{"num_attention_heads": 4, "hidden_size": 256}"#,
            "num_hidden_layers",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": -1}"#,
            "hidden_size",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 256}"#,
            "not divisible",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3, "hidden_size": 256}"#,
            "num_kv_heads",
        ),
        (
            r#"{"num_hidden_layers": 0, "num_attention_heads": 4, "hidden_size": 256}"#,
            "num_layers",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "int3"}"#,
            "torch_dtype",
        ),
        (
            r#"{"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 256}"#,
            "num_attention_heads",
        ),
    ] {
        match ModelConfig::from_json_str(text) {
            Err(Error::ModelConfig(msg)) => assert!(msg.contains(needle), "{text}: {msg}"),
            other => panic!("{text}: expected a ModelConfig error, got {other:?}"),
        }
    }
    assert!(matches!(
        ModelConfig::from_file("/nonexistent/config.json"),
        Err(Error::Io(_))
    ));
}
