//! The replica applies messages to a real SQLite file: whole or not at all, only what
//! continues its chain, rows its own schema refuses set aside as rejections, rows its own
//! rows reference retired, sweeps removing what a snapshot did not name, and digests that
//! agree between replicas holding the same rows. Each test says what it guards first.

use ferry_core::Classify;
use ferry_sync::replica::{
    Downlink, Position, Received, Replica, RunEnd, RunSettings, Standing, TransportError,
};
use ferry_sync::value::{Affinity, Value};
use ferry_sync::wire::{self, ChainHead, Column, Down, Sweep, TablePart, Up};
use ferry_testkit::Scratch;
use rusqlite::Connection;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SEAL_KEY: [u8; 32] = [7; 32];
const SECRET: [u8; 32] = [9; 32];

// ---- building messages -------------------------------------------------------------

fn col(name: &str, affinity: Affinity, key_part: u8, not_null: bool) -> Column {
    Column {
        name: name.into(),
        affinity,
        not_null,
        key_part,
    }
}

fn item_columns() -> Vec<Column> {
    vec![
        col("id", Affinity::Integer, 1, true),
        col("name", Affinity::Text, 0, true),
        col("qty", Affinity::Integer, 0, false),
    ]
}

fn item(id: i64, name: &str, qty: i64) -> Vec<Value> {
    vec![Value::Int(id), Value::Text(name.into()), Value::Int(qty)]
}

fn key(id: i64) -> Vec<Value> {
    vec![Value::Int(id)]
}

fn part(
    table: &str,
    columns: Vec<Column>,
    upserts: Vec<Vec<Value>>,
    deletes: Vec<Vec<Value>>,
) -> TablePart {
    TablePart {
        table: table.into(),
        columns,
        sweep: Sweep::default(),
        deletes,
        upserts,
        writes: None,
    }
}

fn items(upserts: Vec<Vec<Value>>, deletes: Vec<Vec<Value>>) -> TablePart {
    part("items", item_columns(), upserts, deletes)
}

/// A chain of messages as the server numbers them.
struct Chain {
    epoch: [u8; 16],
    seq: u64,
    nonce: u64,
}

impl Chain {
    fn new(epoch: u8) -> Chain {
        Chain {
            epoch: [epoch; 16],
            seq: 0,
            nonce: 0,
        }
    }

    /// The next message; `start` makes it a chain start (prev 0).
    fn message(&mut self, start: bool, parts: Vec<TablePart>) -> Down {
        let (prev, prev_nonce) = if start {
            (0, 0)
        } else {
            (self.seq, self.nonce)
        };
        self.seq += 1;
        self.nonce = self.seq * 1_000 + 7;
        let head = ChainHead {
            replica: [1; 16],
            epoch: self.epoch,
            seq: self.seq,
            nonce: self.nonce,
            prev,
            prev_nonce,
        };
        let stamp = wire::stamp(
            &SECRET,
            &head.replica,
            &head.epoch,
            head.seq,
            head.nonce,
            &[0; 32],
        );
        Down {
            head,
            parts,
            stamp,
            body_hash: [self.seq as u8; 32],
        }
    }

    fn start(&mut self, parts: Vec<TablePart>) -> Down {
        self.message(true, parts)
    }

    fn next(&mut self, parts: Vec<TablePart>) -> Down {
        self.message(false, parts)
    }
}

/// A message as a sealed frame, as the server sends it.
fn frame(down: &Down, seal_key: &[u8; 32]) -> Vec<u8> {
    wire::encode_down(&down.head, &down.parts, &SECRET, seal_key)
        .expect("encodable")
        .0
}

// ---- reading the replica -----------------------------------------------------------

fn open(path: &Path) -> Replica {
    Replica::open(path, SEAL_KEY).expect("opening the replica")
}

fn db(scratch: &Scratch) -> PathBuf {
    scratch.path().join("replica.db")
}

fn rows(conn: &Connection, sql: &str) -> Vec<Vec<Value>> {
    let mut stmt = conn.prepare(sql).unwrap();
    let n = stmt.column_count();
    let mut out = Vec::new();
    let mut cursor = stmt.query([]).unwrap();
    while let Some(r) = cursor.next().unwrap() {
        out.push(
            (0..n)
                .map(|i| match r.get_ref(i).unwrap() {
                    rusqlite::types::ValueRef::Null => Value::Null,
                    rusqlite::types::ValueRef::Integer(v) => Value::Int(v),
                    rusqlite::types::ValueRef::Real(v) => Value::Real(v),
                    rusqlite::types::ValueRef::Text(v) => {
                        Value::Text(String::from_utf8(v.to_vec()).unwrap())
                    }
                    rusqlite::types::ValueRef::Blob(v) => Value::Blob(v.to_vec()),
                })
                .collect(),
        );
    }
    out
}

fn items_in(conn: &Connection) -> Vec<Vec<Value>> {
    rows(conn, "SELECT id, name, qty FROM items ORDER BY id")
}

fn applied(r: Received) -> Vec<(String, usize)> {
    match r {
        Received::Applied { tables, .. } => tables,
        other => panic!("expected Applied, got {other:?}"),
    }
}

fn seq_of(replica: &Replica) -> u64 {
    replica.status().unwrap().seq
}

// ---- the chain ---------------------------------------------------------------------

