//! The command-line grammar, one for every engine (ARCHITECTURE.md, "The command line"):
//!
//! 1. `ferry <engine> <verb> [flags]`: `ship send|status|receive|replicas|promote`,
//!    `outbox install|relay|status|requeue|discard|pause|resume`,
//!    `flow list|show|metrics|signal|cancel`,
//!    `sync check|install|enroll|serve|status|replica [status]`, and `demo`.
//! 2. Every long flag `--some-flag` of `ferry <engine> …` can come from the environment as
//!    `FERRY_<ENGINE>_SOME_FLAG` ([`with_env`] sets this on the parsed command, so no
//!    flag can break the rule); the shared ones are `FERRY_LOG` and `FERRY_LOG_FORMAT`.
//! 3. Durations are milliseconds, with `-ms` ending the flag's name.
//! 4. Every command that prints takes `--json`.
//!
//! The spellings before this grammar still work, with a warning: [`rewrite_aliases`] turns
//! `ferry ship --dir …` into `ferry ship send --dir …`, `ferry receive …` into `ferry ship
//! receive …`, `ferry receive status` into `ferry ship replicas`, and `ferry promote` into
//! `ferry ship promote`; [`read_old_variables`] reads an old variable name when its new
//! one is unset.

use clap::Command;
use std::ffi::OsString;

/// Engines whose flags read `FERRY_<ENGINE>_<FLAG>`, by subcommand name.
const ENGINES: [(&str, &str); 6] = [
    ("ship", "SHIP"),
    ("outbox", "OUTBOX"),
    ("sync", "SYNC"),
    ("flow", "FLOW"),
    ("demo", "DEMO"),
    ("demo-flow-engine", "DEMO"),
];

/// Flags that take no value from the environment: asking for help, or for JSON output,
/// is a choice made at the keyboard (a stray `FERRY_OUTBOX_JSON` would change what a
/// script parses).
const NO_ENV: [&str; 3] = ["help", "version", "json"];

/// Set `FERRY_<ENGINE>_<FLAG>` as the environment variable of every long flag of every
/// engine's commands.
pub fn with_env(mut cmd: Command) -> Command {
    for (name, engine) in ENGINES {
        if cmd.find_subcommand(name).is_some() {
            cmd = cmd.mut_subcommand(name, |sub| env_all(sub, engine));
        }
    }
    cmd
}

fn env_all(mut cmd: Command, engine: &'static str) -> Command {
    let ids: Vec<(String, String)> = cmd
        .get_arguments()
        .filter_map(|a| {
            let long = a.get_long()?;
            (!NO_ENV.contains(&long) && !a.is_hide_set())
                .then(|| (a.get_id().to_string(), env_name(engine, long)))
        })
        .collect();
    for (id, env) in ids {
        // The names live as long as the process: a few dozen short strings.
        let env: &'static str = Box::leak(env.into_boxed_str());
        cmd = cmd.mut_arg(id, |a| a.env(env));
    }
    let subs: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    for s in subs {
        cmd = cmd.mut_subcommand(s, |sub| env_all(sub, engine));
    }
    cmd
}

/// `--some-flag` of engine `SHIP`: `FERRY_SHIP_SOME_FLAG`.
pub fn env_name(engine: &str, long: &str) -> String {
    format!(
        "FERRY_{engine}_{}",
        long.to_ascii_uppercase().replace('-', "_")
    )
}

/// The command line with the spellings before the grammar turned into today's, and a
/// warning for each one turned.
pub fn rewrite_aliases(args: Vec<OsString>) -> (Vec<OsString>, Option<String>) {
    let word = |i: usize| args.get(i).and_then(|a| a.to_str()).unwrap_or("");
    let is_flag = |s: &str| s.starts_with('-') && s != "-h" && s != "--help";
    let (cut, with): (usize, &[&str]) = match (word(1), word(2)) {
        // `ferry ship --dir …` (the shipper, before it was a verb); `ferry ship` alone
        // runs it too when its directory comes from the environment.
        ("ship", w) if is_flag(w) => (2, &["ship", "send"]),
        ("ship", "") if ship_dir_in_env() => (2, &["ship", "send"]),
        ("receive", "status") => (3, &["ship", "replicas"]),
        ("receive", _) => (2, &["ship", "receive"]),
        ("promote", _) => (2, &["ship", "promote"]),
        _ => return (args, None),
    };
    let old: Vec<&str> = (1..cut).map(word).collect();
    let warning = format!(
        "`ferry {}` is now `ferry {}`: the old spelling works but may go",
        old.join(" "),
        with.join(" ")
    );
    let mut out = vec![args[0].clone()];
    out.extend(with.iter().map(OsString::from));
    out.extend(args.into_iter().skip(cut));
    (out, Some(warning))
}

