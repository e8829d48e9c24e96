//! The index's side of spilling cached blocks to the host tier and back: which blocks
//! an eviction of everything evictable would drop, a registered block's content saved
//! apart from the arena, and that content registered again on another block.
//!
//! A child of `index` so that it reads entries directly; the index itself only gains
//! the `mod` line.

use std::sync::Arc;

use super::{Entry, Namespace, PrefixIndex};
use crate::ids::BlockId;
use crate::ids::DiskSlot;
use crate::pool::prefix::{BlockDigest, BlockHash, Medium, PrefixEvent};

/// A registered block's content, kept while its bytes live outside the device arena:
/// everything `register` needs to make it findable again, under the same hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SavedEntry {
    pub(crate) hash: BlockHash,
    pub(crate) parent: Option<BlockHash>,
    /// Depth in its chain (1 for a first block): parents come first when sorted by it.
    pub(crate) depth: u32,
    pub(crate) last_used: u64,
    ns: Option<Arc<[u8]>>,
    key: Option<Arc<[u8]>>,
    priority: i32,
    tokens: Box<[u32]>,
    /// The chain digest, for a digest-chaining hasher (a later block's namespace is
    /// not kept, so it could not be hashed again).
    digest: Option<BlockDigest>,
}

/// The identity of one cached block: everything the prefix index needs to make it
/// findable again under the same hash (the content of the index's saved entries, less
/// its run-time recency and depth).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskEntry {
    /// The block's content hash.
    pub hash: BlockHash,
    /// The hash of the block before it in its chain (`None` for a first block).
    pub parent: Option<BlockHash>,
    /// Its token ids: exactly `block_size` of them.
    pub tokens: Box<[u32]>,
    /// The namespace (cache salt) bytes it was hashed under, if any.
    pub namespace: Option<Box<[u8]>>,
    /// The block's extra-key bytes, if any.
    pub extra_key: Option<Box<[u8]>>,
    /// Its retention priority.
    pub priority: i32,
    /// The full chain digest, for a digest-chaining hasher.
    pub digest: Option<BlockDigest>,
}

impl PrefixIndex {
    /// The cached blocks that evicting everything evictable would evict: cached and
    /// unpinned, with no descendant that is referenced or pinned (such a block never
    /// becomes a leaf). Parents first: by depth, then most recently used first, then
    /// block id, so any leading part of the list is closed under parents.
    pub(crate) fn evictable_closure(&self) -> Vec<BlockId> {
        let n = self.entries.len();
        let mut kept = vec![false; n];
        for (i, e) in self.entries.iter().enumerate() {
            let Some(e) = e else { continue };
            if e.cached && e.pins == 0 {
                continue;
            }
            // Mark this block and its ancestors; stop at one already marked (its
            // ancestors are too).
            let mut at = Some(i);
            while let Some(j) = at {
                if std::mem::replace(&mut kept[j], true) {
                    break;
                }
                at = self.entries[j]
                    .as_ref()
                    .and_then(Entry::parent)
                    .and_then(|ph| self.block_of(ph))
                    .map(BlockId::index);
            }
        }
        let mut out: Vec<(u32, std::cmp::Reverse<u64>, BlockId)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let e = e.as_ref()?;
                (e.cached && e.pins == 0 && !kept[i]).then_some((
                    e.depth,
                    std::cmp::Reverse(e.last_used),
                    BlockId(i as u32),
                ))
            })
            .collect();
        out.sort_unstable();
        out.into_iter().map(|(_, _, b)| b).collect()
    }

    /// The content of registered block `b`, to register again elsewhere later.
    pub(crate) fn save_entry(&self, b: BlockId) -> Option<SavedEntry> {
        let e: &Entry = self.entry(b)?;
        Some(SavedEntry {
            hash: e.hash,
            parent: e.parent(),
            depth: e.depth,
            last_used: e.last_used,
            ns: self.cold_entry(b, e).and_then(|c| c.ns.clone()),
            key: self.cold_entry(b, e).and_then(|c| c.key.clone()),
            priority: e.priority,
            tokens: self.block_tokens(b).into(),
            digest: self.digest_of(b),
        })
    }

    /// Registers live block `b` with the saved content, under its old hash and parent.
    /// Returns `false` (changing nothing but the duplicate counter) when the hash is
    /// registered already or the parent is not.
    pub(crate) fn restore_entry(&mut self, b: BlockId, saved: &SavedEntry) -> bool {
        let ns = Namespace {
            key: saved.ns.clone().unwrap_or_else(|| Arc::from(&[][..])),
            // Unused by `register` (the hash is given); the default keeps it defined.
            seed: self.default_ns.seed,
        };
        self.recent_digest = saved.digest.map(|d| (saved.hash, d));
        self.register(
            b,
            saved.hash,
            saved.parent,
            None,
            &ns,
            saved.key.as_ref(),
            &saved.tokens,
            saved.priority,
        ) == super::Registration::Stored
    }

    /// Announces that `saved`'s content now lives in (`stored`) or left (`!stored`)
    /// host-tier block `host`, for a router's copy of the index.
    pub(crate) fn announce_host(&mut self, saved: &SavedEntry, host: BlockId, stored: bool) {
        if !self.events_on() {
            return;
        }
        let event = if stored {
            PrefixEvent::BlockStored {
                hash: saved.hash,
                parent: saved.parent,
                block: host,
                token_ids: saved.tokens.to_vec(),
                block_size: self.block_size,
                extra_keys: saved.key.as_deref().map(<[u8]>::to_vec).unwrap_or_default(),
                medium: Medium::Host,
                group: self.group,
            }
        } else {
            PrefixEvent::BlockRemoved {
                hash: saved.hash,
                block: host,
                medium: Medium::Host,
                group: self.group,
            }
        };
        self.emit(event);
    }
}

