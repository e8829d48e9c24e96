//! The manager's counters through the [`metrics`](https://docs.rs/metrics) facade,
//! plus a Prometheus text-format recorder and a bounded loopback server.
//!
//! The engine picks the recorder: anything installed with
//! `metrics::set_global_recorder` (or scoped with `metrics::with_local_recorder`)
//! receives what [`MetricsExporter::publish`] sends. For a process that wants a
//! Prometheus endpoint without pulling an async HTTP stack, `PrometheusRecorder`
//! (feature `prometheus`) renders the text exposition format (through
//! `metrics-exporter-prometheus` without its HTTP features) and `serve_prometheus`
//! answers `GET /metrics` on a
//! `std::net::TcpListener`, for a bounded number of requests or time. The metric table,
//! the publishing and that server are this crate's; the text format is not.
//!
//! # What is published
//!
//! Every name, its type and meaning is in [`METRICS`]; names are constants in
//! [`names`]. The ones marked `wired` come from the manager: [`CacheStats`], and
//! [`ExtraCounters::from_manager`] (prefix cache, tiers and preemption, defragmentation).
//! Swap time is not wired: the engine executes swap plans and can fill it. Extra
//! counters are published whenever the field is `Some`, and left out when it is `None`,
//! so a dashboard never shows a fake zero.
//!
//! # Peaks
//!
//! A gauge sampled every few seconds misses the spikes that cause preemptions, so
//! [`MetricsSnapshot::from_manager`] takes the *peak* of used blocks since the previous
//! snapshot ([`KvCache::take_peak_used_blocks`]) and publishes it as
//! `pagedkv_blocks_used_peak`. Take a snapshot once per scrape (the `before_render`
//! hook of `serve_prometheus` does exactly that) and the gauge is the peak between
//! two scrapes.
//!
//! ```
//! # #[cfg(feature = "prometheus")] {
//! use pagedkv::metrics::{MetricsExporter, MetricsSnapshot, PrometheusRecorder, names};
//! use pagedkv::{CacheConfig, DType, KvCache, KvLayout, ModelShape, SeqId};
//!
//! let shape = ModelShape { num_layers: 2, num_q_heads: 4, num_kv_heads: 2, head_dim: 8,
//!                          kv_dtype: DType::F16 };
//! let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
//! kv.admit(SeqId(1), 40, &mut Vec::new())?;
//!
//! let recorder = PrometheusRecorder::new();
//! let exporter = MetricsExporter::new();
//! metrics::with_local_recorder(&recorder, || {
//!     exporter.describe();
//!     exporter.publish(&MetricsSnapshot::from_manager(&mut kv));
//! });
//! let text = recorder.render();
//! assert!(text.contains(&format!("{} 3\n", names::BLOCKS_USED)));
//! # }
//! # Ok::<(), pagedkv::Error>(())
//! ```

use crate::executor::tier::DiskTransferCounters;
use crate::manager::{CacheStats, KvCache};

