//! A message's body: the table parts, in apply order.
//!
//! Layout (varints as in [`crate::value`]):
//! 1. A varint count of parts; then each part:
//! 2. The table name: varint length, then 1..=[`NAME_BYTES_MAX`] bytes of UTF-8 without
//!    NUL, not starting (ignoring ASCII case) with `sqlite_` or `_ferry_sync`.
//! 3. One byte of part flags: bit 0 sweep start, bit 1 sweep end, bit 2 the replica
//!    writes the table (docs/sync-up.md §4.1), bit 3 (only with bit 2) a two-way table:
//!    the replica writes some of its columns, bit 4 (only with bit 2) the replica states
//!    its rows again on a chain start (§7); the other bits 0. A part with bit 2 has
//!    neither sweep flag.
//! 4. A varint count of columns, 1..=[`COLUMNS_MAX`]; then each column: its name (as a
//!    table name, 1..=63 bytes, unique in the part ignoring ASCII case), an affinity byte
//!    (1 Integer, 2 Real, 3 Text, 4 Blob), a not_null byte (0 or 1) and a key_part byte
//!    (0, or the column's place in the key). The key parts present are exactly 1..=k for
//!    some k >= 1, each once.
//! 5. Only when bit 2 is set: the lane the replica uploads the table's writes in, written
//!    as a table name (varint length, 1..=[`NAME_BYTES_MAX`] bytes of UTF-8 without NUL);
//!    then, only when bit 3 is set, a varint count of the columns the replica writes: the
//!    last that many of the part's, at least one, none of them a key part.
//! 6. A varint count of deletes; each is k values, the key's, in key order (no count).
//! 7. A varint count of upserts; each is one value per column, in column order (no count).
//!    A part with bit 2 has no deletes and no upserts: the replica's rows of that table
//!    are its own, and travel up (wire/upload.rs), never down.
//! 8. After the last part, nothing.
//!
//! A value's type need not match its column's affinity (SQLite is dynamically typed), but
//! a Null in a not_null column is refused, in deletes and upserts alike. [`encode_body`]
//! refuses what [`decode_body`] would, so the server never sends a body a replica refuses.
//!
//! The same body carries an upload's rows up ([`read_body`] with [`Carrier::Upload`]):
//! there no part has flags, and the rows of all parts together are at most
//! [`UPLOAD_ROWS_MAX`].

use std::collections::HashSet;

use super::reader::Reader;
use super::{
    COLUMNS_MAX, Column, Fault, NAME_BYTES_MAX, RESERVED_TABLE_PREFIXES, Refused, Rule, Sweep,
    TablePart, UPLOAD_ROWS_MAX, Writes,
};
use crate::value::{self, Affinity, EncodeError, Value};

const SWEEP_START: u8 = 1;
const SWEEP_END: u8 = 2;
/// Part flag bit 2: the replica writes the table, and the lane's name follows the columns.
const WRITES: u8 = 4;
/// Part flag bit 3, only with bit 2: the replica writes the last columns of the part (their
/// count follows the lane); the server sends the rest.
const TWO_WAY: u8 = 8;
/// Part flag bit 4, only with bit 2: the replica states the table's rows again when a chain
/// starts.
const RESTATE: u8 = 16;

/// Smallest encodings, for bounding counts by the bytes that remain: a column is a name
/// (2 bytes at least) and three bytes; a value is a tag at least.
const COLUMN_BYTES_MIN: usize = 5;
const VALUE_BYTES_MIN: usize = 1;
/// A part is a name (2), flags (1), a column count (1), one column (5), two counts (2).
const PART_BYTES_MIN: usize = 11;

/// What a body travels in, which decides what its parts may say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Carrier {
    /// A message down: any defined part flags, rows bounded by the frame's limits alone.
    Down,
    /// An upload: parts without flags, and at most [`UPLOAD_ROWS_MAX`] rows in all.
    Upload,
}

