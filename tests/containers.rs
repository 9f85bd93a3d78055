//! Real containers on a devremap `/dev`, end to end, with runc and with crun: the commands of
//! docs/containers.md (`devremapd mount`, `devremapd oci-patch --in-place`, `<runtime> run`,
//! SIGHUP), and a busybox script inside the container that prints what it sees.
//!
//! The container asks the NVIDIA hook (a no-op script here) for every GPU, as `docker run
//! --gpus all` does, so its `/dev` holds the host's GPUs. The fake host: GPUs `nvidia0`..`nvidia3` are real char devices 1:3, 1:5, 1:7, 1:8 (null,
//! zero, full, random), so a read inside the container tells which host GPU a name reached.
//! The checkpoint saved GPUs {4, 5}, paired with host {0, 1}: `/dev/nvidia4` opens null and
//! `/dev/nvidia5` zero. The reload removes host GPU 0, so the pairing becomes {4, 5} -> {1, 2}:
//! `nvidia4` opens zero, `nvidia5` full, and `nvidia0` is gone.
//!
//! The denied node: host GPU `nvidia6` is a char device 10:229 (the FUSE device). Every rdev
//! the fake GPUs 0..3 use is on the default allow list of both runtimes (runc 1.1.5 and crun
//! 1.8.1 always add null, zero, full, random, urandom, tty, ptmx and pts 136:*, runc also tun
//! 10:200, crun console 5:1), so a denied node needs a number outside that list; 10:229 is, and
//! opening it would be harmless if a runtime allowed it after all (an unused FUSE connection).
//! The spec's `linux.resources.devices` deny everything and then allow the four fake GPUs'
//! numbers (explicitly, though the defaults cover them), never 10:229. So `/dev/nvidia6` is
//! visible with its number, and opening it fails with EPERM: the filesystem grants nothing the
//! cgroup denies, and the cgroup judges the rdev, not the name.
//!
//! The reload happens while the container's process runs: after its first report it waits for
//! `/xchg/go` (written by the test into the read-only rootfs from outside), then reports
//! again; a descriptor it opened before the reload must keep reaching the old device.

mod common;

use common::bundle::{Bundle, Container, Runtime, allow_char, need_containers, oci_config};
use common::daemon::Daemon;
use common::{BIN, FakeHost, arg, fake_rdev, saved_devices};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

/// One container at a time: the machine may be small, and the tests share nothing else.
static SERIAL: Mutex<()> = Mutex::new(());

/// How long a container may take to start and report, or to finish after the reload.
const CONTAINER_PATIENCE: Duration = Duration::from_secs(60);

/// The rdev of host GPU 6, which the container's device cgroup denies.
const DENIED: (u32, u32) = (10, 229);

