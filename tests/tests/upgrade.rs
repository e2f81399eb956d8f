//! Protocol switches (`Connection: upgrade`, as WebSocket uses) through the gateway, over real
//! sockets: the handshake reaches the upstream with its upgrade headers, the `101` reaches the
//! client with its own, bytes then flow both ways, and the tunnel holds the caller's
//! concurrency slot until it closes.

use std::net::SocketAddr;
use std::time::Duration;

use sluice_tests::redis::{RedisServer, HASH_SECRET};
use sluice_tests::{get, send, Sluice};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// Bounds every wait of these tests.
const PATIENCE: Duration = Duration::from_secs(10);

fn config(upstream: SocketAddr) -> String {
    config_with(upstream, "10s", "60s")
}

fn config_with(upstream: SocketAddr, grace: &str, tunnel_idle: &str) -> String {
    format!(
        r#"
[gateway]
listen = "127.0.0.1:0"
max_in_flight = 64
shutdown_grace = "{grace}"

[admin]
listen = "127.0.0.1:0"

[identity]
api_key = ["header:x-api-key"]

[responses]
problem_base = "https://api.example.com/problems/"

[upstreams.app]
url = "http://{upstream}"
tunnel_idle_timeout = "{tunnel_idle}"

[[routes]]
name = "ws"
path = "/ws"
upstream = "app"

[[limits]]
name = "one-at-a-time"
by = "api_key"
algorithm = "concurrency"
quota = 1
"#
    )
}

/// An upstream that switches any request asking for `Upgrade: echo` to a byte echo, and
/// answers anything else `200`. It sends every request head it receives on `heads`.
async fn echo_upstream() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (heads, received) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let heads = heads.clone();
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                let head = read_head(&mut stream).await;
                let _ = heads.send(head.clone());
                let lower = head.to_ascii_lowercase();
                if lower.contains("\r\nupgrade: echo") && lower.contains("\r\nconnection: upgrade")
                {
                    let switch = "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: echo\r\nX-Echo: on\r\n\r\n";
                    stream.write_all(switch.as_bytes()).await.unwrap();
                    let (mut from, mut to) = tokio::io::split(stream);
                    let _ = tokio::io::copy(&mut from, &mut to).await;
                } else {
                    let ok = "HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n";
                    let _ = stream.write_all(ok.as_bytes()).await;
                }
            });
        }
    });
    (addr, received)
}

/// An upstream that reads each request's head and answers `response`, whatever was asked.
async fn canned_upstream(response: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let mut stream = BufReader::new(stream);
            read_head(&mut stream).await;
            let _ = stream.write_all(response.as_bytes()).await;
        }
    });
    addr
}

/// Reads an HTTP head, up to and including the empty line.
async fn read_head<R: AsyncBufReadExt + Unpin>(r: &mut R) -> String {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        let n = tokio::time::timeout(PATIENCE, r.read_line(&mut line))
            .await
            .expect("a head in time")
            .unwrap();
        head.push_str(&line);
        if n == 0 || line == "\r\n" {
            return head;
        }
    }
}

/// Opens a connection to the gateway and asks to switch to the echo protocol as `key`;
/// returns the connection and the response head.
async fn handshake(gw: SocketAddr, key: &str) -> (BufReader<TcpStream>, String) {
    let mut stream = BufReader::new(TcpStream::connect(gw).await.unwrap());
    let ask = format!(
        "GET /ws HTTP/1.1\r\nHost: gw\r\nX-Api-Key: {key}\r\nConnection: keep-alive, Upgrade\r\nUpgrade: echo\r\n\r\n"
    );
    stream.write_all(ask.as_bytes()).await.unwrap();
    let head = read_head(&mut stream).await;
    (stream, head)
}

async fn echo(stream: &mut BufReader<TcpStream>, text: &[u8]) -> Vec<u8> {
    stream.write_all(text).await.unwrap();
    let mut back = vec![0; text.len()];
    tokio::time::timeout(PATIENCE, stream.read_exact(&mut back))
        .await
        .expect("the echo in time")
        .unwrap();
    back
}

#[tokio::test]
async fn an_upgrade_is_forwarded_and_the_tunnel_carries_bytes_both_ways() {
    let (up, mut heads) = echo_upstream().await;
    let gw = Sluice::start(&config(up));
    let (mut stream, head) = handshake(gw.main, "k").await;
    let lower = head.to_ascii_lowercase();
    assert!(lower.starts_with("http/1.1 101"), "{head}");
    assert!(lower.contains("\r\nupgrade: echo\r\n"), "{head}");
    assert!(lower.contains("\r\nconnection: upgrade\r\n"), "{head}");
    assert!(
        lower.contains("\r\nx-echo: on\r\n"),
        "other headers pass: {head}"
    );
    assert!(
        lower.contains("\r\nratelimit: "),
        "limits advertised: {head}"
    );
    let sent = heads.recv().await.unwrap().to_ascii_lowercase();
    assert!(sent.contains("\r\nupgrade: echo\r\n"), "{sent}");
    assert!(sent.contains("\r\nconnection: upgrade\r\n"), "{sent}");
    assert!(
        sent.contains("\r\nx-forwarded-for: 127.0.0.1\r\n"),
        "{sent}"
    );
    // Bytes both ways, several times, in a frame format the gateway knows nothing of; even
    // bytes that look like hyper's own answer to a bad request pass as they are.
    let lookalike = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: Tue, 01 Dec 2026 03:46:47 GMT\r\n\r\n";
    for text in [
        &b"hello"[..],
        &[0u8, 255, 13, 10, 13, 10],
        &[b'x'; 70_000],
        lookalike,
    ] {
        assert_eq!(echo(&mut stream, text).await, text);
    }
}

