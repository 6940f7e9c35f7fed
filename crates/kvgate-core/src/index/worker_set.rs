//! The set of workers holding one block: inline for up to three workers (the common case: a prefix
//! lives on one or a few workers), spilled to the heap beyond. 16 bytes either way.

use crate::WorkerId;

const INLINE: usize = 3;

#[derive(Debug, Clone)]
pub(crate) enum WorkerSet {
    Inline { len: u8, ids: [u32; INLINE] },
    Heap(Box<Vec<u32>>),
}

impl Default for WorkerSet {
    fn default() -> Self {
        WorkerSet::Inline {
            len: 0,
            ids: [0; INLINE],
        }
    }
}

impl WorkerSet {
    #[inline]
    pub(crate) fn as_slice(&self) -> &[u32] {
        match self {
            WorkerSet::Inline { len, ids } => &ids[..*len as usize],
            WorkerSet::Heap(v) => v,
        }
    }

    #[inline]
    pub(crate) fn iter(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.as_slice().iter().map(|&w| WorkerId(w))
    }

    #[inline]
    pub(crate) fn contains(&self, w: WorkerId) -> bool {
        self.as_slice().contains(&w.0)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// Adds `w`; false if it was already present.
    pub(crate) fn insert(&mut self, w: WorkerId) -> bool {
        if self.contains(w) {
            return false;
        }
        match self {
            WorkerSet::Inline { len, ids } if (*len as usize) < INLINE => {
                ids[*len as usize] = w.0;
                *len += 1;
            }
            WorkerSet::Inline { ids, .. } => {
                let mut v = Vec::with_capacity(INLINE * 2);
                v.extend_from_slice(ids);
                v.push(w.0);
                *self = WorkerSet::Heap(Box::new(v));
            }
            WorkerSet::Heap(v) => v.push(w.0),
        }
        true
    }

    /// Removes `w`; false if it was absent. Order is not preserved.
    pub(crate) fn remove(&mut self, w: WorkerId) -> bool {
        match self {
            WorkerSet::Inline { len, ids } => {
                let n = *len as usize;
                let Some(pos) = ids[..n].iter().position(|&x| x == w.0) else {
                    return false;
                };
                ids[pos] = ids[n - 1];
                *len -= 1;
            }
            WorkerSet::Heap(v) => {
                let Some(pos) = v.iter().position(|&x| x == w.0) else {
                    return false;
                };
                v.swap_remove(pos);
                if v.len() <= INLINE {
                    let mut ids = [0; INLINE];
                    ids[..v.len()].copy_from_slice(v);
                    *self = WorkerSet::Inline {
                        len: v.len() as u8,
                        ids,
                    };
                }
            }
        }
        true
    }

    /// Heap bytes owned beyond the inline 16 bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            WorkerSet::Inline { .. } => 0,
            WorkerSet::Heap(v) => std::mem::size_of::<Vec<u32>>() + v.capacity() * 4,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bytes() {
        assert_eq!(std::mem::size_of::<WorkerSet>(), 16);
    }

    #[test]
    fn spill_and_shrink() {
        let mut s = WorkerSet::default();
        for w in 0..10 {
            assert!(s.insert(WorkerId(w)));
            assert!(!s.insert(WorkerId(w)));
        }
        assert!(matches!(s, WorkerSet::Heap(_)));
        for w in 0..8 {
            assert!(s.remove(WorkerId(w)));
            assert!(!s.remove(WorkerId(w)));
        }
        assert!(matches!(s, WorkerSet::Inline { len: 2, .. }));
        let mut left: Vec<u32> = s.as_slice().to_vec();
        left.sort();
        assert_eq!(left, [8, 9]);
        assert!(s.remove(WorkerId(8)) && s.remove(WorkerId(9)) && s.is_empty());
    }
}
