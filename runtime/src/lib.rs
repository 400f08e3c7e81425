//! kiln-runtime: running models — executors, training, decoding, data, checkpoints.
//!
//! Modules:
//! - [`entry`] — entry points of a model graph and checks on the tensors fed to them;
//! - [`exec`] — the executors behind one interface; [`eager`] — the eager CPU executor
//!   (any graph op by op, `gemm` for matmuls, vectorized loops for the rest);
//! - [`compiled`] — the compiled CPU executor: replays an artifact's launch plan (its CLIF
//!   JIT-compiled), its products through `kiln-matmul`;
//! - [`artifact`] — loading a compiled artifact, every file and plan checked;
//! - [`config`] — the YAML training configuration (the paper's recipe as defaults);
//! - [`data`] — parallel corpora, the shared BPE vocabulary, token-based batches;
//! - [`optim`] — Adam;
//! - [`checkpoint`] — atomic checkpoint directories, keep-last-k, averaging;
//! - [`checksums`] — the SHA-256 record of a checkpoint's or a model directory's files;
//! - [`decode`] — greedy and beam search with a key/value cache;
//! - [`bleu`] — corpus BLEU with sacreBLEU's semantics;
//! - [`metrics`] — the `metrics.jsonl` log; [`plot`] — the loss/BLEU PNG;
//! - [`interop`] — PyTorch `nn.Transformer` parameter names;
//! - [`model`] — model directories (weights, graphs, tokenizer) used without the spec;
//! - [`train`] — the trainer; [`divergence`] — when a finite loss has diverged; [`run_dir`] — whether a directory can take a new run;
//!   [`tokenizer`] — a run's BPE vocabulary and the record of what it was trained on;
//! - [`translate`] — batches of sentences through beam search, and scoring;
//! - [`synthetic`] — the generated task of the demo;
//! - [`cuda`] — the CUDA guard: whether the driver, NVRTC and cuBLAS load and a device
//!   exists (every CUDA call goes behind it).

pub mod artifact;
pub mod bleu;
pub mod checkpoint;
pub mod checksums;
pub mod compiled;
pub mod config;
pub mod cuda;
pub mod data;
pub mod decode;
pub mod divergence;
pub mod eager;
pub mod entry;
pub mod exec;
pub mod interop;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod plot;
pub mod run_dir;
pub mod synthetic;
pub mod tokenizer;
pub mod train;
pub mod translate;

pub use eager::{Eager, OpTime, Outputs};
pub use entry::{
    check_inputs, check_weights, compiled_entry_graph, compiled_entry_graph_with,
    compiled_graph_kind, decoder_entries, entry_graph, Entry, GraphKind, RuntimeError,
    COMPILED_ENTRIES,
};
