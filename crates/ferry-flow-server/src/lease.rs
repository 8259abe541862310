//! The lease table (docs/flow-server.md §5.1): which session holds which shard under
//! which epoch. A pure state machine: the server feeds it what happened with its
//! monotonic time and carries out the [`Action`]s it answers; nothing here does I/O.
//!
//! What it guarantees (and `tests/lease.rs` tries to break):
//! 1. A shard has at most one holder, and its epoch rises with every grant.
//! 2. A shard leaves a holder that did not release it only once its last confirmation
//!    is `lease` old: the holder's own deadline (counted from when it sent that ping,
//!    which is earlier) has passed by then.
//! 3. Only the holder at the current epoch passes [`LeaseTable::check`].

use ferry_flow::remote::proto::{Held, Refused, RevokeReason};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A worker's session: random, kept across its reconnects.
pub type SessionId = u128;

/// The table's settings (docs/flow-server.md §3).
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub shards: u32,
    pub lease: Duration,
    pub stuck_after: Duration,
}

/// What the server does for the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Persist `Epoch { shard, epoch, session }`, then send the grant; if it cannot be
    /// persisted, call [`LeaseTable::grant_failed`].
    Grant {
        session: SessionId,
        shard: u32,
        epoch: u64,
    },
    /// The session re-attached to a shard it held, at the same epoch (nothing to persist).
    Resumed {
        session: SessionId,
        shard: u32,
        epoch: u64,
    },
    /// Tell the session (if connected) the shard is no longer its own.
    Revoke {
        session: SessionId,
        shard: u32,
        epoch: u64,
        reason: RevokeReason,
    },
    /// Ask the session to hand the shard back (rebalance).
    Drain {
        session: SessionId,
        shard: u32,
        epoch: u64,
    },
}

#[derive(Clone, Debug)]
enum Hold {
    Free,
    /// Held by `session`; `draining` since then, if asked to hand it back.
    Held {
        session: SessionId,
        draining: Option<Instant>,
    },
    /// Taken from `session` without its release: nobody may have it before `until`.
    Fenced {
        until: Instant,
    },
}

#[derive(Clone, Debug)]
struct Shard {
    hold: Hold,
    epoch: u64,
    /// When the last ping confirming the holder arrived (or the grant, before any).
    confirmed_at: Instant,
    /// A ping confirmed the holder since its grant (or it was resumed, or held before
    /// a restart): until then the holder acts on nothing of it (docs/flow-server.md
    /// §5.3), so its disconnect frees the shard at once.
    confirmed: bool,
    turns: u64,
    turned_at: Instant,
    /// The session it was last taken from as stuck, or that gave it up (handed it back,
    /// or left it out of a Hello): granted back to it only if no other can take it.
    avoid: Option<SessionId>,
}

#[derive(Clone, Debug)]
struct Session {
    max_shards: u32,
    connected: bool,
    last_ping: Instant,
    /// Connection order, for ties.
    order: u64,
}

/// Which session holds which shard (module doc).
#[derive(Debug)]
pub struct LeaseTable {
    settings: Settings,
    shards: Vec<Shard>,
    sessions: BTreeMap<SessionId, Session>,
    next_order: u64,
}

impl LeaseTable {
    /// A table whose shards are all free, at the epochs `epochs` (from the server's log;
    /// empty: every shard at 0). A shard whose last holder is known (`held_by`) is kept
    /// fenced for `lease` from `now`: that holder may still run it under its deadline,
    /// and may resume it meanwhile (docs/flow-server.md §7).
    pub fn new(
        settings: Settings,
        restored: &[(u64, Option<SessionId>)],
        now: Instant,
    ) -> LeaseTable {
        let shards = (0..settings.shards as usize)
            .map(|i| {
                let (epoch, held_by) = restored.get(i).copied().unwrap_or((0, None));
                Shard {
                    hold: match held_by {
                        Some(session) => Hold::Held {
                            session,
                            draining: None,
                        },
                        None => Hold::Free,
                    },
                    epoch,
                    confirmed_at: now,
                    confirmed: true,
                    turns: 0,
                    turned_at: now,
                    avoid: None,
                }
            })
            .collect();
        LeaseTable {
            settings,
            shards,
            sessions: BTreeMap::new(),
            next_order: 0,
        }
    }

