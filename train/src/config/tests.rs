use super::*;

const MINIMAL: &str = "model:\n  spec: m.kiln\ndata:\n  train_src: a\n  train_tgt: b\n  valid_src: c\n  valid_tgt: d\n";

#[test]
fn defaults_are_the_papers_recipe() {
    let c = Config::parse(MINIMAL).unwrap();
    assert_eq!(
        c.optimizer,
        OptimizerConfig {
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-9,
            clip_norm: 0.0,
            weight_decay: 0.0,
        }
    );
    assert_eq!(c.schedule.warmup, 4000);
    assert_eq!(c.batch.max_src_tokens, 25_000);
    assert_eq!(c.batch.max_tgt_tokens, 25_000);
    assert_eq!(c.valid.beam, 4);
    assert_eq!(c.valid.alpha, 0.6);
    assert_eq!(c.data.vocab_size, 37000);
    assert!(
        c.data.byte_fallback,
        "new vocabularies spell unseen characters in bytes"
    );
}

#[test]
fn noam_schedule() {
    let s = ScheduleConfig::default();
    // Peak at the end of warmup: 512^-0.5 * 4000^-0.5.
    let peak = 512f64.powf(-0.5) * 4000f64.powf(-0.5);
    assert!((s.lr(512.0, 4000, 0) - peak).abs() < 1e-15);
    assert!((s.lr(512.0, 1, 0) - 512f64.powf(-0.5) * 4000f64.powf(-1.5)).abs() < 1e-18);
    assert!((s.lr(512.0, 16000, 0) - peak / 2.0).abs() < 1e-15);
    assert!(s.lr(512.0, 2000, 0) < peak && s.lr(512.0, 8000, 0) < peak);
}

#[test]
fn unknown_keys_are_named() {
    let e = Config::parse(&format!("{MINIMAL}optimizer:\n  beta3: 0.5\n")).unwrap_err();
    assert!(e.contains("unknown field `beta3`"), "{e}");
    let e = Config::parse(&format!("{MINIMAL}colour: red\n")).unwrap_err();
    assert!(e.contains("unknown field `colour`"), "{e}");
    let e = Config::parse(&format!(
        "{MINIMAL}valid:\n  every: 5\n  length_penalty: wu\n"
    ))
    .unwrap_err();
    assert!(
        e.contains("missing field") || e.contains("length_penalty"),
        "{e}"
    );
}

#[test]
fn the_stopping_rule_is_k_finished_unless_set() {
    let c = Config::parse(MINIMAL).unwrap();
    assert_eq!(c.valid.early_stop, "k-finished");
    let c = Config::parse(&format!("{MINIMAL}valid:\n  early_stop: exact\n")).unwrap();
    assert_eq!(c.valid.early_stop, "exact");
    let e = Config::parse(&format!("{MINIMAL}valid:\n  early_stop: soon\n")).unwrap_err();
    assert!(
        e.contains("valid.early_stop is `soon`; use k-finished or exact"),
        "{e}"
    );
}

#[test]
fn values_are_checked() {
    let e = Config::parse(&format!(
        "{MINIMAL}batch:\n  max_src_tokens: 100\n  max_tgt_tokens: 100\n  update_freq: 0\n"
    ))
    .unwrap_err();
    assert!(e.contains("update_freq"), "{e}");
    let e = Config::parse(&format!(
        "{MINIMAL}valid:\n  alpha: .nan\n  max_len_a: -1\n"
    ))
    .unwrap_err();
    assert!(
        e.contains("valid.alpha is NaN; give a finite number"),
        "{e}"
    );
    assert!(
        e.contains("valid.max_len_a is -1; give a finite number, 0 or more"),
        "{e}"
    );
}

#[test]
fn optimizer_and_schedule_numbers_are_finite_and_positive() {
    let e = Config::parse(&format!(
        "{MINIMAL}optimizer:\n  eps: .inf\n  beta1: .nan\nschedule:\n  factor: .nan\n  \
         d_model: 0\ntrain:\n  max_steps: 0\n"
    ))
    .unwrap_err();
    for want in [
        "optimizer.beta1 is NaN; give a number in [0, 1)",
        "optimizer.eps is inf; give a positive finite number",
        "schedule.factor is NaN; give a positive finite number",
        "schedule.d_model is 0; give a positive finite number",
        "train.max_steps is 0, so the run would take no step",
    ] {
        assert!(e.contains(want), "{want:?} in {e}");
    }
    let e = Config::parse(&format!(
        "{MINIMAL}optimizer:\n  eps: -1.0e-9\nschedule:\n  factor: -.inf\n  d_model: .nan\n"
    ))
    .unwrap_err();
    for want in [
        "optimizer.eps is -0.000000001; give a positive",
        "schedule.factor is -inf; give a positive",
        "schedule.d_model is NaN; give a positive",
    ] {
        assert!(e.contains(want), "{want:?} in {e}");
    }
    let c = Config::parse(&format!("{MINIMAL}schedule:\n  d_model: 512\n")).unwrap();
    assert_eq!(c.schedule.d_model, Some(512.0));
}

