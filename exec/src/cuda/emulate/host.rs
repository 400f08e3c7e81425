//! The emulated device itself (see the parent module): host memory, kernels compiled by
//! the host C++ compiler under the fiber shim, and cuBLAS / cuBLASLt computed on the host.
//! Test support, built with the `emulate` feature only.

use std::collections::BTreeMap;
use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use kiln_compiler::artifact::fnv1a64;
use kiln_compiler::codegen::cuda::host::FIBER_SHIM;
use kiln_compiler::codegen::cuda::Work;

use crate::cuda::abi::{grid, pack_dims, EpiloguePtrs, GemmPtrs, KilnDims, Sgemm};
use crate::cuda::device::{Buf, DeviceApi, GemmElem, GemmElems, GemmMath, Mark, Unit};
use crate::cuda::lt::Epilogue;

use super::{cxx, dry, REFUSE_BIAS_GRADS};

/// Blocks and threads per block of an emulated launch, at most.
const EMU_GRID: u32 = 2;
const EMU_BLOCK: u32 = 32;

/// Live host buffers: start address → length in bytes.
#[derive(Default)]
struct Registry(Mutex<BTreeMap<u64, usize>>);

impl Registry {
    /// Whether `[addr, addr + bytes)` lies inside one live buffer; the error names `what`.
    fn check(&self, addr: u64, bytes: usize, what: &str) -> Result<(), String> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let inside = map
            .range(..=addr)
            .next_back()
            .is_some_and(|(&start, &len)| addr + bytes as u64 <= start + len as u64);
        if inside {
            Ok(())
        } else {
            Err(format!(
                "emulated device: {what} reaches {bytes} bytes at {addr:#x}, outside every \
                 live buffer"
            ))
        }
    }
}

/// A buffer's host memory; unregistered when dropped.
pub(crate) struct HostMem {
    data: Storage,
    registry: Arc<Registry>,
}

/// Zeroed words: on the heap, or in the dry emulation ([`dry`]) an anonymous mapping,
/// whose pages the kernel supplies only when first written (the work that would write
/// them is skipped, so a step's scratch costs the host what a device allocation does,
/// not a memset of it).
enum Storage {
    Heap(Box<[u32]>),
    Map {
        ptr: *mut libc::c_void,
        bytes: usize,
    },
}

// SAFETY: the mapping is owned by its `HostMem` alone, as the boxed slice is.
unsafe impl Send for Storage {}
unsafe impl Sync for Storage {}

impl Storage {
    fn zeroed(words: usize) -> Storage {
        let words = words.max(1);
        if dry() {
            let bytes = 4 * words;
            // SAFETY: a fresh private anonymous mapping (no file, no fixed address).
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if ptr != libc::MAP_FAILED {
                return Storage::Map { ptr, bytes };
            }
        }
        Storage::Heap(vec![0u32; words].into_boxed_slice())
    }

    fn addr(&self) -> u64 {
        match self {
            Storage::Heap(b) => b.as_ptr() as u64,
            Storage::Map { ptr, .. } => *ptr as u64,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Storage::Heap(b) => 4 * b.len(),
            Storage::Map { bytes, .. } => *bytes,
        }
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Storage::Map { ptr, bytes } = *self {
            // SAFETY: the mapping `zeroed` made, unmapped once.
            unsafe { libc::munmap(ptr, bytes) };
        }
    }
}

impl HostMem {
    pub(crate) fn ptr(&self) -> u64 {
        self.data.addr()
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        let mut map = self.registry.0.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(&self.data.addr());
    }
}

/// A trampoline of the compiled library: buffers, packed dims, items, grid, block.
type Trampoline = unsafe extern "C" fn(*const u64, *const KilnDims, i64, u32, u32);

struct HostFunc {
    /// `None` in the dry emulation ([`dry`]), which builds no library.
    call: Option<Trampoline>,
    work: Work,
    params: usize,
}

/// The emulated device (see the module documentation).
pub(crate) struct HostDevice {
    registry: Arc<Registry>,
    /// The loaded functions. Their libraries stay open for the process's lifetime (the
    /// same file opened again shares the handle).
    funcs: BTreeMap<String, HostFunc>,
    math: GemmMath,
}

/// Launches share the shim's globals (grid coordinates, the barrier, `__shared__`
/// statics): one at a time in the process.
static LAUNCH: Mutex<()> = Mutex::new(());

