//! A command's outputs checked before it does any work: no output resolves to one of its
//! inputs (the same path, through symlinks or `..`, or the same file through a hard link), no
//! two outputs are one file, a directory output (`--repro DIR`, replaced whole) holds no input
//! and no other output, and every output can be created (its directory exists, it is not a
//! directory, a file can be made beside it).
//!
//! A command lists its inputs and outputs in a [`Guard`] and calls [`Guard::check`] before it
//! opens a model or computes anything. `-` given to a JSON output means stdout ([`is_stdout`]).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};

use super::atomic;

/// Whether an output path means stdout (`-`).
pub fn is_stdout(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// Where a file is: its canonical path and, when it exists, its device and inode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    /// The path with symlinks and `..` resolved (for a file that does not exist yet: its
    /// directory's, joined with its name).
    pub path: PathBuf,
    /// `(device, inode)` of an existing file (unix).
    pub inode: Option<(u64, u64)>,
}

#[cfg(unix)]
fn inode_of(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn inode_of(_: &Path) -> Option<(u64, u64)> {
    None
}

impl FileIdentity {
    /// The identity of `p`, or `None` when neither `p` nor its directory resolves. A symlink
    /// to a file that does not exist yet stands for that file.
    pub fn of(p: &Path) -> Option<FileIdentity> {
        let mut p = p.to_path_buf();
        for _ in 0..40 {
            if let Ok(c) = fs::canonicalize(&p) {
                return Some(FileIdentity {
                    path: c,
                    inode: inode_of(&p),
                });
            }
            match fs::read_link(&p) {
                Ok(t) => p = atomic::parent_dir(&p).join(t),
                Err(_) => break,
            }
        }
        let name = p.file_name()?;
        let dir = fs::canonicalize(atomic::parent_dir(&p)).ok()?;
        Some(FileIdentity {
            path: dir.join(name),
            inode: None,
        })
    }
}

/// How two paths name one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Same {
    /// Spelled the same.
    Path,
    /// One of them is a symlink to the other.
    Symlink,
    /// Spelled differently, the same once symlinks and `..` are resolved.
    OtherPath,
    /// Two names (hard links) of one file: the same device and inode.
    HardLink,
}

impl Same {
    /// Words for an error message (empty for [`Same::Path`]).
    fn words(self) -> &'static str {
        match self {
            Same::Path => "",
            Same::Symlink => " (the same file through a symlink)",
            Same::OtherPath => " (the same file by another path)",
            Same::HardLink => " (the same file through a hard link)",
        }
    }
}

/// Whether `p` is a symlink itself.
fn is_symlink(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

/// `a` and `b` spelled the same, but for `.` components (`./m.gguf` is `m.gguf`).
fn spelled_alike(a: &Path, b: &Path) -> bool {
    let parts = |p: &'_ Path| -> Vec<std::ffi::OsString> {
        p.components()
            .filter(|c| *c != std::path::Component::CurDir)
            .map(|c| c.as_os_str().to_os_string())
            .collect()
    };
    parts(a) == parts(b)
}

/// How the paths `a` and `b` name one file, given their identities.
fn same_as(a: &Path, ia: &FileIdentity, b: &Path, ib: &FileIdentity) -> Option<Same> {
    if ia.path == ib.path {
        Some(if spelled_alike(a, b) {
            Same::Path
        } else if is_symlink(a) || is_symlink(b) {
            Same::Symlink
        } else {
            Same::OtherPath
        })
    } else if ia.inode.is_some() && ia.inode == ib.inode {
        Some(Same::HardLink)
    } else {
        None
    }
}

/// Whether `a` and `b` name one file, and how; `None` when they do not (or do not resolve).
pub fn same_file(a: &Path, b: &Path) -> Option<Same> {
    same_as(a, &FileIdentity::of(a)?, b, &FileIdentity::of(b)?)
}

/// What an output is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A file.
    File,
    /// A file, or stdout for `-`.
    FileOrStdout,
    /// A directory written whole (its old contents replaced).
    Dir,
}

#[derive(Clone, Debug)]
struct Output {
    flag: String,
    path: PathBuf,
    kind: Kind,
}

impl Output {
    /// `FLAG PATH` as the user gave them (the path alone without a flag).
    fn named(&self) -> String {
        if self.flag.is_empty() {
            self.path.display().to_string()
        } else {
            format!("{} {}", self.flag, self.path.display())
        }
    }
}

