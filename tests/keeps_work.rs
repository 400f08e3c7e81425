//! Commands never destroy work on disk (#59, "Destroys work"): no writing command
//! overwrites a checkpoint, a run or its own inputs; a run never starts on an empty
//! validation set; a failed start leaves nothing that stops its retry; and a run never
//! writes into the current directory by an empty `checkpoint.dir`.

mod train_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use train_common::{edit_cfg, fails, kiln, ok, says, set_train, train_fails, train_ok, workspace};

/// Every file under `dir` (relative paths) with its size and a digest of its bytes.
fn tree(dir: &Path) -> BTreeMap<PathBuf, (usize, u64)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_path_buf();
                let bytes = std::fs::read(&p).unwrap();
                let mut h = std::hash::DefaultHasher::new();
                std::hash::Hash::hash(&bytes, &mut h);
                out.insert(rel, (bytes.len(), std::hash::Hasher::finish(&h)));
            }
        }
    }
    out
}

/// `kiln init`, `export`, `import`, `run -o` and `compile -o` refuse to write over a
/// checkpoint, into a run, a model directory or an artifact, or over their own inputs,
/// and every file there keeps its bytes; another existing file is replaced.
#[test]
fn writing_commands_refuse_checkpoints_runs_and_their_inputs() {
    let dir = workspace("keeps_outputs", "");
    train_ok(&dir, &[]);
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer_tiny.kiln");
    std::fs::copy(&spec, dir.join("m.kiln")).unwrap();
    std::fs::copy(
        spec.with_file_name("transformer_base.kiln"),
        dir.join("transformer_base.kiln"),
    )
    .unwrap();
    ok(&dir, &["export", "run/best", "-o", "torch.safetensors"]);
    ok(
        &dir,
        &["compile", "m.kiln", "--entries", "forward", "-o", "art"],
    );
    let before = tree(&dir);
    let ck = "run/checkpoints/step_00000020";
    let ck_model = "run/checkpoints/step_00000020/model.safetensors";
    let run = |inputs: &'static str, out: &'static str| {
        vec![
            "run", "m.kiln", "--entry", "forward", "--inputs", inputs, "-o", out,
        ]
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["init", "m.kiln", "-o", ck_model],
            "is inside a training checkpoint",
        ),
        (
            vec!["init", "m.kiln", "-o", "run/best/model.safetensors"],
            "is inside a model directory",
        ),
        (
            vec!["init", "m.kiln", "-o", "run/metrics.jsonl"],
            "is inside a training run's directory",
        ),
        (
            vec!["init", "m.kiln", "-o", "m.kiln"],
            "is one of the inputs (`m.kiln`)",
        ),
        (
            vec!["init", "m.kiln", "-o", "art/weights.safetensors"],
            "is inside a compiled artifact",
        ),
        (
            vec!["export", ck, "-o", ck_model],
            "is inside a training checkpoint",
        ),
        (
            vec!["export", "run/best", "-o", "run/torch.safetensors"],
            "is inside a training run's directory",
        ),
        (
            vec!["import", "torch.safetensors", "-o", "torch.safetensors"],
            "is one of the inputs (`torch.safetensors`)",
        ),
        (
            vec!["import", "torch.safetensors", "-o", ck_model],
            "is inside a training checkpoint",
        ),
        (
            run("in.safetensors", ck_model),
            "is inside a training checkpoint",
        ),
        (
            run("torch.safetensors", "torch.safetensors"),
            "is one of the inputs (`torch.safetensors`)",
        ),
        (
            vec!["compile", "m.kiln", "--entry", "forward", "-o", "m.kiln"],
            "is one of the inputs (`m.kiln`)",
        ),
        (
            vec!["compile", "m.kiln", "--entries", "forward", "-o", "run"],
            "is a training run's directory",
        ),
        (
            vec!["compile", "m.kiln", "--entries", "forward", "-o", ck],
            "is a training checkpoint",
        ),
        (
            vec!["compile", "--from-model", "run/best", "-o", "run/best"],
            "is one of the inputs (`run/best`)",
        ),
        (
            vec!["average", ck, "-o", "run/avg"],
            "is inside a training run's directory",
        ),
    ];
    for (args, want) in &cases {
        let out = kiln(&dir, args);
        let err = train_common::unwrapped(&out.stderr).replace("/ ", "/");
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        says(&err, want);
        says(&err, "choose another -o");
        assert_eq!(tree(&dir), before, "{args:?} changed a file");
    }
    // An artifact is replaced as a whole, and a file that belongs to nothing as well.
    ok(
        &dir,
        &["compile", "m.kiln", "--entries", "forward", "-o", "art"],
    );
    std::fs::write(dir.join("plain.safetensors"), b"old").unwrap();
    ok(&dir, &["init", "m.kiln", "-o", "plain.safetensors"]);
    assert_ne!(
        std::fs::read(dir.join("plain.safetensors")).unwrap(),
        b"old"
    );
    // The trained run still resumes and translates.
    ok(
        &dir,
        &["train", "--resume", "run", "--quiet", "--max-steps", "21"],
    );
}

