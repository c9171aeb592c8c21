//! The packages: `packaging/build.sh` makes a .deb and an .rpm that hold
//! exactly the files listed here (each with the bytes of its source in the
//! repository), keep the configuration across upgrades (conffile,
//! `%config(noreplace)`) and enable the unit on install; the OBS spec
//! (`packaging/rpm/harvester-node-agent.spec`) builds with Debian's rpmbuild
//! from a source tarball and a prebuilt binary into an rpm with the same
//! files; and the shipped default configuration is every key, commented out,
//! at its real default.
//!
//! The packages are built once per run from the binary under test
//! (`HNA_PACKAGE_BINARY`, no second compile) with `HNA_PACKAGE_FAST=1`
//! (gzip instead of xz for the .deb, ~30 s instead of minutes for this
//! unoptimised binary). The shipped command builds `release`; only the
//! `cargo build` line of build.sh is not run here.
//!
//! Maintainer scripts and scriptlets are run with stub `systemctl`,
//! `deb-systemd-helper`, `deb-systemd-invoke` and `systemd-sysusers` first
//! in `PATH`, which only log their arguments: the host's units and users
//! are never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use anyhow::{Context, Result, bail, ensure};
use hna_node::config::{self, FlagValues, KEYS};

use crate::BIN;
use crate::harness::tests;

tests! {
    default_config_comments_out_every_key_at_its_default;
    man_variants_are_the_base_lists_plus_the_man_pages;
    prereqs_script_installs_the_pinned_tool_versions;
    deb_holds_the_files_keeps_the_conffile_and_enables_the_unit: CargoDeb, CargoGenerateRpm, Dpkg, Binutils;
    rpm_holds_the_files_keeps_the_config_and_enables_the_unit: CargoDeb, CargoGenerateRpm, Rpmbuild, Binutils;
    spec_builds_from_the_tarball_with_a_prebuilt_binary: Rpmbuild, Binutils;
    the_cloud_config_fetches_the_files_build_sh_makes: CargoDeb, CargoGenerateRpm, Dpkg, Rpmbuild, Binutils;
}

const NAME: &str = "harvester-node-agent";
const VERSION: &str = env!("CARGO_PKG_VERSION");
const UNIT: &str = "harvester-node-agent.service";
const CONFIG: &str = "/etc/harvester-node-agent/config.toml";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `packaging/man/*.8`, the man pages both packages must carry.
fn man_pages() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(repo().join("packaging/man"))
        .map(|dir| {
            dir.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "8"))
                .collect()
        })
        .unwrap_or_default();
    pages.sort();
    pages
}

/// Every file a package must hold, by installed path, with the repository
/// file it is a copy of (`None`: the binary, checked by running it; the
/// Debian copyright file, which cargo-deb writes; man pages are gzip'd).
fn expected_files(deb: bool) -> BTreeMap<String, Option<PathBuf>> {
    let mut files: BTreeMap<String, Option<PathBuf>> = [
        ("/usr/bin/harvester-node-agent", None),
        (
            "/usr/lib/systemd/system/harvester-node-agent.service",
            Some("systemd/harvester-node-agent.service"),
        ),
        (CONFIG, Some("packaging/config.toml")),
        (
            "/usr/lib/modules-load.d/harvester-node-agent.conf",
            Some("packaging/modules-load.d/harvester-node-agent.conf"),
        ),
        (
            "/usr/lib/sysusers.d/harvester-node-agent.conf",
            Some("packaging/sysusers.d/harvester-node-agent.conf"),
        ),
        (
            "/usr/lib/systemd/system-preset/90-harvester-node-agent.preset",
            Some("packaging/systemd-preset/90-harvester-node-agent.preset"),
        ),
        (
            "/usr/lib/NetworkManager/conf.d/90-harvester-node-agent.conf",
            Some("packaging/NetworkManager/90-harvester-node-agent.conf"),
        ),
        (
            "/usr/share/doc/harvester-node-agent/README.md",
            Some("README.md"),
        ),
    ]
    .into_iter()
    .map(|(dest, src)| (dest.to_string(), src.map(|s| repo().join(s))))
    .collect();
    for page in man_pages() {
        let name = page.file_name().unwrap().to_string_lossy();
        files.insert(format!("/usr/share/man/man8/{name}.gz"), Some(page));
    }
    if deb {
        files.insert("/usr/share/doc/harvester-node-agent/copyright".into(), None);
    }
    files
}

