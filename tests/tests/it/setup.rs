//! `scripts/setup.sh` (what `make demo`, `make test` and `.ci/run` start
//! with) against stand-in tools: what it installs, through what, and what
//! it tells a user who cannot install; and the Makefile honouring
//! `CARGO_TARGET_DIR`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// A machine of stand-in tools: `present` exist (each does nothing), the
/// rest are missing; `id`, `sudo`, `apt-get` and `rustc` behave as the
/// options say, and `apt-get` logs its arguments.
struct Machine {
    dir: PathBuf,
}

impl Machine {
    fn new(name: &str, present: &[&str], uid: u32, sudo: Option<bool>, rust: &str) -> Machine {
        let dir = std::env::temp_dir().join(format!("gemini-setup-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let stub = |n: &str, body: &str| {
            let p = bin.join(n);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        // What the script itself uses from the real system.
        for tool in ["sed", "sort", "head"] {
            let real = ["/usr/bin", "/bin"]
                .iter()
                .map(|d| Path::new(d).join(tool))
                .find(|p| p.exists())
                .unwrap();
            std::os::unix::fs::symlink(real, bin.join(tool)).unwrap();
        }
        for p in present {
            match *p {
                // pkg-config present with glib's .pc file or without it.
                "pkg-config+glib" => stub("pkg-config", "exit 0"),
                "pkg-config" => stub("pkg-config", "exit 1"),
                // python3 without pip.
                "python3-nopip" => stub("python3", "case \"$*\" in -m*) exit 1;; esac\nexit 0"),
                other => stub(other, "exit 0"),
            }
        }
        stub("id", &format!("echo {uid}"));
        let log = dir.join("apt.log");
        stub(
            "apt-get",
            &format!("echo \"$(id -u) $*\" >> {}", log.display()),
        );
        if let Some(ok) = sudo {
            stub(
                "sudo",
                &format!(
                    "if [ \"$1\" = -n ]; then shift; {}; fi\n\"$@\"",
                    if ok { "true" } else { "exit 1" }
                ),
            );
        }
        if !rust.is_empty() {
            stub("cargo", "exit 0");
            stub("rustc", &format!("echo 'rustc {rust} (stand-in)'"));
        }
        Machine { dir }
    }

    fn setup(&self, args: &[&str]) -> Output {
        Command::new("/bin/bash")
            .arg(repo().join("scripts/setup.sh"))
            .args(args)
            .env_clear()
            .env("PATH", self.dir.join("bin"))
            .output()
            .expect("run scripts/setup.sh")
    }

    fn apt_calls(&self) -> String {
        std::fs::read_to_string(self.dir.join("apt.log")).unwrap_or_default()
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const ALL: &[&str] = &["pkg-config+glib", "cc", "c++", "make", "python3", "tmux"];
/// A fresh Debian machine with Rust: no glib headers, no pkg-config, no C++.
const FRESH: &[&str] = &["cc", "make", "python3", "tmux"];

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_complete_machine_installs_nothing_and_says_nothing() {
    let m = Machine::new("complete", ALL, 1000, None, "1.95.0");
    let o = m.setup(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    assert_eq!(m.apt_calls(), "");
}

#[test]
fn as_root_it_installs_what_is_missing_with_apt() {
    let m = Machine::new("root", FRESH, 0, None, "1.95.0");
    let o = m.setup(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        m.apt_calls(),
        "0 update -qq\n0 install -y -qq pkg-config libglib2.0-dev g++\n"
    );
}

#[test]
fn with_passwordless_sudo_it_installs_through_sudo() {
    // The stand-in sudo runs the command as the same user: the uid apt-get
    // logs is the caller's, and the calls went through sudo (no root here).
    let m = Machine::new(
        "sudo",
        &["pkg-config", "cc", "c++", "make", "python3", "tmux"],
        1000,
        Some(true),
        "1.95.0",
    );
    let o = m.setup(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        m.apt_calls(),
        "1000 update -qq\n1000 install -y -qq libglib2.0-dev\n"
    );
}

#[test]
fn without_root_or_sudo_it_prints_the_one_command_and_stops() {
    for (name, sudo) in [("nosudo", None), ("sudo-password", Some(false))] {
        let m = Machine::new(name, FRESH, 1000, sudo, "1.95.0");
        let o = m.setup(&[]);
        assert_eq!(o.status.code(), Some(1), "{name}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(
                "    sudo apt-get update && sudo apt-get install -y pkg-config libglib2.0-dev g++\n"
            ),
            "{name}: {}",
            stderr(&o)
        );
        assert_eq!(m.apt_calls(), "", "{name}");
    }
}

#[test]
fn check_only_reports_and_installs_nothing() {
    let m = Machine::new("check", FRESH, 0, None, "1.95.0");
    let o = m.setup(&["--check"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("missing: pkg-config libglib2.0-dev g++"),
        "{}",
        stderr(&o)
    );
    assert_eq!(m.apt_calls(), "");
    let bad = m.setup(&["--chek"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("unknown argument '--chek'"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn a_missing_or_old_rust_is_named_with_how_to_install_it() {
    for (rust, what) in [
        ("", "cargo not found"),
        ("1.80.1", "rustc 1.80 is older than 1.88"),
    ] {
        let m = Machine::new(&format!("rust{rust}"), ALL, 1000, None, rust);
        let o = m.setup(&[]);
        assert_eq!(o.status.code(), Some(1), "{rust}: {}", stderr(&o));
        assert!(stderr(&o).contains(what), "{rust}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("https://sh.rustup.rs"),
            "{}",
            stderr(&o)
        );
    }
}

#[test]
fn not_debian_names_the_packages_and_stops() {
    let m = Machine::new("notdebian", FRESH, 0, None, "1.95.0");
    std::fs::remove_file(m.dir.join("bin/apt-get")).unwrap();
    let o = m.setup(&[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("not a Debian or"), "{}", stderr(&o));
}

/// `make demo` runs the binaries from where cargo put them, also when
/// `CARGO_TARGET_DIR` moves them (it looked in `target/` before).
#[test]
fn the_makefile_runs_binaries_from_cargo_target_dir() {
    let dir = std::env::temp_dir().join(format!("gemini-target-{}", std::process::id()));
    for (target, want) in [
        (Some(dir.as_path()), dir.join("release/gem-demo")),
        (None, repo().join("target/release/gem-demo")),
    ] {
        let mut make = Command::new("make");
        make.args(["-n", "demo"])
            .current_dir(repo())
            .env_remove("CARGO_TARGET_DIR");
        // cargo as run by `make test` points the build at this target.
        make.env_remove("CARGO_BUILD_TARGET_DIR");
        if let Some(t) = target {
            make.env("CARGO_TARGET_DIR", t);
        }
        let o = make.output().expect("make");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{out}{}", stderr(&o));
        assert!(
            out.contains(&format!("{} examples/resource.conf", want.display())),
            "CARGO_TARGET_DIR={target:?}: {out}"
        );
    }
}

#[test]
fn pip_is_installed_where_apt_can_and_only_named_where_it_cannot() {
    let tools = [
        "pkg-config+glib",
        "cc",
        "c++",
        "make",
        "python3-nopip",
        "tmux",
    ];
    let m = Machine::new("pip-root", &tools, 0, None, "1.95.0");
    let o = m.setup(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        m.apt_calls(),
        "0 update -qq\n0 install -y -qq python3-pip\n"
    );
    // Without root or sudo, a missing pip does not stop the build.
    let m = Machine::new("pip-user", &tools, 1000, None, "1.95.0");
    let o = m.setup(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o)
            .contains("optional, for three tests that otherwise say NOT CHECKED: python3-pip"),
        "{}",
        stderr(&o)
    );
    assert_eq!(m.apt_calls(), "");
}

/// `make install` installs what `make release` built without running a
/// build (so `sudo make install` compiles nothing as root), strips the
/// binaries (the hook is loaded into every exec), installs the README the
/// units' `Documentation=` names, and says what to do when nothing was
/// built; `make uninstall` removes it all but the site's configuration.
#[test]
fn install_strips_and_builds_nothing_and_uninstall_removes_it() {
    let tmp = tempfile::tempdir().unwrap();
    let release = tmp.path().join("release");
    std::fs::create_dir(&release).unwrap();
    // A small program with debug info stands in for each built file.
    let src = tmp.path().join("fake.c");
    std::fs::write(&src, "int main(void) { return 0; }\n").unwrap();
    let fake = release.join("fake");
    let cc = Command::new("cc")
        .arg("-g")
        .arg("-o")
        .arg(&fake)
        .arg(&src)
        .output()
        .unwrap();
    assert!(cc.status.success(), "{}", stderr(&cc));
    for f in [
        "gem-schd",
        "gem-holder",
        "gem-launch",
        "gem-slurm",
        "libgemhook.so",
        "libgemzmq.so",
    ] {
        std::fs::copy(&fake, release.join(f)).unwrap();
    }
    let has_debug = |p: &Path| {
        let b = std::fs::read(p).unwrap();
        b.windows(11).any(|w| w == b".debug_info")
    };
    assert!(has_debug(&fake));
    let dest = tmp.path().join("root");
    let make = |target: &str, release: &Path| {
        Command::new("make")
            .arg(target)
            .arg(format!("RELEASE_DIR={}", release.display()))
            .arg(format!("DESTDIR={}", dest.display()))
            .arg("PREFIX=/usr")
            .env("CARGO", "false") // any cargo run would fail the target
            .current_dir(repo())
            .output()
            .unwrap()
    };
    let o = make("install", &release);
    assert!(o.status.success(), "{}", stderr(&o));
    for f in [
        "bin/gem-schd",
        "bin/gem-holder",
        "bin/gem-launch",
        "bin/gem-slurm",
        "lib/libgemhook.so",
        "lib/libgemzmq.so",
    ] {
        let p = dest.join("usr").join(f);
        assert!(p.exists(), "{f} not installed");
        assert!(!has_debug(&p), "{f} not stripped");
    }
    assert!(dest.join("usr/lib/libgemhook.so.1").exists());
    let unit =
        std::fs::read_to_string(dest.join("usr/lib/systemd/system/gem-schd.service")).unwrap();
    assert!(
        unit.contains("Documentation=file:///usr/share/doc/gemini/README.md"),
        "{unit}"
    );
    assert!(dest.join("usr/share/doc/gemini/README.md").exists());
    assert!(dest.join("etc/gemini/resource.conf").exists());

    let o = make("uninstall", &release);
    assert!(o.status.success(), "{}", stderr(&o));
    for f in [
        "bin/gem-schd",
        "bin/gem-slurm",
        "lib/libgemhook.so",
        "lib/libgemhook.so.1",
        "lib/libgemzmq.so",
        "lib/systemd/system/gem-holder.service",
        "share/doc/gemini",
    ] {
        assert!(!dest.join("usr").join(f).exists(), "{f} left by uninstall");
    }
    assert!(
        dest.join("etc/gemini/resource.conf").exists(),
        "the site's configuration was removed"
    );

    // Nothing built: one line saying what to run, and nothing installed.
    let o = make("install", &tmp.path().join("nothing"));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("run `make release` first"),
        "{}",
        stderr(&o)
    );
}
