//! A Gemma-3-like hybrid model (5 sliding-window layers of window 1,024 per global
//! layer) on one KV byte budget, three ways: every layer full; KV-cache groups
//! (`KvCache::hybrid`: one full and five window groups of 8 layers sharing one arena of
//! pages); and two managers on a fixed split of the budget (global layers / window
//! layers, split by what one request holds in each at the end).
//!
//! Every request has the same prompt (`--prompt`) and output (`--output`); all arrive
//! at once; the scheduler is `serve --hybrid`'s (admit in order above a 1 % watermark,
//! one decode token per running request per step, preempt the newest by recompute when
//! an append finds no memory).
//!
//! `cargo run --release --example hybrid [-- --prompt 4000 --output 1000 --budget-gib 8 --requests 64]`

#[allow(dead_code)] // `serve --hybrid`'s entry point and trace are not used here
#[path = "serve_hybrid/mod.rs"]
mod hybrid;

use hybrid::{serve, AllFull, Groups, Request, Split, BLOCK, GLOBAL_EVERY, LAYERS, WINDOW};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (p, o) = (arg("--prompt", 4000), arg("--output", 1000));
    let budget = arg("--budget-gib", 8) as u64 * (1 << 30);
    let requests = arg("--requests", 64);
    let trace: Vec<Request> = (0..requests)
        .map(|_| Request {
            arrival: 0,
            prompt: p,
            output: o,
        })
        .collect();
    let share = Split::share_for(&trace);
    let full = serve(&mut AllFull::new(budget)?, &trace)?;
    let mut g = Groups::new(budget)?;
    let groups = serve(&mut g, &trace)?;
    g.kv.check_invariants()?;
    let split = serve(&mut Split::new(budget, share)?, &trace)?;

    println!(
        "Gemma-3-like: {LAYERS} layers ({} window {WINDOW}, {} global), 8 KV heads x 256, \
         bf16, block {BLOCK}; prompt {p} + output {o} tokens; budget {} GiB; {requests} requests",
        LAYERS - LAYERS / GLOBAL_EVERY,
        LAYERS / GLOBAL_EVERY,
        budget >> 30
    );
    println!(
        "{:<30}{:>12}{:>12}{:>12}",
        "", "all full", "groups", "split"
    );
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let runs = [&full, &groups, &split];
    let row = |label: &str, f: &dyn Fn(&hybrid::Outcome) -> String| {
        println!(
            "{label:<30}{:>12}{:>12}{:>12}",
            f(runs[0]),
            f(runs[1]),
            f(runs[2])
        );
    };
    row("peak concurrency", &|r| r.peak_running.to_string());
    row("peak KV MiB held", &|r| {
        format!("{:.0}", mib(r.peak_bytes as f64))
    });
    row("KV MiB per running request", &|r| {
        format!("{:.0}", mib(r.bytes_per_running))
    });
    row("decode steps for all", &|r| r.steps.to_string());
    row("preemptions (recompute)", &|r| r.preemptions.to_string());
    println!(
        "split: global layers get {:.1} % of the budget; groups moved {} pages between groups",
        share * 100.0,
        g.kv.group_stats().page_moves
    );
    for r in runs {
        if r.finished != requests {
            return Err(format!("{} of {requests} finished", r.finished).into());
        }
    }
    Ok(())
}
