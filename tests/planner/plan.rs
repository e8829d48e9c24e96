//! Capacity planner: numbers against hand calculations for the shipped configs, every
//! weight precision and KV dtype; invalid inputs are typed errors; suggestions are
//! checked by applying them.

use pagedkv::plan::{
    ModelSpec, PlanInput, Shortfall, Suggestion, Verdict, WeightPrecision, GIB, SWEEP_GPU_GIB,
    SWEEP_KV_DTYPES, WORKSPACE_BYTES,
};
use pagedkv::{DType, Error};

/// Parameter counts written out by hand from each config.json.
struct Hand {
    name: &'static str,
    /// q, k, v, o and gate, up, down of all layers.
    linear: u64,
    /// Embedding + lm_head (+ q/k/v biases for Qwen2): kept in 16 bits.
    dense: u64,
    /// RMSNorm weights, replicated under tensor parallelism.
    norms: u64,
    /// 2 * layers * kv_heads * head_dim: KV elements per token.
    kv_elems_per_token: u64,
    max_position_embeddings: usize,
}

fn llama3_8b() -> Hand {
    // hidden 4096, intermediate 14336, vocab 128256, 32 layers, 32 q heads, 8 KV heads,
    // head dim 128: q = 32*128 = 4096 wide, k and v = 8*128 = 1024 wide.
    Hand {
        name: "llama3-8b",
        // per layer: q 4096x4096 + k 4096x1024 + v 4096x1024 + o 4096x4096
        //          + gate, up, down 3 x 4096x14336
        linear: 32 * (4096 * 4096 + 4096 * 1024 + 4096 * 1024 + 4096 * 4096)
            + 32 * 3 * 4096 * 14336,
        // embedding and untied lm_head, 128256 x 4096 each
        dense: 2 * 128256 * 4096,
        // two norms per layer and the final one
        norms: (2 * 32 + 1) * 4096,
        kv_elems_per_token: 2 * 32 * 8 * 128,
        max_position_embeddings: 8192,
    }
}

fn qwen2_5_7b() -> Hand {
    // hidden 3584, intermediate 18944, vocab 152064, 28 layers, 28 q heads, 4 KV heads,
    // head dim 128: q = 3584 wide, k and v = 512 wide; q/k/v have biases.
    Hand {
        name: "qwen2.5-7b",
        linear: 28 * (3584 * 3584 + 3584 * 512 + 3584 * 512 + 3584 * 3584) + 28 * 3 * 3584 * 18944,
        // embedding + lm_head + per-layer q, k, v biases (3584 + 512 + 512)
        dense: 2 * 152064 * 3584 + 28 * (3584 + 512 + 512),
        norms: (2 * 28 + 1) * 3584,
        kv_elems_per_token: 2 * 28 * 4 * 128,
        max_position_embeddings: 32768,
    }
}

fn llama3_70b() -> Hand {
    // hidden 8192, intermediate 28672, vocab 128256, 80 layers, 64 q heads, 8 KV heads,
    // head dim 128: q = 8192 wide, k and v = 1024 wide.
    Hand {
        name: "llama3-70b",
        linear: 80 * (8192 * 8192 + 8192 * 1024 + 8192 * 1024 + 8192 * 8192)
            + 80 * 3 * 8192 * 28672,
        dense: 2 * 128256 * 8192,
        norms: (2 * 80 + 1) * 8192,
        kv_elems_per_token: 2 * 80 * 8 * 128,
        max_position_embeddings: 8192,
    }
}

fn hands() -> [Hand; 3] {
    [llama3_8b(), qwen2_5_7b(), llama3_70b()]
}

fn input(name: &str, gpu_gib: u64) -> PlanInput {
    PlanInput::new(ModelSpec::resolve(name).unwrap(), gpu_gib * GIB)
}

#[test]
fn parameter_counts_match_the_published_sizes() {
    // Model cards: Llama-3-8B 8.03 B, Qwen2.5-7B 7.61 B ("7.6 B"), Llama-3-70B 70.6 B.
    let expected = [8_030_261_248u64, 7_615_616_512, 70_553_706_496];
    for (hand, total) in hands().iter().zip(expected) {
        assert_eq!(
            hand.linear + hand.dense + hand.norms,
            total,
            "{}",
            hand.name
        );
        let spec = ModelSpec::resolve(hand.name).unwrap();
        assert_eq!(spec.param_counts().unwrap().total(), total, "{}", hand.name);
        assert_eq!(
            spec.param_counts().unwrap().attention + spec.param_counts().unwrap().mlp,
            hand.linear
        );
    }
}

#[test]
fn weight_bytes_for_every_precision() {
    for hand in hands() {
        let (lin, dense, norms) = (hand.linear, hand.dense, hand.norms);
        let cases = [
            // 4 bytes for everything
            (WeightPrecision::F32, 4 * (lin + dense + norms)),
            // 2 bytes for everything
            (WeightPrecision::F16, 2 * (lin + dense + norms)),
            // linear layers 1 byte, the rest stays 16-bit
            (WeightPrecision::Int8, lin + 2 * (dense + norms)),
            // 4 bits per linear weight plus one f16 scale per 128 weights
            (
                WeightPrecision::Int4 { group_size: 128 },
                lin / 2 + 2 * (lin / 128) + 2 * (dense + norms),
            ),
            (
                WeightPrecision::Int4 { group_size: 64 },
                lin / 2 + 2 * (lin / 64) + 2 * (dense + norms),
            ),
        ];
        for (precision, bytes) in cases {
            let mut i = input(hand.name, 1000);
            i.weight_precision = precision;
            i.context_tokens = 1024;
            let plan = i.plan().unwrap();
            assert_eq!(plan.weight_bytes, bytes, "{} {precision}", hand.name);
        }
    }
    // The 16-bit Llama-3-8B is the well-known ~16.06 GB checkpoint.
    let plan = input("llama3-8b", 80).plan().unwrap();
    assert_eq!(plan.weight_bytes, 16_060_522_496);
}

#[test]
fn kv_bytes_per_token_and_block_for_every_dtype() {
    for hand in hands() {
        for dtype in DType::ALL {
            for block_size in [8usize, 16, 32] {
                let mut i = input(hand.name, 1000);
                i.kv_dtype = dtype;
                i.block_size = block_size;
                i.context_tokens = 1024;
                let plan = i.plan().unwrap();
                let per_token = hand.kv_elems_per_token * dtype.size_bytes() as u64;
                assert_eq!(plan.kv_bytes_per_token, per_token, "{} {dtype}", hand.name);
                assert_eq!(plan.block_bytes, per_token * block_size as u64);
            }
        }
    }
    // Spelled out: Llama-3-8B in bf16 is 2 (K,V) * 32 layers * 8 heads * 128 * 2 B
    // = 128 KiB per token, 2 MiB per 16-token block.
    let plan = input("llama3-8b", 80).plan().unwrap();
    assert_eq!(plan.kv_bytes_per_token, 131_072);
    assert_eq!(plan.block_bytes, 2_097_152);
}

