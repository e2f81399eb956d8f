//! `header_timeout`: a connection with no request in flight must send its next request head
//! within the timeout of becoming idle (of connecting, or of its last response ending), or it
//! is closed (gracefully: HTTP/2 first sends `GOAWAY`; see `server::drive`). This stops clients
//! that connect and send nothing, or half a head, from holding connections (slowloris), over
//! HTTP/1.1 and HTTP/2 alike.
//!
//! `send_timeout`: while a response waits on the client (it has something to send, not a
//! body waiting on its upstream), the connection must make progress within the timeout, or it
//! is dropped. This stops a client that stops reading (its socket full, hyper no longer polls
//! the body) from holding its in-flight slot for ever ("slow read"). Progress on HTTP/1.1 is a
//! byte moved either way; on HTTP/2 it is counted per response: a piece of its body taken by
//! hyper (at most 16 KiB, see `body.rs`), because an HTTP/2 client that never opens a
//! stream's flow-control window still moves bytes with its pings, or with its other streams.
//! One response stuck drops the connection: hyper gives no way to reset a single stream from
//! outside its body, and hyper stops polling a body while its stream has no window.
//! An upstream that stops sending is not the client's fault:
//! the body's own timeout (`body.rs`) covers it, and the send timeout does not count meanwhile.
//!
//! One timer per connection, which wakes at most once per the shorter timeout to look at the
//! connection's state; a request only counts itself in and out, and each read or write that
//! moves bytes bumps a counter ([`Counted`]). It replaces hyper's HTTP/1 header timeout, which
//! covers neither HTTP/2 nor a connection that sends nothing at all (the protocol detection
//! waits for the first bytes before hyper's timer starts; that took a `peek` of our own).
//! Measured with callgrind, a forwarded request costs the same either way: hyper made and
//! dropped a timer per request, this one polls the connection's timer when the connection
//! waits.

use std::io;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use crate::head_error::HeadErrors;
use crate::server::Room;

/// A connection's two timeouts (`[gateway]` `header_timeout` and `send_timeout`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    pub(crate) header: Duration,
    pub(crate) send: Duration,
}

/// Why a connection's timer went off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expiry {
    /// No request head within the header timeout: close it gracefully.
    Idle,
    /// A response waited on the client and the connection made no progress for the send
    /// timeout: drop it.
    Stalled,
    /// An HTTP/2 client reset most of its requests before they were answered ([`EARLY_RESETS`]):
    /// drop it.
    ResetFlood,
}

/// The HTTP/2 "rapid reset" guard (CVE-2023-44487), Envoy's rule over the streams the gateway
/// forwarded: one the client resets before its answer, within [`EARLY`] of its start, is an
/// early reset; a connection is dropped once its early resets reach half of its forwarded
/// streams that ended, counted over at least this many (so from 250 early resets on a young
/// connection). h2 already counts streams reset before hyper takes them; these are the ones
/// reset after, each with its upstream request started (review: 120,900 streams in 20 s on one
/// connection, up to 55,000 upstream requests, past the concurrency limits, as a reset request
/// gives its places back at once). Streams the gateway answers itself are not counted: they
/// cost nothing, and a client could pad its resets with them (review: two `/health` requests
/// per reset kept 2,000 resets under the ratio).
pub(crate) const EARLY_RESETS: u64 = 500;

/// How young a stream must be for its reset to count as early: a client that gives up on a
/// slow answer (a deadline of its own) is not flooding.
pub(crate) const EARLY: Duration = Duration::from_secs(1);

/// Whether a connection whose `ended` HTTP/2 streams include `early` early resets is flooding.
fn resets_flood(ended: u64, early: u64) -> bool {
    early.saturating_mul(2) >= ended.max(EARLY_RESETS)
}

