//! `ferry flow list|show|signal|cancel|start|result --server URL`: the same commands as
//! on an engine's directory, through a flow server's HTTP API (docs/flow-server.md §10;
//! `ferry flow serve --http`). They answer from the server's index with no worker
//! connected; signals and cancels reach the run's holder through the server.

use crate::table;
use anyhow::Context;
use serde_json::{Value, json};
use std::time::Duration;

/// A flow server's HTTP API, as the CLI talks to it.
pub struct Client {
    base: String,
    token: Option<String>,
    agent: ureq::Agent,
}

impl Client {
    pub fn new(server: &str, token: Option<String>, timeout: Duration) -> anyhow::Result<Client> {
        let base = server.trim_end_matches('/');
        if !base.starts_with("http://") {
            anyhow::bail!(
                "--server {server:?}: give the server's HTTP API as http://HOST:PORT (its --http)"
            );
        }
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .new_agent();
        Ok(Client {
            base: base.to_string(),
            token,
            agent,
        })
    }

    /// One request (with an idempotency key if given); its JSON answer, or an error
    /// saying what the server said.
    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        key: Option<&str>,
    ) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.base);
        let mut headers = Vec::new();
        if let Some(t) = &self.token {
            headers.push(("Authorization", format!("Bearer {t}")));
        }
        if let Some(k) = key {
            headers.push(("Idempotency-Key", k.to_string()));
        }
        let sent = if method == "POST" {
            let mut r = self
                .agent
                .post(&url)
                .header("Content-Type", "application/json");
            for (h, v) in &headers {
                r = r.header(*h, v);
            }
            match body {
                Some(b) => r.send(b.to_string().as_str()),
                None => r.send_empty(),
            }
        } else {
            let mut r = self.agent.get(&url);
            for (h, v) in &headers {
                r = r.header(*h, v);
            }
            r.call()
        };
        let mut resp = sent.with_context(|| format!("cannot reach the flow server at {url}"))?;
        let status = resp.status();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if status.is_success() {
            return Ok(v);
        }
        let message = v
            .get("error")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| v.to_string());
        let hint = match status.as_u16() {
            401 => " (give the token with --token or FERRY_FLOW_TOKEN)",
            503 => " (transient: try again)",
            _ => "",
        };
        anyhow::bail!("the flow server answered {status}: {message}{hint}")
    }
}

fn path_part(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub fn list(c: &Client, state: Option<&str>, json_out: bool) -> anyhow::Result<()> {
    let mut runs: Vec<Value> = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut q = vec!["limit=1000".to_string()];
        if let Some(s) = state {
            q.push(format!("state={}", path_part(s)));
        }
        if let Some(a) = &after {
            q.push(format!("after={}", path_part(a)));
        }
        let page = c.request("GET", &format!("/v1/runs?{}", q.join("&")), None, None)?;
        runs.extend(page["runs"].as_array().cloned().unwrap_or_default());
        match page["next"].as_str() {
            Some(n) => after = Some(n.to_string()),
            None => break,
        }
    }
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "runs": runs }))?
        );
        return Ok(());
    }
    let by = |s: &str| runs.iter().filter(|r| r["state"] == s).count();
    println!(
        "{} runs: {} running, {} finished, {} failed, {} cancelled, {} parked\n",
        runs.len(),
        by("running"),
        by("finished"),
        by("failed"),
        by("cancelled"),
        by("parked")
    );
    let text = |v: &Value| v.as_str().map(str::to_string).unwrap_or_default();
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                text(&r["id"]),
                text(&r["workflow"]),
                r["generation"].to_string(),
                text(&r["state"]),
                r["shard"].to_string(),
                r.get("detail").map(crate::flow::short).unwrap_or_default(),
            ]
        })
        .collect();
    print!(
        "{}",
        table::render(
            &["RUN", "WORKFLOW", "GEN", "STATE", "SHARD", "DETAIL"],
            &rows
        )
    );
    Ok(())
}

pub fn show(c: &Client, id: &str, json_out: bool) -> anyhow::Result<()> {
    let r = c.request("GET", &format!("/v1/runs/{}", path_part(id)), None, None)?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    print!("{}", render(&r));
    Ok(())
}

fn render(r: &Value) -> String {
    let text = |v: &Value| crate::flow::pretty(v);
    let mut out = format!(
        "run        {}\nworkflow   {}\ngeneration {}\nstate      {}\nshard      {}\n",
        text(&r["id"]),
        text(&r["workflow"]),
        r["generation"],
        text(&r["state"]),
        r["shard"]
    );
    if let Some(p) = r.get("parent") {
        out.push_str(&format!("parent     {}\n", text(p)));
    }
    let label = match r["state"].as_str() {
        Some("finished") => "output",
        Some("failed") => "error",
        Some("parked") => "reason",
        _ => "detail",
    };
    if let Some(d) = r.get("detail") {
        out.push_str(&format!("{label:<10} {}\n", text(d)));
    }
    out
}

pub fn signal(
    c: &Client,
    id: &str,
    name: &str,
    value: Value,
    key: Option<&str>,
    json_out: bool,
) -> anyhow::Result<()> {
    let path = format!("/v1/runs/{}/signals/{}", path_part(id), path_part(name));
    c.request("POST", &path, Some(json!({ "value": value })), key)?;
    let message = format!("signal {name:?} delivered to run {id:?} (durable)");
    say(json_out, &message);
    Ok(())
}

pub fn cancel(c: &Client, id: &str, json_out: bool) -> anyhow::Result<()> {
    let r = c.request(
        "POST",
        &format!("/v1/runs/{}/cancel", path_part(id)),
        None,
        None,
    )?;
    let message = if r["cancelled"] == true {
        format!("run {id:?}: cancel requested (durable)")
    } else {
        format!("run {id:?} had already finished: nothing to cancel")
    };
    say(json_out, &message);
    Ok(())
}

pub fn start(
    c: &Client,
    workflow: &str,
    id: &str,
    input: Value,
    json_out: bool,
) -> anyhow::Result<()> {
    let body = json!({ "workflow": workflow, "id": id, "input": input });
    c.request("POST", "/v1/runs", Some(body), None)?;
    say(
        json_out,
        &format!("run {id:?} of {workflow:?} started (durable)"),
    );
    Ok(())
}

pub fn result(c: &Client, id: &str, wait_ms: u64, json_out: bool) -> anyhow::Result<()> {
    let until = std::time::Instant::now() + Duration::from_millis(wait_ms);
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        let poll = left.min(Duration::from_secs(20)).as_millis();
        let r = c.request(
            "GET",
            &format!("/v1/runs/{}/result?wait_ms={poll}", path_part(id)),
            None,
            None,
        )?;
        if r["state"] != "running" || left.is_zero() {
            if json_out {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", render(&r));
            }
            return Ok(());
        }
    }
}

fn say(json_out: bool, message: &str) {
    if json_out {
        println!(
            "{}",
            json!({ "ok": true, "queued": false, "message": message })
        );
    } else {
        println!("{message}");
    }
}
