//! kiln-ir: the tensor graph IR that the DSL elaborates into and the compiler transforms.
//! It has no dependencies on the optimizer or the code generators, so the DSL builds
//! without egg or Cranelift.
//!
//! Modules:
//! - [`shape`] — symbolic dims and shapes;
//! - [`ir`] — the graph of primitives, built node by node with [`infer`] checking types;
//! - [`printer`] — the deterministic text form;
//! - [`summary`] — what `kiln check` reports.

mod dedup;
pub mod infer;
pub mod ir;
pub mod printer;
pub mod shape;
pub mod summary;

pub use ir::{DType, Graph, IrError, Node, NodeId, Op, TensorType};
pub use shape::{Dim, Shape};
