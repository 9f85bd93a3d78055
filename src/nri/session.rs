//! One connection to containerd as an NRI plugin, as a state machine from bytes read to bytes
//! to write: the plugin's `RegisterPlugin` call on the runtime connection, and every call
//! containerd makes on the plugin connection, each answered in turn by asking the
//! [`Handler`]. The I/O (the socket, reconnecting) is the caller's.
//!
//! Assumptions (containerd/nri v0.6.1, `pkg/stub`, `pkg/adaptation`): containerd calls
//! `Configure` then `Synchronize` once the registration is in (possibly before its answer to
//! `RegisterPlugin` arrives), then the events the plugin subscribed to, one call at a time;
//! each call is a unary ttrpc request with an odd stream id. The event mask has bit
//! `1 << (event - 1)` set for each event (`EventMask.Set`). A call answered with an error status
//! fails what containerd was doing (a container's creation); one not answered within NRI's
//! request timeout (2 s) makes containerd drop the plugin's connection.

use super::api::{self, Event};
use super::convert;
use super::view::Handler;
use super::wire::{self, Demux, Header, Messages, PLUGIN_CONN, REQUEST, RESPONSE, RUNTIME_CONN, WireError};
use prost::Message;

const PLUGIN_SERVICE: &str = "nri.pkg.api.v1alpha1.Plugin";
const RUNTIME_SERVICE: &str = "nri.pkg.api.v1alpha1.Runtime";
/// The stream of the plugin's one call, `RegisterPlugin`.
const REGISTER_STREAM: u32 = 1;

/// The events devremap subscribes to: a container being created (to adjust it) and created
/// (its `/dev` must answer before containerd's CreateContainer returns), running, stopped (also
/// when its task exited) and removed. Never the pod sandbox's.
pub const EVENTS: [Event; 5] = [
    Event::CreateContainer,
    Event::PostCreateContainer,
    Event::PostStartContainer,
    Event::StopContainer,
    Event::RemoveContainer,
];

/// [`EVENTS`] as `ConfigureResponse.events`.
pub fn event_mask(events: &[Event]) -> i32 {
    events.iter().fold(0, |mask, &e| mask | 1 << (e as i32 - 1))
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("containerd's {what} does not decode: {source}")]
    Decode { what: &'static str, source: prost::DecodeError },
    #[error("containerd refused the registration: {0}")]
    Refused(String),
    #[error("unexpected ttrpc message (type {kind}, stream {stream}) on connection {conn}")]
    Unexpected { conn: u32, kind: u8, stream: u32 },
}

/// What a turn did that a user cares about (the caller logs it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Happened {
    /// containerd answered `RegisterPlugin`.
    Registered,
    /// `Configure`: the runtime's name and version.
    Configured { runtime: String, version: String },
    /// `Synchronize`: how many pods and containers containerd listed.
    Synchronized { pods: usize, containers: usize },
    /// `Shutdown`: containerd is going down.
    Shutdown,
    /// The handler panicked; the call was answered with this message as an error.
    Panicked(String),
}

/// What a turn answers: the bytes to write to the socket, and what happened.
#[derive(Debug, Default)]
pub struct Turn {
    pub write: Vec<u8>,
    pub happened: Vec<Happened>,
}

pub struct Session<'h> {
    handler: &'h dyn Handler,
    demux: Demux,
    plugin: Messages,
    runtime: Messages,
    /// The parts of a split `Synchronize` received so far (see [`Session::synchronize`]).
    syncing: Option<(Vec<super::view::Pod>, Vec<super::view::Container>)>,
}

