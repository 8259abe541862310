//! The demo's report: sentences for a person on stdout, or, with `--json`, the same
//! sentences on stderr and one JSON document on stdout at the end, holding the figures
//! each part recorded (`fact`) and whether every check held.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

static JSON: AtomicBool = AtomicBool::new(false);
/// Figures by part ("ship", "outbox", "flow", "sync"), in the order recorded.
static FACTS: Mutex<Vec<(&'static str, &'static str, serde_json::Value)>> = Mutex::new(Vec::new());

/// Report as JSON (on stdout at `finish`) rather than as sentences on stdout.
pub fn json(on: bool) {
    JSON.store(on, Ordering::Relaxed);
}

/// One sentence of the report.
pub fn say_line(line: std::fmt::Arguments<'_>) {
    if JSON.load(Ordering::Relaxed) {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

/// `say!("…", args)`: a sentence of the report.
macro_rules! say {
    () => { $crate::report::say_line(format_args!("")) };
    ($($arg:tt)*) => { $crate::report::say_line(format_args!($($arg)*)) };
}
pub(crate) use say;

/// Record a figure of `part` for the JSON report.
pub fn fact(part: &'static str, key: &'static str, value: impl serde::Serialize) {
    let value = serde_json::to_value(value).expect("a figure serializes");
    ferry_core::sync::lock(&FACTS).push((part, key, value));
}

/// With `--json`, print the document: `{"ok": …, "error": …, "<part>": {"<key>": …}}`.
pub fn finish(result: &anyhow::Result<()>) {
    if !JSON.load(Ordering::Relaxed) {
        return;
    }
    let mut doc = serde_json::Map::new();
    doc.insert("ok".into(), result.is_ok().into());
    if let Err(e) = result {
        doc.insert("error".into(), format!("{e:#}").into());
    }
    for (part, key, value) in ferry_core::sync::lock(&FACTS).drain(..) {
        let entry = doc
            .entry(part)
            .or_insert_with(|| serde_json::Value::Object(Default::default()));
        if let serde_json::Value::Object(m) = entry {
            m.insert(key.into(), value);
        }
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&doc).expect("the report serializes")
    );
}
