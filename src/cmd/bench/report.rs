//! What `kiln bench` reports: the median, minimum and maximum per step, tokens per second,
//! peak memory, what the executor did (its arena, view copies, fused bias gradients,
//! product groups) and, with `--profile`, the last run's time per kernel kind and per
//! matrix product shape; as text or as one JSON object.

use std::collections::BTreeMap;

use kiln_exec::executor::{ExecutorKind, Product, Timing};

use super::device::precision;
use super::rig::Rig;
use super::timed::Measured;
use super::BenchArgs;

/// Peak resident set size of this process, bytes (Linux; 0 elsewhere).
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// What `--profile` gathered from the last run: seconds and count per kernel kind, and
/// per matrix product shape (under its kernel's kind).
#[derive(Default)]
pub(super) struct Profile {
    pub kinds: BTreeMap<String, (f64, usize)>,
    pub products: BTreeMap<(String, Product), (f64, usize)>,
}

impl Profile {
    pub fn note(&mut self, t: &Timing<'_>) {
        let e = self.kinds.entry(t.what.to_string()).or_insert((0.0, 0));
        e.0 += t.seconds;
        e.1 += 1;
        if let Some(p) = t.product {
            let e = self
                .products
                .entry((t.what.to_string(), p))
                .or_insert((0.0, 0));
            e.0 += t.seconds;
            e.1 += 1;
        }
    }

    /// The product shapes, most time first: `(kind, shape, seconds, count)`.
    pub fn products_by_time(&self) -> Vec<(&str, Product, f64, usize)> {
        let mut p: Vec<_> = self
            .products
            .iter()
            .map(|((k, p), (s, n))| (k.as_str(), *p, *s, *n))
            .collect();
        p.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.1.cmp(&b.1)));
        p
    }
}

/// How many product shapes the text profile lists (the JSON lists them all).
const PRODUCT_ROWS: usize = 12;

