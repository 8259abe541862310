//! Guards protocol v1's bytes, the contract between a server and replicas of other
//! versions: values, bodies, frames, reports, uploads and `Filed` answers decode to what
//! was encoded; the golden vectors (`tests/golden/`) are reproduced byte for byte, so a
//! change of encoding fails here before it strands a replica; every rule `open`,
//! `decode_up`, `decode_upload` and `open_filed` enforce is refused by name on a corpus of
//! malformed messages; no flipped byte, truncation or random corruption gets through or
//! panics; a zip bomb stops at `body_max` without allocating past it; a `Filed` opens
//! only for the replica and token it was sealed for.
//!
//! The frames here are also built by a second, independent encoder (`raw_frame`, straight
//! from the layout table with the hmac and sha2 crates), so a layout mistake shared by
//! encoder and decoder cannot hide.
//!
//! The golden files must be what today's encoders write (`golden_files_are_what_the_encoders_write`);
//! rewrite them only when the protocol changes, with a new PROTOCOL:
//! `FERRY_GOLDEN_WRITE=1 cargo test -p ferry-sync --test wire golden_files`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Write as _;
use std::path::PathBuf;

use ferry_sync::value::{
    Affinity, DecodeProblem, EncodeError, Fingerprint, Value, decode_value, decode_varint,
    encode_value, key_text, parse_key_text, row_hash, row_len, value_len,
};
use ferry_sync::wire::{
    Applied, BODY_BYTES_MAX, COMPRESS_ABOVE_BYTES, ChainHead, Column, Digest, Down,
    FILED_BYTES_MAX, FILED_REFUSED_MAX, Filed, HEAD_LEN, Limits, PROTOCOL, REASON_BYTES_MAX,
    Refused, RefusedRow, Rejection, Rule, Sweep, TablePart, UP_BYTES_MAX, UPLOAD_BYTES_MAX, Up,
    Upload, Writes, body_hash, decode_body, decode_up, decode_upload, encode_body, encode_down,
    encode_filed, encode_head, encode_up, encode_upload, open, open_filed, pack_body, seal_key,
    stamp, verify_stamp,
};
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest as _, Sha256};

const SECRET: [u8; 32] = [7; 32];
const TOKEN: &[u8] = b"token-1";
const OTHER_TOKEN: &[u8] = b"token-2";
const REPLICA: [u8; 16] = [0x11; 16];
const OTHER_REPLICA: [u8; 16] = [0x12; 16];
const EPOCH: [u8; 16] = [
    0xe0, 0xe1, 0xe2, 0xe3, 0xe4, 0xe5, 0xe6, 0xe7, 0xe8, 0xe9, 0xea, 0xeb, 0xec, 0xed, 0xee, 0xef,
];
const NONCE_1: u64 = 0x0123_4567_89ab_cdef;
const NONCE_2: u64 = 0x0fed_cba9_8765_4321;
const NONCE_3: u64 = 0x2222_3333_4444_5555;
const NONCE_4: u64 = 0x7fff_ffff_ffff_ffff;
const NONCE_5: u64 = 0x3333_4444_5555_6666;

/// The malformed corpus is opened with these limits, so its size rules fit in a line.
fn corpus_limits() -> Limits {
    Limits {
        frame_max: 1024,
        body_max: 4096,
    }
}

// ---------------------------------------------------------------------------------------
// Values

#[test]
fn values_encode_to_the_documented_bytes() {
    let cases: &[(Value, &str)] = &[
        (Value::Null, "00"),
        (Value::Int(0), "0100"),
        (Value::Int(-1), "0101"),
        (Value::Int(1), "0102"),
        (Value::Int(63), "017e"),
        (Value::Int(64), "018001"),
        (Value::Int(i64::MAX), "01feffffffffffffffff01"),
        (Value::Int(i64::MIN), "01ffffffffffffffffff01"),
        (Value::Real(1.0), "023ff0000000000000"),
        (Value::Real(-0.0), "028000000000000000"),
        (Value::Text("é|".into()), "0303c3a97c"),
        (Value::Text(String::new()), "0300"),
        (Value::Blob(vec![0, 255]), "040200ff"),
    ];
    for (value, expected) in cases {
        let mut out = Vec::new();
        encode_value(value, &mut out).unwrap();
        assert_eq!(hex(&out), *expected, "{value:?}");
        assert_eq!(value_len(value), out.len(), "{value:?}");
        let mut at = 0;
        assert_eq!(&decode_value(&out, &mut at).unwrap(), value);
        assert_eq!(at, out.len());
    }
}

#[test]
fn varints_have_one_encoding() {
    // Overlong encodings would give one value two encodings, and equal rows two hashes.
    let cases: &[(&str, Result<u64, DecodeProblem>)] = &[
        ("00", Ok(0)),
        ("7f", Ok(127)),
        ("8001", Ok(128)),
        ("808001", Ok(1 << 14)),
        ("ffffffffffffffffff01", Ok(u64::MAX)),
        ("8000", Err(DecodeProblem::VarintOverlong)),
        ("ff00", Err(DecodeProblem::VarintOverlong)),
        ("80", Err(DecodeProblem::Truncated)),
        ("", Err(DecodeProblem::Truncated)),
        ("ffffffffffffffffff02", Err(DecodeProblem::VarintOverflow)),
        ("ffffffffffffffffffff01", Err(DecodeProblem::VarintOverflow)),
    ];
    for (bytes, expected) in cases {
        let bytes = unhex(bytes);
        let mut at = 0;
        let got = decode_varint(&bytes, &mut at).map_err(|e| e.problem);
        assert_eq!(&got, expected, "{}", hex(&bytes));
        if got.is_err() {
            assert_eq!(at, 0, "a refused varint moves nothing");
        }
    }
}

#[test]
fn nan_is_refused_at_encode_and_decode() {
    let mut out = Vec::new();
    let refused = encode_value(&Value::Real(f64::NAN), &mut out).unwrap_err();
    assert!(matches!(refused, EncodeError::NotANumber { .. }));
    assert!(refused.to_string().contains("NaN"), "{refused}");
    assert!(out.is_empty());
    let nan = unhex("027ff8000000000000");
    let error = decode_value(&nan, &mut 0).unwrap_err();
    assert_eq!(error.problem, DecodeProblem::NotANumber);
}

#[test]
fn values_roundtrip_at_random() {
    let mut rng = Rng::new(1);
    for _ in 0..20_000 {
        let value = rng.value();
        let mut out = Vec::new();
        encode_value(&value, &mut out).unwrap();
        assert_eq!(value_len(&value), out.len());
        assert_eq!(out, reference_value(&value), "{value:?}");
        let mut at = 0;
        assert_eq!(decode_value(&out, &mut at).unwrap(), value);
        assert_eq!(at, out.len());
        // Every proper prefix is refused as truncated, never misread.
        let cut = rng.below(out.len() as u64) as usize;
        assert_eq!(
            decode_value(&out[..cut], &mut 0).unwrap_err().problem,
            DecodeProblem::Truncated
        );
    }
}

#[test]
fn key_text_escapes_and_reads_back() {
    let key = [
        Value::Int(-5),
        Value::Text("a|b\\c".into()),
        Value::Text(String::new()),
    ];
    let text = key_text(&key);
    assert_eq!(text, r"-5|a\|b\\c|");
    let affinities = [Affinity::Integer, Affinity::Text, Affinity::Text];
    assert_eq!(parse_key_text(&text, &affinities).unwrap(), key);
    // Postgres's renderings of the key types parse_key_text does not read back.
    assert_eq!(key_text(&[Value::Blob(vec![1, 0xab])]), r"\\x01ab");
    assert_eq!(key_text(&[Value::Null, Value::Int(1)]), "|1");
    let reals = [
        (1.5, "1.5"),
        (100.0, "100"),
        (1e20, "1e+20"),
        (1e15, "1e+15"),
        (123_456_789_012_345.0, "123456789012345"),
        (0.0001, "0.0001"),
        (1.5e-5, "1.5e-05"),
        (-2.5e-300, "-2.5e-300"),
        (f64::INFINITY, "Infinity"),
        (f64::NEG_INFINITY, "-Infinity"),
    ];
    for (real, expected) in reals {
        assert_eq!(key_text(&[Value::Real(real)]), expected);
    }
}

#[test]
fn key_text_refuses_what_no_trigger_writes() {
    let int_text = [Affinity::Integer, Affinity::Text];
    for (text, why) in [
        ("1", "too few parts"),
        ("1|a|b", "too many parts"),
        ("01|a", "non-canonical integer"),
        ("+1|a", "non-canonical integer"),
        ("x|a", "not an integer"),
        (r"1|a\n", "an unknown escape"),
        (r"1|a\", "a lone backslash"),
    ] {
        let refused = parse_key_text(text, &int_text);
        assert!(refused.is_err(), "{text:?} ({why}) was read as {refused:?}");
    }
    assert_eq!(parse_key_text("", &[]).unwrap(), vec![]);
    assert!(parse_key_text("x", &[]).is_err());
    assert_eq!(
        parse_key_text("", &[Affinity::Text]).unwrap(),
        vec![Value::Text(String::new())]
    );
}

#[test]
fn key_text_roundtrips_at_random() {
    let mut rng = Rng::new(2);
    for _ in 0..5_000 {
        let parts = 1 + rng.below(4) as usize;
        let mut key = Vec::new();
        let mut affinities = Vec::new();
        for _ in 0..parts {
            if rng.below(2) == 0 {
                key.push(Value::Int(rng.int()));
                affinities.push(Affinity::Integer);
            } else {
                key.push(Value::Text(rng.text(12)));
                affinities
                    .push([Affinity::Text, Affinity::Real, Affinity::Blob][rng.below(3) as usize]);
            }
        }
        let text = key_text(&key);
        assert_eq!(parse_key_text(&text, &affinities).unwrap(), key, "{text:?}");
    }
}

#[test]
fn row_hash_is_fnv1a_over_the_encodings() {
    assert_eq!(
        row_hash(&[]),
        0xcbf2_9ce4_8422_2325,
        "FNV-1a 64's offset basis"
    );
    assert_eq!(row_hash(&[Value::Null]), 0xaf63_bd4c_8601_b7df);
    assert_eq!(row_hash(&[Value::Int(1)]), 0x082f_2407_b4e8_902a);
    let mut rng = Rng::new(3);
    for _ in 0..2_000 {
        let row: Vec<Value> = (0..rng.below(6)).map(|_| rng.value()).collect();
        let encoded: Vec<u8> = row.iter().flat_map(reference_value).collect();
        assert_eq!(row_hash(&row), reference_fnv(&encoded));
        assert_eq!(row_len(&row), encoded.len());
    }
}

#[test]
fn fingerprints_ignore_row_order() {
    // The server reads Postgres and the replica SQLite in different orders; equal
    // contents must give equal digests.
    let mut rng = Rng::new(4);
    let rows: Vec<Vec<Value>> = (0..500).map(|_| vec![rng.value(), rng.value()]).collect();
    let mut forward = Fingerprint::default();
    rows.iter().for_each(|row| forward.add(row));
    let mut backward = Fingerprint::default();
    rows.iter().rev().for_each(|row| backward.add(row));
    assert_eq!(forward, backward);
    assert_eq!(forward.rows, 500);
    let mut fewer = Fingerprint::default();
    rows[1..].iter().for_each(|row| fewer.add(row));
    assert_ne!(forward, fewer);
}

// ---------------------------------------------------------------------------------------
// Bodies

#[test]
fn bodies_roundtrip_at_random_and_encode_canonically() {
    let mut rng = Rng::new(5);
    let mut two_way = 0;
    for _ in 0..500 {
        let parts: Vec<TablePart> = (0..rng.below(4)).map(|_| rng.part()).collect();
        two_way += parts
            .iter()
            .filter(|p| p.writes.as_ref().is_some_and(|w| w.owned > 0))
            .count();
        let body = encode_body(&parts).unwrap();
        assert_eq!(body, reference_body(&parts), "{parts:?}");
        assert_eq!(decode_body(&body).unwrap(), parts);
        // Every prefix is refused; none panics.
        for cut in 0..body.len() {
            assert!(
                decode_body(&body[..cut]).is_err(),
                "a prefix of {cut} bytes was taken"
            );
        }
        // A flipped byte is refused or reads as another body that encodes back to exactly
        // the bytes read: the body has one encoding.
        for _ in 0..20 {
            let mut damaged = body.clone();
            let at = rng.below(damaged.len() as u64) as usize;
            damaged[at] ^= 1 << rng.below(8);
            if let Ok(parts) = decode_body(&damaged) {
                assert_eq!(encode_body(&parts).unwrap(), damaged);
            }
        }
    }
    assert!(two_way >= 20, "only {two_way} two-way parts were tried");
}

#[test]
fn key_parts_may_come_in_any_column_order() {
    // Postgres allows PRIMARY KEY (b, a) with a declared first: deletes then list b, a.
    let part = TablePart {
        table: "lines".into(),
        columns: vec![column("a", 2), column("b", 1), column("qty", 0)],
        sweep: Sweep::default(),
        deletes: vec![vec![Value::Int(20), Value::Int(10)]],
        upserts: vec![vec![Value::Int(10), Value::Int(20), Value::Null]],
        writes: None,
    };
    let body = encode_body(std::slice::from_ref(&part)).unwrap();
    assert_eq!(decode_body(&body).unwrap(), vec![part]);
}

#[test]
fn encode_body_refuses_what_a_replica_would() {
    let base = TablePart {
        table: "orders".into(),
        columns: vec![column("id", 1), column("note", 0)],
        sweep: Sweep::default(),
        deletes: vec![],
        upserts: vec![vec![Value::Int(1), Value::Null]],
        writes: None,
    };
    type Breaker = Box<dyn Fn(&mut TablePart)>;
    let cases: Vec<(&str, Breaker)> = vec![
        (
            "table-name-reserved",
            Box::new(|p: &mut TablePart| p.table = "SQLite_master".into()),
        ),
        (
            "table-name-reserved",
            Box::new(|p: &mut TablePart| p.table = "_ferry_sync_x".into()),
        ),
        (
            "table-name-len",
            Box::new(|p: &mut TablePart| p.table = "t".repeat(64)),
        ),
        (
            "name-nul",
            Box::new(|p: &mut TablePart| p.columns[1].name = "a\0b".into()),
        ),
        (
            "column-count",
            Box::new(|p: &mut TablePart| p.columns.clear()),
        ),
        (
            "column-name-len",
            Box::new(|p: &mut TablePart| p.columns[1].name = String::new()),
        ),
        (
            "column-name-duplicate",
            Box::new(|p: &mut TablePart| p.columns[1].name = "ID".into()),
        ),
        (
            "no-key",
            Box::new(|p: &mut TablePart| p.columns[0].key_part = 0),
        ),
        (
            "key-part-duplicate",
            Box::new(|p: &mut TablePart| p.columns[1].key_part = 1),
        ),
        (
            "key-part-gap",
            Box::new(|p: &mut TablePart| p.columns[0].key_part = 2),
        ),
        (
            "row-width",
            Box::new(|p: &mut TablePart| drop(p.upserts[0].pop())),
        ),
        (
            "row-width",
            Box::new(|p: &mut TablePart| p.deletes.push(vec![])),
        ),
        (
            "null-in-not-null",
            Box::new(|p: &mut TablePart| p.upserts[0][0] = Value::Null),
        ),
        (
            "null-in-not-null",
            Box::new(|p: &mut TablePart| p.deletes.push(vec![Value::Null])),
        ),
    ];
    for (rule, break_it) in cases {
        let mut part = base.clone();
        break_it(&mut part);
        match encode_body(&[part]) {
            Err(EncodeError::Invalid { rule: got, detail }) => {
                assert_eq!(got, rule, "{detail}");
                assert!(detail.contains("table part 1"), "{detail}");
            }
            other => panic!("expected {rule}, got {other:?}"),
        }
    }
    let mut nan = base.clone();
    nan.upserts[0][1] = Value::Real(f64::NAN);
    let refused = encode_body(&[nan]).unwrap_err();
    assert!(matches!(&refused, EncodeError::NotANumber { at } if at.contains("upsert 1")));
}

// ---------------------------------------------------------------------------------------
// Frames

#[test]
fn frames_roundtrip_at_random() {
    let mut rng = Rng::new(6);
    let key = seal_key(TOKEN);
    for round in 0..200 {
        let parts: Vec<TablePart> = (0..rng.below(4)).map(|_| rng.part()).collect();
        let head = rng.head();
        let (frame, stamped) = encode_down(&head, &parts, &SECRET, &key).unwrap();
        let down =
            open(&frame, &key, &Limits::default()).unwrap_or_else(|e| panic!("{round}: {e}"));
        assert_eq!(down.head, head);
        assert_eq!(down.parts, parts);
        assert_eq!(down.stamp, stamped);
        assert_eq!(down.body_hash, body_hash(&frame[HEAD_LEN..]));
        assert_eq!(
            frame,
            raw_frame(&RawHead::of(&head, frame[6]), &frame[HEAD_LEN..], TOKEN)
        );
        assert!(verify_stamp(&SECRET, &head.replica, &applied(&down)));
    }
}

#[test]
fn compressed_frames_open() {
    let key = seal_key(TOKEN);
    let parts = golden_parts_many(300);
    let body = encode_body(&parts).unwrap();
    assert!(body.len() > COMPRESS_ABOVE_BYTES);
    let (frame, _) = encode_down(&chain(1, NONCE_1, 0, 0), &parts, &SECRET, &key).unwrap();
    assert_eq!(frame[6], 1, "the compressed flag");
    assert!(frame.len() - HEAD_LEN < body.len() / 2);
    assert_eq!(open(&frame, &key, &Limits::default()).unwrap().parts, parts);
}

#[test]
fn pack_body_compresses_only_when_it_pays() {
    let small = vec![0u8; COMPRESS_ABOVE_BYTES];
    assert_eq!(
        pack_body(small.clone(), COMPRESS_ABOVE_BYTES),
        (small, false)
    );
    let mut rng = Rng::new(7);
    let noise: Vec<u8> = (0..10_000).map(|_| rng.next() as u8).collect();
    assert_eq!(
        pack_body(noise.clone(), COMPRESS_ABOVE_BYTES),
        (noise, false)
    );
    let zeros = vec![0u8; 10_000];
    let (packed, compressed) = pack_body(zeros.clone(), COMPRESS_ABOVE_BYTES);
    assert!(compressed && packed.len() < 100);
    assert_eq!(zstd::bulk::decompress(&packed, 10_000).unwrap(), zeros);
}

#[test]
fn every_flipped_byte_is_refused() {
    // A damaged header or body must never be applied: the seal covers bytes 0..124
    // (including the body's hash), the hash covers the body.
    let key = seal_key(TOKEN);
    let down = &golden_downs()[1];
    let (frame, _) = encode_down(&down.head, &down.parts, &SECRET, &key).unwrap();
    assert!(frame.len() > HEAD_LEN + 20);
    for at in 0..frame.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut flipped = frame.clone();
            flipped[at] ^= mask;
            let refused = open(&flipped, &key, &Limits::default())
                .err()
                .unwrap_or_else(|| panic!("byte {at} ^ {mask:#x} was taken"));
            if (8..72).contains(&at) || (76..HEAD_LEN).contains(&at) {
                assert_eq!(refused, Refused::BadSeal, "byte {at}");
            } else if (72..76).contains(&at) {
                assert_eq!(refused.kind(), "body-len", "byte {at}");
            } else if at >= HEAD_LEN {
                assert_eq!(refused, Refused::BadBody, "byte {at}");
            }
        }
    }
}

