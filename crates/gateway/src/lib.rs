//! sluice's gateway: the proxy that sits in front of an API.
//!
//! A request walks one way (see `handle`): health -> route -> identify -> quota -> capacity
//! -> forward -> headers -> log.
//! [`Gateway::bind`] opens the listeners; [`Gateway::run`] serves until told to stop, then
//! drains. [`Gateway::bind_workers`] adds worker threads, each a single-threaded runtime
//! serving the connections the accepting thread hands it (each to the thread with the fewest
//! open, see `spread`): a request never crosses threads, which costs less than a
//! work-stealing scheduler's wake-ups.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod access_log;
mod admin;
mod advertise;
mod body;
mod capacity;
mod forward;
mod h1_client;
mod handle;
mod head_error;
mod head_timeout;
mod identify;
mod linger;
mod once_a_second;
mod problem;
mod quota;
mod refusal;
mod request_id;
mod route;
mod server;
mod spread;
mod tunnel;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use sluice_config::Config;
use sluice_limiter::{Clock, SystemClock};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use body::{Body, BodyError};

use handle::Shared;
use head_timeout::Timeouts;
use server::{accept_loop, serve_handed, Drain, Listener};
use spread::{Handoff, Spread};

/// What can stop the gateway from starting.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// A listener could not be opened.
    #[error("cannot listen on {addr} ({what})")]
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
    /// Worker threads serving the main listener's connections beside the calling one.
    workers: usize,
    timeouts: Timeouts,
    shutdown_grace: Duration,
    /// Readiness fails this long before draining starts.
    drain_delay: Duration,
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
        Self::with_listeners(config, clock, main, admin, 0).await
    }

    /// Like [`bind`](Gateway::bind), and [`run`](Gateway::run) will also serve the main
    /// address on `extra` more threads, each with its own current-thread runtime. The calling
    /// runtime accepts every connection and hands each to the thread with the fewest open
    /// (itself included); the admin listener, the sweeper and the store's connection stay on
    /// it.
    pub async fn bind_workers(config: &Config, extra: usize) -> Result<Self, GatewayError> {
        let mut gateway = Self::bind(config).await?;
        gateway.workers = extra;
        Ok(gateway)
    }

    async fn with_listeners(
        config: &Config,
        clock: Arc<dyn Clock>,
        main: TcpListener,
        admin: TcpListener,
        workers: usize,
    ) -> Result<Self, GatewayError> {
        Ok(Self {
            shared: Arc::new(
                Shared::new(config, clock)
                    .await
                    .map_err(GatewayError::Store)?,
            ),
            main,
            admin,
            workers,
            timeouts: Timeouts {
                header: config.gateway.header_timeout,
                send: config.gateway.send_timeout,
            },
            shutdown_grace: config.gateway.shutdown_grace,
            drain_delay: config.gateway.drain_delay,
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

    /// Serves until `shutdown` resolves. Then readiness fails at once; after `drain_delay`
    /// (serving as usual meanwhile) the main listener stops accepting, and in-flight requests
    /// get up to `shutdown_grace` to finish. Returns whether every request finished in time.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> bool {
        self.run_until(shutdown, std::future::pending()).await
    }

    /// [`Gateway::run`], with the delay and the grace ended early when `hurry` resolves after
    /// `shutdown` (an operator's second stop signal): what still runs is cut then, as at the
    /// grace's end.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()>,
        hurry: impl Future<Output = ()>,
    ) -> bool {
        let Gateway {
            shared,
            main,
            admin,
            workers,
            timeouts,
            shutdown_grace,
            drain_delay,
        } = self;
        let (stop_workers, workers_stopped) = watch::channel(false);
        let (senders, workers): (Vec<_>, Vec<_>) = (1..=workers)
            .map(|n| {
                let (tx, handed) = tokio::sync::mpsc::unbounded_channel();
                let worker = Worker {
                    shared: shared.clone(),
                    handed,
                    timeouts,
                    shutdown_grace,
                    stop: workers_stopped.clone(),
                };
                (tx, worker.start(n))
            })
            .unzip();
        let spread = (!senders.is_empty()).then(|| Spread::new(senders));
        let (stop_admin, admin_stopped) = watch::channel(false);
        let admin_task = {
            let shared = shared.clone();
            tokio::spawn(async move {
                let graceful = Drain::new();
                let mut rx = admin_stopped;
                let stop = async move {
                    let _ = rx.wait_for(|stop| *stop).await;
                };
                accept_loop(
                    admin,
                    Listener::Admin,
                    shared,
                    timeouts,
                    &graceful,
                    None,
                    stop,
                )
                .await;
            })
        };

        let sweeper = tokio::spawn(sweep(shared.clone()));
        let graceful = Drain::new();
        tokio::pin!(hurry);
        let mut hurried_before_draining = false;
        let drain = {
            let shared = shared.clone();
            let (hurry, hurried_before_draining) = (&mut hurry, &mut hurried_before_draining);
            async move {
                shutdown.await;
                if !drain_delay.is_zero() {
                    // Load balancers see readiness fail, and stop sending, while this instance
                    // still serves: a connection refused at once tells them nothing (review:
                    // behind HAProxy, the health check met a closed port, not a 503).
                    shared.capacity.stop_soon();
                    tracing::info!(
                        delay_ms = drain_delay.as_millis() as u64,
                        "stopping: readiness fails; serving on for drain_delay before draining"
                    );
                    tokio::select! {
                        () = tokio::time::sleep(drain_delay) => {}
                        () = hurry.as_mut() => *hurried_before_draining = true,
                    }
                }
                shared
                    .capacity
                    .start_draining(tokio::time::Instant::now() + shutdown_grace);
                tracing::info!(
                    in_flight = shared.capacity.in_flight(),
                    held = shared.capacity.held(),
                    grace_ms = shutdown_grace.as_millis() as u64,
                    "draining: readiness fails, no new connections"
                );
            }
        };
        accept_loop(
            main,
            Listener::Main,
            shared.clone(),
            timeouts,
            &graceful,
            spread,
            drain,
        )
        .await;
        let _ = stop_workers.send(true);
        let deadline = tokio::time::Instant::now() + shutdown_grace;
        let stopping = async {
            let cut = wind_down(graceful, &shared, deadline).await;
            let mut finished = no_request_cut(cut);
            for worker in workers {
                finished &= worker.await.unwrap_or(false);
            }
            (cut, finished)
        };
        let hurried = async {
            if !hurried_before_draining {
                hurry.await;
            }
            tracing::warn!(
                in_flight = shared.capacity.in_flight(),
                held = shared.capacity.held(),
                "asked again to stop: the shutdown grace ends now (held requests are answered 503)"
            );
            shared.capacity.end_grace_now();
            std::future::pending::<()>().await;
        };
        let (cut, finished) = tokio::select! {
            stopped = stopping => stopped,
            () = hurried => unreachable!("pending"),
        };
        if !finished {
            // Counted at the cut (every thread's cut comes within moments of this one's).
            tracing::warn!(
                requests = cut.or(shared.capacity.cut_count()).unwrap_or_default(),
                "shutdown grace ran out; the requests still running were cut"
            );
        } else if shared.capacity.is_cut() {
            // Cut on some thread with no request running: connections still closing.
            tracing::info!(
                "shutdown grace ran out while connections were still closing; no request was running"
            );
        }
        sweeper.abort();
        let _ = stop_admin.send(true);
        let _ = admin_task.await;
        finished
    }
}

