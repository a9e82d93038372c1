//! Atomic output files: write to a temporary file `.NAME.tmp-PID` in the destination's
//! directory, flush it to disk, then rename over the destination. An error never leaves a
//! half-written file.
//!
//! Every temporary file or directory in flight is recorded in a process-wide registry, so that
//! the binary's interrupt handler (SIGINT, SIGTERM) can remove them with
//! [`remove_in_flight`] before it exits. A process killed outright (SIGKILL, power loss) leaves
//! its temporaries behind: writing NAME removes the `.NAME.tmp-PID` entries of processes that
//! no longer exist ([`remove_stale`]).

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use anyhow::{bail, Context, Result};

/// Temporary files and directories being written by this process.
static IN_FLIGHT: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The registry, locked (a panic elsewhere does not make it unusable).
fn registry() -> MutexGuard<'static, Vec<PathBuf>> {
    IN_FLIGHT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Removes `p`, a file or a directory with its contents.
fn remove_any(p: &Path) -> std::io::Result<()> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(p),
        Ok(_) => fs::remove_file(p),
        Err(e) => Err(e),
    }
}

/// Removes `p` from the registry (the lock held by the caller).
fn forget(reg: &mut Vec<PathBuf>, p: &Path) {
    reg.retain(|q| q != p);
}

/// The directory `path` is written in (`.` for a bare file name).
pub fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The temporary name of `path` while it is written: `.NAME.tmp-PID` beside it.
pub fn tmp_path(path: &Path) -> Result<PathBuf> {
    let name = path
        .file_name()
        .with_context(|| format!("output: {} is not a file path", path.display()))?;
    let tmp = format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id());
    Ok(match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.join(tmp),
        _ => PathBuf::from(tmp),
    })
}

/// Creates the file `tmp` and records it as in flight, both under the registry's lock (so an
/// interrupt sees either no file or a recorded one).
fn create_in_flight(tmp: &Path) -> std::io::Result<File> {
    let mut reg = registry();
    let f = File::create(tmp)?;
    reg.push(tmp.to_path_buf());
    Ok(f)
}

/// Renames `tmp` over `path` and forgets it, under the registry's lock.
fn commit(tmp: &Path, path: &Path) -> std::io::Result<()> {
    let mut reg = registry();
    let r = fs::rename(tmp, path);
    if r.is_ok() {
        forget(&mut reg, tmp);
    }
    r
}

/// Removes `tmp` (file or directory) and forgets it, under the registry's lock.
fn discard(tmp: &Path) {
    let mut reg = registry();
    let _ = remove_any(tmp);
    forget(&mut reg, tmp);
}

/// Removes every temporary file and directory this process has in flight and returns their
/// paths. The registry stays locked afterwards, so that no new temporary appears before the
/// process exits: only the interrupt handler and the end of `main` (a thread of its own may
/// still be writing a cache file), which exit right after, call this.
pub fn remove_in_flight() -> Vec<PathBuf> {
    let reg = registry();
    let removed = reg
        .iter()
        .filter(|p| remove_any(p).is_ok())
        .cloned()
        .collect();
    // Never unlocked: a writer that reaches the registry now waits until the process exits.
    std::mem::forget(reg);
    removed
}

/// The temporaries this process has in flight now.
pub fn in_flight() -> Vec<PathBuf> {
    registry().clone()
}

