//! `cp --preserve hardlinks` on the receiving side: the later names of one source file
//! become hard links to the file its first name received, once that file is in place.
//!
//! A link entry names an earlier entry of the session (the decoder checks that within a
//! frame; [`Links`] checks it across frames, as it remembers the entries links may name).
//! With a sender that marks the entries that may be linked to (`features::LINK_TARGETS`:
//! the first names of files with several), only those are remembered, at most
//! [`MAX_LINK_TARGETS`], so that a session of millions of files with a few links holds a
//! few entries here, not millions. A conforming sender marks no more (its own table of
//! such files has that bound); should one, the further marks are not remembered and a
//! link to one fails alone, saying why: its data cannot be received instead, as no data
//! travels for a link and the receiver no longer knows where the file it names is. With
//! an older sender, which marks nothing, every file entry is remembered, as any may be
//! linked to. The first name's file may still be arriving when its other names are
//! announced, so a link waits for it: the committer links the waiting names right after
//! it renames the file into place, in the same batch, so the names are durable together
//! and acknowledged together. A file that fails fails its waiting names with it, each
//! alone and saying why. A name is linked as any file is committed: to a temporary name
//! first, then renamed over whatever the destination held, so readers see the old file
//! or the link, never neither; a name that already is the same file is left alone.
//!
//! Where the destination cannot link (another file system beneath the export, a file
//! system without hard links, the file's link limit), the name gets a copy of the first
//! name's file instead, and one note says so.
//!
//! This module does not decide which names are links: the sender's walker does, by
//! device and inode, among the names of the transfer only.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::{Arc, Mutex};

use rustix::fs::AtFlags;
use rustix::io::Errno;
use wanxfer_proto::{EntryMeta, RelPath, MAX_LINK_TARGETS};

use crate::fs::{self, Root, TempFile};
use crate::preserve::{self, Notes, Preserve};
use crate::Error;

/// A name to link to an earlier entry's file.
#[derive(Debug)]
pub struct Link {
    /// Its own entry id, and the id of the entry whose file it is another name of.
    pub id: u64,
    pub target: u64,
    pub dest: RelPath,
    pub mode: u32,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
    /// For a copy where the destination cannot link.
    pub meta: Option<Box<EntryMeta>>,
}

/// What became of a file entry other names may link to.
#[derive(Debug)]
enum State {
    /// Still to be placed; these names wait for it.
    Waiting(Vec<Link>),
    /// Under its name.
    Placed,
    Failed,
    /// Itself a link: nothing may link to it.
    IsLink,
}

#[derive(Debug)]
struct Target {
    dest: RelPath,
    state: State,
}

/// What a link entry can do now.
#[derive(Debug)]
pub enum Ready {
    /// Its file is in place at this path: link it.
    Now(Link, RelPath),
    /// It waits for its file.
    Later,
    /// Its file failed.
    Failed(Error),
}

/// The receiving session's file entries that may be linked to, and the names that link
/// to them.
pub struct Links {
    root: Root,
    tag: u64,
    peer: String,
    /// The sender marks link targets: only those are remembered, at most `bound`.
    marked: bool,
    bound: usize,
    table: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    targets: HashMap<u64, Target>,
    /// File entries taken in, remembered or not.
    files: u64,
    /// The first marked entry past [`MAX_LINK_TARGETS`], and how many were not
    /// remembered.
    forgotten_from: Option<u64>,
    forgotten: u64,
}

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links").finish_non_exhaustive()
    }
}

impl Links {
    /// `tag` names this transfer's temporaries; `peer` is blamed for a bad link;
    /// `marked`: the peer marks the entries links may name.
    pub fn new(root: &Root, tag: u64, peer: String, marked: bool) -> Result<Links, Error> {
        Ok(Links {
            root: root.try_clone()?,
            tag,
            peer,
            marked,
            bound: MAX_LINK_TARGETS,
            table: Mutex::default(),
        })
    }

    /// How many entries are remembered now.
    pub fn remembered(&self) -> usize {
        self.lock().targets.len()
    }

