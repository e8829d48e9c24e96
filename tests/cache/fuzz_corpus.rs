//! Replays the fuzz corpora as regular tests (the coverage-guided fuzzer needs
//! `cargo fuzz`; see `fuzz/README.md`), plus seeded random inputs so the harnesses run
//! even where no corpus is checked out.

use crate::support::fuzz_export;
use crate::support::fuzz_gguf;
use crate::support::fuzz_manager;
use crate::support::fuzz_plan;
use crate::support::fuzz_tables;

use rayon::prelude::*;

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
    // The longest test of its binary (1,500 inputs): spread over the threads rayon has,
    // each input still replayed alone and whole.
    let all: Vec<Vec<u8>> = inputs
        .into_iter()
        .chain(random_inputs(1, 64, 600))
        .collect();
    all.par_iter().for_each(|input| fuzz_manager::run(input));
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

/// Inputs of `target`: its corpus, the harness's own seeds, and each seed truncated at a
/// few points and with single bytes flipped (deterministic, so a failure reproduces).
fn with_mutations(target: &str, seeds: Vec<Vec<u8>>, seed: u64) -> Vec<Vec<u8>> {
    let mut inputs = corpus(target);
    let flips = random_inputs(seed, seeds.len() * 8, 4);
    for (i, s) in seeds.iter().enumerate() {
        for cut in [1, s.len() / 3, s.len() / 2, s.len().saturating_sub(1)] {
            inputs.push(s[..cut.min(s.len())].to_vec());
        }
        for r in &flips[i * 8..i * 8 + 8] {
            let mut m = s.clone();
            if m.len() > 1 {
                let at = 1 + (usize::from(r[0]) << 8 | usize::from(r[1])) % (m.len() - 1);
                m[at] ^= r[2] | 1;
                m[0] = r[3] & 3;
                inputs.push(m);
            }
        }
    }
    inputs.extend(seeds);
    inputs
}

/// The GGUF reader (`fuzz/fuzz_targets/gguf.rs`).
#[test]
fn gguf_corpus_seeds_and_mutations() {
    for s in fuzz_gguf::seeds() {
        let f = pagedkv::plan::gguf::GgufFile::parse(&s).expect("a seed parses");
        f.model_info(pagedkv::DType::F16)
            .expect("a seed gives a config");
    }
    let inputs = with_mutations("gguf", fuzz_gguf::seeds(), 5);
    println!("replaying {} gguf inputs", inputs.len());
    for input in inputs.iter().chain(&random_inputs(6, 256, 64)) {
        fuzz_gguf::run(input);
    }
}

/// Single KV exports (`fuzz/fuzz_targets/export.rs`): the seeds import, the mutations
/// are refused changing nothing or import byte-exact.
#[test]
fn export_corpus_seeds_and_mutations() {
    let seeds = fuzz_export::single_seeds();
    let imported: Vec<bool> = seeds.iter().map(|s| fuzz_export::run_single(s)).collect();
    // The receiver's shape at 7 sender block sizes, each as written and repaired, import;
    // the other dtype, head count, layer count and the latent layout are refused.
    assert_eq!(
        imported.iter().filter(|&&ok| ok).count(),
        14,
        "{imported:?}"
    );
    let inputs = with_mutations("export", seeds, 7);
    println!("replaying {} export inputs", inputs.len());
    let accepted = inputs.iter().filter(|i| fuzz_export::run_single(i)).count();
    println!("{accepted} imported");
}

/// Group exports (`fuzz/fuzz_targets/group_export.rs`).
#[test]
fn group_export_corpus_seeds_and_mutations() {
    let seeds = fuzz_export::group_seeds();
    let imported: Vec<bool> = seeds.iter().map(|s| fuzz_export::run_group(s)).collect();
    // Four sequences import directly; through the prefix caches, all but the one with
    // window holes and ids (refused, as documented); the one-group export is refused.
    assert_eq!(imported.iter().filter(|&&ok| ok).count(), 7, "{imported:?}");
    let inputs = with_mutations("group_export", seeds, 8);
    println!("replaying {} group_export inputs", inputs.len());
    let accepted = inputs.iter().filter(|i| fuzz_export::run_group(i)).count();
    println!("{accepted} imported");
}

/// Writes the harnesses' seeds into `fuzz/corpus/<target>/seed-N`, where `cargo fuzz`
/// starts from them: `cargo test --test cache -- --ignored write_seed_corpora`.
#[test]
#[ignore = "writes files; run once when the seeds change"]
fn write_seed_corpora() {
    for (target, seeds) in [
        ("gguf", fuzz_gguf::seeds()),
        ("export", fuzz_export::single_seeds()),
        ("group_export", fuzz_export::group_seeds()),
    ] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, s) in seeds.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), s).unwrap();
        }
    }
}
