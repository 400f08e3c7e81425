//! The bf16 kernels' interface where they cannot run (their module is written for x86-64
//! under Linux: AMX tiles, whose state is requested from Linux, and AVX-512's
//! `VDPBF16PS`): the products are never available, and nothing here is reached.
#![allow(dead_code)] // The real module's interface, which only its callers there read.

pub(crate) use super::gemm::{Epilogue, Member};
pub(crate) use super::Bf16Kernel as Kernel;

const WHY: &str = "kiln's bf16 products run only on x86-64 CPUs under Linux";

pub(crate) fn kernel() -> Result<Kernel, String> {
    Err(WHY.to_string())
}

pub(crate) fn tiles_available() -> Result<(), &'static str> {
    Err(WHY)
}

pub(crate) fn dot_available() -> Result<(), &'static str> {
    Err(WHY)
}

pub(crate) fn half_available() -> Result<(), &'static str> {
    Err(WHY)
}

/// Never made: no kernel is available.
pub(crate) struct PackedRhs;

impl PackedRhs {
    /// # Safety
    /// Never called: no kernel is available.
    pub(crate) unsafe fn new(_: Kernel, _: (usize, usize), _: super::gemm::Mat) -> PackedRhs {
        unreachable!("bf16 products are only set where a bf16 kernel is available")
    }

    pub(crate) fn is(&self, _: Kernel, _: (usize, usize)) -> bool {
        false
    }

    pub(crate) fn bytes(&self) -> usize {
        0
    }
}

#[derive(Clone, Copy)]
pub(crate) enum Rhs<'a> {
    Mat(super::gemm::Mat),
    Packed(&'a PackedRhs, super::gemm::Mat),
}

/// # Safety
/// Never called: no kernel is available.
pub(crate) unsafe fn gemm_group(
    _: Kernel,
    _: (usize, usize),
    _: super::gemm::Mat,
    _: &[Member<'_>],
) {
    unreachable!("bf16 products are only set where a bf16 kernel is available")
}

/// # Safety
/// Never called: no kernel is available.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    _: Kernel,
    _: (usize, usize, usize),
    _: *mut f32,
    _: isize,
    _: super::gemm::Mat,
    _: Rhs<'_>,
    _: bool,
    _: Epilogue,
    _: Option<super::gemm::ColumnSums>,
) {
    unreachable!("bf16 products are only set where a bf16 kernel is available")
}
