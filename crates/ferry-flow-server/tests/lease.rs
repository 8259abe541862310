//! The lease table as a pure unit (docs/flow-server.md §5.1; T9): grants, standbys and
//! caps, expiry, stuck shards, drains, resumes, a restarted server's grace, the fence,
//! and a random walk of three workers that checks, at every grant, that no other worker
//! could still believe it holds the shard.

use ferry_core::seams::{Rng, SplitMix64};
use ferry_flow::remote::proto::{Held, Refused, RevokeReason};
use ferry_flow_server::lease::{Action, LeaseTable, SessionId, Settings};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(5);
const STUCK: Duration = Duration::from_secs(10);

fn settings(shards: u32) -> Settings {
    Settings {
        shards,
        lease: LEASE,
        stuck_after: STUCK,
    }
}

fn grants(actions: &[Action]) -> Vec<(SessionId, u32, u64)> {
    actions
        .iter()
        .filter_map(|a| match *a {
            Action::Grant {
                session,
                shard,
                epoch,
            } => Some((session, shard, epoch)),
            _ => None,
        })
        .collect()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Guards §5.1 (grant, caps, standbys, rebalance by drain and release).
#[test]
fn the_first_worker_takes_every_shard_and_a_second_is_handed_half_by_drains() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(settings(4), &[], t0);
    let a = table.connect(1, 0, &[], t0);
    assert_eq!(
        grants(&a),
        vec![(1, 0, 1), (1, 1, 1), (1, 2, 1), (1, 3, 1)],
        "every shard at epoch 1"
    );
    // A second worker with room: the first is asked to drain one shard at a time.
    let b = table.connect(2, 0, &[], t0 + ms(10));
    assert_eq!(
        b,
        vec![Action::Drain {
            session: 1,
            shard: 3,
            epoch: 1
        }]
    );
    let r = table.release(1, 3, 1, t0 + ms(20)).unwrap();
    assert_eq!(
        grants(&r),
        vec![(2, 3, 2)],
        "the released shard, at the next epoch"
    );
    assert!(matches!(
        r.last(),
        Some(Action::Drain {
            session: 1,
            shard: 2,
            ..
        })
    ));
    let r = table.release(1, 2, 1, t0 + ms(30)).unwrap();
    assert_eq!(grants(&r), vec![(2, 2, 2)]);
    assert_eq!(r.len(), 1, "two each: nothing more to move");
    assert_eq!(table.held_by(1).len(), 2);
    assert_eq!(table.held_by(2).len(), 2);
}

/// Guards §5.1 (`max_shards`): a worker takes no more than it asked; one at its cap is a
/// standby, and is not asked to take more by a drain.
#[test]
fn a_worker_holds_no_more_than_it_asked_and_the_rest_stand_by() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(settings(4), &[], t0);
    assert_eq!(grants(&table.connect(1, 3, &[], t0)).len(), 3);
    // A second worker: the first, above its fair share (2), is asked to hand one back.
    assert_eq!(
        table.connect(2, 3, &[], t0),
        vec![
            Action::Grant {
                session: 2,
                shard: 3,
                epoch: 1
            },
            Action::Drain {
                session: 1,
                shard: 2,
                epoch: 1
            }
        ]
    );
    // A third, which asks for one: no second drain while the first is pending.
    assert!(table.connect(3, 1, &[], t0).is_empty());
    // The drained shard goes to the worker holding the fewest.
    let r = table.release(1, 2, 1, t0).unwrap();
    assert_eq!(grants(&r), vec![(3, 2, 2)]);
    assert_eq!(r.len(), 1);
    assert!(
        table.tick(t0 + ms(100)).is_empty(),
        "balanced within the caps"
    );
}

