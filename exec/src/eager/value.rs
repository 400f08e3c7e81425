//! Values of the eager executor: typed storage seen through a strided layout.
//!
//! In: buffers written by kernels (owned, shared by reference count) or borrowed from the
//! caller's tensors (parameters are never copied). Out: [`Value`]s that views (`reshape`,
//! `permute`, `broadcast`, `slice`) re-describe without touching the elements, typed
//! [`View`]s for kernels, and row-major buffers for host tensors at the end of a run.
//!
//! A [`Layout`] maps a multi-index `i` to the element `offset + Σ i[d] * strides[d]` of
//! the storage. Strides are never negative; a broadcast axis has stride 0.

use std::sync::Arc;

use super::pool::Pool;
use super::walk::to_vec;

/// A kernel's output buffer, handed back to its pool (if any) when the last value that
/// reads it is dropped.
#[derive(Debug)]
pub(crate) struct Buffer<E: Elem> {
    v: Vec<E>,
    pool: Option<Arc<Pool>>,
}

impl<E: Elem> Buffer<E> {
    /// The elements, leaving an empty buffer (whose drop then returns nothing).
    fn take(mut self) -> Vec<E> {
        std::mem::take(&mut self.v)
    }
}

impl<E: Elem> Drop for Buffer<E> {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            E::recycle(pool, std::mem::take(&mut self.v));
        }
    }
}

/// Where a value's elements live.
#[derive(Debug)]
pub(crate) enum Store<'t, E: Elem> {
    /// Computed by a kernel; views of it share the buffer, and it is freed (or pooled)
    /// when the last one is dropped.
    Owned(Arc<Buffer<E>>),
    /// The caller's tensor, read in place.
    Borrowed(&'t [E]),
}

impl<E: Elem> Clone for Store<'_, E> {
    fn clone(&self) -> Self {
        match self {
            Store::Owned(a) => Store::Owned(Arc::clone(a)),
            Store::Borrowed(s) => Store::Borrowed(s),
        }
    }
}

impl<E: Elem> Store<'_, E> {
    pub(crate) fn as_slice(&self) -> &[E] {
        match self {
            Store::Owned(a) => a.v.as_slice(),
            Store::Borrowed(s) => s,
        }
    }

    /// The elements `layout` describes, row-major: the buffer itself when this is its
    /// only owner and the layout covers it exactly, else a copy.
    pub(crate) fn into_vec(self, layout: &Layout) -> Vec<E> {
        let exact = layout.is_contiguous() && layout.offset == 0;
        let s = match self {
            Store::Owned(a) if exact && a.v.len() == layout.numel() => match Arc::try_unwrap(a) {
                Ok(b) => return b.take(),
                Err(a) => Store::Owned(a),
            },
            s => s,
        };
        to_vec(
            None,
            View {
                data: s.as_slice(),
                layout,
            },
        )
    }
}

/// The elements of a value, by dtype.
#[derive(Clone, Debug)]
pub(crate) enum Data<'t> {
    F(Store<'t, f32>),
    I(Store<'t, i32>),
    B(Store<'t, bool>),
}

impl Data<'_> {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Data::F(_) => "f32",
            Data::I(_) => "i32",
            Data::B(_) => "bool",
        }
    }
}

/// The element types a value can hold, with the way in and out of [`Data`].
pub(crate) trait Elem:
    Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static
{
    fn store<'a, 't>(d: &'a Data<'t>) -> Option<&'a Store<'t, Self>>;
    /// The storage, or the data back when it holds another dtype.
    fn take<'t>(d: Data<'t>) -> Result<Store<'t, Self>, Data<'t>>;
    fn wrap<'t>(s: Store<'t, Self>) -> Data<'t>;
    /// A buffer of `n` elements with unspecified contents (from the pool for f32).
    fn alloc(pool: Option<&Pool>, n: usize) -> Vec<Self>;
    /// Hands a dead buffer to the pool (f32) or frees it.
    fn recycle(pool: &Pool, v: Vec<Self>);
}

macro_rules! elem {
    ($t:ident, $variant:ident) => {
        impl Elem for $t {
            fn store<'a, 't>(d: &'a Data<'t>) -> Option<&'a Store<'t, Self>> {
                match d {
                    Data::$variant(s) => Some(s),
                    _ => None,
                }
            }
            fn take<'t>(d: Data<'t>) -> Result<Store<'t, Self>, Data<'t>> {
                match d {
                    Data::$variant(s) => Ok(s),
                    other => Err(other),
                }
            }
            fn wrap<'t>(s: Store<'t, Self>) -> Data<'t> {
                Data::$variant(s)
            }
            elem!(@pool $t);
        }
    };
    (@pool f32) => {
        fn alloc(pool: Option<&Pool>, n: usize) -> Vec<f32> {
            match pool {
                Some(p) => p.take(n),
                None => vec![0.0; n],
            }
        }
        fn recycle(pool: &Pool, v: Vec<f32>) {
            pool.give(v)
        }
    };
    (@pool $t:ty) => {
        fn alloc(_: Option<&Pool>, n: usize) -> Vec<$t> {
            vec![<$t>::default(); n]
        }
        fn recycle(_: &Pool, _: Vec<$t>) {}
    };
}

elem!(f32, F);
elem!(i32, I);
elem!(bool, B);

/// Row-major strides of `shape`.
pub(crate) fn row_major(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// How a value's multi-indices map into its storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub offset: usize,
}