// ---- the default configuration ---------------------------------------------

/// `# key = value` lines of the shipped file: (key, the line uncommented).
fn commented_assignments(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# "))
        .filter_map(|rest| {
            let (key, _) = rest.split_once(" = ")?;
            let is_key = !key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            is_key.then(|| (key.to_string(), rest.to_string()))
        })
        .collect()
}

fn resolve(text: Option<&str>) -> Result<config::Config> {
    let path = Path::new(CONFIG);
    let no_env = |_: &str| None;
    let mut cfg = config::resolve(
        text.map(|t| (path, t)),
        &no_env,
        &FlagValues::default(),
        &|| "node-a".to_string(),
    )?;
    cfg.file = None;
    Ok(cfg)
}

fn default_config_comments_out_every_key_at_its_default() -> Result<()> {
    let text = std::fs::read_to_string(repo().join("packaging/config.toml"))?;
    let defaults = resolve(None)?;
    // As shipped, the file changes nothing.
    ensure!(
        resolve(Some(&text))? == defaults,
        "packaging/config.toml, as shipped, sets something"
    );
    // Every key once, commented out, after a line that says why.
    let assignments = commented_assignments(&text);
    let keys: Vec<&str> = assignments.iter().map(|(k, _)| k.as_str()).collect();
    let known: BTreeSet<&str> = KEYS.iter().map(|k| k.name).collect();
    ensure!(
        keys.iter().copied().collect::<BTreeSet<_>>() == known && keys.len() == known.len(),
        "commented keys {keys:?}, configuration keys {known:?}"
    );
    let lines: Vec<&str> = text.lines().collect();
    for (key, _) in &assignments {
        let at = lines
            .iter()
            .position(|l| l.starts_with(&format!("# {key} = ")))
            .unwrap();
        ensure!(
            at > 0 && lines[at - 1].starts_with("# ") && !lines[at - 1].contains(" = "),
            "`{key}` has no comment line above it saying why"
        );
    }
    // Uncommented, every line is the default: the shown values are real.
    let uncommented: String = assignments
        .iter()
        .map(|(_, line)| format!("{line}\n"))
        .collect();
    let all_set = resolve(Some(&uncommented)).context("the file with every key uncommented")?;
    ensure!(
        all_set == defaults,
        "with every key uncommented:\n{all_set:#?}\nthe defaults:\n{defaults:#?}"
    );
    Ok(())
}

// ---- Cargo.toml: the `man` variants ----------------------------------------

fn man_variants_are_the_base_lists_plus_the_man_pages() -> Result<()> {
    let manifest: toml::Table = std::fs::read_to_string(repo().join("Cargo.toml"))?.parse()?;
    let metadata = &manifest["package"]["metadata"];
    let rpm = &metadata["generate-rpm"];
    let mut base = rpm["assets"].as_array().context("rpm assets")?.clone();
    let variant = rpm["variants"]["man"]["assets"]
        .as_array()
        .context("rpm man variant assets")?;
    let man: toml::Value = toml::from_str::<toml::Table>(
        r#"v = { source = "target/release/man/*.8.gz", dest = "/usr/share/man/man8/", mode = "644", doc = true }"#,
    )?["v"]
        .clone();
    base.push(man);
    ensure!(
        &base == variant,
        "the rpm `man` variant is not the base assets plus the man pages"
    );
    let deb = &metadata["deb"]["variants"]["man"];
    ensure!(
        deb["name"].as_str() == Some(NAME),
        "deb `man` variant renames the package"
    );
    let appended = deb["merge-assets"]["append"]
        .as_array()
        .context("deb man variant")?;
    ensure!(
        appended.len() == 1 && appended[0][0].as_str() == Some("target/release/man/*.8.gz"),
        "the deb `man` variant appends {appended:?}"
    );
    Ok(())
}

