//! vLLM's ZMQ transport for the event batches (feature `kv-events`): a PUB socket that
//! sends every batch to the routers subscribed, and a ROUTER socket that replays the
//! batches a router missed, spoken as ZMTP 3.1 on one thread of its own.
//!
//! The wire is what vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`) sends:
//!
//! - **PUB**: per batch one message of three frames: the topic (empty unless
//!   [`ZmqPublisherConfig::topic`] says otherwise), the sequence number as 8 bytes
//!   big-endian (0 for the first batch, +1 per batch), and the msgpack `KVEventBatch`
//!   ([`VllmEventEncoder`]).
//! - **Replay ROUTER**: a request of two frames, an empty delimiter and the first
//!   sequence number wanted as a big-endian integer (a REQ socket adds the delimiter; a
//!   DEALER sends it; as the ROUTER application sees it, `[identity, "", start_seq]`),
//!   is answered with every buffered batch from that number on, each as `["", seq,
//!   payload]`, then the end marker `["", -1 as 8 bytes, ""]`. Other requests are
//!   ignored, as vLLM ignores them. The buffer keeps the last
//!   [`ZmqPublisherConfig::replay_buffer_batches`] batches (vLLM's `buffer_steps`).
//!
//! Why ZMTP by hand over `std::net` rather than a crate: the `zeromq` crate needs an
//! async runtime in the engine, and the `zmq` crate links libzmq (a C++ build or a
//! system library). The part of ZMTP 3.1 a publisher needs is small: the 64-byte
//! greeting with the NULL mechanism, the `READY` command with the socket type, frames,
//! `SUBSCRIBE`/`CANCEL` (and ZMTP 3.0's subscription messages), `PING`/`PONG`. TCP
//! only; no CURVE or PLAIN security (bind to loopback or a private network).
//!
//! **The cache never waits for the network.** [`ZmqEventPublisher::publish_payload`]
//! hands the batch to the thread through a bounded queue and returns; when the queue
//! is full the batch is dropped and counted
//! ([`ZmqPublisherStats::batches_dropped_queue_full`]), its sequence number still
//! taken, so subscribers see the gap. Each subscriber has a bounded send queue
//! ([`ZmqPublisherConfig::peer_queue_bytes`]): a batch that does not fit is dropped for
//! that subscriber alone and counted ([`ZmqPublisherStats::batches_dropped_slow_peer`]),
//! as libzmq's PUB drops at its high-water mark; the subscriber sees the gap and can
//! ask the replay socket. A replay connection is read no further until its answer is
//! sent, so a client that asks and never reads holds at most one answer (references to
//! buffered payloads, not copies).
//!
//! The thread wakes at once for each batch, and every
//! [`ZmqPublisherConfig::poll_interval_ms`] otherwise to accept connections, read
//! subscriptions and replay requests, and send what the sockets would not take before.
//!
//! **Bind or connect** ([`PubMode`]). As in vLLM, the PUB socket either binds and
//! routers connect to it, or connects to a router whose SUB socket binds ("bind the
//! stable end"). [`ZmqEventPublisher::start`] chooses as vLLM does: it binds when the
//! endpoint names a wildcard host (`tcp://*:5557`, or an address with `::` in it) and
//! connects otherwise; [`ZmqEventPublisher::bind`] and [`ZmqEventPublisher::connect`]
//! say which. A connecting publisher dials from its own thread with a timeout of
//! [`ZmqPublisherConfig::connect_timeout_ms`], waits
//! [`ZmqPublisherConfig::reconnect_min_ms`] after a failure, doubling up to
//! [`ZmqPublisherConfig::reconnect_max_ms`], and dials again whenever the connection
//! is lost, so a router that starts late or restarts is reached; the cache never waits
//! for any of it. As with a bound socket, a batch goes only to a subscriber whose
//! subscription has arrived: batches published before that are missed (ask the replay
//! socket), which is what libzmq's PUB does too. The replay socket always binds.
//!
//! **Data-parallel ranks.** With [`ZmqPublisherConfig::data_parallel_rank`] `r`, both
//! endpoints' ports are offset by `r` ([`offset_endpoint_port`], vLLM's rule, so rank 2
//! of `tcp://*:5557` publishes on 5559) and the batches carry `r` as their
//! `data_parallel_rank`. Unlike vLLM, port 0 (a free port) is not offset.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};

use super::VllmEventEncoder;
use crate::error::{Error, Result};
use crate::manager::KvCache;
use crate::pool::prefix::PrefixEvent;

/// How the PUB socket reaches its subscribers (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PubMode {
    /// The PUB socket listens on the endpoint; subscribers connect to it.
    Bind,
    /// The PUB socket connects to a subscriber listening on the endpoint, and
    /// reconnects when the connection is lost.
    Connect,
}

impl PubMode {
    /// vLLM's rule: [`PubMode::Bind`] when `endpoint` names a wildcard host (it
    /// contains `*` or `::`), else [`PubMode::Connect`].
    pub fn for_endpoint(endpoint: &str) -> PubMode {
        if endpoint.contains('*') || endpoint.contains("::") {
            PubMode::Bind
        } else {
            PubMode::Connect
        }
    }
}