/// The host level of the prefix cache (`manager/tier_cache.rs`): confirming a host
/// entry's content, hashing past the device chain, and holding device blocks while a
/// store reads them.
impl SavedEntry {
    /// Whether the saved content is exactly this: chained under `parent`, the same
    /// token ids and extra-key bytes, and for a first block the same namespace (the
    /// comparison [`PrefixIndex::confirms`] makes for a device block).
    pub(crate) fn confirms(
        &self,
        parent: Option<BlockHash>,
        ns: &Namespace,
        tokens: &[u32],
        extra: &[u8],
    ) -> bool {
        self.parent == parent
            && *self.tokens == *tokens
            && self.key.as_deref().map_or(extra.is_empty(), |k| k == extra)
            && (self.parent.is_some() || self.ns.as_deref() == Some(&*ns.key))
    }
}

impl PrefixIndex {
    /// The hash (and, for a digest-chaining hasher, the digest) of the block `tokens`
    /// chained after a block with hash `parent` and digest `parent_digest` (`None`: a
    /// first block of `ns`), wherever that parent lives.
    pub(crate) fn chain_hash(
        &self,
        parent: Option<BlockHash>,
        parent_digest: Option<&BlockDigest>,
        ns: &Namespace,
        tokens: &[u32],
        extra: &[u8],
    ) -> (BlockHash, Option<BlockDigest>) {
        if self.digests.is_empty() {
            let h = self
                .config
                .hasher
                .block(parent.unwrap_or(ns.seed), tokens, extra);
            return (h, None);
        }
        let (salt, extra_key) = ns.parts();
        let d = self
            .config
            .hasher
            .block_digest(parent_digest, salt, extra_key, tokens, extra);
        (d.key(), Some(d))
    }

    /// Hits on registered block `b` since it was registered (0 when it is not).
    pub(crate) fn hits_of(&self, b: BlockId) -> u32 {
        self.entry(b).map_or(0, |e| e.hits)
    }

    /// Every registered block, parents first (by depth, then block id).
    pub(crate) fn registered_by_depth(&self) -> Vec<BlockId> {
        let mut out: Vec<(u32, BlockId)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| Some((e.as_ref()?.depth, BlockId(i as u32))))
            .collect();
        out.sort_unstable();
        out.into_iter().map(|(_, b)| b).collect()
    }

    /// Cached block `b` was revived by a holder that is not a request (a store to the
    /// host level reading it): it leaves the candidates without counting as a hit.
    pub(crate) fn on_hold(&mut self, b: BlockId) {
        let Some(e) = self.entry_mut(b) else { return };
        if !e.cached {
            return;
        }
        e.cached = false;
        let (candidate, pinned) = (e.take_candidate(), e.pins > 0);
        if let Some((p, k)) = candidate {
            self.candidates.remove(p, k, b.0);
        }
        if pinned {
            self.pinned_cached -= 1;
        }
    }
}

/// The disk level of the prefix cache (`manager/tier_cache.rs`): a saved entry as the
/// identity a disk store keeps, and back.
impl SavedEntry {
    /// The identity a disk store keeps for this content (recency and depth are the
    /// manager's, not the store's).
    pub(crate) fn to_disk_entry(&self) -> DiskEntry {
        DiskEntry {
            hash: self.hash,
            parent: self.parent,
            tokens: self.tokens.clone(),
            namespace: self.ns.as_deref().map(Box::from),
            extra_key: self.key.as_deref().map(Box::from),
            priority: self.priority,
            digest: self.digest,
        }
    }

    /// The saved entry of a block a disk store holds, at `depth` in its chain.
    pub(crate) fn from_disk_entry(e: &DiskEntry, depth: u32) -> SavedEntry {
        SavedEntry {
            hash: e.hash,
            parent: e.parent,
            depth,
            last_used: 0,
            ns: e.namespace.as_deref().map(Arc::from),
            key: e.extra_key.as_deref().map(Arc::from),
            priority: e.priority,
            tokens: e.tokens.clone(),
            digest: e.digest,
        }
    }

    /// The chain digest (for a digest-chaining hasher).
    pub(crate) fn digest(&self) -> Option<BlockDigest> {
        self.digest
    }
}

impl PrefixIndex {
    /// Announces that `saved`'s content now lives in (`stored`) or left (`!stored`)
    /// disk slot `slot` of the disk level (the event's block is the slot's index).
    pub(crate) fn announce_disk(&mut self, saved: &SavedEntry, slot: DiskSlot, stored: bool) {
        if !self.events_on() {
            return;
        }
        let block = BlockId(slot.0);
        let event = if stored {
            PrefixEvent::BlockStored {
                hash: saved.hash,
                parent: saved.parent,
                block,
                token_ids: saved.tokens.to_vec(),
                block_size: self.block_size,
                extra_keys: saved.key.as_deref().map(<[u8]>::to_vec).unwrap_or_default(),
                medium: Medium::Disk,
                group: self.group,
            }
        } else {
            PrefixEvent::BlockRemoved {
                hash: saved.hash,
                block,
                medium: Medium::Disk,
                group: self.group,
            }
        };
        self.emit(event);
    }
}
