//! The node daemon's table of containers, and its decisions: which container a mount, an exit,
//! a reload or a stop concerns, what a daemon restart finds in the state dir, and when an idle
//! daemon that a wrapper started may go. Pure: the binary does what the answers say (spawns,
//! signals, tears down) and tells the table what happened.
//!
//! Each container has its own keeper process (`devremapd mount`), its own FUSE connection,
//! mountpoint, state file and log, so one container's inputs, reloads or crash never reach
//! another's; the table is what one daemon knows of them all. A slot is `Starting` from the
//! mount request until the keeper answers (another request for the id is refused meanwhile),
//! then `Serving` its keeper's pid until that pid exits.

use std::collections::BTreeMap;

/// A container's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Its keeper is being started; `serial` tells this start from a later one of the same id,
    /// `reloads` is how many node-wide reloads had been asked when it began.
    Starting { serial: u64, reloads: u64 },
    /// Its keeper, `pid`, serves the mount, whose FUSE connection (its device number) is
    /// `connection` once known ([`Registry::connected`]).
    Serving { serial: u64, pid: u32, connection: Option<u64> },
}

/// Why a request for a container is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("container {id}: served already (its devremapd keeper is pid {pid})")]
    Served { id: String, pid: u32 },
    #[error("container {id}: being set up by another request")]
    Starting { id: String },
    #[error("no such container: {id} (the node daemon serves none of that id)")]
    Unknown { id: String },
}

/// What a state dir entry found at the daemon's start is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub id: String,
    /// The live keeper its pid file names (checked to serve this mountpoint), if any.
    pub keeper: Option<u32>,
    /// A front end holds its lock (setting it up, or an earlier wrapper running it).
    pub busy: bool,
    /// Marked for a node daemon (by a wrapper or the NRI plugin), not an earlier version's.
    pub node: bool,
}

/// What the daemon does about an entry found at its start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adopt {
    /// Serve it on: its keeper lives (a daemon restart, or a container of the per-container
    /// daemons of an earlier version, which the node watches until its container ends).
    Watch { id: String, pid: u32 },
    /// Left by a container that is gone: tear it down.
    TearDown { id: String },
    /// A front end is at it: not ours to touch.
    Leave { id: String },
}

#[derive(Debug, Default)]
pub struct Registry {
    slots: BTreeMap<String, Slot>,
    next_serial: u64,
    /// Node-wide reloads asked ([`Registry::reload_all`]).
    reloads: u64,
}

impl Registry {
    /// Claims `id` for a mount: the serial to name the start by.
    pub fn begin(&mut self, id: &str) -> Result<u64, RegistryError> {
        match self.slots.get(id) {
            Some(Slot::Serving { pid, .. }) => Err(RegistryError::Served { id: id.to_owned(), pid: *pid }),
            Some(Slot::Starting { .. }) => Err(RegistryError::Starting { id: id.to_owned() }),
            None => {
                self.next_serial += 1;
                let serial = self.next_serial;
                self.slots.insert(id.to_owned(), Slot::Starting { serial, reloads: self.reloads });
                Ok(serial)
            }
        }
    }

    /// The start `serial` of `id` answers: its keeper is `pid`. True when a node-wide reload
    /// was asked while it started: its keeper, which was not among those told, may have loaded
    /// its inputs before, and the caller has it reload now (found from outside: a container
    /// started during a burst served its old device numbers until the next reload).
    pub fn serving(&mut self, id: &str, serial: u64, pid: u32) -> bool {
        let Some(slot) = self.slots.get_mut(id) else { return false };
        let Slot::Starting { serial: began, reloads } = *slot else { return false };
        if began != serial {
            return false;
        }
        *slot = Slot::Serving { serial, pid, connection: None };
        reloads != self.reloads
    }

    /// The mount keeper `pid` serves for `id` is FUSE connection `connection`, as seen once it
    /// answered: what a copy of it handed to a front end must be ([`Registry::connection`]).
    pub fn connected(&mut self, id: &str, pid: u32, connection: u64) {
        if let Some(Slot::Serving { pid: p, connection: c, .. }) = self.slots.get_mut(id)
            && *p == pid
        {
            *c = Some(connection);
        }
    }

    /// The FUSE connection of `id`'s mount, if it is served and the connection was seen.
    pub fn connection(&self, id: &str) -> Option<u64> {
        match self.slots.get(id) {
            Some(Slot::Serving { connection, .. }) => *connection,
            _ => None,
        }
    }

    /// A node-wide reload is asked: the keepers to tell now. Those still starting are told
    /// once they serve ([`Registry::serving`]).
    pub fn reload_all(&mut self) -> Vec<(String, u32)> {
        self.reloads += 1;
        self.serving_all()
    }

    /// The start `serial` of `id` failed (its own cleanup is done): the id is free again.
    pub fn failed(&mut self, id: &str, serial: u64) {
        if matches!(self.slots.get(id), Some(Slot::Starting { serial: s, .. }) if *s == serial) {
            self.slots.remove(id);
        }
    }