/// Metric names, all with the `pagedkv_` prefix.
pub mod names {
    /// Gauge: blocks in the arena.
    pub const BLOCKS_CAPACITY: &str = "pagedkv_blocks_capacity";
    /// Gauge: blocks referenced by at least one sequence.
    pub const BLOCKS_USED: &str = "pagedkv_blocks_used";
    /// Gauge: highest `pagedkv_blocks_used` since the previous snapshot.
    pub const BLOCKS_USED_PEAK: &str = "pagedkv_blocks_used_peak";
    /// Gauge: blocks on the free list.
    pub const BLOCKS_FREE: &str = "pagedkv_blocks_free";
    /// Gauge: unreferenced blocks kept for the prefix cache (evictable).
    pub const BLOCKS_CACHED: &str = "pagedkv_blocks_cached";
    /// Gauge: sequences the manager holds.
    pub const SEQUENCES: &str = "pagedkv_sequences";
    /// Gauge: token slots of used blocks that hold a token.
    pub const TOKEN_SLOTS_LIVE: &str = "pagedkv_token_slots_live";
    /// Gauge: token slots of used blocks that hold nothing (internal waste).
    pub const TOKEN_SLOTS_WASTED: &str = "pagedkv_token_slots_wasted";
    /// Gauge: live token slots over all slots of the arena.
    pub const UTILIZATION_RATIO: &str = "pagedkv_utilization_ratio";
    /// Gauge: bytes of the used blocks.
    pub const KV_BYTES_USED: &str = "pagedkv_kv_bytes_used";
    /// Gauge: blocks swapped out to the host tier.
    pub const BLOCKS_SWAPPED: &str = "pagedkv_blocks_swapped";
    /// Counter: prompt tokens looked up in the prefix cache.
    pub const PREFIX_QUERY_TOKENS: &str = "pagedkv_prefix_query_tokens_total";
    /// Counter: prompt tokens found in the prefix cache.
    pub const PREFIX_HIT_TOKENS: &str = "pagedkv_prefix_hit_tokens_total";
    /// Counter: preemptions, label `kind` = `swap` or `recompute`.
    pub const PREEMPTIONS: &str = "pagedkv_preemptions_total";
    /// Counter: bytes swapped, label `direction` = `out` (device to host) or `in`.
    pub const SWAP_BYTES: &str = "pagedkv_swap_bytes_total";
    /// Counter: time spent executing swap plans, microseconds.
    pub const SWAP_TIME_US: &str = "pagedkv_swap_time_microseconds_total";
    /// Counter: defragmentation passes.
    pub const DEFRAG_RUNS: &str = "pagedkv_defrag_runs_total";
    /// Counter: bytes moved by defragmentation.
    pub const DEFRAG_MOVED_BYTES: &str = "pagedkv_defrag_moved_bytes_total";
    /// Counter: time spent executing defragmentation moves, microseconds.
    pub const DEFRAG_TIME_US: &str = "pagedkv_defrag_time_microseconds_total";
    /// Counter: prompt tokens served by each level of the prefix cache, label `tier` =
    /// `device`, `host` or `disk` (host and disk counted when their load completes).
    pub const TIER_HIT_TOKENS: &str = "pagedkv_tier_hit_tokens_total";
    /// Counter: blocks stored into a level below the device, label `tier` = `host` or
    /// `disk`.
    pub const TIER_STORED_BLOCKS: &str = "pagedkv_tier_stored_blocks_total";
    /// Counter: bytes of those blocks, label `tier`.
    pub const TIER_STORED_BYTES: &str = "pagedkv_tier_stored_bytes_total";
    /// Counter: blocks loaded from a level below the device to the device, label
    /// `tier` = `host` or `disk`.
    pub const TIER_LOADED_BLOCKS: &str = "pagedkv_tier_loaded_blocks_total";
    /// Counter: bytes of those blocks, label `tier`.
    pub const TIER_LOADED_BYTES: &str = "pagedkv_tier_loaded_bytes_total";
    /// Counter: disk-level jobs a `TransferEngine` completed, label `op` = `store`
    /// (host -> disk) or `load` (disk -> host staging).
    pub const DISK_TRANSFERS: &str = "pagedkv_disk_transfers_total";
    /// Counter: time those jobs took on the engine's worker, microseconds, label `op`
    /// (with [`DISK_TRANSFERS`], a sum and count pair: the mean latency is their ratio).
    pub const DISK_TRANSFER_TIME_US: &str = "pagedkv_disk_transfer_time_microseconds_total";
}

/// Gauge or counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// A value that goes up and down.
    Gauge,
    /// A total that only grows (published with `absolute`).
    Counter,
}

impl MetricKind {
    /// The Prometheus `# TYPE` word.
    pub const fn prometheus_type(self) -> &'static str {
        match self {
            MetricKind::Gauge => "gauge",
            MetricKind::Counter => "counter",
        }
    }
}

