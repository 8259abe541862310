//! Turning a pass's outgoing parts into sealed messages in the replicas' outboxes.
//!
//! 1. Rows that cannot travel (a NaN, or larger than any frame) are quarantined for the
//!    replica owed them and left out.
//! 2. Replicas whose parts are the same rows (by address) share one packing and one
//!    encoding; each body is compressed when that pays, hashed, and stored once.
//! 3. Each replica's messages get the next seqs of its chain, a random nonce each, and a
//!    head sealed with its key and stamped with the epoch's secret.
//! 4. Outbox rows, chain positions and the seq held rows wait for are written in bulk.

use std::collections::{BTreeMap, HashMap};

use sqlx::PgConnection;
use uuid::Uuid;

use super::out::ReplicaOut;
use super::pack::{Budget, pack, row_len};
use super::spec::Spec;
use crate::value::Value;
use crate::wire;

/// A replica's chain as the pass found it.
#[derive(Clone, Debug)]
pub struct Chain {
    pub last_seq: i64,
    pub last_nonce: i64,
    pub seal_key: [u8; 32],
}

/// The installation's epoch and its secret.
#[derive(Clone, Debug)]
pub struct Epoch {
    pub id: Uuid,
    pub secret: [u8; 32],
}

/// What a pass recorded.
#[derive(Clone, Debug, Default)]
pub struct Recorded {
    pub messages: usize,
    /// The replicas that got a message, to wake their long polls (and only theirs).
    pub to: Vec<Uuid>,
    pub bodies: usize,
    pub bytes: usize,
    pub quarantined: usize,
}

/// One packed body: as carried, whether compressed, its hash.
type Packed = (Vec<u8>, bool, [u8; 32]);

/// The largest row a message can carry: a frame's limit less room for the envelope.
const ROW_BYTES_MAX: usize = 15 * 1024 * 1024;

