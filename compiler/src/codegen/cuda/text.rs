//! CUDA C text: an indenting writer, exact constants, the element type of loads and
//! stores, and the prelude every kernel is compiled with.
//!
//! In: what an emitter wants to write. Out: deterministic text. Constants never go
//! through Rust's float formatting (which prints `NaN` and `inf`, and rounds): an `f32`
//! is written as a small exact integer (`2.0f`) or as its bit pattern
//! (`__int_as_float(0x3dcccccd)`), an `i32` as its bit pattern, so the text is exact.

use crate::codegen::cuda::philox;

/// Threads per block of every kernel (a power of two: the block reductions halve it).
pub const THREADS: u32 = 256;

/// Entries of the `kiln_dims` struct every kernel takes by value (the longest dims array
/// is a region's: `1 + 4 + 8·4 + 2 = 39`).
pub const MAX_DIMS: usize = 48;

/// An indenting line writer.
#[derive(Default)]
pub struct W {
    s: String,
    depth: usize,
}

impl W {
    pub fn new() -> W {
        W::default()
    }

    /// One line at the current depth.
    pub fn l(&mut self, line: impl AsRef<str>) {
        for _ in 0..self.depth {
            self.s.push_str("    ");
        }
        self.s.push_str(line.as_ref());
        self.s.push('\n');
    }

    /// `line {` and one level deeper.
    pub fn open(&mut self, line: impl AsRef<str>) {
        self.l(format!("{} {{", line.as_ref()));
        self.depth += 1;
    }

    /// One level shallower and `}`.
    pub fn close(&mut self) {
        self.depth -= 1;
        self.l("}");
    }

    pub fn finish(self) -> String {
        assert_eq!(self.depth, 0, "unbalanced CUDA text");
        self.s
    }
}

/// An exact `f32` constant: a small integer as `2.0f`, anything else (fractions, huge
/// values, `-0.0`, infinities, NaN) as its bits.
pub fn f32_lit(v: f32) -> String {
    if v.is_finite()
        && v == v.trunc()
        && v.abs() < 16_777_216.0
        && !(v == 0.0 && v.is_sign_negative())
    {
        format!("{}.0f", v as i64)
    } else {
        format!("__int_as_float(0x{:08x})", v.to_bits())
    }
}

/// An exact `i32` constant (`i32::MIN` has no literal of its own).
pub fn i32_lit(v: i32) -> String {
    if v == i32::MIN {
        "(-2147483647 - 1)".to_string()
    } else {
        format!("{v}")
    }
}

/// Elements a kernel moves as one group of 16-byte vectors (`kiln_v16`): 32 bytes of f32,
/// 16 of bf16.
pub const GROUP: usize = 8;

/// The element type a kernel loads and stores its float activations as (parameters,
/// scalars and statistics stay `float`). Arithmetic is always in `float`: a load widens,
/// a store rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Elem {
    F32,
    /// bfloat16 (`kiln_bf16`, the upper half of an `f32`): widening is exact, narrowing
    /// rounds to nearest, ties to even, NaN stays NaN — the `half` crate's `bf16`
    /// conversions, bit for bit (the prelude's `kiln_bf16_to_f32`/`kiln_f32_to_bf16`).
    Bf16,
}

