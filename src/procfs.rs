//! What `/proc/<pid>/stat` says of a process: read once, split once. The command name (field 2,
//! in parentheses) may hold spaces and parentheses, so the fields are counted from its end.
//! Used by both binaries: the daemon's checks of its parked processes, the wrapper's words on a
//! stopped keeper.

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

/// Whether process `pid` can run: not stopped (`SIGSTOP`, a debugger: `T`, `t`) nor gone (`Z`,
/// `X`, no such process), so that a parked process handed a container would not leave its start
/// waiting. A process in `D` (paging its binary in, say) runs again by itself.
pub fn runs(pid: u32) -> bool {
    let stat = Stat::of(&pid.to_string());
    matches!(stat.as_ref().and_then(|s| s.field(3)), Some("S" | "R" | "D" | "I"))
}