    /// Keeper `pid` exited: the container it served, whose slot is now free. The caller tears
    /// the directory down only if [`Registry::is_free`] still says so under the state dir's
    /// lock (a new start of the id may have begun meanwhile).
    pub fn exited(&mut self, pid: u32) -> Option<String> {
        let id = self.slots.iter().find(|(_, s)| matches!(s, Slot::Serving { pid: p, .. } if *p == pid))?.0.clone();
        self.slots.remove(&id);
        Some(id)
    }

    /// Whether nothing is started or served under `id`.
    pub fn is_free(&self, id: &str) -> bool {
        !self.slots.contains_key(id)
    }

    /// The keeper serving `id`.
    pub fn keeper(&self, id: &str) -> Result<u32, RegistryError> {
        match self.slots.get(id) {
            Some(Slot::Serving { pid, .. }) => Ok(*pid),
            Some(Slot::Starting { .. }) => Err(RegistryError::Starting { id: id.to_owned() }),
            None => Err(RegistryError::Unknown { id: id.to_owned() }),
        }
    }

    /// Every container served, by id, with its keeper.
    pub fn serving_all(&self) -> Vec<(String, u32)> {
        self.slots
            .iter()
            .filter_map(|(id, s)| match s {
                Slot::Serving { pid, .. } => Some((id.clone(), *pid)),
                Slot::Starting { .. } => None,
            })
            .collect()
    }

    /// Whether a container's keeper is being started: a daemon making way waits for it.
    pub fn starting(&self) -> bool {
        self.slots.values().any(|s| matches!(s, Slot::Starting { .. }))
    }

    /// Whether no container is started or served: a daemon a wrapper started may go.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Which entries found in the state dir while the daemon runs are left over: unknown here,
    /// with no live keeper and no front end holding them. A front end killed before its request
    /// reached the daemon leaves such a directory, which the daemon never heard of (found from
    /// outside: one in 13 wrappers killed in their first milliseconds).
    pub fn left_over(&self, found: Vec<Found>) -> Vec<String> {
        found
            .into_iter()
            .filter(|f| !f.busy && f.keeper.is_none() && !self.slots.contains_key(&f.id))
            .map(|f| f.id)
            .collect()
    }

