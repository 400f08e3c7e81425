//! kiln-runtime: running compiled models.
//!
//! For now: [`entry`] — choosing an entry point of a model graph and checking the tensor
//! files fed to it (inputs, weights) against the graph before anything runs; and the
//! training run's reporting: [`bleu`] (corpus BLEU with sacreBLEU's semantics),
//! [`metrics`] (the `metrics.jsonl` log) and [`plot`] (the loss/BLEU PNG). Training,
//! decoding, data and checkpoints arrive with issue #3; the compiled executors with #5/#6.

pub mod bleu;
pub mod entry;
pub mod metrics;
pub mod plot;

pub use entry::{check_inputs, check_weights, entry_graph, Entry, RuntimeError};
