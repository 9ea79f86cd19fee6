//! A steady write load on a volume, for tests that tell a busy volume
//! from an idle one.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// dd writing to `dir` with direct I/O, over and over, until dropped (at
/// most 10,000 rounds).
pub struct Load {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Load {
    pub fn on(dir: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, file) = (stop.clone(), format!("of={dir}/load"));
        let thread = std::thread::spawn(move || {
            for _ in 0..10_000 {
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                let ok = Command::new("dd")
                    .args(["if=/dev/zero", &file, "bs=4k", "count=2048", "oflag=direct", "conv=notrunc"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                if !ok {
                    break;
                }
            }
        });
        Self { stop, thread: Some(thread) }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
