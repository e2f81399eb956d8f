//! Log set-up: text or JSON lines on stdout, level from `SLUICE_LOG` (default `info`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::LogFormat;

/// Sets up logging; a `SLUICE_LOG` that is not a filter is an error, not a silent `info`.
pub(crate) fn init(format: LogFormat) -> Result<(), String> {
    let filter = match std::env::var("SLUICE_LOG") {
        Err(std::env::VarError::NotPresent) => EnvFilter::new("info"),
        Ok(v) => EnvFilter::try_new(&v).map_err(|e| {
            let shown = sluice_config::printable(format!("{v:?}"));
            format!("SLUICE_LOG={shown} is not a log filter: {e} (write e.g. info, warn, or access=warn,info)")
        })?,
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err("SLUICE_LOG is not UTF-8 text".into());
        }
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout)
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