#[test]
fn truncated_frames_are_refused() {
    let key = seal_key(TOKEN);
    for down in golden_downs() {
        let (frame, _) = encode_down(&down.head, &down.parts, &SECRET, &key).unwrap();
        for cut in 0..frame.len() {
            assert!(open(&frame[..cut], &key, &Limits::default()).is_err());
        }
    }
    // Truncated bodies under a good seal reach the body decoder: refused, never a panic.
    let down = &golden_downs()[0];
    let body = encode_body(&down.parts).unwrap();
    for cut in 0..body.len() {
        let frame = raw_frame(&RawHead::of(&down.head, 0), &body[..cut], TOKEN);
        let refused = open(&frame, &key, &Limits::default()).unwrap_err();
        assert!(matches!(refused, Refused::Malformed { .. }), "{refused}");
    }
}

#[test]
fn random_bytes_under_a_good_seal_never_panic() {
    let key = seal_key(TOKEN);
    let mut rng = Rng::new(8);
    let head = chain(1, NONCE_1, 0, 0);
    for _ in 0..3_000 {
        let len = rng.below(64) as usize;
        let body: Vec<u8> = (0..len).map(|_| rng.small_byte()).collect();
        let frame = raw_frame(&RawHead::of(&head, 0), &body, TOKEN);
        if let Ok(down) = open(&frame, &key, &Limits::default()) {
            assert_eq!(encode_body(&down.parts).unwrap(), body);
        }
    }
}

#[test]
fn zip_bomb_stops_at_body_max() {
    // A compressed body that expands without end must be refused having allocated about
    // body_max, not what it expands to (here 64 times more).
    let one_mib = zstd::bulk::compress(&vec![0u8; 1 << 20], 3).unwrap();
    let bomb: Vec<u8> = one_mib.repeat(64);
    assert!(bomb.len() < 64 * 1024);
    let head = chain(1, NONCE_1, 0, 0);
    let frame = raw_frame(&RawHead::of(&head, 1), &bomb, TOKEN);
    let body_max = 1 << 20;
    let limits = Limits {
        frame_max: 1 << 20,
        body_max,
    };
    let key = seal_key(TOKEN);
    let before = peak_reset();
    let refused = open(&frame, &key, &limits).unwrap_err();
    let peak = peak_since(before);
    assert_eq!(refused.kind(), "body-too-large", "{refused}");
    assert!(
        peak >= body_max / 2,
        "the counter saw {peak} bytes: is the counting allocator installed?"
    );
    assert!(
        peak <= 2 * body_max + (256 << 10),
        "open allocated {peak} bytes for a body_max of {body_max}"
    );
    // With the default limits too: refused at 64 MiB, not 128.
    let bomb: Vec<u8> = one_mib.repeat(BODY_BYTES_MAX / (1 << 20) * 2);
    let frame = raw_frame(&RawHead::of(&head, 1), &bomb, TOKEN);
    let before = peak_reset();
    let refused = open(&frame, &key, &Limits::default()).unwrap_err();
    let peak = peak_since(before);
    assert_eq!(refused.kind(), "body-too-large", "{refused}");
    assert!(
        peak <= BODY_BYTES_MAX + (1 << 20),
        "open allocated {peak} bytes"
    );
}

#[test]
fn stamps_verify_only_their_own_fields() {
    let key = seal_key(TOKEN);
    let down = &golden_downs()[0];
    let (frame, stamped) = encode_down(&down.head, &down.parts, &SECRET, &key).unwrap();
    let opened = open(&frame, &key, &Limits::default()).unwrap();
    let good = applied(&opened);
    assert_eq!(good.stamp, stamped);
    assert_eq!(
        stamped,
        stamp(
            &SECRET,
            &REPLICA,
            &EPOCH,
            opened.head.seq,
            opened.head.nonce,
            &opened.body_hash
        )
    );
    assert!(verify_stamp(&SECRET, &REPLICA, &good));
    assert!(
        !verify_stamp(&[8; 32], &REPLICA, &good),
        "another epoch secret"
    );
    assert!(
        !verify_stamp(&SECRET, &[0x12; 16], &good),
        "another replica"
    );
    for change in 0..4 {
        let mut bad = good;
        match change {
            0 => bad.seq += 1,
            1 => bad.nonce ^= 1,
            2 => bad.body_hash[31] ^= 1,
            _ => bad.stamp[0] ^= 1,
        }
        assert!(!verify_stamp(&SECRET, &REPLICA, &bad), "change {change}");
    }
}

#[test]
#[should_panic(expected = "chain head a replica refuses")]
fn encode_head_refuses_a_broken_chain_head() {
    encode_head(
        &chain(0, NONCE_1, 0, 0),
        false,
        0,
        &[0; 32],
        &SECRET,
        &seal_key(TOKEN),
    );
}

#[test]
fn refusals_say_what_and_where() {
    let mut body = Raw::default();
    body.varint(1);
    body.part_header(
        "orders",
        0,
        &[("id", 1, 1, 0), ("customer", 1, 1, 0), ("total", 2, 0, 3)],
    );
    let frame = raw_frame(&RawHead::of(&chain(1, NONCE_1, 0, 0), 0), &body.0, TOKEN);
    let refused = open(&frame, &seal_key(TOKEN), &Limits::default()).unwrap_err();
    let text = refused.to_string();
    assert_eq!(refused.kind(), "key-part-gap");
    assert!(
        text.starts_with("message refused: table part 1 (\"orders\"): column 3 (\"total\")"),
        "{text}"
    );
    assert!(text.contains("key_part 3"), "{text}");
    assert!(Refused::BadSeal.to_string().contains("token"));
    assert!(Refused::LaterProtocol(2).to_string().contains("upgrade"));
}

// ---------------------------------------------------------------------------------------
// Reports up

#[test]
fn reports_roundtrip_at_random() {
    let mut rng = Rng::new(9);
    for _ in 0..500 {
        let up = rng.up();
        let bytes = encode_up(&up);
        assert_eq!(decode_up(&bytes, &Limits::default()).unwrap(), up);
        for cut in 0..bytes.len() {
            assert!(decode_up(&bytes[..cut], &Limits::default()).is_err());
        }
    }
}

#[test]
fn reports_over_their_limit_are_refused() {
    let mut bytes = encode_up(&Up::default());
    bytes.resize(UP_BYTES_MAX + 1, 0);
    let refused = decode_up(&bytes, &Limits::default()).unwrap_err();
    assert_eq!(refused.kind(), "up-too-large");
}

// ---------------------------------------------------------------------------------------
// Replica-written parts (docs/sync-up.md §4.1)

#[test]
fn replica_written_parts_roundtrip_with_their_lane() {
    // A part the replica writes carries flag bit 2 and, after its columns, the lane; no
    // rows. A decoder that lost the lane would create the table but never upload it.
    let part = written("sales", "main");
    let body = encode_body(std::slice::from_ref(&part)).unwrap();
    let mut raw = Raw::default();
    raw.varint(1);
    raw.part_header("sales", 4, &[("id", 1, 1, 1), ("note", 3, 0, 0)]);
    raw.str("main");
    raw.varint(0);
    raw.varint(0);
    assert_eq!(body, raw.0);
    assert_eq!(decode_body(&body).unwrap(), vec![part.clone()]);
    // Beside an ordinary part, in a frame.
    let parts = vec![golden_downs()[0].parts[0].clone(), part];
    let key = seal_key(TOKEN);
    let (frame, _) = encode_down(&chain(1, NONCE_1, 0, 0), &parts, &SECRET, &key).unwrap();
    assert_eq!(open(&frame, &key, &Limits::default()).unwrap().parts, parts);
}

#[test]
fn replica_written_parts_with_rows_or_sweeps_are_refused() {
    // A replica never sweeps a table it writes nor takes rows of it from the server: a
    // part that says both is a server bug, refused whole before anything is applied.
    let body = |flags: u8, lane: &str, deletes: u64, upserts: u64| {
        let mut raw = Raw::default();
        raw.varint(1);
        raw.part_header("sales", flags, &[("id", 1, 1, 1)]);
        if flags & 4 != 0 {
            raw.str(lane);
        }
        raw.varint(deletes);
        (0..deletes).for_each(|_| raw.bytes(&[1, 2]));
        raw.varint(upserts);
        (0..upserts).for_each(|_| raw.bytes(&[1, 4]));
        raw.0
    };
    let long = "l".repeat(64);
    let cases: [(u8, &str, u64, u64, &str, &str); 12] = [
        (
            4,
            "main",
            1,
            0,
            "replica-written-part",
            "delete count at byte 20",
        ),
        (
            4,
            "main",
            0,
            1,
            "replica-written-part",
            "upsert count at byte 21",
        ),
        (
            5,
            "main",
            0,
            0,
            "replica-written-part",
            "part flags at byte 7",
        ),
        (
            6,
            "main",
            0,
            0,
            "replica-written-part",
            "part flags at byte 7",
        ),
        (
            7,
            "main",
            1,
            1,
            "replica-written-part",
            "part flags at byte 7",
        ),
        // Bit 3 (two-way) comes only with bit 2; bits 4 to 7 are undefined.
        (8, "", 0, 0, "replica-written-part", "part flags at byte 7"),
        (9, "", 0, 0, "replica-written-part", "part flags at byte 7"),
        (0x20, "", 0, 0, "sweep-flags", "part flags at byte 7"),
        (0x84, "main", 0, 0, "sweep-flags", "part flags at byte 7"),
        (4, "", 0, 0, "lane-name-len", "lane name is 0 bytes"),
        (4, &long, 0, 0, "lane-name-len", "lane name is 64 bytes"),
        (4, "ma\0in", 0, 0, "name-nul", "lane name"),
    ];
    for (flags, lane, deletes, upserts, kind, says) in cases {
        let refused = decode_body(&body(flags, lane, deletes, upserts)).unwrap_err();
        assert_eq!(refused.kind(), kind, "flags {flags:#x}: {refused}");
        assert!(refused.to_string().contains(says), "{refused}");
        assert!(refused.to_string().contains("table part 1"), "{refused}");
    }
    // The flags of before still mean what they meant.
    for flags in 0..4 {
        assert!(decode_body(&body(flags, "", 1, 1)).is_ok(), "flags {flags}");
    }
    assert!(decode_body(&body(4, &"l".repeat(63), 0, 0)).is_ok());
}

