//! Every kernel and every specialisation the crate uses (the MLA decode of
//! `kernels/mla_decode.cu` included) compiles under NVRTC for sm_80 and sm_90, to PTX
//! and cubin. Prints registers, spills and shared memory per kernel
//! from ptxas' verbose log.
//!
//! Without NVRTC on the loader path the test prints why it skipped; with
//! `PAGEDKV_REQUIRE_NVRTC=1` (set by `.ci/nvrtc-env`) a missing NVRTC fails it.

use std::io::Write;

use pagedkv::attention::decode_mma::uses_mma;
use pagedkv::executor::cuda::{
    bench_cases, catalog, compile_uncached, nvrtc_present, Arch, KernelSpec,
};

fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc_present() {
        return true;
    }
    let why = "NVRTC (libnvrtc.so) is not on the loader path; `source .ci/nvrtc-env` installs it from PyPI";
    if std::env::var("PAGEDKV_REQUIRE_NVRTC").as_deref() == Ok("1") {
        panic!("{test}: PAGEDKV_REQUIRE_NVRTC=1 but {why}");
    }
    // Straight to the stderr handle: the harness captures `eprintln!` of passing
    // tests, and a skip must be visible in a plain `cargo test`.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    false
}

fn describe(spec: &KernelSpec) -> String {
    match spec {
        KernelSpec::Attention(a) => format!(
            "attention d{} bs{} g{} {} u{} v{}",
            a.head_dim, a.block_size, a.gqa_group, a.dtype, a.unroll, a.vec_bytes
        ),
        KernelSpec::Prefill(p) => format!(
            "prefill d{} bs{} g{} {}",
            p.head_dim, p.block_size, p.gqa_group, p.dtype
        ),
        KernelSpec::CacheOps => "cache_ops".to_string(),
        KernelSpec::Mla(m) => format!(
            "mla r{} p{} bs{} {} h{}",
            m.kv_lora_rank, m.rope_dim, m.block_size, m.dtype, m.heads_per_cta
        ),
    }
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm80_and_sm90") {
        return;
    }
    let specs = catalog();
    println!(
        "{:<5} {:<32} {:<28} {:>5} {:>7} {:>7} {:>6}",
        "arch", "specialisation", "kernel", "regs", "spill>", "spill<", "smem"
    );
    let mut worst_regs = 0;
    for arch in [Arch::SM80, Arch::SM90] {
        for spec in &specs {
            let m = compile_uncached(spec, arch)
                .unwrap_or_else(|e| panic!("{} for {}: {e}", describe(spec), arch.sm()));
            assert!(!m.cubin.is_empty(), "no cubin for {}", describe(spec));
            if let KernelSpec::Attention(a) = spec {
                assert_eq!(
                    m.ptx.contains("mma.sync"),
                    uses_mma(a.dtype, a.gqa_group, a.head_dim, a.block_size),
                    "{}: the compiled decode path is not the one uses_mma sizes for",
                    describe(spec)
                );
            }
            let resources = m.resources();
            for entry in spec.entry_points() {
                assert!(
                    m.ptx.contains(&format!(".entry {entry}")),
                    "{entry} missing from the PTX of {}",
                    describe(spec)
                );
                let r = resources
                    .iter()
                    .find(|r| r.name == entry)
                    .unwrap_or_else(|| panic!("ptxas reported nothing for {entry}:\n{}", m.log));
                assert!(r.registers > 0 && r.registers <= 255, "{r:?}");
                worst_regs = worst_regs.max(r.registers);
                println!(
                    "{:<5} {:<32} {:<28} {:>5} {:>7} {:>7} {:>6}",
                    arch.sm(),
                    describe(spec),
                    entry,
                    r.registers,
                    r.spill_stores,
                    r.spill_loads,
                    r.shared_bytes
                );
            }
        }
    }
    println!(
        "{} modules compiled; most registers per thread: {worst_regs}",
        2 * specs.len()
    );
}

