//! Crash safety, proven by a loop. Each cycle starts the agent with one
//! fault point armed (see `src/fault.rs`; every point is visited in turn, in
//! a seeded order), drives ext4, xfs and block volumes through create →
//! stage → publish → write → expand → unpublish → unstage → delete, or a
//! part of it, and — when the agent dies at the point — starts a plain agent
//! on the same state and retries the interrupted call as kubelet or the
//! external provisioner would: the same request again — or, now and then,
//! the reverse call, as kubelet does for an uncertain stage or publish whose
//! pod went away (unstage, unpublish) and for a teardown whose volume a new
//! pod wants (stage, publish). Once a cycle at most, the agent that takes
//! over is itself armed with a point of the interrupted call, so recoveries
//! (also the agent's own, at start) get interrupted too.
//!
//! After every cycle the machine is compared with a model of what the CO
//! asked for, black-box — CSI answers, the mount table, sysfs and files, not
//! the agent's records: ListVolumes and the pool's images name exactly the
//! live volumes and no file names a deleted one; each staged volume has
//! exactly one loop device (backed by its image) and exactly its staging
//! mount and published targets, of that device; nothing else of the test's
//! is mounted or attached; a target unpublished is gone; and every file
//! written through a published volume (every block written, for block
//! volumes) reads back through the staging mount, also after crashes,
//! unstage and re-stage. Every call must succeed within a few attempts.
//!
//! `VOLRING_CRASH_CYCLES` (default 100) sets the number of cycles;
//! `VOLRING_CRASH_SEED` replays a run (the seed is printed).

mod common;
mod csi_support;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::check;
use csi_support::crash_model::{call_of, steps, Kind, Op, Rng, State, Vol, POINTS};
use csi_support::{files_under, fs_bytes, loop_backing_files, loop_dev, mounts_under, Agent, MIB};
use libtest_mimic::Failed;
use tonic::{Code, Status};
use volring_csi::proto::*;

type Res<T = ()> = Result<T, Failed>;

/// Live volumes at most; a cycle that needs a new one beyond this deletes
/// one first.
const MAX_LIVE: usize = 5;
/// Attempts of one call (the first and the retries) before the test fails.
const ATTEMPTS: u32 = 6;
/// What each ControllerExpandVolume adds.
const GROW: i64 = 64 * MIB;
/// Where block data is written (after the first MiB), one 4 KiB block per datum.
const BLOCK_DATA: u64 = 1 << 20;

struct World {
    a: Agent,
    rng: Rng,
    seed: u64,
    vols: Vec<Vol>,
    cycle: usize,
    point: &'static str,
    /// The running agent has `point` armed and it has not fired.
    armed: bool,
    fired: BTreeMap<&'static str, u32>,
    abandoned: u32,
    /// Errors a call answered before a retry succeeded.
    transient: Vec<String>,
    /// Whether the agent (started by this process) may grow a mounted ext4.
    ext4_grows: bool,
    /// This cycle's recovery was armed with a second point already.
    double_fault: bool,
    double_faults: u32,
}

impl World {
    fn fail(&self, what: impl std::fmt::Display) -> Failed {
        format!(
            "seed {} (VOLRING_CRASH_SEED={0} replays), cycle {}, point {}: {what}\n--- agent log, last lines ---\n{}",
            self.seed,
            self.cycle,
            self.point,
            self.a.log_tail(40)
        )
        .into()
    }

    fn live(&self) -> impl Iterator<Item = &Vol> {
        self.vols.iter().filter(|v| v.state != State::Absent)
    }

    // ---- one call, retried as kubelet does ----

