//! The `kiln` command line end to end: `check` (text and JSON), `graph`, `init`, `run`,
//! and the errors for bad tensor files — each a non-zero exit with a clear message and
//! nothing already on disk lost.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_compiler::init::init_params;
use kiln_compiler::reference::{run, RunOptions};
use kiln_compiler::tensor::{load_safetensors, save_safetensors, Tensor};
use kiln_dsl::Options;

mod common;
use common::{flat, kiln, root};

fn ok(args: &[&str]) -> String {
    let out = kiln(args);
    assert!(
        out.status.success(),
        "kiln {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn fails(args: &[&str]) -> String {
    let out = kiln(args);
    assert_eq!(
        out.status.code(),
        Some(1),
        "kiln {args:?} should fail with status 1"
    );
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    // `kiln graph … | head -1`: the rest of the graph meets a closed pipe.
    use std::io::Read;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["graph", "models/transformer_base.kiln"])
        .current_dir(root())
        .env_remove("RUST_BACKTRACE")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    // The read end is closed here, with most of the graph (about 140 KB) unwritten.
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(&first[..11], b"graph trans");
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(err.is_empty(), "{err}");
}

#[test]
fn a_spec_saved_with_a_byte_order_mark_is_read() {
    // Some editors start UTF-8 files with U+FEFF; the spec and its imports read as without.
    let dir = tmp("bom");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("layers.kiln"),
        "\u{feff}layer twice(d)(x) {\n  linear(d_in = d, d_out = d)(x) * 2.0\n}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("m.kiln"),
        "\u{feff}import \"layers.kiln\"\nmodel m(d: int = 4) {\n  dims batch\n  input x: \
         f32[batch, d]\n  output y = twice(x, d = d)\n}\n",
    )
    .unwrap();
    let text = ok(&["check", s(&dir.join("m.kiln"))]);
    assert!(text.contains("parameters  20 in 2 tensors"), "{text}");
}

#[test]
fn bleu_names_a_bad_line_and_a_misplaced_option() {
    let dir = tmp("bleu_errors");
    std::fs::create_dir_all(&dir).unwrap();
    let (hyp, refs) = (dir.join("hyp"), dir.join("ref"));
    std::fs::write(&hyp, b"the cat sat on the mat\n\xffa dog ran in the park\n").unwrap();
    std::fs::write(&refs, "the cat sat on the mat\na dog ran in the park\n").unwrap();
    let err = flat(&fails(&["bleu", "--ref", s(&refs), s(&hyp)]));
    assert!(
        err.contains("hyp` line 2 is not valid UTF-8 (bad byte at column 1)"),
        "{err}"
    );
    // A byte-order mark and CRLF line ends are not part of the text.
    std::fs::write(
        &hyp,
        "\u{feff}the cat sat on the mat\r\na dog ran in the park\r\n",
    )
    .unwrap();
    assert_eq!(
        ok(&["bleu", "--ref", s(&refs), s(&hyp), "--score-only"]).trim(),
        "100.00"
    );
    let smoothed = |method: &str, value: &str| {
        flat(&fails(&[
            "bleu",
            "--ref",
            s(&refs),
            s(&hyp),
            "--smooth",
            method,
            "--smooth-value",
            value,
        ]))
    };
    // A smoothing value without a smoothing that takes one was silently ignored.
    let err = smoothed("exp", "0.5");
    assert!(
        err.contains("--smooth-value sets the value of `floor` or `add-k` smoothing, not of `exp`"),
        "{err}"
    );
    let err = smoothed("floor", "nan");
    assert!(
        err.contains("needs a finite, non-negative value, got NaN"),
        "{err}"
    );
    assert!(
        !err.contains("one hypothesis line per reference line"),
        "{err}"
    );
}

