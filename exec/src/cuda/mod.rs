//! The CUDA backend's entry gate: whether CUDA can be used on this machine at all.
//!
//! In: nothing (the machine). Out: [`cuda_available`] — `Ok(CudaInfo)` when the driver,
//! NVRTC, cuBLAS and cuBLASLt libraries load and the driver reports at least one device,
//! otherwise `Err` with a sentence naming exactly what is missing.
//!
//! cudarc is built with `dynamic-loading`: nothing links against CUDA, so the workspace
//! builds and its tests run on a machine without the toolkit. The price is that cudarc's
//! wrappers panic when a library or symbol is absent, so **every CUDA call of kiln goes
//! behind this one guard**: it only probes (`is_culib_present` opens and closes each
//! library; the driver calls run under `catch_unwind`), and its answer is computed once per
//! process.
//!
//! Tests that need a GPU start with their helper `require_cuda_or_skip` (built on
//! [`skip_or_fail`]): without CUDA they print
//! `skipped: <reason>` and return early, unless `KILN_REQUIRE_CUDA=1`, in which case a
//! missing GPU fails the test (what a GPU CI runner sets, so that a broken installation
//! cannot pass as a skip).
//!
//! Behind the guard, the CUDA executor ([`CudaExecutor`], [`executor_for`]) runs an entry
//! of a `--target cuda` artifact:
//! - [`abi`] — the launch ABI as pure functions: `kiln_dims` packing, GPU work items,
//!   grids, and row-major GEMMs as column-major cuBLAS calls;
//! - `steps` — what each kernel launches, from the manifest (no GPU needed:
//!   [`launch_plan`]);
//! - `device` — the context, stream, NVRTC module, cuBLAS, buffers, raw launches;
//! - [`executor`] — binding, the device arena at the memory plan's offsets, views, and
//!   each kernel kind's launches;
//! - [`emulate`] — the device emulated on the host (turned on by the command line and the
//!   tests' helpers from `KILN_CUDA_EMULATE=1`), so that all of the above runs in tests
//!   on a machine without a GPU.

pub mod abi;
mod device;
pub mod emulate;
pub mod executor;
mod lt;
pub mod parallel;
pub mod ptx_cache;
mod steps;

use std::sync::OnceLock;

pub use executor::{
    launch_plan, memory_plan, precision_label, program_source, CudaExecError, CudaExecutor,
    CudaOptions, DeviceTensor, MicroOut, ResidentOut, RowsTopK, GPU_IDLE, HOST_ISSUE,
};

/// The environment variable that turns a skipped GPU test into a failure.
pub const REQUIRE_CUDA_ENV: &str = "KILN_REQUIRE_CUDA";

/// What the guard found on a machine where CUDA is usable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaInfo {
    /// Devices the driver reports (at least 1).
    pub device_count: usize,
    /// The driver's CUDA version, `1000 * major + 10 * minor` (13000 for 13.0).
    pub driver_version: i32,
}

/// One probe of the machine: which libraries load and what the driver says. Split from
/// [`diagnose`] so the decision can be tested with any combination of facts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// `libcuda` (the driver API).
    pub driver: bool,
    /// `libnvrtc` (runtime compilation of the emitted kernels).
    pub nvrtc: bool,
    /// `libcublas` (GEMMs).
    pub cublas: bool,
    /// `libcublasLt` (GEMMs with bias/relu epilogues).
    pub cublaslt: bool,
    /// The driver's answer, asked only when the driver library loads:
    /// `(driver version, device count)` or the error of `cuInit` / `cuDeviceGetCount`.
    pub devices: Option<Result<(i32, i32), String>>,
}

