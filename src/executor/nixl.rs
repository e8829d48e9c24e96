//! Moving blocks between the arenas of two processes with NVIDIA NIXL (feature `nixl`).
//!
//! A [`NixlAgent`] wraps one NIXL agent with a UCX backend. It registers a
//! [`HostStorage`] arena (one NIXL memory region per layer: each layer's blocks are one
//! contiguous tensor, [`KvLayout`]'s layer-major regions), hands out its
//! [metadata](NixlAgent::local_metadata) (NIXL's agent metadata plus the base address and
//! length of every registered region) for the caller to carry to a peer by any means,
//! [loads](NixlAgent::add_peer) a peer's metadata, and [reads](NixlAgent::read_blocks)
//! blocks of the peer's arena straight into blocks of its own.
//!
//! This layer moves pages and knows no sequences: which blocks to pull, admitting the
//! sequence on the receiver, checking the bytes against the export header's checksums
//! and committing them is [`crate::export::nixl`]'s part.
//!
//! # Layers
//!
//! | layer | what |
//! |---|---|
//! | `nixl-sys` (`stub-api`) | NIXL's C API, `dlopen`ed from `libnixl_capi.so` at the first call |
//! | [`nixl_available`] | the `dlopen` probe: without the library every `nixl-sys` call aborts the process, so every entry point here probes first and returns [`Error::Transport`] |
//! | [`NixlAgent`] | registration, metadata, descriptor lists from [`KvLayout`] addressing, one READ request per call, polled to a deadline |
//!
//! # Descriptors
//!
//! Block `b` of layer `l` is the run `region[l] + layout.block_byte_offset(b)` of
//! `layout.block_bytes_per_layer()` bytes, on both sides (the same layout is required).
//! One descriptor per (layer, block); consecutive pairs whose source and destination
//! blocks are both consecutive merge into one descriptor, so a sequence allocated in
//! order moves as one descriptor per layer.
//!
//! # Device memory
//!
//! Only host memory is registered here (`DRAM`). A GPU arena goes through the same calls
//! with NIXL's `VRAM` memory type and the device id: the regions of a
//! `executor::cuda` storage are device pointers of the same layer-major layout,
//! so only the registration changes (not built: these machines have no GPU).
//!
//! # Threads
//!
//! NIXL's Rust bindings ask for single-threaded tests; a [`NixlAgent`] is used from one
//! thread at a time (`&mut self` for everything that changes it).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, MemType, MemoryRegion, NixlDescriptor, NixlError, RegistrationHandle, XferDescList,
    XferOp, XferStatus,
};

use crate::error::{Error, Result};
use crate::executor::storage::{HostStorage, Storage};
use crate::ids::BlockId;
use crate::layout::KvLayout;

/// The library `nixl-sys`'s stubs load at the first call.
pub const NIXL_CAPI_LIBRARY: &str = "libnixl_capi.so";

const RTLD_NOW: c_int = 2;
const RTLD_LOCAL: c_int = 0;

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}

/// Whether NIXL's C API library can be loaded in this process (probed once, with the
/// same `dlopen` the `nixl-sys` stubs use, so a probe that passes means their first call
/// finds it too).
///
/// # Errors
/// [`Error::Transport`] with `dlopen`'s message when the library is missing (install the
/// `nixl-cu13` wheel and put its `.nixl_cu13.mesonpy.libs` folder on `LD_LIBRARY_PATH`).
pub fn nixl_available() -> Result<()> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let name = c"libnixl_capi.so";
            // SAFETY: `name` is a NUL-terminated string; loading a library runs its
            // initialisers, which is what the nixl-sys stubs would do at the first call
            // anyway. The handle is kept open for the life of the process on purpose
            // (the stubs' own dlopen of the same name then shares it).
            let handle = unsafe { dlopen(name.as_ptr(), RTLD_NOW | RTLD_LOCAL) };
            if handle.is_null() {
                // SAFETY: dlerror returns NULL or a NUL-terminated string owned by the C
                // library, valid until the next dl* call on this thread; copied at once.
                let msg = unsafe {
                    let e = dlerror();
                    if e.is_null() {
                        "unknown dlopen error".to_string()
                    } else {
                        CStr::from_ptr(e).to_string_lossy().into_owned()
                    }
                };
                Err(msg)
            } else {
                Ok(())
            }
        })
        .clone()
        .map_err(|detail| Error::Transport {
            op: "dlopen libnixl_capi.so",
            detail,
        })
}