    /// The root's descriptor (to sync its file system).
    pub fn root_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.root.fd()
    }

    /// A file entry arrives at `dest`, `linkable` if marked as a link target: other
    /// names may wait for it from now on.
    pub fn file(&self, id: u64, dest: &RelPath, linkable: bool) {
        let mut table = self.lock();
        table.files += 1;
        if self.marked && !linkable {
            return;
        }
        // Only a sender breaking the protocol's bound gets here past it: see the module.
        if self.marked && table.targets.len() >= self.bound {
            table.forgotten_from.get_or_insert(id);
            table.forgotten += 1;
            return;
        }
        table.targets.insert(
            id,
            Target {
                dest: dest.clone(),
                state: State::Waiting(Vec::new()),
            },
        );
    }

    /// File `id` is in place (`true`) or failed: the names waiting for it, to link now,
    /// or to fail with the error this returns for each.
    pub fn settle(&self, id: u64, placed: bool) -> Settled {
        let mut table = self.lock();
        let Some(target) = table.targets.get_mut(&id) else {
            return Settled::default();
        };
        let waiting = match std::mem::replace(
            &mut target.state,
            if placed { State::Placed } else { State::Failed },
        ) {
            State::Waiting(waiting) => waiting,
            other => {
                target.state = other; // settled already
                return Settled::default();
            }
        };
        let dest = target.dest.clone();
        if placed {
            Settled {
                link: waiting.into_iter().map(|l| (l, dest.clone())).collect(),
                fail: Vec::new(),
            }
        } else {
            let shown = self.root.show(&dest);
            Settled {
                link: Vec::new(),
                fail: waiting
                    .into_iter()
                    .map(|l| {
                        let error = self.target_failed(&l, &shown);
                        (l.id, error)
                    })
                    .collect(),
            }
        }
    }

    /// Link entry `link` arrives: refused (ending the session) if its target is not a
    /// file entry of this session that is not itself a link (and is marked, when the
    /// sender marks); failed alone if it is one of the marked entries not remembered.
    pub fn link(&self, link: Link) -> Result<Ready, Error> {
        let (id, to, own) = (link.id, link.target, link.dest.clone());
        let refuse = |why: &str| {
            Err(Error::protocol(
                &self.peer,
                format!("entry {id} is a hard link to entry {to}, which is {why}"),
            ))
        };
        if to >= id {
            return refuse("not an earlier entry");
        }
        let mut table = self.lock();
        let forgotten = table.forgotten_from.is_some_and(|from| to >= from);
        let Some(target) = table.targets.get_mut(&to) else {
            if forgotten {
                return Ok(Ready::Failed(Error::Refused {
                    path: self.root.show(&link.dest),
                    reason: format!(
                        "not linked: it is another name of the file of entry {to}, one of \
                         more than {MAX_LINK_TARGETS} files with several names in this \
                         session, which is more than this side remembers"
                    ),
                }));
            }
            return refuse(if self.marked {
                "not marked as a link target"
            } else {
                "not a file"
            });
        };
        let ready = match &mut target.state {
            State::IsLink => return refuse("itself a link"),
            State::Failed => {
                Ready::Failed(self.target_failed(&link, &self.root.show(&target.dest)))
            }
            State::Placed => Ready::Now(link, target.dest.clone()),
            State::Waiting(waiting) => {
                waiting.push(link);
                Ready::Later
            }
        };
        // Marked, a link is never a target (the decoder refuses the mark on one), so
        // nothing need remember it.
        if !self.marked {
            table.targets.insert(
                id,
                Target {
                    dest: own,
                    state: State::IsLink,
                },
            );
        }
        Ok(ready)
    }

    /// Whether `dest` already is the file at `target` (a re-run).
    pub fn same_file(&self, dest: &RelPath, target: &RelPath) -> bool {
        let inode = |rel: &RelPath| {
            let (parent, name) = rel.split_last()?;
            let dir = self.root.dir(&parent).ok()?;
            let st = rustix::fs::statat(&dir, OsStr::from_bytes(name), AtFlags::SYMLINK_NOFOLLOW)
                .ok()?;
            Some((st.st_dev, st.st_ino))
        };
        inode(dest).is_some_and(|own| inode(target) == Some(own))
    }

    /// Places `link` as another name of the file at `target`, or where the destination
    /// cannot link, as a copy of it (noted once, with `durable` data).
    pub fn place(
        &self,
        link: &Link,
        target: &RelPath,
        durable: bool,
        (keep, notes): &(Preserve, Arc<Notes>),
    ) -> Result<(), Error> {
        let shown = self.root.show(&link.dest);
        let local = |op, e: std::io::Error| Error::local(op, &shown, e);
        let (target_parent, target_name) = target.split_last().expect("files are never the root");
        let (parent, name) = link.dest.split_last().expect("files are never the root");
        let target_dir = self.root.dir(&target_parent)?;
        let dir = Arc::new(self.root.dir(&parent)?);
        let temp = fs::temp_name(self.tag, name);
        let temp = OsStr::from_bytes(&temp);
        // A temporary an interrupted run left under this name is ours to replace.
        let _ = rustix::fs::unlinkat(&*dir, temp, AtFlags::empty());
        match rustix::fs::linkat(
            &target_dir,
            OsStr::from_bytes(target_name),
            &*dir,
            temp,
            AtFlags::empty(),
        ) {
            Ok(()) => {}
            Err(e @ (Errno::XDEV | Errno::PERM | Errno::MLINK | Errno::OPNOTSUPP)) => {
                let target_shown = self.root.show(target);
                notes.add(format!("hardlinks {}", e.raw_os_error()), || {
                    format!(
                        "hard links not kept (from {shown} on, copied from {target_shown}): {}",
                        std::io::Error::from(e)
                    )
                });
                return self.copy(
                    link,
                    target_dir.as_fd(),
                    target_name,
                    dir,
                    durable,
                    keep,
                    notes,
                );
            }
            Err(e) => return Err(local("link", e.into())),
        }
        // Linked without following a symlink: what is linked must be the file itself.
        let placed = fs::meta_at(dir.as_fd(), temp.as_bytes()).and_then(|meta| {
            if meta.is_some_and(|m| m.kind == fs::Kind::File) {
                Ok(())
            } else {
                Err(std::io::Error::other(format!(
                    "{} is no longer a regular file",
                    self.root.show(target)
                )))
            }
        });
        let placed = placed.and_then(|()| {
            Ok(rustix::fs::renameat(
                &*dir,
                temp,
                &*dir,
                OsStr::from_bytes(name),
            )?)
        });
        // Renaming a name onto another name of the same file leaves both: drop ours.
        let _ = rustix::fs::unlinkat(&*dir, temp, AtFlags::empty());
        placed.map_err(|e| local("link", e))
    }

    /// A copy of the file at `target_dir`/`target_name` as `link`, where it cannot link.
    #[allow(clippy::too_many_arguments)]
    fn copy(
        &self,
        link: &Link,
        target_dir: std::os::fd::BorrowedFd<'_>,
        target_name: &[u8],
        dir: Arc<std::os::fd::OwnedFd>,
        durable: bool,
        keep: &Preserve,
        notes: &Notes,
    ) -> Result<(), Error> {
        let shown = self.root.show(&link.dest);
        let local = |op, e| Error::local(op, &shown, e);
        let (_, name) = link.dest.split_last().expect("files are never the root");
        let source = fs::open_file_at(target_dir, target_name).map_err(|e| local("open", e))?;
        let size = fs::fd_meta(source.as_fd())
            .map_err(|e| local("stat", e))?
            .size;
        let temp = TempFile::create(dir, name, self.tag, link.mode, None)
            .map_err(|e| local("create", e))?;
        fs::copy_range(&source, &temp.file, 0, size).map_err(|e| local("copy", e))?;
        if !keep.is_empty() {
            preserve::apply(
                temp.file.as_fd(),
                link.meta.as_deref(),
                *keep,
                &shown,
                notes,
            );
        }
        if durable {
            fs::sync_data(&temp.file).map_err(|e| local("sync", e))?;
        }
        temp.commit(link.mode, link.mtime_sec, link.mtime_nsec)
            .map_err(|e| local("rename into place", e))
    }

    fn target_failed(&self, link: &Link, target_shown: &str) -> Error {
        Error::Refused {
            path: self.root.show(&link.dest),
            reason: format!(
                "not linked: it is another name of {target_shown}, which failed to arrive"
            ),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().expect("no panics while held")
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        let table = self.lock();
        tracing::debug!(
            "hardlinks: remembered {} of {} file entries ({}); {} marked past the bound \
             not remembered",
            table.targets.len(),
            table.files,
            if self.marked {
                "those marked as link targets"
            } else {
                "all: the peer marks none"
            },
            table.forgotten,
        );
    }
}