impl Elem {
    /// The C type of a buffer element.
    pub fn c_type(self) -> &'static str {
        match self {
            Elem::F32 => "float",
            Elem::Bf16 => "kiln_bf16",
        }
    }

    /// The C type of a pointer to a buffer (`const` for an operand).
    pub fn ptr(self, konst: bool) -> String {
        if konst {
            format!("const {}*", self.c_type())
        } else {
            format!("{}*", self.c_type())
        }
    }

    /// The vector type of four elements: `kiln_v16` (four words) or `kiln_v8` (four
    /// bf16), each loaded or stored as one access.
    pub fn quad(self) -> &'static str {
        match self {
            Elem::F32 => "kiln_v16",
            Elem::Bf16 => "kiln_v8",
        }
    }

    /// Element `u` of the [`Elem::quad`] vector `q`, as a `float` (a bf16 element 2k is
    /// the low half of word k).
    pub fn quad_lane(self, q: &str, u: &str) -> String {
        match self {
            Elem::F32 => format!("__int_as_float((int){q}.w[{u}])"),
            Elem::Bf16 => {
                format!("kiln_bf16_to_f32((kiln_bf16)({q}.w[{u} >> 1] >> (16 * ({u} & 1))))")
            }
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Bf16 => 2,
        }
    }

    /// `expr` (an element read from memory) as a `float`.
    pub fn load(self, expr: &str) -> String {
        match self {
            Elem::F32 => expr.to_string(),
            Elem::Bf16 => format!("kiln_bf16_to_f32({expr})"),
        }
    }

    /// `kiln_v16` vectors in a group of [`GROUP`] elements (f32 2, bf16 1): kernels that
    /// move whole groups do the same arithmetic in the same order for both types.
    pub fn v16_per_group(self) -> usize {
        GROUP * self.bytes() / 16
    }

    /// Element `u` (a C expression below [`GROUP`]) of the group held in `q` (an array of
    /// [`Elem::v16_per_group`] `kiln_v16`), as a `float`.
    pub fn group_load(self, q: &str, u: &str) -> String {
        match self {
            Elem::F32 => format!("__int_as_float((int){q}[({u}) >> 2].w[({u}) & 3])"),
            Elem::Bf16 => format!(
                "kiln_bf16_to_f32((kiln_bf16)((({u}) & 1) ? ({q}[0].w[({u}) >> 1] >> 16) : ({q}[0].w[({u}) >> 1] & 0xffffu)))"
            ),
        }
    }

    /// A statement putting the `float` `value` as element `u` of the group `o` (for bf16 an
    /// even `u` sets its word, so the elements must go in order).
    pub fn group_store(self, o: &str, u: &str, value: &str) -> String {
        match self {
            Elem::F32 => {
                format!("{o}[({u}) >> 2].w[({u}) & 3] = (unsigned)__float_as_int({value});")
            }
            Elem::Bf16 => format!(
                "{{ const unsigned hb = (unsigned)kiln_f32_to_bf16({value}); if (({u}) & 1) {o}[0].w[({u}) >> 1] |= hb << 16; else {o}[0].w[({u}) >> 1] = hb; }}"
            ),
        }
    }

    /// A `float` value as the element to store.
    pub fn store(self, value: &str) -> String {
        match self {
            Elem::F32 => value.to_string(),
            Elem::Bf16 => format!("kiln_f32_to_bf16({value})"),
        }
    }
}

/// The text shared by every kernel: the dims struct, NaN-exact `max`/`relu`, saturating
/// casts, wrapping integer arithmetic, the block reductions and Philox. Compiled once
/// ahead of the kernels of a program (see [`crate::codegen::cuda::CudaCode::source`]).
pub fn prelude() -> String {
    let mut w = W::new();
    w.l("// kiln CUDA prelude: shared by every generated kernel.");
    w.l(format!("#define KILN_MAX_DIMS {MAX_DIMS}"));
    w.l(format!("#define KILN_THREADS {THREADS}"));
    w.l("// Sizes and strides (element counts), passed by value.");
    w.l("typedef struct { long long d[KILN_MAX_DIMS]; } kiln_dims;");
    w.l("");
    scalar_helpers(&mut w);
    w.l("");
    block_reductions(&mut w);
    w.l("");
    mma(&mut w);
    w.l("");
    philox::write(&mut w);
    w.finish()
}

