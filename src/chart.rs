//! KV memory over time, paged vs contiguous, as an SVG picture.
//!
//! A [`Timeline`] records one run: at each step the blocks in use, the live tokens,
//! the cached and the swapped blocks, plus event markers (preemption,
//! defragmentation). A [`MemoryChart`] draws a paged and a contiguous timeline of the
//! same arena on one plot: one polyline per entry of [`LINES`], the arena's capacity
//! as a dashed reference line, markers for events, axis labels, ticks and a legend.
//!
//! The SVG is written by hand (about 300 lines here) rather than with `plotters`:
//! plotters lays out text with font metrics, which needs a font backend and system
//! libraries, and brings a dependency tree, while this picture needs only polylines,
//! a few shapes and text that the viewer lays out.
//!
//! ```
//! use pagedkv::chart::{EventKind, MemoryChart, Timeline};
//! use pagedkv::{CacheConfig, DType, KvCache, KvLayout, ModelShape, SeqId};
//! use pagedkv::baseline::{CacheAllocator, ContiguousCache};
//!
//! let shape = ModelShape { num_layers: 2, num_q_heads: 4, num_kv_heads: 2, head_dim: 8,
//!                          kv_dtype: DType::F16 };
//! let layout = KvLayout::new(shape, 16)?;
//! let mut paged = KvCache::new(layout, CacheConfig::new(64))?;
//! let mut contiguous = ContiguousCache::new(layout, 64, 256)?;
//! let (mut p, mut c) = (Timeline::new("paged"), Timeline::new("contiguous"));
//! let mut slots = Vec::new();
//! for step in 0..4u64 {
//!     paged.admit(SeqId(step), 20, &mut slots)?;
//!     contiguous.admit(SeqId(step), 20, &mut slots)?;
//!     p.record(step, &paged.stats(), 0)?;
//!     c.record(step, &CacheAllocator::stats(&contiguous), 0)?;
//! }
//! p.mark(3, EventKind::Preemption);
//! let svg = MemoryChart::new("demo", &layout, 64, p, c).to_svg();
//! assert!(svg.starts_with("<svg"));
//! # Ok::<(), pagedkv::Error>(())
//! ```

use std::fmt::Write as _;

use crate::error::{Error, Result};
use crate::layout::KvLayout;
use crate::manager::CacheStats;

/// One step of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sample {
    /// Scheduler step (x axis).
    pub step: u64,
    /// Blocks reserved by sequences (`CacheStats::used_blocks`).
    pub used_blocks: usize,
    /// Tokens held (`CacheStats::live_token_slots`).
    pub live_tokens: usize,
    /// Unreferenced blocks kept for the prefix cache.
    pub cached_blocks: usize,
    /// Blocks swapped out to the host tier.
    pub swapped_blocks: usize,
}

/// What an event marker means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A sequence was preempted (swapped out or dropped for recompute). Drawn as a
    /// triangle.
    Preemption,
    /// The arena was defragmented. Drawn as a diamond and a dashed vertical line.
    Defragmentation,
}

impl EventKind {
    /// Every kind, in legend order.
    pub const ALL: [EventKind; 2] = [EventKind::Preemption, EventKind::Defragmentation];

    /// Lowercase name, also the marker's `data-event` attribute.
    pub const fn name(self) -> &'static str {
        match self {
            EventKind::Preemption => "preemption",
            EventKind::Defragmentation => "defragmentation",
        }
    }
}

/// An event at a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// Step it happened at.
    pub step: u64,
    /// What happened.
    pub kind: EventKind,
}

/// The time series of one run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Timeline {
    name: String,
    samples: Vec<Sample>,
    events: Vec<Event>,
}

impl Timeline {
    /// An empty timeline (`name` is for reports; the chart labels runs itself).
    pub fn new(name: impl Into<String>) -> Self {
        Timeline {
            name: name.into(),
            samples: Vec::new(),
            events: Vec::new(),
        }
    }

