//! The check API's connections: accepted up to a cap, each served over
//! HTTP/1.1 with a deadline for every request's header (which also closes
//! a connection left idle between requests).
//!
//! A scanner or a slowloris client must not take the switch's fraud check
//! down: a connection over the cap is closed at once, and one that sends
//! its header too slowly, or sits idle, is closed after the deadline; both
//! are logged (at most once a second) and counted
//! (`callguard_connections_shed_total{kind}`). The cap stays below the
//! process's open-file limit, so accepting never fails for want of file
//! descriptors. (A request's body has its own deadline, in the handler.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tracing::warn;

use crate::online::metrics::Metrics;

/// File descriptors kept free of connections (Redis, Kafka, files, the
/// admin listener).
const RESERVED_FDS: u64 = 128;
/// How long a stopping server waits for open connections to finish.
const DRAIN: Duration = Duration::from_secs(5);
/// Pause after a failed accept (so a failing accept cannot spin).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

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
    cap: usize,
    http: http1::Builder,
    metrics: Arc<Metrics>,
    /// Which listener, for logs (`check API`, `admin`).
    name: &'static str,
}

/// One connection: served until it closes, times out or the server stops.
struct Handler {
    stream: TcpStream,
    app: Router,
    http: http1::Builder,
    metrics: Arc<Metrics>,
    stop: watch::Receiver<bool>,
    /// Returned to the cap when the connection ends.
    _permit: OwnedSemaphorePermit,
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
            let Ok(permit) = self.permits.clone().try_acquire_owned() else {
                Metrics::inc(&self.metrics.connections_shed, "cap");
                if shed_log.due() {
                    warn!(
                        listener = self.name,
                        cap = self.cap,
                        "connection cap reached; closing new connections"
                    );
                }
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
                _permit: permit,
            };
            tokio::spawn(handler.run());
        }
        let all = u32::try_from(self.cap).unwrap_or(u32::MAX);
        let _ = tokio::time::timeout(DRAIN, self.permits.acquire_many(all)).await;
    }
}

impl Handler {
    async fn run(mut self) {
        let service = TowerToHyperService::new(self.app);
        let conn = self
            .http
            .serve_connection(TokioIo::new(self.stream), service);
        tokio::pin!(conn);
        let result = tokio::select! {
            r = conn.as_mut() => r,
            () = stopped(&mut self.stop) => {
                // Finish the request in progress, then close.
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
