//! Loop devices a bench made, found and detached through sysfs (not
//! through volring's own scan, which is what some benches measure).

/// Detaches every loop device whose backing file lies below `dir` (read
/// from sysfs here, not through volring's own scan).
pub fn detach_loops_under(dir: &std::path::Path) {
    for e in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let Some(n) = e.file_name().to_str().and_then(|s| s.strip_prefix("loop")).and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) else { continue };
        if std::path::Path::new(b.trim_end_matches('\n')).starts_with(dir) {
            if let Ok(d) = volring_sys::loopdev::LoopDevice::open(n) {
                let _ = d.detach();
            }
        }
    }
}
