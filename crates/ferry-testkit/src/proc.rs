//! Child processes a test can kill the hard way.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running child process whose stderr goes to a log file.
pub struct Proc {
    child: Child,
    log: PathBuf,
    name: String,
}

impl Proc {
    /// Start `program` with `args`; stderr (and stdout) append to `log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        log: &Path,
    ) -> Proc {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("opening the process log");
        let out = file.try_clone().expect("cloning the log handle");
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name} ({}): {e}", program.display()));
        Proc {
            child,
            log: log.to_path_buf(),
            name: name.to_string(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL and reap.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit; returns the exit status code.
    pub fn term(mut self, limit: Duration) -> Option<i32> {
        signal(self.child.id(), "TERM");
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        panic!(
            "{} did not exit within {limit:?} of SIGTERM; log:\n{}",
            self.name,
            self.log_text()
        );
    }

    /// SIGSTOP: the process stops where it is, its files as a crash would leave them.
    pub fn stop(&self) {
        signal(self.child.id(), "STOP");
    }

    /// SIGCONT.
    pub fn cont(&self) {
        signal(self.child.id(), "CONT");
    }

    /// Has it exited? Returns its code if so.
    pub fn exited(&mut self) -> Option<Option<i32>> {
        self.child.try_wait().ok().flatten().map(|s| s.code())
    }

    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Send a signal by name with kill(1), so the testkit needs no unsafe code.
pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

/// Run a command to completion and return (exit code, stdout, stderr).
pub fn run(program: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(program);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", program.display()));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