/// The decision of [`cuda_available`] for one [`Probe`].
pub fn diagnose(p: &Probe) -> Result<CudaInfo, String> {
    let missing: Vec<&str> = [
        (p.driver, "the CUDA driver library (libcuda)"),
        (p.nvrtc, "NVRTC (libnvrtc)"),
        (p.cublas, "cuBLAS (libcublas)"),
        (p.cublaslt, "cuBLASLt (libcublasLt)"),
    ]
    .iter()
    .filter(|(present, _)| !present)
    .map(|(_, name)| *name)
    .collect();
    if !missing.is_empty() {
        return Err(format!(
            "CUDA is not available: cannot load {} (searched the dynamic loader's path, \
             LD_LIBRARY_PATH included)",
            join_names(&missing)
        ));
    }
    match &p.devices {
        None => Err("CUDA is not available: the driver was not asked for devices".into()),
        Some(Err(e)) => Err(format!("CUDA is not available: the driver failed: {e}")),
        Some(Ok((_, n))) if *n <= 0 => {
            Err("CUDA is not available: the driver reports no CUDA device".into())
        }
        Some(Ok((version, n))) => Ok(CudaInfo {
            device_count: *n as usize,
            driver_version: *version,
        }),
    }
}

fn join_names(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// Probes this machine (no caching; see [`cuda_available`]). Never panics: the library
/// checks only open and close the libraries, and the driver calls run under
/// `catch_unwind` (cudarc panics on a missing symbol).
pub fn probe() -> Probe {
    // SAFETY: `is_culib_present` only tries to open the library with `dlopen` and drops it.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    let cublas = unsafe { cudarc::cublas::sys::is_culib_present() };
    let cublaslt = unsafe { cudarc::cublaslt::sys::is_culib_present() };
    let devices = driver.then(|| {
        std::panic::catch_unwind(|| -> Result<(i32, i32), String> {
            let n = cudarc::driver::CudaContext::device_count().map_err(|e| format!("{e:?}"))?;
            let mut v = 0i32;
            // SAFETY: `cuDriverGetVersion` writes one int; the driver is initialized by
            // `device_count` above.
            unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
                .result()
                .map_err(|e| format!("{e:?}"))?;
            Ok((v, n))
        })
        .unwrap_or_else(|panic| Err(panic_text(&*panic)))
    });
    Probe {
        driver,
        nvrtc,
        cublas,
        cublaslt,
        devices,
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic inside cudarc".to_string()
    }
}

/// Whether CUDA is usable here, and if not, why. Computed once per process: call it
/// before any other CUDA call.
///
/// With the emulation on ([`emulate::configure`]) the answer is one emulated device
/// (driver version 0): the CUDA executor then runs on the host, for tests.
pub fn cuda_available() -> Result<CudaInfo, String> {
    if let Some(why) = emulate::missing() {
        return Err(why);
    }
    if emulate::emulated() {
        return Ok(CudaInfo {
            device_count: 1,
            driver_version: 0,
        });
    }
    static ANSWER: OnceLock<Result<CudaInfo, String>> = OnceLock::new();
    ANSWER.get_or_init(|| diagnose(&probe())).clone()
}

/// Whether NCCL can be used here, on top of [`cuda_available`]: `libnccl` loads (it is
/// opened at run time like the rest of CUDA). Only with the `nccl` feature.
#[cfg(feature = "nccl")]
pub fn nccl_available() -> Result<CudaInfo, String> {
    let info = cuda_available()?;
    // SAFETY: `is_culib_present` only tries to open the library with `dlopen` and drops it.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(
            "NCCL is not available: cannot load libnccl (searched the dynamic \
                    loader's path, LD_LIBRARY_PATH included)"
                .to_string(),
        );
    }
    Ok(info)
}

