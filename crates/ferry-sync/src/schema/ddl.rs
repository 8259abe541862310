//! The statements the rules call for, derived from the rules and the catalog. Pure: the
//! same rules and catalog give the same statements, byte for byte, which is how `check`
//! tells an installed function from a different one (`pg_proc.prosrc` against the body).
//!
//! Every trigger notes *what* changed, never who receives it (the relay decides):
//! - a mirrored table: `ferry_sync_note` (after each row's insert, update or delete)
//!   notes the row's key; an update that changes no watched column notes nothing, a key
//!   change notes the old key first. Watched: the mirrored columns (compared as the
//!   relay reads them, so a change a replica would see is a change), the route's own
//!   columns, and every column when `from` or `active` is set (a view may read any).
//! - `ferry_sync_refuse_truncate` (before truncate): TRUNCATE fires no row trigger, so it
//!   would change rows unnoted; it is refused on every table ferry-sync reads changes of.
//! - a grouped table's members table notes (kind `row`) the member rows that joined or
//!   left a group; its assigned table notes (kind `group`) the groups given or taken.
//! - a routed view's tables note (kind `routed`) once per statement that touched them.
//! - the replicas relation notes (kind `replica`) a replica's id when its row changes.

use crate::catalog::{Catalog, CatalogGroup, CatalogRoute, CatalogTable, KeyKind, mapping};
use crate::rules::{Relation, Rules, Table, quote_ident, quote_literal};
use sha2::{Digest as _, Sha256};
use std::collections::{BTreeMap, BTreeSet};

/// The server schema, version 1 (fixed once released; a later version upgrades it).
pub const SERVER_V1: &str = include_str!("../../sql/server-1.sql");

/// The schema version this build installs and reads.
pub const VERSION: i32 = 1;

/// `pg_trigger.tgtype` bits (Postgres's `trigger.h`).
const TG_ROW: i16 = 1;
const TG_BEFORE: i16 = 2;
const TG_INSERT: i16 = 4;
const TG_DELETE: i16 = 8;
const TG_UPDATE: i16 = 16;
const TG_TRUNCATE: i16 = 32;

/// One statement of the DDL: what it installs, its SQL, and the object it makes (which
/// `check` compares with the database).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Statement {
    pub what: String,
    pub sql: String,
    pub object: Object,
}

/// What a statement makes, as `check` finds it in the catalog.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Object {
    /// Schema `ferry_sync` (with its `meta` row, which `install` adds).
    Schema,
    /// `ferry_sync.<name>()`, a trigger function whose `prosrc` is `body`.
    Function { name: String, body: String },
    /// Trigger `name` on `table`, calling `ferry_sync.<function>(args)`.
    Trigger {
        table: Relation,
        name: String,
        function: String,
        args: Vec<String>,
        tgtype: i16,
        /// This is a mirrored table's note trigger: a table mirrored for the first time
        /// (the trigger missing) is sent whole.
        notes_table: bool,
    },
    /// Index `name` (in the table's schema) on `table (columns)`.
    Index {
        table: Relation,
        name: String,
        columns: Vec<String>,
    },
    /// `ferry_sync.meta.declared` holds the rules' digest.
    Declared { digest: String },
}

