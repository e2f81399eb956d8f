//! The gateway's own HTTP/1.1 client, for the common exchange: a request without a body and
//! without an upgrade (a `GET`, `HEAD`, `DELETE`, a bodiless `POST`...).
//!
//! Why not hyper's client for these: callgrind put hyper's HTTP/1 client at about a third of
//! a forwarded request's user-space instructions (docs/benchmarks.md, stop 18): a channel
//! crossing and a task poll each way between the request's task and the connection's, the
//! request head encoded through hyper's generic encoder, the response head parsed into a fresh
//! 8 KiB read buffer after every message. Here the request's own task writes the head and reads
//! the answer on the connection it checked out, and a response whose body has already arrived
//! whole (most API answers) returns the connection to the pool before the response leaves.
//! Requests with a body or an upgrade still go through hyper (`forward.rs`), whose streaming
//! of uploads, early answers and protocol switches this client does not repeat.
//!
//! What it checks of the upstream's answer, as hyper's client does or stricter: one status
//! line `HTTP/1.x` and at most [`MAX_HEADERS`] fields in at most [`MAX_HEAD`] bytes; a body
//! framed by `Transfer-Encoding: chunked` alone or by one `Content-Length` (equal repeats
//! allowed), not both, else the answer is refused as `upstream-bad-response`; interim `1xx`
//! answers skipped; no body after `HEAD`, `204` or `304`; a body of neither framing read until
//! the upstream closes. A connection goes back to the pool only when its answer ended exactly
//! where the next would begin, the upstream speaks HTTP/1.1 and did not say `close`.

use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Method, Response, StatusCode, Version};
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use crate::forward::{Pools, Readiness};

/// Header fields in a response head at most (hyper's client: 100).
const MAX_HEADERS: usize = 100;
/// The largest response head (hyper's client: 8 KiB + 100 x 4 KiB).
const MAX_HEAD: usize = 8192 + 4096 * MAX_HEADERS;
/// A connection's read buffer to start with; it grows towards [`MAX_HEAD`] only for a head
/// that does not fit.
const READ_BUF: usize = 8192;
/// The largest read of a body straight into its own piece, when nothing is buffered.
const BODY_READ: usize = 64 * 1024;
/// The longest chunk-size line (with its extensions), and the longest trailer section.
const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILERS: usize = 64 * 1024;

/// An upstream connection and its buffers.
#[derive(Debug)]
pub(crate) struct Conn {
    io: TcpStream,
    /// Bytes `start..end` arrived and are not used yet; the rest is room.
    rbuf: Vec<u8>,
    start: usize,
    end: usize,
    /// The request head being written (kept for its allocation).
    wbuf: Vec<u8>,
}

/// A kept connection with its response timer, re-armed by each request (as `forward::Kept`).
#[derive(Debug)]
pub(crate) struct Plain {
    conn: Conn,
    pub(crate) timer: Pin<Box<Sleep>>,
}

/// Why an exchange failed.
#[derive(Debug)]
pub(crate) enum Error {
    /// No answer's head by the deadline.
    Timeout,
    /// The connection failed or closed before any byte of an answer came: the request may
    /// not have reached the upstream (a kept connection the upstream closed meanwhile).
    Unanswered(io::Error),
    /// The connection failed or closed in the middle of the answer's head.
    Io(io::Error),
    /// The head is not HTTP/1.x, or too large.
    Malformed(&'static str),
    /// The head frames its body ambiguously or with a coding other than chunked.
    Framing(&'static str),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Timeout => f.write_str("no response head in time"),
            Error::Unanswered(e) => write!(f, "closed before answering: {e}"),
            Error::Io(e) => write!(f, "failed during the response head: {e}"),
            Error::Malformed(what) => write!(f, "malformed response head: {what}"),
            Error::Framing(what) => write!(f, "response framing: {what}"),
        }
    }
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Empty,
    Length(u64),
    Chunked(Chunk),
    /// Until the upstream closes the connection.
    Close,
}

/// Where a chunked body's decoding stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// This many bytes of chunk data left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer fields until an empty line, passed on as the body's
    /// trailers (HTTP/2 clients get them; hyper's HTTP/1.1 server side sends those the
    /// `Trailer` field names, to a client that sent `TE: trailers`). Holds how many of the
    /// buffered bytes are whole lines already looked at.
    Trailers(usize),
}

/// A parsed response head, with what the connection needs to know of it.
struct Head {
    status: StatusCode,
    /// The reason phrase, when it is not the status code's usual one (passed on as hyper's
    /// client did: a `999 Weird` or a `404 Item Missing` reaches an HTTP/1.1 client as sent).
    reason: Option<hyper::ext::ReasonPhrase>,
    version: Version,
    headers: HeaderMap,
    framing: Framing,
    /// HTTP/1.1 without `Connection: close`.
    keep_alive: bool,
}

impl Conn {
    fn new(io: TcpStream) -> Self {
        Conn {
            io,
            rbuf: vec![0; READ_BUF],
            start: 0,
            end: 0,
            wbuf: Vec::new(),
        }
    }

    fn buffered(&self) -> &[u8] {
        &self.rbuf[self.start..self.end]
    }

