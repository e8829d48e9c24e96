//! Compiling `kernels/*.cu` with NVRTC, once per process per specialisation.

use crate::error::{Error, Result};
use crate::layout::shape::DType;
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::{Arc, OnceLock};

const COMMON_SRC: &str = include_str!("../../../kernels/common.cuh");
const ATTENTION_SRC: &str = include_str!("../../../kernels/paged_attention.cu");
const CACHE_OPS_SRC: &str = include_str!("../../../kernels/cache_ops.cu");
const PREFILL_SRC: &str = include_str!("../../../kernels/paged_prefill.cu");
const MLA_SRC: &str = include_str!("../../../kernels/mla_decode.cu");

/// Threads per CTA of the attention kernels (the `NUM_THREADS` define).
pub const ATTENTION_THREADS: u32 = 128;

/// A compute capability, e.g. `Arch { major: 9, minor: 0 }` for sm_90.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl Arch {
    /// sm_80 (A100), the oldest target pagedkv compiles for.
    pub const SM80: Arch = Arch { major: 8, minor: 0 };
    /// sm_90 (H100, H200).
    pub const SM90: Arch = Arch { major: 9, minor: 0 };

    /// `sm_XY`.
    pub fn sm(&self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }
}

/// One specialisation of the attention kernels (`paged_attention_decode` and
/// `paged_attention_merge`), fixed at compile time by `-D` defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionSpec {
    /// Elements per head; `head_dim * dtype bytes` must be a multiple of 16.
    pub head_dim: usize,
    /// Tokens per page.
    pub block_size: usize,
    /// Query heads per KV head.
    pub gqa_group: usize,
    /// Cache dtype.
    pub dtype: DType,
    /// Tokens each token group keeps in flight per iteration (the `UNROLL` define);
    /// 0 leaves the kernel's default (2, or 1 when the accumulators are large).
    pub unroll: u32,
    /// Bytes per vector load (the `VEC_BYTES` define), 8 or 16; 0 leaves the kernel's
    /// default (16, or 8 for fp8 when 16 elements per lane times the group exceed 128
    /// accumulators, which would spill).
    pub vec_bytes: u32,
}

impl AttentionSpec {
    /// The specialisation of one cache shape with the kernel's default unroll and
    /// vector width.
    pub const fn decode(
        dtype: DType,
        head_dim: usize,
        gqa_group: usize,
        block_size: usize,
    ) -> Self {
        AttentionSpec {
            head_dim,
            block_size,
            gqa_group,
            dtype,
            unroll: 0,
            vec_bytes: 0,
        }
    }

    /// The specialisation for `layout`, with the default unroll.
    pub fn for_layout(layout: &crate::layout::KvLayout) -> Self {
        let shape = layout.shape();
        AttentionSpec {
            head_dim: shape.head_dim,
            block_size: layout.block_size(),
            gqa_group: shape.group_size(),
            dtype: shape.kv_dtype,
            unroll: 0,
            vec_bytes: 0,
        }
    }

    /// Checks what the kernel's `static_assert`s would reject, before compiling.
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the field.
    pub fn check(&self) -> Result<()> {
        let head_bytes = self.head_dim * self.dtype.size_bytes();
        let vec_elems = 16 / self.dtype.size_bytes();
        let vecs = self.head_dim / vec_elems.max(1);
        if !head_bytes.is_multiple_of(16)
            || vecs == 0
            || !(vecs.is_power_of_two() || vecs.is_multiple_of(32))
        {
            return Err(Error::Unsupported(format!(
                "CUDA attention needs head_dim * dtype bytes a power-of-two number of 16-byte \
                 vectors (or a multiple of 32 of them); head_dim {} in {} is {head_bytes} bytes",
                self.head_dim, self.dtype
            )));
        }
        if self.gqa_group == 0 || self.gqa_group > 64 {
            return Err(Error::Unsupported(format!(
                "CUDA attention supports GQA groups of 1..=64 query heads, not {}",
                self.gqa_group
            )));
        }
        // q and the output accumulators live in static shared memory (2 x group x
        // head_dim floats), which the 48 KiB static limit bounds.
        if 8 * self.gqa_group * self.head_dim > 40 * 1024 {
            return Err(Error::Unsupported(format!(
                "GQA group {} x head_dim {} needs {} bytes of shared memory; the kernel takes at most 40 KiB",
                self.gqa_group,
                self.head_dim,
                8 * self.gqa_group * self.head_dim
            )));
        }
        if !matches!(self.vec_bytes, 0 | 8 | 16) {
            return Err(Error::Unsupported(format!(
                "vector loads of {} bytes (0 = default, 8 or 16)",
                self.vec_bytes
            )));
        }
        if self.unroll > 4 {
            return Err(Error::Unsupported(format!(
                "unroll {} (0 = default, at most 4)",
                self.unroll
            )));
        }
        if self.block_size == 0 || self.block_size > crate::layout::MAX_BLOCK_SIZE {
            return Err(Error::Unsupported(format!(
                "block size {} out of range",
                self.block_size
            )));
        }
        Ok(())
    }
}

