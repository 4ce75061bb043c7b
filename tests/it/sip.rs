//! Real SIP: Kamailio (Debian's 5.6) in front of `callguard serve`, driven
//! by SIPp, on loopback. The SIP answers (603 Decline with Retry-After, or
//! 200) must equal callguard's records and `callguard replay` on the same
//! calls; with the block-key config, Kamailio alone declines a blocked
//! caller until the key expires.

use crate::common;

use std::collections::HashMap;
use std::net::UdpSocket;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{bin, free_port, query_escape, raw_command, HttpConn, RedisServer};

fn require(binary: &str, package: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {binary}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "`{binary}` is not installed: the SIP tests need it (Debian: apt-get install {package}). \
         The README's test command installs it."
    );
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        // Kamailio leads its own process group (its workers are forked
        // children): stop the whole group, politely first, so no worker is
        // left behind; `kill` of a plain child's pid as a group just fails.
        let group = format!("-{}", self.0.id());
        for signal in ["-TERM", "-KILL"] {
            let _ = Command::new("kill")
                .args([signal, "--", &group])
                .stderr(Stdio::null())
                .status();
            if signal == "-TERM" {
                let deadline = Instant::now() + Duration::from_secs(3);
                while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Processes left in a process group.
fn group_members(pgid: u32) -> usize {
    let out = Command::new("pgrep")
        .args(["-g", &pgid.to_string()])
        .output()
        .expect("pgrep (package procps)");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// A free UDP port on loopback.
fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `callguard serve` on a free port, ready.
fn start_serve(redis: &RedisServer, rules: &Path, extra: &[&str]) -> (Proc, u16) {
    let port = free_port();
    let child = Command::new(bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--redis-url", &redis.url(), "--rules"])
        .arg(rules)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start callguard serve");
    let p = Proc(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !common::http_get(port, "/readyz").is_some_and(|r| r.contains(" 200 ")) {
        assert!(
            Instant::now() < deadline,
            "callguard serve not ready in 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (p, port)
}

/// Kamailio with `config` on a free UDP port, answering OPTIONS.
fn start_kamailio(dir: &Path, config: &str, defines: &[String]) -> (Proc, u16) {
    require(
        "kamailio",
        "kamailio kamailio-utils-modules kamailio-redis-modules",
    );
    let port = free_udp_port();
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    let mut cmd = Command::new("kamailio");
    cmd.arg("-f")
        .arg(repo(config))
        .args(["-l", &format!("udp:127.0.0.1:{port}"), "-DD", "-E"])
        .arg("-Y")
        .arg(&run)
        .args(["-A", "SIP_ANSWER"]);
    for d in defines {
        cmd.args(["-A", d]);
    }
    let log = std::fs::File::create(dir.join("kamailio.log")).unwrap();
    let child = cmd
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start kamailio");
    let p = Proc(child);
    // Ready when an OPTIONS is answered.
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let local = sock.local_addr().unwrap();
    let options = format!(
        "OPTIONS sip:ping@127.0.0.1:{port} SIP/2.0\r\nVia: SIP/2.0/UDP {local};branch=z9hG4bK-ping\r\n\
         From: <sip:ping@{local}>;tag=1\r\nTo: <sip:ping@127.0.0.1:{port}>\r\nCall-ID: ping@test\r\n\
         CSeq: 1 OPTIONS\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 2048];
    loop {
        sock.send_to(options.as_bytes(), ("127.0.0.1", port))
            .unwrap();
        if let Ok(n) = sock.recv(&mut buf) {
            if String::from_utf8_lossy(&buf[..n]).starts_with("SIP/2.0 200") {
                return (p, port);
            }
        }
        assert!(
            Instant::now() < deadline,
            "kamailio did not answer OPTIONS in 20 s; its log: {}",
            std::fs::read_to_string(dir.join("kamailio.log")).unwrap_or_default()
        );
    }
}

/// SIPp as a UAC on loopback: `scenario` (in `integrations/sipp/`) sent
/// to `sip_port`, callers from `inf`, the answers logged to `log`
/// (`-trace_logs`); the caller adds the counts, its port and a timeout.
fn uac(dir: &Path, sip_port: u16, scenario: &str, inf: &Path, log: &Path) -> Command {
    let mut cmd = Command::new("sipp");
    cmd.arg(format!("127.0.0.1:{sip_port}"))
        .arg("-sf")
        .arg(repo(&format!("integrations/sipp/{scenario}")))
        .arg("-inf")
        .arg(inf)
        .args([
            "-i",
            "127.0.0.1",
            "-nostdin",
            "-timeout_error",
            "-trace_logs",
        ])
        .arg("-log_file")
        .arg(log)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    cmd
}

/// One SIP call as SIPp logged it.
#[derive(Debug)]
struct SipCall {
    call_id: String,
    caller: String,
    status: u16,
    retry_after_s: Option<u64>,
    /// The 603's X-RateLimit-Limit and X-RateLimit-Remaining.
    rate_limit: Option<(u64, u64)>,
}

/// Runs SIPp's check scenario: one call per line of `callers` (caller,
/// callee), one at a time, at `rate` calls/s; the answers it logged.
fn run_sipp(
    dir: &Path,
    name: &str,
    sip_port: u16,
    callers: &[(&str, &str)],
    rate: u32,
) -> Vec<SipCall> {
    require("sipp", "sip-tester");
    let inf = dir.join(format!("{name}.csv"));
    let mut text = String::from("SEQUENTIAL\n");
    for (a, b) in callers {
        text.push_str(&format!("{a};{b};\n"));
    }
    std::fs::write(&inf, text).unwrap();
    let log = dir.join(format!("{name}.log"));
    let out = uac(dir, sip_port, "uac-check.xml", &inf, &log)
        .args([
            "-m",
            &callers.len().to_string(),
            "-l",
            "1",
            "-r",
            &rate.to_string(),
        ])
        .args(["-p", &free_udp_port().to_string(), "-timeout", "60s"])
        .stderr(Stdio::piped())
        .output()
        .expect("run sipp");
    assert!(
        out.status.success(),
        "sipp failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let calls: Vec<SipCall> = std::fs::read_to_string(&log)
        .expect("sipp's log")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.trim().split(';').collect();
            SipCall {
                call_id: f[0].to_string(),
                caller: f[1].to_string(),
                status: f[2].parse().unwrap(),
                retry_after_s: f.get(3).and_then(|s| s.parse().ok()),
                rate_limit: f
                    .get(4)
                    .and_then(|s| s.parse().ok())
                    .zip(f.get(5).and_then(|s| s.parse().ok())),
            }
        })
        .collect();
    assert_eq!(calls.len(), callers.len(), "every call answered");
    calls
}

#[test]
fn kamailio_declines_exactly_the_calls_callguard_rejects() {
    declines_exactly_the_rejected_calls(&[]);
}

/// The same with `serve --redis-mode script`.
#[test]
fn kamailio_declines_exactly_the_calls_callguard_rejects_in_script_mode() {
    declines_exactly_the_rejected_calls(&["--redis-mode", "script"]);
}

fn declines_exactly_the_rejected_calls(mode: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start(&[]);
    let rules = common::rules_file(
        dir.path(),
        "[[rule]]\nname = \"burst\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = 3\n",
    );
    let mut extra = vec!["--reject-status", "429"];
    extra.extend_from_slice(mode);
    let (_serve, http) = start_serve(&redis, &rules, &extra);
    let url = format!("CALLGUARD_URL=\"http://127.0.0.1:{http}/v1/check\"");
    let (kam, sip) = start_kamailio(
        dir.path(),
        "integrations/kamailio/callguard-http.cfg",
        &[url],
    );

    // A robocaller (8 calls), a busy subscriber (4), a quiet one (2), interleaved.
    let (a, b, c) = ("+34911000101", "+34911000102", "+34911000103");
    let mut plan = Vec::new();
    for i in 0..8 {
        plan.push((a, "+34600000001"));
        if i % 2 == 0 {
            plan.push((b, "+34600000002"));
        }
        if i == 3 || i == 6 {
            plan.push((c, "+34600000003"));
        }
    }
    let calls = run_sipp(dir.path(), "http", sip, &plan, 25);

    // callguard's record of each call: asked again with the same call id,
    // the API answers the record it gave Kamailio (flagged duplicate).
    let mut conn = HttpConn::connect(http);
    let mut log = String::from("call_id,caller,ts\n");
    let mut records = HashMap::new();
    for call in &calls {
        let r = conn.get(&format!(
            "/v1/check?call_id={}&caller={}",
            query_escape(&call.call_id),
            query_escape(&call.caller)
        ));
        let v = r.json();
        assert_eq!(v["duplicate"], true, "Kamailio checked {}", call.call_id);
        let want = if v["decision"] == "reject" { 603 } else { 200 };
        assert_eq!(call.status, want, "{call:?} vs {v}");
        if want == 603 {
            let ms = v["retry_after_ms"].as_u64().unwrap();
            assert_eq!(
                call.retry_after_s,
                Some(ms.div_ceil(1000)),
                "{call:?} vs {v}"
            );
            // The rate-limit headers, passed on in the SIP reply.
            let rl = &v["ratelimit"];
            assert_eq!(
                call.rate_limit,
                rl["limit"].as_u64().zip(rl["remaining"].as_u64()),
                "{call:?} vs {v}"
            );
            assert!(call.rate_limit.is_some(), "{call:?}");
        }
        log.push_str(&format!(
            "\"{}\",{},{}\n",
            call.call_id, call.caller, v["ts_ms"]
        ));
        records.insert(call.call_id.clone(), v);
    }
    let declined: Vec<&str> = calls
        .iter()
        .filter(|c| c.status == 603)
        .map(|c| c.caller.as_str())
        .collect();
    assert_eq!(
        declined.len(),
        5 + 1,
        "a: 5 over the limit, b: 1, c: none ({declined:?})"
    );
    assert!(!declined.contains(&c));

    // The same calls through `callguard replay` decide the same.
    let input = dir.path().join("sip-calls.csv");
    std::fs::write(&input, log).unwrap();
    let output = dir.path().join("replayed.csv");
    let st = Command::new(bin())
        .args(["replay", "--input"])
        .arg(&input)
        .arg("--rules")
        .arg(&rules)
        .arg("--output")
        .arg(&output)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    let replayed = std::fs::read_to_string(&output).unwrap();
    let mut lines = replayed.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let (id_col, decision_col, retry_col) =
        (col("call_id"), col("decision"), col("retry_after_ms"));
    let mut n = 0;
    for line in lines {
        let f: Vec<&str> = line.split(',').collect();
        let v = &records[f[id_col].trim_matches('"')];
        assert_eq!(v["decision"], f[decision_col], "{line}");
        assert_eq!(
            v["retry_after_ms"].to_string().replace("null", ""),
            f[retry_col],
            "{line}"
        );
        n += 1;
    }
    assert_eq!(n, calls.len());
    // Stopping Kamailio stops its workers too: nothing is left running.
    let pgid = kam.0.id();
    drop(kam);
    assert_eq!(group_members(pgid), 0, "Kamailio processes left running");
}

#[test]
fn kamailio_alone_declines_a_blocked_caller_until_its_key_expires() {
    blocked_until_the_key_expires(&[]);
}

/// The same with the block keys set by the window script.
#[test]
fn kamailio_alone_declines_a_blocked_caller_in_script_mode() {
    blocked_until_the_key_expires(&["--redis-mode", "script"]);
}

fn blocked_until_the_key_expires(mode: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start(&[]);
    let rules = common::rules_file(
        dir.path(),
        "[[rule]]\nname = \"burst\"\nkind = \"sliding\"\nwindow = \"3s\"\nlimit = 2\n",
    );
    let mut extra = vec!["--block-keys"];
    extra.extend_from_slice(mode);
    let (_serve, http) = start_serve(&redis, &rules, &extra);
    let server = format!(
        "REDIS_SERVER=\"name=cg;addr=127.0.0.1;port={}\"",
        redis.port
    );
    let (_kam, sip) = start_kamailio(
        dir.path(),
        "integrations/kamailio/callguard-blockkey.cfg",
        &[server],
    );
    let (a, b) = ("+34911000201", "+34911000202");
    // The platform reports a's calls to callguard (here straight to the
    // API): the third is rejected and blocks a.
    let mut conn = HttpConn::connect(http);
    let mut last = serde_json::Value::Null;
    for i in 0..3 {
        last = conn
            .post(
                "/v1/check",
                &format!(r#"{{"call_id":"k{i}","caller":"{a}"}}"#),
            )
            .json();
    }
    assert_eq!(last["decision"], "reject", "{last}");
    let retry_ms = last["retry_after_ms"].as_i64().unwrap();
    assert!((1..=3_000).contains(&retry_ms), "{last}");
    let decided = |conn: &mut HttpConn| {
        conn.get("/metrics")
            .body
            .lines()
            .filter(|l| l.starts_with("callguard_events_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let before = decided(&mut conn);

    let calls = run_sipp(
        dir.path(),
        "blocked",
        sip,
        &[(a, "+34600000001"), (b, "+34600000002")],
        10,
    );
    assert_eq!(calls[0].status, 603, "{:?}", calls[0]);
    assert!(
        calls[0].retry_after_s.is_some_and(|s| (1..=3).contains(&s)),
        "{:?}",
        calls[0]
    );
    assert_eq!(calls[1].status, 200, "{:?}", calls[1]);
    assert_eq!(
        decided(&mut conn),
        before,
        "Kamailio decided without callguard"
    );

    // Once the key expires, a's next call goes through.
    let key = format!("PTTL cg:block:{{{a}}}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !raw_command(redis.port, &key).is_some_and(|r| r.starts_with(":-2")) {
        assert!(
            Instant::now() < deadline,
            "block key still there after 10 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let calls = run_sipp(dir.path(), "expired", sip, &[(a, "+34600000001")], 10);
    assert_eq!(calls[0].status, 200, "{:?}", calls[0]);
}

/// Two `serve` instances (cached mode) behind Kamailio's dispatcher hashing
/// the From user (`integrations/kamailio/callguard-dispatcher.cfg`): each
/// caller is checked on one instance only, so no write of one instance is
/// ever refused because the other changed the caller; the SIP answers match
/// callguard's records; and with one instance killed, every call is checked
/// on the other (none goes through unchecked).
#[test]
fn kamailio_dispatcher_checks_each_caller_on_one_instance() {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start(&[]);
    let rules = common::rules_file(
        dir.path(),
        "[[rule]]\nname = \"burst\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = 3\n",
    );
    let extra = ["--reject-status", "429"];
    let (serve_a, http_a) = start_serve(&redis, &rules, &extra);
    let (_serve_b, http_b) = start_serve(&redis, &rules, &extra);
    let list = dir.path().join("callguard.list");
    std::fs::write(
        &list,
        format!("1 sip:127.0.0.1:{http_a}\n1 sip:127.0.0.1:{http_b}\n"),
    )
    .unwrap();
    let define = format!("CALLGUARD_LIST=\"{}\"", list.display());
    let (kam, sip) = start_kamailio(
        dir.path(),
        "integrations/kamailio/callguard-dispatcher.cfg",
        &[define],
    );

    // Eight callers, 6 calls each, interleaved: each goes over the limit.
    let callers: Vec<String> = (0..8).map(|i| format!("+3491100020{i}")).collect();
    let plan: Vec<(&str, &str)> = (0..6)
        .flat_map(|_| callers.iter().map(|c| (c.as_str(), "+34600000009")))
        .collect();
    let calls = run_sipp(dir.path(), "dispatched", sip, &plan, 50);

    // Which instance checked each call, from Kamailio's log.
    let checked = |log: &str| -> HashMap<String, (String, String)> {
        log.lines()
            .filter_map(|l| l.split("callguard: checked ").nth(1))
            .filter_map(|rest| {
                let (call, rest) = rest.split_once(" from ")?;
                let (caller, rest) = rest.split_once(" on ")?;
                let (instance, status) = rest.split_once(": ")?;
                Some((
                    call.to_string(),
                    (caller.to_string(), format!("{instance} {}", status.trim())),
                ))
            })
            .collect()
    };
    let log = std::fs::read_to_string(dir.path().join("kamailio.log")).unwrap();
    let seen = checked(&log);
    let mut instances_of: HashMap<&str, std::collections::BTreeSet<&str>> = HashMap::new();
    for call in &calls {
        let (caller, outcome) = seen
            .get(&call.call_id)
            .unwrap_or_else(|| panic!("{} not checked: {log}", call.call_id));
        assert_eq!(caller, &call.caller);
        let instance = outcome.split(' ').next().unwrap();
        instances_of
            .entry(&call.caller)
            .or_default()
            .insert(instance);
        let status = if call.status == 603 { "429" } else { "200" };
        assert!(outcome.ends_with(status), "{call:?}: {outcome}");
    }
    for (caller, instances) in &instances_of {
        assert_eq!(instances.len(), 1, "{caller} checked on {instances:?}");
    }
    let used: std::collections::BTreeSet<&str> = instances_of.values().flatten().copied().collect();
    assert_eq!(used.len(), 2, "both instances get callers: {used:?}");
    // Each caller: 3 allowed, then 3 declined.
    assert_eq!(calls.iter().filter(|c| c.status == 603).count(), 8 * 3);
    for port in [http_a, http_b] {
        let metrics = common::http_get(port, "/metrics").unwrap();
        assert!(
            metrics.contains("callguard_store_conflicts_total 0"),
            "instance {port} had writes refused: {metrics}"
        );
    }

    // One instance gone: its callers are checked on the other.
    drop(serve_a);
    let later: Vec<(&str, &str)> = callers
        .iter()
        .map(|c| (c.as_str(), "+34600000009"))
        .collect();
    let again = run_sipp(dir.path(), "failed-over", sip, &later, 20);
    let log = std::fs::read_to_string(dir.path().join("kamailio.log")).unwrap();
    let seen = checked(&log);
    let b = format!("127.0.0.1:{http_b}");
    for call in &again {
        assert_eq!(call.status, 603, "still over the limit: {call:?}; {log}");
        let (_, outcome) = &seen[&call.call_id];
        assert_eq!(outcome, &format!("{b} 429"), "{call:?}");
    }
    drop(kam);
}

/// `SIPp` answering every call relayed to it (its built-in UAS: 180, 200,
/// then waits for the BYE), on a free UDP port.
fn start_uas(dir: &Path) -> (Proc, u16) {
    require("sipp", "sip-tester");
    let port = free_udp_port();
    let log = std::fs::File::create(dir.join("uas.log")).unwrap();
    let child = Command::new("sipp")
        .args(["-sn", "uas", "-i", "127.0.0.1", "-p", &port.to_string()])
        .args(["-nostdin", "-m", "1000"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start sipp uas");
    (Proc(child), port)
}

/// A call held open by `SIPp` (`uac-hold.xml`) until the test sends it an
/// INFO: then it hangs up with a BYE through Kamailio.
struct HeldCall {
    sipp: Child,
    port: u16,
    log: PathBuf,
}

impl HeldCall {
    /// Places the call from `caller` and waits until it is answered;
    /// the SIP status it got.
    fn place(dir: &Path, name: &str, sip_port: u16, caller: &str) -> (Self, u16) {
        let inf = dir.join(format!("{name}.csv"));
        std::fs::write(&inf, format!("SEQUENTIAL\n{caller};+34600000009;\n")).unwrap();
        let log = dir.join(format!("{name}.log"));
        let port = free_udp_port();
        let sipp = uac(dir, sip_port, "uac-hold.xml", &inf, &log)
            .args(["-m", "1", "-p", &port.to_string(), "-timeout", "90s"])
            .stderr(Stdio::null())
            .spawn()
            .expect("run sipp");
        let call = HeldCall { sipp, port, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = call.answer() {
                return (call, status);
            }
            assert!(Instant::now() < deadline, "{name}: no answer in 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The logged "call_id;caller;status", once answered.
    fn logged(&self) -> Option<Vec<String>> {
        let text = std::fs::read_to_string(&self.log).ok()?;
        let line = text.lines().find(|l| !l.trim().is_empty())?;
        Some(line.trim().split(';').map(str::to_string).collect())
    }

    fn answer(&self) -> Option<u16> {
        self.logged()?.get(2)?.parse().ok()
    }

    /// Tells the held call to hang up (an INFO in its dialog), and waits
    /// for `SIPp` to finish the BYE.
    fn hang_up(mut self) {
        let call_id = self.logged().expect("answered")[0].clone();
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let local = sock.local_addr().unwrap();
        let info = format!(
            "INFO sip:uac@127.0.0.1:{port} SIP/2.0\r\nVia: SIP/2.0/UDP {local};branch=z9hG4bK-info\r\n\
             From: <sip:test@{local}>;tag=9\r\nTo: <sip:uac@127.0.0.1:{port}>\r\nCall-ID: {call_id}\r\n\
             CSeq: 7 INFO\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n",
            port = self.port
        );
        sock.send_to(info.as_bytes(), ("127.0.0.1", self.port))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = self.sipp.try_wait().unwrap() {
                assert!(st.success(), "the held call's SIPp failed: {st}");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the held call did not hang up in 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for HeldCall {
    fn drop(&mut self) {
        let _ = self.sipp.kill();
        let _ = self.sipp.wait();
    }
}

/// A counter of serve's `/metrics` (0 before its first sample).
fn metric(port: u16, name: &str) -> u64 {
    common::http_get(port, "/metrics")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// Kamailio with the dialog module in front of `serve`, SIPp on both
/// sides: with `limit = 2` concurrent calls per caller, the third
/// simultaneous INVITE is declined; after a BYE (Kamailio's dialog end
/// sends `GET /v1/end`), the next INVITE goes through; calls that never
/// send a BYE free their slots after `max_duration` (4 s).
#[test]
fn kamailio_dialogs_hold_and_free_concurrent_slots() {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start(&[]);
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        "[[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nlimit = 2\nmax_duration = \"4s\"\n\
         \n[[rule]]\nname = \"talk\"\nkind = \"sliding\"\nwindow = \"1h\"\nsum = \"talk\"\nlimit = 100000\n",
    )
    .unwrap();
    let (_serve, http) = start_serve(&redis, &rules, &["--reject-status", "429"]);
    let (_uas, uas) = start_uas(dir.path());
    let defines = [
        format!("CALLGUARD_URL=\"http://127.0.0.1:{http}/v1/check\""),
        format!("CALLGUARD_END_URL=\"http://127.0.0.1:{http}/v1/end\""),
        format!("NEXT_HOP=\"sip:127.0.0.1:{uas}\""),
    ];
    let (_kam, sip) = start_kamailio(
        dir.path(),
        "integrations/kamailio/callguard-dialog.cfg",
        &defines,
    );
    let x = "+34911000201";
    let check = |name: &str| run_sipp(dir.path(), name, sip, &[(x, "+34600000010")], 10)[0].status;

    // A call held open (it will hang up), and one that never sends a BYE.
    let (held, status) = HeldCall::place(dir.path(), "held", sip, x);
    assert_eq!(status, 200, "the first call connects");
    let before_open = Instant::now();
    assert_eq!(check("open1"), 200, "the second call connects");
    assert_eq!(check("third"), 603, "a third simultaneous call is declined");

    // The held call hangs up after at least 2 s of talk: Kamailio's
    // dialog ends, and callguard hears of it, talk time and all.
    std::thread::sleep(Duration::from_millis(2_100));
    held.hang_up();
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(http, "callguard_call_ends_total") < 1 {
        assert!(
            Instant::now() < deadline,
            "no call end reached callguard in 30 s; Kamailio's log: {}",
            std::fs::read_to_string(dir.path().join("kamailio.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(check("after_bye"), 200, "the BYE freed a slot");
    assert_eq!(
        check("full_again"),
        603,
        "two open again (neither will send a BYE)"
    );

    // The calls without a BYE hold their slots until max_duration.
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut n = 0;
    loop {
        n += 1;
        if check(&format!("poll{n}")) == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "no slot came back in 40 s");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        before_open.elapsed() >= Duration::from_secs(4),
        "a slot came back {:?} after the call without a BYE, before its max_duration",
        before_open.elapsed()
    );
    assert!(n > 1, "the first retry should still have been declined");
    // The talk cap counted the held call's talk (whole seconds from the
    // answer to the BYE, as Kamailio's dialog sends it), and only it: the
    // other calls never hung up.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let answer = common::http_get(
        http,
        &format!(
            "/v1/check?call_id=talk-probe&caller={}&ts={now}",
            x.replace('+', "%2B")
        ),
    )
    .unwrap_or_default();
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let talk = v["count_talk"].as_i64().unwrap_or(0);
    assert!(
        (2..30).contains(&talk),
        "the held call's talk: {talk} s; Kamailio's log: {}",
        std::fs::read_to_string(dir.path().join("kamailio.log")).unwrap_or_default()
    );
}
