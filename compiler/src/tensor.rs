//! Host tensors and their safetensors form.
//!
//! In: named host tensors ([`Tensor`]: a shape and a typed, row-major buffer of f32, f64,
//! i32, i64 or bool) or a `.safetensors` file. Out: the file (written atomically by
//! [`save_safetensors`]) or the tensors read back ([`load_safetensors`]), bit for bit.
//!
//! Bool tensors are stored with safetensors' `BOOL` dtype, one byte per element (0 or 1).
//! Every error names the file and says what to do about it.

use crate::io_error::PathIoError;
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensorError, View};
use safetensors::SafeTensors;

/// Tensors by name: a run's inputs or parameters.
pub type Feeds = BTreeMap<String, Tensor>;

/// A run's outputs by name, in the graph's output order.
pub type Outputs = Vec<(String, Tensor)>;

/// The elements of a tensor, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

impl TensorData {
    /// The number of elements held.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::F64(v) => v.len(),
            TensorData::I32(v) => v.len(),
            TensorData::I64(v) => v.len(),
            TensorData::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `f32`, `f64`, `i32`, `i64` or `bool`.
    pub fn dtype_name(&self) -> &'static str {
        match self {
            TensorData::F32(_) => "f32",
            TensorData::F64(_) => "f64",
            TensorData::I32(_) => "i32",
            TensorData::I64(_) => "i64",
            TensorData::Bool(_) => "bool",
        }
    }
}

/// A tensor built from a shape and data that do not agree.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a tensor of shape {shape:?} holds {expected} elements, but {got} values were given")]
pub struct ShapeError {
    pub shape: Vec<usize>,
    /// The element count the shape describes.
    pub expected: ElementCount,
    pub got: usize,
}

/// The element count of a shape, or a note that it overflows `usize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElementCount(pub Option<usize>);

impl fmt::Display for ElementCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => write!(f, "more than usize::MAX"),
        }
    }
}

/// The number of elements of `shape`, `None` when it overflows.
pub fn shape_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// A host tensor: a shape and row-major elements. A rank-0 tensor (shape `[]`) holds one
/// element.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: TensorData,
}

impl Tensor {
    /// A tensor, checking that `data` holds exactly as many elements as `shape` says.
    pub fn new(shape: Vec<usize>, data: TensorData) -> Result<Tensor, ShapeError> {
        let expected = shape_numel(&shape);
        if expected != Some(data.len()) {
            return Err(ShapeError {
                shape,
                expected: ElementCount(expected),
                got: data.len(),
            });
        }
        Ok(Tensor { shape, data })
    }

    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Result<Tensor, ShapeError> {
        Tensor::new(shape, TensorData::F32(data))
    }

    pub fn f64(shape: Vec<usize>, data: Vec<f64>) -> Result<Tensor, ShapeError> {
        Tensor::new(shape, TensorData::F64(data))
    }

    pub fn i32(shape: Vec<usize>, data: Vec<i32>) -> Result<Tensor, ShapeError> {
        Tensor::new(shape, TensorData::I32(data))
    }

    pub fn i64(shape: Vec<usize>, data: Vec<i64>) -> Result<Tensor, ShapeError> {
        Tensor::new(shape, TensorData::I64(data))
    }

    pub fn bool(shape: Vec<usize>, data: Vec<bool>) -> Result<Tensor, ShapeError> {
        Tensor::new(shape, TensorData::Bool(data))
    }

    /// A rank-0 f32 tensor.
    pub fn scalar_f32(v: f32) -> Tensor {
        Tensor {
            shape: vec![],
            data: TensorData::F32(vec![v]),
        }
    }

    /// The element count the shape describes (saturating at `usize::MAX`).
    pub fn numel(&self) -> usize {
        shape_numel(&self.shape).unwrap_or(usize::MAX)
    }

