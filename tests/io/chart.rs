//! The SVG chart: produced from a paged and a contiguous run of the same workload,
//! well-formed XML, one polyline per documented line, markers, labels and a legend.

use pagedkv::baseline::{CacheAllocator, ContiguousCache};
use pagedkv::chart::{EventKind, MemoryChart, Sample, Timeline, LINES};
use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 4,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        kv_dtype: DType::BF16,
    };
    KvLayout::new(shape, 16).unwrap()
}

/// Runs the same admit/decode/free workload on `cache`; a sequence that cannot grow
/// is preempted (freed, as for recompute) and marked.
fn simulate(cache: &mut dyn CacheAllocator, steps: u64) -> Timeline {
    let mut t = Timeline::new(cache.name());
    let mut live: Vec<(SeqId, usize)> = Vec::new();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut id = 0;
    for step in 0..steps {
        let prompt = 16 + (next() % 200) as usize;
        if cache.can_admit(prompt) {
            id += 1;
            cache.admit(SeqId(id), prompt, &mut slots).unwrap();
            live.push((SeqId(id), prompt + 1 + (next() % 300) as usize));
        }
        let mut i = 0;
        while i < live.len() {
            let (seq, target) = live[i];
            let len = cache.num_tokens(seq).unwrap();
            let grown = len < target && cache.append(seq, 1, &mut slots, &mut copies).is_ok();
            if !grown {
                if len < target {
                    t.mark(step, EventKind::Preemption);
                }
                cache.free(seq).unwrap();
                live.swap_remove(i);
            } else {
                i += 1;
            }
        }
        t.record(step, &cache.stats(), 0).unwrap();
    }
    t
}

fn chart() -> MemoryChart {
    let layout = layout();
    let mut paged = KvCache::new(layout, CacheConfig::new(256)).unwrap();
    let mut contiguous = ContiguousCache::new(layout, 256, 528).unwrap();
    let mut p = simulate(&mut paged, 400);
    let c = simulate(&mut contiguous, 400);
    p.mark(200, EventKind::Defragmentation);
    MemoryChart::new(
        "KV memory: paged vs contiguous <&> \"test\"",
        &layout,
        256,
        p,
        c,
    )
}

fn points(node: roxmltree::Node<'_, '_>) -> Vec<(f64, f64)> {
    node.attribute("points")
        .unwrap_or("")
        .split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').unwrap();
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

#[test]
fn svg_is_well_formed_with_one_series_per_documented_line() {
    let chart = chart();
    // The workload overflows the contiguous cache's admission far sooner than the paged
    // one; both runs produced something to draw.
    assert!(chart.paged.peak_used_blocks() > 0);
    assert!(chart.contiguous.peak_used_blocks() > 0);
    let svg = chart.to_svg();
    let doc = roxmltree::Document::parse(&svg).expect("the SVG parses as XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(
        root.tag_name().namespace(),
        Some("http://www.w3.org/2000/svg")
    );

    let series: Vec<_> = doc
        .descendants()
        .filter(|n| n.attribute("data-series").is_some())
        .collect();
    let ids: Vec<_> = series
        .iter()
        .map(|n| n.attribute("data-series").unwrap())
        .collect();
    let documented: Vec<_> = LINES.iter().map(|l| l.id).collect();
    assert_eq!(ids, documented);
    for (node, line) in series.iter().zip(LINES) {
        assert_eq!(node.tag_name().name(), "polyline");
        assert_eq!(node.attribute("stroke"), Some(line.color));
        let pts = points(*node);
        assert!(!pts.is_empty(), "{}", line.id);
        for (x, y) in pts {
            assert!((0.0..=1000.0).contains(&x) && (0.0..=560.0).contains(&y));
        }
    }
    // Reserved memory of the paged run rises above zero; its live line is never above
    // its reserved line (a smaller y is higher on the page).
    let reserved = points(series[0]);
    let live = points(series[1]);
    assert_eq!(reserved.len(), live.len());
    for (r, l) in reserved.iter().zip(&live) {
        assert!(l.1 >= r.1 - 1e-9);
    }

    let texts: Vec<String> = doc
        .descendants()
        .filter(|n| n.tag_name().name() == "text")
        .filter_map(|n| n.text().map(str::to_string))
        .collect();
    for line in LINES {
        assert!(
            texts.iter().any(|t| t == line.label),
            "legend: {}",
            line.label
        );
    }
    assert!(texts.iter().any(|t| t == "scheduler step"));
    assert!(texts.iter().any(|t| t.starts_with("KV memory (")));
    assert!(texts
        .iter()
        .any(|t| t == "KV memory: paged vs contiguous <&> \"test\""));
    assert!(texts.iter().any(|t| t == "arena capacity"));

    let markers = |kind: &str, run: &str| {
        doc.descendants()
            .filter(|n| {
                n.attribute("data-event") == Some(kind) && n.attribute("data-run") == Some(run)
            })
            .count()
    };
    assert_eq!(markers("defragmentation", "paged"), 1);
    // Paged admits optimistically and preempts when the arena runs out; contiguous
    // reserves the longest request (528 tokens) up front and never has to.
    let paged_preemptions = chart
        .paged
        .events()
        .iter()
        .filter(|e| e.kind == EventKind::Preemption)
        .count();
    assert!(
        paged_preemptions > 0,
        "the workload overflows the paged arena"
    );
    assert!(markers("preemption", "paged") > 0);
    assert!(markers("preemption", "paged") <= paged_preemptions);
    assert_eq!(markers("preemption", "contiguous"), 0);
}

#[test]
fn downsampling_keeps_the_peak() {
    let layout = layout();
    let mut p = Timeline::new("paged");
    for step in 0..100_000u64 {
        let used = if step == 50_001 { 60 } else { 10 };
        p.push(Sample {
            step,
            used_blocks: used,
            live_tokens: used * 16,
            ..Sample::default()
        })
        .unwrap();
    }
    let chart = MemoryChart::new("spike", &layout, 64, p, Timeline::new("contiguous"));
    let svg = chart.to_svg();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let line = doc
        .descendants()
        .find(|n| n.attribute("data-series") == Some("paged-reserved"))
        .unwrap();
    let pts = points(line);
    assert!(pts.len() <= 1000, "{} points", pts.len());
    let baseline = pts[0].1;
    let top = pts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    // y runs from 490 (0) to 50 (top of scale); 60 blocks is 6x as far up as 10.
    assert!(
        ((490.0 - top) / (490.0 - baseline) - 6.0).abs() < 0.05,
        "{top} {baseline}"
    );
    // An empty contiguous run still has its (empty) documented polylines.
    let empty = doc
        .descendants()
        .filter(|n| {
            n.attribute("data-series")
                .is_some_and(|s| s.starts_with("contiguous"))
        })
        .count();
    assert_eq!(empty, 2);
}

#[test]
fn steps_must_not_go_back() {
    let mut t = Timeline::new("paged");
    t.push(Sample {
        step: 5,
        ..Sample::default()
    })
    .unwrap();
    assert!(t
        .push(Sample {
            step: 4,
            ..Sample::default()
        })
        .is_err());
    assert_eq!(t.samples().len(), 1);
}

#[test]
fn writes_a_file() {
    let chart = chart();
    let path = std::env::temp_dir().join(format!("pagedkv-chart-{}.svg", std::process::id()));
    chart.write_svg(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(text, chart.to_svg());
    assert!(chart.write_svg("/no/such/dir/x.svg").is_err());
}
