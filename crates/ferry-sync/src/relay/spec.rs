//! What the relay needs to know about the tables it plans: built once at start from the
//! rules and Postgres's catalog (`Spec::build`), then read-only. Every SQL fragment here
//! is an identifier the catalog confirmed, quoted, or an expression over the alias `t`.

use crate::value::Affinity;

/// The replicas relation: which rows are replicas now, and their partition.
#[derive(Clone, Debug)]
pub struct ReplicaSetSpec {
    /// Quoted relation, e.g. `"public"."stores"`.
    pub relation: String,
    /// The relation's name as notes carry it (`public.stores`).
    pub noted_as: String,
    /// Quoted uuid column naming each replica.
    pub id: String,
    /// An SQL condition over the relation's columns, or none (every row is live).
    pub live: Option<String>,
    /// Quoted partition column, if replicas are partitioned.
    pub partition: Option<String>,
    /// Quoted audience column, if the rules name audiences.
    pub audience: Option<String>,
}

/// One column as the relay reads it and the replica declares it.
#[derive(Clone, Debug)]
pub struct ColumnSpec {
    pub name: String,
    pub affinity: Affinity,
    pub not_null: bool,
    /// 0, or the column's place in the key (1-based).
    pub key_part: u8,
    /// The expression that reads it from alias `t`, in canonical form (docs/sync.md §3.1).
    pub select: String,
}

/// One part of a primary key (or of a foreign key's referencing columns).
#[derive(Clone, Debug)]
pub struct KeyColumn {
    /// Quoted column name.
    pub column: String,
    /// The Postgres type to cast key text to when looking rows up (`uuid`, `int8`, `text`).
    pub pg_type: String,
}

/// A foreign key from this table into another mirrored table.
#[derive(Clone, Debug)]
pub struct ParentSpec {
    /// Index of the parent in `Spec::tables` (always lower: tables are parents first).
    pub table: usize,
    /// Quoted referencing columns, in the order of the parent's key parts.
    pub columns: Vec<String>,
}

/// How a table's rows find their replicas.
#[derive(Clone, Debug)]
pub enum RouteSpec {
    /// Every replica of the row's partition (quoted column), or every replica.
    Broadcast { partition: Option<String> },
    /// The replica a uuid column (quoted) names.
    Assigned { column: String },
    /// Wherever the parent `parents[parent]` goes by its own rule.
    Follows { parent: usize },
    /// Every replica a group holding the row is assigned to: `members` (quoted) links
    /// rows (`row`) to groups (`group`); `assigned` links groups (the same column name)
    /// to replicas (`replica`). The table's key has one part.
    Grouped {
        members: String,
        row: String,
        group: String,
        assigned: String,
        replica: String,
    },
    /// Every replica the view (quoted) pairs the row with: `row` are the view's columns
    /// for the key's parts, in key order; `replica` its uuid column.
    Routed {
        view: String,
        row: Vec<String>,
        replica: String,
    },
    /// Only with rows that point at it.
    Closure,
}

/// One mirrored table: one entry of the rules (docs/sync-scale.md §1).
#[derive(Clone, Debug)]
pub struct TableSpec {
    /// The name the server's held state keeps the entry under: `public.products`, or
    /// `public.products@till` for an audience's entry.
    pub relation: String,
    /// The name notes carry: the Postgres table (`public.products`).
    pub noted_as: String,
    /// The audience whose replicas hold it; `None`: every replica.
    pub audience: Option<String>,
    /// Quoted relation rows are read from: the `from` view, or the table.
    pub source: String,
    /// Quoted `active` view, if any: rows it hides are not sent for their own sake.
    pub active: Option<String>,
    /// The replica-side table name.
    pub name: String,
    /// In the order the replica declares them.
    pub columns: Vec<ColumnSpec>,
    pub key: Vec<KeyColumn>,
    pub route: RouteSpec,
    pub parents: Vec<ParentSpec>,
}

impl TableSpec {
    /// Whether a replica of `audience` holds this table.
    pub fn reaches(&self, audience: Option<&str>) -> bool {
        crate::rules::reaches(self.audience.as_deref(), audience)
    }

