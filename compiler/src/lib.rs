//! kiln-compiler: the tensor graph IR and everything that transforms or runs it.
//!
//! Pipeline order (see `docs/ARCHITECTURE.md`):
//! - [`shape`], [`ir`], [`infer`], [`printer`], [`summary`] — the IR, from `kiln-ir`
//!   (re-exported, so that the passes and their users name one path);
//! - [`init`] and [`rng`] — seeded parameter initialization and the Philox generator;
//! - [`tensor`] — host tensors and their safetensors form;
//! - [`bind`] — checking inputs and parameters against a graph and binding its dims,
//!   shared by every executor;
//! - [`reference`](mod@reference) — the reference executor, the oracle every later path is tested against;
//! - [`autodiff`] — reverse-mode gradients as a graph-to-graph pass, and `train_step`.
//! - [`adam`] — the Adam optimizer update as an `adam_update` graph of primitives;
//! - [`hoist`] — what a decoder step reads of the encoder, moved into `encode`;
//! - [`optimize`] — the e-graph optimizer: a graph in, a kernel graph out;
//! - [`schedule`] — the kernels' launch order;
//! - [`plan`] — the memory plan: buffers, lifetimes, arena slots;
//! - [`fuse`] — the fusions decided after extraction: product groups, bias-gradient
//!   pairs;
//! - [`launch_plan`] — what runs, in order: the contract with the executors;
//! - [`codegen`] — the CPU (CLIF, Cranelift JIT) and CUDA C backends;
//! - [`options`] — the options of a compilation, declared once;
//! - [`pipeline`] — the one driver that runs the passes in order;
//! - [`artifact`] — writing a compiled artifact;
//! - [`memory`] and [`fsync`] — the memory check before large allocations, durable
//!   writes; [`io_error`] — the one error for a failed file operation.

pub mod adam;
pub mod artifact;
pub mod autodiff;
pub mod bind;
pub mod codegen;
pub mod fsync;
pub mod fuse;
pub mod hoist;
pub mod init;
pub mod io_error;
pub mod launch_plan;
pub mod memory;
pub mod optimize;
pub mod options;
pub mod pipeline;
pub mod plan;
pub mod reference;
pub mod rng;
pub mod schedule;
pub mod tensor;

pub use kiln_ir::{infer, ir, printer, shape, summary};
pub use kiln_ir::{DType, Graph, IrError, Node, NodeId, Op, TensorType};
pub use kiln_ir::{Dim, Shape};
