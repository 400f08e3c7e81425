//! Where each kernel value of one run lives: sources where the caller's tensors are,
//! kernel results in the arena or in an output's own storage, views over what they view,
//! and the copies that reshapes of non-contiguous views need.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_compiler::bind::Binder;
use kiln_compiler::ir::{DType, Op};
use kiln_compiler::optimize::kernels::Def;
use kiln_compiler::plan::ArenaLayout;
use kiln_compiler::reference::ExecError;
use kiln_compiler::tensor::{Tensor, TensorData};

use super::*;
use crate::eager::value::Layout;

/// Each value's locations, and the view copies the run makes. A reshape of a
/// non-contiguous view becomes a copy, made when first read (its source is computed by
/// then, and still alive: views extend liveness) and freed after its last reader.
pub(super) struct Placed {
    /// Per value, one location per result.
    pub locs: Vec<Vec<Loc>>,
    /// Per value, the copies it reads through.
    pub needs: Vec<Vec<usize>>,
    pub copies: Vec<ViewCopy>,
}

/// The storage one run places values in besides its arena.
pub(super) struct Storage<'s> {
    pub base: *mut u8,
    pub layout: &'s ArenaLayout,
    pub keep: &'s mut Keep,
    /// Recycled output storage, taken by length.
    pub spare: &'s mut Vec<Vec<f32>>,
    /// Per direct output, the storage its kernel writes in place.
    pub direct: &'s mut [Option<Vec<f32>>],
    /// Contiguous copies of transposed weights the run reads (kept alive by it).
    pub held: &'s mut Vec<Arc<Vec<f32>>>,
}

/// What the placement reads: the run's tensors and how they were bound.
pub(super) struct Sources<'a, 'g, 't> {
    pub inputs: &'a BTreeMap<String, Tensor>,
    /// Inputs read with their rows gathered (see [`Compiled::gathered_inputs`]).
    pub as_read: &'a BTreeMap<String, (Vec<usize>, DType)>,
    pub bind: &'a Binder<'g, 't>,
    pub params_version: Option<u64>,
}

impl Compiled {
    /// The error for kernel value `v`, named by its scope.
    pub(super) fn node_err(&self, v: usize, message: String) -> ExecError {
        ExecError::Node {
            node: format!("kernel value %{v} ({})", self.kg.values[v].scope),
            message,
        }
    }

    /// Every kernel value's locations, in value order.
    pub(super) fn place(
        &self,
        src: &Sources<'_, '_, '_>,
        store: &mut Storage<'_>,
    ) -> Result<Placed, ExecError> {
        let dims = &src.bind.dims;
        let n = self.kg.values.len();
        let mut placed = Placed {
            locs: Vec::with_capacity(n),
            needs: Vec::with_capacity(n),
            copies: Vec::new(),
        };
        // The copy whose buffer each value's location starts at.
        let mut origin: Vec<Option<usize>> = Vec::with_capacity(n);
        for (v, val) in self.kg.values.iter().enumerate() {
            let shapes: Vec<Vec<usize>> = val
                .types
                .iter()
                .map(|t| t.shape.eval(dims))
                .collect::<Result<_, _>>()
                .map_err(|m| self.node_err(v, m))?;
            let (loc, need, from) = match &val.def {
                // Read with rows gathered: the tensor as it is (its own shape), the rows
                // given to the concatenations that read it.
                Def::Input(name) if src.as_read.contains_key(name) => {
                    let t = &src.inputs[name];
                    let TensorData::F32(data) = &t.data else {
                        return Err(self.node_err(v, "internal: a gathered input not f32".into()));
                    };
                    let loc = Loc {
                        ptr: data.as_ptr() as *mut u8,
                        layout: Layout::contiguous(&t.shape),
                        dtype: DType::F32,
                    };
                    (vec![loc], Vec::new(), None)
                }
                Def::Input(name) => {
                    let id = self.graph.input(name).ok_or_else(|| {
                        self.node_err(v, format!("the graph has no input `{name}`"))
                    })?;
                    let bound = src.bind.input(id, name)?;
                    let loc = source_loc(bound, &shapes[0], store.keep);
                    (vec![loc], Vec::new(), None)
                }
                Def::Param(name) => {
                    let id = self.graph.param(name).ok_or_else(|| {
                        self.node_err(v, format!("the graph has no parameter `{name}`"))
                    })?;
                    let bound = src.bind.param(id, name, &shapes[0])?;
                    let loc = source_loc(bound, &shapes[0], store.keep);
                    (vec![loc], Vec::new(), None)
                }
                Def::Const(c, dtype) => {
                    let p = store.keep.alloc(1);
                    let bits = match dtype {
                        DType::I32 => c.get() as i32 as u32,
                        DType::Bool => (c.get() != 0.0) as u32,
                        _ => (c.get() as f32).to_bits(),
                    };
                    // SAFETY: `p` is a fresh one-element buffer.
                    unsafe { *(p as *mut u32) = bits };
                    let loc = Loc {
                        ptr: p,
                        layout: Layout::contiguous(&[]),
                        dtype: *dtype,
                    };
                    (vec![loc], Vec::new(), None)
                }
                Def::View(op, x) => {
                    let from = origin[*x];
                    let view = (op, *x, shapes[0].as_slice());
                    let (loc, need, from) =
                        self.place_view(v, view, from, &mut placed, store, src.params_version)?;
                    if let Some(c) = from {
                        placed.copies[c].users.push(v);
                    }
                    (vec![loc], need, from)
                }
                Def::Proj(t, k) => {
                    let loc = placed.locs[*t][*k as usize].clone();
                    (vec![loc], placed.needs[*t].clone(), None)
                }
                Def::Kernel { .. } => (self.kernel_locs(v, &shapes, store)?, Vec::new(), None),
            };
            placed.locs.push(loc);
            placed.needs.push(need);
            origin.push(from);
        }
        Ok(placed)
    }

