//! The generated CUDA C compiled and run on the host, against the CPU kernels.
//!
//! In: kernels emitted by `codegen::cuda` and their CPU twins from `codegen::{region,
//! rows, misc}`. Out: pass/fail. With `g++` on the path (else each test prints
//! `skipped: …`), every kernel's text is compiled as C++20 after a small shim that
//! plays CUDA: `__global__`/`__device__` vanish, `__shared__` is a static, every block
//! runs as `blockDim.x` host threads with `__syncthreads()` a `std::barrier`, blocks run
//! one after another, `__umulhi` and `__int_as_float` are plain C++. The kernels run with
//! 4 threads per block and 3 blocks (so grid-stride loops, the block reduction tree and
//! the barriers are all exercised) on the same random data as the JIT-compiled CPU
//! kernels, and must agree: bit for bit where the module documentation of
//! `codegen::cuda` promises it (Philox dropout masks, Adam, `embed_pe`, reductions
//! across rows, copies, fills, relu), else within `1e-5·max|cpu| + 1e-6` (row and
//! column sums in another order, libm's `expf`/`logf` against the CPU's polynomials).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kiln_compiler::codegen::clif::{text, Reduce};
use kiln_compiler::codegen::cuda::host::SHIM;
use kiln_compiler::codegen::cuda::text::{prelude, Elem, MAX_DIMS};
use kiln_compiler::codegen::cuda::{self, CudaFunction};
use kiln_compiler::codegen::misc::{self, ReduceLayout};
use kiln_compiler::codegen::rows::{self, MaskKind};
use kiln_compiler::codegen::{jit, region};
use kiln_compiler::ir::Float;
use kiln_compiler::optimize::regions::{Expr, Inst};
use kiln_compiler::optimize::templates::LnForm;
use kiln_compiler::{DType, Shape, TensorType};

/// Reads the buffers and the launch from stdin, runs the kernel, writes the buffers.
const DRIVER: &str = r#"
static void kiln_read(void* p, size_t n) {
    if (n && fread(p, 1, n, stdin) != n) { fprintf(stderr, "short read\n"); exit(2); }
}
int main() {
    unsigned n;
    kiln_read(&n, 4);
    std::vector<std::vector<unsigned char>> b(n);
    for (unsigned k = 0; k < n; ++k) {
        unsigned long long len;
        kiln_read(&len, 8);
        b[k].resize(len + 4);
        kiln_read(b[k].data(), len);
        b[k].resize(len);
    }
    kiln_dims dims;
    kiln_read(dims.d, sizeof dims.d);
    long long items;
    unsigned grid, block;
    kiln_read(&items, 8);
    kiln_read(&grid, 4);
    kiln_read(&block, 4);
    kiln_launch(grid, block, [&]() { KILN_CALL; });
    for (unsigned k = 0; k < n; ++k) fwrite(b[k].data(), 1, b[k].size(), stdout);
    return 0;
}
"#;

const BLOCK: u32 = 4;
const GRID: u32 = 3;

/// The host C++ compiler, or `None` with the skip printed.
fn gxx() -> Option<&'static str> {
    let ok = Command::new("g++")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        println!("skipped: no g++ on the path to compile the CUDA C on the host");
        return None;
    }
    Some("g++")
}