    /// Runs `op` on volume `vi` until it succeeds. Returns false when the
    /// CO gave up an interrupted call for its reverse (the rest of the
    /// cycle's plan no longer applies).
    fn run(&mut self, vi: usize, op: Op, may_abandon: bool) -> Res<bool> {
        if op == Op::Write {
            self.write(vi)?;
            return Ok(true);
        }
        if op == Op::Expand {
            self.vols[vi].grow_to = self.vols[vi].size + GROW;
        }
        if op == Op::NodeExpand && self.vols[vi].kind.is_fs() {
            self.vols[vi].fs_before = fs_bytes(&self.vols[vi].staging).map_err(|e| format!("statvfs {}: {e}", self.vols[vi].staging))?;
        }
        let mut last = String::new();
        for attempt in 1..=ATTEMPTS {
            let err = match self.request(vi, op) {
                Ok(()) => {
                    self.apply(vi, op)?;
                    return Ok(true);
                }
                Err(s) => s,
            };
            if self.agent_died(&err) {
                self.crashed(op)?;
                // Kubelet does not always retry: an uncertain stage or
                // publish whose pod went away is torn down, and a teardown
                // whose volume a new pod wants is answered with a stage or
                // publish again.
                let instead = match op {
                    Op::Stage => Some(Op::Unstage),
                    Op::Publish => Some(Op::Unpublish),
                    Op::Unstage => Some(Op::Stage),
                    Op::Unpublish => Some(Op::Publish),
                    _ => None,
                };
                if let Some(back) = instead.filter(|_| may_abandon && self.rng.one_in(4)) {
                    self.abandoned += 1;
                    eprintln!(
                        "cycle {} ({}): {op:?} of {} interrupted; the CO calls {back:?} instead",
                        self.cycle, self.point, self.vols[vi].id
                    );
                    self.run(vi, back, false)?;
                    return Ok(false);
                }
                continue;
            }
            // The kernel grows a mounted ext4 only for CAP_SYS_RESOURCE;
            // without it the refusal is the answer (and is final).
            if op == Op::NodeExpand && self.vols[vi].kind == Kind::Ext4 && !self.ext4_grows {
                check(err.code() == Code::FailedPrecondition, format!("ext4 grow without CAP_SYS_RESOURCE: {err:?}"))
                    .map_err(|e| self.fail(msg(&e)))?;
                return Ok(true);
            }
            last = format!("{:?}: {}", err.code(), err.message());
            let line = format!("cycle {} ({}): {op:?} {} attempt {attempt}: {last}", self.cycle, self.point, self.vols[vi].id);
            eprintln!("{line}");
            self.transient.push(line);
            std::thread::sleep(Duration::from_millis(100 * u64::from(attempt)));
        }
        Err(self.fail(format!("{op:?} of {} did not succeed in {ATTEMPTS} attempts; last error {last}", self.vols[vi].id)))
    }

    fn request(&self, vi: usize, op: Op) -> Result<(), Status> {
        let (a, v) = (&self.a, &self.vols[vi]);
        match op {
            Op::Create => a.create(&v.id, v.kind.size(), v.kind.fs()).map(drop),
            Op::Stage => a.stage(&v.id, &v.staging, v.kind.cap()),
            Op::Publish => a.publish(&v.id, &v.staging, &v.target, v.kind.cap(), false),
            Op::Expand => a.expand(&v.id, v.grow_to, v.kind.cap()).map(drop),
            Op::NodeExpand => {
                let path = if v.state == State::Published { &v.target } else { &v.staging };
                a.node_expand(&v.id, path, v.size).map(drop)
            }
            Op::Unpublish => a.unpublish(&v.id, &v.target),
            Op::Unstage => a.unstage(&v.id, &v.staging),
            Op::Delete => a.delete(&v.id),
            Op::Write => unreachable!("not a CSI call"),
        }
    }

