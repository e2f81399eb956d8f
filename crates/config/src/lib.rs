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
    let whole_file = |message: String| {
        ConfigErrors(vec![ConfigError {
            location: None,
            key: String::new(),
            message,
        }])
    };
    let bytes = std::fs::read(path)
        .map_err(|e| whole_file(format!("cannot read {}: {e}", path.display())))?;
    let text = match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            let bytes = e.as_bytes();
            let good = e.utf8_error().valid_up_to();
            let before = std::str::from_utf8(&bytes[..good]).unwrap_or_default();
            let location = error::Source::new(path, before).locate(good);
            return Err(ConfigErrors(vec![ConfigError {
                location: Some(location),
                key: String::new(),
                message: format!(
                    "byte 0x{:02x} is not UTF-8: a TOML file must be UTF-8 text",
                    bytes[good]
                ),
            }]));
        }
    };
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
    let (mut key, map_key_lost) = key_path(e.path());
    let inner = e.into_inner();
    let mut message = inner.message().trim_end().to_owned();
    if let Some(span) = inner.span() {
        // Some errors come from TOML's own reading (a number too large), before serde has a
        // key path: the key is the one written on the value's line.
        // And a table named by a map key (`[upstreams.app]`) is left out of serde's path.
        // So is a dotted key's table (`upstreams.app.bogus = 1` comes back as `bogus`).
        let found = key_at(text, span.start);
        let fuller = found.len() > key.len() && found.ends_with(&format!(".{key}"));
        if !found.is_empty() && (key.is_empty() || map_key_lost || fuller) {
            key = found;
        }
        let value = value_at(text, span.start);
        let header = value.starts_with('[');
        if !value.is_empty() && !header && !message.contains(value) {
            message = format!("{value}: {message}");
        }
    }
    error::Source::new(file, text).error(inner.span(), key, message)
}

/// The value written at `offset`, up to the end of its token on that line (a quoted string to
/// its closing quote), at most 80 bytes: TOML's errors point at where a value starts.
fn value_at(text: &str, offset: usize) -> &str {
    let Some(rest) = text.get(offset..) else {
        return "";
    };
    let line = rest.split('\n').next().unwrap_or("");
    let end = if let Some(quoted) = line.strip_prefix('"') {
        quoted.find('"').map_or(line.len(), |i| i + 2)
    } else {
        line.find(|c: char| c.is_whitespace() || ",#]}".contains(c))
            .unwrap_or(line.len())
    };
    let mut end = end.min(80);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    &line[..end]
}

/// The dotted key whose value stands at `offset`, from the text: the table header above it
/// (an array of tables with its index) and the key before `=` on the line. Empty if the line
/// has no `=` before `offset`.
fn key_at(text: &str, offset: usize) -> String {
    let Some(before) = text.get(..offset) else {
        return String::new();
    };
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].split('\n').next().unwrap_or("");
    // A table header's errors are the table's; a value's (or an unknown key's) key is what
    // stands before the line's `=`, a dotted key whole.
    if let Some(header) = line.trim().strip_prefix('[') {
        let name = header.trim_matches(['[', ']']).trim();
        let plain = !name.is_empty() && !name.contains(['[', ']', '"', '\'', '#']);
        return if plain {
            name.to_owned()
        } else {
            String::new()
        };
    }
    let Some((name, _)) = line.split_once('=') else {
        return String::new();
    };
    let name = name.trim();
    if name.is_empty() || name.contains(['[', ']', '"', '\'']) {
        return String::new();
    }
    let header = before[..line_start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['));
    let table = match header {
        Some(h) if h.starts_with("[[") => {
            let t = h
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or("")
                .trim();
            let marker = format!("[[{t}]]");
            let index = before[..line_start]
                .lines()
                .filter(|l| l.trim().replace(' ', "") == marker)
                .count()
                .saturating_sub(1);
            format!("{t}[{index}].")
        }
        Some(h) => format!(
            "{}.",
            h.trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or("")
                .trim()
        ),
        None => String::new(),
    };
    format!("{table}{name}")
}

/// `limits[2].window`, leaving out the private fields serde's `Spanned` wrapper uses; and
/// whether a map key could not be named (a spanned key: `[upstreams.<name>]`).
fn key_path(path: &serde_path_to_error::Path) -> (String, bool) {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    let mut lost = false;
    for segment in path.iter() {
        if matches!(segment, Segment::Unknown) {
            lost = true;
        }
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
    (out, lost)
}
