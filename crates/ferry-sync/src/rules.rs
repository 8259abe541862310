//! The rules file: which Postgres tables ferry-sync mirrors, and which replicas hold which
//! rows. TOML; `docs/sync.md`, "Rules", is the contract. Pure: parsing and the checks that
//! need no database. What needs the database (columns, keys, foreign keys, views) is
//! checked by [`crate::catalog`].
//!
//! 1. Parse the text with serde (`deny_unknown_fields` everywhere): an unknown key, a
//!    missing one or a value of the wrong shape is refused with its line and column.
//! 2. Resolve names: `products` means `public.products`, `shop.products` names a schema.
//!    Every name is an identifier (`[A-Za-z_][A-Za-z0-9_]*`, 1 to 63 bytes) and is quoted
//!    as written when ferry-sync builds SQL (so `Products` is not `products`).
//! 3. Check what holds without a database: one rule per table, replica-side names unique,
//!    `partition` present on a broadcast table if and only if the replicas are
//!    partitioned, `record` and `both` tables' keys (docs/sync-up.md §2), `setting`
//!    refused (it comes with wishes).
//! 4. Build the model the relay consumes ([`Rules`], [`Table`], [`Route`]), tables sorted
//!    by relation, and its digest ([`Rules::digest`]) over a canonical form (every default
//!    filled in), so two files that say the same thing have one digest.
//!
//! Nothing is persisted here; `install` records the digest in `ferry_sync.meta.declared`.
//!
//! ```toml
//! [replicas]
//! relation = "public.stores"   # has a uuid column named by `id` (default "id")
//! live = "open"                # optional SQL condition over the relation's columns
//! partition = "region_id"      # optional column of the relation
//!
//! [tables.products]
//! sync = "broadcast"
//! partition = "region_id"      # required for broadcast iff replicas are partitioned
//! columns = ["id", "name", "price", "region_id"]
//!
//! [tables.orders]
//! sync = { assigned = "store_id" }
//!
//! [tables.order_lines]
//! sync = { follows = "order_id" }
//!
//! [tables.customers]           # no sync: travels only by closure
//! ```

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

/// Bytes of a Postgres identifier (NAMEDATALEN - 1): a longer one would be truncated by
/// Postgres, so two names that differ past it would name one table.
pub const IDENT_BYTES_MAX: usize = 63;

/// The rules, checked as far as a rules file alone can be.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Rules {
    pub replicas: Replicas,
    /// Sorted by relation; each relation once.
    pub tables: Vec<Table>,
    /// Tables the replicas write and the server files (docs/sync-up.md §2), sorted by
    /// relation. Left out of the digest's JSON when empty, so rules without any keep the
    /// digest they were installed with.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub records: Vec<RecordTable>,
    /// Relay shards (docs/sync-scale.md §2): the replicas are spread over this many relays,
    /// each under its own lock, and every note is written once per shard. Left out of the
    /// digest's JSON when 1.
    #[serde(skip_serializing_if = "is_one")]
    pub shards: u32,
    /// The file the rules came from, for messages (not part of the digest).
    #[serde(skip)]
    pub path: PathBuf,
}

/// Where the replicas are: a relation with one row per replica.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Replicas {
    pub relation: Relation,
    /// The uuid column naming each replica.
    pub id: String,
    /// A SQL condition over the relation's columns: the replicas that hold anything.
    pub live: Option<String>,
    /// The column that puts each replica in a partition (`broadcast` sends a row to the
    /// replicas of its partition only).
    pub partition: Option<String>,
    /// The column naming each replica's audience (docs/sync-scale.md §1): a table entry with
    /// an audience goes to that audience's replicas only. Left out of the digest's JSON
    /// when `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
}

/// A schema-qualified relation name, as written (quoted as written in SQL).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Relation {
    pub schema: String,
    pub name: String,
}

