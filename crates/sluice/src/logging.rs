//! Log set-up: text or JSON lines on stdout, level from `SLUICE_LOG` (default `info`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::LogFormat;

/// The filter `SLUICE_LOG` asks for; a value that is not a filter is an error, not a silent
/// `info`.
pub(crate) fn filter() -> Result<EnvFilter, String> {
    match std::env::var("SLUICE_LOG") {
        Err(std::env::VarError::NotPresent) => Ok(EnvFilter::new("info")),
        Ok(v) => EnvFilter::try_new(with_default_level(&v)).map_err(|e| {
            let shown = sluice_config::printable(format!("{v:?}"));
            format!("SLUICE_LOG={shown} is not a log filter: {e} (write e.g. info, warn, or access=warn)")
        }),
        Err(std::env::VarError::NotUnicode(_)) => Err("SLUICE_LOG is not UTF-8 text".into()),
    }
}

/// `directives` with `info` for every target they do not name, unless they set a level for
/// all themselves. A filter of targets alone turns off everything else (`sluice=debug` would
/// silence the access log and every warning), and an empty one everything: neither is what
/// someone who raises one target's level, or leaves the variable blank, means.
fn with_default_level(directives: &str) -> String {
    let levels = ["off", "error", "warn", "info", "debug", "trace"];
    let has_level = directives
        .split(',')
        .any(|d| levels.contains(&d.trim().to_ascii_lowercase().as_str()));
    if has_level {
        directives.to_owned()
    } else if directives.trim_matches([',', ' ']).is_empty() {
        "info".to_owned()
    } else {
        format!("info,{directives}")
    }
}

/// Sets up logging with [`filter`].
pub(crate) fn init(format: LogFormat) -> Result<(), String> {
    let filter = filter()?;
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

#[cfg(test)]
mod tests {
    use super::with_default_level;

    #[test]
    fn targets_alone_keep_info_for_the_rest() {
        assert_eq!(with_default_level("sluice=debug"), "info,sluice=debug");
        assert_eq!(with_default_level("access=off"), "info,access=off");
        assert_eq!(with_default_level("warn"), "warn");
        assert_eq!(with_default_level("access=warn,DEBUG"), "access=warn,DEBUG");
        assert_eq!(with_default_level(""), "info");
        assert_eq!(with_default_level(" , "), "info");
    }
}