/// One connection's state for its header and send timeouts.
#[derive(Debug)]
pub(crate) struct HeadTimeout {
    timeout: Duration,
    send: Duration,
    /// When the connection was accepted; `idle_since` counts from here.
    start: Instant,
    /// Requests whose heads have arrived and whose responses have not ended.
    in_flight: AtomicUsize,
    /// Of those, the ones whose responses are still being made ([`Busy`]s: not an upload
    /// that outlived its response, [`Lingering`]).
    responding: AtomicUsize,
    /// Request heads that have arrived in all.
    begun: AtomicU64,
    /// When the last response ended, in nanoseconds after `start` (0: none yet).
    idle_since: AtomicU64,
    /// Responses waiting on the client: their head has gone to hyper, their body has not
    /// ended and is not waiting for its upstream.
    sending: AtomicUsize,
    /// Bumped by each read or write that moves bytes (only the connection's IO writes it):
    /// HTTP/1.1's progress.
    moved: AtomicU64,
    /// Whether the connection's last write found the socket full: bytes wait to be written.
    write_waits: AtomicBool,
    /// HTTP/2's progress, per response waiting on the client: when hyper last took a piece
    /// of its body (or it began to wait). A slot per response, reused once it ends.
    streams: Mutex<Vec<Option<Instant>>>,
    /// Whether the connection speaks HTTP/2 (set by its requests).
    http2: AtomicBool,
    /// Whether a tunnel has taken the connection: its bytes are no longer HTTP for the
    /// gateway to look at ([`HeadErrors`]).
    tunnel: AtomicBool,
    /// The status of hyper's automatic answer to a head it refused, once one is written
    /// (0: none): that request's access-log line, which no handler writes.
    refused: AtomicU16,
    /// Whether every byte of the responses that ended has been written: cleared when a
    /// response ends (hyper may still hold its last piece), set when hyper flushes the IO
    /// with no response being made (it does so only with its buffer empty). Only a write
    /// then can be hyper's answer to a refused head; before, it can be a response's last
    /// piece, which may read like one (review: such a body was replaced). An upload that
    /// outlived its response writes nothing: it neither clears this nor keeps it unset.
    settled: AtomicBool,
    /// The connection's room in the gateway, until the connection ends or a tunnel takes it.
    room: Mutex<Option<Room>>,
    /// Set when an HTTP/1.1 request's upload stalled after its response (see
    /// [`Lingering::abandon`]): the connection is dropped, as for a stalled response.
    abandoned: AtomicBool,
    abandon_now: tokio::sync::Notify,
    /// HTTP/2 streams that ended, and of those the early resets ([`EARLY_RESETS`]).
    streams_ended: AtomicU64,
    early_resets: AtomicU64,
    /// Set when the early resets reached their share: the connection is dropped.
    flooded: AtomicBool,
}

impl HeadTimeout {
    pub(crate) fn new(timeouts: Timeouts) -> Arc<Self> {
        Arc::new(HeadTimeout {
            timeout: timeouts.header,
            send: timeouts.send,
            start: Instant::now(),
            in_flight: AtomicUsize::new(0),
            responding: AtomicUsize::new(0),
            begun: AtomicU64::new(0),
            idle_since: AtomicU64::new(0),
            sending: AtomicUsize::new(0),
            moved: AtomicU64::new(0),
            write_waits: AtomicBool::new(false),
            streams: Mutex::new(Vec::new()),
            http2: AtomicBool::new(false),
            tunnel: AtomicBool::new(false),
            refused: AtomicU16::new(0),
            settled: AtomicBool::new(true),
            room: Mutex::new(None),
            abandoned: AtomicBool::new(false),
            abandon_now: tokio::sync::Notify::new(),
            streams_ended: AtomicU64::new(0),
            early_resets: AtomicU64::new(0),
            flooded: AtomicBool::new(false),
        })
    }

    /// Keeps the connection's room (its `max_connections` permit, its count on its thread)
    /// until the connection ends, unless a request takes it first ([`Busy::take_room`]).
    pub(crate) fn keep_room(&self, room: Room) {
        *self.room.lock().unwrap_or_else(|e| e.into_inner()) = Some(room);
    }

