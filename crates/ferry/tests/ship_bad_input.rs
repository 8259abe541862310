//! Bad input gets a clear error and changes nothing: malformed flags, a non-SQLite file,
//! a wrong token, damaged and truncated bodies, an oversized body, unknown names, a
//! page-size mismatch, a base that is not a database.

mod common;

use common::*;
use ferry_ship::proto::{self, BaseHeader, RecordHeader};
use ferry_testkit::proc;
use ferry_testkit::wait_until;
use ferry_testkit::workload::{self, Writer, WriterConfig};
use std::time::Duration;

#[test]
fn malformed_flags_are_refused_with_what_and_where() {
    // (Written in the spellings before `ferry ship <verb>`: they must keep working.)
    let scratch = ferry_testkit::Scratch::new("flags");
    let dir = scratch.path().to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["ship", "--dir", dir, "--peer", "127.0.0.1:7350"],
            "needs a scheme",
        ),
        (
            &[
                "ship",
                "--dir",
                "/nonexistent/ferry",
                "--peer",
                "http://127.0.0.1:1",
            ],
            "/nonexistent/ferry",
        ),
        (
            &[
                "ship",
                "--dir",
                dir,
                "--peer",
                "http://127.0.0.1:1",
                "--db",
                "../x",
            ],
            "\"../x\"",
        ),
        (
            &[
                "ship",
                "--dir",
                dir,
                "--peer",
                "http://127.0.0.1:1",
                "--token-file",
                "/nonexistent/t",
            ],
            "token file",
        ),
        (
            &[
                "receive",
                "--dir",
                dir,
                "--listen",
                "127.0.0.1:1",
                "--max-body-bytes",
                "1000",
            ],
            "--max-body-bytes",
        ),
        (
            &["receive", "--dir", dir, "--listen", "not-an-address"],
            "--listen not-an-address",
        ),
        (
            &["promote", "--dir", dir, "nope", "--to", "/tmp/x.db"],
            "no replica named nope",
        ),
        (&["ship", "--dir", dir], "--peer"),
    ];
    for (args, expect) in cases {
        let (code, _, err) = proc::run(ferry(), args, &[]);
        assert_ne!(code, 0, "{args:?} succeeded");
        assert!(
            err.contains(expect),
            "{args:?}: the error does not say {expect:?}:\n{err}"
        );
    }
}

// Guards against one bad file in the directory stopping the others, or a wrong token
// writing anything.
#[test]
fn a_non_sqlite_file_and_a_wrong_token_are_reported_and_harm_nothing() {
    let mut rig = Rig::new("junk");
    std::fs::write(
        rig.db("junk"),
        b"this is not a database, just text that happens to end in .db",
    )
    .unwrap();
    rig.start_receiver();
    rig.start_shipper();
    let w = Writer::start(
        &rig.db("good"),
        WriterConfig {
            rate: 100,
            ..WriterConfig::default()
        },
    );
    assert!(w.wait_written(50, Duration::from_secs(30)));
    let last = w.stop();
    rig.wait_synced("good", last, Duration::from_secs(30));
    let junk = rig.db_status("junk").unwrap();
    assert!(
        junk.last_error
            .as_deref()
            .unwrap_or("")
            .contains("not a database"),
        "{junk:?}"
    );
    assert!(!rig.replica_path("junk").exists());
    assert_eq!(
        std::fs::read(rig.db("junk")).unwrap(),
        b"this is not a database, just text that happens to end in .db"
    );
    rig.stop_shipper();
    rig.stop_receiver();

    let mut rig = Rig::new("token");
    let good = rig.scratch.path().join("token");
    std::fs::write(&good, "right-token\n").unwrap();
    let bad = rig.scratch.path().join("bad-token");
    std::fs::write(&bad, "wrong-token\n").unwrap();
    rig.token_file = Some(good.clone());
    rig.start_receiver();
    rig.token_file = Some(bad);
    rig.start_shipper();
    let w = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 50,
            ..WriterConfig::default()
        },
    );
    assert!(wait_until(Duration::from_secs(20), || {
        rig.db_status("a")
            .and_then(|d| d.last_error)
            .is_some_and(|e| e.contains("token"))
    }));
    w.stop();
    rig.token_file = Some(good);
    assert!(
        rig.position("a").is_none(),
        "a wrong token created a replica"
    );
    let (status, body) = post(
        &format!(
            "{}/v1/replicas/a/txns?epoch=0&generation=1&page_size=4096",
            rig.receiver_url()
        ),
        b"x",
        None,
    );
    assert_eq!(status, 401, "{body}");
}

