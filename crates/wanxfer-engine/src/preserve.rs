//! `cp --preserve`: owner, group, `user.*` extended attributes, POSIX ACLs and holes,
//! read by the sender as it walks and applied by the receiver before a file's mode and mtime (a
//! `chown` clears set-id bits, and setting an ACL rewrites the group bits of the mode,
//! so both come first and the mode last).
//!
//! What cannot be kept where the destination is is not a failure: the file lands, and
//! the user is told once per kind of shortfall ([`Notes`]: not running as root, a file
//! system without extended attributes), not once per file. ACLs travel as their
//! `system.posix_acl_*` attributes, which the kernel checks as it would a `setfacl`.
//! `trusted.*` and `security.*` attributes never travel (see
//! `wanxfer_proto::check_xattr_name`): a transfer must not grant file capabilities or
//! choose security labels, as it never sets setuid bits.
//!
//! Holes are found with `SEEK_DATA`/`SEEK_HOLE` as the walker lists a file, so that the
//! manifest says which ranges are data before anything is read: the sender then plans
//! those ranges only (as it plans what is left after a resume), and the receiver counts
//! the holes as received and sizes its temporary with `ftruncate`, writing nothing
//! there. Each segment that does travel keeps its digest, and the holes read as the
//! zeros the source had, so verification is as for a dense file. A file with more
//! ranges than a manifest entry may list travels dense, with a note.
//!
//! This module does not decide what a session preserves: that is the request's
//! `PRESERVE_*` flags, cleared by a receiving server that cannot keep owners.

use std::collections::HashSet;
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Mutex;

use rustix::fs::XattrFlags;
use rustix::io::Errno;
use wanxfer_proto::{
    session_flags, EntryMeta, ACL_XATTRS, MAX_DATA_RANGES_PER_ENTRY, MAX_XATTRS_PER_ENTRY,
    MAX_XATTR_BYTES_PER_ENTRY, MAX_XATTR_VALUE_BYTES,
};

use crate::fs::{Kind, Meta};

/// What a session keeps beyond mode and mtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Preserve {
    pub owner: bool,
    pub group: bool,
    pub xattrs: bool,
    pub acls: bool,
    pub sparse: bool,
    pub hardlinks: bool,
}

impl Preserve {
    /// Everything there is to keep (`-a`); a receiver keeps what it may of it.
    pub const ALL: Preserve = Preserve {
        owner: true,
        group: true,
        xattrs: true,
        acls: true,
        sparse: true,
        hardlinks: true,
    };

    /// The items of a request's or an answer's session flags.
    pub fn from_flags(flags: u32) -> Preserve {
        Preserve {
            owner: flags & session_flags::PRESERVE_OWNER != 0,
            group: flags & session_flags::PRESERVE_GROUP != 0,
            xattrs: flags & session_flags::PRESERVE_XATTRS != 0,
            acls: flags & session_flags::PRESERVE_ACLS != 0,
            sparse: flags & session_flags::PRESERVE_SPARSE != 0,
            hardlinks: flags & session_flags::PRESERVE_HARDLINKS != 0,
        }
    }

    pub fn flags(self) -> u32 {
        let mut flags = 0;
        for (on, flag) in [
            (self.owner, session_flags::PRESERVE_OWNER),
            (self.group, session_flags::PRESERVE_GROUP),
            (self.xattrs, session_flags::PRESERVE_XATTRS),
            (self.acls, session_flags::PRESERVE_ACLS),
            (self.sparse, session_flags::PRESERVE_SPARSE),
            (self.hardlinks, session_flags::PRESERVE_HARDLINKS),
        ] {
            if on {
                flags |= flag;
            }
        }
        flags
    }

    pub fn is_empty(self) -> bool {
        self == Preserve::default()
    }

    /// Whether attributes are read and written at all.
    pub fn attributes(self) -> bool {
        self.xattrs || self.acls
    }

    /// Whether attribute `name` is one this session keeps.
    pub fn keeps(self, name: &[u8]) -> bool {
        if ACL_XATTRS.contains(&name) {
            self.acls
        } else {
            self.xattrs && name.len() > b"user.".len() && name.starts_with(b"user.")
        }
    }

    /// The items as `--preserve` names them.
    pub fn names(self) -> Vec<&'static str> {
        [
            (self.owner, "owner"),
            (self.group, "group"),
            (self.xattrs, "xattrs"),
            (self.acls, "acls"),
            (self.sparse, "sparse"),
            (self.hardlinks, "hardlinks"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }
}

/// Whether this process may give files away (`chown` to any owner and group).
pub fn may_chown() -> bool {
    rustix::process::geteuid().is_root()
}

/// Most distinct notes a side keeps for one session.
pub const MAX_NOTES: usize = wanxfer_session::MAX_NOTES;

/// What a receiving side could not keep, once per kind (the first file named).
#[derive(Debug, Default)]
pub struct Notes {
    inner: Mutex<NotesInner>,
}

#[derive(Debug, Default)]
struct NotesInner {
    seen: HashSet<String>,
    new: Vec<String>,
}

impl Notes {
    /// Adds the note `text` makes, unless one of kind `key` was made already.
    pub fn add(&self, key: String, text: impl FnOnce() -> String) {
        let mut inner = self.inner.lock().expect("no panics while held");
        if inner.seen.len() < MAX_NOTES && inner.seen.insert(key) {
            let text = text();
            inner.new.push(text);
        }
    }