/// The names waiting for a file that was just settled.
#[derive(Debug, Default)]
pub struct Settled {
    /// To link to the file at this path.
    pub link: Vec<(Link, RelPath)>,
    /// To fail with these errors.
    pub fail: Vec<(u64, Error)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn links(marked: bool, bound: usize) -> (tempfile::TempDir, Links) {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::open(dir.path()).unwrap();
        let mut links = Links::new(&root, 1, "peer".into(), marked).unwrap();
        links.bound = bound;
        (dir, links)
    }

    fn path(id: u64) -> RelPath {
        RelPath::new(format!("f{id}").as_bytes()).unwrap()
    }

    fn link(id: u64, target: u64) -> Link {
        Link {
            id,
            target,
            dest: path(id),
            mode: 0o644,
            mtime_sec: 1,
            mtime_nsec: 0,
            meta: None,
        }
    }

    /// A marking sender's plain files are not remembered; its marked ones are, and
    /// only a link to one of those is taken.
    #[test]
    fn only_marked_files_are_remembered() {
        let (_dir, links) = links(true, MAX_LINK_TARGETS);
        for id in 0..10_000 {
            links.file(id, &path(id), id % 1000 == 0);
        }
        assert_eq!(links.remembered(), 10);
        assert!(matches!(links.link(link(10_000, 3000)), Ok(Ready::Later)));
        assert_eq!(links.remembered(), 10, "a link is not remembered");
        let refused = links.link(link(10_001, 3001)).unwrap_err().to_string();
        assert!(refused.contains("not marked as a link target"), "{refused}");
        // Settled: the waiting name is linked to the file's path.
        let settled = links.settle(3000, true);
        assert_eq!(settled.link.len(), 1);
        assert_eq!(settled.link[0].1, path(3000));
        assert!(matches!(links.link(link(10_002, 3000)), Ok(Ready::Now(..))));
    }