fn nixl_err(op: &'static str) -> impl FnOnce(NixlError) -> Error {
    move |e| Error::Transport {
        op,
        detail: e.to_string(),
    }
}

/// One registered host region, as NIXL's descriptor trait wants it.
#[derive(Debug)]
struct HostRegion {
    addr: usize,
    len: usize,
}

impl MemoryRegion for HostRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for HostRegion {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// The arena an agent registered (its own), or a peer's as its metadata described it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ArenaDesc {
    block_bytes_per_layer: usize,
    num_blocks: usize,
    /// Base address and length of each layer's region.
    regions: Vec<(usize, usize)>,
}

impl ArenaDesc {
    fn of(storage: &HostStorage) -> Self {
        let layout = storage.layout();
        ArenaDesc {
            block_bytes_per_layer: layout.block_bytes_per_layer(),
            num_blocks: storage.num_blocks(),
            regions: (0..layout.num_layers())
                .map(|l| {
                    let r = storage.region(l);
                    (r.as_ptr() as usize, r.len())
                })
                .collect(),
        }
    }
}

const MD_MAGIC: [u8; 8] = *b"PKVNIXL1";

/// Stats of one completed transfer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferStats {
    /// Bytes moved.
    pub bytes: usize,
    /// NIXL descriptors in the request (after merging contiguous blocks).
    pub descriptors: usize,
    /// From creating the request to its completion.
    pub elapsed: Duration,
}

