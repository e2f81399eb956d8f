//! The `sluice` command: `run` serves, `check` validates a configuration.

#![forbid(unsafe_code)]

mod check;
mod demo;
mod logging;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use sluice_config::{Config, ConfigErrors};
use sluice_gateway::Gateway;

/// sluice: a throttling reverse proxy.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Format of the log lines `run` writes; `check` and `demo` write plain text whatever it
    /// says (level from the SLUICE_LOG variable, `info` by default; e.g. `warn`, or
    /// `sluice=debug`, which keeps `info` for the rest).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve with the given configuration until SIGTERM or SIGINT.
    Run {
        /// The TOML configuration file.
        #[arg(long, short)]
        config: PathBuf,
        /// Point an upstream elsewhere without editing the file: `--upstream app=http://127.0.0.1:8000`.
        #[arg(long, value_name = "NAME=URL")]
        upstream: Vec<String>,
        /// Threads serving requests (default: one per CPU); each new connection goes to the one
        /// with the fewest open. A sidecar often wants 1 or 2.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
        threads: Option<u16>,
    },
    /// Show, in a few seconds on loopback, what sluice answers when a caller's quota runs out
    /// (429) and when the gateway is full (503), and what a load balancer makes of each.
    Demo,
    /// Validate a configuration and print the routes and limits it defines. Exit 2 if invalid.
    Check {
        /// The TOML configuration file.
        #[arg(long, short)]
        config: PathBuf,
        /// As for `run`: check the configuration `run` would use with these overrides.
        #[arg(long, value_name = "NAME=URL")]
        upstream: Vec<String>,
    },
}

/// The CPU features this build was compiled to assume (`.cargo/config.toml`) that this CPU
/// lacks: without the check, the first request would die of an illegal instruction.
#[cfg(target_arch = "x86_64")]
fn missing_cpu_features() -> Vec<&'static str> {
    // CPUID itself: `is_x86_feature_detected!` answers `true` without asking the CPU for a
    // feature the build enables.
    missing_from_cpuid(std::arch::x86_64::__cpuid(1).ecx)
}

#[cfg(not(target_arch = "x86_64"))]
fn missing_cpu_features() -> Vec<&'static str> {
    Vec::new()
}

/// What [`missing_cpu_features`] reads from CPUID leaf 1's ECX: AES-NI is bit 25,
/// `cmpxchg16b` bit 13.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn missing_from_cpuid(ecx: u32) -> Vec<&'static str> {
    let assumed = [
        ("AES-NI", cfg!(target_feature = "aes"), 25),
        ("cmpxchg16b", cfg!(target_feature = "cmpxchg16b"), 13),
    ];
    assumed
        .into_iter()
        .filter(|&(_, assumed, bit)| assumed && ecx >> bit & 1 == 0)
        .map(|(name, _, _)| name)
        .collect()
}

fn main() -> ExitCode {
    let missing = missing_cpu_features();
    if !missing.is_empty() {
        say_err(&format!(
            "sluice: this build uses CPU instructions this CPU does not have ({}); build it \
             for this CPU with RUSTFLAGS=\"-C target-cpu=native\" cargo build --release",
            missing.join(", ")
        ));
        return ExitCode::from(1);
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Demo => {
            let result = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map_err(anyhow::Error::from)
                .and_then(|rt| rt.block_on(demo::run()));
            match result {
                Ok(text) => print_out(&text),
                Err(e) => {
                    say_err(&format!("sluice demo: {e:#}"));
                    ExitCode::from(1)
                }
            }
        }
        Command::Check { config, upstream } => match check::load(&config, &upstream) {
            Ok(c) => {
                // `run` would stop on a bad SLUICE_LOG: so does `check`.
                if let Err(e) = logging::filter() {
                    say_err(&format!("sluice: {e}"));
                    return ExitCode::from(2);
                }
                print_out(&check::describe(&config, &c))
            }
            Err(errors) => invalid(&errors),
        },
        Command::Run {
            config,
            upstream,
            threads,
        } => {
            if let Err(e) = logging::init(cli.log_format) {
                say_err(&format!("sluice: {e}"));
                return ExitCode::from(2);
            }
            let code = match check::load(&config, &upstream) {
                Err(errors) => {
                    // In the log too, so that a collector of stdout (JSON lines) sees why an
                    // instance keeps failing to start, not only stderr.
                    tracing::error!(
                        problems = errors.0.len(),
                        "the configuration is invalid:\n{errors}"
                    );
                    invalid(&errors)
                }
                Ok(loaded) => match run(loaded, threads) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        tracing::error!("{e:#}");
                        say_err(&format!("sluice: {e:#}"));
                        ExitCode::from(1)
                    }
                },
            };
            // The log's last lines out before exit, unless its reader has stopped.
            logging::flush(std::time::Duration::from_secs(2));
            code
        }
    }
}

/// Writes `text` to stdout: a reader that stops early (`sluice check | head`) ends the
/// output, not the process with a panic.
fn print_out(text: &str) -> ExitCode {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "sluice: writing to stdout: {e}");
            ExitCode::from(1)
        }
    }
}