/// tests/rig/prereqs.sh installs the versions the prerequisites' install
/// messages name.
fn prereqs_script_installs_the_pinned_tool_versions() -> Result<()> {
    use hna_testkit::prereq::{CARGO_DEB_VERSION, CARGO_GENERATE_RPM_VERSION};
    let script = std::fs::read_to_string(repo().join("tests/rig/prereqs.sh"))?;
    for pin in [
        format!("\"cargo-deb {CARGO_DEB_VERSION}\""),
        format!("\"cargo-generate-rpm {CARGO_GENERATE_RPM_VERSION}\""),
    ] {
        ensure!(
            script.contains(&pin),
            "tests/rig/prereqs.sh does not pin {pin}"
        );
    }
    Ok(())
}

// ---- building ----------------------------------------------------------------

fn run(cmd: &mut Command) -> Result<Output> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?}: {}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

fn stdout(cmd: &mut Command) -> Result<String> {
    Ok(String::from_utf8(run(cmd)?.stdout)?)
}

/// A scratch directory of this run under cargo's target tmp dir (so it is
/// on the same disk as the build), cleared of earlier runs' directories.
fn scratch(name: &str) -> Result<PathBuf> {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR")).join("packaging");
    std::fs::create_dir_all(&base)?;
    let mine = format!("{name}-{}", std::process::id());
    for entry in std::fs::read_dir(&base)?.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let stale = file_name
            .rsplit_once('-')
            .and_then(|(_, pid)| pid.parse::<u32>().ok())
            .is_some_and(|pid| {
                pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
            });
        if stale {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let dir = base.join(mine);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

struct Packages {
    deb: PathBuf,
    rpm: PathBuf,
}

/// `packaging/build.sh`, once per run, shared by the tests that inspect it.
fn packages() -> Result<&'static Packages> {
    static BUILT: OnceLock<Result<Packages, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build_packages().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(|e| anyhow::anyhow!("packaging/build.sh: {e}"))
}

fn build_packages() -> Result<Packages> {
    let out_dir = scratch("packages")?;
    let text = stdout(
        Command::new("bash")
            .arg(repo().join("packaging/build.sh"))
            .env("HNA_PACKAGE_BINARY", BIN)
            .env("HNA_PACKAGE_FAST", "1")
            .env("HNA_PACKAGE_OUT", &out_dir),
    )?;
    let deb = out_dir.join(format!("{NAME}_{VERSION}_amd64.deb"));
    let rpm = out_dir.join(format!("{NAME}-{VERSION}-1.x86_64.rpm"));
    let printed: Vec<&str> = text.lines().rev().take(2).collect();
    ensure!(
        printed == [rpm.to_str().unwrap(), deb.to_str().unwrap()],
        "build.sh printed {printed:?}, expected the paths of {deb:?} and {rpm:?}"
    );
    ensure!(
        deb.is_file() && rpm.is_file(),
        "build.sh wrote no {deb:?} or {rpm:?}"
    );
    Ok(Packages { deb, rpm })
}

// ---- checks shared by the packages -------------------------------------------

fn assert_same_files(what: &str, got: &BTreeSet<String>, deb: bool) -> Result<()> {
    let want: BTreeSet<String> = expected_files(deb).into_keys().collect();
    ensure!(
        got == &want,
        "{what}: files missing {:?}, unexpected {:?}",
        want.difference(got).collect::<Vec<_>>(),
        got.difference(&want).collect::<Vec<_>>()
    );
    Ok(())
}

/// The unpacked package under `root` has the bytes of the repository files
/// and a binary that is this version of the agent.
fn assert_contents(root: &Path, deb: bool) -> Result<()> {
    for (dest, src) in expected_files(deb) {
        let got = std::fs::read(root.join(dest.trim_start_matches('/')))
            .with_context(|| format!("{dest} in the package"))?;
        let Some(src) = src else { continue };
        let want = std::fs::read(&src)?;
        let got = if dest.ends_with(".gz") {
            stdout(Command::new("sh").arg("-c").arg(format!(
                "gzip -dc '{}'",
                root.join(dest.trim_start_matches('/')).display()
            )))?
            .into_bytes()
        } else {
            got
        };
        ensure!(got == want, "{dest} differs from {}", src.display());
    }
    let binary = root.join("usr/bin/harvester-node-agent");
    let version = stdout(Command::new(&binary).arg("--version"))?;
    ensure!(
        version.trim() == format!("{NAME} {VERSION}"),
        "the packaged binary says {version:?}"
    );
    let preset = std::fs::read_to_string(
        root.join("usr/lib/systemd/system-preset/90-harvester-node-agent.preset"),
    )?;
    ensure!(
        preset.lines().any(|l| l.trim() == format!("enable {UNIT}")),
        "the preset does not enable {UNIT}: {preset}"
    );
    Ok(())
}

/// The daemon's user (the unit's `User=`).
const SYSUSERS: &str = "/usr/lib/sysusers.d/harvester-node-agent.conf";

/// Runs a maintainer script or scriptlet with stub systemd tools that log
/// their arguments; returns the log lines (`tool args...`).
fn run_with_stub_systemd(script: &str, args: &[&str], with_tools: bool) -> Result<Vec<String>> {
    for real in [
        "/bin/systemctl",
        "/usr/bin/deb-systemd",
        "/sbin/",
        "/usr/sbin/",
    ] {
        ensure!(
            !script.contains(real),
            "the script calls `{real}...` by path, which the stubs cannot stand in for:\n{script}"
        );
    }
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("log");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin)?;
    if with_tools {
        for tool in [
            "systemctl",
            "deb-systemd-helper",
            "deb-systemd-invoke",
            "systemd-sysusers",
        ] {
            let stub = bin.join(tool);
            std::fs::write(
                &stub,
                format!(
                    "#!/bin/sh\necho \"{tool} $*\" >> '{}'\nexit 0\n",
                    log.display()
                ),
            )?;
            run(Command::new("chmod").arg("755").arg(&stub))?;
        }
    }
    let script_file = dir.path().join("script");
    std::fs::write(&script_file, script)?;
    // Without the tools: only the stub dir and the shell's own utilities.
    let path = if with_tools {
        format!("{}:/usr/bin:/bin", bin.display())
    } else {
        format!("{}:/nonexistent", bin.display())
    };
    run(Command::new("/bin/sh")
        .arg(&script_file)
        .args(args)
        .env_clear()
        .env("PATH", path))?;
    Ok(std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect())
}