    /// Whether the data holds exactly as many elements as the shape says (the fields are
    /// public, so a tensor can be built inconsistent; consumers check this).
    pub fn is_consistent(&self) -> bool {
        shape_numel(&self.shape) == Some(self.data.len())
    }

    /// `f32`, `f64`, `i32`, `i64` or `bool`.
    pub fn dtype_name(&self) -> &'static str {
        self.data.dtype_name()
    }

    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<&[f64]> {
        match &self.data {
            TensorData::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_i32(&self) -> Option<&[i32]> {
        match &self.data {
            TensorData::I32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            TensorData::I64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<&[bool]> {
        match &self.data {
            TensorData::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The elements of a float tensor widened to f64 (exact); `None` for other dtypes.
    pub fn to_f64_vec(&self) -> Option<Vec<f64>> {
        match &self.data {
            TensorData::F32(v) => Some(v.iter().map(|&x| f64::from(x)).collect()),
            TensorData::F64(v) => Some(v.clone()),
            _ => None,
        }
    }
}

/// Why a safetensors file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum TensorFileError {
    #[error(
        "no tensor file at `{path}`; check the path (or create it first, e.g. with `kiln init`)"
    )]
    NotFound { path: PathBuf },
    #[error(transparent)]
    Io(#[from] PathIoError),
    #[error(
        "`{path}` is not a readable safetensors file ({source}); it may be truncated or \
         corrupt, or not a safetensors file at all — re-create it from its source"
    )]
    Format {
        path: PathBuf,
        source: SafeTensorError,
    },
    #[error(
        "tensor `{name}` in `{path}` has dtype {dtype}, which kiln does not read; \
         supported dtypes are F32, F64, I32, I64 and BOOL — convert it before loading"
    )]
    UnsupportedDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error(
        "tensor `{name}` in `{path}` is BOOL but holds the byte {byte}; bools must be 0 or 1 \
         (the file is corrupt — re-create it)"
    )]
    BadBool {
        path: PathBuf,
        name: String,
        byte: u8,
    },
    #[error("cannot write `{path}`: tensor `{name}` is given twice; give each tensor one name")]
    DuplicateName { path: PathBuf, name: String },
    #[error("cannot write `{path}`: tensor `{name}` is inconsistent: {source}")]
    BadTensor {
        path: PathBuf,
        name: String,
        source: ShapeError,
    },
}

/// One tensor's little-endian bytes, as the safetensors writer wants them.
struct Bytes {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for Bytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn to_bytes(t: &Tensor) -> Bytes {
    let (dtype, bytes) = match &t.data {
        TensorData::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        TensorData::F64(v) => (Dtype::F64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        TensorData::I32(v) => (Dtype::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        TensorData::I64(v) => (Dtype::I64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        TensorData::Bool(v) => (Dtype::BOOL, v.iter().map(|&b| u8::from(b)).collect()),
    };
    Bytes {
        dtype,
        shape: t.shape.clone(),
        bytes,
    }
}

/// Writes `tensors` (and optional string `metadata`) to `path` in safetensors format.
///
/// The write is atomic ([`crate::fsync::write_replacing`]): the bytes go to
/// `<path>.tmp-<pid>` in the same directory, are flushed to disk, and the temporary file is
/// renamed over `path`. If anything fails, the temporary file is removed and whatever was at
/// `path` before is left untouched. A symbolic link is written through (the link stays);
/// a device or FIFO (`/dev/stdout`) is written in place. The same tensors and metadata
/// give the same bytes.
pub fn save_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<(), TensorFileError> {
    let mut seen = BTreeSet::new();
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            return Err(TensorFileError::DuplicateName {
                path: path.to_path_buf(),
                name: name.clone(),
            });
        }
        if !t.is_consistent() {
            return Err(TensorFileError::BadTensor {
                path: path.to_path_buf(),
                name: name.clone(),
                source: ShapeError {
                    shape: t.shape.clone(),
                    expected: ElementCount(shape_numel(&t.shape)),
                    got: t.data.len(),
                },
            });
        }
        views.push((name.clone(), to_bytes(t)));
    }
    let info: Option<HashMap<String, String>> =
        metadata.map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect());
    let bytes = safetensors::serialize(views, info).map_err(|source| TensorFileError::Format {
        path: path.to_path_buf(),
        source,
    })?;