/// A fresh directory per kernel run (tests run in parallel).
fn work_dir() -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("kiln-cuda-host-{}-{k}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// How every kernel is compiled.
const CXX_FLAGS: [&str; 6] = [
    "-std=c++20",
    "-O1",
    "-ffp-contract=off",
    "-pthread",
    "-Wall",
    "-Werror",
];

/// The standard headers the shim includes, precompiled once per test process with
/// [`CXX_FLAGS`] (about half of each kernel's compile time is theirs): the header to
/// `-include`, or `None` where the compiler makes no precompiled header (then each
/// kernel parses them itself, as the shim includes them anyway).
fn precompiled_headers(cxx: &str) -> Option<&'static Path> {
    static PCH: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    PCH.get_or_init(|| {
        let dir = work_dir();
        let header = dir.join("kiln_shim_std.h");
        let includes: String = SHIM
            .lines()
            .filter(|l| l.starts_with("#include <"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&header, includes).ok()?;
        let ok = Command::new(cxx)
            .args(CXX_FLAGS)
            .args(["-x", "c++-header"])
            .arg(&header)
            .arg("-o")
            .arg(dir.join("kiln_shim_std.h.gch"))
            .output()
            .is_ok_and(|o| o.status.success());
        ok.then_some(header)
    })
    .as_deref()
}

/// Compiles `f` (with the prelude and the driver, and `pre`, C++ lines between the shim
/// and the prelude) into an executable.
fn build_with(cxx: &str, dir: &Path, f: &CudaFunction, pre: &str) -> PathBuf {
    let args: Vec<String> = f
        .params
        .iter()
        .enumerate()
        .map(|(k, p)| format!("({})b[{k}].data()", p.c_type))
        .collect();
    let call = format!("{}({}, dims, items)", f.name, args.join(", "));
    let src = format!(
        "{SHIM}\n{pre}\n{}\n{}\n#define KILN_CALL {call}\n{DRIVER}",
        prelude(),
        f.text
    );
    // A program already built in this process (the same function at other shapes or
    // grids) is run again: its executable is kept in a directory of the process.
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    static KEPT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some((_, exe)) = BUILT.lock().unwrap().iter().find(|(s, _)| *s == src) {
        return exe.clone();
    }
    let kept = KEPT.get_or_init(work_dir);
    let path = dir.join(format!("{}.cpp", f.name));
    std::fs::write(&path, &src).expect("write source");
    let exe = kept.join(format!(
        "{}-{}",
        f.name,
        dir.file_name().unwrap().to_string_lossy()
    ));
    let mut cmd = Command::new(cxx);
    cmd.args(CXX_FLAGS);
    if let Some(pch) = precompiled_headers(cxx) {
        cmd.arg("-include").arg(pch);
    }
    let out = cmd
        .arg(&path)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("g++ runs");
    assert!(
        out.status.success(),
        "{} does not compile:\n{}\n{src}",
        f.name,
        String::from_utf8_lossy(&out.stderr)
    );
    BUILT.lock().unwrap().push((src, exe.clone()));
    exe
}

/// Runs `f` on the host over `bufs` (updated in place).
fn run(cxx: &str, f: &CudaFunction, bufs: &mut [Vec<u8>], dims: &[i64], items: u64) {
    run_with(cxx, f, bufs, dims, items, (GRID, BLOCK))
}

/// [`run`] with `(grid, block)`.
fn run_with(
    cxx: &str,
    f: &CudaFunction,
    bufs: &mut [Vec<u8>],
    dims: &[i64],
    items: u64,
    launch: (u32, u32),
) {
    run_pre(cxx, f, bufs, dims, items, launch, "")
}

/// [`run_with`], compiled with `pre` between the shim and the prelude ([`build_with`]).
fn run_pre(
    cxx: &str,
    f: &CudaFunction,
    bufs: &mut [Vec<u8>],
    dims: &[i64],
    items: u64,
    (grid, block): (u32, u32),
    pre: &str,
) {
    assert_eq!(
        bufs.len(),
        f.params.len(),
        "{}: one buffer per parameter",
        f.name
    );
    let dir = work_dir();
    let exe = build_with(cxx, &dir, f, pre);
    let mut input = Vec::new();
    input.extend((bufs.len() as u32).to_le_bytes());
    for b in bufs.iter() {
        input.extend((b.len() as u64).to_le_bytes());
        input.extend(b);
    }
    assert!(dims.len() <= MAX_DIMS);
    for k in 0..MAX_DIMS {
        input.extend(dims.get(k).copied().unwrap_or(0).to_le_bytes());
    }
    input.extend((items as i64).to_le_bytes());
    input.extend(grid.to_le_bytes());
    input.extend(block.to_le_bytes());
    let mut child = Command::new(&exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the kernel runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(&input)
        .expect("feed the kernel");
    let out = child.wait_with_output().expect("kernel output");
    assert!(
        out.status.success(),
        "{} failed: {}",
        f.name,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut at = 0;
    for b in bufs.iter_mut() {
        let n = b.len();
        b.copy_from_slice(&out.stdout[at..at + n]);
        at += n;
    }
    assert_eq!(at, out.stdout.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// [`run_with`] with buffer `out` the same memory as buffer `into` (a kernel's output
/// written over one of its inputs): the function's parameter `out` becomes a local alias
/// of `into`'s. Afterwards `bufs[out]` is a copy of `bufs[into]`.
#[allow(clippy::too_many_arguments)]
fn run_in_place(
    cxx: &str,
    f: &CudaFunction,
    bufs: &mut Vec<Vec<u8>>,
    dims: &[i64],
    items: u64,
    launch: (u32, u32),
    out: usize,
    into: usize,
) {
    let mut g = f.clone();
    let p = g.params.remove(out);
    let decl = format!("{} {}", p.c_type, p.name);
    let sig = format!(", {decl}");
    assert!(g.text.contains(&sig), "{}: no parameter `{decl}`", f.name);
    g.text = g.text.replacen(&sig, "", 1);
    let body = g.text.find("{\n").expect("a body") + 2;
    let alias = format!("    {decl} = ({})({});\n", p.c_type, f.params[into].name);
    g.text.insert_str(body, &alias);
    let kept = bufs.remove(out);
    run_with(cxx, &g, bufs, dims, items, launch);
    bufs.insert(out, kept);
    bufs[out] = bufs[into].clone();
}

/// Runs the CPU kernel built as `clif` over `items` in a few uneven calls.
fn run_cpu(
    clif: &cranelift_codegen::ir::Function,
    name: &str,
    bufs: &mut [Vec<u8>],
    dims: &[i64],
    items: usize,
) {
    let src = text(clif);
    let m = jit::compile(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let k = m.get(name).expect("the CPU kernel");
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let mut lo = 0;
    while lo < items {
        let hi = (lo + 3).min(items);
        // SAFETY: every buffer is sized for the kernel's dims.
        unsafe { k(ptrs.as_ptr(), dims.as_ptr(), lo as i64, hi as i64) };
        lo = hi;
    }
}

/// The CPU `adam_update` kernel over `n` elements (buffers in its order).
fn run_cpu_adam(bufs: &mut [Vec<u8>], n: usize) {
    let (dims, items) = misc::adam_update_dims(n);
    run_cpu(
        &misc::adam_update("adam_update_0"),
        "adam_update_0",
        bufs,
        &dims,
        items,
    );
}

// ---------------------------------------------------------------------------------------
// Data.

/// xorshift64*: deterministic test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    fn floats(&mut self, n: usize, lo: f32, hi: f32) -> Vec<u8> {
        (0..n)
            .flat_map(|_| self.uniform(lo, hi).to_le_bytes())
            .collect()
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i32s(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn as_f32(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn zeros(n: usize) -> Vec<u8> {
    vec![0; 4 * n]
}

fn exact(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: sizes");
    for (i, (a, b)) in as_f32(got).iter().zip(as_f32(want)).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{what}: element {i}: {a} vs {b}");
    }
}

fn close(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: sizes");
    let (g, w) = (as_f32(got), as_f32(want));
    let max = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    let tol = 1e-5 * max + 1e-6;
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol,
            "{what}: element {i}: cuda {a}, cpu {b} (tolerance {tol})"
        );
    }
}

/// `v` rounded to bf16, as buffer bytes.
fn bf16s(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

/// bf16 buffer bytes, widened.
fn from_bf16(b: &[u8]) -> Vec<f32> {
    b.chunks(2)
        .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect()
}

/// f32 buffer bytes rounded to bf16 and widened again (what a bf16 operand holds).
fn through_bf16(b: &[u8]) -> Vec<u8> {
    f32s(&from_bf16(&bf16s(&as_f32(b))))
}

/// A bf16 result against an f32 one: within `2⁻⁷·max|want| + 1e-6`.
fn close_bf16(what: &str, got: &[u8], want: &[f32]) {
    let g = from_bf16(got);
    assert_eq!(g.len(), want.len(), "{what}: sizes");
    let max = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let tol = max / 128.0 + 1e-6;
    for (i, (a, b)) in g.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol,
            "{what}: element {i}: bf16 {a}, f32 {b} (tolerance {tol})"
        );
    }
}

/// A scalar operand.
fn one(v: f32) -> Vec<u8> {
    f32s(&[v])
}

// ---------------------------------------------------------------------------------------
// Tests.

#[test]
fn dropout_masks_match_the_cpu_kernel_and_philox_bit_for_bit() {
    let Some(cxx) = gxx() else { return };
    let (r, c) = (7usize, 13usize);
    let expr = Expr {
        out: TensorType::new(DType::F32, Shape::consts(&[r as i64, c as i64])),
        inputs: 1,
        insts: vec![
            Inst::In(0),
            Inst::Dropout(Float::new(0.3), 6, 0),
            Inst::Const(Float::new(0.25), DType::F32),
            Inst::Bin(kiln_compiler::ir::BinaryOp::Max, 1, 2),
        ],
    };
    let f = cuda::region::region("region_0", &expr, &[true], &[DType::F32]).expect("emits");
    let cpu = region::region("region_0", &expr, &[true]).expect("CPU region");
    let seed = 0x0123_4567_89ab_cdef_u64;
    let step = 77;
    let strides = vec![vec![c as isize, 1]];
    let (dims, rows_n) = region::region_dims(&expr, &[r, c], &strides, seed, step);
    let mut rng = Rng(3);
    let x = rng.floats(r * c, -1.0, 2.0);
    let mut g = vec![x.clone(), zeros(r * c)];
    run(cxx, &f, &mut g, &dims, (r * c) as u64);
    let mut h = vec![x.clone(), zeros(r * c)];
    run_cpu(&cpu, "region_0", &mut h, &dims, rows_n);
    exact("dropout region", &g[1], &h[1]);
    // And the mask is crate::rng's.
    let th = kiln_compiler::rng::dropout_threshold(0.3);
    let xs = as_f32(&x);
    let scale = (1.0 / (1.0 - 0.3f64)) as f32;
    for (i, y) in as_f32(&g[1]).iter().enumerate() {
        let keep = kiln_compiler::rng::dropout_keep(seed, step, 6, i as u64, th);
        let want = if keep { xs[i] * scale } else { 0.0 }.max(0.25);
        assert_eq!(y.to_bits(), want.to_bits(), "element {i}");
    }
}

/// A rank-4 region (four elements per thread: the column steps and carries into three
/// leading indices) over a contiguous input, a transposed one and one broadcast along two
/// axes and its columns, with a dropout: bit-identical to the CPU kernel for shapes whose
/// rows are not a multiple of four (one element at a time) and for shapes whose rows are
/// (vector loads and stores), on several grids.
#[test]
fn rank_four_regions_carry_their_indices_as_the_cpu_does() {
    use kiln_compiler::ir::BinaryOp;
    let Some(cxx) = gxx() else { return };
    for (shape, grid) in [
        ([2usize, 3, 5, 7], (3u32, 4u32)),
        ([1, 1, 3, 1], (1, 2)),
        ([3, 2, 1, 6], (2, 8)),
        // Rows of 8 and 4: every group in one row, every stride a multiple of 4, so the
        // groups take the vector loads.
        ([2, 3, 5, 8], (3, 4)),
        ([3, 2, 3, 4], (2, 32)),
    ] {
        let [a, b, c, d] = shape;
        let n = a * b * c * d;
        let expr = Expr {
            out: TensorType::new(
                DType::F32,
                Shape::consts(&[a as i64, b as i64, c as i64, d as i64]),
            ),
            inputs: 3,
            insts: vec![
                Inst::In(0),
                Inst::In(1),
                Inst::Bin(BinaryOp::Mul, 0, 1),
                Inst::In(2),
                Inst::Bin(BinaryOp::Add, 2, 3),
                Inst::Dropout(Float::new(0.4), 3, 4),
            ],
        };
        // in0 contiguous; in1 stored [c, b, a, d] (leading axes permuted); in2 [b]
        // broadcast over a, c and the columns.
        let strides = vec![
            vec![(b * c * d) as isize, (c * d) as isize, d as isize, 1],
            vec![d as isize, (a * d) as isize, (a * b * d) as isize, 1],
            vec![0, 1, 0, 0],
        ];
        let inner = [true, true, false];
        let dtypes = [DType::F32; 3];
        let f = cuda::region::region("region_0", &expr, &inner, &dtypes).expect("emits");
        assert_eq!(f.work, cuda::Work::Quads);
        let cpu = region::region("region_0", &expr, &inner).expect("CPU region");
        let (dims, rows_n) = region::region_dims(&expr, &shape, &strides, 0xfeed, 5);
        let mut rng = Rng(n as u64);
        let bufs = vec![
            rng.floats(n, -1.0, 1.0),
            rng.floats(n, -1.0, 1.0),
            rng.floats(b, -1.0, 1.0),
            f32s(&vec![f32::NAN; n]),
        ];
        let mut g = bufs.clone();
        run_with(cxx, &f, &mut g, &dims, n as u64, grid);
        let mut h = bufs.clone();
        run_cpu(&cpu, "region_0", &mut h, &dims, rows_n);
        exact(&format!("region {shape:?}"), &g[3], &h[3]);
        // And by the definition.
        let (x, y, z) = (as_f32(&bufs[0]), as_f32(&bufs[1]), as_f32(&bufs[2]));
        let th = kiln_compiler::rng::dropout_threshold(0.4);
        let scale = (1.0 / (1.0 - 0.4f64)) as f32;
        let got = as_f32(&g[3]);
        for i in 0..n {
            let (i0, i1, i2, i3) = (i / (b * c * d), i / (c * d) % b, i / d % c, i % d);
            let v = x[i] * y[((i2 * b + i1) * a + i0) * d + i3] + z[i1];
            let keep = kiln_compiler::rng::dropout_keep(0xfeed, 5, 3, i as u64, th);
            let want = if keep { v * scale } else { 0.0 };
            assert_eq!(got[i].to_bits(), want.to_bits(), "{shape:?} element {i}");
        }
    }
}

#[test]
fn adam_embed_pe_and_column_kernels_are_bit_identical_to_the_cpu() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(11);
    // Adam.
    let n = 37;
    let mut bufs = vec![
        rng.floats(n, -1.0, 1.0),
        rng.floats(n, -0.1, 0.1),
        rng.floats(n, -0.01, 0.01),
        rng.floats(n, 0.0, 0.001),
    ];
    for s in [0.9f32, 0.98, 0.1, 0.02, 1e-9, 3e-4, 1.2] {
        bufs.push(one(s));
    }
    bufs.extend([zeros(n), zeros(n), zeros(n)]);
    let mut g = bufs.clone();
    let f = cuda::misc::adam_update("adam_update_0", Elem::F32);
    run(cxx, &f, &mut g, &[n as i64], n as u64);
    let mut h = bufs.clone();
    run_cpu_adam(&mut h, n);
    for k in 11..14 {
        exact("adam", &g[k], &h[k]);
    }

    // embed_pe with dropout.
    let (vocab, d, b, t) = (11usize, 6usize, 2usize, 5usize);
    let ids: Vec<i32> = (0..b * t).map(|i| ((i * 7 + 3) % vocab) as i32).collect();
    let bufs = vec![
        rng.floats(vocab * d, -1.0, 1.0),
        i32s(&ids),
        rng.floats(t * d, -1.0, 1.0),
        one(2.5),
        zeros(b * t * d),
    ];
    let (dims, items) = region::embed_pe_dims([b, t, d], Some((0.2, 9)), (42, 3));
    let mut g = bufs.clone();
    run(
        cxx,
        &cuda::region::embed_pe("embed_pe_0", true),
        &mut g,
        &dims,
        (b * t * d) as u64,
    );
    let mut h = bufs.clone();
    run_cpu(
        &region::embed_pe("embed_pe_0", true),
        "embed_pe_0",
        &mut h,
        &dims,
        items,
    );
    exact("embed_pe", &g[4], &h[4]);

    // sum_rows: the partial sums and their finish (its own test: not bit-identical).

    // Reductions across rows (sum, max) and along rows (max, with ties of zeros and a NaN).
    for op in [Reduce::Sum, Reduce::Max] {
        let (outer, len, inner) = (3usize, 5usize, 7usize);
        let x = rng.floats(outer * len * inner, -1.0, 1.0);
        let (dims, items) = misc::reduce_dims(ReduceLayout::Across, outer, len, inner);
        let mut g = vec![x.clone(), zeros(outer * inner)];
        let f = cuda::misc::reduce("reduce_0", op, ReduceLayout::Across);
        run(cxx, &f, &mut g, &dims, (outer * inner) as u64);
        let mut h = vec![x.clone(), zeros(outer * inner)];
        run_cpu(
            &misc::reduce("reduce_0", op, ReduceLayout::Across),
            "reduce_0",
            &mut h,
            &dims,
            items,
        );
        exact(&format!("reduce {op:?} across"), &g[1], &h[1]);
    }
    let rows_x = [
        -1.0f32,
        -0.0,
        0.0,
        -2.0,
        -0.5, // max 0: the first zero, -0.0
        1.0,
        f32::NAN,
        3.0,
        2.0,
        0.5, // a NaN
        -3.0,
        -1.0,
        -2.0,
        -1.0,
        -4.0, // ties
    ];
    let x = f32s(&rows_x);
    let (dims, items) = misc::reduce_dims(ReduceLayout::Rows, 3, 5, 1);
    let mut g = vec![x.clone(), zeros(3)];
    run(
        cxx,
        &cuda::misc::reduce("reduce_0", Reduce::Max, ReduceLayout::Rows),
        &mut g,
        &dims,
        3,
    );
    let mut h = vec![x.clone(), zeros(3)];
    run_cpu(
        &misc::reduce("reduce_0", Reduce::Max, ReduceLayout::Rows),
        "reduce_0",
        &mut h,
        &dims,
        items,
    );
    exact("reduce max rows", &g[1], &h[1]);
    assert_eq!(as_f32(&g[1])[0].to_bits(), (-0.0f32).to_bits());

    // Fill, relu, strided copy (a transposed view read backwards along one axis).
    let (rows_n, n) = (5usize, 7usize);
    let bias = rng.floats(n, -1.0, 1.0);
    let (dims, items) = misc::rows_dims(rows_n, n);
    let mut g = vec![bias.clone(), zeros(rows_n * n)];
    run(
        cxx,
        &cuda::misc::fill_rows("fill_rows_0", Elem::F32),
        &mut g,
        &dims,
        (rows_n * n) as u64,
    );
    let mut h = vec![bias.clone(), zeros(rows_n * n)];
    run_cpu(
        &misc::fill_rows("fill_rows_0"),
        "fill_rows_0",
        &mut h,
        &dims,
        items,
    );
    exact("fill_rows", &g[1], &h[1]);
    let mut y = as_f32(&rng.floats(23, -1.0, 1.0));
    y[3] = f32::NAN;
    y[4] = -0.0;
    let (dims, items) = misc::relu_dims(23);
    let mut g = vec![f32s(&y)];
    run(
        cxx,
        &cuda::misc::relu("relu_0", Elem::F32),
        &mut g,
        &dims,
        23,
    );
    let mut h = vec![f32s(&y)];
    run_cpu(&misc::relu("relu_0"), "relu_0", &mut h, &dims, items);
    exact("relu", &g[0], &h[0]);
    // out[i, j] = src[i + 6·j]: a transposed view, shape [6, 4], strides [1, 6].
    let src = rng.floats(24, -1.0, 1.0);
    let (dims, items) = misc::copy_strided_dims(&[6, 4], &[1, 6]);
    let mut g = vec![src.clone(), zeros(24)];
    run(
        cxx,
        &cuda::misc::copy_strided("copy_strided_0"),
        &mut g,
        &dims,
        24,
    );
    let mut h = vec![src.clone(), zeros(24)];
    run_cpu(
        &misc::copy_strided("copy_strided_0", false),
        "copy_strided_0",
        &mut h,
        &dims,
        items,
    );
    exact("copy_strided", &g[1], &h[1]);
    assert_eq!(as_f32(&g[1])[1], as_f32(&src)[6]);
    // Rank 5 (four elements a thread carrying through every axis, an axis of 1): the
    // view [2, 3, 1, 5, 3] of a buffer stored as [3, 5, 2, 3] (axes 1, 3, 0, 4).
    let shape = [2usize, 3, 1, 5, 3];
    let strides = [3i64, 30, 90, 6, 1];
    let n: usize = shape.iter().product();
    let src = rng.floats(n, -1.0, 1.0);
    let (dims, items) = misc::copy_strided_dims(&shape, &strides);
    for launch in [(GRID, BLOCK), (1, 1), (2, 32)] {
        let mut g = vec![src.clone(), zeros(n)];
        run_with(
            cxx,
            &cuda::misc::copy_strided("copy_strided_0"),
            &mut g,
            &dims,
            n as u64,
            launch,
        );
        let mut h = vec![src.clone(), zeros(n)];
        run_cpu(
            &misc::copy_strided("copy_strided_0", false),
            "copy_strided_0",
            &mut h,
            &dims,
            items,
        );
        exact("copy_strided rank 5", &g[1], &h[1]);
        let (got, x) = (as_f32(&g[1]), as_f32(&src));
        let mut i = 0;
        for a in 0..2 {
            for b in 0..3 {
                for d in 0..5 {
                    for e in 0..3 {
                        let at = a as i64 * strides[0]
                            + b as i64 * strides[1]
                            + d as i64 * strides[3]
                            + e as i64 * strides[4];
                        assert_eq!(got[i], x[at as usize], "element {i}");
                        i += 1;
                    }
                }
            }
        }
    }
}

/// `sum_rows` in two kernels (partial sums of 128-row chunks by 32-column blocks, then
/// the chunks in order) against an f64 sum and the CPU kernel: one row, rows across
/// chunks (300 = 2·128 + 44), columns across tiles (37 = 32 + 5), one and two leading
/// axes, blocks of 4 (one lane looping over the columns), 48 (a warp and idle threads),
/// 64 and 256 threads (2 and 8 warps per column tile).
#[test]
fn device_optimizer_kernels_match_the_host_loops_bit_for_bit() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(23);
    // 2·BLOCK·GRID + 5 elements: every thread of the grid-stride loop takes several.
    let n = 2 * (BLOCK * GRID) as usize + 5;
    let (g1, g2) = (rng.floats(n, -2.0, 2.0), rng.floats(n, -2.0, 2.0));
    let (w1, w2) = (731.0f32, 64.0f32);
    let mut bufs = vec![g1.clone(), one(w1), zeros(n), vec![0u8; 4]];
    run(
        cxx,
        &cuda::optim::grad_accumulate(true),
        &mut bufs,
        &[n as i64],
        n as u64,
    );
    bufs[0] = g2.clone();
    bufs[1] = one(w2);
    run(
        cxx,
        &cuda::optim::grad_accumulate(false),
        &mut bufs,
        &[n as i64],
        n as u64,
    );
    // The trainer's `accumulate`: `acc = w·g`, then `acc += w·g`.
    let want: Vec<f32> = as_f32(&g1)
        .iter()
        .zip(as_f32(&g2))
        .map(|(a, b)| {
            let mut acc = w1 * a;
            acc += w2 * b;
            acc
        })
        .collect();
    exact("accumulated gradient", &bufs[2], &f32s(&want));
    assert_eq!(bufs[3], vec![0u8; 4], "finite gradients raise no flag");
    let acc = bufs[2].clone();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut g = as_f32(&g2);
        g[n - 2] = bad;
        let mut b = vec![f32s(&g), one(1.0), acc.clone(), vec![0u8; 4]];
        run(
            cxx,
            &cuda::optim::grad_accumulate(false),
            &mut b,
            &[n as i64],
            n as u64,
        );
        assert_eq!(b[3], 1u32.to_le_bytes().to_vec(), "{bad} raises the flag");
    }

    // Adam from the accumulated gradient and 1/tokens, against the CPU `adam_update`
    // kernel (the host optimizer's bits) fed with `acc·scale` rounded to f32.
    let scale = 1.0f32 / 795.0;
    let consts = [0.9f32, 0.98, 0.1, 0.02, 1e-9, 3.7e-4, 1.3, scale];
    let (p, m, v) = (
        rng.floats(n, -1.0, 1.0),
        rng.floats(n, -0.01, 0.01),
        rng.floats(n, 0.0, 0.001),
    );
    let mut dev = vec![p.clone(), acc.clone(), m.clone(), v.clone(), f32s(&consts)];
    run(
        cxx,
        &cuda::optim::adam_step(),
        &mut dev,
        &[n as i64],
        n as u64,
    );
    let g: Vec<f32> = as_f32(&acc).iter().map(|x| x * scale).collect();
    let mut h = vec![p, f32s(&g), m, v];
    for s in &consts[..7] {
        h.push(one(*s));
    }
    h.extend([zeros(n), zeros(n), zeros(n)]);
    run_cpu_adam(&mut h, n);
    exact("adam p", &dev[0], &h[11]);
    exact("adam m", &dev[2], &h[12]);
    exact("adam v", &dev[3], &h[13]);
    assert_ne!(dev[0], h[0], "the parameters moved");
}

#[test]
fn gemm_operands_convert_to_bf16_as_the_half_crate_does() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(31);
    let mut v: Vec<f32> = as_f32(&rng.floats(40, -3.0, 3.0));
    // Ties both ways, overflow, infinities, NaN, subnormals, signed zeros.
    v.extend([
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::MAX,
        -f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x0000_0001),
        -0.0,
        0.0,
        1e-40,
    ]);
    let n = v.len();
    let mut bufs = vec![f32s(&v), vec![0u8; 2 * n]];
    run(
        cxx,
        &cuda::cast::to_bf16(),
        &mut bufs,
        &[n as i64],
        n as u64,
    );
    assert_eq!(bufs[1], bf16s(&v), "bf16 bits of {v:?}");
}