fn ship_dir_in_env() -> bool {
    std::env::var_os("FERRY_SHIP_DIR").is_some() || std::env::var_os("FERRY_DIR").is_some()
}

/// Variables named before the one rule, and the names that replaced them. A variable
/// that several engines read becomes each of theirs.
const OLD_VARIABLES: &[(&str, &[&str])] = &[
    ("FERRY_DIR", &["FERRY_SHIP_DIR"]),
    ("FERRY_PEER", &["FERRY_SHIP_PEER"]),
    ("FERRY_TOKEN_FILE", &["FERRY_SHIP_TOKEN_FILE"]),
    ("FERRY_EPOCH", &["FERRY_SHIP_EPOCH"]),
    ("FERRY_WORKERS", &["FERRY_SHIP_WORKERS"]),
    ("FERRY_WAL_MAX_BYTES", &["FERRY_SHIP_WAL_MAX_BYTES"]),
    ("FERRY_FOLD_MIN_FRAMES", &["FERRY_SHIP_FOLD_MIN_FRAMES"]),
    ("FERRY_LISTEN", &["FERRY_SHIP_LISTEN"]),
    ("FERRY_MAX_BODY_BYTES", &["FERRY_SHIP_MAX_BODY_BYTES"]),
    ("FERRY_MAX_BASE_BYTES", &["FERRY_SHIP_MAX_BASE_BYTES"]),
    ("FERRY_NO_BASE_CHECK", &["FERRY_SHIP_NO_BASE_CHECK"]),
    ("FERRY_RECEIVE_URL", &["FERRY_SHIP_URL"]),
    (
        "FERRY_METRICS_LISTEN",
        &["FERRY_SHIP_METRICS_LISTEN", "FERRY_OUTBOX_METRICS_LISTEN"],
    ),
    ("FERRY_DB", &["FERRY_OUTBOX_DB"]),
    ("FERRY_TO", &["FERRY_OUTBOX_TO"]),
    ("FERRY_NATS_STREAM", &["FERRY_OUTBOX_STREAM"]),
    ("FERRY_WEBHOOK_SECRET_FILE", &["FERRY_OUTBOX_SECRET_FILE"]),
    ("FERRY_LANES", &["FERRY_OUTBOX_LANES"]),
    ("FERRY_BATCH", &["FERRY_OUTBOX_BATCH"]),
    ("FERRY_WINDOW", &["FERRY_OUTBOX_WINDOW"]),
    ("FERRY_LEASE_MS", &["FERRY_OUTBOX_LEASE_MS"]),
    ("FERRY_MAX_ATTEMPTS", &["FERRY_OUTBOX_MAX_ATTEMPTS"]),
    ("FERRY_POLL_MS", &["FERRY_OUTBOX_POLL_MS"]),
    (
        "FERRY_PUBLISH_TIMEOUT_MS",
        &["FERRY_OUTBOX_PUBLISH_TIMEOUT_MS"],
    ),
    ("FERRY_TIMEOUT_MS", &["FERRY_FLOW_TIMEOUT_MS"]),
];

/// Old variables whose value was taken up under a new name, as a warning to log once
/// logging is set up. Call before any thread starts: it sets variables of this process.
pub fn read_old_variables() -> Vec<String> {
    let mut warnings = Vec::new();
    for (old, new) in OLD_VARIABLES {
        let Some(value) = std::env::var_os(old) else {
            continue;
        };
        let taken: Vec<&str> = new
            .iter()
            .copied()
            .filter(|n| std::env::var_os(n).is_none())
            .collect();
        for n in &taken {
            // SAFETY: called first thing in `main`, before any other thread exists, so
            // nothing reads the environment while it changes.
            unsafe { std::env::set_var(n, &value) };
        }
        if !taken.is_empty() {
            warnings.push(format!(
                "{old} is now {}: the old name is read when the new one is unset",
                new.join(" and ")
            ));
        }
    }
    warnings
}

