//! Metrics: every documented metric is served over a loopback HTTP scrape; peaks are
//! kept since the last read; extras that are not counted are not published.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use pagedkv::metrics::{
    names, serve_prometheus, ExtraCounters, MetricKind, MetricsExporter, MetricsSnapshot,
    PrometheusRecorder, ServeLimits, METRICS,
};
use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};

fn manager() -> KvCache {
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        kv_dtype: DType::F16,
    };
    KvCache::new(KvLayout::new(shape, 16).unwrap(), CacheConfig::new(64)).unwrap()
}

fn full_extras() -> ExtraCounters {
    ExtraCounters {
        swapped_blocks: Some(3),
        prefix_query_tokens: Some(1000),
        prefix_hit_tokens: Some(640),
        preemptions_swap: Some(4),
        preemptions_recompute: Some(2),
        swap_out_bytes: Some(1 << 20),
        swap_in_bytes: Some(1 << 19),
        swap_time_us: Some(1234),
        defrag_runs: Some(5),
        defrag_moved_bytes: Some(4096),
        defrag_time_us: Some(77),
        tier_hit_tokens: Some([64, 32, 16]),
        tier_stored_blocks: Some([6, 3]),
        tier_stored_bytes: Some([6 * 2048, 3 * 2048]),
        tier_loaded_blocks: Some([2, 1]),
        tier_loaded_bytes: Some([2 * 2048, 2048]),
        disk_transfers: Some([3, 1]),
        disk_transfer_time_us: Some([900, 150]),
    }
}

/// The value on the line `series value` of a scrape.
fn value_of(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/plain\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn scrape_over_loopback_finds_every_documented_metric() {
    let mut kv = manager();
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 40, &mut slots).unwrap(); // 3 blocks, 8 slots wasted
    kv.admit(SeqId(2), 16, &mut slots).unwrap(); // 1 block
    let stats = kv.stats();

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let recorder = PrometheusRecorder::new();
    let server_recorder = recorder.clone();
    let server = std::thread::spawn(move || {
        let exporter = MetricsExporter::new();
        let limits = ServeLimits {
            max_requests: 2,
            max_duration: Duration::from_secs(30),
        };
        serve_prometheus(&listener, &server_recorder, limits, || {
            // Publish at scrape time, as an engine would.
            let mut snap = MetricsSnapshot::from_manager(&mut kv);
            snap.extra = full_extras();
            ::metrics::with_local_recorder(&server_recorder, || {
                exporter.describe();
                exporter.publish(&snap);
            });
        })
    });

    let response = http_get(addr, "/metrics");
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("Content-Type: text/plain; version=0.0.4"));
    assert!(head.contains(&format!("Content-Length: {}", body.len())));

    for m in METRICS {
        let kind = match m.kind {
            MetricKind::Gauge => "gauge",
            MetricKind::Counter => "counter",
        };
        assert!(
            body.contains(&format!("# TYPE {} {kind}\n", m.name)),
            "{}",
            m.name
        );
        assert!(
            body.contains(&format!("# HELP {} {}\n", m.name, m.help)),
            "{}",
            m.name
        );
        match m.label {
            None => assert!(value_of(body, m.name).is_some(), "{}", m.name),
            Some((label, values)) => {
                for v in values {
                    let series = format!("{}{{{label}=\"{v}\"}}", m.name);
                    assert!(value_of(body, &series).is_some(), "{series}");
                }
            }
        }
    }
    assert_eq!(value_of(body, names::BLOCKS_USED), Some(4.0));
    assert_eq!(value_of(body, names::BLOCKS_CAPACITY), Some(64.0));
    assert_eq!(
        value_of(body, names::TOKEN_SLOTS_LIVE),
        Some(stats.live_token_slots as f64)
    );
    assert_eq!(value_of(body, names::TOKEN_SLOTS_WASTED), Some(8.0));
    assert_eq!(
        value_of(body, names::UTILIZATION_RATIO),
        Some(56.0 / 1024.0)
    );
    // 4 blocks * 2 layers * 2 (K, V) * 2 heads * 16 tokens * 8 dims * 2 bytes
    assert_eq!(value_of(body, names::KV_BYTES_USED), Some(4.0 * 2048.0));
    assert_eq!(
        value_of(body, "pagedkv_preemptions_total{kind=\"recompute\"}"),
        Some(2.0)
    );
    assert_eq!(
        value_of(body, "pagedkv_swap_bytes_total{direction=\"out\"}"),
        Some(1048576.0)
    );

    let not_found = http_get(addr, "/other");
    assert!(not_found.starts_with("HTTP/1.1 404"), "{not_found}");
    assert_eq!(server.join().unwrap().unwrap(), 2);
}

