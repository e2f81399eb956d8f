//! Probes, timeouts and shutdown over real sockets: `/live`, `/ready` and `health_path`
//! follow capacity and draining only; slow clients are cut off; SIGTERM drains.

use std::time::Duration;

use sluice_tests::{get, MockUpstream, Pending, Sluice};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

fn config(upstream: &str, max_in_flight: u32, header_timeout: &str, grace: &str) -> String {
    format!(
        r#"
[gateway]
listen = "127.0.0.1:0"
max_in_flight = {max_in_flight}
health_path = "/health"
header_timeout = "{header_timeout}"
shutdown_grace = "{grace}"
overload_retry_after = {{ min = "2s", max = "5s" }}

[admin]
listen = "127.0.0.1:0"

[upstreams.app]
url = "{upstream}"

[[routes]]
name = "api"
path = "/"
upstream = "app"
"#
    )
}

/// Connects, sends `bytes` and waits (up to 5 s) for the gateway to close the connection:
/// how long that took after the bytes were sent, and what the gateway sent meanwhile.
async fn closed_after_sending(
    addr: std::net::SocketAddr,
    bytes: &[u8],
    what: &str,
) -> (Duration, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    let closed = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    closed.unwrap_or_else(|| panic!("{what} was still open after 5 s"))
}

/// Reads until the peer closes; returns how long that took, or None after `limit`.
async fn time_until_closed(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    read_until_closed(stream, limit).await.map(|(took, _)| took)
}

/// Reads until the peer closes: how long that took and what it sent, or None after `limit`.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> Option<(Duration, Vec<u8>)> {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(start + limit, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some((start.elapsed(), got)),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// The types of the HTTP/2 frames in `bytes` (a server's side of a connection).
fn h2_frame_types(mut bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    while bytes.len() >= 9 {
        let len = usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
        types.push(bytes[3]);
        bytes = &bytes[(9 + len).min(bytes.len())..];
    }
    types
}

#[tokio::test]
async fn client_sending_half_a_head_is_disconnected_after_header_timeout() {
    let up = MockUpstream::start().await;
    let gw = Sluice::start(&config(&up.url(), 8, "500ms", "5s"));

    let half = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    let (closed, _) = closed_after_sending(gw.main, half, "a half-sent head").await;
    // At the timeout, not a goodbye's second later (HTTP/1.1 has none to wait for).
    assert!(
        (Duration::from_millis(400)..Duration::from_millis(1200)).contains(&closed),
        "closed after {closed:?}"
    );

    let (closed, _) = closed_after_sending(gw.main, b"", "a silent connection").await;
    assert!(
        closed < Duration::from_millis(1200),
        "closed after {closed:?}"
    );
    assert_eq!(up.requests(), 0);
}

/// The header timeout counts from the end of the last response on a kept connection, not
/// from its start, and never while a request is in flight; it covers HTTP/2 too.
#[tokio::test]
async fn header_timeout_counts_idle_time_only_on_both_protocols() {
    let up = MockUpstream::start().await;
    let gw = Sluice::start(&config(&up.url(), 8, "500ms", "5s"));

    // A request held upstream for twice the timeout is answered on its connection.
    let main = gw.main;
    let held = tokio::spawn(async move { get(main, "/hold", &[]).await });
    up.wait_holding(1).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    up.release(1);
    assert_eq!(held.await.unwrap().status, 200);

    // After a full exchange, half of the next head: closed a timeout after the response.
    let mut kept = TcpStream::connect(gw.main).await.unwrap();
    kept.write_all(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = kept.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    kept.write_all(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .await
        .unwrap();
    let closed = time_until_closed(&mut kept, Duration::from_secs(5)).await;
    let closed = closed.expect("a kept connection with half a head was still open after 5 s");
    assert!(
        closed < Duration::from_millis(450),
        "closed {closed:?} after the half head: the timeout did not count from the response"
    );

    // HTTP/2 with prior knowledge: the preface and settings, then no request.
    // It is told so with GOAWAY (frame type 7) before the connection closes.
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
    let (closed, sent) = closed_after_sending(gw.main, preface, "a silent HTTP/2 connection").await;
    assert!(
        closed >= Duration::from_millis(400),
        "closed too early: {closed:?}"
    );
    let frames = h2_frame_types(&sent);
    assert!(
        frames.contains(&7),
        "no GOAWAY before closing: frame types {frames:?}"
    );
    assert_eq!(up.requests(), 2);
}

/// An HTTP/2 stream in flight keeps its connection open past the header timeout; once the
/// connection is idle again, it is closed with GOAWAY a timeout later.
#[tokio::test]
async fn an_http2_stream_in_flight_holds_off_the_header_timeout() {
    use bytes::Bytes;
    use http_body_util::Full;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let up = MockUpstream::start().await;
    let gw = Sluice::start(&config(&up.url(), 8, "500ms", "5s"));
    let stream = TcpStream::connect(gw.main).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let req = http::Request::get("http://h2.example.com/hold")
        .body(Full::<Bytes>::default())
        .unwrap();
    // A clone sends, so that the client keeps the connection (it closes when no sender is left).
    let mut clone = sender.clone();
    let reply = tokio::spawn(async move { clone.send_request(req).await.map(|r| r.status()) });
    up.wait_holding(1).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    up.release(1);
    assert_eq!(reply.await.unwrap().unwrap(), 200);
    let started = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(5), conn).await;
    assert!(
        ended.is_ok(),
        "the idle HTTP/2 connection was still open after 5 s"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "closed {:?} after the response",
        started.elapsed()
    );
    drop(sender);
}

#[tokio::test]
async fn live_is_always_200_and_ready_follows_capacity() {
    let up = MockUpstream::start().await;
    let gw = Sluice::start(&config(&up.url(), 2, "10s", "5s"));
    assert_eq!(get(gw.admin, "/live", &[]).await.status, 200);
    assert_eq!(get(gw.admin, "/ready", &[]).await.status, 200);
    assert_eq!(get(gw.main, "/health", &[]).await.status, 200);

    let main = gw.main;
    let held: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { get(main, "/hold", &[]).await }))
        .collect();
    up.wait_holding(2).await;

    assert_eq!(
        get(gw.admin, "/ready", &[]).await.status,
        503,
        "full gateway must fail readiness"
    );
    assert_eq!(get(gw.main, "/health", &[]).await.status, 503);
    assert_eq!(
        get(gw.admin, "/live", &[]).await.status,
        200,
        "overload must never fail liveness"
    );
    let refused = get(gw.main, "/echo", &[]).await;
    assert_eq!(refused.status, 503);
    let retry: u64 = refused
        .header("retry-after")
        .parse()
        .expect("Retry-After in seconds");
    assert!((2..=5).contains(&retry), "Retry-After {retry} outside 2..5");
    assert_eq!(refused.json()["policy"], "server-capacity");

    up.release(2);
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    // The slot is released when the response body ends; the probe may race the release.
    let deadline = Instant::now() + Duration::from_secs(5);
    while get(gw.admin, "/ready", &[]).await.status != 200 {
        assert!(Instant::now() < deadline, "readiness did not return to 200");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(get(gw.main, "/health", &[]).await.status, 200);
}

