//! Epochs and fencing. An epoch is a fencing token: it only rises, and a holder of an
//! older epoch must not change anything. Comparing is a value, not an error, because a
//! fenced writer is an outcome callers handle (stop, report), not a failure to retry.

use serde::{Deserialize, Serialize};

/// A fencing token. Epoch 0 is the first; promotion raises it by one.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Epoch(pub u64);

impl Epoch {
    pub fn next(self) -> Epoch {
        Epoch(
            self.0
                .checked_add(1)
                .expect("an epoch never reaches u64::MAX: it rises once per promotion"),
        )
    }
}

impl std::fmt::Display for Epoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// How a request's epoch compares with the epoch a store holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// Same epoch: go ahead.
    Current,
    /// The request is older than the store: it is fenced and must change nothing.
    Stale { held: Epoch },
    /// The request is newer: the store must be re-seeded under the new epoch first.
    Newer { held: Epoch },
}

impl Fence {
    pub fn check(request: Epoch, held: Epoch) -> Fence {
        match request.cmp(&held) {
            std::cmp::Ordering::Equal => Fence::Current,
            std::cmp::Ordering::Less => Fence::Stale { held },
            std::cmp::Ordering::Greater => Fence::Newer { held },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_epoch_is_stale() {
        assert_eq!(
            Fence::check(Epoch(1), Epoch(2)),
            Fence::Stale { held: Epoch(2) }
        );
        assert_eq!(Fence::check(Epoch(2), Epoch(2)), Fence::Current);
        assert_eq!(
            Fence::check(Epoch(3), Epoch(2)),
            Fence::Newer { held: Epoch(2) }
        );
        assert_eq!(Epoch(2).next(), Epoch(3));
    }
}
