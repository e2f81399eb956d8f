//! The forwarding step: rewrite the request for the upstream, send it over a pooled
//! keep-alive connection, and map failures to 502 / 504. Bodies stream both ways.

use std::cell::Cell;
use std::collections::VecDeque;
use std::error::Error as StdError;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONNECTION, COOKIE, HOST, TE, UPGRADE};
use http::uri::{Authority, PathAndQuery};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use pin_project_lite::pin_project;
use sluice_config::{MinBodyRate, Upstream};
use tokio::net::TcpStream;

use crate::capacity::Capacity;
use crate::h1_client::{self, Answer};
use crate::problem::Problem;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Pooled connections looked at for a ready one before opening a new connection.
const CHECKOUT_TRIES: usize = 4;

/// A pooled connection unused for this long is closed (by the next checkout or the gateway's
/// once-a-second sweep).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Pools per upstream: one per serving thread (threads beyond this share).
const POOLS: usize = 64;

thread_local! {
    /// Which pool this thread uses: a connection's I/O runs on the runtime that opened it, so
    /// each serving thread keeps its own connections and a request never waits on another
    /// thread's runtime (nor on one that is shutting down).
    pub(crate) static POOL: Cell<usize> = const { Cell::new(0) };
}

/// Makes the calling thread use pool `n` (the serving thread's number).
pub(crate) fn use_pool(n: usize) {
    POOL.with(|p| p.set(n % POOLS));
}

/// One upstream service and its pools of keep-alive HTTP/1.1 connections, one per serving
/// thread.
///
/// Not hyper-util's pooled client: a checkout here is a lock and a pop, with no pool key to
/// hash, no connector service and no task spawned per request to wait for readiness. A
/// connection goes back to the pool as soon as its response head arrives (HTTP/1.1 cannot
/// send the next request before the body ends, so a checkout skips connections that are
/// still busy and opens a new one when none is ready).
#[derive(Debug)]
pub(crate) struct UpstreamClient {
    authority: Authority,
    timeout: Duration,
    connect_timeout: Duration,
    /// Kept connections of hyper's client, for requests with a body or an upgrade.
    idle: Pools<Kept>,
    /// Kept connections of the gateway's own client, for requests without a body or an
    /// upgrade (`h1_client.rs`); shared with the response bodies that hand theirs back.
    plain: Arc<Pools<h1_client::Plain>>,
    tunnel_idle_timeout: Duration,
}

/// An upstream connection with its own response timer, re-armed by each request it carries:
/// moving a timer's deadline later is one atomic step, where a new timer per request took the
/// time driver's lock to register and again to cancel (callgrind: ~370 instructions of a
/// forwarded request).
#[derive(Debug)]
struct Kept {
    sender: SendRequest<Upload>,
    timer: Pin<Box<Sleep>>,
    /// Cuts off what the connection still writes ([`WriteCut`]).
    writes: Arc<WriteCut>,
}

/// Why an exchange failed, before it becomes a problem response.
enum Failure {
    /// The upstream did not connect or answer before the request's deadline.
    Timeout,
    /// The request body stopped coming from the client, or came slower than `min_body_rate`.
    ClientStalled,
    Connect(io::Error),
    Http(hyper::Error),
}

impl UpstreamClient {
    pub(crate) fn new(u: &Upstream) -> Self {
        Self {
            authority: u
                .url
                .authority()
                .cloned()
                .expect("validated upstream URLs have a host"),
            timeout: u.timeout,
            connect_timeout: u.connect_timeout,
            idle: Pools::new(usize::from(u.idle_connections)),
            plain: Arc::new(Pools::new(usize::from(u.idle_connections))),
            tunnel_idle_timeout: u.tunnel_idle_timeout,
        }
    }

    /// How long to wait for the response head, and then for each piece of the body.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The upstream's host and port: the `Host` of a request that names none.
    pub(crate) fn authority(&self) -> &Authority {
        &self.authority
    }

    /// How long a tunnel to this upstream may carry no byte before it is closed.
    pub(crate) fn tunnel_idle_timeout(&self) -> Duration {
        self.tunnel_idle_timeout
    }

    /// Sends `req` (already rewritten) and waits for the response head within `timeout` of
    /// the end of its body (while the body is sent, of its last piece). A body that turns out
    /// longer than `max_body` bytes is cut, and the answer is 413.
    pub(crate) async fn send(
        &self,
        mut req: Request<Incoming>,
        max_body: u64,
        min_rate: Option<MinBodyRate>,
    ) -> Result<Response<Upstreamed>, Problem> {
        // The upstream gets the origin form: the path and query alone.
        let path = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::from(path);
        if http_body::Body::is_end_stream(req.body())
            && !req.headers().contains_key(UPGRADE)
            && req.method() != Method::CONNECT
        {
            return self.send_plain(req.into_parts().0).await;
        }
        let mut req = req.map(|body| Upload::new(body, max_body, min_rate, self.timeout));
        // A body of no declared length goes chunked. hyper's client would send a GET's, HEAD's
        // or CONNECT's as no body at all unless told (the client's chunked framing was taken
        // off with the other hop-by-hop headers).
        let body = req.body();
        if body.moved.is_some() && http_body::Body::size_hint(body).exact().is_none() {
            let chunked = HeaderValue::from_static("chunked");
            req.headers_mut()
                .insert(http::header::TRANSFER_ENCODING, chunked);
        }
        *req.version_mut() = http::Version::HTTP_11;
        let tail = req.body().moved.as_ref().map(|moved| UploadTail {
            moved: Arc::clone(moved),
            timeout: self.timeout,
        });
        let now = Instant::now();
        // The client's body broken or cut: its connection cannot go on.
        let ends = |mut p: Problem| {
            p.ends_connection = true;
            p
        };
        let problem = match self.exchange(req, now, now + self.timeout).await {
            Err(Failure::Timeout) => Problem::upstream_timeout(),
            Err(Failure::ClientStalled) => ends(Problem::body_timeout()),
            Ok(res) => {
                let mut res = res.map(Upstreamed::Hyper);
                // Only an upload still going can outlive the answer: most have ended by now,
                // and cost no extensions map.
                // (One cut at the answer's head waits for the answer's end, ended or not.)
                if let Some(tail) = tail
                    .filter(|t| t.moved.is_cut() || t.moved.state.load(Ordering::Acquire) != ENDED)
                {
                    res.extensions_mut().insert(tail);
                }
                return Ok(res);
            }
            Err(Failure::Connect(e)) => self.unreachable(&e),
            Err(Failure::Http(e)) if caused_by_timeout(&e) => Problem::upstream_timeout(),
            Err(Failure::Http(e)) if caused_by::<ClientTooSlow>(&e) => ends(Problem::body_timeout()),
            Err(Failure::Http(e)) if caused_by::<BodyTooLarge>(&e) => {
                ends(Problem::body_too_large(max_body))
            }
            Err(Failure::Http(e)) if caused_by::<PiecesTooSmall>(&e) => {
                ends(Problem::bad_request(format!(
                    "The request body came in pieces of under {TINY} bytes on average ({FLOOD_PIECES} of them back to back): send it in larger pieces."
                )))
            }
            // The client's own body failed (a malformed chunk, fewer bytes than declared): the
            // caller's error, not the upstream's.
            Err(Failure::Http(e)) if caused_by::<ClientBody>(&e) => {
                tracing::debug!(error = %display_chain(&e), "request body failed");
                ends(Problem::bad_request(
                    "The request body was malformed or ended before its declared length.",
                ))
            }
            // A head that is not HTTP/1.x, or an invalid field: the upstream answered, badly.
            Err(Failure::Http(e)) if e.is_parse() || e.is_parse_status() || e.is_parse_too_large() => {
                tracing::debug!(error = %display_chain(&e), "the upstream's response head is malformed");
                Problem::upstream_bad_response()
            }
            Err(Failure::Http(e)) => {
                tracing::debug!(error = %display_chain(&e), "upstream request failed");
                Problem::upstream_unavailable()
            }
        };
        // An answer given before the client's body was all read (the upstream unreachable,
        // or failing as the body went): its connection cannot go on, and the answer says so
        // (review: 502s to uploads closed their connections unannounced).
        let upload_over = tail
            .as_ref()
            .is_none_or(|t| t.moved.state.load(Ordering::Acquire) == ENDED);
        Err(if upload_over { problem } else { ends(problem) })
    }

    /// Sends a request without a body or an upgrade through the gateway's own client
    /// (`h1_client.rs`), and waits for the response head within `timeout`.
    async fn send_plain(
        &self,
        parts: http::request::Parts,
    ) -> Result<Response<Upstreamed>, Problem> {
        let now = Instant::now();
        let deadline = now + self.timeout;
        // A kept connection the upstream closed as the request went out: a request that
        // may be repeated (RFC 9110 section 9.2.2) goes out again, once, on a new connection
        // (the other kept ones may have died with it: an upstream restarting closes them all).
        let mut may_retry = parts.method.is_idempotent();
        let mut use_pool = true;
        loop {
            let kept = if use_pool {
                self.plain.checkout(now, h1_client::Plain::readiness)
            } else {
                None
            };
            let (plain, pooled) = match kept {
                Some(plain) => (plain, true),
                None => match Box::pin(self.open(deadline)).await {
                    Ok(stream) => (h1_client::Plain::new(stream, deadline), false),
                    Err(Failure::Timeout) => return Err(Problem::upstream_timeout()),
                    Err(Failure::Connect(e)) => return Err(self.unreachable(&e)),
                    Err(_) => return Err(Problem::upstream_unavailable()),
                },
            };
            match h1_client::exchange(plain, &parts, &self.plain, deadline).await {
                Ok(Answer::Whole(res, plain)) => {
                    if let Some(plain) = plain {
                        self.plain.checkin(plain, Instant::now());
                    }
                    return Ok(res.map(Upstreamed::Whole));
                }
                Ok(Answer::Streaming(res, body)) => {
                    return Ok(res.map(|()| Upstreamed::Plain(body)))
                }
                Err(h1_client::Error::Unanswered(_)) if pooled && may_retry => {
                    (may_retry, use_pool) = (false, false);
                }
                Err(h1_client::Error::Timeout) => return Err(Problem::upstream_timeout()),
                Err(e @ (h1_client::Error::Framing(_) | h1_client::Error::Malformed(_))) => {
                    tracing::debug!(upstream = %self.authority, error = %e, "the upstream's response cannot be passed on");
                    return Err(Problem::upstream_bad_response());
                }
                Err(e) => {
                    tracing::debug!(upstream = %self.authority, error = %e, "upstream request failed");
                    return Err(Problem::upstream_unavailable());
                }
            }
        }
    }

    /// Sends `req` on a kept connection or a new one, and waits for the response head until
    /// `deadline`, or later while its body is still being sent.
    async fn exchange(
        &self,
        mut req: Request<Upload>,
        now: Instant,
        deadline: Instant,
    ) -> Result<Response<Incoming>, Failure> {
        let moved = req.body().moved.clone();
        // With a body still to come, the timer also wakes for the body's own deadlines (not
        // the connect: that has the upstream's deadline).
        let first_look = moved
            .as_ref()
            .map_or(deadline, |m| deadline.min(m.next_check(self.timeout)));
        loop {
            let (mut conn, pooled) = match self.checkout(now) {
                Some(conn) => (conn, true),
                // Boxed: a new connection is rare, and its future would otherwise be part of
                // every request's.
                None => (Box::pin(self.connect(deadline)).await?, false),
            };
            conn.timer.as_mut().reset(first_look);
            let sending = conn.sender.try_send_request(req);
            tokio::pin!(sending);
            let sent = loop {
                tokio::select! {
                    biased;
                    sent = sending.as_mut() => break sent,
                    () = conn.timer.as_mut() => {
                        // A body still coming moves the deadline: it counts from its last piece.
                        match moved.as_ref().map(|m| m.verdict(self.timeout, Instant::now())) {
                            Some(Verdict::Wait(later)) => conn.timer.as_mut().reset(later),
                            Some(Verdict::ClientStalled) => return Err(Failure::ClientStalled),
                            Some(Verdict::UpstreamLate) | None => return Err(Failure::Timeout),
                        }
                    }
                }
            };
            match sent {
                Ok(res) => {
                    // A connection that switched protocols is the tunnel's now; one whose
                    // request's body is still going is not reused: the body goes no further
                    // ([`Moved::cut`]), and once the answer is over the connection is closed
                    // ([`UploadTail::response_over`]).
                    let going = moved
                        .as_ref()
                        .filter(|m| m.state.load(Ordering::Acquire) != ENDED);
                    if res.status() != StatusCode::SWITCHING_PROTOCOLS {
                        match going {
                            // The answer's head has come: nothing more of the body goes
                            // upstream, however slowly the client takes the answer.
                            Some(moved) => {
                                moved.cut();
                                conn.writes.cut();
                            }
                            None => self.checkin(conn),
                        }
                    }
                    return Ok(res);
                }
                Err(mut e) => match e.take_message() {
                    // A pooled connection closed under us before anything was sent: the
                    // request is intact, so it goes out on another connection.
                    Some(unsent) if pooled => req = unsent,
                    _ => return Err(Failure::Http(e.into_error())),
                },
            }
        }
    }

    /// A pooled connection ready for a request, if one is found within a few tries. Closed
    /// and stale connections are dropped; busy ones (response body still streaming) go to the
    /// back.
    fn checkout(&self, now: Instant) -> Option<Kept> {
        self.idle.checkout(now, |Kept { sender, .. }| {
            if sender.is_ready() {
                Readiness::Ready
            } else if sender.is_closed() {
                Readiness::Closed
            } else {
                Readiness::Busy
            }
        })
    }

    fn checkin(&self, conn: Kept) {
        self.idle.checkin(conn, Instant::now());
    }

    /// Closes the connections of every thread's pool unused for [`IDLE_TIMEOUT`]; returns how
    /// many. Dropping a connection's sender ends its task on the thread that owns it.
    pub(crate) fn close_idle(&self, now: Instant) -> usize {
        self.idle.close_idle(now) + self.plain.close_idle(now)
    }

    /// The answer when connecting to the upstream failed.
    fn unreachable(&self, e: &io::Error) -> Problem {
        tracing::debug!(upstream = %self.authority, error = %e, "cannot connect to the upstream");
        Problem::upstream_unavailable()
    }

