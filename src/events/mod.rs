//! The prefix cache's events on vLLM's KV-event wire format, for KV-aware routers
//! (NVIDIA Dynamo's KV router, llm-d's indexer) that read what vLLM publishes.
//!
//! vLLM publishes a `KVEventBatch` per scheduler step, msgpack-encoded by `msgspec`
//! (`vllm/distributed/kv_events.py`). [`VllmEventEncoder`] writes the same bytes from
//! the crate's [`PrefixEvent`]s:
//!
//! - **The batch** (an `array_like` struct): the array `[ts, events, data_parallel_rank]`,
//!   `ts` a float64 (seconds since the Unix epoch, as `time.time()`), the rank an integer
//!   or nil. `msgspec` writes every field of an `array_like` struct, defaults included.
//! - **An event** (a tagged union: the tag is the class name), in one of two layouts
//!   ([`VllmEventLayout`]):
//!   - [`VllmEventLayout::TaggedMap`] (the default; vLLM's main branch, and what vLLM
//!     0.26 was seen to publish): a map whose first key is `"type"`, then the fields in
//!     declaration order, fields at their default omitted (`omit_defaults`):
//!     `{"type": "BlockStored", "block_hashes": [..], "parent_block_hash": int | nil,
//!     "token_ids": [..], "block_size": int, "lora_id": nil, "medium": "GPU", "lora_name":
//!     nil}`, `{"type": "BlockRemoved", "block_hashes": [..], "medium": "GPU"}`,
//!     `{"type": "AllBlocksCleared"}`. `"extra_keys"` follows `lora_name` when a block
//!     of the event was hashed with extra keys (below); on a hybrid cache `"group_idx"`
//!     follows (every `BlockStored` and `BlockRemoved` of group `g` says `g`, as vLLM's
//!     block pool writes its KV-cache group id), then in a `BlockStored`
//!     `"kv_cache_spec_kind"` and, for a window group, `"kv_cache_spec_sliding_window"`
//!     ([`VllmEventEncoder::groups_of`]); `locality`, `ownership` and `session_id` are
//!     left out.
//!   - [`VllmEventLayout::ArrayLike`] (older vLLM releases, whose event structs were
//!     `array_like` too): `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!     block_size, lora_id, medium, lora_name]` (then `extra_keys` when a block was
//!     keyed; on a hybrid cache `extra_keys` or nil, then `group_idx`, the kind and the
//!     window),
//!     `["BlockRemoved", block_hashes, medium]` (then `group_idx` on a hybrid cache),
//!     `["AllBlocksCleared"]`.
//!     `msgspec` ignores trailing elements it does not know, so releases from before
//!     `medium`, `lora_name` or `extra_keys` read these too.
//!
//! **`extra_keys`** (vLLM: `list[tuple | None] | None`, one entry per block of
//! `block_hashes`, "extra keys used in block hash computation"): sent only when some
//! block of the event has keyed spans ([`crate::AdmitOptions::block_keys`]), so events
//! without them are byte-for-byte what they were. A block with no span is nil; a keyed
//! block is the array of its spans, each `[identifier, offset_in_block]`: vLLM's
//! multimodal `(identifier, offset)` pair (what `VllmHasher` hashes for a span), the
//! identifier a string when the key is UTF-8, binary otherwise. NVIDIA Dynamo's reader
//! (`dynamo-kv-router` 1.6.1, `zmq_wire::ExtraKeyItem`) takes the string pairs (its
//! "hash with offset" items, vLLM 0.19+); it has no item for a binary identifier with
//! an offset, so engines feeding Dynamo should use text identifiers (vLLM's are hex
//! digests).
//!
//! Integers take msgpack's shortest form (positive fixint, then `uint 8/16/32/64`, as
//! `msgspec` writes them), strings `fixstr`/`str 8/16/32`, arrays and maps their shortest
//! header. Block hashes are the crate's 64-bit [`BlockHash`](crate::pool::prefix::BlockHash)es as unsigned
//! integers; with `pagedkv::pool::prefix::VllmHasher` (feature `vllm-hash`) those are
//! exactly the integers vLLM publishes for the same blocks (the digest's low 64 bits).
//!
//! Consecutive `BlockStored` events of one chain (each the parent of the next, same tier)
//! become one wire event with several hashes and the concatenated token ids, as vLLM
//! sends a request's new blocks; consecutive `BlockRemoved` of one tier become one. The
//! tier names are vLLM's: `"GPU"` for [`Medium::Device`], `"CPU"` for [`Medium::Host`];
//! `"DISK"` for [`Medium::Disk`] is not confirmed as a vLLM name (its offloading
//! mediums found are `"GPU"` and `"CPU"`) but is the one NVIDIA Dynamo's KV router reads as its disk tier
//! (`dynamo-kv-router` 1.6.1, `StorageTier::from_kv_medium`, which also accepts
//! `"CPU_TIER2"`, `"NVME"` and `"STORAGE"`, and writes `"DISK"`).
//!
//! With feature `kv-events`, `ZmqEventPublisher` sends the batches on vLLM's ZMQ wire
//! (a PUB socket and a replay ROUTER socket, module `zmq`), so a router subscribes to a
//! pagedkv engine as to vLLM.
//!
//! Unfinished: events carry no LoRA id or name (`nil`), and `extra_keys` holds only the
//! multimodal spans, not vLLM's per-block LoRA name, cache salt or prompt-embedding
//! items; hashes are never sent as 32-byte strings (vLLM's
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). The crate's LoRA identity already exists:
//! [`crate::AdmitOptions::extra_key`] enters the block hash's namespace (and
//! `VllmHasher` hashes it as vLLM's LoRA name), so a second `lora` option would be a
//! second identity for one namespace. What is missing is the namespace on the event:
//! the prefix index keeps it only on a chain's first block, while stores are announced
//! for every block, and again on relocation, after a reset and for the host and disk
//! tiers. Sending `lora_name` needs [`PrefixEvent::BlockStored`] to carry the
//! namespace and the index to keep it per block (or find it up the chain); a router
//! that salts its own hashes by `lora_name` (Dynamo does) must then be sent exactly the
//! name the engine's requests use. `lora_id` (deprecated in vLLM for `lora_name`) has
//! no counterpart: the crate has no integer adapter id.

