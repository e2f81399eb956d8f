//! Errors that name the file, line, column, key and value.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Where in a configuration file something stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The file, as the user named it.
    pub file: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// 1-based column, counted in characters.
    pub column: usize,
}

/// One problem found in a configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where the offending key or value stands, when known.
    pub location: Option<Location>,
    /// The dotted key path, such as `limits[2].window`; empty for a whole-file problem.
    pub key: String,
    /// What is wrong, naming the bad value.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(loc) = &self.location {
            // The path as one printable line too: a file name holding a newline could forge one.
            let file = printable(loc.file.display().to_string());
            write!(f, "{file}:{}:{}: ", loc.line, loc.column)?;
        }
        if !self.key.is_empty() {
            write!(f, "{}: ", self.key)?;
        }
        f.write_str(&self.message)
    }
}

/// Every problem found in one configuration file (validation does not stop at the first).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// Turns byte offsets of one source text into [`Location`]s.
#[derive(Debug)]
pub(crate) struct Source<'a> {
    file: &'a Path,
    text: &'a str,
    /// Where each line after the first starts, found once when the first error is placed: a
    /// file with thousands of errors is not walked once per error.
    line_starts: std::cell::OnceCell<Vec<usize>>,
    /// The last offset placed and its column: errors come in file order, so one long line of
    /// many errors (a list of 300,000 bad entries) is counted along once, not from its start
    /// for each (review: 26 s).
    last: std::cell::Cell<(usize, usize)>,
}

impl<'a> Source<'a> {
    pub(crate) fn new(file: &'a Path, text: &'a str) -> Self {
        Self {
            file,
            text,
            line_starts: std::cell::OnceCell::new(),
            last: std::cell::Cell::new((0, 0)),
        }
    }

    pub(crate) fn file(&self) -> &Path {
        self.file
    }

    pub(crate) fn locate(&self, offset: usize) -> Location {
        let offset = offset.min(self.text.len());
        let before = &self.text[..floor_char_boundary(self.text, offset)];
        let starts = self
            .line_starts
            .get_or_init(|| self.text.match_indices('\n').map(|(i, _)| i + 1).collect());
        // How many lines after the first start at or before the offset.
        let done = starts.partition_point(|&s| s <= before.len());
        let line = done + 1;
        let line_start = if done == 0 { 0 } else { starts[done - 1] };
        let (last, last_column) = self.last.get();
        let column = if line_start < last && last <= before.len() {
            last_column + before[last..].chars().count()
        } else {
            // A byte-order mark is no column an editor shows.
            let line_text = &before[line_start..];
            line_text
                .strip_prefix('\u{FEFF}')
                .unwrap_or(line_text)
                .chars()
                .count()
                + 1
        };
        self.last.set((before.len(), column));
        Location {
            file: self.file.to_path_buf(),
            line,
            column,
        }
    }

    pub(crate) fn error(
        &self,
        span: Option<Range<usize>>,
        key: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError {
            location: span.map(|s| self.locate(s.start)),
            // A key taken from the text (a TOML syntax error's) is held to the same rule.
            key: printable(key.into()),
            message: printable(message.into()),
        }
    }
}

/// `message` as one printable line: control characters (a value's newline, NUL) escaped, so
/// that a value cannot forge a line of its own, a very long one (a 1 MB value) cut in the
/// middle, and the password of anything written like a URL's userinfo shown as `***`.
pub fn printable(message: String) -> String {
    const MOST: usize = 600;
    let message = without_passwords(message);
    // Control characters, and the invisible ones that reorder or hide text (bidirectional
    // overrides and isolates, zero-width marks).
    let hidden = |c: char| {
        c.is_control()
            || matches!(c, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{FEFF}')
    };
    let escaped = if message.chars().any(hidden) {
        let mut out = String::with_capacity(message.len() + 8);
        for c in message.chars() {
            if hidden(c) {
                out.extend(c.escape_default());
            } else {
                out.push(c);
            }
        }
        out
    } else {
        message
    };
    if escaped.chars().count() <= MOST {
        return escaped;
    }
    let head: String = escaped.chars().take(MOST / 2).collect();
    let tail: Vec<char> = escaped.chars().rev().take(MOST / 4).collect();
    format!(
        "{head} [...] {}",
        tail.into_iter().rev().collect::<String>()
    )
}

/// `text` with the password of every URL-like word in it (`scheme://user:password@host`, and
/// the slips `scheme:/user:password@host` and `user:password@host`) shown as `***`: an error
/// quotes the value it refuses, and a Redis or upstream URL's password must never be printed,
/// whatever the error (found by review: a `url` in the wrong section, of the wrong type, or
/// missing a slash was shown whole). Words run between spaces and double quotes.
fn without_passwords(text: String) -> String {
    if !text.contains('@') {
        return text;
    }
    each_word(&text, |word| crate::host::redact_userinfo(word))
}

/// `text` with each word (a run between spaces and double quotes) replaced by `f`'s.
fn each_word<'w>(text: &'w str, f: impl Fn(&'w str) -> std::borrow::Cow<'w, str>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c.is_whitespace() || c == '"' {
            out.push_str(&f(&text[start..i]));
            out.push(c);
            start = i + c.len_utf8();
        }
    }
    out.push_str(&f(&text[start..]));
    out
}