/// Encodes the parts of a message into a body; refuses (naming the part, row and column)
/// a part the decoder would refuse, or a row of the wrong width.
pub fn encode_body(parts: &[TablePart]) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::new();
    value::encode_varint(parts.len() as u64, &mut out);
    for (index, part) in parts.iter().enumerate() {
        let place = format!("table part {} ({:?})", index + 1, part.table);
        let key = check_header(&part.table, &part.columns).map_err(|f| f.within(&place))?;
        check_writes(part).map_err(|f| f.within(&place))?;
        write_header(part, &mut out);
        value::encode_varint(part.deletes.len() as u64, &mut out);
        for (row, delete) in part.deletes.iter().enumerate() {
            let what = format!("{place}, delete {}", row + 1);
            let columns = key.iter().map(|&c| &part.columns[c]);
            write_row(delete, columns, key.len(), &what, &mut out)?;
        }
        value::encode_varint(part.upserts.len() as u64, &mut out);
        for (row, upsert) in part.upserts.iter().enumerate() {
            let what = format!("{place}, upsert {}", row + 1);
            let width = part.columns.len();
            write_row(upsert, part.columns.iter(), width, &what, &mut out)?;
        }
    }
    Ok(out)
}

/// Decodes and checks a body (decompressed); see the module doc for what is refused.
pub fn decode_body(body: &[u8]) -> Result<Vec<TablePart>, Refused> {
    let mut reader = Reader::new(body, "body");
    let parts = read_body(&mut reader, Carrier::Down)?;
    reader.finish()?;
    Ok(parts)
}

/// Reads a body's parts from `reader`, leaving it after the last part: the caller says
/// what may follow (nothing, for both carriers).
pub(super) fn read_body(
    reader: &mut Reader<'_>,
    carrier: Carrier,
) -> Result<Vec<TablePart>, Fault> {
    let count = reader.count("the part count", PART_BYTES_MIN)?;
    let mut parts = Vec::with_capacity(count);
    let mut rows = 0;
    for index in 1..=count {
        parts.push(read_part(reader, index, carrier, &mut rows)?);
    }
    Ok(parts)
}

/// Reads part `index`; `rows` counts the deletes and upserts of the body so far.
fn read_part(
    reader: &mut Reader<'_>,
    index: usize,
    carrier: Carrier,
    rows: &mut u64,
) -> Result<TablePart, Fault> {
    let table = reader
        .str("the table name")
        .map_err(|f| f.within(format_args!("table part {index}")))?;
    let place = format!("table part {index} ({table:?})");
    let within = |f: Fault| f.within(&place);
    check_table_name(table).map_err(within)?;
    let flags_at = reader.at();
    let flags = reader.u8("the part flags").map_err(within)?;
    check_flags(flags, flags_at, carrier).map_err(within)?;
    let columns = read_columns(reader).map_err(within)?;
    let key = check_header(table, &columns).map_err(within)?;
    let writes = if flags & WRITES == 0 {
        None
    } else {
        let lane = reader.str("the lane name").map_err(within)?;
        check_lane_name(lane).map_err(within)?;
        let owned = if flags & TWO_WAY == 0 {
            0
        } else {
            let at = reader.at();
            let owned = reader
                .varint("the count of columns the replica writes")
                .map_err(within)?;
            check_owned(owned, Some(at), &columns).map_err(within)?
        };
        Some(Writes {
            lane: lane.to_string(),
            owned,
            restate: flags & RESTATE != 0,
        })
    };
    let writes_at = writes.is_some().then_some(flags_at);
    let key_bytes = key.len() * VALUE_BYTES_MIN;
    let deletes_count = read_row_count(
        reader,
        "the delete count",
        key_bytes,
        writes_at,
        carrier,
        rows,
    )
    .map_err(within)?;
    let mut deletes = Vec::with_capacity(deletes_count);
    for row in 1..=deletes_count {
        let what = format!("delete {row}");
        let key_columns = key.iter().map(|&c| &columns[c]);
        deletes.push(read_row(reader, key_columns, &what).map_err(within)?);
    }
    let row_bytes = columns.len() * VALUE_BYTES_MIN;
    let upserts_count = read_row_count(
        reader,
        "the upsert count",
        row_bytes,
        writes_at,
        carrier,
        rows,
    )
    .map_err(within)?;
    let mut upserts = Vec::with_capacity(upserts_count);
    for row in 1..=upserts_count {
        let what = format!("upsert {row}");
        upserts.push(read_row(reader, columns.iter(), &what).map_err(within)?);
    }
    Ok(TablePart {
        table: table.to_string(),
        columns,
        sweep: Sweep {
            start: flags & SWEEP_START != 0,
            end: flags & SWEEP_END != 0,
        },
        deletes,
        upserts,
        writes,
    })
}