/// One documented metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricDef {
    /// Full name.
    pub name: &'static str,
    /// Gauge or counter.
    pub kind: MetricKind,
    /// The label and its values, for metrics published once per value.
    pub label: Option<(&'static str, &'static [&'static str])>,
    /// Meaning, used as the `# HELP` text.
    pub help: &'static str,
    /// Whether the manager fills it today (from [`CacheStats`]); the rest come from
    /// [`ExtraCounters`] once the parts that count them land.
    pub wired: bool,
}

const fn def(name: &'static str, kind: MetricKind, help: &'static str, wired: bool) -> MetricDef {
    MetricDef {
        name,
        kind,
        label: None,
        help,
        wired,
    }
}

/// Label values of [`names::PREEMPTIONS`].
pub const PREEMPTION_KINDS: [&str; 2] = ["swap", "recompute"];
/// Label values of [`names::SWAP_BYTES`].
pub const SWAP_DIRECTIONS: [&str; 2] = ["out", "in"];
/// Label values of [`names::TIER_HIT_TOKENS`], in the order of
/// [`ExtraCounters::tier_hit_tokens`].
pub const HIT_TIERS: [&str; 3] = ["device", "host", "disk"];
/// Label values of the stored and loaded per-tier counters, in the order of their
/// [`ExtraCounters`] arrays.
pub const LOWER_TIERS: [&str; 2] = ["host", "disk"];
/// Label values of [`names::DISK_TRANSFERS`] and [`names::DISK_TRANSFER_TIME_US`], in
/// the order of their [`ExtraCounters`] arrays.
pub const DISK_OPS: [&str; 2] = ["store", "load"];

/// Every metric the exporter publishes.
pub const METRICS: [MetricDef; 26] = {
    use names::*;
    use MetricKind::{Counter, Gauge};
    [
        def(BLOCKS_CAPACITY, Gauge, "Blocks in the KV arena.", true),
        def(
            BLOCKS_USED,
            Gauge,
            "Blocks referenced by at least one sequence.",
            true,
        ),
        def(
            BLOCKS_USED_PEAK,
            Gauge,
            "Highest number of used blocks since the previous snapshot.",
            true,
        ),
        def(BLOCKS_FREE, Gauge, "Blocks on the free list.", true),
        def(
            BLOCKS_CACHED,
            Gauge,
            "Unreferenced blocks kept for the prefix cache (evictable).",
            true,
        ),
        def(SEQUENCES, Gauge, "Sequences the manager holds.", true),
        def(
            TOKEN_SLOTS_LIVE,
            Gauge,
            "Token slots of used blocks that hold a token.",
            true,
        ),
        def(
            TOKEN_SLOTS_WASTED,
            Gauge,
            "Token slots of used blocks that hold nothing (internal waste).",
            true,
        ),
        def(
            UTILIZATION_RATIO,
            Gauge,
            "Live token slots over all token slots of the arena.",
            true,
        ),
        def(KV_BYTES_USED, Gauge, "Bytes of the used blocks.", true),
        def(
            BLOCKS_SWAPPED,
            Gauge,
            "Blocks swapped out to the host tier.",
            true,
        ),
        def(
            PREFIX_QUERY_TOKENS,
            Counter,
            "Prompt tokens looked up in the prefix cache.",
            true,
        ),
        def(
            PREFIX_HIT_TOKENS,
            Counter,
            "Prompt tokens found in the prefix cache.",
            true,
        ),
        MetricDef {
            name: PREEMPTIONS,
            kind: Counter,
            label: Some(("kind", &PREEMPTION_KINDS)),
            help: "Sequences preempted, by kind (swap to host, or drop and recompute).",
            wired: true,
        },
        MetricDef {
            name: SWAP_BYTES,
            kind: Counter,
            label: Some(("direction", &SWAP_DIRECTIONS)),
            help: "Bytes swapped between device and host, by direction.",
            wired: true,
        },
        def(
            SWAP_TIME_US,
            Counter,
            "Time spent executing swap plans, in microseconds.",
            false,
        ),
        def(DEFRAG_RUNS, Counter, "Defragmentation passes.", true),
        def(
            DEFRAG_MOVED_BYTES,
            Counter,
            "Bytes moved by defragmentation.",
            true,
        ),
        def(
            DEFRAG_TIME_US,
            Counter,
            "Time spent planning and executing defragmentation and shrink moves, in microseconds.",
            true,
        ),
        MetricDef {
            name: TIER_HIT_TOKENS,
            kind: Counter,
            label: Some(("tier", &HIT_TIERS)),
            help: "Prompt tokens served by each level of the prefix cache (host and disk once loaded).",
            wired: true,
        },
        MetricDef {
            name: TIER_STORED_BLOCKS,
            kind: Counter,
            label: Some(("tier", &LOWER_TIERS)),
            help: "Blocks stored into the host or disk level of the prefix cache.",
            wired: true,
        },
        MetricDef {
            name: TIER_STORED_BYTES,
            kind: Counter,
            label: Some(("tier", &LOWER_TIERS)),
            help: "Bytes stored into the host or disk level of the prefix cache.",
            wired: true,
        },
        MetricDef {
            name: TIER_LOADED_BLOCKS,
            kind: Counter,
            label: Some(("tier", &LOWER_TIERS)),
            help: "Blocks loaded to the device from the host or disk level of the prefix cache.",
            wired: true,
        },
        MetricDef {
            name: TIER_LOADED_BYTES,
            kind: Counter,
            label: Some(("tier", &LOWER_TIERS)),
            help: "Bytes loaded to the device from the host or disk level of the prefix cache.",
            wired: true,
        },
        MetricDef {
            name: DISK_TRANSFERS,
            kind: Counter,
            label: Some(("op", &DISK_OPS)),
            help: "Disk-level jobs completed by the transfer engine, by operation.",
            wired: false,
        },
        MetricDef {
            name: DISK_TRANSFER_TIME_US,
            kind: Counter,
            label: Some(("op", &DISK_OPS)),
            help: "Time disk-level jobs took on the transfer engine's worker, in microseconds, by operation.",
            wired: false,
        },
    ]
};

/// Counters other parts of the crate are adding; `None` means "not counted here" and
/// the metric is not published. Totals are cumulative since the manager started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExtraCounters {
    /// Blocks now on the host tier ([`names::BLOCKS_SWAPPED`]).
    pub swapped_blocks: Option<u64>,
    /// Prompt tokens looked up in the prefix cache ([`names::PREFIX_QUERY_TOKENS`]).
    pub prefix_query_tokens: Option<u64>,
    /// Prompt tokens found there ([`names::PREFIX_HIT_TOKENS`]).
    pub prefix_hit_tokens: Option<u64>,
    /// Preemptions by swapping out ([`names::PREEMPTIONS`], `kind="swap"`).
    pub preemptions_swap: Option<u64>,
    /// Preemptions by dropping for recompute (`kind="recompute"`).
    pub preemptions_recompute: Option<u64>,
    /// Bytes swapped device to host ([`names::SWAP_BYTES`], `direction="out"`).
    pub swap_out_bytes: Option<u64>,
    /// Bytes swapped host to device (`direction="in"`).
    pub swap_in_bytes: Option<u64>,
    /// Microseconds spent executing swap plans ([`names::SWAP_TIME_US`]).
    pub swap_time_us: Option<u64>,
    /// Defragmentation passes ([`names::DEFRAG_RUNS`]).
    pub defrag_runs: Option<u64>,
    /// Bytes moved by defragmentation ([`names::DEFRAG_MOVED_BYTES`]).
    pub defrag_moved_bytes: Option<u64>,
    /// Microseconds spent moving ([`names::DEFRAG_TIME_US`]).
    pub defrag_time_us: Option<u64>,
    /// Prompt tokens served by the device, host and disk levels, in [`HIT_TIERS`]
    /// order ([`names::TIER_HIT_TOKENS`]).
    pub tier_hit_tokens: Option<[u64; 3]>,
    /// Blocks stored into the host and disk levels, in [`LOWER_TIERS`] order
    /// ([`names::TIER_STORED_BLOCKS`]).
    pub tier_stored_blocks: Option<[u64; 2]>,
    /// Bytes of those blocks ([`names::TIER_STORED_BYTES`]).
    pub tier_stored_bytes: Option<[u64; 2]>,
    /// Blocks loaded to the device from the host and disk levels
    /// ([`names::TIER_LOADED_BLOCKS`]).
    pub tier_loaded_blocks: Option<[u64; 2]>,
    /// Bytes of those blocks ([`names::TIER_LOADED_BYTES`]).
    pub tier_loaded_bytes: Option<[u64; 2]>,
    /// Disk stores and loads a transfer engine completed, in [`DISK_OPS`] order
    /// ([`names::DISK_TRANSFERS`]); see [`Self::with_disk_transfers`].
    pub disk_transfers: Option<[u64; 2]>,
    /// Microseconds they took ([`names::DISK_TRANSFER_TIME_US`]).
    pub disk_transfer_time_us: Option<[u64; 2]>,
}

