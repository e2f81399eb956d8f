//! A plain HTTP/1.1 client for the tests: one fresh connection per request, nothing hidden.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Body;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// What came back.
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: StatusCode,
    /// Response headers.
    pub headers: HeaderMap,
    /// The body, whole (tests that stream large bodies use [`send_counting`]).
    pub body: Bytes,
}

impl Reply {
    /// The body as UTF-8 text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }

    /// A header as text, or "" when absent.
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// `GET target` written byte for byte as given (no URI parsing on the way, so `//a` or
/// `/a/./b` reach the gateway as they are), with the given extra headers, on a new
/// connection that the request closes; the reply read to its end.
pub async fn raw_get(addr: SocketAddr, target: &str, headers: &[(&str, &str)]) -> Reply {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = format!("GET {target} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let fut = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        stream
            .write_all(head.as_bytes())
            .await
            .expect("write the request");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read the reply");
        raw
    };
    let raw = tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .expect("request finished in time");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(&raw)));
    let text = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<StatusCode>().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut headers = HeaderMap::new();
    for line in lines {
        let (k, v) = line
            .split_once(':')
            .unwrap_or_else(|| panic!("bad header line {line:?}"));
        headers.append(
            http::HeaderName::from_bytes(k.trim().as_bytes()).expect("header name"),
            http::HeaderValue::from_str(v.trim()).expect("header value"),
        );
    }
    Reply {
        status,
        headers,
        body: Bytes::copy_from_slice(&raw[split + 4..]),
    }
}

/// A request sent whole, its answer read later: `GET path` with an `X-Api-Key` of `key` (and
/// `Connection: close`) written on a new connection, before the caller sends anything else.
#[derive(Debug)]
pub struct Pending(TcpStream);

impl Pending {
    pub async fn send(addr: SocketAddr, path: &str, key: &str) -> Pending {
        use tokio::io::AsyncWriteExt;
        let mut stream = TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        let head = format!(
            "GET {path} HTTP/1.1\r\nhost: x\r\nx-api-key: {key}\r\nconnection: close\r\n\r\n"
        );
        stream
            .write_all(head.as_bytes())
            .await
            .expect("send the head");
        Pending(stream)
    }

    /// The raw answer, read until the gateway closes the connection (at most 10 s).
    pub async fn answer(mut self) -> String {
        use tokio::io::AsyncReadExt;
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), self.0.read_to_end(&mut raw))
            .await
            .expect("answered within 10 s")
            .expect("read the answer");
        String::from_utf8_lossy(&raw).into_owned()
    }
}

/// A client that gives up waiting: sends `GET path` with an `X-Api-Key` of `key` on a new
/// connection, reads nothing, and closes the connection `after` later.
pub async fn send_and_leave(addr: SocketAddr, path: &str, key: &str, after: Duration) {
    use tokio::io::AsyncWriteExt;
    let mut stream = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let head = format!("GET {path} HTTP/1.1\r\nhost: x\r\nx-api-key: {key}\r\n\r\n");
    stream
        .write_all(head.as_bytes())
        .await
        .expect("send the head");
    tokio::time::sleep(after).await;
}

/// An HTTP/2 (prior knowledge) connection to `addr`, driven in the background.
pub async fn h2_sender<B>(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    sender
}

/// `GET path` with the given extra headers.
pub async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Reply {
    let mut b = Request::get(path).header("host", addr.to_string());
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    send(addr, b.body(Empty::<Bytes>::new()).unwrap()).await
}

/// Sends `req` on a new connection and returns the response head (the body still to read).
async fn exchange<B>(addr: SocketAddr, req: Request<B>) -> http::Response<hyper::body::Incoming>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(conn);
    sender.send_request(req).await.expect("response head")
}

/// Sends `req` on a new connection and reads the whole response.
pub async fn send<B>(addr: SocketAddr, req: Request<B>) -> Reply
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let fut = async {
        let (parts, body) = exchange(addr, req).await.into_parts();
        let body = body.collect().await.expect("response body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .expect("request finished in time")
}

/// Sends `req` and counts the response body's bytes without keeping them.
pub async fn send_counting<B>(addr: SocketAddr, req: Request<B>) -> (StatusCode, u64)
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (status, n, ended) = send_until_end(addr, req).await;
    ended.expect("body frame");
    (status, n)
}

/// `GET path`: the status, the body bytes received, and how the body ended (`Err` with the
/// error when it did not end cleanly, e.g. the connection closed before the promised length).
pub async fn get_until_end(addr: SocketAddr, path: &str) -> (StatusCode, u64, Result<(), String>) {
    let req = Request::get(path)
        .header("host", addr.to_string())
        .body(Empty::<Bytes>::new())
        .unwrap();
    send_until_end(addr, req).await
}

/// Sends `req` and reads the response body to its end, counting its bytes: the status, the
/// count, and how the body ended.
pub async fn send_until_end<B>(
    addr: SocketAddr,
    req: Request<B>,
) -> (StatusCode, u64, Result<(), String>)
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let fut = async {
        let res = exchange(addr, req).await;
        let status = res.status();
        let mut body = res.into_body();
        let mut n = 0u64;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => n += f.into_data().map_or(0, |d| d.len() as u64),
                Err(e) => return (status, n, Err(e.to_string())),
            }
        }
        (status, n, Ok(()))
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .expect("request finished in time")
}

/// `GET path`, returning an error instead of panicking when the connection fails.
pub async fn try_get(addr: SocketAddr, path: &str) -> Result<StatusCode, String> {
    let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::get(path)
        .header("host", addr.to_string())
        .body(Empty::<Bytes>::new())
        .unwrap();
    let res = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = res.status();
    res.into_body().collect().await.map_err(|e| e.to_string())?;
    Ok(status)
}

/// A request body of `pieces` pieces of 1 KiB, one every `every`, then (unless `stall`) its
/// end; with `stall`, it never ends after the last piece.
#[derive(Debug)]
pub struct Trickle {
    left: usize,
    every: Duration,
    stall: bool,
    next: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl Trickle {
    /// `pieces` pieces, one every `every`.
    pub fn new(pieces: usize, every: Duration, stall: bool) -> Self {
        Trickle {
            left: pieces,
            every,
            stall,
            next: Box::pin(tokio::time::sleep(every)),
        }
    }
}

impl Body for Trickle {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        use std::future::Future;
        use std::task::Poll;
        if self.left == 0 {
            return match self.stall {
                true => Poll::Pending,
                false => Poll::Ready(None),
            };
        }
        if self.next.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.left -= 1;
        let every = self.every;
        self.next
            .as_mut()
            .reset(tokio::time::Instant::now() + every);
        Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from(vec![
            b'u';
            1024
        ])))))
    }
}
