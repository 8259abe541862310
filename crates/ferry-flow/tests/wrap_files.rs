//! `EngineBuilder::wrap_files`: the engine's log reached through a storage wrapped around
//! its own files. Guards against a wrapped engine silently losing what an engine on
//! files has (the status file, a directory a plain engine reopens) or the wrapper being
//! bypassed, and against a wrapper given alongside a storage being ignored.

use ferry_flow::{Ctx, Engine, FlowError, Workflow};
use ferry_log::{FileStorage, Storage};
use ferry_testkit::Scratch;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

static W: Workflow<u32, u32> = Workflow::new("w");

/// Counts the syncs it passes on to the files.
struct Counting {
    files: FileStorage,
    syncs: Arc<AtomicU64>,
}

impl Storage for Counting {
    fn list(&self) -> io::Result<Vec<String>> {
        self.files.list()
    }
    fn create(&self, name: &str) -> io::Result<()> {
        self.files.create(name)
    }
    fn len(&self, name: &str) -> io::Result<u64> {
        self.files.len(name)
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.files.read_at(name, offset, buf)
    }
    fn write_at(&self, name: &str, offset: u64, data: &[u8]) -> io::Result<()> {
        self.files.write_at(name, offset, data)
    }
    fn sync(&self, name: &str) -> io::Result<()> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        self.files.sync(name)
    }
    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        self.files.truncate(name, len)
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.files.remove(name)
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.files.sync_dir()
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.files.rename(from, to)
    }
}

fn builder(dir: &std::path::Path) -> ferry_flow::EngineBuilder {
    Engine::builder(dir).register(W, |ctx: Ctx, n: u32| async move {
        let a: u32 = ctx.step("s0", move |_| async move { Ok(n + 1) }).await?;
        Ok(a * 2)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrapped_engine_keeps_its_files_and_syncs_through_the_wrapper() {
    let scratch = Scratch::new("flow-wrap");
    let dir = scratch.dir("flow");
    let syncs = Arc::new(AtomicU64::new(0));
    let counted = syncs.clone();
    let engine = builder(&dir)
        .wrap_files(move |files| {
            Arc::new(Counting {
                files,
                syncs: counted,
            })
        })
        .open()
        .unwrap();
    let h = engine.start(W, "r", &20).await.unwrap();
    assert_eq!(h.result().await.unwrap(), 42);
    assert!(
        syncs.load(Ordering::SeqCst) > 0,
        "the log synced past the wrapper"
    );
    drop(engine);
    assert!(
        dir.join("status.json").exists(),
        "a wrapped engine keeps its status file"
    );
    // The same files, opened plainly: the run's result is there.
    let engine = builder(&dir).open().unwrap();
    assert_eq!(engine.run::<u32>("r").unwrap().result().await.unwrap(), 42);
}

#[test]
fn a_wrapper_with_a_storage_of_its_own_is_refused() {
    let scratch = Scratch::new("flow-wrap-refused");
    let dir = scratch.dir("flow");
    let other = scratch.dir("other");
    let err = builder(&dir)
        .storage(Arc::new(FileStorage::open(&other).unwrap()))
        .wrap_files(|files| Arc::new(files))
        .open()
        .err()
        .expect("refused");
    assert!(
        matches!(&err, FlowError::Config(c) if c.setting == "wrap_files"),
        "{err}"
    );
}
