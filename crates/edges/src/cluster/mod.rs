//! Talking to the guest cluster, shared by the node daemon and the
//! controller: which credentials to use ([`credentials`]), a connection that
//! follows them ([`connection`]), and the single-object watch
//! ([`watch_one`]).

pub mod connection;
pub mod credentials;
pub mod watch_one;

pub use connection::ClusterState;
