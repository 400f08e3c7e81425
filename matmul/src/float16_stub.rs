//! The 16-bit float kernels' interface where they cannot run (their module is written for x86-64
//! under Linux: AMX tiles, whose state is requested from Linux, and AVX-512's
//! `VDPBF16PS`): the products are never available, and nothing here is reached.
#![allow(dead_code)] // The real module's interface, which only its callers there read.

use crate::Kernel16;
pub use crate::{Epilogue, Member};

const WHY: &str = "kiln's bf16 products run only on x86-64 CPUs under Linux";

pub fn kernel() -> Result<Kernel16, String> {
    Err(WHY.to_string())
}

pub fn tiles_available() -> Result<(), &'static str> {
    Err(WHY)
}

pub fn dot_available() -> Result<(), &'static str> {
    Err(WHY)
}

pub fn half_available() -> Result<(), &'static str> {
    Err(WHY)
}

/// Never made: no kernel is available.
pub struct PackedRhs;

impl PackedRhs {
    /// # Safety
    /// Never called: no kernel is available.
    pub unsafe fn new(_: Kernel16, _: (usize, usize), _: crate::Mat) -> PackedRhs {
        unreachable!("bf16 products are only set where a bf16 kernel is available")
    }

    pub fn is(&self, _: Kernel16, _: (usize, usize)) -> bool {
        false
    }

    pub fn bytes(&self) -> usize {
        0
    }
}

#[derive(Clone, Copy)]
pub enum Rhs<'a> {
    Mat(crate::Mat),
    Packed(&'a PackedRhs, crate::Mat),
}

/// # Safety
/// Never called: no kernel is available.
pub unsafe fn gemm_group(_: Kernel16, _: (usize, usize), _: crate::Mat, _: &[Member<'_>]) {
    unreachable!("bf16 products are only set where a bf16 kernel is available")
}

/// # Safety
/// Never called: no kernel is available.
pub unsafe fn gemm(_: Kernel16, _: (usize, usize), _: crate::Mat, _: Member<'_>) {
    unreachable!("bf16 products are only set where a bf16 kernel is available")
}