/// Writes `line` to stderr: not eprintln!, which panics on a closed stderr (the exit code
/// says it all the same).
fn say_err(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn invalid(errors: &ConfigErrors) -> ExitCode {
    use std::io::Write as _;
    let n = errors.0.len();
    // Not eprintln!, which panics on a closed stderr: the exit code says it all the same.
    let _ = write!(
        std::io::stderr().lock(),
        "{errors}\nsluice: the configuration is invalid ({n} problem{})\n",
        if n == 1 { "" } else { "s" }
    );
    ExitCode::from(2)
}

/// Serves until a signal, then drains. A drain cut short by `shutdown_grace` still ends
/// normally (the orchestrator asked us to stop); the log says so.
fn run(config: Config, threads: Option<u16>) -> anyhow::Result<()> {
    if let Some((from, to)) = raise_open_files_limit() {
        tracing::info!(from, to, "raised the open-files limit to the hard limit");
    }
    // Thread per core: every thread runs a current-thread runtime serving the connections
    // handed to it, so a request never crosses threads; a work-stealing scheduler cost about
    // 9 us more per request in cross-thread wake-ups (docs/benchmarks.md).
    let threads = threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        usize::from,
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        // Before binding, which may wait for Redis: a SIGHUP meanwhile would end the process.
        let mut signals = Signals::new()?;
        let gateway = if threads > 1 {
            Gateway::bind_workers(&config, threads - 1).await?
        } else {
            Gateway::bind(&config).await?
        };
        tracing::info!(main = %gateway.main_addr(), admin = %gateway.admin_addr(), threads, routes = config.routes.len(), limits = config.limits.len(), "listening");
        if config.routes.is_empty() {
            tracing::warn!("the configuration has no routes: every request will be answered 404");
        }
        for (route, limits) in check::several_delay_limits(&config) {
            tracing::warn!(
                route,
                limits = limits.join(", "),
                "a route has several delay limits: a request waits for the longest hold, and the others hold at its arrival, not at the upstream (give a route one delay limit)"
            );
        }
        for warning in check::dry_run_costs_too_large(&config) {
            tracing::warn!("{warning}");
        }
        let (first, second) = tokio::sync::oneshot::channel::<()>();
        let (again, hurry) = tokio::sync::oneshot::channel::<()>();
        // Signals are read by a task of their own, so that one arriving while the gateway
        // winds down is still read (a second SIGTERM or SIGINT ends the grace at once).
        tokio::spawn(async move {
            let name = signals.stop().await;
            tracing::info!(signal = name, "shutting down");
            let _ = first.send(());
            signals.stop().await;
            let _ = again.send(());
        });
        let finished = gateway
            .run_until(
                async {
                    let _ = second.await;
                },
                async {
                    // A dropped sender (the task ended) is no request to hurry.
                    if hurry.await.is_err() {
                        std::future::pending::<()>().await;
                    }
                },
            )
            .await;
        tracing::info!(every_request_finished = finished, "stopped");
        Ok(())
    })
}

/// Raises the soft open-files limit to the hard one (at most 2^20, Linux's default `nr_open`),
/// as Go programs and HAProxy do at start: the soft limit (1,024 under systemd) would cap
/// client, upstream and Redis connections far below what the system allows, and
/// `max_connections` defaults to half of it. Returns the limits before and after, if raised.
fn raise_open_files_limit() -> Option<(u64, u64)> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let current = limit.current?; // `None`: unlimited already
    let target = limit.maximum.unwrap_or(u64::MAX).min(1 << 20);
    if current >= target {
        return None;
    }
    let raised = Rlimit {
        current: Some(target),
        maximum: limit.maximum,
    };
    setrlimit(Resource::Nofile, raised).ok()?;
    Some((current, target))
}

/// The signals `run` answers: SIGTERM and SIGINT stop it (the first drains, a second ends the
/// grace at once); SIGHUP, which asks nginx and HAProxy to reload, is logged and ignored, as
/// sluice does not reload its configuration yet (its default action would end the process and
/// every request in flight).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("installing a SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing a SIGINT handler")?,
            hup: signal(SignalKind::hangup()).context("installing a SIGHUP handler")?,
        })
    }

    /// Waits for SIGTERM or SIGINT, and says which.
    async fn stop(&mut self) -> &'static str {
        loop {
            tokio::select! {
                _ = self.term.recv() => return "SIGTERM",
                _ = self.int.recv() => return "SIGINT",
                _ = self.hup.recv() => tracing::warn!(
                    signal = "SIGHUP",
                    "ignored: sluice does not reload its configuration; restart it to apply changes"
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_check_names_each_assumed_feature_the_cpu_lacks() {
        let assumed = |name| match name {
            "AES-NI" => cfg!(target_feature = "aes"),
            _ => cfg!(target_feature = "cmpxchg16b"),
        };
        let expect = |names: &[&'static str]| -> Vec<&'static str> {
            names.iter().copied().filter(|&n| assumed(n)).collect()
        };
        assert_eq!(missing_from_cpuid(0), expect(&["AES-NI", "cmpxchg16b"]));
        assert_eq!(missing_from_cpuid(1 << 25), expect(&["cmpxchg16b"]));
        assert_eq!(missing_from_cpuid(1 << 13), expect(&["AES-NI"]));
        assert_eq!(missing_from_cpuid(1 << 25 | 1 << 13), expect(&[]));
        // This build, on this machine (the shipped flags, and a CPU that has both).
        assert!(cfg!(not(target_arch = "x86_64")) || missing_cpu_features().is_empty());
    }
}
