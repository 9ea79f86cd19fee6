//! Background load for a bench: N plain CPU spinners at default priority,
//! started before the rounds and stopped by PID when dropped (a panic
//! unwinds through the drop too; a bench killed outright takes them along,
//! as each asks the kernel for SIGKILL when its parent dies).
//!
//! The spinners are the bench binary itself, run with `--spin`.

use std::process::{Child, Command, Stdio};

/// The spinners; killed and reaped on drop.
pub struct Background {
    children: Vec<Child>,
}

impl Background {
    /// Starts `n` spinners (none for 0).
    pub fn start(n: usize) -> Background {
        let exe = std::env::current_exe().expect("the bench's own path");
        let children = (0..n)
            .map(|_| {
                Command::new(&exe)
                    .arg("--spin")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("background spinner")
            })
            .collect();
        Background { children }
    }

    pub fn len(&self) -> usize {
        self.children.len()
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        for c in &mut self.children {
            // By PID: Child::kill signals exactly this process.
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The spinner's body: dies with its parent, spins until killed.
pub fn spin() -> ! {
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    if std::os::unix::process::parent_id() == 1 {
        std::process::exit(0);
    }
    let mut x = 0u64;
    loop {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
}

/// How many spinners were asked for: `--background-load N` on the command
/// line or VOLRING_BENCH_BACKGROUND_LOAD=N.
pub fn requested() -> usize {
    let args: Vec<String> = std::env::args().collect();
    let from_args = args.iter().position(|a| a == "--background-load").and_then(|i| args.get(i + 1)).and_then(|n| n.parse().ok());
    from_args.or_else(|| std::env::var("VOLRING_BENCH_BACKGROUND_LOAD").ok().and_then(|n| n.parse().ok())).unwrap_or(0)
}

/// The 1-minute load average.
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg").ok().and_then(|s| s.split_whitespace().next()?.parse().ok()).unwrap_or(f64::NAN)
}