#[test]
fn the_server_stops_at_its_time_limit() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let limits = ServeLimits {
        max_requests: 100,
        max_duration: Duration::from_millis(50),
    };
    let start = std::time::Instant::now();
    let served = serve_prometheus(&listener, &PrometheusRecorder::new(), limits, || {}).unwrap();
    assert_eq!(served, 0);
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn peak_is_kept_since_the_last_read() {
    let mut kv = manager();
    let mut slots = Vec::new();
    let mut copies = CopyPlan::default();
    kv.admit(SeqId(1), 160, &mut slots).unwrap(); // 10 blocks
    kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap(); // 11
    kv.free(SeqId(1)).unwrap();
    kv.admit(SeqId(2), 16, &mut slots).unwrap(); // 1

    let recorder = PrometheusRecorder::new();
    let exporter = MetricsExporter::new();
    let publish = |kv: &mut KvCache| {
        let snap = MetricsSnapshot::from_manager(kv);
        ::metrics::with_local_recorder(&recorder, || exporter.publish(&snap));
        recorder.render()
    };
    let first = publish(&mut kv);
    assert_eq!(value_of(&first, names::BLOCKS_USED), Some(1.0));
    assert_eq!(value_of(&first, names::BLOCKS_USED_PEAK), Some(11.0));
    // The window restarted: the next read sees only what happened since.
    let second = publish(&mut kv);
    assert_eq!(value_of(&second, names::BLOCKS_USED_PEAK), Some(1.0));
    kv.admit(SeqId(3), 48, &mut slots).unwrap();
    kv.free(SeqId(3)).unwrap();
    let third = publish(&mut kv);
    assert_eq!(value_of(&third, names::BLOCKS_USED_PEAK), Some(4.0));
}

#[test]
fn exactly_the_wired_metrics_come_from_the_manager() {
    let mut kv = manager();
    let recorder = PrometheusRecorder::new();
    let exporter = MetricsExporter::new();
    let snap = MetricsSnapshot::from_manager(&mut kv);
    // Everything but swap time and disk transfers (timed by the engine) comes from
    // the manager.
    assert_eq!(snap.extra.swap_time_us, None);
    assert_eq!(snap.extra.disk_transfers, None);
    assert_eq!(snap.extra.prefix_query_tokens, Some(0));
    assert_ne!(snap.extra, ExtraCounters::default());
    ::metrics::with_local_recorder(&recorder, || exporter.publish(&snap));
    let text = recorder.render();
    for m in METRICS {
        let present = text.lines().any(|l| {
            l.strip_prefix(m.name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        });
        assert_eq!(present, m.wired, "{}", m.name);
    }
}

#[test]
fn the_metric_table_is_consistent() {
    let mut seen = std::collections::HashSet::new();
    for m in METRICS {
        assert!(seen.insert(m.name), "duplicate {}", m.name);
        assert!(m.name.starts_with("pagedkv_"), "{}", m.name);
        assert!(
            m.name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit()),
            "{}",
            m.name
        );
        assert_eq!(
            m.kind == MetricKind::Counter,
            m.name.ends_with("_total"),
            "{}",
            m.name
        );
        assert!(!m.help.is_empty() && !m.help.contains('\n'));
    }
}

