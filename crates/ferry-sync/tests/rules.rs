//! The rules file: what parses, into which model, and every refusal a rules file alone
//! can earn, each with a message naming the place and what to do. Guards against a
//! typo'd key passing silently (it would mirror less than the operator wrote) and
//! against two files that mean the same thing getting different digests (every replica
//! would be provisioned again for nothing).

use ferry_sync::rules::{Grouped, Relation, Route, Routed, Rules, RulesError};

const EXAMPLE: &str = r#"
[replicas]
relation = "public.stores"   # must have a uuid column named by `id` (default "id")
live = "open"                # optional SQL condition over the relation's columns
partition = "region_id"      # optional column of the relation

[tables.products]            # "products" means public.products; "shop.products" a schema
sync = "broadcast"
partition = "region_id"      # required for broadcast iff replicas are partitioned
columns = ["id", "name", "price", "region_id"]   # optional; must include the key columns
active = "products_active"   # optional view: rows it hides are not sent for their own sake
from = "products_for_shop"   # optional view to read rows from (same key)
as = "products"              # optional replica-side name (default: the bare table name)

[tables.orders]
sync = { assigned = "store_id" }      # a uuid column naming the replica

[tables.order_lines]
sync = { follows = "order_id" }       # FK column(s) (string or array) into a mirrored table

[tables.customers]                    # no sync: travels only by closure (a held row points at it)

[tables.tags]
sync = { grouped = { members = "tag_members", row = "tag_id", group = "group_id", assigned = "group_stores", replica = "store_id" } }

[tables.notices]
sync = { routed = { view = "notice_routes", row = "notice_id", replica = "store_id" } }   # row may be an array for composite keys
"#;

fn rel(text: &str) -> Relation {
    Relation::parse(text).unwrap()
}

fn parse(text: &str) -> Result<Rules, RulesError> {
    Rules::parse(text, "rules.toml")
}

/// The message of an `Invalid` refusal; panics on anything else.
fn invalid(text: &str) -> String {
    match parse(text) {
        Err(e @ RulesError::Invalid { .. }) => e.to_string(),
        other => panic!("expected an Invalid refusal, got {other:?}"),
    }
}

const REPLICAS: &str = "[replicas]\nrelation = \"stores\"\n";
const PARTITIONED: &str = "[replicas]\nrelation = \"stores\"\npartition = \"region_id\"\n";

#[test]
fn the_designers_example_parses_into_the_model() {
    let rules = parse(EXAMPLE).unwrap();
    assert_eq!(rules.replicas.relation, rel("stores"));
    assert_eq!(rules.replicas.id, "id");
    assert_eq!(rules.replicas.live.as_deref(), Some("open"));
    assert_eq!(rules.replicas.partition.as_deref(), Some("region_id"));
    assert!(rules.partitioned());

    let names: Vec<String> = rules
        .tables
        .iter()
        .map(|t| t.relation.to_string())
        .collect();
    assert_eq!(
        names,
        [
            "public.customers",
            "public.notices",
            "public.order_lines",
            "public.orders",
            "public.products",
            "public.tags"
        ],
        "tables are sorted by relation"
    );
    let products = rules.table(&rel("products")).unwrap();
    assert_eq!(
        products.route,
        Route::Broadcast {
            partition: Some("region_id".into())
        }
    );
    assert_eq!(
        products.columns.as_deref(),
        Some(&["id", "name", "price", "region_id"].map(String::from)[..])
    );
    assert_eq!(products.active, Some(rel("products_active")));
    assert_eq!(products.from, Some(rel("products_for_shop")));
    assert_eq!(products.replica_name, "products");
    assert_eq!(
        rules.table(&rel("orders")).unwrap().route,
        Route::Assigned {
            column: "store_id".into()
        }
    );
    assert_eq!(
        rules.table(&rel("order_lines")).unwrap().route,
        Route::Follows {
            columns: vec!["order_id".into()]
        }
    );
    assert_eq!(
        rules.table(&rel("customers")).unwrap().route,
        Route::Closure
    );
    assert_eq!(
        rules.table(&rel("tags")).unwrap().route,
        Route::Grouped(Grouped {
            members: rel("tag_members"),
            row: "tag_id".into(),
            group: "group_id".into(),
            assigned: rel("group_stores"),
            replica: "store_id".into(),
        })
    );
    assert_eq!(
        rules.table(&rel("notices")).unwrap().route,
        Route::Routed(Routed {
            view: rel("notice_routes"),
            row: vec!["notice_id".into()],
            replica: "store_id".into(),
        })
    );
}