/// Guards: a chain start creates the tables its parts describe (affinities, NOT NULL,
/// the key) and later messages that follow apply on top, against a model of the rows.
#[test]
fn a_chain_start_creates_tables_and_following_messages_apply() {
    let scratch = Scratch::new("replica-chain");
    let mut replica = open(&db(&scratch));
    assert_eq!(
        replica.status().unwrap().standing,
        Some(Standing::NotProvisioned)
    );
    let mut chain = Chain::new(1);
    let mut start = chain.start(vec![
        items(vec![item(1, "nut", 10), item(2, "bolt", 5)], vec![]),
        part(
            "lines",
            vec![
                col("order_id", Affinity::Integer, 1, true),
                col("line", Affinity::Integer, 2, true),
                col("item_id", Affinity::Integer, 0, false),
                col("price", Affinity::Real, 0, false),
            ],
            vec![vec![
                Value::Int(9),
                Value::Int(1),
                Value::Int(1),
                Value::Real(2.5),
            ]],
            vec![],
        ),
    ]);
    start.parts[0].sweep = Sweep {
        start: true,
        end: true,
    };
    let taken = applied(replica.receive_down(start).unwrap());
    assert_eq!(
        taken,
        vec![("items".to_string(), 2), ("lines".to_string(), 1)]
    );
    let conn = replica.conn();
    let ddl: String = conn
        .query_row(
            "SELECT sql FROM sqlite_schema WHERE name = 'items'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(
        ddl.contains("\"name\" TEXT NOT NULL") && ddl.contains("PRIMARY KEY(\"id\")"),
        "{ddl}"
    );
    let keyed: Vec<Vec<Value>> = rows(
        conn,
        "SELECT name FROM pragma_table_info('lines') WHERE pk > 0 ORDER BY pk",
    );
    assert_eq!(
        keyed,
        vec![
            vec![Value::Text("order_id".into())],
            vec![Value::Text("line".into())]
        ]
    );

    let mut model =
        std::collections::BTreeMap::from([(1, item(1, "nut", 10)), (2, item(2, "bolt", 5))]);
    for round in 0..5i64 {
        let id = 3 + round;
        let down = chain.next(vec![items(
            vec![item(id, "washer", round), item(1, "nut", 10 + round)],
            vec![key(2)],
        )]);
        model.insert(id, item(id, "washer", round));
        model.insert(1, item(1, "nut", 10 + round));
        model.remove(&2);
        applied(replica.receive_down(down).unwrap());
        assert_eq!(
            items_in(replica.conn()),
            model.values().cloned().collect::<Vec<_>>()
        );
    }
    let status = replica.status().unwrap();
    assert_eq!((status.seq, status.gap, status.standing), (6, 0, None));
    assert_eq!(status.standing(Some(1), true, 2, 10), Standing::Synced);
    let up = replica.up().unwrap();
    assert_eq!(up.applied.unwrap().seq, 6);
    assert_eq!(up.digests.len(), 2);
}

/// Guards: a redelivered message (or an older one, or a renumbered one at the same seq)
/// is acknowledged and not applied again, so it cannot undo later changes.
#[test]
fn redelivery_is_already_applied_and_changes_nothing() {
    let scratch = Scratch::new("replica-redelivery");
    let mut replica = open(&db(&scratch));
    let mut chain = Chain::new(1);
    let first = chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]);
    let second = chain.next(vec![items(vec![item(1, "nut", 2)], vec![])]);
    applied(replica.receive_down(first.clone()).unwrap());
    applied(replica.receive_down(second.clone()).unwrap());
    assert_eq!(
        replica.receive_down(second.clone()).unwrap(),
        Received::AlreadyApplied { seq: 2 }
    );
    assert_eq!(
        replica.receive_down(first).unwrap(),
        Received::AlreadyApplied { seq: 1 }
    );
    let mut renumbered = second;
    renumbered.head.nonce += 1;
    renumbered.parts = vec![items(vec![item(1, "nut", 99)], vec![])];
    assert_eq!(
        replica.receive_down(renumbered).unwrap(),
        Received::AlreadyApplied { seq: 2 }
    );
    assert_eq!(items_in(replica.conn()), vec![item(1, "nut", 2)]);
    assert_eq!(replica.status().unwrap().gap, 0);
}

/// Guards: a message that does not follow is a gap: it applies nothing and the report
/// says so (no digests meanwhile); the message that does follow still applies, and
/// clears the gap, so a redelivery heals it (docs/sync-protocol.md §1.2).
#[test]
fn a_gap_applies_nothing_and_the_missing_message_heals_it() {
    let scratch = Scratch::new("replica-gap");
    let mut replica = open(&db(&scratch));
    let mut chain = Chain::new(1);
    applied(
        replica
            .receive_down(chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]))
            .unwrap(),
    );
    let skipped = chain.next(vec![items(vec![item(2, "bolt", 1)], vec![])]);
    let third = chain.next(vec![items(vec![item(3, "gear", 1)], vec![])]);
    assert_eq!(
        replica.receive_down(third.clone()).unwrap(),
        Received::Gap { seq: 3 }
    );
    assert_eq!(items_in(replica.conn()), vec![item(1, "nut", 1)]);
    let up = replica.up().unwrap();
    assert_eq!(
        (up.gap, up.applied.unwrap().seq, up.digests.len()),
        (3, 1, 0)
    );
    assert_eq!(
        replica.status().unwrap().standing,
        Some(Standing::AwaitingFix)
    );
    applied(replica.receive_down(skipped).unwrap());
    applied(replica.receive_down(third).unwrap());
    assert_eq!(
        items_in(replica.conn()),
        vec![item(1, "nut", 1), item(2, "bolt", 1), item(3, "gear", 1)]
    );
    assert_eq!(replica.up().unwrap().gap, 0);

    // A chain start after a gap applies too.
    let gap = chain.next(vec![items(vec![item(5, "cam", 1)], vec![])]);
    let _ = chain.next(vec![]);
    let later = chain.next(vec![items(vec![item(6, "rod", 1)], vec![])]);
    let _ = gap;
    assert!(matches!(
        replica.receive_down(later).unwrap(),
        Received::Gap { .. }
    ));
    let mut snapshot = chain.start(vec![items(
        vec![item(1, "nut", 1), item(4, "cog", 1)],
        vec![],
    )]);
    snapshot.parts[0].sweep = Sweep {
        start: true,
        end: true,
    };
    applied(replica.receive_down(snapshot).unwrap());
    assert_eq!(
        items_in(replica.conn()),
        vec![item(1, "nut", 1), item(4, "cog", 1)]
    );
    let up = replica.up().unwrap();
    assert_eq!(
        (up.gap, up.applied.unwrap().seq, up.digests.len()),
        (0, 7, 1)
    );
}