/// Runs without NVRTC: the GPU machine has none, so every decode specialisation
/// `examples/gpu_bench` launches must be a prebuilt cubin. (The GPU tests' fixed
/// cases are checked in their own files, serve's models in
/// examples/serve_gpu/tests.rs.)
#[test]
fn the_benchs_kernels_are_prebuilt() {
    let all = catalog();
    for spec in bench_cases::decode_specs().unwrap() {
        assert!(
            all.contains(&KernelSpec::Attention(spec)),
            "gpu_bench launches {spec:?}, which is not prebuilt"
        );
        assert!(pagedkv::executor::cuda::PREBUILT_ATTENTION.contains(&spec));
    }
}

#[test]
fn a_specialisation_the_kernel_rejects_fails_to_compile_with_the_log() {
    if !nvrtc_or_skip("a_specialisation_the_kernel_rejects_fails_to_compile_with_the_log") {
        return;
    }
    // head_dim 48 in f16 is 96 bytes: 6 vectors, which the host check rejects first.
    let bad = pagedkv::executor::cuda::AttentionSpec {
        head_dim: 48,
        block_size: 16,
        gqa_group: 4,
        dtype: pagedkv::DType::F16,
        unroll: 0,
        vec_bytes: 0,
    };
    let err = compile_uncached(&KernelSpec::Attention(bad), Arch::SM90).unwrap_err();
    assert!(matches!(err, pagedkv::Error::Unsupported(_)), "{err}");
}