#[test]
fn end_to_end_llama3_8b_on_80_gib() {
    let mut i = input("llama3-8b", 80);
    i.reserve_bytes = Some(2 * GIB);
    i.context_tokens = 8192;
    i.concurrency = 32;
    let plan = i.plan().unwrap();
    // usable = 80 GiB * 0.9 = 85_899_345_920 * 0.9
    assert_eq!(plan.usable_bytes, 77_309_411_328);
    // KV budget = usable - weights (16_060_522_496) - reserve (2 GiB)
    assert_eq!(
        plan.kv_budget_bytes,
        77_309_411_328 - 16_060_522_496 - 2_147_483_648
    );
    // 59_101_405_184 / 2 MiB = 28181.6 -> 28181 blocks of 16 tokens
    assert_eq!(plan.num_blocks, 28_181);
    assert_eq!(plan.capacity_tokens, 28_181 * 16);
    // 8192 tokens = 512 blocks per request; 28181 / 512 = 55.04 -> 55 requests
    assert_eq!(plan.blocks_per_request, 512);
    assert_eq!(plan.max_concurrency, 55);
    assert_eq!(plan.verdict, Verdict::Fits);

    // 64 requests need 64 * 512 = 32768 blocks: does not fit.
    i.concurrency = 64;
    let plan = i.plan().unwrap();
    match plan.verdict {
        Verdict::DoesNotFit {
            shortfall,
            suggestions,
        } => {
            assert_eq!(
                shortfall,
                Shortfall::Blocks {
                    needed_blocks: 32_768,
                    num_blocks: 28_181
                }
            );
            // fp8 halves the block: 59_101_405_184 / 1 MiB = 56363 blocks, 110 requests.
            assert!(suggestions.contains(&Suggestion::KvDtype {
                kv_dtype: DType::Fp8E4M3,
                max_concurrency: 110
            }));
            // 28181 / 64 = 440 blocks each = 7040 tokens.
            assert!(suggestions.contains(&Suggestion::Context {
                max_context_tokens: 7040
            }));
            assert!(suggestions.contains(&Suggestion::Concurrency {
                max_concurrency: 55
            }));
        }
        Verdict::Fits => panic!("64 x 8192 tokens cannot fit 28181 blocks"),
    }
}

#[test]
fn estimated_reserve_follows_the_documented_formula() {
    let mut i = input("llama3-8b", 80);
    i.concurrency = 32;
    // 1 GiB workspace
    // + 8192 tokens * 2 B * (2*4096 residual+normed + (32+2*8)*128 qkv + 2*14336 gate/up)
    // + 32 rows * 128256 vocab * 4 B logits
    let expected = WORKSPACE_BYTES + 8192 * 2 * (2 * 4096 + 48 * 128 + 2 * 14336) + 32 * 128256 * 4;
    assert_eq!(expected, 1_794_801_664);
    assert_eq!(i.estimated_reserve_bytes().unwrap(), expected);
    assert_eq!(i.plan().unwrap().reserve_bytes, expected);
    // Under tp 2 the sharded activations halve.
    i.tensor_parallel = 2;
    let expected_tp2 =
        WORKSPACE_BYTES + 8192 * 2 * (2 * 4096 + 48 * 128 / 2 + 14336) + 32 * 128256 * 4;
    assert_eq!(i.estimated_reserve_bytes().unwrap(), expected_tp2);
    // An explicit reserve replaces the estimate.
    i.reserve_bytes = Some(123);
    assert_eq!(i.plan().unwrap().reserve_bytes, 123);
}

#[test]
fn tensor_parallel_splits_weights_and_kv_heads() {
    let hand = llama3_70b();
    let mut i = input("llama3-70b", 80);
    i.tensor_parallel = 4;
    i.context_tokens = 8192;
    let plan = i.plan().unwrap();
    // Each GPU: a quarter of the linear, embedding and lm_head weights, all the norms.
    assert_eq!(
        plan.weight_bytes,
        2 * (hand.linear / 4) + 2 * (hand.dense / 4) + 2 * hand.norms
    );
    // 8 KV heads / 4 = 2 per GPU: 2 * 80 * 2 * 128 * 2 B = 80 KiB per token.
    assert_eq!(plan.kv_bytes_per_token, 81_920);
    // tp 1 does not even hold the weights.
    i.tensor_parallel = 1;
    let plan = i.plan().unwrap();
    assert_eq!(plan.num_blocks, 0);
    assert!(matches!(
        plan.verdict,
        Verdict::DoesNotFit {
            shortfall: Shortfall::Weights { .. },
            ..
        }
    ));
}

#[test]
fn every_suggestion_fits_when_applied() {
    let cases: [(&str, u64, usize, usize); 4] = [
        ("llama3-8b", 80, 8192, 64),
        ("llama3-8b", 24, 8192, 16),
        ("qwen2.5-7b", 48, 32768, 16),
        ("llama3-70b", 80, 8192, 8),
    ];
    for (name, gib, context, concurrency) in cases {
        let mut i = input(name, gib);
        i.context_tokens = context;
        i.concurrency = concurrency;
        let plan = i.plan().unwrap();
        let Verdict::DoesNotFit { suggestions, .. } = plan.verdict else {
            panic!("{name} on {gib} GiB should not fit {concurrency} x {context}");
        };
        assert!(!suggestions.is_empty());
        for s in suggestions {
            let mut alt = i.clone();
            let mut too_far = None;
            match s {
                Suggestion::KvDtype { kv_dtype, .. } => alt.kv_dtype = kv_dtype,
                Suggestion::TensorParallel {
                    tensor_parallel, ..
                } => alt.tensor_parallel = tensor_parallel,
                Suggestion::WeightPrecision { precision, .. } => alt.weight_precision = precision,
                Suggestion::GpuMemory { gpu_memory_bytes } => {
                    alt.gpu_memory_bytes = gpu_memory_bytes;
                    let mut less = i.clone();
                    less.gpu_memory_bytes = gpu_memory_bytes - 4 * (1 << 20);
                    too_far = Some(less);
                }
                Suggestion::Context { max_context_tokens } => {
                    alt.context_tokens = max_context_tokens as usize;
                    let mut more = i.clone();
                    more.context_tokens = max_context_tokens as usize + i.block_size;
                    too_far = Some(more);
                }
                Suggestion::Concurrency { max_concurrency } => {
                    alt.concurrency = max_concurrency as usize;
                    let mut more = i.clone();
                    more.concurrency = max_concurrency as usize + 1;
                    too_far = Some(more);
                }
            }
            assert!(alt.plan().unwrap().verdict.fits(), "{name}: {s}");
            if let Some(beyond) = too_far {
                // The suggestion is the limit, not just something that fits.
                assert!(!beyond.plan().unwrap().verdict.fits(), "{name}: {s}");
            }
        }
    }
}

