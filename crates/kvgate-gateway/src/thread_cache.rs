//! Per-thread caches of the `ArcSwap` cells the request path reads (the policies, the SLO, auth,
//! the speed board): each thread keeps the last value it read and the cell it came from, and while
//! the cell still holds that value (one relaxed pointer compare) it is not loaded again. A store
//! is seen at the next read, as with a load. The cache keeps the cell and the value alive, so a
//! pointer seen equal is that same live value (no reuse of a freed address).

/// `$vis fn $name(cell: &Arc<ArcSwap<$t>>) -> Arc<$t>`: the cell's value, read through this
/// thread's cache (one cache per function).
macro_rules! cached_load {
    ($(#[$m:meta])* $vis:vis fn $name:ident($t:ty)) => {
        $(#[$m])*
        $vis fn $name(cell: &std::sync::Arc<arc_swap::ArcSwap<$t>>) -> std::sync::Arc<$t> {
            type Cache = arc_swap::cache::Cache<
                std::sync::Arc<arc_swap::ArcSwap<$t>>,
                std::sync::Arc<$t>,
            >;
            thread_local! {
                static CACHE: std::cell::RefCell<Option<Cache>> =
                    const { std::cell::RefCell::new(None) };
            }
            CACHE.with(|c| {
                let mut c = c.borrow_mut();
                match c.as_mut() {
                    Some(cache) if std::ptr::eq(cache.arc_swap(), &**cell) => {
                        cache.load().clone()
                    }
                    _ => c.insert(Cache::new(cell.clone())).load().clone(),
                }
            })
        }
    };
}
pub(crate) use cached_load;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arc_swap::ArcSwap;

    cached_load!(fn read(u32));

    #[test]
    fn a_store_is_seen_at_the_next_read_and_cells_are_told_apart() {
        let a = Arc::new(ArcSwap::from_pointee(1));
        let b = Arc::new(ArcSwap::from_pointee(2));
        assert_eq!(*read(&a), 1);
        assert_eq!(*read(&a), 1);
        a.store(Arc::new(3));
        assert_eq!(*read(&a), 3);
        assert_eq!(*read(&b), 2);
        assert_eq!(*read(&a), 3);
        b.store(Arc::new(4));
        assert_eq!(*read(&b), 4);
        // A cell dropped and another made: the cache kept the old one alive, so the new one
        // (at a different address) is read, not the cached value.
        drop(a);
        let c = Arc::new(ArcSwap::from_pointee(5));
        assert_eq!(*read(&c), 5);
    }
}
