//! A volume's life through the CSI calls: create, stage, publish (mount and
//! block, read-only and twice), stats, expansion, unpublish, unstage, delete.

use super::*;

/// The whole life of a mount volume, every call made twice.
pub(super) fn lifecycle_mount(fs: &'static str) -> impl FnOnce() -> Result<(), Failed> {
    move || {
        let a = Agent::start();
        let size = if fs == "xfs" { 320 * MIB } else { 64 * MIB };
        let v = a.create("pvc-life", size, fs)?;
        check(v.capacity_bytes == size, "capacity as asked")?;
        check(a.create("pvc-life", size, fs)? == v, "create is idempotent")?;
        let (staging, target) = (a.k("plugins/stage/pvc-life"), a.k("pods/p1/volumes/pvc-life"));
        for _ in 0..2 {
            a.stage("pvc-life", &staging, mount_cap(fs))?;
        }
        for _ in 0..2 {
            a.publish("pvc-life", &staging, &target, mount_cap(fs), false)?;
        }
        let found = String::from_utf8(std::process::Command::new("findmnt").args(["-no", "FSTYPE", &target]).output()?.stdout)?;
        check(found.trim() == fs, format!("target is {fs}, findmnt says {found:?}"))?;
        let before = a.stats("pvc-life", &target)?;
        let used0 = bytes_usage(&before).map(|u| u.used).unwrap_or(-1);
        let mut f = std::fs::File::create(format!("{target}/data"))?;
        f.write_all(&vec![7u8; 8 << 20])?;
        f.sync_all()?;
        drop(f);
        let after = a.stats("pvc-life", &target)?;
        let used1 = bytes_usage(&after).map(|u| u.used).unwrap_or(-1);
        check(used1 >= used0 + (8 << 20), format!("used grew by 8 MiB: {used0} -> {used1}"))?;
        check(after.usage.iter().any(|u| u.unit == volume_usage::Unit::Inodes as i32 && u.used > 0), "inode usage")?;
        check(after.volume_condition.as_ref().is_some_and(|c| !c.abnormal), "healthy")?;
        // The staging path reports too.
        check(bytes_usage(&a.stats("pvc-life", &staging)?).is_some(), "stats at the staging path")?;
        for _ in 0..2 {
            a.unpublish("pvc-life", &target)?;
        }
        check(!std::path::Path::new(&target).exists(), "target removed")?;
        for _ in 0..2 {
            a.unstage("pvc-life", &staging)?;
        }
        all_gone(&a)?;
        for _ in 0..2 {
            a.delete("pvc-life")?;
        }
        check(!a.image("pvc-life").exists(), "image removed")
    }
}

pub(super) fn lifecycle_block() -> Result<(), Failed> {
    let a = Agent::start();
    a.create("pvc-blk", 32 * MIB, "")?;
    let (staging, target) = (a.k("plugins/stage/pvc-blk"), a.k("pods/p1/dev/pvc-blk"));
    for _ in 0..2 {
        a.stage("pvc-blk", &staging, block_cap())?;
        a.publish("pvc-blk", &staging, &target, block_cap(), false)?;
    }
    // Write through the published device; read back from the image.
    let dev = std::fs::OpenOptions::new().read(true).write(true).open(&target)?;
    dev.write_all_at(b"volring block path", 5 * MIB as u64)?;
    dev.sync_all()?;
    let mut back = [0u8; 18];
    std::fs::File::open(a.image("pvc-blk"))?.read_exact_at(&mut back, 5 * MIB as u64)?;
    check(&back == b"volring block path", "data reached the image")?;
    let s = a.stats("pvc-blk", &target)?;
    check(bytes_usage(&s).is_some_and(|u| u.total == 32 * MIB), format!("block size in stats: {s:?}"))?;
    // Expanding a block volume needs no node step: the device grows at once.
    let e = a.expand("pvc-blk", 48 * MIB, block_cap())?;
    check(e.capacity_bytes == 48 * MIB && !e.node_expansion_required, format!("block expand: {e:?}"))?;
    let mut devf = std::fs::File::open(&target)?;
    check(devf.seek(SeekFrom::End(0))? == 48 * MIB as u64, "device sees the new size")?;
    drop((dev, devf));
    check(a.node_expand("pvc-blk", &target, 48 * MIB)? == 48 * MIB, "node expand is a no-op for block")?;
    for _ in 0..2 {
        a.unpublish("pvc-blk", &target)?;
        a.unstage("pvc-blk", &staging)?;
    }
    all_gone(&a)?;
    a.delete("pvc-blk")?;
    Ok(())
}