#[cfg(feature = "kv-events")]
pub mod zmq;
#[cfg(feature = "kv-events")]
pub use zmq::{PubMode, ZmqEventPublisher, ZmqPublisherConfig, ZmqPublisherStats};

use crate::error::{Error, Result};
use crate::layout::shape::KvKind;
use crate::manager::KvCache;
use crate::pool::prefix::{Medium, PrefixEvent};

/// How events are laid out inside a batch (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VllmEventLayout {
    /// Maps whose first key is `"type"`, defaults omitted (vLLM's current layout).
    #[default]
    TaggedMap,
    /// Arrays whose first element is the tag (older vLLM releases).
    ArrayLike,
}

/// Encodes [`PrefixEvent`]s as vLLM `KVEventBatch` msgpack payloads.
///
/// ```
/// use pagedkv::events::VllmEventEncoder;
/// use pagedkv::pool::prefix::PrefixEvent;
/// let mut out = Vec::new();
/// let n = VllmEventEncoder::new().encode_batch(1.5, &[PrefixEvent::AllCleared], &mut out)?;
/// assert_eq!(n, 1);
/// // [1.5, [{"type": "AllBlocksCleared"}], 0]
/// assert_eq!(out[0], 0x93);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct VllmEventEncoder {
    layout: VllmEventLayout,
    data_parallel_rank: Option<u32>,
    drained: Vec<PrefixEvent>,
    /// Each KV-cache group's vLLM spec kind and sliding window, by group index
    /// ([`Self::groups_of`]); empty for a one-group cache.
    groups: Vec<(&'static str, Option<u32>)>,
}