    let mut bytes = bytes;
    if let Some(m) = metadata {
        sort_metadata(&mut bytes, m);
    }
    crate::fsync::write_replacing(path, &bytes)
        .map_err(|(action, source)| PathIoError::new(action, path, source).into())
}

/// `safetensors::serialize` writes the header's `__metadata__` from a `HashMap`, in an order
/// that changes from run to run. This rewrites it in key order — the same bytes reordered,
/// so the header keeps its length — so that the same tensors and metadata give the same
/// file. The header is left alone unless the object found is exactly `metadata`.
fn sort_metadata(bytes: &mut [u8], metadata: &BTreeMap<String, String>) {
    const KEY: &[u8] = b"{\"__metadata__\":";
    let Ok(sorted) = serde_json::to_string(metadata) else {
        return;
    };
    let (start, end) = (8 + KEY.len(), 8 + KEY.len() + sorted.len());
    if bytes.len() < end || &bytes[8..start] != KEY {
        return;
    }
    match serde_json::from_slice::<BTreeMap<String, String>>(&bytes[start..end]) {
        Ok(found) if &found == metadata => bytes[start..end].copy_from_slice(sorted.as_bytes()),
        _ => {}
    }
}

/// Reads every tensor of a safetensors file. F32, F64, I32, I64 and BOOL are supported;
/// any other dtype is an error naming the tensor.
pub fn load_safetensors(path: &Path) -> Result<BTreeMap<String, Tensor>, TensorFileError> {
    let bytes = std::fs::read(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            TensorFileError::NotFound {
                path: path.to_path_buf(),
            }
        } else {
            PathIoError::new("read", path, source).into()
        }
    })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|source| TensorFileError::Format {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in file.iter() {
        let raw = view.data();
        let data = match view.dtype() {
            Dtype::F32 => TensorData::F32(le_words::<4>(raw).map(f32::from_le_bytes).collect()),
            Dtype::F64 => TensorData::F64(le_words::<8>(raw).map(f64::from_le_bytes).collect()),
            Dtype::I32 => TensorData::I32(le_words::<4>(raw).map(i32::from_le_bytes).collect()),
            Dtype::I64 => TensorData::I64(le_words::<8>(raw).map(i64::from_le_bytes).collect()),
            Dtype::BOOL => {
                let mut v = Vec::with_capacity(raw.len());
                for &b in raw {
                    match b {
                        0 => v.push(false),
                        1 => v.push(true),
                        byte => {
                            return Err(TensorFileError::BadBool {
                                path: path.to_path_buf(),
                                name: name.to_string(),
                                byte,
                            })
                        }
                    }
                }
                TensorData::Bool(v)
            }
            other => {
                return Err(TensorFileError::UnsupportedDtype {
                    path: path.to_path_buf(),
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let tensor = Tensor::new(view.shape().to_vec(), data).map_err(|_| {
            // The safetensors reader already checked sizes; this is a belt-and-braces check.
            TensorFileError::Format {
                path: path.to_path_buf(),
                source: SafeTensorError::TensorInvalidInfo,
            }
        })?;
        out.insert(name.to_string(), tensor);
    }
    Ok(out)
}

/// The bytes as consecutive `N`-byte little-endian words.
fn le_words<const N: usize>(raw: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    raw.chunks_exact(N).map(|c| {
        let mut w = [0u8; N];
        w.copy_from_slice(c);
        w
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh, empty directory under the system temp dir.
    fn scratch_dir(tag: &str) -> PathBuf {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "kiln-tensor-test-{}-{}-{tag}",
            std::process::id(),
            n
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn sample() -> Vec<(String, Tensor)> {
        vec![
            (
                "f32".to_string(),
                Tensor::f32(
                    vec![2, 3],
                    vec![1.5, -0.0, f32::MIN_POSITIVE, f32::MAX, f32::NAN, 1e-40],
                )
                .unwrap(),
            ),
            (
                "f64".to_string(),
                Tensor::f64(vec![3], vec![std::f64::consts::PI, -1e300, f64::INFINITY]).unwrap(),
            ),
            (
                "i32".to_string(),
                Tensor::i32(vec![2, 2], vec![i32::MIN, -1, 0, i32::MAX]).unwrap(),
            ),
            (
                "i64".to_string(),
                Tensor::i64(vec![2], vec![i64::MIN, i64::MAX]).unwrap(),
            ),
            (
                "bool".to_string(),
                Tensor::bool(vec![1, 3], vec![true, false, true]).unwrap(),
            ),
            ("scalar".to_string(), Tensor::scalar_f32(2.25)),
            (
                "empty".to_string(),
                Tensor::f32(vec![0, 4], vec![]).unwrap(),
            ),
        ]
    }

    /// Bitwise equality (NaN payloads and -0.0 included).
    fn same_bits(a: &Tensor, b: &Tensor) -> bool {
        a.shape == b.shape
            && match (&a.data, &b.data) {
                (TensorData::F32(x), TensorData::F32(y)) => x
                    .iter()
                    .map(|v| v.to_bits())
                    .eq(y.iter().map(|v| v.to_bits())),
                (TensorData::F64(x), TensorData::F64(y)) => x
                    .iter()
                    .map(|v| v.to_bits())
                    .eq(y.iter().map(|v| v.to_bits())),
                (x, y) => x == y,
            }
    }

    #[test]
    fn constructors_check_element_count() {
        let e = Tensor::f32(vec![2, 3], vec![1.0; 5]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "a tensor of shape [2, 3] holds 6 elements, but 5 values were given"
        );
        let t = Tensor::i32(vec![], vec![7]).unwrap();
        assert_eq!(t.numel(), 1);
        assert_eq!(t.dtype_name(), "i32");
        assert_eq!(t.as_i32(), Some(&[7][..]));
        assert_eq!(t.as_f32(), None);
        assert_eq!(t.to_f64_vec(), None);
        let f = Tensor::f32(vec![2], vec![0.5, 0.25]).unwrap();
        assert_eq!(f.to_f64_vec(), Some(vec![0.5, 0.25]));
    }

    #[test]
    fn round_trip_is_bit_exact_for_every_dtype() {
        let dir = scratch_dir("roundtrip");
        let path = dir.join("w.safetensors");
        let mut meta = BTreeMap::new();
        meta.insert("step".to_string(), "12".to_string());
        let tensors = sample();
        save_safetensors(&path, &tensors, Some(&meta)).unwrap();
        let back = load_safetensors(&path).unwrap();
        assert_eq!(back.len(), tensors.len());
        for (name, t) in &tensors {
            let b = &back[name];
            assert!(same_bits(t, b), "{name}: {t:?} vs {b:?}");
        }
        // Overwriting replaces the content.
        save_safetensors(&path, &tensors[..1], None).unwrap();
        assert_eq!(load_safetensors(&path).unwrap().len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_same_tensors_and_metadata_give_the_same_bytes() {
        // The crate writes the metadata from a `HashMap`, whose order differs between maps
        // (each has its own random hasher): eight keys give 8! orders.
        let dir = scratch_dir("metadata_order");
        let meta: BTreeMap<String, String> = (0..8)
            .map(|i| (format!("kiln.key{i}"), format!("value \"{i}\" é")))
            .collect();
        let path = dir.join("a.safetensors");
        save_safetensors(&path, &sample(), Some(&meta)).unwrap();
        let first = std::fs::read(&path).unwrap();
        for _ in 0..5 {
            save_safetensors(&path, &sample(), Some(&meta)).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), first);
        }
        let header_len = u64::from_le_bytes(first[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&first[8..8 + header_len]).unwrap();
        let sorted = serde_json::to_string(&meta).unwrap();
        assert!(
            header.starts_with(&format!("{{\"__metadata__\":{sorted}")),
            "{header}"
        );
        let st = safetensors::SafeTensors::deserialize(&first).unwrap();
        assert_eq!(st.len(), sample().len());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn atomic_write_leaves_no_temp_file() {
        let dir = scratch_dir("atomic");
        let path = dir.join("ckpt.safetensors");
        save_safetensors(&path, &sample(), None).unwrap();
        save_safetensors(&path, &sample(), None).unwrap();
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["ckpt.safetensors".to_string()]);

        // A failed write (the target is a directory, so the rename fails) removes its
        // temporary file and leaves the existing content alone.
        let blocked = dir.join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("keep.txt"), b"precious").unwrap();
        let err = save_safetensors(&blocked, &sample(), None).unwrap_err();
        assert!(err.to_string().contains("blocked"), "{err}");
        assert_eq!(
            std::fs::read(blocked.join("keep.txt")).unwrap(),
            b"precious"
        );
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, vec!["blocked", "ckpt.safetensors"]);

        // Duplicate names are refused before anything is written.
        let dup = vec![sample()[0].clone(), sample()[0].clone()];
        let err = save_safetensors(&path, &dup, None).unwrap_err();
        assert!(err.to_string().contains("`f32` is given twice"), "{err}");
        assert_eq!(load_safetensors(&path).unwrap().len(), sample().len());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let dir = scratch_dir("bad");
        let missing = dir.join("nope.safetensors");
        let err = load_safetensors(&missing).unwrap_err();
        assert!(matches!(err, TensorFileError::NotFound { .. }));
        assert!(err.to_string().contains("nope.safetensors"), "{err}");

        let path = dir.join("w.safetensors");
        save_safetensors(&path, &sample(), None).unwrap();
        let full = std::fs::read(&path).unwrap();
        let truncated = dir.join("truncated.safetensors");
        std::fs::write(&truncated, &full[..full.len() - 3]).unwrap();
        let err = load_safetensors(&truncated).unwrap_err();
        assert!(matches!(err, TensorFileError::Format { .. }));
        let msg = err.to_string();
        assert!(msg.contains("truncated.safetensors"), "{msg}");
        assert!(msg.contains("truncated or corrupt"), "{msg}");

        let garbage = dir.join("garbage.safetensors");
        std::fs::write(&garbage, b"this is not a tensor file at all").unwrap();
        let err = load_safetensors(&garbage).unwrap_err();
        assert!(matches!(err, TensorFileError::Format { .. }));
        assert!(err.to_string().contains("garbage.safetensors"), "{err}");

        let tiny = dir.join("tiny.safetensors");
        std::fs::write(&tiny, b"abc").unwrap();
        assert!(matches!(
            load_safetensors(&tiny).unwrap_err(),
            TensorFileError::Format { .. }
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unsupported_dtype_names_the_tensor() {
        let dir = scratch_dir("dtype");
        let path = dir.join("half.safetensors");
        let view = Bytes {
            dtype: Dtype::F16,
            shape: vec![2],
            bytes: vec![0, 60, 0, 64],
        };
        let bytes = safetensors::serialize(vec![("enc.w".to_string(), view)], None).unwrap();
        std::fs::write(&path, bytes).unwrap();
        let msg = load_safetensors(&path).unwrap_err().to_string();
        assert!(msg.contains("`enc.w`"), "{msg}");
        assert!(msg.contains("F16"), "{msg}");
        assert!(msg.contains("half.safetensors"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
