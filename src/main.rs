//! `flashattn`: forward, plan, demo. Errors are one line on stderr and a
//! non-zero exit; no output file is left behind by a failed run.

mod cli;

use clap::Parser;
use cli::args::Cli;

fn main() {
    // Mesa's drivers complain on stderr when this is unset; the message is noise.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    let args = match Cli::try_parse() {
        Ok(a) => a,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                std::process::exit(
                    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                        2
                    } else {
                        0
                    },
                );
            }
            // One line: clap's first line names the problem; its usage block is noise here.
            let text = e.render().to_string();
            let first = text
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("invalid arguments");
            eprintln!("{}", first.trim());
            std::process::exit(2);
        }
    };
    if let Err(e) = cli::run(args.command) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
