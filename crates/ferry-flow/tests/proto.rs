//! Server mode's frame codec (docs/flow-server.md §4; T9's decode fuzz): every frame
//! round-trips, the layout is the one the doc gives, and bytes that are not a frame are
//! refused by name, without a panic and without allocating what a length announces.

use ferry_core::seams::{Rng, SplitMix64};
use ferry_flow::remote::proto::*;
use ferry_flow::{Class, Classify};

fn text(rng: &mut SplitMix64, most: u64) -> String {
    let n = rng.below(most + 1) as usize;
    (0..n)
        .map(|_| ['a', 'é', '/', '0', ' ', '字'][rng.below(6) as usize])
        .collect()
}

fn bytes(rng: &mut SplitMix64, most: u64) -> Vec<u8> {
    let n = rng.below(most + 1) as usize;
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

fn records(rng: &mut SplitMix64) -> Vec<Rec> {
    (0..rng.below(4))
        .map(|_| Rec {
            kind: rng.next_u64() as u8,
            bytes: bytes(rng, 40),
        })
        .collect()
}

fn granted(rng: &mut SplitMix64) -> Vec<Granted> {
    (0..rng.below(4))
        .map(|_| Granted {
            shard: rng.next_u64() as u32,
            epoch: rng.next_u64(),
            checkpoint: rng.next_u64(),
            end: rng.next_u64(),
        })
        .collect()
}

fn refused(rng: &mut SplitMix64) -> Refused {
    match rng.below(9) {
        0 => Refused::Stale {
            shard: rng.next_u64() as u32,
            held: rng.next_u64(),
        },
        1 => Refused::NotHeld {
            shard: rng.next_u64() as u32,
        },
        2 => Refused::PositionGap {
            shard: rng.next_u64() as u32,
            expected: rng.next_u64(),
        },
        3 => Refused::Malformed {
            what: text(rng, 20),
        },
        4 => Refused::TooLarge {
            limit: rng.next_u64(),
        },
        5 => Refused::Unauthorized,
        6 => Refused::Version {
            supported: rng.next_u64() as u16,
        },
        7 => Refused::Unavailable {
            retry_after_ms: rng.next_u64() as u32,
        },
        _ => Refused::NoHolder {
            shard: rng.next_u64() as u32,
        },
    }
}

/// A frame of every type, with fields drawn from `rng`.
fn any_frame(rng: &mut SplitMix64, ty: u64) -> Frame {
    let shard = rng.next_u64() as u32;
    let epoch = rng.next_u64();
    let body = match ty % 19 {
        0 => Body::Hello(Hello {
            version: rng.next_u64() as u16,
            role: if rng.below(2) == 0 {
                Role::Worker
            } else {
                Role::Client
            },
            session: (u128::from(rng.next_u64()) << 64) | u128::from(rng.next_u64()),
            max_shards: rng.next_u64() as u32,
            token: text(rng, 30),
            resume: (0..rng.below(3))
                .map(|_| Resume {
                    shard: rng.next_u64() as u32,
                    epoch: rng.next_u64(),
                    acked: rng.next_u64(),
                })
                .collect(),
            name: text(rng, 12),
        }),
        1 => Body::Ping(
            (0..rng.below(4))
                .map(|_| Turns {
                    shard: rng.next_u64() as u32,
                    epoch: rng.next_u64(),
                    turns: rng.next_u64(),
                })
                .collect(),
        ),
        2 => Body::Append(Append {
            shard,
            epoch,
            first: rng.next_u64(),
            records: records(rng),
        }),
        3 => Body::Release {
            shard,
            epoch,
            end: rng.next_u64(),
        },
        4 => Body::Recover {
            shard,
            epoch,
            from: rng.next_u64(),
            max_bytes: rng.next_u64() as u32,
        },
        5 => Body::Call(Call {
            kind: match rng.below(5) {
                0 => CallKind::Start {
                    workflow: text(rng, 10),
                    id: text(rng, 10),
                    input: bytes(rng, 20),
                },
                1 => CallKind::Signal {
                    id: text(rng, 10),
                    name: text(rng, 10),
                    value: bytes(rng, 20),
                },
                2 => CallKind::Cancel { id: text(rng, 10) },
                3 => CallKind::Query { id: text(rng, 10) },
                _ => CallKind::Result {
                    id: text(rng, 10),
                    wait_ms: rng.next_u64() as u32,
                },
            },
            key: text(rng, 10),
        }),
        6 => Body::Answer {
            call: rng.next_u64(),
            outcome: if rng.below(2) == 0 {
                Outcome::Ok(bytes(rng, 20))
            } else {
                Outcome::Err {
                    kind: text(rng, 8),
                    message: text(rng, 20),
                }
            },
        },
        7 => Body::Welcome(Welcome {
            version: rng.next_u64() as u16,
            session: u128::from(rng.next_u64()),
            shards: rng.next_u64() as u32,
            lease_ms: rng.next_u64() as u32,
            ping_ms: rng.next_u64() as u32,
            stuck_ms: rng.next_u64() as u32,
            record_max: rng.next_u64() as u32,
            grants: granted(rng),
        }),
        8 => Body::Pong(
            (0..rng.below(4))
                .map(|_| Held {
                    shard: rng.next_u64() as u32,
                    epoch: rng.next_u64(),
                })
                .collect(),
        ),
        9 => Body::Grant(granted(rng)),
        10 => Body::Revoke {
            shard,
            epoch,
            reason: [
                RevokeReason::Expired,
                RevokeReason::Stuck,
                RevokeReason::Rebalance,
            ][rng.below(3) as usize],
        },
        11 => Body::Drain { shard, epoch },
        12 => Body::Durable(
            (0..rng.below(4))
                .map(|_| ShardPos {
                    shard: rng.next_u64() as u32,
                    epoch: rng.next_u64(),
                    position: rng.next_u64(),
                })
                .collect(),
        ),
        13 => Body::Records(Records {
            shard,
            epoch,
            first: rng.next_u64(),
            records: records(rng),
            last: rng.below(2) == 0,
        }),
        14 => Body::Released { shard, epoch },
        15 => Body::Fetch {
            shard,
            epoch,
            position: rng.next_u64(),
            offset: rng.next_u64(),
            max_bytes: rng.next_u64() as u32,
        },
        16 => Body::Checkpoint {
            shard,
            epoch,
            position: rng.next_u64(),
            offset: rng.next_u64(),
            bytes: bytes(rng, 40),
            last: rng.below(2) == 0,
        },
        17 => Body::Parked {
            shard,
            epoch,
            run: text(rng, 20),
            reason: text(rng, 40),
        },
        _ => Body::Refused {
            to: rng.next_u64(),
            refused: refused(rng),
        },
    };
    Frame {
        id: rng.next_u64(),
        body,
    }
}

/// Guards §4.1 and §4.2: every frame decodes to what was encoded, whole.
#[test]
fn every_frame_round_trips() {
    let mut rng = SplitMix64::seeded(1);
    for i in 0..4_000 {
        let frame = any_frame(&mut rng, i);
        let bytes = encode(&frame);
        assert_eq!(frame_len(&bytes).unwrap(), Some(bytes.len()), "{frame:?}");
        assert_eq!(decode(&bytes).unwrap(), frame);
    }
}

/// Guards the layout §4.1 gives, byte for byte, for two frames worked out by hand.
#[test]
fn the_layout_is_the_documented_one() {
    let pong = encode(&Frame {
        id: 7,
        body: Body::Pong(vec![]),
    });
    assert_eq!(pong, [0, 0, 0, 13, 65, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0]);
    let append = encode(&Frame {
        id: 2,
        body: Body::Append(Append {
            shard: 3,
            epoch: 4,
            first: 5,
            records: vec![Rec {
                kind: 1,
                bytes: b"ab".to_vec(),
            }],
        }),
    });
    let mut want = vec![0, 0, 0, 40, 3, 0, 0, 0, 0, 0, 0, 0, 2];
    want.extend_from_slice(&3u32.to_be_bytes());
    want.extend_from_slice(&4u64.to_be_bytes());
    want.extend_from_slice(&5u64.to_be_bytes());
    want.extend_from_slice(&1u32.to_be_bytes()); // one record
    want.push(1); // its kind
    want.extend_from_slice(&2u32.to_be_bytes());
    want.extend_from_slice(b"ab");
    assert_eq!(append, want);
}

/// Guards §4.1's strictness: a refusal names what broke.
#[test]
fn bytes_that_are_not_a_frame_are_refused_by_name() {
    let pong = encode(&Frame {
        id: 1,
        body: Body::Pong(vec![]),
    });
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![0, 0], "4 bytes needed"),
        (
            vec![0, 0, 0, 3, 65, 0, 0],
            "shorter than a frame's type and id",
        ),
        (
            ((FRAME_MAX + 1) as u32).to_be_bytes().to_vec(),
            "over the most a frame may hold",
        ),
        ([pong.as_slice(), &[0]].concat(), "were given"),
        (
            {
                let mut b = pong.clone();
                b[4] = 200;
                b
            },
            "the frame's type: 200",
        ),
        (
            {
                let mut b = encode(&Frame {
                    id: 1,
                    body: Body::Records(Records {
                        shard: 0,
                        epoch: 0,
                        first: 0,
                        records: vec![],
                        last: true,
                    }),
                });
                *b.last_mut().unwrap() = 2;
                b
            },
            "whether the page is the last: 2 is neither 0 nor 1",
        ),
        (
            {
                // A Ping claiming four billion entries in 4 bytes: refused, not allocated.
                let mut b = vec![0, 0, 0, 13, 2, 0, 0, 0, 0, 0, 0, 0, 1];
                b.extend_from_slice(&u32::MAX.to_be_bytes());
                b
            },
            "items cannot fit",
        ),
        (
            {
                let mut b = encode(&Frame {
                    id: 1,
                    body: Body::Hello(Hello {
                        version: 1,
                        role: Role::Worker,
                        session: 1,
                        max_shards: 0,
                        token: "ab".into(),
                        resume: vec![],
                        name: String::new(),
                    }),
                });
                // The token's bytes: 0xff is never UTF-8.
                let at = b.len() - 4 - 4 - 2;
                b[at] = 0xff;
                b
            },
            "the token: not UTF-8",
        ),
    ];
    for (bytes, says) in cases {
        let e = match frame_len(&bytes) {
            Err(e) => e,
            Ok(_) => decode(&bytes).expect_err(says),
        };
        assert!(e.what.contains(says), "{:?} should say {says:?}", e.what);
        let refused = Refused::from(e);
        assert_eq!(refused.class(), Class::Corrupted);
    }
}

