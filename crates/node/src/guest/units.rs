//! The service manager's view of the qemu-ga unit, read over systemd's D-Bus
//! API (never by parsing `systemctl` output). Behind a small trait so the
//! mapping is unit-tested with a double and a booted-image test can drive the
//! real one.

use std::future::Future;

use futures::StreamExt;

/// The properties of `org.freedesktop.systemd1.Unit` that decide health.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct UnitState {
    /// `loaded`, `not-found`, `masked`, `error`, …
    pub(crate) load_state: String,
    /// `active`, `inactive`, `failed`, `activating`, `deactivating`, …
    pub(crate) active_state: String,
    /// e.g. `running`, `dead`, `exited`.
    pub(crate) sub_state: String,
    /// `enabled`, `disabled`, `static` (Debian starts the agent from a
    /// udev rule), `masked`, … (empty when unknown).
    pub(crate) unit_file_state: String,
}

impl UnitState {
    pub(crate) fn loaded(&self) -> bool {
        self.load_state == "loaded"
    }
    pub(crate) fn active(&self) -> bool {
        self.active_state == "active" || self.active_state == "reloading"
    }
}

/// Why the service manager did not answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UnitError {
    #[error("no system D-Bus: {0}")]
    NoBus(#[source] zbus::Error),
    #[error("systemd manager: {0}")]
    Manager(#[source] zbus::Error),
    #[error("systemd Subscribe: {0}")]
    Subscribe(#[source] zbus::Error),
    #[error("reading {unit} from systemd: {error}")]
    Read {
        unit: String,
        #[source]
        error: zbus::Error,
    },
}

/// What the health check needs from the service manager.
pub(crate) trait ServiceManager: Send + Sync {
    /// The unit's state; `Ok(None)` when the unit does not exist.
    fn unit(&self, name: &str)
    -> impl Future<Output = Result<Option<UnitState>, UnitError>> + Send;
    /// Resolves when any of `names` changes state (or at once if the
    /// manager cannot signal).
    fn changed(&self, names: &[&str]) -> impl Future<Output = ()> + Send;
}

/// The first of `names` the manager knows.
pub(crate) async fn first_known<S: ServiceManager>(
    sm: &S,
    names: &[&str],
) -> Result<Option<(String, UnitState)>, UnitError> {
    for name in names {
        if let Some(u) = sm.unit(name).await? {
            return Ok(Some((name.to_string(), u)));
        }
    }
    Ok(None)
}

#[zbus::proxy(
    interface = "org.freedesktop.systemd1.Manager",
    default_service = "org.freedesktop.systemd1",
    default_path = "/org/freedesktop/systemd1"
)]
trait Manager {
    fn load_unit(&self, name: &str) -> zbus::Result<zbus::OwnedObjectPath>;
    fn subscribe(&self) -> zbus::Result<()>;
}

#[zbus::proxy(
    interface = "org.freedesktop.systemd1.Unit",
    default_service = "org.freedesktop.systemd1"
)]
trait Unit {
    #[zbus(property)]
    fn load_state(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn active_state(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn sub_state(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn unit_file_state(&self) -> zbus::Result<String>;
}

/// systemd on the system bus.
#[derive(Clone)]
pub(crate) struct Systemd {
    conn: zbus::Connection,
}

impl Systemd {
    /// Connects to the system bus and subscribes to unit signals (systemd
    /// sends PropertiesChanged for units only while someone subscribed).
    pub(crate) async fn connect() -> Result<Self, UnitError> {
        let conn = zbus::Connection::system().await.map_err(UnitError::NoBus)?;
        let manager = ManagerProxy::new(&conn).await.map_err(UnitError::Manager)?;
        manager.subscribe().await.map_err(UnitError::Subscribe)?;
        Ok(Systemd { conn })
    }

    async fn unit_proxy(&self, name: &str) -> zbus::Result<UnitProxy<'static>> {
        let manager = ManagerProxy::new(&self.conn).await?;
        let path = manager.load_unit(name).await?;
        UnitProxy::builder(&self.conn).path(path).build().await
    }
}

impl ServiceManager for Systemd {
    async fn unit(&self, name: &str) -> Result<Option<UnitState>, UnitError> {
        let err = |error: zbus::Error| UnitError::Read {
            unit: name.to_string(),
            error,
        };
        let unit = self.unit_proxy(name).await.map_err(err)?;
        let state = UnitState {
            load_state: unit.load_state().await.map_err(err)?,
            active_state: unit.active_state().await.map_err(err)?,
            sub_state: unit.sub_state().await.map_err(err)?,
            unit_file_state: unit.unit_file_state().await.unwrap_or_default(),
        };
        Ok((state.load_state != "not-found").then_some(state))
    }

    async fn changed(&self, names: &[&str]) {
        let mut streams = Vec::new();
        for name in names {
            if let Ok(unit) = self.unit_proxy(name).await {
                streams.push(unit.receive_active_state_changed().await.boxed());
            }
        }
        if streams.is_empty() {
            return;
        }
        let mut all = futures::stream::select_all(streams);
        // The first item is the current value; the next one is a change.
        let _ = all.next().await;
        let _ = all.next().await;
    }
}
