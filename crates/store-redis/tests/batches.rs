//! Requests waiting at the same moment share one `EVALSHA`: each key is read and written once
//! per call, and every request is decided exactly as it would have been alone, in order.

mod common;

use std::time::Duration;

use common::*;
use sluice_limiter::RefusalReason;
use sluice_store_redis::{Layer, Mode, RedisStore, RemoteDecision, RemoteLimit, StoreError};

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test]
async fn requests_sent_together_share_one_evalsha_that_reads_and_writes_each_key_once() {
    let server = RedisServer::start();
    let store = server.store().await;
    let limits = [
        remote(&fixed("fixed", 20, SECOND)),
        remote(&sliding("sliding", 20, SECOND)),
        remote(&bucket("bucket", 20, SECOND, 20)),
    ];
    let k = key("everyone");
    let layers: Vec<_> = limits.iter().map(|l| Layer::enforced(l, k)).collect();
    // Thirty decisions started in the same poll: all are waiting when the batcher runs.
    let decisions = futures_join_all(
        (0..30)
            .map(|_| Box::pin(store.decide_at(&layers, 1, Mode::Charge, at(0))))
            .collect(),
    )
    .await;
    let admitted: Vec<bool> = decisions
        .iter()
        .map(|d| d.as_ref().unwrap().is_admitted())
        .collect();
    let expected: Vec<bool> = (0..30).map(|i| i < 20).collect();
    assert_eq!(admitted, expected, "in order: the first 20 pass");
    assert_eq!(server.calls("evalsha"), 1);
    assert_eq!(server.calls("get"), 3, "each key read once");
    assert_eq!(server.calls("set"), 3, "each key written once");
    // And the state written is the state after all thirty.
    let alone = store
        .decide_at(&layers, 1, Mode::CheckOnly, at(0))
        .await
        .unwrap();
    let RemoteDecision::Refused(refusal) = alone else {
        panic!("the quota is spent: {alone:?}")
    };
    assert!(refusal.reports.iter().all(|r| r.remaining == 0));
}

/// Polls every future in turn until all are done, so that they all send before any answer
/// comes (what `futures::future::join_all` does, without the dependency).
async fn futures_join_all<F: std::future::Future + Unpin>(mut futures: Vec<F>) -> Vec<F::Output> {
    let mut out: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futures.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match std::pin::Pin::new(&mut *f).poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}

/// Everything a decision reports except its lease id.
fn summary(d: &RemoteDecision) -> String {
    match d {
        RemoteDecision::Admitted(a) => format!(
            "admitted {:?} dry-run refused {:?} at {:?} leases {}",
            a.reports,
            a.dry_run_refused,
            a.now,
            a.lease.as_ref().map_or(0, |l| l.id().len().min(1))
        ),
        RemoteDecision::Refused(r) => format!(
            "refused by {} wait {:?} reason {:?} {:?} at {:?}",
            r.layer, r.wait, r.reason, r.reports, r.now
        ),
        RemoteDecision::CostTooLarge { layer } => format!("too large for {layer}"),
    }
}

/// The same five limits under names starting with `prefix`, so two families share no key.
fn family(prefix: &str) -> Vec<RemoteLimit> {
    let name = |n: &str| format!("{prefix}-{n}");
    let blocking = bucket(&name("blocking"), 2, SECOND, 2).with_block_for(SECOND / 2);
    [
        fixed(&name("fixed"), 5, SECOND),
        sliding(&name("sliding"), 6, SECOND),
        bucket(&name("bucket"), 4, SECOND, 3),
        blocking.unwrap(),
        concurrency(&name("conc"), 3),
    ]
    .iter()
    .map(remote)
    .collect()
}

/// A request: its limits (positions in a family), caller, cost, mode, and whether its layers
/// after the first are dry-run.
type Shape = (Vec<usize>, sluice_limiter::Key, u32, Mode, bool);

fn layers_of<'a>(family: &'a [RemoteLimit], shapes: &[Shape]) -> Vec<Vec<Layer<'a>>> {
    let layers = shapes.iter().map(|(picked, caller, _, _, dry)| {
        let layers = picked
            .iter()
            .enumerate()
            .map(|(i, &l)| match *dry && i > 0 {
                true => Layer::dry_run(&family[l], *caller),
                false => Layer::enforced(&family[l], *caller),
            });
        layers.collect()
    });
    layers.collect()
}

