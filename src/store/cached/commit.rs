//! The cached store's commits: one pipeline per hash slot, script calls
//! and plain `SET`s, the refused callers' state read back with them.

use redis::Value;

use super::wire::{bulk, distinct_fields, refusals, scanned, self_contained, unexpected};
use super::wire::{Committed, Found, Refused, Write};
use super::{wire, CALLERS_PER_CALL, SCAN_COUNT};
use std::sync::Arc;

use crate::store::redis::{Conn, RedisConfig};

/// What a commit needs of the store: its connection, configuration and
/// script, owned (cheap to clone), so that a commit can go on while the
/// store takes callers out of its cache, and after the store call that
/// sent it has returned (see `ahead.rs`).
#[derive(Clone)]
pub(super) struct Committer {
    pub(super) conn: Conn,
    pub(super) config: Arc<RedisConfig>,
    pub(super) sha: Arc<str>,
}

impl Committer {
    fn state_key(&self, caller: &str) -> String {
        self.config.caller_key(caller, ":s")
    }

    fn records_key(&self, caller: &str) -> String {
        self.config.caller_key(caller, ":r")
    }

    fn log_key(&self, caller: &str) -> String {
        self.config.caller_key(caller, ":l")
    }

    /// Sends the writes (one pipeline; one per hash slot on a Cluster, run
    /// concurrently) and returns them with those that were refused.
    pub(super) async fn commit(self, writes: Vec<Write>) -> Result<Committed, redis::RedisError> {
        let groups = self
            .conn
            .groups(writes.len(), |i| self.state_key(&writes[i].caller));
        let calls = groups
            .into_iter()
            .map(|group| self.commit_group(&writes, group));
        let mut refused = Vec::new();
        for outcome in futures::future::join_all(calls).await {
            refused.extend(outcome?);
        }
        Ok(Committed { writes, refused })
    }

    /// Sends the writes `group` of `writes` (all in one slot) in one
    /// pipeline and returns the refused ones with their callers' state.
    ///
    /// A plain write (see [`Write::plain_ttl`]) is one `SET ... NX PX ...
    /// GET` outside the script: it creates the caller's state string only
    /// if absent, or returns the string it found; the script also returns
    /// only the state string of a caller it did not write. When that
    /// string says the caller keeps records or a log apart, those are read
    /// back with it in one transaction, so a refusal always carries the
    /// caller's whole state.
    ///
    /// Each reply stands alone: a script call the server no longer knows
    /// (`NOSCRIPT`: restarted, flushed or failed over) ran nothing, and only
    /// that call is sent again, with the script's text, while the plain
    /// writes and other calls of the pipeline stand as written.
    async fn commit_group(
        &self,
        writes: &[Write],
        group: Vec<usize>,
    ) -> Result<Vec<Refused>, redis::RedisError> {
        let timeout = self.config.timeout * 2;
        let (plain, scripted): (Vec<usize>, Vec<usize>) = group
            .into_iter()
            .partition(|&i| writes[i].plain_ttl().is_some());
        let calls: Vec<Vec<&Write>> = scripted
            .chunks(CALLERS_PER_CALL)
            .map(|chunk| chunk.iter().map(|&i| &writes[i]).collect())
            .collect();
        let mut pipe = redis::Pipeline::with_capacity(calls.len() + plain.len());
        pipe.ignore_errors();
        for ws in &calls {
            pipe.add_command(wire::invocation(&self.config, &self.sha, ws, false));
        }
        let mut key = String::new();
        for &i in &plain {
            let w = &writes[i];
            self.config.write_tagged(&mut key, "", &w.caller, ":s");
            // Sized up front: seven arguments, the key, the string and
            // 20 bytes of flags and TTL (growing them was five
            // reallocations per new caller).
            let mut cmd = redis::Cmd::with_capacity(7, 20 + key.len() + w.value.len());
            cmd.arg("SET")
                .arg(key.as_str())
                .arg(&w.value[..])
                .arg("NX")
                .arg("PX")
                .arg(w.plain_ttl())
                .arg("GET");
            pipe.add_command(cmd);
        }
        let mut conn = self.conn.clone();
        let replies = conn.query(&pipe, timeout).await?;
        if replies.len() != calls.len() + plain.len() {
            return Err(unexpected(format!(
                "{} replies to {} commands",
                replies.len(),
                calls.len() + plain.len()
            )));
        }
        let mut replies = replies.into_iter();
        // Per refused write, the state string found (nil: none).
        let mut found: Vec<(usize, Option<Vec<u8>>)> = Vec::new();
        for (ws, chunk) in calls.iter().zip(scripted.chunks(CALLERS_PER_CALL)) {
            let reply = match replies.next() {
                Some(Value::ServerError(e)) if e.code() == "NOSCRIPT" => {
                    let mut again = redis::pipe();
                    again.add_command(wire::invocation(&self.config, &self.sha, ws, true));
                    conn.query(&again, timeout).await?.pop()
                }
                reply => reply,
            };
            refusals(reply, chunk, &mut found)?;
        }
        // Plain writes: nil when written, else the string found.
        for (&i, reply) in plain.iter().zip(replies) {
            if let Some(value) = bulk(reply)? {
                found.push((i, Some(value)));
            }
        }
        let mut refused = Vec::new();
        let (mut read_back, mut read_some) = (Vec::new(), Vec::new());
        for (write, value) in found {
            match value {
                Some(value) if !self_contained(&value) && writes[write].read_ids.is_some() => {
                    read_some.push(write)
                }
                Some(value) if !self_contained(&value) => read_back.push(write),
                value => refused.push(Refused {
                    write,
                    read: Some(Found {
                        value,
                        hash: Vec::new(),
                        log: None,
                        partial: false,
                    }),
                }),
            }
        }
        if !read_back.is_empty() {
            refused.extend(self.read_back(&mut conn, writes, read_back).await?);
        }
        if !read_some.is_empty() {
            refused.extend(self.read_back_some(&mut conn, writes, read_some).await?);
        }
        Ok(refused)
    }

