//! The three tables of the side-by-side sync benchmark, as magic_sync 0.5.1 declares them,
//! shared by both sides (`#[path]`-included by `server/` and `replicas/`, each of which
//! builds magic_sync with one feature: its `Row` derive generates code for that side's
//! database).
//!
//! The tables are the driver's (bench/sync/magic/README.md has the DDL); each struct is
//! one of them, column for column, and magic_sync refuses to start on any difference.
//! Rows travel as protobuf (magic_sync's `Codec::new` with a prost message): the compact
//! of the two encodings it offers; its other, `Codec::json`, spells every i64 as text.
//!
//! `products` and `orders` go down (catalogs); `sales` goes up (a record each replica
//! writes, filed on the server).

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

/// Written on a replica — a sale its store made — and filed on the server: the way up.
///
/// A plain record (no `version`: history, written once, filed first-wins). Not keyed by
/// the replica (magic_sync's `origin`): `origin` must be a key column, and `sales` is
/// keyed by `id` alone. Instead the server stamps `store` with the replica the upload
/// came from as it files the row ([`place_sale`], the codec's `place`), so a sale is
/// filed under its sender whatever the row says; the host writes that same uuid.
#[derive(sqlx::FromRow, Clone, Debug, magic_sync::Row)]
#[row(table = "sales", mirror = "record")]
pub struct Sale {
    pub id: Uuid,
    /// The store (replica) that made the sale.
    pub store: Uuid,
    pub amount: i64,
    /// When the replica host wrote the row (its wall clock, ns since the epoch, taken
    /// just before the commit). The driver measures commit-to-filed by it.
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

#[derive(Clone, PartialEq, prost::Message)]
pub struct SaleRow {
    /// The sale's uuid, its 16 bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub id: Vec<u8>,
    /// The store's uuid, its 16 bytes.
    #[prost(bytes = "vec", tag = "2")]
    pub store: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub amount: i64,
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

fn sale_to_wire(s: Sale) -> Result<SaleRow, MapError> {
    Ok(SaleRow {
        id: s.id.as_bytes().to_vec(),
        store: s.store.as_bytes().to_vec(),
        amount: s.amount,
        at_ns: s.at_ns,
    })
}

fn sale_from_wire(r: SaleRow) -> Result<Sale, MapError> {
    Ok(Sale {
        id: Uuid::from_slice(&r.id)?,
        store: Uuid::from_slice(&r.store)?,
        amount: r.amount,
        at_ns: r.at_ns,
    })
}

/// The server's stamp on a sale a replica uploads (magic_sync's `Place`): filed under
/// the replica the transport says sent it. Run on the server only; a replica's build
/// of magic_sync keeps no stamp.
fn place_sale(sale: &mut Sale, replica: Uuid, _known: &()) {
    sale.store = replica;
}

/// The tables that travel, parents first (none points at another), as both sides must
/// list them. Only `sales` is stamped as it is filed; the catalogs never go up.
pub fn codecs() -> Vec<Codec<()>> {
    vec![
        Codec::new::<Product, ProductRow>(product_to_wire, product_from_wire, None),
        Codec::new::<Order, OrderRow>(order_to_wire, order_from_wire, None),
        Codec::new::<Sale, SaleRow>(sale_to_wire, sale_from_wire, Some(place_sale)),
    ]
}
