//! One GPU as the CUDA executor uses it: a context and its default stream, the entry's
//! module compiled by NVRTC, cuBLAS, device buffers, raw launches and copies.
//!
//! In: the entry's CUDA C (one unit), the manifest's NVRTC options and function list.
//! Out: [`Device`] — everything later calls need. Only built after
//! [`super::cuda_available`] said yes: cudarc panics on a missing library.
//!
//! Everything runs on one stream, in order; host copies synchronize it. Device pointers
//! are plain `CUdeviceptr`s (`u64`) into [`Buf`]s that the caller keeps alive until the
//! stream has finished with them.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use kiln_compiler::codegen::cuda::Work;

use super::abi::{EpiloguePtrs, GemmPtrs, Sgemm};

mod gpu;
mod nvrtc;

#[cfg(feature = "emulate")]
use super::emulate::{HostDevice, HostMem};
use super::lt::Epilogue;
use gpu::*;
pub(crate) use nvrtc::*;

/// A device buffer of 4-byte words and its address.
pub(crate) struct Buf {
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    owner: Owner,
    pub ptr: u64,
    pub words: usize,
}

/// What keeps a buffer's memory alive (freed when dropped; only NCCL reads it).
#[allow(dead_code)]
enum Owner {
    Gpu(CudaSlice<u32>),
    #[cfg(feature = "emulate")]
    Host(HostMem),
}

/// cuBLAS's math mode ([`Device::new`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemmMath {
    F32,
    Tf32,
    Bf16,
}

/// The element type of GEMM operands ([`Device::gemm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemmElem {
    F32,
    Bf16,
}

/// The element types of a GEMM's operands and of its result.
pub(crate) type GemmElems = (GemmElem, GemmElem);

/// A loaded generated function.
struct Func {
    f: cudarc::driver::CudaFunction,
    work: Work,
    params: usize,
}

/// One GPU, or its host emulation ([`super::emulate`], `KILN_CUDA_EMULATE=1`): what
/// [`DeviceApi`] offers, through the device of the unit it was made from.
pub(crate) struct Device(Box<dyn DeviceApi + Send + Sync>);

/// A compiled unit: PTX for a GPU, or the CUDA C itself for the host emulation.
pub(crate) enum Unit {
    Ptx(Ptx),
    #[cfg(feature = "emulate")]
    Host(String),
}

pub(crate) struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// The entry's module, then any loaded later ([`Device::load_module`]).
    modules: Vec<Arc<CudaModule>>,
    funcs: BTreeMap<String, Func>,
    /// Page-locked host memory that large copies go through (allocated on first use).
    staging: std::sync::Mutex<Option<Staging>>,
    /// The GEMM precision (for cuBLASLt's plans).
    math: GemmMath,
    /// cuBLASLt, for GEMMs with a bias epilogue (made on first use).
    lt: std::sync::Mutex<Option<super::lt::Lt>>,
}

fn drv<E: std::fmt::Debug>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

/// Function `name` of `funcs` for a launch with `given` buffers (`params`: how many it
/// takes), or the error that names what is wrong.
pub(crate) fn launchable<'a, F>(
    funcs: &'a BTreeMap<String, F>,
    name: &str,
    given: usize,
    params: impl Fn(&F) -> usize,
) -> Result<&'a F, String> {
    let func = funcs
        .get(name)
        .ok_or_else(|| format!("the module has no function `{name}`"))?;
    if given != params(func) {
        return Err(format!(
            "`{name}` takes {} buffers, {given} given",
            params(func)
        ));
    }
    Ok(func)
}

/// A point in a device's stream ([`Device::mark`]).
pub enum Mark {
    Gpu(cudarc::driver::CudaEvent),
    #[cfg(feature = "emulate")]
    Host(std::time::Instant),
}

