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
    // Everything but swap time (timed by the engine) comes from the manager.
    assert_eq!(snap.extra.swap_time_us, None);
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