#[test]
fn sum_rows_in_two_passes_matches_the_sum_and_the_cpu_kernel() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(23);
    for (shape, block) in [
        (vec![1usize, 5], BLOCK),
        (vec![300, 37], 256),
        (vec![130, 40], 48),
        (vec![3, 100, 37], 64),
        (vec![2, 129, 9], 256),
        (vec![7, 64], 64),
        // Several chunks and column tiles, the last of each partial.
        (vec![150, 300], 256),
        (vec![2, 70, 130], 32),
        // 22 chunks: the finish's running sums over two warps (rows of 20: the vector
        // loads, four rows at a time, then the rest).
        (vec![2, 1400, 20], 64),
        (vec![1, 301, 36], 256),
    ] {
        let n = *shape.last().unwrap();
        let rows: usize = shape[..shape.len() - 1].iter().product();
        let lead = shape.len() - 1;
        let x = rng.floats(rows * n, -1.0, 1.0);
        let xs = as_f32(&x);
        let chunks = cuda::misc::sum_rows_chunks(rows);
        let (dims, cpu_items) = misc::sum_rows_dims(&shape);
        let mut g = vec![x.clone(), f32s(&vec![f32::NAN; chunks * n])];
        let items = cuda::misc::sum_rows_items(rows, n) as u64;
        run_with(
            cxx,
            &cuda::misc::sum_rows("sum_rows_0", lead).unwrap(),
            &mut g,
            &dims,
            items,
            (3, block),
        );
        let mut y = vec![g[1].clone(), f32s(&vec![f32::NAN; n])];
        run_with(
            cxx,
            &cuda::misc::sum_rows_finish("sum_rows_finish_0", lead).unwrap(),
            &mut y,
            &dims,
            cuda::misc::sum_rows_finish_items(n) as u64,
            (2, block.next_power_of_two().min(128)),
        );
        let got = as_f32(&y[1]);
        let scale = xs.iter().fold(0f64, |a, v| a + v.abs() as f64) / n as f64;
        for j in 0..n {
            let want: f64 = (0..rows).map(|r| xs[r * n + j] as f64).sum();
            assert!(
                (got[j] as f64 - want).abs() <= 1e-6 * scale + 1e-7,
                "{shape:?} block {block}: column {j}: {} vs {want}",
                got[j]
            );
        }
        let mut h = vec![x.clone(), zeros(n)];
        run_cpu(
            &misc::sum_rows("sum_rows_0", lead),
            "sum_rows_0",
            &mut h,
            &dims,
            cpu_items,
        );
        close(&format!("sum_rows {shape:?}"), &y[1], &h[1]);
    }
}

#[test]
fn row_kernels_match_the_cpu_within_rounding() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(5);
    // softmax and the softmax backward.
    let (rows_n, c) = (6usize, 19usize);
    let x = rng.floats(rows_n * c, -4.0, 4.0);
    let (dims, items) = rows::softmax_dims(rows_n, c);
    let mut g = vec![x.clone(), zeros(rows_n * c)];
    run(
        cxx,
        &cuda::rows::softmax("softmax_0", Elem::F32),
        &mut g,
        &dims,
        rows_n as u64,
    );
    let mut h = vec![x.clone(), zeros(rows_n * c)];
    run_cpu(
        &rows::softmax("softmax_0"),
        "softmax_0",
        &mut h,
        &dims,
        items,
    );
    close("softmax", &g[1], &h[1]);
    let p = h[1].clone();
    let dp = rng.floats(rows_n * c, -1.0, 1.0);
    let (dims, items) = rows::softmax_bwd_dims(rows_n, c);
    let mut g = vec![p.clone(), dp.clone(), one(0.125), zeros(rows_n * c)];
    run(
        cxx,
        &cuda::rows::softmax_bwd("softmax_bwd_0", Elem::F32),
        &mut g,
        &dims,
        rows_n as u64,
    );
    let mut h = vec![p, dp, one(0.125), zeros(rows_n * c)];
    run_cpu(
        &rows::softmax_bwd("softmax_bwd_0"),
        "softmax_bwd_0",
        &mut h,
        &dims,
        items,
    );
    close("softmax_bwd", &g[3], &h[3]);

    // scale_mask_softmax, every mask; a fully masked key row included.
    let (b, hh, tq, tk) = (2usize, 3usize, 4usize, 6usize);
    for mask in [MaskKind::None, MaskKind::Key, MaskKind::Causal] {
        let x = rng.floats(b * hh * tq * tk, -3.0, 3.0);
        let m: Vec<i32> = match mask {
            // Batch 0 fully masked (every row uniform), batch 1 sees its first 4 keys.
            MaskKind::Key => (0..b * tk)
                .map(|i| i32::from(i / tk == 1 && i % tk < 4))
                .collect(),
            _ => (0..tq * tk)
                .map(|i| i32::from(i % tk <= i / tk + 2))
                .collect(),
        };
        let mut bufs = vec![x];
        if mask != MaskKind::None {
            bufs.push(i32s(&m));
        }
        bufs.push(one(0.5));
        if mask != MaskKind::None {
            bufs.push(one(-1e9));
        }
        bufs.push(zeros(b * hh * tq * tk));
        let (dims, items) = rows::scale_mask_softmax_dims(b, hh, tq, tk);
        let mut g = bufs.clone();
        let f = cuda::rows::scale_mask_softmax("scale_mask_softmax_0", mask, Elem::F32);
        run(cxx, &f, &mut g, &dims, items as u64);
        let mut h = bufs.clone();
        let cpu = rows::scale_mask_softmax("scale_mask_softmax_0", mask);
        run_cpu(&cpu, "scale_mask_softmax_0", &mut h, &dims, items);
        let last = bufs.len() - 1;
        close(&format!("scale_mask_softmax {mask:?}"), &g[last], &h[last]);
    }

    // add_layer_norm, its backward and the finish.
    let (rows_n, d) = (37usize, 10usize);
    let bufs = vec![
        rng.floats(rows_n * d, -2.0, 2.0),
        rng.floats(rows_n * d, -2.0, 2.0),
        rng.floats(d, 0.5, 1.5),
        rng.floats(d, -0.5, 0.5),
        one(1.0 / d as f32),
        one(1e-6),
        zeros(rows_n * d),
    ];
    let (dims, items) = rows::add_layer_norm_dims(rows_n, d);
    let mut g = bufs.clone();
    run(
        cxx,
        &cuda::rows::add_layer_norm("add_layer_norm_0", Elem::F32),
        &mut g,
        &dims,
        rows_n as u64,
    );
    let mut h = bufs.clone();
    run_cpu(
        &rows::add_layer_norm("add_layer_norm_0", true, false),
        "add_layer_norm_0",
        &mut h,
        &dims,
        items,
    );
    close("add_layer_norm", &g[6], &h[6]);
    let scratch = rows::add_layer_norm_bwd_scratch(rows_n, d);
    let bufs = vec![
        bufs[0].clone(),
        bufs[1].clone(),
        bufs[2].clone(),
        rng.floats(rows_n * d, -1.0, 1.0),
        one(1.0 / d as f32),
        one(1e-6),
        zeros(rows_n * d),
        zeros(scratch),
    ];
    let (dims, items) = rows::add_layer_norm_bwd_dims(rows_n, d);
    let mut g = bufs.clone();
    let f = cuda::rows::add_layer_norm_bwd("add_layer_norm_bwd_0", Elem::F32);
    run(cxx, &f, &mut g, &dims, items as u64);
    let mut h = bufs.clone();
    run_cpu(
        &rows::add_layer_norm_bwd("add_layer_norm_bwd_0", LnForm::Add, false),
        "add_layer_norm_bwd_0",
        &mut h,
        &dims,
        items,
    );
    close("add_layer_norm_bwd dx", &g[6], &h[6]);
    close("add_layer_norm_bwd partials", &g[7], &h[7]);
    let (dims, items) = rows::add_layer_norm_bwd_finish_dims(rows_n, d);
    let mut h = vec![h[7].clone(), zeros(d), zeros(d)];
    let cpu = rows::add_layer_norm_bwd_finish("add_layer_norm_bwd_finish_0");
    run_cpu(&cpu, "add_layer_norm_bwd_finish_0", &mut h, &dims, items);
    let f = cuda::rows::add_layer_norm_bwd_finish("add_layer_norm_bwd_finish_0");
    let tiles = cuda::rows::add_layer_norm_bwd_finish_items(d) as u64;
    // One warp's lanes looping over a tile, two warps, a grid smaller than the tiles.
    for launch in [(GRID, BLOCK), (1, 64)] {
        let mut g = vec![g[7].clone(), zeros(d), zeros(d)];
        run_with(cxx, &f, &mut g, &dims, tiles, launch);
        close("dgamma", &g[1], &h[1]);
        close("dbeta", &g[2], &h[2]);
    }
    // Enough partial blocks (100 of 1,600 rows) for each warp's sixteen running sums, over
    // one to four warps, against the CPU's sums in order.
    let (rows_n, d) = (1600usize, 45usize);
    let blocks = rows::add_layer_norm_bwd_scratch(rows_n, d) / (2 * d);
    assert_eq!(blocks, 100);
    let part = rng.floats(blocks * 2 * d, -1.0, 1.0);
    let (dims, items) = rows::add_layer_norm_bwd_finish_dims(rows_n, d);
    let mut h = vec![part.clone(), zeros(d), zeros(d)];
    run_cpu(&cpu, "add_layer_norm_bwd_finish_0", &mut h, &dims, items);
    let tiles = cuda::rows::add_layer_norm_bwd_finish_items(d) as u64;
    for launch in [(GRID, BLOCK), (2, 32), (1, 128)] {
        let mut g = vec![part.clone(), zeros(d), zeros(d)];
        run_with(cxx, &f, &mut g, &dims, tiles, launch);
        close(&format!("dgamma of 100 blocks, {launch:?}"), &g[1], &h[1]);
        close(&format!("dbeta of 100 blocks, {launch:?}"), &g[2], &h[2]);
    }
}

/// The row kernels' block reductions (warp shuffles, then the warps in order) with
/// blocks of one, two and four warps, against the CPU kernels: softmax, layer norm and
/// its backward (four sums in one reduction) over rows longer than the block.
#[test]
fn block_reductions_over_several_warps_match_the_cpu() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(31);
    let (rows_n, d) = (5usize, 300usize);
    let x = rng.floats(rows_n * d, -3.0, 3.0);
    let (dims, items) = rows::softmax_dims(rows_n, d);
    let mut h = vec![x.clone(), zeros(rows_n * d)];
    run_cpu(
        &rows::softmax("softmax_0"),
        "softmax_0",
        &mut h,
        &dims,
        items,
    );
    let ln = [
        rng.floats(rows_n * d, -2.0, 2.0),
        rng.floats(rows_n * d, -2.0, 2.0),
        rng.floats(d, 0.5, 1.5),
        rng.floats(d, -0.5, 0.5),
        rng.floats(rows_n * d, -1.0, 1.0),
    ];
    let bwd = vec![
        ln[0].clone(),
        ln[1].clone(),
        ln[2].clone(),
        ln[4].clone(),
        one(1.0 / d as f32),
        one(1e-6),
        zeros(rows_n * d),
        zeros(rows::add_layer_norm_bwd_scratch(rows_n, d)),
    ];
    let (bdims, bitems) = rows::add_layer_norm_bwd_dims(rows_n, d);
    let mut hb = bwd.clone();
    run_cpu(
        &rows::add_layer_norm_bwd("add_layer_norm_bwd_0", LnForm::Add, false),
        "add_layer_norm_bwd_0",
        &mut hb,
        &bdims,
        bitems,
    );
    // The forward layer norm, one warp a row: 5 rows over blocks of one to four warps
    // (a block's last warps without a row).
    let fwd: Vec<Vec<u8>> = ln[..4]
        .iter()
        .cloned()
        .chain([one(1.0 / d as f32), one(1e-6), zeros(rows_n * d)])
        .collect();
    let (fdims, fitems) = rows::add_layer_norm_dims(rows_n, d);
    let mut hf = fwd.clone();
    run_cpu(
        &rows::add_layer_norm("add_layer_norm_0", true, false),
        "add_layer_norm_0",
        &mut hf,
        &fdims,
        fitems,
    );
    for block in [32u32, 64, 128] {
        let mut g = fwd.clone();
        run_with(
            cxx,
            &cuda::rows::add_layer_norm("add_layer_norm_0", Elem::F32),
            &mut g,
            &fdims,
            rows_n as u64,
            (1, block),
        );
        close(&format!("add_layer_norm, block {block}"), &g[6], &hf[6]);
    }
    for block in [32u32, 64, 128] {
        let mut g = vec![x.clone(), zeros(rows_n * d)];
        run_with(
            cxx,
            &cuda::rows::softmax("softmax_0", Elem::F32),
            &mut g,
            &dims,
            rows_n as u64,
            (2, block),
        );
        close(&format!("softmax, block {block}"), &g[1], &h[1]);
        let mut g = bwd.clone();
        run_with(
            cxx,
            &cuda::rows::add_layer_norm_bwd("add_layer_norm_bwd_0", Elem::F32),
            &mut g,
            &bdims,
            bitems as u64,
            (2, block),
        );
        close(
            &format!("add_layer_norm_bwd dx, block {block}"),
            &g[6],
            &hb[6],
        );
        close(
            &format!("add_layer_norm_bwd partials, block {block}"),
            &g[7],
            &hb[7],
        );
    }
}

/// The layer norm's rows held in registers (warps of 32, `d ≤ 32 ·` the lane's
/// elements) give the bits of the passes through memory that other rows take
/// (`add_layer_norm_with(…, 0)`), forward and backward, in f32 and bf16, for rows shorter
/// than a warp, of several elements a lane with a partial last one, and of 1,024 (the big
/// model's, 32 a lane); with a program's lanes and with the most; also where `out` and
/// `dx` are the input `x` (in place).
#[test]
fn layer_norm_rows_in_registers_give_the_bits_of_the_passes() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(53);
    let lane = cuda::rows::LN_LANE;
    for e in [Elem::F32, Elem::Bf16] {
        let act = |b: Vec<u8>| match e {
            Elem::F32 => b,
            Elem::Bf16 => bf16s(&as_f32(&b)),
        };
        for (rows_n, d) in [(5usize, 24usize), (40, 300), (3, 1024)] {
            let what = format!("{e:?}, {rows_n} rows of {d}");
            let x = act(rng.floats(rows_n * d, -2.0, 2.0));
            let y = act(rng.floats(rows_n * d, -2.0, 2.0));
            let g = act(rng.floats(rows_n * d, -1.0, 1.0));
            let gamma = rng.floats(d, 0.5, 1.5);
            let beta = rng.floats(d, -0.5, 0.5);
            let out = vec![0u8; x.len()];
            let (inv_d, eps) = (one(1.0 / d as f32), one(1e-5));
            let (dims, _) = rows::add_layer_norm_dims(rows_n, d);
            let fwd = vec![
                x.clone(),
                y.clone(),
                gamma.clone(),
                beta,
                inv_d.clone(),
                eps.clone(),
                out.clone(),
            ];
            let (bdims, bitems) = rows::add_layer_norm_bwd_dims(rows_n, d);
            let bwd = vec![
                x.clone(),
                y,
                gamma,
                g,
                inv_d,
                eps,
                out,
                zeros(rows::add_layer_norm_bwd_scratch(rows_n, d)),
            ];
            for (launch, in_place) in [((2, 64), false), ((1, 32), true), ((3, 128), false)] {
                let mut got = Vec::new();
                // A program's lanes (⌈d / 32⌉), the most, none.
                for regs in [cuda::rows::row_lane(Some(d)), lane, 0] {
                    let f =
                        cuda::rows::add_layer_norm_with("add_layer_norm_0", e, regs, true, false);
                    let mut a = fwd.clone();
                    run_with(cxx, &f, &mut a, &dims, rows_n as u64, launch);
                    let f = cuda::rows::add_layer_norm_bwd_with(
                        "add_layer_norm_bwd_0",
                        e,
                        regs,
                        LnForm::Add,
                        false,
                    );
                    let mut b = bwd.clone();
                    run_with(cxx, &f, &mut b, &bdims, bitems as u64, launch);
                    if in_place {
                        // out = x, then dx = x.
                        let f = cuda::rows::add_layer_norm_with(
                            "add_layer_norm_0",
                            e,
                            regs,
                            true,
                            false,
                        );
                        let mut c = fwd.clone();
                        run_in_place(cxx, &f, &mut c, &dims, rows_n as u64, launch, 6, 0);
                        assert_eq!(c[0], a[6], "{what}: out in place");
                        let f = cuda::rows::add_layer_norm_bwd_with(
                            "add_layer_norm_bwd_0",
                            e,
                            regs,
                            LnForm::Add,
                            false,
                        );
                        let mut c = bwd.clone();
                        run_in_place(cxx, &f, &mut c, &bdims, bitems as u64, launch, 6, 0);
                        assert_eq!(c[0], b[6], "{what}: dx in place");
                        assert_eq!(c[7], b[7], "{what}: partials in place");
                    }
                    got.push((a[6].clone(), b[6].clone(), b[7].clone()));
                }
                for other in &got[1..] {
                    assert_eq!(got[0].0, other.0, "{what}, {launch:?}: out");
                    assert_eq!(got[0].1, other.1, "{what}, {launch:?}: dx");
                    assert_eq!(got[0].2, other.2, "{what}, {launch:?}: dγ, dβ partials");
                }
                let out = match e {
                    Elem::F32 => as_f32(&got[0].0),
                    Elem::Bf16 => from_bf16(&got[0].0),
                };
                assert!(out.iter().all(|v| v.is_finite() && *v != 0.0), "{what}");
            }
        }
    }
}