/// For a test that needs a GPU, given the guard's answer and the value of the tests'
/// `KILN_REQUIRE_CUDA` (their helper reads it): `Some(info)` when CUDA is usable;
/// otherwise prints `skipped: <reason>` and returns `None`, or panics with the reason
/// when the value is `1`.
pub fn skip_or_fail(
    available: Result<CudaInfo, String>,
    require_env: Option<&str>,
) -> Option<CudaInfo> {
    match available {
        Ok(info) => Some(info),
        Err(reason) if require_env.map(str::trim) == Some("1") => {
            panic!("{REQUIRE_CUDA_ENV}=1 but {reason}")
        }
        Err(reason) => {
            println!("skipped: {reason}");
            None
        }
    }
}

/// Whether NVRTC itself loads here: it is a compiler library and needs no GPU or driver,
/// so a machine with only `libnvrtc` (e.g. from the `nvidia-cuda-nvrtc` wheel, found
/// through `LD_LIBRARY_PATH`) can check the generated CUDA C ([`nvrtc_compile`]).
pub fn nvrtc_available() -> Result<String, String> {
    // SAFETY: `is_culib_present` only tries to open the library with `dlopen` and drops it.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "NVRTC is not available: cannot load libnvrtc (searched the dynamic \
                    loader's path, LD_LIBRARY_PATH included)"
                .to_string(),
        );
    }
    Ok(device::nvrtc_version())
}

/// Compiles one CUDA C unit with NVRTC and `options` (those an artifact records:
/// [`kiln_compiler::codegen::cuda::nvrtc_options`]) into PTX, without a device and
/// without the PTX cache: NVRTC's log on failure, or why NVRTC cannot be used.
pub fn nvrtc_compile(source: &str, options: &[String]) -> Result<String, String> {
    nvrtc_compile_with_log(source, options).map(|(ptx, _)| ptx)
}

/// [`nvrtc_compile`] and NVRTC's log of a successful compilation (with
/// `--ptxas-options=-v`, the assembler's registers, stack and spills per function).
pub fn nvrtc_compile_with_log(
    source: &str,
    options: &[String],
) -> Result<(String, String), String> {
    nvrtc_available()?;
    device::nvrtc_ptx_and_log(source, options)
}

/// One function of the assembler's report (`--ptxas-options=-v` in NVRTC's log).
#[derive(Clone, Debug, PartialEq)]
pub struct PtxasFunction {
    pub name: String,
    pub registers: u32,
    /// Bytes of registers spilled to local memory, stored and loaded.
    pub spill_stores: u32,
    pub spill_loads: u32,
    /// Bytes of the stack frame (local memory: spills, and arrays indexed by values the
    /// compiler could not resolve).
    pub stack: u32,
    /// Bytes of static shared memory.
    pub shared: u32,
}

/// What bounds how many blocks of a function an SM holds at once ([`PtxasFunction::occupancy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OccupancyLimit {
    /// 2,048 threads an SM (full occupancy for blocks of 256).
    Threads,
    Registers,
    SharedMemory,
    /// 32 blocks an SM.
    Blocks,
}

impl OccupancyLimit {
    pub fn name(self) -> &'static str {
        match self {
            OccupancyLimit::Threads => "threads",
            OccupancyLimit::Registers => "registers",
            OccupancyLimit::SharedMemory => "shared memory",
            OccupancyLimit::Blocks => "blocks",
        }
    }
}

impl PtxasFunction {
    /// Blocks of `threads` threads one SM of compute capability 9.0 (H100, H200) holds
    /// at once, and what limits it, from the assembler's registers and static shared
    /// memory, by the CUDA occupancy calculator's rules for sm_90: 65,536 registers
    /// allocated per warp in units of 256, 233,472 bytes of shared memory with 1,024
    /// reserved per block and 128-byte granularity, 2,048 threads and 32 blocks.
    pub fn occupancy(&self, threads: u32) -> (u32, OccupancyLimit) {
        let warps = threads.div_ceil(32).max(1);
        let by_threads = 2048 / (warps * 32);
        let regs_per_warp = (self.registers.max(1) * 32).div_ceil(256) * 256;
        let by_regs = (65_536 / regs_per_warp) / warps;
        let smem = (self.shared.saturating_add(1024)).div_ceil(128) * 128;
        let by_smem = 233_472 / smem;
        [
            (by_threads, OccupancyLimit::Threads),
            (by_regs, OccupancyLimit::Registers),
            (by_smem, OccupancyLimit::SharedMemory),
            (32, OccupancyLimit::Blocks),
        ]
        .into_iter()
        .min_by_key(|(n, _)| *n)
        .expect("four limits")
    }
}

