//! What Postgres says about the relations the rules name, checked against the rules and
//! mapped to SQLite. Read at `check`, `install` and relay start; nothing is written.
//!
//! 1. For every table in the rules, read its columns (`pg_attribute`, `pg_type`; a domain
//!    counts as its base type), its primary key and its foreign keys (`pg_constraint`)
//!    and its indexes (`pg_index`). A table without a primary key is refused: the key
//!    names rows on the wire and in notes. Key parts must be uuid, int2/4/8, text or
//!    varchar (one text form each; see [`mapping::KeyKind`]).
//! 2. Select the mirrored columns (`columns`, or every column of the table or of its
//!    `from` view), which must include the key, and map each to an [`Affinity`] and the
//!    expression the relay reads it with ([`mapping`] has the table). A column ferry-sync
//!    cannot map is refused, naming it.
//! 3. Check each route against the catalog: an `assigned` column is a uuid; `follows`
//!    columns are exactly the columns of a foreign key into a mirrored table; `grouped`'s
//!    two tables and `routed`'s view have the columns named, of the key's types; `from`,
//!    `active` and routed views exist and are read once (`SELECT … LIMIT 0`).
//! 4. Check the replicas relation: a table with a uuid `id`, the partition column, and a
//!    `live` condition that Postgres accepts (`SELECT id FROM rel WHERE (live) LIMIT 0`).
//! 5. Keep the foreign keys among mirrored tables whose columns are mirrored on both
//!    sides (`parents`; the others do not exist on a replica and are ignored, as are
//!    foreign keys into unmirrored tables), and order the tables parents first. A cycle
//!    (a self-reference included) is refused: rows could not be sent parents first.
//!
//! A routed view's dependencies are read from `pg_rewrite`/`pg_depend`, through views
//! it reads, down to tables; a table read only inside a function is not seen.

pub mod error;
pub mod mapping;
mod routes;

pub use error::CheckError;
pub use mapping::{KeyKind, Mapping};

use crate::rules::{RecordTable, Relation, Route, Rules, Table};
use crate::value::Affinity;
use error::Doing;
use sqlx::{PgConnection, Row};
use std::collections::{BTreeMap, BTreeSet};

/// The catalog facts for every relation the rules name.
#[derive(Clone, Debug)]
pub struct Catalog {
    /// The mirrored tables, parents before children.
    pub tables: Vec<CatalogTable>,
    pub replicas: CatalogReplicas,
    /// One per grouped table.
    pub groups: Vec<CatalogGroup>,
    /// One per routed table.
    pub routes: Vec<CatalogRoute>,
    /// The tables the replicas write (docs/sync-up.md §2), as the rules list them.
    pub records: Vec<CatalogTable>,
    /// Plain indexes (no expression, no predicate) of the relations ferry-sync indexes,
    /// other than ferry-sync's own: their key columns, leading first. The DDL creates no
    /// index that one of these already provides.
    pub indexes: BTreeMap<Relation, Vec<Vec<String>>>,
}

/// One mirrored table: one entry of the rules (a Postgres table mirrored for two
/// audiences is two).
#[derive(Clone, Debug)]
pub struct CatalogTable {
    pub relation: Relation,
    /// The entry's audience ([`crate::rules::Table::audience`]).
    pub audience: Option<String>,
    /// The mirrored columns, in the order of the table (or of its `from` view).
    pub columns: Vec<CatalogColumn>,
    /// The primary key's columns, in key order.
    pub key: Vec<String>,
    /// How each key part is written in key text; parallel to `key`.
    pub key_kinds: Vec<KeyKind>,
    /// Foreign keys into mirrored tables whose columns are mirrored on both sides.
    pub parents: Vec<ForeignKey>,
    /// A two-way table's columns the replicas write (never in `columns`), in the order
    /// the rules list them; empty otherwise.
    pub owned: Vec<CatalogColumn>,
}

/// One mirrored column.
#[derive(Clone, Debug)]
pub struct CatalogColumn {
    pub name: String,
    /// As Postgres writes it (`numeric(10,2)`, `timestamp with time zone`).
    pub pg_type: String,
    pub affinity: Affinity,
    pub mapping: Mapping,
    pub not_null: bool,
    /// 0 when not part of the key; 1, 2, … for the key's parts in order.
    pub key_part: u8,
    /// `pg_attribute.attnum` (of the `from` view, when there is one).
    pub ordinal: i16,
    /// What the relay selects: `"price"::text`.
    pub select_expr: String,
}

