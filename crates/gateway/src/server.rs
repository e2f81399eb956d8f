//! The accept loops: HTTP/1.1 and HTTP/2 (prior knowledge) on the main listener, HTTP/1.1 on
//! the admin listener, with header timeouts, a 64 KiB cap on request heads and graceful
//! shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::{TcpListener, TcpStream};

use crate::handle::Shared;

/// Request heads (and HTTP/2 header lists) larger than this are refused (431 on HTTP/1.1).
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Builds the connection settings of the main listener.
pub(crate) fn main_builder(header_timeout: Duration) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
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
    let builder = Arc::new(main_builder(header_timeout));
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
        // hyper's header timeout starts once it reads a request head; a client that connects
        // and sends nothing at all is closed here after the same time.
        let mut first = [0u8; 1];
        match tokio::time::timeout(self.header_timeout, stream.peek(&mut first)).await {
            Ok(Ok(n)) if n > 0 => {}
            _ => return,
        }
        let io = TokioIo::new(stream);
        let shared = self.shared;
        let result = match self.kind {
            Listener::Main => {
                let peer = crate::forward::Peer::new(self.peer.ip());
                let svc =
                    service_fn(move |req| crate::handle::handle(shared.clone(), peer.clone(), req));
                let conn = self.builder.serve_connection_with_upgrades(io, svc);
                watcher.watch(conn).await
            }
            Listener::Admin => {
                let svc = service_fn(move |req| crate::admin::handle(shared.clone(), req));
                watcher.watch(self.builder.serve_connection(io, svc)).await
            }
        };
        if let Err(e) = result {
            tracing::debug!(peer = %self.peer, error = %e, "connection ended with an error");
        }
    }
}