impl<'h> Session<'h> {
    /// A session for plugin `name` at `index` (two digits, NRI's order among plugins), and the
    /// bytes of its `RegisterPlugin` call, to write first.
    pub fn start(handler: &'h dyn Handler, name: &str, index: &str) -> (Session<'h>, Vec<u8>) {
        let register = api::RegisterPluginRequest { plugin_name: name.to_owned(), plugin_idx: index.to_owned() };
        let request = wire::Request {
            service: RUNTIME_SERVICE.to_owned(),
            method: "RegisterPlugin".to_owned(),
            payload: register.encode_to_vec(),
            // NRI's registration timeout.
            timeout_nano: 5_000_000_000,
        };
        let header = Header { stream: REGISTER_STREAM, kind: REQUEST, flags: 0 };
        let bytes = wire::mux_frames(RUNTIME_CONN, &wire::message(header, &request.encode_to_vec()));
        let session = Session {
            handler,
            demux: Demux::default(),
            plugin: Messages::new(PLUGIN_CONN),
            runtime: Messages::new(RUNTIME_CONN),
            syncing: None,
        };
        (session, bytes)
    }

    /// Takes bytes read from the socket; answers every call that is now whole.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Turn, SessionError> {
        let mut turn = Turn::default();
        self.demux.push(bytes);
        while let Some((conn, payload)) = self.demux.next_frame()? {
            match conn {
                PLUGIN_CONN => self.plugin.push(&payload),
                RUNTIME_CONN => self.runtime.push(&payload),
                // Go's mux drops frames for a connection nobody opened.
                _ => {}
            }
        }
        while let Some((header, data)) = self.runtime.next_message()? {
            if header.kind != RESPONSE || header.stream != REGISTER_STREAM {
                return Err(SessionError::Unexpected { conn: RUNTIME_CONN, kind: header.kind, stream: header.stream });
            }
            let response = decode::<wire::Response>(&data, "RegisterPlugin answer")?;
            match response.status {
                Some(status) if status.code != 0 => return Err(SessionError::Refused(status.message)),
                _ => turn.happened.push(Happened::Registered),
            }
        }
        while let Some((header, data)) = self.plugin.next_message()? {
            if header.kind != REQUEST {
                return Err(SessionError::Unexpected { conn: PLUGIN_CONN, kind: header.kind, stream: header.stream });
            }
            let request = decode::<wire::Request>(&data, "request")?;
            // A handler's panic fails its call alone: the plugin answers, and serves on.
            let answered =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.answer(&request, &mut turn.happened)));
            let response = answered.unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_owned());
                let message = format!("devremap's NRI handler panicked in {} ({what})", request.method);
                turn.happened.push(Happened::Panicked(message.clone()));
                Ok(failed(wire::INTERNAL, message))
            })?;
            let reply =
                wire::message(Header { stream: header.stream, kind: RESPONSE, flags: 0 }, &response.encode_to_vec());
            turn.write.extend(wire::mux_frames(PLUGIN_CONN, &reply));
        }
        Ok(turn)
    }

    fn answer(
        &mut self,
        request: &wire::Request,
        happened: &mut Vec<Happened>,
    ) -> Result<wire::Response, SessionError> {
        if request.service != PLUGIN_SERVICE {
            return Ok(failed(wire::UNIMPLEMENTED, format!("no service {}", request.service)));
        }
        let payload = request.payload.as_slice();
        let h = self.handler;
        let answer = match request.method.as_str() {
            "Configure" => {
                let r = decode::<api::ConfigureRequest>(payload, "Configure")?;
                happened.push(Happened::Configured { runtime: r.runtime_name, version: r.runtime_version });
                api::ConfigureResponse { events: event_mask(&EVENTS) }.encode_to_vec()
            }
            "Synchronize" => self.synchronize(decode(payload, "Synchronize")?, happened).encode_to_vec(),
            "Shutdown" => {
                happened.push(Happened::Shutdown);
                api::Empty::default().encode_to_vec()
            }
            "CreateContainer" => {
                let r = decode::<api::CreateContainerRequest>(payload, "CreateContainer")?;
                let (pod, container) = parts(r.pod.as_ref(), r.container.as_ref());
                match h.create(&pod, &container) {
                    Ok(a) => {
                        api::CreateContainerResponse { adjust: Some(convert::adjustment(&a)), ..Default::default() }
                            .encode_to_vec()
                    }
                    Err(message) => return Ok(failed(wire::UNKNOWN, message)),
                }
            }
            "StopContainer" => {
                let r = decode::<api::StopContainerRequest>(payload, "StopContainer")?;
                let (pod, container) = parts(r.pod.as_ref(), r.container.as_ref());
                h.stopped(&pod, &container);
                api::StopContainerResponse::default().encode_to_vec()
            }
            "StateChange" => {
                let r = decode::<api::StateChangeEvent>(payload, "StateChange")?;
                let (pod, container) = parts(r.pod.as_ref(), r.container.as_ref());
                match r.event() {
                    Event::PostCreateContainer => h.post_create(&pod, &container),
                    Event::StartContainer | Event::PostStartContainer => h.started(&pod, &container),
                    Event::RemoveContainer => h.removed(&pod, &container),
                    // Not subscribed to: containerd sends none of these.
                    _ => {}
                }
                api::Empty::default().encode_to_vec()
            }
            // Not subscribed to (containerd sends none), and nothing to change if it did.
            "UpdateContainer" => api::UpdateContainerResponse::default().encode_to_vec(),
            other => return Ok(failed(wire::UNIMPLEMENTED, format!("no method {other}"))),
        };
        Ok(wire::Response { status: None, payload: answer })
    }
}

