//! `ZmqEventPublisher` on the wire, read by a ZMTP client written from the spec in
//! `support::kv_events` (not the publisher's code): vLLM's three frames, sequence
//! numbers, the payload bytes, replay with its end marker, late and slow subscribers,
//! peers that break the protocol. Loopback only; every read times out after 10 s.

use crate::support::kv_events;

use std::time::{Duration, Instant};

use kv_events::{admit, cache, drain, prompt, wait_subscribers, Zmtp, BLOCK};
use pagedkv::events::zmq::offset_endpoint_port;
use pagedkv::events::{PubMode, VllmEventEncoder, ZmqEventPublisher, ZmqPublisherConfig};
use pagedkv::pool::prefix::PrefixEvent;
use pagedkv::{Error, SeqId};

fn publisher(config: ZmqPublisherConfig) -> ZmqEventPublisher {
    ZmqEventPublisher::bind(config).unwrap()
}

fn loopback() -> ZmqPublisherConfig {
    ZmqPublisherConfig::new("tcp://127.0.0.1:0").replay("tcp://127.0.0.1:0")
}

/// Drives a cache through stores, shared hits, evictions and a reset; returns each
/// step's events (steps without events left out).
fn steps() -> Vec<Vec<PrefixEvent>> {
    let mut kv = cache(12);
    let mut out = Vec::new();
    let mut step = |kv: &mut pagedkv::KvCache| {
        let e = drain(kv);
        if !e.is_empty() {
            out.push(e);
        }
    };
    admit(&mut kv, 1, &prompt(1, 3 * BLOCK + 1, 2 * BLOCK));
    step(&mut kv);
    admit(&mut kv, 2, &prompt(2, 3 * BLOCK + 2, 2 * BLOCK));
    step(&mut kv);
    kv.free(SeqId(1)).unwrap();
    kv.free(SeqId(2)).unwrap();
    // Eight more blocks than are free: the cached ones are evicted.
    admit(&mut kv, 3, &prompt(3, 10 * BLOCK, 0));
    step(&mut kv);
    kv.reset_prefix_cache().unwrap();
    step(&mut kv);
    out
}

fn encode(ts: f64, events: &[PrefixEvent]) -> Vec<u8> {
    let mut out = Vec::new();
    VllmEventEncoder::new()
        .encode_batch(ts, events, &mut out)
        .unwrap();
    out
}

fn seq_of(frame: &[u8]) -> i64 {
    i64::from_be_bytes(frame.try_into().expect("8-byte sequence number"))
}

#[test]
fn subscribers_get_three_frames_per_batch_numbered_from_zero() {
    let steps = steps();
    let kinds: Vec<_> = steps.iter().flatten().map(std::mem::discriminant).collect();
    for kind in [
        PrefixEvent::AllCleared,
        PrefixEvent::BlockRemoved {
            hash: pagedkv::pool::prefix::BlockHash(0),
            block: pagedkv::BlockId(0),
            medium: pagedkv::pool::prefix::Medium::Device,
            group: None,
        },
    ] {
        assert!(
            kinds.contains(&std::mem::discriminant(&kind)),
            "the steps cover every kind"
        );
    }
    for (topic, minor, command) in [("", 1, true), ("kv@pagedkv", 0, false)] {
        let mut p = publisher(loopback().topic(topic));
        let mut sub = Zmtp::connect(p.local_addr(), "SUB", minor);
        assert_eq!(sub.peer_type, "PUB");
        sub.subscribe(topic.as_bytes(), command);
        wait_subscribers(&p, 1);
        for (i, events) in steps.iter().enumerate() {
            let ts = 1_700_000_000.0 + i as f64;
            assert_eq!(p.publish(ts, events).unwrap(), Some(i as u64));
            let m = sub.recv();
            assert_eq!(m.len(), 3, "topic, sequence number, payload");
            assert_eq!(m[0], topic.as_bytes());
            assert_eq!(m[1], (i as u64).to_be_bytes());
            // The encoder's bytes are checked against msgspec in tests/io/vllm_wire.rs.
            assert_eq!(m[2], encode(ts, events));
        }
        assert_eq!(p.stats().batches_published, steps.len() as u64);
    }
}

