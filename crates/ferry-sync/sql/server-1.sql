-- ferry-sync server schema, version 1. Never edited once released: a later version is a
-- new file that upgrades this one. docs/sync.md, "State on the server", says what each
-- table means and which invariant it carries.
CREATE SCHEMA ferry_sync;

-- One row: the schema version, this installation's epoch and secret (stamps), and the
-- digest of the rules the triggers were installed for.
CREATE TABLE ferry_sync.meta (
    one        boolean PRIMARY KEY DEFAULT true CHECK (one),
    version    integer NOT NULL,
    epoch      uuid NOT NULL,
    secret     bytea NOT NULL CHECK (length(secret) = 32),
    declared   text NOT NULL DEFAULT '',
    restores   integer NOT NULL DEFAULT 0,   -- new epochs taken after a restore (the alarm)
    entries    text[] NOT NULL DEFAULT '{}', -- the entries the installed rules mirror (docs/sync-scale.md §1)
    shards     integer NOT NULL DEFAULT 1 CHECK (shards >= 1), -- relay shards (docs/sync-scale.md §2)
    installed_at timestamptz NOT NULL DEFAULT now()
);

-- What changed, never who receives it. Written by the capture triggers in the writer's
-- transaction; deleted by the pass that plans it (one REPEATABLE READ transaction), or
-- parked. A delete, a key change or a move notes the old key first (lower id).
CREATE TABLE ferry_sync.notes (
    id        bigserial PRIMARY KEY,
    shard     integer NOT NULL DEFAULT 0,  -- the relay shard that plans it: one note per shard
    relation  text NOT NULL,          -- 'schema.table' as the rules name it
    key       text NOT NULL,          -- canonical key text (docs/sync.md, "Keys")
    kind      text NOT NULL DEFAULT 'row' CHECK (kind IN ('row', 'group', 'routed', 'replica', 'table', 'announce')),
    noted_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    parked_at timestamptz,
    attempts  integer NOT NULL DEFAULT 0,
    last_error text
);
CREATE INDEX notes_pending ON ferry_sync.notes (shard, id) WHERE parked_at IS NULL;