impl HostDevice {
    pub fn new(
        source: &str,
        functions: &[(String, Work, usize)],
        math: GemmMath,
    ) -> Result<HostDevice, String> {
        let mut d = HostDevice {
            registry: Arc::default(),
            funcs: BTreeMap::new(),
            math,
        };
        d.load_source(source, functions)?;
        Ok(d)
    }

    /// Compiles `source` into a library and loads its `functions`.
    fn load_source(
        &mut self,
        source: &str,
        functions: &[(String, Work, usize)],
    ) -> Result<(), String> {
        if let Some((name, _, _)) = functions.iter().find(|f| self.funcs.contains_key(&f.0)) {
            return Err(format!("a function `{name}` is loaded already"));
        }
        if dry() {
            // Nothing runs: the functions' launch parameters are all a launch checks.
            for (name, work, params) in functions {
                let f = HostFunc {
                    call: None,
                    work: *work,
                    params: *params,
                };
                self.funcs.insert(name.clone(), f);
            }
            return Ok(());
        }
        let path = build(source, functions)?;
        let c_path = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| format!("a library path with a NUL: {}", path.display()))?;
        // SAFETY: a valid C string; the library's initializers are the C++ runtime's.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!(
                "emulated device: cannot load {}: {}",
                path.display(),
                dl_error()
            ));
        }
        for (name, work, params) in functions {
            let sym = CString::new(format!("kiln_emu_{name}"))
                .map_err(|_| format!("emulated device: a function name with a NUL: {name:?}"))?;
            // SAFETY: a live handle and a valid C string.
            let f = unsafe { libc::dlsym(handle, sym.as_ptr()) };
            if f.is_null() {
                return Err(format!(
                    "emulated device: no function `{name}` in {}",
                    path.display()
                ));
            }
            self.funcs.insert(
                name.clone(),
                HostFunc {
                    // SAFETY: the symbol is a trampoline generated by `build` with this
                    // signature.
                    call: Some(unsafe { std::mem::transmute::<*mut c_void, Trampoline>(f) }),
                    work: *work,
                    params: *params,
                },
            );
        }
        Ok(())
    }

    fn alloc_mem(&self, words: usize) -> HostMem {
        let data = Storage::zeroed(words);
        let mut map = self.registry.0.lock().unwrap_or_else(|p| p.into_inner());
        map.insert(data.addr(), data.bytes());
        drop(map);
        HostMem {
            data,
            registry: self.registry.clone(),
        }
    }

    /// `grad[i] = Σ_p op(first)[i, p]` for the `m` rows of cuBLAS's first operand.
    fn bias_grad(
        &self,
        g: &Sgemm,
        (first, fe): (u64, GemmElem),
        (grad, ge): (u64, GemmElem),
    ) -> Result<(), String> {
        let (m, k) = (g.m as usize, g.k as usize);
        let [(rows, cols, ld), _, _] = crate::cuda::lt::layouts(g);
        if rows > 0 && cols > 0 {
            let extent = (cols as usize - 1) * ld as usize + rows as usize;
            self.registry.check(
                first,
                extent * size(fe) as usize,
                "the GEMM's first operand",
            )?;
        }
        self.registry
            .check(grad, size(ge) as usize * m, "the GEMM's bias gradient")?;
        if dry() {
            return Ok(());
        }
        let lda = g.lda as usize;
        for i in 0..m {
            let mut acc = 0f64;
            for p in 0..k {
                let idx = if g.transa { p + i * lda } else { i + p * lda };
                // SAFETY: inside the extent checked above.
                acc += f64::from(unsafe { read_elem(first, fe, idx) });
            }
            // SAFETY: `m` elements checked above.
            unsafe { write_elem(grad, ge, i, acc as f32) };
        }
        Ok(())
    }

    fn one_gemm(
        &self,
        g: &Sgemm,
        (first, fe): (u64, GemmElem),
        (second, se): (u64, GemmElem),
        (c, ce): (u64, GemmElem),
        beta: f32,
        epilogue: Option<(u64, bool)>,
    ) -> Result<(), String> {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let [la, lb, lc] = crate::cuda::lt::layouts(g);
        for ((rows, cols, ld), p, el, what) in [
            (la, first, fe, "the GEMM's first operand"),
            (lb, second, se, "the GEMM's second operand"),
            (lc, c, ce, "the GEMM's result"),
        ] {
            if ld < rows.max(1) as i64 {
                return Err(format!(
                    "emulated cuBLAS: {what} has {rows} rows but a leading dimension of {ld} \
                     (CUBLAS_STATUS_INVALID_VALUE)"
                ));
            }
            if rows > 0 && cols > 0 {
                let extent = (cols as usize - 1) * ld as usize + rows as usize;
                self.registry.check(p, extent * size(el) as usize, what)?;
            }
        }
        // The bias has the result's element type (cuBLASLt's default).
        if let Some((bias, _)) = epilogue {
            self.registry
                .check(bias, size(ce) as usize * m, "the GEMM's bias")?;
        }
        if dry() {
            return Ok(());
        }
        let tf32 = self.math == GemmMath::Tf32;
        let load = |p: u64, el: GemmElem, idx: usize| -> f64 {
            // SAFETY: every index below lies in the extent checked above.
            let v = unsafe { read_elem(p, el, idx) };
            f64::from(if tf32 && el == GemmElem::F32 {
                round_tf32(v)
            } else {
                v
            })
        };
        let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
        let mut out = vec![0f32; m * n];
        {
            use rayon::prelude::*;
            out.par_chunks_mut(m.max(1))
                .enumerate()
                .for_each(|(j, col)| {
                    for (i, o) in col.iter_mut().enumerate() {
                        let mut acc = 0f64;
                        for p in 0..k {
                            let x = if g.transa {
                                load(first, fe, p + i * lda)
                            } else {
                                load(first, fe, i + p * lda)
                            };
                            let y = if g.transb {
                                load(second, se, j + p * ldb)
                            } else {
                                load(second, se, p + j * ldb)
                            };
                            acc += x * y;
                        }
                        *o = acc as f32;
                    }
                });
        }
        for j in 0..n {
            for i in 0..m {
                let at = i + j * ldc;
                let mut v = out[i + j * m];
                if beta != 0.0 {
                    // SAFETY: inside the result's checked extent.
                    v += beta * unsafe { read_elem(c, ce, at) };
                }
                if let Some((bias, relu)) = epilogue {
                    // SAFETY: `m` elements checked above.
                    v += unsafe { read_elem(bias, ce, i) };
                    if relu {
                        v = v.max(0.0);
                    }
                }
                // SAFETY: inside the result's checked extent.
                unsafe { write_elem(c, ce, at, v) };
            }
        }
        Ok(())
    }
}

