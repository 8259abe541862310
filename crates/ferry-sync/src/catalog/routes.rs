//! Step 3 for the routes that read other relations: `grouped` (two group tables) and
//! `routed` (a view, and the tables it reads).

use super::error::Doing;
use super::{
    CatalogGroup, CatalogRoute, CatalogTable, CheckError, KeyKind, Loader, RelationInfo,
    VIEW_READS_SQL, missing_column, place,
};
use crate::rules::{Relation, Route, Table};

impl Loader<'_> {
    /// A grouped table: its single-part key, the members table linking rows to groups and
    /// the assigned table linking groups to replicas.
    pub(super) async fn group(
        &mut self,
        table: &Table,
        t: &CatalogTable,
    ) -> Result<CatalogGroup, CheckError> {
        let Route::Grouped(g) = &table.route else {
            unreachable!("group is called for grouped tables")
        };
        let here = place(self.rules, table);
        let [key] = t.key.as_slice() else {
            return Err(CheckError::Mismatch(format!(
                "{} ({here}) is grouped but its key has {} columns; a members table links rows by one column, so a grouped table needs a one-column key",
                table.relation,
                t.key.len()
            )));
        };
        let key_type = self.relations[&table.relation]
            .column(key)
            .expect("a key column is a column")
            .type_oid;
        let members = self
            .group_table(&g.members, &format!("members table of {here}"))
            .await?;
        let row = members
            .column(&g.row)
            .ok_or_else(|| missing_column(&g.members, &g.row, &here, "grouped.row"))?;
        if row.type_oid != key_type {
            return Err(CheckError::Mismatch(format!(
                "column {}.{} (grouped.row of {here}) has type {}, not the type of {}'s key {key}; it must name rows of that table: make the types equal",
                g.members, g.row, row.display, table.relation
            )));
        }
        let row_kind = t.key_kinds[0];
        let group = members
            .column(&g.group)
            .ok_or_else(|| missing_column(&g.members, &g.group, &here, "grouped.group"))?
            .clone();
        let group_kind = KeyKind::of(&group.type_name).ok_or_else(|| {
            CheckError::Mismatch(format!(
                "column {}.{} (grouped.group of {here}) has type {}; a group must be a uuid, an integer or text",
                g.members, g.group, group.display
            ))
        })?;
        let assigned = self
            .group_table(&g.assigned, &format!("assigned table of {here}"))
            .await?;
        let assigned_group = assigned
            .column(&g.group)
            .ok_or_else(|| missing_column(&g.assigned, &g.group, &here, "grouped.group"))?;
        if assigned_group.type_oid != group.type_oid {
            return Err(CheckError::Mismatch(format!(
                "column {}.{} has type {} but {}.{} has type {} ({here}); both name groups: make the types equal",
                g.assigned, g.group, assigned_group.display, g.members, g.group, group.display
            )));
        }
        self.require_uuid(&g.assigned, &g.replica, &here, "grouped.replica")?;
        Ok(CatalogGroup {
            table: table.relation.clone(),
            audience: table.audience.clone(),
            members: g.members.clone(),
            row: g.row.clone(),
            row_kind,
            group: g.group.clone(),
            group_kind,
            assigned: g.assigned.clone(),
            replica: g.replica.clone(),
        })
    }

    /// A group table must be a table: its trigger notes group changes.
    async fn group_table(
        &mut self,
        relation: &Relation,
        role: &str,
    ) -> Result<RelationInfo, CheckError> {
        let info = self.relation(relation, role).await?;
        if !info.is_table() {
            return Err(CheckError::Mismatch(format!(
                "{relation}, the {role}, is not a table (relkind {}); ferry-sync notes its changes with a trigger, which needs a table",
                info.kind
            )));
        }
        Ok(info)
    }

    /// A routed table: the view pairing its rows (by key) with replicas, and the tables
    /// the view reads.
    pub(super) async fn route(
        &mut self,
        table: &Table,
        t: &CatalogTable,
    ) -> Result<CatalogRoute, CheckError> {
        let Route::Routed(r) = &table.route else {
            unreachable!("route is called for routed tables")
        };
        let here = place(self.rules, table);
        let view = self
            .relation(&r.view, &format!("routed view of {here}"))
            .await?;
        if r.row.len() != t.key.len() {
            return Err(CheckError::Mismatch(format!(
                "routed.row of {here} names {} column(s) but the key of {} has {} ({}); name the view's columns holding the key, in key order",
                r.row.len(),
                table.relation,
                t.key.len(),
                t.key.join(", ")
            )));
        }
        let table_info = self.relations[&table.relation].clone();
        for (row, key) in r.row.iter().zip(&t.key) {
            let c = view
                .column(row)
                .ok_or_else(|| missing_column(&r.view, row, &here, "routed.row"))?;
            let key_type = table_info.column(key).expect("a key column is a column");
            if c.type_oid != key_type.type_oid {
                return Err(CheckError::Mismatch(format!(
                    "column {}.{row} (routed.row of {here}) has type {}, but the key column {key} it stands for has type {}: make the types equal",
                    r.view, c.display, key_type.display
                )));
            }
        }
        self.require_uuid(&r.view, &r.replica, &here, "routed.replica")?;
        let mut probed = r.row.clone();
        probed.push(r.replica.clone());
        self.probe(&r.view, &probed, &format!("the routed view of {here}"))
            .await?;
        let reads: Vec<(String, String)> = sqlx::query_as(VIEW_READS_SQL)
            .bind(r.view.quoted())
            .fetch_all(&mut *self.conn)
            .await
            .doing(|| format!("reading which tables the routed view {} reads", r.view))?;
        Ok(CatalogRoute {
            table: table.relation.clone(),
            audience: table.audience.clone(),
            view: r.view.clone(),
            reads: reads
                .into_iter()
                .map(|(schema, name)| Relation { schema, name })
                .collect(),
        })
    }
}