    /// Whether an idle connection can carry a request: the upstream has neither closed it nor
    /// sent anything unasked. Costs no system call unless the socket became readable.
    fn readiness(&self) -> Readiness {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match self.io.poll_read_ready(&mut cx) {
            Poll::Pending => Readiness::Ready,
            Poll::Ready(Err(_)) => Readiness::Closed,
            Poll::Ready(Ok(())) => match self.io.try_read(&mut [0u8; 1]) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Readiness::Ready,
                _ => Readiness::Closed,
            },
        }
    }

    /// Reads more into the buffer (grown up to `max` bytes if full); `Ok(0)` at the end of the
    /// stream, an error if the buffer cannot grow.
    fn poll_fill(&mut self, cx: &mut Context<'_>, max: usize) -> Poll<io::Result<usize>> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.rbuf.len() && self.start > 0 {
            self.rbuf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        if self.end == self.rbuf.len() {
            if self.rbuf.len() >= max {
                return Poll::Ready(Err(io::Error::other("more than the read buffer may hold")));
            }
            self.rbuf.resize((self.rbuf.len() * 2).min(max), 0);
        }
        let mut room = ReadBuf::new(&mut self.rbuf[self.end..]);
        std::task::ready!(Pin::new(&mut self.io).poll_read(cx, &mut room))?;
        let n = room.filled().len();
        self.end += n;
        Poll::Ready(Ok(n))
    }

    async fn fill(&mut self, max: usize) -> io::Result<usize> {
        std::future::poll_fn(|cx| self.poll_fill(cx, max)).await
    }

    /// Writes the head in `wbuf` and reads the answer's head (after any interim answers).
    async fn roundtrip(&mut self, head_only: bool) -> Result<Head, Error> {
        self.io
            .write_all(&self.wbuf)
            .await
            .map_err(Error::Unanswered)?;
        let mut answered = false;
        loop {
            // Bytes of the answer known to hold no whole head: it is parsed again only once a
            // line has ended after them, so a head trickled a byte at a time costs a parse per
            // line, not per byte (at most 100 fields, so about a hundred parses of 408 KiB at
            // worst, where per byte it would be tens of gigabytes scanned).
            let mut checked = 0;
            let head = loop {
                // (Nothing to parse before the first read: a kept connection's buffer is empty.)
                if self.buffered()[checked..].contains(&b'\n') {
                    if let Some((len, head)) = parse_head(self.buffered(), head_only)? {
                        self.start += len;
                        break head;
                    }
                }
                checked = self.end - self.start;
                answered |= self.start != self.end;
                if self.end - self.start >= MAX_HEAD {
                    return Err(Error::Malformed("larger than 408 KiB"));
                }
                match self.fill(MAX_HEAD).await {
                    Ok(0) if answered => {
                        return Err(Error::Io(io::ErrorKind::UnexpectedEof.into()))
                    }
                    Ok(0) => return Err(Error::Unanswered(io::ErrorKind::UnexpectedEof.into())),
                    Ok(_) => {}
                    Err(e) if answered => return Err(Error::Io(e)),
                    Err(e) => return Err(Error::Unanswered(e)),
                }
            };
            answered = true;
            // 100 Continue, 102, 103 Early Hints: not passed on (as hyper's client).
            if head.status.is_informational() && head.status != StatusCode::SWITCHING_PROTOCOLS {
                continue;
            }
            return Ok(head);
        }
    }
}

/// Writes `parts`' request line and fields, as hyper's client writes a request without a body
/// (names as the map holds them, in lower case; each value on its own line).
fn encode(dst: &mut Vec<u8>, parts: &http::request::Parts) {
    dst.clear();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    dst.extend_from_slice(parts.method.as_str().as_bytes());
    dst.push(b' ');
    dst.extend_from_slice(path.as_bytes());
    dst.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        dst.extend_from_slice(name.as_str().as_bytes());
        dst.extend_from_slice(b": ");
        dst.extend_from_slice(value.as_bytes());
        dst.extend_from_slice(b"\r\n");
    }
    dst.extend_from_slice(b"\r\n");
}

/// Parses a response head at the start of `buf`: `None` until it is whole.
fn parse_head(buf: &[u8], head_only: bool) -> Result<Option<(usize, Head)>, Error> {
    #[cfg(test)]
    tests::PARSES.with(|n| n.set(n.get() + 1));
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut res = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut res,
        buf,
        &mut fields,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Error::Malformed("more than 100 header fields"))
        }
        Err(_) => return Err(Error::Malformed("not an HTTP/1.x response head")),
    };
    let status = res
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or(Error::Malformed("status code"))?;
    let version = match res.version {
        Some(1) => Version::HTTP_11,
        _ => Version::HTTP_10,
    };
    let reason = res
        .reason
        .filter(|r| Some(*r) != status.canonical_reason())
        .and_then(|r| hyper::ext::ReasonPhrase::try_from(r.as_bytes()).ok());
    // One copy of the head, which the field values share.
    let bytes = Bytes::copy_from_slice(&buf[..len]);
    let base = buf.as_ptr() as usize;
    let mut headers = HeaderMap::with_capacity(res.headers.len() + 3);
    let (mut length, mut chunked, mut coded, mut close) = (None::<u64>, false, false, false);
    for field in res.headers.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes())
            .map_err(|_| Error::Malformed("header field name"))?;
        let at = field.value.as_ptr() as usize - base;
        let value = HeaderValue::from_maybe_shared(bytes.slice(at..at + field.value.len()))
            .map_err(|_| Error::Malformed("header field value"))?;
        if name == http::header::CONTENT_LENGTH {
            for n in value.as_bytes().split(|&b| b == b',') {
                let n = parse_length(n.trim_ascii()).ok_or(Error::Framing("Content-Length"))?;
                if length.is_some_and(|l| l != n) {
                    return Err(Error::Framing("Content-Length values differ"));
                }
                length = Some(n);
            }
        } else if name == http::header::TRANSFER_ENCODING {
            // Only `chunked`, alone and last: anything else the gateway could not pass on
            // (the field is hop-by-hop), nor tell where the body ends.
            for coding in value.as_bytes().split(|&b| b == b',') {
                let coding = coding.trim_ascii();
                if coding.is_empty() {
                    continue;
                }
                if chunked || !coding.eq_ignore_ascii_case(b"chunked") {
                    coded = true;
                }
                chunked = true;
            }
        } else if name == http::header::CONNECTION {
            let mut names_others = false;
            for token in value.as_bytes().split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if !token.is_empty() && !token.eq_ignore_ascii_case(b"keep-alive") {
                    names_others = true;
                }
            }
            if names_others {
                // Kept, for `strip_hop_by_hop` to remove the fields it names too.
                headers.append(name, value);
                continue;
            }
        }
        // Hop-by-hop fields are read above, and never passed on: not stored, so that the
        // gateway's stripping finds nothing to remove in the usual case (`Connection:
        // keep-alive`, `Transfer-Encoding: chunked`).
        if !crate::forward::is_hop_by_hop(&name) {
            headers.append(name, value);
        }
    }
    if coded || (chunked && (length.is_some() || version == Version::HTTP_10)) {
        return Err(Error::Framing(
            "Transfer-Encoding other than chunked alone, or with Content-Length",
        ));
    }
    let bodiless = head_only
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let framing = match (bodiless, chunked, length) {
        (true, _, _) => Framing::Empty,
        (false, true, _) => Framing::Chunked(Chunk::Size),
        (false, false, Some(n)) => Framing::Length(n),
        (false, false, None) => Framing::Close,
    };
    // A 204 that announces a body breaks its framing (RFC 9110 section 15.3.5): such a
    // server may send the body it announced after all, late, into the next request's answer
    // (review: a late `0\r\n\r\n` was the next client's 502). Its connection is not kept.
    // Nor that of an answer to `HEAD`, or a 304, that announces one: the announcement is
    // allowed there (the length the `GET` would have), but a server that sends the body
    // anyway, in a write of its own, has it read as the next request's answer, and every
    // answer on that connection after it goes to the request after its own: other clients'
    // (review: 14 of 348 requests got another client's answer). A connection per such
    // answer is the price.
    let announced = chunked || length.is_some_and(|n| n > 0);
    let broken = announced
        && (head_only || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED);
    let keep_alive = version == Version::HTTP_11 && !close && framing != Framing::Close && !broken;
    Ok(Some((
        len,
        Head {
            status,
            reason,
            version,
            headers,
            framing,
            keep_alive,
        },
    )))
}