impl Mark {
    /// Seconds from `self` to `later`, once the device has reached both (after a
    /// [`Device::sync`]); negative if `later` was reached first.
    pub fn seconds_to(&self, later: &Mark) -> Result<f64, String> {
        match (self, later) {
            (Mark::Gpu(a), Mark::Gpu(b)) => a
                .elapsed_ms(b)
                .map(|ms| f64::from(ms) / 1e3)
                .map_err(drv("cannot time two CUDA events")),
            #[cfg(feature = "emulate")]
            (Mark::Host(a), Mark::Host(b)) => Ok(match b.checked_duration_since(*a) {
                Some(d) => d.as_secs_f64(),
                None => -a.duration_since(*b).as_secs_f64(),
            }),
            #[cfg(feature = "emulate")]
            _ => Err("internal: marks of two kinds of device".to_string()),
        }
    }
}

impl Device {
    /// Device `ordinal` with `unit` loaded (see [`Gpu::new`]); a host unit makes the
    /// emulated device (the ordinal is then 0, the only one).
    pub fn new(
        ordinal: usize,
        unit: Unit,
        functions: &[(String, Work, usize)],
        gemm: GemmMath,
    ) -> Result<Device, String> {
        Ok(Device(match unit {
            Unit::Ptx(ptx) => Box::new(Gpu::new(ordinal, ptx, functions, gemm)?),
            #[cfg(feature = "emulate")]
            Unit::Host(source) => Box::new(HostDevice::new(&source, functions, gemm)?),
        }))
    }
}

impl std::ops::Deref for Device {
    type Target = dyn DeviceApi + Send + Sync;

    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl std::ops::DerefMut for Device {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut *self.0
    }
}

/// What the CUDA executor asks of a device: implemented by a GPU ([`Gpu`]) and by its
/// host emulation. Everything runs on one stream, in order.
pub(crate) trait DeviceApi {
    /// Loads another compiled unit (of this device's kind) and adds its `functions`
    /// (names must not clash with those already loaded).
    fn load_module(
        &mut self,
        unit: Unit,
        functions: &[(String, Work, usize)],
    ) -> Result<(), String>;

    /// Whether a function `name` is loaded.
    fn has(&self, name: &str) -> bool;

    /// Makes the device current on the calling thread (runs may come from any thread).
    fn bind(&self) -> Result<(), String>;

    /// Free and total bytes of the device's memory (the GPU's, bound to this thread), or
    /// `None` for the emulated device, whose memory is the host's.
    fn memory_info(&self) -> Option<(usize, usize)>;

    /// `words` zeroed 4-byte words (at least one).
    fn alloc(&self, words: usize) -> Result<Buf, String>;

    /// `words` 4-byte words (at least one) that the next launch writes whole: not
    /// zeroed on a GPU (no memset), zeroed memory on the emulated device.
    fn alloc_uninit(&self, words: usize) -> Result<Buf, String>;

    /// Copies `words` to `dst` and waits for the copy.
    fn write(&self, dst: u64, words: &[u32]) -> Result<(), String>;

    /// Copies `words` to `dst` in stream order, without waiting for the copy (see
    /// [`Gpu`]'s; the emulation copies at once).
    fn write_enqueued(&self, dst: u64, words: &[u32]) -> Result<(), String>;

    /// `n` words at `src`, after everything queued before.
    fn read(&self, src: u64, n: usize) -> Result<Vec<u32>, String>;

    /// Zeroes `words` words at `dst`.
    fn zero(&self, dst: u64, words: usize) -> Result<(), String>;

    /// Copies `bytes` bytes device to device.
    fn copy_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<(), String>;

    /// The GPU's stream (NCCL communicators are made on it); none for the emulation.
    #[cfg(feature = "nccl")]
    fn stream(&self) -> Result<Arc<CudaStream>, String>;

    /// Sums `buf` over the communicator's devices, in place.
    #[cfg(feature = "nccl")]
    fn all_reduce_sum(&self, comm: &cudarc::nccl::Comm, buf: &mut Buf) -> Result<(), String>;

    /// Waits for everything queued (the emulation runs each call to its end).
    fn sync(&self) -> Result<(), String>;

    /// A point in the device's stream, for profiles, taken without waiting: a timed
    /// CUDA event the GPU reaches when the work queued before it is done, or on the
    /// emulated device (which runs each call as it is made) the host's clock.
    fn mark(&self) -> Result<Mark, String>;

