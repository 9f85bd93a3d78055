//! What `/proc/<pid>/stat` says of a process: read once, split once. The command name (field 2,
//! in parentheses) may hold spaces and parentheses, so the fields are counted from its end.

/// The fields of `/proc/<pid>/stat` (`pid` a number or `self`) from the third on, `None` where
/// the process is gone or the file unreadable.
pub struct Stat(Vec<String>);

impl Stat {
    pub fn of(pid: &str) -> Option<Stat> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Some(Stat(text.rsplit_once(')')?.1.split_whitespace().map(str::to_owned).collect()))
    }

    /// Field `n`, counted as `proc(5)` counts them (1 is the pid, 3 the state).
    pub fn field(&self, n: usize) -> Option<&str> {
        self.0.get(n.checked_sub(3)?).map(String::as_str)
    }

    /// Field `n` as a number.
    pub fn number(&self, n: usize) -> Option<u64> {
        self.field(n)?.parse().ok()
    }
}