/// Where and how [`ZmqEventPublisher`] publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqPublisherConfig {
    /// `tcp://HOST:PORT` of the PUB socket: where it binds (`*` for every interface,
    /// port 0 for a free port, [`ZmqEventPublisher::local_addr`] tells which) or, in
    /// [`PubMode::Connect`], the subscriber it connects to.
    pub endpoint: String,
    /// `tcp://HOST:PORT` the replay ROUTER socket binds; none by default.
    pub replay_endpoint: Option<String>,
    /// The data-parallel rank of this publisher: added to both endpoints' ports and
    /// written into every batch (vLLM's `data_parallel_rank`; 0 by default).
    pub data_parallel_rank: u32,
    /// The first frame of every message (vLLM's `topic`, empty by default).
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`, 10,000 by default).
    pub replay_buffer_batches: usize,
    /// Batches waiting for the publisher thread before new ones are dropped.
    pub queue_batches: usize,
    /// Bytes waiting to be sent to one subscriber before its new batches are dropped.
    pub peer_queue_bytes: usize,
    /// Connections each socket accepts at once; more are closed at once.
    pub max_peers: usize,
    /// How often the thread services the sockets when no batch arrives, in ms.
    pub poll_interval_ms: u64,
    /// How long dropping the publisher waits for queued batches to be sent, in ms.
    pub linger_ms: u64,
    /// [`PubMode::Connect`]: how long one connection attempt may take, in ms (the
    /// publisher thread, never the cache, waits for it).
    pub connect_timeout_ms: u64,
    /// [`PubMode::Connect`]: the wait after a failed attempt or a lost connection, in
    /// ms; doubled after each failure in a row.
    pub reconnect_min_ms: u64,
    /// [`PubMode::Connect`]: the most the wait between attempts grows to, in ms.
    pub reconnect_max_ms: u64,
}

impl ZmqPublisherConfig {
    /// vLLM's defaults (empty topic, 10,000 batches for replay) on `endpoint`, no
    /// replay socket; a queue of 10,000 batches, 64 MiB per subscriber, 64 connections
    /// per socket, a 5 ms poll and 1 s linger (vLLM's shutdown timeout); data-parallel
    /// rank 0; when connecting, 200 ms per attempt and 100 ms to 5 s between attempts
    /// (libzmq's reconnect interval to start with).
    pub fn new(endpoint: impl Into<String>) -> Self {
        ZmqPublisherConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            data_parallel_rank: 0,
            topic: String::new(),
            replay_buffer_batches: 10_000,
            queue_batches: 10_000,
            peer_queue_bytes: 64 << 20,
            max_peers: 64,
            poll_interval_ms: 5,
            linger_ms: 1_000,
            connect_timeout_ms: 200,
            reconnect_min_ms: 100,
            reconnect_max_ms: 5_000,
        }
    }

    /// Sets the `data_parallel_rank` field: both ports offset by `rank`, and `rank` in
    /// every batch.
    pub fn data_parallel_rank(mut self, rank: u32) -> Self {
        self.data_parallel_rank = rank;
        self
    }

    /// The PUB socket's mode by vLLM's rule ([`PubMode::for_endpoint`]).
    pub fn pub_mode(&self) -> PubMode {
        PubMode::for_endpoint(&self.endpoint)
    }

    /// The replay ROUTER socket's endpoint.
    pub fn replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// The topic frame.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    fn validate(&self) -> Result<()> {
        let positive = [
            ("replay_buffer_batches", self.replay_buffer_batches as u64),
            ("queue_batches", self.queue_batches as u64),
            ("peer_queue_bytes", self.peer_queue_bytes as u64),
            ("max_peers", self.max_peers as u64),
            ("poll_interval_ms", self.poll_interval_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("reconnect_min_ms", self.reconnect_min_ms),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(Error::InvalidConfig {
                    field,
                    reason: "must be at least 1".into(),
                });
            }
        }
        if self.reconnect_max_ms < self.reconnect_min_ms {
            return Err(Error::InvalidConfig {
                field: "reconnect_max_ms",
                reason: format!(
                    "{} is less than reconnect_min_ms ({})",
                    self.reconnect_max_ms, self.reconnect_min_ms
                ),
            });
        }
        Ok(())
    }
}

/// `endpoint` with its port offset by `data_parallel_rank`, as vLLM's publisher offsets
/// both of its endpoints: `tcp://*:5557` for rank 2 is `tcp://*:5559`. Rank 0, and port
/// 0 (a free port, so every rank gets its own anyway), leave the endpoint as it is.
///
/// ```
/// use pagedkv::events::zmq::offset_endpoint_port;
/// assert_eq!(offset_endpoint_port("tcp://*:5557", 2)?, "tcp://*:5559");
/// assert_eq!(offset_endpoint_port("tcp://[::1]:5557", 0)?, "tcp://[::1]:5557");
/// # Ok::<(), pagedkv::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidConfig`] (field `endpoint`) when `endpoint` is not
/// `tcp://HOST:PORT` or the offset port is past 65535.
pub fn offset_endpoint_port(endpoint: &str, data_parallel_rank: u32) -> Result<String> {
    offset_port("endpoint", endpoint, data_parallel_rank)
}

