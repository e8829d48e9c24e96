//! The SVG pictures parsed with a real XML parser (`roxmltree`, already the chart
//! test's dev-dependency): the broker's move chart and `src/chart.rs`'s memory chart
//! are well-formed, have one root `svg` element in the SVG namespace whose `viewBox`
//! matches its size, draw everything inside it, and the broker's chart draws every
//! move (one marker per event, in order, with who gave, who took, bytes and why) and
//! ends each model's line at the bytes the ledger grants it.

use std::time::Duration;

use pagedkv::broker::{Broker, BrokerConfig, ModelLimits, Party, SleepOptions};
use pagedkv::chart::{MemoryChart, Timeline};
use pagedkv::{
    AdmitOptions, CacheConfig, DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId, TierConfig,
};

const CHUNK: usize = 64 << 10;

fn layout(layers: usize, heads: usize, block: usize) -> KvLayout {
    let shape = ModelShape {
        num_layers: layers,
        num_q_heads: heads,
        num_kv_heads: heads,
        head_dim: 64,
        kv_dtype: DType::F16,
    };
    KvLayout::new(shape, block).unwrap()
}

/// Checks the root and the viewBox; returns the viewBox's width and height.
fn check_root(doc: &roxmltree::Document<'_>) -> (f64, f64) {
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(
        root.tag_name().namespace(),
        Some("http://www.w3.org/2000/svg")
    );
    let svgs = doc
        .descendants()
        .filter(|n| n.is_element() && n.tag_name().name() == "svg")
        .count();
    assert_eq!(svgs, 1, "one svg element");
    let vb: Vec<f64> = root
        .attribute("viewBox")
        .expect("a viewBox")
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(vb.len(), 4);
    assert_eq!((vb[0], vb[1]), (0.0, 0.0));
    let size = |a: &str| root.attribute(a).unwrap().parse::<f64>().unwrap();
    assert_eq!((vb[2], vb[3]), (size("width"), size("height")));
    (vb[2], vb[3])
}

fn num(n: roxmltree::Node<'_, '_>, a: &str) -> f64 {
    n.attribute(a)
        .unwrap_or_else(|| panic!("{} has no {a}", n.tag_name().name()))
        .parse()
        .unwrap()
}