/// Refuses part flags protocol v1 does not define; in an upload, any flag; and a part
/// that says the replica writes its table (bit 2) and asks for a sweep too.
fn check_flags(flags: u8, at: usize, carrier: Carrier) -> Result<(), Fault> {
    if flags & !(SWEEP_START | SWEEP_END | WRITES | TWO_WAY | RESTATE) != 0 {
        return Err(Fault::new(
            Rule::SweepFlags,
            format!(
                "the part flags at byte {at} are {flags:#04x}; only bits 0 (sweep start), 1 \
                 (sweep end), 2 (the replica writes the table), 3 (two-way) and 4 (restate) \
                 are defined"
            ),
        ));
    }
    if flags & (TWO_WAY | RESTATE) != 0 && flags & WRITES == 0 {
        return Err(Fault::new(
            Rule::ReplicaWrittenPart,
            format!(
                "the part flags at byte {at} are {flags:#04x}: bits 3 (two-way) and 4 \
                 (restate) say how the replica writes the table, and come only with bit 2"
            ),
        ));
    }
    if carrier == Carrier::Upload && flags != 0 {
        return Err(Fault::new(
            Rule::UploadPartFlags,
            format!(
                "the part flags at byte {at} are {flags:#04x}; a part of an upload has none: \
                 it carries rows a replica wrote, never a sweep or a table to create"
            ),
        ));
    }
    if flags & WRITES != 0 && flags & (SWEEP_START | SWEEP_END) != 0 {
        return Err(Fault::new(
            Rule::ReplicaWrittenPart,
            format!(
                "the part flags at byte {at} are {flags:#04x}: bit 2 says the replica writes \
                 the table, which it never sweeps, so bits 0 and 1 must be 0"
            ),
        ));
    }
    Ok(())
}

/// Reads a count of deletes or upserts of `bytes_each` bytes at least apiece, and adds it
/// to `rows`, the body's so far. Refuses any when the part flags (at `writes_at`) say the
/// replica writes the table; in an upload, a count that takes the body past
/// [`UPLOAD_ROWS_MAX`], before anything is allocated for it; and a count the bytes that
/// remain cannot hold.
fn read_row_count(
    reader: &mut Reader<'_>,
    what: &str,
    bytes_each: usize,
    writes_at: Option<usize>,
    carrier: Carrier,
    rows: &mut u64,
) -> Result<usize, Fault> {
    let at = reader.at();
    let count = reader.varint(what)?;
    if let Some(flags_at) = writes_at
        && count != 0
    {
        return Err(Fault::new(
            Rule::ReplicaWrittenPart,
            format!(
                "{what} at byte {at} is {count}, but the part flags at byte {flags_at} say the \
                 replica writes the table: such a part carries no rows (the replica's own go up)"
            ),
        ));
    }
    *rows = rows.saturating_add(count);
    if carrier == Carrier::Upload && *rows > UPLOAD_ROWS_MAX as u64 {
        return Err(Fault::new(
            Rule::UploadRowsMax,
            format!(
                "{what} at byte {at} is {count}, which brings the upload to {} rows, over \
                 {UPLOAD_ROWS_MAX}: the replica sends the rest in another upload",
                *rows
            ),
        ));
    }
    reader.count_checked(count, what, bytes_each, at)
}