#[test]
fn a_subscription_to_another_topic_gets_nothing() {
    let mut p = publisher(loopback().topic("kv@a"));
    let mut other = Zmtp::connect(p.local_addr(), "SUB", 1);
    other.subscribe(b"kv@b", true);
    let mut all = Zmtp::connect(p.local_addr(), "SUB", 1);
    all.subscribe(b"", true);
    wait_subscribers(&p, 1);
    p.publish(1.0, &[PrefixEvent::AllCleared]).unwrap();
    assert_eq!(all.recv()[1], 0u64.to_be_bytes());
    drop(p);
    // The publisher closed the connection without sending `other` anything.
    assert_eq!(other.recv_frame(), None);
}

#[test]
fn a_late_subscriber_gets_later_batches_only() {
    let mut p = publisher(loopback());
    for i in 0..3 {
        p.publish(f64::from(i), &[PrefixEvent::AllCleared]).unwrap();
    }
    let mut sub = Zmtp::connect(p.local_addr(), "SUB", 1);
    sub.subscribe(b"", true);
    wait_subscribers(&p, 1);
    for i in 3..5 {
        p.publish(f64::from(i), &[PrefixEvent::AllCleared]).unwrap();
    }
    assert_eq!(seq_of(&sub.recv()[1]), 3);
    assert_eq!(seq_of(&sub.recv()[1]), 4);
}

/// Sends a replay request from `start` and collects the answer up to the end marker.
fn replay(z: &mut Zmtp, start: u64) -> Vec<(i64, Vec<u8>)> {
    z.send(&[b"", &start.to_be_bytes()]);
    let mut got = Vec::new();
    loop {
        let m = z.recv();
        assert_eq!(m.len(), 3, "delimiter, sequence number, payload: {m:?}");
        assert!(m[0].is_empty(), "the empty delimiter");
        let seq = seq_of(&m[1]);
        if seq == -1 {
            assert!(m[2].is_empty(), "the end marker's payload is empty");
            return got;
        }
        got.push((seq, m[2].clone()));
    }
}

#[test]
fn replay_sends_the_buffered_range_then_the_end_marker() {
    let steps = steps();
    let mut p = publisher(loopback());
    let mut payloads = Vec::new();
    for (i, events) in steps.iter().enumerate() {
        p.publish(i as f64, events).unwrap();
        payloads.push(encode(i as f64, events));
    }
    let mut dealer = Zmtp::connect(p.replay_addr().unwrap(), "DEALER", 1);
    assert_eq!(dealer.peer_type, "ROUTER");
    let all: Vec<_> = (0..).zip(payloads.iter().cloned()).collect();
    // The publisher thread may not have buffered the last batch yet: ask until it has.
    let start = Instant::now();
    while replay(&mut dealer, 0) != all {
        assert!(start.elapsed() < Duration::from_secs(10));
    }
    assert_eq!(replay(&mut dealer, 2), all[2..]);
    assert_eq!(replay(&mut dealer, 99), []);
    // A REQ socket's request looks the same on the wire.
    let mut req = Zmtp::connect(p.replay_addr().unwrap(), "REQ", 1);
    assert_eq!(replay(&mut req, 1), all[1..]);
    assert!(p.stats().replay_requests >= 4, "{:?}", p.stats());
}