    pub fn is_broadcast(&self) -> bool {
        matches!(self.route, RouteSpec::Broadcast { .. })
    }

    /// The columns as the wire carries them.
    pub fn wire_columns(&self) -> Vec<crate::wire::Column> {
        self.columns
            .iter()
            .map(|c| crate::wire::Column {
                name: c.name.clone(),
                affinity: c.affinity,
                not_null: c.not_null,
                key_part: c.key_part,
            })
            .collect()
    }

    /// Index of each key part within `columns`, in key order.
    pub fn key_columns(&self) -> Vec<usize> {
        let mut parts: Vec<(u8, usize)> = self
            .columns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.key_part > 0)
            .map(|(i, c)| (c.key_part, i))
            .collect();
        parts.sort();
        parts.into_iter().map(|(_, i)| i).collect()
    }
}

/// Everything the relay plans with. `tables` is in dependency order: every table comes
/// after the tables it points at, so planning in order sees parents placed first.
#[derive(Clone, Debug)]
pub struct Spec {
    pub replicas: ReplicaSetSpec,
    pub tables: Vec<TableSpec>,
    /// The tables the replicas write, which serve files (docs/sync-up.md §5) and every
    /// snapshot announces (§4.1).
    pub records: Vec<crate::file::RecordSpec>,
    /// The digest of the rules this was built from ([`crate::rules::Rules::digest`]).
    pub digest: String,
    /// Relay shards (docs/sync-scale.md §2).
    pub shards: u32,
}

impl Spec {
    /// The table whose held state is kept as `relation` ([`TableSpec::relation`]).
    pub fn table(&self, relation: &str) -> Option<usize> {
        self.tables.iter().position(|t| t.relation == relation)
    }

    /// The tables a note on `noted` is planned for: every entry of a Postgres table
    /// (`public.products`), or the one entry a note names (`public.products@till`, which
    /// install notes for an entry new to a mirrored table).
    pub fn noted(&self, noted: &str) -> impl Iterator<Item = usize> + '_ {
        let noted = noted.to_string();
        (0..self.tables.len()).filter(move |t| {
            let table = &self.tables[*t];
            table.noted_as == noted || table.relation == noted
        })
    }

    /// The table a replica of `audience` knows as `name`.
    pub fn named(&self, name: &str, audience: Option<&str>) -> Option<usize> {
        self.tables
            .iter()
            .position(|t| t.name == name && t.reaches(audience))
    }

    /// Tables that follow table `parent` (index into `tables`), with the parent slot.
    pub fn followers(&self, parent: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (i, t) in self.tables.iter().enumerate() {
            if let RouteSpec::Follows { parent: slot } = t.route
                && t.parents[slot].table == parent
            {
                out.push((i, slot));
            }
        }
        out
    }

    /// Every (child table, parent slot) whose foreign key points at table `parent`.
    pub fn children(&self, parent: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (i, t) in self.tables.iter().enumerate() {
            for (slot, p) in t.parents.iter().enumerate() {
                if p.table == parent {
                    out.push((i, slot));
                }
            }
        }
        out
    }
}

/// Escapes one key part for the canonical key text (docs/sync.md §3.2).
pub fn escape_part(part: &str, out: &mut String) {
    for c in part.chars() {
        if c == '\\' || c == '|' {
            out.push('\\');
        }
        out.push(c);
    }
}

/// The canonical key text of parts given as their Postgres text forms.
pub fn key_text<S: AsRef<str>>(parts: &[S]) -> String {
    let mut out = String::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        escape_part(p.as_ref(), &mut out);
    }
    out
}

/// Splits a canonical key text into its parts' text forms; `None` if it does not have
/// `n` parts or ends in a lone escape.
pub fn split_key_text(text: &str, n: usize) -> Option<Vec<String>> {
    let mut parts = vec![String::new()];
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => parts.last_mut()?.push(chars.next()?),
            '|' => parts.push(String::new()),
            c => parts.last_mut()?.push(c),
        }
    }
    (parts.len() == n).then_some(parts)
}