#[test]
fn two_way_parts_roundtrip_with_their_owned_columns() {
    // A two-way part carries flag bits 2 and 3 and, after the lane, the count of the last
    // columns the replica writes. A decoder that lost the count would take the replica's
    // columns for the server's, and overwrite the replica's edits with the next rows.
    let part = two_way("orders", "orders", 2);
    let body = encode_body(std::slice::from_ref(&part)).unwrap();
    let mut raw = Raw::default();
    raw.varint(1);
    raw.part_header(
        "orders",
        0x0c,
        &[
            ("id", 1, 1, 1),
            ("total", 2, 0, 0),
            ("status", 3, 0, 0),
            ("picked_at", 1, 0, 0),
        ],
    );
    raw.str("orders");
    raw.varint(2);
    raw.varint(0);
    raw.varint(0);
    assert_eq!(body, raw.0);
    assert_eq!(body, reference_body(std::slice::from_ref(&part)));
    assert_eq!(decode_body(&body).unwrap(), vec![part.clone()]);
    // Every count that leaves the key to the server: 1 up to all the columns after it.
    for owned in 1..=3 {
        let part = two_way("orders", "orders", owned);
        let body = encode_body(std::slice::from_ref(&part)).unwrap();
        assert_eq!(body, reference_body(std::slice::from_ref(&part)));
        assert_eq!(decode_body(&body).unwrap(), vec![part], "owned {owned}");
    }
    // A count of two varint bytes, beside a record part and an ordinary one, in a frame.
    let wide = TablePart {
        columns: (0..200)
            .map(|i| column(&format!("c{i}"), u8::from(i == 0)))
            .collect(),
        writes: Some(Writes {
            lane: "wide".into(),
            owned: 150,
            restate: true,
        }),
        ..two_way("wide", "wide", 1)
    };
    let body = encode_body(std::slice::from_ref(&wide)).unwrap();
    assert_eq!(body, reference_body(std::slice::from_ref(&wide)));
    assert_eq!(decode_body(&body).unwrap(), vec![wide.clone()]);
    let parts = vec![
        golden_downs()[0].parts[0].clone(),
        written("sales", "main"),
        part,
        wide,
    ];
    let key = seal_key(TOKEN);
    let (frame, _) = encode_down(&chain(1, NONCE_1, 0, 0), &parts, &SECRET, &key).unwrap();
    assert_eq!(open(&frame, &key, &Limits::default()).unwrap().parts, parts);
}