/// A command's inputs and outputs, checked together by [`Guard::check`].
#[derive(Clone, Debug, Default)]
pub struct Guard {
    inputs: Vec<(String, PathBuf)>,
    outputs: Vec<Output>,
}

impl Guard {
    /// No inputs, no outputs.
    pub fn new() -> Guard {
        Guard::default()
    }

    /// An input file; `what` names it in errors ("the input model").
    pub fn input(&mut self, what: &str, path: &Path) -> &mut Guard {
        self.inputs.push((what.to_string(), path.to_path_buf()));
        self
    }

    /// The inputs listed so far.
    pub fn inputs(&self) -> impl Iterator<Item = (&str, &Path)> + '_ {
        self.inputs.iter().map(|(w, p)| (w.as_str(), p.as_path()))
    }

    fn push(&mut self, flag: &str, path: Option<&Path>, kind: Kind) -> &mut Guard {
        if let Some(p) = path {
            self.outputs.push(Output {
                flag: flag.to_string(),
                path: p.to_path_buf(),
                kind,
            });
        }
        self
    }

    /// An output file given by `flag` (nothing when `path` is `None`; `flag` may be empty); `-`
    /// is refused.
    pub fn output(&mut self, flag: &str, path: Option<&Path>) -> &mut Guard {
        self.push(flag, path, Kind::File)
    }

    /// An output file that may be `-` (stdout), as `--json` and `--jsonl`.
    pub fn output_or_stdout(&mut self, flag: &str, path: Option<&Path>) -> &mut Guard {
        self.push(flag, path, Kind::FileOrStdout)
    }

    /// An output directory written whole, replacing what it held (`--repro DIR`).
    pub fn output_dir(&mut self, flag: &str, path: Option<&Path>) -> &mut Guard {
        self.push(flag, path, Kind::Dir)
    }

    /// Checks everything listed (see the module documentation); the error names the flag and
    /// the paths as the user gave them.
    pub fn check(&self) -> Result<()> {
        let outputs: Vec<&Output> = self
            .outputs
            .iter()
            .filter(|o| !(o.kind == Kind::FileOrStdout && is_stdout(&o.path)))
            .collect();
        for o in &outputs {
            check_shape(o)?;
        }
        let ids: Vec<(&Output, FileIdentity)> = outputs
            .iter()
            .map(|o| {
                let id = FileIdentity::of(&o.path).ok_or_else(|| {
                    anyhow!("output: {}: cannot resolve its directory", o.named())
                })?;
                Ok((*o, id))
            })
            .collect::<Result<_>>()?;
        let inputs: Vec<(&str, &Path, FileIdentity)> = self
            .inputs
            .iter()
            .filter(|(_, p)| p.exists())
            .filter_map(|(w, p)| Some((w.as_str(), p.as_path(), FileIdentity::of(p)?)))
            .collect();

        // Outputs against inputs.
        for (o, oid) in &ids {
            for (what, ip, iid) in &inputs {
                let hit = match o.kind {
                    Kind::Dir => (iid.path.starts_with(&oid.path)).then_some(Same::Path),
                    _ => same_as(&o.path, oid, ip, iid),
                };
                let Some(how) = hit else { continue };
                if o.kind == Kind::Dir {
                    bail!(
                        "output: {} would replace the directory holding {what} {}; refusing to overwrite an input",
                        o.named(),
                        ip.display()
                    );
                }
                bail!(
                    "output: {} is {what} {}{}; refusing to overwrite an input",
                    o.named(),
                    ip.display(),
                    how.words()
                );
            }
        }

        // Outputs against each other.
        for (i, (a, aid)) in ids.iter().enumerate() {
            for (b, bid) in &ids[i + 1..] {
                let (dir, file, did, fid) = match (a.kind, b.kind) {
                    (Kind::Dir, _) => (a, b, aid, bid),
                    (_, Kind::Dir) => (b, a, bid, aid),
                    _ => {
                        if let Some(how) = same_as(&a.path, aid, &b.path, bid) {
                            bail!(
                                "output: {} and {} are the same file{}; give each output its own path",
                                a.named(),
                                b.named(),
                                how.words()
                            );
                        }
                        continue;
                    }
                };
                if fid.path.starts_with(&did.path) || did.path.starts_with(&fid.path) {
                    bail!(
                        "output: {} is inside {}, which is replaced whole; write it elsewhere",
                        file.named(),
                        dir.named()
                    );
                }
            }
        }

        // A file can be created where each output goes.
        for o in &outputs {
            atomic::probe(&o.path).map_err(|e| {
                anyhow!(
                    "output: {}: cannot create a file in {}: {e:#}",
                    o.named(),
                    atomic::parent_dir(&o.path).display()
                )
            })?;
        }
        Ok(())
    }
}

