//! HTTP-date (RFC 9110 section 5.6.7): IMF-fixdate and the two obsolete forms a recipient must
//! accept, read exactly as the grammar writes them.
//!
//! Written here rather than taken from `httpdate`, which refuses two things the grammar allows:
//! a leap second (`23:59:60`) and years before 1970. A server that sends either would have had
//! its `Retry-After` read as absent, so the caller fell back to its own backoff instead of the
//! wait asked for (found by review).

use std::time::{Duration, SystemTime};

const DAYS: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
const LONG_DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// Whether `text` is a day name, short (`Sun`) or long (`Sunday`): the part of an HTTP-date
/// before its comma.
pub(crate) fn is_day_name(text: &str) -> bool {
    DAYS.contains(&text) || LONG_DAYS.contains(&text)
}

/// The moment `text` names, if it is an HTTP-date in one of the three forms. `now` places an
/// RFC 850 date's two-digit year: the latest year with those digits whose date is at most 50
/// years after `now` (RFC 9110: a date that "appears to be more than 50 years in the future"
/// is in the past), the moment compared, not only the year. Names of days and months are
/// case-sensitive, and the day name must be the date's (in the year so placed).
pub(crate) fn parse(text: &str, now: SystemTime) -> Option<SystemTime> {
    let date = if let Some((day, rest)) = text.split_once(", ") {
        if let Some(weekday) = DAYS.iter().position(|d| *d == day) {
            imf_fixdate(rest.as_bytes(), weekday)?
        } else {
            let weekday = LONG_DAYS.iter().position(|d| *d == day)?;
            let mut date = rfc850(rest.as_bytes(), weekday, year_of(now))?;
            date.place_within_fifty_years_of(now);
            date
        }
    } else {
        asctime(text.as_bytes())?
    };
    date.moment()
}

/// The parts of a date, checked as it is read.
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    weekday: usize,
    seconds: u32,
}

impl Civil {
    /// Moves a two-digit year by centuries to the latest one whose date is at most 50 years
    /// (of 365.2425 days) after `now`.
    fn place_within_fifty_years_of(&mut self, now: SystemTime) {
        const FIFTY_YEARS: i64 = 50 * 31_556_952;
        let limit = seconds_of(now).saturating_add(FIFTY_YEARS);
        let at = |year: i64| {
            let days = days_from_civil(year, self.month, self.day);
            days.saturating_mul(86_400)
                .saturating_add(i64::from(self.seconds))
        };
        // The year starts in `now`'s century: two steps either way reach any placing. Bounded,
        // since far from the epoch both sides saturate alike.
        for _ in 0..2 {
            if at(self.year) > limit {
                self.year -= 100;
            }
        }
        for _ in 0..2 {
            if at(self.year + 100) <= limit {
                self.year += 100;
            }
        }
    }

    /// The moment, if the day exists in its month and the day name is right.
    fn moment(&self) -> Option<SystemTime> {
        if self.day == 0 || self.day > days_in_month(self.year, self.month) {
            return None;
        }
        let days = days_from_civil(self.year, self.month, self.day);
        // 1970-01-01 was a Thursday (index 3).
        if (days + 3).rem_euclid(7) as usize != self.weekday {
            return None;
        }
        let secs = days
            .checked_mul(86_400)?
            .checked_add(i64::from(self.seconds))?;
        if secs >= 0 {
            SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs.unsigned_abs()))
        } else {
            SystemTime::UNIX_EPOCH.checked_sub(Duration::from_secs(secs.unsigned_abs()))
        }
    }
}

/// `06 Nov 1994 08:49:37 GMT`, after `Sun, `.
fn imf_fixdate(b: &[u8], weekday: usize) -> Option<Civil> {
    if b.len() != 24 || b[2] != b' ' || b[6] != b' ' || b[11] != b' ' || &b[20..] != b" GMT" {
        return None;
    }
    Some(Civil {
        day: digits(&b[0..2])?,
        month: month(&b[3..6])?,
        year: i64::from(digits(&b[7..11])?),
        weekday,
        seconds: time_of_day(&b[12..20])?,
    })
}