/// kubelet asks stats of a raw block volume at its own bind of the device
/// volring published, `<root>/plugins/kubernetes.io/csi/volumeDevices/<pv>/dev/<podUID>`,
/// a path volring never made: the volume is there when the path is its
/// device node (proven on one descriptor opened beneath the root), and
/// nowhere else: another volume's device, a symlink to the volume's own
/// device (inside the root or out of it, or on the way), a plain file, the
/// path once kubelet unbound it are NotFound.
pub(super) fn block_stats_at_kubelets_device_path() -> Result<(), Failed> {
    use std::path::Path;
    let a = Agent::start();
    let (s1, t1) = (a.k("plugins/stage/pvc-kb"), a.k("pods/p1/dev/pvc-kb"));
    let (s2, t2) = (a.k("plugins/stage/pvc-kb2"), a.k("pods/p2/dev/pvc-kb2"));
    for (id, staging, target) in [("pvc-kb", &s1, &t1), ("pvc-kb2", &s2, &t2)] {
        a.create(id, 32 * MIB, "")?;
        a.stage(id, staging, block_cap())?;
        a.publish(id, staging, target, block_cap(), false)?;
    }
    let dev_dir = a.kubelet.join("plugins/kubernetes.io/csi/volumeDevices/pvc-kb/dev");
    std::fs::create_dir_all(&dev_dir)?;
    let at = |name: &str| dev_dir.join(name).to_string_lossy().into_owned();
    let bind = |from: &str, to: &str| -> Result<(), Failed> {
        std::fs::File::create(to)?;
        rustix::mount::mount_bind(from, to)?;
        Ok(())
    };
    let kubelet_dev = at("pod-uid-1");
    bind(&t1, &kubelet_dev)?;
    let s = a.stats("pvc-kb", &kubelet_dev)?;
    check(
        bytes_usage(&s).is_some_and(|u| u.total == 32 * MIB) && s.volume_condition.as_ref().is_some_and(|c| !c.abnormal),
        format!("stats at kubelet's bind of the device: {s:?}"),
    )?;
    let other = at("pod-uid-2");
    bind(&t2, &other)?;
    expect_code(a.stats("pvc-kb", &other), Code::NotFound, "stats at another volume's device")?;
    let rdev = std::os::unix::fs::MetadataExt::rdev(&std::fs::metadata(&t1)?);
    let loop_dev = format!("/dev/loop{}", rustix::fs::minor(rdev));
    check(Path::new(&loop_dev).exists(), format!("{loop_dev} is the volume's device"))?;
    std::os::unix::fs::symlink(&t1, at("link-in"))?;
    std::os::unix::fs::symlink(&loop_dev, at("link-out"))?;
    std::fs::write(at("plain"), b"not a device")?;
    let via = a.kubelet.join("plugins/kubernetes.io/csi/volumeDevices/via");
    std::os::unix::fs::symlink(&dev_dir, &via)?;
    let via_dev = via.join("pod-uid-1").to_string_lossy().into_owned();
    for p in [at("link-in"), at("link-out"), at("plain"), via_dev] {
        expect_code(a.stats("pvc-kb", &p), Code::NotFound, &format!("stats at {p}"))?;
    }
    for p in [&kubelet_dev, &other] {
        common::umount(Path::new(p));
    }
    expect_code(a.stats("pvc-kb", &kubelet_dev), Code::NotFound, "stats at kubelet's path once unbound")?;
    for (id, staging, target) in [("pvc-kb", &s1, &t1), ("pvc-kb2", &s2, &t2)] {
        a.unpublish(id, target)?;
        a.unstage(id, staging)?;
    }
    all_gone(&a)
}

pub(super) fn readonly_and_two_publishes() -> Result<(), Failed> {
    let a = Agent::start();
    a.create("pvc-ro", 32 * MIB, "")?;
    let staging = a.k("plugins/stage/pvc-ro");
    let (rw, ro) = (a.k("pods/a/vol"), a.k("pods/b/vol"));
    a.stage("pvc-ro", &staging, mount_cap(""))?;
    a.publish("pvc-ro", &staging, &rw, mount_cap(""), false)?;
    a.publish("pvc-ro", &staging, &ro, mount_cap(""), true)?;
    std::fs::write(format!("{rw}/shared"), b"seen by both")?;
    check(std::fs::read(format!("{ro}/shared"))? == b"seen by both", "both targets show the same filesystem")?;
    let err = std::fs::write(format!("{ro}/nope"), b"x").expect_err("read-only target refuses writes");
    check(err.raw_os_error() == Some(libc::EROFS), format!("EROFS, got {err}"))?;
    // The same target again with another readonly flag is a conflict.
    expect_code(a.publish("pvc-ro", &staging, &ro, mount_cap(""), false), Code::AlreadyExists, "republish rw over ro")?;
    expect_code(a.unstage("pvc-ro", &staging), Code::FailedPrecondition, "unstage while published")?;
    a.unpublish("pvc-ro", &rw)?;
    a.unpublish("pvc-ro", &ro)?;
    a.unstage("pvc-ro", &staging)?;
    // A reader-only capability stages read-only.
    let ro_cap = capability(false, "", &[], Mode::SingleNodeReaderOnly);
    a.stage("pvc-ro", &staging, ro_cap.clone())?;
    a.publish("pvc-ro", &staging, &rw, ro_cap, false)?;
    check(std::fs::write(format!("{rw}/nope"), b"x").is_err(), "reader-only access is read-only")?;
    a.unpublish("pvc-ro", &rw)?;
    a.unstage("pvc-ro", &staging)?;
    all_gone(&a)
}