/// The functions of a `--ptxas-options=-v` log, as NVRTC 13 prints them: `Function
/// properties for NAME`, then `… N bytes spill stores, M bytes spill loads` and `Used R
/// registers, … S bytes smem`. A number that cannot be read is `u32::MAX` (never 0).
pub fn ptxas_report(log: &str) -> Vec<PtxasFunction> {
    let number_before = |line: &str, what: &str| -> Option<u32> {
        let head = &line[..line.find(what)?];
        head.split_whitespace().last()?.parse().ok()
    };
    let mut out: Vec<PtxasFunction> = Vec::new();
    for line in log.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            out.push(PtxasFunction {
                name: name.trim().to_string(),
                registers: 0,
                spill_stores: 0,
                spill_loads: 0,
                stack: 0,
                shared: 0,
            });
        } else if let Some(f) = out.last_mut() {
            if line.contains("spill stores") {
                f.stack = number_before(line, "bytes stack frame").unwrap_or(u32::MAX);
                f.spill_stores = number_before(line, "bytes spill stores").unwrap_or(u32::MAX);
                f.spill_loads = number_before(line, "bytes spill loads").unwrap_or(u32::MAX);
            } else if line.contains("Used ") && line.contains(" registers") {
                f.registers = number_before(line, "registers").unwrap_or(u32::MAX);
                if line.contains("bytes smem") {
                    f.shared = number_before(line, "bytes smem").unwrap_or(u32::MAX);
                }
            }
        }
    }
    out
}