/// `06-Nov-94 08:49:37 GMT`, after `Sunday, `: the year in `this_year`'s century, for
/// [`Civil::place_within_fifty_years_of`] to place.
fn rfc850(b: &[u8], weekday: usize, this_year: i64) -> Option<Civil> {
    if b.len() != 22 || b[2] != b'-' || b[6] != b'-' || b[9] != b' ' || &b[18..] != b" GMT" {
        return None;
    }
    let two = i64::from(digits(&b[7..9])?);
    let year = this_year - this_year.rem_euclid(100) + two;
    Some(Civil {
        day: digits(&b[0..2])?,
        month: month(&b[3..6])?,
        year,
        weekday,
        seconds: time_of_day(&b[10..18])?,
    })
}

/// `Sun Nov  6 08:49:37 1994` (the day of the month is two digits or a space and one).
fn asctime(b: &[u8]) -> Option<Civil> {
    if b.len() != 24 || b[3] != b' ' || b[7] != b' ' || b[10] != b' ' || b[19] != b' ' {
        return None;
    }
    let weekday = DAYS.iter().position(|d| d.as_bytes() == &b[0..3])?;
    let day = match b[8] {
        b' ' => digits(&b[9..10])?,
        _ => digits(&b[8..10])?,
    };
    Some(Civil {
        day,
        month: month(&b[4..7])?,
        year: i64::from(digits(&b[20..24])?),
        weekday,
        seconds: time_of_day(&b[11..19])?,
    })
}

/// `hh:mm:ss` as seconds into the day: hours to 23, minutes to 59, seconds to 60 (a leap
/// second, which reads as the next minute's first).
fn time_of_day(b: &[u8]) -> Option<u32> {
    if b.len() != 8 || b[2] != b':' || b[5] != b':' {
        return None;
    }
    let (h, m, s) = (digits(&b[0..2])?, digits(&b[3..5])?, digits(&b[6..8])?);
    (h <= 23 && m <= 59 && s <= 60).then_some(h * 3600 + m * 60 + s)
}

/// ASCII digits only (no sign, no space), as a number.
fn digits(b: &[u8]) -> Option<u32> {
    b.iter().try_fold(0u32, |n, &d| {
        d.is_ascii_digit().then(|| n * 10 + u32::from(d - b'0'))
    })
}

/// 1 to 12.
fn month(b: &[u8]) -> Option<u32> {
    let i = MONTHS.iter().position(|m| m.as_bytes() == b)?;
    u32::try_from(i + 1).ok()
}

fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to the given proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Seconds from 1970-01-01 to `now` (negative before), saturating far out.
fn seconds_of(now: SystemTime) -> i64 {
    match now.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_secs()).map_or(i64::MIN, |s| -s),
    }
}