    /// The notes made since the last call.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.inner.lock().expect("no panics while held").new)
    }
}

/// What `preserve` asks of an entry with `meta`: its owner and group from the stat, its
/// attributes read through `fd` (an open file or directory; `None` for a symlink, whose
/// attributes are not kept), and a file's data ranges. Attributes past the protocol's
/// limits are left out, and so is everything of an attribute that changed while it was
/// read; `left_out` says so, as it says a file with too many data ranges travels dense.
pub fn read(
    fd: Option<BorrowedFd<'_>>,
    meta: &Meta,
    preserve: Preserve,
    left_out: &mut Option<String>,
) -> Option<Box<EntryMeta>> {
    let mut out = EntryMeta {
        uid: preserve.owner.then_some(meta.uid),
        gid: preserve.group.then_some(meta.gid),
        xattrs: Vec::new(),
        data: None,
        link: None,
        linkable: false,
    };
    if let (Some(fd), true, Kind::File) = (fd, preserve.sparse, meta.kind) {
        match data_ranges(fd, meta.size) {
            Ok(Ranges::Sparse(data)) => out.data = Some(data),
            Ok(Ranges::Dense) => {}
            Ok(Ranges::TooMany) => {
                *left_out = Some(format!(
                    "more than {MAX_DATA_RANGES_PER_ENTRY} data ranges, so it travels dense"
                ))
            }
            Err(e) => *left_out = Some(format!("its holes could not be found: {e}")),
        }
    }
    if let (Some(fd), true) = (fd, preserve.attributes()) {
        match read_xattrs(fd, preserve) {
            Ok((xattrs, None)) => out.xattrs = xattrs,
            Ok((xattrs, Some(why))) => {
                out.xattrs = xattrs;
                *left_out = Some(why);
            }
            Err(e) => *left_out = Some(format!("its extended attributes could not be read: {e}")),
        }
    }
    let empty =
        out.uid.is_none() && out.gid.is_none() && out.xattrs.is_empty() && out.data.is_none();
    (!empty).then(|| Box::new(out))
}

/// A file's layout as `SEEK_DATA`/`SEEK_HOLE` see it.
#[derive(Debug, PartialEq, Eq)]
pub enum Ranges {
    /// No holes (or a file system that does not say): sent as today.
    Dense,
    /// These data ranges, `[start, end)`, and holes elsewhere.
    Sparse(Vec<(u64, u64)>),
    /// More than [`MAX_DATA_RANGES_PER_ENTRY`] ranges.
    TooMany,
}

