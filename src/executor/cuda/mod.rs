//! CUDA support shared by [`crate::executor::storage::CudaStorage`] and
//! [`crate::attention::cuda`]: finding a driver and a device, compiling the kernels in
//! `kernels/*.cu` with NVRTC (once per process and specialisation), and turning
//! driver and compiler failures into [`Error`]s.
//!
//! | layer | what | where |
//! |---|---|---|
//! | raw | `cudarc::driver::sys`, `cudarc::nvrtc::sys` (dynamically loaded) | cudarc |
//! | checked | [`driver_present`], [`nvrtc_present`], [`open_device`], [`compile`] | here |
//! | static model | `sass` (feature `testing`): the decode kernel's main loop read off its SASS, instructions per KV byte, occupancy, modeled bandwidth ceiling (no GPU); a tool for `tests/kernels/speed.rs`, not an engine's | here |
//! | bench cases | `bench_cases` (feature `testing`): the decode specialisations `examples/gpu_bench` launches | here |
//! | safe | `CudaStorage` (arena, streams, plans), `CudaAttention` (decode) | `storage::cuda`, `attention::cuda` |
//!
//! Nothing here needs a GPU to build: cudarc loads `libcuda` and `libnvrtc` when first
//! used, and every entry point first checks that the library can be loaded, so a
//! machine without them gets [`Error::CudaUnavailable`] instead of cudarc's panic.

mod nvrtc;
// Tooling: only `tests/kernels/speed.rs` (run by `.ci/run`) reads a cubin's SASS; an
// engine never does, so it is not compiled into an engine's build. Pure text
// analysis, so its own unit tests run in every test build of the library.
#[cfg(any(test, feature = "testing"))]
pub mod sass;
// Tooling: the decode specialisations `examples/gpu_bench` launches, which
// `tests/kernels/compile.rs` holds to the prebuilt catalog.
#[cfg(feature = "testing")]
pub mod bench_cases;

pub use nvrtc::{
    catalog, compile, compile_uncached, parse_ptxas_log, prebuilt_prefill, write_cubin, Arch,
    AttentionSpec, CompiledModule, KernelResources, KernelSpec, MlaSpec, PrefillSpec,
    ATTENTION_THREADS, CUBIN_DIR_ENV, PREBUILT_ATTENTION, PREFILL_WARPS,
};

use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext, DriverError};
use std::sync::Arc;

/// Maps a driver failure of `call` to [`Error::Cuda`], naming the call.
pub(crate) fn driver_err(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda(format!("{call}: {e}"))
}

/// Whether the CUDA driver library (`libcuda.so`) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: loading the library runs its initialisers, which is what every later
    // driver call does anyway; the handle is dropped at once.
    unsafe { sys::is_culib_present() }
}

/// Whether NVRTC (`libnvrtc.so`) can be loaded. It is found through the dynamic
/// loader's search path (`LD_LIBRARY_PATH`); `.ci/nvrtc-env` sets it up from PyPI.
pub fn nvrtc_present() -> bool {
    // SAFETY: as for `driver_present`.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// What pagedkv needs to know about a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// Compute capability.
    pub arch: Arch,
    /// Streaming multiprocessors (the split planner sizes grids by them).
    pub num_sms: usize,
    /// Bytes of device memory.
    pub total_bytes: usize,
    /// Bytes free when the device was opened.
    pub free_bytes: usize,
}

/// Opens device `ordinal` (its primary context) and describes it.
///
/// # Errors
/// [`Error::CudaUnavailable`] when there is no driver, no device, or no device with
/// this ordinal, or the device is older than sm_80; [`Error::Cuda`] when a driver call
/// fails after that.
pub fn open_device(ordinal: usize) -> Result<(Arc<CudaContext>, DeviceInfo)> {
    if !driver_present() {
        return Err(Error::CudaUnavailable(
            "no CUDA driver library (libcuda.so) found".into(),
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| Error::CudaUnavailable(format!("cuInit/cuDeviceGetCount: {e}")))?;
    if count <= 0 {
        return Err(Error::CudaUnavailable(
            "the driver reports no device".into(),
        ));
    }
    if ordinal >= count as usize {
        return Err(Error::CudaUnavailable(format!(
            "device {ordinal} requested, the driver reports {count}"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(driver_err("cuDeviceGetAttribute(compute capability)"))?;
    let arch = Arch {
        major: major as u32,
        minor: minor as u32,
    };
    if arch.major < 8 {
        return Err(Error::CudaUnavailable(format!(
            "device {ordinal} is {}; pagedkv's kernels need sm_80 or later",
            arch.sm()
        )));
    }
    let num_sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(driver_err("cuDeviceGetAttribute(SM count)"))? as usize;
    let (free_bytes, total_bytes) = ctx.mem_get_info().map_err(driver_err("cuMemGetInfo"))?;
    let name = ctx.name().map_err(driver_err("cuDeviceGetName"))?;
    Ok((
        ctx,
        DeviceInfo {
            ordinal,
            name,
            arch,
            num_sms,
            total_bytes,
            free_bytes,
        },
    ))
}
