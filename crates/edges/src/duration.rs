//! The one duration syntax of every flag, environment variable and
//! configuration key: a bare number is seconds (`3`, `2.5`, as dhclient and
//! udhcpc users type them), or humantime units (`10s`, `1m30s`, `500ms`).
//! Also the one wait for an optional deadline ([`sleep_until`]) that the
//! event loops select on. A leaf: it imports nothing of the crate, so any
//! layer may use it.

use std::time::Duration;

/// Sleeps until `at`; with no deadline, never wakes (a `select!` arm that
/// is off until there is one).
pub async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The accepted forms, for error messages and help texts.
pub(crate) const FORMS: &str =
    "seconds as a bare number (\"3\", \"2.5\") or with units (\"10s\", \"1m30s\", \"500ms\")";

/// A value that is not a duration: it names the value and the accepted
/// forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{value}` is not a duration ({why}); write {FORMS}")]
pub struct DurationError {
    value: String,
    why: String,
}

/// Parses a duration; the error names the value and the accepted forms.
/// Usable as a clap `value_parser`.
pub fn parse_duration(v: &str) -> Result<Duration, DurationError> {
    let t = v.trim();
    let refuse = |why: &str| {
        Err(DurationError {
            value: v.to_string(),
            why: why.to_string(),
        })
    };
    if t.is_empty() {
        return refuse("empty");
    }
    if t.starts_with('-') {
        return refuse("negative");
    }
    if t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return match seconds(t) {
            Some(d) => Ok(d),
            None => refuse("not a number of seconds"),
        };
    }
    humantime::parse_duration(t).or_else(|e| refuse(&e.to_string()))
}

/// `3`, `2.5`, `0.001`, `.5`, `5.` as exact seconds (nanosecond precision);
/// `None` for anything else or a value too large for a `Duration`.
fn seconds(t: &str) -> Option<Duration> {
    let (whole, frac) = t.split_once('.').unwrap_or((t, ""));
    if (whole.is_empty() && frac.is_empty()) || frac.contains('.') || frac.len() > 9 {
        return None;
    }
    let secs: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let nanos: u32 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<9}").parse().ok()?
    };
    Some(Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_numbers_are_seconds() {
        for (text, want) in [
            ("3", Duration::from_secs(3)),
            ("0", Duration::ZERO),
            ("2.5", Duration::from_millis(2500)),
            (" 10 ", Duration::from_secs(10)),
            ("0.001", Duration::from_millis(1)),
            (".5", Duration::from_millis(500)),
            ("5.", Duration::from_secs(5)),
            ("1.000000001", Duration::new(1, 1)),
            ("86400", Duration::from_secs(86_400)),
        ] {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn units_keep_working() {
        for (text, want) in [
            ("3s", Duration::from_secs(3)),
            ("1m30s", Duration::from_secs(90)),
            ("500ms", Duration::from_millis(500)),
            ("2h", Duration::from_secs(7200)),
            ("1m 30s", Duration::from_secs(90)),
        ] {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn everything_else_is_refused_naming_the_forms() {
        for text in [
            "",
            "  ",
            "-3",
            "-2.5",
            "-1s",
            "NaN",
            "nan",
            "inf",
            "1e3",
            "+3",
            "soon",
            "3 parsecs",
            "1.2.3",
            ".",
            "0.0000000001",
            "3,5",
            "99999999999999999999",
        ] {
            let err = parse_duration(text).expect_err(text).to_string();
            assert!(err.contains(&format!("`{text}`")), "{err}");
            assert!(
                err.contains("bare number") && err.contains("\"1m30s\""),
                "{text}: {err}"
            );
        }
        assert!(
            parse_duration("-3")
                .unwrap_err()
                .to_string()
                .contains("negative")
        );
        assert!(
            parse_duration("")
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        // humantime's own reason stays in the message.
        assert!(
            parse_duration("3 parsecs")
                .unwrap_err()
                .to_string()
                .contains("unknown time unit")
        );
    }
}