#[test]
fn data_parallel_devices_are_checked() {
    let with = |train: &str| Config::parse(&format!("{MINIMAL}train:\n{train}"));
    let c = with("  executor: cuda\n  devices: [0, 1]\n").unwrap();
    assert_eq!(c.train.devices, Some(vec![0, 1]));
    let e = with("  executor: compiled\n  devices: [0]\n").unwrap_err();
    assert!(
        e.contains("set train.executor to cuda (it is `compiled`)"),
        "{e}"
    );
    let e = with("  executor: cuda\n  devices: []\n").unwrap_err();
    assert!(e.contains("train.devices is empty"), "{e}");
    let e = with("  executor: cuda\n  devices: [1, 1]\n").unwrap_err();
    assert!(e.contains("GPU 1 twice"), "{e}");
    // Absent: nothing serialized, so the digests of earlier runs stay as they were.
    let plain = with("  executor: cuda\n").unwrap();
    assert!(!serde_yaml::to_string(&plain.train)
        .unwrap()
        .contains("devices"));
}

#[test]
fn gemm_types_are_checked() {
    let with = |train: &str| Config::parse(&format!("{MINIMAL}train:\n{train}"));
    let c = with("  gemm_type: int16\n").unwrap();
    assert_eq!(c.train.gemm_type.as_deref(), Some("int16"));
    assert_eq!(
        kiln_exec::compiled::GemmType::parse("int16"),
        Some(kiln_exec::compiled::GemmType::Kernel(
            kiln_exec::compiled::Kernel16::Int16
        ))
    );
    let e = with("  gemm_type: int4\n").unwrap_err();
    assert!(
        e.contains("train.gemm_type is `int4`; use f32, 16bit, amx, dot, fp16, int16, int8"),
        "{e}"
    );
    // int8 is for inference: refused for training, whatever the executor.
    let e = with("  gemm_type: int8\n").unwrap_err();
    assert!(
        e.contains("train.gemm_type `int8` rounds every product's operands to 8 bits")
            && e.contains("`kiln translate --gemm-type int8`"),
        "{e}"
    );
    let e = with("  executor: eager\n  gemm_type: 16bit\n").unwrap_err();
    assert!(
        e.contains("but train.executor is `eager`: set train.executor to compiled"),
        "{e}"
    );
    // f32 is every executor's precision.
    assert!(with("  executor: eager\n  gemm_type: f32\n").is_ok());
    // Absent: nothing serialized, so the digests of earlier runs stay as they were.
    assert!(!serde_yaml::to_string(&with("").unwrap().train)
        .unwrap()
        .contains("gemm_type"));
}

#[test]
fn overrides_become_set_arguments() {
    let c = Config::parse(&MINIMAL.to_string().replace(
        "  spec: m.kiln\n",
        "  spec: m.kiln\n  set:\n    d_model: 256\n    p_drop: 0.3\n    learned_pos: true\n",
    ))
    .unwrap();
    assert_eq!(
        c.overrides(),
        vec!["d_model=256", "learned_pos=true", "p_drop=0.3"]
    );
}