/// Guards guarantee 2 and §5.1 (expiry): a silent worker loses its shards a lease after
/// its last ping, they go to the standby at the next epoch, and the old holder is fenced.
#[test]
fn a_silent_worker_loses_its_shards_after_a_lease_to_the_standby() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(settings(2), &[], t0);
    table.connect(1, 0, &[], t0);
    table.connect(2, 0, &[], t0);
    // Worker 2 is a standby only once worker 1 keeps its two: let it drain nothing by
    // releasing at once what it was asked, then re-balance never moves more.
    let keep_alive = |table: &mut LeaseTable, t| {
        table.ping(2, &[], t);
    };
    let mut now = t0;
    for _ in 0..4 {
        now += ms(1000);
        table.ping(1, &[(0, 1, 7), (1, 1, 7)], now);
        keep_alive(&mut table, now);
        assert!(grants(&table.tick(now)).is_empty());
    }
    // Worker 1 falls silent at `now`; worker 2 keeps pinging.
    let silent_from = now;
    let mut moved = Vec::new();
    while moved.is_empty() {
        now += ms(250);
        keep_alive(&mut table, now);
        let actions = table.tick(now);
        moved = grants(&actions);
        if !moved.is_empty() {
            assert!(actions.iter().any(|a| matches!(
                a,
                Action::Revoke {
                    session: 1,
                    reason: RevokeReason::Expired,
                    ..
                }
            )));
        }
    }
    assert_eq!(now - silent_from, LEASE);
    assert_eq!(moved.len(), 2);
    assert!(moved.iter().all(|&(s, _, e)| s == 2 && e >= 2));
    assert!(matches!(
        table.check(1, 0, 1),
        Err(Refused::Stale { shard: 0, .. })
    ));
    // Worker 1 wakes and pings: nothing is confirmed, so it stops both shards.
    assert!(table.ping(1, &[(0, 1, 8), (1, 1, 8)], now).is_empty());
}

/// Guards guarantee 3 and §5.1 (stuck): a shard whose turns stand still is revoked after
/// `stuck_after` though pings flow, and granted elsewhere only a lease after its last
/// confirmation.
#[test]
fn a_stuck_shard_is_revoked_and_granted_elsewhere_a_lease_later() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(settings(1), &[], t0);
    table.connect(1, 0, &[], t0);
    table.connect(2, 0, &[], t0);
    let mut now = t0;
    let mut revoked_at = None;
    let mut granted_at = None;
    for step in 1..=80u64 {
        now = t0 + ms(250 * step);
        // Worker 1 pings every 250 ms, but shard 0's turn count never moves.
        let confirmed = table.ping(1, &[(0, 1, 3)], now);
        table.ping(2, &[], now);
        let actions = table.tick(now);
        if actions.iter().any(|a| {
            matches!(
                a,
                Action::Revoke {
                    session: 1,
                    shard: 0,
                    reason: RevokeReason::Stuck,
                    ..
                }
            )
        }) {
            revoked_at = Some(now);
        }
        if let Some(at) = revoked_at
            && now > at
        {
            assert!(
                confirmed.is_empty(),
                "a revoked shard is not confirmed again"
            );
        }
        if let Some(&(2, 0, 2)) = grants(&actions).first() {
            granted_at = Some(now);
            break;
        }
    }
    let revoked_at = revoked_at.expect("revoked as stuck");
    let granted_at = granted_at.expect("granted to the other worker");
    assert!(revoked_at - t0 >= STUCK && revoked_at - t0 < STUCK + ms(500));
    // The last ping that confirmed shard 0 arrived at the tick before the revoke.
    assert!(
        granted_at - revoked_at >= LEASE - ms(250),
        "{:?}",
        granted_at - revoked_at
    );
    assert!(granted_at - revoked_at <= LEASE);
    assert!(now.duration_since(t0) > STUCK);
}

/// Guards guarantee 5 and §8.1: a worker that reconnects within its lease resumes its
/// shards at the same epochs; one that comes back later finds them granted elsewhere.
#[test]
fn a_worker_that_reconnects_within_its_lease_resumes_at_the_same_epochs() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(settings(2), &[], t0);
    table.connect(1, 0, &[], t0);
    table.ping(1, &[(0, 1, 1), (1, 1, 1)], t0 + ms(100));
    assert!(grants(&table.disconnect(1, t0 + ms(150))).is_empty());
    table.connect(2, 0, &[], t0 + ms(200)); // a standby, present all along
    let mut now = t0 + ms(200);
    while now < t0 + ms(3000) {
        now += ms(250);
        table.ping(2, &[], now);
        assert!(grants(&table.tick(now)).is_empty(), "held for the resume");
    }
    let back = table.connect(1, 0, &[(0, 1), (1, 1)], now);
    assert_eq!(
        back[..2],
        [
            Action::Resumed {
                session: 1,
                shard: 0,
                epoch: 1
            },
            Action::Resumed {
                session: 1,
                shard: 1,
                epoch: 1
            }
        ]
    );
    assert_eq!(table.check(1, 0, 1), Ok(()));

    // Now it goes away for longer than a lease: its shards move, and a late resume
    // gets nothing back.
    table.disconnect(1, now);
    let gone = now;
    while now < gone + LEASE + ms(500) {
        now += ms(250);
        table.ping(2, &[(0, 2, 1), (1, 2, 1)], now);
        table.tick(now);
    }
    assert_eq!(table.holder(0), (2, Some(2)));
    let late = table.connect(1, 0, &[(0, 1), (1, 1)], now);
    assert!(!late.iter().any(|a| matches!(a, Action::Resumed { .. })));
}