/// `xent_ls` with a thread's groups of logits held in registers between its two passes
/// (`xent_ls_with(…, keep)`) gives the bits of the kernel that reads them twice: rows
/// that fit (a few groups a thread, some threads with fewer), rows with more groups than
/// the threads keep (the two reads), rows that are not whole groups (one element at a
/// time), in f32 and bf16, and with `dlogits` the logits (in place).
#[test]
fn xent_ls_groups_held_in_registers_give_the_bits_of_two_reads() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(61);
    let (rows_n, pad) = (7usize, 2i64);
    for e in [Elem::F32, Elem::Bf16] {
        let act = |b: Vec<u8>| match e {
            Elem::F32 => b,
            Elem::Bf16 => bf16s(&as_f32(&b)),
        };
        // 520 = 65 groups: 3 a thread for blocks of 32 (some 2), 2 for 64; 1,040 = 130
        // groups: more than 3 a thread of 32; 301 is not whole groups.
        for v in [520usize, 1040, 301] {
            let t: Vec<i32> = (0..rows_n).map(|i| (i * 37 % v) as i32).collect();
            let bufs = vec![
                act(rng.floats(rows_n * v, -6.0, 6.0)),
                i32s(&t),
                one(0.9),
                one(0.1),
                one(1.0 / v as f32),
                one(0.2),
                zeros(rows_n),
                act(zeros(rows_n * v)),
            ];
            let (dims, _) = rows::xent_ls_dims(rows_n, v, pad);
            for launch in [(2, 32), (3, 64)] {
                let what = format!("{e:?}, rows of {v}, {launch:?}");
                let twice = cuda::rows::xent_ls("xent_ls_0", e);
                let mut want = bufs.clone();
                run_with(cxx, &twice, &mut want, &dims, rows_n as u64, launch);
                for keep in [3usize, 4] {
                    let held = cuda::rows::xent_ls_with("xent_ls_0", e, keep);
                    assert_ne!(held.text, twice.text);
                    let mut got = bufs.clone();
                    run_with(cxx, &held, &mut got, &dims, rows_n as u64, launch);
                    assert_eq!(got[6], want[6], "{what}, keep {keep}: row losses");
                    assert_eq!(got[7], want[7], "{what}, keep {keep}: dlogits");
                    let mut inplace = bufs.clone();
                    run_in_place(cxx, &held, &mut inplace, &dims, rows_n as u64, launch, 7, 0);
                    assert_eq!(inplace[6], want[6], "{what}, keep {keep}: in place, losses");
                    assert_eq!(
                        inplace[0], want[7],
                        "{what}, keep {keep}: in place, dlogits"
                    );
                }
                let loss = as_f32(&want[6]);
                assert!(
                    loss.iter().all(|l| l.is_finite() && *l > 0.0),
                    "{what}: {loss:?}"
                );
            }
        }
    }
    // The program's choice: a bf16 vocabulary of whole groups that fits, else none.
    assert_eq!(cuda::rows::xent_keep(Some(37000), Elem::Bf16), 19);
    assert_eq!(cuda::rows::xent_keep(Some(37000), Elem::F32), 0);
    assert_eq!(cuda::rows::xent_keep(Some(37001), Elem::Bf16), 0);
    assert_eq!(cuda::rows::xent_keep(Some(8 * 256 * 25), Elem::Bf16), 0);
    assert_eq!(cuda::rows::xent_keep(None, Elem::Bf16), 0);
}

#[test]
fn xent_ls_matches_the_cpu_kernel_and_its_finish() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(8);
    let (rows_n, v, pad) = (9usize, 40usize, 0i64);
    let logits = rng.floats(rows_n * v, -5.0, 5.0);
    let target: Vec<i32> = (0..rows_n)
        .map(|i| {
            if i % 4 == 3 {
                0
            } else {
                (i * 7 % 39 + 1) as i32
            }
        })
        .collect();
    let (c_nll, c_smooth, inv_v) = (0.9f32, 0.1f32, 1.0 / v as f32);
    // The GPU path: count, main, finish, nothing on the host.
    let mut stats = vec![i32s(&target), zeros(2)];
    let f = cuda::rows::xent_ls_count("xent_ls_count_0");
    run(cxx, &f, &mut stats, &[rows_n as i64, pad], 1);
    let den = target.iter().filter(|&&t| i64::from(t) != pad).count() as f32;
    assert_eq!(as_f32(&stats[1]), vec![den, 1.0 / den]);
    // The seeded form (a loss-scaled train_step): the weight is seed·(1/den).
    let mut seeded = vec![i32s(&target), one(3.0), zeros(2)];
    let f = cuda::rows::xent_ls_count_seeded("xent_ls_count_seeded_0");
    run(cxx, &f, &mut seeded, &[rows_n as i64, pad], 1);
    assert_eq!(as_f32(&seeded[2]), vec![den, 3.0 * (1.0 / den)]);
    let inv_den = f32s(&as_f32(&stats[1])[1..]);
    let bufs = vec![
        logits.clone(),
        i32s(&target),
        one(c_nll),
        one(c_smooth),
        one(inv_v),
        inv_den,
        zeros(rows_n),
        zeros(rows_n * v),
    ];
    let (dims, items) = rows::xent_ls_dims(rows_n, v, pad);
    let mut g = bufs.clone();
    run(
        cxx,
        &cuda::rows::xent_ls("xent_ls_0", Elem::F32),
        &mut g,
        &dims,
        rows_n as u64,
    );
    let mut h = bufs.clone();
    run_cpu(
        &rows::xent_ls("xent_ls_0"),
        "xent_ls_0",
        &mut h,
        &dims,
        items,
    );
    close("xent_ls row losses", &g[6], &h[6]);
    close("xent_ls dlogits", &g[7], &h[7]);
    // Without the gradient (the `loss` entry): the same row losses, bit for bit, as the
    // full kernel on the GPU side, and the logits as they were.
    for launch in [(GRID, BLOCK), (2, 64)] {
        let mut l = vec![
            logits.clone(),
            i32s(&target),
            one(c_nll),
            one(c_smooth),
            one(inv_v),
            zeros(rows_n),
        ];
        run_with(
            cxx,
            &cuda::rows::xent_ls_loss("xent_ls_loss_0", Elem::F32),
            &mut l,
            &dims,
            rows_n as u64,
            launch,
        );
        if launch == (GRID, BLOCK) {
            assert_eq!(l[5], g[6], "the loss-only kernel's row losses");
        }
        close("xent_ls_loss row losses", &l[5], &h[6]);
        assert_eq!(l[0], logits, "the loss-only kernel writes no logits");
    }
    // The online max and sum over two warps, with −inf logits (a first element among
    // them, where nothing is summed yet) and a row whose maximum comes last.
    let mut xs = as_f32(&logits);
    for j in [0usize, 3, 17] {
        xs[v + j] = f32::NEG_INFINITY;
    }
    for j in 0..v {
        xs[2 * v + j] = j as f32 * 0.25;
    }
    let mut bufs2 = bufs.clone();
    bufs2[0] = f32s(&xs);
    let mut h2 = bufs2.clone();
    run_cpu(
        &rows::xent_ls("xent_ls_0"),
        "xent_ls_0",
        &mut h2,
        &dims,
        items,
    );
    for launch in [(2, 64), (1, 32)] {
        let mut g2 = bufs2.clone();
        run_with(
            cxx,
            &cuda::rows::xent_ls("xent_ls_0", Elem::F32),
            &mut g2,
            &dims,
            rows_n as u64,
            launch,
        );
        // Row 1's smoothing term sums the −inf logits: an infinite loss on both.
        let (gl, hl) = (as_f32(&g2[6]), as_f32(&h2[6]));
        assert!(
            gl[1] == f32::INFINITY && hl[1] == f32::INFINITY,
            "{gl:?} {hl:?}"
        );
        let finite = |l: &[f32]| f32s(&[&l[..1], &l[2..]].concat());
        close("xent_ls row losses (−inf)", &finite(&gl), &finite(&hl));
        close("xent_ls dlogits (−inf)", &g2[7], &h2[7]);
    }
    // Rows of 40 go as groups of 8 (16-byte vectors); rows of 37 one element at a time,
    // with rows starting anywhere. Either way the bf16 kernel is the f32 kernel with
    // rounded loads and stores, bit for bit (the same groups, the same order).
    for vv in [40usize, 37] {
        let t: Vec<i32> = (0..rows_n).map(|i| (i * 5 % vv) as i32).collect();
        let bufs = vec![
            rng.floats(rows_n * vv, -4.0, 4.0),
            i32s(&t),
            one(c_nll),
            one(c_smooth),
            one(1.0 / vv as f32),
            one(0.125),
            zeros(rows_n),
            zeros(rows_n * vv),
        ];
        let (dims, items) = rows::xent_ls_dims(rows_n, vv, pad);
        let mut h = bufs.clone();
        run_cpu(
            &rows::xent_ls("xent_ls_0"),
            "xent_ls_0",
            &mut h,
            &dims,
            items,
        );
        for launch in [(GRID, BLOCK), (2, 64)] {
            let mut g = bufs.clone();
            run_with(
                cxx,
                &cuda::rows::xent_ls("xent_ls_0", Elem::F32),
                &mut g,
                &dims,
                rows_n as u64,
                launch,
            );
            close(&format!("xent_ls row losses, v {vv}"), &g[6], &h[6]);
            close(&format!("xent_ls dlogits, v {vv}"), &g[7], &h[7]);
        }
        let (b16, f) = (Some(Elem::Bf16), Some(Elem::F32));
        same_as_f32(
            cxx,
            &format!("xent_ls, v {vv}"),
            &cuda::rows::xent_ls("xent_ls_0", Elem::Bf16),
            &cuda::rows::xent_ls("xent_ls_0", Elem::F32),
            &bufs,
            &[b16, None, None, None, None, None, f, b16],
            &[6, 7],
            (&dims, rows_n as u64),
        );
    }
    let mut fin = vec![g[6].clone(), stats[1].clone(), zeros(1)];
    run(
        cxx,
        &cuda::rows::xent_ls_finish("xent_ls_finish_0"),
        &mut fin,
        &[rows_n as i64],
        1,
    );
    let want = rows::xent_ls_finish(&as_f32(&h[6]), den);
    close("xent_ls loss", &fin[2], &f32s(&[want]));
}

fn as_i32(b: &[u8]) -> Vec<i32> {
    b.chunks(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn index_kernels_follow_the_reference_semantics() {
    let Some(cxx) = gxx() else { return };
    use kiln_compiler::codegen::cuda::index;
    // causal_mask [q, k] with k > q (a cache of k − q positions).
    let (q, k) = (3usize, 7usize);
    let (dims, items) = index::causal_mask_dims(q, k);
    let mut g = vec![zeros(q * k)];
    run(
        cxx,
        &index::causal_mask("causal_mask_0"),
        &mut g,
        &dims,
        items as u64,
    );
    let want: Vec<i32> = (0..q * k)
        .map(|e| i32::from((e % k) as i64 <= (e / k) as i64 + (k as i64 - q as i64)))
        .collect();
    assert_eq!(as_i32(&g[0]), want);
    // pad_mask.
    let ids = [0, 5, 1, 0, 9, -3];
    let (dims, items) = index::pad_mask_dims(ids.len(), 0);
    let mut g = vec![i32s(&ids), zeros(ids.len())];
    run(
        cxx,
        &index::pad_mask("pad_mask_0"),
        &mut g,
        &dims,
        items as u64,
    );
    assert_eq!(as_i32(&g[1]), vec![0, 1, 1, 0, 1, 1]);
    // arange from a cache length.
    let (dims, items) = index::arange_dims(5, 11);
    let mut g = vec![zeros(5)];
    run(cxx, &index::arange("arange_0"), &mut g, &dims, items as u64);
    assert_eq!(as_i32(&g[0]), vec![11, 12, 13, 14, 15]);
    // concat of three operands along the middle axis of [2, n, 3].
    let sizes = [2usize, 1, 3];
    let parts: Vec<Vec<i32>> = sizes
        .iter()
        .enumerate()
        .map(|(p, &n)| (0..2 * n * 3).map(|e| (100 * p + e) as i32).collect())
        .collect();
    let (dims, items) = index::concat_dims(2, 3, &sizes);
    let mut g: Vec<Vec<u8>> = parts.iter().map(|p| i32s(p)).collect();
    g.push(zeros(items));
    run(
        cxx,
        &index::concat("concat_0", 3).unwrap(),
        &mut g,
        &dims,
        items as u64,
    );
    let mut want = Vec::new();
    for o in 0..2 {
        for (p, &n) in sizes.iter().enumerate() {
            want.extend_from_slice(&parts[p][o * n * 3..(o + 1) * n * 3]);
        }
    }
    assert_eq!(as_i32(&g[3]), want);
}

/// `scatter_add` as `scatter_index` + `scatter_rows`: every output element the sum of
/// its row's source rows in position order from 0.0 (the CPU fallback's order, so bit
/// for bit), rows no id names zero (the output is poisoned first), repeated ids, the
/// first and last row; an id out of range is named with its position.
#[test]
fn scatter_rows_sums_each_row_in_position_order() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(31);
    let (rows, width) = (11usize, 7usize);
    let ids: Vec<i32> = vec![3, 0, 10, 3, 3, 7, 0, 10, 5, 3, 9, 1, 3];
    let src = rng.floats(ids.len() * width, -1.0, 1.0);
    let xs = as_f32(&src);
    let (start, order) = cuda::index::scatter_index(&ids, rows).unwrap();
    assert_eq!(start.len(), rows + 1);
    assert_eq!(
        &order[start[3] as usize..start[4] as usize],
        &[0, 3, 4, 9, 12]
    );
    let (dims, items) = cuda::index::scatter_rows_dims(rows, width);
    let mut g = vec![
        i32s(&start),
        i32s(&order),
        src.clone(),
        f32s(&vec![f32::NAN; rows * width]),
    ];
    run(
        cxx,
        &cuda::index::scatter_rows("scatter_rows"),
        &mut g,
        &dims,
        items as u64,
    );
    let mut want = vec![0f32; rows * width];
    for (p, &id) in ids.iter().enumerate() {
        for j in 0..width {
            want[id as usize * width + j] += xs[p * width + j];
        }
    }
    exact("scatter_rows", &g[3], &f32s(&want));
    assert!(as_f32(&g[3])[2 * width..3 * width]
        .iter()
        .all(|&x| x == 0.0));
    assert_eq!(cuda::index::scatter_index(&[1, 11, 2], rows), Err((1, 11)));
    assert_eq!(cuda::index::scatter_index(&[-1], rows), Err((0, -1)));
}

/// `scatter_add_into` as `scatter_index` + `scatter_rows_onto_as`: a row some id names is
/// its base plus its source rows summed in position order from 0.0 (the CPU fallback's
/// values, bit for bit), every other row its base unchanged (the output is poisoned
/// first; a `-0.0` stays `-0.0`).
#[test]
fn scatter_rows_onto_adds_each_rows_sum_to_its_base() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(37);
    let (rows, width) = (11usize, 7usize);
    let ids: Vec<i32> = vec![3, 0, 10, 3, 3, 7, 0, 10, 5, 3, 9, 1, 3];
    let src = rng.floats(ids.len() * width, -1.0, 1.0);
    let mut base = as_f32(&rng.floats(rows * width, -2.0, 2.0));
    base[2 * width] = -0.0;
    let (xs, bs) = (as_f32(&src), base.clone());
    let (start, order) = cuda::index::scatter_index(&ids, rows).unwrap();
    let (dims, items) = cuda::index::scatter_rows_dims(rows, width);
    let f = cuda::index::scatter_rows_onto_as("scatter_rows_onto", Elem::F32, Elem::F32, Elem::F32);
    let mut g = vec![
        i32s(&start),
        i32s(&order),
        f32s(&base),
        src.clone(),
        f32s(&vec![f32::NAN; rows * width]),
    ];
    run(cxx, &f, &mut g, &dims, items as u64);
    let mut want = bs.clone();
    for r in 0..rows {
        let at: Vec<usize> = (0..ids.len()).filter(|&p| ids[p] as usize == r).collect();
        if at.is_empty() {
            continue;
        }
        for j in 0..width {
            let mut s = 0f32;
            for &p in &at {
                s += xs[p * width + j];
            }
            want[r * width + j] = bs[r * width + j] + s;
        }
    }
    exact("scatter_rows_onto", &g[4], &f32s(&want));
    assert_eq!(as_f32(&g[4])[2 * width].to_bits(), (-0.0f32).to_bits());
}