#[tokio::test]
async fn sigterm_fails_readiness_stops_accepting_and_finishes_in_flight_work() {
    let up = MockUpstream::start().await;
    let mut gw = Sluice::start(&config(&up.url(), 8, "10s", "20s"));
    let main = gw.main;
    let in_flight = tokio::spawn(async move { get(main, "/hold", &[]).await });
    up.wait_holding(1).await;

    gw.terminate();
    gw.wait_draining().await;
    assert_eq!(
        get(gw.admin, "/ready", &[]).await.status,
        503,
        "draining must fail readiness"
    );
    assert!(
        TcpStream::connect(gw.main).await.is_err(),
        "the main listener still accepts while draining"
    );

    up.release(1);
    let reply = in_flight.await.unwrap();
    assert_eq!(
        (reply.status.as_u16(), reply.text().as_str()),
        (200, "released\n")
    );
    let status = gw.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0));
}

#[tokio::test]
async fn shutdown_grace_bounds_the_drain() {
    let up = MockUpstream::start().await;
    let mut gw = Sluice::start(&config(&up.url(), 8, "10s", "500ms"));
    let main = gw.main;
    let stuck = tokio::spawn(async move { sluice_tests::client::try_get(main, "/hold").await });
    up.wait_holding(1).await;
    gw.terminate();
    let status = gw.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0));
    assert!(
        stuck.await.unwrap().is_err(),
        "the stuck request cannot have completed"
    );
    up.release(1);
}

/// A second SIGTERM (or SIGINT) during the drain ends the grace at once: an operator who
/// asked twice should not wait out a long grace (or reach for SIGKILL, which would leave the
/// shared store's leases behind). What still runs is cut as at the grace's end.
#[tokio::test]
async fn a_second_stop_signal_ends_the_grace_at_once() {
    let up = MockUpstream::start().await;
    let mut gw = Sluice::start(&config(&up.url(), 8, "10s", "60s"));
    let main = gw.main;
    let stuck = tokio::spawn(async move { sluice_tests::client::try_get(main, "/hold").await });
    up.wait_holding(1).await;
    gw.terminate();
    gw.wait_draining().await;
    gw.signal("INT");
    let status = gw.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0));
    assert!(
        stuck.await.unwrap().is_err(),
        "the held request was cut, not answered"
    );
    assert!(gw.logs().iter().any(|v| v["message"]
        .as_str()
        .is_some_and(|m| m.starts_with("asked again to stop"))));
    up.release(1);
}

/// Held requests are answered at a second stop signal, as at a drain whose grace ends before
/// their hold: 503 with `Retry-After`, rather than cut without an answer (review).
#[tokio::test]
async fn a_second_stop_signal_answers_held_requests_503() {
    let up = MockUpstream::start().await;
    // One request every 10 s from this address, held up to 25 s; a grace of 60 s.
    let limits = "[[limits]]\nname = \"slow\"\nby = \"ip\"\nquota = 1\nwindow = \"10s\"\nmode = \"delay\"\nmax_delay = \"25s\"\n";
    let cfg = format!("{}{limits}", config(&up.url(), 8, "10s", "60s"));
    // One serving thread: requests are decided in the order they were sent.
    let mut gw = Sluice::start_with_args(&cfg, &["--threads", "1"]);
    // Admitted, and kept by its upstream: the second signal cuts it.
    let in_flight = Pending::send(gw.main, "/hold", "k").await;
    up.wait_holding(1).await;
    // Held about 10 s (within the grace, so the drain alone would wait for it).
    let held = Pending::send(gw.main, "/a", "k").await;
    // And one held about 20 s.
    let second = Pending::send(gw.main, "/a", "k").await;
    // Both are held: a fourth would wait about 30 s, past max_delay.
    assert_eq!(get(gw.main, "/a", &[]).await.status, 429);
    gw.terminate();
    gw.wait_draining().await;
    gw.signal("TERM");
    for pending in [held, second] {
        let answer = pending.answer().await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("\r\nretry-after: "),
            "{answer}"
        );
    }
    assert_eq!(gw.wait_exit(Duration::from_secs(10)).await.code(), Some(0));
    drop(in_flight);
    // Their lines say what they got, a whole 503, not that the shutdown cut them as it cut
    // the request in flight (review).
    let lines = gw.access_logs();
    let answered: Vec<_> = lines.iter().filter(|v| v["status"] == 503).collect();
    assert_eq!(answered.len(), 2, "{lines:?}");
    for line in answered {
        assert!(line.get("cut").is_none(), "{line}");
    }
    let cut = lines.iter().find(|v| v["path"] == "/hold").expect("a line");
    assert_eq!(cut["cut"], "shutdown", "{cut}");
    up.release(1);
}

