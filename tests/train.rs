//! Training end to end through the `kiln` binary, on the generated task:
//! - 20 steps straight and 10 steps + resume + 10 steps give bit-identical parameters and
//!   optimizer moments (dropout, gradient accumulation and validation included);
//! - a process killed while it writes checkpoints leaves the previous checkpoint loadable,
//!   and the run resumes from it;
//! - a configuration with an unknown key is refused, naming the key;
//! - resuming after an edit of the run's configuration that would change the trajectory
//!   (batch, schedule, …) is refused, naming the part; raising `max_steps` is accepted;
//! - translation, averaging and the PyTorch export work on the checkpoints.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiln_compiler::tensor::load_safetensors;
use kiln_runtime::checkpoint;
use kiln_runtime::synthetic::Task;

fn kiln(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .output()
        .expect("kiln runs")
}

fn ok(dir: &Path, args: &[&str]) -> String {
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
fn workspace(name: &str, extra: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("train")
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
         data: {{train_src: train.src, train_tgt: train.tgt, valid_src: valid.src, valid_tgt: valid.tgt, vocab_size: 220, max_len: 32}}\n\
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
type Snapshot = Vec<(String, Vec<usize>, Vec<u32>)>;

/// Every tensor of `a` and `b` the same, name for name and bit for bit (`what` says how
/// `b` was made, for the message).
fn same_bits(a: &Snapshot, b: &Snapshot, what: &str) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!((&x.0, &x.1), (&y.0, &y.1));
        assert!(x.2 == y.2, "`{}` differs {what}", x.0);
    }
}

