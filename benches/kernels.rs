//! Kernel-level numbers of the CPU backend: GEMM GFLOP/s (the `gemm` crate as the
//! compiled executor calls it, and bf16 on AMX tiles where the CPU has them) and GB/s of generated memory-bound kernels (softmax,
//! add_layer_norm, Adam), each JIT-compiled from its CLIF text and launched over rayon
//! exactly as the executor launches it. `cargo bench --bench kernels`.

use std::time::Instant;

use kiln_compiler::codegen::jit::{compile, launch};
use kiln_compiler::codegen::{clif, misc, region, rows};
use kiln_compiler::ir::Float;
use kiln_compiler::optimize::regions::{Expr, Inst};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn main() {
    let threads = rayon::current_num_threads();
    println!(
        "kernels bench, {threads} threads, host {}",
        kiln_compiler::codegen::jit::host_description()
    );
    for n in [512usize, 1024, 2048] {
        let a = vec![0.5f32; n * n];
        let b = vec![0.25f32; n * n];
        let mut c = vec![0f32; n * n];
        let s = time(5, || unsafe {
            gemm::gemm(
                n,
                n,
                n,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                n as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(threads),
            )
        });
        println!(
            "gemm {n}^3: {:.1} ms, {:.1} GFLOP/s",
            s * 1e3,
            2.0 * (n * n * n) as f64 / s / 1e9
        );
    }
    // The same products with 16-bit operands (`--gemm-type 16bit`: AMX tiles, else
    // VDPBF16PS where it is fast, else scaled fp16 with AVX512-FP16, else int16; `cargo
    // bench --bench kernels -- amx|dot|fp16|int16` names one wherever it runs), with the
    // operands' rounding and packing counted: 2048³, then the base step's widest shapes.
    let named = std::env::args()
        .skip(1)
        .find_map(|a| kiln_exec::compiled::GemmType::parse(&a));
    let kernel = match named {
        Some(t) => t
            .kernel()
            .and_then(|k| k.ok_or_else(|| "f32 asks for no 16-bit kernel".to_string())),
        None => kiln_exec::compiled::Kernel16::best(),
    };
    for (m, k, n) in [
        (2048usize, 2048, 2048),
        (800, 512, 512),
        (800, 512, 2048),
        (800, 2048, 512),
        (800, 512, 37000),
    ] {
        let a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * n];
        let mut c = vec![0f32; m * n];
        let mut why = kernel.as_ref().err().cloned();
        let s = match &kernel {
            Ok(kernel) => time(9, || {
                if let Err(e) = kiln_exec::compiled::matmul16(*kernel, (m, k, n), &a, &b, &mut c) {
                    why = Some(e);
                }
            }),
            Err(_) => 0.0,
        };
        match why {
            Some(e) => {
                println!("16-bit gemm: skipped ({e})");
                break;
            }
            None => println!(
                "16-bit gemm ({}) {m}×{k}·{k}×{n}: {:.2} ms, {:.1} GFLOP/s",
                kernel.as_ref().map_or("", |k| k.name()),
                s * 1e3,
                2.0 * (m * k * n) as f64 / s / 1e9
            ),
        }
    }
    let funcs = [
        clif::text(&rows::softmax("softmax")),
        clif::text(&rows::add_layer_norm("ln", true, false)),
        clif::text(&misc::adam_update("adam")),
    ]
    .join("\n");
    let m = compile(&funcs).expect("kernels compile");
    // softmax over 800 × 37000 (the vocabulary projection's rows).
    let (r, cdim) = (800usize, 37000usize);
    let x = vec![0.1f32; r * cdim];
    let mut y = vec![0f32; r * cdim];
    let (dims, items) = rows::softmax_dims(r, cdim);
    let f = m.get("softmax").unwrap();
    let s = time(5, || unsafe {
        launch(
            f,
            &[x.as_ptr() as *mut u8, y.as_mut_ptr() as *mut u8],
            &dims,
            items,
            1,
        )
    });
    println!(
        "softmax 800x37000: {:.1} ms, {:.1} GB/s",
        s * 1e3,
        8.0 * (r * cdim) as f64 / s / 1e9
    );
    // add_layer_norm over 800 × 512.
    let (r, d) = (800usize, 512usize);
    let x = vec![0.1f32; r * d];
    let yv = vec![0.2f32; r * d];
    let g = vec![1f32; d];
    let bb = vec![0f32; d];
    let (inv_d, eps) = (1.0f32 / d as f32, 1e-5f32);
    let mut o = vec![0f32; r * d];
    let (dims, items) = rows::add_layer_norm_dims(r, d);
    let f = m.get("ln").unwrap();
    let ptrs = [
        x.as_ptr() as *mut u8,
        yv.as_ptr() as *mut u8,
        g.as_ptr() as *mut u8,
        bb.as_ptr() as *mut u8,
        &inv_d as *const f32 as *mut u8,
        &eps as *const f32 as *mut u8,
        o.as_mut_ptr() as *mut u8,
    ];
    let s = time(20, || unsafe { launch(f, &ptrs, &dims, items, 64) });
    println!(
        "add_layer_norm 800x512: {:.3} ms, {:.1} GB/s",
        s * 1e3,
        12.0 * (r * d) as f64 / s / 1e9
    );
    // Adam over 18.9M elements (the shared embedding table of base at vocab 37000).
    let n = 37000 * 512;
    let mut p = vec![0.1f32; n];
    let gr = vec![0.01f32; n];
    let mut mm = vec![0f32; n];
    let mut vv = vec![0f32; n];
    let k = [0.9f32, 0.98, 0.1, 0.02, 1e-9, 1e-4, 1.0];
    let (dims, items) = misc::adam_update_dims(n);
    let f = m.get("adam").unwrap();
    let s = time(5, || {
        let mut ptrs = vec![
            p.as_mut_ptr() as *mut u8,
            gr.as_ptr() as *mut u8,
            mm.as_mut_ptr() as *mut u8,
            vv.as_mut_ptr() as *mut u8,
        ];
        ptrs.extend(k.iter().map(|c| c as *const f32 as *mut u8));
        ptrs.extend([
            p.as_mut_ptr() as *mut u8,
            mm.as_mut_ptr() as *mut u8,
            vv.as_mut_ptr() as *mut u8,
        ]);
        unsafe { launch(f, &ptrs, &dims, items, 32) }
    });
    println!(
        "adam_update 18.9M params: {:.1} ms, {:.1} GB/s",
        s * 1e3,
        28.0 * n as f64 / s / 1e9
    );
    dropout_region();
    sum_rows();
    xent_ls();
}

