//! [`DiskPrefixStore`]: the disk level of the prefix cache, whose index survives a
//! restart.
//!
//! A tier directory holds two files:
//!
//! - `slots.bin`, block slots cut as by [`super::DiskTier`] (4 KiB-aligned, one whole
//!   block per slot, positional I/O);
//! - `index.journal`, a header and then append-only records, each checksummed, that
//!   say which cached block each slot holds and the XXH64 of its bytes.
//!
//! Reopening the directory ([`DiskPrefixStore::open`]) replays the journal. A store
//! writes the block's bytes first and appends its record after, so a crash between the
//! two leaves at worst a record naming bytes that did not land (or the old occupant's
//! record naming overwritten bytes); either way the slot fails its checksum on
//! [`DiskPrefixStore::load`], which then drops the entry and returns
//! [`Error::Checksum`]: a miss, never wrong K/V. A torn or corrupt record is dropped
//! on reopen and counted in [`DiskRecovery`]. Bytes reach the medium when the kernel
//! writes them back, or at [`DiskPrefixStore::sync`]; the journal is rewritten
//! (compacted: a new file, fsync, rename) when it holds more than twice as many
//! records as live entries.
//!
//! ## The journal
//!
//! All integers little-endian; XXH64 with seed 0.
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `pkvdjrnl` |
//! | 8..12 | `u32` format version ([`DISK_CACHE_FORMAT_VERSION`]) |
//! | 12..16 | `u32` dtype: 0 f32, 1 f16, 2 bf16, 3 fp8 e4m3 |
//! | 16..20 | `u32` kind: 0 standard K/V, 1 latent (MLA) |
//! | 20..24 | `u32` reserved, 0 |
//! | 24..80 | `u64` each: layers, KV heads, head dim, block size (tokens), block bytes, kv_lora_rank (0 for standard), slots in `slots.bin` |
//! | 80..88 | `u64` XXH64 of bytes 0..80 |
//! | then, per record | `u32` body length `n`, the body, `u64` XXH64 of the `4 + n` bytes before it |
//!
//! A record body is one of:
//!
//! | body | fields |
//! |---|---|
//! | store | `u8` 1, `u32` slot, `u64` block hash, `u64` XXH64 of the slot's bytes, `u8` flags (1 parent, 2 digest, 4 namespace, 8 extra key), `u64` parent hash (0 without), `i32` retention priority, 32-byte digest (flag 2 only), `u32` namespace length + bytes, `u32` extra-key length + bytes, `u32` token ids × block size |
//! | remove | `u8` 2, `u32` slot |
//!
//! Replaying, a store to a slot replaces whatever the slot held (an eviction writes no
//! record of its own) and a later store of a hash already held elsewhere replaces the
//! earlier one. A record whose checksum fails but whose length fits in the file is
//! skipped; a length that does not fit ends the replay (a torn tail). Recency is not
//! journaled: after a reopen the least recently *stored* entry is evicted first.

use std::collections::{BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh64::xxh64;

use super::disk::SlotFile;
use crate::error::{Error, Result};
use crate::executor::storage::Storage;
use crate::ids::{BlockId, DiskSlot};
use crate::layout::shape::{DType, KvKind};
use crate::layout::KvLayout;
use crate::pool::prefix::{BlockDigest, BlockHash};

/// The format version [`DiskPrefixStore`] writes and reads.
pub const DISK_CACHE_FORMAT_VERSION: u32 = 1;

/// Longest namespace (cache salt) or extra key a [`DiskEntry`] may carry, in bytes.
pub const MAX_DISK_KEY_BYTES: usize = 64 * 1024;

const MAGIC: [u8; 8] = *b"pkvdjrnl";
const HEADER_BYTES: usize = 88;
const DATA_FILE: &str = "slots.bin";
const JOURNAL_FILE: &str = "index.journal";
const JOURNAL_TMP: &str = "index.journal.tmp";
const KIND_STORE: u8 = 1;
const KIND_REMOVE: u8 = 2;
const FLAG_PARENT: u8 = 1;
const FLAG_DIGEST: u8 = 2;
const FLAG_NAMESPACE: u8 = 4;
const FLAG_EXTRA_KEY: u8 = 8;
/// Fixed part of a store body: kind, slot, hash, checksum, flags, parent, priority.
const STORE_FIXED_BYTES: usize = 1 + 4 + 8 + 8 + 1 + 8 + 4;
/// Records beyond twice the live entries before the journal is compacted; the slack
/// keeps a small store from rewriting its journal every few calls.
const COMPACT_SLACK_RECORDS: u64 = 64;

/// The identity of one cached block (defined with the prefix index, whose entries it
/// mirrors, so that the manager can adopt a store's entries; re-exported here).
pub use crate::pool::prefix::DiskEntry;

/// A block evicted by [`DiskPrefixStore::store`] to make room: the manager announces
/// it removed (medium [`crate::pool::prefix::Medium::Disk`], block = the slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskEviction {
    /// The evicted block's hash.
    pub hash: BlockHash,
    /// The slot it held (now holding the stored block).
    pub slot: DiskSlot,
}