impl Default for VllmEventEncoder {
    fn default() -> Self {
        Self::new()
    }
}

impl VllmEventEncoder {
    /// Tagged-map events, data-parallel rank 0 (what a vLLM publisher of rank 0 sends).
    pub fn new() -> Self {
        VllmEventEncoder {
            layout: VllmEventLayout::TaggedMap,
            data_parallel_rank: Some(0),
            drained: Vec::new(),
            groups: Vec::new(),
        }
    }

    /// Describes `kv`'s KV-cache groups in the events of a hybrid cache: each
    /// `BlockStored` of group `g` then also carries `kv_cache_spec_kind` (vLLM's
    /// `KVCacheSpecKind` value: `"full_attention"`, `"mla_attention"` for a latent
    /// layout, `"sliding_window"` with `kv_cache_spec_sliding_window` its tokens,
    /// `"mamba"` for a recurrent-state group), which a router reads to keep the
    /// groups it indexes (NVIDIA Dynamo's KV router learns each `group_idx`'s kind
    /// from them and indexes only full and latent attention). [`Self::drain_manager`]
    /// does this itself; call it for an encoder fed from an event channel. A
    /// one-group cache's events carry no group fields whatever this says.
    pub fn groups_of(mut self, kv: &KvCache) -> Self {
        self.learn_groups(kv);
        self
    }

    fn learn_groups(&mut self, kv: &KvCache) {
        self.groups.clear();
        if !kv.is_hybrid() {
            return;
        }
        for g in 0..kv.num_groups() {
            let group = kv.group(g);
            let wire = if kv.group_state_pages(g).is_some() {
                ("mamba", None)
            } else if let Some(w) = group.sliding_window() {
                ("sliding_window", u32::try_from(w).ok())
            } else if matches!(group.layout().kind(), KvKind::Latent { .. }) {
                ("mla_attention", None)
            } else {
                ("full_attention", None)
            };
            self.groups.push(wire);
        }
    }

    /// The event layout.
    pub fn layout(mut self, layout: VllmEventLayout) -> Self {
        self.layout = layout;
        self
    }

    /// The batch's `data_parallel_rank` (`None` writes nil).
    pub fn data_parallel_rank(mut self, rank: Option<u32>) -> Self {
        self.data_parallel_rank = rank;
        self
    }

    /// Appends one `KVEventBatch` holding `events` to `out`; returns how many wire
    /// events it holds (chains and runs of removals are merged, see the module docs).
    /// An empty `events` makes a batch with no events.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] when `ts` is not finite; nothing is written then.
    pub fn encode_batch(
        &self,
        ts: f64,
        events: &[PrefixEvent],
        out: &mut Vec<u8>,
    ) -> Result<usize> {
        if !ts.is_finite() {
            return Err(Error::OutOfRange {
                field: "ts",
                value: ts,
                allowed: "finite seconds since the Unix epoch",
            });
        }
        let runs = runs(events);
        // Every store's extra keys are read before a byte is written, so a malformed
        // one leaves `out` as it was.
        for e in events {
            if let PrefixEvent::BlockStored { extra_keys, .. } = e {
                block_spans(extra_keys)?;
            }
        }
        out.push(0x93);
        out.push(0xcb);
        out.extend_from_slice(&ts.to_bits().to_be_bytes());
        array_len(out, runs.len());
        for run in &runs {
            self.encode_event(run, out);
        }
        match self.data_parallel_rank {
            Some(r) => uint(out, u64::from(r)),
            None => out.push(NIL),
        }
        Ok(runs.len())
    }

