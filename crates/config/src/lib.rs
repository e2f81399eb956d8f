//! sluice's configuration: TOML in, a validated [`Config`] out.
//!
//! Parsing happens in two steps. Serde reads the file into raw structs whose values keep
//! their position; validation then turns them into typed values (`NonZeroU32`, `Duration`,
//! parsed networks), collecting every problem with its file, line, column, key and value.
//! A [`Config`] that exists is one sluice can run.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cidr;
mod duration;
mod error;
mod model;
pub mod path;
mod raw;
mod size;
mod validate;

use std::path::Path;

pub use cidr::{mask_v4, mask_v6, Cidr};
pub use duration::format_duration;
pub use error::{ConfigError, ConfigErrors, Location};
pub use model::*;
pub use size::format_size;

/// Reads and validates the configuration file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            location: None,
            key: String::new(),
            message: format!("cannot read {}: {e}", path.display()),
        }])
    })?;
    parse(&text, path)
}

/// Validates configuration `text`; `file` is the name errors are reported under.
pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigErrors> {
    let validator = validate::Validator::new(file, text);
    let raw: raw::RawConfig = serde_path_to_error::deserialize(toml::Deserializer::new(text))
        .map_err(|e| ConfigErrors(vec![serde_error(file, text, e)]))?;
    validator.config(&raw).map_err(ConfigErrors)
}

fn serde_error(
    file: &Path,
    text: &str,
    e: serde_path_to_error::Error<toml::de::Error>,
) -> ConfigError {
    let key = key_path(e.path());
    let inner = e.into_inner();
    error::Source::new(file, text).error(inner.span(), key, inner.message().trim_end().to_owned())
}

/// `limits[2].window`, leaving out the private fields serde's `Spanned` wrapper uses.
fn key_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } if !key.starts_with("$__") => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            _ => {}
        }
    }
    out
}