/// Guards: a frame with a bad seal changes nothing but the gap (the chain cannot continue
/// past it); a later protocol changes nothing at all, not even the gap.
#[test]
fn refused_frames_are_gaps_and_a_later_protocol_is_not() {
    let scratch = Scratch::new("replica-refused");
    let mut replica = open(&db(&scratch));
    let mut chain = Chain::new(1);
    let start = frame(
        &chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]),
        &SEAL_KEY,
    );
    applied(replica.receive(&start).unwrap());
    let next = frame(
        &chain.next(vec![items(vec![item(1, "nut", 2)], vec![])]),
        &SEAL_KEY,
    );
    let mut later = next.clone();
    later[4..6].copy_from_slice(&2u16.to_be_bytes());
    assert_eq!(replica.receive(&later).unwrap(), Received::LaterProtocol(2));
    assert_eq!(replica.status().unwrap().gap, 0);

    let forged = frame(
        &chain.next(vec![items(vec![item(1, "nut", 3)], vec![])]),
        &[8; 32],
    );
    match replica.receive(&forged).unwrap() {
        Received::Refused { reason } => assert!(reason.contains("seal"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(replica.status().unwrap().gap, 2);
    assert_eq!(items_in(replica.conn()), vec![item(1, "nut", 1)]);
}

/// Guards: a message naming a reserved table, or keyed differently from the replica's
/// table, is refused whole (a gap), with nothing created.
#[test]
fn a_message_that_does_not_fit_the_replica_is_refused_whole() {
    let scratch = Scratch::new("replica-unfit");
    let mut replica = open(&db(&scratch));
    replica
        .conn()
        .execute_batch("CREATE TABLE items(code TEXT PRIMARY KEY, name TEXT, qty INTEGER)")
        .unwrap();
    let mut chain = Chain::new(1);
    let down = chain.start(vec![
        part("other", item_columns(), vec![item(1, "x", 1)], vec![]),
        items(vec![], vec![]),
    ]);
    match replica.receive_down(down).unwrap() {
        Received::Refused { reason } => assert!(reason.contains("keyed by"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    let made: i64 = replica
        .conn()
        .query_row(
            "SELECT COUNT(*) FROM sqlite_schema WHERE name = 'other'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!((made, replica.status().unwrap().gap), (0, 1));
}

// ---- rows ----------------------------------------------------------------------------

/// Guards: deletes of a message run before its upserts, so a unique value the replica
/// enforces can move from a deleted row to a new one in one message.
#[test]
fn deletes_go_before_upserts_so_a_unique_value_can_move() {
    let scratch = Scratch::new("replica-unique");
    let mut replica = open(&db(&scratch));
    replica
        .conn()
        .execute_batch(
            "CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, qty INTEGER)",
        )
        .unwrap();
    let mut chain = Chain::new(1);
    applied(
        replica
            .receive_down(chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]))
            .unwrap(),
    );
    let moved = applied(
        replica
            .receive_down(chain.next(vec![items(vec![item(2, "nut", 1)], vec![key(1)])]))
            .unwrap(),
    );
    assert_eq!(moved, vec![("items".to_string(), 2)]);
    assert_eq!(items_in(replica.conn()), vec![item(2, "nut", 1)]);
    assert!(replica.up().unwrap().rejections.is_empty());
}

/// Guards: a row the replica's own CHECK refuses becomes a rejection while the rest of
/// the message applies; it is reported once; a later good version clears it.
#[test]
fn a_refused_row_is_a_rejection_and_a_later_good_version_clears_it() {
    let scratch = Scratch::new("replica-reject");
    let mut replica = open(&db(&scratch));
    replica
        .conn()
        .execute_batch("CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT NOT NULL, qty INTEGER CHECK (qty >= 0))")
        .unwrap();
    let mut chain = Chain::new(1);
    let down = chain.start(vec![items(
        vec![item(1, "nut", 1), item(2, "bolt", -1), item(3, "gear", 3)],
        vec![],
    )]);
    assert_eq!(
        applied(replica.receive_down(down).unwrap()),
        vec![("items".to_string(), 2)]
    );
    assert_eq!(
        items_in(replica.conn()),
        vec![item(1, "nut", 1), item(3, "gear", 3)]
    );
    let up = replica.up().unwrap();
    assert_eq!(up.rejections.len(), 1);
    let rejection = &up.rejections[0];
    assert_eq!(
        (rejection.table.as_str(), &rejection.key, rejection.seq),
        ("items", &key(2), 1)
    );
    assert!(rejection.reason.contains("CHECK"), "{}", rejection.reason);
    assert_eq!(
        replica.status().unwrap().standing,
        Some(Standing::AwaitingFix)
    );
    replica.reported(&up).unwrap();
    // The server keeps only the latest report: a standing rejection is in every one.
    assert_eq!(replica.up().unwrap().rejections.len(), 1);
    assert_eq!(replica.status().unwrap().rejections, 1);

    applied(
        replica
            .receive_down(chain.next(vec![items(vec![item(2, "bolt", 4)], vec![])]))
            .unwrap(),
    );
    assert_eq!(items_in(replica.conn())[1], item(2, "bolt", 4));
    assert_eq!(replica.status().unwrap().rejections, 0);
    assert_eq!(replica.status().unwrap().standing, None);
}

/// Guards: a trigger that RAISE(ROLLBACK)s ends SQLite's whole transaction; the replica
/// finds the row, rejects it and applies the rest of the message (RAISE(FAIL) and
/// RAISE(ABORT) likewise, leaving nothing of the refused row's trigger behind).
#[test]
fn rows_whose_triggers_raise_are_rejected_even_a_rollback() {
    let scratch = Scratch::new("replica-raise");
    let mut replica = open(&db(&scratch));
    replica
        .conn()
        .execute_batch(
            "CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT NOT NULL, qty INTEGER);
             CREATE TABLE audit(name TEXT);
             CREATE TRIGGER no_boom BEFORE INSERT ON items WHEN NEW.name = 'boom'
               BEGIN SELECT RAISE(ROLLBACK, 'no boom here'); END;
             CREATE TRIGGER log_then_fail AFTER INSERT ON items
               BEGIN INSERT INTO audit VALUES (NEW.name);
                     SELECT RAISE(FAIL, 'no fail here') WHERE NEW.name = 'fail'; END;",
        )
        .unwrap();
    let mut chain = Chain::new(1);
    let down = chain.start(vec![items(
        vec![
            item(1, "nut", 1),
            item(2, "boom", 1),
            item(3, "fail", 1),
            item(4, "gear", 1),
            item(5, "boom", 2),
        ],
        vec![],
    )]);
    assert_eq!(
        applied(replica.receive_down(down).unwrap()),
        vec![("items".to_string(), 2)]
    );
    assert_eq!(
        items_in(replica.conn()),
        vec![item(1, "nut", 1), item(4, "gear", 1)]
    );
    let audit = rows(replica.conn(), "SELECT name FROM audit ORDER BY name");
    assert_eq!(
        audit,
        vec![
            vec![Value::Text("gear".into())],
            vec![Value::Text("nut".into())]
        ]
    );
    let mut reasons: Vec<(Vec<Value>, String)> = replica
        .up()
        .unwrap()
        .rejections
        .into_iter()
        .map(|r| (r.key, r.reason))
        .collect();
    reasons.sort_by_key(|(k, _)| format!("{k:?}"));
    assert_eq!(reasons.len(), 3);
    assert!(
        reasons[0].1.contains("no boom here") && reasons[2].1.contains("no boom here"),
        "{reasons:?}"
    );
    assert!(reasons[1].1.contains("no fail here"), "{reasons:?}");
    assert_eq!(seq_of(&replica), 1);
}

/// Guards: a row the server deletes that the replica's own rows still reference is
/// retired (kept, left out of digests) rather than failing the message; sent again, it
/// is revived.
#[test]
fn a_referenced_row_is_retired_not_deleted_and_revived_when_sent_again() {
    let scratch = Scratch::new("replica-retire");
    let mut replica = open(&db(&scratch));
    let mut chain = Chain::new(1);
    applied(
        replica
            .receive_down(chain.start(vec![items(
                vec![item(1, "nut", 1), item(2, "bolt", 1)],
                vec![],
            )]))
            .unwrap(),
    );
    let before = replica.up().unwrap().digests;
    replica
        .conn()
        .execute_batch(
            "CREATE TABLE notes(id INTEGER PRIMARY KEY, item_id INTEGER REFERENCES items(id));
             INSERT INTO notes VALUES (1, 1);",
        )
        .unwrap();
    let taken = applied(
        replica
            .receive_down(chain.next(vec![items(vec![], vec![key(1), key(2)])]))
            .unwrap(),
    );
    assert_eq!(taken, vec![("items".to_string(), 2)]);
    assert_eq!(items_in(replica.conn()), vec![item(1, "nut", 1)]);
    let status = replica.status().unwrap();
    assert_eq!((status.retired, status.rejections), (1, 0));
    let digest = &replica.up().unwrap().digests[0];
    assert_eq!(digest.rows, 0);
    assert_ne!(before[0].fingerprint, digest.fingerprint);

    applied(
        replica
            .receive_down(chain.next(vec![items(vec![item(1, "nut", 7)], vec![])]))
            .unwrap(),
    );
    assert_eq!(replica.status().unwrap().retired, 0);
    assert_eq!(replica.up().unwrap().digests[0].rows, 1);
    assert_eq!(items_in(replica.conn()), vec![item(1, "nut", 7)]);
}

/// Guards: a sweep spanning two messages removes exactly the rows no part named since
/// its start (rejected ones are named too), and no digest is sent mid-sweep.
#[test]
fn a_sweep_across_two_messages_removes_the_unnamed_rows() {
    let scratch = Scratch::new("replica-sweep");
    let mut replica = open(&db(&scratch));
    let mut chain = Chain::new(1);
    let all: Vec<Vec<Value>> = (1..=6).map(|i| item(i, "part", i)).collect();
    applied(
        replica
            .receive_down(chain.start(vec![items(all, vec![])]))
            .unwrap(),
    );
    replica
        .conn()
        .execute_batch("CREATE TRIGGER no_seven BEFORE UPDATE ON items WHEN NEW.qty = 70 BEGIN SELECT RAISE(ABORT, 'no'); END;")
        .unwrap();
    let mut first = items(vec![item(1, "part", 10), item(6, "part", 70)], vec![]);
    first.sweep.start = true;
    applied(replica.receive_down(chain.next(vec![first])).unwrap());
    assert!(
        replica.up().unwrap().digests.is_empty(),
        "no digest while a sweep is under way"
    );
    let mut second = items(vec![item(2, "part", 20)], vec![key(3)]);
    second.sweep.end = true;
    assert_eq!(
        applied(replica.receive_down(chain.next(vec![second])).unwrap()),
        vec![("items".to_string(), 4)]
    );
    assert_eq!(
        items_in(replica.conn()),
        vec![item(1, "part", 10), item(2, "part", 20), item(6, "part", 6)]
    );
    assert_eq!(replica.up().unwrap().digests.len(), 1);
    let left: i64 = replica
        .conn()
        .query_row("SELECT (SELECT COUNT(*) FROM _ferry_sync_sweep) + (SELECT COUNT(*) FROM _ferry_sync_sweeping)", [], |r| r.get(0))
        .unwrap();
    assert_eq!(left, 0);
}

/// Guards: a column that appears in a later part is added to the existing table
/// (nullable: the rows already there have none) and digests read the new column order.
#[test]
fn a_new_column_in_a_later_part_is_added() {
    let scratch = Scratch::new("replica-widen");
    let mut replica = open(&db(&scratch));
    let mut chain = Chain::new(1);
    applied(
        replica
            .receive_down(chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]))
            .unwrap(),
    );
    let mut wider = item_columns();
    wider.push(col("colour", Affinity::Text, 0, true));
    let row = vec![
        Value::Int(2),
        Value::Text("bolt".into()),
        Value::Int(2),
        Value::Text("red".into()),
    ];
    applied(
        replica
            .receive_down(chain.next(vec![part("items", wider, vec![row.clone()], vec![])]))
            .unwrap(),
    );
    let got = rows(
        replica.conn(),
        "SELECT id, name, qty, colour FROM items ORDER BY id",
    );
    assert_eq!(
        got,
        vec![
            vec![
                Value::Int(1),
                Value::Text("nut".into()),
                Value::Int(1),
                Value::Null
            ],
            row
        ]
    );
    let json: String = replica
        .conn()
        .query_row(
            "SELECT columns FROM _ferry_sync_tables WHERE name = 'items'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(json.contains("colour"), "{json}");
    assert_eq!(replica.up().unwrap().digests[0].rows, 2);
}

/// Guards: a server column the rules stopped sending is dropped from the replica's table
/// (its old values were the server's, and nothing would correct them: docs/sync.md
/// §3.3); one the app's index holds is emptied instead; a NOT NULL one the index holds is
/// left as it was, and the message still applies (rows it cannot take are rejections). A table the replica writes is never
/// shed: its columns hold the app's own writes.
#[test]
fn a_column_the_server_stops_sending_is_dropped_or_emptied_and_never_blocks_a_message() {
    let scratch = Scratch::new("replica-shed");
    let mut replica = open(&db(&scratch));
    let mut chain = Chain::new(1);
    let mut wide = item_columns();
    wide.push(col("cost", Affinity::Text, 0, false));
    wide.push(col("shelf", Affinity::Text, 0, false));
    let row = |id: i64, cost: &str, shelf: &str| {
        vec![
            Value::Int(id),
            Value::Text("nut".into()),
            Value::Int(1),
            Value::Text(cost.into()),
            Value::Text(shelf.into()),
        ]
    };
    applied(
        replica
            .receive_down(chain.start(vec![part(
                "items",
                wide,
                vec![row(1, "0.10", "A1")],
                vec![],
            )]))
            .unwrap(),
    );
    replica
        .conn()
        .execute_batch(
            "CREATE INDEX app_shelf ON items(shelf); CREATE INDEX app_name ON items(name);",
        )
        .unwrap();
    // The next shape keeps the key and qty only.
    let narrow = vec![
        col("id", Affinity::Integer, 1, true),
        col("qty", Affinity::Integer, 0, false),
    ];
    applied(
        replica
            .receive_down(chain.next(vec![part(
                "items",
                narrow,
                vec![vec![Value::Int(1), Value::Int(5)]],
                vec![],
            )]))
            .unwrap(),
    );
    let columns: Vec<String> = replica
        .conn()
        .prepare("SELECT name FROM pragma_table_info('items') ORDER BY cid")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        columns,
        ["id", "name", "qty", "shelf"],
        "cost dropped; indexed ones kept"
    );
    // Shelf emptied. Name is NOT NULL and the app's index holds it, so it stays, and a
    // row of the new shape (no name) is one the replica's own schema refuses: set aside
    // and reported, as any such row is, while the message applies.
    assert_eq!(
        rows(replica.conn(), "SELECT id, name, qty, shelf FROM items"),
        vec![vec![
            Value::Int(1),
            Value::Text("nut".into()),
            Value::Int(1),
            Value::Null
        ]],
    );
    let up = replica.up().unwrap();
    assert!(
        up.rejections
            .iter()
            .any(|r| r.table == "items" && r.reason.contains("NOT NULL")),
        "{:?}",
        up.rejections
    );

    // A record table's columns are the app's: announced narrower, it keeps them.
    let writes = wire::Writes {
        lane: "main".into(),
        owned: 0,
        restate: false,
    };
    let visits = |columns: Vec<Column>| TablePart {
        writes: Some(writes.clone()),
        ..part("visits", columns, vec![], vec![])
    };
    let both = vec![
        col("id", Affinity::Integer, 1, true),
        col("note", Affinity::Text, 0, false),
        col("extra", Affinity::Text, 0, false),
    ];
    applied(
        replica
            .receive_down(chain.next(vec![visits(both)]))
            .unwrap(),
    );
    replica
        .conn()
        .execute(
            "INSERT INTO visits (id, note, extra) VALUES (1, 'hi', 'kept')",
            [],
        )
        .unwrap();
    let fewer = vec![
        col("id", Affinity::Integer, 1, true),
        col("note", Affinity::Text, 0, false),
    ];
    applied(
        replica
            .receive_down(chain.next(vec![visits(fewer)]))
            .unwrap(),
    );
    let extra: String = replica
        .conn()
        .query_row("SELECT extra FROM visits WHERE id = 1", [], |r| r.get(0))
        .unwrap();
    assert_eq!(extra, "kept");
}

// ---- storage, readers, crashes -----------------------------------------------------

/// Guards: a full disk mid-apply rolls the whole message back (a transient error, the
/// position unchanged, no row of it kept), and the same message applies once there is
/// room.
#[test]
fn a_full_disk_mid_apply_leaves_nothing_and_the_message_applies_later() {
    let scratch = Scratch::new("replica-full");
    let mut replica = open(&db(&scratch));
    let mut chain = Chain::new(1);
    applied(
        replica
            .receive_down(chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]))
            .unwrap(),
    );
    let pages: i64 = replica
        .conn()
        .query_row("PRAGMA page_count", [], |r| r.get(0))
        .unwrap();
    replica
        .conn()
        .execute_batch(&format!("PRAGMA max_page_count = {}", pages + 3))
        .unwrap();
    let big: Vec<Vec<Value>> = (2..400).map(|i| item(i, &"x".repeat(500), i)).collect();
    let down = chain.next(vec![items(big, vec![key(1)])]);
    let err = replica.receive_down(down.clone()).unwrap_err();
    assert!(err.is_transient(), "{err}");
    assert_eq!(items_in(replica.conn()), vec![item(1, "nut", 1)]);
    assert_eq!(seq_of(&replica), 1);
    assert!(replica.up().unwrap().rejections.is_empty());

    replica
        .conn()
        .execute_batch("PRAGMA max_page_count = 1000000")
        .unwrap();
    assert_eq!(
        applied(replica.receive_down(down).unwrap()),
        vec![("items".to_string(), 399)]
    );
    assert_eq!(seq_of(&replica), 2);
}