/// The label-smoothed cross-entropy with its gradient over the logits of base's
/// `train_step` (800 target tokens × vocabulary 37000): one `exp` per logit.
fn xent_ls() {
    let m = compile(&clif::text(&rows::xent_ls("xent"))).expect("xent_ls compiles");
    let (r, v) = (800usize, 37000usize);
    let x: Vec<f32> = (0..r * v)
        .map(|i| ((i * 7919) % 1000) as f32 * 0.01 - 5.0)
        .collect();
    let target: Vec<i32> = (0..r as i32).map(|i| i * 13 % v as i32).collect();
    let (c_nll, c_smooth, inv_v, inv_den) = (0.9f32, 0.1f32, 1.0 / v as f32, 1.0 / r as f32);
    let mut row_loss = vec![0f32; r];
    let mut d = vec![0f32; r * v];
    let (dims, items) = rows::xent_ls_dims(r, v, -1);
    let k = m.get("xent").unwrap();
    let s = time(9, || unsafe {
        launch(
            k,
            &[
                x.as_ptr() as *mut u8,
                target.as_ptr() as *mut u8,
                &c_nll as *const f32 as *mut u8,
                &c_smooth as *const f32 as *mut u8,
                &inv_v as *const f32 as *mut u8,
                &inv_den as *const f32 as *mut u8,
                row_loss.as_mut_ptr() as *mut u8,
                d.as_mut_ptr() as *mut u8,
            ],
            &dims,
            items,
            1,
        )
    });
    println!(
        "xent_ls 800x37000 (loss + gradient): {:.1} ms, {:.1} ns/logit",
        s * 1e3,
        s * 1e9 / (r * v) as f64
    );
}

/// A bias gradient: `sum_rows` of `[32, 25, 512]` (two leading axes) into `[512]`.
fn sum_rows() {
    let shape = [32usize, 25, 512];
    let m = compile(&clif::text(&misc::sum_rows("sum_rows", 2))).expect("sum_rows compiles");
    let n: usize = shape.iter().product();
    let x = vec![0.5f32; n];
    let mut y = vec![0f32; 512];
    let (dims, items) = misc::sum_rows_dims(&shape);
    let k = m.get("sum_rows").unwrap();
    let s = time(50, || unsafe {
        launch(
            k,
            &[x.as_ptr() as *mut u8, y.as_mut_ptr() as *mut u8],
            &dims,
            items,
            1,
        )
    });
    println!(
        "sum_rows 32x25x512 -> 512: {:.3} ms, {:.1} GB/s",
        s * 1e3,
        4.0 * n as f64 / s / 1e9
    );
}

/// A dropout region over `[32, 25, 512]` (a residual branch of the base model's
/// training step): mostly drawing the Philox masks (`kiln_dropout_masks`, AVX-512 where
/// the CPU has it).
fn dropout_region() {
    let shape = [32usize, 25, 512];
    let expr = Expr {
        out: kiln_compiler::TensorType {
            dtype: kiln_compiler::DType::F32,
            shape: kiln_compiler::Shape::consts(&[32, 25, 512]),
        },
        inputs: 1,
        insts: vec![Inst::In(0), Inst::Dropout(Float::new(0.1), 5, 0)],
    };
    let inner = [true];
    let f = region::region("dropout", &expr, &inner).expect("region builds");
    let m = compile(&clif::text(&f)).expect("region compiles");
    let n: usize = shape.iter().product();
    let x = vec![1f32; n];
    let mut y = vec![0f32; n];
    let strides: Vec<isize> = vec![25 * 512, 512, 1];
    let (dims, items) = region::region_dims(&expr, &shape, &[strides], 42, 7);
    let k = m.get("dropout").unwrap();
    let s = time(20, || unsafe {
        launch(
            k,
            &[x.as_ptr() as *mut u8, y.as_mut_ptr() as *mut u8],
            &dims,
            items,
            64,
        )
    });
    println!(
        "dropout region 32x25x512: {:.2} ms, {:.2} ns/element",
        s * 1e3,
        s * 1e9 / n as f64
    );
}