/// One specialisation of the MLA decode kernels (`mla_decode` and `mla_decode_merge`
/// in `kernels/mla_decode.cu`), over a latent cache
/// ([`crate::layout::shape::KvKind::Latent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MlaSpec {
    /// Latent elements that are also the values (512 for DeepSeek-V3).
    pub kv_lora_rank: usize,
    /// Roped key elements after them (64).
    pub rope_dim: usize,
    /// Tokens per page.
    pub block_size: usize,
    /// Cache dtype.
    pub dtype: DType,
    /// Query heads per CTA, one warp each.
    pub heads_per_cta: usize,
}

impl MlaSpec {
    /// Checks what the kernel's `static_assert`s would reject, before compiling.
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the field.
    pub fn check(&self) -> Result<()> {
        let latent = self.kv_lora_rank + self.rope_dim;
        if self.kv_lora_rank == 0
            || !self.kv_lora_rank.is_multiple_of(32)
            || !latent.is_multiple_of(32)
        {
            return Err(Error::Unsupported(format!(
                "MLA decode needs kv_lora_rank and kv_lora_rank + rope_dim multiples of 32 (one slice per lane), not {} and {latent}",
                self.kv_lora_rank
            )));
        }
        if self.block_size == 0 || self.block_size > crate::layout::MAX_BLOCK_SIZE {
            return Err(Error::Unsupported(format!(
                "block size {} out of range",
                self.block_size
            )));
        }
        let page = self.block_size * latent * self.dtype.size_bytes();
        if !page.is_multiple_of(16) || page > 40 * 1024 {
            return Err(Error::Unsupported(format!(
                "a page of {} latents of {latent} in {} is {page} bytes; the kernel stages whole 16-byte vectors in at most 40 KiB of shared memory",
                self.block_size, self.dtype
            )));
        }
        if !(1..=32).contains(&self.heads_per_cta) {
            return Err(Error::Unsupported(format!(
                "{} heads per CTA (1..=32, one warp each)",
                self.heads_per_cta
            )));
        }
        Ok(())
    }
}

/// Warps per CTA of `paged_prefill` (the kernel's `NUM_WARPS` default).
pub const PREFILL_WARPS: u32 = 4;

/// One specialisation of `kernels/paged_prefill.cu` (`paged_prefill`): variable-length
/// query chunks over the block tables, causal within the chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefillSpec {
    /// Elements per head; a multiple of 32, at most 128.
    pub head_dim: usize,
    /// Tokens per page.
    pub block_size: usize,
    /// Query heads per KV head.
    pub gqa_group: usize,
    /// Cache dtype.
    pub dtype: DType,
}

impl PrefillSpec {
    /// The specialisation for `layout`.
    pub fn for_layout(layout: &crate::layout::KvLayout) -> Self {
        let shape = layout.shape();
        PrefillSpec {
            head_dim: shape.head_dim,
            block_size: layout.block_size(),
            gqa_group: shape.group_size(),
            dtype: shape.kv_dtype,
        }
    }