    /// Launches generated function `name` over `items` work items with the buffers
    /// `ptrs` and `dims`.
    fn launch(&self, name: &str, ptrs: &[u64], dims: &[i64], items: usize) -> Result<(), String>;

    /// Row-major `C = A·B (+ beta·C)` per [`Sgemm`] where `p` says, the operands of
    /// element type `elems.0` and the result of `elems.1` (checked by [`check_elems`]).
    fn gemm(&self, g: &Sgemm, elems: GemmElems, p: GemmPtrs) -> Result<(), String> {
        check_elems(elems)?;
        self.gemm_checked(g, elems, p)
    }

    /// [`DeviceApi::gemm`] once its element types are checked.
    fn gemm_checked(&self, g: &Sgemm, elems: GemmElems, p: GemmPtrs) -> Result<(), String>;

    /// Row-major `c = a·b` in one cuBLASLt call with `epilogue` (`g` as for
    /// [`DeviceApi::sgemm`], `c` of element type `elems.1`, the vector one element per
    /// output column: a bias of the result's type, or the bias gradient it receives).
    /// `Ok(false)` when cuBLASLt has no algorithm for it: nothing was launched, and the
    /// caller runs the separate kernels.
    fn gemm_epilogue(
        &self,
        g: &Sgemm,
        elems: GemmElems,
        p: EpiloguePtrs,
        epilogue: Epilogue,
    ) -> Result<bool, String> {
        check_elems(elems)?;
        self.gemm_epilogue_checked(g, elems, p, epilogue)
    }

    /// [`DeviceApi::gemm_epilogue`] once its element types are checked.
    fn gemm_epilogue_checked(
        &self,
        g: &Sgemm,
        elems: GemmElems,
        p: EpiloguePtrs,
        epilogue: Epilogue,
    ) -> Result<bool, String>;

    /// An f32 [`DeviceApi::gemm`].
    fn sgemm(&self, g: &Sgemm, p: GemmPtrs) -> Result<(), String> {
        self.gemm(g, (GemmElem::F32, GemmElem::F32), p)
    }

    /// A fresh buffer holding `words`.
    fn upload(&self, words: &[u32]) -> Result<Buf, String> {
        let b = self.alloc(words.len())?;
        self.write(b.ptr, words)?;
        Ok(b)
    }

    /// [`DeviceApi::gemm_epilogue`] with a bias (then ReLU with `relu`) of the result's
    /// type.
    fn gemm_bias(
        &self,
        g: &Sgemm,
        elems: GemmElems,
        p: EpiloguePtrs,
        relu: bool,
    ) -> Result<bool, String> {
        let epilogue = if relu {
            Epilogue::ReluBias
        } else {
            Epilogue::Bias
        };
        self.gemm_epilogue(g, elems, p, epilogue)
    }

    /// Row-major `c = a·b` whose cuBLAS first operand (`b`, `g.m × g.k` as read) is also
    /// summed along `k` into the vector (`g.m` elements, bf16 where `grad_bf16`, else
    /// f32): the weight gradient and the bias gradient of a linear layer from one read of
    /// the output gradient. `Ok(false)`: cuBLASLt has no algorithm for it (nothing
    /// launched).
    fn gemm_bias_grad(
        &self,
        g: &Sgemm,
        elems: GemmElems,
        p: EpiloguePtrs,
        grad_bf16: bool,
    ) -> Result<bool, String> {
        self.gemm_epilogue(g, elems, p, Epilogue::BiasGradA { bf16: grad_bf16 })
    }
}

/// The element types of a GEMM's operands and result, unless f32 operands go into a
/// bf16 result (no device call does that).
fn check_elems((elem, out): GemmElems) -> Result<(), String> {
    if elem == GemmElem::F32 && out != GemmElem::F32 {
        return Err("internal: an f32 GEMM into a bf16 result".to_string());
    }
    Ok(())
}

impl Buf {
    /// A buffer of the emulated device.
    #[cfg(feature = "emulate")]
    pub(crate) fn host(mem: HostMem, words: usize) -> Buf {
        Buf {
            ptr: mem.ptr(),
            owner: Owner::Host(mem),
            words,
        }
    }
}