/// `columns` of the child point at `parent_columns` of `parent`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignKey {
    pub name: String,
    pub columns: Vec<String>,
    pub parent: Relation,
    pub parent_columns: Vec<String>,
}

/// The replicas relation.
#[derive(Clone, Debug)]
pub struct CatalogReplicas {
    pub relation: Relation,
    pub id: String,
    pub partition: Option<String>,
    pub audience: Option<String>,
}

/// A grouped table's two group tables, with the key kinds of their columns.
#[derive(Clone, Debug)]
pub struct CatalogGroup {
    pub table: Relation,
    /// The entry's audience: a table may be grouped once per audience.
    pub audience: Option<String>,
    pub members: Relation,
    pub row: String,
    pub row_kind: KeyKind,
    pub group: String,
    pub group_kind: KeyKind,
    pub assigned: Relation,
    pub replica: String,
}

/// A routed table's view and the tables it reads.
#[derive(Clone, Debug)]
pub struct CatalogRoute {
    pub table: Relation,
    /// The entry's audience: a table may be routed once per audience.
    pub audience: Option<String>,
    pub view: Relation,
    /// Tables (not views) the view reads, directly or through other views.
    pub reads: Vec<Relation>,
}

impl Catalog {
    /// Reads and checks the catalog for `rules`. Runs only reads (and `LIMIT 0` probes),
    /// so it may run inside the installing transaction.
    pub async fn load(conn: &mut PgConnection, rules: &Rules) -> Result<Catalog, CheckError> {
        let mut loader = Loader {
            conn,
            rules,
            relations: BTreeMap::new(),
        };
        let mut tables = Vec::new();
        for table in &rules.tables {
            tables.push(loader.table(table).await?);
        }
        link_parents(rules, &mut tables, &mut loader).await?;
        let tables = parents_first(tables)?;
        let replicas = loader.replicas().await?;
        let mut groups = Vec::new();
        let mut routes = Vec::new();
        for table in &rules.tables {
            let catalog_table = tables
                .iter()
                .find(|t| t.entry() == table.entry())
                .expect("every rules table was loaded");
            match &table.route {
                Route::Grouped(_) => groups.push(loader.group(table, catalog_table).await?),
                Route::Routed(_) => routes.push(loader.route(table, catalog_table).await?),
                Route::Assigned { column } => loader.require_uuid(
                    &table.relation,
                    column,
                    &place(rules, table),
                    "assigned",
                )?,
                Route::Broadcast { partition: Some(p) } => loader.check_partition(table, p).await?,
                Route::Broadcast { partition: None } | Route::Follows { .. } | Route::Closure => {}
            }
            loader.check_views(table, catalog_table).await?;
        }
        let mut records = Vec::with_capacity(rules.records.len());
        for record in &rules.records {
            records.push(loader.record(record).await?);
        }
        let indexes = loader
            .relations
            .iter()
            .map(|(r, info)| (r.clone(), info.indexes.clone()))
            .collect();
        Ok(Catalog {
            tables,
            replicas,
            groups,
            routes,
            records,
            indexes,
        })
    }

    /// The entry named `entry` ([`crate::rules::Table::entry`]).
    pub fn entry(&self, entry: &str) -> Option<&CatalogTable> {
        self.tables.iter().find(|t| t.entry() == entry)
    }

    /// Each mirrored Postgres table once, with its entries (one, or one per audience), in
    /// the order of `tables`.
    pub fn relations(&self) -> Vec<(&Relation, Vec<&CatalogTable>)> {
        let mut out: Vec<(&Relation, Vec<&CatalogTable>)> = Vec::new();
        for t in &self.tables {
            match out.iter_mut().find(|(r, _)| *r == &t.relation) {
                Some((_, entries)) => entries.push(t),
                None => out.push((&t.relation, vec![t])),
            }
        }
        out
    }
}

/// The entry a foreign key of an entry of `audience` points at among `tables`: the parent
/// table's entry for the same audience, or its entry for every audience.
pub fn parent_entry<'a, I>(entries: I, parent: &Relation, audience: Option<&str>) -> Option<usize>
where
    I: Iterator<Item = (&'a Relation, Option<&'a str>)> + Clone,
{
    let at = |a: Option<&str>| entries.clone().position(|e| e == (parent, a));
    audience.and_then(|a| at(Some(a))).or_else(|| at(None))
}

/// Each catalog table as (relation, audience), for [`parent_entry`].
pub fn entries_of(
    tables: &[CatalogTable],
) -> impl Iterator<Item = (&Relation, Option<&str>)> + Clone {
    tables.iter().map(|t| (&t.relation, t.audience.as_deref()))
}

