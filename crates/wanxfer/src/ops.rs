//! `wanxfer ls | stat | mkdir | rm | mv | sum`: remote operations on `wanxfer://` URLs.
//!
//! Each command connects once per server it names and sends its requests on that
//! connection; the first failure ends it with the exit code of its class (a refusal by
//! the server is 8, as for `cp`). Names are shown escaped (control characters and bytes
//! that are not UTF-8 as `\n`, `\xff`), in text and in JSON alike, so a hostile name can
//! neither forge an output line nor break a JSON parser.

use std::collections::HashMap;
use std::path::PathBuf;

use serde_json::{json, Map, Value};
use wanxfer_engine::ops::{hex, Client, RemoteUrl};
use wanxfer_engine::session::ClientConfig;
use wanxfer_engine::Error;
use wanxfer_proto::ops::{ListEntry, Meta, NodeKind, RemoveMode};
use wanxfer_proto::RelPath;

use crate::args::{LsArgs, MkdirArgs, MvArgs, RemoteArgs, RmArgs, StatArgs, SumArgs};

/// Connections by server, opened on first use.
struct Clients<'a> {
    remote: &'a RemoteArgs,
    secret: Vec<u8>,
    credential: Option<wanxfer_engine::session::ClientCredential>,
    open: HashMap<String, Client>,
}

