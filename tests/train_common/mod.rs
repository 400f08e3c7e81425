//! Helpers of the training tests (`tests/train.rs`), and the GPU training tests
//! ([`gpu`]), which `tests/cuda_emulated.rs` also runs on the emulated device.
#![allow(dead_code)]

#[path = "../common/cuda.rs"]
mod cuda;
// (Each test binary uses some of them.)
#[allow(unused_imports)]
pub use cuda::{cuda_available, emulated, emulation, require_cuda_or_skip};

pub mod gpu;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiln_train::checkpoint;
use kiln_train::synthetic::Task;

pub fn kiln(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .output()
        .expect("kiln runs")
}

pub fn ok(dir: &Path, args: &[&str]) -> String {
    let out = kiln(dir, args);
    assert!(
        out.status.success(),
        "kiln {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A fresh directory with the generated task and a tiny configuration.
pub fn workspace(name: &str, extra: &str) -> PathBuf {
    // The emulated device's runs (`tests/cuda_emulated.rs`) apart from the plain ones,
    // which may run at the same time.
    let root = if emulated() {
        "train-emulated"
    } else {
        "train"
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(root)
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let task = Task::new(3, 3, 6);
    for (file, seed, n) in [("train", 1, 600), ("valid", 2, 12)] {
        let pairs = task.pairs(seed, n);
        let src: String = pairs.iter().map(|(s, _)| format!("{s}\n")).collect();
        let tgt: String = pairs.iter().map(|(_, t)| format!("{t}\n")).collect();
        std::fs::write(dir.join(format!("{file}.src")), src).unwrap();
        std::fs::write(dir.join(format!("{file}.tgt")), tgt).unwrap();
    }
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer_base.kiln");
    let cfg = format!(
        "model:\n  spec: {}\n  set: {{d_model: 16, d_ff: 32, h: 2, n: 1, p_drop: 0.1}}\n\
         data: {{train_src: train.src, train_tgt: train.tgt, valid_src: valid.src, valid_tgt: valid.tgt, vocab_size: 220, byte_fallback: false, max_len: 32}}\n\
         batch: {{max_src_tokens: 120, max_tgt_tokens: 120, update_freq: 2}}\n\
         schedule: {{warmup: 50, factor: 1.0}}\n\
         train: {{max_steps: 20, executor: reference, log_every: 5}}\n\
         checkpoint: {{dir: run, every: 10, keep: 3}}\n\
         valid: {{every: 10, beam: 2, max_len_b: 5, max_sentences: 4}}\n{extra}",
        spec.display()
    );
    std::fs::write(dir.join("cfg.yaml"), cfg).unwrap();
    dir
}

/// Every parameter and moment as (name, shape, bits).
pub type Snapshot = Vec<(String, Vec<usize>, Vec<u32>)>;

/// Every tensor of `a` and `b` the same, name for name and bit for bit (`what` says how
/// `b` was made, for the message).
pub fn same_bits(a: &Snapshot, b: &Snapshot, what: &str) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!((&x.0, &x.1), (&y.0, &y.1));
        assert!(x.2 == y.2, "`{}` differs {what}", x.0);
    }
}

pub fn final_state(dir: &Path, step: u64) -> (Snapshot, checkpoint::TrainState) {
    let ck = dir.join("run/checkpoints").join(checkpoint::dir_name(step));
    let loaded = checkpoint::load(&ck).unwrap();
    let mut all = Vec::new();
    for (prefix, map) in [
        ("p", &loaded.params),
        ("m", &loaded.moments.m),
        ("v", &loaded.moments.v),
    ] {
        for (k, t) in map {
            let bits = t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect();
            all.push((format!("{prefix}.{k}"), t.shape.clone(), bits));
        }
    }
    (all, loaded.state)
}

/// Replaces `from` (which must be there) by `to` in the workspace configuration.
pub fn edit_cfg(dir: &Path, from: &str, to: &str) {
    let path = dir.join("cfg.yaml");
    let cfg = std::fs::read_to_string(&path).unwrap();
    assert!(cfg.contains(from), "no `{from}` in:\n{cfg}");
    std::fs::write(&path, cfg.replace(from, to)).unwrap();
}

/// Replaces the workspace configuration's `train` section.
pub fn set_train(dir: &Path, train: &str) {
    let old = "train: {max_steps: 20, executor: reference, log_every: 5}";
    edit_cfg(dir, old, &format!("train: {{{train}}}"));
}

/// A diagnostic on one line: its wrapped lines (`\n  │ `) joined with spaces.
pub fn unwrapped(stderr: &[u8]) -> String {
    String::from_utf8_lossy(stderr)
        .lines()
        .map(|l| l.trim_start().trim_start_matches('│').trim())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Asserts that `text` (a command's output or [`unwrapped`] message) contains `want`.
#[track_caller]
pub fn says(text: &str, want: &str) {
    assert!(text.contains(want), "{want:?} not in:\n{text}");
}

/// Runs `kiln` in `dir`, which must fail with status 1 (an error, not a panic); its
/// stderr as [`unwrapped`] gives it.
pub fn fails(dir: &Path, args: &[&str]) -> String {
    let out = kiln(dir, args);
    let err = unwrapped(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "kiln {args:?}: {err}");
    assert!(!err.contains("panicked"), "kiln {args:?}: {err}");
    err
}

/// `kiln train --config cfg.yaml --quiet` and `extra` in `dir`, which must succeed
/// ([`ok`]).
pub fn train_ok(dir: &Path, extra: &[&str]) -> String {
    let mut args = vec!["train", "--config", "cfg.yaml", "--quiet"];
    args.extend_from_slice(extra);
    ok(dir, &args)
}

/// `kiln train --config cfg.yaml --quiet` in `dir`, which must fail ([`fails`]).
pub fn train_fails(dir: &Path) -> String {
    fails(dir, &["train", "--config", "cfg.yaml", "--quiet"])
}

/// A [`workspace`] with each `(from, to)` of `edits` made to its configuration
/// ([`edit_cfg`]).
pub fn workspace_edited(name: &str, edits: &[(&str, &str)]) -> PathBuf {
    let dir = workspace(name, "");
    for (from, to) in edits {
        edit_cfg(&dir, from, to);
    }
    dir
}

/// The trainer's metrics log: ("step kind", loss) of every training and validation
/// record.
pub fn logged_losses(dir: &Path) -> Vec<(String, f64)> {
    let text = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((
                format!("{} {}", v.get("step")?.as_u64()?, v.get("kind")?.as_str()?),
                v.get("loss")?.as_f64()?,
            ))
        })
        .collect()
}

/// The runs in `a` and `b` logged the same records, with losses within 1e-4 relative.
pub fn same_losses(a: &Path, b: &Path, name_a: &str, name_b: &str) {
    let (la, lb) = (logged_losses(a), logged_losses(b));
    assert!(la.len() >= 2, "{la:?}");
    assert_eq!(
        la.iter().map(|x| &x.0).collect::<Vec<_>>(),
        lb.iter().map(|x| &x.0).collect::<Vec<_>>()
    );
    for ((s, x), (_, y)) in la.iter().zip(&lb) {
        assert!(
            (x - y).abs() <= 1e-4 * x.abs(),
            "step {s}: {name_a} loss {x}, {name_b} {y}"
        );
    }
}

/// The relative distance of two parameter snapshots: ‖a − b‖ / ‖a‖ over every tensor.
pub fn relative_distance(a: &Snapshot, b: &Snapshot) -> f64 {
    let (mut d2, mut n2) = (0.0f64, 0.0f64);
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!((&x.0, &x.1), (&y.0, &y.1));
        for (&p, &q) in x.2.iter().zip(&y.2) {
            let (p, q) = (f64::from(f32::from_bits(p)), f64::from(f32::from_bits(q)));
            d2 += (p - q) * (p - q);
            n2 += p * p;
        }
    }
    (d2 / n2).sqrt()
}