/// One worker thread: serves the main listener's connections handed to it.
struct Worker {
    shared: Arc<Shared>,
    handed: tokio::sync::mpsc::UnboundedReceiver<Handoff>,
    timeouts: Timeouts,
    shutdown_grace: Duration,
    stop: watch::Receiver<bool>,
}

impl Worker {
    /// Starts the thread; the receiver says whether its connections all finished in time
    /// after the stop (`false` too if the thread could not run).
    fn start(self, n: usize) -> tokio::sync::oneshot::Receiver<bool> {
        let (done, finished) = tokio::sync::oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name(format!("sluice-worker-{n}"))
            .spawn(move || {
                forward::use_pool(n);
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                let ok = match runtime {
                    Ok(rt) => rt.block_on(self.serve()),
                    Err(e) => {
                        tracing::error!(worker = n, error = %e, "cannot start a worker runtime");
                        false
                    }
                };
                let _ = done.send(ok);
            });
        if let Err(e) = spawned {
            tracing::error!(worker = n, error = %e, "cannot start a worker thread");
        }
        finished
    }

    async fn serve(self) -> bool {
        let graceful = Drain::new();
        let mut stop = self.stop;
        let stopped = async move {
            let _ = stop.wait_for(|stop| *stop).await;
        };
        let (shared, timeouts) = (self.shared, self.timeouts);
        serve_handed(self.handed, shared.clone(), timeouts, &graceful, stopped).await;
        let deadline = tokio::time::Instant::now() + self.shutdown_grace;
        no_request_cut(wind_down(graceful, &shared, deadline).await)
    }
}

