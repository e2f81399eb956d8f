//! The response body: either bytes the gateway wrote or the upstream's body streamed through.
//! It carries the request's in-flight slot and access-log record, so both end exactly when the
//! body does, or when the client goes away and hyper drops it. An upstream body that stops
//! arriving for the upstream's `timeout` ends in an error, which closes the exchange: a stalled
//! upstream cannot hold an in-flight slot for ever.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::access_log::AccessLog;
use crate::capacity::InFlight;
use crate::head_timeout::Busy;
use crate::quota::Held;

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
    log: Option<AccessLog>,
    busy: Option<Busy>,
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind {
        Full { data: Option<Bytes> },
        Upstream {
            #[pin]
            body: Incoming,
            // The longest wait for the next piece of the body.
            timeout: Duration,
            // Made the first time the body is not ready (most bodies never wait: no timer to
            // register and cancel), then moved on by each piece that arrives.
            idle: Option<Pin<Box<Sleep>>>,
        },
    }
}

/// Why a response body failed.
#[derive(Debug)]
pub enum BodyError {
    /// The upstream's body failed (connection reset, malformed chunk).
    Upstream(hyper::Error),
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
            BodyError::Upstream(e) => Some(e),
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

    /// The upstream's `body`, failed when no piece of it arrives within `timeout`.
    pub(crate) fn upstream(body: Incoming, timeout: Duration) -> Self {
        Self {
            kind: Kind::Upstream {
                body,
                timeout,
                idle: None,
            },
            extras: None,
        }
    }

    /// Keeps the in-flight slot and the quota admission (with its concurrency slots) until
    /// the body ends or is dropped.
    pub(crate) fn hold(&mut self, slot: InFlight, held: Held) {
        self.extras.get_or_insert_default().slot = Some((slot, held));
    }

    /// Keeps the connection counted busy (no header timeout) and sending (the send timeout)
    /// until the body ends or is dropped.
    pub(crate) fn keep_busy(&mut self, mut busy: Busy) {
        busy.sending();
        self.extras.get_or_insert_default().busy = Some(busy);
    }

    /// Writes the access-log line when the body ends or is dropped.
    pub(crate) fn log_on_end(&mut self, log: AccessLog) {
        self.extras.get_or_insert_default().log = Some(log);
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.project();
        let polled = match this.kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Upstream {
                body,
                timeout,
                idle,
            } => match body.poll_frame(cx) {
                Poll::Pending => {
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
                    Poll::Ready(frame.map(|f| f.map_err(BodyError::Upstream)))
                }
            },
        };
        if let Poll::Ready(frame) = &polled {
            match frame {
                Some(Ok(f)) => {
                    let log = this.extras.as_mut().and_then(|e| e.log.as_mut());
                    if let (Some(log), Some(data)) = (log, f.data_ref()) {
                        log.add_bytes(data.len());
                    }
                }
                Some(Err(_)) => {
                    if let Some(log) = this.extras.as_mut().and_then(|e| e.log.as_mut()) {
                        log.upstream_body_failed();
                    }
                }
                // The exchange is over: free the in-flight slot and concurrency slots now,
                // not whenever hyper drops the body, and start the connection's header timeout.
                None => {
                    if let Some(e) = this.extras.as_mut() {
                        drop(e.slot.take());
                        drop(e.busy.take());
                    }
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Upstream { body, .. } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Upstream { body, .. } => body.size_hint(),
        }
    }
}
