//! kiln-runtime: running compiled models.
//!
//! For now: [`entry`] — choosing an entry point of a model graph and checking the tensor
//! files fed to it (inputs, weights) against the graph before anything runs. Training,
//! decoding, data and checkpoints arrive with issue #3; the compiled executors with #5/#6.

pub mod config;
pub mod decode;
pub mod entry;
pub mod exec;
pub mod optim;
pub mod synthetic;

pub use entry::{check_inputs, check_weights, entry_graph, Entry, GraphKind, RuntimeError};
