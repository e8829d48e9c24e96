//! The broker's moves as a small SVG: bytes each model (and the external reservations)
//! held over the broker's clock, one step line each, a marker per move whose tooltip
//! names who gave, who took, the bytes and why, and the budget as a dashed line.
//! Hand-written like [`crate::chart`], for the same reasons (no font backend).

use std::fmt::Write as _;

use super::{MoveEvent, Party};

const W: f64 = 900.0;
const H: f64 = 360.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
];
const EXTERNAL_COLOR: &str = "#ff7f0e";

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn party_name(p: Party, names: &[String]) -> String {
    match p {
        Party::Free => "free budget".into(),
        Party::External(r) => format!("reservation {}", r.0),
        Party::Model(m) => names
            .get(m.0 as usize)
            .cloned()
            .unwrap_or_else(|| m.to_string()),
    }
}

/// The block counts of a move that are not zero, for its tooltip: blocks copied to
/// shrink, prefix-cache blocks spilled to the host tier or evicted.
fn block_counts(e: &MoveEvent) -> String {
    let mut out = String::new();
    for (n, what) in [
        (e.moved_blocks, "blocks moved"),
        (e.spilled_blocks, "cached blocks spilled to the host tier"),
        (e.evicted_blocks, "cached blocks evicted"),
    ] {
        if n > 0 {
            let _ = write!(out, "; {n} {what}");
        }
    }
    out
}

/// Renders the picture; see the module docs.
pub(super) fn render(title: &str, names: &[String], events: &[MoveEvent], budget: usize) -> String {
    // Series 0..n are the models, n is the external reservations together.
    let n = names.len();
    let mut held = vec![0i64; n + 1];
    let mut points: Vec<Vec<(u64, i64)>> = vec![Vec::new(); n + 1];
    let series = |p: Party| match p {
        Party::Model(m) if (m.0 as usize) < n => Some(m.0 as usize),
        Party::External(_) => Some(n),
        _ => None,
    };
    let (x0, x1) = match (events.first(), events.last()) {
        (Some(a), Some(b)) => (
            events.iter().map(|e| e.clock).min().unwrap_or(a.clock),
            events.iter().map(|e| e.clock).max().unwrap_or(b.clock),
        ),
        _ => (0, 1),
    };
    let x1 = x1.max(x0 + 1);
    for s in &mut points {
        s.push((x0, 0));
    }
    for e in events {
        for (p, sign) in [(e.from, -1i64), (e.to, 1)] {
            if let Some(s) = series(p) {
                held[s] += sign * e.bytes as i64;
                points[s].push((e.clock, held[s]));
            }
        }
    }
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let ymax = budget.max(1) as f64;
    let sx = |x: u64| LEFT + (x - x0) as f64 / (x1 - x0) as f64 * pw;
    let sy = |y: i64| TOP + ph - (y.max(0) as f64 / ymax).min(1.0) * ph;
    let mib = |b: f64| b / (1024.0 * 1024.0);

    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        svg,
        r#"<rect width="{W}" height="{H}" fill="white"/><text x="{LEFT}" y="22" font-size="15">{}</text>"#,
        escape(title)
    );
    // Axes, ticks, budget line.
    let _ = write!(
        svg,
        r#"<line x1="{LEFT}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}" stroke="black"/>"#,
        TOP + ph,
        LEFT + pw,
        TOP + ph,
        TOP + ph
    );
    for i in 0..=4 {
        let v = ymax * i as f64 / 4.0;
        let y = TOP + ph - ph * i as f64 / 4.0;
        let _ = write!(
            svg,
            r#"<line x1="{}" y1="{y:.1}" x2="{LEFT}" y2="{y:.1}" stroke="black"/><text x="{}" y="{:.1}" text-anchor="end">{:.0}</text>"#,
            LEFT - 4.0,
            LEFT - 6.0,
            y + 4.0,
            mib(v)
        );
        let x = x0 + (x1 - x0) * i / 4;
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{x}</text>"#,
            sx(x),
            TOP + ph + 16.0
        );
    }
    let _ = write!(
        svg,
        r#"<text x="{:.1}" y="{}" text-anchor="middle">step</text><text x="16" y="{:.1}" transform="rotate(-90 16 {:.1})" text-anchor="middle">MiB held</text>"#,
        LEFT + pw / 2.0,
        H - 12.0,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    let _ = write!(
        svg,
        r#"<line data-line="budget" x1="{LEFT}" y1="{TOP}" x2="{}" y2="{TOP}" stroke="gray" stroke-dasharray="6 4"/>"#,
        LEFT + pw
    );
    // One step line per series.
    for (s, pts) in points.iter().enumerate() {
        if s == n && pts.len() == 1 {
            continue; // no reservation ever: no line
        }
        let color = if s == n {
            EXTERNAL_COLOR
        } else {
            COLORS[s % COLORS.len()]
        };
        let mut path = String::new();
        let mut last: Option<i64> = None;
        for &(x, y) in pts {
            if let Some(prev) = last {
                let _ = write!(path, "{:.1},{:.1} ", sx(x), sy(prev));
            }
            let _ = write!(path, "{:.1},{:.1} ", sx(x), sy(y));
            last = Some(y);
        }
        if let Some(prev) = last {
            let _ = write!(path, "{:.1},{:.1}", sx(x1), sy(prev));
        }
        let _ = write!(
            svg,
            r#"<polyline data-series="{s}" fill="none" stroke="{color}" stroke-width="2" points="{path}"/>"#
        );
        let label = if s == n {
            "external".to_string()
        } else {
            names[s].clone()
        };
        let ly = TOP + 14.0 + 18.0 * s as f64;
        let _ = write!(
            svg,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            W - RIGHT + 15.0,
            W - RIGHT + 35.0,
            W - RIGHT + 40.0,
            ly + 4.0,
            escape(&label)
        );
    }
    // A marker per move, on the taker's line, with the explanation as its tooltip.
    let mut after = vec![0i64; n + 1];
    for e in events {
        for (p, sign) in [(e.from, -1i64), (e.to, 1)] {
            if let Some(s) = series(p) {
                after[s] += sign * e.bytes as i64;
            }
        }
        let at = series(e.to).or(series(e.from));
        let Some(s) = at else { continue };
        let _ = write!(
            svg,
            r#"<circle data-event="{}" cx="{:.1}" cy="{:.1}" r="3" fill="black"><title>{} -&gt; {}: {:.1} MiB ({}){}</title></circle>"#,
            e.reason.name(),
            sx(e.clock),
            sy(after[s]),
            escape(&party_name(e.from, names)),
            escape(&party_name(e.to, names)),
            mib(e.bytes as f64),
            e.reason.name(),
            block_counts(e)
        );
    }
    svg.push_str("</svg>\n");
    svg
}