    /// The run's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Records the counters at `step`.
    ///
    /// # Errors
    /// As [`Self::push`].
    pub fn record(&mut self, step: u64, stats: &CacheStats, swapped_blocks: usize) -> Result<()> {
        self.push(Sample {
            step,
            used_blocks: stats.used_blocks,
            live_tokens: stats.live_token_slots,
            cached_blocks: stats.cached_blocks,
            swapped_blocks,
        })
    }

    /// Appends a sample.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `sample.step` is before the last sample's step;
    /// the timeline is unchanged.
    pub fn push(&mut self, sample: Sample) -> Result<()> {
        if let Some(last) = self.samples.last() {
            if sample.step < last.step {
                return Err(Error::config(
                    "step",
                    format!(
                        "{} is before the previous sample's step {}",
                        sample.step, last.step
                    ),
                ));
            }
        }
        self.samples.push(sample);
        Ok(())
    }

    /// Marks an event at `step` (any order).
    pub fn mark(&mut self, step: u64, kind: EventKind) {
        self.events.push(Event { step, kind });
    }

    /// The samples, in step order.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// The events, in the order they were marked.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Highest `used_blocks` recorded.
    pub fn peak_used_blocks(&self) -> usize {
        self.samples
            .iter()
            .map(|s| s.used_blocks)
            .max()
            .unwrap_or(0)
    }
}

/// Which run a line belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Run {
    /// The paged [`crate::KvCache`].
    Paged,
    /// The contiguous baseline (`baseline::ContiguousCache`, feature `testing`).
    Contiguous,
}

/// Which counter a line plots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantity {
    /// Memory of the blocks sequences hold ([`Sample::used_blocks`]).
    Reserved,
    /// Memory the live tokens need ([`Sample::live_tokens`]): the gap to `Reserved` is
    /// waste.
    Live,
    /// Memory of prefix-cache blocks ([`Sample::cached_blocks`]).
    Cached,
    /// Memory swapped to the host ([`Sample::swapped_blocks`]).
    Swapped,
}

/// One documented line of the chart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Line {
    /// Id, the polyline's `data-series` attribute.
    pub id: &'static str,
    /// Legend text.
    pub label: &'static str,
    /// Run it is drawn from.
    pub run: Run,
    /// Counter it plots.
    pub quantity: Quantity,
    /// Stroke colour.
    pub color: &'static str,
    /// SVG `stroke-dasharray` (empty for solid).
    pub dash: &'static str,
}

const PAGED_COLOR: &str = "#1f77b4";
const CONTIGUOUS_COLOR: &str = "#d62728";

/// The lines every chart draws, in legend order.
pub const LINES: [Line; 6] = [
    Line {
        id: "paged-reserved",
        label: "paged: reserved",
        run: Run::Paged,
        quantity: Quantity::Reserved,
        color: PAGED_COLOR,
        dash: "",
    },
    Line {
        id: "paged-live",
        label: "paged: live tokens",
        run: Run::Paged,
        quantity: Quantity::Live,
        color: PAGED_COLOR,
        dash: "2 3",
    },
    Line {
        id: "paged-cached",
        label: "paged: prefix cache",
        run: Run::Paged,
        quantity: Quantity::Cached,
        color: "#2ca02c",
        dash: "",
    },
    Line {
        id: "paged-swapped",
        label: "paged: swapped to host",
        run: Run::Paged,
        quantity: Quantity::Swapped,
        color: "#9467bd",
        dash: "",
    },
    Line {
        id: "contiguous-reserved",
        label: "contiguous: reserved",
        run: Run::Contiguous,
        quantity: Quantity::Reserved,
        color: CONTIGUOUS_COLOR,
        dash: "",
    },
    Line {
        id: "contiguous-live",
        label: "contiguous: live tokens",
        run: Run::Contiguous,
        quantity: Quantity::Live,
        color: CONTIGUOUS_COLOR,
        dash: "2 3",
    },
];

