//! Snapshots of the generated CUDA C: one function of every kernel kind, from the tiny
//! Transformer's training step, forward pass, optimizer step and decoding step, plus the
//! prelude. No GPU is needed: the text is deterministic (emitted twice here, byte for
//! byte) and checked for plausibility (balanced brackets, one `__global__` per function,
//! exact constants) and, where `g++` exists, compiled as C++ under the host shim
//! (`compiler/tests/cuda_host.rs` runs kernels that way against the CPU kernels).

use std::collections::BTreeMap;

use kiln_compiler::codegen::cuda::program::emit_with;
use kiln_compiler::codegen::cuda::storage;
use kiln_compiler::codegen::cuda::text::Elem;
use kiln_compiler::codegen::cuda::{emit, CudaCode, Library, Work};
use kiln_compiler::optimize::optimize;
use kiln_compiler::plan::MemoryPlan;
use kiln_exec::cuda::PtxasFunction;

mod common;
use common::root;

/// The tiny Transformer's kernel graph of `entry`.
fn kernel_graph(entry: &str) -> kiln_compiler::optimize::KernelGraph {
    let spec = root().join("models/transformer_tiny.kiln");
    let elaborate = common::elaborator(&spec, &["vocab=48"]);
    let g = if entry == "train_step_scaled" {
        let g = elaborate(kiln_exec::GraphKind::Train).expect("tiny compiles");
        // Dynamic loss scaling's train_step (`train.loss_scale`): the seeded cross-entropy.
        let options = kiln_compiler::autodiff::TrainStepOptions { loss_scale: true };
        kiln_compiler::autodiff::train_step_with(&g, options).expect("differentiates")
    } else {
        kiln_exec::compiled_entry_graph_with(entry, elaborate, |e| e.message).expect("entry")
    };
    optimize(&g, &Default::default()).expect("optimizes").0
}

/// `entry`'s CUDA code; `entry@bf16` is its mixed-precision program.
fn code_of(entry: &str) -> CudaCode {
    if let Some(entry) = entry.strip_suffix("@bf16") {
        return emit_with(&kernel_graph(entry), Elem::Bf16).expect("emits in bf16");
    }
    if entry == "optimizer" {
        return kiln_compiler::codegen::cuda::optim::code();
    }
    if entry == "cast" {
        return kiln_compiler::codegen::cuda::cast::code();
    }
    if entry == "resident" {
        return kiln_compiler::codegen::cuda::resident::code();
    }
    emit(&kernel_graph(entry)).expect("emits")
}

const ENTRIES: [&str; 6] = [
    "train_step",
    "forward",
    "loss",
    "adam_update",
    "decode_step",
    "train_step_scaled",
];
/// The entries' mixed-precision programs (`program::emit_with(…, Elem::Bf16)`).
const BF16: [&str; 6] = [
    "train_step@bf16",
    "forward@bf16",
    "loss@bf16",
    "adam_update@bf16",
    "decode_step@bf16",
    "train_step_scaled@bf16",
];
/// Every CUDA unit: the entries' programs in f32 and in bf16, the device optimizer's
/// (`codegen::cuda::optim`), the bf16 conversion's (`codegen::cuda::cast`) and the
/// resident decoder's (`codegen::cuda::resident`).
const UNITS: [&str; 15] = [
    "train_step",
    "train_step_scaled",
    "forward",
    "loss",
    "adam_update",
    "decode_step",
    "optimizer",
    "cast",
    "resident",
    "train_step@bf16",
    "train_step_scaled@bf16",
    "forward@bf16",
    "loss@bf16",
    "adam_update@bf16",
    "decode_step@bf16",
];

/// The kind of a function named `<kind>_<n>`.
fn kind_of(name: &str) -> String {
    name.rsplit_once('_')
        .map(|(k, _)| k)
        .unwrap_or(name)
        .to_string()
}

#[test]
fn cuda_of_every_kernel_kind_is_pinned() {
    let mut first: BTreeMap<String, String> = BTreeMap::new();
    let mut prelude = None;
    for entry in ENTRIES {
        let code = code_of(entry);
        assert_eq!(code, code_of(entry), "{entry}: the code is deterministic");
        for f in &code.functions {
            first
                .entry(kind_of(&f.name))
                .or_insert_with(|| f.text.clone());
            if f.text.contains("kiln_keep_word(") && f.name.starts_with("region_") {
                first
                    .entry("region_dropout".into())
                    .or_insert_with(|| f.text.clone());
            }
        }
        let p = prelude.get_or_insert_with(|| code.prelude.clone());
        assert_eq!(*p, code.prelude, "one prelude for every program");
    }
    let kinds: Vec<&str> = first.keys().map(|s| s.as_str()).collect();
    for want in [
        "adam_update",
        "add_layer_norm",
        "arange",
        "causal_mask",
        "concat",
        "pad_mask",
        "add_layer_norm_bwd",
        "add_layer_norm_bwd_finish",
        "copy_strided",
        "embed_pe",
        "fill_rows",
        "region",
        "region_dropout",
        "relu",
        "scale_mask_softmax",
        "softmax_bwd",
        "sum_rows",
        "sum_rows_finish",
        "scatter_rows_onto",
        "xent_ls",
        "xent_ls_loss",
        "xent_ls_count",
        "xent_ls_count_seeded",
        "xent_ls_finish",
    ] {
        assert!(kinds.contains(&want), "no `{want}` kernel among {kinds:?}");
    }
    insta::assert_snapshot!("cuda_prelude", prelude.expect("a prelude"));
    for (kind, text) in &first {
        insta::assert_snapshot!(format!("cuda_{kind}"), text);
    }
}

