//! The response body: either bytes the gateway wrote or the upstream's body streamed through.
//! It carries the request's in-flight slot and access-log record, so both end exactly when the
//! body does, or when the client goes away and hyper drops it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;

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
        Upstream { #[pin] body: Incoming },
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

    pub(crate) fn upstream(body: Incoming) -> Self {
        Self {
            kind: Kind::Upstream { body },
            extras: None,
        }
    }

    /// Keeps the in-flight slot and the quota admission (with its concurrency slots) until
    /// the body ends or is dropped.
    pub(crate) fn hold(&mut self, slot: InFlight, held: Held) {
        self.extras.get_or_insert_default().slot = Some((slot, held));
    }

    /// Keeps the connection counted busy (no header timeout) until the body ends or is
    /// dropped.
    pub(crate) fn keep_busy(&mut self, busy: Busy) {
        self.extras.get_or_insert_default().busy = Some(busy);
    }

    /// Writes the access-log line when the body ends or is dropped.
    pub(crate) fn log_on_end(&mut self, log: AccessLog) {
        self.extras.get_or_insert_default().log = Some(log);
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.project();
        let polled = match this.kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Upstream { body } => body.poll_frame(cx),
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
            Kind::Upstream { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Upstream { body } => body.size_hint(),
        }
    }
}
