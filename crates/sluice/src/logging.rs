//! Log set-up: text or JSON lines on stdout, level from `SLUICE_LOG` (default `info`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::LogFormat;

/// The filter `SLUICE_LOG` asks for; a value that is not a filter is an error, not a silent
/// `info`.
pub(crate) fn filter() -> Result<EnvFilter, String> {
    match std::env::var("SLUICE_LOG") {
        Err(std::env::VarError::NotPresent) => Ok(EnvFilter::new(with_default_level(""))),
        Ok(v) => {
            let shown = || sluice_config::printable(format!("{v:?}"));
            if let Some((slip, level)) = level_slip(&v) {
                return Err(format!("SLUICE_LOG={}: \"{slip}\" is not a level (write {level}); a bare word names a target, which would leave every level as it was", shown()));
            }
            EnvFilter::try_new(with_default_level(&v)).map_err(|e| {
                format!("SLUICE_LOG={} is not a log filter: {e} (write e.g. info, warn, or access=warn)", shown())
            })
        }
        Err(std::env::VarError::NotUnicode(_)) => Err("SLUICE_LOG is not UTF-8 text".into()),
    }
}

/// A bare directive that reads as a level but is not one (`warning`, `err`), with the level
/// meant: tracing's filter takes it for a target's name, so `SLUICE_LOG=warning` would start
/// with every level as it was (review).
fn level_slip(directives: &str) -> Option<(String, &'static str)> {
    directives.split(',').map(str::trim).find_map(|d| {
        let level = match d.to_ascii_lowercase().as_str() {
            "warning" | "warnings" | "wrn" => "warn",
            "err" | "errors" | "fatal" | "critical" | "crit" | "severe" => "error",
            "information" | "informational" | "notice" | "inf" => "info",
            "dbg" | "verbose" | "debugging" => "debug",
            "all" | "trc" => "trace",
            "none" | "quiet" | "silent" => "off",
            _ => return None,
        };
        Some((d.to_owned(), level))
    })
}

/// `directives` with `info` for every target they do not name, unless they set a level for
/// all themselves. A filter of targets alone turns off everything else (`sluice=debug` would
/// silence the access log and every warning), and an empty one everything: neither is what
/// someone who raises one target's level, or leaves the variable blank, means.
///
/// The h2 library's warnings are held to `error` unless the value names `h2` or asks for
/// `debug` or `trace` everywhere: it warns once per frame of some kinds a client chooses to
/// send (a PING acknowledgement never asked for), unthrottled (review: one connection wrote
/// 325 MB of log in 4 s).
fn with_default_level(directives: &str) -> String {
    let levels = [
        "off", "error", "warn", "info", "debug", "trace", "0", "1", "2", "3", "4", "5",
    ];
    let global = directives
        .split(',')
        .map(|d| d.trim().to_ascii_lowercase())
        .rfind(|d| levels.contains(&d.as_str()));
    let base = match &global {
        Some(_) => directives.to_owned(),
        None if directives.trim_matches([',', ' ']).is_empty() => "info".to_owned(),
        None => format!("info,{directives}"),
    };
    // The crate as a whole (`h2=warn`, `h2`): one of its modules named leaves the rest, PING
    // handling included, to the default.
    let names_h2 = directives.split(',').any(|d| {
        let d = d.trim();
        d.strip_prefix("h2")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('='))
    });
    let verbose = matches!(global.as_deref(), Some("debug" | "trace" | "4" | "5"));
    if names_h2 || verbose {
        base
    } else {
        format!("{base},h2=error")
    }
}

/// Lines waiting for stdout, at most: past it, new lines are dropped (and counted) rather than
/// have a serving thread wait for the log's reader.
const QUEUED_LINES: usize = 8_192;

/// Bytes of lines waiting, at most (8,192 lines of the longest access line, about 9 KiB, would
/// be 72 MB: review).
const QUEUED_BYTES: usize = 8 << 20;

static QUEUED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// What the writer thread is asked to do.
enum Job {
    Line(Vec<u8>),
    /// Answer once every line queued before this one is written (or given up on).
    Flush(std::sync::mpsc::Sender<()>),
}

/// Hands each formatted line to one thread that writes stdout, so that no serving thread ever
/// waits on, or fails with, the log's reader (review: a reader that stopped reading froze
/// every thread, probes and SIGTERM included, past the grace; one that had gone made every
/// write fail, and tracing-subscriber's report of that panicked on the closed stderr, so
/// every connection closed unanswered while `/ready` said 200). A full queue drops lines, and
/// the writer says how many as soon as it writes again; a write that fails is dropped the
/// same way.
#[derive(Clone)]
struct Queue {
    jobs: std::sync::mpsc::SyncSender<Job>,
}

static DROPPED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static QUEUE: std::sync::OnceLock<Result<Queue, String>> = std::sync::OnceLock::new();

