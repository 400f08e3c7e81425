//! The IR graph of the specs in `models/`: its text form is pinned by snapshots, it is
//! the same on every run, and its parameters have the stable names later tools rely on.

use std::path::{Path, PathBuf};

use kiln_compiler::ir::Op;
use kiln_compiler::printer::print_graph;
use kiln_compiler::Graph;
use kiln_dsl::{Mode, Options};

fn spec(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn compile(rel: &str, sets: &[&str], mode: Mode) -> Graph {
    let opts = Options {
        overrides: sets.iter().map(|s| s.to_string()).collect(),
        mode,
        model: None,
    };
    kiln_dsl::compile_file(&spec(rel), &opts)
        .unwrap_or_else(|e| panic!("{rel}: {}", e.render(false)))
}

#[test]
fn tiny_graph_text_is_pinned() {
    let g = compile("models/transformer_tiny.kiln", &["n=1"], Mode::Eval);
    g.verify().unwrap();
    insta::assert_snapshot!("graph_transformer_tiny_n1", print_graph(&g));
}

#[test]
fn tiny_training_graph_text_is_pinned() {
    let g = compile("models/transformer_tiny.kiln", &["n=1"], Mode::Train);
    g.verify().unwrap();
    insta::assert_snapshot!("graph_transformer_tiny_n1_train", print_graph(&g));
}

#[test]
fn the_same_spec_gives_the_same_graph_text() {
    for rel in [
        "models/transformer_base.kiln",
        "models/transformer_big.kiln",
        "models/table3/e_learned.kiln",
    ] {
        let a = print_graph(&compile(rel, &[], Mode::Train));
        let b = print_graph(&compile(rel, &[], Mode::Train));
        assert_eq!(a, b, "{rel} printed differently twice");
        assert!(a.len() > 10_000);
    }
}

#[test]
fn base_parameter_names_and_shapes_are_pinned() {
    let g = compile("models/transformer_base.kiln", &["vocab=37000"], Mode::Eval);
    let mut listing = String::new();
    for &p in &g.params {
        if let Op::Param { name, init } = &g.node(p).op {
            listing.push_str(&format!("{name} {} {init}\n", g.ty(p)));
        }
    }
    assert!(listing.contains("encoder.layers.0.self_attn.w_q f32[512, 512] xavier_uniform\n"));
    assert!(listing.contains("decoder.layers.5.cross_attn.w_o f32[512, 512] xavier_uniform\n"));
    assert!(listing.contains("emb.weight f32[37000, 512] normal(std=0.04419417382415922)\n"));
    insta::assert_snapshot!("params_transformer_base", listing);
}

#[test]
fn dropout_is_in_training_graphs_only() {
    let count = |g: &Graph| {
        g.nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Dropout { .. }))
            .count()
    };
    let eval = compile("models/transformer_base.kiln", &[], Mode::Eval);
    let train = compile("models/transformer_base.kiln", &[], Mode::Train);
    let decode = compile("models/transformer_base.kiln", &[], Mode::Decode);
    assert_eq!(count(&eval), 0);
    assert_eq!(count(&decode), 0);
    // Residual dropout on 2 sublayers per encoder layer and 3 per decoder layer, plus
    // the two embedding sums: 6*2 + 6*3 + 2.
    assert_eq!(count(&train), 32);
    let ps: Vec<f64> = train
        .nodes
        .iter()
        .filter_map(|n| match n.op {
            Op::Dropout { p, .. } => Some(p.get()),
            _ => None,
        })
        .collect();
    assert!(ps.iter().all(|&p| p == 0.1));
    let big = compile("models/transformer_big.kiln", &[], Mode::Train);
    assert!(big
        .nodes
        .iter()
        .all(|n| !matches!(n.op, Op::Dropout { p, .. } if p.get() != 0.3)));
    // Streams are distinct, so masks are independent.
    let mut streams: Vec<u32> = train
        .nodes
        .iter()
        .filter_map(|n| match n.op {
            Op::Dropout { stream, .. } => Some(stream),
            _ => None,
        })
        .collect();
    streams.sort();
    streams.dedup();
    assert_eq!(streams.len(), 32);
    // Without dropout (p = 0) the training graph has none either.
    let d0 = compile("models/table3/d_drop0.kiln", &[], Mode::Train);
    assert_eq!(count(&d0), 0);
}

#[test]
fn every_spec_in_models_compiles_and_verifies() {
    let mut n = 0;
    for dir in ["models", "models/table3", "models/gallery"] {
        for e in std::fs::read_dir(spec(dir)).unwrap() {
            let path = e.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("kiln") {
                continue;
            }
            let rel = path
                .strip_prefix(env!("CARGO_MANIFEST_DIR"))
                .unwrap()
                .to_string_lossy()
                .into_owned();
            for mode in [Mode::Eval, Mode::Train] {
                let g = compile(&rel, &[], mode);
                g.verify().unwrap_or_else(|e| panic!("{rel}: {e}"));
                assert_eq!(g.forward_outputs(), vec!["logits".to_string()], "{rel}");
                assert_eq!(g.objective.as_deref(), Some("loss"), "{rel}");
            }
            n += 1;
        }
    }
    assert_eq!(
        n, 26,
        "specs in models/, models/table3/ and models/gallery/"
    );
}

