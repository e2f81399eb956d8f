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
mod host;
mod model;
pub mod path;
mod raw;
mod size;
mod validate;

use std::path::Path;

pub use cidr::{mask_v4, mask_v6, Cidr};
pub use duration::format_duration;
pub use error::{printable, ConfigError, ConfigErrors, Location};
pub use host::redact_url;
pub use model::*;
pub use size::format_size;

/// Reads and validates the configuration file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    load_with(path, &[])
}

/// [`load`], with `url_overrides` (`(upstream name, URL)`, as `--upstream NAME=URL` gives
/// them) checked and used in place of those upstreams' URLs in the file.
pub fn load_with(path: &Path, url_overrides: &[(String, String)]) -> Result<Config, ConfigErrors> {
    let whole_file = |message: String| {
        ConfigErrors(vec![ConfigError {
            location: None,
            key: String::new(),
            // It names the path, which is one printable line too.
            message: printable(message),
        }])
    };
    let bytes = read_bounded(path).map_err(whole_file)?;
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
    parse_with(&text, path, url_overrides)
}

/// The largest configuration file read: far beyond any real one (the shipped file is 4 KiB),
/// and small enough that a wrong path (`/dev/zero`, a log file) is refused at once.
const MAX_FILE: u64 = 16 << 20;

