//! The optimizer options fairseq users reach for, through `kiln train` on the generated
//! task: the `inverse_sqrt`, `cosine` and `fixed` schedules, gradient clipping by global
//! norm and decoupled weight decay — each changes the trajectory, is kept on resume
//! (bit-identical to an uninterrupted run) and is refused where it cannot run.

mod train_common;

use train_common::*;

const FAIRSEQ: &str =
    "schedule: {kind: inverse_sqrt, lr: 3.0e-3, warmup: 8, warmup_init_lr: 1.0e-7}";

/// A workspace whose schedule line is `schedule` and optimizer `optimizer`.
fn run_with(name: &str, schedule: &str, optimizer: &str) -> std::path::PathBuf {
    let dir = workspace(name, optimizer);
    edit_cfg(&dir, "schedule: {warmup: 50, factor: 1.0}", schedule);
    dir
}

#[test]
fn fairseq_options_train_resume_and_change_the_trajectory() {
    let opts = "optimizer: {clip_norm: 0.5, weight_decay: 0.01}\n";
    let a = run_with("fairseq_straight", FAIRSEQ, opts);
    ok(&a, &["train", "--config", "cfg.yaml", "--quiet"]);
    let (pa, sa) = final_state(&a, 20);
    // inverse_sqrt after its warmup of 8: lr · sqrt(8 / 20).
    let want = 3.0e-3 * (8.0f64 / 20.0).sqrt();
    assert!((sa.lr - want).abs() < 1e-15, "{} against {want}", sa.lr);
    // 10 steps, a resume, 10 more: the same bits.
    let b = run_with("fairseq_resumed", FAIRSEQ, opts);
    ok(
        &b,
        &[
            "train",
            "--config",
            "cfg.yaml",
            "--quiet",
            "--max-steps",
            "10",
        ],
    );
    ok(
        &b,
        &["train", "--resume", "run", "--quiet", "--max-steps", "20"],
    );
    let (pb, _) = final_state(&b, 20);
    same_bits(&pa, &pb, "after resuming with clipping and weight decay");
    // Each option moves the parameters elsewhere than the run without it.
    for (name, other) in [
        ("fairseq_no_clip", "optimizer: {weight_decay: 0.01}\n"),
        ("fairseq_no_decay", "optimizer: {clip_norm: 0.5}\n"),
    ] {
        let c = run_with(name, FAIRSEQ, other);
        ok(&c, &["train", "--config", "cfg.yaml", "--quiet"]);
        let (pc, _) = final_state(&c, 20);
        assert!(relative_distance(&pa, &pc) > 0.0, "{name}");
    }
    // The run's configuration keeps the options.
    let kept = std::fs::read_to_string(a.join("run/config.yaml")).unwrap();
    for want in ["kind: inverse_sqrt", "clip_norm: 0.5", "weight_decay: 0.01"] {
        assert!(kept.contains(want), "{want} in {kept}");
    }
    // Resuming under another schedule is refused, naming it.
    let run_cfg = b.join("run/config.yaml");
    let text = std::fs::read_to_string(&run_cfg).unwrap();
    std::fs::write(&run_cfg, text.replace("kind: inverse_sqrt", "kind: fixed")).unwrap();
    let err = fails(
        &b,
        &["train", "--resume", "run", "--quiet", "--max-steps", "30"],
    );
    assert!(err.contains("differs in `schedule`"), "{err}");
}

#[test]
fn cosine_and_fixed_schedules_reach_their_rates() {
    let a = run_with(
        "cosine",
        "schedule: {kind: cosine, lr: 2.0e-3, warmup: 4, min_lr: 1.0e-4}",
        "",
    );
    ok(&a, &["train", "--config", "cfg.yaml", "--quiet"]);
    // The period is train.max_steps (20): min_lr at its end.
    let (_, s) = final_state(&a, 20);
    assert!((s.lr - 1.0e-4).abs() < 1e-15, "{}", s.lr);
    let (_, s) = final_state(&a, 10);
    let t = (10.0 - 4.0) / (20.0 - 4.0);
    let want = 1.0e-4 + (2.0e-3 - 1.0e-4) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos());
    assert!((s.lr - want).abs() < 1e-15, "{} against {want}", s.lr);
    let f = run_with(
        "fixed",
        "schedule: {kind: fixed, lr: 1.0e-3, warmup: 0}",
        "",
    );
    ok(
        &f,
        &[
            "train",
            "--config",
            "cfg.yaml",
            "--quiet",
            "--max-steps",
            "10",
        ],
    );
    let (_, s) = final_state(&f, 10);
    assert_eq!(s.lr, 1.0e-3);
}

#[test]
fn optimizer_options_are_checked_before_a_run_starts() {
    let dir = run_with(
        "optimizer_refused",
        "schedule: {kind: cosine}",
        "optimizer: {clip_norm: -1}\n",
    );
    let err = train_fails(&dir);
    for want in [
        "schedule.lr is missing: the `cosine` schedule needs its peak learning rate",
        "optimizer.clip_norm is -1; give a finite number, 0 (off) or more",
    ] {
        assert!(err.contains(want), "{want:?} in {err}");
    }
    assert!(!dir.join("run").exists());
}
