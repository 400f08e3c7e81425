//! kiln-exec: running a model's graphs — the executors behind one interface, and the
//! artifact they replay.
//!
//! Modules:
//! - [`entry`] — entry points of a model graph and checks on the tensors fed to them;
//! - [`graphs`] — the entry-point graphs of one model (`graphs.json`);
//! - [`executor`] — the executors behind one interface ([`executor::Exec`]) and the choice
//!   among them;
//! - [`eager`] — the eager CPU executor (any graph op by op, `gemm` for matmuls,
//!   vectorized loops for the rest);
//! - [`compiled`] — the compiled CPU executor: replays an artifact's launch plan (its CLIF
//!   JIT-compiled), its products through `kiln-matmul`;
//! - [`cuda`] — the CUDA executor and its guard (whether the driver, NVRTC and cuBLAS load
//!   and a device exists; every CUDA call goes behind it), data parallelism over several
//!   GPUs, and (feature `emulate`, test support) the device emulated on the host;
//! - [`artifact`] — loading a compiled artifact, every file and plan checked.

pub mod artifact;
pub mod compiled;
pub mod cuda;
pub mod eager;
pub mod entry;
pub mod executor;
pub mod graphs;

pub use eager::{Eager, OpTime, Outputs};
pub use entry::{
    check_inputs, check_weights, compiled_entry_graph, compiled_entry_graph_with,
    compiled_graph_kind, decoder_entries, entry_graph, Entry, GraphKind, RuntimeError,
    COMPILED_ENTRIES,
};