#[test]
fn check_says_when_the_parameter_count_does_not_fit_in_64_bits() {
    // 2^33 · 2^33 weights: the count wrapped around to the bias's 2^33.
    let spec = tmp("overflow.kiln");
    std::fs::write(
        &spec,
        "model m(d: int = 8589934592) {\n  dims batch\n  input x: f32[batch, d]\n  \
         l = linear(d_in = d, d_out = d)\n  output y = l(x)\n}\n",
    )
    .unwrap();
    let text = ok(&["check", s(&spec)]);
    assert!(
        text.contains("parameters  at least 18,446,744,073,709,551,615 in 2 tensors"),
        "{text}"
    );
    let v: serde_json::Value = serde_json::from_str(&ok(&["check", s(&spec), "--json"])).unwrap();
    assert_eq!(v["parameters"].as_u64(), Some(u64::MAX));
}

#[test]
fn check_reports_the_papers_parameter_counts() {
    for (spec, want) in [
        ("models/transformer_base.kiln", 63_082_496u64),
        ("models/transformer_big.kiln", 214_245_376),
    ] {
        let json = ok(&["check", spec, "--set", "vocab=37000", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["parameters"].as_u64(), Some(want), "{spec}");
        assert_eq!(
            v["dims"],
            serde_json::json!(["batch", "src_len", "tgt_len"])
        );
        assert_eq!(v["inputs"][0]["name"], "src");
        assert_eq!(
            v["inputs"][0]["shape"],
            serde_json::json!(["batch", "src_len"])
        );
        assert_eq!(v["outputs"][0]["name"], "memory");
        assert_eq!(v["stages"], serde_json::json!(["memory"]));
        assert_eq!(
            v["outputs"][1]["shape"],
            serde_json::json!(["batch", "tgt_len", "37000"])
        );
        assert_eq!(v["objective"], "loss");
        assert!(v["nodes"].as_u64().unwrap() > 1000);
    }
}

#[test]
fn check_text_is_pinned() {
    let text = ok(&[
        "check",
        "models/transformer_base.kiln",
        "--set",
        "vocab=37000",
    ]);
    assert!(text.contains("parameters  63,082,496 in 253 tensors"));
    insta::assert_snapshot!("check_transformer_base", text);
}

#[test]
fn graph_prints_the_text_form() {
    let text = ok(&["graph", "models/transformer_tiny.kiln", "--set", "n=1"]);
    assert!(text.starts_with("graph transformer_tiny\ndims batch, src_len, tgt_len\n"));
    assert!(text.contains("%0 = input src : i32[batch, src_len]\n"));
    assert!(
        text.contains("\noutput logits = %") && text.contains("\nobjective loss = %"),
        "{text}"
    );
}

#[test]
fn init_is_seeded_and_deterministic() {
    let a = tmp("init_a.safetensors");
    let b = tmp("init_b.safetensors");
    let c = tmp("init_c.safetensors");
    ok(&[
        "init",
        "models/transformer_tiny.kiln",
        "--seed",
        "5",
        "-o",
        s(&a),
    ]);
    ok(&[
        "init",
        "models/transformer_tiny.kiln",
        "--seed",
        "5",
        "-o",
        s(&b),
    ]);
    ok(&[
        "init",
        "models/transformer_tiny.kiln",
        "--seed",
        "6",
        "-o",
        s(&c),
    ]);
    let (ta, tb, tc) = (
        load_safetensors(&a).unwrap(),
        load_safetensors(&b).unwrap(),
        load_safetensors(&c).unwrap(),
    );
    assert_eq!(ta, tb);
    assert_ne!(ta["emb.weight"], tc["emb.weight"]);
    assert_eq!(ta.len(), 85);
    // Norms start at gamma = 1, beta = 0; biases at 0.
    assert!(ta["encoder.layers.0.norm1.gamma"]
        .as_f32()
        .unwrap()
        .iter()
        .all(|&x| x == 1.0));
    assert!(ta["encoder.layers.0.norm1.beta"]
        .as_f32()
        .unwrap()
        .iter()
        .all(|&x| x == 0.0));
    assert!(ta["encoder.layers.0.ffn.linear1.b"]
        .as_f32()
        .unwrap()
        .iter()
        .all(|&x| x == 0.0));
    // Xavier-uniform bound for a 32 x 64 matrix.
    let bound = (6.0f32 / (32.0 + 64.0)).sqrt();
    let w = ta["encoder.layers.0.ffn.linear1.w"].as_f32().unwrap();
    assert!(w.iter().all(|x| x.abs() <= bound) && w.iter().any(|x| x.abs() > 0.9 * bound));
}

fn write_inputs(path: &Path, src: Tensor, tgt_in: Tensor, tgt_out: Option<Tensor>) {
    let mut v = vec![("src".to_string(), src), ("tgt_in".to_string(), tgt_in)];
    if let Some(t) = tgt_out {
        v.push(("tgt_out".to_string(), t));
    }
    save_safetensors(path, &v, None).unwrap();
}

#[test]
fn run_equals_the_library_reference_and_accepts_i64_ids() {
    let inputs = tmp("run_inputs.safetensors");
    let weights = tmp("run_weights.safetensors");
    let out = tmp("run_out.safetensors");
    let loss_out = tmp("run_loss.safetensors");
    write_inputs(
        &inputs,
        Tensor::i64(vec![2, 4], vec![5, 6, 7, 0, 8, 9, 10, 11]).unwrap(),
        Tensor::i32(vec![2, 3], vec![1, 7, 6, 1, 11, 10]).unwrap(),
        Some(Tensor::i32(vec![2, 3], vec![7, 6, 2, 11, 10, 2]).unwrap()),
    );
    ok(&[
        "init",
        "models/transformer_tiny.kiln",
        "--seed",
        "3",
        "-o",
        s(&weights),
    ]);
    let stdout = ok(&[
        "run",
        "models/transformer_tiny.kiln",
        "--inputs",
        s(&inputs),
        "--weights",
        s(&weights),
        "-o",
        s(&out),
    ]);
    assert!(stdout.contains("logits: f32 [2, 3, 64]"), "{stdout}");
    let got = load_safetensors(&out).unwrap();

    let g = kiln_dsl::compile_file(
        &root().join("models/transformer_tiny.kiln"),
        &Options::default(),
    )
    .unwrap();
    let fwd = g.prune(&g.forward_outputs()).unwrap();
    let params: BTreeMap<String, Tensor> = init_params(&g, 3).unwrap().into_iter().collect();
    let feeds = load_safetensors(&inputs).unwrap();
    let want = run(&fwd, &feeds, &params, &RunOptions::default()).unwrap();
    assert_eq!(got["logits"], want[0].1, "the CLI and the library disagree");

    let stdout = ok(&[
        "run",
        "models/transformer_tiny.kiln",
        "--entry",
        "loss",
        "--inputs",
        s(&inputs),
        "--weights",
        s(&weights),
        "-o",
        s(&loss_out),
        "--precision",
        "f64",
    ]);
    let loss = load_safetensors(&loss_out).unwrap();
    let l = loss["loss"]
        .as_f64()
        .expect("f64 precision gives f64 outputs")[0];
    assert!(l > 3.0 && l < 6.5, "loss {l}");
    assert!(stdout.contains("loss: f64 [] = "), "{stdout}");
}

#[test]
fn run_rejects_bad_tensor_files_and_keeps_existing_outputs() {
    let out = tmp("keep_me.safetensors");
    std::fs::write(&out, b"precious").unwrap();
    let spec = "models/transformer_tiny.kiln";
    let good_src = || Tensor::i32(vec![1, 3], vec![5, 6, 7]).unwrap();
    let good_tgt = || Tensor::i32(vec![1, 2], vec![1, 7]).unwrap();

    // An input the entry needs is missing.
    let missing = tmp("missing_tgt.safetensors");
    save_safetensors(&missing, &[("src".to_string(), good_src())], None).unwrap();
    let err = fails(&["run", spec, "--inputs", s(&missing), "-o", s(&out)]);
    assert!(err.contains("missing input `tgt_in`"), "{err}");

    // Token ids stored as floats.
    let float_ids = tmp("float_ids.safetensors");
    write_inputs(
        &float_ids,
        Tensor::f32(vec![1, 3], vec![5.0, 6.0, 7.0]).unwrap(),
        good_tgt(),
        None,
    );
    let err = fails(&["run", spec, "--inputs", s(&float_ids), "-o", s(&out)]);
    assert!(err.contains("input `src`") && err.contains("f32"), "{err}");

    // Wrong rank.
    let flat = tmp("flat.safetensors");
    write_inputs(
        &flat,
        Tensor::i32(vec![3], vec![5, 6, 7]).unwrap(),
        good_tgt(),
        None,
    );
    let err = fails(&["run", spec, "--inputs", s(&flat), "-o", s(&out)]);
    assert!(
        err.contains("input `src`") && err.contains("[batch, src_len]"),
        "{err}"
    );

    // Batch sizes that disagree.
    let conflict = tmp("conflict.safetensors");
    write_inputs(
        &conflict,
        good_src(),
        Tensor::i32(vec![2, 2], vec![1, 7, 1, 8]).unwrap(),
        None,
    );
    let err = fails(&["run", spec, "--inputs", s(&conflict), "-o", s(&out)]);
    assert!(err.contains("dim `batch`"), "{err}");

    // A token id outside the vocabulary.
    let oov = tmp("oov.safetensors");
    write_inputs(
        &oov,
        Tensor::i32(vec![1, 3], vec![5, 64, 7]).unwrap(),
        good_tgt(),
        None,
    );
    let err = fails(&["run", spec, "--inputs", s(&oov), "-o", s(&out)]);
    assert!(err.contains("64") && err.contains("gather"), "{err}");

    // A misspelled input name.
    let typo = tmp("typo.safetensors");
    save_safetensors(
        &typo,
        &[
            ("srcc".to_string(), good_src()),
            ("tgt_in".to_string(), good_tgt()),
        ],
        None,
    )
    .unwrap();
    let err = fails(&["run", spec, "--inputs", s(&typo), "-o", s(&out)]);
    assert!(err.contains("did you mean `src`?"), "{err}");

    // Inputs file that does not exist, or is not safetensors.
    let err = fails(&[
        "run",
        spec,
        "--inputs",
        "no/such/inputs.safetensors",
        "-o",
        s(&out),
    ]);
    assert!(err.contains("no/such/inputs.safetensors"), "{err}");
    let junk = tmp("junk.safetensors");
    std::fs::write(&junk, b"this is not a safetensors file").unwrap();
    let err = fails(&["run", spec, "--inputs", s(&junk), "-o", s(&out)]);
    assert!(err.contains("junk.safetensors"), "{err}");

    // Truncated weights, weights of another model size, and an incomplete weights file.
    let inputs = tmp("ok_inputs.safetensors");
    write_inputs(&inputs, good_src(), good_tgt(), None);
    let weights = tmp("w_full.safetensors");
    ok(&["init", spec, "-o", s(&weights)]);
    let bytes = std::fs::read(&weights).unwrap();
    let truncated = tmp("w_truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails(&[
        "run",
        spec,
        "--inputs",
        s(&inputs),
        "--weights",
        s(&truncated),
        "-o",
        s(&out),
    ]);
    assert!(err.contains("w_truncated.safetensors"), "{err}");
    let err = fails(&[
        "run",
        spec,
        "--set",
        "d_model=64",
        "--inputs",
        s(&inputs),
        "--weights",
        s(&weights),
        "-o",
        s(&out),
    ]);
    assert!(
        err.contains("has shape [32]")
            || err.contains("has shape [64, 32]")
            || err.contains("needs"),
        "{err}"
    );
    let mut partial = load_safetensors(&weights).unwrap();
    partial.remove("emb.weight");
    let partial_path = tmp("w_partial.safetensors");
    save_safetensors(
        &partial_path,
        &partial.into_iter().collect::<Vec<_>>(),
        None,
    )
    .unwrap();
    let err = fails(&[
        "run",
        spec,
        "--inputs",
        s(&inputs),
        "--weights",
        s(&partial_path),
        "-o",
        s(&out),
    ]);
    assert!(
        err.contains("lacks 1 of the 85 parameters") && err.contains("emb.weight"),
        "{err}"
    );

    // An entry point that does not exist.
    let err = fails(&[
        "run",
        spec,
        "--entry",
        "backward",
        "--inputs",
        s(&inputs),
        "-o",
        s(&out),
    ]);
    assert!(err.contains("unknown entry point `backward`"), "{err}");

    assert_eq!(
        std::fs::read(&out).unwrap(),
        b"precious",
        "a failed run must not touch the output"
    );
}