#[test]
fn replay_keeps_the_last_buffer_batches() {
    let mut config = loopback();
    config.replay_buffer_batches = 3;
    let mut p = publisher(config);
    for i in 0..5 {
        p.publish(f64::from(i), &[PrefixEvent::AllCleared]).unwrap();
    }
    let mut dealer = Zmtp::connect(p.replay_addr().unwrap(), "DEALER", 1);
    let start = Instant::now();
    loop {
        let seqs: Vec<i64> = replay(&mut dealer, 0).into_iter().map(|(s, _)| s).collect();
        if seqs == [2, 3, 4] {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{seqs:?}");
    }
}

#[test]
fn a_subscriber_that_does_not_read_never_blocks_the_cache() {
    let mut config = loopback();
    config.peer_queue_bytes = 64 << 10;
    config.linger_ms = 50;
    let mut p = publisher(config);
    let mut stalled = Zmtp::connect(p.local_addr(), "SUB", 1);
    stalled.subscribe(b"", true);
    wait_subscribers(&p, 1);
    // 2,000 batches of 64 stored blocks (about 2.5 KB each, 5 MB in all, past what the
    // loopback socket buffers hold).
    let events: Vec<PrefixEvent> = (0..64)
        .map(|i| PrefixEvent::BlockStored {
            hash: pagedkv::pool::prefix::BlockHash(u64::MAX - i),
            parent: None,
            block: pagedkv::BlockId(i as u32),
            token_ids: vec![70_000; BLOCK],
            block_size: BLOCK,
            extra_keys: Vec::new(),
            medium: pagedkv::pool::prefix::Medium::Device,
            group: None,
        })
        .collect();
    let start = Instant::now();
    for i in 0..2_000 {
        p.publish(f64::from(i), &events).unwrap();
    }
    let publishing = start.elapsed();
    assert!(publishing < Duration::from_secs(5), "{publishing:?}");
    let start = Instant::now();
    while p.stats().batches_dropped_slow_peer == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "{:?}", p.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    // The first batch was sent whole; the subscriber sees gaps in what follows.
    assert_eq!(seq_of(&stalled.recv()[1]), 0);
    let start = Instant::now();
    drop(p);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "dropping waits at most the linger"
    );
}

#[test]
fn peers_that_break_the_protocol_are_closed_and_counted() {
    let mut p = publisher(loopback());
    // A PUB cannot subscribe to a PUB.
    let wrong = Zmtp::connect(p.local_addr(), "PUB", 1);
    let mut garbage = std::net::TcpStream::connect(p.local_addr()).unwrap();
    std::io::Write::write_all(&mut garbage, &[0x42; 64]).unwrap();
    // A frame longer than any request the publisher reads.
    let mut huge = Zmtp::connect(p.replay_addr().unwrap(), "DEALER", 1);
    let mut frame = vec![0x02];
    frame.extend_from_slice(&(1u64 << 40).to_be_bytes());
    huge.send_raw(&frame);
    let start = Instant::now();
    while p.stats().peers_refused < 3 {
        assert!(start.elapsed() < Duration::from_secs(10), "{:?}", p.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(wrong);
    // A well-behaved subscriber is served all along.
    let mut sub = Zmtp::connect(p.local_addr(), "SUB", 1);
    sub.subscribe(b"", true);
    wait_subscribers(&p, 1);
    p.publish(1.0, &[PrefixEvent::AllCleared]).unwrap();
    assert_eq!(seq_of(&sub.recv()[1]), 0);
}

#[test]
fn bad_endpoints_are_typed_errors() {
    for endpoint in ["ipc:///tmp/kv", "tcp://127.0.0.1", "tcp://127.0.0.1:port"] {
        let err = ZmqEventPublisher::bind(ZmqPublisherConfig::new(endpoint)).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    field: "endpoint",
                    ..
                }
            ),
            "{err}"
        );
    }
    let taken = publisher(ZmqPublisherConfig::new("tcp://127.0.0.1:0"));
    let again = format!("tcp://{}", taken.local_addr());
    let err = ZmqEventPublisher::bind(ZmqPublisherConfig::new(again)).unwrap_err();
    assert!(matches!(err, Error::Io(_)), "{err}");
    let mut zero = ZmqPublisherConfig::new("tcp://127.0.0.1:0");
    zero.queue_batches = 0;
    let err = ZmqEventPublisher::bind(zero).unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidConfig {
            field: "queue_batches",
            ..
        }
    ));
}