/// `drain_delay`: at SIGTERM readiness fails at once while new connections are still accepted
/// and served, so that a load balancer sees a 503 from its health check before the port
/// closes; then the drain starts as without it, and new connections are refused.
#[tokio::test]
async fn drain_delay_fails_readiness_while_still_serving() {
    let up = MockUpstream::start().await;
    let cfg = config(&up.url(), 8, "10s", "5s").replace(
        "shutdown_grace = \"5s\"",
        "shutdown_grace = \"5s\"\ndrain_delay = \"2s\"",
    );
    let mut gw = Sluice::start_with_args(&cfg, &["--threads", "2"]);
    assert_eq!(get(gw.admin, "/ready", &[]).await.status, 200);
    gw.terminate();
    let stopping = gw
        .wait_log("the stopping line", |v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("stopping: readiness fails"))
        })
        .await;
    assert_eq!(stopping["delay_ms"], 2000, "{stopping}");
    // Timed by the log lines' own clock, the machine's, not by when the test read them.
    let started = logged_at(&stopping);
    assert_eq!(get(gw.admin, "/ready", &[]).await.status, 503);
    assert_eq!(get(gw.main, "/health", &[]).await.status, 503);
    // New connections, on both serving threads, are served.
    for _ in 0..4 {
        assert_eq!(get(gw.main, "/echo", &[]).await.status, 200);
    }
    let checked = seconds_of_day(std::time::SystemTime::now());
    let draining = gw
        .wait_log("the draining line", |v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("draining"))
        })
        .await;
    let drained = logged_at(&draining);
    // Served during the delay, not after it.
    assert!(
        checked < drained,
        "the checks came late: {checked}, draining at {drained}"
    );
    assert!(
        drained - started >= 1.99,
        "draining {} s after stopping: {draining}",
        drained - started
    );
    assert_eq!(gw.wait_exit(Duration::from_secs(10)).await.code(), Some(0));
    assert!(TcpStream::connect(gw.main).await.is_err());
}

/// When a log line was written, in seconds since the day's start (UTC; a test spans no
/// midnight it cares about).
fn logged_at(line: &serde_json::Value) -> f64 {
    let ts = line["timestamp"].as_str().expect("a timestamp");
    // 2026-12-03T03:46:19.618086Z
    let time = ts.split('T').nth(1).expect("a time").trim_end_matches('Z');
    let mut parts = time.split(':').map(|p| p.parse::<f64>().expect("a number"));
    let (h, m, s) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    h * 3600.0 + m * 60.0 + s
}

fn seconds_of_day(t: std::time::SystemTime) -> f64 {
    let since = t.duration_since(std::time::UNIX_EPOCH).unwrap();
    (since.as_secs() % 86_400) as f64 + f64::from(since.subsec_nanos()) / 1e9
}

/// A second stop signal during `drain_delay` ends it and the grace at once, as it ends the
/// grace during a drain.
#[tokio::test]
async fn a_second_stop_signal_ends_the_drain_delay() {
    let up = MockUpstream::start().await;
    let cfg = config(&up.url(), 8, "10s", "30s").replace(
        "shutdown_grace = \"30s\"",
        "shutdown_grace = \"30s\"\ndrain_delay = \"30s\"",
    );
    let mut gw = Sluice::start(&cfg);
    gw.terminate();
    gw.wait_log("the stopping line", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("stopping: readiness fails"))
    })
    .await;
    gw.signal("INT");
    assert_eq!(gw.wait_exit(Duration::from_secs(5)).await.code(), Some(0));
}

/// SIGHUP (nginx's and HAProxy's reload) is logged and ignored: its default action would end
/// the process and cut every request in flight.
#[tokio::test]
async fn sighup_is_logged_and_ignored() {
    let up = MockUpstream::start().await;
    let gw = Sluice::start(&config(&up.url(), 8, "10s", "5s"));
    let main = gw.main;
    let held = tokio::spawn(async move { get(main, "/hold", &[]).await });
    up.wait_holding(1).await;
    gw.signal("HUP");
    gw.wait_log("the ignored SIGHUP", |v| v["signal"] == "SIGHUP")
        .await;
    up.release(1);
    assert_eq!(held.await.unwrap().status, 200);
    assert_eq!(get(gw.main, "/after", &[]).await.status, 200);
}

/// A request a `delay` limit holds past the end of the shutdown grace is answered 503 (with
/// `Retry-After`) when draining starts, rather than cut without an answer when the process
/// exits; one whose hold ends within the grace is forwarded.
#[tokio::test]
async fn held_requests_that_would_outlast_the_grace_get_503_when_draining_starts() {
    let up = MockUpstream::start().await;
    // One request every 4 s from this address, held up to 10 s; a grace of 6 s.
    let limits = "[[limits]]\nname = \"slow\"\nby = \"ip\"\nquota = 1\nwindow = \"4s\"\nmode = \"delay\"\nmax_delay = \"10s\"\n";
    // One serving thread: requests are decided in the order they were sent.
    let cfg = format!("{}{limits}", config(&up.url(), 8, "10s", "6s"));
    let mut gw = Sluice::start_with_args(&cfg, &["--threads", "1"]);
    assert_eq!(get(gw.main, "/a", &[]).await.status, 200);
    // Two more, held about 4 and 8 s.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(Pending::send(gw.main, "/a", "k").await);
    }
    // Both are held: a fourth would wait about 12 s, past max_delay.
    assert_eq!(get(gw.main, "/a", &[]).await.status, 429);
    gw.terminate();
    // The draining line counts them (held requests take no place in flight).
    let draining = gw
        .wait_log("the draining line", |v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("draining"))
        })
        .await;
    assert_eq!(draining["held"], 2, "{draining}");
    let mut answers = Vec::new();
    for pending in held {
        answers.push(pending.answer().await);
    }
    answers.sort();
    assert!(answers[0].starts_with("HTTP/1.1 200"), "{}", answers[0]);
    let late = &answers[1];
    assert!(late.starts_with("HTTP/1.1 503"), "{late}");
    assert!(
        late.to_ascii_lowercase().contains("\r\nretry-after: "),
        "{late}"
    );
    // Said as it is: this instance is going away, not full (review: "The service is at
    // capacity", logged OVERLOADED, with nothing in flight).
    assert!(late.contains("\"policy\":\"server-draining\""), "{late}");
    assert!(late.contains("shutting-down\",\"title\""), "{late}");
    let line = gw
        .wait_log("the held request's line", |v| v["status"] == 503)
        .await;
    assert_eq!(line["decision"], "DRAINING", "{line}");
    assert_eq!(line["policy"], "server-draining", "{line}");
    assert_eq!(gw.wait_exit(Duration::from_secs(15)).await.code(), Some(0));
}