fn read_columns(reader: &mut Reader<'_>) -> Result<Vec<Column>, Fault> {
    let count_at = reader.at();
    let count = reader.varint("the column count")?;
    if count == 0 || count > COLUMNS_MAX as u64 {
        return Err(Fault::new(
            Rule::ColumnCount,
            format!(
                "the column count at byte {count_at} is {count}; a part has 1..={COLUMNS_MAX} columns"
            ),
        ));
    }
    let count = reader.count_checked(count, "the column count", COLUMN_BYTES_MIN, count_at)?;
    let mut columns = Vec::with_capacity(count);
    for number in 1..=count {
        let within = |f: Fault| f.within(format_args!("column {number}"));
        let name = reader.str("the name").map_err(within)?;
        let affinity_at = reader.at();
        let affinity = reader.u8("the affinity").map_err(within)?;
        let affinity = Affinity::from_u8(affinity).ok_or_else(|| {
            within(Fault::new(
                Rule::Affinity,
                format!("the affinity at byte {affinity_at} is {affinity}; it is 1 Integer, 2 Real, 3 Text or 4 Blob"),
            ))
        })?;
        let not_null_at = reader.at();
        let not_null = match reader.u8("not_null").map_err(within)? {
            0 => false,
            1 => true,
            other => {
                return Err(within(Fault::new(
                    Rule::NotNullByte,
                    format!("not_null at byte {not_null_at} is {other}; it is 0 or 1"),
                )));
            }
        };
        let key_part = reader.u8("key_part").map_err(within)?;
        columns.push(Column {
            name: name.to_string(),
            affinity,
            not_null,
            key_part,
        });
    }
    Ok(columns)
}

/// Reads one value per column given, refusing a Null where the column is not_null.
fn read_row<'c>(
    reader: &mut Reader<'_>,
    columns: impl Iterator<Item = &'c Column>,
    what: &str,
) -> Result<Vec<Value>, Fault> {
    let mut row = Vec::new();
    for column in columns {
        let at = reader.at();
        let value = reader
            .value(&format!("the value of column {:?}", column.name))
            .map_err(|f| f.within(what))?;
        if value == Value::Null && column.not_null {
            return Err(Fault::new(
                Rule::NullInNotNull,
                format!(
                    "{what} has a Null at byte {at} for column {:?}, which is not_null",
                    column.name
                ),
            ));
        }
        row.push(value);
    }
    Ok(row)
}

/// Checks a part's table name and columns, and returns the key: for each key part in
/// order, the index of its column.
fn check_header(table: &str, columns: &[Column]) -> Result<Vec<usize>, Fault> {
    check_table_name(table)?;
    if columns.is_empty() || columns.len() > COLUMNS_MAX {
        return Err(Fault::new(
            Rule::ColumnCount,
            format!(
                "it has {} columns; a part has 1..={COLUMNS_MAX}",
                columns.len()
            ),
        ));
    }
    let mut seen = HashSet::with_capacity(columns.len());
    for (index, column) in columns.iter().enumerate() {
        check_column_name(index + 1, &column.name)?;
        if !seen.insert(column.name.to_ascii_lowercase()) {
            return Err(Fault::new(
                Rule::ColumnNameDuplicate,
                format!(
                    "column {} is named {:?}, as an earlier column is (ignoring ASCII case)",
                    index + 1,
                    column.name
                ),
            ));
        }
    }
    check_key(table, columns)
}