/// One mirrored table: one entry of the rules. A Postgres table has one entry, or one per
/// audience (docs/sync-scale.md §1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Table {
    /// The Postgres table.
    pub relation: Relation,
    /// The audience whose replicas hold this entry; `None`: every replica. Left out of the
    /// digest's JSON when `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
    /// The entry's key in the rules file, for messages (not part of the digest).
    #[serde(skip)]
    pub label: String,
    /// The table's name on the replicas (no schema there). Unique among the tables.
    pub replica_name: String,
    pub route: Route,
    /// The columns mirrored; `None`: every column of the table (or of `from`).
    pub columns: Option<Vec<String>>,
    /// A view rows are read from (same key as the table).
    pub from: Option<Relation>,
    /// A view of the rows the rule sends for their own sake.
    pub active: Option<Relation>,
    /// A two-way table (`mirror = "both"`): columns the replicas write back. Left out of
    /// the digest's JSON when `None`, so catalog tables keep the digest they had.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub two_way: Option<TwoWay>,
}

/// The columns of a two-way table the replica holding a row writes (docs/sync-up.md §2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TwoWay {
    /// Never key or routing columns, never in `columns` (those travel down).
    pub columns: Vec<String>,
    /// The upload lane.
    pub lane: String,
}

/// A table the replicas write (`mirror = "record"`): each replica's rows are filed into
/// it by the key (docs/sync-up.md §2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RecordTable {
    pub relation: Relation,
    /// The table's name on the replicas. Unique among every table the rules name.
    pub replica_name: String,
    /// The columns the replicas write; `None`: every column of the table.
    pub columns: Option<Vec<String>>,
    /// A uuid column filing sets to the sending replica; also what lets deletes be filed.
    pub replica: Option<String>,
    /// An integer column: a newer version wins. Without one, the first filing wins.
    pub version: Option<String>,
    /// The upload lane (docs/sync-up.md §3.2).
    pub lane: String,
    /// A setting table (`mirror = "setting"`, docs/sync-up.md §7): the columns the server
    /// may wish values for. Empty for a plain record table (and then left out of the
    /// digest's JSON).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub desired: Vec<String>,
}

impl RecordTable {
    /// Whether this is a setting table.
    pub fn is_setting(&self) -> bool {
        !self.desired.is_empty()
    }
}

/// The lane a replica-written table uploads in when the rules name none.
pub const LANE_DEFAULT: &str = "main";

/// Where the server keeps wishes (docs/sync-up.md §7), mirrored to every replica with
/// setting tables as a two-way table of this name.
pub const WISHES_RELATION: (&str, &str) = ("ferry_sync", "wishes");
/// The wishes table's name on the replicas.
pub const WISHES_TABLE: &str = "ferry_wishes";
/// The wishes table's columns the replicas write: their answer.
pub const WISH_ANSWER_COLUMNS: [&str; 4] = ["answered", "outcome", "reason", "answered_at"];

/// Which replicas hold which rows of a table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// Every replica (of the row's partition, when the replicas are partitioned).
    Broadcast { partition: Option<String> },
    /// The replica a uuid column names.
    Assigned { column: String },
    /// Wherever the parent row that these foreign key columns point at goes.
    Follows { columns: Vec<String> },
    /// Every replica that a group holding the row is assigned to.
    Grouped(Grouped),
    /// Every replica a view pairs the row with.
    Routed(Routed),
    /// No rule of its own: a row travels only with a held row that points at it.
    Closure,
}

/// `grouped`: `members` links rows (`row`) to groups (`group`); `assigned` links groups
/// (a column also named `group`) to replicas (`replica`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Grouped {
    pub members: Relation,
    pub row: String,
    pub group: String,
    pub assigned: Relation,
    pub replica: String,
}

/// `routed`: `view` pairs rows (`row`: the key's columns, in key order) with replicas
/// (`replica`, a uuid).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Routed {
    pub view: Relation,
    pub row: Vec<String>,
    pub replica: String,
}

