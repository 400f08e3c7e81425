//! The examples in the documentation compile: the README's language example and every
//! `kiln` block of docs/LANGUAGE.md that is a complete spec.

mod common;

use std::path::{Path, PathBuf};

use kiln_dsl::Options;

/// Fenced code blocks as (info string, body).
fn fenced(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(String, String)> = None;
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(info) = t.strip_prefix("```") {
            match cur.take() {
                None => cur = Some((info.trim().to_string(), String::new())),
                Some(b) => out.push(b),
            }
        } else if let Some((_, body)) = &mut cur {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

fn blocks(text: &str) -> Vec<String> {
    fenced(text)
        .into_iter()
        .filter(|(info, _)| info.is_empty())
        .map(|(_, b)| b)
        .collect()
}

#[test]
fn readme_language_example_compiles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let example = blocks(&readme)
        .into_iter()
        .find(|b| b.contains("layer encoder_layer"))
        .expect("the README has a language example");
    let g = kiln_dsl::compile_str("README.md", &example, &Options::default())
        .unwrap_or_else(|e| panic!("{}", e.render(false)));
    // The card's line, its d_model (512) taken from the layer's input.
    assert!(example.contains("attention(h=8,d_k=64)"), "{example}");
    let w_q = g.param("layers.0.self_attn.w_q").expect("w_q");
    assert_eq!(g.ty(w_q).to_string(), "f32[512, 512]");
    let w1 = g
        .param("layers.5.ffn.linear1.w")
        .expect("the sixth layer's ffn");
    assert_eq!(g.ty(w1).to_string(), "f32[512, 2048]");
    assert_eq!(
        g.ty(g.output("hidden").unwrap()).to_string(),
        "f32[batch, len, 512]"
    );
}

#[test]
fn readme_opens_with_the_two_commands_and_ci_runs_the_test_command() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let first = blocks_any(&readme);
    assert!(first.starts_with("cargo run --release -- demo"), "{first}");
    let test_cmd = first
        .lines()
        .nth(1)
        .unwrap()
        .split('#')
        .next()
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(test_cmd, "cargo test --workspace");
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    assert!(
        ci.lines().any(|l| l.trim() == test_cmd),
        ".ci/run must run `{test_cmd}`"
    );
}

/// The first fenced block of any language.
fn blocks_any(text: &str) -> String {
    fenced(text).remove(0).1
}

/// Every block of docs/LANGUAGE.md that is a whole spec (it defines a model with a body
/// and elides nothing with `...`) compiles, in eval, train and decode mode.
#[test]
fn language_reference_examples_compile() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("docs/LANGUAGE.md")).unwrap();
    let whole: Vec<String> = blocks(&text)
        .into_iter()
        .filter(|b| {
            b.lines().any(|l| {
                // `model name(params) {`, not a derived `model name = base(...) {`.
                let head = l.split('(').next().unwrap_or("");
                l.starts_with("model ") && !head.contains('=') && l.trim_end().ends_with('{')
            }) && !b.contains("...")
        })
        .collect();
    assert!(!whole.is_empty(), "LANGUAGE.md has a complete example");
    for b in &whole {
        for mode in [
            kiln_dsl::Mode::Eval,
            kiln_dsl::Mode::Train,
            kiln_dsl::Mode::Decode,
        ] {
            let opts = Options {
                mode,
                ..Options::default()
            };
            kiln_dsl::compile_str("LANGUAGE.md", b, &opts)
                .unwrap_or_else(|e| panic!("{mode:?}: {}\n{b}", e.render(false)));
        }
    }
}

/// The language reference's `lm` example (#59, item 13) has what the text under it
/// says: in decode mode, the caches as inputs and outputs of the shapes it names; a
/// `decode_step` but no `encode`; and an artifact of the entries it has.
#[test]
fn the_lm_example_has_a_decode_step_and_no_encode() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("docs/LANGUAGE.md")).unwrap();
    let lm = blocks(&text)
        .into_iter()
        .find(|b| b.contains("model lm("))
        .expect("LANGUAGE.md has the lm example");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("docs_lm");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("lm.kiln");
    std::fs::write(&spec, &lm).unwrap();
    let spec = spec.to_str().unwrap();
    let run = |args: &[&str]| {
        let out = common::kiln(args);
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code(), common::flat(&text))
    };
    let (code, check) = run(&["check", spec, "--mode", "decode"]);
    assert_eq!(code, Some(0), "{check}");
    for want in [
        "cache.attn.k f32[batch, past, 32]",
        "cache.attn.v f32[batch, past, 32]",
        "cache.attn.k f32[batch, len + past, 32]",
    ] {
        assert!(check.contains(want), "{want:?} in {check}");
    }
    let (code, step) = run(&["explain", spec, "--entry", "decode_step"]);
    assert_eq!(code, Some(0), "{step}");
    let (code, encode) = run(&["explain", spec, "--entry", "encode"]);
    assert_eq!(code, Some(1), "{encode}");
    assert!(encode.contains("model `lm` declares no `stage`, so it has no `encode` entry"));
    let art = dir.join("art");
    let (code, compiled) = run(&["compile", spec, "-o", art.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{compiled}");
    let manifest = std::fs::read_to_string(art.join("manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    let entries: Vec<&str> = manifest["entries"]
        .as_array()
        .map(|a| a.iter().filter_map(|e| e["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(entries, ["forward", "decode_step"], "{manifest}");
}