impl CatalogTable {
    /// How the server's state names this entry ([`crate::rules::entry_name`]).
    pub fn entry(&self) -> String {
        crate::rules::entry_name(&self.relation, self.audience.as_deref())
    }

    /// The key parts as `(kind, column)`.
    pub fn key_parts(&self) -> impl Iterator<Item = (KeyKind, &str)> {
        self.key_kinds
            .iter()
            .copied()
            .zip(self.key.iter().map(String::as_str))
    }
}

/// `[tables.NAME] in FILE`: where in the rules a table comes from, for messages.
fn place(rules: &Rules, table: &Table) -> String {
    let key = if !table.label.is_empty() {
        table.label.clone()
    } else if table.relation.schema == "public" {
        table.relation.name.clone()
    } else {
        table.relation.to_string()
    };
    format!("[tables.{key}] in {}", rules.path.display())
}

/// A column as the catalog has it.
#[derive(Clone, Debug)]
struct PgColumn {
    name: String,
    ordinal: i16,
    not_null: bool,
    /// `format_type`, for people.
    display: String,
    /// The base type (a domain resolved): oid, `typname`, `typtype`.
    type_oid: i64,
    type_name: String,
    type_kind: String,
    element: Option<(String, String)>,
}

impl PgColumn {
    fn mapping(&self) -> Option<Mapping> {
        Mapping::of(&mapping::PgType {
            name: &self.type_name,
            kind: &self.type_kind,
            element: self.element.as_ref().map(|(n, k)| (n.as_str(), k.as_str())),
        })
    }
}

/// A relation as the catalog has it.
#[derive(Clone, Debug)]
struct RelationInfo {
    /// `pg_class.relkind`: `r` table, `p` partitioned table, `v` view, `m` materialized.
    kind: String,
    columns: Vec<PgColumn>,
    indexes: Vec<Vec<String>>,
}

impl RelationInfo {
    fn column(&self, name: &str) -> Option<&PgColumn> {
        self.columns.iter().find(|c| c.name == name)
    }

    fn is_table(&self) -> bool {
        self.kind == "r" || self.kind == "p"
    }
}

struct Loader<'a> {
    conn: &'a mut PgConnection,
    rules: &'a Rules,
    relations: BTreeMap<Relation, RelationInfo>,
}

