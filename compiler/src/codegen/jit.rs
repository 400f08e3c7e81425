//! CLIF text to machine code: the JIT the CPU executor runs kernels with.
//!
//! In: CLIF functions as text (what the artifact stores, what [`crate::codegen`] emits).
//! Out: a [`JitModule`] holding callable kernel pointers by function name.
//!
//! The ISA is the host's, from `cranelift_native::builder()` (so AVX and FMA are used
//! where the CPU has them), with `opt_level = speed`. Every function is verified before
//! it is compiled; a malformed or tampered text is an error naming the function, never a
//! crash.

use std::collections::BTreeMap;
use std::sync::Arc;

use cranelift_codegen::ir::{ExternalName, UserExternalName};
use cranelift_codegen::isa::TargetIsa;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{default_libcall_names, Linkage, Module};

use crate::codegen::masks;

/// The machine code of one kernel function: see [`crate::codegen::clif`] for the ABI.
pub type KernelFn = unsafe extern "C" fn(*const *mut u8, *const i64, i64, i64);

/// Compiled kernels. The code stays mapped as long as this value lives.
pub struct JitModule {
    // Never dropped while pointers into it are in use: the executor owns both.
    _module: JITModule,
    fns: BTreeMap<String, KernelFn>,
}

// SAFETY: after `finalize_definitions` the module's code memory is immutable and only
// read (executed); the module itself is never touched again until it is dropped.
unsafe impl Send for JitModule {}
unsafe impl Sync for JitModule {}

impl std::fmt::Debug for JitModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JitModule({} functions)", self.fns.len())
    }
}

impl JitModule {
    /// The kernel called `name`.
    pub fn get(&self, name: &str) -> Option<KernelFn> {
        self.fns.get(name).copied()
    }

    pub fn len(&self) -> usize {
        self.fns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fns.is_empty()
    }
}

/// The host ISA kernels are compiled for (`opt_level = speed`).
pub fn host_isa() -> Result<Arc<dyn TargetIsa>, String> {
    let mut flags = settings::builder();
    flags
        .set("opt_level", "speed")
        .map_err(|e| format!("cranelift flag opt_level: {e}"))?;
    flags
        .set("use_colocated_libcalls", "false")
        .map_err(|e| format!("cranelift flag: {e}"))?;
    flags
        .set("is_pic", "false")
        .map_err(|e| format!("cranelift flag: {e}"))?;
    let mut builder = cranelift_native::builder()
        .map_err(|e| format!("this machine is not supported by Cranelift: {e}"))?;
    // Kept off: with AVX-512DQ an `imul` of 64-bit lanes holding widened 32-bit values
    // (`uwiden_low/high`) lowers to `vpmullq` (three µops, latency 15) instead of
    // `pmuludq` (one), which dropout's Philox in CLIF once drew with; no kernel needs
    // another AVX-512DQ instruction. (Other architectures have no such flag: the error is
    // theirs to ignore.)
    let _ = builder.set("has_avx512dq", "false");
    builder
        .finish(settings::Flags::new(flags))
        .map_err(|e| format!("cannot configure Cranelift for this machine: {e}"))
}

/// A short description of the host ISA (`x86_64 avx2 fma`), for reports.
pub fn host_description() -> String {
    match host_isa() {
        Ok(isa) => {
            let mut s = isa.triple().architecture.to_string();
            for f in isa.isa_flags() {
                if f.as_bool() == Some(true)
                    && ["has_avx", "has_avx2", "has_fma", "has_avx512f"].contains(&f.name)
                {
                    s.push(' ');
                    s.push_str(f.name.trim_start_matches("has_"));
                }
            }
            s
        }
        Err(e) => format!("unsupported ({e})"),
    }
}

