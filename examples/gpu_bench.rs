//! GPU figures for pagedkv in one run, printed as one JSON object:
//!
//! - decode attention bandwidth (K/V bytes read / kernel time) for batch 64 x 4096
//!   tokens and batch 1 x 32k, 64 query / 8 KV heads, head dim 128, page 16: bf16 on
//!   scattered (paged) blocks, the same kernel on consecutive blocks (contiguous), and
//!   fp8 beside bf16;
//! - `copy_blocks` and swap-out GB/s beside one device memcpy / one pinned memcpy of
//!   the same bytes.
//!
//! Without a GPU it says so and exits 0. `gpu_bench --write-cubins DIR [--arch 90]`
//! needs only NVRTC: it prebuilds every kernel this bench and the GPU tests use into
//! DIR, for a GPU machine without NVRTC (`PAGEDKV_CUBIN_DIR=DIR`).

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::sys;
    use pagedkv::attention::cuda::{CudaAttention, Tables};
    use pagedkv::attention::AttentionParams;
    use pagedkv::executor::cuda::AttentionSpec;
    use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
    use pagedkv::{
        BlockId, CopyPlan, DType, Error, KvLayout, ModelShape, PaddedTables, Result, Storage,
        SwapDirection, SwapPlan,
    };
    use serde_json::{json, Value};

    const ITERS: usize = 20;

    fn shape(dtype: DType) -> ModelShape {
        ModelShape {
            num_layers: 1,
            num_q_heads: 64,
            num_kv_heads: 8,
            head_dim: 128,
            kv_dtype: dtype,
        }
    }

    /// Milliseconds per iteration of `f`, timed with events on `stream`.
    fn time_ms(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        stream: &cudarc::driver::CudaStream,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<f64> {
        let ev = |_| {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| Error::Cuda(e.to_string()))
        };
        let (start, end) = (ev(0)?, ev(1)?);
        f()?; // warm-up
        start
            .record(stream)
            .map_err(|e| Error::Cuda(e.to_string()))?;
        for _ in 0..ITERS {
            f()?;
        }
        end.record(stream).map_err(|e| Error::Cuda(e.to_string()))?;
        end.synchronize().map_err(|e| Error::Cuda(e.to_string()))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| Error::Cuda(e.to_string()))?;
        Ok(ms as f64 / ITERS as f64)
    }

    /// Tables for `batch` sequences of `ctx` tokens: scattered blocks (a seeded
    /// shuffle of the arena) or consecutive blocks per sequence.
    fn tables(batch: usize, ctx: usize, num_blocks: usize, scattered: bool) -> PaddedTables {
        let per = ctx.div_ceil(16);
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        if scattered {
            let mut s = 0x9e37_79b9_7f4a_7c15u64;
            for i in (1..ids.len()).rev() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ids.swap(i, (s % (i as u64 + 1)) as usize);
            }
        }
        PaddedTables {
            tables: ids[..batch * per].to_vec(),
            context_lens: vec![ctx as u32; batch],
            batch,
            max_blocks: per,
        }
    }

    fn decode_case(
        dtype: DType,
        batch: usize,
        ctx: usize,
        scattered: bool,
        unroll: u32,
        vec_bytes: u32,
    ) -> Result<Value> {
        let layout = KvLayout::new(shape(dtype), 16)?;
        let num_blocks = batch * ctx.div_ceil(16) + 64;
        let storage = CudaStorage::new(layout, CudaStorageConfig::blocks(num_blocks))?;
        let spec = AttentionSpec {
            unroll,
            vec_bytes,
            ..AttentionSpec::for_layout(&layout)
        };
        let mut attn = CudaAttention::with_spec(&storage, spec)?;
        let t = tables(batch, ctx, num_blocks, scattered);
        let dt = attn.upload_tables(&storage, Tables::Padded(&t))?;
        let plan = attn.plan(&storage, &dt);
        let stream = storage.compute_stream().clone();
        let cuda = storage.context().clone();
        let rows = batch * 64;
        let q = stream
            .alloc_zeros::<f32>(rows * 128)
            .map_err(|e| Error::Cuda(e.to_string()))?;
        let mut out = stream
            .alloc_zeros::<f32>(rows * 128)
            .map_err(|e| Error::Cuda(e.to_string()))?;
        let mut lse = stream
            .alloc_zeros::<f32>(rows)
            .map_err(|e| Error::Cuda(e.to_string()))?;
        let params = AttentionParams::new(128);
        let ms = time_ms(&cuda, &stream, || {
            attn.decode(&storage, 0, &q, &dt, &params, None, &mut out, &mut lse)
                .map(|_| ())
        })?;
        let kv_bytes = (batch * ctx * 8 * 128 * 2 * dtype.size_bytes()) as f64;
        Ok(json!({
            "dtype": dtype.name(), "batch": batch, "context": ctx,
            "layout": if scattered { "paged (scattered blocks)" } else { "contiguous (consecutive blocks)" },
            "unroll": if unroll == 0 { "default".to_string() } else { unroll.to_string() },
            "vec_bytes": if vec_bytes == 0 { "default".to_string() } else { vec_bytes.to_string() },
            "splits": plan.num_splits, "tokens_per_split": plan.tokens_per_split,
            "kernel_us": ms * 1e3, "kv_bytes": kv_bytes,
            "bandwidth_gb_s": kv_bytes / (ms * 1e-3) / 1e9,
        }))
    }

    fn copy_and_swap() -> Result<Value> {
        let layout = KvLayout::new(shape(DType::BF16), 16)?;
        let n = 4096usize;
        let num_blocks = 3 * n;
        let mut storage = CudaStorage::new(
            layout,
            CudaStorageConfig {
                host_blocks: n,
                ..CudaStorageConfig::blocks(num_blocks)
            },
        )?;
        let bpl = layout.block_bytes_per_layer();
        let bytes = n * bpl;
        let t = tables(1, 2 * n * 16, 2 * n, true).tables;
        let mut plan = CopyPlan::new();
        for i in 0..n {
            plan.push(BlockId(t[i]), BlockId(t[n + i]));
        }
        let compute = storage.compute_stream().clone();
        let ctx = storage.context().clone();
        let copy_ms = time_ms(&ctx, &compute, || storage.copy_blocks(&plan))?;
        let base = storage.region_ptr(0)?;
        let memcpy_ms = time_ms(&ctx, &compute, || {
            // SAFETY: both ranges lie in layer 0's mapped region (3n blocks mapped;
            // [0, n) and [2n, 3n) blocks) and do not overlap.
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(base + 2 * bytes as u64, base, bytes, compute.cu_stream())
            }
            .result()
            .map_err(|e| Error::Cuda(e.to_string()))
        })?;
        let mut swap = SwapPlan::new(SwapDirection::Out);
        for (i, &d) in t[..n].iter().enumerate() {
            swap.push(BlockId(d), BlockId(i as u32));
        }
        let runs = swap.runs().len();
        let transfer = storage.transfer_stream().clone();
        let swap_ms = time_ms(&ctx, &transfer, || storage.swap(&swap))?;
        let mut contiguous = SwapPlan::new(SwapDirection::Out);
        for i in 0..n as u32 {
            contiguous.push(BlockId(i), BlockId(i));
        }
        let pinned_ms = time_ms(&ctx, &transfer, || storage.swap(&contiguous))?;
        let gbs = |ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
        Ok(json!({
            "bytes": bytes, "blocks": n,
            "copy_blocks_gb_s": gbs(copy_ms), "device_memcpy_gb_s": gbs(memcpy_ms),
            "copy_blocks_vs_memcpy": memcpy_ms / copy_ms,
            "swap_out_scattered_gb_s": gbs(swap_ms), "swap_runs": runs,
            "pinned_memcpy_one_run_gb_s": gbs(pinned_ms),
            "swap_vs_pinned_memcpy": pinned_ms / swap_ms,
        }))
    }

    pub fn run() -> Result<Value> {
        let mut decode = Vec::new();
        for (batch, ctx) in [(64, 4096), (1, 32768)] {
            for scattered in [true, false] {
                decode.push(decode_case(DType::BF16, batch, ctx, scattered, 0, 0)?);
            }
            decode.push(decode_case(DType::Fp8E4M3, batch, ctx, true, 0, 0)?);
        }
        // The register/in-flight trade-off of the main case, measured rather than guessed.
        for unroll in [1, 2] {
            decode.push(decode_case(DType::BF16, 64, 4096, true, unroll, 0)?);
        }
        for vec_bytes in [8, 16] {
            decode.push(decode_case(DType::Fp8E4M3, 64, 4096, true, 0, vec_bytes)?);
        }
        let probe = CudaStorage::new(
            KvLayout::new(shape(DType::BF16), 16)?,
            CudaStorageConfig::blocks(1),
        )?;
        Ok(json!({
            "device": probe.device().name, "sms": probe.device().num_sms,
            "decode": decode, "copy_and_swap": copy_and_swap()?,
        }))
    }

    pub fn write_cubins(dir: &str, arch: pagedkv::executor::cuda::Arch) -> Result<usize> {
        let specs = pagedkv::executor::cuda::catalog();
        for spec in &specs {
            let m = pagedkv::executor::cuda::compile_uncached(spec, arch)?;
            pagedkv::executor::cuda::write_cubin(&m, std::path::Path::new(dir))?;
        }
        Ok(specs.len())
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    #[cfg(feature = "cuda")]
    {
        if let Some(i) = args.iter().position(|a| a == "--write-cubins") {
            let Some(dir) = args.get(i + 1) else {
                eprintln!("usage: gpu_bench --write-cubins DIR [--arch 90]");
                std::process::exit(2);
            };
            let arch = args
                .iter()
                .position(|a| a == "--arch")
                .and_then(|j| args.get(j + 1))
                .and_then(|s| s.parse::<u32>().ok())
                .map(|v| pagedkv::executor::cuda::Arch {
                    major: v / 10,
                    minor: v % 10,
                })
                .unwrap_or(pagedkv::executor::cuda::Arch::SM90);
            match gpu::write_cubins(dir, arch) {
                Ok(n) => println!("wrote {n} cubins for {} to {dir}", arch.sm()),
                Err(e) => {
                    eprintln!("gpu_bench: {e}");
                    std::process::exit(1);
                }
            }
            return;
        }
        match gpu::run() {
            Ok(v) => println!("{v}"),
            Err(pagedkv::Error::CudaUnavailable(why)) => {
                println!("gpu_bench: no GPU here ({why}); nothing measured");
                if std::env::var("PAGEDKV_REQUIRE_GPU").as_deref() == Ok("1") {
                    std::process::exit(1);
                }
            }
            Err(e) => {
                eprintln!("gpu_bench: {e}");
                std::process::exit(1);
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = args;
        println!("gpu_bench: built without the `cuda` feature; nothing measured");
    }
}