fn offset_port(field: &'static str, endpoint: &str, rank: u32) -> Result<String> {
    let (host, port) = parse_tcp(field, endpoint)?;
    if rank == 0 || port == 0 {
        return Ok(endpoint.to_string());
    }
    let port = u16::try_from(u32::from(port) + rank).map_err(|_| Error::InvalidConfig {
        field,
        reason: format!("{endpoint:?}: the port plus data-parallel rank {rank} is past 65535"),
    })?;
    Ok(format!("tcp://{host}:{port}"))
}

/// Counters of a [`ZmqEventPublisher`] ([`ZmqEventPublisher::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZmqPublisherStats {
    /// Sequence numbers handed out: batches published, dropped ones included.
    pub batches_published: u64,
    /// Batches dropped because the publisher thread's queue was full.
    pub batches_dropped_queue_full: u64,
    /// Batches not sent to one subscriber because its send queue was full (counted
    /// once per subscriber that missed it).
    pub batches_dropped_slow_peer: u64,
    /// Connected subscribers with at least one subscription, now.
    pub subscribers: u64,
    /// Replay requests answered.
    pub replay_requests: u64,
    /// Connections closed for a bad handshake or frame, a wrong socket type, or over
    /// [`ZmqPublisherConfig::max_peers`].
    pub peers_refused: u64,
    /// [`PubMode::Connect`]: connection attempts that failed (refused, unreachable or
    /// timed out).
    pub connect_failures: u64,
}

#[derive(Debug, Default)]
struct Counters {
    dropped_queue_full: AtomicU64,
    dropped_slow_peer: AtomicU64,
    subscribers: AtomicU64,
    replay_requests: AtomicU64,
    peers_refused: AtomicU64,
    connect_failures: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Publishes `KVEventBatch`es on vLLM's ZMQ wire (see the module docs).
///
/// ```
/// use pagedkv::events::{ZmqEventPublisher, ZmqPublisherConfig};
/// use pagedkv::pool::prefix::PrefixEvent;
/// let config = ZmqPublisherConfig::new("tcp://127.0.0.1:0").replay("tcp://127.0.0.1:0");
/// let mut publisher = ZmqEventPublisher::bind(config)?;
/// // A router connects a SUB socket to this address.
/// let _addr = publisher.local_addr();
/// assert_eq!(publisher.publish(1.5, &[PrefixEvent::AllCleared])?, Some(0));
/// assert_eq!(publisher.publish(1.6, &[])?, None); // nothing to say: no batch
/// assert_eq!(publisher.stats().batches_published, 1);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug)]
pub struct ZmqEventPublisher {
    tx: Option<Sender<(u64, Arc<[u8]>)>>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
    next_seq: u64,
    encoder: VllmEventEncoder,
    drained: Vec<PrefixEvent>,
    local_addr: SocketAddr,
    replay_addr: Option<SocketAddr>,
    mode: PubMode,
}

impl ZmqEventPublisher {
    /// Binds the sockets and starts the publisher thread; events are encoded by
    /// [`VllmEventEncoder::new`] (tagged maps) with the config's data-parallel rank.
    /// The endpoints' ports are offset by that rank ([`offset_endpoint_port`]).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an endpoint that is not `tcp://HOST:PORT` (or whose
    /// offset port is past 65535) or a zero limit; [`Error::Io`] when a socket cannot be
    /// bound or the thread started.
    pub fn bind(config: ZmqPublisherConfig) -> Result<Self> {
        Self::open(config, PubMode::Bind)
    }

    /// Binds the replay socket, if any, and starts the publisher thread, which connects
    /// the PUB socket to a subscriber listening on the endpoint (offset by the rank)
    /// and reconnects whenever the connection is lost (see the module docs). Returns at
    /// once: nothing waits for the subscriber.
    ///
    /// # Errors
    /// As [`Self::bind`]; [`Error::InvalidConfig`] also when the endpoint's host does
    /// not resolve. An unreachable subscriber is not an error: the thread keeps trying
    /// and counts [`ZmqPublisherStats::connect_failures`].
    pub fn connect(config: ZmqPublisherConfig) -> Result<Self> {
        Self::open(config, PubMode::Connect)
    }

    /// [`Self::bind`] or [`Self::connect`] as vLLM chooses
    /// ([`ZmqPublisherConfig::pub_mode`]): binds on a wildcard host, connects otherwise.
    ///
    /// # Errors
    /// As [`Self::bind`] and [`Self::connect`].
    pub fn start(config: ZmqPublisherConfig) -> Result<Self> {
        let mode = config.pub_mode();
        Self::open(config, mode)
    }

