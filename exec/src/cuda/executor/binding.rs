//! Binding the views' and kernel results' locations at a run's dims, and each buffer's
//! stored element type.

use std::collections::BTreeMap;

use kiln_compiler::codegen::cuda::text::Elem;
use kiln_compiler::ir::{DType, Op};
use kiln_compiler::optimize::kernels::Def;
use kiln_compiler::reference::ExecError;

use super::*;
use crate::eager::value::Layout;

impl CudaExecutor {
    /// Binds the views and kernel results (every value but the sources, whose locations
    /// `locs` already holds) at dims `dims`, the arena at `base`.
    pub(super) fn bind_derived(
        &self,
        dims: &BTreeMap<String, i64>,
        base: u64,
        layout: &kiln_compiler::plan::ArenaLayout,
        locs: &mut [Vec<DLoc>],
    ) -> Result<Derived, ExecError> {
        let node_err = |v: usize, m: String| ExecError::Node {
            node: format!("kernel value %{v} ({})", self.kg.values[v].scope),
            message: m,
        };
        let n = self.kg.values.len();
        let mut d = Derived {
            needs: vec![Vec::new(); n],
            copies: Vec::new(),
            roots: vec![Root::Source; n],
        };
        // The copy whose buffer each value's location starts at.
        let mut origin: Vec<Option<usize>> = vec![None; n];
        for (v, val) in self.kg.values.iter().enumerate() {
            if matches!(val.def, Def::Input(_) | Def::Param(_) | Def::Const(..)) {
                continue;
            }
            let shapes: Vec<Vec<usize>> = val
                .types
                .iter()
                .map(|t| t.shape.eval(dims))
                .collect::<Result<_, _>>()
                .map_err(|m| node_err(v, m))?;
            let mut need = Vec::new();
            let mut from: Option<usize> = None;
            let (loc, root) = match &val.def {
                Def::View(op, x) => {
                    let src = locs[*x][0].clone();
                    need = d.needs[*x].clone();
                    from = origin[*x];
                    let layout = match op {
                        Op::Reshape { .. } => src.layout.reshape(&shapes[0]),
                        Op::Permute { perm } => Some(src.layout.permute(perm)),
                        Op::Broadcast { .. } => Some(src.layout.broadcast(&shapes[0])),
                        other => {
                            return Err(node_err(v, format!("`{}` is not a view", other.name())))
                        }
                    };
                    // A view of a bf16 buffer is bf16.
                    let dtype = if src.is_bf16() {
                        DType::BF16
                    } else {
                        val.types[0].dtype
                    };
                    let root = match d.roots[*x] {
                        Root::Source => Root::Of(*x),
                        r => r,
                    };
                    match layout {
                        Some(layout) => (
                            vec![DLoc {
                                ptr: src.ptr,
                                layout,
                                dtype,
                            }],
                            root,
                        ),
                        None => {
                            // Placed when it is made.
                            d.copies.push(CopyPlan {
                                src: *x,
                                words: words_of(dtype, src.numel()),
                                users: Vec::new(),
                            });
                            from = Some(d.copies.len() - 1);
                            need.push(d.copies.len() - 1);
                            (
                                vec![DLoc {
                                    ptr: 0,
                                    layout: Layout::contiguous(&shapes[0]),
                                    dtype,
                                }],
                                root,
                            )
                        }
                    }
                }
                Def::Proj(t, k) => {
                    need = d.needs[*t].clone();
                    let root = match d.roots[*t] {
                        Root::Source => Root::Of(*t),
                        r => r,
                    };
                    (vec![locs[*t][*k as usize].clone()], root)
                }
                Def::Kernel { .. } => (
                    (0..val.types.len())
                        .map(|k| {
                            let b = *self.buffer_at.get(&(v, k)).ok_or_else(|| {
                                node_err(v, "internal: no buffer in the memory plan".into())
                            })?;
                            Ok(DLoc {
                                ptr: base + layout.offsets[b] as u64,
                                layout: if self.merged.contains(&(v, k)) {
                                    Layout::heads_merged(&shapes[k])
                                } else {
                                    Layout::contiguous(&shapes[k])
                                },
                                dtype: self.stored(v, k),
                            })
                        })
                        .collect::<Result<_, ExecError>>()?,
                    Root::Arena,
                ),
                Def::Input(_) | Def::Param(_) | Def::Const(..) => unreachable!("skipped above"),
            };
            if let Some(c) = from {
                d.copies[c].users.push(v);
            }
            d.needs[v] = need;
            d.roots[v] = if from.is_some() { Root::Copy } else { root };
            origin[v] = from;
            locs[v] = loc;
        }
        Ok(d)
    }

    /// The device dtype of output `k` of kernel-graph value `v`: `BF16` where the
    /// mixed-precision plan keeps it in bf16 ([`CudaOptions::mixed`]), else its dtype.
    pub(super) fn stored(&self, v: usize, k: usize) -> DType {
        let dtype = self.kg.values[v].types[k].dtype;
        let bf16 = self
            .storage
            .as_ref()
            .and_then(|st| st.get(v))
            .and_then(|e| e.get(k))
            == Some(&Elem::Bf16);
        if bf16 && dtype == DType::F32 {
            DType::BF16
        } else {
            dtype
        }
    }
}
