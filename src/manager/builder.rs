//! [`CacheBuilder`]: one place that composes every option of a [`KvCache`].

use super::groups::GroupSpec;
use super::swap::Tiers;
use super::{CacheConfig, KvCache, TierConfig};
use crate::error::{Error, Result};
use crate::layout::KvLayout;
use crate::pool::prefix::index::PrefixIndex;
use crate::pool::prefix::{EvictionPolicy, PrefixConfig, PrefixEvent, PrefixHasher};

/// Builds a [`KvCache`] from a layout and any mix of options: arena size,
/// watermark, limits, host/disk tiers, prefix-cache hasher, eviction policy and events.
/// Every option has the default [`KvCache::new`] uses.
///
/// ```
/// use pagedkv::pool::prefix::LruPolicy;
/// use pagedkv::{DType, KvCache, KvLayout, ModelShape, TierConfig};
///
/// let shape = ModelShape { num_layers: 2, num_q_heads: 8, num_kv_heads: 2, head_dim: 64,
///                          kv_dtype: DType::BF16 };
/// let (tx, rx) = crossbeam_channel::bounded(1024);
/// let kv = KvCache::builder(KvLayout::new(shape, 16)?)
///     .num_blocks(1024)
///     .watermark_blocks(16)
///     .tiers(TierConfig { num_host_blocks: 4096, num_disk_slots: 0 })
///     .eviction_policy(Box::new(LruPolicy))
///     .record_events(true)
///     .event_channel(tx)
///     .build()?;
/// assert_eq!(kv.tier_stats().host_blocks, 4096);
/// # drop(rx);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `build`"]
pub struct CacheBuilder {
    /// The one group's layout (`None` only for a hybrid builder of no group).
    layout: Option<KvLayout>,
    config: CacheConfig,
    watermark_set: bool,
    tiers: TierConfig,
    prefix: Option<PrefixConfig>,
    hasher: Option<Box<dyn PrefixHasher>>,
    policy: Option<Box<dyn EvictionPolicy>>,
    record_events: Option<bool>,
    event_channel: Option<crossbeam_channel::Sender<PrefixEvent>>,
    max_pinned_blocks: Option<usize>,
    sliding_window: Option<usize>,
    /// A hybrid model's groups ([`KvCache::hybrid_builder`]).
    groups: Option<Vec<GroupSpec>>,
    /// Whether `max_seq_len_tokens` or `max_num_blocks` was set (a hybrid cache
    /// derives both from its groups and refuses them).
    limits_set: bool,
}

impl KvCache {
    /// A [`CacheBuilder`] for an arena of `layout` (64 blocks until
    /// [`CacheBuilder::num_blocks`] says otherwise).
    pub fn builder(layout: KvLayout) -> CacheBuilder {
        CacheBuilder {
            layout: Some(layout),
            ..Self::builder_without_layout()
        }
    }

    /// The defaults of [`Self::builder`] without a layout (for a hybrid builder of no
    /// group, which `build` refuses as [`KvCache::hybrid`] does).
    fn builder_without_layout() -> CacheBuilder {
        CacheBuilder {
            layout: None,
            config: CacheConfig::new(64),
            watermark_set: false,
            tiers: TierConfig::default(),
            prefix: None,
            hasher: None,
            policy: None,
            record_events: None,
            event_channel: None,
            max_pinned_blocks: None,
            sliding_window: None,
            groups: None,
            limits_set: false,
        }
    }