/// A validation set without a pair is a configuration error before anything is written,
/// not a validation loss of 0 that keeps a "best" model.
#[test]
fn an_empty_validation_set_is_refused_before_the_run_starts() {
    for (name, text) in [("valid_empty", ""), ("valid_blank", "\n  \n\n")] {
        let dir = workspace(name, "");
        std::fs::write(dir.join("valid.src"), text).unwrap();
        std::fs::write(dir.join("valid.tgt"), text).unwrap();
        let err = train_fails(&dir);
        says(&err, "has no pair to validate on");
        says(
            &err,
            "data.valid_src and data.valid_tgt must hold at least one pair",
        );
        assert!(
            !dir.join("run").exists(),
            "{name}: the run directory was made"
        );
    }
}

/// A start that fails writes nothing that stops its retry: the configuration is checked
/// before the vocabulary is trained, and a start that fails later (here, on the data) left
/// only a vocabulary, which the retry with other settings trains again.
#[test]
fn a_failed_start_can_be_retried_in_its_directory() {
    let dir = workspace("failed_start", "");
    set_train(&dir, "max_steps: 20, executor: cuda, log_every: 5");
    let err = train_fails(&dir);
    says(
        &err,
        "`train.executor: cuda` runs a compiled `--target cuda` artifact",
    );
    assert!(
        !dir.join("run").exists(),
        "the failed start wrote the run directory"
    );
    edit_cfg(&dir, "executor: cuda", "executor: reference");
    // Every training pair longer than data.max_len: the start fails after the vocabulary.
    edit_cfg(&dir, "max_len: 32", "max_len: 1");
    let err = train_fails(&dir);
    says(&err, "no training pairs left");
    assert!(dir.join("run/tokenizer.json").is_file());
    assert!(
        !dir.join("run/config.yaml").exists(),
        "a failed start wrote its configuration"
    );
    edit_cfg(&dir, "max_len: 1", "max_len: 32");
    edit_cfg(&dir, "vocab_size: 220", "vocab_size: 200");
    train_ok(&dir, &["--max-steps", "10"]);
    assert!(dir.join("run/checkpoints/step_00000010").is_dir());
    // An older kiln's failed start: its configuration without a logged step.
    let old = workspace("failed_start_old", "");
    std::fs::create_dir_all(old.join("run")).unwrap();
    std::fs::copy(dir.join("run/config.yaml"), old.join("run/config.yaml")).unwrap();
    train_ok(&old, &["--max-steps", "10"]);
    // A run that trained is still refused.
    edit_cfg(&old, "vocab_size: 220", "vocab_size: 200");
    says(&train_fails(&old), "already holds checkpoints");
}

