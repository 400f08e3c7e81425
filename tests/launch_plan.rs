//! The launch plan is what runs: an artifact's executor launches exactly the kernels of
//! its manifest's plan, in order, with the plan's product groups and bias-gradient pairs
//! where its products run in 16 bits; `kiln explain` and `kiln inspect` show the fusions.

mod common;

use kiln_exec::executor::Exec;
use std::collections::BTreeMap;
use std::path::PathBuf;

use common::{entry_graph, kiln, root};
use kiln_compiler::launch_plan::{KernelKind, LaunchPlan};
use kiln_compiler::optimize::kind::TemplateKind;
use kiln_compiler::optimize::validate::random_feeds_with;
use kiln_compiler::options::CompileOptions;
use kiln_compiler::reference::RunOptions;
use kiln_exec::artifact::Artifact;
use kiln_exec::compiled::{Compiled, Kernel16};
use kiln_exec::executor::{How, Launched};

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("launch_plan")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// What a run whose every fusion takes effect launches, by the plan alone: a group's
/// members together, then the bias gradients they summed; a product, then the bias
/// gradient it summed; every other launch on its own, in plan order.
fn expected(plan: &LaunchPlan) -> Vec<Launched> {
    let is_sum = |i: usize| plan.launches[i].kind == KernelKind::Template(TemplateKind::SumRows);
    let summed_by = |q: usize| {
        plan.launches[q]
            .bias_grad
            .filter(|&p| !is_sum(q) && is_sum(p))
            .map(|p| Launched {
                launch: p,
                how: How::SummedBy { product: q },
            })
    };
    let mut out = Vec::new();
    let mut s = 0;
    while s < plan.launches.len() {
        if let Some(g) = plan.group_at(s) {
            let members = s..s + g.len;
            out.extend(members.clone().map(|launch| Launched {
                launch,
                how: How::InGroup { first: s },
            }));
            out.extend(members.filter_map(summed_by));
            s += g.len;
            continue;
        }
        if !(is_sum(s) && plan.launches[s].bias_grad.is_some()) {
            out.push(Launched {
                launch: s,
                how: How::Alone,
            });
            out.extend(summed_by(s));
        }
        s += 1;
    }
    out
}

fn alone(plan: &LaunchPlan) -> Vec<Launched> {
    (0..plan.launches.len())
        .map(|launch| Launched {
            launch,
            how: How::Alone,
        })
        .collect()
}

