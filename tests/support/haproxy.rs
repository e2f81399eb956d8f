//! A real HAProxy in front of sluice, on free loopback ports, read through its stats socket.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::process::TempFile;

/// One HAProxy frontend/backend pair in front of sluice.
#[derive(Debug, Clone)]
pub struct Backend {
    /// Name of the backend (and of its frontend, prefixed `fe_`).
    pub name: &'static str,
    /// The `server` line's options after the address, e.g. health-check settings.
    pub server_options: String,
    /// The `option httpchk` line, e.g. `option httpchk GET /ready`.
    pub check: String,
}

/// A running HAProxy; killed on drop.
#[derive(Debug)]
pub struct HaProxy {
    child: Child,
    socket: PathBuf,
    frontends: Vec<(&'static str, SocketAddr)>,
    _config: TempFile,
}

fn free_port() -> u16 {
    crate::closed_port()
}

fn binary() -> &'static str {
    for candidate in [
        "/usr/sbin/haproxy",
        "/usr/bin/haproxy",
        "/usr/local/sbin/haproxy",
    ] {
        if std::path::Path::new(candidate).exists() {
            return candidate;
        }
    }
    panic!("haproxy is not installed: these tests drive a real HAProxy (Debian package `haproxy`; scripts/test installs it)");
}

impl HaProxy {
    /// Starts HAProxy with one frontend per backend, each backend holding one server: sluice's
    /// main listener at `gateway`, health-checked on `check_addr`'s port.
    pub async fn start(gateway: SocketAddr, check_port: u16, backends: &[Backend]) -> Self {
        // Frontend ports are picked free, then bound by HAProxy a moment later: another test
        // may take one in between. `noreuseport` makes such a clash fail HAProxy's start (by
        // default it would share the port, and answer for another test's gateway), and the
        // start is then tried again on other ports.
        for _ in 0..5 {
            if let Some(started) = Self::try_start(gateway, check_port, backends).await {
                return started;
            }
        }
        panic!("haproxy did not start in 5 tries (its errors are above)");
    }

    async fn try_start(gateway: SocketAddr, check_port: u16, backends: &[Backend]) -> Option<Self> {
        let socket = std::env::temp_dir().join(format!(
            "sluice-haproxy-{}-{}.sock",
            std::process::id(),
            free_port()
        ));
        let mut cfg = format!(
            "global\n  stats socket {} mode 600 level admin\n  maxconn 2000\n  noreuseport\n\n\
             defaults\n  mode http\n  timeout connect 1s\n  timeout client 30s\n  timeout server 30s\n  timeout check 1s\n\n",
            socket.display()
        );
        let mut frontends = Vec::new();
        for b in backends {
            let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            frontends.push((b.name, addr));
            cfg.push_str(&format!(
                "frontend fe_{name}\n  bind {addr}\n  default_backend {name}\n\n\
                 backend {name}\n  {check}\n  http-check expect rstatus ^[23]\n  server sluice {gateway} check port {check_port} {opts}\n\n",
                name = b.name,
                check = b.check,
                opts = b.server_options,
            ));
        }
        let config = TempFile::new("cfg", &cfg);
        let child = Command::new(binary())
            .args(["-db", "-f"])
            .arg(&config.0)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn haproxy");
        let mut me = Self {
            child,
            socket,
            frontends,
            _config: config,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while UnixStream::connect(&me.socket).await.is_err() {
            if let Ok(Some(_)) = me.child.try_wait() {
                return None; // a port was taken meanwhile: try others
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "haproxy did not open its stats socket:\n{cfg}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Some(me)
    }

    /// The frontend address for `backend`.
    pub fn frontend(&self, backend: &str) -> SocketAddr {
        self.frontends
            .iter()
            .find(|(n, _)| *n == backend)
            .map(|(_, a)| *a)
            .expect("no such backend")
    }

    /// `show stat` for backend `backend`'s server, column name -> value.
    pub async fn stats(&self, backend: &str) -> std::collections::HashMap<String, String> {
        let mut s = UnixStream::connect(&self.socket)
            .await
            .expect("connect to the stats socket");
        s.write_all(b"show stat\n").await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        let mut lines = out.lines();
        let header = csv_fields(lines.next().expect("CSV header").trim_start_matches("# "));
        for line in lines {
            let f = csv_fields(line);
            if f.first().map(String::as_str) == Some(backend)
                && f.get(1).map(String::as_str) == Some("sluice")
            {
                return header.into_iter().zip(f).collect();
            }
        }
        panic!("backend {backend} not in stats:\n{out}");
    }

    /// (status, check_status) of `backend`'s server, e.g. ("UP", "L7OK").
    pub async fn server_status(&self, backend: &str) -> (String, String) {
        let st = self.stats(backend).await;
        (st["status"].clone(), st["check_status"].clone())
    }

    /// Waits (bounded) until `backend`'s server has passed an active check and is UP.
    pub async fn wait_checked(&self, backend: &str, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let st = self.server_status(backend).await;
            if st.0 == "UP" && st.1 == "L7OK" {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{backend} is {st:?} after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (bounded) until the server of `backend` has a status starting with `want`.
    pub async fn wait_status(
        &self,
        backend: &str,
        want: &str,
        within: Duration,
    ) -> (String, String) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let st = self.server_status(backend).await;
            if st.0.starts_with(want) {
                return st;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{backend} is {st:?}, not {want}, after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One CSV line's fields; quoted fields may hold commas (`last_chk` does).
fn csv_fields(line: &str) -> Vec<String> {
    let (mut fields, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    fields.push(cur);
    fields
}

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}