    /// Whether the call failed because the agent died. A dead agent cannot
    /// answer with a status of its own, only with a transport error; the
    /// process may take a moment to be reapable after its socket closed
    /// (30 s at most: on a loaded 2-core CI host that moment has no bound
    /// worth betting a test on, and the wait ends as soon as it is reaped).
    fn agent_died(&mut self, s: &Status) -> bool {
        if !matches!(s.code(), Code::Unavailable | Code::Unknown | Code::Cancelled) {
            return !self.a.alive();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if !self.a.alive() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// The agent died during `op`: it must be of SIGKILL, at the armed point,
    /// and that point must lie in `op`. Starts a plain agent.
    fn crashed(&mut self, op: Op) -> Res {
        if !self.a.died_at_point() {
            return Err(self.fail(format!("the agent died during {op:?}, not of SIGKILL")));
        }
        if !self.armed {
            return Err(self.fail(format!("the agent died during {op:?} with no fault point armed")));
        }
        if call_of(self.point) != op.call() {
            return Err(self.fail(format!("the agent died during {op:?}, but the armed point is in {}", call_of(self.point))));
        }
        self.armed = false;
        *self.fired.entry(self.point).or_default() += 1;
        // Now and then the recovery itself is interrupted: the agent that
        // takes over is armed with a point of the same call (the same one
        // again, or another), once per cycle.
        if !self.double_fault && self.rng.one_in(4) {
            let same: Vec<&'static str> = POINTS.iter().copied().filter(|p| call_of(p) == op.call()).collect();
            self.point = same[self.rng.below(same.len())];
            self.double_fault = true;
            self.double_faults += 1;
            eprintln!("cycle {}: the agent retrying {op:?} is armed at {}", self.cycle, self.point);
            if self.a.arm(self.point) {
                self.armed = true;
            } else {
                // The agent finishes interrupted operations before it is
                // ready; it died doing so. The next one, unarmed, finishes.
                eprintln!("cycle {}: it died at {} while recovering at start", self.cycle, self.point);
                *self.fired.entry(self.point).or_default() += 1;
                self.a.respawn();
            }
        } else {
            self.a.respawn();
        }
        Ok(())
    }

    fn apply(&mut self, vi: usize, op: Op) -> Res {
        let v = &mut self.vols[vi];
        match op {
            Op::Create => v.state = State::Created,
            Op::Stage => v.state = State::Staged,
            Op::Publish => {
                v.state = State::Published;
                v.ever_published = true;
            }
            Op::Expand => {
                v.grown_from = v.size;
                v.size = v.grow_to;
            }
            // The filesystem took (most of) what the image gained.
            Op::NodeExpand if v.kind.is_fs() && v.size > v.grown_from => {
                let total = fs_bytes(&v.staging).map_err(|e| format!("statvfs {}: {e}", v.staging))?;
                if total < v.fs_before + GROW as u64 / 2 {
                    let what = format!("{} has {total} bytes after NodeExpandVolume, {} before", v.id, v.fs_before);
                    return Err(self.fail(what));
                }
            }
            Op::NodeExpand | Op::Write => {}
            Op::Unpublish => v.state = State::Staged,
            Op::Unstage => v.state = State::Created,
            Op::Delete => v.state = State::Absent,
        }
        Ok(())
    }

    /// The pod writes a datum through the published target and syncs it.
    fn write(&mut self, vi: usize) -> Res {
        let v = &mut self.vols[vi];
        let n = v.tokens.len();
        let token = format!("seed {} cycle {} volume {} datum {n}", self.seed, self.cycle, v.id);
        if v.kind.is_fs() {
            let path = Path::new(&v.target).join(format!("data-{n}"));
            let f = std::fs::File::create(&path).map_err(|e| format!("create {}: {e}", path.display()))?;
            f.write_all_at(token.as_bytes(), 0)?;
            f.sync_all()?;
            std::fs::File::open(&v.target)?.sync_all()?;
        } else {
            let f = std::fs::OpenOptions::new().write(true).open(&v.target).map_err(|e| format!("open {}: {e}", v.target))?;
            f.write_all_at(token.as_bytes(), BLOCK_DATA + 4096 * n as u64)?;
            f.sync_all()?;
        }
        v.tokens.push(token);
        Ok(())
    }

    // ---- planning a cycle ----

    fn new_vol(&mut self, kind: Kind) -> usize {
        let n = self.vols.len();
        let id = format!("crash-{n:04}-{}", if kind.is_fs() { kind.fs() } else { "block" });
        let (staging, target) = (self.a.k(&format!("plugins/volring/{id}/globalmount")), self.a.k(&format!("pods/p{n}/volumes/{id}")));
        self.vols.push(Vol {
            id,
            kind,
            size: kind.size(),
            state: State::Absent,
            staging,
            target,
            grow_to: 0,
            grown_from: 0,
            fs_before: 0,
            tokens: Vec::new(),
            ever_published: false,
        });
        n
    }

    /// A call sequence that reaches `point`: the steps bringing a volume
    /// (new or live) to where the point's call applies, that call, and up to
    /// two further random steps.
    fn plan(&mut self, point: &str) -> Vec<(usize, Op)> {
        let call = call_of(point);
        let fresh = matches!(point, "stage:mkfs" | "stage:formatted");
        let grows = matches!(point, "node_expand:grow" | "node_expand:grown");
        let needs_fs = fresh || grows;
        let staged = [State::Staged, State::Published];
        let pre = match call {
            "create" => State::Absent,
            "stage" | "delete" => State::Created,
            "publish" | "unstage" => State::Staged,
            "unpublish" => State::Published,
            "expand" if point != "expand:refreshed" => [State::Created, State::Staged, State::Published][self.rng.below(3)],
            _ => staged[self.rng.below(2)],
        };
        let mut plan = Vec::new();
        let live: Vec<usize> = (0..self.vols.len()).filter(|&i| self.vols[i].state != State::Absent).collect();
        let fits = |k: Kind| match (needs_fs, grows) {
            (false, _) => true,
            (true, true) => k == Kind::Xfs || (k == Kind::Ext4 && self.ext4_grows),
            (true, false) => k.is_fs(),
        };
        let fitting: Vec<usize> = live.iter().copied().filter(|&i| fits(self.vols[i].kind)).collect();
        let new = pre == State::Absent || fresh || fitting.is_empty() || (live.len() < MAX_LIVE && self.rng.one_in(3));
        if new && live.len() >= MAX_LIVE {
            let victim = live[self.rng.below(live.len())];
            plan.extend(steps(self.vols[victim].state, State::Absent).into_iter().map(|op| (victim, op)));
        }
        let vi = if new {
            let kinds: &[Kind] = match needs_fs {
                true if grows && !self.ext4_grows => &[Kind::Xfs],
                true => &Kind::ALL[..2],
                false => &Kind::ALL,
            };
            let kind = kinds[self.rng.below(kinds.len())];
            self.new_vol(kind)
        } else {
            fitting[self.rng.below(fitting.len())]
        };
        let mut state = self.vols[vi].state;
        plan.extend(steps(state, pre).into_iter().map(|op| (vi, op)));
        state = pre;
        let main: &[Op] = match call {
            "create" => &[Op::Create],
            "stage" => &[Op::Stage],
            "publish" => &[Op::Publish, Op::Write],
            "expand" if pre >= State::Staged && (self.vols[vi].kind.is_fs() || self.rng.one_in(2)) => &[Op::Expand, Op::NodeExpand],
            "expand" => &[Op::Expand],
            "node_expand" => &[Op::Expand, Op::NodeExpand],
            "unpublish" => &[Op::Unpublish],
            "unstage" => &[Op::Unstage],
            _ => &[Op::Delete],
        };
        plan.extend(main.iter().map(|&op| (vi, op)));
        for &op in main {
            state = match op {
                Op::Create | Op::Unstage => State::Created,
                Op::Stage | Op::Unpublish => State::Staged,
                Op::Publish => State::Published,
                Op::Delete => State::Absent,
                _ => state,
            };
        }
        for _ in 0..self.rng.below(3) {
            let next = match state {
                State::Absent => break,
                State::Published => State::Staged,
                s if self.rng.one_in(2) => [State::Absent, State::Created, State::Staged][s as usize - 1],
                s => [State::Staged, State::Published][s as usize - 1],
            };
            plan.extend(steps(state, next).into_iter().map(|op| (vi, op)));
            state = next;
        }
        plan
    }

    // ---- the machine against the model ----

    fn check_world(&mut self) -> Res {
        self.check_listed()?;
        let devs = self.check_loops()?;
        self.check_mounts(&devs)?;
        self.check_data(&devs)?;
        self.check_conditions()
    }

    /// NodeGetVolumeStats finds every staged volume healthy, at its staging
    /// path and at its target.
    fn check_conditions(&self) -> Res {
        for v in self.live().filter(|v| v.state >= State::Staged) {
            let paths = if v.state == State::Published { vec![&v.staging, &v.target] } else { vec![&v.staging] };
            for p in paths {
                let r =
                    self.a.stats(&v.id, p).map_err(|s| self.fail(format!("stats of {} at {p}: {:?} {}", v.id, s.code(), s.message())))?;
                let cond = r.volume_condition.unwrap_or_default();
                check(!cond.abnormal, format!("{} at {p} is reported abnormal: {}", v.id, cond.message)).map_err(|e| self.fail(msg(&e)))?;
            }
        }
        Ok(())
    }

    /// ListVolumes and the pool's images name exactly the live volumes, at
    /// their sizes; no file under the state directory names a deleted one.
    fn check_listed(&self) -> Res {
        let mut c = self.a.c.controller.clone();
        let r = self.a.run(c.list_volumes(ListVolumesRequest::default()))?.into_inner();
        let mut listed: Vec<(String, i64)> =
            r.entries.into_iter().filter_map(|e| e.volume).map(|v| (v.volume_id, v.capacity_bytes)).collect();
        listed.sort();
        let want: BTreeMap<String, i64> = self.live().map(|v| (v.id.clone(), v.size)).collect();
        let expected: Vec<(String, i64)> = want.clone().into_iter().collect();
        check(listed == expected, format!("ListVolumes {listed:?}, the CO expects {expected:?}")).map_err(|e| self.fail(msg(&e)))?;
        let images: BTreeSet<String> = std::fs::read_dir(self.a.state.join("pool"))?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".img").map(str::to_string))
            .collect();
        let want: BTreeSet<String> = want.into_keys().collect();
        check(images == want, format!("pool images {images:?}, live volumes {want:?}")).map_err(|e| self.fail(msg(&e)))?;
        let gone: Vec<&str> = self.vols.iter().filter(|v| v.state == State::Absent).map(|v| v.id.as_str()).collect();
        let mut left = Vec::new();
        files_under(&self.a.state, 4, &mut |p| {
            if p.file_name().and_then(|n| n.to_str()).is_some_and(|n| gone.iter().any(|g| n.contains(g))) {
                left.push(p.to_path_buf());
            }
        });
        check(left.is_empty(), format!("files of deleted volumes are left: {left:?}")).map_err(|e| self.fail(msg(&e)))
    }

