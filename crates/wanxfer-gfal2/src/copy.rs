//! `gfalt_copy_file` between a local file and a wanxfer server, through the engine's own
//! client (`run_client`): parallel streams, every piece verified by its XXH3-128 on
//! arrival, and the file renamed into place only once complete, so a failed copy never
//! leaves a partial file under the destination's name.
//!
//! Around the transfer it does what gfal2 asks of a copy plugin, in gfal2's order:
//! source checksum (and comparison with a value the user gave), parent creation, the
//! overwrite check, the transfer with progress for the monitor callbacks, destination
//! checksum and comparison; errors name the side (`SOURCE`, `DESTINATION`, `TRANSFER`)
//! as FTS3 expects. A replaced destination is replaced in one step by the engine rather
//! than removed first.
//!
//! Between two wanxfer servers the copy is third-party: the source server pushes to the
//! destination with a grant the destination made for this one path (see
//! `wanxfer_proto::tpc`), and this process only drives it, turning the source's progress
//! reports into the monitor callbacks; checksums, parents and the overwrite check are
//! done on each server as for a copy with one local side.
//!
//! What it does not do: copy directories (gfal2 copies files), or stop a copy with a
//! local side in flight when gfal2 cancels or its timeout passes (the engine has no
//! cancel hook yet; the stall timeout still ends a copy over a dead path).

use std::ffi::{c_char, c_int, CStr};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wanxfer_engine::ops::{checksum_reader, hex, Client, ReadError, RemoteUrl};
use wanxfer_engine::progress::Progress;
use wanxfer_engine::session::{run_client, ClientJob, PullDest};
use wanxfer_engine::source::Source;
use wanxfer_engine::Error;
use wanxfer_proto::ops::{ChecksumAlgorithm, NodeKind, OpFailure};
use wanxfer_proto::RelPath;

use crate::config::{self, c_string, Context};
use crate::errors::Failure;
use crate::{algorithm, bytes, domain, ffi, guard, is_ours, plugin, Plugin};

const SOURCE: &str = "SOURCE";
const DESTINATION: &str = "DESTINATION";
const TRANSFER: &str = "TRANSFER";

/// How often the monitor callbacks hear of a copy in progress.
const MONITOR_INTERVAL: Duration = Duration::from_secs(1);

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Endpoint {
    Local(PathBuf),
    Remote(RemoteUrl),
}

impl Endpoint {
    fn parse(url: &[u8]) -> Result<Endpoint, Failure> {
        if is_ours(url) {
            return Ok(Endpoint::Remote(crate::remote(url)?));
        }
        local_path(url).map(Endpoint::Local).ok_or_else(|| {
            Failure::new(
                libc::EPROTONOSUPPORT,
                format!(
                    "{}: the wanxfer plugin copies between file:// and wanxfer:// URLs",
                    String::from_utf8_lossy(url)
                ),
            )
        })
    }
}

/// The absolute path of a `file:///path` (or `file:/path`, `file://localhost/path`) URL.
fn local_path(url: &[u8]) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let rest = url.strip_prefix(b"file:")?;
    let path = match rest.strip_prefix(b"//") {
        Some(after) => after.strip_prefix(b"localhost").unwrap_or(after),
        None => rest,
    };
    path.starts_with(b"/")
        .then(|| PathBuf::from(std::ffi::OsStr::from_bytes(path)))
}

fn is_local(url: &[u8]) -> bool {
    local_path(url).is_some()
}

/// Claims copies with a `wanxfer://` side and a `file://` or `wanxfer://` other side (a
/// copy between two servers is a third-party copy). Bulk copies are left to gfal2, which
/// then copies file by file through `copy_file`.
pub(crate) unsafe extern "C" fn check_copy(
    _data: ffi::plugin_handle,
    _context: ffi::gfal2_context_t,
    src: *const c_char,
    dst: *const c_char,
    check: ffi::gfal_url2_check,
) -> c_int {
    if check != ffi::GFAL_FILE_COPY || src.is_null() || dst.is_null() {
        return 0;
    }
    // SAFETY: gfal2 passes NUL-terminated URLs (checked non-NULL above).
    let (src, dst) = unsafe { (bytes(src), bytes(dst)) };
    let side = |u: &[u8]| is_ours(u) || is_local(u);
    c_int::from((is_ours(src) || is_ours(dst)) && side(src) && side(dst))
}

