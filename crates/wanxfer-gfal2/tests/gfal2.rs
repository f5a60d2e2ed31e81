//! The plugin as gfal2 loads it: Debian's gfal2 and its Python bindings (python3-gfal2)
//! run `tests/gfal2_plugin.py` with `GFAL_PLUGIN_DIR` pointing at a directory holding
//! the built `libgfal_plugin_wanxfer.so`, against a wanxfer server on loopback (the
//! engine's `Server`, what `wanxfer serve` runs, in this process). Once with the plugin
//! alone, every operation; once beside Debian's other plugins, which can stay where a
//! site has them.
//!
//! Without gfal2's Python bindings the test fails, saying what to install: CI installs
//! them (scripts/install-deps.sh), and a skipped test would hide a broken plugin.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

use wanxfer_engine::pool::Cancel;
use wanxfer_engine::session::{Server, ServerLimits};

const SECRET: &str = "gfal2-plugin-test-secret";

/// The plugin cargo built for this test run: `cargo test` leaves the cdylib in
/// `target/<profile>/deps`, beside the test binary (only `cargo build` copies it up to
/// `target/<profile>/`, where a copy may be stale).
fn plugin_library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let deps = exe.parent().expect("tests run from target/<profile>/deps");
    let lib = deps.join("libgfal_plugin_wanxfer.so");
    assert!(lib.is_file(), "{} was not built", lib.display());
    lib
}

/// A Python that has gfal2's bindings: Debian's (python3-gfal2 installs for it), or
/// whichever python3 comes first on PATH.
fn python() -> &'static str {
    for candidate in ["/usr/bin/python3", "python3"] {
        let ok = Command::new(candidate)
            .args(["-c", "import gfal2"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return candidate;
        }
    }
    panic!("no python3 with gfal2's bindings: apt-get install python3-gfal2 (scripts/install-deps.sh does)");
}

/// The served tree the script expects, with a directory outside the root that a symlink
/// inside it points at.
fn site() -> (tempfile::TempDir, PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir_all(root.join("data/sub")).unwrap();
    fs::write(root.join("data/hello.txt"), b"hello from wanxfer\n").unwrap();
    fs::set_permissions(
        root.join("data/hello.txt"),
        std::os::unix::fs::PermissionsExt::from_mode(0o640),
    )
    .unwrap();
    let big: Vec<u8> = (0..1_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    fs::write(root.join("data/big.bin"), big).unwrap();
    symlink("hello.txt", root.join("data/link")).unwrap();
    fs::write(root.join("data/.wanxfer-0011-2233.part"), b"partial").unwrap();
    fs::create_dir_all(dir.path().join("outside/sub")).unwrap();
    fs::write(dir.path().join("outside/precious"), b"keep me").unwrap();
    symlink(dir.path().join("outside"), root.join("escape")).unwrap();
    let server = Server::bind(
        "127.0.0.1:0",
        &root,
        Some(SECRET.as_bytes().to_vec()),
        ServerLimits::default(),
    )
    .expect("bind a loopback server");
    let addr = server.local_addr().unwrap();
    std::thread::spawn(move || server.serve(&Cancel::default()));
    (dir, root, format!("wanxfer://{addr}/"))
}

/// Runs the script in `mode` with the plugin directory `plugins` (and a `second`
/// server, base URL and root, for third-party copies); its output on failure.
fn run_script(
    plugins: &Path,
    base: &str,
    root: &Path,
    scratch: &Path,
    mode: &str,
    second: Option<(&str, &Path)>,
) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gfal2_plugin.py");
    let mut args = vec![
        base.to_string(),
        root.display().to_string(),
        scratch.display().to_string(),
        SECRET.to_string(),
        mode.to_string(),
    ];
    if let Some((base2, root2)) = second {
        args.push(base2.to_string());
        args.push(root2.display().to_string());
    }
    let out = Command::new(python())
        .arg(&script)
        .args(args)
        .env("GFAL_PLUGIN_DIR", plugins)
        // Its own pinned certificates: the user's known_hosts may pin another
        // certificate for a loopback port an earlier server used.
        .env("WANXFER_STATE_DIR", scratch.join("wanxfer-state"))
        .env("WANXFER_SECRET", SECRET)
        .env_remove("WANXFER_SECRET_FILE")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "gfal2_plugin.py {mode} failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}

#[test]
fn gfal2_drives_every_operation_through_the_plugin() {
    let (dir, root, base) = site();
    let plugins = dir.path().join("plugins");
    fs::create_dir(&plugins).unwrap();
    symlink(plugin_library(), plugins.join("libgfal_plugin_wanxfer.so")).unwrap();
    let scratch = dir.path().join("scratch");
    fs::create_dir(&scratch).unwrap();
    let (_second_dir, root2, base2) = site();
    run_script(
        &plugins,
        &base,
        &root,
        &scratch,
        "full",
        Some((&base2, &root2)),
    );
    // The third-party copies, seen from both servers.
    assert_eq!(
        fs::read(root2.join("tpc/big.bin")).unwrap(),
        fs::read(root2.join("data/big.bin")).unwrap()
    );
    assert_eq!(
        fs::read(root.join("data/hello.txt")).unwrap(),
        fs::read(root2.join("data/big.bin")).unwrap()
    );
    assert!(!root2.join("no").exists());
    // What the script did, seen from the server's side.
    assert_eq!(
        fs::read(root.join("copies/pushed.bin")).unwrap(),
        fs::read(scratch.join("push.bin")).unwrap()
    );
    assert!(!root.join("made/a/b/c").exists() && root.join("made/a/b").is_dir());
    // Nothing reached through the planted symlink.
    assert_eq!(
        fs::read(dir.path().join("outside/precious")).unwrap(),
        b"keep me"
    );
    let outside: Vec<_> = fs::read_dir(dir.path().join("outside")).unwrap().collect();
    assert_eq!(outside.len(), 2, "only precious and sub: {outside:?}");
    assert!(fs::read_dir(dir.path().join("outside/sub"))
        .unwrap()
        .next()
        .is_none());
}

/// Where this host's gfal2 keeps its plugins: `gfal2-plugins` in gfal2's library
/// directory, as Debian and gfal2's own build lay it out.
fn system_plugin_dir() -> PathBuf {
    let out = Command::new("pkg-config")
        .args(["--variable=libdir", "gfal2"])
        .output()
        .expect("run pkg-config");
    let libdir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        !libdir.is_empty(),
        "pkg-config does not know gfal2: apt-get install libgfal2-dev"
    );
    Path::new(&libdir).join("gfal2-plugins")
}

/// A site installs the plugin into gfal2's plugin directory beside the others: they
/// stay, and each claims only its own schemes.
#[test]
fn the_plugin_works_beside_debians_other_plugins() {
    let system = system_plugin_dir();
    let Ok(entries) = fs::read_dir(&system) else {
        panic!(
            "{} is missing: apt-get install gfal2 (scripts/install-deps.sh does)",
            system.display()
        );
    };
    let (dir, root, base) = site();
    let plugins = dir.path().join("plugins");
    fs::create_dir(&plugins).unwrap();
    for entry in entries.flatten() {
        symlink(entry.path(), plugins.join(entry.file_name())).unwrap();
    }
    symlink(plugin_library(), plugins.join("libgfal_plugin_wanxfer.so")).unwrap();
    let scratch = dir.path().join("scratch");
    fs::create_dir(&scratch).unwrap();
    run_script(&plugins, &base, &root, &scratch, "coexist", None);
    assert!(root.join("coexist.bin").is_file());
}
