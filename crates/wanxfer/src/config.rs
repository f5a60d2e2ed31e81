//! `wanxfer serve --config FILE`: a TOML file whose keys are `serve`'s long flags.
//!
//! The keys are not a second list of settings: they are read off clap's definition of
//! `serve`, and each value goes through that flag's own value parser. So a flag added to
//! `ServeArgs` is a key with no code here, a value in the file is refused for exactly the
//! reasons it would be refused on the command line, and `--help` and the man page document
//! both. The file's settings become arguments (`--max-sessions=16`) added to the command
//! line for the flags the command line (or the environment) did not give, which is how
//! the command line wins, and the result is parsed by clap once more as a whole.
//!
//! Two keys are not flags, because a flag cannot say them: `[[export]]` and `[[issuer]]`,
//! arrays of tables (each export a name, a directory and who may read and write; each
//! issuer a URL and the file of its public keys). They are read apart, by
//! [`auth_tables`], checked here with the rest (so `--check-config` names their
//! problems too), and never become arguments.
//!
//! What this does not do: paths in the file are taken as on the command line (relative
//! to the working directory, not to the file), and the file is read once, at start; a
//! changed file takes a restart.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, CommandFactory};

use crate::args::Cli;
use wanxfer_engine::auth::{ExportConfig, Grant, IssuerConfig};
use wanxfer_engine::ops::edit_distance;

/// Flags of `serve` that only make sense on the command line.
const NOT_KEYS: [&str; 2] = ["config", "check-config"];

/// Keys that hold tables rather than a flag's value.
const TABLE_KEYS: [&str; 2] = ["export", "issuer"];

/// The `[[export]]` and `[[issuer]]` tables of a configuration file.
#[derive(Debug, Default)]
pub struct AuthTables {
    pub exports: Vec<ExportConfig>,
    pub issuers: Vec<IssuerConfig>,
}

/// The tables of `file` (already checked by [`parse`], which read it first).
pub fn auth_tables(file: &Path) -> Result<AuthTables, wanxfer_engine::Error> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| wanxfer_engine::Error::local("reading", file.display(), e))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        wanxfer_engine::Error::Usage(format!("{}: not valid TOML: {e}", file.display()))
    })?;
    tables(&table).map_err(|problems| {
        wanxfer_engine::Error::Usage(
            problems
                .iter()
                .map(|p| format!("{}: {p}", file.display()))
                .collect::<Vec<_>>()
                .join("\n"),
        )
    })
}