/// Whether a thread's wind-down ([`wind_down`]) cut no request: it finished in time, or what
/// the grace's end cut was only connections still closing (lingering), every request having
/// finished. (The count is taken once, over every thread, at the first cut.)
fn no_request_cut(cut: Option<usize>) -> bool {
    cut.is_none_or(|requests| requests == 0)
}

/// A serving thread's end, once it no longer accepts: its connections get until `deadline`
/// (the end of the shutdown grace) to finish their requests, and so do the tunnels (switched
/// protocols), which left hyper's connections but still hold their slots (every thread's are
/// waited for, which is simpler and no longer than the grace). What still runs then is cut
/// while this thread's runtime still runs, so that its requests' releases of shared-store
/// leases start; then the writes to the shared store its requests started are waited for,
/// until [`settle_until`]. Returns `None` if everything finished within the grace, or how many
/// requests were in flight (over every thread) when it was cut.
async fn wind_down(
    graceful: Drain,
    shared: &Shared,
    deadline: tokio::time::Instant,
) -> Option<usize> {
    let connections = graceful.shutdown();
    tokio::pin!(connections);
    let grace_over = shared.capacity.grace_over(deadline);
    tokio::pin!(grace_over);
    let closed = tokio::select! {
        () = connections.as_mut() => true,
        () = grace_over.as_mut() => false,
    };
    let finished = closed
        && tokio::select! {
            () = shared.capacity.drained() => true,
            () = grace_over.as_mut() => false,
        };
    // From the grace's end, or from now if a second signal ended it early.
    let cut_at = if finished {
        deadline
    } else {
        tokio::time::Instant::now().min(deadline)
    };
    let until = settle_until(cut_at);
    let cut = (!finished).then(|| shared.capacity.cut());
    if !finished {
        // The cut connections end at their next poll, HTTP/2 streams when their connection
        // has, tunnels at theirs, and the slots their requests held go with them.
        if !closed {
            let _ = tokio::time::timeout_at(until, connections).await;
        }
        let _ = tokio::time::timeout_at(until, shared.capacity.drained()).await;
    }
    shared.quota.settle(until).await;
    cut
}

/// Until when a stopping thread waits for the releases and withdrawals its last requests
/// started in the shared store (they run on its runtime, which ends with it): the end of the
/// grace, and a second past it, so that those of requests that ended as the grace did still go
/// out. One cut-off for every thread (their deadlines are moments apart), so that the main
/// thread, which waits for the others first, does not add a second of its own.
fn settle_until(deadline: tokio::time::Instant) -> tokio::time::Instant {
    deadline + Duration::from_secs(1)
}

/// Every second, on the blocking pool, removes keys that returned to their fresh state (the
/// limiter walks each table at most once per its window, never on the request path), and
/// closes upstream connections unused for a minute.
async fn sweep(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (shared, now) = (shared.clone(), tokio::time::Instant::now());
        let _ = tokio::task::spawn_blocking(move || {
            shared.quota.sweep();
            shared.close_idle_upstreams(now);
        })
        .await;
    }
}