#[test]
fn recorder_renders_labels_specials_and_histograms() {
    let recorder = PrometheusRecorder::new();
    ::metrics::with_local_recorder(&recorder, || {
        ::metrics::gauge!("t_gauge", "who" => "a\"b\\c\nd").set(f64::INFINITY);
        ::metrics::gauge!("t_nan").set(f64::NAN);
        ::metrics::counter!("t_total").increment(3);
        ::metrics::counter!("t_total").increment(4);
        ::metrics::histogram!("t_seconds").record(0.5);
        ::metrics::histogram!("t_seconds").record(1.5);
        ::metrics::describe_counter!("t_total", "line one\nline two");
    });
    let text = recorder.render();
    // The spelling of infinity is the exporter's (`inf`, which Prometheus parses as
    // `+Inf` does); the value is what counts.
    assert_eq!(
        value_of(&text, "t_gauge{who=\"a\\\"b\\\\c\\nd\"}"),
        Some(f64::INFINITY),
        "{text}"
    );
    assert!(text.contains("t_nan NaN\n"));
    assert!(text.contains("# HELP t_total line one\\nline two\n"));
    assert!(text.contains("# TYPE t_total counter\nt_total 7\n"));
    assert!(text.contains("# TYPE t_seconds summary\n"));
    assert!(text.contains("t_seconds_sum 2\nt_seconds_count 2\n"));
}

