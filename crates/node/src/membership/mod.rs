//! Liveness on the LAN (issue #30): the agents of one VM network watch
//! each other over that network, so that a node's liveness is measured
//! where its LoadBalancer addresses live, not on its path to the API
//! server. The design is in `docs/loadbalancer-design.md` (Liveness on the
//! LAN).
//!
//! - [`wire`]: the sealed envelope every packet travels in, and the gate
//!   that drops (and counts) what is malformed, unauthenticated, replayed
//!   or from a sender that is no member.
//! - `identity` and `codec`: who a member is, and SWIM's messages on
//!   the wire.
//! - `swim`: one node's member, pure: SWIM (`foca`) for the membership,
//!   and the witnesses' own probes, which report a watched node dead only
//!   once its addresses have surely expired.
//! - `transport`: its edge, one UDP socket on the default uplink and the
//!   timers, and the `transport::LanView` the agent reports
//!   (`status.lan`).
//!
//! The controller reads the reports (`controller::lan_verdict`); the two
//! share only `hna_contract::membership`.

pub(crate) mod codec;
pub(crate) mod identity;
pub(crate) mod swim;
pub(crate) mod transport;
pub mod wire;
