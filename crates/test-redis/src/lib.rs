//! For sluice's tests (the store's and the gateway's): a real `redis-server` on a free loopback
//! port, without persistence, killed on drop, inspected with `redis-cli`. No dependencies, so
//! that the store's tests need not build the gateway's test harness to share it.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `redis-server` on `127.0.0.1:port`.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    /// Its port.
    pub port: u16,
}

/// `name` on the `PATH` or in the usual directories; a missing one fails the test with how to
/// install it.
fn find(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    let usual = ["/usr/bin", "/usr/local/bin", "/usr/sbin"].map(PathBuf::from);
    path.into_iter()
        .chain(usual)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not installed: these tests drive a real Redis. Install it with \
                 `apt-get install redis-server` (scripts/test does so)"
            )
        })
}

impl RedisServer {
    /// Starts on a free port and waits (at most 5 s) until it answers. The port is picked
    /// free and bound by redis-server a moment later, so another test may take it in between:
    /// then redis-server exits (or what answers is not Redis) and another port is tried.
    pub fn start() -> Self {
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port")
                .port();
            if let Some(server) = Self::try_start_on(port) {
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
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--enable-debug-command", "local"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        // At most 500 tries 10 ms apart: about 5 s.
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
        let out = self.cli_command(args).output().expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `redis-cli <args>` against this server, e.g. to run in the background (`spawn`) a
    /// `DEBUG SLEEP` that stalls it while a test goes on.
    pub fn cli_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(find("redis-cli"));
        cmd.args(["-p", &self.port.to_string()]).args(args);
        cmd
    }

    /// Calls of `command` so far, from `INFO commandstats` (0 if never called); the commands
    /// a script runs are counted too.
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