/// Reads the tables, or says what is wrong with each.
fn tables(table: &toml::Table) -> Result<AuthTables, Vec<String>> {
    let mut out = AuthTables::default();
    let mut problems = Vec::new();
    let list = |key: &str, problems: &mut Vec<String>| -> Vec<toml::Table> {
        match table.get(key) {
            None => Vec::new(),
            Some(toml::Value::Array(items)) => items
                .iter()
                .filter_map(|item| match item {
                    toml::Value::Table(t) => Some(t.clone()),
                    other => {
                        problems.push(format!("[[{key}]]: expected a table, not {}", kind(other)));
                        None
                    }
                })
                .collect(),
            Some(other) => {
                problems.push(format!(
                    "`{key}`: expected [[{key}]] tables, not {}",
                    kind(other)
                ));
                Vec::new()
            }
        }
    };
    for (i, t) in list("export", &mut problems).iter().enumerate() {
        let at = format!("[[export]] #{}", i + 1);
        check_fields(t, &at, &["name", "path", "read", "write"], &mut problems);
        let name = string_field(t, "name", &at, &mut problems);
        let path = string_field(t, "path", &at, &mut problems);
        let read = grants_field(t, "read", &at, &mut problems);
        let write = grants_field(t, "write", &at, &mut problems);
        if let (Some(name), Some(path)) = (name, path) {
            out.exports.push(ExportConfig {
                name,
                path: PathBuf::from(path),
                read,
                write,
            });
        }
    }
    for (i, t) in list("issuer", &mut problems).iter().enumerate() {
        let at = format!("[[issuer]] #{}", i + 1);
        check_fields(t, &at, &["issuer", "jwks"], &mut problems);
        let issuer = string_field(t, "issuer", &at, &mut problems);
        let jwks = string_field(t, "jwks", &at, &mut problems);
        if let (Some(issuer), Some(jwks)) = (issuer, jwks) {
            out.issuers.push(IssuerConfig {
                issuer,
                jwks: PathBuf::from(jwks),
            });
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

fn check_fields(t: &toml::Table, at: &str, known: &[&str], problems: &mut Vec<String>) {
    for key in t.keys() {
        if !known.contains(&key.as_str()) {
            problems.push(format!(
                "{at}: unknown key `{key}` (known: {})",
                known.join(", ")
            ));
        }
    }
}

fn string_field(
    t: &toml::Table,
    key: &str,
    at: &str,
    problems: &mut Vec<String>,
) -> Option<String> {
    match t.get(key) {
        Some(toml::Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(other) => {
            problems.push(format!(
                "{at}: `{key}` must be a non-empty string, not {}",
                kind(other)
            ));
            None
        }
        None => {
            problems.push(format!("{at}: `{key}` is missing"));
            None
        }
    }
}

/// An export's `read` or `write` list; missing means nobody.
fn grants_field(t: &toml::Table, key: &str, at: &str, problems: &mut Vec<String>) -> Vec<Grant> {
    let Some(value) = t.get(key) else {
        return Vec::new();
    };
    let toml::Value::Array(items) = value else {
        problems.push(format!(
            "{at}: `{key}` must be an array of identities, not {}",
            kind(value)
        ));
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| match item {
            toml::Value::String(text) => match Grant::parse(text) {
                Ok(g) => Some(g),
                Err(why) => {
                    problems.push(format!("{at}: `{key}`: {why}"));
                    None
                }
            },
            other => {
                problems.push(format!(
                    "{at}: `{key}`: expected a string, not {}",
                    kind(other)
                ));
                None
            }
        })
        .collect()
}

/// Why the command line could not be turned into a [`Cli`].
#[derive(Debug)]
pub enum ParseFailure {
    /// clap's own errors, `--help` and `--version` included: `exit()` prints and exits.
    Clap(clap::Error),
    /// The configuration file: one line per problem, each naming the file and the key.
    Config(Vec<String>),
}

/// Parses the command line, with `serve --config FILE` merged in.
pub fn parse(argv: Vec<OsString>) -> Result<Cli, ParseFailure> {
    let matches = merged_matches(argv)?;
    let mut cli =
        <Cli as clap::FromArgMatches>::from_arg_matches(&matches).map_err(ParseFailure::Clap)?;
    if let (crate::args::Command::Cp(cp), Some(("cp", m))) =
        (&mut cli.command, matches.subcommand())
    {
        cp.rules = crate::args::ordered_rules(m);
    }
    Ok(cli)
}

fn merged_matches(mut argv: Vec<OsString>) -> Result<ArgMatches, ParseFailure> {
    let cmd = Cli::command();
    let matches = cmd
        .clone()
        .try_get_matches_from(&argv)
        .map_err(ParseFailure::Clap)?;
    let Some(("serve", serve)) = matches.subcommand() else {
        return Ok(matches);
    };
    let Some(file) = serve.get_one::<PathBuf>("config") else {
        return Ok(matches);
    };
    let settings = read(file).map_err(ParseFailure::Config)?;
    // `serve` takes no positional arguments, so flags appended after the user's land in
    // `serve` whatever the user wrote before them.
    argv.extend(
        settings
            .into_iter()
            .filter(|s| !given(serve, &s.id))
            .flat_map(|s| s.args),
    );
    cmd.try_get_matches_from(argv).map_err(ParseFailure::Clap)
}

/// Whether the command line or the environment set this flag (so the file must not).
fn given(matches: &ArgMatches, id: &str) -> bool {
    matches!(
        matches.value_source(id),
        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
    )
}

/// Checks a file as `serve --config` reads it; the number of settings in it.
pub fn check(file: &Path) -> Result<usize, Vec<String>> {
    read(file).map(|settings| settings.len())
}

/// One key of the file, as arguments for its flag.
struct Setting {
    id: String,
    args: Vec<OsString>,
}

/// Every setting of the file, each checked by its flag's own parser; or every problem.
fn read(file: &Path) -> Result<Vec<Setting>, Vec<String>> {
    let at = |problem: String| vec![format!("{}: {problem}", file.display())];
    let text = std::fs::read_to_string(file).map_err(|e| at(e.to_string()))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        at(format!("not valid TOML: {}", e.to_string().trim_end()))
    })?;

    let mut cli = Cli::command();
    cli.build();
    let serve = cli
        .find_subcommand("serve")
        .expect("wanxfer has a serve command");
    let keys: Vec<&Arg> = serve
        .get_arguments()
        .filter(|a| a.get_long().is_some_and(|l| !NOT_KEYS.contains(&l)))
        .filter(|a| {
            !matches!(
                a.get_action(),
                ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
            )
        })
        .collect();

    let mut settings = Vec::new();
    let mut problems = Vec::new();
    let mut seen: HashMap<&str, &str> = HashMap::new();
    if let Err(more) = tables(&table) {
        problems.extend(more);
    }
    for (key, value) in &table {
        if TABLE_KEYS.contains(&key.as_str()) {
            continue;
        }
        let long = key.replace('_', "-");
        let Some(arg) = keys.iter().find(|a| a.get_long() == Some(long.as_str())) else {
            problems.push(unknown_key(key, &long, &keys));
            continue;
        };
        let id = arg.get_id().as_str();
        if let Some(first) = seen.insert(id, key) {
            problems.push(format!("key `{key}`: set twice (also as `{first}`)"));
            continue;
        }
        match arguments(serve, arg, value) {
            Ok(args) => settings.push(Setting {
                id: id.to_string(),
                args,
            }),
            Err(why) => problems.push(format!("key `{key}`: {why}")),
        }
    }
    if problems.is_empty() {
        Ok(settings)
    } else {
        Err(problems
            .into_iter()
            .map(|p| format!("{}: {p}", file.display()))
            .collect())
    }
}

fn unknown_key(key: &str, long: &str, keys: &[&Arg]) -> String {
    if NOT_KEYS.contains(&long) {
        return format!("key `{key}`: only a command-line flag, not a setting");
    }
    let closest = keys
        .iter()
        .filter_map(|a| a.get_long())
        .map(|l| (edit_distance(long.as_bytes(), l.as_bytes()), l))
        .min();
    match closest {
        Some((distance, near)) if distance <= 3 => {
            format!("unknown key `{key}`: did you mean `{near}`?")
        }
        _ => format!("unknown key `{key}`: not a flag of `wanxfer serve` (see its --help)"),
    }
}

/// The arguments that give `arg` this value, each value checked by the flag's parser.
fn arguments(
    serve: &clap::Command,
    arg: &Arg,
    value: &toml::Value,
) -> Result<Vec<OsString>, String> {
    let long = arg.get_long().expect("keys are long flags");
    let flag = OsString::from(format!("--{long}"));
    match arg.get_action() {
        ArgAction::SetTrue | ArgAction::SetFalse => {
            let toml::Value::Boolean(on) = value else {
                return Err(format!("expected true or false, not {}", kind(value)));
            };
            let wanted = matches!(arg.get_action(), ArgAction::SetTrue);
            Ok(if *on == wanted { vec![flag] } else { vec![] })
        }
        ArgAction::Count => match value {
            toml::Value::Integer(n) if (0..=255).contains(n) => Ok(vec![flag; *n as usize]),
            other => Err(format!("expected a count (0-255), not {}", kind(other))),
        },
        ArgAction::Set | ArgAction::Append => {
            let many = matches!(arg.get_action(), ArgAction::Append)
                || arg.get_num_args().is_some_and(|n| n.max_values() > 1);
            let items: Vec<&toml::Value> = match value {
                toml::Value::Array(items) if many => items.iter().collect(),
                toml::Value::Array(_) => {
                    return Err(format!("expected {}, not an array", expected(arg)))
                }
                single => vec![single],
            };
            let texts = items
                .into_iter()
                .map(|item| scalar_text(arg, item))
                .collect::<Result<Vec<_>, _>>()?;
            let args: Vec<OsString> = match arg.get_action() {
                ArgAction::Append => texts
                    .iter()
                    .map(|t| format!("--{long}={t}").into())
                    .collect(),
                _ if texts.len() == 1 => vec![format!("--{long}={}", texts[0]).into()],
                _ => std::iter::once(flag)
                    .chain(texts.iter().map(OsString::from))
                    .collect(),
            };
            // The flag's own parser, reached the only way clap offers: a parse of `serve`
            // with this one flag.
            serve
                .clone()
                .try_get_matches_from(std::iter::once(OsString::from("serve")).chain(args.clone()))
                .map_err(|e| refusal(&e))?;
            Ok(args)
        }
        _ => Err("cannot be set from a file".into()),
    }
}

/// Whether the flag takes free text (a path, a name), where only a TOML string makes sense:
/// `root = 5` is more likely a mistake than a directory named 5.
fn takes_text(arg: &Arg) -> bool {
    use clap::builder::{ValueParser, ValueParserFactory};
    let id = arg.get_value_parser().type_id();
    [
        ValueParser::string().type_id(),
        ValueParser::os_string().type_id(),
        ValueParser::path_buf().type_id(),
        <PathBuf as ValueParserFactory>::value_parser().type_id(),
    ]
    .contains(&id)
}

fn takes_bool(arg: &Arg) -> bool {
    arg.get_value_parser().type_id() == clap::builder::ValueParser::bool().type_id()
}

fn is_choice(arg: &Arg) -> bool {
    !arg.get_possible_values().is_empty() && !takes_bool(arg)
}

/// A TOML scalar as the text the flag would get on the command line.
fn scalar_text(arg: &Arg, value: &toml::Value) -> Result<String, String> {
    let text_only = takes_text(arg) || is_choice(arg);
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) if !text_only => Ok(i.to_string()),
        toml::Value::Float(f) if !text_only => Ok(f.to_string()),
        toml::Value::Boolean(b) if takes_bool(arg) => Ok(b.to_string()),
        other => Err(format!("expected {}, not {}", expected(arg), kind(other))),
    }
}

