//! Training options fairseq users reach for, through `kiln train` on the generated task:
//! the `inverse_sqrt`, `cosine` and `fixed` schedules, gradient clipping by global norm
//! and decoupled weight decay — each changes the trajectory, is kept on resume
//! (bit-identical to an uninterrupted run) and is refused where it cannot run — and the
//! validation BLEU logged with how it was computed.

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
    train_ok(&a, &[]);
    let (pa, sa) = final_state(&a, 20);
    // inverse_sqrt after its warmup of 8: lr · sqrt(8 / 20).
    let want = 3.0e-3 * (8.0f64 / 20.0).sqrt();
    assert!((sa.lr - want).abs() < 1e-15, "{} against {want}", sa.lr);
    // 10 steps, a resume, 10 more: the same bits.
    let b = run_with("fairseq_resumed", FAIRSEQ, opts);
    train_ok(&b, &["--max-steps", "10"]);
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
        train_ok(&c, &[]);
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
    train_ok(&a, &[]);
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
    train_ok(&f, &["--max-steps", "10"]);
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

#[test]
fn validation_bleu_is_logged_with_its_signature() {
    let dir = workspace("bleu_signature", "");
    train_ok(&dir, &["--max-steps", "10"]);
    let log = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let valid: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "valid")
        .collect();
    assert_eq!(valid.len(), 1, "{log}");
    assert!(valid[0]["bleu"].is_f64(), "{log}");
    assert_eq!(
        valid[0]["bleu_signature"],
        "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0\
         |beam:2|alpha:0.6|penalty:gnmt|stop:k-finished|max_len:1.0x+5"
    );
    assert!(log
        .lines()
        .filter(|l| l.contains("\"train\""))
        .all(|l| !l.contains("signature")));
}

/// With BLEU computed, `best/` and the state's best step follow the highest validation
/// BLEU; with `metric: loss`, the lowest validation loss.
#[test]
fn the_best_step_follows_the_metric() {
    let valid = |dir: &std::path::Path| -> Vec<(u64, f64, f64)> {
        std::fs::read_to_string(dir.join("run/metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["kind"] == "valid")
            .map(|v| {
                let (s, l, b) = (v["step"].as_u64(), v["loss"].as_f64(), v["bleu"].as_f64());
                (s.unwrap(), l.unwrap(), b.unwrap())
            })
            .collect()
    };
    let best_step = |dir: &std::path::Path| -> u64 {
        let state =
            std::fs::read_to_string(dir.join("run/checkpoints/step_00000020/state.yaml")).unwrap();
        let line = state.lines().find_map(|l| l.strip_prefix("best_step: "));
        line.expect("best_step in state.yaml").parse().unwrap()
    };
    for (name, metric) in [("best_by_bleu", ""), ("best_by_loss", " metric: loss,")] {
        let dir = workspace(name, "");
        edit_cfg(
            &dir,
            "valid: {every: 10,",
            &format!("valid: {{every: 5,{metric}"),
        );
        train_ok(&dir, &[]);
        let v = valid(&dir);
        assert_eq!(v.len(), 4, "{v:?}");
        // The first of the best, as a strict improvement keeps it.
        let pick = if metric.is_empty() {
            v.iter().fold(v[0], |b, x| if x.2 > b.2 { *x } else { b })
        } else {
            v.iter().fold(v[0], |b, x| if x.1 < b.1 { *x } else { b })
        };
        assert_eq!(best_step(&dir), pick.0, "{name}: {v:?}");
    }
}