/// A client that leaves in the middle of a response body (an HTTP/1.1 connection closed, an
/// HTTP/2 stream reset) is logged with the status it was sent, the bytes handed over, and
/// `cut = "client"`; a body taken whole, or one never begun (`HEAD`), with no `cut`. Before,
/// a download abandoned halfway read as a whole `200` (review).
#[tokio::test]
async fn the_access_log_marks_a_response_its_client_left_mid_body() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Empty};
    const SIZE: usize = 8 << 20;
    let up = MockUpstream::start().await;
    let gw = Sluice::start(&config(&up.url(), 8, "10s", "1s"));
    let path = format!("/download?bytes={SIZE}");
    let line_for = |id: &'static str| {
        let gw = &gw;
        async move {
            gw.wait_log(id, |v| v["target"] == "access" && v["request_id"] == id)
                .await
        }
    };
    // HTTP/1.1: the head and a little of the body, then the connection closes.
    let mut conn = TcpStream::connect(gw.main).await.unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nhost: a\r\nx-request-id: h1-left\r\n\r\n");
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut got = vec![0u8; 64 * 1024];
    let n = conn.read(&mut got).await.unwrap();
    assert!(String::from_utf8_lossy(&got[..n]).starts_with("HTTP/1.1 200"));
    drop(conn);
    let left = line_for("h1-left").await;
    assert_eq!(left["status"], 200, "{left}");
    assert_eq!(left["cut"], "client", "{left}");
    assert!(left["bytes"].as_u64().unwrap() < SIZE as u64, "{left}");
    // HTTP/2: one frame of the body, then the stream is reset (the body dropped).
    let mut sender = sluice_tests::client::h2_sender::<Empty<Bytes>>(gw.main).await;
    let req = http::Request::get(format!("http://a{path}"))
        .header("x-request-id", "h2-left")
        .body(Empty::new())
        .unwrap();
    let res = sender.send_request(req).await.unwrap();
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    body.frame().await.expect("a frame").unwrap();
    drop(body);
    let left = line_for("h2-left").await;
    assert_eq!(left["status"], 200, "{left}");
    assert_eq!(left["cut"], "client", "{left}");
    assert!(left["bytes"].as_u64().unwrap() < SIZE as u64, "{left}");
    // Whole, and never begun: no cut.
    for (method, id) in [("GET", "whole"), ("HEAD", "head")] {
        let mut conn = TcpStream::connect(gw.main).await.unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: a\r\nx-request-id: {id}\r\nconnection: close\r\n\r\n"
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        let mut reply = Vec::new();
        conn.read_to_end(&mut reply).await.unwrap();
        assert!(reply.starts_with(b"HTTP/1.1 200"), "{method}");
        let line = line_for(id).await;
        assert!(line.get("cut").is_none(), "{line}");
        let bytes = if method == "GET" { SIZE as u64 } else { 0 };
        assert_eq!(line["bytes"], bytes, "{line}");
    }
}

/// An upstream on a loopback port that answers every request with `head`, then waits
/// `wait` and sends `rest` (reading only the request's head).
async fn scripted_upstream(head: &'static [u8], wait: Duration, rest: &'static [u8]) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(n @ 1..) => got.extend_from_slice(&buf[..n]),
                        _ => return,
                    }
                }
                let _ = s.write_all(head).await;
                tokio::time::sleep(wait).await;
                let _ = s.write_all(rest).await;
                let _ = s.read(&mut buf).await;
            });
        }
    });
    url
}

/// A client that leaves after the head of a response whose body has not begun (a long poll
/// given up) is logged `cut = "client"` too; a whole answer that ends with trailer fields,
/// through hyper's client (a request with a body), is not (review: after its trailers the
/// body's end went unsaid, and the line said `cut`).
#[tokio::test]
async fn the_access_log_marks_a_long_poll_left_and_not_a_body_ended_by_trailers() {
    let poll = scripted_upstream(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        Duration::from_secs(30),
        b"",
    )
    .await;
    let gw = Sluice::start(&config(&poll, 8, "10s", "1s"));
    let mut conn = TcpStream::connect(gw.main).await.unwrap();
    let head = "GET /poll HTTP/1.1\r\nhost: a\r\nx-request-id: left-early\r\n\r\n";
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut got = vec![0u8; 4096];
    let n = conn.read(&mut got).await.unwrap();
    assert!(String::from_utf8_lossy(&got[..n]).starts_with("HTTP/1.1 200"));
    drop(conn);
    let left = gw
        .wait_log("the long poll's line", |v| v["request_id"] == "left-early")
        .await;
    assert_eq!(
        (&left["status"], &left["bytes"]),
        (&200.into(), &0.into()),
        "{left}"
    );
    assert_eq!(left["cut"], "client", "{left}");

    let trailers = scripted_upstream(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n5\r\nhello\r\n0\r\nx-sum: 1\r\n\r\n",
        Duration::ZERO,
        b"",
    )
    .await;
    let gw = Sluice::start(&config(&trailers, 8, "10s", "1s"));
    for (te, id) in [("te: trailers\r\n", "with-te"), ("", "without-te")] {
        let mut conn = TcpStream::connect(gw.main).await.unwrap();
        let request = format!("POST /up HTTP/1.1\r\nhost: a\r\n{te}x-request-id: {id}\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi");
        conn.write_all(request.as_bytes()).await.unwrap();
        let mut reply = Vec::new();
        conn.read_to_end(&mut reply).await.unwrap();
        let reply = String::from_utf8_lossy(&reply);
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(reply.contains("5\r\nhello\r\n0\r\n"), "{reply}");
        let line = gw.wait_log(id, |v| v["request_id"] == id).await;
        assert!(line.get("cut").is_none(), "{line}");
    }
}