    /// A request's head has arrived: the connection is busy until the returned guard drops
    /// (when the response ends, or the request is abandoned).
    pub(crate) fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.responding.fetch_add(1, Ordering::AcqRel);
        self.begun.fetch_add(1, Ordering::AcqRel);
        Busy {
            head: Arc::clone(self),
            sending: false,
            http2: None,
            answered: false,
            forwarded: false,
            stream: None,
        }
    }

    /// How many request heads have arrived on the connection in all.
    pub(crate) fn begun(&self) -> u64 {
        self.begun.load(Ordering::Acquire)
    }

    /// When the last request on the connection ended (when it was accepted, if none has).
    pub(crate) fn last_ended(&self) -> Instant {
        self.start + Duration::from_nanos(self.idle_since.load(Ordering::Acquire))
    }

    /// Whether a request is in flight on the connection.
    pub(crate) fn is_busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0
    }

    /// The status hyper answered a request head it could not read with, if it did (400, 414
    /// or 431; the connection then ends).
    pub(crate) fn refused(&self) -> Option<u16> {
        match self.refused.load(Ordering::Acquire) {
            0 => None,
            status => Some(status),
        }
    }

    /// Whether the connection speaks HTTP/2 (its preface was read, or a request said so).
    pub(crate) fn speaks_http2(&self) -> bool {
        self.http2.load(Ordering::Relaxed)
    }

    fn is_sending(&self) -> bool {
        self.sending.load(Ordering::Acquire) > 0
    }

    /// Resolves when the connection has been idle for the header timeout ([`Expiry::Idle`],
    /// only if `idle`), or when responses waited on the client through a whole send timeout
    /// without progress ([`Expiry::Stalled`]; found within one more look, at most the shorter
    /// timeout later).
    pub(crate) async fn expired(&self, idle: bool) -> Expiry {
        let period = self.timeout.min(self.send);
        let first = match idle {
            true => self.idle_deadline().min(Instant::now() + period),
            false => Instant::now() + period,
        };
        let mut timer = pin!(tokio::time::sleep_until(first));
        // HTTP/1.1: the bytes counter at the last look, when that was, and how long the
        // connection has been sending without a byte moving, as of then.
        let (mut seen, mut looked, mut still) = (self.moved(), Instant::now(), Duration::ZERO);
        loop {
            tokio::select! {
                () = timer.as_mut() => {}
                () = self.abandon_now.notified() => {}
            }
            if self.abandoned.load(Ordering::Acquire) {
                return Expiry::Stalled;
            }
            if self.flooded.load(Ordering::Acquire) {
                return Expiry::ResetFlood;
            }
            let now = Instant::now();
            let left = if self.http2.load(Ordering::Relaxed) {
                // Each response on its own: one stuck on its stream's flow-control window
                // is not kept alive by others that move.
                self.oldest_stream()
                    .map(|since| (since + self.send).saturating_duration_since(now))
            } else {
                let moved = self.moved();
                still = match self.is_sending() && moved == seen {
                    true => still + (now - looked),
                    false => Duration::ZERO,
                };
                (seen, looked) = (moved, now);
                self.is_sending().then(|| self.send.saturating_sub(still))
            };
            if left == Some(Duration::ZERO) {
                return Expiry::Stalled;
            }
            let next = if idle && !self.is_busy() {
                let deadline = self.idle_deadline();
                if now >= deadline {
                    return Expiry::Idle;
                }
                deadline.min(now + period)
            } else if let Some(left) = left {
                now + period.min(left)
            } else {
                // Busy waiting for its response (no head is awaited, nothing is sent).
                now + period
            };
            timer.as_mut().reset(next);
        }
    }

    /// A count bumped by every read or write that moves bytes on the connection.
    pub(crate) fn moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }

    /// The header timeout: how long a connection with no request in flight may stay open.
    pub(crate) fn header_timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the connection's last write found the socket full (bytes wait in the
    /// connection to be written, as the client reads).
    pub(crate) fn write_waits(&self) -> bool {
        self.write_waits.load(Ordering::Relaxed)
    }

    /// Notes how a write to the socket went.
    pub(crate) fn note_write<T>(&self, polled: &Poll<io::Result<T>>) {
        self.write_waits
            .store(polled.is_pending(), Ordering::Relaxed);
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, Vec<Option<Instant>>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the HTTP/2 response waiting longest on the client last made progress.
    fn oldest_stream(&self) -> Option<Instant> {
        self.streams().iter().flatten().min().copied()
    }

    fn idle_deadline(&self) -> Instant {
        self.last_ended() + self.timeout
    }

    /// An HTTP/2 stream ended, reset early or not: past their share ([`EARLY_RESETS`]), the
    /// connection's timer goes off.
    fn stream_ended(&self, early: bool) {
        let ended = self.streams_ended.fetch_add(1, Ordering::AcqRel) + 1;
        let early = match early {
            true => self.early_resets.fetch_add(1, Ordering::AcqRel) + 1,
            false => self.early_resets.load(Ordering::Acquire),
        };
        if resets_flood(ended, early) && !self.flooded.swap(true, Ordering::AcqRel) {
            self.abandon_now.notify_one();
        }
    }
}