impl ExtraCounters {
    /// Everything the manager counts beyond [`CacheStats`]: prefix-cache queries and
    /// hits, swapped blocks, preemptions by kind, swap bytes, defragmentation moves.
    /// Swap time and the disk transfers stay `None`: the engine executes the plans and
    /// times them ([`Self::with_disk_transfers`]).
    pub fn from_manager(kv: &KvCache) -> Self {
        let prefix = kv.prefix_stats();
        let tiers = kv.tier_stats();
        let defrag = kv.defrag_counters();
        let host = kv.host_cache_stats();
        let disk = kv.disk_cache_stats();
        let bb = kv.layout().block_bytes() as u64;
        ExtraCounters {
            swapped_blocks: Some(tiers.host_used_blocks as u64),
            prefix_query_tokens: Some(prefix.query_tokens),
            prefix_hit_tokens: Some(prefix.hit_tokens),
            preemptions_swap: Some(tiers.preempt_swaps),
            preemptions_recompute: Some(tiers.preempt_recomputes),
            swap_out_bytes: Some(tiers.bytes_swapped_out),
            swap_in_bytes: Some(tiers.bytes_swapped_in),
            swap_time_us: None,
            defrag_runs: Some(defrag.runs),
            defrag_moved_bytes: Some(defrag.moved_blocks * kv.layout().block_bytes() as u64),
            defrag_time_us: Some(defrag.time_us),
            tier_hit_tokens: Some([
                host.device_hit_tokens,
                host.host_hit_tokens,
                disk.disk_hit_tokens,
            ]),
            tier_stored_blocks: Some([host.stored_blocks, disk.stored_blocks]),
            tier_stored_bytes: Some([host.stored_bytes, disk.stored_blocks * bb]),
            tier_loaded_blocks: Some([host.loaded_blocks, disk.loaded_blocks]),
            tier_loaded_bytes: Some([host.loaded_bytes, disk.loaded_blocks * bb]),
            disk_transfers: None,
            disk_transfer_time_us: None,
        }
    }

