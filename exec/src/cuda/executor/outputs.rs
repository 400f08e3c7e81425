//! A run's outputs: downloaded to the host, kept on the device (a resident decoder's
//! caches), or, in device training, each parameter's gradient added into its accumulator
//! by one launch, with the first gradient that is not finite found.

use std::collections::BTreeMap;

use kiln_compiler::codegen::cuda::optim;
use kiln_compiler::ir::DType;
use kiln_compiler::reference::ExecError;
use kiln_compiler::tensor::Tensor;

use super::*;

/// A run's outputs: on the host, kept on the device, and a gradient of device training
/// that is not finite.
pub(super) type Outputs = (
    Vec<(String, Tensor)>,
    BTreeMap<String, DeviceTensor>,
    Option<(String, f32)>,
);

/// Where a run's values are, for its outputs.
pub(super) struct Placed<'p> {
    pub needs: &'p [Vec<usize>],
    pub copies: &'p mut [DevCopy],
    pub locs: &'p mut [Vec<DLoc>],
}

/// Device training's gradients: each parameter's, contiguous, and the table of one
/// launch that adds them into the accumulators (`optim::GRAD_ENTRY` words a row).
#[derive(Default)]
struct Grads<'n> {
    by_param: BTreeMap<&'n str, DLoc>,
    table: Vec<u64>,
    largest: usize,
    first_micro: bool,
}

impl CudaExecutor {
    pub(super) fn outputs(
        &self,
        r: &mut Run<'_>,
        device: &Device,
        p: Placed<'_>,
        training: Option<(&Training, Micro)>,
        resident: Option<&Resident<'_>>,
    ) -> Result<Outputs, ExecError> {
        let mut out = Vec::with_capacity(self.graph.outputs.len());
        let mut kept = BTreeMap::new();
        let mut grads = Grads {
            first_micro: true,
            ..Grads::default()
        };
        for o in &self.graph.outputs {
            let v = &crate::executor::program_output(&self.kg, &o.name)?;
            r.materialize(&p.needs[*v], p.copies, p.locs)
                .map_err(dev_err)?;
            let trained = training.and_then(|(t, mb)| {
                let name = o.name.strip_prefix("grad.")?;
                let (key, tp) = t.params.get_key_value(name)?;
                Some((t, mb, key.as_str(), tp))
            });
            if let Some((t, mb, name, tp)) = trained {
                let g = r.contig(&p.locs[*v][0]).map_err(dev_err)?;
                let n = g.numel();
                if g.dtype != DType::F32 || g.shape() != tp.shape.as_slice() {
                    return Err(dev_err(format!(
                        "the gradient of `{name}` is {:?} {:?}, the parameter f32 {:?}",
                        g.dtype,
                        g.shape(),
                        tp.shape
                    )));
                }
                let flag = t.bad.ptr + 4 * tp.index as u64;
                grads.table.extend([g.base(), tp.acc.ptr, flag, n as u64]);
                grads.largest = grads.largest.max(n);
                grads.first_micro = mb.first;
                grads.by_param.insert(name, g);
                continue;
            }
            if resident.is_some_and(|res| (res.keep)(&o.name)) {
                let l = &p.locs[*v][0];
                let buf = device.alloc(l.numel()).map_err(dev_err)?;
                r.copy_to(l, buf.ptr).map_err(dev_err)?;
                let t = DeviceTensor {
                    buf,
                    shape: l.shape().to_vec(),
                    dtype: l.dtype,
                };
                kept.insert(o.name.clone(), t);
                continue;
            }
            let t = r.download(&p.locs[*v][0]).map_err(dev_err)?;
            out.push((o.name.clone(), t));
        }
        let non_finite = match training {
            Some((t, _)) => accumulate(r, device, t, &grads)?,
            None => None,
        };
        Ok((out, kept, non_finite))
    }
}

/// Adds device training's gradients into their accumulators (or assigns them, at the
/// first micro-batch of a step), and finds the first parameter, in name order, whose
/// gradient has an element that is not finite, and that element.
fn accumulate(
    r: &mut Run<'_>,
    device: &Device,
    t: &Training,
    grads: &Grads<'_>,
) -> Result<Option<(String, f32)>, ExecError> {
    if !grads.table.is_empty() {
        let f = if grads.first_micro {
            optim::GRAD_ASSIGN_MANY
        } else {
            optim::GRAD_ACCUMULATE_MANY
        };
        let tab = r
            .upload_enqueued(&optim::table_words(&grads.table))
            .map_err(dev_err)?;
        let count = grads.table.len() / optim::GRAD_ENTRY;
        device
            .launch(
                f,
                &[tab, t.scalars.ptr],
                &[count as i64],
                optim::many_items(grads.largest),
            )
            .map_err(dev_err)?;
    }
    if let Some(missing) = t
        .params
        .keys()
        .find(|n| !grads.by_param.contains_key(n.as_str()))
    {
        return Err(ExecError::Unsupported(format!(
            "the entry has no gradient output `grad.{missing}` for a trained parameter"
        )));
    }
    let flags = device.read(t.bad.ptr, t.params.len()).map_err(dev_err)?;
    let Some((name, _)) = t.params.iter().find(|(_, tp)| flags[tp.index] != 0) else {
        return Ok(None);
    };
    let words = r.words(&grads.by_param[name.as_str()]).map_err(dev_err)?;
    let x = words
        .into_iter()
        .map(f32::from_bits)
        .find(|x| !x.is_finite())
        .unwrap_or(f32::NAN);
    Ok(Some((name.clone(), x)))
}