    /// A TCP connection to the upstream, within `connect_timeout` and before `deadline`.
    async fn open(&self, deadline: Instant) -> Result<TcpStream, Failure> {
        let addr = (
            self.authority.host(),
            self.authority.port_u16().unwrap_or(80),
        );
        let connect_by = deadline.min(Instant::now() + self.connect_timeout);
        let mut tried = false;
        let stream = loop {
            match tokio::time::timeout_at(connect_by, TcpStream::connect(addr)).await {
                Err(_elapsed) => return Err(Failure::Timeout),
                // Out of file descriptors: the kept connections to this upstream are closed
                // (their tasks end at once, on their threads) and the connection tried once
                // more; the operator is told, at most once a second, and not only at debug
                // level (review: healthy upstreams answered 502 for want of descriptors,
                // `Too many open files` in the debug log alone).
                Ok(Err(e)) if out_of_files(&e) => {
                    static SHORT: std::sync::LazyLock<crate::once_a_second::OnceASecond> =
                        std::sync::LazyLock::new(crate::once_a_second::OnceASecond::new);
                    if SHORT.now() {
                        tracing::warn!(upstream = %self.authority, error = %e, "out of file descriptors for upstream connections: raise the open-files limit (ulimit -n, LimitNOFILE) or lower max_connections or max_in_flight");
                    }
                    if tried || self.close_idle(Instant::now() + IDLE_TIMEOUT) == 0 {
                        return Err(Failure::Connect(e));
                    }
                    tried = true;
                    tokio::task::yield_now().await;
                }
                Ok(Err(e)) => return Err(Failure::Connect(e)),
                Ok(Ok(stream)) => break stream,
            }
        };
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }

    /// A new connection for hyper's client, within `connect_timeout` and before `deadline`.
    async fn connect(&self, deadline: Instant) -> Result<Kept, Failure> {
        let stream = self.open(deadline).await?;
        let writes = Arc::new(WriteCut::default());
        let stream = Cuttable {
            stream,
            writes: Arc::clone(&writes),
        };
        let handshake = http1::Builder::new().handshake(TokioIo::new(stream));
        let (sender, conn) = match tokio::time::timeout_at(deadline, handshake).await {
            Err(_elapsed) => return Err(Failure::Timeout),
            Ok(handshake) => handshake.map_err(Failure::Http)?,
        };
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %display_chain(&e), "upstream connection ended with an error");
            }
        });
        let timer = Box::pin(tokio::time::sleep_until(deadline));
        Ok(Kept {
            sender,
            timer,
            writes,
        })
    }
}

/// The switch that ends what an upstream connection writes once the answer's head has come
/// while its request's body was still going ([`Moved::cut`]): from then on the connection
/// only reads its answer. What hyper still holds of the body is taken as written and dropped,
/// so that it goes on to the body, which hands the rest of it off ([`hand_off`]), and to the
/// body's end, which closes the connection ([`AnsweredFirst`]). Without it, an upstream that
/// answered and took no more of the body kept hyper writing to it (its socket full), the
/// client's upload unread and the connection open for as long as the upstream kept it (review).
#[derive(Debug, Default)]
struct WriteCut(Cut);

impl WriteCut {
    fn cut(&self) {
        self.0.cut();
    }

    fn is_cut(&self) -> bool {
        self.0.is_cut()
    }

    /// A write is waiting for the socket: the cut wakes it too. Whether the cut came first.
    fn wait(&self, cx: &Context<'_>) -> bool {
        self.0.wake_on_cut(cx);
        self.0.is_cut()
    }
}

/// A flag set once, and the task to wake when it is (the one that registered last).
#[derive(Debug, Default)]
struct Cut {
    cut: std::sync::atomic::AtomicBool,
    waiting: Mutex<Option<std::task::Waker>>,
}

impl Cut {
    fn cut(&self) {
        self.cut.store(true, Ordering::Release);
        self.wake();
    }

    fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Acquire)
    }

    /// Wakes the task registered, if any (it looks again at what woke it).
    fn wake(&self) {
        let waiting = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(waker) = waiting {
            waker.wake();
        }
    }

    /// The task polling `cx` is woken by the cut.
    fn wake_on_cut(&self, cx: &Context<'_>) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if !waiting.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *waiting = Some(cx.waker().clone());
        }
    }
}

/// An upstream connection's socket whose writes a [`WriteCut`] can end.
#[derive(Debug)]
struct Cuttable {
    stream: TcpStream,
    writes: Arc<WriteCut>,
}

