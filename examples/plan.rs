//! Capacity planner CLI: how many KV blocks, tokens and concurrent requests a model
//! gets on a GPU, and what to change when the target does not fit.
//!
//! ```text
//! cargo run --release --example plan -- --model llama3-8b --gpu-gib 80 --context 8192 --concurrency 32
//! cargo run --release --example plan -- --model path/to/config.json --weights int4 --tp 2 --json
//! cargo run --release --example plan -- --model qwen2.5-7b --context 32768 --sweep
//! cargo run --release --example plan -- --model tests/data/mixtral-8x7b.json --tp 2
//! cargo run --release --example plan -- --model tests/data/jamba-1.5-mini.json --context 32768 --ssm-state-dtype bf16
//! ```
//!
//! Exits with status 0 when the target fits (every line fits, for a sweep), 1 when it
//! does not, 2 on invalid input.

use std::process::ExitCode;

use clap::Parser;
use pagedkv::plan::{ModelSpec, Plan, PlanInput, WeightPrecision, GIB};
use pagedkv::DType;

#[derive(Parser, Debug)]
#[command(about = "KV-cache capacity planner for pagedkv")]
struct Args {
    /// Built-in model (llama3-8b, qwen2.5-7b, llama3-70b) or a path to a config.json.
    #[arg(long, short)]
    model: String,
    /// Weight precision: fp32, fp16, bf16, int8, fp8, int4 (group 128), int4-gN,
    /// int4zp-gN, fp8-bRxC, nf4, nf4-dq or mxfp4 (default: the config's
    /// quantization_config, else 16-bit). Overrides the config for every linear layer.
    #[arg(long)]
    weights: Option<String>,
    /// Plan a config with fields the planner does not understand (experts of an
    /// unknown architecture, unknown quantization) as the dense model its other fields
    /// describe, instead of refusing; the output says so.
    #[arg(long)]
    assume_dense: bool,
    /// KV-cache dtype: f32, f16, bf16, fp8.
    #[arg(long, default_value = "bf16")]
    kv_dtype: String,
    /// Hybrid models: dtype of the recurrent layers' SSM state (default: the config's
    /// mamba_ssm_cache_dtype, else f32).
    #[arg(long)]
    ssm_state_dtype: Option<String>,
    /// Hybrid models: dtype of the recurrent layers' conv state (default: the model's).
    #[arg(long)]
    conv_state_dtype: Option<String>,
    /// Memory of one GPU, GiB.
    #[arg(long, default_value_t = 80.0)]
    gpu_gib: f64,
    /// Fraction of GPU memory the engine may use (vLLM's gpu_memory_utilization).
    #[arg(long, default_value_t = 0.9)]
    util: f64,
    /// Reserve for activations and workspace, GiB (default: estimated from the shape).
    #[arg(long)]
    reserve_gib: Option<f64>,
    /// Tokens per forward pass, for the reserve estimate.
    #[arg(long, default_value_t = pagedkv::plan::DEFAULT_MAX_BATCH_TOKENS)]
    max_batch_tokens: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Tokens per request (default: the model's max_position_embeddings).
    #[arg(long)]
    context: Option<usize>,
    /// Requests of `context` tokens that must run at once.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// One line per GPU size (24, 48, 80, 141 GiB) and KV dtype instead of one table.
    #[arg(long)]
    sweep: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn input(args: &Args) -> pagedkv::Result<PlanInput> {
    let model = ModelSpec::resolve(&args.model)?;
    let mut input = PlanInput::new(model, 0);
    input.set_gpu_memory_gib(args.gpu_gib)?;
    if let Some(weights) = &args.weights {
        input.weight_precision = WeightPrecision::parse(weights)?;
        input.attention_precision = None;
    }
    input.assume_dense = args.assume_dense;
    input.kv_dtype = DType::parse(&args.kv_dtype)?;
    if let Some(d) = &args.ssm_state_dtype {
        input.ssm_state_dtype = DType::parse(d)?;
    }
    if let Some(d) = &args.conv_state_dtype {
        input.conv_state_dtype = DType::parse(d)?;
    }
    input.gpu_memory_utilization = args.util;
    if let Some(gib) = args.reserve_gib {
        if !(gib.is_finite() && gib >= 0.0) {
            return Err(pagedkv::Error::OutOfRange {
                field: "reserve_gib",
                value: gib,
                allowed: "a non-negative number of GiB",
            });
        }
        input.reserve_bytes = Some((gib * GIB as f64) as u64);
    }
    input.max_batch_tokens = args.max_batch_tokens;
    input.block_size = args.block_size;
    if let Some(context) = args.context {
        input.context_tokens = context;
    }
    input.concurrency = args.concurrency;
    input.tensor_parallel = args.tp;
    Ok(input)
}

fn run(args: &Args) -> pagedkv::Result<bool> {
    let input = input(args)?;
    let plans: Vec<Plan> = if args.sweep {
        input.sweep()?
    } else {
        vec![input.plan()?]
    };
    if args.json {
        let value = if args.sweep {
            serde_json::Value::Array(plans.iter().map(Plan::to_json).collect())
        } else {
            plans[0].to_json()
        };
        println!("{value:#}");
    } else if args.sweep {
        let p = &plans[0];
        println!(
            "{}: weights {}, tp {}, {} requests x {} tokens, utilisation {}",
            p.model,
            p.weight_precision,
            p.tensor_parallel,
            p.concurrency,
            p.context_tokens,
            p.gpu_memory_utilization
        );
        for note in &p.notes {
            println!("note: {note}");
        }
        println!("{}", Plan::SWEEP_HEADER);
        for p in &plans {
            println!("{}", p.sweep_line());
        }
    } else {
        print!("{}", plans[0]);
    }
    Ok(plans.iter().all(|p| p.verdict.fits()))
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