/// The access log tells a request whose client left while its upstream had not answered
/// (`499`, with the time the upstream had taken so far) from one cut because the shutdown
/// grace ran out (`499` too, nothing having been answered, with `cut = "shutdown"`).
#[tokio::test]
async fn the_access_log_tells_a_client_gone_from_a_request_cut_at_shutdown() {
    let up = MockUpstream::start().await;
    let mut gw = Sluice::start_with_args(&config(&up.url(), 8, "10s", "1s"), &["--threads", "1"]);
    sluice_tests::send_and_leave(gw.main, "/hold", "k", Duration::from_millis(300)).await;
    let left = gw
        .wait_log("the request whose client left", |v| v["target"] == "access")
        .await;
    assert_eq!(left["status"], 499, "{left}");
    assert!(left.get("cut").is_none(), "{left}");
    let waited = left["upstream_ms"].as_f64().unwrap_or_default();
    assert!(
        waited >= 250.0,
        "the upstream's wait until the client left: {left}"
    );
    let cut = Pending::send(gw.main, "/hold", "k").await;
    up.wait_holding(2).await;
    gw.terminate();
    assert_eq!(gw.wait_exit(Duration::from_secs(10)).await.code(), Some(0));
    drop(cut);
    let lines = gw.access_logs();
    let cut = lines.last().expect("the cut request's line");
    assert_eq!(cut["status"], 499, "{cut}");
    assert_eq!(cut["cut"], "shutdown", "{cut}");
    assert!(
        cut["upstream_ms"].as_f64().unwrap_or_default() >= 900.0,
        "{cut}"
    );
    up.release(2);
}

/// `max_connections`: at the cap the gateway stops accepting, so a new connection waits in the
/// listen backlog until an open one ends (here idle ones, closed by their header timeout), and
/// the admin listener, which is not counted, still answers its probes.
#[tokio::test]
async fn at_max_connections_new_connections_wait_until_one_ends() {
    let up = MockUpstream::start().await;
    let cfg = config(&up.url(), 64, "700ms", "5s").replace(
        "max_in_flight = 64",
        "max_in_flight = 64\nmax_connections = 2",
    );
    let gw = Sluice::start_with_args(&cfg, &["--threads", "1"]);
    // Two idle connections take the two places (a request on each proves they were accepted).
    let mut idle = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(gw.main).await.unwrap();
        s.write_all(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        idle.push(s);
    }
    let started = Instant::now();
    // The admin listener is not counted: its probes still answer, and readiness holds (the
    // connections open are served; only new ones wait).
    assert_eq!(get(gw.admin, "/ready", &[]).await.status, 200);
    let reply = get(gw.main, "/echo", &[]).await;
    let waited = started.elapsed();
    assert_eq!(reply.status, 200);
    assert!(
        waited >= Duration::from_millis(500),
        "served after {waited:?}: before an idle connection's 700 ms header timeout"
    );
    let warning = gw
        .wait_log("the cap", |v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("max_connections reached"))
        })
        .await;
    assert_eq!(warning["max_connections"], 2);
    drop(idle);
}