#[test]
fn two_way_parts_whose_columns_do_not_fit_are_refused() {
    // The replica's columns are the last `owned`: at least one, never all, never a key
    // column. A count that breaks this would give the replica a key (or the server
    // nothing), so the part is refused whole, naming the byte of the count.
    // Name, affinity, not_null, key_part.
    type Columns<'a> = &'a [(&'a str, u8, u8, u8)];
    let body = |flags: u8, columns: Columns, owned: &[u8], rows: u64| {
        let mut raw = Raw::default();
        raw.varint(1);
        raw.part_header("sales", flags, columns);
        raw.str("main");
        raw.bytes(owned);
        raw.varint(rows);
        (0..rows).for_each(|_| raw.bytes(&[1, 2]));
        raw.varint(0);
        raw.0
    };
    let two = [("id", 1, 1, 1), ("note", 3, 0, 0)];
    let key_last = [("id", 1, 1, 1), ("note", 3, 0, 0), ("line", 1, 1, 2)];
    let keys_apart = [("line", 1, 1, 2), ("note", 3, 0, 0), ("id", 1, 1, 1)];
    // Part count (1), name (6), flags (1), column count (1), columns (3 + 3 and 5 + 3),
    // lane (5): the count is at byte 28; with a third column (5 + 3), at byte 36.
    let cases: [(Columns, &[u8], u64, &str, &str); 10] = [
        (
            &two,
            &[0],
            0,
            "replica-written-part",
            "writes at byte 28 is 0, of 2",
        ),
        (
            &two,
            &[2],
            0,
            "replica-written-part",
            "writes at byte 28 is 2, of 2",
        ),
        (
            &two,
            &[3],
            0,
            "replica-written-part",
            "writes at byte 28 is 3, of 2",
        ),
        (
            &two,
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
            0,
            "replica-written-part",
            "is 18446744073709551615, of 2",
        ),
        (
            &key_last,
            &[1],
            0,
            "replica-written-part",
            "writes at byte 36 is 1, of 3",
        ),
        (
            &keys_apart,
            &[2],
            0,
            "replica-written-part",
            "writes at byte 36 is 2, of 3",
        ),
        (
            &two,
            &[1],
            1,
            "replica-written-part",
            "delete count at byte 29",
        ),
        (&two, &[0x81, 0x00], 0, "varint-overlong", "table part 1"),
        (&two, &[], 0, "truncated", "table part 1"),
        (&two, &[0x80], 0, "truncated", "table part 1"),
    ];
    for (columns, owned, rows, kind, says) in cases {
        // A count missing or cut short: the body ends where it would (no row counts).
        let cut = if matches!(owned, [] | [0x80]) { 2 } else { 0 };
        let bytes = body(0x0c, columns, owned, rows);
        let refused = decode_body(&bytes[..bytes.len() - cut]).unwrap_err();
        assert_eq!(refused.kind(), kind, "{owned:?}: {refused}");
        assert!(refused.to_string().contains(says), "{refused}");
        assert!(refused.to_string().contains("table part 1"), "{refused}");
    }
    // With a sweep flag, and bit 3 without bit 2, before any count is read.
    for (flags, says) in [
        (0x0d, "part flags at byte 7"),
        (0x0e, "part flags at byte 7"),
        (0x08, "come only with bit 2"),
        (0x0b, "come only with bit 2"),
        (0x10, "come only with bit 2"),
    ] {
        let refused = decode_body(&body(flags, &two, &[1], 0)).unwrap_err();
        assert_eq!(
            refused.kind(),
            "replica-written-part",
            "{flags:#x}: {refused}"
        );
        assert!(refused.to_string().contains(says), "{refused}");
    }
    // What fits is taken: the key first or not, the count up to the columns after it.
    assert!(decode_body(&body(0x0c, &two, &[1], 0)).is_ok());
    let key_middle = [
        ("note", 3, 0, 0),
        ("id", 1, 1, 1),
        ("a", 3, 0, 0),
        ("b", 3, 0, 0),
    ];
    assert!(decode_body(&body(0x0c, &key_middle, &[2], 0)).is_ok());
    assert_eq!(
        decode_body(&body(0x0c, &key_middle, &[3], 0))
            .unwrap_err()
            .kind(),
        "replica-written-part"
    );
}

#[test]
fn encode_body_refuses_a_replica_written_part_a_replica_would() {
    type Breaker = Box<dyn Fn(&mut TablePart)>;
    let cases: Vec<(&str, Breaker)> = vec![
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| p.sweep.start = true),
        ),
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| p.sweep.end = true),
        ),
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| p.upserts.push(vec![Value::Int(1), Value::Null])),
        ),
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| p.deletes.push(vec![Value::Int(1)])),
        ),
        (
            "lane-name-len",
            Box::new(|p: &mut TablePart| p.writes = Some(Writes::record(""))),
        ),
        (
            "lane-name-len",
            Box::new(|p: &mut TablePart| p.writes = Some(Writes::record("l".repeat(64)))),
        ),
        (
            "name-nul",
            Box::new(|p: &mut TablePart| p.writes = Some(Writes::record("ma\0in"))),
        ),
        // Two-way: the replica's columns are the last `owned`, at least one, never all,
        // never a key column.
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| {
                p.columns.push(column("line", 2));
                p.writes = Some(owned_by_replica("main", 1));
            }),
        ),
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| {
                p.columns.rotate_left(1);
                p.writes = Some(owned_by_replica("main", 1));
            }),
        ),
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| p.writes = Some(owned_by_replica("main", 2))),
        ),
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| p.writes = Some(owned_by_replica("main", usize::MAX))),
        ),
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| {
                p.writes = Some(owned_by_replica("main", 1));
                p.sweep.end = true;
            }),
        ),
        (
            "replica-written-part",
            Box::new(|p: &mut TablePart| {
                p.writes = Some(owned_by_replica("main", 1));
                p.upserts.push(vec![Value::Int(1), Value::Null]);
            }),
        ),
        (
            "lane-name-len",
            Box::new(|p: &mut TablePart| p.writes = Some(owned_by_replica("", 1))),
        ),
    ];
    for (rule, break_it) in cases {
        let mut part = written("sales", "main");
        break_it(&mut part);
        match encode_body(&[part]) {
            Err(EncodeError::Invalid { rule: got, detail }) => {
                assert_eq!(got, rule, "{detail}");
                assert!(detail.contains("table part 1"), "{detail}");
            }
            other => panic!("expected {rule}, got {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Uploads and Filed (docs/sync-up.md §4.2, §4.3)

#[test]
fn uploads_roundtrip_at_random() {
    let mut rng = Rng::new(10);
    for round in 0..500 {
        let upload = rng.upload();
        let bytes = encode_upload(&upload).unwrap_or_else(|e| panic!("{round}: {e}"));
        let body = encode_body(&upload.parts).unwrap();
        let flags = u16::from(upload.restated);
        let lane = upload.lane.as_bytes();
        assert_eq!(
            bytes,
            raw_upload(flags, upload.id, upload.filed_n, lane, &body)
        );
        assert_eq!(decode_upload(&bytes).unwrap(), upload);
        for cut in 0..bytes.len() {
            assert!(decode_upload(&bytes[..cut]).is_err(), "a prefix of {cut}");
        }
    }
}

#[test]
fn encode_upload_refuses_what_a_server_would() {
    type Breaker = Box<dyn Fn(&mut Upload)>;
    let cases: Vec<(&str, Breaker)> = vec![
        ("upload-id-zero", Box::new(|u: &mut Upload| u.id = 0)),
        (
            "lane-name-len",
            Box::new(|u: &mut Upload| u.lane = String::new()),
        ),
        (
            "lane-name-len",
            Box::new(|u: &mut Upload| u.lane = "l".repeat(64)),
        ),
        (
            "name-nul",
            Box::new(|u: &mut Upload| u.lane = "sa\0les".into()),
        ),
        (
            "upload-part-flags",
            Box::new(|u: &mut Upload| u.parts[0].writes = Some(Writes::record("sales"))),
        ),
        (
            "upload-part-flags",
            Box::new(|u: &mut Upload| {
                u.parts[0].deletes.clear();
                u.parts[0].upserts.clear();
                u.parts[0].writes = Some(owned_by_replica("sales", 1));
            }),
        ),
        (
            "upload-part-flags",
            Box::new(|u: &mut Upload| u.parts[0].sweep.start = true),
        ),
        (
            "upload-rows-max",
            Box::new(|u: &mut Upload| u.parts = vec![sales_part(0, 600), sales_part(600, 401)]),
        ),
        (
            "upload-too-large",
            Box::new(|u: &mut Upload| u.parts = vec![blob_part(UPLOAD_BYTES_MAX)]),
        ),
        (
            "no-key",
            Box::new(|u: &mut Upload| u.parts[0].columns[0].key_part = 0),
        ),
    ];
    for (rule, break_it) in cases {
        let mut upload = golden_upload();
        break_it(&mut upload);
        match encode_upload(&upload) {
            Err(EncodeError::Invalid { rule: got, detail }) => assert_eq!(got, rule, "{detail}"),
            other => panic!("expected {rule}, got {other:?}"),
        }
    }
}

#[test]
fn uploads_at_their_limits_are_taken_and_past_them_refused() {
    // The replica packs up to exactly the limits; one row or one byte more is refused, the
    // rows before a single one of them is read (so a hostile count allocates nothing).
    let upload = |parts| Upload {
        parts,
        ..golden_upload()
    };
    let full = upload(vec![sales_part(0, 600), sales_part(600, 400)]);
    let bytes = encode_upload(&full).unwrap();
    assert_eq!(decode_upload(&bytes).unwrap(), full);
    let over = encode_body(&[sales_part(0, 600), sales_part(600, 401)]).unwrap();
    let refused = decode_upload(&raw_upload(0, 1, 0, b"sales", &over)).unwrap_err();
    assert_eq!(refused.kind(), "upload-rows-max", "{refused}");
    assert!(refused.to_string().contains("1001 rows"), "{refused}");

    let size = |blob: usize| encode_upload(&upload(vec![blob_part(blob)])).map(|b| b.len());
    let probe = UPLOAD_BYTES_MAX - 1000;
    let exact = probe + (UPLOAD_BYTES_MAX - size(probe).unwrap());
    let bytes = encode_upload(&upload(vec![blob_part(exact)])).unwrap();
    assert_eq!(bytes.len(), UPLOAD_BYTES_MAX);
    assert_eq!(decode_upload(&bytes).unwrap().parts[0], blob_part(exact));
    assert!(size(exact + 1).is_err());
    let mut longer = bytes;
    longer.push(0);
    assert_eq!(
        decode_upload(&longer).unwrap_err().kind(),
        "upload-too-large"
    );
}

#[test]
fn uploads_refuse_parts_that_are_not_rows() {
    // An upload carries rows a replica wrote: a sweep or a table to create in it is a
    // replica bug the server refuses whole, naming the byte.
    let body = encode_body(&[written("sales", "main")]).unwrap();
    let refused = decode_upload(&raw_upload(0, 1, 0, b"sales", &body)).unwrap_err();
    assert_eq!(refused.kind(), "upload-part-flags", "{refused}");
    // Fixed fields (24) and lane (6), then the part count (1) and name (6).
    assert!(
        refused.to_string().contains("part flags at byte 37"),
        "{refused}"
    );
}

#[test]
fn filed_roundtrips_at_random() {
    let key = seal_key(TOKEN);
    let mut rng = Rng::new(11);
    for _ in 0..500 {
        let filed = rng.filed();
        let bytes = encode_filed(&filed, &key, &REPLICA);
        assert_eq!(bytes, reference_filed(&filed, &REPLICA, TOKEN));
        assert_eq!(open_filed(&bytes, &key, &REPLICA).unwrap(), filed);
        for cut in 0..bytes.len() {
            assert!(open_filed(&bytes[..cut], &key, &REPLICA).is_err());
        }
    }
}

#[test]
fn filed_reasons_are_cut_at_a_character_boundary() {
    // The server's database gives reasons of any length; one too long must not make the
    // replica refuse the answer, and so send the same upload forever.
    let key = seal_key(TOKEN);
    for (reason, kept) in [
        ("é".repeat(600), "é".repeat(512)),
        (
            format!("ab{}", "€".repeat(400)),
            format!("ab{}", "€".repeat(340)),
        ),
        ("r".repeat(REASON_BYTES_MAX), "r".repeat(REASON_BYTES_MAX)),
    ] {
        let mut filed = golden_filed();
        filed.refused[0].reason = reason;
        let opened = open_filed(&encode_filed(&filed, &key, &REPLICA), &key, &REPLICA).unwrap();
        assert_eq!(opened.refused[0].reason, kept);
    }
}

#[test]
fn a_filed_opens_only_for_its_replica_and_token() {
    // A Filed makes a replica forget what it sent: one sealed for another replica (even
    // under the same token) or another token must not.
    let key = seal_key(TOKEN);
    let bytes = encode_filed(&golden_filed(), &key, &REPLICA);
    assert_eq!(open_filed(&bytes, &key, &REPLICA).unwrap(), golden_filed());
    assert_eq!(
        open_filed(&bytes, &key, &OTHER_REPLICA),
        Err(Refused::BadFiledSeal)
    );
    assert_eq!(
        open_filed(&bytes, &seal_key(OTHER_TOKEN), &REPLICA),
        Err(Refused::BadFiledSeal)
    );
    assert!(Refused::BadFiledSeal.to_string().contains("token"));
    assert_eq!(Refused::BadFiledSeal.kind(), "bad-filed-seal");
}

#[test]
fn every_flipped_byte_of_a_filed_is_refused() {
    // The seal covers every byte before it; only the fixed fields checked before the seal
    // (magic, protocol, flags) may be refused by another name.
    // (flags that stay defined, bits 0 and 1, reach the seal).
    let key = seal_key(TOKEN);
    let lines = golden_lines("filed.txt");
    for (name, _, bytes) in lines.iter().filter(|(_, outcome, _)| outcome == "ok") {
        assert!(open_filed(bytes, &key, &REPLICA).is_ok(), "{name}");
        for at in 0..bytes.len() {
            for mask in [0x01u8, 0x80, 0xff] {
                let mut flipped = bytes.clone();
                flipped[at] ^= mask;
                let refused = open_filed(&flipped, &key, &REPLICA)
                    .err()
                    .unwrap_or_else(|| panic!("{name}: byte {at} ^ {mask:#x} was taken"));
                let flags = u16::from_be_bytes([flipped[6], flipped[7]]);
                let expected = match at {
                    0..4 => "magic",
                    4..6 if flipped[4..6] == [0, 0] => "protocol-zero",
                    4..6 => "later-protocol",
                    6..8 if flags & !3 != 0 => "flags",
                    _ => "bad-filed-seal",
                };
                assert_eq!(refused.kind(), expected, "{name}: byte {at}: {refused}");
            }
        }
    }
}

#[test]
fn filed_over_its_limit_is_refused() {
    let mut bytes = encode_filed(&golden_filed(), &seal_key(TOKEN), &REPLICA);
    bytes.resize(FILED_BYTES_MAX + 1, 0);
    let refused = open_filed(&bytes, &seal_key(TOKEN), &REPLICA).unwrap_err();
    assert_eq!(refused.kind(), "filed-too-large");
    // The largest Filed the server can build fits: every row of a full upload refused,
    // each with the longest reason.
    let full = Filed {
        refused: (0..FILED_REFUSED_MAX)
            .map(|i| RefusedRow {
                table: "t".repeat(63),
                key: vec![Value::Blob(vec![0; UPLOAD_BYTES_MAX / FILED_REFUSED_MAX])],
                reason: format!("{i}").repeat(REASON_BYTES_MAX),
            })
            .collect(),
        ..golden_filed()
    };
    let bytes = encode_filed(&full, &seal_key(TOKEN), &REPLICA);
    assert!(bytes.len() <= FILED_BYTES_MAX);
    assert_eq!(
        open_filed(&bytes, &seal_key(TOKEN), &REPLICA)
            .unwrap()
            .refused
            .len(),
        FILED_REFUSED_MAX
    );
}

#[test]
#[should_panic(expected = "a Filed a replica refuses")]
fn encode_filed_refuses_an_id_of_zero() {
    let filed = Filed {
        id: 0,
        ..golden_filed()
    };
    encode_filed(&filed, &seal_key(TOKEN), &REPLICA);
}

#[test]
fn filed_dropped_rows_count_with_the_refused() {
    // Each row of an upload is filed, refused or dropped: the two lists together hold at
    // most one row per row of the largest upload, and a full one of each kind fits.
    let key = seal_key(TOKEN);
    let row = |i: usize| RefusedRow {
        table: "t".repeat(63),
        key: vec![Value::Blob(vec![0; UPLOAD_BYTES_MAX / FILED_REFUSED_MAX])],
        reason: format!("{i}").repeat(REASON_BYTES_MAX)[..REASON_BYTES_MAX].to_string(),
    };
    for refused in [0, 1, FILED_REFUSED_MAX / 2, FILED_REFUSED_MAX - 1] {
        let full = Filed {
            refused: (0..refused).map(row).collect(),
            dropped: (refused..FILED_REFUSED_MAX).map(row).collect(),
            ..golden_filed()
        };
        let bytes = encode_filed(&full, &key, &REPLICA);
        assert!(bytes.len() <= FILED_BYTES_MAX, "{refused} refused");
        let opened = open_filed(&bytes, &key, &REPLICA).unwrap();
        assert!(opened == full, "{refused} refused: not read back as sent");
    }
    // One past, sealed by the reference encoder (encode_filed refuses to build it): the
    // dropped count is refused before a dropped row is read.
    let small = |i: usize| RefusedRow {
        table: "t".into(),
        key: vec![Value::Int(i as i64)],
        reason: String::new(),
    };
    for refused in [0, 1, FILED_REFUSED_MAX / 2, FILED_REFUSED_MAX] {
        let over = Filed {
            refused: (0..refused).map(small).collect(),
            dropped: (refused..=FILED_REFUSED_MAX).map(small).collect(),
            ..golden_filed()
        };
        let bytes = reference_filed(&over, &REPLICA, TOKEN);
        let refused_as = open_filed(&bytes, &key, &REPLICA).unwrap_err();
        assert_eq!(refused_as.kind(), "refused-rows-max", "{refused_as}");
        assert!(
            refused_as.to_string().contains("the dropped row count"),
            "{refused_as}"
        );
    }
}

#[test]
#[should_panic(expected = "refused-rows-max")]
fn encode_filed_refuses_more_refused_and_dropped_rows_than_an_upload_has_rows() {
    let row = golden_filed().refused[0].clone();
    let filed = Filed {
        refused: vec![row.clone(); FILED_REFUSED_MAX / 2],
        dropped: vec![row; FILED_REFUSED_MAX / 2 + 1],
        ..golden_filed()
    };
    encode_filed(&filed, &seal_key(TOKEN), &REPLICA);
}

#[test]
#[should_panic(expected = "refused-rows-max")]
fn encode_filed_refuses_more_refusals_than_an_upload_has_rows() {
    let row = golden_filed().refused[0].clone();
    let filed = Filed {
        refused: vec![row; FILED_REFUSED_MAX + 1],
        ..golden_filed()
    };
    encode_filed(&filed, &seal_key(TOKEN), &REPLICA);
}

// ---------------------------------------------------------------------------------------
// Golden vectors

/// A message of `tests/golden/down.txt`, built here from fixed keys and nonces.
struct GoldenDown {
    name: &'static str,
    /// What `open` with `TOKEN`'s seal key gives: `ok` or a refusal kind.
    outcome: &'static str,
    token: &'static [u8],
    head: ChainHead,
    parts: Vec<TablePart>,
}

fn golden_downs() -> Vec<GoldenDown> {
    let customers = |sweep, upserts| TablePart {
        table: "customers".into(),
        columns: vec![
            column("id", 1),
            not_null(column("name", 0)),
            column("email", 0),
        ],
        sweep,
        deletes: vec![],
        upserts,
        writes: None,
    };
    let orders = |sweep, deletes, upserts| TablePart {
        table: "orders".into(),
        columns: vec![
            column("id", 1),
            not_null(column("customer_id", 0)),
            with_affinity(column("total", 0), Affinity::Real),
            with_affinity(column("note", 0), Affinity::Blob),
        ],
        sweep,
        deletes,
        upserts,
        writes: None,
    };
    let lines = TablePart {
        table: "order_lines".into(),
        columns: vec![column("line", 2), column("order_id", 1), column("qty", 0)],
        sweep: Sweep::default(),
        deletes: vec![vec![Value::Int(10), Value::Int(1)]],
        upserts: vec![vec![Value::Int(2), Value::Int(12), Value::Int(3)]],
        writes: None,
    };
    let whole = Sweep {
        start: true,
        end: true,
    };
    let snapshot = vec![
        customers(
            whole,
            vec![
                vec![Value::Int(1), text("Ada"), Value::Null],
                vec![
                    Value::Int(2),
                    text("Grace|Hopper"),
                    text("grace@example.org"),
                ],
            ],
        ),
        orders(
            whole,
            vec![],
            vec![
                vec![
                    Value::Int(10),
                    Value::Int(1),
                    Value::Real(12.5),
                    Value::Blob(vec![0xde, 0xad]),
                ],
                vec![Value::Int(11), Value::Int(2), Value::Null, Value::Null],
            ],
        ),
    ];
    let next = vec![
        orders(
            Sweep::default(),
            vec![vec![Value::Int(11)]],
            vec![vec![
                Value::Int(12),
                Value::Int(1),
                Value::Real(-0.25),
                Value::Null,
            ]],
        ),
        lines,
    ];
    vec![
        GoldenDown {
            name: "snapshot",
            outcome: "ok",
            token: TOKEN,
            head: chain(1, NONCE_1, 0, 0),
            parts: snapshot,
        },
        GoldenDown {
            name: "next",
            outcome: "ok",
            token: TOKEN,
            head: chain(2, NONCE_2, 1, NONCE_1),
            parts: next.clone(),
        },
        GoldenDown {
            name: "compressed",
            outcome: "ok",
            token: TOKEN,
            head: chain(3, NONCE_3, 2, NONCE_2),
            parts: golden_parts_many(200),
        },
        GoldenDown {
            name: "heartbeat",
            outcome: "ok",
            token: TOKEN,
            head: chain(4, NONCE_4, 3, NONCE_3),
            parts: vec![],
        },
        GoldenDown {
            name: "other-token",
            outcome: "bad-seal",
            token: OTHER_TOKEN,
            head: chain(2, NONCE_2, 1, NONCE_1),
            parts: next,
        },
        // The announcement of a two-way table (flag bits 2 and 3, the lane, then the count
        // of the replica's columns: status and picked_at) beside a record table's.
        GoldenDown {
            name: "two-way",
            outcome: "ok",
            token: TOKEN,
            head: chain(5, NONCE_5, 4, NONCE_4),
            parts: vec![two_way("orders", "orders", 2), written("sales", "main")],
        },
    ]
}

fn golden_parts_many(rows: i64) -> Vec<TablePart> {
    vec![TablePart {
        table: "customers".into(),
        columns: vec![
            column("id", 1),
            not_null(column("name", 0)),
            column("email", 0),
        ],
        sweep: Sweep {
            start: true,
            end: false,
        },
        deletes: vec![],
        upserts: (1..=rows)
            .map(|i| {
                vec![
                    Value::Int(i),
                    text(&format!("customer number {i}")),
                    text(&format!("customer-{i}@example.org")),
                ]
            })
            .collect(),
        writes: None,
    }]
}

fn golden_ups() -> Vec<(&'static str, Up)> {
    vec![
        ("nothing-yet", Up::default()),
        (
            "full",
            Up {
                applied: Some(Applied {
                    epoch: EPOCH,
                    seq: 2,
                    nonce: NONCE_2,
                    body_hash: [0xab; 32],
                    stamp: [0xcd; 16],
                }),
                gap: 5,
                rejections: vec![Rejection {
                    table: "orders".into(),
                    key: vec![Value::Int(12)],
                    reason: "CHECK constraint failed: total >= 0".into(),
                    seq: 2,
                }],
                digests: vec![Digest {
                    table: "customers".into(),
                    rows: 2,
                    fingerprint: 0x0123_4567_89ab_cdef,
                }],
            },
        ),
    ]
}

/// The upload of `tests/golden/upload.txt`: one lane's rows of a `record` table, one
/// written and one deleted since the last turn.
fn golden_upload() -> Upload {
    Upload {
        restated: false,
        id: 0x5eed_0000_0000_0001,
        filed_n: 41,
        lane: "sales".into(),
        parts: vec![TablePart {
            table: "sales".into(),
            columns: sales_columns(),
            sweep: Sweep::default(),
            deletes: vec![vec![Value::Int(7)]],
            upserts: vec![vec![
                Value::Int(8),
                text("3f2a9c1e-7b4d-4e8a-9f00-112233445566"),
                Value::Real(19.5),
            ]],
            writes: None,
        }],
    }
}

/// A lane's full upload (1,000 sales) goes compressed (flag bit 1) when that is smaller,
/// reads back as it was, and encodes back to the same bytes; a small one stays plain.
#[test]
fn uploads_compress_when_it_pays_and_read_back() {
    let mut upload = golden_upload();
    upload.parts[0].deletes.clear();
    upload.parts[0].upserts = (0..1_000)
        .map(|i| {
            vec![
                Value::Int(i),
                text(&format!("3f2a9c1e-7b4d-4e8a-9f00-{i:012}")),
                Value::Real(i as f64 / 4.0),
            ]
        })
        .collect();
    let bytes = encode_upload(&upload).unwrap();
    let plain = encode_body(&upload.parts).unwrap().len();
    assert_eq!(u16::from_be_bytes([bytes[6], bytes[7]]), 2, "compressed");
    assert!(bytes.len() * 2 < plain, "{} of {plain} bytes", bytes.len());
    let read = decode_upload(&bytes).unwrap();
    assert_eq!(read, upload);
    assert_eq!(encode_upload(&read).unwrap(), bytes);
    let small = encode_upload(&golden_upload()).unwrap();
    assert_eq!(
        u16::from_be_bytes([small[6], small[7]]),
        0,
        "a small body stays plain"
    );
}

/// The `Filed` of `tests/golden/filed.txt`: the answer to [`golden_upload`] from a server
/// that had filed 17 uploads of this replica when the upload said 41, so it lost filings.
fn golden_filed() -> Filed {
    Filed {
        id: 0x5eed_0000_0000_0001,
        filed_n: 42,
        refile_after: 17,
        refused: vec![RefusedRow {
            table: "sales".into(),
            key: vec![Value::Int(8)],
            reason: "store_id names another replica".into(),
        }],
        dropped: vec![],
        stale: None,
    }
}

/// The `Filed` of `tests/golden/filed.txt`'s `filed-stale`: the answer to an upload older
/// than one the server filed (a transport delivered it late): flag bit 1, no rows, and
/// the newest id filed after the lists.
fn golden_filed_stale() -> Filed {
    Filed {
        id: 0x5eed_0000_0000_0003,
        filed_n: 43,
        refile_after: 0,
        refused: vec![],
        dropped: vec![],
        stale: Some(0x5eed_0000_0000_0009),
    }
}

/// The `Filed` of `tests/golden/filed.txt`'s `filed-dropped`: the answer to an upload of
/// a two-way table's rows, one refused and two dropped (the server deleted one row and
/// took the other back), so flag bit 0 is set and a second list follows the first.
fn golden_filed_dropped() -> Filed {
    Filed {
        id: 0x5eed_0000_0000_0002,
        filed_n: 43,
        refile_after: 0,
        refused: vec![RefusedRow {
            table: "orders".into(),
            key: vec![Value::Int(10)],
            reason: "CHECK constraint failed: status".into(),
        }],
        dropped: vec![
            RefusedRow {
                table: "orders".into(),
                key: vec![Value::Int(11)],
                reason: "the row was deleted".into(),
            },
            RefusedRow {
                table: "order_lines".into(),
                key: vec![Value::Int(12), Value::Int(2)],
                reason: "the row was taken back".into(),
            },
        ],
        stale: None,
    }
}

/// The lines of `tests/golden/filed.txt`: a name, what `open_filed` for `REPLICA` gives,
/// the replica it is sealed for, and the `Filed`.
fn golden_fileds() -> [(&'static str, &'static str, [u8; 16], Filed); 4] {
    [
        ("filed", "ok", REPLICA, golden_filed()),
        (
            "other-replica",
            "bad-filed-seal",
            OTHER_REPLICA,
            golden_filed(),
        ),
        ("filed-dropped", "ok", REPLICA, golden_filed_dropped()),
        ("filed-stale", "ok", REPLICA, golden_filed_stale()),
    ]
}

#[test]
fn golden_upload_and_filed_vectors_are_reproduced_and_read() {
    let lines = golden_lines("upload.txt");
    assert_eq!(lines.len(), 1, "upload.txt has one line");
    let (name, outcome, bytes) = &lines[0];
    assert_eq!((name.as_str(), outcome.as_str()), ("sales", "ok"));
    let upload = golden_upload();
    assert_eq!(
        encode_upload(&upload).unwrap(),
        *bytes,
        "the encoding of an upload changed"
    );
    let body = encode_body(&upload.parts).unwrap();
    assert_eq!(
        *bytes,
        raw_upload(0, upload.id, upload.filed_n, b"sales", &body)
    );
    assert_eq!(decode_upload(bytes).unwrap(), upload);

    let key = seal_key(TOKEN);
    let lines = golden_lines("filed.txt");
    assert_eq!(lines.len(), golden_fileds().len());
    for ((name, outcome, bytes), (expected_name, expected, sealed_for, golden)) in
        lines.iter().zip(golden_fileds())
    {
        assert_eq!((name.as_str(), outcome.as_str()), (expected_name, expected));
        assert_eq!(
            encode_filed(&golden, &key, &sealed_for),
            *bytes,
            "{name}: the encoding of a Filed changed"
        );
        assert_eq!(
            *bytes,
            reference_filed(&golden, &sealed_for, TOKEN),
            "{name}"
        );
        // Flag bit 0 says whether the list of dropped rows follows, bit 1 whether the
        // upload was stale.
        let flags = u16::from_be_bytes([bytes[6], bytes[7]]);
        assert_eq!(
            flags,
            u16::from(!golden.dropped.is_empty()) | u16::from(golden.stale.is_some()) << 1,
            "{name}"
        );
        match open_filed(bytes, &key, &REPLICA) {
            Ok(filed) => {
                assert_eq!(*outcome, "ok", "{name}");
                assert_eq!(filed, golden, "{name}");
            }
            Err(refused) => assert_eq!(refused.kind(), outcome, "{name}: {refused}"),
        }
    }
}

#[test]
fn golden_down_vectors_are_reproduced_and_open() {
    let key = seal_key(TOKEN);
    let lines = golden_lines("down.txt");
    let downs = golden_downs();
    assert_eq!(
        lines.len(),
        downs.len(),
        "down.txt has one line per golden message"
    );
    for ((name, outcome, bytes), down) in lines.iter().zip(&downs) {
        assert_eq!(name, down.name);
        assert_eq!(outcome, down.outcome, "{name}");
        let (frame, _) =
            encode_down(&down.head, &down.parts, &SECRET, &seal_key(down.token)).unwrap();
        let carried = &bytes[HEAD_LEN..];
        let body = if bytes[6] == 1 {
            zstd::bulk::decompress(carried, 1 << 20).unwrap()
        } else {
            carried.to_vec()
        };
        assert_eq!(
            body,
            reference_body(&down.parts),
            "{name}: the body is not the layout's"
        );
        if frame != *bytes {
            // Only zstd's output may differ (a newer zstd): the head over the golden body
            // and the body it decompresses to must still match.
            assert_eq!(
                bytes[6], 1,
                "{name}: the encoding of an uncompressed message changed"
            );
            assert_eq!(
                body,
                encode_body(&down.parts).unwrap(),
                "{name}: the body changed"
            );
            let (head, _) = encode_head(
                &down.head,
                true,
                carried.len() as u32,
                &body_hash(carried),
                &SECRET,
                &seal_key(down.token),
            );
            assert_eq!(&head[..], &bytes[..HEAD_LEN], "{name}: the head changed");
        }
        assert_eq!(
            *bytes,
            raw_frame(&RawHead::of(&down.head, bytes[6]), carried, down.token),
            "{name}"
        );
        match open(bytes, &key, &Limits::default()) {
            Ok(opened) => {
                assert_eq!(*outcome, "ok", "{name}");
                assert_eq!(opened.head, down.head, "{name}");
                assert_eq!(opened.parts, down.parts, "{name}");
                assert!(verify_stamp(&SECRET, &REPLICA, &applied(&opened)), "{name}");
            }
            Err(refused) => assert_eq!(refused.kind(), outcome, "{name}: {refused}"),
        }
    }
}

#[test]
fn golden_up_vectors_are_reproduced_and_read() {
    let lines = golden_lines("up.txt");
    let ups = golden_ups();
    assert_eq!(lines.len(), ups.len());
    for ((name, outcome, bytes), (expected_name, up)) in lines.iter().zip(&ups) {
        assert_eq!(name, expected_name);
        assert_eq!(outcome, "ok");
        assert_eq!(encode_up(up), *bytes, "{name}: the encoding changed");
        assert_eq!(
            decode_up(bytes, &Limits::default()).as_ref(),
            Ok(up),
            "{name}"
        );
    }
}

#[test]
fn malformed_corpus_is_refused_rule_by_rule() {
    let key = seal_key(TOKEN);
    for (name, kind, bytes) in golden_lines("malformed.txt") {
        let refused = if name.starts_with("down-") {
            open(&bytes, &key, &corpus_limits()).err()
        } else if name.starts_with("upload-") {
            decode_upload(&bytes).err()
        } else if name.starts_with("filed-") {
            open_filed(&bytes, &key, &REPLICA).err()
        } else {
            assert!(
                name.starts_with("up-"),
                "{name}: a name starts with down-, up-, upload- or filed-"
            );
            decode_up(&bytes, &corpus_limits()).err()
        };
        let refused = refused.unwrap_or_else(|| panic!("{name} was taken"));
        assert_eq!(refused.kind(), kind, "{name}: {refused}");
    }
}

#[test]
fn malformed_corpus_covers_every_rule() {
    let kinds: Vec<String> = golden_lines("malformed.txt")
        .into_iter()
        .map(|(_, kind, _)| kind)
        .collect();
    let mut expected: Vec<&str> = Rule::ALL.iter().map(|rule| rule.name()).collect();
    // A report over 4 MiB would be an 8 MiB line: reports_over_their_limit_are_refused;
    // likewise uploads_at_their_limits_are_taken_and_past_them_refused and
    // filed_over_its_limit_is_refused.
    let too_large = ["up-too-large", "upload-too-large", "filed-too-large"];
    expected.retain(|kind| !too_large.contains(kind));
    expected.extend(["later-protocol", "bad-seal", "bad-body", "bad-filed-seal"]);
    for kind in expected {
        assert!(
            kinds.iter().any(|k| k == kind),
            "malformed.txt has no case of {kind}"
        );
    }
}

/// Guards the golden files against an encoder that drifts: each is compared with what the
/// encoders write today. With `FERRY_GOLDEN_WRITE=1` they are rewritten instead.
#[test]
fn golden_files_are_what_the_encoders_write() {
    let mut down = String::from(
        "# ferry-sync protocol v1, messages down: name, what open() gives, the frame in hex.\n\
         # Keys: epoch secret [7; 32], opened with seal_key(b\"token-1\"); replica 0x11 x 16,\n\
         # epoch e0..ef. Built by golden_downs() in tests/wire.rs; regenerate with\n\
         # FERRY_GOLDEN_WRITE=1 cargo test -p ferry-sync --test wire golden_files\n",
    );
    for message in golden_downs() {
        let (frame, _) = encode_down(
            &message.head,
            &message.parts,
            &SECRET,
            &seal_key(message.token),
        )
        .unwrap();
        writeln!(down, "{} {} {}", message.name, message.outcome, hex(&frame)).unwrap();
    }
    let mut up = String::from(
        "# ferry-sync protocol v1, reports up: name, what decode_up() gives, the report in hex.\n\
         # Built by golden_ups() in tests/wire.rs.\n",
    );
    for (name, report) in golden_ups() {
        writeln!(up, "{name} ok {}", hex(&encode_up(&report))).unwrap();
    }
    let mut upload = String::from(
        "# ferry-sync protocol v1, uploads: name, what decode_upload() gives, the upload in\n\
         # hex. Built by golden_upload() in tests/wire.rs.\n",
    );
    writeln!(
        upload,
        "sales ok {}",
        hex(&encode_upload(&golden_upload()).unwrap())
    )
    .unwrap();
    let mut filed = String::from(
        "# ferry-sync protocol v1, Filed answers: name, what open_filed() with\n\
         # seal_key(b\"token-1\") and replica 0x11 x 16 gives, the Filed in hex. Built by\n\
         # golden_filed() and golden_fileds() in tests/wire.rs.\n",
    );
    for (name, outcome, sealed_for, golden) in golden_fileds() {
        let bytes = encode_filed(&golden, &seal_key(TOKEN), &sealed_for);
        writeln!(filed, "{name} {outcome} {}", hex(&bytes)).unwrap();
    }
    let mut malformed = String::from(
        "# ferry-sync protocol v1, malformed messages: name (down- for open(), up- for\n\
         # decode_up(), upload- for decode_upload(), filed- for open_filed() with replica\n\
         # 0x11 x 16), the refusal kind (Refused::kind), the bytes in hex. Opened with\n\
         # seal_key(b\"token-1\") and frame_max 1024, body_max 4096; sealed and stamped like\n\
         # down.txt, so each reaches the check it breaks. Built by malformed_cases() in\n\
         # tests/wire.rs. up-, upload- and filed-too-large (lines of megabytes) are tested\n\
         # in code instead.\n",
    );
    for (name, kind, bytes) in malformed_cases() {
        writeln!(malformed, "{name} {kind} {}", hex(&bytes)).unwrap();
    }
    let write = std::env::var_os("FERRY_GOLDEN_WRITE").is_some();
    for (file, text) in [
        ("down.txt", down),
        ("up.txt", up),
        ("upload.txt", upload),
        ("filed.txt", filed),
        ("malformed.txt", malformed),
    ] {
        let path = golden_path(file);
        if write {
            std::fs::write(&path, text).unwrap();
            continue;
        }
        let stored = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            stored == text,
            "{} is not what the encoders write now: an encoding changed. If the protocol \
             changed on purpose (with a new PROTOCOL), rewrite it with FERRY_GOLDEN_WRITE=1",
            path.display()
        );
    }
}

/// One malformed message per rule (some rules twice, from both ends of a range).
fn malformed_cases() -> Vec<(String, &'static str, Vec<u8>)> {
    let mut cases = Vec::new();
    let mut down = |name: &str, kind: &'static str, frame: Vec<u8>| {
        cases.push((format!("down-{name}"), kind, frame));
    };
    let head = chain(2, NONCE_2, 1, NONCE_1);
    let good_body = base_body(|_| {});
    let sealed = |edit: &dyn Fn(&mut RawHead)| {
        let mut raw = RawHead::of(&head, 0);
        edit(&mut raw);
        raw_frame(&raw, &good_body, TOKEN)
    };
    let good = sealed(&|_| {});
    down("frame-short", "frame-short", good[..HEAD_LEN - 1].to_vec());
    down("magic", "magic", sealed(&|h| h.magic = *b"FSU1"));
    down(
        "later-protocol",
        "later-protocol",
        sealed(&|h| h.protocol = PROTOCOL + 1),
    );
    down(
        "protocol-zero",
        "protocol-zero",
        sealed(&|h| h.protocol = 0),
    );
    down("flags", "flags", sealed(&|h| h.flags = 0x80));
    down("reserved", "reserved", sealed(&|h| h.reserved = 1));
    down(
        "body-len",
        "body-len",
        sealed(&|h| h.body_len = Some(good_body.len() as u32 + 1)),
    );
    let long = base_body(|b| b.text_value = "x".repeat(1100));
    down(
        "frame-too-large",
        "frame-too-large",
        raw_frame(&RawHead::of(&head, 0), &long, TOKEN),
    );
    let mut bad_seal = good.clone();
    bad_seal[HEAD_LEN - 1] ^= 1;
    down("bad-seal", "bad-seal", bad_seal);
    let mut bad_body = good.clone();
    *bad_body.last_mut().unwrap() ^= 1;
    down("bad-body", "bad-body", bad_body);
    down("seq-zero", "seq-zero", sealed(&|h| h.seq = 0));
    down("nonce-zero", "nonce-range", sealed(&|h| h.nonce = 0));
    down("nonce-high", "nonce-range", sealed(&|h| h.nonce = 1 << 63));
    down(
        "prev-is-seq",
        "prev-not-before-seq",
        sealed(&|h| h.prev = 2),
    );
    down(
        "prev-without-nonce",
        "prev-nonce-pair",
        sealed(&|h| h.prev_nonce = 0),
    );
    down(
        "nonce-without-prev",
        "prev-nonce-pair",
        sealed(&|h| h.prev = 0),
    );
    down(
        "prev-nonce-high",
        "prev-nonce-range",
        sealed(&|h| h.prev_nonce = 1 << 63),
    );
    let compressed = |body: &[u8]| raw_frame(&RawHead::of(&head, 1), body, TOKEN);
    down("not-zstd", "zstd", compressed(b"not zstd at all"));
    down(
        "zstd-cut",
        "zstd",
        compressed(&zstd::bulk::compress(&good_body, 3).unwrap()[..10]),
    );
    let expands = zstd::bulk::compress(&[0u8; 5000], 3).unwrap();
    down("body-too-large", "body-too-large", compressed(&expands));
    let mut body_cases: Vec<(&str, &'static str, Vec<u8>)> = vec![
        (
            "truncated",
            "truncated",
            good_body[..good_body.len() - 1].to_vec(),
        ),
        ("empty-body", "truncated", vec![]),
        (
            "varint-overlong",
            "varint-overlong",
            [&[0x81, 0x00][..], &good_body[1..]].concat(),
        ),
        ("varint-overflow", "varint-overflow", vec![0xff; 11]),
        (
            "count-exceeds-bytes",
            "count-exceeds-bytes",
            [&[0x80, 0x80, 0x80, 0x80, 0x40][..], &good_body[1..]].concat(),
        ),
        (
            "trailing-bytes",
            "trailing-bytes",
            [&good_body[..], &[0]].concat(),
        ),
    ];
    let mut part =
        |name, kind, edit: &dyn Fn(&mut BasePart)| body_cases.push((name, kind, base_body(edit)));
    part("value-tag", "value-tag", &|b| {
        b.upsert_raw = Some(vec![0x01, 0x02, 0x09])
    });
    part("table-name-not-utf8", "not-utf8", &|b| {
        b.table = vec![0xff, 0xfe]
    });
    part("text-not-utf8", "not-utf8", &|b| {
        b.upsert_raw = Some(vec![0x01, 0x02, 0x03, 0x01, 0xff])
    });
    part("real-nan", "real-nan", &|b| {
        b.upsert_raw = Some(unhex("0102027ff8000000000000"))
    });
    // Bits 3 (two-way) and 4 (restate) are defined now, refused without bit 2: bit 5 is
    // the first undefined.
    part("sweep-flags", "sweep-flags", &|b| b.flags = 0x20);
    part("sweep-flags-high", "sweep-flags", &|b| b.flags = 0x8c);
    part("two-way-without-writes", "replica-written-part", &|b| {
        b.flags = 8
    });
    part("restate-without-writes", "replica-written-part", &|b| {
        b.flags = 0x10
    });
    let two_way_part = |b: &mut BasePart, owned: u64| {
        b.flags = 0x0c;
        b.lane = Some("main");
        b.owned = Some(owned);
    };
    part("two-way-owned-zero", "replica-written-part", &|b| {
        two_way_part(b, 0)
    });
    part("two-way-owned-all", "replica-written-part", &|b| {
        two_way_part(b, 2)
    });
    part("two-way-owned-over", "replica-written-part", &|b| {
        two_way_part(b, 3)
    });
    part("two-way-owned-key", "replica-written-part", &|b| {
        two_way_part(b, 1);
        b.columns.push(("line", 1, 1, 2));
    });
    part("two-way-with-rows", "replica-written-part", &|b| {
        two_way_part(b, 1)
    });
    part("two-way-with-sweep", "replica-written-part", &|b| {
        two_way_part(b, 1);
        b.flags = 0x0e;
    });
    part("writes-with-rows", "replica-written-part", &|b| {
        b.flags = 4;
        b.lane = Some("main");
    });
    part("writes-with-sweep", "replica-written-part", &|b| {
        b.flags = 5;
        b.lane = Some("main");
    });
    part("lane-name-empty", "lane-name-len", &|b| {
        b.flags = 4;
        b.lane = Some("");
    });
    part("table-name-empty", "table-name-len", &|b| b.table = vec![]);
    part("table-name-64", "table-name-len", &|b| {
        b.table = vec![b't'; 64]
    });
    part("table-name-nul", "name-nul", &|b| {
        b.table = b"or\0ders".to_vec()
    });
    part("column-name-nul", "name-nul", &|b| {
        b.columns[1].0 = "no\0te"
    });
    part("table-name-sqlite", "table-name-reserved", &|b| {
        b.table = b"sqlite_stat1".to_vec()
    });
    part("table-name-ferry", "table-name-reserved", &|b| {
        b.table = b"_FERRY_SYNC_state".to_vec()
    });
    part("column-count-zero", "column-count", &|b| {
        b.column_count = Some(0)
    });
    part("column-count-1001", "column-count", &|b| {
        b.column_count = Some(1001)
    });
    part("column-count-beyond-bytes", "count-exceeds-bytes", &|b| {
        b.column_count = Some(900)
    });
    part("column-name-empty", "column-name-len", &|b| {
        b.columns[1].0 = ""
    });
    part("column-name-64", "column-name-len", &|b| {
        b.columns[1].0 = LONG_NAME
    });
    part("column-name-duplicate", "column-name-duplicate", &|b| {
        b.columns[1].0 = "ID"
    });
    part("affinity-zero", "affinity", &|b| b.columns[1].1 = 0);
    part("affinity-five", "affinity", &|b| b.columns[1].1 = 5);
    part("not-null-byte", "not-null-byte", &|b| b.columns[1].2 = 2);
    part("no-key", "no-key", &|b| b.columns[0].3 = 0);
    part("key-part-duplicate", "key-part-duplicate", &|b| {
        b.columns[1].3 = 1
    });
    part("key-part-gap", "key-part-gap", &|b| b.columns[1].3 = 3);
    part("null-in-not-null-upsert", "null-in-not-null", &|b| {
        b.upsert_raw = Some(vec![0x00, 0x00])
    });
    part("null-in-not-null-delete", "null-in-not-null", &|b| {
        b.delete_raw = Some(vec![0x00])
    });
    part("upsert-count-beyond-bytes", "count-exceeds-bytes", &|b| {
        b.upsert_count = Some(1000)
    });
    for (name, kind, body) in body_cases {
        down(name, kind, raw_frame(&RawHead::of(&head, 0), &body, TOKEN));
    }

    let good_up = encode_up(&golden_ups()[1].1);
    let mut up = |name: &str, kind: &'static str, bytes: Vec<u8>| {
        cases.push((format!("up-{name}"), kind, bytes));
    };
    let with = |at: usize, bytes: &[u8]| {
        let mut changed = good_up.clone();
        changed[at..at + bytes.len()].copy_from_slice(bytes);
        changed
    };
    up("magic", "magic", with(0, b"FSD1"));
    up("later-protocol", "later-protocol", with(4, &[0, 2]));
    up("protocol-zero", "protocol-zero", with(4, &[0, 0]));
    up("flags", "flags", with(6, &[1]));
    up("reserved", "reserved", with(7, &[1]));
    up("applied-byte", "applied-byte", with(8, &[2]));
    up("applied-seq-zero", "seq-zero", with(25, &[0; 8]));
    up("applied-nonce-zero", "nonce-range", with(33, &[0; 8]));
    up(
        "truncated",
        "truncated",
        good_up[..good_up.len() - 1].to_vec(),
    );
    up(
        "trailing-bytes",
        "trailing-bytes",
        [&good_up[..], &[0]].concat(),
    );
    let mut report = Raw::default();
    report.bytes(b"FSU1\x00\x01\x00\x00\x00");
    report.u64(0);
    let fixed = report.0.clone();
    let tail = |bytes: &[u8]| [&fixed[..], bytes].concat();
    up("rejections-max", "rejections-max", tail(&[0x91, 0x4e])); // 10001
    up(
        "rejections-beyond-bytes",
        "count-exceeds-bytes",
        tail(&[0x64, 0x00]),
    );
    up("digests-max", "digests-max", tail(&[0x00, 0xe9, 0x07])); // 1001
    up(
        "digest-count-overlong",
        "varint-overlong",
        tail(&[0x00, 0x80, 0x00]),
    );
    let rejection = |table: &str, key: &[u8], reason_len: usize| {
        let mut raw = Raw::default();
        raw.varint(1);
        raw.str(table);
        raw.bytes(key);
        raw.str(&"r".repeat(reason_len));
        raw.u64(1);
        raw.varint(0);
        tail(&raw.0)
    };
    up(
        "reason-len",
        "reason-len",
        rejection("orders", &[1, 1, 2], 1025),
    );
    up(
        "rejection-key-empty",
        "rejection-key-len",
        rejection("orders", &[0], 3),
    );
    up(
        "rejection-key-nan",
        "real-nan",
        rejection("orders", &unhex("01027ff8000000000000"), 3),
    );
    up(
        "rejection-table-reserved",
        "table-name-reserved",
        rejection("sqlite_master", &[1, 1, 2], 3),
    );
    let mut digest = Raw::default();
    digest.varint(0);
    digest.varint(1);
    digest.str("_ferry_sync_state");
    digest.u64(1);
    digest.u64(2);
    up(
        "digest-table-reserved",
        "table-name-reserved",
        tail(&digest.0),
    );
    malformed_uploads(&mut cases);
    malformed_fileds(&mut cases);
    cases
}