#[test]
fn table3_parameter_counts() {
    // Computed by hand from the paper's definitions with one shared 37000 x d_model
    // embedding; e.g. (C) N = 2: 37000*512 + 2*3,152,384 + 2*4,204,032.
    let cases = [
        ("models/table3/a_h1.kiln", 63_082_496),
        ("models/table3/a_h32.kiln", 63_082_496),
        ("models/table3/b_dk16.kiln", 55_990_784),
        ("models/table3/c_n2.kiln", 33_656_832),
        ("models/table3/c_d256.kiln", 26_834_944),
        ("models/table3/c_ff4096.kiln", 88_272_896),
        ("models/table3/e_learned.kiln", 63_082_496 + 2 * 1024 * 512),
        ("models/parsing.kiln", 155_459_584 - 21_000 * 1024),
    ];
    for (rel, want) in cases {
        let sets: &[&str] = if rel.contains("parsing") {
            &[]
        } else {
            &["vocab=37000"]
        };
        let g = compile(rel, sets, Mode::Eval);
        assert_eq!(g.num_parameters(), want, "{rel}");
    }
}

/// A learned positional table is found by its structure (a parameter gathered at an
/// `arange` along the dim): its rows bound the positions of sources and targets, in the
/// full graph and in the decoder's step (whose positions start at `past`). Sinusoidal
/// positions are computed and leave no such limit.
#[test]
fn position_tables_are_found_by_structure() {
    use kiln_compiler::ir::PositionTable;
    let base = "models/transformer_base.kiln";
    let sets = ["n=1", "vocab=50", "learned_pos=true", "max_len=40"];
    let table = |param: &str| {
        Some(PositionTable {
            param: param.to_string(),
            rows: 40,
        })
    };
    for mode in [Mode::Eval, Mode::Train] {
        let g = compile(base, &sets, mode);
        assert_eq!(
            g.position_table("src_len"),
            table("src_pos.table"),
            "{mode:?}"
        );
        assert_eq!(
            g.position_table("tgt_len"),
            table("tgt_pos.table"),
            "{mode:?}"
        );
        assert_eq!(g.position_table("batch"), None);
    }
    let step = compile(base, &sets, Mode::Decode);
    assert_eq!(step.position_table("tgt_len"), table("tgt_pos.table"));
    assert_eq!(
        kiln_decode::search::max_target_positions(&step),
        Some(40),
        "the table's rows"
    );
    let sinusoidal = compile(base, &["n=1", "vocab=50", "max_len=300"], Mode::Decode);
    assert_eq!(sinusoidal.position_table("tgt_len"), None);
    assert_eq!(
        kiln_decode::search::max_target_positions(&sinusoidal),
        Some(300),
        "the spec's max_len"
    );
    let tiny = compile("models/transformer_tiny.kiln", &[], Mode::Eval);
    assert_eq!(tiny.position_table("src_len"), None);
}

/// A spec of its own, whose table is not sized by a `max_len` parameter: the positions
/// check names the table and its rows, and asks for a larger table, not for `max_len`.
#[test]
fn a_position_table_without_max_len_is_named_by_its_rows() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("graph_positions");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("pos.kiln");
    std::fs::write(
        &file,
        "model positions(rows: int = 8, d: int = 4) {\n  dims batch, len\n  \
         input x: f32[batch, len, d]\n  pos = learned(max_len = rows, d = d)\n  \
         output y = pos(x)\n}\n",
    )
    .unwrap();
    let g = kiln_dsl::compile_file(&file, &Options::default())
        .unwrap_or_else(|e| panic!("{}", e.render(false)));
    let table = g.position_table("len").expect("the learned table");
    assert_eq!((table.param.as_str(), table.rows), ("pos.table", 8));
    let lens = [3usize, 8, 9];
    let err = kiln_decode::translate::check_positions(
        &g,
        "len",
        lens.len(),
        &|i| lens[i],
        &|i| format!("row {}", i + 1),
        "shorten it",
    )
    .unwrap_err();
    assert_eq!(
        err,
        "row 3 takes 9 positions, but the model's table `pos.table` covers only 8: shorten \
         it, or train a model whose `pos.table` has 9 rows or more"
    );
    assert_eq!(
        kiln_decode::translate::check_positions(&g, "len", 2, &|i| lens[i], &|_| String::new(), ""),
        Ok(())
    );
}