    /// Query tokens per CTA (the kernel's `Q_TILE`): 16 query rows per CTA in all.
    pub fn q_tile(&self) -> usize {
        (16 / self.gqa_group.max(1)).max(1)
    }

    /// Keys per shared-memory tile (the kernel's `KV_TILE`).
    pub fn kv_tile(&self) -> usize {
        if self.head_dim > 128 {
            16
        } else {
            32
        }
    }

    /// Static shared memory of one CTA, in bytes (q rows, padded K tile, V tile, f32).
    pub fn shared_bytes(&self) -> usize {
        let rows = self.q_tile() * self.gqa_group;
        4 * (rows * self.head_dim + self.kv_tile() * (2 * self.head_dim + 1))
    }

    /// Checks what the kernel's `static_assert`s would reject, before compiling.
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the field.
    pub fn check(&self) -> Result<()> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(32) || self.head_dim > 128 {
            return Err(Error::Unsupported(format!(
                "CUDA prefill needs head_dim a multiple of 32 up to 128, not {}",
                self.head_dim
            )));
        }
        if self.gqa_group == 0 || self.shared_bytes() > 48 * 1024 {
            return Err(Error::Unsupported(format!(
                "CUDA prefill with GQA group {} at head_dim {} needs {} bytes of static shared \
                 memory (at most 48 KiB)",
                self.gqa_group,
                self.head_dim,
                self.shared_bytes()
            )));
        }
        if self.block_size == 0 || self.block_size > crate::layout::MAX_BLOCK_SIZE {
            return Err(Error::Unsupported(format!(
                "block size {} out of range",
                self.block_size
            )));
        }
        Ok(())
    }
}

/// A kernel module: which source and which specialisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelSpec {
    /// `kernels/paged_attention.cu` with its defines.
    Attention(AttentionSpec),
    /// `kernels/cache_ops.cu`: `copy_blocks` and every `reshape_and_cache_<in>_<cache>`.
    CacheOps,
    /// `kernels/paged_prefill.cu` with its defines.
    Prefill(PrefillSpec),
    /// `kernels/mla_decode.cu` with its defines.
    Mla(MlaSpec),
}

/// The dtype code the kernels use (see `kernels/common.cuh`).
pub(crate) const fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Fp8E4M3 => 3,
    }
}

impl KernelSpec {
    /// The full source handed to NVRTC (`common.cuh` prepended).
    pub fn source(&self) -> String {
        let body = match self {
            KernelSpec::Prefill(_) => PREFILL_SRC,
            KernelSpec::Attention(_) => ATTENTION_SRC,
            KernelSpec::CacheOps => CACHE_OPS_SRC,
            KernelSpec::Mla(_) => MLA_SRC,
        };
        format!("{COMMON_SRC}\n{body}")
    }