/// The data ranges of the open file `fd` of `size` bytes. A file system without
/// `SEEK_DATA` reports the whole file as data, which is [`Ranges::Dense`].
pub fn data_ranges(fd: BorrowedFd<'_>, size: u64) -> io::Result<Ranges> {
    use rustix::fs::{seek, SeekFrom};
    let mut out = Vec::new();
    let mut at = 0u64;
    while at < size {
        let start = match seek(fd, SeekFrom::Data(at)) {
            Ok(start) => start,
            // No data at or past `at`: the rest is a hole.
            Err(Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        if start >= size {
            break;
        }
        let end = match seek(fd, SeekFrom::Hole(start)) {
            Ok(end) => end.min(size),
            Err(Errno::NXIO) => size,
            Err(e) => return Err(e.into()),
        };
        if end <= start {
            break; // shrunk meanwhile
        }
        if out.len() == MAX_DATA_RANGES_PER_ENTRY {
            return Ok(Ranges::TooMany);
        }
        out.push((start, end));
        at = end;
    }
    Ok(if out == [(0, size)] {
        Ranges::Dense
    } else {
        Ranges::Sparse(out)
    })
}

/// The names of the attributes on `fd`, or none where the file system has none.
fn list_xattrs(fd: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    let mut buf = vec![0u8; 4096];
    let len = loop {
        match rustix::fs::flistxattr(fd, &mut buf[..]) {
            Ok(len) => break len,
            Err(Errno::RANGE) if buf.len() < (1 << 20) => {
                let need = rustix::fs::flistxattr_query(fd)?;
                buf.resize(need.clamp(buf.len() * 2, 1 << 20), 0);
            }
            Err(Errno::NOTSUP) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        }
    };
    Ok(buf[..len]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(<[u8]>::to_vec)
        .collect())
}

/// The attributes on `fd` this session keeps, in name order, within the protocol's
/// limits; the reason any were left out.
type ReadXattrs = (Vec<(Vec<u8>, Vec<u8>)>, Option<String>);

fn read_xattrs(fd: BorrowedFd<'_>, preserve: Preserve) -> io::Result<ReadXattrs> {
    let mut names = list_xattrs(fd)?;
    names.retain(|n| preserve.keeps(n));
    names.sort();
    let mut out = Vec::new();
    let mut total = 0usize;
    let mut value = vec![0u8; MAX_XATTR_VALUE_BYTES];
    for name in names {
        let len = match rustix::fs::fgetxattr(fd, &name[..], &mut value[..]) {
            Ok(len) => len,
            // Removed since it was listed.
            Err(Errno::NODATA) => continue,
            Err(Errno::RANGE) => {
                let why = format!(
                    "extended attribute {} is larger than {MAX_XATTR_VALUE_BYTES} bytes",
                    String::from_utf8_lossy(&name)
                );
                return Ok((out, Some(why)));
            }
            Err(e) => return Err(e.into()),
        };
        total += name.len() + len;
        if out.len() == MAX_XATTRS_PER_ENTRY || total > MAX_XATTR_BYTES_PER_ENTRY {
            let why = format!(
                "more than {MAX_XATTRS_PER_ENTRY} extended attributes or \
                 {MAX_XATTR_BYTES_PER_ENTRY} bytes of them"
            );
            return Ok((out, Some(why)));
        }
        out.push((name, value[..len].to_vec()));
    }
    Ok((out, None))
}

/// Gives the open file or directory `fd` what `meta` says (nothing said: no
/// attributes), as far as `preserve` asks and this side may: owner and group, then the
/// attributes, removing those of the kept kinds that the source does not have (a new
/// file may have inherited a default ACL). Call before setting the mode. What cannot be
/// kept is noted, naming `shown`.
pub fn apply(
    fd: BorrowedFd<'_>,
    meta: Option<&EntryMeta>,
    preserve: Preserve,
    shown: &str,
    notes: &Notes,
) {
    let empty = EntryMeta::default();
    let meta = meta.unwrap_or(&empty);
    let uid = meta.uid.filter(|_| preserve.owner);
    let gid = meta.gid.filter(|_| preserve.group);
    if uid.is_some() || gid.is_some() {
        let owner = uid.map(uid_of);
        let group = gid.map(gid_of);
        if let Err(e) = rustix::fs::fchown(fd, owner, group) {
            notes.add(format!("owner {e}"), || {
                format!("owner and group not kept (from {shown} on): {e}")
            });
        }
    }
    if preserve.attributes() {
        if let Err(e) = sync_xattrs(fd, &meta.xattrs, preserve) {
            let what = attribute_kinds(preserve);
            notes.add(
                format!("xattrs {}", e.raw_os_error().unwrap_or(0)),
                || match e.raw_os_error() {
                    Some(libc::ENOTSUP) => format!(
                        "{what} not kept: the destination's file system does not support them \
                         (from {shown} on)"
                    ),
                    _ => format!("{what} not kept (from {shown} on): {e}"),
                },
            );
        }
    }
}

/// Gives `fd` an owner and group for a symlink's sake: the link itself, never its target.
pub fn apply_to_link(
    dir: BorrowedFd<'_>,
    name: &[u8],
    meta: Option<&EntryMeta>,
    preserve: Preserve,
    shown: &str,
    notes: &Notes,
) {
    let Some(meta) = meta else { return };
    let uid = meta.uid.filter(|_| preserve.owner).map(uid_of);
    let gid = meta.gid.filter(|_| preserve.group).map(gid_of);
    if uid.is_none() && gid.is_none() {
        return;
    }
    if let Err(e) = rustix::fs::chownat(dir, name, uid, gid, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
    {
        notes.add(format!("owner {e}"), || {
            format!("owner and group not kept (from {shown} on): {e}")
        });
    }
}

fn attribute_kinds(preserve: Preserve) -> &'static str {
    match (preserve.xattrs, preserve.acls) {
        (true, true) => "extended attributes and ACLs",
        (true, false) => "extended attributes",
        _ => "ACLs",
    }
}

fn uid_of(uid: u32) -> rustix::fs::Uid {
    rustix::fs::Uid::from_raw(uid)
}

fn gid_of(gid: u32) -> rustix::fs::Gid {
    rustix::fs::Gid::from_raw(gid)
}

fn sync_xattrs(
    fd: BorrowedFd<'_>,
    wanted: &[(Vec<u8>, Vec<u8>)],
    preserve: Preserve,
) -> io::Result<()> {
    let have = list_xattrs(fd)?;
    for name in have.iter().filter(|n| preserve.keeps(n)) {
        if !wanted.iter().any(|(w, _)| w == name) {
            match rustix::fs::fremovexattr(fd, &name[..]) {
                Ok(()) | Err(Errno::NODATA) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    for (name, value) in wanted.iter().filter(|(n, _)| preserve.keeps(n)) {
        rustix::fs::fsetxattr(fd, &name[..], value, XattrFlags::empty())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn flags_round_trip_and_only_kept_names_are_kept() {
        for bits in 0..64u32 {
            let p = Preserve {
                owner: bits & 1 != 0,
                group: bits & 2 != 0,
                xattrs: bits & 4 != 0,
                acls: bits & 8 != 0,
                sparse: bits & 16 != 0,
                hardlinks: bits & 32 != 0,
            };
            assert_eq!(Preserve::from_flags(p.flags()), p);
        }
        let xattrs = Preserve {
            xattrs: true,
            ..Preserve::default()
        };
        assert!(xattrs.keeps(b"user.a"));
        assert!(!xattrs.keeps(b"user."));
        assert!(!xattrs.keeps(b"security.capability"));
        assert!(!xattrs.keeps(b"trusted.x"));
        assert!(!xattrs.keeps(b"system.posix_acl_access"));
        let acls = Preserve {
            acls: true,
            ..Preserve::default()
        };
        assert!(acls.keeps(b"system.posix_acl_default"));
        assert!(!acls.keeps(b"user.a"));
    }

    #[test]
    fn notes_are_made_once_per_kind_and_bounded() {
        let notes = Notes::default();
        for i in 0..3 {
            notes.add("owner".into(), || format!("first {i}"));
        }
        assert_eq!(notes.take(), vec!["first 0".to_string()]);
        for i in 0..MAX_NOTES * 2 {
            notes.add(format!("k{i}"), || format!("n{i}"));
        }
        assert_eq!(notes.take().len(), MAX_NOTES - 1);
        assert!(notes.take().is_empty());
    }

    #[test]
    fn data_ranges_are_found_and_bounded() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(dir.path().join("s")).unwrap();
        let size = 64u64 << 20;
        f.set_len(size).unwrap();
        f.write_all_at(&[1; 4096], 1 << 20).unwrap();
        f.write_all_at(&[2; 4096], size - 4096).unwrap();
        match data_ranges(f.as_fd(), size).unwrap() {
            Ranges::Dense => eprintln!("skipped: no holes under {}", dir.path().display()),
            Ranges::Sparse(data) => {
                assert_eq!(data, vec![(1 << 20, (1 << 20) + 4096), (size - 4096, size)])
            }
            Ranges::TooMany => panic!("two ranges"),
        }
        let empty = std::fs::File::create(dir.path().join("h")).unwrap();
        empty.set_len(size).unwrap();
        let all_hole = data_ranges(empty.as_fd(), size).unwrap();
        assert!(all_hole == Ranges::Dense || all_hole == Ranges::Sparse(Vec::new()));
        let many = std::fs::File::create(dir.path().join("m")).unwrap();
        let n = MAX_DATA_RANGES_PER_ENTRY as u64 + 1;
        many.set_len(n * 8192).unwrap();
        for i in 0..n {
            many.write_all_at(&[3; 4096], i * 8192).unwrap();
        }
        let got = data_ranges(many.as_fd(), n * 8192).unwrap();
        assert!(matches!(got, Ranges::Dense | Ranges::TooMany), "{got:?}");
    }

    #[test]
    fn user_attributes_are_read_and_set_where_the_file_system_has_them() {
        let dir = tempfile::tempdir().unwrap();
        let a = std::fs::File::create(dir.path().join("a")).unwrap();
        let b = std::fs::File::create(dir.path().join("b")).unwrap();
        if rustix::fs::fsetxattr(&a, "user.k", b"v", XattrFlags::empty()).is_err() {
            eprintln!(
                "skipped: no user.* attributes under {}",
                dir.path().display()
            );
            return;
        }
        rustix::fs::fsetxattr(&b, "user.stale", b"x", XattrFlags::empty()).unwrap();
        let p = Preserve {
            xattrs: true,
            ..Preserve::default()
        };
        let meta = crate::fs::fd_meta(a.as_fd()).unwrap();
        let mut left_out = None;
        let read = read(Some(a.as_fd()), &meta, p, &mut left_out).unwrap();
        assert_eq!(read.xattrs, vec![(b"user.k".to_vec(), b"v".to_vec())]);
        assert!(left_out.is_none());
        let notes = Notes::default();
        apply(b.as_fd(), Some(&read), p, "b", &notes);
        assert!(notes.take().is_empty());
        assert_eq!(list_xattrs(b.as_fd()).unwrap(), vec![b"user.k".to_vec()]);
    }
}