/// Whether process `pid` exists. Unknown answers count as alive (its files are kept).
pub fn process_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        // Pid 0 and values beyond pid_t would name process groups or nothing: not ours to judge.
        let Ok(p) = libc::pid_t::try_from(pid) else {
            return true;
        };
        if p <= 0 {
            return true;
        }
        // SAFETY: kill with signal 0 sends no signal; it only asks whether `p` exists (and may
        // be signalled). `p` is a positive pid, so no process group is addressed.
        let r = unsafe { libc::kill(p, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// The pid in an entry name `PREFIX<pid>` or `PREFIX<pid>-<anything>`.
fn pid_after(name: &str, prefix: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?;
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let (pid, tail) = rest.split_at(digits);
    if pid.is_empty() || !(tail.is_empty() || tail.starts_with('-')) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the entries of `dir` named `PREFIX<pid>` or `PREFIX<pid>-...` whose process no
/// longer exists (this process's own are kept); returns what was removed.
pub fn remove_stale_in(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let me = std::process::id();
    rd.filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let pid = pid_after(name.to_str()?, prefix)?;
            (pid != me && !process_alive(pid)).then(|| e.path())
        })
        .filter(|p| remove_any(p).is_ok())
        .collect()
}

/// Removes the temporaries `.NAME.tmp-PID` (and `.NAME.tmp-PID-...`) beside `path` left by
/// processes that no longer exist; returns what was removed.
pub fn remove_stale(path: &Path) -> Vec<PathBuf> {
    let Some(name) = path.file_name() else {
        return Vec::new();
    };
    remove_stale_in(
        &parent_dir(path),
        &format!(".{}.tmp-", name.to_string_lossy()),
    )
}

/// Checks that a file can be created beside `path`: creates its temporary name and removes it.
/// The error is the operating system's.
pub fn probe(path: &Path) -> Result<()> {
    let tmp = tmp_path(path)?;
    let r = create_in_flight(&tmp);
    discard(&tmp);
    r?;
    Ok(())
}

/// Writes `path` atomically with the bytes produced by `write`.
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let tmp = tmp_path(path)?;
    remove_stale(path);
    let p = path.display();
    let result = (|| -> Result<()> {
        let f = create_in_flight(&tmp)
            .with_context(|| format!("output: cannot create {p} (as {})", tmp.display()))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        write(&mut w)?;
        let f = w
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("output: cannot write {p} (as {})", tmp.display()))?;
        f.sync_all()
            .with_context(|| format!("output: cannot flush {p} (as {})", tmp.display()))?;
        commit(&tmp, path)
            .with_context(|| format!("output: cannot rename {} to {p}", tmp.display()))
    })();
    if result.is_err() {
        discard(&tmp);
    }
    result
}

/// A temporary directory in flight: recorded in the registry while it exists, removed with its
/// contents when dropped, unless [`InFlightDir::commit`] moved it into place.
#[derive(Debug)]
pub struct InFlightDir {
    path: PathBuf,
    done: bool,
}

impl InFlightDir {
    /// Creates the directory `path` (which must not exist) and records it.
    pub fn create(path: &Path) -> Result<InFlightDir> {
        let mut reg = registry();
        fs::create_dir(path)
            .with_context(|| format!("output: cannot create {}", path.display()))?;
        reg.push(path.to_path_buf());
        Ok(InFlightDir {
            path: path.to_path_buf(),
            done: false,
        })
    }