/// A rules file that cannot be used. Permanent: the same file fails the same way.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RulesError {
    /// The text is not TOML, or not the rules' shape (an unknown key, a missing one).
    #[error("rules file {}, line {line}, column {column}: {message}; fix the rules file", path.display())]
    Syntax {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    /// The shape is right but what it says cannot hold.
    #[error("rules file {}: {place}: {message}", path.display())]
    Invalid {
        path: PathBuf,
        /// `[replicas]` or `[tables.NAME]`, as written.
        place: String,
        message: String,
    },
}

impl ferry_core::Classify for RulesError {
    fn class(&self) -> ferry_core::Class {
        ferry_core::Class::Permanent
    }
}

impl Rules {
    /// Parses and checks a rules file; `path` is only for messages.
    pub fn parse(text: &str, path: impl AsRef<Path>) -> Result<Rules, RulesError> {
        let path = path.as_ref().to_path_buf();
        let raw: RawRules = toml::from_str(text).map_err(|e| syntax(&path, text, &e))?;
        build(raw, path)
    }

    /// SHA-256 (hex) of the rules' canonical form: the model as JSON, every default filled
    /// in and tables sorted, so only a change of meaning changes it.
    pub fn digest(&self) -> String {
        let json = serde_json::to_string(self).expect("the rules model serializes: plain data");
        let hash = Sha256::digest(format!("ferry-sync rules v1\n{json}").as_bytes());
        hash.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The first entry that mirrors `relation` (its only one, unless it has one per
    /// audience), if any.
    pub fn table(&self, relation: &Relation) -> Option<&Table> {
        self.tables.iter().find(|t| &t.relation == relation)
    }

    /// The entry named `entry` ([`Table::entry`]), if any.
    pub fn entry(&self, entry: &str) -> Option<&Table> {
        self.tables.iter().find(|t| t.entry() == entry)
    }

    /// The entries that mirror `relation`: one, one per audience, or none.
    pub fn entries<'a>(&'a self, relation: &'a Relation) -> impl Iterator<Item = &'a Table> {
        self.tables.iter().filter(move |t| &t.relation == relation)
    }

    /// Whether some entry mirrors `relation`.
    pub fn mirrors(&self, relation: &Relation) -> bool {
        self.entries(relation).next().is_some()
    }

    /// Whether any table is a setting table (so the rules mirror the wishes).
    pub fn has_settings(&self) -> bool {
        self.records.iter().any(RecordTable::is_setting)
    }

    /// Whether the replicas are partitioned.
    pub fn partitioned(&self) -> bool {
        self.replicas.partition.is_some()
    }
}

impl Relation {
    /// `name` means `public.name`; `schema.name` names the schema. Each part an identifier.
    pub fn parse(text: &str) -> Result<Relation, NameError> {
        let (schema, name) = match text.split_once('.') {
            Some((schema, name)) => (schema, name),
            None => ("public", text),
        };
        check_ident(schema).map_err(|e| NameError(format!("{text:?}: the schema {e}")))?;
        check_ident(name).map_err(|e| NameError(format!("{text:?}: {e}")))?;
        Ok(Relation {
            schema: schema.into(),
            name: name.into(),
        })
    }

    /// `"schema"."name"`, for SQL.
    pub fn quoted(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }
}

impl fmt::Display for Relation {
    /// `schema.name`: how notes, messages and errors name a relation.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// How the server's state names the entry of `relation` for `audience`: `schema.name`,
/// or `schema.name@audience` (docs/sync-scale.md §1).
pub fn entry_name(relation: &Relation, audience: Option<&str>) -> String {
    match audience {
        None => relation.to_string(),
        Some(a) => format!("{relation}@{a}"),
    }
}

/// Whether a replica of audience `replica` holds an entry for audience `entry`: an entry
/// without one goes to every replica, an entry for one to that audience's replicas.
pub fn reaches(entry: Option<&str>, replica: Option<&str>) -> bool {
    entry.is_none() || entry == replica
}

impl Table {
    /// The name the server's state keeps this entry under ([`entry_name`]): notes
    /// name the Postgres table, held state the entry.
    pub fn entry(&self) -> String {
        entry_name(&self.relation, self.audience.as_deref())
    }

    /// Whether a replica of `audience` holds this entry.
    pub fn reaches(&self, audience: Option<&str>) -> bool {
        reaches(self.audience.as_deref(), audience)
    }

    /// The columns the route reads on the table itself (they decide who holds a row, so a
    /// change of any of them must be noted even when they are not mirrored).
    pub fn route_columns(&self) -> Vec<&str> {
        match &self.route {
            Route::Broadcast { partition } => partition.iter().map(String::as_str).collect(),
            Route::Assigned { column } => vec![column.as_str()],
            Route::Follows { columns } => columns.iter().map(String::as_str).collect(),
            Route::Grouped(_) | Route::Routed(_) | Route::Closure => Vec::new(),
        }
    }
}

/// Quotes an identifier for SQL, as written.
pub fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// Quotes a string literal for SQL (standard-conforming: only `'` is special).
pub fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// A name in the rules that is not an identifier Postgres would take as written.
/// Permanent: the same name fails the same way; the message says which and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NameError(pub String);

impl ferry_core::Classify for NameError {
    fn class(&self) -> ferry_core::Class {
        ferry_core::Class::Permanent
    }
}

/// An identifier as the rules accept it: 1..=63 bytes of `[A-Za-z0-9_]`, not starting
/// with a digit.
pub fn check_ident(ident: &str) -> Result<(), NameError> {
    if ident.is_empty() {
        return Err(NameError("name is empty".into()));
    }
    if ident.len() > IDENT_BYTES_MAX {
        return Err(NameError(format!(
            "name {ident:?} is {} bytes, over Postgres's {IDENT_BYTES_MAX}",
            ident.len()
        )));
    }
    let first_ok = ident.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_');
    if !first_ok || !ident.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(NameError(format!(
            "name {ident:?} is not an identifier (letters, digits and _, not starting with a digit)"
        )));
    }
    Ok(())
}

// ---- The file's shape (serde) ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRules {
    replicas: RawReplicas,
    #[serde(default)]
    tables: BTreeMap<String, RawTable>,
    relay: Option<RawRelay>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRelay {
    shards: u32,
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// The most relay shards the rules may name: each writes every note once more.
pub const SHARDS_MAX: u32 = 64;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplicas {
    relation: String,
    #[serde(default = "default_id")]
    id: String,
    live: Option<String>,
    partition: Option<String>,
    audience: Option<String>,
}

fn default_id() -> String {
    "id".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTable {
    sync: Option<RawSync>,
    #[serde(default)]
    mirror: Mirror,
    partition: Option<String>,
    columns: Option<Vec<String>>,
    active: Option<String>,
    from: Option<String>,
    #[serde(rename = "as")]
    replica_name: Option<String>,
    replica: Option<String>,
    version: Option<String>,
    lane: Option<String>,
    replica_writes: Option<Vec<String>>,
    desired: Option<Vec<String>>,
    table: Option<String>,
    audience: Option<String>,
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
enum Mirror {
    #[default]
    Catalog,
    Record,
    Both,
    Setting,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum RawSync {
    Broadcast,
    Assigned(String),
    Follows(OneOrMany),
    Grouped(RawGrouped),
    Routed(RawRouted),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGrouped {
    members: String,
    row: String,
    group: String,
    assigned: String,
    replica: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRouted {
    view: String,
    row: OneOrMany,
    replica: String,
}

/// A TOML error as a [`RulesError::Syntax`], with the 1-based line and column of its
/// span's start.
fn syntax(path: &Path, text: &str, e: &toml::de::Error) -> RulesError {
    let start = e.span().map_or(0, |s| s.start).min(text.len());
    let before = &text[..start];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    RulesError::Syntax {
        path: path.to_path_buf(),
        line,
        column,
        message: e.message().trim().to_string(),
    }
}

// ---- Building and checking the model ----

fn build(raw: RawRules, path: PathBuf) -> Result<Rules, RulesError> {
    let invalid = |place: &str, message: String| RulesError::Invalid {
        path: path.clone(),
        place: place.to_string(),
        message,
    };
    let replicas = build_replicas(raw.replicas).map_err(|m| invalid("[replicas]", m))?;
    let mut tables: Vec<Table> = Vec::new();
    let mut records: Vec<RecordTable> = Vec::new();
    // (relation, audience, replica-side name, writes back, key) of every entry.
    let mut seen: Vec<(Relation, Option<String>, String, bool, String)> = Vec::new();
    for (key, raw_table) in raw.tables {
        let place = format!("[tables.{key}]");
        let entry = if matches!(raw_table.mirror, Mirror::Record | Mirror::Setting) {
            let record = build_record(&key, raw_table).map_err(|m| invalid(&place, m))?;
            let entry = (
                record.relation.clone(),
                None,
                record.replica_name.clone(),
                true,
                key.clone(),
            );
            records.push(record);
            entry
        } else {
            let table = build_table(&key, raw_table, &replicas).map_err(|m| invalid(&place, m))?;
            let entry = (
                table.relation.clone(),
                table.audience.clone(),
                table.replica_name.clone(),
                table.two_way.is_some(),
                key.clone(),
            );
            tables.push(table);
            entry
        };
        if let Some(m) = clash(&seen, &entry) {
            return Err(invalid(&place, m));
        }
        seen.push(entry);
    }
    if records.iter().any(RecordTable::is_setting) {
        tables.push(wishes_table());
    }
    tables.sort_by(|a, b| (&a.relation, &a.audience).cmp(&(&b.relation, &b.audience)));
    records.sort_by(|a, b| a.relation.cmp(&b.relation));
    let shards = match raw.relay {
        None => 1,
        Some(r) if (1..=SHARDS_MAX).contains(&r.shards) => r.shards,
        Some(r) => {
            return Err(invalid(
                "[relay]",
                format!(
                    "shards = {} is out of range; name 1 to {SHARDS_MAX} (each shard is a relay of its own, and every change is noted once per shard)",
                    r.shards
                ),
            ));
        }
    };
    Ok(Rules {
        replicas,
        tables,
        records,
        shards,
        path,
    })
}

/// Why entry `e` cannot stand beside the entries `seen`, if it cannot: a Postgres table
/// is mirrored by one entry, or by one per audience; a replica-side name names one table
/// for every replica that holds it, and one that replicas write back names one table.
fn clash(
    seen: &[(Relation, Option<String>, String, bool, String)],
    e: &(Relation, Option<String>, String, bool, String),
) -> Option<String> {
    let (relation, audience, name, writes, _) = e;
    for (r, a, n, w, other) in seen {
        let overlap = a.is_none() || audience.is_none() || a == audience;
        if r == relation && overlap {
            return Some(match (a, audience) {
                (Some(a), Some(_)) => format!(
                    "names table {relation} for audience {a:?}, which [tables.{other}] does too; keep one"
                ),
                (None, None) => format!(
                    "names table {relation}, which another entry names too ([tables.{other}]); keep one"
                ),
                _ => format!(
                    "names table {relation}, which [tables.{other}] names too, and one of them has no `audience` (it goes to every replica); give each entry of a table its own audience"
                ),
            });
        }
        if n == name && (overlap || *w || *writes) {
            return Some(format!(
                "the replica-side name {name:?} is taken by [tables.{other}]; give one of them another with `as = \"...\"`"
            ));
        }
    }
    None
}

fn build_replicas(raw: RawReplicas) -> Result<Replicas, String> {
    let relation = Relation::parse(&raw.relation).map_err(|e| format!("relation {e}"))?;
    check_ident(&raw.id).map_err(|e| format!("id: {e}"))?;
    if let Some(p) = &raw.partition {
        check_ident(p).map_err(|e| format!("partition: {e}"))?;
    }
    if let Some(a) = &raw.audience {
        check_ident(a).map_err(|e| format!("audience: {e}"))?;
    }
    if raw.live.as_deref().is_some_and(|l| l.trim().is_empty()) {
        return Err(
            "live is empty; leave it out when every replica is live, or write a SQL condition"
                .into(),
        );
    }
    Ok(Replicas {
        relation,
        id: raw.id,
        live: raw.live,
        partition: raw.partition,
        audience: raw.audience,
    })
}

fn build_table(key: &str, raw: RawTable, replicas: &Replicas) -> Result<Table, String> {
    let relation =
        Relation::parse(raw.table.as_deref().unwrap_or(key)).map_err(|e| format!("table {e}"))?;
    let audience = match raw.audience {
        Some(a) if replicas.audience.is_none() => {
            return Err(format!(
                "`audience = {a:?}` needs the replicas' audience: add `audience = \"COLUMN\"` to [replicas], naming the column that says each replica's audience"
            ));
        }
        Some(a) => Some(
            check_ident(&a)
                .map(|_| a)
                .map_err(|e| format!("audience: {e}"))?,
        ),
        None => None,
    };
    let partitioned = replicas.partition.is_some();
    for (what, given) in [
        ("replica", raw.replica.is_some()),
        ("version", raw.version.is_some()),
        ("desired", raw.desired.is_some()),
    ] {
        if given {
            return Err(format!(
                "`{what}` applies to tables the replicas write (mirror = \"record\" or \"setting\"); remove it from this table"
            ));
        }
    }
    let two_way = if raw.mirror == Mirror::Both {
        let Some(written) = raw.replica_writes else {
            return Err(
                "a two-way table (mirror = \"both\") names the columns the replicas write: add `replica_writes = [\"COLUMN\", ...]`"
                    .into(),
            );
        };
        if raw.from.is_some() {
            return Err(
                "`from` reads rows through a view, and a two-way table's replicas write the table itself: remove `from`, or make the table a catalog table"
                    .into(),
            );
        }
        let written = check_list("replica_writes", written)?;
        if let Some(c) = raw
            .columns
            .as_ref()
            .and_then(|cs| written.iter().find(|w| cs.contains(w)))
        {
            return Err(format!(
                "column {c:?} is in both `columns` (the server's, sent down) and `replica_writes` (the replicas', sent up); a column has one writer: keep it in one"
            ));
        }
        let lane = match raw.lane {
            Some(l) => check_ident(&l)
                .map(|_| l)
                .map_err(|e| format!("lane: {e}"))?,
            None => LANE_DEFAULT.to_string(),
        };
        Some(TwoWay {
            columns: written,
            lane,
        })
    } else {
        for (what, given) in [
            ("lane", raw.lane.is_some()),
            ("replica_writes", raw.replica_writes.is_some()),
        ] {
            if given {
                return Err(format!(
                    "`{what}` applies to tables the replicas write (mirror = \"record\" or \"both\"); remove it from this catalog table"
                ));
            }
        }
        None
    };
    let route = build_route(raw.sync, raw.partition, partitioned)?;
    if let (Some(tw), Some(column)) = (&two_way, route_column(&route))
        && tw.columns.iter().any(|c| c == column)
    {
        return Err(format!(
            "column {column:?} routes the table's rows, so the server writes it; it cannot be in `replica_writes`"
        ));
    }
    let columns = raw.columns.map(check_columns).transpose()?;
    let replica_name = replica_side_name(&relation, raw.replica_name)?;
    let view = |what: &str, v: Option<String>| {
        v.map(|v| Relation::parse(&v).map_err(|e| format!("{what}: {e}")))
            .transpose()
    };
    Ok(Table {
        from: view("from", raw.from)?,
        active: view("active", raw.active)?,
        relation,
        audience,
        label: key.to_string(),
        replica_name,
        route,
        columns,
        two_way,
    })
}

/// The wishes, as a two-way table assigned to the replica each names: the server writes
/// the wish, the replica its answer (docs/sync-up.md §7).
fn wishes_table() -> Table {
    Table {
        relation: Relation {
            schema: WISHES_RELATION.0.into(),
            name: WISHES_RELATION.1.into(),
        },
        audience: None,
        label: format!("{}.{}", WISHES_RELATION.0, WISHES_RELATION.1),
        replica_name: WISHES_TABLE.into(),
        route: Route::Assigned {
            column: "replica".into(),
        },
        columns: None,
        from: None,
        active: None,
        two_way: Some(TwoWay {
            columns: WISH_ANSWER_COLUMNS.iter().map(|c| c.to_string()).collect(),
            lane: "wishes".into(),
        }),
    }
}

/// The column of the row itself that a route reads, if one.
fn route_column(route: &Route) -> Option<&str> {
    match route {
        Route::Broadcast { partition } => partition.as_deref(),
        Route::Assigned { column } => Some(column),
        _ => None,
    }
}

/// The table's name on the replicas: `as`, or the relation's name.
fn replica_side_name(relation: &Relation, given: Option<String>) -> Result<String, String> {
    let replica_name = given.unwrap_or_else(|| relation.name.clone());
    check_ident(&replica_name).map_err(|e| format!("as: {e}"))?;
    let lower = replica_name.to_ascii_lowercase();
    if lower.starts_with("sqlite_") || lower.starts_with("ferry_") {
        return Err(format!(
            "the replica-side name {replica_name:?} starts with sqlite_ or ferry_, which SQLite and ferry keep for themselves; choose another with `as = \"...\"`"
        ));
    }
    Ok(replica_name)
}

fn build_record(key: &str, raw: RawTable) -> Result<RecordTable, String> {
    let relation = Relation::parse(key).map_err(|e| format!("table {e}"))?;
    for (what, given) in [
        ("sync", raw.sync.is_some()),
        ("partition", raw.partition.is_some()),
        ("from", raw.from.is_some()),
        ("active", raw.active.is_some()),
        ("replica_writes", raw.replica_writes.is_some()),
        ("table", raw.table.is_some()),
        ("audience", raw.audience.is_some()),
    ] {
        if given {
            return Err(format!(
                "`{what}` routes rows down (or picks whose copy of them), and the replicas write a record table, whichever replica it is: remove it, or make the table a catalog table"
            ));
        }
    }
    let setting = raw.mirror == Mirror::Setting;
    if !setting && raw.desired.is_some() {
        return Err(
            "`desired` names the columns the server may wish values for, on a setting table (mirror = \"setting\"); remove it"
                .into(),
        );
    }
    let ident = |what: &str, v: Option<String>| {
        v.map(|v| {
            check_ident(&v)
                .map(|_| v)
                .map_err(|e| format!("{what}: {e}"))
        })
        .transpose()
    };
    let columns = raw.columns.map(check_columns).transpose()?;
    let replica = ident("replica", raw.replica)?;
    let version = ident("version", raw.version)?;
    let lane = ident("lane", raw.lane)?.unwrap_or_else(|| LANE_DEFAULT.to_string());
    if let Some(columns) = &columns {
        for (what, c) in [("replica", &replica), ("version", &version)] {
            if let Some(c) = c
                && !columns.contains(c)
            {
                return Err(format!(
                    "{what} column {c:?} is not in `columns`; add it there"
                ));
            }
        }
    }
    let desired = if setting {
        let (Some(replica), Some(version), Some(desired)) = (&replica, &version, raw.desired)
        else {
            return Err(
                "a setting table (mirror = \"setting\") names its owner, its version and what the server may wish: `replica = \"COLUMN\"` (a uuid), `version = \"COLUMN\"` (an integer each write raises) and `desired = [\"COLUMN\", ...]`"
                    .into(),
            );
        };
        let desired = check_list("desired", desired)?;
        if let Some(c) = desired.iter().find(|c| *c == replica || *c == version) {
            return Err(format!(
                "column {c:?} is the setting's `replica` or `version`, which the replica itself writes; a wish cannot set it: leave it out of `desired`"
            ));
        }
        if let Some(columns) = &columns
            && let Some(c) = desired.iter().find(|c| !columns.contains(c))
        {
            return Err(format!(
                "desired column {c:?} is not in `columns`; add it there"
            ));
        }
        desired
    } else {
        Vec::new()
    };
    Ok(RecordTable {
        replica_name: replica_side_name(&relation, raw.replica_name)?,
        relation,
        columns,
        replica,
        version,
        lane,
        desired,
    })
}

fn build_route(
    sync: Option<RawSync>,
    partition: Option<String>,
    partitioned: bool,
) -> Result<Route, String> {
    let ident = |what: &str, v: String| {
        check_ident(&v)
            .map(|_| v)
            .map_err(|e| format!("{what}: {e}"))
    };
    let route = match sync {
        Some(RawSync::Broadcast) => {
            return match (partition, partitioned) {
                (Some(p), true) => Ok(Route::Broadcast {
                    partition: Some(ident("partition", p)?),
                }),
                (None, false) => Ok(Route::Broadcast { partition: None }),
                (None, true) => Err(
                    "a broadcast table needs `partition = \"COLUMN\"` because the replicas are partitioned: name the column that holds the row's partition"
                        .into(),
                ),
                (Some(_), false) => Err(
                    "`partition` is set but the replicas are not partitioned ([replicas] has no partition); remove it or partition the replicas"
                        .into(),
                ),
            };
        }
        Some(RawSync::Assigned(column)) => Route::Assigned {
            column: ident("assigned", column)?,
        },
        Some(RawSync::Follows(columns)) => Route::Follows {
            columns: check_list("follows", columns.into_vec())?,
        },
        Some(RawSync::Grouped(g)) => Route::Grouped(Grouped {
            members: Relation::parse(&g.members).map_err(|e| format!("grouped.members: {e}"))?,
            row: ident("grouped.row", g.row)?,
            group: ident("grouped.group", g.group)?,
            assigned: Relation::parse(&g.assigned).map_err(|e| format!("grouped.assigned: {e}"))?,
            replica: ident("grouped.replica", g.replica)?,
        }),
        Some(RawSync::Routed(r)) => Route::Routed(Routed {
            view: Relation::parse(&r.view).map_err(|e| format!("routed.view: {e}"))?,
            row: check_list("routed.row", r.row.into_vec())?,
            replica: ident("routed.replica", r.replica)?,
        }),
        None => Route::Closure,
    };
    if partition.is_some() {
        return Err(
            "`partition` applies to broadcast tables only; remove it (this table's route decides its replicas)"
                .into(),
        );
    }
    Ok(route)
}

fn check_columns(columns: Vec<String>) -> Result<Vec<String>, String> {
    if columns.is_empty() {
        return Err("columns is empty; list at least the key columns, or leave it out to mirror every column".into());
    }
    check_list("columns", columns)
}

/// A non-empty list of distinct identifiers.
fn check_list(what: &str, list: Vec<String>) -> Result<Vec<String>, String> {
    if list.is_empty() {
        return Err(format!("{what} is empty; name at least one column"));
    }
    let mut seen = BTreeSet::new();
    for c in &list {
        check_ident(c).map_err(|e| format!("{what}: {e}"))?;
        if !seen.insert(c) {
            return Err(format!("{what} names {c:?} twice"));
        }
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_name_is_in_public_and_a_dotted_one_names_its_schema() {
        let r = Relation::parse("products").unwrap();
        assert_eq!(r.to_string(), "public.products");
        let r = Relation::parse("shop.products").unwrap();
        assert_eq!(r.quoted(), "\"shop\".\"products\"");
        assert!(Relation::parse("a.b.c").is_err());
        assert!(Relation::parse("1x").is_err());
        assert!(Relation::parse(&"x".repeat(64)).is_err());
        assert!(Relation::parse(&"x".repeat(63)).is_ok());
    }

    #[test]
    fn literals_and_identifiers_are_quoted() {
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