impl Cuttable {
    /// A write, or the dropping of what was to be written once the writes are cut.
    fn poll_writing<T>(
        &mut self,
        cx: &mut Context<'_>,
        cut: T,
        write: impl Fn(Pin<&mut TcpStream>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if self.writes.is_cut() {
            return Poll::Ready(Ok(cut));
        }
        match write(Pin::new(&mut self.stream), cx) {
            Poll::Pending if self.writes.wait(cx) => Poll::Ready(Ok(cut)),
            polled => polled,
        }
    }
}

impl tokio::io::AsyncRead for Cuttable {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Cuttable {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_writing(cx, buf.len(), |s, cx| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let all = bufs.iter().map(|b| b.len()).sum();
        self.get_mut()
            .poll_writing(cx, all, |s, cx| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut()
            .poll_writing(cx, (), |s, cx| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Whether a connection failed for want of file descriptors (the process's, or the system's).
fn out_of_files(e: &io::Error) -> bool {
    const EMFILE: i32 = 24;
    const ENFILE: i32 = 23;
    matches!(e.raw_os_error(), Some(EMFILE | ENFILE))
}

/// An upstream's response body: hyper's, or the gateway's own client's (whole, or still to
/// be read from its connection).
#[derive(Debug)]
pub(crate) enum Upstreamed {
    Hyper(Incoming),
    Whole(Option<Bytes>),
    Plain(Box<h1_client::Streaming>),
}

impl http_body::Body for Upstreamed {
    type Data = Bytes;
    type Error = Box<dyn StdError + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Upstreamed::Hyper(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map_err(Into::into))),
            Upstreamed::Whole(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            Upstreamed::Plain(body) => body
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Upstreamed::Hyper(body) => body.is_end_stream(),
            Upstreamed::Whole(data) => data.is_none(),
            Upstreamed::Plain(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Upstreamed::Hyper(body) => body.size_hint(),
            Upstreamed::Whole(data) => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Upstreamed::Plain(body) => body.size_hint(),
        }
    }
}

pin_project! {
    /// A request body on its way to the upstream. One that is not empty notes when its last
    /// piece passed, so that the response timer counts from the end of the upload, not from
    /// its start: an upload longer than the timeout passes while it keeps moving, and one
    /// that stops is timed out from its last piece.
    ///
    /// While it waits on the client, the body also keeps its own timer on the client's
    /// deadlines (`timeout` after the last piece, and `min_body_rate`), as the task that
    /// drops its rest once the answer's head has come does ([`drain`]). Only a body that has
    /// to wait pays for the timer.
    #[project = UploadProj]
    #[derive(Debug)]
    pub(crate) struct Upload {
        // Taken by the task that reads and drops the rest once the answer has come
        // ([`Moved::cut`]).
        body: Option<Incoming>,
        moved: Option<Arc<Moved>>,
        // Bytes still allowed (`max_body_size`).
        allowed: u64,
        // The upstream's timeout: the longest the client may take over each piece.
        timeout: Duration,
        // Armed the first time the body waits on the client.
        client_timer: Option<Pin<Box<Sleep>>>,
        // Tells the response's side when the upload is over (ended, failed or dropped).
        gone: Option<Gone>,
        // Small pieces gathered into one before they go upstream.
        merge: Merge<BoxError>,
    }
}

type BoxError = Box<dyn StdError + Send + Sync>;

/// Pieces of a request body smaller than this are gathered into pieces of about this much
/// before they go upstream: a body sent in tiny chunks (or HTTP/2 `DATA` frames) otherwise
/// costs a write to the upstream per chunk (review: 1 MB in one-byte chunks took 1,000,000
/// `writev`s and 5.5 s of CPU).
const MERGE: usize = 16 * 1024;

/// A body's next piece, as [`Merge::poll`] asks for it: whether the wait is the client's, then
/// the piece and whether the body ended with it.
type PollPiece<'a, E> =
    dyn FnMut(&mut Context<'_>, bool) -> (Poll<Option<Result<Frame<Bytes>, E>>>, bool) + 'a;

/// How many yields in a row that bring no piece end a gathering. One is not enough: the next
/// chunk comes about two scheduler turns after the last was taken (measured: with one yield,
/// none of 20,000 one-byte chunks were gathered; with up to four, they went as two pieces,
/// each yield-run ending after two).
const YIELDS: u8 = 4;

/// Gathers a body's small pieces. hyper hands an HTTP/1.1 body on a chunk at a time, the next
/// one decoded only once the last is taken (on the client connection's task), so the pieces
/// behind a small one are never ready at once: a piece waits while yields to the scheduler
/// bring more, and goes when [`YIELDS`] in a row bring none, when it reaches [`MERGE`], or
/// when something that cannot join it comes (a large piece, trailers, the end, an error: held
/// for the next poll). A client that sends slowly has each piece wait that many yields.
#[derive(Debug)]
struct Merge<E> {
    buf: Option<BytesMut>,
    yielded: u8,
    held: Option<Option<Result<Frame<Bytes>, E>>>,
    /// The pieces that came back to back, joining others ([`Pieces::flooded`]).
    joined: Pieces,
}

/// A body is refused once [`FLOOD_PIECES`] of its pieces that came back to back average under
/// [`TINY`] bytes. Each piece costs the server library a hand-over between tasks, about a
/// microsecond: 1 MB in one-byte chunks took a second of CPU (nginx: 10 ms), a hundred times
/// what the bytes cost as ordinary requests. Refused at 1,024, such a body costs about what
/// its bytes would as requests, and it was charged as a request first. (Pieces that come one
/// at a time, each after a wait, are not counted while forwarded: a client streaming small
/// records. Pieces of a body whose answer has come, which go nowhere, all are: [`drain`].)
const FLOOD_PIECES: u64 = 1024;
/// Chunks of 8 bytes or more are never refused (a chunk split across two reads makes two
/// pieces: 8-byte chunks average a little under 8).
const TINY: u64 = 7;

/// A count of pieces and their bytes, for the tiny-piece flood ([`FLOOD_PIECES`]).
#[derive(Debug, Default, Clone, Copy)]
struct Pieces {
    count: u64,
    bytes: u64,
}

impl Pieces {
    fn add(&mut self, len: u64) {
        self.count += 1;
        self.bytes += len;
    }

    fn flooded(&self) -> bool {
        self.count >= FLOOD_PIECES && self.bytes < self.count * TINY
    }
}

impl<E> Default for Merge<E> {
    fn default() -> Self {
        Merge {
            buf: None,
            yielded: 0,
            held: None,
            joined: Pieces::default(),
        }
    }
}

impl<E> Merge<E> {
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        piece: &mut PollPiece<'_, E>,
    ) -> Poll<Option<Result<Frame<Bytes>, E>>> {
        if let Some(held) = self.held.take() {
            return Poll::Ready(held);
        }
        loop {
            // Only a wait with nothing in hand is the client's: hyper asks for the next piece.
            let (polled, ended) = piece(cx, self.buf.is_none());
            match polled {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if data.len() < MERGE && !ended => {
                        if self.buf.is_some() {
                            self.joined.add(data.len() as u64);
                        }
                        let buf = self.buf.get_or_insert_with(|| {
                            // Under `MERGE` before each piece, and each piece under it.
                            BytesMut::with_capacity(2 * MERGE)
                        });
                        buf.extend_from_slice(&data);
                        self.yielded = 0;
                        if buf.len() >= MERGE {
                            return Poll::Ready(self.take());
                        }
                    }
                    Ok(data) => return Poll::Ready(self.before(Some(Ok(Frame::data(data))))),
                    Err(frame) => return Poll::Ready(self.before(Some(Ok(frame)))),
                },
                Poll::Ready(other) => return Poll::Ready(self.before(other)),
                Poll::Pending if self.buf.is_none() => return Poll::Pending,
                Poll::Pending if self.yielded < YIELDS => {
                    self.yielded += 1;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Poll::Pending => return Poll::Ready(self.take()),
            }
        }
    }

    /// What was gathered, if anything, before `next` (held for the next poll); else `next`.
    fn before(&mut self, next: Option<Result<Frame<Bytes>, E>>) -> Option<Result<Frame<Bytes>, E>> {
        match self.buf {
            Some(_) => {
                self.held = Some(next);
                self.take()
            }
            None => next,
        }
    }

    fn take(&mut self) -> Option<Result<Frame<Bytes>, E>> {
        self.yielded = 0;
        let data = self.buf.take().unwrap_or_default().freeze();
        Some(Ok(Frame::data(data)))
    }

    /// Whether the body came in a flood of tiny pieces ([`FLOOD_PIECES`]).
    fn flooded(&self) -> bool {
        self.joined.flooded()
    }

    /// Whether nothing is in hand.
    fn is_empty(&self) -> bool {
        self.buf.is_none() && self.held.is_none()
    }

    /// The data bytes in hand.
    fn len(&self) -> u64 {
        let held = match &self.held {
            Some(Some(Ok(frame))) => frame.data_ref().map_or(0, Bytes::len),
            _ => 0,
        };
        (self.buf.as_ref().map_or(0, BytesMut::len) + held) as u64
    }
}

/// Dropped with its [`Upload`]: the upload is over, so what its response left to it (the
/// request's slots) is freed.
#[derive(Debug)]
struct Gone(Arc<Moved>);

impl Drop for Gone {
    fn drop(&mut self) {
        self.0.upload_over();
    }
}

/// What a request whose response ended before its upload keeps until the upload is over.
pub(crate) trait KeptUntilOver: Send {
    /// The upload stalled: what it kept is about to be freed.
    fn stalled(&mut self);
}

/// The upload of a request whose response may end before it does (an upstream that answers
/// at once and reads the body after). The request's slots (its place in `max_in_flight` and
/// its concurrency slots) are then kept until the upload is over too, so that a client
/// trickling an upload still holds them (review: six uploads past a concurrency limit of two
/// and `max_in_flight = 3`, all streaming at once), but not for longer than the upload goes
/// on making progress: after `timeout` without a piece (the client's stall is also the
/// upload's own error; an upstream that stops taking it is not), they are freed.
#[derive(Debug, Clone)]
pub(crate) struct UploadTail {
    moved: Arc<Moved>,
    timeout: Duration,
}

/// An answer the gateway does not pass on (its framing, say): its exchange is over, and the
/// upstream connection, if it waits on the rest of the request's body, is closed.
pub(crate) fn answer_dropped<B>(res: &Response<B>) {
    if let Some(tail) = res.extensions().get::<UploadTail>() {
        tail.response_over();
    }
}

impl UploadTail {
    /// The response is over before the upload: the upstream connection, which has sent its
    /// last piece of the body since the answer's head came ([`Moved::cut`]), is closed, its
    /// request's body cut short (never taken for whole), not reused.
    pub(crate) fn response_over(&self) {
        self.moved.answered.store(true, Ordering::Release);
        self.moved.cut();
    }

    /// Keeps `slots` until the upload is over or stalls, or `capacity` is cut at the end of
    /// the shutdown grace; drops them at once if the upload is over.
    pub(crate) fn keep_until_over(self, slots: Box<dyn KeptUntilOver>, capacity: Option<Capacity>) {
        // (`slots`, a parameter, is dropped after the lock's guard when it is not kept.)
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut tail = self.moved.tail.lock().unwrap_or_else(|e| e.into_inner());
        if tail.over {
            return;
        }
        tail.kept = Some(slots);
        drop(tail);
        runtime.spawn(self.watch(capacity));
    }

    /// Ends when the upload is over, or frees the slots kept once it has made no progress for
    /// `timeout`, or at the cut (an upload the upstream is not taking is not polled, so would
    /// not see the cut itself: its concurrency leases in the shared store must still be
    /// released in the grace's last second, not left to expire).
    async fn watch(self, capacity: Option<Capacity>) {
        let cut = async {
            match &capacity {
                Some(capacity) => capacity.cut_off().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(cut);
        let stalled = loop {
            tokio::select! {
                () = tokio::time::sleep_until(self.moved.deadline(self.timeout)) => {}
                // Woken as the upload ends, so that a watcher lives no longer than its upload.
                () = self.moved.over_now.notified() => {}
                () = cut.as_mut() => break false,
            }
            let tail = self.moved.tail.lock().unwrap_or_else(|e| e.into_inner());
            if tail.over {
                return;
            }
            if self.moved.deadline(self.timeout) <= Instant::now() {
                break true;
            }
        };
        let kept = self
            .moved
            .tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .kept
            .take();
        if let Some(mut kept) = kept {
            if stalled {
                tracing::debug!(timeout = ?self.timeout, "an upload that outlived its response made no progress: its request ends");
                kept.stalled();
            }
            drop(kept);
        }
    }
}

/// The client stopped sending the request body, or sent it slower than `min_body_rate`.
#[derive(Debug, thiserror::Error)]
#[error("the client sent the request body too slowly")]
struct ClientTooSlow;

/// The answer came before the request body ended, and is over: the body, whose rest was read
/// and dropped, ends in an error, so that the upstream connection closes rather than take it
/// for whole.
#[derive(Debug, thiserror::Error)]
#[error("the response ended before the request body: its rest was not forwarded")]
struct AnsweredFirst;

/// A request body came in a flood of tiny pieces ([`FLOOD_PIECES`]): answered 400.
#[derive(Debug, thiserror::Error)]
#[error("the request body came in a flood of tiny pieces")]
struct PiecesTooSmall;

/// A request body went past `max_body_size` while it was forwarded.
#[derive(Debug, thiserror::Error)]
#[error("the request body is larger than max_body_size")]
struct BodyTooLarge;

/// The client's request body failed (hyper's error inside): answered 400, not 502.
#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed")]
struct ClientBody(#[source] hyper::Error);

/// How a request body is coming: when its last piece passed, how much came, whether the
/// gateway is waiting on the client for more, and for how long it has waited on the client
/// in all (the minimum rate is asked of that time only: time the upstream spends not taking
/// the body is not the client's).
#[derive(Debug)]
struct Moved {
    start: Instant,
    /// Nanoseconds after `start`.
    last: AtomicU64,
    bytes: AtomicU64,
    /// [`MOVING`], [`WAITING`] or [`ENDED`].
    state: AtomicU8,
    /// Nanoseconds spent waiting on the client, in stretches that ended.
    waited: AtomicU64,
    /// Nanoseconds after `start` when the current stretch of waiting began.
    wait_since: AtomicU64,
    min_rate: Option<MinBodyRate>,
    /// What the response, if it ended first, left for the upload's end to free.
    tail: Mutex<Tail>,
    /// Wakes the watcher of what is kept when the upload is over.
    over_now: tokio::sync::Notify,
    /// Set when the answer's head came first: the rest of the body is read and dropped, not
    /// forwarded ([`Moved::cut`]); it wakes the task polling the body while it waits on the
    /// client.
    cut: Cut,
    /// Set when, after that, the answer is over too: the upstream connection is then closed
    /// ([`UploadTail::response_over`]).
    answered: std::sync::atomic::AtomicBool,
}

/// The slots a response that ended before its upload left to it.
#[derive(Default)]
struct Tail {
    kept: Option<Box<dyn KeptUntilOver>>,
    /// The upload is over: nothing more is kept.
    over: bool,
}

impl std::fmt::Debug for Tail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tail")
            .field("kept", &self.kept.is_some())
            .field("over", &self.over)
            .finish()
    }
}

/// The body's last poll gave a piece: the next is not asked for yet (the upstream may not be
/// taking what it has).
const MOVING: u8 = 0;
/// The body's last poll found nothing yet: the client owes the next piece.
const WAITING: u8 = 1;
/// The whole body has come.
const ENDED: u8 = 2;

/// What the response timer finds when it fires.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Nothing is late yet: look again then.
    Wait(Instant),
    /// The client owes the body's next piece and is past its deadline (`timeout` after the
    /// last piece, or behind `min_body_rate`): 408.
    ClientStalled,
    /// The body has come (or the upstream is not taking it) and the upstream is late: 504.
    UpstreamLate,
}

impl Moved {
    fn new(min_rate: Option<MinBodyRate>) -> Self {
        Moved {
            start: Instant::now(),
            last: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            state: AtomicU8::new(MOVING),
            waited: AtomicU64::new(0),
            wait_since: AtomicU64::new(0),
            min_rate,
            tail: Mutex::default(),
            over_now: tokio::sync::Notify::new(),
            cut: Cut::default(),
            answered: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The task polling the body waits on the client: the cut wakes it.
    fn wake_on_cut(&self, cx: &Context<'_>) {
        self.cut.wake_on_cut(cx);
    }

    fn is_cut(&self) -> bool {
        self.cut.is_cut()
    }

    /// The answer's head has come while the body is still coming: nothing more of the body
    /// goes upstream, however slowly the client takes the answer. An upstream that answers
    /// without reading the body and takes what follows for its next requests would otherwise
    /// serve requests no limit counted (review: 50 requests in one body past a limit of 2,
    /// also with the answer read slowly; RFC 9112 section 11.2). The task polling the body is
    /// woken to hand it off ([`hand_off`]).
    fn cut(&self) {
        self.cut.cut();
    }

    /// The upload has ended, failed or been dropped: what its response left is freed.
    fn upload_over(&self) {
        let kept = {
            let mut tail = self.tail.lock().unwrap_or_else(|e| e.into_inner());
            tail.over = true;
            tail.kept.take()
        };
        if kept.is_some() {
            self.over_now.notify_one();
        }
        drop(kept);
    }

    fn nanos_since_start(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The body's poll found nothing: a stretch of waiting on the client begins (or goes on).
    fn wait(&self) {
        if self.state.swap(WAITING, Ordering::AcqRel) != WAITING {
            self.wait_since
                .store(self.nanos_since_start(), Ordering::Release);
        }
    }

    /// A piece of `len` bytes came (or the end): the body is `state` now.
    fn note(&self, state: u8, len: u64) {
        let nanos = self.nanos_since_start();
        if self.state.swap(state, Ordering::AcqRel) == WAITING {
            let since = self.wait_since.load(Ordering::Acquire);
            self.waited
                .fetch_add(nanos.saturating_sub(since), Ordering::AcqRel);
        }
        self.last.store(nanos, Ordering::Release);
        self.bytes.fetch_add(len, Ordering::AcqRel);
    }

    /// `timeout` after the last piece (or the end).
    fn deadline(&self, timeout: Duration) -> Instant {
        self.start + Duration::from_nanos(self.last.load(Ordering::Acquire)) + timeout
    }

    /// Waiting time the body has left before it falls behind `min_body_rate`: the grace, or
    /// the time its bytes so far buy at the rate if longer, less what it has waited already.
    fn rate_allowance(&self, rate: MinBodyRate) -> Duration {
        let bytes = self.bytes.load(Ordering::Acquire);
        let bought = Duration::from_secs_f64(bytes as f64 / rate.bytes_per_second as f64);
        let waited = Duration::from_nanos(self.waited.load(Ordering::Acquire));
        rate.grace.max(bought).saturating_sub(waited)
    }

    /// The first moment the timer must look at this body: the earliest a client could fall
    /// behind the rate is once it has waited the grace.
    fn next_check(&self, timeout: Duration) -> Instant {
        let deadline = self.deadline(timeout);
        self.min_rate
            .map_or(deadline, |r| deadline.min(self.start + r.grace))
    }

    fn verdict(&self, timeout: Duration, now: Instant) -> Verdict {
        let deadline = self.deadline(timeout);
        let state = self.state.load(Ordering::Acquire);
        let waiting = state == WAITING;
        // Behind the rate: when the current stretch of waiting uses up the allowance (a body
        // that has ended owes nothing).
        let rate_due = self.min_rate.filter(|_| state != ENDED).map(|rate| {
            let allowance = self.rate_allowance(rate);
            if waiting {
                let since = self.wait_since.load(Ordering::Acquire);
                self.start + Duration::from_nanos(since) + allowance
            } else {
                // Not waiting: the allowance from now at the soonest, and not more often than
                // once a second while the upstream is not taking the body.
                now + allowance.max(Duration::from_secs(1))
            }
        });
        if !waiting {
            return if deadline > now {
                Verdict::Wait(rate_due.map_or(deadline, |r| r.min(deadline)))
            } else {
                Verdict::UpstreamLate
            };
        }
        let due = rate_due.map_or(deadline, |r| r.min(deadline));
        if due > now {
            Verdict::Wait(due)
        } else {
            Verdict::ClientStalled
        }
    }
}

impl Upload {
    fn new(body: Incoming, allowed: u64, min_rate: Option<MinBodyRate>, timeout: Duration) -> Self {
        // Most requests have no body: no clock and no allocation for them.
        let moved =
            (!http_body::Body::is_end_stream(&body)).then(|| Arc::new(Moved::new(min_rate)));
        Upload {
            body: Some(body),
            gone: moved.clone().map(Gone),
            moved,
            allowed,
            timeout,
            client_timer: None,
            merge: Merge::default(),
        }
    }
}

/// Whether the client, which owes the body's next piece, is past its deadline; if not, the
/// body's timer is set to wake the task at that deadline.
fn client_late(
    timer: &mut Option<Pin<Box<Sleep>>>,
    moved: &Moved,
    timeout: Duration,
    cx: &mut Context<'_>,
) -> bool {
    loop {
        let at = match moved.verdict(timeout, Instant::now()) {
            Verdict::Wait(at) => at,
            Verdict::ClientStalled => return true,
            // Only a body that is not waiting on its client can find the upstream late.
            Verdict::UpstreamLate => return false,
        };
        let sleep = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        // A deadline that moved later (a piece came) can wait for the earlier one to fire:
        // one timer operation per wait that ends, not per piece.
        if at < sleep.deadline() || sleep.is_elapsed() {
            sleep.as_mut().reset(at);
        }
        if sleep.as_mut().poll(cx).is_pending() {
            return false;
        }
    }
}

impl http_body::Body for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let mut this = self.project();
        if let Some(moved) = this.moved.as_ref().filter(|m| m.is_cut()) {
            let moved = Arc::clone(moved);
            hand_off(&mut this);
            // The upstream connection waits for the rest of the body while its answer comes;
            // once the answer is over, it is closed. (Looked at once woken: registered first.)
            moved.wake_on_cut(cx);
            if moved.answered.load(Ordering::Acquire) {
                return Poll::Ready(Some(Err(Box::new(AnsweredFirst))));
            }
            return Poll::Pending;
        }
        // Taken out for the call, as the pieces are polled through `this`.
        let mut merge = std::mem::take(this.merge);
        let polled = merge.poll(cx, &mut |cx: &mut Context<'_>, asked| {
            let polled = poll_piece(&mut this, cx, asked);
            (polled, ended(this.body))
        });
        if merge.flooded() {
            return Poll::Ready(Some(Err(Box::new(PiecesTooSmall))));
        }
        *this.merge = merge;
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.merge.is_empty() && ended(&self.body)
    }

    fn size_hint(&self) -> SizeHint {
        let Some(body) = &self.body else {
            return SizeHint::default();
        };
        let mut hint = body.size_hint();
        let held = self.merge.len();
        hint.set_lower(hint.lower() + held);
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + held);
        }
        hint
    }
}

/// Whether a body has ended (or was handed off).
fn ended(body: &Option<Incoming>) -> bool {
    body.as_ref().is_none_or(http_body::Body::is_end_stream)
}

/// The answer's head has come while the body is still coming ([`Moved::cut`]): nothing more
/// of it goes upstream. What was gathered is dropped, and the rest goes to a task of its own
/// that reads and drops it (once).
fn hand_off(this: &mut UploadProj<'_>) {
    *this.merge = Merge::default();
    if let (Some(body), Some(moved)) = (this.body.take(), this.moved.clone()) {
        let gone = this.gone.take();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(drain(body, moved, gone, *this.allowed, *this.timeout));
        }
    }
}

/// Reads and drops the rest of a body whose answer has come, so that the client's connection
/// can be read past it, held to the same deadlines (`timeout` after its last piece,
/// `min_body_rate`) and `max_body_size` as before; it is over when it ends or fails, or is
/// cut at a deadline or the limit. (Its request's slots wait for that: [`UploadTail`].)
async fn drain(
    mut body: Incoming,
    moved: Arc<Moved>,
    gone: Option<Gone>,
    mut allowed: u64,
    timeout: Duration,
) {
    use http_body_util::BodyExt;
    let _gone = gone;
    let mut pieces = Pieces::default();
    loop {
        moved.wait();
        let frame = {
            let next = body.frame();
            tokio::pin!(next);
            loop {
                let Verdict::Wait(at) = moved.verdict(timeout, Instant::now()) else {
                    return;
                };
                tokio::select! {
                    frame = next.as_mut() => break frame,
                    () = tokio::time::sleep_until(at) => {}
                }
            }
        };
        let len = match frame {
            Some(Ok(frame)) => frame.data_ref().map_or(0, |d| d.len() as u64),
            _ => break,
        };
        if body.is_end_stream() {
            break;
        }
        // A flood of tiny pieces, which go nowhere: the body is left unread, so its connection
        // closes (HTTP/1.1) or its stream is reset (review: the flood guard did not apply here).
        pieces.add(len);
        if pieces.flooded() {
            tracing::debug!("a dropped request body came in a flood of tiny pieces: left unread");
            return;
        }
        moved.note(MOVING, len);
        match allowed.checked_sub(len) {
            Some(left) => allowed = left,
            None => return,
        }
    }
    moved.note(ENDED, 0);
}

/// The body's next piece, counted (its time and size, `max_body_size`). A wait for the
/// client is noted, and its deadlines looked at, only if the piece is asked for (`asked`):
/// not when looking for more to merge with one in hand.
fn poll_piece(
    this: &mut UploadProj<'_>,
    cx: &mut Context<'_>,
    asked: bool,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    let Some(body) = this.body.as_mut() else {
        return Poll::Ready(Some(Err(Box::new(AnsweredFirst))));
    };
    let polled = Pin::new(&mut *body).poll_frame(cx);
    let at_end = body.is_end_stream();
    let len = match &polled {
        Poll::Ready(Some(Ok(frame))) => frame.data_ref().map_or(0, |d| d.len() as u64),
        _ => 0,
    };
    if let Some(moved) = this.moved {
        match &polled {
            Poll::Pending if !asked => {}
            Poll::Pending => {
                moved.wait();
                moved.wake_on_cut(cx);
                if client_late(this.client_timer, moved, *this.timeout, cx) {
                    return Poll::Ready(Some(Err(Box::new(ClientTooSlow))));
                }
            }
            Poll::Ready(Some(Ok(_))) if !at_end => moved.note(MOVING, len),
            Poll::Ready(_) => {
                moved.note(ENDED, len);
                moved.upload_over();
            }
        }
    }
    if len > 0 {
        match this.allowed.checked_sub(len) {
            Some(left) => *this.allowed = left,
            None => return Poll::Ready(Some(Err(Box::new(BodyTooLarge)))),
        }
    }
    // Coerced, not `into()`: that would box the box, and hide the type from `caused_by`.
    let client_body = |e| -> BoxError { Box::new(ClientBody(e)) };
    polled.map(|frame| frame.map(|f| f.map_err(client_body)))
}

/// Whether `e` or one of its sources is an `E`.
fn caused_by<E: StdError + 'static>(e: &(dyn StdError + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<E>() {
            return true;
        }
        cur = err.source();
    }
    false
}