/// The statements for `rules`, in install order: the schema, the functions each before
/// its triggers, the indexes, the digest.
pub fn ddl(rules: &Rules, catalog: &Catalog) -> Vec<Statement> {
    let names = Names::new(catalog);
    let mut out = vec![schema_statement(), refuse_truncate_function()];
    let mut truncate_guarded = BTreeSet::new();
    // One capture trigger per Postgres table, whatever the number of its entries: notes
    // name the table, and the relay plans each note for every entry of it.
    for (relation, entries) in catalog.relations() {
        let rules_entries: Vec<&Table> = entries
            .iter()
            .map(|t| {
                rules
                    .entry(&t.entry())
                    .expect("the catalog holds the rules' tables")
            })
            .collect();
        let function = names.function("note_", relation);
        out.push(function_statement(
            &function,
            &format!("the capture function of {relation}"),
            &table_note_body(&rules_entries, &entries),
        ));
        out.push(row_trigger(relation, "ferry_sync_note", &function, true));
        out.extend(refuse_truncate(relation, "mirrors", &mut truncate_guarded));
    }
    for g in &catalog.groups {
        out.extend(group_statements(g, &names, &mut truncate_guarded));
    }
    for r in &catalog.routes {
        out.extend(route_statements(r, &names));
    }
    out.extend(replica_statements(catalog, &mut truncate_guarded));
    if rules.shards > 1 {
        out.extend(fan_out_statements(rules.shards));
    }
    out.extend(indexes(rules, catalog));
    let digest = rules.digest();
    out.push(Statement {
        what: "the rules' digest in ferry_sync.meta.declared".into(),
        sql: format!(
            "UPDATE ferry_sync.meta SET declared = {}, shards = {};\n{}",
            quote_literal(&digest),
            rules.shards,
            settings_sql(rules, catalog)
        ),
        object: Object::Declared { digest },
    });
    out
}

/// Rewrites `ferry_sync.settings`, which `ferry_sync.wish` checks wishes against
/// (docs/sync-up.md §7). It changes only with the rules, so it goes with their digest.
fn settings_sql(rules: &Rules, catalog: &Catalog) -> String {
    let mut sql = String::from("DELETE FROM ferry_sync.settings;");
    for (r, t) in rules.records.iter().zip(&catalog.records) {
        let (Some(version), true) = (&r.version, r.is_setting()) else {
            continue;
        };
        let desired: Vec<String> = r.desired.iter().map(|d| quote_literal(d)).collect();
        sql.push_str(&format!(
            "\nINSERT INTO ferry_sync.settings (setting, relation, version, desired, key_parts) VALUES ({}, {}, {}, ARRAY[{}]::text[], {});",
            quote_literal(&r.replica_name),
            quote_literal(&r.relation.to_string()),
            quote_literal(version),
            desired.join(", "),
            t.key.len()
        ));
    }
    sql
}

fn schema_statement() -> Statement {
    Statement {
        what: format!("the ferry_sync schema, version {VERSION}"),
        sql: format!(
            "{}\n-- then: INSERT INTO ferry_sync.meta (version, epoch, secret) VALUES ({VERSION}, <a random uuid>, <32 random bytes>);",
            SERVER_V1.trim_end()
        ),
        object: Object::Schema,
    }
}

fn refuse_truncate_function() -> Statement {
    let body = "
BEGIN
    RAISE EXCEPTION 'TRUNCATE of %.% is refused: ferry-sync % it (delete the rows instead, or remove the table from the rules and run `ferry sync install`)',
        TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_ARGV[0]
        USING ERRCODE = '55000';
END
";
    function_statement("refuse_truncate", "the function refusing TRUNCATE", body)
}

fn function_statement(name: &str, what: &str, body: &str) -> Statement {
    Statement {
        what: what.to_string(),
        sql: format!(
            "CREATE OR REPLACE FUNCTION ferry_sync.{}() RETURNS trigger LANGUAGE plpgsql AS $ferry${body}$ferry$;",
            quote_ident(name)
        ),
        object: Object::Function {
            name: name.to_string(),
            body: body.to_string(),
        },
    }
}

/// `AFTER INSERT OR UPDATE OR DELETE … FOR EACH ROW`.
fn row_trigger(table: &Relation, name: &str, function: &str, notes_table: bool) -> Statement {
    trigger(
        table,
        name,
        function,
        &[],
        TG_ROW | TG_INSERT | TG_UPDATE | TG_DELETE,
        notes_table,
        format!("the trigger {name} on {table}"),
    )
}

