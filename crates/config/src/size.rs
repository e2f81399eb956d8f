//! Sizes in the configuration: an integer and a unit, `B`, `KB`/`MB`/`GB` (powers of 1000) or
//! `KiB`/`MiB`/`GiB` (powers of 1024).

/// Parses `"10MiB"`, `"512KB"`, `"4096B"` into bytes.
pub(crate) fn parse_size(value: &str) -> Result<u64, String> {
    let digits = value.bytes().take_while(u8::is_ascii_digit).count();
    let unit: Option<u64> = match &value[digits..] {
        "B" => Some(1),
        "KB" => Some(1_000),
        "MB" => Some(1_000_000),
        "GB" => Some(1_000_000_000),
        "KiB" => Some(1 << 10),
        "MiB" => Some(1 << 20),
        "GiB" => Some(1 << 30),
        _ => None,
    };
    // Digits that overflow a u64 are a size all the same: too large, not malformed.
    let n = (digits > 0).then(|| value[..digits].parse::<u64>().ok());
    match (n, unit) {
        (Some(n), Some(unit)) => n
            .and_then(|n| n.checked_mul(unit))
            .ok_or_else(|| format!("\"{value}\" is too large")),
        _ => Err(format!(
            "\"{value}\" is not a size (write an integer and a unit: 512KiB, 10MiB, 1GiB, 100MB, 4096B)"
        )),
    }
}

/// Formats a size the way the configuration writes it (used by `sluice check`).
pub fn format_size(bytes: u64) -> String {
    for (unit, name) in [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")] {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{}{name}", bytes / unit);
        }
    }
    for (unit, name) in [(1_000_000_000, "GB"), (1_000_000, "MB"), (1_000, "KB")] {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{}{name}", bytes / unit);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_every_documented_unit() {
        assert_eq!(parse_size("4096B"), Ok(4096));
        assert_eq!(parse_size("512KB"), Ok(512_000));
        assert_eq!(parse_size("100MB"), Ok(100_000_000));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("512KiB"), Ok(512 * 1024));
        assert_eq!(parse_size("10MiB"), Ok(10 * 1024 * 1024));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
    }

    #[test]
    fn refuses_what_is_not_a_size() {
        for bad in [
            "",
            "10",
            "MiB",
            "10mb",
            "1.5MiB",
            "10 MiB",
            "-1B",
            "99999999999GiB",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes_past_u64_are_too_large_not_malformed() {
        for big in [
            "18446744073709551616B",
            "99999999999GiB",
            "99999999999999999999999KiB",
        ] {
            assert_eq!(
                parse_size(big),
                Err(format!("\"{big}\" is too large")),
                "{big}"
            );
        }
        assert_eq!(parse_size("18446744073709551615B"), Ok(u64::MAX));
    }

    #[test]
    fn formats_round_trip() {
        for n in [1 << 30, 10 << 20, 512 << 10, 100_000_000, 1_000, 999] {
            assert_eq!(parse_size(&format_size(n)), Ok(n), "{n}");
        }
    }
}