/// `max_connections_per_ip`: one client address cannot take every place. Its next connection
/// is closed at once, while another address is served (and readiness does not fail).
#[tokio::test]
async fn one_client_address_has_at_most_its_connections() {
    let up = MockUpstream::start().await;
    let cfg = config(&up.url(), 64, "10s", "5s").replace(
        "max_in_flight = 64",
        "max_in_flight = 64\nmax_connections_per_ip = 2",
    );
    let gw = Sluice::start_with_args(&cfg, &["--threads", "1"]);
    let from = |ip: &str| {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
        socket.connect(gw.main)
    };
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = from("127.0.0.1").await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(s);
    }
    // A third from the same address: closed without an answer.
    let mut third = from("127.0.0.1").await.unwrap();
    let _ = third
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    let mut buf = [0u8; 256];
    let read = tokio::time::timeout(Duration::from_secs(5), third.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    // Another address is served, and the gateway is ready.
    let mut other = from("127.0.0.2").await.unwrap();
    other
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let n = other.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    assert_eq!(get(gw.admin, "/ready", &[]).await.status, 200);
    let warning = gw
        .wait_log("the per-address cap", |v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("max_connections_per_ip reached"))
        })
        .await;
    assert_eq!(warning["client"], "127.0.0.1");
    // One of its connections ends: it has a place again.
    drop(held.pop());
    let started = Instant::now();
    loop {
        let mut again = from("127.0.0.1").await.unwrap();
        let _ = again
            .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            .await;
        if let Ok(Ok(n @ 1..)) =
            tokio::time::timeout(Duration::from_secs(5), again.read(&mut buf)).await
        {
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no place came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The soft and hard "Max open files" limits of process `pid`.
fn open_files(pid: u32) -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let mut fields = line["Max open files".len()..].split_whitespace();
    let soft = fields.next()?.parse().ok()?;
    let hard = fields.next()?.parse().ok()?;
    Some((soft, hard))
}

/// `sluice run` raises its soft open-files limit to the hard one (at most 2^20), as HAProxy and
/// Go programs do, so the default `max_connections` is not capped by a low soft limit.
#[test]
fn run_raises_the_soft_open_files_limit_to_the_hard_one() {
    let (_, hard) = open_files(std::process::id()).expect("this process's limits");
    assert!(
        hard > 256,
        "the test needs a hard limit above 256, not {hard}"
    );
    let file = sluice_tests::process::TempFile::new(
        "toml",
        "[gateway]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n",
    );
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -Sn 256 && exec \"$0\" run --config \"$1\"")
        .arg(sluice_tests::process::binary())
        .arg(&file.0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start sluice under sh");
    let deadline = Instant::now() + Duration::from_secs(10);
    let seen = loop {
        let limits = open_files(child.id());
        if limits.is_some_and(|(soft, _)| soft != 256) || Instant::now() > deadline {
            break limits;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(seen, Some((hard.min(1 << 20), hard)));
}

/// A download over HTTP/2 under way at shutdown arrives whole: when h2 ends the connection
/// after the last stream, the client's window updates are still arriving, and closing the
/// socket outright would reset it and throw away what it still had to send (review: curl
/// failed with "connection reset" megabytes short). The gateway closes it lingering. The
/// client here opens a large window, reads its socket at about 2 MB/s and gives the window
/// back as it reads, as curl with `--limit-rate` does, and answers pings.
#[tokio::test]
async fn a_download_under_way_at_shutdown_arrives_whole() {
    const SIZE: u32 = 8 << 20;
    const WINDOW: u32 = 16 << 20;
    let up = MockUpstream::start().await;
    let mut gw = Sluice::start(&config(&up.url(), 8, "30s", "30s"));
    let mut s = TcpStream::connect(gw.main).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    // SETTINGS: INITIAL_WINDOW_SIZE (4) of 16 MiB; then its connection-wide window as large.
    out.extend_from_slice(&[0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 4]);
    out.extend_from_slice(&WINDOW.to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 4, 1, 0, 0, 0, 0]); // the server's SETTINGS, acked ahead
    out.extend_from_slice(&window_update(WINDOW - 65_535));
    out.extend_from_slice(&h2_get(&format!("/download?bytes={SIZE}")));
    s.write_all(&out).await.unwrap();
    let (mut frames, mut data, mut ended, mut terminated) = (Vec::new(), 0usize, false, false);
    let mut buf = vec![0u8; 64 * 1024];
    let start = Instant::now();
    let outcome = loop {
        let read = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await;
        let n = match read {
            Err(_) => break "no byte for 20 s".to_owned(),
            Ok(Ok(0)) => break "closed".to_owned(),
            Ok(Err(e)) => break format!("failed: {e}"),
            Ok(Ok(n)) => n,
        };
        frames.extend_from_slice(&buf[..n]);
        // Whole frames: DATA (0) on stream 1 counts, END_STREAM (1) ends it.
        while frames.len() >= 9 {
            let len =
                usize::from(frames[0]) << 16 | usize::from(frames[1]) << 8 | usize::from(frames[2]);
            if frames.len() < 9 + len {
                break;
            }
            if frames[3] == 0 {
                data += len;
                ended |= frames[4] & 1 == 1;
            }
            if frames[3] == 6 && frames[4] & 1 == 0 {
                // A PING (the goodbye's among them) is answered.
                let mut ack = vec![0, 0, 8, 6, 1, 0, 0, 0, 0];
                ack.extend_from_slice(&frames[9..17]);
                let _ = s.write_all(&ack).await;
            }
            frames.drain(..9 + len);
        }
        if !terminated && data > 0 {
            gw.terminate();
            terminated = true;
        }
        // The window back for what was read, as the client's reading goes on.
        let _ = s.write_all(&window_update(u32::try_from(n).unwrap())).await;
        let due = Duration::from_secs_f64(data as f64 / 2e6);
        tokio::time::sleep_until(start + due).await;
    };
    assert_eq!(
        (outcome.as_str(), data, ended),
        ("closed", SIZE as usize, true)
    );
    drop(s);
    let status = gw.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0));
}

/// An HTTP/2 `HEADERS` frame opening stream 1 with `GET path` for `h2.example.com`, ending the
/// stream: indexed `:method GET` and `:scheme http`, then literals for `:path` and
/// `:authority` (HPACK, RFC 7541 appendix A).
fn h2_get(path: &str) -> Vec<u8> {
    h2_get_on(1, path)
}

/// [`h2_get`] on stream `stream`.
fn h2_get_on(stream: u32, path: &str) -> Vec<u8> {
    let mut block = vec![0x82u8, 0x86, 0x44, u8::try_from(path.len()).unwrap()];
    block.extend_from_slice(path.as_bytes());
    block.extend_from_slice(&[0x41, 14]);
    block.extend_from_slice(b"h2.example.com");
    let len = u8::try_from(block.len()).unwrap();
    let mut frame = vec![0, 0, len, 1, 0x05]; // END_STREAM | END_HEADERS
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(&block);
    frame
}

/// Reads HTTP/2 frames from `s` into `frames` (type, flags, stream, payload) until `done`
/// says so; panics after 5 s.
async fn read_frames_until(
    s: &mut TcpStream,
    frames: &mut Vec<(u8, u8, u32, Vec<u8>)>,
    buf: &mut Vec<u8>,
    done: impl Fn(&[(u8, u8, u32, Vec<u8>)]) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut chunk = [0u8; 16 * 1024];
    while !done(frames) {
        let n = match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => n,
            other => panic!("reading frames: {other:?}; frames so far {frames:?}"),
        };
        buf.extend_from_slice(&chunk[..n]);
        while buf.len() >= 9 {
            let len = usize::from(buf[0]) << 16 | usize::from(buf[1]) << 8 | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
            frames.push((buf[3], buf[4], stream, buf[9..9 + len].to_vec()));
            buf.drain(..9 + len);
        }
    }
}