/// A connect timeout is a 504 (the upstream did not answer in time), like nginx.
fn caused_by_timeout(e: &(dyn StdError + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err
            .downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::TimedOut)
        {
            return true;
        }
        cur = err.source();
    }
    false
}

fn display_chain(e: &(dyn StdError + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        out.push_str(": ");
        out.push_str(&err.to_string());
        cur = err.source();
    }
    out
}

/// Removes hop-by-hop headers, including every header the `Connection` header names. One
/// pass over the names, without hashing or copying, in the usual cases: none at all (a
/// request), or a `Connection` header alone naming nothing else (`keep-alive`, `close`: most
/// responses).
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap, keep: &[HeaderName]) -> Stripped {
    let (mut found, mut connection, mut te) = (0usize, false, false);
    for name in headers.keys() {
        if is_hop_by_hop(name) {
            found += 1;
            connection |= *name == CONNECTION;
            te |= *name == TE;
        }
    }
    let mut stripped = Stripped::default();
    if found == 0 {
        return stripped;
    }
    stripped.takes_trailers = te
        && headers
            .get_all(TE)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"));
    if connection {
        // The headers it names, other than `close` (names none), `keep-alive` (removed
        // below anyway), `host` and those in `keep` (the request was routed and counted by
        // them: the upstream must see what the gateway saw, or a caller could be counted
        // under one key and served under another), and `x-request-id` (the gateway's own,
        // which the upstream's logs are matched by: review); an invalid name names nothing.
        stripped.named = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|n| {
                !["close", "keep-alive", "host", "x-request-id"]
                    .iter()
                    .any(|k| n.eq_ignore_ascii_case(k))
            })
            .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
            .filter(|n| !keep.contains(n))
            .collect();
        for name in &stripped.named {
            headers.remove(name);
        }
        headers.remove(CONNECTION);
        if found == 1 {
            return stripped;
        }
    }
    let rest: smallvec::SmallVec<[HeaderName; 4]> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n))
        .cloned()
        .collect();
    for name in rest {
        headers.remove(name);
    }
    stripped
}

/// What [`strip_hop_by_hop`] found that outlives the header section.
#[derive(Debug, Default)]
pub(crate) struct Stripped {
    /// A `TE` said `trailers`: the sender takes trailer fields, which a request's next hop
    /// may be told again (see [`prepare_request`]).
    pub(crate) takes_trailers: bool,
    /// The fields `Connection` named (other than those always removed): connection-specific
    /// in the trailer section too (RFC 9110 section 6.5.1), where they are removed as well.
    pub(crate) named: smallvec::SmallVec<[HeaderName; 2]>,
}

/// `Max-Forwards` on a `TRACE` or `OPTIONS` (RFC 9110 section 7.6.2): decremented on its
/// way through, and at 0 the request goes no further: the gateway answers it as its final
/// recipient (`true`). A value that is not a number is passed on as it came.
pub(crate) fn max_forwards_spent<B>(req: &mut Request<B>) -> bool {
    use http::header::MAX_FORWARDS;
    if !matches!(*req.method(), Method::OPTIONS | Method::TRACE) {
        return false;
    }
    let Some(value) = req.headers().get(MAX_FORWARDS) else {
        return false;
    };
    match value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        Some(0) => true,
        Some(n) => {
            req.headers_mut()
                .insert(MAX_FORWARDS, HeaderValue::from(n - 1));
            false
        }
        None => false,
    }
}

/// An upstream response's `Content-Length` as the gateway passes it on: none on a `204` (RFC
/// 9110 section 8.6: a server must not send one), and one value where the upstream repeated it
/// (`5, 5`, or the field twice: the upstream's parser refused any that differ), as an
/// intermediary should (same section). HTTP/2 clients refuse the response otherwise (review:
/// curl failed with `PROTOCOL_ERROR`), and HTTP/1.1 ones got the list as sent. Leading zeros
/// go too, as on requests ([`canonical_content_length`]).
pub(crate) fn one_content_length(status: StatusCode, headers: &mut HeaderMap) {
    if status == StatusCode::NO_CONTENT {
        headers.remove(http::header::CONTENT_LENGTH);
        return;
    }
    canonical_content_length(headers);
}

/// A `Content-Length` as the gateway framed the body: one value, its digits without leading
/// zeros. The client's `010` or `0003` (which hyper reads as 10 and 3) went on as
/// written (review), and an upstream reading a leading zero as octal (C's `strtol` with base
/// 0) or capping the digits it reads would split the body elsewhere than the gateway did:
/// on a kept connection, the rest read as another request. Left alone when already one
/// plain number, as nearly every request's is.
pub(crate) fn canonical_content_length(headers: &mut HeaderMap) {
    use http::header::CONTENT_LENGTH;
    let mut values = headers.get_all(CONTENT_LENGTH).iter();
    let Some(first) = values.next() else {
        return;
    };
    let digits = first.as_bytes();
    let plain = values.next().is_none()
        && !digits.is_empty()
        && (digits[0] != b'0' || digits.len() == 1)
        && digits.iter().all(u8::is_ascii_digit);
    if plain {
        return;
    }
    // hyper and h2 refused values that differ or are not numbers: the first value's number is
    // the length they framed.
    let number = digits
        .split(|&b| b == b',')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    if let Some(n) = std::str::from_utf8(number)
        .ok()
        .and_then(|n| n.parse::<u64>().ok())
    {
        headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
    }
}

/// Hop-by-hop headers (RFC 9110 section 7.6.1), `Proxy-Connection` (pre-standard) and
/// `HTTP2-Settings`, which belongs to an `h2c` upgrade (RFC 7540 section 3.2.1) that is never
/// forwarded. Not `Trailer` (RFC 2616 listed it; RFC 9110 section 6.6.2 does not): it names
/// the trailer fields to come, end to end, and hyper's HTTP/1.1 side passes on only the
/// trailer fields it names. Names are lower case; a `match` on them compiles to a switch on the length and
/// one comparison, where comparing with a list of `HeaderName`s cost ~70 instructions a header.
pub(crate) fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "transfer-encoding"
            | "upgrade"
            | "http2-settings"
    )
}

/// The protocol an HTTP/1.1 request asks to switch to (`Connection: upgrade` and an `Upgrade`
/// header, e.g. `websocket`), if any and if it may be forwarded (not `h2c`).
pub(crate) fn upgrade_protocol<B>(req: &Request<B>) -> Option<HeaderValue> {
    if req.version() != http::Version::HTTP_11 {
        return None;
    }
    let asks = req
        .headers()
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    let protocol = req.headers().get(UPGRADE).filter(|_| asks)?;
    // Cleartext HTTP/2 would give the client a raw HTTP/2 connection to the upstream, behind
    // the gateway's back (routes and limits decided once, for the handshake): "h2c
    // smuggling". The request goes on without the upgrade.
    let h2c = protocol.to_str().map_or(true, |p| {
        p.split(',').any(|t| t.trim().eq_ignore_ascii_case("h2c"))
    });
    (!h2c).then(|| protocol.clone())
}

/// Whether a `101`'s `Upgrade` (`got`) names only protocols the client asked for (`asked`),
/// in any case: a server must switch to one of them (RFC 9110 section 7.8). Anything else, or
/// none, is no switch the client can follow (or one it did not ask for, e.g. to `h2c`, a
/// raw HTTP/2 connection to the upstream behind the gateway's back).
pub(crate) fn switched_as_asked(asked: &HeaderValue, got: Option<&HeaderValue>) -> bool {
    fn tokens(v: &HeaderValue) -> impl Iterator<Item = &str> {
        let text = v.to_str().unwrap_or_default();
        text.split(',').map(str::trim).filter(|t| !t.is_empty())
    }
    let Some(got) = got else {
        return false;
    };
    tokens(got).next().is_some()
        && tokens(got).all(|p| tokens(asked).any(|a| a.eq_ignore_ascii_case(p)))
}

/// Puts back the two hop-by-hop headers of a protocol switch, which the upstream (on a
/// request) or the client (on a `101` response) must see, with the `TE` a request may still
/// carry (see [`prepare_request`]).
pub(crate) fn set_upgrade(headers: &mut HeaderMap, protocol: HeaderValue) {
    let connection = if headers.contains_key(TE) {
        "upgrade, te"
    } else {
        "upgrade"
    };
    headers.insert(CONNECTION, HeaderValue::from_static(connection));
    headers.insert(UPGRADE, protocol);
}

/// A connection's peer, with what every request on the connection needs of it worked out
/// once: whether it is a trusted proxy, and its address written out for `X-Forwarded-For`
/// (formatting an address cost more than the rest of a request's rewrite).
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    /// The address (an IPv4-mapped IPv6 address as IPv4).
    pub(crate) ip: IpAddr,
    /// Whether the peer is a trusted proxy, whose forwarding headers are believed.
    pub(crate) trusted: bool,
    forwarded: HeaderValue,
}

impl Peer {
    /// The peer at `addr`; `is_trusted` tells trusted proxies (`Identify::is_trusted`).
    pub(crate) fn new(addr: IpAddr, is_trusted: impl FnOnce(IpAddr) -> bool) -> Self {
        let ip = addr.to_canonical();
        let forwarded =
            HeaderValue::from_str(&ip.to_string()).expect("an address is a valid header value");
        Peer {
            ip,
            trusted: is_trusted(ip),
            forwarded,
        }
    }
}

/// Rewrites request headers for the upstream: hop-by-hop stripped, the peer appended to a
/// trusted proxy's `X-Forwarded-For` (anyone else's is replaced by the peer), `X-Forwarded-Proto` set (kept only from a trusted proxy), `Host` kept
/// (replaced by the target's authority where it has one: HTTP/2's `:authority`, an absolute-form
/// target; `upstream`'s own for a request that names no host: HTTP/1.0, or HTTP/2 without
/// `:authority`), and HTTP/2's `cookie` fields joined into one
/// line (RFC 9113 section 8.2.3: many HTTP/1.1 servers read only the first).
pub(crate) fn prepare_request<B>(
    req: &mut Request<B>,
    peer: &Peer,
    upstream: &Authority,
    identity: &IdentityHeaders,
) {
    if req.version() == http::Version::HTTP_2 {
        join_cookies(req.headers_mut());
    }
    // A client that takes trailer fields (gRPC's, say) is said to the upstream to take them
    // again: the gateway passes them on (to an HTTP/1.1 client, those named in `Trailer`,
    // as hyper does; an HTTP/1.0 client can take none). `TE` is for the next hop only, so
    // `Connection` names it (RFC 9110 section 10.1.4).
    let stripped = strip_hop_by_hop(req.headers_mut(), &identity.names);
    if stripped.takes_trailers && req.version() != http::Version::HTTP_10 {
        let headers = req.headers_mut();
        headers.insert(TE, HeaderValue::from_static("trailers"));
        headers.insert(CONNECTION, HeaderValue::from_static("te"));
    }
    // A target's authority (an absolute-form HTTP/1 target, HTTP/2's `:authority`) replaces
    // `Host` (RFC 9112 section 3.2.2, RFC 9113 section 8.3.1): [`bad_host`] has held the two
    // to one host, but `Host` may leave out a port the target names.
    let authority = req.uri().authority();
    if authority.is_some() || !req.headers().contains_key(HOST) {
        let host = authority.unwrap_or(upstream).as_str();
        if let Ok(host) = HeaderValue::from_str(host) {
            req.headers_mut().insert(HOST, host);
        }
    }
    let version = req.version();
    let headers = req.headers_mut();
    // Which of the fields below the request carries, in one pass over the names without
    // hashing: most carry none, and each lookup by name hashes it.
    let (mut xff_sent, mut xfp_sent, mut spoofable) = (false, false, false);
    let (mut underscores, mut claims, mut length_sent) = (false, false, false);
    let mut trailer = false;
    for name in headers.keys() {
        match name.as_str() {
            "content-length" => length_sent = true,
            "trailer" => trailer = true,
            "x-forwarded-for" => xff_sent = true,
            "x-forwarded-proto" => xfp_sent = true,
            "x-forwarded-host" | "forwarded" | "x-real-ip" => spoofable = true,
            "x-request-id" => {}
            "x-forwarded-ssl"
            | "x-forwarded-scheme"
            | "front-end-https"
            | "x-url-scheme"
            | "x-forwarded-port"
            | "x-forwarded-prefix"
            | "x-forwarded-server"
            | "x-host"
            | "x-client-ip"
            | "true-client-ip"
            | "x-cluster-client-ip"
            | "cf-connecting-ip"
            | "fastly-client-ip"
            | "x-original-url"
            | "x-rewrite-url"
            | "x-scheme"
            | "x-forwarded-protocol"
            | "client-ip"
            | "x-original-host"
            | "x-forwarded-uri"
            | "x-original-uri" => claims = true,
            other => {
                // Only a name as long as one a lookalike could spell is looked into.
                underscores |= identity.lookalike_lengths & length_bit(other.len()) != 0
                    && (identity.underscored || has_cgi_separator(other));
            }
        }
    }
    if length_sent {
        canonical_content_length(headers);
    }
    if trailer {
        // A request's trailer fields are not passed on (hyper's client sends only those
        // `Trailer` names): they could say what the gateway removed or counted the request
        // by, after it decided (`X-Api-Key`, `X-Forwarded-For`, a field `Connection` named),
        // to an upstream that merges them into the header section (review).
        headers.remove(http::header::TRAILER);
    }
    if underscores {
        drop_lookalikes(headers, &identity.names, !peer.trusted);
    }
    if claims && !peer.trusted {
        // What a proxy in front would say about the request (its scheme, port or prefix, the
        // client's address, the URL before a rewrite), said by the caller itself: frameworks
        // read these before or instead of X-Forwarded-Proto and X-Forwarded-For (Rack's
        // X-Forwarded-Ssl, request-ip's X-Client-IP), and IIS or Symfony serve
        // X-Original-URL's path instead of the one routed and counted (review).
        for name in CLAIMS {
            headers.remove(name);
        }
    }
    // As bytes: a value that is not text (a client's stray byte a proxy passed on) is carried
    // on, not dropped with the chain it is part of. Only a trusted proxy's chain goes on: from
    // anyone else it is the caller's own word, which the gateway did not count by, and an
    // upstream reading its leftmost entry would take it for the client.
    let mut xff: Vec<u8> = Vec::new();
    if xff_sent && peer.trusted {
        for v in headers.get_all(&X_FORWARDED_FOR) {
            let v = v.as_bytes().trim_ascii();
            if !v.is_empty() {
                xff.extend_from_slice(v);
                xff.extend_from_slice(b", ");
            }
        }
    }
    let forwarded = if xff.is_empty() {
        Some(peer.forwarded.clone())
    } else {
        xff.extend_from_slice(peer.forwarded.as_bytes());
        HeaderValue::from_bytes(&xff).ok()
    };
    if let Some(v) = forwarded {
        headers.insert(X_FORWARDED_FOR.clone(), v);
    }
    if !(peer.trusted && xfp_sent) {
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    }
    // A gateway says it was on the way (RFC 9110 section 7.6.3), after any `Via` before it:
    // the protocol it received the request in, and its name.
    headers.append(http::header::VIA, via(version));
    if !peer.trusted && spoofable {
        // A caller's own word on the host (`X-Forwarded-Host`, `Forwarded: host=`) would have
        // an upstream that believes it (Rails, Django, Express behind a proxy) serve another
        // host than the one the request was routed and counted by: the host is the routed
        // one, and `Forwarded` from an untrusted peer is dropped (the gateway writes its
        // facts in X-Forwarded-For and X-Forwarded-Proto).
        if let Some(claimed) = headers.remove(&X_FORWARDED_HOST) {
            let routed = headers.get(HOST).cloned().unwrap_or(claimed);
            headers.insert(X_FORWARDED_HOST.clone(), routed);
        }
        headers.remove(http::header::FORWARDED);
        // `X-Real-IP` (nginx's, read by many frameworks) from the caller itself: the address
        // is the peer's.
        if headers.contains_key(&X_REAL_IP) {
            headers.insert(X_REAL_IP.clone(), peer.forwarded.clone());
        }
    }
}

