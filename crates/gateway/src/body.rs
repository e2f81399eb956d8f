//! The response body: either bytes the gateway wrote or the upstream's body streamed through.
//! It carries the request's in-flight slot and access-log record, so both end exactly when the
//! body does, or when the client goes away and hyper drops it (the slot, and the connection's
//! busy mark, wait for the request's upload too when the upstream answered before reading it
//! all, whose rest is then dropped, not forwarded: `forward::UploadTail`). An upstream body that stops
//! arriving for the upstream's `timeout` ends in an error, which closes the exchange: a stalled
//! upstream cannot hold an in-flight slot for ever. The body also tells the connection's send
//! timeout (`head_timeout.rs`) whether the response waits on the client or on its upstream, and
//! on HTTP/2 hands the upstream's pieces on at most [`PIECE`] bytes at a time, each one
//! progress.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderName;
use http_body::{Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::access_log::AccessLog;
use crate::capacity::InFlight;
use crate::forward::{KeptUntilOver, UploadTail, Upstreamed};
use crate::head_timeout::{Busy, Lingering};
use crate::quota::Held;

/// The largest piece of an upstream body handed to an HTTP/2 connection at once. hyper takes
/// the next piece only once the client's flow-control window has let the last one out, and
/// each piece taken is the connection's progress for the send timeout: an upstream's piece can
/// be hundreds of KiB, which a slow but honest client could take longer than the timeout to
/// let in. 16 KiB is HTTP/2's default frame size.
const PIECE: usize = 16 * 1024;

pin_project! {
    /// A response body.
    #[derive(Debug)]
    pub struct Body {
        #[pin]
        kind: Kind,
        // Boxed: the slot, admissions and log record are large, and hyper moves the
        // response around several times; a pointer is cheaper to move than ~1 KiB.
        extras: Option<Box<Extras>>,
    }
}

#[derive(Debug, Default)]
struct Extras {
    slot: Option<(InFlight, Held)>,
    /// The request's upload, when it may outlast this body: the slot then waits for it.
    upload: Option<UploadTail>,
    log: Option<AccessLog>,
    busy: Option<Busy>,
}

impl Extras {
    /// The response is over: the request's slots are freed and its connection no longer
    /// counted busy, unless the request's upload is still going. Then both wait for it: the
    /// request is not over, and its connection's header timeout (counted from the end of its
    /// last request) must not cut the upload (it did, 1 s after an early answer with
    /// `header_timeout = "1s"`, the upstream left with a third of the body).
    fn request_over(&mut self) {
        let slot = self.slot.take();
        // The upstream connection, which took nothing more of the upload since the answer's
        // head, is closed.
        if let Some(upload) = &self.upload {
            upload.response_over();
        }
        match self.upload.take() {
            Some(upload) if slot.is_some() || self.busy.is_some() => {
                let busy = self.busy.take().map(Busy::linger);
                let capacity = slot.as_ref().map(|(in_flight, _)| in_flight.capacity());
                upload.keep_until_over(Box::new(KeptRequest { _slot: slot, busy }), capacity);
            }
            _ => drop((slot, self.busy.take())),
        }
    }
}

/// What a request whose upload outlives its response keeps until the upload is over.
struct KeptRequest {
    _slot: Option<(InFlight, Held)>,
    busy: Option<Lingering>,
}

impl KeptUntilOver for KeptRequest {
    fn stalled(&mut self) {
        if let Some(busy) = &self.busy {
            busy.abandon();
        }
    }
}

impl Drop for Extras {
    fn drop(&mut self) {
        self.request_over();
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind {
        Full { data: Option<Bytes> },
        Upstream {
            #[pin]
            body: Upstreamed,
            // The longest wait for the next piece of the body.
            timeout: Duration,
            // Made the first time the body is not ready (most bodies never wait: no timer to
            // register and cancel), then moved on by each piece that arrives.
            idle: Option<Pin<Box<Sleep>>>,
            // What is left of a piece being handed to an HTTP/2 connection in `PIECE`s.
            rest: Bytes,
            // The fields the response's `Connection` named, removed from its trailers too
            // (empty, and not allocated, for nearly every response).
            named: Box<[HeaderName]>,
        },
    }
}

impl Kind {
    /// Nothing is left to hand to the connection.
    fn is_over(&self) -> bool {
        match self {
            Kind::Full { data } => data.is_none(),
            Kind::Upstream { body, rest, .. } => {
                rest.is_empty() && http_body::Body::is_end_stream(body)
            }
        }
    }
}

/// Why a response body failed.
#[derive(Debug)]
pub enum BodyError {
    /// The upstream's body failed (connection reset, malformed chunk).
    Upstream(Box<dyn std::error::Error + Send + Sync>),
    /// No piece of the upstream's body came within the upstream's `timeout`.
    Stalled(Duration),
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::Upstream(e) => write!(f, "upstream body: {e}"),
            BodyError::Stalled(t) => write!(f, "upstream body stalled for {t:?}"),
        }
    }
}