    /// These counters with the disk-level jobs a transfer engine completed
    /// ([`crate::executor::tier::TransferEngine::disk_transfer_counters`]).
    pub fn with_disk_transfers(mut self, c: &DiskTransferCounters) -> Self {
        self.disk_transfers = Some([c.store_jobs, c.load_jobs]);
        self.disk_transfer_time_us = Some([c.store_time_us, c.load_time_us]);
        self
    }
}

/// What one publish sends: the manager's counters, the arena's geometry, the extras.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetricsSnapshot {
    /// The manager's counters. Its `peak_used_blocks` is ignored in favour of
    /// [`Self::peak_used_blocks`].
    pub cache: CacheStats,
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes of one block over all layers.
    pub block_bytes: usize,
    /// Highest used blocks since the previous snapshot.
    pub peak_used_blocks: usize,
    /// Counters the manager does not have yet.
    pub extra: ExtraCounters,
}

impl MetricsSnapshot {
    /// Reads the manager's counters and takes its peak (restarting the peak window).
    pub fn from_manager(kv: &mut KvCache) -> Self {
        let cache = kv.stats();
        MetricsSnapshot {
            cache,
            block_size: kv.block_size(),
            block_bytes: kv.layout().block_bytes(),
            peak_used_blocks: kv.take_peak_used_blocks(),
            extra: ExtraCounters::from_manager(kv),
        }
    }
}

/// Publishes [`MetricsSnapshot`]s to whatever recorder the `metrics` facade has.
#[derive(Debug, Clone, Copy, Default)]
pub struct MetricsExporter {
    _private: (),
}

impl MetricsExporter {
    /// An exporter.
    pub const fn new() -> Self {
        MetricsExporter { _private: () }
    }

    /// Sends the `# HELP` text of every metric in [`METRICS`] to the current recorder;
    /// call it once after installing the recorder.
    pub fn describe(&self) {
        for m in METRICS {
            match m.kind {
                MetricKind::Gauge => ::metrics::describe_gauge!(m.name, m.help),
                MetricKind::Counter => ::metrics::describe_counter!(m.name, m.help),
            }
        }
    }