/// A prompt served by each tier in turn (device, host, disk) with the disk jobs run on
/// a `TransferEngine`: the per-tier counters and the engine's disk transfer counts
/// come out in the Prometheus text with the values the manager and engine hold.
#[test]
fn per_tier_counters_follow_stores_loads_and_engine_completions() {
    use pagedkv::executor::tier::{
        complete_disk_jobs, store_prefixes_to_host, submit_disk_stage, submit_disk_store,
        DiskPrefixStore, TransferEngine,
    };
    use pagedkv::{AdmitOptions, HostStorage, PrefixHit, TierConfig};

    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        kv_dtype: DType::F16,
    };
    let layout = KvLayout::new(shape, 16).unwrap();
    let bb = layout.block_bytes() as f64;
    let mut kv = KvCache::builder(layout)
        .num_blocks(16)
        .watermark_blocks(0)
        .tiers(TierConfig {
            num_host_blocks: 8,
            ..TierConfig::default()
        })
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("pagedkv-metrics-tiers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut engine = TransferEngine::new(HostStorage::with_host_tier(layout, 16, 8).unwrap());
    engine.attach_disk_store(DiskPrefixStore::create(&dir, &layout, 8).unwrap());
    let opts = AdmitOptions::default();
    let p: Vec<u32> = (0..49).collect(); // 3 full blocks
    kv.admit_tokens(SeqId(1), &p, &opts, &mut Vec::new())
        .unwrap();
    kv.free(SeqId(1)).unwrap();
    let lookup = |kv: &KvCache| {
        let mut hit = PrefixHit::default();
        kv.lookup_prefix(&p, &opts, &mut hit).unwrap();
        hit
    };
    let settle = |kv: &mut KvCache, engine: &mut TransferEngine<HostStorage>| {
        let start = std::time::Instant::now();
        while engine.disk_jobs_in_flight() > 0 {
            assert!(start.elapsed() < Duration::from_secs(20));
            for r in complete_disk_jobs(kv, engine).unwrap() {
                if let pagedkv::executor::tier::DiskJobReport::Stage { result, .. } = r {
                    result.unwrap();
                }
            }
        }
    };
    {
        let mut st = engine.storage().lock();
        assert_eq!(
            store_prefixes_to_host(&mut kv, &mut *st, usize::MAX).unwrap(),
            3
        );
    }
    submit_disk_store(&mut kv, &mut engine, usize::MAX).unwrap();
    settle(&mut kv, &mut engine);
    // A device hit, then a host hit, then a disk hit.
    let hit = lookup(&kv);
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    kv.free(SeqId(2)).unwrap();
    kv.evict_cached(usize::MAX);
    let hit = lookup(&kv);
    assert_eq!(hit.host_tokens(), 48);
    kv.admit_prompt(SeqId(3), &p, &hit).unwrap();
    let job = kv.load_job(SeqId(3)).unwrap();
    engine.submit(&job).unwrap();
    engine.wait(job.ticket).unwrap();
    engine.poll_completed();
    kv.complete_swap(job.ticket).unwrap();
    kv.free(SeqId(3)).unwrap();
    kv.evict_cached(usize::MAX);
    kv.evict_host_cache(usize::MAX).unwrap();
    let hit = lookup(&kv);
    assert_eq!(hit.disk_tokens(), 48);
    kv.admit_prompt(SeqId(4), &p, &hit).unwrap();
    submit_disk_stage(&mut kv, &mut engine, SeqId(4)).unwrap();
    settle(&mut kv, &mut engine);
    let job = kv.load_job(SeqId(4)).unwrap();
    engine.submit(&job).unwrap();
    engine.wait(job.ticket).unwrap();
    engine.poll_completed();
    kv.complete_swap(job.ticket).unwrap();
    kv.check_invariants().unwrap();

    let counters = engine.disk_transfer_counters();
    assert_eq!((counters.store_jobs, counters.load_jobs), (1, 1));
    assert_eq!(counters.stored_bytes, 3 * layout.block_bytes() as u64);
    let mut snap = MetricsSnapshot::from_manager(&mut kv);
    snap.extra = snap.extra.with_disk_transfers(&counters);
    let recorder = PrometheusRecorder::new();
    let exporter = MetricsExporter::new();
    ::metrics::with_local_recorder(&recorder, || {
        exporter.describe();
        exporter.publish(&snap);
    });
    let text = recorder.render();
    let v = |name: &str, label: &str, value: &str| {
        value_of(&text, &format!("{name}{{{label}=\"{value}\"}}"))
    };
    assert_eq!(
        v(names::TIER_HIT_TOKENS, "tier", "device"),
        Some(48.0),
        "{text}"
    );
    assert_eq!(v(names::TIER_HIT_TOKENS, "tier", "host"), Some(48.0));
    assert_eq!(v(names::TIER_HIT_TOKENS, "tier", "disk"), Some(48.0));
    assert_eq!(v(names::TIER_STORED_BLOCKS, "tier", "host"), Some(3.0));
    assert_eq!(v(names::TIER_STORED_BLOCKS, "tier", "disk"), Some(3.0));
    assert_eq!(v(names::TIER_STORED_BYTES, "tier", "disk"), Some(3.0 * bb));
    assert_eq!(v(names::TIER_LOADED_BLOCKS, "tier", "host"), Some(3.0));
    assert_eq!(v(names::TIER_LOADED_BLOCKS, "tier", "disk"), Some(3.0));
    assert_eq!(v(names::TIER_LOADED_BYTES, "tier", "host"), Some(3.0 * bb));
    assert_eq!(v(names::TIER_LOADED_BYTES, "tier", "disk"), Some(3.0 * bb));
    assert_eq!(v(names::DISK_TRANSFERS, "op", "store"), Some(1.0));
    assert_eq!(v(names::DISK_TRANSFERS, "op", "load"), Some(1.0));
    assert_eq!(
        v(names::DISK_TRANSFER_TIME_US, "op", "load"),
        Some(counters.load_time_us as f64)
    );
    assert!(text.contains("# TYPE pagedkv_disk_transfer_time_microseconds_total counter\n"));
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A hybrid cache's snapshot counts the whole arena (pages of every group), its peak
/// window, and the prefix hits its admissions served.
#[test]
fn a_hybrid_caches_snapshot_counts_every_group() {
    use pagedkv::{AdmitOptions, GroupSpec, GroupStep};
    let l = manager().layout().to_owned();
    let mut kv = KvCache::hybrid_builder(&[GroupSpec::full(l), GroupSpec::window(l, 32)])
        .num_blocks(64)
        .watermark_blocks(0)
        .build()
        .unwrap();
    let mut step = GroupStep::default();
    let prompt: Vec<u32> = (0..100).collect(); // 7 pages in each group
    let opts = AdmitOptions::default();
    kv.admit_tokens_grouped(SeqId(1), &prompt, &opts, &mut step)
        .unwrap();
    for _ in 0..40 {
        kv.append_grouped(SeqId(1), 1, &mut step).unwrap(); // the window gives pages back
    }
    let hit = kv
        .admit_tokens_grouped(SeqId(2), &prompt, &opts, &mut step)
        .unwrap()
        .cached_tokens;
    assert!(hit > 0, "the second request hits the first one's prompt");
    let snap = MetricsSnapshot::from_manager(&mut kv);
    let st = kv.group_stats();
    assert_eq!(snap.cache.num_blocks, 64);
    assert_eq!(snap.cache.used_blocks, st.used_pages);
    assert_eq!(snap.peak_used_blocks, st.peak_used_pages.max(st.used_pages));
    assert_eq!(
        snap.extra.prefix_query_tokens,
        Some(2 * prompt.len() as u64)
    );
    assert_eq!(snap.extra.prefix_hit_tokens, Some(hit as u64));
}
