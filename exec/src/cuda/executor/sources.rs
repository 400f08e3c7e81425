//! A run's sources on the device: inputs uploaded or already there (a resident decoder's
//! state), parameters uploaded once a version or trained in place, constants in stream
//! order.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_compiler::bind::{Binder, Source};
use kiln_compiler::ir::DType;
use kiln_compiler::optimize::kernels::Def;
use kiln_compiler::reference::ExecError;

use super::*;
use crate::eager::value::Layout;

/// What binding a run's sources reads.
pub(super) struct SourceCtx<'a, 'g, 't> {
    pub bind: &'a Binder<'g, 't>,
    pub dims: &'a BTreeMap<String, i64>,
    /// The locations kept for these dims, whose shapes the sources take.
    pub kept: Option<&'a Arc<Bound>>,
    pub resident: Option<&'a Resident<'a>>,
    pub training: Option<&'a Training>,
    pub device: &'a Device,
}

impl CudaExecutor {
    /// The error for kernel value `v`, named by its scope.
    pub(super) fn node_err(&self, v: usize, message: String) -> ExecError {
        ExecError::Node {
            node: format!("kernel value %{v} ({})", self.kg.values[v].scope),
            message,
        }
    }

    /// Every source's location into `locs`. Whether a parameter was uploaded (the bf16
    /// casts kept from an earlier run of the version are then stale).
    pub(super) fn bind_sources(
        &self,
        r: &mut Run<'_>,
        ctx: &SourceCtx<'_, '_, '_>,
        cache: &mut Option<ParamCache>,
        locs: &mut [Vec<DLoc>],
    ) -> Result<bool, ExecError> {
        let mut uploaded = false;
        for &(v, node) in &self.sources {
            let val = &self.kg.values[v];
            let shape = match ctx.kept {
                Some(b) => b.locs[v][0].layout.shape.clone(),
                None => val.types[0]
                    .shape
                    .eval(ctx.dims)
                    .map_err(|m| self.node_err(v, m))?,
            };
            let loc = match &val.def {
                Def::Input(name) => {
                    let id = node.ok_or_else(|| {
                        self.node_err(v, format!("the graph has no input `{name}`"))
                    })?;
                    match ctx.resident.and_then(|r| r.inputs.get(name.as_str())) {
                        Some(t) => self.resident_input(r, v, name, t, &shape)?,
                        None => {
                            let src = ctx.bind.input(id, name)?;
                            let bf16 = self.stored(v, 0) == DType::BF16;
                            r.source(src, &shape, bf16)
                                .map_err(|m| self.node_err(v, m))?
                        }
                    }
                }
                Def::Param(name) => {
                    let id = node.ok_or_else(|| {
                        self.node_err(v, format!("the graph has no parameter `{name}`"))
                    })?;
                    let src = ctx.bind.param(id, name, &shape)?;
                    let param = (v, name.as_str(), &shape[..]);
                    let loc = match ctx.training {
                        Some(t) => self.trained_param(param, t)?,
                        None => match cache.as_mut() {
                            None => r
                                .source(src, &shape, false)
                                .map_err(|m| self.node_err(v, m))?,
                            Some(c) => {
                                let (loc, fresh) = self.kept_param(param, src, c, ctx.device)?;
                                uploaded |= fresh;
                                loc
                            }
                        },
                    };
                    r.params.insert(loc.ptr);
                    loc
                }
                Def::Const(c, dtype) => {
                    let bits = match dtype {
                        DType::I32 => c.get() as i32 as u32,
                        DType::Bool => (c.get() != 0.0) as u32,
                        _ => (c.get() as f32).to_bits(),
                    };
                    // In stream order, without a wait (four bytes, staged by the driver).
                    let ptr = r
                        .upload_enqueued(&[bits])
                        .map_err(|m| self.node_err(v, m))?;
                    DLoc {
                        ptr,
                        layout: Layout::contiguous(&[]),
                        dtype: *dtype,
                    }
                }
                _ => {
                    return Err(
                        self.node_err(v, "internal: not an input, parameter or constant".into())
                    )
                }
            };
            locs[v] = vec![loc];
        }
        Ok(uploaded)
    }

    /// Input `name` (value `v`) where the device already holds it: checked against the
    /// shape and dtype the entry reads, an f32 tensor rounded where it reads bf16.
    fn resident_input(
        &self,
        r: &mut Run<'_>,
        v: usize,
        name: &str,
        t: &DeviceTensor,
        shape: &[usize],
    ) -> Result<DLoc, ExecError> {
        if t.shape != shape {
            return Err(self.node_err(
                v,
                format!(
                    "the device's `{name}` has shape {:?}, the entry needs {:?}",
                    t.shape, shape
                ),
            ));
        }
        let held = DLoc {
            ptr: t.buf.ptr,
            layout: Layout::contiguous(shape),
            dtype: t.dtype,
        };
        let want = self.stored(v, 0);
        if want == DType::BF16 && held.dtype == DType::F32 {
            // An f32 tensor (`to_device`) for a bf16 input: rounded here.
            r.rounded_to_bf16(&held).map_err(|m| self.node_err(v, m))
        } else if held.dtype != want {
            Err(self.node_err(
                v,
                format!(
                    "the device's `{name}` holds {:?}, the entry reads {want:?}",
                    held.dtype
                ),
            ))
        } else {
            Ok(held)
        }
    }

    /// A parameter of device training: the trained copy itself.
    fn trained_param(
        &self,
        (v, name, shape): (usize, &str, &[usize]),
        t: &Training,
    ) -> Result<DLoc, ExecError> {
        let tp = t.params.get(name).ok_or_else(|| {
            self.node_err(
                v,
                format!("parameter `{name}` is not among the trained ones"),
            )
        })?;
        if tp.shape != shape {
            return Err(self.node_err(
                v,
                format!(
                    "parameter `{name}` is trained with shape {:?}, the entry needs {:?}",
                    tp.shape, shape
                ),
            ));
        }
        Ok(DLoc {
            ptr: tp.p.ptr,
            layout: Layout::contiguous(shape),
            dtype: DType::F32,
        })
    }

    /// A parameter kept on the device for its version: uploaded where the cache has no
    /// copy of the same host slice. Its location, and whether it was uploaded.
    fn kept_param(
        &self,
        (v, name, shape): (usize, &str, &[usize]),
        src: Source<'_>,
        c: &mut ParamCache,
        device: &Device,
    ) -> Result<(DLoc, bool), ExecError> {
        let (words, dtype, key) = source_words(&src);
        let hit = c.bufs.get(name).is_some_and(|(k, _, _)| *k == key);
        if !hit {
            let b = device.upload(&words).map_err(|m| self.node_err(v, m))?;
            c.bufs.insert(name.to_string(), (key, dtype, b));
        }
        let (_, dtype, b) = &c.bufs[name];
        let loc = DLoc {
            ptr: b.ptr,
            layout: Layout::contiguous(shape),
            dtype: *dtype,
        };
        Ok((loc, !hit))
    }
}