impl Session<'_> {
    /// `Synchronize`, whole or in parts. From NRI v0.9 on (containerd 2.1) a runtime whose list
    /// is too large for one message (ttrpc's 4 MiB) sends it in parts, each but the last with
    /// `more`, and closes a plugin that does not answer a part with `more`: the handler is
    /// given the whole list once the last part is in (taken for the whole list, a part would
    /// have every NRI container listed in the others torn down). v0.6.1 sends one message.
    fn synchronize(&mut self, r: api::SynchronizeRequest, happened: &mut Vec<Happened>) -> api::SynchronizeResponse {
        let (mut pods, mut containers) = self.syncing.take().unwrap_or_default();
        pods.extend(r.pods.iter().map(convert::pod));
        containers.extend(r.containers.iter().map(convert::container));
        if r.more {
            self.syncing = Some((pods, containers));
            return api::SynchronizeResponse { more: true, ..Default::default() };
        }
        self.handler.synchronize(&pods, &containers);
        happened.push(Happened::Synchronized { pods: pods.len(), containers: containers.len() });
        api::SynchronizeResponse::default()
    }
}

fn parts(
    pod: Option<&api::PodSandbox>,
    container: Option<&api::Container>,
) -> (super::view::Pod, super::view::Container) {
    (pod.map(convert::pod).unwrap_or_default(), container.map(convert::container).unwrap_or_default())
}

fn failed(code: i32, message: String) -> wire::Response {
    wire::Response { status: Some(wire::Status { code, message }), payload: Vec::new() }
}