/// The prelude's scalar helpers: NaN-exact `max` and `relu`, the saturating f32 → i32
/// cast, bf16 storage and its conversions, the vector types, and wrapping i32 arithmetic.
fn scalar_helpers(w: &mut W) {
    w.l("// max as the reference reduces: a NaN `a` wins, then the larger, ties keep `a`.");
    w.open("__device__ __forceinline__ float kiln_max_ref(float a, float b)");
    w.l("return (a >= b || a != a) ? a : b;");
    w.close();
    w.l("// The elementwise max of the reference: a NaN `a` wins, then a NaN or larger `b`.");
    w.open("__device__ __forceinline__ float kiln_max_bin(float a, float b)");
    w.l("return (b != b || b > a) ? b : a;");
    w.close();
    w.l("// relu: x if x > 0 or NaN, else +0.");
    w.open("__device__ __forceinline__ float kiln_relu(float x)");
    w.l("return x <= 0.0f ? 0.0f : x;");
    w.close();
    w.l("// f32 -> i32: truncate, saturate, NaN -> 0.");
    w.open("__device__ __forceinline__ int kiln_f2i(float x)");
    w.l("if (x != x) return 0;");
    w.l(format!(
        "if (x >= {}) return 2147483647;",
        f32_lit(2_147_483_648.0)
    ));
    w.l(format!(
        "if (x < {}) return {};",
        f32_lit(-2_147_483_648.0),
        i32_lit(i32::MIN)
    ));
    w.l("return (int)x;");
    w.close();
    w.l("// bf16 storage: the upper 16 bits of an f32. Widening is exact; narrowing rounds to");
    w.l("// nearest, ties to even (overflow gives inf), and keeps NaN a quiet NaN.");
    w.l("typedef unsigned short kiln_bf16;");
    w.open("__device__ __forceinline__ float kiln_bf16_to_f32(kiln_bf16 h)");
    w.l("return __int_as_float((int)((unsigned)h << 16));");
    w.close();
    w.open("__device__ __forceinline__ kiln_bf16 kiln_f32_to_bf16(float f)");
    w.l("const unsigned x = (unsigned)__float_as_int(f);");
    w.l("if ((x & 0x7fffffffu) > 0x7f800000u) return (kiln_bf16)((x >> 16) | 0x40u);");
    w.l("return (kiln_bf16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);");
    w.close();
    w.l("// Sixteen bytes as one load or store: four words, eight bf16 (element 2k the low half");
    w.l("// of word k) or four floats.");
    w.l("struct alignas(16) kiln_v16 { unsigned w[4]; };");
    w.l("// Eight bytes: four bf16 (element 2k the low half of word k).");
    w.l("struct alignas(8) kiln_v8 { unsigned w[2]; };");
    w.l("// Before a loop over a vector's elements: unrolled on the device, so that the");
    w.l("// vectors' words are registers (an index the compiler cannot resolve puts them in");
    w.l("// local memory).");
    w.l("#if defined(__CUDACC_RTC__) || defined(__CUDA_ARCH__)");
    w.l("#define KILN_UNROLL _Pragma(\"unroll\")");
    w.l("#else");
    w.l("#define KILN_UNROLL");
    w.l("#endif");
    w.l("// Wrapping i32 arithmetic.");
    for (name, op) in [("add", "+"), ("sub", "-"), ("mul", "*")] {
        w.open(format!(
            "__device__ __forceinline__ int kiln_wrap_{name}(int a, int b)"
        ));
        w.l(format!("return (int)((unsigned)a {op} (unsigned)b);"));
        w.close();
    }
}

