//! kiln's CPU matrix products, the kernels its compiled executor calls for `matmul` and
//! `linear`:
//!
//! - [`gemm_one`] (`f32.rs`): f32 products through the `gemm` crate; a transposed right
//!   operand of a large product is copied row-major first (`transpose.rs`), and a small
//!   single-threaded one runs on AVX-512F or AVX2 registers (`small.rs`), and
//!   [`gemm_rows`] runs many products of one row together (`small/one_row.rs`: decoding's
//!   attention, one query a head);
//! - [`float16`]: 16-bit float operands and f32 sums: AMX tiles (`amx.rs`), AVX-512's
//!   `VDPBF16PS` (`avx512_bf16.rs`) and AVX512-FP16's `VFMADD231PH` (`avx512_fp16.rs`),
//!   sharing their rounding, packing and driver;
//! - [`int16`]: int16 operands and int32 sums on AVX2's `VPMADDWD` (`avx2.rs`), sharing
//!   the float16 driver's interface;
//! - [`int8`]: int8 operands and int32 sums for inference, on AVX-512 VNNI
//!   (`avx512_vnni.rs`), AVX-VNNI (`avx_vnni.rs`) or AVX2 (`avx2.rs`);
//! - [`Kernel16`] (`kernel.rs`): which of the 16-bit kernels this CPU runs, and
//!   [`matmul16`], a safe product on slices.
//!
//! No well-kept crate has the 16-bit kernels on stable Rust, so they are written here by
//! hand, one file per instruction family, and tested against exact references
//! (`float16/tests.rs`, `int16/tests.rs`). Every result element is summed in the same
//! order whatever the threads: a product gives the same bits on every run.

mod f32;
mod kernel;
mod mat;
#[cfg(test)]
mod testing;
mod transpose;

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub mod float16;
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
#[path = "float16_stub.rs"]
pub mod float16;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub mod int16;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub mod int8;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub mod small;

pub use f32::{gemm_one, gemm_rows, parallelism, RowProduct, PAR_MIN};
pub use kernel::{matmul16, Kernel16};
pub use mat::{ColumnSums, Dst, Epilogue, Mat, Member, SUM_AXES};
