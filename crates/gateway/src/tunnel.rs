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

use crate::access_log::AccessLog;
use crate::capacity::InFlight;
use crate::quota::Held;
use crate::server::Room;

/// Splices the two sides once both have switched; `hold` is released when the tunnel ends
/// (or its task is aborted, as a cut at the end of the shutdown grace does: see
/// [`crate::capacity::Capacity::spawn_tunnel`]).
///
/// `log` is the request's access-log line, written when the tunnel ends (so its `total_ms` is
/// the tunnel's life, `bytes` what went to the client), with `tunnel_up` and `tunnel_down`
/// (bytes each way) and `tunnel_end`: `closed` (either side), `error`, `idle`, `not_switched`
/// (a side never completed the switch), or `cut` (the task was aborted at the end of the
/// shutdown grace; the line's `cut` then says `shutdown`).
pub(crate) async fn splice(
    client: OnUpgrade,
    upstream: OnUpgrade,
    idle_timeout: Duration,
    hold: (InFlight, Held, Option<Room>),
    log: AccessLog,
) {
    let activity = Activity::new();
    let mut ending = Ending {
        log,
        activity: Arc::clone(&activity),
        end: "cut",
    };
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(both) => both,
        Err(e) => {
            tracing::debug!(error = %e, "a protocol switch did not complete");
            ending.end = "not_switched";
            return;
        }
    };
    let mut client = Watched::new(TokioIo::new(client), &activity, Side::Client);
    let mut upstream = Watched::new(TokioIo::new(upstream), &activity, Side::Upstream);
    ending.end = tokio::select! {
        copied = tokio::io::copy_bidirectional(&mut client, &mut upstream) => match copied {
            Ok((up, down)) => {
                tracing::debug!(up, down, "tunnel closed");
                "closed"
            }
            Err(e) => {
                tracing::debug!(error = %e, "tunnel ended with an error");
                "error"
            }
        },
        () = activity.idle_for(idle_timeout) => {
            tracing::debug!(idle_ms = idle_timeout.as_millis() as u64, "idle tunnel closed");
            "idle"
        }
    };
    drop(hold);
}

/// Writes the tunnel's access-log line when the tunnel ends, however it ends (an aborted task
/// drops it too).
struct Ending {
    log: AccessLog,
    activity: Arc<Activity>,
    end: &'static str,
}

impl Drop for Ending {
    fn drop(&mut self) {
        let up = self.activity.up.load(Ordering::Relaxed);
        let down = self.activity.down.load(Ordering::Relaxed);
        self.log.tunnel(up, down, self.end);
    }
}

/// When bytes last passed through a tunnel, either way, and how many each way.
#[derive(Debug)]
struct Activity {
    start: Instant,
    /// Milliseconds since `start`.
    last_ms: AtomicU64,
    /// Written to the upstream.
    up: AtomicU64,
    /// Written to the client (what was read from the upstream but is still in the copy's
    /// buffer when the tunnel ends never reached it: review).
    down: AtomicU64,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
        })
    }

    fn touch(&self) {
        let now = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(now, Ordering::Relaxed);
    }

    /// `n` bytes were written to `side`.
    fn wrote(&self, side: Side, n: usize) {
        self.touch();
        let counter = match side {
            Side::Client => &self.down,
            Side::Upstream => &self.up,
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
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

/// Which side of a tunnel a [`Watched`] is.
#[derive(Debug, Clone, Copy)]
enum Side {
    Client,
    Upstream,
}

/// One side of a tunnel, noting every read or write that moved bytes.
struct Watched<T> {
    io: T,
    activity: Arc<Activity>,
    side: Side,
}

impl<T> Watched<T> {
    fn new(io: T, activity: &Arc<Activity>, side: Side) -> Self {
        Watched {
            io,
            activity: Arc::clone(activity),
            side,
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
        if let Poll::Ready(Ok(n)) = polled {
            if n > 0 {
                self.activity.wrote(self.side, n);
            }
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

    /// Each way counts what was written to the receiving side, not what was read from the
    /// sending one: a client that stops reading has not had what waits in the copy's buffer.
    #[tokio::test(start_paused = true)]
    async fn a_tunnel_counts_what_reached_each_side() {
        use tokio::io::AsyncWriteExt;
        let activity = Activity::new();
        // The client's side holds 1 KiB and is never read; the upstream sends 64 KiB.
        let (client_far, client_near) = tokio::io::duplex(1024);
        let (mut upstream_far, upstream_near) = tokio::io::duplex(64 * 1024);
        upstream_far.write_all(&[7u8; 64 * 1024]).await.unwrap();
        let mut client = Watched::new(client_near, &activity, Side::Client);
        let mut upstream = Watched::new(upstream_near, &activity, Side::Upstream);
        let copy = tokio::io::copy_bidirectional(&mut client, &mut upstream);
        let stalled = tokio::time::timeout(Duration::from_secs(1), copy).await;
        assert!(stalled.is_err(), "the copy ended: {stalled:?}");
        assert_eq!(activity.down.load(Ordering::Relaxed), 1024);
        assert_eq!(activity.up.load(Ordering::Relaxed), 0);
        drop((client_far, upstream_far));
    }
}
