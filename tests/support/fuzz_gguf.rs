//! Fuzz harness for the GGUF reader (`GgufFile::parse`, `model_info`, `tensor_data`),
//! shared by `fuzz/fuzz_targets/gguf.rs` and `tests/cache/fuzz_corpus.rs`.
//!
//! Checked: no panic; every tensor's data, when the reader returns it, is exactly
//! `num_bytes` long and lies inside the input at `data_offset + offset`; an accepted
//! model config has a valid shape; the metadata accessors agree with each other.

#![allow(dead_code)] // each test binary uses its own part

use pagedkv::plan::gguf::{GgufFile, GgufValue};
use pagedkv::DType;

/// One input.
pub fn run(data: &[u8]) {
    let Ok(f) = GgufFile::parse(data) else {
        return;
    };
    for (key, value) in &f.metadata {
        assert!(f.get(key).is_some());
        check_value(value, 0);
    }
    for t in &f.tensors {
        let Ok((bytes, info)) = f.tensor_data(data, &t.name) else {
            continue;
        };
        // The first tensor of that name is the one returned.
        assert_eq!(f.tensor(&t.name), Some(info));
        assert_eq!(Some(bytes.len() as u64), info.num_bytes());
        let start = bytes.as_ptr() as usize - data.as_ptr() as usize;
        assert_eq!(start as u64, f.data_offset + info.offset);
    }
    for dtype in [DType::F16, DType::Fp8E4M3] {
        if let Ok(m) = f.model_info(dtype) {
            m.config
                .shape
                .validate()
                .expect("an accepted GGUF config has a valid shape");
            assert_eq!(m.config.shape.kv_dtype, dtype);
        }
    }
}

fn check_value(v: &GgufValue, depth: usize) {
    assert!(
        depth <= pagedkv::plan::gguf::MAX_ARRAY_DEPTH,
        "nesting past the limit"
    );
    if let Some(x) = v.as_u64() {
        // Every integer that reads as u64 reads as the same f64 (within its precision).
        if let Some(f) = v.as_f64() {
            assert_eq!(f, x as f64);
        }
    }
    if let Some(items) = v.as_array() {
        for item in items {
            check_value(item, depth + 1);
        }
    }
}

// ---- seeds ---------------------------------------------------------------------------

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// A metadata value for the writer: its GGUF type code and encoded bytes.
enum Meta<'a> {
    U32(u32),
    U64(u64),
    I32(i32),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(&'a str),
    StrArray(&'a [&'a str]),
    F32Array(&'a [f32]),
    /// An array of arrays of u8.
    Nested(&'a [&'a [u8]]),
}