/// Counts and settings that mean nothing are refused when the arguments are read (clap's
/// usage error, status 2), with the flag named, before any model is loaded.
#[test]
fn meaningless_counts_and_settings_are_refused() {
    let usage_error = |args: &[&str]| {
        let out = kiln(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "kiln {args:?} should be a usage error"
        );
        String::from_utf8(out.stderr).unwrap()
    };
    let spec = root().join("models/transformer_tiny.kiln");
    let spec = s(&spec);
    for (flag, value, says) in [
        ("--runs", "0", "0 is not in 1.."),
        ("--batch", "0", "0 is not in 1.."),
        ("--src-len", "0", "0 is not in 1.."),
    ] {
        let err = usage_error(&["bench", spec, flag, value]);
        assert!(
            err.contains(flag) && err.contains(says),
            "{flag} {value}: {err}"
        );
    }
    let err = fails(&["bench", spec, "--tgt-len", "0", "--entry", "forward"]);
    assert!(
        err.contains("--tgt-len 0 leaves `forward` no target tokens to time"),
        "{err}"
    );
    let missing = tmp("no-such-model");
    let missing = s(&missing);
    for (flag, value, says) in [
        (
            "--beam",
            "0",
            "`0` is not a beam width: give a whole number from 1 to 256",
        ),
        ("--alpha", "nan", "`nan` is not a finite number"),
        ("--max-len-a", "-3", "`-3` is negative; give 0 or more"),
    ] {
        let arg = format!("{flag}={value}");
        let err = usage_error(&["translate", "--checkpoint", missing, &arg]);
        assert!(
            err.contains(flag) && err.contains(says),
            "{flag} {value}: {err}"
        );
    }
}