/// `BEFORE TRUNCATE … FOR EACH STATEMENT` refusing it, once per table.
fn refuse_truncate(
    table: &Relation,
    why: &str,
    guarded: &mut BTreeSet<Relation>,
) -> Option<Statement> {
    if !guarded.insert(table.clone()) {
        return None;
    }
    Some(trigger(
        table,
        "ferry_sync_refuse_truncate",
        "refuse_truncate",
        &[why.to_string()],
        TG_BEFORE | TG_TRUNCATE,
        false,
        format!("the trigger refusing TRUNCATE of {table}"),
    ))
}

fn trigger(
    table: &Relation,
    name: &str,
    function: &str,
    args: &[String],
    tgtype: i16,
    notes_table: bool,
    what: String,
) -> Statement {
    let timing = if tgtype & TG_BEFORE != 0 {
        "BEFORE"
    } else {
        "AFTER"
    };
    let events: Vec<&str> = [
        (TG_INSERT, "INSERT"),
        (TG_UPDATE, "UPDATE"),
        (TG_DELETE, "DELETE"),
        (TG_TRUNCATE, "TRUNCATE"),
    ]
    .iter()
    .filter(|(bit, _)| tgtype & bit != 0)
    .map(|(_, e)| *e)
    .collect();
    let each = if tgtype & TG_ROW != 0 {
        "ROW"
    } else {
        "STATEMENT"
    };
    let args_sql: Vec<String> = args.iter().map(|a| quote_literal(a)).collect();
    let sql = format!(
        "DROP TRIGGER IF EXISTS {n} ON {t};\nCREATE TRIGGER {n} {timing} {} ON {t} FOR EACH {each} EXECUTE FUNCTION ferry_sync.{}({});",
        events.join(" OR "),
        quote_ident(function),
        args_sql.join(", "),
        n = quote_ident(name),
        t = table.quoted(),
    );
    Statement {
        what,
        sql,
        object: Object::Trigger {
            table: table.clone(),
            name: name.to_string(),
            function: function.to_string(),
            args: args.to_vec(),
            tgtype,
            notes_table,
        },
    }
}

/// The body of a mirrored table's capture function, for all its entries: it notes a
/// change of any column some entry mirrors or routes by.
fn table_note_body(rules: &[&Table], entries: &[&CatalogTable]) -> String {
    let t = entries[0];
    let watch = |row: &str| -> String {
        if rules.iter().any(|r| r.from.is_some() || r.active.is_some()) {
            return format!("{row}::text");
        }
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        let mut exprs: Vec<String> = Vec::new();
        for c in entries.iter().flat_map(|e| &e.columns) {
            if seen.insert(&c.name) {
                exprs.push(c.mapping.expr(&format!("{row}.{}", quote_ident(&c.name))));
            }
        }
        for col in rules.iter().flat_map(|r| r.route_columns()) {
            if seen.insert(col) {
                exprs.push(format!("{row}.{}::text", quote_ident(col)));
            }
        }
        format!("ROW({})", exprs.join(", "))
    };
    let key_row = |row: &str| -> String {
        let cols: Vec<String> = t
            .key
            .iter()
            .map(|k| format!("{row}.{}", quote_ident(k)))
            .collect();
        format!("ROW({})", cols.join(", "))
    };
    let key_text = |row: &str| -> String {
        let parts: Vec<(KeyKind, String)> = t
            .key_parts()
            .map(|(kind, k)| (kind, format!("{row}.{}", quote_ident(k))))
            .collect();
        mapping::key_text_expr(&parts)
    };
    let relation = quote_literal(&t.relation.to_string());
    format!(
        "
BEGIN
    IF TG_OP = 'UPDATE' AND {old_watch} IS NOT DISTINCT FROM {new_watch} THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND {old_key} IS DISTINCT FROM {new_key}) THEN
        INSERT INTO ferry_sync.notes (relation, key) VALUES ({relation}, {old_text});
    END IF;
    IF TG_OP <> 'DELETE' THEN
        INSERT INTO ferry_sync.notes (relation, key) VALUES ({relation}, {new_text});
    END IF;
    -- Wakes the relay at commit (Postgres sends one notification per transaction for
    -- repeated identical ones), so a change waits for a pass, not for the relay's poll.
    PERFORM pg_notify('ferry_sync', '');
    RETURN NULL;
END
",
        old_watch = watch("OLD"),
        new_watch = watch("NEW"),
        old_key = key_row("OLD"),
        new_key = key_row("NEW"),
        old_text = key_text("OLD"),
        new_text = key_text("NEW"),
    )
}