fn points(n: roxmltree::Node<'_, '_>) -> Vec<(f64, f64)> {
    n.attribute("points")
        .unwrap()
        .split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').unwrap();
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

/// Every circle and polyline point lies inside the viewBox.
fn check_inside(doc: &roxmltree::Document<'_>, (w, h): (f64, f64)) {
    let inside = |x: f64, y: f64| (0.0..=w).contains(&x) && (0.0..=h).contains(&y);
    for n in doc.descendants().filter(|n| n.is_element()) {
        match n.tag_name().name() {
            "circle" => assert!(inside(num(n, "cx"), num(n, "cy"))),
            "polyline" => {
                for (x, y) in points(n) {
                    assert!(inside(x, y), "({x}, {y}) outside {w}x{h}");
                }
            }
            "line" => {
                assert!(inside(num(n, "x1"), num(n, "y1")) && inside(num(n, "x2"), num(n, "y2")))
            }
            _ => {}
        }
    }
}

#[test]
fn the_broker_chart_is_well_formed_and_draws_every_move() {
    // Names with every character XML escapes.
    let names = ["chat <v2>", "embed & co", "rerank \"q\" 'r'"];
    let mut b: Broker<HostStorage> = Broker::new(BrokerConfig::new(12 * CHUNK, CHUNK)).unwrap();
    let mut ids = Vec::new();
    for (i, l) in [layout(2, 2, 16), layout(1, 4, 8), layout(3, 1, 4)]
        .into_iter()
        .enumerate()
    {
        let bpc = b.blocks_per_chunk(&l).unwrap();
        let kv = KvCache::builder(l)
            .num_blocks(2 * bpc)
            .watermark_blocks(0)
            .tiers(TierConfig {
                num_host_blocks: 64,
                ..TierConfig::default()
            })
            .build()
            .unwrap();
        let storage = HostStorage::with_host_tier(l, 2 * bpc, 64).unwrap();
        let limits = ModelLimits::new(CHUNK, 8 * CHUNK).with_priority(i as i32);
        ids.push(b.register(names[i], kv, storage, limits).unwrap());
    }
    let opts = AdmitOptions::default();
    let mut slots = Vec::new();
    // Model 0 fills its cache with prompts and frees them; grows into the free budget.
    {
        let mut g = b.lock(ids[0]).unwrap();
        let bpc = g.kv().num_blocks() / 2;
        g.ensure_available(5 * bpc).unwrap();
        for s in 0..4u32 {
            let prompt: Vec<u32> = (s * 1000..s * 1000 + 65).collect();
            g.kv_mut()
                .admit_tokens(SeqId(s.into()), &prompt, &opts, &mut slots)
                .unwrap();
            g.kv_mut().free(SeqId(s.into())).unwrap();
        }
    }
    b.set_clock(10);
    // Model 2 takes the free budget, then model 0's idle and cached memory.
    {
        let mut g = b.lock(ids[2]).unwrap();
        let bpc = g.kv().num_blocks() / 2;
        g.ensure_available(8 * bpc).unwrap();
    }
    b.set_clock(20);
    let r = b.reserve(CHUNK, Duration::from_millis(10)).unwrap();
    b.set_clock(30);
    b.release(r).unwrap();
    b.set_clock(40);
    let sleep = SleepOptions {
        spill_cached_prefixes: true,
        ..SleepOptions::default()
    };
    b.sleep(ids[2], sleep).unwrap();
    b.sleep(ids[0], sleep).unwrap();
    b.set_clock(50);
    b.wake(ids[0], 4 * CHUNK).unwrap();
    let events = b.events();
    let reasons: std::collections::BTreeSet<_> = events.iter().map(|e| e.reason.name()).collect();
    for r in [
        "register",
        "grow",
        "take_idle",
        "reserve",
        "release",
        "sleep",
        "wake",
    ] {
        assert!(reasons.contains(r), "no {r} in {reasons:?}");
    }
    assert!(events.iter().any(|e| e.spilled_blocks > 0));

    let svg = b.events_svg("moves <of> \"three\" & more");
    let doc = roxmltree::Document::parse(&svg).expect("the broker SVG parses as XML");
    let size = check_root(&doc);
    check_inside(&doc, size);
    // The title and the legend survive escaping.
    let texts: Vec<&str> = doc.descendants().filter_map(|n| n.text()).collect();
    assert!(texts.contains(&"moves <of> \"three\" & more"));
    for name in names {
        assert!(texts.contains(&name), "{name} not in the legend");
    }
    // One marker per move, in order, its tooltip naming both sides, bytes and reason.
    let markers: Vec<_> = doc
        .descendants()
        .filter(|n| n.attribute("data-event").is_some())
        .collect();
    assert_eq!(markers.len(), events.len());
    let party = |p: Party| match p {
        Party::Free => "free budget".to_string(),
        Party::External(r) => format!("reservation {}", r.0),
        Party::Model(m) => names[m.0 as usize].to_string(),
    };
    for (m, e) in markers.iter().zip(&events) {
        assert_eq!(m.tag_name().name(), "circle");
        assert_eq!(m.attribute("data-event"), Some(e.reason.name()));
        let title = m
            .children()
            .find(|c| c.tag_name().name() == "title")
            .and_then(|t| t.text())
            .unwrap();
        let mut want = format!(
            "{} -> {}: {:.1} MiB ({})",
            party(e.from),
            party(e.to),
            e.bytes as f64 / (1024.0 * 1024.0),
            e.reason.name()
        );
        for (n, what) in [
            (e.moved_blocks, "blocks moved"),
            (e.spilled_blocks, "cached blocks spilled to the host tier"),
            (e.evicted_blocks, "cached blocks evicted"),
        ] {
            if n > 0 {
                want += &format!("; {n} {what}");
            }
        }
        assert_eq!(title, want);
    }
    // Each model's line starts at 0 bytes and ends at what the ledger grants it, on
    // the scale set by the dashed budget line.
    let budget_y = doc
        .descendants()
        .find(|n| n.attribute("data-line") == Some("budget"))
        .map(|n| num(n, "y1"))
        .unwrap();
    let stats = b.stats();
    for (i, m) in stats.models.iter().enumerate() {
        let line = doc
            .descendants()
            .find(|n| n.attribute("data-series") == Some(&*i.to_string()))
            .unwrap();
        let pts = points(line);
        let zero_y = pts[0].1;
        let end_y = pts.last().unwrap().1;
        let bytes = (zero_y - end_y) / (zero_y - budget_y) * stats.budget_bytes as f64;
        // Coordinates carry one decimal: a tenth of a pixel of the scale.
        let tolerance = 0.1 / (zero_y - budget_y) * stats.budget_bytes as f64;
        assert!(
            (bytes - m.granted_bytes as f64).abs() <= tolerance,
            "{}: line ends at {bytes:.0} bytes, granted {}",
            m.name,
            m.granted_bytes
        );
    }
}

#[test]
fn the_memory_chart_is_well_formed_inside_its_view_box() {
    let l = layout(2, 2, 16);
    let mut kv = KvCache::new(l, CacheConfig::new(64)).unwrap();
    let mut t = Timeline::new("paged");
    let mut slots = Vec::new();
    for step in 0..40u64 {
        if step % 3 == 0 {
            kv.admit(SeqId(step), 16 * (1 + step as usize % 4), &mut slots)
                .unwrap();
        }
        if step % 5 == 4 {
            kv.free(SeqId(step - step % 3)).ok();
        }
        t.record(step, &kv.stats(), 0).unwrap();
    }
    let chart = MemoryChart::new("a <chart> & \"quotes\"", &l, 64, t, Timeline::new("none"));
    let svg = chart.to_svg();
    let doc = roxmltree::Document::parse(&svg).expect("the chart SVG parses as XML");
    let size = check_root(&doc);
    check_inside(&doc, size);
}