    /// Publishes `snap` to the current recorder: gauges are set, counters are set to
    /// their totals, extras that are `None` are skipped.
    pub fn publish(&self, snap: &MetricsSnapshot) {
        use names::*;
        let c = &snap.cache;
        let gauges = [
            (BLOCKS_CAPACITY, c.num_blocks as f64),
            (BLOCKS_USED, c.used_blocks as f64),
            (
                BLOCKS_USED_PEAK,
                snap.peak_used_blocks.max(c.used_blocks) as f64,
            ),
            (BLOCKS_FREE, c.free_blocks as f64),
            (BLOCKS_CACHED, c.cached_blocks as f64),
            (SEQUENCES, c.num_sequences as f64),
            (TOKEN_SLOTS_LIVE, c.live_token_slots as f64),
            (TOKEN_SLOTS_WASTED, c.internal_waste_slots as f64),
            (UTILIZATION_RATIO, c.utilization(snap.block_size)),
            (
                KV_BYTES_USED,
                c.used_blocks as f64 * snap.block_bytes as f64,
            ),
        ];
        for (name, value) in gauges {
            ::metrics::gauge!(name).set(value);
        }
        let e = &snap.extra;
        if let Some(v) = e.swapped_blocks {
            ::metrics::gauge!(BLOCKS_SWAPPED).set(v as f64);
        }
        let counters = [
            (PREFIX_QUERY_TOKENS, e.prefix_query_tokens),
            (PREFIX_HIT_TOKENS, e.prefix_hit_tokens),
            (SWAP_TIME_US, e.swap_time_us),
            (DEFRAG_RUNS, e.defrag_runs),
            (DEFRAG_MOVED_BYTES, e.defrag_moved_bytes),
            (DEFRAG_TIME_US, e.defrag_time_us),
        ];
        for (name, value) in counters {
            if let Some(v) = value {
                ::metrics::counter!(name).absolute(v);
            }
        }
        let labelled = [
            (PREEMPTIONS, "kind", "swap", e.preemptions_swap),
            (PREEMPTIONS, "kind", "recompute", e.preemptions_recompute),
            (SWAP_BYTES, "direction", "out", e.swap_out_bytes),
            (SWAP_BYTES, "direction", "in", e.swap_in_bytes),
        ];
        for (name, label, value, total) in labelled {
            if let Some(v) = total {
                ::metrics::counter!(name, label => value).absolute(v);
            }
        }
        if let Some(v) = e.tier_hit_tokens {
            for (tier, total) in HIT_TIERS.into_iter().zip(v) {
                ::metrics::counter!(TIER_HIT_TOKENS, "tier" => tier).absolute(total);
            }
        }
        let per_lower_tier = [
            (TIER_STORED_BLOCKS, e.tier_stored_blocks),
            (TIER_STORED_BYTES, e.tier_stored_bytes),
            (TIER_LOADED_BLOCKS, e.tier_loaded_blocks),
            (TIER_LOADED_BYTES, e.tier_loaded_bytes),
        ];
        for (name, totals) in per_lower_tier {
            if let Some(v) = totals {
                for (tier, total) in LOWER_TIERS.into_iter().zip(v) {
                    ::metrics::counter!(name, "tier" => tier).absolute(total);
                }
            }
        }
        let per_op = [
            (DISK_TRANSFERS, e.disk_transfers),
            (DISK_TRANSFER_TIME_US, e.disk_transfer_time_us),
        ];
        for (name, totals) in per_op {
            if let Some(v) = totals {
                for (op, total) in DISK_OPS.into_iter().zip(v) {
                    ::metrics::counter!(name, "op" => op).absolute(total);
                }
            }
        }
    }
}

/// The Prometheus text format and its loopback endpoint (feature `prometheus`).
#[cfg(feature = "prometheus")]
mod prometheus {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use crate::error::{Error, Result};

    // ---- the Prometheus text-format recorder ---------------------------------------------

    /// A `metrics` recorder that keeps the latest values and renders them in the
    /// Prometheus text exposition format (version 0.0.4): the recorder of
    /// [`metrics-exporter-prometheus`](https://docs.rs/metrics-exporter-prometheus), built
    /// without its default features, so without its tokio/hyper HTTP listener and push
    /// gateway. Histograms are rendered as summaries (quantiles, `_sum`, `_count`).
    ///
    /// What stays hand-written here, and why: this wrapper, because the crate's recorder
    /// does not clone and the example installs one copy globally while the server renders
    /// from another; and [`serve_prometheus`], because the crate's own endpoint is the
    /// `http-listener` feature, which is the async stack this avoids.
    ///
    /// Clones share the same values, so one clone can be installed as the recorder while
    /// another renders for the HTTP server.
    ///
    /// The text is the upstream crate's: metric families come in no fixed order, and an
    /// infinite gauge is written `inf` (which Prometheus parses) rather than `+Inf`.
    #[derive(Debug, Clone)]
    pub struct PrometheusRecorder {
        inner: Arc<metrics_exporter_prometheus::PrometheusRecorder>,
    }

