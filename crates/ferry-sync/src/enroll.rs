//! Enrolment: a replica's bearer token, and the seal key derived from it.
//!
//! The token is 32 random bytes, hex-encoded. The server keeps only its SHA-256 (to
//! authenticate requests) and the seal key (`wire::seal_key(token)`, to seal messages);
//! the replica keeps the token and derives the same seal key. Enrolling again replaces
//! both: messages sealed with the old key are refused by the replica, and the relay
//! starts its chain again.

use sha2::{Digest as _, Sha256};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::wire;

/// A fresh token: 64 hex digits.
pub fn new_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).expect("the operating system's random source is available");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Records `token` for replica `id` and asks the relay to (re)provision it.
pub async fn enroll(conn: &mut PgConnection, id: Uuid, token: &str) -> Result<(), sqlx::Error> {
    let hash = Sha256::digest(token.as_bytes()).to_vec();
    let key = wire::seal_key(token.as_bytes()).to_vec();
    sqlx::query(
        "INSERT INTO ferry_sync.replicas (id, token_hash, seal_key) VALUES ($1, $2, $3)
         ON CONFLICT (id) DO UPDATE SET token_hash = excluded.token_hash, seal_key = excluded.seal_key, standing = 'new'",
    )
    .bind(id)
    .bind(hash)
    .bind(key)
    .execute(&mut *conn)
    .await?;
    sqlx::query("INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ('ferry_sync.replicas', $1, 'replica')")
        .bind(id.to_string())
        .execute(&mut *conn)
        .await?;
    sqlx::query("SELECT pg_notify('ferry_sync', 'enroll')")
        .execute(&mut *conn)
        .await?;
    Ok(())
}
