//! kiln-train: training a model and keeping what it learned.
//!
//! Modules:
//! - [`config`] — the YAML training configuration (the paper's recipe as defaults);
//! - [`data`] — parallel corpora, the shared BPE vocabulary, token-based batches;
//!   [`tokenizer`] — a run's BPE vocabulary and the record of what it was trained on;
//! - [`optim`] — Adam;
//! - [`trainer`] — the trainer; [`divergence`] — when a finite loss has diverged;
//!   [`run_dir`] — whether a directory can take a new run;
//! - [`checkpoint`] — atomic checkpoint directories, keep-last-k, averaging;
//!   [`checksums`] — the SHA-256 record of a checkpoint's or a model directory's files;
//! - [`model`] — model directories (weights, graphs, tokenizer) used without the spec;
//! - [`metrics`] — the `metrics.jsonl` log; [`plot`] — the loss/BLEU PNG;
//! - [`interop`] — PyTorch `nn.Transformer` parameter names;
//! - [`synthetic`] — the generated task of the demo.

pub mod checkpoint;
pub mod checksums;
pub mod config;
pub mod data;
pub mod divergence;
pub mod interop;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod plot;
pub mod run_dir;
pub mod synthetic;
pub mod tokenizer;
pub mod trainer;
