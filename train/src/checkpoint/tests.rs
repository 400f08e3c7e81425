use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_compiler::tensor::TensorData;

use super::*;

/// Writes `bytes` to the checkpoint file `path` and records its new checksum: for the
/// tests that damage a file on purpose to see how loading names the damage.
fn write_sealed(path: &Path, bytes: impl AsRef<[u8]>) {
    std::fs::write(path, bytes).unwrap();
    crate::checksums::rehash(path.parent().unwrap()).unwrap();
}

fn scratch_dir(tag: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir =
        std::env::temp_dir().join(format!("kiln-ckpt-test-{}-{}-{tag}", std::process::id(), n));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn params(scale: f32) -> BTreeMap<String, Tensor> {
    let mut p = BTreeMap::new();
    p.insert(
        "emb.weight".to_string(),
        Tensor::f32(vec![3, 2], (0..6).map(|i| scale * i as f32 + 0.1).collect()).unwrap(),
    );
    p.insert(
        "encoder.layers.0.norm1.gamma".to_string(),
        Tensor::f32(vec![2], vec![scale, -scale / 3.0]).unwrap(),
    );
    p
}

fn moments(p: &BTreeMap<String, Tensor>) -> AdamMoments {
    let scaled = |k: f32| {
        p.iter()
            .map(|(n, t)| {
                let d = t.as_f32().unwrap().iter().map(|x| x * k).collect();
                (n.clone(), Tensor::f32(t.shape.clone(), d).unwrap())
            })
            .collect()
    };
    AdamMoments {
        m: scaled(0.5),
        v: scaled(0.25),
    }
}

fn state(step: u64) -> TrainState {
    let mut s = TrainState {
        step,
        epoch: 2,
        batch_in_epoch: 17,
        seed: 1234,
        src_tokens_seen: 1_000_000,
        tgt_tokens_seen: 1_100_000,
        lr: 7.0e-4 / 3.0,
        best_val_loss: Some(2.345678901234),
        best_bleu: None,
        config_digest: "sha256:abc".to_string(),
        ..TrainState::default()
    };
    s.lr_schedule.insert("warmup_steps".to_string(), 4000.0);
    s.extra
        .insert("note".to_string(), "hello: world".to_string());
    s
}

fn save_step(root: &Path, step: u64, scale: f32) -> Checkpoint {
    let p = params(scale);
    save(
        root,
        &state(step),
        &p,
        &moments(&p),
        &[("tokenizer.json", b"{\"v\":1}")],
    )
    .unwrap()
}

#[test]
fn round_trip() {
    let root = scratch_dir("roundtrip");
    let c = save_step(&root, 100, 1.5);
    assert_eq!(c.dir, root.join("step_00000100"));
    let back = load(&c.dir).unwrap();
    assert_eq!(back.params, params(1.5));
    assert_eq!(back.moments, moments(&params(1.5)));
    assert_eq!(back.state, state(100));
    assert_eq!(back.extra_files, vec!["tokenizer.json".to_string()]);
    assert_eq!(read_extra(&c.dir, "tokenizer.json").unwrap(), b"{\"v\":1}");
    // model.safetensors is a plain weights file.
    let w = load_safetensors(&c.dir.join(MODEL_FILE)).unwrap();
    assert_eq!(w, params(1.5));
    let o = load_safetensors(&c.dir.join(OPTIMIZER_FILE)).unwrap();
    assert!(o.contains_key("m.emb.weight") && o.contains_key("v.emb.weight"));
    // Saving the same step again replaces it.
    let p = params(2.0);
    save(&root, &state(100), &p, &moments(&p), &[]).unwrap();
    let back = load(&c.dir).unwrap();
    assert_eq!(back.params, p);
    assert!(back.extra_files.is_empty());
    let names: Vec<_> = std::fs::read_dir(&root).unwrap().collect();
    assert_eq!(names.len(), 1);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn state_yaml_is_extensible() {
    // The state of the first kilns: no best_step, loss scale, ...; and a field of
    // a newer one.
    let old = "step: 5\nepoch: 0\nbatch_in_epoch: 5\nseed: 1\nsrc_tokens_seen: 10\n\
               tgt_tokens_seen: 12\nlr: 0.001\nlr_schedule: {}\nbest_val_loss: null\n\
               best_bleu: null\nconfig_digest: abc\nextra: {}\nfuture_field: 1\n";
    let s = parse_state(old, Path::new("state.yaml")).unwrap();
    assert_eq!((s.step, s.batch_in_epoch, s.seed), (5, 5, 1));
    assert_eq!((s.best_bleu, s.best_step, s.loss_scale), (None, None, None));
    assert!(s.extra.is_empty());
    // What this kiln writes reads back.
    let yaml = serde_yaml::to_string(&state(7)).unwrap();
    assert_eq!(parse_state(&yaml, Path::new("s")).unwrap(), state(7));
}

#[test]
fn a_state_cut_short_is_refused() {
    let root = scratch_dir("cut");
    let dir = save_step(&root, 20, 1.0).dir;
    let path = dir.join(STATE_FILE);
    let full = std::fs::read_to_string(&path).unwrap();
    for (text, want) in [
        (
            "",
            "state.yaml` is empty (truncated?); restore it, or delete the checkpoint",
        ),
        ("# nothing\n", "state.yaml` is empty (truncated?)"),
        (
            "step: 20\n",
            "state.yaml` is incomplete (truncated?): it has no `epoch`, \
             `batch_in_epoch`, `seed`, ",
        ),
    ] {
        write_sealed(&path, text);
        let msg = load(&dir).unwrap_err().to_string();
        assert!(msg.contains(want), "{text:?}: {msg}");
        assert!(!msg.contains("rename the directory"), "{msg}");
    }
    // Cut at any line before `extra` (the last field): refused as incomplete. Cut
    // inside `extra`, only its free-form entries are lost.
    let lines: Vec<&str> = full.lines().collect();
    let extra = lines.iter().position(|l| l.starts_with("extra:")).unwrap();
    for n in 1..lines.len() {
        let cut = lines[..n].join("\n") + "\n";
        write_sealed(&path, &cut);
        match load(&dir) {
            Err(CheckpointError::IncompleteState { missing, .. }) if n <= extra => {
                assert!(missing.ends_with("`extra`"), "{cut}: {missing}")
            }
            Ok(c) if n > extra => {
                let mut want = state(20);
                want.extra.clear();
                assert_eq!(c.state, want);
            }
            other => panic!("{cut}: {other:?}"),
        }
    }
    write_sealed(&path, &full);
    assert_eq!(load(&dir).unwrap().state, state(20));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn crash_leftovers_are_ignored_then_cleaned() {
    let root = scratch_dir("atomic");
    save_step(&root, 100, 1.0);
    save_step(&root, 200, 2.0);
    // A save killed mid-write leaves a partial temporary directory; pid 4294967294
    // is above any pid_max, so it belongs to no live process.
    let crashed = root.join("step_00000300.tmp-4294967294");
    std::fs::create_dir(&crashed).unwrap();
    std::fs::write(crashed.join(MODEL_FILE), b"partial").unwrap();
    let l = latest(&root).unwrap().unwrap();
    assert_eq!((l.step, l.dir.clone()), (200, root.join("step_00000200")));
    assert_eq!(list(&root).unwrap().len(), 2);
    // The next save removes it.
    save_step(&root, 300, 3.0);
    assert!(!crashed.exists());
    assert_eq!(latest(&root).unwrap().unwrap().step, 300);
    assert_eq!(
        load(&root.join("step_00000300")).unwrap().params,
        params(3.0)
    );

    // A checkpoint that lost a file is reported, by name, with the fix.
    std::fs::remove_file(root.join("step_00000300").join(OPTIMIZER_FILE)).unwrap();
    let msg = latest(&root).unwrap_err().to_string();
    assert!(
        msg.contains("step_00000300") && msg.contains(OPTIMIZER_FILE),
        "{msg}"
    );
    assert!(msg.contains("delete the directory"), "{msg}");
    let msg = load(&root.join("step_00000300")).unwrap_err().to_string();
    assert!(msg.contains(OPTIMIZER_FILE), "{msg}");

    // A corrupt file and a corrupt state are named.
    let dir = root.join("step_00000200");
    std::fs::write(dir.join(MODEL_FILE), b"garbage").unwrap();
    let msg = load(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("step_00000200: model.safetensors does not match its SHA-256"),
        "{msg}"
    );
    write_sealed(&dir.join(MODEL_FILE), b"garbage");
    let msg = load(&dir).unwrap_err().to_string();
    assert!(msg.contains("step_00000200/model.safetensors"), "{msg}");
    let dir = root.join("step_00000100");
    write_sealed(&dir.join(STATE_FILE), "step: [1, 2]\n");
    let msg = load(&dir).unwrap_err().to_string();
    assert!(msg.contains("state.yaml"), "{msg}");
    write_sealed(
        &dir.join(STATE_FILE),
        serde_yaml::to_string(&state(7)).unwrap(),
    );
    let msg = load(&dir).unwrap_err().to_string();
    assert!(msg.contains("step 7") && msg.contains("step 100"), "{msg}");

    assert!(latest(&root.join("nothing-here")).unwrap().is_none());
    assert!(matches!(
        load(&root.join("nothing-here")),
        Err(CheckpointError::NotACheckpoint { .. })
    ));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn weights_and_moments_of_another_dtype_or_name_are_named() {
    let root = scratch_dir("dtype");
    let dir = save_step(&root, 3, 1.0).dir;
    let (model, optimizer) = (dir.join(MODEL_FILE), dir.join(OPTIMIZER_FILE));
    let rewrite = |path: &Path, edit: &dyn Fn(&mut BTreeMap<String, Tensor>)| {
        let mut t = load_safetensors(path).unwrap();
        edit(&mut t);
        let named: Vec<(String, Tensor)> = t.into_iter().collect();
        save_safetensors(path, &named, None).unwrap();
        crate::checksums::rehash(path.parent().unwrap()).unwrap();
    };
    let f64_of = |t: &Tensor| Tensor {
        shape: t.shape.clone(),
        data: TensorData::F64(t.to_f64_vec().unwrap()),
    };
    let (good_model, good_optimizer) = (
        std::fs::read(&model).unwrap(),
        std::fs::read(&optimizer).unwrap(),
    );

    rewrite(&optimizer, &|t| {
        let m = f64_of(&t["m.emb.weight"]);
        t.insert("m.emb.weight".into(), m);
    });
    let msg = load(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("step_00000003/optimizer.safetensors` does not fit the parameters in `")
            && msg.contains("moment `m.emb.weight` is f64, but Adam moments are f32; restore it"),
        "{msg}"
    );
    write_sealed(&optimizer, &good_optimizer);

    rewrite(&model, &|t| {
        let p = f64_of(&t["emb.weight"]);
        t.insert("emb.weight".into(), p);
    });
    let msg = load(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("step_00000003/model.safetensors`: parameter `emb.weight` is f64, but a checkpoint's parameters are f32"),
        "{msg}"
    );
    // A caller's check of the weights comes before the moments are compared.
    write_sealed(&model, &good_model);
    rewrite(&model, &|t| {
        t.remove("emb.weight");
    });
    let msg = load_checked(&dir, &|file, p| {
        assert_eq!(file, model.as_path());
        match p.contains_key("emb.weight") {
            true => Ok(()),
            false => Err(format!("`{}` lacks `emb.weight`", file.display())),
        }
    })
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains(
            "model.safetensors` lacks `emb.weight`; the checkpoint's files do not fit together"
        ),
        "{msg}"
    );
    // Without one, the moments are what does not fit, and the message says so.
    let msg = load(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("optimizer.safetensors` does not fit the parameters in `")
            && msg.contains("it has moments `m` of `emb.weight`, which is not a parameter"),
        "{msg}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn save_checks_moments_and_file_names() {
    let root = scratch_dir("checks");
    let p = params(1.0);
    let mut m = moments(&p);
    m.v.remove("emb.weight");
    let msg = save(&root, &state(1), &p, &m, &[]).unwrap_err().to_string();
    assert!(msg.contains("`emb.weight`"), "{msg}");
    let m = moments(&p);
    for bad in ["", "../x", "a/b", MODEL_FILE] {
        assert!(matches!(
            save(&root, &state(1), &p, &m, &[(bad, b"")]),
            Err(CheckpointError::BadFileName { .. })
        ));
    }
    assert!(list(&root).unwrap().is_empty());
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn prune_keeps_the_last_k() {
    let root = scratch_dir("prune");
    for (i, step) in [100u64, 200, 300, 1000, 50].into_iter().enumerate() {
        save_step(&root, step, i as f32);
    }
    std::fs::create_dir(root.join("notes")).unwrap();
    let removed = prune(&root, 2).unwrap();
    assert_eq!(
        removed,
        vec![
            root.join("step_00000050"),
            root.join("step_00000100"),
            root.join("step_00000200")
        ]
    );
    let left: Vec<u64> = list(&root).unwrap().iter().map(|c| c.step).collect();
    assert_eq!(left, vec![300, 1000]);
    assert!(root.join("notes").is_dir());
    assert!(prune(&root, 5).unwrap().is_empty());
    assert!(matches!(prune(&root, 0), Err(CheckpointError::KeepZero)));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn averaging_three_checkpoints_is_the_mean() {
    let root = scratch_dir("average");
    let a = save_step(&root, 1, 1.0).dir;
    let b = save_step(&root, 2, 2.0).dir;
    let c = save_step(&root, 3, 4.5).dir;
    // Mix a directory and a bare file.
    let c_file = c.join(MODEL_FILE);
    let avg = average(&[&a, &b, &c_file]).unwrap();
    assert_eq!(avg.len(), 2);
    let emb = avg["emb.weight"].as_f32().unwrap();
    // scale * i + 0.1 averaged over scales 1, 2, 4.5: (7.5 / 3) * i + 0.1.
    for (i, &x) in emb.iter().enumerate() {
        let want = [1.0f32, 2.0, 4.5]
            .iter()
            .map(|&s| f64::from(s * i as f32 + 0.1))
            .sum::<f64>()
            / 3.0;
        assert_eq!(x, want as f32, "element {i}");
    }
    let g = avg["encoder.layers.0.norm1.gamma"].as_f32().unwrap();
    assert_eq!(g[0], (7.5f64 / 3.0) as f32);
    let want1 =
        (f64::from(-1.0f32 / 3.0) + f64::from(-2.0f32 / 3.0) + f64::from(-4.5f32 / 3.0)) / 3.0;
    assert_eq!(g[1], want1 as f32);
    assert_eq!(avg["emb.weight"].shape, vec![3, 2]);

    // The odd one out is named.
    let odd = root.join("odd.safetensors");
    let mut p = params(1.0);
    p.remove("emb.weight");
    p.insert(
        "emb.weights".to_string(),
        Tensor::f32(vec![3, 2], vec![0.0; 6]).unwrap(),
    );
    let named: Vec<(String, Tensor)> = p.into_iter().collect();
    save_safetensors(&odd, &named, None).unwrap();
    let msg = average(&[&a, &odd]).unwrap_err().to_string();
    assert!(
        msg.contains("odd.safetensors") && msg.contains("`emb.weights`"),
        "{msg}"
    );
    let mut p = params(1.0);
    p.insert(
        "emb.weight".to_string(),
        Tensor::f32(vec![2, 3], vec![0.0; 6]).unwrap(),
    );
    let named: Vec<(String, Tensor)> = p.into_iter().collect();
    save_safetensors(&odd, &named, None).unwrap();
    let msg = average(&[&a, &odd]).unwrap_err().to_string();
    assert!(
        msg.contains("[2, 3]") && msg.contains("emb.weight"),
        "{msg}"
    );
    assert!(matches!(average(&[]), Err(CheckpointError::AverageNothing)));
    std::fs::remove_dir_all(&root).unwrap();
}