// Guards against a damaged, cut, oversized or misaddressed request changing a replica: each
// is refused with its reason before anything is applied.
#[test]
fn damaged_cut_oversized_and_misaddressed_requests_are_refused_and_change_nothing() {
    let mut rig = Rig::new("requests");
    rig.receive_args = vec!["--max-body-bytes".into(), (20 << 20).to_string()];
    rig.start_receiver();
    rig.start_shipper();
    let w = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 100,
            ..WriterConfig::default()
        },
    );
    assert!(w.wait_written(40, Duration::from_secs(30)));
    let last = w.stop();
    rig.wait_synced("a", last, Duration::from_secs(30));
    // From here on the test is the only client: a shipper racing the forged requests
    // below would be told its transactions are held.
    rig.stop_shipper();
    let pos = rig.position("a").unwrap();
    let digest = || ferry_ship::sqlite::digest(&rig.replica("a")).unwrap();
    let before = digest();
    let url = |tail: &str| format!("{}/v1/replicas/{tail}", rig.receiver_url());
    let q = format!(
        "epoch={}&generation={}&page_size={}",
        pos.epoch, pos.generation, pos.page_size
    );

    // A well-formed no-op transaction: page 2 rewritten with its own content.
    let page2: Vec<u8> = rig
        .replica("a")
        .query_row("SELECT data FROM sqlite_dbpage WHERE pgno = 2", [], |r| {
            r.get(0)
        })
        .unwrap();
    let mut body = Vec::new();
    let h = RecordHeader {
        seq: pos.seq + 1,
        part: 0,
        last: true,
        commit_pages: pos.pages,
        page_count: 1,
        observed_ms: 0,
        wal_checksum: 0,
    };
    proto::encode_record(&mut body, &h, [(2u32, page2.as_slice())]);

    let refused = |status: u16, text: &str, code: &str, want: &str| {
        assert_eq!(status, 400.max(status), "{text}");
        let r: proto::Refusal =
            serde_json::from_str(text).unwrap_or_else(|_| panic!("not a refusal: {text}"));
        assert_eq!(serde_json::to_value(r.code).unwrap(), code, "{text}");
        assert!(r.error.contains(want), "{text} lacks {want:?}");
    };
    let mut flipped = body.clone();
    flipped[100] ^= 1;
    let (s, t) = post(&url(&format!("a/txns?{q}")), &flipped, None);
    assert_eq!(s, 400);
    refused(s, &t, "corrupt", "CRC32C");
    let (s, t) = post(&url(&format!("a/txns?{q}")), &body[..body.len() - 7], None);
    assert_eq!(s, 400);
    refused(s, &t, "corrupt", "truncated");
    let (s, t) = post(&url(&format!("a/txns?{q}")), &vec![0u8; 21 << 20], None);
    assert_eq!(s, 413, "{t}");
    refused(s, &t, "too_large", "limit");
    let (s, t) = post(&url("a/txns"), &body, None);
    assert_eq!(s, 400, "{t}");
    let wrong_ps = format!(
        "epoch={}&generation={}&page_size=8192",
        pos.epoch, pos.generation
    );
    let (s, t) = post(&url(&format!("a/txns?{wrong_ps}")), &body, None);
    assert_eq!(s, 409, "{t}");
    refused(s, &t, "needs_base", "page size");
    let (s, t) = post(&url(&format!("nope/txns?{q}")), &body, None);
    assert_eq!(s, 409, "{t}");
    refused(s, &t, "needs_base", "no replica");
    let (s, t) = post(&url(&format!("..%2Fetc/txns?{q}")), &body, None);
    assert_eq!(s, 400, "{t}");
    let (s, t) = post(
        &url(&format!(
            "a/txns?epoch=0&generation=12345&page_size={}",
            pos.page_size
        )),
        &body,
        None,
    );
    assert_eq!(s, 409, "{t}");
    refused(s, &t, "needs_base", "generation");
    assert!(get_json::<proto::Position>(&url("nope"), None).is_none());

    // A base whose pages are not a database: refused after streaming, replica untouched.
    let header = BaseHeader {
        page_size: 4096,
        page_count: 2,
        epoch: pos.epoch,
        generation: 99,
        seq: 0,
        observed_ms: 0,
        wal_checksum: 0,
    };
    let mut base = header.encode().to_vec();
    let pages = vec![7u8; 8192];
    base.extend_from_slice(&pages);
    base.extend_from_slice(&proto::base_trailer(crc32c::crc32c(&pages)));
    let (s, t) = post(
        &url(&format!("a/base?epoch={}&generation=99", pos.epoch)),
        &base,
        None,
    );
    assert_eq!(s, 400, "{t}");
    refused(s, &t, "bad_request", "not a SQLite database");
    // A base cut short.
    let (s, t) = post(
        &url(&format!("a/base?epoch={}&generation=99", pos.epoch)),
        &base[..5000],
        None,
    );
    assert!(s == 400, "{s} {t}");

    assert_eq!(digest(), before, "a refused request changed the replica");
    assert_eq!(rig.position("a").unwrap().seq, pos.seq);
    workload::verify(&rig.replica("a")).unwrap();

    // The well-formed one goes through, and a resend of it is idempotent.
    let (s, t) = post(&url(&format!("a/txns?{q}")), &body, None);
    assert_eq!(s, 200, "{t}");
    let (s, t) = post(&url(&format!("a/txns?{q}")), &body, None);
    assert_eq!(s, 200, "{t}");
    assert_eq!(rig.position("a").unwrap().seq, pos.seq + 1);
    assert_eq!(digest(), before);
}