    /// The temporary directory `.NAME.tmp-PID` beside `dest`, after removing the stale ones of
    /// dead processes.
    pub fn beside(dest: &Path) -> Result<InFlightDir> {
        remove_stale(dest);
        let tmp = tmp_path(dest)?;
        if tmp.exists() {
            // Our own pid's leftover (pid reuse): not in flight, since we never made it.
            remove_any(&tmp).with_context(|| format!("output: cannot remove {}", tmp.display()))?;
        }
        InFlightDir::create(&tmp)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the directory to `dest`. An existing `dest` directory is moved aside
    /// (`.NAME.tmp-PID-old`), replaced, and then removed; on failure it is put back.
    pub fn commit(mut self, dest: &Path) -> Result<()> {
        let mut reg = registry();
        let d = dest.display();
        let mut old = tmp_path(dest)?.into_os_string();
        old.push("-old");
        let old = PathBuf::from(old);
        let had = fs::symlink_metadata(dest).is_ok();
        if had {
            if !dest.is_dir() {
                bail!("output: {d} exists and is not a directory");
            }
            let _ = remove_any(&old);
            fs::rename(dest, &old)
                .with_context(|| format!("output: cannot move {d} aside to {}", old.display()))?;
        }
        if let Err(e) = fs::rename(&self.path, dest) {
            if had {
                let _ = fs::rename(&old, dest);
            }
            return Err(e)
                .with_context(|| format!("output: cannot rename {} to {d}", self.path.display()));
        }
        forget(&mut reg, &self.path);
        self.done = true;
        if had {
            let _ = remove_any(&old);
        }
        Ok(())
    }
}

impl Drop for InFlightDir {
    fn drop(&mut self) {
        if !self.done {
            discard(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_write_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.bin");
        write_atomic(&p, |w| Ok(w.write_all(b"ok")?)).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"ok");
        let r = write_atomic(&p, |w| {
            w.write_all(b"partial")?;
            anyhow::bail!("boom")
        });
        assert!(r.is_err());
        assert_eq!(fs::read(&p).unwrap(), b"ok");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_write_in_progress_is_registered_and_forgotten_after() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("y.bin");
        let tmp = tmp_path(&p).unwrap();
        write_atomic(&p, |w| {
            assert!(in_flight().contains(&tmp), "{tmp:?} not registered");
            assert!(tmp.is_file());
            Ok(w.write_all(b"y")?)
        })
        .unwrap();
        assert!(!in_flight().contains(&tmp));
        assert!(!tmp.exists());
    }

    #[test]
    fn pids_are_read_from_temporary_names() {
        assert_eq!(pid_after(".a.json.tmp-123", ".a.json.tmp-"), Some(123));
        assert_eq!(pid_after(".a.json.tmp-123-old", ".a.json.tmp-"), Some(123));
        assert_eq!(pid_after(".a.json.tmp-", ".a.json.tmp-"), None);
        assert_eq!(pid_after(".a.json.tmp-12x", ".a.json.tmp-"), None);
        assert_eq!(pid_after(".a.json.tmp-5.tmp-9", ".a.json.tmp-"), None);
        assert_eq!(pid_after(".b.json.tmp-123", ".a.json.tmp-"), None);
    }

    #[cfg(unix)]
    #[test]
    fn stale_temporaries_of_dead_processes_go_and_live_ones_stay() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("z.json");
        // A process that has exited: its pid is free.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        assert!(!process_alive(dead));
        assert!(process_alive(std::process::id()));
        let stale = dir.path().join(format!(".z.json.tmp-{dead}"));
        let stale_dir = dir.path().join(format!(".z.json.tmp-{dead}-old"));
        let mine = dir
            .path()
            .join(format!(".z.json.tmp-{}", std::process::id()));
        let other = dir.path().join(format!(".zz.json.tmp-{dead}"));
        fs::write(&stale, b"s").unwrap();
        fs::create_dir(&stale_dir).unwrap();
        fs::write(stale_dir.join("f"), b"f").unwrap();
        fs::write(&mine, b"m").unwrap();
        fs::write(&other, b"o").unwrap();
        let mut removed = remove_stale(&p);
        removed.sort();
        assert_eq!(removed, vec![stale.clone(), stale_dir.clone()]);
        assert!(!stale.exists() && !stale_dir.exists());
        assert!(mine.exists() && other.exists());
    }

    #[test]
    fn a_directory_in_flight_is_removed_unless_committed() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("case");
        {
            let t = InFlightDir::beside(&dest).unwrap();
            fs::write(t.path().join("a"), b"a").unwrap();
            assert!(in_flight().contains(&t.path().to_path_buf()));
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        // Committed over an existing directory: the old contents are replaced.
        fs::create_dir(&dest).unwrap();
        fs::write(dest.join("old"), b"o").unwrap();
        let t = InFlightDir::beside(&dest).unwrap();
        let tp = t.path().to_path_buf();
        fs::write(tp.join("new"), b"n").unwrap();
        t.commit(&dest).unwrap();
        assert!(!in_flight().contains(&tp));
        assert!(dest.join("new").is_file() && !dest.join("old").exists());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
