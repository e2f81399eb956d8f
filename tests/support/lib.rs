//! Support for sluice's end-to-end tests: a mock upstream, a handle on a running `sluice`
//! process on free loopback ports, and a small HTTP client. Everything talks to 127.0.0.1.

#![forbid(unsafe_code)]

pub mod client;
pub mod haproxy;
pub mod inproc;
pub mod process;
pub mod redis;
pub mod upstream;

pub use client::{get, raw_get, send, send_and_leave, Pending, Reply};
pub use inproc::InProcess;
pub use process::Sluice;
pub use upstream::MockUpstream;

/// A `delay` limit "smooth" by API key: 2 per second with a bucket of 1 (a request every
/// 500 ms), holding a request up to `max_delay`.
pub fn smooth_delay_limit(max_delay: &str) -> String {
    format!(
        r#"
[[limits]]
name = "smooth"
by = "api_key"
quota = 2
window = "1s"
burst = 1
mode = "delay"
max_delay = "{max_delay}"
"#
    )
}

/// Waits until the wall clock is `from_ms` to `to_ms` into a window of `window_ms` aligned to
/// the Unix epoch, as the gateway's fixed and sliding windows are (and Redis's clock, on the
/// same machine): for a test whose requests must fall in one window, or be held into the next
/// one for a known part of a window.
pub async fn in_window(window_ms: u128, from_ms: u128, to_ms: u128) {
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("the clock is past 1970");
        if (from_ms..to_ms).contains(&(now.as_millis() % window_ms)) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A loopback port that was free a moment ago (bound, then released): for an upstream that
/// must refuse connections.
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a probe port");
    l.local_addr().expect("probe port address").port()
}