impl Loader<'_> {
    /// Reads one mirrored table: steps 1 and 2.
    async fn table(&mut self, table: &Table) -> Result<CatalogTable, CheckError> {
        let here = place(self.rules, table);
        let info = self
            .relation(&table.relation, &format!("table named by {here}"))
            .await?;
        if !info.is_table() {
            return Err(CheckError::Mismatch(format!(
                "{} named by {here} is not a table (relkind {}); ferry-sync mirrors tables: name the table, and read through a view with `from`",
                table.relation, info.kind
            )));
        }
        let key = self.primary_key(&table.relation).await?;
        let key_kinds = key_kinds(&table.relation, &info, &key)?;
        let source_info = match &table.from {
            Some(view) => {
                let view_info = self
                    .relation(view, &format!("`from` view of {here}"))
                    .await?;
                for k in &key {
                    let same = view_info.column(k).map(|c| c.type_oid)
                        == info.column(k).map(|c| c.type_oid);
                    if !same {
                        return Err(CheckError::Mismatch(format!(
                            "the `from` view {view} of {here} lacks key column {k} (of the table's type); ferry-sync reads rows from it by the table's key: select {k} in the view"
                        )));
                    }
                }
                view_info
            }
            None => info.clone(),
        };
        let source = table.from.as_ref().unwrap_or(&table.relation);
        let owned_names: &[String] = table.two_way.as_ref().map_or(&[], |t| &t.columns);
        let mut columns = select_columns(table, &here, source, &source_info, &info, &key)?;
        columns.retain(|c| !owned_names.contains(&c.name));
        let mut owned = Vec::with_capacity(owned_names.len());
        for name in owned_names {
            let c = info
                .column(name)
                .ok_or_else(|| missing_column(&table.relation, name, &here, "replica_writes"))?;
            if key.contains(name) {
                return Err(CheckError::Mismatch(format!(
                    "column {}.{name} is in `replica_writes` of {here} and in the primary key; the key names rows, which the server writes: leave it out of `replica_writes`",
                    table.relation
                )));
            }
            let mapping = c.mapping().ok_or_else(|| {
                CheckError::Mismatch(format!(
                    "column {}.{name} (in `replica_writes` of {here}) has type {}, which ferry-sync cannot map to SQLite",
                    table.relation, c.display
                ))
            })?;
            owned.push(CatalogColumn {
                name: c.name.clone(),
                pg_type: c.display.clone(),
                affinity: mapping.affinity(),
                mapping,
                // The replica's copy starts empty: its writes fill it.
                not_null: false,
                key_part: 0,
                ordinal: c.ordinal,
                select_expr: mapping.expr(&crate::rules::quote_ident(&c.name)),
            });
        }
        Ok(CatalogTable {
            relation: table.relation.clone(),
            audience: table.audience.clone(),
            columns,
            key,
            key_kinds,
            parents: Vec::new(),
            owned,
        })
    }

    /// Reads one table the replicas write: a table with a mappable key, its `replica`
    /// column a uuid and its `version` column an integer.
    async fn record(&mut self, record: &RecordTable) -> Result<CatalogTable, CheckError> {
        let as_table = Table {
            relation: record.relation.clone(),
            audience: None,
            label: String::new(),
            replica_name: record.replica_name.clone(),
            route: Route::Closure,
            columns: record.columns.clone(),
            from: None,
            active: None,
            two_way: None,
        };
        let here = place(self.rules, &as_table);
        let table = self.table(&as_table).await?;
        if let Some(column) = &record.replica {
            self.require_uuid(&record.relation, column, &here, "replica")?;
        }
        if let Some(column) = &record.version {
            let c = table
                .columns
                .iter()
                .find(|c| &c.name == column)
                .ok_or_else(|| missing_column(&record.relation, column, &here, "version"))?;
            if c.mapping != Mapping::Integer {
                return Err(CheckError::Mismatch(format!(
                    "column {}.{column} (version of {here}) has type {}; a version is an integer each write raises (the newer one wins): use int4 or int8",
                    record.relation, c.pg_type
                )));
            }
        }
        Ok(table)
    }

    /// Reads a relation's columns and indexes once; refuses a missing relation.
    async fn relation(
        &mut self,
        relation: &Relation,
        role: &str,
    ) -> Result<RelationInfo, CheckError> {
        if let Some(info) = self.relations.get(relation) {
            return Ok(info.clone());
        }
        let quoted = relation.quoted();
        let kind: Option<String> =
            sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
                .bind(&quoted)
                .fetch_optional(&mut *self.conn)
                .await
                .doing(|| format!("looking up {relation}"))?;
        let Some(kind) = kind else {
            return Err(CheckError::Mismatch(format!(
                "{relation}, the {role}, does not exist in this database; create it, or fix the rules file"
            )));
        };
        let columns = sqlx::query(COLUMNS_SQL)
            .bind(&quoted)
            .fetch_all(&mut *self.conn)
            .await
            .doing(|| format!("reading the columns of {relation}"))?
            .iter()
            .map(pg_column)
            .collect::<Result<Vec<_>, _>>()
            .doing(|| format!("reading the columns of {relation}"))?;
        let indexes = if kind == "r" || kind == "p" {
            sqlx::query_scalar(INDEXES_SQL)
                .bind(&quoted)
                .fetch_all(&mut *self.conn)
                .await
                .doing(|| format!("reading the indexes of {relation}"))?
        } else {
            Vec::new()
        };
        let info = RelationInfo {
            kind,
            columns,
            indexes,
        };
        self.relations.insert(relation.clone(), info.clone());
        Ok(info)
    }

    async fn primary_key(&mut self, relation: &Relation) -> Result<Vec<String>, CheckError> {
        let key: Option<Vec<String>> = sqlx::query_scalar(PRIMARY_KEY_SQL)
            .bind(relation.quoted())
            .fetch_optional(&mut *self.conn)
            .await
            .doing(|| format!("reading the primary key of {relation}"))?;
        key.ok_or_else(|| {
            CheckError::Mismatch(format!(
                "table {relation} has no primary key; ferry-sync needs one to name rows: add one (ALTER TABLE {} ADD PRIMARY KEY (...))",
                relation.quoted()
            ))
        })
    }

    async fn foreign_keys(&mut self, relation: &Relation) -> Result<Vec<ForeignKey>, CheckError> {
        let rows = sqlx::query(FOREIGN_KEYS_SQL)
            .bind(relation.quoted())
            .fetch_all(&mut *self.conn)
            .await
            .doing(|| format!("reading the foreign keys of {relation}"))?;
        rows.iter()
            .map(|r| {
                Ok(ForeignKey {
                    name: r.try_get(0)?,
                    parent: Relation {
                        schema: r.try_get(1)?,
                        name: r.try_get(2)?,
                    },
                    columns: r.try_get(3)?,
                    parent_columns: r.try_get(4)?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .doing(|| format!("reading the foreign keys of {relation}"))
    }

    /// An existing column of a loaded relation that must be a uuid.
    fn require_uuid(
        &self,
        relation: &Relation,
        column: &str,
        here: &str,
        role: &str,
    ) -> Result<(), CheckError> {
        let info = self
            .relations
            .get(relation)
            .expect("require_uuid is called on loaded relations");
        let c = info
            .column(column)
            .ok_or_else(|| missing_column(relation, column, here, role))?;
        if c.type_name != "uuid" {
            return Err(CheckError::Mismatch(format!(
                "column {relation}.{column} ({role} of {here}) has type {}, but it names a replica, which is a uuid: use a uuid column",
                c.display
            )));
        }
        Ok(())
    }

    /// A broadcast table's partition column: present, of the replicas' partition type.
    async fn check_partition(&mut self, table: &Table, column: &str) -> Result<(), CheckError> {
        let here = place(self.rules, table);
        let info = self.relations[&table.relation].clone();
        let c = info
            .column(column)
            .ok_or_else(|| missing_column(&table.relation, column, &here, "partition"))?;
        let rules = self.rules;
        let replicas = self
            .relation(&rules.replicas.relation, "replicas relation")
            .await?;
        let partition = rules.replicas.partition.as_deref().unwrap_or_default();
        if let Some(r) = replicas.column(partition)
            && r.type_oid != c.type_oid
        {
            return Err(CheckError::Mismatch(format!(
                "column {}.{column} (partition of {here}) has type {}, but the replicas' partition column {}.{partition} has type {}; partitions are compared as values of one type: make them the same type",
                table.relation, c.display, self.rules.replicas.relation, r.display
            )));
        }
        Ok(())
    }

    /// `from` and `active` views: present, with the key, and readable.
    async fn check_views(&mut self, table: &Table, t: &CatalogTable) -> Result<(), CheckError> {
        let here = place(self.rules, table);
        if let Some(active) = &table.active {
            let info = self
                .relation(active, &format!("`active` view of {here}"))
                .await?;
            let table_info = self.relations[&table.relation].clone();
            for k in &t.key {
                let same =
                    info.column(k).map(|c| c.type_oid) == table_info.column(k).map(|c| c.type_oid);
                if !same {
                    return Err(CheckError::Mismatch(format!(
                        "the `active` view {active} of {here} lacks key column {k} (of the table's type); it says which rows are active by their key: select {k} in the view"
                    )));
                }
            }
            self.probe(active, &t.key, &format!("the `active` view of {here}"))
                .await?;
        }
        if let Some(from) = &table.from {
            let names: Vec<String> = t.columns.iter().map(|c| c.name.clone()).collect();
            self.probe(from, &names, &format!("the `from` view of {here}"))
                .await?;
        }
        Ok(())
    }

    /// `SELECT cols FROM rel LIMIT 0`: Postgres can read what the relay will read.
    async fn probe(
        &mut self,
        relation: &Relation,
        columns: &[String],
        role: &str,
    ) -> Result<(), CheckError> {
        let list: Vec<String> = columns
            .iter()
            .map(|c| crate::rules::quote_ident(c))
            .collect();
        let sql = format!(
            "SELECT {} FROM {} LIMIT 0",
            list.join(", "),
            relation.quoted()
        );
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&mut *self.conn)
            .await
            .doing(|| format!("reading {relation}, {role} (`{sql}`)"))?;
        Ok(())
    }

    /// Step 4: the replicas relation.
    async fn replicas(&mut self) -> Result<CatalogReplicas, CheckError> {
        let r = &self.rules.replicas;
        let here = format!("[replicas] in {}", self.rules.path.display());
        let info = self
            .relation(&r.relation, &format!("replicas relation of {here}"))
            .await?;
        if !info.is_table() {
            return Err(CheckError::Mismatch(format!(
                "the replicas relation {} of {here} is not a table (relkind {}); ferry-sync notes replicas joining and leaving with a trigger, which needs a table",
                r.relation, info.kind
            )));
        }
        self.require_uuid(&r.relation, &r.id, &here, "id")?;
        if let Some(p) = &r.partition {
            let c = info
                .column(p)
                .ok_or_else(|| missing_column(&r.relation, p, &here, "partition"))?;
            if KeyKind::of(&c.type_name).is_none() {
                return Err(CheckError::Mismatch(format!(
                    "column {}.{p} (partition of {here}) has type {}; a partition must be a uuid, an integer or text",
                    r.relation, c.display
                )));
            }
        }
        let condition = r.live.as_deref().unwrap_or("true");
        let sql = format!(
            "SELECT {} FROM {} WHERE ({condition}) LIMIT 0",
            crate::rules::quote_ident(&r.id),
            r.relation.quoted()
        );
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&mut *self.conn)
            .await
            .doing(|| format!("checking the live condition of {here} (`{sql}`)"))?;
        if let Some(a) = &r.audience {
            let c = info
                .column(a)
                .ok_or_else(|| missing_column(&r.relation, a, &here, "audience"))?;
            if KeyKind::of(&c.type_name) != Some(KeyKind::Text) {
                return Err(CheckError::Mismatch(format!(
                    "column {}.{a} (audience of {here}) has type {}; an audience is named by text: make it text (or a varchar)",
                    r.relation, c.display
                )));
            }
        }
        Ok(CatalogReplicas {
            relation: r.relation.clone(),
            id: r.id.clone(),
            partition: r.partition.clone(),
            audience: r.audience.clone(),
        })
    }
}

/// The key kinds of `key`'s columns, refusing a type with no single text form.
fn key_kinds(
    relation: &Relation,
    info: &RelationInfo,
    key: &[String],
) -> Result<Vec<KeyKind>, CheckError> {
    key.iter()
        .map(|k| {
            let c = info.column(k).expect("a primary key column is a column of its table");
            KeyKind::of(&c.type_name).ok_or_else(|| {
                CheckError::Mismatch(format!(
                    "key column {relation}.{k} has type {}; ferry-sync names rows by keys whose parts are uuid, int2, int4, int8, text or varchar: key the table by one of those",
                    c.display
                ))
            })
        })
        .collect()
}

/// Step 2: the mirrored columns of one table, mapped.
fn select_columns(
    table: &Table,
    here: &str,
    source: &Relation,
    source_info: &RelationInfo,
    table_info: &RelationInfo,
    key: &[String],
) -> Result<Vec<CatalogColumn>, CheckError> {
    if let Some(wanted) = &table.columns {
        for name in wanted {
            if source_info.column(name).is_none() {
                return Err(missing_column(source, name, here, "columns"));
            }
        }
        for k in key {
            if !wanted.contains(k) {
                return Err(CheckError::Mismatch(format!(
                    "`columns` of {here} leaves out key column {k}; the key names rows on the replicas: add {k:?} to `columns`"
                )));
            }
        }
    }
    let mut columns = Vec::new();
    for c in &source_info.columns {
        if table.columns.as_ref().is_some_and(|w| !w.contains(&c.name)) {
            continue;
        }
        let mapping = c.mapping().ok_or_else(|| {
            CheckError::Mismatch(format!(
                "column {source}.{} has type {}, which ferry-sync cannot map to SQLite; leave it out with `columns = [...]` or cast it in a `from` view ({here})",
                c.name, c.display
            ))
        })?;
        let key_part = key.iter().position(|k| *k == c.name).map_or(0, |i| i + 1);
        // A view's columns carry no NOT NULL; the table's column of the same name and
        // type says it.
        let not_null = c.not_null
            || table_info
                .column(&c.name)
                .is_some_and(|t| t.not_null && t.type_oid == c.type_oid);
        columns.push(CatalogColumn {
            name: c.name.clone(),
            pg_type: c.display.clone(),
            affinity: mapping.affinity(),
            mapping,
            not_null: not_null || key_part > 0,
            key_part: u8::try_from(key_part).expect("a primary key has at most 32 columns"),
            ordinal: c.ordinal,
            select_expr: mapping.expr(&crate::rules::quote_ident(&c.name)),
        });
    }
    Ok(columns)
}

fn missing_column(relation: &Relation, column: &str, here: &str, role: &str) -> CheckError {
    CheckError::Mismatch(format!(
        "column {relation}.{column}, named by `{role}` of {here}, does not exist; fix the rules file or add the column"
    ))
}

/// Step 5: each table's foreign keys into mirrored tables whose columns are mirrored on
/// both sides; `follows` must be one of them. A foreign key of an entry for one audience
/// points at the parent's entry for that audience, else at its entry for every audience
/// ([`parent_entry`]); an entry for every audience cannot point at a table mirrored only
/// per audience (which of its shapes would the rows point at?).
async fn link_parents(
    rules: &Rules,
    tables: &mut [CatalogTable],
    loader: &mut Loader<'_>,
) -> Result<(), CheckError> {
    let mirrored: Vec<(Relation, Option<String>, BTreeSet<String>)> = tables
        .iter()
        .map(|t| {
            let names = t.columns.iter().map(|c| c.name.clone()).collect();
            (t.relation.clone(), t.audience.clone(), names)
        })
        .collect();
    let entries = mirrored.iter().map(|m| (&m.0, m.1.as_deref()));
    for (table, rule) in tables.iter_mut().zip(&rules.tables) {
        debug_assert_eq!(table.entry(), rule.entry());
        let fks = loader.foreign_keys(&table.relation).await?;
        let own =
            &mirrored[parent_entry(entries.clone(), &table.relation, table.audience.as_deref())
                .expect("its own entry")]
            .2;
        let mut parents = Vec::new();
        for fk in &fks {
            let Some(p) = parent_entry(entries.clone(), &fk.parent, table.audience.as_deref())
            else {
                if table.audience.is_none() && rules.mirrors(&fk.parent) {
                    return Err(CheckError::Mismatch(format!(
                        "{} goes to every audience and its foreign key {} points at {}, which is mirrored only per audience; give {} an entry per audience too, or {} one without an audience",
                        place(rules, rule),
                        fk.name,
                        fk.parent,
                        place(rules, rule),
                        fk.parent
                    )));
                }
                continue;
            };
            let parent = &mirrored[p].2;
            if fk.columns.iter().all(|c| own.contains(c))
                && fk.parent_columns.iter().all(|c| parent.contains(c))
            {
                parents.push(fk.clone());
            }
        }
        table.parents = parents;
        if let Route::Follows { columns } = &rule.route {
            check_follows(rules, rule, columns, &fks, &table.parents)?;
        }
    }
    Ok(())
}

fn check_follows(
    rules: &Rules,
    rule: &Table,
    columns: &[String],
    fks: &[ForeignKey],
    parents: &[ForeignKey],
) -> Result<(), CheckError> {
    let here = place(rules, rule);
    let wanted: BTreeSet<&String> = columns.iter().collect();
    let same = |fk: &&ForeignKey| fk.columns.iter().collect::<BTreeSet<_>>() == wanted;
    if parents.iter().any(|fk| same(&fk)) {
        return Ok(());
    }
    let list = columns.join(", ");
    Err(CheckError::Mismatch(match fks.iter().find(same) {
        None => format!(
            "`follows` of {here} names ({list}), which is not a foreign key of {}; follows needs a foreign key into a mirrored table: add it, or fix the rules file",
            rule.relation
        ),
        Some(fk) if !rules.mirrors(&fk.parent) => format!(
            "`follows` of {here} names ({list}), a foreign key into {}, which the rules do not mirror; add [tables.{}] to the rules",
            fk.parent, fk.parent.name
        ),
        Some(fk)
            if !rules
                .entries(&fk.parent)
                .any(|p| p.reaches(rule.audience.as_deref())) =>
        {
            format!(
                "`follows` of {here} names ({list}), a foreign key into {}, which is not mirrored for this entry's audience; give {} an entry for it",
                fk.parent, fk.parent
            )
        }
        Some(fk) => format!(
            "`follows` of {here} names ({list}), a foreign key into {}, but its columns are not mirrored on both sides; add them to `columns` of both tables",
            fk.parent
        ),
    }))
}

/// Orders tables parents first (Kahn), refusing a cycle.
fn parents_first(tables: Vec<CatalogTable>) -> Result<Vec<CatalogTable>, CheckError> {
    // Each entry's parents, as indexes into `tables`.
    let parents: Vec<Vec<usize>> = tables
        .iter()
        .map(|t| {
            t.parents
                .iter()
                .filter_map(|fk| {
                    parent_entry(entries_of(&tables), &fk.parent, t.audience.as_deref())
                })
                .collect()
        })
        .collect();
    let mut left: BTreeSet<usize> = (0..tables.len()).collect();
    let mut order = Vec::new();
    while !left.is_empty() {
        let ready: Vec<usize> = left
            .iter()
            .copied()
            .filter(|i| parents[*i].iter().all(|p| !left.contains(p)))
            .collect();
        if ready.is_empty() {
            return Err(CheckError::Cycle {
                cycle: find_cycle(&tables, &parents, &left),
            });
        }
        for i in ready {
            left.remove(&i);
            order.push(i);
        }
    }
    let mut slots: Vec<Option<CatalogTable>> = tables.into_iter().map(Some).collect();
    Ok(order
        .into_iter()
        .map(|i| slots[i].take().expect("each entry is ordered once"))
        .collect())
}

/// A cycle among `left` (every entry there has a parent there): follow parents until an
/// entry repeats.
fn find_cycle(
    tables: &[CatalogTable],
    parents: &[Vec<usize>],
    left: &BTreeSet<usize>,
) -> Vec<String> {
    let mut path: Vec<usize> = vec![*left.iter().next().expect("a cycle has tables")];
    loop {
        let here = *path.last().expect("path starts with one");
        let next = *parents[here]
            .iter()
            .find(|p| left.contains(*p))
            .expect("every table left has a parent left");
        if let Some(i) = path.iter().position(|r| *r == next) {
            let mut cycle: Vec<String> = path[i..].iter().map(|r| tables[*r].entry()).collect();
            cycle.push(tables[next].entry());
            return cycle;
        }
        path.push(next);
    }
}

fn pg_column(r: &sqlx::postgres::PgRow) -> Result<PgColumn, sqlx::Error> {
    let element_name: Option<String> = r.try_get(7)?;
    let element_kind: Option<String> = r.try_get(8)?;
    Ok(PgColumn {
        name: r.try_get(0)?,
        ordinal: r.try_get(1)?,
        not_null: r.try_get(2)?,
        display: r.try_get(3)?,
        type_oid: r.try_get(4)?,
        type_name: r.try_get(5)?,
        type_kind: r.try_get(6)?,
        element: element_name.zip(element_kind),
    })
}

/// Columns of `$1` (a quoted relation name): name, attnum, not null, the type as written,
/// then the base type (a domain resolved) and, for an array, its element type.
const COLUMNS_SQL: &str = "
SELECT a.attname::text, a.attnum, a.attnotnull, format_type(a.atttypid, a.atttypmod),
       b.oid::int8, b.typname::text, b.typtype::text, e.typname::text, e.typtype::text
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
JOIN pg_type b ON b.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END
LEFT JOIN pg_type e ON e.oid = b.typelem AND b.typcategory = 'A'
WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum";

const PRIMARY_KEY_SQL: &str = "
SELECT ARRAY(SELECT a.attname::text
             FROM unnest(con.conkey) WITH ORDINALITY k(n, i)
             JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n
             ORDER BY k.i)
FROM pg_constraint con
WHERE con.conrelid = to_regclass($1) AND con.contype = 'p'";

/// Foreign keys of `$1` declared on it (not the copies Postgres keeps on partitions).
const FOREIGN_KEYS_SQL: &str = "
SELECT con.conname::text, pn.nspname::text, pc.relname::text,
       ARRAY(SELECT a.attname::text
             FROM unnest(con.conkey) WITH ORDINALITY k(n, i)
             JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n
             ORDER BY k.i),
       ARRAY(SELECT a.attname::text
             FROM unnest(con.confkey) WITH ORDINALITY k(n, i)
             JOIN pg_attribute a ON a.attrelid = con.confrelid AND a.attnum = k.n
             ORDER BY k.i)
FROM pg_constraint con
JOIN pg_class pc ON pc.oid = con.confrelid
JOIN pg_namespace pn ON pn.oid = pc.relnamespace
WHERE con.conrelid = to_regclass($1) AND con.contype = 'f' AND con.conparentid = 0
ORDER BY con.conname";

/// Key columns of the plain indexes of `$1`, other than ferry-sync's own.
const INDEXES_SQL: &str = "
SELECT ARRAY(SELECT a.attname::text
             FROM unnest(x.indkey::int2[]) WITH ORDINALITY k(n, i)
             JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.n
             WHERE k.i <= x.indnkeyatts
             ORDER BY k.i)
FROM pg_index x
JOIN pg_class ic ON ic.oid = x.indexrelid
WHERE x.indrelid = to_regclass($1) AND x.indexprs IS NULL AND x.indpred IS NULL
  AND ic.relname NOT LIKE 'ferry\\_sync\\_%'
ORDER BY ic.relname";

/// The tables a view reads, through the views it reads.
const VIEW_READS_SQL: &str = "
WITH RECURSIVE deps(oid) AS (
    SELECT to_regclass($1)::oid
    UNION
    SELECT d.refobjid
    FROM deps
    JOIN pg_rewrite r ON r.ev_class = deps.oid
    JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
                    AND d.refclassid = 'pg_class'::regclass AND d.refobjid <> deps.oid
)
SELECT n.nspname::text, c.relname::text
FROM deps
JOIN pg_class c ON c.oid = deps.oid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p')
ORDER BY 1, 2";
