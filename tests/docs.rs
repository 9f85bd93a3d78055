//! The docs' examples, run. A transcript is a fenced block (no language, or `console`) whose
//! first line starts `$ `: each `$ ` line is a command, followed by the output it prints
//! (stderr and stdout, as a terminal shows them). A command continues on the next lines when
//! it holds a here-document (`<<'EOF'` up to the line `EOF`) or its line ends in `\`.
//!
//! Each file (README.md, docs/*.md) runs top to bottom, as root, in one shell (bash, so a
//! variable, a function or a `cd` of one transcript holds in the next) in its own scratch
//! directory (under Cargo's target directory), which holds links to the repository's `examples`
//! and `tests` and nothing else, in a mount namespace of its own whose `/run` and `/tmp` are
//! empty tmpfs (so `/run/devremap` and docs/restore.md's `/tmp/demo` are made by the doc, as on
//! a fresh machine, and the host's are never touched), and in a pid namespace of its own whose
//! init is that shell: when it ends, whatever a doc left running (a daemon, a container, a
//! detached process) is killed with it. This build's `devremapd` and `devremap-runtime` come
//! first on `PATH`, then a `criu` that works here (found as the suite finds it,
//! `common::clients::need_criu`), for docs/restore.md's checkpoint; runc and a static busybox
//! are needed too, so the run fails, never skips, where any of them is missing. Every command's output
//! must be what the doc shows, where a line `...` stands for any number of lines (as in
//! trycmd). Two normalisations apply to both sides, the only ones, both to a daemon's log
//! lines, whose text no reader chooses: the timestamp (`[2026-12-01T22:30:00.123Z INFO ...`,
//! which the docs may write `[...`) becomes `[T`, and each pid in the line (`keeper pid 5852`)
//! becomes `pid P`. Nothing else is: dates, pids and temporary paths in a command's own output
//! are the command's to leave out (`ls -l --time-style=+`, relative paths in the scratch
//! directory, a pid compared in the command instead of printed), and a signal to a daemon is
//! followed by a command that waits until the state file shows its effect
//! (`examples/state`, docs/daemon.md), never by a sleep.
//!
//! A transcript right after a line `*Not run by the tests: needs a GPU host.*` or
//! `*Not run by the tests: needs a real cluster.*` (the line a reader sees above it) is not run
//! but counted; so is one after a line `*Not run by the tests yet: REASON.*`, an example not
//! yet made to run here (none is left: the count is pinned at 0). The
//! counts are pinned below: a transcript that stops being recognised, or one marked without
//! saying so here, fails the test.
//!
//! The README's quick start, an `sh` block followed by its output, is checked the same way.
//!
//! Why not trycmd or snapbox: trycmd runs each command alone, in a copy of a fixed directory,
//! so a file made, a variable set or a device node made by one example is not there for the
//! next, and the docs' examples build on each other; snapbox would compare, but the shell
//! session and the markdown reading below would still be ours. So this is the whole harness.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::Duration;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// How many commands run, and how many are marked (per marker). Change these only with the
/// docs: they are what keeps a doc from silently going untested.
const RUN: usize = 271;
const MARKED: &[(&str, usize)] = &[(GPU_HOST, 6), (CLUSTER, 2), (NOT_YET, 0)];

const GPU_HOST: &str = "*Not run by the tests: needs a GPU host.*";
const CLUSTER: &str = "*Not run by the tests: needs a real cluster.*";
/// The start of a marker line whose reason follows.
const NOT_YET: &str = "*Not run by the tests yet: ";

/// How long one command may take before the file's run is given up.
const PATIENCE: Duration = Duration::from_secs(120);

/// One command of a transcript: where it is, the command, the output it shows.
#[derive(Debug)]
struct Case {
    line: usize,
    command: String,
    expected: String,
}

/// A transcript: its fence's line, the marker above it (if any), its commands.
#[derive(Debug)]
struct Transcript {
    line: usize,
    marker: Option<&'static str>,
    cases: Vec<Case>,
}

/// The fenced blocks of a markdown file: (line of the fence, language, body, the last
/// non-blank line before the fence).
fn blocks(text: &str) -> Vec<(usize, String, String, String)> {
    let mut out = Vec::new();
    let mut open: Option<(usize, String, String, String)> = None;
    let mut before = String::new();
    for (n, line) in text.lines().enumerate() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(lang)) => open = Some((n + 1, lang.trim().to_owned(), String::new(), before.clone())),
            (Some(_), Some("")) => out.extend(open.take()),
            (Some((_, _, body, _)), _) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, None) if !line.trim().is_empty() => before = line.trim().to_owned(),
            (None, None) => {}
        }
    }
    out
}