    /// Exactly one loop device per staged volume, backed by its image; none
    /// other backed by anything of the test's. Returns volume → device.
    fn check_loops(&self) -> Res<BTreeMap<String, u64>> {
        let scratch = self.a.scratch.path();
        let mut ours: Vec<(u32, PathBuf)> = loop_backing_files().into_iter().filter(|(_, b)| b.starts_with(scratch)).collect();
        let mut devs = BTreeMap::new();
        for v in self.live().filter(|v| v.state >= State::Staged) {
            let image = std::fs::canonicalize(self.a.image(&v.id))?;
            let mine: Vec<u32> = ours.iter().filter(|(_, b)| *b == image).map(|(n, _)| *n).collect();
            let [n] = mine[..] else { return Err(self.fail(format!("staged volume {} has loop devices {mine:?}, not one", v.id))) };
            devs.insert(v.id.clone(), loop_dev(n).ok_or_else(|| self.fail(format!("no dev for loop{n}")))?);
            ours.retain(|(m, _)| *m != n);
        }
        check(ours.is_empty(), format!("leaked loop devices: {ours:?}")).map_err(|e| self.fail(msg(&e)))?;
        Ok(devs)
    }

    /// Under the kubelet root exactly the staging mounts and targets of the
    /// staged and published volumes, each once and of the volume's device;
    /// an unpublished target is removed.
    fn check_mounts(&self, devs: &BTreeMap<String, u64>) -> Res {
        let mut mounts = mounts_under(&self.a.kubelet);
        let take = |m: &mut Vec<PathBuf>, p: &Path| m.iter().position(|x| x == p).map(|i| m.remove(i));
        for v in self.live().filter(|v| v.state >= State::Staged) {
            let dev = devs[&v.id];
            let staging = Path::new(&v.staging);
            // A block volume is bound on a file the driver picks inside the
            // staging directory: accept exactly one mount there.
            let at = if v.kind.is_fs() {
                take(&mut mounts, staging)
            } else {
                let inside: Vec<PathBuf> = mounts.iter().filter(|m| m.starts_with(staging)).cloned().collect();
                match inside[..] {
                    [ref p] => take(&mut mounts, p),
                    _ => None,
                }
            };
            let at = at.ok_or_else(|| self.fail(format!("{} ({:?}) is not mounted once at {}", v.id, v.state, v.staging)))?;
            self.is_device(v, &at, dev)?;
            if v.state == State::Published {
                let t =
                    take(&mut mounts, Path::new(&v.target)).ok_or_else(|| self.fail(format!("{} is not mounted at {}", v.id, v.target)))?;
                self.is_device(v, &t, dev)?;
            }
        }
        check(mounts.is_empty(), format!("leaked mounts: {mounts:?}")).map_err(|e| self.fail(msg(&e)))?;
        for v in self.vols.iter().filter(|v| v.ever_published && v.state < State::Published) {
            check(!Path::new(&v.target).exists(), format!("{}'s target {} is left after unpublish", v.id, v.target))
                .map_err(|e| self.fail(msg(&e)))?;
        }
        Ok(())
    }

