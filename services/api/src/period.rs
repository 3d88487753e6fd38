//! Times and periods as people write them: every query parameter and CLI flag that takes a
//! time reads a date (`2026-11-01`, midnight UTC), an RFC 3339 date-time
//! (`2026-11-01T08:00:00Z`, `2026-11-01T09:00:00+01:00`), milliseconds since the epoch, or a
//! span (`2h`, `90m`, `1d 12h`) meaning that long before now by the server's clock, so a client
//! never needs its own.

use ledger::book::Granularity;

use crate::Problem;

/// What a time may look like, for error messages.
pub const INSTANT_FORMS: &str = "a date (2026-11-01), an RFC 3339 date-time (2026-11-01T08:00:00Z), milliseconds since the epoch or a span before now (2h, 1d 12h)";

/// Reads a time, a span being that long before `now_ms`: see the [module](self) documentation.
pub fn parse_instant(text: &str, now_ms: u64) -> Result<u64, String> {
    let text = text.trim();
    let bad = || format!("{text:?} is not {INSTANT_FORMS}");
    // Bare digits are milliseconds since the epoch (a span needs its unit).
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text
            .parse()
            .ok()
            .filter(|&ms| ms <= ledger::book::MAX_TIME_MS)
            .ok_or_else(|| format!("{text:?} is not {INSTANT_FORMS} before the year 10000"));
    }
    if let Ok(span) = humantime::parse_duration(text) {
        let ms = u64::try_from(span.as_millis()).unwrap_or(u64::MAX);
        return Ok(now_ms.saturating_sub(ms));
    }
    let nanos = if text.len() == 10 {
        let date = time::Date::parse(
            text,
            time::macros::format_description!("[year]-[month]-[day]"),
        )
        .map_err(|_| bad())?;
        date.midnight().assume_utc().unix_timestamp_nanos()
    } else {
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
            .map_err(|_| bad())?
            .unix_timestamp_nanos()
    };
    u64::try_from(nanos / 1_000_000).map_err(|_| format!("{text:?} is before 1970"))
}

/// A time in RFC 3339, in UTC, to the second (or finer when it has a fraction).
pub fn format_instant(ms: u64) -> String {
    rfc3339(ms, false)
}

/// An instant for people: RFC 3339 in UTC, to the second (`2026-12-03T16:31:57Z`).
pub fn date(ms: u64) -> String {
    rfc3339(ms, true)
}

fn rfc3339(ms: u64, to_the_second: bool) -> String {
    let nanos = i128::from(ms) * 1_000_000;
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|t| {
            if to_the_second {
                t.replace_nanosecond(0).ok()
            } else {
                Some(t)
            }
        })
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| format!("{ms} ms after the epoch"))
}

/// The query parameter `field` read as a time (a span before `now_ms`), or a problem naming it.
pub fn instant_param(
    field: &str,
    value: Option<&str>,
    now_ms: u64,
) -> Result<Option<u64>, Problem> {
    value
        .map(|v| parse_instant(v, now_ms).map_err(|e| Problem::invalid(field, e)))
        .transpose()
}

/// The period `[from, to)` a query asks for, on boundaries of `align`: `to` defaults to (and
/// stops at) `now`, `from` to `default_span_ms` before `to`; `from` goes back to the start of its
/// period and `to` on to the end of its own, unless that is past `now`.
pub fn period(
    from: Option<&str>,
    to: Option<&str>,
    default_span_ms: u64,
    align: Granularity,
    now: u64,
) -> Result<(u64, u64), Problem> {
    let to_asked = instant_param("to", to, now)?;
    let from_asked = instant_param("from", from, now)?;
    if let (Some(f), Some(t)) = (from_asked, to_asked) {
        if t <= f {
            return Err(Problem::invalid(
                "to",
                format!(
                    "the period must end after it starts: from {} to {}",
                    format_instant(f),
                    format_instant(t)
                ),
            ));
        }
    }
    let to = to_asked.map_or(now, |t| align.ceil(t.min(now)).min(now));
    let from = align.start_of(from_asked.unwrap_or(to.saturating_sub(default_span_ms)));
    if from >= to {
        return Err(Problem::invalid(
            if to_asked.is_some() { "to" } else { "from" },
            format!(
                "the period must end after it starts and before now: from {} to {}",
                format_instant(from),
                format_instant(to)
            ),
        ));
    }
    Ok((from, to))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_as_people_write_them() {
        assert_eq!(parse_instant("2026-11-01", 0), Ok(1_793_491_200_000));
        assert_eq!(
            parse_instant("2026-11-01T08:00:00Z", 0),
            Ok(1_793_520_000_000)
        );
        assert_eq!(
            parse_instant("2026-11-01T09:00:00+01:00", 0),
            Ok(1_793_520_000_000)
        );
        assert_eq!(
            parse_instant("2026-11-01T08:00:00.250Z", 0),
            Ok(1_793_520_000_250)
        );
        assert_eq!(parse_instant("1793520000000", 0), Ok(1_793_520_000_000));
        assert_eq!(
            parse_instant("0", 5),
            Ok(0),
            "digits are milliseconds, not a span"
        );
        // A span is that long before now, by the server's clock.
        let now = 1_793_520_000_000;
        assert_eq!(parse_instant("2h", now), Ok(now - 7_200_000));
        assert_eq!(parse_instant("1d 12h", now), Ok(now - 129_600_000));
        assert_eq!(parse_instant("90m", 1_000), Ok(0), "not before the epoch");
        for bad in [
            "",
            "yesterday",
            "2026-13-01",
            "2026-11-01T08:00",
            "-5",
            "2026-11-1",
        ] {
            let e = parse_instant(bad, 0).unwrap_err();
            assert!(e.contains("RFC 3339"), "{bad:?}: {e}");
        }
        assert_eq!(format_instant(1_793_520_000_000), "2026-11-01T08:00:00Z");
    }

    #[test]
    fn periods_align_to_calendar_boundaries_and_stop_at_now() {
        let now = parse_instant("2026-11-04T13:25:00Z", 0).unwrap();
        let (from, to) =
            period(Some("2026-11-01T05:10:00Z"), None, 0, Granularity::Day, now).unwrap();
        assert_eq!(from, parse_instant("2026-11-01", 0).unwrap());
        assert_eq!(to, now);
        let (from, to) = period(
            Some("2026-11-02T05:00:00Z"),
            Some("2026-11-02T07:30:00Z"),
            0,
            Granularity::Hour,
            now,
        )
        .unwrap();
        assert_eq!(from, parse_instant("2026-11-02T05:00:00Z", 0).unwrap());
        assert_eq!(to, parse_instant("2026-11-02T08:00:00Z", 0).unwrap());
        let e = period(Some("2026-11-05"), None, 0, Granularity::Day, now).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("from"));
        let e = period(Some("soon"), None, 0, Granularity::Day, now).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("from"));
        // The far future is now; the end of the calendar does not panic.
        let (_, to) = period(None, Some("9999-12-31"), 0, Granularity::Month, now).unwrap();
        assert_eq!(to, now);
    }
}
