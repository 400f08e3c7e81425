//! Hostile input that once panicked, aborted or hung (#59, items 5–11): each case exits
//! with a clear error, no panic, the message's key phrase, and leaves the files it was
//! given as they were. (Spec cases that fit a file are in the catalog,
//! `tests/diagnostics/`.)

mod common;

use std::path::{Path, PathBuf};

use common::{flat, kiln, root};

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("hostile_input")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `kiln args`, which must fail with `code`, no panic, and `want` in its error.
fn refused(args: &[&str], code: i32, want: &str) -> String {
    let out = kiln(args);
    let err = flat(&String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(code), "kiln {args:?}: {err}");
    assert!(!err.contains("panicked"), "kiln {args:?}: {err}");
    assert!(err.contains(want), "kiln {args:?}: `{want}` not in:\n{err}");
    err
}

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

/// Item 7: a spec with names of a million characters is refused at its first long name,
/// at once — no quadratic "did you mean" between two of them.
#[test]
fn names_of_a_million_characters_are_refused_at_once() {
    let dir = tmp("long_names");
    let spec = dir.join("long.kiln");
    let (a, b) = ("a".repeat(1_000_000), "b".repeat(1_000_000));
    let text = format!(
        "layer {a}(d: int) (x) {{\n  return x\n}}\n\nmodel m(d: int = 8) {{\n  dims batch\n  \
         input x: f32[batch, d]\n  output y = {b}(x, d = d)\n}}\n"
    );
    std::fs::write(&spec, &text).unwrap();
    let err = refused(
        &["check", spec.to_str().unwrap()],
        1,
        "a name of 1000000 characters; names have at most 256",
    );
    assert!(err.len() < 20_000, "the message quotes the whole name");
    assert_eq!(bytes(&spec), text.as_bytes());
}

/// The fuzz target's slowest finding: a spec that elaborates to more graph nodes than
/// the bound (`repeat` counts in the thousands) is refused when it reaches the bound,
/// naming the bound and the place.
#[test]
fn a_model_past_the_node_bound_is_refused() {
    let spec = root().join("models/parsing.kiln");
    let err = refused(
        &["check", spec.to_str().unwrap(), "--set", "n=1100"],
        1,
        "the model elaborates to more than 250000 graph nodes",
    );
    assert!(err.contains("check the `repeat` counts"), "{err}");
}

/// Item 11: a spec that never ends (a device) is refused at its size bound, not read
/// until memory runs out. (An import of one is in the catalog.)
#[test]
fn a_spec_that_never_ends_is_refused() {
    refused(
        &["check", "/dev/zero"],
        1,
        "`/dev/zero` is larger than 16 MiB, too large for a spec",
    );
}

/// Item 8: `--beam` is bounded, and a negative one is named as a bad value, not as an
/// unknown flag.
#[test]
fn a_beam_out_of_range_is_refused_with_its_bounds() {
    let nowhere = tmp("beam").join("nowhere");
    let ck = nowhere.to_str().unwrap();
    for beam in ["10000", "0", "-1"] {
        let err = refused(
            &["translate", "--checkpoint", ck, "--beam", beam],
            2,
            "--beam",
        );
        assert!(err.contains("1 to 256"), "--beam {beam}: {err}");
        assert!(!err.contains("unexpected argument"), "--beam {beam}: {err}");
    }
}

/// Item 10: more worker threads than a few per core are refused before any work.
#[test]
fn too_many_threads_are_refused() {
    let nowhere = tmp("threads").join("nowhere");
    refused(
        &[
            "translate",
            "--checkpoint",
            nowhere.to_str().unwrap(),
            "--threads",
            "100000",
        ],
        1,
        "100000 threads is more than 4 per core",
    );
}

/// Item 11: a configuration that never ends, or that nests 100,000 flow lists deep, is
/// refused at once, before a run directory or a vocabulary is written.
#[test]
fn configurations_too_large_or_too_deep_are_refused() {
    let dir = tmp("config");
    refused(
        &["train", "--config", "/dev/zero"],
        1,
        "too large for a configuration",
    );
    let deep = dir.join("deep.yaml");
    let text = format!("data: {}{}\n", "[".repeat(100_000), "]".repeat(100_000));
    std::fs::write(&deep, &text).unwrap();
    refused(
        &["train", "--config", deep.to_str().unwrap()],
        1,
        "nested 100000 deep, more than the 32",
    );
    assert_eq!(bytes(&deep), text.as_bytes());
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(left.len(), 1, "only the configuration: {left:?}");
    // A shipped configuration still loads (its nesting is shallow).
    let base = root().join("models/configs/base.yaml");
    kiln_train::config::Config::load(&base).unwrap();
}

/// Item 14: `kiln compile --validate` of a model with a vocabulary of one draws its
/// random ids inside the table (id 0), and the validation passes.
#[test]
fn validation_of_a_one_word_vocabulary_draws_ids_in_range() {
    let dir = tmp("vocab_one");
    let out = dir.join("kernels.txt");
    let spec = root().join("models/transformer_tiny.kiln");
    let run = kiln(&[
        "compile",
        spec.to_str().unwrap(),
        "--set",
        "vocab=1",
        "--entry",
        "forward",
        "--validate",
        "-o",
        out.to_str().unwrap(),
    ]);
    let err = flat(&String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{err}");
    assert!(err.contains("passed"), "{err}");
    assert!(out.is_file());
}

/// Item 17: `--max-steps +2` reads as 2 to a number parser but means "2 more" to a
/// person: it is refused with what the flag counts.
#[test]
fn a_relative_step_count_is_refused() {
    let nowhere = tmp("max_steps").join("run");
    refused(
        &[
            "train",
            "--resume",
            nowhere.to_str().unwrap(),
            "--max-steps",
            "+2",
        ],
        2,
        "`+2` reads as a number of steps more, but --max-steps is the step the run trains to",
    );
}

/// Item 17: `data.max_len: 0` is named by its key when the configuration is read.
#[test]
fn a_max_len_of_zero_names_its_key() {
    let dir = tmp("max_len");
    let base = std::fs::read_to_string(root().join("models/configs/base.yaml")).unwrap();
    let cfg = dir.join("cfg.yaml");
    let text = base.replacen("  max_len: 256\n", "  max_len: 0\n", 1);
    assert_ne!(text, base);
    std::fs::write(&cfg, &text).unwrap();
    refused(
        &["train", "--config", cfg.to_str().unwrap()],
        1,
        "data.max_len is 0, which leaves no pair to train on",
    );
    assert_eq!(bytes(&cfg), text.as_bytes());
}
