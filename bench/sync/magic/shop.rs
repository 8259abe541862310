//! The two tables of the side-by-side sync benchmark, as magic_sync 0.5.1 declares them,
//! shared by both sides (`#[path]`-included by `server/` and `replicas/`, each of which
//! builds magic_sync with one feature: its `Row` derive generates code for that side's
//! database).
//!
//! The tables are the driver's (bench/sync/magic/README.md has the DDL); each struct is
//! one of them, column for column, and magic_sync refuses to start on any difference.
//! Rows travel as protobuf (magic_sync's `Codec::new` with a prost message): the compact
//! of the two encodings it offers; its other, `Codec::json`, spells every i64 as text.

use magic_sync::wire::{Codec, MapError};
use uuid::Uuid;

/// Written on the server, held whole by every live store.
#[derive(sqlx::FromRow, Clone, Debug, magic_sync::Row)]
#[row(table = "products", mirror = "catalog", sync = "broadcast")]
pub struct Product {
    pub id: i64,
    pub name: String,
    pub price_cents: i64,
    /// When the driver's writer changed the row (Postgres's clock, ns since the epoch);
    /// 0 for a row loaded before the run. The replica host measures lag by it.
    pub at_ns: i64,
}

/// Written on the server, held by the one store its `store` names.
#[derive(sqlx::FromRow, Clone, Debug, magic_sync::Row)]
#[row(table = "orders", mirror = "catalog", sync = "assigned(store)")]
pub struct Order {
    pub id: i64,
    pub store: Uuid,
    pub qty: i64,
    /// As `Product::at_ns`.
    pub at_ns: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProductRow {
    #[prost(int64, tag = "1")]
    pub id: i64,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(int64, tag = "3")]
    pub price_cents: i64,
    #[prost(int64, tag = "4")]
    pub at_ns: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct OrderRow {
    #[prost(int64, tag = "1")]
    pub id: i64,
    /// The store's uuid, its 16 bytes.
    #[prost(bytes = "vec", tag = "2")]
    pub store: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub qty: i64,
    #[prost(int64, tag = "4")]
    pub at_ns: i64,
}

fn product_to_wire(p: Product) -> Result<ProductRow, MapError> {
    Ok(ProductRow {
        id: p.id,
        name: p.name,
        price_cents: p.price_cents,
        at_ns: p.at_ns,
    })
}

fn product_from_wire(r: ProductRow) -> Result<Product, MapError> {
    Ok(Product {
        id: r.id,
        name: r.name,
        price_cents: r.price_cents,
        at_ns: r.at_ns,
    })
}

fn order_to_wire(o: Order) -> Result<OrderRow, MapError> {
    Ok(OrderRow {
        id: o.id,
        store: o.store.as_bytes().to_vec(),
        qty: o.qty,
        at_ns: o.at_ns,
    })
}

fn order_from_wire(r: OrderRow) -> Result<Order, MapError> {
    Ok(Order {
        id: r.id,
        store: Uuid::from_slice(&r.store)?,
        qty: r.qty,
        at_ns: r.at_ns,
    })
}

/// The tables that travel, parents first (neither points at the other), as both sides
/// must list them. No codec stamps uploaded rows: nothing goes up but the engine's own.
pub fn codecs() -> Vec<Codec<()>> {
    vec![
        Codec::new::<Product, ProductRow>(product_to_wire, product_from_wire, None),
        Codec::new::<Order, OrderRow>(order_to_wire, order_from_wire, None),
    ]
}
