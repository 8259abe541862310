//! Reading the app's files without touching their timestamps.
//!
//! SQLite syncs with `fsync`, which writes the inode too whenever it is dirty, and a dirty
//! inode costs the app's commit one more synchronous disk write. The app's own writes
//! dirty it at most once per clock tick (the mtime); a shipper that reads and stats the
//! WAL on every step can dirty it far more often, in two ways this module avoids:
//!
//! - **atime.** Under `relatime` (the default mount option) the first read after a write
//!   updates the atime. A shipper reading the WAL every millisecond did so after nearly
//!   every tick's writes, doubling the commits whose fsync also wrote the inode. [`open`]
//!   opens with `O_NOATIME` (allowed to the file's owner: an in-process or same-user
//!   sidecar shipper), falling back to a plain open otherwise.
//! - **Multigrain timestamps.** Since Linux 6.13, a stat that reports a file's mtime or
//!   ctime marks them observed, and the next write to the file then takes a fine-grained
//!   timestamp: the inode is dirtied by every write instead of once per clock tick.
//!   Measured here, an outside loop stat-ing the WAL cut a plain SQLite writer from 5,300
//!   to 3,500 commits per second. `statx` asked only for the inode and the size does not
//!   mark the timestamps observed: [`stat`] and [`fstat`].
//!
//!   Worse, a fine-grained timestamp taken for *any* file advances a clock floor shared
//!   by every file on the machine, so that the app's next write to its WAL sees a newer
//!   time too. A receiver on the same machine that stat-ed its position record before
//!   writing it, once per batch, cost the app's writer as much as a shipper stat-ing its
//!   WAL: measured here, an unrelated loop writing and stat-ing a file of its own cut the
//!   writer by a fifth. Production receivers run elsewhere, but a shipper and receiver
//!   on one machine (tests, benchmarks, a local standby) must not do it either.
//!
//! Every metadata read and file read on the shipper's and receiver's per-step paths goes
//! through here.

use std::fs::File;
use std::io;
use std::path::Path;

/// Open `path` read-only without updating its atime when read (see the module docs).
pub fn open(path: &Path) -> io::Result<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOATIME)
            .open(path)
        {
            // Not the file's owner: O_NOATIME is refused, read it the ordinary way.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            r => return r,
        }
    }
    File::open(path)
}

/// What the shipper needs of a file's metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meta {
    /// The device, encoded as `std::os::unix::fs::MetadataExt::dev` encodes it.
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
}

impl From<Meta> for crate::ship_state::FileId {
    fn from(m: Meta) -> Self {
        crate::ship_state::FileId {
            dev: m.dev,
            ino: m.ino,
        }
    }
}

/// `path`'s identity and length (following symlinks), timestamps untouched.
pub fn stat(path: &Path) -> io::Result<Meta> {
    imp::stat(path)
}

/// An open file's identity and length, timestamps untouched.
pub fn fstat(file: &File) -> io::Result<Meta> {
    imp::fstat(file)
}

#[cfg(target_os = "linux")]
mod imp {
    use super::Meta;
    use std::ffi::CString;
    use std::fs::File;
    use std::io;
    use std::mem::MaybeUninit;
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    pub fn stat(path: &Path) -> io::Result<Meta> {
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
        statx(libc::AT_FDCWD, &c, 0)
    }

    pub fn fstat(file: &File) -> io::Result<Meta> {
        statx(file.as_raw_fd(), c"", libc::AT_EMPTY_PATH)
    }

    fn statx(dirfd: libc::c_int, path: &std::ffi::CStr, flags: libc::c_int) -> io::Result<Meta> {
        let mut buf = MaybeUninit::<libc::statx>::zeroed();
        // SAFETY: `path` is a NUL-terminated string that outlives the call, and `buf`
        // points to a `statx` struct the kernel fills; neither is kept after the call.
        #[allow(unsafe_code)]
        let rc = unsafe {
            libc::statx(
                dirfd,
                path.as_ptr(),
                flags | libc::AT_STATX_SYNC_AS_STAT,
                libc::STATX_INO | libc::STATX_SIZE,
                buf.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: statx returned 0, so it wrote the struct (which was zeroed anyway, and
        // is plain integers).
        #[allow(unsafe_code)]
        let b = unsafe { buf.assume_init() };
        if b.stx_mask & (libc::STATX_INO | libc::STATX_SIZE) != libc::STATX_INO | libc::STATX_SIZE {
            return Err(io::Error::other(
                "the file system did not report an inode number and size",
            ));
        }
        Ok(Meta {
            dev: libc::makedev(b.stx_dev_major, b.stx_dev_minor),
            ino: b.stx_ino,
            len: b.stx_size,
        })
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::Meta;
    use std::fs::File;
    use std::io;
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    fn meta(m: std::fs::Metadata) -> Meta {
        Meta {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
        }
    }

    pub fn stat(path: &Path) -> io::Result<Meta> {
        std::fs::metadata(path).map(meta)
    }

    pub fn fstat(file: &File) -> io::Result<Meta> {
        file.metadata().map(meta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn agrees_with_std() {
        let dir = ferry_testkit::Scratch::new("quiet");
        let p = dir.path().join("f");
        std::fs::write(&p, b"hello").unwrap();
        let std_meta = std::fs::metadata(&p).unwrap();
        let want = Meta {
            dev: std_meta.dev(),
            ino: std_meta.ino(),
            len: 5,
        };
        assert_eq!(stat(&p).unwrap(), want);
        assert_eq!(fstat(&open(&p).unwrap()).unwrap(), want);
        assert_eq!(std::fs::read(&p).unwrap(), b"hello");
        assert_eq!(
            stat(&dir.path().join("missing")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }
}