/// A model or a batch too large for the machine is a clear error before anything is
/// allocated (`kiln_compiler::memory`), not an abort ("memory allocation of N bytes
/// failed") or a kill; a file already at the output path is kept.
#[test]
fn a_model_or_batch_larger_than_the_machine_is_an_error_not_an_abort() {
    let out = tmp("too_large.safetensors");
    std::fs::write(&out, b"precious").unwrap();
    let err = fails(&[
        "init",
        "models/transformer_base.kiln",
        "--set",
        "vocab=3000000000",
        "-o",
        s(&out),
    ]);
    assert!(
        flat(&err).contains(
            "initializing 253 parameters would allocate 5.6 TiB, but the available memory"
        ) && flat(&err).contains("; make the model smaller (its vocabulary, width or layers)"),
        "{err}"
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");

    let err = fails(&[
        "bench",
        "models/transformer_tiny.kiln",
        "--entry",
        "forward",
        "--batch",
        "10000000000",
        "--runs",
        "1",
    ]);
    assert!(
        flat(&err).contains(
            "the random inputs at batch=10000000000, src_len=25, tgt_len=25 would allocate \
             1.8 TiB, but"
        ) && flat(&err).contains("; use a smaller batch or shorter lengths"),
        "{err}"
    );
}

#[test]
fn a_sentence_too_long_for_the_attention_scores_is_an_error_not_an_abort() {
    // The arena fits (a tiny model), but each thread's `[t, t]` score block would take
    // terabytes: the allocation aborted the process (SIGABRT) before it was checked.
    let err = flat(&fails(&[
        "bench",
        "models/transformer_tiny.kiln",
        "--entry",
        "forward",
        "--batch",
        "1",
        "--src-len",
        "1000000",
        "--tgt-len",
        "2",
        "--runs",
        "1",
        "--warmup",
        "0",
    ]));
    assert!(
        err.contains(
            "(encoder.layers.0.self_attn): attention: the compiled executor's `attention` (1 \
             f32 [1000000, 1000000] score block(s) for each of"
        ) && err.contains("would allocate")
            && err.contains("or shorter sequences (`kiln --no-memory-check` skips this check)"),
        "{err}"
    );
}

#[test]
fn init_to_an_unwritable_place_fails_cleanly() {
    let err = fails(&[
        "init",
        "models/transformer_tiny.kiln",
        "-o",
        "/proc/kiln-cannot-write-here/w.safetensors",
    ]);
    assert!(err.contains("w.safetensors"), "{err}");
}

#[cfg(unix)]
#[test]
fn outputs_write_through_links_and_into_devices_and_name_a_missing_directory() {
    use std::os::unix::fs::{symlink, FileTypeExt};
    let dir = tmp("outputs_special");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // `-o latest`, a link to this run's weights: the weights are written, the link kept.
    symlink("weights.safetensors", dir.join("latest")).unwrap();
    let spec = "models/transformer_tiny.kiln";
    ok(&["init", spec, "-o", s(&dir.join("latest"))]);
    assert!(std::fs::symlink_metadata(dir.join("latest"))
        .unwrap()
        .file_type()
        .is_symlink());
    let direct = dir.join("direct.safetensors");
    ok(&["init", spec, "-o", s(&direct)]);
    assert_eq!(
        std::fs::read(dir.join("weights.safetensors")).unwrap(),
        std::fs::read(&direct).unwrap(),
        "the same spec and seed give the same bytes"
    );
    // A device is written into, never replaced by a regular file.
    ok(&["init", spec, "-o", "/dev/null"]);
    ok(&["compile", spec, "--entry", "forward", "-o", "/dev/null"]);
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
    let err = flat(&fails(&[
        "init",
        spec,
        "-o",
        s(&dir.join("nodir/w.safetensors")),
    ]));
    assert!(
        err.contains("nodir` does not exist; create it first") && !err.contains(".tmp-"),
        "{err}"
    );
}

#[test]
fn demo_runs_without_files_and_learns_the_task() {
    // A fixed step count makes the run deterministic (on this machine, compiled executor:
    // 192/200 exact, BLEU 98.86 for the average of the last five checkpoints); 1,000
    // steps take ~30 s in the dev profile. The default demo trains for 60 s (~2,780 steps
    // in release on 2 cores: 200/200).
    let dir = tmp("demo_cwd");
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["demo", "--steps", "1000", "--dir"])
        .arg(dir.join("run"))
        .current_dir(&dir)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("trained 1000 steps"), "{text}");
    assert!(
        text.contains("average of 5 checkpoints (steps 600, 700, 800, 900, 1000)"),
        "{text}"
    );
    // "result (the average): exact match 194/200 = 97.0%   BLEU = 99.12 ..."
    let line = text
        .lines()
        .find(|l| l.contains("  result (") && l.contains("): exact match"))
        .unwrap_or_else(|| panic!("no exact-match line in:\n{text}"));
    let field = |after: &str| -> f64 {
        let rest = &line[line.find(after).unwrap() + after.len()..];
        let num: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        num.parse().unwrap()
    };
    let exact = field("exact match");
    let bleu = field("BLEU =");
    assert!(
        exact >= 180.0,
        "exact match {exact}/200 is too low:\n{text}"
    );
    assert!(bleu >= 95.0, "BLEU {bleu} is too low:\n{text}");
    for f in [
        "run/metrics.jsonl",
        "run/training.png",
        "run/tokenizer.json",
        "test.hyp",
    ] {
        assert!(dir.join("run").join(f).exists(), "{f} missing:\n{text}");
    }
}

