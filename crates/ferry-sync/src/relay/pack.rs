//! Packing a replica's parts into message bodies within the limits. Pure.
//!
//! 1. Tables go in index order (parents first); within a message, the replica deletes
//!    every part's keys first (children first) and then upserts (parents first).
//! 2. A message closes when the next row would take it past `BODY_TARGET_BYTES` or
//!    `ROWS_PER_MESSAGE_MAX`; a table's rows then continue in the next message, and its
//!    sweep-start goes with its first piece and sweep-end with its last.
//! 3. A table's deletes travel in the same message as its first upserts whenever they
//!    fit, so a unique value can move from one row to another in one transaction.
//! 4. A single row larger than the target still goes, alone; the caller has already
//!    quarantined rows that could not fit any frame.

use super::out::{ReplicaOut, RowRef};
use super::spec::Spec;
use crate::value::Value;
use crate::wire::{Sweep, TablePart};

/// What one message may hold when packing.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub bytes: usize,
    pub rows: usize,
}

/// The bytes a value takes on the wire, at most (tag, length varint, payload).
pub fn value_len(v: &Value) -> usize {
    match v {
        Value::Null => 1,
        Value::Int(_) => 11,
        Value::Real(_) => 9,
        Value::Text(s) => 1 + 5 + s.len(),
        Value::Blob(b) => 1 + 5 + b.len(),
    }
}

pub fn row_len(row: &[Value]) -> usize {
    row.iter().map(value_len).sum()
}

/// Splits `out` into message bodies (as table parts), in order.
pub fn pack(spec: &Spec, out: &ReplicaOut, budget: Budget) -> Vec<Vec<TablePart>> {
    let mut messages: Vec<Vec<TablePart>> = Vec::new();
    // A chain starts with the tables the replica writes, so a replica provisioned or
    // caught up has them and their triggers (docs/sync-up.md §4.1): empty parts. A rules
    // change that touches them announces them again.
    let announce = out.chain_start || out.announce;
    let mut current: Vec<TablePart> = if announce {
        spec.records
            .iter()
            .filter(|r| r.reaches(out.audience.as_deref()))
            .map(crate::file::RecordSpec::announce)
            .collect()
    } else {
        Vec::new()
    };
    let mut bytes = 0usize;
    let mut rows = 0usize;
    for (&t, table_out) in &out.tables {
        if table_out.is_empty() {
            continue;
        }
        let table = &spec.tables[t];
        let columns = table.wire_columns();
        let header = 64 + columns.iter().map(|c| c.name.len() + 8).sum::<usize>();
        let new_part = |start: bool| TablePart {
            table: table.name.clone(),
            columns: columns.clone(),
            sweep: Sweep { start, end: false },
            deletes: Vec::new(),
            upserts: Vec::new(),
            writes: None,
        };
        let items = table_out
            .deletes
            .iter()
            .map(|k| (true, k))
            .chain(table_out.upserts.iter().map(|r| (false, r)));
        let mut part = new_part(table_out.sweep_start);
        if bytes + header > budget.bytes && !current.is_empty() {
            messages.push(std::mem::take(&mut current));
            bytes = 0;
            rows = 0;
        }
        bytes += header;
        for (is_delete, row) in items {
            let len = row_len(row);
            if (bytes + len > budget.bytes || rows + 1 > budget.rows)
                && (rows > 0 || !part_is_empty(&part))
            {
                current.push(std::mem::replace(&mut part, new_part(false)));
                messages.push(std::mem::take(&mut current));
                bytes = header;
                rows = 0;
            }
            push_row(&mut part, is_delete, row);
            bytes += len;
            rows += 1;
        }
        part.sweep.end = table_out.sweep_end;
        current.push(part);
    }
    if !current.is_empty() || (messages.is_empty() && announce) {
        messages.push(current);
    }
    messages
}

fn part_is_empty(part: &TablePart) -> bool {
    part.deletes.is_empty() && part.upserts.is_empty()
}

fn push_row(part: &mut TablePart, is_delete: bool, row: &RowRef) {
    if is_delete {
        part.deletes.push(row.as_ref().clone());
    } else {
        part.upserts.push(row.as_ref().clone());
    }
}
