//! Cold prompts placed by the replica that owns their prefix, end to end: real routers
//! in-process, each with its own internal listener, asking each other over real HTTP, in front
//! of simulated engines (real HTTP, real ZMQ).

mod common;

use common::*;
use kvroute::RouterConfig;
use kvroute::config::ColdOwnerScope;
use kvroute::peer::cold_owner::{
    COLD_PLACE_BODY_MAX_BYTES, COLD_PLACE_MODEL_HEADER, COLD_PLACE_PATH,
    COLD_PLACE_PROMPT_TOKENS_HEADER,
};
use kvroute::peer::load_share::LoadShareConfig;
use kvroute_discovery::PeerUrl;
use serde_json::json;

const TOKEN: &[u8] = b"cold-owner-test-token-0123456789abcdef";
/// Cold prompts sent to every replica at once; each must land on one rank.
const COLD_GROUPS: usize = 5;

fn config(urls: &[String], cold_owner: ColdOwnerScope) -> RouterConfig {
    RouterConfig {
        internal_auth_token: Some(TOKEN.into()),
        // Long enough that a pending prefix outlives the whole test.
        pending_prefix_ttl_ms: 30_000,
        load_share: LoadShareConfig {
            cold_owner,
            // A loaded CI machine may take a while to answer; the property under test is
            // agreement, not speed.
            cold_owner_timeout_ms: 1_000,
            // A sibling heard once stays a candidate owner through a stall of this machine
            // (a silent sibling owns nothing, and the replicas would then disagree).
            stale_ms: kvroute::peer::load_share::LOAD_SHARE_STALE_MS_MAX,
            ..LoadShareConfig::default()
        },
        ..router_config(urls)
    }
}

/// [`config`] with a cost model that always prefers waiting behind a prefix's first prefill to
/// computing it again elsewhere (a large displacement charge on uncached tokens): the copies
/// of one prompt then belong on one rank, and only a disagreement between replicas about where
/// it went can split them.
fn following_config(urls: &[String], cold_owner: ColdOwnerScope) -> RouterConfig {
    let mut c = config(urls, cold_owner);
    c.weights.eviction_cost_fraction = 10.0;
    c
}

/// A long prompt nobody has cached (its prefill dominates any queue, so a replica that knows
/// it is pending on a rank follows it there).
fn cold_prompt(tag: &str) -> String {
    let words: Vec<String> = (0..600).map(|i| format!("w{}{tag}", i % 53)).collect();
    format!("a cold prompt {tag}: {}", words.join(" "))
}

/// Sends one chat through `base`; returns the status and the rank the router chose
/// (`url#dp_rank` from the decision header).
async fn chat(base: String, content: String) -> (u16, String) {
    let (status, d) = chat_decision(base, content).await;
    (
        status,
        format!("{}#{}", field(&d, "url"), field(&d, "dp_rank")),
    )
}