    /// The shard's epoch and holder, if it has one.
    pub fn holder(&self, shard: u32) -> (u64, Option<SessionId>) {
        let s = &self.shards[shard as usize];
        match s.hold {
            Hold::Held { session, .. } => (s.epoch, Some(session)),
            _ => (s.epoch, None),
        }
    }

    /// Every session the table knows: whether it is connected, by id.
    pub fn sessions(&self) -> Vec<(SessionId, bool)> {
        self.sessions
            .iter()
            .map(|(&id, s)| (id, s.connected))
            .collect()
    }

    /// The shards `session` holds, in order.
    pub fn held_by(&self, session: SessionId) -> Vec<Held> {
        self.shards
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s.hold, Hold::Held { session: h, .. } if h == session))
            .map(|(i, s)| Held {
                shard: i as u32,
                epoch: s.epoch,
            })
            .collect()
    }

    /// A session (re)connects, asking for at most `max_shards` (0: all) and naming the
    /// shards it still runs. Those it holds at that epoch are resumed; those it names and
    /// does not hold it must stop (no action: the `Welcome` does not list them); those it
    /// holds and does not name are fenced until a lease after their last confirmation
    /// (a Hello can be older than the session's newest). Then free shards are granted.
    pub fn connect(
        &mut self,
        session: SessionId,
        max_shards: u32,
        resume: &[(u32, u64)],
        now: Instant,
    ) -> Vec<Action> {
        let order = self.next_order;
        self.next_order += 1;
        let s = self.sessions.entry(session).or_insert(Session {
            max_shards,
            connected: true,
            last_ping: now,
            order,
        });
        s.max_shards = max_shards;
        s.connected = true;
        s.last_ping = now;
        let mut actions = Vec::new();
        for (i, shard) in self.shards.iter_mut().enumerate() {
            let Hold::Held { session: h, .. } = shard.hold else {
                continue;
            };
            if h != session {
                continue;
            }
            let epoch = shard.epoch;
            if resume.contains(&(i as u32, epoch)) {
                shard.confirmed_at = now;
                shard.confirmed = true;
                shard.turned_at = now;
                actions.push(Action::Resumed {
                    session,
                    shard: i as u32,
                    epoch,
                });
            } else {
                // Not named: the worker stopped it, or this Hello is older than one it
                // sent since (and still runs the shard under). Either way nobody else
                // may have it before its last confirmation is a lease old.
                let until = shard.confirmed_at + self.settings.lease;
                shard.hold = if now >= until {
                    Hold::Free
                } else {
                    Hold::Fenced { until }
                };
                // It gave the shard up: another worker first.
                shard.avoid = Some(session);
            }
        }
        actions.extend(self.assign(now));
        actions.extend(self.rebalance(now));
        actions
    }

    /// The session's connection closed: it keeps the shards a ping confirmed until its
    /// lease runs out, for a resume; the others are granted elsewhere now.
    pub fn disconnect(&mut self, session: SessionId, now: Instant) -> Vec<Action> {
        if let Some(s) = self.sessions.get_mut(&session) {
            s.connected = false;
        }
        // A grant no ping confirmed was never acted on: free at once, for another
        // session (a worker that closed as the grant came, or died before its first
        // ping, would otherwise keep it for a lease).
        for shard in &mut self.shards {
            if matches!(shard.hold, Hold::Held { session: h, .. } if h == session)
                && !shard.confirmed
            {
                shard.hold = Hold::Free;
                shard.avoid = Some(session);
            }
        }
        self.assign(now)
    }

    /// A ping arrived: `turns` lists (shard, epoch, turn count). Answers the shards it
    /// confirms, for the `Pong`.
    pub fn ping(
        &mut self,
        session: SessionId,
        turns: &[(u32, u64, u64)],
        now: Instant,
    ) -> Vec<Held> {
        let Some(s) = self.sessions.get_mut(&session) else {
            return Vec::new();
        };
        s.last_ping = now;
        let mut confirmed = Vec::new();
        for &(shard, epoch, count) in turns {
            let Some(sh) = self.shards.get_mut(shard as usize) else {
                continue;
            };
            if !matches!(sh.hold, Hold::Held { session: h, .. } if h == session)
                || sh.epoch != epoch
            {
                continue;
            }
            sh.confirmed_at = now;
            sh.confirmed = true;
            if count != sh.turns {
                sh.turns = count;
                sh.turned_at = now;
            }
            confirmed.push(Held { shard, epoch });
        }
        confirmed
    }

    /// Whether `session` may act on `shard` at `epoch` (an append, a release, a page
    /// read): the fence of docs/flow-server.md §5.2.
    pub fn check(&self, session: SessionId, shard: u32, epoch: u64) -> Result<(), Refused> {
        let Some(s) = self.shards.get(shard as usize) else {
            return Err(Refused::NotHeld { shard });
        };
        if s.epoch != epoch {
            return Err(Refused::Stale {
                shard,
                held: s.epoch,
            });
        }
        match s.hold {
            Hold::Held { session: h, .. } if h == session => Ok(()),
            _ => Err(Refused::NotHeld { shard }),
        }
    }

    /// The holder hands the shard back (a drain, a SIGTERM): free at once, and granted.
    pub fn release(
        &mut self,
        session: SessionId,
        shard: u32,
        epoch: u64,
        now: Instant,
    ) -> Result<Vec<Action>, Refused> {
        self.check(session, shard, epoch)?;
        let s = &mut self.shards[shard as usize];
        s.hold = Hold::Free;
        s.avoid = Some(session);
        let mut actions = self.assign(now);
        actions.extend(self.rebalance(now));
        Ok(actions)
    }

    /// The `Epoch` record of a grant could not be persisted: the shard is free again
    /// (its epoch stays raised; the next grant raises it further).
    pub fn grant_failed(&mut self, shard: u32) {
        self.shards[shard as usize].hold = Hold::Free;
    }

    /// Time passes: leases run out, stuck shards are revoked, drains past their time
    /// are revoked, fenced shards come free, free shards are granted.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        let lease = self.settings.lease;
        let mut actions = Vec::new();
        let expired: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.last_ping) >= lease)
            .map(|(&id, _)| id)
            .collect();
        for (i, shard) in self.shards.iter_mut().enumerate() {
            let shard_no = i as u32;
            match shard.hold {
                Hold::Held { session, draining } => {
                    let connected = self.sessions.get(&session).is_some_and(|s| s.connected);
                    let reason = if expired.contains(&session)
                        || !self.sessions.contains_key(&session)
                    {
                        // Silent for a lease (or a holder from before a restart that
                        // never came back): its deadline has passed.
                        if now.saturating_duration_since(shard.confirmed_at) >= lease {
                            Some(RevokeReason::Expired)
                        } else {
                            None
                        }
                    } else if now.saturating_duration_since(shard.turned_at)
                        >= self.settings.stuck_after
                    {
                        Some(RevokeReason::Stuck)
                    } else if draining.is_some_and(|at| now.saturating_duration_since(at) >= lease)
                    {
                        Some(RevokeReason::Rebalance)
                    } else {
                        None
                    };
                    if let Some(reason) = reason {
                        if reason == RevokeReason::Stuck {
                            shard.avoid = Some(session);
                        }
                        if connected {
                            actions.push(Action::Revoke {
                                session,
                                shard: shard_no,
                                epoch: shard.epoch,
                                reason,
                            });
                        }
                        let until = shard.confirmed_at + lease;
                        shard.hold = if now >= until {
                            Hold::Free
                        } else {
                            Hold::Fenced { until }
                        };
                    }
                }
                Hold::Fenced { until } if now >= until => shard.hold = Hold::Free,
                _ => {}
            }
        }
        // A silent session that is gone is forgotten once it holds nothing; one still
        // connected stays, and is granted nothing until it pings again (`eligible`).
        for id in expired {
            let held = self.count(id) > 0;
            if !held && !self.sessions[&id].connected {
                self.sessions.remove(&id);
            }
        }
        actions.extend(self.assign(now));
        actions.extend(self.rebalance(now));
        actions
    }

    fn count(&self, session: SessionId) -> usize {
        self.shards
            .iter()
            .filter(|s| matches!(s.hold, Hold::Held { session: h, .. } if h == session))
            .count()
    }

    /// Whether `s` may be granted shards: connected, and heard from within a lease.
    fn eligible(&self, s: &Session, now: Instant) -> bool {
        s.connected && now.saturating_duration_since(s.last_ping) < self.settings.lease
    }

    fn cap(&self, s: &Session) -> usize {
        match s.max_shards {
            0 => self.shards.len(),
            n => (n as usize).min(self.shards.len()),
        }
    }

    /// Every free shard to the connected session holding the fewest, below its cap (the one
    /// it was taken from as stuck, or that handed it back, last of all).
    fn assign(&mut self, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        for i in 0..self.shards.len() {
            if !matches!(self.shards[i].hold, Hold::Free) {
                continue;
            }
            let avoid = self.shards[i].avoid;
            let taker = self
                .sessions
                .iter()
                .filter(|(_, s)| self.eligible(s, now))
                .map(|(&id, s)| (Some(id) == avoid, self.count(id), s.order, id, self.cap(s)))
                .filter(|&(_, held, _, _, cap)| held < cap)
                .min();
            let Some((_, _, _, session, _)) = taker else {
                continue;
            };
            let shard = &mut self.shards[i];
            shard.epoch += 1;
            shard.hold = Hold::Held {
                session,
                draining: None,
            };
            shard.confirmed_at = now;
            shard.confirmed = false;
            shard.turned_at = now;
            if shard.avoid != Some(session) {
                shard.avoid = None;
            }
            actions.push(Action::Grant {
                session,
                shard: i as u32,
                epoch: shard.epoch,
            });
        }
        actions
    }

    /// Each connected session above its fair share is asked to hand one shard back, if
    /// another connected session below its share could take it.
    fn rebalance(&mut self, now: Instant) -> Vec<Action> {
        let connected: Vec<(SessionId, usize)> = self
            .sessions
            .iter()
            .filter(|(_, s)| self.eligible(s, now))
            .map(|(&id, s)| (id, self.cap(s)))
            .collect();
        if connected.len() < 2 {
            return Vec::new();
        }
        let fair = self.shards.len().div_ceil(connected.len());
        let room = connected
            .iter()
            .any(|&(id, cap)| self.count(id) < fair.min(cap));
        if !room {
            return Vec::new();
        }
        let mut actions = Vec::new();
        for &(id, _) in &connected {
            let draining = self.shards.iter().any(
                |s| matches!(s.hold, Hold::Held { session, draining: Some(_) } if session == id),
            );
            if draining || self.count(id) <= fair {
                continue;
            }
            // Its highest-numbered shard.
            if let Some((i, shard)) = self
                .shards
                .iter_mut()
                .enumerate()
                .rev()
                .find(|(_, s)| matches!(s.hold, Hold::Held { session, .. } if session == id))
            {
                shard.hold = Hold::Held {
                    session: id,
                    draining: Some(now),
                };
                actions.push(Action::Drain {
                    session: id,
                    shard: i as u32,
                    epoch: shard.epoch,
                });
            }
        }
        actions
    }
}