    /// One transaction reading, per caller of `which` writes, its state
    /// string, what `records` asks of its records hash (given the hash's
    /// key), and its log kept apart: three replies per caller, in order.
    fn read_pipe(
        &self,
        writes: &[Write],
        which: &[usize],
        records: impl Fn(&Write, String) -> redis::Cmd,
    ) -> redis::Pipeline {
        let mut pipe = redis::pipe();
        pipe.atomic();
        for &i in which {
            let w = &writes[i];
            pipe.cmd("GET").arg(self.state_key(&w.caller));
            pipe.add_command(records(w, self.records_key(&w.caller)));
            pipe.cmd("GET").arg(self.log_key(&w.caller));
        }
        pipe
    }

    /// The state of the callers of `which` writes with only the records of
    /// their `read_ids`: state string, those records (`HMGET`) and the log
    /// kept apart, in one transaction, so the three agree and no version
    /// check is needed after. One round trip whatever the caller's
    /// records, where [`Self::read_back`] scans them all.
    async fn read_back_some(
        &self,
        conn: &mut Conn,
        writes: &[Write],
        which: Vec<usize>,
    ) -> Result<Vec<Refused>, redis::RedisError> {
        let pipe = self.read_pipe(writes, &which, |w, records| {
            let mut hmget = redis::cmd("HMGET");
            hmget.arg(records);
            for id in w.read_ids.iter().flatten() {
                hmget.arg(id.as_str());
            }
            hmget
        });
        let mut it = conn
            .query(&pipe, self.config.timeout * 2)
            .await?
            .into_iter();
        let mut out = Vec::with_capacity(which.len());
        for write in which {
            let (Some(value), Some(Value::Array(got)), Some(log)) =
                (it.next(), it.next(), it.next())
            else {
                return Err(unexpected("a malformed partial read back".into()));
            };
            let ids = writes[write].read_ids.iter().flatten();
            let hash = ids
                .zip(got)
                .filter(|(_, rec)| *rec != Value::Nil)
                .flat_map(|(id, rec)| [Value::BulkString(id.as_bytes().to_vec()), rec])
                .collect();
            out.push(Refused {
                write,
                read: Some(Found {
                    value: bulk(value)?,
                    hash,
                    log: bulk(log)?,
                    partial: true,
                }),
            });
        }
        Ok(out)
    }

    /// The whole state of the callers of `which` writes: state string,
    /// records hash and log kept apart, read in one transaction with the
    /// first [`SCAN_COUNT`] records; a busy caller's further records are
    /// read [`SCAN_COUNT`] at a time (`HSCAN`), so no call holds Redis for
    /// long, and its version is checked again after them: a caller written
    /// meanwhile comes back unread.
    async fn read_back(
        &self,
        conn: &mut Conn,
        writes: &[Write],
        which: Vec<usize>,
    ) -> Result<Vec<Refused>, redis::RedisError> {
        let pipe = self.read_pipe(writes, &which, |_, records| {
            let mut hscan = redis::cmd("HSCAN");
            hscan.arg(records).arg(0).arg("COUNT").arg(SCAN_COUNT);
            hscan
        });
        let mut it = conn
            .query(&pipe, self.config.timeout * 2)
            .await?
            .into_iter();
        let mut out = Vec::with_capacity(which.len());
        for write in which {
            let (Some(value), Some(scan), Some(log)) = (it.next(), it.next(), it.next()) else {
                return Err(unexpected("a malformed read back".into()));
            };
            let value = bulk(value)?;
            let (mut cursor, mut hash) = scanned(scan)?;
            if cursor != 0 {
                let records = self.records_key(&writes[write].caller);
                while cursor != 0 {
                    let mut pipe = redis::pipe();
                    pipe.cmd("HSCAN")
                        .arg(&records)
                        .arg(cursor)
                        .arg("COUNT")
                        .arg(SCAN_COUNT);
                    let reply = conn.query(&pipe, self.config.timeout).await?.pop();
                    let (next, more) = scanned(reply.unwrap_or(Value::Nil))?;
                    hash.extend(more);
                    cursor = next;
                }
                let mut pipe = redis::pipe();
                pipe.cmd("GETRANGE")
                    .arg(self.state_key(&writes[write].caller))
                    .arg(0)
                    .arg(7);
                let now = bulk(
                    conn.query(&pipe, self.config.timeout)
                        .await?
                        .pop()
                        .unwrap_or(Value::Nil),
                )?;
                let before = value.as_deref().and_then(|v| v.get(..8));
                if now.as_deref() != before {
                    // Written while its records were read: read again in
                    // the next round, which the round limit bounds.
                    out.push(Refused { write, read: None });
                    continue;
                }
                hash = distinct_fields(hash);
            }
            out.push(Refused {
                write,
                read: Some(Found {
                    value,
                    hash,
                    log: bulk(log)?,
                    partial: false,
                }),
            });
        }
        Ok(out)
    }
}
