//! sluice's gateway: the proxy that sits in front of an API.
//!
//! A request walks one way (see `handle`): health -> route -> identify -> quota -> capacity
//! -> forward -> headers -> log.
//! [`Gateway::bind`] opens the listeners; [`Gateway::run`] serves until told to stop, then
//! drains.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod access_log;
mod admin;
mod advertise;
mod body;
mod capacity;
mod forward;
mod handle;
mod identify;
mod problem;
mod quota;
mod refusal;
mod request_id;
mod route;
mod server;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::server::graceful::GracefulShutdown;
use sluice_config::Config;
use sluice_limiter::{Clock, SystemClock};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use body::Body;

use handle::Shared;
use server::{accept_loop, Listener};

/// What can stop the gateway from starting.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// A listener could not be opened.
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The configured address.
        addr: SocketAddr,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The limits' store cannot be used as configured.
    #[error("{0}")]
    Store(String),
}

/// A gateway with its listeners open, ready to [`run`](Gateway::run).
#[derive(Debug)]
pub struct Gateway {
    shared: Arc<Shared>,
    main: TcpListener,
    admin: TcpListener,
    header_timeout: Duration,
    shutdown_grace: Duration,
}

impl Gateway {
    /// Opens the main and admin listeners. Port 0 picks a free port; see
    /// [`main_addr`](Gateway::main_addr).
    pub async fn bind(config: &Config) -> Result<Self, GatewayError> {
        Self::bind_with_clock(config, Arc::new(SystemClock::new())).await
    }

    /// Like [`bind`](Gateway::bind), with the limits reading time from `clock` (tests pass a
    /// manual clock).
    pub async fn bind_with_clock(
        config: &Config,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, GatewayError> {
        let bind = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| GatewayError::Bind { what, addr, source })
        };
        let main = bind("gateway.listen", config.gateway.listen).await?;
        let admin = bind("admin.listen", config.admin.listen).await?;
        Ok(Self {
            shared: Arc::new(
                Shared::new(config, clock)
                    .await
                    .map_err(GatewayError::Store)?,
            ),
            main,
            admin,
            header_timeout: config.gateway.header_timeout,
            shutdown_grace: config.gateway.shutdown_grace,
        })
    }

    /// The main listener's address.
    pub fn main_addr(&self) -> SocketAddr {
        self.main
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// The admin listener's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` resolves. Then readiness fails at once, the main listener stops
    /// accepting, and in-flight requests get up to `shutdown_grace` to finish. Returns whether
    /// every request finished in time.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> bool {
        let Gateway {
            shared,
            main,
            admin,
            header_timeout,
            shutdown_grace,
        } = self;
        let (stop_admin, admin_stopped) = watch::channel(false);
        let admin_task = {
            let shared = shared.clone();
            tokio::spawn(async move {
                let graceful = GracefulShutdown::new();
                let mut rx = admin_stopped;
                let stop = async move {
                    let _ = rx.wait_for(|stop| *stop).await;
                };
                accept_loop(
                    admin,
                    Listener::Admin,
                    shared,
                    header_timeout,
                    &graceful,
                    stop,
                )
                .await;
            })
        };

        let sweeper = tokio::spawn(sweep(shared.clone()));
        let graceful = GracefulShutdown::new();
        let drain = {
            let shared = shared.clone();
            async move {
                shutdown.await;
                shared.capacity.start_draining();
                tracing::info!(
                    in_flight = shared.capacity.in_flight(),
                    grace_ms = shutdown_grace.as_millis() as u64,
                    "draining: readiness fails, no new connections"
                );
            }
        };
        accept_loop(
            main,
            Listener::Main,
            shared.clone(),
            header_timeout,
            &graceful,
            drain,
        )
        .await;
        let finished = tokio::time::timeout(shutdown_grace, graceful.shutdown())
            .await
            .is_ok();
        if !finished {
            tracing::warn!(
                in_flight = shared.capacity.in_flight(),
                "shutdown grace ran out; closing remaining connections"
            );
        }
        sweeper.abort();
        let _ = stop_admin.send(true);
        let _ = admin_task.await;
        finished
    }
}

/// Every second, on the blocking pool, removes keys that returned to their fresh state. The
/// limiter walks each table at most once per its window, never on the request path.
async fn sweep(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let shared = shared.clone();
        let _ = tokio::task::spawn_blocking(move || shared.quota.sweep()).await;
    }
}