// ---------------------------------------------------------------------------------------
// Flash attention against plain loops.

/// One attention problem: `[b, h, t, d]` operands stored in layouts of their own.
struct Attn {
    b: usize,
    h: usize,
    tq: usize,
    tk: usize,
    dk: usize,
    dv: usize,
    mask: MaskKind,
    scale: f32,
    fill: f32,
}

/// A `[b, h, t, d]` operand: its storage and its element strides. `permuted` stores it
/// as `[b, t, h, d]` (the projections' layout before the head split).
fn operand(
    rng: &mut Rng,
    (b, h, t, d): (usize, usize, usize, usize),
    permuted: bool,
) -> (Vec<f32>, [usize; 4]) {
    let data = as_f32(&rng.floats(b * h * t * d, -1.0, 1.0));
    let strides = if permuted {
        [t * h * d, d, h * d, 1]
    } else {
        [h * t * d, t * d, d, 1]
    };
    (data, strides)
}

fn at(x: &(Vec<f32>, [usize; 4]), i: [usize; 4]) -> f64 {
    let s = x.1;
    x.0[i[0] * s[0] + i[1] * s[1] + i[2] * s[2] + i[3] * s[3]] as f64
}

/// The reference: `(out, dq, dk, dv)`, contiguous `[b, h, t, d]`, in f64 by the
/// definitions (softmax of the masked scaled scores; its backward, zero where masked).
#[allow(clippy::type_complexity)]
fn attention_reference(
    a: &Attn,
    q: &(Vec<f32>, [usize; 4]),
    k: &(Vec<f32>, [usize; 4]),
    v: &(Vec<f32>, [usize; 4]),
    g: &(Vec<f32>, [usize; 4]),
    mask: &[i32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (tq, tk, dk, dv) = (a.tq, a.tk, a.dk, a.dv);
    let mut out = vec![0f32; a.b * a.h * tq * dv];
    let mut dq = vec![0f32; a.b * a.h * tq * dk];
    let mut dkk = vec![0f32; a.b * a.h * tk * dk];
    let mut dvv = vec![0f32; a.b * a.h * tk * dv];
    for bi in 0..a.b {
        for hi in 0..a.h {
            let keep = |i: usize, j: usize| match a.mask {
                MaskKind::None => true,
                MaskKind::Key => mask[bi * tk + j] != 0,
                MaskKind::Causal => mask[i * tk + j] != 0,
            };
            let mut p = vec![vec![0f64; tk]; tq];
            for (i, pr) in p.iter_mut().enumerate() {
                for (j, x) in pr.iter_mut().enumerate() {
                    let d: f64 = (0..dk)
                        .map(|c| at(q, [bi, hi, i, c]) * at(k, [bi, hi, j, c]))
                        .sum();
                    *x = if keep(i, j) {
                        d * a.scale as f64
                    } else {
                        a.fill as f64
                    };
                }
                let m = pr.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = pr.iter().map(|x| (x - m).exp()).sum();
                for x in pr.iter_mut() {
                    *x = (*x - m).exp() / z;
                }
            }
            let bh = bi * a.h + hi;
            for i in 0..tq {
                for c in 0..dv {
                    let o: f64 = (0..tk).map(|j| p[i][j] * at(v, [bi, hi, j, c])).sum();
                    out[(bh * tq + i) * dv + c] = o as f32;
                }
                let dp: Vec<f64> = (0..tk)
                    .map(|j| {
                        (0..dv)
                            .map(|c| at(g, [bi, hi, i, c]) * at(v, [bi, hi, j, c]))
                            .sum()
                    })
                    .collect();
                let dot: f64 = (0..tk).map(|j| p[i][j] * dp[j]).sum();
                let ds: Vec<f64> = (0..tk)
                    .map(|j| {
                        if keep(i, j) {
                            p[i][j] * (dp[j] - dot) * a.scale as f64
                        } else {
                            0.0
                        }
                    })
                    .collect();
                for c in 0..dk {
                    let x: f64 = (0..tk).map(|j| ds[j] * at(k, [bi, hi, j, c])).sum();
                    dq[(bh * tq + i) * dk + c] = x as f32;
                }
                for j in 0..tk {
                    for c in 0..dk {
                        dkk[(bh * tk + j) * dk + c] += (ds[j] * at(q, [bi, hi, i, c])) as f32;
                    }
                    for c in 0..dv {
                        dvv[(bh * tk + j) * dv + c] += (p[i][j] * at(g, [bi, hi, i, c])) as f32;
                    }
                }
            }
        }
    }
    (out, dq, dkk, dvv)
}

/// Runs the three flash kernels on the host for `a` and checks them against the
/// reference (within `1e-5·max|ref| + 1e-6`), with `block` threads per block; the results
/// stored `[b, h, t, d]` or, `merged`, with the heads merged (`[b, t, h, d]`, as the
/// executors store attention results the output projection reads as rows).
fn check_flash(cxx: &str, a: &Attn, seed: u64, block: u32, merged: bool) {
    check_flash_as(cxx, a, seed, block, Elem::F32, merged)
}

/// The element strides of a `[b, h, t, d]` result, stored `[b, t, h, d]` when `merged`.
fn result_strides((h, t, d): (usize, usize, usize), merged: bool) -> [usize; 4] {
    if merged {
        [t * h * d, d, h * d, 1]
    } else {
        [h * t * d, t * d, d, 1]
    }
}

/// A `[b, h, t, d]` result of `size`-byte elements stored with its heads merged, in the
/// `[b, h, t, d]` order.
fn unmerge(bytes: &[u8], (b, h, t, d): (usize, usize, usize, usize), size: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..t {
                let from = ((bi * t + i) * h + hi) * d * size;
                let to = ((bi * h + hi) * t + i) * d * size;
                out[to..to + d * size].copy_from_slice(&bytes[from..from + d * size]);
            }
        }
    }
    out
}

/// [`check_flash`] with the activations (`q`, `k`, `v`, `g` and the results) stored as
/// `elem`: bf16 operands are rounded first and the reference takes the rounded values;
/// bf16 results are compared within `2⁻⁷·max|ref|` (their own rounding and that of the
/// values the kernels store between passes).
fn check_flash_as(cxx: &str, a: &Attn, seed: u64, block: u32, elem: Elem, merged: bool) {
    check_flash_kernels(cxx, a, seed, block, (elem, merged), false)
}

/// [`check_flash_as`], with `tc_only` the tensor-core kernels only.
fn check_flash_kernels(
    cxx: &str,
    a: &Attn,
    seed: u64,
    block: u32,
    (elem, merged): (Elem, bool),
    tc_only: bool,
) {
    use kiln_compiler::codegen::cuda::attention::{self, Part};
    use kiln_compiler::codegen::cuda::tensor;
    let mut rng = Rng(seed);
    let (b, h, tq, tk, dk, dv) = (a.b, a.h, a.tq, a.tk, a.dk, a.dv);
    let round = |mut x: (Vec<f32>, [usize; 4])| {
        if elem == Elem::Bf16 {
            for v in x.0.iter_mut() {
                *v = half::bf16::from_f32(*v).to_f32();
            }
        }
        x
    };
    let q = round(operand(&mut rng, (b, h, tq, dk), true));
    let k = round(operand(&mut rng, (b, h, tk, dk), false));
    let v = round(operand(&mut rng, (b, h, tk, dv), true));
    let g = round(operand(&mut rng, (b, h, tq, dv), true));
    let store = |x: &[f32]| match elem {
        Elem::F32 => f32s(x),
        Elem::Bf16 => bf16s(x),
    };
    let zeros_e = |n: usize| vec![0u8; n * elem.bytes()];
    // `t`: the result's rows (tq or tk), `d` its head size.
    let check = |what: &str, got: &[u8], want: &[f32], (t, d): (usize, usize)| {
        let got = if merged {
            unmerge(got, (b, h, t, d), elem.bytes())
        } else {
            got.to_vec()
        };
        match elem {
            Elem::F32 => close(what, &got, &f32s(want)),
            Elem::Bf16 => close_bf16(what, &got, want),
        }
    };
    let mask: Vec<i32> = match a.mask {
        MaskKind::None => vec![],
        // Padding: batch entry 0 keeps every key, the others lose a tail (the last loses
        // all but its first key).
        MaskKind::Key => (0..b)
            .flat_map(|bi| {
                let keep = if bi == 0 { tk } else { (tk / (bi + 1)).max(1) };
                (0..tk).map(move |j| (j < keep) as i32)
            })
            .collect(),
        MaskKind::Causal => (0..tq)
            .flat_map(|i| (0..tk).map(move |j| (j <= i) as i32))
            .collect(),
    };
    let (out, dq, dkk, dvv) = attention_reference(a, &q, &k, &v, &g, &mask);
    let masked = a.mask != MaskKind::None;
    let what = format!(
        "{:?} b={b} h={h} tq={tq} tk={tk} dk={dk} dv={dv} block={block} {elem:?} merged={merged}",
        a.mask
    );

    let head = |mut bufs: Vec<Vec<u8>>, with_g: bool| {
        let mut all = vec![store(&q.0), store(&k.0), store(&v.0)];
        if masked {
            all.push(i32s(&mask));
        }
        if with_g {
            all.push(store(&g.0));
        }
        all.push(one(a.scale));
        if masked {
            all.push(one(a.fill));
        }
        all.append(&mut bufs);
        all
    };
    let rs = |t, d| result_strides((h, t, d), merged);
    let fdims = attention::dims(b, h, tq, tk, &[q.1, k.1, v.1, rs(tq, dv)]);
    let bdims = attention::dims(
        b,
        h,
        tq,
        tk,
        &[q.1, k.1, v.1, g.1, rs(tq, dk), rs(tk, dk), rs(tk, dv)],
    );
    let launch = (GRID, block);

    if !tc_only {
        let f = attention::forward("flash_fwd", a.mask, dk, dv, elem);
        let t = attention::tile(Part::Forward, dk, dv).unwrap();
        let mut bufs = head(vec![zeros_e(out.len())], false);
        run_with(
            cxx,
            &f,
            &mut bufs,
            &fdims,
            attention::items(Part::Forward, t, b, h, tq, tk) as u64,
            launch,
        );
        check(
            &format!("forward {what}"),
            bufs.last().unwrap(),
            &out,
            (tq, dv),
        );

        let f = attention::backward_q("flash_q", a.mask, dk, dv, elem);
        let t = attention::tile(Part::BackwardQ, dk, dv).unwrap();
        let mut bufs = head(vec![zeros_e(dq.len()), zeros(b * h * tq * 3)], true);
        run_with(
            cxx,
            &f,
            &mut bufs,
            &bdims,
            attention::items(Part::BackwardQ, t, b, h, tq, tk) as u64,
            launch,
        );
        let n = bufs.len();
        check(&format!("dq {what}"), &bufs[n - 2], &dq, (tq, dk));
        let stats = bufs[n - 1].clone();

        let f = attention::backward_kv("flash_kv", a.mask, dk, dv, elem);
        let t = attention::tile(Part::BackwardKv, dk, dv).unwrap();
        let mut bufs = head(vec![stats, zeros_e(dkk.len()), zeros_e(dvv.len())], true);
        run_with(
            cxx,
            &f,
            &mut bufs,
            &bdims,
            attention::items(Part::BackwardKv, t, b, h, tq, tk) as u64,
            launch,
        );
        let n = bufs.len();
        check(&format!("dk {what}"), &bufs[n - 2], &dkk, (tk, dk));
        check(&format!("dv {what}"), &bufs[n - 1], &dvv, (tk, dv));
    }
    // bf16 heads of multiples of 16 on tensor cores (whole warps only): the same
    // buffers, dims, tiles and items.
    let tc = |p| elem == Elem::Bf16 && block.is_multiple_of(32) && tensor::fits(p, dk, dv);
    if tc(Part::Forward) {
        let f = tensor::forward("flash_fwd_tc", a.mask, dk, dv);
        let t = attention::tile(Part::Forward, dk, dv).unwrap();
        let mut bufs = head(vec![zeros_e(out.len())], false);
        run_with(
            cxx,
            &f,
            &mut bufs,
            &fdims,
            attention::items(Part::Forward, t, b, h, tq, tk) as u64,
            launch,
        );
        check(
            &format!("tensor-core forward {what}"),
            bufs.last().unwrap(),
            &out,
            (tq, dv),
        );
    }
    if tc(Part::BackwardQ) && tc(Part::BackwardKv) {
        let f = tensor::backward_q("flash_q_tc", a.mask, dk, dv);
        let t = attention::tile(Part::BackwardQ, dk, dv).unwrap();
        let mut bufs = head(vec![zeros_e(dq.len()), zeros(b * h * tq * 3)], true);
        run_with(
            cxx,
            &f,
            &mut bufs,
            &bdims,
            attention::items(Part::BackwardQ, t, b, h, tq, tk) as u64,
            launch,
        );
        let n = bufs.len();
        check(
            &format!("tensor-core dq (two kernels) {what}"),
            &bufs[n - 2],
            &dq,
            (tq, dk),
        );
        let stats = bufs[n - 1].clone();
        let f = tensor::backward_kv("flash_kv_tc", a.mask, dk, dv);
        let t = attention::tile(Part::BackwardKv, dk, dv).unwrap();
        let mut bufs = head(vec![stats, zeros_e(dkk.len()), zeros_e(dvv.len())], true);
        run_with(
            cxx,
            &f,
            &mut bufs,
            &bdims,
            attention::items(Part::BackwardKv, t, b, h, tq, tk) as u64,
            launch,
        );
        let n = bufs.len();
        check(
            &format!("tensor-core dk (two kernels) {what}"),
            &bufs[n - 2],
            &dkk,
            (tk, dk),
        );
        check(
            &format!("tensor-core dv (two kernels) {what}"),
            &bufs[n - 1],
            &dvv,
            (tk, dv),
        );
    }
    if tc(Part::Short) && attention::fits_short(tq, tk, dk, dv) {
        let f = tensor::backward_short("flash_short_tc", a.mask, dk, dv);
        let t = attention::tile(Part::Short, dk, dv).unwrap();
        let mut bufs = head(
            vec![zeros_e(dq.len()), zeros_e(dkk.len()), zeros_e(dvv.len())],
            true,
        );
        run_with(
            cxx,
            &f,
            &mut bufs,
            &bdims,
            attention::items(Part::Short, t, b, h, tq, tk) as u64,
            launch,
        );
        let n = bufs.len();
        check(
            &format!("tensor-core dq {what}"),
            &bufs[n - 3],
            &dq,
            (tq, dk),
        );
        check(
            &format!("tensor-core dk {what}"),
            &bufs[n - 2],
            &dkk,
            (tk, dk),
        );
        check(
            &format!("tensor-core dv {what}"),
            &bufs[n - 1],
            &dvv,
            (tk, dv),
        );
    }

    if !tc_only {
        // The whole backward in one block per head, where the head fits its tile.
        if attention::fits_short(tq, tk, dk, dv) {
            let f = attention::backward_short("flash_short", a.mask, dk, dv, elem);
            let t = attention::tile(Part::Short, dk, dv).unwrap();
            let mut bufs = head(
                vec![zeros_e(dq.len()), zeros_e(dkk.len()), zeros_e(dvv.len())],
                true,
            );
            run_with(
                cxx,
                &f,
                &mut bufs,
                &bdims,
                attention::items(Part::Short, t, b, h, tq, tk) as u64,
                launch,
            );
            let n = bufs.len();
            check(&format!("short dq {what}"), &bufs[n - 3], &dq, (tq, dk));
            check(&format!("short dk {what}"), &bufs[n - 2], &dkk, (tk, dk));
            check(&format!("short dv {what}"), &bufs[n - 1], &dvv, (tk, dv));
        }
    }
}