/// `checkpoint.dir: ""` (or `--dir ""`) would write the run into the current directory,
/// and a file is no run directory.
#[test]
fn an_empty_or_file_checkpoint_dir_is_refused() {
    let dir = workspace("empty_checkpoint_dir", "");
    edit_cfg(&dir, "dir: run,", "dir: \"\",");
    let before = tree(&dir);
    says(
        &train_fails(&dir),
        "checkpoint.dir is empty, which would write the run into the current directory",
    );
    assert_eq!(tree(&dir), before);
    edit_cfg(&dir, "dir: \"\",", "dir: run,");
    let before = tree(&dir);
    // (The command line refuses an empty value itself.)
    let out = kiln(
        &dir,
        &["train", "--config", "cfg.yaml", "--quiet", "--dir", ""],
    );
    assert_eq!(out.status.code(), Some(2));
    says(
        &String::from_utf8_lossy(&out.stderr),
        "a value is required for '--dir <DIR>'",
    );
    assert_eq!(tree(&dir), before);
    std::fs::write(dir.join("afile"), b"mine").unwrap();
    let err = fails(
        &dir,
        &["train", "--config", "cfg.yaml", "--quiet", "--dir", "afile"],
    );
    says(&err, "is a file, not a directory");
    assert_eq!(std::fs::read(dir.join("afile")).unwrap(), b"mine");
}

/// #59 item 18: what a write killed by a signal leaves — a whole artifact as
/// `ART.tmp-PID` and `ART.tmp-PID-old`, `training.png.tmp-PID-N.png`,
/// `best/graphs.tmp-PID` — is removed by the next compile or run, when that process is
/// gone; a file of the user's with a similar name, beside the artifact, stays.
#[test]
fn temporary_files_of_killed_writes_are_removed_by_the_next_run() {
    let dir = workspace("stale_temps", "");
    train_ok(&dir, &[]);
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer_tiny.kiln");
    let spec = spec.to_str().unwrap();
    ok(
        &dir,
        &["compile", spec, "--entries", "forward", "-o", "art"],
    );
    // 4294967294 is no process's id.
    let dead = "4294967294";
    let planted = [
        format!("art.tmp-{dead}/manifest.json"),
        format!("art.tmp-{dead}-old/manifest.json"),
        format!("run/training.png.tmp-{dead}-0.png"),
        format!("run/best/graphs.tmp-{dead}"),
    ];
    for p in &planted {
        let p = dir.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, b"left by a kill").unwrap();
    }
    let users = dir.join(format!("notes.tmp-{dead}"));
    std::fs::write(&users, b"mine").unwrap();
    ok(
        &dir,
        &["compile", spec, "--entries", "forward", "-o", "art"],
    );
    assert!(!dir.join(format!("art.tmp-{dead}")).exists());
    assert!(!dir.join(format!("art.tmp-{dead}-old")).exists());
    assert_eq!(std::fs::read(&users).unwrap(), b"mine");
    ok(
        &dir,
        &["train", "--resume", "run", "--max-steps", "30", "--quiet"],
    );
    for p in &planted[2..] {
        assert!(!dir.join(p).exists(), "{p} survived the resumed run");
    }
}

/// #59 item 15: a loss that explodes but stays finite (a learning rate a thousand times
/// the schedule's) stops the run with a named error — the step, the loss, its lowest —
/// and a non-zero exit, instead of training on and keeping a `best/` of it.
#[test]
fn a_run_whose_finite_loss_explodes_stops_as_diverged() {
    let dir = workspace("diverged", "");
    edit_cfg(&dir, "factor: 1.0}", "factor: 1000.0}");
    edit_cfg(
        &dir,
        "log_every: 5}",
        "log_every: 5, divergence: {factor: 4, steps: 3}}",
    );
    let err = train_fails(&dir);
    assert!(
        err.contains("the run diverged") && err.contains("times the lowest it reached"),
        "{err}"
    );
    assert!(
        !dir.join("run/best").exists(),
        "no best model of a diverged run"
    );
}

/// #59 item 17: a resumed run says the steps it took and the step they took it to, not
/// the run's total as if it had trained them all.
#[test]
fn a_resumed_run_reports_the_steps_it_took() {
    let dir = workspace("resumed_report", "");
    train_ok(&dir, &[]);
    let out = ok(&dir, &["train", "--resume", "run", "--max-steps", "30"]);
    assert!(out.contains("trained 10 steps (to step 30) in "), "{out}");
}
