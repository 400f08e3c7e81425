//! The shipped training configurations: they parse, they carry the paper's recipe, and
//! each runs a couple of training steps at its full architecture (with a tiny BPE
//! vocabulary and small batches, so the test stays quick). Multi30k is read from
//! `../shared/data/multi30k` when present; otherwise the generated task stands in.

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_train::config::Config;
use kiln_train::synthetic::Task;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn configs_parse_with_the_papers_recipe() {
    let base = Config::load(&root().join("models/configs/base.yaml")).unwrap();
    assert_eq!(
        (
            base.optimizer.beta1,
            base.optimizer.beta2,
            base.optimizer.eps
        ),
        (0.9, 0.98, 1e-9)
    );
    assert_eq!(base.schedule.warmup, 4000);
    assert_eq!(
        (base.batch.max_src_tokens, base.batch.max_tgt_tokens),
        (25_000, 25_000)
    );
    assert_eq!(base.train.max_steps, 100_000);
    assert_eq!(base.train.executor, "compiled");
    assert_eq!(base.data.vocab_size, 37000);
    assert_eq!(
        (base.valid.beam, base.valid.alpha, base.valid.max_len_b),
        (4, 0.6, 50)
    );
    assert!(base.overrides().contains(&"p_drop=0.1".to_string()));
    assert!(base.overrides().contains(&"eps_ls=0.1".to_string()));
    let big = Config::load(&root().join("models/configs/big.yaml")).unwrap();
    assert!(big.overrides().contains(&"p_drop=0.3".to_string()));
    assert_eq!(big.train.max_steps, 300_000);
    assert!(big.model.spec.ends_with("transformer_big.kiln"));
    let small = Config::load(&root().join("models/configs/multi30k_small.yaml")).unwrap();
    assert!(small.data.train_src.ends_with("multi30k/train.en"));
}

/// A copy of `name` with a tiny vocabulary, small batches, 2 steps and a scratch run
/// directory; on generated data when Multi30k is absent.
fn quick(name: &str) -> (PathBuf, PathBuf) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("configs")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut v: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("models/configs").join(format!("{name}.yaml")))
            .unwrap(),
    )
    .unwrap();
    let cfgdir = root().join("models/configs");
    let abs = |p: &str| serde_yaml::Value::String(cfgdir.join(p).display().to_string());
    let spec = v["model"]["spec"].as_str().unwrap().to_string();
    v["model"]["spec"] = abs(&spec);
    let multi30k = root().join("../shared/data/multi30k/train.en").is_file();
    for key in ["train_src", "train_tgt", "valid_src", "valid_tgt"] {
        let p = v["data"][key].as_str().unwrap().to_string();
        v["data"][key] = if multi30k {
            abs(&p)
        } else {
            serde_yaml::Value::String(dir.join(key).display().to_string())
        };
    }
    if !multi30k {
        println!(
            "Multi30k is absent (../shared/data/multi30k); training on the generated task instead"
        );
        let task = Task::new(5, 3, 8);
        let pairs = task.pairs(1, 200);
        let src: String = pairs.iter().map(|(s, _)| format!("{s}\n")).collect();
        let tgt: String = pairs.iter().map(|(_, t)| format!("{t}\n")).collect();
        for (key, text) in [
            ("train_src", &src),
            ("train_tgt", &tgt),
            ("valid_src", &src),
            ("valid_tgt", &tgt),
        ] {
            std::fs::write(dir.join(key), text).unwrap();
        }
    }
    // The 256 byte tokens, the corpus's 102 characters and the specials, and some merges.
    v["data"]["vocab_size"] = 400.into();
    v["batch"]["max_src_tokens"] = 200.into();
    v["batch"]["max_tgt_tokens"] = 200.into();
    v["train"]["max_steps"] = 2.into();
    v["train"]["log_every"] = 1.into();
    v["checkpoint"]["dir"] = serde_yaml::Value::String(dir.join("run").display().to_string());
    v["valid"]["max_sentences"] = 4.into();
    v["valid"]["max_len_b"] = 3.into();
    let cfg = dir.join("cfg.yaml");
    std::fs::write(&cfg, serde_yaml::to_string(&v).unwrap()).unwrap();
    (dir, cfg)
}

fn two_steps(name: &str) {
    let (dir, cfg) = quick(name);
    let start = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}: {err}");
    assert!(err.contains("step 2/2"), "{err}");
    assert!(dir
        .join("run/checkpoints/step_00000002/model.safetensors")
        .is_file());
    println!(
        "{name}: 2 steps (with init, BPE and validation) in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    // The big model's checkpoint with its Adam state is 2.1 GB, the base one 0.5 GB:
    // left behind, they filled the disk of a CI run before the later test binaries ran.
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn base_config_trains_two_steps() {
    two_steps("base");
}

#[test]
fn big_config_trains_two_steps() {
    two_steps("big");
}

/// The Multi30k recipe (`models/configs/multi30k.yaml`, #62) trains from its config (its
/// 16-bit products, the best kernel the CPU has): two steps.
#[test]
fn multi30k_recipe_trains_two_steps() {
    two_steps("multi30k");
}

/// The gallery's variants (`models/gallery/`, #61) train from their configs: two steps
/// each, on Multi30k where it is present.
#[test]
fn gallery_configs_train_two_steps() {
    for name in [
        "multi30k_pre_ln",
        "multi30k_rms_swiglu",
        "multi30k_gelu_ffn",
        "multi30k_separate_embeddings",
    ] {
        two_steps(name);
    }
}