#[test]
fn schemas_replica_names_and_composite_rows_are_honoured() {
    let rules = parse(&format!(
        "{REPLICAS}
[tables.\"shop.products\"]
as = \"shop_products\"
sync = {{ follows = [\"a\", \"b\"] }}

[tables.notices]
sync = {{ routed = {{ view = \"ops.routes\", row = [\"x\", \"y\"], replica = \"store_id\" }} }}
"
    ))
    .unwrap();
    let t = rules.table(&rel("shop.products")).unwrap();
    assert_eq!(t.relation.schema, "shop");
    assert_eq!(t.replica_name, "shop_products");
    assert_eq!(
        t.route,
        Route::Follows {
            columns: vec!["a".into(), "b".into()]
        }
    );
    let Route::Routed(r) = &rules.table(&rel("notices")).unwrap().route else {
        panic!("notices is routed")
    };
    assert_eq!(r.view, rel("ops.routes"));
    assert_eq!(r.row, ["x", "y"]);
}

#[test]
fn an_unknown_key_is_refused_with_its_line_and_column() {
    let text = format!(
        "{REPLICAS}\n[tables.orders]\nsync = {{ assigned = \"store_id\" }}\ncolums = [\"id\"]\n"
    );
    match parse(&text) {
        Err(RulesError::Syntax {
            line,
            column,
            message,
            ..
        }) => {
            assert_eq!((line, column), (6, 1), "{message}");
            assert!(message.contains("colums"), "{message}");
        }
        other => panic!("expected a syntax refusal, got {other:?}"),
    }
    let e = parse(&text).unwrap_err().to_string();
    assert!(
        e.starts_with("rules file rules.toml, line 6, column 1:"),
        "{e}"
    );

    // In [replicas], and inside an inline table.
    let e = parse("[replicas]\nrelation = \"stores\"\nlve = \"open\"\n").unwrap_err();
    assert!(matches!(e, RulesError::Syntax { line: 3, .. }), "{e}");
    let e = parse(&format!(
        "{REPLICAS}[tables.tags]\nsync = {{ grouped = {{ members = \"m\", row = \"r\", group = \"g\", assigned = \"a\", replica = \"s\", extra = 1 }} }}\n"
    ))
    .unwrap_err();
    assert!(matches!(e, RulesError::Syntax { line: 4, .. }), "{e}");
    assert!(e.to_string().contains("extra"), "{e}");
}

#[test]
fn a_bad_shape_is_refused_as_syntax() {
    for (text, needle) in [
        ("", "replicas"),
        ("[replicas]\n", "relation"),
        ("[replicas]\nrelation = 1\n", "string"),
        (
            &format!("{REPLICAS}[tables.t]\nsync = \"sometimes\"\n") as &str,
            "sometimes",
        ),
        (
            &format!("{REPLICAS}[tables.t]\nmirror = \"never\"\n"),
            "never",
        ),
        (
            &format!("{REPLICAS}[tables.t]\nsync = {{ assigned = 1 }}\n"),
            "string",
        ),
        ("[replicas\n", ""),
    ] {
        match parse(text) {
            Err(RulesError::Syntax { message, .. }) => {
                assert!(message.contains(needle), "{text:?}: {message}")
            }
            other => panic!("{text:?}: expected a syntax refusal, got {other:?}"),
        }
    }
}

/// docs/sync-up.md §2: a two-way table names the columns its replicas write; they are
/// never the key, a routing column or in `columns`, and `from` is refused.
#[test]
fn a_two_way_table_names_the_columns_its_replicas_write_and_nothing_else_may_claim_them() {
    let ok = parse(&format!(
        "{REPLICAS}[tables.orders]\nmirror = \"both\"\nsync = {{ assigned = \"store_id\" }}\nreplica_writes = [\"status\", \"picked_at\"]\nlane = \"orders\"\n"
    ))
    .unwrap();
    let two_way = ok.tables[0].two_way.as_ref().unwrap();
    assert_eq!(two_way.columns, ["status", "picked_at"]);
    assert_eq!(two_way.lane, "orders");
    let plain = parse(&format!("{REPLICAS}[tables.t]\nmirror = \"catalog\"\n")).unwrap();
    assert_eq!(plain.tables[0].two_way, None);
    for (body, needle) in [
        ("mirror = \"both\"\n", "replica_writes = ["),
        ("mirror = \"both\"\nreplica_writes = []\n", "is empty"),
        (
            "mirror = \"both\"\nreplica_writes = [\"a\", \"a\"]\n",
            "twice",
        ),
        (
            "mirror = \"both\"\nreplica_writes = [\"a\"]\ncolumns = [\"id\", \"a\"]\n",
            "a column has one writer",
        ),
        (
            "mirror = \"both\"\nreplica_writes = [\"store_id\"]\nsync = { assigned = \"store_id\" }\n",
            "routes the table's rows",
        ),
        (
            "mirror = \"both\"\nreplica_writes = [\"a\"]\nfrom = \"v\"\n",
            "remove `from`",
        ),
        (
            "replica_writes = [\"a\"]\n",
            "remove it from this catalog table",
        ),
        ("lane = \"x\"\n", "remove it from this catalog table"),
        (
            "mirror = \"setting\"\n",
            "names its owner, its version and what the server may wish",
        ),
        (
            "mirror = \"setting\"\nreplica = \"s\"\nversion = \"rev\"\ndesired = [\"rev\"]\n",
            "a wish cannot set it",
        ),
        (
            "mirror = \"record\"\ndesired = [\"a\"]\n",
            "on a setting table",
        ),
        ("desired = [\"a\"]\n", "remove it from this"),
    ] {
        let e = invalid(&format!("{REPLICAS}[tables.t]\n{body}"));
        assert!(e.contains(needle), "{body:?}: {e}");
        assert!(e.contains("[tables.t]"), "{e}");
    }
}

/// docs/sync-up.md §2: a record table is the replicas' to write; what routes rows down
/// makes no sense on it, and what only records mean makes no sense on a catalog table.
#[test]
fn a_record_table_takes_replica_version_and_lane_and_nothing_that_routes_rows_down() {
    let rules = parse(&format!(
        "{REPLICAS}[tables.sales]\nmirror = \"record\"\nreplica = \"store_id\"\nversion = \"rev\"\nlane = \"tills\"\n[tables.notes]\nmirror = \"record\"\n"
    ))
    .unwrap();
    assert!(rules.tables.is_empty());
    assert_eq!(rules.records.len(), 2);
    let notes = &rules.records[0];
    assert_eq!(
        (notes.replica_name.as_str(), notes.lane.as_str()),
        ("notes", "main")
    );
    assert_eq!(
        (notes.replica.as_deref(), notes.version.as_deref()),
        (None, None)
    );
    let sales = &rules.records[1];
    assert_eq!(sales.replica.as_deref(), Some("store_id"));
    assert_eq!(sales.version.as_deref(), Some("rev"));
    assert_eq!(sales.lane, "tills");
    for (extra, needle) in [
        ("sync = \"broadcast\"", "`sync` routes rows down"),
        ("from = \"v\"", "`from` routes rows down"),
        ("active = \"v\"", "`active` routes rows down"),
        (
            "columns = [\"id\"]\nreplica = \"store_id\"",
            "replica column \"store_id\" is not in `columns`",
        ),
        ("lane = \"a b\"", "lane:"),
    ] {
        let e = invalid(&format!(
            "{REPLICAS}[tables.t]\nmirror = \"record\"\n{extra}\n"
        ));
        assert!(e.contains(needle), "{extra}: {e}");
    }
    for field in ["replica = \"x\"", "version = \"x\"", "lane = \"x\""] {
        let e = invalid(&format!("{REPLICAS}[tables.t]\n{field}\n"));
        assert!(
            e.contains("applies to tables the replicas write"),
            "{field}: {e}"
        );
    }
    let e = invalid(&format!(
        "{REPLICAS}[tables.t]\nmirror = \"record\"\n[tables.u]\nas = \"t\"\n"
    ));
    assert!(e.contains("is taken by"), "{e}");
}

/// Rules written before record tables existed keep the digest they were installed with.
#[test]
fn rules_without_record_tables_keep_their_digest() {
    let rules = parse(&format!("{REPLICAS}[tables.t]\nsync = \"broadcast\"\n")).unwrap();
    let json = serde_json::to_string(&rules).unwrap();
    assert!(!json.contains("records"), "{json}");
}

#[test]
fn names_must_be_identifiers_of_at_most_63_bytes() {
    let long = "x".repeat(64);
    for (text, needle) in [
        (format!("{REPLICAS}[tables.{long}]\n"), "over Postgres's 63"),
        (
            format!("{REPLICAS}[tables.\"a.b.c\"]\n"),
            "not an identifier",
        ),
        (
            format!("{REPLICAS}[tables.\"9lives\"]\n"),
            "not an identifier",
        ),
        (format!("{REPLICAS}[tables.t]\nas = \"my table\"\n"), "as:"),
        (
            format!("{REPLICAS}[tables.t]\ncolumns = [\"id\", \"na-me\"]\n"),
            "columns",
        ),
        (
            format!("{REPLICAS}[tables.t]\nsync = {{ assigned = \"\" }}\n"),
            "empty",
        ),
        (
            "[replicas]\nrelation = \"sto res\"\n".to_string(),
            "[replicas]",
        ),
        (
            "[replicas]\nrelation = \"stores\"\nid = \"\"\n".to_string(),
            "id",
        ),
    ] {
        let e = invalid(&text);
        assert!(e.contains(needle), "{text:?}: {e}");
    }
    let ok = format!("{REPLICAS}[tables.{}]\n", "x".repeat(63));
    assert!(parse(&ok).is_ok());
}

#[test]
fn replica_side_names_are_unique() {
    let e = invalid(&format!(
        "{REPLICAS}[tables.products]\n[tables.\"shop.products\"]\n"
    ));
    assert!(e.contains("\"products\" is taken"), "{e}");
    assert!(e.contains("as = "), "{e}");
    let ok = parse(&format!(
        "{REPLICAS}[tables.products]\n[tables.\"shop.products\"]\nas = \"shop_products\"\n"
    ));
    assert!(ok.is_ok());
    let e = invalid(&format!(
        "{REPLICAS}[tables.products]\n[tables.\"public.products\"]\nas = \"p2\"\n"
    ));
    assert!(e.contains("another entry names too"), "{e}");
    let e = invalid(&format!("{REPLICAS}[tables.t]\nas = \"sqlite_master\"\n"));
    assert!(e.contains("keep for themselves"), "{e}");
}

#[test]
fn broadcast_needs_a_partition_exactly_when_the_replicas_are_partitioned() {
    assert!(parse(&format!("{REPLICAS}[tables.t]\nsync = \"broadcast\"\n")).is_ok());
    assert!(
        parse(&format!(
            "{PARTITIONED}[tables.t]\nsync = \"broadcast\"\npartition = \"region_id\"\n"
        ))
        .is_ok()
    );
    let e = invalid(&format!("{PARTITIONED}[tables.t]\nsync = \"broadcast\"\n"));
    assert!(e.contains("needs `partition"), "{e}");
    let e = invalid(&format!(
        "{REPLICAS}[tables.t]\nsync = \"broadcast\"\npartition = \"region_id\"\n"
    ));
    assert!(e.contains("not partitioned"), "{e}");
    let e = invalid(&format!(
        "{PARTITIONED}[tables.t]\nsync = {{ assigned = \"s\" }}\npartition = \"region_id\"\n"
    ));
    assert!(e.contains("broadcast tables only"), "{e}");
}

#[test]
fn lists_are_non_empty_and_without_repeats() {
    let e = invalid(&format!("{REPLICAS}[tables.t]\ncolumns = []\n"));
    assert!(e.contains("columns is empty"), "{e}");
    let e = invalid(&format!(
        "{REPLICAS}[tables.t]\ncolumns = [\"id\", \"id\"]\n"
    ));
    assert!(e.contains("twice"), "{e}");
    let e = invalid(&format!(
        "{REPLICAS}[tables.t]\nsync = {{ follows = [] }}\n"
    ));
    assert!(e.contains("follows is empty"), "{e}");
    let e = invalid("[replicas]\nrelation = \"stores\"\nlive = \" \"\n");
    assert!(e.contains("live is empty"), "{e}");
}

#[test]
fn the_digest_follows_meaning_not_spelling() {
    let a = parse(&format!(
        "{REPLICAS}[tables.a]\nsync = \"broadcast\"\n[tables.b]\nsync = {{ follows = \"a_id\" }}\n"
    ))
    .unwrap();
    // Same meaning: other order, defaults spelled out, a comment, another path.
    let b = Rules::parse(
        "[replicas]\nrelation = \"public.stores\"\nid = \"id\"\n# hi\n[tables.\"public.b\"]\nsync = { follows = [\"a_id\"] }\nas = \"b\"\n[tables.a]\nsync = \"broadcast\"\nmirror = \"catalog\"\n",
        "elsewhere.toml",
    )
    .unwrap();
    assert_eq!(a.digest(), b.digest());
    assert_eq!(a.digest().len(), 64);
    assert!(a.digest().bytes().all(|c| c.is_ascii_hexdigit()));
    let c = parse(&format!(
        "{REPLICAS}[tables.a]\nsync = \"broadcast\"\n[tables.b]\nsync = {{ follows = \"a_id\" }}\nas = \"bee\"\n"
    ))
    .unwrap();
    assert_ne!(a.digest(), c.digest());
}

#[test]
fn a_rules_error_is_permanent() {
    use ferry_core::Classify;
    let e = parse("nonsense").unwrap_err();
    assert!(!e.is_transient());
}

/// Audiences (docs/sync-scale.md §1): one Postgres table mirrored once per audience, in two
/// shapes, each entry kept apart in the server's state; every way two entries could
/// claim one table or one replica-side name is refused, naming both.
#[test]
fn a_table_is_mirrored_once_or_once_per_audience_and_names_stay_unique_per_audience() {
    const AUDIENCES: &str = "[replicas]\nrelation = \"stores\"\naudience = \"kind\"\n";
    let rules = parse(&format!(
        "{AUDIENCES}
[tables.till_products]
table = \"products\"
audience = \"till\"
sync = \"broadcast\"
columns = [\"id\", \"name\", \"price\"]
active = \"products_on_sale\"

[tables.office_products]
table = \"products\"
audience = \"office\"
sync = \"broadcast\"

[tables.orders]
audience = \"till\"
sync = {{ assigned = \"store_id\" }}

[tables.customers]
"
    ))
    .unwrap();
    assert_eq!(rules.replicas.audience.as_deref(), Some("kind"));
    let entries: Vec<(String, String)> = rules
        .entries(&rel("products"))
        .map(|t| (t.entry(), t.replica_name.clone()))
        .collect();
    assert_eq!(
        entries,
        [
            ("public.products@office".to_string(), "products".to_string()),
            ("public.products@till".to_string(), "products".to_string())
        ]
    );
    let till = rules.entry("public.products@till").unwrap();
    assert!(till.reaches(Some("till")) && !till.reaches(Some("office")) && !till.reaches(None));
    let customers = rules.entry("public.customers").unwrap();
    assert!(customers.reaches(Some("till")) && customers.reaches(None));
    // Adding audiences to rules that had none leaves the digest of rules without them.
    let plain = "[replicas]\nrelation = \"stores\"\n[tables.customers]\n";
    let with_column =
        "[replicas]\nrelation = \"stores\"\naudience = \"kind\"\n[tables.customers]\n";
    assert_ne!(
        parse(plain).unwrap().digest(),
        parse(with_column).unwrap().digest()
    );
    assert_eq!(
        parse(plain).unwrap().digest(),
        parse("[replicas]\nrelation = \"stores\"\n\n[tables.customers]\nmirror = \"catalog\"\n")
            .unwrap()
            .digest()
    );

    for (tables, needle) in [
        (
            "[tables.a]\ntable = \"products\"\naudience = \"till\"\n[tables.b]\ntable = \"products\"\naudience = \"till\"\nas = \"p2\"\n",
            "names table public.products for audience \"till\", which [tables.a] does too",
        ),
        (
            "[tables.products]\n[tables.b]\ntable = \"products\"\naudience = \"till\"\nas = \"p2\"\n",
            "one of them has no `audience`",
        ),
        (
            "[tables.products]\naudience = \"till\"\n[tables.goods]\nas = \"products\"\n",
            "the replica-side name \"products\" is taken by [tables.",
        ),
        (
            "[tables.products]\naudience = \"till\"\nmirror = \"both\"\nreplica_writes = [\"shelf\"]\n[tables.goods]\naudience = \"office\"\nas = \"products\"\n",
            "the replica-side name \"products\" is taken by [tables.",
        ),
        (
            "[tables.sales]\nmirror = \"record\"\naudience = \"till\"\n",
            "`audience` routes rows down",
        ),
        (
            "[tables.products]\naudience = \"a b\"\n",
            "audience: name \"a b\" is not an identifier",
        ),
    ] {
        let e = invalid(&format!("{AUDIENCES}{tables}"));
        assert!(e.contains(needle), "{tables}: {e}");
    }
    let e = invalid(&format!(
        "{REPLICAS}[tables.products]\naudience = \"till\"\n"
    ));
    assert!(
        e.contains("needs the replicas' audience: add `audience = \"COLUMN\"` to [replicas]"),
        "{e}"
    );
    // Two audiences may share a replica-side name; an entry for one audience and the
    // table's own name elsewhere may not.
    parse(&format!(
        "{AUDIENCES}[tables.a]\ntable = \"products\"\naudience = \"till\"\n[tables.b]\ntable = \"goods\"\naudience = \"office\"\nas = \"products\"\n"
    ))
    .unwrap();
}