/// A paged and a contiguous run of the same arena, ready to draw.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryChart {
    /// Title above the plot.
    pub title: String,
    /// Tokens per block (converts live tokens to memory).
    pub block_size: usize,
    /// Bytes per block over all layers; 0 plots in blocks instead of bytes.
    pub block_bytes: usize,
    /// Blocks in the arena (the dashed capacity line).
    pub capacity_blocks: usize,
    /// The paged run.
    pub paged: Timeline,
    /// The contiguous run.
    pub contiguous: Timeline,
}

const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 560.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 760.0;
const TOP: f64 = 70.0;
const BOTTOM: f64 = 490.0;

impl MemoryChart {
    /// A chart of `paged` and `contiguous` over an arena of `capacity_blocks` blocks of
    /// `layout`.
    pub fn new(
        title: impl Into<String>,
        layout: &KvLayout,
        capacity_blocks: usize,
        paged: Timeline,
        contiguous: Timeline,
    ) -> Self {
        MemoryChart {
            title: title.into(),
            block_size: layout.block_size(),
            block_bytes: layout.block_bytes(),
            capacity_blocks,
            paged,
            contiguous,
        }
    }

    fn timeline(&self, run: Run) -> &Timeline {
        match run {
            Run::Paged => &self.paged,
            Run::Contiguous => &self.contiguous,
        }
    }

    /// The value of `q` in a sample, in blocks (live tokens as fractional blocks).
    fn blocks(&self, s: &Sample, q: Quantity) -> f64 {
        match q {
            Quantity::Reserved => s.used_blocks as f64,
            Quantity::Live => s.live_tokens as f64 / self.block_size.max(1) as f64,
            Quantity::Cached => s.cached_blocks as f64,
            Quantity::Swapped => s.swapped_blocks as f64,
        }
    }