    /// File name shown in compiler messages.
    pub fn file_name(&self) -> &'static str {
        match self {
            KernelSpec::Prefill(_) => "paged_prefill.cu",
            KernelSpec::Attention(_) => "paged_attention.cu",
            KernelSpec::CacheOps => "cache_ops.cu",
            KernelSpec::Mla(_) => "mla_decode.cu",
        }
    }

    /// The `-D` options of this specialisation.
    pub fn defines(&self) -> Vec<String> {
        match self {
            KernelSpec::Attention(a) => {
                let mut d = vec![
                    format!("-DHEAD_DIM={}", a.head_dim),
                    format!("-DBLOCK_SIZE={}", a.block_size),
                    format!("-DGQA_GROUP={}", a.gqa_group),
                    format!("-DKV_DTYPE={}", dtype_code(a.dtype)),
                    format!("-DNUM_THREADS={ATTENTION_THREADS}"),
                ];
                if a.unroll > 0 {
                    d.push(format!("-DUNROLL={}", a.unroll));
                }
                if a.vec_bytes > 0 {
                    d.push(format!("-DVEC_BYTES={}", a.vec_bytes));
                }
                d
            }
            KernelSpec::Prefill(p) => vec![
                format!("-DHEAD_DIM={}", p.head_dim),
                format!("-DBLOCK_SIZE={}", p.block_size),
                format!("-DGQA_GROUP={}", p.gqa_group),
                format!("-DKV_DTYPE={}", dtype_code(p.dtype)),
                format!("-DNUM_WARPS={PREFILL_WARPS}"),
            ],
            KernelSpec::CacheOps => Vec::new(),
            KernelSpec::Mla(m) => vec![
                format!("-DKV_LORA_RANK={}", m.kv_lora_rank),
                format!("-DROPE_DIM={}", m.rope_dim),
                format!("-DBLOCK_SIZE={}", m.block_size),
                format!("-DKV_DTYPE={}", dtype_code(m.dtype)),
                format!("-DHEADS_PER_CTA={}", m.heads_per_cta),
            ],
        }
    }

    /// The `extern "C"` kernels the module must export.
    pub fn entry_points(&self) -> Vec<&'static str> {
        match self {
            KernelSpec::Attention(_) => vec!["paged_attention_decode", "paged_attention_merge"],
            KernelSpec::Mla(_) => vec!["mla_decode", "mla_decode_merge"],
            KernelSpec::CacheOps => vec![
                "copy_blocks",
                "reshape_and_cache_f32_f32",
                "reshape_and_cache_f32_f16",
                "reshape_and_cache_f32_bf16",
                "reshape_and_cache_f32_fp8",
                "reshape_and_cache_f16_f16",
                "reshape_and_cache_f16_fp8",
                "reshape_and_cache_bf16_bf16",
                "reshape_and_cache_bf16_fp8",
                "reshape_and_cache_fp8_fp8",
                "rope_and_cache_f32_f32",
                "rope_and_cache_f32_f16",
                "rope_and_cache_f32_bf16",
                "rope_and_cache_f32_fp8",
            ],
            KernelSpec::Prefill(_) => vec!["paged_prefill"],
        }
    }
}

/// Dtypes, head dims and GQA groups of [`PREBUILT_ATTENTION`]'s 16-token-page grid.
const GRID_DTYPES: [DType; 3] = [DType::F16, DType::BF16, DType::Fp8E4M3];
const GRID_HEAD_DIMS: [usize; 2] = [64, 128];
const GRID_GROUPS: [usize; 3] = [1, 4, 8];
const GRID_LEN: usize = GRID_DTYPES.len() * GRID_HEAD_DIMS.len() * GRID_GROUPS.len();

/// Pages under a tile, on both decode paths: bf16 d128 page 1 and fp8 d128 page 2 keep
/// the simple path (too small for the tensor-core copy, see
/// [`crate::attention::decode_mma::uses_mma`]); bf16 d128 page 4 and f16 d64 page 8
/// take the tensor cores with 4 and 2 pages per tile.
const SMALL_PAGES: [AttentionSpec; 4] = [
    AttentionSpec::decode(DType::BF16, 128, 8, 1),
    AttentionSpec::decode(DType::BF16, 128, 8, 4),
    AttentionSpec::decode(DType::Fp8E4M3, 128, 4, 2),
    AttentionSpec::decode(DType::F16, 64, 4, 8),
];

/// Every attention specialisation the GPU checks launch, the one list they all take
/// theirs from: `tests/cuda/attention.rs` sweeps all of it, `tests/cuda/prefill.rs` and
/// [`catalog`]'s prefill modules use its 16-token grid, `examples/gpu_bench` (bf16
/// and fp8 at d128 GQA 8) and `serve --backend cuda` (the scaled llama3 shapes, d64
/// GQA 4 and 8) launch members of it. [`catalog`] prebuilds each for the GPU machine,
/// which has no NVRTC; CPU tests hold every fixed case of those users to the catalog
/// (`tests/cuda/attention.rs`, `tests/cuda/prefill.rs`, `tests/kernels/compile.rs` for
/// the bench, `examples/serve_gpu/tests.rs` for serve).
///
/// The grid: f16, bf16, fp8 x head dims 64, 128 x GQA 1, 4, 8 on 16-token pages; then
/// f32 at d128 GQA 8; then pages of 1, 2, 4 and 8 tokens (`SMALL_PAGES`).
pub const PREBUILT_ATTENTION: [AttentionSpec; GRID_LEN + 1 + SMALL_PAGES.len()] =
    prebuilt_attention();

