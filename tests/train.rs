//! Training end to end through the `kiln` binary, on the generated task:
//! - 20 steps straight and 10 steps + resume + 10 steps give bit-identical parameters and
//!   optimizer moments (dropout, gradient accumulation and validation included);
//! - a process killed while it writes checkpoints leaves the previous checkpoint loadable,
//!   and the run resumes from it;
//! - a configuration with an unknown key is refused, naming the key;
//! - resuming after an edit of the run's configuration that would change the trajectory
//!   (batch, schedule, …) is refused, naming the part; raising `max_steps` is accepted;
//! - translation, averaging and the PyTorch export work on the checkpoints.

mod train_common;

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_compiler::tensor::load_safetensors;
use kiln_train::checkpoint;
use train_common::*;

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
    train_ok(&dir, &["--max-steps", "4"]);
    let cfg_path = dir.join("run/config.yaml");
    let original = std::fs::read_to_string(&cfg_path).unwrap();
    says(&original, "max_src_tokens: 120");
    let edited = original
        .replace("max_src_tokens: 120", "max_src_tokens: 100")
        .replace("warmup: 50", "warmup: 60");
    std::fs::write(&cfg_path, edited).unwrap();
    let out = kiln(&dir, &["train", "--resume", "run", "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    says(&err, "differs in `batch`, `schedule`");
    says(&err, "step_00000004");
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
    edit_cfg(
        &dir,
        "checkpoint: {dir: run, every: 10, keep: 3}",
        "checkpoint: {dir: run, every: 1, keep: 2}",
    );
    edit_cfg(&dir, "max_steps: 20", "max_steps: 400");
    edit_cfg(&dir, "valid: {every: 10", "valid: {every: 1000");
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
    says(&err, "unknown field `optimiser`");
    let out = kiln(&dir, &["train", "--resume", "nowhere", "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a run directory"));
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
    says(&out, "loss scale 2^12; 0 step(s) skipped");
    let out = ok(&scaled, &["train", "--resume", "run", "--max-steps", "10"]);
    says(&out, "loss scale 2^13; 0 step(s) skipped");
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
    says(&stdout, &last);
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
    let err = train_fails(&dir);
    says(&err, "step 1: the gradient of `");
    says(
        &err,
        "every loss scale down to 2^127, below `train.loss_scale.min`",
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
    let err = train_fails(&dir);
    says(&err, "train.loss_scale.init is 1000; use a power of two");
    says(&err, "train.loss_scale.window must be at least 1");
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
    says(&err, "needs a train_step whose backward pass is seeded");
    says(&err, "was compiled without it");
    assert!(!dir.join("run/config.yaml").exists());
}

/// `kiln train --gemm-type int16` (`train.gemm_type`): the compiled executor's large
/// products with int16 operands. The run's configuration records it, a resume keeps it,
/// and it is part of the trajectory (a resume without it is refused, naming the key). The
/// logged losses differ from f32's in their bits, by less than 1e-3 relative; a 16-bit
/// type for another executor is refused.
#[test]
fn gemm_type_runs_the_products_in_int16_and_is_kept_on_resume() {
    if let Err(why) = kiln_exec::compiled::Kernel16::Int16.available() {
        println!("skipped: {why}");
        return;
    }
    // Products of 120 tokens × 256 · 256 × 512 and × 220 (the vocabulary): above the
    // size below which 16-bit products stay f32.
    let train = |gemm| {
        [
            "train",
            "--config",
            "cfg.yaml",
            "--quiet",
            "--gemm-type",
            gemm,
        ]
    };
    let run = |name: &str, gemm| {
        let dir = workspace(name, "");
        set_train(&dir, "max_steps: 3, executor: compiled, log_every: 1");
        edit_cfg(&dir, "d_model: 16, d_ff: 32", "d_model: 256, d_ff: 512");
        ok(&dir, &train(gemm));
        dir
    };
    let f = run("gemm_f32", "f32");
    let q = run("gemm_int16", "int16");
    let (lf, lq) = (logged_losses(&f), logged_losses(&q));
    let steps = |l: &[(String, f64)]| l.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(steps(&lf), steps(&lq));
    assert!(lf.len() >= 3, "{lf:?}");
    for ((s, x), (_, y)) in lf.iter().zip(&lq) {
        assert!(x != y, "step {s}: the same loss {x} with int16 products");
        assert!(
            (x - y).abs() <= 1e-3 * x.abs(),
            "step {s}: f32 {x}, int16 {y}"
        );
    }
    let cfg_path = q.join("run/config.yaml");
    let saved = std::fs::read_to_string(&cfg_path).unwrap();
    says(&saved, "gemm_type: int16");
    assert!(!std::fs::read_to_string(f.join("run/config.yaml"))
        .unwrap()
        .contains("gemm_type: int16"));
    // A resume continues in int16; without the key it would be another trajectory.
    std::fs::write(&cfg_path, saved.replace("  gemm_type: int16\n", "")).unwrap();
    let err = fails(
        &q,
        &["train", "--resume", "run", "--quiet", "--max-steps", "4"],
    );
    says(&err, "differs in `train.gemm_type`");
    std::fs::write(&cfg_path, &saved).unwrap();
    ok(
        &q,
        &["train", "--resume", "run", "--quiet", "--max-steps", "4"],
    );
    assert!(q.join("run/checkpoints/step_00000004").is_dir());
    // Translation takes it too (the compiled executor only).
    let translate = |extra: &[&'static str]| {
        let mut args = vec!["translate", "--checkpoint", "run", "--input", "valid.src"];
        args.extend_from_slice(&["--gemm-type", "int16"]);
        args.extend_from_slice(extra);
        args
    };
    let out = kiln(&q, &translate(&[]));
    let (text, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{err}");
    assert_eq!(text.lines().count(), 12, "{text}");
    says(&err, "(beam 4, compiled, int16 products)");
    let err = fails(&q, &translate(&["--executor", "eager"]));
    says(&err, "add `--executor compiled`, or leave --gemm-type out");
    // The reference executor has no 16-bit products.
    let dir = workspace("gemm_reference", "");
    let err = fails(&dir, &train("int16"));
    says(
        &err,
        "with --gemm-type int16: train.gemm_type `int16` chooses the compiled CPU \
         executor's matrix products, but train.executor is `reference`",
    );
    assert!(!dir.join("run").exists());
    // A kernel this CPU lacks: refused before the run directory is made.
    let lacking = kiln_exec::compiled::Kernel16::SIXTEEN_BIT
        .into_iter()
        .find_map(|k| k.available().err().map(|why| (k.key(), why)));
    if let Some((key, why)) = lacking {
        set_train(&dir, "max_steps: 3, executor: compiled");
        let err = fails(&dir, &train(key));
        says(&err, &format!("train.gemm_type is `{key}`, but {why}"));
        assert!(!dir.join("run").exists());
    }
}

#[test]
fn checkpoints_translate_average_and_export() {
    let dir = workspace("tools", "");
    train_ok(&dir, &[]);
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
    // One sentence a batch translates the same, on one worker or on two at once.
    let one = translate(&["--batch", "1"]);
    assert!(one.status.success());
    assert_eq!(String::from_utf8(one.stdout).unwrap(), out);
    for workers in ["1", "2"] {
        let w = translate(&["--batch", "1", "--workers", workers]);
        assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
        assert_eq!(
            String::from_utf8(w.stdout).unwrap(),
            out,
            "--workers {workers}"
        );
    }
    // Batches of at most 3 source tokens: `s1 s2 s3` (3 tokens or more) is one alone,
    // and the output is the same.
    let capped = translate(&["--max-tokens", "3"]);
    assert!(
        capped.status.success(),
        "{}",
        String::from_utf8_lossy(&capped.stderr)
    );
    assert_eq!(
        String::from_utf8(capped.stdout).unwrap(),
        out,
        "--max-tokens 3"
    );
    for flag in ["--batch", "--max-tokens"] {
        let zero = kiln(&dir, &["translate", "--checkpoint", "run", flag, "0"]);
        assert_eq!(zero.status.code(), Some(2), "{flag} 0: clap's usage error");
    }
    // The n best, Moses style: `LINE ||| TEXT ||| log_prob= LP ||| SCORE`, best first,
    // the first being the 1-best translation, each score its log-probability over the
    // GNMT penalty (at least 1 and at most that of the longest output, src + 4 tokens).
    let nbest = translate(&["--nbest", "3"]);
    assert!(nbest.status.success());
    let text = String::from_utf8(nbest.stdout).unwrap();
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split(" ||| ").collect()).collect();
    assert_eq!(rows.len(), 3 + 1 + 3, "{text}");
    assert_eq!(rows[3], ["1", "", "log_prob= 0", "0"], "the empty line");
    for (line, first) in [(0usize, 0usize), (2, 4)] {
        let mut last = f64::INFINITY;
        for (k, row) in rows[first..first + 3].iter().enumerate() {
            assert_eq!(row.len(), 4, "{text}");
            assert_eq!(row[0], line.to_string());
            if k == 0 {
                assert_eq!(row[1], lines[line], "the best is the 1-best translation");
            }
            let lp: f64 = row[2].strip_prefix("log_prob= ").unwrap().parse().unwrap();
            let score: f64 = row[3].parse().unwrap();
            assert!(lp < 0.0 && score <= last, "{text}");
            let max_div = ((5.0 + 3.0 + 4.0) / 6.0f64).powf(0.6);
            assert!(score >= lp && score <= lp / max_div + 1e-4, "{text}");
            last = score;
        }
    }
    // `kiln score` of the translations gives back the log-probabilities the search
    // reported; the empty line stays empty.
    std::fs::write(dir.join("hyp.txt"), &out).unwrap();
    let scored = kiln(
        &dir,
        &[
            "score",
            "--checkpoint",
            "run",
            "--src",
            "in.txt",
            "--ref",
            "hyp.txt",
            "--executor",
            "reference",
        ],
    );
    assert!(scored.status.success(), "{}", unwrapped(&scored.stderr));
    let text_scores = String::from_utf8(scored.stdout).unwrap();
    let scores: Vec<&str> = text_scores.lines().collect();
    assert_eq!(scores.len(), 3, "{text_scores}");
    assert_eq!(scores[1], "");
    for (line, first) in [(0usize, 0usize), (2, 4)] {
        let want: f64 = rows[first][2]
            .strip_prefix("log_prob= ")
            .unwrap()
            .parse()
            .unwrap();
        let got: f64 = scores[line].parse().unwrap();
        assert!((got - want).abs() <= 1e-5 * want.abs(), "{got} vs {want}");
    }
    let err = String::from_utf8(scored.stderr).unwrap();
    assert!(
        err.starts_with("scored 2 sentence pairs (")
            && err.contains("; 1 with an empty source left blank) in ")
            && err.contains(" nats/token, perplexity "),
        "{err}"
    );
    // `--normalize`: per token, so each sum is its per-token value times a whole number
    // of tokens (the reference's, plus <eos>).
    let normalized = ok(
        &dir,
        &[
            "score",
            "--checkpoint",
            "run",
            "--src",
            "in.txt",
            "--ref",
            "hyp.txt",
            "--executor",
            "reference",
            "--normalize",
        ],
    );
    let per_token: Vec<&str> = normalized.lines().collect();
    assert_eq!(per_token[1], "");
    for line in [0, 2] {
        let (sum, per): (f64, f64) = (
            scores[line].parse().unwrap(),
            per_token[line].parse().unwrap(),
        );
        let tokens = sum / per;
        assert!(
            tokens >= 1.0 && (tokens - tokens.round()).abs() < 1e-4,
            "{sum} / {per} = {tokens} tokens"
        );
    }
    // Files are read as corpora are: a byte-order mark is dropped, invalid UTF-8 is an
    // error naming the line.
    std::fs::write(dir.join("latin1.txt"), b"\xEF\xBB\xBFs1 s2\nbad \xff\n").unwrap();
    let bad = kiln(
        &dir,
        &[
            "score",
            "--checkpoint",
            "run",
            "--src",
            "latin1.txt",
            "--ref",
            "in.txt",
        ],
    );
    assert_eq!(bad.status.code(), Some(1));
    let err = unwrapped(&bad.stderr);
    says(&err, "`latin1.txt` line 2 is not valid UTF-8");
    // Nothing to score: said so, with no cross-entropy of 0 and perplexity of 1.
    std::fs::write(dir.join("empty.txt"), "").unwrap();
    let none = kiln(
        &dir,
        &[
            "score",
            "--checkpoint",
            "run",
            "--src",
            "empty.txt",
            "--ref",
            "empty.txt",
        ],
    );
    assert!(none.status.success());
    assert!(none.stdout.is_empty());
    let err = unwrapped(&none.stderr);
    assert!(
        err.contains("scored no sentence pairs: the input is empty") && !err.contains("perplexity"),
        "{err}"
    );
    std::fs::write(dir.join("short.txt"), "only one line\n").unwrap();
    let mismatch = kiln(
        &dir,
        &[
            "score",
            "--checkpoint",
            "run",
            "--src",
            "in.txt",
            "--ref",
            "short.txt",
        ],
    );
    assert_eq!(mismatch.status.code(), Some(1));
    let err = unwrapped(&mismatch.stderr);
    assert!(
        err.contains("`in.txt` has 3 lines but `short.txt` has 1")
            && err.contains("give one translation per source line"),
        "{err}"
    );
    let wide = translate(&["--nbest", "5"]);
    assert_eq!(wide.status.code(), Some(1));
    let err = String::from_utf8(wide.stderr).unwrap();
    assert!(
        err.contains("--nbest 5 asks for more hypotheses than the search keeps (4, --beam 4)")
            && err.contains("use --beam 5 or more, or --nbest 4 or fewer"),
        "{err}"
    );
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
    // `--last N` takes a run's newest N checkpoints: the same average.
    let last = ok(&dir, &["average", "--last", "2", "run", "-o", "avg_last"]);
    assert!(
        last.starts_with("averaged 2 checkpoints (steps 10, 20; the last 2) into avg_last"),
        "{last}"
    );
    assert_eq!(
        load_safetensors(&dir.join("avg_last/model.safetensors")).unwrap(),
        load_safetensors(&dir.join("avg/model.safetensors")).unwrap()
    );
    best_checkpoints_are_averaged(&dir);
    let err = fails(&dir, &["average", "--last", "3", "run", "-o", "x"]);
    assert!(
        err.contains("--last 3 asks for 3 checkpoints, but `run/checkpoints` has 2 (steps 10, 20)")
            && err.contains("average fewer (--last 2), or keep more with checkpoint.keep"),
        "{err}"
    );
    assert!(!dir.join("x").exists());
    std::fs::create_dir_all(dir.join("empty_run")).unwrap();
    let err = fails(&dir, &["average", "--last", "1", "empty_run", "-o", "x"]);
    says(&err, "`empty_run` holds no checkpoints");
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

    // `kiln inspect` reads model directories as well as artifacts: a run (its newest
    // checkpoint, with the run's last logged losses), one checkpoint, an averaged model.
    let params: u64 = m.values().map(|t| t.numel() as u64).sum();
    let digits = params.to_string();
    let params: String = digits
        .chars()
        .enumerate()
        .flat_map(|(i, c)| {
            let comma = i > 0 && (digits.len() - i).is_multiple_of(3);
            comma.then_some(',').into_iter().chain([c])
        })
        .collect();
    let run = ok(&dir, &["inspect", "run"]);
    for want in [
        "— the newest of the 2 checkpoints of run `run` (steps 10, 20)".to_string(),
        format!("  parameters {params} in {} tensors (", m.len()),
        "  graphs train_step (".to_string(),
        // Sinusoidal positions; the spec's max_len caps the outputs.
        "  positions: sources of any length; outputs up to 1024 tokens, <eos> included\n"
            .to_string(),
        "  training step 20, epoch ".to_string(),
        "  Adam moments for every parameter".to_string(),
        "  last logged (run/metrics.jsonl): training loss ".to_string(),
        "  BLEU signature nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0|beam:2|"
            .to_string(),
    ] {
        assert!(run.contains(&want), "{want:?} in\n{run}");
    }
    let one = ok(&dir, &["inspect", "run/checkpoints/step_00000010"]);
    assert!(
        one.contains("— a checkpoint (step 10)") && one.contains("  training step 10, "),
        "{one}"
    );
    let avg = ok(&dir, &["inspect", "avg"]);
    assert!(
        avg.contains("— a model directory without training state (`kiln average`'s output, or a run's best/)")
            && !avg.contains("training step"),
        "{avg}"
    );
    let err = fails(&dir, &["inspect", "avg", "--plan"]);
    assert!(
        err.contains("is a model directory: it has graphs and weights, but no memory plans")
            && err.contains("`kiln compile --from-model avg -o DIR`, then inspect DIR"),
        "{err}"
    );
    let err = fails(&dir, &["inspect", "."]);
    assert!(
        err.contains("is not a kiln artifact") && err.contains("also reads model directories"),
        "{err}"
    );
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
    edit_cfg(
        &eager,
        "max_steps: 20, executor: reference",
        "max_steps: 10, executor: eager",
    );
    ok(&eager, &["train", "--config", "cfg.yaml", "--quiet"]);

    let comp = workspace("from_artifact_compiled", "");
    edit_cfg(
        &comp,
        "max_steps: 20, executor: reference",
        "max_steps: 10, executor: compiled",
    );
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
    let out = train_from_artifact(&comp);
    assert!(out.status.success(), "{}", unwrapped(&out.stderr));

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
    edit_cfg(&reference, "max_steps: 20", "max_steps: 10");
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
    says(&err, "train_step, loss");
}

/// `valid.patience` stops a run after that many validations in a row without a better
/// `valid.metric`, with a checkpoint where it stopped; a resumed run stays stopped until
/// the patience is raised. `checkpoint.best` keeps the best validation's model in
/// `<run>/best/`, which translates like any model directory.
#[test]
fn patience_stops_a_run_and_the_best_model_is_kept() {
    // A learning rate of about 1e-30 leaves every f32 weight as it was, so the
    // validation loss never improves after the first validation.
    let dir = workspace_edited(
        "patience",
        &[
            ("factor: 1.0", "factor: 1.0e-30"),
            (
                "valid: {every: 10,",
                "valid: {every: 2, bleu: false, patience: 2,",
            ),
        ],
    );
    let out = kiln(&dir, &["train", "--config", "cfg.yaml", "--quiet"]);
    assert!(out.status.success(), "{}", unwrapped(&out.stderr));
    let err = unwrapped(&out.stderr);
    assert!(
        err.contains("stopped early at step 6: 2 validations in a row without a better loss than ")
            && err.contains("(step 2); valid.patience is 2"),
        "{err}"
    );
    let steps: Vec<u64> = checkpoint::list(&dir.join("run/checkpoints"))
        .unwrap()
        .iter()
        .map(|c| c.step)
        .collect();
    assert_eq!(steps, [6], "a checkpoint where the run stopped");
    let state =
        std::fs::read_to_string(dir.join("run/checkpoints/step_00000006/state.yaml")).unwrap();
    assert!(
        state.contains("best_step: 2") && state.contains("bad_validations: 2"),
        "{state}"
    );
    let losses = logged_losses(&dir);
    let valid: Vec<f64> = losses
        .iter()
        .filter(|(k, _)| k.ends_with("valid"))
        .map(|(_, l)| *l)
        .collect();
    assert_eq!(valid.len(), 3, "{losses:?}");
    assert!(valid.iter().all(|&l| l == valid[0]), "{valid:?}");
    assert!(dir.join("run/best/model.safetensors").is_file());

    // Resumed, it stays stopped; with more patience it trains to the next validation.
    let again = kiln(&dir, &["train", "--resume", "run"]);
    assert!(again.status.success());
    let out = String::from_utf8_lossy(&again.stdout);
    assert!(
        !out.contains("trained"),
        "no step taken, none reported: {out}"
    );
    let err = unwrapped(&again.stderr);
    assert!(
        err.contains("stopped early at step 6") && err.contains("raise valid.patience"),
        "{err}"
    );
    let cfg = dir.join("run/config.yaml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    says(&text, "patience: 2");
    std::fs::write(&cfg, text.replace("patience: 2", "patience: 3")).unwrap();
    let more = kiln(&dir, &["train", "--resume", "run", "--quiet"]);
    assert!(more.status.success(), "{}", unwrapped(&more.stderr));
    assert!(
        unwrapped(&more.stderr).contains("stopped early at step 8: 3 validations in a row"),
        "{}",
        unwrapped(&more.stderr)
    );

    // An ordinary run: the best model is that of the best validation, and translates.
    let dir = workspace_edited(
        "best_model",
        &[("valid: {every: 10,", "valid: {every: 10, bleu: false,")],
    );
    train_ok(&dir, &[]);
    let state =
        std::fs::read_to_string(dir.join("run/checkpoints/step_00000020/state.yaml")).unwrap();
    let best_step: u64 = state
        .lines()
        .find_map(|l| l.strip_prefix("best_step: "))
        .expect("best_step in state.yaml")
        .parse()
        .unwrap();
    let valid: Vec<(String, f64)> = logged_losses(&dir)
        .into_iter()
        .filter(|(k, _)| k.ends_with("valid"))
        .collect();
    let (best_key, _) = valid
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap()
        .clone();
    assert_eq!(best_key, format!("{best_step} valid"), "{valid:?}");
    let best = load_safetensors(&dir.join("run/best/model.safetensors")).unwrap();
    let at_best = load_safetensors(&dir.join(format!(
        "run/checkpoints/step_{best_step:08}/model.safetensors"
    )))
    .unwrap();
    assert_eq!(best, at_best);
    std::fs::write(dir.join("in.txt"), "s1 s2 s3\n").unwrap();
    let t = ok(
        &dir,
        &[
            "translate",
            "--checkpoint",
            "run/best",
            "--input",
            "in.txt",
            "--executor",
            "reference",
            "--max-len-b",
            "4",
        ],
    );
    assert_eq!(t.lines().count(), 1);

    // `metric: bleu` needs BLEU computed.
    let dir = workspace_edited(
        "metric_bleu",
        &[(
            "valid: {every: 10,",
            "valid: {every: 10, bleu: false, metric: bleu,",
        )],
    );
    let err = train_fails(&dir);
    says(&err, "valid.metric is `bleu` but valid.bleu is false");
}

/// Numbers that would make the learning rate NaN, infinite or zero are refused when the
/// configuration is read, each named; a run that diverges anyway (a huge but finite
/// factor) stops saying that it has no checkpoint yet, not that "the last one" is kept.
#[test]
fn degenerate_optimizer_and_schedule_numbers_are_refused() {
    let dir = workspace("degenerate_numbers", "optimizer: {eps: .inf}\n");
    edit_cfg(&dir, "factor: 1.0", "factor: .nan, d_model: 0");
    edit_cfg(&dir, "max_steps: 20", "max_steps: 0");
    let err = train_fails(&dir);
    for want in [
        "schedule.factor is NaN; give a positive finite number",
        "schedule.d_model is 0; give a positive finite number",
        "optimizer.eps is inf; give a positive finite number",
        "train.max_steps is 0, so the run would take no step",
    ] {
        assert!(err.contains(want), "{want:?} in {err}");
    }
    assert!(!dir.join("run").exists());

    let dir = workspace_edited("diverging", &[("factor: 1.0", "factor: 1.0e30")]);
    let err = train_fails(&dir);
    assert!(
        err.contains("is not finite")
            && err.contains(
                "stopping — the run has no checkpoint yet (none was due before this step)"
            ),
        "{err}"
    );
    assert!(
        !err.contains("last good checkpoint") && !err.contains("panicked"),
        "{err}"
    );
    assert!(checkpoint::latest(&dir.join("run/checkpoints"))
        .unwrap()
        .is_none());
}

/// A workspace trained for 10 steps (one checkpoint, `run/checkpoints/step_00000010`).
fn trained(name: &str) -> PathBuf {
    let dir = workspace(name, "");
    let args = [
        "train",
        "--config",
        "cfg.yaml",
        "--quiet",
        "--max-steps",
        "10",
    ];
    ok(&dir, &args);
    dir
}

/// A `state.yaml` cut short, or empty, is refused by resume and inspect alike, as
/// truncated, rather than resumed with zeros for the seed and the data position (or
/// taken for a renamed checkpoint).
#[test]
fn a_truncated_train_state_is_refused() {
    let dir = trained("truncated_state");
    let state = dir.join("run/checkpoints/step_00000010/state.yaml");
    let full = std::fs::read_to_string(&state).unwrap();
    let first_line = full.lines().next().unwrap().to_string();
    assert_eq!(first_line, "step: 10");
    for (text, want) in [
        (
            format!("{first_line}\n"),
            "state.yaml` is incomplete (truncated?): it has no `epoch`, `batch_in_epoch`, `seed`",
        ),
        (
            String::new(),
            "state.yaml` is empty (truncated?); restore it, or delete the checkpoint directory",
        ),
    ] {
        write_sealed(&state, &text);
        for args in [
            &["train", "--resume", "run", "--quiet", "--max-steps", "12"][..],
            &["inspect", "run"][..],
        ] {
            let out = kiln(&dir, args);
            let err = unwrapped(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
            assert!(err.contains(want), "{args:?}: {err}");
            assert!(!err.contains("rename the directory"), "{err}");
        }
    }
    assert!(!dir.join("run/checkpoints/step_00000012").exists());
}

/// Rewrites the safetensors file `path` after `edit`.
/// Writes `bytes` to the checkpoint (or model directory) file `path` and records its new
/// checksum: for the tests that damage a file on purpose to see how it is named.
fn write_sealed(path: &Path, bytes: impl AsRef<[u8]>) {
    std::fs::write(path, bytes).unwrap();
    kiln_train::checksums::rehash(path.parent().unwrap()).unwrap();
}

fn rewrite_tensors(
    path: &Path,
    edit: impl Fn(&mut std::collections::BTreeMap<String, kiln_compiler::tensor::Tensor>),
) {
    let mut t = load_safetensors(path).unwrap();
    edit(&mut t);
    let named: Vec<_> = t.into_iter().collect();
    kiln_compiler::tensor::save_safetensors(path, &named, None).unwrap();
    kiln_train::checksums::rehash(path.parent().unwrap()).unwrap();
}

/// A flipped byte in a checkpoint's weights (#59, item 16: it used to load and
/// translate with exit 0) is caught by the checkpoint's SHA-256 record before anything
/// reads the file, by every command that reads a checkpoint; so is a checkpoint without
/// the record. The byte put back, the checkpoint translates again.
#[test]
fn a_flipped_weight_byte_is_refused_by_the_checksums() {
    let dir = trained("flipped_byte");
    let ck = dir.join("run/checkpoints/step_00000010");
    let model = ck.join("model.safetensors");
    let good = std::fs::read(&model).unwrap();
    let mut bad = good.clone();
    // The last byte is a weight's (the header comes first).
    *bad.last_mut().unwrap() ^= 0x01;
    std::fs::write(&model, &bad).unwrap();
    std::fs::write(dir.join("in.txt"), "s1 s2 s3\n").unwrap();
    let commands: [&[&str]; 4] = [
        &["translate", "--checkpoint", "run", "--input", "in.txt"],
        &[
            "score",
            "--checkpoint",
            "run",
            "--src",
            "in.txt",
            "--ref",
            "in.txt",
        ],
        &["inspect", "run"],
        &["train", "--resume", "run", "--quiet", "--max-steps", "12"],
    ];
    let refused = |want: &str| {
        for args in commands {
            let out = kiln(&dir, args);
            let err = unwrapped(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
            assert!(err.contains(want), "{args:?}: {err}");
        }
    };
    refused(
        "step_00000010: model.safetensors does not match its SHA-256 in checksums.sha256: \
         the file is damaged or was changed after kiln wrote it",
    );
    std::fs::write(&model, &good).unwrap();
    ok(&dir, commands[0]);
    // A newest checkpoint that lost a file: `kiln inspect RUN` names the file (it used
    // to say the run was an artifact without `manifest.json`).
    let optimizer = ck.join("optimizer.safetensors");
    let kept = std::fs::read(&optimizer).unwrap();
    std::fs::remove_file(&optimizer).unwrap();
    let out = kiln(&dir, &["inspect", "run"]);
    let err = unwrapped(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("has no `optimizer.safetensors`, so it is incomplete"),
        "{err}"
    );
    assert!(!err.contains("manifest.json"), "{err}");
    std::fs::write(&optimizer, kept).unwrap();
    std::fs::remove_file(ck.join("checksums.sha256")).unwrap();
    refused("step_00000010: no checksums.sha256");
}

/// Damaged checkpoint tensors are reported against the file that is damaged: weights
/// that lack a parameter are the weights' fault (not "the Adam moments do not match"),
/// and f64 weights or moments are named with their file and the fix — by resume and by
/// `kiln inspect` alike.
#[test]
fn damaged_checkpoint_tensors_are_blamed_on_their_file() {
    use kiln_compiler::tensor::{Tensor, TensorData};
    let dir = trained("damaged_tensors");
    let ck = dir.join("run/checkpoints/step_00000010");
    let (model, optimizer) = (
        ck.join("model.safetensors"),
        ck.join("optimizer.safetensors"),
    );
    let (good_model, good_optimizer) = (
        std::fs::read(&model).unwrap(),
        std::fs::read(&optimizer).unwrap(),
    );
    let f64_of = |t: &Tensor| Tensor {
        shape: t.shape.clone(),
        data: TensorData::F64(t.to_f64_vec().unwrap()),
    };
    let refused = |commands: &[&[&str]], want: &[&str]| {
        for args in commands {
            let out = kiln(&dir, args);
            let err = unwrapped(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
            for w in want {
                assert!(err.contains(w), "{w:?} from {args:?}: {err}");
            }
            assert!(!err.contains("panicked"), "{err}");
        }
    };
    let resume: &[&str] = &["train", "--resume", "run", "--quiet", "--max-steps", "12"];
    let inspect: &[&str] = &["inspect", "run"];

    rewrite_tensors(&model, |t| {
        t.remove("emb.weight");
    });
    refused(
        &[resume],
        &[
            "step_00000010/model.safetensors` lacks 1 of the",
            "emb.weight",
            "the checkpoint's files do not fit together",
        ],
    );
    let err = unwrapped(&kiln(&dir, resume).stderr);
    assert!(!err.contains("Adam moments"), "{err}");

    write_sealed(&model, &good_model);
    rewrite_tensors(&model, |t| {
        let p = f64_of(&t["emb.weight"]);
        t.insert("emb.weight".into(), p);
    });
    refused(
        &[resume, inspect],
        &["step_00000010/model.safetensors`: parameter `emb.weight` is f64, but a checkpoint's parameters are f32"],
    );

    write_sealed(&model, &good_model);
    rewrite_tensors(&optimizer, |t| {
        let m = f64_of(&t["m.emb.weight"]);
        t.insert("m.emb.weight".into(), m);
    });
    refused(
        &[resume, inspect],
        &[
            "step_00000010/optimizer.safetensors` does not fit the parameters in `",
            "moment `m.emb.weight` is f64, but Adam moments are f32; restore it, or delete the checkpoint directory",
        ],
    );
    write_sealed(&optimizer, &good_optimizer);

    // Weights or moments that are not finite (a damaged file, or a run that diverged)
    // are refused by every reader, not translated into empty lines, averaged into
    // another model or trained on.
    rewrite_tensors(&model, |t| {
        let mut p = t["decoder.layers.0.ffn.linear1.w"].clone();
        if let TensorData::F32(v) = &mut p.data {
            v[3] = f32::NAN;
            v[7] = f32::INFINITY;
        }
        t.insert("decoder.layers.0.ffn.linear1.w".into(), p);
    });
    std::fs::write(dir.join("one.src"), "s1 s2\n").unwrap();
    let ckpt = "run/checkpoints/step_00000010";
    refused(
        &[
            resume,
            inspect,
            &["translate", "--checkpoint", "run", "--input", "one.src"],
            &["average", "run/best", ckpt, "-o", "avg"],
            &["export", "run", "-o", "torch.safetensors"],
            &["export", &format!("{ckpt}/model.safetensors"), "-o", "torch.safetensors"],
        ],
        &[
            "parameter `decoder.layers.0.ffn.linear1.w` in `run/checkpoints/step_00000010/",
            "model.safetensors` has 2 of its 512 values not finite (NaN or infinite; the first at flat index 3)",
            "a run diverged before they were saved: use an earlier checkpoint",
        ],
    );
    assert!(!dir.join("avg").exists() && !dir.join("torch.safetensors").exists());
    write_sealed(&model, &good_model);
    // A plain weights file of integers is not a model's weights, either way.
    let ints = dir.join("ints.safetensors");
    let t = Tensor::i32(vec![2, 2], vec![1, 2, 3, 4]).unwrap();
    kiln_compiler::tensor::save_safetensors(&ints, &[("emb.weight".to_string(), t)], None).unwrap();
    refused(
        &[
            &["export", "ints.safetensors", "-o", "torch.safetensors"],
            &["import", "ints.safetensors", "-o", "kiln.safetensors"],
        ],
        &["tensor `emb.weight` in `ints.safetensors` is i32, but weights are floats"],
    );
    rewrite_tensors(&optimizer, |t| {
        let mut v = t["v.emb.weight"].clone();
        if let TensorData::F32(x) = &mut v.data {
            x[0] = f32::NEG_INFINITY;
        }
        t.insert("v.emb.weight".into(), v);
    });
    refused(
        &[resume, inspect],
        &[
            "moment `v.emb.weight` in `",
            "has 1 of its",
            "values not finite",
        ],
    );
    write_sealed(&optimizer, &good_optimizer);
    ok(&dir, resume);
    assert!(dir.join("run/checkpoints/step_00000012").is_dir());
}

/// A checkpoint whose tokenizer.json has another size than the model's vocabulary (a
/// tokenizer of another run copied in) is refused when it is loaded — by translate,
/// score, inspect and resume — naming both sizes, instead of translating garbage (a
/// smaller tokenizer) or failing deep in the model with an id out of range (a larger).
#[test]
fn a_tokenizer_of_another_size_is_refused() {
    let big = trained("tokenizer_219");
    let small = workspace("tokenizer_100", "");
    edit_cfg(&small, "vocab_size: 220", "vocab_size: 100");
    ok(
        &small,
        &[
            "train",
            "--config",
            "cfg.yaml",
            "--quiet",
            "--max-steps",
            "1",
        ],
    );
    let ck = |dir: &Path, step: &str| {
        dir.join("run/checkpoints")
            .join(step)
            .join("tokenizer.json")
    };
    let (big_tok, small_tok) = (ck(&big, "step_00000010"), ck(&small, "step_00000001"));
    let (big_bytes, small_bytes) = (
        std::fs::read(&big_tok).unwrap(),
        std::fs::read(&small_tok).unwrap(),
    );
    write_sealed(&big_tok, &small_bytes);
    write_sealed(&small_tok, &big_bytes);
    for (dir, want) in [
        (&big, "step_00000010/tokenizer.json` has 100 tokens but the model's embedding has 219 rows; this tokenizer belongs to another model"),
        (&small, "step_00000001/tokenizer.json` has 219 tokens but the model's embedding has 100 rows; this tokenizer belongs to another model"),
    ] {
        std::fs::write(dir.join("in.txt"), "s1 s2 s3\n").unwrap();
        for args in [
            &["translate", "--checkpoint", "run", "--input", "in.txt"][..],
            &["score", "--checkpoint", "run", "--src", "in.txt", "--ref", "in.txt"][..],
            &["inspect", "run"][..],
            &["train", "--resume", "run", "--quiet", "--max-steps", "12"][..],
        ] {
            let out = kiln(dir, args);
            let err = unwrapped(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
            assert!(err.contains(want), "{args:?}: {err}");
            assert!(out.stdout.is_empty(), "{args:?}");
        }
    }
}

/// `training.png` is a picture of the metrics: a failure to draw it is a warning, and
/// the run goes on to its checkpoints. A failure that does stop the run after a step
/// (here `best/` cannot be written) writes that step's checkpoint first and says so.
#[test]
fn a_plot_or_best_model_failure_keeps_the_training() {
    let dir = trained("plot_blocked");
    std::fs::remove_file(dir.join("run/training.png")).unwrap();
    std::fs::create_dir(dir.join("run/training.png")).unwrap();
    let out = kiln(
        &dir,
        &["train", "--resume", "run", "--quiet", "--max-steps", "20"],
    );
    let err = unwrapped(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: cannot write `run/training.png`: cannot rename the temporary plot")
            && err.contains("training goes on"),
        "{err}"
    );
    assert!(dir.join("run/checkpoints/step_00000020").is_dir());

    // Validation at step 5, checkpoints every 10: `best/` fails at step 5. (By the
    // loss, which improves after it; this task's BLEU stays 0 for 20 steps.)
    let dir = workspace_edited(
        "best_blocked",
        &[("valid: {every: 10", "valid: {metric: loss, every: 5")],
    );
    std::fs::create_dir_all(dir.join("run")).unwrap();
    std::fs::write(dir.join("run/best"), "a file where best/ goes").unwrap();
    let err = train_fails(&dir);
    assert!(
        err.contains("cannot write `run/best`")
            && err.contains(
                "the training up to step 5 is kept in `run/checkpoints/step_00000005`: fix \
                 that, then continue with `kiln train --resume run`"
            ),
        "{err}"
    );
    let ck = checkpoint::latest(&dir.join("run/checkpoints"))
        .unwrap()
        .unwrap();
    assert_eq!(ck.step, 5);
    std::fs::remove_file(dir.join("run/best")).unwrap();
    ok(&dir, &["train", "--resume", "run", "--quiet"]);
    assert!(dir.join("run/best/model.safetensors").is_file());
    assert!(dir.join("run/checkpoints/step_00000020").is_dir());
}

/// A new run does not overwrite a run directory's `config.yaml` or `metrics.jsonl` unless
/// they are those of an earlier start of the same configuration that left no checkpoint
/// (then it starts over, as before): a hand-written `config.yaml` (say, the one given to
/// `--config`), another run's, or a metrics log without a configuration are refused, and
/// left as they were.
#[test]
fn a_new_run_keeps_files_that_are_not_its_own() {
    let dir = workspace("foreign_files", "");
    let cfg = std::fs::read_to_string(dir.join("cfg.yaml")).unwrap();
    let refused = |want: &[&str]| {
        let err = train_fails(&dir);
        for w in want {
            assert!(err.contains(w), "{w:?} in {err}");
        }
    };
    let fix = "move it away (or delete it) to start a new run in this directory, or choose another `checkpoint.dir`";
    std::fs::create_dir_all(dir.join("run")).unwrap();
    let mine = format!("# my notes: tried lr x2\n{cfg}");
    std::fs::write(dir.join("run/config.yaml"), &mine).unwrap();
    refused(&[
        "`run/config.yaml` would be overwritten by the new run's configuration, and it is not one kiln wrote",
        fix,
    ]);
    assert_eq!(
        std::fs::read_to_string(dir.join("run/config.yaml")).unwrap(),
        mine
    );
    assert!(
        !dir.join("run/tokenizer.json").exists(),
        "refused before the tokenizer"
    );
    std::fs::remove_file(dir.join("run/config.yaml")).unwrap();
    let log = "{\"step\":5,\"kind\":\"train\",\"loss\":4.5}\n";
    std::fs::write(dir.join("run/metrics.jsonl"), log).unwrap();
    refused(&[
        "`run/metrics.jsonl` is the metrics log of an earlier run (",
        "no `config.yaml` and no checkpoints), which a new run would overwrite",
        fix,
    ]);
    assert_eq!(
        std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap(),
        log
    );
    std::fs::remove_file(dir.join("run/metrics.jsonl")).unwrap();

    // A start of this configuration that left no checkpoint (here: deleted) starts over,
    // for another number of steps too.
    train_ok(&dir, &["--max-steps", "10"]);
    std::fs::remove_dir_all(dir.join("run/checkpoints")).unwrap();
    train_ok(&dir, &[]);
    assert!(dir.join("run/checkpoints/step_00000020").is_dir());
    // Another configuration's is refused.
    std::fs::remove_dir_all(dir.join("run/checkpoints")).unwrap();
    edit_cfg(&dir, "warmup: 50", "warmup: 60");
    refused(&[
        "`run/config.yaml` would be overwritten by the new run's configuration, and it is the configuration of another run (it differs in `schedule`)",
        fix,
    ]);
}

/// A run directory's `tokenizer.json` is reused by a new run when its record says it was
/// trained on this configuration's data and `data.vocab_size`. One that a start on empty
/// files left (4 tokens, no training beside it) is trained again by the next start; one
/// beside a run that trained, for another vocabulary size, is refused, saying what
/// changed. A tokenizer without a record (an older kiln's, or put there by hand) is used
/// as before.
#[test]
fn a_stale_run_tokenizer_is_not_reused() {
    let dir = workspace("stale_tokenizer", "");
    let good = std::fs::read_to_string(dir.join("cfg.yaml")).unwrap();
    std::fs::write(dir.join("empty.txt"), "").unwrap();
    edit_cfg(
        &dir,
        "train_src: train.src, train_tgt: train.tgt",
        "train_src: empty.txt, train_tgt: empty.txt",
    );
    let out = kiln(&dir, &["train", "--config", "cfg.yaml", "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(unwrapped(&out.stderr).contains("no training pairs left in `empty.txt`"));
    assert!(
        dir.join("run/tokenizer.json").is_file() && dir.join("run/tokenizer.source.yaml").is_file()
    );
    assert!(!dir.join("run/config.yaml").exists());
    std::fs::write(dir.join("cfg.yaml"), &good).unwrap();
    let out = kiln(&dir, &["train", "--config", "cfg.yaml", "--max-steps", "1"]);
    let err = unwrapped(&out.stderr);
    assert!(out.status.success(), "{err}");
    says(&err, "trained a shared BPE vocabulary of 219 tokens");

    // Reused by the next start of this configuration.
    std::fs::remove_dir_all(dir.join("run/checkpoints")).unwrap();
    let out = kiln(&dir, &["train", "--config", "cfg.yaml", "--max-steps", "1"]);
    let err = unwrapped(&out.stderr);
    assert!(out.status.success(), "{err}");
    says(&err, "loaded the BPE vocabulary run/tokenizer.json (219 tokens); it was trained on this configuration's data");
    // Beside the run's checkpoint, another vocabulary size is refused (here by `kiln
    // compile --config`, which would build its artifact on it).
    edit_cfg(&dir, "vocab_size: 220", "vocab_size: 100");
    let err = fails(&dir, &["compile", "--config", "cfg.yaml", "-o", "art"]);
    says(&err, "`run/tokenizer.json` (219 tokens) was trained for other settings than this configuration's: data.vocab_size was 220, it is 100 now;");
    says(&err, "delete `run/tokenizer.json` and `run/tokenizer.source.yaml` to train a tokenizer for this configuration, or delete `run/tokenizer.source.yaml` alone to use this tokenizer all the same");
    // And so is one without the byte tokens where byte fallback is asked for.
    edit_cfg(
        &dir,
        "vocab_size: 100, byte_fallback: false",
        "vocab_size: 220, byte_fallback: true",
    );
    let err = fails(&dir, &["compile", "--config", "cfg.yaml", "-o", "art"]);
    says(&err, "was trained for other settings than this configuration's: data.byte_fallback was false, it is true now;");
    edit_cfg(&dir, "byte_fallback: true", "byte_fallback: false");
    // Without its record, it is used as it is (as kilns before records did).
    std::fs::remove_dir_all(dir.join("run/checkpoints")).unwrap();
    std::fs::remove_file(dir.join("run/config.yaml")).unwrap();
    std::fs::remove_file(dir.join("run/metrics.jsonl")).unwrap();
    std::fs::remove_file(dir.join("run/tokenizer.source.yaml")).unwrap();
    let out = kiln(&dir, &["train", "--config", "cfg.yaml", "--max-steps", "1"]);
    let err = unwrapped(&out.stderr);
    assert!(out.status.success(), "{err}");
    says(&err, "(219 tokens); it has no record of what it was trained on (an older kiln's, or put there by hand), so it is used as it is");
}

/// `kiln train` whose standard output and error are pipes nobody reads any more (`| head`
/// that has exited) trains on to its checkpoints and exits 0: progress and summary lines
/// that cannot be written are not a reason to lose the run. `kiln translate`, whose
/// standard output is its product, still fails cleanly on a closed pipe.
#[test]
fn closed_output_pipes_do_not_stop_training() {
    use std::process::Stdio;
    let dir = workspace("closed_pipes", "");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["train", "--config", "cfg.yaml"])
        .current_dir(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The readers go away before kiln writes its first line.
    drop(child.stdout.take());
    drop(child.stderr.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let ck = checkpoint::latest(&dir.join("run/checkpoints"))
        .unwrap()
        .unwrap();
    assert_eq!(ck.step, 20);

    std::fs::write(dir.join("in.txt"), "s1 s2 s3\n".repeat(50)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["translate", "--checkpoint", "run", "--input", "in.txt"])
        .current_dir(&dir)
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = unwrapped(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot write: Broken pipe") && !err.contains("panicked"),
        "{err}"
    );
}

/// Copies the flat directory `from` (a checkpoint) to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// `kiln average` refuses an output that is one of its inputs, lies inside one, or is a
/// checkpoint or run directory (it would overwrite trained weights), and the same
/// checkpoint given twice.
#[test]
fn average_does_not_overwrite_its_inputs() {
    let dir = workspace("average_outputs", "");
    train_ok(&dir, &[]);
    let weights = dir.join("run/checkpoints/step_00000020/model.safetensors");
    let before = std::fs::read(&weights).unwrap();
    let (a, b) = (
        "run/checkpoints/step_00000010",
        "run/checkpoints/step_00000020",
    );
    let (fa, fb) = (
        "run/checkpoints/step_00000010/model.safetensors",
        "run/checkpoints/step_00000020/model.safetensors",
    );
    let help = "choose another -o, outside it: nothing there is written over";
    for (args, want) in [
        (
            vec![a, b, "-o", b],
            format!("`-o {b}` is one of the inputs (`{b}`), which the output would overwrite"),
        ),
        (
            vec![fa, fb, "-o", fb],
            format!("`-o {fb}` is one of the inputs (`{fb}`)"),
        ),
        (
            vec![a, b, "-o", fb],
            format!("`-o {fb}` is inside a training checkpoint (`"),
        ),
        (
            vec![a, "-o", "run"],
            "`-o run` is a training run's directory".to_string(),
        ),
        (
            vec![a, "-o", "run/best"],
            "`-o run/best` is inside a training run's directory".to_string(),
        ),
        (
            vec!["--last", "1", "run", "-o", a],
            format!("`-o {a}` is a training checkpoint, whose files the output would overwrite"),
        ),
        (vec![a, a, "-o", "x"], format!("`{a}` is given twice")),
        (
            vec!["run", b, "-o", "x"],
            format!("`run` and `{b}` are the same checkpoint"),
        ),
    ] {
        let out = kiln(&dir, &[&["average"][..], &args].concat());
        // (Long paths are wrapped after a `/`.)
        let err = unwrapped(&out.stderr).replace("/ ", "/");
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(&want), "{args:?}: {want:?} in {err}");
        let help = if want.contains("twice") || want.contains("same checkpoint") {
            "average distinct checkpoints"
        } else {
            help
        };
        assert!(err.contains(help), "{args:?}: {err}");
    }
    assert_eq!(
        std::fs::read(&weights).unwrap(),
        before,
        "step 20's weights"
    );
    assert!(!dir.join("x").exists());
    ok(&dir, &["average", a, b, "-o", "avg"]);
    // An earlier average's output may be replaced.
    ok(&dir, &["average", a, b, "-o", "avg"]);
}

/// `kiln average` checks the graphs and tokenizer it copies from the first checkpoint
/// as `kiln translate` would, and refuses checkpoints whose graphs or tokenizer differ
/// from the first's (other runs), naming both files.
#[test]
fn average_checks_the_files_it_copies_and_refuses_other_runs() {
    let dir = workspace("average_files", "");
    train_ok(&dir, &[]);
    let ck = |step: u64| dir.join("run/checkpoints").join(checkpoint::dir_name(step));
    let refused = |inputs: &[&str], want: &[&str]| {
        let out = kiln(&dir, &[&["average"][..], inputs, &["-o", "avg"]].concat());
        let err = unwrapped(&out.stderr).replace("/ ", "/");
        assert_eq!(out.status.code(), Some(1), "{inputs:?}: {err}");
        for w in want {
            assert!(err.contains(w), "{inputs:?}: {w:?} in {err}");
        }
        assert!(!dir.join("avg").exists());
    };
    let ten = "run/checkpoints/step_00000010";
    for (file, bytes, want) in [
        (
            "graphs.json",
            &b""[..],
            "`bad/graphs.json`: not a kiln graph set",
        ),
        ("tokenizer.json", &b"{\"truncated"[..], "bad/tokenizer.json"),
    ] {
        let _ = std::fs::remove_dir_all(dir.join("bad"));
        copy_dir(&ck(20), &dir.join("bad"));
        write_sealed(&dir.join("bad").join(file), bytes);
        refused(&["bad", ten], &[want]);
        refused(&[ten, "bad"], &[want]);
    }
    std::fs::remove_file(dir.join("bad/tokenizer.json")).unwrap();
    refused(
        &["bad", ten],
        &["`bad` is not a kiln model: it has no `tokenizer.json`"],
    );

    // Another run's checkpoint: the same shapes, but another tokenizer (two tokens
    // swapped) or other graphs.
    let _ = std::fs::remove_dir_all(dir.join("other"));
    copy_dir(&ck(20), &dir.join("other"));
    let tok_path = dir.join("other/tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let (x, y) = (vocab["1"].clone(), vocab["2"].clone());
    vocab.insert("1".into(), y);
    vocab.insert("2".into(), x);
    write_sealed(&tok_path, serde_json::to_string(&tok).unwrap());
    refused(
        &[ten, "other"],
        &[
            "`other/tokenizer.json` differs from `run/checkpoints/step_00000010/tokenizer.json`: these are checkpoints of different models or runs (another vocabulary",
            "average checkpoints of one run only",
        ],
    );
    copy_dir(&ck(20), &dir.join("other"));
    let graphs_path = dir.join("other/graphs.json");
    let mut graphs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&graphs_path).unwrap()).unwrap();
    graphs["model"] = "renamed".into();
    write_sealed(&graphs_path, serde_json::to_vec(&graphs).unwrap());
    refused(
        &[ten, "other"],
        &["`other/graphs.json` differs from `run/checkpoints/step_00000010/graphs.json`"],
    );
}

/// Resuming a run for fewer steps than it has taken is refused (a run does not go back);
/// for exactly as many, nothing is trained and the summary says so, instead of "trained
/// 10 steps in 0.0s … loss 0.0000"; `--max-steps 0` is refused.
#[test]
fn resuming_below_or_at_the_current_step() {
    let dir = trained("resume_below");
    let out = kiln(&dir, &["train", "--resume", "run", "--max-steps", "5"]);
    let err = unwrapped(&out.stderr).replace("/ ", "/");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "train.max_steps is 5 (`--max-steps`, or the run's config.yaml), but the run is at \
             step 10 already (`run/checkpoints/step_00000010`): there is nothing to train, and \
             a run does not go back; give a --max-steps above 10 to train on"
        ),
        "{err}"
    );
    let out = kiln(&dir, &["train", "--resume", "run", "--max-steps", "10"]);
    assert!(out.status.success(), "{}", unwrapped(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text,
        "nothing to train: the run is at step 10, its train.max_steps; give a larger \
         --max-steps to train on\n"
    );
    let steps: Vec<u64> = checkpoint::list(&dir.join("run/checkpoints"))
        .unwrap()
        .iter()
        .map(|c| c.step)
        .collect();
    assert_eq!(steps, [10]);
    for args in [
        &["train", "--resume", "run", "--max-steps", "0"][..],
        &[
            "train",
            "--config",
            "cfg.yaml",
            "--dir",
            "run0",
            "--max-steps",
            "0",
        ][..],
    ] {
        let out = kiln(&dir, args);
        let err = unwrapped(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        says(&err, "--max-steps 0 asks for no step at all");
    }
    assert!(!dir.join("run0").exists());
}

/// A learned positional table (Table 3 (E)) covers `max_len` positions. Validation and
/// `kiln translate` decode within it however far `max_len_a` would let an output grow
/// (validation read position 33 of a 33-row table and stopped the run), and
/// a training pair, a line to translate or a reference to score that does not fit is
/// refused by name before anything runs.
#[test]
fn learned_positions_bound_decoding_and_are_checked() {
    let dir = workspace_edited(
        "learned_positions",
        &[
            (
                "p_drop: 0.1}",
                "p_drop: 0.1, learned_pos: true, max_len: 33}",
            ),
            ("valid: {every: 10,", "valid: {every: 1,"),
            ("max_len_b: 5", "max_len_b: 60"),
        ],
    );
    // After one step the model is all but its random start: <eos> is rarely likely,
    // so outputs run to their length limit.
    train_ok(&dir, &["--max-steps", "1"]);
    let info = ok(&dir, &["inspect", "run"]);
    says(&info, "  positions: sources up to 33 tokens (a learned table); outputs up to 33 tokens, <eos> included\n");
    let valid = std::fs::read_to_string(dir.join("valid.src")).unwrap();
    let first: String = valid.lines().take(3).map(|l| format!("{l}\n")).collect();
    std::fs::write(dir.join("three.src"), &first).unwrap();
    let out = kiln(
        &dir,
        &[
            "translate",
            "--checkpoint",
            "run",
            "--input",
            "three.src",
            "--max-len-a",
            "1e9",
            "--greedy",
        ],
    );
    assert!(out.status.success(), "{}", unwrapped(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    let tokens: usize = err
        .split(" output tokens")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no output token count in: {err}"));
    // Each output takes at most 33 positions, <eos> among them.
    assert!(tokens <= 3 * 32, "{tokens} output tokens: {err}");

    let long = vec!["s1"; 40].join(" ");
    std::fs::write(dir.join("long.src"), format!("{first}{long}\n")).unwrap();
    let err = fails(
        &dir,
        &["translate", "--checkpoint", "run", "--input", "long.src"],
    );
    says(&err, "line 4 takes 40 positions, but the model's table `src_pos.table` covers only 33: shorten it, or train a model with `max_len` 40 or more");
    std::fs::write(dir.join("one.src"), valid.lines().next().unwrap()).unwrap();
    std::fs::write(dir.join("one.tgt"), format!("{long}\n")).unwrap();
    let err = fails(
        &dir,
        &[
            "score",
            "--checkpoint",
            "run",
            "--src",
            "one.src",
            "--ref",
            "one.tgt",
        ],
    );
    says(&err, "`one.tgt` line 1 (<bos> and its tokens) takes 41 positions, but the model's table `tgt_pos.table` covers only 33");

    // Training pairs of up to 32 positions against a table of 6.
    let dir = workspace_edited(
        "learned_positions_short",
        &[(
            "p_drop: 0.1}",
            "p_drop: 0.1, learned_pos: true, max_len: 6}",
        )],
    );
    let err = train_fails(&dir);
    says(&err, "`train.tgt` line 8 (its tokens and <bos> or <eos>) takes 7 positions, but the model's table `tgt_pos.table` covers only 6: set `data.max_len` to that or less (longer pairs are left out), or train a model with `max_len` 7 or more");
    assert!(!dir.join("run").join("checkpoints").exists());
}

/// `kiln translate` on standard input translates each line as it arrives: a line written
/// to the pipe comes back while the pipe is still open, and what comes back is what the
/// same lines give from a file. Both stopping rules translate; an unknown one is refused.
#[test]
fn standard_input_is_translated_as_it_arrives() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    use std::sync::mpsc;
    use std::time::Duration;

    let dir = trained("stream");
    std::fs::write(dir.join("two.txt"), "s1 s2 s3\ns4 s5\n").unwrap();
    let whole = ok(
        &dir,
        &["translate", "--checkpoint", "run", "--input", "two.txt"],
    );
    let want: Vec<&str> = whole.lines().collect();
    assert_eq!(want.len(), 2, "{whole}");

    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["translate", "--checkpoint", "run"])
        .current_dir(&dir)
        .env("NO_COLOR", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    for (k, line) in ["s1 s2 s3", "s4 s5"].iter().enumerate() {
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        let got = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("line {k} did not come back with the pipe open: {e}"));
        assert_eq!(got, want[k], "line {k}");
        assert!(child.try_wait().unwrap().is_none(), "kiln exited early");
    }
    drop(stdin);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(
        rx.recv_timeout(Duration::from_secs(5)).is_err(),
        "an extra line"
    );

    let rule = |rule: &'static str| {
        let args = [
            "translate",
            "--checkpoint",
            "run",
            "--input",
            "two.txt",
            "--early-stop",
        ];
        kiln(&dir, &[&args[..], &[rule]].concat())
    };
    for name in ["k-finished", "exact"] {
        let out = rule(name);
        assert!(out.status.success(), "{name}: {}", unwrapped(&out.stderr));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).lines().count(),
            2,
            "{name}"
        );
    }
    let out = rule("soon");
    let err = unwrapped(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("invalid value 'soon' for '--early-stop"),
        "{err}"
    );
}

/// `kiln compile --from-model RUN --precision int8` writes an artifact that records int8
/// and runs its weights' products in int8 when loaded: it translates with the scores of
/// the model directory under `--gemm-type int8`, which differ from f32's; a run's
/// `--gemm-type f32` overrides it. Training in int8 is refused, at compile time and in the
/// YAML.
#[test]
fn an_int8_artifact_translates_with_the_int8_products() {
    let int8 = kiln_exec::compiled::Kernel16::Int8;
    if let Err(why) = int8.available() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = trained("int8_artifact");
    std::fs::write(dir.join("in.txt"), "s1 s2 s3\ns4 s5\ns3 s1 s1 s2\n").unwrap();
    ok(
        &dir,
        &[
            "compile",
            "--from-model",
            "run",
            "--precision",
            "int8",
            "-o",
            "i8",
        ],
    );
    let inspect = ok(&dir, &["inspect", "i8"]);
    assert!(inspect.contains("precision: int8"), "{inspect}");
    let tr = |model: &str, gemm: Option<&str>| {
        let mut args = vec![
            "translate",
            "--model",
            model,
            "--input",
            "in.txt",
            "--nbest",
            "2",
        ];
        args.extend_from_slice(&["--max-len-b", "6"]);
        if let Some(g) = gemm {
            args.extend_from_slice(&["--gemm-type", g]);
        }
        ok(&dir, &args)
    };
    let from_artifact = tr("i8", None);
    assert_eq!(from_artifact.lines().count(), 6, "{from_artifact}");
    assert_eq!(from_artifact, tr("run", Some("int8")));
    let f32 = tr("run", None);
    assert_ne!(from_artifact, f32, "the int8 scores are f32's");
    assert_eq!(tr("i8", Some("f32")), f32);

    let err = fails(
        &dir,
        &[
            "compile",
            "--config",
            "cfg.yaml",
            "--precision",
            "int8",
            "-o",
            "t8",
        ],
    );
    assert!(
        err.contains("--precision int8") && err.contains("entry `train_step` trains"),
        "{err}"
    );
    let err = fails(
        &dir,
        &[
            "train",
            "--config",
            "cfg.yaml",
            "--gemm-type",
            "int8",
            "--dir",
            "r8",
        ],
    );
    assert!(
        err.contains("train.gemm_type `int8`") && err.contains("kiln translate --gemm-type int8"),
        "{err}"
    );
}

/// `kiln average --best N RUN` takes the checkpoints of the best validations by the
/// run's metric (BLEU here, highest first, a tie to the later step), records the choice
/// in `average.yaml`, which `kiln inspect` prints, and says what it lacks.
fn best_checkpoints_are_averaged(dir: &Path) {
    let log = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let valid: Vec<(u64, f64)> = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "valid")
        .map(|v| (v["step"].as_u64().unwrap(), v["bleu"].as_f64().unwrap()))
        .collect();
    assert_eq!(valid.iter().map(|v| v.0).collect::<Vec<_>>(), [10, 20]);
    let want = if valid[0].1 > valid[1].1 { 10 } else { 20 };
    let out = ok(dir, &["average", "--best", "1", "run", "-o", "avg_best"]);
    assert!(
        out.starts_with(&format!(
            "averaged 1 checkpoint (step {want}; the best 1 by bleu) into avg_best"
        )),
        "{out}"
    );
    assert_eq!(
        load_safetensors(&dir.join("avg_best/model.safetensors")).unwrap(),
        load_safetensors(&dir.join(format!("run/checkpoints/step_{want:08}/model.safetensors")))
            .unwrap()
    );
    let record = std::fs::read_to_string(dir.join("avg_best/average.yaml")).unwrap();
    assert!(
        record.contains(&format!(
            "averaged: [{want}]\nchosen: best 1 by bleu\nvalidation:\n  {want}: {{loss: "
        )),
        "{record}"
    );
    let shown = ok(dir, &["inspect", "avg_best"]);
    assert!(shown.contains("chosen: best 1 by bleu"), "{shown}");
    let err = fails(dir, &["average", "--best", "3", "run", "-o", "x"]);
    assert!(
        err.contains("--best 3 asks for 3 checkpoints, but the run's validations (bleu) score 2 (steps 10, 20)"),
        "{err}"
    );
    assert!(!dir.join("x").exists());
}