/// The prelude's block reductions: sums, maxima, an online softmax's (max, sum) pairs and
/// four sums at once, each in a fixed order.
fn block_reductions(w: &mut W) {
    w.l("// Block reductions over blockDim.x partials (a power of two, at most KILN_THREADS),");
    w.l("// called by every thread of the block: a butterfly of shuffles in each warp, whose");
    w.l("// lane 0 holds the warp's tree (lane l with lane l + s at each step), then the warps'");
    w.l("// results in warp order. The order is fixed for a block size, so the result does");
    w.l("// not depend on scheduling. Every thread gets the result; `sh` holds 4 floats a warp.");
    w.open("__device__ __forceinline__ unsigned kiln_lanes()");
    w.l("return blockDim.x >= 32u ? 0xffffffffu : ((1u << blockDim.x) - 1u);");
    w.close();
    w.open("__device__ __forceinline__ unsigned kiln_width()");
    w.l("return blockDim.x >= 32u ? 32u : blockDim.x;");
    w.close();
    for (name, combine) in [("sum", "a + b"), ("max", "kiln_max_ref(a, b)")] {
        w.open(format!(
            "__device__ __forceinline__ float kiln_combine_{name}(float a, float b)"
        ));
        w.l(format!("return {combine};"));
        w.close();
        w.open(format!("__device__ float kiln_warp_{name}(float v)"));
        w.open("for (unsigned s = kiln_width() >> 1; s > 0; s >>= 1)");
        w.l(format!(
            "v = kiln_combine_{name}(v, __shfl_xor_sync(kiln_lanes(), v, (int)s));"
        ));
        w.close();
        w.l("return v;");
        w.close();
        w.open(format!(
            "__device__ float kiln_block_{name}(float v, float* sh)"
        ));
        w.l("const unsigned t = threadIdx.x;");
        w.l(format!("v = kiln_warp_{name}(v);"));
        w.l("if ((t & 31u) == 0) sh[t >> 5] = v;");
        w.l("__syncthreads();");
        w.l("float r = sh[0];");
        w.l(format!(
            "for (unsigned k = 1; k < ((blockDim.x + 31u) >> 5); ++k) r = kiln_combine_{name}(r, sh[k]);"
        ));
        w.l("__syncthreads();");
        w.l("return r;");
        w.close();
    }
    w.l("// z·exp(m − mn): a running sum of exp(x − m) moved to the larger max mn (0 while m");
    w.l("// is −inf: nothing summed yet).");
    w.open("__device__ __forceinline__ float kiln_scaled(float z, float m, float mn)");
    w.l(format!(
        "return m == {} ? 0.0f : z * expf(m - mn);",
        f32_lit(f32::NEG_INFINITY)
    ));
    w.close();
    w.l("// The block's (max, Σexp(x − max)) from each thread's pair (an online softmax's");
    w.l("// partials), combined as the sums above: every thread gets both.");
    w.open("__device__ void kiln_block_max_sum(float* m, float* z, float* sh)");
    w.l("const unsigned t = threadIdx.x;");
    w.l("float a = *m, b = *z;");
    w.open("for (unsigned s = kiln_width() >> 1; s > 0; s >>= 1)");
    w.l("const float a2 = __shfl_xor_sync(kiln_lanes(), a, (int)s);");
    w.l("const float b2 = __shfl_xor_sync(kiln_lanes(), b, (int)s);");
    w.l("const float mn = kiln_max_ref(a, a2);");
    w.l("b = kiln_scaled(b, a, mn) + kiln_scaled(b2, a2, mn);");
    w.l("a = mn;");
    w.close();
    w.open("if ((t & 31u) == 0)");
    w.l("sh[(t >> 5) * 2] = a;");
    w.l("sh[(t >> 5) * 2 + 1] = b;");
    w.close();
    w.l("__syncthreads();");
    w.l("a = sh[0];");
    w.l("b = sh[1];");
    w.open("for (unsigned k = 1; k < ((blockDim.x + 31u) >> 5); ++k)");
    w.l("const float mn = kiln_max_ref(a, sh[2 * k]);");
    w.l("b = kiln_scaled(b, a, mn) + kiln_scaled(sh[2 * k + 1], sh[2 * k], mn);");
    w.l("a = mn;");
    w.close();
    w.l("__syncthreads();");
    w.l("*m = a;");
    w.l("*z = b;");
    w.close();
    w.l("// Four sums at once (one pair of barriers): v[0..4] replaced by their block sums.");
    w.open("__device__ void kiln_block_sum4(float* v, float* sh)");
    w.l("const unsigned t = threadIdx.x;");
    w.open("for (int q = 0; q < 4; ++q)");
    w.l("const float s = kiln_warp_sum(v[q]);");
    w.l("if ((t & 31u) == 0) sh[(t >> 5) * 4 + q] = s;");
    w.close();
    w.l("__syncthreads();");
    w.open("for (int q = 0; q < 4; ++q)");
    w.l("float r = sh[q];");
    w.l("for (unsigned k = 1; k < ((blockDim.x + 31u) >> 5); ++k) r = r + sh[k * 4 + q];");
    w.l("v[q] = r;");
    w.close();
    w.l("__syncthreads();");
    w.close();
}