/// An HTTP/2 client that neither answers the shutdown's `PING` nor heeds its first `GOAWAY`
/// cannot keep the drain going with new streams to the grace's end (review): a stream it opens
/// at once is served (the `GOAWAY` may have crossed it), one it opens seconds later is answered
/// 503 `shutting-down` without reaching the upstream.
#[tokio::test]
async fn http2_streams_opened_long_after_goaway_are_turned_away() {
    let up = MockUpstream::start().await;
    let mut gw = Sluice::start_with_args(&config(&up.url(), 8, "30s", "30s"), &["--threads", "1"]);
    let mut s = TcpStream::connect(gw.main).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // SETTINGS
    out.extend_from_slice(&[0, 0, 0, 4, 1, 0, 0, 0, 0]); // the server's SETTINGS, acked ahead
    out.extend_from_slice(&h2_get_on(1, "/hold"));
    s.write_all(&out).await.unwrap();
    up.wait_holding(1).await;
    gw.terminate();
    let (mut frames, mut buf) = (Vec::new(), Vec::new());
    // The first GOAWAY (7) and its PING (6, not an ack), left unanswered.
    read_frames_until(&mut s, &mut frames, &mut buf, |f| {
        f.iter().any(|x| x.0 == 7) && f.iter().any(|x| x.0 == 6 && x.1 & 1 == 0)
    })
    .await;
    // At once: served.
    s.write_all(&h2_get_on(3, "/echo")).await.unwrap();
    let ended =
        |id: u32| move |f: &[(u8, u8, u32, Vec<u8>)]| f.iter().any(|x| x.2 == id && x.1 & 1 == 1);
    read_frames_until(&mut s, &mut frames, &mut buf, ended(3)).await;
    let body = |id: u32, frames: &[(u8, u8, u32, Vec<u8>)]| {
        let data = frames.iter().filter(|x| x.0 == 0 && x.2 == id);
        String::from_utf8_lossy(&data.flat_map(|x| x.3.clone()).collect::<Vec<_>>()).into_owned()
    };
    assert!(!body(3, &frames).contains("shutting-down"), "{frames:?}");
    assert_eq!(up.requests(), 2);
    // Past the time a client has to hear the GOAWAY: turned away, nothing forwarded.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    s.write_all(&h2_get_on(5, "/echo")).await.unwrap();
    read_frames_until(&mut s, &mut frames, &mut buf, ended(5)).await;
    let late = body(5, &frames);
    assert!(late.contains("shutting-down\",\"title\""), "{late}");
    assert!(late.contains("\"policy\":\"server-draining\""), "{late}");
    assert_eq!(up.requests(), 2);
    up.release(1);
    read_frames_until(&mut s, &mut frames, &mut buf, ended(1)).await;
    let line = gw
        .wait_log("the late stream's line", |v| v["status"] == 503)
        .await;
    assert_eq!(line["decision"], "DRAINING", "{line}");
    drop(s);
    assert_eq!(gw.wait_exit(Duration::from_secs(10)).await.code(), Some(0));
}

/// An HTTP/2 `WINDOW_UPDATE` for the whole connection.
fn window_update(increment: u32) -> Vec<u8> {
    let mut frame = vec![0, 0, 4, 8, 0, 0, 0, 0, 0];
    frame.extend_from_slice(&increment.to_be_bytes());
    frame
}

/// A grace that ends with only connections still closing (lingering) cut no request: the log
/// says every request finished, whichever serving thread the connection was on (review: a
/// worker thread's lingering connection made it say `requests=0` and false).
#[tokio::test]
async fn a_grace_that_cuts_only_closing_connections_cut_no_request() {
    let up = MockUpstream::start().await;
    let mut gw = Sluice::start_with_args(&config(&up.url(), 8, "30s", "2s"), &["--threads", "2"]);
    // An idle keep-alive connection takes one thread; the trickler goes to the other.
    let idle = TcpStream::connect(gw.main).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut trickler = TcpStream::connect(gw.main).await.unwrap();
    trickler
        .write_all(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = trickler.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    gw.terminate();
    // A byte a second after its answer keeps its lingering close going past the grace.
    let trickle = tokio::spawn(async move {
        for _ in 0..6 {
            if trickler.write_all(b"x").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let status = gw.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0));
    let stopped = gw.wait_log("stopped", |v| v["message"] == "stopped").await;
    assert_eq!(stopped["every_request_finished"], true);
    assert!(!gw.logs().iter().any(|v| v["message"]
        .as_str()
        .is_some_and(|m| m.contains("requests still running were cut"))));
    trickle.abort();
    drop(idle);
}

/// A connection holding part of a request head does not hold the drain: it is closed when the
/// drain starts, as an idle one is (review: it kept a 30 s grace to its end).
#[tokio::test]
async fn a_half_sent_head_does_not_hold_the_drain() {
    let up = MockUpstream::start().await;
    let mut gw = Sluice::start(&config(&up.url(), 8, "30s", "30s"));
    let mut half = TcpStream::connect(gw.main).await.unwrap();
    half.write_all(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .await
        .unwrap();
    // Its bytes are read before the drain starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    gw.terminate();
    let closed = time_until_closed(&mut half, Duration::from_secs(20)).await;
    let closed =
        closed.expect("the half-sent head's connection was still open 20 s into the grace");
    assert!(closed < Duration::from_secs(5), "closed after {closed:?}");
    let status = gw.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0));
    assert_eq!(up.requests(), 0);
}

/// An HTTP/2 client that never answers the goodbye's `PING` (gone, or not reading) does not
/// hold the drain to the grace's end once its requests are answered (review: the drain ran
/// its whole grace; h2 keeps a connection until the `PING` is answered).
#[tokio::test]
async fn an_http2_client_that_never_answers_the_goodbye_does_not_hold_the_drain() {
    let up = MockUpstream::start().await;
    let mut gw = Sluice::start(&config(&up.url(), 8, "30s", "30s"));
    let mut s = TcpStream::connect(gw.main).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // SETTINGS
    out.extend_from_slice(&[0, 0, 0, 4, 1, 0, 0, 0, 0]); // its ACK, sent ahead
    out.extend_from_slice(&h2_get("/hold"));
    s.write_all(&out).await.unwrap();
    up.wait_holding(1).await;
    gw.terminate();
    gw.wait_draining().await;
    up.release(1);
    // The client reads on but answers nothing, the goodbye's PING included.
    let (closed, sent) = read_until_closed(&mut s, Duration::from_secs(20))
        .await
        .expect("the connection was still open 20 s into a 30 s grace");
    let frames = h2_frame_types(&sent);
    assert!(
        frames.contains(&1) && frames.contains(&6) && frames.contains(&7),
        "the answer (HEADERS), the goodbye's PING and GOAWAY: frame types {frames:?}"
    );
    assert!(closed < Duration::from_secs(10), "closed after {closed:?}");
    let status = gw.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0));
}

