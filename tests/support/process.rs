//! A `sluice` process started by a test on free loopback ports, stopped when dropped.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde_json::Value;

/// A running sluice.
#[derive(Debug)]
pub struct Sluice {
    child: Child,
    /// The main listener.
    pub main: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
    logs: Arc<Mutex<Vec<Value>>>,
    _config: TempFile,
}

impl Sluice {
    /// Starts `sluice run` on `config` (TOML). Both listeners should say port 0; the
    /// addresses actually bound are read from the `listening` log line.
    pub fn start(config: &str) -> Self {
        Self::start_with_args(config, &[])
    }

    /// Like [`start`](Sluice::start) with extra command-line arguments.
    pub fn start_with_args(config: &str, args: &[&str]) -> Self {
        Self::start_with(config, args, &[] as &[(&str, &str)])
    }

    /// Like [`start`](Sluice::start) with extra arguments and environment variables.
    pub fn start_with<K, V>(config: &str, args: &[&str], env: &[(K, V)]) -> Self
    where
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        let file = TempFile::new("toml", config);
        let mut child = Command::new(binary())
            .args(["--log-format", "json", "run", "--config"])
            .arg(&file.0)
            .args(args)
            .env("SLUICE_LOG", "info")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn sluice");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    eprintln!("sluice: {line}");
                    continue;
                };
                if v["message"] == "listening" {
                    let _ = tx.send((
                        v["main"].as_str().unwrap_or("").to_owned(),
                        v["admin"].as_str().unwrap_or("").to_owned(),
                    ));
                }
                sink.lock().unwrap().push(v);
            }
        });
        let (main, admin) = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(addrs) => addrs,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "sluice did not report its listeners within 20 s (exit: {:?})",
                    child.try_wait()
                );
            }
        };
        Self {
            child,
            main: main.parse().expect("main address"),
            admin: admin.parse().expect("admin address"),
            logs,
            _config: file,
        }
    }

    /// Log lines so far (JSON objects).
    pub fn logs(&self) -> Vec<Value> {
        self.logs.lock().unwrap().clone()
    }

    /// Access-log lines so far.
    pub fn access_logs(&self) -> Vec<Value> {
        self.logs()
            .into_iter()
            .filter(|v| v["target"] == "access")
            .collect()
    }

    /// Waits (bounded) for a log line matching `pred`.
    pub async fn wait_log(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(v) = self.logs().into_iter().find(|v| pred(v)) {
                return v;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no log line {what} within 10 s: {:#?}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits (bounded) until the gateway says it is draining (after [`Sluice::terminate`]).
    pub async fn wait_draining(&self) {
        self.wait_log("draining", |v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("draining"))
        })
        .await;
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends the signal named `name` (`TERM`, `HUP`, ...).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{name} failed");
    }

    /// Waits (bounded) for the process to exit.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for sluice") {
                return status;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "sluice did not exit within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Peak resident memory (VmHWM) in bytes, from /proc.
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("read /proc status");
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc status");
        kb * 1024
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `sluice <args>` to completion: (exit code, stdout, stderr).
pub fn run_cli(args: &[&str]) -> (i32, String, String) {
    run_cli_with(args, &[])
}

/// [`run_cli`] with environment variables set.
pub fn run_cli_with(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(binary())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run sluice");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A file removed on drop.
#[derive(Debug)]
pub struct TempFile(pub PathBuf);

impl TempFile {
    /// Writes `content` to a new file with the given extension.
    pub fn new(ext: &str, content: &str) -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let path =
            std::env::temp_dir().join(format!("sluice-test-{}-{n}.{ext}", std::process::id()));
        std::fs::File::create(&path)
            .and_then(|mut f| f.write_all(content.as_bytes()))
            .expect("write temp file");
        Self(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The `sluice` binary of this build (`target/<profile>/sluice`), built once per test run so
/// that a test never runs a stale binary. (Cargo releases its build lock before running tests,
/// so the nested build does not wait on the outer one.)
pub fn binary() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("test executable path");
            let dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target/<profile>/deps/..")
                .to_path_buf();
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
            let mut cmd = Command::new(cargo);
            cmd.args(["build", "--quiet", "-p", "sluice", "--bin", "sluice"]);
            if dir.ends_with("release") {
                cmd.arg("--release");
            }
            let ok = cmd.status().map(|s| s.success()).unwrap_or(false);
            assert!(
                ok,
                "`cargo build -p sluice` failed; the end-to-end tests need the binary"
            );
            let bin = dir.join("sluice");
            assert!(
                bin.exists(),
                "{} is missing after building it",
                bin.display()
            );
            bin
        })
        .clone()
}