    /// A view of value `x`: its location, the copies it reads through, and the copy its
    /// location starts at. A view that no layout can express (a reshape of a
    /// non-contiguous view) is a new copy, placed when it is made.
    fn place_view(
        &self,
        v: usize,
        (op, x, shape): (&Op, usize, &[usize]),
        from: Option<usize>,
        placed: &mut Placed,
        store: &mut Storage<'_>,
        params_version: Option<u64>,
    ) -> Result<(Loc, Vec<usize>, Option<usize>), ExecError> {
        let dtype = self.kg.values[v].types[0].dtype;
        let src = &placed.locs[x][0];
        let mut need = placed.needs[x].clone();
        let layout = match op {
            Op::Reshape { .. } => src.layout.reshape(shape),
            Op::Permute { perm } => Some(src.layout.permute(perm)),
            Op::Broadcast { .. } => Some(src.layout.broadcast(shape)),
            other => return Err(self.node_err(v, format!("`{}` is not a view", other.name()))),
        };
        let Some(layout) = layout else {
            placed.copies.push(ViewCopy {
                src: x,
                words: src.numel(),
                buf: None,
                users: Vec::new(),
            });
            let c = placed.copies.len() - 1;
            need.push(c);
            let loc = Loc {
                ptr: std::ptr::null_mut(),
                layout: Layout::contiguous(shape),
                dtype,
            };
            return Ok((loc, need, Some(c)));
        };
        let loc = Loc {
            ptr: src.ptr,
            layout,
            dtype,
        };
        match self.weight_copy(v, &loc, params_version) {
            Some(copy) => {
                let contiguous = Loc {
                    ptr: copy.as_ptr() as *mut u8,
                    layout: Layout::contiguous(shape),
                    dtype: DType::F32,
                };
                store.held.push(copy);
                Ok((contiguous, need, None))
            }
            None => Ok((loc, need, from)),
        }
    }

    /// A kernel's results: in its output's own storage where the memory plan writes an
    /// output in place, else in the arena.
    fn kernel_locs(
        &self,
        v: usize,
        shapes: &[Vec<usize>],
        store: &mut Storage<'_>,
    ) -> Result<Vec<Loc>, ExecError> {
        let val = &self.kg.values[v];
        (0..val.types.len())
            .map(|k| {
                let ptr = match self.home.get(&(v, k)) {
                    // The first result of an in-place chain places the storage; the
                    // later ones write over it.
                    Some(Home::Output(i)) => match &mut store.direct[*i] {
                        Some(own) => own.as_mut_ptr() as *mut u8,
                        slot => {
                            let n: usize = shapes[k].iter().product();
                            let mut own = take_storage(store.spare, n);
                            let ptr = own.as_mut_ptr() as *mut u8;
                            *slot = Some(own);
                            ptr
                        }
                    },
                    Some(Home::Arena(b)) => store.base.wrapping_add(store.layout.offsets[*b]),
                    None => {
                        return Err(
                            self.node_err(v, "internal: no buffer in the memory plan".into())
                        )
                    }
                };
                let layout = if self.merged.contains(&(v, k)) {
                    Layout::heads_merged(&shapes[k])
                } else {
                    Layout::contiguous(&shapes[k])
                };
                Ok(Loc {
                    ptr,
                    layout,
                    dtype: val.types[k].dtype,
                })
            })
            .collect()
    }
}