/// `sluice run` with its log going to pipes this test holds: the gateway's addresses, read
/// from the `listening` line, and the child with its pipes (the log's reader is the test).
fn run_with_piped_log(
    config: &str,
) -> (
    std::process::Child,
    std::net::SocketAddr,
    std::net::SocketAddr,
    sluice_tests::process::TempFile,
) {
    use std::io::BufRead;
    let file = sluice_tests::process::TempFile::new("toml", config);
    let mut child = std::process::Command::new(sluice_tests::process::binary())
        .args(["--log-format", "json", "run", "--config"])
        .arg(&file.0)
        .env("SLUICE_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn sluice");
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let listening = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "sluice exited before listening"
        );
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        if v["message"] == "listening" {
            break v;
        }
    };
    child.stdout = Some(out.into_inner());
    let addr = |k: &str| listening[k].as_str().unwrap().parse().unwrap();
    (child, addr("main"), addr("admin"), file)
}

fn sigterm(child: &std::process::Child) {
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
}

/// Waits (up to `within`) for `child` to exit.
async fn exit_of(child: &mut std::process::Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running {within:?} later");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A log whose reader has gone (a collector that died, `| logger` killed) loses lines, not
/// requests: every request is answered, and SIGTERM drains and exits 0 (review: each
/// connection closed unanswered, `/ready` said 200, and SIGTERM exited 101 at once).
#[tokio::test]
async fn a_log_whose_reader_is_gone_loses_lines_not_requests() {
    let up = MockUpstream::start().await;
    let (mut child, main, admin, _file) = run_with_piped_log(&config(&up.url(), 8, "10s", "5s"));
    drop(child.stdout.take());
    drop(child.stderr.take());
    for i in 0..20 {
        assert_eq!(get(main, "/api/echo", &[]).await.status, 200, "request {i}");
    }
    assert_eq!(get(main, "/health", &[]).await.status, 200);
    assert_eq!(get(admin, "/ready", &[]).await.status, 200);
    let slow = tokio::spawn(async move { get(main, "/api/pause?ms=500", &[]).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    sigterm(&child);
    assert_eq!(
        slow.await.unwrap().status,
        200,
        "in flight at SIGTERM: drained"
    );
    assert_eq!(
        exit_of(&mut child, Duration::from_secs(10)).await.code(),
        Some(0)
    );
}

/// A log whose reader has stopped reading (a full pipe) does not stop the gateway either: lines
/// past what waits for it are dropped, requests are answered, and SIGTERM exits within its
/// grace (review: every thread, probes and SIGTERM included, waited on the pipe).
#[tokio::test]
async fn a_log_whose_reader_stopped_reading_loses_lines_not_requests() {
    let up = MockUpstream::start().await;
    let (mut child, main, admin, _file) = run_with_piped_log(&config(&up.url(), 8, "10s", "2s"));
    // An access line each: past a pipe's 64 KiB, and past the 8,192 lines that wait.
    const REQUESTS: usize = 10_000;
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            tokio::spawn(async move {
                for i in 0..REQUESTS / 8 {
                    assert_eq!(get(main, "/api/echo", &[]).await.status, 200, "{t}/{i}");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(get(admin, "/ready", &[]).await.status, 200);
    // Reading again: what was dropped is said as soon as the writer writes again.
    let out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let (mut access, mut dropped) = (0, 0);
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            access += usize::from(v["target"] == "access");
            dropped += v["dropped"].as_u64().unwrap_or(0) as usize;
        }
        (access, dropped)
    });
    sigterm(&child);
    assert_eq!(
        exit_of(&mut child, Duration::from_secs(8)).await.code(),
        Some(0)
    );
    let (access, dropped) = reader.join().unwrap();
    assert!(dropped > 0, "{access} access lines, none dropped");
    // Every line written or counted (review: the count was queued behind the full queue,
    // and mostly dropped with it: 1 reported of 126,000).
    assert!(
        access + dropped >= REQUESTS,
        "{access} written + {dropped} dropped"
    );
}

/// The admin listener keeps at most 64 connections, so that idle admin connections cannot
/// take the file descriptors upstream connections need (review: 400 of them had healthy
/// upstreams answered 502). Past them the oldest is closed for each new one: a probe is
/// answered at once whatever holds the others (review: refused at the cap, it waited for their
/// header timeout).
#[tokio::test]
async fn the_admin_listener_keeps_a_bounded_number_of_connections() {
    let up = MockUpstream::start().await;
    let gw = Sluice::start(&config(&up.url(), 8, "30s", "5s"));
    let mut idle = Vec::new();
    for _ in 0..64 {
        idle.push(TcpStream::connect(gw.admin).await.unwrap());
    }
    // The 64 were taken and are served (a smaller cap would close the first of them).
    let mut buf = [0u8; 64];
    let first = &mut idle[0];
    first
        .write_all(b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), first.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    // Each new one, a probe's (kept open here), is answered; the oldest are closed, one for
    // each.
    let mut probes = Vec::new();
    for _ in 0..3 {
        let mut probe = TcpStream::connect(gw.admin).await.unwrap();
        probe
            .write_all(b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), probe.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
        probes.push(probe);
    }
    for i in [0, 1, 2, 3, 63] {
        let limit = Duration::from_millis(if i < 3 { 2000 } else { 100 });
        let closed = read_until_closed(&mut idle[i], limit).await;
        assert_eq!(closed.is_some(), i < 3, "connection {i}: {closed:?}");
    }
    gw.wait_log("the cap's warning", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("admin connections at their cap"))
    })
    .await;
    assert_eq!(get(gw.main, "/api/echo", &[]).await.status, 200);
}