    /// `p` is a filesystem on `dev` (mount volumes) or the device `dev`.
    fn is_device(&self, v: &Vol, p: &Path, dev: u64) -> Res {
        let st = rustix::fs::stat(p).map_err(|e| self.fail(format!("stat {}: {e}", p.display())))?;
        let got = if v.kind.is_fs() { st.st_dev } else { st.st_rdev };
        check(got == dev, format!("{} at {} is device {got:#x}, its loop device is {dev:#x}", v.id, p.display()))
            .map_err(|e| self.fail(msg(&e)))
    }

    /// Everything written through a published volume reads back through its
    /// staging mount.
    fn check_data(&self, devs: &BTreeMap<String, u64>) -> Res {
        for v in self.live().filter(|v| v.state >= State::Staged && !v.tokens.is_empty()) {
            for (n, token) in v.tokens.iter().enumerate() {
                let mut got = vec![0u8; token.len()];
                let read = if v.kind.is_fs() {
                    std::fs::read(Path::new(&v.staging).join(format!("data-{n}"))).map(|b| got = b)
                } else {
                    let file = mounts_under(Path::new(&v.staging)).into_iter().next().ok_or("no staged block file")?;
                    std::fs::File::open(file).and_then(|f| f.read_exact_at(&mut got, BLOCK_DATA + 4096 * n as u64))
                };
                if read.is_err() || got != token.as_bytes() {
                    let what =
                        format!("{} (device {:#x}) lost datum {n} ({read:?}): read {:?}", v.id, devs[&v.id], String::from_utf8_lossy(&got));
                    return Err(self.fail(what));
                }
            }
        }
        Ok(())
    }
}