#[tokio::test]
async fn a_batch_decides_every_request_as_it_would_alone_in_order() {
    let server = RedisServer::start();
    let store = server.store().await;
    let (batched, alone) = (family("batched"), family("alone"));
    let callers = [key("a"), key("b"), key("c")];
    let mut rng = Rng(0x5eed_ba7c);
    let (mut now_us, mut batches, mut requests) = (0, 0, 0);
    // Admissions are kept to the end so that concurrency leases stay held on both sides.
    let mut held = Vec::new();
    let mut seen = [0; 4];
    for step in 0..60 {
        now_us += rng.below(400_000);
        // A batch of 1-12 requests, each with 1-3 distinct limits, a caller, a cost, a mode.
        let mut shapes: Vec<Shape> = Vec::new();
        for _ in 0..=rng.below(12) {
            let mut picked: Vec<usize> = Vec::new();
            for _ in 0..=rng.below(3) {
                let l = rng.below(batched.len() as u64) as usize;
                if !picked.contains(&l) {
                    picked.push(l);
                }
            }
            let caller = callers[rng.below(3) as usize];
            let cost = rng.below(4) as u32;
            let mode = match rng.below(5) {
                0 => Mode::CheckOnly,
                _ => Mode::Charge,
            };
            let dry = rng.below(6) == 0;
            shapes.push((picked, caller, cost, mode, dry));
        }
        let (ours, theirs) = (layers_of(&batched, &shapes), layers_of(&alone, &shapes));
        let together = futures_join_all(
            ours.iter()
                .zip(&shapes)
                .map(|(layers, (_, _, cost, mode, _))| {
                    Box::pin(store.decide_at(layers, *cost, *mode, at(now_us)))
                })
                .collect(),
        )
        .await;
        for (i, (layers, (_, _, cost, mode, _))) in theirs.iter().zip(&shapes).enumerate() {
            let one = store.decide_at(layers, *cost, *mode, at(now_us)).await;
            let (one, together) = (one.unwrap(), together[i].as_ref().unwrap());
            assert_eq!(
                summary(together),
                summary(&one),
                "step {step}, request {i} of {}",
                shapes.len()
            );
            let outcome = match &one {
                RemoteDecision::Admitted(_) => 0,
                RemoteDecision::Refused(r) if r.reason == RefusalReason::Exhausted => 1,
                RemoteDecision::Refused(_) => 2,
                RemoteDecision::CostTooLarge { .. } => 3,
            };
            seen[outcome] += 1;
            held.push(one);
        }
        batches += 1;
        requests += shapes.len();
        held.extend(together.into_iter().map(Result::unwrap));
    }
    // The sequence went through every outcome: admitted, refused, refused while blocked,
    // too large.
    assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
    let evalsha = server.calls("evalsha");
    assert_eq!(
        evalsha,
        (batches + requests) as u64,
        "one EVALSHA per batch, one per request alone"
    );
    drop(held);
}

#[tokio::test]
async fn a_request_whose_key_redis_cannot_read_fails_alone_and_writes_nothing() {
    let server = RedisServer::start();
    let store: RedisStore = server.store().await;
    let limit = remote(&fixed("f", 100, SECOND));
    let slots = remote(&concurrency("slots", 1));
    // Request 0 takes the only slot; request 3's fixed-window key holds a hash. The bad read
    // comes after request 0 wrote its lease: the call must go on, not end there.
    let taking = [Layer::enforced(&slots, key("holder"))];
    let (good, bad) = (
        [Layer::enforced(&limit, key("good"))],
        [Layer::enforced(&limit, key("bad"))],
    );
    let mut admin = server.admin().await;
    let name = limit.key_name(key("bad"));
    let _: () = redis::cmd("HSET")
        .arg(&name)
        .arg("f")
        .arg("v")
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut requests = Vec::new();
    for i in 0..6 {
        let layers: &[Layer<'_>] = match i {
            0 => &taking,
            3 => &bad,
            _ => &good,
        };
        requests.push(Box::pin(store.decide_at(layers, 1, Mode::Charge, at(0))));
    }
    let results = futures_join_all(requests).await;
    for (i, r) in results.iter().enumerate() {
        match (i, r) {
            (3, r) => assert!(matches!(r, Err(StoreError::KeyType(0))), "{r:?}"),
            (_, Ok(d)) => assert!(d.is_admitted(), "request {i}: {d:?}"),
            (_, Err(e)) => panic!("request {i} failed with its neighbour: {e}"),
        }
    }
    assert_eq!(server.calls("evalsha"), 1, "one call, nothing sent again");
    // The four good ones were charged once each (a check reports what is left), the bad key
    // is untouched, and the slot holds exactly request 0's lease.
    let d = store.decide_at(&good, 1, Mode::CheckOnly, at(0)).await;
    let RemoteDecision::Admitted(a) = d.unwrap() else {
        panic!("admitted")
    };
    assert_eq!(a.reports[0].remaining, 100 - 4);
    let kind: String = redis::cmd("TYPE")
        .arg(&name)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(kind, "hash");
    let leases: u64 = redis::cmd("ZCARD")
        .arg(slots.key_name(key("holder")))
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(leases, 1);
    drop(results);
}