fn decode<M: Message + Default>(bytes: &[u8], what: &'static str) -> Result<M, SessionError> {
    M::decode(bytes).map_err(|source| SessionError::Decode { what, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nri::view::{Adjustment, Container, Mount, Pod};
    use std::sync::Mutex;

    /// Records each call; `create` answers with a /dev mount, or fails for container "bad".
    #[derive(Default)]
    struct Recorder(Mutex<Vec<String>>);

    impl Handler for Recorder {
        fn create(&self, pod: &Pod, c: &Container) -> Result<Adjustment, String> {
            self.0.lock().unwrap().push(format!("create {} {}", pod.id, c.id));
            if c.id == "panic" {
                panic!("boom");
            }
            if c.id == "bad" {
                return Err("no GPUs for bad".into());
            }
            let dev = Mount { destination: "/dev".into(), kind: "bind".into(), source: "/x".into(), options: vec![] };
            Ok(Adjustment { mounts: vec![dev], remove_mounts: vec!["/dev".into()], ..Default::default() })
        }
        fn post_create(&self, _: &Pod, c: &Container) {
            self.0.lock().unwrap().push(format!("created {}", c.id));
        }
        fn started(&self, _: &Pod, c: &Container) {
            self.0.lock().unwrap().push(format!("started {} {}", c.id, c.pid));
        }
        fn stopped(&self, _: &Pod, c: &Container) {
            self.0.lock().unwrap().push(format!("stopped {}", c.id));
        }
        fn removed(&self, _: &Pod, c: &Container) {
            self.0.lock().unwrap().push(format!("removed {}", c.id));
        }
        fn synchronize(&self, pods: &[Pod], containers: &[Container]) {
            self.0.lock().unwrap().push(format!("synchronize {} {}", pods.len(), containers.len()));
        }
    }

    /// containerd's call `method` on the plugin connection, as bytes on the trunk.
    fn call(stream: u32, method: &str, payload: Vec<u8>) -> Vec<u8> {
        let request = wire::Request { service: PLUGIN_SERVICE.into(), method: method.into(), payload, timeout_nano: 0 };
        wire::mux_frames(
            PLUGIN_CONN,
            &wire::message(Header { stream, kind: REQUEST, flags: 0 }, &request.encode_to_vec()),
        )
    }

    /// The plugin's answers in `bytes`, by stream.
    fn answers(bytes: &[u8]) -> Vec<(u32, wire::Response)> {
        let mut demux = Demux::default();
        demux.push(bytes);
        let mut messages = Messages::new(PLUGIN_CONN);
        while let Some((conn, payload)) = demux.next_frame().unwrap() {
            assert_eq!(conn, PLUGIN_CONN);
            messages.push(&payload);
        }
        let mut out = Vec::new();
        while let Some((header, data)) = messages.next_message().unwrap() {
            assert_eq!(header.kind, RESPONSE);
            out.push((header.stream, wire::Response::decode(data.as_slice()).unwrap()));
        }
        out
    }

    fn pod_and(container: &str) -> (Option<api::PodSandbox>, Option<api::Container>) {
        let pod = api::PodSandbox { id: "p1".into(), ..Default::default() };
        let container =
            api::Container { id: container.into(), pod_sandbox_id: "p1".into(), pid: 7, ..Default::default() };
        (Some(pod), Some(container))
    }

    /// Bug (issue 32's note: "NRI v0.10's split Synchronize not read"): a runtime of NRI v0.9 or
    /// later sends a list too large for one message in parts, each but the last with `more`, and
    /// closes a plugin that answers a part without `more`. Each part is answered with `more`
    /// and nothing reaches the handler until the last: then the whole list, once. (Read as
    /// whole lists, the first part would have had every NRI container in the others torn down.)
    #[test]
    fn a_split_synchronize_reaches_the_handler_whole() {
        let recorder = Recorder::default();
        let (mut session, _) = Session::start(&recorder, "devremap", "10");
        let part = |ids: &[&str], more| {
            let listed = ids.iter().map(|id| pod_and(id));
            let (pods, containers): (Vec<_>, Vec<_>) = listed.map(|(p, c)| (p.unwrap(), c.unwrap())).unzip();
            api::SynchronizeRequest { pods, containers, more }.encode_to_vec()
        };
        let trunk = [
            call(1, "Synchronize", part(&["c1", "c2"], true)),
            call(3, "Synchronize", part(&["c3"], true)),
            call(5, "Synchronize", part(&["c4"], false)),
            // A later, whole one (containerd's next registration) starts afresh.
            call(7, "Synchronize", part(&["c5"], false)),
        ]
        .concat();
        let turn = session.feed(&trunk).unwrap();
        assert_eq!(*recorder.0.lock().unwrap(), ["synchronize 4 4", "synchronize 1 1"]);
        assert_eq!(
            turn.happened,
            [Happened::Synchronized { pods: 4, containers: 4 }, Happened::Synchronized { pods: 1, containers: 1 }]
        );
        let more: Vec<bool> = answers(&turn.write)
            .iter()
            .map(|(_, r)| api::SynchronizeResponse::decode(r.payload.as_slice()).unwrap().more)
            .collect();
        assert_eq!(more, [true, true, false, false]);
    }

    /// Rule (issue 32): the event mask is NRI's, bit `1 << (event - 1)`: CreateContainer (4),
    /// PostCreateContainer (5), PostStartContainer (7), StopContainer (10), RemoveContainer
    /// (11), and no pod event.
    #[test]
    fn event_mask_is_nris_encoding() {
        assert_eq!(event_mask(&EVENTS), 1 << 3 | 1 << 4 | 1 << 6 | 1 << 9 | 1 << 10);
    }

    /// Rule (issue 32): the plugin registers on connection 2 (stream 1, `Runtime.RegisterPlugin`
    /// with its name and index); containerd's answer on that connection is `Registered`, a
    /// refusal an error naming containerd's reason.
    #[test]
    fn registers_on_the_runtime_connection() {
        let recorder = Recorder::default();
        let (mut session, bytes) = Session::start(&recorder, "devremap", "10");
        let mut demux = Demux::default();
        demux.push(&bytes);
        let (conn, payload) = demux.next_frame().unwrap().unwrap();
        assert_eq!(conn, RUNTIME_CONN);
        let mut messages = Messages::new(RUNTIME_CONN);
        messages.push(&payload);
        let (header, data) = messages.next_message().unwrap().unwrap();
        assert_eq!(header, Header { stream: 1, kind: REQUEST, flags: 0 });
        let request = wire::Request::decode(data.as_slice()).unwrap();
        assert_eq!((request.service.as_str(), request.method.as_str()), (RUNTIME_SERVICE, "RegisterPlugin"));
        let register = api::RegisterPluginRequest::decode(request.payload.as_slice()).unwrap();
        assert_eq!((register.plugin_name.as_str(), register.plugin_idx.as_str()), ("devremap", "10"));

        let ok = wire::Response { status: None, payload: api::Empty::default().encode_to_vec() };
        let answer = wire::mux_frames(
            RUNTIME_CONN,
            &wire::message(Header { stream: 1, kind: RESPONSE, flags: 0 }, &ok.encode_to_vec()),
        );
        assert_eq!(session.feed(&answer).unwrap().happened, vec![Happened::Registered]);

        let (mut refused, _) = Session::start(&recorder, "devremap", "10");
        let no = wire::Response {
            status: Some(wire::Status { code: 3, message: "invalid plugin index".into() }),
            payload: vec![],
        };
        let answer = wire::mux_frames(
            RUNTIME_CONN,
            &wire::message(Header { stream: 1, kind: RESPONSE, flags: 0 }, &no.encode_to_vec()),
        );
        let err = refused.feed(&answer).unwrap_err();
        assert_eq!(err.to_string(), "containerd refused the registration: invalid plugin index");
    }

    /// Rule (issue 32): containerd's calls, however the socket's reads cut them, reach the
    /// handler in order and are each answered on their own stream: Configure with the event
    /// mask, CreateContainer with the handler's adjustment (a removal mark, then the mount), a
    /// handler's refusal as an error status carrying its message, StateChange's start,
    /// remove and post-create, StopContainer, Synchronize; an unknown method is answered `Unimplemented`.
    #[test]
    fn calls_reach_the_handler_and_are_answered() {
        let recorder = Recorder::default();
        let (mut session, _) = Session::start(&recorder, "devremap", "10");
        let configure = api::ConfigureRequest {
            runtime_name: "containerd".into(),
            runtime_version: "1.7.24".into(),
            config: String::new(),
        };
        let (pod, container) = pod_and("c1");
        let create = api::CreateContainerRequest { pod: pod.clone(), container: container.clone() };
        let (bad_pod, bad) = pod_and("bad");
        let start = api::StateChangeEvent {
            event: Event::PostStartContainer as i32,
            pod: pod.clone(),
            container: container.clone(),
        };
        let stop = api::StopContainerRequest { pod: pod.clone(), container: container.clone() };
        let created = api::StateChangeEvent {
            event: Event::PostCreateContainer as i32,
            pod: pod.clone(),
            container: container.clone(),
        };
        let remove = api::StateChangeEvent {
            event: Event::RemoveContainer as i32,
            pod: pod.clone(),
            container: container.clone(),
        };
        let sync = api::SynchronizeRequest {
            pods: vec![pod.clone().unwrap()],
            containers: vec![container.clone().unwrap()],
            more: false,
        };
        let trunk = [
            call(1, "Configure", configure.encode_to_vec()),
            call(3, "Synchronize", sync.encode_to_vec()),
            call(5, "CreateContainer", create.encode_to_vec()),
            call(7, "CreateContainer", api::CreateContainerRequest { pod: bad_pod, container: bad }.encode_to_vec()),
            call(9, "StateChange", start.encode_to_vec()),
            call(11, "StopContainer", stop.encode_to_vec()),
            call(13, "StateChange", remove.encode_to_vec()),
            call(15, "Frobnicate", vec![]),
            call(17, "StateChange", created.encode_to_vec()),
        ]
        .concat();
        let mut written = Vec::new();
        let mut happened = Vec::new();
        for chunk in trunk.chunks(7) {
            let turn = session.feed(chunk).unwrap();
            written.extend(turn.write);
            happened.extend(turn.happened);
        }
        assert_eq!(
            happened,
            vec![
                Happened::Configured { runtime: "containerd".into(), version: "1.7.24".into() },
                Happened::Synchronized { pods: 1, containers: 1 }
            ]
        );
        assert_eq!(
            *recorder.0.lock().unwrap(),
            [
                "synchronize 1 1",
                "create p1 c1",
                "create p1 bad",
                "started c1 7",
                "stopped c1",
                "removed c1",
                "created c1"
            ]
        );
        let answers = answers(&written);
        assert_eq!(answers.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [1, 3, 5, 7, 9, 11, 13, 15, 17]);
        let configured = api::ConfigureResponse::decode(answers[0].1.payload.as_slice()).unwrap();
        assert_eq!(configured.events, event_mask(&EVENTS));
        let created = api::CreateContainerResponse::decode(answers[2].1.payload.as_slice()).unwrap();
        let destinations: Vec<_> = created.adjust.unwrap().mounts.into_iter().map(|m| m.destination).collect();
        assert_eq!(destinations, ["-/dev", "/dev"]);
        assert_eq!(answers[3].1.status, Some(wire::Status { code: wire::UNKNOWN, message: "no GPUs for bad".into() }));
        assert!(answers[4..7].iter().all(|(_, r)| r.status.is_none()));
        assert_eq!(answers[7].1.status.as_ref().map(|s| s.code), Some(wire::UNIMPLEMENTED));
    }

    /// Rule (issue 32): bytes that are not NRI end the session with an error naming what did
    /// not decode, never a panic.
    #[test]
    fn garbage_is_an_error() {
        let recorder = Recorder::default();
        let (mut session, _) = Session::start(&recorder, "devremap", "10");
        let err = session.feed(&call(1, "CreateContainer", vec![0xff, 0xff, 0xff])).unwrap_err();
        assert!(err.to_string().starts_with("containerd's CreateContainer does not decode"), "{err}");
    }

    /// Rule (issue 32): a handler that panics fails that call alone (an error status naming the
    /// method and the panic, which fails the container's creation) and the session answers
    /// the next call.
    #[test]
    fn a_panicking_handler_fails_its_call_alone() {
        let recorder = Recorder::default();
        let (mut session, _) = Session::start(&recorder, "devremap", "10");
        let (pod, container) = pod_and("panic");
        let (pod1, c1) = pod_and("c1");
        let trunk = [
            call(1, "CreateContainer", api::CreateContainerRequest { pod, container }.encode_to_vec()),
            call(3, "CreateContainer", api::CreateContainerRequest { pod: pod1, container: c1 }.encode_to_vec()),
        ]
        .concat();
        let turn = session.feed(&trunk).unwrap();
        let message = "devremap's NRI handler panicked in CreateContainer (boom)".to_owned();
        assert_eq!(turn.happened, vec![Happened::Panicked(message.clone())]);
        let answers = answers(&turn.write);
        assert_eq!(answers[0].1.status, Some(wire::Status { code: wire::INTERNAL, message }));
        assert_eq!(answers[1].1.status, None);
    }
}