impl Spec {
    /// The relay's view of `rules` over what Postgres said about them. Refuses what the
    /// relay cannot plan yet, naming the table.
    pub fn build(
        rules: &crate::rules::Rules,
        catalog: &crate::catalog::Catalog,
    ) -> Result<Spec, String> {
        use crate::catalog::KeyKind;
        use crate::rules::{Route, quote_ident};
        let r = &rules.replicas;
        let replicas = ReplicaSetSpec {
            relation: r.relation.quoted(),
            noted_as: r.relation.to_string(),
            id: quote_ident(&r.id),
            live: r.live.clone(),
            partition: r.partition.as_deref().map(quote_ident),
            audience: r.audience.as_deref().map(quote_ident),
        };
        let position = |relation: &crate::rules::Relation, audience: Option<&str>| {
            let entries = crate::catalog::entries_of(&catalog.tables);
            crate::catalog::parent_entry(entries, relation, audience)
        };
        let mut tables = Vec::with_capacity(catalog.tables.len());
        for ct in &catalog.tables {
            let rt = rules.entry(&ct.entry()).ok_or_else(|| {
                format!(
                    "table {} is in the catalog but not in the rules",
                    ct.relation
                )
            })?;
            let key = ct
                .key_parts()
                .map(|(kind, column)| KeyColumn {
                    column: quote_ident(column),
                    pg_type: match kind {
                        KeyKind::Int => "int8",
                        KeyKind::Uuid => "uuid",
                        KeyKind::Text => "text",
                    }
                    .to_string(),
                })
                .collect();
            let mut parents = Vec::new();
            let mut follows_slot = None;
            for fk in &ct.parents {
                let Some(p) = position(&fk.parent, ct.audience.as_deref()) else {
                    continue;
                };
                let parent = &catalog.tables[p];
                // Order the referencing columns by the parent's key parts; a foreign key
                // into other columns than the parent's key names no row and is skipped.
                let mut columns = Vec::with_capacity(parent.key.len());
                for k in &parent.key {
                    match fk.parent_columns.iter().position(|c| c == k) {
                        Some(i) => columns.push(quote_ident(&fk.columns[i])),
                        None => break,
                    }
                }
                if columns.len() != parent.key.len() || fk.columns.len() != parent.key.len() {
                    continue;
                }
                if let Route::Follows { columns: follow } = &rt.route
                    && follow.iter().collect::<std::collections::BTreeSet<_>>()
                        == fk.columns.iter().collect::<std::collections::BTreeSet<_>>()
                {
                    follows_slot = Some(parents.len());
                }
                parents.push(ParentSpec { table: p, columns });
            }
            let route = match &rt.route {
                Route::Broadcast { partition } => RouteSpec::Broadcast { partition: partition.as_deref().map(quote_ident) },
                Route::Assigned { column } => RouteSpec::Assigned { column: quote_ident(column) },
                Route::Follows { columns } => RouteSpec::Follows {
                    parent: follows_slot.ok_or_else(|| {
                        format!("table {}: `follows = {columns:?}` is not a foreign key into the key of a mirrored table", ct.relation)
                    })?,
                },
                Route::Closure => RouteSpec::Closure,
                Route::Grouped(g) => {
                    if ct.key.len() != 1 {
                        return Err(format!(
                            "table {}: a grouped table needs a key of one column (its members table names rows by it)",
                            ct.relation
                        ));
                    }
                    RouteSpec::Grouped {
                        members: g.members.quoted(),
                        row: quote_ident(&g.row),
                        group: quote_ident(&g.group),
                        assigned: g.assigned.quoted(),
                        replica: quote_ident(&g.replica),
                    }
                }
                Route::Routed(v) => RouteSpec::Routed {
                    view: v.view.quoted(),
                    row: v.row.iter().map(|c| quote_ident(c)).collect(),
                    replica: quote_ident(&v.replica),
                },
            };
            let columns = ct
                .columns
                .iter()
                .map(|c| ColumnSpec {
                    name: c.name.clone(),
                    affinity: c.affinity,
                    not_null: c.not_null,
                    key_part: c.key_part,
                    select: c.select_expr.clone(),
                })
                .collect();
            tables.push(TableSpec {
                relation: ct.entry(),
                noted_as: ct.relation.to_string(),
                audience: ct.audience.clone(),
                source: rt.from.as_ref().unwrap_or(&ct.relation).quoted(),
                active: rt.active.as_ref().map(|a| a.quoted()),
                name: rt.replica_name.clone(),
                columns,
                key,
                route,
                parents,
            });
        }
        for t in &tables {
            if t.is_broadcast() {
                for p in &t.parents {
                    if !tables[p.table].is_broadcast() {
                        return Err(format!(
                            "table {} is broadcast and points at {}, which is not: make {} broadcast too (every replica of the partition would hold the rows it points at anyway)",
                            t.relation, tables[p.table].relation, tables[p.table].relation
                        ));
                    }
                }
            }
        }
        let mut records: Vec<crate::file::RecordSpec> = rules
            .records
            .iter()
            .zip(&catalog.records)
            .map(|(r, ct)| record_spec(r, ct))
            .collect();
        for (table, ct) in tables.iter().zip(&catalog.tables) {
            let rt = rules.entry(&ct.entry()).expect("checked above");
            if let Some(two_way) = &rt.two_way {
                records.push(two_way_spec(table, ct, &two_way.lane));
            }
        }
        Ok(Spec {
            replicas,
            tables,
            records,
            digest: rules.digest(),
            shards: rules.shards,
        })
    }
}