    impl Default for PrometheusRecorder {
        fn default() -> Self {
            Self::new()
        }
    }

    impl PrometheusRecorder {
        /// An empty recorder.
        pub fn new() -> Self {
            PrometheusRecorder {
                inner: Arc::new(
                    metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder(),
                ),
            }
        }

        /// All metrics in the text format, one family (`# HELP`, `# TYPE`, its series) after
        /// another.
        pub fn render(&self) -> String {
            self.inner.handle().render()
        }
    }

    impl ::metrics::Recorder for PrometheusRecorder {
        fn describe_counter(
            &self,
            key: ::metrics::KeyName,
            unit: Option<::metrics::Unit>,
            description: ::metrics::SharedString,
        ) {
            self.inner.describe_counter(key, unit, description);
        }

        fn describe_gauge(
            &self,
            key: ::metrics::KeyName,
            unit: Option<::metrics::Unit>,
            description: ::metrics::SharedString,
        ) {
            self.inner.describe_gauge(key, unit, description);
        }

        fn describe_histogram(
            &self,
            key: ::metrics::KeyName,
            unit: Option<::metrics::Unit>,
            description: ::metrics::SharedString,
        ) {
            self.inner.describe_histogram(key, unit, description);
        }

        fn register_counter(
            &self,
            key: &::metrics::Key,
            metadata: &::metrics::Metadata<'_>,
        ) -> ::metrics::Counter {
            self.inner.register_counter(key, metadata)
        }

        fn register_gauge(
            &self,
            key: &::metrics::Key,
            metadata: &::metrics::Metadata<'_>,
        ) -> ::metrics::Gauge {
            self.inner.register_gauge(key, metadata)
        }

        fn register_histogram(
            &self,
            key: &::metrics::Key,
            metadata: &::metrics::Metadata<'_>,
        ) -> ::metrics::Histogram {
            self.inner.register_histogram(key, metadata)
        }
    }

    // ---- a bounded loopback HTTP server ----------------------------------------------------

    /// When [`serve_prometheus`] stops.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct ServeLimits {
        /// Requests to answer before returning.
        pub max_requests: usize,
        /// Longest time to serve, from the call.
        pub max_duration: Duration,
    }

    /// Longest request head [`serve_prometheus`] reads.
    const MAX_REQUEST_BYTES: usize = 8 * 1024;

    /// Answers HTTP `GET /metrics` (and `GET /`) on `listener` with
    /// `recorder.render()`, calling `before_render` first so the caller can publish a
    /// fresh snapshot; anything else gets a 404. Returns the number of requests answered
    /// once `limits` is reached.
    ///
    /// Deliberately small and synchronous: one connection at a time, `Connection: close`,
    /// a 2-second read timeout per request. It is meant for a loopback port scraped by a
    /// local agent, not for the open internet.
    ///
    /// # Errors
    /// [`Error::Io`] when the listener fails (a failing client connection is dropped and
    /// does not end the loop).
    pub fn serve_prometheus(
        listener: &TcpListener,
        recorder: &PrometheusRecorder,
        limits: ServeLimits,
        mut before_render: impl FnMut(),
    ) -> Result<usize> {
        let io = |e: std::io::Error| Error::Io(format!("metrics server: {e}"));
        let start = Instant::now();
        listener.set_nonblocking(true).map_err(io)?;
        let mut served = 0;
        while served < limits.max_requests && start.elapsed() < limits.max_duration {
            match listener.accept() {
                Ok((stream, _)) => {
                    if answer(stream, recorder, &mut before_render).is_ok() {
                        served += 1;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        Ok(served)
    }

    fn answer(
        mut stream: TcpStream,
        recorder: &PrometheusRecorder,
        before_render: &mut impl FnMut(),
    ) -> std::io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST_BYTES {
            let n = stream.read(&mut buf)?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
        let mut parts = line.split(|&b| b == b' ');
        let (method, path) = (parts.next(), parts.next());
        let (status, body) = match (method, path) {
            (Some(b"GET"), Some(b"/metrics" | b"/")) => {
                before_render();
                ("200 OK", recorder.render())
            }
            _ => ("404 Not Found", "not found; try GET /metrics\n".to_string()),
        };
        write!(
            stream,
            "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        stream.flush()
    }
}

#[cfg(feature = "prometheus")]
pub use prometheus::{serve_prometheus, PrometheusRecorder, ServeLimits};
