//! Disaggregated prefill/decode in one process.
//!
//! A "prefill" instance (tensor-parallel over 2 host shards, 16-token blocks) admits a
//! seeded synthetic trace and writes K/V that are a deterministic function of token id,
//! position, layer, K/V and byte. It exports every sequence into a self-describing
//! buffer and ships it twice: in process (a `Vec<u8>` handed over) and through a
//! loopback TCP connection on 127.0.0.1. Each "decode" instance (one unsharded storage,
//! 32-token blocks) imports, checks the token ids, appends decode tokens, and at the end
//! every sequence's K/V must equal, byte for byte, those of a single-instance run of
//! the same trace.
//!
//! ```text
//! cargo run --release --example disaggregated -- --sequences 64 --seed 7
//! ```
//!
//! The run is bounded (fixed trace, socket timeouts) and exits by itself, with status
//! 1 if any sequence differs.
//!
//! # Two processes over NIXL (feature `nixl`)
//!
//! `--transport nixl` moves the K/V page to page between two processes with NVIDIA NIXL
//! (UCX) instead: this process is the prefill instance and spawns itself as the decode
//! instance (`--role decode`). Loopback TCP carries only the control messages (agent
//! metadata, one offer per sequence, one acknowledgement back); the decode process READs
//! each sequence's blocks straight from the prefill arena into its own
//! ([`pagedkv::export::nixl`]), decodes, and compares every sequence with a
//! single-instance run of the same trace. Pages move as they are, so both instances use
//! `--prefill-block-size` and no tensor parallelism.
//!
//! ```text
//! LD_LIBRARY_PATH=<site-packages>/.nixl_cu13.mesonpy.libs UCX_TLS=tcp \
//!   cargo run --release --features nixl --example disaggregated -- --transport nixl
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::Parser;
use pagedkv::executor::shard::ShardedStorage;
use pagedkv::export::HEADER_FIXED_BYTES;
use pagedkv::export::{export_sequence, exported_len, import_sequence, ExportHeader};
use pagedkv::layout::Kv;
use pagedkv::layout::Slot;
use pagedkv::{
    CacheConfig, CopyPlan, DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId, Storage,
};

#[derive(Parser, Debug)]
#[command(about = "Prefill on one cache, ship the KV, decode on another; check the bytes")]
struct Args {
    /// Sequences in the trace.
    #[arg(long, default_value_t = 48)]
    sequences: usize,
    /// Seed of the trace.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Shortest and longest prompt, in tokens.
    #[arg(long, default_value_t = 32)]
    min_prompt: usize,
    #[arg(long, default_value_t = 512)]
    max_prompt: usize,
    /// Decode tokens appended to every sequence after the import.
    #[arg(long, default_value_t = 24)]
    decode_tokens: usize,
    /// Tensor-parallel degree of the prefill instance.
    #[arg(long, default_value_t = 2)]
    prefill_tp: usize,
    /// Block sizes of the prefill and decode instances.
    #[arg(long, default_value_t = 16)]
    prefill_block_size: usize,
    #[arg(long, default_value_t = 32)]
    decode_block_size: usize,
    /// `local`: in process and over loopback TCP, one process. `nixl`: two processes,
    /// blocks moved by NIXL (needs the `nixl` feature and `libnixl_capi.so`).
    #[arg(long, default_value = "local")]
    transport: String,
    /// Set by the example itself when it spawns its decode process.
    #[arg(long, default_value = "prefill", hide = true)]
    role: String,
    /// The prefill process's control address (decode role only).
    #[arg(long, hide = true)]
    connect: Option<String>,
}