std::thread_local! {
    /// Set on the writer thread: its own lines (the report of dropped ones) are written at
    /// once, not queued behind a full queue, where they would be dropped in their turn.
    static WRITER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Queue {
    fn start() -> Result<Queue, String> {
        let (jobs, queued) = std::sync::mpsc::sync_channel::<Job>(QUEUED_LINES);
        std::thread::Builder::new()
            .name("sluice-log".into())
            .spawn(move || {
                WRITER.with(|w| w.set(true));
                write_lines(&queued);
            })
            .map_err(|e| format!("cannot start the log's writer thread: {e}"))?;
        Ok(Queue { jobs })
    }
}

fn write_lines(queued: &std::sync::mpsc::Receiver<Job>) {
    use std::io::Write;
    use std::sync::atomic::Ordering;
    // Locked for good (the lock is reentrant: the report below, written on this thread, takes
    // it again).
    let mut out = std::io::stdout().lock();
    while let Ok(job) = queued.recv() {
        match job {
            Job::Line(line) => {
                QUEUED.fetch_sub(line.len(), Ordering::Relaxed);
                if out.write_all(&line).and_then(|()| out.flush()).is_err() {
                    DROPPED.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let dropped = DROPPED.swap(0, Ordering::Relaxed);
                if dropped > 0 {
                    tracing::warn!(
                        dropped,
                        "log lines were dropped: the log's reader did not keep up or was gone"
                    );
                }
            }
            Job::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// One event's line, handed to the writer thread when the formatter is done with it.
struct Line {
    queue: Queue,
    bytes: Vec<u8>,
}

impl std::io::Write for Line {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        if self.bytes.is_empty() {
            return;
        }
        if WRITER.with(std::cell::Cell::get) {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            if out
                .write_all(&self.bytes)
                .and_then(|()| out.flush())
                .is_err()
            {
                DROPPED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            return;
        }
        let len = self.bytes.len();
        let room = QUEUED
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
                (q + len <= QUEUED_BYTES).then_some(q + len)
            })
            .is_ok();
        if !room {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let line = Job::Line(std::mem::take(&mut self.bytes));
        if self.queue.jobs.try_send(line).is_err() {
            QUEUED.fetch_sub(len, Ordering::Relaxed);
            DROPPED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Queue {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        Line {
            queue: self.clone(),
            // The formatter writes a line in one piece: one allocation of its size.
            bytes: Vec::new(),
        }
    }
}

/// Waits, up to `within`, until every line logged so far is written: before the process
/// exits, so that its last lines (the drain's, the error that stopped it) are not lost, yet a
/// reader that has stopped does not keep it from exiting.
#[allow(clippy::disallowed_types)] // at exit, outside any runtime: no paused clock to honour
pub(crate) fn flush(within: std::time::Duration) {
    let Some(Ok(queue)) = QUEUE.get() else {
        return;
    };
    let (done, written) = std::sync::mpsc::channel();
    let deadline = std::time::Instant::now() + within;
    let mut job = Job::Flush(done);
    // The queue may be full: try until the deadline.
    loop {
        match queue.jobs.try_send(job) {
            Ok(()) => break,
            Err(std::sync::mpsc::TrySendError::Full(back))
                if std::time::Instant::now() < deadline =>
            {
                job = back;
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(_) => return,
        }
    }
    let _ = written.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()));
}

/// Sets up logging with [`filter`].
pub(crate) fn init(format: LogFormat) -> Result<(), String> {
    let filter = filter()?;
    let queue = QUEUE.get_or_init(Queue::start).clone()?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(queue)
        // A line that cannot be written is counted, never reported on stderr (which may be
        // closed too: `eprintln!` panics then).
        .log_internal_errors(false)
        .with_ansi(std::io::stdout().is_terminal())
        // Which serving thread wrote it (`main`, `sluice-worker-N`): how connections spread.
        .with_thread_names(true);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{level_slip, with_default_level};

    #[test]
    fn words_read_as_levels_but_not_levels_are_named() {
        assert_eq!(level_slip("warning"), Some(("warning".into(), "warn")));
        assert_eq!(
            level_slip("access=off, FATAL"),
            Some(("FATAL".into(), "error"))
        );
        assert_eq!(level_slip("warn"), None);
        assert_eq!(level_slip("sluice=debug,access"), None);
        assert_eq!(level_slip("warning=debug"), None);
    }

    #[test]
    fn targets_alone_keep_info_for_the_rest() {
        assert_eq!(
            with_default_level("sluice=debug"),
            "info,sluice=debug,h2=error"
        );
        assert_eq!(with_default_level("access=off"), "info,access=off,h2=error");
        assert_eq!(with_default_level("warn"), "warn,h2=error");
        assert_eq!(with_default_level("access=warn,DEBUG"), "access=warn,DEBUG");
        assert_eq!(with_default_level(""), "info,h2=error");
        assert_eq!(with_default_level(" , "), "info,h2=error");
        // Asked for by name, or everything verbose: as asked.
        assert_eq!(with_default_level("h2=warn"), "info,h2=warn");
        assert_eq!(with_default_level("trace"), "trace");
        assert_eq!(with_default_level("h2c=debug"), "info,h2c=debug,h2=error");
        assert_eq!(with_default_level("5"), "5");
        assert_eq!(
            with_default_level("h2::codec=debug"),
            "info,h2::codec=debug,h2=error"
        );
    }
}
