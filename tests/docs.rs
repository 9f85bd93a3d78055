//! The docs' examples, run: every transcript in README.md and docs/*.md (a fenced block whose
//! lines starting `$ devremapd ` are commands, each followed by its expected output) whose
//! command needs nothing but the repository's own files runs here, in the repository root,
//! with this build's `devremapd` first on `PATH`, and its output (stderr and stdout, as a
//! terminal shows them) must be the block's. The README's quick start, an `sh` block followed
//! by its output, is checked the same way.
//!
//! A transcript that names a file outside the repository (`/tmp/devremap-host`, a mountpoint
//! under `/run/devremap`, a file an earlier block or the prose describes) is not run here:
//! most of remap.md's are such, so remap.md does not yet run top to bottom.

mod common;

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// One transcript entry: where it is, the command, the output it shows.
#[derive(Debug)]
struct Case {
    file: String,
    line: usize,
    command: String,
    expected: String,
}

/// The fenced blocks of a markdown file: (line of the fence, language, body).
fn blocks(text: &str) -> Vec<(usize, String, String)> {
    let mut out = Vec::new();
    let mut open: Option<(usize, String, String)> = None;
    for (n, line) in text.lines().enumerate() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(lang)) => open = Some((n + 1, lang.trim().to_owned(), String::new())),
            (Some(_), Some("")) => out.extend(open.take()),
            (Some((_, _, body)), _) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// The transcripts of `file` (relative to the repository root).
fn cases(file: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(Path::new(ROOT).join(file)).unwrap();
    let mut out: Vec<Case> = Vec::new();
    for (fence, lang, body) in blocks(&text) {
        if !lang.is_empty() || !body.starts_with("$ devremapd ") {
            continue;
        }
        for (i, line) in body.lines().enumerate() {
            if let Some(command) = line.strip_prefix("$ ") {
                out.push(Case {
                    file: file.to_owned(),
                    line: fence + 1 + i,
                    command: command.to_owned(),
                    expected: String::new(),
                });
            } else if let Some(case) = out.last_mut() {
                case.expected.push_str(line);
                case.expected.push('\n');
            }
        }
    }
    out
}

/// Whether the command needs only the repository's files: every argument that is a path
/// (holds a `/`, or ends `.json`) is one that exists from the repository root, or
/// `/dev/null`.
fn runs_here(command: &str) -> bool {
    let words = command.split('|').next().unwrap_or_default().split_whitespace();
    let words = words.map(|w| w.strip_prefix("2>").unwrap_or(w));
    words.filter(|w| !w.starts_with('-') && (w.contains('/') || w.ends_with(".json"))).all(|w| {
        let p = Path::new(w);
        w == "/dev/null" || (!p.is_absolute() && Path::new(ROOT).join(p).exists())
    })
}

/// Runs `command` in the repository root, with this build's binaries first on PATH; returns
/// stderr and stdout as one stream, in order.
fn run(command: &str) -> String {
    let bin = Path::new(common::BIN).parent().unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new("sh")
        .args(["-c", &format!("{{ {command}\n}} 2>&1")])
        .current_dir(ROOT)
        .env("PATH", path)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A log line's timestamp, which the docs show as `[...` or a real time: both become `[T`.
fn without_times(text: &str) -> String {
    text.lines()
        .map(|l| match (l.strip_prefix('['), l.find(' ')) {
            (Some(_), Some(sp)) if l.starts_with("[...") || l[1..sp].contains('T') => format!("[T{}", &l[sp..]),
            _ => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
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

/// Rule (issue 21): every transcript that needs only the repository runs as written and
/// prints what the doc shows.
#[test]
fn the_docs_transcripts_print_what_they_show() {
    let mut files = vec!["README.md".to_owned()];
    for entry in std::fs::read_dir(Path::new(ROOT).join("docs")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".md") {
            files.push(format!("docs/{name}"));
        }
    }
    files.sort();
    let mut ran = 0;
    let mut failures = Vec::new();
    for case in files.iter().flat_map(|f| cases(f)) {
        if !runs_here(&case.command) {
            continue;
        }
        ran += 1;
        let got = run(&case.command);
        if !matches(&without_times(&got), &without_times(&case.expected)) {
            failures.push(format!(
                "{}:{}: $ {}\n--- the doc shows:\n{}--- it printed:\n{got}",
                case.file, case.line, case.command, case.expected
            ));
        }
    }
    assert!(failures.is_empty(), "{} of {ran} transcripts differ:\n\n{}", failures.len(), failures.join("\n"));
    assert!(ran >= 10, "only {ran} transcripts ran: the docs' format changed?");
}

/// Rule (issue 21): the README's quick start prints exactly the block that follows it.
#[test]
fn the_quick_start_prints_what_the_readme_shows() {
    let text = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let all = blocks(&text);
    let at = all
        .iter()
        .position(|(_, lang, body)| lang == "sh" && body.starts_with("cargo run --release -- plan "))
        .unwrap();
    let command = all[at].2.trim().replace("cargo run --release --", "devremapd");
    let expected = &all[at + 1].2;
    assert_eq!(&run(&command), expected, "README's quick start: $ {command}");
}