// ---- the .deb ------------------------------------------------------------------

fn deb_holds_the_files_keeps_the_conffile_and_enables_the_unit() -> Result<()> {
    let deb = &packages()?.deb;
    // `dpkg -c`: owner root, the binary 0755, everything else 0644.
    let listing = stdout(Command::new("dpkg").arg("-c").arg(deb))?;
    let mut files = BTreeSet::new();
    for line in listing.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (perms, owner, path) = (fields[0], fields[1], fields[5]);
        ensure!(
            owner == "0/0" || owner == "root/root",
            "{line}: not owned by root"
        );
        if perms.starts_with('d') {
            continue;
        }
        let path = path.trim_start_matches('.').to_string();
        let want = if path == "/usr/bin/harvester-node-agent" {
            "-rwxr-xr-x"
        } else {
            "-rw-r--r--"
        };
        ensure!(perms == want, "{line}: mode {perms}, want {want}");
        files.insert(path);
    }
    assert_same_files("the .deb", &files, true)?;

    let info = stdout(Command::new("dpkg").arg("-I").arg(deb))?;
    ensure!(
        info.lines().any(|l| l.trim() == format!("Package: {NAME}"))
            && info
                .lines()
                .any(|l| l.trim() == format!("Version: {VERSION}")),
        "dpkg -I:\n{info}"
    );
    let conffiles = stdout(Command::new("dpkg-deb").arg("-I").arg(deb).arg("conffiles"))?;
    ensure!(
        conffiles.lines().collect::<Vec<_>>() == [CONFIG],
        "conffiles: {conffiles:?}"
    );

    let root = tempfile::tempdir()?;
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(root.path()))?;
    assert_contents(root.path(), true)?;

    // postinst configure (a first install: no old version) enables the unit,
    // and starts it when systemd runs.
    let control = tempfile::tempdir()?;
    run(Command::new("dpkg-deb")
        .arg("-e")
        .arg(deb)
        .arg(control.path()))?;
    let postinst = std::fs::read_to_string(control.path().join("postinst"))?;
    let calls = run_with_stub_systemd(&postinst, &["configure"], true)?;
    ensure!(
        calls.first() == Some(&format!("systemd-sysusers {SYSUSERS}")),
        "postinst configure did not create the daemon's user first; it ran {calls:?}"
    );
    ensure!(
        calls.contains(&format!("deb-systemd-helper enable {UNIT}")),
        "postinst configure did not enable {UNIT}; it ran {calls:?}"
    );
    if Path::new("/run/systemd/system").is_dir() {
        ensure!(
            calls.contains(&format!("deb-systemd-invoke start {UNIT}")),
            "postinst configure did not start {UNIT} under systemd; it ran {calls:?}"
        );
    }
    // An upgrade is one systemd restart job (postinst `configure <old>`),
    // never a stop in the old package's prerm and a start later: the agent
    // tells a restart job from a stop and keeps its addresses through it
    // (`lb_keep_on_stop`, issue #29). Read from the scripts, since their
    // systemd branch runs only where systemd is PID 1.
    let prerm = std::fs::read_to_string(control.path().join("prerm")).unwrap_or_default();
    ensure!(
        postinst.contains("_dh_action=restart")
            && postinst.contains("deb-systemd-invoke $_dh_action"),
        "postinst does not restart the unit on upgrade:\n{postinst}"
    );
    ensure!(
        prerm
            .lines()
            .filter(|l| l.contains("deb-systemd-invoke stop"))
            .count()
            <= 1
            && prerm.contains("[ \"$1\" = remove ]"),
        "prerm stops the unit on upgrade, not only on removal:\n{prerm}"
    );
    Ok(())
}