fn file_column(c: &crate::catalog::CatalogColumn) -> crate::file::FileColumn {
    crate::file::FileColumn {
        name: c.name.clone(),
        pg_type: c.pg_type.clone(),
        mapping: c.mapping,
        not_null: c.not_null,
        key_part: c.key_part,
    }
}

/// How serve files a two-way table's uploads (docs/sync-up.md §5.1): its key and the
/// replica's columns, into rows the server records the sender holding.
fn two_way_spec(
    table: &TableSpec,
    catalog: &crate::catalog::CatalogTable,
    lane: &str,
) -> crate::file::RecordSpec {
    let key_columns = catalog.columns.iter().filter(|c| c.key_part > 0);
    let mut key_sorted: Vec<_> = key_columns.collect();
    key_sorted.sort_by_key(|c| c.key_part);
    let columns: Vec<crate::file::FileColumn> = key_sorted
        .iter()
        .map(|c| file_column(c))
        .chain(catalog.owned.iter().map(file_column))
        .collect();
    crate::file::RecordSpec {
        relation: table.relation.clone(),
        quoted: catalog.relation.quoted(),
        name: table.name.clone(),
        key: (0..key_sorted.len()).collect(),
        replica: None,
        version: None,
        lane: lane.to_string(),
        columns,
        two_way: Some(crate::file::TwoWaySpec {
            down: table.wire_columns(),
            audience: table.audience.clone(),
        }),
        restate: table.name == crate::rules::WISHES_TABLE,
    }
}

fn record_spec(
    rules: &crate::rules::RecordTable,
    catalog: &crate::catalog::CatalogTable,
) -> crate::file::RecordSpec {
    let columns: Vec<crate::file::FileColumn> = catalog.columns.iter().map(file_column).collect();
    let at = |name: &Option<String>| {
        name.as_ref()
            .and_then(|n| columns.iter().position(|c| &c.name == n))
    };
    crate::file::RecordSpec {
        relation: rules.relation.to_string(),
        quoted: rules.relation.quoted(),
        name: rules.replica_name.clone(),
        key: catalog
            .key
            .iter()
            .map(|k| {
                columns
                    .iter()
                    .position(|c| &c.name == k)
                    .expect("the catalog keeps every key column")
            })
            .collect(),
        replica: at(&rules.replica),
        version: at(&rules.version),
        lane: rules.lane.clone(),
        columns,
        two_way: None,
        restate: rules.is_setting(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_text_round_trips_escapes() {
        let parts = ["a|b", "c\\d", "", "42"];
        let text = key_text(&parts);
        assert_eq!(text, "a\\|b|c\\\\d||42");
        assert_eq!(split_key_text(&text, 4).unwrap(), parts);
        assert_eq!(split_key_text(&text, 3), None);
        assert_eq!(split_key_text("x\\", 1), None);
    }
}