#[test]
fn prebuilt_cubins_are_loaded_before_nvrtc() {
    // Runs everywhere: the file is found by name, so NVRTC is never called. The bytes
    // are not a real cubin; loading them into a context is the GPU tests' business.
    let dir = std::env::temp_dir().join(format!("pagedkv-cubins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = KernelSpec::Attention(pagedkv::executor::cuda::AttentionSpec {
        head_dim: 256,
        block_size: 32,
        gqa_group: 2,
        dtype: pagedkv::DType::BF16,
        unroll: 0,
        vec_bytes: 0,
    });
    let arch = Arch { major: 8, minor: 9 };
    std::fs::write(dir.join(spec.cubin_file_name(arch)), b"fake cubin").unwrap();
    std::env::set_var(pagedkv::executor::cuda::CUBIN_DIR_ENV, &dir);
    let m = pagedkv::executor::cuda::compile(&spec, arch).unwrap();
    assert_eq!(m.cubin, b"fake cubin");
    assert!(m.log.contains("prebuilt"));
    // Another specialisation has another name: no stale cubin is ever picked up.
    let other = KernelSpec::Attention(pagedkv::executor::cuda::AttentionSpec {
        head_dim: 128,
        block_size: 32,
        gqa_group: 2,
        dtype: pagedkv::DType::BF16,
        unroll: 0,
        vec_bytes: 0,
    });
    assert_ne!(spec.cubin_file_name(arch), other.cubin_file_name(arch));
    assert_ne!(spec.cubin_file_name(arch), spec.cubin_file_name(Arch::SM90));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn edge_specialisations_the_host_check_accepts_compile() {
    if !nvrtc_or_skip("edge_specialisations_the_host_check_accepts_compile") {
        return;
    }
    use pagedkv::executor::cuda::AttentionSpec;
    use pagedkv::DType;
    let base = AttentionSpec {
        head_dim: 128,
        block_size: 16,
        gqa_group: 1,
        dtype: DType::BF16,
        unroll: 0,
        vec_bytes: 0,
    };
    for spec in [
        AttentionSpec {
            gqa_group: 32,
            ..base
        },
        AttentionSpec {
            head_dim: 256,
            dtype: DType::F32,
            ..base
        },
        AttentionSpec {
            head_dim: 256,
            gqa_group: 16,
            dtype: DType::Fp8E4M3,
            ..base
        },
        AttentionSpec {
            head_dim: 16,
            dtype: DType::Fp8E4M3,
            ..base
        },
        AttentionSpec {
            block_size: 1,
            ..base
        },
        AttentionSpec {
            block_size: 1024,
            unroll: 4,
            vec_bytes: 8,
            ..base
        },
    ] {
        spec.check().unwrap();
        let m = compile_uncached(&KernelSpec::Attention(spec), Arch::SM90).unwrap_or_else(|e| {
            panic!("{spec:?} passed the host check but failed to compile: {e}")
        });
        assert!(!m.cubin.is_empty());
    }
}

/// The host sizes a launch's dynamic shared memory by `uses_mma`; the kernel picks its
/// path by `DECODE_MMA`. Around the small-page limit (a page must hold 32 of a tile's
/// 16-byte chunks: 512 bytes of rows) the PTX holds `mma.sync` exactly where
/// `uses_mma` says, for 64-, 128- and 256-byte rows: the two sides cannot drift apart
/// unnoticed, and the kernel's `static_assert` refuses a tensor-core path with smaller
/// pages.
#[test]
fn the_tensor_core_path_is_compiled_exactly_where_the_host_expects_it() {
    if !nvrtc_or_skip("the_tensor_core_path_is_compiled_exactly_where_the_host_expects_it") {
        return;
    }
    use pagedkv::executor::cuda::AttentionSpec;
    use pagedkv::DType;
    for (dtype, head_dim, block_size, mma) in [
        (DType::BF16, 32, 4, false),
        (DType::BF16, 32, 8, true),
        (DType::Fp8E4M3, 128, 2, false),
        (DType::Fp8E4M3, 128, 4, true),
        (DType::BF16, 128, 1, false),
        (DType::BF16, 128, 2, true),
    ] {
        let spec = AttentionSpec {
            head_dim,
            block_size,
            gqa_group: 8,
            dtype,
            unroll: 0,
            vec_bytes: 0,
        };
        assert_eq!(uses_mma(dtype, 8, head_dim, block_size), mma, "{spec:?}");
        let m = compile_uncached(&KernelSpec::Attention(spec), Arch::SM90)
            .unwrap_or_else(|e| panic!("{spec:?}: {e}"));
        assert_eq!(m.ptx.contains("mma.sync"), mma, "{spec:?}");
    }
}

#[test]
fn prefill_edge_specialisations_the_host_check_accepts_compile() {
    if !nvrtc_or_skip("prefill_edge_specialisations_the_host_check_accepts_compile") {
        return;
    }
    use pagedkv::executor::cuda::PrefillSpec;
    use pagedkv::DType;
    let base = PrefillSpec {
        head_dim: 128,
        block_size: 16,
        gqa_group: 1,
        dtype: DType::BF16,
    };
    for spec in [
        PrefillSpec {
            gqa_group: 16,
            ..base
        },
        PrefillSpec {
            head_dim: 32,
            dtype: DType::Fp8E4M3,
            ..base
        },
        PrefillSpec {
            head_dim: 96,
            gqa_group: 3,
            dtype: DType::F32,
            ..base
        },
        PrefillSpec {
            block_size: 1,
            ..base
        },
    ] {
        spec.check().unwrap();
        let m = compile_uncached(&KernelSpec::Prefill(spec), Arch::SM90).unwrap_or_else(|e| {
            panic!("{spec:?} passed the host check but failed to compile: {e}")
        });
        assert!(!m.cubin.is_empty());
    }
    for bad in [
        PrefillSpec {
            head_dim: 100,
            ..base
        },
        PrefillSpec {
            head_dim: 256,
            ..base
        },
        PrefillSpec {
            gqa_group: 0,
            ..base
        },
        PrefillSpec {
            gqa_group: 32,
            ..base
        },
    ] {
        assert!(bad.check().is_err(), "{bad:?}");
    }
}
