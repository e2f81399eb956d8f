//! A gateway run inside the test process, on real loopback sockets, with its limits reading
//! a manual clock: time-dependent rules are tested by advancing the clock, never by sleeping.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sluice_gateway::Gateway;
use sluice_limiter::{ManualClock, Nanos};
use tokio::sync::oneshot;

/// A Unix time on a whole hour (so minute and hour windows start exactly here).
pub const EPOCH_ALIGNED: Duration = Duration::from_secs(1_800_000_000);

/// A gateway running in this process; stops when dropped.
#[derive(Debug)]
pub struct InProcess {
    /// The main listener.
    pub main: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
    /// The clock the limits read.
    pub clock: Arc<ManualClock>,
    stop: Option<oneshot::Sender<()>>,
}

impl InProcess {
    /// Starts a gateway on `config` (TOML; listeners on port 0) with its clock at
    /// [`EPOCH_ALIGNED`] + `offset`.
    pub async fn start(config: &str, offset: Duration) -> Self {
        if std::env::var_os("SLUICE_HASH_SECRET").is_none() {
            // Only read when the config uses Redis; every test uses the same value.
            std::env::set_var("SLUICE_HASH_SECRET", crate::redis::HASH_SECRET);
        }
        let config = sluice_config::parse(config, Path::new("test.toml"))
            .unwrap_or_else(|e| panic!("test config is invalid:\n{e}"));
        let clock = Arc::new(ManualClock::new(Nanos::from_unix(EPOCH_ALIGNED + offset)));
        let gateway = Gateway::bind_with_clock(&config, clock.clone())
            .await
            .expect("bind test gateway");
        let (main, admin) = (gateway.main_addr(), gateway.admin_addr());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(gateway.run(async move {
            let _ = stopped.await;
        }));
        Self {
            main,
            admin,
            clock,
            stop: Some(stop),
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