/// A request in flight on its connection; dropping it makes the connection idle again (if it
/// was the last).
#[derive(Debug)]
pub(crate) struct Busy {
    head: Arc<HeadTimeout>,
    sending: bool,
    /// When the request began, if it came over HTTP/2.
    http2: Option<Instant>,
    /// Whether its response was handed to hyper: dropped before, it was given up on (over
    /// HTTP/2, its client reset it, or the connection ended).
    answered: bool,
    /// Whether it went upstream.
    forwarded: bool,
    /// Its slot in the connection's `streams`, while it waits on an HTTP/2 client.
    stream: Option<usize>,
}

/// HTTP/2's connection preface (RFC 9113 section 3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl Busy {
    /// The request came over HTTP/2: its connection's progress is pieces of response bodies.
    pub(crate) fn http2(&mut self) {
        self.http2 = Some(Instant::now());
        self.head.http2.store(true, Ordering::Relaxed);
    }

    /// The request came over HTTP/1.x: so does the connection, whatever its first bytes
    /// looked like (review: one starting `PRI * HTTP/1.1`, taken for HTTP/2 by them, had its
    /// stalled responses looked for among HTTP/2 streams, found none, and was never dropped).
    pub(crate) fn http1(&mut self) {
        if self.head.http2.load(Ordering::Relaxed) {
            self.head.http2.store(false, Ordering::Relaxed);
        }
    }

    pub(crate) fn is_http2(&self) -> bool {
        self.http2.is_some()
    }

    /// Its response goes to hyper: the request was not given up on.
    pub(crate) fn answered(&mut self) {
        self.answered = true;
    }

    /// It goes upstream: over HTTP/2, it counts for the rapid-reset guard ([`EARLY_RESETS`]).
    pub(crate) fn forwarded(&mut self) {
        self.forwarded = true;
    }

    /// Takes the connection's room, for a tunnel that outlives the connection as hyper sees
    /// it: after a protocol switch, hyper lets go of the connection while its socket lives on
    /// in the tunnel, which must go on counting against `max_connections`.
    pub(crate) fn take_room(&self) -> Option<Room> {
        self.head.tunnel.store(true, Ordering::Release);
        self.head
            .room
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Its response waits on the client: the send timeout applies until [`Busy::waiting`] or
    /// the drop.
    pub(crate) fn sending(&mut self) {
        if !self.sending {
            self.sending = true;
            self.head.sending.fetch_add(1, Ordering::AcqRel);
            if self.http2.is_some() {
                let mut streams = self.head.streams();
                let now = Some(Instant::now());
                self.stream = Some(match streams.iter().position(Option::is_none) {
                    Some(free) => {
                        streams[free] = now;
                        free
                    }
                    None => {
                        streams.push(now);
                        streams.len() - 1
                    }
                });
            }
        }
    }

    /// Its response body waits for its upstream (whose own timeout applies), not the client.
    pub(crate) fn waiting(&mut self) {
        if self.sending {
            self.sending = false;
            self.head.sending.fetch_sub(1, Ordering::AcqRel);
            if let Some(i) = self.stream.take() {
                self.head.streams()[i] = None;
            }
        }
    }

    /// hyper took a piece of its body: progress on HTTP/2 for this response (on HTTP/1.1 the
    /// bytes moving on the connection say it), and the response waits on the client again.
    pub(crate) fn delivered(&mut self) {
        match self.stream {
            Some(i) => self.head.streams()[i] = Some(Instant::now()),
            None => self.sending(),
        }
    }
}