-- The relay shard a replica belongs to, of `shards`: its id's first four bytes, as an
-- unsigned big-endian integer, modulo `shards` (the relay computes the same in Rust).
CREATE FUNCTION ferry_sync.shard_of(id uuid, shards integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ((((get_byte(uuid_send(id), 0)::int8 << 24) | (get_byte(uuid_send(id), 1)::int8 << 16))
            | ((get_byte(uuid_send(id), 2)::int8 << 8) | get_byte(uuid_send(id), 3)::int8)) % shards)::integer
$$;

-- The replicas the relay knows: their chain, their seal key, what they confirmed.
-- `last_*` is the newest message recorded for the replica; `confirmed_*` the newest it
-- confirmed (stamp verified). A replica whose row is missing is provisioned from scratch.
CREATE TABLE ferry_sync.replicas (
    id              uuid PRIMARY KEY,
    partition       text,                 -- the replica's partition value, as text
    audience        text,                 -- its audience (docs/sync-scale.md §1), or NULL
    token_hash      bytea,                -- SHA-256 of its bearer token
    seal_key        bytea,                -- HMAC key the replica checks seals with
    epoch           uuid,                 -- the epoch its chain belongs to
    last_seq        bigint NOT NULL DEFAULT 0,
    last_nonce      bigint NOT NULL DEFAULT 0,
    confirmed_seq   bigint NOT NULL DEFAULT 0,
    confirmed_nonce bigint NOT NULL DEFAULT 0,
    standing        text NOT NULL DEFAULT 'new', -- new | provisioning | following
    heard_at        timestamptz,
    confirmed_at    timestamptz,
    failing_since   timestamptz,
    digest_at       timestamptz,                 -- when its digests were last compared
    confirmed_pass  bigint NOT NULL DEFAULT 0,   -- the pass its newest confirmed message was recorded in
    dropped         integer NOT NULL DEFAULT 0,  -- outboxes dropped (the alarm)
    handled_n       bigint NOT NULL DEFAULT 0    -- the `reports.n` the relay handled last
);

-- Row versions of broadcast tables: one row per (table, partition, key), O(rows). A
-- change sets rv to the recording pass's number; a delete or a move out of the
-- partition keeps the row as a tombstone (gone) until every replica's mark passed it.
CREATE TABLE ferry_sync.rows (
    shard     integer NOT NULL DEFAULT 0,   -- each relay shard keeps its own versions
    relation  text NOT NULL,
    part      text NOT NULL DEFAULT '',
    key       text NOT NULL,
    rv        bigint NOT NULL,
    gone      boolean NOT NULL DEFAULT false,
    PRIMARY KEY (shard, relation, part, key)
);
CREATE INDEX rows_since ON ferry_sync.rows (shard, relation, part, rv);
CREATE INDEX rows_gone ON ferry_sync.rows (shard, rv) WHERE gone;

-- Pass numbers: a broadcast row's rv is the pass that recorded it. Only the relay that
-- holds the lock records, so rv rises in commit order.
CREATE SEQUENCE ferry_sync.passes;

-- A replica's mark for broadcast tables is replicas.confirmed_pass: every row of its
-- partition with rv <= it is in a message it confirmed, except its quarantined rows.
-- O(replicas), whatever the number of broadcast tables and rows.

-- Per-row held state, only for tables whose routing differs per replica (assigned,
-- follows, grouped, routed, and parents pulled in by closure). `seq` is the message
-- that last carried the row; the replica holds it once confirmed_seq >= seq.
CREATE TABLE ferry_sync.held (
    replica   uuid NOT NULL REFERENCES ferry_sync.replicas ON DELETE CASCADE,
    relation  text NOT NULL,
    key       text NOT NULL,
    seq       bigint NOT NULL,
    by_rule   boolean NOT NULL,   -- its own rule sends it (false: only closure keeps it)
    PRIMARY KEY (replica, relation, key)
);
-- A changed row's holders, whoever they are (the planner looks rows up by key).
CREATE INDEX held_by_key ON ferry_sync.held (relation, key);

-- Bodies shared by every replica a message goes to (a broadcast change is stored once).
CREATE TABLE ferry_sync.bodies (
    hash  bytea NOT NULL,         -- SHA-256 of body
    shard integer NOT NULL DEFAULT 0,  -- the relay shard that wrote (and sweeps) it
    body  bytea NOT NULL,
    PRIMARY KEY (hash, shard)
);

-- Each replica's recorded, unconfirmed messages, in chain order. A message leaves when
-- the replica confirms it (or a later one).
CREATE TABLE ferry_sync.outbox (
    replica    uuid NOT NULL REFERENCES ferry_sync.replicas ON DELETE CASCADE,
    seq        bigint NOT NULL,
    head       bytea NOT NULL,    -- the encoded header, seal and stamp
    -- No foreign key to `bodies`, and no index: the relay writes a body in the pass that
    -- records the messages naming it, and a pass every few seconds deletes the bodies
    -- no message names (fenced, like every write). Both cost every message's insert.
    body_hash  bytea NOT NULL,
    bytes      integer NOT NULL,
    pass       bigint NOT NULL,   -- the pass that recorded it: confirming it moves the replica's mark here
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (replica, seq)
);

-- What a replica's held rows point at (per-replica tables only): a parent stays on a
-- replica while any row here names it.
CREATE TABLE ferry_sync.points (
    replica        uuid NOT NULL REFERENCES ferry_sync.replicas ON DELETE CASCADE,
    relation       text NOT NULL,   -- the parent
    key            text NOT NULL,
    child_relation text NOT NULL,
    child_key      text NOT NULL,
    PRIMARY KEY (replica, child_relation, child_key, relation, key)
);
CREATE INDEX points_parent ON ferry_sync.points (relation, key, replica);

-- Each replica's latest report up, stored by whichever serve process received it; `n`
-- counts the reports stored. The relay's pass handles a report whose `n` is above the
-- replica's `replicas.handled_n`, and writes only that: a pass (REPEATABLE READ) never
-- updates a row a serve process updates, so a report arriving mid-pass cannot fail the
-- pass with a serialization error; it is handled by the next.
CREATE TABLE ferry_sync.reports (
    replica     uuid PRIMARY KEY REFERENCES ferry_sync.replicas ON DELETE CASCADE,
    up          bytea NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),   -- when it was last heard from
    n           bigint NOT NULL DEFAULT 1
);

-- Rows set aside for one replica: they did not encode, did not fit a message, or the
-- replica refused them. Retried at relay start and on a timer.
CREATE TABLE ferry_sync.quarantine (
    replica   uuid NOT NULL REFERENCES ferry_sync.replicas ON DELETE CASCADE,
    relation  text NOT NULL,
    key       text NOT NULL,
    cause     text NOT NULL CHECK (cause IN ('encode', 'size', 'replica')),
    reason    text NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (replica, relation, key)
);

CREATE INDEX rows_key ON ferry_sync.rows (relation, key);
-- `install` inserts the meta row with a secret from the operating system's random source.

-- The way up (docs/sync-up.md §5). Per replica, how many uploads were filed: written by
-- filing (serve) alone, never by the relay's passes, whose REPEATABLE READ updates of
-- `replicas` a concurrent write would fail. `n` is what each Filed tells the replica; an
-- upload that says more shows this database lost filings (a restore).
CREATE TABLE ferry_sync.filings (
    replica  uuid PRIMARY KEY REFERENCES ferry_sync.replicas ON DELETE CASCADE,
    n        bigint NOT NULL DEFAULT 0,
    before   bigint NOT NULL DEFAULT 0,  -- `n` before the latest filing: the restore check's
    last_id  bigint NOT NULL DEFAULT 0   -- the newest upload filed: an older one is stale
);