fn put_meta(b: &mut Vec<u8>, v: &Meta<'_>) {
    match v {
        Meta::U32(x) => {
            b.extend(4u32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Meta::U64(x) => {
            b.extend(10u32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Meta::I32(x) => {
            b.extend(5u32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Meta::F32(x) => {
            b.extend(6u32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Meta::F64(x) => {
            b.extend(12u32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Meta::Bool(x) => {
            b.extend(7u32.to_le_bytes());
            b.push(u8::from(*x));
        }
        Meta::Str(s) => {
            b.extend(8u32.to_le_bytes());
            put_str(b, s);
        }
        Meta::StrArray(items) => {
            b.extend(9u32.to_le_bytes());
            b.extend(8u32.to_le_bytes());
            b.extend((items.len() as u64).to_le_bytes());
            for s in *items {
                put_str(b, s);
            }
        }
        Meta::F32Array(items) => {
            b.extend(9u32.to_le_bytes());
            b.extend(6u32.to_le_bytes());
            b.extend((items.len() as u64).to_le_bytes());
            for x in *items {
                b.extend(x.to_le_bytes());
            }
        }
        Meta::Nested(rows) => {
            b.extend(9u32.to_le_bytes());
            b.extend(9u32.to_le_bytes());
            b.extend((rows.len() as u64).to_le_bytes());
            for row in *rows {
                b.extend(0u32.to_le_bytes());
                b.extend((row.len() as u64).to_le_bytes());
                b.extend(*row);
            }
        }
    }
}

/// A GGUF file: version, metadata, tensors (name, dims, ggml type, data bytes), with
/// the data section aligned to `alignment`.
fn gguf(
    version: u32,
    meta: &[(&str, Meta<'_>)],
    tensors: &[(&str, &[u64], u32, usize)],
    alignment: usize,
) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(version.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        put_str(&mut b, k);
        put_meta(&mut b, v);
    }
    let mut offset = 0u64;
    for (name, dims, ty, bytes) in tensors {
        put_str(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (*bytes as u64).next_multiple_of(alignment as u64);
    }
    while b.len() % alignment != 0 {
        b.push(0);
    }
    for (i, (_, _, _, bytes)) in tensors.iter().enumerate() {
        b.extend((0..*bytes).map(|j| (i * 17 + j) as u8));
        while b.len() % alignment != 0 {
            b.push(0);
        }
    }
    b
}

/// Small valid GGUF files: a llama with GQA, F32/F16/Q8_0/Q4_0 tensors and a
/// vocabulary; a qwen2 with an explicit key length, a 64-byte alignment and an f64
/// theta; a tied-embedding model without `output.weight`; version 2; nested arrays.
pub fn seeds() -> Vec<Vec<u8>> {
    let vocab: &[&str] = &["<s>", "</s>", "a", "b", "\u{e9}"];
    let llama = gguf(
        3,
        &[
            ("general.architecture", Meta::Str("llama")),
            ("llama.block_count", Meta::U32(2)),
            ("llama.attention.head_count", Meta::U32(4)),
            ("llama.attention.head_count_kv", Meta::U32(2)),
            ("llama.embedding_length", Meta::U32(32)),
            ("llama.feed_forward_length", Meta::U32(64)),
            ("llama.context_length", Meta::U64(2048)),
            ("llama.rope.freq_base", Meta::F32(10_000.0)),
            ("tokenizer.ggml.tokens", Meta::StrArray(vocab)),
            (
                "tokenizer.ggml.scores",
                Meta::F32Array(&[0.0, -1.0, -2.0, -3.0, 0.5]),
            ),
            ("tokenizer.ggml.add_bos_token", Meta::Bool(true)),
        ],
        &[
            ("token_embd.weight", &[32, 5], 1, 32 * 5 * 2),
            ("blk.0.attn_q.weight", &[32, 32], 8, 32 * 32 / 32 * 34),
            ("blk.0.attn_k.weight", &[32, 16], 2, 32 * 16 / 32 * 18),
            ("output.weight", &[32, 5], 0, 32 * 5 * 4),
        ],
        32,
    );
    let qwen = gguf(
        3,
        &[
            ("general.architecture", Meta::Str("qwen2")),
            ("general.alignment", Meta::U32(64)),
            ("qwen2.block_count", Meta::U32(3)),
            ("qwen2.attention.head_count", Meta::U32(8)),
            ("qwen2.attention.head_count_kv", Meta::U32(1)),
            ("qwen2.attention.key_length", Meta::U32(16)),
            ("qwen2.embedding_length", Meta::U32(64)),
            ("qwen2.rope.freq_base", Meta::F64(1_000_000.0)),
            ("qwen2.vocab_size", Meta::U32(7)),
            ("general.file_type", Meta::I32(1)),
        ],
        &[("output.weight", &[64, 7], 1, 64 * 7 * 2)],
        64,
    );
    let tied = gguf(
        3,
        &[
            ("general.architecture", Meta::Str("llama")),
            ("llama.block_count", Meta::U32(1)),
            ("llama.attention.head_count", Meta::U32(2)),
            ("llama.embedding_length", Meta::U32(8)),
            ("tokenizer.ggml.tokens", Meta::StrArray(vocab)),
        ],
        &[("token_embd.weight", &[8, 5], 0, 8 * 5 * 4)],
        32,
    );
    let v2 = gguf(
        2,
        &[
            ("general.architecture", Meta::Str("llama")),
            ("llama.block_count", Meta::U32(1)),
            ("llama.attention.head_count", Meta::U32(1)),
            ("llama.embedding_length", Meta::U32(4)),
            ("x.nested", Meta::Nested(&[&[1, 2], &[], &[3]])),
        ],
        &[],
        32,
    );
    vec![llama, qwen, tied, v2]
}