/// T9's decode fuzz: random bytes, and valid frames with bytes flipped, cut, added and
/// their length prefix changed, never panic; whatever decodes is canonical (encoding it
/// gives the same bytes back), so no two byte strings mean the same frame.
#[test]
fn mangled_frames_never_panic_and_what_decodes_is_canonical() {
    let mut rng = SplitMix64::seeded(0xf7a3e);
    let mut decoded = 0;
    for i in 0..60_000u64 {
        let mut b = encode(&any_frame(&mut rng, i));
        match rng.below(5) {
            0 => {
                let at = rng.below(b.len() as u64) as usize;
                b[at] ^= 1 << rng.below(8);
            }
            1 => {
                let at = rng.below(b.len() as u64) as usize;
                b[at] = rng.next_u64() as u8;
            }
            2 => {
                let cut = rng.below(b.len() as u64) as usize;
                b.truncate(cut);
            }
            3 => {
                let extra = bytes(&mut rng, 8);
                b.extend_from_slice(&extra);
                let len = (b.len() - 4) as u32;
                b[..4].copy_from_slice(&len.to_be_bytes());
            }
            _ => b = bytes(&mut rng, 64),
        }
        if let Ok(frame) = decode(&b) {
            decoded += 1;
            assert_eq!(encode(&frame), b, "{frame:?} has another encoding");
        }
    }
    // Some mangled frames still decode (a flipped bit in a number): the check above saw them.
    assert!(decoded > 1_000, "{decoded}");
}