#[test]
fn demo_never_deletes_files_it_did_not_write() {
    // A directory with a file of the user's, and one with only a `run/` (a real training
    // run, say): both refused, both left as they were.
    let dir = tmp("demo_foreign");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("run/checkpoints")).unwrap();
    std::fs::write(dir.join("thesis.txt"), "precious").unwrap();
    let err = flat(&fails(&["demo", "--steps", "1", "--dir", s(&dir)]));
    assert!(
        err.contains("holds files the demo does not write (`thesis.txt`)"),
        "{err}"
    );
    assert!(
        err.contains("give `--dir` a new or empty directory"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("thesis.txt")).unwrap(),
        "precious"
    );
    std::fs::remove_file(dir.join("thesis.txt")).unwrap();
    let err = flat(&fails(&["demo", "--steps", "1", "--dir", s(&dir)]));
    assert!(err.contains("holds no `demo.yaml`"), "{err}");
    assert!(dir.join("run/checkpoints").is_dir());
    // A file where the directory should be.
    let file = tmp("demo_file");
    std::fs::write(&file, "x").unwrap();
    let err = flat(&fails(&["demo", "--steps", "1", "--dir", s(&file)]));
    assert!(err.contains("is not a directory"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "x");
}

#[test]
fn demo_refuses_an_empty_budget() {
    // `--seconds 0` would mean "no time limit" to the trainer, `--steps 0` no training.
    for flag in ["--seconds", "--steps"] {
        let out = kiln(&["demo", flag, "0"]);
        assert_eq!(out.status.code(), Some(2), "demo {flag} 0");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("0 is not in 1.."), "{err}");
    }
}

