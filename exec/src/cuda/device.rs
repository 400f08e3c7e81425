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

use super::abi::{GemmPtrs, Sgemm};

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

/// A loaded generated function.
struct Func {
    f: cudarc::driver::CudaFunction,
    work: Work,
    params: usize,
}

/// One GPU, or its host emulation ([`super::emulate`], `KILN_CUDA_EMULATE=1`).
pub(crate) enum Device {
    Gpu(Box<Gpu>),
    #[cfg(feature = "emulate")]
    Host(HostDevice),
}

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
        match unit {
            Unit::Ptx(ptx) => Ok(Device::Gpu(Box::new(Gpu::new(
                ordinal, ptx, functions, gemm,
            )?))),
            #[cfg(feature = "emulate")]
            Unit::Host(source) => Ok(Device::Host(HostDevice::new(&source, functions, gemm)?)),
        }
    }

    /// See [`Gpu::load_module`].
    pub fn load_module(
        &mut self,
        unit: Unit,
        functions: &[(String, Work, usize)],
    ) -> Result<(), String> {
        match (self, unit) {
            (Device::Gpu(g), Unit::Ptx(ptx)) => g.load_module(ptx, functions),
            #[cfg(feature = "emulate")]
            (Device::Host(h), Unit::Host(source)) => h.load_module(&source, functions),
            #[cfg(feature = "emulate")]
            _ => Err("internal: a unit compiled for another device".to_string()),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        match self {
            Device::Gpu(g) => g.has(name),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.has(name),
        }
    }

    /// See [`Gpu::bind`] (nothing to do on the host).
    pub fn bind(&self) -> Result<(), String> {
        match self {
            Device::Gpu(g) => g.bind(),
            #[cfg(feature = "emulate")]
            Device::Host(_) => Ok(()),
        }
    }

    /// Free and total bytes of the device's memory (the GPU's, bound to this thread), or
    /// `None` for the emulated device, whose memory is the host's.
    pub fn memory_info(&self) -> Option<(usize, usize)> {
        match self {
            Device::Gpu(g) => {
                g.bind().ok()?;
                cudarc::driver::result::mem_get_info().ok()
            }
            #[cfg(feature = "emulate")]
            Device::Host(_) => None,
        }
    }

    /// `words` 4-byte words (at least one) that the next launch writes whole: not
    /// zeroed on a GPU (no memset), zeroed memory on the emulated device.
    pub fn alloc_uninit(&self, words: usize) -> Result<Buf, String> {
        match self {
            Device::Gpu(g) => g.alloc_uninit(words),
            #[cfg(feature = "emulate")]
            Device::Host(_) => self.alloc(words),
        }
    }

    /// `words` zeroed 4-byte words (at least one).
    pub fn alloc(&self, words: usize) -> Result<Buf, String> {
        match self {
            Device::Gpu(g) => g.alloc(words),
            #[cfg(feature = "emulate")]
            Device::Host(h) => {
                let mem = h.alloc(words);
                Ok(Buf {
                    ptr: mem.ptr(),
                    owner: Owner::Host(mem),
                    words,
                })
            }
        }
    }

    /// A fresh buffer holding `words`.
    pub fn upload(&self, words: &[u32]) -> Result<Buf, String> {
        let b = self.alloc(words.len())?;
        self.write(b.ptr, words)?;
        Ok(b)
    }

    /// Copies `words` to `dst` and waits for the copy.
    pub fn write(&self, dst: u64, words: &[u32]) -> Result<(), String> {
        match self {
            Device::Gpu(g) => g.write(dst, words),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.write(dst, words),
        }
    }

    /// See [`Gpu::write_enqueued`] (the emulation copies at once).
    pub fn write_enqueued(&self, dst: u64, words: &[u32]) -> Result<(), String> {
        match self {
            Device::Gpu(g) => g.write_enqueued(dst, words),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.write(dst, words),
        }
    }

    /// `n` words at `src`, after everything queued before.
    pub fn read(&self, src: u64, n: usize) -> Result<Vec<u32>, String> {
        match self {
            Device::Gpu(g) => g.read(src, n),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.read(src, n),
        }
    }

    /// Zeroes `words` words at `dst`.
    pub fn zero(&self, dst: u64, words: usize) -> Result<(), String> {
        match self {
            Device::Gpu(g) => g.zero(dst, words),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.zero(dst, words),
        }
    }

    /// Copies `bytes` bytes device to device.
    pub fn copy_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<(), String> {
        match self {
            Device::Gpu(g) => g.copy_bytes(dst, src, bytes),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.copy_bytes(dst, src, bytes),
        }
    }

    /// The GPU's stream (NCCL communicators are made on it); none for the emulation.
    #[cfg(feature = "nccl")]
    pub fn stream(&self) -> Result<Arc<CudaStream>, String> {
        match self {
            Device::Gpu(g) => Ok(g.stream()),
            #[cfg(feature = "emulate")]
            Device::Host(_) => Err("NCCL needs GPUs: the emulated device has no stream".into()),
        }
    }

    /// See [`Gpu::all_reduce_sum`].
    #[cfg(feature = "nccl")]
    pub fn all_reduce_sum(&self, comm: &cudarc::nccl::Comm, buf: &mut Buf) -> Result<(), String> {
        match self {
            Device::Gpu(g) => g.all_reduce_sum(comm, buf),
            #[cfg(feature = "emulate")]
            Device::Host(_) => Err("NCCL needs GPUs, not the emulated device".to_string()),
        }
    }

    /// Waits for everything queued (the emulation runs each call to its end).
    pub fn sync(&self) -> Result<(), String> {
        match self {
            Device::Gpu(g) => g.sync(),
            #[cfg(feature = "emulate")]
            Device::Host(_) => Ok(()),
        }
    }

    /// A point in the device's stream, for profiles, taken without waiting: a timed
    /// CUDA event the GPU reaches when the work queued before it is done, or on the
    /// emulated device (which runs each call as it is made) the host's clock.
    pub fn mark(&self) -> Result<Mark, String> {
        match self {
            Device::Gpu(g) => g.mark(),
            #[cfg(feature = "emulate")]
            Device::Host(_) => Ok(Mark::Host(std::time::Instant::now())),
        }
    }

    /// See [`Gpu::launch`].
    pub fn launch(
        &self,
        name: &str,
        ptrs: &[u64],
        dims: &[i64],
        items: usize,
    ) -> Result<(), String> {
        match self {
            Device::Gpu(g) => g.launch(name, ptrs, dims, items),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.launch(name, ptrs, dims, items),
        }
    }

    /// See [`Gpu::gemm`].
    pub fn gemm(
        &self,
        g: &Sgemm,
        elem: GemmElem,
        out: GemmElem,
        p: GemmPtrs,
    ) -> Result<(), String> {
        if elem == GemmElem::F32 && out != GemmElem::F32 {
            return Err("internal: an f32 GEMM into a bf16 result".to_string());
        }
        match self {
            Device::Gpu(d) => d.gemm(g, elem, out, p),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.gemm(g, elem, out, p),
        }
    }

    /// See [`Gpu::gemm_epilogue`]: a bias (then ReLU with `relu`) of `out`'s type.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bias(
        &self,
        g: &Sgemm,
        elems: (GemmElem, GemmElem),
        a: u64,
        b: u64,
        c: u64,
        bias: u64,
        relu: bool,
    ) -> Result<bool, String> {
        let epilogue = if relu {
            Epilogue::ReluBias
        } else {
            Epilogue::Bias
        };
        self.gemm_epilogue(g, elems, a, b, c, bias, epilogue)
    }

    /// Row-major `c = a·b` whose cuBLAS first operand (`b`, `g.m × g.k` as read) is also
    /// summed along `k` into `grad` (`g.m` elements, bf16 where `grad_bf16`, else f32):
    /// the weight gradient and the bias gradient of a linear layer from one read of the
    /// output gradient. `Ok(false)`: cuBLASLt has no algorithm for it (nothing launched).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bias_grad(
        &self,
        g: &Sgemm,
        elems: (GemmElem, GemmElem),
        a: u64,
        b: u64,
        c: u64,
        grad: u64,
        grad_bf16: bool,
    ) -> Result<bool, String> {
        let epilogue = Epilogue::BiasGradA { bf16: grad_bf16 };
        self.gemm_epilogue(g, elems, a, b, c, grad, epilogue)
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm_epilogue(
        &self,
        g: &Sgemm,
        (elem, out): (GemmElem, GemmElem),
        a: u64,
        b: u64,
        c: u64,
        vector: u64,
        epilogue: Epilogue,
    ) -> Result<bool, String> {
        if elem == GemmElem::F32 && out != GemmElem::F32 {
            return Err("internal: an f32 GEMM into a bf16 result".to_string());
        }
        match self {
            Device::Gpu(d) => d.gemm_epilogue(g, (elem, out), a, b, c, vector, epilogue),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.gemm_epilogue(g, (elem, out), a, b, c, vector, epilogue),
        }
    }

    /// See [`Gpu::sgemm`].
    pub fn sgemm(&self, g: &Sgemm, p: GemmPtrs) -> Result<(), String> {
        match self {
            Device::Gpu(d) => d.sgemm(g, p),
            #[cfg(feature = "emulate")]
            Device::Host(h) => h.gemm(g, GemmElem::F32, GemmElem::F32, p),
        }
    }
}