static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// The `Via` entry for a request received in `version`.
fn via(version: http::Version) -> HeaderValue {
    HeaderValue::from_static(match version {
        http::Version::HTTP_2 => "2 sluice",
        http::Version::HTTP_10 => "1.0 sluice",
        _ => "1.1 sluice",
    })
}

/// The headers callers are identified and counted by (a `Connection` header cannot remove
/// them, and their lookalikes are dropped), with what looking for lookalikes needs, worked
/// out once rather than per request.
#[derive(Debug)]
pub(crate) struct IdentityHeaders {
    names: Vec<HeaderName>,
    /// The lengths a lookalike of these or of [`WRITTEN`] has, as [`length_bit`]s.
    lookalike_lengths: u64,
    /// Whether one of them holds `_` or `.` (`header:x_custom`): its lookalikes need none.
    underscored: bool,
}

impl IdentityHeaders {
    pub(crate) fn new(names: Vec<HeaderName>) -> Self {
        let lookalike_lengths = names.iter().fold(WRITTEN_LENGTHS | CLAIMS_LENGTHS, |m, h| {
            m | length_bit(h.as_str().len())
        });
        let underscored = names.iter().any(|h| has_cgi_separator(h.as_str()));
        IdentityHeaders {
            names,
            lookalike_lengths,
            underscored,
        }
    }
}

/// Fields a proxy in front writes about the request, passed on only from `trusted_proxies`.
const CLAIMS: [&str; 21] = [
    "x-forwarded-ssl",
    "x-forwarded-scheme",
    "front-end-https",
    "x-url-scheme",
    "x-forwarded-port",
    "x-forwarded-prefix",
    "x-forwarded-server",
    "x-host",
    "x-client-ip",
    "true-client-ip",
    "x-cluster-client-ip",
    "cf-connecting-ip",
    "fastly-client-ip",
    "x-original-url",
    "x-rewrite-url",
    "x-scheme",
    "x-forwarded-protocol",
    "client-ip",
    "x-original-host",
    "x-forwarded-uri",
    "x-original-uri",
];

/// [`CLAIMS`]'s lengths, as [`length_bit`]s.
const CLAIMS_LENGTHS: u64 = lengths_of(&CLAIMS);

/// The fields the gateway writes for the upstream.
const WRITTEN: [&str; 5] = [
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-real-ip",
    "x-request-id",
];

/// [`WRITTEN`]'s lengths, as [`length_bit`]s.
const WRITTEN_LENGTHS: u64 = lengths_of(&WRITTEN);

/// The lengths of `names`, as [`length_bit`]s.
const fn lengths_of(names: &[&str]) -> u64 {
    let mut mask = 0;
    let mut i = 0;
    while i < names.len() {
        mask |= length_bit(names[i].len());
        i += 1;
    }
    mask
}

/// Whether `name` holds a `_` or a `.`, which CGI-style servers read as `-` (see
/// [`drop_lookalikes`]), eight bytes at a time (a `memchr` call per name, or a loop over its
/// bytes, cost several times more on the short names of a request).
fn has_cgi_separator(name: &str) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    const UNDERSCORES: u64 = u64::from_ne_bytes([b'_'; 8]);
    const DOTS: u64 = u64::from_ne_bytes([b'.'; 8]);
    // A zero byte in `word` is a match in the name (the classic "has a zero byte" test, exact
    // here: names are ASCII, so no byte of `word` has its high bit set).
    let zero_byte = |word: u64| word.wrapping_sub(ONES) & !word & HIGHS != 0;
    let mut chunks = name.as_bytes().chunks_exact(8);
    for chunk in chunks.by_ref() {
        let word = u64::from_ne_bytes(chunk.try_into().expect("eight bytes"));
        if zero_byte(word ^ UNDERSCORES) || zero_byte(word ^ DOTS) {
            return true;
        }
    }
    chunks.remainder().iter().any(|&b| b == b'_' || b == b'.')
}

/// A bit for a name's length (one bit for every length from 63 on), to look only into names
/// a lookalike could be.
const fn length_bit(len: usize) -> u64 {
    1 << if len < 63 { len } else { 63 }
}

/// Removes the fields whose names spell, with `_`, `.` and `-` taken as one, a name the gateway
/// identifies callers by (`identity`) or writes for the upstream (`X-Forwarded-*`,
/// `X-Real-IP`, `X-Request-Id`), without being it: `X_Api_Key`, `X_Forwarded_For`, or
/// `x-custom` when `header:x_custom` is configured. CGI-style servers (Python's WSGI servers,
/// Rack, PHP) read both spellings as one variable (`HTTP_X_API_KEY`), so such a field would
/// carry a key the gateway did not count by, or an address or host it did not write; nginx
/// drops names with underscores for the same reason (`underscores_in_headers`). From a peer
/// outside `trusted_proxies` ([`CLAIMS`] are dropped then), so are their spellings. The names
/// themselves, and other names with underscores, go on as they came. PHP also reads a `.` as
/// `_` (`X.Api.Key` is `HTTP_X_API_KEY` behind `php -S`, Caddy's `php_fastcgi`, FrankenPHP;
/// review: such a field carried a key the gateway had not counted).
fn drop_lookalikes(headers: &mut HeaderMap, identity: &[HeaderName], untrusted: bool) {
    let spells = |name: &str, other: &str| {
        name != other
            && name.len() == other.len()
            && name
                .bytes()
                .zip(other.bytes())
                .all(|(a, b)| cgi_fold(a) == cgi_fold(b))
    };
    let lookalikes: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            let name = name.as_str();
            let real = WRITTEN.contains(&name)
                || identity.iter().any(|h| h.as_str() == name)
                || CLAIMS.contains(&name);
            !real
                && (WRITTEN.iter().any(|w| spells(name, w))
                    || identity.iter().any(|h| spells(name, h.as_str()))
                    || untrusted && CLAIMS.iter().any(|c| spells(name, c)))
        })
        .cloned()
        .collect();
    for name in lookalikes {
        headers.remove(&name);
    }
}

/// HTTP/2 may split `cookie` into several fields; HTTP/1.1 has one line, joined by `; `.
fn join_cookies(headers: &mut HeaderMap) {
    let mut values = headers.get_all(COOKIE).iter();
    if values.next().is_none() || values.next().is_none() {
        return;
    }
    let joined: Vec<u8> = headers
        .get_all(COOKIE)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect::<Vec<_>>()
        .join(&b"; "[..]);
    if let Ok(v) = HeaderValue::from_bytes(&joined) {
        headers.insert(COOKIE, v);
    }
}

/// Whether a request's transfer codings are anything but `chunked` once (say `gzip,
/// chunked`, or `chunked, chunked`). hyper takes one chunked framing off and forwards the
/// body chunked again, so any other coding would be lost and the upstream would read
/// still-encoded bytes as plain: answered 501 (RFC 9112 section 6.1). Empty list elements
/// do not count (RFC 9110 section 5.6.1). hyper itself refuses a list not ending in `chunked`.
pub(crate) fn unsupported_coding(headers: &HeaderMap) -> bool {
    let mut codings = headers
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|c| !c.is_empty());
    !(codings
        .next()
        .is_some_and(|c| c.eq_ignore_ascii_case(b"chunked"))
        && codings.next().is_none())
}

/// Why a request's `Host` makes it unroutable (RFC 9112 section 3.2: answered 400): an
/// HTTP/1.1 request without one, a request with two, a value that is not a host and port, or
/// (HTTP/2) one that names another host than `:authority`. Routes match on `Host`, and an
/// upstream that read another `Host` than the gateway would serve one route under another's
/// limits.
pub(crate) fn bad_host<B>(req: &Request<B>) -> Option<&'static str> {
    let h2 = req.version() == http::Version::HTTP_2;
    // HTTP/2's `:authority`, or an HTTP/1.1 request target in absolute form: the request is
    // routed and forwarded by `Host`, so the two must agree.
    let authority = req.uri().authority();
    let mut hosts = req.headers().get_all(HOST).iter();
    let Some(host) = hosts.next() else {
        return match authority {
            // The authority is the host then: it is held to the same rule.
            Some(a) if !is_host_and_port(a.as_str().as_bytes()) => {
                Some("The request's authority is not a host name or address with an optional port.")
            }
            Some(_) if h2 || req.version() != http::Version::HTTP_11 => None,
            _ => (req.version() == http::Version::HTTP_11)
                .then_some("An HTTP/1.1 request must carry a Host header."),
        };
    };
    if hosts.next().is_some() {
        return Some("The request carries more than one Host header.");
    }
    if !is_host_and_port(host.as_bytes()) {
        return Some("The Host header is not a host name or address with an optional port.");
    }
    match authority {
        Some(a) if !same_host(a.as_str().as_bytes(), host.as_bytes()) => Some(if h2 {
            "The Host header names another host than the request's :authority."
        } else {
            "The Host header names another host than the request target."
        }),
        _ => None,
    }
}

/// Why a request target is none the gateway routes, if it is not: a path (origin form), or
/// an `http` or `https` URI (absolute form); `*` for `OPTIONS` only (RFC 9112 section 3.2).
/// Review: `GET *`, `GET host:80` (authority form, for `CONNECT` only) and `GET ftp://a/b`
/// were routed, answered 404 or forwarded as `/b`.
pub(crate) fn bad_target<B>(req: &Request<B>) -> Option<&'static str> {
    let uri = req.uri();
    if uri
        .scheme_str()
        .is_some_and(|s| !s.eq_ignore_ascii_case("http") && !s.eq_ignore_ascii_case("https"))
    {
        return Some("The request target's scheme is neither http nor https.");
    }
    match uri.path() {
        "*" if req.method() == Method::OPTIONS => None,
        "*" => Some("The request target * is for OPTIONS only."),
        path if !path.starts_with('/') => {
            Some("The request target is not a path (nor an http URI).")
        }
        _ => None,
    }
}

/// Whether a header field value begins or ends with a space or tab: over HTTP/2 a malformed
/// request (RFC 9113 section 8.2.1), which the h2 layer lets through (review). Over HTTP/1.1
/// such blanks are never part of a value; passed on, each reader would decide for itself
/// whether `" k "` is `k`.
pub(crate) fn padded_value(headers: &http::HeaderMap) -> bool {
    let blank = |b: Option<&u8>| matches!(b, Some(b' ' | b'\t'));
    headers.values().any(|v| {
        let b = v.as_bytes();
        blank(b.first()) || blank(b.last())
    })
}

/// The method a `POST` asks servers to dispatch it as instead (`X-HTTP-Method-Override`,
/// `X-HTTP-Method`, `X-Method-Override`, in either spelling, or a `_method` query parameter),
/// if it names another method. Symfony and Laravel, Rails (`Rack::MethodOverride`),
/// ASP.NET Core's override middleware and Express's honour such a field on a `POST` (review:
/// `POST` with `X-HTTP-Method-Override: GET` was served as the `GET`-only route's action,
/// counted under another route at another cost). Such a request is answered 400: routing it
/// by the named method would let a caller whose upstream ignores the field be counted under
/// the cheaper route instead.
pub(crate) fn method_override<B>(req: &Request<B>) -> Option<String> {
    // In any case: routes match methods so, and Symfony and ASP.NET Core take a `post` for a
    // `POST` (review: `post` with an override went on to the catch-all route).
    if !req.method().as_str().eq_ignore_ascii_case("POST") {
        return None;
    }
    // Named as sent, if it is a method of a sane length (the problem body repeats it).
    let named = |value: &[u8]| {
        let value = value.trim_ascii();
        (!value.is_empty() && !value.eq_ignore_ascii_case(b"POST")).then(
            || match Method::from_bytes(value) {
                Ok(m) if m.as_str().len() <= 20 => m.to_string(),
                _ => "another method".to_owned(),
            },
        )
    };
    for (name, value) in req.headers() {
        let name = name.as_str();
        // `x-http-method-override` is the longest: most names are passed over by length.
        if name.len() <= "x-http-method-override".len()
            && [
                "x-http-method-override",
                "x-http-method",
                "x-method-override",
            ]
            .iter()
            .any(|o| same_name(name, o))
        {
            if let Some(method) = named(value.as_bytes()) {
                return Some(method);
            }
        }
    }
    // Under any name a server reads as `_method` (see `param_name`).
    let query = req.uri().query()?;
    query.split(['&', ';']).find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (crate::identify::param_name(k.as_bytes()) == b"_method")
            .then(|| named(v.as_bytes()))
            .flatten()
    })
}

/// Whether a header name (lower case) is `spelled` (lower case, with `-` only), with `_` or
/// `.` for any `-` (as CGI-style servers read them: see [`drop_lookalikes`]).
fn same_name(name: &str, spelled: &str) -> bool {
    name.len() == spelled.len()
        && name
            .bytes()
            .zip(spelled.bytes())
            .all(|(n, s)| cgi_fold(n) == s)
}

/// A header name's byte as CGI-style servers read it: `_` and `.` (PHP) as `-`.
fn cgi_fold(b: u8) -> u8 {
    if b == b'_' || b == b'.' {
        b'-'
    } else {
        b
    }
}