/// A `Content-Length` value: decimal digits only, no sign, no overflow.
fn parse_length(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &d| {
        d.is_ascii_digit().then(|| n * 10 + u64::from(d - b'0'))
    })
}

/// A chunk-size line at the start of `buf`: hex digits (at most 16 after leading zeros),
/// optional whitespace and extensions (no control characters but tab), CRLF. `Ok(None)`
/// until the line is whole.
fn parse_chunk_size(buf: &[u8]) -> Result<Option<(usize, u64)>, &'static str> {
    let Some(lf) = buf.iter().position(|&b| b == b'\n') else {
        return if buf.len() > MAX_CHUNK_LINE {
            Err("chunk-size line too long")
        } else {
            Ok(None)
        };
    };
    if lf > MAX_CHUNK_LINE || lf == 0 || buf[lf - 1] != b'\r' {
        return Err("chunk-size line");
    }
    let line = &buf[..lf - 1];
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let significant = line[..digits].iter().skip_while(|&&b| b == b'0').count();
    if digits == 0 || significant > 16 {
        return Err("chunk size");
    }
    let rest = &line[digits..];
    let ext = rest.trim_ascii_start();
    let ext_ok = rest.iter().all(|&b| b == b'\t' || (b >= b' ' && b != 0x7f))
        && (ext.is_empty() || ext[0] == b';');
    if !ext_ok {
        return Err("chunk extension");
    }
    let size = line[..digits].iter().fold(0u64, |n, &d| {
        let v = (d as char).to_digit(16).unwrap_or(0);
        (n << 4) | u64::from(v)
    });
    Ok(Some((lf + 1, size)))
}

/// What a finished exchange hands the caller.
pub(crate) enum Answer {
    /// The head, and the whole body already read: the connection is free.
    Whole(Response<Option<Bytes>>, Option<Plain>),
    /// The head; the body is still to be read from the connection.
    Streaming(Response<()>, Box<Streaming>),
}

impl Plain {
    /// Whether this idle connection can carry a request (see [`Conn::readiness`]).
    pub(crate) fn readiness(&self) -> Readiness {
        self.conn.readiness()
    }

    /// A new connection, its timer set to `deadline` (re-armed by each exchange).
    pub(crate) fn new(io: TcpStream, deadline: Instant) -> Self {
        Plain {
            conn: Conn::new(io),
            timer: Box::pin(tokio::time::sleep_until(deadline)),
        }
    }
}

/// Sends the bodiless request `parts` on `plain` and reads the answer's head by `deadline`,
/// and its body too if it has already arrived; `pools` takes the connection back when a
/// streamed body ends.
pub(crate) async fn exchange(
    mut plain: Plain,
    parts: &http::request::Parts,
    pools: &Arc<Pools<Plain>>,
    deadline: Instant,
) -> Result<Answer, Error> {
    encode(&mut plain.conn.wbuf, parts);
    plain.timer.as_mut().reset(deadline);
    let head_only = parts.method == Method::HEAD;
    let head = {
        let Plain { conn, timer } = &mut plain;
        tokio::select! {
            biased;
            head = conn.roundtrip(head_only) => head?,
            () = timer.as_mut() => return Err(Error::Timeout),
        }
    };
    let mut res = Response::new(());
    *res.status_mut() = head.status;
    *res.version_mut() = head.version;
    *res.headers_mut() = head.headers;
    if let Some(reason) = head.reason {
        res.extensions_mut().insert(reason);
    }
    if head.status == StatusCode::SWITCHING_PROTOCOLS {
        // Not asked for: the connection is the upstream's other protocol now.
        return Ok(Answer::Whole(res.map(|()| None), None));
    }
    let mut body = Streaming {
        plain: Some(plain),
        framing: head.framing,
        keep_alive: head.keep_alive,
        pools: Arc::clone(pools),
        big_reads: false,
        delivered: false,
        failed: None,
    };
    match body.take_whole() {
        Ok(Some((data, plain))) => Ok(Answer::Whole(res.map(|()| data), plain)),
        Ok(None) => Ok(Answer::Streaming(res, Box::new(body))),
        Err(what) => Err(Error::Framing(what)),
    }
}