    /// The y unit: its name and how many blocks one unit is.
    fn unit(&self, max_blocks: f64) -> (&'static str, f64) {
        if self.block_bytes == 0 {
            return ("blocks", 1.0);
        }
        let max_bytes = max_blocks * self.block_bytes as f64;
        let (name, bytes) = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]
            .into_iter()
            .find(|&(_, b)| max_bytes >= b as f64)
            .unwrap_or(("bytes", 1));
        (name, bytes as f64 / self.block_bytes as f64)
    }

    /// The picture as an SVG document.
    pub fn to_svg(&self) -> String {
        let all = [&self.paged, &self.contiguous];
        let steps = all
            .iter()
            .flat_map(|t| {
                t.samples
                    .iter()
                    .map(|s| s.step)
                    .chain(t.events.iter().map(|e| e.step))
            })
            .fold(None, |acc: Option<(u64, u64)>, s| match acc {
                None => Some((s, s)),
                Some((lo, hi)) => Some((lo.min(s), hi.max(s))),
            });
        let (x_lo, x_hi) = steps.unwrap_or((0, 1));
        let x_hi = if x_hi == x_lo { x_lo + 1 } else { x_hi };
        let mut y_max = self.capacity_blocks as f64;
        for line in LINES {
            for s in &self.timeline(line.run).samples {
                y_max = y_max.max(self.blocks(s, line.quantity));
            }
        }
        let (unit, blocks_per_unit) = self.unit(y_max.max(1.0));
        let (y_ticks, y_top_units) = nice_ticks(y_max.max(1.0) / blocks_per_unit);
        let y_top = y_top_units * blocks_per_unit;
        let (x_ticks, _) = nice_ticks_range(x_lo as f64, x_hi as f64);

        let px = |step: f64| LEFT + (step - x_lo as f64) / (x_hi - x_lo) as f64 * (RIGHT - LEFT);
        let py = |blocks: f64| BOTTOM - blocks / y_top * (BOTTOM - TOP);

        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            svg,
            r#"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
        );
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="28" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"#,
            (LEFT + RIGHT) / 2.0,
            escape(&self.title)
        );

        // Grid, ticks and axes.
        let _ = writeln!(svg, r##"<g class="grid" stroke="#e0e0e0">"##);
        for &t in &y_ticks {
            let y = py(t * blocks_per_unit);
            let _ = writeln!(
                svg,
                r#"<line x1="{LEFT}" y1="{y:.1}" x2="{RIGHT}" y2="{y:.1}"/>"#
            );
        }
        for &t in &x_ticks {
            let x = px(t);
            let _ = writeln!(
                svg,
                r#"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{BOTTOM}"/>"#
            );
        }
        let _ = writeln!(svg, "</g>");
        let _ = writeln!(svg, r#"<g class="ticks">"#);
        for &t in &y_ticks {
            let y = py(t * blocks_per_unit);
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                LEFT - 6.0,
                y + 4.0,
                fmt_tick(t)
            );
        }
        for &t in &x_ticks {
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                px(t),
                BOTTOM + 18.0,
                fmt_tick(t)
            );
        }
        let _ = writeln!(svg, "</g>");
        let _ = writeln!(
            svg,
            r#"<path class="axes" d="M{LEFT},{TOP} V{BOTTOM} H{RIGHT}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            svg,
            r#"<text class="x-label" x="{:.1}" y="{:.1}" text-anchor="middle">scheduler step</text>"#,
            (LEFT + RIGHT) / 2.0,
            BOTTOM + 42.0
        );
        let _ = writeln!(
            svg,
            r#"<text class="y-label" x="20" y="{:.1}" text-anchor="middle" transform="rotate(-90 20 {:.1})">KV memory ({unit})</text>"#,
            (TOP + BOTTOM) / 2.0,
            (TOP + BOTTOM) / 2.0
        );

        // Capacity reference line.
        let cap_y = py(self.capacity_blocks as f64);
        let _ = writeln!(
            svg,
            r##"<line class="capacity" x1="{LEFT}" y1="{cap_y:.1}" x2="{RIGHT}" y2="{cap_y:.1}" stroke="#555" stroke-dasharray="8 4"/>"##
        );
        let _ = writeln!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">arena capacity</text>"##,
            RIGHT - 4.0,
            cap_y - 4.0
        );

        // One polyline per documented line; at most one point per pixel column, the
        // column's maximum, so peaks survive downsampling.
        for line in LINES {
            let mut points = String::new();
            let mut column: Option<(i64, f64, f64)> = None;
            let flush = |points: &mut String, c: Option<(i64, f64, f64)>| {
                if let Some((_, x, v)) = c {
                    let _ = write!(points, "{x:.1},{:.1} ", py(v));
                }
            };
            for s in &self.timeline(line.run).samples {
                let x = px(s.step as f64);
                let v = self.blocks(s, line.quantity);
                let col = x.floor() as i64;
                column = match column {
                    Some((c, cx, cv)) if c == col => Some((c, cx, cv.max(v))),
                    other => {
                        flush(&mut points, other);
                        Some((col, x, v))
                    }
                };
            }
            flush(&mut points, column);
            let dash = if line.dash.is_empty() {
                String::new()
            } else {
                format!(r#" stroke-dasharray="{}""#, line.dash)
            };
            let _ = writeln!(
                svg,
                r#"<polyline class="series" data-series="{}" fill="none" stroke="{}" stroke-width="1.5"{dash} points="{}"><title>{}</title></polyline>"#,
                line.id,
                line.color,
                points.trim_end(),
                escape(line.label)
            );
        }

        // Event markers in a strip above the plot (paged row, then contiguous row), one
        // per pixel column and kind.
        let _ = writeln!(svg, r#"<g class="events">"#);
        for (run, color, row) in [
            (Run::Paged, PAGED_COLOR, TOP - 22.0),
            (Run::Contiguous, CONTIGUOUS_COLOR, TOP - 10.0),
        ] {
            let mut seen = std::collections::HashSet::new();
            for e in &self.timeline(run).events {
                let x = px(e.step as f64);
                if !seen.insert((x.round() as i64, e.kind)) {
                    continue;
                }
                // Preemptions can come by the hundred: a row of triangles above the
                // plot. Defragmentations are rare: a line through the plot as well.
                let guide = match e.kind {
                    EventKind::Preemption => String::new(),
                    EventKind::Defragmentation => format!(
                        r#"<line x1="{x:.1}" y1="{row:.1}" x2="{x:.1}" y2="{BOTTOM}" stroke="{color}" stroke-dasharray="3 3"/>"#
                    ),
                };
                let _ = writeln!(
                    svg,
                    r#"<g class="marker" data-event="{}" data-run="{}">{guide}<path d="{}" fill="{color}"/><title>{} at step {}</title></g>"#,
                    e.kind.name(),
                    run_name(run),
                    marker_path(e.kind, x, row),
                    e.kind.name(),
                    e.step
                );
            }
        }
        let _ = writeln!(svg, "</g>");

        // Legend.
        let lx = RIGHT + 20.0;
        let _ = writeln!(svg, r#"<g class="legend">"#);
        let mut y = TOP + 10.0;
        for line in LINES {
            let dash = if line.dash.is_empty() {
                String::new()
            } else {
                format!(r#" stroke-dasharray="{}""#, line.dash)
            };
            let _ = writeln!(
                svg,
                r#"<line x1="{lx}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
                lx + 28.0,
                line.color,
                lx + 34.0,
                y + 4.0,
                escape(line.label)
            );
            y += 20.0;
        }
        let _ = writeln!(
            svg,
            r##"<line x1="{lx}" y1="{y}" x2="{}" y2="{y}" stroke="#555" stroke-dasharray="8 4"/><text x="{}" y="{}">arena capacity</text>"##,
            lx + 28.0,
            lx + 34.0,
            y + 4.0
        );
        y += 20.0;
        for kind in EventKind::ALL {
            let _ = writeln!(
                svg,
                r##"<path d="{}" fill="#444"/><text x="{}" y="{}">{} (colour: run)</text>"##,
                marker_path(kind, lx + 14.0, y),
                lx + 34.0,
                y + 4.0,
                kind.name()
            );
            y += 20.0;
        }
        let _ = writeln!(svg, "</g>");
        let _ = writeln!(svg, "</svg>");
        svg
    }

    /// Writes [`Self::to_svg`] to `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be written.
    pub fn write_svg(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_svg())
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))
    }
}