    /// Drains `kv`'s recorded prefix events ([`KvCache::drain_prefix_events`];
    /// turn recording on with `PrefixConfig::record_events`) and appends them to `out`
    /// as one batch stamped `ts`. Returns the number of wire events; when there were no
    /// events it writes nothing and returns 0.
    ///
    /// # Errors
    /// As [`Self::encode_batch`]; the drained events are kept for the next call then.
    pub fn drain_manager(&mut self, kv: &mut KvCache, ts: f64, out: &mut Vec<u8>) -> Result<usize> {
        self.learn_groups(kv);
        kv.drain_prefix_events(&mut self.drained);
        if self.drained.is_empty() {
            return Ok(0);
        }
        let n = self.encode_batch(ts, &self.drained, out)?;
        self.drained.clear();
        Ok(n)
    }

    fn encode_event(&self, run: &[PrefixEvent], out: &mut Vec<u8>) {
        let maps = self.layout == VllmEventLayout::TaggedMap;
        match run.first() {
            Some(PrefixEvent::BlockStored {
                parent,
                block_size,
                medium,
                group,
                ..
            }) => {
                let keyed = run.iter().any(|e| {
                    matches!(e, PrefixEvent::BlockStored { extra_keys, .. } if !extra_keys.is_empty())
                });
                // A map omits `extra_keys` when no block is keyed; an array writes it
                // (nil) when `group_idx` follows, as fields are positional there.
                let with_keys = keyed || (!maps && group.is_some());
                let spec = group.and_then(|g| self.groups.get(usize::from(g)));
                let fields = 7
                    + usize::from(with_keys)
                    + usize::from(group.is_some())
                    + spec.map_or(0, |(_, w)| 1 + usize::from(w.is_some()));
                let mut field = header(out, maps, "BlockStored", fields);
                field(out, "block_hashes");
                array_len(out, run.len());
                for e in run {
                    if let PrefixEvent::BlockStored { hash, .. } = e {
                        uint(out, hash.0);
                    }
                }
                field(out, "parent_block_hash");
                match parent {
                    Some(p) => uint(out, p.0),
                    None => out.push(NIL),
                }
                field(out, "token_ids");
                let n_tokens = run
                    .iter()
                    .map(|e| match e {
                        PrefixEvent::BlockStored { token_ids, .. } => token_ids.len(),
                        _ => 0,
                    })
                    .sum();
                array_len(out, n_tokens);
                for e in run {
                    if let PrefixEvent::BlockStored { token_ids, .. } = e {
                        for &t in token_ids {
                            uint(out, u64::from(t));
                        }
                    }
                }
                field(out, "block_size");
                uint(out, *block_size as u64);
                field(out, "lora_id");
                out.push(NIL);
                field(out, "medium");
                str(out, medium_name(*medium));
                field(out, "lora_name");
                out.push(NIL);
                if keyed {
                    field(out, "extra_keys");
                    array_len(out, run.len());
                    for e in run {
                        if let PrefixEvent::BlockStored { extra_keys, .. } = e {
                            block_extra_keys(out, extra_keys);
                        }
                    }
                } else if with_keys {
                    out.push(NIL);
                }
                if let Some(g) = group {
                    field(out, "group_idx");
                    uint(out, u64::from(*g));
                }
                if let Some((kind, window)) = spec {
                    field(out, "kv_cache_spec_kind");
                    str(out, kind);
                    if let Some(w) = window {
                        field(out, "kv_cache_spec_sliding_window");
                        uint(out, u64::from(*w));
                    }
                }
            }
            Some(PrefixEvent::BlockRemoved { medium, group, .. }) => {
                let fields = 2 + usize::from(group.is_some());
                let mut field = header(out, maps, "BlockRemoved", fields);
                field(out, "block_hashes");
                array_len(out, run.len());
                for e in run {
                    if let PrefixEvent::BlockRemoved { hash, .. } = e {
                        uint(out, hash.0);
                    }
                }
                field(out, "medium");
                str(out, medium_name(*medium));
                if let Some(g) = group {
                    field(out, "group_idx");
                    uint(out, u64::from(*g));
                }
            }
            Some(PrefixEvent::AllCleared) | None => {
                // No fields: the field-name writer goes unused.
                let _ = header(out, maps, "AllBlocksCleared", 0);
            }
        }
    }
}