    fn open(mut config: ZmqPublisherConfig, mode: PubMode) -> Result<Self> {
        config.validate()?;
        let rank = config.data_parallel_rank;
        config.endpoint = offset_port("endpoint", &config.endpoint, rank)?;
        if let Some(e) = &config.replay_endpoint {
            config.replay_endpoint = Some(offset_port("replay_endpoint", e, rank)?);
        }
        let (publish, dialer, local_addr) = match mode {
            PubMode::Bind => {
                let listener = listen("endpoint", &config.endpoint)?;
                let addr = bound_addr(&listener)?;
                (Some(listener), None, addr)
            }
            PubMode::Connect => {
                let dialer = Dialer::new(&config)?;
                let addr = dialer.addrs[0];
                (None, Some(dialer), addr)
            }
        };
        let replay = match &config.replay_endpoint {
            Some(e) => Some(listen("replay_endpoint", e)?),
            None => None,
        };
        let replay_addr = replay.as_ref().map(bound_addr).transpose()?;
        let (tx, rx) = crossbeam_channel::bounded(config.queue_batches);
        let counters = Arc::new(Counters::default());
        let worker = Worker {
            rx,
            listeners: [publish, replay],
            dialer,
            peers: Vec::new(),
            buffer: VecDeque::new(),
            topic: config.topic.as_bytes().to_vec(),
            counters: Arc::clone(&counters),
            config,
        };
        let thread = std::thread::Builder::new()
            .name("pagedkv-kv-events".into())
            .spawn(move || worker.run())
            .map_err(|e| Error::Io(format!("starting the KV event publisher thread: {e}")))?;
        Ok(ZmqEventPublisher {
            tx: Some(tx),
            thread: Some(thread),
            counters,
            next_seq: 0,
            encoder: VllmEventEncoder::new().data_parallel_rank(Some(rank)),
            drained: Vec::new(),
            local_addr,
            replay_addr,
            mode,
        })
    }

    /// Encodes batches with `encoder` instead (another layout or data-parallel rank;
    /// it replaces the config's rank in the batches, not in the ports).
    pub fn with_encoder(mut self, encoder: VllmEventEncoder) -> Self {
        self.encoder = encoder;
        self
    }

    /// The PUB socket's address: where it is bound, or in [`PubMode::Connect`] the
    /// subscriber's address it connects to (the first the endpoint resolved to).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Whether the PUB socket binds or connects.
    pub fn mode(&self) -> PubMode {
        self.mode
    }

    /// The address the replay socket is bound to, if there is one.
    pub fn replay_addr(&self) -> Option<SocketAddr> {
        self.replay_addr
    }

    /// Publishes one encoded `KVEventBatch` and returns its sequence number. Never
    /// waits: when the thread's queue is full the batch is dropped and counted, and its
    /// sequence number stays taken.
    ///
    /// # Errors
    /// [`Error::Io`] when the publisher thread is gone (it ends only when dropped, so
    /// this does not happen short of a bug); the batch is counted as dropped.
    pub fn publish_payload(&mut self, payload: Vec<u8>) -> Result<u64> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let sent = match &self.tx {
            Some(tx) => tx.try_send((seq, payload.into())),
            None => Err(TrySendError::Disconnected((seq, Arc::from(Vec::new())))),
        };
        match sent {
            Ok(()) => Ok(seq),
            Err(TrySendError::Full(_)) => {
                bump(&self.counters.dropped_queue_full);
                Ok(seq)
            }
            Err(TrySendError::Disconnected(_)) => {
                bump(&self.counters.dropped_queue_full);
                Err(Error::Io(
                    "the KV event publisher thread has stopped".into(),
                ))
            }
        }
    }

    /// Encodes `events` as one batch stamped `ts` (seconds since the Unix epoch) and
    /// publishes it; `None` when `events` is empty (vLLM sends no empty batches).
    ///
    /// # Errors
    /// As [`VllmEventEncoder::encode_batch`] (nothing is published then) and
    /// [`Self::publish_payload`].
    pub fn publish(&mut self, ts: f64, events: &[PrefixEvent]) -> Result<Option<u64>> {
        if events.is_empty() {
            return Ok(None);
        }
        let mut payload = Vec::new();
        self.encoder.encode_batch(ts, events, &mut payload)?;
        self.publish_payload(payload).map(Some)
    }

    /// Drains `kv`'s recorded prefix events ([`KvCache::drain_prefix_events`]) and
    /// publishes them as one batch stamped now; `None` when there were none.
    ///
    /// # Errors
    /// As [`Self::publish_payload`].
    pub fn publish_drained(&mut self, kv: &mut KvCache) -> Result<Option<u64>> {
        kv.drain_prefix_events(&mut self.drained);
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let events = std::mem::take(&mut self.drained);
        let published = self.publish(ts, &events);
        self.drained = events;
        self.drained.clear();
        published
    }

