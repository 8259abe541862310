//! What a pass sends, collected per replica before it is packed into messages. Rows are
//! shared (`Arc`) between replicas, so a broadcast change held by a hundred replicas is
//! read once, encoded once per distinct message, and stored once (`ferry_sync.bodies`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::record::key_text_of;
use crate::value::Value;

pub type RowRef = Arc<Vec<Value>>;

/// One table's share of a replica's next messages.
#[derive(Clone, Debug, Default)]
pub struct TableOut {
    pub sweep_start: bool,
    pub sweep_end: bool,
    /// Keys to delete, as typed key values.
    pub deletes: Vec<RowRef>,
    /// Rows to upsert, one value per column.
    pub upserts: Vec<RowRef>,
    /// Per key deleted (key text), how many upserts were planned before its last delete.
    deleted_after: HashMap<String, usize>,
}

impl TableOut {
    /// Deletes a row (`key` its key text, `values` its typed key values). The replica
    /// applies a part's deletes before its upserts, so an upsert of the same row planned
    /// earlier in the pass (a heal, a catch-up, a row kept for a pointer) is dropped by
    /// `settle`; one planned later still wins.
    pub fn delete(&mut self, key: String, values: RowRef) {
        self.deleted_after.insert(key, self.upserts.len());
        self.deletes.push(values);
    }

    /// Drops every upsert that a later delete of the same row overrides: within a pass the
    /// last decision for a row wins. `key_cols` are the table's key columns.
    pub fn settle(&mut self, key_cols: &[usize]) {
        if self.deleted_after.is_empty() {
            return;
        }
        let deleted = std::mem::take(&mut self.deleted_after);
        let mut i = 0;
        self.upserts.retain(|row| {
            let before = deleted
                .get(&key_text_of(row, key_cols))
                .is_some_and(|after| i < *after);
            i += 1;
            !before
        });
    }

    pub fn is_empty(&self) -> bool {
        !self.sweep_start && !self.sweep_end && self.deletes.is_empty() && self.upserts.is_empty()
    }
}

/// One replica's outgoing parts, by table index (parents first).
#[derive(Clone, Debug, Default)]
pub struct ReplicaOut {
    /// The messages start a new chain (prev 0): a provisioning or a catch-up.
    pub chain_start: bool,
    /// The first message names the tables the replica writes, as a chain start does:
    /// the rules changed them (docs/sync-up.md §4.1).
    pub announce: bool,
    /// The replica's audience: which two-way tables a chain start announces
    /// (`Planner::run` sets it).
    pub audience: Option<String>,
    pub tables: BTreeMap<usize, TableOut>,
}

impl ReplicaOut {
    pub fn table(&mut self, table: usize) -> &mut TableOut {
        self.tables.entry(table).or_default()
    }

    pub fn is_empty(&self) -> bool {
        !self.chain_start && !self.announce && self.tables.values().all(TableOut::is_empty)
    }

    /// A cheap identity of the content: replicas with equal signatures get equal bodies.
    /// Rows are compared by address, which is equal exactly when the planner shared them.
    pub fn signature(&self) -> Vec<usize> {
        let mut sig = Vec::new();
        sig.push(self.chain_start as usize | (self.announce as usize) << 1);
        if let Some(a) = &self.audience {
            // Announcements differ by audience; so must the bodies' identity.
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            a.hash(&mut h);
            sig.push(h.finish() as usize);
        }
        for (t, out) in &self.tables {
            sig.push(*t);
            sig.push(out.sweep_start as usize | (out.sweep_end as usize) << 1);
            sig.push(out.deletes.len());
            sig.extend(out.deletes.iter().map(|r| Arc::as_ptr(r) as usize));
            sig.push(out.upserts.len());
            sig.extend(out.upserts.iter().map(|r| Arc::as_ptr(r) as usize));
        }
        sig
    }
}