/// Guards §7: a restarted server keeps each shard for its last holder for a lease (it may
/// still be running it), lets that holder resume, and grants the rest after the lease.
#[test]
fn a_restarted_server_waits_a_lease_for_the_last_holders() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(settings(3), &[(4, Some(1)), (9, Some(2)), (2, None)], t0);
    // A new worker arrives at once: it gets only the shard nobody held.
    assert_eq!(grants(&table.connect(3, 0, &[], t0)), vec![(3, 2, 3)]);
    // Worker 1 comes back and resumes shard 0 at epoch 4.
    let r = table.connect(1, 0, &[(0, 4)], t0 + ms(500));
    assert_eq!(
        r[0],
        Action::Resumed {
            session: 1,
            shard: 0,
            epoch: 4
        }
    );
    // Worker 2 never comes back: shard 1 is granted once a lease has passed, at epoch 10.
    let mut now = t0;
    let mut got = Vec::new();
    while got.is_empty() {
        now += ms(250);
        table.ping(1, &[(0, 4, 1)], now);
        table.ping(3, &[(2, 3, 1)], now);
        got = grants(&table.tick(now));
    }
    assert_eq!(now - t0, LEASE);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].1, got[0].2), (1, 10));
}

/// Guards §5.2: the fence says which epoch holds, and tells another session apart.
#[test]
fn the_fence_refuses_other_epochs_as_stale_and_other_sessions_as_not_held() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(settings(1), &[(6, None)], t0);
    table.connect(1, 0, &[], t0);
    assert_eq!(table.check(1, 0, 7), Ok(()));
    assert_eq!(
        table.check(1, 0, 6),
        Err(Refused::Stale { shard: 0, held: 7 })
    );
    assert_eq!(table.check(2, 0, 7), Err(Refused::NotHeld { shard: 0 }));
    assert_eq!(table.check(1, 5, 7), Err(Refused::NotHeld { shard: 5 }));
    assert_eq!(
        table.release(2, 0, 7, t0),
        Err(Refused::NotHeld { shard: 0 })
    );
    // A grant whose epoch could not be persisted frees the shard; the next grant goes
    // higher still.
    table.grant_failed(0);
    assert_eq!(grants(&table.tick(t0 + ms(1))), vec![(1, 0, 8)]);
}

/// What one simulated worker believes.
#[derive(Default)]
struct Worker {
    connected: bool,
    /// shard → (epoch, deadline once confirmed).
    holds: BTreeMap<u32, (u64, Option<Instant>)>,
    turns: u64,
}

/// T9's walk: three workers connect, ping (with pings delayed up to 200 ms on the way),
/// fall silent, drop, resume, release and wedge shards, while Revokes may be lost. At
/// every grant no other worker may hold the shard with a deadline still ahead (guarantee
/// 2), and epochs only rise.
#[test]
fn no_grant_ever_finds_another_worker_still_holding_the_shard() {
    for seed in 0..40 {
        walk(seed);
    }
}

