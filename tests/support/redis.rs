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
    /// Starts on a free port. The port is picked free and bound by redis-server a moment
    /// later, so another test may take it in between: then redis-server exits (or what answers
    /// is not Redis) and the start is tried again on another port.
    pub fn start() -> Self {
        for _ in 0..5 {
            if let Some(server) = Self::try_start_on(crate::closed_port()) {
                return server;
            }
        }
        panic!("redis-server did not start in 5 tries");
    }

    /// Starts on `port` (to restart a killed server where clients expect it).
    pub fn start_on(port: u16) -> Self {
        Self::try_start_on(port)
            .unwrap_or_else(|| panic!("redis-server did not start on port {port}"))
    }

    fn try_start_on(port: u16) -> Option<Self> {
        let mut child = Command::new(find("redis-server"))
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
            if let Ok(Some(_)) = child.try_wait() {
                return None; // could not bind: the port was taken
            }
            if answers_ping(port) {
                break;
            }
            assert!(
                tries < 500,
                "redis-server did not answer on {port} within 5 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(Self {
            child: Some(child),
            port,
        })
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

/// Whether what listens on `port` is a Redis answering `PING`.
fn answers_ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut conn) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
    let mut reply = [0u8; 7];
    conn.write_all(b"PING\r\n").is_ok()
        && conn.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}
