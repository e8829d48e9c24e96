//! Replays the fuzz corpora as regular tests (the coverage-guided fuzzer needs
//! `cargo fuzz`; see `fuzz/README.md`), plus seeded random inputs so the harnesses run
//! even where no corpus is checked out.

#[path = "common/fuzz_manager.rs"]
mod fuzz_manager;
#[path = "common/fuzz_plan.rs"]
mod fuzz_plan;
#[path = "common/fuzz_tables.rs"]
mod fuzz_tables;

use std::path::Path;

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let mut inputs = Vec::new();
    for dir in ["corpus", "regressions"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz")
            .join(dir)
            .join(target);
        if let Ok(entries) = std::fs::read_dir(&path) {
            for e in entries.flatten() {
                if let Ok(bytes) = std::fs::read(e.path()) {
                    inputs.push(bytes);
                }
            }
        }
    }
    inputs
}

fn random_inputs(seed: u64, count: usize, len: usize) -> Vec<Vec<u8>> {
    let mut s = seed;
    (0..count)
        .map(|_| {
            (0..len)
                .map(|_| {
                    s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let z = (s ^ (s >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    (z >> 56) as u8
                })
                .collect()
        })
        .collect()
}

#[test]
fn manager_corpus_and_random_inputs() {
    let inputs = corpus("manager");
    println!("replaying {} manager corpus inputs", inputs.len());
    for input in inputs.iter().chain(&random_inputs(1, 64, 600)) {
        fuzz_manager::run(input);
    }
}

#[test]
fn config_json_corpus_never_panics() {
    let mut inputs = corpus("config_json");
    inputs.extend(random_inputs(2, 256, 64));
    // Mutations of a real config: truncations and byte flips.
    let base = pagedkv::plan::config::builtin::LLAMA3_8B.as_bytes();
    for cut in (0..base.len()).step_by(7) {
        inputs.push(base[..cut].to_vec());
    }
    for (i, r) in random_inputs(3, 128, 2).iter().enumerate() {
        let mut m = base.to_vec();
        let at = (i * 13) % m.len();
        m[at] ^= r[0] | 1;
        inputs.push(m);
    }
    for input in &inputs {
        if let Ok(text) = std::str::from_utf8(input) {
            if let Ok(c) = pagedkv::ModelConfig::from_json_str(text) {
                c.shape
                    .validate()
                    .expect("an accepted config has a valid shape");
            }
        }
    }
}

#[test]
fn block_tables_corpus_and_random_inputs() {
    let inputs = corpus("block_tables");
    println!("replaying {} block_tables corpus inputs", inputs.len());
    for input in inputs.iter().chain(&random_inputs(4, 2_000, 96)) {
        fuzz_tables::run(input);
    }
}

/// The planner and the contiguous attention entry point under arbitrary numbers (the
/// test profile checks overflow, so a wrapping size panics here).
#[test]
fn planner_corpus_and_random_inputs() {
    let inputs = corpus("planner");
    println!("replaying {} planner corpus inputs", inputs.len());
    for input in inputs.iter().chain(&random_inputs(4, 4096, 96)) {
        fuzz_plan::run(input);
    }
}