/// The file's bytes, if it is a regular file or a pipe (`sluice check -c <(envsubst < t)`) of
/// at most [`MAX_FILE`]: a directory or a device (`/dev/zero`) is refused before it is read, so
/// a wrong path can neither fill the memory nor read for ever. The type is that of the file
/// opened, not of the path looked at before.
fn read_bounded(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    #[cfg(unix)]
    use std::os::unix::fs::FileTypeExt;
    let cannot = |e: std::io::Error| format!("cannot read {}: {e}", path.display());
    let file = std::fs::File::open(path).map_err(cannot)?;
    let kind = file.metadata().map_err(cannot)?.file_type();
    #[cfg(unix)]
    let pipe = kind.is_fifo();
    #[cfg(not(unix))]
    let pipe = false;
    if kind.is_dir() {
        return Err(format!("cannot read {}: it is a directory", path.display()));
    }
    if !kind.is_file() && !pipe {
        return Err(format!(
            "cannot read {}: it is not a regular file or a pipe (a device or a socket)",
            path.display()
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(format!(
            "cannot read {}: it is larger than {} MiB, which no configuration needs",
            path.display(),
            MAX_FILE >> 20
        ));
    }
    Ok(bytes)
}

/// Validates configuration `text`; `file` is the name errors are reported under.
pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigErrors> {
    parse_with(text, file, &[])
}

/// [`parse`], with URL overrides as for [`load_with`].
pub fn parse_with(
    text: &str,
    file: &Path,
    url_overrides: &[(String, String)],
) -> Result<Config, ConfigErrors> {
    let validator = validate::Validator::new(file, text, url_overrides);
    let raw: raw::RawConfig = serde_path_to_error::deserialize(toml::Deserializer::new(text))
        .map_err(|e| ConfigErrors(vec![serde_error(file, text, e)]))?;
    validator.config(&raw).map_err(ConfigErrors)
}

fn serde_error(
    file: &Path,
    text: &str,
    e: serde_path_to_error::Error<toml::de::Error>,
) -> ConfigError {
    let mut error = serde_error_plain(file, text, e);
    if let Some(hint) = hint(&error.key, &error.message) {
        error.message = format!("{} ({hint})", error.message);
    }
    let line = error
        .location
        .as_ref()
        .and_then(|l| text.lines().nth(l.line - 1));
    if let Some(line) = line {
        error.message = error::hide_broken_userinfo(line, &error.message);
    }
    error
}

/// Keys whose values are durations (`"30s"`) and sizes (`"1MiB"`), by their last part.
const DURATION_KEYS: &[&str] = &[
    "header_timeout",
    "send_timeout",
    "shutdown_grace",
    "drain_delay",
    "min_body_rate_grace",
    "min",
    "max",
    "connect_timeout",
    "timeout",
    "tunnel_idle_timeout",
    "window",
    "max_delay",
    "block_for",
];
const SIZE_KEYS: &[&str] = &["max_body_size", "min_body_rate"];

/// What to write instead, for the slips serde's words do not explain: a number where a
/// duration or size is written as a string, `[limits]` for `[[limits]]`, one route name
/// without its list.
fn hint(key: &str, message: &str) -> Option<String> {
    let last = key.rsplit('.').next().unwrap_or(key);
    let last = last.split('[').next().unwrap_or(last);
    if let Some(rest) = message.split("invalid type: integer `").nth(1) {
        if message.contains("expected a string") {
            let n = rest.split('`').next().unwrap_or("");
            // Only a value the key would take is suggested (review: `= 0` was told to write
            // "0s", then refused as not longer than zero; `= -10`, "-10s").
            let positive = n.parse::<u64>().is_ok_and(|n| n > 0);
            if DURATION_KEYS.contains(&last) {
                return Some(match positive || (n == "0" && last == "drain_delay") {
                    true => format!("a duration is a string with a unit: write \"{n}s\""),
                    false => "a duration is a string with a unit, such as \"30s\"".to_owned(),
                });
            }
            if SIZE_KEYS.contains(&last) {
                return Some(match positive || (n == "0" && last == "min_body_rate") {
                    true => format!("a size is a string with a unit: write \"{n}B\" or \"{n}KiB\""),
                    false => "a size is a string with a unit, such as \"1MiB\"".to_owned(),
                });
            }
        }
    }
    if message.contains("invalid type: table, expected a sequence")
        && (key == "limits" || key == "routes")
    {
        return Some(format!(
            "each entry is its own [[{key}]] table, with two brackets"
        ));
    }
    if message.contains("invalid type: string") && message.contains("expected a sequence") {
        if let Some(value) = message.split("invalid type: string ").nth(1) {
            let value = value.split(", expected").next().unwrap_or(value);
            return Some(format!("write a list: [{value}]"));
        }
    }
    if message.contains("number too large to fit in target type") {
        return Some("TOML integers stop at 9223372036854775807".to_owned());
    }
    None
}

fn serde_error_plain(
    file: &Path,
    text: &str,
    e: serde_path_to_error::Error<toml::de::Error>,
) -> ConfigError {
    let (mut key, map_key_lost) = key_path(e.path());
    let inner = e.into_inner();
    // TOML's messages run over lines ("invalid escape sequence\nexpected ..."): one line here.
    let message = inner
        .message()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    let message = plain_types(&message);
    let mut message = message;
    // TOML says nothing of a control character in a comment (review: the line was printed
    // with an empty message), or that it expected a newline: name it, wherever it is.
    let control = inner.span().and_then(|span| {
        let c = text.get(span.start..)?.chars().next()?;
        (c.is_control() && !matches!(c, '\t' | '\n' | '\r')).then_some(c)
    });
    if let Some(c) = control {
        if key.is_empty() {
            key = key_at(text, inner.span().map_or(0, |s| s.start));
        }
        let message = format!(
            "control character U+{:04X} is not allowed here: TOML allows none but tab outside strings, comments included (inside a string, write it as \\u{:04X})",
            u32::from(c),
            u32::from(c)
        );
        return error::Source::new(file, text).error(inner.span(), key, message);
    }
    if let Some(span) = inner.span() {
        // An error inside a string (a bad escape, one never closed) is the string's key's; the
        // value shown is the string on the error's line, from its opening quote or the line's
        // start.
        if let Some((open, closed)) = string_around(text, span.start) {
            let found = key_at(text, open);
            if key.is_empty() && !found.is_empty() {
                key = found;
            }
            let before = text.get(..span.start).unwrap_or(text);
            let line_start = before.rfind('\n').map_or(0, |i| i + 1);
            let value = value_line(text, if closed { open.max(line_start) } else { open });
            // A Redis URL's password is not repeated, wherever its string breaks; on a line
            // holding a URL with a user, nothing of the line is (review: a quote or `,` in
            // the password broke the string, and the error quoted the password's tail).
            let value = &redact_url(quotable(text, span.start, value));
            if !value.is_empty() && !message.contains(value) {
                message = format!("{value}: {message}");
            }
            // TOML points just past a bad escape's letter; the escape starts at its backslash.
            // One never closed is pointed at where it opens.
            let mut place = if closed { span.start } else { open };
            if closed && message.contains("escape") {
                if let Some(slash) = before[line_start..].rfind('\\') {
                    place = line_start + slash;
                }
            }
            return error::Source::new(file, text).error(Some(place..place), key, message);
        }
        // Some errors come from TOML's own reading (a number too large), before serde has a
        // key path: the key is the one written on the value's line.
        // And a table named by a map key (`[upstreams.app]`) is left out of serde's path.
        // So is a dotted key's table (`upstreams.app.bogus = 1` comes back as `bogus`).
        let found = key_at(text, span.start);
        let fuller = found.len() > key.len() && found.ends_with(&format!(".{key}"));
        if !found.is_empty() && (key.is_empty() || map_key_lost || fuller) {
            key = found;
        }
        let value = quotable(text, span.start, value_at(text, span.start));
        // toml hands a date-time to serde as a map, which is called a table above.
        if value.starts_with(|c: char| c.is_ascii_digit()) {
            message = message.replace("invalid type: table", "invalid type: date-time");
        }
        // A table header is no value: the error is the table's.
        let line_start = text[..span.start.min(text.len())]
            .rfind('\n')
            .map_or(0, |i| i + 1);
        let header = text
            .get(line_start..span.start)
            .is_some_and(|before| before.trim().is_empty())
            && value.starts_with('[');
        if !value.is_empty() && !header && !message.contains(value) {
            message = format!("{value}: {message}");
        }
    }
    error::Source::new(file, text).error(inner.span(), key, message)
}

/// serde's words for sluice's own types (`struct RawGateway`, `i64`) in the words of the file:
/// a table, an integer.
fn plain_types(message: &str) -> String {
    // A table (a dotted key, `max_held.x = 1`) where one value goes: toml's spanned value reads
    // the table's first key as its own marker and says so in its words (review).
    if message.contains("expected a borrowed string") {
        return "invalid type: table, expected one value".to_owned();
    }
    let mut out = message.to_owned();
    for (rust, toml) in [
        ("expected i64", "expected an integer"),
        ("expected u64", "expected an integer"),
        ("invalid type: map", "invalid type: table"),
    ] {
        out = out.replace(rust, toml);
    }
    // serde spells a float out in full (`1e308` as 309 digits); the value as written
    // already leads the message.
    if let Some(at) = out.find("floating point `") {
        let from = at + "floating point".len();
        if let Some(len) = out[from + 2..].find('`') {
            out.replace_range(from..from + 2 + len + 1, "");
        }
    }
    while let Some(at) = out.find("expected struct Raw") {
        let end = out[at..]
            .find(|c: char| !c.is_ascii_alphanumeric() && c != ' ')
            .map_or(out.len(), |i| at + i);
        let name_end = out[at + "expected struct ".len()..end]
            .find(' ')
            .map_or(end, |i| at + "expected struct ".len() + i);
        out.replace_range(at..name_end, "expected a table");
    }
    out
}

/// Where the string holding `offset` opens, if `offset` is inside one (or inside one never
/// closed), and whether it closes: a short scan of the TOML text for comments and the four
/// kinds of string.
fn string_around(text: &str, offset: usize) -> Option<(usize, bool)> {
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len().min(offset) {
        let q = b[i];
        if q == b'#' {
            i = b[i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |n| i + n);
            continue;
        }
        if q != b'"' && q != b'\'' {
            i += 1;
            continue;
        }
        let open = i;
        let multi = b[i..].starts_with(&[q, q, q]);
        let quotes = if multi { 3 } else { 1 };
        i += quotes;
        loop {
            if i >= b.len() || (!multi && b[i] == b'\n') {
                // Never closed: everything after the opening quote is the string's.
                return (offset >= open).then_some((open, false));
            }
            if q == b'"' && b[i] == b'\\' {
                i += 2;
                continue;
            }
            if b[i..].starts_with(&[q, q, q][..quotes]) {
                // A multi-line string may end in up to two more quotes of its own.
                let mut end = i + quotes;
                while multi && end < b.len() && b[end] == q && end < i + quotes + 2 {
                    end += 1;
                }
                if offset > open && offset < end {
                    return Some((open, true));
                }
                i = end;
                break;
            }
            i += 1;
        }
    }
    None
}

/// `value`, taken from the line at `offset` to be quoted in an error, or nothing if it could
/// be part of a password: on a line holding a URL with a user, only a whole URL is quoted
/// (its password then hidden as `***`), not a piece of one (a quote or `,` in the password
/// broke its string).
fn quotable<'t>(text: &str, offset: usize, value: &'t str) -> &'t str {
    match value.contains("://") || !holds_userinfo(text, offset) {
        true => value,
        false => "",
    }
}