/// How one engine's library settings are spelled on its command line: library errors
/// name settings (`ConfigError::setting`), a person typed flags.
pub struct Flags(pub &'static [(&'static str, &'static str)]);

impl Flags {
    /// The flag that gives `setting` (the setting itself if no flag does).
    pub fn of<'a>(&self, setting: &'a str) -> &'a str {
        self.0
            .iter()
            .find(|(s, _)| *s == setting)
            .map_or(setting, |&(_, flag)| flag)
    }

    /// The error's reason with every other setting it names spelled as its flag. Only
    /// settings of more than one word: a one-word one ("dir", "names", "nice") is also
    /// an English word, which the reason may use as one.
    pub fn reason(&self, e: &ferry_core::ConfigError) -> String {
        let mut reason = e.reason.clone();
        for (setting, flag) in self.0.iter().filter(|(s, _)| s.contains('_')) {
            reason = reason.replace(setting, flag);
        }
        reason
    }

    /// A setting's error as a person reads it: `--batch 0: must be between 1 and 10000`.
    /// `given`: the flag's value as typed, when the command has it (else the value as
    /// the library holds it).
    pub fn error(&self, e: &ferry_core::ConfigError, given: Option<String>) -> anyhow::Error {
        anyhow::anyhow!(
            "{} {}: {}",
            self.of(e.setting),
            given.unwrap_or_else(|| e.value.clone()),
            self.reason(e)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewrite(line: &str) -> (String, bool) {
        let args = line.split(' ').map(OsString::from).collect();
        let (out, warning) = rewrite_aliases(args);
        let out: Vec<String> = out.into_iter().map(|a| a.into_string().unwrap()).collect();
        (out.join(" "), warning.is_some())
    }

    #[test]
    fn old_spellings_become_verbs_of_ship() {
        assert_eq!(
            rewrite("ferry ship --dir d --peer p"),
            ("ferry ship send --dir d --peer p".into(), true)
        );
        assert_eq!(
            rewrite("ferry ship status --dir d"),
            ("ferry ship status --dir d".into(), false)
        );
        assert_eq!(
            rewrite("ferry ship --help"),
            ("ferry ship --help".into(), false)
        );
        assert_eq!(
            rewrite("ferry receive --dir d --listen a"),
            ("ferry ship receive --dir d --listen a".into(), true)
        );
        assert_eq!(
            rewrite("ferry receive status --url u"),
            ("ferry ship replicas --url u".into(), true)
        );
        assert_eq!(
            rewrite("ferry promote --dir d n --to t"),
            ("ferry ship promote --dir d n --to t".into(), true)
        );
        assert_eq!(
            rewrite("ferry outbox status --db x"),
            ("ferry outbox status --db x".into(), false)
        );
    }

    #[test]
    fn a_flag_reads_the_variable_of_its_engine() {
        assert_eq!(
            env_name("SHIP", "wal-max-bytes"),
            "FERRY_SHIP_WAL_MAX_BYTES"
        );
        let cmd = with_env(
            Command::new("ferry").subcommand(
                Command::new("outbox").subcommand(
                    Command::new("relay")
                        .arg(clap::Arg::new("lease_ms").long("lease-ms"))
                        .arg(
                            clap::Arg::new("json")
                                .long("json")
                                .action(clap::ArgAction::SetTrue),
                        ),
                ),
            ),
        );
        let relay = cmd
            .find_subcommand("outbox")
            .and_then(|o| o.find_subcommand("relay"))
            .unwrap();
        let env = |id: &str| {
            relay
                .get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env())
                .map(|e| e.to_string_lossy().into_owned())
        };
        assert_eq!(env("lease_ms").as_deref(), Some("FERRY_OUTBOX_LEASE_MS"));
        assert_eq!(env("json"), None);
    }
}