/// The year (UTC) of `now`.
fn year_of(now: SystemTime) -> i64 {
    let days = match now.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs() / 86_400).unwrap_or(i64::MAX / 2),
        Err(e) => -i64::try_from(e.duration().as_secs().div_ceil(86_400)).unwrap_or(i64::MAX / 2),
    };
    // Hinnant's `civil_from_days`, year only.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let year = yoe + era * 400;
    if mp >= 10 {
        year + 1
    } else {
        year
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> SystemTime {
        if secs >= 0 {
            SystemTime::UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
        } else {
            SystemTime::UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
        }
    }

    /// 2026-12-01.
    fn now() -> SystemTime {
        at(1_796_083_200)
    }

    #[test]
    fn the_three_forms_name_the_same_moment() {
        for text in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(parse(text, now()), Some(at(784_111_777)), "{text}");
        }
    }

    #[test]
    fn agrees_with_httpdate_where_httpdate_reads_a_date() {
        // Every day from 1970 to 2100 at a varying time, in the fixed form.
        let mut secs: u64 = 0;
        while secs < 4_102_444_800 {
            let t = SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
            let text = httpdate::fmt_http_date(t);
            assert_eq!(parse(&text, now()), Some(t), "{text}");
            secs += 86_400 + 3_607;
        }
    }

    #[test]
    fn a_leap_second_and_years_before_1970_are_dates() {
        assert_eq!(
            parse("Sat, 31 Dec 2016 23:59:60 GMT", now()),
            Some(at(1_483_228_800))
        );
        assert_eq!(
            parse("Sun, 06 Nov 1960 08:49:37 GMT", now()),
            Some(at(-288_803_423))
        );
        assert_eq!(
            parse("Mon, 01 Jan 0001 00:00:00 GMT", now()),
            Some(at(-62_135_596_800))
        );
    }

    #[test]
    fn two_digit_years_fall_within_fifty_years_of_now() {
        // In 2026: 76 is 2076 (50 years ahead), 77 is 1977, 00 is 2000.
        let year = |text: &str| {
            let t = parse(text, now()).unwrap();
            year_of(t)
        };
        assert_eq!(year("Wednesday, 01-Jan-76 00:00:00 GMT"), 2076);
        assert_eq!(year("Saturday, 01-Jan-77 00:00:00 GMT"), 1977);
        assert_eq!(year("Saturday, 01-Jan-00 00:00:00 GMT"), 2000);
        // The moment decides, not the year alone (review): on 2026-12-01, 30-Nov-76 is 49.99
        // years ahead (2076), 02-Dec-76 50.003 (1976, a Thursday).
        assert_eq!(year("Monday, 30-Nov-76 00:00:00 GMT"), 2076);
        assert_eq!(year("Thursday, 02-Dec-76 00:00:00 GMT"), 1976);
        assert_eq!(
            parse("Wednesday, 02-Dec-76 00:00:00 GMT", now()),
            None,
            "2076's weekday"
        );
        // On 2026-01-01, 31-Dec-76 is 1976-12-31, a Friday, in the past.
        let new_year = at(1_767_225_600);
        assert_eq!(
            parse("Friday, 31-Dec-76 23:59:59 GMT", new_year),
            Some(at(220_924_799))
        );
        // Far from the epoch either way, placing ends (and panics on nothing).
        for secs in [i64::MAX, i64::MAX / 2, i64::MIN / 2, -62_135_596_800] {
            let span = Duration::from_secs(secs.unsigned_abs());
            let far = match secs >= 0 {
                true => SystemTime::UNIX_EPOCH.checked_add(span),
                false => SystemTime::UNIX_EPOCH.checked_sub(span),
            };
            if let Some(far) = far {
                let _ = parse("Sunday, 06-Nov-94 08:49:37 GMT", far);
            }
        }
    }

    #[test]
    fn what_the_grammar_does_not_allow_is_refused() {
        for bad in [
            "Sun, 06 Nov 1994 08:49:37",        // no zone
            "Sun, 06 Nov 1994 08:49:37 UTC",    // wrong zone
            "Sun, 6 Nov 1994 08:49:37 GMT",     // one-digit day
            "sun, 06 Nov 1994 08:49:37 GMT",    // case
            "Sun, 06 nov 1994 08:49:37 GMT",    // case
            "Mon, 06 Nov 1994 08:49:37 GMT",    // wrong weekday
            "Thu, 29 Feb 2001 00:00:00 GMT",    // no such day
            "Sun, 31 Nov 1994 00:00:00 GMT",    // no such day
            "Sun, 06 Nov 1994 24:00:00 GMT",    // no such hour
            "Sun, 06 Nov 1994 08:60:00 GMT",    // no such minute
            "Sun, 06 Nov 1994 08:49:61 GMT",    // no such second
            "Sun, 06 Nov 1994 08:49:37 GMT ",   // trailing space
            "Sun, 06 Nov +994 08:49:37 GMT",    // sign
            "Sun, 06-Nov-94 08:49:37 GMT",      // short name, RFC 850 date
            "Sunday, 06 Nov 1994 08:49:37 GMT", // long name, fixed date
            "Sun Nov 06 08:49:37 1994 GMT",     // asctime has no zone
            "1994-11-06T08:49:37Z",
            "",
        ] {
            assert_eq!(parse(bad, now()), None, "{bad:?}");
        }
    }

    #[test]
    fn day_names_are_recognised_for_splitting_lists() {
        assert!(is_day_name("Sun") && is_day_name("Wednesday"));
        assert!(!is_day_name("sun") && !is_day_name("60") && !is_day_name(" Sun"));
    }
}