/// What [`DiskPrefixStore::store`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "an eviction must be announced to the prefix index's listeners"]
pub enum DiskStoreOutcome {
    /// The block was written to `slot`, evicting `evicted` when the store was full.
    Stored {
        /// Where it lives now.
        slot: DiskSlot,
        /// The entry that made room, if one had to.
        evicted: Option<DiskEviction>,
    },
    /// The hash was held already (in `slot`); nothing was written.
    AlreadyPresent {
        /// Where it lives.
        slot: DiskSlot,
    },
}

/// What [`DiskPrefixStore::open`] found in the journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskRecovery {
    /// Records replayed.
    pub applied_records: u64,
    /// Records skipped: a checksum that failed, or a body that does not parse.
    pub dropped_records: u64,
    /// Bytes after the last record that could be framed (a torn append), dropped.
    pub dropped_tail_bytes: u64,
    /// Entries the replay left live.
    pub live_entries: usize,
}

/// Counters of a [`DiskPrefixStore`] since it was created or opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskCacheStats {
    /// Entries held.
    pub live_entries: usize,
    /// Bytes of block data they hold (`live_entries * block_bytes`).
    pub live_bytes: u64,
    /// Slots in the data file.
    pub capacity_blocks: usize,
    /// Blocks written.
    pub stores: u64,
    /// Stores of a hash already held (no-ops).
    pub duplicate_stores: u64,
    /// Blocks read back and verified.
    pub loads: u64,
    /// Loads of a hash not held.
    pub load_misses: u64,
    /// Loads whose bytes failed their checksum (the entry was dropped).
    pub checksum_failures: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// Entries removed by [`DiskPrefixStore::remove`].
    pub removes: u64,
    /// Journal rewrites.
    pub compactions: u64,
    /// Automatic compactions that failed (the journal kept growing; retried later).
    pub compaction_failures: u64,
    /// Bytes of the journal now.
    pub journal_bytes: u64,
    /// Records in the journal now.
    pub journal_records: u64,
    /// [`DiskRecovery::applied_records`] of the open.
    pub recovered_records: u64,
    /// [`DiskRecovery::dropped_records`] of the open.
    pub dropped_records: u64,
}

#[derive(Debug)]
struct Live {
    entry: DiskEntry,
    checksum: u64,
    last_used: u64,
}

/// The disk level of the prefix cache: cached blocks in a file of slots, indexed by a
/// checksummed journal that a reopen replays (see the module docs for the format).
///
/// ```
/// use pagedkv::executor::tier::{DiskEntry, DiskPrefixStore, DiskStoreOutcome};
/// use pagedkv::pool::prefix::BlockHash;
/// use pagedkv::{DType, KvLayout, ModelShape};
///
/// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1,
///                          head_dim: 8, kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 4)?;
/// let dir = std::env::temp_dir().join(format!("pagedkv-doc-disk-cache-{}", std::process::id()));
/// let entry = DiskEntry { hash: BlockHash(7), parent: None, tokens: vec![1, 2, 3, 4].into(),
///                         namespace: None, extra_key: None, priority: 0, digest: None };
/// let bytes = vec![0xab; layout.block_bytes()];
/// {
///     let mut store = DiskPrefixStore::create(&dir, &layout, 16)?;
///     let outcome = store.store(&entry, &bytes)?;
///     assert!(matches!(outcome, DiskStoreOutcome::Stored { evicted: None, .. }));
/// }
/// let mut store = DiskPrefixStore::open(&dir, &layout)?;   // after a restart
/// assert_eq!(store.chain_len(&[BlockHash(7), BlockHash(8)]), 1);
/// let mut out = vec![0; layout.block_bytes()];
/// assert!(store.load(BlockHash(7), &mut out)?);
/// assert_eq!(out, bytes);
/// # drop(store);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug)]
pub struct DiskPrefixStore {
    dir: PathBuf,
    layout: KvLayout,
    slots: SlotFile,
    journal: File,
    journal_len: u64,
    journal_records: u64,
    by_slot: Vec<Option<Live>>,
    by_hash: HashMap<BlockHash, u32>,
    /// Live entries per parent hash (whether that parent is held or not).
    children: HashMap<BlockHash, u32>,
    /// Every live entry by `(last_used, slot)`.
    lru: BTreeSet<(u64, u32)>,
    /// The live entries no live entry names as parent, by `(last_used, slot)`.
    leaves: BTreeSet<(u64, u32)>,
    /// Free slots; the next one is popped from the end.
    free: Vec<u32>,
    tick: u64,
    recovery: DiskRecovery,
    stats: DiskCacheStats,
    scratch: Vec<u8>,
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Io(format!("{what} {}: {e}", path.display()))
}

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Fp8E4M3 => 3,
    }
}