    /// The publisher's counters now.
    pub fn stats(&self) -> ZmqPublisherStats {
        let c = &self.counters;
        ZmqPublisherStats {
            batches_published: self.next_seq,
            batches_dropped_queue_full: c.dropped_queue_full.load(Ordering::Relaxed),
            batches_dropped_slow_peer: c.dropped_slow_peer.load(Ordering::Relaxed),
            subscribers: c.subscribers.load(Ordering::Relaxed),
            replay_requests: c.replay_requests.load(Ordering::Relaxed),
            peers_refused: c.peers_refused.load(Ordering::Relaxed),
            connect_failures: c.connect_failures.load(Ordering::Relaxed),
        }
    }
}

impl Drop for ZmqEventPublisher {
    /// Sends what is queued (for at most [`ZmqPublisherConfig::linger_ms`]), then
    /// closes the sockets.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(thread) = self.thread.take() {
            // The thread does not panic; if it did, there is nothing left to close.
            let _ = thread.join();
        }
    }
}

/// `tcp://HOST:PORT` split into `HOST` (as written) and the port.
fn parse_tcp<'a>(field: &'static str, endpoint: &'a str) -> Result<(&'a str, u16)> {
    let invalid = |reason: &str| Error::InvalidConfig {
        field,
        reason: format!("{endpoint:?}: {reason}"),
    };
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| invalid("only tcp://HOST:PORT is supported"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| invalid("no :PORT"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| invalid("the port is not a number"))?;
    Ok((host, port))
}

/// The addresses `endpoint` resolves to (`*` is every IPv4 interface).
fn resolve(field: &'static str, endpoint: &str) -> Result<Vec<SocketAddr>> {
    let (host, port) = parse_tcp(field, endpoint)?;
    let host = match host {
        "*" => "0.0.0.0",
        h => h.trim_start_matches('[').trim_end_matches(']'),
    };
    let invalid = |reason: String| Error::InvalidConfig {
        field,
        reason: format!("{endpoint:?}: {reason}"),
    };
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| invalid(e.to_string()))?
        .collect();
    if addrs.is_empty() {
        return Err(invalid("the host resolves to no address".into()));
    }
    Ok(addrs)
}