/// The bytes of `good` with `patch` written at `at`.
fn patched(good: &[u8], at: usize, patch: &[u8]) -> Vec<u8> {
    let mut changed = good.to_vec();
    changed[at..at + patch.len()].copy_from_slice(patch);
    changed
}

/// One malformed upload per rule `decode_upload` adds to the body's.
fn malformed_uploads(cases: &mut Vec<(String, &'static str, Vec<u8>)>) {
    let good = encode_upload(&golden_upload()).unwrap();
    let body = encode_body(&golden_upload().parts).unwrap();
    let mut upload = |name: &str, kind: &'static str, bytes: Vec<u8>| {
        cases.push((format!("upload-{name}"), kind, bytes));
    };
    upload("magic", "magic", patched(&good, 0, b"FSU1"));
    upload(
        "later-protocol",
        "later-protocol",
        patched(&good, 4, &[0, 2]),
    );
    upload("protocol-zero", "protocol-zero", patched(&good, 4, &[0, 0]));
    // Bit 0 restated, bit 1 compressed; bit 2 is the first undefined.
    upload("flags", "flags", patched(&good, 6, &[0, 4]));
    // Flag bit 1: the body is zstd; one that is not, or that opens past the upload's
    // limit, is refused before a row is read.
    upload(
        "zstd-not",
        "zstd",
        raw_upload(2, 0x5eed_0000_0000_0001, 41, b"sales", &body),
    );
    // Two zstd frames, each within the window a server allows, opening to one byte more
    // than an upload may hold.
    let half = UPLOAD_BYTES_MAX / 2;
    let (first, packed) = pack_body(vec![0u8; half], 0);
    let (second, packed_too) = pack_body(vec![0u8; UPLOAD_BYTES_MAX - half + 1], 0);
    assert!(packed && packed_too);
    let bomb = [first, second].concat();
    upload(
        "zstd-over-limit",
        "body-too-large",
        raw_upload(2, 0x5eed_0000_0000_0001, 41, b"sales", &bomb),
    );
    upload("flags-high", "flags", patched(&good, 6, &[0x80, 0]));
    upload("id-zero", "upload-id-zero", patched(&good, 8, &[0; 8]));
    let with_lane = |lane: &[u8]| raw_upload(0, 1, 0, lane, &body);
    upload("lane-empty", "lane-name-len", with_lane(b""));
    upload("lane-64", "lane-name-len", with_lane(&[b'l'; 64]));
    upload("lane-nul", "name-nul", with_lane(b"sa\0les"));
    upload("lane-not-utf8", "not-utf8", with_lane(&[0xff]));
    let with_body = |body: &[u8]| raw_upload(0, 1, 0, b"sales", body);
    upload(
        "part-sweep",
        "upload-part-flags",
        with_body(&base_body(|b| b.flags = 1)),
    );
    let written_body = encode_body(&[written("sales", "main")]).unwrap();
    upload("part-writes", "upload-part-flags", with_body(&written_body));
    let two_way_body = encode_body(&[two_way("orders", "orders", 2)]).unwrap();
    upload(
        "part-two-way",
        "upload-part-flags",
        with_body(&two_way_body),
    );
    // One delete and 1000 upserts, refused at the upsert count, before any is read.
    upload(
        "rows-max",
        "upload-rows-max",
        with_body(&base_body(|b| b.upsert_count = Some(1000))),
    );
    upload(
        "part-no-key",
        "no-key",
        with_body(&base_body(|b| b.columns[0].3 = 0)),
    );
    upload("truncated", "truncated", good[..good.len() - 1].to_vec());
    upload("lane-cut", "truncated", good[..26].to_vec());
    upload(
        "trailing-bytes",
        "trailing-bytes",
        [&good[..], &[0]].concat(),
    );
}

