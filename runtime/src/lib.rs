//! kiln-runtime: running compiled models.
//!
//! For now: [`entry`] — choosing an entry point of a model graph and checking the tensor
//! files fed to it (inputs, weights) against the graph before anything runs;
//! [`data`] — parallel corpora, the shared BPE vocabulary and token-based batches;
//! [`checkpoint`] — atomic checkpoints, keep-last-k and averaging; [`interop`] — weights
//! in PyTorch `nn.Transformer` naming. Training and decoding arrive with issue #3; the
//! compiled executors with #5/#6.

pub mod checkpoint;
pub mod data;
pub mod entry;
pub mod interop;

pub use entry::{check_inputs, check_weights, entry_graph, Entry, RuntimeError};
