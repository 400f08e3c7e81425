//! The catalog of bad specs: every file in `tests/diagnostics/` (plus a generated 1 MB
//! spec of garbage) is checked with the real `kiln` binary. Each must exit with status 1
//! — not 0, and not a panic — and its message is pinned by an insta snapshot.
//!
//! A `.kiln` case runs `kiln check <file>` plus the arguments on its `# args:` line; an
//! `.args` case runs the arguments it contains from the repository root.

use std::path::{Path, PathBuf};
use std::process::Command;

fn kiln() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env_remove("RUST_BACKTRACE").env("NO_COLOR", "1");
    c
}

/// Runs a case and returns its stderr, asserting a clean failure.
fn run_case(name: &str, mut cmd: Command) -> String {
    let out = cmd.output().expect("the kiln binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "case `{name}` should fail with exit status 1\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "case `{name}` panicked:\n{stderr}"
    );
    assert!(
        stdout.is_empty(),
        "case `{name}` printed to stdout:\n{stdout}"
    );
    stderr
}

fn cases() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/diagnostics");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/diagnostics exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("kiln" | "args")
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn catalog_of_bad_specs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let all = cases();
    assert!(
        all.len() >= 20,
        "the catalog has {} cases, want at least 20",
        all.len()
    );
    let mut messages = std::collections::BTreeSet::new();
    for path in all {
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let mut cmd = kiln();
        cmd.current_dir(root);
        if rel.ends_with(".args") {
            let args = std::fs::read_to_string(&path).unwrap();
            cmd.args(args.split_whitespace());
        } else {
            cmd.arg("check").arg(&rel);
            let bytes = std::fs::read(&path).unwrap();
            let text = String::from_utf8_lossy(&bytes);
            if let Some(line) = text.lines().find_map(|l| l.strip_prefix("# args:")) {
                cmd.args(line.split_whitespace());
            }
        }
        let stderr = run_case(&stem, cmd);
        // Distinct cases give distinct first lines.
        let first = stderr
            .lines()
            .find(|l| l.contains('×'))
            .unwrap_or("")
            .to_string();
        assert!(
            messages.insert(first.clone()),
            "case `{stem}` repeats the message {first:?}"
        );
        insta::assert_snapshot!(format!("diag_{stem}"), stderr);
    }
}

#[test]
fn a_megabyte_of_garbage_fails_fast_and_cleanly() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("garbage");
    std::fs::create_dir_all(&dir).unwrap();
    // Deterministic printable garbage with newlines, a little over 1 MB.
    let mut state = 0x2545f4914f6cdd1du64;
    let mut text = String::with_capacity(1 << 20);
    while text.len() < (1 << 20) + 17 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let c = (state % 97) as u8;
        text.push(match c {
            0..=5 => '\n',
            6..=10 => ' ',
            _ => (b'!' + (c - 11)) as char,
        });
    }
    // Starts with something that is not a keyword.
    text.insert_str(0, "%%");
    std::fs::write(dir.join("garbage_1mb.kiln"), &text).unwrap();
    let mut cmd = kiln();
    cmd.current_dir(&dir).args(["check", "garbage_1mb.kiln"]);
    let start = std::time::Instant::now();
    let stderr = run_case("garbage_1mb", cmd);
    assert!(
        stderr.len() < 4000,
        "the message stays short, got {} bytes",
        stderr.len()
    );
    // Not a timing assertion on speed, only a guard against pathological backtracking.
    assert!(start.elapsed().as_secs() < 60);
    insta::assert_snapshot!("diag_garbage_1mb", stderr);
}

#[test]
fn a_very_long_line_is_shown_as_a_window() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("longline");
    std::fs::create_dir_all(&dir).unwrap();
    let mut text = String::from(
        "model m(d: int = 8) {\n  dims b\n  input x: f32[b, d]\n  output y = concat([",
    );
    for _ in 0..5000 {
        text.push_str("x, ");
    }
    text.push_str("nope], axis = 0)\n}\n");
    std::fs::write(dir.join("long.kiln"), &text).unwrap();
    let mut cmd = kiln();
    cmd.current_dir(&dir).args(["check", "long.kiln"]);
    let stderr = run_case("long_line", cmd);
    assert!(stderr.contains("unknown name `nope`"), "{stderr}");
    assert!(
        stderr.contains("long.kiln:4:"),
        "the location names line 4: {stderr}"
    );
    assert!(
        stderr.len() < 3000,
        "the long line is cut to a window: {} bytes",
        stderr.len()
    );
}
