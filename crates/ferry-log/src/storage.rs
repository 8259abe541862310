//! The seam between the log and the disk (docs/log.md §3). `FileStorage` is the real
//! thing; `crate::sim::SimStorage` keeps only what a completed sync made durable, for
//! tests that crash the log at any step.
//!
//! All names are plain file names in the log's one directory.

use ferry_core::fs::DirLock;
use ferry_core::sync::lock;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub trait Storage: Send + Sync + 'static {
    /// The names of the files in the directory.
    fn list(&self) -> io::Result<Vec<String>>;
    /// Create an empty file; an error if it exists. The name is durable after `sync_dir`.
    fn create(&self, name: &str) -> io::Result<()>;
    fn len(&self, name: &str) -> io::Result<u64>;
    /// Fill `buf` from `offset` as far as the file goes; how many bytes were read.
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
    fn write_at(&self, name: &str, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Make the file's contents and length durable (fdatasync).
    fn sync(&self, name: &str) -> io::Result<()>;
    fn truncate(&self, name: &str, len: u64) -> io::Result<()>;
    /// Remove a file; durable after `sync_dir`.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Make creations, removals and renames durable (fsync of the directory).
    fn sync_dir(&self) -> io::Result<()>;
    /// Rename `from` to `to` (which must not exist), atomically; durable after
    /// `sync_dir`. A storage without it keeps no spare segments (docs/log.md §3): the
    /// log removes what it retires and creates every segment anew.
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let _ = (from, to);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this storage cannot rename",
        ))
    }
}

/// Files in a directory, locked against a second process opening the same log.
pub struct FileStorage {
    dir: PathBuf,
    files: Mutex<HashMap<String, Arc<File>>>,
    _lock: DirLock,
}

impl FileStorage {
    /// Create `dir` if needed and lock it.
    pub fn open(dir: &Path) -> io::Result<FileStorage> {
        std::fs::create_dir_all(dir)?;
        let lock = DirLock::try_acquire(&dir.join("lock"), "another process using this log")
            .map_err(|e| io::Error::new(io::ErrorKind::ResourceBusy, e.to_string()))?;
        Ok(FileStorage {
            dir: dir.to_path_buf(),
            files: Mutex::new(HashMap::new()),
            _lock: lock,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn file(&self, name: &str) -> io::Result<Arc<File>> {
        let mut files = lock(&self.files);
        if let Some(f) = files.get(name) {
            return Ok(f.clone());
        }
        let f = Arc::new(
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(self.dir.join(name))?,
        );
        files.insert(name.to_string(), f.clone());
        Ok(f)
    }
}

impl Storage for FileStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            if let Some(n) = e?.file_name().to_str() {
                out.push(n.to_string());
            }
        }
        Ok(out)
    }

    fn create(&self, name: &str) -> io::Result<()> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(self.dir.join(name))?;
        lock(&self.files).insert(name.to_string(), Arc::new(f));
        Ok(())
    }

    fn len(&self, name: &str) -> io::Result<u64> {
        Ok(self.file(name)?.metadata()?.len())
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let f = self.file(name)?;
        let mut filled = 0;
        while filled < buf.len() {
            match f.read_at(&mut buf[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(filled)
    }

    fn write_at(&self, name: &str, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file(name)?.write_all_at(data, offset)
    }

    fn sync(&self, name: &str) -> io::Result<()> {
        self.file(name)?.sync_data()
    }

    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        self.file(name)?.set_len(len)
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        lock(&self.files).remove(name);
        std::fs::remove_file(self.dir.join(name))
    }

    fn sync_dir(&self) -> io::Result<()> {
        ferry_core::fs::fsync_dir(&self.dir)
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let (a, b) = (self.dir.join(from), self.dir.join(to));
        // The directory is locked to this process, so nothing appears in between.
        match std::fs::symlink_metadata(&b) {
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{to} exists"),
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::rename(a, b)?;
        let mut files = lock(&self.files);
        if let Some(f) = files.remove(from) {
            files.insert(to.to_string(), f);
        }
        Ok(())
    }
}