pub(crate) unsafe extern "C" fn copy_file(
    data: ffi::plugin_handle,
    context: ffi::gfal2_context_t,
    params: ffi::gfalt_params_t,
    src: *const c_char,
    dst: *const c_char,
    err: *mut *mut ffi::GError,
) -> c_int {
    guard(err, c"wanxfer_copy_file", -1, || {
        // SAFETY: gfal2 passes our plugin data, live params and NUL-terminated URLs.
        let (plugin, src_url, dst_url) =
            unsafe { (plugin(data), CStr::from_ptr(src), CStr::from_ptr(dst)) };
        let copy = Copy {
            plugin,
            settings: Context(context),
            params,
            src_url,
            dst_url,
        };
        copy.run().map(|()| 0)
    })
}

struct Copy<'a> {
    plugin: &'a Plugin,
    settings: Context,
    params: ffi::gfalt_params_t,
    src_url: &'a CStr,
    dst_url: &'a CStr,
}

/// What gfal2's parameters ask of a copy.
struct Asked {
    strict: bool,
    replace: bool,
    create_parent: bool,
    streams: u16,
    checksum_mode: ffi::gfalt_checksum_mode_t,
    algorithm: Option<ChecksumAlgorithm>,
    user_checksum: String,
}

impl Copy<'_> {
    fn asked(&self) -> Result<Asked, Failure> {
        let mut kind = [0 as c_char; 64];
        let mut value = [0 as c_char; 512];
        // SAFETY: `params` is the live handle gfal2 passed; the buffers are as long as
        // said and gfal2 writes NUL-terminated strings into them; a NULL error pointer is
        // accepted by these getters.
        let (strict, replace, create_parent, streams, mode) = unsafe {
            let mode = ffi::gfalt_get_checksum(
                self.params,
                kind.as_mut_ptr(),
                kind.len(),
                value.as_mut_ptr(),
                value.len(),
                std::ptr::null_mut(),
            );
            (
                ffi::gfalt_get_strict_copy_mode(self.params, std::ptr::null_mut()) != 0,
                ffi::gfalt_get_replace_existing_file(self.params, std::ptr::null_mut()) != 0,
                ffi::gfalt_get_create_parent_dir(self.params, std::ptr::null_mut()) != 0,
                ffi::gfalt_get_nbstreams(self.params, std::ptr::null_mut()),
                mode,
            )
        };
        // SAFETY: both buffers were zeroed and gfal2 NUL-terminates what it writes.
        let (kind, value) = unsafe {
            (
                CStr::from_ptr(kind.as_ptr()).to_bytes().to_vec(),
                CStr::from_ptr(value.as_ptr())
                    .to_string_lossy()
                    .trim()
                    .to_string(),
            )
        };
        let mode = if strict {
            ffi::GFALT_CHECKSUM_NONE
        } else {
            mode
        };
        let algorithm = if mode == ffi::GFALT_CHECKSUM_NONE {
            None
        } else if kind.is_empty() {
            // gfal2's own default for copies.
            Some(ChecksumAlgorithm::Adler32)
        } else {
            Some(algorithm(&kind).map_err(|f| f.on(TRANSFER, Some("CHECKSUM")))?)
        };
        Ok(Asked {
            strict,
            replace,
            create_parent,
            streams: u16::try_from(streams).unwrap_or(u16::MAX),
            checksum_mode: mode,
            algorithm,
            user_checksum: value,
        })
    }

    fn run(&self) -> Result<(), Failure> {
        let src = Endpoint::parse(self.src_url.to_bytes())?;
        let dst = Endpoint::parse(self.dst_url.to_bytes())?;
        let asked = self.asked()?;
        let (local, url, push) = match (src, dst) {
            (Endpoint::Local(local), Endpoint::Remote(url)) => (local, url, true),
            (Endpoint::Remote(url), Endpoint::Local(local)) => (local, url, false),
            (Endpoint::Remote(from), Endpoint::Remote(to)) => {
                return self.third_party(&from, &to, &asked)
            }
            (Endpoint::Local(_), Endpoint::Local(_)) => {
                return Err(Failure::new(libc::EPROTONOSUPPORT, "no wanxfer:// side"))
            }
        };
        let cfg = config::client_config(&self.settings, &url.server, Some(asked.streams))
            .map_err(|f| f.on(TRANSFER, None))?;
        let mut ops = Client::connect(&cfg).map_err(|e| Failure::from(e).on(TRANSFER, None))?;
        let local = if push {
            local_source(&local)?
        } else {
            remote_source(&mut ops, &url.path)?;
            local
        };

        let mut source_sum = None;
        if let (Some(algorithm), true) = (
            asked.algorithm,
            asked.checksum_mode & ffi::GFALT_CHECKSUM_SOURCE != 0,
        ) {
            self.event(ffi::GFAL_EVENT_SOURCE, stage(Stage::ChecksumEnter), "");
            let sum = if push {
                local_checksum(&local, algorithm).map_err(|f| f.on(SOURCE, Some("CHECKSUM")))?
            } else {
                remote_checksum(&mut ops, &url.path, algorithm, SOURCE)?
            };
            self.event(ffi::GFAL_EVENT_SOURCE, stage(Stage::ChecksumExit), &sum);
            if !asked.user_checksum.is_empty()
                && !same_checksum(algorithm, &sum, &asked.user_checksum)
            {
                return Err(Failure::new(
                    libc::EIO,
                    format!(
                        "source checksum and user-specified checksum do not match: {sum} != {}",
                        asked.user_checksum
                    ),
                )
                .on(SOURCE, Some("CHECKSUM MISMATCH")));
            }
            source_sum = Some(sum);
        }

        if !asked.strict {
            if push {
                self.prepare_remote_destination(&mut ops, &url.path, &asked)?;
            } else {
                self.prepare_local_destination(&local, &asked)?;
            }
        }

        self.transfer(&cfg, &local, &url, push)?;

        if let (Some(algorithm), true) = (
            asked.algorithm,
            asked.checksum_mode & ffi::GFALT_CHECKSUM_TARGET != 0,
        ) {
            self.event(ffi::GFAL_EVENT_DESTINATION, stage(Stage::ChecksumEnter), "");
            let sum = if push {
                remote_checksum(&mut ops, &url.path, algorithm, DESTINATION)?
            } else {
                local_checksum(&local, algorithm)
                    .map_err(|f| f.on(DESTINATION, Some("CHECKSUM")))?
            };
            self.event(
                ffi::GFAL_EVENT_DESTINATION,
                stage(Stage::ChecksumExit),
                &sum,
            );
            let (against, which) = if asked.user_checksum.is_empty() {
                (source_sum.clone().unwrap_or_default(), "source")
            } else {
                (asked.user_checksum.clone(), "user-specified")
            };
            if !against.is_empty() && !same_checksum(algorithm, &sum, &against) {
                return Err(Failure::new(
                    libc::EIO,
                    format!("{which} checksum and destination checksum do not match: {against} != {sum}"),
                )
                .on(DESTINATION, Some("CHECKSUM MISMATCH")));
            }
        }
        self.plugin.keep(ops);
        Ok(())
    }

    /// A copy between two wanxfer servers: checksums and the destination's preparation
    /// on each server, the data from one to the other.
    fn third_party(&self, from: &RemoteUrl, to: &RemoteUrl, asked: &Asked) -> Result<(), Failure> {
        let connect = |server: &str| {
            config::client_config(&self.settings, server, Some(asked.streams))
                .and_then(|cfg| Client::connect(&cfg).map_err(Failure::from))
                .map_err(|f| f.on(TRANSFER, None))
        };
        let mut source = connect(&from.server)?;
        let mut dest = connect(&to.server)?;
        remote_source(&mut source, &from.path)?;
        let mut source_sum = None;
        if let (Some(algorithm), true) = (
            asked.algorithm,
            asked.checksum_mode & ffi::GFALT_CHECKSUM_SOURCE != 0,
        ) {
            self.event(ffi::GFAL_EVENT_SOURCE, stage(Stage::ChecksumEnter), "");
            let sum = remote_checksum(&mut source, &from.path, algorithm, SOURCE)?;
            self.event(ffi::GFAL_EVENT_SOURCE, stage(Stage::ChecksumExit), &sum);
            if !asked.user_checksum.is_empty()
                && !same_checksum(algorithm, &sum, &asked.user_checksum)
            {
                return Err(Failure::new(
                    libc::EIO,
                    format!(
                        "source checksum and user-specified checksum do not match: {sum} != {}",
                        asked.user_checksum
                    ),
                )
                .on(SOURCE, Some("CHECKSUM MISMATCH")));
            }
            source_sum = Some(sum);
        }
        if !asked.strict {
            self.prepare_remote_destination(&mut dest, &to.path, asked)?;
        }
        self.push_between(&mut source, &mut dest, from, to, asked)?;
        if let (Some(algorithm), true) = (
            asked.algorithm,
            asked.checksum_mode & ffi::GFALT_CHECKSUM_TARGET != 0,
        ) {
            self.event(ffi::GFAL_EVENT_DESTINATION, stage(Stage::ChecksumEnter), "");
            let sum = remote_checksum(&mut dest, &to.path, algorithm, DESTINATION)?;
            self.event(
                ffi::GFAL_EVENT_DESTINATION,
                stage(Stage::ChecksumExit),
                &sum,
            );
            let (against, which) = if asked.user_checksum.is_empty() {
                (source_sum.unwrap_or_default(), "source")
            } else {
                (asked.user_checksum.clone(), "user-specified")
            };
            if !against.is_empty() && !same_checksum(algorithm, &sum, &against) {
                return Err(Failure::new(
                    libc::EIO,
                    format!("{which} checksum and destination checksum do not match: {against} != {sum}"),
                )
                .on(DESTINATION, Some("CHECKSUM MISMATCH")));
            }
        }
        self.plugin.keep(source);
        self.plugin.keep(dest);
        Ok(())
    }

    /// The transfer of a third-party copy: a grant from the destination, the push by the
    /// source, its progress reports to the monitor callbacks.
    fn push_between(
        &self,
        source: &mut Client,
        dest: &mut Client,
        from: &RemoteUrl,
        to: &RemoteUrl,
        asked: &Asked,
    ) -> Result<(), Failure> {
        let transfer = |e: Error| Failure::from(e).on(TRANSFER, None);
        let fingerprint = dest.fingerprint().map(parse_fingerprint).ok_or_else(|| {
            Failure::new(
                libc::EPROTONOSUPPORT,
                "a third-party copy needs TLS to the destination (NO_ENCRYPTION is set)",
            )
            .on(TRANSFER, None)
        })??;
        let grant = dest
            .grant(&to.path, wanxfer_proto::tpc::MAX_GRANT_TTL_S, 0)
            .map_err(transfer)?;
        let desc = format!(
            "{} => {}",
            self.src_url.to_string_lossy(),
            self.dst_url.to_string_lossy()
        );
        self.event(ffi::GFAL_EVENT_NONE, stage(Stage::TransferEnter), &desc);
        self.event(ffi::GFAL_EVENT_NONE, stage(Stage::TransferType), "3rd push");
        let defaults = wanxfer_engine::session::Tuning::default();
        let request = wanxfer_proto::tpc::PushTo {
            sources: vec![from.path.clone()],
            server: to.server.clone().into_bytes(),
            fingerprint,
            dest: to.path.clone(),
            into: false,
            grant,
            streams: if asked.streams > 0 {
                asked.streams
            } else {
                defaults.streams
            },
            block_size: defaults.block_size,
            depth: defaults.depth,
            // gfal2 decides about an existing destination itself (overwrite): send it.
            compare: wanxfer_proto::Compare::Always,
            flags: 0,
            // gfal2's copy parameters name no owners or attributes to keep.
            preserve: 0,
            // A gfal2 copy is of one URL, whole.
            selection: wanxfer_proto::Selection::default(),
        };
        let progress = Progress::default();
        let started = Instant::now();
        let mut last = (started, 0u64);
        let summary = source
            .push_to(request, |p| {
                progress.bytes.store(p.bytes, Ordering::Relaxed);
                last = self.monitor(&progress, started, last);
                Ok(())
            })
            .map_err(transfer)?;
        progress.bytes.store(summary.bytes, Ordering::Relaxed);
        self.monitor(&progress, started, last);
        if let Some((class, message)) = &summary.error {
            let e = Error::remote(
                &from.server,
                &wanxfer_proto::ErrorMsg::new(*class, &String::from_utf8_lossy(message)),
            );
            return Err(transfer(e));
        }
        if let Some((_, message)) = summary.failures.first() {
            return Err(
                Failure::new(libc::EIO, String::from_utf8_lossy(message)).on(TRANSFER, None)
            );
        }
        self.event(ffi::GFAL_EVENT_NONE, stage(Stage::TransferExit), &desc);
        Ok(())
    }

    fn prepare_remote_destination(
        &self,
        ops: &mut Client,
        path: &RelPath,
        asked: &Asked,
    ) -> Result<(), Failure> {
        let dest = |e: Error| Failure::from(e).on(DESTINATION, None);
        if let Some((parent, _)) = path.split_last() {
            if asked.create_parent {
                ops.mkdir(&parent, true, 0o755)
                    .map_err(|e| Failure::from(e).on(DESTINATION, Some("MAKE_PARENT")))?;
            } else {
                // Said here as ENOENT, which gfal2 callers act on (FTS3 retries with
                // create_parent), rather than as the session's refusal later.
                let (errno, why) = match ops.stat(&parent).map_err(dest)?.kind {
                    NodeKind::Dir => (0, ""),
                    // The server never writes through it; say so as it would.
                    NodeKind::Symlink => (libc::EACCES, "is a symlink, never followed"),
                    _ => (libc::ENOTDIR, "is not a directory"),
                };
                if errno != 0 {
                    return Err(Failure::new(
                        errno,
                        format!("{parent}: the destination's parent {why}"),
                    )
                    .on(DESTINATION, None));
                }
            }
        }
        match ops.stat(path) {
            Ok(meta) => self.existing(meta.kind == NodeKind::Dir, asked),
            Err(Error::Op {
                failure: OpFailure::NotFound,
                ..
            }) => Ok(()),
            Err(e) => Err(dest(e)),
        }
    }

    fn prepare_local_destination(&self, path: &Path, asked: &Asked) -> Result<(), Failure> {
        let dest = |e: std::io::Error, what: &str| {
            Failure::new(
                e.raw_os_error().unwrap_or(libc::EIO),
                format!("{what} {}: {e}", path.display()),
            )
            .on(DESTINATION, None)
        };
        if asked.create_parent {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| dest(e, "create parent of"))?;
            }
        }
        match std::fs::symlink_metadata(path) {
            Ok(meta) => self.existing(meta.is_dir(), asked),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(dest(e, "stat")),
        }
    }

    /// What to do about a destination that exists.
    fn existing(&self, is_dir: bool, asked: &Asked) -> Result<(), Failure> {
        if is_dir {
            return Err(
                Failure::new(libc::EISDIR, "the destination is a directory").on(DESTINATION, None)
            );
        }
        if !asked.replace {
            return Err(
                Failure::new(libc::EEXIST, "the file exists and overwrite is not set")
                    .on(DESTINATION, Some("EXISTS")),
            );
        }
        self.event(
            ffi::GFAL_EVENT_DESTINATION,
            stage(Stage::Overwrite),
            "replaced in one step once the new file is complete and verified",
        );
        Ok(())
    }

    /// Runs the engine's client on a thread of its own while this (gfal2's) thread
    /// reports progress to the monitor callbacks.
    fn transfer(
        &self,
        cfg: &wanxfer_engine::session::ClientConfig,
        local: &Path,
        url: &RemoteUrl,
        push: bool,
    ) -> Result<(), Failure> {
        let desc = format!(
            "{} => {}",
            self.src_url.to_string_lossy(),
            self.dst_url.to_string_lossy()
        );
        self.event(ffi::GFAL_EVENT_NONE, stage(Stage::TransferEnter), &desc);
        self.event(
            ffi::GFAL_EVENT_NONE,
            stage(Stage::TransferType),
            if push { "push" } else { "pull" },
        );
        let job = if push {
            let source = Source::local(&[local.to_path_buf()])
                .map_err(|e| Failure::from(e).on(SOURCE, None))?;
            ClientJob::Push {
                source,
                dest: url.path.clone(),
                into: false,
            }
        } else {
            ClientJob::Pull {
                sources: vec![url.path.clone()],
                synthetic_bytes: None,
                dest: PullDest::Local {
                    path: local.to_path_buf(),
                    into: false,
                },
            }
        };
        let progress = Arc::new(Progress::default());
        let cfg = cfg.clone();
        let worker = {
            let progress = progress.clone();
            std::thread::Builder::new()
                .name("wanxfer-gfal2-copy".into())
                .spawn(move || {
                    block_sigpipe();
                    run_client(&cfg, job, progress)
                })
                .map_err(|e| Failure::new(libc::EAGAIN, format!("cannot start a thread: {e}")))?
        };
        let started = Instant::now();
        let mut last = (started, 0u64);
        while !worker.is_finished() {
            std::thread::sleep(Duration::from_millis(50));
            if last.0.elapsed() >= MONITOR_INTERVAL {
                last = self.monitor(&progress, started, last);
            }
        }
        let result = worker
            .join()
            .map_err(|_| Failure::new(libc::EIO, "the copy thread panicked (a bug)"))?;
        self.monitor(&progress, started, last);
        result.map_err(|failed| Failure::from(failed.error).on(TRANSFER, None))?;
        self.event(ffi::GFAL_EVENT_NONE, stage(Stage::TransferExit), &desc);
        Ok(())
    }

    /// Tells the monitor callbacks how far the copy is; returns the new reference point
    /// for the instant rate.
    fn monitor(
        &self,
        progress: &Progress,
        started: Instant,
        last: (Instant, u64),
    ) -> (Instant, u64) {
        let now = Instant::now();
        let bytes = progress.bytes.load(Ordering::Relaxed);
        let total = started.elapsed().as_secs_f64().max(1e-3);
        let since = now.duration_since(last.0).as_secs_f64().max(1e-3);
        let mut status = ffi::_gfalt_transfer_status {
            plugin_transfer_data: std::ptr::null_mut(),
            status: 0,
            average_baudrate: (bytes as f64 / total) as usize,
            instant_baudrate: (bytes.saturating_sub(last.1) as f64 / since) as usize,
            transfer_time: started.elapsed().as_secs() as libc::time_t,
            bytes_transfered: usize::try_from(bytes).unwrap_or(usize::MAX),
        };
        // SAFETY: `params` is live; `status` and both URLs outlive the call, which passes
        // them to the callbacks the caller registered.
        unsafe {
            ffi::plugin_trigger_monitor(
                self.params,
                &mut status,
                self.src_url.as_ptr(),
                self.dst_url.as_ptr(),
            );
        }
        (now, bytes)
    }

    fn event(&self, side: ffi::gfal_event_side_t, stage: ffi::GQuark, text: &str) {
        let text = c_string(text);
        // SAFETY: `params` is live; the format takes exactly the one NUL-terminated
        // string given.
        unsafe {
            ffi::plugin_trigger_event(
                self.params,
                domain(),
                side,
                stage,
                c"%s".as_ptr(),
                text.as_ptr(),
            );
        }
    }
}