/// A compiled artifact's `train_step` launches its manifest's launch plan, kernel by
/// kernel, in order (f32 products: no fusion takes effect), and the plan records the
/// fusions the compiler decided: the tiny model's query, key and value projections as
/// groups, its bias gradients paired with their products.
#[test]
fn an_artifact_runs_exactly_its_manifests_launch_plan() {
    let dir = tmp("artifact").join("art");
    let out = kiln(&[
        "compile",
        root()
            .join("models/transformer_tiny.kiln")
            .to_str()
            .unwrap(),
        "--set",
        "vocab=48",
        "--entries",
        "forward,train_step",
        "-o",
        dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let art = Artifact::load(&dir).unwrap();
    for (i, name) in ["forward", "train_step"].into_iter().enumerate() {
        let plan: LaunchPlan =
            serde_json::from_value(manifest["entries"][i]["launch"].clone()).unwrap();
        assert_eq!(manifest["entries"][i]["name"], name);
        let mut exec = art.executor(name).unwrap();
        assert_eq!(exec.launch_plan(), &plan, "{name}: the executor's plan");
        exec.record_launches(true);
        let g = exec.graph().clone();
        let dims: BTreeMap<String, i64> = g.dims.iter().map(|d| (d.clone(), 3)).collect();
        let (inputs, params) = random_feeds_with(&g, 5, &dims).unwrap();
        exec.run(&inputs, &params, &RunOptions::default()).unwrap();
        assert_eq!(exec.last_launches(), alone(&plan), "{name}");
        // Every launch's functions are in the CLIF, and the query, key and value
        // projections of each attention are a group of three `linear`s.
        let clif = std::fs::read_to_string(dir.join(format!("kernels/{name}.clif"))).unwrap();
        for l in &plan.launches {
            for f in l
                .functions
                .values()
                .filter(|f| !f.chars().all(|c| "01".contains(c)))
            {
                assert!(clif.contains(&format!("function %{f}(")), "{name}: {f}");
            }
        }
        let linear = KernelKind::Template(TemplateKind::Linear);
        let threes = plan
            .groups
            .iter()
            .filter(|g| g.len == 3 && plan.launches[g.first].kind == linear)
            .count();
        // The tiny model: 2 encoder layers, 2 decoder layers (self-attention only: a
        // cross-attention's keys and values read the encoder's output, its query not).
        assert!(threes >= 4, "{name}: {} groups of three", threes);
        let pairs = plan
            .launches
            .iter()
            .filter(|l| l.bias_grad.is_some())
            .count()
            / 2;
        if name == "train_step" {
            assert!(pairs > 10, "{name}: {pairs} bias-gradient pairs");
        } else {
            assert_eq!(pairs, 0, "{name}: no gradient, no pair");
        }
    }
}

/// With 16-bit products (base at 36 rows, where every product is large enough), a run
/// launches the plan with every fusion taking effect — the groups' members together, each
/// bias gradient summed by its product — and compiled without the fusions, the plan has
/// none and the run launches each kernel on its own. Each 16-bit kernel is skipped where
/// the CPU cannot run it.
#[test]
fn with_16_bit_products_a_run_takes_every_fusion_of_its_plan() {
    let path = root().join("models/transformer_base.kiln");
    for entry in ["forward", "train_step"] {
        let g = entry_graph(&path, &["vocab=300"], entry).unwrap();
        let dims: BTreeMap<String, i64> = g
            .dims
            .iter()
            .map(|d| (d.clone(), if d == "batch" { 4 } else { 9 }))
            .collect();
        let (inputs, params) = random_feeds_with(&g, 5, &dims).unwrap();
        let separate = CompileOptions {
            product_groups: false,
            bias_grad_fusion: false,
            ..CompileOptions::default()
        };
        for kernel in Kernel16::SIXTEEN_BIT {
            if let Err(why) = kernel.available() {
                println!("skipped {kernel:?}: {why}");
                continue;
            }
            for opts in [CompileOptions::default(), separate.clone()] {
                let mut exec = Compiled::from_graph_with(g.clone(), &opts).unwrap();
                exec.set_bf16_kernel(Some(kernel)).unwrap();
                exec.record_launches(true);
                exec.run(&inputs, &params, &RunOptions::default()).unwrap();
                let plan = exec.launch_plan();
                let what = format!("{entry} {kernel:?} fused {}", opts.product_groups);
                if opts.product_groups {
                    assert!(
                        plan.groups.len() >= 18,
                        "{what}: {} groups",
                        plan.groups.len()
                    );
                } else {
                    assert!(plan.groups.is_empty(), "{what}");
                    assert!(
                        plan.launches.iter().all(|l| l.bias_grad.is_none()),
                        "{what}"
                    );
                }
                assert_eq!(exec.last_launches(), expected(plan), "{what}");
            }
        }
    }
}

/// `kiln explain` prints the fusions of the launch plan, and `--no-product-groups`
/// (a compile option) leaves them out.
#[test]
fn explain_shows_the_fusions() {
    let spec = root().join("models/transformer_tiny.kiln");
    let run = |extra: &[&str]| {
        let mut args = vec!["explain", spec.to_str().unwrap(), "--entry", "train_step"];
        args.extend_from_slice(extra);
        let out = kiln(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let text = run(&["--kernels"]);
    let line = text
        .lines()
        .find(|l| l.starts_with("fusions: "))
        .unwrap_or_else(|| panic!("no fusions line:\n{text}"));
    assert!(!line.starts_with("fusions: 0 product groups"), "{line}");
    assert!(text.contains("  group of 3 linear reading %"), "{text}");
    assert!(text.contains("  bias gradient %"), "{text}");
    let off = run(&["--no-product-groups", "--no-bias-grad-fusion"]);
    assert!(
        off.contains("fusions: 0 product groups (0 launches), 0 bias gradients paired"),
        "{off}"
    );
}