impl Busy {
    /// The request goes on after its response (its upload does): the connection stays busy,
    /// sending nothing, but is held only weakly, so that once it ends its room (its place
    /// under `max_connections` and `max_connections_per_ip`) goes with it rather than waiting
    /// for the upload (review: a closed connection kept its place for the upstream's timeout).
    pub(crate) fn linger(mut self) -> Lingering {
        self.waiting();
        // This guard's drop takes the request off the count: the lingering one will instead.
        self.head.in_flight.fetch_add(1, Ordering::AcqRel);
        Lingering {
            head: Arc::downgrade(&self.head),
            http2: self.http2.is_some(),
            begun: self.head.begun(),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.waiting();
        // Its response ended: hyper may still hold its last piece.
        self.head.settled.store(false, Ordering::Release);
        self.head.responding.fetch_sub(1, Ordering::AcqRel);
        if let (Some(begun), true) = (self.http2, self.forwarded) {
            self.head
                .stream_ended(!self.answered && begun.elapsed() < EARLY);
        }
        request_ended(&self.head);
    }
}

/// A request in flight after its response; see [`Busy::linger`].
#[derive(Debug)]
pub(crate) struct Lingering {
    head: Weak<HeadTimeout>,
    http2: bool,
    /// Heads begun on the connection when the response ended.
    begun: u64,
}

impl Lingering {
    /// The request's upload stalled: an HTTP/1.1 connection is dropped (it cannot be read
    /// past a body nobody takes, so it would not even see its client close), as one whose
    /// response stalls is, unless a later request's head has come since its response ended:
    /// then the connection was read past the body (hyper holds its last piece, the rest was
    /// read) and serves on (review: a request pipelined behind such an upload was cut with
    /// it). An HTTP/2 stream goes alone (its connection reads on, and sees a reset or a close).
    pub(crate) fn abandon(&self) {
        if self.http2 {
            return;
        }
        if let Some(head) = self.head.upgrade() {
            if head.begun() != self.begun {
                return;
            }
            head.abandoned.store(true, Ordering::Release);
            head.abandon_now.notify_one();
        }
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        if let Some(head) = self.head.upgrade() {
            request_ended(&head);
        }
    }
}

/// One request fewer in flight on the connection: idle from now if it was the last.
fn request_ended(t: &HeadTimeout) {
    let now = u64::try_from(t.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    // Before the count: whoever sees no request in flight sees this end too.
    t.idle_since.fetch_max(now, Ordering::AcqRel);
    t.in_flight.fetch_sub(1, Ordering::AcqRel);
}

pin_project! {
    /// A connection's IO, noting each read or write that moves bytes for the send timeout,
    /// and putting problem bodies into hyper's own answers to heads it refuses
    /// ([`HeadErrors`]).
    #[derive(Debug)]
    pub(crate) struct Counted<T> {
        #[pin]
        io: T,
        head: Arc<HeadTimeout>,
        errors: Arc<HeadErrors>,
        // A replacement being written in place of hyper's buffer of this length, and how
        // much of it has gone.
        swap: Option<Swap>,
        // How many of the connection's first bytes are HTTP/2's preface so far, over one
        // read or several; `u8::MAX` once one is not.
        preface: u8,
    }
}

impl<T> Counted<T> {
    pub(crate) fn new(io: T, head: Arc<HeadTimeout>, errors: Arc<HeadErrors>) -> Self {
        Counted {
            io,
            head,
            errors,
            swap: None,
            preface: 0,
        }
    }
}

/// A problem answer written in place of hyper's automatic one.
#[derive(Debug)]
struct Swap {
    answer: Vec<u8>,
    sent: usize,
    /// The length of hyper's buffer, reported written once the whole answer is.
    replaces: usize,
}

impl<T: AsyncWrite> Counted<T> {
    /// The problem answer to write instead of `buf`, if `buf` is one of hyper's automatic
    /// answers to a head it refused (never once a tunnel has the connection).
    fn swap_for(&self, buf: &[u8]) -> Option<Swap> {
        // hyper answers a refused head on its own only between messages: with no response
        // being made and every byte of the ones before written, and never on HTTP/2.
        let head = &self.head;
        if head.tunnel.load(Ordering::Acquire)
            || head.responding.load(Ordering::Acquire) > 0
            || !head.settled.load(Ordering::Acquire)
            || head.speaks_http2()
        {
            return None;
        }
        let (status, answer) = self.errors.replacement(buf)?;
        self.head.refused.store(status, Ordering::Release);
        Some(Swap {
            answer,
            sent: 0,
            replaces: buf.len(),
        })
    }

    /// Writes `buf`, or with `swap` (or one already under way) the problem answer in its
    /// place: all of it is written before `buf` is reported written, hyper offering the same
    /// `buf` again while this is pending.
    fn poll_write_or_swap(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
        swap: Option<Swap>,
    ) -> Poll<io::Result<usize>> {
        let mut this = self.project();
        let swap = match (this.swap.as_mut(), swap) {
            (Some(under_way), _) => under_way,
            (None, Some(new)) => this.swap.insert(new),
            (None, None) => {
                let polled = this.io.poll_write(cx, buf);
                this.head.note_write(&polled);
                if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
                    this.head.note_moved();
                }
                return polled;
            }
        };
        if swap.replaces != buf.len() {
            *this.swap = None;
            let e = io::Error::new(io::ErrorKind::InvalidInput, "another buffer mid-answer");
            return Poll::Ready(Err(e));
        }
        while swap.sent < swap.answer.len() {
            match ready!(this.io.as_mut().poll_write(cx, &swap.answer[swap.sent..])) {
                Ok(n @ 1..) => {
                    swap.sent += n;
                    this.head.note_moved();
                }
                Ok(0) => {
                    *this.swap = None;
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                Err(e) => {
                    *this.swap = None;
                    return Poll::Ready(Err(e));
                }
            }
        }
        *this.swap = None;
        Poll::Ready(Ok(buf.len()))
    }
}

impl HeadTimeout {
    /// Bytes moved. A load and a store, not an atomic add: only the connection's IO writes it.
    pub(crate) fn note_moved(&self) {
        let n = self.moved.load(Ordering::Relaxed);
        self.moved.store(n.wrapping_add(1), Ordering::Relaxed);
    }
}

impl<T: AsyncRead> AsyncRead for Counted<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let polled = this.io.poll_read(cx, buf);
        if buf.filled().len() > before {
            // The connection's first bytes say whether it speaks HTTP/2, before any request
            // does (a connection closed for its header timeout is told so): its whole
            // preface, as hyper reads it, in one read or several (review: `PRI ` alone, or a
            // first read of `P`, was taken for it). Its first HTTP/1.x request says otherwise
            // too ([`Busy::http1`]).
            let matched = usize::from(*this.preface);
            if matched < PREFACE.len() {
                let came = &buf.filled()[before..];
                let n = came.len().min(PREFACE.len() - matched);
                *this.preface = if came[..n] == PREFACE[matched..matched + n] {
                    (matched + n) as u8
                } else {
                    u8::MAX
                };
                if usize::from(*this.preface) == PREFACE.len() {
                    this.head.http2.store(true, Ordering::Relaxed);
                }
            }
            this.head.note_moved();
        }
        polled
    }
}

