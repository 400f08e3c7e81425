//! The digest of the settings a resumed run must share with the run it resumes, and the
//! differences named when they do not.

use std::collections::BTreeMap;

use crate::config::Config;

/// FNV-1a of a value's YAML text.
fn fnv(value: &impl serde::Serialize) -> String {
    let text = serde_yaml::to_string(value).unwrap_or_default();
    kiln_compiler::artifact::hash_hex(text.as_bytes())
}

/// A digest of each part of the configuration that decides the training trajectory
/// (`model=… data=… batch=… optimizer=… schedule=… run=…`, `run` being the seed and the
/// executor). How long to train, how often to log, checkpoint or validate are left out:
/// a resumed run may change those.
pub(crate) fn digest(cfg: &Config) -> String {
    [
        ("model", fnv(&cfg.model)),
        // Where the pairs are read from (text or binarized) does not change them.
        (
            "data",
            fnv(&crate::config::DataConfig {
                binarized: None,
                ..cfg.data.clone()
            }),
        ),
        ("batch", fnv(&cfg.batch)),
        ("optimizer", fnv(&cfg.optimizer)),
        ("schedule", fnv(&cfg.schedule)),
        ("run", fnv(&(cfg.train.seed, &cfg.train.executor))),
    ]
    .into_iter()
    // Runs without loss scaling keep the digest they had before it existed.
    .chain(
        cfg.train
            .loss_scale
            .as_ref()
            .map(|l| ("loss_scale", fnv(l))),
    )
    // Products in 16 bits change the trajectory (f32, the default, keeps the digest).
    .chain(
        cfg.train
            .gemm_type
            .as_ref()
            .filter(|g| g.as_str() != "f32")
            .map(|g| ("gemm", fnv(g))),
    )
    // Data parallel over several GPUs multiplies the batch (which GPUs does not matter,
    // and one GPU through NCCL is the run without it).
    .chain(
        cfg.train
            .devices
            .as_ref()
            .filter(|d| d.len() > 1)
            .map(|d| ("gpus", fnv(&d.len()))),
    )
    .map(|(k, v)| format!("{k}={v}"))
    .collect::<Vec<_>>()
    .join(" ")
}

/// The parts whose digests differ between two [`digest`] texts (none when either is
/// not in that form).
pub(crate) fn digest_changes(saved: &str, now: &str) -> Vec<String> {
    let parts = |s: &str| -> Option<BTreeMap<String, String>> {
        s.split(' ')
            .map(|kv| {
                kv.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect()
    };
    let (Some(a), Some(b)) = (parts(saved), parts(now)) else {
        return Vec::new();
    };
    a.keys()
        .chain(b.keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            if k == "run" {
                "`train.seed`/`train.executor`".to_string()
            } else if k == "loss_scale" {
                "`train.loss_scale`".to_string()
            } else if k == "gemm" {
                "`train.gemm_type`".to_string()
            } else if k == "gpus" {
                "the number of GPUs in `train.devices`".to_string()
            } else {
                format!("`{k}`")
            }
        })
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}