/// Sends one chat through `base`; returns the status and the whole decision header.
async fn chat_decision(base: String, content: String) -> (u16, String) {
    let (status, body, headers) = post_json(
        &format!("{base}/v1/chat/completions"),
        &json!({"model": "m", "max_tokens": 2,
            "messages": [{"role": "user", "content": content}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    (status, decision(&headers))
}

/// One `name=value` field of a decision header ("?" when absent).
fn field(decision: &str, name: &str) -> String {
    decision
        .split(';')
        .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
        .unwrap_or("?")
        .to_string()
}

async fn start_replicas(
    urls: &[String],
    n: usize,
    cold_owner: ColdOwnerScope,
) -> Vec<kvroute::RouterHandle> {
    start_replicas_with(urls, n, || following_config(urls, cold_owner)).await
}

/// `n` replicas of `make()`'s configuration, each listing the others as siblings, once every
/// one hears every sibling.
async fn start_replicas_with(
    urls: &[String],
    n: usize,
    make: impl Fn() -> RouterConfig,
) -> Vec<kvroute::RouterHandle> {
    let mut replicas = Vec::new();
    for _ in 0..n {
        replicas.push(kvroute::serve(make()).await.expect("replica"));
    }
    for (i, r) in replicas.iter().enumerate() {
        let siblings: Vec<PeerUrl> = replicas
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, s)| PeerUrl::parse(&s.internal_url()).expect("internal URL"))
            .collect();
        r.router.peers.replace(siblings);
        wait_subscribed(&r.url(), urls.len() * 2).await;
    }
    wait_siblings_heard(&replicas).await;
    replicas
}

/// Waits until every replica hears each of its siblings' bookings streams: a sibling that is
/// not heard owns no cold prompt, so agreement needs every stream up.
async fn wait_siblings_heard(replicas: &[kvroute::RouterHandle]) {
    wait_until(
        "every replica to hear each sibling",
        WAIT_DEADLINE,
        || async {
            let heard: Vec<usize> = replicas
                .iter()
                .map(|r| {
                    let stale_ms = r.router.config.load_share.stale_ms;
                    let siblings = r.router.load_share.siblings(stale_ms);
                    siblings.iter().filter(|s| s.fresh).count()
                })
                .collect();
            if heard.iter().all(|&n| n + 1 == replicas.len()) {
                Ok(())
            } else {
                Err(format!("siblings heard per replica: {heard:?}"))
            }
        },
    )
    .await
}

/// One outcome of `kvroute_cold_placements_total` from a metrics page (0 when absent).
fn placements(metrics: &str, outcome: &str) -> f64 {
    metric_value(
        metrics,
        &format!(r#"kvroute_cold_placements_total{{outcome="{outcome}"}}"#),
    )
    .and_then(|v| v.parse::<f64>().ok())
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_receiving_one_cold_prompt_at_once_start_it_on_one_rank() {
    let fleet = fleet(2, 2, "m").await;
    let urls = urls(&fleet);
    for scope in [ColdOwnerScope::Fleet, ColdOwnerScope::Prefix] {
        let replicas = start_replicas(&urls, 3, scope).await;
        for group in 0..COLD_GROUPS {
            let prompt = cold_prompt(&format!("{scope:?}{group}"));
            let sent: Vec<_> = replicas
                .iter()
                .map(|r| tokio::spawn(chat(r.url(), prompt.clone())))
                .collect();
            let mut ranks = Vec::new();
            for s in sent {
                ranks.push(s.await.expect("chat task").1);
            }
            if ranks.windows(2).any(|w| w[0] != w[1]) {
                // Name the cause: each replica's placements so far, by outcome.
                let mut outcomes = Vec::new();
                for r in &replicas {
                    let m = metrics_text(&r.url()).await;
                    outcomes.push(
                        [
                            "owner_chose",
                            "owner_failed",
                            "owner_rank_unknown",
                            "served",
                        ]
                        .map(|o| format!("{o}={}", placements(&m, o)))
                        .join(" "),
                    );
                }
                panic!(
                    "{scope:?} group {group}: one cold prompt sent to 3 replicas at once went \
                     to {ranks:?}; placements per replica: {outcomes:?}"
                );
            }
        }
        // Every placement a replica took from an owner was served by one, and none failed.
        let mut asked = 0.0;
        let mut served = 0.0;
        for r in &replicas {
            let m = metrics_text(&r.url()).await;
            let count = |outcome: &str| placements(&m, outcome);
            asked += count("owner_chose");
            served += count("served");
            assert_eq!(
                count("owner_failed"),
                0.0,
                "{scope:?}: a reachable owner failed"
            );
        }
        assert!(asked > 0.0, "{scope:?}: no replica asked an owner");
        assert_eq!(
            asked, served,
            "{scope:?}: placements taken and served differ"
        );
        for r in replicas {
            r.shutdown().await;
        }
    }
}

/// The owner of a cold prompt counts a copy it placed for a sibling until the sibling's own
/// booking of it arrives, and then no longer: counted twice, two copies placed for siblings
/// look like four requests on the prompt's rank, which puts the owner's own copy over the load
/// bound (4 ranks, 4 in flight: bound 2 x 5/4 + 2 = 4.5 < 5) and starts it on a second rank.
/// The engines are slow and the bookings' frames far apart (placed hold 4 x 500 ms), so the
/// owner's copy is planned after the siblings' bookings arrived and well within the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owners_own_copy_follows_its_placements_once_the_askers_bookings_arrive() {
    let sim = kvroute_sim::config::SimConfig {
        engines: 2,
        dp_size: 2,
        served_model_name: "m".into(),
        instant: false,
        // Long enough that every copy is still in flight when the owner's copy is planned, and
        // that none of the prompt's blocks is stored before then (the prompt stays cold).
        prefill_us_per_token: 1_000,
        ..kvroute_sim::config::SimConfig::for_tests()
    };
    let fleet = kvroute_sim::start_fleet(sim).await.expect("fleet starts");
    let urls = urls(&fleet);
    let replicas = start_replicas_with(&urls, 3, || {
        let mut c = following_config(&urls, ColdOwnerScope::Fleet);
        c.load_share.interval_ms = 500;
        c
    })
    .await;
    let internal: Vec<PeerUrl> = replicas
        .iter()
        .map(|r| PeerUrl::parse(&r.internal_url()).expect("internal URL"))
        .collect();
    let owner_at = internal
        .iter()
        .position(|me| {
            let others: Vec<PeerUrl> = internal.iter().filter(|p| *p != me).cloned().collect();
            kvroute::peer::cold_owner::owner_of(
                kvroute::peer::cold_owner::FLEET_OWNER_KEY,
                me,
                &others,
            ) == me
        })
        .expect("one replica owns the fleet's cold prompts");
    let prompt = cold_prompt("late owner");
    let asked: Vec<_> = (0..replicas.len())
        .filter(|&i| i != owner_at)
        .map(|i| tokio::spawn(chat(replicas[i].url(), prompt.clone())))
        .collect();
    let owner = &replicas[owner_at];
    wait_until(
        "the owner to hear both askers' bookings on one rank",
        WAIT_DEADLINE,
        || async {
            let loads: Vec<(i64, i64)> = owner
                .router
                .registry
                .workers()
                .iter()
                .flat_map(|w| {
                    w.ranks
                        .iter()
                        .map(|l| {
                            use std::sync::atomic::Ordering::Relaxed;
                            (
                                l.sibling_in_flight.load(Relaxed),
                                l.placed_in_flight.load(Relaxed),
                            )
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            if loads.iter().any(|&(sibling, _)| sibling == 2) {
                Ok(())
            } else {
                Err(format!("(sibling, placed) in flight per rank: {loads:?}"))
            }
        },
    )
    .await;
    let (_, owner_rank) = chat(owner.url(), prompt.clone()).await;
    let mut ranks = Vec::new();
    for a in asked {
        ranks.push(a.await.expect("chat task").1);
    }
    assert!(
        ranks.iter().all(|r| *r == owner_rank),
        "the askers' copies went to {ranks:?}, the owner's own to {owner_rank}"
    );
    for r in replicas {
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_books_a_cold_prompts_prefill_and_the_asker_only_the_request() {
    let fleet = fleet(2, 2, "m").await;
    let urls = urls(&fleet);
    let cfg = |urls: &[String]| {
        let mut c = config(urls, ColdOwnerScope::Fleet);
        // No frames between the two: each one's counters are its own bookings only.
        c.load_share.enabled = false;
        // A prefill that takes a minute on the virtual clock: the backlog cannot drain while
        // the test looks at it.
        c.weights.prefill_cost_us_per_token = 50_000.0;
        c
    };
    let a = kvroute::serve(cfg(&urls)).await.expect("a");
    let b = kvroute::serve(cfg(&urls)).await.expect("b");
    let (a_url, b_url) = (
        PeerUrl::parse(&a.internal_url()).unwrap(),
        PeerUrl::parse(&b.internal_url()).unwrap(),
    );
    a.router.peers.replace([b_url.clone()]);
    b.router.peers.replace([a_url.clone()]);
    wait_subscribed(&a.url(), 4).await;
    wait_subscribed(&b.url(), 4).await;
    let owner_is_a = kvroute::peer::cold_owner::owner_of(
        kvroute::peer::cold_owner::FLEET_OWNER_KEY,
        &a_url,
        std::slice::from_ref(&b_url),
    ) == &a_url;
    let (owner, asker) = if owner_is_a { (&a, &b) } else { (&b, &a) };
    let (_, asked) = chat_decision(asker.url(), cold_prompt("booked")).await;
    let rank = format!("{}#{}", field(&asked, "url"), field(&asked, "dp_rank"));
    assert_eq!(field(&asked, "reason"), "cold_owner", "{asked}");
    let waited_ms: f64 = field(&asked, "owner_wait_ms")
        .parse()
        .unwrap_or_else(|e| panic!("the decision names the wait for the owner ({e}): {asked}"));
    assert!(
        (0.0..1_000.0).contains(&waited_ms),
        "the wait is within the ask's timeout: {asked}"
    );
    let owner_workers = workers(&owner.url()).await;
    let asker_workers = workers(&asker.url()).await;
    let owner_backlog = rank_field(&owner_workers, "prefill_backlog_us");
    let asker_backlog = rank_field(&asker_workers, "prefill_backlog_us");
    let asker_sent = rank_field(&asker_workers, "dispatched_total");
    let owner_sent = rank_field(&owner_workers, "dispatched_total");
    let at = |rows: &[(String, u64, i64)]| {
        rows.iter()
            .find(|(u, d, _)| format!("{u}#{d}") == rank)
            .map(|r| r.2)
            .unwrap_or(-1)
    };
    assert!(
        at(&owner_backlog) > 1_000_000,
        "the owner queued the prefill on {rank}: {owner_backlog:?}"
    );
    assert!(
        asker_backlog.iter().all(|r| r.2 == 0),
        "the asker queued no prefill work of its own: {asker_backlog:?}"
    );
    assert_eq!(
        at(&asker_sent),
        1,
        "the asker dispatched the request: {asker_sent:?}"
    );
    assert!(
        owner_sent.iter().all(|r| r.2 == 0),
        "the owner dispatched nothing: {owner_sent:?}"
    );
    // The owner places its own cold prompt without asking anyone: no wait to name.
    let (_, placed_here) = chat_decision(owner.url(), cold_prompt("owned")).await;
    assert_eq!(
        field(&placed_here, "owner_wait_ms"),
        "?",
        "the owner asked nobody: {placed_here}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_that_is_not_heard_owns_no_cold_prompt() {
    let fleet = fleet(2, 2, "m").await;
    let urls = urls(&fleet);
    let a = kvroute::serve(config(&urls, ColdOwnerScope::Prefix))
        .await
        .expect("a");
    // Siblings that are not there (closed ports): listed, never heard. With load sharing on
    // they own nothing, so no prompt waits on them.
    let dead: Vec<PeerUrl> = (0..8)
        .map(|_| PeerUrl::parse(&format!("http://127.0.0.1:{}", free_port())).unwrap())
        .collect();
    a.router.peers.replace(dead);
    wait_subscribed(&a.url(), 4).await;
    for i in 0..6 {
        let (status, _) = chat(a.url(), cold_prompt(&format!("dead{i}"))).await;
        assert_eq!(status, 200);
    }
    let m = metrics_text(&a.url()).await;
    let asked = metric_value(&m, "kvroute_cold_placement_wait_seconds_count")
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert_eq!(
        (asked, placements(&m, "owner_failed")),
        (0.0, 0.0),
        "6 cold prompts with 8 silent siblings listed: none should be sent to a sibling \
         (asks, failed asks)"
    );
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_keeps_failing_is_set_aside_and_its_prompts_placed_at_once() {
    use kvroute::peer::owner_standings::{COLD_OWNER_FAILURES_MAX, COLD_OWNER_SET_ASIDE_MIN_MS};
    let fleet = fleet(2, 2, "m").await;
    let urls = urls(&fleet);
    let mut cfg = config(&urls, ColdOwnerScope::Fleet);
    // No bookings streams: a listed sibling counts as a candidate owner until its asks fail,
    // as when load sharing is off or a sibling streams but cannot place.
    cfg.load_share.enabled = false;
    let a = kvroute::serve(cfg).await.expect("a");
    let me = PeerUrl::parse(&a.internal_url()).unwrap();
    // A closed address that outranks this replica for the fleet's one key. Each candidate is a
    // coin toss weighted by this replica's own weight, which its random port decides: when that
    // weight is high, 64 ports on one host could all lose (a clean-clone CI run failed so). So
    // the candidates are every loopback host 127.0.x.y (nothing listens there) on one free
    // port: only a replica outranking all 65,000 of them would find none.
    let port = free_port();
    let dead = (1..=u16::MAX)
        .filter(|h| !matches!(h & 0xff, 0 | 255))
        .map(|h| format!("127.0.{}.{}", h >> 8, h & 0xff))
        .filter(|host| {
            let candidate = PeerUrl::parse(&format!("http://{host}:{port}")).unwrap();
            kvroute::peer::cold_owner::owner_of(
                kvroute::peer::cold_owner::FLEET_OWNER_KEY,
                &me,
                std::slice::from_ref(&candidate),
            ) == &candidate
        })
        // Nothing listens there: the address can be bound (and is released at once).
        .find(|host| std::net::TcpListener::bind((host.as_str(), port)).is_ok())
        .map(|host| PeerUrl::parse(&format!("http://{host}:{port}")).unwrap())
        .expect("a closed loopback address outranks this replica");
    a.router.peers.replace([dead.clone()]);
    wait_subscribed(&a.url(), 4).await;
    for i in 0..COLD_OWNER_FAILURES_MAX {
        let (status, _) = chat(a.url(), cold_prompt(&format!("failing{i}"))).await;
        assert_eq!(status, 200);
    }
    let m = metrics_text(&a.url()).await;
    assert_eq!(
        placements(&m, "owner_failed"),
        f64::from(COLD_OWNER_FAILURES_MAX),
        "every cold prompt was sent to the dead owner until it was set aside"
    );
    let seen = workers(&a.url()).await;
    let failing = &seen["load_share"]["cold_owners_failing"];
    let set_aside_for_ms = failing
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["sibling"] == dead.to_string()))
        .and_then(|r| r["set_aside_for_ms"].as_u64())
        .unwrap_or(0);
    assert!(
        set_aside_for_ms > 0 && set_aside_for_ms <= COLD_OWNER_SET_ASIDE_MIN_MS,
        "/workers should show {dead} set aside: {failing}"
    );
    // Within the pause the owner is not asked: the next cold prompt is placed here at once.
    let sent = std::time::Instant::now();
    let (status, _) = chat(a.url(), cold_prompt("after")).await;
    assert_eq!(status, 200);
    let m = metrics_text(&a.url()).await;
    if sent.elapsed().as_millis() < u128::from(set_aside_for_ms) {
        assert_eq!(
            placements(&m, "owner_failed"),
            f64::from(COLD_OWNER_FAILURES_MAX),
            "a cold prompt sent within the pause was sent to the owner set aside"
        );
    } else {
        eprintln!(
            "the prompt after the failures took {:?}, past the pause: its ask not checked",
            sent.elapsed()
        );
    }
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_placement_endpoint_refuses_what_is_not_a_placement_request() {
    let fleet = fleet(1, 2, "m").await;
    let urls = urls(&fleet);
    let a = kvroute::serve(config(&urls, ColdOwnerScope::Prefix))
        .await
        .expect("a");
    wait_subscribed(&a.url(), 2).await;
    let place = format!("{}{COLD_PLACE_PATH}", a.internal_url());
    let post = |body: Vec<u8>, model: &str, token: Option<&[u8]>| {
        let mut req = client()
            .post(&place)
            .header(COLD_PLACE_MODEL_HEADER, model)
            .body(body);
        if let Some(t) = token {
            req = req.bearer_auth(String::from_utf8_lossy(t));
        }
        async move { req.send().await.expect("sent").status().as_u16() }
    };
    let ids: Vec<u8> = (0u32..64).flat_map(|t| (t + 100).to_le_bytes()).collect();
    assert_eq!(post(ids.clone(), "m", None).await, 401, "no token");
    assert_eq!(
        post(ids.clone(), "m", Some(b"wrong-token-0123456789abcdef")).await,
        401
    );
    assert_eq!(
        post(vec![1, 2, 3], "m", Some(TOKEN)).await,
        400,
        "not u32 ids"
    );
    assert_eq!(post(Vec::new(), "m", Some(TOKEN)).await, 400, "no ids");
    assert_eq!(post(ids.clone(), "no-such-model", Some(TOKEN)).await, 404);
    assert_eq!(
        post(vec![0; COLD_PLACE_BODY_MAX_BYTES + 4], "m", Some(TOKEN)).await,
        413,
        "over the body cap"
    );
    // And a well-formed one names a rank of the fleet.
    let resp = client()
        .post(&place)
        .header(COLD_PLACE_MODEL_HEADER, "m")
        .bearer_auth(String::from_utf8_lossy(TOKEN))
        .body(ids)
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status().as_u16(), 200);
    let placed: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(
        placed["worker_url"].as_str(),
        Some(urls[0].as_str()),
        "{placed}"
    );
    assert!(
        placed["dp_rank"].as_u64().is_some_and(|r| r < 2),
        "{placed}"
    );
    // The prompt's whole length, when the body is only its head: the owner books the whole
    // prompt's prefill; a length it cannot read, or past what a body could hold, is clamped,
    // never refused nor trusted.
    let booked = |first: u32, length: &'static str| {
        let ids: Vec<u8> = (first..first + 64).flat_map(|t| t.to_le_bytes()).collect();
        let req = client()
            .post(&place)
            .header(COLD_PLACE_MODEL_HEADER, "m")
            .header(COLD_PLACE_PROMPT_TOKENS_HEADER, length)
            .bearer_auth(String::from_utf8_lossy(TOKEN))
            .body(ids);
        async move {
            let resp = req.send().await.expect("sent");
            assert_eq!(resp.status().as_u16(), 200, "length header {length:?}");
            let placed: serde_json::Value = resp.json().await.expect("json");
            placed["prefill_booked_us"].as_u64().expect("booked")
        }
    };
    let head_only = booked(1_000, "64").await;
    let whole = booked(2_000, "6400").await;
    assert!(
        whole > 50 * head_only,
        "a 6,400-token prompt books {whole} us, its 64-token head alone {head_only} us"
    );
    for unreadable in ["many", "-5", "99999999999999999999", "9999999999"] {
        booked(3_000, unreadable).await;
    }
    a.shutdown().await;
}
