//! Sizes computed from caller input are checked: absurd inputs are typed errors, never a
//! wrapped number (release builds) or a panic (builds with overflow checks, which the
//! `test` profile has by default).

use pagedkv::attention::cpu::{contiguous_decode, ContiguousKv};
use pagedkv::attention::AttentionParams;
use pagedkv::plan::{ModelSpec, PlanInput, GIB};
use pagedkv::{DType, Error};

/// Item 2: 2^56 requests of 4096 tokens (256 blocks each) need 2^64 blocks, which
/// wrapped to 0 blocks needed and the verdict "fits".
#[test]
fn concurrency_times_blocks_per_request_overflow_is_an_error() {
    let spec = ModelSpec::resolve("llama3-8b").unwrap();
    let mut input = PlanInput::new(spec, 80 * GIB);
    input.context_tokens = 4096;
    input.concurrency = 1 << 56;
    match input.plan() {
        Err(Error::OutOfRange { field, value, .. }) => {
            assert_eq!(field, "concurrency");
            assert_eq!(value, (1u64 << 56) as f64);
        }
        other => panic!("expected an out-of-range concurrency, got {other:?}"),
    }
    // One request fewer than the wrap point still does not "fit": it is refused or
    // does not fit, never fits.
    input.concurrency = (1 << 56) - 1;
    if let Ok(plan) = input.plan() {
        assert!(!plan.verdict.fits());
    }
}

/// Item 2, the byte side: a reserve near `u64::MAX` plus the weights wrapped.
#[test]
fn reserve_plus_weights_overflow_is_an_error() {
    let spec = ModelSpec::resolve("llama3-8b").unwrap();
    let mut input = PlanInput::new(spec, 80 * GIB);
    input.context_tokens = 4096;
    input.reserve_bytes = Some(u64::MAX - 10);
    assert!(
        matches!(
            input.plan(),
            Err(Error::OutOfRange {
                field: "reserve_bytes",
                ..
            })
        ),
        "{:?}",
        input.plan()
    );
    // The estimated reserve overflows with an absurd batch.
    let mut input = PlanInput::new(ModelSpec::resolve("llama3-8b").unwrap(), 80 * GIB);
    input.context_tokens = 4096;
    input.max_batch_tokens = usize::MAX / 2;
    assert!(
        matches!(
            input.plan(),
            Err(Error::OutOfRange {
                field: "max_batch_tokens",
                ..
            })
        ),
        "{:?}",
        input.plan()
    );
}

/// Item 3: a 2^32 x 2^32 embedding counted as 0 parameters.
#[test]
fn config_dimensions_that_overflow_parameter_counts_are_errors() {
    let text = r#"{
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 4294967296,
        "intermediate_size": 1,
        "vocab_size": 4294967296,
        "max_position_embeddings": 4096
    }"#;
    let spec = ModelSpec::from_json_str(text).unwrap();
    let input = PlanInput::new(spec, 80 * GIB);
    match input.plan() {
        Err(Error::ModelConfig(msg)) => {
            assert!(msg.contains("overflow"), "{msg}");
            assert!(msg.contains("4294967296"), "{msg}");
        }
        other => panic!("expected a ModelConfig overflow error, got {other:?}"),
    }
    // Each of the big dimensions alone, multiplied by the layer count.
    for (field, value) in [
        ("intermediate_size", "18446744073709551615"),
        ("vocab_size", "18446744073709551615"),
        ("hidden_size", "18446744073709551615"),
    ] {
        let mut v: serde_json::Value =
            serde_json::from_str(pagedkv::plan::config::builtin::LLAMA3_8B).unwrap();
        v[field] = serde_json::from_str(value).unwrap();
        let text = v.to_string();
        // hidden_size enters head_dim; with an explicit head_dim the shape stays valid.
        let text = text.replacen('{', "{\"head_dim\": 128,", 1);
        let result = ModelSpec::from_json_str(&text)
            .and_then(|spec| PlanInput::new(spec, 80 * GIB).plan().map(|_| ()));
        assert!(
            matches!(result, Err(Error::ModelConfig(ref m)) if m.contains("overflow")),
            "{field}: {result:?}"
        );
    }
}

/// Item 4: `max_tokens = 2^62` made `ContiguousKv::bytes()` wrap to 0, empty slices
/// passed the length check and the kernel indexed out of bounds.
#[test]
fn contiguous_kv_size_overflow_is_an_error() {
    let kv = ContiguousKv {
        k: &[],
        v: &[],
        dtype: DType::F32,
        batch: 1,
        max_tokens: 1 << 62,
        num_kv_heads: 1,
        head_dim: 1,
    };
    let params = AttentionParams::new(1);
    let mut out = [0f32; 1];
    let r = contiguous_decode(&kv, 1, &[0.0], &[1], &params, None, &mut out, None);
    assert!(
        matches!(
            r,
            Err(Error::ShapeMismatch { .. } | Error::OutOfRange { .. })
        ),
        "{r:?}"
    );
}
