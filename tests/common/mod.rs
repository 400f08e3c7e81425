//! Helpers shared by the integration tests (each test file uses some of them).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the `kiln` binary from the repository root, without colors.
pub fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(root())
        .env("NO_COLOR", "1")
        .output()
        .expect("kiln runs")
}

/// Every spec shipped in `models/` and `models/table3/`, listed from the folders (a new
/// spec is covered without editing a test), sorted.
pub fn shipped_specs() -> Vec<PathBuf> {
    let models = root().join("models");
    let mut out = Vec::new();
    for dir in [models.clone(), models.join("table3")] {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "kiln") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}
