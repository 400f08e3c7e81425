//! Whether a run has diverged while its loss stays finite: the training loss above a
//! factor of the lowest it reached, step after step (`train.divergence`). The lowest
//! counts as at least 1 nat a token: a model that good fluctuates by factors near its
//! floor (a batch at 0.01, the next at 0.05) without diverging.

use crate::config::DivergenceConfig;

/// The least loss the factor multiplies (nats a target token).
pub const FLOOR: f64 = 1.0;

/// The run's lowest training loss so far, and how many steps in a row have been above
/// the factor of it.
#[derive(Clone, Debug)]
pub struct Watch {
    config: DivergenceConfig,
    lowest: f64,
    above: u64,
}

/// What [`Watch::observe`] found: the run has diverged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Diverged {
    pub loss: f64,
    pub lowest: f64,
    pub factor: f64,
    pub steps: u64,
}

impl Watch {
    pub fn new(config: &DivergenceConfig) -> Watch {
        Watch {
            config: config.clone(),
            lowest: f64::INFINITY,
            above: 0,
        }
    }

    /// Takes one step's training loss (per target token); `Some` once `steps` losses in
    /// a row were above `factor` times the lowest before them.
    pub fn observe(&mut self, loss: f64) -> Option<Diverged> {
        if self.config.factor == 0.0 || !loss.is_finite() {
            return None;
        }
        if loss > self.config.factor * self.lowest.max(FLOOR) {
            self.above += 1;
        } else {
            self.above = 0;
            self.lowest = self.lowest.min(loss);
        }
        (self.above >= self.config.steps).then_some(Diverged {
            loss,
            lowest: self.lowest,
            factor: self.config.factor,
            steps: self.config.steps,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loss_that_stays_far_above_its_lowest_is_divergence_a_spike_is_not() {
        let config = DivergenceConfig {
            factor: 4.0,
            steps: 3,
        };
        let mut w = Watch::new(&config);
        for l in [9.0, 6.0, 3.0, 2.0] {
            assert_eq!(w.observe(l), None);
        }
        // A spike of two steps, then back: no divergence.
        assert_eq!(w.observe(9.0), None);
        assert_eq!(w.observe(8.5), None);
        assert_eq!(w.observe(2.5), None);
        // Three in a row above 4 × 2.
        assert_eq!(w.observe(4e4), None);
        assert_eq!(w.observe(3e4), None);
        assert_eq!(
            w.observe(5e4),
            Some(Diverged {
                loss: 5e4,
                lowest: 2.0,
                factor: 4.0,
                steps: 3
            })
        );
        let mut off = Watch::new(&DivergenceConfig {
            factor: 0.0,
            steps: 1,
        });
        assert_eq!(off.observe(1.0), None);
        assert_eq!(off.observe(1e9), None);
        // Near a good model's floor, the factor multiplies 1 nat, not the lowest.
        let mut good = Watch::new(&config);
        for l in [0.01, 0.05, 0.05, 0.05, 0.05] {
            assert_eq!(good.observe(l), None);
        }
    }
}
