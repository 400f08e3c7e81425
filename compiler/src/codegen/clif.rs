//! Building kernel functions in CLIF: the kernel ABI, loops, constants and vector helpers.
//!
//! Every CPU kernel function has one signature:
//!
//! ```text
//! function %name(i64 args, i64 dims, i64 begin, i64 end) system_v
//! ```
//!
//! - `args` points at an array of buffer base pointers (`*const *mut u8`), in the order
//!   the kernel kind documents (operands, then results);
//! - `dims` points at an array of `i64` sizes and strides (element counts), laid out as
//!   the kernel kind documents — dims are arguments, so one function serves every batch
//!   size and length;
//! - `[begin, end)` is the range of work items (rows, usually) this call computes. The
//!   runtime splits the items across threads with rayon; a call never depends on another.
//!
//! Vectors are `F32X4` (Cranelift emits 128-bit vectors on x86-64); loops are written
//! explicitly: a main loop unrolled over several vectors, a single-vector loop, a scalar
//! tail. [`Kb`] wraps a `FunctionBuilder` with the steps every kernel needs.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{
    types, AbiParam, BlockArg, Function, InstBuilder, MemFlagsData, Signature, StackSlotData,
    StackSlotKind, Type, UserFuncName, Value,
};
use cranelift_codegen::isa::{CallConv, TargetFrontendConfig};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use target_lexicon::PointerWidth;

/// Lanes of an `F32X4`.
pub const LANES: i64 = 4;
/// Vectors per iteration of an unrolled main loop.
pub const UNROLL: i64 = 4;

/// The vector type of every kernel.
pub const VF: Type = types::F32X4;
/// Its integer twin (bools are `i32` 0/1 in buffers, lane masks in registers).
pub const VI: Type = types::I32X4;

/// The signature of every kernel function (see the module documentation).
pub fn kernel_signature() -> Signature {
    let mut sig = Signature::new(CallConv::SystemV);
    for _ in 0..4 {
        sig.params.push(AbiParam::new(types::I64));
    }
    sig
}

/// The frontend configuration kernels are built for: 64-bit pointers, System V.
pub fn frontend_config() -> TargetFrontendConfig {
    TargetFrontendConfig {
        default_call_conv: CallConv::SystemV,
        pointer_width: PointerWidth::U64,
        page_size_align_log2: 12,
    }
}

/// Memory flags of kernel loads and stores: buffers never alias in a way that matters to
/// one access, are aligned to their element, and never trap (the runtime sizes them).
pub fn mem() -> MemFlagsData {
    // Not `aligned`: vector accesses start at any element.
    MemFlagsData::new()
        .with_notrap()
        .with_endianness(cranelift_codegen::ir::Endianness::Little)
}

/// Memory flags of a `bitcast` (lane order: little-endian).
pub fn lanes() -> MemFlagsData {
    MemFlagsData::new().with_endianness(cranelift_codegen::ir::Endianness::Little)
}

/// Builds one kernel function: `body` receives the builder positioned in the entry block
/// with the four ABI arguments bound, and must leave the current block unterminated; the
/// function returns after it.
pub fn build_kernel(name: &str, body: impl FnOnce(&mut Kb)) -> Function {
    let mut func = Function::with_name_signature(UserFuncName::testcase(name), kernel_signature());
    let mut fctx = FunctionBuilderContext::new();
    {
        let mut b = FunctionBuilder::new(&mut func, &mut fctx);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let p = b.block_params(entry).to_vec();
        let mut kb = Kb {
            b,
            args: p[0],
            dims: p[1],
            begin: p[2],
            end: p[3],
        };
        body(&mut kb);
        kb.b.ins().return_(&[]);
        kb.b.seal_all_blocks();
        kb.b.finalize(frontend_config());
    }
    func
}

/// The CLIF text of a function (what the artifact stores and the JIT parses back).
pub fn text(func: &Function) -> String {
    func.display().to_string()
}

/// A kernel under construction.
pub struct Kb<'a> {
    pub b: FunctionBuilder<'a>,
    /// `*const *mut u8`: buffer pointers.
    pub args: Value,
    /// `*const i64`: sizes and strides.
    pub dims: Value,
    pub begin: Value,
    pub end: Value,
}