#[test]
fn invalid_inputs_are_typed_errors() {
    // Zero memory.
    let i = input("llama3-8b", 0);
    assert!(matches!(
        i.plan(),
        Err(Error::OutOfRange {
            field: "gpu_memory_bytes",
            ..
        })
    ));
    let mut i = input("llama3-8b", 80);
    for gib in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            i.set_gpu_memory_gib(gib),
            Err(Error::OutOfRange {
                field: "gpu_memory_gib",
                ..
            })
        ));
    }
    // Context past max_position_embeddings.
    let mut i = input("llama3-8b", 80);
    i.context_tokens = llama3_8b().max_position_embeddings + 1;
    assert_eq!(
        i.plan().unwrap_err(),
        Error::ContextTooLong {
            context_tokens: 8193,
            max_position_embeddings: 8192
        }
    );
    let mut i = input("qwen2.5-7b", 80);
    i.context_tokens = qwen2_5_7b().max_position_embeddings;
    assert!(i.plan().is_ok());
    i.context_tokens += 1;
    assert!(matches!(i.plan(), Err(Error::ContextTooLong { .. })));
    // Utilisation outside (0, 1].
    for u in [0.0, -0.5, 1.0001, 2.0, f64::NAN] {
        let mut i = input("llama3-8b", 80);
        i.gpu_memory_utilization = u;
        assert!(
            matches!(
                i.plan(),
                Err(Error::OutOfRange {
                    field: "gpu_memory_utilization",
                    ..
                })
            ),
            "{u}"
        );
    }
    let mut i = input("llama3-8b", 80);
    i.gpu_memory_utilization = 1.0;
    assert!(i.plan().is_ok());
    // Tensor parallelism that does not divide the heads.
    let cases = [
        ("llama3-8b", 3, "num_attention_heads", 32),
        ("llama3-8b", 16, "num_key_value_heads", 8),
        ("qwen2.5-7b", 8, "num_attention_heads", 28),
        ("llama3-70b", 16, "num_key_value_heads", 8),
    ];
    for (name, tp, what, count) in cases {
        let mut i = input(name, 80);
        i.tensor_parallel = tp;
        assert_eq!(
            i.plan().unwrap_err(),
            Error::UnevenTensorParallel { what, count, tp }
        );
    }
    // Zeros elsewhere.
    for field in ["context_tokens", "concurrency", "tensor_parallel"] {
        let mut i = input("llama3-8b", 80);
        match field {
            "context_tokens" => i.context_tokens = 0,
            "concurrency" => i.concurrency = 0,
            _ => i.tensor_parallel = 0,
        }
        assert!(
            matches!(i.plan(), Err(Error::OutOfRange { field: f, .. }) if f == field),
            "{field}"
        );
    }
    let mut i = input("llama3-8b", 80);
    i.block_size = 0;
    assert!(matches!(
        i.plan(),
        Err(Error::InvalidConfig {
            field: "block_size",
            ..
        })
    ));
}

