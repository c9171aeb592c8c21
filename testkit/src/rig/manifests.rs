//! Applying a kustomize directory (e.g. `packaging/kubernetes/`) the way
//! `kubectl apply --server-side -k` would for a plain base: the files named
//! by `kustomization.yaml`'s `resources`, in that order, each document
//! server-side applied through discovery, waiting for each
//! CustomResourceDefinition to be Established before the next object.
//!
//! Only plain bases are supported: a `kustomization.yaml` with anything but
//! `apiVersion`, `kind` and `resources` (patches, images, namespace, ...) or
//! a resource that is a directory or URL is an error, never silently applied
//! differently from `kubectl`.
//!
//! YAML is parsed with `serde_norway`, the maintained fork of `serde_yaml`
//! (its libyaml port, `unsafe-libyaml-norway`, gets fixes; `serde_yaml` is
//! archived and `serde_yaml_ng` still uses the archived `unsafe-libyaml`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::Scope;
use serde::Deserialize;

/// The field manager of objects the rig applies.
pub const FIELD_MANAGER: &str = "hna-rig";

/// How long a CRD may take to become Established.
const ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(30);

/// One object of a manifests directory.
#[derive(Debug, Clone)]
pub struct Manifest {
    /// The file it came from.
    pub source: PathBuf,
    /// The object as written (`types` and `metadata.name` always set).
    pub object: DynamicObject,
}

impl Manifest {
    /// `apiVersion` and `kind`.
    pub fn gvk(&self) -> Result<GroupVersionKind> {
        let types = self.object.types.as_ref().context("no apiVersion/kind")?;
        GroupVersionKind::try_from(types).map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// `kind`.
    pub fn kind(&self) -> &str {
        self.object.types.as_ref().map_or("", |t| t.kind.as_str())
    }

    /// `metadata.name`.
    pub fn name(&self) -> &str {
        self.object.metadata.name.as_deref().unwrap_or("")
    }

    /// `kind/name (file)`, for messages.
    pub fn describe(&self) -> String {
        format!(
            "{}/{} ({})",
            self.kind(),
            self.name(),
            self.source
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
        )
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    #[allow(dead_code)]
    api_version: Option<String>,
    #[allow(dead_code)]
    kind: Option<String>,
    #[serde(default)]
    resources: Vec<String>,
}

/// Reads `dir/kustomization.yaml` and every document of every file in its
/// `resources`, in order. Empty documents are skipped; a document without
/// `apiVersion`, `kind` or `metadata.name` is an error naming the file.
pub fn load_kustomization(dir: &Path) -> Result<Vec<Manifest>> {
    let kfile = dir.join("kustomization.yaml");
    let text =
        std::fs::read_to_string(&kfile).with_context(|| format!("read {}", kfile.display()))?;
    let k: Kustomization = serde_norway::from_str(&text).with_context(|| {
        format!(
            "{}: only apiVersion, kind and resources are supported",
            kfile.display()
        )
    })?;
    let mut out = Vec::new();
    for r in &k.resources {
        if r.contains("://") {
            bail!("{}: remote resource {r} not supported", kfile.display());
        }
        let path = dir.join(r);
        if path.is_dir() {
            bail!(
                "{}: resource {r} is a directory (nested kustomizations not supported)",
                kfile.display()
            );
        }
        out.extend(load_file(&path)?);
    }
    Ok(out)
}

/// Every non-empty document of one multi-document YAML file.
pub fn load_file(path: &Path) -> Result<Vec<Manifest>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut out = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(&text).enumerate() {
        let value = serde_json::Value::deserialize(doc)
            .with_context(|| format!("{}: document {}", path.display(), i + 1))?;
        if value.is_null() {
            continue; // an empty document (a trailing `---`, comments only)
        }
        let object: DynamicObject = serde_json::from_value(value)
            .with_context(|| format!("{}: document {}", path.display(), i + 1))?;
        if object.types.is_none() || object.metadata.name.is_none() {
            bail!(
                "{}: document {} lacks apiVersion, kind or metadata.name",
                path.display(),
                i + 1
            );
        }
        out.push(Manifest {
            source: path.to_path_buf(),
            object,
        });
    }
    Ok(out)
}

/// [`load_kustomization`] and [`apply`]: the one call for a test that needs the
/// manifests in place, e.g. to run the controller with
/// [`super::ApiServer::controller_kubeconfig`].
pub async fn apply_kustomization(
    client: &kube::Client,
    dir: &Path,
    mode: Mode,
) -> Result<Vec<DynamicObject>> {
    let all = load_kustomization(dir)?;
    apply(client, &all, mode).await
}

/// How to apply.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// Persist the objects.
    #[default]
    Apply,
    /// `dryRun=All` (`kubectl apply --dry-run=server`): admission and
    /// validation run, nothing is stored. Objects in a namespace that does
    /// not exist yet are refused, as with kubectl.
    DryRun,
}

/// Server-side applies `manifests` in order with `client` (force, field
/// manager [`FIELD_MANAGER`]), and returns the server's answer for each.
/// After a CustomResourceDefinition is applied for real, waits until it is
/// Established. Stops at the first error, which names the object.
pub async fn apply(
    client: &kube::Client,
    manifests: &[Manifest],
    mode: Mode,
) -> Result<Vec<DynamicObject>> {
    let mut out = Vec::with_capacity(manifests.len());
    for m in manifests {
        let what = m.describe();
        let gvk = m.gvk().with_context(|| what.clone())?;
        let (resource, caps) = kube::discovery::pinned_kind(client, &gvk)
            .await
            .with_context(|| {
                format!(
                    "{what}: the API server does not serve {}/{} {}",
                    gvk.group, gvk.version, gvk.kind
                )
            })?;
        let api: Api<DynamicObject> =
            match caps.scope {
                Scope::Cluster => Api::all_with(client.clone(), &resource),
                Scope::Namespaced => {
                    let ns =
                        m.object.metadata.namespace.as_deref().with_context(|| {
                            format!("{what}: namespaced but no metadata.namespace")
                        })?;
                    Api::namespaced_with(client.clone(), ns, &resource)
                }
            };
        let mut params = PatchParams::apply(FIELD_MANAGER).force();
        if mode == Mode::DryRun {
            params = params.dry_run();
        }
        let answer = api
            .patch(m.name(), &params, &Patch::Apply(&m.object))
            .await
            .with_context(|| format!("apply {what}"))?;
        if mode == Mode::Apply
            && gvk.group == "apiextensions.k8s.io"
            && gvk.kind == "CustomResourceDefinition"
        {
            wait_established(client, m.name())
                .await
                .with_context(|| what.clone())?;
        }
        out.push(answer);
    }
    Ok(out)
}

/// Waits (up to 30 s) until CRD `name` has condition `Established=True`.
pub async fn wait_established(client: &kube::Client, name: &str) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let deadline = Instant::now() + ESTABLISHED_TIMEOUT;
    loop {
        let crd = crds
            .get(name)
            .await
            .with_context(|| format!("get CRD {name}"))?;
        let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
        if conditions
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("CRD {name} not Established within {ESTABLISHED_TIMEOUT:?}: {conditions:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