/// Checks that the key parts present are exactly 1..=k with k >= 1, and returns the
/// column index of each part in order.
fn check_key(table: &str, columns: &[Column]) -> Result<Vec<usize>, Fault> {
    let key_len = columns.iter().filter(|c| c.key_part != 0).count();
    if key_len == 0 {
        return Err(Fault::new(
            Rule::NoKey,
            format!("no column of table {table:?} has a key_part; a part needs a key"),
        ));
    }
    let mut key: Vec<Option<usize>> = vec![None; key_len];
    for (index, column) in columns.iter().enumerate() {
        let part = usize::from(column.key_part);
        if part == 0 {
            continue;
        }
        let Some(slot) = key.get_mut(part - 1) else {
            return Err(Fault::new(
                Rule::KeyPartGap,
                format!(
                    "column {} ({:?}) of table {table:?} has key_part {part}, but the table \
                     has only {key_len} key columns, so its key parts are 1..={key_len}",
                    index + 1,
                    column.name
                ),
            ));
        };
        if let Some(earlier) = slot.replace(index) {
            return Err(Fault::new(
                Rule::KeyPartDuplicate,
                format!(
                    "column {} ({:?}) of table {table:?} has key_part {part}, as column {} \
                     ({:?}) does",
                    index + 1,
                    column.name,
                    earlier + 1,
                    columns[earlier].name
                ),
            ));
        }
    }
    // k columns in k slots, none out of range and none twice: every slot is filled.
    Ok(key.into_iter().flatten().collect())
}

/// Refuses an empty, long, NUL-holding or reserved table name.
pub(super) fn check_table_name(table: &str) -> Result<(), Fault> {
    if table.is_empty() || table.len() > NAME_BYTES_MAX {
        return Err(Fault::new(
            Rule::TableNameLen,
            format!(
                "the table name is {} bytes; a name is 1..={NAME_BYTES_MAX} bytes",
                table.len()
            ),
        ));
    }
    if let Some(at) = table.find('\0') {
        return Err(Fault::new(
            Rule::NameNul,
            format!("the table name {table:?} holds a NUL at byte {at}"),
        ));
    }
    for prefix in RESERVED_TABLE_PREFIXES {
        let head = table.as_bytes().get(..prefix.len());
        if head.is_some_and(|head| head.eq_ignore_ascii_case(prefix.as_bytes())) {
            return Err(Fault::new(
                Rule::TableNameReserved,
                format!(
                    "the table name {table:?} starts with {prefix:?}, which the replica keeps for itself"
                ),
            ));
        }
    }
    Ok(())
}

/// Refuses an empty, long or NUL-holding lane name, as a table name is refused: a lane is
/// named in the rules as a table is, and a NUL would be cut by a C string or refused by
/// Postgres text. The reserved prefixes do not apply: a lane names no table.
pub(super) fn check_lane_name(lane: &str) -> Result<(), Fault> {
    if lane.is_empty() || lane.len() > NAME_BYTES_MAX {
        return Err(Fault::new(
            Rule::LaneNameLen,
            format!(
                "the lane name is {} bytes; a name is 1..={NAME_BYTES_MAX} bytes",
                lane.len()
            ),
        ));
    }
    if let Some(at) = lane.find('\0') {
        return Err(Fault::new(
            Rule::NameNul,
            format!("the lane name {lane:?} holds a NUL at byte {at}"),
        ));
    }
    Ok(())
}

/// Refuses a count of columns the replica writes (read at byte `at`, or `None` when
/// encoding) that is 0, not below the part's column count, or takes in a key column.
fn check_owned(owned: u64, at: Option<usize>, columns: &[Column]) -> Result<usize, Fault> {
    let first = columns
        .len()
        .saturating_sub(usize::try_from(owned).unwrap_or(usize::MAX));
    if owned == 0
        || owned >= columns.len() as u64
        || columns[first..].iter().any(|c| c.key_part > 0)
    {
        return Err(Fault::new(
            Rule::ReplicaWrittenPart,
            format!(
                "the count of columns the replica writes{} is {owned}, of {} columns: a \
                 two-way table's replica writes its last 1 or more columns, never a key column",
                at.map(|at| format!(" at byte {at}")).unwrap_or_default(),
                columns.len()
            ),
        ));
    }
    Ok(owned as usize)
}