/// Whether two `host[:port]` values name the same host: case and a trailing dot aside, and
/// a port left out on one side agreeing with any.
fn same_host(a: &[u8], b: &[u8]) -> bool {
    fn split(v: &[u8]) -> (&[u8], Option<&[u8]>) {
        let colon = match v.iter().rposition(|&b| b == b']') {
            Some(end) => v[end..].iter().position(|&b| b == b':').map(|i| end + i),
            None => v.iter().position(|&b| b == b':'),
        };
        let (host, port) = match colon {
            Some(i) => (&v[..i], Some(&v[i + 1..])),
            None => (v, None),
        };
        (host.strip_suffix(b".").unwrap_or(host), port)
    }
    let ((ha, pa), (hb, pb)) = (split(a), split(b));
    ha.eq_ignore_ascii_case(hb) && (pa.is_none() || pb.is_none() || pa == pb)
}

/// `uri-host [ ":" port ]` (RFC 9110 section 7.2): a registered name (unreserved characters,
/// sub-delimiters and escapes, no `@`, `/` or `,`) or a bracketed IPv6 literal, then at most
/// one `:` and up to five digits. One pass over a table: it runs on every request.
fn is_host_and_port(v: &[u8]) -> bool {
    let mut i = 0;
    if v.first() == Some(&b'[') {
        i = 1;
        while i < v.len() && HOST_CHARS[usize::from(v[i])] == IPV6 {
            i += 1;
        }
        if i == 1 || v.get(i) != Some(&b']') {
            return false;
        }
        i += 1;
    } else {
        while i < v.len() && v[i] != b':' && HOST_CHARS[usize::from(v[i])] != NO {
            i += 1;
        }
        if i == 0 {
            return false;
        }
    }
    match v.get(i) {
        None => true,
        Some(b':') => {
            let digits = &v[i + 1..];
            digits.len() <= 5 && digits.iter().all(u8::is_ascii_digit)
        }
        Some(_) => false,
    }
}

/// [`HOST_CHARS`]'s classes: not allowed, a registered name's character, an IPv6 literal's
/// character (hex digits, `:` and `.`, which names use too).
const NO: u8 = 0;
const NAME: u8 = 1;
const IPV6: u8 = 2;

static HOST_CHARS: [u8; 256] = {
    let mut t = [NO; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = if c.is_ascii_hexdigit() || c == b':' || c == b'.' {
            IPV6
        } else if c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'-' | b'_'
                    | b'~'
                    | b'%'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b';'
                    | b'='
            )
        {
            NAME
        } else {
            NO
        };
        b += 1;
    }
    t
};

/// What a checkout found a pooled connection to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Readiness {
    Ready,
    /// Its response body is still streaming.
    Busy,
    Closed,
}

/// Every serving thread's pool of kept connections of one kind to one upstream, each keeping
/// at most `keep` (`idle_connections`); more are closed once their exchange ends.
#[derive(Debug)]
pub(crate) struct Pools<C> {
    pools: Box<[Mutex<Pool<C>>]>,
    keep: usize,
}

impl<C> Pools<C> {
    pub(crate) fn new(keep: usize) -> Self {
        Pools {
            pools: (0..POOLS).map(|_| Mutex::new(Pool::default())).collect(),
            keep,
        }
    }

    /// This thread's pool.
    fn pool(&self) -> &Mutex<Pool<C>> {
        &self.pools[POOL.with(Cell::get)]
    }

    /// A connection of this thread's pool that `state` finds ready (see [`Pool::checkout`]).
    pub(crate) fn checkout(&self, now: Instant, state: impl Fn(&C) -> Readiness) -> Option<C> {
        let mut pool = self.pool().lock().unwrap_or_else(|e| e.into_inner());
        pool.checkout(now, state)
    }

    pub(crate) fn checkin(&self, conn: C, now: Instant) {
        let mut pool = self.pool().lock().unwrap_or_else(|e| e.into_inner());
        pool.checkin(conn, now, self.keep);
    }

    /// Closes the connections of every thread's pool unused for [`IDLE_TIMEOUT`]; returns how
    /// many.
    pub(crate) fn close_idle(&self, now: Instant) -> usize {
        let pools = self.pools.iter();
        pools
            .map(|p| p.lock().unwrap_or_else(|e| e.into_inner()).close_idle(now))
            .sum()
    }
}

/// One thread's kept connections, oldest first, each with when it was last checked in.
#[derive(Debug)]
pub(crate) struct Pool<C> {
    kept: VecDeque<(C, Instant)>,
}

impl<C> Default for Pool<C> {
    fn default() -> Self {
        Pool {
            kept: VecDeque::new(),
        }
    }
}

impl<C> Pool<C> {
    /// The first ready connection within [`CHECKOUT_TRIES`] looks: closed and stale ones are
    /// dropped, busy ones go to the back.
    pub(crate) fn checkout(&mut self, now: Instant, state: impl Fn(&C) -> Readiness) -> Option<C> {
        for _ in 0..CHECKOUT_TRIES {
            let (conn, since) = self.kept.pop_front()?;
            if now.saturating_duration_since(since) >= IDLE_TIMEOUT {
                continue;
            }
            match state(&conn) {
                Readiness::Ready => return Some(conn),
                Readiness::Busy => self.kept.push_back((conn, since)),
                Readiness::Closed => {}
            }
        }
        None
    }

    /// Keeps `conn` for later requests if fewer than `keep` are kept; else drops it.
    pub(crate) fn checkin(&mut self, conn: C, now: Instant, keep: usize) {
        if self.kept.len() < keep {
            self.kept.push_back((conn, now));
        }
    }

    /// Drops the connections unused for [`IDLE_TIMEOUT`]; returns how many.
    pub(crate) fn close_idle(&mut self, now: Instant) -> usize {
        let before = self.kept.len();
        self.kept
            .retain(|(_, since)| now.saturating_duration_since(*since) < IDLE_TIMEOUT);
        before - self.kept.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_targets_are_paths_or_http_uris_and_star_for_options_only() {
        let req = |method: &str, target: &str| {
            http::Request::builder()
                .method(method)
                .uri(target)
                .body(())
                .unwrap()
        };
        for (method, target) in [
            ("GET", "/a"),
            ("GET", "http://a/b"),
            ("GET", "HTTPS://a:8443/b?c"),
            ("GET", "http://a"),
            ("OPTIONS", "*"),
            ("OPTIONS", "/"),
        ] {
            assert_eq!(bad_target(&req(method, target)), None, "{method} {target}");
        }
        for (method, target) in [
            ("GET", "*"),
            ("POST", "*"),
            ("GET", "a:80"),
            ("GET", "ftp://a/b"),
            ("GET", "ws://a/b"),
        ] {
            assert!(
                bad_target(&req(method, target)).is_some(),
                "{method} {target}"
            );
        }
    }

    /// What an upload keeps in these tests: a channel that closes when it is dropped.
    struct Probe(#[allow(dead_code)] tokio::sync::oneshot::Sender<()>);

    impl KeptUntilOver for Probe {
        fn stalled(&mut self) {}
    }

    fn kept() -> (Box<dyn KeptUntilOver>, tokio::sync::oneshot::Receiver<()>) {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        (Box::new(Probe(tx)), rx)
    }

    fn freed(rx: &mut tokio::sync::oneshot::Receiver<()>) -> bool {
        matches!(
            rx.try_recv(),
            Err(tokio::sync::oneshot::error::TryRecvError::Closed)
        )
    }

    fn watched(timeout: Duration) -> (Arc<Moved>, UploadTail) {
        let moved = Arc::new(Moved::new(None));
        let tail = UploadTail {
            moved: Arc::clone(&moved),
            timeout,
        };
        (moved, tail)
    }

    /// The slots an upload keeps are freed as it ends, and its watcher ends then too, not at
    /// the timeout (review: a task per such request lived the upstream's timeout, memory grew
    /// with the request rate).
    #[tokio::test(start_paused = true)]
    async fn what_an_upload_keeps_is_freed_when_it_ends_and_its_watcher_ends_too() {
        let metrics = tokio::runtime::Handle::current().metrics();
        let before = metrics.num_alive_tasks();
        let (moved, tail) = watched(Duration::from_secs(30));
        let (slots, mut rx) = kept();
        tail.keep_until_over(slots, None);
        tokio::task::yield_now().await;
        assert_eq!(metrics.num_alive_tasks(), before + 1, "a watcher");
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!freed(&mut rx), "kept while the upload goes on");
        moved.upload_over();
        assert!(freed(&mut rx));
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            metrics.num_alive_tasks(),
            before,
            "the watcher outlived the upload"
        );
        // Kept after the upload is over: freed at once, no watcher.
        let (slots, mut rx) = kept();
        let (_, tail) = {
            let (moved, tail) = watched(Duration::from_secs(30));
            moved.upload_over();
            (moved, tail)
        };
        tail.keep_until_over(slots, None);
        assert!(freed(&mut rx));
        assert_eq!(metrics.num_alive_tasks(), before);
    }

    /// An upload that stops moving frees what it keeps after the timeout; a cut at the end
    /// of the shutdown grace frees it at once (review: with Redis, the lease was left to
    /// expire).
    #[tokio::test(start_paused = true)]
    async fn what_a_stalled_or_cut_upload_keeps_is_freed() {
        let (moved, tail) = watched(Duration::from_secs(30));
        let (slots, mut rx) = kept();
        tail.keep_until_over(slots, None);
        tokio::time::sleep(Duration::from_secs(29)).await;
        assert!(!freed(&mut rx));
        moved.note(MOVING, 100); // a piece at 29 s
        tokio::time::sleep(Duration::from_secs(29)).await;
        assert!(!freed(&mut rx), "58 s: 29 s since the last piece");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(freed(&mut rx), "60 s: 31 s since the last piece");

        let capacity = Capacity::new(4);
        let (_moved, tail) = watched(Duration::from_secs(30));
        let (slots, mut rx) = kept();
        tail.keep_until_over(slots, Some(capacity.clone()));
        tokio::task::yield_now().await;
        assert!(!freed(&mut rx));
        capacity.cut();
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        assert!(freed(&mut rx), "kept past the cut");
    }

    fn peer(addr: &str, trusted: bool) -> Peer {
        Peer::new(addr.parse().unwrap(), |_| trusted)
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_is_late_on_the_client_when_it_owes_the_next_piece_else_on_the_upstream() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let rate = Some(MinBodyRate {
            bytes_per_second: 1000,
            grace: Duration::from_secs(5),
        });
        let timeout = Duration::from_secs(10);
        let m = Moved::new(rate);
        assert_eq!(m.next_check(timeout), at(5), "the grace, at the soonest");
        // Not waiting on the client (the upstream is not taking the body): the upstream's
        // timeout decides; the rate is looked at again later.
        assert_eq!(m.verdict(timeout, at(0)), Verdict::Wait(at(5)));
        assert_eq!(m.verdict(timeout, at(10)), Verdict::UpstreamLate);
        // Waiting on the client from the start: nothing by the grace's end is below any rate.
        m.wait();
        assert_eq!(m.verdict(timeout, at(0)), Verdict::Wait(at(5)));
        assert_eq!(m.verdict(timeout, at(5)), Verdict::ClientStalled);
        // Once the body has ended, only the upstream can be late: `timeout` after the end.
        tokio::time::advance(Duration::from_secs(3)).await;
        m.note(ENDED, 100);
        assert_eq!(m.verdict(timeout, at(3)), Verdict::Wait(at(13)));
        assert_eq!(m.verdict(timeout, at(13)), Verdict::UpstreamLate);
        // Without a minimum rate a client is late `timeout` after its last piece.
        let m = Moved::new(None);
        m.wait();
        assert_eq!(m.verdict(timeout, at(12)), Verdict::Wait(at(13)));
        assert_eq!(m.verdict(timeout, at(13)), Verdict::ClientStalled);
    }