/// A key holding a state nothing of sluice's wrote (here a count of a half) fails its own
/// request, not the others decided in the same call: Redis charged those.
#[tokio::test]
async fn a_reply_that_does_not_parse_fails_its_request_alone() {
    let server = RedisServer::start();
    let store: RedisStore = server.store().await;
    let limit = remote(&fixed("f", 100, SECOND));
    let mut admin = server.admin().await;
    let name = limit.key_name(key("odd"));
    // This window's index (at(0), one-second windows) and a count of a half.
    let mut state = vec![0u8];
    for field in [(T0.0 / SEC) as f64, 0.5, 0.0, 0.0] {
        state.extend_from_slice(&field.to_le_bytes());
    }
    let _: () = redis::cmd("SET")
        .arg(&name)
        .arg(state)
        .query_async(&mut admin)
        .await
        .unwrap();
    let (good, odd) = (
        [Layer::enforced(&limit, key("good"))],
        [Layer::enforced(&limit, key("odd"))],
    );
    let mut requests = Vec::new();
    for i in 0..4 {
        let layers: &[Layer<'_>] = if i == 2 { &odd } else { &good };
        requests.push(Box::pin(store.decide_at(layers, 1, Mode::Charge, at(0))));
    }
    let results = futures_join_all(requests).await;
    assert_eq!(server.calls("evalsha"), 1, "one call");
    for (i, r) in results.iter().enumerate() {
        match (i, r) {
            (2, r) => assert!(matches!(r, Err(StoreError::Reply(_))), "{r:?}"),
            (_, Ok(d)) => assert!(d.is_admitted(), "request {i}: {d:?}"),
            (_, Err(e)) => panic!("request {i} failed with its neighbour: {e}"),
        }
    }
}

/// Refunds and withdrawals share an `EVALSHA` with decisions: each request's arguments end
/// where the next one's begin (a take-back carries its tags and the states a held request's
/// charges replaced), and each is decided in order (by a reviewer: no test put a take-back
/// in a call with other requests, so a wrong position went unseen).
#[tokio::test]
async fn refunds_and_withdrawals_batched_with_decisions_are_read_in_place() {
    type Boxed<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = String> + 'a>>;
    let show = |d: Result<RemoteDecision, StoreError>| match d {
        Ok(RemoteDecision::Admitted(a)) => format!("admitted, held {:?}", a.hold),
        other => format!("{other:?}"),
    };
    let server = RedisServer::start();
    let store = server.store().await;
    let held = fixed("f", 2, SECOND).with_max_delay(Duration::from_millis(1500));
    let held = remote(&held.unwrap());
    let b = remote(&bucket("b", 10, SECOND, 10));
    let (k1, k2) = (key("one"), key("two"));
    let l1 = [Layer::enforced(&held, k1), Layer::enforced(&b, k1)];
    let l2 = [Layer::enforced(&held, k2), Layer::enforced(&b, k2)];
    for round in 0..3 {
        let now = at(200_000 + round * 3_000_000);
        let first = store.decide_at(&l1, 2, Mode::Charge, now).await.unwrap();
        assert!(first.is_admitted());
        let RemoteDecision::Admitted(second) =
            store.decide_at(&l1, 2, Mode::Charge, now).await.unwrap()
        else {
            panic!("held into the next window")
        };
        let hold = second.hold;
        assert!(!hold.is_zero());
        let RemoteDecision::Admitted(third) =
            store.decide_at(&l2, 1, Mode::Charge, now).await.unwrap()
        else {
            panic!("another caller's first")
        };
        let calls_before = server.calls("evalsha");
        let (store, l1, l2) = (&store, &l1, &l2);
        let requests: Vec<Boxed<'_>> = vec![
            Box::pin(async move { show(store.decide_at(l2, 1, Mode::Charge, now).await) }),
            Box::pin(async move {
                let taken = match round % 2 {
                    0 => store.withdraw_at(l1, second, now).await,
                    _ => store.refund_at(l1, second, now).await,
                };
                format!("{taken:?}")
            }),
            Box::pin(async move { show(store.decide_at(l1, 2, Mode::Charge, now).await) }),
            Box::pin(async move { format!("{:?}", store.refund_at(l2, third, now).await) }),
            Box::pin(async move { show(store.decide_at(l2, 1, Mode::Charge, now).await) }),
        ];
        let got = futures_join_all(requests).await;
        assert_eq!(
            server.calls("evalsha") - calls_before,
            1,
            "one call: {got:?}"
        );
        assert_eq!(got[1], "Ok(())");
        assert_eq!(got[3], "Ok(())");
        // The withdrawn request's place in the next window is the next one's.
        assert_eq!(got[2], format!("admitted, held {hold:?}"));
        assert_eq!(got[0], "admitted, held 0ns");
        assert_eq!(got[4], "admitted, held 0ns");
    }
}
