//! Compiled artifacts: `kiln compile --entries … -o DIR`, `kiln inspect DIR`, and
//! `kiln_exec::artifact::Artifact::load` — round trip against the reference executor,
//! determinism, and the errors for corrupted, truncated and newer artifacts.
//!
//! Tolerance, per output (as in `tests/compiled.rs`):
//! `max|artifact − reference| ≤ 1e-5·max|reference| + 1e-6`.

use kiln_exec::executor::Exec;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::optimize::validate::{random_feeds_with, Feeds};
use kiln_compiler::reference::{self, RunOptions};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::Graph;
use kiln_exec::artifact::{Artifact, ArtifactError};

mod common;
use common::{flat, kiln};

const REL: f64 = 1e-5;
const ABS: f64 = 1e-6;
const SPEC: &str = "models/transformer_tiny.kiln";

/// A fresh, empty directory for one test.
fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("artifact")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Records in `m` the digest of its edited contents, as `kiln compile` would have.
fn rehash(m: &mut serde_json::Value) {
    let manifest: kiln_compiler::artifact::Manifest = serde_json::from_value(m.clone()).unwrap();
    m["manifest_hash"] = manifest.digest().unwrap().into();
}

/// Compiles the tiny spec (vocabulary 48) into `dir` with `entries`.
fn compile(dir: &Path, entries: &str) {
    let out = kiln(&[
        "compile",
        SPEC,
        "--set",
        "vocab=48",
        "--entries",
        entries,
        "--target",
        "cpu",
        "-o",
        dir.to_str().unwrap(),
        "--seed",
        "7",
    ]);
    assert!(
        out.status.success(),
        "kiln compile failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `kiln args`, which must succeed (its standard error otherwise).
fn kiln_ok(args: &[&str]) -> std::process::Output {
    let out = kiln(args);
    assert!(out.status.success(), "kiln {args:?}: {}", stderr(&out));
    out
}

/// The artifact's entry points, in manifest order.
fn entry_names(art: &Artifact) -> Vec<&str> {
    art.entries()
        .iter()
        .map(|e| e.manifest.name.as_str())
        .collect()
}

/// Standard error with the diagnostic's line wrapping undone (`\n  │ ` → ` `): where a
/// message wraps depends on the length of the paths in it.
fn stderr(out: &std::process::Output) -> String {
    unwrap_lines(&String::from_utf8_lossy(&out.stderr))
}

fn unwrap_lines(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        match t.strip_prefix('│') {
            Some(rest) if i > 0 => {
                out.push(' ');
                out.push_str(rest.trim_start());
            }
            _ => {
                if i > 0 {
                    out.push('\n');
                }
                out.push_str(line);
            }
        }
    }
    out
}

/// Every file under `dir`, by relative path.
/// `kiln compile SPEC` (vocab 48) of train_step and decode_step for `target` and
/// `precision`, with `extra` flags, into `out`.
fn compile_for(out: &Path, target: &str, precision: &str, extra: &[&str]) {
    let mut args = vec!["compile", SPEC, "--set", "vocab=48", "--entries"];
    args.extend([
        "train_step,decode_step",
        "--target",
        target,
        "--precision",
        precision,
    ]);
    args.extend_from_slice(extra);
    args.extend(["-o", out.to_str().unwrap()]);
    kiln_ok(&args);
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Runs entry `entry` of the artifact and the reference executor on the same random
/// inputs with the artifact's weights; returns the mismatches.
fn compare(
    art: &Artifact,
    entry: &str,
    weights: &BTreeMap<String, Tensor>,
    seed: u64,
) -> Vec<String> {
    let exec = art
        .executor(entry)
        .unwrap_or_else(|e| panic!("{entry}: {e}"));
    let g: &Graph = exec.graph();
    let sizes = [2i64, 5, 3, 2];
    let dims: BTreeMap<String, i64> = g
        .dims
        .iter()
        .enumerate()
        .map(|(i, d)| (d.clone(), sizes[i % sizes.len()]))
        .collect();
    let (inputs, random_params): (Feeds, Feeds) =
        random_feeds_with(g, seed, &dims).unwrap_or_else(|e| panic!("{entry}: {e}"));
    // The artifact's weights, for exactly the graph's parameters.
    let params: Feeds = random_params
        .keys()
        .map(|k| {
            let w = weights
                .get(k)
                .unwrap_or_else(|| panic!("{entry}: the artifact has no weight `{k}`"));
            (k.clone(), w.clone())
        })
        .collect();
    let opts = RunOptions {
        seed,
        step: 3,
        ..RunOptions::default()
    };
    let want = reference::run(g, &inputs, &params, &opts)
        .unwrap_or_else(|e| panic!("{entry}: reference: {e}"));
    let got = exec
        .run(&inputs, &params, &opts)
        .unwrap_or_else(|e| panic!("{entry}: artifact: {e}"));
    assert_eq!(want.len(), got.len(), "{entry}: output count");
    let mut bad = Vec::new();
    for ((name, w), (n2, c)) in want.iter().zip(&got) {
        assert_eq!(name, n2);
        let (w, c) = (w.to_f64_vec().unwrap(), c.to_f64_vec().unwrap());
        assert_eq!(w.len(), c.len(), "{entry}: output `{name}` size");
        let max_ref = w.iter().fold(0f64, |m, x| m.max(x.abs()));
        let diff = w
            .iter()
            .zip(&c)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
        if diff > REL * max_ref + ABS || diff.is_nan() {
            bad.push(format!(
                "{entry} `{name}`: max diff {diff:.3e}, max |ref| {max_ref:.3e}"
            ));
        }
    }
    bad
}

#[test]
fn artifact_round_trips_and_matches_the_reference() {
    let dir = tmp("round_trip").join("tiny");
    compile(&dir, "forward,encode,decode_step,train_step");
    for f in [
        "manifest.json",
        "weights.safetensors",
        "kernels/forward.clif",
        "kernels/encode.clif",
        "kernels/decode_step.clif",
        "kernels/train_step.clif",
    ] {
        assert!(dir.join(f).is_file(), "missing {f}");
    }
    // No temporary directories left beside it.
    let siblings: Vec<String> = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(siblings, vec!["tiny".to_string()]);

    // The manifest's fields.
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["format"], "kiln-artifact");
    assert_eq!(m["version"], 4);
    assert_eq!(
        m["options"],
        serde_json::json!({"target": "Cpu", "precision": "f32", "buffer_reuse": true,
            "product_groups": true, "bias_grad_fusion": true})
    );
    assert_eq!(m["model"], "transformer_tiny");
    assert_eq!(m["spec_hash"].as_str().unwrap().len(), 16);
    let fwd = &m["entries"][0];
    assert_eq!(fwd["name"], "forward");
    let ks = fwd["launch"]["launches"].as_array().unwrap();
    assert!(ks.len() > 10);
    for (k, next) in ks.iter().zip(&ks[1..]) {
        // Kernel values are numbered in launch order.
        assert!(
            k["value"].as_u64() < next["value"].as_u64(),
            "{k} before {next}"
        );
        assert!(k["writes"][0]["buffer"].is_u64(), "{k}");
        assert!(k["writes"][0]["slot"].is_u64(), "{k}");
        assert!(
            k["functions"].as_object().is_some_and(|f| !f.is_empty()),
            "{k}"
        );
    }
    assert!(m["files"]["weights.safetensors"]["bytes"].as_u64().unwrap() > 1000);
    assert!(m["files"]["kernels/forward.clif"]["sha256"]
        .as_str()
        .is_some_and(|h| h.len() == 64));

    // Load it without the spec and run every entry against the reference.
    let art = Artifact::load(&dir).unwrap();
    assert_eq!(art.model(), "transformer_tiny");
    assert!(art.hparams().iter().any(|(k, v)| k == "vocab" && v == "48"));
    let names = entry_names(&art);
    assert_eq!(names, ["forward", "encode", "decode_step", "train_step"]);
    let weights = art.weights().unwrap();
    assert_eq!(weights.len(), 85);
    // The weights are the spec's, initialized from the seed given to `kiln compile`.
    let init_dir = tmp("round_trip_init");
    let init = init_dir.join("w.safetensors");
    kiln_ok(&[
        "init",
        SPEC,
        "--set",
        "vocab=48",
        "--seed",
        "7",
        "-o",
        init.to_str().unwrap(),
    ]);
    let want = kiln_compiler::tensor::load_safetensors(&init).unwrap();
    assert_eq!(
        weights.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (k, w) in &want {
        assert_eq!(weights[k].as_f32(), w.as_f32(), "weight `{k}`");
    }
    let mut bad = Vec::new();
    for (i, e) in ["forward", "encode", "decode_step", "train_step"]
        .iter()
        .enumerate()
    {
        bad.extend(compare(&art, e, &weights, 11 + i as u64));
    }
    assert!(
        bad.is_empty(),
        "the artifact disagrees with the reference:\n{}",
        bad.join("\n")
    );
    assert!(matches!(
        art.executor("loss"),
        Err(ArtifactError::NoEntry { .. })
    ));

    // `kiln inspect` reports real numbers.
    let out = kiln_ok(&["inspect", dir.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    for want in [
        "format: kiln-artifact v4",
        "model: transformer_tiny",
        "  options:\n    target: cpu\n    cuda_arch: -\n    precision: f32\n    buffer_reuse: true\n    \
         product_groups: true\n    bias_grad_fusion: true\n",
        "  fusions: ",
        "host: ",
        "16-bit products (--gemm-type 16bit): ",
        "weights: 85 tensors",
        "entry forward",
        "entry train_step",
        "attention 6",
        "at batch=32 src_len=25 tgt_len=25: arena ",
        "at batch=32 past=0 src_len=25 tgt_len=25: arena ",
    ] {
        assert!(text.contains(want), "`{want}` not in:\n{text}");
    }
    // Kernel totals and arena bytes agree with the loaded artifact.
    let fwd = art.entry("forward").unwrap();
    let total = fwd.manifest.kernel_graph.kernels().len();
    assert!(text.contains(&format!("  kernels: {total} (")), "{text}");
    let dims: BTreeMap<String, i64> = [("batch", 32), ("src_len", 25), ("tgt_len", 25)]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
    // A CPU artifact's arena leaves out the outputs, which the executor writes straight
    // into the tensors it returns (the forward's logits here).
    let plan = &fwd.manifest.plan;
    let external = plan.output_buffers(&fwd.manifest.kernel_graph);
    let arena = plan.layout_with(&dims, &external).unwrap().total;
    let peak = plan.live_peak(&dims).unwrap();
    let outside: usize = plan
        .buffers
        .iter()
        .zip(&external)
        .filter(|(_, &x)| x)
        .map(|(b, _)| b.bytes(&dims).unwrap())
        .sum();
    assert!(arena > 0 && peak > 0 && outside > 0);
    assert!(arena <= plan.layout(&dims).unwrap().total);
    assert!(
        text.contains(&format!(
            "arena {arena} bytes (+ {outside} bytes of outputs outside it), live peak {peak} bytes"
        )),
        "{text}"
    );
    // Other dims, and the plan text.
    let out = kiln_ok(&["inspect", dir.to_str().unwrap(), "--batch", "2", "--plan"]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains("at batch=2 src_len=25 tgt_len=25: arena "),
        "{text}"
    );
    assert!(text.contains("slot 0 "), "{text}");
}

#[test]
fn the_same_spec_compiles_to_the_same_bytes() {
    let base = tmp("deterministic");
    let (a, b) = (base.join("a"), base.join("b"));
    compile(&a, "forward,decode_step");
    compile(&b, "forward,decode_step");
    let (fa, fb) = (files(&a), files(&b));
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    for (k, v) in &fa {
        assert!(v == &fb[k], "{k} differs between two compilations");
    }
    // Recompiling over an existing artifact replaces it (same bytes again).
    compile(&a, "forward,decode_step");
    assert_eq!(files(&a), fa);
    // A different entry list replaces the old artifact entirely.
    compile(&a, "encode");
    assert!(!a.join("kernels/forward.clif").exists());
    assert!(a.join("kernels/encode.clif").is_file());
}

/// `kiln compile SPEC -o DIR` without `--entries` writes an artifact of every entry point,
/// as a compiler's `-o` writes its program; `--entry NAME -o FILE` still writes one kernel
/// graph's text, and `--entry` with `--entries` is a usage error.
#[test]
fn compile_to_a_directory_writes_every_entry() {
    let base = tmp("default_entries");
    let dir = base.join("all.art");
    let out = kiln_ok(&[
        "compile",
        SPEC,
        "--set",
        "vocab=48",
        "-o",
        dir.to_str().unwrap(),
    ]);
    let art = Artifact::load(&dir).unwrap();
    let names = entry_names(&art);
    assert_eq!(
        names,
        ["forward", "train_step", "loss", "encode", "decode_step"]
    );
    assert!(stderr(&out).contains("5 entries"), "{}", stderr(&out));

    let file = base.join("k.txt");
    kiln_ok(&[
        "compile",
        SPEC,
        "--entry",
        "encode",
        "-o",
        file.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.starts_with("kernels transformer_tiny target=cpu\n"),
        "{text}"
    );
    assert!(text.contains("\noutput memory = %"), "{text}");

    let out = kiln(&[
        "compile",
        SPEC,
        "--entry",
        "encode",
        "--entries",
        "encode",
        "-o",
        base.join("x").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot be used with"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_corrupted_kernel_file_is_named() {
    let dir = tmp("corrupt").join("art");
    compile(&dir, "forward");
    let clif = dir.join("kernels/forward.clif");
    let mut bytes = std::fs::read(&clif).unwrap();
    let i = bytes.len() / 2;
    bytes[i] = if bytes[i] == b'x' { b'y' } else { b'x' };
    std::fs::write(&clif, &bytes).unwrap();
    let err = Artifact::load(&dir).unwrap_err();
    assert!(matches!(err, ArtifactError::Corrupt { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("forward.clif") && msg.contains("corrupt") && msg.contains("recompile"),
        "{msg}"
    );
    let out = kiln(&["inspect", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("kiln::artifact") && e.contains("forward.clif"),
        "{e}"
    );
}

#[test]
fn a_truncated_weights_file_is_named() {
    let dir = tmp("truncated").join("art");
    compile(&dir, "forward");
    let w = dir.join("weights.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() - 100]).unwrap();
    let err = Artifact::load(&dir).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ArtifactError::Corrupt { .. }), "{err:?}");
    assert!(
        msg.contains("weights.safetensors") && msg.contains("bytes"),
        "{msg}"
    );
    // A missing file is named too.
    std::fs::remove_file(&w).unwrap();
    let msg = Artifact::load(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("weights.safetensors") && msg.contains("missing"),
        "{msg}"
    );
}

/// A manifest changed after `kiln compile` wrote it — a memory plan whose buffers die
/// early or share one slot, a buffer smaller than its kernel writes — is refused at load
/// by its own hash, before any executor trusts it (such plans gave wrong outputs, or a
/// heap overrun); a manifest only reformatted still loads.
#[test]
fn a_manifest_changed_after_it_was_written_is_refused() {
    let dir = tmp("manifest_hash").join("art");
    compile(&dir, "forward");
    let mpath = dir.join("manifest.json");
    let text = std::fs::read_to_string(&mpath).unwrap();
    let original: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(original["manifest_hash"]
        .as_str()
        .is_some_and(|h| h.len() == 64));
    // Reformatted (compact JSON, same contents): still the same manifest.
    std::fs::write(&mpath, serde_json::to_vec(&original).unwrap()).unwrap();
    Artifact::load(&dir).unwrap().executor("forward").unwrap();
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit); 3] = [
        ("buffers dying early", |m| {
            for b in m["entries"][0]["plan"]["buffers"].as_array_mut().unwrap() {
                b["dies"] = b["born"].clone();
            }
        }),
        ("every buffer in one slot", |m| {
            for b in m["entries"][0]["plan"]["buffers"].as_array_mut().unwrap() {
                b["slot"] = 0.into();
            }
        }),
        ("a buffer shape shrunk", |m| {
            let b = &mut m["entries"][0]["plan"]["buffers"][3];
            b["ty"]["shape"] = serde_json::json!([{"terms": [[[], 1]]}]);
        }),
    ];
    for (what, edit) in edits {
        let mut m = original.clone();
        edit(&mut m);
        std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        let err = Artifact::load(&dir).unwrap_err();
        assert!(
            matches!(err, ArtifactError::BadManifest { .. }),
            "{what}: {err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("manifest.json")
                && msg.contains("modified or damaged after `kiln compile` wrote it")
                && msg.contains("recompile"),
            "{what}: {msg}"
        );
        let out = kiln(&["inspect", dir.to_str().unwrap()]);
        assert!(!out.status.success(), "{what}");
        assert!(
            stderr(&out).contains("modified or damaged"),
            "{what}: {}",
            stderr(&out)
        );
    }
    // A manifest without its hash is refused: no path skips the check.
    let mut m = original.clone();
    m.as_object_mut().unwrap().remove("manifest_hash");
    std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let msg = Artifact::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("missing field `manifest_hash`"), "{msg}");
    // One edited and hashed again (as a forger would) still has its memory plan checked
    // against its kernel graph.
    for (what, edit) in edits {
        let mut m = original.clone();
        edit(&mut m);
        rehash(&mut m);
        std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        let msg = Artifact::load(&dir).unwrap_err().to_string();
        assert!(
            msg.contains("entry `forward`: the memory plan is not the one its kernel graph gives"),
            "{what}: {msg}"
        );
    }
}

/// A manifest hashed again after an edit (as a forger would) whose graphs point out of range
/// — a kernel operand, a projection, a launch position, a parameter list entry — is a clear
/// error at load, not a panic in the executor or the memory planner.
#[test]
fn a_manifest_without_its_hash_with_indices_out_of_range_is_refused() {
    let dir = tmp("manifest_indices").join("art");
    compile(&dir, "forward");
    let mpath = dir.join("manifest.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    let first_kernel = |m: &mut serde_json::Value| -> usize {
        m["entries"][0]["kernel_graph"]["values"]
            .as_array()
            .unwrap()
            .iter()
            .position(|v| {
                v["def"]
                    .get("Kernel")
                    .is_some_and(|k| !k["inputs"].as_array().unwrap().is_empty())
            })
            .unwrap()
    };
    type Edit = fn(&mut serde_json::Value, usize);
    let edits: [(&str, Edit, &str); 7] = [
        (
            "a launch's kind",
            |m, _| {
                m["entries"][0]["launch"]["launches"][0]["kind"] =
                    serde_json::json!({"Prim": "nope"})
            },
            "the launch plan is not the one its kernel graph gives",
        ),
        (
            "the product groups",
            |m, _| m["entries"][0]["launch"]["groups"] = serde_json::json!([]),
            "the launch plan is not the one its kernel graph gives",
        ),
        (
            "a kernel operand",
            |m, k| {
                m["entries"][0]["kernel_graph"]["values"][k]["def"]["Kernel"]["inputs"][0] =
                    999_999.into()
            },
            "the kernel graph is corrupt: malformed graph: value %",
        ),
        (
            "a launch position",
            |m, k| {
                m["entries"][0]["kernel_graph"]["values"][k]["def"]["Kernel"]["index"] =
                    999_999.into()
            },
            "the kernel graph is corrupt: malformed graph: kernel %",
        ),
        (
            "an output",
            |m, _| m["entries"][0]["kernel_graph"]["outputs"][0][1] = 999_999.into(),
            "the kernel graph is corrupt: malformed graph: output `",
        ),
        (
            "a parameter list entry",
            |m, _| m["entries"][0]["graph"]["params"][0] = 999_999.into(),
            "the graph is corrupt: malformed graph: parameter list entry 0 is %999999, which \
             points nowhere",
        ),
        (
            "an input list entry naming a parameter",
            |m, _| {
                let p = m["entries"][0]["graph"]["params"][0].clone();
                m["entries"][0]["graph"]["inputs"][0] = p;
            },
            "the graph is corrupt: malformed graph: input list entry 0 is %",
        ),
    ];
    for (what, edit, want) in edits {
        let mut m = original.clone();
        let k = first_kernel(&mut m);
        edit(&mut m, k);
        rehash(&mut m);
        std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        let msg = Artifact::load(&dir).unwrap_err().to_string();
        assert!(msg.contains(want), "{what}: {msg}");
        let out = kiln(&["inspect", dir.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1), "{what}");
        assert!(!stderr(&out).contains("panicked"), "{what}");
    }
}

/// Paths that are not artifacts, or artifacts where a model is wanted, are named as
/// what they are.
#[test]
fn things_that_are_not_artifacts_say_what_they_are() {
    let root = tmp("not_artifacts");
    std::fs::create_dir_all(&root).unwrap();
    let file = root.join("base.yaml");
    std::fs::write(&file, "model: {}\n").unwrap();
    let msg = Artifact::load(&file).unwrap_err().to_string();
    assert!(
        msg.contains("base.yaml` is a file, not an artifact"),
        "{msg}"
    );
    // A manifest (hashed again) that lists no entry points.
    let dir = root.join("art");
    compile(&dir, "forward");
    let mpath = dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    m["entries"] = serde_json::json!([]);
    rehash(&mut m);
    std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let msg = Artifact::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("(it lists no entry points)"), "{msg}");
    // An artifact given where a model is wanted.
    let art = root.join("art2");
    compile(&art, "forward");
    let out = kiln(&[
        "compile",
        "--from-model",
        art.to_str().unwrap(),
        "-o",
        root.join("out").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = flat(&stderr(&out));
    assert!(
        err.contains("art2` is a compiled artifact, not a model")
            && err.contains("runs it; `--from-model` takes a checkpoint"),
        "{err}"
    );
    assert!(!root.join("out").exists());
    // `kiln run` on a directory without a manifest: not "give a `.kiln` file".
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = kiln(&[
        "run",
        empty.to_str().unwrap(),
        "--entry",
        "forward",
        "--inputs",
        "in.safetensors",
        "-o",
        "out.safetensors",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = flat(&stderr(&out));
    assert!(
        err.contains("empty` is not a kiln artifact: it has no `manifest.json`"),
        "{err}"
    );
}

#[test]
fn a_newer_artifact_version_says_to_recompile() {
    let dir = tmp("version").join("art");
    compile(&dir, "forward");
    let mpath = dir.join("manifest.json");
    let text = std::fs::read_to_string(&mpath).unwrap();
    assert!(text.contains("\"version\": 4,"));
    std::fs::write(
        &mpath,
        text.replacen("\"version\": 4,", "\"version\": 5,", 1),
    )
    .unwrap();
    let err = Artifact::load(&dir).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ArtifactError::Version { found: 5, .. }),
        "{err:?}"
    );
    assert!(
        msg.contains("version 5")
            && msg.contains("reads version 4")
            && msg.contains("kiln compile"),
        "{msg}"
    );
    let out = kiln(&["inspect", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("version 5"), "{}", stderr(&out));
}

#[test]
fn cli_errors() {
    // No artifact there.
    let base = tmp("cli_errors");
    let missing = base.join("nope");
    let out = kiln(&["inspect", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no artifact at"), "{}", stderr(&out));
    // A directory without a manifest.
    let empty = base.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = kiln(&["inspect", empty.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("manifest.json"), "{}", stderr(&out));
    // A CUDA architecture that is not one.
    let out = kiln(&[
        "compile",
        SPEC,
        "--entries",
        "forward",
        "--target",
        "cuda",
        "--cuda-arch",
        "hopper",
        "-o",
        base.join("cuda").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("`hopper` is not a CUDA architecture")
            && stderr(&out).contains("sm_90"),
        "{}",
        stderr(&out)
    );
    assert!(!base.join("cuda").exists());
    // An unknown entry.
    let out = kiln(&[
        "compile",
        SPEC,
        "--entries",
        "forward,bogus",
        "-o",
        base.join("x").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    // A directory that is not an artifact is never replaced.
    let mine = base.join("mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), "keep me").unwrap();
    let out = kiln(&[
        "compile",
        SPEC,
        "--set",
        "vocab=48",
        "--entries",
        "forward",
        "-o",
        mine.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is not a kiln artifact"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        std::fs::read_to_string(mine.join("notes.txt")).unwrap(),
        "keep me"
    );
    // Without `--entries`, `kiln compile` still prints the kernel graph.
    let out = kiln_ok(&["compile", SPEC, "--set", "vocab=48", "--entry", "encode"]);
    assert!(!out.stdout.is_empty());
}

/// `kiln run ARTIFACT_DIR`: the artifact's kernels on a safetensors file of inputs, with
/// its own weights, equal (within the tolerance) to `kiln run SPEC` with the reference
/// executor and those weights; `--executor eager` runs the artifact's graph.
#[test]
fn kiln_run_takes_an_artifact() {
    let dir = tmp("run");
    let art = dir.join("art");
    compile(&art, "forward,loss");
    let inputs = dir.join("inputs.safetensors");
    kiln_compiler::tensor::save_safetensors(
        &inputs,
        &[
            (
                "src".to_string(),
                Tensor::i32(vec![2, 5], vec![5, 6, 7, 0, 9, 8, 9, 10, 11, 3]).unwrap(),
            ),
            (
                "tgt_in".to_string(),
                Tensor::i32(vec![2, 3], vec![1, 7, 6, 1, 11, 10]).unwrap(),
            ),
            (
                "tgt_out".to_string(),
                Tensor::i32(vec![2, 3], vec![7, 6, 2, 11, 10, 2]).unwrap(),
            ),
        ],
        None,
    )
    .unwrap();
    let weights = art.join("weights.safetensors");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    for entry in ["forward", "loss"] {
        let run = |target: &str, extra: &[&str], out: &Path| {
            let mut args = vec![
                "run".to_string(),
                target.to_string(),
                "--entry".into(),
                entry.into(),
            ];
            args.extend(["--inputs".to_string(), s(&inputs), "-o".to_string(), s(out)]);
            args.extend(extra.iter().map(|x| x.to_string()));
            let refs: Vec<&str> = args.iter().map(|a| a.as_str()).collect();
            let o = kiln(&refs);
            assert!(o.status.success(), "kiln {args:?}:\n{}", stderr(&o));
            kiln_compiler::tensor::load_safetensors(out).unwrap()
        };
        let got = run(&s(&art), &[], &dir.join(format!("{entry}_art.safetensors")));
        let eager = run(
            &s(&art),
            &["--executor", "eager"],
            &dir.join(format!("{entry}_eager.safetensors")),
        );
        let want = run(
            SPEC,
            &["--set", "vocab=48", "--weights", &s(&weights)],
            &dir.join(format!("{entry}_ref.safetensors")),
        );
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>()
        );
        for (name, w) in &want {
            let w = w.as_f32().unwrap();
            let scale = w.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
            for other in [&got, &eager] {
                let g = other[name].as_f32().unwrap();
                let err = g
                    .iter()
                    .zip(w)
                    .fold(0.0f64, |m, (&a, &b)| m.max(f64::from(a - b).abs()));
                assert!(
                    err <= REL * scale + ABS,
                    "{entry}/{name}: error {err:e} (scale {scale:e})"
                );
            }
        }
    }
    // An entry the artifact does not have is named with the ones it has.
    let o = kiln(&[
        "run",
        &s(&art),
        "--entry",
        "encode",
        "--inputs",
        &s(&inputs),
        "-o",
        &s(&dir.join("x.safetensors")),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("no entry `encode`") && err.contains("`forward`, `loss`"),
        "{err}"
    );
}

/// The other sources of `kiln compile` and the artifact consumers name what is wrong.
#[test]
fn artifact_source_and_consumer_errors() {
    let base = tmp("source_errors");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let fails = |args: &[&str]| {
        let out = kiln(args);
        assert!(
            out.status.code().is_some_and(|c| c != 0),
            "{args:?} succeeded"
        );
        stderr(&out)
    };
    // Nothing to compile.
    let err = fails(&["compile", "-o", &s(&base.join("a"))]);
    assert!(err.contains("<SPEC>") || err.contains("required"), "{err}");
    // A missing configuration.
    let err = fails(&[
        "compile",
        "--config",
        &s(&base.join("nope.yaml")),
        "-o",
        &s(&base.join("a")),
    ]);
    assert!(err.contains("nope.yaml"), "{err}");
    // A directory that is not a trained model.
    let err = fails(&[
        "compile",
        "--from-model",
        &s(&base),
        "-o",
        &s(&base.join("a")),
    ]);
    assert!(err.contains("is not a kiln model"), "{err}");
    assert!(!base.join("a").exists());
    // An artifact compiled from a spec has no tokenizer: it cannot translate text.
    let art = base.join("art");
    compile(&art, "encode,decode_step");
    let input = base.join("in.txt");
    std::fs::write(&input, "a b c\n").unwrap();
    let err = fails(&["translate", "--model", &s(&art), "--input", &s(&input)]);
    assert!(
        err.contains("carries no tokenizer") && err.contains("--from-model"),
        "{err}"
    );
}

/// The manifest's spec hash covers the files the spec imports (an edited import is a
/// different model), not the path the spec was named by.
#[test]
fn the_spec_hash_covers_imports() {
    let dir = tmp("spec_hash");
    for f in ["transformer_tiny.kiln", "transformer_base.kiln"] {
        std::fs::copy(common::root().join("models").join(f), dir.join(f)).unwrap();
    }
    let hash_of = |spec: &Path, out: &str| -> String {
        let o = kiln(&[
            "compile",
            spec.to_str().unwrap(),
            "--set",
            "vocab=48",
            "--entries",
            "encode",
            "-o",
            dir.join(out).to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(out).join("manifest.json")).unwrap())
                .unwrap();
        m["spec_hash"].as_str().unwrap().to_string()
    };
    let a = hash_of(&dir.join("transformer_tiny.kiln"), "a");
    // The shipped copy, named by a relative path: same files, same hash.
    assert_eq!(a, hash_of(Path::new(SPEC), "b"));
    let base = dir.join("transformer_base.kiln");
    let text = std::fs::read_to_string(&base).unwrap();
    std::fs::write(&base, format!("{text}\n# edited\n")).unwrap();
    assert_ne!(a, hash_of(&dir.join("transformer_tiny.kiln"), "c"));
}

/// `kiln compile --target cuda`: each entry's CUDA C beside its CLIF, byte for byte the
/// emitter's text for the manifest's kernel graph, launch metadata in the manifest,
/// summarized by `kiln inspect`; `kiln run` runs its CPU code; a corrupted `.cu` file or
/// a manifest whose function list disagrees with the text is named.
/// `kiln inspect DIR --nvrtc` compiles a CUDA artifact's C with NVRTC where libnvrtc
/// loads (no GPU needed) and reports every entry's assembly; where it does not, or for
/// a CPU artifact, it is an error that says why and what to do.
#[test]
fn inspect_nvrtc_assembles_a_cuda_artifact_or_says_why_not() {
    let dir = tmp("inspect_nvrtc");
    let (cuda, cpu, mixed) = (dir.join("cuda"), dir.join("cpu"), dir.join("mixed"));
    for (art, target, precision) in [
        (&cuda, "cuda", "f32"),
        (&cpu, "cpu", "f32"),
        (&mixed, "cuda", "mixed"),
    ] {
        compile_for(art, target, precision, &[]);
    }
    let out = kiln(&["inspect", cpu.to_str().unwrap(), "--nvrtc"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("is a `cpu` artifact: it has no CUDA C"),
        "{}",
        stderr(&out)
    );
    let out = kiln(&["inspect", cuda.to_str().unwrap(), "--nvrtc"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    match kiln_exec::cuda::nvrtc_available() {
        Ok(version) => {
            assert!(out.status.success(), "{}", stderr(&out));
            let lines: Vec<&str> = text.lines().filter(|l| l.contains("  nvrtc ")).collect();
            assert_eq!(lines.len(), 2, "{text}");
            for l in lines {
                assert!(l.starts_with(&format!("  nvrtc {version}: ")), "{l}");
                assert!(
                    l.contains("assembled for sm_90") && l.ends_with("no spills"),
                    "{l}"
                );
            }
            // Each entry's occupancy: how many functions fill an SM, then each kind with
            // a function that does not (the flash attention kernels' shared tiles and
            // registers keep them below).
            let occ: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("  occupancy (an sm_90 SM"))
                .collect();
            assert_eq!(occ.len(), 2, "{text}");
            assert!(
                occ[0].contains("blocks of 256): ")
                    && occ[0].contains(" functions fill its 2,048 threads"),
                "{text}"
            );
            assert!(
                text.lines()
                    .any(|l| l.starts_with("    attention_bwd_short (")
                        && l.contains(" blocks an SM (")
                        && l.contains("limited by registers")),
                "{text}"
            );
            // A mixed-precision artifact: its programs, with their 2-byte strided copy.
            let out = kiln(&["inspect", mixed.to_str().unwrap(), "--nvrtc"]);
            assert!(out.status.success(), "{}", stderr(&out));
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let lines: Vec<&str> = text.lines().filter(|l| l.contains("  nvrtc ")).collect();
            assert_eq!(lines.len(), 2, "{text}");
            for l in lines {
                assert!(
                    l.contains(" functions (mixed precision) assembled for sm_90")
                        && l.ends_with("no spills"),
                    "{l}"
                );
            }
            assert!(
                text.lines().any(|l| l.starts_with("    copy_strided16 (")),
                "{text}"
            );
        }
        Err(reason) => {
            println!("NVRTC is not here ({reason}): only the error is checked");
            assert_eq!(out.status.code(), Some(1));
            let err = stderr(&out);
            assert!(
                err.contains("NVRTC is not available") && err.contains("pip install"),
                "{err}"
            );
        }
    }
}

/// `kiln compile --target cuda --precision mixed` writes the program that runs: the
/// manifest records the options, each entry's `.cu` is the mixed-precision program (the
/// driver's bf16 text for the manifest's kernel graph, its buffers' element types in the
/// manifest), and a second compilation gives the same bytes. `--no-buffer-reuse` is
/// recorded too (every buffer in a slot of its own), and options that contradict each
/// other are refused, naming the fix.
#[test]
fn a_mixed_precision_artifact_carries_the_program_that_runs() {
    use kiln_compiler::options::Precision;
    let dir = tmp("mixed");
    let compile_mixed = |out: &Path, extra: &[&str]| compile_for(out, "cuda", "mixed", extra);
    let (art, again) = (dir.join("art"), dir.join("again"));
    compile_mixed(&art, &[]);
    compile_mixed(&again, &[]);
    assert_eq!(files(&art), files(&again));
    let loaded = Artifact::load(&art).unwrap();
    assert_eq!(loaded.manifest.options.precision, Precision::Mixed);
    for name in ["train_step", "decode_step"] {
        let e = loaded.entry(name).unwrap();
        let c = e.manifest.cuda.as_ref().unwrap();
        let code =
            kiln_compiler::pipeline::cuda_program(&e.manifest.kernel_graph, Precision::Mixed)
                .unwrap();
        assert_eq!(
            e.cuda_source.as_deref(),
            Some(code.source().as_str()),
            "{name}"
        );
        assert!(code.source().contains("kiln_bf16"), "{name}");
        assert_eq!(c.storage, code.storage, "{name}");
        assert!(!c.storage.is_empty(), "{name}");
    }
    let out = kiln_ok(&["inspect", art.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("    precision: mixed\n"));
    // Without buffer reuse: recorded, and no two buffers share a slot.
    let apart = dir.join("apart");
    compile_mixed(&apart, &["--no-buffer-reuse"]);
    let loaded = Artifact::load(&apart).unwrap();
    assert!(!loaded.manifest.options.buffer_reuse);
    let plan = &loaded.entry("train_step").unwrap().manifest.plan;
    assert!(!plan.reuse);
    assert_eq!(plan.slots, plan.buffers.len());
    // Contradictions.
    for (args, want) in [
        (
            &["--target", "cpu", "--precision", "mixed"][..],
            "--precision mixed is the CUDA program's, but the target is cpu",
        ),
        (
            &["--target", "cuda", "--cuda-arch", "90"][..],
            "`90` is not a CUDA architecture",
        ),
    ] {
        let mut all = vec!["compile", SPEC, "--entries", "forward"];
        all.extend_from_slice(args);
        let x = dir.join("x");
        all.extend(["-o", x.to_str().unwrap()]);
        let out = kiln(&all);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(stderr(&out).contains(want), "{args:?}: {}", stderr(&out));
        assert!(!x.exists());
    }
}

#[test]
fn a_cuda_artifact_carries_cuda_c_for_its_kernel_graph() {
    let dir = tmp("cuda");
    let art = dir.join("art");
    kiln_ok(&[
        "compile",
        SPEC,
        "--set",
        "vocab=48",
        "--entries",
        "train_step,encode,decode_step",
        "--target",
        "cuda",
        "--cuda-arch",
        "sm_80",
        "-o",
        art.to_str().unwrap(),
    ]);
    let loaded = Artifact::load(&art).unwrap();
    assert_eq!(loaded.manifest.target().name(), "cuda");
    for name in ["train_step", "encode", "decode_step"] {
        let e = loaded.entry(name).unwrap();
        let c = e.manifest.cuda.as_ref().expect("a cuda section");
        assert_eq!(c.source, format!("kernels/{name}.cu"));
        assert_eq!(c.arch, "sm_80");
        assert!(c
            .nvrtc_options
            .contains(&"--gpu-architecture=sm_80".to_string()));
        let text = std::fs::read_to_string(art.join(&c.source)).unwrap();
        assert_eq!(e.cuda_source.as_deref(), Some(text.as_str()));
        let code = kiln_compiler::codegen::cuda::emit(&e.manifest.kernel_graph).unwrap();
        assert_eq!(text, code.source(), "{name}: the emitter's text");
        assert_eq!(c.kernels, code.kernels);
        assert_eq!(c.kernels.len(), e.manifest.kernel_graph.kernels().len());
        assert!(!c.functions.is_empty());
    }
    // The same spec gives the same bytes.
    let again = dir.join("again");
    kiln_ok(&[
        "compile",
        SPEC,
        "--set",
        "vocab=48",
        "--entries",
        "train_step,encode,decode_step",
        "--target",
        "cuda",
        "--cuda-arch",
        "sm_80",
        "-o",
        again.to_str().unwrap(),
    ]);
    assert_eq!(files(&art), files(&again));
    // `kiln inspect` prints every option it was compiled with, and summarizes the CUDA
    // side.
    let out = kiln_ok(&["inspect", art.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "  options:\n    target: cuda\n    cuda_arch: sm_80\n    precision: f32\n    \
             buffer_reuse: true\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("bytes of CUDA C in kernels/train_step.cu) for sm_80")
            && text.contains("cuBLAS GEMMs"),
        "{text}"
    );
    // `kiln run` runs the artifact's CPU code, and says so.
    let inputs = dir.join("inputs.safetensors");
    kiln_compiler::tensor::save_safetensors(
        &inputs,
        &[(
            "src".to_string(),
            Tensor::i32(vec![1, 4], vec![5, 6, 7, 8]).unwrap(),
        )],
        None,
    )
    .unwrap();
    let enc = dir.join("enc.safetensors");
    let out = kiln_ok(&[
        "run",
        art.to_str().unwrap(),
        "--entry",
        "encode",
        "--inputs",
        inputs.to_str().unwrap(),
        "-o",
        enc.to_str().unwrap(),
    ]);
    assert!(
        stderr(&out).contains("a `cuda` artifact, run with its CPU code"),
        "{}",
        stderr(&out)
    );
    let memory = &kiln_compiler::tensor::load_safetensors(&enc).unwrap()["memory"];
    assert_eq!(memory.shape, vec![1, 4, 32]);
    // A changed byte in the CUDA C is named.
    let cu = art.join("kernels/encode.cu");
    let mut bytes = std::fs::read(&cu).unwrap();
    let i = bytes.len() / 2;
    bytes[i] = if bytes[i] == b'x' { b'y' } else { b'x' };
    std::fs::write(&cu, &bytes).unwrap();
    let err = Artifact::load(&art).unwrap_err().to_string();
    assert!(
        err.contains("encode.cu") && err.contains("corrupt"),
        "{err}"
    );
    // A manifest that lists other functions than the text defines is refused by its own
    // hash; with the hash updated, as a hand edit would need, by the function check.
    let good = again;
    let mpath = good.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    let funcs = m["entries"][1]["cuda"]["functions"].as_array_mut().unwrap();
    let removed = funcs.pop().unwrap();
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    let err = Artifact::load(&good).unwrap_err().to_string();
    assert!(
        err.contains("manifest.json") && err.contains("modified or damaged"),
        "{err}"
    );
    let mut edited: kiln_compiler::artifact::Manifest = serde_json::from_value(m).unwrap();
    edited.manifest_hash = edited.digest().unwrap();
    std::fs::write(&mpath, serde_json::to_vec(&edited).unwrap()).unwrap();
    let err = Artifact::load(&good).unwrap_err().to_string();
    assert!(
        err.contains("encode.cu")
            && err.contains(removed["name"].as_str().unwrap())
            && err.contains("the manifest lists"),
        "{err}"
    );
}

/// Mixed precision runs attention only as flash kernels: a model whose heads are too wide
/// for them (base with 2 heads of 256) is refused by `kiln compile --precision mixed`,
/// with the precisions that take it, and nothing is written; `bf16` compiles it.
#[test]
fn mixed_precision_without_flash_attention_is_a_compile_error() {
    let dir = tmp("mixed_wide_heads");
    let art = dir.join("art");
    let args = |precision: &'static str| {
        vec![
            "compile".to_string(),
            "models/transformer_base.kiln".to_string(),
            "--set".to_string(),
            "vocab=48".to_string(),
            "--set".to_string(),
            "n=1".to_string(),
            "--set".to_string(),
            "d_ff=64".to_string(),
            "--set".to_string(),
            "h=2".to_string(),
            "--entries".to_string(),
            "encode".to_string(),
            "--target".to_string(),
            "cuda".to_string(),
            "--precision".to_string(),
            precision.to_string(),
            "-o".to_string(),
            art.to_str().unwrap().to_string(),
        ]
    };
    let mixed = args("mixed");
    let out = kiln(&mixed.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(1));
    let err = flat(&stderr(&out));
    assert!(
        err.contains("(attention) has no flash kernels")
            && err.contains("compile this model with --precision f32, tf32 or bf16"),
        "{err}"
    );
    assert!(!art.exists(), "nothing is written");
    let bf16 = args("bf16");
    kiln_ok(&bf16.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(art.join("manifest.json").is_file());
}