#[derive(Clone, Copy)]
enum Stage {
    ChecksumEnter,
    ChecksumExit,
    Overwrite,
    TransferEnter,
    TransferType,
    TransferExit,
}

/// gfal2's quark for `stage` (set when libgfal_transfer is loaded, before any plugin).
fn stage(stage: Stage) -> ffi::GQuark {
    // SAFETY: these are GQuark globals gfal2 initialises at load and never changes.
    unsafe {
        match stage {
            Stage::ChecksumEnter => ffi::GFAL_EVENT_CHECKSUM_ENTER,
            Stage::ChecksumExit => ffi::GFAL_EVENT_CHECKSUM_EXIT,
            Stage::Overwrite => ffi::GFAL_EVENT_OVERWRITE_DESTINATION,
            Stage::TransferEnter => ffi::GFAL_EVENT_TRANSFER_ENTER,
            Stage::TransferType => ffi::GFAL_EVENT_TRANSFER_TYPE,
            Stage::TransferExit => ffi::GFAL_EVENT_TRANSFER_EXIT,
        }
    }
}

/// `SHA256:hex`, as the engine prints a certificate's fingerprint, as its 32 bytes.
fn parse_fingerprint(text: &str) -> Result<[u8; 32], Failure> {
    let bad = || Failure::new(libc::EPROTO, format!("not a SHA256 fingerprint: {text:?}"));
    let hex = text
        .strip_prefix("SHA256:")
        .filter(|h| h.len() == 64)
        .ok_or_else(bad)?;
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// The local source, which must be a regular file; a symlink is copied as the file it
/// names, as gfal2's file plugin reads it.
fn local_source(path: &Path) -> Result<PathBuf, Failure> {
    let fail = |e: std::io::Error| {
        Failure::new(
            e.raw_os_error().unwrap_or(libc::EIO),
            format!("{}: {e}", path.display()),
        )
        .on(SOURCE, None)
    };
    let real = std::fs::canonicalize(path).map_err(fail)?;
    let meta = std::fs::metadata(&real).map_err(fail)?;
    if meta.is_dir() {
        return Err(
            Failure::new(libc::EISDIR, format!("{}: is a directory", path.display()))
                .on(SOURCE, None),
        );
    }
    if !meta.is_file() {
        return Err(Failure::new(
            libc::EINVAL,
            format!("{}: not a regular file", path.display()),
        )
        .on(SOURCE, None));
    }
    Ok(real)
}

/// Checks the remote source is a regular file.
fn remote_source(ops: &mut Client, path: &RelPath) -> Result<(), Failure> {
    let meta = ops
        .stat(path)
        .map_err(|e| Failure::from(e).on(SOURCE, None))?;
    match meta.kind {
        NodeKind::File => Ok(()),
        NodeKind::Dir => {
            Err(Failure::new(libc::EISDIR, format!("{path}: is a directory")).on(SOURCE, None))
        }
        _ => {
            Err(Failure::new(libc::EINVAL, format!("{path}: not a regular file")).on(SOURCE, None))
        }
    }
}

fn remote_checksum(
    ops: &mut Client,
    path: &RelPath,
    algorithm: ChecksumAlgorithm,
    side: &'static str,
) -> Result<String, Failure> {
    ops.checksum(path, algorithm)
        .map(|d| hex(&d))
        .map_err(|e| Failure::from(e).on(side, Some("CHECKSUM")))
}

/// The checksum of a local file, computed as the server computes its own.
pub fn local_checksum(path: &Path, algorithm: ChecksumAlgorithm) -> Result<String, Failure> {
    let io = |e: std::io::Error| {
        Failure::new(
            e.raw_os_error().unwrap_or(libc::EIO),
            format!("checksum {}: {e}", path.display()),
        )
    };
    let file = std::fs::File::open(path).map_err(io)?;
    match checksum_reader(file, algorithm, &mut |_| Ok(())) {
        Ok(digest) => Ok(hex(&digest)),
        Err(ReadError::Io(e)) => Err(io(e)),
        Err(ReadError::Stopped(e)) => Err(e.into()),
    }
}

/// Whether two printed checksums are the same value: case aside, and for the 32-bit sums
/// leading zeros aside (some catalogues drop them from Adler-32).
pub fn same_checksum(algorithm: ChecksumAlgorithm, a: &str, b: &str) -> bool {
    let number = |s: &str| {
        let s = s.trim();
        u32::from_str_radix(s.strip_prefix("0x").unwrap_or(s), 16).ok()
    };
    match algorithm {
        ChecksumAlgorithm::Adler32 | ChecksumAlgorithm::Crc32c => {
            matches!((number(a), number(b)), (Some(x), Some(y)) if x == y)
        }
        _ => a.trim().eq_ignore_ascii_case(b.trim()),
    }
}

/// Keeps SIGPIPE from this thread and the engine's threads it starts (they inherit the
/// mask): gfal2 runs inside programs (FTS3's url-copy) that do not ignore it, and a
/// `writev` or `sendfile` to a peer that went away raises it. The engine then sees
/// `EPIPE`, which it reports as a lost connection.
fn block_sigpipe() {
    // SAFETY: the set is initialised by sigemptyset before use, and pthread_sigmask
    // changes only the calling thread's mask (this copy thread's).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_urls_are_absolute_file_urls() {
        assert_eq!(local_path(b"file:///tmp/x"), Some(PathBuf::from("/tmp/x")));
        assert_eq!(local_path(b"file:/tmp/x"), Some(PathBuf::from("/tmp/x")));
        assert_eq!(
            local_path(b"file://localhost/tmp/x"),
            Some(PathBuf::from("/tmp/x"))
        );
        assert_eq!(local_path(b"file://tmp/x"), None);
        assert_eq!(local_path(b"/tmp/x"), None);
        assert_eq!(local_path(b"gsiftp://h/x"), None);
    }

    #[test]
    fn checksums_compare_as_values() {
        assert!(same_checksum(
            ChecksumAlgorithm::Adler32,
            "0001e2f3",
            "1E2F3"
        ));
        assert!(!same_checksum(
            ChecksumAlgorithm::Adler32,
            "0001e2f3",
            "1e2f4"
        ));
        assert!(same_checksum(ChecksumAlgorithm::Md5, "ABCDEF", "abcdef"));
        assert!(!same_checksum(ChecksumAlgorithm::Adler32, "zz", "zz"));
    }
}
