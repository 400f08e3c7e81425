//! The learning-rate schedules: the paper's (`noam`, the default) and those fairseq
//! users reach for (`inverse_sqrt`, `cosine`, `fixed`).
//!
//! In: the `schedule` section of the configuration, the model's `d_model` (for `noam`)
//! and the run's length (for `cosine`). Out: the learning rate of each optimizer step
//! (steps count from 1). Each is a function of the step alone, so a resumed run takes
//! the same rates as an uninterrupted one.

use serde::{Deserialize, Serialize};

/// Which schedule.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// The paper's: `factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)`.
    #[default]
    Noam,
    /// fairseq's `inverse_sqrt`: linear from `warmup_init_lr` to `lr` over `warmup`
    /// steps, then `lr · sqrt(warmup / step)`.
    InverseSqrt,
    /// Linear warmup to `lr`, then half a cosine down to `min_lr` at step `period`
    /// (`min_lr` after it).
    Cosine,
    /// Linear warmup to `lr` (none with `warmup: 0`), then `lr`.
    Fixed,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ScheduleConfig {
    /// `noam` (default), `inverse_sqrt`, `cosine` or `fixed`. Left out of a written
    /// configuration when `noam`, so runs from before the option keep their digest.
    #[serde(skip_serializing_if = "is_noam")]
    pub kind: ScheduleKind,
    /// Steps of linear warmup.
    pub warmup: u64,
    /// `noam`: multiplies the paper's learning rate.
    pub factor: f64,
    /// `noam`: defaults to the spec's `d_model`.
    #[serde(default)]
    pub d_model: Option<f64>,
    /// The peak learning rate of `inverse_sqrt`, `cosine` and `fixed` (required there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Where the warmup of `inverse_sqrt`, `cosine` and `fixed` starts (fairseq's
    /// `warmup_init_lr`); 0 by default.
    #[serde(skip_serializing_if = "is_zero")]
    pub warmup_init_lr: f64,
    /// `cosine`: the learning rate it ends at; 0 by default.
    #[serde(skip_serializing_if = "is_zero")]
    pub min_lr: f64,
    /// `cosine`: the step it reaches `min_lr` at (warmup included); `train.max_steps`
    /// by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period: Option<u64>,
}

fn is_noam(k: &ScheduleKind) -> bool {
    *k == ScheduleKind::Noam
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            kind: ScheduleKind::Noam,
            warmup: 4000,
            factor: 1.0,
            d_model: None,
            lr: None,
            warmup_init_lr: 0.0,
            min_lr: 0.0,
            period: None,
        }
    }
}

impl ScheduleConfig {
    /// The learning rate of optimizer step `step` (from 1): `d_model` is the model's
    /// width (`noam`), `total` the run's steps (`cosine`'s default period).
    pub fn lr(&self, d_model: f64, step: u64, total: u64) -> f64 {
        let s = step.max(1) as f64;
        let w = self.warmup as f64;
        if self.kind == ScheduleKind::Noam {
            let w = w.max(1.0);
            return self.factor * d_model.powf(-0.5) * s.powf(-0.5).min(s * w.powf(-1.5));
        }
        let peak = self.lr.unwrap_or(0.0);
        if s < w {
            return self.warmup_init_lr + (peak - self.warmup_init_lr) * s / w;
        }
        match self.kind {
            ScheduleKind::InverseSqrt => peak * (w.max(1.0) / s).sqrt(),
            ScheduleKind::Cosine => {
                let end = self.period.unwrap_or(total) as f64;
                let t = if end > w {
                    ((s - w) / (end - w)).min(1.0)
                } else {
                    1.0
                };
                self.min_lr + (peak - self.min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
            }
            _ => peak,
        }
    }

    /// Whether the schedule reads the model's `d_model`.
    pub fn needs_d_model(&self) -> bool {
        self.kind == ScheduleKind::Noam
    }

    /// The section's problems, into `bad`.
    pub(super) fn check(&self, bad: &mut Vec<String>) {
        let positive = |key: &str, value: f64, bad: &mut Vec<String>| {
            if !(value.is_finite() && value > 0.0) {
                bad.push(format!("{key} is {value}; give a positive finite number"));
            }
        };
        let kind = serde_yaml::to_string(&self.kind).unwrap_or_default();
        let kind = kind.trim();
        if self.kind == ScheduleKind::Noam {
            positive("schedule.factor", self.factor, bad);
            if let Some(d) = self.d_model {
                positive("schedule.d_model", d, bad);
            }
            for (key, given) in [
                ("lr", self.lr.is_some()),
                ("warmup_init_lr", self.warmup_init_lr != 0.0),
                ("min_lr", self.min_lr != 0.0),
                ("period", self.period.is_some()),
            ] {
                if given {
                    bad.push(format!(
                        "schedule.{key} is not read by the `noam` schedule (its scale is \
                         schedule.factor); set `kind: inverse_sqrt`, `cosine` or `fixed`, \
                         or drop it"
                    ));
                }
            }
            return;
        }
        match self.lr {
            Some(lr) => positive("schedule.lr", lr, bad),
            None => bad.push(format!(
                "schedule.lr is missing: the `{kind}` schedule needs its peak learning \
                 rate (e.g. `lr: 5.0e-4`)"
            )),
        }
        if !(self.warmup_init_lr.is_finite() && self.warmup_init_lr >= 0.0) {
            bad.push(format!(
                "schedule.warmup_init_lr is {}; give a finite number, 0 or more",
                self.warmup_init_lr
            ));
        }
        if self.kind == ScheduleKind::InverseSqrt && self.warmup == 0 {
            bad.push(
                "schedule.warmup is 0, but `inverse_sqrt` decays as sqrt(warmup / step); \
                 give at least 1"
                    .to_string(),
            );
        }
        if self.kind == ScheduleKind::Cosine {
            if !(self.min_lr.is_finite() && self.min_lr >= 0.0) {
                bad.push(format!(
                    "schedule.min_lr is {}; give a finite number, 0 or more",
                    self.min_lr
                ));
            }
        } else if self.min_lr != 0.0 || self.period.is_some() {
            bad.push(format!(
                "schedule.min_lr and schedule.period belong to the `cosine` schedule, not \
                 `{kind}`: drop them or set `kind: cosine`"
            ));
        }
    }
}
