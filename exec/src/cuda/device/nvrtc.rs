//! Compiling a unit's CUDA C with NVRTC (through the PTX cache), or keeping the source for
//! the emulated device.

use cudarc::nvrtc::Ptx;

use super::*;

/// NVRTC's version, `major.minor` (`?` if it cannot say).
pub(crate) fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; only called after the CUDA guard found NVRTC.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{major}.{minor}")
    } else {
        "?".to_string()
    }
}

/// Compiles `source` (one unit) with NVRTC and `options`; the error is NVRTC's log. The
/// PTX is kept in the PTX cache ([`super::ptx_cache`]): a unit compiled before by the
/// same NVRTC with the same options is read back instead.
pub(crate) fn compile(source: &str, options: &[String]) -> Result<Unit, String> {
    #[cfg(feature = "emulate")]
    if crate::cuda::emulate::emulated() {
        return Ok(Unit::Host(source.to_string()));
    }
    let dir = crate::cuda::ptx_cache::dir();
    let (ptx, _) = crate::cuda::ptx_cache::compile_cached(
        dir.as_deref(),
        source,
        options,
        &nvrtc_version(),
        || nvrtc_ptx(source, options),
    )?;
    Ok(Unit::Ptx(Ptx::from_src(ptx)))
}

/// NVRTC's PTX of `source` with `options` and its log (warnings, and the assembler's
/// report with `--ptxas-options=-v`); NVRTC must be loadable: the caller checked.
pub(crate) fn nvrtc_ptx_and_log(
    source: &str,
    options: &[String],
) -> Result<(String, String), String> {
    use cudarc::nvrtc::result;
    let text = |v: Vec<std::ffi::c_char>| {
        let bytes: Vec<u8> = v
            .into_iter()
            .map(|c| c as u8)
            .take_while(|&b| b != 0)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let src = std::ffi::CString::new(source).map_err(|_| "a NUL in the CUDA C".to_string())?;
    let prog = result::create_program(&src, None).map_err(|e| format!("NVRTC: {e:?}"))?;
    // SAFETY: `prog` was just created and is destroyed once, below; `src` outlives it.
    unsafe {
        let compiled = result::compile_program(prog, options);
        let log = result::get_program_log(prog).map(text).unwrap_or_default();
        let out = match compiled {
            Ok(()) => result::get_ptx(prog)
                .map(|p| (text(p), log))
                .map_err(|e| format!("NVRTC: {e:?}")),
            Err(e) => Err(format!(
                "NVRTC failed ({e:?}) with options {}:\n{log}",
                options.join(" ")
            )),
        };
        let _ = result::destroy_program(prog);
        out
    }
}

/// NVRTC's PTX of `source` with `options` (NVRTC must be loadable: the caller checked);
/// a failure is NVRTC's log, verbatim.
pub(crate) fn nvrtc_ptx(source: &str, options: &[String]) -> Result<String, String> {
    nvrtc_ptx_and_log(source, options).map(|(ptx, _)| ptx)
}
