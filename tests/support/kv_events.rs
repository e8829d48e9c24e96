//! Shared by the `kv_events_*` tests: a ZMTP client written from the spec
//! (rfc.zeromq.org/spec/23 and /37), apart from the publisher's code, and a cache that
//! records its prefix events.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use pagedkv::events::ZmqEventPublisher;
use pagedkv::pool::prefix::PrefixEvent;
use pagedkv::{
    AdmitOptions, CacheConfig, DType, KvCache, KvLayout, ModelShape, PrefixConfig, SeqId,
};

/// Every read waits at most this long: the tests end in bounded time.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// One ZMTP connection, blocking, as a SUB, DEALER or other socket.
pub struct Zmtp {
    stream: TcpStream,
    /// The peer's `Socket-Type`.
    pub peer_type: String,
}

impl Zmtp {
    /// Connects and does the NULL handshake, announcing ZMTP `minor` (0 or 1).
    pub fn connect(addr: SocketAddr, socket_type: &str, minor: u8) -> Zmtp {
        let stream = TcpStream::connect_timeout(&addr, TIMEOUT).unwrap();
        Zmtp::handshake(stream, socket_type, minor)
    }

    /// Accepts one connection on `listener` (a socket that binds, as a router's SUB
    /// may) and does the NULL handshake as [`Zmtp::connect`] does: in ZMTP both ends
    /// of a NULL handshake say the same.
    pub fn accept(listener: &TcpListener, socket_type: &str, minor: u8) -> Zmtp {
        listener.set_nonblocking(true).unwrap();
        let start = Instant::now();
        let stream = loop {
            match listener.accept() {
                Ok((stream, _)) => break stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(start.elapsed() < TIMEOUT, "no connection to accept");
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        stream.set_nonblocking(false).unwrap();
        Zmtp::handshake(stream, socket_type, minor)
    }

    fn handshake(mut stream: TcpStream, socket_type: &str, minor: u8) -> Zmtp {
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, minor];
        greeting.extend_from_slice(b"NULL");
        greeting.resize(64, 0);
        stream.write_all(&greeting).unwrap();
        let mut peer = [0u8; 64];
        stream.read_exact(&mut peer).unwrap();
        assert_eq!(
            (peer[0], peer[9], peer[10]),
            (0xff, 0x7f, 3),
            "greeting {peer:?}"
        );
        assert_eq!(&peer[12..16], b"NULL");
        assert_eq!(peer[32], 0, "as-server is 0 for NULL");
        let mut ready = vec![5];
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        ready.extend_from_slice(socket_type.as_bytes());
        let mut z = Zmtp {
            stream,
            peer_type: String::new(),
        };
        z.send_frame(0x04, &ready);
        let (flags, body) = z.recv_frame().expect("READY");
        assert_eq!(flags & 0x04, 0x04, "the first frame is a command");
        assert_eq!(&body[..6], b"\x05READY");
        let props = &body[6..];
        let name_len = props[0] as usize;
        assert_eq!(&props[1..1 + name_len], b"Socket-Type");
        let at = 1 + name_len;
        let len = u32::from_be_bytes(props[at..at + 4].try_into().unwrap()) as usize;
        z.peer_type = String::from_utf8(props[at + 4..at + 4 + len].to_vec()).unwrap();
        z
    }

    fn send_frame(&mut self, flags: u8, body: &[u8]) {
        let mut f = Vec::new();
        if body.len() > 255 {
            f.push(flags | 0x02);
            f.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            f.extend_from_slice(&[flags, body.len() as u8]);
        }
        f.extend_from_slice(body);
        self.stream.write_all(&f).unwrap();
    }

    /// Sends raw bytes (for the tests of a misbehaving peer).
    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    /// One frame: its flags and body; `None` when the peer closed the connection.
    pub fn recv_frame(&mut self) -> Option<(u8, Vec<u8>)> {
        let mut head = [0u8; 2];
        if self.stream.read_exact(&mut head).is_err() {
            return None;
        }
        let len = if head[0] & 0x02 != 0 {
            let mut rest = [0u8; 7];
            self.stream.read_exact(&mut rest).unwrap();
            let mut be = [0u8; 8];
            be[0] = head[1];
            be[1..].copy_from_slice(&rest);
            u64::from_be_bytes(be) as usize
        } else {
            head[1] as usize
        };
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).unwrap();
        Some((head[0], body))
    }

    /// Sends one message of `frames`.
    pub fn send(&mut self, frames: &[&[u8]]) {
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { 0x01 } else { 0 };
            self.send_frame(more, f);
        }
    }

    /// The next message, commands skipped.
    pub fn recv(&mut self) -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        loop {
            let (flags, body) = self.recv_frame().expect("a message");
            if flags & 0x04 != 0 {
                continue;
            }
            frames.push(body);
            if flags & 0x01 == 0 {
                return frames;
            }
        }
    }

    /// Subscribes to `prefix`: with the SUBSCRIBE command on ZMTP 3.1, else with
    /// ZMTP 3.0's message `\x01 prefix`.
    pub fn subscribe(&mut self, prefix: &[u8], command: bool) {
        if command {
            let mut body = vec![9];
            body.extend_from_slice(b"SUBSCRIBE");
            body.extend_from_slice(prefix);
            self.send_frame(0x04, &body);
        } else {
            let mut m = vec![1];
            m.extend_from_slice(prefix);
            self.send(&[&m]);
        }
    }
}

/// Waits until `publisher` counts `n` subscribers (a subscription reaches the
/// publisher's thread a little after it was sent).
pub fn wait_subscribers(publisher: &ZmqEventPublisher, n: u64) {
    let start = Instant::now();
    while publisher.stats().subscribers != n {
        assert!(start.elapsed() < TIMEOUT, "{:?}", publisher.stats());
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub const BLOCK: usize = 4;

/// A cache of `num_blocks` blocks of [`BLOCK`] tokens that records its prefix events.
pub fn cache(num_blocks: usize) -> KvCache {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 1,
        num_kv_heads: 1,
        head_dim: 2,
        kv_dtype: DType::F32,
    };
    let mut p = PrefixConfig::for_arena(num_blocks);
    p.record_events = true;
    let cfg = CacheConfig {
        num_blocks,
        watermark_blocks: 0,
        max_seq_len_tokens: 0,
        ..CacheConfig::new(0)
    };
    KvCache::with_prefix_config(KvLayout::new(shape, BLOCK).unwrap(), cfg, p).unwrap()
}

/// Admits `tokens` as sequence `seq`.
pub fn admit(kv: &mut KvCache, seq: u64, tokens: &[u32]) {
    let mut slots = Vec::new();
    kv.admit_tokens(SeqId(seq), tokens, &AdmitOptions::default(), &mut slots)
        .unwrap();
}

/// The events recorded since the last call.
pub fn drain(kv: &mut KvCache) -> Vec<PrefixEvent> {
    let mut events = Vec::new();
    kv.drain_prefix_events(&mut events);
    events
}

/// Prompts of `len` tokens that share their first `shared` tokens.
pub fn prompt(id: u32, len: usize, shared: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            if (i as usize) < shared {
                1000 + i
            } else {
                id * 10_000 + i
            }
        })
        .collect()
}