/// A buffer's element type in words: `bf16`, `f32`, or the dtype of an integer buffer.
fn stored(kg: &kiln_compiler::optimize::KernelGraph, code: &CudaCode, v: usize) -> String {
    let (owner, i) = storage::buffer(kg, v);
    let dtype = kg.values[owner].types[i].dtype;
    if dtype != kiln_compiler::DType::F32 {
        return dtype.to_string();
    }
    match storage::of(&code.storage, kg, v) {
        Elem::F32 => "f32".into(),
        Elem::Bf16 => "bf16".into(),
    }
}

/// The tiny Transformer's mixed-precision programs: which buffer is kept in which type,
/// kernel by kernel (pinned for the training and decoding steps), and the text of every function kind
/// that reads or writes bf16.
#[test]
fn bf16_programs_are_pinned() {
    let mut first: BTreeMap<String, String> = BTreeMap::new();
    for entry in BF16 {
        let code = code_of(entry);
        assert_eq!(code, code_of(entry), "{entry}: the code is deterministic");
        let kg = kernel_graph(entry.trim_end_matches("@bf16"));
        assert_eq!(
            code.storage.len(),
            kg.values.len(),
            "{entry}: one entry per value"
        );
        assert_eq!(code.kernels.len(), kg.kernels().len());
        for f in &code.functions {
            if f.text.contains("kiln_bf16") {
                first
                    .entry(kind_of(&f.name))
                    .or_insert_with(|| f.text.clone());
            }
        }
        let mut lines = Vec::new();
        for (v, op, inputs) in kg.kernels() {
            let ins: Vec<String> = inputs.iter().map(|&x| stored(&kg, &code, x)).collect();
            let outs: Vec<String> = (0..kg.values[v].types.len())
                .map(|i| {
                    let dtype = kg.values[v].types[i].dtype;
                    match (dtype, code.storage[v][i]) {
                        (kiln_compiler::DType::F32, Elem::Bf16) => "bf16".to_string(),
                        (kiln_compiler::DType::F32, Elem::F32) => "f32".to_string(),
                        (d, _) => d.to_string(),
                    }
                })
                .collect();
            lines.push(format!(
                "%{v} {}: {} -> {}",
                op.kind(),
                ins.join(" "),
                outs.join(" ")
            ));
        }
        if let "train_step@bf16" | "decode_step@bf16" = entry {
            let name = format!("cuda_bf16_storage_{}", entry.trim_end_matches("@bf16"));
            insta::assert_snapshot!(name, lines.join("\n"));
        }
    }
    let kinds: Vec<&str> = first.keys().map(|s| s.as_str()).collect();
    for want in [
        "add_layer_norm",
        "add_layer_norm_bwd",
        "attention",
        "attention_bwd_kv",
        "attention_bwd_q",
        "copy_strided16",
        "embed_pe",
        "fill_rows",
        "region",
        "relu",
        "sum_rows",
        "xent_ls",
        "xent_ls_loss",
    ] {
        assert!(
            kinds.contains(&want),
            "no bf16 `{want}` kernel among {kinds:?}"
        );
    }
    for (kind, text) in &first {
        insta::assert_snapshot!(format!("cuda_bf16_{kind}"), text);
    }
}

#[test]
fn the_device_optimizer_is_pinned() {
    let code = code_of("optimizer");
    assert_eq!(code, code_of("optimizer"), "the code is deterministic");
    assert_eq!(
        code.prelude,
        code_of("train_step").prelude,
        "the programs' prelude"
    );
    let text: Vec<&str> = code.functions.iter().map(|f| f.text.as_str()).collect();
    insta::assert_snapshot!("cuda_device_optimizer", text.join("\n"));
    let cast = code_of("cast");
    assert_eq!(cast.prelude, code.prelude);
    insta::assert_snapshot!("cuda_to_bf16", cast.functions[0].text);
    let resident = code_of("resident");
    assert_eq!(resident, code_of("resident"), "the code is deterministic");
    assert_eq!(resident.prelude, code.prelude);
    insta::assert_snapshot!("cuda_take_rows", resident.functions[0].text);
    insta::assert_snapshot!("cuda_row_top_k", resident.functions[1].text);
}