/// One malformed `Filed` per rule `open_filed` enforces; those past the seal are sealed
/// for `REPLICA` under `TOKEN`, so each reaches the check it breaks.
fn malformed_fileds(cases: &mut Vec<(String, &'static str, Vec<u8>)>) {
    let good = encode_filed(&golden_filed(), &seal_key(TOKEN), &REPLICA);
    let mut filed = |name: &str, kind: &'static str, bytes: Vec<u8>| {
        cases.push((format!("filed-{name}"), kind, bytes));
    };
    filed("magic", "magic", patched(&good, 0, b"FSW1"));
    filed(
        "later-protocol",
        "later-protocol",
        patched(&good, 4, &[0, 2]),
    );
    filed("protocol-zero", "protocol-zero", patched(&good, 4, &[0, 0]));
    // Bit 0 says dropped rows follow, bit 1 the upload was stale (both sealed); bit 2 is
    // the first undefined.
    filed("flags", "flags", patched(&good, 6, &[0, 4]));
    filed("flags-high", "flags", patched(&good, 6, &[0x80, 1]));
    filed(
        "dropped-flag-unsealed",
        "bad-filed-seal",
        patched(&good, 6, &[0, 1]),
    );
    filed("short", "truncated", good[..40].to_vec());
    filed("head-cut", "truncated", good[..6].to_vec());
    let mut bad_seal = good.clone();
    *bad_seal.last_mut().unwrap() ^= 1;
    filed("bad-seal", "bad-filed-seal", bad_seal);
    filed("count-changed", "bad-filed-seal", patched(&good, 32, &[2]));
    filed(
        "other-replica",
        "bad-filed-seal",
        encode_filed(&golden_filed(), &seal_key(TOKEN), &OTHER_REPLICA),
    );
    let sealed =
        |id: u64, rest: &[u8]| raw_filed(&raw_filed_fields(id, 42, 17, rest), &REPLICA, TOKEN);
    let row = |table: &str, key: &[u8], reason_len: usize| {
        let mut raw = Raw::default();
        raw.varint(1);
        raw.str(table);
        raw.bytes(key);
        raw.str(&"r".repeat(reason_len));
        raw.0
    };
    filed("id-zero", "upload-id-zero", sealed(0, &[0]));
    filed(
        "refused-rows-max",
        "refused-rows-max",
        sealed(1, &[0xe9, 0x07]),
    ); // 1001
    filed(
        "refused-beyond-bytes",
        "count-exceeds-bytes",
        sealed(1, &[0x64]),
    );
    filed(
        "count-overlong",
        "varint-overlong",
        sealed(1, &[0x80, 0x00]),
    );
    filed(
        "reason-len",
        "reason-len",
        sealed(1, &row("sales", &[1, 1, 2], 1025)),
    );
    filed(
        "key-empty",
        "rejection-key-len",
        sealed(1, &row("sales", &[0], 3)),
    );
    filed(
        "key-nan",
        "real-nan",
        sealed(1, &row("sales", &unhex("01027ff8000000000000"), 3)),
    );
    filed(
        "table-reserved",
        "table-name-reserved",
        sealed(1, &row("_ferry_sync_up", &[1, 1, 2], 3)),
    );
    filed("trailing-bytes", "trailing-bytes", sealed(1, &[0, 0]));
    // Flag bit 0: a second list, of dropped rows, follows the refused rows; the two
    // together are at most FILED_REFUSED_MAX.
    let dropping = |rest: &[u8]| {
        raw_filed(
            &raw_filed_fields_flagged(1, 1, 42, 17, rest),
            &REPLICA,
            TOKEN,
        )
    };
    let refused_one = row("sales", &[1, 1, 2], 3);
    filed(
        "dropped-rows-max",
        "refused-rows-max",
        dropping(&[&refused_one[..], &[0xe8, 0x07]].concat()),
    ); // 1 + 1000
    filed(
        "dropped-rows-max-alone",
        "refused-rows-max",
        dropping(&[0x00, 0xe9, 0x07]),
    ); // 0 + 1001
    filed(
        "dropped-beyond-bytes",
        "count-exceeds-bytes",
        dropping(&[0x00, 0x64]),
    );
    filed("dropped-missing", "truncated", dropping(&[0x00]));
    // Flag bit 1: the newest upload filed follows the lists; it is newer than the one
    // answered, and a stale answer files nothing (no rows, no refile).
    let stale = |id: u64, refile_after: u64, rest: &[u8]| {
        raw_filed(
            &raw_filed_fields_flagged(2, id, 42, refile_after, rest),
            &REPLICA,
            TOKEN,
        )
    };
    filed(
        "stale-not-older",
        "stale-not-older",
        stale(5, 0, &[&[0][..], &5u64.to_be_bytes()].concat()),
    );
    filed(
        "stale-refiles",
        "stale-not-older",
        stale(5, 17, &[&[0][..], &9u64.to_be_bytes()].concat()),
    );
    filed(
        "stale-refuses",
        "stale-not-older",
        stale(5, 0, &[&refused_one[..], &9u64.to_be_bytes()].concat()),
    );
    filed("stale-missing", "truncated", stale(5, 0, &[0]));
    filed(
        "dropped-key-empty",
        "rejection-key-len",
        dropping(&[&[0x00][..], &row("orders", &[0], 3)].concat()),
    );
    filed(
        "dropped-table-reserved",
        "table-name-reserved",
        dropping(&[&[0x00][..], &row("sqlite_master", &[1, 1, 2], 3)].concat()),
    );
    filed(
        "dropped-without-flag",
        "trailing-bytes",
        sealed(1, &[&[0x00][..], &row("orders", &[1, 1, 2], 3)].concat()),
    );
}

