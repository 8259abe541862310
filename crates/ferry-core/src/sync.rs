//! Locks. ferry's mutexes guard maps and counters that every holder updates in single
//! statements, so a lock poisoned by a thread that panicked while holding it still
//! guards consistent data: [`lock`] takes it anyway rather than spreading the panic to
//! every other thread (the panic itself is reported where it happened).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Lock `m`, recovering the guard from a poisoned lock (see the module doc for why that
/// is safe for the mutexes ferry uses this on).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Wait on `cv` with `guard`, as [`lock`] takes a poisoned lock.
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(|p| p.into_inner())
}

/// Wait on `cv` with `guard` for at most `d`, as [`lock`] takes a poisoned lock.
pub fn wait_timeout<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    d: Duration,
) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, d)
        .unwrap_or_else(|p| p.into_inner())
        .0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