/// The script the container runs (busybox sh). Every fact is one line `<phase> <key>: <value>`.
const SCRIPT: &str = r#"#!/bin/sh
# The device a node opens: null (reads nothing), zero (reads zeros, takes writes), full
# (reads zeros, refuses writes), random (reads bytes), or the error of open.
ident() {
  if ! err=$(head -c 8 "$1" 2>&1 >/dev/null); then echo "error: $err"; return; fi
  b=$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')
  case "$b" in
    "") echo null ;;
    0000000000000000) if (echo x >> "$1") 2>/dev/null; then echo zero; else echo full; fi ;;
    *) echo random ;;
  esac
}
node() {
  if [ -c "/dev/$2" ]; then echo "$1 $2: char $(stat -c '%t:%T %a %u:%g' "/dev/$2")"
  elif [ -e "/dev/$2" ]; then echo "$1 $2: not a char device"
  else echo "$1 $2: missing"; fi
}
try() {
  p=$1; k=$2; shift 2
  if out=$("$@" 2>&1); then echo "$p $k: ok"; else echo "$p $k: failed: $out"; fi
}
report() {
  p=$1
  for n in nvidia0 nvidia1 nvidia2 nvidia3 nvidia4 nvidia5 nvidia6 null zero full random urandom tty; do
    node "$p" "$n"
  done
  for n in nvidia0 nvidia1 nvidia2 nvidia3 nvidia4 nvidia5 nvidia6 null zero full random urandom; do
    echo "$p $n.opens: $(ident "/dev/$n")"
  done
  while read -r src mp fs rest; do
    case "$mp" in /dev|/dev/*) echo "$p mount $mp: $fs" ;; esac
  done < /proc/mounts
  echo "$p ls: $(ls /dev | tr '\n' ' ')"
  echo "$p fd0: $(readlink /dev/fd/0)"
  echo "$p stdout.link: $(readlink /dev/stdout)"
  echo "$p fd.list: $(ls /dev/fd/ | tr '\n' ' ')"
  try "$p" shm.write sh -c 'echo hi > /dev/shm/f && cat /dev/shm/f'
  try "$p" mknod mknod /dev/x c 1 3
  try "$p" touch touch /dev/y
  try "$p" mkdir mkdir /dev/d
  try "$p" rm rm /dev/null
  try "$p" chmod chmod 600 /dev/null
  try "$p" chown chown 1:1 /dev/null
  echo "$p null.after: $(stat -c '%a %u:%g' /dev/null)"
  echo "$p created: $(ls /dev | grep -x -e x -e y -e d | tr '\n' ' ')"
}
echo "via /dev/stdout" >> /dev/stdout
report phase1
exec 3<> /dev/nvidia5
echo "phase1 fd3: $(stat -L -c '%t:%T' /proc/self/fd/3)"
echo "phase1 done"
i=0
while [ ! -e /xchg/go ]; do
  i=$((i + 1))
  if [ "$i" -gt 1200 ]; then echo "phase2 timeout"; exit 1; fi
  sleep 0.05
done
report phase2
echo "phase2 fd3: $(stat -L -c '%t:%T' /proc/self/fd/3)"
if (echo x >&3) 2>/dev/null; then echo "phase2 fd3.opens: zero"; else echo "phase2 fd3.opens: full"; fi
echo "phase2 done"
"#;

/// `major:minor` as busybox `stat -c %t:%T` prints it (hex).
fn hex((major, minor): (u32, u32)) -> String {
    format!("{major:x}:{minor:x}")
}

/// The `<phase> <key>: <value>` lines of a transcript.
fn facts(stdout: &str) -> BTreeMap<String, String> {
    stdout
        .lines()
        .filter(|l| l.starts_with("phase"))
        .filter_map(|l| l.split_once(": ").map(|(k, v)| (k.to_owned(), v.trim_end().to_owned())))
        .collect()
}

/// Asserts on the facts a container printed, showing the whole transcript on failure.
struct Facts<'a> {
    map: BTreeMap<String, String>,
    transcript: &'a str,
}

impl Facts<'_> {
    fn get(&self, key: &str) -> &str {
        self.map
            .get(key)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("the container printed no {key:?}\n{}", self.transcript))
    }

    fn eq(&self, key: &str, want: &str) {
        assert_eq!(self.get(key), want, "{key}\n{}", self.transcript);
    }

    fn contains(&self, key: &str, needle: &str) {
        let got = self.get(key);
        assert!(got.contains(needle), "{key}: {got:?} does not contain {needle:?}\n{}", self.transcript);
    }

    /// `/dev/<name>` is a char device `rdev`, mode 0666, owned by root, and opens `device`.
    fn device(&self, phase: &str, name: &str, rdev: (u32, u32), device: &str) {
        self.eq(&format!("{phase} {name}"), &format!("char {} 666 0:0", hex(rdev)));
        self.eq(&format!("{phase} {name}.opens"), device);
    }

    /// What holds in both phases: runc's /dev, its mounts, the refusals, the denied node.
    fn common(&self, p: &str, expected_ls: &str) {
        for (name, rdev, device) in [
            ("null", (1, 3), "null"),
            ("zero", (1, 5), "zero"),
            ("full", (1, 7), "full"),
            ("random", (1, 8), "random"),
            ("urandom", (1, 9), "random"),
        ] {
            self.device(p, name, rdev, device);
        }
        self.eq(&format!("{p} tty"), "char 5:0 666 0:0");
        // Native names of the host GPUs that stay.
        for (minor, device) in [(1, "zero"), (2, "full"), (3, "random")] {
            self.device(p, &format!("nvidia{minor}"), fake_rdev(minor), device);
        }
        // The cgroup denies the rdev, whatever the name: visible, but open fails with EPERM.
        self.eq(&format!("{p} nvidia6"), &format!("char {} 666 0:0", hex(DENIED)));
        self.contains(&format!("{p} nvidia6.opens"), "error: ");
        self.contains(&format!("{p} nvidia6.opens"), "Operation not permitted");
        // The runtime's mounts land on the devremap tree and stay there across a reload.
        self.eq(&format!("{p} mount /dev"), "fuse");
        self.eq(&format!("{p} mount /dev/pts"), "devpts");
        self.eq(&format!("{p} mount /dev/shm"), "tmpfs");
        self.eq(&format!("{p} mount /dev/mqueue"), "mqueue");
        self.eq(&format!("{p} ls"), expected_ls);
        // runc's symlinks resolve through the container's /proc.
        assert!(!self.get(&format!("{p} fd0")).is_empty(), "/dev/fd/0 does not resolve\n{}", self.transcript);
        self.eq(&format!("{p} stdout.link"), "/proc/self/fd/1");
        let fds: Vec<&str> = self.get(&format!("{p} fd.list")).split(' ').collect();
        assert!(["0", "1", "2"].iter().all(|fd| fds.contains(fd)), "/dev/fd lists {fds:?}\n{}", self.transcript);
        self.eq(&format!("{p} shm.write"), "ok");
        // Every change to the tree is refused by the filesystem (the process has CAP_MKNOD,
        // CAP_CHOWN, CAP_FOWNER): setattr with EPERM, the rest with EROFS.
        for key in ["mknod", "touch", "mkdir", "rm"] {
            self.contains(&format!("{p} {key}"), "failed: ");
            self.contains(&format!("{p} {key}"), "Read-only file system");
        }
        for key in ["chmod", "chown"] {
            self.contains(&format!("{p} {key}"), "failed: ");
            self.contains(&format!("{p} {key}"), "Operation not permitted");
        }
        self.eq(&format!("{p} null.after"), "666 0:0");
        self.eq(&format!("{p} created"), "");
    }
}

/// The names directly under `/dev` that the daemon serves (mount points included), as the
/// container's `ls /dev | tr '\n' ' '` prints them (its trailing space trimmed).
fn expected_ls(state: &Value) -> String {
    let names: BTreeSet<&str> = state["nodes"]
        .as_array()
        .expect("nodes is an array")
        .iter()
        .filter_map(|n| n["path"].as_str())
        .filter(|p| !p.contains('/'))
        .collect();
    names.into_iter().collect::<Vec<_>>().join(" ")
}

fn container_on_devremap(runtime: Runtime) {
    need_containers(runtime);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());

    // The restore host and the checkpoint.
    let host = FakeHost::with_gpus(&[0, 1, 2, 3]);
    host.node("nvidia6", DENIED);
    let meta = host.tmp.path().join("meta.json");
    fs::write(&meta, saved_devices(&[4, 5]).to_string()).unwrap();

    // The bundle: runc's default spec, its device cgroup allowing the fake GPUs only, asking
    // the NVIDIA hook for every GPU (`docker run --gpus all`): a spec is given the GPUs it asks
    // for (issue 29.3).
    let rules: Vec<Value> = (0..4).map(fake_rdev).map(|(ma, mi)| allow_char(ma, mi)).collect();
    let mut config = oci_config(&format!("devremap-{}", runtime.name()), &rules);
    common::bundle::nvidia_hook(&mut config, host.tmp.path(), Some("all"));
    let bundle = Bundle::new(SCRIPT, &config);

    // 1. Mount, with the spec so that the runtime's mount points exist.
    let d = Daemon::start(&[
        "--metadata",
        arg(&meta),
        "--host-dev",
        arg(&host.dev()),
        "--host-root",
        arg(&host.root()),
        "--spec",
        arg(&bundle.config_path()),
    ]);
    let state = d.state();
    let remap: Vec<(String, String)> = state["remap"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_owned(), e["new"]["name"].as_str().unwrap_or_default().to_owned()))
        .collect();
    assert!(remap.iter().any(|(n, _)| n == "nvidia4"), "{}", state["remap"]);

    // 2. Patch the bundle's spec: /dev becomes a bind mount of the devremap mount.
    let out = Command::new(BIN)
        .args(["oci-patch", arg(&bundle.config_path()), "--dev", arg(&d.mountpoint), "--in-place"])
        .output()
        .unwrap();
    assert!(out.status.success(), "oci-patch failed: {}", String::from_utf8_lossy(&out.stderr));
    let config = bundle.config();
    let dev_mounts: Vec<&Value> =
        config["mounts"].as_array().unwrap().iter().filter(|m| m["destination"] == "/dev").collect();
    assert_eq!(dev_mounts.len(), 1);
    assert_eq!(dev_mounts[0]["type"], "bind");
    assert_eq!(dev_mounts[0]["source"], arg(&d.mountpoint));

    // 3. Run the container; it reports, then waits for the reload.
    let id = format!("devremap-test-{}-{}", runtime.name(), std::process::id());
    let mut c = Container::run(runtime, &bundle, &id);
    c.wait_line("phase1 done", CONTAINER_PATIENCE);
    let out1 = c.stdout();
    let transcript = format!("{out1}--- runtime stderr ---\n{}--- daemon log ---\n{}", c.stderr(), d.log_text());
    let f = Facts { map: facts(&out1), transcript: &transcript };
    assert!(
        out1.lines().any(|l| l == "via /dev/stdout"),
        "/dev/stdout does not reach the container's stdout\n{transcript}"
    );
    f.common("phase1", &expected_ls(&state));
    // Checkpoint names reach the paired host GPUs; native names their own.
    f.device("phase1", "nvidia4", fake_rdev(0), "null");
    f.device("phase1", "nvidia5", fake_rdev(1), "zero");
    f.device("phase1", "nvidia0", fake_rdev(0), "null");
    f.eq("phase1 fd3", &hex(fake_rdev(1)));

    // 4. Reload with a new pairing while the container runs: host GPU 0 is gone, so saved
    // {4, 5} now pair with host {1, 2}.
    fs::remove_file(host.dev().join("nvidia0")).unwrap();
    let state2 = d.reload();
    assert_eq!(state2["generation"], 2, "{}", d.log_text());
    assert_eq!(state2["last_error"], Value::Null);
    fs::write(bundle.xchg().join("go"), "").unwrap();
    let status = c.wait(CONTAINER_PATIENCE);
    let out = c.stdout();
    let transcript = format!("{out}--- runtime stderr ---\n{}--- daemon log ---\n{}", c.stderr(), d.log_text());
    assert!(status.success(), "{} run exited with {status}\n{transcript}", runtime.name());
    let f = Facts { map: facts(&out), transcript: &transcript };
    assert!(out.lines().any(|l| l == "phase2 done"), "the container did not finish its report\n{transcript}");
    // The running container's next open reaches the new device; the old native name is gone.
    f.device("phase2", "nvidia4", fake_rdev(1), "zero");
    f.device("phase2", "nvidia5", fake_rdev(2), "full");
    f.eq("phase2 nvidia0", "missing");
    f.contains("phase2 nvidia0.opens", "error: ");
    f.common("phase2", &expected_ls(&state2));
    // A descriptor opened before the reload keeps its device.
    f.eq("phase2 fd3", &hex(fake_rdev(1)));
    f.eq("phase2 fd3.opens", "zero");

    // 5. Clean up: the container first, so that nothing holds the mount.
    let deleted = c.delete();
    assert!(deleted.status.success(), "{} delete -f: {}", runtime.name(), String::from_utf8_lossy(&deleted.stderr));
    drop(c);
    assert!(d.stop().success());
}

/// runc 1.1 runs a restored container on a devremap /dev and sees a reload.
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn runc_container_on_devremap() {
    container_on_devremap(Runtime::Runc);
}

/// crun 1.8 runs a restored container on a devremap /dev and sees a reload (on a hybrid cgroup
/// host, in a mount namespace without the cgroup2 mount).
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn crun_container_on_devremap() {
    container_on_devremap(Runtime::Crun);
}

/// Shell-quotes a command for `script -c`.
fn shell_line(cmd: &Command) -> String {
    let quote = |s: &std::ffi::OsStr| format!("'{}'", s.to_str().expect("a UTF-8 argument").replace('\'', r"'\''"));
    std::iter::once(quote(cmd.get_program())).chain(cmd.get_args().map(quote)).collect::<Vec<_>>().join(" ")
}

/// With `process.terminal`, the runtime bind-mounts the container's pty onto `/dev/console`,
/// which it cannot create on our tree: the tree holds a placeholder there (char 1:3), and the
/// runtime's console mount covers it. `script` gives the runtime the terminal it needs.
fn terminal_console(runtime: Runtime) {
    need_containers(runtime);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The findings go to a file, not to the terminal, where the runtime's own messages and the
    // terminal's echo and line-end handling would mix with them.
    let script = "{ tty; stat -c 'console %F %t:%T' /dev/console; grep ' /dev/console ' /proc/mounts | cut -d' ' -f3; } >/out/found\n";
    let mut config = oci_config("tty", &[]);
    config["process"]["terminal"] = Value::Bool(true);
    let out_dir = tempfile::TempDir::new().unwrap();
    let found = out_dir.path().join("found");
    config["mounts"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"destination": "/out", "type": "bind", "source": arg(out_dir.path()), "options": ["rbind", "rw"]}));
    let bundle = Bundle::new(script, &config);
    fs::create_dir(bundle.rootfs().join("out")).unwrap();
    let host = FakeHost::new();
    let config_path = bundle.config_path();
    let d = Daemon::start(&["--spec", arg(&config_path), "--host-root", arg(&host.root())]);
    let state = d.state();
    let console =
        state["nodes"].as_array().unwrap().iter().find(|n| n["path"] == "console").expect("a console placeholder");
    assert_eq!(
        (console["type"].as_str(), console["major"].as_u64(), console["minor"].as_u64()),
        (Some("char"), Some(1), Some(3))
    );
    let out = Command::new(BIN)
        .args(["oci-patch", arg(&config_path), "--dev", arg(&d.mountpoint), "--in-place"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let id = format!("devremap-tty-{}", runtime.name());
    let run = runtime.command(&bundle.state_root(), &["run", "--bundle", arg(bundle.dir()), &id]);
    // script's stdin stays open until the runtime is gone. At EOF on its stdin, script types the
    // terminal's end-of-file character into the terminal; the runtime, which has put that
    // terminal in raw mode, copies the byte (a NUL) into the container's console, whose line
    // discipline echoes it as `^@` into the output, before or after the script's lines.
    let mut script = Command::new("script")
        .args(["-qec", &shell_line(&run), "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdin = script.stdin.take();
    let out = script.wait_with_output().unwrap();
    drop(stdin);
    let _ = runtime.command(&bundle.state_root(), &["delete", "-f", &id]).output();
    let terminal = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} with a terminal failed: {terminal}{}",
        runtime.name(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text =
        fs::read_to_string(&found).unwrap_or_else(|e| panic!("{}: {e}; terminal: {terminal:?}", found.display()));
    let lines: Vec<&str> = text.lines().collect();
    let [tty, console_line, source] = lines[..] else { panic!("expected three lines: {text:?}") };
    let pty = tty.strip_prefix("/dev/pts/").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    assert!(pty, "no tty: {text:?}");
    assert_eq!(console_line, "console character special file 88:0", "the console is not the pty");
    assert_eq!(source, "devpts", "the console is not mounted from devpts");
    assert!(d.stop().success());
}

/// Rule: with a terminal, runc's console lands on our placeholder. Bug (issue 11.2): a NUL
/// that `script` typed at the end of its stdin was echoed into the terminal's output, where
/// the test looked for its findings, and broke the match.
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn runc_terminal_console() {
    terminal_console(Runtime::Runc);
}

/// Rule: with a terminal, crun's console lands on our placeholder.
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn crun_terminal_console() {
    terminal_console(Runtime::Crun);
}

/// Bug (found from outside): the plan of a spec whose devices sit over runc's own nodes differed
/// from the /dev runc 1.1.5 makes itself: runc turns /dev/ptmx into the symlink `pts/ptmx`
/// whatever the spec lists, and replaces a default node only for a device written exactly as
/// its path (`/dev//null`, `/dev/./zero`, `/dev/full/` leave the default); and its chown of
/// every node leaves `uid` 4294967295 root's and clears set-user-ID (`fileMode` 0o7777 is
/// 0o1777). Here runc runs the spec with its own tmpfs /dev, and every node it made for these
/// names is what `plan` serves, mode and owner included.
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn plan_matches_runcs_own_dev_for_spec_devices_over_defaults() {
    need_containers(Runtime::Runc);
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let device = |path: &str, major: u32, minor: u32| serde_json::json!({"path": path, "type": "c", "major": major, "minor": minor});
    let names = ["null", "zero", "full", "ptmx", "fd", "tty", "x", "a", "b", "c"];
    let mut config = oci_config("defaults", &[]);
    config["linux"]["devices"] = serde_json::json!([
        device("/dev//null", 1, 5),
        device("/dev/./zero", 1, 7),
        device("/dev/full/", 1, 3),
        device("/dev/ptmx", 5, 2),
        device("/dev/fd", 1, 9),
        device("/dev//tty", 1, 8),
        device("/dev/tty", 1, 9),
        device("/dev/x/", 1, 9),
        serde_json::json!({"path": "/dev/a", "type": "c", "major": 1, "minor": 3,
                           "uid": 4_294_967_295u32, "gid": 4_294_967_295u32, "fileMode": 0o600}),
        serde_json::json!({"path": "/dev/b", "type": "c", "major": 1, "minor": 3, "fileMode": 0o7777}),
        serde_json::json!({"path": "/dev/c", "type": "c", "major": 1, "minor": 3, "fileMode": 0o4640, "uid": 5, "gid": 6}),
    ]);
    let bundle = stat_bundle(&names, &config);
    let c = runcs_own_dev(&bundle);
    let host = FakeHost::new();
    let plan = common::plan_json(&["--spec", arg(&bundle.config_path()), "--host-root", arg(&host.root())]);
    plan_is_runcs(&plan, &names, &c);
}

/// A bundle of `config` whose script `stat`s each of `names` under /dev.
fn stat_bundle(names: &[&str], config: &Value) -> Bundle {
    let script: String = names.iter().map(|n| format!("stat -c '%n %F %t:%T %a %u:%g' /dev/{n}\n")).collect();
    Bundle::new(&script, config)
}

/// Runs `bundle` under runc with runc's own tmpfs /dev, to its end.
fn runcs_own_dev(bundle: &Bundle) -> Container<'_> {
    let mut c = Container::run(Runtime::Runc, bundle, "devremap-defaults");
    assert!(c.wait(CONTAINER_PATIENCE).success(), "{}", c.transcript());
    c
}

/// Every one of `names` is in `plan` as container `c` (see [`runcs_own_dev`]) saw runc make it:
/// its type, number, mode and owner.
fn plan_is_runcs(plan: &Value, names: &[&str], c: &Container) {
    let seen = c.stdout();
    for name in names {
        let node = common::node(plan, name).unwrap_or_else(|| panic!("{name} is not in the plan: {plan}"));
        let want = match node["type"].as_str() {
            Some("symlink") => format!("/dev/{name} symbolic link"),
            _ => format!(
                "/dev/{name} character special file {} {:o} {}:{}",
                hex((node["major"].as_u64().unwrap() as u32, node["minor"].as_u64().unwrap() as u32)),
                node["mode"].as_u64().unwrap(),
                node["uid"],
                node["gid"]
            ),
        };
        let line = seen.lines().find(|l| l.starts_with(&format!("/dev/{name} "))).unwrap_or_default();
        assert!(line.starts_with(&want), "runc made {line:?}, the plan serves {want:?}\n{}", c.transcript());
    }
}

/// Bug (issue 22): a pass-through node the spec lists (`/dev/kfd`, `/dev/nvidiactl`,
/// `/dev/nvidia-uvm`) was served with the host node's mode and owner: a spec's `0600` over a
/// host's `0666` gave the container access runc never gives. runc makes each with the spec's
/// `fileMode` (0666 where it gives none), `uid` and `gid`, and so does the plan, with the host
/// node's number (here the same as the spec's, so that runc's node and the plan's compare whole).
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn a_host_pass_through_node_has_the_specs_mode_as_runc_makes_it() {
    need_containers(Runtime::Runc);
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let names = ["kfd", "nvidiactl", "nvidia-uvm"];
    let mut config = oci_config("defaults", &[]);
    config["linux"]["devices"] = serde_json::json!([
        {"path": "/dev/kfd", "type": "c", "major": 1, "minor": 8, "fileMode": 0o600, "uid": 5, "gid": 6},
        {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 0o600},
        {"path": "/dev/nvidia-uvm", "type": "c", "major": 1, "minor": 9},
    ]);
    let bundle = stat_bundle(&names, &config);
    let c = runcs_own_dev(&bundle);
    let host = FakeHost::new();
    for (name, rdev, mode) in [("kfd", (1, 8), 0o666), ("nvidiactl", (195, 255), 0o666), ("nvidia-uvm", (1, 9), 0o600)]
    {
        common::mknod_char(&host.dev().join(name), rdev, mode);
    }
    let plan = common::plan_json(&[
        "--spec",
        arg(&bundle.config_path()),
        "--host-dev",
        arg(&host.dev()),
        "--host-root",
        arg(&host.root()),
    ]);
    plan_is_runcs(&plan, &names, &c);
}

/// The GPU families' names the issue 29.3 comparison looks at, in the container and the tree.
const FAMILY_NAMES: &[&str] = &[
    "nvidia0",
    "nvidia1",
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-modeset",
    "nvidia-caps",
    "nvidia-caps/nvidia-cap1",
    "kfd",
    "dri",
    "dri/renderD128",
];

/// One line per node of [`FAMILY_NAMES`] under `root` (a mounted tree), as busybox's
/// `stat -c '%n %F %t:%T %a'` prints it for `/dev/<name>`.
fn family_lines_of(root: &std::path::Path) -> BTreeSet<String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut lines = BTreeSet::new();
    for name in FAMILY_NAMES {
        let Ok(meta) = fs::symlink_metadata(root.join(name)) else { continue };
        let kind = if meta.file_type().is_char_device() { "character special file" } else { "directory" };
        let rdev = if meta.file_type().is_char_device() {
            hex((libc::major(meta.rdev()), libc::minor(meta.rdev())))
        } else {
            "0:0".into()
        };
        lines.insert(format!("/dev/{name} {kind} {rdev} {:o}", meta.mode() & 0o7777));
    }
    lines
}

/// Bug (issue 29.3): with a device directory, a spec was served GPU nodes runc never makes from
/// it: asking the NVIDIA hook for nothing (`NVIDIA_VISIBLE_DEVICES` `void`, empty, `,`, unset)
/// gave every `nvidiaN`, `nvidiactl`, `nvidia-uvm` and `nvidia-caps/*`; listing only
/// `nvidiactl`, `nvidia-uvm`, `kfd` or a render node gave every NVIDIA node too; a GPU-less spec
/// whose env says `DEVREMAP_ENABLE=true` (an image can) got the whole directory. For each, the
/// tree mounted from the spec and a fake device directory holds, of the GPU families' names,
/// exactly the nodes runc makes from the same spec (the hook, a no-op here, adds nothing for
/// these values, as the toolkit's adds nothing).
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn a_spec_gets_no_gpu_node_that_runc_would_not_make() {
    need_containers(Runtime::Runc);
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let host = FakeHost::with_gpus(&[0, 1]);
    let (ctl, uvm, kfd, render) = ((195, 255), (1, 9), (1, 8), (226, 128));
    for (rel, rdev) in [
        ("nvidiactl", ctl),
        ("nvidia-uvm", uvm),
        ("nvidia-modeset", (195, 254)),
        ("nvidia-caps/nvidia-cap1", (1, 8)),
        ("kfd", kfd),
        ("dri/renderD128", render),
    ] {
        host.node(rel, rdev);
    }
    let device = |path: &str, (major, minor): (u32, u32)| serde_json::json!({"path": path, "type": "c", "major": major, "minor": minor});
    let script: String = FAMILY_NAMES
        .iter()
        .map(|n| format!("[ -e /dev/{n} ] && stat -c '%n %F %t:%T %a' /dev/{n}\n"))
        .chain(["true\n".to_owned()])
        .collect();
    let hook = |visible: Option<&str>| {
        let mut config = oci_config("gpus", &[]);
        common::bundle::nvidia_hook(&mut config, host.tmp.path(), visible);
        config
    };
    let listing = |dev: Value| {
        let mut config = oci_config("gpus", &[]);
        config["linux"]["devices"] = serde_json::json!([dev]);
        config
    };
    let mut enabled = oci_config("gpus", &[]);
    enabled["process"]["env"].as_array_mut().unwrap().push(serde_json::json!("DEVREMAP_ENABLE=true"));
    // The toolkit's CDI spec for GPU 0 in an image whose ENV says all (attack 2 B1): the CDI
    // hook (a no-op here, as the toolkit's makes no node) and the toolkit's trailing `void`.
    let mut cdi = listing(device("/dev/nvidia0", fake_rdev(0)));
    common::bundle::nvidia_hook(&mut cdi, host.tmp.path(), None);
    let cdi_hook = host.tmp.path().join("nvidia-cdi-hook");
    fs::copy(host.tmp.path().join("nvidia-container-runtime-hook"), &cdi_hook).unwrap();
    cdi["hooks"] = serde_json::json!({"createContainer": [{"path": arg(&cdi_hook), "args": ["nvidia-cdi-hook", "create-symlinks"]}]});
    for value in ["all", "void"] {
        cdi["process"]["env"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!(format!("NVIDIA_VISIBLE_DEVICES={value}")));
    }
    let cases = [
        ("the hook asked for void", hook(Some("void"))),
        ("the hook asked for nothing (empty)", hook(Some(""))),
        ("the hook asked for ','", hook(Some(","))),
        ("the hook without NVIDIA_VISIBLE_DEVICES", hook(None)),
        ("only nvidiactl listed", listing(device("/dev/nvidiactl", ctl))),
        ("only nvidia-uvm listed", listing(device("/dev/nvidia-uvm", uvm))),
        ("only kfd listed", listing(device("/dev/kfd", kfd))),
        ("only a render node listed", listing(device("/dev/dri/renderD128", render))),
        ("a GPU-less spec with DEVREMAP_ENABLE=true", enabled),
        ("a CDI spec for GPU 0 with the image's NVIDIA_VISIBLE_DEVICES=all", cdi),
    ];
    let mut wrong = Vec::new();
    for (case, config) in cases {
        let bundle = Bundle::new(&script, &config);
        let c = runcs_own_dev(&bundle);
        let runc: BTreeSet<String> = c.stdout().lines().map(str::to_owned).collect();
        let d = Daemon::start(&[
            "--spec",
            arg(&bundle.config_path()),
            "--host-dev",
            arg(&host.dev()),
            "--host-root",
            arg(&host.root()),
        ]);
        let tree = family_lines_of(&d.mountpoint);
        assert!(d.stop().success(), "{case}: the daemon failed");
        if tree != runc {
            wrong.push(format!("{case}: the tree holds {tree:?}, runc makes {runc:?}"));
        }
    }
    assert!(wrong.is_empty(), "{} of 10 cases differ:\n{}", wrong.len(), wrong.join("\n"));
}

/// Bug (issue 29.5): runc mounts a tmpfs on a directory that exists and chmods it to that
/// directory's mode, so on the tree's `0755` mount point `/dev/shm` was `0755` and a non-root
/// user in a runc container could not write shared memory, where plain runc gives `1777`. As
/// uid 1000 without capabilities, the container writes a file in `/dev/shm` on a devremap
/// `/dev`, and `/dev/shm` has the mode it has on runc's own `/dev`; with runc and crun, and
/// with the tmpfs's `options` where given.
fn a_non_root_user_writes_dev_shm(runtime: Runtime, options: Option<Value>) {
    need_containers(runtime);
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let script = "stat -c 'shm.mode: %a' /dev/shm\n\
                  if echo hi > /dev/shm/f 2>/dev/null; then echo 'shm.write: ok'; else echo 'shm.write: refused'; fi\n";
    let mut config = oci_config("shm", &[]);
    if let Some(options) = options {
        let mounts = config["mounts"].as_array_mut().unwrap();
        let shm = mounts.iter_mut().find(|m| m["destination"] == "/dev/shm").unwrap();
        shm["options"] = options;
    }
    config["process"]["user"] = serde_json::json!({"uid": 1000, "gid": 1000});
    let none = serde_json::json!([]);
    config["process"]["capabilities"] =
        serde_json::json!({"bounding": none, "effective": none, "permitted": none, "ambient": none});
    let own = Bundle::new(script, &config);
    let mut c = Container::run(runtime, &own, &format!("devremap-shm-own-{}", runtime.name()));
    assert!(c.wait(CONTAINER_PATIENCE).success(), "{}", c.transcript());
    let plain = c.stdout();
    assert!(plain.contains("shm.write: ok\n"), "{} itself: {plain}", runtime.name());
    drop(c);

    let bundle = Bundle::new(script, &config);
    let host = FakeHost::new();
    let d = Daemon::start(&["--spec", arg(&bundle.config_path()), "--host-root", arg(&host.root())]);
    let out = Command::new(BIN)
        .args(["oci-patch", arg(&bundle.config_path()), "--dev", arg(&d.mountpoint), "--in-place"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut c = Container::run(runtime, &bundle, &format!("devremap-shm-{}", runtime.name()));
    assert!(c.wait(CONTAINER_PATIENCE).success(), "{}", c.transcript());
    assert_eq!(c.stdout(), plain, "on devremap (left) and on {}'s own /dev (right)", runtime.name());
    drop(c);
    assert!(d.stop().success());
}

/// Bug (issue 29.5): under runc, a non-root user could not write `/dev/shm` on a devremap `/dev`.
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn a_non_root_user_writes_dev_shm_under_runc() {
    a_non_root_user_writes_dev_shm(Runtime::Runc, None);
}

/// Rule (issue 29.5): under crun, which never chmods the tmpfs, `/dev/shm` is as crun's own.
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn a_non_root_user_writes_dev_shm_under_crun() {
    a_non_root_user_writes_dev_shm(Runtime::Crun, None);
}

/// Bug (issue 29, attack 2 B3): runc joins a tmpfs's data options with `,` and the kernel reads
/// the last `mode=` among them; devremap read the last option starting with `mode=`, so with
/// `["mode=700", "nr_inodes=0,mode=1777"]` runc chmodded `/dev/shm` to `0700` on a devremap
/// `/dev` where its own is `1777`, and a non-root user could not write it.
#[test]
#[ignore = "needs root, /dev/fuse, runc or crun, and busybox-static"]
fn a_non_root_user_writes_dev_shm_whose_mode_is_in_a_joined_option() {
    a_non_root_user_writes_dev_shm(
        Runtime::Runc,
        Some(serde_json::json!(["nosuid", "mode=700", "nr_inodes=0,mode=1777"])),
    );
}