/// Guards: readers on another connection see the previous state while a message applies
/// (WAL, one transaction), and the whole message once it commits.
#[test]
fn a_reader_sees_the_old_state_until_the_commit() {
    let scratch = Scratch::new("replica-reader");
    let path = db(&scratch);
    let mut replica = open(&path);
    let mut chain = Chain::new(1);
    applied(
        replica
            .receive_down(chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]))
            .unwrap(),
    );
    let reader = Connection::open(&path).unwrap();
    let seen = Arc::new(Mutex::new(Vec::<i64>::new()));
    let hook_seen = seen.clone();
    replica
        .conn()
        .update_hook(Some(
            move |_: rusqlite::hooks::Action, _: &str, table: &str, _: i64| {
                if table == "items" {
                    let n: i64 = reader
                        .query_row("SELECT COUNT(*) FROM items", [], |r| r.get(0))
                        .unwrap();
                    hook_seen.lock().unwrap().push(n);
                }
            },
        ))
        .unwrap();
    let down = chain.next(vec![items(
        (2..=10).map(|i| item(i, "bolt", i)).collect(),
        vec![key(1)],
    )]);
    applied(replica.receive_down(down).unwrap());
    replica
        .conn()
        .update_hook(None::<fn(rusqlite::hooks::Action, &str, &str, i64)>)
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 10, "one look per row written");
    assert!(
        seen.iter().all(|&n| n == 1),
        "mid-apply the reader saw {seen:?}"
    );
    let reader = Connection::open(&path).unwrap();
    let n: i64 = reader
        .query_row("SELECT COUNT(*) FROM items", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 9);
}