/// A whole body (`None` if empty) and the connection it came on, if it can be kept.
type Whole = (Option<Bytes>, Option<Plain>);

/// A response body read from its connection as the client takes it.
#[derive(Debug)]
pub(crate) struct Streaming {
    /// `None` once the body ended (the connection went back to the pool or was closed).
    plain: Option<Plain>,
    framing: Framing,
    keep_alive: bool,
    pools: Arc<Pools<Plain>>,
    /// Whether the last read of the body filled the buffer: then the next read goes
    /// straight into a piece of up to [`BODY_READ`] bytes, until one comes back less than
    /// half full (a trickle must not hold a large allocation per byte while the client is
    /// slow to take it).
    big_reads: bool,
    /// A piece was handed on since the last `Pending`; a failure then waits one poll (see
    /// [`Streaming::poll_frame`]).
    delivered: bool,
    /// The failure to report at the next poll.
    failed: Option<io::Error>,
}

impl Streaming {
    /// The whole body, if it is already in the buffer (decoded if chunked), with the
    /// connection if it can be kept.
    fn take_whole(&mut self) -> Result<Option<Whole>, &'static str> {
        let Some(plain) = self.plain.as_mut() else {
            return Ok(None);
        };
        let conn = &mut plain.conn;
        let data = match self.framing {
            Framing::Empty => None,
            Framing::Length(n) if (conn.end - conn.start) as u64 >= n => {
                let n = n as usize;
                let data = Bytes::copy_from_slice(&conn.rbuf[conn.start..conn.start + n]);
                conn.start += n;
                (n > 0).then_some(data)
            }
            Framing::Chunked(Chunk::Size) => {
                // Decode on a copy of the state: if the last chunk has not arrived, the
                // buffer is left as it was and the body streams.
                let (mut at, mut data) = (conn.start, Vec::new());
                loop {
                    let Some((len, size)) = parse_chunk_size(&conn.rbuf[at..conn.end])? else {
                        return Ok(None);
                    };
                    at += len;
                    if size == 0 {
                        // Trailer fields: passed on by streaming.
                        match trailers_end(&conn.rbuf[at..conn.end], &mut 0)? {
                            Some(2) => at += 2,
                            _ => return Ok(None),
                        }
                        break;
                    }
                    let size = usize::try_from(size).unwrap_or(usize::MAX);
                    if conn.end - at < size.saturating_add(2) {
                        return Ok(None);
                    }
                    data.extend_from_slice(&conn.rbuf[at..at + size]);
                    if &conn.rbuf[at + size..at + size + 2] != b"\r\n" {
                        return Err("chunk data not followed by CRLF");
                    }
                    at += size + 2;
                }
                conn.start = at;
                (!data.is_empty()).then(|| Bytes::from(data))
            }
            _ => return Ok(None),
        };
        self.framing = Framing::Length(0);
        Ok(Some((data, self.release())))
    }

    /// The body has ended: the connection, if it can carry another request (kept alive, and
    /// nothing unasked after the answer).
    fn release(&mut self) -> Option<Plain> {
        let mut plain = self.plain.take()?;
        let conn = &mut plain.conn;
        if !self.keep_alive || conn.start != conn.end {
            return None;
        }
        // A buffer grown for a large head goes back to its usual size while kept.
        if conn.rbuf.len() > READ_BUF {
            conn.rbuf = vec![0; READ_BUF];
            (conn.start, conn.end) = (0, 0);
        }
        Some(plain)
    }

    fn finish(&mut self) {
        if let Some(plain) = self.release() {
            self.pools.checkin(plain, Instant::now());
        }
    }

    /// After a piece: a chunk's data done waits for its CRLF; a body done frees its
    /// connection at once (hyper stops polling a body that says it has ended).
    fn advance(&mut self) {
        match &mut self.framing {
            Framing::Chunked(c @ Chunk::Data(0)) => *c = Chunk::DataEnd,
            Framing::Length(0) => self.finish(),
            _ => {}
        }
    }

    pub(crate) fn is_end_stream(&self) -> bool {
        self.failed.is_none() && (self.plain.is_none() || self.framing == Framing::Length(0))
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Empty => SizeHint::with_exact(0),
            _ if self.plain.is_none() => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }

    /// The next piece of the body. A failure found right after pieces were handed on is
    /// reported one poll later, after a `Pending` (with a wake-up): hyper ends the connection
    /// at once on a body error, dropping what it has not sent yet, and on `Pending` it first
    /// sends what it has. So the client gets the head and the pieces before the cut, as
    /// through hyper's client, rather than nothing at all.
    pub(crate) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if let Some(e) = self.failed.take() {
            return Poll::Ready(Some(Err(e)));
        }
        match self.poll_next(cx) {
            Poll::Ready(Some(Err(e))) if self.delivered => {
                self.delivered = false;
                self.failed = Some(e);
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Ready(Some(Ok(frame))) => {
                self.delivered = true;
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => {
                self.delivered = false;
                Poll::Pending
            }
            other => other,
        }
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let bad = |what: &'static str| io::Error::new(io::ErrorKind::InvalidData, what);
        loop {
            let Some(plain) = self.plain.as_mut() else {
                return Poll::Ready(None);
            };
            let conn = &mut plain.conn;
            let buffered = (conn.end - conn.start) as u64;
            match &mut self.framing {
                Framing::Empty | Framing::Length(0) => {
                    self.finish();
                    return Poll::Ready(None);
                }
                Framing::Length(n) | Framing::Chunked(Chunk::Data(n)) if buffered > 0 => {
                    let take = buffered.min(*n) as usize;
                    let data = Bytes::copy_from_slice(&conn.rbuf[conn.start..conn.start + take]);
                    conn.start += take;
                    *n -= take as u64;
                    self.advance();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Framing::Length(n) | Framing::Chunked(Chunk::Data(n))
                    if self.big_reads && *n >= READ_BUF as u64 =>
                {
                    // Nothing buffered, and the body comes fast: read straight into the piece.
                    let mut piece = vec![0; (*n).min(BODY_READ as u64) as usize];
                    let mut room = ReadBuf::new(&mut piece);
                    match Pin::new(&mut conn.io).poll_read(cx, &mut room) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Err(e)) => return self.fail(e),
                        Poll::Ready(Ok(())) => {}
                    }
                    let got = room.filled().len();
                    if got == 0 {
                        return self.fail(io::ErrorKind::UnexpectedEof.into());
                    }
                    *n -= got as u64;
                    let data = if got < piece.len() / 2 {
                        self.big_reads = false;
                        Bytes::copy_from_slice(&piece[..got])
                    } else {
                        piece.truncate(got);
                        Bytes::from(piece)
                    };
                    self.advance();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Framing::Close if buffered > 0 => {
                    let data = Bytes::copy_from_slice(conn.buffered());
                    conn.start = conn.end;
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Framing::Chunked(Chunk::Size) => match parse_chunk_size(conn.buffered()) {
                    Err(what) => return self.fail(bad(what)),
                    Ok(Some((len, size))) => {
                        conn.start += len;
                        self.framing = Framing::Chunked(if size == 0 {
                            Chunk::Trailers(0)
                        } else {
                            Chunk::Data(size)
                        });
                        continue;
                    }
                    Ok(None) => {}
                },
                Framing::Chunked(Chunk::DataEnd) if buffered >= 2 => {
                    if conn.buffered()[..2] != *b"\r\n" {
                        return self.fail(bad("chunk data not followed by CRLF"));
                    }
                    conn.start += 2;
                    self.framing = Framing::Chunked(Chunk::Size);
                    continue;
                }
                Framing::Chunked(Chunk::Trailers(mut checked)) => {
                    match trailers_end(conn.buffered(), &mut checked) {
                        Err(what) => return self.fail(bad(what)),
                        Ok(Some(len)) => {
                            let fields = match trailer_fields(&conn.buffered()[..len]) {
                                Err(what) => return self.fail(bad(what)),
                                Ok(fields) => fields,
                            };
                            conn.start += len;
                            self.framing = Framing::Length(0);
                            self.finish();
                            match fields {
                                None => continue,
                                Some(fields) => {
                                    return Poll::Ready(Some(Ok(Frame::trailers(fields))))
                                }
                            }
                        }
                        Ok(None) => self.framing = Framing::Chunked(Chunk::Trailers(checked)),
                    }
                }
                Framing::Length(_)
                | Framing::Chunked(Chunk::Data(_) | Chunk::DataEnd)
                | Framing::Close => {}
            }
            // More bytes needed.
            let close = self.framing == Framing::Close;
            let max = if matches!(self.framing, Framing::Chunked(Chunk::Trailers(_))) {
                MAX_TRAILERS + READ_BUF
            } else {
                READ_BUF
            };
            let plain = self.plain.as_mut().expect("checked above");
            match plain.conn.poll_fill(cx, max) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(got)) if got >= READ_BUF / 2 => self.big_reads = true,
                Poll::Ready(Ok(0)) if close => {
                    self.plain = None;
                    return Poll::Ready(None);
                }
                Poll::Ready(Ok(0)) => {
                    return self.fail(io::ErrorKind::UnexpectedEof.into());
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return self.fail(e),
            }
        }
    }

    fn fail(&mut self, e: io::Error) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.plain = None;
        Poll::Ready(Some(Err(e)))
    }
}