/// Guards §4.3: fenced refusals say so, and each refusal has the class the doc gives.
#[test]
fn refusals_are_typed_and_classified() {
    let fenced = [
        Refused::Stale { shard: 1, held: 2 },
        Refused::NotHeld { shard: 1 },
    ];
    for r in &fenced {
        assert!(r.is_fenced());
        assert_eq!(r.class(), Class::Permanent);
    }
    assert_eq!(
        Refused::Unavailable { retry_after_ms: 5 }.class(),
        Class::Transient
    );
    assert_eq!(Refused::NoHolder { shard: 3 }.class(), Class::Transient);
    for r in [
        Refused::PositionGap {
            shard: 1,
            expected: 9,
        },
        Refused::TooLarge { limit: 1 },
        Refused::Unauthorized,
        Refused::Version { supported: 1 },
    ] {
        assert!(!r.is_fenced());
        assert_eq!(r.class(), Class::Permanent);
    }
    assert_eq!(
        Refused::Stale { shard: 4, held: 9 }.to_string(),
        "shard 4 is held under epoch 9: this worker's hold on it is over"
    );
}

/// A stream that hands out its bytes in chunks of drawn sizes.
struct Chunked {
    bytes: Vec<u8>,
    at: usize,
    rng: SplitMix64,
    most: u64,
}