/// The message the killed child applies: big enough that it is killed mid-way.
fn kill_message(chain: &mut Chain) -> Down {
    chain.next(vec![items(
        (2..=500).map(|i| item(i, "bolt", i)).collect(),
        vec![key(1)],
    )])
}

/// Guards: a replica process SIGKILLed mid-apply leaves the previous state (position,
/// rows, engine tables), a file that passes integrity_check, and the message applies
/// when fetched again.
#[test]
fn a_replica_killed_mid_apply_reopens_at_the_previous_state() {
    // The same test binary, run again with these set, is the child the test kills.
    if let (Ok(path), Ok(marker)) = (
        std::env::var("FERRY_REPLICA_KILL_DB"),
        std::env::var("FERRY_REPLICA_KILL_MARKER"),
    ) {
        apply_until_killed(Path::new(&path), Path::new(&marker));
    }
    let scratch = Scratch::new("replica-kill");
    let path = db(&scratch);
    {
        let mut replica = open(&path);
        let mut chain = Chain::new(1);
        applied(
            replica
                .receive_down(chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]))
                .unwrap(),
        );
    }
    let marker = scratch.path().join("mid-apply");
    let child = ferry_testkit::proc::Proc::spawn(
        "replica child",
        &std::env::current_exe().unwrap(),
        &[
            "--exact",
            "a_replica_killed_mid_apply_reopens_at_the_previous_state",
            "--nocapture",
        ],
        &[
            ("FERRY_REPLICA_KILL_DB", path.to_str().unwrap()),
            ("FERRY_REPLICA_KILL_MARKER", marker.to_str().unwrap()),
        ],
        &scratch.path().join("child.log"),
    );
    assert!(
        ferry_testkit::wait_until(Duration::from_secs(60), || marker.exists()),
        "the child never reached mid-apply"
    );
    child.kill9();

    let mut replica = open(&path);
    let ok: String = replica
        .conn()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
    assert_eq!(items_in(replica.conn()), vec![item(1, "nut", 1)]);
    assert_eq!(seq_of(&replica), 1);
    let mut chain = Chain::new(1);
    chain.start(vec![]);
    assert_eq!(
        applied(replica.receive_down(kill_message(&mut chain)).unwrap()),
        vec![("items".to_string(), 500)]
    );
    assert_eq!(seq_of(&replica), 2);
}

