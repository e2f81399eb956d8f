//! A real `redis-server` on a free loopback port, killed on drop, driven with `redis-cli`.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The secret every sluice instance in these tests shares (keys in Redis are keyed hashes).
pub const HASH_SECRET: &str = "test-secret-shared-by-every-instance";

/// A running `redis-server` without persistence.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    /// Its port.
    pub port: u16,
}

fn find(name: &str) -> PathBuf {
    ["/usr/bin", "/usr/local/bin", "/usr/sbin"]
        .iter()
        .map(|d| PathBuf::from(d).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} is not installed: these tests drive a real Redis (Debian package `redis-server`; scripts/test installs it)"))
}

impl RedisServer {
    /// Starts on a free port.
    pub fn start() -> Self {
        Self::start_on(crate::closed_port())
    }

    /// Starts on `port` (to restart a killed server where clients expect it).
    pub fn start_on(port: u16) -> Self {
        let child = Command::new(find("redis-server"))
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--enable-debug-command", "local"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        for tries in 0.. {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            assert!(
                tries < 500,
                "redis-server did not listen on {port} within 5 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Self {
            child: Some(child),
            port,
        }
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs `redis-cli <args>` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(find("redis-cli"))
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Calls of `command` so far, from `INFO commandstats` (0 if never called).
    pub fn calls(&self, command: &str) -> u64 {
        let stats = self.cli(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:calls=");
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