#[test]
fn flash_attention_matches_the_definition_without_a_mask() {
    let Some(cxx) = gxx() else { return };
    for (tq, tk, block, merged) in [(1, 1, 4, false), (5, 7, 4, true), (37, 45, 32, true)] {
        let a = Attn {
            b: 2,
            h: 3,
            tq,
            tk,
            dk: 8,
            dv: 12,
            mask: MaskKind::None,
            scale: 0.35,
            fill: 0.0,
        };
        check_flash(cxx, &a, 21 + tq as u64, block, merged);
    }
}

#[test]
fn flash_attention_matches_the_definition_with_key_padding() {
    let Some(cxx) = gxx() else { return };
    for (tq, tk, block, merged) in [(6, 9, 4, false), (33, 40, 32, true)] {
        let a = Attn {
            b: 3,
            h: 2,
            tq,
            tk,
            dk: 12,
            dv: 8,
            mask: MaskKind::Key,
            scale: 0.3,
            fill: -1e9,
        };
        check_flash(cxx, &a, 31 + tq as u64, block, merged);
    }
}

#[test]
fn flash_attention_matches_the_definition_with_a_causal_mask() {
    let Some(cxx) = gxx() else { return };
    let a = Attn {
        b: 2,
        h: 2,
        tq: 35,
        tk: 35,
        dk: 8,
        dv: 8,
        mask: MaskKind::Causal,
        scale: 0.5,
        fill: -1e9,
    };
    check_flash(cxx, &a, 41, 32, false);
    // The Transformer's heads (64): 32-row tiles forward, 16-row tiles on the key side.
    let a = Attn {
        b: 1,
        h: 2,
        tq: 20,
        tk: 20,
        dk: 64,
        dv: 64,
        mask: MaskKind::Causal,
        scale: 0.125,
        fill: -1e9,
    };
    check_flash(cxx, &a, 43, 64, true);
}

/// The one-block backward at its tile's edge (32 rows; `check_flash` runs it wherever the
/// head fits), with every mask, in f32 and bf16.
#[test]
fn flash_backward_in_one_block_per_head_at_the_tile_edge() {
    use kiln_compiler::codegen::cuda::attention::{fits_short, tile, Part};
    let Some(cxx) = gxx() else { return };
    assert_eq!(tile(Part::Short, 8, 8), Some(32));
    assert!(fits_short(32, 32, 8, 8) && !fits_short(32, 33, 8, 8));
    for (mask, elem, block, merged) in [
        (MaskKind::Causal, Elem::F32, 32, true),
        (MaskKind::Key, Elem::Bf16, 64, true),
        (MaskKind::None, Elem::F32, 4, false),
    ] {
        let a = Attn {
            b: 3,
            h: 2,
            tq: 32,
            tk: if mask == MaskKind::Causal { 32 } else { 29 },
            dk: 8,
            dv: 8,
            mask,
            scale: 0.4,
            fill: -1e9,
        };
        check_flash_as(cxx, &a, 61, block, elem, merged);
    }
}

#[test]
fn flash_attention_in_bf16_matches_the_definition_within_bf16_rounding() {
    let Some(cxx) = gxx() else { return };
    let a = Attn {
        b: 2,
        h: 2,
        tq: 21,
        tk: 37,
        dk: 16,
        dv: 8,
        mask: MaskKind::Key,
        scale: 0.25,
        fill: -1e9,
    };
    check_flash_as(cxx, &a, 51, 32, Elem::Bf16, true);
    let a = Attn {
        b: 1,
        h: 2,
        tq: 33,
        tk: 33,
        dk: 8,
        dv: 8,
        mask: MaskKind::Causal,
        scale: 0.35,
        fill: -1e9,
    };
    check_flash_as(cxx, &a, 52, 16, Elem::Bf16, false);
}

/// The tensor-core kernels (`codegen::cuda::tensor`, which `check_flash_as` also runs
/// for bf16 heads of multiples of 16 in whole warps) alone: every mask; several key and
/// query tiles (`tk` 70, `tq` 45: the two-kernel backward), lengths not a multiple of 16
/// or 8, one-row heads, `dk ≠ dv`, blocks of one, two and eight warps, results with the
/// heads merged or not.
#[test]
fn flash_attention_on_tensor_cores_matches_the_definition_within_bf16_rounding() {
    let Some(cxx) = gxx() else { return };
    let cases = [
        (MaskKind::None, 1, 1, 16, 16, 32, false),
        (MaskKind::Key, 25, 25, 64, 64, 256, true),
        (MaskKind::Key, 21, 70, 48, 32, 64, false),
        (MaskKind::Causal, 45, 45, 32, 16, 32, true),
    ];
    for (k, (mask, tq, tk, dk, dv, block, merged)) in cases.into_iter().enumerate() {
        let a = Attn {
            b: 2,
            h: 2,
            tq,
            tk,
            dk,
            dv,
            mask,
            scale: 1.0 / (dk as f32).sqrt(),
            fill: -1e9,
        };
        check_flash_kernels(cxx, &a, 70 + k as u64, block, (Elem::Bf16, merged), true);
    }
}

/// A test kernel: every warp computes `c + a·b` for one m16n8k16 tile with the prelude's
/// `kiln_mma`, its fragments gathered from row-major `a` (16×16) and `b` (16×8) by PTX's
/// layout, into its own copy of the 16×8 result.
fn mma_tile_kernel() -> CudaFunction {
    let text = "extern \"C\" __global__ void mma_tile(const kiln_bf16* a, const kiln_bf16* b, const float* c, float* d, const kiln_dims dims, long long items) {
    (void)dims; (void)items;
    const int lane = (int)(threadIdx.x & 31u), g = lane >> 2, t = lane & 3, wp = (int)(threadIdx.x >> 5);
    float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
    const unsigned a0 = (unsigned)a[g * 16 + 2 * t] | ((unsigned)a[g * 16 + 2 * t + 1] << 16);
    const unsigned a1 = (unsigned)a[(g + 8) * 16 + 2 * t] | ((unsigned)a[(g + 8) * 16 + 2 * t + 1] << 16);
    const unsigned a2 = (unsigned)a[g * 16 + 2 * t + 8] | ((unsigned)a[g * 16 + 2 * t + 9] << 16);
    const unsigned a3 = (unsigned)a[(g + 8) * 16 + 2 * t + 8] | ((unsigned)a[(g + 8) * 16 + 2 * t + 9] << 16);
    const unsigned b0 = (unsigned)b[(2 * t) * 8 + g] | ((unsigned)b[(2 * t + 1) * 8 + g] << 16);
    const unsigned b1 = (unsigned)b[(2 * t + 8) * 8 + g] | ((unsigned)b[(2 * t + 9) * 8 + g] << 16);
    kiln_mma(acc, a0, a1, a2, a3, b0, b1);
    float* o = d + wp * 128;
    o[g * 8 + 2 * t] = acc[0];
    o[g * 8 + 2 * t + 1] = acc[1];
    o[(g + 8) * 8 + 2 * t] = acc[2];
    o[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
";
    CudaFunction {
        name: "mma_tile".into(),
        params: vec![
            cuda_param("a", "const kiln_bf16*"),
            cuda_param("b", "const kiln_bf16*"),
            cuda_param("c", "const float*"),
            cuda_param("d", "float*"),
        ],
        work: kiln_compiler::codegen::cuda::Work::Blocks,
        items_rule: "one tile".into(),
        text: text.into(),
    }
}

/// `kiln_mma` gives `c + a·b` with the operands in PTX's `mma.m16n8k16` fragment layout:
/// under the shim's exchange and through the shuffles of GPUs before sm_80 alike (each
/// product of bf16 values is exact; only the order of the f32 sums may differ).
#[test]
fn tensor_core_tile_follows_the_ptx_fragment_layout() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(91);
    let a: Vec<f32> = as_f32(&rng.floats(256, -2.0, 2.0))
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect();
    let b: Vec<f32> = as_f32(&rng.floats(128, -2.0, 2.0))
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect();
    let c = as_f32(&rng.floats(128, -1.0, 1.0));
    let want: Vec<f32> = (0..16)
        .flat_map(|i| (0..8).map(move |j| (i, j)))
        .map(|(i, j)| {
            let s: f64 = (0..16)
                .map(|k| a[i * 16 + k] as f64 * b[k * 8 + j] as f64)
                .sum();
            (c[i * 8 + j] as f64 + s) as f32
        })
        .collect();
    let f = mma_tile_kernel();
    for pre in ["", "#undef KILN_HOST_MMA"] {
        let warps = 2;
        let mut bufs = vec![bf16s(&a), bf16s(&b), f32s(&c), zeros(128 * warps)];
        run_pre(cxx, &f, &mut bufs, &[], 1, (1, 32 * warps as u32), pre);
        let got = as_f32(&bufs[3]);
        for w in 0..warps {
            for (k, (x, y)) in got[w * 128..(w + 1) * 128].iter().zip(&want).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                    "{pre:?} warp {w}: element ({}, {}): {x}, want {y}",
                    k / 8,
                    k % 8
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// bf16 storage.

/// A kernel over the prelude's conversions: `bits[i] = narrow(x[i])`, `wide[i] =
/// widen(bits[i])`.
fn bf16_roundtrip_kernel() -> CudaFunction {
    let text = "extern \"C\" __global__ void bf16_roundtrip(const float* x, kiln_bf16* bits, float* wide, const kiln_dims dims, long long items) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < items; i += (long long)gridDim.x * blockDim.x) {
        const kiln_bf16 h = kiln_f32_to_bf16(x[i]);
        bits[i] = h;
        wide[i] = kiln_bf16_to_f32(h);
    }
    (void)dims;
}
";
    CudaFunction {
        name: "bf16_roundtrip".into(),
        params: vec![
            cuda_param("x", "const float*"),
            cuda_param("bits", "kiln_bf16*"),
            cuda_param("wide", "float*"),
        ],
        work: kiln_compiler::codegen::cuda::Work::Threads,
        items_rule: "elements".into(),
        text: text.into(),
    }
}

fn cuda_param(name: &str, c_type: &str) -> kiln_compiler::codegen::cuda::Param {
    kiln_compiler::codegen::cuda::Param {
        name: name.into(),
        c_type: c_type.into(),
    }
}

#[test]
fn bf16_conversions_are_the_half_crates_bit_for_bit() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(61);
    let mut xs: Vec<u32> = vec![
        0,
        0x8000_0000,
        0x7f80_0000, // inf
        0xff80_0000, // -inf
        0x7fc0_0000, // NaN
        0x7f80_0001, // a signalling NaN with a low payload (must stay NaN)
        0xffff_ffff, // -NaN, every payload bit
        0x7f7f_ffff, // the largest finite: rounds up to inf
        0x7f7f_7fff, // just below the tie: stays finite
        0x0000_0001, // the smallest subnormal
        0x3f80_8000, // 1 + 2⁻⁸: a tie, to even (down)
        0x3f81_8000, // 1 + 3·2⁻⁸: a tie, to even (up)
        0x3f80_8001, // just above a tie: up
        0xbf80_8000, // a negative tie
    ];
    xs.extend((0..4000).map(|_| rng.next() as u32));
    let x: Vec<f32> = xs.iter().map(|&b| f32::from_bits(b)).collect();
    let n = x.len();
    let mut bufs = vec![f32s(&x), vec![0u8; 2 * n], zeros(n)];
    run(cxx, &bf16_roundtrip_kernel(), &mut bufs, &[], n as u64);
    let wide = as_f32(&bufs[2]);
    for (i, &v) in x.iter().enumerate() {
        let want = half::bf16::from_f32(v);
        let got = u16::from_le_bytes([bufs[1][2 * i], bufs[1][2 * i + 1]]);
        if v.is_nan() {
            assert!(
                half::bf16::from_bits(got).is_nan(),
                "{:#010x}: {got:#06x}",
                xs[i]
            );
        } else {
            assert_eq!(got, want.to_bits(), "{:#010x} ({v})", xs[i]);
        }
        assert_eq!(wide[i].to_bits(), (got as u32) << 16, "widening {got:#06x}");
    }
}