// ---- the .rpm ------------------------------------------------------------------

/// `rpm -qp --dump`: path, then (size, mtime, digest, mode, owner, group,
/// config, doc, ...).
fn rpm_dump(rpm: &Path) -> Result<BTreeMap<String, Vec<String>>> {
    let text = stdout(Command::new("rpm").args(["-qp", "--dump"]).arg(rpm))?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut fields = l.split(' ').map(str::to_string);
            Some((fields.next()?, fields.collect()))
        })
        .collect())
}

/// The checks both rpms (cargo-generate-rpm's and the spec's) must pass.
fn assert_rpm(rpm: &Path, what: &str) -> Result<()> {
    let query = |fmt: &str| stdout(Command::new("rpm").args(["-qp", "--qf", fmt]).arg(rpm));
    ensure!(
        query("%{NAME} %{VERSION}")? == format!("{NAME} {VERSION}"),
        "{what}: name and version {:?}",
        query("%{NAME} %{VERSION}")?
    );
    let dump = rpm_dump(rpm)?;
    let mut files = BTreeSet::new();
    for (path, f) in &dump {
        let mode = u32::from_str_radix(&f[3], 8).with_context(|| format!("mode of {path}"))?;
        ensure!(
            f[4] == "root" && f[5] == "root",
            "{what}: {path} not owned by root"
        );
        if mode & 0o170000 == 0o040000 {
            continue; // a directory the package owns
        }
        let want = if path == "/usr/bin/harvester-node-agent" {
            0o100755
        } else {
            0o100644
        };
        ensure!(mode == want, "{what}: {path} mode {mode:o}, want {want:o}");
        files.insert(path.clone());
    }
    assert_same_files(what, &files, false)?;
    // %config(noreplace): the flags of each file.
    let flags = query("[%{FILENAMES} %{FILEFLAGS:fflags}\\n]")?;
    for line in flags.lines() {
        let (path, fl) = line.rsplit_once(' ').unwrap_or((line, ""));
        if path == CONFIG {
            ensure!(
                fl.contains('c') && fl.contains('n'),
                "{what}: {CONFIG} is not %config(noreplace): {fl:?}"
            );
        } else {
            ensure!(!fl.contains('c'), "{what}: {path} is marked %config");
        }
    }
    let configs = stdout(Command::new("rpm").arg("-qpc").arg(rpm))?;
    ensure!(
        configs.lines().collect::<Vec<_>>() == [CONFIG],
        "{what}: rpm -qpc: {configs:?}"
    );

    // Contents, unpacked with rpm2cpio.
    let root = tempfile::tempdir()?;
    run(Command::new("sh")
        .current_dir(root.path())
        .arg("-c")
        .arg(format!("rpm2cpio '{}' | cpio -idm --quiet", rpm.display())))?;
    assert_contents(root.path(), false)?;

    // Scriptlets: %post on a first install presets (enables) the unit, also
    // with no systemctl at all (a chroot); %preun on the last removal
    // disables and stops it.
    let scripts = stdout(Command::new("rpm").args(["-qp", "--scripts"]).arg(rpm))?;
    ensure!(
        scripts.contains("postinstall scriptlet"),
        "{what}: no %post: {scripts}"
    );
    let post = query("%{POSTIN}")?;
    let calls = run_with_stub_systemd(&post, &["1"], true)?;
    ensure!(
        calls.first() == Some(&format!("systemd-sysusers {SYSUSERS}")),
        "{what}: %post 1 did not create the daemon's user first: {calls:?}"
    );
    ensure!(
        calls.contains(&format!("systemctl --no-reload preset {UNIT}")),
        "{what}: %post 1 ran {calls:?}"
    );
    run_with_stub_systemd(&post, &["1"], false)
        .with_context(|| format!("{what}: %post without systemctl"))?;
    let preun = query("%{PREUN}")?;
    let calls = run_with_stub_systemd(&preun, &["0"], true)?;
    ensure!(
        calls.contains(&format!("systemctl --no-reload disable --now {UNIT}")),
        "{what}: %preun 0 ran {calls:?}"
    );
    let calls = run_with_stub_systemd(&preun, &["1"], true)?;
    ensure!(calls.is_empty(), "{what}: %preun on upgrade ran {calls:?}");
    Ok(())
}