/// `kiln_mma`: one tensor-core tile, `c += a·b` with `a` 16×16 and `b` 16×8 in bf16 and
/// `c` 16×8 in f32, each operand spread over the 32 lanes of a warp as PTX's
/// `mma.m16n8k16` spreads it (every lane of the warp calls it, with `blockDim.x` a
/// multiple of 32). On sm_80 and later it is that instruction; under the host shim
/// (`KILN_HOST_MMA`) the shim's exchange through shared slots; on older GPUs the same
/// sums through warp shuffles.
fn mma(w: &mut W) {
    w.l("// Tensor cores: c += a·b for one m16n8k16 tile (bf16 operands, f32 accumulators),");
    w.l("// in the fragment layout of PTX's mma.m16n8k16. Lane 4g + t holds, two bf16 a word");
    w.l("// with the lower index in the low half:");
    w.l("//   a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9];");
    w.l("//   b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g];");
    w.l("//   c[0] = C[g][2t], c[1] = C[g][2t+1], c[2] = C[g+8][2t], c[3] = C[g+8][2t+1].");
    w.l("// Every lane of the warp calls it.");
    w.open("__device__ __forceinline__ float kiln_bf16_lo(unsigned x)");
    w.l("return __int_as_float((int)(x << 16));");
    w.close();
    w.open("__device__ __forceinline__ float kiln_bf16_hi(unsigned x)");
    w.l("return __int_as_float((int)(x & 0xffff0000u));");
    w.close();
    w.l("// Two bf16 of one column of a matrix stored as rows of bf16 pairs: element `hi` of the");
    w.l("// pair `x` (row k) in the low half, the same of `y` (row k + 1) in the high half.");
    w.open("__device__ __forceinline__ unsigned kiln_pair_col(unsigned x, unsigned y, int hi)");
    w.l("return hi ? ((x >> 16) | (y & 0xffff0000u)) : ((x & 0xffffu) | (y << 16));");
    w.close();
    w.open("__device__ __forceinline__ void kiln_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1)");
    w.l("#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800");
    w.l("asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\"");
    w.l("    : \"+f\"(c[0]), \"+f\"(c[1]), \"+f\"(c[2]), \"+f\"(c[3])");
    w.l("    : \"r\"(a0), \"r\"(a1), \"r\"(a2), \"r\"(a3), \"r\"(b0), \"r\"(b1));");
    w.l("#elif defined(KILN_HOST_MMA)");
    w.l("kiln_host_mma(c, a0, a1, a2, a3, b0, b1);");
    w.l("#else");
    w.l("// Lane 4g + t gathers row g's (and g + 8's) words of a from lanes 4g + u and");
    w.l("// columns 2t's and 2t + 1's words of b from lanes 8t + u and 8t + 4 + u.");
    w.l("const int lane = (int)(threadIdx.x & 31u), g = lane >> 2, t = lane & 3;");
    w.open("for (int u = 0; u < 4; ++u)");
    w.l("const unsigned x0 = __shfl_sync(0xffffffffu, a0, 4 * g + u), x1 = __shfl_sync(0xffffffffu, a1, 4 * g + u);");
    w.l("const unsigned x2 = __shfl_sync(0xffffffffu, a2, 4 * g + u), x3 = __shfl_sync(0xffffffffu, a3, 4 * g + u);");
    w.l("const unsigned y0 = __shfl_sync(0xffffffffu, b0, 8 * t + u), y1 = __shfl_sync(0xffffffffu, b1, 8 * t + u);");
    w.l("const unsigned z0 = __shfl_sync(0xffffffffu, b0, 8 * t + 4 + u), z1 = __shfl_sync(0xffffffffu, b1, 8 * t + 4 + u);");
    w.l("c[0] = c[0] + kiln_bf16_lo(x0) * kiln_bf16_lo(y0) + kiln_bf16_hi(x0) * kiln_bf16_hi(y0) + kiln_bf16_lo(x2) * kiln_bf16_lo(y1) + kiln_bf16_hi(x2) * kiln_bf16_hi(y1);");
    w.l("c[1] = c[1] + kiln_bf16_lo(x0) * kiln_bf16_lo(z0) + kiln_bf16_hi(x0) * kiln_bf16_hi(z0) + kiln_bf16_lo(x2) * kiln_bf16_lo(z1) + kiln_bf16_hi(x2) * kiln_bf16_hi(z1);");
    w.l("c[2] = c[2] + kiln_bf16_lo(x1) * kiln_bf16_lo(y0) + kiln_bf16_hi(x1) * kiln_bf16_hi(y0) + kiln_bf16_lo(x3) * kiln_bf16_lo(y1) + kiln_bf16_hi(x3) * kiln_bf16_hi(y1);");
    w.l("c[3] = c[3] + kiln_bf16_lo(x1) * kiln_bf16_lo(z0) + kiln_bf16_hi(x1) * kiln_bf16_hi(z0) + kiln_bf16_lo(x3) * kiln_bf16_lo(z1) + kiln_bf16_hi(x3) * kiln_bf16_hi(z1);");
    w.close();
    w.l("#endif");
    w.close();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_are_exact_and_never_nan_or_inf_words() {
        assert_eq!(f32_lit(0.0), "0.0f");
        assert_eq!(f32_lit(-3.0), "-3.0f");
        assert_eq!(f32_lit(-0.0), "__int_as_float(0x80000000)");
        assert_eq!(f32_lit(0.1), "__int_as_float(0x3dcccccd)");
        assert_eq!(f32_lit(f32::NAN), "__int_as_float(0x7fc00000)");
        assert_eq!(f32_lit(f32::NEG_INFINITY), "__int_as_float(0xff800000)");
        assert_eq!(f32_lit(-1e9), "__int_as_float(0xce6e6b28)");
        assert_eq!(i32_lit(i32::MIN), "(-2147483647 - 1)");
        assert_eq!(i32_lit(-5), "-5");
    }
}