impl DeviceApi for HostDevice {
    fn load_module(
        &mut self,
        unit: Unit,
        functions: &[(String, Work, usize)],
    ) -> Result<(), String> {
        match unit {
            Unit::Host(source) => self.load_source(&source, functions),
            Unit::Ptx(_) => Err("internal: a unit compiled for another device".into()),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.funcs.contains_key(name)
    }

    fn bind(&self) -> Result<(), String> {
        Ok(())
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        None
    }

    fn alloc(&self, words: usize) -> Result<Buf, String> {
        Ok(Buf::host(self.alloc_mem(words), words))
    }

    fn alloc_uninit(&self, words: usize) -> Result<Buf, String> {
        self.alloc(words)
    }

    fn write(&self, dst: u64, words: &[u32]) -> Result<(), String> {
        self.registry
            .check(dst, 4 * words.len(), "a host-to-device copy")?;
        // SAFETY: checked to lie inside a live buffer, which `words` (host memory the
        // caller borrows) cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), dst as *mut u32, words.len()) };
        Ok(())
    }

    fn write_enqueued(&self, dst: u64, words: &[u32]) -> Result<(), String> {
        self.write(dst, words)
    }

    fn read(&self, src: u64, n: usize) -> Result<Vec<u32>, String> {
        self.registry.check(src, 4 * n, "a device-to-host copy")?;
        let mut out = vec![0u32; n];
        // SAFETY: checked to lie inside a live buffer.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u32, out.as_mut_ptr(), n) };
        Ok(out)
    }

    fn zero(&self, dst: u64, words: usize) -> Result<(), String> {
        self.registry.check(dst, 4 * words, "a memset")?;
        if dry() {
            return Ok(());
        }
        // SAFETY: checked to lie inside a live buffer.
        unsafe { std::ptr::write_bytes(dst as *mut u32, 0, words) };
        Ok(())
    }

    fn copy_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<(), String> {
        self.registry
            .check(dst, bytes, "a device-to-device copy's destination")?;
        self.registry
            .check(src, bytes, "a device-to-device copy's source")?;
        if dry() {
            return Ok(());
        }
        // SAFETY: both checked to lie inside live buffers; `copy` allows overlap, as
        // `cuMemcpyDtoD` does not promise to.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    #[cfg(feature = "nccl")]
    fn stream(&self) -> Result<std::sync::Arc<cudarc::driver::CudaStream>, String> {
        Err("NCCL needs GPUs: the emulated device has no stream".into())
    }

    #[cfg(feature = "nccl")]
    fn all_reduce_sum(&self, _: &cudarc::nccl::Comm, _: &mut Buf) -> Result<(), String> {
        Err("NCCL needs GPUs, not the emulated device".to_string())
    }

    fn sync(&self) -> Result<(), String> {
        Ok(())
    }

    fn mark(&self) -> Result<Mark, String> {
        Ok(Mark::Host(std::time::Instant::now()))
    }

    fn launch(&self, name: &str, ptrs: &[u64], dims: &[i64], items: usize) -> Result<(), String> {
        let func = crate::cuda::device::launchable(&self.funcs, name, ptrs.len(), |f| f.params)?;
        let Some((g, b)) = grid(func.work, items) else {
            return Ok(());
        };
        for (k, &p) in ptrs.iter().enumerate() {
            self.registry
                .check(p, 0, &format!("buffer {k} of a launch of `{name}`"))?;
        }
        let packed = pack_dims(dims).map_err(|e| format!("`{name}`: {e}"))?;
        let Some(call) = func.call.filter(|_| !dry()) else {
            return Ok(());
        };
        let _one = LAUNCH.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the trampoline casts each pointer to its parameter's type and runs
        // the kernel over host memory the pointers address (checked above to start
        // inside live buffers; the kernels' own bounds are the launch ABI's).
        unsafe {
            call(
                ptrs.as_ptr(),
                &packed,
                items as i64,
                g.min(EMU_GRID),
                b.min(EMU_BLOCK),
            )
        };
        Ok(())
    }

    /// `cublasSgemm` / `cublasGemmEx` (strided-batched with `batch`): see the module
    /// documentation. `first` is cuBLAS's first operand (`b` of the row-major product).
    fn gemm_checked(&self, g: &Sgemm, (elem, out): GemmElems, p: GemmPtrs) -> Result<(), String> {
        let (count, sa, sb, sc) = p.batch.unwrap_or((1, 0, 0, 0));
        for i in 0..count as i64 {
            let at = |x: u64, stride: i64, el: GemmElem| x + (i * stride) as u64 * size(el);
            self.one_gemm(
                g,
                (at(p.b, sb, elem), elem),
                (at(p.a, sa, elem), elem),
                (at(p.c, sc, out), out),
                p.beta,
                None,
            )?;
        }
        Ok(())
    }

    /// cuBLASLt's `D = op(A)·op(B)` with `epilogue`: `+ bias` (then ReLU), the bias of
    /// the result's type; or the bias gradient `Σ_k op(A)[i, k]` into `bias`, in f64 and
    /// rounded once to its type. With [`REFUSE_BIAS_GRAD_ENV`] set, a bias gradient has no
    /// algorithm (`Ok(false)`, nothing done), as on a GPU whose cuBLASLt lacks one.
    fn gemm_epilogue_checked(
        &self,
        g: &Sgemm,
        (elem, out): GemmElems,
        p: EpiloguePtrs,
        epilogue: Epilogue,
    ) -> Result<bool, String> {
        let (a, b, c, bias) = (p.a, p.b, p.c, p.vector);
        if let Epilogue::BiasGradA { bf16 } = epilogue {
            if REFUSE_BIAS_GRADS.load(Ordering::Relaxed) {
                return Ok(false);
            }
            let grad = if bf16 { GemmElem::Bf16 } else { GemmElem::F32 };
            self.bias_grad(g, (b, elem), (bias, grad))?;
            self.one_gemm(g, (b, elem), (a, elem), (c, out), 0.0, None)?;
        } else {
            let relu = epilogue == Epilogue::ReluBias;
            self.one_gemm(g, (b, elem), (a, elem), (c, out), 0.0, Some((bias, relu)))?;
        }
        Ok(true)
    }
}

fn size(el: GemmElem) -> u64 {
    match el {
        GemmElem::F32 => 4,
        GemmElem::Bf16 => 2,
    }
}

/// # Safety
/// `p` must address element `idx` of its type.
unsafe fn read_elem(p: u64, el: GemmElem, idx: usize) -> f32 {
    match el {
        GemmElem::F32 => unsafe { *(p as *const f32).add(idx) },
        GemmElem::Bf16 => half::bf16::from_bits(unsafe { *(p as *const u16).add(idx) }).to_f32(),
    }
}

/// # Safety
/// `p` must address element `idx` of its type.
unsafe fn write_elem(p: u64, el: GemmElem, idx: usize, v: f32) {
    match el {
        GemmElem::F32 => unsafe { *(p as *mut f32).add(idx) = v },
        GemmElem::Bf16 => unsafe { *(p as *mut u16).add(idx) = half::bf16::from_f32(v).to_bits() },
    }
}

/// `v` with its mantissa rounded to TF32's 10 bits (nearest, ties away; NaN and the
/// infinities as they are).
fn round_tf32(v: f32) -> f32 {
    if !v.is_finite() {
        return v;
    }
    f32::from_bits((v.to_bits() + 0x1000) & !0x1fff)
}

fn dl_error() -> String {
    // SAFETY: `dlerror` returns NULL or a C string valid until the next dl call.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: a valid C string (above).
        unsafe { std::ffi::CStr::from_ptr(e) }
            .to_string_lossy()
            .into_owned()
    }
}

/// The trampolines' helper: casts the buffers to the kernel's parameter types.
const CALL: &str = r#"
#include <cstddef>
#include <tuple>
#include <utility>
template <class... A, std::size_t... I>
static void kiln_emu_call_at(void (*f)(A...), const unsigned long long* b, kiln_dims d,
                             long long items, std::index_sequence<I...>) {
    f(reinterpret_cast<std::tuple_element_t<I, std::tuple<A...>>>(b[I])..., d, items);
}
template <class... A>
static void kiln_emu_call(void (*f)(A...), const unsigned long long* b, kiln_dims d,
                          long long items) {
    kiln_emu_call_at(f, b, d, items, std::make_index_sequence<sizeof...(A) - 2>{});
}
"#;

/// The library of `source`'s `functions` (compiled once per source: cached by hash).
fn build(source: &str, functions: &[(String, Work, usize)]) -> Result<PathBuf, String> {
    let mut text = format!("{FIBER_SHIM}\n{source}\n{CALL}\n");
    for (name, _, _) in functions {
        text.push_str(&format!(
            "extern \"C\" void kiln_emu_{name}(const unsigned long long* b, const kiln_dims* d, \
             long long items, unsigned grid, unsigned block) {{\n    kiln_dims dims = *d;\n    \
             kiln_launch(grid, block, [&]() {{ kiln_emu_call({name}, b, dims, items); }});\n}}\n"
        ));
    }
    let cxx = cxx();
    let dir = std::env::temp_dir().join("kiln-cuda-emulate");
    std::fs::create_dir_all(&dir)
        .map_err(|e| format!("emulated device: cannot create {}: {e}", dir.display()))?;
    let key = format!("{:016x}-{}", fnv1a64(text.as_bytes()), text.len());
    let lib = dir.join(format!("{key}.so"));
    if lib.exists() {
        // Marks it used, so that pruning keeps it.
        if let Ok(f) = std::fs::File::options().append(true).open(&lib) {
            let _ = f.set_modified(std::time::SystemTime::now());
        }
        return Ok(lib);
    }
    prune(&dir, CACHE_DAYS);
    let unique = format!(
        "{key}.{}.{:?}",
        std::process::id(),
        std::thread::current().id()
    )
    .replace(
        |c: char| !c.is_ascii_alphanumeric() && c != '.' && c != '-',
        "_",
    );
    let src = dir.join(format!("{unique}.cpp"));
    let tmp = dir.join(format!("{unique}.so.tmp"));
    std::fs::write(&src, &text)
        .map_err(|e| format!("emulated device: cannot write {}: {e}", src.display()))?;
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w"])
        .arg(&src)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("emulated device: cannot run `{cxx}` (set CXX): {e}"))?;
    let _ = std::fs::remove_file(&src);
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!(
            "emulated device: `{cxx}` cannot compile the unit:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    rename_into(&tmp, &lib)?;
    Ok(lib)
}

/// Days a cached library unused (by modification time, which a cache hit renews) is
/// kept: every change to the kernels' text makes a new one.
const CACHE_DAYS: u64 = 14;

/// Removes the libraries (and stray temporaries) of `dir` not used for `days` days. A
/// process that has one loaded keeps its mapping.
fn prune(dir: &Path, days: u64) {
    let Some(cutoff) =
        std::time::SystemTime::now().checked_sub(std::time::Duration::from_secs(days * 86_400))
    else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let stale = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t < cutoff);
        if stale
            && e.path()
                .extension()
                .is_some_and(|x| x == "so" || x == "tmp" || x == "cpp")
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn rename_into(tmp: &Path, lib: &Path) -> Result<(), String> {
    std::fs::rename(tmp, lib).map_err(|e| {
        format!(
            "emulated device: cannot move {} into place: {e}",
            tmp.display()
        )
    })
}

#[cfg(test)]
mod tests;