/// The child of the test above: applies the message and parks itself mid-apply (in the
/// update hook, inside the transaction) until it is killed.
fn apply_until_killed(path: &Path, marker: &Path) -> ! {
    let marker = marker.to_path_buf();
    let mut replica = open(path);
    let mut written = 0;
    replica
        .conn()
        .update_hook(Some(
            move |_: rusqlite::hooks::Action, _: &str, _: &str, _: i64| {
                written += 1;
                if written == 300 {
                    std::fs::write(&marker, b"mid-apply").unwrap();
                    loop {
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            },
        ))
        .unwrap();
    let mut chain = Chain::new(1);
    chain.start(vec![]);
    let _ = replica.receive_down(kill_message(&mut chain));
    panic!("the child should have been killed mid-apply");
}

// ---- digests -----------------------------------------------------------------------

/// Guards: two replicas that applied the same messages send equal digests, and a row
/// changed behind the engine's back changes the digest (the server would heal it).
#[test]
fn digests_agree_between_equal_replicas_and_catch_a_changed_row() {
    let scratch = Scratch::new("replica-digest");
    let mut a = open(&scratch.path().join("a.db"));
    let mut b = open(&scratch.path().join("b.db"));
    let mut chain = Chain::new(1);
    let messages = vec![
        chain.start(vec![items(
            vec![item(1, "nut", 1), item(2, "bolt", 2)],
            vec![],
        )]),
        chain.next(vec![items(vec![item(3, "gear", 3)], vec![key(1)])]),
    ];
    for m in &messages {
        applied(a.receive_down(m.clone()).unwrap());
        applied(b.receive_down(m.clone()).unwrap());
    }
    let (da, db) = (a.up().unwrap().digests, b.up().unwrap().digests);
    assert_eq!(da.len(), 1);
    assert_eq!(da, db);
    assert_eq!(da[0].rows, 2);

    b.conn()
        .execute("UPDATE items SET qty = 4 WHERE id = 3", [])
        .unwrap();
    let db = b.up().unwrap().digests;
    assert_eq!(da[0].rows, db[0].rows);
    assert_ne!(da[0].fingerprint, db[0].fingerprint);
}

/// Guards: the file refuses a later version of the engine's tables rather than lose
/// state a newer ferry keeps.
#[test]
fn a_later_version_of_the_engine_tables_is_refused() {
    let scratch = Scratch::new("replica-version");
    let path = db(&scratch);
    drop(open(&path));
    Connection::open(&path)
        .unwrap()
        .execute_batch("UPDATE _ferry_sync_state SET version = 99")
        .unwrap();
    let err = Replica::open(&path, SEAL_KEY).err().expect("refused");
    assert!(!err.is_transient());
    assert!(err.to_string().contains("99"), "{err}");
}

// ---- the loop over a transport -----------------------------------------------------

/// A transport that serves a list of frames by position and keeps the reports; it sets
/// `stop` once it has served everything and a report confirmed the last message.
struct FakeLink {
    frames: Vec<(u64, Vec<u8>)>,
    reports: Vec<Up>,
    fail_fetches: u32,
    refuse: bool,
    last_seq: u64,
    stop: Arc<AtomicBool>,
}

impl Downlink for FakeLink {
    fn fetch(
        &mut self,
        position: Position,
        max: usize,
        _wait: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let after_seq = position.seq;
        if self.refuse {
            return Err(TransportError::Refused("401".into()));
        }
        if self.fail_fetches > 0 {
            self.fail_fetches -= 1;
            return Err(TransportError::Unavailable("connection refused".into()));
        }
        Ok(self
            .frames
            .iter()
            .filter(|(seq, _)| *seq > after_seq)
            .take(max)
            .map(|(_, f)| f.clone())
            .collect())
    }

    fn report(&mut self, up: &[u8]) -> Result<(), TransportError> {
        let up =
            wire::decode_up(up, &wire::Limits::default()).expect("a report the server accepts");
        if up.applied.is_some_and(|a| a.seq == self.last_seq) {
            self.stop.store(true, Ordering::SeqCst);
        }
        self.reports.push(up);
        Ok(())
    }
}

fn fast_settings() -> RunSettings {
    RunSettings {
        window: 2,
        wait: Duration::from_millis(1),
        backoff: ferry_core::backoff::Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(2),
            Duration::ZERO,
        ),
        ..RunSettings::default()
    }
}

/// Guards: the loop fetches after its position, applies each batch in order, backs off
/// through transport failures and reports the position (with the stamp the server
/// checks) and the rejections.
#[test]
fn the_loop_fetches_applies_and_reports() {
    let scratch = Scratch::new("replica-run");
    let mut replica = open(&db(&scratch));
    replica
        .conn()
        .execute_batch("CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT NOT NULL, qty INTEGER CHECK (qty >= 0))")
        .unwrap();
    let mut chain = Chain::new(1);
    let mut frames = vec![(
        1,
        frame(
            &chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]),
            &SEAL_KEY,
        ),
    )];
    for i in 2..=5 {
        let qty = if i == 3 { -1 } else { i };
        let down = chain.next(vec![items(vec![item(i, "bolt", qty)], vec![])]);
        frames.push((i as u64, frame(&down, &SEAL_KEY)));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut link = FakeLink {
        frames,
        reports: vec![],
        fail_fetches: 2,
        refuse: false,
        last_seq: 5,
        stop: stop.clone(),
    };
    let end = replica.run(&mut link, &stop, &fast_settings()).unwrap();
    assert_eq!(end, RunEnd::Stopped);
    let last = link.reports.last().unwrap();
    let applied = last.applied.unwrap();
    assert_eq!(applied.seq, 5);
    assert!(wire::verify_stamp(&SECRET, &[1; 16], &applied));
    let mut rejected: Vec<&Vec<Value>> = link
        .reports
        .iter()
        .flat_map(|u| u.rejections.iter().map(|r| &r.key))
        .collect();
    rejected.dedup();
    assert_eq!(
        rejected,
        vec![&key(3)],
        "the one refused row, in every report while it stands"
    );
    assert_eq!(items_in(replica.conn()).len(), 4);
    assert!(replica.status().unwrap().heard_at_ms.is_some());
}

