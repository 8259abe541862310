//! Plain-text tables for status commands.

/// Render rows under a header, columns padded to their widest cell.
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(header.iter().map(|s| s.to_string()).collect());
    out.push('\n');
    for row in rows {
        out.push_str(&line(row.clone()));
        out.push('\n');
    }
    out
}

/// Bytes for people: 1.5 MiB.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The samples of a Prometheus text exposition (version 0.0.4) as JSON objects
/// `{"name", "labels": {..}, "value"}`, for `--json` on commands that print metrics.
/// Comment lines are skipped; a label value keeps its escapes undone (`\"`, `\\`,
/// `\n`); a line that does not parse is skipped rather than guessed at.
pub fn prometheus_samples(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(sample)
        .collect()
}

fn sample(line: &str) -> Option<serde_json::Value> {
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        None => (series, serde_json::Map::new()),
        Some((name, rest)) => (name, labels(rest.strip_suffix('}')?)?),
    };
    Some(serde_json::json!({ "name": name, "labels": labels, "value": value }))
}

/// `a="x",b="y"` (values quoted, with `\"`, `\\` and `\n` escaped).
fn labels(mut s: &str) -> Option<serde_json::Map<String, serde_json::Value>> {
    let mut out = serde_json::Map::new();
    while !s.is_empty() {
        let (key, rest) = s.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        out.insert(key.to_string(), value.into());
        s = rest[end + 1..]
            .strip_prefix(',')
            .unwrap_or(&rest[end + 1..]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_line_up() {
        let t = super::render(&["A", "BB"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    BB\nxyz  1\n");
        assert_eq!(super::bytes(1536), "1.5 KiB");
    }

    #[test]
    fn prometheus_text_becomes_samples() {
        let text = "# HELP x y\n# TYPE x counter\nx_total 3\nruns{state=\"a\\\"b\",k=\"v\"} 1.5\nbad line\n";
        let got = super::prometheus_samples(text);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0]["name"], "x_total");
        assert_eq!(got[0]["value"], 3.0);
        assert_eq!(got[1]["labels"]["state"], "a\"b");
        assert_eq!(got[1]["labels"]["k"], "v");
    }
}