/// Parses and compiles CLIF text (any number of functions); every function becomes a
/// kernel under its name (`%name` in the text).
pub fn compile(text: &str) -> Result<JitModule, String> {
    let funcs = cranelift_reader::parse_functions(text)
        .map_err(|e| format!("the kernel text does not parse as CLIF: {e}"))?;
    let isa = host_isa()?;
    let call_conv = isa.default_call_conv();
    let mut builder = JITBuilder::with_isa(isa.clone(), default_libcall_names());
    // The one function a kernel may call: region and `embed_pe` kernels draw their
    // dropout masks with it.
    builder.symbol(masks::SYMBOL, masks::kiln_dropout_masks as *const u8);
    let mut module = JITModule::new(builder);
    let mut ids = Vec::with_capacity(funcs.len());
    let mut ctx = module.make_context();
    let mut draw_masks = None;
    for mut func in funcs {
        let name = func.name.to_string().trim_start_matches('%').to_string();
        func.signature.call_conv = call_conv;
        // Calls: only `%kiln_dropout_masks`, with its signature, bound to the module's
        // import of it; every signature a kernel calls through uses the host's C ABI.
        for sig in func.dfg.signatures.values_mut() {
            sig.call_conv = call_conv;
        }
        let calls: Vec<_> = func.dfg.ext_funcs.keys().collect();
        for f in calls {
            let data = &func.dfg.ext_funcs[f];
            let callee = data.name.display(None).to_string();
            let sig = func.dfg.signatures[data.signature].clone();
            if callee.trim_start_matches('%') != masks::SYMBOL || sig != masks::signature(call_conv)
            {
                return Err(format!(
                    "kernel `{name}` calls `{callee}` ({sig}); kernels may only call `%{}` {}",
                    masks::SYMBOL,
                    masks::signature(call_conv)
                ));
            }
            let id = match draw_masks {
                Some(id) => id,
                None => {
                    let id = module
                        .declare_function(masks::SYMBOL, Linkage::Import, &sig)
                        .map_err(|e| format!("kernel `{name}`: {e}"))?;
                    draw_masks = Some(id);
                    id
                }
            };
            let user = func.declare_imported_user_function(UserExternalName::new(0, id.as_u32()));
            func.dfg.ext_funcs[f].name = ExternalName::User(user);
        }
        if func.signature != {
            let mut s = crate::codegen::clif::kernel_signature();
            s.call_conv = call_conv;
            s
        } {
            return Err(format!(
                "kernel `{name}` has signature {} — every kernel takes (i64, i64, i64, i64)",
                func.signature
            ));
        }
        cranelift_codegen::verify_function(&func, isa.as_ref())
            .map_err(|e| format!("kernel `{name}` is not valid CLIF: {e}"))?;
        let id = module
            .declare_function(&name, Linkage::Local, &func.signature)
            .map_err(|e| format!("kernel `{name}`: {e}"))?;
        ctx.func = func;
        module
            .define_function(id, &mut ctx)
            .map_err(|e| format!("kernel `{name}` does not compile: {e:?}"))?;
        module.clear_context(&mut ctx);
        ids.push((name, id));
    }
    module
        .finalize_definitions()
        .map_err(|e| format!("linking kernels: {e}"))?;
    let mut fns = BTreeMap::new();
    for (name, id) in ids {
        let p = module.get_finalized_function(id);
        // SAFETY: every function was checked to have the kernel signature above.
        let f = unsafe { std::mem::transmute::<*const u8, KernelFn>(p) };
        fns.insert(name, f);
    }
    Ok(JitModule {
        _module: module,
        fns,
    })
}

/// Calls `f` over items `[0, items)`, split into chunks of at least `grain` items across
/// rayon's threads (a chunk's result never depends on the split).
///
/// # Safety
/// `ptrs` and `dims` must be what the kernel's ABI requires, with every buffer large
/// enough for every item.
pub unsafe fn launch(f: KernelFn, ptrs: &[*mut u8], dims: &[i64], items: usize, grain: usize) {
    struct P(*const *mut u8, *const i64);
    unsafe impl Sync for P {}
    unsafe impl Send for P {}
    let p = P(ptrs.as_ptr(), dims.as_ptr());
    let grain = grain.max(1);
    let threads = rayon::current_num_threads().max(1);
    let chunks = items.div_ceil(grain).min(threads * 4).max(1);
    if chunks <= 1 || items <= grain {
        unsafe { f(p.0, p.1, 0, items as i64) };
        return;
    }
    let per = items.div_ceil(chunks);
    let p = &p;
    rayon::scope(|s| {
        for c in 0..chunks {
            let lo = c * per;
            let hi = ((c + 1) * per).min(items);
            if lo >= hi {
                continue;
            }
            s.spawn(move |_| {
                let p = p;
                unsafe { f(p.0, p.1, lo as i64, hi as i64) }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel whose body only calls `callee` with signature `sig`.
    fn calling(callee: &str, sig: &str) -> String {
        format!(
            "function %k(i64, i64, i64, i64) system_v {{\n    sig0 = {sig} system_v\n    \
             fn0 = %{callee} sig0\n\nblock0(v0: i64, v1: i64, v2: i64, v3: i64):\n    \
             v4 = iconst.i32 0\n    call fn0(v0, v4, v4, v4, v1, v2, v3)\n    return\n}}\n"
        )
    }

    #[test]
    fn kernels_may_call_only_the_dropout_masks() {
        let sig = "(i64, i32, i32, i32, i64, i64, i64)";
        compile(&calling("kiln_dropout_masks", sig)).expect("the masks' call links");
        let err = compile(&calling("system", sig)).unwrap_err();
        assert!(
            err.contains("kernel `k` calls `%system`") && err.contains("%kiln_dropout_masks"),
            "{err}"
        );
        let other = "(i64, i32, i32, i32, i64, i64, i32)";
        let err = compile(&calling("kiln_dropout_masks", other)).unwrap_err();
        assert!(err.contains("calls `%kiln_dropout_masks`"), "{err}");
    }
}