/// `message`, about a line holding a URL with a user (`://` and, after it, `@`), with what
/// stands before the `@` of each word of it shown as `***`: a quote or space in the password
/// breaks the TOML string, and what an error quotes from the rest of the line is then the
/// password's tail (`4dor@host:6379`), which [`without_passwords`] cannot tell from an
/// address. Words run between spaces and double quotes; a scheme is kept.
pub(crate) fn hide_broken_userinfo(line: &str, message: &str) -> String {
    let has_user = line
        .find("://")
        .is_some_and(|scheme| line[scheme..].contains('@'));
    if !has_user || !message.contains('@') {
        return message.to_owned();
    }
    each_word(message, |word| match word.rfind('@') {
        Some(at) => {
            let keep = word[..at].find("://").map_or(0, |s| s + 3);
            if word[keep..at].is_empty() || word[..at].ends_with("***") {
                word.into()
            } else {
                format!("{}***{}", &word[..keep], &word[at..]).into()
            }
        }
        None => word.into(),
    })
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Columns counted on from the last error placed are the ones counted from the line's
    /// start, in any order of offsets, across lines, a byte-order mark and wide characters.
    #[test]
    fn locations_do_not_depend_on_the_order_they_are_asked_in() {
        let text = "\u{FEFF}a = \"\u{e9}\u{e9}\"\nb = [1, \u{1F600}, 3]\n\nc = 4";
        let file = Path::new("c.toml");
        let alone = |o: usize| Source::new(file, text).locate(o);
        let shared = Source::new(file, text);
        let mut offsets: Vec<usize> = (0..=text.len() + 2).collect();
        offsets.extend((0..=text.len()).rev().step_by(3));
        offsets.extend((0..=text.len()).step_by(7));
        for o in offsets {
            assert_eq!(shared.locate(o), alone(o), "offset {o}");
        }
        assert_eq!((alone(4).line, alone(4).column), (1, 2));
        assert_eq!((alone(text.len()).line, alone(text.len()).column), (4, 6));
    }

    #[test]
    fn messages_are_one_printable_line_of_bounded_length() {
        assert_eq!(
            printable("\"a\nb\0\" is bad".into()),
            "\"a\\nb\\u{0}\" is bad"
        );
        assert_eq!(printable("\"a\u{202E}b\"".into()), "\"a\\u{202e}b\"");
        let long = printable(format!("\"{}\" is too long", "x".repeat(5000)));
        assert!(long.len() < 700 && long.contains(" [...] "), "{long}");
        assert!(long.ends_with("\" is too long"));
    }

    #[test]
    fn passwords_are_never_printed() {
        for (said, shown) in [
            (
                "\"redis://u:SECRET1@h:6379\" is not used",
                "\"redis://u:***@h:6379\" is not used",
            ),
            (
                "[\"redis://u:SECRET2@h:6379\"]: invalid type: sequence",
                "[\"redis://u:***@h:6379\"]: invalid type: sequence",
            ),
            (
                "\"redis:/u:SECRET3@h:6379\" is not",
                "\"redis:/u:***@h:6379\" is not",
            ),
            (
                "string \"redis://u:SECRET4@h:6379\", expected",
                "string \"redis://u:***@h:6379\", expected",
            ),
            ("http://u:SECRETX@h twice", "http://u:***@h twice"),
            (
                "--upstream app=http://u:SECRETX@h:",
                "--upstream app=http://u:***@h:",
            ),
            ("redis://:SECRET@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
            ("u:SECRET@h:6379", "u:***@h:6379"),
            ("redis://u:pa:ss@w@h", "redis://u:***@h"),
            ("redis:u:SECRET@h", "redis:***@h"),
        ] {
            assert_eq!(printable(said.into()), shown, "{said}");
            assert!(!printable(said.into()).contains("SECRET"));
        }
        for kept in [
            "user@example.com is",
            "redis://u@h:6379",
            "no at sign: a:b",
            "\"@\" x",
        ] {
            assert_eq!(printable(kept.into()), kept);
        }
    }

    #[test]
    fn a_byte_order_mark_takes_no_column() {
        let text = "\u{FEFF}x = 1\n";
        let src = Source::new(Path::new("f.toml"), text);
        assert_eq!(src.locate(text.find('x').unwrap()).column, 1);
    }

    #[test]
    fn locations_are_one_based_lines_and_columns() {
        let text = "a = 1\n[b]\nwindow = \"x\"\n";
        let src = Source::new(Path::new("f.toml"), text);
        let off = text.find("\"x\"").unwrap();
        let loc = src.locate(off);
        assert_eq!((loc.line, loc.column), (3, 10));
        assert_eq!(src.locate(0).line, 1);
    }

    #[test]
    fn error_display_names_file_line_column_key_and_message() {
        let src = Source::new(Path::new("c.toml"), "x = 1\n");
        let e = src.error(Some(4..5), "x", "bad");
        assert_eq!(e.to_string(), "c.toml:1:5: x: bad");
    }
}