/// The timed runs' figures.
#[derive(Clone, Copy)]
struct Summary {
    med: f64,
    min: f64,
    max: f64,
    adam_med: f64,
    tokens: f64,
    rss: u64,
    threads: usize,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// The executor as measured: the CUDA executor's GEMM precision, the CPU's 16-bit product
/// kernel, what stays on the GPU, the GPUs of data parallelism.
fn executor_name(a: &BenchArgs, rig: &Rig) -> String {
    // The CUDA executor's GEMM precision is part of what was measured.
    let mut executor_name = if a.executor == ExecutorKind::Cuda {
        match kiln_exec::cuda::precision_label(precision(a)) {
            "fp32" => "cuda".to_string(),
            g => format!("cuda-{g}"),
        }
    } else if let Some(kernel) = rig.compiled.as_ref().and_then(|c| c.bf16_kernel()) {
        // `--gemm-type` on a CPU with a 16-bit kernel: the large products in 16 bits.
        match kernel {
            kiln_exec::compiled::Kernel16::Tiles => "compiled-bf16-products".to_string(),
            kiln_exec::compiled::Kernel16::Dot => "compiled-bf16-products-vdpbf16ps".to_string(),
            kiln_exec::compiled::Kernel16::Half => "compiled-fp16-products".to_string(),
            kiln_exec::compiled::Kernel16::Int16 => "compiled-int16-products".to_string(),
            kiln_exec::compiled::Kernel16::Int8 => "compiled-int8-products".to_string(),
        }
    } else {
        a.executor.to_string()
    };
    if rig.resident.is_some() {
        executor_name.push_str(" (state on the GPU)");
    }
    if rig.outputs_on_device {
        executor_name.push_str(" (outputs left on the GPU)");
    }
    if let Some(dp) = &rig.parallel {
        executor_name = format!(
            "{executor_name} x{} (GPUs {:?}, {})",
            dp.world_size(),
            dp.devices(),
            dp.engine()
        );
    }
    executor_name
}

pub(super) fn report(a: &BenchArgs, rig: &Rig, m: &Measured) {
    let times = &m.times;
    let ranks = rig.parallel.as_ref().map_or(1, |dp| dp.world_size());
    let tokens = match rig.entry.as_str() {
        "decode_step" => a.batch,
        _ => a.batch * a.tgt_len * ranks as i64,
    } as f64;
    let sum = Summary {
        med: median(times),
        min: times.iter().cloned().fold(f64::INFINITY, f64::min),
        max: times.iter().cloned().fold(0.0, f64::max),
        adam_med: median(&m.adam_times),
        tokens,
        rss: peak_rss(),
        threads: rayon::current_num_threads(),
    };
    let name = executor_name(a, rig);
    if a.json {
        json(a, rig, &m.profile, &sum, &name);
    } else {
        text(a, rig, &sum, &name);
        if let Some(c) = &rig.compiled {
            text_compiled(a, c);
        }
        if let Some(c) = &rig.cuda {
            text_cuda(a, c);
        }
        text_profile(a, &m.profile);
    }
}

fn json(a: &BenchArgs, rig: &Rig, profile: &Profile, s: &Summary, executor_name: &str) {
    let (compiled, cuda) = (&rig.compiled, &rig.cuda);
    let mut obj = serde_json::json!({
        "spec": a.spec.display().to_string(),
        "entry": a.entry,
        "executor": executor_name,
        "batch": a.batch, "src_len": a.src_len, "tgt_len": a.tgt_len,
        "threads": s.threads,
        "runs": a.runs, "warmup": a.warmup,
        "median_ms": s.med * 1e3, "min_ms": s.min * 1e3, "max_ms": s.max * 1e3,
        "adam_ms": s.adam_med * 1e3,
        "tokens_per_s": s.tokens / s.med,
        "peak_rss_bytes": s.rss,
        "setup_s": rig.setup,
    });
    if let Some(c) = &compiled {
        obj["arena_bytes"] = serde_json::json!(c.arena_bytes());
        obj["scratch_bytes"] = serde_json::json!(c.scratch_bytes());
        let (n, bytes) = c.view_copies();
        obj["view_copies"] = serde_json::json!({"count": n, "bytes": bytes});
        let (summed, separate) = c.bias_grad_counts();
        obj["bias_grads"] = serde_json::json!({"summed": summed, "separate": separate});
        let (groups, kernels) = c.product_groups();
        obj["product_groups"] = serde_json::json!({"groups": groups, "kernels": kernels});
    }
    if !profile.kinds.is_empty() {
        let kinds: serde_json::Map<String, serde_json::Value> = profile
            .kinds
            .iter()
            .map(|(k, (s, n))| (k.clone(), serde_json::json!({"ms": s * 1e3, "kernels": n})))
            .collect();
        let products: Vec<serde_json::Value> = profile
            .products_by_time()
            .into_iter()
            .map(|(k, p, s, n)| {
                serde_json::json!({
                    "kind": k, "batch": p.batch, "m": p.m, "k": p.k, "n": p.n,
                    "a_transposed": p.a_transposed, "b_transposed": p.b_transposed,
                    "count": n, "ms": s * 1e3,
                    "gflop_per_s": (s > 0.0).then(|| n as f64 * p.flops() / s / 1e9),
                })
            })
            .collect();
        obj["profile"] = serde_json::json!({"kinds": kinds, "products": products});
    }
    if let Some(c) = &cuda {
        let (fused, separate) = c.epilogue_counts();
        obj["bias_epilogues"] = serde_json::json!({"fused": fused, "separate": separate});
        let (fused, separate) = c.bias_grad_counts();
        obj["bias_grads"] = serde_json::json!({"fused": fused, "separate": separate});
        obj["arena_bytes"] = serde_json::json!(c.arena_bytes());
        let (n, bytes) = c.view_copies();
        obj["view_copies"] = serde_json::json!({"count": n, "bytes": bytes});
    }
    outln!("{obj}");
}

fn text(a: &BenchArgs, rig: &Rig, sum: &Summary, executor_name: &str) {
    let Summary {
        med,
        min,
        max,
        adam_med,
        tokens,
        rss,
        threads,
    } = *sum;
    let (adam, setup) = (&rig.adam, rig.setup);
    outln!(
        "bench {} entry={} executor={} batch={} src_len={} tgt_len={} threads={threads}",
        a.spec.display(),
        a.entry,
        executor_name,
        a.batch,
        a.src_len,
        a.tgt_len
    );
    outln!(
        "  median {:.1} ms/step (min {:.1}, max {:.1}; {} runs after {} warm-up){}",
        med * 1e3,
        min * 1e3,
        max * 1e3,
        a.runs,
        a.warmup,
        if adam.is_some() {
            format!("; Adam {:.1} ms of it", adam_med * 1e3)
        } else {
            String::new()
        }
    );
    outln!("  {:.0} target tokens/s", tokens / med);
    outln!(
        "  peak RSS {:.1} MiB; setup (compile, init) {:.2} s",
        rss as f64 / 1048576.0,
        setup
    );
}

/// The compiled executor's memory, and how it ran bias gradients and products.
fn text_compiled(a: &BenchArgs, c: &kiln_exec::compiled::Compiled) {
    outln!(
        "  arena {:.1} MiB (the memory plan at these dims)",
        c.arena_bytes() as f64 / 1048576.0
    );
    let (n, bytes) = c.view_copies();
    outln!(
        "  outside the arena: {:.1} MiB live at once for inputs, view copies and kernel \
         scratch ({n} view copies of {:.1} MiB in all)",
        c.scratch_bytes() as f64 / 1048576.0,
        bytes as f64 / 1048576.0
    );
    let (summed, separate) = c.bias_grad_counts();
    if summed + separate > 0 {
        outln!(
            "  bias gradients: {summed} summed by their weight gradient's product as it \
             packed dy, {separate} by sum_rows ({} runs)",
            a.warmup + a.runs
        );
    }
    let (groups, kernels) = c.product_groups();
    if groups > 0 {
        outln!(
            "  products of one left operand: {kernels} in {groups} groups that packed \
             it once ({} runs)",
            a.warmup + a.runs
        );
    }
}

/// The CUDA executor's memory, and how it ran bias epilogues and gradients.
fn text_cuda(a: &BenchArgs, c: &kiln_exec::cuda::CudaExecutor) {
    outln!(
        "  device arena {:.1} MiB (the memory plan at these dims)",
        c.arena_bytes() as f64 / 1048576.0
    );
    let (fused, separate) = c.epilogue_counts();
    if fused + separate > 0 {
        outln!(
            "  linear kernels with a bias: {fused} in one cuBLASLt call (bias epilogue), \
             {separate} as bias + GEMM (+ ReLU) ({} runs)",
            a.warmup + a.runs
        );
    }
    let (fused, separate) = c.bias_grad_counts();
    if fused + separate > 0 {
        outln!(
            "  bias gradients: {fused} summed by their weight gradient's GEMM (cuBLASLt \
             BGRADA epilogue), {separate} by sum_rows ({} runs)",
            a.warmup + a.runs
        );
    }
    let (n, bytes) = c.view_copies();
    outln!(
        "  view copies: {n} of {:.1} MiB in all (outside the arena)",
        bytes as f64 / 1048576.0
    );
}

/// `--profile`: the last run's time per kernel kind and per matrix product shape.
fn text_profile(a: &BenchArgs, profile: &Profile) {
    if !profile.kinds.is_empty() {
        let mut p: Vec<(String, (f64, usize))> = profile.kinds.clone().into_iter().collect();
        p.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        outln!("  time per kernel kind (last run):");
        // Whole-run figures (the CUDA executor's idle and issue times) come last.
        let (runs, kinds): (Vec<_>, Vec<_>) = p.into_iter().partition(|(k, _)| k.starts_with('['));
        let width = kinds
            .iter()
            .chain(&runs)
            .map(|(k, _)| k.chars().count())
            .max()
            .unwrap_or(0)
            .max(22);
        for (k, (s, n)) in kinds {
            outln!("    {k:<width$} {:>9.1} ms  {n:>5} kernels", s * 1e3);
        }
        for (k, (s, _)) in runs {
            outln!("    {k:<width$} {:>9.1} ms", s * 1e3);
        }
    }
    let products = profile.products_by_time();
    if !products.is_empty() {
        // GFLOP/s on the CPU, TFLOP/s on a GPU.
        let (unit, scale) = if a.executor == ExecutorKind::Cuda {
            ("TFLOP/s", 1e12)
        } else {
            ("GFLOP/s", 1e9)
        };
        let (secs, flops) = products.iter().fold((0.0, 0.0), |(s, f), (_, p, t, n)| {
            (s + t, f + *n as f64 * p.flops())
        });
        outln!(
            "  matrix products by shape (last run; m×k·k×n, ᵀ an operand stored \
             transposed): {} kernels, {:.1} ms, {:.1} {unit}",
            products.iter().map(|p| p.3).sum::<usize>(),
            secs * 1e3,
            flops / secs / scale
        );
        let shown = &products[..products.len().min(PRODUCT_ROWS)];
        let width = shown.iter().map(|p| p.0.chars().count()).max().unwrap_or(0);
        for (k, p, s, n) in shown {
            outln!(
                "    {:<28} {k:<width$} {n:>4} × {:>8.3} ms = {:>8.1} ms  {:>7.1} {unit}",
                p.to_string(),
                s * 1e3 / *n as f64,
                s * 1e3,
                *n as f64 * p.flops() / s / scale
            );
        }
        if products.len() > PRODUCT_ROWS {
            outln!(
                "    … {} more shapes (`--json` lists them all)",
                products.len() - PRODUCT_ROWS
            );
        }
    }
}