/// Every `(`/`)`, `[`/`]`, `{`/`}` pair balanced and properly nested.
fn balanced(text: &str) -> Result<(), String> {
    let mut stack = Vec::new();
    for (i, c) in text.char_indices() {
        match c {
            '(' | '[' | '{' => stack.push(c),
            ')' | ']' | '}' => {
                let want = match c {
                    ')' => '(',
                    ']' => '[',
                    _ => '{',
                };
                if stack.pop() != Some(want) {
                    return Err(format!("unbalanced `{c}` at byte {i}"));
                }
            }
            _ => {}
        }
    }
    if stack.is_empty() {
        Ok(())
    } else {
        Err(format!("unclosed {stack:?}"))
    }
}

/// `text` without its `//` comments (which may name NaN in words).
fn without_comments(text: &str) -> String {
    text.lines()
        .map(|l| l.split_once("//").map(|(code, _)| code).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `text` with the contents of its string literals blanked (the quotes kept).
fn without_strings(text: &str) -> String {
    let mut inside = false;
    text.chars()
        .map(|c| {
            if c == '"' {
                inside = !inside;
                c
            } else if inside {
                ' '
            } else {
                c
            }
        })
        .collect()
}

/// The identifier-like words of `text`.
fn words(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
}

#[test]
fn every_source_is_plausible_cuda() {
    for entry in UNITS {
        let code = code_of(entry);
        let source = code.source();
        balanced(&source).unwrap_or_else(|e| panic!("{entry}: {e}"));
        let code_text = without_comments(&source);
        for w in words(&code_text) {
            let lower = w.to_ascii_lowercase();
            assert!(
                !matches!(lower.as_str(), "nan" | "inf" | "infinity"),
                "{entry}: `{w}` in the text: constants must be exact bit patterns"
            );
        }
        // Float literals are small integers (`2.0f`); anything else is a bit pattern
        // (string literals, the tensor-core tile's `asm` text, aside).
        let code_text = without_strings(&code_text);
        let b = code_text.as_bytes();
        for i in 1..b.len().saturating_sub(2) {
            // A number ends here: digits before the dot, begun by a digit (not a member
            // access of a name ending in digits, `x0.w`).
            let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
            let start = (0..i).rev().take_while(|&j| word(b[j])).last();
            if b[i] == b'.'
                && b[i - 1].is_ascii_digit()
                && start.is_some_and(|j| b[j].is_ascii_digit())
            {
                assert_eq!(
                    &code_text[i..i + 3],
                    ".0f",
                    "{entry}: an inexact float literal near `{}`",
                    &code_text[i.saturating_sub(20)..(i + 20).min(code_text.len())]
                );
            }
        }
        assert_eq!(
            source.matches("__global__").count(),
            code.functions.len(),
            "{entry}: one __global__ per function"
        );
        for f in &code.functions {
            balanced(&f.text).unwrap_or_else(|e| panic!("{}: {e}", f.name));
            // A kernel may bound its registers for two blocks an SM.
            let head = format!("extern \"C\" __global__ void {}(", f.name);
            let bounded = format!(
                "extern \"C\" __global__ void __launch_bounds__(KILN_THREADS, 2) {}(",
                f.name
            );
            assert_eq!(
                f.text.matches(&head).count() + f.text.matches(&bounded).count(),
                1,
                "{}: {}",
                f.name,
                f.text
            );
            assert_eq!(
                f.text.matches("__global__").count(),
                1,
                "{}: one kernel per function text",
                f.name
            );
            // The declared parameters, then dims and items, in order.
            let mut sig: Vec<String> = f
                .params
                .iter()
                .map(|p| format!("{} {}", p.c_type, p.name))
                .collect();
            sig.push("const kiln_dims dims".into());
            sig.push("long long items".into());
            let sig = format!("{})", sig.join(", "));
            assert!(
                [&head, &bounded]
                    .iter()
                    .any(|h| f.text.contains(&format!("{h}{sig}"))),
                "{}: the signature is the declared parameters:\n{}",
                f.name,
                f.text
            );
            let shared = f.text.contains("__shared__");
            let uses_block = f.text.contains("kiln_block_");
            let flash = f.name.starts_with("attention");
            // `sum_rows` and the finish of the layer norm's backward add their warps'
            // column sums through shared memory; the layer norm's backward keeps its rows'
            // statistics there.
            let column_sums =
                f.name.starts_with("sum_rows_") || f.name.starts_with("add_layer_norm_bwd");
            // The decoder's top-k reduces (max, f64 sum, arg-max) in trees of its own.
            let top_k = f.name.starts_with("kiln_row_top_k");
            assert_eq!(
                shared,
                uses_block || flash || column_sums || top_k,
                "{}: shared scratch iff block sums, flash tiles, column sums or top-k",
                f.name
            );
            if shared {
                // The layer norm's backward (not its finish) is one warp per row block, with
                // a slot of statistics per warp in its two-phase path.
                let per_warp = f.name.starts_with("add_layer_norm_bwd_")
                    && !f.name.starts_with("add_layer_norm_bwd_finish");
                let want = if per_warp { Work::Warps } else { Work::Blocks };
                assert_eq!(f.work, want, "{}: shared memory per block or warp", f.name);
            }
            if flash {
                assert_eq!(f.work, Work::Blocks, "{}: one tile per block", f.name);
                assert!(f.text.contains("__syncthreads()"), "{}", f.name);
            }
            if uses_block {
                assert_eq!(
                    f.work,
                    Work::Blocks,
                    "{}: block reductions need blocks",
                    f.name
                );
            }
            assert!(!f.items_rule.is_empty());
        }
        // Every kernel launches something, and every role names an emitted function.
        for (i, k) in code.kernels.iter().enumerate() {
            for (role, name) in &k.functions {
                if role == "inner" {
                    assert!(name.chars().all(|c| c == '0' || c == '1'));
                    continue;
                }
                assert!(
                    code.function(name).is_some(),
                    "{entry} kernel {i} ({}): role {role} names missing `{name}`",
                    k.kind
                );
            }
            let generated = k.functions.keys().any(|r| r != "copy" && r != "inner");
            assert!(
                generated || k.library.is_some(),
                "{entry} kernel {i} ({}) launches nothing",
                k.kind
            );
            match (k.kind.as_str(), &k.library) {
                ("linear" | "linear_relu", Some(Library::Gemm { bias, relu, .. })) => {
                    assert_eq!(*bias, Some(2));
                    assert_eq!(*relu, k.kind == "linear_relu");
                    assert!(k.functions.contains_key("bias"));
                    assert_eq!(k.functions.contains_key("epilogue"), *relu);
                }
                (
                    "matmul",
                    Some(Library::Gemm {
                        bias: None,
                        relu: false,
                        ..
                    }),
                ) => {}
                (
                    "attention",
                    Some(Library::Attention {
                        backward: false, ..
                    }),
                ) => {
                    assert!(k.functions.contains_key("softmax"));
                    // The tiny model's heads (8) take the flash kernel.
                    assert_eq!(kind_of(&k.functions["flash"]), "attention");
                }
                ("attention_bwd", Some(Library::Attention { backward: true, .. })) => {
                    assert!(k.functions.contains_key("softmax_bwd"));
                    assert_eq!(kind_of(&k.functions["flash_q"]), "attention_bwd_q");
                    assert_eq!(kind_of(&k.functions["flash_kv"]), "attention_bwd_kv");
                }
                ("linear" | "linear_relu" | "matmul" | "attention" | "attention_bwd", l) => {
                    panic!("{entry} kernel {i} ({}): library {l:?}", k.kind)
                }
                (_, Some(Library::Host)) => assert!(!generated, "{}", k.kind),
                // The `loss` entry's cross-entropy writes no gradient: role `loss`.
                ("xent_ls", None) if entry.starts_with("loss") => {
                    assert!(k.functions.contains_key("loss"));
                    assert!(!k.functions.contains_key("main"));
                    assert_eq!(kind_of(&k.functions["loss"]), "xent_ls_loss");
                }
                (_, None) => assert!(k.functions.contains_key("main"), "{}", k.kind),
                (kind, l) => panic!("{entry} kernel {i} ({kind}): library {l:?}"),
            }
        }
    }
}

#[test]
fn what_runs_on_the_host_is_listed() {
    // What is left without CUDA code is listed here, so a new kind that falls back to
    // the host is a visible change.
    let mut host: Vec<String> = Vec::new();
    for entry in ENTRIES {
        for k in code_of(entry).kernels {
            if k.library == Some(Library::Host) && !host.contains(&k.kind) {
                host.push(k.kind);
            }
        }
    }
    host.sort();
    insta::assert_snapshot!("cuda_host_kinds", host.join("\n"));
}

/// Runs `compiler` on each `(what, source)` written to its own file (`prefix` + source,
/// extension `ext`) in a fresh temporary directory, in parallel, with `args` before the
/// file; fails with the compiler's messages and `complaint` if one does not compile.
fn compile_each(
    compiler: &str,
    args: &[&str],
    (ext, prefix): (&str, &str),
    sources: &[(String, String)],
    complaint: &str,
) {
    use rayon::prelude::*;
    // Tests run at once in one process: a directory of each call's own.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kiln-compile-each-{}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    sources
        .par_iter()
        .enumerate()
        .for_each(|(k, (what, source))| {
            let path = dir.join(format!("p{k}.{ext}"));
            std::fs::write(&path, format!("{prefix}\n{source}")).expect("write");
            let out = std::process::Command::new(compiler)
                .args(args)
                .arg(&path)
                .output()
                .expect("the compiler runs");
            assert!(
                out.status.success(),
                "{what}: {complaint} ({compiler}):\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Each `(what, source)` compiled as C++20 under the host shim (`-fsyntax-only -Wall
/// -Werror`), in parallel; skipped with a printed reason without `g++`.
fn compiles_as_cpp(sources: &[(String, String)]) {
    if !answers("g++") {
        println!("skipped: no g++ on the path to compile the CUDA C on the host");
        return;
    }
    compile_each(
        "g++",
        &["-std=c++20", "-fsyntax-only", "-Wall", "-Werror"],
        ("cpp", kiln_compiler::codegen::cuda::host::SHIM),
        sources,
        "the CUDA C is not valid C++ under the shim",
    );
}

/// What NVRTC gives a unit without any `#include`, declared for clang's CUDA mode: the
/// execution-space attributes, the built-in index variables (clang's own header) and
/// the device functions the kernels call. A kernel that calls anything else — a host
/// function, a library it does not include — fails to compile here as under NVRTC.
const NVRTC_BUILTINS: &str = r#"#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __host__ __attribute__((host))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#include <__clang_cuda_builtin_vars.h>
__device__ void __syncthreads();
__device__ float expf(float);
__device__ float logf(float);
__device__ float sqrtf(float);
__device__ float sinf(float);
__device__ float cosf(float);
__device__ double exp(double);
__device__ double log(double);
__device__ float __int_as_float(int);
__device__ int __float_as_int(float);
__device__ unsigned __umulhi(unsigned, unsigned);
__device__ float __shfl_xor_sync(unsigned, float, int, int = 32);
"#;

/// A clang that compiles CUDA (`$KILN_CLANG`, else `clang` or `clang-N` on the path).
fn clang() -> Option<String> {
    let names: Vec<String> = std::env::var("KILN_CLANG")
        .into_iter()
        .chain(std::iter::once("clang".to_string()))
        .chain((14..=21).rev().map(|n| format!("clang-{n}")))
        .collect();
    names.into_iter().find(|c| answers(c))
}

/// Whether `program --version` runs and succeeds.
fn answers(program: &str) -> bool {
    std::process::Command::new(program)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Each `(what, source)` compiled as CUDA device code by clang (`-x cuda
/// --cuda-device-only -fsyntax-only -Wall -Werror`, no CUDA headers, only
/// [`NVRTC_BUILTINS`]): what g++ under the host shim cannot see — a device function
/// calling a host one, a missing `__device__`, a name NVRTC does not define. Skipped
/// with a printed reason without clang (CI has none; the development machine does).
fn compiles_as_cuda(sources: &[(String, String)]) {
    let Some(clang) = clang() else {
        println!("skipped: no clang on the path (or $KILN_CLANG) to compile the CUDA C as CUDA");
        return;
    };
    compile_each(
        &clang,
        &[
            "-x",
            "cuda",
            "--cuda-device-only",
            "--cuda-gpu-arch=sm_80",
            "-nocudainc",
            "-nocudalib",
            "-fsyntax-only",
            "-Wall",
            "-Werror",
        ],
        ("cu", NVRTC_BUILTINS),
        sources,
        "the CUDA C does not compile as CUDA",
    );
}

/// Each `(what, source)` compiled by NVRTC itself with the options an artifact records
/// (`nvrtc_options("sm_90")`, plus `--ptxas-options=-v` for the assembler's report),
/// which needs `libnvrtc` but no GPU: with the `nvidia-cuda-nvrtc` wheel,
/// `LD_LIBRARY_PATH=…/site-packages/nvidia/cu13/lib`. Every function must assemble for
/// `sm_90` without spilling registers to local memory, and the regions, bias gradients,
/// layer norms and cross-entropies with no stack frame at all (their vectors of four,
/// rows and held groups in registers). Skipped with a printed reason
/// where NVRTC does not load (CI).
fn compiles_with_nvrtc(sources: &[(String, String)]) {
    use rayon::prelude::*;
    let version = match kiln_exec::cuda::nvrtc_available() {
        Ok(v) => v,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    let mut options = kiln_compiler::codegen::cuda::nvrtc_options("sm_90");
    options.push("--ptxas-options=-v".to_string());
    let reports: Vec<Vec<PtxasFunction>> = sources
        .par_iter()
        .map(|(what, source)| {
            let (_, log) = kiln_exec::cuda::nvrtc_compile_with_log(source, &options)
                .unwrap_or_else(|log| panic!("{what}: NVRTC {version} rejects the CUDA C:\n{log}"));
            let report = kiln_exec::cuda::ptxas_report(&log);
            assert!(!report.is_empty(), "{what}: no assembler report in\n{log}");
            for f in &report {
                // The regions' and bias gradients' vector groups, the layer norms' rows and
                // the cross-entropy's held groups stay in registers (CUDA's `sinf` and `cosf`
                // keep a local array for their slow argument reduction).
                let held = ["region_", "sum_rows_", "add_layer_norm", "xent_ls"];
                if held.iter().any(|p| f.name.starts_with(p)) {
                    // After `void`, or after a `__launch_bounds__(…)` attribute.
                    let head = format!(" {}(", f.name);
                    let body = source
                        .split(&head)
                        .nth(1)
                        .and_then(|b| b.split("\n}\n").next());
                    let body = body.unwrap_or_else(|| panic!("{what}: no text of `{}`", f.name));
                    if !body.contains("sinf(") && !body.contains("cosf(") {
                        assert_eq!(f.stack, 0, "{what}: `{}` has a stack frame", f.name);
                    }
                }
                assert!(
                    f.spill_stores == 0 && f.spill_loads == 0,
                    "{what}: `{}` spills registers for sm_90 ({} bytes stored, {} loaded; \
                     {} registers)",
                    f.name,
                    f.spill_stores,
                    f.spill_loads,
                    f.registers
                );
            }
            report
        })
        .collect();
    let all: Vec<&PtxasFunction> = reports.iter().flatten().collect();
    let most = all.iter().max_by_key(|f| f.registers).expect("functions");
    println!(
        "NVRTC {version} compiled {} units ({} functions) for sm_90: no spills; at most {} \
         registers (`{}`)",
        sources.len(),
        all.len(),
        most.registers,
        most.name
    );
    let tc = all.iter().filter(|f| f.name.contains("_tc_"));
    if let Some(f) = tc.max_by_key(|f| f.registers) {
        println!(
            "tensor-core attention: at most {} registers (`{}`)",
            f.registers, f.name
        );
    }
}

/// NVRTC's PTX is text for the asked architecture, and a unit it rejects comes back as
/// its log, naming the line (where NVRTC loads; skipped otherwise).
#[test]
fn nvrtc_gives_ptx_or_its_log() {
    if let Err(reason) = kiln_exec::cuda::nvrtc_available() {
        println!("skipped: {reason}");
        return;
    }
    let options = kiln_compiler::codegen::cuda::nvrtc_options("sm_90");
    let ptx = kiln_exec::cuda::nvrtc_compile(&code_of("cast").source(), &options).unwrap();
    assert!(ptx.contains(".target sm_90"), "{ptx}");
    assert!(!ptx.contains('\0'));
    let broken = "extern \"C\" __global__ void k(float* x) {\n    x[0] = undeclared;\n}\n";
    let err = kiln_exec::cuda::nvrtc_compile(broken, &options).unwrap_err();
    assert!(
        err.contains("NVRTC failed") && err.contains("undeclared"),
        "{err}"
    );
    assert!(err.contains("(2):"), "the line is named: {err}");
}

/// The report reader sees spills (so the no-spill check can fail), as NVRTC 13 prints
/// them, the stack frame and the shared memory.
#[test]
fn the_assemblers_report_is_read() {
    use kiln_exec::cuda::ptxas_report;
    let log = "ptxas info    : Compiling entry function 'attention_1' for 'sm_90'
ptxas info    : Function properties for attention_1
ptxas         .     40 bytes stack frame, 36 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 9088 bytes smem
ptxas info    : Function properties for relu_0
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 28 registers, used 0 barriers
";
    let r = ptxas_report(log);
    let got: Vec<(&str, u32, u32, u32, u32, u32)> = r
        .iter()
        .map(|f| {
            let n = f.name.as_str();
            (
                n,
                f.registers,
                f.stack,
                f.spill_stores,
                f.spill_loads,
                f.shared,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("attention_1", 255, 40, 36, 12, 9088),
            ("relu_0", 28, 0, 0, 0, 0)
        ]
    );
}

#[test]
fn every_program_compiles_as_cpp_under_the_host_shim() {
    let sources: Vec<(String, String)> = UNITS
        .iter()
        .map(|u| (u.to_string(), code_of(u).source()))
        .collect();
    compiles_as_cpp(&sources);
    compiles_as_cuda(&sources);
    compiles_with_nvrtc(&sources);
}

/// Every distinct shipped spec (`common::DISTINCT_SPECS`: every kernel kind, mask and
/// head shape) makes a mixed-precision program for every entry: no buffer needs two
/// types, parameters, gradients, the loss and Adam's state stay f32, and each program is
/// valid C++ under the host shim where `g++` exists. Its memory plan (bf16 buffers in
/// 2-byte elements) and the f32 one are sound — buffers sharing a slot are never live
/// at once and fit it — and the mixed arena is the smaller. Both programs (bf16 and
/// f32) compile under g++'s host shim, as CUDA under clang and with NVRTC, where each
/// is present.
#[test]
fn every_distinct_spec_emits_a_mixed_precision_program() {
    use rayon::prelude::*;
    let entries = [
        "train_step",
        "forward",
        "encode",
        "decode_step",
        "adam_update",
    ];
    let jobs: Vec<(String, &str)> = common::DISTINCT_SPECS
        .iter()
        .flat_map(|s| entries.iter().map(move |e| (s.to_string(), *e)))
        .collect();
    let sources: Vec<(String, String)> = jobs
        .par_iter()
        .map(|(spec, entry)| {
            let path = common::SPEC_DIRS
                .iter()
                .map(|d| root().join(d).join(spec))
                .find(|p| p.exists())
                .expect("a shipped spec");
            let g = common::entry_graph(&path, &["vocab=48"], entry).expect("the entry");
            let (kg, _) = optimize(&g, &Default::default()).expect("optimizes");
            let code = emit_with(&kg, Elem::Bf16)
                .unwrap_or_else(|e| panic!("{spec} {entry}: no bf16 program: {e}"));
            let mut bf16 = 0;
            for (v, value) in kg.values.iter().enumerate() {
                let e = code.storage[v][0];
                if matches!(value.def, kiln_compiler::optimize::kernels::Def::Param(_)) {
                    assert_eq!(e, Elem::F32, "{spec} {entry}: a parameter in bf16");
                }
                bf16 += usize::from(e == Elem::Bf16);
            }
            // The device trainer accumulates f32 gradients, and the loss stays f32.
            for (name, v) in &kg.outputs {
                if name.starts_with("grad.") || name == "loss" {
                    assert_eq!(
                        storage::of(&code.storage, &kg, *v),
                        Elem::F32,
                        "{spec} {entry}: output `{name}` in bf16"
                    );
                }
            }
            if *entry == "adam_update" {
                assert_eq!(bf16, 0, "{spec}: Adam keeps everything in f32");
            } else {
                assert!(bf16 > 10, "{spec} {entry}: {bf16} bf16 values");
            }
            let dims: BTreeMap<String, i64> = kg
                .dims
                .iter()
                .enumerate()
                .map(|(i, d)| (d.clone(), [8, 13, 11, 5][i % 4]))
                .collect();
            let f32_plan = MemoryPlan::build(&kg);
            let mixed = storage::memory_plan(&kg, &code.storage);
            for (what, plan) in [("f32", &f32_plan), ("mixed", &mixed)] {
                plan.check(&dims)
                    .unwrap_or_else(|e| panic!("{spec} {entry}: the {what} plan: {e}"));
            }
            // bf16 activations take fewer bytes: the mixed plan's live peak is below the
            // f32 one's. (At these small dims the f32 gradients of the 37,000-row
            // embedding dominate both, so by little, and the packed layouts can differ
            // the other way by the packer's gaps; the next test compares the arenas at
            // the benchmark's size.)
            let peak = |p: &MemoryPlan| p.live_peak(&dims).unwrap();
            let total = |p: &MemoryPlan| p.layout(&dims).unwrap().total;
            if *entry == "adam_update" {
                assert_eq!(
                    total(&mixed),
                    total(&f32_plan),
                    "{spec}: Adam's plan is the f32 one"
                );
            } else {
                assert!(
                    peak(&mixed) < peak(&f32_plan),
                    "{spec} {entry}: mixed live peak {} B, f32 {} B",
                    peak(&mixed),
                    peak(&f32_plan)
                );
            }
            let f32_code = emit(&kg).unwrap_or_else(|e| panic!("{spec} {entry}: {e}"));
            [
                (format!("{spec} {entry} bf16"), code.source()),
                (format!("{spec} {entry} f32"), f32_code.source()),
            ]
        })
        .collect::<Vec<_>>()
        .into_iter()
        .flatten()
        .collect();
    compiles_as_cpp(&sources);
    compiles_as_cuda(&sources);
    compiles_with_nvrtc(&sources);
}

/// The base model's `train_step` at the benchmark's batch (1,000 sentences of 25 source
/// and 25 target tokens, vocabulary 37,000): the mixed-precision arena, with its bf16
/// activations in 2-byte elements, is sound and at most 55% of the f32 one, and packing
/// the buffers by lifetime brings both within 2% of their live peaks (measured: 6.2 and
/// 12.2 GiB, exactly the live peaks, where the slots end to end take 10.0 and 19.6 GiB).
#[test]
fn the_mixed_precision_arena_of_the_base_train_step_is_about_half_the_f32_one() {
    let path = root().join("models/transformer_base.kiln");
    let g = common::entry_graph(&path, &["vocab=37000"], "train_step").expect("the entry");
    let (kg, _) = optimize(&g, &Default::default()).expect("optimizes");
    let code = emit_with(&kg, Elem::Bf16).expect("a bf16 program");
    let dims: BTreeMap<String, i64> = [("batch", 1000), ("src_len", 25), ("tgt_len", 25)]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
    let f32_plan = MemoryPlan::build(&kg);
    let mixed = storage::memory_plan(&kg, &code.storage);
    mixed.check(&dims).unwrap();
    f32_plan.check(&dims).unwrap();
    let (f32_layout, mixed_layout) = (
        f32_plan.layout(&dims).unwrap(),
        mixed.layout(&dims).unwrap(),
    );
    let (full, half) = (f32_layout.total, mixed_layout.total);
    let (full_peak, half_peak) = (
        f32_plan.live_peak(&dims).unwrap(),
        mixed.live_peak(&dims).unwrap(),
    );
    let mib = |b: usize| b as f64 / 1048576.0;
    println!(
        "base train_step at 25,000 + 25,000 tokens: f32 arena {:.1} MiB (slots {:.1}), \
         mixed {:.1} MiB (slots {:.1}), ratio {:.3}; live peaks {:.1} and {:.1} MiB",
        mib(full),
        mib(f32_layout.slots_total),
        mib(half),
        mib(mixed_layout.slots_total),
        half as f64 / full as f64,
        mib(full_peak),
        mib(half_peak)
    );
    assert!(20 * half <= 11 * full, "mixed {half} B, f32 {full} B");
    // Packing by lifetime reaches the live peak (within 2%), well under the slots.
    for (what, l, peak) in [
        ("f32", &f32_layout, full_peak),
        ("mixed", &mixed_layout, half_peak),
    ] {
        assert!(l.packed, "{what}: the slots were the smaller");
        assert!(
            50 * l.total <= 51 * peak,
            "{what}: arena {} B, live peak {peak} B",
            l.total
        );
        assert!(
            5 * l.total <= 4 * l.slots_total,
            "{what}: arena {} B, slots {} B",
            l.total,
            l.slots_total
        );
    }
    // Every bf16 kernel result is planned in 2-byte elements, every other in 4.
    for b in &mixed.buffers {
        let e = code.storage[b.value][b.output];
        assert_eq!(b.elem_bytes, e.bytes(), "%{}.{}", b.value, b.output);
    }
}

/// The base Transformer's mixed-precision `train_step` runs every attention on tensor
/// cores (heads of 64: `codegen::cuda::tensor`), forward and backward (one block per head
/// for sentences that fit a 32-row tile, else the query-side and key-side kernels); its
/// f32 program on the CUDA cores. The two kernels' text is
/// pinned (key padding, the encoder's self-attention).
#[test]
fn the_base_models_bf16_attention_runs_on_tensor_cores() {
    let path = root().join("models/transformer_base.kiln");
    let g = common::entry_graph(&path, &["vocab=37000"], "train_step").expect("the entry");
    let (kg, _) = optimize(&g, &Default::default()).expect("optimizes");
    let mixed = emit_with(&kg, Elem::Bf16).expect("a bf16 program");
    let fp32 = emit_with(&kg, Elem::F32).expect("an f32 program");
    // `KILN_CUDA_CORE_ATTENTION=1`: the bf16 program with its attention on the CUDA cores.
    let cores = kiln_compiler::codegen::cuda::program::emit_attention_on(&kg, Elem::Bf16, false)
        .expect("a bf16 program");
    assert_eq!(cores.storage, mixed.storage);
    let roles = |code: &CudaCode, role: &str| -> Vec<String> {
        code.kernels
            .iter()
            .filter_map(|k| k.functions.get(role).cloned())
            .collect()
    };
    // Encoder self, decoder self and cross attention in each of 6 layers.
    for (role, n) in [
        ("flash", 18),
        ("flash_short", 18),
        ("flash_q", 18),
        ("flash_kv", 18),
    ] {
        let names = roles(&mixed, role);
        assert_eq!(names.len(), n, "{role}");
        assert!(
            names.iter().all(|f| f.contains("_tc_")),
            "{role}: {names:?}"
        );
        for code in [&fp32, &cores] {
            let names = roles(code, role);
            assert_eq!(names.len(), n, "{role}");
            assert!(
                names.iter().all(|f| !f.contains("_tc")),
                "{role}: {names:?}"
            );
        }
    }
    let key = kiln_compiler::codegen::rows::MaskKind::Key;
    let tensor = kiln_compiler::codegen::cuda::tensor::forward("attention_tc_key", key, 64, 64);
    insta::assert_snapshot!("cuda_tensor_core_attention", tensor.text);
    let back = kiln_compiler::codegen::cuda::tensor::backward_short(
        "attention_bwd_short_tc_key",
        key,
        64,
        64,
    );
    insta::assert_snapshot!("cuda_tensor_core_attention_bwd_short", back.text);
    let text = |name: &str| mixed.function(name).map(|f| f.text.clone());
    let first = roles(&mixed, "flash");
    assert!(text(&first[0]).is_some_and(|t| t.contains("kiln_mma(")));
}
