//! When a reload the node daemon asked of a container's keeper (`SIGHUP`, for `ctl reload` and
//! the daemon's own `SIGHUP`) has finished, read from the container's state file: its
//! `server_pid` and `reloads`, the reloads the serving server finished (applied, refused or
//! abandoned).
//!
//! Assumptions: `reloads` counts the reloads finished since the mount, on across the servers
//! that take over (a crash, an upgrade, a wake after a rest), but for a server of an earlier
//! build, which counts from 0 in each server; a keeper given `SIGHUP` while a server takes over
//! (or while resting: `server_pid` is null then) has the server that then serves reload once it
//! does, so the next reload finished after the request is the one asked for.

use serde_json::Value;

/// What a state file says of the reloads of the server serving then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reloads {
    server_pid: Option<u64>,
    reloads: Option<u64>,
}

impl Reloads {
    /// From a state file's JSON (`Value::Null` when it cannot be read).
    pub fn of(state: &Value) -> Reloads {
        Reloads { server_pid: state["server_pid"].as_u64(), reloads: state["reloads"].as_u64() }
    }

    /// Whether `now` shows a reload finished since `self`, read before it was asked for: the
    /// count moved on, or a server that took over meanwhile counts from 0 (an earlier build's)
    /// and has finished one.
    pub fn finished_by(self, now: Reloads) -> bool {
        let Some(n) = now.reloads else { return false };
        let same = now.server_pid == self.server_pid;
        match self.reloads {
            None => same || n >= 1,
            Some(before) if n > before => true,
            Some(before) => !same && n < before && n >= 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn at(server_pid: u64, reloads: u64) -> Reloads {
        Reloads::of(&json!({"server_pid": server_pid, "reloads": reloads}))
    }

    /// Bug (found from outside): `ctl reload ID` while the container's server was upgraded
    /// waited for `reloads` to pass the old server's count, which the new server starts again
    /// from 0: it waited its 30 s and said the reload unfinished, though the new server had
    /// reloaded.
    #[test]
    fn a_reload_by_a_server_that_took_over_is_finished() {
        let before = at(10, 5);
        assert!(!before.finished_by(at(10, 5)));
        assert!(before.finished_by(at(10, 6)));
        assert!(!before.finished_by(at(11, 0)), "the new server has not reloaded yet");
        assert!(before.finished_by(at(11, 1)), "an earlier build's server, counting from 0");
    }

    /// Rule (issue 31): the count goes on across a takeover, and a resting mount names no
    /// server: a `SIGHUP` to a resting keeper is finished once the server it wakes has reloaded
    /// (found from outside: the woken server's count started again from 0, and a script waiting
    /// for `reloads` to move waited for ever), and still when that server rested again since.
    #[test]
    fn a_reload_by_a_woken_server_is_finished_once_it_reloaded() {
        let resting = Reloads::of(&json!({"server_pid": null, "reloads": 5}));
        assert!(!resting.finished_by(at(12, 5)), "woken, not yet reloaded");
        assert!(resting.finished_by(at(12, 6)));
        assert!(resting.finished_by(Reloads::of(&json!({"server_pid": null, "reloads": 6}))), "rested again since");
        assert!(!resting.finished_by(resting));
        assert!(!at(10, 5).finished_by(at(11, 5)), "a crash's successor before its reload");
    }

    /// Rule: a state file not yet written, or unreadable, is no reload finished; one written
    /// after it was read before is.
    #[test]
    fn an_unreadable_state_file_is_no_finished_reload() {
        let unread = Reloads::of(&Value::Null);
        assert!(!unread.finished_by(unread));
        assert!(!at(10, 5).finished_by(unread));
        assert!(unread.finished_by(at(10, 1)));
        assert!(!unread.finished_by(at(10, 0)));
    }
}