impl Layout {
    /// Row-major, starting at element 0.
    pub(crate) fn contiguous(shape: &[usize]) -> Layout {
        Layout {
            shape: shape.to_vec(),
            strides: row_major(shape),
            offset: 0,
        }
    }

    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are `offset .. offset + numel` in row-major order.
    pub(crate) fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut want = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != want {
                return false;
            }
            want *= d;
        }
        true
    }

    /// A `[b, h, t, d]` shape stored in the `[b, t, h, d]` order: an attention result
    /// with its heads merged ([`kiln_compiler::optimize::kernels::KernelGraph::heads_merged`]).
    pub(crate) fn heads_merged(shape: &[usize]) -> Layout {
        debug_assert_eq!(shape.len(), 4);
        Layout::contiguous(&[shape[0], shape[2], shape[1], shape[3]]).permute(&[0, 2, 1, 3])
    }

    /// Output axis `i` is axis `perm[i]`.
    pub(crate) fn permute(&self, perm: &[usize]) -> Layout {
        Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }

    /// Numpy broadcast to `to` (right-aligned): new and size-1 axes get stride 0.
    pub(crate) fn broadcast(&self, to: &[usize]) -> Layout {
        let off = to.len() - self.shape.len();
        let strides = (0..to.len())
            .map(|i| {
                if i < off || self.shape[i - off] == 1 {
                    0
                } else {
                    self.strides[i - off]
                }
            })
            .collect();
        Layout {
            shape: to.to_vec(),
            strides,
            offset: self.offset,
        }
    }

    /// Elements `start .. start + len` along `axis`.
    pub(crate) fn slice(&self, axis: usize, start: usize, len: usize) -> Layout {
        let mut l = self.clone();
        l.shape[axis] = len;
        if len > 0 && l.numel() > 0 {
            l.offset += start * self.strides[axis];
        }
        l
    }

    /// The same elements under a new shape, if that needs no copy (contiguous values).
    pub(crate) fn reshape(&self, to: &[usize]) -> Option<Layout> {
        if !self.is_contiguous() {
            return None;
        }
        let mut l = Layout::contiguous(to);
        l.offset = if l.numel() == 0 { 0 } else { self.offset };
        Some(l)
    }
}

/// A computed value: storage and layout.
#[derive(Clone, Debug)]
pub(crate) struct Value<'t> {
    pub data: Data<'t>,
    pub layout: Layout,
}

/// A typed, borrowed view of a value, what kernels read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View<'s, E> {
    pub data: &'s [E],
    pub layout: &'s Layout,
}

impl<'s, E: Elem> View<'s, E> {
    pub(crate) fn shape(&self) -> &'s [usize] {
        &self.layout.shape
    }

    /// The elements in row-major order, when they already are.
    pub(crate) fn contiguous(&self) -> Option<&'s [E]> {
        if self.layout.is_contiguous() {
            let n = self.layout.numel();
            let start = if n == 0 { 0 } else { self.layout.offset };
            self.data.get(start..start + n)
        } else {
            None
        }
    }
}

impl<'t> Value<'t> {
    /// A row-major value over `v`, handed to `pool` when it dies.
    pub(crate) fn owned<E: Elem>(
        shape: &[usize],
        v: Vec<E>,
        pool: Option<&Arc<Pool>>,
    ) -> Value<'t> {
        Value {
            data: E::wrap(Store::Owned(Arc::new(Buffer {
                v,
                pool: pool.cloned(),
            }))),
            layout: Layout::contiguous(shape),
        }
    }

    pub(crate) fn borrowed<E: Elem>(shape: &[usize], v: &'t [E]) -> Value<'t> {
        Value {
            data: E::wrap(Store::Borrowed(v)),
            layout: Layout::contiguous(shape),
        }
    }

    pub(crate) fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    /// A typed view, or `None` when the value holds another dtype.
    pub(crate) fn view<E: Elem>(&self) -> Option<View<'_, E>> {
        E::store(&self.data).map(|s| View {
            data: s.as_slice(),
            layout: &self.layout,
        })
    }

    /// Whether this value alone owns an f32 buffer of at least `n` elements (one a
    /// kernel may write its result into, or that goes back to the pool as it dies).
    pub(crate) fn owns_f32_buffer_of(&self, n: usize) -> bool {
        matches!(&self.data, Data::F(Store::Owned(a)) if Arc::strong_count(a) == 1 && a.v.len() >= n)
    }

    /// The row-major buffer itself, when this value is its only owner and covers it
    /// exactly — so a kernel may overwrite it in place. Otherwise the value comes back.
    pub(crate) fn into_unique<E: Elem>(self) -> Result<Vec<E>, Value<'t>> {
        let fits = self.layout.is_contiguous()
            && self.layout.offset == 0
            && matches!(E::store(&self.data), Some(Store::Owned(a)) if a.v.len() == self.layout.numel());
        if !fits {
            return Err(self);
        }
        let Value { data, layout } = self;
        match E::take(data) {
            Ok(Store::Owned(a)) => Arc::try_unwrap(a).map(Buffer::take).map_err(|a| Value {
                data: E::wrap(Store::Owned(a)),
                layout,
            }),
            Ok(other) => Err(Value {
                data: E::wrap(other),
                layout,
            }),
            Err(data) => Err(Value { data, layout }),
        }
    }
}