pub async fn record(
    conn: &mut PgConnection,
    spec: &Spec,
    epoch: &Epoch,
    (shard, pass): (i32, i64),
    mut outs: BTreeMap<Uuid, ReplicaOut>,
    chains: &mut HashMap<Uuid, Chain>,
    budget: Budget,
) -> Result<Recorded, sqlx::Error> {
    let mut recorded = Recorded::default();
    // Step 1.
    let mut q_replica = Vec::new();
    let mut q_relation = Vec::new();
    let mut q_key = Vec::new();
    let mut q_cause = Vec::new();
    for (r, out) in outs.iter_mut() {
        for (t, table_out) in out.tables.iter_mut() {
            let table = &spec.tables[*t];
            let key_cols = table.key_columns();
            table_out.upserts.retain(|row| {
                let cause = if row
                    .iter()
                    .any(|v| matches!(v, Value::Real(f) if f.is_nan()))
                {
                    "encode"
                } else if row_len(row) > ROW_BYTES_MAX {
                    "size"
                } else {
                    return true;
                };
                q_replica.push(*r);
                q_relation.push(table.relation.clone());
                q_key.push(key_text_of(row, &key_cols));
                q_cause.push(cause.to_string());
                false
            });
        }
    }
    recorded.quarantined = q_replica.len();
    if !q_replica.is_empty() {
        // DISTINCT ON: a row can be in a replica's message twice when one pass both
        // provisions the replica and plans the row's note; ON CONFLICT may not meet one
        // key twice in a statement (found by the NaN test, 2026-12-06).
        sqlx::query(
            "INSERT INTO ferry_sync.quarantine (replica, relation, key, cause, reason)
             SELECT DISTINCT ON (r, rel, k) r, rel, k, c, CASE c WHEN 'encode' THEN 'a real value is NaN' ELSE 'the row is larger than a message can carry' END
             FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[]) AS x(r, rel, k, c)
             ON CONFLICT (replica, relation, key) DO UPDATE SET cause = excluded.cause, reason = excluded.reason, at = now()",
        )
        .bind(&q_replica)
        .bind(&q_relation)
        .bind(&q_key)
        .bind(&q_cause)
        .execute(&mut *conn)
        .await?;
    }
    // A row quarantined by the server (NaN, too large) that now travels leaves quarantine:
    // status must not count it after a fix. Looked for only while such rows exist.
    let server_quarantine: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM ferry_sync.quarantine WHERE cause IN ('encode', 'size'))",
    )
    .fetch_one(&mut *conn)
    .await?;
    if server_quarantine {
        let (mut s_replica, mut s_relation, mut s_key) = (Vec::new(), Vec::new(), Vec::new());
        for (r, out) in &outs {
            for (t, table_out) in &out.tables {
                let table = &spec.tables[*t];
                let key_cols = table.key_columns();
                for row in &table_out.upserts {
                    s_replica.push(*r);
                    s_relation.push(table.relation.clone());
                    s_key.push(key_text_of(row, &key_cols));
                }
            }
        }
        sqlx::query(
            "DELETE FROM ferry_sync.quarantine q USING unnest($1::uuid[], $2::text[], $3::text[]) AS x(r, rel, k)
             WHERE q.replica = x.r AND q.relation = x.rel AND q.key = x.k AND q.cause IN ('encode', 'size')",
        )
        .bind(&s_replica)
        .bind(&s_relation)
        .bind(&s_key)
        .execute(&mut *conn)
        .await?;
    }
    // Step 2.
    let mut packed: HashMap<Vec<usize>, Vec<Packed>> = HashMap::new();
    let mut new_bodies: HashMap<[u8; 32], Vec<u8>> = HashMap::new();
    for out in outs.values() {
        if out.is_empty() {
            continue;
        }
        let sig = out.signature();
        if packed.contains_key(&sig) {
            continue;
        }
        let mut bodies = Vec::new();
        for parts in pack(spec, out, budget) {
            let body = wire::encode_body(&parts)
                .expect("rows that cannot encode were quarantined in step 1");
            let (carried, compressed) = wire::pack_body(body, wire::COMPRESS_ABOVE_BYTES);
            let hash = wire::body_hash(&carried);
            new_bodies.entry(hash).or_insert_with(|| carried.clone());
            bodies.push((carried, compressed, hash));
        }
        packed.insert(sig, bodies);
    }
    // Step 3.
    let mut o_replica = Vec::new();
    let mut o_seq = Vec::new();
    let mut o_head: Vec<Vec<u8>> = Vec::new();
    let mut o_hash: Vec<Vec<u8>> = Vec::new();
    let mut o_bytes = Vec::new();
    let (mut c_replica, mut c_seq, mut c_nonce) = (Vec::new(), Vec::new(), Vec::new());
    for (r, out) in &outs {
        if out.is_empty() {
            continue;
        }
        let Some(chain) = chains.get_mut(r) else {
            continue;
        };
        let bodies = &packed[&out.signature()];
        if !bodies.is_empty() {
            recorded.to.push(*r);
        }
        for (i, (carried, compressed, hash)) in bodies.iter().enumerate() {
            let seq = chain.last_seq + 1;
            let nonce = random_nonce();
            let (prev, prev_nonce) = if i == 0 && out.chain_start {
                (0, 0)
            } else {
                (chain.last_seq, chain.last_nonce)
            };
            let head = wire::ChainHead {
                replica: *r.as_bytes(),
                epoch: *epoch.id.as_bytes(),
                seq: seq as u64,
                nonce: nonce as u64,
                prev: prev as u64,
                prev_nonce: prev_nonce as u64,
            };
            let (bytes, _stamp) = wire::encode_head(
                &head,
                *compressed,
                carried.len() as u32,
                hash,
                &epoch.secret,
                &chain.seal_key,
            );
            o_replica.push(*r);
            o_seq.push(seq);
            o_head.push(bytes.to_vec());
            o_hash.push(hash.to_vec());
            o_bytes.push((bytes.len() + carried.len()) as i32);
            recorded.messages += 1;
            recorded.bytes += bytes.len() + carried.len();
            chain.last_seq = seq;
            chain.last_nonce = nonce;
        }
        c_replica.push(*r);
        c_seq.push(chain.last_seq);
        c_nonce.push(chain.last_nonce);
    }
    // Step 4.
    recorded.bodies = new_bodies.len();
    let (b_hash, b_body): (Vec<Vec<u8>>, Vec<Vec<u8>>) =
        new_bodies.into_iter().map(|(h, b)| (h.to_vec(), b)).unzip();
    // Each relay shard writes and sweeps its own copy of a body (docs/sync-scale.md §2): two
    // shards recording the same broadcast change never write one row.
    sqlx::query("INSERT INTO ferry_sync.bodies (shard, hash, body) SELECT $3, * FROM unnest($1::bytea[], $2::bytea[]) ON CONFLICT DO NOTHING")
        .bind(&b_hash)
        .bind(&b_body)
        .bind(shard)
        .execute(&mut *conn)
        .await?;
    sqlx::query(
        "INSERT INTO ferry_sync.outbox (replica, seq, head, body_hash, bytes, pass)
         SELECT r, s, h, b, n, $6 FROM unnest($1::uuid[], $2::int8[], $3::bytea[], $4::bytea[], $5::int4[]) AS x(r, s, h, b, n)",
    )
    .bind(&o_replica)
    .bind(&o_seq)
    .bind(&o_head)
    .bind(&o_hash)
    .bind(&o_bytes)
    .bind(pass)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE ferry_sync.replicas c SET last_seq = x.s, last_nonce = x.n, standing = CASE WHEN standing = 'new' THEN 'provisioning' ELSE standing END
         FROM unnest($1::uuid[], $2::int8[], $3::int8[]) AS x(r, s, n) WHERE c.id = x.r",
    )
    .bind(&c_replica)
    .bind(&c_seq)
    .bind(&c_nonce)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE ferry_sync.held h SET seq = x.s FROM unnest($1::uuid[], $2::int8[]) AS x(r, s)
         WHERE h.replica = x.r AND h.seq = 0",
    )
    .bind(&c_replica)
    .bind(&c_seq)
    .execute(&mut *conn)
    .await?;
    Ok(recorded)
}

/// The canonical key text of a row, from its key columns' values.
pub fn key_text_of(row: &[Value], key_columns: &[usize]) -> String {
    let parts: Vec<String> = key_columns
        .iter()
        .map(|i| match &row[*i] {
            Value::Int(n) => n.to_string(),
            Value::Text(s) => s.clone(),
            Value::Real(f) => f.to_string(),
            Value::Blob(_) | Value::Null => String::new(),
        })
        .collect();
    super::spec::key_text(&parts)
}

/// A nonce in 1..=2^63-1 from the operating system's random source.
pub fn random_nonce() -> i64 {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes).expect("the operating system's random source is available");
    (i64::from_be_bytes(bytes) & i64::MAX).max(1)
}
