//! Records which git commit `forge` was built from, for `forge --version` (an empty
//! record outside a git checkout, e.g. from a source tarball).

use std::path::Path;
use std::process::Command;

fn main() {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    let commit =
        git(&["rev-parse", "--short=12", "HEAD"]).map_or("no git commit recorded".to_owned(), |h| format!("git {h}"));
    println!("cargo:rustc-env=FORGE_GIT_COMMIT={commit}");
    // Build again when HEAD moves (a commit, a checkout); only paths that exist, since a
    // missing one would rerun this script on every build.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        for p in ["HEAD", "refs/heads", "packed-refs"] {
            let path = Path::new(&dir).join(p);
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
