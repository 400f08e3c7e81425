//! Snapshots of the generated CLIF: one function of every kernel kind, from the tiny
//! Transformer's training step, forward pass and optimizer step. The text is
//! deterministic (emitted twice here, byte for byte).

use std::collections::BTreeMap;

use kiln_compiler::codegen::program::emit;
use kiln_compiler::optimize::optimize;

mod common;
use common::root;

fn code_of(entry: &str) -> kiln_compiler::codegen::program::CpuCode {
    let spec = root().join("models/transformer_tiny.kiln");
    let elaborate = common::elaborator(&spec, &["vocab=48"]);
    let g = kiln_exec::compiled_entry_graph_with(entry, elaborate, |e| e.message).expect("entry");
    let (kg, _) = optimize(&g, &Default::default()).expect("optimizes");
    emit(&kg).expect("emits")
}

#[test]
fn clif_of_every_kernel_kind_is_pinned() {
    let mut first: BTreeMap<String, String> = BTreeMap::new();
    for entry in [
        "train_step",
        "forward",
        "loss",
        "adam_update",
        "decode_step",
    ] {
        let code = code_of(entry);
        assert_eq!(code, code_of(entry), "{entry}: the code is deterministic");
        for (name, text) in &code.functions {
            let kind = name
                .rsplit_once('_')
                .map(|(k, _)| k)
                .unwrap_or(name)
                .to_string();
            // A region that drops out, pinned apart: it draws its masks with the one call
            // a kernel makes (`kiln_dropout_masks`, per chunk of a row).
            let kind = if kind == "region" && text.contains("%kiln_dropout_masks") {
                "region_dropout".to_string()
            } else {
                kind
            };
            first.entry(kind).or_insert_with(|| text.clone());
        }
    }
    let kinds: Vec<&str> = first.keys().map(|s| s.as_str()).collect();
    for want in [
        "adam_update",
        "add_layer_norm",
        "add_layer_norm_bwd",
        "add_layer_norm_bwd_finish",
        "copy_strided",
        "embed_pe",
        "fill_rows",
        "region",
        "region_dropout",
        "relu",
        "scale_mask_softmax",
        "softmax_bwd",
        "sum_rows",
        "xent_ls",
        "xent_ls_loss",
    ] {
        assert!(kinds.contains(&want), "no `{want}` kernel among {kinds:?}");
    }
    for (kind, text) in &first {
        // The one call a kernel makes: its dropout masks, per chunk of a row.
        let calls: Vec<&str> = text.lines().filter(|l| l.contains("call ")).collect();
        if text.contains("fn0 = %kiln_dropout_masks sig0") {
            assert!(
                !calls.is_empty() && calls.iter().all(|l| l.contains("call fn0(")),
                "{kind}: calls the masks only: {calls:?}"
            );
        } else {
            assert!(
                calls.is_empty(),
                "{kind}: no calls in generated kernels: {calls:?}"
            );
        }
        if kind == "region_dropout" {
            assert!(!calls.is_empty(), "{kind}: draws its masks");
        }
        insta::assert_snapshot!(format!("clif_{kind}"), text);
    }
}

#[test]
fn the_public_snapshot_helper_is_deterministic() {
    let spec = root().join("models/transformer_tiny.kiln");
    let a = kiln::snapshot::kernels(&spec, &["vocab=48"], "forward").expect("helper");
    let b = kiln::snapshot::kernels(&spec, &["vocab=48"], "forward").expect("helper");
    assert_eq!(a, b);
    assert!(
        a.starts_with("# kernels of transformer_tiny entry=forward\n"),
        "{}",
        &a[..80]
    );
    assert!(
        a.contains(" attention softmax=scale_mask_softmax_0"),
        "{a:.2000}"
    );
    assert!(a.contains("function %embed_pe_0(i64, i64, i64, i64) system_v {"));
    // The launch plan's fusions, as they run: the tiny model's query, key and value
    // projections read one input.
    assert!(a.contains("\nfusions: "), "{a:.4000}");
    assert!(a.contains("\n  group of 3 linear reading %"), "{a:.4000}");
    let err = kiln::snapshot::kernels(root().join("models/nope.kiln"), &[], "forward").unwrap_err();
    assert!(err.contains("nope.kiln"), "{err}");
}

/// `kiln snapshot`: `-o` writes the kernels as files, `--check` passes on the same spec and
/// fails after a one-character change to it with a unified diff, `-o` will not write over
/// a snapshot, and `--bless` rewrites it so that the check passes again.
#[test]
fn the_snapshot_command_writes_checks_and_blesses() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("snapshot_cli");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["transformer_tiny.kiln", "transformer_base.kiln"] {
        std::fs::copy(root().join("models").join(f), dir.join(f)).unwrap();
    }
    let spec = dir.join("transformer_tiny.kiln");
    let snap = dir.join("snap");
    let (spec_s, snap_s) = (spec.to_str().unwrap(), snap.to_str().unwrap());
    let run = |args: &[&str]| {
        let base = [
            "snapshot",
            spec_s,
            "--set",
            "vocab=48",
            "--entries",
            "forward",
        ];
        let out = common::kiln(&[&base[..], args].concat());
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let (code, _, err) = run(&["-o", snap_s]);
    assert_eq!(code, Some(0), "{err}");
    let read = |f: &str| std::fs::read_to_string(snap.join(f)).unwrap();
    let launch = read("forward.launch.txt");
    assert!(launch.starts_with("# kernels of transformer_tiny entry=forward\n%"));
    assert!(
        launch.contains(" attention softmax=scale_mask_softmax_0"),
        "{launch}"
    );
    assert!(read("forward.clif").contains("function %embed_pe_0(i64, i64, i64, i64) system_v {"));
    assert!(read("forward.graph.txt").contains("attention"));
    assert!(
        !snap.join("forward.cu").exists(),
        "no CUDA C for --target cpu"
    );
    let header = read("snapshot.txt");
    assert!(
        header.starts_with("kiln snapshot of transformer_tiny.kiln\nset vocab=48\nentries forward\noption target cpu\n"),
        "{header}"
    );

    let (code, out, err) = run(&["--check", snap_s]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("matches (4 files)"), "{out}");

    let text = std::fs::read_to_string(&spec).unwrap();
    assert!(text.contains("d_ff = 64"));
    std::fs::write(&spec, text.replacen("d_ff = 64", "d_ff = 68", 1)).unwrap();
    let (code, out, err) = run(&["--check", snap_s]);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        out.contains("forward.graph.txt (snapshot)") && out.contains("\n@@ -"),
        "{out}"
    );
    assert!(
        out.lines().any(|l| l.starts_with('-') && l.contains("64"))
            && out.lines().any(|l| l.starts_with('+') && l.contains("68")),
        "{out}"
    );
    assert!(
        err.contains("differ from the snapshot") && err.contains("--bless"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");

    let (code, _, err) = run(&["-o", snap_s]);
    assert_eq!(code, Some(1));
    assert!(err.contains("already holds a snapshot"), "{err}");
    let (code, _, err) = run(&["--bless", snap_s]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = run(&["--check", snap_s]);
    assert_eq!(code, Some(0), "{out}\n{err}");
}