/// One NIXL agent with a UCX backend and at most one registered host arena.
///
/// Dropping it deregisters the arena and destroys the agent; a peer's transfers from
/// it fail afterwards (a typed error on the peer, see [`Self::read_blocks`]).
pub struct NixlAgent {
    // Field order is drop order: registrations go before the agent they belong to.
    registrations: Vec<RegistrationHandle>,
    arena: Option<ArenaDesc>,
    layout: Option<KvLayout>,
    peers: HashMap<String, ArenaDesc>,
    agent: Agent,
    name: String,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent")
            .field("name", &self.name)
            .field("arena", &self.arena)
            .field("peers", &self.peers.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl NixlAgent {
    /// Creates an agent named `name` (unique among the agents that will talk to each
    /// other) with NIXL's UCX backend. UCX reads its usual environment: `UCX_TLS=tcp`
    /// for TCP on machines without RDMA (what CI uses).
    ///
    /// # Errors
    /// [`Error::Transport`] when the NIXL library is missing ([`nixl_available`], probed
    /// first: nothing aborts the process), or creating the agent or the backend fails.
    pub fn new(name: &str) -> Result<Self> {
        nixl_available()?;
        let agent = Agent::new(name).map_err(nixl_err("create agent"))?;
        let (_mems, params) = agent
            .get_plugin_params("UCX")
            .map_err(nixl_err("UCX plugin parameters"))?;
        // The backend belongs to the agent (destroyed with it); the handle is not needed.
        agent
            .create_backend("UCX", &params)
            .map_err(nixl_err("create UCX backend"))?;
        Ok(NixlAgent {
            registrations: Vec::new(),
            arena: None,
            layout: None,
            peers: HashMap::new(),
            agent,
            name: name.to_string(),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers every layer region of `storage` with NIXL, so that peers can read its
    /// blocks and this agent can read into them.
    ///
    /// # Safety
    /// From this call until [`Self::deregister`] or the agent's drop, NIXL (and through
    /// it, peers' reads) may access the registered memory at any time:
    /// - `storage` must not be dropped, and its regions must not be reallocated
    ///   ([`HostStorage::resize_blocks`]), while registered;
    /// - bytes a peer reads while they are being written are whatever the peer sees (the
    ///   caller keeps a sequence's blocks unchanged until its receiver is done).
    ///
    /// The calls that write into local memory ([`Self::read_blocks`]) take the storage
    /// by `&mut` and check that it is still the registered one.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when an arena is already registered or `storage` has no
    /// blocks; [`Error::Transport`] when NIXL refuses a region (the regions registered
    /// before it are deregistered: nothing changed).
    pub unsafe fn register_host_arena(&mut self, storage: &HostStorage) -> Result<()> {
        if self.arena.is_some() {
            return Err(Error::config(
                "nixl arena",
                "this agent already registered an arena",
            ));
        }
        if storage.num_blocks() == 0 {
            return Err(Error::config("nixl arena", "the storage has no blocks"));
        }
        let desc = ArenaDesc::of(storage);
        let mut regs = Vec::with_capacity(desc.regions.len());
        for &(addr, len) in &desc.regions {
            let region = HostRegion { addr, len };
            // On error `regs` drops, deregistering what was registered.
            regs.push(
                self.agent
                    .register_memory(&region, None)
                    .map_err(nixl_err("register host region"))?,
            );
        }
        self.registrations = regs;
        self.arena = Some(desc);
        self.layout = Some(*storage.layout());
        Ok(())
    }

    /// Deregisters the arena (a no-op without one). Peers' reads from it fail afterwards.
    pub fn deregister(&mut self) {
        self.registrations.clear();
        self.arena = None;
        self.layout = None;
    }

    /// This agent's metadata for a peer: NIXL's agent metadata (connection details and
    /// the registered memory's keys) and the registered arena's region addresses. The
    /// caller carries the bytes (any side channel); the peer passes them to
    /// [`Self::add_peer`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] without a registered arena; [`Error::Transport`].
    pub fn local_metadata(&self) -> Result<Vec<u8>> {
        let arena = self.arena.as_ref().ok_or_else(|| {
            Error::config("nixl arena", "register an arena before sharing metadata")
        })?;
        let md = self
            .agent
            .get_local_md()
            .map_err(nixl_err("get local metadata"))?;
        let mut out = Vec::with_capacity(md.len() + 64 + 16 * arena.regions.len());
        out.extend_from_slice(&MD_MAGIC);
        out.extend_from_slice(&(md.len() as u64).to_le_bytes());
        out.extend_from_slice(&md);
        for v in [
            arena.block_bytes_per_layer,
            arena.num_blocks,
            arena.regions.len(),
        ] {
            out.extend_from_slice(&(v as u64).to_le_bytes());
        }
        for &(addr, len) in &arena.regions {
            out.extend_from_slice(&(addr as u64).to_le_bytes());
            out.extend_from_slice(&(len as u64).to_le_bytes());
        }
        let sum = xxhash_rust::xxh64::xxh64(&out, 0);
        out.extend_from_slice(&sum.to_le_bytes());
        Ok(out)
    }

    /// Loads a peer's [metadata](Self::local_metadata) and returns the peer's agent name,
    /// the name [`Self::read_blocks`] takes.
    ///
    /// # Errors
    /// [`Error::Checksum`] or [`Error::ExportFormat`] for bytes that are not an intact
    /// metadata blob, [`Error::Transport`] when NIXL refuses them. Nothing changed then.
    pub fn add_peer(&mut self, metadata: &[u8]) -> Result<String> {
        let (md, arena) = parse_metadata(metadata)?;
        let name = self
            .agent
            .load_remote_md(md)
            .map_err(nixl_err("load remote metadata"))?;
        self.peers.insert(name.clone(), arena);
        Ok(name)
    }

    /// Forgets a peer (its NIXL metadata too). A no-op for an unknown name.
    pub fn remove_peer(&mut self, peer: &str) {
        if self.peers.remove(peer).is_some() {
            // The metadata may already be gone on NIXL's side; either way it is now.
            let _ = self.agent.invalidate_remote_md(peer);
        }
    }

    /// Reads blocks of `peer`'s registered arena into blocks of `storage` (the
    /// registered arena): for each pair `(remote, local)`, every layer's bytes of
    /// block `remote` on the peer land in block `local` here. One NIXL READ request,
    /// polled until it completes or `timeout` passes.
    ///
    /// # Errors
    /// Before anything moves: [`Error::InvalidConfig`] when `storage` is not the
    /// registered arena (another layout, reallocated) or `peer` is unknown,
    /// [`Error::ShapeMismatch`] when the peer's arena has another block size or layer
    /// count, [`Error::BlockOutOfRange`] for a block past either arena.
    /// During the transfer: [`Error::Transport`] (a peer that is gone, a UCX error) and
    /// [`Error::TransportTimeout`]; the request is released before they return, and the
    /// destination blocks hold unspecified bytes (the caller frees them).
    pub fn read_blocks(
        &self,
        peer: &str,
        storage: &mut HostStorage,
        pairs: &[(BlockId, BlockId)],
        timeout: Duration,
    ) -> Result<TransferStats> {
        let (local, layout) = match (&self.arena, &self.layout) {
            (Some(a), Some(l)) => (a, l),
            _ => {
                return Err(Error::config(
                    "nixl arena",
                    "register an arena before transfers",
                ))
            }
        };
        if storage.layout() != layout || ArenaDesc::of(storage) != *local {
            return Err(Error::config(
                "nixl arena",
                "the storage is not the registered arena (other layout, or reallocated)",
            ));
        }
        let remote = self.peers.get(peer).ok_or_else(|| {
            Error::config(
                "nixl peer",
                format!("no metadata loaded for agent {peer:?}"),
            )
        })?;
        check_peer_arena(remote, local)?;
        for &(r, l) in pairs {
            for (block, num_blocks) in [(r, remote.num_blocks), (l, local.num_blocks)] {
                if block.index() >= num_blocks {
                    return Err(Error::BlockOutOfRange { block, num_blocks });
                }
            }
        }
        let start = Instant::now();
        if pairs.is_empty() {
            return Ok(TransferStats {
                bytes: 0,
                descriptors: 0,
                elapsed: start.elapsed(),
            });
        }
        let runs = merge_runs(pairs);
        let n = local.block_bytes_per_layer;
        // The destination addresses come from the unique borrow the transfer writes
        // under (they equal the registered ones, checked above).
        let local_bases: Vec<usize> = (0..layout.num_layers())
            .map(|l| storage.region_mut(l).as_mut_ptr() as usize)
            .collect();
        let mut local_list =
            XferDescList::new(MemType::Dram).map_err(nixl_err("descriptor list"))?;
        let mut remote_list =
            XferDescList::new(MemType::Dram).map_err(nixl_err("descriptor list"))?;
        let mut bytes = 0;
        for (&l_base, &(r_base, _)) in local_bases.iter().zip(&remote.regions) {
            for &(r, l, len) in &runs {
                let size = len * n;
                local_list.add_desc(l_base + layout.block_byte_offset(l), size, 0);
                remote_list.add_desc(r_base + layout.block_byte_offset(r), size, 0);
                bytes += size;
            }
        }
        let descriptors = runs.len() * local.regions.len();
        // The local memory is written by NIXL while this call holds `storage` by `&mut`:
        // nothing else reads or writes those blocks until the request is released.
        let req = self
            .agent
            .create_xfer_req(XferOp::Read, &local_list, &remote_list, peer, None)
            .map_err(nixl_err("create READ request"))?;
        let mut in_progress = self
            .agent
            .post_xfer_req(&req, None)
            .map_err(nixl_err("post READ request"))?;
        let deadline = start + timeout;
        let mut polls = 0u32;
        while in_progress {
            match self
                .agent
                .get_xfer_status(&req)
                .map_err(nixl_err("READ transfer"))?
            {
                XferStatus::Success => in_progress = false,
                XferStatus::InProgress => {
                    if Instant::now() >= deadline {
                        // Dropping `req` releases it (NIXL aborts a request in flight).
                        drop(req);
                        return Err(Error::TransportTimeout {
                            op: "READ transfer",
                            timeout_ms: timeout.as_millis() as u64,
                        });
                    }
                    // Spin briefly (small transfers finish in microseconds), then
                    // leave the core to UCX's progress thread.
                    polls += 1;
                    if polls < 64 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(20));
                    }
                }
            }
        }
        drop(req);
        Ok(TransferStats {
            bytes,
            descriptors,
            elapsed: start.elapsed(),
        })
    }
}

/// Fails unless the peer's arena pages like ours.
fn check_peer_arena(remote: &ArenaDesc, local: &ArenaDesc) -> Result<()> {
    if remote.block_bytes_per_layer != local.block_bytes_per_layer {
        return Err(Error::ShapeMismatch {
            what: "peer arena bytes per block and layer",
            expected: local.block_bytes_per_layer,
            got: remote.block_bytes_per_layer,
        });
    }
    if remote.regions.len() != local.regions.len() {
        return Err(Error::ShapeMismatch {
            what: "peer arena layers",
            expected: local.regions.len(),
            got: remote.regions.len(),
        });
    }
    Ok(())
}

/// `(remote, local)` pairs as runs `(remote start, local start, blocks)`: a pair extends
/// the previous run when both its blocks follow that run's.
fn merge_runs(pairs: &[(BlockId, BlockId)]) -> Vec<(BlockId, BlockId, usize)> {
    let mut runs: Vec<(BlockId, BlockId, usize)> = Vec::new();
    for &(r, l) in pairs {
        if let Some((r0, l0, len)) = runs.last_mut() {
            if r.index() == r0.index() + *len && l.index() == l0.index() + *len {
                *len += 1;
                continue;
            }
        }
        runs.push((r, l, 1));
    }
    runs
}

fn parse_metadata(bytes: &[u8]) -> Result<(&[u8], ArenaDesc)> {
    let bad = |what: &'static str, expected: u64, got: u64| Error::ExportFormat {
        what,
        expected,
        got,
    };
    if bytes.len() < 8 + 8 + 24 + 8 || bytes[..8] != MD_MAGIC {
        return Err(bad("NIXL agent metadata magic", 1, 0));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    let stored = read_u64(sum, 0);
    let got = xxhash_rust::xxh64::xxh64(body, 0);
    if stored != got {
        return Err(Error::Checksum {
            what: "NIXL agent metadata".into(),
            expected: stored,
            got,
        });
    }
    // The checksum passed, so the lengths below are the sender's; still bounds-checked.
    let md_len = read_u64(body, 8) as usize;
    let md_end = 16usize
        .checked_add(md_len)
        .filter(|&e| e + 24 <= body.len())
        .ok_or(bad(
            "NIXL agent metadata length",
            body.len() as u64,
            md_len as u64,
        ))?;
    let md = &body[16..md_end];
    let block_bytes_per_layer = read_u64(body, md_end) as usize;
    let num_blocks = read_u64(body, md_end + 8) as usize;
    let num_regions = read_u64(body, md_end + 16) as usize;
    let rest = &body[md_end + 24..];
    if Some(rest.len()) != num_regions.checked_mul(16) {
        return Err(bad(
            "NIXL agent metadata regions",
            num_regions as u64,
            (rest.len() / 16) as u64,
        ));
    }
    let regions = rest
        .chunks_exact(16)
        .map(|c| (read_u64(c, 0) as usize, read_u64(c, 8) as usize))
        .collect();
    Ok((
        md,
        ArenaDesc {
            block_bytes_per_layer,
            num_blocks,
            regions,
        },
    ))
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_pairs_merge_into_runs() {
        let p = |r: u32, l: u32| (BlockId(r), BlockId(l));
        let runs = merge_runs(&[p(3, 10), p(4, 11), p(5, 12), p(9, 13), p(10, 15), p(11, 16)]);
        assert_eq!(
            runs,
            vec![
                (BlockId(3), BlockId(10), 3),
                (BlockId(9), BlockId(13), 1),
                (BlockId(10), BlockId(15), 2)
            ]
        );
        assert!(merge_runs(&[]).is_empty());
    }

    #[test]
    fn metadata_round_trips_and_rejects_damage() {
        let arena = ArenaDesc {
            block_bytes_per_layer: 4096,
            num_blocks: 7,
            regions: vec![(0x1000, 7 * 4096), (0x9000, 7 * 4096)],
        };
        let md = b"opaque nixl bytes";
        let mut out = Vec::new();
        out.extend_from_slice(&MD_MAGIC);
        out.extend_from_slice(&(md.len() as u64).to_le_bytes());
        out.extend_from_slice(md);
        for v in [4096u64, 7, 2] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for (a, l) in [(0x1000u64, 7 * 4096u64), (0x9000, 7 * 4096)] {
            out.extend_from_slice(&a.to_le_bytes());
            out.extend_from_slice(&l.to_le_bytes());
        }
        let sum = xxhash_rust::xxh64::xxh64(&out, 0);
        out.extend_from_slice(&sum.to_le_bytes());
        let (got_md, got) = parse_metadata(&out).unwrap();
        assert_eq!((got_md, got), (&md[..], arena));
        let mut bad = out.clone();
        bad[20] ^= 1;
        assert!(matches!(parse_metadata(&bad), Err(Error::Checksum { .. })));
        assert!(parse_metadata(&out[..10]).is_err());
    }
}
