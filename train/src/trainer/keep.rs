//! What a run keeps: validation, the checkpoints and the best one, early stopping's
//! patience, and the messages that name what was kept.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln_compiler::reference::RunOptions;
use kiln_compiler::tensor::{Tensor, TensorData};

use crate::checkpoint::{self, AdamMoments};
use crate::model::{CONFIG_FILE, GRAPHS_FILE, TOKENIZER_FILE};
use kiln_decode::bleu::{corpus_bleu, BleuOptions};
use kiln_decode::search::{DecodeOptions, EarlyStop, LengthPenalty};
use kiln_decode::translate::{
    decode_workers, translate_ids, Batching, Schedule, StepModels, TRANSLATE_BATCH,
};

use super::*;

impl Trainer {
    /// How validation BLEU is computed: sacreBLEU's signature (its defaults, one
    /// reference), then the search that made the translations.
    pub(super) fn bleu_signature(&self) -> String {
        let v = &self.cfg.valid;
        format!(
            "{}|beam:{}|alpha:{:?}|penalty:{}|stop:{}|max_len:{:?}x+{}",
            BleuOptions::default().signature(1),
            v.beam,
            v.alpha,
            v.length_penalty,
            v.early_stop,
            v.max_len_a,
            v.max_len_b
        )
    }

    /// Validation loss (token-weighted) and, if configured, BLEU of beam search.
    pub fn validate(&self) -> Result<(f64, Option<f64>), TrainError> {
        let objective = self
            .graphs
            .loss
            .objective
            .clone()
            .unwrap_or_else(|| "loss".to_string());
        let (mut sum, mut tokens) = (0.0f64, 0usize);
        // `&self`: the parameters cannot change during the pass.
        let opts = RunOptions {
            params_version: Some(kiln_exec::executor::fresh_params_version()),
            ..RunOptions::default()
        };
        for b in 0..self.valid_plan.len() {
            let batch = self.valid_plan.batch(&self.valid, b).expect("valid batch");
            let mut inputs = BTreeMap::new();
            inputs.insert("src".to_string(), batch.src);
            inputs.insert("tgt_in".to_string(), batch.tgt_in);
            inputs.insert("tgt_out".to_string(), batch.tgt_out);
            let out = self
                .loss_exec
                .run_map(&inputs, &self.params, &opts)
                .map_err(|source| TrainError::Exec {
                    step: self.state.step,
                    source,
                })?;
            let l = scalar(&out, &objective).unwrap_or(f32::NAN) as f64;
            sum += l * batch.n_tgt_tokens as f64;
            tokens += batch.n_tgt_tokens;
        }
        let loss = sum / tokens.max(1) as f64;
        if !self.cfg.valid.bleu {
            return Ok((loss, None));
        }
        let v = &self.cfg.valid;
        let opts = DecodeOptions {
            beam: v.beam,
            greedy: false,
            penalty: LengthPenalty::parse(&v.length_penalty, v.alpha)
                .unwrap_or(LengthPenalty::Gnmt(v.alpha)),
            early_stop: EarlyStop::parse(&v.early_stop).unwrap_or_default(),
            max_len_a: v.max_len_a,
            max_len_b: v.max_len_b,
            ..DecodeOptions::default()
        };
        let n = self.valid.len();
        let srcs: Vec<Vec<i32>> = self.valid[..n].iter().map(|e| e.src.clone()).collect();
        let models = StepModels {
            encode: &*self.encode_exec,
            step: &*self.step_exec,
            params: &self.params,
            vocab: self.vocab(),
        };
        let schedule = Schedule {
            batching: Batching::sentences(TRANSLATE_BATCH),
            workers: decode_workers(&*self.step_exec),
        };
        let hyps = translate_ids(models, &srcs, &opts, schedule, &mut |_| {})?;
        let hyps: Vec<String> = hyps.iter().map(|h| self.tokenizer.decode(h)).collect();
        let refs: Vec<String> = self.valid_lines[..n]
            .iter()
            .map(|&l| self.valid_corpus.tgt[l].clone())
            .collect();
        let bleu = corpus_bleu(&hyps, &[refs], &BleuOptions::default())
            .map_err(|e| TrainError::Setup(format!("BLEU: {e}")))?;
        Ok((loss, Some(bleu.score)))
    }

    /// Where this run writes its checkpoints (`<run dir>/checkpoints`).
    pub fn checkpoint_root(&self) -> PathBuf {
        self.dir.join("checkpoints")
    }