fn rpm_holds_the_files_keeps_the_config_and_enables_the_unit() -> Result<()> {
    assert_rpm(&packages()?.rpm, "cargo-generate-rpm's rpm")
}

// ---- the spec ------------------------------------------------------------------

fn spec_builds_from_the_tarball_with_a_prebuilt_binary() -> Result<()> {
    let top = scratch("rpmbuild")?;
    let sources = top.join("SOURCES");
    std::fs::create_dir_all(&sources)?;
    // The source tarball, as OBS gets it: the tree under <name>-<version>/.
    let prefix = format!("{NAME}-{VERSION}");
    run(Command::new("tar")
        .current_dir(repo())
        .args([
            "--exclude=./target",
            "--exclude=./.git",
            "--exclude=./fuzz/target",
        ])
        .arg(format!("--transform=s,^\\.,{prefix},"))
        .arg("-czf")
        .arg(sources.join(format!("{prefix}.tar.gz")))
        .arg("."))?;
    // The binary as a release build has it (no debug info).
    let binary = top.join("harvester-node-agent");
    run(Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(&binary)
        .arg(BIN))?;
    run(Command::new("rpmbuild")
        .arg("-bb")
        // Debian's rpm database knows none of the build dependencies.
        .arg("--nodeps")
        .arg("--define")
        .arg(format!("_topdir {}", top.display()))
        .arg("--define")
        .arg(format!("hna_prebuilt {}", binary.display()))
        // A quick payload compression (the default, zstd level 19, takes
        // over a minute for this binary here); the files are what counts.
        .arg("--define")
        .arg("_binary_payload w3.zstdio")
        .arg(repo().join("packaging/rpm/harvester-node-agent.spec")))?;
    let rpm = top.join(format!("RPMS/x86_64/{NAME}-{VERSION}-1.x86_64.rpm"));
    ensure!(rpm.is_file(), "rpmbuild made no {}", rpm.display());
    assert_rpm(&rpm, "the spec's rpm")?;
    let _ = std::fs::remove_dir_all(&top);
    Ok(())
}

/// Issue #32: `packaging/cloud-init/cloud-config.yaml` fetches the package
/// files by name; they must be the names `packaging/build.sh` writes (it
/// once asked for `_0.1.0-1_amd64.deb` where the build made
/// `_0.1.0_amd64.deb`).
fn the_cloud_config_fetches_the_files_build_sh_makes() -> Result<()> {
    let built = packages()?;
    let config = std::fs::read_to_string(repo().join("packaging/cloud-init/cloud-config.yaml"))?;
    let fetched = |var: &str| -> Result<String> {
        let line = config
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with(&format!("{var}=")))
            .with_context(|| format!("no {var}= in the cloud-config"))?;
        Ok(line.rsplit('/').next().unwrap_or_default().to_string())
    };
    for (var, file) in [("AGENT_DEB_URL", &built.deb), ("AGENT_RPM_URL", &built.rpm)] {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        ensure!(
            fetched(var)? == name,
            "{var} fetches {}, build.sh makes {name}",
            fetched(var)?
        );
    }
    Ok(())
}
