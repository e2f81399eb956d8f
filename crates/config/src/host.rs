//! Host names in URLs (what a resolver will read as the name written, and nothing else), and
//! URLs shown without their password.

use std::net::{Ipv4Addr, Ipv6Addr};

/// Whether `host` (as a URL holds it: a bracketed IPv6 address, or no brackets) is an IPv6
/// address in brackets, a dotted IPv4 address (four decimal parts, no leading zeros), or a DNS
/// name: labels of letters, digits, `-` and `_`, 1 to 63 bytes each and at most 253 in all, an
/// optional trailing dot, and a last label that is not a number (all digits, or `0x` and hex
/// digits). So `0177.0.0.1`, `2130706433`, `0x7f` and `0x7f.1`, which resolvers read as IPv4 in
/// octal, as one number or in hex, and `999.0.0.1`, are refused rather than reach an address
/// nobody wrote; a Docker container's short id (`3f4e5a6b7c8d`) is a name.
pub(crate) fn host_ok(host: &str) -> bool {
    if let Some(inner) = host.strip_prefix('[') {
        return inner
            .strip_suffix(']')
            .is_some_and(|a| a.parse::<Ipv6Addr>().is_ok());
    }
    if host.parse::<Ipv4Addr>().is_ok() {
        return true;
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    // What a resolver reads as a number (`inet_aton`: decimal, octal, `0x` hex parts).
    let numeric = |l: &str| {
        l.bytes().all(|b| b.is_ascii_digit())
            || l.strip_prefix("0x")
                .or_else(|| l.strip_prefix("0X"))
                .is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(label_ok)
        && !name.rsplit('.').next().is_some_and(numeric)
}

/// `url` with the password of its user information replaced by `***`, for logs and messages:
/// everything between the first `:` after `://` and the last `@` is hidden, so a password that
/// holds `/`, `?`, `#` or `@` unencoded is hidden whole too.
pub fn redact_url(url: &str) -> String {
    redact_userinfo(url).into_owned()
}

/// One word, its userinfo's password (after the first `:` of what stands before the last `@`,
/// past a `scheme:` followed by slashes) replaced by `***`.
pub(crate) fn redact_userinfo(word: &str) -> std::borrow::Cow<'_, str> {
    let Some(at) = word.rfind('@') else {
        return word.into();
    };
    // A scheme is letters, digits, `+`, `-` and `.` from a letter, then `:/`; what stands
    // before it (`app=` of `--upstream app=URL`) is kept.
    let scheme_end = word[..at]
        .find(":/")
        .filter(|&i| {
            let scheme = word[..i]
                .rsplit(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
                .next()
                .unwrap_or("");
            scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        })
        .map_or(0, |i| i + 1);
    let start =
        scheme_end + word[scheme_end..].len() - word[scheme_end..].trim_start_matches('/').len();
    if start > at {
        return word.into();
    }
    let Some(colon) = word[start..at].find(':') else {
        return word.into();
    };
    let from = start + colon + 1;
    format!("{}***{}", &word[..from], &word[at..]).into()
}

#[cfg(test)]
mod tests {
    use super::{host_ok, redact_url};

    #[test]
    fn names_and_plain_addresses_pass_numbers_a_resolver_would_reread_do_not() {
        for good in [
            "127.0.0.1",
            "localhost",
            "redis.internal",
            "api-1.example.com.",
            "my_service",
            "[::1]",
            "[2001:db8::1]",
            "10.0.0.5",
            "3f4e5a6b7c8d",
            "1password.internal",
        ] {
            assert!(host_ok(good), "{good}");
        }
        for bad in [
            "",
            "0177.0.0.1",
            "2130706433",
            "0x7f.0.0.1",
            "0x7f.1",
            "0x7f",
            "0XFF",
            "999.0.0.1",
            "127.1",
            "a..b",
            "exa mple",
            "[::1",
            "[not-v6]",
            "::1",
            ".",
            &"a".repeat(64),
        ] {
            assert!(!host_ok(bad), "{bad}");
        }
    }

    #[test]
    fn passwords_are_hidden_and_nothing_else_changes() {
        assert_eq!(redact_url("redis://u:pw@h:1/2"), "redis://u:***@h:1/2");
        assert_eq!(redact_url("redis://:p@w@h"), "redis://:***@h");
        assert_eq!(redact_url("redis://user@h"), "redis://user@h");
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
        assert_eq!(redact_url("not a url"), "not a url");
        for written in [
            "redis://u:pa#ss@h",
            "redis://u:pa?ss@h",
            "redis://u:pa/ss@h/3",
        ] {
            let shown = redact_url(written);
            assert!(
                shown.starts_with("redis://u:***@h") && !shown.contains("ss@"),
                "{shown}"
            );
        }
        // In a message's quotes too.
        assert_eq!(redact_url("\"redis://u:p\\q@h\""), "\"redis://u:***@h\"");
    }
}