fn final_state(dir: &Path, step: u64) -> (Snapshot, checkpoint::TrainState) {
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

#[test]
fn resuming_gives_bit_identical_parameters() {
    let a = workspace("straight", "");
    ok(&a, &["train", "--config", "cfg.yaml", "--quiet"]);
    let b = workspace("resumed", "");
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
    assert!(b.join("run/checkpoints/step_00000010").is_dir());
    assert!(!b.join("run/checkpoints/step_00000020").exists());
    ok(
        &b,
        &["train", "--resume", "run", "--quiet", "--max-steps", "20"],
    );
    let (pa, sa) = final_state(&a, 20);
    let (pb, sb) = final_state(&b, 20);
    same_bits(&pa, &pb, "after resuming");
    assert_eq!(sa.step, 20);
    assert_eq!((sa.epoch, sa.batch_in_epoch), (sb.epoch, sb.batch_in_epoch));
    assert_eq!(sa.tgt_tokens_seen, sb.tgt_tokens_seen);
    assert_eq!(sa.lr, sb.lr);
    // The parameters did move.
    let (p10, _) = final_state(&b, 10);
    assert!(p10.iter().zip(&pb).any(|(x, y)| x.2 != y.2));
    // The metrics log holds each step once, even with the resume.
    let log = std::fs::read_to_string(b.join("run/metrics.jsonl")).unwrap();
    let train_steps: Vec<&str> = log.lines().filter(|l| l.contains("\"train\"")).collect();
    assert_eq!(train_steps.len(), 4, "{log}");
    assert!(b.join("run/training.png").is_file());
}

#[test]
fn resuming_under_an_edited_configuration() {
    let dir = workspace("edited", "");
    ok(
        &dir,
        &[
            "train",
            "--config",
            "cfg.yaml",
            "--quiet",
            "--max-steps",
            "4",
        ],
    );
    let cfg_path = dir.join("run/config.yaml");
    let original = std::fs::read_to_string(&cfg_path).unwrap();
    assert!(original.contains("max_src_tokens: 120"), "{original}");
    let edited = original
        .replace("max_src_tokens: 120", "max_src_tokens: 100")
        .replace("warmup: 50", "warmup: 60");
    std::fs::write(&cfg_path, edited).unwrap();
    let out = kiln(&dir, &["train", "--resume", "run", "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("differs in `batch`, `schedule`"), "{err}");
    assert!(err.contains("step_00000004"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // How long to train is not part of the trajectory.
    std::fs::write(&cfg_path, original.replace("max_steps: 4", "max_steps: 6")).unwrap();
    ok(&dir, &["train", "--resume", "run", "--quiet"]);
    assert!(dir.join("run/checkpoints/step_00000006").is_dir());
}

#[test]
fn a_run_killed_while_checkpointing_resumes_from_the_last_good_checkpoint() {
    let dir = workspace("killed", "");
    // Checkpoint at every step so that a kill likely lands during a write.
    let cfg = std::fs::read_to_string(dir.join("cfg.yaml"))
        .unwrap()
        .replace(
            "checkpoint: {dir: run, every: 10, keep: 3}",
            "checkpoint: {dir: run, every: 1, keep: 2}",
        )
        .replace("max_steps: 20", "max_steps: 400")
        .replace("valid: {every: 10", "valid: {every: 1000");
    std::fs::write(dir.join("cfg.yaml"), cfg).unwrap();
    let root = dir.join("run/checkpoints");
    for (round, delay_ms) in [900u64, 1300, 1700].into_iter().enumerate() {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(if round == 0 {
                vec!["train", "--config", "cfg.yaml", "--quiet"]
            } else {
                vec!["train", "--resume", "run", "--quiet"]
            })
            .current_dir(&dir)
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        // Whatever the moment, the newest complete checkpoint loads.
        if let Some(ck) = checkpoint::latest(&root).unwrap() {
            let loaded = checkpoint::load(&ck.dir).unwrap();
            assert_eq!(loaded.state.step, ck.step);
            load_safetensors(&ck.dir.join("model.safetensors")).unwrap();
        }
    }
    let before = checkpoint::latest(&root)
        .unwrap()
        .expect("some checkpoint was written")
        .step;
    let target = before + 2;
    ok(
        &dir,
        &[
            "train",
            "--resume",
            "run",
            "--quiet",
            "--max-steps",
            &target.to_string(),
        ],
    );
    assert_eq!(checkpoint::latest(&root).unwrap().unwrap().step, target);
}

#[test]
fn unknown_configuration_keys_are_refused_by_name() {
    let dir = workspace("badcfg", "optimiser: {beta1: 0.9}\n");
    let out = kiln(&dir, &["train", "--config", "cfg.yaml", "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown field `optimiser`"), "{err}");
    let out = kiln(&dir, &["train", "--resume", "nowhere", "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a run directory"));
}

/// Replaces `from` (which must be there) by `to` in the workspace configuration.
fn edit_cfg(dir: &Path, from: &str, to: &str) {
    let path = dir.join("cfg.yaml");
    let cfg = std::fs::read_to_string(&path).unwrap();
    assert!(cfg.contains(from), "no `{from}` in:\n{cfg}");
    std::fs::write(&path, cfg.replace(from, to)).unwrap();
}

/// Replaces the workspace configuration's `train` section.
fn set_train(dir: &Path, train: &str) {
    let old = "train: {max_steps: 20, executor: reference, log_every: 5}";
    edit_cfg(dir, old, &format!("train: {{{train}}}"));
}

/// A workspace whose first steps overflow at the largest loss scale, 2^127 (dropout of
/// 0.9 scales what it keeps by 10, so some gradients exceed 2), trained 6 steps with the
/// compiled executor and `loss_scale: {<loss_scale>}`.
fn overflowing(name: &str, loss_scale: &str) -> PathBuf {
    let dir = workspace(name, "");
    edit_cfg(&dir, "p_drop: 0.1", "p_drop: 0.9");
    set_train(
        &dir,
        &format!("max_steps: 6, executor: compiled, log_every: 1, loss_scale: {{{loss_scale}}}"),
    );
    dir
}

/// 2^127, the largest power of two in f32.
const SCALE_MAX: &str = "1.7014118346046923e38";

#[test]
fn loss_scaling_by_powers_of_two_changes_no_bit_and_resumes() {
    let plain = workspace("unscaled", "");
    set_train(&plain, "max_steps: 10, executor: compiled, log_every: 5");
    ok(&plain, &["train", "--config", "cfg.yaml", "--quiet"]);
    // The scale grows 1024 → 2048 → 4096 → 8192 after steps 3, 6 and 9; the run stops
    // at step 6 and resumes.
    let scaled = workspace("scaled", "");
    set_train(
        &scaled,
        "max_steps: 10, executor: compiled, log_every: 5, loss_scale: {init: 1024, window: 3}",
    );
    let args = ["train", "--config", "cfg.yaml", "--max-steps", "6"];
    let out = ok(&scaled, &args);
    assert!(out.contains("loss scale 2^12; 0 step(s) skipped"), "{out}");
    let out = ok(&scaled, &["train", "--resume", "run", "--max-steps", "10"]);
    assert!(out.contains("loss scale 2^13; 0 step(s) skipped"), "{out}");
    let (pa, sa) = final_state(&plain, 10);
    let (pb, sb) = final_state(&scaled, 10);
    same_bits(&pa, &pb, "with loss scaling");
    assert_eq!((sa.loss_scale, sa.overflows), (None, 0));
    assert_eq!(sb.loss_scale, Some(8192.0));
    assert_eq!((sb.loss_scale_good_steps, sb.overflows), (1, 0));
    let (_, s6) = final_state(&scaled, 6);
    assert_eq!((s6.loss_scale, s6.loss_scale_good_steps), (Some(4096.0), 0));
    // The logged losses are the unscaled run's (the training records after the stop
    // at step 6 average other intervals).
    let (la, lb) = (logged_losses(&plain), logged_losses(&scaled));
    for key in ["5 train", "10 valid"] {
        let find = |l: &[(String, f64)]| l.iter().find(|(k, _)| k == key).map(|x| x.1);
        assert!(find(&la).is_some(), "{la:?}");
        assert_eq!(find(&la), find(&lb), "{key}");
    }
}

#[test]
fn an_overflowing_loss_scale_skips_the_step_and_halves() {
    let dir = overflowing("overflow", &format!("init: {SCALE_MAX}, window: 1000"));
    let out = kiln(&dir, &["train", "--config", "cfg.yaml"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let (params, state) = final_state(&dir, 6);
    let k = state.overflows;
    assert!(k >= 1, "2^127 overflows the gradients: {stderr}");
    assert_eq!(state.step, 6);
    assert_eq!(state.loss_scale, Some(2f64.powi(127 - k as i32)));
    assert!(
        stderr.contains("step 1: the gradient of `")
            && stderr.contains("overflowed at loss scale 2^127; step skipped, scale 2^126"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("step skipped").count() as u64,
        k,
        "one line per skipped step: {stderr}"
    );
    let last = format!("loss scale 2^{}; {k} step(s) skipped", 127 - k);
    assert!(stdout.contains(&last), "{stdout}");
    for (name, _, bits) in &params {
        assert!(
            bits.iter().all(|b| f32::from_bits(*b).is_finite()),
            "`{name}` is not finite"
        );
    }

    // The minimum reached: a clear error, no checkpoint.
    let dir = overflowing(
        "overflow_min",
        &format!("init: {SCALE_MAX}, window: 1000, min: {SCALE_MAX}"),
    );
    let out = kiln(&dir, &["train", "--config", "cfg.yaml", "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    let err = unwrapped(&out.stderr);
    assert!(err.contains("step 1: the gradient of `"), "{err}");
    assert!(
        err.contains("every loss scale down to 2^127, below `train.loss_scale.min`"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(checkpoint::latest(&dir.join("run/checkpoints"))
        .unwrap()
        .is_none());
}

#[test]
fn loss_scaling_settings_are_checked() {
    let dir = workspace("loss_scale_bad", "");
    set_train(&dir, "max_steps: 2, loss_scale: {init: 1000, window: 0}");
    let out = kiln(&dir, &["train", "--config", "cfg.yaml", "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    let err = unwrapped(&out.stderr);
    assert!(
        err.contains("train.loss_scale.init is 1000; use a power of two"),
        "{err}"
    );
    assert!(
        err.contains("train.loss_scale.window must be at least 1"),
        "{err}"
    );
    // An artifact compiled without loss scaling cannot train with it.
    let dir = workspace("loss_scale_artifact", "");
    set_train(&dir, "max_steps: 2, executor: compiled");
    ok(&dir, &["compile", "--config", "cfg.yaml", "-o", "art"]);
    edit_cfg(
        &dir,
        "executor: compiled}",
        "executor: compiled, loss_scale: {init: 1024}}",
    );
    let out = train_from_artifact(&dir);
    assert_eq!(out.status.code(), Some(1));
    let err = unwrapped(&out.stderr);
    assert!(
        err.contains("needs a train_step whose backward pass is seeded"),
        "{err}"
    );
    assert!(err.contains("was compiled without it"), "{err}");
    assert!(!dir.join("run/config.yaml").exists());
}

#[test]
fn checkpoints_translate_average_and_export() {
    let dir = workspace("tools", "");
    ok(&dir, &["train", "--config", "cfg.yaml", "--quiet"]);
    // A new run into the same directory is refused rather than overwriting it.
    let again = kiln(&dir, &["train", "--config", "cfg.yaml", "--quiet"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("--resume"));
    // Translation keeps one output line per input line, empty lines included. Standard
    // error gets one summary line: the sentences (the empty line is not one), their
    // source tokens, and the speed.
    std::fs::write(dir.join("in.txt"), "s1 s2 s3\n\ns4 s5\n").unwrap();
    let translate = |extra: &[&str]| {
        let base = [
            "translate",
            "--checkpoint",
            "run",
            "--input",
            "in.txt",
            "--executor",
            "reference",
            "--max-len-b",
            "4",
        ];
        kiln(&dir, &[&base[..], extra].concat())
    };
    let run = translate(&[]);
    assert!(run.status.success());
    let out = String::from_utf8(run.stdout).unwrap();
    let lines: Vec<&str> = out.split('\n').collect();
    assert_eq!(lines.len(), 4, "{out:?}");
    assert_eq!(lines[1], "");
    let err = String::from_utf8(run.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("translated 2 sentences (5 source and ")
            && err.contains(" sentences/s, ")
            && err.trim_end().ends_with("(beam 4, reference)"),
        "{err}"
    );
    // One sentence a batch translates the same.
    let one = translate(&["--batch", "1"]);
    assert!(one.status.success());
    assert_eq!(String::from_utf8(one.stdout).unwrap(), out);
    let zero = kiln(&dir, &["translate", "--checkpoint", "run", "--batch", "0"]);
    assert_eq!(zero.status.code(), Some(2), "clap's usage error");
    // Averaging two checkpoints gives their mean, as a model directory translate accepts.
    ok(
        &dir,
        &[
            "average",
            "run/checkpoints/step_00000010",
            "run/checkpoints/step_00000020",
            "-o",
            "avg",
        ],
    );
    let a = load_safetensors(&dir.join("run/checkpoints/step_00000010/model.safetensors")).unwrap();
    let b = load_safetensors(&dir.join("run/checkpoints/step_00000020/model.safetensors")).unwrap();
    let m = load_safetensors(&dir.join("avg/model.safetensors")).unwrap();
    let (x, y, z) = (
        a["emb.weight"].as_f32().unwrap(),
        b["emb.weight"].as_f32().unwrap(),
        m["emb.weight"].as_f32().unwrap(),
    );
    for i in 0..x.len() {
        assert!((z[i] as f64 - (x[i] as f64 + y[i] as f64) / 2.0).abs() < 1e-7);
    }
    ok(
        &dir,
        &[
            "translate",
            "--checkpoint",
            "avg",
            "--input",
            "in.txt",
            "--executor",
            "reference",
            "--max-len-b",
            "2",
        ],
    );
    // PyTorch naming round trip is bit-exact.
    ok(
        &dir,
        &[
            "export",
            "--format",
            "torch",
            "avg",
            "-o",
            "torch.safetensors",
        ],
    );
    let t = load_safetensors(&dir.join("torch.safetensors")).unwrap();
    assert!(t.contains_key("encoder.layers.0.self_attn.in_proj_weight"));
    assert!(t.contains_key("decoder.layers.0.multihead_attn.out_proj.bias"));
    assert_eq!(
        t["encoder.layers.0.self_attn.in_proj_weight"].shape,
        vec![48, 16]
    );
    ok(
        &dir,
        &[
            "import",
            "--format",
            "torch",
            "torch.safetensors",
            "-o",
            "back.safetensors",
        ],
    );
    let back = load_safetensors(&dir.join("back.safetensors")).unwrap();
    assert_eq!(back, m);
}

/// A diagnostic on one line: its wrapped lines (`\n  │ `) joined with spaces.
fn unwrapped(stderr: &[u8]) -> String {
    String::from_utf8_lossy(stderr)
        .lines()
        .map(|l| l.trim_start().trim_start_matches('│').trim())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The trainer's metrics log: ("step kind", loss) of every training and validation
/// record.
fn logged_losses(dir: &Path) -> Vec<(String, f64)> {
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
fn same_losses(a: &Path, b: &Path, name_a: &str, name_b: &str) {
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
fn relative_distance(a: &Snapshot, b: &Snapshot) -> f64 {
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

/// Training from a compiled artifact (`kiln compile --config`, `kiln train --artifact`,
/// compiled executor) follows the eager executor's run: the same first weights, the
/// logged training and validation losses within 1e-4 relative, and the parameters after
/// 10 Adam steps no further from the eager run's than twice the reference executor's run
/// is (relative norm, about 1.5e-3 here: executors differ by float rounding, and Adam's
/// normalized first steps turn the sign of a near-zero gradient into a full-size step). A
/// trained model compiled with `kiln compile --from-model` translates exactly as the
/// model directory does.
#[test]
fn training_and_translation_from_an_artifact_follow_the_eager_executor() {
    let eager = workspace("from_artifact_eager", "");
    let cfg = std::fs::read_to_string(eager.join("cfg.yaml")).unwrap();
    let cfg = cfg.replace(
        "max_steps: 20, executor: reference",
        "max_steps: 10, executor: eager",
    );
    std::fs::write(eager.join("cfg.yaml"), &cfg).unwrap();
    ok(&eager, &["train", "--config", "cfg.yaml", "--quiet"]);

    let comp = workspace("from_artifact_compiled", "");
    let cfg = cfg.replace("executor: eager", "executor: compiled");
    std::fs::write(comp.join("cfg.yaml"), &cfg).unwrap();
    ok(&comp, &["compile", "--config", "cfg.yaml", "-o", "art"]);
    // The artifact holds what training needs, and compiling did not start a run.
    let inspect = ok(&comp, &["inspect", "art"]);
    for want in [
        "entry train_step",
        "entry loss",
        "entry encode",
        "entry decode_step",
        "tokenizer: tokenizer.json",
    ] {
        assert!(inspect.contains(want), "`{want}` missing from:\n{inspect}");
    }
    assert!(!comp.join("run").exists());
    ok(
        &comp,
        &[
            "train",
            "--config",
            "cfg.yaml",
            "--artifact",
            "art",
            "--quiet",
        ],
    );

    // The same first weights: the artifact's are the trainer's initialization.
    let art_w = load_safetensors(&comp.join("art/weights.safetensors")).unwrap();
    let init = kiln_compiler::init::init_params(
        &kiln_dsl::compile_file(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("models/transformer_base.kiln")
                .as_path(),
            &kiln_dsl::Options {
                overrides: ["d_model=16", "d_ff=32", "h=2", "n=1", "p_drop=0.1"]
                    .iter()
                    .map(|s| s.to_string())
                    .chain([format!("vocab={}", art_w["emb.weight"].shape[0])])
                    .collect(),
                ..Default::default()
            },
        )
        .unwrap(),
        1,
    )
    .unwrap();
    for (name, t) in &init {
        assert_eq!(&art_w[name], t, "artifact weight `{name}`");
    }

    same_losses(&eager, &comp, "eager", "artifact");
    let (pe, se) = final_state(&eager, 10);
    let (pc, sc) = final_state(&comp, 10);
    assert_eq!((se.epoch, se.batch_in_epoch), (sc.epoch, sc.batch_in_epoch));
    // The yardstick: the reference executor's run of the same configuration.
    let reference = workspace("from_artifact_reference", "");
    std::fs::write(
        reference.join("cfg.yaml"),
        cfg.replace("executor: compiled", "executor: reference"),
    )
    .unwrap();
    ok(&reference, &["train", "--config", "cfg.yaml", "--quiet"]);
    let (pr, _) = final_state(&reference, 10);
    let d = relative_distance(&pe, &pc);
    let d_ref = relative_distance(&pe, &pr);
    assert!(
        d <= 2.0 * d_ref && d > 0.0,
        "parameters after 10 steps: artifact vs eager {d:e}, reference vs eager {d_ref:e} (relative norm)"
    );

    // Resuming a run started from an artifact continues on it.
    ok(
        &comp,
        &["train", "--resume", "run", "--quiet", "--max-steps", "12"],
    );
    assert!(comp.join("run/checkpoints/step_00000012").is_dir());

    // Translation: the checkpoint compiled into an artifact decodes exactly as the
    // checkpoint with the compiled executor, and as the eager executor does.
    std::fs::write(comp.join("in.txt"), "s1 s2 s3\n\ns4 s5\ns3 s1 s1 s2\n").unwrap();
    ok(&comp, &["compile", "--from-model", "run", "-o", "tart"]);
    let tr = |model: &str, exec: &str| {
        ok(
            &comp,
            &[
                "translate",
                "--model",
                model,
                "--input",
                "in.txt",
                "--executor",
                exec,
                "--max-len-b",
                "6",
            ],
        )
    };
    let from_artifact = tr("tart", "compiled");
    assert_eq!(from_artifact.lines().count(), 4, "{from_artifact:?}");
    assert_eq!(from_artifact, tr("run", "compiled"));
    assert_eq!(from_artifact, tr("run", "eager"));
    assert_eq!(from_artifact, tr("tart", "eager"));

    // An artifact for another vocabulary is refused, naming both sizes and the fix.
    ok(
        &comp,
        &[
            "compile",
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("models/transformer_tiny.kiln")
                .to_str()
                .unwrap(),
            "--set",
            "vocab=40",
            "--entries",
            "train_step,loss,encode,decode_step",
            "-o",
            "other",
        ],
    );
    let refused = |artifact: &str, run: &str| {
        let args = [
            "train",
            "--config",
            "cfg.yaml",
            "--artifact",
            artifact,
            "--dir",
            run,
            "--quiet",
        ];
        let out = kiln(&comp, &args);
        let err = unwrapped(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        err
    };
    let err = refused("other", "run2");
    assert!(
        err.contains("vocabulary of 40 tokens") && err.contains("kiln compile --config"),
        "{err}"
    );
    // One without the training entries is refused, naming them.
    let err = refused("tart", "run3");
    assert!(err.contains("train_step, loss"), "{err}");
}

/// `train.executor: cuda` with a `--target cuda` artifact (`kiln compile --config …
/// --target cuda`): without a GPU, a non-zero exit that names the reason; with one
/// (device training: parameters, gradient accumulators and Adam's moments stay on the
/// GPU), the logged losses of 10 steps within 1e-4 relative of the compiled executor's
/// run and the final parameters and moments within 1e-2 (relative norm: executors differ
/// by float rounding, which Adam's first steps amplify), and resuming continues on the
/// device.
#[test]
fn training_on_the_gpu_follows_the_compiled_executor() {
    let gpu = workspace("gpu_cuda", "");
    let cfg = std::fs::read_to_string(gpu.join("cfg.yaml"))
        .unwrap()
        .replace(
            "max_steps: 20, executor: reference",
            "max_steps: 10, executor: cuda",
        );
    std::fs::write(gpu.join("cfg.yaml"), &cfg).unwrap();
    let out = compile_and_train(&gpu);
    if kiln_runtime::cuda::require_cuda_or_skip().is_none() {
        let reason = kiln_runtime::cuda::cuda_available().unwrap_err();
        let first: String = reason
            .split_whitespace()
            .take(4)
            .collect::<Vec<_>>()
            .join(" ");
        let err = unwrapped(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains(&first), "{err}");
        return;
    }
    assert!(out.status.success(), "{}", unwrapped(&out.stderr));
    let comp = workspace("gpu_compiled", "");
    std::fs::write(
        comp.join("cfg.yaml"),
        cfg.replace("executor: cuda", "executor: compiled"),
    )
    .unwrap();
    ok(&comp, &["train", "--config", "cfg.yaml", "--quiet"]);
    same_losses(&comp, &gpu, "compiled", "GPU");
    let (pg, sg) = final_state(&gpu, 10);
    let (pc, sc) = final_state(&comp, 10);
    assert_eq!((sg.epoch, sg.batch_in_epoch), (sc.epoch, sc.batch_in_epoch));
    let d = relative_distance(&pc, &pg);
    assert!(
        d <= 1e-2 && d > 0.0,
        "GPU vs compiled after 10 steps: {d:e}"
    );
    ok(
        &gpu,
        &["train", "--resume", "run", "--quiet", "--max-steps", "12"],
    );
    let (p12, s12) = final_state(&gpu, 12);
    assert_eq!(s12.step, 12);
    assert!(
        relative_distance(&pg, &p12) > 0.0,
        "the resumed steps trained"
    );
}

/// `kiln compile --config cfg.yaml --target cuda -o art` (which needs no GPU, and must
/// succeed), then `kiln train --config cfg.yaml --artifact art --quiet` in `dir`: its
/// output.
fn compile_and_train(dir: &Path) -> Output {
    ok(
        dir,
        &[
            "compile", "--config", "cfg.yaml", "--target", "cuda", "-o", "art",
        ],
    );
    train_from_artifact(dir)
}

/// `kiln train --config cfg.yaml --artifact art --quiet` in `dir`: its output.
fn train_from_artifact(dir: &Path) -> Output {
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
fn gpu_run(name: &str, train: &str) -> Option<PathBuf> {
    gpu_run_edited(name, train, &[])
}

/// [`gpu_run`] with `edits` (`from`, `to`) made to the configuration first.
fn gpu_run_edited(name: &str, train: &str, edits: &[(&str, &str)]) -> Option<PathBuf> {
    let dir = workspace(name, "");
    set_train(&dir, train);
    for (from, to) in edits {
        edit_cfg(&dir, from, to);
    }
    let out = compile_and_train(&dir);
    kiln_runtime::cuda::require_cuda_or_skip()?;
    assert!(out.status.success(), "{}", unwrapped(&out.stderr));
    Some(dir)
}

/// Dynamic loss scaling on the GPU's device-resident training: a power-of-two scale that
/// never overflows leaves the run as it is without scaling (the scale reaches the seeded
/// cross-entropy kernel, and the accumulation weights `tokens/S` undo it).
#[test]
fn loss_scaling_on_the_gpu_leaves_the_run_unchanged() {
    let Some(plain) = gpu_run("gpu_unscaled", "max_steps: 6, executor: cuda, log_every: 5") else {
        return;
    };
    let scaled = gpu_run(
        "gpu_scaled",
        "max_steps: 6, executor: cuda, log_every: 5, loss_scale: {init: 1024, window: 2}",
    )
    .expect("a GPU");
    let (pa, _) = final_state(&plain, 6);
    let (pb, sb) = final_state(&scaled, 6);
    assert_eq!((sb.loss_scale, sb.overflows), (Some(8192.0), 0));
    let d = relative_distance(&pa, &pb);
    eprintln!("GPU, scaled vs unscaled after 6 steps: relative distance {d:e}");
    assert!(d <= 1e-6, "scaled vs unscaled on the GPU: {d:e}");
}

/// Data-parallel training (`train.devices`) sums gradients with NCCL: without the `nccl`
/// feature the run is refused with the command that builds it; with it but without a
/// GPU, with CUDA's reason. Nothing is trained either way.
#[test]
fn data_parallel_training_says_what_it_needs() {
    let dir = workspace("dp_needs", "");
    set_train(&dir, "max_steps: 2, executor: cuda, devices: [0]");
    let out = compile_and_train(&dir);
    let err = unwrapped(&out.stderr);
    if cfg!(feature = "nccl") {
        if kiln_runtime::cuda::cuda_available().is_ok() {
            println!("skipped: a GPU is here (data_parallel_on_one_gpu_is_the_single_gpu_run)");
            return;
        }
        assert!(err.contains("CUDA is not available"), "{err}");
    } else {
        assert!(
            err.contains("train.devices")
                && err.contains("NCCL")
                && err.contains("cargo build --release --features nccl"),
            "{err}"
        );
    }
    assert!(!out.status.success());
    assert!(!dir.join("run/checkpoints").exists(), "nothing trained");
}

/// With one GPU, data parallel through NCCL (`devices: [0]`) is bit for bit the
/// single-GPU run: the all-reduce over one rank changes nothing, and the batches and
/// dropout masks are the same. With two GPUs, `devices: [0, 1]` and `update_freq: 1`
/// follow one GPU with `update_freq: 2` (the same batches and masks; only the order of
/// the gradient sums differs).
#[cfg(feature = "nccl")]
#[test]
fn data_parallel_on_one_gpu_is_the_single_gpu_run() {
    let train = "max_steps: 6, executor: cuda, log_every: 1";
    let Some(single) = gpu_run("dp_single", train) else {
        return;
    };
    let one = gpu_run("dp_one_rank", &format!("{train}, devices: [0]")).expect("a GPU");
    assert_eq!(logged_losses(&single), logged_losses(&one));
    let (ps, ss) = final_state(&single, 6);
    let (p1, s1) = final_state(&one, 6);
    assert_eq!((ss.epoch, ss.batch_in_epoch), (s1.epoch, s1.batch_in_epoch));
    same_bits(&ps, &p1, "with one NCCL rank");
    let gpus = kiln_runtime::cuda::cuda_available().unwrap().device_count;
    if gpus < 2 {
        println!("{gpus} GPU: the two-rank comparison needs two");
        return;
    }
    let two = gpu_run_edited(
        "dp_two_ranks",
        &format!("{train}, devices: [0, 1]"),
        &[("update_freq: 2", "update_freq: 1")],
    )
    .expect("two GPUs");
    same_losses(&single, &two, "one GPU", "two GPUs");
    let (p2, s2) = final_state(&two, 6);
    assert_eq!((ss.epoch, ss.batch_in_epoch), (s2.epoch, s2.batch_in_epoch));
    let d = relative_distance(&ps, &p2);
    eprintln!("two NCCL ranks vs one GPU after 6 steps: relative distance {d:e}");
    assert!(d <= 1e-4, "two ranks vs one GPU: {d:e}");
}
