//! GPU figures for pagedkv in one run, printed as one JSON object. Every figure has
//! its baseline from the same run beside it, and device time is separated from host
//! time: each timed loop is enqueued behind a host-released gate (a `cuLaunchHostFunc`
//! that waits for the loop to be fully queued), so the events between the loop's ends
//! time execution only, never the host's enqueue rate, which is reported apart
//! (`host_us_per_call`).
//!
//! - decode attention bandwidth (K/V bytes read / kernel time) for batch 64 x 4096
//!   tokens and batch 1 x 32k, 64 query / 8 KV heads, head dim 128, page 16: bf16 on
//!   scattered (paged) blocks, the same kernel on consecutive blocks (contiguous), and
//!   fp8 beside bf16; beside each, a device memcpy of the same bytes. Cache and
//!   queries hold random non-zero values; small cases rotate over several disjoint
//!   batches so that at least 512 MiB is read per lap (the H200's L2 is 50 MiB); the
//!   main case also with one forced split beside the occupancy planner's choice, and
//!   with bf16 queries and output beside f32;
//! - `copy_blocks`: the launch of an uploaded plan (device time), and the whole call
//!   with host validation and upload (host time), beside a device memcpy of the same
//!   bytes;
//! - swap-out of scattered blocks to pinned memory beside one pinned memcpy of the same
//!   bytes (one run).
//!
//! Without a GPU it says so and exits 0. `gpu_bench --write-cubins DIR [--arch 90]`
//! needs only NVRTC: it prebuilds every kernel this bench and the GPU tests use into
//! DIR, for a GPU machine without NVRTC (`PAGEDKV_CUBIN_DIR=DIR`).

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::sys;
    use pagedkv::attention::cuda::{CudaAttention, Outputs, Queries, Tables};
    use pagedkv::attention::AttentionParams;
    use pagedkv::executor::cuda::bench_cases::{self as cases, shape};
    use pagedkv::executor::cuda::AttentionSpec;
    use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
    use pagedkv::layout::plans::SwapDirection;
    use pagedkv::layout::Slot;
    use pagedkv::tables::PaddedTables;
    use pagedkv::{BlockId, CopyPlan, DType, Error, KvLayout, Result, Storage, SwapPlan};
    use serde_json::{json, Value};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    const ITERS: usize = 20;
    /// Bytes each decode lap reads at least (rotating over disjoint batches).
    const LAP_BYTES: usize = 512 << 20;

    fn cuda_err(e: impl std::fmt::Display) -> Error {
        Error::Cuda(e.to_string())
    }

    /// Holds a stream until released from the host (or 30 s pass, so a mistake cannot
    /// hang the bench): work queued behind it runs back to back once released.
    struct Gate(Arc<AtomicBool>);

    unsafe extern "C" fn wait_for_gate(user: *mut std::ffi::c_void) {
        // SAFETY: `user` is the pointer `Gate::block` leaked from an Arc<AtomicBool>;
        // this callback runs once and takes that reference back.
        let flag = unsafe { Arc::from_raw(user as *const AtomicBool) };
        let start = Instant::now();
        while !flag.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(30) {
            std::hint::spin_loop();
        }
    }

    impl Gate {
        fn block(stream: &cudarc::driver::CudaStream) -> Result<Gate> {
            let flag = Arc::new(AtomicBool::new(false));
            let user = Arc::into_raw(Arc::clone(&flag)) as *mut std::ffi::c_void;
            // SAFETY: the callback takes back the Arc leaked above; the stream is live.
            unsafe { sys::cuLaunchHostFunc(stream.cu_stream(), Some(wait_for_gate), user) }
                .result()
                .map_err(cuda_err)?;
            Ok(Gate(flag))
        }

        fn release(&self) {
            self.0.store(true, Ordering::Release);
        }
    }

    /// Device milliseconds per iteration of `f` (events on `stream` around `ITERS`
    /// calls queued behind a gate) and host microseconds per call (the enqueue loop's
    /// wall time). `f` must queue only asynchronous work (no pageable uploads: those
    /// wait for the stream, i.e. for the gate).
    fn time_split(
        ctx: &Arc<cudarc::driver::CudaContext>,
        stream: &cudarc::driver::CudaStream,
        mut f: impl FnMut(usize) -> Result<()>,
    ) -> Result<(f64, f64)> {
        let ev = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda_err)
        };
        let (start, end) = (ev()?, ev()?);
        f(0)?; // warm-up: module load, scratch allocation, first touch
        stream.synchronize().map_err(cuda_err)?;
        let gate = Gate::block(stream)?;
        start.record(stream).map_err(cuda_err)?;
        let t0 = Instant::now();
        let mut queued = Ok(());
        for i in 0..ITERS {
            queued = f(i);
            if queued.is_err() {
                break;
            }
        }
        let host = t0.elapsed();
        end.record(stream).map_err(cuda_err)?;
        gate.release();
        queued?;
        end.synchronize().map_err(cuda_err)?;
        let ms = start.elapsed_ms(&end).map_err(cuda_err)?;
        Ok((
            ms as f64 / ITERS as f64,
            host.as_secs_f64() * 1e6 / ITERS as f64,
        ))
    }

    /// Tables for `batch` sequences of `ctx` tokens starting at arena block `first`:
    /// scattered blocks (a seeded shuffle of the whole arena) or consecutive blocks.
    fn tables(
        batch: usize,
        ctx: usize,
        num_blocks: usize,
        first: usize,
        scattered: bool,
    ) -> PaddedTables {
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
            tables: ids[first..first + batch * per].to_vec(),
            context_lens: vec![ctx as u32; batch],
            batch,
            max_blocks: per,
        }
    }

    struct Rng(u64);
    impl Rng {
        /// Uniform in [-1, 1), never exactly zero in practice.
        fn f32(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// Writes random values into every slot of layer 0 (in the cache dtype).
    fn fill_random(storage: &mut CudaStorage, seed: u64) -> Result<()> {
        let layout = *storage.layout();
        let dtype = layout.dtype();
        let per_token = layout.shape().num_kv_heads * layout.shape().head_dim;
        let total = (storage.num_blocks() * layout.block_size()) as u64;
        let chunk = 1u64 << 16;
        let mut rng = Rng(seed | 1);
        let mut vals = vec![0f32; chunk as usize * per_token];
        let mut k = vec![0u8; vals.len() * dtype.size_bytes()];
        let mut v = k.clone();
        let mut at = 0;
        while at < total {
            let n = chunk.min(total - at) as usize;
            let slots: Vec<Slot> = (at..at + n as u64).map(Slot).collect();
            let m = n * per_token;
            for buf in [&mut k, &mut v] {
                vals[..m].iter_mut().for_each(|x| *x = rng.f32());
                pagedkv::layout::convert::encode(
                    dtype,
                    &vals[..m],
                    1.0,
                    &mut buf[..m * dtype.size_bytes()],
                )?;
            }
            let b = m * dtype.size_bytes();
            storage.write_slots(0, &slots, &k[..b], &v[..b])?;
            at += n as u64;
        }
        storage.sync_compute()
    }

    /// Device memcpy of `bytes` between two fresh buffers: the bandwidth ceiling.
    fn memcpy_baseline(storage: &CudaStorage, bytes: usize) -> Result<(f64, f64)> {
        let stream = storage.compute_stream().clone();
        let src = stream.alloc_zeros::<u8>(bytes).map_err(cuda_err)?;
        let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(cuda_err)?;
        let ctx = storage.context().clone();
        time_split(&ctx, &stream, |_| {
            stream.memcpy_dtod(&src, &mut dst).map_err(cuda_err)
        })
    }

    /// One decode measurement. `splits`: `None` is the occupancy-aware planner's
    /// choice, `Some(n)` forces `n`; `bf16_io`: queries and output in bf16
    /// (`decode_io`) instead of f32.
    #[allow(clippy::too_many_arguments)]
    fn decode_case(
        dtype: DType,
        batch: usize,
        ctx: usize,
        scattered: bool,
        unroll: u32,
        vec_bytes: u32,
        splits: Option<u32>,
        bf16_io: bool,
    ) -> Result<Value> {
        let layout = KvLayout::new(shape(dtype), cases::BLOCK_SIZE)?;
        let per_batch = batch * ctx.div_ceil(16);
        let kv_bytes = batch * ctx * 8 * 128 * 2 * dtype.size_bytes();
        let laps = LAP_BYTES.div_ceil(kv_bytes).clamp(1, 8);
        let num_blocks = laps * per_batch + 64;
        let mut storage = CudaStorage::new(layout, CudaStorageConfig::blocks(num_blocks))?;
        fill_random(&mut storage, 0x5eed ^ batch as u64 ^ ctx as u64)?;
        let spec = AttentionSpec {
            unroll,
            vec_bytes,
            ..AttentionSpec::for_layout(&layout)
        };
        debug_assert!(unroll != 0 || vec_bytes != 0 || cases::decode_specs()?.contains(&spec));
        cases::check_prebuilt(&spec)?;
        let mut attn = CudaAttention::with_spec(&storage, spec)?;
        let dts = (0..laps)
            .map(|r| {
                let t = tables(batch, ctx, num_blocks, r * per_batch, scattered);
                attn.upload_tables(&storage, Tables::Padded(&t))
            })
            .collect::<Result<Vec<_>>>()?;
        let plan = match splits {
            Some(n) => pagedkv::attention::split_plan_with(ctx, 16, n)?,
            None => attn.plan(&storage, &dts[0]),
        };
        let stream = storage.compute_stream().clone();
        let cuda = storage.context().clone();
        let rows = batch * 64;
        let mut rng = Rng(0x9e37);
        let qh: Vec<f32> = (0..rows * 128).map(|_| rng.f32()).collect();
        let q = stream.clone_htod(&qh).map_err(cuda_err)?;
        let qh16: Vec<u16> = qh
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let q16 = stream.clone_htod(&qh16).map_err(cuda_err)?;
        let mut out = stream.alloc_zeros::<f32>(rows * 128).map_err(cuda_err)?;
        let mut out16 = stream.alloc_zeros::<u16>(rows * 128).map_err(cuda_err)?;
        let mut lse = stream.alloc_zeros::<f32>(rows).map_err(cuda_err)?;
        let params = AttentionParams::new(128);
        let (ms, host_us) = time_split(&cuda, &stream, |i| {
            let (qs, outs) = if bf16_io {
                (Queries::BF16(&q16), Outputs::BF16(&mut out16))
            } else {
                (Queries::F32(&q), Outputs::F32(&mut out))
            };
            attn.decode_io(
                &storage,
                0,
                qs,
                &dts[i % laps],
                &params,
                splits,
                outs,
                &mut lse,
            )
            .map(|_| ())
        })?;
        let (memcpy_ms, _) = memcpy_baseline(&storage, kv_bytes)?;
        let gbs = |ms: f64| kv_bytes as f64 / (ms * 1e-3) / 1e9;
        Ok(json!({
            "dtype": dtype.name(), "batch": batch, "context": ctx,
            "layout": if scattered { "paged (scattered blocks)" } else { "contiguous (consecutive blocks)" },
            "unroll": if unroll == 0 { "default".to_string() } else { unroll.to_string() },
            "vec_bytes": if vec_bytes == 0 { "default".to_string() } else { vec_bytes.to_string() },
            "splits": plan.num_splits, "tokens_per_split": plan.tokens_per_split,
            "split_choice": if splits.is_some() { "forced" } else { "occupancy planner" },
            "ctas_per_sm": attn.ctas_per_sm(),
            "q_out_dtype": if bf16_io { "bf16" } else { "f32" },
            "rotating_batches": laps,
            "kernel_us": ms * 1e3, "host_us_per_call": host_us, "kv_bytes": kv_bytes,
            "bandwidth_gb_s": gbs(ms),
            // A memcpy reads and writes: its bandwidth counts both, as decode's K/V
            // read is compared with the copy engine's read + write of the same bytes.
            "memcpy_same_bytes_us": memcpy_ms * 1e3,
            "memcpy_read_write_gb_s": 2.0 * gbs(memcpy_ms),
            "decode_vs_memcpy_time": memcpy_ms / ms,
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
        fill_random(&mut storage, 7)?;
        let bpl = layout.block_bytes_per_layer();
        let bytes = n * bpl;
        let t = tables(1, 2 * n * 16, 2 * n, 0, true).tables;
        let mut plan = CopyPlan::new();
        for i in 0..n {
            plan.push(BlockId(t[i]), BlockId(t[n + i]));
        }
        let compute = storage.compute_stream().clone();
        let ctx = storage.context().clone();
        let uploaded = storage.upload_copy_plan(&plan)?;
        let (copy_ms, copy_launch_host_us) =
            time_split(&ctx, &compute, |_| storage.copy_blocks_uploaded(&uploaded))?;
        // The whole call (validation, pageable upload of the pairs, launch), host time:
        // its upload waits for the stream, so it cannot run behind a gate.
        let t0 = Instant::now();
        for _ in 0..ITERS {
            storage.copy_blocks(&plan)?;
        }
        storage.sync_compute()?;
        let copy_call_us = t0.elapsed().as_secs_f64() * 1e6 / ITERS as f64;
        let base = storage.region_ptr(0)?;
        let (memcpy_ms, _) = time_split(&ctx, &compute, |_| {
            // SAFETY: both ranges lie in layer 0's mapped region (3n blocks mapped;
            // [0, n) and [2n, 3n) blocks) and do not overlap.
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(base + 2 * bytes as u64, base, bytes, compute.cu_stream())
            }
            .result()
            .map_err(cuda_err)
        })?;
        let mut swap = SwapPlan::new(SwapDirection::Out);
        for (i, &d) in t[..n].iter().enumerate() {
            swap.push(BlockId(d), BlockId(i as u32));
        }
        let runs = swap.runs().len();
        let transfer = storage.transfer_stream().clone();
        let (swap_ms, swap_host_us) = time_split(&ctx, &transfer, |_| storage.swap(&swap))?;
        let mut contiguous = SwapPlan::new(SwapDirection::Out);
        for i in 0..n as u32 {
            contiguous.push(BlockId(i), BlockId(i));
        }
        let (pinned_ms, _) = time_split(&ctx, &transfer, |_| storage.swap(&contiguous))?;
        let gbs = |ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
        Ok(json!({
            "bytes": bytes, "blocks": n,
            "copy_blocks_kernel_us": copy_ms * 1e3, "copy_blocks_gb_s": gbs(copy_ms),
            "copy_blocks_launch_host_us": copy_launch_host_us,
            "copy_blocks_whole_call_host_us": copy_call_us,
            "device_memcpy_gb_s": gbs(memcpy_ms),
            "copy_blocks_vs_memcpy_time": memcpy_ms / copy_ms,
            "swap_out_scattered_gb_s": gbs(swap_ms), "swap_runs": runs,
            "swap_enqueue_host_us": swap_host_us,
            "pinned_memcpy_one_run_gb_s": gbs(pinned_ms),
            "swap_vs_pinned_memcpy_time": pinned_ms / swap_ms,
        }))
    }

    pub fn run() -> Result<Value> {
        let mut decode = Vec::new();
        for (batch, ctx) in [(64, 4096), (1, 32768)] {
            for scattered in [true, false] {
                decode.push(decode_case(
                    DType::BF16,
                    batch,
                    ctx,
                    scattered,
                    0,
                    0,
                    None,
                    false,
                )?);
            }
            decode.push(decode_case(
                DType::Fp8E4M3,
                batch,
                ctx,
                true,
                0,
                0,
                None,
                false,
            )?);
        }
        // The main case's baselines for the work-list launch's host-side changes: one forced split
        // beside the occupancy planner's choice, and bf16 queries and output beside f32.
        // (GQA 8 takes the tensor-core path, which ignores `unroll` and `vec_bytes`.)
        decode.push(decode_case(
            DType::BF16,
            64,
            4096,
            true,
            0,
            0,
            Some(1),
            false,
        )?);
        decode.push(decode_case(DType::BF16, 64, 4096, true, 0, 0, None, true)?);
        let probe = CudaStorage::new(
            KvLayout::new(shape(DType::BF16), 16)?,
            CudaStorageConfig::blocks(1),
        )?;
        Ok(json!({
            "device": probe.device().name, "sms": probe.device().num_sms,
            "iters": ITERS,
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