impl Kb<'_> {
    /// Buffer pointer `i` of the `args` array.
    pub fn ptr(&mut self, i: usize) -> Value {
        self.b
            .ins()
            .load(types::I64, mem(), self.args, (8 * i) as i32)
    }

    /// Size `i` of the `dims` array.
    pub fn dim(&mut self, i: usize) -> Value {
        self.b
            .ins()
            .load(types::I64, mem(), self.dims, (8 * i) as i32)
    }

    pub fn iconst(&mut self, v: i64) -> Value {
        self.b.ins().iconst(types::I64, v)
    }

    /// An `f32` constant of type `ty` (`F32` or `F32X4`, splatted).
    pub fn fconst(&mut self, ty: Type, v: f32) -> Value {
        let s = self.b.ins().f32const(v);
        if ty.is_vector() {
            self.b.ins().splat(ty, s)
        } else {
            s
        }
    }

    /// An `i32` constant of type `ty` (`I32` or `I32X4`, splatted).
    pub fn i32const(&mut self, ty: Type, v: i32) -> Value {
        let s = self.b.ins().iconst(types::I32, v as i64);
        if ty.is_vector() {
            self.b.ins().splat(ty, s)
        } else {
            s
        }
    }

    /// `base + 4·index` (the address of element `index` of a 4-byte buffer).
    pub fn elem_addr(&mut self, base: Value, index: Value) -> Value {
        let off = self.b.ins().ishl_imm_u(index, 2);
        self.b.ins().iadd(base, off)
    }

    /// Loads a value of `ty` (`F32`, `F32X4`, `I32`, `I32X4`) at element `index`.
    pub fn load(&mut self, ty: Type, base: Value, index: Value) -> Value {
        let a = self.elem_addr(base, index);
        self.b.ins().load(ty, mem(), a, 0)
    }

    /// Loads the `f32` at element `index` and splats it to `ty`.
    pub fn load_splat(&mut self, ty: Type, base: Value, index: Value) -> Value {
        let s = self.load(types::F32, base, index);
        if ty.is_vector() {
            self.b.ins().splat(ty, s)
        } else {
            s
        }
    }

    /// Stores `v` at element `index`.
    pub fn store(&mut self, v: Value, base: Value, index: Value) {
        let a = self.elem_addr(base, index);
        self.b.ins().store(mem(), v, a, 0);
    }

    /// A counted loop: `i = lo, lo+step, …` while `i + step <= hi`, threading `carry`
    /// through `body` (which returns the new carried values, same types). Returns the
    /// first `i` not processed and the final carried values.
    pub fn for_range(
        &mut self,
        lo: Value,
        hi: Value,
        step: i64,
        carry: &[Value],
        mut body: impl FnMut(&mut Kb, Value, &[Value]) -> Vec<Value>,
    ) -> (Value, Vec<Value>) {
        let header = self.b.create_block();
        let body_block = self.b.create_block();
        let exit = self.b.create_block();
        self.b.append_block_param(header, types::I64);
        self.b.append_block_param(exit, types::I64);
        for &c in carry {
            let ty = self.b.func.dfg.value_type(c);
            self.b.append_block_param(header, ty);
            self.b.append_block_param(exit, ty);
        }
        let mut args: Vec<BlockArg> = vec![BlockArg::from(lo)];
        args.extend(carry.iter().map(|&c| BlockArg::from(c)));
        self.b.ins().jump(header, &args);

        self.b.switch_to_block(header);
        let hp = self.b.block_params(header).to_vec();
        let i = hp[0];
        let next = self.b.ins().iadd_imm_s(i, step);
        let go = self.b.ins().icmp(IntCC::SignedLessThanOrEqual, next, hi);
        let exit_args: Vec<BlockArg> = hp.iter().map(|&v| BlockArg::from(v)).collect();
        self.b.ins().brif(go, body_block, &[], exit, &exit_args);

        self.b.switch_to_block(body_block);
        let new = body(self, i, &hp[1..]);
        assert_eq!(
            new.len(),
            carry.len(),
            "a loop body returns one value per carry"
        );
        let next = self.b.ins().iadd_imm_s(i, step);
        let mut back: Vec<BlockArg> = vec![BlockArg::from(next)];
        back.extend(new.iter().map(|&c| BlockArg::from(c)));
        self.b.ins().jump(header, &back);

        self.b.switch_to_block(exit);
        let ep = self.b.block_params(exit).to_vec();
        (ep[0], ep[1..].to_vec())
    }

    /// Runs `body(index, ty)` over elements `[lo, hi)`: `UNROLL` vectors per iteration,
    /// then one vector, then scalars (`ty` is `F32X4` or `F32`). For maps without a carry.
    pub fn map_elems(&mut self, lo: Value, hi: Value, mut body: impl FnMut(&mut Kb, Value, Type)) {
        self.map_elems_unrolled(lo, hi, |kb, i, ty, _| body(kb, i, ty));
    }

    /// [`Kb::map_elems`], telling `body` which of the `UNROLL` vectors of the main loop's
    /// iteration it emits (`Some(u)`, in order `0..UNROLL`, all in one block sequence so
    /// values of `u = 0` are usable by the rest) or that it is in a tail (`None`).
    pub fn map_elems_unrolled(
        &mut self,
        lo: Value,
        hi: Value,
        mut body: impl FnMut(&mut Kb, Value, Type, Option<usize>),
    ) {
        let (i, _) = self.for_range(lo, hi, LANES * UNROLL, &[], |kb, i, _| {
            for u in 0..UNROLL {
                let j = kb.b.ins().iadd_imm_s(i, u * LANES);
                body(kb, j, VF, Some(u as usize));
            }
            vec![]
        });
        let (i, _) = self.for_range(i, hi, LANES, &[], |kb, i, _| {
            body(kb, i, VF, None);
            vec![]
        });
        self.for_range(i, hi, 1, &[], |kb, i, _| {
            body(kb, i, types::F32, None);
            vec![]
        });
    }

    /// A reduction over elements `[lo, hi)`: `term(index, ty)` gives a vector (or a
    /// scalar in the tail) combined by `op` into `UNROLL` vector accumulators, which are
    /// combined pairwise, then across lanes, then with the scalar tail. `init` is the
    /// identity of `op`.
    pub fn reduce_elems(
        &mut self,
        lo: Value,
        hi: Value,
        init: f32,
        op: Reduce,
        mut term: impl FnMut(&mut Kb, Value, Type) -> Value,
    ) -> Value {
        let z = self.fconst(VF, init);
        let accs = vec![z; UNROLL as usize];
        let (i, accs) = self.for_range(lo, hi, LANES * UNROLL, &accs, |kb, i, acc| {
            (0..UNROLL)
                .map(|u| {
                    let j = kb.b.ins().iadd_imm_s(i, u * LANES);
                    let t = term(kb, j, VF);
                    kb.combine(op, acc[u as usize], t)
                })
                .collect()
        });
        let a01 = self.combine(op, accs[0], accs[1]);
        let a23 = self.combine(op, accs[2], accs[3]);
        let acc = self.combine(op, a01, a23);
        let (i, acc) = self.for_range(i, hi, LANES, &[acc], |kb, i, acc| {
            let t = term(kb, i, VF);
            vec![kb.combine(op, acc[0], t)]
        });
        let s = self.horizontal(op, acc[0]);
        let (_, s) = self.for_range(i, hi, 1, &[s], |kb, i, acc| {
            let t = term(kb, i, types::F32);
            vec![kb.combine(op, acc[0], t)]
        });
        s[0]
    }

    /// The sum of `term` over elements `[lo, hi)` in an order fixed by each element's
    /// index alone: element `i` goes to lane `i % LANES` of accumulator
    /// `(i / LANES) % UNROLL`, in increasing `i`, the last partial group of
    /// `LANES · UNROLL` through a zero-filled stack buffer; then the accumulators pairwise
    /// and the lanes. So terms after `hi` that are exactly zero (the masked keys of a
    /// padded row) do not change a bit of the sum: a sentence's attention is the same
    /// alone and in a padded batch. `term` is called once per element, vector or scalar.
    pub fn sum_elems_padded(
        &mut self,
        lo: Value,
        hi: Value,
        mut term: impl FnMut(&mut Kb, Value, Type) -> Value,
    ) -> Value {
        let group = LANES * UNROLL;
        let z = self.fconst(VF, 0.0);
        let accs = vec![z; UNROLL as usize];
        let (i, mut accs) = self.for_range(lo, hi, group, &accs, |kb, i, acc| {
            (0..UNROLL)
                .map(|u| {
                    let j = kb.b.ins().iadd_imm_s(i, u * LANES);
                    let t = term(kb, j, VF);
                    kb.b.ins().fadd(acc[u as usize], t)
                })
                .collect()
        });
        let slot = self.b.create_sized_stack_slot(StackSlotData::new(
            StackSlotKind::ExplicitSlot,
            4 * group as u32,
            4,
        ));
        let buf = self.b.ins().stack_addr(types::I64, slot, 0);
        let zero = self.fconst(VF, 0.0);
        for u in 0..UNROLL {
            let at = self.iconst(u * LANES);
            self.store(zero, buf, at);
        }
        self.for_range(i, hi, 1, &[], |kb, j, _| {
            let t = term(kb, j, types::F32);
            let at = kb.b.ins().isub(j, i);
            kb.store(t, buf, at);
            vec![]
        });
        for (u, acc) in accs.iter_mut().enumerate() {
            let at = self.iconst(u as i64 * LANES);
            let t = self.load(VF, buf, at);
            *acc = self.b.ins().fadd(*acc, t);
        }
        let a01 = self.b.ins().fadd(accs[0], accs[1]);
        let a23 = self.b.ins().fadd(accs[2], accs[3]);
        let acc = self.b.ins().fadd(a01, a23);
        self.horizontal(Reduce::Sum, acc)
    }

    /// `a op b` for a reduction operator.
    pub fn combine(&mut self, op: Reduce, a: Value, b: Value) -> Value {
        match op {
            Reduce::Sum => self.b.ins().fadd(a, b),
            Reduce::Max => self.fmax(a, b),
        }
    }

    /// The lanes of `v` combined by `op` (`((l0 op l1) op (l2 op l3))`).
    pub fn horizontal(&mut self, op: Reduce, v: Value) -> Value {
        let l: Vec<Value> = (0..4)
            .map(|k| self.b.ins().extractlane(v, k as u8))
            .collect();
        let a = self.combine(op, l[0], l[1]);
        let c = self.combine(op, l[2], l[3]);
        self.combine(op, a, c)
    }

    /// `max(a, b)` as the reference computes it (`a.max(b)`: a NaN operand yields the
    /// other); on equal values either.
    pub fn fmax(&mut self, a: Value, b: Value) -> Value {
        // fmax_pseudo(a, b) = b > a ? b : a … we want NaN-ignoring like f32::max.
        let gt = self.b.ins().fcmp(FloatCC::GreaterThan, b, a);
        let a_nan = self.b.ins().fcmp(FloatCC::Unordered, a, a);
        let pick_b = self.b.ins().bor(gt, a_nan);
        self.select(pick_b, b, a)
    }

    /// `min(a, b)` (NaN-ignoring like `f32::min`).
    pub fn fmin(&mut self, a: Value, b: Value) -> Value {
        let lt = self.b.ins().fcmp(FloatCC::LessThan, b, a);
        let a_nan = self.b.ins().fcmp(FloatCC::Unordered, a, a);
        let pick_b = self.b.ins().bor(lt, a_nan);
        self.select(pick_b, b, a)
    }

    /// `c ? x : y` for a comparison result `c` of the same width (a lane mask for vectors,
    /// an `i8` for scalars).
    pub fn select(&mut self, c: Value, x: Value, y: Value) -> Value {
        let ty = self.b.func.dfg.value_type(x);
        if ty.is_vector() {
            let ct = self.b.func.dfg.value_type(c);
            let c = if ct == ty {
                c
            } else {
                self.b.ins().bitcast(ty, lanes(), c)
            };
            self.b.ins().bitselect(c, x, y)
        } else {
            self.b.ins().select(c, x, y)
        }
    }

    /// `x · y + z` with one rounding (FMA).
    pub fn fma(&mut self, x: Value, y: Value, z: Value) -> Value {
        self.b.ins().fma(x, y, z)
    }

    /// `e^x` (see [`crate::codegen::math`]).
    pub fn exp(&mut self, x: Value) -> Value {
        crate::codegen::math::exp(self, x)
    }

    /// `e^x` for `x ≤ 0`, as a softmax's `x − max x` (see
    /// [`crate::codegen::math::exp_nonpositive`]).
    pub fn exp_nonpositive(&mut self, x: Value) -> Value {
        crate::codegen::math::exp_nonpositive(self, x)
    }

    /// `ln x` (see [`crate::codegen::math`]).
    pub fn log(&mut self, x: Value) -> Value {
        crate::codegen::math::log(self, x)
    }

    /// The vector or scalar float type matching `x`'s integer type, and vice versa.
    pub fn ty(&self, v: Value) -> Type {
        self.b.func.dfg.value_type(v)
    }
}

/// A reduction operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Max,
}

/// The integer type with the lanes of a float type (`F32X4` → `I32X4`, `F32` → `I32`).
pub fn int_of(ty: Type) -> Type {
    if ty.is_vector() {
        VI
    } else {
        types::I32
    }
}