const LONG_NAME: &str = "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";

/// The corpus's one table part, field by field, so each case can break one field:
/// `orders (id INTEGER NOT NULL key 1, note TEXT)` with one delete and one upsert.
struct BasePart {
    table: Vec<u8>,
    flags: u8,
    /// Written after the columns when set, as a replica-written part's lane.
    lane: Option<&'static str>,
    /// Written after the lane when set, as a two-way part's count of replica columns.
    owned: Option<u64>,
    column_count: Option<u64>,
    /// Name, affinity, not_null, key_part.
    columns: Vec<(&'static str, u8, u8, u8)>,
    text_value: String,
    delete_raw: Option<Vec<u8>>,
    upsert_raw: Option<Vec<u8>>,
    upsert_count: Option<u64>,
}

fn base_body(edit: impl FnOnce(&mut BasePart)) -> Vec<u8> {
    let mut part = BasePart {
        table: b"orders".to_vec(),
        flags: 0,
        lane: None,
        owned: None,
        column_count: None,
        columns: vec![("id", 1, 1, 1), ("note", 3, 0, 0)],
        text_value: "paid".into(),
        delete_raw: None,
        upsert_raw: None,
        upsert_count: None,
    };
    edit(&mut part);
    let mut raw = Raw::default();
    raw.varint(1);
    raw.varint(part.table.len() as u64);
    raw.bytes(&part.table);
    raw.bytes(&[part.flags]);
    raw.varint(part.column_count.unwrap_or(part.columns.len() as u64));
    for (name, affinity, not_null, key_part) in &part.columns {
        raw.str(name);
        raw.bytes(&[*affinity, *not_null, *key_part]);
    }
    if let Some(lane) = part.lane {
        raw.str(lane);
    }
    if let Some(owned) = part.owned {
        raw.varint(owned);
    }
    raw.varint(1);
    raw.bytes(
        &part
            .delete_raw
            .unwrap_or_else(|| reference_value(&Value::Int(7))),
    );
    raw.varint(part.upsert_count.unwrap_or(1));
    let upsert = [
        reference_value(&Value::Int(1)),
        reference_value(&Value::Text(part.text_value)),
    ]
    .concat();
    raw.bytes(&part.upsert_raw.unwrap_or(upsert));
    raw.0
}

fn golden_lines(file: &str) -> Vec<(String, String, Vec<u8>)> {
    let path = golden_path(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading {}: {e}; golden_files_are_what_the_encoders_write writes it",
            path.display()
        )
    });
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            assert_eq!(
                fields.len(),
                3,
                "a golden line is `name outcome hex`: {line:.80}"
            );
            (
                fields[0].to_string(),
                fields[1].to_string(),
                unhex(fields[2]),
            )
        })
        .collect()
}

fn golden_path(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(file)
}

// ---------------------------------------------------------------------------------------
// A second encoder, straight from the layout, for frames this crate's encoder refuses to
// build (and to check the one it does build).

#[derive(Clone)]
struct RawHead {
    magic: [u8; 4],
    protocol: u16,
    flags: u8,
    reserved: u8,
    replica: [u8; 16],
    epoch: [u8; 16],
    seq: u64,
    nonce: u64,
    prev: u64,
    prev_nonce: u64,
    /// The body's length unless set.
    body_len: Option<u32>,
}

impl RawHead {
    fn of(head: &ChainHead, flags: u8) -> RawHead {
        RawHead {
            magic: *b"FSD1",
            protocol: 1,
            flags,
            reserved: 0,
            replica: head.replica,
            epoch: head.epoch,
            seq: head.seq,
            nonce: head.nonce,
            prev: head.prev,
            prev_nonce: head.prev_nonce,
            body_len: None,
        }
    }
}

/// head ‖ body with the body's SHA-256, the stamp under `SECRET` and the seal under
/// `token`'s seal key, each computed here from the hmac and sha2 crates.
fn raw_frame(head: &RawHead, carried: &[u8], token: &[u8]) -> Vec<u8> {
    let hash: [u8; 32] = Sha256::digest(carried).into();
    let mut stamp_mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&SECRET).unwrap();
    stamp_mac.update(&head.replica);
    stamp_mac.update(&head.epoch);
    stamp_mac.update(&head.seq.to_be_bytes());
    stamp_mac.update(&head.nonce.to_be_bytes());
    stamp_mac.update(&hash);
    let stamp = stamp_mac.finalize().into_bytes();
    let mut key_mac = <Hmac<Sha256> as KeyInit>::new_from_slice(token).unwrap();
    key_mac.update(b"ferry-sync seal v1");
    let seal_key = key_mac.finalize().into_bytes();
    let mut frame = Vec::new();
    frame.extend_from_slice(&head.magic);
    frame.extend_from_slice(&head.protocol.to_be_bytes());
    frame.push(head.flags);
    frame.push(head.reserved);
    frame.extend_from_slice(&head.replica);
    frame.extend_from_slice(&head.epoch);
    for field in [head.seq, head.nonce, head.prev, head.prev_nonce] {
        frame.extend_from_slice(&field.to_be_bytes());
    }
    frame.extend_from_slice(&head.body_len.unwrap_or(carried.len() as u32).to_be_bytes());
    frame.extend_from_slice(&hash);
    frame.extend_from_slice(&stamp[..16]);
    assert_eq!(frame.len(), 124);
    let mut seal_mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&seal_key).unwrap();
    seal_mac.update(&frame);
    frame.extend_from_slice(&seal_mac.finalize().into_bytes()[..16]);
    frame.extend_from_slice(carried);
    frame
}

/// A replica's seal key, from the hmac crate as docs/sync.md states it.
fn raw_seal_key(token: &[u8]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(token).unwrap();
    mac.update(b"ferry-sync seal v1");
    mac.finalize().into_bytes().into()
}

/// An upload's fixed fields and lane, straight from the layout, then `body`.
fn raw_upload(flags: u16, id: u64, filed_n: u64, lane: &[u8], body: &[u8]) -> Vec<u8> {
    let mut raw = Raw::default();
    raw.bytes(b"FSW1");
    raw.bytes(&1u16.to_be_bytes());
    raw.bytes(&flags.to_be_bytes());
    raw.u64(id);
    raw.u64(filed_n);
    raw.varint(lane.len() as u64);
    raw.bytes(lane);
    raw.bytes(body);
    raw.0
}

/// A `Filed`'s fixed fields (flags 0), straight from the layout, then `rest` (count and
/// rows).
fn raw_filed_fields(id: u64, filed_n: u64, refile_after: u64, rest: &[u8]) -> Vec<u8> {
    raw_filed_fields_flagged(0, id, filed_n, refile_after, rest)
}

/// A `Filed`'s fixed fields with `flags`, then `rest` (the lists of rows).
fn raw_filed_fields_flagged(
    flags: u16,
    id: u64,
    filed_n: u64,
    refile_after: u64,
    rest: &[u8],
) -> Vec<u8> {
    let mut raw = Raw::default();
    raw.bytes(b"FSF1");
    raw.bytes(&1u16.to_be_bytes());
    raw.bytes(&flags.to_be_bytes());
    raw.u64(id);
    raw.u64(filed_n);
    raw.u64(refile_after);
    raw.bytes(rest);
    raw.0
}

/// `fields` and their seal for `replica` under `token`'s seal key, computed here.
fn raw_filed(fields: &[u8], replica: &[u8; 16], token: &[u8]) -> Vec<u8> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&raw_seal_key(token)).unwrap();
    mac.update(b"ferry-sync filed");
    mac.update(replica);
    mac.update(fields);
    [fields, &mac.finalize().into_bytes()[..16]].concat()
}

/// A `Filed` (reasons within the limit) as the layout states it, sealed here: flag bit 0
/// and the list of dropped rows only when there are some.
fn reference_filed(filed: &Filed, replica: &[u8; 16], token: &[u8]) -> Vec<u8> {
    let mut rows = Raw::default();
    let mut lists = vec![&filed.refused];
    if !filed.dropped.is_empty() {
        lists.push(&filed.dropped);
    }
    for list in lists {
        rows.varint(list.len() as u64);
        for row in list {
            rows.str(&row.table);
            rows.varint(row.key.len() as u64);
            row.key.iter().for_each(|v| rows.bytes(&reference_value(v)));
            rows.str(&row.reason);
        }
    }
    if let Some(newest) = filed.stale {
        rows.0.extend_from_slice(&newest.to_be_bytes());
    }
    let flags = u16::from(!filed.dropped.is_empty()) | u16::from(filed.stale.is_some()) << 1;
    let fields =
        raw_filed_fields_flagged(flags, filed.id, filed.filed_n, filed.refile_after, &rows.0);
    raw_filed(&fields, replica, token)
}

/// A body as the layout (wire/body.rs) states it, written independently of `encode_body`:
/// for a part the replica writes, flag bit 2 and the lane after the columns; for a
/// two-way one, bit 3 too and the count of the replica's columns after the lane.
fn reference_body(parts: &[TablePart]) -> Vec<u8> {
    let mut raw = Raw::default();
    raw.varint(parts.len() as u64);
    for part in parts {
        let mut flags = u8::from(part.sweep.start) | u8::from(part.sweep.end) << 1;
        if let Some(writes) = &part.writes {
            flags |= 4;
            if writes.restate {
                flags |= 16;
            }
            if writes.owned > 0 {
                flags |= 8;
            }
        }
        let columns: Vec<(&str, u8, u8, u8)> = part
            .columns
            .iter()
            .map(|c| {
                let affinity = match c.affinity {
                    Affinity::Integer => 1,
                    Affinity::Real => 2,
                    Affinity::Text => 3,
                    Affinity::Blob => 4,
                };
                (c.name.as_str(), affinity, u8::from(c.not_null), c.key_part)
            })
            .collect();
        raw.part_header(&part.table, flags, &columns);
        if let Some(writes) = &part.writes {
            raw.str(&writes.lane);
            if writes.owned > 0 {
                raw.varint(writes.owned as u64);
            }
        }
        for rows in [&part.deletes, &part.upserts] {
            raw.varint(rows.len() as u64);
            for value in rows.iter().flatten() {
                raw.bytes(&reference_value(value));
            }
        }
    }
    raw.0
}

