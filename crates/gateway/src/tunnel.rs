//! Protocol switches (`Connection: upgrade`, e.g. WebSocket): once the upstream answers `101`,
//! the client's and the upstream's connections are spliced together, byte for byte, until
//! either side closes or no byte has passed either way for the upstream's
//! `tunnel_idle_timeout`.
//!
//! The request was decided like any other (its quota charged once, at the handshake); the
//! tunnel then holds the request's in-flight slot and concurrency slots for as long as it is
//! open, since it keeps using the gateway and the upstream, and the connection's room (its
//! place under `max_connections`, its count on its thread), since hyper lets go of the
//! connection at the switch while its socket lives on here. The idle timeout is what keeps
//! abandoned tunnels from holding them for ever.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use crate::capacity::InFlight;
use crate::quota::Held;
use crate::server::Room;

/// Splices the two sides once both have switched; `hold` is released when the tunnel ends
/// (or its task is aborted, as a cut at the end of the shutdown grace does: see
/// [`crate::capacity::Capacity::spawn_tunnel`]).
pub(crate) async fn splice(
    client: OnUpgrade,
    upstream: OnUpgrade,
    idle_timeout: Duration,
    hold: (InFlight, Held, Option<Room>),
) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(both) => both,
        Err(e) => {
            tracing::debug!(error = %e, "a protocol switch did not complete");
            return;
        }
    };
    let activity = Activity::new();
    let mut client = Watched::new(TokioIo::new(client), &activity);
    let mut upstream = Watched::new(TokioIo::new(upstream), &activity);
    tokio::select! {
        copied = tokio::io::copy_bidirectional(&mut client, &mut upstream) => match copied {
            Ok((up, down)) => tracing::debug!(up, down, "tunnel closed"),
            Err(e) => tracing::debug!(error = %e, "tunnel ended with an error"),
        },
        () = activity.idle_for(idle_timeout) => {
            tracing::debug!(idle_ms = idle_timeout.as_millis() as u64, "idle tunnel closed");
        }
    }
    drop(hold);
}

/// When bytes last passed through a tunnel, either way.
#[derive(Debug)]
struct Activity {
    start: Instant,
    /// Milliseconds since `start`.
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        })
    }

    fn touch(&self) {
        let now = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(now, Ordering::Relaxed);
    }

    /// Resolves once nothing has passed for `timeout`.
    async fn idle_for(&self, timeout: Duration) {
        loop {
            let last = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            if last.elapsed() >= timeout {
                return;
            }
            tokio::time::sleep_until(last + timeout).await;
        }
    }
}

/// One side of a tunnel, noting every read or write that moved bytes.
struct Watched<T> {
    io: T,
    activity: Arc<Activity>,
}

impl<T> Watched<T> {
    fn new(io: T, activity: &Arc<Activity>) -> Self {
        Watched {
            io,
            activity: Arc::clone(activity),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_tunnel_is_idle_only_after_the_whole_timeout_without_bytes() {
        let activity = Activity::new();
        let timeout = Duration::from_secs(60);
        let idle = tokio::spawn({
            let activity = activity.clone();
            async move { activity.idle_for(timeout).await }
        });
        tokio::time::sleep(Duration::from_secs(59)).await;
        activity.touch(); // bytes passed at 59 s
        tokio::time::sleep(Duration::from_secs(59)).await;
        tokio::task::yield_now().await;
        assert!(!idle.is_finished(), "118 s: 59 s since the last byte");
        tokio::time::sleep(Duration::from_secs(2)).await;
        tokio::task::yield_now().await;
        assert!(idle.is_finished(), "120 s: 61 s without a byte");
    }
}
