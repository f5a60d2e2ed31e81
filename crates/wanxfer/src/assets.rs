//! `wanxfer generate-assets --out DIR`: man pages and shell completions for packagers,
//! rendered from the same clap definition that parses the command line, so they cannot
//! drift from the flags.
//!
//! It is not one of [`Cli`]'s subcommands: clap's completion generators list hidden
//! subcommands too, so a hidden one would be offered to every user who presses Tab.
//! `main` hands it the command line before clap sees it, and [`Cli`] stays exactly the
//! public interface the man pages and completions describe.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser};
use clap_complete::Shell;

use crate::args::Cli;

/// The name `main` recognises as the first argument.
pub const SUBCOMMAND: &str = "generate-assets";

#[derive(Debug, Parser)]
#[command(
    name = "wanxfer generate-assets",
    about = "Write wanxfer's man pages (DIR/man) and bash, zsh and fish completions \
             (DIR/completions)."
)]
struct GenerateArgs {
    /// The directory to write into (created if missing).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

/// Runs `wanxfer generate-assets ARGS` (`argv` without the program name).
pub fn main(argv: Vec<OsString>) -> Result<(), String> {
    let args = GenerateArgs::try_parse_from(argv).unwrap_or_else(|e| e.exit());
    for path in generate(&args.out)? {
        println!("{}", path.display());
    }
    Ok(())
}

/// Writes every asset under `out`; the files written.
pub fn generate(out: &Path) -> Result<Vec<PathBuf>, String> {
    let io = |what: &Path, e: std::io::Error| format!("{}: {e}", what.display());
    let man = out.join("man");
    let completions = out.join("completions");
    for dir in [&man, &completions] {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    clap_mangen::generate_to(Cli::command(), &man).map_err(|e| io(&man, e))?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut Cli::command(), "wanxfer", &completions)
            .map_err(|e| io(&completions, e))?;
    }
    let mut written = Vec::new();
    for dir in [&man, &completions] {
        for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
            written.push(entry.map_err(|e| io(dir, e))?.path());
        }
    }
    written.sort();
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each man page names every flag of its command, read off the clap definition, so a
    /// flag added later is checked too; and each completion offers every subcommand.
    #[test]
    fn man_pages_and_completions_cover_every_flag() {
        let dir = tempfile::tempdir().unwrap();
        generate(dir.path()).unwrap();
        let mut cli = Cli::command();
        cli.build();
        let mut pages = vec![("wanxfer".to_string(), &cli)];
        for sub in cli.get_subcommands().filter(|s| s.get_name() != "help") {
            pages.push((format!("wanxfer-{}", sub.get_name()), sub));
        }
        for (page, cmd) in &pages {
            let path = dir.path().join("man").join(format!("{page}.1"));
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{page}: {e}"));
            // roff escapes the dashes of flags: `\-\-max\-sessions`.
            let text = text.replace("\\-", "-");
            assert!(
                text.starts_with(".ie") || text.contains(".TH"),
                "{page} is roff"
            );
            for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
                if let Some(long) = arg.get_long() {
                    assert!(text.contains(&format!("--{long}")), "{page} lacks --{long}");
                }
            }
        }
        let names: Vec<String> = std::fs::read_dir(dir.path().join("man"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), pages.len(), "one page per command: {names:?}");

        for file in ["wanxfer.bash", "_wanxfer", "wanxfer.fish"] {
            let text = std::fs::read_to_string(dir.path().join("completions").join(file)).unwrap();
            for sub in ["serve", "cp", "bench"] {
                assert!(text.contains(sub), "{file} lacks {sub}");
            }
            assert!(
                text.contains("max-session-memory"),
                "{file} lacks serve's flags"
            );
            assert!(!text.contains(SUBCOMMAND), "{file} offers {SUBCOMMAND}");
        }
    }
}