/// Where a trailer section ends in `buf` (just past its empty line): `None` until it does.
/// Looks from `*at`, the end of the whole lines already looked at, and moves it past the
/// lines it finds, so that a section trickled a byte at a time is read once, not once a byte.
fn trailers_end(buf: &[u8], at: &mut usize) -> Result<Option<usize>, &'static str> {
    while let Some(lf) = buf[*at..].iter().position(|&b| b == b'\n') {
        let line = &buf[*at..*at + lf];
        *at += lf + 1;
        if *at > MAX_TRAILERS {
            return Err("trailer section too long");
        }
        match line {
            b"\r" => return Ok(Some(*at)),
            [.., b'\r'] => {}
            _ => return Err("trailer line not ended by CRLF"),
        }
    }
    if buf.len() > MAX_TRAILERS {
        return Err("trailer section too long");
    }
    Ok(None)
}

/// The fields of a whole trailer section (its empty line included): `None` if it has none.
fn trailer_fields(section: &[u8]) -> Result<Option<HeaderMap>, &'static str> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let fields = match httparse::parse_headers(section, &mut fields) {
        Ok(httparse::Status::Complete((_, fields))) => fields,
        _ => return Err("trailer fields"),
    };
    if fields.is_empty() {
        return Ok(None);
    }
    let mut map = HeaderMap::with_capacity(fields.len());
    for field in fields.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes()).map_err(|_| "trailer field")?;
        let value = HeaderValue::from_bytes(field.value).map_err(|_| "trailer field")?;
        map.append(name, value);
    }
    Ok(Some(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// Calls of `parse_head` on this thread.
        pub(super) static PARSES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    fn head(text: &str) -> Result<Option<(usize, Head)>, Error> {
        parse_head(text.as_bytes(), false)
    }

    fn framing(text: &str) -> Framing {
        head(text).unwrap().unwrap().1.framing
    }

    #[test]
    fn a_head_is_framed_by_chunked_alone_or_one_length_else_refused() {
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"),
            Framing::Length(5)
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\ncontent-length: 5\r\n\r\n"),
            Framing::Length(5)
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"),
            Framing::Chunked(Chunk::Size)
        );
        assert_eq!(framing("HTTP/1.0 200 OK\r\n\r\n"), Framing::Close);
        assert_eq!(framing("HTTP/1.1 204 No Content\r\n\r\n"), Framing::Empty);
        assert_eq!(
            framing("HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n"),
            Framing::Empty
        );
        let (_, h) = parse_head(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n", true)
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, Framing::Empty, "an answer to HEAD has no body");
        for bad in [
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 5, 6\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: \r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n",
            "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        ] {
            assert!(
                matches!(head(bad), Err(Error::Framing(_))),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn hop_by_hop_fields_are_read_not_kept_unless_connection_names_others() {
        let kept = |t: &str| {
            let h = head(t).unwrap().unwrap().1;
            let names: Vec<String> = h.headers.keys().map(|n| n.to_string()).collect();
            (names, h.keep_alive)
        };
        let usual = "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\
            Transfer-Encoding: chunked\r\nX-App: 1\r\nTrailer: x-sum\r\n\r\n";
        // `Trailer` is not one: it names the trailer fields, end to end.
        let names = vec!["x-app".to_owned(), "trailer".to_owned()];
        assert_eq!(kept(usual), (names, true));
        let (names, keep_alive) =
            kept("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(
            (names, keep_alive),
            (vec!["content-length".to_owned()], false)
        );
        // A field that Connection names is the gateway's to remove: Connection stays for it.
        let (names, keep_alive) = kept(
            "HTTP/1.1 200 OK\r\nconnection: keep-alive, x-internal\r\nx-internal: 1\r\n\
            content-length: 0\r\n\r\n",
        );
        assert_eq!(names, ["connection", "x-internal", "content-length"]);
        assert!(keep_alive);
    }

    #[test]
    fn a_head_must_be_http_1_and_within_limits() {
        assert!(head("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n")
            .unwrap()
            .is_none());
        for bad in [
            "HTTP/2 200 OK\r\n\r\n",
            "HTTP/1.1 20 OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\nbad name: x\r\n\r\n",
            "HTTP/1.1 200 OK\r\nx: a\u{7}b\r\n\r\n",
            "HTTP/1.1 200 OK\r\n folded: x\r\n\r\n",
        ] {
            assert!(
                matches!(head(bad), Err(Error::Malformed(_))),
                "{bad:?} was accepted"
            );
        }
        let many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: v\r\n")).collect();
        let text = format!("HTTP/1.1 200 OK\r\n{many}\r\n");
        assert!(matches!(head(&text), Err(Error::Malformed(_))));
    }

    #[test]
    fn a_reason_phrase_other_than_the_usual_one_is_kept() {
        let reason = |t: &str| {
            head(t)
                .unwrap()
                .unwrap()
                .1
                .reason
                .map(|r| r.as_bytes().to_vec())
        };
        assert_eq!(reason("HTTP/1.1 404 Not Found\r\n\r\n"), None);
        assert_eq!(
            reason("HTTP/1.1 404 Item Missing\r\n\r\n").as_deref(),
            Some(&b"Item Missing"[..])
        );
        assert_eq!(
            reason("HTTP/1.1 999 Weird\r\n\r\n").as_deref(),
            Some(&b"Weird"[..])
        );
        assert_eq!(reason("HTTP/1.1 200 \r\n\r\n").as_deref(), Some(&b""[..]));
    }

    #[test]
    fn keep_alive_needs_http_1_1_without_close_and_a_delimited_body() {
        let keep = |t: &str| head(t).unwrap().unwrap().1.keep_alive;
        assert!(keep("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"));
        assert!(!keep(
            "HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\ncontent-length: 0\r\n\r\n"
        ));
        assert!(!keep(
            "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n"
        ));
        assert!(!keep("HTTP/1.1 200 OK\r\n\r\n"));
        // A 204 announcing a body may send it late.
        assert!(keep("HTTP/1.1 204 No Content\r\n\r\n"));
        assert!(keep("HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n"));
        assert!(!keep(
            "HTTP/1.1 204 No Content\r\ntransfer-encoding: chunked\r\n\r\n"
        ));
        assert!(!keep(
            "HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n"
        ));
        // So may a 304, or an answer to HEAD (review: its late body was the next client's
        // answer, and each answer after it the next request's).
        assert!(keep("HTTP/1.1 304 Not Modified\r\n\r\n"));
        assert!(!keep(
            "HTTP/1.1 304 Not Modified\r\ncontent-length: 54\r\n\r\n"
        ));
        let keep_head = |t: &str| {
            parse_head(t.as_bytes(), true)
                .unwrap()
                .unwrap()
                .1
                .keep_alive
        };
        assert!(keep_head("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"));
        assert!(!keep_head("HTTP/1.1 200 OK\r\ncontent-length: 54\r\n\r\n"));
        assert!(!keep_head(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        ));
    }

    #[test]
    fn field_values_are_kept_as_sent() {
        let text = "HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nset-cookie: b=2\r\nx-odd: caf\u{e9} \r\ncontent-length: 0\r\n\r\n";
        let (len, h) = head(text).unwrap().unwrap();
        assert_eq!(len, text.len());
        let cookies: Vec<_> = h.headers.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert_eq!(h.headers["x-odd"].as_bytes(), "caf\u{e9}".as_bytes());
    }

    #[test]
    fn chunk_sizes_are_strict_hex_with_optional_extensions() {
        assert_eq!(parse_chunk_size(b"1f\r\nxx"), Ok(Some((4, 31))));
        assert_eq!(parse_chunk_size(b"0;name=\"v\"\r\n"), Ok(Some((12, 0))));
        assert_eq!(parse_chunk_size(b"A ; x\r\n"), Ok(Some((7, 10))));
        assert_eq!(parse_chunk_size(b"5 \t\r\n"), Ok(Some((5, 5))));
        assert_eq!(
            parse_chunk_size(b"00000000000000000005\r\n"),
            Ok(Some((22, 5)))
        );
        assert_eq!(parse_chunk_size(b"ffff"), Ok(None));
        assert_eq!(
            parse_chunk_size(b"ffffffffffffffff\r\n"),
            Ok(Some((18, u64::MAX)))
        );
        for bad in [
            &b"\r\n"[..],
            b"1ffffffffffffffff\r\n",
            b"-1\r\n",
            b"5\n",
            b"5 x\r\n",
            b"5;\x01\r\n",
            b"0x5\r\n",
        ] {
            assert!(parse_chunk_size(bad).is_err(), "{bad:?}");
        }
        let long = [b'1'; MAX_CHUNK_LINE + 1];
        assert!(parse_chunk_size(&long).is_err());
    }

    #[test]
    fn trailers_end_at_their_empty_line_and_are_bounded() {
        let end = |buf: &[u8]| trailers_end(buf, &mut 0);
        assert_eq!(end(b"\r\nnext"), Ok(Some(2)));
        assert_eq!(end(b"a: 1\r\nb: 2\r\n\r\n"), Ok(Some(14)));
        assert_eq!(end(b"a: 1\r\nb:"), Ok(None));
        assert!(end(b"a: 1\n\r\n").is_err());
        let long = format!("a: {}\r\n", "x".repeat(MAX_TRAILERS));
        assert!(end(long.as_bytes()).is_err());
        assert!(end(&long.as_bytes()[..MAX_TRAILERS + 1]).is_err());
        // Looking again once more has arrived starts at the first line not yet whole.
        let mut at = 0;
        assert_eq!(trailers_end(b"a: 1\r\nb:", &mut at), Ok(None));
        assert_eq!(at, 6);
        assert_eq!(trailers_end(b"a: 1\r\nb: 2\r", &mut at), Ok(None));
        assert_eq!(at, 6);
        assert_eq!(trailers_end(b"a: 1\r\nb: 2\r\n\r\n", &mut at), Ok(Some(14)));
        let fields = trailer_fields(b"grpc-status: 0\r\nx-b: 1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            (fields.len(), fields["grpc-status"].as_bytes()),
            (2, &b"0"[..])
        );
        assert_eq!(trailer_fields(b"\r\n"), Ok(None));
        assert!(trailer_fields(b"bad name: 1\r\n\r\n").is_err());
    }

    use std::time::Duration;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    /// A connection to an upstream that reads one request head, answers `response` (one
    /// byte per write if `bytewise`, yielding between writes, so the gateway's reads end
    /// anywhere in it), and then closes the connection if `close`, else keeps it open.
    async fn upstream(response: &'static [u8], bytewise: bool, close: bool) -> TcpStream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap());
        let (ours, theirs) = tokio::join!(ours, listener.accept());
        let mut theirs = theirs.unwrap().0;
        tokio::spawn(async move {
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                let mut byte = [0];
                if theirs.read(&mut byte).await.unwrap_or(0) == 0 {
                    return;
                }
                head.push(byte[0]);
            }
            if bytewise {
                for b in response {
                    theirs.write_all(&[*b]).await.unwrap();
                    tokio::task::yield_now().await;
                }
            } else {
                theirs.write_all(response).await.unwrap();
            }
            if !close {
                std::future::pending::<()>().await;
            }
        });
        ours.unwrap()
    }

    fn get() -> http::request::Parts {
        let req = http::Request::get("/x")
            .header("host", "up")
            .body(())
            .unwrap();
        req.into_parts().0
    }

    /// The status, the body (or the error that ended it) and whether the connection went
    /// back to the pool.
    async fn run(
        response: &'static [u8],
        bytewise: bool,
        close: bool,
    ) -> (u16, Result<String, String>, bool) {
        let io = upstream(response, bytewise, close).await;
        let pools = Arc::new(Pools::new(4));
        let deadline = Instant::now() + Duration::from_secs(30);
        let answer = exchange(Plain::new(io, deadline), &get(), &pools, deadline).await;
        let (status, body) = match answer {
            Ok(Answer::Whole(res, plain)) => {
                if let Some(plain) = plain {
                    pools.checkin(plain, Instant::now());
                }
                let body = res.body().clone().unwrap_or_default();
                (res.status(), Ok(String::from_utf8(body.to_vec()).unwrap()))
            }
            Ok(Answer::Streaming(res, mut body)) => {
                let mut data = Vec::new();
                // As hyper does: a body that says it has ended is not polled again.
                let end = loop {
                    if body.is_end_stream() {
                        break Ok(());
                    }
                    match std::future::poll_fn(|cx| body.poll_frame(cx)).await {
                        None => break Ok(()),
                        Some(Ok(frame)) => match frame.into_data() {
                            Ok(piece) => data.extend_from_slice(&piece),
                            Err(frame) => {
                                for (name, value) in frame.into_trailers().unwrap().iter() {
                                    let value = value.to_str().unwrap();
                                    data.extend_from_slice(format!("[{name}: {value}]").as_bytes());
                                }
                            }
                        },
                        Some(Err(e)) => break Err(e.to_string()),
                    }
                };
                assert!(body.is_end_stream());
                (res.status(), end.map(|()| String::from_utf8(data).unwrap()))
            }
            Err(e) => return (0, Err(e.to_string()), false),
        };
        let kept = pools.checkout(Instant::now(), Plain::readiness).is_some();
        (status.as_u16(), body, kept)
    }

    const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;x=\"y\"\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n";
    const LENGTH: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello world";

    #[tokio::test]
    async fn delimited_bodies_are_read_whole_wherever_the_reads_end_and_free_their_connection() {
        const NO_TRAILERS: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n";
        for (response, body) in [
            (CHUNKED, "hello world[x-trailer: 1]"),
            (NO_TRAILERS, "hello world"),
            (LENGTH, "hello world"),
        ] {
            for bytewise in [false, true] {
                let got = run(response, bytewise, false).await;
                let shown = String::from_utf8_lossy(response);
                assert_eq!(
                    got,
                    (200, Ok(body.into()), true),
                    "{shown} bytewise: {bytewise}"
                );
            }
        }
    }

    #[tokio::test]
    async fn a_body_until_close_is_read_whole_and_its_connection_not_kept() {
        for bytewise in [false, true] {
            let got = run(b"HTTP/1.0 200 OK\r\n\r\nhello world", bytewise, true).await;
            assert_eq!(got, (200, Ok("hello world".into()), false));
        }
    }

    #[tokio::test]
    async fn interim_answers_are_skipped_and_bytes_after_an_answer_cost_the_connection() {
        let interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(
            run(interim, true, false).await,
            (204, Ok(String::new()), true)
        );
        let extra = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n";
        assert_eq!(
            run(extra, false, false).await,
            (200, Ok("ok".into()), false)
        );
    }

    #[tokio::test]
    async fn a_body_cut_short_or_malformed_fails_and_its_connection_is_not_kept() {
        let cut = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel";
        let (status, body, kept) = run(cut, true, true).await;
        assert_eq!((status, kept), (200, false));
        assert!(body.is_err(), "{body:?}");
        let short = b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello";
        let (_, body, kept) = run(short, true, true).await;
        assert!(body.is_err() && !kept, "{body:?}");
        let bad_trailer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nbad name: 1\r\n\r\n";
        for bytewise in [false, true] {
            let (_, body, kept) = run(bad_trailer, bytewise, false).await;
            assert!(body.is_err() && !kept, "{body:?} kept: {kept}");
        }
        let bad = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n";
        for bytewise in [false, true] {
            let (_, body, kept) = run(bad, bytewise, false).await;
            assert!(body.is_err() && !kept, "{body:?}");
        }
    }

    #[tokio::test]
    async fn a_head_trickled_a_byte_at_a_time_is_parsed_once_a_line() {
        let mut head = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..40 {
            head.extend_from_slice(format!("x-field-{i}: {}\r\n", "v".repeat(40)).as_bytes());
        }
        head.extend_from_slice(b"content-length: 2\r\n\r\nok");
        let lines = head.iter().filter(|&&b| b == b'\n').count();
        let response: &'static [u8] = head.leak();
        PARSES.with(|n| n.set(0));
        assert_eq!(
            run(response, true, false).await,
            (200, Ok("ok".into()), true)
        );
        let parses = PARSES.with(|n| n.get());
        assert!(
            (1..=lines).contains(&parses),
            "{parses} parses of a head of {lines} lines, {} bytes",
            response.len()
        );
    }

    #[tokio::test]
    async fn no_answer_at_all_is_told_apart_from_a_cut_one() {
        let (_, err, _) = run(b"", false, true).await;
        assert!(err.unwrap_err().starts_with("closed before answering"));
        let (_, err, _) = run(b"HTTP/1.1 200 OK\r\ncontent-le", true, true).await;
        assert!(err
            .unwrap_err()
            .starts_with("failed during the response head"));
    }

    #[tokio::test(start_paused = true)]
    async fn an_upstream_that_never_answers_times_out_at_the_deadline() {
        let io = upstream(b"", false, false).await;
        let pools = Arc::new(Pools::new(4));
        let start = Instant::now();
        let deadline = start + Duration::from_secs(5);
        let answer = exchange(Plain::new(io, deadline), &get(), &pools, deadline).await;
        assert!(matches!(answer, Err(Error::Timeout)));
        assert_eq!(Instant::now() - start, Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_kept_connection_the_upstream_closed_is_not_handed_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap());
        let (ours, theirs) = tokio::join!(ours, listener.accept());
        let (ours, theirs) = (ours.unwrap(), theirs.unwrap().0);
        let pools = Arc::new(Pools::new(4));
        let now = Instant::now();
        pools.checkin(Plain::new(ours, now), now);
        let open = pools
            .checkout(now, Plain::readiness)
            .expect("open and idle: handed out");
        pools.checkin(open, now);
        drop(theirs);
        let found = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let Some(plain) = pools.checkout(now, Plain::readiness) else {
                    return;
                };
                // Not seen closed yet: wait for the socket to say something, then look again.
                plain.conn.io.readable().await.unwrap();
                pools.checkin(plain, now);
            }
        });
        found
            .await
            .expect("the closed connection is dropped at checkout");
    }

    #[test]
    fn a_request_head_is_written_as_hyper_writes_it() {
        let req = http::Request::delete("http://up/a/b?c=d")
            .header("host", "up")
            .header("x-two", "1")
            .header("x-two", "2")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let mut out = Vec::new();
        encode(&mut out, &parts);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "DELETE /a/b?c=d HTTP/1.1\r\nhost: up\r\nx-two: 1\r\nx-two: 2\r\n\r\n"
        );
    }
}