fn shape() -> ModelShape {
    // Llama-style GQA, scaled down in layers so the example runs in seconds.
    ModelShape {
        num_layers: 4,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 64,
        kv_dtype: DType::BF16,
    }
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[derive(Clone)]
struct Request {
    prompt: Vec<u32>,
    decode: Vec<u32>,
}

fn trace(args: &Args) -> Vec<Request> {
    let mut rng = Rng(args.seed);
    let span = (args.max_prompt - args.min_prompt + 1) as u64;
    (0..args.sequences)
        .map(|_| {
            let len = args.min_prompt + (rng.next() % span) as usize;
            let mut tok = || (rng.next() % 32_000) as u32;
            Request {
                prompt: (0..len).map(|_| tok()).collect(),
                decode: (0..args.decode_tokens).map(|_| tok()).collect(),
            }
        })
        .collect()
}

/// K and V rows (`[tokens, kv_heads, head_dim]`) of one layer for tokens
/// `(id, position)`: what a model would compute, reduced to a hash of its inputs.
fn kv_rows(tokens: impl Iterator<Item = (u32, usize)>, layer: usize, row: usize) -> [Vec<u8>; 2] {
    let mut out = [Vec::new(), Vec::new()];
    for (id, pos) in tokens {
        for (kv, buf) in [Kv::K, Kv::V].into_iter().zip(&mut out) {
            let mut r =
                Rng(u64::from(id) << 32 ^ (pos as u64) << 8 ^ (layer as u64) << 2 ^ kv as u64);
            buf.extend(
                (0..row.div_ceil(8))
                    .flat_map(|_| r.next().to_le_bytes())
                    .take(row),
            );
        }
    }
    out
}

/// One serving instance: a manager and the storage it drives.
struct Instance<S: Storage> {
    mgr: KvCache,
    kv: S,
}

impl<S: Storage> Instance<S> {
    fn new(layout: KvLayout, num_blocks: usize, kv: S) -> Self {
        let mut config = CacheConfig::new(num_blocks);
        config.watermark_blocks = 0;
        let mgr = KvCache::new(layout, config).expect("valid config");
        Instance { mgr, kv }
    }

    fn row(&self) -> usize {
        let s = self.kv.layout().shape();
        s.num_kv_heads * s.head_dim * s.kv_dtype.size_bytes()
    }

    fn write(&mut self, slots: &[Slot], ids: &[u32], first_pos: usize) -> pagedkv::Result<()> {
        for layer in 0..shape().num_layers {
            let tokens = ids.iter().copied().zip(first_pos..);
            let [k, v] = kv_rows(tokens, layer, self.row());
            self.kv.write_slots(layer, slots, &k, &v)?;
        }
        Ok(())
    }

    fn prefill(&mut self, seq: SeqId, prompt: &[u32]) -> pagedkv::Result<()> {
        let mut slots = Vec::new();
        self.mgr.admit(seq, prompt.len(), &mut slots)?;
        self.write(&slots, prompt, 0)
    }

    /// Decode: one token at a time, as an engine would.
    fn decode(&mut self, seq: SeqId, tokens: &[u32]) -> pagedkv::Result<()> {
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        for &t in tokens {
            let pos = self.mgr.num_tokens(seq)?;
            copies.clear();
            self.mgr.append(seq, 1, &mut slots, &mut copies)?;
            self.kv.copy_blocks(&copies)?;
            self.write(&slots, &[t], pos)?;
        }
        Ok(())
    }

    /// Every layer's K and V of `seq`, concatenated.
    fn read(&self, seq: SeqId) -> pagedkv::Result<Vec<u8>> {
        let n = self.mgr.num_tokens(seq)?;
        let table = self.mgr.block_table(seq)?;
        let mut out = Vec::new();
        for layer in 0..shape().num_layers {
            let (mut k, mut v) = (vec![0; n * self.row()], vec![0; n * self.row()]);
            self.kv.read_tokens(layer, table, n, &mut k, &mut v)?;
            out.extend(k);
            out.extend(v);
        }
        Ok(out)
    }

    /// Imports one export as `seq`, checks its token ids, then decodes.
    fn receive(&mut self, seq: SeqId, buf: &[u8], req: &Request) -> Result<Duration, String> {
        let t = Instant::now();
        let got = import_sequence(&mut self.mgr, &mut self.kv, seq, buf)
            .map_err(|e| format!("{seq}: import: {e}"))?;
        let took = t.elapsed();
        if got.token_ids.as_deref() != Some(&req.prompt[..]) {
            return Err(format!(
                "{seq}: the imported token ids are not the prompt's"
            ));
        }
        self.decode(seq, &req.decode)
            .map_err(|e| format!("{seq}: decode: {e}"))?;
        Ok(took)
    }
}

fn blocks_for(reqs: &[Request], block_size: usize) -> usize {
    reqs.iter()
        .map(|r| (r.prompt.len() + r.decode.len()).div_ceil(block_size))
        .sum()
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
}

/// Reads one export from a stream: the fixed header gives the length of the rest.
fn read_frame(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let mut buf = vec![0; HEADER_FIXED_BYTES];
    match stream.read_exact(&mut buf) {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        r => r?,
    }
    let header = ExportHeader::parse(&buf).map_err(std::io::Error::other)?;
    buf.resize(header.total_len(), 0);
    stream.read_exact(&mut buf[HEADER_FIXED_BYTES..])?;
    Ok(Some(buf))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.min_prompt == 0 || args.max_prompt < args.min_prompt {
        return Err("need 0 < min-prompt <= max-prompt".into());
    }
    match args.transport.as_str() {
        "local" => {}
        #[cfg(feature = "nixl")]
        "nixl" => return nixl_mode::run(&args),
        #[cfg(not(feature = "nixl"))]
        "nixl" => return Err("--transport nixl needs the `nixl` feature (--features nixl)".into()),
        other => return Err(format!("unknown transport {other:?} (local, nixl)").into()),
    }
    let reqs = trace(&args);
    let prompt_tokens: usize = reqs.iter().map(|r| r.prompt.len()).sum();

    // The single-instance run every result is compared with.
    let single_layout = KvLayout::new(shape(), args.prefill_block_size)?;
    let nb = blocks_for(&reqs, args.prefill_block_size);
    let mut single = Instance::new(single_layout, nb, HostStorage::new(single_layout, nb)?);
    for (i, r) in reqs.iter().enumerate() {
        single.prefill(SeqId(i as u64), &r.prompt)?;
        single.decode(SeqId(i as u64), &r.decode)?;
    }

    // Prefill instance, tensor-parallel.
    let prefill_layout = single_layout;
    let nb = blocks_for(&reqs, args.prefill_block_size);
    let tp = ShardedStorage::host(prefill_layout, args.prefill_tp, nb, 0)?;
    let mut prefill = Instance::new(prefill_layout, nb, tp);
    let mut exports = Vec::with_capacity(reqs.len());
    let mut export_time = Duration::ZERO;
    // One reused staging buffer, as an engine would keep one (pinned, on a GPU): timing
    // a fresh allocation would time the kernel's page faults, not the export.
    let mut staging = vec![1u8; exported_len(&prefill_layout, args.max_prompt, true)?];
    for (i, r) in reqs.iter().enumerate() {
        let seq = SeqId(i as u64);
        prefill.prefill(seq, &r.prompt)?;
        let t = Instant::now();
        let len = export_sequence(
            &prefill.mgr,
            &prefill.kv,
            seq,
            Some(&r.prompt),
            &mut staging,
        )?;
        export_time += t.elapsed();
        // The prefill instance is done with the sequence once it is shipped.
        prefill.mgr.free(seq)?;
        exports.push(staging[..len].to_vec());
    }
    let shipped: usize = exports.iter().map(Vec::len).sum();
    // Baseline for the ratios: one memcpy of the same bytes into touched memory.
    let mut sink = vec![1u8; staging.len()];
    let t = Instant::now();
    for buf in &exports {
        sink[..buf.len()].copy_from_slice(buf);
        std::hint::black_box(&mut sink);
    }
    let memcpy_time = t.elapsed();
    let kv_bytes = prompt_tokens * prefill_layout.token_bytes();

    // Decode instance 1: in process.
    let decode_layout = KvLayout::new(shape(), args.decode_block_size)?;
    let nb = blocks_for(&reqs, args.decode_block_size);
    let mut local = Instance::new(decode_layout, nb, HostStorage::new(decode_layout, nb)?);
    let mut import_time = Duration::ZERO;
    for (i, (buf, r)) in exports.iter().zip(&reqs).enumerate() {
        import_time += local.receive(SeqId(i as u64), buf, r)?;
    }

    // Decode instance 2: behind a loopback socket, on its own thread.
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let decode_reqs = reqs.clone();
    let tcp_start = Instant::now();
    let remote = std::thread::spawn(move || -> Result<_, String> {
        let (mut stream, _) = listener.accept().map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        let storage = HostStorage::new(decode_layout, nb).map_err(|e| e.to_string())?;
        let mut inst = Instance::new(decode_layout, nb, storage);
        let mut i = 0;
        while let Some(frame) = read_frame(&mut stream).map_err(|e| e.to_string())? {
            let req = decode_reqs.get(i).ok_or("more frames than requests")?;
            inst.receive(SeqId(i as u64), &frame, req)?;
            i += 1;
        }
        Ok((inst, i))
    });
    let mut stream = TcpStream::connect(addr)?;
    stream.set_write_timeout(Some(Duration::from_secs(30)))?;
    for buf in &exports {
        stream.write_all(buf)?;
    }
    drop(stream); // EOF: the receiver's loop ends.
    let (remote, received) = remote.join().map_err(|_| "decode thread panicked")??;
    let tcp_time = tcp_start.elapsed();

    // Every sequence, on both decode instances, equals the single-instance run.
    let mut mismatches = 0;
    for i in 0..reqs.len() {
        let seq = SeqId(i as u64);
        let want = single.read(seq)?;
        for (name, got) in [("in-process", local.read(seq)?), ("tcp", remote.read(seq)?)] {
            if got != want {
                eprintln!("{seq}: {name} decode instance differs from the single-instance run");
                mismatches += 1;
            }
        }
    }
    local.mgr.check_invariants()?;
    remote.mgr.check_invariants()?;

    println!(
        "{} sequences, {} prompt tokens (+{} decode tokens each); prefill TP={} bs={}, decode TP=1 bs={}",
        reqs.len(),
        prompt_tokens,
        args.decode_tokens,
        args.prefill_tp,
        args.prefill_block_size,
        args.decode_block_size
    );
    println!(
        "shipped {:.1} MiB ({:.1} MiB of K/V, {:.2} % header) twice: in process and over 127.0.0.1 ({received} frames)",
        shipped as f64 / (1 << 20) as f64,
        kv_bytes as f64 / (1 << 20) as f64,
        100.0 * (shipped - kv_bytes) as f64 / shipped as f64
    );
    let memcpy = gbps(shipped, memcpy_time);
    println!(
        "export {:.2} GB/s ({:.2}x memcpy; gather from {} shards + hashing), import {:.2} GB/s ({:.2}x memcpy; validate + re-page + write), memcpy {memcpy:.2} GB/s",
        gbps(shipped, export_time),
        gbps(shipped, export_time) / memcpy,
        args.prefill_tp,
        gbps(shipped, import_time),
        gbps(shipped, import_time) / memcpy,
    );
    println!(
        "tcp: {:.2} GB/s end to end (send, receive, import and {} decode steps per sequence)",
        gbps(shipped, tcp_time),
        args.decode_tokens
    );
    if mismatches > 0 {
        eprintln!("{mismatches} mismatches");
        std::process::exit(1);
    }
    println!(
        "all {} sequences match the single-instance run byte for byte, on both decode instances",
        reqs.len()
    );
    Ok(())
}

/// `--transport nixl`: the prefill process and the decode process it spawns.
#[cfg(feature = "nixl")]
mod nixl_mode {
    use super::*;
    use pagedkv::executor::nixl::NixlAgent;
    use pagedkv::export::nixl::{offer_sequence, pull_sequence};
    use std::process::{Command, Stdio};

    /// Deadline of every socket read or write, and of the connection.
    const IO_TIMEOUT: Duration = Duration::from_secs(30);
    /// Deadline of one NIXL READ.
    const XFER_TIMEOUT: Duration = Duration::from_secs(30);
    /// Deadline of the whole decode process.
    const CHILD_TIMEOUT: Duration = Duration::from_secs(300);

    type Res<T> = Result<T, Box<dyn std::error::Error>>;

    fn send(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
        stream.write_all(&(bytes.len() as u32).to_le_bytes())?;
        stream.write_all(bytes)
    }

    fn recv(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len)?;
        let mut buf = vec![0; u32::from_le_bytes(len) as usize];
        stream.read_exact(&mut buf)?;
        Ok(buf)
    }

    fn timeouts(stream: &TcpStream) -> std::io::Result<()> {
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))
    }

    pub fn run(args: &Args) -> Res<()> {
        match args.role.as_str() {
            "prefill" => prefill(args),
            "decode" => decode(args),
            other => Err(format!("unknown role {other:?} (prefill, decode)").into()),
        }
    }

    /// The prefill process: spawns the decode process, offers every sequence, frees it
    /// once the decode process says it has it. Exits 1 when the decode process fails.
    fn prefill(args: &Args) -> Res<()> {
        let reqs = trace(args);
        let layout = KvLayout::new(shape(), args.prefill_block_size)?;
        let nb = blocks_for(&reqs, args.prefill_block_size);
        let mut inst = Instance::new(layout, nb, HostStorage::new(layout, nb)?);
        let mut agent = NixlAgent::new("pagedkv-prefill")?;
        // SAFETY: `inst.kv` is never resized and outlives `agent` (declared after it,
        // so dropped first).
        unsafe { agent.register_host_arena(&inst.kv)? };

        let listener = TcpListener::bind("127.0.0.1:0")?;
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .args(["--transport", "nixl", "--role", "decode", "--connect"])
            .arg(listener.local_addr()?.to_string())
            .args(["--sequences", &args.sequences.to_string()])
            .args(["--seed", &args.seed.to_string()])
            .args(["--min-prompt", &args.min_prompt.to_string()])
            .args(["--max-prompt", &args.max_prompt.to_string()])
            .args(["--decode-tokens", &args.decode_tokens.to_string()])
            .args(["--prefill-block-size", &args.prefill_block_size.to_string()])
            .stdin(Stdio::null())
            .spawn()?;
        let outcome = serve(&listener, &mut agent, &mut inst, &reqs);
        // The decode process ends on its own (every socket operation has a deadline);
        // past CHILD_TIMEOUT it is killed.
        let deadline = Instant::now() + CHILD_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if Instant::now() >= deadline {
                child.kill()?;
                child.wait()?;
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        drop(agent);
        let served = outcome?;
        match status {
            Some(s) if s.success() => {
                println!("prefill: {served} sequences offered over NIXL and freed after the decode process took them");
                Ok(())
            }
            Some(s) => {
                eprintln!("prefill: the decode process failed ({s})");
                std::process::exit(1);
            }
            None => {
                eprintln!(
                    "prefill: the decode process did not finish in {CHILD_TIMEOUT:?}; killed"
                );
                std::process::exit(1);
            }
        }
    }

    /// Accepts the decode process, sends the metadata, then one offer per sequence.
    fn serve(
        listener: &TcpListener,
        agent: &mut NixlAgent,
        inst: &mut Instance<HostStorage>,
        reqs: &[Request],
    ) -> Res<usize> {
        listener.set_nonblocking(true)?;
        let deadline = Instant::now() + IO_TIMEOUT;
        let mut stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err("the decode process did not connect".into());
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e.into()),
            }
        };
        stream.set_nonblocking(false)?;
        timeouts(&stream)?;
        send(&mut stream, &agent.local_metadata()?)?;
        let mut scratch = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            let seq = SeqId(i as u64);
            inst.prefill(seq, &r.prompt)?;
            let offer = offer_sequence(&inst.mgr, &inst.kv, seq, Some(&r.prompt), &mut scratch)?;
            send(&mut stream, &offer)?;
            // The blocks stay untouched until the decode process has read them.
            let ack = recv(&mut stream)?;
            if ack != [0] {
                return Err(format!(
                    "{seq}: the decode process refused it: {}",
                    String::from_utf8_lossy(&ack[1.min(ack.len())..])
                )
                .into());
            }
            inst.mgr.free(seq)?;
        }
        send(&mut stream, &[])?; // end of the trace
        inst.mgr.check_invariants()?;
        Ok(reqs.len())
    }

    /// The decode process: pulls every offered sequence, decodes it, compares all with a
    /// single-instance run; exits 1 on any mismatch.
    fn decode(args: &Args) -> Res<()> {
        let addr = args
            .connect
            .as_deref()
            .ok_or("--role decode needs --connect")?;
        let reqs = trace(args);
        let layout = KvLayout::new(shape(), args.prefill_block_size)?;
        let nb = blocks_for(&reqs, args.prefill_block_size);
        let mut single = Instance::new(layout, nb, HostStorage::new(layout, nb)?);
        for (i, r) in reqs.iter().enumerate() {
            single.prefill(SeqId(i as u64), &r.prompt)?;
            single.decode(SeqId(i as u64), &r.decode)?;
        }

        let mut inst = Instance::new(layout, nb, HostStorage::new(layout, nb)?);
        let mut agent = NixlAgent::new("pagedkv-decode")?;
        // SAFETY: `inst.kv` is never resized and outlives `agent` (declared after it).
        unsafe { agent.register_host_arena(&inst.kv)? };
        let mut stream = TcpStream::connect_timeout(&addr.parse()?, IO_TIMEOUT)?;
        timeouts(&stream)?;
        let peer = agent.add_peer(&recv(&mut stream)?)?;

        let (mut moved, mut descriptors, mut xfer_time) = (0usize, 0usize, Duration::ZERO);
        let start = Instant::now();
        let mut received = 0;
        loop {
            let offer = recv(&mut stream)?;
            if offer.is_empty() {
                break;
            }
            let seq = SeqId(received as u64);
            let req = reqs.get(received).ok_or("more offers than requests")?;
            let result = pull_sequence(
                &agent,
                &peer,
                &mut inst.mgr,
                &mut inst.kv,
                seq,
                &offer,
                XFER_TIMEOUT,
            )
            .map_err(|e| format!("{seq}: pull: {e}"))
            .and_then(|p| {
                if p.imported.token_ids.as_deref() != Some(&req.prompt[..]) {
                    return Err(format!("{seq}: the token ids are not the prompt's"));
                }
                Ok(p)
            });
            match result {
                Ok(p) => {
                    send(&mut stream, &[0])?;
                    moved += p.transfer.bytes;
                    descriptors += p.transfer.descriptors;
                    xfer_time += p.transfer.elapsed;
                }
                Err(e) => {
                    let mut nack = vec![1u8];
                    nack.extend_from_slice(e.as_bytes());
                    let _ = send(&mut stream, &nack);
                    eprintln!("decode: {e}");
                    std::process::exit(1);
                }
            }
            inst.decode(seq, &req.decode)?;
            received += 1;
        }
        let total = start.elapsed();

        let mut mismatches = 0;
        for i in 0..reqs.len() {
            let seq = SeqId(i as u64);
            if i >= received || inst.read(seq)? != single.read(seq)? {
                eprintln!("{seq}: the decode process differs from the single-instance run");
                mismatches += 1;
            }
        }
        inst.mgr.check_invariants()?;
        let prompt_tokens: usize = reqs.iter().map(|r| r.prompt.len()).sum();
        println!(
            "{} sequences, {} prompt tokens (+{} decode tokens each); prefill and decode in two processes, bs={}",
            reqs.len(),
            prompt_tokens,
            args.decode_tokens,
            args.prefill_block_size
        );
        println!(
            "nixl: {:.1} MiB READ in {descriptors} descriptors ({} sequences), {:.2} GB/s in transfers ({:.1} ms), {:.2} GB/s end to end ({:.1} ms: offers, READs, checksums, decode steps)",
            moved as f64 / (1 << 20) as f64,
            received,
            gbps(moved, xfer_time),
            xfer_time.as_secs_f64() * 1e3,
            gbps(moved, total),
            total.as_secs_f64() * 1e3,
        );
        drop(agent);
        if mismatches > 0 {
            eprintln!("{mismatches} mismatches");
            std::process::exit(1);
        }
        println!(
            "all {} sequences match the single-instance run byte for byte",
            reqs.len()
        );
        Ok(())
    }
}