/// A port nothing listens on now (bound, read, closed).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[test]
fn a_connecting_publisher_reaches_a_subscriber_that_binds_late_and_reconnects() {
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let mut config = ZmqPublisherConfig::new(&endpoint);
    config.reconnect_min_ms = 5;
    config.reconnect_max_ms = 20;
    // vLLM's rule: no wildcard host, so the publisher connects.
    assert_eq!(config.pub_mode(), PubMode::Connect);
    let mut p = ZmqEventPublisher::start(config).unwrap();
    assert_eq!(p.mode(), PubMode::Connect);
    assert_eq!(p.local_addr().port(), port);
    // Nobody listens yet: the attempts fail on the publisher's thread, not here.
    let start = Instant::now();
    while p.stats().connect_failures < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "{:?}", p.stats());
        std::thread::sleep(Duration::from_millis(2));
    }
    let steps = steps();
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let mut sub = Zmtp::accept(&listener, "SUB", 1);
    assert_eq!(sub.peer_type, "PUB");
    sub.subscribe(b"", true);
    wait_subscribers(&p, 1);
    for (i, events) in steps.iter().enumerate() {
        let ts = 1_700_000_000.0 + i as f64;
        assert_eq!(p.publish(ts, events).unwrap(), Some(i as u64));
        let m = sub.recv();
        assert_eq!(m.len(), 3, "topic, sequence number, payload");
        assert!(m[0].is_empty());
        assert_eq!(m[1], (i as u64).to_be_bytes());
        assert_eq!(m[2], encode(ts, events));
    }
    // The subscriber goes away and comes back: the publisher dials again, and the
    // numbers go on.
    drop(sub);
    wait_subscribers(&p, 0);
    let mut sub = Zmtp::accept(&listener, "SUB", 0);
    sub.subscribe(b"", false);
    wait_subscribers(&p, 1);
    let n = steps.len() as u64;
    assert_eq!(p.publish(9.0, &[PrefixEvent::AllCleared]).unwrap(), Some(n));
    assert_eq!(sub.recv()[1], n.to_be_bytes());
}

#[test]
fn data_parallel_rank_offsets_both_ports_and_stamps_the_batches() {
    assert_eq!(
        offset_endpoint_port("tcp://*:5557", 2).unwrap(),
        "tcp://*:5559"
    );
    assert_eq!(
        offset_endpoint_port("tcp://10.0.0.7:5557", 2).unwrap(),
        "tcp://10.0.0.7:5559"
    );
    assert_eq!(
        offset_endpoint_port("tcp://[::1]:5557", 2).unwrap(),
        "tcp://[::1]:5559"
    );
    assert_eq!(
        offset_endpoint_port("tcp://*:5557", 0).unwrap(),
        "tcp://*:5557"
    );
    assert_eq!(offset_endpoint_port("tcp://*:0", 2).unwrap(), "tcp://*:0");
    assert!(matches!(
        offset_endpoint_port("tcp://*:65535", 2),
        Err(Error::InvalidConfig {
            field: "endpoint",
            ..
        })
    ));
    assert_eq!(PubMode::for_endpoint("tcp://*:5557"), PubMode::Bind);
    assert_eq!(PubMode::for_endpoint("tcp://[::]:5557"), PubMode::Bind);
    assert_eq!(PubMode::for_endpoint("tcp://router:5557"), PubMode::Connect);

    // Rank 2 of a bound publisher: both sockets listen two ports up.
    let (pub_port, replay_port) = (free_port(), free_port());
    let config = ZmqPublisherConfig::new(format!("tcp://127.0.0.1:{}", pub_port - 2))
        .replay(format!("tcp://127.0.0.1:{}", replay_port - 2))
        .data_parallel_rank(2);
    let mut p = ZmqEventPublisher::bind(config).unwrap();
    assert_eq!(p.local_addr().port(), pub_port);
    assert_eq!(p.replay_addr().unwrap().port(), replay_port);
    let mut sub = Zmtp::connect(p.local_addr(), "SUB", 1);
    sub.subscribe(b"", true);
    wait_subscribers(&p, 1);
    p.publish(1.0, &[PrefixEvent::AllCleared]).unwrap();
    let m = sub.recv();
    assert_eq!(m[1], 0u64.to_be_bytes());
    let mut rank2 = Vec::new();
    VllmEventEncoder::new()
        .data_parallel_rank(Some(2))
        .encode_batch(1.0, &[PrefixEvent::AllCleared], &mut rank2)
        .unwrap();
    assert_eq!(m[2], rank2, "the batch says rank 2");
}
