//! Runs a small synthetic decode workload on a `KvCache` and serves its metrics
//! in the Prometheus text format on a loopback port, for a bounded time or number of
//! scrapes, then exits.
//!
//! ```text
//! cargo run --example metrics_server -- --port 9464 --seconds 30
//! curl -s http://127.0.0.1:9464/metrics
//! cargo run --example metrics_server -- --requests 1 --self-scrape   # prints one scrape
//! ```
//!
//! The endpoint is a `std::net::TcpListener` (`pagedkv::metrics::serve_prometheus`) and
//! the text-format recorder of `metrics-exporter-prometheus` without its HTTP features
//! (`pagedkv::metrics::PrometheusRecorder`), not an async HTTP exporter: one loopback
//! scrape endpoint does not need tokio and hyper.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use pagedkv::manager::SharedKvCache;
use pagedkv::metrics::{
    serve_prometheus, MetricsExporter, MetricsSnapshot, PrometheusRecorder, ServeLimits,
};
use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};

#[derive(Parser, Debug)]
#[command(about = "Serve pagedkv metrics for a synthetic workload")]
struct Args {
    /// Loopback port (0 picks a free one and prints it).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Stop serving after this many seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Stop serving after this many answered requests.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Scrape the endpoint once from inside the process and print the answer.
    #[arg(long)]
    self_scrape: bool,
}

/// A small deterministic generator, so the example needs no `rand`.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Admits requests with random prompt and output lengths and decodes them one token
/// per step, freeing each when it reaches its length, until `stop`.
fn workload(kv: &SharedKvCache, stop: &AtomicBool) -> pagedkv::Result<()> {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let mut live: Vec<(SeqId, usize)> = Vec::new();
    let mut slots = Vec::new();
    let mut copies = CopyPlan::default();
    let mut next = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let prompt = 16 + rng.below(496) as usize;
        if live.len() < 64 && kv.lock().can_admit(prompt) {
            next += 1;
            kv.admit(SeqId(next), prompt, &mut slots)?;
            live.push((SeqId(next), prompt + 1 + rng.below(512) as usize));
        }
        let mut i = 0;
        while i < live.len() {
            let (seq, target) = live[i];
            let done = kv.lock().num_tokens(seq)? >= target;
            if done || !kv.lock().can_append(seq, 1) {
                kv.free(seq)?;
                live.swap_remove(i);
                continue;
            }
            kv.append(seq, 1, &mut slots, &mut copies)?;
            copies.clear();
            i += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn scrape(addr: std::net::SocketAddr) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut out = String::new();
    stream.read_to_string(&mut out)?;
    Ok(out)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let shape = ModelShape {
        num_layers: 32,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        kv_dtype: DType::BF16,
    };
    let layout = KvLayout::new(shape, 16)?;
    let kv = Arc::new(SharedKvCache::new(KvCache::new(
        layout,
        CacheConfig::new(2048),
    )?));

    let recorder = PrometheusRecorder::new();
    metrics::set_global_recorder(recorder.clone())
        .map_err(|_| "another metrics recorder is already installed")?;
    let exporter = MetricsExporter::new();
    exporter.describe();

    let listener = TcpListener::bind(("127.0.0.1", args.port))?;
    let addr = listener.local_addr()?;
    println!(
        "serving http://{addr}/metrics for {} s or {} requests",
        args.seconds, args.requests
    );

    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (kv, stop) = (Arc::clone(&kv), Arc::clone(&stop));
        std::thread::spawn(move || workload(&kv, &stop))
    };
    let scraper = args.self_scrape.then(|| {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            scrape(addr)
        })
    });

    let limits = ServeLimits {
        max_requests: args.requests,
        max_duration: Duration::from_secs(args.seconds),
    };
    let served = serve_prometheus(&listener, &recorder, limits, || {
        exporter.publish(&MetricsSnapshot::from_manager(&mut kv.lock()));
    })?;
    stop.store(true, Ordering::Relaxed);
    worker.join().map_err(|_| "workload thread panicked")??;
    if let Some(scraper) = scraper {
        let text = scraper.join().map_err(|_| "scraper thread panicked")??;
        println!("{text}");
    }
    println!("answered {served} requests; final stats: {:?}", kv.stats());
    Ok(())
}