/// Whether the line at `offset` holds a URL with a user (`://`, then `@`): what an error
/// quotes from it could be part of a password (its string broken by a quote in it).
fn holds_userinfo(text: &str, offset: usize) -> bool {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    let line = &text[start..end];
    line.find("://").is_some_and(|s| line[s..].contains('@'))
}

/// The rest of the line from `offset`, trimmed, at most 80 bytes.
fn value_line(text: &str, offset: usize) -> &str {
    let Some(rest) = text.get(offset..) else {
        return "";
    };
    let line = rest.split('\n').next().unwrap_or("").trim();
    let mut end = line.len().min(80);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    &line[..end]
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
    } else if line.starts_with(['{', '[']) {
        // An inline table or array, whole: to its closing bracket on this line (brackets in
        // its strings, basic or literal, escaped quotes included, do not count).
        let mut depth = 0usize;
        let mut quote: Option<char> = None;
        let mut escaped = false;
        line.char_indices()
            .find(|&(_, c)| {
                match (quote, c) {
                    (Some('"'), _) if escaped => escaped = false,
                    (Some('"'), '\\') => escaped = true,
                    (Some(q), c) if c == q => quote = None,
                    (Some(_), _) => {}
                    (None, '"' | '\'') => quote = Some(c),
                    (None, '{' | '[') => depth += 1,
                    (None, '}' | ']') => depth = depth.saturating_sub(1),
                    (None, _) => {}
                }
                depth == 0
            })
            .map_or(line.len(), |(i, _)| i + 1)
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

/// The dotted key whose key or value stands at `offset` (an array of tables with its index:
/// `routes[1].respond`): read from the parsed document's spans when the text parses as TOML,
/// so that quoted names, inline tables and multi-line strings are named right (review: they
/// were not, by the text alone); else from the text ([`key_on_line`]).
fn key_at(text: &str, offset: usize) -> String {
    match toml_edit::ImDocument::parse(text) {
        Ok(doc) => spanned_key(doc.as_table(), "", offset).unwrap_or_default(),
        Err(_) => key_on_line(text, offset),
    }
}

/// The deepest key under `table` (named `path`) whose key, value or table spans `offset`.
fn spanned_key(table: &toml_edit::Table, path: &str, offset: usize) -> Option<String> {
    let within = |span: Option<std::ops::Range<usize>>| span.is_some_and(|s| s.contains(&offset));
    let join = |name: &str| match path {
        "" => name.to_owned(),
        _ => format!("{path}.{name}"),
    };
    for (name, _) in table.iter() {
        let (key, item) = table.get_key_value(name)?;
        let here = join(name);
        let found = match item {
            toml_edit::Item::None => None,
            toml_edit::Item::Value(value) => {
                let start = key.span().map_or(usize::MAX, |s| s.start);
                let end = value.span().map_or(0, |s| s.end);
                (start <= offset && offset < end)
                    .then(|| spanned_value(value, &here, offset).unwrap_or(here.clone()))
            }
            // A table's span runs from its header over its entries: an entry first.
            toml_edit::Item::Table(t) => {
                spanned_key(t, &here, offset).or_else(|| within(t.span()).then(|| here.clone()))
            }
            toml_edit::Item::ArrayOfTables(tables) => {
                tables.iter().enumerate().find_map(|(i, t)| {
                    let here = format!("{here}[{i}]");
                    spanned_key(t, &here, offset).or_else(|| within(t.span()).then_some(here))
                })
            }
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

/// Within a value named `path`: the key of an inline table's entry, or an array's element,
/// that spans `offset`.
fn spanned_value(value: &toml_edit::Value, path: &str, offset: usize) -> Option<String> {
    match value {
        toml_edit::Value::InlineTable(t) => t.iter().find_map(|(name, v)| {
            let (key, _) = t.get_key_value(name)?;
            let start = key.span().map_or(usize::MAX, |s| s.start);
            let end = v.span().map_or(0, |s| s.end);
            let here = format!("{path}.{name}");
            (start <= offset && offset < end)
                .then(|| spanned_value(v, &here, offset).unwrap_or(here.clone()))
        }),
        toml_edit::Value::Array(a) => a.iter().enumerate().find_map(|(i, v)| {
            let here = format!("{path}[{i}]");
            v.span()
                .is_some_and(|s| s.contains(&offset))
                .then(|| spanned_value(v, &here, offset).unwrap_or(here.clone()))
        }),
        _ => None,
    }
}

/// The dotted key whose value stands at `offset`, from the text: the table header above it
/// (an array of tables with its index) and the key before `=` on the line. Empty if the line
/// has no `=` before `offset`. For text that does not parse as TOML.
fn key_on_line(text: &str, offset: usize) -> String {
    let Some(before) = text.get(..offset) else {
        return String::new();
    };
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[line_start..]
        .find('\n')
        .map_or(text.len(), |i| line_start + i);
    let line = &text[line_start..line_end];
    // A table header's errors are the table's; a value's (or an unknown key's) key is what
    // stands before the line's `=`, a dotted key whole, under the header above it.
    if line.trim().starts_with('[') {
        return table_name(line)
            .map(|t| indexed(&text[..line_end], t))
            .unwrap_or_default();
    }
    let Some((name, _)) = line.split_once('=') else {
        return String::new();
    };
    let name = name.trim();
    if name.is_empty() || name.contains(['[', ']', '"', '\'']) {
        return String::new();
    }
    let above = &before[..line_start];
    match above.lines().rev().find(|l| l.trim().starts_with('[')) {
        Some(header) => match table_name(header) {
            Some(t) => format!("{}.{name}", indexed(above, t)),
            None => String::new(),
        },
        None => name.to_owned(),
    }
}

/// The table a header line names (`[a.b]` or `[[a]]`, a comment after it allowed), if it is
/// written plainly (no quoted parts).
fn table_name(header: &str) -> Option<&str> {
    let header = header.split('#').next().unwrap_or("").trim();
    let name = header.trim_start_matches('[').trim_end_matches(']').trim();
    let plain = !name.is_empty() && !name.contains(['[', ']', '"', '\'']);
    plain.then_some(name)
}

/// `table` with the index of each array of tables it runs through (`routes.respond` ->
/// `routes[1].respond`), counting the `[[...]]` headers in `text` (which ends with the header
/// that opened `table`).
fn indexed(text: &str, table: &str) -> String {
    let arrays: Vec<&str> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("[["))
        .filter_map(table_name)
        .collect();
    let mut out = String::new();
    let mut path = String::new();
    for part in table.split('.').map(str::trim) {
        if !path.is_empty() {
            path.push('.');
            out.push('.');
        }
        path.push_str(part);
        out.push_str(part);
        let same = |a: &&&str| a.split('.').map(str::trim).eq(path.split('.'));
        let count = arrays.iter().filter(same).count();
        if count > 0 {
            out.push_str(&format!("[{}]", count - 1));
        }
    }
    out
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
