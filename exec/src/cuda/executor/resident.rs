//! The resident decoder: tensors kept on the device between a decoder's steps, rows
//! gathered to the surviving beams and each row's best tokens, without a copy to the host.

use std::collections::BTreeMap;

use kiln_compiler::codegen::cuda::resident as gather;
use kiln_compiler::ir::DType;
use kiln_compiler::reference::{ExecError, RunOptions};
use kiln_compiler::tensor::{Feeds, Tensor, TensorData};

use crate::executor::DeviceResident;

use super::*;

impl DeviceResident for CudaExecutor {
    /// A host tensor copied to the device (f32, f64 narrowed to f32, i32, i64 checked
    /// to fit i32, bools as 0/1).
    fn to_device(&self, t: &Tensor) -> Result<DeviceTensor, ExecError> {
        let numel = t.numel();
        if !t.is_consistent() {
            return Err(ExecError::Unsupported(format!(
                "a tensor of shape {:?} holding {} values",
                t.shape,
                t.data.len()
            )));
        }
        let (words, dtype): (Vec<u32>, DType) = match &t.data {
            TensorData::F32(v) => (v.iter().map(|x| x.to_bits()).collect(), DType::F32),
            TensorData::F64(v) => (
                v.iter().map(|&x| (x as f32).to_bits()).collect(),
                DType::F32,
            ),
            TensorData::I32(v) => (v.iter().map(|&x| x as u32).collect(), DType::I32),
            TensorData::I64(v) => (
                v.iter()
                    .map(|&x| {
                        i32::try_from(x).map(|x| x as u32).map_err(|_| {
                            ExecError::Unsupported(format!("the id {x} does not fit in i32"))
                        })
                    })
                    .collect::<Result<_, _>>()?,
                DType::I32,
            ),
            TensorData::Bool(v) => (v.iter().map(|&b| b as u32).collect(), DType::Bool),
        };
        debug_assert_eq!(words.len(), numel);
        let guard = self.state();
        guard.device.bind().map_err(dev_err)?;
        let buf = guard.device.upload(&words).map_err(dev_err)?;
        Ok(DeviceTensor {
            buf,
            shape: t.shape.clone(),
            dtype,
        })
    }

    /// Every tensor of `ts` with its rows (axis 0) taken in the order `rows` (repeats
    /// allowed): row `r` of each result is row `rows[r]` of its source, bit for bit (the
    /// host's `decode::take_rows`). One upload of the indices, one launch per tensor of
    /// the generated `kiln_take_rows` (compiled on first use), one synchronization.
    fn take_rows(
        &self,
        ts: &[&DeviceTensor],
        rows: &[usize],
    ) -> Result<Vec<DeviceTensor>, ExecError> {
        let guard = self.decoder_unit()?;
        let dev = &guard.device;
        let idx: Vec<u32> = rows
            .iter()
            .map(|&r| u32::try_from(r).map_err(|_| ExecError::Unsupported(format!("row {r}"))))
            .collect::<Result<_, _>>()?;
        let idx = dev.upload(&idx).map_err(dev_err)?;
        let mut out = Vec::with_capacity(ts.len());
        for t in ts {
            let Some((&n0, rest)) = t.shape.split_first() else {
                return Err(ExecError::Unsupported(
                    "rows of a scalar on the device".to_string(),
                ));
            };
            if let Some(&bad) = rows.iter().find(|&&r| r >= n0) {
                return Err(ExecError::Unsupported(format!(
                    "row {bad} of a device tensor of shape {:?}",
                    t.shape
                )));
            }
            let elems: usize = rest.iter().product();
            // The gather moves words: a bf16 row is half as many (rows of an even width).
            let width = if t.dtype == DType::BF16 {
                if !elems.is_multiple_of(2) {
                    return Err(ExecError::Unsupported(format!(
                        "rows of {elems} bf16 values (an odd count) on the device"
                    )));
                }
                elems / 2
            } else {
                elems
            };
            let mut shape = t.shape.clone();
            shape[0] = rows.len();
            let buf = dev.alloc(rows.len() * width).map_err(dev_err)?;
            let (dims, items) = gather::take_rows_dims(rows.len(), width);
            if items > 0 {
                dev.launch(
                    gather::TAKE_ROWS,
                    &[idx.ptr, t.buf.ptr, buf.ptr],
                    &dims,
                    items,
                )
                .map_err(dev_err)?;
            }
            out.push(DeviceTensor {
                buf,
                shape,
                dtype: t.dtype,
            });
        }
        dev.sync().map_err(dev_err)?;
        Ok(out)
    }