/// The word ending the here-document that `command` opens (`<<'EOF'`, `<<EOF`, `<<-"PY"`: a
/// word of capitals and `_`, so a shift such as `1 << 20` is none), if it opens one.
fn heredoc_end(command: &str) -> Option<String> {
    command.match_indices("<<").find_map(|(at, _)| {
        let rest = command[at + 2..].trim_start_matches('-').trim_start();
        let rest = rest.trim_start_matches(['\'', '"']);
        let word: String = rest.chars().take_while(|c| c.is_ascii_uppercase() || *c == '_').collect();
        (!word.is_empty()).then_some(word)
    })
}

/// The transcripts of `file` (relative to the repository root).
fn transcripts(file: &str) -> Vec<Transcript> {
    transcripts_in(&std::fs::read_to_string(Path::new(ROOT).join(file)).unwrap())
}

/// The transcripts of a markdown text.
fn transcripts_in(text: &str) -> Vec<Transcript> {
    let mut out = Vec::new();
    for (fence, lang, body, before) in blocks(text) {
        if !(lang.is_empty() || lang == "console") || !body.starts_with("$ ") {
            continue;
        }
        let marker = [GPU_HOST, CLUSTER]
            .into_iter()
            .find(|m| before == *m)
            .or_else(|| (before.starts_with(NOT_YET) && before.ends_with(".*")).then_some(NOT_YET));
        let mut cases: Vec<Case> = Vec::new();
        let mut lines = body.lines().enumerate();
        while let Some((i, line)) = lines.next() {
            if let Some(command) = line.strip_prefix("$ ") {
                let mut command = command.to_owned();
                if let Some(end) = heredoc_end(&command) {
                    for (_, l) in lines.by_ref() {
                        command.push('\n');
                        command.push_str(l);
                        if l == end {
                            break;
                        }
                    }
                }
                while command.ends_with('\\') {
                    let Some((_, l)) = lines.next() else { break };
                    command.push('\n');
                    command.push_str(l);
                }
                cases.push(Case { line: fence + 1 + i, command, expected: String::new() });
            } else if let Some(case) = cases.last_mut() {
                case.expected.push_str(line);
                case.expected.push('\n');
            }
        }
        out.push(Transcript { line: fence, marker, cases });
    }
    out
}

/// README.md and docs/*.md, sorted.
fn doc_files() -> Vec<String> {
    let mut files = vec!["README.md".to_owned()];
    for entry in std::fs::read_dir(Path::new(ROOT).join("docs")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".md") {
            files.push(format!("docs/{name}"));
        }
    }
    files.sort();
    files
}

/// The end of a command's output in the shell's stream: the line after it carries its status.
const END: &str = "\x1fdocs-end ";

