//! `flashattn`: forward, backward, decode, plan, demo, bench. Errors are one line on
//! stderr and a non-zero exit; no output file is left behind by a failed run.

use clap::Parser;
use flashattn_cli::args::Cli;
use flashattn_cli::commands;
use flashattn_cli::error::one_line;

fn main() {
    // Mesa's drivers complain on stderr when this is unset; the message is noise.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    let args = match Cli::try_parse() {
        Ok(a) => a,
        Err(e) => exit_on_usage(e),
    };
    if let Err(e) = commands::run(args.command) {
        eprintln!("error: {}", one_line(&e));
        std::process::exit(1);
    }
}

/// Help and version go to stdout (exit 0); a bad command line is clap's
/// first line on stderr (exit 2), without its usage block.
fn exit_on_usage(e: clap::Error) -> ! {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            std::process::exit(0);
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            std::process::exit(2);
        }
        _ => {
            let text = e.render().to_string();
            let lines: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:"))
                .filter(|l| !l.is_empty())
                .collect();
            // A missing flag, or the flags a flag conflicts with (more
            // than one), are named on the lines after the first.
            let line = match e.kind() {
                ErrorKind::MissingRequiredArgument | ErrorKind::ArgumentConflict => lines.join(" "),
                _ => lines.first().copied().unwrap_or("invalid arguments").into(),
            };
            eprintln!("{line}");
            std::process::exit(2);
        }
    }
}