/// The header's layout fields, in header order, with their names for errors.
fn fingerprint(layout: &KvLayout) -> [(&'static str, u64); 8] {
    let shape = layout.shape();
    let (kind, rank) = match layout.kind() {
        KvKind::Standard => (0, 0),
        KvKind::Latent { kv_lora_rank, .. } => (1, kv_lora_rank as u64),
    };
    [
        (
            "disk tier layout: dtype code",
            u64::from(dtype_code(layout.dtype())),
        ),
        ("disk tier layout: kind (0 standard, 1 latent)", kind),
        ("disk tier layout: num_layers", shape.num_layers as u64),
        ("disk tier layout: num_kv_heads", shape.num_kv_heads as u64),
        ("disk tier layout: head_dim", shape.head_dim as u64),
        ("disk tier layout: block_size", layout.block_size() as u64),
        ("disk tier layout: block_bytes", layout.block_bytes() as u64),
        ("disk tier layout: kv_lora_rank", rank),
    ]
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// Compares two fingerprints; `expected` is the one on disk (or of the store).
fn check_fingerprint(
    expected: &[(&'static str, u64); 8],
    got: &[(&'static str, u64); 8],
) -> Result<()> {
    for (&(what, e), &(_, g)) in expected.iter().zip(got) {
        if e != g {
            return Err(Error::ShapeMismatch {
                what,
                expected: to_usize(e),
                got: to_usize(g),
            });
        }
    }
    Ok(())
}

fn header_bytes(layout: &KvLayout, capacity: usize) -> Vec<u8> {
    let f = fingerprint(layout);
    let mut h = Vec::with_capacity(HEADER_BYTES);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&DISK_CACHE_FORMAT_VERSION.to_le_bytes());
    h.extend_from_slice(&(f[0].1 as u32).to_le_bytes());
    h.extend_from_slice(&(f[1].1 as u32).to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    for &(_, v) in &f[2..] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    h.extend_from_slice(&(capacity as u64).to_le_bytes());
    let sum = xxh64(&h, 0);
    h.extend_from_slice(&sum.to_le_bytes());
    debug_assert_eq!(h.len(), HEADER_BYTES);
    h
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Checks a journal header against `layout`; returns the slot count it states.
fn parse_header(b: &[u8], layout: &KvLayout) -> Result<usize> {
    if b.len() < HEADER_BYTES {
        return Err(Error::DiskFormat {
            what: "journal header bytes",
            expected: HEADER_BYTES as u64,
            got: b.len() as u64,
        });
    }
    let magic = u64_at(b, 0);
    if magic != u64::from_le_bytes(MAGIC) {
        return Err(Error::DiskFormat {
            what: "journal magic",
            expected: u64::from_le_bytes(MAGIC),
            got: magic,
        });
    }
    let version = u32_at(b, 8);
    if version != DISK_CACHE_FORMAT_VERSION {
        return Err(Error::DiskFormat {
            what: "journal format version",
            expected: DISK_CACHE_FORMAT_VERSION.into(),
            got: version.into(),
        });
    }
    let sum = xxh64(&b[..HEADER_BYTES - 8], 0);
    let stored = u64_at(b, HEADER_BYTES - 8);
    if sum != stored {
        return Err(Error::DiskFormat {
            what: "journal header checksum",
            expected: stored,
            got: sum,
        });
    }
    let mut on_disk = fingerprint(layout);
    on_disk[0].1 = u32_at(b, 12).into();
    on_disk[1].1 = u32_at(b, 16).into();
    for (i, f) in on_disk[2..].iter_mut().enumerate() {
        f.1 = u64_at(b, 24 + 8 * i);
    }
    check_fingerprint(&on_disk, &fingerprint(layout))?;
    let capacity = u64_at(b, 72);
    if capacity >= u64::from(u32::MAX) {
        return Err(Error::DiskFormat {
            what: "journal slot count",
            expected: u64::from(u32::MAX) - 1,
            got: capacity,
        });
    }
    Ok(capacity as usize)
}

/// Frames a record body: length, body, checksum.
fn frame(body: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(body.len() + 12);
    r.extend_from_slice(&(body.len() as u32).to_le_bytes());
    r.extend_from_slice(body);
    let sum = xxh64(&r, 0);
    r.extend_from_slice(&sum.to_le_bytes());
    r
}

fn store_record(slot: u32, e: &DiskEntry, checksum: u64) -> Vec<u8> {
    let ns = e.namespace.as_deref().unwrap_or(&[]);
    let key = e.extra_key.as_deref().unwrap_or(&[]);
    let mut b =
        Vec::with_capacity(STORE_FIXED_BYTES + 40 + ns.len() + key.len() + 4 * e.tokens.len());
    let mut flags = 0;
    for (on, f) in [
        (e.parent.is_some(), FLAG_PARENT),
        (e.digest.is_some(), FLAG_DIGEST),
        (e.namespace.is_some(), FLAG_NAMESPACE),
        (e.extra_key.is_some(), FLAG_EXTRA_KEY),
    ] {
        if on {
            flags |= f;
        }
    }
    b.push(KIND_STORE);
    b.extend_from_slice(&slot.to_le_bytes());
    b.extend_from_slice(&e.hash.0.to_le_bytes());
    b.extend_from_slice(&checksum.to_le_bytes());
    b.push(flags);
    b.extend_from_slice(&e.parent.map_or(0, |p| p.0).to_le_bytes());
    b.extend_from_slice(&e.priority.to_le_bytes());
    if let Some(d) = e.digest {
        b.extend_from_slice(&d.0);
    }
    for part in [ns, key] {
        b.extend_from_slice(&(part.len() as u32).to_le_bytes());
        b.extend_from_slice(part);
    }
    for t in e.tokens.iter() {
        b.extend_from_slice(&t.to_le_bytes());
    }
    frame(&b)
}

fn remove_record(slot: u32) -> Vec<u8> {
    let mut b = vec![KIND_REMOVE];
    b.extend_from_slice(&slot.to_le_bytes());
    frame(&b)
}

/// A replayed record.
enum Record {
    Store {
        slot: u32,
        entry: DiskEntry,
        checksum: u64,
    },
    Remove {
        slot: u32,
    },
}

/// A reader over a record body that fails (with `None`) instead of running off it.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.b.get(self.at..end)?;
        self.at = end;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|s| s[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|s| u32_at(s, 0))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|s| u64_at(s, 0))
    }
}

/// Parses a record body whose checksum passed; `None` when it does not make sense for
/// this store (unknown kind, slot past the file, wrong token count, trailing bytes).
fn parse_body(body: &[u8], capacity: usize, block_size: usize) -> Option<Record> {
    let mut c = Cursor { b: body, at: 0 };
    let kind = c.u8()?;
    let slot = c.u32()?;
    if slot as usize >= capacity {
        return None;
    }
    let record = match kind {
        KIND_REMOVE => Record::Remove { slot },
        KIND_STORE => {
            let hash = BlockHash(c.u64()?);
            let checksum = c.u64()?;
            let flags = c.u8()?;
            if flags & !(FLAG_PARENT | FLAG_DIGEST | FLAG_NAMESPACE | FLAG_EXTRA_KEY) != 0 {
                return None;
            }
            let parent = c.u64()?;
            let priority = c.u32()? as i32;
            let digest = if flags & FLAG_DIGEST != 0 {
                let mut d = [0; 32];
                d.copy_from_slice(c.take(32)?);
                Some(BlockDigest(d))
            } else {
                None
            };
            let mut keys = [None, None];
            for (k, flag) in keys.iter_mut().zip([FLAG_NAMESPACE, FLAG_EXTRA_KEY]) {
                let len = c.u32()? as usize;
                if len > MAX_DISK_KEY_BYTES {
                    return None;
                }
                let bytes = c.take(len)?;
                if flags & flag != 0 {
                    *k = Some(Box::<[u8]>::from(bytes));
                } else if len != 0 {
                    return None;
                }
            }
            let raw = c.take(block_size.checked_mul(4)?)?;
            let tokens = raw.chunks_exact(4).map(|t| u32_at(t, 0)).collect();
            let [namespace, extra_key] = keys;
            Record::Store {
                slot,
                checksum,
                entry: DiskEntry {
                    hash,
                    parent: (flags & FLAG_PARENT != 0).then_some(BlockHash(parent)),
                    tokens,
                    namespace,
                    extra_key,
                    priority,
                    digest,
                },
            }
        }
        _ => return None,
    };
    (c.at == body.len()).then_some(record)
}

/// Largest record body a store of this block size writes.
fn max_body_bytes(block_size: usize) -> usize {
    STORE_FIXED_BYTES + 32 + 8 + 2 * MAX_DISK_KEY_BYTES + 4 * block_size
}

impl DiskPrefixStore {
    /// Creates a store in `dir` (made if missing) for `capacity_blocks` blocks of
    /// `layout`: the data file sized, an empty journal written and synced. Any store
    /// already in `dir` is replaced.
    ///
    /// # Errors
    /// [`Error::Io`] when a file cannot be made; [`Error::InvalidConfig`] for a
    /// capacity past the `u32` slot ids or a file size that overflows (checked before
    /// any file is touched). An I/O failure part way leaves the directory's old store
    /// damaged but never misread: its journal is replaced last (atomically), and an old
    /// journal over a truncated data file fails every checksum or the size check.
    pub fn create(dir: &Path, layout: &KvLayout, capacity_blocks: usize) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| io_err("create", dir, e))?;
        let data_path = dir.join(DATA_FILE);
        // Check the sizes before touching any file.
        let data_bytes = SlotFile::checked_file_bytes(layout, capacity_blocks)?;
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&data_path)
            .map_err(|e| io_err("open", &data_path, e))?;
        data.set_len(data_bytes)
            .map_err(|e| io_err("size", &data_path, e))?;
        let slots = SlotFile::new(data, layout, capacity_blocks)?;
        let header = header_bytes(layout, capacity_blocks);
        let journal = write_journal_file(dir, &header)?;
        let mut store = Self::empty(dir, layout, slots, journal, capacity_blocks);
        store.journal_len = header.len() as u64;
        store.finish_free_list();
        Ok(store)
    }

    /// Opens the store in `dir` written for `layout` and rebuilds its index from the
    /// journal. Dropped records (a torn tail, a failed checksum) are counted in
    /// [`Self::recovery`] and the journal is rewritten without them.
    ///
    /// # Errors
    /// [`Error::Io`] when a file is missing or unreadable; [`Error::DiskFormat`] for a
    /// wrong magic, version or header checksum, or a data file shorter than the
    /// journal's slot count says; [`Error::ShapeMismatch`] when the store was written
    /// for another layout (the field named, the stored value as `expected`). Nothing
    /// on disk changed on error, except a failed rewrite's temporary file.
    pub fn open(dir: &Path, layout: &KvLayout) -> Result<Self> {
        let journal_path = dir.join(JOURNAL_FILE);
        let bytes = std::fs::read(&journal_path).map_err(|e| io_err("read", &journal_path, e))?;
        let capacity = parse_header(&bytes, layout)?;
        let data_path = dir.join(DATA_FILE);
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&data_path)
            .map_err(|e| io_err("open", &data_path, e))?;
        let slots = SlotFile::new(data, layout, capacity)?;
        let data_len = slots
            .file()
            .metadata()
            .map_err(|e| io_err("stat", &data_path, e))?
            .len();
        if data_len < slots.file_bytes() {
            return Err(Error::DiskFormat {
                what: "data file bytes",
                expected: slots.file_bytes(),
                got: data_len,
            });
        }
        let journal = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&journal_path)
            .map_err(|e| io_err("open", &journal_path, e))?;
        let mut store = Self::empty(dir, layout, slots, journal, capacity);
        let (end, mut recovery) = store.replay(&bytes)?;
        store.journal_len = end as u64;
        store.finish_free_list();
        recovery.dropped_tail_bytes = (bytes.len() - end) as u64;
        recovery.live_entries = store.by_hash.len();
        store.recovery = recovery;
        store.stats.recovered_records = recovery.applied_records;
        store.stats.dropped_records = recovery.dropped_records;
        if recovery.dropped_records > 0 || recovery.dropped_tail_bytes > 0 {
            store.compact()?;
        }
        Ok(store)
    }

    fn empty(
        dir: &Path,
        layout: &KvLayout,
        slots: SlotFile,
        journal: File,
        capacity: usize,
    ) -> Self {
        DiskPrefixStore {
            dir: dir.to_path_buf(),
            layout: *layout,
            slots,
            journal,
            journal_len: 0,
            journal_records: 0,
            by_slot: (0..capacity).map(|_| None).collect(),
            by_hash: HashMap::new(),
            children: HashMap::new(),
            lru: BTreeSet::new(),
            leaves: BTreeSet::new(),
            free: Vec::new(),
            tick: 0,
            recovery: DiskRecovery::default(),
            stats: DiskCacheStats {
                capacity_blocks: capacity,
                ..DiskCacheStats::default()
            },
            scratch: Vec::new(),
        }
    }

    /// Applies every record of `bytes` after the header; returns where the last framed
    /// record ends and the counts.
    fn replay(&mut self, bytes: &[u8]) -> Result<(usize, DiskRecovery)> {
        let mut rec = DiskRecovery::default();
        let max_body = max_body_bytes(self.layout.block_size());
        let mut at = HEADER_BYTES;
        while bytes.len() - at >= 4 {
            let n = u32_at(bytes, at) as usize;
            let total = 4 + n + 8;
            if n > max_body || bytes.len() - at < total {
                break;
            }
            let framed = &bytes[at..at + 4 + n];
            let sum = u64_at(bytes, at + 4 + n);
            at += total;
            self.journal_records += 1;
            if xxh64(framed, 0) != sum {
                rec.dropped_records += 1;
                continue;
            }
            match parse_body(&framed[4..], self.by_slot.len(), self.layout.block_size()) {
                Some(Record::Store {
                    slot,
                    entry,
                    checksum,
                }) => {
                    self.remove_live(slot);
                    if let Some(&old) = self.by_hash.get(&entry.hash) {
                        self.remove_live(old);
                    }
                    self.insert_live(slot, entry, checksum);
                    rec.applied_records += 1;
                }
                Some(Record::Remove { slot }) => {
                    self.remove_live(slot);
                    rec.applied_records += 1;
                }
                None => rec.dropped_records += 1,
            }
        }
        Ok((at, rec))
    }

    /// Rebuilds the free list from the slot table (lowest slot handed out first).
    fn finish_free_list(&mut self) {
        self.free = (0..self.by_slot.len() as u32)
            .rev()
            .filter(|&s| self.by_slot[s as usize].is_none())
            .collect();
        self.sync_stats();
    }

    fn sync_stats(&mut self) {
        self.stats.live_entries = self.by_hash.len();
        self.stats.live_bytes = self.by_hash.len() as u64 * self.slots.block_bytes() as u64;
        self.stats.journal_bytes = self.journal_len;
        self.stats.journal_records = self.journal_records;
    }

    fn is_leaf(&self, hash: BlockHash) -> bool {
        self.children.get(&hash).is_none_or(|&n| n == 0)
    }

    /// Indexes `entry` in free `slot`; its hash must not be held.
    fn insert_live(&mut self, slot: u32, entry: DiskEntry, checksum: u64) {
        self.tick += 1;
        let key = (self.tick, slot);
        self.lru.insert(key);
        if self.is_leaf(entry.hash) {
            self.leaves.insert(key);
        }
        if let Some(p) = entry.parent {
            let n = self.children.entry(p).or_insert(0);
            *n += 1;
            if *n == 1 {
                if let Some(&ps) = self.by_hash.get(&p) {
                    if let Some(pl) = &self.by_slot[ps as usize] {
                        self.leaves.remove(&(pl.last_used, ps));
                    }
                }
            }
        }
        self.by_hash.insert(entry.hash, slot);
        self.by_slot[slot as usize] = Some(Live {
            entry,
            checksum,
            last_used: self.tick,
        });
    }

    /// Unindexes whatever `slot` holds (the caller returns the slot to the free list
    /// or reuses it).
    fn remove_live(&mut self, slot: u32) -> Option<Live> {
        let live = self.by_slot[slot as usize].take()?;
        self.by_hash.remove(&live.entry.hash);
        self.lru.remove(&(live.last_used, slot));
        self.leaves.remove(&(live.last_used, slot));
        if let Some(p) = live.entry.parent {
            if let Some(n) = self.children.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    self.children.remove(&p);
                    if let Some(&ps) = self.by_hash.get(&p) {
                        if let Some(pl) = &self.by_slot[ps as usize] {
                            self.leaves.insert((pl.last_used, ps));
                        }
                    }
                }
            }
        }
        Some(live)
    }

    fn touch(&mut self, slot: u32) {
        self.tick += 1;
        let tick = self.tick;
        let Some(live) = self.by_slot[slot as usize].as_mut() else {
            return;
        };
        let old = (live.last_used, slot);
        live.last_used = tick;
        self.lru.remove(&old);
        self.lru.insert((tick, slot));
        if self.leaves.remove(&old) {
            self.leaves.insert((tick, slot));
        }
    }

    /// The slot to evict: the least recently used leaf (an entry no other entry names
    /// as parent) other than `protect`, else the least recently used entry other than
    /// `protect`, else any (a store of one slot).
    fn victim(&self, protect: Option<u32>) -> Option<u32> {
        let other = |&&(_, s): &&(u64, u32)| Some(s) != protect;
        self.leaves
            .iter()
            .find(other)
            .or_else(|| self.lru.iter().find(other))
            .or_else(|| self.lru.first())
            .map(|&(_, s)| s)
    }

    /// Appends one framed record at the journal's end.
    fn append(&mut self, record: &[u8]) -> Result<()> {
        if let Err(e) = self.journal.write_all_at(record, self.journal_len) {
            // A partial append is overwritten by the next one (it writes at the same
            // offset) and dropped as a torn tail by a reopen; cut it now if we can.
            let _ = self.journal.set_len(self.journal_len);
            return Err(Error::Io(format!(
                "append to {}: {e}",
                self.dir.join(JOURNAL_FILE).display()
            )));
        }
        self.journal_len += record.len() as u64;
        self.journal_records += 1;
        Ok(())
    }

    /// Compacts the journal when it holds more than twice the live records (plus
    /// slack); a failure is counted, not returned: the call that got here succeeded.
    fn maybe_compact(&mut self) {
        let live = self.by_hash.len() as u64;
        if self.journal_records > 2 * live + COMPACT_SLACK_RECORDS && self.compact().is_err() {
            self.stats.compaction_failures += 1;
        }
        self.sync_stats();
    }

    /// Rewrites the journal with one store record per live entry, least recently used
    /// first (so a reopen keeps their order): written to a temporary file, synced,
    /// renamed over the journal, the directory synced.
    ///
    /// # Errors
    /// [`Error::Io`]; the old journal is then still in place and in use.
    pub fn compact(&mut self) -> Result<()> {
        let mut bytes = header_bytes(&self.layout, self.by_slot.len());
        for &(_, slot) in &self.lru {
            if let Some(live) = &self.by_slot[slot as usize] {
                bytes.extend_from_slice(&store_record(slot, &live.entry, live.checksum));
            }
        }
        let journal = write_journal_file(&self.dir, &bytes)?;
        self.journal = journal;
        self.journal_len = bytes.len() as u64;
        self.journal_records = self.by_hash.len() as u64;
        self.stats.compactions += 1;
        self.sync_stats();
        Ok(())
    }

    /// Whether the block with this hash is held.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// The slot holding this hash.
    pub fn slot_of(&self, hash: BlockHash) -> Option<DiskSlot> {
        self.by_hash.get(&hash).map(|&s| DiskSlot(s))
    }

    /// The identity of the block with this hash.
    pub fn entry(&self, hash: BlockHash) -> Option<&DiskEntry> {
        let &slot = self.by_hash.get(&hash)?;
        self.by_slot[slot as usize].as_ref().map(|l| &l.entry)
    }

    /// How many leading hashes of `chain` are held (a prefix lookup's disk hit, in
    /// blocks).
    pub fn chain_len(&self, chain: &[BlockHash]) -> usize {
        chain.iter().take_while(|h| self.contains(**h)).count()
    }

    /// Every held entry with its slot, parents first (by depth in the store, then
    /// slot), so a manager adopting them at startup registers each parent before its
    /// children. Entries on a parent cycle (only hash collisions make one) come last.
    pub fn entries(&self) -> Vec<(DiskSlot, &DiskEntry)> {
        let mut by_parent: HashMap<BlockHash, Vec<u32>> = HashMap::new();
        let mut depth: Vec<(u32, u32)> = Vec::with_capacity(self.by_hash.len());
        for (slot, live) in self.by_slot.iter().enumerate() {
            let Some(live) = live else { continue };
            match live.entry.parent {
                Some(p) if p != live.entry.hash && self.by_hash.contains_key(&p) => {
                    by_parent.entry(p).or_default().push(slot as u32);
                }
                _ => depth.push((1, slot as u32)),
            }
        }
        let mut next = 0;
        while next < depth.len() {
            let (d, slot) = depth[next];
            next += 1;
            if let Some(live) = &self.by_slot[slot as usize] {
                if let Some(kids) = by_parent.remove(&live.entry.hash) {
                    depth.extend(kids.into_iter().map(|k| (d + 1, k)));
                }
            }
        }
        let mut cyclic: Vec<u32> = by_parent.into_values().flatten().collect();
        depth.sort_unstable();
        cyclic.sort_unstable();
        depth
            .into_iter()
            .map(|(_, s)| s)
            .chain(cyclic)
            .filter_map(|s| Some((DiskSlot(s), &self.by_slot[s as usize].as_ref()?.entry)))
            .collect()
    }

    fn check_entry(&self, entry: &DiskEntry, bytes_len: usize) -> Result<()> {
        if bytes_len != self.slots.block_bytes() {
            return Err(Error::ShapeMismatch {
                what: "bytes of one disk slot",
                expected: self.slots.block_bytes(),
                got: bytes_len,
            });
        }
        if entry.tokens.len() != self.layout.block_size() {
            return Err(Error::ShapeMismatch {
                what: "token ids of one disk-cached block",
                expected: self.layout.block_size(),
                got: entry.tokens.len(),
            });
        }
        for (what, key) in [
            ("disk-cached namespace", &entry.namespace),
            ("disk-cached extra key", &entry.extra_key),
        ] {
            let len = key.as_ref().map_or(0, |k| k.len());
            if len > MAX_DISK_KEY_BYTES {
                return Err(Error::PrefixKeyTooLong {
                    what,
                    len,
                    limit: MAX_DISK_KEY_BYTES,
                });
            }
        }
        Ok(())
    }

    /// Stores one block: its bytes into a free slot (or the slot of an evicted entry
    /// when the store is full: the least recently used leaf, never the new block's
    /// parent unless it is the only entry), then its journal record. A hash already
    /// held is a no-op, reported as [`DiskStoreOutcome::AlreadyPresent`].
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for `bytes` that are not one block or token ids that
    /// are not `block_size` of them; [`Error::PrefixKeyTooLong`] for a key past
    /// [`MAX_DISK_KEY_BYTES`]; [`Error::TierFull`] for a store of no slots;
    /// [`Error::Io`] when the data write or the journal append fails. The index is
    /// unchanged on error; an eviction victim whose bytes were overwritten by a failed
    /// store stays indexed and fails its checksum when loaded (then dropped).
    pub fn store(&mut self, entry: &DiskEntry, bytes: &[u8]) -> Result<DiskStoreOutcome> {
        self.check_entry(entry, bytes.len())?;
        if let Some(&slot) = self.by_hash.get(&entry.hash) {
            self.stats.duplicate_stores += 1;
            return Ok(DiskStoreOutcome::AlreadyPresent {
                slot: DiskSlot(slot),
            });
        }
        let (slot, victim) = match self.free.last() {
            Some(&s) => (s, None),
            None => {
                let protect = entry.parent.and_then(|p| self.by_hash.get(&p).copied());
                match self.victim(protect) {
                    Some(s) => (s, Some(s)),
                    None => {
                        return Err(Error::TierFull {
                            tier: "disk",
                            needed: 1,
                            free: 0,
                        })
                    }
                }
            }
        };
        let checksum = xxh64(bytes, 0);
        // Bytes first, record after: a record never names bytes not yet written.
        self.slots.write(DiskSlot(slot), bytes)?;
        self.append(&store_record(slot, entry, checksum))?;
        let evicted = match victim {
            None => {
                self.free.pop();
                None
            }
            Some(s) => {
                let gone = self.remove_live(s);
                self.stats.evictions += 1;
                gone.map(|l| DiskEviction {
                    hash: l.entry.hash,
                    slot: DiskSlot(s),
                })
            }
        };
        self.insert_live(slot, entry.clone(), checksum);
        self.stats.stores += 1;
        self.maybe_compact();
        Ok(DiskStoreOutcome::Stored {
            slot: DiskSlot(slot),
            evicted,
        })
    }

    /// Reads the block with this hash into `out` and checks its bytes; `Ok(false)` on
    /// a miss. A hit becomes the most recently used entry.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `out` is not one block; [`Error::Io`] when the
    /// read fails (the entry stays); [`Error::Checksum`] when the bytes differ from
    /// what was stored: the entry is then removed (a miss from then on). `out` is
    /// zeroed after either, so wrong K/V never leave the store.
    pub fn load(&mut self, hash: BlockHash, out: &mut [u8]) -> Result<bool> {
        if out.len() != self.slots.block_bytes() {
            return Err(Error::ShapeMismatch {
                what: "bytes of one disk slot",
                expected: self.slots.block_bytes(),
                got: out.len(),
            });
        }
        let Some(&slot) = self.by_hash.get(&hash) else {
            self.stats.load_misses += 1;
            return Ok(false);
        };
        let expected = self.by_slot[slot as usize]
            .as_ref()
            .map_or(0, |l| l.checksum);
        if let Err(e) = self.slots.read(DiskSlot(slot), out) {
            out.fill(0);
            return Err(e);
        }
        let got = xxh64(out, 0);
        if got != expected {
            out.fill(0);
            self.stats.checksum_failures += 1;
            // The entry goes whether or not its removal reaches the journal: a reopen
            // that brings it back finds the same bad bytes and drops it again.
            let _ = self.append(&remove_record(slot));
            self.remove_live(slot);
            self.free.push(slot);
            self.maybe_compact();
            return Err(Error::Checksum {
                what: format!("disk cache {} of block {hash}", DiskSlot(slot)),
                expected,
                got,
            });
        }
        self.touch(slot);
        self.stats.loads += 1;
        Ok(true)
    }

    /// Removes the block with this hash; returns the slot it held (`None`: not held,
    /// nothing done).
    ///
    /// # Errors
    /// [`Error::Io`] when the journal append fails; the entry then stays.
    pub fn remove(&mut self, hash: BlockHash) -> Result<Option<DiskSlot>> {
        let Some(&slot) = self.by_hash.get(&hash) else {
            return Ok(None);
        };
        self.append(&remove_record(slot))?;
        self.remove_live(slot);
        self.free.push(slot);
        self.stats.removes += 1;
        self.maybe_compact();
        Ok(Some(DiskSlot(slot)))
    }

    fn check_storage<S: Storage + ?Sized>(&self, storage: &S) -> Result<()> {
        check_fingerprint(&fingerprint(&self.layout), &fingerprint(storage.layout()))
    }

    /// [`Self::store`] of host-tier block `host_block` of `storage` (read with
    /// [`Storage::read_host_block`]); a hash already held is not read at all.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a storage of another layout; the storage's read
    /// errors ([`Error::BlockOutOfRange`], [`Error::Unsupported`] for a storage
    /// without a host tier); as [`Self::store`].
    pub fn store_from<S: Storage + ?Sized>(
        &mut self,
        storage: &S,
        host_block: BlockId,
        entry: &DiskEntry,
    ) -> Result<DiskStoreOutcome> {
        self.check_storage(storage)?;
        self.check_entry(entry, self.slots.block_bytes())?;
        if let Some(&slot) = self.by_hash.get(&entry.hash) {
            self.stats.duplicate_stores += 1;
            return Ok(DiskStoreOutcome::AlreadyPresent {
                slot: DiskSlot(slot),
            });
        }
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(self.slots.block_bytes(), 0);
        let result = storage
            .read_host_block(host_block, &mut buf)
            .and_then(|()| self.store(entry, &buf));
        self.scratch = buf;
        result
    }

    /// [`Self::load`] into host-tier block `host_block` of `storage` (written with
    /// [`Storage::write_host_block`] only once the bytes passed their checksum);
    /// `Ok(false)` on a miss, the host block untouched.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a storage of another layout; as [`Self::load`]
    /// (the host block untouched); the storage's write errors (the entry stays).
    pub fn load_into<S: Storage + ?Sized>(
        &mut self,
        storage: &mut S,
        host_block: BlockId,
        hash: BlockHash,
    ) -> Result<bool> {
        self.check_storage(storage)?;
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(self.slots.block_bytes(), 0);
        let result = match self.load(hash, &mut buf) {
            Ok(true) => storage.write_host_block(host_block, &buf).map(|()| true),
            other => other,
        };
        self.scratch = buf;
        result
    }

    /// Flushes the data file and the journal to the medium (`fdatasync` both, data
    /// first): every call that returned before survives a power loss.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn sync(&self) -> Result<()> {
        self.slots
            .file()
            .sync_data()
            .map_err(|e| io_err("sync", &self.dir.join(DATA_FILE), e))?;
        self.journal
            .sync_data()
            .map_err(|e| io_err("sync", &self.dir.join(JOURNAL_FILE), e))
    }

    /// What the open found in the journal (all zero for a created store).
    pub fn recovery(&self) -> DiskRecovery {
        self.recovery
    }

    /// Counters since the store was created or opened.
    pub fn stats(&self) -> DiskCacheStats {
        self.stats
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Slots in the data file.
    pub fn capacity_blocks(&self) -> usize {
        self.by_slot.len()
    }

    /// Bytes of one block (what a slot holds).
    pub fn block_bytes(&self) -> usize {
        self.slots.block_bytes()
    }

    /// The layout the store was made for.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The tier directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Writes `bytes` as the journal of `dir`: a temporary file, synced, renamed over the
/// journal, the directory synced. Returns the new journal, open for appends.
fn write_journal_file(dir: &Path, bytes: &[u8]) -> Result<File> {
    let tmp = dir.join(JOURNAL_TMP);
    let path = dir.join(JOURNAL_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| io_err("create", &tmp, e))?;
    file.write_all_at(bytes, 0)
        .map_err(|e| io_err("write", &tmp, e))?;
    file.sync_all().map_err(|e| io_err("sync", &tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io_err("rename to", &path, e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("sync", dir, e))?;
    Ok(file)
}