    /// What to do about each entry found in the state dir at the start, and takes in those it
    /// watches.
    pub fn adopt(&mut self, found: Vec<Found>) -> Vec<Adopt> {
        found
            .into_iter()
            .map(|f| match f {
                // A node daemon's container with a front end at it: the wrapper between the
                // last daemon's answer and its runtime's exec (which may still ask for a copy
                // of the mount: found from outside, it was refused as unknown), or a
                // foreground runtime. Its keeper serves: watched as any other.
                Found { id, busy: true, keeper: None, .. } | Found { id, busy: true, node: false, .. } => {
                    Adopt::Leave { id }
                }
                Found { id, keeper: Some(pid), .. } => {
                    self.next_serial += 1;
                    let serving = Slot::Serving { serial: self.next_serial, pid, connection: None };
                    self.slots.insert(id.clone(), serving);
                    Adopt::Watch { id, pid }
                }
                Found { id, keeper: None, .. } => Adopt::TearDown { id },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule (issue 31): a request names only its own container; an id is served by one keeper
    /// at a time, and a second start of it is refused while the first is under way or serves.
    #[test]
    fn an_id_is_started_once() {
        let mut r = Registry::default();
        let s = r.begin("a").unwrap();
        assert!(r.starting());
        assert_eq!(r.begin("a"), Err(RegistryError::Starting { id: "a".into() }));
        assert!(r.begin("b").is_ok(), "another container is not held up");
        r.serving("a", s, 10);
        assert_eq!(r.begin("a"), Err(RegistryError::Served { id: "a".into(), pid: 10 }));
        assert_eq!(r.keeper("a"), Ok(10));
        assert_eq!(r.keeper("b"), Err(RegistryError::Starting { id: "b".into() }));
        assert_eq!(r.keeper("c"), Err(RegistryError::Unknown { id: "c".into() }));
    }

    /// Rule (issue 31): a keeper's exit frees its container, and only its own: an exit never
    /// frees a later start of the same id, so the teardown it leads to never removes the new
    /// container's mount (a quick delete and create of one id, `podman restart`).
    /// Bug (found from outside): a node-wide reload reached the keepers serving, not one still
    /// starting, which may have loaded its inputs before the reload was asked: it served them
    /// until the next reload. Its start's end says to reload it, once per start.
    #[test]
    fn a_reload_asked_during_a_start_is_passed_on_when_it_serves() {
        let mut r = Registry::default();
        let a = r.begin("a").unwrap();
        r.serving("a", a, 10);
        let b = r.begin("b").unwrap();
        assert_eq!(r.reload_all(), vec![("a".to_owned(), 10)]);
        let c = r.begin("c").unwrap();
        assert!(r.serving("b", b, 11), "b began before the reload");
        assert!(!r.serving("c", c, 12), "c began after it");
        assert!(!r.serving("b", b, 11), "told once");
        let stale = r.begin("d").unwrap();
        r.failed("d", stale);
        let d = r.begin("d").unwrap();
        r.reload_all();
        assert!(!r.serving("d", stale, 13), "an earlier start of the id is not this one");
        assert!(r.serving("d", d, 14));
    }

    /// Bug (found from outside): `attach` handed out whatever devremap mount was topmost at a
    /// container's `dev` (another container's, bound over it). The connection its keeper's
    /// mount was seen with is kept with its slot, for this keeper only, and goes with it.
    #[test]
    fn a_served_mounts_connection_is_kept_for_its_keeper_alone() {
        let mut r = Registry::default();
        let s = r.begin("a").unwrap();
        r.connected("a", 10, 49);
        assert_eq!(r.connection("a"), None, "not served yet");
        r.serving("a", s, 10);
        r.connected("a", 11, 53);
        assert_eq!(r.connection("a"), None, "another keeper's");
        r.connected("a", 10, 49);
        assert_eq!(r.connection("a"), Some(49));
        assert_eq!(r.exited(10), Some("a".into()));
        assert_eq!(r.connection("a"), None);
    }

    #[test]
    fn an_exit_frees_only_its_own_start() {
        let mut r = Registry::default();
        let s = r.begin("a").unwrap();
        r.serving("a", s, 10);
        assert_eq!(r.exited(10), Some("a".into()));
        assert!(r.is_free("a"));
        let s2 = r.begin("a").unwrap();
        assert_eq!(r.exited(10), None, "the old keeper's pid is not the new start's");
        // A late answer of an earlier start never takes a newer one's slot.
        r.serving("a", s, 11);
        assert_eq!(r.keeper("a"), Err(RegistryError::Starting { id: "a".into() }));
        r.failed("a", s);
        assert!(!r.is_free("a"), "an earlier start's failure leaves the newer one");
        r.serving("a", s2, 12);
        assert_eq!(r.serving_all(), vec![("a".to_owned(), 12)]);
        r.failed("a", s2);
        assert_eq!(r.keeper("a"), Ok(12), "a start that answered is not failed afterwards");
    }

    /// Rule (issue 31): a daemon restarted finds what its predecessor served: a live keeper is
    /// watched, a dead one's directory torn down, one a front end holds left alone unless a
    /// node daemon's keeper serves it (bug found from outside: a wrapper whose start had its
    /// answer just before a restart, and then asked for a copy of the mount, was refused it as
    /// unknown).
    #[test]
    fn a_restart_adopts_what_it_finds() {
        let mut r = Registry::default();
        let found = vec![
            Found { id: "live".into(), keeper: Some(7), busy: false, node: true },
            Found { id: "dead".into(), keeper: None, busy: false, node: true },
            Found { id: "setting-up".into(), keeper: None, busy: true, node: true },
            Found { id: "old-wrapper".into(), keeper: Some(8), busy: true, node: false },
            Found { id: "about-to-exec".into(), keeper: Some(9), busy: true, node: true },
        ];
        assert_eq!(
            r.adopt(found),
            vec![
                Adopt::Watch { id: "live".into(), pid: 7 },
                Adopt::TearDown { id: "dead".into() },
                Adopt::Leave { id: "setting-up".into() },
                Adopt::Leave { id: "old-wrapper".into() },
                Adopt::Watch { id: "about-to-exec".into(), pid: 9 },
            ]
        );
        assert_eq!(r.keeper("live"), Ok(7));
        assert!(r.is_free("dead") && r.is_free("setting-up"));
        assert_eq!(r.exited(7), Some("live".into()));
        assert_eq!(r.exited(9), Some("about-to-exec".into()));
        assert!(r.is_empty());
    }

    /// Rule (found from outside): while the daemon runs, a directory is left over only when no
    /// one has it: not started or served here, no live keeper, no front end holding its lock.
    #[test]
    fn only_a_directory_no_one_has_is_left_over() {
        let mut r = Registry::default();
        let starting = r.begin("starting").unwrap();
        let served = r.begin("served").unwrap();
        r.serving("served", served, 10);
        let found = vec![
            Found { id: "starting".into(), keeper: None, busy: false, node: true },
            Found { id: "served".into(), keeper: None, busy: false, node: true },
            Found { id: "held".into(), keeper: None, busy: true, node: true },
            Found { id: "earlier-version".into(), keeper: Some(8), busy: false, node: false },
            Found { id: "killed-wrapper".into(), keeper: None, busy: false, node: true },
        ];
        assert_eq!(r.left_over(found), vec!["killed-wrapper".to_owned()]);
        r.failed("starting", starting);
        assert_eq!(
            r.left_over(vec![Found { id: "starting".into(), keeper: None, busy: false, node: true }]),
            vec!["starting"]
        );
    }
}