-- Rows the database refused to file for a reason a deploy may fix, newest per row;
-- filed again by the relay at start and on its retry timer, and by `ferry sync refile`.
CREATE TABLE ferry_sync.inbox (
    replica   uuid NOT NULL REFERENCES ferry_sync.replicas ON DELETE CASCADE,
    relation  text NOT NULL,          -- 'schema.table' as the rules name it
    key       text NOT NULL,          -- canonical key text
    row       bytea NOT NULL,         -- a body (docs/sync-protocol.md §1.1): one part, one upsert
    reason    text NOT NULL,
    tries     integer NOT NULL DEFAULT 1,
    at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (replica, relation, key)
);

-- Settings and wishes (docs/sync-up.md §7). The setting tables the rules name, written by
-- `install` with the rules' digest: what `wish` checks a wish against.
CREATE TABLE ferry_sync.settings (
    setting   text PRIMARY KEY,       -- the table's name on the replicas
    relation  text NOT NULL,          -- 'schema.table' as the rules name it
    version   text NOT NULL,          -- the integer column each write raises
    desired   text[] NOT NULL,        -- the columns a wish may set
    key_parts integer NOT NULL
);

-- Values the server wishes a replica's setting row to take: one wish per row, a newer one
-- replacing it. It travels to the replica as a two-way table (`ferry_wishes` there): the
-- columns up to `version` are the server's; `answered` to `answered_at` are the
-- replica's answer, for the wish numbered `answered`.
CREATE TABLE ferry_sync.wishes (
    replica     uuid NOT NULL,
    setting     text NOT NULL,        -- the setting table, as the replicas name it
    key         text NOT NULL,        -- the row's key: a JSON array of its values
    wish        bigint NOT NULL,      -- this wish's number; a newer wish of the row has another
    vals        text NOT NULL,        -- a JSON object: desired column to value
    if_version  bigint,               -- carry it out only while the row's version is this
    note        text,
    version     text NOT NULL,        -- the setting's version column, for the replica
    wished_at   timestamptz NOT NULL DEFAULT now(),
    answered    bigint,               -- the wish this answer is for
    outcome     text,                 -- applied | refused | superseded | waiting
    reason      text,
    answered_at bigint,               -- when, in ms since 1970 by the replica's clock
    PRIMARY KEY (replica, setting, key)
);

-- Wishes `vals` (a JSON object of desired columns) onto replica `p_replica`'s row `p_key`
-- (a JSON array of its key values) of setting table `p_setting`, in the caller's
-- transaction; replaces the row's earlier wish. Returns the wish's number.
CREATE FUNCTION ferry_sync.wish(p_replica uuid, p_setting text, p_key jsonb, p_vals jsonb,
                                p_if_version bigint DEFAULT NULL, p_note text DEFAULT NULL)
RETURNS bigint LANGUAGE plpgsql AS $ferry$
DECLARE
    s ferry_sync.settings;
    n bigint := 1 + floor(random() * 4611686018427387903)::bigint;
    c text;
BEGIN
    SELECT * INTO s FROM ferry_sync.settings WHERE setting = p_setting;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ferry_sync.wish: % is not a setting table (the rules name: %)', p_setting,
            coalesce((SELECT string_agg(setting, ', ' ORDER BY setting) FROM ferry_sync.settings), 'none')
            USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(p_key) IS DISTINCT FROM 'array' OR jsonb_array_length(p_key) <> s.key_parts THEN
        RAISE EXCEPTION 'ferry_sync.wish: the key of a % row is a JSON array of % values, not %', p_setting, s.key_parts, p_key
            USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(p_vals) IS DISTINCT FROM 'object' OR p_vals = '{}'::jsonb THEN
        RAISE EXCEPTION 'ferry_sync.wish: the values are a JSON object of desired columns, not %', p_vals
            USING ERRCODE = '22023';
    END IF;
    FOR c IN SELECT jsonb_object_keys(p_vals) LOOP
        IF NOT c = ANY (s.desired) THEN
            RAISE EXCEPTION 'ferry_sync.wish: % is not a desired column of % (desired: %)', c, p_setting, array_to_string(s.desired, ', ')
                USING ERRCODE = '22023';
        END IF;
    END LOOP;
    INSERT INTO ferry_sync.wishes (replica, setting, key, wish, vals, if_version, note, version)
    VALUES (p_replica, p_setting, p_key::text, n, p_vals::text, p_if_version, p_note, s.version)
    ON CONFLICT (replica, setting, key) DO UPDATE
    SET wish = excluded.wish, vals = excluded.vals, if_version = excluded.if_version,
        note = excluded.note, version = excluded.version, wished_at = now();
    RETURN n;
END
$ferry$;

-- Withdraws the wish for a row; true if there was one.
CREATE FUNCTION ferry_sync.withdraw(p_replica uuid, p_setting text, p_key jsonb)
RETURNS boolean LANGUAGE plpgsql AS $ferry$
BEGIN
    DELETE FROM ferry_sync.wishes WHERE replica = p_replica AND setting = p_setting AND key = p_key::text;
    RETURN FOUND;
END
$ferry$;