/// Grows the image, then the mounted filesystem, while a pod uses it.
pub(super) fn expand_while_published(fs: &'static str) -> impl FnOnce() -> Result<(), Failed> {
    move || {
        let a = Agent::start();
        let (small, big) = if fs == "xfs" { (320 * MIB, 512 * MIB) } else { (64 * MIB, 256 * MIB) };
        a.create("pvc-grow", small, fs)?;
        let (staging, target) = (a.k("plugins/stage/pvc-grow"), a.k("pods/g/vol"));
        a.stage("pvc-grow", &staging, mount_cap(fs))?;
        a.publish("pvc-grow", &staging, &target, mount_cap(fs), false)?;
        let total = |a: &Agent| -> Result<i64, Failed> { Ok(bytes_usage(&a.stats("pvc-grow", &target)?).map(|u| u.total).unwrap_or(0)) };
        let before = total(&a)?;
        let e = a.expand("pvc-grow", big, mount_cap(fs))?;
        check(e.capacity_bytes == big && e.node_expansion_required, format!("controller expand: {e:?}"))?;
        let node = a.node_expand("pvc-grow", &target, big);
        if fs == "ext4" && !ext4_grows_mounted() {
            // This machine withholds CAP_SYS_RESOURCE; the answer must say so.
            expect_code(node, Code::FailedPrecondition, "ext4 grow without CAP_SYS_RESOURCE")?;
        } else {
            check(node? == big, "node expand reports the new size")?;
            let after = total(&a)?;
            check(after > before + (big - small) / 2, format!("{fs} grew: {before} -> {after}"))?;
            // Idempotent.
            a.node_expand("pvc-grow", &target, big)?;
        }
        check(a.expand("pvc-grow", big, mount_cap(fs))?.capacity_bytes == big, "controller expand is idempotent")?;
        a.unpublish("pvc-grow", &target)?;
        a.unstage("pvc-grow", &staging)?;
        all_gone(&a)
    }
}

/// With `--expansion node` (what deploy/ runs) the controller does not
/// offer expansion and NodeExpandVolume grows the image, the device and
/// the filesystem on the volume's own node. The old code answered
/// OutOfRange ("grow it with ControllerExpandVolume first").
pub(super) fn node_expansion_grows_where_the_volume_lives() -> Result<(), Failed> {
    let mut a = Agent::start();
    a.respawn_with(&[("VOLRING_EXPANSION", "node")]);
    let mut c = a.c.controller.clone();
    let caps = a.run(c.controller_get_capabilities(ControllerGetCapabilitiesRequest {}))?.into_inner();
    let expand = controller_service_capability::rpc::Type::ExpandVolume as i32;
    let offered =
        caps.capabilities.iter().any(|c| matches!(&c.r#type, Some(controller_service_capability::Type::Rpc(r)) if r.r#type == expand));
    check(!offered, "the controller does not offer EXPAND_VOLUME")?;
    a.create("pvc-nb", 32 * MIB, "")?;
    expect_code(a.expand("pvc-nb", 48 * MIB, block_cap()), Code::Unimplemented, "ControllerExpandVolume")?;
    let (staging, target) = (a.k("plugins/stage/pvc-nb"), a.k("pods/nb/dev"));
    a.stage("pvc-nb", &staging, block_cap())?;
    a.publish("pvc-nb", &staging, &target, block_cap(), false)?;
    check(a.node_expand("pvc-nb", &target, 48 * MIB)? == 48 * MIB, "node expand grows a block volume")?;
    check(std::fs::metadata(a.image("pvc-nb"))?.len() == 48 * MIB as u64, "the image grew")?;
    check(std::fs::File::open(&target)?.seek(SeekFrom::End(0))? == 48 * MIB as u64, "the device sees the new size")?;
    check(a.node_expand("pvc-nb", &target, 48 * MIB)? == 48 * MIB, "a retry is a no-op")?;
    expect_code(a.node_expand("pvc-nb", &target, -1), Code::InvalidArgument, "negative size")?;
    a.unpublish("pvc-nb", &target)?;
    a.unstage("pvc-nb", &staging)?;

    a.create("pvc-nx", 320 * MIB, "xfs")?;
    let (staging, target) = (a.k("plugins/stage/pvc-nx"), a.k("pods/nx/vol"));
    a.stage("pvc-nx", &staging, mount_cap("xfs"))?;
    a.publish("pvc-nx", &staging, &target, mount_cap("xfs"), false)?;
    let total = |a: &Agent| -> Result<i64, Failed> { Ok(bytes_usage(&a.stats("pvc-nx", &target)?).map(|u| u.total).unwrap_or(0)) };
    let before = total(&a)?;
    check(a.node_expand("pvc-nx", &target, 512 * MIB)? == 512 * MIB, "node expand grows an xfs volume")?;
    let after = total(&a)?;
    check(after > before + 96 * MIB, format!("xfs grew: {before} -> {after}"))?;
    a.unpublish("pvc-nx", &target)?;
    a.unstage("pvc-nx", &staging)?;
    all_gone(&a)
}