/// The checks of one output on its own: a file name, an existing directory, not `-` where
/// stdout is not allowed, a file output not a directory and a directory output not a file.
fn check_shape(o: &Output) -> Result<()> {
    let p = o.named();
    if o.kind != Kind::FileOrStdout && is_stdout(&o.path) {
        bail!("output: {p}: only --json and --jsonl write to stdout; give a file path");
    }
    if o.path.file_name().is_none() {
        if o.kind == Kind::Dir {
            // `.`, `./`, `..`, `/`: a directory output is replaced whole, so it must be one of
            // its own, never the directory the command runs in or one above it.
            let which = match o.path.components().next_back() {
                Some(std::path::Component::CurDir) => "the current directory",
                Some(std::path::Component::ParentDir) => "a parent directory",
                _ => "the root directory",
            };
            bail!(
                "output: {p} is {which}; {} replaces its directory whole, so give a new directory (e.g. {} ./case)",
                o.flag,
                o.flag
            );
        }
        bail!("output: {p} is not a file path");
    }
    let dir = atomic::parent_dir(&o.path);
    if !dir.is_dir() {
        bail!(
            "output: {p}: the directory {} {}",
            dir.display(),
            if dir.exists() {
                "is not a directory"
            } else {
                "does not exist"
            }
        );
    }
    match o.kind {
        Kind::Dir => {
            if o.path.exists() && !o.path.is_dir() {
                bail!("output: {p} exists and is not a directory");
            }
        }
        _ => {
            if o.path.is_dir() {
                bail!("output: {p} is a directory; give a file path");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(g: &Guard) -> String {
        format!("{:#}", g.check().unwrap_err())
    }

    #[test]
    fn identity_sees_through_dot_dot_symlinks_and_hard_links() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a.bin");
        fs::write(&a, b"a").unwrap();
        fs::create_dir(d.path().join("sub")).unwrap();
        assert_eq!(same_file(&a, &a), Some(Same::Path));
        let dot = d.path().join(".").join("a.bin");
        assert_eq!(same_file(&dot, &a), Some(Same::Path));
        let dotdot = d.path().join("sub/../a.bin");
        assert_eq!(same_file(&dotdot, &a), Some(Same::OtherPath));
        let hard = d.path().join("hard.bin");
        fs::hard_link(&a, &hard).unwrap();
        #[cfg(unix)]
        {
            assert_eq!(same_file(&hard, &a), Some(Same::HardLink));
            let link = d.path().join("link.bin");
            std::os::unix::fs::symlink(&a, &link).unwrap();
            assert_eq!(same_file(&link, &a), Some(Same::Symlink));
            // A symlinked directory on the way.
            let sdir = d.path().join("sdir");
            std::os::unix::fs::symlink(d.path(), &sdir).unwrap();
            assert_eq!(same_file(&sdir.join("a.bin"), &a), Some(Same::OtherPath));
        }
        // A copy is another file; a file that does not exist yet is compared by its path.
        #[cfg(unix)]
        {
            // A symlink to a file not written yet.
            let dangling = d.path().join("dangling.svg");
            std::os::unix::fs::symlink("later.svg", &dangling).unwrap();
            assert_eq!(
                same_file(&dangling, &d.path().join("later.svg")),
                Some(Same::Symlink)
            );
        }
        let copy = d.path().join("copy.bin");
        fs::write(&copy, b"a").unwrap();
        assert_eq!(same_file(&copy, &a), None);
        let new = d.path().join("new.bin");
        assert_eq!(
            same_file(&new, &d.path().join("sub/../new.bin")),
            Some(Same::OtherPath)
        );
        assert_eq!(same_file(&new, &a), None);
        assert_eq!(same_file(&d.path().join("no/such/x"), &a), None);
    }

    #[test]
    fn an_output_that_is_an_input_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let m = d.path().join("m.gguf");
        fs::write(&m, b"model").unwrap();
        let mut g = Guard::new();
        g.input("the input model", &m)
            .output_or_stdout("--json", Some(&m));
        let e = err(&g);
        assert!(
            e.starts_with("output: --json ")
                && e.contains("is the input model")
                && e.ends_with("refusing to overwrite an input"),
            "{e}"
        );
        assert_eq!(fs::read(&m).unwrap(), b"model");
        // Another output is fine, and stdout is never a file.
        let mut g = Guard::new();
        g.input("the input model", &m)
            .output_or_stdout("--json", Some(&d.path().join("out.json")))
            .output_or_stdout("--jsonl", Some(Path::new("-")));
        g.check().unwrap();
        assert_eq!(
            fs::read_dir(d.path()).unwrap().count(),
            1,
            "the probe stays"
        );
    }

    #[test]
    fn two_outputs_that_are_one_file_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("p.svg");
        let mut g = Guard::new();
        g.output_or_stdout("--json", Some(&p))
            .output("--plot", Some(&p));
        let e = err(&g);
        assert!(
            e.contains("--json") && e.contains("--plot") && e.contains("same file"),
            "{e}"
        );
        // Both to stdout is not two files.
        let mut g = Guard::new();
        g.output_or_stdout("--json", Some(Path::new("-")))
            .output_or_stdout("--jsonl", Some(Path::new("-")));
        g.check().unwrap();
    }

    /// `.`, `./`, `..` and `/` as a directory output say which directory that is and why it
    /// is refused (it would be replaced whole), not that it is no file path.
    #[test]
    fn a_directory_output_of_dot_or_dot_dot_is_refused_with_the_reason() {
        for (p, which) in [
            (".", "the current directory"),
            ("./", "the current directory"),
            ("..", "a parent directory"),
            ("../..", "a parent directory"),
            ("/", "the root directory"),
        ] {
            let mut g = Guard::new();
            g.output_dir("--repro", Some(Path::new(p)));
            let e = err(&g);
            assert!(
                e.starts_with(&format!("output: --repro {p} is {which}; --repro replaces its directory whole, so give a new directory")),
                "{p}: {e}"
            );
        }
    }

    #[test]
    fn a_directory_output_may_hold_no_input_and_no_other_output() {
        let d = tempfile::tempdir().unwrap();
        let case = d.path().join("case");
        fs::create_dir(&case).unwrap();
        let m = case.join("weights.gguf");
        fs::write(&m, b"w").unwrap();
        let mut g = Guard::new();
        g.input("the input model", &m)
            .output_dir("--repro", Some(&case));
        let e = err(&g);
        assert!(
            e.contains("would replace the directory holding the input model"),
            "{e}"
        );
        let mut g = Guard::new();
        g.output_dir("--repro", Some(&case))
            .output_or_stdout("--json", Some(&case.join("r.json")));
        let e = err(&g);
        assert!(e.contains("is inside --repro"), "{e}");
        let mut g = Guard::new();
        g.output_dir("--repro", Some(&d.path().join("other")))
            .input("the input model", &m);
        g.check().unwrap();
    }

    #[test]
    fn bad_output_places_are_refused_before_work() {
        let d = tempfile::tempdir().unwrap();
        let mut g = Guard::new();
        g.output("--out", Some(&d.path().join("no/such/x.npy")));
        let e = err(&g);
        assert!(e.contains("no/such") && e.contains("does not exist"), "{e}");
        let mut g = Guard::new();
        g.output_or_stdout("--json", Some(d.path()));
        assert!(err(&g).contains("is a directory"));
        let mut g = Guard::new();
        g.output("--out", Some(Path::new("-")));
        assert!(err(&g).contains("only --json and --jsonl"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let ro = d.path().join("ro");
            fs::create_dir(&ro).unwrap();
            fs::set_permissions(&ro, fs::Permissions::from_mode(0o555)).unwrap();
            // Root ignores directory permissions: only check when the directory is really
            // read-only to us.
            if fs::write(ro.join("t"), b"t").is_err() {
                let mut g = Guard::new();
                g.output_or_stdout("--json", Some(&ro.join("out.json")));
                let e = err(&g);
                assert!(e.contains("ro/out.json: cannot create a file in"), "{e}");
                assert!(!e.contains(".tmp-"), "{e}");
            }
            fs::set_permissions(&ro, fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
}