impl<'a> Clients<'a> {
    fn new(remote: &'a RemoteArgs) -> Result<Clients<'a>, Error> {
        let (secret, credential) =
            crate::secret::for_client_with(remote.secret_file.as_deref(), &remote.security)?;
        Ok(Clients {
            remote,
            secret,
            credential,
            open: HashMap::new(),
        })
    }

    fn get(&mut self, server: &str) -> Result<&mut Client, Error> {
        if !self.open.contains_key(server) {
            let mut cfg: ClientConfig = self.remote.config(server, self.secret.clone());
            cfg.credential = self.credential.clone();
            self.open.insert(server.to_string(), Client::connect(&cfg)?);
        }
        Ok(self.open.get_mut(server).expect("inserted above"))
    }
}

/// The `wanxfer://` URL in `arg`; anything else is a usage error.
fn remote(arg: &std::path::Path) -> Result<RemoteUrl, Error> {
    use std::os::unix::ffi::OsStrExt;
    RemoteUrl::parse(arg.as_os_str().as_bytes())?.ok_or_else(|| {
        Error::Usage(format!(
            "{}: not a remote location (wanxfer://HOST:PORT/PATH)",
            arg.display()
        ))
    })
}

fn remotes(args: &[PathBuf]) -> Result<Vec<(String, RemoteUrl)>, Error> {
    args.iter()
        .map(|a| Ok((a.display().to_string(), remote(a)?)))
        .collect()
}

pub fn ls(args: &LsArgs) -> Result<(), Error> {
    let urls = remotes(&args.urls)?;
    let mut clients = Clients::new(&args.remote)?;
    let headers = urls.len() > 1 && !args.remote.json;
    for (i, (shown, url)) in urls.iter().enumerate() {
        if headers {
            println!("{}{shown}:", if i > 0 { "\n" } else { "" });
        }
        let client = clients.get(&url.server)?;
        client.list(&url.path, args.recursive, args.long, |entry| {
            if args.remote.json {
                let mut obj = Map::new();
                if urls.len() > 1 {
                    obj.insert("url".into(), shown.as_str().into());
                }
                obj.insert("path".into(), entry.path.to_string().into());
                obj.insert("kind".into(), entry.kind.name().into());
                if let Some(meta) = &entry.meta {
                    meta_fields(meta, &mut obj);
                }
                println!("{}", Value::Object(obj));
            } else {
                println!("{}", entry_line(&entry));
            }
            Ok(())
        })?;
    }
    Ok(())
}

pub fn stat(args: &StatArgs) -> Result<(), Error> {
    let urls = remotes(&args.urls)?;
    let mut clients = Clients::new(&args.remote)?;
    for (shown, url) in &urls {
        let meta = clients.get(&url.server)?.stat(&url.path)?;
        if args.remote.json {
            let mut obj = Map::new();
            obj.insert("url".into(), shown.as_str().into());
            obj.insert("path".into(), url.path.to_string().into());
            obj.insert("kind".into(), meta.kind.name().into());
            meta_fields(&meta, &mut obj);
            println!("{}", Value::Object(obj));
        } else {
            println!("url: {shown}");
            println!("path: {}", url.path);
            println!("kind: {}", meta.kind.name());
            println!("size: {}", meta.size);
            println!("mode: {:04o}", meta.mode);
            println!("mtime: {}", utc(meta.mtime_sec, Some(meta.mtime_nsec)));
            if meta.kind == NodeKind::Symlink {
                println!("target: {}", escaped(&meta.link_target));
            }
        }
    }
    Ok(())
}

pub fn mkdir(args: &MkdirArgs) -> Result<(), Error> {
    let urls = remotes(&args.urls)?;
    let mut clients = Clients::new(&args.remote)?;
    for (shown, url) in &urls {
        clients
            .get(&url.server)?
            .mkdir(&url.path, args.parents, args.mode)?;
        done(args.remote.json, "mkdir", shown, &url.path);
    }
    Ok(())
}

pub fn rm(args: &RmArgs) -> Result<(), Error> {
    let urls = remotes(&args.urls)?;
    let mut clients = Clients::new(&args.remote)?;
    let mode = match (args.recursive, args.dir) {
        (true, _) => RemoveMode::Recursive,
        (false, true) => RemoveMode::EmptyDir,
        (false, false) => RemoveMode::NotDir,
    };
    for (shown, url) in &urls {
        let client = clients.get(&url.server)?;
        // `rm -d` removes a file as well as an empty directory, as rm(1) does.
        let mode = match mode {
            RemoveMode::EmptyDir if client.stat(&url.path)?.kind != NodeKind::Dir => {
                RemoveMode::NotDir
            }
            mode => mode,
        };
        client.remove(&url.path, mode)?;
        done(args.remote.json, "rm", shown, &url.path);
    }
    Ok(())
}

pub fn mv(args: &MvArgs) -> Result<(), Error> {
    let (from, to) = (remote(&args.source)?, remote(&args.dest)?);
    if from.server != to.server {
        return Err(Error::Usage(
            "mv moves within one server: both URLs must name the same HOST:PORT".into(),
        ));
    }
    let mut clients = Clients::new(&args.remote)?;
    let client = clients.get(&from.server)?;
    // As mv(1): onto an existing directory, the source moves into it.
    let mut dest = to.path.clone();
    if let (Ok(meta), Some((_, name))) = (client.stat(&to.path), from.path.split_last()) {
        if meta.kind == NodeKind::Dir {
            dest = to
                .path
                .join(name)
                .map_err(|e| Error::Usage(format!("{}: {e}", args.dest.display())))?;
        }
    }
    client.rename(&from.path, &dest)?;
    if args.remote.json {
        let out = json!({
            "op": "mv",
            "from": from.path.to_string(),
            "to": dest.to_string(),
            "ok": true,
        });
        println!("{out}");
    }
    Ok(())
}

pub fn sum(args: &SumArgs) -> Result<(), Error> {
    let urls = remotes(&args.urls)?;
    let mut clients = Clients::new(&args.remote)?;
    let algorithm = args.algorithm.algorithm();
    for (shown, url) in &urls {
        let digest = clients.get(&url.server)?.checksum(&url.path, algorithm)?;
        if args.remote.json {
            let out = json!({
                "url": shown,
                "path": url.path.to_string(),
                "algorithm": algorithm.name(),
                "checksum": hex(&digest),
            });
            println!("{out}");
        } else {
            // The layout of sha256sum and xxhsum.
            println!("{}  {shown}", hex(&digest));
        }
    }
    Ok(())
}

fn done(json: bool, op: &str, shown: &str, path: &RelPath) {
    if json {
        let out = json!({ "op": op, "url": shown, "path": path.to_string(), "ok": true });
        println!("{out}");
    }
}

fn meta_fields(meta: &Meta, obj: &mut Map<String, Value>) {
    obj.insert("size".into(), meta.size.into());
    obj.insert("mode".into(), format!("{:04o}", meta.mode).into());
    obj.insert("mtime_sec".into(), meta.mtime_sec.into());
    obj.insert("mtime_nsec".into(), meta.mtime_nsec.into());
    if meta.kind == NodeKind::Symlink {
        obj.insert("link_target".into(), escaped(&meta.link_target).into());
    }
}

/// One `ls` line: the path, or with `-l` what `ls -l` shows of it.
fn entry_line(entry: &ListEntry) -> String {
    let Some(meta) = &entry.meta else {
        return entry.path.to_string();
    };
    let kind = match meta.kind {
        NodeKind::Dir => 'd',
        NodeKind::Symlink => 'l',
        NodeKind::File => '-',
        _ => '?',
    };
    let mut line = format!(
        "{kind}{} {:>14} {} {}",
        permissions(meta.mode),
        meta.size,
        utc(meta.mtime_sec, None),
        entry.path
    );
    if meta.kind == NodeKind::Symlink {
        line.push_str(" -> ");
        line.push_str(&escaped(&meta.link_target));
    }
    line
}

/// `rwxr-x---` with set-id and sticky bits where `ls` puts them.
fn permissions(mode: u32) -> String {
    let bit = |mask: u32, c: char| if mode & mask != 0 { c } else { '-' };
    let exec = |x: u32, special: u32, set: char| match (mode & x != 0, mode & special != 0) {
        (true, true) => set,
        (false, true) => set.to_ascii_uppercase(),
        (true, false) => 'x',
        (false, false) => '-',
    };
    [
        bit(0o400, 'r'),
        bit(0o200, 'w'),
        exec(0o100, 0o4000, 's'),
        bit(0o040, 'r'),
        bit(0o020, 'w'),
        exec(0o010, 0o2000, 's'),
        bit(0o004, 'r'),
        bit(0o002, 'w'),
        exec(0o001, 0o1000, 't'),
    ]
    .iter()
    .collect()
}

/// Bytes as the engine shows names: control characters and invalid UTF-8 escaped.
fn escaped(bytes: &[u8]) -> String {
    wanxfer_proto::Escaped(bytes).to_string()
}

/// `sec` (and `nsec`) since the epoch as UTC, `2024-05-01 12:34:56` (or the ISO 8601
/// form with nanoseconds).
fn utc(sec: i64, nsec: Option<u32>) -> String {
    let days = sec.div_euclid(86_400);
    let secs = sec.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (secs / 3600, secs / 60 % 60, secs % 60);
    match nsec {
        None => format!("{y:04}-{m:02}-{d:02} {hh:02}:{mm:02}:{ss:02}"),
        Some(ns) => format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}.{ns:09}Z"),
    }
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_utc() {
        assert_eq!(utc(0, None), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400, None), "2000-02-29 00:00:00");
        assert_eq!(
            utc(1_700_000_000, Some(5)),
            "2023-11-14T22:13:20.000000005Z"
        );
        assert_eq!(utc(-1, None), "1969-12-31 23:59:59");
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions(0o755), "rwxr-xr-x");
        assert_eq!(permissions(0o4644), "rwSr--r--");
        assert_eq!(permissions(0o1777), "rwxrwxrwt");
    }
}