impl std::error::Error for BodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BodyError::Upstream(e) => Some(&**e),
            BodyError::Stalled(_) => None,
        }
    }
}

impl Body {
    pub(crate) fn full(data: impl Into<Bytes>) -> Self {
        let data: Bytes = data.into();
        let data = (!data.is_empty()).then_some(data);
        Self {
            kind: Kind::Full { data },
            extras: None,
        }
    }

    /// Drops a body the gateway wrote itself, for an answer to `HEAD`, and says how long it
    /// was (for its `Content-Length`). hyper leaves the body out of an HTTP/1.1 answer to
    /// `HEAD` itself, but sends it over HTTP/2, where a `HEAD` stream with `DATA` is a
    /// protocol error: the client got a stream reset instead of the answer (review).
    pub(crate) fn drop_for_head(&mut self) -> Option<usize> {
        match &mut self.kind {
            Kind::Full { data } => data.take().map(|d| d.len()),
            Kind::Upstream { .. } => None,
        }
    }

    /// The upstream's `body`, failed when no piece of it arrives within `timeout`.
    pub(crate) fn upstream(body: Upstreamed, timeout: Duration) -> Self {
        if let Upstreamed::Whole(data) = body {
            return Self {
                kind: Kind::Full { data },
                extras: None,
            };
        }
        Self {
            kind: Kind::Upstream {
                body,
                timeout,
                idle: None,
                rest: Bytes::new(),
                named: Box::default(),
            },
            extras: None,
        }
    }

    /// Removes `named` (the fields the response's `Connection` named, see
    /// [`crate::forward::Stripped`]) from its trailer fields too. Nearly always empty, which
    /// allocates nothing.
    pub(crate) fn without_in_trailers(mut self, named: &[HeaderName]) -> Self {
        if let Kind::Upstream { named: kept, .. } = &mut self.kind {
            *kept = named.into();
        }
        self
    }

    /// Keeps the in-flight slot and the quota admission (with its concurrency slots) until
    /// the body ends or is dropped, and the request's `upload`, if any, is over.
    pub(crate) fn hold(&mut self, slot: InFlight, held: Held, upload: Option<UploadTail>) {
        let extras = self.extras.get_or_insert_default();
        extras.slot = Some((slot, held));
        extras.upload = upload;
    }

    /// Keeps the connection counted busy (no header timeout) until the body ends or is
    /// dropped, and sending (the send timeout) whenever it is not waiting for its upstream.
    pub(crate) fn keep_busy(&mut self, mut busy: Busy) {
        busy.answered();
        busy.sending();
        self.extras.get_or_insert_default().busy = Some(busy);
    }