const fn prebuilt_attention() -> [AttentionSpec; GRID_LEN + 1 + SMALL_PAGES.len()] {
    let mut out = [AttentionSpec::decode(DType::F32, 128, 8, 16); GRID_LEN + 1 + SMALL_PAGES.len()];
    let mut n = 0;
    let mut i = 0;
    while i < GRID_DTYPES.len() {
        let mut j = 0;
        while j < GRID_HEAD_DIMS.len() {
            let mut k = 0;
            while k < GRID_GROUPS.len() {
                out[n] =
                    AttentionSpec::decode(GRID_DTYPES[i], GRID_HEAD_DIMS[j], GRID_GROUPS[k], 16);
                n += 1;
                k += 1;
            }
            j += 1;
        }
        i += 1;
    }
    // out[n] stays f32 d128 GQA 8.
    n += 1;
    let mut p = 0;
    while p < SMALL_PAGES.len() {
        out[n] = SMALL_PAGES[p];
        n += 1;
        p += 1;
    }
    out
}

/// The prefill specialisations prebuilt: [`PREBUILT_ATTENTION`]'s 16-bit and fp8
/// entries on 16-token pages (its grid).
pub fn prebuilt_prefill() -> impl Iterator<Item = PrefillSpec> {
    PREBUILT_ATTENTION
        .iter()
        .filter(|a| a.block_size == 16 && a.dtype != DType::F32)
        .map(|a| PrefillSpec {
            head_dim: a.head_dim,
            block_size: a.block_size,
            gqa_group: a.gqa_group,
            dtype: a.dtype,
        })
}

/// Every module the crate's GPU tests, bench and example use, prebuilt as cubins for
/// the GPU machine (`gpu_bench --write-cubins`); CI compiles each for sm_80 and sm_90.
/// The attention and prefill modules come from [`PREBUILT_ATTENTION`]. Engines may
/// compile others: any [`AttentionSpec`] that passes [`AttentionSpec::check`] is valid.
///
/// Explicit `unroll` and `vec_bytes` variants are not here: every GQA-8 shape takes the
/// tensor-core path, which compiles neither, so such a module would be the default's
/// twin.
pub fn catalog() -> Vec<KernelSpec> {
    let mut out = vec![KernelSpec::CacheOps];
    out.extend(
        PREBUILT_ATTENTION
            .iter()
            .copied()
            .map(KernelSpec::Attention),
    );
    // MLA decode on DeepSeek-V3's latent (512 + 64) in 16-token pages: bf16 and fp8
    // with 8 heads per CTA, and bf16 with 16.
    for (dtype, heads_per_cta) in [(DType::BF16, 8), (DType::Fp8E4M3, 8), (DType::BF16, 16)] {
        out.push(KernelSpec::Mla(MlaSpec {
            kv_lora_rank: 512,
            rope_dim: 64,
            block_size: 16,
            dtype,
            heads_per_cta,
        }));
    }
    out.extend(prebuilt_prefill().map(KernelSpec::Prefill));
    out
}

/// Register and spill figures of one kernel, from ptxas' verbose log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    /// Kernel name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
    /// Bytes of static shared memory.
    pub shared_bytes: u32,
}

/// A compiled module: PTX, cubin for the target, and the compiler's log.
#[derive(Debug, Clone)]
pub struct CompiledModule {
    /// What was compiled.
    pub spec: KernelSpec,
    /// For which device architecture.
    pub arch: Arch,
    /// PTX text.
    pub ptx: String,
    /// Device code for `arch` (what gets loaded: no PTX JIT at run time).
    pub cubin: Vec<u8>,
    /// NVRTC's log, including ptxas' `-v` resource lines.
    pub log: String,
}

impl CompiledModule {
    /// Registers, spills and shared memory per kernel, from the log.
    pub fn resources(&self) -> Vec<KernelResources> {
        parse_ptxas_log(&self.log)
    }
}

