//! The accept loops: HTTP/1.1 and HTTP/2 (prior knowledge) on the main listener, HTTP/1.1 on
//! the admin listener, with header timeouts ([`HeadTimeout`]), a 64 KiB cap on request heads
//! and graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::{TcpListener, TcpStream};

use crate::admin;
use crate::forward::Peer;
use crate::handle::{self, Shared};
use crate::head_timeout::HeadTimeout;

/// Request heads (and HTTP/2 header lists) larger than this are refused (431 on HTTP/1.1).
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Builds the connection settings of both listeners.
pub(crate) fn builder() -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        // The header timeout is the connection's own (`HeadTimeout`), for both protocols.
        .header_read_timeout(None)
        .max_buf_size(MAX_HEAD_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEAD_BYTES as u32)
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(Duration::from_secs(20));
    builder
}

/// Which service a listener runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Listener {
    Main,
    Admin,
}

/// Accepts connections until `stop` resolves. Connections are registered with `graceful`
/// so that shutdown can wait for them.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    kind: Listener,
    shared: Arc<Shared>,
    header_timeout: Duration,
    graceful: &GracefulShutdown,
    stop: impl Future<Output = ()>,
) {
    let builder = Arc::new(builder());
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            () = &mut stop => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                let conn = Conn {
                    builder: builder.clone(),
                    shared: shared.clone(),
                    peer,
                    header_timeout,
                    kind,
                };
                tokio::spawn(conn.serve(stream, graceful.watcher()));
            }
            Err(e) => {
                // Out of file descriptors and the like: say so, and do not spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

struct Conn {
    builder: Arc<auto::Builder<TokioExecutor>>,
    shared: Arc<Shared>,
    peer: SocketAddr,
    header_timeout: Duration,
    kind: Listener,
}

impl Conn {
    async fn serve(self, stream: TcpStream, watcher: Watcher) {
        let io = TokioIo::new(stream);
        let shared = self.shared;
        let head = HeadTimeout::new(self.header_timeout);
        let requests = Arc::clone(&head);
        let conn = async {
            match self.kind {
                Listener::Main => {
                    let peer = Peer::new(self.peer.ip());
                    let svc = service_fn(move |req| {
                        handle::handle(shared.clone(), peer.clone(), requests.begin(), req)
                    });
                    let conn = self.builder.serve_connection_with_upgrades(io, svc);
                    watcher.watch(conn).await
                }
                Listener::Admin => {
                    let svc =
                        service_fn(move |req| admin::handle(shared.clone(), requests.begin(), req));
                    watcher.watch(self.builder.serve_connection(io, svc)).await
                }
            }
        };
        let result = tokio::select! {
            // The connection first: the timer matters only when the connection has nothing
            // to do.
            biased;
            result = conn => result,
            () = head.expired() => {
                tracing::debug!(peer = %self.peer, "no request head within header_timeout: closed");
                return;
            }
        };
        if let Err(e) = result {
            tracing::debug!(peer = %self.peer, error = %e, "connection ended with an error");
        }
    }
}