/// `kiln compile --config cfg.yaml --target cuda -o art` (which needs no GPU, and must
/// succeed), then `kiln train --config cfg.yaml --artifact art --quiet` in `dir`: its
/// output.
pub fn compile_and_train(dir: &Path) -> Output {
    ok(
        dir,
        &[
            "compile", "--config", "cfg.yaml", "--target", "cuda", "-o", "art",
        ],
    );
    train_from_artifact(dir)
}

/// `kiln train --config cfg.yaml --artifact art --quiet` in `dir`: its output.
pub fn train_from_artifact(dir: &Path) -> Output {
    kiln(
        dir,
        &[
            "train",
            "--config",
            "cfg.yaml",
            "--artifact",
            "art",
            "--quiet",
        ],
    )
}

/// A workspace with `train: {<train>}`, its configuration compiled to a CUDA artifact and
/// trained from it; `None` (after printing why) where there is no GPU.
pub fn gpu_run(name: &str, train: &str) -> Option<PathBuf> {
    gpu_run_edited(name, train, &[])
}

/// [`gpu_run`] with `edits` (`from`, `to`) made to the configuration first.
pub fn gpu_run_edited(name: &str, train: &str, edits: &[(&str, &str)]) -> Option<PathBuf> {
    let dir = workspace(name, "");
    set_train(&dir, train);
    for (from, to) in edits {
        edit_cfg(&dir, from, to);
    }
    let out = compile_and_train(&dir);
    require_cuda_or_skip()?;
    assert!(out.status.success(), "{}", unwrapped(&out.stderr));
    Some(dir)
}