/// The keyed spans of one block's extra-key bytes (`offset_in_block: u32 LE ‖
/// len(key): u32 LE ‖ key`, repeated; see [`crate::AdmitOptions::block_keys`]) as
/// `(key, offset)` pairs, in order.
///
/// # Errors
/// [`Error::InvalidConfig`] (field `extra_keys`) when the bytes do not split into whole
/// spans (an event built by hand; the prefix index never makes one).
fn block_spans(mut bytes: &[u8]) -> Result<Vec<(&[u8], u32)>> {
    let malformed = |at: usize| {
        Error::config(
            "extra_keys",
            format!("block extra-key bytes end inside a span header or key ({at} bytes left)"),
        )
    };
    let mut spans = Vec::new();
    while !bytes.is_empty() {
        let (head, rest) = bytes
            .split_at_checked(8)
            .ok_or_else(|| malformed(bytes.len()))?;
        let word = |i: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&head[i..i + 4]);
            u32::from_le_bytes(w)
        };
        let (offset, len) = (word(0), word(4));
        let len = usize::try_from(len).map_err(|_| malformed(bytes.len()))?;
        let (key, rest) = rest
            .split_at_checked(len)
            .ok_or_else(|| malformed(bytes.len()))?;
        spans.push((key, offset));
        bytes = rest;
    }
    Ok(spans)
}

/// One block's entry of `extra_keys`: nil when no span starts in it, else the array of
/// its spans, each `[identifier, offset_in_block]` (vLLM's multimodal `(identifier,
/// offset)` pair, as its block hash takes it), the identifier a string when the key is
/// UTF-8 and binary otherwise (what `msgspec` writes for `str` and `bytes`).
/// [`VllmEventEncoder::encode_batch`] checked the bytes before writing anything.
fn block_extra_keys(out: &mut Vec<u8>, bytes: &[u8]) {
    let spans = block_spans(bytes).unwrap_or_default();
    if spans.is_empty() {
        out.push(NIL);
        return;
    }
    array_len(out, spans.len());
    for (key, offset) in spans {
        array_len(out, 2);
        match std::str::from_utf8(key) {
            Ok(s) => str(out, s),
            Err(_) => bin(out, key),
        }
        uint(out, u64::from(offset));
    }
}

/// vLLM's name for a tier (`MEDIUM_GPU`, and `"CPU"` for its host offloading).
fn medium_name(m: Medium) -> &'static str {
    match m {
        Medium::Device => "GPU",
        Medium::Host => "CPU",
        Medium::Disk => "DISK",
    }
}

/// Splits `events` into the runs that become one wire event each: a chain of stores
/// (each the parent of the next, same tier and block size), a run of removals from one
/// tier, or a single clear.
fn runs(events: &[PrefixEvent]) -> Vec<&[PrefixEvent]> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=events.len() {
        let joins = events
            .get(i)
            .is_some_and(|next| joins(&events[i - 1], next));
        if !joins {
            out.push(&events[start..i]);
            start = i;
        }
    }
    out
}

fn joins(prev: &PrefixEvent, next: &PrefixEvent) -> bool {
    match (prev, next) {
        (
            PrefixEvent::BlockStored {
                hash,
                medium,
                block_size,
                group,
                ..
            },
            PrefixEvent::BlockStored {
                parent: Some(p),
                medium: m,
                block_size: bs,
                group: g,
                ..
            },
        ) => p == hash && m == medium && bs == block_size && g == group,
        (
            PrefixEvent::BlockRemoved { medium, group, .. },
            PrefixEvent::BlockRemoved {
                medium: m,
                group: g,
                ..
            },
        ) => m == medium && g == group,
        _ => false,
    }
}