impl<T: AsyncWrite> AsyncWrite for Counted<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let swap = if self.swap.is_none() {
            self.swap_for(buf)
        } else {
            None
        };
        self.poll_write_or_swap(cx, buf, swap)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // hyper's automatic answer is a head alone: one slice that starts with the status line.
        if let [first, rest @ ..] = bufs {
            if rest.iter().all(|b| b.is_empty()) {
                if self.swap.is_some() {
                    return self.poll_write_or_swap(cx, first, None);
                }
                if let Some(swap) = self.swap_for(first) {
                    return self.poll_write_or_swap(cx, first, Some(swap));
                }
            }
        }
        let this = self.project();
        let polled = this.io.poll_write_vectored(cx, bufs);
        this.head.note_write(&polled);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.head.note_moved();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.project();
        // hyper flushes its IO once its own buffer is empty: all it had is written.
        if this.head.responding.load(Ordering::Acquire) == 0 {
            this.head.settled.store(true, Ordering::Release);
        }
        this.io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;

    /// A request abandoned after its response (its upload stalled) drops its connection only
    /// if no later request's head has come since: one that has was read past the body
    /// (review: a request pipelined behind such an upload was cut with it).
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_request_drops_its_connection_unless_it_was_read_past() {
        let timeouts = Timeouts {
            header: Duration::from_secs(10),
            send: Duration::from_secs(10),
        };
        let head = HeadTimeout::new(timeouts);
        let lingering = head.begin().linger();
        lingering.abandon();
        let expired = tokio::time::timeout(Duration::from_millis(10), head.expired(true)).await;
        assert_eq!(expired, Ok(Expiry::Stalled));

        let head = HeadTimeout::new(timeouts);
        let lingering = head.begin().linger();
        let _next = head.begin();
        lingering.abandon();
        let expired = tokio::time::timeout(Duration::from_secs(30), head.expired(true)).await;
        assert!(expired.is_err(), "{expired:?}");
        // The lingering request still counts: the connection is not idle while it runs.
        drop(_next);
        assert!(head.is_busy());
        drop(lingering);
        assert!(!head.is_busy());
    }

    const T: Duration = Duration::from_secs(10);
    /// A send timeout long enough not to matter to the header timeout's tests.
    const NEVER: Duration = Duration::from_secs(1_000_000);

    fn head(send: Duration) -> Arc<HeadTimeout> {
        HeadTimeout::new(Timeouts { header: T, send })
    }

    /// Whether `expired` has resolved after `after` more (paused) time.
    async fn expired_after(
        f: &mut std::pin::Pin<&mut impl Future<Output = Expiry>>,
        after: Duration,
    ) -> bool {
        tokio::time::timeout(after, f.as_mut()).await.is_ok()
    }

    /// How `expired` resolved within `after` more (paused) time, if it did.
    async fn expiry_within(
        f: &mut std::pin::Pin<&mut impl Future<Output = Expiry>>,
        after: Duration,
    ) -> Option<Expiry> {
        tokio::time::timeout(after, f.as_mut()).await.ok()
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_expires_a_timeout_after_it_started() {
        let t = head(NEVER);
        let mut expired = pin!(t.expired(true));
        assert!(!expired_after(&mut expired, T - Duration::from_millis(1)).await);
        assert!(expired_after(&mut expired, Duration::from_millis(2)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_connection_never_expires_and_an_idle_one_counts_from_its_last_response() {
        let t = head(NEVER);
        let mut expired = pin!(t.expired(true));
        tokio::time::advance(Duration::from_secs(5)).await;
        let first = t.begin();
        let second = t.begin();
        // Busy far longer than the timeout: a slow upstream is not the client's head.
        assert!(!expired_after(&mut expired, T * 3).await);
        drop(first);
        assert!(
            !expired_after(&mut expired, T * 2).await,
            "one still in flight"
        );
        drop(second);
        assert!(!expired_after(&mut expired, T - Duration::from_millis(1)).await);
        assert!(expired_after(&mut expired, Duration::from_millis(2)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn each_response_end_moves_the_deadline() {
        let t = head(NEVER);
        let mut expired = pin!(t.expired(true));
        for _ in 0..5 {
            assert!(!expired_after(&mut expired, T - Duration::from_secs(1)).await);
            drop(t.begin());
        }
        assert!(!expired_after(&mut expired, T - Duration::from_millis(1)).await);
        assert!(expired_after(&mut expired, Duration::from_millis(2)).await);
    }

    const SEND: Duration = Duration::from_secs(4);

    #[tokio::test(start_paused = true)]
    async fn a_response_sent_without_a_byte_moving_is_stalled_after_the_send_timeout() {
        let t = head(SEND);
        let mut expired = pin!(t.expired(true));
        let mut busy = t.begin();
        t.note_moved(); // its head arrived
        busy.sending();
        // Looks come every 4 s (the shorter timeout): the stall is found at the first look a
        // whole send timeout after the last one that saw bytes move, by 8 s.
        assert_eq!(
            expiry_within(&mut expired, SEND - Duration::from_millis(1)).await,
            None
        );
        assert_eq!(
            expiry_within(&mut expired, SEND + Duration::from_millis(2)).await,
            Some(Expiry::Stalled)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_moving_while_sending_keep_the_connection() {
        let t = head(SEND);
        let mut expired = pin!(t.expired(false));
        let mut busy = t.begin();
        busy.sending();
        for _ in 0..10 {
            assert!(!expired_after(&mut expired, SEND - Duration::from_secs(1)).await);
            t.note_moved();
        }
        drop(busy);
        assert!(
            !expired_after(&mut expired, SEND * 10).await,
            "idle, but idle expiry is off"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_waiting_on_its_upstream_is_not_stalled_until_it_waits_on_the_client_again() {
        let t = head(SEND);
        let mut expired = pin!(t.expired(false));
        let mut busy = t.begin();
        busy.sending();
        busy.waiting();
        assert!(
            !expired_after(&mut expired, SEND * 10).await,
            "the upstream's wait"
        );
        busy.delivered();
        assert_eq!(
            expiry_within(&mut expired, SEND * 2 + Duration::from_millis(1)).await,
            Some(Expiry::Stalled)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn on_http2_only_pieces_taken_are_progress_not_bytes() {
        let t = head(SEND);
        let mut expired = pin!(t.expired(false));
        let mut busy = t.begin();
        busy.http2();
        busy.sending();
        // Pieces taken keep it...
        for _ in 0..10 {
            assert!(!expired_after(&mut expired, SEND - Duration::from_secs(1)).await);
            busy.delivered();
        }
        // ...bytes alone (pings) do not.
        let stalled = async {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                t.note_moved();
            }
        };
        tokio::select! {
            expiry = expired.as_mut() => assert_eq!(expiry, Expiry::Stalled),
            () = stalled => unreachable!(),
            () = tokio::time::sleep(SEND * 3) => panic!("pings kept a shut stream alive"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn on_http2_a_response_stuck_on_its_stream_is_not_kept_alive_by_others() {
        let t = head(SEND);
        let mut expired = pin!(t.expired(false));
        let h2 = || {
            let mut busy = t.begin();
            busy.http2();
            busy.sending();
            busy
        };
        let (mut moving, stuck, mut ended) = (h2(), h2(), h2());
        ended.delivered();
        // A response that ended counts no more.
        drop(ended);
        // One response takes a piece every second; the other never does after its first.
        let stalled_after = async {
            let started = Instant::now();
            let give_up = started + SEND * 5;
            loop {
                tokio::select! {
                    expiry = expired.as_mut() => return (expiry, started.elapsed()),
                    () = tokio::time::sleep(Duration::from_secs(1)) => moving.delivered(),
                    () = tokio::time::sleep_until(give_up) => panic!("the moving one kept the stuck one alive"),
                }
            }
        };
        let (expiry, after) = stalled_after.await;
        assert_eq!(expiry, Expiry::Stalled);
        assert!(
            (SEND..=SEND + Duration::from_millis(1)).contains(&after),
            "stalled after {after:?}: the stuck one's send timeout is {SEND:?}"
        );
        drop(stuck);
    }

    #[tokio::test(start_paused = true)]
    async fn on_http2_responses_that_all_move_keep_the_connection() {
        let t = head(SEND);
        let mut expired = pin!(t.expired(false));
        let mut all: Vec<Busy> = (0..3).map(|_| t.begin()).collect();
        for b in &mut all {
            b.http2();
            b.sending();
        }
        for round in 0..20 {
            assert!(!expired_after(&mut expired, Duration::from_secs(1)).await);
            // Each takes a piece every third second, in turn.
            all[round % 3].delivered();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waiting_for_its_response_is_never_stalled() {
        let t = head(SEND);
        let mut expired = pin!(t.expired(true));
        let busy = t.begin();
        // Waiting for the upstream's head or held by a delay limit: nothing to send yet.
        assert!(!expired_after(&mut expired, SEND * 10).await);
        drop(busy);
    }

    /// An HTTP/2 request forwarded upstream that ends: answered or not, and at what age.
    async fn http2_request(t: &Arc<HeadTimeout>, answered: bool, age: Duration) {
        let mut busy = t.begin();
        busy.http2();
        busy.forwarded();
        tokio::time::advance(age).await;
        if answered {
            busy.answered();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_http2_connection_whose_requests_are_mostly_reset_early_is_dropped() {
        // After `answered` answered streams, dropped at the `early`th early reset, not before.
        async fn dropped_at(answered: u64, early: u64) {
            let young = Duration::from_millis(1);
            let t = head(NEVER);
            let mut expired = pin!(t.expired(true));
            for _ in 0..answered {
                http2_request(&t, true, young).await;
            }
            for _ in 1..early {
                http2_request(&t, false, young).await;
            }
            assert!(!expired_after(&mut expired, Duration::ZERO).await);
            http2_request(&t, false, young).await;
            assert_eq!(
                expiry_within(&mut expired, Duration::ZERO).await,
                Some(Expiry::ResetFlood)
            );
        }
        // A young connection: at its 250th early reset, whatever came between.
        dropped_at(100, EARLY_RESETS / 2).await;
        // Past `EARLY_RESETS` streams: once half of them were reset early.
        dropped_at(1_000, 1_000).await;
    }

    #[tokio::test(start_paused = true)]
    async fn giving_up_on_slow_answers_or_http1_requests_is_no_reset_flood() {
        let t = head(NEVER);
        let mut expired = pin!(t.expired(true));
        // Every request given up on, each after a second: a client with a deadline of its own.
        for _ in 0..EARLY_RESETS * 2 {
            http2_request(&t, false, EARLY).await;
        }
        // HTTP/1.1 requests dropped unanswered: their connection ended.
        for _ in 0..EARLY_RESETS * 2 {
            drop(t.begin());
        }
        assert!(!expired_after(&mut expired, Duration::ZERO).await);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_answered_by_the_gateway_do_not_pad_early_resets() {
        let t = head(NEVER);
        let mut expired = pin!(t.expired(true));
        for _ in 0..EARLY_RESETS / 2 - 1 {
            http2_request(&t, false, Duration::from_millis(1)).await;
            // Two answered by the gateway itself (not forwarded) per reset.
            for _ in 0..2 {
                let mut busy = t.begin();
                busy.http2();
                busy.answered();
            }
        }
        assert!(!expired_after(&mut expired, Duration::ZERO).await);
        http2_request(&t, false, Duration::from_millis(1)).await;
        assert_eq!(
            expiry_within(&mut expired, Duration::ZERO).await,
            Some(Expiry::ResetFlood)
        );
    }
}
