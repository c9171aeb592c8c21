//! Liveness on the LAN (issue #30): the agents of one VM network watch
//! each other over that network, so that a node's liveness is measured
//! where its LoadBalancer addresses live, not on its path to the API
//! server. The design is in `docs/loadbalancer-design.md` (Liveness on the
//! LAN).
//!
//! Built so far: [`wire`], the authenticated envelope every membership
//! packet travels in, and the gate that drops (and counts) what is
//! malformed, unauthenticated, replayed or from a sender that is no member.
//! Not yet: the SWIM member (`foca`), its UDP transport, the witnesses'
//! reports and the controller's use of them; nothing in the daemon uses
//! this module yet.

pub mod codec;
pub mod swim;
pub mod transport;
pub mod wire;
