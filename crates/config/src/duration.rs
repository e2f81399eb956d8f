//! Durations as written in sluice's TOML: an integer and a unit, `500ms`, `2s`, `10m`, `1h`, `1d`.

use std::time::Duration;

/// Parses `500ms`, `2s`, `10m`, `1h` or `1d`. On failure, returns the message to show,
/// naming the value and, where the intent is clear, what to write instead.
pub(crate) fn parse_duration(value: &str) -> Result<Duration, String> {
    strict(value).ok_or_else(|| {
        if well_formed(value) {
            return format!("\"{value}\" is too long: at most 36500d (100 years)");
        }
        match suggestion(value) {
            Some(fix) => format!("\"{value}\" is not a duration (try \"{fix}\")"),
            None => format!(
                "\"{value}\" is not a duration (write an integer and a unit: 500ms, 2s, 10m, 1h, 1d)"
            ),
        }
    })
}

/// [`parse_duration`] for a duration in whole seconds: a value such as `"1.5s"` is told it
/// must be whole seconds (`why`), not pointed at a millisecond form it would refuse next.
pub(crate) fn parse_whole_seconds(value: &str, why: &str) -> Result<Duration, String> {
    let whole = |d: Duration| d.subsec_nanos() == 0;
    match parse_duration(value) {
        Ok(d) if !whole(d) => Err(format!(
            "\"{value}\" is not a whole number of seconds: {why}"
        )),
        Err(_) if suggestion(value).is_some_and(|fix| strict(&fix).is_some_and(|d| !whole(d))) => {
            Err(format!(
                "\"{value}\" is not a duration, nor a whole number of seconds: {why}"
            ))
        }
        other => other,
    }
}

/// Digits and a unit, as [`strict`] reads them, whatever their size.
fn well_formed(value: &str) -> bool {
    let digits = value.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && matches!(&value[digits..], "ms" | "s" | "m" | "h" | "d")
}

fn strict(value: &str) -> Option<Duration> {
    let digits = value.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return None;
    }
    let n: u64 = value[..digits].parse().ok()?;
    let unit_ms: u64 = match &value[digits..] {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    n.checked_mul(unit_ms).map(Duration::from_millis)
}

/// "1 minute" -> "60s", "250 millis" -> "250ms", "1.5s" -> "1500ms".
fn suggestion(value: &str) -> Option<String> {
    let v = value.trim().to_ascii_lowercase();
    let split = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    let number: f64 = v[..split].parse().ok()?;
    let unit = v[split..].trim();
    let ms_per_unit = match unit {
        "" | "s" | "sec" | "secs" | "second" | "seconds" => 1_000.0,
        "ms" | "msec" | "millis" | "millisecond" | "milliseconds" => 1.0,
        "m" | "min" | "mins" | "minute" | "minutes" => 60_000.0,
        "h" | "hr" | "hrs" | "hour" | "hours" => 3_600_000.0,
        "d" | "day" | "days" => 86_400_000.0,
        _ => return None,
    };
    let ms = number * ms_per_unit;
    if !(ms.is_finite() && ms >= 0.0 && ms.fract() == 0.0 && ms < 1e15) {
        return None;
    }
    let ms = ms as u64;
    Some(if ms % 1_000 == 0 {
        format!("{}s", ms / 1_000)
    } else {
        format!("{ms}ms")
    })
}

/// Formats a duration the way the configuration writes it (used by `sluice check`).
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0 => "0s".to_owned(),
        _ if ms % 86_400_000 == 0 => format!("{}d", ms / 86_400_000),
        _ if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        _ if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        _ if ms % 1_000 == 0 => format!("{}s", ms / 1_000),
        _ => format!("{ms}ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_every_documented_unit() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86_400)));
    }

    #[test]
    fn words_get_a_suggestion() {
        assert_eq!(
            parse_duration("1 minute").unwrap_err(),
            "\"1 minute\" is not a duration (try \"60s\")"
        );
        assert!(parse_duration("1.5s")
            .unwrap_err()
            .contains("try \"1500ms\""));
        assert!(parse_duration("60").unwrap_err().contains("try \"60s\""));
    }

    #[test]
    fn garbage_is_refused_without_a_guess() {
        for bad in ["", "s", "-1s", "1 fortnight", "1e400s"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(
                e.starts_with(&format!("\"{bad}\" is not a duration")),
                "{e}"
            );
        }
        // Well formed, only too large for any duration: told so, not how to write one.
        assert_eq!(
            parse_duration("99999999999999999999d").unwrap_err(),
            "\"99999999999999999999d\" is too long: at most 36500d (100 years)"
        );
    }

    #[test]
    fn formatting_round_trips() {
        for s in ["500ms", "2s", "10m", "1h", "1d", "90s"] {
            assert_eq!(format_duration(parse_duration(s).unwrap()), s);
        }
    }
}