/// Refuses a part that says the replica writes its table and yet asks for a sweep or
/// carries rows, whose lane a replica would refuse, or whose two-way columns do not fit.
fn check_writes(part: &TablePart) -> Result<(), Fault> {
    let Some(Writes { lane, owned, .. }) = &part.writes else {
        return Ok(());
    };
    check_lane_name(lane)?;
    if *owned > 0 {
        check_owned(*owned as u64, None, &part.columns)?;
    }
    if part.sweep != Sweep::default() {
        return Err(Fault::new(
            Rule::ReplicaWrittenPart,
            format!(
                "it says the replica writes the table (lane {lane:?}) and asks for a sweep \
                 ({:?}); a replica never sweeps a table it writes",
                part.sweep
            ),
        ));
    }
    if !part.deletes.is_empty() || !part.upserts.is_empty() {
        return Err(Fault::new(
            Rule::ReplicaWrittenPart,
            format!(
                "it says the replica writes the table (lane {lane:?}) and carries {} deletes \
                 and {} upserts; such a part carries no rows (the replica's own go up)",
                part.deletes.len(),
                part.upserts.len()
            ),
        ));
    }
    Ok(())
}

fn check_column_name(number: usize, name: &str) -> Result<(), Fault> {
    if name.is_empty() || name.len() > NAME_BYTES_MAX {
        return Err(Fault::new(
            Rule::ColumnNameLen,
            format!(
                "the name of column {number} is {} bytes; a name is 1..={NAME_BYTES_MAX} bytes",
                name.len()
            ),
        ));
    }
    if let Some(at) = name.find('\0') {
        return Err(Fault::new(
            Rule::NameNul,
            format!("the name of column {number}, {name:?}, holds a NUL at byte {at}"),
        ));
    }
    Ok(())
}

/// Writes a part up to its row counts: name, flags, columns and, if the replica writes
/// the table, the lane.
fn write_header(part: &TablePart, out: &mut Vec<u8>) {
    write_str(&part.table, out);
    let start = if part.sweep.start { SWEEP_START } else { 0 };
    let end = if part.sweep.end { SWEEP_END } else { 0 };
    let writes = match &part.writes {
        None => 0,
        Some(w) => {
            let two_way = if w.owned > 0 { TWO_WAY } else { 0 };
            let restate = if w.restate { RESTATE } else { 0 };
            WRITES | two_way | restate
        }
    };
    out.push(start | end | writes);
    value::encode_varint(part.columns.len() as u64, out);
    for column in &part.columns {
        write_str(&column.name, out);
        out.push(column.affinity as u8);
        out.push(u8::from(column.not_null));
        out.push(column.key_part);
    }
    if let Some(w) = &part.writes {
        write_str(&w.lane, out);
        if w.owned > 0 {
            value::encode_varint(w.owned as u64, out);
        }
    }
}

/// Writes one row of `width` values, one per column given, refusing a wrong width, NaN,
/// and a Null in a not_null column.
fn write_row<'c>(
    row: &[Value],
    columns: impl Iterator<Item = &'c Column>,
    width: usize,
    what: &str,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    if row.len() != width {
        return Err(EncodeError::Invalid {
            rule: "row-width",
            detail: format!(
                "{what}: it has {} values, the part needs {width}",
                row.len()
            ),
        });
    }
    for (value, column) in row.iter().zip(columns) {
        if *value == Value::Null && column.not_null {
            let detail = format!(
                "{what}: a Null for column {:?}, which is not_null",
                column.name
            );
            return Err(Fault::new(Rule::NullInNotNull, detail).into());
        }
        value::encode_value(value, out).map_err(|_| EncodeError::NotANumber {
            at: format!("{what}, column {:?}", column.name),
        })?;
    }
    Ok(())
}

pub(super) fn write_str(text: &str, out: &mut Vec<u8>) {
    value::encode_varint(text.len() as u64, out);
    out.extend_from_slice(text.as_bytes());
}