    /// A [`CacheBuilder`] for a hybrid model's cache over the KV-cache groups `specs`
    /// (what [`KvCache::hybrid`] builds), with every option a one-group cache takes
    /// that applies to every group: the arena's pages ([`CacheBuilder::num_blocks`]),
    /// the watermark, the table capacity, a host tier ([`CacheBuilder::tiers`]), and
    /// the prefix cache's hasher, eviction policy, pins and events, which each full and
    /// latent group's prefix cache takes (its events carry the group,
    /// [`PrefixEvent::BlockStored`]'s `group`, vLLM's `group_idx` on the wire).
    ///
    /// ```
    /// use pagedkv::{DType, GroupSpec, KvCache, KvLayout, ModelShape};
    ///
    /// let shape = ModelShape { num_layers: 2, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::BF16 };
    /// let layout = KvLayout::new(shape, 16)?;
    /// let kv = KvCache::hybrid_builder(&[GroupSpec::full(layout), GroupSpec::window(layout, 32)])
    ///     .num_blocks(256)
    ///     .watermark_blocks(4)
    ///     .record_events(true)
    ///     .build()?;
    /// assert_eq!(kv.num_groups(), 2);
    /// assert!(kv.prefix_config().record_events);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// `build` refuses ([`Error::InvalidConfig`]) what a hybrid cache takes from its
    /// groups instead (a sliding window: use [`GroupSpec::window`]; the longest
    /// sequence and the growth limit: the arena sets them), and a disk tier
    /// ([`Error::NotOnHybrid`]), besides what [`KvCache::hybrid`] refuses.
    pub fn hybrid_builder(specs: &[GroupSpec]) -> CacheBuilder {
        let mut b = match specs.first() {
            Some(s) => KvCache::builder(s.layout),
            None => KvCache::builder_without_layout(),
        };
        b.groups = Some(specs.to_vec());
        b
    }
}

impl CacheBuilder {
    /// Blocks in the device arena.
    pub fn num_blocks(mut self, num_blocks: usize) -> Self {
        self.config.num_blocks = num_blocks;
        if !self.watermark_set {
            self.config.watermark_blocks = CacheConfig::new(num_blocks).watermark_blocks;
        }
        self
    }

    /// Every field of [`CacheConfig`] at once.
    pub fn config(mut self, config: CacheConfig) -> Self {
        self.config = config;
        self.watermark_set = true;
        self
    }

    /// [`CacheConfig::watermark_blocks`] (default: 1 % of the arena).
    pub fn watermark_blocks(mut self, blocks: usize) -> Self {
        self.config.watermark_blocks = blocks;
        self.watermark_set = true;
        self
    }

    /// [`CacheConfig::max_seq_len_tokens`].
    pub fn max_seq_len_tokens(mut self, tokens: usize) -> Self {
        self.config.max_seq_len_tokens = tokens;
        self.limits_set = true;
        self
    }

    /// [`CacheConfig::max_num_blocks`].
    pub fn max_num_blocks(mut self, blocks: usize) -> Self {
        self.config.max_num_blocks = blocks;
        self.limits_set = true;
        self
    }

    /// [`CacheConfig::table_capacity_blocks`]: room each block table makes at once
    /// (the longest sequence's blocks, for a decode step that never allocates).
    pub fn table_capacity_blocks(mut self, blocks: usize) -> Self {
        self.config.table_capacity_blocks = blocks;
        self
    }

    /// Host and disk tiers to swap to (default: none).
    pub fn tiers(mut self, tiers: TierConfig) -> Self {
        self.tiers = tiers;
        self
    }

    /// A whole [`PrefixConfig`]; the finer options below override its fields.
    pub fn prefix(mut self, prefix: PrefixConfig) -> Self {
        self.prefix = Some(prefix);
        self
    }

    /// [`PrefixConfig::hasher`].
    pub fn hasher(mut self, hasher: Box<dyn PrefixHasher>) -> Self {
        self.hasher = Some(hasher);
        self
    }

    /// [`PrefixConfig::policy`].
    pub fn eviction_policy(mut self, policy: Box<dyn EvictionPolicy>) -> Self {
        self.policy = Some(policy);
        self
    }

    /// [`PrefixConfig::record_events`].
    pub fn record_events(mut self, record: bool) -> Self {
        self.record_events = Some(record);
        self
    }

    /// [`PrefixConfig::event_channel`].
    pub fn event_channel(mut self, sender: crossbeam_channel::Sender<PrefixEvent>) -> Self {
        self.event_channel = Some(sender);
        self
    }

    /// [`PrefixConfig::max_pinned_blocks`].
    pub fn max_pinned_blocks(mut self, blocks: usize) -> Self {
        self.max_pinned_blocks = Some(blocks);
        self
    }