#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn varint(&mut self, mut n: u64) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                self.0.push(byte);
                return;
            }
            self.0.push(byte | 0x80);
        }
    }

    fn bytes(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    fn str(&mut self, text: &str) {
        self.varint(text.len() as u64);
        self.bytes(text.as_bytes());
    }

    fn u64(&mut self, n: u64) {
        self.bytes(&n.to_be_bytes());
    }

    fn part_header(&mut self, table: &str, flags: u8, columns: &[(&str, u8, u8, u8)]) {
        self.str(table);
        self.bytes(&[flags]);
        self.varint(columns.len() as u64);
        for (name, affinity, not_null, key_part) in columns {
            self.str(name);
            self.bytes(&[*affinity, *not_null, *key_part]);
        }
    }
}

/// The value encoding as the spec states it, written independently of `encode_value`.
fn reference_value(value: &Value) -> Vec<u8> {
    let mut raw = Raw::default();
    match value {
        Value::Null => raw.bytes(&[0]),
        Value::Int(n) => {
            raw.bytes(&[1]);
            raw.varint(((n << 1) ^ (n >> 63)) as u64);
        }
        Value::Real(r) => {
            raw.bytes(&[2]);
            raw.bytes(&r.to_bits().to_be_bytes());
        }
        Value::Text(text) => {
            raw.bytes(&[3]);
            raw.str(text);
        }
        Value::Blob(blob) => {
            raw.bytes(&[4]);
            raw.varint(blob.len() as u64);
            raw.bytes(blob);
        }
    }
    raw.0
}

fn reference_fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x100_0000_01b3)
    })
}

// ---------------------------------------------------------------------------------------
// Helpers

fn chain(seq: u64, nonce: u64, prev: u64, prev_nonce: u64) -> ChainHead {
    ChainHead {
        replica: REPLICA,
        epoch: EPOCH,
        seq,
        nonce,
        prev,
        prev_nonce,
    }
}

fn applied(down: &Down) -> Applied {
    Applied {
        epoch: down.head.epoch,
        seq: down.head.seq,
        nonce: down.head.nonce,
        body_hash: down.body_hash,
        stamp: down.stamp,
    }
}

fn column(name: &str, key_part: u8) -> Column {
    Column {
        name: name.into(),
        affinity: if key_part > 0 {
            Affinity::Integer
        } else {
            Affinity::Text
        },
        not_null: key_part > 0,
        key_part,
    }
}

fn not_null(column: Column) -> Column {
    Column {
        not_null: true,
        ..column
    }
}

fn with_affinity(column: Column, affinity: Affinity) -> Column {
    Column { affinity, ..column }
}

fn text(text: &str) -> Value {
    Value::Text(text.into())
}

/// A part that says the replica writes `table`, in `lane`: columns, no rows.
fn written(table: &str, lane: &str) -> TablePart {
    TablePart {
        table: table.into(),
        columns: vec![column("id", 1), column("note", 0)],
        sweep: Sweep::default(),
        deletes: vec![],
        upserts: vec![],
        writes: Some(Writes::record(lane)),
    }
}

/// A two-way part announcing `table`: the server's columns `id` (the key) and `total`, then
/// the replica's `status` and `picked_at`, of which the replica writes the last `owned`.
fn two_way(table: &str, lane: &str, owned: usize) -> TablePart {
    TablePart {
        table: table.into(),
        columns: vec![
            column("id", 1),
            with_affinity(column("total", 0), Affinity::Real),
            column("status", 0),
            with_affinity(column("picked_at", 0), Affinity::Integer),
        ],
        sweep: Sweep::default(),
        deletes: vec![],
        upserts: vec![],
        writes: Some(owned_by_replica(lane, owned)),
    }
}

/// What a two-way part says: the replica writes its last `owned` columns, in `lane`.
fn owned_by_replica(lane: &str, owned: usize) -> Writes {
    Writes {
        lane: lane.into(),
        owned,
        restate: false,
    }
}

fn sales_columns() -> Vec<Column> {
    vec![
        column("id", 1),
        not_null(column("store_id", 0)),
        with_affinity(column("total", 0), Affinity::Real),
    ]
}

/// A part of an upload of `sales` with `rows` upserts, ids from `first`.
fn sales_part(first: i64, rows: i64) -> TablePart {
    TablePart {
        table: "sales".into(),
        columns: sales_columns(),
        sweep: Sweep::default(),
        deletes: vec![],
        upserts: (first..first + rows)
            .map(|id| vec![Value::Int(id), text("store-1"), Value::Real(1.0)])
            .collect(),
        writes: None,
    }
}

/// A part of an upload holding one row with a blob of `len` bytes.
fn blob_part(len: usize) -> TablePart {
    TablePart {
        table: "photos".into(),
        columns: vec![
            column("id", 1),
            with_affinity(column("data", 0), Affinity::Blob),
        ],
        sweep: Sweep::default(),
        deletes: vec![],
        upserts: vec![vec![Value::Int(1), Value::Blob(noise(len))]],
        writes: None,
    }
}

/// `len` bytes zstd cannot shrink (splitmix64's output), so a body of them travels plain
/// and its size is what the limits see.
fn noise(len: usize) -> Vec<u8> {
    let mut rng = Rng::new(len as u64);
    (0..len).map(|_| rng.next() as u8).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, byte| {
            write!(out, "{byte:02x}").unwrap();
            out
        })
}

fn unhex(text: &str) -> Vec<u8> {
    assert!(text.len().is_multiple_of(2), "odd hex: {text:.40}");
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).expect("hex"))
        .collect()
}

/// xorshift64*: a seeded, dependency-free source of test cases.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    /// Bytes that hit the body's small fields often (tags, flags, counts, affinities).
    fn small_byte(&mut self) -> u8 {
        if self.below(2) == 0 {
            self.below(6) as u8
        } else {
            self.next() as u8
        }
    }

    fn int(&mut self) -> i64 {
        match self.below(4) {
            0 => [0, 1, -1, i64::MIN, i64::MAX, 63, 64, -64, -65][self.below(9) as usize],
            _ => {
                let n = (self.next() >> self.below(64)) as i64;
                if self.below(2) == 0 {
                    n
                } else {
                    n.wrapping_neg()
                }
            }
        }
    }

    fn text(&mut self, max: u64) -> String {
        let alphabet = ['a', 'Z', '0', '|', '\\', ' ', 'é', '€', '😀', '\0', '\n'];
        (0..self.below(max + 1))
            .map(|_| alphabet[self.below(alphabet.len() as u64) as usize])
            .collect()
    }

    fn value(&mut self) -> Value {
        match self.below(5) {
            0 => Value::Null,
            1 => Value::Int(self.int()),
            2 => loop {
                let real = match self.below(4) {
                    0 => [
                        0.0,
                        -0.0,
                        f64::INFINITY,
                        f64::NEG_INFINITY,
                        1.5,
                        f64::MIN_POSITIVE,
                    ][self.below(6) as usize],
                    _ => f64::from_bits(self.next()),
                };
                if !real.is_nan() {
                    break Value::Real(real);
                }
            },
            3 => {
                let max = if self.below(10) == 0 { 300 } else { 8 };
                Value::Text(self.text(max))
            }
            _ => {
                let max = if self.below(10) == 0 { 300 } else { 8 };
                Value::Blob((0..self.below(max)).map(|_| self.next() as u8).collect())
            }
        }
    }

    fn part(&mut self) -> TablePart {
        let width = 1 + self.below(6) as usize;
        let keys = 1 + self.below(width as u64) as usize;
        let mut order: Vec<usize> = (0..width).collect();
        for i in (1..width).rev() {
            order.swap(i, self.below(i as u64 + 1) as usize);
        }
        let mut columns: Vec<Column> = (0..width)
            .map(|i| Column {
                name: if self.below(2) == 0 {
                    format!("c{i}")
                } else {
                    format!("Col_{i}")
                },
                affinity: Affinity::from_u8(1 + self.below(4) as u8).unwrap(),
                not_null: self.below(2) == 0,
                key_part: 0,
            })
            .collect();
        for (part, &index) in order.iter().take(keys).enumerate() {
            columns[index].key_part = part as u8 + 1;
        }
        let row = |rng: &mut Rng, columns: &mut dyn Iterator<Item = &Column>| -> Vec<Value> {
            columns
                .map(|column| match rng.value() {
                    Value::Null if column.not_null => Value::Int(0),
                    value => value,
                })
                .collect()
        };
        let mut key_columns: Vec<&Column> = columns.iter().filter(|c| c.key_part > 0).collect();
        key_columns.sort_by_key(|c| c.key_part);
        let deletes = (0..self.below(4))
            .map(|_| row(self, &mut key_columns.iter().copied()))
            .collect();
        let upserts = (0..self.below(5))
            .map(|_| row(self, &mut columns.iter()))
            .collect();
        let names = ["t", "orders", "Line_items", "ε", "sqlite", "x_ferry_sync"];
        let part = TablePart {
            table: format!(
                "{}{}",
                names[self.below(names.len() as u64) as usize],
                self.below(100)
            ),
            sweep: Sweep {
                start: self.below(2) == 0,
                end: self.below(2) == 0,
            },
            columns,
            deletes,
            upserts,
            writes: None,
        };
        if self.below(6) == 0 {
            // A table the replica writes: only its columns and lane travel down; half the
            // time (where its last columns are not key columns) a two-way table's, whose
            // replica writes 1 up to all of those last columns.
            let free = part
                .columns
                .iter()
                .rev()
                .take_while(|c| c.key_part == 0)
                .count();
            let owned = if free > 0 && self.below(2) == 0 {
                1 + self.below(free as u64) as usize
            } else {
                0
            };
            return TablePart {
                sweep: Sweep::default(),
                deletes: vec![],
                upserts: vec![],
                writes: Some({
                    let lane = self.lane();
                    Writes {
                        restate: lane.len().is_multiple_of(2),
                        lane,
                        owned,
                    }
                }),
                ..part
            };
        }
        part
    }

    fn lane(&mut self) -> String {
        match self.below(4) {
            0 => "main".into(),
            1 => "x".repeat(63),
            2 => "sqlite_lanes_are_not_tables".into(),
            // At most 12 characters of at most 4 bytes, and one more: within 63 bytes.
            _ => self.text(12).replace('\0', "") + "l",
        }
    }

    /// An upload of up to three parts of the kind a replica sends: no flags, no writes.
    fn upload(&mut self) -> Upload {
        let parts = (0..self.below(4))
            .map(|_| TablePart {
                sweep: Sweep::default(),
                writes: None,
                ..self.part()
            })
            .collect();
        Upload {
            restated: self.below(2) == 0,
            id: 1 + self.below(u64::MAX),
            filed_n: if self.below(3) == 0 { 0 } else { self.next() },
            lane: self.lane(),
            parts,
        }
    }

    fn filed(&mut self) -> Filed {
        Filed {
            id: 1 + self.below(u64::MAX),
            filed_n: self.next(),
            refile_after: if self.below(2) == 0 { 0 } else { self.next() },
            refused: (0..self.below(4))
                .map(|_| RefusedRow {
                    table: format!("t{}", self.below(9)),
                    key: (0..1 + self.below(3)).map(|_| self.value()).collect(),
                    reason: self.text(40),
                })
                .collect(),
            dropped: (0..self.below(3))
                .map(|_| RefusedRow {
                    table: format!("t{}", self.below(9)),
                    key: (0..1 + self.below(3)).map(|_| self.value()).collect(),
                    reason: self.text(40),
                })
                .collect(),
            stale: None,
        }
    }

    fn head(&mut self) -> ChainHead {
        let seq = 1 + self.below(1 << 40);
        let starts = self.below(3) == 0 || seq == 1;
        let mut bytes = || -> [u8; 16] { std::array::from_fn(|_| self.next() as u8) };
        let replica = bytes();
        let epoch = bytes();
        ChainHead {
            replica,
            epoch,
            seq,
            nonce: 1 + self.below(i64::MAX as u64),
            prev: if starts { 0 } else { self.below(seq - 1) + 1 },
            prev_nonce: if starts {
                0
            } else {
                1 + self.below(i64::MAX as u64)
            },
        }
    }

    fn up(&mut self) -> Up {
        let applied = (self.below(2) == 0).then(|| Applied {
            epoch: std::array::from_fn(|_| self.next() as u8),
            seq: 1 + self.below(1000),
            nonce: 1 + self.below(i64::MAX as u64),
            body_hash: std::array::from_fn(|_| self.next() as u8),
            stamp: std::array::from_fn(|_| self.next() as u8),
        });
        Up {
            applied,
            gap: if self.below(3) == 0 { 0 } else { self.next() },
            rejections: (0..self.below(4))
                .map(|_| Rejection {
                    table: format!("t{}", self.below(9)),
                    key: (0..1 + self.below(3)).map(|_| self.value()).collect(),
                    reason: self.text(40),
                    seq: self.next(),
                })
                .collect(),
            digests: (0..self.below(4))
                .map(|_| Digest {
                    table: format!("t{}", self.below(9)),
                    rows: self.next(),
                    fingerprint: self.next(),
                })
                .collect(),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Counting what a thread allocates, to hold open() to body_max on a zip bomb.

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

/// Starts measuring this thread's peak; returns the bytes live now.
fn peak_reset() -> isize {
    let live = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(live));
    live
}

/// The most bytes this thread had live above `before` since [`peak_reset`].
fn peak_since(before: isize) -> usize {
    (PEAK.with(Cell::get) - before).max(0) as usize
}

// SAFETY: every method forwards to the system allocator with the caller's arguments
// unchanged and only counts sizes on the side; the counters allocate nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract, passed on as is.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            note(layout.size() as isize);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from System) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        note(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for dealloc; `new_size` is the caller's, checked by its contract.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            note(new_size as isize - layout.size() as isize);
        }
        moved
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;