/// A function noting, for each row of a group table that appears, disappears or
/// changes `compared`, the key text of its `noted` column as a note of `kind` on
/// `relation` (a null noted value is nothing to note).
fn link_note_body(
    relation: &Relation,
    kind: &str,
    compared: &[&str],
    noted: &str,
    noted_kind: KeyKind,
) -> String {
    let row = |r: &str| -> String {
        let cols: Vec<String> = compared
            .iter()
            .map(|c| format!("{r}.{}", quote_ident(c)))
            .collect();
        format!("ROW({})", cols.join(", "))
    };
    let value = |r: &str| format!("{r}.{}", quote_ident(noted));
    let insert = |r: &str| {
        format!(
            "INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ({}, {}, {});",
            quote_literal(&relation.to_string()),
            noted_kind.text_expr(&value(r)),
            quote_literal(kind)
        )
    };
    format!(
        "
BEGIN
    IF TG_OP = 'UPDATE' AND {old_row} IS NOT DISTINCT FROM {new_row} THEN
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' AND {old_value} IS NOT NULL THEN
        {old_insert}
    END IF;
    IF TG_OP <> 'DELETE' AND {new_value} IS NOT NULL THEN
        {new_insert}
    END IF;
    RETURN NULL;
END
",
        old_row = row("OLD"),
        new_row = row("NEW"),
        old_value = value("OLD"),
        new_value = value("NEW"),
        old_insert = insert("OLD"),
        new_insert = insert("NEW"),
    )
}

fn group_statements(
    g: &CatalogGroup,
    names: &Names,
    guarded: &mut BTreeSet<Relation>,
) -> Vec<Statement> {
    let a = g.audience.as_deref();
    let members_fn = names.of_entry("members_", &g.table, a);
    let groups_fn = names.of_entry("groups_", &g.table, a);
    let members_trigger = names.of_entry("ferry_sync_members_", &g.table, a);
    let groups_trigger = names.of_entry("ferry_sync_groups_", &g.table, a);
    let mut out = vec![
        function_statement(
            &members_fn,
            &format!("the function noting {}'s group members", g.table),
            &link_note_body(&g.table, "row", &[&g.row, &g.group], &g.row, g.row_kind),
        ),
        row_trigger(&g.members, &members_trigger, &members_fn, false),
        function_statement(
            &groups_fn,
            &format!("the function noting {}'s group assignments", g.table),
            &link_note_body(
                &g.table,
                "group",
                &[&g.group, &g.replica],
                &g.group,
                g.group_kind,
            ),
        ),
        row_trigger(&g.assigned, &groups_trigger, &groups_fn, false),
    ];
    out.extend(refuse_truncate(&g.members, "routes rows by", guarded));
    out.extend(refuse_truncate(&g.assigned, "routes rows by", guarded));
    out
}

fn route_statements(r: &CatalogRoute, names: &Names) -> Vec<Statement> {
    let a = r.audience.as_deref();
    let function = names.of_entry("routed_", &r.table, a);
    let trigger_name = names.of_entry("ferry_sync_routed_", &r.table, a);
    let body = format!(
        "
BEGIN
    INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ({}, '', 'routed');
    RETURN NULL;
END
",
        quote_literal(&r.table.to_string())
    );
    let mut out = vec![function_statement(
        &function,
        &format!("the function noting a change of {}'s routes", r.table),
        &body,
    )];
    for read in &r.reads {
        out.push(trigger(
            read,
            &trigger_name,
            &function,
            &[],
            TG_INSERT | TG_UPDATE | TG_DELETE | TG_TRUNCATE,
            false,
            format!(
                "the trigger {trigger_name} on {read} (read by routed view {})",
                r.view
            ),
        ));
    }
    out
}

