//! kiln-runtime: running compiled models.
//!
//! [`eager`] — the eager CPU executor: any graph op by op, `gemm` for matmuls,
//! vectorized loops for the rest; the unfused baseline compiled code is measured against.
//!
//! [`entry`] — choosing an entry point of a model graph and checking the tensor
//! files fed to it (inputs, weights) against the graph before anything runs. Training,
//! decoding, data and checkpoints arrive with issue #3; the compiled executors with #5/#6.

pub mod eager;
pub mod entry;

pub use eager::{Eager, OpTime, Outputs};
pub use entry::{check_inputs, check_weights, entry_graph, Entry, RuntimeError};
