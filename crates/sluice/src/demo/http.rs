//! The demo's HTTP: a tiny upstream whose `/slow` requests wait until released, and a client
//! that opens one connection per request (as separate callers would).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// An in-process upstream on a free loopback port.
pub(crate) struct Upstream {
    pub(crate) addr: SocketAddr,
    release: Arc<Semaphore>,
}

impl Upstream {
    pub(crate) async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let release = Arc::new(Semaphore::new(0));
        let gate = release.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let gate = gate.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let gate = gate.clone();
                        async move {
                            if req.uri().path() == "/slow" {
                                if let Ok(permit) = gate.acquire().await {
                                    permit.forget();
                                }
                            }
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(
                                b"ok\n",
                            ))))
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(Self { addr, release })
    }

    /// Lets `n` slow requests finish.
    pub(crate) fn release(&self, n: usize) {
        self.release.add_permits(n);
    }
}

/// What a caller saw.
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: http::HeaderMap,
    pub(crate) body: Bytes,
}

/// `GET path` on a new connection, with an optional API key.
pub(crate) async fn get(addr: SocketAddr, path: &str, key: Option<&str>) -> anyhow::Result<Reply> {
    let res = send(addr, path, key).await?;
    let (parts, body) = res.into_parts();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// `GET path`, returning the response with its body read (for the retry helper).
pub(crate) async fn send(
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
) -> anyhow::Result<Response<Bytes>> {
    let stream = TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = Request::get(path).header("host", addr.to_string());
    if let Some(k) = key {
        req = req.header("x-api-key", k);
    }
    let res = sender
        .send_request(req.body(Empty::<Bytes>::new())?)
        .await?;
    let (parts, body) = res.into_parts();
    Ok(Response::from_parts(
        parts,
        body.collect().await?.to_bytes(),
    ))
}
