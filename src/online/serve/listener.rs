//! The check API's connections: accepted up to a cap, each served over
//! HTTP/1.1 with a deadline for every request's header (which also closes
//! a connection left idle between requests).
//!
//! A scanner or a slowloris client must not take the switch's fraud check
//! down. At the cap, a new connection takes the place of the oldest one
//! with no request in flight (silent, idle between requests, or still
//! sending its header), as nginx reuses idle keep-alive connections when it
//! runs out: so checks and `/healthz` get through however many connections
//! are held open. Only when every connection has a request in flight is a
//! new one closed at once. A connection that sends its header too slowly,
//! or sits idle, is closed after the deadline. All three are logged (at
//! most once a second) and counted (`callguard_connections_shed_total{kind}`:
//! `evicted`, `cap`, `timeout`). The cap stays below the process's
//! open-file limit, so accepting never fails for want of file descriptors.
//! (A request's body has its own deadline, in the handler.)

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tracing::warn;

use crate::online::metrics::Metrics;

/// File descriptors kept free of connections (Redis, Kafka, files, the
/// admin listener).
const RESERVED_FDS: u64 = 128;
/// How long a stopping server waits for open connections to finish.
const DRAIN: Duration = Duration::from_secs(5);
/// Pause after a failed accept (so a failing accept cannot spin).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Longest a new connection waits for the place of the one it evicted
/// (that one's task closes it at once, unless a request just started).
const EVICT_WAIT: Duration = Duration::from_millis(100);

/// Bounds on one listener's connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most connections open at once; more are closed at once.
    pub max_connections: usize,
    /// Deadline for a request's header, from the moment the server is
    /// ready to read it: a connection idle this long between requests is
    /// closed too.
    pub header_timeout: Duration,
}

/// Accepts connections and serves each with its own task (a `Handler`).
pub struct Listener {
    tcp: TcpListener,
    permits: Arc<Semaphore>,
    /// The open connections, oldest first.
    open: Arc<Open>,
    cap: usize,
    http: http1::Builder,
    metrics: Arc<Metrics>,
    /// Which listener, for logs (`check API`, `admin`).
    name: &'static str,
}

/// One connection: served until it closes, times out, is evicted or the
/// server stops.
struct Handler {
    stream: TcpStream,
    app: Router,
    http: http1::Builder,
    metrics: Arc<Metrics>,
    stop: watch::Receiver<bool>,
    /// Its place among the open connections (left when it ends).
    slot: Registered,
    /// Returned to the cap when the connection ends.
    _permit: OwnedSemaphorePermit,
}

/// What the listener knows of one open connection.
#[derive(Default)]
struct Slot {
    /// Requests in flight (0: silent, idle, or sending its header).
    busy: AtomicU32,
    /// Chosen to make room: told once.
    evicted: AtomicBool,
    /// Wakes its handler to close it.
    evict: Notify,
}

/// The open connections by age (their ids increase).
#[derive(Default)]
struct Open {
    slots: Mutex<BTreeMap<u64, Arc<Slot>>>,
    next: std::sync::atomic::AtomicU64,
}

impl Open {
    /// Registers a new connection.
    fn register(self: &Arc<Self>) -> Registered {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::default());
        if let Ok(mut slots) = self.slots.lock() {
            slots.insert(id, slot.clone());
        }
        Registered {
            open: self.clone(),
            id,
            slot,
        }
    }

    /// Tells the oldest connection with no request in flight to close;
    /// false when every one has a request in flight.
    fn evict_oldest_idle(&self) -> bool {
        let Ok(slots) = self.slots.lock() else {
            return false;
        };
        let victim = slots.values().find(|s| {
            s.busy.load(Ordering::Acquire) == 0 && !s.evicted.swap(true, Ordering::AcqRel)
        });
        match victim {
            Some(s) => {
                s.evict.notify_one();
                true
            }
            None => false,
        }
    }
}

/// A connection's registration, removed when dropped.
struct Registered {
    open: Arc<Open>,
    id: u64,
    slot: Arc<Slot>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Ok(mut slots) = self.open.slots.lock() {
            slots.remove(&self.id);
        }
    }
}

/// Counts a request in flight on a connection while it lives.
struct InFlight(Arc<Slot>);