    /// What beam search reads of a step's logits, selected on the device
    /// (`codegen::cuda::resident::row_top_k`, compiled on first use): per row of
    /// `logits` (`[rows, len, vocab]` f32 or bf16, its last position), the best `k` tokens
    /// other than `banned` and NaN, best first with ties to the smaller id, their
    /// log-probabilities (f64 log-softmax over the row's non-NaN values), and `eos`'s.
    /// Downloads `12·k + 8` bytes a row instead of the row.
    fn row_top_k(
        &self,
        logits: &DeviceTensor,
        k: usize,
        banned: &[i32],
        eos: i32,
    ) -> Result<RowsTopK, ExecError> {
        let [rows, len, vocab] = logits.shape[..] else {
            return Err(ExecError::Unsupported(format!(
                "logits of shape {:?}: the top-k reads [rows, len, vocab]",
                logits.shape
            )));
        };
        let f = match logits.dtype {
            DType::F32 => gather::TOP_K,
            DType::BF16 => gather::TOP_K_BF16,
            other => {
                return Err(ExecError::Unsupported(format!(
                    "{other:?} logits for the top-k"
                )))
            }
        };
        let mut out = RowsTopK {
            k,
            vals: vec![f64::NEG_INFINITY; rows * k],
            ids: vec![-1; rows * k],
            eos: vec![f64::NEG_INFINITY; rows],
        };
        if rows == 0 || len == 0 {
            return Ok(out);
        }
        let guard = self.decoder_unit()?;
        let dev = &guard.device;
        let mut ban: Vec<u32> = banned.iter().map(|&b| b as u32).collect();
        let nb = ban.len();
        ban.push(0);
        let ban = dev.upload(&ban).map_err(dev_err)?;
        let vals = dev.alloc(2 * rows * k.max(1)).map_err(dev_err)?;
        let ids = dev.alloc(rows * k.max(1)).map_err(dev_err)?;
        let eos_buf = dev.alloc(2 * rows).map_err(dev_err)?;
        let (dims, items) =
            gather::row_top_k_dims(rows, (vocab, len * vocab, (len - 1) * vocab), k, nb, eos);
        dev.launch(
            f,
            &[logits.buf.ptr, ban.ptr, vals.ptr, ids.ptr, eos_buf.ptr],
            &dims,
            items,
        )
        .map_err(dev_err)?;
        let f64s = |w: Vec<u32>| -> Vec<f64> {
            w.chunks(2)
                .map(|p| f64::from_bits(u64::from(p[0]) | (u64::from(p[1]) << 32)))
                .collect()
        };
        if k > 0 {
            out.vals = f64s(dev.read(vals.ptr, 2 * rows * k).map_err(dev_err)?);
            out.ids = dev
                .read(ids.ptr, rows * k)
                .map_err(dev_err)?
                .into_iter()
                .map(|w| w as i32)
                .collect();
        }
        out.eos = f64s(dev.read(eos_buf.ptr, 2 * rows).map_err(dev_err)?);
        Ok(out)
    }

    /// A run with some inputs already on the device (`resident`, by input name; the other
    /// inputs from the host as in [`CudaExecutor::run`]); the outputs `keep` names stay on
    /// the device (copied out of the arena), the others come back to the host, in
    /// `graph.outputs` order. What the GPU decoder runs each step: its encoder output and
    /// key/value caches never leave the device.
    fn run_resident(
        &self,
        inputs: &Feeds,
        resident: &BTreeMap<String, DeviceTensor>,
        params: &Feeds,
        opts: &RunOptions,
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<ResidentOut, ExecError> {
        let res = Resident {
            inputs: resident,
            keep,
        };
        let out = self.run_with(inputs, params, opts, None, None, Some(&res))?;
        Ok((out.outputs, out.kept))
    }
}

impl CudaExecutor {
    /// The device, bound to this thread, with the resident decoder's unit
    /// (`codegen::cuda::resident`: the row gather and the top-k) compiled and loaded on
    /// first use.
    pub(super) fn decoder_unit(&self) -> Result<std::sync::MutexGuard<'_, State>, ExecError> {
        let mut guard = self.state();
        guard.device.bind().map_err(dev_err)?;
        load_unit_once(
            &mut guard.device,
            gather::TAKE_ROWS,
            gather::code,
            &self.nvrtc_options,
        )
        .map_err(|log| dev_err(format!("NVRTC cannot compile the decoder's unit: {log}")))?;
        Ok(guard)
    }

    /// A device tensor copied to the host.
    pub fn to_host(&self, t: &DeviceTensor) -> Result<Tensor, ExecError> {
        let guard = self.state();
        guard.device.bind().map_err(dev_err)?;
        let n = t.numel();
        let w = guard
            .device
            .read(t.buf.ptr, words_of(t.dtype, n))
            .map_err(dev_err)?;
        let data = match t.dtype {
            DType::I32 => TensorData::I32(w.into_iter().map(|x| x as i32).collect()),
            DType::Bool => TensorData::Bool(w.iter().map(|&x| x != 0).collect()),
            DType::BF16 => TensorData::F32(unpack_bf16(&w, n)),
            _ => TensorData::F32(w.into_iter().map(f32::from_bits).collect()),
        };
        Ok(Tensor {
            shape: t.shape.clone(),
            data,
        })
    }
}
