//! Writing metric families computed at scrape time (a component's live
//! state read as a snapshot) through `prometheus-client`'s encoder, which
//! escapes label values and writes OpenMetrics text.

use std::fmt;

use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, EncodeMetric,
    MetricEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

/// The `Content-Type` of what [`encode`] writes.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A label set of a family computed at scrape time.
pub type Labels = Vec<(&'static str, String)>;

/// The registry's OpenMetrics text, `# EOF` included.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String fails only if a collector fails, and ours write
    // to the same String.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        tracing::warn!(error = %e, "could not encode the metrics");
    }
    out
}

/// One family of gauges written by a collector: `name` (with `unit`'s
/// suffix), one sample per label set.
pub fn gauges<L: EncodeLabelSet, N: EncodeGaugeValue + std::fmt::Debug>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    samples: impl IntoIterator<Item = (L, N)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, unit.as_ref(), MetricType::Gauge)?;
    for (labels, value) in samples {
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A single unlabelled gauge.
pub fn gauge<N: EncodeGaugeValue + std::fmt::Debug>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    value: N,
) -> fmt::Result {
    let family = encoder.encode_descriptor(name, help, unit.as_ref(), MetricType::Gauge)?;
    ConstGauge::new(value).encode(family)
}

/// One family of counters (`name` without `_total`: the encoder adds it).
pub fn counters<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, u64)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in samples {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A single unlabelled counter (`u64`, or `f64` for a fractional
/// quantity such as CPU seconds).
pub fn counter<N: EncodeCounterValue + std::fmt::Debug>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: N,
) -> fmt::Result {
    let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(value).encode(family)
}

/// An info metric: `name` without `_info`, which the encoder adds; the
/// facts as labels, the value 1.
pub fn info(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    labels: &impl EncodeLabelSet,
) -> fmt::Result {
    let mut family: MetricEncoder =
        encoder.encode_descriptor(name, help, None, MetricType::Info)?;
    family.encode_info(labels)
}

/// `1` for true.
pub fn flag(b: bool) -> i64 {
    i64::from(b)
}