/// Run by `sh -c` with the checkout as `$1`: empty tmpfs on /run and /tmp, then bash. A
/// checkout under /tmp (CI clones into /tmp/ci) is bound back into the new /tmp first, or the
/// tmpfs would hide the binaries, `examples` and the scratch directory (seen: every command
/// "not found" in a fresh-clone CI run). `fusectl` is mounted where nobody has (a host systemd
/// did not boot: docs/daemon.md aborts a connection through it; seen failing on a fresh CI
/// machine, where only a later test mounted it).
const FRESH_RUN_AND_TMP: &str = r#"set -e
grep -qs ' /sys/fs/fuse/connections fusectl ' /proc/mounts || mount -t fusectl fusectl /sys/fs/fuse/connections
mount -t tmpfs -o mode=0755 docs-run /run
case "$1" in /tmp/*) mkdir /run/.host-tmp; mount --bind /tmp /run/.host-tmp ;; esac
mount -t tmpfs docs-tmp /tmp
case "$1" in /tmp/*)
    mkdir -p "$1"; mount --bind "/run/.host-tmp/${1#/tmp/}" "$1"
    umount -l /run/.host-tmp; rmdir /run/.host-tmp
    # The shell's working directory is still the one under the hidden /tmp; entered again by
    # its path, it is the bound-in checkout's. (Seen: a relative `--output` renamed from a
    # temporary file that `tempfile` had named by the absolute path failed with EXDEV.)
    cd "$(pwd -P)" ;;
esac
set +e
exec bash --noprofile --norc"#;

/// One bash, in a scratch directory, that runs a file's commands in order.
struct Shell {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    _dir: tempfile::TempDir,
    _tools: tempfile::TempDir,
}

impl Shell {
    fn new() -> Shell {
        // Not under /tmp, which the namespace below covers with a tmpfs of its own.
        std::fs::create_dir_all(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let dir = tempfile::TempDir::new_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        for name in ["examples", "tests"] {
            std::os::unix::fs::symlink(Path::new(ROOT).join(name), dir.path().join(name)).unwrap();
        }
        let tools = tempfile::TempDir::new_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let bin = Path::new(common::BIN).parent().unwrap();
        let path = format!("{}:{}", bin.display(), common::clients::path_with_criu(tools.path()));
        let (out, err) = std::io::pipe().unwrap();
        // A mount namespace of its own with an empty /run and /tmp: the docs' /run/devremap and
        // /tmp/demo are then the fresh ones they start from, and whatever they leave mounted
        // goes with the namespace. A pid namespace whose init is the shell: its end (the
        // killpg in drop) kills everything the doc started, wherever it was reparented to.
        let mut child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "--", "sh", "-c"])
            .arg(FRESH_RUN_AND_TMP)
            .args(["sh", ROOT])
            .current_dir(dir.path())
            .env("PATH", path)
            .env("LC_ALL", "C.UTF-8")
            .env_remove("RUST_LOG")
            .env_remove("DEVREMAP_RUNTIME_CONFIG")
            .stdin(Stdio::piped())
            .stdout(err.try_clone().unwrap())
            .stderr(err)
            .process_group(0)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                if tx.send(line.unwrap_or_else(|e| format!("(unreadable: {e})"))).is_err() {
                    break;
                }
            }
        });
        Shell { child, stdin, lines, _dir: dir, _tools: tools }
    }

    /// Runs `command` (stdin from /dev/null) and returns what it printed, or why it did not end.
    fn run(&mut self, command: &str) -> Result<String, String> {
        let script = format!("{{ {command}\n}} </dev/null\nprintf '\\n{END}%d\\n' $?\n");
        self.stdin.write_all(script.as_bytes()).map_err(|e| format!("the shell is gone: {e}"))?;
        let mut got = String::new();
        loop {
            match self.lines.recv_timeout(PATIENCE) {
                Ok(line) if line.starts_with(END) => break,
                Ok(line) => {
                    got.push_str(&line);
                    got.push('\n');
                }
                Err(RecvTimeoutError::Timeout) => return Err(format!("still running after {PATIENCE:?}:\n{got}")),
                Err(RecvTimeoutError::Disconnected) => return Err(format!("the shell exited:\n{got}")),
            }
        }
        // The newline printed before the end marker.
        got.pop();
        Ok(got)
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        // The whole group: a command the doc left running in the background too.
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// A log line's timestamp, which the docs show as `[...` or a real time: both become `[T`; and
/// in a log line, each pid (`pid 5852`) becomes `pid P`.
fn normalised(text: &str) -> String {
    text.lines()
        .map(|l| match (l.strip_prefix('['), l.find(' ')) {
            (Some(_), Some(sp)) if l.starts_with("[...") || l[1..sp].contains('T') => {
                format!("[T{}", without_pids(&l[sp..]))
            }
            _ => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `text` with the digits after each `pid ` replaced by `P`.
fn without_pids(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("pid ") {
        out.push_str(&rest[..at + 4]);
        rest = &rest[at + 4..];
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 {
            out.push('P');
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    out
}

/// Whether `got` is `expected`, where a line `...` (indented or not) in `expected` stands for
/// any number of lines, as in trycmd.
fn matches(got: &str, expected: &str) -> bool {
    fn walk(got: &[&str], expected: &[&str]) -> bool {
        match expected.split_first() {
            None => got.is_empty(),
            Some((e, rest)) if e.trim() == "..." => (0..=got.len()).any(|skip| walk(&got[skip..], rest)),
            Some((e, rest)) => got.split_first().is_some_and(|(g, grest)| g == e && walk(grest, rest)),
        }
    }
    let (got, expected): (Vec<&str>, Vec<&str>) = (got.lines().collect(), expected.lines().collect());
    walk(&got, &expected)
}

/// The number of commands per kind over all docs: (run, marked per marker).
fn counts() -> (usize, Vec<(&'static str, usize)>) {
    let all: Vec<Transcript> = doc_files().iter().flat_map(|f| transcripts(f)).collect();
    let run = all.iter().filter(|t| t.marker.is_none()).map(|t| t.cases.len()).sum();
    let marked = MARKED
        .iter()
        .map(|(m, _)| (*m, all.iter().filter(|t| t.marker == Some(*m)).map(|t| t.cases.len()).sum()))
        .collect();
    (run, marked)
}

/// Rule (issue 21): the docs hold as many runnable and as many marked commands as pinned here,
/// so a transcript the parser stops recognising, or one newly marked, fails (without root).
#[test]
fn the_docs_hold_the_pinned_number_of_transcripts() {
    let (run, marked) = counts();
    assert_eq!((run, marked), (RUN, MARKED.to_vec()), "(commands run, commands marked per marker)");
}

/// Rule (issue 21): every transcript of README.md and docs/*.md that is not marked runs as
/// written, top to bottom in its file, and prints what the doc shows.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and CRIU: the docs' examples make device nodes, mount and checkpoint a container"]
fn the_docs_transcripts_print_what_they_show() {
    common::need_root();
    common::bundle::need_containers(common::bundle::Runtime::Runc);
    common::clients::need_criu();
    let mut ran = 0;
    let mut failures = Vec::new();
    // DOCS_ONLY=docs/remap.md runs one file (while editing it); the count is then not checked.
    let only = std::env::var("DOCS_ONLY").ok();
    for file in doc_files().into_iter().filter(|f| only.as_ref().is_none_or(|o| o == f)) {
        let mut shell = None;
        // A command that did not end leaves the shell busy: the file's later commands cannot run.
        'file: for transcript in transcripts(&file).into_iter().filter(|t| t.marker.is_none()) {
            let shell = shell.get_or_insert_with(Shell::new);
            for case in &transcript.cases {
                ran += 1;
                let got = match shell.run(&case.command) {
                    Ok(got) => got,
                    Err(why) => {
                        failures.push(format!("{file}:{}: $ {}\n{why}", case.line, case.command));
                        break 'file;
                    }
                };
                if !matches(&normalised(&got), &normalised(&case.expected)) {
                    failures.push(format!(
                        "{file}:{} (block at {}): $ {}\n--- the doc shows:\n{}--- it printed:\n{got}",
                        case.line, transcript.line, case.command, case.expected
                    ));
                }
            }
        }
    }
    eprintln!("{ran} commands run");
    assert!(failures.is_empty(), "{} of {ran} commands differ:\n\n{}", failures.len(), failures.join("\n"));
    if only.is_none() {
        assert_eq!(ran, RUN, "commands run");
    }
}

/// Rule (issue 21): the README's quick start prints exactly the block that follows it.
#[test]
fn the_quick_start_prints_what_the_readme_shows() {
    let text = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let all = blocks(&text);
    let at = all
        .iter()
        .position(|(_, lang, body, _)| lang == "sh" && body.starts_with("cargo run --release -- plan "))
        .unwrap();
    let command = all[at].2.trim().replace("cargo run --release --", "devremapd");
    let expected = &all[at + 1].2;
    let bin = Path::new(common::BIN).parent().unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new("sh")
        .args(["-c", &format!("{{ {command}\n}} 2>&1")])
        .current_dir(ROOT)
        .env("PATH", path)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert_eq!(&String::from_utf8_lossy(&out.stdout), expected, "README's quick start: $ {command}");
}

/// Rule (issue 21): the parser reads what the docs write: a here-document and a `\` line are
/// one command, the lines after a command are its output, a marker line right above a block
/// marks it, and a block with a language (`sh`) is no transcript.
#[test]
fn transcripts_are_read_as_the_docs_write_them() {
    let text = "intro:\n\n```\n$ cat > x <<'EOF'\n$ not a command\nEOF\n$ echo a \\\n  b\na b\n$ echo $((1 << 2))\n4\n```\n\n\
                *Not run by the tests yet: a reason.*\n\n```\n$ false\n```\n\n```sh\n$ echo no\n```\n";
    let all = transcripts_in(text);
    assert_eq!(all.len(), 2, "{all:?}");
    let (first, marked) = (&all[0], &all[1]);
    assert_eq!((first.line, first.marker), (3, None));
    let commands: Vec<(&str, &str)> = first.cases.iter().map(|c| (c.command.as_str(), c.expected.as_str())).collect();
    assert_eq!(
        commands,
        [("cat > x <<'EOF'\n$ not a command\nEOF", ""), ("echo a \\\n  b", "a b\n"), ("echo $((1 << 2))", "4\n")]
    );
    assert_eq!(first.cases[1].line, 7);
    assert_eq!((marked.marker, marked.cases.len()), (Some(NOT_YET), 1));
}

/// Rule (issue 21): `...` stands for any number of lines, and nothing else is loose but a log
/// line's timestamp and pids (a pid in a command's own output is compared as printed).
#[test]
fn an_ellipsis_line_stands_for_any_lines() {
    assert!(matches("a\nb\nc\nd\n", "a\n  ...\nd\n"));
    assert!(matches("a\nd\n", "a\n...\nd\n"));
    assert!(!matches("a\nb\n", "a\n"));
    assert!(!matches("a\nb\nc\n", "a\n...\nd\n"));
    assert_eq!(normalised("[2026-11-30T12:29:35.020Z WARN  x] y"), normalised("[... WARN  x] y"));
    assert_eq!(
        normalised("[2026-11-30T12:29:35.020Z INFO  x] (keeper pid 5852, server pid 5856)"),
        "[T INFO  x] (keeper pid P, server pid P)"
    );
    assert_eq!(normalised("pid 5852 is not a log line"), "pid 5852 is not a log line");
}
