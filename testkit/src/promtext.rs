//! The Prometheus text format, read: for benches that take their figures
//! from a server's own `/metrics` (kube-apiserver, etcd) rather than from
//! what the product says of itself.

use std::collections::BTreeMap;

/// The verbs of kube-apiserver's request metrics that write.
pub const WRITING_VERBS: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "DELETE",
    "APPLY",
    "DELETECOLLECTION",
];

/// Whether a kube-apiserver request sample counts writes.
pub fn is_write(s: &Sample) -> bool {
    s.labels
        .get("verb")
        .is_some_and(|v| WRITING_VERBS.contains(&v.as_str()))
}

/// One sample of a Prometheus text exposition.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Every sample of `text`; lines it cannot read are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some(split) = line.find(['{', ' ']) else {
            continue;
        };
        let (name, rest) = line.split_at(split);
        let (labels, rest) = match rest.strip_prefix('{') {
            Some(body) => match parse_labels(body) {
                Some(parsed) => parsed,
                None => continue,
            },
            None => (BTreeMap::new(), rest),
        };
        let Some(value) = rest.split_whitespace().next().and_then(|v| v.parse().ok()) else {
            continue;
        };
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    out
}

/// `a="1",b="x\"y"}` and what follows the `}`.
fn parse_labels(body: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    let mut rest = body;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let (key, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.to_string(), value);
        rest = &after[end + 1..];
    }
}

/// The sum of the samples named `name` that `keep` keeps.
pub fn sum(samples: &[Sample], name: &str, keep: impl Fn(&Sample) -> bool) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name && keep(s))
        .map(|s| s.value)
        .sum()
}

/// `histogram_quantile` over cumulative `(le, count)` buckets: linear
/// within the bucket the rank falls in.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower);
            }
            let within = (rank - below) / (count - below).max(f64::MIN_POSITIVE);
            return Some(lower + (le - lower) * within);
        }
        (lower, below) = (le, count);
    }
    Some(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_with_commas_and_quotes() {
        let m = parse("# HELP x\nx{a=\"1,2\",b=\"q\\\"\"} 3\ny 4.5\nz{le=\"+Inf\"} 7 1700000000\n");
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].labels["a"], "1,2");
        assert_eq!(m[0].labels["b"], "q\"");
        assert_eq!(m[0].value, 3.0);
        assert_eq!(m[1].name, "y");
        assert_eq!(m[2].labels["le"], "+Inf");
        assert_eq!(m[2].value, 7.0);
    }

    #[test]
    fn quantile_interpolates_within_the_bucket() {
        let b = [(0.1, 50.0), (0.2, 100.0), (f64::INFINITY, 100.0)];
        assert!((quantile(&b, 0.5).unwrap() - 0.1).abs() < 1e-9);
        assert!((quantile(&b, 0.99).unwrap() - 0.198).abs() < 1e-9);
        assert_eq!(quantile(&[(0.1, 0.0)], 0.99), None);
    }
}