    /// Writes a checkpoint of the current state and keeps the last `keep`.
    pub fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        let mut m = BTreeMap::new();
        let mut v = BTreeMap::new();
        for (name, p) in &self.params {
            let t = |x: &Vec<f32>| Tensor {
                shape: p.shape.clone(),
                data: TensorData::F32(x.clone()),
            };
            m.insert(name.clone(), t(&self.adam.m[name]));
            v.insert(name.clone(), t(&self.adam.v[name]));
        }
        let tok = self.tokenizer.to_json()?;
        let cfg_yaml = serde_yaml::to_string(&self.cfg).expect("config serializes");
        let files: [(&str, &[u8]); 3] = [
            (GRAPHS_FILE, &self.graphs_json),
            (TOKENIZER_FILE, tok.as_bytes()),
            (CONFIG_FILE, cfg_yaml.as_bytes()),
        ];
        let root = self.dir.join("checkpoints");
        let ck = checkpoint::save(
            &root,
            &self.state,
            &self.params,
            &AdamMoments { m, v },
            &files,
        )?;
        checkpoint::prune(&root, self.cfg.checkpoint.keep)?;
        Ok(ck.dir)
    }

    /// Writes the current parameters as the model directory `<run>/best/`.
    pub(super) fn save_best(&self) -> Result<PathBuf, TrainError> {
        let dir = self.dir.join("best");
        let tok = self.tokenizer.to_json()?;
        let cfg_yaml = serde_yaml::to_string(&self.cfg).expect("config serializes");
        let extra: [(&str, &[u8]); 1] = [(CONFIG_FILE, cfg_yaml.as_bytes())];
        crate::model::save_dir(
            &dir,
            &self.params,
            &self.graphs_json,
            tok.as_bytes(),
            &extra,
        )
        .map_err(|e| TrainError::Write {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        Ok(dir)
    }

    /// What `valid.patience` says of the validations so far: `Some(why)` once that many
    /// in a row were no better than the best.
    pub(super) fn patience_spent(&self) -> Option<String> {
        let patience = self.cfg.valid.patience;
        if patience == 0 || self.state.bad_validations < patience {
            return None;
        }
        let (name, best) = if self.cfg.valid.best_metric() == "bleu" {
            ("BLEU", self.state.best_bleu.map(|b| format!("{b:.2}")))
        } else {
            ("loss", self.state.best_val_loss.map(|l| format!("{l:.4}")))
        };
        Some(format!(
            "stopped early at step {}: {} validation{} in a row without a better {name} than \
             {} (step {}); valid.patience is {patience}",
            self.state.step,
            self.state.bad_validations,
            if self.state.bad_validations == 1 {
                ""
            } else {
                "s"
            },
            best.unwrap_or_else(|| "none".into()),
            self.state
                .best_step
                .map_or_else(|| "?".to_string(), |s| s.to_string()),
        ))
    }

    /// An error after a step was taken (writing the metrics log or `best/`, validating):
    /// the step's checkpoint is written first, unless it is on disk already, so that the
    /// error costs no training; a write error then says where the training is kept.
    pub(super) fn keeping_the_step(&mut self, e: TrainError) -> TrainError {
        let step = self.state.step;
        let root = self.checkpoint_root();
        let saved = match checkpoint::latest(&root) {
            Ok(Some(c)) if c.step == step => Ok(c.dir),
            _ => self.sync_device().and_then(|()| self.save_checkpoint()),
        };
        match (e, saved) {
            (TrainError::Write { path, message }, Ok(dir)) => TrainError::Write {
                path,
                message: format!(
                    "{message}; the training up to step {step} is kept in `{}`: fix that, then \
                     continue with `kiln train --resume {}`",
                    dir.display(),
                    self.dir.display()
                ),
            },
            (e, _) => e,
        }
    }

    /// A training error that says what is kept: fills in the run's newest checkpoint.
    pub(super) fn naming_the_kept_checkpoint(&self, mut e: TrainError) -> TrainError {
        if let TrainError::NonFinite { kept, .. }
        | TrainError::LossScale { kept, .. }
        | TrainError::Diverged { kept, .. } = &mut e
        {
            let newest = checkpoint::latest(&self.checkpoint_root()).ok().flatten();
            *kept = Kept(newest.map(|c| c.dir));
        }
        e
    }
}