fn expected(arg: &Arg) -> String {
    if is_choice(arg) {
        let names: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| format!("\"{}\"", v.get_name()))
            .collect();
        format!("a string, one of {}", names.join(", "))
    } else if takes_bool(arg) {
        "true or false".into()
    } else if takes_text(arg) {
        "a string".into()
    } else {
        "a number or a string".into()
    }
}

fn kind(value: &toml::Value) -> &'static str {
    match value {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a float",
        toml::Value::Boolean(_) => "a boolean",
        toml::Value::Datetime(_) => "a date",
        toml::Value::Array(_) => "an array",
        toml::Value::Table(_) => "a table",
    }
}

/// The flag parser's reason for refusing a value, without clap's framing (which names a
/// command-line flag and suggests --help).
fn refusal(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    let value = match e.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(v)) => format!("{v:?}"),
        _ => "the value".into(),
    };
    if let Some(source) = std::error::Error::source(e) {
        return format!("{value}: {source}");
    }
    if let Some(ContextValue::Strings(valid)) = e.get(ContextKind::ValidValue) {
        return format!("{value} is not one of {}", valid.join(", "));
    }
    let text = e.to_string();
    let first = text.lines().next().unwrap_or_default();
    first.strip_prefix("error: ").unwrap_or(first).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::Command;

    fn file_with(text: &str) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        file
    }

    fn argv(args: &[&str]) -> Vec<OsString> {
        std::iter::once("wanxfer")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect()
    }

    fn serve_args(args: &[&str]) -> crate::args::ServeArgs {
        match parse(argv(args)) {
            Ok(Cli {
                command: Command::Serve(serve),
            }) => serve,
            Ok(other) => panic!("not serve: {other:?}"),
            Err(e) => panic!("{args:?}: {e:?}"),
        }
    }

    fn problems(text: &str) -> Vec<String> {
        let file = file_with(text);
        check(file.path()).expect_err("the file is refused")
    }

    /// A value each serve flag accepts, found from its definition alone.
    fn sample(arg: &Arg) -> toml::Value {
        match arg.get_action() {
            ArgAction::SetTrue | ArgAction::SetFalse => return toml::Value::Boolean(true),
            ArgAction::Count => return toml::Value::Integer(1),
            _ => {}
        }
        let text = if let Some(default) = arg.get_default_values().first() {
            default.to_string_lossy().into_owned()
        } else if let Some(choice) = arg.get_possible_values().first() {
            choice.get_name().to_string()
        } else if arg
            .get_value_names()
            .is_some_and(|names| names.iter().any(|n| n.as_str() == "HOST:PORT"))
        {
            "127.0.0.1:0".to_string()
        } else {
            "/srv/sample".to_string()
        };
        // Numbers as TOML integers, the way a person writes them.
        match text.parse::<i64>() {
            Ok(n) if !takes_text(arg) && !is_choice(arg) => toml::Value::Integer(n),
            _ => toml::Value::String(text),
        }
    }

    /// Every flag of `serve` is a key: the test names none of them, so a flag added later
    /// is covered with no change here. Every other key is written with underscores.
    #[test]
    fn every_serve_flag_is_a_key() {
        let mut cli = Cli::command();
        cli.build();
        let serve = cli.find_subcommand("serve").unwrap();
        let mut table = toml::Table::new();
        let mut ids = Vec::new();
        for (i, arg) in serve
            .get_arguments()
            .filter(|a| a.get_long().is_some_and(|l| !NOT_KEYS.contains(&l)))
            .filter(|a| !matches!(a.get_action(), ArgAction::Help | ArgAction::Version))
            .enumerate()
        {
            let long = arg.get_long().unwrap();
            let key = if i % 2 == 0 {
                long.to_string()
            } else {
                long.replace('-', "_")
            };
            table.insert(key, sample(arg));
            ids.push(arg.get_id().as_str().to_string());
        }
        assert!(ids.len() >= 15, "serve has its flags: {ids:?}");
        let file = file_with(&toml::to_string(&table).unwrap());
        assert_eq!(check(file.path()), Ok(ids.len()));

        let path = file.path().to_str().unwrap();
        let matches = merged_matches(argv(&["serve", "--config", path])).unwrap();
        let (_, serve_matches) = matches.subcommand().unwrap();
        for id in &ids {
            assert_eq!(
                serve_matches.value_source(id),
                Some(ValueSource::CommandLine),
                "{id} was not taken from the file"
            );
        }
        serve_args(&["serve", "--config", path]);
    }

    #[test]
    fn file_settings_take_effect_and_the_command_line_wins() {
        let file = file_with(
            r#"
            root = "/srv/data"
            listen = "127.0.0.1:7900"
            max_sessions = 3
            max-session-memory = "64MiB"
            io = "copy"
            transport = "fabric"
            provider = "verbs"
            log-format = "json"
            "#,
        );
        let path = file.path().to_str().unwrap();
        let args = serve_args(&[
            "serve",
            "--config",
            path,
            "--listen",
            "[::1]:7901",
            "--io=sendfile",
        ]);
        assert_eq!(args.root.as_deref(), Some(Path::new("/srv/data")));
        assert_eq!(args.listen, "[::1]:7901");
        let limits = args.limits(Path::new("/srv/data"));
        assert_eq!(limits.max_sessions, 3);
        assert_eq!(limits.max_session_memory, 64 << 20);
        assert_eq!(limits.io, wanxfer_engine::source::IoMode::Sendfile);
        assert_eq!(limits.fabric_provider.as_deref(), Some("verbs"));
        assert_eq!(args.log.log_format, crate::args::LogFormat::Json);
    }

    #[test]
    fn the_root_may_come_from_either_place_but_must_come() {
        let empty = file_with("max-sessions = 2\n");
        let path = empty.path().to_str().unwrap();
        let err = serve_args(&["serve", "--config", path]).root().unwrap_err();
        assert!(err.to_string().contains(path), "{err}");
        let args = serve_args(&["serve", "--config", path, "--root", "/x"]);
        assert_eq!(args.root().unwrap(), Path::new("/x"));
    }

    #[test]
    fn bad_keys_are_named_with_the_reason() {
        let found = problems(
            r#"
            max-sesions = 4
            max-sessions = "many"
            root = 5
            io = "fast"
            write = 1
            streams = 4
            listen = "7803"
            max-block-size = "1K"
            stall-timeout = [1, 2]
            provider = { name = "verbs" }
            config = "/etc/other.toml"
            "#,
        );
        let expect = [
            "unknown key `max-sesions`: did you mean `max-sessions`?",
            "key `max-sessions`: \"many\": invalid digit",
            "key `root`: expected a string, not an integer",
            "key `io`: \"fast\" is not one of auto, copy, sendfile, zerocopy",
            "key `write`: expected a string, one of \"auto\", \"buffered\", \"direct\", not an integer",
            "unknown key `streams`",
            "key `listen`: \"7803\": \"7803\" is only a port",
            "key `max-block-size`: \"1K\": block size must be between",
            "key `stall-timeout`: expected a number or a string, not an array",
            "key `provider`: expected a string, not a table",
            "key `config`: only a command-line flag",
        ];
        assert_eq!(found.len(), expect.len(), "{found:#?}");
        for needle in expect {
            assert!(
                found.iter().any(|p| p.contains(needle)),
                "no problem says {needle:?}: {found:#?}"
            );
        }
    }

    #[test]
    fn a_key_spelled_both_ways_or_broken_toml_is_refused() {
        let both = problems("max-sessions = 2\nmax_sessions = 3\n");
        assert!(both[0].contains("set twice"), "{both:?}");
        let broken = problems("max-sessions = \n");
        assert!(
            broken[0].contains("not valid TOML") && broken[0].contains("line 1"),
            "{broken:?}"
        );
        let missing = check(Path::new("/nonexistent/wanxfer.toml")).unwrap_err();
        assert!(
            missing[0].contains("/nonexistent/wanxfer.toml"),
            "{missing:?}"
        );
    }

    /// The README's example is valid and shows every key, so it cannot fall behind a
    /// flag added later.
    #[test]
    fn the_readme_example_is_valid_and_shows_every_key() {
        let readme =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
                .unwrap();
        let (_, section) = readme
            .split_once("### Server configuration")
            .expect("the README's configuration section");
        let (_, rest) = section.split_once("```toml\n").expect("a TOML example");
        let (example, _) = rest.split_once("```").unwrap();
        let file = file_with(example);
        let settings = read(file.path()).unwrap_or_else(|p| panic!("{p:#?}"));
        let mut cli = Cli::command();
        cli.build();
        let serve = cli.find_subcommand("serve").unwrap();
        for arg in serve.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if NOT_KEYS.contains(&long) || matches!(arg.get_action(), ArgAction::Help) {
                continue;
            }
            let id = arg.get_id().as_str();
            assert!(
                settings.iter().any(|s| s.id == id),
                "the README's example lacks `{long}`"
            );
        }
    }

    /// The file the Debian package installs as /etc/wanxfer/wanxfer.toml.
    #[test]
    fn the_packaged_example_is_valid() {
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/wanxfer.toml");
        let keys = check(&example).unwrap_or_else(|p| panic!("{p:#?}"));
        assert!(keys >= 3, "root, listen and secret-file at least");
    }
}