/// Parses ptxas `-v` output (`Function properties for NAME`, `N bytes spill stores,
/// M bytes spill loads`, `Used R registers ... S bytes smem`).
pub fn parse_ptxas_log(log: &str) -> Vec<KernelResources> {
    fn number_before(line: &str, word: &str) -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    }
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(at) = line.find("Function properties for ") {
            out.push(KernelResources {
                name: line[at + "Function properties for ".len()..]
                    .trim()
                    .to_string(),
                registers: 0,
                spill_stores: 0,
                spill_loads: 0,
                shared_bytes: 0,
            });
        } else if let Some(k) = out.last_mut() {
            if let Some(n) = number_before(line, "bytes spill stores") {
                k.spill_stores = n;
            }
            if let Some(n) = number_before(line, "bytes spill loads") {
                k.spill_loads = n;
            }
            if let Some(n) = number_before(line, "registers") {
                k.registers = n;
            }
            if let Some(n) = number_before(line, "bytes smem") {
                k.shared_bytes = n;
            }
        }
    }
    out
}

type Cache = Mutex<HashMap<(KernelSpec, Arch), Arc<CompiledModule>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Environment variable naming a folder of prebuilt cubins (written by
/// [`write_cubin`]); [`compile`] loads from it before calling NVRTC, so a machine
/// without NVRTC (the GPU test machine) runs kernels built elsewhere.
pub const CUBIN_DIR_ENV: &str = "PAGEDKV_CUBIN_DIR";

impl KernelSpec {
    /// File name of this specialisation's cubin for `arch`. It carries a hash of the
    /// source and defines, so a cubin built from other sources is never picked up.
    pub fn cubin_file_name(&self, arch: Arch) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self
            .source()
            .bytes()
            .chain(self.defines().join(" ").bytes())
        {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        let tag = match self {
            KernelSpec::Attention(a) => format!(
                "attention-d{}-bs{}-g{}-{}-u{}-v{}",
                a.head_dim, a.block_size, a.gqa_group, a.dtype, a.unroll, a.vec_bytes
            ),
            KernelSpec::CacheOps => "cache_ops".to_string(),
            KernelSpec::Prefill(p) => format!(
                "prefill-d{}-bs{}-g{}-{}",
                p.head_dim, p.block_size, p.gqa_group, p.dtype
            ),
            KernelSpec::Mla(m) => format!(
                "mla-r{}-p{}-bs{}-{}-h{}",
                m.kv_lora_rank, m.rope_dim, m.block_size, m.dtype, m.heads_per_cta
            ),
        };
        format!("{tag}-{}-{h:016x}.cubin", arch.sm())
    }
}

/// Writes `module`'s cubin into `dir` under [`KernelSpec::cubin_file_name`].
///
/// # Errors
/// [`Error::Io`].
pub fn write_cubin(module: &CompiledModule, dir: &std::path::Path) -> Result<std::path::PathBuf> {
    let path = dir.join(module.spec.cubin_file_name(module.arch));
    std::fs::create_dir_all(dir).map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?;
    std::fs::write(&path, &module.cubin)
        .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    Ok(path)
}

fn prebuilt(spec: &KernelSpec, arch: Arch) -> Option<CompiledModule> {
    let dir = std::env::var_os(CUBIN_DIR_ENV)?;
    let path = std::path::Path::new(&dir).join(spec.cubin_file_name(arch));
    let cubin = std::fs::read(path).ok()?;
    Some(CompiledModule {
        spec: *spec,
        arch,
        ptx: String::new(),
        cubin,
        log: format!(
            "prebuilt cubin from {}",
            std::path::Path::new(&dir).display()
        ),
    })
}

/// Compiles `spec` for `arch`, or returns the module compiled earlier in this process
/// (or prebuilt, see [`CUBIN_DIR_ENV`]).
///
/// # Errors
/// [`Error::CudaUnavailable`] without NVRTC; [`Error::Unsupported`] for a
/// specialisation the kernel cannot take; [`Error::Cuda`] with the compiler log when
/// compilation fails.
pub fn compile(spec: &KernelSpec, arch: Arch) -> Result<Arc<CompiledModule>> {
    if let Some(m) = cache().lock().get(&(*spec, arch)) {
        return Ok(m.clone());
    }
    // Compile outside the lock: NVRTC is thread-safe and a compile takes a while.
    let module = match prebuilt(spec, arch) {
        Some(m) => Arc::new(m),
        None => Arc::new(compile_uncached(spec, arch)?),
    };
    Ok(cache()
        .lock()
        .entry((*spec, arch))
        .or_insert(module)
        .clone())
}

/// Compiles `spec` for `arch` without the process-wide cache.
///
/// # Errors
/// As [`compile`].
pub fn compile_uncached(spec: &KernelSpec, arch: Arch) -> Result<CompiledModule> {
    match spec {
        KernelSpec::Attention(a) => a.check()?,
        KernelSpec::Mla(m) => m.check()?,
        KernelSpec::Prefill(p) => p.check()?,
        KernelSpec::CacheOps => {}
    }
    if !super::nvrtc_present() {
        return Err(Error::CudaUnavailable(
            "NVRTC (libnvrtc.so) not found on the loader path; source .ci/nvrtc-env or add \
             the CUDA lib directory to LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let src = CString::new(spec.source())
        .map_err(|_| Error::Cuda("kernel source holds a NUL byte".into()))?;
    let name = CString::new(spec.file_name())
        .map_err(|_| Error::Cuda("kernel file name holds a NUL byte".into()))?;
    let nv = |call: &'static str| move |e: nvrtc::NvrtcError| Error::Cuda(format!("{call}: {e:?}"));
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(nv("nvrtcCreateProgram"))?;
    let mut options = vec![
        format!("--gpu-architecture={}", arch.sm()),
        "-std=c++17".to_string(),
        "--ptxas-options=-v".to_string(),
        // Line info for compute-sanitizer and profilers; it changes no instruction.
        "-lineinfo".to_string(),
    ];
    options.extend(spec.defines());
    // The kernels need no CUDA headers; an include path is passed on when set (by
    // .ci/nvrtc-env) so local experiments with `#include <cuda_fp16.h>` work too.
    if let Some(dir) = std::env::var_os("PAGEDKV_CUDA_INCLUDE") {
        if let Some(dir) = dir.to_str().filter(|d| std::path::Path::new(d).is_dir()) {
            options.push(format!("--include-path={dir}"));
        }
    }
    // SAFETY: `prog` comes from `create_program` above and is destroyed once, at the
    // end; `src` and `name`, which it may reference, outlive it. The same holds for
    // every call on `prog` below.
    let compiled = unsafe { nvrtc::compile_program(prog, &options) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|l| c_chars_to_string(&l))
        .unwrap_or_default();
    let result = compiled
        .map_err(|e| {
            Error::Cuda(format!(
                "NVRTC failed on {} {:?} for {}: {e:?}\n{log}",
                spec.file_name(),
                spec.defines(),
                arch.sm()
            ))
        })
        .and_then(|()| {
            // SAFETY: as above; compilation succeeded, so PTX and cubin exist.
            let ptx = unsafe { nvrtc::get_ptx(prog) }.map_err(nv("nvrtcGetPTX"))?;
            // SAFETY: as above.
            let cubin = unsafe { get_cubin(prog) }.map_err(nv("nvrtcGetCUBIN"))?;
            Ok(CompiledModule {
                spec: *spec,
                arch,
                ptx: c_chars_to_string(&ptx),
                cubin,
                log: log.clone(),
            })
        });
    // SAFETY: as above; `prog` is not used after this.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// # Safety
/// `prog` must be a live program that compiled successfully.
unsafe fn get_cubin(
    prog: nvrtc_sys::nvrtcProgram,
) -> std::result::Result<Vec<u8>, nvrtc::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: the caller guarantees `prog`; `size` is a valid out-pointer.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds the `size` bytes NVRTC said it would write.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast::<c_char>()) }.result()?;
    Ok(buf)
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_log_is_parsed_per_kernel() {
        let log = "ptxas info    : Compiling entry function 'k' for 'sm_90'\n\
ptxas info    : Function properties for paged_attention_merge\n\
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 32 registers, used 0 barriers\n\
ptxas info    : Function properties for paged_attention_decode\n\
ptxas         .     0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 137 registers, used 1 barriers, 8768 bytes smem\n";
        let r = parse_ptxas_log(log);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].name, "paged_attention_merge");
        assert_eq!((r[0].registers, r[0].shared_bytes), (32, 0));
        assert_eq!(r[1].name, "paged_attention_decode");
        assert_eq!(
            (
                r[1].registers,
                r[1].spill_stores,
                r[1].spill_loads,
                r[1].shared_bytes
            ),
            (137, 8, 12, 8768)
        );
    }

    #[test]
    fn specs_the_kernel_cannot_take_are_rejected_before_compiling() {
        let ok = AttentionSpec {
            head_dim: 128,
            block_size: 16,
            gqa_group: 8,
            dtype: DType::BF16,
            unroll: 0,
            vec_bytes: 0,
        };
        assert!(ok.check().is_ok());
        for bad in [
            AttentionSpec { head_dim: 4, ..ok },
            AttentionSpec {
                head_dim: 96 + 4,
                ..ok
            },
            AttentionSpec { gqa_group: 0, ..ok },
            AttentionSpec { unroll: 5, ..ok },
            AttentionSpec {
                gqa_group: 64,
                head_dim: 128,
                ..ok
            },
            AttentionSpec { vec_bytes: 4, ..ok },
            AttentionSpec {
                block_size: 0,
                ..ok
            },
        ] {
            assert!(matches!(bad.check(), Err(Error::Unsupported(_))), "{bad:?}");
        }
        // 96 bf16 = 12 vectors: neither a power of two nor a multiple of 32.
        assert!(AttentionSpec { head_dim: 96, ..ok }.check().is_err());
        // 256 f32 = 64 vectors: two per lane.
        assert!(AttentionSpec {
            head_dim: 256,
            dtype: DType::F32,
            ..ok
        }
        .check()
        .is_ok());
    }

    #[test]
    fn the_catalog_is_the_prebuilt_list_once_each_within_the_compile_budget() {
        let all = catalog();
        for (i, a) in all.iter().enumerate() {
            assert!(!all[i + 1..].contains(a), "{a:?} twice");
        }
        for a in PREBUILT_ATTENTION {
            assert!(all.contains(&KernelSpec::Attention(a)));
        }
        assert_eq!(prebuilt_prefill().count(), GRID_LEN);
        // CI compiles each module for two arches (tests/kernels/compile.rs): 45 modules
        // in the catalog is what it was sized for.
        assert!(all.len() <= 45, "{} modules", all.len());
    }

    #[test]
    fn every_catalog_spec_passes_its_checks() {
        for spec in catalog() {
            match spec {
                KernelSpec::Attention(a) => a.check().unwrap(),
                KernelSpec::Mla(m) => m.check().unwrap(),
                KernelSpec::Prefill(p) => p.check().unwrap(),
                KernelSpec::CacheOps => {}
            }
            assert!(!spec.entry_points().is_empty());
        }
    }

    #[test]
    fn mla_specs_the_kernel_rejects_are_refused_before_compiling() {
        let ok = MlaSpec {
            kv_lora_rank: 512,
            rope_dim: 64,
            block_size: 16,
            dtype: DType::BF16,
            heads_per_cta: 8,
        };
        ok.check().unwrap();
        for bad in [
            MlaSpec {
                kv_lora_rank: 500,
                ..ok
            },
            MlaSpec { rope_dim: 60, ..ok },
            // 64 tokens x 576 x 2 bytes = 72 KiB of shared memory.
            MlaSpec {
                block_size: 64,
                ..ok
            },
            MlaSpec {
                heads_per_cta: 0,
                ..ok
            },
            MlaSpec {
                heads_per_cta: 33,
                ..ok
            },
        ] {
            assert!(matches!(bad.check(), Err(Error::Unsupported(_))), "{bad:?}");
        }
    }
}