fn listen(field: &'static str, endpoint: &str) -> Result<TcpListener> {
    let addrs = resolve(field, endpoint)?;
    let listener =
        TcpListener::bind(&addrs[..]).map_err(|e| Error::Io(format!("binding {endpoint}: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::Io(format!("{endpoint}: {e}")))?;
    Ok(listener)
}

fn bound_addr(listener: &TcpListener) -> Result<SocketAddr> {
    listener.local_addr().map_err(|e| Error::Io(e.to_string()))
}

/// The connecting side of [`PubMode::Connect`]: where to dial and when next.
struct Dialer {
    addrs: Vec<SocketAddr>,
    timeout: Duration,
    min_wait: Duration,
    max_wait: Duration,
    /// The wait after the next failure; back to `min_wait` once a handshake completes.
    wait: Duration,
    next_attempt: Instant,
    /// A connection of ours is among the peers.
    connected: bool,
}

impl Dialer {
    fn new(config: &ZmqPublisherConfig) -> Result<Self> {
        let min_wait = Duration::from_millis(config.reconnect_min_ms);
        Ok(Dialer {
            addrs: resolve("endpoint", &config.endpoint)?,
            timeout: Duration::from_millis(config.connect_timeout_ms),
            min_wait,
            max_wait: Duration::from_millis(config.reconnect_max_ms),
            wait: min_wait,
            next_attempt: Instant::now(),
            connected: false,
        })
    }

    /// One attempt on each address in turn; a connected, non-blocking stream or `None`.
    fn dial(&self) -> Option<TcpStream> {
        self.addrs.iter().find_map(|addr| {
            let stream = TcpStream::connect_timeout(addr, self.timeout).ok()?;
            let ready = stream.set_nonblocking(true).is_ok() && stream.set_nodelay(true).is_ok();
            ready.then_some(stream)
        })
    }

    /// Schedules the next attempt after the current wait, and doubles the wait.
    fn back_off(&mut self) {
        self.next_attempt = Instant::now() + self.wait;
        self.wait = (self.wait * 2).min(self.max_wait);
    }
}

// ---- ZMTP 3.1 (rfc.zeromq.org/spec/37) ----------------------------------------------

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// Largest frame a peer may send us: subscriptions, replay requests and commands are
/// small; anything larger is a peer to close.
const MAX_IN_FRAME: u64 = 64 << 10;
/// Most frames in one message a peer sends us.
const MAX_IN_PARTS: usize = 8;
/// The sequence number of the replay's end marker.
const END_SEQ: i64 = -1;

/// Our greeting: signature, version 3.1, the NULL mechanism, not as-server.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn frame_header(out: &mut Vec<u8>, len: usize, flags: u8) {
    match u8::try_from(len) {
        Ok(n) => out.extend_from_slice(&[flags, n]),
        Err(_) => {
            out.push(flags | FLAG_LONG);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
    }
}

fn frame(out: &mut Vec<u8>, body: &[u8], flags: u8) {
    frame_header(out, body.len(), flags);
    out.extend_from_slice(body);
}

/// A command frame: the name's length, the name, then `data`.
fn command(name: &str, data: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    let mut out = Vec::with_capacity(body.len() + 9);
    frame(&mut out, &body, FLAG_COMMAND);
    out
}

/// `READY` with the metadata property `Socket-Type`.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut props = Vec::new();
    props.push(11);
    props.extend_from_slice(b"Socket-Type");
    props.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    props.extend_from_slice(socket_type.as_bytes());
    command("READY", &props)
}

/// The value of property `name` in a `READY` command's data.
fn property<'a>(mut data: &'a [u8], name: &str) -> Option<&'a [u8]> {
    while let Some((&name_len, rest)) = data.split_first() {
        let (key, rest) = rest.split_at_checked(usize::from(name_len))?;
        let (len, rest) = rest.split_at_checked(4)?;
        let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
        let (value, rest) = rest.split_at_checked(len)?;
        if key.eq_ignore_ascii_case(name.as_bytes()) {
            return Some(value);
        }
        data = rest;
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A connection to the PUB socket.
    Publish,
    /// A connection to the replay ROUTER socket.
    Replay,
}

impl Role {
    fn socket_type(self) -> &'static str {
        match self {
            Role::Publish => "PUB",
            Role::Replay => "ROUTER",
        }
    }

    /// Whether a peer of `socket_type` may talk to this socket (ZMTP 3.1's table).
    fn accepts(self, socket_type: &[u8]) -> bool {
        match self {
            Role::Publish => matches!(socket_type, b"SUB" | b"XSUB"),
            Role::Replay => matches!(socket_type, b"REQ" | b"DEALER" | b"ROUTER"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handshake {
    Greeting,
    Ready,
    Open,
}

/// Why a connection is closed.
enum Close {
    /// The peer closed it, or the socket failed.
    Gone,
    /// The peer broke the protocol (greeting, socket type, frame size, a message
    /// before the handshake).
    Refused,
}
use Close::Refused;

struct Peer {
    stream: TcpStream,
    role: Role,
    handshake: Handshake,
    inbuf: Vec<u8>,
    parts: Vec<Vec<u8>>,
    out: VecDeque<Arc<[u8]>>,
    /// Bytes of `out`'s first chunk already written.
    out_off: usize,
    out_bytes: usize,
    subscriptions: Vec<Vec<u8>>,
    /// Closed by the peer or by us: dropped after this round.
    closed: bool,
    /// We connected to it ([`PubMode::Connect`]) rather than accepted it.
    dialed: bool,
}

impl Peer {
    fn new(stream: TcpStream, role: Role) -> Self {
        let mut peer = Peer {
            stream,
            role,
            handshake: Handshake::Greeting,
            inbuf: Vec::new(),
            parts: Vec::new(),
            out: VecDeque::new(),
            out_off: 0,
            out_bytes: 0,
            subscriptions: Vec::new(),
            closed: false,
            dialed: false,
        };
        // NULL security: each side sends its greeting and READY without waiting.
        peer.push(greeting().to_vec().into());
        peer.push(ready(role.socket_type()).into());
        peer
    }

    fn push(&mut self, chunk: Arc<[u8]>) {
        self.out_bytes += chunk.len();
        self.out.push_back(chunk);
    }

    fn subscribed(&self, topic: &[u8]) -> bool {
        self.handshake == Handshake::Open && self.subscriptions.iter().any(|s| topic.starts_with(s))
    }

    /// A replay answer is still being sent: read no further requests.
    fn replaying(&self) -> bool {
        self.role == Role::Replay && self.handshake == Handshake::Open && !self.out.is_empty()
    }

    /// Writes what the socket takes now.
    fn flush(&mut self) -> io::Result<()> {
        while !self.out.is_empty() {
            let slices: Vec<IoSlice<'_>> = self
                .out
                .iter()
                .take(32)
                .enumerate()
                .map(|(i, c)| IoSlice::new(if i == 0 { &c[self.out_off..] } else { c }))
                .collect();
            let mut written = match self.stream.write_vectored(&slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            while let Some(front) = self.out.front() {
                let left = front.len() - self.out_off;
                if written < left {
                    self.out_off += written;
                    break;
                }
                written -= left;
                self.out_bytes -= front.len();
                self.out.pop_front();
                self.out_off = 0;
            }
        }
        Ok(())
    }

    /// Reads what the peer sent and acts on each complete frame.
    fn receive(&mut self, shared: &mut Shared<'_>) -> std::result::Result<(), Close> {
        let mut buf = [0u8; 16 << 10];
        while !self.replaying() {
            match self.stream.read(&mut buf) {
                Ok(0) => return Err(Close::Gone),
                Ok(n) => {
                    self.inbuf.extend_from_slice(&buf[..n]);
                    self.parse(shared)?;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Err(Close::Gone),
            }
        }
        Ok(())
    }

    fn parse(&mut self, shared: &mut Shared<'_>) -> std::result::Result<(), Close> {
        let mut pos = 0;
        let inbuf = std::mem::take(&mut self.inbuf);
        let result = loop {
            let avail = &inbuf[pos..];
            if self.handshake == Handshake::Greeting {
                let Some(g) = avail.get(..64) else {
                    break Ok(());
                };
                let valid =
                    g[0] == 0xff && g[9] & 1 == 1 && g[10] >= 3 && g[12..32] == greeting()[12..32];
                if !valid {
                    break Err(Refused);
                }
                pos += 64;
                self.handshake = Handshake::Ready;
                continue;
            }
            if self.replaying() {
                break Ok(());
            }
            let Some((&flags, rest)) = avail.split_first() else {
                break Ok(());
            };
            if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
                break Err(Refused);
            }
            let (header, len) = if flags & FLAG_LONG != 0 {
                match rest.get(..8) {
                    Some(b) => (9, u64::from_be_bytes(b.try_into().unwrap_or([0xff; 8]))),
                    None => break Ok(()),
                }
            } else {
                match rest.first() {
                    Some(&b) => (2, u64::from(b)),
                    None => break Ok(()),
                }
            };
            if len > MAX_IN_FRAME {
                break Err(Refused);
            }
            let Some(body) = avail.get(header..header + len as usize) else {
                break Ok(());
            };
            pos += header + len as usize;
            let acted = if flags & FLAG_COMMAND != 0 {
                self.on_command(body)
            } else {
                self.on_frame(body, flags & FLAG_MORE != 0, shared)
            };
            if acted.is_err() {
                break acted;
            }
        };
        self.inbuf = inbuf;
        self.inbuf.drain(..pos);
        result
    }

    fn on_command(&mut self, body: &[u8]) -> std::result::Result<(), Close> {
        let (&name_len, rest) = body.split_first().ok_or(Refused)?;
        let (name, data) = rest
            .split_at_checked(usize::from(name_len))
            .ok_or(Refused)?;
        match (self.handshake, name) {
            (Handshake::Ready, b"READY") => {
                let socket_type = property(data, "Socket-Type").ok_or(Refused)?;
                if !self.role.accepts(socket_type) {
                    return Err(Refused);
                }
                self.handshake = Handshake::Open;
            }
            (Handshake::Open, b"SUBSCRIBE") if self.role == Role::Publish => {
                self.subscriptions.push(data.to_vec());
            }
            (Handshake::Open, b"CANCEL") if self.role == Role::Publish => self.cancel(data),
            (Handshake::Open, b"PING") => {
                // PING's data: a 2-byte TTL, then the context PONG echoes.
                let context = data.get(2..).unwrap_or_default();
                self.push(command("PONG", context).into());
            }
            (Handshake::Open, b"ERROR") | (Handshake::Ready, _) => return Err(Refused),
            _ => {}
        }
        Ok(())
    }

    fn cancel(&mut self, topic: &[u8]) {
        if let Some(i) = self.subscriptions.iter().position(|s| s == topic) {
            self.subscriptions.swap_remove(i);
        }
    }

    fn on_frame(
        &mut self,
        body: &[u8],
        more: bool,
        shared: &mut Shared<'_>,
    ) -> std::result::Result<(), Close> {
        if self.handshake != Handshake::Open || self.parts.len() == MAX_IN_PARTS {
            return Err(Refused);
        }
        self.parts.push(body.to_vec());
        if more {
            return Ok(());
        }
        let parts = std::mem::take(&mut self.parts);
        match (self.role, &parts[..]) {
            // ZMTP 3.0's subscriptions: a message whose first byte is 1 or 0.
            (Role::Publish, [m]) => match m.split_first() {
                Some((1, topic)) => self.subscriptions.push(topic.to_vec()),
                Some((0, topic)) => self.cancel(topic),
                _ => {}
            },
            (Role::Replay, [delimiter, start]) if delimiter.is_empty() && start.len() <= 8 => {
                let start = start.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b));
                self.replay(start, shared);
            }
            _ => {}
        }
        Ok(())
    }

    fn replay(&mut self, start: u64, shared: &mut Shared<'_>) {
        bump(&shared.counters.replay_requests);
        for (seq, payload) in shared.buffer.iter().filter(|(s, _)| *s >= start) {
            let mut header = Vec::with_capacity(2 + 10 + 9);
            frame(&mut header, b"", FLAG_MORE);
            frame(&mut header, &seq.to_be_bytes(), FLAG_MORE);
            frame_header(&mut header, payload.len(), 0);
            self.push(header.into());
            self.push(Arc::clone(payload));
        }
        let mut end = Vec::with_capacity(14);
        frame(&mut end, b"", FLAG_MORE);
        frame(&mut end, &END_SEQ.to_be_bytes(), FLAG_MORE);
        frame(&mut end, b"", 0);
        self.push(end.into());
    }
}

/// What the peers' handlers read besides their own state.
struct Shared<'a> {
    buffer: &'a VecDeque<(u64, Arc<[u8]>)>,
    counters: &'a Counters,
}

struct Worker {
    rx: Receiver<(u64, Arc<[u8]>)>,
    /// The PUB listener (none in [`PubMode::Connect`]) and the replay listener.
    listeners: [Option<TcpListener>; 2],
    /// The PUB socket's connection in [`PubMode::Connect`].
    dialer: Option<Dialer>,
    peers: Vec<Peer>,
    buffer: VecDeque<(u64, Arc<[u8]>)>,
    topic: Vec<u8>,
    counters: Arc<Counters>,
    config: ZmqPublisherConfig,
}

impl Worker {
    fn run(mut self) {
        let poll = Duration::from_millis(self.config.poll_interval_ms);
        let mut linger_until = None;
        loop {
            if linger_until.is_none() {
                match self.rx.recv_timeout(poll) {
                    Ok(batch) => self.fan_out(batch),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {
                        linger_until =
                            Some(Instant::now() + Duration::from_millis(self.config.linger_ms));
                    }
                }
                while let Ok(batch) = self.rx.try_recv() {
                    self.fan_out(batch);
                }
            } else {
                std::thread::sleep(poll);
            }
            if linger_until.is_none() {
                // Lingering, nothing is queued for a subscriber not yet connected.
                self.dial();
            }
            self.accept();
            self.service();
            if let Some(deadline) = linger_until {
                let sent = self
                    .peers
                    .iter()
                    .all(|p| p.out.is_empty() || p.handshake != Handshake::Open);
                if sent || Instant::now() >= deadline {
                    return;
                }
            }
        }
    }

    /// Queues batch `seq` for every subscriber whose queue has room, and keeps it for
    /// replay.
    fn fan_out(&mut self, (seq, payload): (u64, Arc<[u8]>)) {
        let mut header = Vec::with_capacity(self.topic.len() + 2 * 9 + 10);
        frame(&mut header, &self.topic, FLAG_MORE);
        frame(&mut header, &seq.to_be_bytes(), FLAG_MORE);
        frame_header(&mut header, payload.len(), 0);
        let header: Arc<[u8]> = header.into();
        for peer in &mut self.peers {
            if peer.role != Role::Publish || !peer.subscribed(&self.topic) {
                continue;
            }
            if peer.out_bytes + header.len() + payload.len() > self.config.peer_queue_bytes {
                bump(&self.counters.dropped_slow_peer);
                continue;
            }
            peer.push(Arc::clone(&header));
            peer.push(Arc::clone(&payload));
        }
        if self.buffer.len() == self.config.replay_buffer_batches {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    /// In [`PubMode::Connect`], connects when there is no connection and the wait
    /// after the last failure is over.
    fn dial(&mut self) {
        let Some(dialer) = &mut self.dialer else {
            return;
        };
        if dialer.connected || Instant::now() < dialer.next_attempt {
            return;
        }
        match dialer.dial() {
            Some(stream) => {
                let mut peer = Peer::new(stream, Role::Publish);
                peer.dialed = true;
                self.peers.push(peer);
                dialer.connected = true;
            }
            None => {
                bump(&self.counters.connect_failures);
                dialer.back_off();
            }
        }
    }

    fn accept(&mut self) {
        for (listener, role) in self.listeners.iter().zip([Role::Publish, Role::Replay]) {
            let Some(listener) = listener else { continue };
            while let Ok((stream, _)) = listener.accept() {
                let count = self.peers.iter().filter(|p| p.role == role).count();
                let ready = count < self.config.max_peers
                    && stream.set_nonblocking(true).is_ok()
                    && stream.set_nodelay(true).is_ok();
                if ready {
                    self.peers.push(Peer::new(stream, role));
                } else {
                    bump(&self.counters.peers_refused);
                }
            }
        }
    }

    fn service(&mut self) {
        let mut shared = Shared {
            buffer: &self.buffer,
            counters: &self.counters,
        };
        for peer in &mut self.peers {
            match peer.receive(&mut shared) {
                Ok(()) => {}
                Err(Close::Gone) => peer.closed = true,
                Err(Close::Refused) => {
                    bump(&self.counters.peers_refused);
                    peer.closed = true;
                }
            }
            if !peer.closed && peer.flush().is_err() {
                peer.closed = true;
            }
        }
        if let Some(dialer) = &mut self.dialer {
            match self.peers.iter().find(|p| p.dialed) {
                Some(p) if p.closed => {
                    // Lost (or refused by the peer): dial again after the wait, which
                    // keeps doubling while no handshake completes.
                    dialer.connected = false;
                    dialer.back_off();
                }
                Some(p) if p.handshake == Handshake::Open => dialer.wait = dialer.min_wait,
                _ => {}
            }
        }
        self.peers.retain(|p| !p.closed);
        let subscribers = self
            .peers
            .iter()
            .filter(|p| p.role == Role::Publish && p.subscribed(&self.topic))
            .count();
        self.counters
            .subscribers
            .store(subscribers as u64, Ordering::Relaxed);
    }
}