fn run_name(run: Run) -> &'static str {
    match run {
        Run::Paged => "paged",
        Run::Contiguous => "contiguous",
    }
}

/// A triangle (preemption) or diamond (defragmentation) centred at `(x, y)`.
fn marker_path(kind: EventKind, x: f64, y: f64) -> String {
    match kind {
        EventKind::Preemption => format!(
            "M{:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} Z",
            x - 5.0,
            y - 4.0,
            x + 5.0,
            y - 4.0,
            x,
            y + 5.0
        ),
        EventKind::Defragmentation => format!(
            "M{:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} Z",
            x,
            y - 5.0,
            x + 5.0,
            y,
            x,
            y + 5.0,
            x - 5.0,
            y
        ),
    }
}

/// Escapes text for XML content and attribute values.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() && c != '\n' && c != '\t' => {}
            c => out.push(c),
        }
    }
    out
}

/// A 1-2-5 step giving about five intervals over `span`.
fn nice_step(span: f64) -> f64 {
    let raw = (span / 5.0).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let m = raw / mag;
    let nice = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// Ticks from 0 to a round number at or above `max`; returns the ticks and the top.
fn nice_ticks(max: f64) -> (Vec<f64>, f64) {
    let step = nice_step(max);
    let top = (max / step).ceil().max(1.0) * step;
    let n = (top / step).round() as usize;
    ((0..=n).map(|i| i as f64 * step).collect(), top)
}

/// Ticks inside `[lo, hi]` at a round step.
fn nice_ticks_range(lo: f64, hi: f64) -> (Vec<f64>, f64) {
    let step = nice_step(hi - lo);
    let first = (lo / step).ceil() * step;
    let n = ((hi - first) / step).floor().max(0.0) as usize;
    ((0..=n).map(|i| first + i as f64 * step).collect(), step)
}

fn fmt_tick(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}