impl tokio::io::AsyncRead for Chunked {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let most = self.most;
        let n = (1 + self.rng.below(most) as usize)
            .min(buf.remaining())
            .min(self.bytes.len() - self.at);
        let at = self.at;
        buf.put_slice(&self.bytes[at..at + n]);
        self.at += n;
        std::task::Poll::Ready(Ok(()))
    }
}

/// Guards the frame reader (`remote::io`): frames cut anywhere across reads, several in
/// one read, large and small, come out whole and in order; a stream that ends inside a
/// frame is an error, between frames a clean end.
#[tokio::test]
async fn the_frame_reader_reassembles_frames_cut_anywhere() {
    let mut rng = SplitMix64::seeded(5);
    for most in [1u64, 7, 300, 70_000] {
        let mut frames = Vec::new();
        let mut bytes = Vec::new();
        for i in 0..300u64 {
            let mut f = any_frame(&mut rng, i);
            if i % 50 == 0 {
                // Now and then a frame far larger than a read.
                f.body = Body::Append(Append {
                    shard: 1,
                    epoch: 2,
                    first: 3,
                    records: vec![Rec {
                        kind: 1,
                        bytes: vec![9; 200_000],
                    }],
                });
            }
            bytes.extend(encode(&f));
            frames.push(f);
        }
        let mut stream = Chunked {
            bytes: bytes.clone(),
            at: 0,
            rng: SplitMix64::seeded(most),
            most,
        };
        let mut reader = ferry_flow::remote::io::FrameReader::default();
        for want in &frames {
            let got = reader.next(&mut stream).await.unwrap().unwrap();
            assert_eq!(&got, want);
        }
        assert!(reader.next(&mut stream).await.unwrap().is_none());
        // Cut inside the last frame: an error, not a frame and not a clean end.
        let mut cut = Chunked {
            bytes: bytes[..bytes.len() - 3].to_vec(),
            at: 0,
            rng: SplitMix64::seeded(most),
            most,
        };
        let mut reader = ferry_flow::remote::io::FrameReader::default();
        for _ in 0..frames.len() - 1 {
            reader.next(&mut cut).await.unwrap().unwrap();
        }
        assert!(reader.next(&mut cut).await.is_err());
    }
}
