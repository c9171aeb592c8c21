//! The annotations the controller writes on a Service: kube-vip's record,
//! written once the address is held and taken off when the Service is
//! deleted (one that opts out keeps it, so that kube-vip asks for the same
//! address).

use std::collections::BTreeMap;

use hna_contract::{AddressIdentity, kube_vip};

use super::plan::Write;
use super::world::ServiceIn;

/// The annotations the controller writes on a Service it serves (kube-vip's
/// record, so that moving back to kube-vip keeps the address).
pub(crate) const OUR_ANNOTATIONS: [&str; 3] =
    [kube_vip::HWADDR, kube_vip::REQUESTED_IP, kube_vip::VIP_HOST];

/// The record of `s` held by `holder` at `ip` with the MAC of `id`, where
/// its annotations do not say so already.
pub(super) fn record(s: &ServiceIn, id: &AddressIdentity, ip: &str, holder: &str) -> Option<Write> {
    let record = [
        (kube_vip::HWADDR, hna_contract::mac::format(&id.mac)),
        (kube_vip::REQUESTED_IP, ip.to_string()),
        (kube_vip::VIP_HOST, holder.to_string()),
    ];
    let set: BTreeMap<String, Option<String>> = record
        .into_iter()
        .filter(|(k, v)| s.annotations.get(*k) != Some(v))
        .map(|(k, v)| (k.to_string(), Some(v)))
        .collect();
    (!set.is_empty()).then(|| Write::ServiceAnnotations {
        service: s.key.clone(),
        set,
    })
}

/// [`OUR_ANNOTATIONS`] off `s`, where it has any.
pub(super) fn removal_of_ours(s: &ServiceIn) -> Option<Write> {
    let set: BTreeMap<String, Option<String>> = OUR_ANNOTATIONS
        .iter()
        .filter(|k| s.annotations.contains_key(**k))
        .map(|k| (k.to_string(), None))
        .collect();
    (!set.is_empty()).then(|| Write::ServiceAnnotations {
        service: s.key.clone(),
        set,
    })
}