    /// The rate is asked of the time spent waiting on the client only: 20 s in which the
    /// upstream takes nothing do not count against a client that kept up.
    #[tokio::test(start_paused = true)]
    async fn the_minimum_rate_counts_only_the_time_spent_waiting_on_the_client() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let timeout = Duration::from_secs(60);
        let m = Moved::new(Some(MinBodyRate {
            bytes_per_second: 1000,
            grace: Duration::from_secs(5),
        }));
        // 2 s waiting on the client for 6,000 bytes (6 s of allowance at the rate).
        m.wait();
        tokio::time::advance(Duration::from_secs(2)).await;
        m.note(MOVING, 6_000);
        // The upstream takes nothing for 20 s, then the gateway waits on the client again:
        // 6 s allowed less 2 s waited leaves 4 s, from 22 s.
        tokio::time::advance(Duration::from_secs(20)).await;
        m.wait();
        assert_eq!(m.verdict(timeout, at(25)), Verdict::Wait(at(26)));
        assert_eq!(m.verdict(timeout, at(26)), Verdict::ClientStalled);
    }

    /// [`prepare_request`] from `peer` to [`upstream`], with `identity`'s headers read.
    fn prepare<B>(req: &mut Request<B>, peer: Peer, identity: &[HeaderName]) {
        prepare_request(
            req,
            &peer,
            &upstream(),
            &IdentityHeaders::new(identity.to_vec()),
        );
    }

    fn upstream() -> Authority {
        Authority::from_static("127.0.0.1:3000")
    }

    #[test]
    fn a_request_naming_no_host_gets_the_upstreams_and_connection_cannot_remove_host() {
        let mut req = Request::builder()
            .uri("/")
            .version(http::Version::HTTP_10)
            .body(())
            .unwrap();
        prepare(&mut req, peer("192.0.2.1", false), &[]);
        assert_eq!(req.headers()[HOST], "127.0.0.1:3000");
        let mut req = Request::builder()
            .uri("/")
            .header("host", "api.example.com")
            .header("connection", "host, x-gone")
            .header("x-gone", "1")
            .body(())
            .unwrap();
        prepare(&mut req, peer("192.0.2.1", false), &[]);
        assert_eq!(req.headers()[HOST], "api.example.com");
        assert!(!req.headers().contains_key("x-gone"));
    }

    /// A proxy forwards the target's authority as `Host`, port included, whatever `Host` the
    /// request had (RFC 9112 section 3.2.2 for an absolute-form target, RFC 9113 section
    /// 8.3.1 for HTTP/2's `:authority`); an origin-form target keeps its `Host`.
    #[test]
    fn a_targets_authority_replaces_host() {
        for (version, uri, host, forwarded) in [
            (
                http::Version::HTTP_11,
                "http://a.example:81/x",
                "a.example",
                "a.example:81",
            ),
            (
                http::Version::HTTP_11,
                "http://a.example/x",
                "A.Example.:80",
                "a.example",
            ),
            (
                http::Version::HTTP_2,
                "https://a.example:8443/",
                "a.example",
                "a.example:8443",
            ),
            (http::Version::HTTP_11, "/x", "A.Example:81", "A.Example:81"),
        ] {
            let req = Request::builder().version(version).uri(uri);
            let mut req = req.header("host", host).body(()).unwrap();
            assert_eq!(bad_host(&req), None, "{uri} {host}");
            prepare(&mut req, peer("192.0.2.1", false), &[]);
            let hosts: Vec<_> = req.headers().get_all(HOST).iter().collect();
            assert_eq!(hosts, [forwarded], "{uri} {host}");
        }
    }

    #[test]
    fn http2_cookie_fields_become_one_line_and_forwarded_for_keeps_non_text_bytes() {
        let mut req = Request::builder()
            .uri("http://api.example.com/")
            .version(http::Version::HTTP_2)
            .header("cookie", "a=1")
            .header("cookie", "b=2")
            .header("x-forwarded-for", HeaderValue::from_bytes(b"\xff").unwrap())
            .body(())
            .unwrap();
        prepare(&mut req, peer("192.0.2.1", true), &[]);
        let cookies: Vec<_> = req.headers().get_all(COOKIE).iter().collect();
        assert_eq!(cookies, ["a=1; b=2"]);
        assert_eq!(
            req.headers()["x-forwarded-for"].as_bytes(),
            b"\xff, 192.0.2.1"
        );
        // HTTP/1.1 has one cookie line already; two are passed on as they came.
        let mut req = Request::builder()
            .uri("/")
            .header("host", "h")
            .header("cookie", "a=1")
            .header("cookie", "b=2")
            .body(())
            .unwrap();
        prepare(&mut req, peer("192.0.2.1", false), &[]);
        assert_eq!(req.headers().get_all(COOKIE).iter().count(), 2);
    }

    #[test]
    fn only_chunked_alone_is_a_transfer_coding_the_gateway_passes_on() {
        let te = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(http::header::TRANSFER_ENCODING, v.parse().unwrap());
            }
            unsupported_coding(&h)
        };
        for fine in [
            &["chunked"][..],
            &["Chunked"],
            &[" chunked "],
            &[", chunked"],
            &["chunked,"],
        ] {
            assert!(!te(fine), "{fine:?}");
        }
        for bad in [
            &["gzip, chunked"][..],
            &["gzip", "chunked"],
            &["chunked, chunked"],
            &["chunked", "chunked"],
            &["identity"],
            &[""],
        ] {
            assert!(te(bad), "{bad:?}");
        }
    }

    #[test]
    fn host_must_be_one_valid_host_and_agree_with_the_authority() {
        let req = |version, uri: &str, hosts: &[&str]| {
            let mut b = Request::builder().uri(uri).version(version);
            for h in hosts {
                b = b.header("host", *h);
            }
            b.body(()).unwrap()
        };
        let v11 = http::Version::HTTP_11;
        for fine in [
            "api.example.com",
            "api.example.com:8080",
            "[::1]:80",
            "192.0.2.1",
            "a_b.example:",
        ] {
            assert_eq!(bad_host(&req(v11, "/", &[fine])), None, "{fine}");
        }
        for bad in [
            "a:80:80", "a, b", "user@a", "a/b", "[::1", "[zz]", "a:x", "", "a:123456",
        ] {
            assert!(bad_host(&req(v11, "/", &[bad])).is_some(), "{bad:?}");
        }
        assert!(bad_host(&req(v11, "/", &["a", "b"])).is_some(), "two");
        assert!(
            bad_host(&req(v11, "/", &[])).is_some(),
            "HTTP/1.1 without Host"
        );
        assert_eq!(bad_host(&req(http::Version::HTTP_10, "/", &[])), None);
        // An absolute-form target is held to its Host as HTTP/2's :authority is.
        let absolute = |host: &[&str]| bad_host(&req(v11, "http://a.example/x", host));
        assert_eq!(absolute(&["a.example"]), None);
        assert_eq!(absolute(&["A.EXAMPLE:80"]), None);
        assert!(absolute(&["evil.example"]).is_some());
        assert!(absolute(&[]).is_some(), "HTTP/1.1 needs Host even then");
        let v10 = http::Version::HTTP_10;
        assert_eq!(bad_host(&req(v10, "http://a.example/x", &[])), None);
        assert!(
            bad_host(&req(v10, "http://user@a.example/x", &[])).is_some(),
            "an HTTP/1.0 target's authority is held to the Host rule too"
        );
        let v2 = http::Version::HTTP_2;
        assert_eq!(bad_host(&req(v2, "http://a.example/", &[])), None);
        assert_eq!(
            bad_host(&req(v2, "http://a.example/", &["A.example"])),
            None
        );
        assert!(bad_host(&req(v2, "http://a.example/", &["b.example"])).is_some());
        assert_eq!(
            bad_host(&req(v2, "http://a.example/", &["a.example.:80"])),
            None
        );
        assert_eq!(
            bad_host(&req(v2, "http://a.example:8080/", &["a.example"])),
            None
        );
        assert!(bad_host(&req(v2, "http://a.example:8080/", &["a.example:9090"])).is_some());
        assert!(
            bad_host(&req(v2, "http://evil@a.example/", &[])).is_some(),
            "userinfo"
        );
    }

    #[test]
    fn pool_hands_out_ready_connections_and_closes_stale_closed_and_extra_ones() {
        let t0 = Instant::now();
        let later = |s: u64| t0 + Duration::from_secs(s);
        let mut pool = Pool::default();
        let ready = |c: &char| match c {
            'b' => Readiness::Busy,
            'x' => Readiness::Closed,
            _ => Readiness::Ready,
        };
        // The cap: a third connection is not kept.
        for c in ['x', 'b', 'r'] {
            pool.checkin(c, t0, 2);
        }
        assert_eq!(pool.kept.len(), 2);
        // Closed dropped, busy to the back, ready handed out.
        pool.checkin('r', later(1), 3);
        assert_eq!(pool.checkout(later(2), ready), Some('r'));
        assert_eq!(pool.kept.iter().map(|e| e.0).collect::<String>(), "b");
        // Stale ones go, at checkout or in the sweep, and only they.
        pool.checkin('r', later(30), 3);
        assert_eq!(pool.close_idle(later(59)), 0);
        assert_eq!(pool.close_idle(later(60)), 1, "the one from t0");
        assert_eq!(pool.checkout(later(90), ready), None, "30 s + 60 s: stale");
        assert!(pool.kept.is_empty());
        // A cap of zero keeps nothing.
        pool.checkin('r', later(91), 0);
        assert_eq!(pool.checkout(later(91), ready), None);
    }

    #[test]
    fn a_connection_header_alone_goes_with_what_it_names() {
        for (connection, named) in [
            ("keep-alive", None),
            ("close", None),
            ("X-Mine", Some("x-mine")),
        ] {
            let mut h = HeaderMap::new();
            h.insert(CONNECTION, HeaderValue::from_static(connection));
            h.insert("x-mine", HeaderValue::from_static("1"));
            h.insert("x-kept", HeaderValue::from_static("1"));
            strip_hop_by_hop(&mut h, &[]);
            assert!(!h.contains_key(CONNECTION), "{connection}");
            assert_eq!(h.contains_key("x-mine"), named.is_none(), "{connection}");
            assert!(h.contains_key("x-kept"), "{connection}");
        }
    }

    #[test]
    fn connection_named_headers_and_hop_by_hop_are_removed() {
        let mut req = Request::builder()
            .uri("/")
            .header("connection", "keep-alive, X-Secret")
            .header("connection", "close,x-other ,bad name")
            .header("x-secret", "1")
            .header("x-other", "1")
            .header("keep-alive", "timeout=5")
            .header("te", "gzip")
            .header("trailer", "x-sum")
            .header("transfer-encoding", "chunked")
            .header("upgrade", "websocket")
            .header("proxy-authorization", "Basic eA==")
            .header("proxy-authenticate", "Basic")
            .header("proxy-connection", "keep-alive")
            .header("http2-settings", "AAMAAABkAAQAAP__")
            .header("x-kept", "yes")
            .header("tee", "kept too")
            .header("upgrades", "kept too")
            .body(())
            .unwrap();
        prepare(&mut req, peer("192.0.2.1", false), &[]);
        let h = req.headers();
        for gone in [
            "connection",
            "x-secret",
            "x-other",
            "keep-alive",
            "te",
            "transfer-encoding",
            "upgrade",
            "proxy-authorization",
            "proxy-authenticate",
            "proxy-connection",
            "http2-settings",
        ] {
            assert!(!h.contains_key(gone), "{gone} was forwarded");
        }
        assert_eq!(h["x-kept"], "yes");
        assert_eq!(h["tee"], "kept too");
        assert_eq!(h["upgrades"], "kept too");
        // Not hop-by-hop (RFC 9110 section 6.6.2), but a request's trailer fields are not
        // passed on: neither is the field that names them.
        assert!(!h.contains_key("trailer"));
    }

    /// A client that takes trailer fields says so to the upstream through the gateway, as
    /// `TE: trailers` for the next hop alone; any other coding it takes is the gateway's
    /// business, not the upstream's.
    #[test]
    fn te_trailers_goes_on_for_the_next_hop_alone() {
        for (te, forwarded) in [
            (&["trailers"][..], Some("trailers")),
            (&["gzip, Trailers"], Some("trailers")),
            (&["gzip", " trailers "], Some("trailers")),
            (&["gzip;q=0.5, deflate"], None),
            (&["trailersx"], None),
        ] {
            let mut req = Request::builder()
                .uri("/")
                .header("connection", "keep-alive, te");
            for v in te {
                req = req.header("te", *v);
            }
            let mut req = req.body(()).unwrap();
            prepare(&mut req, peer("192.0.2.1", false), &[]);
            let h = req.headers();
            let got: Vec<_> = h.get_all("te").iter().collect();
            match forwarded {
                Some(v) => {
                    assert_eq!(got, [v], "{te:?}");
                    let connection: Vec<_> = h.get_all("connection").iter().collect();
                    assert_eq!(connection, ["te"], "{te:?}");
                }
                None => {
                    assert!(got.is_empty(), "{te:?}");
                    assert!(!h.contains_key("connection"), "{te:?}");
                }
            }
            // A protocol switch names both.
            set_upgrade(req.headers_mut(), HeaderValue::from_static("websocket"));
            let connection = if forwarded.is_some() {
                "upgrade, te"
            } else {
                "upgrade"
            };
            assert_eq!(req.headers()["connection"], connection, "{te:?}");
        }
        // An HTTP/1.0 client can take no trailer fields (review).
        let mut req = Request::builder()
            .version(http::Version::HTTP_10)
            .uri("/")
            .header("te", "trailers")
            .body(())
            .unwrap();
        prepare(&mut req, peer("192.0.2.1", false), &[]);
        assert!(!req.headers().contains_key("te"));
        assert!(!req.headers().contains_key("connection"));
    }

    #[test]
    fn forwarded_for_gets_the_peer_appended_and_proto_is_set() {
        let claimed = || {
            Request::builder()
                .uri("/")
                .header("x-forwarded-for", "203.0.113.9")
                .header("x-forwarded-for", "198.51.100.2")
                .header("x-forwarded-proto", "https")
                .header("x-real-ip", "203.0.113.9")
                .body(())
                .unwrap()
        };
        // A trusted proxy's chain goes on, the peer appended.
        let mut req = claimed();
        prepare(&mut req, peer("::ffff:192.0.2.1", true), &[]);
        let h = req.headers();
        assert_eq!(h["x-forwarded-for"], "203.0.113.9, 198.51.100.2, 192.0.2.1");
        assert_eq!(h["x-forwarded-proto"], "https");
        assert_eq!(h["x-real-ip"], "203.0.113.9");
        // Anyone else's claims are replaced by what the gateway saw.
        let mut req = claimed();
        prepare(&mut req, peer("::ffff:192.0.2.1", false), &[]);
        let h = req.headers();
        assert_eq!(h["x-forwarded-for"], "192.0.2.1");
        assert_eq!(
            h["x-forwarded-proto"], "http",
            "untrusted peer cannot claim https"
        );
        assert_eq!(h["x-real-ip"], "192.0.2.1");
        let mut req = Request::builder().uri("/").body(()).unwrap();
        prepare(&mut req, peer("192.0.2.1", false), &[]);
        assert!(!req.headers().contains_key("x-real-ip"), "not added");
    }

    /// CGI-style servers read `X_Api_Key` as `X-Api-Key` (both are `HTTP_X_API_KEY`): such a
    /// spelling of a field the gateway counts callers by or writes does not reach the
    /// upstream, from anyone; other names with underscores do.
    #[test]
    fn underscore_spellings_of_identity_and_forwarding_fields_are_dropped() {
        let identity = [HeaderName::from_static("x-api-key")];
        for trusted in [false, true] {
            let mut req = Request::builder()
                .uri("/")
                .header("X_Api_Key", "k1")
                .header("x-api_key", "k2")
                .header("X_Forwarded_For", "7.7.7.7")
                .header("x_real_ip", "8.8.8.8")
                .header("X_Forwarded_Host", "evil.example")
                .header("X_Forwarded_Proto", "https")
                .header("X_Request_Id", "mine")
                .header("X.Api.Key", "k3")
                .header("x.forwarded.for", "9.9.9.9")
                .header("X.Real_IP", "6.6.6.6")
                .header("x_api_keys", "not one")
                .header("my_header", "kept")
                .body(())
                .unwrap();
            prepare(&mut req, peer("192.0.2.1", trusted), &identity);
            let mut names: Vec<&str> = req.headers().keys().map(HeaderName::as_str).collect();
            names.sort_unstable();
            assert_eq!(
                names,
                [
                    "host",
                    "my_header",
                    "via",
                    "x-forwarded-for",
                    "x-forwarded-proto",
                    "x_api_keys"
                ],
                "trusted: {trusted}"
            );
        }
        // A configured name with an underscore is forwarded; its spelling with `-` is not,
        // nor a spelling that mixes the two.
        let identity = [HeaderName::from_static("x_custom_key")];
        let mut req = Request::builder()
            .uri("/")
            .header("x_custom_key", "k1")
            .header("x-custom-key", "k2")
            .header("x-custom_key", "k3")
            .header("x-other", "kept")
            .body(())
            .unwrap();
        prepare(&mut req, peer("192.0.2.1", false), &identity);
        let h = req.headers();
        assert_eq!(h["x_custom_key"], "k1");
        assert!(!h.contains_key("x-custom-key") && !h.contains_key("x-custom_key"));
        assert_eq!(h["x-other"], "kept");
        // A name of any length: those from 63 bytes on share one bit of the length filter.
        let long = format!("x-{}", "k".repeat(80));
        let identity = [HeaderName::from_bytes(long.as_bytes()).unwrap()];
        let mut req = Request::builder()
            .uri("/")
            .header(long.replacen('-', "_", 1), "k1")
            .header(format!("x_{}", "k".repeat(81)), "kept")
            .body(())
            .unwrap();
        prepare(&mut req, peer("192.0.2.1", false), &identity);
        assert!(!req
            .headers()
            .contains_key(long.replacen('-', "_", 1).as_str()));
        assert_eq!(
            req.headers()[format!("x_{}", "k".repeat(81)).as_str()],
            "kept"
        );
    }

    #[test]
    fn an_underscore_is_found_anywhere_in_a_name() {
        for len in 0..40 {
            let plain = "a".repeat(len);
            assert!(!has_cgi_separator(&plain), "{len}");
            for at in 0..len {
                let mut with = plain.clone().into_bytes();
                with[at] = b'_';
                let with = String::from_utf8(with).unwrap();
                assert!(has_cgi_separator(&with), "{with}");
            }
        }
        // Neighbours of `_` (0x5f) and `.` (0x2e) in the ASCII table are not them.
        assert!(!has_cgi_separator("^`~^`~^`~^`~-/"));
        for len in 0..40 {
            let mut dotted = "a".repeat(len).into_bytes();
            for at in 0..len {
                dotted[at] = b'.';
                assert!(has_cgi_separator(std::str::from_utf8(&dotted).unwrap()));
                dotted[at] = b'a';
            }
        }
    }

    /// What a proxy in front would say about a request (scheme, client address, the URL
    /// before a rewrite) reaches the upstream from a trusted proxy only, in either spelling;
    /// and `Connection` cannot take the gateway's request id away (review).
    #[test]
    fn a_caller_cannot_claim_what_a_proxy_in_front_would_say() {
        let build = || {
            let mut b = Request::builder()
                .uri("/x")
                .header("host", "api.example.com");
            for name in CLAIMS {
                b = b.header(name, "claimed");
            }
            b.header("x_original_url", "/admin")
                .header("x_forwarded_ssl", "on")
                .header("x_other", "kept")
                .header("x-request-id", "r1")
                .header("connection", "x-request-id, close")
                .body(())
                .unwrap()
        };
        let mut req = build();
        prepare(&mut req, peer("192.0.2.1", false), &[]);
        let h = req.headers();
        for name in CLAIMS.iter().chain(&["x_original_url", "x_forwarded_ssl"]) {
            assert!(!h.contains_key(*name), "{name} from a caller");
        }
        assert_eq!(h["x_other"], "kept");
        assert_eq!(h["x-request-id"], "r1");
        let mut req = build();
        prepare(&mut req, peer("10.0.0.1", true), &[]);
        let h = req.headers();
        for name in CLAIMS.iter().chain(&["x_original_url", "x_forwarded_ssl"]) {
            assert!(h.contains_key(*name), "{name} from a trusted proxy");
        }
        assert_eq!(h["x-request-id"], "r1");
    }

    /// RFC 9110 section 7.6.2: `Max-Forwards` counts down on `TRACE` and `OPTIONS` only, and
    /// at 0 the request stops here; section 7.6.3: the gateway adds itself to `Via`.
    #[test]
    fn max_forwards_counts_down_and_via_names_the_gateway() {
        let request = |method: Method, max: &str| {
            Request::builder()
                .method(method)
                .uri("/x")
                .header("max-forwards", max)
                .body(())
                .unwrap()
        };
        for method in [Method::OPTIONS, Method::TRACE] {
            assert!(max_forwards_spent(&mut request(method.clone(), "0")));
            let mut req = request(method.clone(), " 3 ");
            assert!(!max_forwards_spent(&mut req));
            assert_eq!(req.headers()["max-forwards"], "2");
            let mut req = request(method, "x");
            assert!(!max_forwards_spent(&mut req));
            assert_eq!(
                req.headers()["max-forwards"],
                "x",
                "not a number: as it came"
            );
        }
        let mut req = request(Method::GET, "0");
        assert!(!max_forwards_spent(&mut req), "GET is not counted");
        assert_eq!(req.headers()["max-forwards"], "0");

        for (version, via) in [
            (http::Version::HTTP_11, "1.1 sluice"),
            (http::Version::HTTP_2, "2 sluice"),
            (http::Version::HTTP_10, "1.0 sluice"),
        ] {
            let mut req = Request::builder()
                .version(version)
                .uri("http://api.example.com/x")
                .header("via", "1.1 edge")
                .body(())
                .unwrap();
            prepare(&mut req, peer("192.0.2.1", false), &[]);
            let all: Vec<_> = req.headers().get_all("via").iter().collect();
            assert_eq!(all, ["1.1 edge", via]);
        }
    }

    #[test]
    fn trusted_proxy_keeps_its_forwarded_proto_and_h2_authority_becomes_host() {
        let mut req = Request::builder()
            .uri("http://api.example.com/x")
            .header("x-forwarded-proto", "https")
            .body(())
            .unwrap();
        prepare(&mut req, peer("10.0.0.1", true), &[]);
        assert_eq!(req.headers()["x-forwarded-proto"], "https");
        assert_eq!(req.headers()["host"], "api.example.com");
    }

    /// An upstream that reads `X-Forwarded-Host` or `Forwarded: host=` must see the host the
    /// request was routed and counted by, unless a trusted proxy wrote them.
    #[test]
    fn a_caller_cannot_name_another_host_in_forwarding_headers() {
        let build = || {
            Request::builder()
                .uri("/x")
                .header("host", "other.example")
                .header("x-forwarded-host", "api.example.com")
                .header("x-forwarded-host", "b.example")
                .header("forwarded", "host=api.example.com;proto=https")
                .body(())
                .unwrap()
        };
        let mut req = build();
        prepare(&mut req, peer("203.0.113.7", false), &[]);
        let h = req.headers();
        let xfh: Vec<_> = h.get_all("x-forwarded-host").iter().collect();
        assert_eq!(xfh, ["other.example"]);
        assert!(!h.contains_key("forwarded"));
        let mut req = build();
        prepare(&mut req, peer("10.0.0.1", true), &[]);
        assert_eq!(req.headers().get_all("x-forwarded-host").iter().count(), 2);
        assert!(req.headers().contains_key("forwarded"));
        // A request without them gets none.
        let mut req = Request::builder()
            .uri("/x")
            .header("host", "a")
            .body(())
            .unwrap();
        prepare(&mut req, peer("203.0.113.7", false), &[]);
        assert!(!req.headers().contains_key("x-forwarded-host"));
    }

    type Piece = (Poll<Option<Result<Frame<Bytes>, ()>>>, bool);

    /// A body's pieces as `Merge::poll` asks for them, from a script: each a piece (`Some`) or
    /// a wait (`None`); the body ends with its last piece.
    struct Script {
        steps: VecDeque<Option<Frame<Bytes>>>,
        asked: Vec<bool>,
    }

    impl Script {
        fn new(steps: Vec<Option<Frame<Bytes>>>) -> Self {
            Script {
                steps: steps.into(),
                asked: Vec::new(),
            }
        }

        fn piece(&mut self, asked: bool) -> Piece {
            self.asked.push(asked);
            let polled = match self.steps.pop_front() {
                Some(Some(frame)) => Poll::Ready(Some(Ok(frame))),
                Some(None) => Poll::Pending,
                None => Poll::Ready(None),
            };
            (polled, self.steps.is_empty())
        }
    }

    #[derive(Default)]
    struct Wakes(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// What `Merge::poll` gives, each poll, for `script`: a data piece's length, `T` for
    /// trailers, `W` for a wait (with how many wake-ups it asked for), `E` for the end.
    fn merged(script: &mut Script) -> Vec<String> {
        let wakes = Arc::new(Wakes::default());
        let waker = std::task::Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        let mut merge = Merge::<()>::default();
        let mut seen = Vec::new();
        loop {
            let before = wakes.0.load(Ordering::SeqCst);
            let polled = merge.poll(&mut cx, &mut |_, asked| script.piece(asked));
            seen.push(match polled {
                Poll::Pending => format!("W{}", wakes.0.load(Ordering::SeqCst) - before),
                Poll::Ready(Some(Ok(frame))) if frame.is_data() => {
                    frame.into_data().unwrap().len().to_string()
                }
                Poll::Ready(Some(Ok(_))) => "T".to_owned(),
                Poll::Ready(Some(Err(()))) => "error".to_owned(),
                Poll::Ready(None) => {
                    seen.push("E".to_owned());
                    return seen;
                }
            });
            if seen.len() > 100 {
                return seen;
            }
        }
    }

    fn data(len: usize) -> Option<Frame<Bytes>> {
        Some(Frame::data(Bytes::from(vec![b'x'; len])))
    }

    #[test]
    fn small_pieces_ready_together_go_as_one_of_about_merge_bytes() {
        let mut script = Script::new((0..7).map(|_| data(6_000)).collect());
        assert_eq!(merged(&mut script), ["18000", "18000", "6000", "E"]);
        // Only the first piece of each was asked for: the rest were looked for.
        let asked: Vec<bool> = script.asked.iter().copied().take(4).collect();
        assert_eq!(asked, [true, false, false, true]);
    }

    #[test]
    fn a_piece_waits_while_yields_bring_more_and_goes_when_they_stop() {
        // A piece after every other yield: gathered. Then none through `YIELDS` yields: sent.
        let mut steps = vec![data(1)];
        for _ in 0..10 {
            steps.extend([None, data(1)]);
        }
        steps.extend((0..=YIELDS).map(|_| None));
        steps.push(data(1));
        let mut script = Script::new(steps);
        let mut want = vec!["W1".to_owned(); 10 + usize::from(YIELDS)];
        want.extend(["11", "1", "E"].map(str::to_owned));
        assert_eq!(merged(&mut script), want);
        // Asked for: the first piece, then (once the gathered one went) the last and the end.
        let asked = script.asked.iter().filter(|a| **a).count();
        assert_eq!((script.asked[0], asked), (true, 3));
        assert_eq!(script.asked[script.asked.len() - 2..], [true, true]);
    }

    #[test]
    fn pieces_waited_for_one_at_a_time_are_no_flood() {
        // Each tiny piece after a wait: a client streaming small records.
        let mut steps = Vec::new();
        for _ in 0..5_000 {
            steps.extend([data(1), None, None, None, None, None]);
        }
        let mut script = Script::new(steps);
        let waker = std::task::Waker::from(Arc::new(Wakes::default()));
        let mut cx = Context::from_waker(&waker);
        let mut merge = Merge::<()>::default();
        let mut sent = 0;
        loop {
            match merge.poll(&mut cx, &mut |_, a| script.piece(a)) {
                Poll::Ready(Some(_)) => sent += 1,
                Poll::Ready(None) => break,
                Poll::Pending => {}
            }
            assert!(!merge.flooded());
        }
        assert_eq!(sent, 5_000);
    }

    #[test]
    fn a_flood_of_tiny_pieces_gathered_is_told_apart() {
        let flooded = |pieces: usize, size: usize| {
            let mut steps: Vec<_> = (0..pieces).map(|_| data(size)).collect();
            steps.push(data(1));
            let mut script = Script::new(steps);
            let wakes = Arc::new(Wakes::default());
            let waker = std::task::Waker::from(wakes);
            let mut cx = Context::from_waker(&waker);
            let mut merge = Merge::<()>::default();
            while let Poll::Ready(Some(_)) = merge.poll(&mut cx, &mut |_, a| script.piece(a)) {
                if merge.flooded() {
                    return true;
                }
            }
            false
        };
        // The first piece of a gathering is not counted: it came after a wait.
        let most = usize::try_from(FLOOD_PIECES).unwrap();
        assert!(flooded(most + 1, 1));
        assert!(flooded(5_000, 6));
        assert!(!flooded(most, 1));
        assert!(!flooded(5_000, 7));
    }

    #[test]
    fn a_large_piece_trailers_or_the_end_do_not_join_but_follow() {
        let trailers = Some(Frame::trailers(HeaderMap::new()));
        let mut script = Script::new(vec![data(10), data(20), data(MERGE), data(5), trailers]);
        assert_eq!(merged(&mut script), ["30", "16384", "5", "T", "E"]);
        // The last piece goes alone at once: nothing can follow it.
        let mut script = Script::new(vec![data(10), None, data(3)]);
        assert_eq!(merged(&mut script), ["W1", "10", "3", "E"]);
        // A large piece alone passes as it came.
        let mut script = Script::new(vec![data(MERGE + 1), data(MERGE * 2)]);
        assert_eq!(merged(&mut script), ["16385", "32768", "E"]);
    }

    #[test]
    fn a_switch_must_be_to_a_protocol_the_client_asked_for() {
        let v = HeaderValue::from_static;
        let asked = v("websocket");
        assert!(switched_as_asked(&asked, Some(&v("websocket"))));
        assert!(switched_as_asked(&asked, Some(&v("WebSocket"))));
        assert!(switched_as_asked(
            &v("foo/2, websocket"),
            Some(&v("websocket"))
        ));
        assert!(!switched_as_asked(&asked, Some(&v("h2c"))));
        assert!(!switched_as_asked(&asked, Some(&v("websocket, h2c"))));
        assert!(!switched_as_asked(&asked, Some(&v(""))));
        assert!(!switched_as_asked(&asked, None));
    }

    #[test]
    fn a_post_asking_to_be_served_as_another_method_is_found() {
        let req = |method: &str, uri: &str, fields: &[(&str, &str)]| {
            let mut b = Request::builder().method(method).uri(uri);
            for (n, v) in fields {
                b = b.header(*n, *v);
            }
            b.body(()).unwrap()
        };
        for (uri, fields) in [
            ("/s", &[("x-http-method-override", "GET")][..]),
            ("/s", &[("X-HTTP-Method", " GET ")]),
            ("/s", &[("x-method-override", "GET")]),
            ("/s", &[("x_http_method_override", "GET")]),
            (
                "/s",
                &[("x-http-method-override", "POST"), ("x-http-method", "GET")],
            ),
            ("/s?q=a&_method=GET", &[]),
            ("/s?q=a;_method=GET", &[]),
            ("/s?%5Fmethod=GET", &[]),
            ("/s?.method=GET", &[]),
            ("/s?%20_METHOD=GET", &[]),
            // PHP cuts a parameter's name at a NUL, and reads a `.` in a field's as `_`
            // (review).
            ("/s?_method%00=GET", &[]),
            ("/s", &[("X.HTTP.Method.Override", "GET")]),
        ] {
            let found = method_override(&req("POST", uri, fields));
            assert_eq!(found.as_deref(), Some("GET"), "{uri} {fields:?}");
        }
        // Whatever the method's case: routes match it so, and frameworks take `post` for it.
        for method in ["post", "Post", "pOST"] {
            let found = method_override(&req(method, "/s?_method=GET", &[]));
            assert_eq!(found.as_deref(), Some("GET"), "{method}");
        }
        // A value that is no method, or a long one, is not repeated to the client.
        let long = "G".repeat(100);
        for value in [long.as_str(), "GET POST"] {
            let found = method_override(&req("POST", "/s", &[("x-http-method", value)]));
            assert_eq!(found.as_deref(), Some("another method"), "{value}");
        }
        for (method, uri, fields) in [
            ("POST", "/s", &[][..]),
            ("POST", "/s", &[("x-http-method-override", "post")]),
            ("POST", "/s", &[("x-http-method-override", "")]),
            ("POST", "/s?_method=POST", &[]),
            ("POST", "/s?x_method=GET", &[]),
            ("POST", "/s", &[("x-http-method-overrides", "GET")]),
            // Servers honour overrides on a `POST` only.
            (
                "GET",
                "/s?_method=DELETE",
                &[("x-http-method-override", "DELETE")],
            ),
        ] {
            assert_eq!(
                method_override(&req(method, uri, fields)),
                None,
                "{method} {uri} {fields:?}"
            );
        }
    }
}