#[tokio::test]
async fn an_open_tunnel_holds_its_concurrency_slot_until_it_closes() {
    let (up, _heads) = echo_upstream().await;
    let gw = Sluice::start(&config(up));
    let (mut tunnel, head) = handshake(gw.main, "k").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert_eq!(echo(&mut tunnel, b"still open").await, b"still open");
    // The caller's one slot is the tunnel's: another request of the same key is refused, any
    // other key passes.
    let busy = get(gw.main, "/ws", &[("x-api-key", "k")]).await;
    assert_eq!(busy.status, 429);
    assert_eq!(
        get(gw.main, "/ws", &[("x-api-key", "other")]).await.status,
        200
    );
    // The tunnel's access-log line waits for its end.
    assert!(
        !gw.access_logs().iter().any(|v| v["status"] == 101),
        "{:?}",
        gw.access_logs()
    );
    // Closing the tunnel frees it.
    drop(tunnel);
    let freed = tokio::time::timeout(PATIENCE, async {
        loop {
            let r = get(gw.main, "/ws", &[("x-api-key", "k")]).await;
            if r.status == 200 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        freed.is_ok(),
        "the slot was not released after the tunnel closed"
    );
    // Its line, once it has closed: how long it lived and what it carried each way.
    let line = gw
        .wait_log("the tunnel's line", |v| v["status"] == 101)
        .await;
    assert_eq!(line["tunnel_end"], "closed", "{line}");
    assert_eq!(
        (&line["tunnel_up"], &line["tunnel_down"]),
        (&10.into(), &10.into()),
        "{line}"
    );
    assert_eq!(line["bytes"], 10, "{line}");
}

#[tokio::test]
async fn an_upgrade_the_upstream_declines_is_an_ordinary_response() {
    // Declines the switch: a plain 200 that closes.
    let up =
        canned_upstream("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\nno\n")
            .await;
    let gw = Sluice::start(&config(up));
    let (mut stream, head) = handshake(gw.main, "k").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("\r\nupgrade:"),
        "{head}"
    );
    let mut body = [0u8; 3];
    tokio::time::timeout(PATIENCE, stream.read_exact(&mut body))
        .await
        .expect("the body in time")
        .unwrap();
    assert_eq!(&body, b"no\n");
}

#[tokio::test]
async fn an_h2c_upgrade_is_not_forwarded() {
    let (up, mut heads) = echo_upstream().await;
    let gw = Sluice::start(&config(up));
    // Cleartext HTTP/2 would hand the client a raw HTTP/2 connection to the upstream.
    let req = http::Request::get("/ws")
        .header("host", gw.main.to_string())
        .header("x-api-key", "k")
        .header("connection", "Upgrade, HTTP2-Settings")
        .header("upgrade", "h2c")
        .header("http2-settings", "AAMAAABkAAQAAP__")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    assert_eq!(send(gw.main, req).await.status, 200);
    let sent = heads.recv().await.unwrap().to_ascii_lowercase();
    for gone in [
        "\r\nupgrade:",
        "\r\nhttp2-settings:",
        "\r\nconnection: upgrade",
    ] {
        assert!(!sent.contains(gone), "{gone} reached the upstream: {sent}");
    }
}

#[tokio::test]
async fn a_switch_nobody_asked_for_is_a_502() {
    let switch = "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n";
    let up = canned_upstream(switch).await;
    let gw = Sluice::start(&config(up));
    let reply = get(gw.main, "/ws", &[("x-api-key", "k")]).await;
    assert_eq!(reply.status, 502);
    // The upstream answered, wrongly: not "could not be reached" (review).
    let body = String::from_utf8_lossy(&reply.body).into_owned();
    assert!(body.contains("upstream-bad-response"), "{body}");
}

/// A switch to a protocol the client did not ask for cannot be followed (RFC 9110 section
/// 7.8), and one to `h2c` would hand the client a raw HTTP/2 connection to the upstream:
/// 502, no tunnel (review: it was passed through).
#[tokio::test]
async fn a_switch_to_another_protocol_than_the_one_asked_for_is_a_502() {
    for switch in [
        "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
        "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n\r\n",
    ] {
        let up = canned_upstream(switch).await;
        let gw = Sluice::start(&config(up));
        let (_stream, head) = handshake(gw.main, "k").await;
        assert!(head.starts_with("HTTP/1.1 502"), "{switch:?}: {head}");
    }
    // The protocol asked for, in another case, is followed.
    let up = canned_upstream(
        "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: ECHO\r\n\r\n",
    )
    .await;
    let gw = Sluice::start(&config(up));
    let (_stream, head) = handshake(gw.main, "k").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
}

#[tokio::test]
async fn shutdown_waits_within_its_grace_for_open_tunnels() {
    let (up, _heads) = echo_upstream().await;
    let mut gw = Sluice::start(&config_with(up, "20s", "60s"));
    let (mut tunnel, head) = handshake(gw.main, "k").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    gw.terminate();
    gw.wait_draining().await;
    // Draining: the tunnel still carries bytes...
    assert_eq!(echo(&mut tunnel, b"after SIGTERM").await, b"after SIGTERM");
    // ...until its client closes it; then the gateway stops, every request finished.
    drop(tunnel);
    let status = gw.wait_exit(PATIENCE).await;
    assert_eq!(status.code(), Some(0));
    let stopped = gw.wait_log("stopped", |v| v["message"] == "stopped").await;
    assert_eq!(stopped["every_request_finished"], true);
}

/// A tunnel still open when the shutdown grace ends is closed while the gateway can still
/// release its concurrency lease in the shared store (not left for the lease's 60 s expiry).
#[tokio::test]
async fn a_tunnel_open_when_the_grace_ends_is_closed_and_its_lease_released() {
    let redis = RedisServer::start();
    let (up, _heads) = echo_upstream().await;
    let store = format!("\n[store]\nkind = \"redis\"\nurl = \"{}\"\n", redis.url());
    let cfg = config_with(up, "1s", "60s") + &store;
    let mut gw = Sluice::start_with(&cfg, &[], &[("SLUICE_HASH_SECRET", HASH_SECRET)]);
    let (mut tunnel, head) = handshake(gw.main, "k").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let key = redis.cli(&["--scan", "--pattern", "sluice:one-at-a-time:*"]);
    let leases = || redis.cli(&["ZCARD", key.trim()]).trim().to_string();
    assert_eq!(leases(), "1");
    gw.terminate();
    assert_eq!(gw.wait_exit(PATIENCE).await.code(), Some(0));
    assert_eq!(leases(), "0", "the lease was released at the cut");
    let line = gw
        .wait_log("the tunnel's line", |v| v["status"] == 101)
        .await;
    assert_eq!(
        (&line["tunnel_end"], &line["cut"]),
        (&"cut".into(), &"shutdown".into()),
        "{line}"
    );
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(PATIENCE, tunnel.read_to_end(&mut rest)).await;
    assert!(matches!(closed, Ok(Ok(0))), "{closed:?}");
}

#[tokio::test]
async fn a_tunnel_idle_for_its_timeout_is_closed_and_frees_its_slot() {
    let (up, _heads) = echo_upstream().await;
    let gw = Sluice::start(&config_with(up, "10s", "1s"));
    let (mut tunnel, head) = handshake(gw.main, "k").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    // Traffic every 150 ms keeps it open past the timeout...
    for _ in 0..8 {
        assert_eq!(echo(&mut tunnel, b"ping").await, b"ping");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // ...silence closes it.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(PATIENCE, tunnel.read_to_end(&mut rest)).await;
    assert!(
        matches!(closed, Ok(Ok(0))),
        "the idle tunnel was not closed: {closed:?}"
    );
    assert_eq!(get(gw.main, "/ws", &[("x-api-key", "k")]).await.status, 200);
    let line = gw
        .wait_log("the tunnel's line", |v| v["status"] == 101)
        .await;
    assert_eq!(line["tunnel_end"], "idle", "{line}");
    assert_eq!(
        (&line["tunnel_up"], &line["tunnel_down"]),
        (&32.into(), &32.into()),
        "{line}"
    );
    assert!(line["total_ms"].as_f64().unwrap() >= 1000.0, "{line}");
}

/// A tunnel is still a client connection: it counts against `max_connections` until it
/// closes, although hyper let go of its connection at the switch.
#[tokio::test]
async fn an_open_tunnel_counts_against_max_connections() {
    let (up, _heads) = echo_upstream().await;
    let cfg = config(up).replace(
        "max_in_flight = 64",
        "max_in_flight = 64\nmax_connections = 1",
    );
    let gw = Sluice::start_with_args(&cfg, &["--threads", "1"]);
    let (mut tunnel, head) = handshake(gw.main, "k").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert_eq!(echo(&mut tunnel, b"open").await, b"open");
    // The one place is the tunnel's: a new connection waits in the listen backlog (served
    // within about a millisecond when the tunnel did not count)...
    let waiting = tokio::spawn(get(gw.main, "/ws", &[("x-api-key", "other")]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a second connection was served while the tunnel held the only place"
    );
    assert_eq!(echo(&mut tunnel, b"still open").await, b"still open");
    // ...until the tunnel closes.
    drop(tunnel);
    let served = tokio::time::timeout(PATIENCE, waiting).await;
    assert_eq!(
        served
            .expect("served once the tunnel closed")
            .unwrap()
            .status,
        200
    );
}