#[test]
fn row_kernels_in_bf16_match_the_cpu_within_bf16_rounding() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(71);
    // softmax: bf16 in and out against the CPU kernel on the rounded input.
    let (rows_n, c) = (5usize, 37usize);
    let x = through_bf16(&rng.floats(rows_n * c, -4.0, 4.0));
    let (dims, items) = rows::softmax_dims(rows_n, c);
    let mut g = vec![bf16s(&as_f32(&x)), vec![0u8; 2 * rows_n * c]];
    run(
        cxx,
        &cuda::rows::softmax("softmax_0", Elem::Bf16),
        &mut g,
        &dims,
        rows_n as u64,
    );
    let mut h = vec![x.clone(), zeros(rows_n * c)];
    run_cpu(
        &rows::softmax("softmax_0"),
        "softmax_0",
        &mut h,
        &dims,
        items,
    );
    close_bf16("softmax bf16", &g[1], &as_f32(&h[1]));

    // The masked scaled softmax with key padding.
    let (b, hh, tq, tk) = (2usize, 2usize, 3usize, 11usize);
    let n = b * hh * tq * tk;
    let x = through_bf16(&rng.floats(n, -3.0, 3.0));
    let mask: Vec<i32> = (0..b * tk).map(|i| (i % tk < 7 + i / tk) as i32).collect();
    let (dims, items) = rows::scale_mask_softmax_dims(b, hh, tq, tk);
    let f = cuda::rows::scale_mask_softmax("scale_mask_softmax_0", MaskKind::Key, Elem::Bf16);
    let mut g = vec![
        bf16s(&as_f32(&x)),
        i32s(&mask),
        one(0.5),
        one(-1e9),
        vec![0u8; 2 * n],
    ];
    run(cxx, &f, &mut g, &dims, items as u64);
    let mut h = vec![x.clone(), i32s(&mask), one(0.5), one(-1e9), zeros(n)];
    run_cpu(
        &rows::scale_mask_softmax("scale_mask_softmax_0", MaskKind::Key),
        "scale_mask_softmax_0",
        &mut h,
        &dims,
        items,
    );
    close_bf16("scale_mask_softmax bf16", &g[4], &as_f32(&h[4]));

    // add_layer_norm: bf16 activations, f32 gain and bias.
    let (rows_n, d) = (4usize, 24usize);
    let x = through_bf16(&rng.floats(rows_n * d, -2.0, 2.0));
    let y = through_bf16(&rng.floats(rows_n * d, -2.0, 2.0));
    let gamma = rng.floats(d, 0.5, 1.5);
    let beta = rng.floats(d, -0.5, 0.5);
    let (dims, items) = rows::add_layer_norm_dims(rows_n, d);
    let (inv_d, eps) = (one(1.0 / d as f32), one(1e-5));
    let mut g = vec![
        bf16s(&as_f32(&x)),
        bf16s(&as_f32(&y)),
        gamma.clone(),
        beta.clone(),
        inv_d.clone(),
        eps.clone(),
        vec![0u8; 2 * rows_n * d],
    ];
    let f = cuda::rows::add_layer_norm("add_layer_norm_0", Elem::Bf16);
    run(cxx, &f, &mut g, &dims, rows_n as u64);
    let mut h = vec![x, y, gamma, beta, inv_d, eps, zeros(rows_n * d)];
    run_cpu(
        &rows::add_layer_norm("add_layer_norm_0", true, false),
        "add_layer_norm_0",
        &mut h,
        &dims,
        items,
    );
    close_bf16("add_layer_norm bf16", &g[6], &as_f32(&h[6]));
}

/// The resident decoder's row gather (`resident::take_rows`): rows reordered and
/// repeated as beam search asks, every word copied exactly (NaN payloads and negative
/// zeros included), whatever the grid.
#[test]
fn take_rows_gathers_rows_exactly() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(47);
    let (src_rows, width) = (5usize, 9usize);
    let mut src = rng.floats(src_rows * width, -1.0, 1.0);
    // Odd bit patterns travel as they are.
    src[..4].copy_from_slice(&0x7fc0_1234u32.to_le_bytes());
    src[4..8].copy_from_slice(&0x8000_0000u32.to_le_bytes());
    let rows: Vec<i32> = vec![4, 0, 0, 2, 4, 4, 1];
    let (dims, items) = cuda::resident::take_rows_dims(rows.len(), width);
    let mut want = Vec::new();
    for &r in &rows {
        want.extend_from_slice(&src[r as usize * width * 4..(r as usize + 1) * width * 4]);
    }
    for launch in [(GRID, BLOCK), (1, 32)] {
        let mut g = vec![
            i32s(&rows),
            src.clone(),
            f32s(&vec![f32::NAN; rows.len() * width]),
        ];
        run_with(
            cxx,
            &cuda::resident::take_rows(),
            &mut g,
            &dims,
            items as u64,
            launch,
        );
        assert_eq!(g[2], want, "grid {launch:?}");
    }
}

/// `v` logits' best `k` tokens, as the host decoder ranks them: larger value, then
/// smaller id, NaN and `banned` left out; `(id, value − lse)`, `lse` summed in order.
fn top_k_reference(x: &[f32], k: usize, banned: &[i32]) -> (f64, Vec<(i32, f64)>) {
    let m = x
        .iter()
        .filter(|a| !a.is_nan())
        .fold(f32::NEG_INFINITY, |m, &a| m.max(a));
    let s: f64 = x
        .iter()
        .filter(|a| !a.is_nan())
        .map(|&a| (a as f64 - m as f64).exp())
        .sum();
    let lse = m as f64 + s.ln();
    let mut ids: Vec<usize> = (0..x.len())
        .filter(|&j| !x[j].is_nan() && !banned.contains(&(j as i32)))
        .collect();
    ids.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    let best = ids
        .iter()
        .take(k)
        .map(|&j| (j as i32, x[j] as f64 - lse))
        .collect();
    (lse, best)
}