#[test]
fn fairseq_schedules() {
    let parse = |yaml: &str| Config::parse(&format!("{MINIMAL}schedule:\n{yaml}")).unwrap();
    // inverse_sqrt: linear from warmup_init_lr to lr over the warmup, then lr·sqrt(w/step).
    let c = parse("  kind: inverse_sqrt\n  lr: 5.0e-4\n  warmup: 4000\n  warmup_init_lr: 1.0e-7\n");
    let s = &c.schedule;
    assert_eq!(s.kind, ScheduleKind::InverseSqrt);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-15 * b.abs().max(1e-12);
    assert!(close(s.lr(0.0, 1, 0), 1e-7 + (5e-4 - 1e-7) / 4000.0));
    assert!(close(s.lr(0.0, 2000, 0), 1e-7 + (5e-4 - 1e-7) * 0.5));
    assert!(close(s.lr(0.0, 4000, 0), 5e-4));
    assert!(close(s.lr(0.0, 16000, 0), 2.5e-4));
    // cosine: the peak after the warmup, half way down at the middle, min_lr at the end
    // of the period (train.max_steps unless given) and after it.
    let c = parse("  kind: cosine\n  lr: 1.0e-3\n  warmup: 100\n  min_lr: 1.0e-5\n");
    let s = &c.schedule;
    assert!(close(s.lr(0.0, 50, 1100), 5e-4));
    assert!(close(s.lr(0.0, 100, 1100), 1e-3));
    assert!(close(s.lr(0.0, 600, 1100), 1e-5 + (1e-3 - 1e-5) * 0.5));
    assert!(close(s.lr(0.0, 1100, 1100), 1e-5));
    assert!(close(s.lr(0.0, 5000, 1100), 1e-5));
    let c = parse("  kind: cosine\n  lr: 1.0e-3\n  warmup: 0\n  period: 200\n");
    assert!(close(c.schedule.lr(0.0, 100, 1100), 5e-4));
    // fixed: the warmup, then lr.
    let c = parse("  kind: fixed\n  lr: 3.0e-4\n  warmup: 10\n");
    assert!(close(c.schedule.lr(0.0, 5, 0), 1.5e-4));
    assert!(close(c.schedule.lr(0.0, 10, 0), 3e-4));
    assert!(close(c.schedule.lr(0.0, 99_999, 0), 3e-4));
}

#[test]
fn schedule_and_optimizer_options_are_checked() {
    let err = |yaml: &str| Config::parse(&format!("{MINIMAL}{yaml}")).unwrap_err();
    let e = err("schedule:\n  kind: cosine\n");
    assert!(
        e.contains("schedule.lr is missing") && e.contains("`cosine`"),
        "{e}"
    );
    let e = err("schedule:\n  lr: 1.0e-3\n");
    assert!(
        e.contains("schedule.lr is not read by the `noam` schedule"),
        "{e}"
    );
    let e = err("schedule:\n  kind: inverse_sqrt\n  lr: 1.0e-3\n  warmup: 0\n");
    assert!(e.contains("schedule.warmup is 0"), "{e}");
    let e = err("schedule:\n  kind: fixed\n  lr: 1.0e-3\n  min_lr: 1.0e-5\n");
    assert!(e.contains("belong to the `cosine` schedule"), "{e}");
    let e = err("schedule:\n  kind: polynomial\n");
    assert!(e.contains("unknown variant `polynomial`"), "{e}");
    let e = err("optimizer:\n  clip_norm: -1\n  weight_decay: .nan\n");
    assert!(e.contains("optimizer.clip_norm is -1"), "{e}");
    assert!(e.contains("optimizer.weight_decay is NaN"), "{e}");
    let e = err("optimizer:\n  clip_norm: 1.0\ntrain:\n  executor: cuda\n");
    assert!(e.contains("not yet with train.executor: cuda"), "{e}");
    let c = Config::parse(&format!(
        "{MINIMAL}optimizer:\n  clip_norm: 0.1\n  weight_decay: 0.0001\n"
    ))
    .unwrap();
    assert_eq!(
        (c.optimizer.clip_norm, c.optimizer.weight_decay),
        (0.1, 1e-4)
    );
}

/// The new options are left out of a written configuration at their defaults, so the
/// digest a resumed run compares is that of runs from before them.
#[test]
fn default_schedule_and_optimizer_write_what_they_wrote_before() {
    let c = Config::parse(MINIMAL).unwrap();
    assert_eq!(
        serde_yaml::to_string(&c.schedule).unwrap(),
        "warmup: 4000\nfactor: 1.0\nd_model: null\n"
    );
    assert_eq!(
        serde_yaml::to_string(&c.optimizer).unwrap(),
        "beta1: 0.9\nbeta2: 0.98\neps: 1e-9\n"
    );
}

#[test]
fn the_best_model_is_judged_by_bleu_when_it_is_computed() {
    let c = Config::parse(MINIMAL).unwrap();
    assert!(c.valid.bleu);
    assert_eq!(c.valid.best_metric(), "bleu");
    let c = Config::parse(&format!("{MINIMAL}valid:\n  bleu: false\n")).unwrap();
    assert_eq!(c.valid.best_metric(), "loss");
    let c = Config::parse(&format!("{MINIMAL}valid:\n  metric: loss\n")).unwrap();
    assert_eq!(c.valid.best_metric(), "loss");
    let e = Config::parse(&format!("{MINIMAL}valid:\n  metric: ter\n")).unwrap_err();
    assert!(e.contains("valid.metric is `ter`; use loss or bleu"), "{e}");
}
