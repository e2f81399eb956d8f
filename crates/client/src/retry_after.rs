//! `Retry-After` (RFC 9110 section 10.2.3): delay-seconds or an HTTP-date, nothing else.

use std::time::{Duration, SystemTime};

use http::header::{HeaderMap, RETRY_AFTER};

/// Reads a `Retry-After` field value as a wait counted from `now`.
///
/// Accepts `delay-seconds` (`1*DIGIT`) and the three HTTP-date forms a recipient must accept
/// (IMF-fixdate, the obsolete RFC 850 form and asctime, a leap second and any four-digit year
/// included). Everything else is `None`, meaning *absent*, never a wait of zero: `1.5`, `-3`,
/// `+5`, the empty string, whitespace and garbage. A zero wait comes only from `0` or a date
/// that is not in the future, which are real instructions to retry now ([`RetryPolicy`] honours
/// one once, then backs off instead). Seconds beyond a `u64` are `u64::MAX` seconds: the grammar
/// allows any number of digits, and a server that says "not for ages" must not be asked again
/// sooner than one that says a day (as it was when such a value read as absent).
///
/// `now` is the caller's wall clock, used only for the date form (and to place an RFC 850
/// date's two-digit year, within 50 years of it as RFC 9110 asks). Leading and trailing spaces
/// or tabs are ignored, as a field parser strips them.
///
/// [`RetryPolicy`]: crate::RetryPolicy
pub fn retry_after(value: impl AsRef<[u8]>, now: SystemTime) -> Option<Duration> {
    let text = std::str::from_utf8(value.as_ref()).ok()?;
    let text = text.trim_matches([' ', '\t']);
    if text.is_empty() {
        return None;
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        // All digits, so the only possible failure is overflow.
        return Some(Duration::from_secs(text.parse::<u64>().unwrap_or(u64::MAX)));
    }
    let date = crate::date::parse(text, now)?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Reads the `Retry-After` field of a response's headers with [`retry_after`].
///
/// A date is counted from the response's own `Date` when it has one (RFC 9110 section 6.6.1),
/// so that a client whose clock runs fast or slow still waits what the server meant (a clock
/// 90 s fast would otherwise read a 60 s wait as "now", and retry at once); `now` is used
/// only without a readable `Date`.
///
/// `Retry-After` is a singleton field, but a proxy may repeat it (a CDN's line beside the
/// origin's, or `60, 60` on one line): the longest of the waits is taken, so that no server is
/// asked again early. A value that cannot be read (an empty line beside `3600`) is passed
/// over, not taken for the whole field: the field is absent only when no value reads (review:
/// an empty line beside `3600` had the caller back in 100 ms).
pub fn retry_after_header(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let now = server_date(headers, now).unwrap_or(now);
    headers
        .get_all(RETRY_AFTER)
        .iter()
        .filter_map(|value| std::str::from_utf8(value.as_bytes()).ok())
        .flat_map(list)
        .filter_map(|wait| retry_after(wait, now))
        .max()
}

/// The values a comma joined on one line (`60, 60`, or two dates). An HTTP-date holds a comma
/// itself, after its day name (`Sun, 06 Nov ...`), so a piece that is a day name is joined
/// with the next one again.
fn list(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut pieces = text.match_indices(',').map(|(i, _)| i).chain([text.len()]);
    while let Some(end) = pieces.next() {
        let piece = &text[start..end];
        if crate::date::is_day_name(piece.trim_start_matches([' ', '\t'])) {
            if let Some(next) = pieces.next() {
                out.push(&text[start..next]);
                start = next + 1;
                continue;
            }
        }
        out.push(piece);
        start = end + 1;
    }
    out
}

/// The response's `Date`, if it has exactly one that reads as an HTTP-date (an RFC 850 date's
/// two-digit year placed within 50 years of `now`).
fn server_date(headers: &HeaderMap, now: SystemTime) -> Option<SystemTime> {
    let mut values = headers.get_all(http::header::DATE).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    crate::date::parse(value.to_str().ok()?.trim_matches([' ', '\t']), now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    /// Sun, 06 Nov 1994 08:49:37 GMT, RFC 9110's example date.
    fn example_date() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777)
    }

    fn before_example(secs: u64) -> SystemTime {
        example_date() - Duration::from_secs(secs)
    }

    #[test]
    fn delay_seconds_is_a_wait() {
        let now = SystemTime::now();
        assert_eq!(retry_after("42", now), Some(Duration::from_secs(42)));
        assert_eq!(retry_after("007", now), Some(Duration::from_secs(7)));
        assert_eq!(
            retry_after(HeaderValue::from_static("60"), now),
            Some(Duration::from_secs(60))
        );
    }

    #[test]
    fn zero_seconds_is_retry_now_not_absent() {
        assert_eq!(retry_after("0", SystemTime::now()), Some(Duration::ZERO));
    }

    #[test]
    fn decimal_1_5_parses_as_absent_not_zero() {
        // The seed's rule: a Retry-After in neither form, such as 1.5, is absent.
        assert_eq!(retry_after("1.5", SystemTime::now()), None);
    }

    #[test]
    fn values_in_neither_form_are_absent() {
        let now = SystemTime::now();
        for bad in [
            "-3", "+5", "", " ", "\t", "garbage", "5s", "5 5", "0x10", "1e3", "٣", "5,6",
        ] {
            assert_eq!(retry_after(bad, now), None, "{bad:?}");
        }
    }

    /// Review: a wait past `u64` read as absent, so the caller backed off for 100 ms where a
    /// smaller wait had it stop.
    #[test]
    fn overflowing_seconds_are_the_longest_wait() {
        let now = SystemTime::now();
        for huge in [
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999999999",
        ] {
            assert_eq!(
                retry_after(huge, now),
                Some(Duration::from_secs(u64::MAX)),
                "{huge}"
            );
        }
    }

    /// Review: two dates on one line (a proxy's repetition) read as absent, since only lists
    /// of seconds were split.
    #[test]
    fn dates_joined_on_one_line_give_the_longest_wait() {
        let now = before_example(90);
        let h = headers(&[(
            "retry-after",
            "Sun, 06 Nov 1994 08:49:37 GMT, Sun, 06 Nov 1994 08:48:37 GMT",
        )]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(90)));
        let h = headers(&[("retry-after", "60, Sunday, 06-Nov-94 08:49:37 GMT,120")]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(120)));
        let h = headers(&[("retry-after", "Sun Nov  6 08:49:37 1994, 5")]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(90)));
        // A day name with nothing after it is not a date: passed over, the 60 s kept.
        let h = headers(&[("retry-after", "60, Sun,")]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(60)));
        // Nothing readable at all: absent.
        let h = headers(&[("retry-after", "soon, Sun,"), ("retry-after", "")]);
        assert_eq!(retry_after_header(&h, now), None);
    }

    fn headers(fields: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in fields {
            h.append(*name, HeaderValue::from_static(value));
        }
        h
    }

    #[test]
    fn a_date_is_counted_from_the_responses_date_not_the_local_clock() {
        // The client's clock runs 90 s fast: against it, a 60 s wait would be "now".
        let fast = example_date() + Duration::from_secs(90);
        let h = headers(&[
            ("date", "Sun, 06 Nov 1994 08:49:37 GMT"),
            ("retry-after", "Sun, 06 Nov 1994 08:50:37 GMT"),
        ]);
        assert_eq!(retry_after_header(&h, fast), Some(Duration::from_secs(60)));
        // Without a Date, the local clock is all there is.
        let h = headers(&[("retry-after", "Sun, 06 Nov 1994 08:50:37 GMT")]);
        assert_eq!(retry_after_header(&h, fast), Some(Duration::ZERO));
        // Seconds do not depend on either clock.
        let h = headers(&[
            ("date", "Sun, 06 Nov 1994 08:49:37 GMT"),
            ("retry-after", "5"),
        ]);
        assert_eq!(retry_after_header(&h, fast), Some(Duration::from_secs(5)));
    }

    #[test]
    fn a_repeated_retry_after_gives_its_longest_wait() {
        let now = SystemTime::now();
        let h = headers(&[("retry-after", "60"), ("retry-after", "60")]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(60)));
        let h = headers(&[("retry-after", "5"), ("retry-after", "60")]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(60)));
        let h = headers(&[("retry-after", "30, 60")]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(60)));
        // An unreadable line or piece is passed over: the readable wait stands.
        let h = headers(&[("retry-after", "3600"), ("retry-after", "garbage")]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(3600)));
        let h = headers(&[("retry-after", "3600"), ("retry-after", "")]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(3600)));
        let h = headers(&[("retry-after", "5,")]);
        assert_eq!(retry_after_header(&h, now), Some(Duration::from_secs(5)));
    }

    #[test]
    fn non_utf8_bytes_are_absent() {
        let value = HeaderValue::from_bytes(b"\xff12").unwrap();
        assert_eq!(retry_after(&value, SystemTime::now()), None);
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        assert_eq!(
            retry_after(" 30\t", SystemTime::now()),
            Some(Duration::from_secs(30))
        );
    }

    #[test]
    fn imf_fixdate_is_a_wait_until_that_moment() {
        let wait = retry_after("Sun, 06 Nov 1994 08:49:37 GMT", before_example(90));
        assert_eq!(wait, Some(Duration::from_secs(90)));
    }

    #[test]
    fn obsolete_rfc850_date_is_accepted() {
        let wait = retry_after("Sunday, 06-Nov-94 08:49:37 GMT", before_example(90));
        assert_eq!(wait, Some(Duration::from_secs(90)));
    }

    #[test]
    fn obsolete_asctime_date_is_accepted() {
        let wait = retry_after("Sun Nov  6 08:49:37 1994", before_example(90));
        assert_eq!(wait, Some(Duration::from_secs(90)));
    }

    #[test]
    fn date_in_the_past_is_retry_now() {
        let later = example_date() + Duration::from_secs(3600);
        assert_eq!(
            retry_after("Sun, 06 Nov 1994 08:49:37 GMT", later),
            Some(Duration::ZERO)
        );
        // RFC 9110's own example, read by any client after 1999.
        let wait = retry_after("Fri, 31 Dec 1999 23:59:59 GMT", SystemTime::now());
        assert_eq!(wait, Some(Duration::ZERO));
    }

    #[test]
    fn date_equal_to_now_is_retry_now() {
        let wait = retry_after("Sun, 06 Nov 1994 08:49:37 GMT", example_date());
        assert_eq!(wait, Some(Duration::ZERO));
    }

    #[test]
    fn malformed_dates_are_absent() {
        let now = before_example(90);
        for bad in [
            "Sun, 06 Nov 1994 08:49:37",     // no zone
            "Sun, 06 Nov 1994 08:49:37 UTC", // wrong zone
            "Sun, 32 Nov 1994 08:49:37 GMT", // no such day
            "Sun, 06 Nov 1994 25:49:37 GMT", // no such hour
            "Mon, 06 Nov 1994 08:49:37 GMT", // wrong weekday
            "1994-11-06T08:49:37Z",          // ISO 8601 is not an HTTP-date
        ] {
            assert_eq!(retry_after(bad, now), None, "{bad:?}");
        }
    }

    #[test]
    fn header_map_lookup_reads_the_single_field() {
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after_header(&headers, SystemTime::now()), None);
        headers.insert(RETRY_AFTER, HeaderValue::from_static("42"));
        assert_eq!(
            retry_after_header(&headers, SystemTime::now()),
            Some(Duration::from_secs(42))
        );
    }
}