fn replica_statements(catalog: &Catalog, guarded: &mut BTreeSet<Relation>) -> Vec<Statement> {
    let r = &catalog.replicas;
    let id = format!("OLD.{}", quote_ident(&r.id));
    let new_id = format!("NEW.{}", quote_ident(&r.id));
    let relation = quote_literal(&r.relation.to_string());
    let body = format!(
        "
BEGIN
    IF TG_OP = 'UPDATE' AND OLD::text IS NOT DISTINCT FROM NEW::text THEN
        RETURN NULL;
    END IF;
    IF {id} IS NOT NULL AND (TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND {id} IS DISTINCT FROM {new_id})) THEN
        INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ({relation}, {id}::text, 'replica');
    END IF;
    IF TG_OP <> 'DELETE' AND {new_id} IS NOT NULL THEN
        INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ({relation}, {new_id}::text, 'replica');
    END IF;
    RETURN NULL;
END
"
    );
    let mut out = vec![
        function_statement(
            "replicas_note",
            &format!(
                "the function noting changes of the replicas relation {}",
                r.relation
            ),
            &body,
        ),
        row_trigger(&r.relation, "ferry_sync_replicas", "replicas_note", false),
    ];
    out.extend(refuse_truncate(&r.relation, "routes rows by", guarded));
    out
}

/// With relay shards (docs/sync-scale.md §2), every note is planned by every shard: a note
/// written for shard 0, as every writer writes it, is copied for the others in the same
/// transaction.
fn fan_out_statements(shards: u32) -> Vec<Statement> {
    let body = format!(
        "
BEGIN
    IF NEW.shard <> 0 THEN
        RETURN NULL;
    END IF;
    INSERT INTO ferry_sync.notes (shard, relation, key, kind)
    SELECT s, NEW.relation, NEW.key, NEW.kind FROM generate_series(1, {}) AS s;
    RETURN NULL;
END
",
        shards - 1
    );
    let notes = Relation {
        schema: "ferry_sync".into(),
        name: "notes".into(),
    };
    vec![
        function_statement(
            "notes_fan_out",
            &format!(
                "the function copying each note for relay shards 1 to {}",
                shards - 1
            ),
            &body,
        ),
        trigger(
            &notes,
            "ferry_sync_fan_out",
            "notes_fan_out",
            &[],
            TG_ROW | TG_INSERT,
            false,
            format!("the trigger copying each note for {shards} relay shards"),
        ),
    ]
}