/// msgpack `nil`.
const NIL: u8 = 0xc0;

/// Writes the event's header (the map with its `"type"` entry, or the array with its
/// tag) for `fields` fields; returns the writer of a field's name (a map key, nothing
/// in an array).
fn header(
    out: &mut Vec<u8>,
    maps: bool,
    tag: &str,
    fields: usize,
) -> impl FnMut(&mut Vec<u8>, &str) {
    if maps {
        map_len(out, fields + 1);
        str(out, "type");
    } else {
        array_len(out, fields + 1);
    }
    str(out, tag);
    move |out: &mut Vec<u8>, name: &str| {
        if maps {
            str(out, name);
        }
    }
}

/// A non-negative integer in its shortest msgpack form.
fn uint(out: &mut Vec<u8>, n: u64) {
    if n < 0x80 {
        out.push(n as u8);
    } else if n <= u64::from(u8::MAX) {
        out.extend_from_slice(&[0xcc, n as u8]);
    } else if n <= u64::from(u16::MAX) {
        out.push(0xcd);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else if n <= u64::from(u32::MAX) {
        out.push(0xce);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

/// A length-prefixed header: the fix form (`fix | len` below `fix_max`), else the
/// 16- or 32-bit form. Lengths past `u32::MAX` cannot be built in memory here (each
/// element takes at least a byte), so they saturate instead of panicking.
fn len_header(out: &mut Vec<u8>, len: usize, fix: u8, fix_max: usize, wide16: u8, wide32: u8) {
    if len < fix_max {
        out.push(fix | len as u8);
    } else if let Ok(n) = u16::try_from(len) {
        out.push(wide16);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(wide32);
        out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    }
}

fn array_len(out: &mut Vec<u8>, len: usize) {
    len_header(out, len, 0x90, 16, 0xdc, 0xdd);
}

fn map_len(out: &mut Vec<u8>, len: usize) {
    len_header(out, len, 0x80, 16, 0xde, 0xdf);
}

/// A UTF-8 string: `fixstr` below 32 bytes, then `str 8/16/32`.
fn str(out: &mut Vec<u8>, s: &str) {
    let len = s.len();
    if len < 32 {
        out.push(0xa0 | len as u8);
    } else if let Ok(n) = u8::try_from(len) {
        out.extend_from_slice(&[0xd9, n]);
    } else if let Ok(n) = u16::try_from(len) {
        out.push(0xda);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

/// Binary data: `bin 8/16/32`.
fn bin(out: &mut Vec<u8>, b: &[u8]) {
    let len = b.len();
    if let Ok(n) = u8::try_from(len) {
        out.extend_from_slice(&[0xc4, n]);
    } else if let Ok(n) = u16::try_from(len) {
        out.push(0xc5);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(0xc6);
        out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    }
    out.extend_from_slice(b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_and_headers_take_the_shortest_form() {
        let enc = |n: u64| {
            let mut v = Vec::new();
            uint(&mut v, n);
            v
        };
        assert_eq!(enc(127), [0x7f]);
        assert_eq!(enc(128), [0xcc, 0x80]);
        assert_eq!(enc(256), [0xcd, 1, 0]);
        assert_eq!(enc(65_536), [0xce, 0, 1, 0, 0]);
        assert_eq!(enc(1 << 32), [0xcf, 0, 0, 0, 1, 0, 0, 0, 0]);
        let mut v = Vec::new();
        array_len(&mut v, 15);
        array_len(&mut v, 16);
        map_len(&mut v, 70_000);
        assert_eq!(v, [0x9f, 0xdc, 0, 16, 0xdf, 0, 1, 0x11, 0x70]);
        let mut s = Vec::new();
        str(&mut s, &"x".repeat(32));
        assert_eq!(&s[..2], [0xd9, 32]);
    }
}
