//! Where the `kvroute` and `kvroute-sim` binaries come from.
//!
//! Cargo sets `CARGO_BIN_EXE_<name>` only for a package's OWN binaries, and this crate owns none
//! (linking the router into the harness would defeat the point: the scenarios run the shipped
//! binary). So the first scenario of a test process runs, once (a [`OnceLock`]):
//!
//! ```text
//! $CARGO build -p kvroute -p kvroute-sim --bins --locked --target-dir <this test's target dir> [profile]
//! ```
//!
//! with the profile and target directory read off the running test executable
//! (`<target>/<profile>/deps/<test>-<hash>`), and uses `<target>/<profile>/kvroute` and
//! `kvroute-sim`. Why build instead of only looking next to the test executable: on a clean CI
//! checkout `cargo test --workspace` does build both binaries (their packages have integration
//! tests), but `cargo test -p kvroute-fleet` alone does not, and after an edit to the router a
//! binary found lying there would be STALE, so a scenario would prove something about old code.
//! When both are fresh the build is a no-op of about a second. Cargo releases its build lock
//! before it runs test executables, so the nested build does not deadlock (checked: the
//! scenarios run under `cargo test` with this build inside them). After `cargo test
//! --workspace` the nested build may still compile some dependencies once more, since cargo
//! unifies features over the packages it was asked for. That one-time cost is paid before the
//! first process is spawned, so no scenario's time limit counts it.
//!
//! `KVROUTE_FLEET_BIN_DIR=<dir>` skips the build and takes both binaries from `<dir>` (e.g. a
//! `production` build for a benchmark). Cross-compiled test layouts (`<target>/<triple>/...`)
//! are not handled: the harness runs processes on this host.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The two binaries a fleet is made of.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub kvroute: PathBuf,
    pub sim: PathBuf,
}

/// Overrides the build: a directory holding `kvroute` and `kvroute-sim`.
pub const BIN_DIR_ENV: &str = "KVROUTE_FLEET_BIN_DIR";

/// The binaries, built on first use (see the module doc). Panics with cargo's output if the
/// build fails: no scenario can run without them.
pub fn binaries() -> &'static Binaries {
    static BINARIES: OnceLock<Result<Binaries, String>> = OnceLock::new();
    match BINARIES.get_or_init(locate_or_build) {
        Ok(b) => b,
        Err(e) => panic!("the fleet harness has no binaries: {e}"),
    }
}

fn locate_or_build() -> Result<Binaries, String> {
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV) {
        return existing(Path::new(&dir));
    }
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut profile_dir = exe
        .parent()
        .ok_or("the test executable has no directory")?
        .to_path_buf();
    if profile_dir.file_name().is_some_and(|n| n == "deps") {
        profile_dir.pop();
    }
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("cannot read the profile directory's name")?
        .to_string();
    let target_dir = profile_dir
        .parent()
        .ok_or("the profile directory has no parent")?;
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--manifest-path")
        .arg(&manifest)
        // --locked: a nested build must never rewrite the lock file under the outer one.
        .args(["-p", "kvroute", "-p", "kvroute-sim", "--bins", "--locked"])
        .arg("--target-dir")
        .arg(target_dir);
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run cargo build: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo build -p kvroute -p kvroute-sim failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    existing(&profile_dir)
}

fn existing(dir: &Path) -> Result<Binaries, String> {
    let b = Binaries {
        kvroute: dir.join(format!("kvroute{}", std::env::consts::EXE_SUFFIX)),
        sim: dir.join(format!("kvroute-sim{}", std::env::consts::EXE_SUFFIX)),
    };
    for p in [&b.kvroute, &b.sim] {
        if !p.is_file() {
            return Err(format!("{} does not exist", p.display()));
        }
    }
    Ok(b)
}