/// The indexes the relay's lookups need, unless a plain index already leads with the
/// same columns.
fn indexes(rules: &Rules, catalog: &Catalog) -> Vec<Statement> {
    let mut wanted: Vec<(Relation, Vec<String>, String)> = Vec::new();
    for t in &rules.tables {
        match &t.route {
            crate::rules::Route::Assigned { column } => wanted.push((
                t.relation.clone(),
                vec![column.clone()],
                format!("{}'s replicas by {column}", t.relation),
            )),
            crate::rules::Route::Follows { columns } => wanted.push((
                t.relation.clone(),
                columns.clone(),
                format!("{}'s rows by their parent", t.relation),
            )),
            _ => {}
        }
    }
    for g in &catalog.groups {
        wanted.push((
            g.members.clone(),
            vec![g.group.clone()],
            format!("{}'s members by group", g.table),
        ));
        wanted.push((
            g.members.clone(),
            vec![g.row.clone()],
            format!("{}'s groups by row", g.table),
        ));
        wanted.push((
            g.assigned.clone(),
            vec![g.group.clone()],
            format!("{}'s replicas by group", g.table),
        ));
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for (table, columns, purpose) in wanted {
        if !seen.insert((table.clone(), columns.clone())) || covered(catalog, &table, &columns) {
            continue;
        }
        let name = fit(
            format!("ferry_sync_{}_{}", table.name, columns.join("_")),
            &format!("{table}({})", columns.join(",")),
        );
        let cols: Vec<String> = columns.iter().map(|c| quote_ident(c)).collect();
        out.push(Statement {
            what: format!("the index {name} ({purpose})"),
            sql: format!(
                "CREATE INDEX IF NOT EXISTS {} ON {} ({});",
                quote_ident(&name),
                table.quoted(),
                cols.join(", ")
            ),
            object: Object::Index {
                table,
                name,
                columns,
            },
        });
    }
    out
}

/// Does a plain index of `table` (not ferry-sync's) lead with `columns`, in any order?
fn covered(catalog: &Catalog, table: &Relation, columns: &[String]) -> bool {
    let wanted: BTreeSet<&String> = columns.iter().collect();
    catalog.indexes.get(table).is_some_and(|indexes| {
        indexes.iter().any(|index| {
            index.len() >= columns.len()
                && index[..columns.len()].iter().collect::<BTreeSet<_>>() == wanted
        })
    })
}

/// Names derived from relations: `<prefix><name>` for `public`, `<prefix><schema>__<name>`
/// otherwise, made to fit 63 bytes, and given a hash suffix where two relations would
/// share one (`public.a__b` and `a.b`).
struct Names {
    bases: BTreeMap<Relation, String>,
}

impl Names {
    fn new(catalog: &Catalog) -> Names {
        let plain = |r: &Relation| {
            if r.schema == "public" {
                r.name.clone()
            } else {
                format!("{}__{}", r.schema, r.name)
            }
        };
        let relations = catalog.relations();
        let mut count: BTreeMap<String, usize> = BTreeMap::new();
        for (relation, _) in &relations {
            *count.entry(plain(relation)).or_default() += 1;
        }
        let bases = relations
            .iter()
            .map(|(relation, _)| {
                let base = plain(relation);
                let base = if count[&base] > 1 {
                    format!("{base}_{}", short_hash(&relation.to_string()))
                } else {
                    base
                };
                ((*relation).clone(), base)
            })
            .collect();
        Names { bases }
    }

    fn function(&self, prefix: &str, relation: &Relation) -> String {
        self.derived(prefix, relation)
    }

    /// A name for one entry of `relation`: an entry for an audience gets `__<audience>`
    /// and a hash of the entry, so it never meets another table's name (`orders` for
    /// audience `east` and a table `orders__east`).
    fn of_entry(&self, prefix: &str, relation: &Relation, audience: Option<&str>) -> String {
        match audience {
            None => self.derived(prefix, relation),
            Some(a) => {
                let base = &self.bases[relation];
                let seed = format!("{prefix}{relation}@{a}");
                fit(format!("{prefix}{base}__{a}_{}", short_hash(&seed)), &seed)
            }
        }
    }

    fn derived(&self, prefix: &str, relation: &Relation) -> String {
        let base = &self.bases[relation];
        fit(format!("{prefix}{base}"), &format!("{prefix}{relation}"))
    }
}

/// `name` if it fits a Postgres identifier (63 bytes), else its first 54 bytes, `_` and
/// 8 hex digits of SHA-256 over `seed` (names are ASCII, so any cut is a char boundary).
fn fit(name: String, seed: &str) -> String {
    if name.len() <= crate::rules::IDENT_BYTES_MAX {
        return name;
    }
    format!("{}_{}", &name[..54], short_hash(seed))
}

fn short_hash(seed: &str) -> String {
    Sha256::digest(seed.as_bytes())[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_name_is_cut_and_given_a_hash() {
        let long = "x".repeat(70);
        let a = fit(format!("note_{long}"), "a");
        let b = fit(format!("note_{long}"), "b");
        assert_eq!(a.len(), 63);
        assert_ne!(a, b);
        assert_eq!(fit("note_t".into(), "s"), "note_t");
    }
}
