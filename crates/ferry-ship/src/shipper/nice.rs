//! The niceness of the shipper's threads (see `ShipperConfig::nice`).

/// Make the calling thread `nice` (see `ShipperConfig::nice`). Only Linux sets niceness
/// per thread; elsewhere this does nothing. A failure is logged and otherwise ignored: it
/// only costs the app some throughput.
pub fn lower_thread_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take plain integers, touch no memory of ours,
        // and on Linux PRIO_PROCESS with a thread id changes only that thread.
        #[allow(unsafe_code)]
        let rc = unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
        };
        if rc != 0 {
            tracing::debug!(
                "cannot lower the shipper's priority to nice {nice}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}
