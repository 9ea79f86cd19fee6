//! One object's job: what to write (a plan made from what is wanted and
//! what is stored), the writes themselves, and what the job learned.

use super::{bump, GonePolicy, Part, Sink, SinkError, Stats, Want};
use crate::objects::{Key, Object};
use crate::pace::Gate;

/// How a job's requests went, for the limit and the outage.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sent {
    /// The limit's epoch it was sent at.
    pub(super) epoch: u64,
    /// Sent as the probe of a server that was down.
    pub(super) probe: bool,
}

/// What one object's job learned.
pub(super) struct Outcome {
    pub(super) key: Key,
    pub(super) want: Want,
    pub(super) attempts: u32,
    pub(super) sent: Sent,
    /// What is stored now, as far as the job knows.
    pub(super) stored: Option<Object>,
    pub(super) error: Option<SinkError>,
    /// Something was written or deleted.
    pub(super) wrote: bool,
    /// It was read first: the watch saw someone else's change.
    pub(super) confirm: bool,
}

/// What a job does for one object.
#[derive(Debug, Clone)]
pub(super) enum Plan {
    Write(Object),
    /// Read what is stored, then write what differs from it.
    Confirm(Object),
    Delete,
}

/// `None` when the sink already holds what is wanted.
pub(super) fn plan(key: &Key, want: &Want, stored: Option<&Object>, gone: GonePolicy) -> Option<Plan> {
    match want {
        Want::Put(o) => needs(o, stored).then(|| Plan::Write(o.clone())),
        Want::Retire => {
            let s = stored?;
            debug_assert_eq!(&s.key, key);
            match gone {
                GonePolicy::Delete => Some(Plan::Delete),
                GonePolicy::MarkInactive => s.retired().filter(|r| needs(r, stored)).map(Plan::Write),
            }
        }
        Want::Remove => stored.map(|_| Plan::Delete),
        // Resolved to the desired object before planning.
        Want::Repair => None,
    }
}

fn main_differs(o: &Object, stored: Option<&Object>) -> bool {
    stored.is_none_or(|s| s.labels != o.labels || s.spec != o.spec)
}

fn status_differs(o: &Object, stored: Option<&Object>) -> bool {
    !o.status.is_null() && stored.is_none_or(|s| s.status != o.status)
}

fn needs(o: &Object, stored: Option<&Object>) -> bool {
    main_differs(o, stored) || status_differs(o, stored)
}

/// Runs one object's writes; a conflict re-reads it once and tries again
/// (a confirm reads it first). Returns what is stored afterwards, the
/// error that stopped it, and whether anything was written or deleted.
pub(super) async fn run_job<S: Sink>(
    sink: &S,
    gate: &Gate,
    stats: &Stats,
    key: &Key,
    plan: Plan,
    mut stored: Option<Object>,
) -> (Option<Object>, Option<SinkError>, bool) {
    let mut wrote = false;
    let mut reread = false;
    let (plan, mut read_first) = match plan {
        Plan::Confirm(o) => (Plan::Write(o), true),
        p => (p, false),
    };
    loop {
        if read_first {
            gate.pass().await;
            bump(&stats.requests);
            match sink.get(key).await {
                Ok(now) => stored = now,
                Err(e) => {
                    count(stats, &e);
                    return (stored, Some(e), wrote);
                }
            }
            if let Plan::Write(o) = &plan {
                if !needs(o, stored.as_ref()) {
                    return (stored, None, wrote);
                }
            }
        }
        let r = match &plan {
            Plan::Delete => {
                gate.pass().await;
                bump(&stats.requests);
                sink.delete(key).await.map(|()| {
                    bump(&stats.deletes);
                    wrote = true;
                    stored = None;
                })
            }
            Plan::Write(o) => write(sink, gate, stats, o, &mut stored, &mut wrote).await,
            Plan::Confirm(_) => unreachable!("made a write above"),
        };
        let err = match r {
            Ok(()) => return (stored, None, wrote),
            Err(e) => e,
        };
        count(stats, &err);
        if !matches!(err, SinkError::Conflict(_)) || reread {
            return (stored, Some(err), wrote);
        }
        // A conflict: read it once and try again.
        reread = true;
        read_first = true;
    }
}

fn count(stats: &Stats, err: &SinkError) {
    match err {
        SinkError::Throttled { .. } => bump(&stats.throttled),
        SinkError::Conflict(_) => bump(&stats.conflicts),
        SinkError::Unavailable(_) | SinkError::Overloaded { .. } => bump(&stats.unavailable),
        SinkError::Refused(_) => bump(&stats.refused),
    }
}

/// Writes the parts of `o` that differ from `stored`, main first (it
/// creates the object), updating `stored` as each lands.
async fn write<S: Sink>(
    sink: &S,
    gate: &Gate,
    stats: &Stats,
    o: &Object,
    stored: &mut Option<Object>,
    wrote: &mut bool,
) -> Result<(), SinkError> {
    if main_differs(o, stored.as_ref()) {
        gate.pass().await;
        bump(&stats.requests);
        sink.write(o, Part::Main).await?;
        *wrote = true;
        bump(&stats.writes_main);
        let status = stored.take().map(|s| s.status).unwrap_or(serde_json::Value::Null);
        *stored = Some(Object { status, ..o.clone() });
    }
    if status_differs(o, stored.as_ref()) {
        gate.pass().await;
        bump(&stats.requests);
        sink.write(o, Part::Status).await?;
        *wrote = true;
        bump(&stats.writes_status);
        if let Some(s) = stored.as_mut() {
            s.status = o.status.clone();
        }
    }
    Ok(())
}
