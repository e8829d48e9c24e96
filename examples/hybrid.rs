//! A Gemma-3-like hybrid model (5 sliding-window layers of window 1,024 per global
//! layer) against the same model with every layer full, on the same KV byte budget.
//!
//! The hybrid cache is two managers (two KV-cache groups): the global layers' group
//! holds every token, the local layers' group is built with
//! `CacheBuilder::sliding_window` and gives back blocks that fell out of the window.
//! The byte budget is split between the two arenas in proportion to what one request
//! holds in each at its full context. Requests (prompt `--prompt`, output `--output`
//! tokens) are admitted while both groups can hold a new one; every step decodes one
//! token for each running request.
//!
//! `cargo run --release --example hybrid [-- --prompt 4000 --output 1000 --budget-gib 8]`

use pagedkv::{CopyPlan, DType, KvCacheManager, KvLayout, ModelShape, SeqId};

const LAYERS: usize = 48;
const GLOBAL_EVERY: usize = 6; // 5 local : 1 global
const WINDOW: usize = 1024;
const BLOCK: usize = 16;

fn shape(layers: usize) -> ModelShape {
    // Gemma-3-12B-like: 8 KV heads of 256, bf16.
    ModelShape {
        num_layers: layers,
        num_q_heads: 16,
        num_kv_heads: 8,
        head_dim: 256,
        kv_dtype: DType::BF16,
    }
}

struct Run {
    peak_running: usize,
    peak_bytes: u64,
    finished: usize,
    steps: usize,
}

/// Serves `requests` requests over `groups` (manager, block bytes, the most blocks
/// a running request holds after its first decode step). A request is admitted when
/// every group has room for its prompt plus one block, beyond what the running ones
/// may still grow to.
fn serve(groups: &mut [(KvCacheManager, u64, usize)], requests: usize, p: usize, o: usize) -> Run {
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    let mut running: Vec<(SeqId, usize)> = Vec::new();
    let (mut next, mut finished, mut steps) = (0u64, 0, 0);
    let (mut peak_running, mut peak_bytes) = (0, 0u64);
    while finished < requests {
        let fits = |groups: &[(KvCacheManager, u64, usize)], running: &[(SeqId, usize)]| {
            groups.iter().all(|(kv, _, most)| {
                let growth: usize = running
                    .iter()
                    .map(|(id, _)| {
                        let held = kv
                            .block_table(*id)
                            .map(|t| {
                                t.iter()
                                    .filter(|&&b| b != pagedkv::BlockId::RELEASED)
                                    .count()
                            })
                            .unwrap_or(0);
                        most.saturating_sub(held) + 1
                    })
                    .sum();
                kv.num_available_blocks() > growth + p.div_ceil(BLOCK)
            })
        };
        while (next as usize) < requests && fits(groups, &running) {
            for (kv, _, _) in groups.iter_mut() {
                kv.admit(SeqId(next), p, &mut slots)
                    .expect("checked by can_admit");
            }
            running.push((SeqId(next), 0));
            next += 1;
        }
        assert!(!running.is_empty(), "one request does not fit the budget");
        for (id, done) in &mut running {
            for (kv, _, _) in groups.iter_mut() {
                kv.append(*id, 1, &mut slots, &mut copies)
                    .expect("reserved at admission");
            }
            *done += 1;
        }
        steps += 1;
        peak_running = peak_running.max(running.len());
        let bytes: u64 = groups
            .iter()
            .map(|(kv, bb, _)| kv.stats().used_blocks as u64 * bb)
            .sum();
        peak_bytes = peak_bytes.max(bytes);
        running.retain(|&(id, done)| {
            if done < o {
                return true;
            }
            for (kv, _, _) in groups.iter_mut() {
                kv.free(id).expect("running");
            }
            finished += 1;
            false
        });
    }
    Run {
        peak_running,
        peak_bytes,
        finished,
        steps,
    }
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> pagedkv::Result<()> {
    let (p, o) = (arg("--prompt", 4000), arg("--output", 1000));
    let budget = arg("--budget-gib", 8) as u64 * (1 << 30);
    let requests = arg("--requests", 64);
    let global = LAYERS / GLOBAL_EVERY;
    let local = LAYERS - global;
    let ctx = p + o;

    // Every layer full.
    let all = KvLayout::new(shape(LAYERS), BLOCK)?;
    let all_bb = all.block_bytes() as u64;
    let full_kv = KvCacheManager::builder(all)
        .num_blocks((budget / all_bb) as usize)
        .watermark_blocks(0)
        .build()?;
    let mut one = [(full_kv, all_bb, ctx.div_ceil(BLOCK))];
    let a = serve(&mut one, requests, p, o);

    // Hybrid: two groups, the budget split by what one request holds in each.
    let gl = KvLayout::new(shape(global), BLOCK)?;
    let lo = KvLayout::new(shape(local), BLOCK)?;
    let (g_bb, l_bb) = (gl.block_bytes() as u64, lo.block_bytes() as u64);
    let g_req = ctx.div_ceil(BLOCK) as u64 * g_bb;
    // The window group holds the whole prompt for its prefill step, then the window.
    let l_need = p + 1;
    // Only the split uses the prompt: the admission check below is dynamic.
    let l_req = (l_need.div_ceil(BLOCK).max(WINDOW.div_ceil(BLOCK) + 1)) as u64 * l_bb;
    let g_budget = budget * g_req / (g_req + l_req);
    let global_kv = KvCacheManager::builder(gl)
        .num_blocks((g_budget / g_bb) as usize)
        .watermark_blocks(0)
        .build()?;
    let local_kv = KvCacheManager::builder(lo)
        .num_blocks(((budget - g_budget) / l_bb) as usize)
        .watermark_blocks(0)
        .sliding_window(WINDOW)
        .build()?;
    let mut two = [
        (global_kv, g_bb, ctx.div_ceil(BLOCK)),
        (local_kv, l_bb, WINDOW.div_ceil(BLOCK) + 1),
    ];
    let h = serve(&mut two, requests, p, o);

    let per_req_full = LAYERS as u64 * ctx.div_ceil(BLOCK) as u64 * all_bb / LAYERS as u64;
    let per_req_hybrid = g_req + (WINDOW.div_ceil(BLOCK) + 1) as u64 * l_bb;
    println!(
        "Gemma-3-like: {LAYERS} layers ({local} local of window {WINDOW}, {global} global), \
         8 KV heads x 256, bf16, block {BLOCK}; prompt {p} + output {o} tokens; \
         budget {} GiB; {requests} requests",
        budget >> 30
    );
    println!("                          all layers full      hybrid (window freeing)");
    println!(
        "KV bytes / request (end)  {:>10.1} MiB       {:>10.1} MiB",
        per_req_full as f64 / (1 << 20) as f64,
        per_req_hybrid as f64 / (1 << 20) as f64
    );
    println!(
        "peak KV bytes held        {:>10.1} MiB       {:>10.1} MiB",
        a.peak_bytes as f64 / (1 << 20) as f64,
        h.peak_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "peak concurrency          {:>10}           {:>10}",
        a.peak_running, h.peak_running
    );
    println!(
        "decode steps for all      {:>10}           {:>10}",
        a.steps, h.steps
    );
    assert_eq!((a.finished, h.finished), (requests, requests));
    Ok(())
}