    /// Past the bound, marked files are not remembered, and a link to one fails alone,
    /// saying why; a link to an unmarked file before the bound is still refused.
    #[test]
    fn marks_past_the_bound_fail_their_links_alone() {
        let (_dir, links) = links(true, 2);
        links.file(0, &path(0), false);
        for id in 1..=4 {
            links.file(id, &path(id), true);
        }
        assert_eq!(links.remembered(), 2);
        assert!(matches!(links.link(link(5, 2)), Ok(Ready::Later)));
        match links.link(link(6, 3)) {
            Ok(Ready::Failed(e)) => {
                let e = e.to_string();
                assert!(
                    e.contains("f6") && e.contains("more than this side remembers"),
                    "{e}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(
            links.link(link(7, 0)).is_err(),
            "unmarked, before the bound"
        );
        assert_eq!(links.remembered(), 2);
    }

    /// A sender that marks nothing (an older one): every file may be linked to, and
    /// every file and link is remembered, as before.
    #[test]
    fn without_marks_every_file_is_remembered() {
        let (_dir, links) = links(false, 2);
        for id in 0..100 {
            links.file(id, &path(id), false);
        }
        assert_eq!(links.remembered(), 100, "no bound without marks");
        assert!(matches!(links.link(link(100, 42)), Ok(Ready::Later)));
        let refused = links.link(link(101, 100)).unwrap_err().to_string();
        assert!(refused.contains("itself a link"), "{refused}");
    }
}
