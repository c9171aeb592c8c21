//! Kubernetes naming rules (object names, label keys and values) and the
//! well-known topology label keys, as the API server enforces and defines
//! them.
//!
//! A leaf: it imports nothing from the crate, so both the configuration
//! (which validates names before anything runs) and the topology relay
//! (which checks what it is about to write) can use it.

/// The label keys the topology relay carries unless configured otherwise:
/// what Harvester copies from its host Nodes into each VMI's annotations.
pub const DEFAULT_TOPOLOGY_KEYS: &[&str] = &[
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
];

/// A DNS-1123 subdomain: what the API server accepts for Node names and
/// label-key prefixes.
pub fn is_dns_subdomain(v: &str) -> bool {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    !v.is_empty() && v.len() <= 253 && v.split('.').all(label_ok)
}

/// Kubernetes label values: empty, or at most 63 characters of
/// `[A-Za-z0-9._-]` beginning and ending with an alphanumeric.
pub fn is_label_value(v: &str) -> bool {
    if v.is_empty() {
        return true;
    }
    let b = v.as_bytes();
    v.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// A label key Kubernetes would refuse, and which part of it is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{key}` is not a label key: {why}")]
pub struct InvalidLabelKey {
    key: String,
    why: &'static str,
}

/// Kubernetes label keys: an optional DNS-subdomain prefix and `/`, then a
/// name of at most 63 characters of `[A-Za-z0-9._-]` beginning and ending
/// with an alphanumeric. The error says which part is wrong.
pub fn validate_label_key(key: &str) -> Result<(), InvalidLabelKey> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let bad = |why: &'static str| {
        Err(InvalidLabelKey {
            key: key.to_string(),
            why,
        })
    };
    if name.is_empty() || name.len() > 63 {
        return bad("the name part must be 1 to 63 characters");
    }
    let n = name.as_bytes();
    if !n[0].is_ascii_alphanumeric()
        || !n[n.len() - 1].is_ascii_alphanumeric()
        || !n
            .iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
    {
        return bad(
            "the name part may hold letters, digits, '-', '_' and '.', and must begin and end with a letter or digit",
        );
    }
    if let Some(p) = prefix
        && !is_dns_subdomain(p)
    {
        return bad("the prefix must be a DNS subdomain (lowercase letters, digits, '-' and '.')");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_subdomains() {
        let long_label = "a".repeat(63);
        let at_limit = [
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(61),
        ]
        .join(".");
        assert_eq!(at_limit.len(), 253);
        for ok in [
            "guest-1",
            "a",
            "0",
            "node.example.com",
            long_label.as_str(),
            at_limit.as_str(),
        ] {
            assert!(is_dns_subdomain(ok), "{ok}");
        }
        let too_long_label = "a".repeat(64);
        let too_long = format!("{at_limit}x");
        for bad in [
            "",
            "Guest-1",
            "guest_1",
            "-guest",
            "guest-",
            "a..b",
            ".a",
            "a.",
            "a.-b",
            "a b",
            "gäst",
            too_long_label.as_str(),
            too_long.as_str(),
        ] {
            assert!(!is_dns_subdomain(bad), "{bad:?}");
        }
    }

    #[test]
    fn label_keys() {
        for ok in [
            "topology.kubernetes.io/region",
            "topology.kubernetes.io/zone",
            "rack",
            "Rack_1.a-b",
            "example.com/a.b_c-d",
        ] {
            assert!(validate_label_key(ok).is_ok(), "{ok}");
        }
        for (bad, part) in [
            ("", "name part must be 1 to 63"),
            ("x/", "name part must be 1 to 63"),
            (&"a".repeat(64), "name part must be 1 to 63"),
            ("zone-", "must begin and end"),
            ("_zone", "must begin and end"),
            ("a b", "must begin and end"),
            ("a/b/c", "must begin and end"),
            ("/zone", "prefix must be a DNS subdomain"),
            ("Example.com/zone", "prefix must be a DNS subdomain"),
        ] {
            let err = validate_label_key(bad).expect_err(bad).to_string();
            assert!(
                err.starts_with(&format!("`{bad}` is not a label key")),
                "{err}"
            );
            assert!(err.contains(part), "{bad:?}: {err}");
        }
    }

    #[test]
    fn label_values() {
        let longest = "a".repeat(63);
        for ok in ["us-east-1a", "", "A", "a.b_c-d", longest.as_str()] {
            assert!(is_label_value(ok), "{ok:?}");
        }
        let too_long = "a".repeat(64);
        for bad in ["-a", "a-", ".a", "a b", "a/b", "zoné", too_long.as_str()] {
            assert!(!is_label_value(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_default_topology_keys_are_label_keys() {
        assert_eq!(DEFAULT_TOPOLOGY_KEYS.len(), 2);
        for k in DEFAULT_TOPOLOGY_KEYS {
            assert!(validate_label_key(k).is_ok(), "{k}");
        }
    }
}