/// The CUDA executor of entry `entry` of `art` as an [`crate::executor::Exec`] (what the CLI
/// calls), in the artifact's precision on the first GPU; the error says why not (no GPU:
/// the guard's reason and the CPU alternative).
pub fn executor_for(
    art: &crate::artifact::Artifact,
    entry: &str,
) -> Result<Box<dyn crate::executor::Exec>, String> {
    CudaExecutor::with_options(art, entry, CudaOptions::default())
        .map(|e| Box::new(e) as Box<dyn crate::executor::Exec>)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn occupancy_follows_the_sm_90_calculator() {
        let f = |registers, shared| PtxasFunction {
            name: "f".into(),
            registers,
            spill_stores: 0,
            spill_loads: 0,
            stack: 0,
            shared,
        };
        // 32 registers, no shared memory: 8 blocks of 256 fill the SM's 2,048 threads.
        assert_eq!(f(32, 0).occupancy(256), (8, OccupancyLimit::Threads));
        // 128 registers: 4,096 a warp, 16 warps an SM, two blocks of 8 warps.
        assert_eq!(f(128, 0).occupancy(256), (2, OccupancyLimit::Registers));
        // 72 registers round up to 2,304 a warp (9 units of 256): 28 warps, 3 blocks.
        assert_eq!(f(72, 0).occupancy(256), (3, OccupancyLimit::Registers));
        // 46,208 bytes of shared memory + 1,024 reserved: 47,232 a block, 4 fit in 228 KiB.
        assert_eq!(
            f(32, 46_208).occupancy(256),
            (4, OccupancyLimit::SharedMemory)
        );
        // Small blocks: the 32-block limit.
        assert_eq!(f(16, 0).occupancy(32), (32, OccupancyLimit::Blocks));
    }

    fn all_present(devices: Option<Result<(i32, i32), String>>) -> Probe {
        Probe {
            driver: true,
            nvrtc: true,
            cublas: true,
            cublaslt: true,
            devices,
        }
    }

    #[test]
    fn every_missing_library_is_named() {
        let p = Probe {
            driver: false,
            nvrtc: true,
            cublas: false,
            cublaslt: false,
            devices: None,
        };
        let e = diagnose(&p).unwrap_err();
        assert!(e.contains("libcuda"), "{e}");
        assert!(!e.contains("libnvrtc"), "{e}");
        assert!(
            e.contains("the CUDA driver library (libcuda), cuBLAS (libcublas) or cuBLASLt"),
            "{e}"
        );
        let p = Probe {
            nvrtc: false,
            ..all_present(Some(Ok((13000, 1))))
        };
        let e = diagnose(&p).unwrap_err();
        assert!(
            e.ends_with("cannot load NVRTC (libnvrtc) (searched the dynamic loader's path, LD_LIBRARY_PATH included)"),
            "{e}"
        );
    }

    #[test]
    fn devices_decide_once_the_libraries_load() {
        assert_eq!(
            diagnose(&all_present(Some(Ok((13000, 2))))),
            Ok(CudaInfo {
                device_count: 2,
                driver_version: 13000
            })
        );
        let e = diagnose(&all_present(Some(Ok((13000, 0))))).unwrap_err();
        assert!(e.contains("no CUDA device"), "{e}");
        let e = diagnose(&all_present(Some(Err("CUDA_ERROR_NO_DEVICE".into())))).unwrap_err();
        assert!(e.contains("driver failed: CUDA_ERROR_NO_DEVICE"), "{e}");
    }

    #[test]
    fn the_guard_answers_on_this_machine_without_panicking() {
        let answer = cuda_available();
        assert_eq!(answer, cuda_available(), "computed once");
        match &answer {
            Ok(info) => assert!(info.device_count > 0),
            Err(reason) => {
                assert!(reason.starts_with("CUDA is not available: "), "{reason}");
                // The probe agrees with the libraries as the loader sees them.
                let p = probe();
                assert_eq!(diagnose(&p), answer);
            }
        }
    }

    #[test]
    fn a_missing_gpu_skips_unless_required() {
        let absent = || Err::<CudaInfo, _>("CUDA is not available: test".to_string());
        assert_eq!(skip_or_fail(absent(), None), None);
        assert_eq!(skip_or_fail(absent(), Some("0")), None);
        assert_eq!(skip_or_fail(absent(), Some("")), None);
        let required = std::panic::catch_unwind(|| skip_or_fail(absent(), Some("1")));
        let msg = panic_text(&*required.unwrap_err());
        assert_eq!(msg, "KILN_REQUIRE_CUDA=1 but CUDA is not available: test");
        let info = CudaInfo {
            device_count: 1,
            driver_version: 13000,
        };
        assert_eq!(skip_or_fail(Ok(info.clone()), Some("1")), Some(info));
    }

    #[test]
    fn the_helper_follows_the_guard_on_this_machine() {
        // What a GPU test sees here, with the environment as it is: on a machine without
        // CUDA and without KILN_REQUIRE_CUDA=1, a skip; with it, a failure.
        let env = std::env::var(REQUIRE_CUDA_ENV).ok();
        let got = std::panic::catch_unwind(|| skip_or_fail(cuda_available(), env.as_deref()));
        match (cuda_available(), env.as_deref().map(str::trim) == Some("1")) {
            (Ok(info), _) => assert_eq!(got.unwrap(), Some(info)),
            (Err(_), false) => assert_eq!(got.unwrap(), None),
            (Err(_), true) => assert!(got.is_err()),
        }
        // And with the variable forced both ways.
        if cuda_available().is_err() {
            assert!(
                std::panic::catch_unwind(|| skip_or_fail(cuda_available(), Some("1"))).is_err()
            );
            assert_eq!(skip_or_fail(cuda_available(), None), None);
        }
    }
}