impl InFlight {
    fn new(slot: &Arc<Slot>) -> Self {
        slot.busy.fetch_add(1, Ordering::AcqRel);
        InFlight(slot.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// At most once a second: whether to log a shed connection now.
struct Every {
    last: Option<Instant>,
}

impl Every {
    fn due(&mut self) -> bool {
        let due = self
            .last
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if due {
            self.last = Some(Instant::now());
        }
        due
    }
}

impl Listener {
    /// A listener on `tcp` within `limits` (the cap lowered to fit the
    /// open-file limit, which is first raised as far as allowed).
    pub fn new(
        tcp: TcpListener,
        limits: Limits,
        metrics: Arc<Metrics>,
        name: &'static str,
    ) -> Self {
        let cap = limits.max_connections.clamp(1, fd_budget());
        if cap < limits.max_connections {
            warn!(
                listener = name,
                asked = limits.max_connections,
                cap,
                "connection cap lowered to fit the open-file limit (raise it with ulimit -n)"
            );
        }
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .keep_alive(true);
        Listener {
            tcp,
            permits: Arc::new(Semaphore::new(cap)),
            open: Arc::default(),
            cap,
            http,
            metrics,
            name,
        }
    }

    /// The connection cap in force.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The address listened on.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.tcp.local_addr()
    }

    /// Serves `app` until `stop` turns true; then lets open connections
    /// finish their requests (for up to 5 s).
    pub async fn run(self, app: Router, mut stop: watch::Receiver<bool>) {
        let mut shed_log = Every { last: None };
        let mut error_log = Every { last: None };
        loop {
            let accepted = tokio::select! {
                () = stopped(&mut stop) => break,
                a = self.tcp.accept() => a,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    if error_log.due() {
                        warn!(listener = self.name, error = %e, "accepting a connection failed");
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let Some(permit) = self.permit(&mut shed_log).await else {
                drop(stream);
                continue;
            };
            // No Nagle delay on answers: a switch waits on each one.
            if let Err(e) = stream.set_nodelay(true) {
                warn!(error = %e, "could not set TCP_NODELAY");
            }
            let handler = Handler {
                stream,
                app: app.clone(),
                http: self.http.clone(),
                metrics: self.metrics.clone(),
                stop: stop.clone(),
                slot: self.open.register(),
                _permit: permit,
            };
            tokio::spawn(handler.run());
        }
        let all = u32::try_from(self.cap).unwrap_or(u32::MAX);
        let _ = tokio::time::timeout(DRAIN, self.permits.acquire_many(all)).await;
    }

    /// A place for a new connection: a free one, or at the cap the place
    /// of the oldest connection with no request in flight, which is told
    /// to close (`evicted`); `None` when every connection has a request in
    /// flight (`cap`: the new one is closed).
    async fn permit(&self, shed_log: &mut Every) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Some(p);
        }
        let kind = if self.open.evict_oldest_idle() {
            let wait = self.permits.clone().acquire_owned();
            if let Ok(Ok(p)) = tokio::time::timeout(EVICT_WAIT, wait).await {
                Metrics::inc(&self.metrics.connections_shed, "evicted");
                if shed_log.due() {
                    warn!(
                        listener = self.name,
                        cap = self.cap,
                        "connection cap reached; closing the oldest idle connections for new ones"
                    );
                }
                return Some(p);
            }
            "cap"
        } else {
            "cap"
        };
        Metrics::inc(&self.metrics.connections_shed, kind);
        if shed_log.due() {
            warn!(
                listener = self.name,
                cap = self.cap,
                "connection cap reached with a request in flight on every connection; \
                 closing new connections"
            );
        }
        None
    }
}

impl Handler {
    async fn run(mut self) {
        let app = TowerToHyperService::new(self.app);
        let slot = self.slot.slot.clone();
        // Each request counts as in flight until its answer is ready.
        let service = hyper::service::service_fn(move |request| {
            let busy = InFlight::new(&slot);
            let answer = hyper::service::Service::call(&app, request);
            async move {
                let answer = answer.await;
                drop(busy);
                answer
            }
        });
        let conn = self
            .http
            .serve_connection(TokioIo::new(self.stream), service);
        tokio::pin!(conn);
        let slot = self.slot.slot.clone();
        let result = tokio::select! {
            r = conn.as_mut() => r,
            () = stopped(&mut self.stop) => {
                // Finish the request in progress, then close.
                conn.as_mut().graceful_shutdown();
                conn.await
            }
            () = slot.evict.notified() => {
                if slot.busy.load(Ordering::Acquire) == 0 {
                    return; // closed with nothing in flight
                }
                // A request started since it was chosen: answer it first.
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = result {
            if e.is_timeout() {
                Metrics::inc(&self.metrics.connections_shed, "timeout");
            }
        }
    }
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// File descriptors connections may use: the open-file limit (raised to
/// its hard limit first, where allowed) less [`RESERVED_FDS`].
#[cfg(unix)]
fn fd_budget() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the struct passed.
    let soft = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return usize::MAX;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
        lim.rlim_cur
    };
    usize::try_from(soft.saturating_sub(RESERVED_FDS).max(1)).unwrap_or(usize::MAX)
}

#[cfg(not(unix))]
fn fd_budget() -> usize {
    usize::MAX
}