#[test]
fn precision_names_parse() {
    assert_eq!(
        WeightPrecision::parse("bf16").unwrap(),
        WeightPrecision::F16
    );
    assert_eq!(
        WeightPrecision::parse("FP8").unwrap(),
        WeightPrecision::Int8
    );
    assert_eq!(
        WeightPrecision::parse("int4").unwrap(),
        WeightPrecision::Int4 { group_size: 128 }
    );
    assert_eq!(
        WeightPrecision::parse("int4-g32").unwrap(),
        WeightPrecision::Int4 { group_size: 32 }
    );
    for p in WeightPrecision::LADDER {
        assert_eq!(WeightPrecision::parse(&p.name()).unwrap(), p);
    }
    for bad in ["int3", "int4-g0", "int4-gx", ""] {
        assert!(WeightPrecision::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn model_specs_from_configs() {
    let text = pagedkv::plan::config::builtin::LLAMA3_8B;
    assert!(!ModelSpec::from_json_str(text).unwrap().attention_bias);
    assert!(ModelSpec::resolve("qwen2.5-7b").unwrap().attention_bias);
    // Tied embeddings drop the lm_head.
    let tied = text.replace(
        "\"tie_word_embeddings\": false",
        "\"tie_word_embeddings\": true",
    );
    let spec = ModelSpec::from_json_str(&tied).unwrap();
    assert_eq!(spec.param_counts().unwrap().lm_head, 0);
    assert_eq!(
        spec.param_counts().unwrap().total(),
        8_030_261_248 - 128256 * 4096
    );
    // The weight estimate needs intermediate_size.
    let partial = text.replace("\"intermediate_size\": 14336,", "");
    assert!(matches!(
        ModelSpec::from_json_str(&partial),
        Err(Error::ModelConfig(_))
    ));
    assert!(matches!(
        ModelSpec::resolve("/no/such/config.json"),
        Err(Error::Io(_))
    ));
}

#[test]
fn sweep_covers_every_gpu_and_dtype() {
    let mut i = input("llama3-8b", 80);
    i.context_tokens = 8192;
    i.concurrency = 64;
    let plans = i.sweep().unwrap();
    assert_eq!(plans.len(), SWEEP_GPU_GIB.len() * SWEEP_KV_DTYPES.len());
    for (n, p) in plans.iter().enumerate() {
        let gib = SWEEP_GPU_GIB[n / SWEEP_KV_DTYPES.len()];
        assert_eq!(p.gpu_memory_bytes, (gib * GIB as f64) as u64);
        assert_eq!(p.kv_dtype, SWEEP_KV_DTYPES[n % SWEEP_KV_DTYPES.len()]);
        assert!(p.sweep_line().contains(p.kv_dtype.name()));
    }
    // Halving the element size doubles the blocks, up to rounding.
    for row in plans.chunks(SWEEP_KV_DTYPES.len()) {
        let (f32_, bf16, fp8) = (row[0].num_blocks, row[1].num_blocks, row[2].num_blocks);
        assert!(bf16 == 2 * f32_ || bf16 == 2 * f32_ + 1);
        assert!(fp8 == 2 * bf16 || fp8 == 2 * bf16 + 1);
    }
    // 64 x 8192 needs 32768 blocks: bf16 fits on 141 GiB, not on 80.
    assert!(!plans[7].verdict.fits());
    assert!(plans[10].verdict.fits());
}

#[test]
fn json_carries_the_numbers() {
    let mut i = input("llama3-8b", 24);
    i.context_tokens = 8192;
    i.concurrency = 16;
    let plan = i.plan().unwrap();
    let v = plan.to_json();
    assert_eq!(v["num_blocks"], plan.num_blocks);
    assert_eq!(v["kv_bytes_per_token"], 131_072);
    assert_eq!(v["weight_bytes"], plan.weight_bytes);
    assert_eq!(v["fits"], false);
    assert_eq!(v["shortfall"]["kind"], "blocks");
    assert!(v["suggestions"].as_array().is_some_and(|s| !s.is_empty()));
    // And it is valid JSON text.
    let text = v.to_string();
    let back: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(back, v);
}

/// A public config shipped in `tests/data/` and the figures its publishers give.
struct Published {
    file: &'static str,
    /// Total parameters as published.
    total: f64,
    /// Active parameters per token as published, and whether that figure leaves the
    /// input embedding out (gpt-oss and DeepSeek cards do; Mistral and Qwen count it).
    active: Option<(f64, bool)>,
    /// The count written out by hand from the config.
    exact: u64,
}

fn data(file: &str) -> ModelSpec {
    ModelSpec::from_file(format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn published() -> Vec<Published> {
    vec![
        // Mistral-7B-v0.1: 7.24 B on the model page ("7.3B" in the announcement).
        // embeddings + 32 x (q,o 4096^2; k,v 4096x1024; gate,up,down 4096x14336) + norms
        Published {
            file: "mistral-7b.json",
            total: 7.24e9,
            active: None,
            exact: 2 * 32000 * 4096
                + 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
                + 32 * 3 * 4096 * 14336
                + 65 * 4096,
        },
        // Gemma-2-9B: 9.24 B. Tied embedding, head_dim 256 (q is 4096 wide, not the
        // hidden 3584), four norms per layer.
        Published {
            file: "gemma-2-9b.json",
            total: 9.24e9,
            active: None,
            exact: 256000 * 3584
                + 42 * (2 * 3584 * 4096 + 2 * 3584 * 2048)
                + 42 * 3 * 3584 * 14336
                + (4 * 42 + 1) * 3584,
        },
        // Phi-3-mini: 3.8 B (fused qkv and gate_up, same counts).
        Published {
            file: "phi-3-mini-4k.json",
            total: 3.8e9,
            active: None,
            exact: 2 * 32064 * 3072 + 32 * 4 * 3072 * 3072 + 32 * 3 * 3072 * 8192 + 65 * 3072,
        },
        // Qwen2.5-7B-Instruct-AWQ: the 7.61 B of Qwen2.5-7B, stored in int4.
        Published {
            file: "qwen2.5-7b-instruct-awq.json",
            total: 7.61e9,
            active: None,
            exact: 7_615_616_512,
        },
        // Mixtral-8x7B: 46.7 B total, 12.9 B per token (Mistral's announcement).
        // 8 experts of 3 x 4096 x 14336 in each of 32 layers, routers 8 x 4096.
        Published {
            file: "mixtral-8x7b.json",
            total: 46.7e9,
            active: Some((12.9e9, false)),
            exact: 2 * 32000 * 4096
                + 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
                + 32 * 8 * 3 * 4096 * 14336
                + 32 * 8 * 4096
                + 65 * 4096,
        },
        // Qwen3-30B-A3B: 30.5 B total, 3.3 B activated. 128 experts of 3 x 2048 x 768
        // (moe_intermediate_size), q 32 x 128 = 4096 wide, q/k norms of 128.
        Published {
            file: "qwen3-30b-a3b.json",
            total: 30.5e9,
            active: Some((3.3e9, false)),
            exact: 2 * 151936 * 2048
                + 48 * (2 * 2048 * 4096 + 2 * 2048 * 512)
                + 48 * 128 * 3 * 2048 * 768
                + 48 * 128 * 2048
                + 97 * 2048
                + 48 * 2 * 128,
        },
        // DeepSeek-V3: 671 B total (main model; the 14 B MTP module apart), 37 B
        // activated. MLA: q_a 7168x1536, q_b 1536 x 128x192, kv_a 7168x(512+64),
        // kv_b 512 x 128x256, o 128x128 x 7168; 3 dense layers of 18432; 58 MoE layers
        // of 256 routed + 1 shared experts of 2048, router 256x7168 + 256 bias.
        Published {
            file: "deepseek-v3.json",
            total: 671e9,
            active: Some((37e9, true)),
            exact: 2 * 129280 * 7168
                + 61 * (7168 * 1536
                    + 1536 * 128 * 192
                    + 7168 * 576
                    + 512 * 128 * 256
                    + 128 * 128 * 7168)
                + 3 * 3 * 7168 * 18432
                + 58 * 257 * 3 * 7168 * 2048
                + 58 * (256 * 7168 + 256)
                + 123 * 7168
                + 61 * (1536 + 512),
        },
        // DeepSeek-V2-Lite: 15.7 B total, 2.4 B activated. No q_lora_rank: a full
        // q projection 2048 x 16x192; 1 dense layer; 26 MoE layers of 64 routed + 2
        // shared experts of 1408.
        Published {
            file: "deepseek-v2-lite.json",
            total: 15.7e9,
            active: Some((2.4e9, true)),
            exact: 2 * 102400 * 2048
                + 27 * (2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048)
                + 3 * 2048 * 10944
                + 26 * 66 * 3 * 2048 * 1408
                + 26 * 64 * 2048
                + 55 * 2048
                + 27 * 512,
        },
        // gpt-oss-20b: 20.91 B total, 3.61 B active (model card table). Biases on
        // q, k, v, o and 64 sinks per layer; 32 experts with gate_up (2 x 2880) and down
        // biases; router 2880 x 32 with bias.
        Published {
            file: "gpt-oss-20b.json",
            total: 20.91e9,
            active: Some((3.61e9, true)),
            exact: 2 * 201088 * 2880
                + 24 * (2 * 2880 * 4096 + 2 * 2880 * 512 + 4096 + 2 * 512 + 2880 + 64)
                + 24 * 32 * (3 * 2880 * 2880 + 2 * 2880 + 2880)
                + 24 * (2880 * 32 + 32)
                + 49 * 2880,
        },
    ]
}

#[test]
fn published_parameter_counts_within_one_percent() {
    for p in published() {
        let counts = data(p.file).param_counts().unwrap();
        let total = counts.total();
        assert_eq!(total, p.exact, "{}: against the hand count", p.file);
        let err = (total as f64 - p.total).abs() / p.total;
        assert!(
            err < 0.01,
            "{}: {total} vs published {} ({:.2} %)",
            p.file,
            p.total,
            err * 100.0
        );
        match p.active {
            None => assert_eq!(counts.active(), total, "{}: dense", p.file),
            Some((published, without_embedding)) => {
                let active = if without_embedding {
                    counts.active_without_embedding()
                } else {
                    counts.active()
                };
                // Active figures are published to two significant digits ("3.3 B",
                // "37 B"): 2.5 % allows that rounding and nothing like a missed expert.
                let err = (active as f64 - published).abs() / published;
                assert!(
                    err < 0.025,
                    "{}: active {active} vs {published} ({:.2} %)",
                    p.file,
                    err * 100.0
                );
                assert!(active < total / 3, "{}", p.file);
            }
        }
    }
}

#[test]
fn moe_memory_counts_every_expert() {
    // A reported bug: Mixtral-8x7B was counted 7.24 B and "fit" on one 80 GiB GPU in bf16.
    let spec = data("mixtral-8x7b.json");
    let mut i = PlanInput::new(spec, 80 * GIB);
    i.context_tokens = 4096;
    let plan = i.plan().unwrap();
    assert_eq!(plan.params, 46_702_792_704);
    assert_eq!(plan.active_params, 12_879_925_248);
    // 2 bytes per parameter: about 87 GiB.
    assert_eq!(plan.weight_bytes, 2 * 46_702_792_704);
    assert!(matches!(
        plan.verdict,
        Verdict::DoesNotFit {
            shortfall: Shortfall::Weights { .. },
            ..
        }
    ));
    // tp 2 splits the experts too.
    i.tensor_parallel = 2;
    let plan = i.plan().unwrap();
    assert!(plan.verdict.fits());
    assert!(
        plan.to_string().contains("12.88 B active per token"),
        "{plan}"
    );
    // Qwen3-30B-A3B in bf16 is 61 GB of weights, not the 6.7 GB of its 3.34 B misread.
    let plan = PlanInput::new(data("qwen3-30b-a3b.json"), 80 * GIB)
        .plan()
        .unwrap();
    assert_eq!(plan.weight_bytes, 2 * 30_532_122_624);
}

#[test]
fn precision_comes_from_the_config_and_the_caller_overrides_it() {
    // AWQ: 4-bit weights, an f16 scale and a 4-bit zero per 128 weights; embedding,
    // lm_head, biases and norms in 16 bits.
    let awq = data("qwen2.5-7b-instruct-awq.json");
    assert_eq!(
        awq.config_precision(),
        Some(WeightPrecision::Int4Zp { group_size: 128 })
    );
    let hand = qwen2_5_7b();
    let mut i = PlanInput::new(awq, 80 * GIB);
    i.context_tokens = 4096;
    let plan = i.plan().unwrap();
    let groups = hand.linear / 128;
    assert_eq!(
        plan.weight_bytes,
        hand.linear / 2 + 2 * groups + groups / 2 + 2 * (hand.dense + hand.norms)
    );
    // About 5.57 GB, the size of the published checkpoint's safetensors.
    assert!(
        (5.5e9..5.65e9).contains(&(plan.weight_bytes as f64)),
        "{}",
        plan.weight_bytes
    );
    assert!(plan.notes.iter().any(|n| n.contains("quantization_config")));
    // --weights overrides.
    i.weight_precision = WeightPrecision::F16;
    let plan = i.plan().unwrap();
    assert_eq!(
        plan.weight_bytes,
        2 * (hand.linear + hand.dense + hand.norms)
    );
    assert!(
        plan.notes.iter().any(|n| n.contains("as asked")),
        "{:?}",
        plan.notes
    );

    // DeepSeek-V3: fp8 with one f32 scale per 128 x 128 block.
    let ds = data("deepseek-v3.json");
    assert_eq!(
        ds.config_precision(),
        Some(WeightPrecision::Fp8Block {
            rows: 128,
            cols: 128
        })
    );
    let c = ds.param_counts().unwrap();
    let linear = c.attention + c.mlp + c.experts;
    assert_eq!(
        c.bytes_per_gpu(
            WeightPrecision::Fp8Block {
                rows: 128,
                cols: 128
            },
            1
        )
        .unwrap(),
        linear
            + 4 * linear.div_ceil(128 * 128)
            + 2 * (c.embedding + c.lm_head + c.router + c.norms)
    );

    // gpt-oss: MXFP4 experts, attention left in bf16 (modules_to_not_convert).
    let oss = data("gpt-oss-20b.json");
    assert_eq!(oss.config_precision(), Some(WeightPrecision::Mxfp4));
    let c = oss.param_counts().unwrap();
    let mut i = PlanInput::new(oss, 80 * GIB);
    i.context_tokens = 4096;
    assert_eq!(i.attention_precision, Some(WeightPrecision::F16));
    let plan = i.plan().unwrap();
    let experts = c.experts;
    assert_eq!(
        plan.weight_bytes,
        experts.div_ceil(2)
            + experts.div_ceil(32)
            + 2 * c.attention
            + 2 * (c.embedding + c.lm_head + c.attention_bias + c.router + c.norms)
    );
    // The published checkpoint is 12.8 GiB.
    let gib = plan.weight_bytes as f64 / GIB as f64;
    assert!((12.6..13.0).contains(&gib), "{gib}");
    assert!(
        plan.notes
            .iter()
            .any(|n| n.contains("sliding window of 128 tokens on 12 of 24 layers")),
        "{:?}",
        plan.notes
    );

    // bitsandbytes and GPTQ read from a config.
    let base = pagedkv::plan::config::builtin::LLAMA3_8B;
    for (q, expected) in [
        (
            r#"{"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_use_double_quant": true}"#,
            WeightPrecision::Nf4 { double_quant: true },
        ),
        (
            r#"{"quant_method": "bitsandbytes", "load_in_8bit": true}"#,
            WeightPrecision::Int8,
        ),
        (
            r#"{"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": true}"#,
            WeightPrecision::Int4Zp { group_size: 32 },
        ),
        (
            r#"{"quant_method": "gptq", "bits": 4, "group_size": -1}"#,
            WeightPrecision::Int4Zp { group_size: 4096 },
        ),
        (
            r#"{"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": false}"#,
            WeightPrecision::Int4 { group_size: 64 },
        ),
    ] {
        let text = base.replacen('{', &format!("{{\"quantization_config\": {q},"), 1);
        assert_eq!(
            ModelSpec::from_json_str(&text).unwrap().config_precision(),
            Some(expected),
            "{q}"
        );
    }
}

#[test]
fn unknown_memory_fields_are_refused_unless_assumed_dense() {
    let base = pagedkv::plan::config::builtin::LLAMA3_8B;
    // An architecture the planner does not know, with experts.
    let text = base
        .replace(
            "\"model_type\": \"llama\"",
            "\"model_type\": \"mystery_moe\"",
        )
        .replacen(
            '{',
            "{\"num_experts\": 64, \"moe_intermediate_size\": 1024,",
            1,
        );
    let spec = ModelSpec::from_json_str(&text).unwrap();
    match spec.param_counts() {
        Err(Error::ModelConfig(msg)) => {
            assert!(
                msg.contains("moe_intermediate_size") && msg.contains("num_experts"),
                "{msg}"
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let mut i = PlanInput::new(spec, 80 * GIB);
    i.context_tokens = 4096;
    assert!(matches!(i.plan(), Err(Error::ModelConfig(_))));
    i.assume_dense = true;
    let plan = i.plan().unwrap();
    assert_eq!(plan.params, 8_030_261_248);
    let shown = plan.to_string();
    assert!(
        shown.contains("--assume-dense") && shown.contains("num_experts"),
        "{shown}"
    );
    // A known dense type with expert fields is refused too: they would change memory.
    let text = base.replacen('{', "{\"num_local_experts\": 8,", 1);
    assert!(ModelSpec::from_json_str(&text)
        .unwrap()
        .param_counts()
        .is_err());
    // Unknown quantization, linear-attention layers.
    for extra in [
        r#""quantization_config": {"quant_method": "hqq"},"#,
        r#""quantization_config": {"quant_method": "gptq", "bits": 3},"#,
        r#""linear_num_key_heads": 16,"#,
    ] {
        let text = base.replacen('{', &format!("{{{extra}"), 1);
        let spec = ModelSpec::from_json_str(&text).unwrap();
        assert!(
            matches!(spec.param_counts(), Err(Error::ModelConfig(_))),
            "{extra}"
        );
    }
}

/// DeepSeek-V2-Lite's parameters, written out from its config (as in `published`).
const V2_LITE_PARAMS: u64 = 2 * 102400 * 2048
    + 27 * (2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048)
    + 3 * 2048 * 10944
    + 26 * 66 * 3 * 2048 * 1408
    + 26 * 64 * 2048
    + 55 * 2048
    + 27 * 512;

#[test]
fn latent_attention_kv_is_one_latent_per_token_and_layer() {
    // Bytes per token = layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, for
    // every dtype; num_key_value_heads (128 and 16) and head_dim do not enter.
    for (file, layers) in [("deepseek-v3.json", 61u64), ("deepseek-v2-lite.json", 27)] {
        for dtype in DType::ALL {
            let mut i = PlanInput::new(data(file), 141 * GIB);
            i.context_tokens = 4096;
            i.kv_dtype = dtype;
            i.tensor_parallel = 8;
            let plan = i.plan().unwrap();
            let per_token = layers * (512 + 64) * dtype.size_bytes() as u64;
            assert_eq!(plan.kv_bytes_per_token, per_token, "{file} {dtype}");
            assert_eq!(plan.block_bytes, 16 * per_token, "{file} {dtype}");
            assert!(
                plan.notes
                    .iter()
                    .any(|n| n.contains("kv_lora_rank 512")
                        && n.contains("every GPU holds all of it")),
                "{:?}",
                plan.notes
            );
        }
    }
    // The issue's figure: DeepSeek-V3 in bf16 is 61 x 576 x 2 = 70,272 bytes a token
    // (the standard formula with its 128 KV heads of 56 would say 1,748,992).
    let mut i = PlanInput::new(data("deepseek-v3.json"), 141 * GIB);
    i.context_tokens = 4096;
    i.tensor_parallel = 8;
    assert_eq!(i.plan().unwrap().kv_bytes_per_token, 70_272);
    assert_eq!(2 * 61 * 128 * 56 * 2, 1_748_992);
    // The parameter count is unchanged and no dense assumption is needed or noted.
    assert!(i.model.param_counts().is_ok());
    assert!(!i
        .plan()
        .unwrap()
        .notes
        .iter()
        .any(|n| n.contains("NOT right")));
}

#[test]
fn deepseek_v2_lite_plan_by_hand() {
    // One 80 GiB GPU, weights in 16 bits (the config has no quantization_config), KV in
    // bf16, 16-token blocks, 32,768-token requests.
    let mut i = PlanInput::new(data("deepseek-v2-lite.json"), 80 * GIB);
    i.context_tokens = 32_768;
    i.concurrency = 100;
    let plan = i.plan().unwrap();
    assert_eq!(plan.params, V2_LITE_PARAMS);
    assert_eq!(plan.weight_bytes, 2 * V2_LITE_PARAMS);
    // Reserve: 1 GiB + 8192 tokens x 2 B x (2 x 2048 residual and normed input
    // + 16 x (128 + 64) query + 512 + 64 kv_a + 16 x (128 + 128) kv_b
    // + 2 x 10944 gate/up) + 100 rows x 102400 vocab x 4 B.
    let qkv = 16 * 192 + 576 + 16 * 256;
    assert_eq!(qkv, 7744);
    let reserve = GIB + 8192 * 2 * (2 * 2048 + qkv + 2 * 10944) + 100 * 102400 * 4;
    assert_eq!(plan.reserve_bytes, reserve);
    let usable = (80.0 * GIB as f64 * 0.9).floor() as u64;
    assert_eq!(plan.usable_bytes, usable);
    let budget = usable - 2 * V2_LITE_PARAMS - reserve;
    assert_eq!(plan.kv_budget_bytes, budget);
    // 27 layers x 576 x 2 B = 31,104 B a token; 497,664 B a block.
    assert_eq!(plan.kv_bytes_per_token, 31_104);
    assert_eq!(plan.block_bytes, 497_664);
    let blocks = budget / 497_664;
    assert_eq!(plan.num_blocks, blocks);
    assert_eq!(plan.capacity_tokens, blocks * 16);
    assert_eq!(plan.blocks_per_request, 2048);
    assert_eq!(plan.max_concurrency, blocks / 2048);
    // The figures written out: 31.4 GB of weights, 1.42 M tokens of cache.
    assert_eq!(V2_LITE_PARAMS, 15_706_484_224);
    assert_eq!(reserve, 1_667_301_376);
    assert_eq!(blocks, 88_873);
    assert_eq!(blocks * 16, 1_421_968);
    assert_eq!(blocks / 2048, 43);
    assert!(!plan.verdict.fits(), "100 x 32k does not fit, 43 do");
    i.concurrency = 43;
    assert!(i.plan().unwrap().verdict.fits());
}

#[test]
fn gemma2_9b_sizes_window_layers_by_their_window() {
    // Gemma-2-9B: 42 layers alternating local (window 4,096, even layers) and global;
    // 8 KV heads of 256 in bf16: 2 x 42 x 8 x 256 x 2 B = 344,064 B a token.
    let mut i = PlanInput::new(data("gemma-2-9b.json"), 80 * GIB);
    i.context_tokens = 8192;
    i.concurrency = 1;
    let plan = i.plan().unwrap();
    assert_eq!(plan.kv_bytes_per_token, 344_064);
    assert_eq!(plan.block_bytes, 344_064 * 16);
    // 8,192 tokens = 512 blocks on the 21 global layers; the 21 local layers hold at
    // most ceil(4096 / 16) + 1 = 257: (21 x 512 + 21 x 257) / 42 = 384.5 -> 385
    // whole-model blocks (every layer full: 512).
    assert_eq!(plan.blocks_per_request, 385);
    assert_eq!(plan.max_concurrency, plan.num_blocks / 385);
    assert!(plan.notes.iter().any(|n| n.contains("21 of 42 layers")));
    // Below the window nothing is saved: 2,048 tokens = 128 blocks on every layer.
    i.context_tokens = 2048;
    assert_eq!(i.plan().unwrap().blocks_per_request, 128);
    // Without the window every layer holds the whole context.
    let mut full = i.clone();
    full.model.config.arch.sliding_window = None;
    full.context_tokens = 8192;
    assert_eq!(full.plan().unwrap().blocks_per_request, 512);
}

#[test]
fn planner_splits_hybrid_models_into_kv_cache_groups_of_equal_pages() {
    // gpt-oss-20b: 24 layers alternating window 128 and full; 8 KV heads of 64.
    let i = PlanInput::new(data("gpt-oss-20b.json"), 80 * GIB);
    let groups = i.kv_cache_groups().unwrap();
    assert_eq!(groups.len(), 2);
    assert_eq!((groups[0].window, groups[1].window), (None, Some(128)));
    assert!(groups.iter().all(|g| g.layout.shape().num_layers == 12));
    // Every page the same bytes; together the bytes of a whole-model block.
    let page = groups[0].layout.block_bytes();
    assert_eq!(page, 2 * 12 * 8 * 64 * 2 * 16);
    assert_eq!(page * 2, i.plan().unwrap().block_bytes as usize);
    let kv = pagedkv::KvCache::hybrid(&groups, 64).unwrap();
    assert_eq!(kv.num_groups(), 2);

    // Gemma-2-9B: 42 layers, 21 local: two groups of 21.
    let g = PlanInput::new(data("gemma-2-9b.json"), 80 * GIB)
        .kv_cache_groups()
        .unwrap();
    assert_eq!(g.len(), 2);
    assert_eq!(g[1].window, Some(4096));
    assert_eq!(g[0].layout.shape().num_layers, 21);
    // A Gemma-3-like split, 8 global and 40 local layers: 1 + 5 groups of 8.
    let mut g3 = PlanInput::new(data("gemma-2-9b.json"), 80 * GIB);
    g3.model.config.shape.num_layers = 48;
    g3.model.config.arch.layer_types = (0..48)
        .map(|l| {
            if l % 6 == 5 {
                "full_attention"
            } else {
                "sliding_attention"
            }
            .to_string()
        })
        .collect();
    let g = g3.kv_cache_groups().unwrap();
    let windows: Vec<_> = g.iter().map(|s| s.window).collect();
    assert_eq!(
        windows,
        [
            None,
            Some(4096),
            Some(4096),
            Some(4096),
            Some(4096),
            Some(4096)
        ]
    );
    assert!(g.iter().all(|s| s.layout.shape().num_layers == 8));

    // No window: one group of every layer; DeepSeek-V3's is one latent group.
    let g = PlanInput::new(data("llama-3-8b.json"), 80 * GIB)
        .kv_cache_groups()
        .unwrap();
    assert_eq!(
        (g.len(), g[0].window, g[0].layout.shape().num_layers),
        (1, None, 32)
    );
    let g = PlanInput::new(data("deepseek-v3.json"), 80 * GIB)
        .kv_cache_groups()
        .unwrap();
    assert_eq!((g.len(), g[0].layout.shape().num_layers), (1, 61));
    assert!(matches!(g[0].layout.kind(), pagedkv::KvKind::Latent { .. }));
}

/// A hybrid config's sizes, written out by hand from its `config.json` (the files in
/// `tests/data/` name their sources) with vLLM's `MambaStateShapeCalculator` shapes:
/// none of these numbers comes from the planner.
struct HybridHand {
    file: &'static str,
    /// Attention layers of `num_hidden_layers`.
    attention_layers: u64,
    recurrent_layers: u64,
    /// 2 (K, V) x attention layers x KV heads x head_dim x 2 B (bf16).
    kv_bytes_per_token: u64,
    /// Conv state of one layer in bf16, SSM state of one layer in f32.
    conv_bytes: u64,
    ssm_bytes: u64,
    /// Total parameters as published, and half a unit of its last digit.
    published: (f64, f64),
}

fn hybrid_hands() -> [HybridHand; 4] {
    [
        // Qwen3-Next-80B-A3B: every 4th of 48 layers is full attention (12), with 2 KV
        // heads of 256. Gated DeltaNet: 16 key heads and 32 value heads of 128, kernel
        // 4: conv over q, k, v = 3 x (2x16x128 + 32x128) = 3 x 8192; state 32 x 128 x 128.
        HybridHand {
            file: "qwen3-next-80b-a3b.json",
            attention_layers: 12,
            recurrent_layers: 36,
            kv_bytes_per_token: 2 * 12 * 2 * 256 * 2,
            conv_bytes: 3 * 8192 * 2,
            ssm_bytes: 32 * 128 * 128 * 4,
            published: (80e9, 0.5e9),
        },
        // Nemotron-H-8B: pattern of 24 M, 4 *, 24 -. Attention 8 KV heads of 128.
        // Mamba-2: 128 heads of 64 (d_inner 8192), state 128, 8 groups, kernel 4: conv
        // 3 x (8192 + 2x8x128); state 128 x 64 x 128.
        HybridHand {
            file: "nemotron-h-8b.json",
            attention_layers: 4,
            recurrent_layers: 24,
            kv_bytes_per_token: 2 * 4 * 8 * 128 * 2,
            conv_bytes: 3 * (8192 + 2 * 8 * 128) * 2,
            ssm_bytes: 128 * 64 * 128 * 4,
            published: (8e9, 0.5e9),
        },
        // Jamba-1.5-Mini: attention where layer % 8 == 4 (4 of 32), 8 KV heads of
        // 4096/32 = 128. Mamba(-1): d_inner 2 x 4096, state 16, kernel 4: conv 3 x 8192;
        // state 8192 x 16. Published: 52 B total, 12 B active.
        HybridHand {
            file: "jamba-1.5-mini.json",
            attention_layers: 4,
            recurrent_layers: 28,
            kv_bytes_per_token: 2 * 4 * 8 * 128 * 2,
            conv_bytes: 3 * 8192 * 2,
            ssm_bytes: 8192 * 16 * 4,
            published: (52e9, 0.5e9),
        },
        // Granite-4.0-H-Tiny: 4 attention layers of 40 with 4 KV heads of 1536/12 = 128.
        // Mamba-2: 48 heads of 64 (d_inner 3072), state 128, 1 group, kernel 4: conv
        // 3 x (3072 + 2x1x128); state 48 x 64 x 128. Published: 7 B total.
        HybridHand {
            file: "granite-4.0-h-tiny.json",
            attention_layers: 4,
            recurrent_layers: 36,
            kv_bytes_per_token: 2 * 4 * 4 * 128 * 2,
            conv_bytes: 3 * (3072 + 2 * 128) * 2,
            ssm_bytes: 48 * 64 * 128 * 4,
            published: (7e9, 0.5e9),
        },
    ]
}

#[test]
fn hybrid_kv_and_state_bytes_match_the_hand_computation() {
    for hand in hybrid_hands() {
        let mut i = PlanInput::new(data(hand.file), 141 * GIB);
        i.context_tokens = 8192;
        i.concurrency = 4;
        // The defaults: conv state in the model's bf16, SSM state in f32.
        assert_eq!(i.conv_state_dtype, DType::BF16, "{}", hand.file);
        assert_eq!(i.ssm_state_dtype, DType::F32, "{}", hand.file);
        let plan = i.plan().unwrap();
        assert_eq!(
            plan.kv_bytes_per_token, hand.kv_bytes_per_token,
            "{}",
            hand.file
        );
        assert_eq!(
            plan.block_bytes,
            16 * hand.kv_bytes_per_token,
            "{}",
            hand.file
        );
        let st = plan
            .state
            .as_ref()
            .expect("a hybrid plan reports its state");
        assert_eq!(
            (st.attention_layers as u64, st.recurrent_layers as u64),
            (hand.attention_layers, hand.recurrent_layers),
            "{}",
            hand.file
        );
        assert_eq!(st.conv_bytes_per_layer, hand.conv_bytes, "{}", hand.file);
        assert_eq!(st.ssm_bytes_per_layer, hand.ssm_bytes, "{}", hand.file);
        let per_seq = hand.recurrent_layers * (hand.conv_bytes + hand.ssm_bytes);
        assert_eq!(st.bytes_per_sequence, per_seq, "{}", hand.file);
        // The state takes whole pages of the attention block; both limits together.
        let pages = per_seq.div_ceil(plan.block_bytes);
        assert_eq!(st.pages_per_sequence, pages, "{}", hand.file);
        assert_eq!(
            st.waste_bytes_per_sequence,
            pages * plan.block_bytes - per_seq
        );
        assert_eq!(plan.blocks_per_request, 8192 / 16, "{}", hand.file);
        assert_eq!(plan.pages_per_request, 512 + pages, "{}", hand.file);
        assert_eq!(plan.max_concurrency, plan.num_blocks / (512 + pages));
        assert_eq!(st.kv_limited_concurrency, plan.num_blocks / 512);
        assert_eq!(st.state_limited_concurrency, plan.num_blocks / pages);
        assert!(
            plan.max_concurrency < st.kv_limited_concurrency.min(st.state_limited_concurrency) + 1
        );
        let json = plan.to_json();
        assert_eq!(json["state"]["bytes_per_sequence"], per_seq);
        assert!(
            plan.to_string().contains("recurrent state / sequence"),
            "{plan}"
        );

        // The state dtype is a parameter: bf16 halves the SSM state.
        i.ssm_state_dtype = DType::BF16;
        let st = i.plan().unwrap().state.unwrap();
        assert_eq!(st.ssm_bytes_per_layer, hand.ssm_bytes / 2, "{}", hand.file);
    }
    // Written out once: Jamba-1.5-Mini holds 28 x (49,152 + 524,288) = 16,056,320 B of
    // state per sequence, the same as a 980-token context of its KV (16 KiB a token).
    assert_eq!(28 * (3 * 8192 * 2 + 8192 * 16 * 4), 16_056_320);
}

#[test]
fn hybrid_state_splits_under_tensor_parallelism() {
    // Nemotron-H-8B on 2 GPUs: 4 KV heads each; 64 Mamba heads; 8 groups divide by 2,
    // so conv = 3 x (8192 + 2x8x128) / 2.
    let mut i = PlanInput::new(data("nemotron-h-8b.json"), 80 * GIB);
    i.context_tokens = 8192;
    i.tensor_parallel = 2;
    let plan = i.plan().unwrap();
    assert_eq!(plan.kv_bytes_per_token, 2 * 4 * 4 * 128 * 2);
    let st = plan.state.unwrap();
    assert_eq!(st.conv_bytes_per_layer, 3 * (8192 + 2 * 8 * 128) / 2 * 2);
    assert_eq!(st.ssm_bytes_per_layer, 64 * 64 * 128 * 4);
    // Granite-4.0-H-Tiny on 4 GPUs: its one group is replicated on every GPU (vLLM's
    // extra_groups_for_head_shards: 1 group becomes 4), conv = 3 x (3072 + 2x4x128) / 4.
    let mut i = PlanInput::new(data("granite-4.0-h-tiny.json"), 80 * GIB);
    i.context_tokens = 8192;
    i.tensor_parallel = 4;
    let st = i.plan().unwrap().state.unwrap();
    assert_eq!(st.conv_bytes_per_layer, 3 * (3072 + 2 * 4 * 128) / 4 * 2);
    assert_eq!(st.ssm_bytes_per_layer, 12 * 64 * 128 * 4);
    // Qwen3-Next on 3 GPUs: 16 key heads do not split three ways.
    let mut i = PlanInput::new(data("qwen3-next-80b-a3b.json"), 80 * GIB);
    i.tensor_parallel = 3;
    assert!(matches!(i.plan(), Err(Error::UnevenTensorParallel { .. })));
}

#[test]
fn hybrid_parameter_counts_within_the_published_rounding() {
    for hand in hybrid_hands() {
        let total = data(hand.file).param_counts().unwrap().total() as f64;
        let (published, half_unit) = hand.published;
        assert!(
            (total - published).abs() <= half_unit,
            "{}: {total} vs published {published}",
            hand.file
        );
    }
}

#[test]
fn hybrid_kv_cache_groups_hold_attention_layers_only() {
    // Qwen3-Next: one full-attention group of its 12 attention layers (the state is
    // reported by the plan, not as a KV group).
    let g = PlanInput::new(data("qwen3-next-80b-a3b.json"), 80 * GIB)
        .kv_cache_groups()
        .unwrap();
    assert_eq!(
        (g.len(), g[0].window, g[0].layout.shape().num_layers),
        (1, None, 12)
    );
    assert_eq!(g[0].layout.block_bytes(), 16 * 2 * 12 * 2 * 256 * 2);
}

#[test]
fn unknown_layer_types_are_refused_by_name() {
    let qwen_next = include_str!("../data/qwen3-next-80b-a3b.json");
    // A layer list with a type Qwen3-Next does not have.
    let mut types = vec!["\"linear_attention\""; 48];
    types[7] = "\"mamba\"";
    let text = qwen_next.replacen(
        '{',
        &format!("{{\"layer_types\": [{}],", types.join(",")),
        1,
    );
    match ModelSpec::from_json_str(&text) {
        Err(Error::UnknownLayerType {
            model_type,
            layer,
            layer_type,
        }) => assert_eq!(
            (model_type.as_str(), layer, layer_type.as_str()),
            ("qwen3_next", 7, "mamba")
        ),
        other => panic!("expected UnknownLayerType, got {other:?}"),
    }
    // Nemotron-H's `E` (a mixture-of-experts layer) is not one the planner sizes.
    let nemotron = include_str!("../data/nemotron-h-8b.json").replacen("M-M-M-M*", "M-M-M-E*", 1);
    assert!(matches!(
        ModelSpec::from_json_str(&nemotron),
        Err(Error::UnknownLayerType { layer: 6, ref layer_type, .. }) if layer_type == "E"
    ));
    // A dense model naming a linear-attention layer is refused, not planned as dense,
    // and assume_dense cannot reach it: the config does not parse.
    let base = pagedkv::plan::config::builtin::LLAMA3_8B;
    let text = base.replacen(
        '{',
        r#"{"layer_types": ["full_attention", "linear_attention"],"#,
        1,
    );
    let e = ModelSpec::from_json_str(&text).unwrap_err();
    assert!(e.to_string().contains("\"linear_attention\""), "{e}");
    assert!(matches!(e, Error::UnknownLayerType { layer: 1, .. }));
    // A pattern as long as the model, or refused.
    let short = include_str!("../data/nemotron-h-8b.json").replacen("M-M-M-M*", "M-M*", 1);
    assert!(matches!(
        ModelSpec::from_json_str(&short),
        Err(Error::ModelConfig(_))
    ));
}