/// Guards: a permanent transport failure (a wrong token) ends the loop with an error
/// that says not to retry, instead of spinning.
#[test]
fn the_loop_ends_on_a_permanent_transport_failure() {
    let scratch = Scratch::new("replica-run-401");
    let mut replica = open(&db(&scratch));
    let stop = Arc::new(AtomicBool::new(false));
    let mut link = FakeLink {
        frames: vec![],
        reports: vec![],
        fail_fetches: 0,
        refuse: true,
        last_seq: 1,
        stop: stop.clone(),
    };
    let err = replica.run(&mut link, &stop, &fast_settings()).unwrap_err();
    assert!(!err.is_transient(), "{err}");
    assert_eq!(
        link.reports.len(),
        1,
        "the replica reported where it stands first"
    );
}

/// Guards: a window of messages that follow each other applies in one transaction with
/// the same outcome as one by one, and anything the one-by-one path must handle (a row
/// whose trigger rolls back, a gap) makes the window apply nothing, so that path runs.
#[test]
fn a_window_applies_in_one_transaction_and_anything_unusual_applies_nothing() {
    let scratch = Scratch::new("replica-window");
    let mut replica = open(&db(&scratch));
    let key = SEAL_KEY;
    replica
        .conn()
        .execute_batch(
            "CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT NOT NULL, qty INTEGER);
             CREATE TRIGGER no_boom BEFORE INSERT ON items WHEN NEW.name = 'boom'
               BEGIN SELECT RAISE(ROLLBACK, 'no boom here'); END;",
        )
        .unwrap();
    let mut chain = Chain::new(1);
    let f1 = frame(
        &chain.start(vec![items(vec![item(1, "nut", 1)], vec![])]),
        &key,
    );
    let f2 = frame(
        &chain.next(vec![items(vec![item(2, "gear", 1)], vec![])]),
        &key,
    );
    let got = replica.receive_many(&[f1.clone(), f2.clone()]).unwrap();
    assert_eq!(
        got.expect("a clean window applies").len(),
        2,
        "one answer per frame"
    );
    assert_eq!(
        items_in(replica.conn()),
        vec![item(1, "nut", 1), item(2, "gear", 1)]
    );
    assert_eq!(seq_of(&replica), 2);
    // Sent again: already applied, nothing changes.
    let again = replica.receive_many(&[f1, f2]).unwrap().unwrap();
    assert!(
        again
            .iter()
            .all(|r| matches!(r, Received::AlreadyApplied { .. }))
    );

    // A row whose trigger rolls back: the window applies nothing...
    let f3 = frame(
        &chain.next(vec![items(vec![item(3, "boom", 1)], vec![])]),
        &key,
    );
    let f4 = frame(
        &chain.next(vec![items(vec![item(4, "bolt", 1)], vec![])]),
        &key,
    );
    assert_eq!(
        replica.receive_many(&[f3.clone(), f4.clone()]).unwrap(),
        None
    );
    assert_eq!(seq_of(&replica), 2);
    assert_eq!(items_in(replica.conn()).len(), 2);
    // ...and one by one, the row is a rejection and the rest applies.
    applied(replica.receive(&f3).unwrap());
    applied(replica.receive(&f4).unwrap());
    assert_eq!(
        items_in(replica.conn()),
        vec![item(1, "nut", 1), item(2, "gear", 1), item(4, "bolt", 1)]
    );

    // A gap: the window applies nothing and records nothing; one by one records it.
    let _lost = chain.next(vec![items(vec![item(5, "lost", 1)], vec![])]);
    let f6 = frame(
        &chain.next(vec![items(vec![item(6, "late", 1)], vec![])]),
        &key,
    );
    assert_eq!(
        replica.receive_many(&[f6.clone(), f6.clone()]).unwrap(),
        None
    );
    assert_eq!(seq_of(&replica), 4);
    assert_eq!(replica.status().unwrap().gap, 0);
    assert!(matches!(
        replica.receive(&f6).unwrap(),
        Received::Gap { .. }
    ));
}