    /// Writes the access-log line when the body ends or is dropped.
    pub(crate) fn log_on_end(&mut self, log: AccessLog) {
        if log.is_on() {
            self.extras.get_or_insert_default().log = Some(log);
        }
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        if let Some(log) = this.extras.as_mut().and_then(|e| e.log.as_mut()) {
            log.body_begun();
        }
        let busy = this.extras.as_mut().and_then(|e| e.busy.as_mut());
        let split = busy.as_ref().is_some_and(|b| b.is_http2());
        let polled = match this.kind.as_mut().project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Upstream { rest, .. } if !rest.is_empty() => {
                let piece = rest.split_to(rest.len().min(PIECE));
                Poll::Ready(Some(Ok(Frame::data(piece))))
            }
            KindProj::Upstream {
                body,
                timeout,
                idle,
                rest,
                named,
            } => match body.poll_frame(cx) {
                Poll::Pending => {
                    // Waiting for the upstream: the body's timeout, not the client's.
                    if let Some(busy) = busy {
                        busy.waiting();
                    }
                    let timer = idle.get_or_insert_with(|| Box::pin(tokio::time::sleep(*timeout)));
                    match timer.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(Some(Err(BodyError::Stalled(*timeout)))),
                        Poll::Pending => Poll::Pending,
                    }
                }
                Poll::Ready(frame) => {
                    if let Some(timer) = idle {
                        timer.as_mut().reset(Instant::now() + *timeout);
                    }
                    match frame {
                        Some(Ok(f)) if split && f.data_ref().is_some_and(|d| d.len() > PIECE) => {
                            let mut data = f.into_data().unwrap_or_default();
                            *rest = data.split_off(PIECE);
                            Poll::Ready(Some(Ok(Frame::data(data))))
                        }
                        // Trailers are a message's fields too: no connection-specific ones
                        // (RFC 9110 section 7.6.1), nor framing ones (section 6.5.1); HTTP/2
                        // clients reset the stream for either (review: the body was lost).
                        Some(Ok(f)) if f.is_trailers() => {
                            let mut fields = f.into_trailers().unwrap_or_default();
                            crate::forward::strip_hop_by_hop(&mut fields, &[]);
                            for name in named.iter() {
                                fields.remove(name);
                            }
                            for name in [
                                http::header::CONTENT_LENGTH,
                                http::header::CONTENT_ENCODING,
                                http::header::CONTENT_TYPE,
                                http::header::CONTENT_RANGE,
                                http::header::HOST,
                                http::header::TRAILER,
                            ] {
                                fields.remove(name);
                            }
                            Poll::Ready(Some(Ok(Frame::trailers(fields))))
                        }
                        frame => Poll::Ready(frame.map(|f| f.map_err(BodyError::Upstream))),
                    }
                }
            },
        };
        if let Poll::Ready(frame) = &polled {
            let extras = this.extras.as_mut();
            match frame {
                Some(Ok(f)) => {
                    if let Some(e) = extras {
                        if let Some(log) = e.log.as_mut() {
                            if let Some(data) = f.data_ref() {
                                log.add_bytes(data.len());
                            }
                            // hyper polls no further once the body says it is at its end,
                            // nor after trailers, which are always the last frame (review: a
                            // chunked body through hyper's client, whose end-of-stream stays
                            // unsaid after its trailers, was logged cut).
                            if this.kind.is_over() || f.is_trailers() {
                                log.ended();
                            }
                        }
                        if let Some(busy) = e.busy.as_mut() {
                            busy.delivered();
                        }
                    }
                }
                Some(Err(_)) => {
                    if let Some(log) = extras.and_then(|e| e.log.as_mut()) {
                        log.upstream_body_failed();
                    }
                }
                // The exchange is over: free the in-flight slot and concurrency slots now,
                // not whenever hyper drops the body, and start the connection's header timeout.
                None => {
                    if let Some(e) = extras {
                        if let Some(log) = e.log.as_mut() {
                            log.ended();
                        }
                        e.request_over();
                    }
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.kind.is_over()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Upstream { body, rest, .. } => {
                let (body, rest) = (body.size_hint(), rest.len() as u64);
                let mut hint = SizeHint::new();
                if let Some(upper) = body.upper() {
                    hint.set_upper(upper.saturating_add(rest));
                }
                hint.set_lower(body.lower().saturating_add(rest));
                hint
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::head_timeout::{HeadTimeout, Timeouts};
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A real upstream body of `len` bytes, sent in one write (so hyper's reads, and the pieces
    /// it yields, grow to hundreds of KiB).
    async fn upstream_body(len: usize) -> hyper::body::Incoming {
        let (ours, mut theirs) = tokio::io::duplex(4 << 20);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(ours))
            .await
            .unwrap();
        tokio::spawn(conn);
        let res = tokio::spawn(async move {
            let req = http::Request::get("/").body(Empty::<Bytes>::new()).unwrap();
            sender.send_request(req).await.unwrap()
        });
        let mut head = [0u8; 1024];
        let n = theirs.read(&mut head).await.unwrap();
        assert!(head[..n].ends_with(b"\r\n\r\n"));
        let mut reply = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n").into_bytes();
        reply.resize(reply.len() + len, b'x');
        theirs.write_all(&reply).await.unwrap();
        tokio::spawn(async move { theirs }); // kept open until the test's runtime ends
        res.await.unwrap().into_body()
    }

    /// The largest piece and the total of a body's data, checking that its size hint stays
    /// exact (a piece held back counts).
    async fn pieces(mut body: Body, len: usize) -> (usize, usize) {
        let (mut largest, mut total) = (0, 0);
        while let Some(frame) = body.frame().await {
            let piece = frame.unwrap().into_data().unwrap().len();
            (largest, total) = (largest.max(piece), total + piece);
            let left = http_body::Body::size_hint(&body).exact();
            assert_eq!(left, Some((len - total) as u64), "after {total} bytes");
        }
        (largest, total)
    }

    fn busy(http2: bool) -> Busy {
        let head = HeadTimeout::new(Timeouts {
            header: Duration::from_secs(10),
            send: Duration::from_secs(10),
        });
        let mut busy = head.begin();
        if http2 {
            busy.http2();
        }
        busy
    }

    #[tokio::test]
    async fn an_upstream_body_goes_to_http2_in_pieces_of_at_most_16_kib_and_whole_to_http1() {
        const LEN: usize = 2 << 20;
        let mut h2 = Body::upstream(
            Upstreamed::Hyper(upstream_body(LEN).await),
            Duration::from_secs(10),
        );
        h2.keep_busy(busy(true));
        assert_eq!(http_body::Body::size_hint(&h2).exact(), Some(LEN as u64));
        assert_eq!(pieces(h2, LEN).await, (PIECE, LEN));
        let mut h1 = Body::upstream(
            Upstreamed::Hyper(upstream_body(LEN).await),
            Duration::from_secs(10),
        );
        h1.keep_busy(busy(false));
        let (largest, total) = pieces(h1, LEN).await;
        assert!(largest > PIECE, "HTTP/1.1 gets hyper's pieces as they are");
        assert_eq!(total, LEN);
    }
}