    /// A sliding window of `tokens` for every layer of this manager (one KV-cache
    /// group of window layers): as a sequence's computed tokens advance, each block
    /// entirely before the window of its next query (the query at position `p` reads
    /// `p + 1 - tokens ..= p`) goes back to the pool and its table entry becomes
    /// [`crate::ids::BlockId::RELEASED`]. A decoding sequence then holds at most
    /// `ceil(tokens / block_size) + 1` blocks.
    ///
    /// What a window manager does not do: serve or register prefix-cache hits (a hit
    /// would need the blocks before the window, which are gone, and a released
    /// registered block would leave a cached parent above live children), swap out a
    /// sequence that has released blocks (preemption recomputes it instead), export
    /// such a sequence, or truncate it below its window.
    ///
    /// ```
    /// use pagedkv::{CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let mut kv = KvCache::builder(KvLayout::new(shape, 16)?)
    ///     .num_blocks(64)
    ///     .sliding_window(64)
    ///     .build()?;
    /// let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    /// kv.admit(SeqId(1), 300, &mut slots)?;
    /// for _ in 0..20 {
    ///     kv.append(SeqId(1), 1, &mut slots, &mut copies)?;
    /// }
    /// // 320 tokens: 20 blocks without the window; the last query (position 319)
    /// // reads 256..=319, 4 blocks.
    /// assert_eq!(kv.stats().used_blocks, 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn sliding_window(mut self, tokens: usize) -> Self {
        self.sliding_window = Some(tokens);
        self
    }

    /// The manager.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] for an empty arena, a watermark not below it, a
    /// `max_num_blocks` below it, pins past the arena, tiers past the `u32` id
    /// space, or a sliding window of 0 tokens.
    pub fn build(mut self) -> Result<KvCache> {
        if let Some(specs) = self.groups.take() {
            return self.build_hybrid(&specs);
        }
        let Some(layout) = self.layout else {
            return Err(Error::config("groups", "a model needs at least one group"));
        };
        let prefix = self.prefix_config();
        let mut kv = KvCache::new(layout, self.config)?;
        kv.prefix = PrefixIndex::new(self.config.num_blocks, layout.block_size(), prefix)?;
        kv.tiers = Tiers::new(self.tiers)?;
        if self.sliding_window == Some(0) {
            return Err(Error::config("sliding_window", "a window of 0 tokens"));
        }
        kv.window = self.sliding_window;
        Ok(kv)
    }

    fn build_hybrid(mut self, specs: &[GroupSpec]) -> Result<KvCache> {
        if self.sliding_window.is_some() {
            return Err(Error::config(
                "sliding_window",
                "a hybrid cache takes its windows from its groups (GroupSpec::window)",
            ));
        }
        if self.limits_set {
            return Err(Error::config(
                "max_seq_len_tokens",
                "a hybrid cache's limits follow its arena (set neither max_seq_len_tokens nor max_num_blocks)",
            ));
        }
        if self.tiers.num_disk_slots > 0 {
            return Err(Error::NotOnHybrid {
                operation: "a disk tier",
                groups: specs.len(),
            });
        }
        let prefix = self.prefix_config();
        let watermark = self.config.watermark_blocks;
        let kv = KvCache::hybrid_with_prefix(
            specs,
            self.config.num_blocks,
            self.tiers.num_host_blocks,
            &prefix,
        )?;
        // The watermark defaults to 1 % of the arena, as for one group.
        let kv = kv.with_watermark_blocks(watermark)?;
        Ok(match self.config.table_capacity_blocks {
            0 => kv,
            n => kv.with_table_capacity_blocks(n),
        })
    }

    /// The prefix-cache configuration: the whole one given, or the arena's default,
    /// with the finer options applied.
    fn prefix_config(&mut self) -> PrefixConfig {
        let mut prefix = self
            .prefix
            .take()
            .unwrap_or_else(|| PrefixConfig::for_arena(self.config.num_blocks));
        if let Some(h) = self.hasher.take() {
            prefix.hasher = h;
        }
        if let Some(p) = self.policy.take() {
            prefix.policy = p;
        }
        if let Some(r) = self.record_events {
            prefix.record_events = r;
        }
        if let Some(tx) = self.event_channel.take() {
            prefix.event_channel = Some(tx);
        }
        if let Some(n) = self.max_pinned_blocks {
            prefix.max_pinned_blocks = n;
        }
        prefix
    }
}
