//! What a pass sends, collected per replica before it is packed into messages. Rows are
//! shared (`Arc`) between replicas, so a broadcast change held by a hundred replicas is
//! read once, encoded once per distinct message, and stored once (`ferry_sync.bodies`).

use std::collections::BTreeMap;
use std::sync::Arc;

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
}

impl TableOut {
    pub fn is_empty(&self) -> bool {
        !self.sweep_start && !self.sweep_end && self.deletes.is_empty() && self.upserts.is_empty()
    }
}

/// One replica's outgoing parts, by table index (parents first).
#[derive(Clone, Debug, Default)]
pub struct ReplicaOut {
    /// The messages start a new chain (prev 0): a provisioning or a catch-up.
    pub chain_start: bool,
    pub tables: BTreeMap<usize, TableOut>,
}

impl ReplicaOut {
    pub fn table(&mut self, table: usize) -> &mut TableOut {
        self.tables.entry(table).or_default()
    }

    pub fn is_empty(&self) -> bool {
        !self.chain_start && self.tables.values().all(TableOut::is_empty)
    }

    /// A cheap identity of the content: replicas with equal signatures get equal bodies.
    /// Rows are compared by address, which is equal exactly when the planner shared them.
    pub fn signature(&self) -> Vec<usize> {
        let mut sig = Vec::new();
        sig.push(self.chain_start as usize);
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