/// `kiln bleu` against the `sacrebleu` command itself (2.x; `pip install sacrebleu`) on
/// generated text that exercises the 13a tokenizer (punctuation, quotes, numbers, dashes,
/// entities, mixed case), empty hypotheses and two references, under every smoothing,
/// lowercasing and tokenizer option both share: the same score to the 6 decimals
/// sacreBLEU prints. Skips, printing why, without `sacrebleu` on the PATH.
#[test]
fn bleu_equals_the_sacrebleu_command_when_installed() {
    let probe = Command::new("sacrebleu").arg("--version").output();
    match probe {
        Ok(o) if o.status.success() => {}
        _ => {
            eprintln!(
                "skipping bleu_equals_the_sacrebleu_command_when_installed: no `sacrebleu` \
                 on the PATH (`pip install sacrebleu` runs it)"
            );
            return;
        }
    }
    let words = [
        "A",
        "man",
        "in",
        "a",
        "blue",
        "shirt",
        "is",
        "riding",
        "bike",
        "down",
        "the",
        "street.",
        "Two",
        "dogs,",
        "\"play\"",
        "in",
        "snow",
        "(happily)",
        "it's",
        "U.S.",
        "3.14",
        "1,000",
        "e-mail",
        "50%",
        "&amp;",
        "--",
        "x-ray",
        "Hello!",
        "why?",
        "'s",
        "<b>",
        "naïve",
        "Straße",
        "$5.00",
        "end.",
        "don't",
        "...",
        ";",
        "Mr.",
        "und",
    ];
    let mut state = 0x2545f4914f6cdd1du64;
    let mut next = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    // Two corpora: 300 long segments (every n-gram order has matches), and 12 short
    // ones without 3- or 4-gram matches, where the smoothings differ.
    let mut corpus = |lines: usize, short: bool| {
        let (mut refs, mut refs2, mut hyps) = (String::new(), String::new(), String::new());
        for line in 0..lines {
            let len = if short { 4 + next(3) } else { 1 + next(14) };
            // Short segments use plain words: a word 13a splits (`(happily)`) would
            // bring its own 3-grams.
            let pool: &[&str] = if short { &words[1..11] } else { &words };
            let r: Vec<&str> = (0..len).map(|_| pool[next(pool.len())]).collect();
            // The hypothesis: the reference with words dropped, swapped or replaced; in
            // the short corpus every third word replaced by an unknown one (so no 3- or
            // 4-gram matches).
            let mut h: Vec<&str> = Vec::new();
            for (i, w) in r.iter().enumerate() {
                if short {
                    h.push(if i % 3 == 2 { "zzz" } else { w });
                    continue;
                }
                match next(10) {
                    0 => {}
                    1 => h.push(words[next(words.len())]),
                    2 if !h.is_empty() => {
                        let at = h.len() - 1;
                        h.insert(at, *w)
                    }
                    _ => h.push(*w),
                }
            }
            let h = if line % 37 == 5 {
                String::new()
            } else {
                h.join(" ")
            };
            let r2: Vec<&str> = r.iter().rev().copied().collect();
            refs.push_str(&format!("{}\n", r.join(" ")));
            refs2.push_str(&format!("{}\n", r2.join(" ")));
            hyps.push_str(&format!("{h}\n"));
        }
        let tag = if short { "short" } else { "long" };
        let (rf, rf2, hf) = (
            tmp(&format!("sb_{tag}.ref")),
            tmp(&format!("sb_{tag}.ref2")),
            tmp(&format!("sb_{tag}.hyp")),
        );
        std::fs::write(&rf, refs).unwrap();
        std::fs::write(&rf2, refs2).unwrap();
        std::fs::write(&hf, hyps).unwrap();
        (rf, rf2, hf)
    };
    let corpora = [corpus(300, false), corpus(12, true)];
    // First both commands' defaults (sacreBLEU's `exp` smoothing), then each option.
    let cases: [(&[&str], &[&str]); 9] = [
        (&[], &[]),
        (&["--smooth", "none"], &["--smooth-method", "none"]),
        (&["--smooth", "exp"], &["--smooth-method", "exp"]),
        (&["--smooth", "floor"], &["--smooth-method", "floor"]),
        (
            &["--smooth", "floor", "--smooth-value", "0.3"],
            &["--smooth-method", "floor", "--smooth-value", "0.3"],
        ),
        (&["--smooth", "add-k"], &["--smooth-method", "add-k"]),
        (
            &["--lowercase", "--smooth", "none"],
            &["-lc", "--smooth-method", "none"],
        ),
        (
            &["--tokenize", "none", "--smooth", "none"],
            &["--tokenize", "none", "--smooth-method", "none"],
        ),
        (
            &["--smooth", "exp", "--lowercase"],
            &["-lc", "--smooth-method", "exp"],
        ),
    ];
    let mut scores = Vec::new();
    for ((rf, rf2, hf), two_refs) in corpora
        .iter()
        .flat_map(|c| [(c, false), (c, true)])
        .map(|(c, t)| (c.clone(), t))
    {
        for (ours, theirs) in cases {
            let mut args = vec!["bleu", "--ref", s(&rf)];
            if two_refs {
                args.extend(["--ref", s(&rf2)]);
            }
            args.extend(ours);
            args.extend(["--json", s(&hf)]);
            let json = ok(&args);
            let v: serde_json::Value = serde_json::from_str(&json).unwrap();
            let kiln_score = v["score"].as_f64().unwrap();
            let mut sb = Command::new("sacrebleu");
            sb.arg(&rf);
            if two_refs {
                sb.arg(&rf2);
            }
            let out = sb
                .args(["-i", s(&hf), "-m", "bleu", "-b", "-w", "6"])
                .args(theirs)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let theirs_score: f64 = String::from_utf8(out.stdout)
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            assert!(
                (kiln_score - theirs_score).abs() <= 1e-6,
                "{ours:?} (two references: {two_refs}): kiln {kiln_score}, sacreBLEU {theirs_score}"
            );
            scores.push(kiln_score);
        }
    }
    // The options and corpora do give different scores (the comparison has teeth):
    // on the short corpus the four smoothings all differ.
    // The signatures of both commands' defaults, with two references.
    let (rf, rf2, hf) = &corpora[0];
    let ours = ok(&["bleu", "--ref", s(rf), "--ref", s(rf2), "--json", s(hf)]);
    let ours: serde_json::Value = serde_json::from_str(&ours).unwrap();
    let out = Command::new("sacrebleu")
        .args([s(rf), s(rf2), "-i", s(hf), "-m", "bleu"])
        .output()
        .unwrap();
    let theirs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ours["signature"], theirs["signature"]);
    // Cases 1 to 5 of the short corpus with one reference (after 2 × 9 long ones).
    let short_one_ref = &scores[19..24];
    assert_eq!(scores[18], scores[20], "the default is `exp`");
    for i in 0..short_one_ref.len() {
        for j in i + 1..short_one_ref.len() {
            assert!(
                (short_one_ref[i] - short_one_ref[j]).abs() > 1e-3,
                "{short_one_ref:?}"
            );
        }
    }
}