/// The decoder's top-k on the device (`resident::row_top_k`): per row the `k` best
/// tokens (ties to the smaller id, NaN and banned ids skipped, `−1`/`−∞` past the last),
/// their log-probabilities within 1e-12 of the host's f64 log-softmax, and the
/// end-of-sentence log-probability; rows at a stride and offset (the last position of
/// `[rows, len, v]`), f32 and bf16 logits, several block sizes.
#[test]
fn row_top_k_picks_what_the_host_decoder_picks() {
    let Some(cxx) = gxx() else { return };
    let mut rng = Rng(53);
    let (rows, len, v) = (5usize, 2usize, 37usize);
    let mut x = as_f32(&rng.floats(rows * len * v, -4.0, 4.0));
    // Ties (a repeated maximum), NaN, −∞ and a row with fewer candidates than k.
    let last = |r: usize, j: usize| (r * len + len - 1) * v + j;
    x[last(0, 5)] = 9.0;
    x[last(0, 30)] = 9.0;
    x[last(1, 3)] = f32::NAN;
    x[last(1, 7)] = f32::NEG_INFINITY;
    for j in 0..v {
        if j > 4 {
            x[last(4, j)] = f32::NAN;
        }
    }
    let banned = [0i32, 1];
    let (k, eos) = (6usize, 2i32);
    for e in [Elem::F32, Elem::Bf16] {
        let xs: Vec<f32> = match e {
            Elem::F32 => x.clone(),
            Elem::Bf16 => from_bf16(&bf16s(&x)),
        };
        let f = cuda::resident::row_top_k(e);
        let (dims, items) =
            cuda::resident::row_top_k_dims(rows, (v, len * v, (len - 1) * v), k, 2, eos);
        for launch in [(GRID, BLOCK), (2, 8)] {
            let mut g = vec![
                match e {
                    Elem::F32 => f32s(&xs),
                    Elem::Bf16 => bf16s(&xs),
                },
                i32s(&banned),
                vec![0u8; 8 * rows * k],
                zeros(rows * k),
                vec![0u8; 8 * rows],
            ];
            run_with(cxx, &f, &mut g, &dims, items as u64, launch);
            let f64s = |b: &[u8]| -> Vec<f64> {
                b.chunks(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                    .collect()
            };
            let (vals, idx, eos_lp) = (f64s(&g[2]), as_i32(&g[3]), f64s(&g[4]));
            for r in 0..rows {
                let row = &xs[last(r, 0)..last(r, 0) + v];
                let (lse, want) = top_k_reference(row, k, &banned);
                for slot in 0..k {
                    let (gi, gv) = (idx[r * k + slot], vals[r * k + slot]);
                    match want.get(slot) {
                        Some(&(wi, wv)) => {
                            assert_eq!(gi, wi, "{e:?} {launch:?} row {r} slot {slot}");
                            assert!(
                                (gv - wv).abs() <= 1e-12 * wv.abs().max(1.0) || gv == wv,
                                "{e:?} row {r} slot {slot}: {gv} vs {wv}"
                            );
                        }
                        None => assert!(gi == -1 && gv == f64::NEG_INFINITY, "row {r} {slot}"),
                    }
                }
                let we = row[eos as usize] as f64 - lse;
                assert!(
                    (eos_lp[r] - we).abs() <= 1e-12 * we.abs().max(1.0),
                    "eos {r}"
                );
            }
            // The tie at the top of row 0 goes to the smaller id.
            assert_eq!(&idx[..2], &[5, 30]);
            // Row 4 has three candidates (ids 2, 3, 4).
            assert_eq!(&idx[4 * k + 3..5 * k], &[-1, -1, -1]);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Mixed precision: the kernels a bf16 program generates per element type.

/// `bytes` (4-byte f32 elements) as stored in `e`: unchanged, or rounded to bf16.
fn store_as(e: Elem, bytes: &[u8]) -> Vec<u8> {
    match e {
        Elem::F32 => bytes.to_vec(),
        Elem::Bf16 => bf16s(&as_f32(bytes)),
    }
}

/// A buffer stored in `e` widened to f32 bytes.
fn widened(e: Elem, bytes: &[u8]) -> Vec<u8> {
    match e {
        Elem::F32 => bytes.to_vec(),
        Elem::Bf16 => f32s(&from_bf16(bytes)),
    }
}

/// Runs `mixed` over `bufs` stored as `elems` and the f32 kernel `plain` over the same
/// values widened; the results (`outs`, by buffer index) must be the f32 kernel's,
/// rounded where stored in bf16, bit for bit: the bf16 variant only widens its loads
/// and rounds its stores.
#[allow(clippy::too_many_arguments)]
fn same_as_f32(
    cxx: &str,
    what: &str,
    mixed: &CudaFunction,
    plain: &CudaFunction,
    bufs: &[Vec<u8>],
    elems: &[Option<Elem>],
    outs: &[usize],
    (dims, items): (&[i64], u64),
) {
    // Operands hold values bf16 can represent, so both kernels read the same numbers.
    let exact_in: Vec<Vec<u8>> = bufs
        .iter()
        .zip(elems)
        .map(|(b, e)| match e {
            Some(Elem::Bf16) => through_bf16(b),
            _ => b.clone(),
        })
        .collect();
    let mut m: Vec<Vec<u8>> = exact_in
        .iter()
        .zip(elems)
        .map(|(b, e)| e.map_or_else(|| b.clone(), |e| store_as(e, b)))
        .collect();
    run(cxx, mixed, &mut m, dims, items);
    let mut p = exact_in.clone();
    run(cxx, plain, &mut p, dims, items);
    for &k in outs {
        let e = elems[k].unwrap_or(Elem::F32);
        let want = store_as(e, &p[k]);
        assert_eq!(m[k].len(), want.len(), "{what}: buffer {k} size");
        assert!(
            m[k] == want,
            "{what}: buffer {k}: {:?} vs {:?}",
            as_f32(&widened(e, &m[k])),
            as_f32(&widened(e, &want))
        );
    }
}

/// Integer and bool operands and an integer result through the regions' vector path
/// (rows of 8 and 12: whole groups in a row) and a rank-1 region of 10 elements (two
/// vector groups, then a group of two, one element at a time): bit-identical to the CPU
/// kernel, and to the definition.
#[test]
fn integer_and_bool_regions_take_vector_loads_as_the_cpu_does() {
    use kiln_compiler::ir::{BinaryOp, CmpOp};
    let Some(cxx) = gxx() else { return };
    for shape in [vec![3usize, 8], vec![2, 12], vec![10]] {
        let n: usize = shape.iter().product();
        let c = *shape.last().unwrap();
        let dims_of: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let contiguous: Vec<isize> = if shape.len() == 2 {
            vec![c as isize, 1]
        } else {
            vec![1]
        };
        // where(mask, x · f32(k), −x), then as i32 plus k (a float and an int result).
        let float_out = Expr {
            out: TensorType::new(DType::F32, Shape::consts(&dims_of)),
            inputs: 3,
            insts: vec![
                Inst::In(0),
                Inst::In(1),
                Inst::In(2),
                Inst::Cast(DType::F32, 2),
                Inst::Bin(BinaryOp::Mul, 1, 3),
                Inst::Un(kiln_compiler::ir::UnaryOp::Neg, 1),
                Inst::Where(0, 4, 5),
            ],
        };
        let int_out = Expr {
            out: TensorType::new(DType::I32, Shape::consts(&dims_of)),
            inputs: 3,
            insts: vec![
                Inst::In(1),
                Inst::Cast(DType::I32, 0),
                Inst::In(2),
                Inst::Bin(BinaryOp::Add, 1, 2),
                Inst::In(0),
                Inst::Const(Float::new(0.0), DType::I32),
                Inst::Where(4, 3, 5),
                Inst::Const(Float::new(5.0), DType::I32),
                Inst::Cmp(CmpOp::Lt, 6, 7),
                Inst::Cast(DType::I32, 8),
                Inst::Bin(BinaryOp::Mul, 6, 9),
            ],
        };
        let dtypes = [DType::Bool, DType::F32, DType::I32];
        let inner = [true, true, true];
        let strides = vec![contiguous.clone(); 3];
        let mut rng = Rng(n as u64 + 7);
        let mask: Vec<i32> = (0..n).map(|i| ((i * 7 + 3) % 5 < 3) as i32).collect();
        let ks: Vec<i32> = (0..n).map(|i| (i as i32 * 13) % 9 - 4).collect();
        let xs = rng.floats(n, -8.0, 8.0);
        for (what, expr) in [("float result", &float_out), ("int result", &int_out)] {
            let f = cuda::region::region("region_0", expr, &inner, &dtypes).expect("emits");
            let cpu = region::region_typed("region_0", expr, &inner, &dtypes).expect("CPU region");
            let (dims, rows_n) = region::region_dims(expr, &shape, &strides, 1, 1);
            let bufs = vec![i32s(&mask), xs.clone(), i32s(&ks), f32s(&vec![f32::NAN; n])];
            let mut g = bufs.clone();
            run_with(cxx, &f, &mut g, &dims, n as u64, (2, 32));
            let mut h = bufs.clone();
            run_cpu(&cpu, "region_0", &mut h, &dims, rows_n);
            exact(&format!("{what} {shape:?}"), &g[3], &h[3]);
            let x = as_f32(&xs);
            for i in 0..n {
                let got = &g[3][4 * i..4 * i + 4];
                let m = mask[i] != 0;
                if expr.out.dtype == DType::F32 {
                    let want = if m { x[i] * ks[i] as f32 } else { -x[i] };
                    assert_eq!(got, want.to_le_bytes(), "{what} {shape:?} element {i}");
                } else {
                    let v = if m { x[i] as i32 + ks[i] } else { 0 };
                    let want = v * (v < 5) as i32;
                    assert_eq!(got, want.to_le_bytes(), "{what} {shape:?} element {i}");
                }
            }
        }
    }
}

#[test]
fn mixed_precision_kernels_are_the_f32_kernels_with_rounded_stores() {
    let Some(cxx) = gxx() else { return };
    use kiln_compiler::codegen::cuda::index;
    use kiln_compiler::ir::BinaryOp;
    let (b16, f) = (Some(Elem::Bf16), Some(Elem::F32));
    let mut rng = Rng(41);

    // A region: bf16 activation · f32 row vector + dropout, max with a constant, into bf16;
    // rows of 11 (one element at a time) and of 12 (vector groups).
    for (r, c) in [(6usize, 11usize), (5, 12)] {
        let expr = Expr {
            out: TensorType::new(DType::F32, Shape::consts(&[r as i64, c as i64])),
            inputs: 2,
            insts: vec![
                Inst::In(0),
                Inst::In(1),
                Inst::Bin(BinaryOp::Mul, 0, 1),
                Inst::Dropout(Float::new(0.2), 3, 2),
                Inst::Const(Float::new(-0.5), DType::F32),
                Inst::Bin(BinaryOp::Max, 3, 4),
            ],
        };
        let inner = [true, true];
        let dtypes = [DType::F32, DType::F32];
        let strides = vec![vec![c as isize, 1], vec![0, 1]];
        let (dims, _) = region::region_dims(&expr, &[r, c], &strides, 99, 4);
        let mixed = cuda::region::region_as(
            "region_0",
            &expr,
            &inner,
            &dtypes,
            &[Elem::Bf16, Elem::F32],
            Elem::Bf16,
        )
        .unwrap();
        assert!(
            mixed.params[0].c_type == "const kiln_bf16*"
                && mixed.params[1].c_type == "const float*"
        );
        let plain = cuda::region::region("region_0", &expr, &inner, &dtypes).unwrap();
        let bufs = vec![
            rng.floats(r * c, -2.0, 2.0),
            rng.floats(c, -1.0, 1.0),
            zeros(r * c),
        ];
        same_as_f32(
            cxx,
            "region",
            &mixed,
            &plain,
            &bufs,
            &[b16, f, b16],
            &[2],
            (&dims, (r * c) as u64),
        );
    }
    // A bf16 store of an integer region's output is refused.
    let ints = Expr {
        out: TensorType::new(DType::I32, Shape::consts(&[3])),
        inputs: 1,
        insts: vec![Inst::In(0)],
    };
    assert!(
        cuda::region::region_as("r", &ints, &[true], &[DType::I32], &[Elem::F32], Elem::Bf16)
            .is_err()
    );

    // embed_pe with dropout: f32 table and positions, bf16 output.
    let (vocab, d, b, t) = (9usize, 6usize, 2usize, 5usize);
    let ids: Vec<i32> = (0..b * t).map(|i| ((i * 5 + 2) % vocab) as i32).collect();
    let bufs = vec![
        rng.floats(vocab * d, -1.0, 1.0),
        i32s(&ids),
        rng.floats(t * d, -1.0, 1.0),
        one(2.5),
        zeros(b * t * d),
    ];
    let (dims, _) = region::embed_pe_dims([b, t, d], Some((0.1, 2)), (5, 8));
    for pe in [Elem::F32, Elem::Bf16] {
        same_as_f32(
            cxx,
            &format!("embed_pe, pe {pe:?}"),
            &cuda::region::embed_pe_as("embed_pe_0", true, pe, Elem::Bf16),
            &cuda::region::embed_pe("embed_pe_0", true),
            &bufs,
            &[f, None, Some(pe), f, b16],
            &[4],
            (&dims, (b * t * d) as u64),
        );
    }

    // Bias gradients: bf16 rows summed into f32 (both passes); rows of 13 (a column at a
    // time) and of 20 (vector loads).
    let (rows, n) = (150usize, 13usize);
    for n in [n, 20] {
        let (dims, _) = misc::sum_rows_dims(&[3, 50, n]);
        let chunks = cuda::misc::sum_rows_chunks(rows);
        same_as_f32(
            cxx,
            &format!("sum_rows of rows of {n}"),
            &cuda::misc::sum_rows_as("sum_rows_0", 2, Elem::Bf16).unwrap(),
            &cuda::misc::sum_rows("sum_rows_0", 2).unwrap(),
            &[rng.floats(rows * n, -1.0, 1.0), zeros(chunks * n)],
            &[b16, f],
            &[1],
            (&dims, cuda::misc::sum_rows_items(rows, n) as u64),
        );
    }
    let (dims, _) = misc::sum_rows_dims(&[3, 50, n]);
    let chunks = cuda::misc::sum_rows_chunks(rows);
    for y in [Elem::F32, Elem::Bf16] {
        same_as_f32(
            cxx,
            &format!("sum_rows_finish into {y:?}"),
            &cuda::misc::sum_rows_finish_as("sum_rows_finish_0", 2, y).unwrap(),
            &cuda::misc::sum_rows_finish("sum_rows_finish_0", 2).unwrap(),
            &[rng.floats(chunks * n, -9.0, 9.0), zeros(n)],
            &[f, Some(y)],
            &[1],
            (&dims, cuda::misc::sum_rows_finish_items(n) as u64),
        );
    }

    // Reductions over bf16, both layouts and ops, into bf16 or f32.
    let (outer, len, inner_n) = (4usize, 9usize, 5usize);
    for op in [Reduce::Sum, Reduce::Max] {
        for (layout, inner_n) in [(ReduceLayout::Across, inner_n), (ReduceLayout::Rows, 1)] {
            let (dims, _) = misc::reduce_dims(layout, outer, len, inner_n);
            let items = match layout {
                ReduceLayout::Rows => outer,
                ReduceLayout::Across => outer * inner_n,
            };
            for y in [Elem::F32, Elem::Bf16] {
                same_as_f32(
                    cxx,
                    &format!("reduce {op:?} {layout:?} into {y:?}"),
                    &cuda::misc::reduce_as("reduce_0", op, layout, Elem::Bf16, y),
                    &cuda::misc::reduce("reduce_0", op, layout),
                    &[rng.floats(outer * len * inner_n, -3.0, 3.0), zeros(items)],
                    &[b16, Some(y)],
                    &[1],
                    (&dims, items as u64),
                );
            }
        }
    }

    // The embedding gradient: bf16 rows scattered into an f32 table.
    let (rows, width) = (7usize, 5usize);
    let ids: Vec<i32> = vec![3, 0, 6, 3, 1, 3];
    let (start, order) = index::scatter_index(&ids, rows).unwrap();
    let (dims, items) = index::scatter_rows_dims(rows, width);
    same_as_f32(
        cxx,
        "scatter_rows",
        &index::scatter_rows_as("scatter_rows_0", Elem::Bf16, Elem::F32),
        &index::scatter_rows("scatter_rows_0"),
        &[
            i32s(&start),
            i32s(&order),
            rng.floats(ids.len() * width, -1.0, 1.0),
            zeros(rows * width),
        ],
        &[None, None, b16, f],
        &[3],
        (&dims, items as u64),
    );

    // concat: a bf16 cache and a new bf16 position (raw), and mixed operands (converted).
    let sizes = [3usize, 1];
    let (dims, items) = index::concat_dims(2, 4, &sizes);
    let parts = vec![
        rng.floats(2 * 3 * 4, -1.0, 1.0),
        rng.floats(2 * 4, -1.0, 1.0),
        zeros(items),
    ];
    for (ins, out) in [
        ([Elem::Bf16, Elem::Bf16], Elem::Bf16),
        ([Elem::F32, Elem::Bf16], Elem::Bf16),
        ([Elem::Bf16, Elem::F32], Elem::F32),
    ] {
        same_as_f32(
            cxx,
            &format!("concat {ins:?} -> {out:?}"),
            &index::concat_as("concat_0", &ins, out).unwrap(),
            &index::concat("concat_0", 2).unwrap(),
            &parts,
            &[Some(ins[0]), Some(ins[1]), Some(out)],
            &[2],
            (&dims, items as u64),
        );
    }

    // A strided view of bf16 elements: a transpose.
    let (s0, s1) = (3usize, 4usize);
    let xs = from_bf16(&bf16s(&as_f32(&rng.floats(s0 * s1, -1.0, 1.0))));
    let view_dims: Vec<i64> = vec![1, 1, 1, s1 as i64, s0 as i64, 0, 0, 0, 1, s1 as i64];
    let mut g = vec![bf16s(&xs), vec![0u8; 2 * s0 * s1]];
    let copy = cuda::misc::copy_strided_as("copy_strided16_0", Elem::Bf16);
    run(cxx, &copy, &mut g, &view_dims, (s0 * s1) as u64);
    let want: Vec<f32> = (0..s1)
        .flat_map(|j| (0..s0).map(move |i| (i, j)))
        .map(|(i, j)| xs[i * s1 + j])
        .collect();
    assert_eq!(from_bf16(&g[1]), want, "copy_strided of bf16");
}

/// The activations (#61) in the CUDA C regions (`tanhf`, `erff`, the sigmoid and SiLU by
/// `expf`, `rsqrt` by `sqrtf`), compiled on the host: within a few ulp of the CPU
/// region's polynomials, NaN where it is NaN.
#[test]
fn activation_regions_agree_with_the_cpu() {
    use kiln_compiler::ir::UnaryOp;
    let Some(cxx) = gxx() else { return };
    let n = 203usize;
    let mut rng = Rng(11);
    let mut xs = as_f32(&rng.floats(n - 5, -9.0, 9.0));
    xs.extend([0.0, -0.0, 40.0, -40.0, f32::NAN]);
    for u in [
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Erf,
        UnaryOp::Rsqrt,
        UnaryOp::Silu,
    ] {
        let expr = Expr {
            out: TensorType::new(DType::F32, Shape::consts(&[n as i64])),
            inputs: 1,
            insts: vec![Inst::In(0), Inst::Un(u, 0)],
        };
        let dtypes = [DType::F32];
        let f = cuda::region::region("region_0", &expr, &[true], &dtypes).expect("emits");
        let cpu = region::region_typed("region_0", &expr, &[true], &dtypes).expect("CPU region");
        let (dims, rows_n) = region::region_dims(&expr, &[n], &[vec![1]], 1, 1);
        let bufs = vec![f32s(&xs), f32s(&vec![f32::NAN; n])];
        let mut g = bufs.clone();
        run_with(cxx, &f, &mut g, &dims, n as u64, (2, 32));
        let mut h = bufs.clone();
        run_cpu(&cpu, "region_0", &mut h, &dims, rows_n);
        for (i, (a, b)) in as_f32(&g[1]).iter().zip(as_f32(&h[1])).enumerate() {
            let x = xs[i];
            if b.is_nan() {
                assert!(a.is_nan(), "{u:?}({x}): {a} on the device, NaN on the CPU");
                continue;
            }
            if b.is_infinite() {
                assert_eq!(*a, b, "{u:?}({x})");
                continue;
            }
            assert!(
                (a - b).abs() <= 4e-7 * b.abs() + 3e-7,
                "{u:?}({x}): {a} on the device, {b} on the CPU"
            );
        }
    }
}

/// The `plain` layer norm (no `y`: a pre-LN block's) gives the bits of the adding one
/// with `y = 0`, forward and backward, on the CPU and in the CUDA C (rows in registers
/// and through memory); its `y` operand is not read (NaN there changes nothing). The
/// backward's `carry` form (the residual path's gradient in `y`'s slot) gives `dx` as
/// that gradient plus the plain form's `dx`, bit for bit, and the same `dγ`, `dβ`. The
/// same for RMSNorm's forms (`rms`: no mean, `β` unread — NaN there changes nothing).
#[test]
fn plain_layer_norm_is_the_adding_one_with_y_zero() {
    let mut rng = Rng(71);
    let (rows_n, d) = (37usize, 96usize);
    let x = rng.floats(rows_n * d, -2.0, 2.0);
    let g = rng.floats(rows_n * d, -1.0, 1.0);
    let carried = rng.floats(rows_n * d, -1.0, 1.0);
    let gamma = rng.floats(d, 0.5, 1.5);
    let real_beta = rng.floats(d, -0.5, 0.5);
    let nan_beta = f32s(&vec![f32::NAN; d]);
    for rms in [false, true] {
        let beta = if rms { &nan_beta } else { &real_beta };
        let (inv_d, eps) = (one(1.0 / d as f32), one(1e-5));
        let out = vec![0u8; x.len()];
        let nans = f32s(&vec![f32::NAN; rows_n * d]);
        let zero_y = zeros(rows_n * d);
        let fwd = |y: &Vec<u8>| {
            let ops = [&x, y, &gamma, beta, &inv_d, &eps, &out];
            ops.map(|b| b.clone()).to_vec()
        };
        let bwd = |y: &Vec<u8>| {
            let scratch = zeros(rows::add_layer_norm_bwd_scratch(rows_n, d));
            let ops = [&x, y, &gamma, &g, &inv_d, &eps, &out, &scratch];
            ops.map(|b| b.clone()).to_vec()
        };
        let plus_carried = |dx: &[u8]| {
            let s: Vec<f32> = as_f32(&carried)
                .iter()
                .zip(as_f32(dx))
                .map(|(c, v)| c + v)
                .collect();
            f32s(&s)
        };
        let (dims, items) = rows::add_layer_norm_dims(rows_n, d);
        let (bdims, bitems) = rows::add_layer_norm_bwd_dims(rows_n, d);
        type Run<'a> = dyn Fn(LnForm, &Vec<u8>) -> (Vec<u8>, Vec<u8>, Vec<u8>) + 'a;
        let check = |what: &str, run: &Run| {
            let want = run(LnForm::Add, &zero_y);
            assert!(as_f32(&want.0).iter().all(|v| v.is_finite()), "{what}");
            assert_eq!(run(LnForm::Plain, &nans), want, "{what}: plain");
            let c = run(LnForm::Carry, &carried);
            assert_eq!(c.0, want.0, "{what}: carry's forward");
            assert_eq!(c.1, plus_carried(&want.1), "{what}: carry's dx");
            assert_eq!(c.2, want.2, "{what}: carry's dγ, dβ partials");
        };
        // CPU (the forward's carry form is the plain one).
        let cpu_out = std::cell::RefCell::new(Vec::new());
        check(&format!("CPU, rms {rms}"), &|form, y| {
            let mut a = fwd(y);
            let f = rows::add_layer_norm("add_layer_norm_0", form == LnForm::Add, rms);
            run_cpu(&f, "add_layer_norm_0", &mut a, &dims, items);
            let mut b = bwd(y);
            let f = rows::add_layer_norm_bwd("add_layer_norm_bwd_0", form, rms);
            run_cpu(&f, "add_layer_norm_bwd_0", &mut b, &bdims, bitems);
            if form == LnForm::Add {
                *cpu_out.borrow_mut() = as_f32(&a[6]);
            }
            (a[6].clone(), b[6].clone(), b[7].clone())
        });
        // RMSNorm's forward against its definition, in f64.
        if rms {
            let xs = as_f32(&x);
            let gs = as_f32(&gamma);
            let got = cpu_out.borrow();
            for r in 0..rows_n {
                let row = &xs[r * d..(r + 1) * d];
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
                let inv = 1.0 / (ms + 1e-5).sqrt();
                for j in 0..d {
                    let want = row[j] as f64 * inv * gs[j] as f64;
                    let g = got[r * d + j] as f64;
                    assert!(
                        (g - want).abs() <= 1e-5 * want.abs() + 1e-6,
                        "rms row {r}: {g} vs {want}"
                    );
                }
            }
        }
        // CUDA C on the host.
        let Some(cxx) = gxx() else { continue };
        for regs in [cuda::rows::row_lane(Some(d)), 0] {
            check(&format!("CUDA, {regs} a lane, rms {rms}"), &|form, y| {
                let mut a = fwd(y);
                let add = form == LnForm::Add;
                let f =
                    cuda::rows::add_layer_norm_with("add_layer_norm_0", Elem::F32, regs, add, rms);
                run_with(cxx, &f, &mut a, &dims, rows_n as u64, (2, 64));
                let mut b = bwd(y);
                let f = cuda::rows::add_layer_norm_bwd_with(
                    "add_layer_norm_bwd_0",
                    Elem::F32,
                    regs,
                    form,
                    rms,
                );
                run_with(cxx, &f, &mut b, &bdims, bitems as u64, (2, 64));
                (a[6].clone(), b[6].clone(), b[7].clone())
            });
        }
    }
}
