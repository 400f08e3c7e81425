//! CPU code generation: kernels of the kernel graph as Cranelift IR (CLIF).
//!
//! In: a [`crate::optimize::KernelGraph`]. Out: CLIF functions, one per distinct kernel
//! body, as deterministic text, plus how each kernel launches them (see [`clif`] for the
//! ABI every function shares).
//!
//! - [`clif`] — the kernel ABI and builder helpers (loops, vectors, reductions);
//! - [`math`] — `exp`, `log`, `sin`, `cos` as polynomials in CLIF;
//! - [`jit`] — CLIF text to machine code for the host (`cranelift_native`, `opt_level =
//!   speed`), and the rayon launcher;
//! - [`cuda`] — the same kernels as CUDA C text (NVRTC at load), with their launch ABI.

pub mod clif;
pub mod cuda;
pub mod jit;
pub mod masks;
pub mod math;
pub mod misc;
pub mod program;
pub mod region;
pub mod rows;
