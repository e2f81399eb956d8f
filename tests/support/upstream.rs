//! A real HTTP upstream on a loopback port, with endpoints the tests steer:
//! routed by the last path segment: `echo` (reports what it received), `/hold` (answers only when released),
//! `/download?bytes=N` (streams N bytes), `/upload` (counts the body without keeping it),
//! `/reset` (drops the connection), `/hop` (answers with hop-by-hop headers), `/stall` (promises
//! 1000 bytes, sends 10, then nothing), `/pause?ms=N` (sends `before\n`, waits N ms, sends
//! `after\n`: a stream whose upstream is slow, not stalled), `/early` (answers `ok` at once,
//! then reads the request body to its end, counting it), `/deaf` (answers `ok` at once and
//! never reads the request body, for a minute).

use std::convert::Infallible;
use std::future::Future as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// A running mock upstream; stops when dropped.
#[derive(Debug)]
pub struct MockUpstream {
    /// Where it listens.
    pub addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct State {
    release: Semaphore,
    holding: AtomicUsize,
    requests: AtomicUsize,
    connections: AtomicUsize,
    /// Body bytes `/early` has read after answering.
    early_bytes: AtomicUsize,
}

impl MockUpstream {
    /// Starts on a free loopback port.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind mock upstream");
        let addr = listener.local_addr().expect("mock upstream address");
        let state = Arc::new(State {
            release: Semaphore::new(0),
            holding: AtomicUsize::new(0),
            requests: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            early_bytes: AtomicUsize::new(0),
        });
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                st.connections.fetch_add(1, Ordering::SeqCst);
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| serve(st.clone(), req));
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, state, task }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Lets `n` held requests answer.
    pub fn release(&self, n: usize) {
        self.state.release.add_permits(n);
    }

    /// Requests currently waiting in `/hold`.
    pub fn holding(&self) -> usize {
        self.state.holding.load(Ordering::SeqCst)
    }

    /// Requests received so far.
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Request body bytes `/early` has read after its answer.
    pub fn early_bytes(&self) -> usize {
        self.state.early_bytes.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until `n` requests are held.
    pub async fn wait_holding(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.holding() < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "upstream never held {n} requests (holding {})",
                self.holding()
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type MockBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn serve(
    st: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<MockBody>, std::io::Error> {
    st.requests.fetch_add(1, Ordering::SeqCst);
    let query = req.uri().query().unwrap_or("").to_owned();
    // Routed by the last path segment, so any gateway prefix (`/api/hold`) works.
    let endpoint = req.uri().path().rsplit('/').next().unwrap_or("").to_owned();
    match endpoint.as_str() {
        "reset" => Err(std::io::Error::other("reset requested")),
        "hold" => {
            st.holding.fetch_add(1, Ordering::SeqCst);
            let permit = st.release.acquire().await.expect("semaphore open");
            permit.forget();
            st.holding.fetch_sub(1, Ordering::SeqCst);
            Ok(text(StatusCode::OK, "released\n"))
        }
        "download" => {
            let n: u64 = query
                .strip_prefix("bytes=")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            Ok(Response::new(Repeat::new(n).boxed()))
        }
        "stall" => Ok(Response::new(Stall { sent: false }.boxed())),
        "mirror" => Ok(Response::new(Mirror(req.into_body()).boxed())),
        "early" => {
            let mut body = req.into_body();
            tokio::spawn(async move {
                while let Some(Ok(frame)) = body.frame().await {
                    if let Ok(data) = frame.into_data() {
                        st.early_bytes.fetch_add(data.len(), Ordering::SeqCst);
                    }
                }
            });
            Ok(text(StatusCode::OK, "ok\n"))
        }
        "deaf" => {
            let body = req.into_body();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(body);
            });
            Ok(text(StatusCode::OK, "ok\n"))
        }
        "pause" => {
            let ms: u64 = query
                .strip_prefix("ms=")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            Ok(Response::new(Pause::new(Duration::from_millis(ms)).boxed()))
        }
        "hop" => {
            let mut res = text(StatusCode::OK, "hop\n");
            let h = res.headers_mut();
            h.insert("connection", "x-internal".parse().unwrap());
            h.insert("x-internal", "secret".parse().unwrap());
            h.insert("keep-alive", "timeout=5".parse().unwrap());
            h.insert("x-public", "yes".parse().unwrap());
            Ok(res)
        }
        _ => {
            // /echo and /upload: count the body frame by frame, never keep it.
            let (parts, mut body) = req.into_parts();
            let mut received: u64 = 0;
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.map_err(std::io::Error::other)?.into_data() {
                    received += data.len() as u64;
                }
            }
            let headers: serde_json::Map<String, serde_json::Value> = parts
                .headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_owned(),
                        json!(v.to_str().unwrap_or("<binary>")),
                    )
                })
                .collect();
            let report = json!({
                "method": parts.method.as_str(),
                "uri": parts.uri.to_string(),
                "version": format!("{:?}", parts.version),
                "headers": headers,
                "body_bytes": received,
            });
            let mut res = text(StatusCode::OK, &report.to_string());
            res.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok(res)
        }
    }
}

fn text(status: StatusCode, s: &str) -> Response<MockBody> {
    let mut res = Response::new(Full::new(Bytes::from(s.to_owned())).boxed());
    *res.status_mut() = status;
    res
}

/// A body that announces 1000 bytes, sends 10 and then never another (never wakes again).
#[derive(Debug)]
pub struct Stall {
    sent: bool,
}

impl Body for Stall {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.sent {
            return Poll::Pending;
        }
        self.sent = true;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"0123456789")))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(1000)
    }
}

/// A response body that sends the request body back as it comes, before the request has
/// ended (a streaming or echo service). It ends where the request body ends or fails.
#[derive(Debug)]
pub struct Mirror(Incoming);

impl Body for Mirror {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        loop {
            return match Pin::new(&mut self.0).poll_frame(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                    // Trailers are not mirrored.
                    Err(_) => continue,
                },
                Poll::Ready(Some(Err(_)) | None) => Poll::Ready(None),
            };
        }
    }
}

/// A body that sends `before\n`, waits, then sends `after\n` and ends.
#[derive(Debug)]
pub struct Pause {
    pieces: std::vec::IntoIter<&'static [u8]>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Pause {
    /// Waits `wait` between its two pieces.
    pub fn new(wait: Duration) -> Self {
        Self {
            pieces: vec![&b"before\n"[..], &b"after\n"[..]].into_iter(),
            wait: Some(Box::pin(tokio::time::sleep(wait))),
        }
    }
}

impl Body for Pause {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        // The first piece at once, the second after the wait.
        if self.pieces.len() == 1 {
            if let Some(wait) = self.wait.as_mut() {
                std::task::ready!(wait.as_mut().poll(cx));
                self.wait = None;
            }
        }
        let piece = self.pieces.next();
        Poll::Ready(piece.map(|p| Ok(Frame::data(Bytes::from_static(p)))))
    }
}

/// A body of `n` bytes made on the fly in 64 KiB chunks, so nothing holds it whole.
#[derive(Debug)]
pub struct Repeat {
    remaining: u64,
    chunk: Bytes,
}

impl Repeat {
    /// `n` bytes of `x`.
    pub fn new(n: u64) -> Self {
        Self {
            remaining: n,
            chunk: Bytes::from(vec![b'x'; 64 * 1024]),
        }
    }
}

impl Body for Repeat {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let n = self.remaining.min(self.chunk.len() as u64) as usize;
        self.remaining -= n as u64;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}