fn msg(f: &Failed) -> String {
    f.message().unwrap_or("").to_string()
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.trim().parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")))
}

fn crash_loop_inner(w: &mut World, cycles: usize) -> Res {
    let started = Instant::now();
    let mut order = Vec::new();
    for cycle in 0..cycles {
        if cycle % POINTS.len() == 0 {
            order = w.rng.shuffled(POINTS);
        }
        w.cycle = cycle;
        w.point = order[cycle % POINTS.len()];
        // Nothing is pending between cycles: an agent dying at start here
        // did work it had no intent for.
        if !w.a.arm(w.point) {
            return Err(w.fail("the armed agent died before it was ready, with no operation pending"));
        }
        w.armed = true;
        w.double_fault = false;
        let plan = w.plan(w.point);
        for (vi, op) in plan {
            if !w.run(vi, op, true)? {
                break;
            }
        }
        w.check_world()?;
    }
    let per_cycle = started.elapsed() / cycles.max(1) as u32;
    // Tear everything down on a plain agent; then nothing may be left.
    w.a.respawn();
    w.armed = false;
    w.point = "(teardown)";
    for vi in 0..w.vols.len() {
        for op in steps(w.vols[vi].state, State::Absent) {
            w.run(vi, op, false)?;
        }
    }
    w.check_world()?;
    let not_fired: Vec<&str> = POINTS.iter().copied().filter(|p| !w.fired.contains_key(p)).collect();
    eprintln!(
        "crash_loop: seed {}, {cycles} cycles, {:.2} s per cycle, {} volumes ({} ext4, {} xfs, {} block), {} crashes ({} while recovering), \
         {} abandoned, {} transient errors; fired: {:?}",
        w.seed,
        per_cycle.as_secs_f64(),
        w.vols.len(),
        w.vols.iter().filter(|v| v.kind == Kind::Ext4).count(),
        w.vols.iter().filter(|v| v.kind == Kind::Xfs).count(),
        w.vols.iter().filter(|v| v.kind == Kind::Block).count(),
        w.fired.values().sum::<u32>(),
        w.double_faults,
        w.abandoned,
        w.transient.len(),
        w.fired
    );
    if cycles >= POINTS.len() {
        check(not_fired.is_empty(), format!("seed {}: fault points never reached: {not_fired:?}", w.seed))?;
    }
    Ok(())
}

#[test]
fn crash_loop() {
    volring_sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
    let cycles = env_u64("VOLRING_CRASH_CYCLES").unwrap_or(100) as usize;
    let seed = env_u64("VOLRING_CRASH_SEED")
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64));
    eprintln!("crash_loop: seed {seed} (VOLRING_CRASH_SEED={seed} replays this run), {cycles} cycles");
    let mut w = World {
        a: Agent::start(),
        rng: Rng::new(seed),
        seed,
        vols: Vec::new(),
        cycle: 0,
        point: "(start)",
        armed: false,
        fired: BTreeMap::new(),
        abandoned: 0,
        transient: Vec::new(),
        ext4_grows: csi_support::ext4_grows_mounted(),
        double_fault: false,
        double_faults: 0,
    };
    if let Err(e) = crash_loop_inner(&mut w, cycles) {
        panic!("{}", msg(&e));
    }
}