fn walk(seed: u64) {
    let mut rng = SplitMix64::seeded(seed);
    let shards = 1 + rng.below(6) as u32;
    let t0 = Instant::now();
    let mut table = LeaseTable::new(settings(shards), &[], t0);
    let mut workers: BTreeMap<SessionId, Worker> =
        (1..=3).map(|i| (i, Worker::default())).collect();
    let mut epochs = vec![0u64; shards as usize];
    let mut now = t0;
    let mut granted = 0;
    for _ in 0..3_000 {
        now += ms(rng.below(400));
        let id = 1 + rng.below(3) as SessionId;
        let mut actions = Vec::new();
        match rng.below(10) {
            0 => {
                let w = workers.get_mut(&id).unwrap();
                // A worker resumes what it holds with a deadline still ahead; the rest it
                // has stopped.
                w.holds.retain(|_, (_, d)| d.is_some_and(|d| d > now));
                let resume: Vec<(u32, u64)> = w.holds.iter().map(|(&s, &(e, _))| (s, e)).collect();
                w.connected = true;
                actions = table.connect(id, rng.below(3) as u32, &resume, now);
                // Resumed shards are confirmed as of now; the others are dropped.
                let resumed: Vec<(u32, u64)> = actions
                    .iter()
                    .filter_map(|a| match *a {
                        Action::Resumed {
                            session,
                            shard,
                            epoch,
                        } if session == id => Some((shard, epoch)),
                        _ => None,
                    })
                    .collect();
                w.holds.retain(|s, (e, _)| resumed.contains(&(*s, *e)));
                for (_, d) in w.holds.values_mut() {
                    *d = Some(now + LEASE);
                }
            }
            1 => {
                let w = workers.get_mut(&id).unwrap();
                w.connected = false;
                actions = table.disconnect(id, now);
            }
            2..=6 => {
                let w = workers.get_mut(&id).unwrap();
                if w.connected {
                    let delay = ms(rng.below(200));
                    let sent = now - delay.min(now - t0);
                    if rng.below(8) != 0 {
                        w.turns += 1; // a wedged shard thread now and then
                    }
                    let turns: Vec<(u32, u64, u64)> = w
                        .holds
                        .iter()
                        .map(|(&s, &(e, _))| (s, e, w.turns))
                        .collect();
                    let confirmed: Vec<Held> = table.ping(id, &turns, now);
                    // Confirmed shards extend their deadline from the send; the others stop.
                    w.holds.retain(|&s, (e, d)| {
                        if confirmed.contains(&Held {
                            shard: s,
                            epoch: *e,
                        }) {
                            *d = Some(sent + LEASE);
                            true
                        } else {
                            false
                        }
                    });
                }
            }
            7 => {
                // Release one shard (a drain or a SIGTERM).
                let w = workers.get_mut(&id).unwrap();
                if let Some((&s, &(e, _))) = w.holds.iter().next()
                    && w.connected
                {
                    w.holds.remove(&s);
                    if let Ok(a) = table.release(id, s, e, now) {
                        actions = a;
                    }
                }
            }
            _ => actions = table.tick(now),
        }
        for a in actions {
            match a {
                Action::Grant {
                    session,
                    shard,
                    epoch,
                } => {
                    granted += 1;
                    assert!(
                        epoch > epochs[shard as usize],
                        "seed {seed}: epochs only rise"
                    );
                    epochs[shard as usize] = epoch;
                    for (&other, w) in &workers {
                        if other == session {
                            continue;
                        }
                        if let Some(&(_, Some(deadline))) = w.holds.get(&shard) {
                            assert!(
                                deadline <= now,
                                "seed {seed}: shard {shard} granted to {session} at epoch \
                                 {epoch} while worker {other} may run it for {:?} more",
                                deadline - now
                            );
                        }
                    }
                    let w = workers.get_mut(&session).unwrap();
                    assert!(w.connected);
                    w.holds.insert(shard, (epoch, None));
                }
                Action::Revoke { session, shard, .. } => {
                    // Lost on the way now and then: the deadline must do.
                    if rng.below(2) == 0 {
                        workers.get_mut(&session).unwrap().holds.remove(&shard);
                    }
                }
                Action::Drain { .. } | Action::Resumed { .. } => {}
            }
        }
        // At most one holder per shard, as the table sees it.
        for s in 0..shards {
            let (epoch, holder) = table.holder(s);
            assert_eq!(epoch, epochs[s as usize].max(epoch));
            if let Some(h) = holder {
                assert_eq!(table.check(h, s, epoch), Ok(()));
            }
        }
    }
    assert!(
        granted > 10,
        "seed {seed}: the walk granted only {granted} times"
    );
}

/// Guards §5.1's disconnect: a grant no ping confirmed was never acted on (the worker
/// starts a grant's runs only once confirmed), so when its session's connection closes
/// the shard goes to another session at once, not a lease later; a confirmed one waits
/// for the resume.
#[test]
fn a_grant_never_confirmed_is_granted_elsewhere_as_its_session_disconnects() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(settings(2), &[], t0);
    table.connect(1, 0, &[], t0);
    table.connect(2, 1, &[], t0);
    // Session 1 confirms shard 0 only; shard 1 was granted to it, never confirmed.
    let (h0, h1) = (table.holder(0), table.holder(1));
    assert_eq!(
        (h0.1, h1.1),
        (Some(1), Some(1)),
        "both went to the first session"
    );
    table.ping(1, &[(0, h0.0, 1)], t0 + ms(10));
    table.ping(2, &[], t0 + ms(10));
    let moved = grants(&table.disconnect(1, t0 + ms(20)));
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert_eq!(
        table.holder(1).1,
        Some(2),
        "the unconfirmed shard moved at once"
    );
    assert_eq!(
        table.holder(0).1,
        Some(1),
        "the confirmed one waits for a resume"
    );
}
