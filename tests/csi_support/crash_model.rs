//! The crash loop's model of what the CO asked for (tests/crash_loop.rs):
//! volume kinds, lifecycle states, the CO's steps between them, and a
//! small seeded random number generator (so a failing run replays from its
//! seed, with no dependency).

use volring_csi::proto::VolumeCapability;

use super::{block_cap, mount_cap, MIB};

/// Every fault point the agent has (`VOLRING_FAULT_POINT`), in the order a
/// volume's life reaches them: the crash loop's own list of where it kills.
/// The agent's unit test (volring-volumes `fault`) keeps it equal to the
/// points in the agent's source, and the loop fails a run in which a listed
/// point never fired.
pub const POINTS: &[&str] = &[
    "pool.create.created",
    "pool.create.sized",
    "pool.create.placed",
    "pool.create.recorded",
    "stage:attach",
    "stage:attached",
    "stage:path",
    "stage:mkfs",
    "stage:formatted",
    "stage:mount",
    "stage:mounted",
    "stage:staged",
    "publish:target",
    "publish:bind",
    "publish:bound",
    "pool.expand.grown",
    "pool.expand.recorded",
    "expand:refreshed",
    "node_expand:refreshed",
    "node_expand:grow",
    "node_expand:grown",
    "unpublish:unmounted",
    "unpublish:removed",
    "unpublish:done",
    "unstage:intent",
    "unstage:unmounted",
    "unstage:removed",
    "unstage:detached",
    "unstage:done",
    "pool.delete.tombstoned",
    "pool.delete.unrecorded",
    "pool.delete.removed",
];

/// The CSI call a point of [`POINTS`] lies in, by its name (the part before
/// the first `:` or `.`, after an optional `pool.`): `create`, `stage`,
/// `publish`, `expand`, `node_expand`, `unpublish`, `unstage` or `delete`.
pub fn call_of(point: &str) -> &str {
    let name = point.strip_prefix("pool.").unwrap_or(point);
    name.split([':', '.']).next().unwrap_or(name)
}

/// xorshift64*, seeded through splitmix64 so any seed (0 too) works.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self((z ^ (z >> 31)) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True with probability 1/n.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    pub fn shuffled<T: Copy>(&mut self, items: &[T]) -> Vec<T> {
        let mut v = items.to_vec();
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
        v
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Ext4,
    Xfs,
    Block,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Ext4, Kind::Xfs, Kind::Block];

    pub fn fs(self) -> &'static str {
        match self {
            Kind::Ext4 => "ext4",
            Kind::Xfs => "xfs",
            Kind::Block => "",
        }
    }

    pub fn is_fs(self) -> bool {
        self != Kind::Block
    }

    pub fn cap(self) -> VolumeCapability {
        if self.is_fs() {
            mount_cap(self.fs())
        } else {
            block_cap()
        }
    }

    pub fn size(self) -> i64 {
        match self {
            Kind::Ext4 => 32 * MIB,
            Kind::Xfs => 300 * MIB,
            Kind::Block => 16 * MIB,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum State {
    Absent,
    Created,
    Staged,
    Published,
}

/// A step of the CO's; all but `Write` (the pod writing) are CSI calls.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Op {
    Create,
    Stage,
    Publish,
    Write,
    Expand,
    NodeExpand,
    Unpublish,
    Unstage,
    Delete,
}

impl Op {
    /// The call's name as [`call_of`] gives it.
    pub fn call(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Stage => "stage",
            Op::Publish => "publish",
            Op::Write => "write",
            Op::Expand => "expand",
            Op::NodeExpand => "node_expand",
            Op::Unpublish => "unpublish",
            Op::Unstage => "unstage",
            Op::Delete => "delete",
        }
    }
}

/// What the CO believes of one volume.
pub struct Vol {
    pub id: String,
    pub kind: Kind,
    pub size: i64,
    pub state: State,
    pub staging: String,
    pub target: String,
    /// The size a ControllerExpandVolume under way asks for.
    pub grow_to: i64,
    /// The size before the last ControllerExpandVolume.
    pub grown_from: i64,
    /// The filesystem's size before the NodeExpandVolume under way.
    pub fs_before: u64,
    /// Data written through the published volume, in order.
    pub tokens: Vec<String>,
    pub ever_published: bool,
}

/// The steps that take a volume from `from` to `to`.
pub fn steps(from: State, to: State) -> Vec<Op> {
    const UP: [(State, &[Op]); 3] =
        [(State::Absent, &[Op::Create]), (State::Created, &[Op::Stage]), (State::Staged, &[Op::Publish, Op::Write])];
    const DOWN: [(State, Op); 3] = [(State::Published, Op::Unpublish), (State::Staged, Op::Unstage), (State::Created, Op::Delete)];
    let mut ops = Vec::new();
    if from < to {
        for (s, steps) in UP {
            if s >= from && s < to {
                ops.extend_from_slice(steps);
            }
        }
    } else {
        for (s, step) in DOWN {
            if s <= from && s > to {
                ops.push(step);
            }
        }
    }
    ops
}
